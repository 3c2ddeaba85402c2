//! Server-sent events (`text/event-stream`) scanning of streamed completions.
//!
//! [`SseScanner`] follows the WHATWG event-stream rules (lines end with LF, CRLF or CR; an event ends
//! at a blank line; `data:` lines of one event are joined with `\n`; lines starting with `:` are
//! comments) and, for every event, reads just what the gateway needs from its JSON data: `usage`,
//! whether `choices` is empty, whether a choice carries a non-empty content delta. Only events
//! that may carry usage (a `usage` key with an object value) are JSON-parsed; the others (every
//! content chunk) are read by a cheap byte scan ([`summarize_event`]).
//!
//! Memory per stream is bounded and does not grow with the stream: the partial line carried across
//! chunks ([`LINE_CAP`]), the current event's data ([`DATA_CAP`]) and, only when stripping, the raw
//! bytes of the current incomplete event ([`EVENT_CAP`]). The buffers are reused from event to event.
//!
//! Every decision depends on the bytes only, never on where the chunks were split: feeding a stream
//! in any number of pieces forwards the same bytes and finds the same usage as feeding it whole.

use crate::usage::{Usage, UsageField};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// Longest line (without its terminator) read; a longer line spoils its event (not parsed, never stripped).
pub const LINE_CAP: usize = 64 * 1024;
/// Most data bytes kept for one event; an event with more is not parsed and never stripped.
pub const DATA_CAP: usize = 64 * 1024;
/// Largest event (raw bytes) that may be held back to be stripped; a larger one is forwarded.
pub const EVENT_CAP: usize = 64 * 1024;

/// What happens to the LF that may follow a CR which ended an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterCr {
    /// The last byte was not a CR line terminator.
    No,
    /// A CR ended a line inside an event: a following LF is part of the event.
    InEvent,
    /// A CR ended an event that was forwarded: a following LF is forwarded too.
    Forwarded,
    /// A CR ended an event that was stripped: a following LF is stripped too.
    Stripped,
}

/// Scanner for one `text/event-stream` response body.
#[derive(Debug)]
pub struct SseScanner {
    strip: bool,
    /// Partial line carried over from the previous chunk.
    line: Vec<u8>,
    /// Length of the current line so far (it may exceed what `line` keeps).
    line_len: usize,
    after_cr: AfterCr,
    /// `data` of the current event, each line followed by `\n`.
    data: Vec<u8>,
    has_data: bool,
    /// The current event has a line or data too large to read.
    spoiled: bool,
    /// Raw bytes of the current event so far.
    event_len: usize,
    /// Strip mode: raw bytes of the current event held back from earlier chunks.
    held: Vec<u8>,
    /// Strip mode: the current event grew beyond [`EVENT_CAP`] and is forwarded as it comes.
    passthrough: bool,
    done: bool,
    usage: Option<Usage>,
    content_events: u64,
    events: u64,
    stripped_events: u64,
    max_buffered: usize,
}

impl SseScanner {
    pub fn new(strip_usage_only_event: bool) -> Self {
        SseScanner {
            strip: strip_usage_only_event,
            line: Vec::new(),
            line_len: 0,
            after_cr: AfterCr::No,
            data: Vec::new(),
            has_data: false,
            spoiled: false,
            event_len: 0,
            held: Vec::new(),
            passthrough: false,
            done: false,
            usage: None,
            content_events: 0,
            events: 0,
            stripped_events: 0,
            max_buffered: 0,
        }
    }

