//! Providers as they really authenticate and speak (issue 29), through real Envoy with the
//! release .wasm and the real companion, against strict simulators (`maas_e2e::cloud_sim`):
//! - Azure OpenAI: the client calls the OpenAI shape at the model's prefix and at the one base
//!   URL; the deployment's path and `api-version` reach Azure, with the static `api-key` or an
//!   Entra access token the companion obtained from client credentials;
//! - Vertex AI: the project/location path with a Google access token the companion obtained from
//!   a service-account key (its signed assertion verified by the token endpoint), tokens living
//!   3 s: requests across several lifetimes all succeed and Vertex sees several tokens.
//!
//! The filter only ever gets the access token (the credentials document is read here as the
//! filter reads it: no private key, no client secret).

use maas_e2e::cloud_sim::{self, CloudSimConfig, CloudSimHandle};
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [system:authenticated]}
"#;

const CLIENT_SECRET: &str = "entra-client-secret-1";
const AZURE_KEY: &str = "sk-azure-static";

fn sim_config(token_lifetime: u64) -> CloudSimConfig {
    CloudSimConfig {
        azure_deployment: "gpt-4o-prod".into(),
        azure_api_key: AZURE_KEY.into(),
        azure_tenant: "contoso.onmicrosoft.com".into(),
        azure_client_id: "app-1".into(),
        azure_client_secret: CLIENT_SECRET.into(),
        vertex_project: "proj-1".into(),
        vertex_location: "us-central1".into(),
        gcp_private_key_pem: include_str!("../../fixtures/test-gcp-service-account-key.pem").into(),
        gcp_client_email: "gateway@proj-1.iam.gserviceaccount.com".into(),
        token_lifetime,
    }
}

fn policy(sim: &CloudSimHandle) -> String {
    let backend = sim.url();
    let model = |name: &str, provider: Value| {
        json!({"name": name, "path": format!("/ext/{name}"), "tiers": ["free"],
               "backend": backend, "provider": provider, "upstreamCluster": format!("ext-{name}")})
    };
    // Claude on Vertex AI: Anthropic Messages at the publisher's path, the Vertex model id
    // as the served name.
    let mut claude = model(
        "claude-vx",
        json!({"type": "vertex", "credentialRef": "gcp-sa", "auth": "gcpServiceAccount",
               "project": "proj-1", "location": "us-central1", "publisher": "anthropic"}),
    );
    claude["servedName"] = json!(cloud_sim::VERTEX_CLAUDE_MODEL);
    // Gemini on Vertex AI in its own API: OpenAI chat translated to generateContent.
    let mut gemini = model(
        "gem-vx",
        json!({"type": "vertex", "credentialRef": "gcp-sa", "auth": "gcpServiceAccount",
               "project": "proj-1", "location": "us-central1", "publisher": "google"}),
    );
    gemini["servedName"] = json!(cloud_sim::VERTEX_GEMINI_MODEL);
    json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["system:authenticated"],
                   "limits": {"requests": [{"limit": 100000, "window": "1m"}]}}],
        "models": [
            model("az", json!({"type": "azure-openai", "credentialRef": "azure-key",
                               "deployment": "gpt-4o-prod", "apiVersion": "2024-10-21"})),
            model("az-entra", json!({"type": "azure-openai", "credentialRef": "azure-app",
                                     "auth": "azureClientCredentials", "deployment": "gpt-4o-prod"})),
            // Strictness of the simulator: an api-version Azure does not know, no deployment.
            model("az-old", json!({"type": "azure-openai", "credentialRef": "azure-key",
                                   "deployment": "gpt-4o-prod", "apiVersion": "2023-01-01"})),
            model("az-bare", json!({"type": "azure-openai", "credentialRef": "azure-key"})),
            model("vx", json!({"type": "vertex", "credentialRef": "gcp-sa", "auth": "gcpServiceAccount",
                               "project": "proj-1", "location": "us-central1"})),
            claude,
            gemini,
            // Routed backends (the reference's weighted externalProviderRefs): one model, two
            // providers, each its own cluster, drawn per request.
            {"name": "duo", "path": "/ext/duo", "tiers": ["free"], "api": "openai",
             "backends": [
                {"name": "azure", "backend": backend, "upstreamCluster": "ext-duo-azure",
                 "weight": 1,
                 "provider": {"type": "azure-openai", "credentialRef": "azure-key",
                              "deployment": "gpt-4o-prod", "apiVersion": "2024-10-21"}},
                {"name": "vertex", "backend": backend, "upstreamCluster": "ext-duo-vertex",
                 "weight": 1,
                 "provider": {"type": "vertex", "credentialRef": "gcp-sa",
                              "auth": "gcpServiceAccount", "project": "proj-1",
                              "location": "us-central1"}}
             ]},
        ]
    })
    .to_string()
}

