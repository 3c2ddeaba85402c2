//! HTTP/2 through the gateway (issue 10 item 2), and request trailers.
//!
//! Two Envoys are started from the stack's own bootstrap, in front of its companion and
//! simulator: one in the older mode (headers go on before the body is read: what an Istio
//! WasmPlugin gives) and one that holds the headers for the body (`pauseHeadersForBody` +
//! `allow_on_headers_stop_iteration`, the stack's and the cluster's default).
//! Both accept HTTP/2 with prior knowledge (h2c) and HTTP/1.1 on their plain listener
//! (`codec_type: AUTO`), HTTP/2 or HTTP/1.1 over TLS (ALPN) on a second listener, and keep
//! HTTP/1.1 request trailers (`http_protocol_options.enable_trailers`). Each Envoy has its own
//! limit counters (shared data is per Envoy), so a user's budget is per mode.
//!
//! A request whose body ends with trailers (the last DATA frame has no END_STREAM; an HTTP/1.1
//! chunked body with a trailer section) must get the same body decision as any other: model
//! check, admission, reservation, settlement.

use crate::helpers::*;
use anyhow::Context;
use futures_util::FutureExt;
use maas_e2e::Stack;
use maas_e2e::envoy_config;
use maas_e2e::extra_envoy::ExtraEnvoy;
use maas_e2e::h2client::{self, End, FramedRequest, TestCert, TlsTarget};
use maas_e2e::module_stack::Stoppable;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: open
    level: 1
    groups: [g-open]
    limits:
      requests: [{limit: 100000, window: 1d}]
      tokens: [{limit: 1000000, window: 1d}]
    defaultMaxTokens: 50
  - name: tight
    level: 2
    groups: [g-tight]
    limits:
      tokens: [{limit: 100, window: 1d}]
    defaultMaxTokens: 10
  - name: few
    level: 3
    groups: [g-few]
    limits:
      requests: [{limit: 2, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [open, tight, few]
    backend: simulator
  - name: other-model
    path: /llm/other-model
    tiers: [open]
    backend: simulator
"#;

/// One user per test (and per protocol and gateway where a test spends a budget per protocol;
/// each gateway counts its own budget: global limits are off for them).
const IDENTITIES: &str = r#"
identities:
  - {token: ana-token, username: ana, groups: [g-open]}
  - {token: mia-token, username: mia, groups: [g-open]}
  - {token: tim-token, username: tim, groups: [g-tight]}
  - {token: tim-hold-token, username: tim-hold, groups: [g-tight]}
  - {token: cody-token, username: cody, groups: [g-open]}
  - {token: stella-token, username: stella, groups: [g-open]}
  - {token: fran-token, username: fran, groups: [g-open]}
  - {token: kai-token, username: kai, groups: [g-open]}
  - {token: dee-token, username: dee, groups: [g-open]}
  - {token: pat-http1-token, username: pat-http1, groups: [g-few]}
  - {token: pat-h2c-token, username: pat-h2c, groups: [g-few]}
  - {token: pat-h2-tls-token, username: pat-h2-tls, groups: [g-few]}
  - {token: pat-http1-hold-token, username: pat-http1-hold, groups: [g-few]}
  - {token: pat-h2c-hold-token, username: pat-h2c-hold, groups: [g-few]}
  - {token: pat-h2-tls-hold-token, username: pat-h2-tls-hold, groups: [g-few]}
  - {token: sue-http1-token, username: sue-http1, groups: [g-open]}
  - {token: sue-h2c-token, username: sue-h2c, groups: [g-open]}
  - {token: sue-h2-tls-token, username: sue-h2-tls, groups: [g-open]}
  - {token: tess-token, username: tess, groups: [g-open]}
"#;

const CHAT: &str = "/llm/sim-model/v1/chat/completions";
/// The name the TLS listeners' certificate is for.
const TLS_NAME: &str = "localhost";

/// The module's stack and, once a test asks, its two gateways.
struct Started {
    stack: Stack,
    gateways: OnceLock<Result<Gateways, String>>,
}

impl Stoppable for Started {
    fn stop(&self) {
        if let Some(Ok(gateways)) = self.gateways.get() {
            for gateway in &gateways.list {
                let envoy = gateway
                    .envoy
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                drop(envoy); // stops it
            }
        }
        self.stack.shutdown();
    }
}

fn started() -> &'static Started {
    static S: ModuleStack<Started> = ModuleStack::new();
    S.get_or_start(|| {
        Ok(Started {
            stack: start_stack(POLICY, IDENTITIES, "credentials: {}\n", None)?,
            gateways: OnceLock::new(),
        })
    })
}

fn stack() -> &'static Stack {
    &started().stack
}

