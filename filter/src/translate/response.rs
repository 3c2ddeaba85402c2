//! A non-streamed Anthropic Messages answer → an OpenAI `chat.completion`; an Anthropic error →
//! an OpenAI error (same status, type and message).

use super::{finish_reason, openai_error, openai_usage};
use crate::usage::UsageCounts;
use serde_json::{Value, json};

/// The OpenAI body for the Anthropic JSON body `body`; `created`: the answer's time (seconds).
/// `None`: neither a message nor an Anthropic error (then forwarded as it came).
pub fn translate(body: &[u8], created: u64) -> Option<Vec<u8>> {
    let anthropic: Value = serde_json::from_slice(body).ok()?;
    let out = match anthropic.get("type").and_then(Value::as_str) {
        Some("message") => completion(&anthropic, created)?,
        Some("error") => openai_error(&anthropic)?,
        _ => return None,
    };
    serde_json::to_vec(&out).ok()
}

/// The `chat.completion` of a Messages answer.
fn completion(m: &Value, created: u64) -> Option<Value> {
    let id = m.get("id").and_then(Value::as_str).unwrap_or_default();
    let mut text: Option<String> = None;
    let mut tool_calls = Vec::new();
    for block in m.get("content")?.as_array()? {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                let t = block.get("text").and_then(Value::as_str).unwrap_or_default();
                text.get_or_insert_with(String::new).push_str(t);
            }
            Some("tool_use") => tool_calls.push(json!({
                "id": block.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": block.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": block.get("input").map_or_else(|| "{}".to_string(), Value::to_string),
                },
            })),
            // Thinking is never asked for by a translated request; other blocks have no
            // OpenAI place.
            _ => {}
        }
    }
    let mut message = json!({"role": "assistant", "content": text, "refusal": null});
    if !tool_calls.is_empty()
        && let Some(o) = message.as_object_mut()
    {
        o.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    let counts: UsageCounts = m
        .get("usage")
        .and_then(|u| serde_json::from_value(u.clone()).ok())
        .unwrap_or_default();
    Some(json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion",
        "created": created,
        "model": m.get("model").cloned().unwrap_or(Value::Null),
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(m.get("stop_reason").and_then(Value::as_str)),
        }],
        "usage": openai_usage(&counts),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tr(v: Value) -> Value {
        serde_json::from_slice(&translate(&serde_json::to_vec(&v).unwrap(), 7).unwrap()).unwrap()
    }

    #[test]
    fn a_message_becomes_a_chat_completion() {
        let out = tr(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
            "stop_reason": "max_tokens", "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 2,
                      "cache_read_input_tokens": 3, "output_tokens": 4}
        }));
        assert_eq!(
            out,
            json!({
                "id": "chatcmpl-msg_1", "object": "chat.completion", "created": 7, "model": "claude-x",
                "choices": [{"index": 0, "logprobs": null, "finish_reason": "length",
                    "message": {"role": "assistant", "content": "hello", "refusal": null}}],
                "usage": {"prompt_tokens": 15, "completion_tokens": 4, "total_tokens": 19,
                          "prompt_tokens_details": {"cached_tokens": 3}},
            })
        );
    }

    #[test]
    fn tool_use_becomes_tool_calls() {
        let out = tr(json!({
            "id": "msg_2", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"q": "a"}}],
            "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 2}
        }));
        let choice = &out["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], Value::Null);
        assert_eq!(
            choice["message"]["tool_calls"],
            json!([{"id": "toolu_1", "type": "function",
                    "function": {"name": "get", "arguments": "{\"q\":\"a\"}"}}])
        );
    }

    #[test]
    fn an_anthropic_error_becomes_an_openai_error() {
        let out = tr(
            json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "max_tokens: Field required"}, "request_id": "r"}),
        );
        assert_eq!(
            out,
            json!({"error": {"message": "max_tokens: Field required",
                "type": "invalid_request_error", "param": null, "code": null}})
        );
    }

    #[test]
    fn anything_else_is_not_translated() {
        assert_eq!(translate(b"not json", 0), None);
        assert_eq!(translate(br#"{"object":"chat.completion"}"#, 0), None);
    }
}
