//! OpenAI chat ↔ Gemini on Vertex AI, in Vertex's own API (a model of provider type `vertex`
//! with `publisher: google`, called at `…/publishers/google/models/{model}:generateContent`, a
//! stream at `:streamGenerateContent?alt=sse`).
//!
//! - [`request`]: the OpenAI chat body → a `GenerateContentRequest`: `messages` → `contents`
//!   (`assistant` → role `model`, consecutive messages of one role joined), system and developer
//!   messages → `systemInstruction`, text parts → `{text}`, `data:` image URLs →
//!   `{inlineData}`, the cap → `generationConfig.maxOutputTokens`, `temperature`, `top_p` →
//!   `topP`, `stop` → `stopSequences`, `seed`, the penalties, `response_format` →
//!   `responseMimeType` (and a `json_schema`'s schema → `responseJsonSchema`), function tools,
//!   tool calls and results as [`tools`] says. What has no faithful translation (several
//!   choices, `strict` schemas, logprobs, an image by URL…) is refused (400
//!   `untranslatable_request`, named), never dropped;
//! - [`Answer`]: the provider's answer as it passes — a JSON answer kept to its end and
//!   translated to a `chat.completion`; an SSE stream translated event by event to
//!   `chat.completion.chunk` events, then (when it ends) the usage chunk if asked and
//!   `data: [DONE]`, carrying only an incomplete event between chunks. Its usage
//!   (`usageMetadata`, the last one a stream sent) is what the provider sent: metering reads it
//!   from here. Thought parts (a thinking model's reasoning) never reach the client; their
//!   tokens count as completion tokens, as Google bills them. `functionCall` parts come back as
//!   `tool_calls` (streamed: one delta per call, whole, as Gemini sends it), the finish reason
//!   `tool_calls` when the turn ended on them.

use super::chunks::{Api, Head, Seen, Translated, error_body, openai_usage, sse_error};
use super::request::{
    ChatFields, ClientAsk, Untranslatable, is_default, join_turn, refuse, stop_sequences,
};
use crate::usage::Usage;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::borrow::Cow;

/// Translates the OpenAI chat body into a `GenerateContentRequest`. The cap is the body's own
/// (`max_completion_tokens`, else `max_tokens`: admission set one when the client named none).
pub fn request(body: &[u8]) -> Result<(Vec<u8>, ClientAsk), Untranslatable> {
    let Ok(Value::Object(openai)) = serde_json::from_slice::<Value>(body) else {
        return refuse("the body is not a JSON object");
    };
    let mut fields = ChatFields::default();
    let mut config = Map::new();
    for (name, v) in &openai {
        if v.is_null() || is_default(name, v) || fields.read(name, v)? {
            continue;
        }
        match name.as_str() {
            "temperature" | "top_p" | "presence_penalty" | "frequency_penalty" | "seed"
            | "stop" | "response_format" => generation_field(name, v, &mut config)?,
            other => {
                return refuse(format!(
                    "{other} has no equivalent in this model's API (Gemini generateContent)"
                ));
            }
        }
    }
    let (system, contents) = contents_of(fields.messages()?)?;
    let (declarations, tool_config) = tools::config(&fields.tools)?;
    if let Some(cap) = fields.cap.filter(|c| *c > 0) {
        config.insert("maxOutputTokens".into(), Value::from(cap));
    }
    let mut out = Map::new();
    out.insert("contents".into(), Value::Array(contents));
    if !system.is_empty() {
        out.insert("systemInstruction".into(), json!({"parts": system}));
    }
    if !config.is_empty() {
        out.insert("generationConfig".into(), Value::Object(config));
    }
    if let Some(d) = declarations {
        out.insert("tools".into(), d);
    }
    if let Some(c) = tool_config {
        out.insert("toolConfig".into(), c);
    }
    let bytes = serde_json::to_vec(&Value::Object(out))
        .map_err(|e| Untranslatable(format!("the translated body could not be written: {e}")))?;
    Ok((bytes, fields.ask))
}

