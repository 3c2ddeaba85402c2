//! One event's JSON data: what the gateway reads from it ([`summarize_event`], [`parse_event`]).

use crate::usage::{Usage, UsageCounts};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// What the gateway reads from one event's JSON data.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EventSummary {
    /// Number of `choices` (None when absent, null or not an array).
    pub choices: Option<u64>,
    /// A choice has a non-empty `delta.content` or `text`; or the event is an Anthropic
    /// `content_block_delta` whose `delta` has a non-empty `text`/`partial_json`/`thinking`; or a
    /// Responses `response.*.delta` with a non-empty string `delta`.
    pub content: bool,
    /// The top-level `usage` (the only one that can make an event usage-only, i.e. strippable).
    pub usage: Option<Usage>,
    /// Every count the event states: top-level `usage`, `message.usage` (Anthropic
    /// `message_start`) and `response.usage` (Responses), merged in document order.
    pub counts: UsageCounts,
}

/// Reads what the gateway needs from an event's data, parsing the JSON only when the event may
/// carry usage.
///
/// A cheap pass finds the keys `usage`, `choices`, `content`, `text`, `type`, `delta`,
/// `partial_json` and `thinking` (at any depth) by their colons: a `:` preceded by `"name"` (and
/// optional whitespace) is that key, since inside a JSON string the quotes around such a word would
/// have to be escaped. The data is parsed in full ([`parse_event`]) only when a `usage` key has an
/// object value (the only kind that yields usage, at whatever depth: `message.usage`,
/// `response.usage`) or a `content`/`text` key has an array value (content parts). Otherwise
/// (every content chunk, whose `usage` is absent or `null`) the event has no usage, its choice
/// count is not needed (stripping needs usage) and it carries content when it has a `choices`
/// key and a `content` or `text` key whose value is a non-empty string (OpenAI, vLLM), or a
/// `type` `content_block_delta` and a non-empty `text`/`partial_json`/`thinking` (Anthropic), or
/// a `type` `response.….delta` and a non-empty string `delta` (Responses).
///
/// For the chunk shapes of these APIs this gives the same answer as [`parse_event`]. It may
/// differ on malformed JSON (it only checks that the data starts with `{`), on keys or `type`
/// values written with escapes (`"\u0075sage"` is not recognised) and on these keys away from
/// where the APIs put them. The usage found is exact for all but escaped keys; `content_events`
/// is only an estimate of completion tokens, used when usage never arrives.
pub fn summarize_event(data: &[u8]) -> Option<EventSummary> {
    let keys = scan_keys(data)?;
    if keys.needs_parse {
        return parse_event(data);
    }
    let content = (keys.choices && keys.content)
        || (keys.anthropic_delta && (keys.content || keys.other_text))
        || (keys.responses_delta && keys.delta_text);
    Some(EventSummary {
        choices: None,
        content,
        usage: None,
        counts: UsageCounts::default(),
    })
}

/// What [`scan_keys`] found.
#[allow(clippy::struct_excessive_bools)] // independent keys one byte scan found
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Keys {
    /// A `usage` key with an object value, or a `content`/`text` key with an array value.
    needs_parse: bool,
    /// A `choices` key.
    choices: bool,
    /// A `content` or `text` key with a non-empty string value.
    content: bool,
    /// A `partial_json` or `thinking` key with a non-empty string value (Anthropic deltas).
    other_text: bool,
    /// A `delta` key with a non-empty string value (Responses deltas).
    delta_text: bool,
    /// A `type` key with the string value `content_block_delta`.
    anthropic_delta: bool,
    /// A `type` key with a string value `response.….delta`.
    responses_delta: bool,
}

/// The event types whose content the gateway counts, from the data's `type`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum EventType {
    #[default]
    Other,
    /// Anthropic `content_block_delta`.
    AnthropicContentDelta,
    /// OpenAI Responses `response.….delta` (`response.output_text.delta`, …).
    ResponsesDelta,
}

