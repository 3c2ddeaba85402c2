//! OpenAI chat ↔ AWS Bedrock Converse (a model of provider type `bedrock`).
//!
//! - [`request`]: the OpenAI chat body → a Converse body (`messages[].content[{text}]`, system
//!   and developer messages → `system[{text}]`, the cap → `inferenceConfig.maxTokens`,
//!   `temperature`, `top_p` → `topP`, `stop` → `stopSequences`; tools, tool calls, tool results
//!   and images as [`tools`] says); what has no faithful translation is refused (400
//!   `untranslatable_request`, named), never dropped;
//! - [`Answer`]: the provider's answer as it passes — a Converse JSON answer kept to its end and
//!   translated to a `chat.completion`, a ConverseStream (`application/vnd.amazon.eventstream`)
//!   translated message by message to `chat.completion.chunk` events and `data: [DONE]`, never
//!   kept whole; `toolUse` blocks → `tool_calls` (streamed: the call's id and name when its
//!   block starts, then each `input` fragment as an `arguments` delta). Its usage (the
//!   answer's `usage`, the stream's `metadata` event) is what the provider sent: metering reads
//!   it from here.

use super::eventstream::{Decoder, Message};
use super::request::{ClientAsk, Untranslatable, is_default, refuse};
use crate::usage::Usage;
use serde_json::{Map, Value, json};
use std::borrow::Cow;

/// Translates the OpenAI chat body into a Converse body. The cap is the body's own
/// (`max_completion_tokens`, else `max_tokens`: admission set one when the client named none).
pub fn request(body: &[u8]) -> Result<(Vec<u8>, ClientAsk), Untranslatable> {
    let Ok(Value::Object(openai)) = serde_json::from_slice::<Value>(body) else {
        return refuse("the body is not a JSON object");
    };
    let mut ask = ClientAsk::default();
    let mut inference = Map::new();
    let mut cap: Option<u64> = None;
    let mut messages: Option<&Vec<Value>> = None;
    let mut asked = tools::Asked::default();
    for (name, v) in &openai {
        if v.is_null() || is_default(name, v) {
            continue;
        }
        match name.as_str() {
            // In the path.
            "model" => {}
            "messages" => match v.as_array() {
                Some(m) => messages = Some(m),
                None => return refuse("messages must be an array"),
            },
            "max_tokens" | "max_completion_tokens" => match v.as_u64() {
                Some(n) => cap = Some(cap.map_or(n, |c| c.max(n))),
                None => return refuse(format!("{name} must be a non-negative integer")),
            },
            "temperature" | "top_p" => {
                if !v.is_number() {
                    return refuse(format!("{name} must be a number"));
                }
                let key = if name == "top_p" {
                    "topP"
                } else {
                    "temperature"
                };
                inference.insert(key.into(), v.clone());
            }
            "stream" => match v.as_bool() {
                Some(s) => ask.stream = s,
                None => return refuse("stream must be a boolean"),
            },
            "stream_options" => read_stream_options(v, &mut ask)?,
            "tools" => asked.tools = Some(v),
            "tool_choice" => asked.choice = Some(v),
            "parallel_tool_calls" => match v.as_bool() {
                Some(b) => asked.one_at_a_time = !b,
                None => return refuse("parallel_tool_calls must be a boolean"),
            },
            "stop" => {
                let stops = match v {
                    Value::String(s) => vec![Value::String(s.clone())],
                    Value::Array(a) if a.iter().all(Value::is_string) => a.clone(),
                    _ => return refuse("stop must be a string or an array of strings"),
                };
                inference.insert("stopSequences".into(), Value::Array(stops));
            }
            other => {
                return refuse(format!(
                    "{other} has no equivalent in this model's API (AWS Bedrock Converse)"
                ));
            }
        }
    }
    let Some(messages) = messages else {
        return refuse("messages is required");
    };
    let (system, messages, tool_blocks) = messages_of(messages)?;
    let tool_config = asked.config(tool_blocks)?;
    if let Some(cap) = cap.filter(|c| *c > 0) {
        inference.insert("maxTokens".into(), Value::from(cap));
    }
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(messages));
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    if !inference.is_empty() {
        out.insert("inferenceConfig".into(), Value::Object(inference));
    }
    if let Some(config) = tool_config {
        out.insert("toolConfig".into(), config);
    }
    let bytes = serde_json::to_vec(&Value::Object(out))
        .map_err(|e| Untranslatable(format!("the translated body could not be written: {e}")))?;
    Ok((bytes, ask))
}

