//! An OpenAI chat request body → an Anthropic Messages request body.
//!
//! Every field of the OpenAI body is either translated or refused (400
//! `untranslatable_request`, naming it): nothing is dropped silently, so a client never gets an
//! answer to a request other than the one it sent. A `null` field is read as absent.
//!
//! - `system` / `developer` messages → the top-level `system` (text blocks, in order: Anthropic
//!   has one system prompt, so one in the middle of a conversation is hoisted to it);
//! - `user` / `assistant` messages → `messages` (a string, or content parts: `text`, and
//!   `image_url` as a `base64` image block for a `data:image/…;base64,` URL or a `url` image
//!   block for an `https://` URL); an assistant's `tool_calls` → `tool_use` blocks; `tool`
//!   messages → `tool_result` blocks of one user message;
//! - `max_tokens` is the cap decided at admission (the client's cap, else the one reserved):
//!   Anthropic requires it, and the backend then never generates more than was reserved;
//! - `temperature`, `top_p`, `stream` as they are; `stop` → `stop_sequences`; `user` →
//!   `metadata.user_id`; `tools` / `tool_choice` / `parallel_tool_calls` → Anthropic tools;
//! - `n` other than 1, `logprobs`, `response_format` other than text, audio, penalties, seeds…
//!   have no Anthropic equivalent: refused.

use serde_json::{Map, Value, json};

/// What the client asked of the answer's shape, kept for the response side.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientAsk {
    pub stream: bool,
    /// `stream_options.include_usage`: the final chunk carries the usage.
    pub include_usage: bool,
}

/// A request that cannot be translated faithfully: the message names what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untranslatable(pub String);

pub(super) fn refuse<T>(what: impl Into<String>) -> Result<T, Untranslatable> {
    Err(Untranslatable(what.into()))
}

/// Top-level fields read as absent when they hold their default (OpenAI's own defaults); the
/// Converse translation reads them alike.
pub(super) fn is_default(name: &str, v: &Value) -> bool {
    match name {
        "n" => v.as_u64() == Some(1),
        "logprobs" | "store" => v == &Value::Bool(false),
        "frequency_penalty" | "presence_penalty" => v.as_f64() == Some(0.0),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
        "modalities" => v == &json!(["text"]),
        _ => false,
    }
}

/// `stream_options` as every translation reads it: only `include_usage`.
pub(super) fn read_stream_options(v: &Value, ask: &mut ClientAsk) -> Result<(), Untranslatable> {
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

/// Appends a turn of `role` to `turns` (`{"role", <key>: blocks}`), joined with the last turn
/// when that has the same role: APIs that alternate roles (Converse, Gemini) take consecutive
/// messages of one role (a run of tool results, a result next to a user message) as one turn.
pub(super) fn join_turn(turns: &mut Vec<Value>, role: &str, key: &str, blocks: Vec<Value>) {
    let same = turns
        .last_mut()
        .filter(|last| last.get("role").and_then(Value::as_str) == Some(role))
        .and_then(|last| last.get_mut(key))
        .and_then(Value::as_array_mut);
    match same {
        Some(existing) => existing.extend(blocks),
        None => {
            let mut turn = Map::new();
            turn.insert("role".into(), Value::from(role));
            turn.insert(key.into(), Value::Array(blocks));
            turns.push(Value::Object(turn));
        }
    }
}

/// `stop` (a string or strings) as a list of stop sequences.
pub(super) fn stop_sequences(v: &Value) -> Result<Value, Untranslatable> {
    match v {
        Value::String(s) => Ok(Value::Array(vec![Value::String(s.clone())])),
        Value::Array(a) if a.iter().all(Value::is_string) => Ok(v.clone()),
        _ => refuse("stop must be a string or an array of strings"),
    }
}

/// The tool fields of the OpenAI body.
#[derive(Debug, Default)]
pub(super) struct Asked<'a> {
    pub tools: Option<&'a Value>,
    pub choice: Option<&'a Value>,
    /// `parallel_tool_calls: false`.
    pub one_at_a_time: bool,
}

