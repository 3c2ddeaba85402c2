//! The `maas-companion` binary: command line validation, the start log line, SIGTERM.

use crate::helpers::{IDENTITIES, create_database, internal_pki, local_policy};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_maas-companion");

#[test]
fn invalid_configuration_exits_with_a_message_naming_the_flag() {
    let out = Command::new(BIN)
        .env_clear()
        .args(["--database-url", "postgres://x@127.0.0.1:1/db"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--policy-file"), "{stderr}");

    let out = Command::new(BIN)
        .env_clear()
        .env("DATABASE_URL", "postgres://user:hunter2@127.0.0.1:1/db")
        .env("MAAS_POLICY_FILE", "/nonexistent/policy.yaml")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--policy-file /nonexistent/policy.yaml"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "password leaked: {stderr}");
}

/// The internal listener's caller check is on unless turned off: without its CA the binary
/// does not start, and says which flag (exit 2); with a CA file that holds no certificate it
/// stops before listening, naming the flag and the file (exit 1).
#[test]
fn the_binary_refuses_to_start_without_a_usable_internal_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, local_policy()).unwrap();
    let ids = dir.path().join("ids.yaml");
    std::fs::write(&ids, IDENTITIES).unwrap();
    let creds = dir.path().join("creds.yaml");
    std::fs::write(&creds, "credentials: {}\n").unwrap();
    let run = |envs: &[(&str, String)]| {
        Command::new(BIN)
            .env_clear()
            .env("DATABASE_URL", "postgres://x@127.0.0.1:1/db")
            .env("MAAS_POLICY_FILE", &policy)
            .env("MAAS_IDENTITY_PROVIDER", "static")
            .env("MAAS_IDENTITIES_FILE", &ids)
            .env("MAAS_CREDENTIALS_SOURCE", "file")
            .env("MAAS_CREDENTIALS_FILE", &creds)
            .env("MAAS_PUBLIC_ADDR", "127.0.0.1:0")
            .env("MAAS_INTERNAL_ADDR", "127.0.0.1:0")
            .env("MAAS_METRICS_ADDR", "127.0.0.1:0")
            .envs(envs.iter().map(|(k, v)| (*k, v)))
            .output()
            .unwrap()
    };
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--internal-client-ca (MAAS_INTERNAL_CLIENT_CA) is required"),
        "{stderr}"
    );

    let garbage = dir.path().join("ca.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let mut env = internal_pki().env();
    env.retain(|(k, _)| *k != "MAAS_INTERNAL_CLIENT_CA");
    env.push(("MAAS_INTERNAL_CLIENT_CA", garbage.display().to_string()));
    let out = run(&env);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "cannot start: --internal-client-ca {}:",
            garbage.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("listening"), "{stderr}");
}

/// The binary, started on free ports with the local policy and identities and JSON logs on
/// stderr (every line kept in `lines`).
struct Started {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    public: String,
    internal: String,
    metrics: String,
    _dir: tempfile::TempDir,
}

