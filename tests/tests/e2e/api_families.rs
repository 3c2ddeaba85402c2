//! Every API family through the real stack (Envoy + the release .wasm + companion + simulator):
//! OpenAI Responses and Anthropic Messages requests, streamed and not, pass the gateway unchanged
//! (the simulator refuses unknown fields as the real APIs do, so a body the gateway rewrote with
//! `stream_options` would be a 400) and their real usage is charged to the caller's token window.
//!
//! What a request was charged is read from `x-ratelimit-remaining-tokens` of a probe before and
//! after it (as filter_limits.rs does): a non-streamed chat completion of known usage. Each test
//! has its own subject, so the windows do not mix; windows are a day long.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};

const LIMIT: u64 = 100_000;

const POLICY: &str = r#"
tiers:
  - name: fam
    level: 1
    groups: [g-fam]
    limits:
      tokens: [{limit: 100000, window: 1d}]
    defaultMaxTokens: 50
models:
  - name: sim-openai
    path: /llm/sim-openai
    tiers: [fam]
    backend: simulator
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [fam]
    backend: simulator
    api: anthropic
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: resp-plain-token, username: resp-plain, groups: [g-fam]}
  - {token: resp-stream-token, username: resp-stream, groups: [g-fam]}
  - {token: msg-plain-token, username: msg-plain, groups: [g-fam]}
  - {token: msg-stream-token, username: msg-stream, groups: [g-fam]}
  - {token: emb-token, username: emb, groups: [g-fam]}
  - {token: chat-token, username: chat, groups: [g-fam]}
  - {token: resp-big-token, username: resp-big, groups: [g-fam]}
  - {token: gz-token, username: gz, groups: [g-fam]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

const CHAT: &str = "/llm/sim-openai/v1/chat/completions";
const RESPONSES: &str = "/llm/sim-openai/v1/responses";
const EMBEDDINGS: &str = "/llm/sim-openai/v1/embeddings";
const MESSAGES: &str = "/llm/sim-claude/v1/messages";

/// Usage of one probe: prompt "x" (1) + 1 completion token.
const PROBE_USAGE: u64 = 2;

fn remaining_tokens(r: &Reply) -> u64 {
    r.header("x-ratelimit-remaining-tokens")
        .unwrap_or_else(|| panic!("no x-ratelimit-remaining-tokens in {:?}", r.headers))
        .parse()
        .unwrap()
}

/// A non-streamed chat completion of known usage; returns the tokens remaining in the window
/// after its own reservation.
async fn probe(token: &str, id: &str) -> u64 {
    let r = chat(
        stack(),
        CHAT,
        id,
        &[("authorization", &bearer(token))],
        json!({"model": "sim-openai", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "probe {id}: {}", r.body);
    assert_eq!(r.json()["usage"]["total_tokens"], PROBE_USAGE);
    remaining_tokens(&r)
}

/// Sends `body` to `path` between two probes; returns the reply and the tokens it was charged.
async fn charged(token: &str, id: &str, path: &str, body: Value) -> (Reply, u64) {
    let before = probe(token, &format!("{id}-probe-before")).await;
    assert!(before <= LIMIT);
    let r = chat(
        stack(),
        path,
        id,
        &[("authorization", &bearer(token))],
        body,
    )
    .await;
    let after = probe(token, &format!("{id}-probe-after")).await;
    let used = before
        .checked_sub(after)
        .and_then(|d| d.checked_sub(PROBE_USAGE))
        .unwrap_or_else(|| panic!("{id}: remaining went from {before} to {after}"));
    (r, used)
}

/// `(event name, data)` of a named-event SSE body.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = String::new();
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = d.to_string();
                }
            }
            let v = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {body}"));
            (name, v)
        })
        .collect()
}

/// The body the simulator received for this test id, as JSON.
fn upstream_body(id: &str) -> Value {
    let seen = stack().sim_requests_with_test_id(id);
    assert_eq!(
        seen.len(),
        1,
        "{id} reached the backend {} times",
        seen.len()
    );
    serde_json::from_str(&seen[0].body).unwrap()
}

