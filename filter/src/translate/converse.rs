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

use super::chunks::{Api, Head, Seen, Translated, error_body, openai_usage, sse_error};
use super::eventstream::{Decoder, Message};
use super::request::{
    ChatFields, ClientAsk, Untranslatable, is_default, join_turn, refuse, stop_sequences,
};
use crate::usage::Usage;
use serde_json::{Map, Value, json};
use std::borrow::Cow;

/// Translates the OpenAI chat body into a Converse body. The cap is the body's own
/// (`max_completion_tokens`, else `max_tokens`: admission set one when the client named none).
pub fn request(body: &[u8]) -> Result<(Vec<u8>, ClientAsk), Untranslatable> {
    let Ok(Value::Object(openai)) = serde_json::from_slice::<Value>(body) else {
        return refuse("the body is not a JSON object");
    };
    let mut fields = ChatFields::default();
    let mut inference = Map::new();
    for (name, v) in &openai {
        if v.is_null() || is_default(name, v) || fields.read(name, v)? {
            continue;
        }
        match name.as_str() {
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
            "stop" => {
                inference.insert("stopSequences".into(), stop_sequences(v)?);
            }
            other => {
                return refuse(format!(
                    "{other} has no equivalent in this model's API (AWS Bedrock Converse)"
                ));
            }
        }
    }
    let (system, messages, tool_blocks) = messages_of(fields.messages()?)?;
    let tool_config = tools::config(&fields.tools, tool_blocks)?;
    if let Some(cap) = fields.cap.filter(|c| *c > 0) {
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
    Ok((bytes, fields.ask))
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
        join_turn(&mut out, role, "content", blocks);
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

/// A non-streamed Converse answer → `chat.completion` (and its usage); a Bedrock error
/// (`{"message": …}`) → an OpenAI error. `None`: neither.
pub fn completion(body: &[u8], model: &str, created: u64) -> Option<(Vec<u8>, Option<Usage>)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let Some(output) = v.get("output") else {
        let message = v.get("message").or_else(|| v.get("Message"))?.as_str()?;
        let out = error_body(message, None);
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

/// One ConverseStream's translation state.
#[derive(Debug, Default)]
pub struct StreamState {
    decoder: Decoder,
    include_usage: bool,
    started: bool,
    done: bool,
    /// Content block index → tool call index, for the `toolUse` blocks started.
    tools: Vec<(u64, usize)>,
}

/// AWS Bedrock Converse, as [`Translated`] reads it.
#[derive(Debug)]
pub struct Converse;

/// One Bedrock answer as it passes.
pub type Answer = Translated<Converse>;

/// The content type of a ConverseStream answer.
pub const EVENTSTREAM: &str = "application/vnd.amazon.eventstream";

impl Api for Converse {
    type Stream = StreamState;
    const STREAM_TYPE: &'static str = EVENTSTREAM;
    const ID_PREFIX: &'static str = "chatcmpl-bedrock-";

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
        s.decoder.carried()
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
        let (messages, error) = s.decoder.feed(chunk);
        for m in &messages {
            let shown = stream_message(s, head, m, &mut out);
            if shown.usage.is_some() {
                seen.usage = shown.usage;
            }
            seen.deltas = seen.deltas.saturating_add(shown.deltas);
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

mod tools;

#[cfg(test)]
mod tests;
