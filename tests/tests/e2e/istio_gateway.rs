//! The Gateway's Envoy as Istio builds it from the objects `wasm-plugin-crs/` ships (issue 26
//! items 5 and 11), run with the real Envoy and the real `.wasm`: the filter installed by the
//! EnvoyFilter maas-filter (an HTTP filter first in the chain, its configuration delivered over
//! ECDS — read here from a file, as `path_config_source` — in the form the istio-agent hands it to
//! Envoy: the module a local file, its `ISTIO_META_*` variables gone), and the connection
//! manager settings of the EnvoyFilter maas-gateway-connection-manager merged in
//! (`maas_e2e::istio_gateway` says what is done by hand and why). Only the pluginConfig's
//! companion cluster and poll interval are the local stack's.
//!
//! - With the shipped knob (`allow_on_headers_stop_iteration`) and `pauseHeadersForBody`, a
//!   request refused on its body never opens an upstream request: Envoy's counter for the model
//!   cluster (`upstream_rq_total`) does not move, even for a body that arrives in two parts
//!   300 ms apart (the headers would have gone upstream meanwhile).
//! - Without the knob and the flag (what a WasmPlugin gives), that slow body refusal opens one:
//!   the same counter moves by one — the difference the knob makes, so the first test can fail.
//! - The flag without the knob (an Envoy older than 1.35, or an istiod that dropped the field):
//!   no request hangs; the filter finds out, lets requests go on as without the flag and sets
//!   `maas_headers_hold_unsupported`.
//! - The shipped connection manager settings refuse a header name with an underscore.
//! - The one base URL in the routes istiod generates from the sample model HTTPRoutes
//!   (`istio_gateway::istio_routes`): each sample model named in the body lands on its own
//!   backend, `x-maas-model` never reaches it, a body refusal opens no upstream request.
//! - The weighted sample (one model, routed backends OpenAI 3 : Azure 1) in those routes: every
//!   request at either URL form lands on the backend the filter drew, by the routes matching
//!   `x-maas-model` and `x-maas-backend`; both providers serve some, each with only its own
//!   credential and path; a client's own `x-maas-backend` chooses nothing.
//!
//! What only a cluster proves is in docs/deploy.md ("Holding headers for the body", "A model at
//! the one base URL").

use crate::helpers::*;
use maas_e2e::Stack;
use maas_e2e::envoy_config;
use maas_e2e::extra_envoy::ExtraEnvoy;
use maas_e2e::istio_gateway::{self, ShippedGateway};
use maas_e2e::sim::{self, SimConfig, SimHandle};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const BASE_POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1d}]
      tokens: [{limit: 500, window: 1d}]
  - name: premium
    level: 1
    groups: [g-premium]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
  - name: sim-premium
    path: /llm/sim-premium
    tiers: [premium]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: held-token, username: held, groups: [system:authenticated]}
  - {token: plugin-token, username: plugin, groups: [system:authenticated]}
  - {token: noknob-token, username: noknob, groups: [system:authenticated]}
  - {token: headers-token, username: headers, groups: [system:authenticated]}
  - {token: oneurl-token, username: oneurl, groups: [system:authenticated]}
  - {token: weighted-token, username: weighted, groups: [system:authenticated]}
"#;

/// The provider key of the sample external model (Secret openai-key in the samples).
const OPENAI_KEY: &str = "sk-sample-openai-key";
/// The key of the sample Azure OpenAI resource (Secret azure-openai-key).
const AZURE_KEY: &str = "sk-sample-azure-key";
/// The AWS credentials of the sample Bedrock model (Secret aws-bedrock).
const AWS_KEY_ID: &str = "AKIASAMPLEBEDROCK";
const AWS_SECRET: &str = "sample/bedrock/secret/access/key/0123456789";
/// The sample Bedrock model's id at Bedrock (its servedName in the shipped policy).
const BEDROCK_MODEL_ID: &str = "anthropic.claude-3-haiku-20240307-v1:0";

