//! Enforcement integrity (issue 10) through real Envoy with the release .wasm: a wrong secret never
//! rides on the owner's callout, the prompt is reserved, a reservation that can never fit is
//! refused before the backend, compressed responses are counted, abandoned work is charged.
//!
//! Windows are a day long so that no test straddles a window boundary.

use crate::helpers::*;
use futures_util::future::join_all;
use maas_e2e::Stack;
use serde_json::json;
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: wide
    level: 1
    groups: [g-wide]
    limits:
      requests: [{limit: 100000, window: 1d}]
  - name: small
    level: 2
    groups: [g-small]
    limits:
      tokens: [{limit: 3000, window: 1d}]
    defaultMaxTokens: 10
  - name: meter
    level: 3
    groups: [g-meter]
    limits:
      tokens: [{limit: 1000000, window: 1d}]
    defaultMaxTokens: 100
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [wide, small, meter]
    backend: simulator
  # A model that reads images, each reserved at 1000 prompt tokens (the default is 4096).
  - name: vision-model
    path: /llm/vision-model
    tiers: [small]
    backend: simulator
    mediaTokens: 1000
  # A model that declares its context window: a request continuing stored context reserves it.
  - name: window-model
    path: /llm/window-model
    tiers: [small, meter]
    backend: simulator
    details: {contextWindow: "8192"}
  # A model whose platform team accepts tools the provider runs (settled from the usage).
  - name: settle-model
    path: /llm/settle-model
    tiers: [meter]
    backend: simulator
    hostedTools: settle
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: owner-token, username: owner, groups: [g-wide]}
  - {token: sue-token, username: sue, groups: [g-small]}
  - {token: pam-token, username: pam, groups: [g-small]}
  - {token: gus-token, username: gus, groups: [g-meter]}
  - {token: abby-token, username: abby, groups: [g-meter]}
  - {token: ivy-token, username: ivy, groups: [g-small]}
  - {token: vic-token, username: vic, groups: [g-small]}
  - {token: tom-token, username: tom, groups: [g-small]}
  - {token: cleo-token, username: cleo, groups: [g-meter]}
"#;

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {name}: {:?}", r.headers))
}

/// The same key id with another secret of the right shape.
fn wrong_secret(key: &str, n: usize) -> String {
    const B62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let (head, secret) = key.rsplit_once('_').expect("sk-oai-<id>_<secret>");
    let mut s: Vec<u8> = secret.bytes().collect();
    let last = s.len() - 1;
    let mut c = B62[n % B62.len()];
    if c == s[last] {
        c = B62[(n + 1) % B62.len()];
    }
    s[last] = c;
    format!("{head}_{}", String::from_utf8(s).unwrap())
}

#[tokio::test]
async fn a_wrong_secret_never_rides_on_the_owners_callout() {
    let stack = stack();
    let body = json!({"model": "sim-model", "max_tokens": 1,
                      "messages": [{"role": "user", "content": "hi"}]});
    let mut owner_ok = 0;
    let mut wrong_ok = 0;
    let mut wrong_total = 0;
    for round in 0..6 {
        // A fresh key: nothing cached, so the first requests all miss at once.
        let key = stack
            .mint_key_plain("owner-token", &format!("race-{round}"))
            .await
            .unwrap();
        let mut calls = Vec::new();
        for i in 0..25 {
            let cred = if i == 12 {
                key.clone()
            } else {
                wrong_secret(&key, i)
            };
            let body = body.clone();
            calls.push(async move {
                let auth = bearer(&cred);
                let r = chat(stack, CHAT, "race", &[("authorization", &auth)], body).await;
                (i == 12, r.status, r.body)
            });
        }
        for (is_owner, status, text) in join_all(calls).await {
            if is_owner {
                assert_eq!(status, 200, "the owner's request failed: {text}");
                owner_ok += 1;
            } else {
                wrong_total += 1;
                if status == 200 {
                    wrong_ok += 1;
                } else {
                    assert_eq!(status, 401, "{text}");
                }
            }
        }
    }
    assert_eq!(owner_ok, 6);
    assert_eq!(
        wrong_ok, 0,
        "{wrong_ok} of {wrong_total} wrong secrets were let through"
    );
}