    /// Feeds one chunk of a text/event-stream body; returns what to forward now.
    ///
    /// When not stripping, it is always exactly `chunk` (borrowed) and scanning only observes.
    /// The result is `Cow::Borrowed` exactly when it is the whole chunk unchanged; `Cow::Owned`
    /// (possibly empty) means the chunk must be replaced by it.
    /// When stripping, the usage-only event (`choices: []` with `usage`) is removed; the bytes of the
    /// current incomplete event are held back (at most [`EVENT_CAP`]) until it completes.
    pub fn feed<'a>(&mut self, chunk: &'a [u8]) -> Cow<'a, [u8]> {
        let mut out = Out::new(chunk);
        // Start (in `chunk`) of the bytes of the current event not yet forwarded or held.
        let mut event_from = 0usize;
        let mut pos = 0usize;
        while pos < chunk.len() {
            let Some(rest) = chunk.get(pos..) else { break };
            if self.after_cr != AfterCr::No {
                let after = std::mem::replace(&mut self.after_cr, AfterCr::No);
                if rest.first() == Some(&b'\n') {
                    match after {
                        AfterCr::InEvent => self.event_len = self.event_len.saturating_add(1),
                        AfterCr::Forwarded => out.forward(pos, pos.saturating_add(1)),
                        AfterCr::Stripped | AfterCr::No => {}
                    }
                    pos = pos.saturating_add(1);
                    if after != AfterCr::InEvent {
                        event_from = pos;
                    }
                    continue;
                }
            }
            let Some(n) = find_either(rest, b'\n', b'\r') else {
                // Partial line: keep it for the next chunk.
                self.event_len = self.event_len.saturating_add(rest.len());
                self.partial_line(rest);
                break;
            };
            let Some(&term) = rest.get(n) else { break };
            let line_end = pos.saturating_add(n);
            let next = line_end.saturating_add(1);
            // Bytes of this line incl. its terminator (the LF of a CRLF is counted when seen).
            self.event_len = self.event_len.saturating_add(n).saturating_add(1);
            let ends_event = if self.line.is_empty() && self.line_len == 0 {
                self.line_len = n;
                let line = rest.get(..n).unwrap_or_default();
                self.process_line(line)
            } else {
                self.partial_line(rest.get(..n).unwrap_or_default());
                let line = std::mem::take(&mut self.line);
                let ends = self.process_line(&line);
                self.line = line;
                self.line.clear();
                ends
            };
            self.line_len = 0;
            pos = next;
            if ends_event {
                let strip = self.dispatch();
                if self.strip {
                    if strip {
                        self.held.clear();
                    } else {
                        if !self.held.is_empty() {
                            out.forward_bytes(&self.held);
                            self.held.clear();
                        }
                        out.forward(event_from, next);
                    }
                } else {
                    out.forward(event_from, next);
                }
                self.passthrough = false;
                self.event_len = 0;
                event_from = next;
                self.after_cr = match (term, strip) {
                    (b'\r', true) => AfterCr::Stripped,
                    (b'\r', false) => AfterCr::Forwarded,
                    _ => AfterCr::No,
                };
            } else if term == b'\r' {
                self.after_cr = AfterCr::InEvent;
            }
        }
        // The rest of the chunk belongs to the current, incomplete event.
        let tail = chunk.get(event_from..).unwrap_or_default();
        if !self.strip {
            out.forward(event_from, chunk.len());
        } else if !tail.is_empty() {
            if self.passthrough {
                out.forward(event_from, chunk.len());
            } else if self.held.len().saturating_add(tail.len()) > EVENT_CAP {
                // Too large to hold: give up stripping this event and forward it as it comes.
                out.forward_bytes(&self.held);
                self.held = Vec::new();
                out.forward(event_from, chunk.len());
                self.passthrough = true;
            } else {
                self.held.extend_from_slice(tail);
            }
        }
        self.note_buffered();
        out.finish()
    }

    /// End of stream: bytes still held (to forward now) and the usage seen, if any.
    ///
    /// An unterminated last event is read for usage too (but always forwarded).
    pub fn finish(&mut self) -> (Vec<u8>, Option<Usage>) {
        if self.line_len > 0 || !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.process_line(&line);
            self.line_len = 0;
        }
        if self.has_data {
            self.dispatch();
        }
        self.after_cr = AfterCr::No;
        self.passthrough = false;
        self.event_len = 0;
        (std::mem::take(&mut self.held), self.usage)
    }

    /// The last usage seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Number of events carrying a non-empty content delta (`choices[].delta.content` or
    /// `choices[].text`), to estimate completion tokens when usage never arrives. Exact for
    /// OpenAI/vLLM chunk shapes, an estimate otherwise (see [`summarize_event`]).
    pub fn content_events(&self) -> u64 {
        self.content_events
    }

    /// Whether `data: [DONE]` was seen.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Events dispatched (events with data) so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Usage-only events removed so far (strip mode).
    pub fn stripped_events(&self) -> u64 {
        self.stripped_events
    }

    /// Bytes buffered right now (partial line, event data, held event).
    pub fn buffered_bytes(&self) -> usize {
        self.line
            .len()
            .saturating_add(self.data.len())
            .saturating_add(self.held.len())
    }

    /// Largest [`Self::buffered_bytes`] seen at the end of a `feed`.
    pub fn max_buffered_bytes(&self) -> usize {
        self.max_buffered
    }

    fn note_buffered(&mut self) {
        self.max_buffered = self.max_buffered.max(self.buffered_bytes());
    }

    /// Appends the start of a line that continues in the next chunk.
    fn partial_line(&mut self, part: &[u8]) {
        self.line_len = self.line_len.saturating_add(part.len());
        if self.line_len > LINE_CAP {
            // Keep only enough to know the field name; the line itself is unreadable.
            if self.line.len() > 8 {
                self.line.truncate(8);
                self.line.shrink_to_fit();
            } else if self.line.len() < 8 {
                let room = 8usize.saturating_sub(self.line.len());
                self.line
                    .extend_from_slice(part.get(..room.min(part.len())).unwrap_or_default());
            }
        } else {
            self.line.extend_from_slice(part);
        }
    }

    /// Processes one complete line (without terminator); `true` when it is blank (end of event).
    fn process_line(&mut self, line: &[u8]) -> bool {
        let overlong = self.line_len > LINE_CAP;
        if line.is_empty() && !overlong {
            return true;
        }
        if line.first() == Some(&b':') {
            return false; // comment
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(c) => {
                let name = line.get(..c).unwrap_or_default();
                let mut value = line.get(c.saturating_add(1)..).unwrap_or_default();
                if let Some(v) = value.strip_prefix(b" ") {
                    value = v;
                }
                (name, value)
            }
            None => (line, &[][..]),
        };
        if name != b"data" {
            return false;
        }
        self.has_data = true;
        if overlong || self.spoiled {
            self.spoiled = true;
            return false;
        }
        if self
            .data
            .len()
            .saturating_add(value.len())
            .saturating_add(1)
            > DATA_CAP
        {
            self.spoiled = true;
            self.data.clear();
            return false;
        }
        self.data.extend_from_slice(value);
        self.data.push(b'\n');
        false
    }

    /// End of an event: reads its data; returns whether to strip it.
    fn dispatch(&mut self) -> bool {
        let mut strip = false;
        if self.has_data && !self.spoiled {
            self.events = self.events.saturating_add(1);
            let data = self.data.strip_suffix(b"\n").unwrap_or(&self.data);
            if data == b"[DONE]" {
                self.done = true;
            } else if let Some(ev) = summarize_event(data) {
                if let Some(u) = ev.usage {
                    self.usage = Some(u);
                }
                if ev.content {
                    self.content_events = self.content_events.saturating_add(1);
                }
                strip = self.strip
                    && ev.usage.is_some()
                    && ev.choices == Some(0)
                    && !self.passthrough
                    && self.event_len <= EVENT_CAP;
            }
        }
        if strip {
            self.stripped_events = self.stripped_events.saturating_add(1);
        }
        self.data.clear();
        if self.data.capacity() > 4 * 1024 {
            self.data = Vec::new();
        }
        self.has_data = false;
        self.spoiled = false;
        strip
    }
}