/// A sampling or output field of the OpenAI body → its `generationConfig` member.
fn generation_field(
    name: &str,
    v: &Value,
    config: &mut Map<String, Value>,
) -> Result<(), Untranslatable> {
    match name {
        "temperature" | "top_p" | "presence_penalty" | "frequency_penalty" => {
            if !v.is_number() {
                return refuse(format!("{name} must be a number"));
            }
            let key = match name {
                "top_p" => "topP",
                "presence_penalty" => "presencePenalty",
                "frequency_penalty" => "frequencyPenalty",
                _ => "temperature",
            };
            config.insert(key.into(), v.clone());
        }
        "seed" => match v.as_i64() {
            Some(s) => {
                config.insert("seed".into(), Value::from(s));
            }
            None => return refuse("seed must be an integer"),
        },
        "stop" => {
            config.insert("stopSequences".into(), stop_sequences(v)?);
        }
        "response_format" => {
            config.insert("responseMimeType".into(), json!("application/json"));
            if let Some(schema) = response_schema(v)? {
                config.insert("responseJsonSchema".into(), schema.clone());
            }
        }
        _ => return refuse(format!("{name} cannot be translated")),
    }
    Ok(())
}

/// The system parts and the conversation (consecutive messages of one role joined).
fn contents_of(messages: &[Value]) -> Result<(Vec<Value>, Vec<Value>), Untranslatable> {
    let mut system = Vec::new();
    // The tool calls made so far (id → function name): a tool result names its function.
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(m) = m.as_object() else {
            return refuse(format!("{at} must be an object"));
        };
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if let Some((k, _)) = m
            .iter()
            .find(|(k, v)| !v.is_null() && !known_field(role, k))
        {
            return refuse(format!(
                "{at}.{k} has no equivalent in Gemini generateContent"
            ));
        }
        let content = m.get("content");
        let (role, parts) = match role {
            "system" | "developer" => {
                system.extend(parts_of(&at, content, false)?);
                continue;
            }
            "user" => ("user", parts_of(&at, content, true)?),
            "assistant" => ("model", tools::assistant_parts(&at, m, &mut calls)?),
            "tool" => ("user", vec![tools::function_response(&at, m, &calls)?]),
            other => return refuse(format!("{at}.role {other:?} cannot be translated")),
        };
        join_turn(&mut out, role, "parts", parts);
    }
    if out.is_empty() {
        return refuse("messages must hold a user message");
    }
    Ok((system, out))
}

/// Fields a message of `role` may carry (a `null` one is read as absent).
fn known_field(role: &str, k: &str) -> bool {
    match role {
        "assistant" => matches!(k, "role" | "content" | "name" | "tool_calls"),
        "tool" => matches!(k, "role" | "content" | "tool_call_id"),
        _ => matches!(k, "role" | "content" | "name"),
    }
}

/// The JSON Schema a `response_format` asks the answer to follow (`None`: `json_object`, any
/// JSON). `json_schema` → Gemini's `responseJsonSchema` (JSON Schema as written); its `name`
/// and `description` name nothing Gemini reads, and `strict: true` (OpenAI's exact adherence)
/// is refused rather than promised.
fn response_schema(v: &Value) -> Result<Option<&Value>, Untranslatable> {
    match v.get("type").and_then(Value::as_str) {
        Some("json_object") => Ok(None),
        Some("json_schema") => {
            let Some(spec) = v.get("json_schema").and_then(Value::as_object) else {
                return refuse("response_format.json_schema must be an object");
            };
            for (k, x) in spec {
                match (k.as_str(), x) {
                    ("name" | "description", _) | (_, Value::Null) => {}
                    ("schema", Value::Object(_)) | ("strict", Value::Bool(false)) => {}
                    _ => {
                        return refuse(format!(
                            "response_format.json_schema.{k} cannot be translated for Gemini"
                        ));
                    }
                }
            }
            match spec.get("schema") {
                Some(schema @ Value::Object(_)) => Ok(Some(schema)),
                _ => refuse("response_format.json_schema.schema is required"),
            }
        }
        _ => refuse("response_format must be json_object or json_schema"),
    }
}

