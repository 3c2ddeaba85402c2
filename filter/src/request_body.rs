//! Request body inspection: the few top-level fields of a request the gateway needs.
//!
//! [`inspect`] reads `model`, `stream`, the cap fields (`max_tokens`, `max_completion_tokens`,
//! `max_output_tokens`), `n` / `best_of` and `stream_options.include_usage`, and estimates the
//! prompt ([`estimate`]) without building anything else (messages, tools…). A duplicated read
//! field is refused: the backend might read the other copy (one model billed as another).
//! [`with_include_usage`] sets `stream_options.include_usage = true` by splicing bytes, so every
//! other byte of the body is preserved exactly.

mod estimate;

use estimate::{Estimate, Place, Shape, Shaped, Tools};
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::fmt;

/// What the gateway reads from a request body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestInfo {
    pub model: Option<String>,
    pub stream: bool,
    /// The cap on generated tokens per choice, as the most generous server reads the body: the
    /// largest of every cap field any API family defines ([`CAP_FIELDS`]), `0` read as absent.
    /// `None`: the body has no cap (the reservation then takes the tier's default).
    pub max_tokens: Option<u64>,
    pub include_usage: bool,
    /// Completions asked for (`n`, or `best_of` when larger); 1 when absent.
    pub choices: u64,
    /// Estimated prompt tokens: [`PROMPT_BYTES_PER_TOKEN`] bytes of prompt text per token.
    pub prompt_tokens_estimate: u64,
    /// What the provider reads or runs beyond the body's text, when anything (boxed: most
    /// requests have none, and every request carries this).
    pub beyond_text: Option<Box<BeyondText>>,
}

/// What a request has the provider read or run that its text does not show.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BeyondText {
    /// Content parts that carry media (an image, audio, video or document: inline, a URL or a
    /// file id): each is reserved at the model's `mediaTokens` besides the text estimate.
    pub media_parts: u64,
    /// A field that makes the provider read context it holds, which the body does not show
    /// (Responses `previous_response_id`, `conversation`, a stored `prompt`): the prompt may
    /// then be anything up to the model's context window.
    pub stored_context: Option<&'static str>,
    /// A tool the provider runs itself inside the request (a `tools` entry whose `type` is not
    /// one the client runs, e.g. `web_search`, `file_search`, `code_interpreter`, `mcp`,
    /// Anthropic `web_search_20250305`; or `web_search_options`, `mcp_servers`): it reads
    /// content and may take turns the body does not show, so its cost has no bound.
    pub hosted_tool: Option<String>,
}

impl BeyondText {
    /// `None` when there is nothing beyond the text.
    fn boxed(self) -> Option<Box<BeyondText>> {
        (self != BeyondText::default()).then(|| Box::new(self))
    }
}

impl RequestInfo {
    /// [`BeyondText::media_parts`].
    pub fn media_parts(&self) -> u64 {
        self.beyond_text.as_ref().map_or(0, |b| b.media_parts)
    }

    /// [`BeyondText::stored_context`].
    pub fn stored_context(&self) -> Option<&'static str> {
        self.beyond_text.as_ref().and_then(|b| b.stored_context)
    }

    /// [`BeyondText::hosted_tool`].
    pub fn hosted_tool(&self) -> Option<&str> {
        self.beyond_text
            .as_ref()
            .and_then(|b| b.hosted_tool.as_deref())
    }
}

/// Every field an API family caps generation with: OpenAI chat `max_completion_tokens` (and its
/// deprecated `max_tokens`), completions `max_tokens`, Responses `max_output_tokens`, Anthropic
/// Messages `max_tokens`.
///
/// The cap is the largest of those present, whatever the operation: a server may read a field
/// of another family's vocabulary (vLLM and SGLang accept and ignore unknown fields, but a
/// lenient or translating server reads them), so a body's field from another family must cost,
/// not be free. And where a family has two fields the servers disagree: vLLM and SGLang take
/// `max_completion_tokens or max_tokens` — Python's `or`, so `0` (or null) falls through to the
/// other (vLLM `vllm/entrypoints/utils.py` `get_max_tokens` and `serving_engine.py`
/// `_validate_input`; SGLang `python/sglang/srt/entrypoints/openai/protocol.py`
/// `ChatCompletionRequest.to_sampling_params`: `"max_new_tokens": self.max_completion_tokens or
/// self.max_tokens`) — while OpenAI prefers `max_completion_tokens` and older servers read
/// `max_tokens` only. `{"max_completion_tokens": 0, "max_tokens": 50000}` generates 50,000 on
/// vLLM: the larger is what the most generous server generates, and `0` is read as absent
/// (SGLang reads `{"max_completion_tokens": 0}` alone as no cap at all).
pub const CAP_FIELDS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// Bytes of prompt text counted as one token when the prompt is estimated from the body.
///
/// The rule ([`estimate`]): below the top level, every object key and every string counts with
/// its UTF-8 length and every number as one token (token-id prompts), except a payload a backend
/// takes as binary media (a `data:` URL of an image, audio, video or PDF type, an Anthropic
/// `base64` source of such a type, `input_audio` data) where a content part of that media type
/// carries it; the top-level fields count their values (not `model` nor the fields read). The
/// sum divided by 4, rounded up. English prose runs at about 4 bytes per token, so the estimate is
/// close; no byte-level tokenizer produces more than one token per byte, so the real count of the
/// text is never more than 4× the estimate (plus per-message framing, which settlement corrects
/// after the response). Media parts are counted apart ([`RequestInfo::media_parts`]) and
/// reserved at the model's `mediaTokens`.
pub const PROMPT_BYTES_PER_TOKEN: u64 = 4;

/// Why a request body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    NotJson(String),
    NotAnObject,
    BadField {
        field: &'static str,
        message: String,
    },
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::NotJson(e) => write!(f, "request body is not valid JSON: {e}"),
            BodyError::NotAnObject => f.write_str("request body must be a JSON object"),
            BodyError::BadField { field, message } => write!(f, "'{field}' {message}"),
        }
    }
}

impl std::error::Error for BodyError {}

impl BodyError {
    /// The field at fault, as OpenAI's error `param` names it (`None`: the body as a whole).
    pub fn field(&self) -> Option<&'static str> {
        match self {
            BodyError::BadField { field, .. } => Some(field),
            BodyError::NotJson(_) | BodyError::NotAnObject => None,
        }
    }
}

/// The raw values of the fields read (small: only these are built, the rest is skipped).
#[derive(Default)]
struct Fields {
    model: Option<Raw>,
    stream: Option<Raw>,
    max_tokens: Option<Raw>,
    max_completion_tokens: Option<Raw>,
    max_output_tokens: Option<Raw>,
    stream_options: Option<Raw>,
    n: Option<Raw>,
    best_of: Option<Raw>,
    /// Prompt text bytes of every other field (see [`PROMPT_BYTES_PER_TOKEN`]).
    text_bytes: u64,
    /// Media parts of every other field ([`RequestInfo::media_parts`]).
    media_parts: u64,
    /// The first field found pointing at context the provider holds.
    stored_context: Option<&'static str>,
    /// The first tool found that the provider runs ([`RequestInfo::hosted_tool`]).
    hosted_tool: Option<String>,
    duplicate: Option<&'static str>,
}

