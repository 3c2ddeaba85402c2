//! Filter e2e (issues 4 and 10): per-subject request and token limits through real Envoy with
//! the release .wasm — streamed budgets, reserve-then-settle, concurrency, discovery, one budget
//! per person across keys pinned to different tiers, reservations that can never fit.
//!
//! Windows are a day (or a year) long so that no test straddles a window boundary.

use crate::helpers::*;
use futures_util::StreamExt;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: req
    level: 1
    groups: [g-req]
    limits:
      requests: [{limit: 3, window: 1d}, {limit: 100, window: 366d}]
  - name: stream
    level: 2
    groups: [g-stream]
    limits:
      tokens: [{limit: 100, window: 1d}]
    defaultMaxTokens: 10
  - name: conc
    level: 3
    groups: [g-conc]
    limits:
      tokens: [{limit: 100, window: 1d}]
  - name: settle
    level: 4
    groups: [g-settle]
    limits:
      requests: [{limit: 1000, window: 1d}]
      tokens: [{limit: 1000, window: 1d}, {limit: 5000, window: 366d}]
    defaultMaxTokens: 500
  - name: abort
    level: 5
    groups: [g-abort]
    limits:
      tokens: [{limit: 1000, window: 1d}]
  - name: lo
    level: 6
    groups: [g-lo]
    limits:
      tokens: [{limit: 100, window: 1d}]
  - name: hi
    level: 7
    groups: [g-hi]
    limits:
      tokens: [{limit: 200, window: 1d}]
  - name: busy
    level: 8
    groups: [g-busy]
    limits:
      requests: [{limit: 100000, window: 1d}]
      tokens: [{limit: 100000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [req, stream, conc, settle, abort, lo, hi, busy]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: rita-token, username: rita, groups: [g-req]}
  - {token: olga-token, username: olga, groups: [g-req]}
  - {token: sam-token, username: sam, groups: [g-stream]}
  - {token: cora-token, username: cora, groups: [g-conc]}
  - {token: stan-token, username: stan, groups: [g-settle]}
  - {token: abe-token, username: abe, groups: [g-abort]}
  - {token: mia-token, username: mia, groups: [g-lo, g-hi]}
  - {token: bea-token, username: bea, groups: [g-busy]}
  - {token: pia-token, username: pia, groups: [g-settle]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", r.headers))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn request_limit_gives_429_with_headers() {
    let stack = stack();
    let h = [("authorization", "Bearer rita-token")];
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
    for expected_remaining in [2, 1, 0] {
        let r = chat(stack, CHAT, "req-ok", &h, body.clone()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 3);
        assert_eq!(
            header_u64(&r, "x-ratelimit-remaining-requests"),
            expected_remaining
        );
        assert!(r.header("x-ratelimit-reset-requests").is_some());
        // The early warning (default thresholds 80 and 95): only the answer that takes the
        // last request (100 % of the day's 3) carries it, naming that window.
        let warning = r.header("x-maas-quota-warning");
        if expected_remaining == 0 {
            let w = warning.expect("a warning at 100 %");
            assert!(
                w.starts_with("threshold=95, used=100, kind=requests, window=1d, reset="),
                "{w}"
            );
        } else {
            assert_eq!(warning, None, "{expected_remaining} left");
        }
    }
    let r = chat(stack, CHAT, "req-429", &h, body.clone()).await;
    let e = r.error(429);
    assert_eq!(e["type"], "rate_limit_exceeded");
    assert!(e["code"].is_string());
    let retry = header_u64(&r, "retry-after");
    assert!((1..=86_400).contains(&retry), "retry-after {retry}");
    assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 3);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 0);
    assert!(stack.sim_requests_with_test_id("req-429").is_empty());
    assert!(
        r.header("x-maas-quota-warning").is_some(),
        "{:?}",
        r.headers
    );
    // Discovery still works, uncounted.
    let r = send(
        client()
            .get(format!("{}/llm/sim-model/v1/models", stack.gateway_url()))
            .bearer_auth("rita-token"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Another subject is not affected by rita's count.
    let r = chat(
        stack,
        CHAT,
        "req-other",
        &[("authorization", "Bearer olga-token")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 2);
}

/// A provider's own `x-ratelimit-*` (its limits for the gateway's account, once or repeated)
/// never reach the client: each header is the gateway's, once, on JSON and stream answers.
#[tokio::test]
async fn the_providers_own_rate_limit_headers_are_replaced_by_the_gateways() {
    let stack = stack();
    let h = [
        ("authorization", "Bearer pia-token"),
        ("x-sim-ratelimit-headers", "1"),
    ];
    for (n, stream) in [(0, false), (1, true)] {
        let body = json!({
            "model": "sim-model",
            "stream": stream,
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
        });
        let r = chat(stack, CHAT, &format!("provider-limits-{n}"), &h, body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        for name in [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ] {
            let values: Vec<&str> = r
                .headers
                .get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            assert_eq!(values.len(), 1, "stream {stream}: {name}: {values:?}");
            assert!(
                !values.iter().any(|v| v.starts_with("provider")),
                "stream {stream}: {name}: {values:?}"
            );
        }
        // A name the gateway never sends is the provider's alone: removed.
        assert_eq!(
            r.header("x-ratelimit-limit-images"),
            None,
            "stream {stream}"
        );
        // Below every threshold the gateway warns of nothing: the upstream's warning is gone.
        assert_eq!(r.header("x-maas-quota-warning"), None, "stream {stream}");
        // The provider's IETF pair too (the policy chose OpenAI's headers).
        assert_eq!(r.header("ratelimit"), None, "stream {stream}");
        assert_eq!(r.header("ratelimit-policy"), None, "stream {stream}");
        assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 1000);
        assert_eq!(header_u64(&r, "x-ratelimit-limit-tokens"), 1000);
        assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 999 - n);
    }
}

/// `data:` payloads of an SSE body.
fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

#[tokio::test]
async fn streamed_responses_exhaust_the_token_budget() {
    let stack = stack();
    let h = [("authorization", "Bearer sam-token")];
    // prompt 2 words + 20 completion tokens = 22 per request; reserved at admission: 20 + the
    // prompt estimate ("role" "user" "content" "hello there" = 26 bytes of text → 7 tokens) = 27.
    let plain = json!({"model": "sim-model", "stream": true, "max_tokens": 20,
                       "messages": [{"role": "user", "content": "hello there"}]});
    let r = chat(stack, CHAT, "stream-1", &h, plain.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("text/event-stream")
    );
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 73);
    assert!(!r.body.contains("x-maas-quota-warning"), "{}", r.body);
    let events = sse_events(&r.body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(
            v.get("usage").is_none_or(Value::is_null),
            "the client did not ask for usage: {e}"
        );
        assert!(
            !v["choices"].as_array().unwrap().is_empty(),
            "usage-only chunk leaked: {e}"
        );
    }
    // The model was asked for usage on the client's behalf.
    let sent = &stack.sim_requests_with_test_id("stream-1")[0];
    let sent: Value = serde_json::from_str(&sent.body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);

    // A client that asks for usage gets it.
    let mut asked = plain.clone();
    asked["stream_options"] = json!({"include_usage": true});
    let r = chat(stack, CHAT, "stream-2", &h, asked).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let usage: Vec<Value> = sse_events(&r.body)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|v| v["usage"].is_object())
        .collect();
    assert_eq!(usage.len(), 1, "{}", r.body);
    assert_eq!(usage[0]["usage"]["total_tokens"], 22);
    // 44 used: the reservation for this one shows 100 - 22 - 27.
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 51);

    for id in ["stream-3", "stream-4"] {
        let r = chat(stack, CHAT, id, &h, plain.clone()).await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        // stream-4 leaves the day's window at 93 %: the warning is in the headers and, for a
        // streaming client, a comment before the first event (SSE clients skip it).
        if id == "stream-4" {
            let w = r.header("x-maas-quota-warning").expect("a warning");
            assert!(w.starts_with("threshold=80, used=93, kind=tokens"), "{w}");
            assert!(
                r.body
                    .starts_with(&format!(": x-maas-quota-warning {w}\n\n")),
                "{}",
                r.body
            );
            assert_eq!(
                sse_events(&r.body).last().map(String::as_str),
                Some("[DONE]")
            );
        } else {
            assert_eq!(r.header("x-maas-quota-warning"), None);
            assert!(r.body.starts_with("data:"), "{}", r.body);
        }
    }
    // 88 used; 88 + 27 does not fit in 100.
    let r = chat(stack, CHAT, "stream-5", &h, plain.clone()).await;
    let e = r.error(429);
    assert!(e["message"].as_str().unwrap().contains("tokens"), "{e}");
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 12);
    assert_eq!(header_u64(&r, "x-ratelimit-limit-tokens"), 100);
    assert!(r.header("x-ratelimit-reset-tokens").is_some());
    assert!(header_u64(&r, "retry-after") >= 1);
    assert!(stack.sim_requests_with_test_id("stream-5").is_empty());
    // Model discovery is never token-limited.
    let r = send(
        client()
            .get(format!("{}/llm/sim-model/v1/models", stack.gateway_url()))
            .bearer_auth("sam-token"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // A request small enough to fit still passes (reservation 11 = tier default 10 + the prompt
    // "x" ≤ 12 left).
    let small = json!({"model": "sim-model", "prompt": "x"});
    let r = chat(
        stack,
        "/llm/sim-model/v1/completions",
        "stream-6",
        &[
            ("authorization", "Bearer sam-token"),
            ("x-sim-completion-tokens", "1"),
        ],
        small,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn concurrent_requests_overshoot_by_at_most_one_reservation() {
    stack(); // started before the burst
    let mut tasks = Vec::new();
    for i in 0..12 {
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": "sim-model", "max_tokens": 30,
                              "messages": [{"role": "user", "content": "one two"}]});
            chat(
                self::stack(),
                CHAT,
                &format!("conc-{i}"),
                &[
                    ("authorization", "Bearer cora-token"),
                    ("x-sim-chunk-delay-ms", "20"),
                ],
                body,
            )
            .await
        }));
    }
    let mut used = 0;
    let (mut ok, mut limited) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 => {
                ok += 1;
                used += r.json()["usage"]["total_tokens"].as_u64().unwrap();
            }
            429 => limited += 1,
            s => panic!("unexpected {s}: {}", r.body),
        }
    }
    assert!(ok >= 1 && limited >= 1, "ok {ok}, limited {limited}");
    assert!(
        used <= 100 + 30,
        "{used} tokens used on a budget of 100 (reservation 30)"
    );
}

