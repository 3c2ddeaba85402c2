//! Weighted token limits and the unmetered Anthropic `count_tokens` through the real stack
//! (Envoy + the release .wasm + companion + simulator), issue 15.
//!
//! - A tier with `tokenWeights: {output: 4}`: a response of 10 prompt + 20 completion tokens costs
//!   10 + 20 × 4 = 90 "weighted tokens", as `x-ratelimit-remaining-tokens` shows, and the window
//!   is exhausted in that unit.
//! - `POST …/v1/messages/count_tokens` (Anthropic) is forwarded (the simulator answers it as
//!   strictly as the real API: `{"input_tokens": n}`, any field it does not know refused), counts
//!   as a request in the request windows and reserves and settles no token.
//!
//! Each test has its own subject; windows are a day long.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const TOKEN_LIMIT: u64 = 1000;

const POLICY: &str = r#"
tiers:
  - name: weighted
    level: 1
    groups: [g-weighted]
    limits:
      requests: [{limit: 1000, window: 1d}]
      tokens: [{limit: 1000, window: 1d}]
    tokenWeights: {output: 4}
  - name: counted
    level: 1
    groups: [g-counted]
    limits:
      requests: [{limit: 3, window: 1d}]
      tokens: [{limit: 1000, window: 1d}]
models:
  - name: sim-openai
    path: /llm/sim-openai
    tiers: [weighted, counted]
    backend: simulator
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [weighted, counted]
    backend: simulator
    api: anthropic
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: w-cost-token, username: w-cost, groups: [g-weighted]}
  - {token: w-budget-token, username: w-budget, groups: [g-weighted]}
  - {token: ct-token, username: ct, groups: [g-counted]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with_plugin_config(
        &S,
        POLICY,
        IDENTITIES,
        "credentials: {}\n",
        Some(json!({"usage": {"reportIntervalMs": 500}})),
    )
}

const CHAT: &str = "/llm/sim-openai/v1/chat/completions";
const COUNT_TOKENS: &str = "/llm/sim-claude/v1/messages/count_tokens";

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", r.headers))
        .parse()
        .unwrap()
}

/// A chat completion whose usage is 10 prompt tokens (ten words) and 20 completion tokens.
fn ten_and_twenty() -> Value {
    json!({"model": "sim-openai", "max_tokens": 20,
           "messages": [{"role": "user", "content": "one two three four five six seven eight nine ten"}]})
}

async fn call(token: &str, id: &str) -> Reply {
    chat(
        stack(),
        CHAT,
        id,
        &[("authorization", &bearer(token))],
        ten_and_twenty(),
    )
    .await
}

#[tokio::test]
async fn a_response_of_10_prompt_and_20_completion_tokens_costs_90_with_output_weighing_4() {
    let first = call("w-cost-token", "w-cost-1").await;
    assert_eq!(first.status, 200, "{}", first.body);
    let usage = &first.json()["usage"];
    assert_eq!(
        (&usage["prompt_tokens"], &usage["completion_tokens"]),
        (&json!(10), &json!(20)),
        "the simulator's usage"
    );
    // Admission reserved the prompt estimate + max_tokens 20 × 4.
    let reserved = TOKEN_LIMIT - header_u64(&first, "x-ratelimit-remaining-tokens");
    assert!(
        reserved > 80,
        "reserved {reserved}: max_tokens 20 weighs 80"
    );
    let second = call("w-cost-token", "w-cost-2").await;
    assert_eq!(second.status, 200, "{}", second.body);
    // The first settled to 10 + 20 × 4 = 90 (unweighted it would be 30); the second reserved
    // the same as the first.
    assert_eq!(
        header_u64(&second, "x-ratelimit-remaining-tokens"),
        TOKEN_LIMIT - 90 - reserved
    );
    // The ledger keeps the raw tokens: 2 × (10 prompt, 20 completion), never weighted.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = send(
            client()
                .get(format!(
                    "{}/maas-api/v1/usage?groupBy=model",
                    stack().gateway_url()
                ))
                .header("authorization", bearer("w-cost-token")),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let row = r.json()["data"][0].clone();
        if row["requests"] == 2 {
            assert_eq!(
                (&row["promptTokens"], &row["completionTokens"]),
                (&json!(20), &json!(40)),
                "{row}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the ledger never showed 2 requests: {row}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_token_budget_is_exhausted_in_weighted_tokens() {
    let first = call("w-budget-token", "w-budget-0").await;
    assert_eq!(first.status, 200, "{}", first.body);
    let reserved = TOKEN_LIMIT - header_u64(&first, "x-ratelimit-remaining-tokens");
    // Request k + 1 is admitted while k × 90 + reserved ≤ 1000 (unweighted: k × 30).
    let admitted = (TOKEN_LIMIT - reserved) / 90 + 1;
    for k in 1..admitted {
        // Two ticks apart, the subject is never "hot" (filter/src/folds.rs: 8 admissions in two
        // ticks on a worker), so each refund is written when the answer ends: folded, it would
        // reach the counter the other worker reads only at the first worker's next tick, and
        // the arithmetic above would not hold on a loaded machine.
        tokio::time::sleep(std::time::Duration::from_millis(450)).await;
        let r = call("w-budget-token", &format!("w-budget-{k}")).await;
        assert_eq!(r.status, 200, "request {k}: {}", r.body);
    }
    let refused = call("w-budget-token", "w-budget-last").await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    let e = refused.error(429);
    assert_eq!(e["code"], "rate_limit_exceeded", "{e}");
    assert!(
        header_u64(&refused, "x-ratelimit-remaining-tokens") < reserved,
        "{:?}",
        refused.headers
    );
    assert!(
        admitted < TOKEN_LIMIT / 30,
        "weighted: fewer than the {} unweighted",
        TOKEN_LIMIT / 30
    );
}

#[tokio::test]
async fn count_tokens_is_forwarded_and_counts_a_request_but_no_token() {
    let body = json!({"model": "sim-claude",
                      "messages": [{"role": "user", "content": "how many tokens is this"}]});
    // The tier allows 3 requests a day: three count_tokens calls pass, none takes a token.
    for n in 1..=3u64 {
        let id = format!("ct-{n}");
        let r = chat(
            stack(),
            COUNT_TOKENS,
            &id,
            &[("authorization", &bearer("ct-token"))],
            body.clone(),
        )
        .await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        assert_eq!(r.json(), json!({"input_tokens": 5}));
        assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 3 - n);
        assert_eq!(
            header_u64(&r, "x-ratelimit-remaining-tokens"),
            TOKEN_LIMIT,
            "{id}: no token reserved or settled"
        );
        // The body reached the backend unaltered.
        let seen = stack().sim_requests_with_test_id(&id);
        assert_eq!(seen.len(), 1);
        assert_eq!(serde_json::from_str::<Value>(&seen[0].body).unwrap(), body);
        assert!(seen[0].path.ends_with("/v1/messages/count_tokens"));
    }
    let r = chat(
        stack(),
        COUNT_TOKENS,
        "ct-4",
        &[("authorization", &bearer("ct-token"))],
        body,
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(stack().sim_requests_with_test_id("ct-4").is_empty());
}