/// A message's parts: a string, or `text` parts (and `image_url` parts with `images`).
pub(super) fn parts_of(
    at: &str,
    content: Option<&Value>,
    images: bool,
) -> Result<Vec<Value>, Untranslatable> {
    match content {
        Some(Value::String(s)) => Ok(vec![json!({"text": s})]),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| {
                let at = format!("{at}.content[{j}]");
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(json!({"text": t})),
                    (Some("image_url"), _) if images => image_part(&at, p),
                    (Some(other), _) => {
                        refuse(format!("{at}: a {other:?} part cannot be translated"))
                    }
                    (None, _) => refuse(format!("{at}: a part needs a type")),
                }
            })
            .collect(),
        _ => refuse(format!(
            "{at}.content must be a string or an array of text parts"
        )),
    }
}

/// An `image_url` part given as a `data:` URL → `inlineData` (the gateway fetches no URL).
fn image_part(at: &str, p: &Value) -> Result<Value, Untranslatable> {
    let Some(image) = p.get("image_url").and_then(Value::as_object) else {
        return refuse(format!("{at}.image_url must be an object"));
    };
    for (k, v) in image {
        match (k.as_str(), v) {
            ("url", _) | ("detail", Value::Null) => {}
            ("detail", Value::String(d)) if d == "auto" => {}
            _ => return refuse(format!("{at}.image_url.{k} cannot be translated")),
        }
    }
    let url = image.get("url").and_then(Value::as_str).unwrap_or_default();
    let Some((media_type, data)) = url
        .strip_prefix("data:")
        .and_then(|d| d.split_once(";base64,"))
    else {
        return refuse(format!(
            "{at}.image_url.url: send the image as a data:image/…;base64, URL (the gateway fetches no URL)"
        ));
    };
    if !matches!(
        media_type,
        "image/png" | "image/jpeg" | "image/webp" | "image/heic" | "image/heif"
    ) {
        return refuse(format!(
            "{at}.image_url.url: image type {media_type:?} cannot be sent (png, jpeg, webp, heic or heif)"
        ));
    }
    Ok(json!({"inlineData": {"mimeType": media_type, "data": data}}))
}

/// OpenAI's `finish_reason` for a Gemini `finishReason`.
pub fn finish_reason(reason: Option<&str>) -> Value {
    match reason {
        None => Value::Null,
        Some("MAX_TOKENS") => json!("length"),
        Some(
            "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY",
        ) => json!("content_filter"),
        // STOP, OTHER, FINISH_REASON_UNSPECIFIED and anything newer: the turn ended.
        Some(_) => json!("stop"),
    }
}

/// `usageMetadata`, as far as metering reads it.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct UsageMetadata {
    prompt_token_count: Option<u64>,
    tool_use_prompt_token_count: Option<u64>,
    candidates_token_count: Option<u64>,
    thoughts_token_count: Option<u64>,
    cached_content_token_count: Option<u64>,
    total_token_count: Option<u64>,
}

impl UsageMetadata {
    /// As metering counts it: prompt = prompt + tool-use prompt tokens (cached ones included),
    /// completion = candidates + thoughts (Google bills thinking as output). `None`: neither
    /// a prompt nor a candidates count.
    fn usage(&self) -> Option<Usage> {
        if self.prompt_token_count.is_none() && self.candidates_token_count.is_none() {
            return None;
        }
        let prompt_tokens = self
            .prompt_token_count
            .unwrap_or(0)
            .saturating_add(self.tool_use_prompt_token_count.unwrap_or(0));
        let completion_tokens = self
            .candidates_token_count
            .unwrap_or(0)
            .saturating_add(self.thoughts_token_count.unwrap_or(0));
        Some(Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: self
                .total_token_count
                .unwrap_or(0)
                .max(prompt_tokens.saturating_add(completion_tokens)),
            cached_input_tokens: self
                .cached_content_token_count
                .unwrap_or(0)
                .min(prompt_tokens),
        })
    }
}

