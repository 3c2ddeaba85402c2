//! Load held (issue 7): a bounded soak through real Envoy with the release .wasm, the companion
//! and PostgreSQL — mixed traffic (cached keys in both headers, streams, a static token,
//! discovery, management calls and mints, a small tier that gets 429s) from a few concurrent
//! clients for `MAAS_SOAK_SECS` (default 40) seconds on loopback. Asserts: no answer other than
//! 200 and the small tier's 429s; counters exact (what the clients got = what the filter counted
//! = what reached the model, from Envoy's stats and the simulator's record); Envoy's and the
//! companion's RSS flat after warm-up within a stated bound. And the token budget holds under
//! concurrency: N clients against a small budget never get more than the budget plus one
//! reservation.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: big
    level: 1
    groups: [g-big]
    limits:
      requests: [{limit: 10000000, window: 366d}]
      tokens: [{limit: 1000000000, window: 366d}]
    defaultMaxTokens: 16
  - name: small
    level: 2
    groups: [g-small]
    limits:
      requests: [{limit: 25, window: 366d}]
  - name: budget
    level: 3
    groups: [g-budget]
    limits:
      tokens: [{limit: 300, window: 366d}]
    defaultMaxTokens: 20
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [big, small, budget]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: big-token, username: big, groups: [g-big]}
  - {token: big2-token, username: big2, groups: [g-big]}
  - {token: small-token, username: small, groups: [g-small]}
  - {token: budget-token, username: budget, groups: [g-budget]}
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, "credentials: {}\n")
}

/// Tests of this module that read its stack's global metrics take this so they do not count
/// each other (other modules have stacks of their own).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";
const MODELS: &str = "/llm/sim-model/v1/models";

// ---- process memory (pids found from the stack's listening ports) ----

/// Inodes of the sockets listening on `port` (IPv4 and IPv6).
fn listening_inodes(port: u16) -> Vec<String> {
    let mut inodes = Vec::new();
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let local_port = f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) {
                inodes.push(f[9].to_string());
            }
        }
    }
    inodes
}

/// The pid of the process listening on `port`.
fn pid_listening_on(port: u16) -> u32 {
    let wanted: Vec<String> = listening_inodes(port)
        .into_iter()
        .map(|i| format!("socket:[{i}]"))
        .collect();
    assert!(!wanted.is_empty(), "nothing listens on port {port}");
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && wanted.iter().any(|w| target.to_str() == Some(w.as_str()))
            {
                return pid;
            }
        }
    }
    panic!("no process owns the socket listening on {port}");
}

/// VmRSS of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("pid {pid} is gone: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

// ---- Envoy counters ----

