//! Security e2e (issue 10, items 4 and 5): the provider key only does what the gateway meters.
//!
//! - Only a model's allow-listed (method, path) pairs are forwarded: everything else under its
//!   prefix (files, fine-tuning, batches, vLLM admin endpoints, other methods) is a JSON 404
//!   `operation_not_allowed` that the backend never sees, whatever the spelling of the path.
//! - A provider credential goes only to the model's own upstream: a route the gateway did not
//!   create (a longer prefix under the model's path, pointing at another cluster) gets nothing;
//!   the request is refused (503 `upstream_mismatch`) and never leaves.
//!
//! The simulator records every request it receives (its own record, independent of the filter);
//! the hijacking route points at a second recorder.

use crate::helpers::*;
use anyhow::Context;
use maas_e2e::extra_envoy::ExtraEnvoy;
use maas_e2e::{Stack, envoy_config, sim};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 100000, window: 1d}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free]
    backend: simulator
  - name: vllm-model
    path: /llm/vllm
    tiers: [free]
    backend: simulator
    upstreamCluster: vllm-upstream
  - name: gpt-ext
    path: /ext/openai
    tiers: [free]
    backend: simulator
    provider: {type: openai, credentialRef: openai-key}
    upstreamCluster: ext-openai
  - name: claude-ext
    path: /ext/anthropic
    tiers: [free]
    backend: simulator
    provider: {type: anthropic, credentialRef: anthropic-key}
    upstreamCluster: ext-anthropic
  - name: custom-ops
    path: /llm/custom
    tiers: [free]
    backend: simulator
    operations:
      - {method: POST, path: /v1/audio/transcriptions}
      - {method: GET, path: /v1/jobs/*/status}
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: tok-surface-alice-41c9, username: alice, groups: [system:authenticated]}
"#;
const ALICE: &str = "tok-surface-alice-41c9";

const CREDENTIALS: &str = r#"
credentials:
  openai-key: sk-prov-openai-surface-9b2e
  anthropic-key: sk-prov-anthropic-surface-5d71
"#;
const OPENAI_KEY: &str = "sk-prov-openai-surface-9b2e";

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, CREDENTIALS)
}

/// The first request of a fresh stack may meet the filter before the provider credentials
/// arrive (503 `provider_credential_missing`): wait until an external model answers.
async fn ready(stack: &Stack) {
    let ok = eventually(Duration::from_secs(30), || async {
        chat(
            stack,
            "/ext/openai/v1/chat/completions",
            "surface-warmup",
            &[("authorization", &bearer(ALICE))],
            json!({"model": "gpt-ext", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        )
        .await
        .status
            == 200
    })
    .await;
    assert!(ok.is_some(), "provider credentials never arrived");
}

/// Sends `method url` with alice's credential, an `x-test-id` and a small JSON body naming
/// `model` (none for GET/HEAD).
async fn call(base: &str, method: &str, path: &str, test_id: &str, model: &str) -> Reply {
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = client()
        .request(m, format!("{base}{path}"))
        .bearer_auth(ALICE)
        .header("x-test-id", test_id);
    if !matches!(method, "GET" | "HEAD") {
        req = req
            .header("content-type", "application/json")
            .body(json!({"model": model, "input": "x", "max_tokens": 1}).to_string());
    }
    send(req).await
}

/// Asserts the filter's own 404 (`operation_not_allowed`; HEAD answers carry no body).
fn assert_operation_refused(r: &Reply, what: &str) {
    assert_eq!(r.status, 404, "{what}: {}", r.body);
    if !what.starts_with("HEAD ") {
        let e: Value = serde_json::from_str(&r.body)
            .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", r.body));
        assert_eq!(
            e["error"]["code"], "operation_not_allowed",
            "{what}: {}",
            r.body
        );
        assert_eq!(e["error"]["type"], "invalid_request_error", "{what}");
    }
}

/// Unmetered endpoints of OpenAI and vLLM, and the methods no model serves by default.
const DISALLOWED: &[(&str, &str)] = &[
    ("GET", "/v1/files"),
    ("POST", "/v1/files"),
    ("DELETE", "/v1/files/file-abc123"),
    ("GET", "/v1/files/file-abc123/content"),
    ("POST", "/v1/fine_tuning/jobs"),
    ("POST", "/v1/batches"),
    ("POST", "/v1/uploads"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/start_profile"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("GET", "/v1/chat/completions"),
    ("PUT", "/v1/chat/completions"),
    ("DELETE", "/v1/models/sim-model"),
    ("HEAD", "/v1/models"),
    ("OPTIONS", "/v1/chat/completions"),
    ("GET", ""),
    ("GET", "/"),
];

#[tokio::test]
async fn disallowed_operations_are_404_and_never_reach_the_backend() {
    let stack = stack();
    ready(stack).await;
    let base = stack.gateway_url();
    let mut n = 0;
    for prefix in [
        "/llm/sim-model",
        "/llm/vllm",
        "/ext/openai",
        "/ext/anthropic",
    ] {
        for (method, rest) in DISALLOWED {
            n += 1;
            let id = format!("surface-deny-{n}");
            let what = format!("{method} {prefix}{rest}");
            let r = call(&base, method, &format!("{prefix}{rest}"), &id, "sim-model").await;
            assert_operation_refused(&r, &what);
            assert!(
                stack.sim_requests_with_test_id(&id).is_empty(),
                "{what} reached the backend"
            );
        }
    }
    // Per family: OpenAI models do not serve Anthropic's messages, nor Anthropic models OpenAI's
    // completions (their chat completions are translated: `translate_anthropic`); a model with
    // its own list serves nothing else.
    for (method, path) in [
        ("POST", "/ext/openai/v1/messages"),
        ("POST", "/ext/anthropic/v1/completions"),
        ("POST", "/ext/anthropic/v1/embeddings"),
        ("POST", "/ext/anthropic/v1/messages/batches"),
        ("POST", "/llm/custom/v1/chat/completions"),
        ("GET", "/llm/custom/v1/models"),
        ("GET", "/llm/custom/v1/jobs/a/b/status"),
    ] {
        n += 1;
        let id = format!("surface-deny-{n}");
        let r = call(&base, method, path, &id, "sim-model").await;
        assert_operation_refused(&r, &format!("{method} {path}"));
        assert!(stack.sim_requests_with_test_id(&id).is_empty(), "{path}");
    }
    // Query strings play no part in the match.
    let r = call(
        &base,
        "GET",
        "/ext/openai/v1/files?x=/v1/chat/completions",
        "surface-q",
        "gpt-ext",
    )
    .await;
    assert_operation_refused(&r, "query");
    assert!(stack.sim_requests_with_test_id("surface-q").is_empty());
    // The provider key never reached the backend on any of these.
    for req in stack.sim_requests() {
        if req
            .header("x-test-id")
            .is_some_and(|t| t.starts_with("surface-deny"))
        {
            panic!(
                "a refused request was recorded: {} {}",
                req.method, req.path
            );
        }
    }
}

#[tokio::test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn allowed_operations_reach_the_backend() {
    let stack = stack();
    ready(stack).await;
    let base = stack.gateway_url();
    let body = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let auth = bearer(ALICE);
    let h = [("authorization", auth.as_str())];
    for (prefix, model) in [
        ("/llm/sim-model", "sim-model"),
        ("/llm/vllm", "vllm-model"),
        ("/ext/openai", "gpt-ext"),
    ] {
        let id = format!("surface-allow-chat-{model}");
        let r = chat(
            stack,
            &format!("{prefix}/v1/chat/completions?trace=1"),
            &id,
            &h,
            body(model),
        )
        .await;
        assert_eq!(r.status, 200, "{prefix}: {}", r.body);
        let seen = stack.sim_requests_with_test_id(&id);
        assert_eq!(seen.len(), 1, "{prefix}");
        assert_eq!(seen[0].path, "/v1/chat/completions?trace=1");
        if model == "gpt-ext" {
            assert_eq!(
                seen[0].header("authorization"),
                Some(format!("Bearer {OPENAI_KEY}").as_str())
            );
        }
        for path in ["/v1/models", &format!("/v1/models/{model}")] {
            let id = format!("surface-allow-models-{model}-{}", path.len());
            let r = call(&base, "GET", &format!("{prefix}{path}"), &id, model).await;
            // The simulator lists models but has no per-model endpoint: it must get the call.
            assert!(
                !r.body.contains("operation_not_allowed"),
                "{prefix}{path}: {}",
                r.body
            );
            if path == "/v1/models" {
                assert_eq!(r.status, 200, "{prefix}{path}: {}", r.body);
            }
            assert_eq!(
                stack.sim_requests_with_test_id(&id).len(),
                1,
                "{prefix}{path}"
            );
        }
    }
    // Forwarded (the simulator itself has no such endpoints: what counts is that they arrive).
    for (method, path, model, backend_path) in [
        (
            "POST",
            "/ext/openai/v1/embeddings",
            "gpt-ext",
            "/v1/embeddings",
        ),
        (
            "POST",
            "/ext/openai/v1/responses",
            "gpt-ext",
            "/v1/responses",
        ),
        (
            "POST",
            "/ext/openai/v1/completions",
            "gpt-ext",
            "/v1/completions",
        ),
        (
            "POST",
            "/ext/anthropic/v1/messages",
            "claude-ext",
            "/v1/messages",
        ),
        (
            "GET",
            "/ext/anthropic/v1/models",
            "claude-ext",
            "/v1/models",
        ),
        (
            "GET",
            "/llm/custom/v1/jobs/j-1/status",
            "custom-ops",
            "/v1/jobs/j-1/status",
        ),
    ] {
        let id = format!("surface-allow-{method}-{path}");
        let r = call(&base, method, path, &id, model).await;
        assert!(
            !r.body.contains("operation_not_allowed"),
            "{method} {path}: {}",
            r.body
        );
        let seen = stack.sim_requests_with_test_id(&id);
        assert_eq!(
            seen.len(),
            1,
            "{method} {path} did not reach the backend: {}",
            r.body
        );
        assert_eq!(
            (seen[0].method.as_str(), seen[0].path.as_str()),
            (method, backend_path)
        );
    }
    let r = send(
        client()
            .post(format!("{base}/llm/custom/v1/audio/transcriptions"))
            .bearer_auth(ALICE)
            .header("x-test-id", "surface-allow-upload")
            .header("content-type", "application/octet-stream")
            .body(vec![7u8; 512]),
    )
    .await;
    assert!(!r.body.contains("operation_not_allowed"), "{}", r.body);
    assert_eq!(
        stack
            .sim_requests_with_test_id("surface-allow-upload")
            .len(),
        1
    );
}

/// Sends one chat request exactly as written (no client-side normalisation).
fn raw(addr: SocketAddr, method: &str, path: &str, test_id: &str) -> u16 {
    let body = r#"{"model":"gpt-ext","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
    let auth = bearer(ALICE);
    let headers = [("authorization", auth.as_str()), ("x-test-id", test_id)];
    raw_json_request(addr, method, path, &headers, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

#[tokio::test]
async fn encoded_and_odd_spellings_never_reach_an_unlisted_endpoint() {
    let stack = stack();
    ready(stack).await;
    let allowed = |m: &str, p: &str| {
        let p = p.split('?').next().unwrap_or_default();
        matches!(
            (m, p),
            ("POST", "/v1/chat/completions")
                | ("POST", "/v1/completions")
                | ("POST", "/v1/embeddings")
                | ("POST", "/v1/responses")
                | ("GET", "/v1/models")
        ) || (m == "GET"
            && p.strip_prefix("/v1/models/")
                .is_some_and(|r| !r.contains('/')))
    };
    // (method, path, may this spelling be served at all): Envoy may decode or merge a spelling
    // into an allowed path (then exactly that path goes upstream) or the filter refuses it.
    let cases: &[(&str, &str, bool)] = &[
        ("POST", "/ext/openai/v1/chat%2Fcompletions", true),
        ("POST", "/ext/openai/v1/chat%2fcompletions", true),
        ("GET", "/ext/openai/v1/./files", false),
        ("GET", "/ext/openai//v1/files", false),
        ("GET", "/ext/openai/v1//files", false),
        ("GET", "/ext/openai/V1/files", false),
        ("GET", "/ext/openai/v1/FILES", false),
        ("GET", "/ext/openai/v1/files/", false),
        ("GET", "/ext/openai/v1/%66iles", false),
        ("GET", "/ext/openai/v1/models/../files", false),
        ("GET", "/ext/openai/v1/models/%2E%2E/files", false),
        ("GET", "/ext/openai/v1/models/..%2Ffiles", false),
        ("GET", "/ext/openai/v1/models%2F..%2Ffiles", false),
        ("POST", "/ext/openai/v1/chat/completions/", false),
        ("POST", "/ext/openai/v1/chat/completions/x", false),
        ("POST", "/ext/openai/v1/Chat/Completions", false),
        ("POST", "/ext/openai/v1/chat/completions;x", false),
        ("POST", "/ext/openai/v1/chat/completions%00", false),
        ("POST", "/ext/openai/v1/chat/completions%20", false),
        (
            "POST",
            "/ext/openai/v1/fine_tuning/jobs?next=/v1/chat/completions",
            false,
        ),
        ("POST", "/ext/openai/./v1/fine_tuning/jobs", false),
        ("GET", "/ext/openai/v1/models/x/../../files", false),
        ("POST", "/ext/openai/v1/chat/completions/..", true),
        ("post", "/ext/openai/v1/chat/completions", false),
        ("HEAD", "/ext/openai/v1/models", false),
        ("OPTIONS", "/ext/openai/v1/models", false),
    ];
    let mut served = Vec::new();
    for (i, (method, path, may_serve)) in cases.iter().enumerate() {
        let id = format!("surface-odd-{i}");
        let addr = stack.gateway_addr();
        let (m, p, t) = (method.to_string(), path.to_string(), id.clone());
        let status = tokio::task::spawn_blocking(move || raw(addr, &m, &p, &t))
            .await
            .unwrap();
        let seen = stack.sim_requests_with_test_id(&id);
        for r in &seen {
            assert!(
                allowed(&r.method, &r.path),
                "{method} {path} reached the backend as {} {} ({status})",
                r.method,
                r.path
            );
        }
        if !may_serve {
            assert!(
                (400..500).contains(&status),
                "{method} {path}: {status} (expected a refusal)"
            );
            assert!(seen.is_empty(), "{method} {path} reached the backend");
        }
        served.push(format!(
            "{method} {path} → {status} ({} upstream)",
            seen.len()
        ));
    }
    eprintln!("{}", served.join("\n"));
}

/// A second Envoy from the stack's own bootstrap, plus `routes` (added first, so they win)
/// leading to a cluster `attacker` that reaches `attacker`: what someone who may create an
/// HTTPRoute on the Gateway could add. Stopped on drop.
fn envoy_with_extra_routes(stack: &Stack, attacker: SocketAddr, routes: &[Value]) -> ExtraEnvoy {
    ExtraEnvoy::beside(stack, "surface", false, |v, _| {
        let list = envoy_config::routes_mut(v).context("the gateway's routes")?;
        for (i, r) in routes.iter().enumerate() {
            list.insert(i, r.clone());
        }
        envoy_config::add_addr_cluster(v, "attacker", attacker)
    })
    .unwrap_or_else(|e| panic!("the second Envoy did not start: {e:#}"))
}

#[tokio::test]
async fn a_route_the_gateway_did_not_create_never_gets_the_provider_key() {
    let stack = stack();
    ready(stack).await;
    // Someone else's Service, recording what it receives.
    let attacker = sim::spawn(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        sim::SimConfig::default(),
    )
    .unwrap();
    // Longer prefixes under an external model's and an on-cluster model's paths.
    let hijack = |prefix: &str| {
        json!({"match": {"prefix": prefix},
               "route": {"cluster": "attacker", "prefix_rewrite": "/v1/", "timeout": "30s"}})
    };
    let envoy = envoy_with_extra_routes(
        stack,
        attacker.addr(),
        &[hijack("/ext/openai/v1/"), hijack("/llm/vllm/v1/")],
    );
    let gateway = envoy.gateway_url();
    let auth = bearer(ALICE);
    let body = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "my secret prompt"}], "max_tokens": 1});
    // Control, and the wait for this Envoy's filter to have the provider credentials: a route
    // the policy knows (not hijacked) serves, with the provider key.
    let mut attempt = 0;
    let served = eventually(Duration::from_secs(30), || {
        attempt += 1;
        let id = format!("surface-hijack-control-{attempt}");
        let (gateway, auth, body) = (gateway.clone(), auth.clone(), body("claude-ext"));
        async move {
            send(
                client()
                    .post(format!("{gateway}/ext/anthropic/v1/messages"))
                    .header("authorization", &auth)
                    .header("x-test-id", &id)
                    .json(&body),
            )
            .await;
            let seen = stack.sim_requests_with_test_id(&id);
            seen.len() == 1 && seen[0].header("x-api-key") == Some("sk-prov-anthropic-surface-5d71")
        }
    })
    .await;
    assert!(
        served.is_some(),
        "the second Envoy never served the anthropic model"
    );
    let r = send(
        client()
            .post(format!("{gateway}/llm/sim-model/v1/chat/completions"))
            .header("authorization", &auth)
            .json(&body("sim-model")),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    for (path, model) in [
        ("/ext/openai/v1/chat/completions", "gpt-ext"),
        ("/ext/openai/v1/models", "gpt-ext"),
        ("/llm/vllm/v1/chat/completions", "vllm-model"),
    ] {
        let id = format!("surface-hijack-{path}");
        let req = client()
            .post(format!("{gateway}{path}"))
            .header("authorization", &auth)
            .header("x-test-id", &id);
        let req = if path.ends_with("/models") {
            client()
                .get(format!("{gateway}{path}"))
                .header("authorization", &auth)
                .header("x-test-id", &id)
        } else {
            req.json(&body(model))
        };
        let r = send(req).await;
        let e = r.error(503);
        assert_eq!(e["code"], "upstream_mismatch", "{path}: {}", r.body);
        assert!(stack.sim_requests_with_test_id(&id).is_empty(), "{path}");
    }
    let leaked = attacker.requests();
    assert!(
        leaked.is_empty(),
        "the hijacking route received {} request(s), e.g. {:?} with authorization {:?}",
        leaked.len(),
        leaked.first().map(|r| &r.path),
        leaked.first().and_then(|r| r.header("authorization"))
    );
    drop(envoy);
}
