//! OpenAI tools, tool calls, tool results and images → Converse (`toolConfig`, `toolUse`,
//! `toolResult` and `image` blocks), as AWS Bedrock's Converse API takes them:
//!
//! - `tools` (function tools) → `toolConfig.tools[{toolSpec: {name, description,
//!   inputSchema: {json: <parameters>}}}]` (a function without parameters takes an empty object
//!   schema, as OpenAI reads it); `tool_choice` `auto` → `{auto: {}}`, `required` → `{any: {}}`,
//!   a named function → `{tool: {name}}`;
//! - `tool_choice: "none"` with tools is refused: Converse has no way to give a model tools and
//!   forbid their use, and leaving the tools out would change the prompt the client wrote.
//!   Without tools, `auto` and `none` mean what no tools mean, and are read as absent;
//! - `parallel_tool_calls: false` with tools is refused (Converse has no such switch); without
//!   tools it asks nothing;
//! - Converse takes `toolUse` / `toolResult` blocks only with a `toolConfig`: a conversation
//!   holding tool calls or results without `tools` is refused, naming it;
//! - an assistant's `tool_calls` → `toolUse` blocks after its text (`arguments` must be a JSON
//!   object: Converse's `input` is one); a `tool` message → a `toolResult` block (text content);
//! - an `image_url` part with a `data:image/(png|jpeg|gif|webp);base64,` URL → an `image` block
//!   with those bytes (still base64: Converse's JSON carries blobs so); any other URL is refused
//!   (Converse takes bytes or S3 locations, and the gateway fetches nothing).

use super::text_of;
use crate::translate::request::{Asked, Untranslatable, function_tools, refuse, tool_call};
use serde_json::{Map, Value, json};

/// The `toolConfig` of the body's tool fields (`None`: no tools); `tool_blocks`: the
/// conversation holds tool calls or results.
pub(super) fn config(
    asked: &Asked<'_>,
    tool_blocks: bool,
) -> Result<Option<Value>, Untranslatable> {
    let tools = match asked.tools {
        Some(tools) => tool_specs(tools)?,
        None => Vec::new(),
    };
    if tools.is_empty() {
        if let Some(c) = asked.choice
            && !matches!(c.as_str(), Some("auto" | "none"))
        {
            return refuse("tool_choice requires tools");
        }
        if tool_blocks {
            return refuse(
                "tools are required: the conversation holds tool calls or tool results, \
                 which AWS Bedrock Converse takes only with the tools they use",
            );
        }
        return Ok(None);
    }
    if asked.one_at_a_time {
        return refuse(
            "parallel_tool_calls: false has no equivalent in AWS Bedrock Converse \
             (a model may call several tools in one answer)",
        );
    }
    let mut config = Map::new();
    config.insert("tools".into(), Value::Array(tools));
    if let Some(choice) = asked.choice.map(tool_choice).transpose()? {
        config.insert("toolChoice".into(), choice);
    }
    Ok(Some(Value::Object(config)))
}

/// `tool_choice` (tools given) as Converse's `toolChoice`.
fn tool_choice(choice: &Value) -> Result<Value, Untranslatable> {
    if let Some(s) = choice.as_str() {
        return match s {
            "auto" => Ok(json!({"auto": {}})),
            "required" => Ok(json!({"any": {}})),
            "none" => refuse(
                "tool_choice \"none\" with tools has no equivalent in AWS Bedrock Converse \
                 (it cannot give a model tools and forbid their use): send no tools instead",
            ),
            other => refuse(format!("tool_choice {other:?} cannot be translated")),
        };
    }
    match (
        choice.get("type").and_then(Value::as_str),
        choice.pointer("/function/name").and_then(Value::as_str),
    ) {
        (Some("function"), Some(name)) => Ok(json!({"tool": {"name": name}})),
        _ => refuse("tool_choice must be auto, required or name a function"),
    }
}

/// OpenAI function tools as Converse `toolSpec`s.
fn tool_specs(tools: &Value) -> Result<Vec<Value>, Untranslatable> {
    Ok(function_tools(tools)?
        .into_iter()
        .map(|t| {
            let mut spec = Map::new();
            spec.insert("name".into(), json!(t.name));
            // Converse takes no empty description: an empty one says nothing.
            if let Some(d) = t.description.filter(|d| d.as_str() != Some("")) {
                spec.insert("description".into(), d.clone());
            }
            let schema = t
                .parameters
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            spec.insert("inputSchema".into(), json!({"json": schema}));
            json!({"toolSpec": spec})
        })
        .collect())
}

/// An assistant message's blocks: its text, then its tool calls as `toolUse` blocks.
pub(super) fn assistant_blocks(
    at: &str,
    m: &Map<String, Value>,
) -> Result<Vec<Value>, Untranslatable> {
    let calls: &[Value] = match m.get("tool_calls") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(calls)) => calls,
        Some(_) => return refuse(format!("{at}.tool_calls must be an array")),
    };
    let content = m.get("content");
    let mut blocks = match content {
        // Tool calls alone (Converse takes no empty text block).
        None | Some(Value::Null) if !calls.is_empty() => Vec::new(),
        Some(Value::String(s)) if s.is_empty() && !calls.is_empty() => Vec::new(),
        _ => text_of(at, content)?,
    };
    for (j, call) in calls.iter().enumerate() {
        let (id, name, input) = tool_call(&format!("{at}.tool_calls[{j}]"), call)?;
        blocks.push(json!({"toolUse": {"toolUseId": id, "name": name, "input": input}}));
    }
    Ok(blocks)
}

/// A `tool` message as a `toolResult` block.
pub(super) fn tool_result(at: &str, m: &Map<String, Value>) -> Result<Value, Untranslatable> {
    let Some(id) = m.get("tool_call_id").and_then(Value::as_str) else {
        return refuse(format!("{at}.tool_call_id is required"));
    };
    let content = text_of(at, m.get("content"))?;
    Ok(json!({"toolResult": {"toolUseId": id, "content": content}}))
}

/// An `image_url` part as a Converse `image` block. `detail` is a resolution hint OpenAI
/// models read; Converse has none, so only `auto` (the default) is translated.
pub(super) fn image_block(at: &str, p: &Value) -> Result<Value, Untranslatable> {
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
    let Some(data_url) = url.strip_prefix("data:") else {
        return refuse(format!(
            "{at}.image_url.url: AWS Bedrock Converse takes an image's bytes and the gateway \
             fetches no URL: send the image as a data:image/…;base64, URL"
        ));
    };
    let Some((media_type, data)) = data_url.split_once(";base64,") else {
        return refuse(format!("{at}.image_url.url: a data: URL must be base64"));
    };
    let format = match media_type {
        "image/png" => "png",
        "image/jpeg" => "jpeg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        other => {
            return refuse(format!(
                "{at}.image_url.url: image type {other:?} cannot be sent (png, jpeg, gif or webp)"
            ));
        }
    };
    Ok(json!({"image": {"format": format, "source": {"bytes": data}}}))
}