/// Output of one `feed`: borrowed from the chunk as long as it is a prefix of it.
struct Out<'a> {
    chunk: &'a [u8],
    borrowed_end: usize,
    owned: Option<Vec<u8>>,
}

impl<'a> Out<'a> {
    fn new(chunk: &'a [u8]) -> Self {
        Out {
            chunk,
            borrowed_end: 0,
            owned: None,
        }
    }

    fn owned(&mut self) -> &mut Vec<u8> {
        let (chunk, end) = (self.chunk, self.borrowed_end);
        self.owned
            .get_or_insert_with(|| chunk.get(..end).unwrap_or_default().to_vec())
    }

    /// Forwards `chunk[from..to]`.
    fn forward(&mut self, from: usize, to: usize) {
        if to <= from {
            return;
        }
        if self.owned.is_none() && from == self.borrowed_end {
            self.borrowed_end = to;
            return;
        }
        let bytes = self.chunk.get(from..to).unwrap_or_default();
        self.owned().extend_from_slice(bytes);
    }

    /// Forwards bytes held from earlier chunks.
    fn forward_bytes(&mut self, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.owned().extend_from_slice(bytes);
        }
    }

    /// `Cow::Borrowed` only when the output is the whole chunk unchanged, so a caller can tell
    /// "forward as is" from "replace the body chunk" by the variant alone.
    fn finish(self) -> Cow<'a, [u8]> {
        match self.owned {
            Some(v) => Cow::Owned(v),
            None if self.borrowed_end >= self.chunk.len() => Cow::Borrowed(self.chunk),
            None => Cow::Owned(
                self.chunk
                    .get(..self.borrowed_end)
                    .unwrap_or_default()
                    .to_vec(),
            ),
        }
    }
}

/// What the gateway reads from one event's JSON data.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EventSummary {
    /// Number of `choices` (None when absent, null or not an array).
    pub choices: Option<u64>,
    /// A choice has a non-empty `delta.content` or `text`.
    pub content: bool,
    pub usage: Option<Usage>,
}

/// Reads what the gateway needs from an event's data, parsing the JSON only when the event may
/// carry usage.
///
/// A cheap pass finds the keys `usage`, `choices`, `content` and `text` (at any depth) by their
/// colons: a `:` preceded by `"name"` (and optional whitespace) is that key, since inside a JSON
/// string the quotes around such a word would have to be escaped. The data is parsed in full
/// ([`parse_event`]) only when a `usage` key has an object value (the only kind that yields
/// usage) or a `content`/`text` key has an array value (content parts). Otherwise (every content
/// chunk of OpenAI and vLLM streams, whose `usage` is absent or `null`) the event has no usage,
/// its choice count is not needed (stripping needs usage) and it carries content when it has a
/// `choices` key and a `content` or `text` key whose value is a non-empty string.
///
/// For OpenAI/vLLM chunk shapes this gives the same answer as [`parse_event`]. It may differ on
/// malformed JSON (it only checks that the data starts with `{`), on keys written with escapes
/// (`"\u0075sage"` is not recognised) and on `content`/`text` keys outside `choices[].delta` /
/// `choices[]`. The usage found is exact for all but escaped keys; `content_events` is only an
/// estimate of completion tokens, used when usage never arrives.
pub fn summarize_event(data: &[u8]) -> Option<EventSummary> {
    let keys = scan_keys(data)?;
    if keys.needs_parse {
        return parse_event(data);
    }
    Some(EventSummary {
        choices: None,
        content: keys.choices && keys.content,
        usage: None,
    })
}

/// What [`scan_keys`] found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Keys {
    /// A `usage` key with an object value, or a `content`/`text` key with an array value.
    needs_parse: bool,
    /// A `choices` key.
    choices: bool,
    /// A `content` or `text` key with a non-empty string value.
    content: bool,
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
    let mut from = start.saturating_add(1);
    while let Some(n) = data.get(from..).and_then(|r| find_byte(r, b':')) {
        let colon = from.saturating_add(n);
        from = colon.saturating_add(1);
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
        let key = if name.ends_with(b"\"usage") {
            Key::Usage
        } else if name.ends_with(b"\"content") || name.ends_with(b"\"text") {
            Key::Content
        } else if name.ends_with(b"\"choices") {
            Key::Choices
        } else {
            continue;
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
                Some(b'"') => {
                    let next = data.get(value.saturating_add(1)).copied();
                    keys.content |= next.is_some() && next != Some(b'"');
                }
                _ => {}
            },
        }
    }
    Some(keys)
}

