//! Several backends per model (issue 29), through real Envoy with the release .wasm: requests
//! spread by weight; a backend answering 503 or 429, refusing connections or stalling past its
//! timeout fails over to another and the client sees one clean answer; a backend that fails
//! after the first response byte is not retried (the client sees the error); a request that
//! failed over is metered once, like any other; the usage event names the backend that served.
//! The usage ledger names it too (the route's `x-maas-served-by`, read by the filter): its
//! per-backend counts (`GET /v1/usage?groupBy=backend`) equal the access log's `served_by`
//! counts, a failed-over request counts against the backend that answered, an upstream's own
//! `x-maas-served-by` is replaced and never reaches the client, and a model without backends
//! records none. Each model has simulators of its own (so tests run in parallel without sharing
//! a fault).

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::sim::{self, SimConfig, SimHandle};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [g-free]}
  - {token: mia-token, username: mia, groups: [g-free]}
  - {token: bea-token, username: bea, groups: [g-free]}
"#;

/// The simulators, by name: `spread-a`/`spread-b` (80/20), `ok-503`/`down-503` (answers 503),
/// `ok-429`/`down-429`, `ok-refused` (beside a port nothing listens on), `ok-slow`/`stall`
/// (answers nothing for 60 s, the backends' timeout is 1 s), `drop-a`/`drop-b` (both end the
/// stream after its first bytes), `meter` (one backend: the baseline for metering) and
/// `ok-meter`/`down-meter` (answers 503) for the metered failover, `ok-s503`/`down-s503` for a
/// stream's failover, `long-a`/`long-b` (healthy, 1 s timeout) for a stream longer than that,
/// `down-a`/`down-b` (both answer 503), `ledger-a`/`ledger-b` (75/25) for the ledger's counts,
/// `real`/`decoy` (weight 1/0) for a spoofing upstream, `single` for a model without backends,
/// `own-down`/`plain-up` and `own-up`/`plain-down` for backends with a served name of their own
/// (`own`) and without (`plain`), one of each pair answering 503 (`…-unheld`: the same, for the
/// stack whose filters do not hold headers), `cool-up`/`cool-down` (answers 503) for a cooldown, `idle-a`/`idle-b` (healthy, 1 s timeout)
/// for a stream that goes quiet.
fn sims() -> &'static BTreeMap<&'static str, SimHandle> {
    static SIMS: OnceLock<BTreeMap<&'static str, SimHandle>> = OnceLock::new();
    SIMS.get_or_init(|| {
        let names = [
            "spread-a",
            "spread-b",
            "ok-503",
            "down-503",
            "ok-429",
            "down-429",
            "ok-refused",
            "ok-slow",
            "stall",
            "drop-a",
            "drop-b",
            "meter",
            "ok-meter",
            "down-meter",
            "ok-s503",
            "down-s503",
            "long-a",
            "long-b",
            "down-a",
            "down-b",
            "ledger-a",
            "ledger-b",
            "real",
            "decoy",
            "single",
            "own-down",
            "plain-up",
            "own-up",
            "plain-down",
            "own-down-unheld",
            "plain-up-unheld",
            "cool-up",
            "cool-down",
            "idle-a",
            "idle-b",
        ];
        let out: BTreeMap<_, _> = names
            .into_iter()
            .map(|n| {
                let s = sim::spawn("127.0.0.1:0".parse().unwrap(), SimConfig::default())
                    .expect("a simulator starts");
                (n, s)
            })
            .collect();
        out["down-503"].set_fault("status-503");
        out["down-429"].set_fault("status-429");
        out["down-meter"].set_fault("status-503");
        out["down-s503"].set_fault("status-503");
        out["stall"].set_fault("stall");
        out["down-a"].set_fault("status-503");
        out["down-b"].set_fault("status-503");
        out["drop-a"].set_fault("drop-mid-stream");
        out["drop-b"].set_fault("drop-mid-stream");
        out["own-down"].set_fault("status-503");
        out["plain-down"].set_fault("status-503");
        out["own-down-unheld"].set_fault("status-503");
        out["cool-down"].set_fault("status-503");
        out
    })
}

/// A local port nothing listens on (bound, then released).
fn refused_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        format!("http://{}", l.local_addr().expect("its address"))
    })
}

/// Chat completions simulator `name` received (the companion's readiness probes left out).
fn chats(name: &str) -> usize {
    sims()[name]
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .count()
}

