//! The prompt estimate: the bytes of a request body that a backend's template tokenizes.
//!
//! **Count unless known to be media.** Below the body's top level every object key and every
//! string counts with its UTF-8 length (decoded), every number as [`PROMPT_BYTES_PER_TOKEN`]
//! bytes (one token: token-id prompts). Keys count because templates render them: a tool's or a
//! `response_format`'s JSON schema is mostly property names, Anthropic `tool_use.input` and tool
//! call arguments are rendered as JSON. The top-level keys are the API's parameter names, which
//! no template renders, and the top-level fields the gateway reads (`model`, `stream`, the cap
//! fields, `n`…) are not prompt.
//!
//! Left out is only a payload a backend decodes as binary media, where it takes media: a string
//! in a content part of a message (`messages[*].content[*]`, Responses `input[*].content[*]` and
//! `input[*].output[*]`, and their nested `content` lists, e.g. Anthropic `tool_result`), whose
//! part `type` and own declaration both say binary:
//! - `image_url` / `audio_url` / `video_url` parts: `.url` a `data:` URL of an image, audio,
//!   video or PDF media type; Responses `input_image`: `image_url` such a URL;
//! - `file` parts: `.file_data` such a URL; Responses `input_file`: `file_data` such a URL;
//! - `input_audio` parts: `.data` with an audio `format` (`wav`, `mp3`…);
//! - Anthropic `image` / `document` parts: `.source.data` with `source.type` `base64` and a binary
//!   `media_type` (`image/*`, `application/pdf`…); a `text` source (plain-text document) counts.
//!
//! Anything else counts, wherever it is: the same shapes inside a tool schema, tool arguments or
//! any field not modelled are text a template renders. A declaration may come after the payload
//! (`{"data": …, "media_type": …}`), so each object decides at its end; a declaration given twice
//! with different values (a parser may read either) counts the payload. What the media itself
//! costs (image or PDF tokens) is not in its bytes: each content part that declares a media type
//! or carries a media member is counted ([`Tally::media`]) and reserved at the model's
//! `mediaTokens` (`decide::prompt_estimate`).
//!
//! Nothing is built: keys and strings are read in place (from the body, or the parser's scratch
//! buffer when escaped), so the walk allocates nothing.

use super::PROMPT_BYTES_PER_TOKEN;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// Where a value sits, as far as the estimate cares: media is left out only in a content part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// Anything else: every key, string and number counts.
    Text,
    /// `messages`, Responses `input`: a list of messages or input items.
    Messages,
    /// One message or input item: its `content` (Responses `output`) holds parts.
    Message,
    /// A `content` value: a string, or a list of parts.
    Parts,
    /// One content part, `{"type": …, …}`.
    Part,
}

/// Prompt text bytes of the value at a [`Place`].
pub(super) struct Estimate(pub(super) Place);

/// What a value adds to the prompt estimate: text bytes, and media parts (each reserved at the
/// model's `mediaTokens`: what an image, audio, video or document costs is not in its bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tally {
    pub(super) text: u64,
    pub(super) media: u64,
}

impl Tally {
    fn text(text: u64) -> Tally {
        Tally { text, media: 0 }
    }

