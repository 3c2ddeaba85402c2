//! The usage ledger end to end (issue 16): calls through the real gateway (Envoy + the wasm
//! filter) are reported by the filter's workers (`POST /internal/v1/usage`, every
//! `usage.reportIntervalMs`) to the companion's PostgreSQL ledger, and `GET /maas-api/v1/usage`
//! shows exactly those requests and tokens — the simulator's usage numbers — with refusals by
//! reason; an API key sees its own key's usage only; `GET /maas-api/v1/quota` `used` matches
//! what the `x-ratelimit-remaining-*` headers implied.
//!
//! Prints `usage-ledger figure:` lines (how long after the last call the ledger showed it).

use crate::helpers::{ModuleStack, Reply, bearer, client, send};
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: metered
    level: 0
    groups: [g-metered]
    limits:
      requests: [{limit: 100, window: 1d}]
      tokens: [{limit: 100000, window: 1d}]
    defaultMaxTokens: 50
  - name: tiny
    level: 1
    groups: [g-tiny]
    limits:
      requests: [{limit: 1, window: 1d}]
  - name: trial
    level: 2
    groups: [g-trial]
    limits:
      requests: [{limit: 100, window: 1d}, {limit: 1, window: 1d, shadow: true}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [metered, tiny, trial]
    backend: simulator
  - name: sim-embed
    path: /llm/sim-embed
    tiers: [metered]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: led-token, username: led, groups: [g-metered]}
  - {token: tiny-token, username: tiny, groups: [g-tiny]}
  - {token: quota-token, username: quota, groups: [g-metered]}
  - {token: trial-token, username: trial, groups: [g-trial]}
"#;

/// Short enough for the test, long enough to batch several calls.
const REPORT_INTERVAL_MS: u64 = 500;
/// How long the ledger may take to show a call: a report interval, a tick, the companion's
/// insert, with room for a loaded machine.
const LEDGER_DEADLINE: Duration = Duration::from_secs(20);

const CHAT: &str = "/llm/sim-model/v1/chat/completions";
const EMBEDDINGS: &str = "/llm/sim-embed/v1/embeddings";

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    crate::helpers::stack_with_plugin_config(
        &S,
        POLICY,
        IDENTITIES,
        "credentials: {}\n",
        Some(json!({"usage": {"reportIntervalMs": REPORT_INTERVAL_MS}})),
    )
}

async fn call(cred: &str, path: &str, body: Value) -> Reply {
    send(
        client()
            .post(format!("{}{path}", stack().gateway_url()))
            .header("authorization", bearer(cred))
            .json(&body),
    )
    .await
}

async fn get(cred: &str, path_and_query: &str) -> Reply {
    send(
        client()
            .get(format!(
                "{}/maas-api{path_and_query}",
                stack().gateway_url()
            ))
            .header("authorization", bearer(cred)),
    )
    .await
}

/// `GET /v1/usage?groupBy=model` rows as `model → (requests, prompt, completion, refused)`.
async fn usage_by_model(cred: &str) -> std::collections::BTreeMap<String, (u64, u64, u64, Value)> {
    let r = get(cred, "/v1/usage?groupBy=model").await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|row| {
            (
                row["model"].as_str().unwrap_or_default().to_string(),
                (
                    row["requests"].as_u64().unwrap_or(0),
                    row["promptTokens"].as_u64().unwrap_or(0),
                    row["completionTokens"].as_u64().unwrap_or(0),
                    row["refused"].clone(),
                ),
            )
        })
        .collect()
}