fn credentials(sim: &CloudSimHandle) -> String {
    json!({"credentials": {
        "azure-key": AZURE_KEY,
        "azure-app": {"tenant-id": "contoso.onmicrosoft.com", "client-id": "app-1",
                      "client-secret": CLIENT_SECRET},
        "gcp-sa": {"service-account.json": sim.gcp_key_json()},
    }})
    .to_string()
}

async fn start(token_lifetime: u64) -> (CloudSimHandle, Stack) {
    let sim = cloud_sim::spawn(sim_config(token_lifetime))
        .await
        .expect("cloud simulator starts");
    let mut options = StackOptions::default()
        .with_policy_yaml(&policy(&sim))
        .with_identities_yaml(IDENTITIES)
        .with_credentials_yaml(&credentials(&sim));
    options.poll_interval_ms = 500;
    options
        .companion_env
        .push(("MAAS_AZURE_AUTHORITY_URL".into(), sim.url()));
    let stack = tokio::task::spawn_blocking(move || Stack::start(options))
        .await
        .expect("stack start task")
        .expect("stack starts");
    (sim, stack)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// POSTs `body` to `path` at the gateway as alice: status and body.
async fn post(stack: &Stack, path: &str, body: Value) -> (u16, Value) {
    let r = client()
        .post(format!("{}{path}", stack.gateway_url()))
        .header("authorization", "Bearer alice-token")
        .header("api-key", "client-sent-key")
        .json(&body)
        .send()
        .await
        .expect("gateway answers");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
}

/// Waits until the filter has the credential (the companion's first exchange, one poll) on
/// every Envoy worker: each polls on its own, so one worker may serve while another is a poll
/// behind (503 `provider_credential_missing` meanwhile). Ten answers in a row, each on a new
/// connection (so on any worker), say every worker has it.
async fn until_served(stack: &Stack, path: &str, model: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut in_a_row = 0;
    loop {
        let (status, body) = post(stack, path, chat(model)).await;
        in_a_row = if status == 200 { in_a_row + 1 } else { 0 };
        if in_a_row == 10 {
            return;
        }
        if status == 200 {
            continue;
        }
        assert!(
            Instant::now() < deadline,
            "{model} never served: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_openai_gets_its_deployment_path_api_version_and_credential() {
    let (sim, stack) = start(3600).await;
    until_served(&stack, "/ext/az/v1/chat/completions", "az").await;
    let base = sim.requests().len();
    // At the model's prefix (the client's query string is not passed on) and at the one base URL.
    for (path, model) in [
        (
            "/ext/az/v1/chat/completions?api-version=1999-01-01&debug=1",
            "az",
        ),
        ("/v1/chat/completions", "az"),
    ] {
        let (status, body) = post(&stack, path, chat(model)).await;
        assert_eq!(status, 200, "{path}: {body}");
        assert_eq!(body["usage"]["completion_tokens"], 2);
    }
    let (status, body) = post(
        &stack,
        "/ext/az/v1/embeddings",
        json!({"model": "az", "input": "hello there"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let seen = sim.requests();
    let seen: Vec<_> = seen[base..].iter().collect();
    let paths: Vec<&str> = seen.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21",
            "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21",
            "/openai/deployments/gpt-4o-prod/embeddings?api-version=2024-10-21",
        ]
    );
    // The provider key, never the client's.
    assert!(
        seen.iter()
            .all(|r| r.api_key.as_deref() == Some(AZURE_KEY) && r.bearer.is_none()),
        "{seen:?}"
    );

    // An operation Azure deployments do not serve never leaves the gateway.
    let before = sim.requests().len();
    let (status, body) = post(
        &stack,
        "/ext/az/v1/responses",
        json!({"model": "az", "input": "hi"}),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "operation_not_allowed");
    assert_eq!(sim.requests().len(), before);

    // The simulator is as strict as Azure: an unknown api-version is 400, the OpenAI path
    // without a deployment 404 (what every Azure model got before the gateway rewrote paths).
    let (status, _) = post(&stack, "/ext/az-old/v1/chat/completions", chat("az-old")).await;
    assert_eq!(status, 400);
    let (status, _) = post(&stack, "/ext/az-bare/v1/chat/completions", chat("az-bare")).await;
    assert_eq!(status, 404);
    assert_eq!(
        sim.requests().last().map(|r| r.path.clone()).as_deref(),
        Some("/v1/chat/completions")
    );

    // Entra client credentials: the companion's access token as a bearer token.
    until_served(&stack, "/ext/az-entra/v1/chat/completions", "az-entra").await;
    let (status, body) = post(&stack, "/v1/chat/completions", chat("az-entra")).await;
    assert_eq!(status, 200, "{body}");
    let last = sim.requests().last().cloned().expect("a request");
    assert!(
        last.bearer
            .as_deref()
            .is_some_and(|c| c.starts_with("entra-sim-token-")),
        "{last:?}"
    );
    // The client's own `api-key` never reaches Azure next to the gateway's token.
    assert_eq!(last.api_key, None, "{last:?}");
    assert!(
        sim.refused_grants().is_empty(),
        "{:?}",
        sim.refused_grants()
    );
    // The filter's document: tokens and keys only, never the client secret.
    let doc = credentials_document(&stack).await;
    assert!(!doc.contains(CLIENT_SECRET), "{doc}");
}

/// A model with routed backends: each request is drawn to one of them (1:1 here) at either
/// URL form, and gets that provider's path and credential — Azure's deployment path and
/// `api-key`, Vertex's project path and access token — never the other's, never the client's;
/// a client's own `x-maas-backend` chooses nothing; a stream is served too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_backends_draw_one_provider_per_request_each_with_its_own_path_and_credential() {
    let (sim, stack) = start(3600).await;
    until_served(&stack, "/ext/duo/v1/chat/completions", "duo").await;
    // Served once one backend can serve on every worker: Vertex's token may come a poll later
    // (its exchange), and until a worker has it that worker draws only Azure.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !credentials_document(&stack)
        .await
        .contains("gcp-sim-token-")
    {
        assert!(Instant::now() < deadline, "no Vertex token");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let base = sim.requests().len();
    let n = 40;
    for i in 0..n {
        let path = if i % 2 == 0 {
            "/ext/duo/v1/chat/completions"
        } else {
            "/v1/chat/completions"
        };
        let r = client()
            .post(format!("{}{path}", stack.gateway_url()))
            .header("authorization", "Bearer alice-token")
            .header("api-key", "client-sent-key")
            .header("x-maas-backend", "azure")
            .json(&chat("duo"))
            .send()
            .await
            .expect("gateway answers");
        assert_eq!(r.status(), 200, "{path}");
        let body: Value = r.json().await.expect("JSON");
        assert_eq!(body["usage"]["completion_tokens"], 2, "{body}");
    }
    let seen = sim.requests();
    let seen = &seen[base..];
    assert_eq!(
        seen.len(),
        n,
        "each request reached one backend once: {seen:?}"
    );
    let azure: Vec<_> = seen
        .iter()
        .filter(|r| r.path.starts_with("/openai/deployments/"))
        .collect();
    let vertex: Vec<_> = seen
        .iter()
        .filter(|r| r.path.starts_with("/v1/projects/proj-1/"))
        .collect();
    eprintln!(
        "cloud_providers::routed: 1:1 weights gave azure {} / vertex {}",
        azure.len(),
        vertex.len()
    );
    assert_eq!(azure.len() + vertex.len(), n, "{seen:?}");
    // 1:1 over 40 draws: each at least 8 unless the draw (or the client's header) decides.
    assert!(azure.len() >= 8 && vertex.len() >= 8, "{seen:?}");
    for r in &azure {
        assert_eq!(
            r.path,
            "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(
            (r.api_key.as_deref(), r.bearer.as_deref()),
            (Some(AZURE_KEY), None),
            "{r:?}"
        );
    }
    for r in &vertex {
        assert!(
            r.bearer
                .as_deref()
                .is_some_and(|t| t.starts_with("gcp-sim-token-")),
            "{r:?}"
        );
        assert_eq!(r.api_key, None, "{r:?}");
    }
    // A stream, served by whichever is drawn.
    let r = client()
        .post(format!("{}/v1/chat/completions", stack.gateway_url()))
        .header("authorization", "Bearer alice-token")
        .json(&json!({"model": "duo", "stream": true, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .expect("gateway answers");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("stream");
    assert!(text.contains("data: [DONE]"), "{text}");
}

async fn credentials_document(stack: &Stack) -> String {
    stack
        .internal_client()
        .get(format!(
            "{}/internal/v1/credentials",
            stack.companion_internal_url()
        ))
        .send()
        .await
        .expect("companion answers")
        .text()
        .await
        .expect("body")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vertex_tokens_rotate_under_traffic_with_no_failed_request() {
    // Short enough to rotate several times under traffic; long enough that a refresh (at half
    // its life) reaches every worker's poll on a loaded 2-core machine (3 s flaked once).
    const LIFETIME: u64 = 5;
    let (sim, stack) = start(LIFETIME).await;
    until_served(&stack, "/ext/vx/v1/chat/completions", "vx").await;
    let doc: Value = serde_json::from_str(&credentials_document(&stack).await).expect("JSON");
    assert!(
        doc["credentials"]["gcp-sa"]
            .as_str()
            .is_some_and(|t| t.starts_with("gcp-sim-token-")),
        "{doc}"
    );
    assert!(doc["expires_at"]["gcp-sa"].as_u64().is_some(), "{doc}");
    assert!(!doc.to_string().contains("PRIVATE KEY"), "{doc}");

    // Traffic across more than three token lifetimes, alternating both URL forms.
    let base = sim.requests().len();
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(LIFETIME * 3 + 1) {
        let path = if sent % 2 == 0 {
            "/ext/vx/v1/chat/completions"
        } else {
            "/v1/chat/completions"
        };
        let (status, body) = post(&stack, path, chat("vx")).await;
        assert_eq!(
            status,
            200,
            "request {sent} at {:?}: {body}",
            started.elapsed()
        );
        sent += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = sim.requests();
    let seen = &seen[base..];
    assert_eq!(seen.len(), sent);
    assert!(seen.iter().all(|r| r.status == 200
        && r.path
            == "/v1/projects/proj-1/locations/us-central1/endpoints/openapi/chat/completions"));
    let tokens: BTreeSet<&str> = seen.iter().filter_map(|r| r.bearer.as_deref()).collect();
    assert!(
        tokens.len() >= 3,
        "{sent} requests over {:?} saw {} tokens",
        started.elapsed(),
        tokens.len()
    );
    assert!(
        sim.refused_grants().is_empty(),
        "{:?}",
        sim.refused_grants()
    );
    eprintln!(
        "vertex: {sent} requests over {:?}, {} distinct tokens, {} issued",
        started.elapsed(),
        tokens.len(),
        sim.tokens_issued()
    );
}

/// The official OpenAI SDK (tests/sdk/clients.py, `MAAS_SDK_PYTHON` from scripts/lib/common.sh)
/// with `base_url = {gateway}/v1` calls the Azure OpenAI (key and Entra), Vertex and Claude on
/// Vertex models, not streamed and streamed, as it would call OpenAI; the official Anthropic SDK
/// calls Claude on Vertex as it would call Anthropic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_sdk_calls_azure_and_vertex_through_the_gateway() {
    let (sim, stack) = start(3600).await;
    for model in ["az", "az-entra", "vx", "claude-vx", "gem-vx"] {
        until_served(&stack, &format!("/ext/{model}/v1/chat/completions"), model).await;
    }
    let python = std::env::var("MAAS_SDK_PYTHON").expect(
        "MAAS_SDK_PYTHON: a Python with tests/sdk/requirements.txt (scripts/lib/common.sh \
         ensure_sdk_clients sets it)",
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/clients.py");
    let base = sim.requests().len();
    let out = tokio::process::Command::new(python)
        .arg(script)
        .env("ANTHROPIC_MODEL", "claude-vx")
        .args([
            stack.gateway_url().as_str(),
            "alice-token",
            "sdk",
            "az",
            "az-entra",
            "vx",
            "claude-vx",
            "gem-vx",
        ])
        .output()
        .await
        .expect("the SDK script runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    for model in ["az", "az-entra", "vx", "claude-vx", "gem-vx"] {
        let m = &v[model];
        assert_eq!(m["text"], "tok0 tok1", "{v}");
        assert_eq!(m["completion_tokens"], 2, "{v}");
        assert_eq!(m["stream_text"], "tok0 tok1", "{v}");
    }
    assert_eq!(v["unknown"]["status"], 404, "{v}");
    let a = &v["anthropic"];
    assert_eq!(
        (
            &a["text"],
            &a["output_tokens"],
            &a["stream_text"],
            &a["stream_output_tokens"]
        ),
        (
            &json!("tok0 tok1"),
            &json!(2),
            &json!("tok0 tok1"),
            &json!(2)
        ),
        "{v}"
    );
    // Each went to its provider's own path: 2 calls per model.
    let seen = sim.requests();
    let paths: BTreeSet<&str> = seen[base..].iter().map(|r| r.path.as_str()).collect();
    assert_eq!(
        paths,
        BTreeSet::from([
            "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21",
            "/v1/projects/proj-1/locations/us-central1/endpoints/openapi/chat/completions",
            "/v1/projects/proj-1/locations/us-central1/publishers/anthropic/models/claude-sonnet-4@20250514:rawPredict",
            "/v1/projects/proj-1/locations/us-central1/publishers/anthropic/models/claude-sonnet-4@20250514:streamRawPredict",
            "/v1/projects/proj-1/locations/us-central1/publishers/google/models/gemini-2.5-flash:generateContent",
            "/v1/projects/proj-1/locations/us-central1/publishers/google/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
        ])
    );
    // 2 calls for each OpenAI-shaped model, 2 Anthropic ones.
    assert_eq!(seen.len() - base, 12);
    assert!(seen[base..].iter().all(|r| r.status == 200));
}

/// A function call to Gemini: the tools leave as function declarations, the call comes back
/// as `tool_calls`, and its result goes back as a `functionResponse` (2 generateContent calls).
async fn gemini_function_call_round_trip(stack: &Stack) {
    // A function call: the tools leave as function declarations, the call comes back as
    // tool_calls, and its result goes back as a functionResponse.
    let weather = json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let ask = json!({"model": "gem-vx", "max_tokens": 20, "tools": weather,
                     "tool_choice": "required",
                     "messages": [{"role": "user", "content": "weather in Paris?"}]});
    let (status, called) = post(stack, "/v1/chat/completions", ask.clone()).await;
    assert_eq!(status, 200, "{called}");
    let choice = &called["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{called}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "weather", "{called}");
    assert_eq!(call["function"]["arguments"], "{\"city\":\"Paris\"}");
    let mut answered = ask.clone();
    answered["tool_choice"] = json!("auto");
    answered["messages"] = json!([
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"sky\": \"clear\"}"}
    ]);
    let (status, text) = post(stack, "/v1/chat/completions", answered).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["choices"][0]["message"]["content"], "tok0 tok1");
}

/// Gemini on Vertex AI in its own API: an OpenAI chat request leaves as a
/// `generateContent` body (the strict simulator refuses anything else), a stream at
/// `streamGenerateContent?alt=sse`; the answers come back as OpenAI chat (the thought part
/// never shown, the stream event by event, usage as Gemini reported it); a function call and
/// its result go both ways; what has no translation (`n` > 1) is refused before anything
/// reaches Vertex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_on_vertex_speaks_generate_content_behind_the_openai_shape() {
    let (sim, stack) = start(3600).await;
    until_served(&stack, "/ext/gem-vx/v1/chat/completions", "gem-vx").await;
    let base = sim.requests().len();
    let body = json!({"model": "gem-vx", "max_tokens": 5, "temperature": 0.5, "stop": ["END"],
                      "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "hello"},
                                   {"role": "user", "content": [{"type": "text", "text": "more"}]}]});
    let (status, answer) = post(&stack, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], "gem-vx");
    assert_eq!(answer["choices"][0]["message"]["content"], "tok0 tok1");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    // Streamed, with the usage asked for: chunks, the usage chunk, [DONE].
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = client()
        .post(format!(
            "{}/ext/gem-vx/v1/chat/completions",
            stack.gateway_url()
        ))
        .header("authorization", "Bearer alice-token")
        .json(&streamed)
        .send()
        .await
        .expect("gateway answers");
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text
        .split(
            "

",
        )
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or(e))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "tok0 tok1");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks.last().unwrap()["usage"]["total_tokens"], 5, "{text}");
    gemini_function_call_round_trip(&stack).await;
    // Structured output: a JSON schema the answer must follow.
    let mut structured = body.clone();
    structured["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "n",
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}});
    let (status, answer) = post(&stack, "/v1/chat/completions", structured).await;
    assert_eq!(status, 200, "{answer}");
    // What has no translation (several choices): refused, never sent.
    let mut several = body.clone();
    several["n"] = json!(2);
    let (status, err) = post(&stack, "/v1/chat/completions", several).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["code"], "untranslatable_request");
    let seen = sim.requests();
    let paths: Vec<&str> = seen[base..].iter().map(|r| r.path.as_str()).collect();
    let at = "/v1/projects/proj-1/locations/us-central1/publishers/google/models/gemini-2.5-flash";
    assert_eq!(
        paths,
        [
            format!("{at}:generateContent"),
            format!("{at}:streamGenerateContent?alt=sse"),
            format!("{at}:generateContent"),
            format!("{at}:generateContent"),
            format!("{at}:generateContent"),
        ]
    );
    assert!(seen[base..].iter().all(|r| r.status == 200));
    gemini_compressed_anyway(&sim, &stack, &body).await;
}