#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Key {
    Model,
    Stream,
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    StreamOptions,
    N,
    BestOf,
    /// Chat and Anthropic `messages`: media parts may be left out of the estimate.
    Messages,
    /// Responses `input` (items with content parts; or a string, or embeddings' inputs).
    Input,
    /// Responses: context the provider holds (a stored response, a conversation, a stored
    /// prompt when `prompt` is an object; completions' `prompt` is text).
    PreviousResponseId,
    Conversation,
    Prompt,
    /// Tools: the provider runs some itself ([`RequestInfo::hosted_tool`]).
    Tools,
    /// Chat's web search (search models), Anthropic's MCP connector: run by the provider.
    WebSearchOptions,
    McpServers,
    #[serde(other)]
    Other,
}

impl Key {
    /// The name of a field that may point at context the provider holds, and whether a value
    /// of this shape does (`None`: not such a field).
    fn stored_context(&self, shape: Shape) -> Option<(&'static str, bool)> {
        Some(match self {
            Key::PreviousResponseId => ("previous_response_id", shape != Shape::Null),
            Key::Conversation => ("conversation", shape != Shape::Null),
            Key::Prompt => ("prompt", shape == Shape::Object),
            _ => return None,
        })
    }

    /// The name of a top-level field whose value has the provider run a tool.
    fn hosted_field(&self) -> &'static str {
        match self {
            Key::WebSearchOptions => "web_search_options",
            _ => "mcp_servers",
        }
    }

    /// Where the value of a field that is not read sits, for the prompt estimate.
    fn place(&self) -> Place {
        match self {
            Key::Messages | Key::Input => Place::Messages,
            _ => Place::Text,
        }
    }
}

impl<'de> Deserialize<'de> for Fields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(FieldsVisitor)
    }
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let mut fields = Fields::default();
        while let Some(key) = map.next_key::<Key>()? {
            let (slot, name) = match key {
                Key::Model => (&mut fields.model, "model"),
                Key::Stream => (&mut fields.stream, "stream"),
                Key::MaxTokens => (&mut fields.max_tokens, "max_tokens"),
                Key::MaxCompletionTokens => {
                    (&mut fields.max_completion_tokens, "max_completion_tokens")
                }
                Key::MaxOutputTokens => (&mut fields.max_output_tokens, "max_output_tokens"),
                Key::StreamOptions => (&mut fields.stream_options, "stream_options"),
                Key::N => (&mut fields.n, "n"),
                Key::BestOf => (&mut fields.best_of, "best_of"),
                other @ (Key::Messages | Key::Input | Key::Other) => {
                    let tally = map.next_value_seed(Estimate(other.place()))?;
                    fields.text_bytes = fields.text_bytes.saturating_add(tally.text);
                    fields.media_parts = fields.media_parts.saturating_add(tally.media);
                    continue;
                }
                // Text as any field; any occurrence that points at stored context counts
                // (a repeated key: a parser may read either).
                Key::Tools => {
                    let (text, hosted) = map.next_value_seed(Tools)?;
                    fields.text_bytes = fields.text_bytes.saturating_add(text);
                    if fields.hosted_tool.is_none() {
                        fields.hosted_tool = hosted;
                    }
                    continue;
                }
                run @ (Key::WebSearchOptions | Key::McpServers) => {
                    let (text, shape) = map.next_value_seed(Shaped)?;
                    fields.text_bytes = fields.text_bytes.saturating_add(text);
                    if shape != Shape::Null && fields.hosted_tool.is_none() {
                        fields.hosted_tool = Some(run.hosted_field().to_string());
                    }
                    continue;
                }
                stored @ (Key::PreviousResponseId | Key::Conversation | Key::Prompt) => {
                    let (text, shape) = map.next_value_seed(Shaped)?;
                    fields.text_bytes = fields.text_bytes.saturating_add(text);
                    if let Some((name, true)) = stored.stored_context(shape) {
                        fields.stored_context.get_or_insert(name);
                    }
                    continue;
                }
            };
            let value = map.next_value::<Raw>()?;
            if slot.is_some() {
                fields.duplicate.get_or_insert(name);
            } else {
                *slot = Some(value);
            }
        }
        Ok(fields)
    }
}

/// A read field's value, as far as its checks need it: any JSON value is accepted here (the
/// types are checked once the whole body parsed, so a syntax error anywhere wins), only a string
/// is kept (the model name), and everything else is visited, not built: every string in it is
/// still checked UTF-8, as `serde_json::Value` checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Raw {
    Null,
    Bool(bool),
    /// A non-negative integer within u64.
    Count(u64),
    Str(String),
    /// An object: its last `include_usage` member (`stream_options`).
    Object {
        include_usage: Option<Scalar>,
    },
    /// Any other number, or an array.
    Other,
}

/// `stream_options.include_usage` as far as its check needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scalar {
    Null,
    Bool(bool),
    Other,
}

impl<'de> Deserialize<'de> for Raw {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(RawVisitor)
    }
}

struct RawVisitor;