/// `usageMetadata` as metering counts it ([`UsageMetadata::usage`]).
pub fn usage_of(v: &Value) -> Option<Usage> {
    UsageMetadata::deserialize(v).ok()?.usage()
}

/// A Google error (`{"error": {"code", "message", "status"}}`, or a list of them as a stream
/// method answers) → an OpenAI error with the same message, `code` its status.
fn google_error(v: &Value) -> Option<Value> {
    let error = match v {
        Value::Array(items) => items.first()?.get("error")?,
        other => other.get("error")?,
    };
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("the provider answered with an error");
    Some(error_body(
        message,
        error.get("status").and_then(Value::as_str),
    ))
}

/// The text of a candidate's parts (thought parts left out) and whether it had any text part.
fn candidate_text(candidate: &Value) -> Option<String> {
    let mut text: Option<String> = None;
    for part in candidate
        .pointer("/content/parts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if part.get("thought").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        if let Some(t) = part.get("text").and_then(Value::as_str) {
            text.get_or_insert_with(String::new).push_str(t);
        }
    }
    text
}

/// A candidate's `functionCall` parts as OpenAI tool calls (`id`: Gemini's own when it gives
/// one, else `call_<created>_<n>`, `n` counting from `first`; `arguments`: the args as a JSON
/// string).
fn candidate_calls(candidate: &Value, created: u64, first: usize) -> Vec<Value> {
    let calls = candidate
        .pointer("/content/parts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|part| part.get("functionCall"));
    openai_calls(calls, created, first)
}

/// Gemini `functionCall`s as OpenAI tool calls (see [`candidate_calls`]).
fn openai_calls<'v>(
    calls: impl Iterator<Item = &'v Value>,
    created: u64,
    first: usize,
) -> Vec<Value> {
    calls
        .enumerate()
        .map(|(n, call)| {
            let id = call
                .get("id")
                .and_then(Value::as_str)
                .map_or_else(|| format!("call_{created}_{}", first + n), str::to_string);
            json!({
                "id": id,
                "type": "function",
                "function": {
                    "name": call.get("name"),
                    "arguments": call.get("args").map_or_else(|| "{}".to_string(), Value::to_string),
                },
            })
        })
        .collect()
}

/// OpenAI's `finish_reason` of a candidate: `tool_calls` when it called a function and ended
/// its turn.
fn finish_of(reason: Option<&str>, called: bool) -> Value {
    match reason {
        Some("STOP") if called => json!("tool_calls"),
        other => finish_reason(other),
    }
}

/// A non-streamed answer → `chat.completion` (and its usage); a Google error → an OpenAI
/// error. `None`: neither.
pub fn completion(body: &[u8], model: &str, created: u64) -> Option<(Vec<u8>, Option<Usage>)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    if let Some(error) = google_error(&v) {
        return Some((serde_json::to_vec(&error).ok()?, None));
    }
    let usage = v.get("usageMetadata").and_then(usage_of);
    if v.get("candidates").is_none() && usage.is_none() {
        return None;
    }
    let candidate = v.pointer("/candidates/0").cloned().unwrap_or(Value::Null);
    let calls = candidate_calls(&candidate, created, 0);
    // A prompt blocked before any candidate: an empty answer, filtered.
    let finish = match candidate.get("finishReason").and_then(Value::as_str) {
        None if v.pointer("/promptFeedback/blockReason").is_some() => json!("content_filter"),
        reason => finish_of(reason, !calls.is_empty()),
    };
    let text = candidate_text(&candidate);
    let mut message = json!({
        "role": "assistant",
        // Calls without text: `null`, as OpenAI answers a tool call.
        "content": match text {
            None if !calls.is_empty() => Value::Null,
            t => Value::String(t.unwrap_or_default()),
        },
        "refusal": null,
    });
    if !calls.is_empty()
        && let Some(o) = message.as_object_mut()
    {
        o.insert("tool_calls".into(), Value::Array(calls));
    }
    let out = json!({
        "id": format!("chatcmpl-gemini-{created}"),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish,
        }],
        "usage": usage.as_ref().map_or(Value::Null, openai_usage),
    });
    Some((serde_json::to_vec(&out).ok()?, usage))
}

