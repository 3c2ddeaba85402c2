//! The quota-warning webhook (issue 30): lease batches whose global count crosses a tier's
//! `warnAt` thresholds make the companion POST one signed event per window per threshold to a
//! receiver — here a local HTTP server on port 0 that records what it gets and answers as
//! scripted. The companion in-process over a fresh PostgreSQL database
//! (`MAAS_TEST_DATABASE_URL`), its lease counters in process.
//!
//! alice's counter is checked against tier `free`'s daily tokens (config/local/policy.yaml:
//! 100000 a day, warnAt 80 and 95); fresh subjects against `premium`'s 50000 tokens a minute
//! are the sentinels that show the recorder has worked through everything offered before them.

use crate::helpers::{TestApp, create_database, spawn_app_on};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use hmac::{Hmac, Mac};
use maas_companion::settings::QuotaWebhookSettings;
use maas_types::lease::LEASES_PATH;
use secrecy::{SecretSlice, SecretString};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"whsec-0123456789abcdef0123456789abcdef";
const DAY: u64 = 86_400;
const ALICE_DAILY: u64 = 100_000;
const BOB_MINUTE: u64 = 50_000;

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Got {
    id: String,
    timestamp: String,
    signature: String,
    content_type: String,
    body: String,
}

impl Got {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

type Log = Arc<Mutex<Vec<Got>>>;

struct Receiver {
    url: String,
    got: Log,
    _server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }
}

fn header(h: &HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// One scripted answer: its status, how long it is held back, its `Retry-After`.
#[derive(Debug, Clone, Copy)]
struct Step {
    status: u16,
    delay: Duration,
    retry_after: Option<&'static str>,
}

fn statuses(list: &[u16]) -> Vec<Step> {
    list.iter()
        .map(|&status| Step {
            status,
            delay: Duration::ZERO,
            retry_after: None,
        })
        .collect()
}

/// A receiver answering the statuses of `script` in turn, then 200.
async fn receiver(script: &[u16]) -> Receiver {
    receiver_with(statuses(script)).await
}

/// A receiver answering the steps of `script` in turn, then 200 at once.
async fn receiver_with(script: Vec<Step>) -> Receiver {
    type Shared = (Log, Arc<Mutex<VecDeque<Step>>>);
    async fn hook(
        State((log, script)): State<Shared>,
        h: HeaderMap,
        body: String,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        log.lock().unwrap().push(Got {
            id: header(&h, "x-maas-webhook-id"),
            timestamp: header(&h, "x-maas-webhook-timestamp"),
            signature: header(&h, "x-maas-webhook-signature"),
            content_type: header(&h, "content-type"),
            body,
        });
        let step = script.lock().unwrap().pop_front();
        let step = step.unwrap_or(Step {
            status: 200,
            delay: Duration::ZERO,
            retry_after: None,
        });
        tokio::time::sleep(step.delay).await;
        let status = StatusCode::from_u16(step.status).unwrap();
        match step.retry_after {
            Some(v) => (status, [("retry-after", v)]).into_response(),
            None => status.into_response(),
        }
    }
    let got: Log = Arc::default();
    let shared: Shared = (got.clone(), Arc::new(Mutex::new(script.into())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks/maas", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/hooks/maas", axum::routing::post(hook))
        .with_state(shared);
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Receiver {
        url,
        got,
        _server: server,
    }
}

/// A URL nobody listens on (connections refused).
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}/hooks/maas", l.local_addr().unwrap())
}

/// Test settings: short timeout, fast retries, a quick poll.
fn webhook(url: &str) -> QuotaWebhookSettings {
    QuotaWebhookSettings {
        url: SecretString::from(url.to_string()),
        endpoint: "http://127.0.0.1".into(),
        secret: Arc::new(SecretSlice::from(SECRET.to_vec())),
        timeout: Duration::from_secs(2),
        max_attempts: 8,
        max_pending: 10_000,
        retry_base: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        poll_interval: Duration::from_millis(50),
    }
}

async fn spawn(database_url: &str, settings: QuotaWebhookSettings) -> TestApp {
    spawn_app_on(database_url.to_string(), move |s| {
        s.quota_webhook = Some(settings);
    })
    .await
}