/// The fields of an OpenAI chat body that the translations to a provider's own API (Converse,
/// Gemini) read alike.
#[derive(Debug, Default)]
pub(super) struct ChatFields<'a> {
    pub ask: ClientAsk,
    /// The cap: the larger of `max_tokens` and `max_completion_tokens` (admission set one
    /// when the client named none).
    pub cap: Option<u64>,
    messages: Option<&'a Vec<Value>>,
    pub tools: Asked<'a>,
}

impl<'a> ChatFields<'a> {
    /// Reads `name: v` when it is one of these fields (`model` too: the provider's path names
    /// the model): `Ok(true)`; `Ok(false)` for any other field.
    pub fn read(&mut self, name: &str, v: &'a Value) -> Result<bool, Untranslatable> {
        match name {
            "model" => {}
            "messages" => match v.as_array() {
                Some(m) => self.messages = Some(m),
                None => return refuse("messages must be an array"),
            },
            "max_tokens" | "max_completion_tokens" => match v.as_u64() {
                Some(n) => self.cap = Some(self.cap.map_or(n, |c| c.max(n))),
                None => return refuse(format!("{name} must be a non-negative integer")),
            },
            "stream" => match v.as_bool() {
                Some(s) => self.ask.stream = s,
                None => return refuse("stream must be a boolean"),
            },
            "stream_options" => read_stream_options(v, &mut self.ask)?,
            "tools" => self.tools.tools = Some(v),
            "tool_choice" => self.tools.choice = Some(v),
            "parallel_tool_calls" => match v.as_bool() {
                Some(b) => self.tools.one_at_a_time = !b,
                None => return refuse("parallel_tool_calls must be a boolean"),
            },
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The messages, which are required.
    pub fn messages(&self) -> Result<&'a [Value], Untranslatable> {
        match self.messages {
            Some(m) => Ok(m),
            None => refuse("messages is required"),
        }
    }
}

/// An OpenAI function tool as every translation reads it.
pub(super) struct FunctionTool<'a> {
    pub name: &'a str,
    /// A string, when given.
    pub description: Option<&'a Value>,
    /// The JSON Schema of the arguments (an object), when given.
    pub parameters: Option<&'a Value>,
}

/// The body's `tools`: function tools only, each with a name; a string `description`, an
/// object `parameters` and `strict: false` are read, anything else is refused by name (strict
/// schema adherence is OpenAI's; no other API has the switch).
pub(super) fn function_tools(tools: &Value) -> Result<Vec<FunctionTool<'_>>, Untranslatable> {
    let Some(tools) = tools.as_array() else {
        return refuse("tools must be an array");
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let f = t.get("function").and_then(Value::as_object);
            let (Some("function"), Some(f)) = (t.get("type").and_then(Value::as_str), f) else {
                return refuse(format!("tools[{i}]: only function tools can be translated"));
            };
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                return refuse(format!("tools[{i}].function.name is required"));
            };
            let mut tool = FunctionTool {
                name,
                description: None,
                parameters: None,
            };
            for (k, v) in f {
                match (k.as_str(), v) {
                    ("name", _) | (_, Value::Null) | ("strict", Value::Bool(false)) => {}
                    ("description", Value::String(_)) => tool.description = Some(v),
                    ("parameters", Value::Object(_)) => tool.parameters = Some(v),
                    _ => return refuse(format!("tools[{i}].function.{k} cannot be translated")),
                }
            }
            Ok(tool)
        })
        .collect()
}

/// One of an assistant message's `tool_calls` (at `at`): its id, function name and
/// arguments (a JSON object, as every other API takes a call's input).
pub(super) fn tool_call<'a>(
    at: &str,
    call: &'a Value,
) -> Result<(&'a str, &'a str, Value), Untranslatable> {
    let (Some(id), Some("function"), Some(name), Some(arguments)) = (
        call.get("id").and_then(Value::as_str),
        call.get("type").and_then(Value::as_str),
        call.pointer("/function/name").and_then(Value::as_str),
        call.pointer("/function/arguments").and_then(Value::as_str),
    ) else {
        return refuse(format!(
            "{at} must be a function call with id, function.name and function.arguments"
        ));
    };
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => Ok((id, name, v)),
        _ => refuse(format!("{at}.function.arguments must be a JSON object")),
    }
}