/// Largest event (its data plus the current line) carried between chunks; a longer one ends the
/// translation with an error event.
pub const EVENT_CAP: usize = super::stream::EVENT_CAP;

/// One stream's translation state: the SSE lines of an event not complete yet.
#[allow(clippy::struct_excessive_bools)] // parser flags on the stream path
#[derive(Debug, Default)]
pub struct StreamState {
    include_usage: bool,
    /// The current line, not terminated yet.
    line: Vec<u8>,
    /// A CR ended the last chunk's last line: an LF starting the next chunk belongs to it.
    after_cr: bool,
    /// `data` of the current event, lines joined by `\n`.
    data: Vec<u8>,
    has_data: bool,
    started: bool,
    finished: bool,
    done: bool,
    /// Tool calls sent so far (the next one's index).
    calls: usize,
}

/// Gemini's `generateContent`, as [`Translated`] reads it.
#[derive(Debug)]
pub struct Gemini;

/// One Gemini answer as it passes.
pub type Answer = Translated<Gemini>;

impl Api for Gemini {
    type Stream = StreamState;
    const STREAM_TYPE: &'static str = "text/event-stream";
    const ID_PREFIX: &'static str = "chatcmpl-gemini-";

    fn stream(ask: ClientAsk) -> StreamState {
        StreamState {
            include_usage: ask.include_usage,
            ..StreamState::default()
        }
    }

    fn completion(body: &[u8], model: &str, created: u64) -> Option<(Vec<u8>, Option<Usage>)> {
        completion(body, model, created)
    }

    fn carried(s: &StreamState) -> usize {
        s.line.len().saturating_add(s.data.len())
    }

    fn feed_stream(
        s: &mut StreamState,
        head: &Head<'_>,
        chunk: &[u8],
        end: bool,
        seen: &mut Seen,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len().saturating_mul(2));
        if s.done {
            return out;
        }
        let mut rest = chunk;
        if s.after_cr {
            s.after_cr = false;
            rest = rest.strip_prefix(b"\n").unwrap_or(rest);
        }
        while !s.done {
            let Some(at) = memchr::memchr2(b'\n', b'\r', rest) else {
                s.line.extend_from_slice(rest);
                break;
            };
            let (line, tail) = rest.split_at(at);
            s.line.extend_from_slice(line);
            let crlf = tail.starts_with(b"\r\n");
            s.after_cr = tail == b"\r";
            rest = tail.get(if crlf { 2 } else { 1 }..).unwrap_or_default();
            if let Some(shown) = end_line(s, head, &mut out) {
                if shown.usage.is_some() {
                    seen.usage = shown.usage;
                }
                seen.deltas = seen.deltas.saturating_add(shown.deltas);
            }
        }
        if !s.done && s.line.len().saturating_add(s.data.len()) > EVENT_CAP {
            s.done = true;
            sse_error(
                &mut out,
                "the provider sent an event too large to translate",
                Some("untranslatable_response"),
            );
        } else if end && !s.done {
            // Gemini's stream simply ends: the client's end (its usage first, if asked).
            s.done = true;
            if s.include_usage
                && let Some(u) = &seen.usage
            {
                head.chunk(&mut out, json!([]), Some(openai_usage(u)));
            }
            out.extend_from_slice(b"data: [DONE]\n\n");
        }
        out
    }
}

/// One line ended (in `s.line`): an event ends at an empty line. What the event showed.
fn end_line(s: &mut StreamState, head: &Head<'_>, out: &mut Vec<u8>) -> Option<Seen> {
    let mut line = std::mem::take(&mut s.line);
    let mut seen = None;
    if line.is_empty() {
        if s.has_data {
            let data = std::mem::take(&mut s.data);
            s.has_data = false;
            seen = Some(stream_event(s, head, &data, out));
            if data.capacity() <= 64 * 1024 {
                s.data = data;
                s.data.clear();
            }
        }
    } else if let Some(value) = line.strip_prefix(b"data:") {
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if s.has_data {
            s.data.push(b'\n');
        }
        s.data.extend_from_slice(value);
        s.has_data = true;
    }
    line.clear();
    s.line = line;
    seen
}