// ---- the two gateways ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Headers go on once the caller is authorised; the body is decided at its end (the older
    /// mode, an Istio WasmPlugin's).
    Default,
    /// `pauseHeadersForBody`: headers wait for the body decision.
    HoldHeaders,
}

impl Mode {
    /// Suffix of the users whose budget a test spends on this gateway.
    fn user_suffix(self) -> &'static str {
        match self {
            Mode::Default => "",
            Mode::HoldHeaders => "-hold",
        }
    }
}

struct Gateway {
    mode: Mode,
    /// Plain listener: HTTP/1.1 or h2c (prior knowledge).
    plain: SocketAddr,
    /// TLS listener: ALPN h2 or http/1.1.
    tls: SocketAddr,
    /// Taken (stopped) when the module's stack stops.
    envoy: Mutex<Option<ExtraEnvoy>>,
}

struct Gateways {
    list: Vec<Gateway>,
    tls: TlsTarget,
}

/// Both gateways, started once beside the module's stack (stopped with it).
fn gateways() -> &'static Gateways {
    let started = started();
    let result = started.gateways.get_or_init(|| {
        let stack = &started.stack;
        std::thread::spawn(move || start_gateways(stack).map_err(|e| format!("{e:#}")))
            .join()
            .unwrap_or_else(|_| Err("starting the gateways panicked".into()))
    });
    match result {
        Ok(g) => g,
        Err(e) => panic!("the HTTP/2 gateways did not start: {e}"),
    }
}

fn start_gateways(stack: &Stack) -> anyhow::Result<Gateways> {
    let dir = stack.dir().join("http2-gateways");
    std::fs::create_dir_all(&dir)?;
    let cert = TestCert::generate(&[TLS_NAME, "127.0.0.1"])?;
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, &cert.cert_pem)?;
    std::fs::write(&key_path, &cert.key_pem)?;
    let mut list = Vec::new();
    for mode in [Mode::Default, Mode::HoldHeaders] {
        list.push(start_gateway(stack, mode, &cert_path, &key_path)?);
    }
    Ok(Gateways {
        list,
        tls: cert.target(TLS_NAME),
    })
}

/// Another Envoy from the stack's bootstrap (fresh ports, started again when one is taken),
/// HTTP/1.1 trailers kept, a TLS listener, and for [`Mode::HoldHeaders`] both knobs that hold
/// headers for the body.
fn start_gateway(
    stack: &Stack,
    mode: Mode,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> anyhow::Result<Gateway> {
    let name = format!("http2-{mode:?}").to_ascii_lowercase();
    let envoy = ExtraEnvoy::beside(stack, &name, true, |v, ports| {
        match mode {
            Mode::HoldHeaders => envoy_config::hold_headers_for_body(v)?,
            Mode::Default => envoy_config::continue_headers_before_body(v)?,
        }
        // Each gateway counts alone: with budget leases shared through the one companion, a
        // response's `x-ratelimit-remaining-*` also moves with the other gateway's leases, which
        // the exact counts these tests compare must not depend on (global_limits.rs tests them).
        envoy_config::merge_plugin_config(v, &json!({"limits": {"global": {"enabled": false}}}))?;
        let tls = ports.second.context("a port for the TLS listener")?;
        envoy_config::add_tls_listener(v, tls, cert, key)?;
        envoy_config::enable_http1_trailers(v)
    })?;
    Ok(Gateway {
        mode,
        plain: envoy.ports.listen,
        tls: envoy.ports.second.context("a port for the TLS listener")?,
        envoy: Mutex::new(Some(envoy)),
    })
}

// ---- protocols ----

/// How a request travels to the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    /// HTTP/1.1 with `content-length` (reqwest): as every other e2e test sends.
    Http1,
    /// HTTP/1.1 with a chunked body (and the request's trailers, if any).
    Http1Chunked,
    /// HTTP/2 over cleartext, prior knowledge.
    H2c,
    /// HTTP/2 over TLS, negotiated with ALPN.
    H2Tls,
}

impl Wire {
    /// The protocols every check of "the same over both protocols" runs with.
    const PROTOCOLS: [Wire; 3] = [Wire::Http1, Wire::H2c, Wire::H2Tls];
    /// The ways a request can end with trailers.
    const WITH_TRAILERS: [Wire; 3] = [Wire::H2c, Wire::H2Tls, Wire::Http1Chunked];

    fn name(self) -> &'static str {
        match self {
            Wire::Http1 => "http1",
            Wire::Http1Chunked => "http1-chunked",
            Wire::H2c => "h2c",
            Wire::H2Tls => "h2-tls",
        }
    }
}