/// A Gemini answer Vertex gzips although the gateway asked for `identity` (JSON and SSE) is
/// decoded, translated and metered like an uncompressed one: the client gets the same
/// translation, uncompressed, with the same usage.
async fn gemini_compressed_anyway(sim: &CloudSimHandle, stack: &Stack, body: &Value) {
    let (status, plain) = post(stack, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{plain}");
    for stream in [false, true] {
        let mut ask = body.clone();
        if stream {
            ask["stream"] = json!(true);
            ask["stream_options"] = json!({"include_usage": true});
        }
        let r = client()
            .post(format!("{}/v1/chat/completions", stack.gateway_url()))
            .header("authorization", "Bearer alice-token")
            .header("x-sim-compress", "always-gzip")
            .json(&ask)
            .send()
            .await
            .expect("gateway answers");
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers().get("content-encoding"), None, "stream {stream}");
        let text = r.text().await.unwrap_or_default();
        if stream {
            let chunks: Vec<Value> = text
                .split("\n\n")
                .filter_map(|e| e.strip_prefix("data: "))
                .filter(|e| *e != "[DONE]")
                .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
                .collect();
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            let content: String = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
                .collect();
            assert_eq!(content, "tok0 tok1", "{text}");
            assert_eq!(chunks.last().map(|c| &c["usage"]), Some(&plain["usage"]));
        } else {
            let v: Value = serde_json::from_str(&text).expect("a JSON answer");
            assert_eq!(v["choices"], plain["choices"], "{text}");
            assert_eq!(v["usage"], plain["usage"], "{text}");
        }
    }
    let gzipped: Vec<bool> = sim
        .requests()
        .iter()
        .rev()
        .take(3)
        .map(|r| r.gzipped)
        .collect();
    assert_eq!(
        gzipped,
        [true, true, false],
        "Vertex gzipped the last two answers only"
    );
}