impl EventType {
    fn of(name: &[u8]) -> EventType {
        if name == b"content_block_delta" {
            EventType::AnthropicContentDelta
        } else if name.starts_with(b"response.") && name.ends_with(b".delta") {
            EventType::ResponsesDelta
        } else {
            EventType::Other
        }
    }
}

/// Whether the JSON string starting at `data[value]` (its opening quote) is non-empty.
fn non_empty_string_at(data: &[u8], value: usize) -> bool {
    data.get(value) == Some(&b'"')
        && !matches!(data.get(value.saturating_add(1)), None | Some(&b'"'))
}

fn is_json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Index of the first non-whitespace byte of `data` at or after `from`.
fn skip_ws(data: &[u8], from: usize) -> Option<usize> {
    let n = data.get(from..)?.iter().position(|&b| !is_json_ws(b))?;
    Some(from.saturating_add(n))
}

/// The keys of interest in `data`, found from its colons; `None` when `data` does not start with
/// `{` (not a JSON object).
fn scan_keys(data: &[u8]) -> Option<Keys> {
    let start = skip_ws(data, 0)?;
    if data.get(start) != Some(&b'{') {
        return None;
    }
    let mut keys = Keys::default();
    let base = start.saturating_add(1);
    // One iterator over the colons, not a search started again after each: in Envoy's V8 it
    // measured 517,820 instructions per 64-chunk stream against 527,070 (a search per colon)
    // and 543,487 (a word-at-a-time scan that was cheaper natively).
    for n in memchr::memchr_iter(b':', data.get(base..).unwrap_or_default()) {
        let colon = base.saturating_add(n);
        let from = colon.saturating_add(1);
        let mut before = data.get(..colon).unwrap_or_default();
        while let Some((&last, rest)) = before.split_last() {
            if !is_json_ws(last) {
                break;
            }
            before = rest;
        }
        let Some(name) = before.strip_suffix(b"\"") else {
            continue;
        };
        // By the name's last byte first: most keys (`id`, `model`, `index`…) end in none of
        // these, and each other is compared with the one or two names it could be.
        let key = match name.last() {
            Some(b'e') if name.ends_with(b"\"usage") => Key::Usage,
            Some(b'e') if name.ends_with(b"\"type") => Key::Type,
            Some(b't') if name.ends_with(b"\"content") || name.ends_with(b"\"text") => Key::Content,
            Some(b's') if name.ends_with(b"\"choices") => Key::Choices,
            Some(b'a') if name.ends_with(b"\"delta") => Key::Delta,
            Some(b'n') if name.ends_with(b"\"partial_json") => Key::OtherText,
            Some(b'g') if name.ends_with(b"\"thinking") => Key::OtherText,
            _ => continue,
        };
        let Some(value) = skip_ws(data, from) else {
            break;
        };
        let first = data.get(value).copied();
        match key {
            Key::Usage => keys.needs_parse |= first == Some(b'{'),
            Key::Choices => keys.choices = true,
            Key::Content => match first {
                Some(b'[') => keys.needs_parse = true,
                Some(b'"') => keys.content |= non_empty_string_at(data, value),
                _ => {}
            },
            Key::OtherText => keys.other_text |= non_empty_string_at(data, value),
            Key::Delta => keys.delta_text |= non_empty_string_at(data, value),
            Key::Type if first == Some(b'"') => {
                let start = value.saturating_add(1);
                let rest = data.get(start..).unwrap_or_default();
                if let Some(end) = find_byte(rest, b'"') {
                    match EventType::of(rest.get(..end).unwrap_or_default()) {
                        EventType::AnthropicContentDelta => keys.anthropic_delta = true,
                        EventType::ResponsesDelta => keys.responses_delta = true,
                        EventType::Other => {}
                    }
                }
            }
            Key::Type => {}
        }
    }
    Some(keys)
}

#[derive(Clone, Copy)]
enum Key {
    Usage,
    Choices,
    Content,
    Type,
    Delta,
    OtherText,
}

