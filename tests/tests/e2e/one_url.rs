//! The one base URL (issue 28) through real Envoy with the release .wasm: `POST {gateway}/v1/…`
//! with the model named in the body. The filter holds the headers, reads `model`, finds the
//! model (name or alias) and the caller's right to it, and sets `x-maas-model`; Envoy's routes
//! for `/v1/…` match that header, and Envoy chooses the route again after the filter changed the
//! headers — shown here by two models on two backends (two simulators, two clusters) behind one
//! URL, each request landing on its own. Refusals at the body never reach a backend; the served
//! name is given to the body (the reference's own sample: `facebook-opt-125m-simulated` serving
//! `facebook/opt-125m` on a simulator that, as vLLM, serves only that name); `GET /v1/models` is
//! answered by the gateway; one budget whichever URL form spends it.
//!
//! Windows are a day long so that no test straddles a window boundary.

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::sim::{self, SimConfig, SimHandle};
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::time::Duration;

const IDENTITIES: &str = r#"
identities:
  - {token: free-token, username: freda, groups: [g-free]}
  - {token: premium-token, username: pat, groups: [g-premium]}
  - {token: budget-token, username: bud, groups: [g-free]}
  - {token: list-token, username: lis, groups: [g-free]}
"#;

/// The vLLM-like simulator behind `facebook-opt-125m-simulated`: it serves only
/// `facebook/opt-125m`.
fn opt_sim() -> &'static SimHandle {
    static SIM: OnceLock<SimHandle> = OnceLock::new();
    SIM.get_or_init(|| {
        sim::spawn(
            "127.0.0.1:0".parse().unwrap(),
            SimConfig {
                chunk_delay: Duration::ZERO,
                models: vec!["facebook/opt-125m".into()],
                served_only: true,
            },
        )
        .expect("the second simulator starts")
    })
}

fn policy() -> &'static str {
    static POLICY: OnceLock<String> = OnceLock::new();
    POLICY.get_or_init(|| {
        format!(
            r#"
tiers:
  - name: free
    level: 1
    groups: [g-free]
    limits:
      tokens: [{{limit: 100000, window: 1d}}]
    defaultMaxTokens: 20
  - name: premium
    level: 2
    groups: [g-premium]
    limits:
      tokens: [{{limit: 100000, window: 1d}}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, premium]
    backend: simulator
  - name: facebook-opt-125m-simulated
    aliases: [publishers/llm/models/opt-125m, opt]
    servedName: facebook/opt-125m
    path: /llm/facebook-opt-125m-simulated
    tiers: [free, premium]
    backend: {}
    upstreamCluster: opt-sim
  - name: premium-model
    path: /llm/premium-model
    tiers: [premium]
    backend: simulator
  - name: sim-claude
    path: /llm/sim-claude
    tiers: [free, premium]
    backend: simulator
    api: anthropic
"#,
            opt_sim().url()
        )
    })
}

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, policy(), IDENTITIES, "credentials: {}\n")
}

fn chat_body(model: &str) -> Value {
    json!({"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi there"}]})
}

async fn post(url: &str, cred: &str, test_id: &str, body: Value) -> Reply {
    send(
        client()
            .post(url)
            .header("authorization", bearer(cred))
            .header("x-test-id", test_id)
            .json(&body),
    )
    .await
}

/// What both simulators received for `test_id`: (the stack's, the opt simulator's).
fn seen(stack: &Stack, test_id: &str) -> (Vec<sim::RecordedRequest>, Vec<sim::RecordedRequest>) {
    let opt = opt_sim()
        .requests()
        .into_iter()
        .filter(|r| r.header("x-test-id") == Some(test_id))
        .collect();
    (stack.sim_requests_with_test_id(test_id), opt)
}

fn body_of(r: &sim::RecordedRequest) -> Value {
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.body))
}