async fn start_binary(env: &[(&str, &str)]) -> Started {
    let database_url = create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    let ids = dir.path().join("ids.yaml");
    let creds = dir.path().join("creds.yaml");
    std::fs::write(&policy, local_policy()).unwrap();
    std::fs::write(&ids, IDENTITIES).unwrap();
    std::fs::write(&creds, "credentials: {}\n").unwrap();
    let mut command = Command::new(BIN);
    command
        .env_clear()
        .env("RUST_LOG", "info")
        .env("MAAS_LOG_FORMAT", "json")
        .env("DATABASE_URL", &database_url)
        .env("MAAS_PUBLIC_ADDR", "127.0.0.1:0")
        .env("MAAS_INTERNAL_ADDR", "127.0.0.1:0")
        .env("MAAS_METRICS_ADDR", "127.0.0.1:0")
        .envs(internal_pki().env());
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command
        .args(["--policy-file", policy.to_str().unwrap()])
        .args([
            "--identity-provider",
            "static",
            "--identities-file",
            ids.to_str().unwrap(),
        ])
        .args([
            "--credentials-source",
            "file",
            "--credentials-file",
            creds.to_str().unwrap(),
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
    let deadline = Instant::now() + Duration::from_secs(30);
    let (public, internal, metrics) = loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("no 'listening' line");
        let Ok(entry) = serde_json::from_str::<serde_json::Value>(&line) else {
            panic!("not a JSON log line: {line}");
        };
        let message = entry["fields"]["message"].as_str().unwrap_or_default();
        if let Some(rest) = message.split("listening public=").nth(1) {
            let (public, rest) = rest.split_once(" internal=").unwrap();
            let (internal, metrics) = rest.split_once(" metrics=").unwrap();
            break (
                public.trim().to_string(),
                internal.trim().to_string(),
                metrics.trim().to_string(),
            );
        }
    };
    Started {
        child,
        lines: rx,
        public,
        internal,
        metrics,
        _dir: dir,
    }
}

impl Started {
    /// SIGTERM; waits for exit 0; answers every log line not read yet.
    fn stop(mut self) -> Vec<String> {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(status.success(), "{status}");
        // The reader thread ends with the pipe: every line is in.
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        lines
    }
}

#[tokio::test]
async fn starts_logs_its_addresses_and_stops_on_sigterm() {
    let started = start_binary(&[]).await;
    let (public, internal, metrics) = (
        started.public.clone(),
        started.internal.clone(),
        started.metrics.clone(),
    );
    let health = reqwest::get(format!("http://{public}/health"))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let auth = internal_pki()
        .gateway_client()
        .post(format!("https://{internal}/internal/v1/authenticate"))
        .json(&serde_json::json!({"credential": "alice-token"}))
        .send()
        .await
        .unwrap();
    assert_eq!(auth.status(), 200);
    let scrape = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .unwrap();
    assert_eq!(scrape.status(), 200);
    assert!(
        scrape
            .text()
            .await
            .unwrap()
            .contains("maas_authenticate_total")
    );

    let rest = started.stop();
    // Nothing in the log carries a credential.
    assert!(!rest.iter().any(|l| l.contains("alice-token")));
}

/// `GET /v1/usage` with times chrono takes but PostgreSQL's timestamptz cannot hold: a 400
/// naming the parameter, and no ERROR line (it was a 500 and one ERROR per request).
#[tokio::test]
async fn usage_times_beyond_the_ledger_are_a_400_naming_them_and_log_no_error() {
    let started = start_binary(&[]).await;
    let http = reqwest::Client::new();
    for (query, param) in [
        ("from=-8000000000000&to=-7999990000000", "to"),
        ("from=-8000000000000", "from"),
        ("from=2026-12-01&to=8000000000000", "to"),
        ("from=-62135596801&to=2026-12-01", "from"),
    ] {
        let r = http
            .get(format!("http://{}/v1/usage?{query}", started.public))
            .bearer_auth("alice-token")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{query}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["param"], param, "{query}: {body}");
        assert_eq!(body["error"]["code"], "invalid_parameter", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("0001-01-01"), "{message}");
    }
    let lines = started.stop();
    let errors: Vec<&String> = lines
        .iter()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .map(|e| e["level"] == "ERROR")
                .unwrap_or(true)
        })
        .collect();
    assert!(errors.is_empty(), "ERROR lines: {errors:?}");
}

#[tokio::test]
async fn a_listener_that_cannot_serve_makes_the_process_exit_non_zero() {
    exits_non_zero_when_its_address_is_taken("internal").await;
}

#[tokio::test]
async fn a_metrics_listener_that_cannot_serve_makes_the_process_exit_non_zero() {
    exits_non_zero_when_its_address_is_taken("metrics").await;
}