/// Sends `req` to `gw` over `wire`; panics (naming both) when no response comes.
async fn call(gw: &Gateway, wire: Wire, req: &FramedRequest) -> Reply {
    let what = format!(
        "{} {} ({:?}, {})",
        req.method,
        req.path,
        gw.mode,
        wire.name()
    );
    let result = match wire {
        Wire::Http1 => {
            assert_eq!(
                req.end,
                End::LastData,
                "{what}: plain HTTP/1.1 has no trailers"
            );
            let method = reqwest::Method::from_bytes(req.method.as_bytes()).unwrap();
            let mut r = client().request(method, format!("http://{}{}", gw.plain, req.path));
            for (k, v) in &req.headers {
                r = r.header(k, v);
            }
            if !req.frames.is_empty() {
                r = r.body(req.body_bytes());
            }
            return send(r).await;
        }
        Wire::Http1Chunked => h2client::send_http1_chunked(gw.plain, req).await,
        Wire::H2c => h2client::send_h2c(gw.plain, req).await,
        Wire::H2Tls => h2client::send_h2_tls(gw.tls, &gateways().tls, req).await,
    };
    let r = result.unwrap_or_else(|e| panic!("{what}: {e:#}"));
    Reply {
        status: r.status,
        body: r.text(),
        headers: r.headers,
    }
}

/// The combinations (gateway mode × wire) of one test: each runs to its end even when another
/// fails (its panic message is printed as usual), and the test then fails naming every
/// combination that failed — so one run shows, e.g., which modes and protocols lose a decision.
#[derive(Default)]
struct Combos {
    failed: Vec<String>,
    ran: usize,
}

impl Combos {
    async fn run(
        &mut self,
        gw: &Gateway,
        wire: Wire,
        checks: impl std::future::Future<Output = ()>,
    ) {
        self.ran += 1;
        if AssertUnwindSafe(checks).catch_unwind().await.is_err() {
            self.failed.push(format!("{:?}/{}", gw.mode, wire.name()));
        }
    }

    fn finish(self) {
        assert!(
            self.failed.is_empty(),
            "{} of {} combinations failed: {:?}",
            self.failed.len(),
            self.ran,
            self.failed
        );
    }
}

fn chat_request(test_id: &str, credential: &str, body: &Value) -> FramedRequest {
    FramedRequest::post_json(CHAT, body)
        .header("authorization", &bearer(credential))
        .header("x-test-id", test_id)
}

/// The body in two DATA frames (chunks), neither with END_STREAM, then trailers `x-trailer: 1`.
fn with_trailers(req: FramedRequest) -> FramedRequest {
    req.split_into(2).trailers(&[("x-trailer", "1")])
}

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} in {:?} ({})", r.headers, r.body))
        .parse()
        .unwrap()
}

fn id(test: &str, gw: &Gateway, wire: Wire, step: &str) -> String {
    format!("{test}-{:?}-{}-{step}", gw.mode, wire.name())
}

/// A call that fits and is counted like any other: `max_tokens` and completion 3, prompt 1.
async fn probe(gw: &Gateway, user: &str, test_id: &str) -> Reply {
    let body = json!({"model": "sim-model", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "probe"}]});
    let r = call(gw, Wire::H2c, &chat_request(test_id, user, &body)).await;
    assert_eq!(r.status, 200, "{test_id}: {}", r.body);
    r
}

// ---- HTTP/2 basics ----

#[tokio::test]
async fn http2_with_an_api_key_gets_200_with_rate_headers_and_the_model_never_sees_the_key() {
    let stack = stack();
    let key = &stack
        .mint_key_plain("ana-token", "http2-key")
        .await
        .expect("ana can mint a key");
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in [Wire::H2c, Wire::H2Tls] {
            combos
                .run(gw, wire, async move {
                    let test_id = id("apikey", gw, wire, "ok");
                    let body = json!({"model": "sim-model",
                                  "messages": [{"role": "user", "content": "hello gateway"}]});
                    let r = call(gw, wire, &chat_request(&test_id, key, &body)).await;
                    assert_eq!(r.status, 200, "{test_id}: {}", r.body);
                    assert_eq!(r.json()["usage"]["prompt_tokens"], 2, "{}", r.body);
                    assert!(header_u64(&r, "x-ratelimit-limit-requests") > 0);
                    assert!(r.header("x-ratelimit-remaining-requests").is_some());
                    assert!(r.header("x-ratelimit-remaining-tokens").is_some());
                    let seen = stack.sim_requests_with_test_id(&test_id);
                    assert_eq!(seen.len(), 1, "{test_id}: {seen:?}");
                    for (name, value) in &seen[0].headers {
                        assert!(
                            !value.contains(key.as_str()) && !value.contains("sk-oai-"),
                            "{test_id}: the model saw the key in {name}"
                        );
                    }
                    assert!(seen[0].header("authorization").is_none(), "{test_id}");
                })
                .await;
        }
    }
    combos.finish();
}