#[tokio::test]
async fn reservation_is_settled_to_real_usage() {
    let stack = stack();
    let h = [
        ("authorization", "Bearer stan-token"),
        ("x-sim-completion-tokens", "5"),
    ];
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "a b"}]});
    // No max_tokens: the tier default (500) is reserved...
    let r1 = chat(stack, CHAT, "settle-1", &h, body.clone()).await;
    assert_eq!(r1.status, 200, "{}", r1.body);
    let before = header_u64(&r1, "x-ratelimit-remaining-tokens");
    assert_eq!(r1.json()["usage"]["total_tokens"], 7);
    // ... and settled to the 7 used: the next reservation sees 500 - 7 more room.
    let r2 = chat(stack, CHAT, "settle-2", &h, body.clone()).await;
    assert_eq!(r2.status, 200, "{}", r2.body);
    assert_eq!(
        header_u64(&r2, "x-ratelimit-remaining-tokens"),
        before + 500 - 7 - 500
    );
    // Discovery takes nothing.
    for _ in 0..3 {
        let r = send(
            client()
                .get(format!("{}/llm/sim-model/v1/models", stack.gateway_url()))
                .bearer_auth("stan-token"),
        )
        .await;
        assert_eq!(r.status, 200);
        assert!(r.header("x-ratelimit-remaining-tokens").is_none());
    }
    let r3 = chat(stack, CHAT, "settle-3", &h, body).await;
    assert_eq!(
        header_u64(&r3, "x-ratelimit-remaining-tokens"),
        before - 7 - 7
    );
}

