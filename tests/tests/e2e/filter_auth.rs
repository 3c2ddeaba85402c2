//! Filter e2e (issue 4): authentication, credential hygiene, provider credentials, routing and
//! authorisation — through real Envoy with the release .wasm, the real companion and PostgreSQL.

use crate::helpers::*;
use maas_e2e::Stack;
use serde_json::json;
use std::collections::BTreeSet;

const POLICY: &str = r#"
tiers:
  - name: free
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 10000, window: 1m}]
      tokens: [{limit: 1000000, window: 1m}]
  - name: premium
    level: 1
    groups: [tier-premium-users]
    limits:
      requests: [{limit: 10000, window: 1m}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [free, premium]
    backend: simulator
    operations:
      - {method: POST, path: /v1/chat/completions}
      - {method: POST, path: /v1/completions}
      - {method: GET, path: /v1/models}
      - {method: GET, path: /v1/models/*}
      - {method: POST, path: /v1/audio/transcriptions}
  - name: sim-premium
    path: /llm/sim-premium
    tiers: [premium]
    backend: simulator
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
    api: openai  # the simulator speaks the OpenAI API
  - name: azure-ext
    path: /ext/azure
    tiers: [free]
    backend: simulator
    provider: {type: azure-openai, credentialRef: azure-key}
    upstreamCluster: ext-azure
  - name: vertex-ext
    path: /ext/vertex
    tiers: [free]
    backend: simulator
    provider: {type: vertex, credentialRef: vertex-key}
    upstreamCluster: ext-vertex
  - name: nokey-ext
    path: /ext/nokey
    tiers: [free]
    backend: simulator
    provider: {type: openai, credentialRef: missing-key}
    upstreamCluster: ext-nokey
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
  - {token: bob-token, username: bob, groups: [system:authenticated, tier-premium-users]}
  - {token: dave-token, username: dave, groups: [system:authenticated]}
  - {token: erin-token, username: erin, groups: [system:authenticated]}
"#;

const CREDENTIALS: &str = r#"
credentials:
  openai-key: sk-prov-openai
  anthropic-key: sk-prov-anthropic
  azure-key: sk-prov-azure
  vertex-key: sk-prov-vertex
"#;

fn stack() -> &'static Stack {
    static S: ModuleStack<Stack> = ModuleStack::new();
    stack_with(&S, POLICY, IDENTITIES, CREDENTIALS)
}

/// Tests of this module that read its stack's global metrics take this so they do not count
/// each other (other modules have stacks of their own).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

fn body(model: &str) -> serde_json::Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3})
}

/// Headers Envoy itself adds or owns on the way to the backend (not the client's, not ours).
const ENVOY_HEADERS: &[&str] = &[
    "host",
    "x-forwarded-proto",
    "x-request-id",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-original-path",
    "content-length",
    "transfer-encoding",
];

/// The names of the headers the simulator got for `test_id` (exactly one request), minus
/// Envoy's own.
fn backend_headers(stack: &Stack, test_id: &str) -> (BTreeSet<String>, Vec<(String, String)>) {
    let seen = stack.sim_requests_with_test_id(test_id);
    assert_eq!(seen.len(), 1, "{test_id}: backend requests {seen:?}");
    let headers = seen[0].headers.clone();
    let names = headers
        .iter()
        .map(|(k, _)| k.to_ascii_lowercase())
        .filter(|k| !ENVOY_HEADERS.contains(&k.as_str()))
        .collect();
    (names, headers)
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// What the backend gets besides Envoy's own: the client's harmless headers, and the filter's
/// `accept-encoding: identity` (usage is read from the response body).
const CLIENT_HEADERS: &[&str] = &[
    "content-type",
    "accept",
    "x-test-id",
    "x-custom",
    "accept-encoding",
];

#[tokio::test]
async fn api_key_token_and_x_api_key_reach_backend_without_identity() {
    let _serial = serial().await;
    let stack = stack();
    let key = stack
        .mint_key_plain("alice-token", "hygiene")
        .await
        .unwrap();
    let auth = bearer(&key);
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("hyg-bearer-key", vec![("authorization", auth.as_str())]),
        ("hyg-x-api-key", vec![("x-api-key", key.as_str())]),
        ("hyg-token", vec![("authorization", "Bearer alice-token")]),
        (
            "hyg-both-same",
            vec![
                ("authorization", auth.as_str()),
                ("x-api-key", key.as_str()),
            ],
        ),
    ];
    for (id, mut headers) in cases {
        headers.push(("x-maas-username", "root"));
        headers.push(("X-MaaS-Group", "maas-admins"));
        headers.push(("x-custom", "kept"));
        headers.push(("accept", "application/json"));
        let r = chat(
            stack,
            "/llm/sim-model/v1/chat/completions",
            id,
            &headers,
            body("sim-model"),
        )
        .await;
        assert_eq!(r.status, 200, "{id}: {}", r.body);
        let (names, all) = backend_headers(stack, id);
        assert_eq!(names, set(CLIENT_HEADERS), "{id}: {all:?}");
        assert!(
            all.iter()
                .any(|(k, v)| k == "accept-encoding" && v == "identity"),
            "{id}: {all:?}"
        );
        assert!(
            !all.iter()
                .any(|(_, v)| v.contains(&key) || v.contains("alice-token"))
        );
    }
    assert!(!stack.logs_text().contains(&key), "key in a log");
}

#[tokio::test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn provider_credentials_replace_the_users() {
    let _serial = serial().await;
    let stack = stack();
    let key = stack
        .mint_key_plain("dave-token", "providers")
        .await
        .unwrap();
    let auth = bearer(&key);
    // (path, model, extra header expected on the backend, its value)
    let cases = [
        (
            "/ext/openai",
            "gpt-ext",
            "authorization",
            "Bearer sk-prov-openai",
        ),
        (
            "/ext/vertex",
            "vertex-ext",
            "authorization",
            "Bearer sk-prov-vertex",
        ),
        ("/ext/azure", "azure-ext", "api-key", "sk-prov-azure"),
        (
            "/ext/anthropic",
            "claude-ext",
            "x-api-key",
            "sk-prov-anthropic",
        ),
    ];
    // Provider credentials come from the first poll (no bootstrap): wait for it.
    let ready = eventually(std::time::Duration::from_secs(10), || async {
        chat(
            stack,
            "/ext/openai/v1/chat/completions",
            "prov-warmup",
            &[("authorization", auth.as_str())],
            body("gpt-ext"),
        )
        .await
        .status
            == 200
    })
    .await;
    assert!(ready.is_some(), "provider credentials never arrived");
    for (prefix, model, header, value) in cases {
        for (n, client_cred) in [
            ("authorization", auth.as_str()),
            ("x-api-key", key.as_str()),
        ]
        .into_iter()
        .enumerate()
        {
            let id = format!("prov-{model}-{n}");
            let r = chat(
                stack,
                &format!("{prefix}/v1/chat/completions"),
                &id,
                &[
                    client_cred,
                    ("accept", "application/json"),
                    ("x-custom", "kept"),
                    ("x-maas-tier", "enterprise"),
                ],
                body(model),
            )
            .await;
            assert_eq!(r.status, 200, "{id}: {}", r.body);
            let (names, all) = backend_headers(stack, &id);
            let mut expected = set(CLIENT_HEADERS);
            expected.insert(header.to_string());
            if model == "claude-ext" {
                expected.insert("anthropic-version".into());
            }
            assert_eq!(names, expected, "{id}: {all:?}");
            let got: Vec<&str> = all
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case(header))
                .map(|(_, v)| v.as_str())
                .collect();
            assert_eq!(got, vec![value], "{id}: set once, replacing the user's");
            if model == "claude-ext" {
                let v = all.iter().find(|(k, _)| k == "anthropic-version").unwrap();
                assert_eq!(v.1, "2023-06-01");
            }
        }
    }
    // A client-sent anthropic-version is kept, not duplicated.
    let r = chat(
        stack,
        "/ext/anthropic/v1/chat/completions",
        "prov-anthropic-version",
        &[
            ("authorization", auth.as_str()),
            ("anthropic-version", "2024-01-01"),
        ],
        body("claude-ext"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (_, all) = backend_headers(stack, "prov-anthropic-version");
    let versions: Vec<&str> = all
        .iter()
        .filter(|(k, _)| k == "anthropic-version")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(versions, vec!["2024-01-01"]);
    // No credential configured for the model: 503, nothing forwarded.
    let r = chat(
        stack,
        "/ext/nokey/v1/chat/completions",
        "prov-nokey",
        &[("authorization", auth.as_str())],
        json!({"model": "nokey-ext"}),
    )
    .await;
    let e = r.error(503);
    assert_eq!(e["code"], "provider_credential_missing");
    assert!(stack.sim_requests_with_test_id("prov-nokey").is_empty());
}

#[tokio::test]
async fn credential_refusals() {
    let _serial = serial().await;
    let stack = stack();
    let key = stack
        .mint_key_plain("alice-token", "refusals")
        .await
        .unwrap();
    let p = "/llm/sim-model/v1/chat/completions";
    // Both headers, different credentials: 400.
    let r = chat(
        stack,
        p,
        "ref-both",
        &[
            ("authorization", &bearer(&key)),
            ("x-api-key", "alice-token"),
        ],
        body("sim-model"),
    )
    .await;
    r.error(400);
    // Wrong shape with the key prefix: 401 and no callout.
    let callouts = companion_validations(stack).await;
    let r = chat(
        stack,
        p,
        "ref-shape",
        &[("authorization", "Bearer sk-oai-notakey_x")],
        body("sim-model"),
    )
    .await;
    assert_eq!(r.error(401)["message"], "invalid key format");
    let r = chat(
        stack,
        p,
        "ref-shape",
        &[("x-api-key", &format!("{key}x"))],
        body("sim-model"),
    )
    .await;
    r.error(401);
    assert_eq!(
        companion_validations(stack).await,
        callouts,
        "a malformed key made a callout"
    );
    // Other schemes, empty, control characters.
    for (h, v, status) in [
        ("authorization", "Basic YWxpY2U6eA==", 401),
        ("authorization", "Bearer ", 401),
        ("x-api-key", "", 401),
        ("authorization", "Bearer a b", 400),
    ] {
        let r = chat(stack, p, "ref-misc", &[(h, v)], body("sim-model")).await;
        r.error(status);
    }
    // Unknown token and unknown key: 401 from the companion.
    r_unknown(stack, p).await;
    assert!(stack.sim_requests_with_test_id("ref-both").is_empty());
    assert!(stack.sim_requests_with_test_id("ref-shape").is_empty());
    assert!(stack.sim_requests_with_test_id("ref-misc").is_empty());
}

async fn r_unknown(stack: &Stack, p: &str) {
    let (_, unknown_key) = maas_types::apikey::format_key(&[3; 12], &[4; 32]);
    for cred in ["nobody-token".to_string(), unknown_key] {
        let r = chat(
            stack,
            p,
            "ref-unknown",
            &[("authorization", &bearer(&cred))],
            body("sim-model"),
        )
        .await;
        r.error(401);
        // Negative answers are cached briefly: the second is refused the same way.
        let r = chat(
            stack,
            p,
            "ref-unknown",
            &[("authorization", &bearer(&cred))],
            body("sim-model"),
        )
        .await;
        r.error(401);
    }
    assert!(stack.sim_requests_with_test_id("ref-unknown").is_empty());
}

#[tokio::test]
async fn routing_and_authorisation() {
    let _serial = serial().await;
    let stack = stack();
    let a = bearer("alice-token");
    let h = [("authorization", a.as_str())];
    // Unknown model path, mixed case, internal paths: 404.
    for path in [
        "/llm/nope/v1/chat/completions",
        "/LLM/sim-model/v1/chat/completions",
        "/llm/sim-modelx/v1/chat/completions",
    ] {
        chat(stack, path, "route-404", &h, body("sim-model"))
            .await
            .error(404);
    }
    for path in [
        "/internal/v1/policy",
        "/maas-api/internal/v1/credentials",
        "/Internal/v1/policy",
    ] {
        let r = send(
            client()
                .get(format!("{}{path}", stack.gateway_url()))
                .bearer_auth("alice-token"),
        )
        .await;
        r.error(404);
        assert!(!r.body.contains("sk-prov"), "{path}: {}", r.body);
    }
    // Ambiguous paths: 400, before anything else (sent raw: clients would normalise them).
    for path in [
        "/llm/sim-model/v1/../v1/chat/completions",
        "/llm/sim-model/./v1/chat/completions",
        "/llm//sim-model/v1/chat/completions",
        "/llm/sim-model/v1%2Fchat/completions",
        "/llm/sim-model/v1/chat;x/completions",
        "/llm/sim-model/v1/chat\\completions",
    ] {
        // Envoy may normalise some of these itself first (then it is an unauthenticated call).
        let status = raw_status(stack, "POST", path);
        assert!((400..=404).contains(&status), "{path}: {status}");
    }
    // Body names another model: 400.
    let e = chat(
        stack,
        "/llm/sim-model/v1/chat/completions",
        "route-400",
        &h,
        body("sim-premium"),
    )
    .await
    .error(400);
    assert_eq!(e["code"], "model_mismatch");
    // Tier not allowed on the model: 403; a premium user passes.
    let e = chat(
        stack,
        "/llm/sim-premium/v1/chat/completions",
        "route-403",
        &h,
        body("sim-premium"),
    )
    .await
    .error(403);
    assert_eq!(e["type"], "permission_error");
    let r = chat(
        stack,
        "/llm/sim-premium/v1/chat/completions",
        "route-premium",
        &[("authorization", "Bearer bob-token")],
        body("sim-premium"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // A premium user's key pinned to free may not use the premium model.
    let pinned = stack
        .mint_key("bob-token", json!({"name": "pinned", "tier": "free"}))
        .await
        .unwrap();
    let pk = pinned["key"].as_str().unwrap();
    chat(
        stack,
        "/llm/sim-premium/v1/chat/completions",
        "route-pinned",
        &[("authorization", &bearer(pk))],
        body("sim-premium"),
    )
    .await
    .error(403);
    for id in ["route-404", "route-400", "route-403", "route-pinned"] {
        assert!(
            stack.sim_requests_with_test_id(id).is_empty(),
            "{id} reached the backend"
        );
    }
    // Discovery needs authentication.
    let url = format!("{}/llm/sim-model/v1/models", stack.gateway_url());
    send(client().get(&url)).await.error(401);
    let r = send(client().get(&url).bearer_auth("alice-token")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Management passes with its Authorization (the companion checks it).
    let r = send(
        client()
            .get(format!("{}/maas-api/v1/models", stack.gateway_url()))
            .bearer_auth("alice-token")
            .header("x-maas-username", "root"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// `GET /maas-api/v1/models` through the gateway with a forged `Host`: each model's `url` is the
/// gateway's own (the companion's configured public URL), never the client's host.
#[tokio::test]
async fn model_urls_name_the_gateway_whatever_host_the_client_sends() {
    let _serial = serial().await;
    let stack = stack();
    let r = send(
        client()
            .get(format!("{}/maas-api/v1/models", stack.gateway_url()))
            .bearer_auth("alice-token")
            .header("host", "evil.example.net")
            .header("x-forwarded-host", "evil.example.net")
            .header("x-forwarded-proto", "https"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!r.body.contains("evil"), "{}", r.body);
    let sim = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "sim-model")
        .cloned()
        .unwrap_or_else(|| panic!("no sim-model in {}", r.body));
    assert_eq!(
        sim["url"],
        json!(format!("{}/llm/sim-model", stack.gateway_url())),
        "{sim}"
    );
}

#[tokio::test]
async fn concurrent_misses_make_one_callout_per_worker() {
    let _serial = serial().await;
    let stack = stack();
    let key = stack.mint_key_plain("erin-token", "burst").await.unwrap();
    let before = companion_validations(stack).await;
    let mut tasks = Vec::new();
    for i in 0..24 {
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let s = self::stack();
            chat(
                s,
                "/llm/sim-model/v1/chat/completions",
                &format!("burst-{i}"),
                &[("authorization", &bearer(&key))],
                body("sim-model"),
            )
            .await
            .status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let made = companion_validations(stack).await - before;
    // The stack runs Envoy with 2 workers; each makes at most one callout for the key (a
    // callout that finished before a later request arrived would have filled the cache).
    assert!(
        (1..=2).contains(&made),
        "{made} callouts for 24 concurrent requests"
    );
}

#[tokio::test]
async fn metrics_are_exported() {
    let _serial = serial().await;
    let stack = stack();
    let _ = chat(
        stack,
        "/llm/sim-model/v1/chat/completions",
        "metrics",
        &[("authorization", "Bearer alice-token")],
        body("sim-model"),
    )
    .await;
    let _ = chat(
        stack,
        "/llm/sim-model/v1/chat/completions",
        "metrics",
        &[],
        body("sim-model"),
    )
    .await;
    // Prometheus sees the filter's series with their labels (Envoy's tag extraction, as the
    // Gateway's extraStatTags configure it), without a prefix. Histograms reach the output at
    // Envoy's stats flush (every 5 s).
    let series = |text: &str, family: &str, labels: &[&str]| {
        text.lines().any(|l| {
            l.strip_prefix(family)
                .and_then(|r| r.strip_prefix('{'))
                .is_some_and(|r| labels.iter().all(|want| r.contains(want)))
        })
    };
    let complete = |text: &str| {
        series(
            text,
            "maas_requests_total",
            &[
                r#"decision="allowed""#,
                r#"code="ok""#,
                r#"model="sim-model""#,
            ],
        ) && series(
            text,
            "maas_requests_total",
            &[r#"decision="unauthenticated""#, r#"code="invalid_api_key""#],
        ) && series(
            text,
            "maas_tokens_total",
            &[
                r#"token_type="input""#,
                r#"tier="free""#,
                r#"subscription="none""#,
                r#"model="sim-model""#,
            ],
        ) && series(text, "maas_tokens_total", &[r#"token_type="output""#])
            && series(
                text,
                "gen_ai_client_token_usage_count",
                &[
                    r#"token_type="input""#,
                    r#"operation="chat""#,
                    r#"model="sim-model""#,
                ],
            )
            && series(
                text,
                "gen_ai_server_request_duration_ms_count",
                &[r#"operation="chat""#],
            )
            && [
                "maas_auth_cache_hit",
                "maas_auth_cache_miss",
                "maas_auth_callout_latency_ms_bucket",
            ]
            .iter()
            .all(|n| text.contains(n))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut text = String::new();
    while std::time::Instant::now() < deadline {
        text = send(client().get(format!("{}/stats/prometheus", stack.envoy_admin_url())))
            .await
            .body;
        if complete(&text) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert!(
        complete(&text),
        "series missing from /stats/prometheus: {text}"
    );
    // No series keeps its labels in its name (a label Envoy does not extract would).
    assert!(!text.contains("=.="), "unextracted labels: {text}");
    // Counted at the filter's next tick.
    assert!(
        eventually(std::time::Duration::from_secs(5), || async {
            labelled_now(stack, "maas_requests_total", &[("decision", "allowed")]).await >= 1
        })
        .await
        .is_some(),
        "maas_requests_total never counted the allowed request"
    );
}

#[tokio::test]
async fn request_bodies_and_upstream_faults() {
    let _serial = serial().await;
    let stack = stack();
    let p = "/llm/sim-model/v1/chat/completions";
    let auth = [("authorization", "Bearer alice-token")];
    // Larger than the 1 MiB body cap: 413, never forwarded whole.
    let big = json!({"model": "sim-model", "messages": [{"role": "user", "content": "x ".repeat(700_000)}]});
    let r = chat(stack, p, "body-big", &auth, big).await;
    assert_eq!(r.status, 413, "{}", &r.body[..r.body.len().min(300)]);
    // Not JSON where JSON is required: 400 with the reason.
    let r = send(
        client()
            .post(format!("{}{p}", stack.gateway_url()))
            .header("authorization", "Bearer alice-token")
            .header("content-type", "application/json")
            .header("x-test-id", "body-bad")
            .body("{not json"),
    )
    .await;
    let e = r.error(400);
    assert_eq!(
        (&e["code"], &e["param"]),
        (&json!("invalid_body"), &json!(null)),
        "{e}"
    );
    // A field of the wrong type: 400 naming it in `param`, as OpenAI's own errors do.
    let mut bad_cap = body("sim-model");
    bad_cap["max_tokens"] = json!("many");
    let r = chat(stack, p, "body-bad-cap", &auth, bad_cap).await;
    let e = r.error(400);
    assert_eq!(
        (&e["code"], &e["param"]),
        (&json!("invalid_body"), &json!("max_tokens")),
        "{e}"
    );
    // A malformed upstream body passes through untouched.
    let r = chat(
        stack,
        p,
        "body-up-notjson",
        &[auth[0], ("x-sim-fault", "not-json")],
        body("sim-model"),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "this is not json {");
    // A stream without usage (the model ignored include_usage) and a stream cut mid-way still
    // reach the client as sent.
    let stream = json!({"model": "sim-model", "stream": true, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let r = chat(
        stack,
        p,
        "body-up-nousage",
        &[auth[0], ("x-sim-fault", "no-usage")],
        stream.clone(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("[DONE]"), "{}", r.body);
    let r = chat(
        stack,
        p,
        "body-up-nodone",
        &[auth[0], ("x-sim-fault", "no-done")],
        stream,
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("tok3"), "{}", r.body);
    // Uploads are not buffered or parsed.
    let r = send(
        client()
            .post(format!(
                "{}/llm/sim-model/v1/audio/transcriptions",
                stack.gateway_url()
            ))
            .header("authorization", "Bearer alice-token")
            .header("content-type", "application/octet-stream")
            .header("x-test-id", "body-upload")
            .body(vec![0u8; 4096]),
    )
    .await;
    assert_ne!(r.status, 400, "{}", r.body);
    assert_eq!(stack.sim_requests_with_test_id("body-upload").len(), 1);
}

#[tokio::test]
async fn invalid_plugin_config_keeps_envoy_from_serving() {
    let _serial = serial().await;
    let stack = stack();
    // The stack's own Envoy config with a broken pluginConfig: Envoy must refuse it.
    let text = std::fs::read_to_string(stack.envoy_config_path()).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let wasm = maas_e2e::envoy_config::wasm_filter_mut(&mut config).unwrap();
    wasm["typed_config"]["config"]["configuration"]["value"] =
        json!(r#"{"companion":{"cluster":"maas-companion","timeoutMs":0}}"#);
    let listener = &mut config["static_resources"]["listeners"][0];
    // Free ports for this copy.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let admin = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    listener["address"]["socket_address"]["port_value"] = json!(port);
    config["admin"]["address"]["socket_address"]["port_value"] = json!(admin);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy-bad.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let envoy = maas_e2e::tools::envoy_bin().unwrap();
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::process::Command::new(envoy)
            .arg("-c")
            .arg(&path)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "info",
                "--base-id",
                "77",
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("envoy exits on its own")
    .unwrap();
    assert!(
        !out.status.success(),
        "envoy started with a broken pluginConfig"
    );
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("companion.timeoutMs"),
        "the error does not name the field:\n{log}"
    );
}

/// Sends raw bytes as one HTTP/1.1 request and returns the status.
fn raw_request(stack: &Stack, request: &[u8]) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(stack.gateway_addr()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    s.write_all(request).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn non_utf8_headers_are_refused_and_the_worker_survives() {
    let _serial = serial().await;
    let stack = stack();
    let raw_body = br#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}"#;
    for bad in [
        &b"Authorization: Bearer \xff\xfe\xfd\r\n"[..],
        &b"x-api-key: sk-oai-\xc3\x28\r\n"[..],
    ] {
        // Many times, so that every worker sees one.
        for _ in 0..6 {
            let mut req = b"POST /llm/sim-model/v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\ncontent-type: application/json\r\n".to_vec();
            req.extend_from_slice(bad);
            req.extend_from_slice(format!("content-length: {}\r\n\r\n", raw_body.len()).as_bytes());
            req.extend_from_slice(raw_body);
            let status = raw_request(stack, &req);
            assert!(
                status == 400 || status == 401,
                "non-UTF-8 credential got {status}"
            );
        }
    }
    // Every worker still answers.
    for i in 0..8 {
        let r = chat(
            stack,
            "/llm/sim-model/v1/chat/completions",
            &format!("utf8-after-{i}"),
            &[("authorization", "Bearer alice-token")],
            body("sim-model"),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
}