#[tokio::test]
async fn http2_without_a_credential_gets_a_401_json_error_and_nothing_reaches_the_model() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in [Wire::H2c, Wire::H2Tls] {
            combos.run(gw, wire, async move {
                let test_id = id("nokey", gw, wire, "401");
                let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
                let req = FramedRequest::post_json(CHAT, &body).header("x-test-id", &test_id);
                let r = call(gw, wire, &req).await;
                let e = r.error(401);
                assert_eq!(e["type"], "authentication_error", "{}", r.body);
                assert_eq!(r.header("content-type"), Some("application/json"));
                assert_eq!(r.header("www-authenticate"), Some("Bearer"));
                assert!(stack.sim_requests_with_test_id(&test_id).is_empty());
            })
            .await;
        }
    }
    combos.finish();
}

// ---- request trailers: the body decision still runs ----

#[tokio::test]
async fn trailers_body_naming_another_model_gets_400_model_mismatch() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::WITH_TRAILERS {
            combos
                .run(gw, wire, async move {
                    let test_id = id("mismatch", gw, wire, "400");
                    let body = json!({"model": "other-model", "max_tokens": 3,
                                  "messages": [{"role": "user", "content": "hi"}]});
                    let req = with_trailers(chat_request(&test_id, "mia-token", &body));
                    let r = call(gw, wire, &req).await;
                    assert_eq!(r.status, 400, "{test_id}: {}", r.body);
                    assert_eq!(
                        r.error(400)["code"],
                        "model_mismatch",
                        "{test_id}: {}",
                        r.body
                    );
                    if gw.mode == Mode::HoldHeaders {
                        assert!(
                            stack.sim_requests_with_test_id(&test_id).is_empty(),
                            "{test_id}: held headers, yet the backend saw the request"
                        );
                    }
                })
                .await;
        }
    }
    combos.finish();
}

#[tokio::test]
async fn trailers_request_that_does_not_fit_the_token_window_gets_429() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        // Spend 91 of tim's 100 (prompt 1 + completion 90): 9 left, not empty.
        let body = json!({"model": "sim-model", "max_tokens": 90,
                          "messages": [{"role": "user", "content": "x"}]});
        let setup = id("tight", gw, Wire::H2c, "setup");
        let tim = format!("tim{}-token", gw.mode.user_suffix());
        let r = call(
            gw,
            Wire::H2c,
            &chat_request(&setup, &tim, &body).header("x-sim-completion-tokens", "90"),
        )
        .await;
        assert_eq!(r.status, 200, "{setup}: {}", r.body);
        assert_eq!(r.json()["usage"]["total_tokens"], 91, "{}", r.body);
        for wire in Wire::WITH_TRAILERS {
            combos
                .run(gw, wire, async move {
                    let test_id = id("tight", gw, wire, "429");
                    let body = json!({"model": "sim-model", "max_tokens": 50,
                                  "messages": [{"role": "user", "content": "x"}]});
                    let tim = format!("tim{}-token", gw.mode.user_suffix());
                    let req = with_trailers(chat_request(&test_id, &tim, &body));
                    let r = call(gw, wire, &req).await;
                    assert_eq!(
                        r.status, 429,
                        "{test_id}: 50 tokens cannot be reserved with 9 left: {}",
                        r.body
                    );
                    let e = r.error(429);
                    assert_eq!(e["type"], "rate_limit_exceeded", "{}", r.body);
                    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 9);
                    assert!(header_u64(&r, "retry-after") >= 1);
                    if gw.mode == Mode::HoldHeaders {
                        assert!(stack.sim_requests_with_test_id(&test_id).is_empty());
                    }
                })
                .await;
        }
    }
    combos.finish();
}

/// `probe`, then `req` (with a `max_tokens` of `reserve`, using `uses` tokens), then `probe`
/// again. The request was admitted through the body decision (its response carries the token
/// window's headers), held its reservation while in flight (its remaining count is below what
/// is left once it settled, as the reservation, at least `reserve`, exceeds `uses`), and was
/// settled to exactly what it used. Only the real usage is compared exactly: what a
/// reservation adds to `max_tokens` (a prompt estimate) is the filter's business.
async fn assert_counted(
    gw: &Gateway,
    wire: Wire,
    user: &str,
    test: &str,
    req: FramedRequest,
    reserve: u64,
    uses: u64,
) -> Reply {
    assert!(
        reserve > uses + 3,
        "the test needs a reservation above the use"
    );
    let before = probe(gw, user, &id(test, gw, wire, "before")).await;
    let test_id = req
        .headers
        .iter()
        .find(|(k, _)| k == "x-test-id")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let r = call(gw, wire, &req).await;
    assert_eq!(r.status, 200, "{test_id}: {}", r.body);
    let held = r
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| {
            panic!(
                "{test_id}: no x-ratelimit-remaining-tokens: the request was never admitted \
                 by the body decision ({:?})",
                r.headers
            )
        });
    let after = probe(gw, user, &id(test, gw, wire, "after")).await;
    let remaining = |p: &Reply| header_u64(p, "x-ratelimit-remaining-tokens");
    let probe_used = before.json()["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(
        remaining(&before) - remaining(&after),
        probe_used + uses,
        "{test_id}: the window counts the {uses} tokens it used (and the probe's {probe_used})"
    );
    assert!(
        held < remaining(&after),
        "{test_id}: in flight it held its reservation of max_tokens {reserve}: {held} left \
         then, {} once it settled to {uses}",
        remaining(&after)
    );
    r
}

