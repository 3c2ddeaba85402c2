//! Several backends per model where a provider has its own path scheme (issue 29), through real
//! Envoy with the release .wasm: an Azure OpenAI deployment beside an OpenAI-compatible
//! backend. The filter's upstream mode sets each attempt's `:path` for the backend Envoy chose
//! — Azure's `/openai/deployments/{deployment}/…?api-version=`, the other's `/v1/…` — from the
//! operation, whatever an earlier attempt of the same request sent (Envoy hands every attempt
//! the same headers). The Azure backend is the strict simulator (an unknown path 404, a
//! missing or unknown `api-version` 400, another key 401), so a 200 is the proof.

use crate::helpers::*;
use maas_e2e::cloud_sim::{self, CloudSimConfig};
use maas_e2e::sim::{self, RecordedRequest, SimConfig, SimHandle};
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const IDENTITIES: &str = r#"
identities:
  - {token: alice-token, username: alice, groups: [g-free]}
"#;

const OPENAI_KEY: &str = "sk-openai-plain";
const AZURE_KEY: &str = "sk-azure-static";
const DEPLOYMENT: &str = "gpt-4o-prod";
const API_VERSION: &str = "2024-10-21";

fn azure_path(deployment: &str, op: &str) -> String {
    format!("/openai/deployments/{deployment}/{op}?api-version={API_VERSION}")
}

fn cloud_config() -> CloudSimConfig {
    CloudSimConfig {
        azure_deployment: DEPLOYMENT.into(),
        azure_api_key: AZURE_KEY.into(),
        azure_tenant: "contoso.onmicrosoft.com".into(),
        azure_client_id: "app-1".into(),
        azure_client_secret: "unused".into(),
        vertex_project: "proj-1".into(),
        vertex_location: "us-central1".into(),
        gcp_private_key_pem: include_str!("../../fixtures/test-gcp-service-account-key.pem").into(),
        gcp_client_email: "gateway@proj-1.iam.gserviceaccount.com".into(),
        token_lifetime: 3600,
    }
}

/// An OpenAI-compatible simulator that requires `name: value` (and answers `fault`, if any).
fn plain_sim(name: &str, value: &str, fault: Option<&str>) -> SimHandle {
    let s = sim::spawn("127.0.0.1:0".parse().unwrap(), SimConfig::default())
        .expect("a simulator starts");
    s.require_key(name, value);
    if let Some(f) = fault {
        s.set_fault(f);
    }
    s
}

fn openai_backend(name: &str, url: &str) -> Value {
    json!({"name": name, "backend": url, "weight": 50, "timeout": "30s",
           "provider": {"type": "openai", "credentialRef": "openai-key"}})
}

fn azure_backend(name: &str, url: &str, deployment: &str) -> Value {
    json!({"name": name, "backend": url, "weight": 50, "timeout": "30s",
           "provider": {"type": "azure-openai", "credentialRef": "azure-key",
                        "deployment": deployment, "apiVersion": API_VERSION}})
}

fn model(name: &str, backends: &[Value]) -> Value {
    json!({"name": name, "path": format!("/llm/{name}"), "tiers": ["free"],
           "upstreamCluster": format!("{name}-backends"), "backends": backends})
}

async fn start(models: Vec<Value>) -> Stack {
    let policy = json!({
        "observability": {"usageEvents": true},
        "tiers": [{"name": "free", "level": 0, "groups": ["g-free"],
                   "limits": {"requests": [{"limit": 100000, "window": "1d"}]}}],
        "models": models,
    })
    .to_string();
    let credentials =
        json!({"credentials": {"openai-key": OPENAI_KEY, "azure-key": AZURE_KEY}}).to_string();
    let mut options = StackOptions::default()
        .with_policy_yaml(&policy)
        .with_identities_yaml(IDENTITIES)
        .with_credentials_yaml(&credentials);
    options.poll_interval_ms = 500;
    tokio::task::spawn_blocking(move || Stack::start(options))
        .await
        .expect("stack start task")
        .expect("stack starts")
}

async fn call(stack: &Stack, path: &str, model: &str) -> Reply {
    let body = if path.ends_with("/embeddings") {
        json!({"model": model, "input": "one two three"})
    } else {
        json!({"model": model, "max_tokens": 3,
               "messages": [{"role": "user", "content": "one two three four"}]})
    };
    chat(
        stack,
        path,
        "backend_paths",
        &[
            ("authorization", &bearer("alice-token")),
            ("api-key", "client-sent"),
        ],
        body,
    )
    .await
}