fn read_stream_options(v: &Value, ask: &mut ClientAsk) -> Result<(), Untranslatable> {
    let Some(o) = v.as_object() else {
        return refuse("stream_options must be an object");
    };
    for (k, x) in o {
        match (k.as_str(), x) {
            ("include_usage", Value::Bool(b)) => ask.include_usage = *b,
            (_, Value::Null) => {}
            _ => return refuse(format!("stream_options.{k} cannot be translated")),
        }
    }
    Ok(())
}

/// The text of a message's `content`: a string, or `text` parts.
fn text_of(at: &str, content: Option<&Value>) -> Result<Vec<Value>, Untranslatable> {
    match content {
        Some(Value::String(s)) => Ok(vec![json!({"text": s})]),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match text_part(p) {
                Some(t) => Ok(json!({"text": t})),
                None => refuse(format!(
                    "{at}.content[{j}]: only text parts are translated here for this model"
                )),
            })
            .collect(),
        _ => refuse(format!(
            "{at}.content must be a string or an array of text parts"
        )),
    }
}

/// The text of a `{"type":"text","text":…}` part.
fn text_part(p: &Value) -> Option<&str> {
    match (p.get("type").and_then(Value::as_str), p.get("text")) {
        (Some("text"), Some(Value::String(t))) => Some(t),
        _ => None,
    }
}

/// A user message's content: a string, or `text` and `image_url` parts.
fn user_blocks(at: &str, content: Option<&Value>) -> Result<Vec<Value>, Untranslatable> {
    let Some(Value::Array(parts)) = content else {
        return text_of(at, content);
    };
    parts
        .iter()
        .enumerate()
        .map(|(j, p)| {
            if let Some(t) = text_part(p) {
                return Ok(json!({"text": t}));
            }
            let at = format!("{at}.content[{j}]");
            match p.get("type").and_then(Value::as_str) {
                Some("image_url") => tools::image_block(&at, p),
                Some(other) => refuse(format!("{at}: a {other:?} part cannot be translated")),
                None => refuse(format!("{at}: a part needs a type")),
            }
        })
        .collect()
}

/// Fields a message of `role` may carry (a `null` one is read as absent).
fn known_field(role: &str, k: &str) -> bool {
    match role {
        "assistant" => matches!(k, "role" | "content" | "name" | "tool_calls"),
        "tool" => matches!(k, "role" | "content" | "tool_call_id"),
        _ => matches!(k, "role" | "content" | "name"),
    }
}

/// The system blocks, the conversation (consecutive messages of one role joined: Converse
/// alternates roles, so a run of `tool` messages is one user message of `toolResult` blocks,
/// joined with a user message next to it), and whether it holds tool calls or results.
fn messages_of(messages: &[Value]) -> Result<(Vec<Value>, Vec<Value>, bool), Untranslatable> {
    let mut system = Vec::new();
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    let mut tool_blocks = false;
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
                "{at}.{k} has no equivalent in AWS Bedrock Converse"
            ));
        }
        let (role, blocks) = match role {
            "system" | "developer" => {
                system.extend(text_of(&at, m.get("content"))?);
                continue;
            }
            "user" => ("user", user_blocks(&at, m.get("content"))?),
            "assistant" => ("assistant", tools::assistant_blocks(&at, m)?),
            "tool" => ("user", vec![tools::tool_result(&at, m)?]),
            other => return refuse(format!("{at}.role {other:?} cannot be translated")),
        };
        tool_blocks |= blocks
            .iter()
            .any(|b| b.get("toolUse").is_some() || b.get("toolResult").is_some());
        let same = out
            .last_mut()
            .filter(|last| last.get("role").and_then(Value::as_str) == Some(role))
            .and_then(|last| last.get_mut("content"))
            .and_then(Value::as_array_mut);
        match same {
            Some(content) => content.extend(blocks),
            None => out.push(json!({"role": role, "content": blocks})),
        }
    }
    if out.is_empty() {
        return refuse("messages must hold a user message");
    }
    Ok((system, out, tool_blocks))
}

/// OpenAI's `finish_reason` for a Converse `stopReason`.
pub fn finish_reason(stop: Option<&str>) -> Value {
    match stop {
        None => Value::Null,
        Some("max_tokens" | "model_context_window_exceeded") => json!("length"),
        Some("tool_use") => json!("tool_calls"),
        Some("guardrail_intervened" | "content_filtered") => json!("content_filter"),
        Some(_) => json!("stop"),
    }
}