#[derive(Clone, Copy)]
enum Key {
    Usage,
    Choices,
    Content,
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// Word-at-a-time search: in `word` (8 bytes, little-endian), the lowest set bit marks the first
/// byte equal to `needle` (bits above it may be spurious, never below).
fn eq_mask(word: u64, needle: u64) -> u64 {
    let x = word ^ needle;
    x.wrapping_sub(LO) & !x & HI
}

/// Index of the first byte of `hay` equal to `a` or `b` (pass `a` twice for one byte).
fn find_either(hay: &[u8], a: u8, b: u8) -> Option<usize> {
    let (pa, pb) = (LO.wrapping_mul(u64::from(a)), LO.wrapping_mul(u64::from(b)));
    let mut words = hay.chunks_exact(8);
    let mut offset = 0usize;
    for w in &mut words {
        let Ok(bytes) = <[u8; 8]>::try_from(w) else {
            break;
        };
        let word = u64::from_le_bytes(bytes);
        let m = eq_mask(word, pa) | eq_mask(word, pb);
        if m != 0 {
            return Some(offset.saturating_add((m.trailing_zeros() / 8) as usize));
        }
        offset = offset.saturating_add(8);
    }
    let tail = words.remainder();
    let p = tail.iter().position(|&c| c == a || c == b)?;
    Some(offset.saturating_add(p))
}

fn find_byte(hay: &[u8], needle: u8) -> Option<usize> {
    find_either(hay, needle, needle)
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
        while let Some(key) = map.next_key::<EventKey>()? {
            match key {
                EventKey::Choices => {
                    let c = map.next_value::<Choices>()?;
                    ev.choices = c.count;
                    ev.content = c.content;
                }
                EventKey::Usage => ev.usage = map.next_value::<UsageField>()?.0,
                EventKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(ev)
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// OpenAI chat completion stream with `stream_options.include_usage` (usage in its own chunk).
    pub(crate) const OPENAI: &str = concat!(
        "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" \\\"usage\\\": {}\\n\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"world\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15,\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}\n\n",
        "data: [DONE]\n\n",
    );

    /// The OpenAI stream without the usage-only event: what a client that did not ask gets.
    fn openai_stripped() -> String {
        OPENAI
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"choices\":[],"))
            .collect()
    }

    /// vLLM stream: completions API, `continuous_usage_stats`-like usage in the last content chunk.
    pub(crate) const VLLM_LAST_CHUNK: &str = concat!(
        "data: {\"id\":\"cmpl-9f2\",\"object\":\"text_completion\",\"created\":1732000001,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"text\":\" The\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"cmpl-9f2\",\"object\":\"text_completion\",\"created\":1732000001,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"text\":\" sky\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"cmpl-9f2\",\"object\":\"text_completion\",\"created\":1732000001,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"text\":\" is\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],\"usage\":{\"prompt_tokens\":7,\"total_tokens\":10,\"completion_tokens\":3}}\n\n",
        "data: [DONE]\n\n",
    );

    fn crlf(s: &str) -> String {
        s.replace('\n', "\r\n")
    }

    fn cr(s: &str) -> String {
        s.replace('\n', "\r")
    }

    /// Multi-line data, comments, `event:`/`id:` fields, keep-alives, no `[DONE]`.
    pub(crate) const MULTILINE: &str = concat!(
        ": keep-alive\n\n",
        "id: 1\nevent: message\ndata: {\"choices\":[{\"index\":0,\n",
        "data: \"delta\":{\"content\":\"Hi\"}}],\n",
        ": a comment in the middle\n",
        "data: \"usage\":null}\n\n",
        "retry: 1000\n\n",
        "data:{\"choices\":[],\n",
        "data:\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n",
    );

    fn feed_all(strip: bool, parts: &[&[u8]]) -> (Vec<u8>, Option<Usage>, u64, SseScanner) {
        let mut s = SseScanner::new(strip);
        let mut out = Vec::new();
        for p in parts {
            let o = s.feed(p);
            if !strip {
                assert_eq!(&*o, *p, "observe mode forwards the chunk unchanged");
                assert!(matches!(o, Cow::Borrowed(_)));
            }
            out.extend_from_slice(&o);
        }
        let (rest, usage) = s.finish();
        out.extend_from_slice(&rest);
        let ce = s.content_events();
        (out, usage, ce, s)
    }