fn url(name: &str) -> String {
    sims()[name].url()
}

/// A policy model (YAML) with these backends `(name, URL, weight)`, each with `timeout`.
fn model(name: &str, backends: &[(&str, String, u32)], timeout: &str) -> String {
    let list: Vec<String> = backends
        .iter()
        .map(|(n, u, w)| {
            format!("      - {{name: {n}, backend: \"{u}\", weight: {w}, timeout: {timeout}}}")
        })
        .collect();
    format!(
        "  - name: {name}\n    path: /llm/{name}\n    tiers: [free]\n    backends:\n{}\n",
        list.join("\n")
    )
}

/// `model` (YAML from [`model`]) with this `cooldown`.
fn with_cooldown(model: String, cooldown: &str) -> String {
    model.replacen(
        "    backends:\n",
        &format!("    cooldown: {cooldown}\n    backends:\n"),
        1,
    )
}

/// A model served as `model-served` whose backend `own` takes `own-name` in the body (its
/// simulator `own_sim`) and `plain` the model's served name (`plain_sim`).
fn renamed_model(name: &str, own_sim: &str, plain_sim: &str) -> String {
    format!(
        "  - name: {name}\n    path: /llm/{name}\n    tiers: [free]\n    servedName: model-served\n    upstreamCluster: {name}-backends\n    backends:\n      \
         - {{name: own, backend: \"{}\", weight: 50, timeout: 30s, servedName: own-name}}\n      \
         - {{name: plain, backend: \"{}\", weight: 50, timeout: 30s}}\n",
        url(own_sim),
        url(plain_sim)
    )
}

fn policy() -> &'static str {
    static POLICY: OnceLock<String> = OnceLock::new();
    POLICY.get_or_init(|| {
        let models = [
            model(
                "spread",
                &[("a", url("spread-a"), 80), ("b", url("spread-b"), 20)],
                "30s",
            ),
            model(
                "fail-503",
                &[("up", url("ok-503"), 50), ("down", url("down-503"), 50)],
                "30s",
            ),
            model(
                "fail-429",
                // The faulty one first: readiness must not stop at it.
                &[("down", url("down-429"), 50), ("up", url("ok-429"), 50)],
                "30s",
            ),
            model(
                "refused",
                &[
                    ("up", url("ok-refused"), 50),
                    ("gone", refused_url().to_string(), 50),
                ],
                "30s",
            ),
            model(
                "slow",
                &[("up", url("ok-slow"), 50), ("stuck", url("stall"), 50)],
                "1s",
            ),
            model(
                "drops",
                &[("a", url("drop-a"), 50), ("b", url("drop-b"), 50)],
                "30s",
            ),
            model("meter", &[("only", url("meter"), 1)], "30s"),
            model(
                "stream-503",
                &[("up", url("ok-s503"), 50), ("down", url("down-s503"), 50)],
                "30s",
            ),
            // Its promise is one try each per request: without a cooldown (which would eject
            // one of them for a while, `cooling`).
            with_cooldown(
                model(
                    "all-down",
                    &[("a", url("down-a"), 50), ("b", url("down-b"), 50)],
                    "30s",
                ),
                "{failures: 0}",
            ),
            with_cooldown(
                model(
                    "cooling",
                    &[("up", url("cool-up"), 50), ("down", url("cool-down"), 50)],
                    "30s",
                ),
                "{failures: 2, duration: 30s}",
            ),
            model(
                "long",
                &[("a", url("long-a"), 50), ("b", url("long-b"), 50)],
                "1s",
            ),
            model(
                "idle",
                &[("a", url("idle-a"), 50), ("b", url("idle-b"), 50)],
                "1s",
            ),
            model(
                "fail-meter",
                &[("up", url("ok-meter"), 50), ("down", url("down-meter"), 50)],
                "30s",
            ),
            model(
                "ledger",
                &[("a", url("ledger-a"), 75), ("b", url("ledger-b"), 25)],
                "30s",
            ),
            // `decoy` is a backend of the model that never gets traffic: the name a spoofing
            // upstream sends.
            model(
                "spoof",
                &[("real", url("real"), 1), ("decoy", url("decoy"), 0)],
                "30s",
            ),
            renamed_model("renamed-own-down", "own-down", "plain-up"),
            renamed_model("renamed-plain-down", "own-up", "plain-down"),
            format!(
                "  - name: single\n    path: /llm/single\n    tiers: [free]\n    backend: \"{}\"\n",
                url("single")
            ),
        ];
        policy_of(&models.concat())
    })
}