#[tokio::test]
async fn a_huge_prompt_with_max_tokens_one_is_reserved_and_refused_up_front() {
    let stack = stack();
    // ~60k tokens of prompt (240 kB of text) with max_tokens 1, for a tier of 3000 tokens a day.
    let prompt = "word ".repeat(48_000);
    let body = json!({"model": "sim-model", "max_tokens": 1,
                      "messages": [{"role": "user", "content": prompt}]});
    let r = chat(
        stack,
        CHAT,
        "huge-prompt",
        &[("authorization", "Bearer sue-token")],
        body,
    )
    .await;
    let e = r.error(400);
    assert_eq!(e["code"], "tokens_exceed_limit", "{e}");
    assert!(
        stack.sim_requests_with_test_id("huge-prompt").is_empty(),
        "a request that can never fit reached the backend"
    );
}

#[tokio::test]
async fn parallel_large_prompts_cannot_multiply_the_budget() {
    let stack = stack();
    // Each request: ~1000 prompt tokens (4000 bytes; the simulator counts 1000 words, so the
    // settled use is as large) + max_tokens 10 → ~1010 reserved and used; the tier has 3000 a
    // day, so at most 2 run whatever the concurrency.
    let prompt = "abc ".repeat(1000);
    let bodies = (0..8).map(|_| {
        json!({"model": "sim-model", "max_tokens": 10,
               "messages": [{"role": "user", "content": prompt.clone()}]})
    });
    let ok = admitted_at_once(
        stack,
        CHAT,
        "par-prompt",
        &[("authorization", "Bearer pam-token")],
        bodies,
    )
    .await;
    assert!(ok <= 2, "{ok} requests of ~1010 tokens admitted on 3000");
}

/// Sends `bodies` at once; the number answered 200, which must be at least one and what the
/// simulator received.
async fn admitted_at_once(
    stack: &Stack,
    path: &str,
    test_id: &str,
    headers: &[(&str, &str)],
    bodies: impl Iterator<Item = serde_json::Value>,
) -> usize {
    let calls =
        bodies.map(|body| async move { chat(stack, path, test_id, headers, body).await.status });
    let statuses = join_all(calls).await;
    let ok = statuses.iter().filter(|s| **s == 200).count();
    assert!(ok >= 1, "{test_id}: {statuses:?}");
    assert_eq!(
        ok,
        stack.sim_requests_with_test_id(test_id).len(),
        "{test_id}: {statuses:?}"
    );
    ok
}

/// An image costs what the model charges for it, not its few bytes of URL: a part carrying
/// media reserves the model's `mediaTokens` (default 4096), so one image is more than the
/// small tier's whole day and is refused before the backend.
#[tokio::test]
async fn an_image_by_url_is_reserved_at_the_models_media_tokens() {
    let stack = stack();
    let body = json!({"model": "sim-model", "max_tokens": 1,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]});
    let r = chat(
        stack,
        CHAT,
        "image-url",
        &[("authorization", "Bearer ivy-token")],
        body,
    )
    .await;
    let e = r.error(400);
    assert_eq!(e["code"], "tokens_exceed_limit", "{e}");
    assert!(
        stack.sim_requests_with_test_id("image-url").is_empty(),
        "a request whose images can never fit reached the backend"
    );
}

/// Concurrent requests carrying images cannot multiply the budget: each reserves its image at
/// `mediaTokens` (1000 on vision-model) while it runs, so on a 3000-token day at most two of
/// eight slow ones run at once, though their text is a few tokens (before media cost, all
/// eight ran).
#[tokio::test]
async fn parallel_image_requests_cannot_multiply_the_budget() {
    let stack = stack();
    let bodies = (0..8).map(|i| {
        json!({"model": "vision-model", "max_tokens": 10,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "describe"},
                {"type": "image_url", "image_url": {"url": format!("https://example.com/{i}.png")}}]}]})
    });
    let headers = [
        ("authorization", "Bearer vic-token"),
        ("x-sim-response-delay-ms", "1500"),
    ];
    let path = "/llm/vision-model/v1/chat/completions";
    let ok = admitted_at_once(stack, path, "par-image", &headers, bodies).await;
    assert!(
        ok <= 2,
        "{ok} requests with a 1000-token image admitted at once on 3000"
    );
}