async fn envoy_counter(stack: &Stack, name: &str) -> u64 {
    let text = send(client().get(format!(
        "{}/stats?filter=^{}$",
        stack.envoy_admin_url(),
        name.replace('.', "\\.")
    )))
    .await
    .body;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

struct Counters {
    /// Requests the model answered (completed), as Envoy counts them.
    upstream_rq: u64,
    /// Requests started upstream (see the note where it is reported).
    upstream_started: u64,
    allowed: u64,
    limited: u64,
}

async fn counters(stack: &Stack) -> Counters {
    Counters {
        upstream_rq: envoy_counter(stack, "cluster.model-sim.upstream_rq_completed").await,
        upstream_started: envoy_counter(stack, "cluster.model-sim.upstream_rq_total").await,
        allowed: labelled(stack, "maas_requests_total", &[("decision", "allowed")]).await,
        limited: labelled(
            stack,
            "maas_requests_total",
            &[("decision", "rate_limited")],
        )
        .await,
    }
}

/// Totals the clients saw.
#[derive(Default)]
struct Seen {
    model_ok: AtomicU64,
    limited: AtomicU64,
    management_ok: AtomicU64,
    minted: AtomicU64,
    stream_tokens: AtomicU64,
}

fn usage_of_stream(body: &str) -> Option<u64> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find_map(|v| v["usage"]["total_tokens"].as_u64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn soak_mixed_traffic_counters_exact_memory_flat() {
    let _serial = serial().await;
    let stack = stack();
    let secs: u64 = std::env::var("MAAS_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40)
        .clamp(10, 600);
    let key = stack.mint_key_plain("big-token", "soak").await.unwrap();
    let key2 = stack.mint_key_plain("big2-token", "soak2").await.unwrap();
    let small_key = stack.mint_key_plain("small-token", "soak").await.unwrap();
    let envoy_pid = pid_listening_on(port_of(&stack.envoy_admin_url()));
    let companion_pid = pid_listening_on(port_of(&stack.companion_public_url()));
    let rss0 = (rss_kib(envoy_pid), rss_kib(companion_pid));
    stack.clear_sim_requests();
    let before = counters(stack).await;

    let seen: &'static Seen = Box::leak(Box::default());
    let errors: &'static std::sync::Mutex<Vec<String>> = Box::leak(Box::default());
    let deadline = Instant::now() + Duration::from_secs(secs);
    // The simulator keeps its last 10 000 records: the four model clients stay below that,
    // paced to spread their requests over the whole run.
    const MAX_PER_CLIENT: u64 = 2_200;
    let pace = Duration::from_millis(secs * 1000 / MAX_PER_CLIENT);
    let mut tasks = Vec::new();
    // Client kinds: 0 key in Authorization, JSON; 1 key in x-api-key, streams; 2 static token,
    // JSON and discovery; 3 small tier (429s expected); 4 management reads and mints.
    for kind in 0..5u32 {
        let (key, key2, small_key) = (key.clone(), key2.clone(), small_key.clone());
        tasks.push(tokio::spawn(async move {
            let stack = self::stack();
            let c = client();
            let mut n = 0u64;
            while Instant::now() < deadline && n < MAX_PER_CLIENT {
                n += 1;
                if kind < 3 {
                    tokio::time::sleep(pace).await;
                }
                let id = format!("soak-{kind}");
                let chat_req = |auth: (&str, String), stream: bool| {
                    let mut b = json!({"model": "sim-model", "max_tokens": 8,
                                       "messages": [{"role": "user", "content": "soak test prompt"}]});
                    if stream {
                        b["stream"] = json!(true);
                        if n.is_multiple_of(2) {
                            b["stream_options"] = json!({"include_usage": true});
                        }
                    }
                    c.post(format!("{}{CHAT}", stack.gateway_url()))
                        .header(auth.0, auth.1)
                        .header("x-test-id", &id)
                        .json(&b)
                };
                let (req, is_model, may_429) = match kind {
                    0 => (chat_req(("authorization", bearer(&key)), false), true, false),
                    1 => (chat_req(("x-api-key", key2.clone()), true), true, false),
                    2 if n.is_multiple_of(4) => (
                        c.get(format!("{}{MODELS}", stack.gateway_url()))
                            .header("authorization", "Bearer big-token")
                            .header("x-test-id", &id),
                        true,
                        false,
                    ),
                    2 => (chat_req(("authorization", "Bearer big-token".into()), n.is_multiple_of(3)), true, false),
                    3 => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        (chat_req(("authorization", bearer(&small_key)), n.is_multiple_of(2)), true, true)
                    }
                    _ => {
                        tokio::time::sleep(Duration::from_millis(25)).await;
                        if n.is_multiple_of(20) {
                            let r = c
                                .post(format!("{}/maas-api/v1/api-keys", stack.gateway_url()))
                                .bearer_auth("big-token")
                                .json(&json!({"name": format!("soak-mint-{n}"), "ephemeral": true}));
                            match r.send().await {
                                Ok(r) if r.status().as_u16() == 201 => {
                                    seen.minted.fetch_add(1, Ordering::Relaxed);
                                }
                                Ok(r) => errors.lock().unwrap().push(format!("mint: {}", r.status())),
                                Err(e) => errors.lock().unwrap().push(format!("mint: {e}")),
                            }
                            continue;
                        }
                        (
                            c.get(format!("{}/maas-api/v1/models", stack.gateway_url()))
                                .header("authorization", bearer(&key)),
                            false,
                            false,
                        )
                    }
                };
                match req.send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let body = resp.text().await;
                        match (status, body) {
                            (200, Ok(body)) => {
                                if is_model {
                                    seen.model_ok.fetch_add(1, Ordering::Relaxed);
                                    if let Some(t) = usage_of_stream(&body) {
                                        seen.stream_tokens.fetch_add(t, Ordering::Relaxed);
                                    }
                                } else {
                                    seen.management_ok.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            (429, Ok(_)) if may_429 => {
                                seen.limited.fetch_add(1, Ordering::Relaxed);
                            }
                            (s, b) => errors
                                .lock()
                                .unwrap()
                                .push(format!("client {kind}: {s} {:?}", b.map(|b| b.chars().take(200).collect::<String>()))),
                        }
                    }
                    Err(e) => errors.lock().unwrap().push(format!("client {kind}: {e}")),
                }
            }
            n
        }));
    }
    // Memory after warm-up (a quarter of the run, at least 5 s), then every second.
    let warm_at = Duration::from_secs((secs / 4).max(5));
    tokio::time::sleep(warm_at).await;
    let rss_warm = (rss_kib(envoy_pid), rss_kib(companion_pid));
    let mut rss_max = rss_warm;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = (rss_kib(envoy_pid), rss_kib(companion_pid));
        rss_max = (rss_max.0.max(now.0), rss_max.1.max(now.1));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await.unwrap();
    }
    let rss_end = (rss_kib(envoy_pid), rss_kib(companion_pid));
    // Let in-flight settlement and stats flush (Envoy's stats are read live; the sim's record is
    // written before it answers).
    let errors = errors.lock().unwrap().clone();
    let model_ok = seen.model_ok.load(Ordering::Relaxed);
    let limited = seen.limited.load(Ordering::Relaxed);
    // The filter's counters may trail the answers a little: wait (bounded) for them to settle.
    let mut after = counters(stack).await;
    let settle_start = Instant::now();
    while settle_start.elapsed() < Duration::from_secs(10)
        && (after.allowed - before.allowed != model_ok
            || after.limited - before.limited != limited
            || after.upstream_rq - before.upstream_rq != model_ok)
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = counters(stack).await;
    }
    let sim_seen = stack
        .sim_requests()
        .iter()
        .filter(|r| {
            r.header("x-test-id")
                .is_some_and(|t| t.starts_with("soak-"))
        })
        .count() as u64;
    let upstream = after.upstream_rq - before.upstream_rq;
    let started = after.upstream_started - before.upstream_started;
    let allowed = after.allowed - before.allowed;
    let filter_limited = after.limited - before.limited;
    eprintln!(
        "soak {secs}s: {sent} client requests; model 200s {model_ok}, 429s {limited} (small tier), \
         management 200s {}, mints {}, streamed usage tokens {}; filter allowed {allowed}, limited \
         {filter_limited}; Envoy upstream requests completed {upstream} (started {started}); simulator saw {sim_seen}",
        seen.management_ok.load(Ordering::Relaxed),
        seen.minted.load(Ordering::Relaxed),
        seen.stream_tokens.load(Ordering::Relaxed),
    );
    eprintln!(
        "RSS KiB envoy: start {} warm {} max {} end {}; companion: start {} warm {} max {} end {}",
        rss0.0, rss_warm.0, rss_max.0, rss_end.0, rss0.1, rss_warm.1, rss_max.1, rss_end.1
    );
    assert!(
        errors.is_empty(),
        "{} errors, first: {:?}",
        errors.len(),
        &errors[..errors.len().min(10)]
    );
    assert!(
        model_ok > 100,
        "too little traffic to mean anything: {model_ok}"
    );
    // The small tier: exactly its 25 requests, the rest 429.
    let small_ok = sim_seen_by(stack, "soak-3");
    assert_eq!(
        small_ok, 25,
        "the small tier's 25 requests passed, no more, no less"
    );
    assert!(limited > 0, "the small tier never hit its limit");
    // Counters exact.
    assert_eq!(
        upstream, model_ok,
        "Envoy's completed upstream requests ≠ what clients got back as 200"
    );
    assert_eq!(
        sim_seen, model_ok,
        "the simulator saw ≠ what clients got back as 200"
    );
    assert_eq!(
        allowed, model_ok,
        "the filter's allowed count ≠ requests that passed"
    );
    assert_eq!(
        filter_limited, limited,
        "the filter's 429 count ≠ the 429s clients got"
    );
    // Memory flat after warm-up: growth bounded by 32 MiB (Envoy) / 32 MiB (companion).
    const BOUND_KIB: u64 = 32 * 1024;
    assert!(
        rss_end.0 <= rss_warm.0 + BOUND_KIB && rss_max.0 <= rss_warm.0 + BOUND_KIB,
        "Envoy RSS grew from {} KiB to {} (max {}) KiB",
        rss_warm.0,
        rss_end.0,
        rss_max.0
    );
    assert!(
        rss_end.1 <= rss_warm.1 + BOUND_KIB && rss_max.1 <= rss_warm.1 + BOUND_KIB,
        "companion RSS grew from {} KiB to {} (max {}) KiB",
        rss_warm.1,
        rss_end.1,
        rss_max.1
    );
    stack.check_alive().unwrap();
}