/// The stack with two federated Vertex models: `vx-wif` reading `token_file`, `vx-escape`
/// naming a file outside the token directory (the directory `token_file` is in).
async fn start_federated(lifetime: u64, token_file: &std::path::Path) -> (CloudSimHandle, Stack) {
    let sim = cloud_sim::spawn(sim_config(lifetime))
        .await
        .expect("cloud simulator starts");
    sim.allow_subject_token("k8s-sa-token-1");
    let mut policy: Value = serde_json::from_str(&policy(&sim)).expect("policy");
    for name in ["vx-wif", "vx-escape"] {
        policy["models"]
            .as_array_mut()
            .expect("models")
            .push(json!({
            "name": name, "path": format!("/ext/{name}"), "tiers": ["free"],
            "backend": sim.url(), "upstreamCluster": format!("ext-{name}"),
            "provider": {"type": "vertex", "credentialRef": name, "auth": "gcpServiceAccount",
                         "project": "proj-1", "location": "us-central1"}}));
    }
    let mut credentials: Value = serde_json::from_str(&credentials(&sim)).expect("credentials");
    credentials["credentials"]["vx-wif"] = json!({
        "credential-config.json": sim.gcp_federation_config(token_file.to_str().expect("utf-8"))});
    credentials["credentials"]["vx-escape"] =
        json!({"credential-config.json": sim.gcp_federation_config("/etc/hostname")});
    let mut options = StackOptions::default()
        .with_policy_yaml(&policy.to_string())
        .with_identities_yaml(IDENTITIES)
        .with_credentials_yaml(&credentials.to_string());
    options.poll_interval_ms = 500;
    let dir = token_file
        .parent()
        .and_then(std::path::Path::to_str)
        .expect("utf-8 dir")
        .to_string();
    options.companion_env.extend([
        ("MAAS_GCP_STS_URL".into(), sim.gcp_sts_url()),
        (
            "MAAS_GCP_IAM_CREDENTIALS_URL".into(),
            sim.gcp_iam_credentials_url(),
        ),
        ("MAAS_GCP_SUBJECT_TOKEN_DIR".into(), dir),
    ]);
    let stack = tokio::task::spawn_blocking(move || Stack::start(options))
        .await
        .expect("stack start task")
        .expect("stack starts");

    (sim, stack)
}