/// Index of the first byte of `hay` equal to `a` or `b`.
pub(super) fn find_either(hay: &[u8], a: u8, b: u8) -> Option<usize> {
    memchr::memchr2(a, b, hay)
}

pub(super) fn find_byte(hay: &[u8], needle: u8) -> Option<usize> {
    memchr::memchr(needle, hay)
}

/// Reads an event's data as a JSON object; `None` when it is not one.
pub fn parse_event(data: &[u8]) -> Option<EventSummary> {
    serde_json::from_slice::<EventSummary>(data).ok()
}

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum EventKey {
    Choices,
    Usage,
    Message,
    Response,
    Type,
    Delta,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for EventSummary {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(EventVisitor)
    }
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = EventSummary;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventSummary, A::Error> {
        let mut ev = EventSummary::default();
        let mut event_type = EventType::Other;
        let mut delta = DeltaValue::default();
        while let Some(key) = map.next_key::<EventKey>()? {
            match key {
                EventKey::Choices => {
                    let c = map.next_value::<Choices>()?;
                    ev.choices = c.count;
                    ev.content = c.content;
                }
                EventKey::Usage => {
                    let counts = map.next_value::<UsageCounts>()?;
                    ev.usage = counts.usage();
                    ev.counts.merge(&counts);
                }
                EventKey::Message | EventKey::Response => {
                    ev.counts.merge(&map.next_value::<NestedUsage>()?.0);
                }
                EventKey::Type => event_type = map.next_value::<TypeTag>()?.0,
                EventKey::Delta => delta = map.next_value::<DeltaValue>()?,
                EventKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        ev.content |= match event_type {
            EventType::AnthropicContentDelta => delta.object_text,
            EventType::ResponsesDelta => delta.string,
            EventType::Other => false,
        };
        Ok(ev)
    }
}

macro_rules! ignore_scalars {
    ($v:ty, $value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<$v, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<$v, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<$v, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<$v, E> {
            Ok($value)
        }
        fn visit_unit<E: de::Error>(self) -> Result<$v, E> {
            Ok($value)
        }
        fn visit_none<E: de::Error>(self) -> Result<$v, E> {
            Ok($value)
        }
    };
}

/// The `usage` inside an object (`message`, `response`); empty counts for anything else.
struct NestedUsage(UsageCounts);

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum NestedKey {
    Usage,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for NestedUsage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NestedUsageVisitor)
    }
}

struct NestedUsageVisitor;

impl<'de> Visitor<'de> for NestedUsageVisitor {
    type Value = NestedUsage;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NestedUsage, A::Error> {
        let mut counts = UsageCounts::default();
        while let Some(key) = map.next_key::<NestedKey>()? {
            match key {
                NestedKey::Usage => counts.merge(&map.next_value::<UsageCounts>()?),
                NestedKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(NestedUsage(counts))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NestedUsage, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(NestedUsage(UsageCounts::default()))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<NestedUsage, E> {
        Ok(NestedUsage(UsageCounts::default()))
    }

    ignore_scalars!(NestedUsage, NestedUsage(UsageCounts::default()));
}

/// The event's `type`, classified; `Other` for anything but a string.
struct TypeTag(EventType);

impl<'de> Deserialize<'de> for TypeTag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TypeTagVisitor)
    }
}

struct TypeTagVisitor;

impl<'de> Visitor<'de> for TypeTagVisitor {
    type Value = TypeTag;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a type")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<TypeTag, E> {
        Ok(TypeTag(EventType::of(v.as_bytes())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TypeTag, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TypeTag(EventType::Other))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TypeTag, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(TypeTag(EventType::Other))
    }

    ignore_scalars!(TypeTag, TypeTag(EventType::Other));
}

/// A top-level `delta`: a non-empty string (Responses), or an object with a non-empty `text`,
/// `partial_json` or `thinking` (Anthropic).
#[derive(Default)]
struct DeltaValue {
    string: bool,
    object_text: bool,
}

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum AnthropicDeltaKey {
    Text,
    PartialJson,
    Thinking,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for DeltaValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DeltaValueVisitor)
    }
}

