//! Budgets reserve what the backend will really do (issue 26, items 1–3), through real Envoy with
//! the release .wasm against the simulator, which reads each API family's cap field as the real
//! servers do (chat: vLLM's and SGLang's `max_completion_tokens or max_tokens`; completions and
//! Anthropic `max_tokens`; Responses `max_output_tokens`) and counts plain-text documents and tool
//! schemas as prompt:
//! - every family's own cap field is reserved, and a cap field of another family costs too;
//! - `max_completion_tokens: 0` next to `max_tokens` reserves the larger, `0` alone is "no cap";
//! - prompt text the old estimate skipped (Anthropic text documents, schema property names) is
//!   reserved, while binary media declared as such stays out of the estimate.
//!
//! A request's reservation is read from its own `x-ratelimit-remaining-tokens` (the window after
//! the reservation): each subject is fresh, so `limit − remaining` is what was reserved. The
//! `small` tier (3,000 tokens a day) shows the refusals; the `meter` tier (1,000,000) the
//! reservations. Windows are a day long so that no test straddles a window boundary.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};

const METER_LIMIT: u64 = 1_000_000;
const METER_DEFAULT_MAX_TOKENS: u64 = 100;

const POLICY: &str = r#"
tiers:
  - name: small
    level: 1
    groups: [g-small]
    limits:
      tokens: [{limit: 3000, window: 1d}]
    defaultMaxTokens: 10
  - name: meter
    level: 2
    groups: [g-meter]
    limits:
      tokens: [{limit: 1000000, window: 1d}]
    defaultMaxTokens: 100
models:
  - name: sim-openai
    path: /llm/sim-openai
    tiers: [small, meter]
    backend: simulator
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [small, meter]
    backend: simulator
    api: anthropic
"#;

/// One subject per check, so that each reservation is read on a fresh window.
const IDENTITIES: &str = r#"
identities:
  - {token: s-resp, username: s-resp, groups: [g-small]}
  - {token: s-chat-two-caps, username: s-chat-two-caps, groups: [g-small]}
  - {token: s-chat-foreign, username: s-chat-foreign, groups: [g-small]}
  - {token: s-doc, username: s-doc, groups: [g-small]}
  - {token: s-tool-names, username: s-tool-names, groups: [g-small]}
  - {token: s-format-names, username: s-format-names, groups: [g-small]}
  - {token: m-resp, username: m-resp, groups: [g-meter]}
  - {token: m-chat-mct, username: m-chat-mct, groups: [g-meter]}
  - {token: m-chat-mt, username: m-chat-mt, groups: [g-meter]}
  - {token: m-cmpl, username: m-cmpl, groups: [g-meter]}
  - {token: m-msg, username: m-msg, groups: [g-meter]}
  - {token: m-chat-two-caps, username: m-chat-two-caps, groups: [g-meter]}
  - {token: m-chat-zero, username: m-chat-zero, groups: [g-meter]}
  - {token: m-doc, username: m-doc, groups: [g-meter]}
  - {token: m-media-claude, username: m-media-claude, groups: [g-meter]}
  - {token: m-media-openai, username: m-media-openai, groups: [g-meter]}
  - {token: m-tool-names, username: m-tool-names, groups: [g-meter]}
"#;

const CHAT: &str = "/llm/sim-openai/v1/chat/completions";
const COMPLETIONS: &str = "/llm/sim-openai/v1/completions";
const RESPONSES: &str = "/llm/sim-openai/v1/responses";
const MESSAGES: &str = "/llm/sim-claude/v1/messages";

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

async fn post(path: &str, test_id: &str, token: &str, body: Value) -> Reply {
    chat(
        stack(),
        path,
        test_id,
        &[("authorization", &bearer(token))],
        body,
    )
    .await
}

/// Admitted on a fresh `meter` subject: what its admission reserved, and the answer.
async fn reserved(path: &str, test_id: &str, token: &str, body: Value) -> (u64, Value) {
    let r = post(path, test_id, token, body).await;
    assert_eq!(r.status, 200, "{test_id}: {}", r.body);
    let remaining: u64 = r
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "{test_id}: no x-ratelimit-remaining-tokens: {:?}",
                r.headers
            )
        });
    (METER_LIMIT - remaining, r.json())
}