/// Converse `usage` (`inputTokens`, `outputTokens`, `totalTokens`, cache reads) as metering
/// counts it.
pub fn usage_of(v: &Value) -> Option<Usage> {
    let n = |k: &str| v.get(k).and_then(Value::as_u64);
    let (prompt, completion) = (n("inputTokens"), n("outputTokens"));
    if prompt.is_none() && completion.is_none() {
        return None;
    }
    let prompt_tokens = prompt.unwrap_or(0);
    let completion_tokens = completion.unwrap_or(0);
    Some(Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: n("totalTokens").unwrap_or(prompt_tokens.saturating_add(completion_tokens)),
        cached_input_tokens: n("cacheReadInputTokens").unwrap_or(0).min(prompt_tokens),
    })
}

fn openai_usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens},
    })
}

fn error_body(message: &str, kind: &str, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// A non-streamed Converse answer → `chat.completion` (and its usage); a Bedrock error
/// (`{"message": …}`) → an OpenAI error. `None`: neither.
pub fn completion(body: &[u8], model: &str, created: u64) -> Option<(Vec<u8>, Option<Usage>)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let Some(output) = v.get("output") else {
        let message = v.get("message").or_else(|| v.get("Message"))?.as_str()?;
        let out = error_body(message, "upstream_error", None);
        return Some((serde_json::to_vec(&out).ok()?, None));
    };
    let message = answer_message(output.pointer("/message/content"));
    let usage = v.get("usage").and_then(usage_of);
    let out = json!({
        "id": format!("chatcmpl-bedrock-{created}"),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(v.get("stopReason").and_then(Value::as_str)),
        }],
        "usage": usage.as_ref().map_or(Value::Null, openai_usage),
    });
    Some((serde_json::to_vec(&out).ok()?, usage))
}

/// The assistant message of a Converse answer's content: its text, and its `toolUse` blocks as
/// `tool_calls` (`arguments`: the input as a JSON string). Without text beside tool calls the
/// content is `null`, as OpenAI answers a tool call. Reasoning and other blocks are never asked
/// for by a translated request.
fn answer_message(content: Option<&Value>) -> Value {
    let mut text: Option<String> = None;
    let mut calls = Vec::new();
    for block in content.and_then(Value::as_array).into_iter().flatten() {
        if let Some(t) = block.get("text").and_then(Value::as_str) {
            text.get_or_insert_with(String::new).push_str(t);
        } else if let Some(u) = block.get("toolUse") {
            calls.push(json!({
                "id": u.get("toolUseId"),
                "type": "function",
                "function": {
                    "name": u.get("name"),
                    "arguments": u.get("input").map_or_else(|| "{}".to_string(), Value::to_string),
                },
            }));
        }
    }
    let content = match text {
        Some(t) => Value::String(t),
        None if !calls.is_empty() => Value::Null,
        None => Value::String(String::new()),
    };
    let mut message = json!({"role": "assistant", "content": content, "refusal": null});
    if !calls.is_empty()
        && let Some(o) = message.as_object_mut()
    {
        o.insert("tool_calls".into(), Value::Array(calls));
    }
    message
}

/// Largest non-streamed answer kept to be translated at its end.
pub const JSON_CAP: usize = super::answer::JSON_CAP;

#[derive(Debug)]
enum Mode {
    Json {
        kept: Vec<u8>,
        too_large: bool,
    },
    Stream(Box<StreamState>),
    /// Neither (an Envoy error page, a compressed answer): passed as it came.
    Passthrough,
}

/// One ConverseStream's translation state.
#[derive(Debug, Default)]
struct StreamState {
    decoder: Decoder,
    include_usage: bool,
    started: bool,
    done: bool,
    /// Content block index → tool call index, for the `toolUse` blocks started.
    tools: Vec<(u64, usize)>,
}

/// One Bedrock answer as it passes.
#[derive(Debug)]
pub struct Answer {
    mode: Mode,
    model: String,
    created: u64,
    usage: Option<Usage>,
    content_events: u64,
}

/// The content type of a ConverseStream answer.
pub const EVENTSTREAM: &str = "application/vnd.amazon.eventstream";