/// Translates the OpenAI chat body `body` into an Anthropic Messages body with `max_tokens`
/// (the cap the client named, read at admission; `None`: left for admission to set to the one
/// it reserves).
pub fn translate(
    body: &[u8],
    max_tokens: Option<u64>,
) -> Result<(Vec<u8>, ClientAsk), Untranslatable> {
    let Ok(Value::Object(openai)) = serde_json::from_slice::<Value>(body) else {
        return refuse("the body is not a JSON object");
    };
    let mut out = Map::new();
    let mut ask = ClientAsk::default();
    let mut tools: Option<Value> = None;
    let mut tool_choice: Option<Value> = None;
    let mut parallel_tool_calls = true;
    let mut messages: Option<&Vec<Value>> = None;
    for (name, v) in &openai {
        if v.is_null() || is_default(name, v) {
            continue;
        }
        match name.as_str() {
            "model" => {
                out.insert("model".into(), v.clone());
            }
            "messages" => match v.as_array() {
                Some(m) => messages = Some(m),
                None => return refuse("messages must be an array"),
            },
            // The cap decided at admission (from these, else the one reserved).
            "max_tokens" | "max_completion_tokens" => {}
            "temperature" | "top_p" => {
                if !v.is_number() {
                    return refuse(format!("{name} must be a number"));
                }
                out.insert(name.clone(), v.clone());
            }
            "stream" => match v.as_bool() {
                Some(s) => {
                    ask.stream = s;
                    out.insert("stream".into(), Value::Bool(s));
                }
                None => return refuse("stream must be a boolean"),
            },
            "stream_options" => read_stream_options(v, &mut ask)?,
            "stop" => {
                out.insert("stop_sequences".into(), stop_sequences(v)?);
            }
            "user" => match v.as_str() {
                Some(u) => {
                    out.insert("metadata".into(), json!({"user_id": u}));
                }
                None => return refuse("user must be a string"),
            },
            "tools" => tools = Some(v.clone()),
            "tool_choice" => tool_choice = Some(v.clone()),
            "parallel_tool_calls" => match v.as_bool() {
                Some(b) => parallel_tool_calls = b,
                None => return refuse("parallel_tool_calls must be a boolean"),
            },
            other => {
                return refuse(format!(
                    "{other} has no equivalent in this model's API (Anthropic Messages)"
                ));
            }
        }
    }
    let Some(messages) = messages else {
        return refuse("messages is required");
    };
    let (system, messages) = translate_messages(messages)?;
    if let Some(cap) = max_tokens {
        out.insert("max_tokens".into(), Value::from(cap));
    }
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    out.insert("messages".into(), Value::Array(messages));
    insert_tools(
        &mut out,
        tools.as_ref(),
        tool_choice.as_ref(),
        parallel_tool_calls,
    )?;
    let bytes = serde_json::to_vec(&Value::Object(out))
        .map_err(|e| Untranslatable(format!("the translated body could not be written: {e}")))?;
    Ok((bytes, ask))
}

/// `tools`, `tool_choice` and `parallel_tool_calls` as Anthropic's `tools` and `tool_choice`.
fn insert_tools(
    out: &mut Map<String, Value>,
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: bool,
) -> Result<(), Untranslatable> {
    let tools = match tools {
        Some(tools) => translate_tools(tools)?,
        None => Vec::new(),
    };
    if tools.is_empty() {
        // Without tools `auto` and `none` mean what no tools mean (Anthropic takes no
        // `tool_choice` without tools); a tool required of none cannot be.
        match tool_choice.and_then(Value::as_str) {
            None if tool_choice.is_none() => {}
            Some("auto" | "none") => {}
            _ => return refuse("tool_choice requires tools"),
        }
    } else {
        out.insert("tools".into(), Value::Array(tools));
        if let Some(choice) = translate_tool_choice(tool_choice, parallel_tool_calls)? {
            out.insert("tool_choice".into(), choice);
        }
    }
    Ok(())
}

