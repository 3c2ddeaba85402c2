//! `POST /internal/v1/leases` end to end: the companion in-process (port 0) over a real
//! redis-server that each test starts on a free port (or none: the in-process store), and a real
//! PostgreSQL (`MAAS_TEST_DATABASE_URL`, as the other companion tests).
//!
//! redis-server: `$MAAS_REDIS_SERVER`, else `/usr/bin/redis-server`. Missing, the tests fail.

use crate::helpers::{self, Reply, TestApp, spawn_app_with};
use maas_companion::settings::RedisSettings;
use maas_types::lease::{LEASES_PATH, LeaseItem, LeaseKind, apply_item};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// A throwaway redis-server.

struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

fn redis_binary() -> PathBuf {
    let path = std::env::var("MAAS_REDIS_SERVER")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "/usr/bin/redis-server".into());
    let path = PathBuf::from(path);
    assert!(
        path.is_file(),
        "{} not found: these tests need redis-server (apt-get install redis-server, or set \
         MAAS_REDIS_SERVER)",
        path.display()
    );
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts redis-server on `port` (with `extra` flags; `--tls` in them: `port` is the TLS
/// port and there is no plain one); `None` when it exited (port taken) or never answered.
fn start_on(port: u16, dir: &std::path::Path, extra: &[String]) -> Option<Child> {
    let tls = extra.iter().any(|a| a.starts_with("--tls"));
    let ports = if tls {
        [
            "--port".to_string(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
        ]
    } else {
        [
            "--port".to_string(),
            port.to_string(),
            "--tls-port".into(),
            "0".into(),
        ]
    };
    let mut child = Command::new(redis_binary())
        .args(ports)
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(extra)
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return None;
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some(child);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

impl RedisServer {
    fn start() -> RedisServer {
        Self::start_with(tempfile::tempdir().unwrap(), Vec::new())
    }

    /// With more redis-server flags; `dir` holds whatever files they name.
    fn start_with(dir: tempfile::TempDir, extra: Vec<String>) -> RedisServer {
        for _ in 0..10 {
            let port = free_port();
            if let Some(child) = start_on(port, dir.path(), &extra) {
                return RedisServer {
                    child: Some(child),
                    port,
                    dir,
                    extra,
                };
            }
        }
        panic!("redis-server did not start on any of 10 free ports");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port (empty: nothing is saved).
    fn restart(&mut self) {
        self.stop();
        for _ in 0..20 {
            if let Some(child) = start_on(self.port, self.dir.path(), &self.extra) {
                self.child = Some(child);
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not start again on port {}", self.port);
    }

    async fn client(&self) -> redis::aio::MultiplexedConnection {
        self.client_as(&self.url()).await
    }

    async fn client_as(&self, url: &str) -> redis::aio::MultiplexedConnection {
        redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------------
// Companions.

fn redis_settings(url: &str) -> RedisSettings {
    RedisSettings {
        url: url.to_string().into(),
        endpoint: url.to_string(),
        timeout: Duration::from_millis(500),
    }
}

async fn companion_on(redis: &RedisServer) -> TestApp {
    let settings = redis_settings(&redis.url());
    spawn_app_with(move |s| s.leases.redis = Some(settings)).await
}

async fn companion_in_memory() -> TestApp {
    spawn_app_with(|s| s.leases.redis = None).await
}

async fn lease(app: &TestApp, replica: &str, items: Vec<Value>) -> Reply {
    app.internal_post(LEASES_PATH, &json!({"replica": replica, "items": items}))
        .await
}

/// The window of one hour that holds now.
fn hour() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    now - now % 3600
}

fn item(subject: &str, limit: u64, need: u64, want: u64, debt: u64, release: u64) -> Value {
    json!({
        "subject": subject, "kind": "requests", "windowSeconds": 3600, "windowStart": hour(),
        "limit": limit, "need": need, "want": want, "debt": debt, "release": release
    })
}

fn grants(r: &Reply) -> Vec<(u64, u64)> {
    assert_eq!(r.status, 200, "{}", r.body);
    r.body["grants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["granted"].as_u64().unwrap(), g["taken"].as_u64().unwrap()))
        .collect()
}

fn subject() -> String {
    format!("user:{}", uuid::Uuid::new_v4().simple())
}

// ---------------------------------------------------------------------------------------------
// The rules, run against either store.

async fn grants_never_exceed_the_limit_under_concurrency(app: &TestApp) {
    let user = subject();
    let limit = 100;
    // 50 batches in flight at once, from 4 replica ids, each asking 1 and wanting 7.
    let mut batches = tokio::task::JoinSet::new();
    for i in 0..50 {
        let (http, url) = (app.http.clone(), format!("{}{LEASES_PATH}", app.internal));
        let body = json!({"replica": format!("replica-{}", i % 4), "items": [item(&user, limit, 1, 7, 0, 0)]});
        batches.spawn(async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            (
                v["grants"][0]["granted"].as_u64().unwrap(),
                v["grants"][0]["taken"].as_u64().unwrap(),
            )
        });
    }
    let answers = batches.join_all().await;
    let granted: u64 = answers.iter().map(|(g, _)| g).sum();
    assert_eq!(granted, limit, "every grant summed: {answers:?}");
    assert!(answers.iter().all(|(_, taken)| *taken <= limit));
    let after = grants(&lease(app, "replica-0", vec![item(&user, limit, 0, 0, 0, 0)]).await);
    assert_eq!(after[0], (0, limit), "taken is exactly what was granted");
    let denied = grants(&lease(app, "replica-1", vec![item(&user, limit, 1, 0, 0, 0)]).await);
    assert_eq!(denied[0], (0, limit), "nothing left: the need is not met");
}

async fn debt_counts_and_release_returns(app: &TestApp) {
    let user = subject();
    let r = grants(&lease(app, "r1", vec![item(&user, 10, 10, 0, 0, 0)]).await);
    assert_eq!(r[0], (10, 10));
    // Usage above the lease is debt: counted even above the limit.
    let r = grants(&lease(app, "r1", vec![item(&user, 10, 0, 0, 5, 0)]).await);
    assert_eq!(r[0], (0, 15));
    let r = grants(&lease(app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await);
    assert_eq!(r[0], (0, 15), "over the limit: no grant");
    // Unused lease handed back is available again.
    let r = grants(&lease(app, "r1", vec![item(&user, 10, 0, 0, 0, 8)]).await);
    assert_eq!(r[0], (0, 7));
    let r = grants(&lease(app, "r2", vec![item(&user, 10, 3, 0, 0, 0)]).await);
    assert_eq!(r[0], (3, 10));
}

async fn fair_share_and_replica_count(app: &TestApp) {
    let user = subject();
    for replica in ["a", "b", "c", "a", "b"] {
        let r = lease(app, replica, vec![]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = lease(app, "d", vec![item(&user, 100, 1, 1000, 0, 0)]).await;
    assert_eq!(r.body["replicas"], 4, "distinct ids: a, b, c, d");
    assert_eq!(grants(&r)[0], (25, 25), "a quarter of what is left");
    let r = lease(app, "a", vec![item(&user, 100, 60, 0, 0, 0)]).await;
    assert_eq!(
        grants(&r)[0],
        (60, 85),
        "the need is met above the fair share"
    );
    let r = lease(app, "b", vec![item(&user, 100, 0, 1000, 0, 0)]).await;
    assert_eq!(grants(&r)[0], (3, 88), "15 left ÷ 4");
}

/// A batch re-sent with the same `batchId` (its first answer lost) is applied once and gets the
/// first answer again; another id, or no id, is applied.
async fn a_repeated_batch_id_is_applied_once(app: &TestApp) {
    let user = subject();
    let body = json!({"replica": "r1", "batchId": "w1-0001",
                      "items": [item(&user, 100, 10, 0, 3, 0), item(&user, 100, 0, 5, 0, 0)]});
    let first = app.internal_post(LEASES_PATH, &body).await;
    let again = app.internal_post(LEASES_PATH, &body).await;
    assert_eq!(grants(&first), vec![(10, 13), (5, 18)]);
    assert_eq!(again.body, first.body, "the same answer, byte for byte");
    let now = grants(&lease(app, "r1", vec![item(&user, 100, 0, 0, 0, 0)]).await);
    assert_eq!(now[0], (0, 18), "applied once");
    // The same id from another replica is its own batch.
    let other = json!({"replica": "r2", "batchId": "w1-0001",
                       "items": [item(&user, 100, 0, 0, 2, 0)]});
    assert_eq!(
        grants(&app.internal_post(LEASES_PATH, &other).await)[0],
        (0, 20)
    );
    let bad = json!({"replica": "r1", "batchId": "no spaces", "items": []});
    let r = app.internal_post(LEASES_PATH, &bad).await;
    assert_eq!(
        (r.status, r.body["error"]["param"].as_str()),
        (400, Some("batchId"))
    );
}

async fn all_rules(app: &TestApp) {
    a_repeated_batch_id_is_applied_once(app).await;
    grants_never_exceed_the_limit_under_concurrency(app).await;
    debt_counts_and_release_returns(app).await;
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_store_grants_never_exceed_the_limit_and_counts_debt_release_and_replicas() {
    let redis = RedisServer::start();
    let app = companion_on(&redis).await;
    all_rules(&app).await;
    let r = lease(&app, "r1", vec![]).await;
    assert_eq!(r.body["store"], "redis");
}

#[tokio::test]
async fn redis_store_splits_what_is_left_among_the_replicas_it_counts() {
    let redis = RedisServer::start();
    fair_share_and_replica_count(&companion_on(&redis).await).await;
}

#[tokio::test]
async fn memory_store_splits_what_is_left_among_the_replicas_it_counts() {
    fair_share_and_replica_count(&companion_in_memory().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_follows_the_same_rules() {
    let app = companion_in_memory().await;
    all_rules(&app).await;
    let r = lease(&app, "r1", vec![]).await;
    assert_eq!(r.body["store"], "memory");
    let ready = app.internal_get("/ready").await;
    assert_eq!(ready.status, 200);
    assert_eq!(
        ready.body["leases"],
        json!({"store": "memory", "reachable": true})
    );
}

#[tokio::test]
async fn the_redis_script_does_what_apply_item_does() {
    let redis = RedisServer::start();
    let app = companion_on(&redis).await;
    let subjects = [subject(), subject(), subject()];
    let mut model = std::collections::HashMap::<(usize, LeaseKind), u64>::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for _ in 0..120 {
        let n = rng.gen_range(1..6);
        let mut items = Vec::new();
        let mut sent = Vec::new();
        for _ in 0..n {
            let s = rng.gen_range(0..subjects.len());
            let kind = if rng.gen_bool(0.5) {
                LeaseKind::Requests
            } else {
                LeaseKind::Tokens
            };
            let it = LeaseItem {
                subject: subjects[s].clone(),
                kind,
                window_seconds: 3600,
                window_start: hour(),
                limit: rng.gen_range(0..500),
                need: if rng.gen_bool(0.3) {
                    0
                } else {
                    rng.gen_range(0..120)
                },
                want: rng.gen_range(0..300),
                debt: if rng.gen_bool(0.7) {
                    0
                } else {
                    rng.gen_range(0..80)
                },
                release: if rng.gen_bool(0.7) {
                    0
                } else {
                    rng.gen_range(0..150)
                },
            };
            items.push(serde_json::to_value(&it).unwrap());
            sent.push((s, it));
        }
        // Up to three replica ids, so that the fair share divides by 1, 2 and 3.
        let replica = format!("replica-{}", rng.gen_range(0..3));
        let r = lease(&app, &replica, items).await;
        let replicas = u32::try_from(r.body["replicas"].as_u64().unwrap()).unwrap();
        assert!((1..=3).contains(&replicas), "{}", r.body);
        let expected: Vec<(u64, u64)> = sent
            .iter()
            .map(|(s, it)| {
                let taken = model.entry((*s, it.kind)).or_default();
                let (next, granted) = apply_item(*taken, it, replicas);
                *taken = next;
                (granted, next)
            })
            .collect();
        assert_eq!(grants(&r), expected);
    }
    // The counter's key and expiry: window end + 60 s.
    let mut conn = redis.client().await;
    let key = format!(
        "maas:lease:v1:{}:requests:3600:{}",
        hex_sha256(&subjects[0]),
        hour()
    );
    let at: i64 = redis::cmd("PEXPIRETIME")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(at, i64::try_from((hour() + 3600 + 60) * 1000).unwrap());
    let stored: Option<u64> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, model.get(&(0, LeaseKind::Requests)).copied());
}

fn hex_sha256(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

#[tokio::test]
async fn a_batch_is_one_redis_round_trip() {
    let redis = RedisServer::start();
    let app = companion_on(&redis).await;
    let series = "maas_companion_redis_round_trips_total";
    // The first batch may load the script (NOSCRIPT → SCRIPT LOAD → EVALSHA).
    let user = subject();
    grants(&lease(&app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await);
    for size in [1, 20, 200] {
        let before = app.metric(series).await;
        let items = (0..size)
            .map(|_| item(&subject(), 10, 1, 5, 0, 0))
            .collect();
        let r = lease(&app, "r1", items).await;
        assert_eq!(grants(&r).len(), size);
        assert_eq!(app.metric(series).await - before, 1.0, "{size} items");
    }
    assert!(app.metric("maas_companion_lease_batches_total").await >= 4.0);
    assert!(app.metric("maas_companion_lease_items_total").await >= 222.0);
    let denied_before = app.metric("maas_companion_lease_grants_denied_total").await;
    grants(&lease(&app, "r1", vec![item(&user, 10, 100, 0, 0, 0)]).await);
    assert_eq!(
        app.metric("maas_companion_lease_grants_denied_total").await - denied_before,
        1.0
    );
}

#[tokio::test]
async fn redis_down_answers_503_keeps_ready_and_recovers_without_a_restart() {
    let mut redis = RedisServer::start();
    let app = companion_on(&redis).await;
    let user = subject();
    grants(&lease(&app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await);
    assert_eq!(app.metric("maas_companion_lease_store_up").await, 1.0);

    redis.stop();
    let started = Instant::now();
    let r = lease(&app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.code(), "lease_store_unavailable");
    assert!(started.elapsed() < Duration::from_secs(2), "answered fast");
    assert_eq!(app.metric("maas_companion_lease_store_up").await, 0.0);
    assert!(app.metric("maas_companion_lease_store_errors_total").await >= 1.0);
    let ready = app.internal_get("/ready").await;
    assert_eq!(ready.status, 200, "authentication does not need Redis");
    assert_eq!(
        ready.body["leases"],
        json!({"store": "redis", "reachable": false})
    );
    // Authentication keeps working.
    let key = app.mint_named("alice-token", "k").await;
    let auth = app.authenticate(key["key"].as_str().unwrap()).await;
    assert_eq!(auth.status, 200, "{}", auth.body);

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut attempts = 0;
    let r = loop {
        attempts += 1;
        let r = lease(&app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await;
        if r.status == 200 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(attempts, 1, "the first batch after Redis is back succeeds");
    assert_eq!(grants(&r)[0], (1, 1), "a fresh Redis: counters start again");
    assert_eq!(app.metric("maas_companion_lease_store_up").await, 1.0);
    let ready = app.internal_get("/ready").await;
    assert_eq!(ready.body["leases"]["reachable"], true);
}

#[tokio::test]
async fn a_companion_starts_without_redis_and_reports_it() {
    // Nothing listens on this port.
    let url = format!("redis://127.0.0.1:{}", free_port());
    let settings = redis_settings(&url);
    let app = spawn_app_with(move |s| s.leases.redis = Some(settings)).await;
    let ready = app.internal_get("/ready").await;
    assert_eq!(ready.status, 200);
    assert_eq!(ready.body["leases"]["reachable"], false);
    assert_eq!(app.metric("maas_companion_lease_store_up").await, 0.0);
    let r = lease(&app, "r1", vec![item(&subject(), 10, 1, 0, 0, 0)]).await;
    assert_eq!(r.status, 503);
}

#[tokio::test]
async fn two_companions_on_one_redis_share_the_counters_and_a_restart_keeps_them() {
    let redis = RedisServer::start();
    let one = companion_on(&redis).await;
    let two = companion_on(&redis).await;
    let user = subject();
    assert_eq!(
        grants(&lease(&one, "r1", vec![item(&user, 10, 6, 0, 0, 0)]).await)[0],
        (6, 6)
    );
    let r = lease(&two, "r2", vec![item(&user, 10, 6, 0, 0, 0)]).await;
    assert_eq!(grants(&r)[0], (0, 6), "6 taken through the other companion");
    assert_eq!(r.body["replicas"], 2, "replicas seen by either companion");
    drop(one);
    drop(two);
    let again = companion_on(&redis).await;
    let r = lease(&again, "r1", vec![item(&user, 10, 4, 0, 0, 0)]).await;
    assert_eq!(grants(&r)[0], (4, 10), "a new companion sees the counters");
}

#[tokio::test]
async fn a_bad_batch_is_a_400_naming_the_field() {
    let app = companion_in_memory().await;
    let good = item(&subject(), 10, 1, 0, 0, 0);
    let spoil = |field: &str, value: Value| {
        let mut v = good.clone();
        v[field] = value;
        v
    };
    let cases = [
        ("", vec![good.clone()], "replica"),
        ("r1", vec![good.clone(); 1025], "items"),
        (
            "r1",
            vec![good.clone(), spoil("windowSeconds", json!(0))],
            "items[1].windowSeconds",
        ),
        (
            "r1",
            vec![spoil("windowStart", json!(hour() + 7))],
            "items[0].windowStart",
        ),
        ("r1", vec![spoil("subject", json!(""))], "items[0].subject"),
        (
            "r1",
            vec![spoil("subject", json!("x".repeat(1025)))],
            "items[0].subject",
        ),
    ];
    for (replica, items, field) in cases {
        let r = lease(&app, replica, items).await;
        assert_eq!(r.status, 400, "{field}: {}", r.body);
        assert_eq!(r.body["error"]["param"], field, "{}", r.body);
        assert!(r.message().contains(field), "{}", r.message());
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
    }
    // Nothing of a refused batch was applied.
    let r = lease(&app, "r1", vec![good]).await;
    assert_eq!(grants(&r)[0], (1, 1));
    assert_eq!(
        r.body["replicas"], 1,
        "the refused replica ids were not counted"
    );
}

#[tokio::test]
async fn the_lease_path_is_not_on_the_public_listener() {
    let app = companion_in_memory().await;
    let body = json!({"replica": "r1", "items": [item(&subject(), 10, 1, 0, 0, 0)]});
    let r = app.public_post(LEASES_PATH, None, &body).await;
    assert_eq!(r.status, 404, "{}", r.body);
    let r = app
        .http
        .post(format!("{}{LEASES_PATH}", app.metrics))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(lease(&app, "r1", vec![]).await.status, 200);
}

#[tokio::test]
async fn a_redis_that_refused_the_password_is_retried_once_it_accepts_it() {
    let redis = RedisServer::start_with(
        tempfile::tempdir().unwrap(),
        vec!["--requirepass".into(), "old-password".into()],
    );
    let url = format!("redis://:new-password@127.0.0.1:{}", redis.port);
    let settings = redis_settings(&url);
    let app = spawn_app_with(move |s| s.leases.redis = Some(settings)).await;
    let user = subject();
    let r = lease(&app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.code(), "lease_store_unavailable");
    // The password is rotated on the Redis side: the companion follows without a restart.
    let mut admin = redis
        .client_as(&format!("redis://:old-password@127.0.0.1:{}", redis.port))
        .await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("new-password")
        .query_async(&mut admin)
        .await
        .unwrap();
    let r = lease(&app, "r1", vec![item(&user, 10, 1, 0, 0, 0)]).await;
    assert_eq!(grants(&r)[0], (1, 1));
}

/// A throwaway CA (PEM) and a server certificate for 127.0.0.1 signed by it: (ca, cert, key).
fn tls_files() -> (String, String, String) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    (ca_cert.pem(), leaf.pem(), leaf_key.serialize_pem())
}

#[tokio::test]
async fn the_binary_reaches_redis_over_tls_with_a_password_it_never_logs() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_files();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    std::fs::write(path("ca.pem"), ca).unwrap();
    std::fs::write(path("cert.pem"), cert).unwrap();
    std::fs::write(path("key.pem"), key).unwrap();
    let flags: Vec<String> = [
        ("--tls-cert-file", path("cert.pem")),
        ("--tls-key-file", path("key.pem")),
        ("--tls-ca-cert-file", path("ca.pem")),
        ("--tls-auth-clients", "no".into()),
        ("--requirepass", "hunter2-secret".into()),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_string(), value])
    .collect();
    let ca_file = path("ca.pem");
    let redis = RedisServer::start_with(dir, flags);
    let url = format!("rediss://:hunter2-secret@127.0.0.1:{}", redis.port);

    let database_url = helpers::create_database().await;
    let files = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = files.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_maas-companion"))
        .env_clear()
        .env("RUST_LOG", "info")
        .env("MAAS_LOG_FORMAT", "json")
        // The system's roots as rustls-native-certs reads them: here, the throwaway CA.
        .env("SSL_CERT_FILE", &ca_file)
        .env("DATABASE_URL", &database_url)
        .env("MAAS_REDIS_URL", &url)
        .env("MAAS_PUBLIC_ADDR", "127.0.0.1:0")
        .env("MAAS_INTERNAL_ADDR", "127.0.0.1:0")
        .env("MAAS_METRICS_ADDR", "127.0.0.1:0")
        .envs(helpers::internal_pki().env())
        .args([
            "--policy-file",
            &file("policy.yaml", &helpers::local_policy()),
        ])
        .args(["--identity-provider", "static"])
        .args(["--identities-file", &file("ids.yaml", helpers::IDENTITIES)])
        .args(["--credentials-source", "file"])
        .args([
            "--credentials-file",
            &file("creds.yaml", "credentials: {}\n"),
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let internal = loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("no 'listening' line");
        log.push(line.clone());
        if let Some(rest) = line.split(" internal=").nth(1) {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    let http = helpers::internal_pki().gateway_client();
    let body = json!({"replica": "r1", "items": [item(&subject(), 10, 4, 0, 0, 0)]});
    let r = http
        .post(format!("https://{internal}{LEASES_PATH}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let answer: Value = r.json().await.unwrap();
    let ready: Value = http
        .get(format!("https://{internal}/ready"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    log.extend(rx.try_iter());
    assert_eq!(status, 200, "{answer} {log:#?}");
    assert_eq!(answer["store"], "redis");
    assert_eq!(answer["grants"][0]["granted"], 4);
    assert_eq!(ready["leases"]["reachable"], true);
    let endpoint = format!("rediss://127.0.0.1:{}", redis.port);
    assert!(log.iter().any(|l| l.contains(&endpoint)), "{log:#?}");
    assert!(!log.iter().any(|l| l.contains("hunter2")), "{log:#?}");
}