#[tokio::test]
async fn trailers_request_reserves_max_tokens_and_its_usage_is_counted() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::WITH_TRAILERS {
            combos
                .run(gw, wire, async move {
                    let test_id = id("counted", gw, wire, "call");
                    // prompt 3 + completion 7 = 10 used; 40 reserved.
                    let body = json!({"model": "sim-model", "max_tokens": 40,
                                  "messages": [{"role": "user", "content": "a b c"}]});
                    let req = with_trailers(
                        chat_request(&test_id, "cody-token", &body)
                            .header("x-sim-completion-tokens", "7"),
                    );
                    let r = assert_counted(gw, wire, "cody-token", "counted", req, 40, 10).await;
                    assert_eq!(r.json()["usage"]["total_tokens"], 10, "{}", r.body);
                    assert_eq!(stack.sim_requests_with_test_id(&test_id).len(), 1);
                })
                .await;
        }
    }
    combos.finish();
}

/// `data:` payloads of an SSE body.
fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

/// A streamed response the client did not ask usage for: ends with `[DONE]`, no usage-only
/// event; the backend was asked for usage on the client's behalf.
fn assert_stream_usage_hidden(stack: &Stack, test_id: &str, r: &Reply) {
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("text/event-stream"),
        "{test_id}: {:?}",
        r.headers
    );
    let events = sse_events(&r.body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{test_id}: {}",
        r.body
    );
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(
            !v["choices"].as_array().unwrap().is_empty(),
            "{test_id}: usage-only event leaked: {e}"
        );
    }
    let seen = stack.sim_requests_with_test_id(test_id);
    assert_eq!(seen.len(), 1, "{test_id}");
    let sent: Value = serde_json::from_str(&seen[0].body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true, "{test_id}");
}

#[tokio::test]
async fn streamed_trailers_request_still_has_its_usage_counted() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::WITH_TRAILERS {
            combos
                .run(gw, wire, async move {
                    let test_id = id("stream", gw, wire, "call");
                    // prompt 2 + completion 5 = 7 used; 30 reserved.
                    let body = json!({"model": "sim-model", "stream": true, "max_tokens": 30,
                                  "messages": [{"role": "user", "content": "one two"}]});
                    let req = with_trailers(
                        chat_request(&test_id, "stella-token", &body)
                            .header("x-sim-completion-tokens", "5"),
                    );
                    let r = assert_counted(gw, wire, "stella-token", "stream", req, 30, 7).await;
                    assert_stream_usage_hidden(stack, &test_id, &r);
                })
                .await;
        }
    }
    combos.finish();
}

#[tokio::test]
async fn http2_body_in_many_small_data_frames_still_gets_the_body_decision() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for end in [End::LastData, End::EmptyData] {
            // Labelled h2c; the END_STREAM placement is in the test ids.
            combos
                .run(gw, Wire::H2c, async move {
                    let wire = Wire::H2c;
                    let end_name = if end == End::LastData {
                        "last-data"
                    } else {
                        "empty-data"
                    };
                    let frames = |req: FramedRequest| {
                        req.split_into(60)
                            .end(end.clone())
                            .frame_delay(Duration::from_millis(2))
                    };
                    let test_id = id("frames", gw, wire, &format!("{end_name}-mismatch"));
                    let body = json!({"model": "other-model", "max_tokens": 3,
                                  "messages": [{"role": "user", "content": "many small frames"}]});
                    let req = frames(chat_request(&test_id, "fran-token", &body));
                    assert_eq!(req.frames.len(), 60);
                    let r = call(gw, wire, &req).await;
                    assert_eq!(r.status, 400, "{test_id}: {}", r.body);
                    assert_eq!(r.error(400)["code"], "model_mismatch", "{test_id}");
                    if gw.mode == Mode::HoldHeaders {
                        assert!(stack.sim_requests_with_test_id(&test_id).is_empty());
                    }

                    let test_id = id("frames", gw, wire, &format!("{end_name}-ok"));
                    // prompt 3 + completion 4 = 7 used; 20 reserved.
                    let body = json!({"model": "sim-model", "max_tokens": 20,
                                  "messages": [{"role": "user", "content": "many small frames"}]});
                    let req = frames(
                        chat_request(&test_id, "fran-token", &body)
                            .header("x-sim-completion-tokens", "4"),
                    );
                    let r = assert_counted(gw, wire, "fran-token", "frames", req, 20, 7).await;
                    assert_eq!(r.json()["usage"]["total_tokens"], 7, "{}", r.body);
                    let seen = stack.sim_requests_with_test_id(&test_id);
                    assert_eq!(seen.len(), 1, "{test_id}");
                    assert_eq!(
                        seen[0].body,
                        body.to_string(),
                        "{test_id}: the whole body reached the model"
                    );
                })
                .await;
        }
    }
    combos.finish();
}