/// The system blocks and the user / assistant messages.
fn translate_messages(messages: &[Value]) -> Result<(Vec<Value>, Vec<Value>), Untranslatable> {
    let mut system = Vec::new();
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    // The tool results of the current run of `tool` messages (one user message).
    let mut results: Vec<Value> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(m) = m.as_object() else {
            return refuse(format!("{at} must be an object"));
        };
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        for (k, v) in m {
            let known = match role {
                "assistant" => matches!(k.as_str(), "role" | "content" | "tool_calls" | "name"),
                "tool" => matches!(k.as_str(), "role" | "content" | "tool_call_id"),
                _ => matches!(k.as_str(), "role" | "content" | "name"),
            };
            // A name only labels a participant; Anthropic has no participants to label.
            if !known && !v.is_null() {
                return refuse(format!("{at}.{k} cannot be translated"));
            }
        }
        let content = m.get("content").unwrap_or(&Value::Null);
        if role != "tool" && !results.is_empty() {
            out.push(json!({"role": "user", "content": std::mem::take(&mut results)}));
        }
        match role {
            "system" | "developer" => system.extend(text_blocks(content, &at)?),
            "user" => out.push(json!({"role": "user", "content": user_content(content, &at)?})),
            "assistant" => out.push(assistant_message(m, content, &at)?),
            "tool" => {
                let Some(id) = m.get("tool_call_id").and_then(Value::as_str) else {
                    return refuse(format!("{at}.tool_call_id is required"));
                };
                results.push(json!({
                    "type": "tool_result",
                    "tool_use_id": id,
                    "content": text_blocks(content, &at)?,
                }));
            }
            other => return refuse(format!("{at}.role {other:?} cannot be translated")),
        }
    }
    if !results.is_empty() {
        out.push(json!({"role": "user", "content": results}));
    }
    Ok((system, out))
}

/// Text-only content (a string or `text` parts) as text blocks.
fn text_blocks(content: &Value, at: &str) -> Result<Vec<Value>, Untranslatable> {
    match content {
        Value::String(s) => Ok(vec![json!({"type": "text", "text": s})]),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match text_part(p) {
                Some(t) => Ok(json!({"type": "text", "text": t})),
                None => refuse(format!(
                    "{at}.content[{j}]: only text parts can be translated"
                )),
            })
            .collect(),
        _ => refuse(format!(
            "{at}.content must be a string or an array of parts"
        )),
    }
}

/// The text of a `{"type":"text","text":…}` part with no other field.
fn text_part(p: &Value) -> Option<&str> {
    let o = p.as_object()?;
    if o.get("type")?.as_str()? != "text" || o.keys().any(|k| k != "type" && k != "text") {
        return None;
    }
    o.get("text")?.as_str()
}

/// A user message's content: a string as it is, parts as blocks.
fn user_content(content: &Value, at: &str) -> Result<Value, Untranslatable> {
    let parts = match content {
        Value::String(s) => return Ok(Value::String(s.clone())),
        Value::Array(parts) => parts,
        _ => {
            return refuse(format!(
                "{at}.content must be a string or an array of parts"
            ));
        }
    };
    let mut blocks = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        if let Some(t) = text_part(p) {
            blocks.push(json!({"type": "text", "text": t}));
            continue;
        }
        match p.get("type").and_then(Value::as_str) {
            Some("image_url") => blocks.push(image_block(p, &at)?),
            Some(other) => return refuse(format!("{at}: a {other:?} part cannot be translated")),
            None => return refuse(format!("{at}: a part needs a type")),
        }
    }
    Ok(Value::Array(blocks))
}

/// Media types Anthropic takes as image blocks.
const IMAGE_TYPES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];

/// An `image_url` part as an Anthropic image block. `detail` is a resolution hint OpenAI
/// models read; Anthropic picks its own, so only `auto` (the default) is translated.
fn image_block(p: &Value, at: &str) -> Result<Value, Untranslatable> {
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
    let Some(url) = image.get("url").and_then(Value::as_str) else {
        return refuse(format!("{at}.image_url.url is required"));
    };
    if let Some(data_url) = url.strip_prefix("data:") {
        let Some((media_type, data)) = data_url.split_once(";base64,") else {
            return refuse(format!("{at}: a data: URL must be base64"));
        };
        if !IMAGE_TYPES.contains(&media_type) {
            return refuse(format!(
                "{at}: image type {media_type:?} cannot be sent (jpeg, png, gif or webp)"
            ));
        }
        return Ok(json!({"type": "image", "source":
            {"type": "base64", "media_type": media_type, "data": data}}));
    }
    if url.starts_with("https://") {
        return Ok(json!({"type": "image", "source": {"type": "url", "url": url}}));
    }
    refuse(format!(
        "{at}: an image URL must be https:// or a data: URL"
    ))
}