fn now() -> u64 {
    u64::try_from(chrono::Utc::now().timestamp()).unwrap()
}

/// One lease batch of one token item, answered 200: the counter's taken after it.
async fn lease(app: &TestApp, subject: &str, window: u64, limit: u64, need: u64) -> u64 {
    let start = now() - now() % window;
    let r = app
        .internal_post(
            LEASES_PATH,
            &json!({"replica": "gw-1", "items": [{
                "subject": subject, "kind": "tokens", "windowSeconds": window,
                "windowStart": start, "limit": limit, "need": need
            }]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body["grants"][0]["taken"].as_u64().unwrap()
}

/// alice's daily tokens taken up to `to` (from `from`).
async fn alice_to(app: &TestApp, from: u64, to: u64) {
    assert_eq!(lease(app, "alice", DAY, ALICE_DAILY, to - from).await, to);
}

/// Polls `check` until true (a deadline so that a failure ends, not to time anything).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn deliveries(app: &TestApp, result: &str) -> f64 {
    app.metric(&format!(
        "maas_companion_quota_webhooks_total{{result=\"{result}\"}}"
    ))
    .await
}

fn sign(secret: &[u8], timestamp: &str, body: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
    mac.update(format!("{timestamp}.{body}").as_bytes());
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// What a receiver does: the signature over `<timestamp>.<body>` with its secret, compared in
/// constant time, and a timestamp at most 5 minutes old.
fn verifies(got: &Got, secret: &[u8]) -> bool {
    let Some(hex_sig) = got.signature.strip_prefix("v1=") else {
        return false;
    };
    let Ok(given) = hex::decode(hex_sig) else {
        return false;
    };
    let fresh = got
        .timestamp
        .parse::<u64>()
        .is_ok_and(|t| now().abs_diff(t) <= 300);
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
    mac.update(format!("{}.{}", got.timestamp, got.body).as_bytes());
    fresh && mac.verify_slice(&given).is_ok()
}

/// `(threshold, used)` of the received events in order.
fn thresholds(got: &[Got]) -> Vec<(u64, u64)> {
    got.iter()
        .map(|g| {
            let v = g.json();
            (
                v["threshold"].as_u64().unwrap(),
                v["used"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn pseudonym(name: &str) -> Value {
    json!(maas_companion::pseudonym::subject(name))
}

/// The events for `name`, in order.
fn events_of(r: &Receiver, name: &str) -> Vec<Got> {
    r.got()
        .into_iter()
        .filter(|g| g.json()["subject"] == pseudonym(name))
        .collect()
}

fn alice_events(r: &Receiver) -> Vec<Got> {
    events_of(r, "alice")
}

/// `name` (a fresh subject on premium's 50000 tokens a minute) crossing 80 %: once its event is
/// delivered, every crossing `app` was offered before was recorded (the recorder takes them in
/// order).
async fn sentinel(app: &TestApp, r: &Receiver, name: &str) {
    lease(app, name, 60, BOB_MINUTE, BOB_MINUTE * 4 / 5).await;
    until("the sentinel delivered", || async {
        events_of(r, name)
            .iter()
            .any(|g| g.json()["scope"] == json!({"tier": "premium"}))
    })
    .await;
}

#[tokio::test]
async fn crossing_80_then_95_fires_two_signed_events_once_each() {
    let r = receiver(&[]).await;
    let db = create_database().await;
    let app = spawn(&db, webhook(&r.url)).await;
    alice_to(&app, 0, 70_000).await;
    alice_to(&app, 70_000, 80_000).await;
    until("the 80 % event", || async { !r.got().is_empty() }).await;
    // Past 80 % again and again in the same window: nothing new, until 95 %.
    alice_to(&app, 80_000, 85_000).await;
    alice_to(&app, 85_000, 90_000).await;
    alice_to(&app, 90_000, 96_000).await;
    alice_to(&app, 96_000, 97_000).await;
    sentinel(&app, &r, "sentinel").await;
    let got = alice_events(&r);
    assert_eq!(thresholds(&got), [(80, 80_000), (95, 96_000)]);
    let first = got[0].json();
    let start = now() - now() % DAY;
    let window_start = chrono::DateTime::from_timestamp(i64::try_from(start).unwrap(), 0)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let subject = first["subject"].as_str().unwrap();
    assert!(
        subject.starts_with("u-") && !got[0].body.contains("alice"),
        "{first}"
    );
    assert_eq!(first["type"], "quota.warning");
    assert_eq!(first["id"], got[0].id.as_str());
    assert_eq!(first["kind"], "tokens");
    assert_eq!(first["window"], "1d");
    assert_eq!(first["windowStart"], window_start.as_str());
    assert_eq!(first["limit"], ALICE_DAILY);
    assert_eq!(first["percentUsed"], 80);
    assert_eq!(first["shadow"], false);
    assert!(first["createdAt"].as_str().unwrap().ends_with('Z'));
    assert_eq!(got[1].json()["percentUsed"], 96);
    assert_ne!(got[0].id, got[1].id);
    for g in &got {
        assert_eq!(g.content_type, "application/json");
        assert!(verifies(g, SECRET), "{g:?}");
        assert!(
            !verifies(g, b"another-secret-0123456789abcdef0123"),
            "{g:?}"
        );
        assert_eq!(g.signature, sign(SECRET, &g.timestamp, &g.body));
    }
    // A changed body or timestamp no longer verifies.
    let mut forged = got[0].clone();
    forged.body = forged.body.replace("\"limit\":100000", "\"limit\":1");
    assert!(!verifies(&forged, SECRET));
    // The receiver has the sentinel's event before its sender writes the outcome and counts
    // it: wait for the count, which must then be exactly the three sent.
    until("three deliveries counted", || async {
        deliveries(&app, "delivered").await >= 3.0
    })
    .await;
    assert_eq!(deliveries(&app, "delivered").await, 3.0);
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM quota_warnings WHERE delivery = 'delivered'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(rows, 3);
}

#[tokio::test]
async fn two_companions_racing_and_a_restart_still_fire_once_per_threshold() {
    let r = receiver(&[]).await;
    let db = create_database().await;
    let a = spawn(&db, webhook(&r.url)).await;
    let b = spawn(&db, webhook(&r.url)).await;
    // Each companion's own counter (in process) crosses 80 %: both detect it at once.
    for _ in 0..3 {
        let (x, y) = tokio::join!(lease(&a, "alice", DAY, ALICE_DAILY, 27_000), async {
            lease(&b, "alice", DAY, ALICE_DAILY, 27_000).await
        });
        assert_eq!(x, y);
    }
    sentinel(&a, &r, "sentinel-a").await;
    sentinel(&b, &r, "sentinel-b").await;
    assert_eq!(thresholds(&alice_events(&r)), [(80, 81_000)]);
    // A restart forgets nothing: the new companion's count crosses 80 % again (its counters
    // are new), then 95 %: one more event, for 95.
    drop(a);
    let c = spawn(&db, webhook(&r.url)).await;
    alice_to(&c, 0, 85_000).await;
    alice_to(&c, 85_000, 96_000).await;
    until("the 95 % event", || async { alice_events(&r).len() == 2 }).await;
    sentinel(&c, &r, "sentinel-c").await;
    assert_eq!(thresholds(&alice_events(&r)), [(80, 81_000), (95, 96_000)]);
    let ids: std::collections::HashSet<String> = r.got().into_iter().map(|g| g.id).collect();
    assert_eq!(ids.len(), r.got().len(), "one request per event");
}

#[tokio::test]
async fn a_receiver_failing_twice_gets_three_attempts_with_one_id() {
    let r = receiver(&[503, 503]).await;
    let db = create_database().await;
    let app = spawn(&db, webhook(&r.url)).await;
    alice_to(&app, 0, 80_000).await;
    until("delivered", || async {
        deliveries(&app, "delivered").await == 1.0
    })
    .await;
    let got = r.got();
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(
        got.iter()
            .all(|g| g.id == got[0].id && g.body == got[0].body)
    );
    assert!(got.iter().all(|g| verifies(g, SECRET)));
    assert_eq!(deliveries(&app, "retried").await, 2.0);
    assert_eq!(deliveries(&app, "dead").await, 0.0);
    let (delivery, attempts): (String, i32) =
        sqlx::query_as("SELECT delivery, attempts FROM quota_warnings")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((delivery.as_str(), attempts), ("delivered", 3));
}

#[tokio::test]
async fn a_400_is_not_retried() {
    let r = receiver(&[400]).await;
    let db = create_database().await;
    let app = spawn(&db, webhook(&r.url)).await;
    alice_to(&app, 0, 80_000).await;
    until("dead", || async { deliveries(&app, "dead").await == 1.0 }).await;
    assert_eq!(r.got().len(), 1);
    assert_eq!(deliveries(&app, "retried").await, 0.0);
    let (delivery, error): (String, Option<String>) =
        sqlx::query_as("SELECT delivery, last_error FROM quota_warnings")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(delivery, "dead");
    assert!(error.unwrap().contains("400"));
}

#[tokio::test]
async fn a_dead_receiver_never_holds_up_the_api_and_ends_dead_after_max_attempts() {
    let db = create_database().await;
    let mut settings = webhook(&dead_url());
    settings.max_attempts = 3;
    settings.retry_base = Duration::from_millis(300);
    settings.retry_max = Duration::from_secs(1);
    let app = spawn(&db, settings).await;
    let key = app.mint("alice-token", json!({"name": "k"})).await;
    let key = key["key"].as_str().unwrap().to_string();
    alice_to(&app, 0, 80_000).await;
    until("a failed attempt", || async {
        deliveries(&app, "retried").await >= 1.0
    })
    .await;
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM quota_webhook_outbox")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(pending, 1, "the event is still being retried");
    // While its deliveries fail: the gateway's calls and the public API answer as ever.
    let started = Instant::now();
    let quota = app.public_get("/v1/quota", Some("alice-token")).await;
    assert_eq!(quota.status, 200, "{}", quota.body);
    alice_to(&app, 80_000, 81_000).await;
    let auth = app.authenticate(&key).await;
    assert_eq!(auth.status, 200, "{}", auth.body);
    println!(
        "quota-webhook figure: /v1/quota, a lease batch and an authenticate answered in {:?} while deliveries failed",
        started.elapsed()
    );
    until("dead", || async { deliveries(&app, "dead").await == 1.0 }).await;
    assert_eq!(deliveries(&app, "retried").await, 2.0);
    assert_eq!(deliveries(&app, "delivered").await, 0.0);
    let (delivery, attempts): (String, i32) =
        sqlx::query_as("SELECT delivery, attempts FROM quota_warnings")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((delivery.as_str(), attempts), ("dead", 3));
    until("the pending gauge at 0", || async {
        app.metric("maas_companion_quota_webhook_pending").await == 0.0
    })
    .await;
}

#[tokio::test]
async fn beyond_max_pending_the_oldest_undelivered_events_are_dropped() {
    let db = create_database().await;
    let mut settings = webhook(&dead_url());
    settings.max_pending = 2;
    settings.max_attempts = 100;
    settings.retry_base = Duration::from_secs(600);
    settings.retry_max = Duration::from_secs(600);
    let app = spawn(&db, settings).await;
    let count = |sql: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    alice_to(&app, 0, 80_000).await;
    until("alice 80 queued", || async {
        count("SELECT count(*) FROM quota_webhook_outbox").await == 1
    })
    .await;
    alice_to(&app, 80_000, 96_000).await;
    until("alice 95 queued", || async {
        count("SELECT count(*) FROM quota_warnings").await == 2
    })
    .await;
    lease(&app, "bob", 60, BOB_MINUTE, BOB_MINUTE * 4 / 5).await;
    until("one dropped", || async {
        deliveries(&app, "dropped").await == 1.0
    })
    .await;
    assert_eq!(count("SELECT count(*) FROM quota_webhook_outbox").await, 2);
    let alice = hex::encode(Sha256::digest(b"alice"));
    let states: Vec<(i16, String)> = sqlx::query_as(
        "SELECT threshold, delivery FROM quota_warnings WHERE subject_sha256 = $1 ORDER BY threshold",
    )
    .bind(&alice)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        [(80, "dropped".to_string()), (95, "pending".to_string())]
    );
    until("the pending gauge at 2", || async {
        app.metric("maas_companion_quota_webhook_pending").await == 2.0
    })
    .await;
}

#[tokio::test]
async fn a_receiver_too_slow_is_retried_after_the_timeout_with_the_same_id() {
    let r = receiver_with(vec![Step {
        status: 200,
        delay: Duration::from_secs(5),
        retry_after: None,
    }])
    .await;
    let db = create_database().await;
    let mut settings = webhook(&r.url);
    settings.timeout = Duration::from_millis(300);
    let app = spawn(&db, settings).await;
    alice_to(&app, 0, 80_000).await;
    until("delivered", || async {
        deliveries(&app, "delivered").await == 1.0
    })
    .await;
    let got = r.got();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].id, got[1].id);
    assert_eq!(deliveries(&app, "retried").await, 1.0);
    let error: Option<String> = sqlx::query_scalar("SELECT last_error FROM quota_webhook_outbox")
        .fetch_optional(&app.pool)
        .await
        .unwrap()
        .flatten();
    assert_eq!(error, None, "delivered: no longer in the outbox");
}

#[tokio::test]
async fn a_429s_retry_after_sets_the_next_attempt_when_longer_than_the_backoff() {
    let r = receiver_with(vec![Step {
        status: 429,
        delay: Duration::ZERO,
        retry_after: Some("120"),
    }])
    .await;
    let db = create_database().await;
    let app = spawn(&db, webhook(&r.url)).await;
    alice_to(&app, 0, 80_000).await;
    until("a retry scheduled", || async {
        deliveries(&app, "retried").await == 1.0
    })
    .await;
    let (wait, error): (f64, Option<String>) = sqlx::query_as(
        "SELECT EXTRACT(EPOCH FROM next_attempt_at - now())::float8, last_error
         FROM quota_webhook_outbox",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    // The backoff alone would be at most 200 ms (test settings): the receiver's 120 s rules.
    assert!(wait > 100.0 && wait <= 120.0, "next attempt in {wait} s");
    assert_eq!(error.as_deref(), Some("HTTP 429"));
    assert_eq!(r.got().len(), 1);
}

const SCOPES_POLICY: &str = r#"
tiers:
  - name: trial
    level: 0
    groups: [system:authenticated]
    limits:
      tokens: [{limit: 1000, window: 1h}, {limit: 500, window: 1h, shadow: true}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [trial]
subscriptions:
  - name: team-a
    owner: {groups: [system:authenticated]}
    warnAt: [50]
    models:
      - name: sim-model
        tokenRateLimits: [{limit: 2000, window: 1h}]
"#;

#[tokio::test]
async fn a_shadow_limit_and_a_subscription_budget_warn_naming_their_scope() {
    let r = receiver(&[]).await;
    let database_url = create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let policy = write("policy.yaml", SCOPES_POLICY);
    let identities = write("identities.yaml", crate::helpers::IDENTITIES);
    let credentials = write("credentials.yaml", "credentials: {}\n");
    let mut config =
        crate::helpers::local_settings(&database_url, &policy, &identities, &credentials);
    config.quota_webhook = Some(webhook(&r.url));
    let app =
        crate::helpers::spawn_with_config(config, dir, policy, database_url, Default::default())
            .await;
    // 450 of the trial's 1000 tokens: 45 % of the limit, 90 % of its shadow limit (500).
    assert_eq!(lease(&app, "erin", 3600, 1000, 450).await, 450);
    // 1100 of team-a's 2000 on sim-model: 55 %, past the subscription's only threshold.
    let counter = maas_types::subscription::counter_subject("erin", "team-a", "sim-model");
    assert_eq!(lease(&app, &counter, 3600, 2000, 1100).await, 1100);
    until("two events", || async { r.got().len() == 2 }).await;
    let mut events: Vec<Value> = r.got().iter().map(Got::json).collect();
    events.sort_by_key(|e| e["limit"].as_u64());
    let summary: Vec<Value> = events
        .iter()
        .map(|e| {
            json!([
                e["scope"],
                e["threshold"],
                e["limit"],
                e["used"],
                e["percentUsed"],
                e["shadow"],
                e["window"]
            ])
        })
        .collect();
    assert_eq!(
        summary,
        [
            json!([{"tier": "trial"}, 80, 500, 450, 90, true, "1h"]),
            json!([{"subscription": "team-a", "model": "sim-model"}, 50, 2000, 1100, 55, false, "1h"]),
        ]
    );
    assert!(events.iter().all(|e| e["subject"] == pseudonym("erin")));
}