/// Waits until `GET /v1/usage?groupBy=model` for `cred` equals `want`; the time it took.
async fn ledger_shows(
    cred: &str,
    want: &std::collections::BTreeMap<String, (u64, u64, u64, Value)>,
) -> Duration {
    let start = Instant::now();
    loop {
        let last = usage_by_model(cred).await;
        if &last == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < LEDGER_DEADLINE,
            "the ledger never showed {want:?} for {cred}; last {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn usage_of(r: &Reply) -> (u64, u64) {
    let u = &r.json()["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap_or(0),
        u["completion_tokens"].as_u64().unwrap_or(0),
    )
}

#[tokio::test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn calls_through_the_gateway_show_in_the_ledger_by_model_with_refusals_and_per_key() {
    let s = stack();
    let minted1 = s
        .mint_key("led-token", json!({"name": "ledger-k1"}))
        .await
        .unwrap();
    let minted2 = s
        .mint_key("led-token", json!({"name": "ledger-k2"}))
        .await
        .unwrap();
    let key_of = |m: &Value| m["key"].as_str().unwrap().to_string();
    let (k1, k2) = (key_of(&minted1), key_of(&minted2));

    // k1: a JSON chat, a streamed chat (its usage event is added and stripped by the gateway:
    // the simulator's deterministic rule gives its numbers), an embeddings call, and a
    // reservation larger than the day's token limit (400 tokens_exceed_limit).
    let json_body = json!({"model": "sim-model", "max_tokens": 5,
                           "messages": [{"role": "user", "content": "one two three"}]});
    let r = call(&k1, CHAT, json_body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (p1, c1) = usage_of(&r);
    assert!(p1 > 0 && c1 == 5, "{}", r.body);
    let stream_body = json!({"model": "sim-model", "max_tokens": 4, "stream": true,
                             "messages": [{"role": "user", "content": "four five"}]});
    let r = call(&k1, CHAT, stream_body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!r.body.contains("\"usage\":{"), "stripped: {}", r.body);
    let (p2, c2) = (maas_e2e::sim::prompt_tokens(&stream_body), 4);
    let embed_body = json!({"model": "sim-embed", "input": ["a b", "c d e"]});
    let r = call(&k1, EMBEDDINGS, embed_body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (p3, c3) = usage_of(&r);
    assert!(p3 > 0, "{}", r.body);
    let r = call(
        &k1,
        CHAT,
        json!({"model": "sim-model", "max_tokens": 200_000,
               "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.error(400)["code"], "tokens_exceed_limit");
    // k2: one JSON chat.
    let r = call(&k2, CHAT, json_body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (p4, c4) = usage_of(&r);
    // tiny (one request a day): the second call is refused 429.
    let r = call("tiny-token", CHAT, json_body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (p5, c5) = usage_of(&r);
    let r = call("tiny-token", CHAT, json_body.clone()).await;
    assert_eq!(r.error(429)["code"], "rate_limit_exceeded");
    // Not authenticated: no subject, nothing in anyone's ledger.
    let r = call("no-such-token", CHAT, json_body).await;
    assert_eq!(r.status, 401);
    let last_call = Instant::now();

    // The user (a token): every key's usage, by model.
    let all = [
        (
            "sim-model".to_string(),
            (
                3,
                p1 + p2 + p4,
                c1 + c2 + c4,
                json!({"tokens_exceed_limit": 1}),
            ),
        ),
        ("sim-embed".to_string(), (1, p3, c3, json!({}))),
    ]
    .into();
    ledger_shows("led-token", &all).await;
    eprintln!(
        "usage-ledger figure: the ledger showed the calls {} ms after the last one (report interval {REPORT_INTERVAL_MS} ms)",
        last_call.elapsed().as_millis()
    );
    // An API key sees its own key's usage only.
    let only_k1 = [
        (
            "sim-model".to_string(),
            (2, p1 + p2, c1 + c2, json!({"tokens_exceed_limit": 1})),
        ),
        ("sim-embed".to_string(), (1, p3, c3, json!({}))),
    ]
    .into();
    assert_eq!(usage_by_model(&k1).await, only_k1);
    let only_k2 = [("sim-model".to_string(), (1, p4, c4, json!({})))].into();
    assert_eq!(usage_by_model(&k2).await, only_k2);
    // By key: both keys, named, each by the key API's id (the one minting answered), which
    // finds the key.
    let r = get("led-token", "/v1/usage?groupBy=key").await;
    let mut by_key: Vec<(String, String, u64)> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["keyName"].as_str().unwrap_or("-").to_string(),
                row["keyId"].as_str().unwrap_or("-").to_string(),
                row["requests"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    by_key.sort();
    let id_of = |m: &Value| m["id"].as_str().unwrap().to_string();
    assert_eq!(
        by_key,
        [
            ("ledger-k1".to_string(), id_of(&minted1), 3),
            ("ledger-k2".to_string(), id_of(&minted2), 1)
        ],
        "{}",
        r.body
    );
    for (name, id, _) in &by_key {
        let found = get("led-token", &format!("/v1/api-keys/{id}")).await;
        assert_eq!(found.status, 200, "{}", found.body);
        assert_eq!(found.json()["name"], json!(name), "{}", found.body);
    }
    // The refused caller: one forwarded, one refused by rate limit.
    let tiny = [(
        "sim-model".to_string(),
        (1, p5, c5, json!({"rate_limit_exceeded": 1})),
    )]
    .into();
    ledger_shows("tiny-token", &tiny).await;
    // Nothing is counted twice by later reports (no resend after a 200).
    tokio::time::sleep(Duration::from_millis(3 * REPORT_INTERVAL_MS)).await;
    assert_eq!(usage_by_model("led-token").await, all);
}

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", r.headers))
        .parse()
        .unwrap()
}

/// Tolerance: `used` is the lease counter the gateways enforce against. While a gateway holds
/// budget leased ahead (prefetch, released after `limits.global.idleReleaseMs` + a report
/// interval: ≈ 4 s by default) `used` is above the headers' figure by that lease; once released,
/// requests match exactly. Tokens: the headers of a response carry its reservation (they are
/// decided at admission), the quota its settled usage: once settled, `used` = the usage the
/// simulator reported, i.e. the headers' figure minus (reservation − usage) of the last call.
#[tokio::test]
async fn quota_used_matches_what_the_rate_limit_headers_implied() {
    let body = json!({"model": "sim-model", "max_tokens": 7,
                      "messages": [{"role": "user", "content": "alpha beta gamma"}]});
    let mut usage = 0;
    let mut last = None;
    for _ in 0..3 {
        let r = call("quota-token", CHAT, body.clone()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let (p, c) = usage_of(&r);
        usage += p + c;
        last = Some(r);
    }
    let last = last.unwrap();
    let requests_implied = header_u64(&last, "x-ratelimit-limit-requests")
        - header_u64(&last, "x-ratelimit-remaining-requests");
    let tokens_implied = header_u64(&last, "x-ratelimit-limit-tokens")
        - header_u64(&last, "x-ratelimit-remaining-tokens");
    assert_eq!(requests_implied, 3);
    // The last call's reservation (prompt estimate + max_tokens) less its usage, at most.
    let prompt_bytes = "alpha beta gamma".len() as u64;
    assert!(
        tokens_implied >= usage && tokens_implied - usage <= prompt_bytes + 7,
        "headers implied {tokens_implied}, usage {usage}"
    );
    let started = Instant::now();
    let seen = loop {
        let r = get("quota-token", "/v1/quota").await;
        let seen = if r.status == 200 {
            r.json()
        } else {
            Value::Null
        };
        let used = |kind: &str| {
            seen["data"]
                .as_array()
                .and_then(|rows| rows.iter().find(|row| row["kind"] == kind))
                .and_then(|row| row["used"].as_u64())
        };
        if used("requests") == Some(requests_implied) && used("tokens") == Some(usage) {
            break seen;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "quota never matched requests {requests_implied} / tokens {usage}: {} {}",
            r.status,
            r.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let rows = seen["data"].as_array().unwrap();
    for row in rows {
        assert_eq!(
            row["remaining"].as_u64().unwrap(),
            row["limit"].as_u64().unwrap() - row["used"].as_u64().unwrap()
        );
    }
    eprintln!(
        "usage-ledger figure: /v1/quota matched the headers {} ms after the last call (requests {requests_implied}; tokens {usage} settled, the headers implied {tokens_implied}: the last call's reservation)",
        started.elapsed().as_millis()
    );
}

/// A shadow limit (1 request a day, beside the enforced 100) refuses nothing: every call is
/// answered, the headers show the enforced limit, and each would-be refusal is counted in the
/// filter's metric and in the ledger as `shadow_rate_limit_exceeded`.
#[tokio::test]
async fn a_shadow_limit_counts_what_it_would_refuse_and_refuses_nothing() {
    let s = stack();
    let before = crate::helpers::metric(s, "maas_shadow_refusals_total").await;
    let body = json!({"model": "sim-model", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "try me"}]});
    for n in 0..3u64 {
        let r = call("trial-token", CHAT, body.clone()).await;
        assert_eq!(r.status, 200, "call {n}: {}", r.body);
        assert_eq!(r.header("x-ratelimit-limit-requests"), Some("100"));
        assert_eq!(
            r.header("x-ratelimit-remaining-requests"),
            Some((99 - n).to_string().as_str())
        );
    }
    let after = crate::helpers::metric(s, "maas_shadow_refusals_total").await;
    assert_eq!(after - before, 2, "the second and third calls");
    let start = Instant::now();
    loop {
        let rows = usage_by_model("trial-token").await;
        if let Some((requests, _, _, refused)) = rows.get("sim-model")
            && *requests == 3
            && refused == &json!({"shadow_rate_limit_exceeded": 2})
        {
            break;
        }
        assert!(
            start.elapsed() < LEDGER_DEADLINE,
            "the ledger never showed the shadow refusals: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