/// An assistant message: its text, then its tool calls as `tool_use` blocks.
fn assistant_message(
    m: &Map<String, Value>,
    content: &Value,
    at: &str,
) -> Result<Value, Untranslatable> {
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(calls)) => Some(calls),
        Some(_) => return refuse(format!("{at}.tool_calls must be an array")),
    };
    let Some(calls) = calls.filter(|c| !c.is_empty()) else {
        // Text only: a string stays a string.
        return match content {
            Value::String(_) => Ok(json!({"role": "assistant", "content": content})),
            _ => Ok(json!({"role": "assistant", "content": text_blocks(content, at)?})),
        };
    };
    let mut blocks = match content {
        Value::Null => Vec::new(),
        Value::String(s) if s.is_empty() => Vec::new(),
        _ => text_blocks(content, at)?,
    };
    for (j, call) in calls.iter().enumerate() {
        let (id, name, input) = tool_call(&format!("{at}.tool_calls[{j}]"), call)?;
        blocks.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
    }
    Ok(json!({"role": "assistant", "content": blocks}))
}

/// OpenAI function tools as Anthropic tools (a function without parameters takes an empty
/// object schema, as OpenAI reads it).
fn translate_tools(tools: &Value) -> Result<Vec<Value>, Untranslatable> {
    Ok(function_tools(tools)?
        .into_iter()
        .map(|t| {
            let mut tool = Map::new();
            tool.insert("name".into(), json!(t.name));
            if let Some(d) = t.description {
                tool.insert("description".into(), d.clone());
            }
            tool.insert(
                "input_schema".into(),
                t.parameters
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            );
            Value::Object(tool)
        })
        .collect())
}