/// Refused up front on a `small` subject (3,000 tokens a day): 400 `tokens_exceed_limit`, and the
/// backend never saw it.
async fn refused_up_front(path: &str, test_id: &str, token: &str, body: Value) {
    let r = post(path, test_id, token, body).await;
    let e = r.error(400);
    assert_eq!(e["code"], "tokens_exceed_limit", "{test_id}: {e}");
    assert!(
        stack().sim_requests_with_test_id(test_id).is_empty(),
        "{test_id}: a request that can never fit reached the backend"
    );
}

#[tokio::test]
async fn responses_max_output_tokens_is_reserved() {
    // The backend generates 100,000 tokens for this body: it can never fit 3,000 a day.
    refused_up_front(
        RESPONSES,
        "resp-100k",
        "s-resp",
        json!({"model": "sim-openai", "input": "hi", "max_output_tokens": 100_000}),
    )
    .await;
    let (r, answer) = reserved(
        RESPONSES,
        "resp-5k",
        "m-resp",
        json!({"model": "sim-openai", "input": "hi", "max_output_tokens": 5000}),
    )
    .await;
    assert_eq!(answer["usage"]["output_tokens"], 5000, "{answer}");
    assert!(
        (5000..5010).contains(&r),
        "reserved {r} for max_output_tokens 5000"
    );
}

#[tokio::test]
async fn every_family_reserves_its_own_cap_field() {
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (path, id, token, body, cap) in [
        (
            CHAT,
            "fam-chat-mct",
            "m-chat-mct",
            json!({"model": "sim-openai", "messages": hi, "max_completion_tokens": 700}),
            700,
        ),
        (
            CHAT,
            "fam-chat-mt",
            "m-chat-mt",
            json!({"model": "sim-openai", "messages": hi, "max_tokens": 650}),
            650,
        ),
        (
            COMPLETIONS,
            "fam-cmpl",
            "m-cmpl",
            json!({"model": "sim-openai", "prompt": "hi", "max_tokens": 600}),
            600,
        ),
        (
            MESSAGES,
            "fam-msg",
            "m-msg",
            json!({"model": "sim-claude", "messages": hi, "max_tokens": 900}),
            900,
        ),
    ] {
        let (r, _) = reserved(path, id, token, body).await;
        assert!(
            (cap..cap + 10).contains(&r),
            "{id}: reserved {r} for a cap of {cap}"
        );
    }
}

