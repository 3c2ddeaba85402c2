//! Requests that name no output cap (issue 26, item 4), through real Envoy with the release .wasm:
//! the simulator answers as vLLM does (`x-sim-uncapped-tokens`: it generates that much when the
//! body names no cap, as vLLM generates up to the context length). A tier that injects
//! (`uncappedRequests: inject`, the default) sets the API family's cap field to what it reserves,
//! so the backend stops there; a tier that only reserves (`reserve`) overshoots by the whole
//! generation (settled as debt).
//!
//! Windows are a day long so that no test straddles a window boundary.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};

const POLICY: &str = r#"
tiers:
  - name: injects
    level: 1
    groups: [g-inject]
    limits:
      tokens: [{limit: 1000, window: 1d}]
    defaultMaxTokens: 50
  - name: reserves
    level: 2
    groups: [g-reserve]
    limits:
      tokens: [{limit: 1000, window: 1d}]
    defaultMaxTokens: 50
    uncappedRequests: reserve
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [injects, reserves]
    backend: simulator
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [injects]
    backend: simulator
    api: anthropic
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: ivy-token, username: ivy, groups: [g-inject]}
  - {token: ida-token, username: ida, groups: [g-inject]}
  - {token: ian-token, username: ian, groups: [g-inject]}
  - {token: rex-token, username: rex, groups: [g-reserve]}
  - {token: una-token, username: una, groups: [g-inject]}
"#;

/// What the backend generates for a body without a cap (vLLM: up to the context length).
const CONTEXT: &str = "100000";

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

async fn post(stack: &Stack, path: &str, test_id: &str, token: &str, body: Value) -> Reply {
    let auth = bearer(token);
    chat(
        stack,
        path,
        test_id,
        &[
            ("authorization", auth.as_str()),
            ("x-sim-uncapped-tokens", CONTEXT),
        ],
        body,
    )
    .await
}

/// The body the simulator received for this test.
fn received(stack: &Stack, test_id: &str) -> Value {
    let reqs = stack.sim_requests_with_test_id(test_id);
    let last = reqs
        .last()
        .unwrap_or_else(|| panic!("{test_id}: nothing reached the backend"));
    serde_json::from_str(&last.body).unwrap()
}

fn remaining_tokens(r: &Reply) -> u64 {
    r.header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no x-ratelimit-remaining-tokens: {:?}", r.headers))
}

#[tokio::test]
async fn an_uncapped_chat_request_is_capped_at_its_reservation() {
    let stack = stack();
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
    let r = post(
        stack,
        "/llm/sim-model/v1/chat/completions",
        "cap-chat",
        "ivy-token",
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Before: the backend generated 100,000 tokens against a reservation of 50.
    assert_eq!(r.json()["usage"]["completion_tokens"], 50, "{}", r.body);
    let sent = received(stack, "cap-chat");
    assert_eq!(sent["max_tokens"], 50, "{sent}");
    assert_eq!(
        sent["messages"][0]["content"], "hi",
        "the rest is as sent: {sent}"
    );
}

#[tokio::test]
async fn an_uncapped_stream_is_capped_and_still_counted() {
    let stack = stack();
    let body = json!({"model": "sim-model", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = post(
        stack,
        "/llm/sim-model/v1/chat/completions",
        "cap-stream",
        "ida-token",
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let content_chunks = r
        .body
        .lines()
        .filter(|l| l.starts_with("data: {") && l.contains("\"content\""))
        .count();
    assert_eq!(content_chunks, 50, "{}", r.body);
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    let sent = received(stack, "cap-stream");
    assert_eq!(sent["max_tokens"], 50, "{sent}");
    assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
}

#[tokio::test]
async fn every_api_family_gets_its_own_cap_field() {
    let stack = stack();
    let cases = [
        (
            "/llm/sim-model/v1/completions",
            json!({"model": "sim-model", "prompt": "hi"}),
            "max_tokens",
            "/usage/completion_tokens",
        ),
        (
            "/llm/sim-model/v1/responses",
            json!({"model": "sim-model", "input": "hi"}),
            "max_output_tokens",
            "/usage/output_tokens",
        ),
        (
            "/llm/sim-claude/v1/messages",
            json!({"model": "sim-claude", "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
            "/usage/output_tokens",
        ),
    ];
    for (i, (path, body, field, usage)) in cases.into_iter().enumerate() {
        let id = format!("cap-family-{i}");
        let r = post(stack, path, &id, "ian-token", body).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert_eq!(
            r.json().pointer(usage),
            Some(&json!(50)),
            "{path}: {}",
            r.body
        );
        assert_eq!(received(stack, &id)[field], 50, "{path}");
    }
}

#[tokio::test]
async fn uncapped_requests_never_take_more_than_the_window() {
    let stack = stack();
    // Until refused: each request is capped at its reservation, so the window holds.
    let mut admitted = 0;
    let mut generated = 0;
    for i in 0..40 {
        let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
        let r = post(
            stack,
            "/llm/sim-model/v1/chat/completions",
            &format!("cap-window-{i}"),
            "una-token",
            body,
        )
        .await;
        if r.status != 200 {
            assert_eq!(r.error(429)["code"], "rate_limit_exceeded", "{}", r.body);
            break;
        }
        admitted += 1;
        generated += r.json()["usage"]["total_tokens"].as_u64().unwrap();
    }
    // 1000 tokens a day, each request about 1 prompt + 50 completion tokens: the window holds.
    assert!(admitted > 5, "{admitted} admitted");
    assert!(
        generated <= 1000,
        "{generated} tokens generated for a window of 1000"
    );
}

#[tokio::test]
async fn a_tier_that_only_reserves_overshoots_by_the_whole_generation() {
    let stack = stack();
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
    let r = post(
        stack,
        "/llm/sim-model/v1/chat/completions",
        "cap-reserve",
        "rex-token",
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Forwarded as sent: the backend generates what it likes (the documented choice).
    assert_eq!(r.json()["usage"]["completion_tokens"], 100000, "{}", r.body);
    assert!(received(stack, "cap-reserve").get("max_tokens").is_none());
    assert!(remaining_tokens(&r) <= 1000);
}
