//! Helpers shared by the e2e modules: a stack per module with the module's own policy and
//! identities, metrics from Envoy's admin, and request shorthands.

#![allow(dead_code)]

use maas_e2e::{Stack, StackOptions};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub use maas_e2e::module_stack::ModuleStack;

/// The module's stack with this policy and identities: started when its first test asks (again
/// after it stopped), stopped once the module's tests are done (see [`ModuleStack`]).
#[track_caller]
pub fn stack_with(
    cell: &'static ModuleStack<Stack>,
    policy: &'static str,
    identities: &'static str,
    credentials: &'static str,
) -> &'static Stack {
    stack_with_plugin_config(cell, policy, identities, credentials, None)
}

/// As [`stack_with`], with extra pluginConfig merged over the stack's.
#[track_caller]
pub fn stack_with_plugin_config(
    cell: &'static ModuleStack<Stack>,
    policy: &'static str,
    identities: &'static str,
    credentials: &'static str,
    plugin_config_extra: Option<Value>,
) -> &'static Stack {
    cell.get_or_start(|| start_stack(policy, identities, credentials, plugin_config_extra))
}

/// Starts a stack with this policy and identities on a thread of its own (not on the calling
/// test's async runtime).
pub fn start_stack(
    policy: &'static str,
    identities: &'static str,
    credentials: &'static str,
    plugin_config_extra: Option<Value>,
) -> Result<Stack, String> {
    std::thread::spawn(move || {
        let mut options = StackOptions::default()
            .with_policy_yaml(policy)
            .with_identities_yaml(identities)
            .with_credentials_yaml(credentials);
        options.plugin_config_extra = plugin_config_extra;
        Stack::start(options).map_err(|e| format!("{e:#}"))
    })
    .join()
    .unwrap_or_else(|_| Err("stack start panicked".into()))
}

/// A wasm custom metric's value (`wasmcustom.<name>` in /stats) once what happened before the
/// call has been handed to Envoy, 0 when not defined yet. For a snapshot whose right value is
/// not known in advance (e.g. "unchanged since"); to wait for a known value, poll
/// [`metric_now`] with [`eventually`] instead.
pub async fn metric(stack: &Stack, name: &str) -> u64 {
    // The filter hands counters to Envoy once per tick (200 ms): waiting out two ticks is what
    // makes this a snapshot of everything before the call (no condition to poll for).
    tokio::time::sleep(Duration::from_millis(450)).await;
    metric_now(stack, name).await
}

/// Envoy's `/stats` lines of the filter's metrics (`wasmcustom.…`) at this admin URL; empty when
/// Envoy does not answer.
pub async fn wasm_stats(admin_url: &str) -> String {
    match client()
        .get(format!("{admin_url}/stats?filter=wasmcustom"))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// An unlabelled metric's value in `/stats` text (`wasmcustom.<name>: N`), 0 when not defined.
pub fn stat_value(stats: &str, name: &str) -> u64 {
    let wanted = format!("wasmcustom.{name}: ");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&wanted))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A wasm custom metric's value in Envoy right now (the filter's last tick), 0 when not defined.
pub async fn metric_now(stack: &Stack, name: &str) -> u64 {
    stat_value(&wasm_stats(&stack.envoy_admin_url()).await, name)
}

/// A labelled family of the filter (`maas_requests_total`, …) summed over the series whose
/// labels include `with`, as Envoy holds it right now. `/stats` prints a series with its labels
/// in the name (`wasmcustom.decision=.=allowed;.;model=.=m;.;maas_requests_total: 3`).
pub async fn labelled_now(stack: &Stack, family: &str, with: &[(&str, &str)]) -> u64 {
    labelled_sum(&wasm_stats(&stack.envoy_admin_url()).await, family, with)
}

/// [`labelled_now`] once what happened before the call has been handed to Envoy (see [`metric`]).
pub async fn labelled(stack: &Stack, family: &str, with: &[(&str, &str)]) -> u64 {
    tokio::time::sleep(Duration::from_millis(450)).await;
    labelled_now(stack, family, with).await
}