/// The models of the sample policy (wasm-plugin-crs/base/companion/policy-configmap.yaml: the
/// models the sample HTTPRoutes publish) in this module's free tier, beside the module's own.
/// Routed backends name no URL in the sample (their clusters are the operator's); the stack's
/// own bootstrap needs one for each, so they get the simulator's (the Istio-shaped Envoy
/// replaces those routes and clusters with the samples').
fn policy() -> &'static str {
    static POLICY: OnceLock<String> = OnceLock::new();
    POLICY.get_or_init(|| {
        let mut policy: Value = yaml_serde::from_str(BASE_POLICY).unwrap();
        let text = std::fs::read_to_string(
            maas_e2e::tools::workspace_root()
                .join("wasm-plugin-crs/base/companion/policy-configmap.yaml"),
        )
        .unwrap();
        let cm: Value = yaml_serde::from_str(&text).unwrap();
        let sample: Value =
            yaml_serde::from_str(cm["data"]["policy.yaml"].as_str().unwrap()).unwrap();
        for model in sample["models"].as_array().unwrap() {
            let mut model = model.clone();
            model["tiers"] = json!(["free"]);
            let backends = model.get_mut("backends").and_then(Value::as_array_mut);
            for b in backends.into_iter().flatten() {
                if b.get("upstreamCluster").is_some() && b.get("backend").is_none() {
                    b["backend"] = json!("simulator");
                }
            }
            policy["models"].as_array_mut().unwrap().push(model);
        }
        // JSON is YAML.
        policy.to_string()
    })
}

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    static CREDENTIALS: OnceLock<String> = OnceLock::new();
    let credentials = CREDENTIALS.get_or_init(|| {
        format!(
            "credentials:\n  openai-key: {OPENAI_KEY}\n  azure-openai-key: {AZURE_KEY}\n  \
             aws-bedrock: {{aws-access-key-id: {AWS_KEY_ID}, aws-secret-access-key: {AWS_SECRET}}}\n"
        )
    });
    stack_with(&S, policy(), IDENTITIES, credentials)
}

const CHAT: &str = "/llm/sim-model/v1/chat/completions";

/// How the shipped Wasm config is changed for one test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// As shipped.
    Shipped,
    /// The knob and `pauseHeadersForBody` both off: what a WasmPlugin gives.
    WasmPlugin,
    /// `pauseHeadersForBody` on, the knob gone: an Envoy or istiod that drops the field.
    KnobDropped,
}

/// An Envoy beside the stack built from the stack's bootstrap and the shipped EnvoyFilters.
fn istio_envoy(stack: &Stack, name: &str, shape: Shape) -> ExtraEnvoy {
    istio_envoy_with(stack, name, shape, |_| Ok(()))
}