// ---- a body declared by its content-length ----

/// `req` over HTTP/1.1 with its `content-length`, the body written in its frames with the
/// request's frame delay between them (one connection, closed after the answer).
async fn http1_in_pieces(
    addr: SocketAddr,
    req: &FramedRequest,
) -> anyhow::Result<h2client::Response> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let mut head = format!(
        "{} {} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n",
        req.method, req.path
    );
    for (k, v) in &req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    tcp.write_all(head.as_bytes()).await?;
    for frame in &req.frames {
        tcp.write_all(frame).await?;
        tcp.flush().await?;
        tokio::time::sleep(req.frame_delay).await;
    }
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut raw)).await??;
    h2client::parse_http1_response(&raw)
}

/// A body that reaches its `content-length` is decided then, before its stream ends (the
/// filter does not hold it to END_STREAM): sent in pieces over HTTP/2 (its END_STREAM or its
/// trailers coming later) and over HTTP/1.1, it is admitted, counted once, and reaches the
/// model whole. A body longer than it declares never reaches the model with its extra bytes
/// (Envoy's codec or the filter refuses it).
#[tokio::test]
async fn a_body_decided_at_its_content_length_is_counted_once_and_never_grows_past_it() {
    let stack = stack();
    let mut combos = Combos::default();
    let chat = |test_id: &str| {
        let body = json!({"model": "sim-model", "max_tokens": 20,
                          "messages": [{"role": "user", "content": "declared by its length"}]});
        let len = body.to_string().len();
        let req = chat_request(test_id, "dee-token", &body)
            .header("x-sim-completion-tokens", "4")
            .split_into(3)
            .frame_delay(Duration::from_millis(30));
        (req, body, len)
    };
    for gw in &gateways().list {
        let ends = [
            ("empty-data", End::EmptyData),
            (
                "trailers",
                End::Trailers(vec![("x-trailer".into(), "1".into())]),
            ),
        ];
        for (end_name, end) in ends {
            combos
                .run(gw, Wire::H2c, async move {
                    let test_id = id("declared", gw, Wire::H2c, end_name);
                    let (req, body, len) = chat(&test_id);
                    let req = req.header("content-length", &len.to_string()).end(end);
                    // prompt 4 + completion 4 = 8 used; 20 reserved.
                    assert_counted(gw, Wire::H2c, "dee-token", "declared", req, 20, 8).await;
                    let seen = stack.sim_requests_with_test_id(&test_id);
                    assert_eq!(seen.len(), 1, "{test_id}");
                    assert_eq!(seen[0].body, body.to_string(), "{test_id}: the whole body");
                })
                .await;
        }
        combos
            .run(gw, Wire::Http1, async move {
                let test_id = id("declared", gw, Wire::Http1, "pieces");
                let (req, body, len) = chat(&test_id);
                let req = req.header("content-length", &len.to_string());
                let r = http1_in_pieces(gw.plain, &req).await.expect("an answer");
                assert_eq!(r.status, 200, "{test_id}: {}", r.text());
                assert!(
                    r.header("x-ratelimit-remaining-tokens").is_some(),
                    "{test_id}"
                );
                let seen = stack.sim_requests_with_test_id(&test_id);
                assert_eq!(seen.len(), 1, "{test_id}");
                assert_eq!(seen[0].body, body.to_string(), "{test_id}: the whole body");
            })
            .await;
        combos
            .run(gw, Wire::H2c, async move {
                let test_id = id("declared", gw, Wire::H2c, "longer");
                let (req, _, len) = chat(&test_id);
                let declared = len - 12;
                let req = req
                    .header("content-length", &declared.to_string())
                    .end(End::EmptyData);
                // Refused or reset: never a model's answer to the longer body.
                if let Ok(r) = h2client::send_h2c(gw.plain, &req).await {
                    assert_ne!(r.status, 200, "{test_id}: {}", r.text());
                }
                for seen in stack.sim_requests_with_test_id(&test_id) {
                    assert!(
                        seen.body.len() <= declared,
                        "{test_id}: the model got {} bytes of a body declared as {declared}",
                        seen.body.len()
                    );
                }
            })
            .await;
    }
    combos.finish();
}

