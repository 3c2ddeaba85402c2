//! Reliability e2e (issue 7): faults survived, nothing lost — the companion stopped during
//! traffic, PostgreSQL stopped, the companion restarted while keys are minted, and upstream
//! faults (500, not JSON, dropped stream, no usage, no `[DONE]`). Real Envoy with the release
//! .wasm, the real companion and PostgreSQL, on a stack of this module's own; tests run one at a
//! time because they stop and start its processes.

use crate::helpers::*;
use futures_util::StreamExt;
use maas_e2e::Stack;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1d}]
  - name: metered
    level: 1
    groups: [g-metered]
    limits:
      tokens: [{limit: 1000000, window: 366d}]
    defaultMaxTokens: 64
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, metered]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
  - {token: bob-token, username: bob, groups: [system:authenticated]}
  - {token: minter-token, username: minter, groups: [system:authenticated]}
  - {token: pg-token, username: pguser, groups: [system:authenticated]}
  - {token: fresh-token, username: fresh, groups: [system:authenticated]}
  - {token: mia-token, username: mia, groups: [system:authenticated, g-metered]}
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

async fn call(stack: &Stack, cred: &str, test_id: &str) -> Reply {
    let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    chat(
        stack,
        CHAT,
        test_id,
        &[("authorization", &bearer(cred))],
        body,
    )
    .await
}

/// `POST /internal/v1/authenticate` straight to the companion.
async fn authenticate(stack: &Stack, credential: &str) -> Reply {
    send(
        stack
            .internal_client()
            .post(format!(
                "{}/internal/v1/authenticate",
                stack.companion_internal_url()
            ))
            .json(&json!({"credential": credential})),
    )
    .await
}