/// The policy (YAML) with these models: one tier of generous limits, usage events on.
fn policy_of(models: &str) -> String {
    format!(
        r#"
observability: {{usageEvents: true}}
tiers:
  - name: free
    level: 0
    groups: [g-free]
    limits:
      requests: [{{limit: 100000, window: 1d}}]
      tokens: [{{limit: 10000000, window: 1d}}]
models:
{models}"#
    )
}

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    // Usage reports often: the ledger tests wait for them.
    S.get_or_start(|| {
        start_stack(
            policy(),
            IDENTITIES,
            "credentials: {}\n",
            Some(json!({"usage": {"reportIntervalMs": 300}})),
        )
    })
}

/// A chat completion for `model` (usage events are told apart by the model).
async fn call(stack: &Stack, model: &str, extra: Value) -> Reply {
    call_as(stack, "alice-token", model, extra).await
}

/// As [`call`], with this credential.
async fn call_as(stack: &Stack, cred: &str, model: &str, extra: Value) -> Reply {
    let mut body = json!({"model": model, "max_tokens": 3,
                          "messages": [{"role": "user", "content": "one two three four"}]});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    chat(
        stack,
        &format!("/llm/{model}/v1/chat/completions"),
        "backends",
        &[("authorization", &bearer(cred))],
        body,
    )
    .await
}