/// As [`istio_envoy`], the bootstrap then changed by `more`.
fn istio_envoy_with(
    stack: &Stack,
    name: &str,
    shape: Shape,
    mut more: impl FnMut(&mut Value) -> anyhow::Result<()>,
) -> ExtraEnvoy {
    let shipped = ShippedGateway::load().expect("the shipped EnvoyFilters load");
    let dir = stack.dir().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let ecds = dir.join("ecds.json");
    let mut ec = shipped
        .agent_converted_extension_config(&istio_gateway::wasm_path().unwrap())
        .unwrap();
    // The stack's companion (its cluster and authority), from the stack's own bootstrap.
    let mut local: Value =
        serde_json::from_str(&std::fs::read_to_string(stack.envoy_config_path()).unwrap()).unwrap();
    let local_plugin: Value = serde_json::from_str(
        envoy_config::wasm_filter_mut(&mut local).unwrap()["typed_config"]["config"]
            ["configuration"]["value"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    istio_gateway::merge_extension_plugin_config(
        &mut ec,
        &json!({"companion": local_plugin["companion"], "pollIntervalMs": 500}),
    )
    .unwrap();
    match shape {
        Shape::Shipped => {}
        Shape::WasmPlugin => {
            istio_gateway::merge_extension_plugin_config(
                &mut ec,
                &json!({"pauseHeadersForBody": false}),
            )
            .unwrap();
            istio_gateway::wasm_plugin_config_mut(&mut ec)
                .unwrap()
                .remove("allow_on_headers_stop_iteration");
        }
        Shape::KnobDropped => {
            istio_gateway::wasm_plugin_config_mut(&mut ec)
                .unwrap()
                .remove("allow_on_headers_stop_iteration");
        }
    }
    istio_gateway::write_ecds_file(&ecds, &ec).unwrap();
    let envoy = ExtraEnvoy::beside(stack, name, false, |v, _| {
        istio_gateway::apply(v, &shipped, &ecds)?;
        more(v)
    })
    .unwrap_or_else(|e| panic!("the Istio-shaped Envoy did not start: {e:#}"));
    wait_for_policy(&envoy);
    envoy
}

/// The shipped pluginConfig has no bootstrap policy: until its first poll is answered the filter
/// refuses every model request with 503 `no_policy`. Ready once a model path without a
/// credential is a 401 (routed to a model: the policy is there).
fn wait_for_policy(envoy: &ExtraEnvoy) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = maas_e2e::stack::http_request(
            envoy.ports.listen,
            "GET",
            "/llm/sim-model/v1/models",
            Duration::from_secs(2),
        )
        .map(|(s, _)| s)
        .unwrap_or(0);
        if status == 401 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the Istio-shaped Envoy has no policy after 30 s (last status {status})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Envoy's count of requests started to the model cluster.
async fn started(admin: &str) -> u64 {
    stat(admin, "cluster.model-sim.upstream_rq_total").await
}

async fn stat(admin: &str, name: &str) -> u64 {
    let text = send(client().get(format!("{admin}/stats?filter={name}")))
        .await
        .body;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// An HTTP/1.1 request whose body comes in two parts `pause` apart (a slow client): the
/// status and how long the answer took.
fn two_part_request(
    addr: SocketAddr,
    path: &str,
    token: &str,
    test_id: &str,
    body: &str,
    pause: Duration,
) -> (u16, Duration) {
    let started = Instant::now();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nauthorization: Bearer {token}\r\n\
         x-test-id: {test_id}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let (first, rest) = body.split_at(body.len() / 2);
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(first.as_bytes()).unwrap();
    std::thread::sleep(pause);
    let _ = s.write_all(rest.as_bytes());
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let status = String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, started.elapsed())
}

fn ok_body() -> String {
    json!({"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

fn mismatch_body() -> String {
    json!({"model": "sim-premium", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

/// Body refusals on `envoy`, each body in two parts 300 ms apart: status and upstream requests
/// started for each (model mismatch, a reservation beyond the token window, a body that is not
/// JSON).
async fn body_refusals(
    stack: &Stack,
    envoy: &ExtraEnvoy,
    token: &str,
    tag: &str,
) -> Vec<(String, u16, u64, usize)> {
    let admin = envoy.admin_url();
    let addr = envoy.ports.listen;
    let cases = [
        ("model_mismatch", mismatch_body()),
        (
            "tokens_exceed_limit",
            json!({"model": "sim-model", "max_tokens": 100000, "messages": []}).to_string(),
        ),
        ("invalid_body", "[1,2,3,4,5,6,7,8]".to_string()),
    ];
    let mut out = Vec::new();
    for (what, body) in cases {
        let id = format!("ig-{tag}-{what}");
        let before = started(&admin).await;
        let token = token.to_string();
        let (status, _) = tokio::task::spawn_blocking(move || {
            two_part_request(addr, CHAT, &token, &id, &body, Duration::from_millis(300))
        })
        .await
        .unwrap();
        // A late upstream request gets time to show (nothing to poll for).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let id = format!("ig-{tag}-{what}");
        out.push((
            what.to_string(),
            status,
            started(&admin).await - before,
            stack.sim_requests_with_test_id(&id).len(),
        ));
    }
    out
}

#[tokio::test]
async fn the_shipped_filter_over_ecds_opens_no_upstream_request_for_a_body_refusal() {
    let stack = stack();
    let envoy = istio_envoy(stack, "istio-shipped", Shape::Shipped);
    let admin = envoy.admin_url();
    // Envoy runs the shipped extension config: knob on, fail closed.
    let dump = send(client().get(format!("{admin}/config_dump?resource=ecds_filters")))
        .await
        .json();
    let config = &dump["configs"][0]["ecds_filter"]["typed_config"]["config"];
    assert_eq!(config["allow_on_headers_stop_iteration"], true, "{dump}");
    assert_eq!(config["failure_policy"], "FAIL_CLOSED");
    assert_eq!(dump["configs"][0]["ecds_filter"]["name"], "maas-filter");
    // Allowed: one upstream request, also with the body in two parts.
    let before = started(&admin).await;
    let addr = envoy.ports.listen;
    let (status, _) = tokio::task::spawn_blocking(move || {
        two_part_request(
            addr,
            CHAT,
            "held-token",
            "ig-held-ok",
            &ok_body(),
            Duration::from_millis(300),
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    assert_eq!(started(&admin).await, before + 1);
    let seen = stack.sim_requests_with_test_id("ig-held-ok");
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].header("content-length"),
        Some(seen[0].body.len().to_string().as_str()),
        "held headers keep an exact content-length"
    );
    let refusals = body_refusals(stack, &envoy, "held-token", "held").await;
    for (what, status, upstream, received) in &refusals {
        assert_eq!(*status, 400, "{what}: {refusals:?}");
        assert_eq!(
            *upstream, 0,
            "{what} opened an upstream request: {refusals:?}"
        );
        assert_eq!(*received, 0, "{what}: {refusals:?}");
    }
    assert_eq!(
        stat(&admin, "wasmcustom.maas_headers_hold_unsupported").await,
        0
    );
}

/// The knob makes the difference: the same slow body refusal through the filter configured as
/// a WasmPlugin configures it opens an upstream request (reset before the backend has it all).
#[tokio::test]
async fn without_the_knob_a_body_refusal_opens_an_upstream_request() {
    let stack = stack();
    let envoy = istio_envoy(stack, "istio-wasmplugin", Shape::WasmPlugin);
    let refusals = body_refusals(stack, &envoy, "plugin-token", "plugin").await;
    for (what, status, upstream, received) in &refusals {
        assert_eq!(*status, 400, "{what}: {refusals:?}");
        assert_eq!(*upstream, 1, "{what}: {refusals:?}");
        assert_eq!(
            *received, 0,
            "{what}: the backend never has it whole: {refusals:?}"
        );
    }
}

/// `pauseHeadersForBody` without the knob: nothing hangs (without the filter's probe, Envoy
/// never hands the held body over and the request waits for the stream idle timeout, 300 s).
#[tokio::test]
async fn the_flag_without_the_knob_does_not_hang() {
    let stack = stack();
    let envoy = istio_envoy(stack, "istio-knob-dropped", Shape::KnobDropped);
    let admin = envoy.admin_url();
    let addr = envoy.ports.listen;
    for (i, body) in [ok_body(), ok_body(), mismatch_body()]
        .into_iter()
        .enumerate()
    {
        let id = format!("ig-noknob-{i}");
        let (status, took) = tokio::task::spawn_blocking(move || {
            two_part_request(
                addr,
                CHAT,
                "noknob-token",
                &id,
                &body,
                Duration::from_millis(50),
            )
        })
        .await
        .unwrap();
        let want = if i == 2 { 400 } else { 200 };
        assert_eq!(status, want, "request {i}");
        assert!(took < Duration::from_secs(3), "request {i} took {took:?}");
    }
    assert_eq!(
        stat(&admin, "wasmcustom.maas_headers_hold_unsupported").await,
        1
    );
    assert!(
        envoy
            .log()
            .contains("allow_on_headers_stop_iteration is not set"),
        "the filter says why"
    );
}

/// The shipped connection manager settings (EnvoyFilter maas-gateway-connection-manager) refuse
/// a request carrying a header name with an underscore before any filter runs.
#[tokio::test]
async fn the_shipped_connection_manager_refuses_underscore_headers() {
    let stack = stack();
    let envoy = istio_envoy(stack, "istio-headers", Shape::Shipped);
    let body = ok_body();
    let status = |header: &str, id: &str| {
        raw_json_request(
            envoy.ports.listen,
            "POST",
            CHAT,
            &[
                ("authorization", "Bearer headers-token"),
                ("x-test-id", id),
                (header, "admin"),
            ],
            &body,
        )
        .unwrap()
    };
    assert_eq!(status("x-request-tag", "ig-headers-ok"), 200);
    assert_eq!(status("x_maas_user", "ig-headers-reserved"), 400);
    assert!(
        stack
            .sim_requests_with_test_id("ig-headers-reserved")
            .is_empty()
    );
    assert_eq!(
        stat(
            &envoy.admin_url(),
            "http1.requests_rejected_with_underscores_in_headers"
        )
        .await,
        1
    );
}

/// A simulator serving only `model` (as vLLM serves its served name), one per sample backend.
fn model_sim(model: &str) -> SimHandle {
    sim::spawn(
        "127.0.0.1:0".parse().unwrap(),
        SimConfig {
            chunk_delay: Duration::ZERO,
            models: vec![model.to_string()],
            served_only: true,
        },
    )
    .expect("a simulator starts")
}

/// A cluster stat by exact name (cluster names hold `|`, which `/stats?filter=` reads as a
/// regular expression).
async fn cluster_stat(admin: &str, cluster: &str, stat: &str) -> u64 {
    let name = format!("cluster.{cluster}.{stat}: ");
    let text = send(client().get(format!("{admin}/stats"))).await.body;
    text.lines()
        .find_map(|l| l.strip_prefix(&name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// What `sim` received for `test_id`.
fn seen(sim: &SimHandle, test_id: &str) -> Vec<sim::RecordedRequest> {
    sim.requests()
        .into_iter()
        .filter(|r| r.header("x-test-id") == Some(test_id))
        .collect()
}

fn chat(model: &str) -> Value {
    json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
}

/// Refusals at the one base URL's body, each body in two parts 300 ms apart: no upstream request
/// on either sample cluster, nothing at either backend.
async fn one_url_refusals_open_no_upstream_request(
    envoy: &ExtraEnvoy,
    kserve: &SimHandle,
    openai: &SimHandle,
) {
    let admin = envoy.admin_url();
    let cases = [
        ("model_not_found", 404, chat("no-such-model").to_string()),
        (
            "tokens_exceed_limit",
            400,
            json!({"model": "facebook/opt-125m", "max_tokens": 100000, "messages": []}).to_string(),
        ),
        ("invalid_body", 400, "[1,2,3,4,5,6,7,8]".to_string()),
    ];
    for (what, want, body) in cases {
        let before = (
            cluster_stat(&admin, KSERVE_CLUSTER, "upstream_rq_total").await,
            cluster_stat(&admin, OPENAI_CLUSTER, "upstream_rq_total").await,
        );
        let id = format!("iu-refused-{what}");
        let addr = envoy.ports.listen;
        let sent_id = id.clone();
        let (status, _) = tokio::task::spawn_blocking(move || {
            two_part_request(
                addr,
                "/v1/chat/completions",
                "oneurl-token",
                &sent_id,
                &body,
                Duration::from_millis(300),
            )
        })
        .await
        .unwrap();
        // A late upstream request gets time to show (nothing to poll for).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = (
            cluster_stat(&admin, KSERVE_CLUSTER, "upstream_rq_total").await,
            cluster_stat(&admin, OPENAI_CLUSTER, "upstream_rq_total").await,
        );
        assert_eq!(status, want, "{what}");
        assert_eq!(after, before, "{what} opened an upstream request");
        assert!(
            seen(kserve, &id).is_empty() && seen(openai, &id).is_empty(),
            "{what}"
        );
    }
}

const KSERVE_CLUSTER: &str =
    "outbound|80||facebook-opt-125m-simulated-predictor.llm.svc.cluster.local";
const OPENAI_CLUSTER: &str = "outbound|443||api.openai.com";
const AZURE_CLUSTER: &str = "outbound|443||example-resource.openai.azure.com";
const BEDROCK_CLUSTER: &str = "outbound|443||bedrock-runtime.us-east-1.amazonaws.com";

/// Each sample's Envoy cluster on its simulator (Istio's DestinationRule originates TLS to a
/// provider; here every provider is plain HTTP).
fn sample_clusters(
    kserve: &SimHandle,
    openai: &SimHandle,
    azure: SocketAddr,
    bedrock: SocketAddr,
) -> [(String, SocketAddr); 4] {
    [
        (KSERVE_CLUSTER.to_string(), kserve.addr()),
        (OPENAI_CLUSTER.to_string(), openai.addr()),
        (AZURE_CLUSTER.to_string(), azure),
        (BEDROCK_CLUSTER.to_string(), bedrock),
    ]
}

/// The Bedrock simulator behind the sample Bedrock model: it recomputes every SigV4 signature
/// (path, host, body hash) from the sample's secret and refuses a mismatch with 403.
async fn bedrock_sim() -> maas_e2e::bedrock_sim::BedrockSimHandle {
    maas_e2e::bedrock_sim::spawn(maas_e2e::bedrock_sim::BedrockSimConfig {
        access_key_id: AWS_KEY_ID.into(),
        secret_access_key: AWS_SECRET.into(),
        session_token: None,
        region: "us-east-1".into(),
        model_id: BEDROCK_MODEL_ID.into(),
    })
    .await
    .expect("the Bedrock simulator starts")
}

/// The Azure OpenAI simulator behind the sample Azure model: strict about the deployment path,
/// `api-version` and `api-key`.
async fn azure_sim() -> maas_e2e::cloud_sim::CloudSimHandle {
    maas_e2e::cloud_sim::spawn(maas_e2e::cloud_sim::CloudSimConfig {
        azure_deployment: "gpt-4o-prod".into(),
        azure_api_key: AZURE_KEY.into(),
        azure_tenant: "t".into(),
        azure_client_id: "c".into(),
        azure_client_secret: "s".into(),
        vertex_project: "p".into(),
        vertex_location: "l".into(),
        gcp_private_key_pem: include_str!("../../fixtures/test-gcp-service-account-key.pem").into(),
        gcp_client_email: "unused@p.iam.gserviceaccount.com".into(),
        token_lifetime: 3600,
    })
    .await
    .expect("the Azure simulator starts")
}

/// The one base URL in the route configuration Istio generates from the sample HTTPRoutes
/// (wasm-plugin-crs/samples/*/httproute.yaml, translated by `istio_gateway::istio_routes` as
/// istiod does: `/v1` + header `x-maas-model` exact, `request_headers_to_remove`, the provider's
/// host rewrite, clusters `outbound|<port>||<host>`) with the shipped filter over ECDS: each
/// sample model, named in the body at `POST /v1/chat/completions`, lands on its own backend —
/// Envoy chose the route again after the filter set `x-maas-model` — and the backend never sees
/// the header (nor a client's own copy); the path-prefix rules still work; a refusal at the body
/// opens no upstream request on either cluster.
#[tokio::test]
async fn the_sample_httproutes_as_istio_generates_them_route_one_url_by_the_body() {
    let stack = stack();
    let kserve = model_sim("facebook/opt-125m");
    let openai = model_sim("gpt-4o");
    let azure = azure_sim().await;
    let bedrock = bedrock_sim().await;
    let samples: Vec<Value> = istio_gateway::MODEL_ROUTE_SAMPLES
        .iter()
        .map(|p| istio_gateway::load_httproute(p).unwrap())
        .collect();
    let routes = istio_gateway::istio_gateway_routes(&samples).unwrap();
    let clusters = sample_clusters(&kserve, &openai, azure.addr, bedrock.addr);
    let envoy = istio_envoy_with(stack, "istio-one-url", Shape::Shipped, |v| {
        istio_gateway::replace_model_routes(v, routes.clone(), &clusters)
    });
    let admin = envoy.admin_url();
    let one_url = format!("{}/v1/chat/completions", envoy.gateway_url());
    let seen = |s: &SimHandle, id: &str| -> Vec<sim::RecordedRequest> {
        s.requests()
            .into_iter()
            .filter(|r| r.header("x-test-id") == Some(id))
            .collect()
    };
    let chat = |model: &str| json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let post = |url: String,
                id: &'static str,
                body: Value,
                extra: Option<(&'static str, &'static str)>| {
        let mut req = client()
            .post(url)
            .header("authorization", "Bearer oneurl-token")
            .header("x-test-id", id)
            .json(&body);
        if let Some((k, v)) = extra {
            req = req.header(k, v);
        }
        send(req)
    };

    // The KServe sample, the client naming the other model in its own routing header: the
    // filter removes the client's copy and the body decides.
    let r = post(
        one_url.clone(),
        "iu-kserve",
        chat("facebook/opt-125m"),
        Some(("x-maas-model", "gpt-4o")),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (on_kserve, on_openai) = (seen(&kserve, "iu-kserve"), seen(&openai, "iu-kserve"));
    assert_eq!(
        (on_kserve.len(), on_openai.len()),
        (1, 0),
        "its own backend"
    );
    assert_eq!(on_kserve[0].path, "/v1/chat/completions");
    assert_eq!(
        on_kserve[0].header("x-maas-model"),
        None,
        "{:?}",
        on_kserve[0].headers
    );

    // The external sample: its host, its provider key, no routing header.
    let r = post(one_url.clone(), "iu-openai", chat("gpt-4o"), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (on_kserve, on_openai) = (seen(&kserve, "iu-openai"), seen(&openai, "iu-openai"));
    assert_eq!(
        (on_kserve.len(), on_openai.len()),
        (0, 1),
        "its own backend"
    );
    let got = &on_openai[0];
    assert_eq!(got.path, "/v1/chat/completions");
    assert_eq!(got.header("host"), Some("api.openai.com"));
    assert_eq!(
        got.header("authorization"),
        Some(format!("Bearer {OPENAI_KEY}").as_str())
    );
    assert_eq!(got.header("x-maas-model"), None, "{:?}", got.headers);

    // The path-prefix rules, as Istio rewrites them.
    let r = post(
        format!(
            "{}/llm/facebook-opt-125m-simulated/v1/chat/completions",
            envoy.gateway_url()
        ),
        "iu-prefix",
        chat("facebook/opt-125m"),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let on_kserve = seen(&kserve, "iu-prefix");
    assert_eq!(on_kserve.len(), 1);
    assert_eq!(on_kserve[0].path, "/v1/chat/completions");

    the_azure_sample_takes_its_provider_path(&envoy, &azure, &[&kserve, &openai]).await;
    the_bedrock_sample_takes_its_signed_path(&envoy, &bedrock, &[&kserve, &openai]).await;

    one_url_refusals_open_no_upstream_request(&envoy, &kserve, &openai).await;
    // The counters count: the three requests that went through.
    assert_eq!(
        (
            cluster_stat(&admin, KSERVE_CLUSTER, "upstream_rq_total").await,
            cluster_stat(&admin, OPENAI_CLUSTER, "upstream_rq_total").await,
        ),
        (2, 1)
    );
}

/// The Azure sample: at both URL forms the filter sends the deployment path, Envoy chooses the
/// provider-path rule by it and the header, and the strict simulator (404 for another path, 400
/// without a known api-version, 401 without the key) answers; no other backend sees it.
async fn the_azure_sample_takes_its_provider_path(
    envoy: &ExtraEnvoy,
    azure: &maas_e2e::cloud_sim::CloudSimHandle,
    others: &[&SimHandle],
) {
    let gateway = envoy.gateway_url();
    for (url, id) in [
        (format!("{gateway}/v1/chat/completions"), "iu-azure"),
        (
            format!("{gateway}/llm/gpt-4o-azure/v1/chat/completions"),
            "iu-azure-prefix",
        ),
    ] {
        let r = send(
            client()
                .post(url)
                .header("authorization", "Bearer oneurl-token")
                .header("x-test-id", id)
                .json(&chat("gpt-4o-azure")),
        )
        .await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        for other in others {
            assert!(seen(other, id).is_empty(), "{id} reached another backend");
        }
    }
    let got: Vec<(String, Option<String>, u16)> = azure
        .requests()
        .into_iter()
        .map(|r| (r.path, r.api_key, r.status))
        .collect();
    let want = (
        "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21".to_string(),
        Some(AZURE_KEY.to_string()),
        200,
    );
    assert_eq!(got, [want.clone(), want]);
    assert_eq!(
        cluster_stat(&envoy.admin_url(), AZURE_CLUSTER, "upstream_rq_total").await,
        2
    );
}

/// The Bedrock sample: at both URL forms the filter translates the chat body to Converse, sends
/// `/model/<id>/converse` to the signed host with the routing header, Envoy chooses the `/model`
/// rule by it, and the simulator — recomputing the SigV4 signature over the path, host and body
/// as AWS does — accepts it: the routes change nothing the filter signed. No other backend sees
/// it, nor the routing header.
async fn the_bedrock_sample_takes_its_signed_path(
    envoy: &ExtraEnvoy,
    bedrock: &maas_e2e::bedrock_sim::BedrockSimHandle,
    others: &[&SimHandle],
) {
    let gateway = envoy.gateway_url();
    for (url, id) in [
        (format!("{gateway}/v1/chat/completions"), "iu-bedrock"),
        (
            format!("{gateway}/llm/claude-bedrock/v1/chat/completions"),
            "iu-bedrock-prefix",
        ),
    ] {
        let r = send(
            client()
                .post(url)
                .header("authorization", "Bearer oneurl-token")
                .header("x-test-id", id)
                .json(&json!({"model": "claude-bedrock", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]})),
        )
        .await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        assert_eq!(r.json()["object"], "chat.completion", "{id}: {}", r.body);
        for other in others {
            assert!(
                other
                    .requests()
                    .iter()
                    .all(|q| q.header("x-test-id") != Some(id)),
                "{id} reached another backend"
            );
        }
    }
    let got = bedrock.requests();
    assert_eq!(got.len(), 2, "{got:?}");
    for q in &got {
        assert_eq!(
            (q.path.as_str(), q.status, q.refused.as_deref()),
            (
                "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse",
                200,
                None
            )
        );
        assert_eq!(
            q.header("host"),
            Some("bedrock-runtime.us-east-1.amazonaws.com")
        );
        assert_eq!(q.header("x-maas-model"), None, "{:?}", q.headers);
    }
    assert_eq!(
        cluster_stat(&envoy.admin_url(), BEDROCK_CLUSTER, "upstream_rq_total").await,
        2
    );
}

/// The weighted sample's model (wasm-plugin-crs/samples/weighted-model: routed backends, OpenAI
/// weight 3, the Azure deployment weight 1).
const WEIGHTED_MODEL: &str = "gpt-4o-split";

/// The weighted sample in the routes istiod generates from every sample HTTPRoute, with the
/// shipped filter over ECDS: 20 requests at the model's prefix and 20 at the one base URL, each
/// carrying a client's own `x-maas-backend: azure` and `api-key`, all answer 200. The filter
/// draws a backend per request and sets `x-maas-model` and `x-maas-backend`; Envoy chooses that
/// backend's route by both (else the filter's upstream check answers 503). Both providers
/// receive some — the client's header forces nothing — each only its own credential and path:
/// the OpenAI simulator `/v1/chat/completions` (prefix stripped), its key as `Bearer`, the
/// served name `gpt-4o`, no `api-key`, no routing header; the strict Azure simulator the
/// deployment path with `api-version` and its own `api-key` (the client's replaced), no bearer.
/// Envoy's cluster counters agree.
#[tokio::test]
async fn the_weighted_sample_sends_each_request_to_the_backend_drawn_by_its_own_routes() {
    let stack = stack();
    let openai = model_sim("gpt-4o");
    let azure = azure_sim().await;
    let samples: Vec<Value> = istio_gateway::MODEL_ROUTE_SAMPLES
        .iter()
        .map(|p| istio_gateway::load_httproute(p).unwrap())
        .collect();
    let routes = istio_gateway::istio_gateway_routes(&samples).unwrap();
    // The other samples' clusters stay the stack's simulator (nothing here goes there).
    let clusters = [
        (OPENAI_CLUSTER.to_string(), openai.addr()),
        (AZURE_CLUSTER.to_string(), azure.addr),
    ];
    let envoy = istio_envoy_with(stack, "istio-weighted", Shape::Shipped, |v| {
        istio_gateway::replace_model_routes(v, routes.clone(), &clusters)
    });
    let admin = envoy.admin_url();
    let gateway = envoy.gateway_url();
    weighted_warm_up(&gateway).await;
    let before = (
        cluster_stat(&admin, OPENAI_CLUSTER, "upstream_rq_total").await,
        cluster_stat(&admin, AZURE_CLUSTER, "upstream_rq_total").await,
        azure.requests().len(),
    );
    let n = 20;
    weighted_requests(&gateway, n).await;
    let on_openai: Vec<sim::RecordedRequest> = openai
        .requests()
        .into_iter()
        .filter(|r| {
            r.header("x-test-id")
                .is_some_and(|t| t.starts_with("iw-prefix-") || t.starts_with("iw-one-url-"))
        })
        .collect();
    let on_azure = azure.requests().split_off(before.2);
    let by_form = |form: &str| {
        on_openai
            .iter()
            .filter(|r| r.header("x-test-id").is_some_and(|t| t.starts_with(form)))
            .count()
    };
    eprintln!(
        "istio_gateway::weighted: 3:1 weights over {} requests gave openai {} (prefix {}, one URL \
         {}) / azure {}",
        2 * n,
        on_openai.len(),
        by_form("iw-prefix-"),
        by_form("iw-one-url-"),
        on_azure.len()
    );
    assert_eq!(
        on_openai.len() + on_azure.len(),
        2 * n,
        "each request reached one backend once: {on_openai:?} {on_azure:?}"
    );
    assert!(
        !on_openai.is_empty() && !on_azure.is_empty(),
        "both backends drawn (the client's x-maas-backend: azure chose nothing): openai {}, \
         azure {}",
        on_openai.len(),
        on_azure.len()
    );
    openai_backend_saw_only_its_own(&on_openai);
    for q in &on_azure {
        // The strict simulator's own checks passed (200) and it saw only Azure's key.
        assert_eq!(
            (
                q.path.as_str(),
                q.api_key.as_deref(),
                q.bearer.as_deref(),
                q.status
            ),
            (
                "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21",
                Some(AZURE_KEY),
                None,
                200
            ),
            "{q:?}"
        );
    }
    assert_eq!(
        (
            cluster_stat(&admin, OPENAI_CLUSTER, "upstream_rq_total").await - before.0,
            cluster_stat(&admin, AZURE_CLUSTER, "upstream_rq_total").await - before.1,
        ),
        (on_openai.len() as u64, on_azure.len() as u64)
    );
}

/// `n` requests for the weighted model at its prefix (ids `iw-prefix-<i>`), then `n` at the one
/// base URL (`iw-one-url-<i>`), each with a client's own `x-maas-backend: azure` and `api-key`:
/// every one answers 200 with a chat completion.
async fn weighted_requests(gateway: &str, n: usize) {
    for (form, path) in [
        ("prefix", "/llm/gpt-4o-split/v1/chat/completions"),
        ("one-url", "/v1/chat/completions"),
    ] {
        for i in 0..n {
            let id = format!("iw-{form}-{i}");
            let r = send(
                client()
                    .post(format!("{gateway}{path}"))
                    .header("authorization", "Bearer weighted-token")
                    .header("x-test-id", &id)
                    .header("x-maas-backend", "azure")
                    .header("api-key", "client-sent-key")
                    .json(&chat(WEIGHTED_MODEL)),
            )
            .await;
            assert_eq!(r.status, 200, "{id}: {}", r.body);
            assert_eq!(r.json()["object"], "chat.completion", "{id}: {}", r.body);
        }
    }
}

/// Until the weighted model answers 200 (the provider keys arrive in their own poll beside the
/// policy's; the filter draws only among backends whose key it holds).
async fn weighted_warm_up(gateway: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = send(
            client()
                .post(format!("{gateway}/v1/chat/completions"))
                .header("authorization", "Bearer weighted-token")
                .header("x-test-id", "iw-warm-up")
                .json(&chat(WEIGHTED_MODEL)),
        )
        .await;
        if r.status == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the weighted model never answered: {} {}",
            r.status,
            r.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The OpenAI backend's requests: its path (the model's prefix stripped at the prefix form),
/// host and key, the served name in the body, nothing of Azure's or the client's, no routing
/// header.
fn openai_backend_saw_only_its_own(seen: &[sim::RecordedRequest]) {
    for q in seen {
        assert_eq!(
            (
                q.method.as_str(),
                q.path.as_str(),
                q.header("host"),
                q.header("authorization")
            ),
            (
                "POST",
                "/v1/chat/completions",
                Some("api.openai.com"),
                Some(format!("Bearer {OPENAI_KEY}").as_str())
            ),
            "{q:?}"
        );
        for gone in ["api-key", "x-maas-model", "x-maas-backend"] {
            assert_eq!(q.header(gone), None, "{gone}: {:?}", q.headers);
        }
        let body: Value = serde_json::from_str(&q.body).unwrap();
        assert_eq!(body["model"], "gpt-4o", "the backend's served name");
    }
}