/// `tool_choice` (and `parallel_tool_calls: false`) as Anthropic's `tool_choice`.
fn translate_tool_choice(
    choice: Option<&Value>,
    parallel: bool,
) -> Result<Option<Value>, Untranslatable> {
    let mut out = match choice {
        None => {
            if parallel {
                return Ok(None);
            }
            json!({"type": "auto"})
        }
        Some(Value::String(s)) => match s.as_str() {
            "auto" => json!({"type": "auto"}),
            "none" => json!({"type": "none"}),
            "required" => json!({"type": "any"}),
            other => return refuse(format!("tool_choice {other:?} cannot be translated")),
        },
        Some(v) => match (
            v.get("type").and_then(Value::as_str),
            v.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => json!({"type": "tool", "name": name}),
            _ => return refuse("tool_choice must name a function"),
        },
    };
    if !parallel
        && out.get("type").and_then(Value::as_str) != Some("none")
        && let Some(o) = out.as_object_mut()
    {
        o.insert("disable_parallel_tool_use".into(), Value::Bool(true));
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tr(v: Value, cap: u64) -> Result<(Value, ClientAsk), String> {
        translate(&serde_json::to_vec(&v).unwrap(), Some(cap))
            .map(|(b, a)| (serde_json::from_slice(&b).unwrap(), a))
            .map_err(|e| e.0)
    }

    #[test]
    fn a_plain_chat_becomes_a_messages_body() {
        let (body, ask) = tr(
            json!({
                "model": "claude", "max_completion_tokens": 50, "temperature": 0.5, "top_p": 0.9,
                "stop": "END", "user": "u1", "n": 1, "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "developer", "content": [{"type": "text", "text": "be kind"}]},
                    {"role": "user", "content": "hi", "name": "bob"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": [{"type": "text", "text": "again"}]},
                ]
            }),
            50,
        )
        .unwrap();
        assert_eq!(
            body,
            json!({
                "model": "claude", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9,
                "stop_sequences": ["END"], "metadata": {"user_id": "u1"}, "stream": true,
                "system": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "be kind"}],
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": [{"type": "text", "text": "again"}]},
                ]
            })
        );
        assert_eq!(
            ask,
            ClientAsk {
                stream: true,
                include_usage: true
            }
        );
    }

    #[test]
    fn max_tokens_is_the_cap_read_at_admission_or_left_for_it() {
        // None: admission sets the one it reserves on the translated body.
        let (b, _) = translate(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
            None,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(v.get("max_tokens").is_none());
        // The client's own cap was read at admission: the one given here is what was reserved.
        let (body, _) = tr(
            json!({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}),
            9,
        )
        .unwrap();
        assert_eq!(body["max_tokens"], 9);
        let (body, _) = tr(
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            4096,
        )
        .unwrap();
        assert_eq!(body["max_tokens"], 4096);
        assert!(body.get("max_completion_tokens").is_none());
    }

    #[test]
    fn images_become_image_blocks() {
        let (body, _) = tr(
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR", "detail": "auto"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
            ]}]}),
            5,
        )
        .unwrap();
        assert_eq!(
            body["messages"][0]["content"],
            json!([
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
            ])
        );
    }

    #[test]
    fn tools_and_tool_messages_become_tool_use_and_tool_result() {
        let (body, _) = tr(
            json!({"model": "m", "parallel_tool_calls": false, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "get", "description": "d",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}],
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"q\":\"a\"}"}},
                        {"id": "c2", "type": "function", "function": {"name": "get", "arguments": "{}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "r2"}]},
                    {"role": "user", "content": "thanks"},
                ]}),
            5,
        )
        .unwrap();
        assert_eq!(
            body["tools"],
            json!([{"name": "get", "description": "d", "input_schema":
                {"type": "object", "properties": {"q": {"type": "string"}}}}])
        );
        assert_eq!(
            body["tool_choice"],
            json!({"type": "any", "disable_parallel_tool_use": true})
        );
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "c1", "name": "get", "input": {"q": "a"}},
                    {"type": "tool_use", "id": "c2", "name": "get", "input": {}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "r1"}]},
                    {"type": "tool_result", "tool_use_id": "c2", "content": [{"type": "text", "text": "r2"}]},
                ]},
                {"role": "user", "content": "thanks"},
            ])
        );
    }

    #[test]
    fn what_has_no_equivalent_is_refused_by_name() {
        let user = json!([{"role": "user", "content": "x"}]);
        for (extra, named) in [
            (json!({"n": 2}), "n"),
            (json!({"logprobs": true}), "logprobs"),
            (json!({"seed": 1}), "seed"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
            (json!({"audio": {}}), "audio"),
            (
                json!({"stream_options": {"include_obfuscation": true}}),
                "include_obfuscation",
            ),
            (
                json!({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}),
                "sometimes",
            ),
            (json!({"tool_choice": "required"}), "requires tools"),
        ] {
            let mut body = json!({"model": "m", "messages": user});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let err = tr(body, 5).unwrap_err();
            assert!(err.contains(named), "{named}: {err}");
        }
        for (message, named) in [
            (
                json!({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
                "input_audio",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}),
                "https",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AA"}}]}),
                "image/tiff",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "high"}}]}),
                "detail",
            ),
            (json!({"role": "function", "content": "x"}), "function"),
            (
                json!({"role": "assistant", "content": "x", "audio": {"id": "a"}}),
                "audio",
            ),
            (
                json!({"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}),
                "only text",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "f", "arguments": "[1]"}}]}),
                "arguments",
            ),
            (json!({"role": "tool", "content": "r"}), "tool_call_id"),
        ] {
            let err = tr(json!({"model": "m", "messages": [message]}), 5).unwrap_err();
            assert!(err.contains(named), "{named}: {err}");
        }
        assert!(
            tr(json!({"model": "m"}), 5)
                .unwrap_err()
                .contains("messages")
        );
        assert!(translate(b"[1]", Some(5)).is_err());
    }

    #[test]
    fn defaults_and_nulls_are_absent() {
        let (body, ask) = tr(
            json!({"model": "m", "n": 1, "logprobs": false, "seed": null, "presence_penalty": 0,
                "response_format": {"type": "text"}, "stream": false, "tools": [],
                "tool_choice": "none", "parallel_tool_calls": false,
                "messages": [{"role": "user", "content": "x"}]}),
            5,
        )
        .unwrap();
        assert_eq!(
            body,
            json!({"model": "m", "max_tokens": 5, "stream": false,
                   "messages": [{"role": "user", "content": "x"}]})
        );
        assert_eq!(ask, ClientAsk::default());
    }
}