// ---- the most important e2e checks, over HTTP/1.1 and HTTP/2 alike ----

#[tokio::test]
async fn same_over_both_protocols_minted_key_works_and_identity_headers_never_reach_the_model() {
    let stack = stack();
    let key = &stack
        .mint_key_plain("kai-token", "both-protocols")
        .await
        .expect("kai can mint a key");
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::PROTOCOLS {
            combos
                .run(gw, wire, async move {
                    let test_id = id("hygiene", gw, wire, "ok");
                    let body = json!({"model": "sim-model",
                                  "messages": [{"role": "user", "content": "hello gateway"}]});
                    let req = chat_request(&test_id, key, &body)
                        .header("x-maas-username", "carol")
                        .header("x-maas-groups", "maas-admins")
                        .header("x-maas-tier", "vip");
                    let r = call(gw, wire, &req).await;
                    assert_eq!(r.status, 200, "{test_id}: {}", r.body);
                    assert_eq!(r.json()["object"], "chat.completion");
                    let seen = stack.sim_requests_with_test_id(&test_id);
                    assert_eq!(seen.len(), 1, "{test_id}");
                    assert_eq!(seen[0].path, "/v1/chat/completions", "prefix rewritten");
                    for (name, value) in &seen[0].headers {
                        let name = name.to_ascii_lowercase();
                        assert!(
                            name != "authorization"
                                && name != "x-api-key"
                                && !name.starts_with("x-maas-"),
                            "{test_id}: {name} reached the model"
                        );
                        assert!(!value.contains(key.as_str()), "{test_id}: key in {name}");
                    }
                })
                .await;
        }
    }
    combos.finish();
}

#[tokio::test]
async fn same_over_both_protocols_refusals_are_openai_json_errors() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::PROTOCOLS {
            combos.run(gw, wire, async move {
                let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
                let test_id = id("refusals", gw, wire, "any");
                let base = FramedRequest::post_json(CHAT, &body).header("x-test-id", &test_id);
                let cases: Vec<(FramedRequest, u16, &str)> = vec![
                    (base.clone(), 401, "no credential"),
                    (
                        base.clone().header("authorization", "Bearer sk-oai-notakey_x"),
                        401,
                        "malformed key",
                    ),
                    (
                        base.clone().header("authorization", "Bearer nobody-token"),
                        401,
                        "unknown token",
                    ),
                    (
                        base.clone()
                            .header("authorization", "Bearer ana-token")
                            .header("x-api-key", "sk-oai-other"),
                        400,
                        "two different credentials",
                    ),
                    (
                        FramedRequest::post_json("/llm/other-model/v1/chat/completions", &body)
                            .header("x-test-id", &test_id)
                            .header("authorization", "Bearer tim-token"),
                        403,
                        "tier not allowed on the model",
                    ),
                    (
                        FramedRequest::new("GET", "/no/such/model").header("x-test-id", &test_id),
                        404,
                        "no model at the path",
                    ),
                    (
                        FramedRequest::new("GET", "/maas-api/internal/v1/policy")
                            .header("x-test-id", &test_id),
                        404,
                        "internal API",
                    ),
                ];
                for (req, status, what) in cases {
                    let r = call(gw, wire, &req).await;
                    assert_eq!(r.status, status, "{test_id} {what}: {}", r.body);
                    r.error(status);
                    assert_eq!(
                        r.header("content-type"),
                        Some("application/json"),
                        "{test_id} {what}"
                    );
                }
                assert!(stack.sim_requests_with_test_id(&test_id).is_empty());
            })
            .await;
        }
    }
    combos.finish();
}

#[tokio::test]
async fn same_over_both_protocols_request_limit_gives_429_with_headers() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::PROTOCOLS {
            combos.run(gw, wire, async move {
                let body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
                let user = format!("pat-{}{}-token", wire.name(), gw.mode.user_suffix());
                for expected_remaining in [1, 0] {
                    let test_id = id("limit", gw, wire, &format!("ok-{expected_remaining}"));
                    let r = call(gw, wire, &chat_request(&test_id, &user, &body)).await;
                    assert_eq!(r.status, 200, "{test_id}: {}", r.body);
                    assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 2);
                    assert_eq!(
                        header_u64(&r, "x-ratelimit-remaining-requests"),
                        expected_remaining
                    );
                }
                let test_id = id("limit", gw, wire, "429");
                let r = call(gw, wire, &chat_request(&test_id, &user, &body)).await;
                let e = r.error(429);
                assert_eq!(e["type"], "rate_limit_exceeded");
                assert!((1..=86_400).contains(&header_u64(&r, "retry-after")));
                assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 0);
                assert!(stack.sim_requests_with_test_id(&test_id).is_empty());
            })
            .await;
        }
    }
    combos.finish();
}