/// A Responses request continuing a stored response makes the provider read the whole earlier
/// conversation, which the body does not show: it reserves the model's context window, or is
/// refused (naming the field) when the model declares none; never forwarded on a few tokens.
#[tokio::test]
async fn continuing_stored_context_reserves_the_context_window_or_is_refused() {
    let stack = stack();
    let chained = |model: &str| {
        json!({"model": model, "input": "and then?", "max_output_tokens": 10,
               "previous_response_id": "resp_0123456789"})
    };
    // No context window declared: nothing to reserve for it.
    let r = chat(
        stack,
        "/llm/sim-model/v1/responses",
        "stored-unbounded",
        &[("authorization", "Bearer cleo-token")],
        chained("sim-model"),
    )
    .await;
    let e = r.error(400);
    assert_eq!(e["code"], "prompt_not_reservable", "{e}");
    assert_eq!(e["param"], "previous_response_id", "{e}");
    // Declared (8192): more than the small tier's day, refused up front …
    let r = chat(
        stack,
        "/llm/window-model/v1/responses",
        "stored-small",
        &[("authorization", "Bearer tom-token")],
        chained("window-model"),
    )
    .await;
    assert_eq!(r.error(400)["code"], "tokens_exceed_limit");
    for id in ["stored-unbounded", "stored-small"] {
        assert!(
            stack.sim_requests_with_test_id(id).is_empty(),
            "{id}: a request whose prompt could not be reserved reached the backend"
        );
    }
    // … and reserved whole on a large one (the window after the reservation says so).
    let r = chat(
        stack,
        "/llm/window-model/v1/responses",
        "stored-reserved",
        &[("authorization", "Bearer cleo-token")],
        chained("window-model"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let remaining = header_u64(&r, "x-ratelimit-remaining-tokens");
    assert!(
        remaining <= 1_000_000 - 8192 - 10,
        "remaining {remaining}: the context window was not reserved"
    );
}

/// A tool the provider runs itself (web search, code execution, remote MCP) reads content and
/// takes turns the body does not show: refused by default, naming it, and never forwarded;
/// a model whose policy says `hostedTools: settle` forwards it.
#[tokio::test]
async fn tools_the_provider_runs_are_refused_unless_the_model_settles_them() {
    let stack = stack();
    let auth = [("authorization", "Bearer cleo-token")];
    let hi = json!([{"role": "user", "content": "find it"}]);
    let function = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
    let cases = [
        (
            CHAT,
            "hosted-chat",
            json!({"model": "sim-model", "max_tokens": 10, "messages": hi,
                   "tools": [function, {"type": "web_search"}]}),
            "tools",
        ),
        (
            "/llm/sim-model/v1/responses",
            "hosted-responses",
            json!({"model": "sim-model", "max_output_tokens": 10, "input": "find it",
                   "tools": [{"type": "mcp", "server_label": "x", "server_url": "https://mcp.example.com"}]}),
            "tools",
        ),
        (
            CHAT,
            "hosted-search-options",
            json!({"model": "sim-model", "max_tokens": 10, "messages": hi, "web_search_options": {}}),
            "web_search_options",
        ),
    ];
    for (path, id, body, param) in cases {
        let r = chat(stack, path, id, &auth, body).await;
        let e = r.error(400);
        assert_eq!(e["code"], "hosted_tool_not_allowed", "{id}: {e}");
        assert_eq!(e["param"], param, "{id}: {e}");
        assert!(
            stack.sim_requests_with_test_id(id).is_empty(),
            "{id}: a request with a tool the provider runs reached the backend"
        );
    }
    // A 100 kB tool type is refused naming only its first 64 bytes: the answer does not echo
    // what the client sent.
    let r = chat(
        stack,
        CHAT,
        "hosted-long-type",
        &auth,
        json!({"model": "sim-model", "max_tokens": 10, "messages": hi,
               "tools": [{"type": "t".repeat(100_000)}]}),
    )
    .await;
    assert_eq!(r.error(400)["code"], "hosted_tool_not_allowed");
    assert!(r.body.len() < 2000, "{} bytes", r.body.len());
    assert!(
        stack
            .sim_requests_with_test_id("hosted-long-type")
            .is_empty()
    );
    // Function tools alone are the client's: forwarded.
    let r = chat(
        stack,
        CHAT,
        "hosted-function",
        &auth,
        json!({"model": "sim-model", "max_tokens": 10, "messages": hi, "tools": [function]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The model that settles them forwards the request.
    let _ = chat(
        stack,
        "/llm/settle-model/v1/chat/completions",
        "hosted-settled",
        &auth,
        json!({"model": "settle-model", "max_tokens": 10, "messages": hi,
               "tools": [{"type": "web_search"}]}),
    )
    .await;
    assert_eq!(stack.sim_requests_with_test_id("hosted-settled").len(), 1);
}

/// Tokens left in gus's (or abby's) day, from a zero-cost discovery… no: discovery carries no
/// rate headers; a one-token request's headers are taken and its own reservation added back.
async fn remaining_tokens(stack: &Stack, token: &str, id: &str) -> u64 {
    let auth = bearer(token);
    let body = json!({"model": "sim-model", "max_tokens": 1,
                      "messages": [{"role": "user", "content": "x"}]});
    let r = chat(stack, CHAT, id, &[("authorization", &auth)], body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    header_u64(&r, "x-ratelimit-remaining-tokens")
}

#[tokio::test]
async fn compressed_responses_are_counted() {
    let stack = stack();
    let before = remaining_tokens(stack, "gus-token", "gz-probe-1").await;
    // The client accepts gzip (as the OpenAI SDKs do) and the backend compresses whatever it is
    // asked: 50,000 completion tokens must be charged, not 0 or the reservation.
    let body = json!({"model": "sim-model", "max_tokens": 50000,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = chat(
        stack,
        CHAT,
        "gz-json",
        &[
            ("authorization", "Bearer gus-token"),
            ("accept-encoding", "gzip"),
            ("x-sim-compress", "always-gzip"),
            ("x-sim-completion-tokens", "50000"),
        ],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The backend was asked for an uncompressed body.
    let sent = stack.sim_requests_with_test_id("gz-json");
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].header("accept-encoding"), Some("identity"));
    let after = remaining_tokens(stack, "gus-token", "gz-probe-2").await;
    // probe 1 settled to its real use (a few tokens); the compressed response to 50,000+.
    let spent = before - after;
    assert!(
        (50_000..50_100).contains(&spent),
        "charged {spent} tokens for a 50,000-token compressed response"
    );

    // Streamed and compressed.
    let before = after;
    let body = json!({"model": "sim-model", "max_tokens": 5000, "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = chat(
        stack,
        CHAT,
        "gz-sse",
        &[
            ("authorization", "Bearer gus-token"),
            ("accept-encoding", "gzip"),
            ("x-sim-compress", "always-gzip"),
            ("x-sim-completion-tokens", "3000"),
        ],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let after = remaining_tokens(stack, "gus-token", "gz-probe-3").await;
    let spent = before - after;
    assert!(
        (3_000..3_100).contains(&spent),
        "charged {spent} tokens for a 3,000-token compressed stream"
    );
}

#[tokio::test]
async fn work_abandoned_before_the_response_is_charged() {
    let stack = stack();
    let before = remaining_tokens(stack, "abby-token", "abandon-probe-1").await;
    // The backend answers after 2 s; the client gives up after 300 ms.
    let body = json!({"model": "sim-model", "max_tokens": 700,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
        .post(format!("{}{CHAT}", stack.gateway_url()))
        .header("authorization", "Bearer abby-token")
        .header("x-test-id", "abandon")
        .header("x-sim-response-delay-ms", "2000")
        .json(&body)
        .send()
        .await;
    assert!(r.is_err(), "the client was meant to give up");
    // Settlement happens when Envoy ends the stream; poll until it shows.
    let mut spent = 0;
    for i in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = remaining_tokens(stack, "abby-token", &format!("abandon-probe-{}", i + 2)).await;
        // Each probe costs a few tokens of its own.
        spent = before - now;
        if spent >= 700 {
            break;
        }
    }
    assert!(
        spent >= 700,
        "an abandoned request settled to {spent} tokens, not its reservation (700+)"
    );
}