impl Answer {
    /// `content_type`, `identity` (not compressed) of the provider's answer; `model`: the name
    /// the client gets; `created`: now (seconds).
    pub fn new(
        content_type: &str,
        identity: bool,
        ask: ClientAsk,
        model: &str,
        created: u64,
    ) -> Self {
        let is = |t: &str| {
            content_type
                .get(..t.len())
                .is_some_and(|c| c.eq_ignore_ascii_case(t))
        };
        let mode = if !identity {
            Mode::Passthrough
        } else if is(EVENTSTREAM) {
            Mode::Stream(Box::new(StreamState {
                include_usage: ask.include_usage,
                ..StreamState::default()
            }))
        } else if content_type
            .as_bytes()
            .windows(4)
            .any(|w| w.eq_ignore_ascii_case(b"json"))
        {
            Mode::Json {
                kept: Vec::new(),
                too_large: false,
            }
        } else {
            Mode::Passthrough
        };
        Answer {
            mode,
            model: model.to_string(),
            created,
            usage: None,
            content_events: 0,
        }
    }

    /// The client gets an event stream (the content type to announce).
    pub fn is_stream(&self) -> bool {
        matches!(self.mode, Mode::Stream(_))
    }

    /// The usage the provider sent (the answer's `usage`, the stream's `metadata`).
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Text deltas of a stream (≈ completion tokens when no usage came).
    pub fn content_events(&self) -> u64 {
        self.content_events
    }

    /// Bytes kept for later chunks.
    pub fn pending(&self) -> usize {
        match &self.mode {
            Mode::Json { kept, .. } => kept.len(),
            Mode::Stream(s) => s.decoder.carried(),
            Mode::Passthrough => 0,
        }
    }

    /// One chunk of the provider's answer (`end`: its last): what the client gets now.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        match &mut self.mode {
            Mode::Passthrough => chunk.to_vec(),
            Mode::Json { kept, too_large } => {
                if !*too_large {
                    if kept.len().saturating_add(chunk.len()) > JSON_CAP {
                        *too_large = true;
                        *kept = Vec::new();
                    } else {
                        kept.extend_from_slice(chunk);
                    }
                }
                if !end {
                    return Vec::new();
                }
                if *too_large {
                    return untranslatable("the provider's answer is too large to translate");
                }
                let kept = std::mem::take(kept);
                match completion(&kept, &self.model, self.created) {
                    Some((out, usage)) => {
                        self.usage = usage;
                        out
                    }
                    None => kept,
                }
            }
            Mode::Stream(_) => self.feed_stream(chunk, end),
        }
    }

    fn feed_stream(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        let Mode::Stream(s) = &mut self.mode else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(chunk.len().saturating_mul(2));
        if s.done {
            return out;
        }
        let (messages, error) = s.decoder.feed(chunk);
        let head = Head {
            model: &self.model,
            created: self.created,
        };
        for m in &messages {
            let seen = stream_message(s, &head, m, &mut out);
            if let Some(u) = seen.usage {
                self.usage = Some(u);
            }
            self.content_events = self.content_events.saturating_add(seen.deltas);
            if s.done {
                return out;
            }
        }
        if let Some(e) = error {
            s.done = true;
            sse_error(&mut out, &e.to_string(), Some("untranslatable_response"));
        } else if end {
            // The stream ended without its metadata: the client still gets its end.
            s.done = true;
            out.extend_from_slice(b"data: [DONE]\n\n");
        }
        out
    }
}

/// What every chunk names.
struct Head<'a> {
    model: &'a str,
    created: u64,
}

/// A `contentBlockDelta` payload, as far as the translation reads it (no JSON tree built).
#[derive(serde::Deserialize)]
struct DeltaEvent<'a> {
    #[serde(rename = "contentBlockIndex", default)]
    index: u64,
    #[serde(borrow, default)]
    delta: Option<BlockDelta<'a>>,
}

#[derive(serde::Deserialize)]
struct BlockDelta<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "toolUse")]
    tool_use: Option<ToolDelta<'a>>,
}

/// A fragment of a tool call's input (JSON text, whole only once every fragment is joined).
#[derive(serde::Deserialize)]
struct ToolDelta<'a> {
    #[serde(borrow, default)]
    input: Option<Cow<'a, str>>,
}