#[tokio::test]
async fn one_url_routes_each_model_by_the_body_to_its_own_backend() {
    let stack = stack();
    let url = format!("{}/v1/chat/completions", stack.gateway_url());

    let r = post(&url, "free-token", "one-sim", chat_body("sim-model")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "sim-model");
    let (on_sim, on_opt) = seen(stack, "one-sim");
    assert_eq!(
        (on_sim.len(), on_opt.len()),
        (1, 0),
        "sim-model: its own backend"
    );
    assert_eq!(on_sim[0].path, "/v1/chat/completions");
    assert_eq!(body_of(&on_sim[0])["model"], "sim-model");

    // The other model, by its name, an alias with slashes and a short alias: the other
    // backend, which serves only its served name — the body's `model` was given it, with a
    // content-length that fits.
    for (i, id) in [
        "facebook-opt-125m-simulated",
        "publishers/llm/models/opt-125m",
        "opt",
    ]
    .iter()
    .enumerate()
    {
        let test_id = format!("one-opt-{i}");
        let r = post(&url, "free-token", &test_id, chat_body(id)).await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        assert_eq!(r.json()["model"], "facebook/opt-125m");
        let (on_sim, on_opt) = seen(stack, &test_id);
        assert_eq!(
            (on_sim.len(), on_opt.len()),
            (0, 1),
            "{id}: the opt backend"
        );
        assert_eq!(on_opt[0].path, "/v1/chat/completions");
        assert_eq!(body_of(&on_opt[0])["model"], "facebook/opt-125m");
        assert_eq!(
            on_opt[0].header("content-length"),
            Some(on_opt[0].body.len().to_string().as_str()),
            "{:?}",
            on_opt[0].headers
        );
        // The routing header did its work at the gateway; the backend is not told.
        assert_eq!(on_opt[0].header("x-maas-model"), None);
    }
}

#[tokio::test]
async fn streams_at_the_one_url_reach_each_model_with_usage_counted() {
    let stack = stack();
    let url = format!("{}/v1/chat/completions", stack.gateway_url());
    for (model, test_id) in [
        ("sim-model", "one-stream-sim"),
        ("facebook-opt-125m-simulated", "one-stream-opt"),
    ] {
        let body = json!({"model": model, "max_tokens": 3, "stream": true,
                          "messages": [{"role": "user", "content": "hi"}]});
        let r = post(&url, "free-token", test_id, body).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        assert!(r.body.contains("data: [DONE]"), "{}", r.body);
        assert!(
            !r.body.contains("\"usage\":{"),
            "usage event stripped: {}",
            r.body
        );
        let (on_sim, on_opt) = seen(stack, test_id);
        let got = if model == "sim-model" {
            &on_sim
        } else {
            &on_opt
        };
        assert_eq!(on_sim.len() + on_opt.len(), 1, "{model}");
        assert_eq!(got.len(), 1, "{model}: its own backend");
        assert_eq!(body_of(&got[0])["stream_options"]["include_usage"], true);
    }
}

#[tokio::test]
async fn the_served_name_is_given_at_the_path_prefix_too() {
    let stack = stack();
    let url = format!(
        "{}/llm/facebook-opt-125m-simulated/v1/chat/completions",
        stack.gateway_url()
    );
    for (i, id) in ["facebook-opt-125m-simulated", "opt"].iter().enumerate() {
        let test_id = format!("prefix-opt-{i}");
        let r = post(&url, "free-token", &test_id, chat_body(id)).await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        let (_, on_opt) = seen(stack, &test_id);
        assert_eq!(on_opt.len(), 1);
        assert_eq!(body_of(&on_opt[0])["model"], "facebook/opt-125m");
    }
    // The simulator serves only its served name, as vLLM does: straight at it, the MaaS name
    // is a 404 (what a client got before the gateway rewrote the body).
    let r = send(
        client()
            .post(format!("{}/v1/chat/completions", opt_sim().url()))
            .json(&chat_body("facebook-opt-125m-simulated")),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "NotFoundError");
}