struct DeltaValueVisitor;

impl<'de> Visitor<'de> for DeltaValueVisitor {
    type Value = DeltaValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a delta")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<DeltaValue, E> {
        Ok(DeltaValue {
            string: !v.is_empty(),
            object_text: false,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<DeltaValue, A::Error> {
        let mut object_text = false;
        while let Some(key) = map.next_key::<AnthropicDeltaKey>()? {
            match key {
                AnthropicDeltaKey::Text
                | AnthropicDeltaKey::PartialJson
                | AnthropicDeltaKey::Thinking => object_text |= map.next_value::<Content>()?.0,
                AnthropicDeltaKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(DeltaValue {
            string: false,
            object_text,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<DeltaValue, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(DeltaValue::default())
    }

    ignore_scalars!(DeltaValue, DeltaValue::default());
}

/// `choices`: how many, and whether any carries content. Tolerant of any JSON value.
struct Choices {
    count: Option<u64>,
    content: bool,
}

impl<'de> Deserialize<'de> for Choices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ChoicesVisitor)
    }
}

struct ChoicesVisitor;

impl<'de> Visitor<'de> for ChoicesVisitor {
    type Value = Choices;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("choices")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
        let mut count = 0u64;
        let mut content = false;
        while let Some(ChoiceFlag(c)) = seq.next_element::<ChoiceFlag>()? {
            count = count.saturating_add(1);
            content |= c;
        }
        Ok(Choices {
            count: Some(count),
            content,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Choices, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Choices {
            count: None,
            content: false,
        })
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Choices, E> {
        Ok(Choices {
            count: None,
            content: false,
        })
    }

    ignore_scalars!(
        Choices,
        Choices {
            count: None,
            content: false
        }
    );
}

/// One choice: does it carry a non-empty `delta.content` or `text`?
struct ChoiceFlag(bool);

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum ChoiceKey {
    Delta,
    Text,
    #[serde(other)]
    Other,
}

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum DeltaKey {
    Content,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for ChoiceFlag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ObjectFlagVisitor::Choice).map(ChoiceFlag)
    }
}

/// `delta`: does it carry a non-empty `content`?
struct DeltaFlag(bool);

impl<'de> Deserialize<'de> for DeltaFlag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ObjectFlagVisitor::Delta).map(DeltaFlag)
    }
}

/// Visits a choice or a delta object; any other value is `false`.
#[derive(Clone, Copy)]
enum ObjectFlagVisitor {
    Choice,
    Delta,
}

impl<'de> Visitor<'de> for ObjectFlagVisitor {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let mut found = false;
        match self {
            ObjectFlagVisitor::Choice => {
                while let Some(key) = map.next_key::<ChoiceKey>()? {
                    found |= match key {
                        ChoiceKey::Delta => map.next_value::<DeltaFlag>()?.0,
                        ChoiceKey::Text => map.next_value::<Content>()?.0,
                        ChoiceKey::Other => {
                            map.next_value::<IgnoredAny>()?;
                            false
                        }
                    };
                }
            }
            ObjectFlagVisitor::Delta => {
                while let Some(key) = map.next_key::<DeltaKey>()? {
                    found |= match key {
                        DeltaKey::Content => map.next_value::<Content>()?.0,
                        DeltaKey::Other => {
                            map.next_value::<IgnoredAny>()?;
                            false
                        }
                    };
                }
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<bool, E> {
        Ok(false)
    }

    ignore_scalars!(bool, false);
}

/// Content value: a non-empty string, or a non-empty array of parts, is content.
struct Content(bool);

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor)
    }
}

struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = Content;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("content")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
        Ok(Content(!v.is_empty()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
        let mut any = false;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            any = true;
        }
        Ok(Content(any))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Content, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Content(false))
    }

    ignore_scalars!(Content, Content(false));
}