/// Starts the binary with the `listener`'s address already held by someone else.
async fn exits_non_zero_when_its_address_is_taken(listener: &str) {
    let database_url = create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    let ids = dir.path().join("ids.yaml");
    let creds = dir.path().join("creds.yaml");
    std::fs::write(&policy, local_policy()).unwrap();
    std::fs::write(&ids, IDENTITIES).unwrap();
    std::fs::write(&creds, "credentials: {}\n").unwrap();
    // Something else already holds the listener's address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let addr = |which: &str| {
        if which == listener {
            taken_addr.clone()
        } else {
            "127.0.0.1:0".to_string()
        }
    };
    let mut child = Command::new(BIN)
        .env_clear()
        .env("RUST_LOG", "info")
        .env("DATABASE_URL", &database_url)
        .env("MAAS_PUBLIC_ADDR", addr("public"))
        .env("MAAS_INTERNAL_ADDR", addr("internal"))
        .env("MAAS_METRICS_ADDR", addr("metrics"))
        .envs(internal_pki().env())
        .args(["--policy-file", policy.to_str().unwrap()])
        .args([
            "--identity-provider",
            "static",
            "--identities-file",
            ids.to_str().unwrap(),
        ])
        .args([
            "--credentials-source",
            "file",
            "--credentials-file",
            creds.to_str().unwrap(),
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kept running without its {listener} listener");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{listener} address {taken_addr}")),
        "the message names the listener and its address: {stderr}"
    );
    drop(taken);
}

/// What a user does through the key API, then every line the binary logged: with the default
/// (`--log-user-names hmac`) no line names the user, the key's lines name its pseudonym (the
/// keyed HMAC of the name with the key file's key); with `clear` the name is there.
async fn key_api_logs(env: &[(&str, &str)]) -> Vec<String> {
    let started = start_binary(env).await;
    let http = reqwest::Client::new();
    let base = format!("http://{}", started.public);
    let minted: serde_json::Value = http
        .post(format!("{base}/v1/api-keys"))
        .bearer_auth("alice-token")
        .json(&serde_json::json!({"name": "logged"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = minted["id"].as_str().unwrap().to_string();
    let revoked = http
        .delete(format!("{base}/v1/api-keys/{id}"))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap();
    assert_eq!(revoked.status(), 200);
    // carol (an admin) revokes alice's keys in bulk.
    let bulk = http
        .post(format!("{base}/v1/api-keys/bulk-revoke"))
        .bearer_auth("carol-token")
        .json(&serde_json::json!({"username": "alice"}))
        .send()
        .await
        .unwrap();
    assert!(bulk.status().is_success(), "{}", bulk.status());
    let mut lines = Vec::new();
    lines.extend(started.stop());
    lines
}

#[tokio::test]
async fn logs_name_users_by_keyed_pseudonym_unless_clear_names_are_asked() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("pseudonym.key");
    let key = "k".repeat(40);
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let lines = key_api_logs(&[("MAAS_LOG_PSEUDONYM_KEY_FILE", key_file.to_str().unwrap())]).await;
    let all = lines.join("\n");
    assert!(all.contains("API key minted"), "{all}");
    for name in ["alice", "carol"] {
        assert!(!all.contains(name), "{name} in the logs: {all}");
        let p = maas_companion::pseudonym::pseudonym(key.as_bytes(), name);
        assert!(
            all.contains(&p),
            "{name}'s pseudonym {p} not in the logs: {all}"
        );
    }

    let clear = key_api_logs(&[("MAAS_LOG_USER_NAMES", "clear")])
        .await
        .join("\n");
    assert!(clear.contains("\"user\":\"alice\""), "{clear}");
}

/// The authenticate answer names its subject by the keyed pseudonym of the key file's key, even
/// when the logs are set to clear names (telemetry never gets the name).
#[tokio::test]
async fn the_authenticate_answer_carries_the_keyed_pseudonym_even_with_clear_log_names() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("pseudonym.key");
    let key = "q".repeat(32);
    std::fs::write(&key_file, &key).unwrap();
    let started = start_binary(&[
        ("MAAS_LOG_USER_NAMES", "clear"),
        ("MAAS_LOG_PSEUDONYM_KEY_FILE", key_file.to_str().unwrap()),
    ])
    .await;
    let answer: serde_json::Value = internal_pki()
        .gateway_client()
        .post(format!(
            "https://{}/internal/v1/authenticate",
            started.internal
        ))
        .json(&serde_json::json!({"credential": "alice-token"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["subject"], "alice");
    assert_eq!(
        answer["pseudonym"],
        maas_companion::pseudonym::pseudonym(key.as_bytes(), "alice")
    );
    started.stop();
}