/// A stream event as far as the translation reads it, borrowed from its bytes (no JSON tree
/// for the text events that make up a stream).
#[derive(serde::Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    candidates: Vec<Candidate<'a>>,
    #[serde(rename = "usageMetadata", default)]
    usage: Option<UsageMetadata>,
    #[serde(rename = "promptFeedback", borrow, default)]
    feedback: Option<Feedback<'a>>,
    /// An error event is read again as a tree ([`google_error`]).
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(serde::Deserialize)]
struct Candidate<'a> {
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(rename = "finishReason", borrow, default)]
    finish: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct Content<'a> {
    #[serde(borrow, default)]
    parts: Vec<Part<'a>>,
}

#[derive(serde::Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    thought: Option<bool>,
    #[serde(rename = "functionCall", default)]
    function_call: Option<Value>,
}

#[derive(serde::Deserialize)]
struct Feedback<'a> {
    #[serde(rename = "blockReason", borrow, default)]
    block: Option<Cow<'a, str>>,
}

/// Translates one event's data (a `GenerateContentResponse`, or an error).
fn stream_event(s: &mut StreamState, head: &Head<'_>, data: &[u8], out: &mut Vec<u8>) -> Seen {
    let mut seen = Seen::default();
    let event = match serde_json::from_slice::<Event<'_>>(data) {
        Ok(e) if e.error.is_none() => e,
        // An error (alone, or in a list), or not an event: the stream ends there.
        _ => {
            s.done = true;
            match serde_json::from_slice::<Value>(data)
                .ok()
                .as_ref()
                .and_then(google_error)
            {
                Some(error) => {
                    out.extend_from_slice(b"data: ");
                    let _ = serde_json::to_writer(&mut *out, &error);
                    out.extend_from_slice(b"\n\n");
                }
                None => sse_error(
                    out,
                    "the provider sent an event that is not a Gemini answer",
                    Some("untranslatable_response"),
                ),
            }
            return seen;
        }
    };
    seen.usage = event.usage.as_ref().and_then(UsageMetadata::usage);
    if !s.started {
        s.started = true;
        head.delta(
            out,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        );
    }
    let candidate = event.candidates.first();
    let parts = candidate
        .and_then(|c| c.content.as_ref())
        .map_or(&[][..], |c| c.parts.as_slice());
    // The text of the event's parts (thought parts left out), borrowed when it is one part.
    let mut texts = parts
        .iter()
        .filter(|p| p.thought != Some(true))
        .filter_map(|p| p.text.as_deref())
        .filter(|t| !t.is_empty());
    if let Some(first) = texts.next() {
        seen.deltas = 1;
        match texts.next() {
            None => head.content(out, first),
            Some(second) => {
                let mut joined = format!("{first}{second}");
                texts.for_each(|t| joined.push_str(t));
                head.content(out, &joined);
            }
        }
    }
    // Gemini sends a call whole, in one part: one delta with its id, name and arguments.
    let calls = parts.iter().filter_map(|p| p.function_call.as_ref());
    for mut call in openai_calls(calls, head.created, s.calls) {
        if let Some(o) = call.as_object_mut() {
            o.insert("index".into(), json!(s.calls));
        }
        s.calls += 1;
        seen.deltas = 1;
        head.delta(out, json!({"tool_calls": [call]}), Value::Null);
    }
    let reason = candidate.and_then(|c| c.finish.as_deref());
    let blocked = event.feedback.is_some_and(|f| f.block.is_some());
    if !s.finished && (reason.is_some() || blocked) {
        s.finished = true;
        let finish = if reason.is_none() {
            json!("content_filter")
        } else {
            finish_of(reason, s.calls > 0)
        };
        head.delta(out, json!({}), finish);
    }
    seen
}

mod tools;

#[cfg(test)]
mod tests;