impl Head<'_> {
    /// A content chunk, written straight (the stream's hot path: one per token).
    fn content(&self, out: &mut Vec<u8>, text: &str) {
        let created = self.created.to_string();
        out.extend_from_slice(b"data: {\"id\":\"chatcmpl-bedrock-");
        out.extend_from_slice(created.as_bytes());
        out.extend_from_slice(b"\",\"object\":\"chat.completion.chunk\",\"created\":");
        out.extend_from_slice(created.as_bytes());
        out.extend_from_slice(b",\"model\":");
        let _ = serde_json::to_writer(&mut *out, self.model);
        out.extend_from_slice(b",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
        let _ = serde_json::to_writer(&mut *out, text);
        out.extend_from_slice(b"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    }

    fn chunk(&self, out: &mut Vec<u8>, choices: Value, usage: Option<Value>) {
        let mut c = json!({
            "id": format!("chatcmpl-bedrock-{}", self.created),
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let (Some(u), Some(o)) = (usage, c.as_object_mut()) {
            o.insert("usage".into(), u);
        }
        out.extend_from_slice(b"data: ");
        let _ = serde_json::to_writer(&mut *out, &c);
        out.extend_from_slice(b"\n\n");
    }

    fn delta(&self, out: &mut Vec<u8>, delta: Value, finish: Value) {
        self.chunk(
            out,
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]),
            None,
        );
    }
}

/// What one stream message showed.
#[derive(Default)]
struct Seen {
    usage: Option<Usage>,
    deltas: u64,
}

/// Translates one ConverseStream message.
fn stream_message(s: &mut StreamState, head: &Head<'_>, m: &Message, out: &mut Vec<u8>) -> Seen {
    let mut seen = Seen::default();
    if m.message_type != "event" {
        // An exception (throttling, validation…) or an error: OpenAI's in-stream error.
        let payload: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
        let message = payload
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("the provider ended the stream with an error");
        sse_error(
            out,
            message,
            Some(m.kind.as_str()).filter(|k| !k.is_empty()),
        );
        s.done = true;
        return seen;
    }
    if !s.started && m.kind != "metadata" {
        s.started = true;
        head.delta(
            out,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        );
    }
    if m.kind == "contentBlockDelta" {
        if let Ok(DeltaEvent {
            index,
            delta: Some(delta),
        }) = serde_json::from_slice(&m.payload)
        {
            if let Some(t) = delta.text {
                seen.deltas = 1;
                head.content(out, &t);
            } else if let Some(part) = delta.tool_use.and_then(|u| u.input)
                && let Some(&(_, tool)) = s.tools.iter().find(|(i, _)| *i == index)
            {
                seen.deltas = 1;
                head.delta(
                    out,
                    json!({"tool_calls": [{"index": tool, "function": {"arguments": part}}]}),
                    Value::Null,
                );
            }
        }
        return seen;
    }
    let Ok(payload) = serde_json::from_slice::<Value>(&m.payload) else {
        return seen;
    };
    match m.kind.as_str() {
        "contentBlockStart" => tool_start(s, head, &payload, out),
        "messageStop" => head.delta(
            out,
            json!({}),
            finish_reason(payload.get("stopReason").and_then(Value::as_str)),
        ),
        "metadata" => {
            seen.usage = payload.get("usage").and_then(usage_of);
            if s.include_usage
                && let Some(u) = &seen.usage
            {
                head.chunk(out, json!([]), Some(openai_usage(u)));
            }
            out.extend_from_slice(b"data: [DONE]\n\n");
            s.done = true;
        }
        // messageStart (the role chunk went above), a text block's start, contentBlockStop,
        // anything newer.
        _ => {}
    }
    seen
}

/// A `toolUse` block starts: the client's tool call (the next index among this answer's
/// calls) with its id and name; its input follows in `arguments` fragments.
fn tool_start(s: &mut StreamState, head: &Head<'_>, payload: &Value, out: &mut Vec<u8>) {
    let Some(u) = payload.pointer("/start/toolUse") else {
        return;
    };
    let index = payload
        .get("contentBlockIndex")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let tool = s.tools.len();
    s.tools.push((index, tool));
    head.delta(
        out,
        json!({"tool_calls": [{"index": tool, "id": u.get("toolUseId"), "type": "function",
            "function": {"name": u.get("name"), "arguments": ""}}]}),
        Value::Null,
    );
}

fn sse_error(out: &mut Vec<u8>, message: &str, code: Option<&str>) {
    out.extend_from_slice(b"data: ");
    let _ = serde_json::to_writer(&mut *out, &error_body(message, "upstream_error", code));
    out.extend_from_slice(b"\n\n");
}

fn untranslatable(message: &str) -> Vec<u8> {
    serde_json::to_vec(&error_body(
        message,
        "upstream_error",
        Some("untranslatable_response"),
    ))
    .unwrap_or_default()
}

mod tools;

#[cfg(test)]
mod tests;
