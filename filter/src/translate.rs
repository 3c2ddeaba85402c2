//! Translation between an OpenAI chat client and a model whose backend speaks Anthropic Messages
//! (a model of API family `anthropic` called at `POST /v1/chat/completions`).
//!
//! Plain functions over plain data, natively tested:
//! - [`request`]: the OpenAI chat body → an Anthropic Messages body (refusing, with a 400, what
//!   cannot be translated faithfully instead of dropping it);
//! - [`response`]: a non-streamed Messages answer (or an Anthropic error) → `chat.completion` (or
//!   an OpenAI error);
//! - [`stream`]: Messages SSE events → `chat.completion.chunk` events and `data: [DONE]`, event by
//!   event, carrying only an incomplete trailing event from one chunk to the next.
//!
//! Metering never reads the translation: the usage scanners read what the provider really sent,
//! so budgets, metering and ledger are those of a direct Anthropic call of the same usage.

pub mod answer;
pub mod chunks;
pub mod converse;
pub mod eventstream;
pub mod gemini;
pub mod request;
pub mod response;
pub mod stream;

use crate::usage::UsageCounts;
use serde_json::{Value, json};

/// An answer in a provider's own API, translated for an OpenAI chat client as it passes; its
/// usage is the one the provider sent.
#[derive(Debug)]
pub enum NativeAnswer {
    /// AWS Bedrock Converse / ConverseStream.
    Converse(converse::Answer),
    /// Gemini `generateContent` / `streamGenerateContent?alt=sse`.
    Gemini(gemini::Answer),
}

impl NativeAnswer {
    /// The client gets an event stream.
    pub fn is_stream(&self) -> bool {
        match self {
            NativeAnswer::Converse(a) => a.is_stream(),
            NativeAnswer::Gemini(a) => a.is_stream(),
        }
    }

    /// Whether the answer's `content-encoding` must go (the client gets plain bytes).
    pub fn drops_encoding(&self) -> bool {
        match self {
            NativeAnswer::Converse(a) => a.drops_encoding(),
            NativeAnswer::Gemini(a) => a.drops_encoding(),
        }
    }

    /// The usage the provider sent.
    pub fn usage(&self) -> Option<crate::usage::Usage> {
        match self {
            NativeAnswer::Converse(a) => a.usage(),
            NativeAnswer::Gemini(a) => a.usage(),
        }
    }

    /// Text deltas of a stream (≈ completion tokens when no usage came).
    pub fn content_events(&self) -> u64 {
        match self {
            NativeAnswer::Converse(a) => a.content_events(),
            NativeAnswer::Gemini(a) => a.content_events(),
        }
    }

    /// One chunk of the provider's answer (`end`: its last): what the client gets now.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        match self {
            NativeAnswer::Converse(a) => a.feed(chunk, end),
            NativeAnswer::Gemini(a) => a.feed(chunk, end),
        }
    }
}

/// The Anthropic API version the translated requests are written for.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The path suffix a translated request is sent to instead of `/v1/chat/completions`.
pub const MESSAGES_PATH: &str = "/v1/messages";
const CHAT_PATH: &str = "/v1/chat/completions";

/// The upstream path of a translated request: `path` (the client's, query and all) with its
/// `/v1/chat/completions` operation replaced by `/v1/messages` (the query dropped: Messages
/// takes none). `None`: the path does not end with the chat operation.
pub fn messages_path(path: &str) -> Option<String> {
    let no_query = path.split(['?', '#']).next().unwrap_or_default();
    let prefix = no_query.strip_suffix(CHAT_PATH)?;
    Some(format!("{prefix}{MESSAGES_PATH}"))
}

/// A Messages body as Claude on Vertex AI takes it: no `model` (the path names it) and
/// `anthropic_version` in the body (Vertex reads no `anthropic-version` header). Anything that
/// is not a JSON object is refused.
pub fn vertex_messages_body(body: &[u8]) -> Result<Vec<u8>, String> {
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(body) else {
        return Err("the body is not a JSON object".to_string());
    };
    map.remove("model");
    map.insert(
        "anthropic_version".to_string(),
        json!(maas_types::VERTEX_ANTHROPIC_VERSION),
    );
    serde_json::to_vec(&Value::Object(map)).map_err(|e| e.to_string())
}

/// OpenAI's `finish_reason` for an Anthropic `stop_reason`.
pub fn finish_reason(stop_reason: Option<&str>) -> Value {
    match stop_reason {
        None => Value::Null,
        Some("max_tokens" | "model_context_window_exceeded") => json!("length"),
        Some("tool_use") => json!("tool_calls"),
        Some("refusal") => json!("content_filter"),
        // end_turn, stop_sequence, pause_turn and anything newer: the turn ended.
        Some(_) => json!("stop"),
    }
}

/// OpenAI `usage` from Anthropic counts, as the filter's metering reads them: prompt = input +
/// cache creation + cache read, completion = output, cached = cache read.
pub fn openai_usage(counts: &UsageCounts) -> Value {
    let u = counts.usage().unwrap_or_default();
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens},
    })
}

/// An OpenAI error body from an Anthropic one (`{"type":"error","error":{"type","message"}}`):
/// the same type and message. `None`: not an Anthropic error.
pub fn openai_error(anthropic: &Value) -> Option<Value> {
    let error = anthropic.get("error")?;
    let message = error.get("message").and_then(Value::as_str).unwrap_or("");
    let kind = error
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("api_error");
    Some(json!({"error": {"message": message, "type": kind, "param": null, "code": null}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vertex_body_names_no_model_and_carries_the_vertex_version() {
        let out = vertex_messages_body(
            br#"{"model":"claude","max_tokens":5,"anthropic_version":"x","messages":[]}"#,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            json!({"max_tokens": 5, "anthropic_version": "vertex-2023-10-16", "messages": []})
        );
        assert!(vertex_messages_body(b"[1]").is_err());
        assert!(vertex_messages_body(b"{").is_err());
    }

    #[test]
    fn the_path_keeps_its_prefix_and_drops_the_query() {
        assert_eq!(
            messages_path("/llm/claude/v1/chat/completions").as_deref(),
            Some("/llm/claude/v1/messages")
        );
        assert_eq!(
            messages_path("/v1/chat/completions?x=1").as_deref(),
            Some("/v1/messages")
        );
        assert_eq!(messages_path("/v1/completions"), None);
    }

    #[test]
    fn stop_reasons_map_to_finish_reasons() {
        assert_eq!(finish_reason(Some("end_turn")), json!("stop"));
        assert_eq!(finish_reason(Some("stop_sequence")), json!("stop"));
        assert_eq!(finish_reason(Some("max_tokens")), json!("length"));
        assert_eq!(finish_reason(Some("tool_use")), json!("tool_calls"));
        assert_eq!(finish_reason(Some("refusal")), json!("content_filter"));
        assert_eq!(finish_reason(None), Value::Null);
    }

    #[test]
    fn usage_counts_the_cache_in_the_prompt_as_metering_does() {
        let counts: UsageCounts = serde_json::from_value(json!({
            "input_tokens": 10, "cache_creation_input_tokens": 3,
            "cache_read_input_tokens": 5, "output_tokens": 7
        }))
        .unwrap();
        assert_eq!(
            openai_usage(&counts),
            json!({"prompt_tokens": 18, "completion_tokens": 7, "total_tokens": 25,
                   "prompt_tokens_details": {"cached_tokens": 5}})
        );
    }
}