/// Workload identity federation (a Secret's `credential-config.json`, no key anywhere): the
/// companion exchanges its projected Kubernetes token at Google's STS, impersonates the
/// service account at the IAM Credentials API, and hands the filter only the access token.
/// Tokens living 5 s rotate under traffic; kubelet rotating the pod's token midway (the STS
/// refusing the old one from then on) fails no request. A configuration naming a token file
/// outside `--gcp-subject-token-dir` sends nothing anywhere: its model is 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vertex_tokens_from_workload_identity_federation_follow_the_pod_token() {
    // Short enough to rotate several times under traffic; long enough that a refresh (at half
    // its life) reaches every worker's poll on a loaded 2-core machine (3 s flaked once).
    const LIFETIME: u64 = 5;
    let tokens_dir = tempfile::tempdir().expect("token dir");
    let token_file = tokens_dir.path().join("token");
    std::fs::write(&token_file, "k8s-sa-token-1\n").expect("token file");
    let (sim, stack) = start_federated(LIFETIME, &token_file).await;
    until_served(&stack, "/ext/vx-wif/v1/chat/completions", "vx-wif").await;
    let doc = credentials_document(&stack).await;
    let parsed: Value = serde_json::from_str(&doc).expect("JSON");
    assert!(
        parsed["credentials"]["vx-wif"]
            .as_str()
            .is_some_and(|t| t.starts_with("gcp-sim-token-")),
        "{doc}"
    );
    for never in ["k8s-sa-token", "sts-sim-token", "external_account"] {
        assert!(!doc.contains(never), "the filter got {never}: {doc}");
    }
    assert!(parsed["credentials"].get("vx-escape").is_none(), "{doc}");
    let (status, body) = post(
        &stack,
        "/ext/vx-escape/v1/chat/completions",
        chat("vx-escape"),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        body["error"]["code"], "provider_credential_missing",
        "{body}"
    );

    let base = sim.requests().len();
    let started = Instant::now();
    let mut sent = 0;
    let mut rotated = None;
    while started.elapsed() < Duration::from_secs(LIFETIME * 3 + 1) {
        if rotated.is_none() && started.elapsed() > Duration::from_secs(LIFETIME) {
            // kubelet writes a new token; the old one expires half a second later (after any
            // exchange that read it just before has long been answered).
            sim.allow_subject_token("k8s-sa-token-2");
            std::fs::write(&token_file, "k8s-sa-token-2\n").expect("token file");
            rotated = Some((Instant::now(), sim.subject_tokens_seen().len()));
        }
        if let Some((at, _)) = rotated
            && at.elapsed() > Duration::from_millis(500)
        {
            sim.revoke_subject_token("k8s-sa-token-1");
        }
        let path = if sent % 2 == 0 {
            "/ext/vx-wif/v1/chat/completions"
        } else {
            "/v1/chat/completions"
        };
        let (status, body) = post(&stack, path, chat("vx-wif")).await;
        assert_eq!(
            status,
            200,
            "request {sent} at {:?}: {body}",
            started.elapsed()
        );
        sent += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = sim.requests();
    let seen = &seen[base..];
    assert_eq!(seen.len(), sent);
    let tokens: BTreeSet<&str> = seen.iter().filter_map(|r| r.bearer.as_deref()).collect();
    assert!(
        tokens.len() >= 3,
        "{sent} requests saw {} tokens",
        tokens.len()
    );
    assert!(
        tokens.iter().all(|t| t.starts_with("gcp-sim-token-")),
        "{tokens:?}"
    );
    assert!(
        sim.refused_grants().is_empty(),
        "{:?}",
        sim.refused_grants()
    );
    // The file is read again at each exchange: the new pod token was used after the rotation.
    let (_, before) = rotated.expect("rotated during the traffic");
    let after = sim.subject_tokens_seen().split_off(before);
    assert!(
        !after.is_empty() && after.iter().all(|t| t == "k8s-sa-token-2"),
        "{after:?}"
    );
    eprintln!(
        "vertex (federation): {sent} requests over {:?}, {} distinct tokens, {} issued",
        started.elapsed(),
        tokens.len(),
        sim.tokens_issued()
    );
}