    pub(super) fn add(self, other: Tally) -> Tally {
        Tally {
            text: self.text.saturating_add(other.text),
            media: self.media.saturating_add(other.media),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Estimate {
    type Value = Tally;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Tally, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Estimate {
    type Value = Tally;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Tally, E> {
        Ok(Tally::text(v.len() as u64))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Tally, E> {
        Ok(Tally::default())
    }

    fn visit_unit<E>(self) -> Result<Tally, E> {
        Ok(Tally::default())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Tally, E> {
        Ok(Tally::text(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Tally, E> {
        Ok(Tally::text(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Tally, E> {
        Ok(Tally::text(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Tally, A::Error> {
        let element = match self.0 {
            Place::Messages => Place::Message,
            Place::Parts => Place::Part,
            _ => Place::Text,
        };
        let mut total = Tally::default();
        while let Some(n) = seq.next_element_seed(Estimate(element))? {
            total = total.add(n);
        }
        Ok(total)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Tally, A::Error> {
        match self.0 {
            Place::Message => message(map),
            Place::Part => part(map),
            _ => text_object(map).map(Tally::text),
        }
    }
}

/// A value's JSON type, as far as a field pointing at stored context cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Null,
    Object,
    Other,
}

/// A top-level value outside any message: its text bytes and its [`Shape`].
pub(super) struct Shaped;

impl<'de> DeserializeSeed<'de> for Shaped {
    type Value = (u64, Shape);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(u64, Shape), D::Error> {
        let (text, shape, _) = d.deserialize_any(ShapeVisitor { keep_str: false })?;
        Ok((text, shape))
    }
}

/// Longest string kept from a body by [`ShapeVisitor`] (it is named in a refusal's message).
const KEPT_STR_BYTES: usize = 64;

/// A value's text bytes, its [`Shape`] and, with `keep_str`, the string it is (its first
/// [`KEPT_STR_BYTES`] bytes).
struct ShapeVisitor {
    keep_str: bool,
}

impl<'de> Visitor<'de> for ShapeVisitor {
    type Value = (u64, Shape, Option<String>);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        let kept = self.keep_str.then(|| {
            let mut end = v.len().min(KEPT_STR_BYTES);
            while !v.is_char_boundary(end) {
                end -= 1;
            }
            v.get(..end).unwrap_or_default().to_string()
        });
        Ok((v.len() as u64, Shape::Other, kept))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok((0, Shape::Other, None))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok((0, Shape::Null, None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, Shape::Other, None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, Shape::Other, None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, Shape::Other, None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Ok((text_seq(seq)?, Shape::Other, None))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok((text_object(map)?, Shape::Object, None))
    }
}

/// Tool `type`s the client runs (the provider only asks for a call, which comes back visible in
/// the next request): everything else in `tools` is run by the provider inside the request
/// (web search, file search, code execution, remote MCP…), reading what the body does not show.
const CLIENT_RUN_TOOLS: [&str; 4] = ["function", "custom", "local_shell", "computer_use_preview"];
/// Prefixes of Anthropic's client-run tool versions (`bash_20250124`, `text_editor_…`, …).
const CLIENT_RUN_TOOL_PREFIXES: [&str; 4] = ["bash_", "text_editor_", "computer_", "memory_"];

/// Whether the provider runs a tool of this `type` itself.
pub(super) fn is_hosted_tool(tool_type: &str) -> bool {
    !(CLIENT_RUN_TOOLS.contains(&tool_type)
        || CLIENT_RUN_TOOL_PREFIXES
            .iter()
            .any(|p| tool_type.starts_with(p)))
}

/// The top-level `tools`: its text bytes, and the `type` of the first tool the provider runs
/// itself ([`is_hosted_tool`]; a `type` that is not a string counts as one). A tool without a
/// `type` (Anthropic's own tools) is the client's.
pub(super) struct Tools;

impl<'de> DeserializeSeed<'de> for Tools {
    type Value = (u64, Option<String>);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ToolsVisitor { element: false })
    }
}

/// `tools` (`element: false`: a list of tools) or one of its elements (a tool object): text
/// bytes, and the `type` of the first tool the provider runs.
#[derive(Clone, Copy)]
struct ToolsVisitor {
    element: bool,
}

impl<'de> DeserializeSeed<'de> for ToolsVisitor {
    type Value = (u64, Option<String>);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ToolsVisitor {
    type Value = (u64, Option<String>);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok((v.len() as u64, None))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok((0, None))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok((0, None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        if self.element {
            return Ok((text_seq(seq)?, None));
        }
        let mut text: u64 = 0;
        let mut hosted = None;
        while let Some((n, h)) = seq.next_element_seed(ToolsVisitor { element: true })? {
            text = text.saturating_add(n);
            if hosted.is_none() {
                hosted = h;
            }
        }
        Ok((text, hosted))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        if !self.element {
            return Ok((text_object(map)?, None));
        }
        let mut text: u64 = 0;
        let mut hosted = None;
        while let Some(Name(key)) = map.next_key_seed(NameSeed)? {
            text = text.saturating_add(key.len);
            if key.name == KeyName::Type {
                let (n, tool_type) = map.next_value_seed(ToolType)?;
                text = text.saturating_add(n);
                if hosted.is_none() {
                    hosted = tool_type;
                }
            } else {
                text = text.saturating_add(map.next_value_seed(TextSeed)?);
            }
        }
        Ok((text, hosted))
    }
}

/// A tool's `type`: its text bytes, and the type when the provider runs such a tool (a value
/// that is not a string: `"(not a string)"`; null: no type).
struct ToolType;

impl<'de> DeserializeSeed<'de> for ToolType {
    type Value = (u64, Option<String>);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let (text, shape, tool_type) = d.deserialize_any(ShapeVisitor { keep_str: true })?;
        Ok(match (shape, tool_type) {
            (_, Some(t)) => (text, is_hosted_tool(&t).then_some(t)),
            (Shape::Null, None) => (text, None),
            _ => (text, Some("(not a string)".to_string())),
        })
    }
}

/// The text bytes of a list outside any message (no media is counted there).
fn text_seq<'de, A: SeqAccess<'de>>(seq: A) -> Result<u64, A::Error> {
    Ok(Estimate(Place::Text).visit_seq(seq)?.text)
}

/// The text bytes of a value outside any message.
struct TextSeed;

impl<'de> DeserializeSeed<'de> for TextSeed {
    type Value = u64;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        Ok(Estimate(Place::Text).deserialize(d)?.text)
    }
}

/// An object of plain text: its keys and values.
fn text_object<'de, A: MapAccess<'de>>(mut map: A) -> Result<u64, A::Error> {
    let mut total: u64 = 0;
    while let Some(Name(key)) = map.next_key_seed(NameSeed)? {
        let value = map.next_value_seed(TextSeed)?;
        total = total.saturating_add(key.len).saturating_add(value);
    }
    Ok(total)
}

/// A message or input item: `content` (Responses `output`) holds parts.
///
/// An item that is itself shaped as a media part (a bare `{"type":"input_image",…}` in Responses
/// `input`, which a lenient server may take) is one media part too; its payload counts as text.
fn message<'de, A: MapAccess<'de>>(mut map: A) -> Result<Tally, A::Error> {
    let mut total = Tally::default();
    let mut media_part = false;
    while let Some(Name(key)) = map.next_key_seed(NameSeed)? {
        let place = match key.name {
            KeyName::Content | KeyName::Output => Place::Parts,
            KeyName::Type => {
                let (bytes, seen) = map.next_value_seed(TypeSeed)?;
                media_part |= matches!(seen, PartType::Media(_));
                total = total.add(Tally::text(key.len.saturating_add(bytes)));
                continue;
            }
            name => {
                media_part |= name.is_media_member();
                Place::Text
            }
        };
        let value = map.next_value_seed(Estimate(place))?;
        total = total.add(Tally::text(key.len)).add(value);
    }
    Ok(total.add(Tally {
        text: 0,
        media: u64::from(media_part),
    }))
}

/// A member of a content part that can carry media: which key, and in which shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carrier {
    /// Chat `{"type":"image_url","image_url":{"url":"data:…"}}`.
    ImageUrlObject,
    /// vLLM `{"type":"audio_url","audio_url":{"url":"data:…"}}`.
    AudioUrlObject,
    /// vLLM `{"type":"video_url","video_url":{"url":"data:…"}}`.
    VideoUrlObject,
    /// Responses `{"type":"input_image","image_url":"data:…"}`.
    ImageUrlString,
    /// Chat `{"type":"file","file":{"file_data":"data:…"}}`.
    FileObject,
    /// Responses `{"type":"input_file","file_data":"data:…"}`.
    FileDataString,
    /// `{"type":"input_audio","input_audio":{"data":…,"format":"wav"}}`.
    InputAudioObject,
    /// Anthropic `{"type":"image"|"document","source":{"type":"base64","media_type":…,"data":…}}`.
    SourceObject,
}

const CARRIERS: usize = 8;

impl Carrier {
    fn slot(self) -> usize {
        self as usize
    }

    /// The carrier a part `type` takes its media in.
    fn of_part_type(part_type: &str) -> Option<Carrier> {
        Some(match part_type {
            "image_url" => Carrier::ImageUrlObject,
            "audio_url" => Carrier::AudioUrlObject,
            "video_url" => Carrier::VideoUrlObject,
            "input_image" => Carrier::ImageUrlString,
            "file" => Carrier::FileObject,
            "input_file" => Carrier::FileDataString,
            "input_audio" => Carrier::InputAudioObject,
            "image" | "document" => Carrier::SourceObject,
            _ => return None,
        })
    }
}

/// A part's `type`, as far as media goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartType {
    None,
    /// A media part, taking its media in this carrier.
    Media(Carrier),
    /// Not a media part, or declared twice differently (a parser may read either): all counts.
    Text,
}

impl PartType {
    fn and(self, seen: PartType) -> PartType {
        match (self, seen) {
            (PartType::None, s) => s,
            (a, b) if a == b => a,
            _ => PartType::Text,
        }
    }
}

/// One content part. Media payloads are held until the part's end, when its `type` is known:
/// left out only when they sit in the carrier that type takes media in. A part that declares a
/// media type or carries a media member (inline, a URL or a file id alike: the backend fetches
/// what it is pointed at) is one media part, whatever its payload's bytes.
fn part<'de, A: MapAccess<'de>>(mut map: A) -> Result<Tally, A::Error> {
    let mut total: u64 = 0;
    let mut nested = Tally::default();
    let mut part_type = PartType::None;
    let mut media_part = false;
    let mut held = [0u64; CARRIERS];
    while let Some(Name(key)) = map.next_key_seed(NameSeed)? {
        total = total.saturating_add(key.len);
        let member = match key.name {
            KeyName::Type => {
                let (bytes, seen) = map.next_value_seed(TypeSeed)?;
                total = total.saturating_add(bytes);
                media_part |= matches!(seen, PartType::Media(_));
                part_type = part_type.and(seen);
                continue;
            }
            // Nested parts (Anthropic `tool_result` content).
            KeyName::Content => {
                nested = nested.add(map.next_value_seed(Estimate(Place::Parts))?);
                continue;
            }
            KeyName::ImageUrl => Member::ImageUrl,
            KeyName::AudioUrl => Member::Url(Carrier::AudioUrlObject),
            KeyName::VideoUrl => Member::Url(Carrier::VideoUrlObject),
            KeyName::File => Member::File,
            KeyName::FileData => Member::FileData,
            KeyName::InputAudio => Member::InputAudio,
            KeyName::Source => Member::Source,
            _ => {
                let n = map.next_value_seed(TextSeed)?;
                total = total.saturating_add(n);
                continue;
            }
        };
        media_part = true;
        let measured = map.next_value_seed(member)?;
        total = total.saturating_add(measured.text);
        if let Some((carrier, bytes)) = measured.media {
            match held.get_mut(carrier.slot()) {
                Some(slot) => *slot = slot.saturating_add(bytes),
                None => total = total.saturating_add(bytes),
            }
        }
    }
    for (slot, bytes) in held.iter().enumerate() {
        let media = matches!(part_type, PartType::Media(c) if c.slot() == slot);
        if !media {
            total = total.saturating_add(*bytes);
        }
    }
    Ok(Tally {
        text: total,
        media: u64::from(media_part),
    }
    .add(nested))
}

/// A part's `type` value: its bytes, and which part it declares.
struct TypeSeed;

impl<'de> DeserializeSeed<'de> for TypeSeed {
    type Value = (u64, PartType);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TypeSeed {
    type Value = (u64, PartType);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        let declared = Carrier::of_part_type(v).map_or(PartType::Text, PartType::Media);
        Ok((v.len() as u64, declared))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok((0, PartType::Text))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok((0, PartType::Text))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, PartType::Text))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, PartType::Text))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, PartType::Text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Ok((text_seq(seq)?, PartType::Text))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok((text_object(map)?, PartType::Text))
    }
}

/// A part member that may carry media, measured: the bytes that count, and the bytes that are
/// media if the part's `type` names this carrier.
struct Measured {
    text: u64,
    media: Option<(Carrier, u64)>,
}

impl Measured {
    fn text(text: u64) -> Measured {
        Measured { text, media: None }
    }
}

/// Which media-carrying member of a part is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Member {
    /// `image_url`: an object with `url` (chat), or a string (Responses `input_image`).
    ImageUrl,
    /// `audio_url` / `video_url`: an object with `url`.
    Url(Carrier),
    /// `file`: an object with `file_data`.
    File,
    /// `file_data`: a string (Responses `input_file`).
    FileData,
    /// `input_audio`: an object with `data` and `format`.
    InputAudio,
    /// `source`: an object with `type`, `media_type` and `data`.
    Source,
}

impl<'de> DeserializeSeed<'de> for Member {
    type Value = Measured;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Measured, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Member {
    type Value = Measured;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Measured, E> {
        let bytes = v.len() as u64;
        let carrier = match self {
            Member::ImageUrl => Carrier::ImageUrlString,
            Member::FileData => Carrier::FileDataString,
            _ => return Ok(Measured::text(bytes)),
        };
        Ok(if is_binary_data_url(v) {
            Measured {
                text: 0,
                media: Some((carrier, bytes)),
            }
        } else {
            Measured::text(bytes)
        })
    }

    fn visit_bool<E>(self, _: bool) -> Result<Measured, E> {
        Ok(Measured::text(0))
    }

    fn visit_unit<E>(self) -> Result<Measured, E> {
        Ok(Measured::text(0))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Measured, E> {
        Ok(Measured::text(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Measured, E> {
        Ok(Measured::text(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Measured, E> {
        Ok(Measured::text(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Measured, A::Error> {
        Ok(Measured::text(text_seq(seq)?))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Measured, A::Error> {
        let (carrier, payload_key) = match self {
            Member::ImageUrl => (Carrier::ImageUrlObject, KeyName::Url),
            Member::Url(carrier) => (carrier, KeyName::Url),
            Member::File => (Carrier::FileObject, KeyName::FileData),
            Member::InputAudio => (Carrier::InputAudioObject, KeyName::Data),
            Member::Source => (Carrier::SourceObject, KeyName::Data),
            Member::FileData => return Ok(Measured::text(text_object(map)?)),
        };
        let mut text: u64 = 0;
        // Payload strings, media if the object's declarations say so at its end.
        let mut held: u64 = 0;
        // Every payload string held is a binary `data:` URL (the URL carriers' declaration).
        let mut binary_urls = true;
        let mut declared = Declared::default();
        while let Some(Name(key)) = map.next_key_seed(NameSeed)? {
            text = text.saturating_add(key.len);
            if key.name == payload_key {
                match map.next_value_seed(PayloadString)? {
                    PayloadValue::String { bytes, binary_url } => {
                        held = held.saturating_add(bytes);
                        binary_urls &= binary_url;
                    }
                    PayloadValue::Other(n) => text = text.saturating_add(n),
                }
                continue;
            }
            let declaration = match (self, key.name) {
                (Member::Source, KeyName::Type) => Some(Declaration::SourceType),
                (Member::Source, KeyName::MediaType) => Some(Declaration::MediaType),
                (Member::InputAudio, KeyName::Format) => Some(Declaration::AudioFormat),
                _ => None,
            };
            let n = match declaration {
                Some(d) => {
                    let (n, binary) = map.next_value_seed(DeclarationSeed(d))?;
                    declared.note(d, binary);
                    n
                }
                None => map.next_value_seed(TextSeed)?,
            };
            text = text.saturating_add(n);
        }
        let binary = match self {
            Member::ImageUrl | Member::Url(_) | Member::File => binary_urls,
            Member::InputAudio => declared.only_binary(&[Declaration::AudioFormat]),
            Member::Source => {
                declared.only_binary(&[Declaration::SourceType, Declaration::MediaType])
            }
            Member::FileData => false,
        };
        Ok(if binary && held > 0 {
            Measured {
                text,
                media: Some((carrier, held)),
            }
        } else {
            Measured::text(text.saturating_add(held))
        })
    }
}

/// What a media object declares of its payload's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Declaration {
    /// Anthropic `source.type`: binary when `base64`.
    SourceType,
    /// Anthropic `source.media_type`: binary when an image, audio, video or PDF type.
    MediaType,
    /// `input_audio.format`: binary when an audio format.
    AudioFormat,
}

/// Per declaration: seen as binary, seen otherwise.
#[derive(Debug, Default)]
struct Declared {
    binary: [bool; 3],
    other: [bool; 3],
}

impl Declared {
    fn note(&mut self, d: Declaration, binary: bool) {
        let seen = if binary {
            &mut self.binary
        } else {
            &mut self.other
        };
        if let Some(s) = seen.get_mut(d as usize) {
            *s = true;
        }
    }

    /// Each of `needed` declared, and only as binary (declared twice differently: a parser may
    /// read either, so not binary).
    fn only_binary(&self, needed: &[Declaration]) -> bool {
        needed.iter().all(|d| {
            self.binary.get(*d as usize) == Some(&true)
                && self.other.get(*d as usize) == Some(&false)
        })
    }
}

struct DeclarationSeed(Declaration);

impl<'de> DeserializeSeed<'de> for DeclarationSeed {
    type Value = (u64, bool);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DeclarationSeed {
    type Value = (u64, bool);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        let binary = match self.0 {
            Declaration::SourceType => v == "base64",
            Declaration::MediaType => is_binary_media_type(v),
            Declaration::AudioFormat => AUDIO_FORMATS.contains(&v),
        };
        Ok((v.len() as u64, binary))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok((0, false))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok((0, false))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, false))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, false))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok((PROMPT_BYTES_PER_TOKEN, false))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Ok((text_seq(seq)?, false))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok((text_object(map)?, false))
    }
}

/// `input_audio.format` values of audio (OpenAI's `wav` and `mp3`, and what servers add).
const AUDIO_FORMATS: [&str; 9] = [
    "wav", "mp3", "flac", "ogg", "opus", "aac", "m4a", "webm", "pcm16",
];

fn starts_with_ignore_case(s: &str, prefix: &str) -> bool {
    s.get(..prefix.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
}

/// A media type a backend decodes as binary media: `image/*`, `audio/*`, `video/*`,
/// `application/pdf` (case-insensitive, parameters ignored). Anything else (`text/*`, JSON, an
/// unknown or empty type) is text.
pub(super) fn is_binary_media_type(media_type: &str) -> bool {
    let essence = media_type.split(';').next().unwrap_or_default().trim();
    ["image/", "audio/", "video/"]
        .iter()
        .any(|p| starts_with_ignore_case(essence, p) && essence.len() > p.len())
        || essence.eq_ignore_ascii_case("application/pdf")
}

/// A `data:` URL (RFC 2397) of a binary media type; one without a type is `text/plain`.
pub(super) fn is_binary_data_url(s: &str) -> bool {
    if !starts_with_ignore_case(s, "data:") {
        return false;
    }
    match s.get(5..).and_then(|rest| rest.split_once(',')) {
        Some((header, _)) => is_binary_media_type(header),
        None => false,
    }
}

/// A payload member's value: a string held until its object's end, or anything else (counted).
enum PayloadValue {
    String { bytes: u64, binary_url: bool },
    Other(u64),
}

struct PayloadString;

impl<'de> DeserializeSeed<'de> for PayloadString {
    type Value = PayloadValue;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<PayloadValue, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PayloadString {
    type Value = PayloadValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<PayloadValue, E> {
        Ok(PayloadValue::String {
            bytes: v.len() as u64,
            binary_url: is_binary_data_url(v),
        })
    }

    fn visit_bool<E>(self, _: bool) -> Result<PayloadValue, E> {
        Ok(PayloadValue::Other(0))
    }

    fn visit_unit<E>(self) -> Result<PayloadValue, E> {
        Ok(PayloadValue::Other(0))
    }

    fn visit_u64<E>(self, _: u64) -> Result<PayloadValue, E> {
        Ok(PayloadValue::Other(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_i64<E>(self, _: i64) -> Result<PayloadValue, E> {
        Ok(PayloadValue::Other(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_f64<E>(self, _: f64) -> Result<PayloadValue, E> {
        Ok(PayloadValue::Other(PROMPT_BYTES_PER_TOKEN))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<PayloadValue, A::Error> {
        Ok(PayloadValue::Other(text_seq(seq)?))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PayloadValue, A::Error> {
        Ok(PayloadValue::Other(text_object(map)?))
    }
}

/// The object keys the estimate tells apart (everything else is [`KeyName::Other`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyName {
    Content,
    Output,
    Type,
    ImageUrl,
    AudioUrl,
    VideoUrl,
    Url,
    File,
    FileData,
    InputAudio,
    Source,
    Data,
    MediaType,
    Format,
    Other,
}

impl KeyName {
    /// A member a content part carries media in.
    fn is_media_member(self) -> bool {
        matches!(
            self,
            KeyName::ImageUrl
                | KeyName::AudioUrl
                | KeyName::VideoUrl
                | KeyName::File
                | KeyName::FileData
                | KeyName::InputAudio
                | KeyName::Source
        )
    }
}

/// An object key: its length (it counts) and which one it is.
struct Key {
    len: u64,
    name: KeyName,
}

struct Name(Key);

/// Reads a key in place (borrowed from the body, or the parser's scratch buffer when escaped:
/// compared decoded, as the backend's parser reads it).
struct NameSeed;

impl<'de> DeserializeSeed<'de> for NameSeed {
    type Value = Name;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Name, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameSeed {
    type Value = Name;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<Name, E> {
        let name = match key {
            "content" => KeyName::Content,
            "output" => KeyName::Output,
            "type" => KeyName::Type,
            "image_url" => KeyName::ImageUrl,
            "audio_url" => KeyName::AudioUrl,
            "video_url" => KeyName::VideoUrl,
            "url" => KeyName::Url,
            "file" => KeyName::File,
            "file_data" => KeyName::FileData,
            "input_audio" => KeyName::InputAudio,
            "source" => KeyName::Source,
            "data" => KeyName::Data,
            "media_type" => KeyName::MediaType,
            "format" => KeyName::Format,
            _ => KeyName::Other,
        };
        Ok(Name(Key {
            len: key.len() as u64,
            name,
        }))
    }
}

#[cfg(test)]
mod tests;