#[tokio::test]
async fn upstream_error_and_client_abort_settle_from_what_was_seen() {
    let stack = stack();
    let auth = [("authorization", "Bearer abe-token")];
    let probe = || async {
        let body = json!({"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "p"}]});
        let r = chat(
            self::stack(),
            CHAT,
            "abort-probe",
            &[
                ("authorization", "Bearer abe-token"),
                ("x-sim-completion-tokens", "1"),
            ],
            body,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        // What the probe saw before its own reservation of 1; its own use (2) is settled after.
        header_u64(&r, "x-ratelimit-remaining-tokens") + 1
    };
    let start = probe().await;
    // An upstream 500 uses nothing: the 100 reserved come back.
    let body = json!({"model": "sim-model", "max_tokens": 100, "messages": [{"role": "user", "content": "x"}]});
    let r = chat(
        stack,
        CHAT,
        "abort-500",
        &[auth[0], ("x-sim-fault", "status-500")],
        body,
    )
    .await;
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(probe().await, start - 2);

    // A stream the client drops after a few events: settled from what streamed, not left at
    // the 200 reserved.
    let body = json!({"model": "sim-model", "stream": true, "max_tokens": 200,
                      "messages": [{"role": "user", "content": "tell me a story"}]});
    let resp = client()
        .post(format!("{}{CHAT}", stack.gateway_url()))
        .header("authorization", "Bearer abe-token")
        .header("x-sim-chunk-delay-ms", "30")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut got = 0;
    while let Some(chunk) = stream.next().await {
        got += chunk.unwrap().len();
        if got > 300 {
            break;
        }
    }
    drop(stream);
    let before_abort = start - 4;
    let settled = eventually(Duration::from_secs(10), || async {
        let now = probe().await;
        // the probes themselves took 2 each
        let used = before_abort.saturating_sub(now);
        used > 0 && used < 200
    })
    .await;
    assert!(
        settled.is_some(),
        "the aborted stream was not settled from what it streamed"
    );
}

#[tokio::test]
async fn keys_pinned_to_two_tiers_share_the_higher_tiers_budget() {
    // mia qualifies for lo (100 tokens a day) and hi (200 a day) and holds a key pinned to each.
    // Per tier she could spend 100 + 200; per person she may spend at most hi's 200.
    let stack = stack();
    let mut keys = Vec::new();
    for tier in ["lo", "hi"] {
        let minted = stack
            .mint_key(
                "mia-token",
                json!({"name": format!("mia-{tier}"), "tier": tier}),
            )
            .await
            .unwrap();
        assert_eq!(minted["tier"], tier, "{minted}");
        keys.push(bearer(minted["key"].as_str().unwrap()));
    }
    let (lo, hi) = (&keys[0], &keys[1]);

    // A reservation above the pinned tier's whole window can never fit: 400, nothing counted,
    // even though the subject's higher tier would allow it.
    let big = json!({"model": "sim-model", "max_tokens": 150,
                     "messages": [{"role": "user", "content": "x"}]});
    let r = chat(stack, CHAT, "pin-too-large", &[("authorization", lo)], big).await;
    let e = r.error(400);
    assert_eq!(e["type"], "invalid_request_error", "{e}");
    assert_eq!(e["code"], "tokens_exceed_limit", "{e}");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("tier lo allows 100 per 1d"), "{msg}");
    assert!(stack.sim_requests_with_test_id("pin-too-large").is_empty());

    // Spend on both keys in turn (10 completion tokens each) until both are refused.
    let body = json!({"model": "sim-model", "max_tokens": 10,
                      "messages": [{"role": "user", "content": "x"}]});
    let (mut spent_lo, mut spent_hi) = (0, 0);
    let (mut lo_open, mut hi_open) = (true, true);
    for i in 0..60 {
        if !lo_open && !hi_open {
            break;
        }
        let on_lo = (i % 2 == 0 && lo_open) || !hi_open;
        let auth = if on_lo { lo } else { hi };
        let r = chat(
            stack,
            CHAT,
            &format!("pin-{i}"),
            &[("authorization", auth), ("x-sim-completion-tokens", "10")],
            body.clone(),
        )
        .await;
        match r.status {
            200 => {
                let used = r.json()["usage"]["total_tokens"].as_u64().unwrap();
                if on_lo {
                    spent_lo += used;
                } else {
                    spent_hi += used;
                }
            }
            429 => {
                assert_eq!(r.error(429)["type"], "rate_limit_exceeded");
                if on_lo {
                    lo_open = false;
                } else {
                    hi_open = false;
                }
            }
            s => panic!("unexpected {s}: {}", r.body),
        }
    }
    assert!(!lo_open && !hi_open, "both keys should be exhausted");
    // The pinned lower tier only restricts: the lo key alone stays within lo's 100.
    assert!(spent_lo <= 100, "lo key spent {spent_lo}");
    // Together: never more than the higher tier's 200 (per tier it would have been 300) ...
    assert!(
        spent_lo + spent_hi <= 200,
        "spent {spent_lo} on lo + {spent_hi} on hi: more than the 200 of mia's highest tier"
    );
    // ... and the higher tier's budget was usable.
    assert!(
        spent_lo + spent_hi > 150,
        "spent only {spent_lo} + {spent_hi}"
    );
}

/// A subject the worker admits often has its refunds folded into its next counter write
/// (`filter/src/folds.rs`): on its own connection (one worker) every answer still counts every
/// earlier request's real usage exactly; a fresh connection (either worker) sees exactly the
/// same once a tick (200 ms) has passed.
#[tokio::test]
async fn a_busy_subjects_folded_refunds_are_exact_for_its_worker_and_everywhere_a_tick_later() {
    let stack = stack();
    let body = json!({"model": "sim-model", "max_tokens": 100,
                      "messages": [{"role": "user", "content": "a b"}]});
    // One pooled connection: one worker.
    let one = client();
    let mut last: Option<u64> = None;
    for i in 0..30 {
        let r = send(
            one.post(format!("{}{CHAT}", stack.gateway_url()))
                .header("authorization", "Bearer bea-token")
                .header("x-sim-completion-tokens", "5")
                .header("x-test-id", format!("busy-{i}"))
                .json(&body),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["usage"]["total_tokens"], 7);
        let remaining = header_u64(&r, "x-ratelimit-remaining-tokens");
        if let Some(before) = last {
            // The same reservation each time: what changed is the last request's 7 tokens.
            assert_eq!(before - remaining, 7, "request {i}");
        }
        last = Some(remaining);
    }
    let last = last.unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    for i in 0..6 {
        // A new connection each (either worker).
        let r = chat(
            stack,
            CHAT,
            &format!("busy-probe-{i}"),
            &[
                ("authorization", "Bearer bea-token"),
                ("x-sim-completion-tokens", "5"),
            ],
            body.clone(),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            header_u64(&r, "x-ratelimit-remaining-tokens"),
            last - 7 - 7 * i,
            "probe {i}: every earlier request counted at its real usage"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