fn sim_seen_by(stack: &Stack, id: &str) -> u64 {
    stack.sim_requests_with_test_id(id).len() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn token_budget_holds_under_concurrency() {
    let _serial = serial().await;
    let stack = stack();
    const BUDGET: u64 = 300;
    const RESERVATION: u64 = 20; // max_tokens of every request
    const CLIENTS: usize = 16;
    let key = stack
        .mint_key_plain("budget-token", "budget")
        .await
        .unwrap();
    let before = counters(stack).await;
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let stack = self::stack();
            let c = client();
            let (mut used, mut ok, mut limited_in_a_row, mut n) = (0u64, 0u64, 0, 0);
            let mut statuses = BTreeMap::<u16, u64>::new();
            while limited_in_a_row < 3 && n < 60 {
                n += 1;
                let stream = (i + n) % 2 == 0;
                let mut b = json!({"model": "sim-model", "max_tokens": RESERVATION,
                                   "messages": [{"role": "user", "content": "x"}]});
                if stream {
                    b["stream"] = json!(true);
                    b["stream_options"] = json!({"include_usage": true});
                }
                let r = send(
                    c.post(format!("{}{CHAT}", stack.gateway_url()))
                        .header("authorization", bearer(&key))
                        .header("x-sim-chunk-delay-ms", "2")
                        .header("x-test-id", "budget")
                        .json(&b),
                )
                .await;
                *statuses.entry(r.status).or_default() += 1;
                match r.status {
                    200 => {
                        limited_in_a_row = 0;
                        ok += 1;
                        used += if stream {
                            usage_of_stream(&r.body).expect("usage in the stream")
                        } else {
                            r.json()["usage"]["total_tokens"].as_u64().unwrap()
                        };
                    }
                    429 => {
                        limited_in_a_row += 1;
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                    s => panic!("client {i}: unexpected {s}: {}", r.body),
                }
            }
            (used, ok, statuses)
        }));
    }
    let (mut used, mut ok) = (0, 0);
    let mut statuses = BTreeMap::<u16, u64>::new();
    for t in tasks {
        let (u, o, s) = t.await.unwrap();
        used += u;
        ok += o;
        for (k, v) in s {
            *statuses.entry(k).or_default() += v;
        }
    }
    let limited_seen = statuses.get(&429).copied().unwrap_or(0);
    let mut after = counters(stack).await;
    let settle_start = Instant::now();
    while settle_start.elapsed() < Duration::from_secs(10)
        && (after.allowed - before.allowed != ok || after.limited - before.limited != limited_seen)
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = counters(stack).await;
    }
    eprintln!(
        "budget: filter allowed {}, limited {}; clients 200 {ok}, 429 {}",
        after.allowed - before.allowed,
        after.limited - before.limited,
        statuses.get(&429).copied().unwrap_or(0)
    );
    eprintln!(
        "{CLIENTS} clients on a budget of {BUDGET} (reservation {RESERVATION}): {ok} passed, {used} tokens used; statuses {statuses:?}"
    );
    assert!(
        used <= BUDGET + RESERVATION,
        "{used} tokens used on a budget of {BUDGET} (one reservation = {RESERVATION})"
    );
    // And the budget was actually used, not refused wholesale.
    assert!(used >= BUDGET / 2, "only {used} of {BUDGET} tokens used");
    assert_eq!(
        stack.sim_requests_with_test_id("budget").len() as u64,
        ok,
        "requests that reached the model ≠ 200s"
    );
    assert_eq!(
        after.allowed - before.allowed,
        ok,
        "the filter's allowed count"
    );
    assert_eq!(
        after.limited - before.limited,
        limited_seen,
        "the filter's 429 count"
    );
}