/// Sums the counters of `/stats` text that belong to `family` with the labels `with`.
pub fn labelled_sum(stats: &str, family: &str, with: &[(&str, &str)]) -> u64 {
    stats
        .lines()
        .filter_map(|l| l.strip_prefix("wasmcustom."))
        .filter_map(|l| l.rsplit_once(": "))
        .filter_map(|(name, value)| {
            let mut rest = name;
            let mut labels = Vec::new();
            while let Some((pair, tail)) = rest.split_once(";.;") {
                labels.push(pair.split_once("=.=")?);
                rest = tail;
            }
            let wanted = rest == family
                && with
                    .iter()
                    .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v));
            wanted.then(|| value.trim().parse::<u64>().ok()).flatten()
        })
        .sum()
}

/// Polls `check` until true or `timeout` passes; returns how long it took.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < timeout {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Status, headers and body of a response.
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// Asserts an OpenAI-style error with this status and returns the error object.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        assert!(v["error"]["message"].is_string(), "{}", self.body);
        assert!(v["error"]["type"].is_string(), "{}", self.body);
        v["error"].clone()
    }
}

pub async fn send(req: reqwest::RequestBuilder) -> Reply {
    let resp = req.send().await.expect("gateway answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().await.unwrap_or_default();
    Reply {
        status,
        headers,
        body,
    }
}

/// POST a chat completion for `model` at `path` with these headers.
pub async fn chat(
    stack: &Stack,
    path: &str,
    test_id: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> Reply {
    let mut req = client()
        .post(format!("{}{path}", stack.gateway_url()))
        .header("x-test-id", test_id)
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    send(req).await
}

pub fn bearer(cred: &str) -> String {
    format!("Bearer {cred}")
}

/// A client for the current test's runtime (a pooled connection must not outlive its runtime,
/// and each #[tokio::test] has its own).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("reqwest client")
}

/// Sends `method path` as written (no client-side normalisation of `..` or `//`) and returns
/// the status.
pub fn raw_status(stack: &Stack, method: &str, path: &str) -> u16 {
    maas_e2e::stack::http_request(stack.gateway_addr(), method, path, Duration::from_secs(5))
        .map(|(s, _)| s)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Sends one HTTP/1.1 request exactly as written (no client-side normalisation of `..`, `//` or
/// encodings), with these headers, a JSON `body` and `Connection: close`; returns the status
/// (0 when the answer has no status line). Fails when nothing answers.
pub fn raw_json_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    write!(
        s,
        "{head}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    Ok(String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0))
}

/// Credential validations the companion has answered (`maas_authenticate_total`, all results):
/// the ground truth for how many callouts the filter made.
pub async fn companion_validations(stack: &Stack) -> u64 {
    let text = client()
        .get(format!("{}/metrics", stack.companion_metrics_url()))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .expect("companion /metrics answers")
        .text()
        .await
        .unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("maas_authenticate_total"))
        .filter_map(|l| l.rsplit(' ').next())
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The usage events of `model`, once there are `n` (never more).
pub async fn events_of(stack: &Stack, model: &str, n: usize) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(stack.usage_events_path()).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .filter(|l: &Value| l["event"]["model"] == model)
            .collect();
        if lines.len() >= n {
            // Late duplicates would show after a moment.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let again = std::fs::read_to_string(stack.usage_events_path()).unwrap_or_default();
            let count = again
                .lines()
                .filter(|l| l.contains(&format!("\"model\":\"{model}\"")))
                .count();
            assert_eq!(count, n, "one usage event per request of {model}:\n{again}");
            return lines;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} of {n} usage events of {model}:\n{text}",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `cred`'s `GET /v1/usage?groupBy=backend` rows of `model` as `backend →
/// requests`, once they add up to `n` (a report interval or two after the calls; never more).
pub async fn ledger_by_backend(
    stack: &Stack,
    cred: &str,
    model: &str,
    n: usize,
) -> BTreeMap<String, usize> {
    let start = Instant::now();
    loop {
        let r = send(
            client()
                .get(format!(
                    "{}/maas-api/v1/usage?groupBy=backend",
                    stack.gateway_url()
                ))
                .bearer_auth(cred),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["groupBy"], "backend", "{v}");
        let mut rows: BTreeMap<String, usize> = BTreeMap::new();
        for row in v["data"].as_array().cloned().unwrap_or_default() {
            if row["model"] == model {
                let backend = row["backend"].as_str().expect("a backend").to_string();
                let requests = row["requests"].as_u64().unwrap_or(0);
                *rows.entry(backend).or_default() += usize::try_from(requests).unwrap_or(0);
            }
        }
        let total: usize = rows.values().sum();
        assert!(
            total <= n,
            "{model}: the ledger counts more than {n}: {rows:?}"
        );
        if total == n {
            return rows;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{model}: the ledger shows {rows:?}, not {n} requests"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The model the replicated-limit modules call (pools, money budgets, scopes).
pub const SIM_CHAT: &str = "/llm/sim-model/v1/chat/completions";

/// A stack of `replicas` Envoys, each with its own companion, sharing one Redis and
/// PostgreSQL (`plugin_config_extra` merged over each Envoy's pluginConfig), started off the
/// test's runtime.
pub async fn start_replicated(
    policy: &'static str,
    identities: &'static str,
    replicas: usize,
    plugin_config_extra: Option<Value>,
) -> std::sync::Arc<Stack> {
    let stack = tokio::task::spawn_blocking(move || {
        let mut options = StackOptions::default()
            .with_policy_yaml(policy)
            .with_identities_yaml(identities)
            .with_credentials_yaml("credentials: {}\n")
            .with_replicas(replicas);
        options.plugin_config_extra = plugin_config_extra;
        Stack::start(options)
    })
    .await
    .expect("stack start did not panic")
    .unwrap_or_else(|e| panic!("stack did not start: {e:#}"));
    assert!(stack.has_redis());
    std::sync::Arc::new(stack)
}

/// A key named `name` of `token`'s user, bound to `subscription`.
pub async fn subscription_key(
    stack: &Stack,
    token: &str,
    subscription: &str,
    name: &str,
) -> String {
    let v = stack
        .mint_key(
            token,
            serde_json::json!({"name": name, "subscription": subscription}),
        )
        .await
        .expect("minted");
    assert_eq!(v["subscription"], subscription, "{v}");
    v["key"].as_str().expect("key").to_string()
}

/// A chat to [`SIM_CHAT`] on replica `replica` with `cred`, capped at `max_tokens`.
pub async fn sim_chat_at(stack: &Stack, replica: usize, cred: &str, max_tokens: u64) -> Reply {
    send(
        client()
            .post(format!("{}{SIM_CHAT}", stack.gateway_url_of(replica)))
            .bearer_auth(cred)
            .json(
                &serde_json::json!({"model": "sim-model", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": "hi"}]}),
            ),
    )
    .await
}

/// The companion's `GET /v1/quota` as `cred`.
pub async fn quota_of(stack: &Stack, cred: &str) -> Value {
    client()
        .get(format!("{}/v1/quota", stack.companion_public_url()))
        .bearer_auth(cred)
        .send()
        .await
        .expect("quota")
        .json()
        .await
        .expect("quota json")
}

/// What concurrent clients (`tasks`, each answering its user's index and how many it got
/// admitted) were admitted, per user.
pub async fn admitted_per_user(tasks: Vec<tokio::task::JoinHandle<(usize, u64)>>) -> [u64; 3] {
    let mut per_user = [0u64; 3];
    for t in tasks {
        let (user, ok) = t.await.expect("client task");
        if let Some(slot) = per_user.get_mut(user) {
            *slot += ok;
        }
    }
    per_user
}

/// What a replica leased and did not use goes back when it idles: the rest of a shared limit
/// is then usable from any replica. Sends one request every 250 ms (the replicas and `keys` in
/// turn) until `total` reaches `limit` or 20 s pass (an idle lease goes back in about 4 s; the
/// whole suite on 2 cores once took longer than 10 s); `admitted` judges each answer (and checks
/// a refusal's reason). Returns the new total.
pub async fn admit_the_rest(
    stack: &Stack,
    replicas: usize,
    keys: &[String],
    mut total: u64,
    limit: u64,
    admitted: impl Fn(&Reply) -> bool,
) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    while total < limit && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let key = keys.get(i % keys.len()).expect("a key");
        if admitted(&sim_chat_at(stack, i % replicas, key, 8).await) {
            total += 1;
        }
        i += 1;
    }
    total
}