    fn usage(p: u64, c: u64, t: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: p,
            completion_tokens: c,
            total_tokens: t,
        })
    }

    #[test]
    fn openai_usage_in_own_chunk() {
        let (out, u, ce, s) = feed_all(false, &[OPENAI.as_bytes()]);
        assert_eq!(out, OPENAI.as_bytes());
        assert_eq!(u, usage(12, 3, 15));
        assert_eq!(ce, 3, "empty role delta and finish chunk are not content");
        assert!(s.done());
        assert_eq!(s.events(), 7);
    }

    #[test]
    fn openai_strip_removes_only_usage_event() {
        let (out, u, ce, s) = feed_all(true, &[OPENAI.as_bytes()]);
        assert_eq!(String::from_utf8(out).unwrap(), openai_stripped());
        assert_eq!(u, usage(12, 3, 15));
        assert_eq!(ce, 3);
        assert_eq!(s.stripped_events(), 1);
    }

    #[test]
    fn strip_returns_borrowed_when_chunk_ends_on_event_boundary() {
        let mut s = SseScanner::new(true);
        let first = OPENAI.split_inclusive("\n\n").next().unwrap();
        assert!(matches!(s.feed(first.as_bytes()), Cow::Borrowed(b) if b == first.as_bytes()));
        // A partial event is held back and released with the rest of it.
        let (a, b) = first.split_at(20);
        assert!(matches!(s.feed(a.as_bytes()), Cow::Owned(v) if v.is_empty()));
        assert!(s.buffered_bytes() >= 20);
        assert!(matches!(s.feed(b.as_bytes()), Cow::Owned(v) if v == first.as_bytes()));
        // A chunk holding one whole event and the start of the next: the tail is held back.
        let two = &OPENAI.as_bytes()[..first.len() + 10];
        assert!(matches!(s.feed(two), Cow::Owned(v) if v == first.as_bytes()));
    }

    #[test]
    fn vllm_usage_in_last_content_chunk() {
        for strip in [false, true] {
            let (out, u, ce, _) = feed_all(strip, &[VLLM_LAST_CHUNK.as_bytes()]);
            assert_eq!(
                out,
                VLLM_LAST_CHUNK.as_bytes(),
                "nothing stripped: choices not empty"
            );
            assert_eq!(u, usage(7, 3, 10));
            assert_eq!(ce, 3);
        }
    }

    #[test]
    fn crlf_and_cr_line_endings() {
        for (s, stripped) in [
            (crlf(OPENAI), crlf(&openai_stripped())),
            (cr(OPENAI), cr(&openai_stripped())),
        ] {
            let (out, u, ce, _) = feed_all(false, &[s.as_bytes()]);
            assert_eq!(out, s.as_bytes());
            assert_eq!(u, usage(12, 3, 15));
            assert_eq!(ce, 3);
            let (out, u, _, sc) = feed_all(true, &[s.as_bytes()]);
            assert_eq!(u, usage(12, 3, 15));
            assert_eq!(sc.stripped_events(), 1);
            assert_eq!(String::from_utf8(out).unwrap(), stripped);
        }
    }

    #[test]
    fn crlf_split_between_cr_and_lf_of_stripped_event() {
        let s = crlf(OPENAI);
        let usage_end = s.find("data: [DONE]").unwrap();
        // Split between the CR and the LF that end the usage-only event.
        let (a, b) = s.as_bytes().split_at(usage_end - 1);
        let (out, u, _, _) = feed_all(true, &[a, b]);
        assert_eq!(u, usage(12, 3, 15));
        assert_eq!(String::from_utf8(out).unwrap(), crlf(&openai_stripped()));
    }

    #[test]
    fn multiline_data_comments_fields_no_done() {
        let (out, u, ce, s) = feed_all(false, &[MULTILINE.as_bytes()]);
        assert_eq!(out, MULTILINE.as_bytes());
        assert_eq!(u, usage(5, 1, 6), "total computed from prompt + completion");
        assert_eq!(ce, 1);
        assert!(!s.done());
        let (out, _, _, s) = feed_all(true, &[MULTILINE.as_bytes()]);
        assert_eq!(s.stripped_events(), 1);
        let kept = MULTILINE.split("data:{\"choices\":[],").next().unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), kept);
    }

    #[test]
    fn no_usage_counts_content_events() {
        let s: String = OPENAI
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"choices\":[],"))
            .collect();
        let (out, u, ce, _) = feed_all(true, &[s.as_bytes()]);
        assert_eq!(out, s.as_bytes());
        assert_eq!(u, None);
        assert_eq!(ce, 3);
    }

    #[test]
    fn unterminated_last_event_is_read_and_forwarded() {
        let s = "data: {\"choices\":[],\"usage\":{\"total_tokens\":9}}";
        let (out, u, _, _) = feed_all(true, &[s.as_bytes()]);
        assert_eq!(out, s.as_bytes(), "an incomplete event is never stripped");
        assert_eq!(u, usage(0, 0, 9), "only total given");
    }

    #[test]
    fn usage_only_event_needs_empty_choices_array() {
        for ev in [
            "data: {\"usage\":{\"total_tokens\":9}}\n\n",
            "data: {\"choices\":null,\"usage\":{\"total_tokens\":9}}\n\n",
            "data: {\"choices\":[],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{}}\n\n",
        ] {
            let (out, _, _, s) = feed_all(true, &[ev.as_bytes()]);
            assert_eq!(out, ev.as_bytes(), "{ev}");
            assert_eq!(s.stripped_events(), 0);
        }
    }

    #[test]
    fn oversized_event_is_forwarded_not_held() {
        let big = format!(
            "data: {{\"choices\":[],\"pad\":\"{}\",\"usage\":{{\"total_tokens\":1}}}}\n\n",
            "x".repeat(EVENT_CAP + 10)
        );
        let mut s = SseScanner::new(true);
        let mut out = Vec::new();
        for c in big.as_bytes().chunks(1000) {
            out.extend_from_slice(&s.feed(c));
            assert!(s.buffered_bytes() <= LINE_CAP + DATA_CAP + EVENT_CAP);
        }
        out.extend_from_slice(&s.finish().0);
        assert_eq!(out, big.as_bytes());
        // The same whole: same bytes.
        let (whole, _, _, _) = feed_all(true, &[big.as_bytes()]);
        assert_eq!(whole, big.as_bytes());
    }

    #[test]
    fn overlong_line_spoils_only_its_event() {
        let long = format!(
            "data: {{\"choices\":[],\"usage\":{{\"total_tokens\":1}},\"pad\":\"{}\"}}\n\n",
            "y".repeat(LINE_CAP)
        );
        let stream = format!("{long}data: {{\"choices\":[{{\"text\":\"a\"}}]}}\n\n");
        for strip in [false, true] {
            let whole = feed_all(strip, &[stream.as_bytes()]);
            let parts: Vec<&[u8]> = stream.as_bytes().chunks(4096).collect();
            let split = feed_all(strip, &parts);
            assert_eq!(whole.0, stream.as_bytes(), "nothing stripped");
            assert_eq!(whole.1, None, "the overlong event is not read");
            assert_eq!(whole.2, 1, "the next event is read");
            assert_eq!((split.0, split.1, split.2), (whole.0, whole.1, whole.2));
            assert!(split.3.max_buffered_bytes() <= DATA_CAP + EVENT_CAP + 4096);
        }
    }

    #[test]
    fn memory_does_not_grow_with_stream_length() {
        let mut s = SseScanner::new(true);
        let bytes = OPENAI.as_bytes();
        for _ in 0..2000 {
            for c in bytes.chunks(37) {
                let _ = s.feed(c);
            }
        }
        // At most one partial line, one event's data and one held event, each shorter than an event.
        let longest_event = OPENAI.split_inclusive("\n\n").map(str::len).max().unwrap();
        assert!(
            s.max_buffered_bytes() <= 3 * longest_event,
            "{}",
            s.max_buffered_bytes()
        );
        assert!(s.data.capacity() <= 4 * 1024 && s.held.capacity() <= 2 * longest_event);
    }

    #[test]
    fn content_detection() {
        let cases: &[(&str, bool)] = &[
            (r#"{"choices":[{"delta":{"content":"a"}}]}"#, true),
            (r#"{"choices":[{"delta":{"content":""}}]}"#, false),
            (
                r#"{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#,
                false,
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant"}},{"text":"x"}]}"#,
                true,
            ),
            (r#"{"choices":[{"text":""}]}"#, false),
            (r#"{"choices":[{"delta":{"content":"\u00e9"}}]}"#, true),
            (
                r#"{"choices":[{"delta":"weird"}],"usage":{"prompt_tokens":1}}"#,
                false,
            ),
        ];
        for (json, expected) in cases {
            let ev = parse_event(json.as_bytes()).unwrap();
            assert_eq!(ev.content, *expected, "{json}");
        }
        let ev =
            parse_event(br#"{"choices":[{"delta":"weird"}],"usage":{"prompt_tokens":1}}"#).unwrap();
        assert_eq!(ev.usage, usage(1, 0, 1));
        assert_eq!(parse_event(b"[1,2]"), None);
        assert_eq!(parse_event(b"{\"choices\":[}"), None);
    }

    /// The fast summary agrees with the full parse on what the scanner uses: usage, content and
    /// whether the event would be stripped.
    fn assert_summary_agrees(data: &[u8]) {
        let full = parse_event(data);
        let fast = summarize_event(data);
        let text = String::from_utf8_lossy(data);
        let key = |e: Option<EventSummary>| {
            e.map(|e| {
                (
                    e.usage,
                    e.content,
                    e.usage.is_some() && e.choices == Some(0),
                )
            })
        };
        assert_eq!(key(fast), key(full), "{text}");
    }

    #[test]
    fn fast_summary_agrees_with_parse_on_recorded_shapes() {
        let chunks = openai_stream_chunks(3);
        for stream in [OPENAI, VLLM_LAST_CHUNK, &crlf(MULTILINE), &chunks.concat()] {
            for event in stream.split("\n\n") {
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                let data = data.join("\n");
                if !data.is_empty() && data != "[DONE]" {
                    assert_summary_agrees(data.as_bytes());
                }
            }
        }
        for json in [
            r#"{"choices":[{"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"delta":{"content":""}}]}"#,
            r#"{"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#,
            r#"{"choices":[{"delta":{"role":"assistant"}},{"text":"x"}]}"#,
            r#"{"choices":[{"text":""}]}"#,
            r#"{"choices":[{"delta":{"content":"\u00e9"}}]}"#,
            r#"{"choices":[{"delta":{"content":"\"usage\":{\"total_tokens\":5}"}}]}"#,
            r#"{"choices":[{"delta":{"content":"\\"}}],"usage":null}"#,
            r#"{"choices":[{"delta":{"content":[{"type":"text","text":"a"}]}}]}"#,
            r#"{"choices":[{"delta":{"content":[]}}]}"#,
            r#"{"choices":[{"delta":{"content":{}}}]}"#,
            r#"{"choices":[{"delta":{"content":"x"},"logprobs":{"content":[{"token":"x"}]}}]}"#,
            r#"{"choices":[{"delta":"weird"}],"usage":{"prompt_tokens":1}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
            r#"{"choices":[],"usage":{}}"#,
            r#"{"choices":[],"usage":[1]}"#,
            r#"{"choices" : [ ] , "usage" : { "total_tokens" : 4 } }"#,
            "{\"choices\":[],\n\"usage\"\t:\r{\"total_tokens\":4}}",
            r#"{"choices":[{"delta":{"reasoning_content":"think"}}]}"#,
            r#"{"usage":{"total_tokens":9},"choices":[{"text":"a"}]}"#,
            "[1,2]",
            "",
            "  ",
        ] {
            assert_summary_agrees(json.as_bytes());
        }
        // Where the estimate is allowed to differ: malformed JSON still counts its content.
        let broken = br#"{"choices":[{"delta":{"content":"a"}}]"#;
        assert_eq!(parse_event(broken), None);
        assert_eq!(summarize_event(broken).map(|e| e.content), Some(true));
    }

    /// JSON strings that look like the keys and values the fast path looks for.
    fn tricky_text() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just("\"usage\":{\"total_tokens\":7}".to_string()),
                Just("\"content\":\"".to_string()),
                Just("\"choices\":[]".to_string()),
                Just("\\".to_string()),
                Just("\"".to_string()),
                Just(":".to_string()),
                Just("usage".to_string()),
                Just("text".to_string()),
                "[a-z é\n\t{}:\\[\\]\"\\\\]{0,6}",
            ],
            0..5,
        )
        .prop_map(|v| v.concat())
    }

    fn usage_value() -> impl Strategy<Value = Option<serde_json::Value>> {
        prop_oneof![
            Just(None),
            Just(Some(serde_json::Value::Null)),
            Just(Some(serde_json::json!({}))),
            (0u64..1000, 0u64..1000).prop_map(|(p, c)| Some(
                serde_json::json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
            )),
            (0u64..1000).prop_map(|t| Some(serde_json::json!({"total_tokens": t}))),
            Just(Some(serde_json::json!("usage"))),
        ]
    }

    fn content_value() -> impl Strategy<Value = Option<serde_json::Value>> {
        prop_oneof![
            Just(None),
            Just(Some(serde_json::Value::Null)),
            Just(Some(serde_json::json!(""))),
            tricky_text().prop_map(|t| Some(serde_json::json!(t))),
            tricky_text().prop_map(|t| Some(serde_json::json!([{"type": "text", "text": t}]))),
            Just(Some(serde_json::json!([]))),
        ]
    }

    /// One choice of a chat (`delta`) or completions (`text`) chunk.
    fn choice() -> impl Strategy<Value = serde_json::Value> {
        (
            any::<bool>(),
            content_value(),
            proptest::option::of(tricky_text()),
            any::<bool>(),
            proptest::option::of(tricky_text()),
        )
            .prop_map(|(chat, content, reasoning, logprobs, finish)| {
                let mut c = serde_json::json!({"index": 0, "finish_reason": finish});
                c["logprobs"] = if logprobs {
                    serde_json::json!({"content": [{"token": "x", "logprob": -0.5}]})
                } else {
                    serde_json::Value::Null
                };
                if chat {
                    let mut delta = serde_json::json!({});
                    if let Some(v) = content {
                        delta["content"] = v;
                    }
                    if let Some(r) = reasoning {
                        delta["reasoning_content"] = serde_json::json!(r);
                    }
                    c["delta"] = delta;
                } else if let Some(v) = content {
                    c["text"] = v;
                }
                c
            })
    }

    proptest! {
        #[test]
        fn fast_summary_agrees_with_parse_on_chunk_shapes(
            choices in proptest::collection::vec(choice(), 0..3),
            usage in usage_value(),
            id in tricky_text(),
            pretty in any::<bool>(),
        ) {
            let mut ev = serde_json::json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": 1732000000,
                "model": "m",
                "choices": choices,
            });
            if let Some(u) = usage {
                ev["usage"] = u;
            }
            let data = if pretty {
                serde_json::to_vec_pretty(&ev).unwrap()
            } else {
                serde_json::to_vec(&ev).unwrap()
            };
            assert_summary_agrees(&data);
        }

        #[test]
        fn find_either_finds_the_first(
            hay in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b':'), any::<u8>()], 0..80),
            from in 0usize..80,
        ) {
            let hay = &hay[from.min(hay.len())..];
            let naive = hay.iter().position(|&b| b == b'\n' || b == b'\r');
            prop_assert_eq!(find_either(hay, b'\n', b'\r'), naive);
            prop_assert_eq!(find_byte(hay, b':'), hay.iter().position(|&b| b == b':'));
        }
    }

    /// Splits `data` at the given sorted points.
    fn split_at_points(data: &[u8], mut points: Vec<usize>) -> Vec<&[u8]> {
        points.sort_unstable();
        points.dedup();
        let mut parts = Vec::new();
        let mut last = 0;
        for p in points {
            let p = p.min(data.len());
            parts.push(&data[last..p]);
            last = p;
        }
        parts.push(&data[last..]);
        parts
    }

    fn streams() -> Vec<String> {
        let mut v = Vec::new();
        for s in [OPENAI, VLLM_LAST_CHUNK, MULTILINE] {
            v.push(s.to_string());
            v.push(crlf(s));
            v.push(cr(s));
        }
        v.push(openai_stripped());
        v
    }

    #[test]
    fn every_split_point_gives_same_result() {
        for stream in streams() {
            let bytes = stream.as_bytes();
            for strip in [false, true] {
                let whole = feed_all(strip, &[bytes]);
                for i in 0..=bytes.len() {
                    let (a, b) = bytes.split_at(i);
                    let split = feed_all(strip, &[a, b]);
                    assert_eq!(split.0, whole.0, "strip={strip} split at {i}");
                    assert_eq!(split.1, whole.1, "strip={strip} split at {i}");
                    assert_eq!(split.2, whole.2, "strip={strip} split at {i}");
                }
            }
        }
    }

    #[test]
    fn byte_by_byte_gives_same_result() {
        for stream in streams() {
            let bytes = stream.as_bytes();
            for strip in [false, true] {
                let whole = feed_all(strip, &[bytes]);
                let parts: Vec<&[u8]> = bytes.chunks(1).collect();
                let split = feed_all(strip, &parts);
                assert_eq!((split.0, split.1, split.2), (whole.0, whole.1, whole.2));
            }
        }
    }

    proptest! {
        #[test]
        fn random_multi_splits_same_result(
            which in 0usize..10,
            points in proptest::collection::vec(0usize..4000, 0..20),
            strip in any::<bool>(),
        ) {
            let all = streams();
            let stream = &all[which % all.len()];
            let bytes = stream.as_bytes();
            let whole = feed_all(strip, &[bytes]);
            let split = feed_all(strip, &split_at_points(bytes, points));
            prop_assert_eq!(split.0, whole.0);
            prop_assert_eq!(split.1, whole.1);
            prop_assert_eq!(split.2, whole.2);
        }

        #[test]
        fn garbage_never_panics_and_split_invariant(
            data in proptest::collection::vec(
                prop_oneof![
                    any::<u8>(),
                    Just(b'\n'), Just(b'\r'), Just(b':'), Just(b'{'), Just(b'}'),
                    Just(b'"'), Just(b'['), Just(b']'),
                ],
                0..600,
            ),
            points in proptest::collection::vec(0usize..600, 0..10),
            strip in any::<bool>(),
        ) {
            let whole = feed_all(strip, &[&data]);
            let split = feed_all(strip, &split_at_points(&data, points));
            prop_assert_eq!(&split.0, &whole.0);
            prop_assert_eq!(split.1, whole.1);
            prop_assert_eq!(split.2, whole.2);
            if !strip {
                prop_assert_eq!(&whole.0, &data);
            }
        }

        #[test]
        fn event_soup_split_invariant(
            events in proptest::collection::vec(
                prop_oneof![
                    Just("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n\n".to_string()),
                    Just("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n".to_string()),
                    Just(": ping\n\n".to_string()),
                    Just("\n".to_string()),
                    Just("\r\n".to_string()),
                    Just("\r".to_string()),
                    Just("data: [DONE]\n\n".to_string()),
                    Just("data: {\"choices\":[],\r\ndata: \"usage\":{\"total_tokens\":4}}\r\n\r\n".to_string()),
                    Just("data: {\"choices\":[],\rdata: \"usage\":{\"total_tokens\":5}}\r\r".to_string()),
                    "[a-z:{}\\[\\] \"\r\n]{0,12}",
                ],
                0..30,
            ),
            points in proptest::collection::vec(0usize..2000, 0..12),
        ) {
            let stream: String = events.concat();
            let bytes = stream.as_bytes();
            for strip in [false, true] {
                let whole = feed_all(strip, &[bytes]);
                let split = feed_all(strip, &split_at_points(bytes, points.clone()));
                prop_assert_eq!(&split.0, &whole.0);
                prop_assert_eq!(split.1, whole.1);
                prop_assert_eq!(split.2, whole.2);
            }
        }
    }

    /// A realistic OpenAI stream: role chunk, `tokens` content chunks, finish chunk, usage chunk,
    /// `[DONE]`; one event per chunk, as upstreams send them.
    fn openai_stream_chunks(tokens: usize) -> Vec<String> {
        let head = "data: {\"id\":\"chatcmpl-AbC\",\"object\":\"chat.completion.chunk\",\"created\":1732000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0ba0d124f1\",\"choices\":[{\"index\":0,\"delta\":";
        let tail = ",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n";
        let mut v = vec![format!(
            "{head}{{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null}}{tail}"
        )];
        for i in 0..tokens {
            v.push(format!("{head}{{\"content\":\" tok{i}\"}}{tail}"));
        }
        v.push(format!(
            "{head}{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}],\"usage\":null}}\n\n"
        ));
        v.push(OPENAI.split_inclusive("\n\n").nth(5).unwrap().to_string());
        v.push("data: [DONE]\n\n".to_string());
        v
    }

    #[test]
    fn realistic_stream_counts() {
        let chunks = openai_stream_chunks(62);
        let parts: Vec<&[u8]> = chunks.iter().map(|c| c.as_bytes()).collect();
        for strip in [false, true] {
            let (out, u, ce, s) = feed_all(strip, &parts);
            assert_eq!(u, usage(12, 3, 15));
            assert_eq!(ce, 62);
            assert_eq!(s.stripped_events(), u64::from(strip));
            assert_eq!(
                out.len() + usize::from(strip) * parts[64].len(),
                chunks.concat().len()
            );
        }
    }

    /// Time per realistic stream (65 chunks + `[DONE]`, one event per chunk); run with
    /// `cargo test -p maas-filter --release --lib sse::tests::per_stream -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn per_stream() {
        let chunks = openai_stream_chunks(62);
        // Best of 15 rounds of 2,000 streams, alternating modes: the machine may be shared.
        let n = 2_000u32;
        let mut best = [f64::MAX; 2];
        let mut total = 0u64;
        for _ in 0..15 {
            for strip in [false, true] {
                let start = std::time::Instant::now();
                for _ in 0..n {
                    let mut s = SseScanner::new(strip);
                    for c in &chunks {
                        total += s.feed(std::hint::black_box(c.as_bytes())).len() as u64;
                    }
                    let (_, u) = s.finish();
                    total += u.map_or(0, |u| u.total_tokens) + s.content_events();
                }
                let per = start.elapsed().as_secs_f64() / f64::from(n);
                let b = &mut best[usize::from(strip)];
                *b = b.min(per);
            }
        }
        std::hint::black_box(total);
        for strip in [false, true] {
            let per = best[usize::from(strip)];
            println!(
                "sse per stream strip={strip}: {:.2} µs per {}-chunk stream ({:.0} ns per event), best of 15",
                per * 1e6,
                chunks.len(),
                per * 1e9 / chunks.len() as f64,
            );
        }
    }

    /// Throughput and memory figures; run with
    /// `cargo test -p maas-filter --release --lib sse::tests::throughput -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn throughput() {
        let mut stream = Vec::new();
        while stream.len() < 32 * 1024 * 1024 {
            stream.extend_from_slice(OPENAI.as_bytes());
        }
        for (strip, chunk) in [
            (false, 256),
            (false, 4096),
            (false, 65536),
            (true, 256),
            (true, 4096),
        ] {
            let mut s = SseScanner::new(strip);
            let start = std::time::Instant::now();
            let mut forwarded = 0usize;
            for c in stream.chunks(chunk) {
                forwarded += s.feed(c).len();
            }
            let el = start.elapsed().as_secs_f64();
            println!(
                "sse strip={strip} chunk={chunk}: {:.0} MB/s, {:.0} events/s, max buffered {} B, forwarded {} B, usage {:?}",
                stream.len() as f64 / el / 1e6,
                s.events() as f64 / el,
                s.max_buffered_bytes(),
                forwarded,
                s.usage(),
            );
            std::hint::black_box(forwarded);
        }
    }
}