#[tokio::test]
async fn chat_reserves_the_larger_of_two_cap_fields_and_zero_is_no_cap() {
    let hi = json!([{"role": "user", "content": "hi"}]);
    // vLLM and SGLang read `max_completion_tokens or max_tokens`: 0 is falsy, 50,000 generated.
    let two_caps = json!({"model": "sim-openai", "messages": hi, "max_completion_tokens": 0, "max_tokens": 50_000});
    refused_up_front(CHAT, "two-caps-small", "s-chat-two-caps", two_caps.clone()).await;
    let (r, answer) = reserved(CHAT, "two-caps-meter", "m-chat-two-caps", two_caps).await;
    let generated = answer["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(generated, 50_000, "{answer}");
    assert!(
        r >= generated,
        "reserved {r} for a request the backend answered with {generated} tokens"
    );
    // `max_tokens: 0` alone is no cap: the tier's default, as a request without a cap.
    let (r, _) = reserved(
        CHAT,
        "zero-cap",
        "m-chat-zero",
        json!({"model": "sim-openai", "messages": hi, "max_tokens": 0}),
    )
    .await;
    assert!(
        (METER_DEFAULT_MAX_TOKENS..METER_DEFAULT_MAX_TOKENS + 10).contains(&r),
        "reserved {r} for max_tokens 0 (no cap; the tier default is {METER_DEFAULT_MAX_TOKENS})"
    );
    // Another family's cap field costs too (a lenient server may read it).
    refused_up_front(
        CHAT,
        "foreign-cap",
        "s-chat-foreign",
        json!({"model": "sim-openai", "messages": hi, "max_tokens": 5, "max_output_tokens": 100_000}),
    )
    .await;
}

/// An Anthropic plain-text document of `words` words.
fn text_document(words: usize) -> Value {
    json!({"type": "document",
           "source": {"type": "text", "media_type": "text/plain", "data": "word ".repeat(words)}})
}

#[tokio::test]
async fn anthropic_text_documents_are_prompt() {
    // 60,000 words (300 kB): the backend reads 60,000 tokens; 3,000 a day can never hold it.
    refused_up_front(
        MESSAGES,
        "doc-60k",
        "s-doc",
        json!({"model": "sim-claude", "max_tokens": 10, "messages": [{"role": "user", "content": [
            text_document(60_000), {"type": "text", "text": "summarise"}]}]}),
    )
    .await;
    let (r, answer) = reserved(
        MESSAGES,
        "doc-2k",
        "m-doc",
        json!({"model": "sim-claude", "max_tokens": 10, "messages": [{"role": "user", "content": [
            text_document(2000), {"type": "text", "text": "summarise"}]}]}),
    )
    .await;
    let read = answer["usage"]["input_tokens"].as_u64().unwrap();
    assert!(read >= 2000, "{answer}");
    assert!(
        r >= read + 10,
        "reserved {r} for a document the backend read as {read} tokens (+10 max_tokens)"
    );
}

#[tokio::test]
async fn declared_binary_media_stays_out_of_the_estimate() {
    // ~100 kB of base64 each; the type is declared after the payload in the Anthropic source.
    // Its bytes are not text (25,000 tokens each if they were); each part reserves the model's
    // media tokens (the default, 4096) instead.
    let media = maas_types::policy::DEFAULT_MEDIA_TOKENS;
    let b64 = "QUJD".repeat(25_000);
    let (r, _) = reserved(
        MESSAGES,
        "media-claude",
        "m-media-claude",
        json!({"model": "sim-claude", "max_tokens": 10, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"data": b64, "type": "base64", "media_type": "image/png"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": b64}},
            {"type": "text", "text": "describe"}]}]}),
    )
    .await;
    assert!(
        (2 * media..2 * media + 100).contains(&r),
        "reserved {r} for two declared binary payloads"
    );
    let (r, _) = reserved(
        CHAT,
        "media-openai",
        "m-media-openai",
        json!({"model": "sim-openai", "max_tokens": 10, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}},
            {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
            {"type": "file", "file": {"filename": "a.pdf", "file_data": format!("data:application/pdf;base64,{b64}")}},
            {"type": "text", "text": "describe"}]}]}),
    )
    .await;
    assert!(
        (3 * media..3 * media + 100).contains(&r),
        "reserved {r} for three declared binary payloads"
    );
}

/// A JSON schema with `n` property names (each `{}`: the names are the whole schema).
fn schema_with_names(n: usize) -> Value {
    let properties: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("property_name_{i:05}"), json!({})))
        .collect();
    json!({"type": "object", "properties": properties})
}

#[tokio::test]
async fn schema_property_names_are_prompt() {
    let hi = json!([{"role": "user", "content": "hi"}]);
    // 20,000 names (~440 kB): a tool schema and a response_format schema.
    refused_up_front(
        CHAT,
        "tool-names-20k",
        "s-tool-names",
        json!({"model": "sim-openai", "messages": hi, "max_tokens": 10, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema_with_names(20_000)}}]}),
    )
    .await;
    refused_up_front(
        CHAT,
        "format-names-20k",
        "s-format-names",
        json!({"model": "sim-openai", "messages": hi, "max_tokens": 10, "response_format": {
            "type": "json_schema", "json_schema": {"name": "out", "schema": schema_with_names(20_000)}}}),
    )
    .await;
    let (r, answer) = reserved(
        CHAT,
        "tool-names-500",
        "m-tool-names",
        json!({"model": "sim-openai", "messages": hi, "max_tokens": 10, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema_with_names(500)}}]}),
    )
    .await;
    let read = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(read >= 500, "{answer}");
    assert!(
        r >= read + 10,
        "reserved {r} for a tool schema the backend read as {read} tokens (+10 max_tokens)"
    );
}
