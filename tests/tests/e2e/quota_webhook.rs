//! The quota-warning webhook end to end (issue 30): two gateway replicas (each an Envoy with
//! the release filter and its own companion, one Redis, one PostgreSQL), the companions given
//! `MAAS_QUOTA_WEBHOOK_URL` (a receiver in this test, on port 0) and a secret file. A user whose
//! calls, alternating between the replicas, cross 80 % of a small daily token limit makes the
//! receiver get ONE signed event for threshold 80 — not one per companion, and not again on
//! the next calls in the same window. A second user crossing their own threshold afterwards is
//! the sentinel: once their event arrived, every lease batch of the first user's calls before
//! it has been looked at.

use crate::helpers::{Reply, client, send};
use axum::extract::State;
use axum::http::HeaderMap;
use hmac::{Hmac, Mac};
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use sha2::Sha256;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: warned
    level: 1
    groups: [g-warned]
    warnAt: [80]
    limits:
      tokens: [{limit: 1000, window: 1d}]
  - name: sentry
    level: 2
    groups: [g-sentry]
    warnAt: [80]
    limits:
      tokens: [{limit: 1001, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [warned, sentry]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: warn-token, username: warner, groups: [g-warned]}
  - {token: sentry-token, username: sentry-user, groups: [g-sentry]}
"#;

const SECRET: &str = "e2e-quota-webhook-secret-0123456789abcdef";
const CHAT: &str = "/llm/sim-model/v1/chat/completions";

/// One POST the receiver got: (id header, timestamp header, signature header, body).
type Got = (String, String, String, String);
type Log = Arc<Mutex<Vec<Got>>>;

fn header(h: &HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// A receiver on port 0 answering 200 to everything: its URL and what it got.
async fn receiver() -> (String, Log) {
    async fn hook(State(log): State<Log>, h: HeaderMap, body: String) -> &'static str {
        log.lock().unwrap().push((
            header(&h, "x-maas-webhook-id"),
            header(&h, "x-maas-webhook-timestamp"),
            header(&h, "x-maas-webhook-signature"),
            body,
        ));
        "ok"
    }
    let log: Log = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/maas/quota", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/maas/quota", axum::routing::post(hook))
        .with_state(log.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, log)
}

/// A receiver's check: `v1=` HMAC-SHA256(secret, "<timestamp>.<body>") and a fresh timestamp.
fn verifies(got: &Got, secret: &str) -> bool {
    let now = unix_now();
    let fresh = got.1.parse::<u64>().is_ok_and(|t| now.abs_diff(t) <= 300);
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{}.{}", got.1, got.3).as_bytes());
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    fresh && got.2 == format!("v1={hex}")
}

fn events_for(log: &Log, tier: &str) -> Vec<(Got, Value)> {
    log.lock()
        .unwrap()
        .iter()
        .map(|g| (g.clone(), serde_json::from_str::<Value>(&g.3).unwrap()))
        .filter(|(_, v)| v["scope"] == json!({"tier": tier}))
        .collect()
}

async fn start(url: &str, secret_file: &std::path::Path) -> Stack {
    let env = vec![
        ("MAAS_QUOTA_WEBHOOK_URL".to_string(), url.to_string()),
        (
            "MAAS_QUOTA_WEBHOOK_SECRET_FILE".to_string(),
            secret_file.display().to_string(),
        ),
        ("MAAS_QUOTA_WEBHOOK_TIMEOUT_MS".to_string(), "2000".into()),
    ];
    tokio::task::spawn_blocking(move || {
        let mut options = StackOptions::default()
            .with_policy_yaml(POLICY)
            .with_identities_yaml(IDENTITIES)
            .with_credentials_yaml("credentials: {}\n")
            .with_replicas(2);
        options.companion_env = env;
        Stack::start(options)
    })
    .await
    .expect("stack start did not panic")
    .unwrap_or_else(|e| panic!("stack did not start: {e:#}"))
}

/// A chat of 100 completion tokens through replica `replica`: its status and total tokens.
async fn chat(stack: &Stack, replica: usize, token: &str) -> (u16, u64) {
    let r: Reply = send(
        client()
            .post(format!("{}{CHAT}", stack.gateway_url_of(replica)))
            .bearer_auth(token)
            .json(&json!({"model": "sim-model", "max_tokens": 100,
                          "messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    let total = if r.status == 200 {
        r.json()["usage"]["total_tokens"].as_u64().unwrap_or(0)
    } else {
        0
    };
    (r.status, total)
}

/// Calls alternating between the replicas until `token`'s real usage reaches `tokens`.
async fn use_up(stack: &Stack, token: &str, tokens: u64) -> u64 {
    let mut used = 0;
    let mut i = 0;
    while used < tokens {
        let (status, total) = chat(stack, i % 2, token).await;
        assert_eq!(status, 200, "call {i} of {token} refused at {used} tokens");
        used += total;
        i += 1;
    }
    used
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_80_percent_through_two_replicas_sends_one_signed_event() {
    // Not across midnight UTC: the daily window must hold the whole test.
    let into_day = unix_now() % 86_400;
    if into_day > 86_400 - 180 {
        tokio::time::sleep(Duration::from_secs(86_400 - into_day + 5)).await;
    }
    let (url, log) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("webhook-secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    let stack = start(&url, &secret_file).await;

    let used = use_up(&stack, "warn-token", 800).await;
    until("the 80 % event", || !events_for(&log, "warned").is_empty()).await;
    // The next calls of the window (admitted or refused): nothing new.
    for replica in [0, 1, 0, 1] {
        let (status, _) = chat(&stack, replica, "warn-token").await;
        assert!(status == 200 || status == 429, "{status}");
    }
    use_up(&stack, "sentry-token", 801).await;
    until("the sentinel's event", || {
        !events_for(&log, "sentry").is_empty()
    })
    .await;

    let events = events_for(&log, "warned");
    assert_eq!(events.len(), 1, "{events:?}");
    let (got, event) = &events[0];
    eprintln!("quota-webhook figure: the 80 % event after {used} tokens used: {event}");
    assert_eq!(event["type"], "quota.warning");
    assert_eq!(event["id"], got.0.as_str(), "the id header names the event");
    assert_eq!(event["threshold"], 80);
    assert_eq!(event["kind"], "tokens");
    assert_eq!(event["window"], "1d");
    assert_eq!(event["limit"], 1000);
    assert_eq!(event["shadow"], false);
    assert!(event["used"].as_u64().unwrap() >= 800, "{event}");
    assert!(event["percentUsed"].as_u64().unwrap() >= 80, "{event}");
    let subject = event["subject"].as_str().unwrap();
    assert!(
        subject.starts_with("u-") && !got.3.contains("warner"),
        "{event}"
    );
    assert!(verifies(got, SECRET), "{got:?}");
    assert!(!verifies(got, "another-secret-0123456789abcdef0123456789"));
    tokio::task::spawn_blocking(move || stack.shutdown())
        .await
        .unwrap();
}