impl<'de> Visitor<'de> for RawVisitor {
    type Value = Raw;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Raw, E> {
        Ok(Raw::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Raw, E> {
        Ok(Raw::Bool(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Raw, E> {
        Ok(Raw::Count(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Raw, E> {
        Ok(u64::try_from(v).map_or(Raw::Other, Raw::Count))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Raw, E> {
        Ok(Raw::Other)
    }

    fn visit_str<E>(self, v: &str) -> Result<Raw, E> {
        Ok(Raw::Str(v.to_string()))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Raw, A::Error> {
        SkipVisitor.visit_seq(seq)?;
        Ok(Raw::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw, A::Error> {
        let mut include_usage = None;
        while let Some(KeyIs(is_include_usage)) = map.next_key_seed(KeyIsSeed("include_usage"))? {
            if is_include_usage {
                include_usage = Some(map.next_value::<Scalar>()?);
            } else {
                map.next_value::<Skip>()?;
            }
        }
        Ok(Raw::Object { include_usage })
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Raw::deserialize(d)? {
            Raw::Null => Scalar::Null,
            Raw::Bool(b) => Scalar::Bool(b),
            _ => Scalar::Other,
        })
    }
}

/// Any JSON value, visited and dropped (its strings checked, nothing built).
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SkipVisitor)
    }
}

struct SkipVisitor;

impl<'de> Visitor<'de> for SkipVisitor {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_str<E>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Skip, A::Error> {
        while map.next_key::<Skip>()?.is_some() {
            map.next_value::<Skip>()?;
        }
        Ok(Skip)
    }
}

/// Whether an object key is the one looked for (read in place: no copy of the key).
struct KeyIs(bool);

struct KeyIsSeed(&'static str);

impl<'de> serde::de::DeserializeSeed<'de> for KeyIsSeed {
    type Value = KeyIs;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<KeyIs, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIsSeed {
    type Value = KeyIs;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<KeyIs, E> {
        Ok(KeyIs(key == self.0))
    }
}

fn first_non_ws(body: &[u8]) -> Option<u8> {
    body.iter()
        .copied()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
}

fn read_fields(body: &[u8]) -> Result<Fields, BodyError> {
    match first_non_ws(body) {
        Some(b'{') => {}
        None => return Err(BodyError::NotJson("empty body".to_string())),
        Some(_) => {
            return match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => Err(BodyError::NotAnObject),
                Err(e) => Err(BodyError::NotJson(e.to_string())),
            };
        }
    }
    let fields: Fields =
        serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
    if let Some(field) = fields.duplicate {
        return Err(BodyError::BadField {
            field,
            message: "appears more than once".to_string(),
        });
    }
    Ok(fields)
}

fn bad(field: &'static str, message: &str) -> BodyError {
    BodyError::BadField {
        field,
        message: message.to_string(),
    }
}

fn token_limit(field: &'static str, v: Option<&Raw>) -> Result<Option<u64>, BodyError> {
    match v {
        None | Some(Raw::Null) => Ok(None),
        Some(Raw::Count(n)) => Ok(Some(*n)),
        Some(_) => Err(bad(field, "must be a non-negative integer")),
    }
}

/// The cap ([`CAP_FIELDS`]): the largest of the fields given, `0` as absent; `None`: no cap.
fn cap(fields: [Option<u64>; 3]) -> Option<u64> {
    fields.into_iter().flatten().filter(|n| *n != 0).max()
}

/// Reads only the top-level fields needed (model, stream, the cap fields, n / best_of,
/// stream_options.include_usage) and estimates the prompt. Wrong types → [`BodyError::BadField`]
/// naming the field.
///
/// The API family does not reach this function, on purpose: the cap is the largest of every
/// family's cap fields and the estimate counts every field, so a field of another family's
/// vocabulary costs the same in any operation (see [`CAP_FIELDS`]).
pub fn inspect(body: &[u8]) -> Result<RequestInfo, BodyError> {
    let f = read_fields(body)?;
    let model = match f.model {
        None | Some(Raw::Null) => None,
        Some(Raw::Str(s)) => Some(s),
        Some(_) => return Err(bad("model", "must be a string")),
    };
    let stream = match f.stream {
        None | Some(Raw::Null) => false,
        Some(Raw::Bool(b)) => b,
        Some(_) => return Err(bad("stream", "must be a boolean")),
    };
    let max_tokens = token_limit("max_tokens", f.max_tokens.as_ref())?;
    let max_completion_tokens =
        token_limit("max_completion_tokens", f.max_completion_tokens.as_ref())?;
    let max_output_tokens = token_limit("max_output_tokens", f.max_output_tokens.as_ref())?;
    let include_usage = match f.stream_options {
        None | Some(Raw::Null) => false,
        Some(Raw::Object { include_usage }) => match include_usage {
            None | Some(Scalar::Null) => false,
            Some(Scalar::Bool(b)) => b,
            Some(Scalar::Other) => {
                return Err(bad("stream_options.include_usage", "must be a boolean"));
            }
        },
        Some(_) => return Err(bad("stream_options", "must be an object")),
    };
    let n = token_limit("n", f.n.as_ref())?.unwrap_or(1);
    let best_of = token_limit("best_of", f.best_of.as_ref())?.unwrap_or(1);
    Ok(RequestInfo {
        model,
        stream,
        max_tokens: cap([max_tokens, max_completion_tokens, max_output_tokens]),
        include_usage,
        choices: n.max(best_of).max(1),
        prompt_tokens_estimate: f.text_bytes.div_ceil(PROMPT_BYTES_PER_TOKEN),
        beyond_text: BeyondText {
            media_parts: f.media_parts,
            stored_context: f.stored_context,
            hosted_tool: f.hosted_tool,
        }
        .boxed(),
    })
}

/// Returns the body with `stream_options.include_usage = true`, everything else preserved byte for
/// byte (other `stream_options` fields too).
pub fn with_include_usage(body: &[u8]) -> Result<Vec<u8>, BodyError> {
    // Validates the body (JSON object, no duplicates, right types) before splicing.
    inspect(body)?;
    splice_include_usage(body)
}

/// As [`with_include_usage`], for a body [`inspect`] has already accepted (the request path reads
/// the body once, not twice).
pub fn splice_include_usage(body: &[u8]) -> Result<Vec<u8>, BodyError> {
    let malformed = || BodyError::NotJson("malformed object".to_string());
    let open = skip_ws(body, 0);
    // What goes in at `at` (replacing up to `remove_to`), and whether a comma follows it.
    let (at, remove_to, insert, comma): (usize, usize, &[u8], bool) =
        match find_member(body, open, "stream_options").ok_or_else(malformed)? {
            (members, None) => {
                // Insert as the first member.
                let at = open.checked_add(1).ok_or_else(malformed)?;
                let ins = br#""stream_options":{"include_usage":true}"#;
                (at, at, ins, members > 0)
            }
            (_, Some((start, _))) if body.get(start) == Some(&b'{') => {
                match find_member(body, start, "include_usage").ok_or_else(malformed)? {
                    (_, Some((value, value_end))) => (value, value_end, b"true", false),
                    (inner, None) => {
                        let at = start.checked_add(1).ok_or_else(malformed)?;
                        (at, at, br#""include_usage":true"#, inner > 0)
                    }
                }
            }
            // null (inspect refused every other type)
            (_, Some((start, end))) => (start, end, br#"{"include_usage":true}"#, false),
        };
    let head = body.get(..at).ok_or_else(malformed)?;
    let tail = body.get(remove_to..).ok_or_else(malformed)?;
    let mut out = Vec::with_capacity(body.len().saturating_add(insert.len() + 1 + CAP_ROOM));
    out.extend_from_slice(head);
    out.extend_from_slice(insert);
    if comma {
        out.push(b',');
    }
    out.extend_from_slice(tail);
    Ok(out)
}

/// Sets the body's top-level member `name` to the number `value`, in place: the value of the
/// last member of that name replaced (the one parsers read), else the member inserted first;
/// every other byte preserved. For a body [`inspect`] has already accepted. Allocates only when
/// the body has no room for the change ([`splice_include_usage`] leaves [`CAP_ROOM`]).
pub fn set_number_member(body: &mut Vec<u8>, name: &str, value: u64) -> Result<(), BodyError> {
    use std::io::Write;
    // At most 20 digits, formatted without an allocation.
    let mut digits = [0u8; 24];
    let left = {
        let mut w = digits.as_mut_slice();
        write!(w, "{value}").map_err(|_| malformed())?;
        w.len()
    };
    let len = digits.len().saturating_sub(left);
    let digits = digits.get(..len).ok_or_else(malformed)?;
    set_member(body, name, digits)
}

/// Sets the body's top-level member `name` to the string `value` (JSON-escaped), in place, as
/// [`set_number_member`] does: the served model name given to the body's `model`.
pub fn set_string_member(body: &mut Vec<u8>, name: &str, value: &str) -> Result<(), BodyError> {
    let encoded = serde_json::to_vec(value).map_err(|e| BodyError::NotJson(e.to_string()))?;
    set_member(body, name, &encoded)
}

fn malformed() -> BodyError {
    BodyError::NotJson("malformed object".to_string())
}

/// Replaces the value of the last top-level member `name` with `raw` (a JSON value's bytes),
/// or inserts `"name":raw` as the first member.
fn set_member(body: &mut Vec<u8>, name: &str, raw: &[u8]) -> Result<(), BodyError> {
    let open = skip_ws(body, 0);
    let (at, remove_to, key, comma) = match find_member(body, open, name).ok_or_else(malformed)? {
        (_, Some((start, end))) => (start, end, false, false),
        (members, None) => {
            let at = open.checked_add(1).ok_or_else(malformed)?;
            (at, at, true, members > 0)
        }
    };
    if remove_to > body.len() || at > remove_to {
        return Err(malformed());
    }
    let (quote, colon): (&[u8], &[u8]) = if key { (b"\"", b"\":") } else { (b"", b"") };
    let key_name: &[u8] = if key { name.as_bytes() } else { b"" };
    let comma: &[u8] = if comma { b"," } else { b"" };
    let insert = quote
        .iter()
        .chain(key_name)
        .chain(colon)
        .chain(raw)
        .chain(comma)
        .copied();
    body.splice(at..remove_to, insert);
    Ok(())
}

/// Room [`splice_include_usage`] leaves in the body it returns for a cap set later
/// ([`set_number_member`]) without another allocation.
pub const CAP_ROOM: usize = 48;

fn key_is(body: &[u8], key: (usize, usize), name: &str) -> bool {
    let Some(raw) = body.get(key.0..key.1) else {
        return false;
    };
    let Some(inner) = raw.get(1..raw.len().saturating_sub(1)) else {
        return false;
    };
    if !inner.contains(&b'\\') {
        return inner == name.as_bytes();
    }
    matches!(serde_json::from_slice::<String>(raw), Ok(k) if k == name)
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i = i.saturating_add(1);
    }
    i
}

/// `i` at an opening quote: the index after the closing quote.
fn skip_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i.checked_add(1)?;
    loop {
        match b.get(j)? {
            b'"' => return j.checked_add(1),
            b'\\' => j = j.checked_add(2)?,
            _ => j = j.checked_add(1)?,
        }
    }
}

/// `i` at the start of a value: the index after it.
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth = depth.checked_add(1)?,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return j.checked_add(1);
                        }
                    }
                    _ => {}
                }
                j = j.checked_add(1)?;
            }
        }
        _ => {
            let mut j = i;
            while let Some(c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j = j.checked_add(1)?;
            }
            Some(j)
        }
    }
}

/// `open` at a `{`: the members of that object (the body is already known to be valid JSON).
/// The object at `open`: how many members it has, and the byte range (start, end) of the value
/// of the last member named `name` (a duplicated key: the last one is what most parsers read).
/// `None` when malformed.
fn find_member(b: &[u8], open: usize, name: &str) -> Option<(usize, Option<(usize, usize)>)> {
    if b.get(open) != Some(&b'{') {
        return None;
    }
    let (mut count, mut found) = (0usize, None);
    let mut i = skip_ws(b, open.checked_add(1)?);
    if b.get(i) == Some(&b'}') {
        return Some((count, found));
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = skip_string(b, i)?;
        let colon = skip_ws(b, key_end);
        if b.get(colon) != Some(&b':') {
            return None;
        }
        let v = skip_ws(b, colon.checked_add(1)?);
        let v_end = skip_value(b, v)?;
        count = count.saturating_add(1);
        if key_is(b, (i, key_end), name) {
            found = Some((v, v_end));
        }
        let next = skip_ws(b, v_end);
        match b.get(next)? {
            b',' => i = skip_ws(b, next.checked_add(1)?),
            b'}' => return Some((count, found)),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CHAT: &str = r#"{
  "model": "sim-model",
  "messages": [{"role": "system", "content": "You are \"model\": x"}, {"role": "user", "content": "Hi"}],
  "temperature": 0.7,
  "max_tokens": 64,
  "stream": true,
  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"model": 1, "stream": "x"}}}]
}"#;

    fn info(model: Option<&str>, stream: bool, max: Option<u64>, usage: bool) -> RequestInfo {
        RequestInfo {
            model: model.map(str::to_string),
            stream,
            max_tokens: max,
            include_usage: usage,
            choices: 1,
            prompt_tokens_estimate: 0,
            beyond_text: None,
        }
    }

    /// The fields `info` names (the prompt estimate has its own tests).
    fn core(r: Result<RequestInfo, BodyError>) -> Result<RequestInfo, BodyError> {
        r.map(|i| RequestInfo {
            prompt_tokens_estimate: 0,
            beyond_text: None,
            ..i
        })
    }

    #[test]
    fn tools_the_provider_runs_are_named() {
        let hosted = |body: serde_json::Value| {
            inspect(body.to_string().as_bytes())
                .unwrap()
                .hosted_tool()
                .map(str::to_string)
        };
        let f = serde_json::json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(hosted(serde_json::json!({"tools": [f]})), None);
        // Anthropic's own tools have no type; its client-run versions are the client's.
        assert_eq!(
            hosted(
                serde_json::json!({"tools": [{"name": "get", "input_schema": {}},
                {"type": "bash_20250124", "name": "bash"},
                {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
                {"type": "custom", "name": "x"}, {"type": null, "name": "y"}]})
            ),
            None
        );
        for (tool, named) in [
            (serde_json::json!({"type": "web_search"}), "web_search"),
            (
                serde_json::json!({"type": "file_search", "vector_store_ids": ["v"]}),
                "file_search",
            ),
            (
                serde_json::json!({"type": "code_interpreter", "container": {"type": "auto"}}),
                "code_interpreter",
            ),
            (
                serde_json::json!({"type": "mcp", "server_url": "https://x"}),
                "mcp",
            ),
            (
                serde_json::json!({"type": "web_search_20250305", "name": "web_search", "max_uses": 5}),
                "web_search_20250305",
            ),
            (serde_json::json!({"type": 5}), "(not a string)"),
        ] {
            assert_eq!(
                hosted(serde_json::json!({"tools": [f, tool]})).as_deref(),
                Some(named),
                "{tool}"
            );
        }
        assert_eq!(
            hosted(serde_json::json!({"messages": [], "web_search_options": {}})).as_deref(),
            Some("web_search_options")
        );
        assert_eq!(
            hosted(serde_json::json!({"web_search_options": null})),
            None
        );
        assert_eq!(
            hosted(serde_json::json!({"mcp_servers": [{"type": "url", "url": "https://x"}]}))
                .as_deref(),
            Some("mcp_servers")
        );
        // A repeated `type`: any occurrence the provider runs counts.
        let twice = br#"{"tools":[{"type":"web_search","type":"function"}]}"#;
        assert_eq!(inspect(twice).unwrap().hosted_tool(), Some("web_search"));
        // A client's type string is kept to 64 bytes (a refusal names it), its text counted.
        let long = serde_json::json!({"tools": [{"type": "x".repeat(10_000)}]});
        let i = inspect(long.to_string().as_bytes()).unwrap();
        assert_eq!(i.hosted_tool().map(str::len), Some(64));
        assert!(i.prompt_tokens_estimate >= 2500);
        // Tools' text is still prompt.
        let big = serde_json::json!({"tools": [{"type": "web_search", "d": "a".repeat(400)}]});
        assert!(
            inspect(big.to_string().as_bytes())
                .unwrap()
                .prompt_tokens_estimate
                >= 100
        );
    }

    #[test]
    fn fields_pointing_at_stored_context_are_named() {
        let stored = |body: &str| inspect(body.as_bytes()).unwrap().stored_context();
        assert_eq!(
            stored(r#"{"input":"hi","previous_response_id":"resp_1"}"#),
            Some("previous_response_id")
        );
        assert_eq!(
            stored(r#"{"input":"hi","previous_response_id":null}"#),
            None
        );
        assert_eq!(
            stored(r#"{"input":"hi","conversation":{"id":"conv_1"}}"#),
            Some("conversation")
        );
        assert_eq!(
            stored(r#"{"input":"hi","conversation":"conv_1"}"#),
            Some("conversation")
        );
        assert_eq!(
            stored(r#"{"prompt":{"id":"pmpt_1","version":"2"}}"#),
            Some("prompt")
        );
        // Completions' prompt is text, not a reference.
        assert_eq!(stored(r#"{"prompt":"Once upon a time"}"#), None);
        assert_eq!(stored(r#"{"prompt":[1,2,3]}"#), None);
        // Escaped key, and a repeated one: any occurrence that points counts.
        assert_eq!(
            stored(r#"{"previous\u005fresponse_id":"resp_1"}"#),
            Some("previous_response_id")
        );
        assert_eq!(
            stored(r#"{"conversation":"c","conversation":null}"#),
            Some("conversation")
        );
        assert_eq!(
            stored(r#"{"messages":[{"role":"user","content":"hi"}]}"#),
            None
        );
        // Its text still counts as prompt.
        let i = inspect(br#"{"input":"","previous_response_id":"abcdefgh"}"#).unwrap();
        assert_eq!(i.prompt_tokens_estimate, 2);
    }

    #[test]
    fn prompt_estimate_counts_text_not_media_nor_model() {
        let text = "a".repeat(4000);
        let body = serde_json::json!({
            "model": "m".repeat(1000),
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "A".repeat(100_000))}}
                ]}
            ],
            "max_tokens": 1
        });
        let i = inspect(body.to_string().as_bytes()).unwrap();
        // 4000 text bytes + the keys and the type values (~60 bytes) → ~1015 tokens; never the
        // 100 kB image, never the model name.
        assert!(
            (1000..=1020).contains(&i.prompt_tokens_estimate),
            "{}",
            i.prompt_tokens_estimate
        );
        // A ~60k-token prompt is estimated as such, whatever max_tokens says.
        let big = serde_json::json!({"messages": [{"role": "user", "content": "word ".repeat(48_000)}], "max_tokens": 1});
        let i = inspect(big.to_string().as_bytes()).unwrap();
        assert!(
            i.prompt_tokens_estimate >= 60_000,
            "{}",
            i.prompt_tokens_estimate
        );
        // Token-id prompts count one token per id; Anthropic system + messages (their keys too)
        // and Responses input count too; top-level keys do not.
        let ids = inspect(br#"{"prompt":[1,2,3,4,5]}"#).unwrap();
        assert_eq!(ids.prompt_tokens_estimate, 5);
        let anthropic = inspect(br#"{"system":"abcdefgh","messages":[{"role":"user","content":"abcd"}],"max_tokens":9}"#).unwrap();
        assert_eq!(
            anthropic.prompt_tokens_estimate,
            (8 + "role".len() as u64 + 4 + "content".len() as u64 + 4).div_ceil(4)
        );
        let responses = inspect(br#"{"input":"abcdefghijkl","instructions":"abcd"}"#).unwrap();
        assert_eq!(responses.prompt_tokens_estimate, 4);
        // A `data` key outside a media part is text (escaped or not).
        let escaped =
            inspect(br#"{"messages":[{"d\u0061ta":"AAAAAAAAAAAAAAAA","text":"abcd"}]}"#).unwrap();
        assert_eq!(
            escaped.prompt_tokens_estimate,
            (4 + 16 + 4 + 4_u64).div_ceil(4)
        );
    }

    #[test]
    fn prompt_estimate_counts_tools_tool_calls_and_tool_results() {
        // What a tool conversation sends (Converse and Anthropic translate it) costs at
        // admission: the tool schemas (top-level `tools`, a field not read, counted as text),
        // the calls' arguments and the results (in `messages`), every key and string.
        let estimate = |v: serde_json::Value| {
            inspect(v.to_string().as_bytes())
                .unwrap()
                .prompt_tokens_estimate
        };
        let user = serde_json::json!([{"role": "user", "content": "hi"}]);
        let plain = estimate(serde_json::json!({"messages": user}));
        let description = "d".repeat(4000);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get",
            "description": description,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
        let with_tools = estimate(serde_json::json!({"messages": user, "tools": tools}));
        assert!(with_tools >= plain + 1000, "{plain} → {with_tools}");
        let arguments = format!("{{\"q\":\"{}\"}}", "a".repeat(4000));
        let result = "r".repeat(4000);
        let history = serde_json::json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "get", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": result}
        ]});
        assert!(estimate(history) >= plain + 2000);
        // An image's base64 bytes are media, never text: not estimated (the provider's usage
        // settles what the image cost).
        let image = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "A".repeat(40_000))}}
        ]}]});
        assert!(estimate(image) < plain + 50);
    }

    #[test]
    fn cap_is_the_largest_cap_field_of_any_family() {
        let cap = |body: &str| inspect(body.as_bytes()).map(|i| i.max_tokens);
        // Each family's own field.
        assert_eq!(cap(r#"{"max_tokens":7}"#), Ok(Some(7)));
        assert_eq!(cap(r#"{"max_completion_tokens":8}"#), Ok(Some(8)));
        assert_eq!(cap(r#"{"max_output_tokens":100000}"#), Ok(Some(100_000)));
        assert_eq!(cap(r#"{"max_output_tokens":null}"#), Ok(None));
        assert_eq!(cap(r#"{"max_output_t\u006fkens":9}"#), Ok(Some(9)));
        // Two fields: what the most generous server generates. vLLM / SGLang read
        // `max_completion_tokens or max_tokens` (0 falls through); servers reading max_tokens
        // only take the other.
        assert_eq!(
            cap(r#"{"max_completion_tokens":0,"max_tokens":50000}"#),
            Ok(Some(50_000))
        );
        assert_eq!(
            cap(r#"{"max_completion_tokens":9,"max_tokens":50}"#),
            Ok(Some(50))
        );
        assert_eq!(
            cap(r#"{"max_completion_tokens":null,"max_tokens":50}"#),
            Ok(Some(50))
        );
        // Another family's field costs too.
        assert_eq!(
            cap(r#"{"max_tokens":5,"max_output_tokens":100000}"#),
            Ok(Some(100_000))
        );
        assert_eq!(
            cap(r#"{"max_tokens":5,"max_completion_tokens":6,"max_output_tokens":4}"#),
            Ok(Some(6))
        );
        // 0 is no cap (SGLang reads `max_completion_tokens: 0` alone as no limit).
        for body in [
            r#"{"max_tokens":0}"#,
            r#"{"max_completion_tokens":0}"#,
            r#"{"max_output_tokens":0}"#,
            r#"{"max_tokens":0,"max_completion_tokens":0,"max_output_tokens":null}"#,
            r#"{}"#,
        ] {
            assert_eq!(cap(body), Ok(None), "{body}");
        }
        // Types are checked and a duplicate refused, as for the other cap fields.
        for body in [
            r#"{"max_output_tokens":"100000"}"#,
            r#"{"max_output_tokens":-1}"#,
            r#"{"max_output_tokens":1.5}"#,
            r#"{"max_output_tokens":1,"max_output_tokens":100000}"#,
        ] {
            assert!(
                matches!(
                    cap(body),
                    Err(BodyError::BadField {
                        field: "max_output_tokens",
                        ..
                    })
                ),
                "{body}: {:?}",
                cap(body)
            );
        }
    }

    #[test]
    fn choices_from_n_and_best_of() {
        assert_eq!((inspect(br#"{"n":3}"#)).unwrap().choices, 3);
        assert_eq!((inspect(br#"{"n":2,"best_of":5}"#)).unwrap().choices, 5);
        assert_eq!((inspect(br#"{"n":0}"#)).unwrap().choices, 1);
        assert_eq!((inspect(br#"{}"#)).unwrap().choices, 1);
        assert!(inspect(br#"{"n":"3"}"#).is_err());
        assert!(inspect(br#"{"n":1,"n":9}"#).is_err());
    }

    #[test]
    fn reads_fields() {
        assert_eq!(
            core(inspect(CHAT.as_bytes())),
            Ok(info(Some("sim-model"), true, Some(64), false))
        );
        assert_eq!(core(inspect(b"{}")), Ok(info(None, false, None, false)));
        assert_eq!(
            core(inspect(
                br#"{"model":null,"stream":null,"max_tokens":null,"stream_options":null}"#
            )),
            Ok(info(None, false, None, false))
        );
        assert_eq!(core(inspect(br#"{"max_tokens":5,"max_completion_tokens":9,"stream_options":{"include_usage":true,"continuous_usage_stats":false}}"#)),
            Ok(info(None, false, Some(9), true))
        );
        assert_eq!(
            core(inspect(br#"{"max_completion_tokens":0}"#)),
            Ok(info(None, false, None, false))
        );
        assert_eq!(
            core(inspect(br#"{"m\u006fdel":"a"}"#)),
            Ok(info(Some("a"), false, None, false))
        );
    }

    #[test]
    fn bad_fields_named() {
        let cases: &[(&str, &str)] = &[
            (r#"{"model":5}"#, "model"),
            (r#"{"model":["a"]}"#, "model"),
            (r#"{"stream":"true"}"#, "stream"),
            (r#"{"stream":1}"#, "stream"),
            (r#"{"max_tokens":-1}"#, "max_tokens"),
            (r#"{"max_tokens":1.5}"#, "max_tokens"),
            (r#"{"max_tokens":"10"}"#, "max_tokens"),
            (r#"{"max_completion_tokens":-3}"#, "max_completion_tokens"),
            (r#"{"stream_options":true}"#, "stream_options"),
            (
                r#"{"stream_options":{"include_usage":"yes"}}"#,
                "stream_options.include_usage",
            ),
            (r#"{"model":"a","model":"b"}"#, "model"),
            (r#"{"stream":true,"stream":false}"#, "stream"),
        ];
        for (body, field) in cases {
            match inspect(body.as_bytes()) {
                Err(e @ BodyError::BadField { .. }) => {
                    let BodyError::BadField { field: f, .. } = &e else {
                        unreachable!()
                    };
                    assert_eq!(f, field, "{body}");
                    assert!(e.to_string().starts_with(&format!("'{field}' ")), "{e}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn not_json_or_not_object() {
        for body in [
            &b""[..],
            b"  ",
            b"{",
            b"{\"model\":\"a\"",
            b"{\"a\":1} x",
            b"nope",
            b"\xff\xfe",
            b"{'a':1}",
        ] {
            assert!(
                matches!(inspect(body), Err(BodyError::NotJson(_))),
                "{body:?}"
            );
        }
        for body in [
            &b"[]"[..],
            b"[{\"model\":\"a\"}]",
            b"\"s\"",
            b"1",
            b"null",
            b" true ",
        ] {
            assert_eq!(core(inspect(body)), Err(BodyError::NotAnObject), "{body:?}");
        }
        assert!(
            BodyError::NotJson("x".into())
                .to_string()
                .contains("not valid JSON")
        );
    }

    #[test]
    fn a_number_member_is_inserted_or_its_value_replaced() {
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, r#"{"max_tokens":256}"#),
            (
                r#" { "model" : "m" } "#,
                r#" {"max_tokens":256, "model" : "m" } "#,
            ),
            (
                r#"{"max_tokens":null,"a":1}"#,
                r#"{"max_tokens":256,"a":1}"#,
            ),
            (r#"{"max_tokens" : 0 }"#, r#"{"max_tokens" : 256 }"#),
            // Nested members of the same name are not the top-level one.
            (
                r#"{"x":{"max_tokens":0},"b":"}"}"#,
                r#"{"max_tokens":256,"x":{"max_tokens":0},"b":"}"}"#,
            ),
            // An escaped key is the same key.
            (r#"{"max\u005ftokens":0}"#, r#"{"max\u005ftokens":256}"#),
        ];
        for (body, expected) in cases {
            let mut out = body.as_bytes().to_vec();
            set_number_member(&mut out, "max_tokens", 256).unwrap();
            assert_eq!(std::str::from_utf8(&out).unwrap(), *expected, "{body}");
            assert_eq!(inspect(&out).unwrap().max_tokens, Some(256), "{body}");
        }
    }

    #[test]
    fn include_usage_inserted_or_replaced() {
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, r#"{"stream_options":{"include_usage":true}}"#),
            (
                r#" { "model" : "m" } "#,
                r#" {"stream_options":{"include_usage":true}, "model" : "m" } "#,
            ),
            (
                r#"{"stream_options":null,"a":1}"#,
                r#"{"stream_options":{"include_usage":true},"a":1}"#,
            ),
            (
                r#"{"stream_options":{}}"#,
                r#"{"stream_options":{"include_usage":true}}"#,
            ),
            (
                r#"{"stream_options":{"continuous_usage_stats":true}}"#,
                r#"{"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#,
            ),
            (
                r#"{"stream_options":{"include_usage":false, "x":[1,{"include_usage":false}]},"b":"}"}"#,
                r#"{"stream_options":{"include_usage":true, "x":[1,{"include_usage":false}]},"b":"}"}"#,
            ),
            (
                r#"{"stream_options":{"include_usage" : null}}"#,
                r#"{"stream_options":{"include_usage" : true}}"#,
            ),
            (
                r#"{"x":{"stream_options":null},"stream\u005foptions":{"include_usage":false}}"#,
                r#"{"x":{"stream_options":null},"stream\u005foptions":{"include_usage":true}}"#,
            ),
        ];
        for (body, expected) in cases {
            let out = with_include_usage(body.as_bytes()).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), *expected, "{body}");
        }
        let out = with_include_usage(CHAT.as_bytes()).unwrap();
        assert_eq!(
            core(inspect(&out)),
            Ok(info(Some("sim-model"), true, Some(64), true))
        );
        assert!(with_include_usage(b"[1]").is_err());
        assert!(with_include_usage(br#"{"stream_options":1}"#).is_err());
    }

    /// The field checks as they were first written, over `serde_json::Value`: the oracle the
    /// typed field values must agree with.
    mod value_oracle {
        use super::super::{
            BodyError, Estimate, Key, PROMPT_BYTES_PER_TOKEN, Place, RequestInfo, bad, cap,
            first_non_ws,
        };
        use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
        use serde_json::Value;
        use std::fmt;

        /// The raw values of the fields read (small: only these are built, the rest is skipped).
        #[derive(Default)]
        struct Fields {
            model: Option<Value>,
            stream: Option<Value>,
            max_tokens: Option<Value>,
            max_completion_tokens: Option<Value>,
            max_output_tokens: Option<Value>,
            stream_options: Option<Value>,
            n: Option<Value>,
            best_of: Option<Value>,
            /// Prompt text bytes of every other field (see [`PROMPT_BYTES_PER_TOKEN`]).
            text_bytes: u64,
            media_parts: u64,
            stored_context: Option<&'static str>,
            hosted_tool: Option<String>,
            duplicate: Option<&'static str>,
        }

        impl<'de> Deserialize<'de> for Fields {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_map(FieldsVisitor)
            }
        }

        struct FieldsVisitor;

        impl<'de> Visitor<'de> for FieldsVisitor {
            type Value = Fields;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut fields = Fields::default();
                while let Some(key) = map.next_key::<Key>()? {
                    let (slot, name) = match key {
                        Key::Model => (&mut fields.model, "model"),
                        Key::Stream => (&mut fields.stream, "stream"),
                        Key::MaxTokens => (&mut fields.max_tokens, "max_tokens"),
                        Key::MaxCompletionTokens => {
                            (&mut fields.max_completion_tokens, "max_completion_tokens")
                        }
                        Key::MaxOutputTokens => {
                            (&mut fields.max_output_tokens, "max_output_tokens")
                        }
                        Key::StreamOptions => (&mut fields.stream_options, "stream_options"),
                        Key::N => (&mut fields.n, "n"),
                        Key::BestOf => (&mut fields.best_of, "best_of"),
                        other @ (Key::Messages | Key::Input | Key::Other) => {
                            let tally = map.next_value_seed(Estimate(other.place()))?;
                            fields.text_bytes = fields.text_bytes.saturating_add(tally.text);
                            fields.media_parts = fields.media_parts.saturating_add(tally.media);
                            continue;
                        }
                        beyond @ (Key::Tools
                        | Key::WebSearchOptions
                        | Key::McpServers
                        | Key::PreviousResponseId
                        | Key::Conversation
                        | Key::Prompt) => {
                            let value = map.next_value::<Value>()?;
                            let tally = serde::de::DeserializeSeed::deserialize(
                                Estimate(Place::Text),
                                &value,
                            )
                            .map_err(serde::de::Error::custom)?;
                            fields.text_bytes = fields.text_bytes.saturating_add(tally.text);
                            let (hosted, stored) = beyond_text_of(&beyond, &value);
                            if fields.hosted_tool.is_none() {
                                fields.hosted_tool = hosted;
                            }
                            if let Some(name) = stored {
                                fields.stored_context.get_or_insert(name);
                            }
                            continue;
                        }
                    };
                    let value = map.next_value::<Value>()?;
                    if slot.is_some() {
                        fields.duplicate.get_or_insert(name);
                    } else {
                        *slot = Some(value);
                    }
                }
                Ok(fields)
            }
        }

        /// The hosted tool and the stored-context field a top-level field's value names, as
        /// the rule reads them (a kept type string is cut at 64 bytes, as the walk keeps it).
        fn beyond_text_of(key: &Key, value: &Value) -> (Option<String>, Option<&'static str>) {
            let hosted_type = |t: &Value| match t.get("type") {
                None | Some(Value::Null) => None,
                Some(Value::String(t)) => super::super::estimate::is_hosted_tool(t).then(|| {
                    let mut end = t.len().min(64);
                    while !t.is_char_boundary(end) {
                        end -= 1;
                    }
                    t[..end].to_string()
                }),
                Some(_) => Some("(not a string)".to_string()),
            };
            match (key, value) {
                (Key::Tools, Value::Array(tools)) => (tools.iter().find_map(hosted_type), None),
                (Key::Tools, _) | (Key::WebSearchOptions | Key::McpServers, Value::Null) => {
                    (None, None)
                }
                (Key::WebSearchOptions, _) => (Some("web_search_options".into()), None),
                (Key::McpServers, _) => (Some("mcp_servers".into()), None),
                (Key::PreviousResponseId, v) => {
                    (None, (!v.is_null()).then_some("previous_response_id"))
                }
                (Key::Conversation, v) => (None, (!v.is_null()).then_some("conversation")),
                (_, v) => (None, v.is_object().then_some("prompt")),
            }
        }

        fn read_fields(body: &[u8]) -> Result<Fields, BodyError> {
            match first_non_ws(body) {
                Some(b'{') => {}
                None => return Err(BodyError::NotJson("empty body".to_string())),
                Some(_) => {
                    return match serde_json::from_slice::<IgnoredAny>(body) {
                        Ok(_) => Err(BodyError::NotAnObject),
                        Err(e) => Err(BodyError::NotJson(e.to_string())),
                    };
                }
            }
            let fields: Fields =
                serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
            if let Some(field) = fields.duplicate {
                return Err(BodyError::BadField {
                    field,
                    message: "appears more than once".to_string(),
                });
            }
            Ok(fields)
        }

        fn token_limit(field: &'static str, v: Option<&Value>) -> Result<Option<u64>, BodyError> {
            match v {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) => n
                    .as_u64()
                    .map(Some)
                    .ok_or_else(|| bad(field, "must be a non-negative integer")),
                Some(_) => Err(bad(field, "must be a non-negative integer")),
            }
        }

        pub(super) fn inspect(body: &[u8]) -> Result<RequestInfo, BodyError> {
            let f = read_fields(body)?;
            let model = match f.model {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s),
                Some(_) => return Err(bad("model", "must be a string")),
            };
            let stream = match f.stream {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => b,
                Some(_) => return Err(bad("stream", "must be a boolean")),
            };
            let max_tokens = token_limit("max_tokens", f.max_tokens.as_ref())?;
            let max_completion_tokens =
                token_limit("max_completion_tokens", f.max_completion_tokens.as_ref())?;
            let max_output_tokens = token_limit("max_output_tokens", f.max_output_tokens.as_ref())?;
            let include_usage = match f.stream_options {
                None | Some(Value::Null) => false,
                Some(Value::Object(o)) => match o.get("include_usage") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => {
                        return Err(bad("stream_options.include_usage", "must be a boolean"));
                    }
                },
                Some(_) => return Err(bad("stream_options", "must be an object")),
            };
            let n = token_limit("n", f.n.as_ref())?.unwrap_or(1);
            let best_of = token_limit("best_of", f.best_of.as_ref())?.unwrap_or(1);
            Ok(RequestInfo {
                model,
                stream,
                max_tokens: cap([max_tokens, max_completion_tokens, max_output_tokens]),
                include_usage,
                choices: n.max(best_of).max(1),
                prompt_tokens_estimate: f.text_bytes.div_ceil(PROMPT_BYTES_PER_TOKEN),
                beyond_text: super::super::BeyondText {
                    media_parts: f.media_parts,
                    stored_context: f.stored_context,
                    hosted_tool: f.hosted_tool,
                }
                .boxed(),
            })
        }
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 20, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(
                    "(model|stream|include_usage|stream_options|[a-z]{1,4})",
                    inner,
                    0..4
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn typed_fields_read_as_values_did() {
        for body in [
            r#"{"model":"m","stream":true,"max_tokens":5,"n":2,"best_of":3}"#,
            r#"{"model":1}"#,
            r#"{"model":null}"#,
            r#"{"model":{"a":1}}"#,
            r#"{"model":["x"]}"#,
            r#"{"stream":"yes"}"#,
            r#"{"stream":null}"#,
            r#"{"max_tokens":-0}"#,
            r#"{"max_tokens":-1}"#,
            r#"{"max_tokens":1.0}"#,
            r#"{"max_tokens":1e2}"#,
            r#"{"max_tokens":18446744073709551615}"#,
            r#"{"max_tokens":18446744073709551616}"#,
            r#"{"max_tokens":"5"}"#,
            r#"{"n":[1]}"#,
            r#"{"stream_options":{"include_usage":true,"include_usage":5}}"#,
            r#"{"stream_options":{"include_usage":1,"include_usage":false}}"#,
            r#"{"stream_options":{"include\u005fusage":true}}"#,
            r#"{"stream_options":{"include_usage":{"a":[1,2]}}}"#,
            r#"{"stream_options":{"x":[{"include_usage":5}]}}"#,
            r#"{"stream_options":[]}"#,
            r#"{"stream_options":"x"}"#,
            r#"{"stream_options":null}"#,
            r#"{"model":"a","model":"b"}"#,
            r#"{"max_tokens":1,"max_tokens":null}"#,
            r#"{"max_tokens":[1,{"a":"\ud800"}]}"#,
            r#"{"stream_options":{"x":"\ud800"}}"#,
            r#"{"model":"m","stream_options":{"x":[1,2,{"y":null}]}, "max_tokens": [1e400]}"#,
        ] {
            assert_eq!(
                inspect(body.as_bytes()),
                value_oracle::inspect(body.as_bytes()),
                "{body}"
            );
        }
        // Invalid UTF-8 inside a read field is still a JSON error, as it was.
        for body in [
            &b"{\"stream_options\":{\"x\":\"\xff\"}}"[..],
            &b"{\"max_tokens\":[\"\xff\"]}"[..],
            &b"{\"model\":\"\xff\"}"[..],
        ] {
            assert!(matches!(inspect(body), Err(BodyError::NotJson(_))));
            assert_eq!(inspect(body), value_oracle::inspect(body));
        }
    }

    proptest! {
        #[test]
        fn typed_fields_agree_with_values(v in json_value()) {
            let body = serde_json::to_vec(&v).unwrap();
            prop_assert_eq!(inspect(&body), value_oracle::inspect(&body));
        }

        #[test]
        fn typed_fields_agree_with_values_field_by_field(
            fields in proptest::collection::vec((
                "(model|stream|max_tokens|max_completion_tokens|max_output_tokens|stream_options|n|best_of|messages)",
                prop_oneof![json_value(), any::<u64>().prop_map(serde_json::Value::from)],
            ), 0..6),
        ) {
            // Written by hand: duplicated keys stay duplicated.
            let members: Vec<String> = fields
                .iter()
                .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).unwrap(), v))
                .collect();
            let body = format!("{{{}}}", members.join(","));
            prop_assert_eq!(inspect(body.as_bytes()), value_oracle::inspect(body.as_bytes()));
        }

        #[test]
        fn typed_fields_agree_with_values_on_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..120)) {
            prop_assert_eq!(inspect(&data), value_oracle::inspect(&data));
        }

        #[test]
        fn cap_is_the_largest_nonzero_cap_field(
            caps in proptest::collection::vec(proptest::option::of(prop_oneof![Just(0u64), 0..5u64, any::<u64>()]), 3),
            other in proptest::option::of(any::<u64>()),
        ) {
            let mut members: Vec<String> = CAP_FIELDS
                .iter()
                .zip(&caps)
                .filter_map(|(k, v)| v.map(|v| format!("{k:?}:{v}")))
                .collect();
            if let Some(v) = other {
                // A field no family caps with is not a cap.
                members.push(format!("\"max_new_tokens\":{v}"));
            }
            let body = format!("{{{}}}", members.join(","));
            let expected = caps.iter().flatten().copied().filter(|n| *n != 0).max();
            prop_assert_eq!(inspect(body.as_bytes()).unwrap().max_tokens, expected);
        }

        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = inspect(&data);
            let _ = with_include_usage(&data);
        }

        #[test]
        fn json_garbage_never_panics(v in json_value()) {
            let body = serde_json::to_vec(&v).unwrap();
            let r = inspect(&body);
            if !v.is_object() {
                prop_assert_eq!(r, Err(BodyError::NotAnObject));
            }
            let _ = with_include_usage(&body);
        }

        #[test]
        fn a_spliced_cap_is_what_a_parser_reads_and_the_rest_is_kept(
            extra in proptest::collection::btree_map("[a-z]{1,6}", json_value(), 0..5),
            existing in proptest::option::of(prop_oneof![
                Just(serde_json::Value::Null),
                Just(serde_json::json!(0)),
            ]),
            value in 1u64..1_000_000,
            pretty in any::<bool>(),
        ) {
            let mut obj: serde_json::Map<String, serde_json::Value> = extra.into_iter().collect();
            obj.remove("max_output_tokens");
            if let Some(e) = existing {
                obj.insert("max_output_tokens".into(), e);
            }
            let v = serde_json::Value::Object(obj);
            let body = if pretty {
                serde_json::to_vec_pretty(&v).unwrap()
            } else {
                serde_json::to_vec(&v).unwrap()
            };
            let mut out = body.clone();
            set_number_member(&mut out, "max_output_tokens", value).unwrap();
            // Both read by the same parser (floats need not round-trip through `v`).
            let mut parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
            let mut expected: serde_json::Value = serde_json::from_slice(&body).unwrap();
            prop_assert_eq!(parsed["max_output_tokens"].as_u64(), Some(value));
            parsed.as_object_mut().unwrap().remove("max_output_tokens");
            expected.as_object_mut().unwrap().remove("max_output_tokens");
            prop_assert_eq!(parsed, expected);
        }

        #[test]
        fn with_include_usage_preserves_the_rest(
            extra in proptest::collection::btree_map("[a-z]{1,6}", json_value(), 0..5),
            model in proptest::option::of("[a-zA-Z0-9/_.\"\\\\-]{0,12}"),
            stream in proptest::option::of(any::<bool>()),
            max in proptest::option::of(any::<u64>()),
            so in prop_oneof![
                Just(None),
                Just(Some(serde_json::Value::Null)),
                proptest::collection::btree_map("(include_usage|[a-z]{1,6})", prop_oneof![
                    any::<bool>().prop_map(serde_json::Value::Bool),
                    Just(serde_json::Value::Null),
                ], 0..3).prop_map(|m| Some(serde_json::Value::Object(m.into_iter().collect()))),
            ],
            pretty in any::<bool>(),
        ) {
            // Fields the gateway reads and type-checks (n, best_of) are not "the rest".
            let mut obj: serde_json::Map<String, serde_json::Value> = extra
                .into_iter()
                .filter(|(k, _)| k != "n" && k != "best_of")
                .collect();
            if let Some(m) = &model { obj.insert("model".into(), m.clone().into()); }
            if let Some(s) = stream { obj.insert("stream".into(), s.into()); }
            if let Some(m) = max { obj.insert("max_tokens".into(), m.into()); }
            if let Some(s) = &so { obj.insert("stream_options".into(), s.clone()); }
            let v = serde_json::Value::Object(obj);
            let body = if pretty { serde_json::to_vec_pretty(&v).unwrap() } else { serde_json::to_vec(&v).unwrap() };
            let before = inspect(&body).unwrap();
            prop_assert_eq!(&before.model, &model);
            let out = with_include_usage(&body).unwrap();
            let after = inspect(&out).unwrap();
            prop_assert_eq!(after, RequestInfo { include_usage: true, ..before });
            // Everything else is unchanged, other stream_options fields included.
            let mut v2: serde_json::Value = serde_json::from_slice(&out).unwrap();
            // Compared with the body as parsed (serde_json float parsing is not exact round-trip).
            let mut v1: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let so1 = v1.as_object_mut().unwrap().remove("stream_options");
            let so2 = v2.as_object_mut().unwrap().remove("stream_options").unwrap();
            prop_assert_eq!(v1, v2);
            let mut so2 = so2.as_object().unwrap().clone();
            prop_assert_eq!(so2.remove("include_usage"), Some(serde_json::Value::Bool(true)));
            let mut rest1 = so1.and_then(|s| s.as_object().cloned()).unwrap_or_default();
            rest1.remove("include_usage");
            prop_assert_eq!(rest1, so2);
        }
    }
}
