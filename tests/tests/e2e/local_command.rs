//! The `maas-local` command (what ./scripts/run-local.sh runs): prints READY and next steps that
//! work, and leaves no process behind after Ctrl-C (SIGINT) or even after being killed.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

struct Started {
    child: KillOnDrop,
    gateway: String,
    /// Every URL of the READY line (the first is `gateway`).
    gateways: Vec<String>,
    stack_dir: String,
    /// The `Internal API:` line's URL.
    internal: String,
    /// The `OpenAI base URL:` line's URL, and whether it came before the path-prefix URLs.
    one_base_url: String,
    one_base_url_first: bool,
    /// The `Prometheus:` line's URL (with --observability).
    prometheus: Option<String>,
    /// The `Usage events:` line's file.
    usage_events: String,
    output: mpsc::Receiver<String>,
}

/// SIGKILLs maas-local if the test panics first; its death signal then stops the stack.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for KillOnDrop {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free port P whose successor P+1 is free too (replica 1 of `--replicas 2` takes P+1).
fn free_port_pair() -> u16 {
    loop {
        let first = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// One maas-local at a time: two stacks starting together pick free ports concurrently and can
/// race for the same one.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts maas-local and reads its output until the next steps are printed.
fn start_local() -> Started {
    start_local_with(&[])
}

/// As [`start_local`], with extra arguments.
fn start_local_with(extra: &[&str]) -> Started {
    // Not inherited: a leaked process would hold the test runner's pipe open. Kept in a file so
    // a failed start says why.
    let stderr_path = std::env::temp_dir().join(format!("maas-local-test-{}.err", free_port()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_maas-local"))
        .args(["--port", &free_port_pair().to_string()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut gateways: Option<Vec<String>> = None;
    let mut stack_dir = None;
    let mut internal = None;
    let mut one_base_url: Option<String> = None;
    let mut one_base_url_first = false;
    let mut prometheus = None;
    let mut usage_events = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    while stack_dir.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).unwrap_or_else(|_| {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            panic!("maas-local printed no READY/Logs line in time; its stderr:\n{stderr}")
        });
        if let Some(urls) = line.strip_prefix("READY ") {
            gateways = Some(urls.split_whitespace().map(str::to_string).collect());
        }
        if let Some(url) = line.strip_prefix("OpenAI base URL: ") {
            one_base_url = Some(url.trim().to_string());
        }
        if line.starts_with("Path-prefix URLs") {
            one_base_url_first = one_base_url.is_some();
        }
        if let Some(rest) = line.strip_prefix("Usage events: ") {
            usage_events = rest.split(" (").next().map(str::to_string);
        }
        if let Some(url) = line.strip_prefix("Internal API: ") {
            internal = Some(url.trim().to_string());
        }
        if let Some(rest) = line.strip_prefix("Prometheus: ") {
            prometheus = rest.split_whitespace().next().map(str::to_string);
        }
        if let Some(dir) = line.strip_prefix("Logs: ") {
            stack_dir = Some(dir.trim().to_string());
        }
    }
    // Started: the file was only needed to explain a failed start.
    let _ = std::fs::remove_file(&stderr_path);
    let gateways = gateways.expect("READY line before Logs line");
    Started {
        child: KillOnDrop(child),
        gateway: gateways.first().expect("READY names a URL").clone(),
        gateways,
        stack_dir: stack_dir.unwrap(),
        internal: internal.expect("an Internal API line before the Logs line"),
        one_base_url: one_base_url.expect("an OpenAI base URL line before the Logs line"),
        one_base_url_first,
        prometheus,
        usage_events: usage_events.expect("a Usage events line before the Logs line"),
        output: rx,
    }
}

/// Pids of processes whose command line mentions `needle` (the stack's directory).
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// `(pid, program name)` of the processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<(u32, String)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid …`: the fields after the last ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = stat.rsplit_once(')')?.1.to_string();
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .filter_map(|pid| {
            // comm, not exe: Debian's redis-server is a link to redis-check-rdb.
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            Some((pid, comm.trim().to_string()))
        })
        .collect()
}

fn wait_gone(needle: &str, within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let left = processes_mentioning(needle);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn ready_next_steps_work_and_ctrl_c_leaves_nothing() {
    let _one = one_at_a_time();
    let mut started = start_local();
    assert!(
        processes_mentioning(&started.stack_dir).len() >= 3,
        "postgres, companion and envoy run from the stack dir"
    );
    // Where the usage events go: a file of the stack's, which Envoy opened.
    let events = std::path::Path::new(&started.usage_events);
    assert_eq!(
        events,
        std::path::Path::new(&started.stack_dir).join("usage-events.jsonl")
    );
    assert!(events.exists(), "{}", events.display());
    // The printed steps: mint with alice-token through the gateway, then call the model.
    let client = reqwest::blocking::Client::new();
    let minted: serde_json::Value = client
        .post(format!("{}/maas-api/v1/api-keys", started.gateway))
        .bearer_auth("alice-token")
        .json(&serde_json::json!({"name": "local-command"}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let key = minted["key"].as_str().expect("key minted");
    // The one base URL is printed first, and works; the model's path prefix too.
    assert_eq!(started.one_base_url, format!("{}/v1", started.gateway));
    assert!(
        started.one_base_url_first,
        "the one base URL before the path-prefix URLs"
    );
    for url in [
        format!("{}/chat/completions", started.one_base_url),
        format!("{}/llm/sim-model/v1/chat/completions", started.gateway),
    ] {
        let resp = client
            .post(&url)
            .bearer_auth(key)
            .json(&serde_json::json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .unwrap();
        assert_eq!(resp.status(), 200, "{url}");
    }

    // The internal API it prints refuses a caller without the gateway's certificate and
    // answers one with it (the files it names).
    let pki = std::path::Path::new(&started.stack_dir).join("internal-pki");
    let ca = std::fs::read(pki.join("ca.crt")).unwrap();
    let trusting = || {
        reqwest::blocking::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
    };
    let credentials = format!("{}/internal/v1/credentials", started.internal);
    assert!(
        started.internal.starts_with("https://"),
        "{}",
        started.internal
    );
    let refused = trusting().build().unwrap().get(&credentials).send();
    assert!(refused.is_err(), "no certificate: {refused:?}");
    let mut identity = std::fs::read(pki.join("gateway-client.crt")).unwrap();
    identity.extend(std::fs::read(pki.join("gateway-client.key")).unwrap());
    let admitted = trusting()
        .identity(reqwest::Identity::from_pem(&identity).unwrap())
        .build()
        .unwrap()
        .get(&credentials)
        .send()
        .unwrap();
    assert_eq!(admitted.status(), 200);

    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe { libc::kill(started.child.id() as libc::pid_t, libc::SIGINT) };
    let status = started.child.wait().unwrap();
    assert!(status.success(), "maas-local exit after Ctrl-C: {status}");
    let left = wait_gone(&started.stack_dir, Duration::from_secs(10));
    assert!(left.is_empty(), "processes left behind: {left:?}");
    assert!(
        !std::path::Path::new(&started.stack_dir).exists(),
        "stack dir removed"
    );
    drop(started.output);
}

/// `--replicas 2`: READY lists two gateway URLs (the first the default); a key minted through
/// one replica works through the other (one database), each replica has its own companion, and
/// the replicas share one Redis; Ctrl-C stops all of it.
#[test]
fn replicas_ready_lists_every_gateway_and_a_key_works_through_each() {
    let _one = one_at_a_time();
    let mut started = start_local_with(&["--replicas", "2"]);
    assert_eq!(started.gateways.len(), 2, "READY {:?}", started.gateways);
    assert_ne!(started.gateways[0], started.gateways[1]);
    let port = |url: &str| -> u16 { url.rsplit(':').next().unwrap().parse().unwrap() };
    let (first, second) = (port(&started.gateways[0]), port(&started.gateways[1]));
    // Replica 1 takes --port + 1 when free. The other e2e stacks run beside this one and bind
    // ephemeral ports, so + 1 may have been taken: then it must still be held by someone.
    assert!(
        second == first + 1
            || std::net::TcpListener::bind(("127.0.0.1", first.saturating_add(1))).is_err(),
        "replica 1 skipped a free --port + 1: {:?}",
        started.gateways
    );
    // maas-local's children, by program: one Redis, two companions, two Envoys.
    let children = children_of(started.child.id());
    let count = |name: &str| children.iter().filter(|(_, exe)| exe == name).count();
    assert_eq!(
        count("redis-server"),
        1,
        "one Redis for all replicas: {children:?}"
    );
    assert_eq!(
        count("maas-companion"),
        2,
        "a companion per replica: {children:?}"
    );
    assert_eq!(count("envoy"), 2, "an Envoy per replica: {children:?}");

    let client = reqwest::blocking::Client::new();
    let minted: serde_json::Value = client
        .post(format!("{}/maas-api/v1/api-keys", started.gateways[0]))
        .bearer_auth("alice-token")
        .json(&serde_json::json!({"name": "local-replicas"}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let key = minted["key"].as_str().expect("key minted");
    for gateway in &started.gateways {
        let resp = client
            .post(format!("{gateway}/llm/sim-model/v1/chat/completions"))
            .bearer_auth(key)
            .json(&serde_json::json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .unwrap();
        assert_eq!(resp.status(), 200, "through {gateway}");
    }

    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe { libc::kill(started.child.id() as libc::pid_t, libc::SIGINT) };
    let status = started.child.wait().unwrap();
    assert!(status.success(), "maas-local exit after Ctrl-C: {status}");
    let left = wait_gone(&started.stack_dir, Duration::from_secs(15));
    assert!(left.is_empty(), "processes left behind: {left:?}");
    let still: Vec<_> = children
        .iter()
        .filter(|(pid, _)| std::path::Path::new(&format!("/proc/{pid}")).exists())
        .collect();
    assert!(still.is_empty(), "children left behind: {still:?}");
    drop(started.output);
}

/// `--observability`: Prometheus starts beside the stack, prints its URL, scrapes the gateway
/// (the filter's labelled series appear after a call) with the shipped alert rules loaded, and
/// stops with the rest on Ctrl-C.
#[test]
fn observability_starts_prometheus_scraping_the_gateway() {
    let _one = one_at_a_time();
    let mut started = start_local_with(&["--observability"]);
    let prom = started.prometheus.clone().expect("a Prometheus: line");
    let client = reqwest::blocking::Client::new();
    let resp = client
        .post(format!("{}/v1/chat/completions", started.gateway))
        .bearer_auth("alice-token")
        .json(&serde_json::json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let query = |q: &str| -> serde_json::Value {
        client
            .get(format!("{prom}/api/v1/query"))
            .query(&[("query", q)])
            .send()
            .unwrap()
            .json()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = query(r#"sum(maas_requests_total{decision="allowed",model="sim-model"})"#);
        if r["data"]["result"][0]["value"][1] == "1" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never saw the call: {r}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let rules: serde_json::Value = client
        .get(format!("{prom}/api/v1/rules"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let names = rules.to_string();
    for alert in [
        "MaaSAuthFailureRateHigh",
        "MaaSGatewayLeaseFallback",
        "MaaSCompanionDown",
    ] {
        assert!(names.contains(alert), "{alert} not loaded: {rules}");
    }
    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe { libc::kill(started.child.id() as libc::pid_t, libc::SIGINT) };
    let status = started.child.wait().unwrap();
    assert!(status.success(), "maas-local exit after Ctrl-C: {status}");
    let left = wait_gone(&started.stack_dir, Duration::from_secs(15));
    assert!(left.is_empty(), "processes left behind: {left:?}");
    drop(started.output);
}

#[test]
fn killed_command_leaves_nothing() {
    let _one = one_at_a_time();
    let mut started = start_local();
    started.child.kill().unwrap(); // SIGKILL: no cleanup code runs, only the death signal.
    started.child.wait().unwrap();
    let left = wait_gone(&started.stack_dir, Duration::from_secs(15));
    assert!(
        left.is_empty(),
        "processes left behind after SIGKILL: {left:?}"
    );
    let _ = std::fs::remove_dir_all(&started.stack_dir);
}