#[tokio::test]
async fn same_over_both_protocols_streamed_usage_is_hidden_and_counted() {
    let stack = stack();
    let mut combos = Combos::default();
    for gw in &gateways().list {
        for wire in Wire::PROTOCOLS {
            combos
                .run(gw, wire, async move {
                    let user = format!("sue-{}-token", wire.name());
                    let test_id = id("sse", gw, wire, "call");
                    // prompt 2 + completion 6 = 8 used; 25 reserved.
                    let body = json!({"model": "sim-model", "stream": true, "max_tokens": 25,
                                  "messages": [{"role": "user", "content": "stream please"}]});
                    let req =
                        chat_request(&test_id, &user, &body).header("x-sim-completion-tokens", "6");
                    let r = assert_counted(gw, wire, &user, "sse", req, 25, 8).await;
                    assert_stream_usage_hidden(stack, &test_id, &r);
                })
                .await;
        }
    }
    combos.finish();
}

// ---- response trailers ----

/// An upstream whose answers end in trailers (HTTP/2 to the simulator, which sends the
/// provider's own `x-ratelimit-*` there): they never reach the client, the other trailers do,
/// and the answer is counted as any other.
#[tokio::test]
async fn the_upstreams_rate_limit_trailers_never_reach_the_client() {
    let stack = stack();
    let envoy = ExtraEnvoy::beside(stack, "http2-upstream-trailers", false, |v, _| {
        envoy_config::merge_plugin_config(v, &json!({"limits": {"global": {"enabled": false}}}))?;
        envoy_config::upstream_http2(v, envoy_config::SIMULATOR_CLUSTER)
    })
    .unwrap();
    let addr = envoy.ports.listen;
    let remaining = |r: &h2client::Response| -> u64 {
        r.header("x-ratelimit-remaining-tokens")
            .unwrap_or_else(|| panic!("no x-ratelimit-remaining-tokens in {:?}", r.headers))
            .parse()
            .unwrap()
    };
    let probe = |n: usize| {
        let body = json!({"model": "sim-model", "max_tokens": 3,
                          "messages": [{"role": "user", "content": "probe"}]});
        chat_request(&format!("upstream-trailers-probe-{n}"), "tess-token", &body)
    };
    let mut before = h2client::send_h2c(addr, &probe(0)).await.unwrap();
    assert_eq!(before.status, 200, "{}", before.text());
    for (n, stream) in [(1, false), (2, true)] {
        // prompt 1 + completion 10 = 11 used (the simulator's rule), 50 reserved.
        let body = json!({"model": "sim-model", "stream": stream, "max_tokens": 10,
                          "messages": [{"role": "user", "content": "hi"}]});
        let req = chat_request(&format!("upstream-trailers-{n}"), "tess-token", &body)
            .header("x-sim-ratelimit-trailers", "1");
        let r = h2client::send_h2c(addr, &req).await.unwrap();
        assert_eq!(r.status, 200, "stream {stream}: {}", r.text());
        // The gateway's own limits are in the headers.
        assert!(
            r.header("x-ratelimit-remaining-requests")
                .is_some_and(|v| v.parse::<u64>().is_ok()),
            "stream {stream}: {:?}",
            r.headers
        );
        let trailers = r
            .trailers
            .as_ref()
            .unwrap_or_else(|| panic!("stream {stream}: no trailers came through"));
        assert_eq!(
            trailers.get("x-sim-trailer").and_then(|v| v.to_str().ok()),
            Some("kept"),
            "stream {stream}: {trailers:?}"
        );
        let leaked: Vec<_> = trailers
            .keys()
            .filter(|k| k.as_str().starts_with("x-ratelimit-"))
            .collect();
        assert!(
            leaked.is_empty(),
            "stream {stream}: {leaked:?} reached the client"
        );
        if stream {
            let text = r.text();
            assert!(text.contains("[DONE]"), "{text}");
            assert!(
                !text.contains("\"usage\""),
                "the usage event is stripped: {text}"
            );
        } else {
            assert_eq!(
                r.text().parse::<Value>().unwrap()["usage"]["total_tokens"],
                11
            );
        }
        let after = h2client::send_h2c(addr, &probe(n)).await.unwrap();
        assert_eq!(after.status, 200, "{}", after.text());
        // Probes use prompt 1 + completion 3.
        assert_eq!(
            remaining(&before) - remaining(&after),
            11 + 4,
            "stream {stream}: counted as it used"
        );
        before = after;
    }
}