/// Mints through the gateway; returns the status and body (never panics on a refusal).
async fn try_mint(stack: &Stack, token: &str, name: &str) -> Result<Reply, String> {
    let resp = client()
        .post(format!("{}/maas-api/v1/api-keys", stack.gateway_url()))
        .bearer_auth(token)
        .timeout(Duration::from_secs(10))
        .json(&json!({"name": name}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().await.map_err(|e| e.to_string())?;
    Ok(Reply {
        status,
        headers,
        body,
    })
}

#[tokio::test]
async fn companion_stopped_during_traffic_cached_pass_uncached_503_then_recovery() {
    let _serial = serial().await;
    let stack = stack();
    let cached = stack.mint_key_plain("alice-token", "cached").await.unwrap();
    let uncached = stack
        .mint_key_plain("alice-token", "uncached")
        .await
        .unwrap();
    assert_eq!(call(stack, &cached, "rf-warm").await.status, 200);
    assert_eq!(call(stack, "bob-token", "rf-warm").await.status, 200);

    // Traffic with the cached key and the cached token while the companion goes away.
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let answered_in_task = answered.clone();
    let traffic = tokio::spawn(async move {
        let s = self::stack();
        let mut statuses = Vec::new();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(4) && statuses.len() < 3000 {
            statuses.push(call(s, &cached, "rf-traffic").await.status);
            statuses.push(call(s, "bob-token", "rf-traffic").await.status);
            answered_in_task.store(statuses.len(), std::sync::atomic::Ordering::Relaxed);
        }
        statuses
    });
    // The traffic is flowing before the companion goes.
    eventually(Duration::from_secs(10), || async {
        answered.load(std::sync::atomic::Ordering::Relaxed) >= 2
    })
    .await
    .expect("the traffic never started");
    stack.stop_companion();
    let mut uncached_statuses = Vec::new();
    for _ in 0..5 {
        for cred in [uncached.as_str(), "fresh-token"] {
            let r = call(stack, cred, "rf-uncached").await;
            let e = r.error(503);
            assert!(e["code"].is_string(), "{}", r.body);
            uncached_statuses.push(r.status);
        }
        // Deliberate: the probes are spread over the outage (about a second).
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let statuses = traffic.await.unwrap();
    assert!(statuses.len() >= 4, "too little traffic: {statuses:?}");
    let not_ok: Vec<_> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(
        not_ok.is_empty(),
        "cached credentials failed while the companion was down: {not_ok:?} of {}",
        statuses.len()
    );
    assert!(
        stack.sim_requests_with_test_id("rf-uncached").is_empty(),
        "an uncached credential reached the model while the companion was down"
    );

    stack.start_companion().expect("companion restarts");
    let took = eventually(Duration::from_secs(15), || async {
        call(stack, &uncached, "rf-recover").await.status == 200
            && call(stack, "fresh-token", "rf-recover").await.status == 200
    })
    .await
    .expect("uncached credentials never worked again after the companion came back");
    eprintln!(
        "companion down: {} cached calls all 200, {} uncached calls all 503; recovered after {took:?}",
        statuses.len(),
        uncached_statuses.len()
    );
    stack.check_alive().unwrap();
}

#[tokio::test]
async fn postgres_stopped_ready_fails_503_json_and_keys_survive_restart() {
    let _serial = serial().await;
    let stack = stack();
    let mut keys = Vec::new();
    for i in 0..5 {
        keys.push(
            stack
                .mint_key_plain("pg-token", &format!("pg-{i}"))
                .await
                .unwrap(),
        );
    }
    let ready = |s: &'static Stack| async move {
        client()
            .get(format!("{}/ready", s.companion_public_url()))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    assert_eq!(ready(stack).await, 200);

    stack.stop_postgres();
    let down = eventually(Duration::from_secs(10), || async {
        ready(stack).await != 200
    })
    .await;
    assert!(down.is_some(), "/ready stayed 200 with PostgreSQL stopped");
    // A key the companion has not seen (its own cache is per key): authenticate cannot decide.
    let r = authenticate(stack, &keys[4]).await;
    assert_eq!(
        r.status, 503,
        "authenticate with the database down: {}",
        r.body
    );
    assert!(r.json()["error"]["message"].is_string(), "{}", r.body);
    // Through the gateway the filter answers 503 too (never a pass).
    let r = call(stack, &keys[4], "pg-down").await;
    r.error(503);
    assert!(stack.sim_requests_with_test_id("pg-down").is_empty());
    // Minting answers 503 JSON.
    let r = try_mint(stack, "pg-token", "while-down").await.unwrap();
    let e = r.error(503);
    assert!(e["message"].is_string());

    stack.start_postgres().expect("postgres restarts");
    let up = eventually(Duration::from_secs(30), || async {
        ready(stack).await == 200
    })
    .await
    .expect("/ready never came back after PostgreSQL restarted");
    // Every key minted before is there and works (directly and through the gateway).
    let works = eventually(Duration::from_secs(15), || async {
        authenticate(stack, &keys[0]).await.status == 200
    })
    .await;
    assert!(works.is_some(), "authenticate never recovered");
    for (i, key) in keys.iter().enumerate() {
        let r = authenticate(stack, key).await;
        assert_eq!(r.status, 200, "key {i}: {}", r.body);
        assert_eq!(r.json()["subject"], "pguser");
        let r = call(stack, key, "pg-after").await;
        assert_eq!(r.status, 200, "key {i} through the gateway: {}", r.body);
    }
    // And minting works again.
    let r = try_mint(stack, "pg-token", "after").await.unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    eprintln!("postgres down: /ready failed after {down:?}; back after {up:?}; 5/5 keys work");
    stack.check_alive().unwrap();
}

#[tokio::test]
async fn companion_restarted_while_minting_every_201_is_a_working_key() {
    let _serial = serial().await;
    minting_through_a_restart(false).await;
}

#[tokio::test]
async fn companion_killed_while_minting_every_201_is_a_working_key() {
    let _serial = serial().await;
    minting_through_a_restart(true).await;
}

/// The pid of the process listening on `port` (from /proc/net/tcp and /proc/*/fd).
fn pid_listening_on(port: u16) -> Option<i32> {
    let mut inodes = Vec::new();
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let f: Vec<&str> = line.split_whitespace().collect();
            let p = f
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if f.len() > 9 && f[3] == "0A" && p == Some(port) {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(t) = std::fs::read_link(fd.path())
                && inodes.iter().any(|i| t.to_str() == Some(i.as_str()))
            {
                return Some(pid);
            }
        }
    }
    None
}

/// Mints keys from 3 clients (bounded in count and time) while the companion is stopped
/// (SIGTERM, graceful) or killed (SIGKILL) and started again; every 201 must be a working key.
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn minting_through_a_restart(kill: bool) {
    let stack = stack();
    let tag = if kill { "k" } else { "t" };
    // Minting clients, bounded in count and time.
    let mut tasks = Vec::new();
    // Set when the companion is back: the clients go on for one more second after that.
    let back: &'static std::sync::Mutex<Option<Instant>> = Box::leak(Box::default());
    // Keys minted so far by all clients (the restart waits for minting to be under way).
    let minted_so_far: &'static std::sync::atomic::AtomicUsize = Box::leak(Box::default());
    for c in 0..3 {
        tasks.push(tokio::spawn(async move {
            let s = self::stack();
            let mut got = Vec::new();
            let mut refused = Vec::new();
            let start = Instant::now();
            let mut i = 0;
            let done = || {
                back.lock()
                    .unwrap()
                    .is_some_and(|t| t.elapsed() > Duration::from_secs(1))
            };
            while !done() && start.elapsed() < Duration::from_secs(30) && i < 2000 {
                i += 1;
                match try_mint(s, "minter-token", &format!("m-{tag}-{c}-{i}")).await {
                    Ok(r) if r.status == 201 => {
                        let v = r.json();
                        let key = v["key"].as_str().expect("201 has a key").to_string();
                        let id = v["id"].as_str().expect("201 has an id").to_string();
                        got.push((id, key));
                        minted_so_far.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(r) => refused.push(format!("{} {}", r.status, r.body)),
                    Err(e) => refused.push(e),
                }
                // Pacing (deliberate): a steady trickle of mints across the restart.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (got, refused)
        }));
    }
    eventually(Duration::from_secs(30), || async {
        minted_so_far.load(std::sync::atomic::Ordering::Relaxed) >= 3
    })
    .await
    .expect("the clients never minted before the restart");
    let s = stack;
    let companion_port: u16 = stack
        .companion_public_url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("companion port");
    tokio::task::spawn_blocking(move || {
        if kill {
            // The companion this test's stack started: killed without a chance to clean up.
            let pid = pid_listening_on(companion_port).expect("companion pid");
            // SAFETY: kill(2) on the pid of our own stack's companion.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
            // Gone when its port no longer accepts connections.
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect(("127.0.0.1", companion_port)).is_ok() {
                assert!(
                    Instant::now() < deadline,
                    "the killed companion still listens"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        s.stop_companion();
        // Deliberate: the companion stays away for a while, so the clients meet the outage.
        std::thread::sleep(Duration::from_millis(500));
        s.start_companion()
    })
    .await
    .unwrap()
    .expect("companion restarts");
    *back.lock().unwrap() = Some(Instant::now());
    let mut minted = Vec::new();
    let mut refused = Vec::new();
    for t in tasks {
        let (g, r) = t.await.unwrap();
        minted.extend(g);
        refused.extend(r);
    }
    assert!(minted.len() >= 3, "too few keys minted: {}", minted.len());
    for r in &refused {
        // A refusal is fine (the companion was away); a 2xx other than 201 or a 4xx is not.
        assert!(
            !r.starts_with('2') && !r.starts_with('4'),
            "unexpected answer while the companion restarted: {r}"
        );
    }
    for (id, key) in &minted {
        let r = authenticate(stack, key).await;
        assert_eq!(
            r.status, 200,
            "key {id} got a 201 but does not work: {}",
            r.body
        );
        let key_id = key
            .strip_prefix("sk-oai-")
            .and_then(|k| k.split_once('_'))
            .map(|(id, _)| id)
            .expect("key shape");
        assert_eq!(r.json()["key_id"], key_id, "key {id}");
    }
    // A sample through the gateway as well.
    for (id, key) in minted.iter().step_by((minted.len() / 5).max(1)) {
        let r = call(stack, key, "mint-restart").await;
        assert_eq!(r.status, 200, "key {id}: {}", r.body);
    }
    // No half-written key: the store holds at least every key the clients were given.
    let listed = send(
        client()
            .post(format!(
                "{}/maas-api/v1/api-keys/search",
                stack.gateway_url()
            ))
            .bearer_auth("minter-token")
            .json(&json!({"pagination": {"limit": 100, "offset": 0}})),
    )
    .await;
    assert_eq!(listed.status, 200, "{}", listed.body);
    // No key appears in a log.
    let logs = stack.logs_text();
    for (id, key) in &minted {
        let secret = key.split_once('_').map(|(_, s)| s).unwrap_or(key);
        assert!(!logs.contains(secret), "key {id} appears in a log");
    }
    eprintln!(
        "companion {} while minting: {} keys minted (all work), {} refused during the restart",
        if kill {
            "killed (SIGKILL)"
        } else {
            "restarted (SIGTERM)"
        },
        minted.len(),
        refused.len()
    );
    stack.check_alive().unwrap();
}

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} in {:?} ({})", r.headers, r.body))
        .parse()
        .unwrap()
}

/// Remaining tokens seen by a tiny probe before its own reservation (1 token), then its own
/// use (2 tokens) is settled after the response.
async fn probe(stack: &Stack) -> u64 {
    let body = json!({"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "p"}]});
    let r = chat(
        stack,
        CHAT,
        "uf-probe",
        &[
            ("authorization", "Bearer mia-token"),
            ("x-sim-completion-tokens", "1"),
        ],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "probe: {}", r.body);
    header_u64(&r, "x-ratelimit-remaining-tokens") + 1
}

/// Sends one faulty request and reads the whole answer as bytes (a dropped stream yields what
/// arrived before the drop).
async fn faulty(stack: &Stack, fault: &str, stream: bool) -> (u16, String, bool) {
    let mut body = json!({"model": "sim-model", "max_tokens": 1000,
                          "messages": [{"role": "user", "content": "one two three"}]});
    if stream {
        body["stream"] = json!(true);
    }
    let resp = client()
        .post(format!("{}{CHAT}", stack.gateway_url()))
        .header("authorization", "Bearer mia-token")
        .header("x-sim-fault", fault)
        .header("x-sim-completion-tokens", "5")
        .header("x-test-id", format!("uf-{fault}"))
        .json(&body)
        .send()
        .await
        .expect("the gateway answers");
    let status = resp.status().as_u16();
    let mut s = resp.bytes_stream();
    let mut bytes = Vec::new();
    let mut broken = false;
    while let Some(chunk) = s.next().await {
        match chunk {
            Ok(c) => bytes.extend_from_slice(&c),
            Err(_) => {
                broken = true;
                break;
            }
        }
    }
    (status, String::from_utf8_lossy(&bytes).into_owned(), broken)
}

fn data_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

#[tokio::test]
async fn upstream_faults_reach_the_client_the_filter_survives_and_settles() {
    let _serial = serial().await;
    let stack = stack();
    let mut before = probe(stack).await;
    let mut figures = Vec::new();
    // (fault, stream, charge bound): what the settled charge may be for a reservation of 1000
    // completion tokens plus the prompt estimate (a few tokens) whose real use is 3 prompt + 5
    // completion tokens.
    let cases: [(&str, bool, std::ops::RangeInclusive<u64>); 7] = [
        // An upstream error uses nothing.
        ("status-500", false, 0..=0),
        // Usage unreadable in a 200 JSON body: the reservation is charged (bounded by it).
        ("not-json", false, 0..=1010),
        ("no-usage", false, 0..=1010),
        // Streams are settled from what streamed: far below the reservation.
        ("drop-mid-stream", true, 1..=100),
        ("no-usage", true, 1..=100),
        // Without [DONE] the usage chunk still came: exactly 8.
        ("no-done", true, 8..=8),
        // A 500 on a stream request: nothing.
        ("status-500", true, 0..=0),
    ];
    for (fault, stream, bound) in cases {
        let (status, body, broken) = faulty(stack, fault, stream).await;
        match (fault, stream) {
            ("status-500", _) => {
                assert_eq!(status, 500, "{body}");
                let v: Value = serde_json::from_str(&body).expect("the upstream's JSON error");
                assert_eq!(v["error"]["message"], "simulated failure", "{body}");
            }
            ("not-json", _) => {
                assert_eq!(status, 200);
                assert_eq!(
                    body, "this is not json {",
                    "the client gets what the upstream sent"
                );
            }
            ("no-usage", false) => {
                assert_eq!(status, 200);
                let v: Value = serde_json::from_str(&body).unwrap();
                assert!(v.get("usage").is_none(), "{body}");
                assert_eq!(
                    v["choices"][0]["message"]["content"],
                    "tok0 tok1 tok2 tok3 tok4"
                );
            }
            ("drop-mid-stream", _) => {
                assert_eq!(status, 200);
                let events = data_events(&body);
                assert!(
                    !events.is_empty(),
                    "nothing arrived before the drop: {body}"
                );
                assert!(
                    !events.iter().any(|e| e == "[DONE]"),
                    "a dropped stream must not look complete: {body}"
                );
                eprintln!(
                    "drop-mid-stream: {} events, client saw error: {broken}",
                    events.len()
                );
            }
            ("no-usage", true) => {
                assert_eq!(status, 200);
                let events = data_events(&body);
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
                assert!(!broken);
            }
            ("no-done", true) => {
                assert_eq!(status, 200);
                let events = data_events(&body);
                assert!(!events.is_empty());
                assert!(!events.iter().any(|e| e == "[DONE]"), "{body}");
                assert!(!broken);
            }
            _ => unreachable!(),
        }
        // The filter is alive and the reservation settled: the next request sees it (each
        // probe itself uses 2, settled before the next one reads).
        let mut charged = u64::MAX;
        for k in 1..=20u64 {
            let now = probe(stack).await;
            charged = before.saturating_sub(now).saturating_sub(2 * k);
            if bound.contains(&charged) {
                before = now;
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(
            bound.contains(&charged),
            "{fault} (stream {stream}): charged {charged}, expected {bound:?}: reservation not settled"
        );
        figures.push(format!(
            "{fault}/{}={charged}",
            if stream { "sse" } else { "json" }
        ));
    }
    // Envoy and the filter are still there; no wasm failure in Envoy's log.
    stack.check_alive().unwrap();
    let log = stack.logs_text();
    for bad in ["panicked", "wasm trap", "Function: proxy_on", "unreachable"] {
        assert!(
            !log.contains(bad),
            "Envoy log shows a filter failure: {bad}"
        );
    }
    assert_eq!(call(stack, "alice-token", "uf-after").await.status, 200);
    eprintln!("upstream faults survived and settled: {figures:?}");
}