#[tokio::test]
async fn responses_api_non_streamed_usage_is_charged() {
    // input 3 words + instructions 2 = 5 prompt tokens, 4 output tokens.
    let body = json!({"model": "sim-openai", "input": "one two three", "instructions": "be brief",
                      "max_output_tokens": 4});
    let (r, used) = charged(
        "resp-plain-token",
        "fam-resp-plain",
        RESPONSES,
        body.clone(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["total_tokens"], 9, "{}", r.body);
    assert_eq!(used, 9, "charged what the response's usage says");
    assert_eq!(upstream_body("fam-resp-plain"), body, "forwarded unchanged");
}

#[tokio::test]
async fn responses_api_streamed_passes_and_usage_is_charged() {
    let body = json!({"model": "sim-openai", "input": "one two three", "instructions": "be brief",
                      "max_output_tokens": 4, "stream": true});
    let (r, used) = charged(
        "resp-stream-token",
        "fam-resp-stream",
        RESPONSES,
        body.clone(),
    )
    .await;
    assert_eq!(
        r.status, 200,
        "the Responses API refuses stream_options.include_usage: {}",
        r.body
    );
    assert_eq!(
        upstream_body("fam-resp-stream"),
        body,
        "forwarded unchanged"
    );
    let events = named_events(&r.body);
    let last = &events.last().expect("events").1;
    assert_eq!(last["type"], "response.completed", "{}", r.body);
    assert_eq!(last["response"]["usage"]["total_tokens"], 9);
    assert_eq!(
        events
            .iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .count(),
        4,
        "nothing stripped"
    );
    assert_eq!(used, 9, "charged the usage of response.completed");
}

#[tokio::test]
async fn anthropic_messages_non_streamed_usage_is_charged() {
    // messages 3 words + system 2 = 5 input tokens, 6 output tokens.
    let body = json!({"model": "sim-claude", "max_tokens": 6, "system": "be brief",
                      "messages": [{"role": "user", "content": "hello there friend"}]});
    let (r, used) = charged("msg-plain-token", "fam-msg-plain", MESSAGES, body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "message", "{}", r.body);
    assert_eq!(
        (&v["usage"]["input_tokens"], &v["usage"]["output_tokens"]),
        (&json!(5), &json!(6))
    );
    assert_eq!(used, 11, "input + output tokens charged");
    assert_eq!(upstream_body("fam-msg-plain"), body, "forwarded unchanged");
}

#[tokio::test]
async fn anthropic_messages_streamed_passes_and_usage_is_charged() {
    let body = json!({"model": "sim-claude", "max_tokens": 6, "system": "be brief", "stream": true,
                      "messages": [{"role": "user", "content": "hello there friend"}]});
    let (r, used) = charged("msg-stream-token", "fam-msg-stream", MESSAGES, body.clone()).await;
    assert_eq!(
        r.status, 200,
        "Anthropic refuses stream_options (extra inputs): {}",
        r.body
    );
    assert_eq!(upstream_body("fam-msg-stream"), body, "forwarded unchanged");
    let events = named_events(&r.body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{}", r.body);
    assert_eq!(names.last(), Some(&"message_stop"), "{}", r.body);
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "content_block_delta")
            .count(),
        6,
        "nothing stripped"
    );
    assert_eq!(
        used, 11,
        "input (message_start) + output (message_delta) charged"
    );
}

#[tokio::test]
async fn embeddings_usage_is_charged() {
    let body = json!({"model": "sim-openai", "input": ["a b", "c d e"]});
    let (r, used) = charged("emb-token", "fam-emb", EMBEDDINGS, body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"],
        json!({"prompt_tokens": 5, "total_tokens": 5})
    );
    assert_eq!(used, 5);
    assert_eq!(upstream_body("fam-emb"), body, "forwarded unchanged");
}

#[tokio::test]
async fn chat_stream_still_gets_usage_added_and_stripped() {
    // The control: OpenAI chat/completions streams are still rewritten for usage, which the
    // (strict) simulator accepts, and the usage-only chunk never reaches the client.
    let body = json!({"model": "sim-openai", "max_tokens": 3, "stream": true,
                      "messages": [{"role": "user", "content": "a b"}]});
    let (r, used) = charged("chat-token", "fam-chat-stream", CHAT, body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let sent = upstream_body("fam-chat-stream");
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert!(!r.body.contains("\"usage\":{"), "{}", r.body);
    assert_eq!(used, 5);
}

#[tokio::test]
async fn responses_api_stream_with_a_completed_event_larger_than_the_caps_is_charged() {
    // 12,000 output tokens: response.completed repeats the ~90 KB text on one data line, more
    // than the filter parses whole (64 KiB): its usage is found while it passes.
    let body = json!({"model": "sim-openai", "input": "one two three", "max_output_tokens": 12000,
                      "stream": true});
    let (r, used) = charged("resp-big-token", "fam-resp-big", RESPONSES, body).await;
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(500)]);
    let completed = r
        .body
        .split("\n\n")
        .find(|e| e.starts_with("event: response.completed"))
        .expect("response.completed reached the client");
    assert!(completed.len() > 64 * 1024, "{}", completed.len());
    assert_eq!(used, 3 + 12_000);
}

#[tokio::test]
async fn gzipped_responses_are_still_charged() {
    // A backend that compresses whatever the client accepts (x-sim-compress: always-gzip).
    let h = [
        ("authorization", "Bearer gz-token"),
        ("x-sim-compress", "always-gzip"),
    ];
    for (id, path, body, expected) in [
        (
            "fam-gz-resp",
            RESPONSES,
            json!({"model": "sim-openai", "input": "one two three", "max_output_tokens": 4}),
            7,
        ),
        (
            "fam-gz-msg-stream",
            MESSAGES,
            json!({"model": "sim-claude", "max_tokens": 6, "stream": true,
                   "messages": [{"role": "user", "content": "hello there friend"}]}),
            9,
        ),
    ] {
        let before = probe("gz-token", &format!("{id}-probe-before")).await;
        let r = chat(stack(), path, id, &h, body).await;
        let after = probe("gz-token", &format!("{id}-probe-after")).await;
        assert_eq!(r.status, 200, "{id}");
        assert_eq!(r.header("content-encoding"), Some("gzip"), "{id}");
        assert_eq!(before - after - PROBE_USAGE, expected, "{id}");
    }
}
