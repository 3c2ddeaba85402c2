//! OpenAI tools, tool calls and tool results → Gemini (`tools[{functionDeclarations}]`,
//! `toolConfig`, `functionCall` and `functionResponse` parts), as Vertex AI takes them:
//!
//! - `tools` (function tools) → one `{functionDeclarations: [{name, description,
//!   parametersJsonSchema}]}` (the JSON Schema as the client wrote it: Vertex reads JSON Schema
//!   there, where `parameters` would take only its OpenAPI subset; a function without
//!   parameters declares none);
//! - `tool_choice` `auto` → `functionCallingConfig.mode: AUTO`, `none` → `NONE`, `required` →
//!   `ANY`, a named function → `ANY` with `allowedFunctionNames: [name]`;
//! - `parallel_tool_calls: false` with tools is refused (Gemini has no such switch);
//! - an assistant's `tool_calls` → `functionCall` parts after its text (`arguments` must be a
//!   JSON object: Gemini's `args` is one); a `tool` message → a `functionResponse` part naming
//!   the function its `tool_call_id` called earlier in the conversation (a result of no call
//!   seen is refused), its `response` the content when that is a JSON object, else
//!   `{"content": <text>}`.

use super::parts_of;
use crate::translate::request::{Asked, Untranslatable, function_tools, refuse, tool_call};
use serde_json::{Map, Value, json};

/// `tools` and `toolConfig` of the body's tool fields (`None`: no tools).
pub(super) fn config(asked: &Asked<'_>) -> Result<(Option<Value>, Option<Value>), Untranslatable> {
    let declarations = match asked.tools {
        Some(tools) => declarations(tools)?,
        None => Vec::new(),
    };
    if declarations.is_empty() {
        if let Some(c) = asked.choice
            && !matches!(c.as_str(), Some("auto" | "none"))
        {
            return refuse("tool_choice requires tools");
        }
        return Ok((None, None));
    }
    if asked.one_at_a_time {
        return refuse(
            "parallel_tool_calls: false has no equivalent in Gemini (a model may call \
             several functions in one answer)",
        );
    }
    let config = asked
        .choice
        .map(|c| tool_choice(c, &declarations))
        .transpose()?;
    Ok((
        Some(json!([{"functionDeclarations": declarations}])),
        config,
    ))
}

/// `tool_choice` (tools given) as Gemini's `toolConfig`.
fn tool_choice(choice: &Value, declared: &[Value]) -> Result<Value, Untranslatable> {
    let mode = |m: &str| json!({"functionCallingConfig": {"mode": m}});
    if let Some(s) = choice.as_str() {
        return match s {
            "auto" => Ok(mode("AUTO")),
            "none" => Ok(mode("NONE")),
            "required" => Ok(mode("ANY")),
            other => refuse(format!("tool_choice {other:?} cannot be translated")),
        };
    }
    match (
        choice.get("type").and_then(Value::as_str),
        choice.pointer("/function/name").and_then(Value::as_str),
    ) {
        (Some("function"), Some(name)) => {
            if !declared.iter().any(|d| d["name"] == name) {
                return refuse(format!(
                    "tool_choice names {name:?}, which no tool declares"
                ));
            }
            Ok(json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}}))
        }
        _ => refuse("tool_choice must be auto, none, required or name a function"),
    }
}

/// OpenAI function tools as Gemini function declarations.
fn declarations(tools: &Value) -> Result<Vec<Value>, Untranslatable> {
    Ok(function_tools(tools)?
        .into_iter()
        .map(|t| {
            let mut d = Map::new();
            d.insert("name".into(), json!(t.name));
            if let Some(description) = t.description {
                d.insert("description".into(), description.clone());
            }
            if let Some(schema) = t.parameters {
                d.insert("parametersJsonSchema".into(), schema.clone());
            }
            Value::Object(d)
        })
        .collect())
}

/// An assistant message's parts: its text, then its tool calls as `functionCall` parts (each
/// remembered in `calls`, id → name, for the results that follow).
pub(super) fn assistant_parts(
    at: &str,
    m: &Map<String, Value>,
    calls: &mut Vec<(String, String)>,
) -> Result<Vec<Value>, Untranslatable> {
    let made: &[Value] = match m.get("tool_calls") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(made)) => made,
        Some(_) => return refuse(format!("{at}.tool_calls must be an array")),
    };
    let content = m.get("content");
    let mut parts = match content {
        // Calls alone (an empty text part says nothing).
        None | Some(Value::Null) if !made.is_empty() => Vec::new(),
        Some(Value::String(s)) if s.is_empty() && !made.is_empty() => Vec::new(),
        _ => parts_of(at, content, false)?,
    };
    for (j, call) in made.iter().enumerate() {
        let (id, name, args) = tool_call(&format!("{at}.tool_calls[{j}]"), call)?;
        calls.push((id.to_string(), name.to_string()));
        parts.push(json!({"functionCall": {"name": name, "args": args}}));
    }
    Ok(parts)
}

/// A `tool` message as a `functionResponse` part.
pub(super) fn function_response(
    at: &str,
    m: &Map<String, Value>,
    calls: &[(String, String)],
) -> Result<Value, Untranslatable> {
    let Some(id) = m.get("tool_call_id").and_then(Value::as_str) else {
        return refuse(format!("{at}.tool_call_id is required"));
    };
    let Some((_, name)) = calls.iter().rev().find(|(c, _)| c == id) else {
        return refuse(format!(
            "{at}.tool_call_id {id:?} answers no tool call of an earlier assistant message"
        ));
    };
    let text: String = parts_of(at, m.get("content"), false)?
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect();
    let response = match serde_json::from_str::<Value>(&text) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"content": text}),
    };
    Ok(json!({"functionResponse": {"name": name, "response": response}}))
}