fn served_by(events: &[Value]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in events {
        *out.entry(e["served_by"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    out
}

/// What metering saw of a request: forwarded, decision, input and output tokens.
fn metered(e: &Value) -> (Value, Value, Value, Value) {
    let e = &e["event"];
    (
        e["forwarded"].clone(),
        e["decision"].clone(),
        e["input_tokens"].clone(),
        e["output_tokens"].clone(),
    )
}

#[tokio::test]
async fn requests_spread_by_weight() {
    let s = stack();
    for _ in 0..100 {
        let r = call(s, "spread", json!({})).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let a = chats("spread-a");
    let b = chats("spread-b");
    eprintln!("backends::requests_spread_by_weight: 80/20 weights gave {a}/{b}");
    assert_eq!(a + b, 100, "each request reached one backend once");
    // Envoy's weighted round robin (per worker) gives 80/20 up to a few per worker; the bound
    // is wide enough never to flake and narrow enough that 50/50 or 100/0 fails.
    assert!((65..=92).contains(&a), "80/20 split: a got {a}, b got {b}");
    let events = events_of(s, "spread", 100).await;
    let by = served_by(&events);
    assert_eq!(by.get("a"), Some(&a), "{by:?}");
    assert_eq!(by.get("b"), Some(&b), "{by:?}");
}

/// `n` calls to `model`, each answered 200 by the healthy backend `up`; the faulty backend
/// `down_sim` was tried (so requests did fail over); one usage event each, served by `up`.
async fn fails_over(model: &str, up_sim: &str, down_sim: &str, n: usize) -> Vec<Value> {
    let s = stack();
    for _ in 0..n {
        let r = call(s, model, json!({})).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "chat.completion", "{}", r.body);
    }
    assert_eq!(chats(up_sim), n, "{model}: all served by up");
    if !down_sim.is_empty() {
        let tried = chats(down_sim);
        assert!(
            tried > 0 && tried <= n,
            "{model}: the faulty backend was tried {tried} times"
        );
    }
    let events = events_of(s, model, n).await;
    assert_eq!(served_by(&events), BTreeMap::from([("up".to_string(), n)]));
    // The ledger counts each against the backend that answered, never the one that failed.
    assert_eq!(
        ledger_by_backend(s, "alice-token", model, n).await,
        BTreeMap::from([("up".to_string(), n)])
    );
    events
}

#[tokio::test]
async fn a_503_backend_fails_over_and_the_client_sees_one_clean_answer() {
    fails_over("fail-503", "ok-503", "down-503", 10).await;
}

#[tokio::test]
async fn a_429_backend_fails_over() {
    fails_over("fail-429", "ok-429", "down-429", 10).await;
}

#[tokio::test]
async fn a_refused_connection_fails_over() {
    fails_over("refused", "ok-refused", "", 10).await;
}

#[tokio::test]
async fn a_backend_past_its_timeout_fails_over() {
    let started = Instant::now();
    fails_over("slow", "ok-slow", "stall", 6).await;
    // Every stalled attempt gave up after its 1 s, not the stall's 60 s.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_failed_over_request_is_metered_once_like_any_other() {
    let s = stack();
    let r = call(s, "meter", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let baseline = events_of(s, "meter", 1).await;
    // 503 first, then served by the other backend: the same tokens, one event, one count.
    let n = 6;
    let mut remaining = Vec::new();
    for _ in 0..n {
        // Mia calls nothing else: her request count moves with these requests only.
        let r = call_as(s, "mia-token", "fail-meter", json!({})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        remaining.push(
            r.header("x-ratelimit-remaining-requests")
                .and_then(|v| v.parse::<u64>().ok())
                .expect("the filter counted the request"),
        );
    }
    // Each request took one from the tier's request limit, failed over or not.
    for pair in remaining.windows(2) {
        assert_eq!(pair[0] - 1, pair[1], "{remaining:?}");
    }
    let tried = chats("down-meter");
    assert!(tried > 0, "no request failed over in {n}");
    assert_eq!(chats("ok-meter"), n);
    let events = events_of(s, "fail-meter", n).await;
    for e in &events {
        assert_eq!(metered(e), metered(&baseline[0]), "{e}");
        assert_eq!(e["status"], 200, "{e}");
        assert_eq!(e["served_by"], "up", "{e}");
    }
    assert_eq!(baseline[0]["served_by"], "only");
    assert_eq!(
        ledger_by_backend(s, "mia-token", "fail-meter", n).await,
        BTreeMap::from([("up".to_string(), n)])
    );
}

#[tokio::test]
async fn the_ledger_counts_per_backend_what_the_access_log_says_served() {
    let s = stack();
    let n = 40;
    for _ in 0..n {
        let r = call(s, "ledger", json!({})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header(maas_types::SERVED_BY_HEADER),
            None,
            "not for the client"
        );
    }
    let (a, b) = (chats("ledger-a"), chats("ledger-b"));
    assert_eq!(a + b, n);
    assert!(a > 0 && b > 0, "75/25 weights gave {a}/{b}");
    let events = events_of(s, "ledger", n).await;
    let logged = served_by(&events);
    assert_eq!(
        logged,
        BTreeMap::from([("a".to_string(), a), ("b".to_string(), b)])
    );
    let ledger = ledger_by_backend(s, "alice-token", "ledger", n).await;
    eprintln!("backends::ledger: access log {logged:?}, ledger {ledger:?}");
    assert_eq!(ledger, logged, "exact per backend");
}

#[tokio::test]
async fn an_upstreams_own_served_by_is_replaced_and_never_reaches_the_client() {
    let s = stack();
    let n = 5;
    for _ in 0..n {
        // The backend that serves (`real`) claims to be `decoy`, another backend of the model.
        let r = chat(
            s,
            "/llm/spoof/v1/chat/completions",
            "backends",
            &[
                ("authorization", &bearer("alice-token")),
                ("x-sim-served-by", "decoy"),
            ],
            json!({"model": "spoof", "max_tokens": 3,
                   "messages": [{"role": "user", "content": "one two"}]}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header(maas_types::SERVED_BY_HEADER),
            None,
            "{:?}",
            r.headers
        );
    }
    assert_eq!((chats("real"), chats("decoy")), (n, 0));
    let events = events_of(s, "spoof", n).await;
    assert_eq!(
        served_by(&events),
        BTreeMap::from([("real".to_string(), n)])
    );
    assert_eq!(
        ledger_by_backend(s, "alice-token", "spoof", n).await,
        BTreeMap::from([("real".to_string(), n)])
    );
}

#[tokio::test]
async fn a_model_without_backends_records_no_backend_whatever_its_upstream_says() {
    let s = stack();
    let n = 3;
    for _ in 0..n {
        let r = chat(
            s,
            "/llm/single/v1/chat/completions",
            "backends",
            &[
                ("authorization", &bearer("bea-token")),
                ("x-sim-served-by", "single"),
            ],
            json!({"model": "single", "max_tokens": 3,
                   "messages": [{"role": "user", "content": "one two"}]}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        // The filter removes the upstream's copy (no route sets one here).
        assert_eq!(
            r.header(maas_types::SERVED_BY_HEADER),
            None,
            "{:?}",
            r.headers
        );
    }
    assert_eq!(chats("single"), n);
    // Bea's ledger has the requests (by model) and no backend row for them.
    let start = Instant::now();
    loop {
        let r = send(
            client()
                .get(format!(
                    "{}/maas-api/v1/usage?groupBy=model",
                    s.gateway_url()
                ))
                .bearer_auth("bea-token"),
        )
        .await;
        let v = r.json();
        let requests: u64 = v["data"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter(|row| row["model"] == "single")
            .map(|row| row["requests"].as_u64().unwrap_or(0))
            .sum();
        if requests == n as u64 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "bea's ledger by model: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        ledger_by_backend(s, "bea-token", "single", 0).await,
        BTreeMap::new()
    );
}

#[tokio::test]
async fn a_backend_failing_after_the_first_byte_is_not_retried() {
    let s = stack();
    let n = 4;
    for _ in 0..n {
        let resp = client()
            .post(format!("{}/llm/drops/v1/chat/completions", s.gateway_url()))
            .header("authorization", bearer("alice-token"))
            .json(&json!({"model": "drops", "max_tokens": 8, "stream": true,
                          "messages": [{"role": "user", "content": "one two"}]}))
            .send()
            .await
            .expect("gateway answers");
        assert_eq!(resp.status(), 200, "the stream started");
        let body = resp.bytes().await;
        let text = body
            .as_ref()
            .map(|b| String::from_utf8_lossy(b).to_string())
            .unwrap_or_default();
        assert!(
            body.is_err() || !text.contains("[DONE]"),
            "the client sees the broken stream, not a second one: {text}"
        );
        assert!(
            text.matches("\"role\":\"assistant\"").count() <= 1,
            "one stream's start only: {text}"
        );
    }
    let tried = chats("drop-a") + chats("drop-b");
    assert_eq!(tried, n, "each request reached one backend, once");
    let events = events_of(s, "drops", n).await;
    for e in &events {
        assert_eq!(e["event"]["forwarded"], true, "{e}");
    }
}

/// A streamed chat for `model`: status and the whole body (an error reading it: `None`).
async fn stream(stack: &Stack, model: &str, headers: &[(&str, &str)]) -> (u16, Option<String>) {
    let mut req = client()
        .post(format!(
            "{}/llm/{model}/v1/chat/completions",
            stack.gateway_url()
        ))
        .header("authorization", bearer("alice-token"))
        .json(&json!({"model": model, "max_tokens": 8, "stream": true,
                      "messages": [{"role": "user", "content": "one two"}]}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("gateway answers");
    let status = resp.status().as_u16();
    let body = resp
        .bytes()
        .await
        .ok()
        .map(|b| String::from_utf8_lossy(&b).to_string());
    (status, body)
}

#[tokio::test]
async fn a_stream_fails_over_before_its_first_byte() {
    let s = stack();
    let n = 6;
    for _ in 0..n {
        let (status, body) = stream(s, "stream-503", &[]).await;
        assert_eq!(status, 200);
        let body = body.expect("the whole stream");
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        assert_eq!(body.matches("[DONE]").count(), 1, "{body}");
    }
    assert_eq!(chats("ok-s503"), n);
    assert!(chats("down-s503") > 0, "no stream failed over");
    let events = events_of(s, "stream-503", n).await;
    assert_eq!(served_by(&events), BTreeMap::from([("up".to_string(), n)]));
}

#[tokio::test]
async fn a_stream_longer_than_the_timeout_is_not_cut_once_it_started() {
    let s = stack();
    // 8 chunks 300 ms apart: about 2.4 s in all, each gap under the 1 s timeout.
    let started = Instant::now();
    let (status, body) = stream(s, "long", &[("x-sim-chunk-delay-ms", "300")]).await;
    assert_eq!(status, 200);
    let body = body.expect("the whole stream");
    assert!(
        started.elapsed() > Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let tried = chats("long-a") + chats("long-b");
    assert_eq!(tried, 1, "not retried");
}

/// A stream that started and then goes quiet for longer than its tries could take (the stream
/// idle timeout: each backend's timeout, summed, plus 1 s; here 2 × 1 s + 1 s) is cut, not
/// retried — the client has part of an answer — and settled once.
#[tokio::test]
async fn a_stream_quiet_for_longer_than_the_timeout_is_cut_not_retried() {
    let s = stack();
    // The first chunk at once, then 5 s between chunks: past the 3 s idle timeout.
    let started = Instant::now();
    let (status, body) = stream(s, "idle", &[("x-sim-chunk-delay-ms", "5000")]).await;
    let took = started.elapsed();
    assert_eq!(status, 200, "the stream started");
    let text = body.unwrap_or_default();
    assert!(!text.contains("[DONE]"), "cut before its end: {text}");
    // Seen cut after 3 s on its own and after 2 s in the full suite: what is promised is the
    // cut before the next chunk (without the route's idle timeout the stream ran to its end).
    assert!(
        took < Duration::from_millis(4900),
        "cut before the next chunk: {took:?}"
    );
    assert_eq!(chats("idle-a") + chats("idle-b"), 1, "not retried");
    let events = events_of(s, "idle", 1).await;
    assert_eq!(events[0]["event"]["forwarded"], true, "{}", events[0]);
}

#[tokio::test]
async fn with_every_backend_down_the_client_gets_the_last_answer_after_one_try_each() {
    let s = stack();
    let n = 4;
    for _ in 0..n {
        let r = call(s, "all-down", json!({})).await;
        let e = r.error(503);
        assert_eq!(
            e["message"], "simulated overload",
            "the backend's own answer"
        );
    }
    let a = chats("down-a");
    let b = chats("down-b");
    assert_eq!(
        (a, b),
        (n, n),
        "each backend tried once per request, no more"
    );
    let events = events_of(s, "all-down", n).await;
    for e in &events {
        assert_eq!(e["status"], 503, "{e}");
    }
}

/// A backend without a provider that keeps failing is ejected for its cooldown (Envoy's outlier
/// detection, from the model's `cooldown`): after a few failed attempts no request is sent to
/// it, and every request is answered by the other.
#[tokio::test]
async fn a_backend_that_keeps_failing_is_left_alone_for_its_cooldown() {
    let s = stack();
    let n = 30;
    for _ in 0..n {
        let r = call(s, "cooling", json!({})).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let tried = chats("cool-down");
    eprintln!("backends::cooldown: the failing backend was tried {tried} times in {n}");
    // Two failures in a row eject it (a request or two more may be on their way while Envoy's
    // main thread ejects it); without a cooldown round robin tries it about every other time.
    assert!((2..=6).contains(&tried), "tried {tried} times");
    assert_eq!(chats("cool-up"), n);
    for _ in 0..10 {
        let r = call(s, "cooling", json!({})).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(chats("cool-down"), tried, "not tried again while it cools");
    let events = events_of(s, "cooling", n + 10).await;
    assert_eq!(
        served_by(&events),
        BTreeMap::from([("up".to_string(), n + 10)])
    );
}

/// `ready` of each model in alice's `GET /maas-api/v1/models`.
async fn readiness(stack: &Stack) -> BTreeMap<String, bool> {
    let r = send(
        client()
            .get(format!("{}/maas-api/v1/models", stack.gateway_url()))
            .bearer_auth("alice-token"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap_or_default().to_string(),
                m["ready"].as_bool().expect("ready"),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_model_is_ready_while_one_of_its_backends_is() {
    let ready = readiness(stack()).await;
    assert_eq!(ready.get("spread"), Some(&true), "{ready:?}");
    assert_eq!(
        ready.get("refused"),
        Some(&true),
        "one backend up: {ready:?}"
    );
    assert_eq!(
        ready.get("all-down"),
        Some(&false),
        "every backend 503: {ready:?}"
    );
}

/// The `model` of each chat body simulator `name` received, with whether its `content-length`
/// (when sent) is the body's own length.
fn models_received(name: &str) -> Vec<(String, bool)> {
    sims()[name]
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .map(|r| {
            let body: Value = serde_json::from_str(&r.body).expect("a JSON body");
            let framed = r
                .header("content-length")
                .is_none_or(|n| n.parse::<usize>().ok() == Some(r.body.len()));
            (body["model"].as_str().unwrap_or("-").to_string(), framed)
        })
        .collect()
}

/// Sends `n` chat completions to `model`: even ones over HTTP/1.1 with a `content-length`, odd
/// ones over HTTP/2 with the body in two DATA frames ended by trailers (no `content-length`).
/// Each must be answered 200 with a chat completion.
async fn renamed_calls(s: &Stack, model: &str, n: usize) {
    for i in 0..n {
        let r = if i % 2 == 0 {
            call(s, model, json!({})).await
        } else {
            let body = json!({"model": model, "max_tokens": 3,
                              "messages": [{"role": "user", "content": "one two three"}]});
            let req = maas_e2e::h2client::FramedRequest::post_json(
                &format!("/llm/{model}/v1/chat/completions"),
                &body,
            )
            .header("authorization", &bearer("alice-token"))
            .split_into(2)
            .trailers(&[("x-trailer", "1")]);
            let r = maas_e2e::h2client::send_h2c(s.gateway_addr(), &req)
                .await
                .expect("an HTTP/2 answer");
            Reply {
                status: r.status,
                body: r.text(),
                headers: r.headers,
            }
        };
        assert_eq!(r.status, 200, "{model} #{i}: {}", r.body);
        assert_eq!(r.json()["object"], "chat.completion", "{}", r.body);
    }
}

fn own_name((m, framed): &(String, bool)) -> bool {
    m == "own-name" && *framed
}

fn served_name((m, framed): &(String, bool)) -> bool {
    m == "model-served" && *framed
}

/// A backend with a served name of its own (the reference's per-binding `targetModel`) gets it
/// in the body's `model` on each of its attempts, whatever the client sent and over HTTP/1.1
/// or HTTP/2 with trailers; a failover from it to a backend without one sends that backend the
/// model's served name — never the first attempt's rewrite, nor its `content-length` — and the
/// other way round. Every request is answered once, and counted once against the backend that
/// served.
#[tokio::test]
async fn each_backend_gets_its_own_served_name_across_a_failover() {
    let s = stack();
    let n = 8;
    renamed_calls(s, "renamed-own-down", n).await;
    renamed_calls(s, "renamed-plain-down", n).await;
    // own fails over to plain: every request reached plain with the model's served name.
    let (tried, served) = (models_received("own-down"), models_received("plain-up"));
    eprintln!(
        "backends::served_names: own-down tried {}, plain-up served {}",
        tried.len(),
        served.len()
    );
    assert!(!tried.is_empty(), "no request failed over");
    assert!(tried.iter().all(own_name), "{tried:?}");
    assert_eq!(served.len(), n);
    assert!(served.iter().all(served_name), "{served:?}");
    // plain fails over to own: every request reached own with its own name.
    let (tried, served) = (models_received("plain-down"), models_received("own-up"));
    assert!(!tried.is_empty(), "no request failed over");
    assert!(tried.iter().all(served_name), "{tried:?}");
    assert_eq!(served.len(), n);
    assert!(served.iter().all(own_name), "{served:?}");
    let events = events_of(s, "renamed-own-down", n).await;
    assert_eq!(
        served_by(&events),
        BTreeMap::from([("plain".to_string(), n)])
    );
    let events = events_of(s, "renamed-plain-down", n).await;
    assert_eq!(served_by(&events), BTreeMap::from([("own".to_string(), n)]));
}

/// Without `pauseHeadersForBody` (and so without Envoy's allow_on_headers_stop_iteration on the
/// upstream filter) a held attempt's body would never reach the filter (the request would wait
/// for its per-try timeout): the headers go first, without the `content-length` an earlier
/// attempt or the client set, and the renamed body follows. The same failover, through a stack
/// configured so: every request answered, each backend its own name, every body framed right.
#[tokio::test]
async fn without_held_headers_a_renamed_body_follows_its_headers() {
    static S: ModuleStack<Stack> = ModuleStack::new();
    let s = S.get_or_start(|| {
        static POLICY: OnceLock<String> = OnceLock::new();
        let policy = POLICY.get_or_init(|| {
            policy_of(&renamed_model(
                "renamed-unheld",
                "own-down-unheld",
                "plain-up-unheld",
            ))
        });
        start_stack(
            policy,
            IDENTITIES,
            "credentials: {}\n",
            Some(json!({"pauseHeadersForBody": false})),
        )
    });
    let n = 4;
    renamed_calls(s, "renamed-unheld", n).await;
    // Framing: each request's `content-length`, when Envoy sent one (it may, once it holds the
    // whole rewritten body before the connection is ready), is its body's length; else chunked.
    let (tried, served) = (
        models_received("own-down-unheld"),
        models_received("plain-up-unheld"),
    );
    assert!(!tried.is_empty(), "no request failed over");
    assert!(tried.iter().all(own_name), "{tried:?}");
    assert_eq!(served.len(), n);
    assert!(served.iter().all(served_name), "{served:?}");
}