/// Ten answers in a row from `model` (every worker's filters, the upstream ones too, hold the
/// policy and the credentials). Returns the calls it made.
async fn until_served(stack: &Stack, model: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut in_a_row, mut calls) = (0, 0);
    while in_a_row < 10 {
        let r = call(stack, &format!("/llm/{model}/v1/chat/completions"), model).await;
        calls += 1;
        in_a_row = if r.status == 200 { in_a_row + 1 } else { 0 };
        assert!(
            Instant::now() < deadline,
            "{model} never served: {} {}",
            r.status,
            r.body
        );
        if r.status != 200 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    calls
}

fn paths(seen: &[RecordedRequest]) -> Vec<&str> {
    seen.iter().map(|r| r.path.as_str()).collect()
}

fn header<'a>(r: &'a RecordedRequest, name: &str) -> Vec<&'a str> {
    r.headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .collect()
}

/// Weighted traffic to an OpenAI backend and an Azure deployment: each request reaches one of
/// them at its own path with its own key — chat at the model's URL and at the one base URL,
/// embeddings, and the official OpenAI SDK, streamed and not; the client's query string and
/// `api-key` reach neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_backend_gets_its_own_path_azure_its_deployment() {
    let azure = cloud_sim::spawn(cloud_config())
        .await
        .expect("cloud simulator starts");
    let plain = plain_sim("authorization", &bearer(OPENAI_KEY), None);
    let stack = start(vec![model(
        "mix",
        &[
            openai_backend("plain", &plain.url()),
            azure_backend("azure", &azure.url(), DEPLOYMENT),
        ],
    )])
    .await;
    until_served(&stack, "mix").await;
    let (a0, p0) = (azure.requests().len(), plain.requests().len());
    let n = 40;
    for i in 0..n {
        let path = match i % 4 {
            0 => "/llm/mix/v1/chat/completions?api-version=1999-01-01",
            1 => "/v1/chat/completions",
            2 => "/llm/mix/v1/embeddings",
            _ => "/v1/embeddings",
        };
        let r = call(&stack, path, "mix").await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    let azure_seen = azure.requests().split_off(a0);
    let plain_seen = plain.requests().split_off(p0);
    eprintln!(
        "backend_paths: 50/50 weights gave azure {} / plain {}",
        azure_seen.len(),
        plain_seen.len()
    );
    assert_eq!(azure_seen.len() + plain_seen.len(), n, "one backend each");
    assert!(azure_seen.len() >= 8 && plain_seen.len() >= 8);
    assert!(azure_seen.iter().all(|r| r.status == 200), "{azure_seen:?}");
    for p in azure_seen.iter().map(|r| r.path.as_str()) {
        assert!(
            [
                azure_path(DEPLOYMENT, "chat/completions"),
                azure_path(DEPLOYMENT, "embeddings")
            ]
            .iter()
            .any(|a| a == p),
            "azure got {p}"
        );
    }
    assert!(
        azure_seen
            .iter()
            .all(|r| r.api_key.as_deref() == Some(AZURE_KEY))
    );
    for r in &plain_seen {
        assert!(
            ["/v1/chat/completions", "/v1/embeddings"].contains(&r.path.as_str()),
            "plain got {}",
            r.path
        );
        assert_eq!(header(r, "authorization"), [bearer(OPENAI_KEY)]);
        assert!(header(r, "api-key").is_empty(), "{:?}", r.headers);
    }

    // The official OpenAI SDK at the one base URL, not streamed and streamed.
    let python = std::env::var("MAAS_SDK_PYTHON").expect(
        "MAAS_SDK_PYTHON: a Python with tests/sdk/requirements.txt (scripts/lib/common.sh \
         ensure_sdk_clients sets it)",
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/clients.py");
    let (a1, p1) = (azure.requests().len(), plain.requests().len());
    for _ in 0..3 {
        let out = tokio::process::Command::new(&python)
            .arg(script)
            .args([stack.gateway_url().as_str(), "alice-token", "sdk", "mix"])
            .output()
            .await
            .expect("the SDK script runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        // The two calls may reach different backends (the simulators answer alike but for
        // their length): each answered with text.
        for field in ["text", "stream_text"] {
            let text = v["mix"][field].as_str().unwrap_or_default();
            assert!(text.starts_with("tok0 tok1"), "{field}: {v}");
        }
    }
    // Six chat calls between them, each at its backend's own path.
    let azure_sdk = azure.requests().split_off(a1);
    let plain_sdk = plain.requests().split_off(p1);
    assert_eq!(azure_sdk.len() + plain_sdk.len(), 6);
    let chat = azure_path(DEPLOYMENT, "chat/completions");
    assert!(azure_sdk.iter().all(|r| r.path == chat && r.status == 200));
    assert!(plain_sdk.iter().all(|r| r.path == "/v1/chat/completions"));
}

/// Failover across path schemes, both ways: an OpenAI backend answering 503 fails over to the
/// Azure deployment, which gets its own path and key; an Azure backend answering 503 fails over
/// to an OpenAI backend, which gets `/v1/chat/completions` — never the Azure path the first
/// attempt left in the shared headers. Each client request gets one clean 200, counted once,
/// the usage event naming the backend that served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_sends_each_backend_its_own_path_both_ways() {
    let azure = cloud_sim::spawn(cloud_config())
        .await
        .expect("cloud simulator starts");
    let plain_down = plain_sim("authorization", &bearer(OPENAI_KEY), Some("status-503"));
    let azure_down = plain_sim("api-key", AZURE_KEY, Some("status-503"));
    let plain = plain_sim("authorization", &bearer(OPENAI_KEY), None);
    let stack = start(vec![
        model(
            "to-azure",
            &[
                openai_backend("plain", &plain_down.url()),
                azure_backend("azure", &azure.url(), DEPLOYMENT),
            ],
        ),
        model(
            "from-azure",
            &[
                azure_backend("azure", &azure_down.url(), "dep-down"),
                openai_backend("plain", &plain.url()),
            ],
        ),
    ])
    .await;
    let warm = [
        until_served(&stack, "to-azure").await,
        until_served(&stack, "from-azure").await,
    ];
    let n = 16;
    for model in ["to-azure", "from-azure"] {
        for i in 0..n {
            let path = if i % 2 == 0 {
                format!("/llm/{model}/v1/chat/completions")
            } else {
                "/v1/chat/completions".to_string()
            };
            let r = call(&stack, &path, model).await;
            assert_eq!(r.status, 200, "{model} {path}: {}", r.body);
            assert_eq!(r.json()["object"], "chat.completion", "{}", r.body);
        }
    }
    // OpenAI → Azure: the failing OpenAI backend got the OpenAI path; Azure every answer.
    let down = plain_down.requests();
    assert!(!down.is_empty(), "the failing backend was tried");
    assert!(paths(&down).iter().all(|p| *p == "/v1/chat/completions"));
    let chat = azure_path(DEPLOYMENT, "chat/completions");
    assert!(
        azure
            .requests()
            .iter()
            .all(|r| r.path == chat && r.status == 200 && r.api_key.as_deref() == Some(AZURE_KEY))
    );
    // Azure → OpenAI: the failing deployment got its Azure path and key; the OpenAI backend
    // only ever the OpenAI path, and no Azure key.
    let tried = azure_down.requests();
    assert!(!tried.is_empty(), "the failing deployment was tried");
    assert!(
        paths(&tried)
            .iter()
            .all(|p| *p == azure_path("dep-down", "chat/completions")),
        "{:?}",
        paths(&tried)
    );
    assert!(tried.iter().all(|r| header(r, "api-key") == [AZURE_KEY]));
    let served = plain.requests();
    assert!(
        paths(&served).iter().all(|p| *p == "/v1/chat/completions"),
        "{:?}",
        paths(&served)
    );
    assert!(
        served.iter().all(|r| header(r, "api-key").is_empty()
            && header(r, "authorization") == [bearer(OPENAI_KEY)])
    );
    // Counted once each, served by the backend that answered.
    for ((model, by), warm) in [("to-azure", "azure"), ("from-azure", "plain")]
        .into_iter()
        .zip(warm)
    {
        let events = events_of(&stack, model, warm + n).await;
        let answered: Vec<&Value> = events.iter().filter(|e| e["status"] == 200).collect();
        assert!(answered.len() >= n + 10, "{model}: {events:?}");
        assert!(
            answered.iter().all(|e| e["served_by"] == by),
            "{model}: {answered:?}"
        );
    }
}