#[tokio::test]
async fn anthropic_messages_and_count_tokens_at_the_one_url() {
    let stack = stack();
    let base = stack.gateway_url();
    let body = json!({"model": "sim-claude", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hello there"}]});
    let r = send(
        client()
            .post(format!("{base}/v1/messages"))
            .header("x-api-key", "free-token")
            .header("anthropic-version", "2023-06-01")
            .header("x-test-id", "one-messages")
            .json(&body),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["type"], "message");
    assert_eq!(stack.sim_requests_with_test_id("one-messages").len(), 1);
    let r = send(
        client()
            .post(format!("{base}/v1/messages/count_tokens"))
            .header("x-api-key", "free-token")
            .header("anthropic-version", "2023-06-01")
            .header("x-test-id", "one-count")
            .json(&json!({"model": "sim-claude",
                          "messages": [{"role": "user", "content": "a b c"}]})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["input_tokens"], 3);
    // A chat model's id at the Messages URL: the model does not serve that operation.
    let r = send(
        client()
            .post(format!("{base}/v1/messages"))
            .header("x-api-key", "free-token")
            .header("x-test-id", "one-messages-wrong")
            .json(&json!({"model": "sim-model", "max_tokens": 4,
                          "messages": [{"role": "user", "content": "x"}]})),
    )
    .await;
    assert_eq!(r.error(404)["code"], "operation_not_allowed");
    assert!(
        stack
            .sim_requests_with_test_id("one-messages-wrong")
            .is_empty()
    );
}

/// Each refusal at the one base URL: OpenAI-style JSON, and nothing reaches either backend.
#[tokio::test]
async fn refusals_at_the_body_never_reach_a_backend() {
    let stack = stack();
    let base = stack.gateway_url();
    let url = format!("{base}/v1/chat/completions");
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        (
            "ref-no-model",
            json!({"messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (
            "ref-null-model",
            json!({"model": null, "messages": []}),
            404,
            "model_not_found",
        ),
        (
            "ref-unknown",
            chat_body("no-such-model"),
            404,
            "model_not_found",
        ),
        (
            "ref-served-name",
            chat_body("facebook/opt-125m"),
            404,
            "model_not_found",
        ),
        ("ref-case", chat_body("SIM-MODEL"), 404, "model_not_found"),
        (
            "ref-not-allowed",
            chat_body("premium-model"),
            403,
            "model_not_allowed",
        ),
        (
            "ref-model-number",
            json!({"model": 7, "messages": []}),
            400,
            "invalid_body",
        ),
    ];
    let mut wrong = Vec::new();
    for (test_id, body, status, code) in cases {
        let r = post(&url, "free-token", test_id, body).await;
        let e = r.error(status);
        if e["code"] != code {
            wrong.push(format!("{test_id}: {} {e}", r.status));
        }
    }
    // The same model by its path prefix gives the same answer (status and code).
    let r = post(
        &format!("{base}/llm/premium-model/v1/chat/completions"),
        "free-token",
        "ref-path-not-allowed",
        chat_body("premium-model"),
    )
    .await;
    assert_eq!(r.error(403)["code"], "model_not_allowed");
    assert!(wrong.is_empty(), "{wrong:#?}");
    for test_id in [
        "ref-no-model",
        "ref-null-model",
        "ref-unknown",
        "ref-served-name",
        "ref-case",
        "ref-not-allowed",
        "ref-model-number",
        "ref-path-not-allowed",
    ] {
        let (on_sim, on_opt) = seen(stack, test_id);
        assert!(
            on_sim.is_empty() && on_opt.is_empty(),
            "{test_id} reached a backend"
        );
    }
}

/// Bodies that are not JSON objects, no credential, a GET at a POST operation: refused, and
/// nothing reaches either backend.
#[tokio::test]
async fn unreadable_requests_at_the_one_url_never_reach_a_backend() {
    let stack = stack();
    let url = format!("{}/v1/chat/completions", stack.gateway_url());
    // Not JSON; a JSON array; an empty body; no credential; a GET at a POST operation.
    for (test_id, text, status) in [
        ("ref-not-json", "model=sim-model", 400),
        ("ref-array", "[{\"model\":\"sim-model\"}]", 400),
        ("ref-empty", "", 404),
    ] {
        let r = send(
            client()
                .post(&url)
                .header("authorization", "Bearer free-token")
                .header("content-type", "application/json")
                .header("x-test-id", test_id)
                .body(text),
        )
        .await;
        r.error(status);
    }
    let r = send(
        client()
            .post(&url)
            .header("x-test-id", "ref-no-cred")
            .json(&chat_body("sim-model")),
    )
    .await;
    r.error(401);
    let r = send(
        client()
            .get(&url)
            .header("authorization", "Bearer free-token")
            .header("x-test-id", "ref-get"),
    )
    .await;
    assert_eq!(r.error(404)["code"], "operation_not_allowed");
    for test_id in [
        "ref-not-json",
        "ref-array",
        "ref-empty",
        "ref-no-cred",
        "ref-get",
    ] {
        let (on_sim, on_opt) = seen(stack, test_id);
        assert!(
            on_sim.is_empty() && on_opt.is_empty(),
            "{test_id} reached a backend"
        );
    }
}

/// Attackers: the client's own routing header, in any spelling, picks nothing.
#[tokio::test]
async fn the_client_cannot_pick_the_route() {
    let stack = stack();
    let url = format!("{}/v1/chat/completions", stack.gateway_url());
    // Its own header naming a model it may not use, the body naming one it may: the body's.
    let r = send(
        client()
            .post(&url)
            .header("authorization", "Bearer free-token")
            .header("x-test-id", "atk-header")
            .header("x-maas-model", "premium-model")
            .json(&chat_body("sim-model")),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "sim-model");
    let got = stack.sim_requests_with_test_id("atk-header");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].header("x-maas-model"), None, "{:?}", got[0].headers);
    // Its header and the body both naming the forbidden model: 403, as without the header.
    let r = send(
        client()
            .post(&url)
            .header("authorization", "Bearer free-token")
            .header("x-test-id", "atk-both")
            .header("x-maas-model", "premium-model")
            .json(&chat_body("premium-model")),
    )
    .await;
    assert_eq!(r.error(403)["code"], "model_not_allowed");
    // The header at a model's path prefix picks nothing either.
    let r = send(
        client()
            .post(format!(
                "{}/llm/sim-model/v1/chat/completions",
                stack.gateway_url()
            ))
            .header("authorization", "Bearer free-token")
            .header("x-test-id", "atk-prefix-header")
            .header("x-maas-model", "premium-model")
            .json(&chat_body("sim-model")),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let got = stack.sim_requests_with_test_id("atk-prefix-header");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].header("x-maas-model"), None);
    // The underscore spelling: the connection manager refuses it (the stack's setting).
    let status = raw_json_request(
        stack.gateway_addr(),
        "POST",
        "/v1/chat/completions",
        &[
            ("authorization", "Bearer free-token"),
            ("x-test-id", "atk-underscore"),
            ("x_maas_model", "premium-model"),
        ],
        &chat_body("premium-model").to_string(),
    )
    .unwrap();
    assert_eq!(status, 400);

    for test_id in ["atk-both", "atk-underscore"] {
        let (on_sim, on_opt) = seen(stack, test_id);
        assert!(
            on_sim.is_empty() && on_opt.is_empty(),
            "{test_id} reached a backend"
        );
    }
}

/// `model` twice is refused (parsers disagree on which one counts: serde_json's derive refuses,
/// Python's json and pydantic take the last); a gzip body the filter cannot read is refused; a
/// body in pieces is read whole.
#[tokio::test]
async fn duplicated_unreadable_and_split_bodies() {
    let stack = stack();
    let url = format!("{}/v1/chat/completions", stack.gateway_url());
    // `model` twice: refused, whichever one a backend would read.
    for (test_id, text) in [
        (
            "atk-dup",
            r#"{"model":"sim-model","model":"premium-model","messages":[]}"#,
        ),
        (
            "atk-dup2",
            r#"{"model":"premium-model","messages":[],"model":"sim-model"}"#,
        ),
    ] {
        let r = send(
            client()
                .post(&url)
                .header("authorization", "Bearer free-token")
                .header("content-type", "application/json")
                .header("x-test-id", test_id)
                .body(text),
        )
        .await;
        let e = r.error(400);
        assert_eq!(e["code"], "invalid_body", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("more than once"),
            "{e}"
        );
    }

    // A gzip-encoded body: not read as JSON, so refused.
    let gz = {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(chat_body("sim-model").to_string().as_bytes())
            .unwrap();
        enc.finish().unwrap()
    };
    let r = send(
        client()
            .post(&url)
            .header("authorization", "Bearer free-token")
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .header("x-test-id", "atk-gzip")
            .body(gz),
    )
    .await;
    assert_eq!(r.error(400)["code"], "invalid_body");

    // A body in pieces (chunked, with pauses between them): read whole, routed by its model.
    let text = chat_body("facebook-opt-125m-simulated").to_string();
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
        text.as_bytes().chunks(7).map(|c| Ok(c.to_vec())).collect();
    let slow = futures_util::StreamExt::then(futures_util::stream::iter(pieces), |p| async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        p
    });
    let r = send(
        client()
            .post(&url)
            .header("authorization", "Bearer free-token")
            .header("content-type", "application/json")
            .header("x-test-id", "atk-pieces")
            .body(reqwest::Body::wrap_stream(slow)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    for test_id in ["atk-dup", "atk-dup2", "atk-gzip"] {
        let (on_sim, on_opt) = seen(stack, test_id);
        assert!(
            on_sim.is_empty() && on_opt.is_empty(),
            "{test_id} reached a backend"
        );
    }
    let (on_sim, on_opt) = seen(stack, "atk-pieces");
    assert_eq!((on_sim.len(), on_opt.len()), (0, 1));
    assert_eq!(body_of(&on_opt[0])["model"], "facebook/opt-125m");
}

/// `GET /v1/models` at the gateway: the caller's models (aliases not listed as models of their
/// own), answered without a backend; `GET /v1/models/{id}` one of them, by name or alias.
#[tokio::test]
async fn the_gateway_lists_the_callers_models() {
    let stack = stack();
    let base = stack.gateway_url();
    let get = |cred: &'static str, path: String| {
        let url = format!("{base}{path}");
        async move {
            send(
                client()
                    .get(url)
                    .header("authorization", bearer(cred))
                    .header("x-test-id", "models-list"),
            )
            .await
        }
    };
    let ids = |r: &Reply| -> Vec<String> {
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "list");
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                assert_eq!(m["object"], "model", "{m}");
                assert!(m["created"].is_u64() && m["owned_by"].is_string(), "{m}");
                m["id"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let free = ids(&get("list-token", "/v1/models".into()).await);
    assert_eq!(
        free,
        ["sim-model", "facebook-opt-125m-simulated", "sim-claude"]
    );
    let premium = ids(&get("premium-token", "/v1/models".into()).await);
    assert_eq!(
        premium,
        [
            "sim-model",
            "facebook-opt-125m-simulated",
            "premium-model",
            "sim-claude"
        ]
    );
    let r = get(
        "list-token",
        "/v1/models/publishers/llm/models/opt-125m".into(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], "facebook-opt-125m-simulated");
    let r = get("list-token", "/v1/models/premium-model".into()).await;
    assert_eq!(r.error(404)["code"], "model_not_found");
    let r = get("premium-token", "/v1/models/premium-model".into()).await;
    assert_eq!(r.json()["id"], "premium-model");
    let r = send(client().get(format!("{base}/v1/models"))).await;
    r.error(401);
    let r = send(
        client()
            .post(format!("{base}/v1/models"))
            .header("authorization", "Bearer list-token"),
    )
    .await;
    r.error(404);
    let (on_sim, on_opt) = seen(stack, "models-list");
    assert!(on_sim.is_empty() && on_opt.is_empty());
}

/// One budget: tokens spent at the one base URL and at the path prefix draw on one counter.
#[tokio::test]
async fn one_budget_whichever_url_form_spends_it() {
    let stack = stack();
    let base = stack.gateway_url();
    let remaining = |r: &Reply| -> u64 {
        assert_eq!(r.status, 200, "{}", r.body);
        r.header("x-ratelimit-remaining-tokens")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no x-ratelimit-remaining-tokens: {:?}", r.headers))
    };
    let spent = |r: &Reply| -> u64 { r.json()["usage"]["total_tokens"].as_u64().unwrap() };
    let one = format!("{base}/v1/chat/completions");
    let prefix = format!("{base}/llm/sim-model/v1/chat/completions");
    let r1 = post(&one, "budget-token", "budget-1", chat_body("sim-model")).await;
    let after1 = remaining(&r1);
    let r2 = post(&prefix, "budget-token", "budget-2", chat_body("sim-model")).await;
    let after2 = remaining(&r2);
    let r3 = post(&one, "budget-token", "budget-3", chat_body("sim-model")).await;
    let after3 = remaining(&r3);
    // Each answer's remaining is read after its own reservation; the next request sees the
    // previous one settled at its real usage.
    let reservation = 100_000 - after1;
    assert!(reservation >= spent(&r1), "{reservation}");
    assert_eq!(
        after2,
        100_000 - spent(&r1) - reservation,
        "prefix after one URL"
    );
    assert_eq!(
        after3,
        100_000 - spent(&r1) - spent(&r2) - reservation,
        "one URL after prefix"
    );
}

/// A gateway whose headers cannot be held for the body (an Istio WasmPlugin's default): the
/// one base URL is refused 503 `body_routing_unavailable` before anything goes upstream; the
/// path prefixes work as before.
#[tokio::test]
async fn without_held_headers_the_one_url_is_refused() {
    let stack = stack();
    let envoy = maas_e2e::extra_envoy::ExtraEnvoy::beside(stack, "no-hold", false, |v, _| {
        maas_e2e::envoy_config::continue_headers_before_body(v)
    })
    .unwrap_or_else(|e| panic!("the second Envoy did not start: {e:#}"));
    let base = envoy.gateway_url();
    let r = post(
        &format!("{base}/v1/chat/completions"),
        "free-token",
        "nohold-one",
        chat_body("sim-model"),
    )
    .await;
    assert_eq!(r.error(503)["code"], "body_routing_unavailable");
    let r = post(
        &format!("{base}/llm/sim-model/v1/chat/completions"),
        "free-token",
        "nohold-prefix",
        chat_body("sim-model"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (on_sim, on_opt) = seen(stack, "nohold-one");
    assert!(on_sim.is_empty() && on_opt.is_empty());
    assert_eq!(stack.sim_requests_with_test_id("nohold-prefix").len(), 1);
}

/// A route the gateway did not make for the model (here the opt model's one-URL route turned to
/// the other simulator's cluster): Envoy chooses it only after the filter let the request go,
/// so the filter checks the cluster that answered — that answer never reaches the client.
#[tokio::test]
async fn another_clusters_answer_at_the_one_url_never_reaches_the_client() {
    let stack = stack();
    let envoy = maas_e2e::extra_envoy::ExtraEnvoy::beside(stack, "foreign-route", false, |v, _| {
        let routes = v
            .pointer_mut(
                "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes",
            )
            .and_then(Value::as_array_mut)
            .ok_or_else(|| anyhow::anyhow!("no routes"))?;
        let mut turned = 0;
        for r in routes.iter_mut() {
            if r["match"]["headers"][0]["string_match"]["exact"] == "facebook-opt-125m-simulated" {
                r["route"]["cluster"] = json!(maas_e2e::envoy_config::SIMULATOR_CLUSTER);
                turned += 1;
            }
        }
        anyhow::ensure!(turned == 1, "the opt model's one-URL route: {turned}");
        Ok(())
    })
    .unwrap_or_else(|e| panic!("the second Envoy did not start: {e:#}"));
    let r = post(
        &format!("{}/v1/chat/completions", envoy.gateway_url()),
        "free-token",
        "foreign-route",
        chat_body("facebook-opt-125m-simulated"),
    )
    .await;
    assert_eq!(r.error(503)["code"], "upstream_mismatch");
    assert!(!r.body.contains("choices"), "{}", r.body);
    // It did reach the foreign cluster (that is what the check is for), not the model's.
    let (on_sim, on_opt) = seen(stack, "foreign-route");
    assert_eq!((on_sim.len(), on_opt.len()), (1, 0));
}

/// The official SDKs as users call the gateway (tests/sdk/clients.py, versions pinned in
/// tests/sdk/requirements.txt, `MAAS_SDK_PYTHON` from scripts/lib/common.sh's ensure step): one
/// OpenAI client with `base_url = {gateway}/v1` calls two models on two backends, not streamed
/// and streamed, and lists the models; the Anthropic client with `base_url = {gateway}` calls
/// Messages, not streamed and streamed.
#[tokio::test]
async fn the_official_sdks_use_the_one_base_url() {
    let stack = stack();
    let python = std::env::var("MAAS_SDK_PYTHON").expect(
        "MAAS_SDK_PYTHON: a Python with tests/sdk/requirements.txt (scripts/lib/common.sh \
         ensure_sdk_clients sets it)",
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/clients.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([
            stack.gateway_url().as_str(),
            "free-token",
            "sdk",
            "sim-model",
            "facebook-opt-125m-simulated",
        ])
        .env("ANTHROPIC_MODEL", "sim-claude")
        .output()
        .await
        .expect("the SDK script runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!(
        "openai {} anthropic {}",
        v["openai_version"], v["anthropic_version"]
    );
    for (model, answered_as) in [
        ("sim-model", "sim-model"),
        ("facebook-opt-125m-simulated", "facebook/opt-125m"),
    ] {
        let m = &v[model];
        assert_eq!(m["model"], answered_as, "{v}");
        assert_eq!(m["text"], "tok0 tok1 tok2", "{v}");
        assert_eq!(m["completion_tokens"], 3, "{v}");
        assert_eq!(m["stream_text"], "tok0 tok1 tok2", "{v}");
    }
    assert_eq!(
        v["models"],
        json!(["sim-model", "facebook-opt-125m-simulated", "sim-claude"])
    );
    assert_eq!(
        v["unknown"],
        json!({"status": 404, "code": "model_not_found"})
    );
    let a = &v["anthropic"];
    assert_eq!(a["type"], "message", "{v}");
    assert_eq!(a["text"], "tok0 tok1 tok2 tok3", "{v}");
    assert_eq!(a["stream_text"], "tok0 tok1 tok2 tok3", "{v}");
    assert_eq!(a["stream_output_tokens"], 4, "{v}");
    // Each call reached its own backend (the unknown model none).
    let (on_sim, on_opt) = seen(stack, "sdk");
    assert_eq!(on_opt.len(), 2, "the opt model's two calls");
    assert!(
        on_opt
            .iter()
            .all(|r| body_of(r)["model"] == "facebook/opt-125m")
    );
    let paths: Vec<&str> = on_sim.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/v1/chat/completions",
            "/v1/chat/completions",
            "/v1/messages",
            "/v1/messages"
        ],
        "sim-model's two chat calls and sim-claude's two Messages calls"
    );
}

/// The reference's inference guide (docs/content/user-guide/inference.md at v0.2.1), its curl
/// flow unchanged: `GET $MAAS_API_URL/v1/models` with an API key, `MODEL_URL=.data[i].url`,
/// `MODEL_NAME=.data[i].id`, then `POST $MODEL_URL/v1/chat/completions` with that model (and the
/// same with `"stream": true`). Each url is the gateway's own (`--public-url`), whatever `Host`
/// the client sends, and leads to the model's backend.
#[tokio::test]
async fn the_reference_inference_guides_curl_works_unchanged() {
    let stack = stack();
    let base = stack.gateway_url();
    let key = stack
        .mint_key_plain("list-token", "inference-guide")
        .await
        .unwrap();
    let list = send(
        client()
            .get(format!("{base}/v1/models"))
            .header("authorization", bearer(&key))
            .header("host", "evil.example.net"),
    )
    .await;
    assert_eq!(list.status, 200, "{}", list.body);
    let data = list.json()["data"].as_array().unwrap().clone();
    for entry in &data {
        let url = entry["url"]
            .as_str()
            .unwrap_or_else(|| panic!("no url: {entry}"));
        assert!(
            url.starts_with(&base),
            "{url} is not the gateway's ({base})"
        );
    }
    // The guide takes `.data[0]`; the first two are the stack's chat models (one on the stack's
    // simulator, one served under another name on its own).
    for (i, entry) in data.iter().take(2).enumerate() {
        let (model_url, model_name) = (
            entry["url"].as_str().unwrap(),
            entry["id"].as_str().unwrap(),
        );
        for stream in [false, true] {
            let test_id = format!("guide-{i}-{stream}");
            let mut body = json!({
                "model": model_name,
                "messages": [{"role": "user", "content": "Hello, how are you?"}],
                "max_tokens": 100,
            });
            if stream {
                body["stream"] = json!(true);
            }
            let r = post(
                &format!("{model_url}/v1/chat/completions"),
                &key,
                &test_id,
                body,
            )
            .await;
            assert_eq!(
                r.status, 200,
                "{model_url} {model_name} stream={stream}: {}",
                r.body
            );
            let (on_sim, on_opt) = seen(stack, &test_id);
            assert_eq!(
                on_sim.len() + on_opt.len(),
                1,
                "{test_id} reached one backend once"
            );
        }
    }
}
