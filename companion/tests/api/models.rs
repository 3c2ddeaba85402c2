//! `GET /v1/models` in the reference's shape (issue 28): per caller the models of its tier and
//! of every subscription it has, each with `kind`, `modelDetails`, `aliases`, `subscriptions`,
//! and `ready` from a probe of the model's server — a real HTTP server here that goes up and
//! down, one that never answers in time, and an address nothing listens on.

use crate::helpers::{IDENTITIES, TestApp, local_settings, spawn_with_config};
use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A model server: `GET /v1/models` answers `status` (200 while up, 503 when failing), counts
/// its probes; [`Backend::stop`] closes its port, [`Backend::start`] opens it again.
pub(crate) struct Backend {
    addr: SocketAddr,
    pub(crate) status: Arc<AtomicU16>,
    pub(crate) probes: Arc<AtomicUsize>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Backend {
    pub(crate) async fn new() -> Backend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut b = Backend {
            addr: listener.local_addr().unwrap(),
            status: Arc::new(AtomicU16::new(200)),
            probes: Arc::default(),
            task: None,
        };
        b.serve(listener);
        b
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (status, probes) = (self.status.clone(), self.probes.clone());
        let router = Router::new().route(
            "/v1/models",
            get(move || async move {
                probes.fetch_add(1, Ordering::SeqCst);
                let s = StatusCode::from_u16(status.load(Ordering::SeqCst)).unwrap();
                (s, axum::Json(json!({"object": "list", "data": []})))
            }),
        );
        self.task = Some(tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        }));
    }

    async fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    async fn start(&mut self) {
        let listener = tokio::net::TcpListener::bind(self.addr).await.unwrap();
        self.serve(listener);
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A server that accepts connections and never answers.
async fn silent_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    (addr, task)
}

/// A port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn policy(up: &str, slow: &str, down: &str) -> String {
    format!(
        r#"
tiers:
  - name: free
    level: 0
    groups: [tier-free-users]
  - name: closed
    level: -1
    groups: [nobody-has-this-group]
models:
  - name: up-model
    path: /llm/up-model
    tiers: [free]
    backend: {up}
    ownedBy: llm/up-model
    aliases: [publishers/llm/models/up-model]
    servedName: facebook/opt-125m
    details:
      displayName: Up Model
      description: A model whose server answers
      genaiUseCase: chat
      contextWindow: "8192"
      capabilities: [text-generation, chat]
  - name: slow-model
    path: /llm/slow-model
    tiers: [free]
    backend: {slow}
  - name: sub-model
    path: /llm/sub-model
    tiers: [closed]
    backend: {down}
  - name: ext-model
    path: /ext/ext-model
    tiers: [closed]
    backend: {up}
    provider: {{type: openai, credentialRef: openai-key}}
    upstreamCluster: outbound|443||api.openai.com
subscriptions:
  - name: team-a
    displayName: Team A
    description: Alice's team
    owner: {{groups: [tier-free-users]}}
    models:
      - {{name: up-model, tokenRateLimits: [{{limit: 100, window: 1m}}]}}
      - {{name: sub-model, tokenRateLimits: [{{limit: 100, window: 1m}}]}}
  - name: dave-only
    owner: {{users: [dave]}}
    models:
      - {{name: sub-model, tokenRateLimits: [{{limit: 100, window: 1m}}]}}
      - {{name: ext-model, tokenRateLimits: [{{limit: 100, window: 1m}}]}}
"#
    )
}

async fn spawn(policy_text: &str, ttl_ms: u64, timeout_ms: u64) -> TestApp {
    let database_url = crate::helpers::create_database().await;
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.yaml");
    let identities = dir.path().join("identities.yaml");
    let credentials = dir.path().join("credentials.yaml");
    std::fs::write(&policy_path, policy_text).unwrap();
    std::fs::write(&identities, IDENTITIES).unwrap();
    std::fs::write(&credentials, "credentials: {openai-key: sk-x}\n").unwrap();
    let mut config = local_settings(&database_url, &policy_path, &identities, &credentials);
    config.model_probe.ttl = Duration::from_millis(ttl_ms);
    config.model_probe.timeout = Duration::from_millis(timeout_ms);
    spawn_with_config(config, dir, policy_path, database_url, Default::default()).await
}

fn by_id(body: &Value) -> std::collections::BTreeMap<String, Value> {
    body["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{body}"))
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_string(), m.clone()))
        .collect()
}

/// Everything a caller may use, in the reference's fields; `ready` follows the server.
#[tokio::test]
async fn the_listing_has_the_references_fields_and_real_readiness() {
    let mut up = Backend::new().await;
    let (slow, _silent) = silent_server().await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    let app = spawn(
        &policy(&up.url(), &format!("http://{slow}"), &down),
        100,
        500,
    )
    .await;

    // Alice: her tier's models (up, slow) and her subscription's (up, sub).
    let started = Instant::now();
    let r = app.public_get("/v1/models", Some("alice-token")).await;
    let took = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["cache-control"], "no-store");
    let models = by_id(&r.body);
    assert_eq!(
        models.keys().collect::<Vec<_>>(),
        ["slow-model", "sub-model", "up-model"]
    );
    // The silent server cost the listing about the probe timeout, not more.
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let m = &models["up-model"];
    assert_eq!(m["object"], "model");
    assert_eq!(m["kind"], "llmisvc");
    assert_eq!(m["owned_by"], "llm/up-model");
    assert_eq!(m["ready"], true, "{m}");
    assert_eq!(m["aliases"], json!(["publishers/llm/models/up-model"]));
    assert_eq!(
        m["modelDetails"],
        json!({"displayName": "Up Model", "description": "A model whose server answers",
               "genaiUseCase": "chat", "contextWindow": "8192",
               "modelCapabilities": ["text-generation", "chat"]})
    );
    assert_eq!(
        m["subscriptions"],
        json!([{"name": "team-a", "displayName": "Team A", "description": "Alice's team"}])
    );
    assert_eq!(
        models["slow-model"]["ready"], false,
        "never answers in time"
    );
    assert!(
        models["slow-model"].get("subscriptions").is_none(),
        "reached through the tier only"
    );
    assert!(models["slow-model"].get("modelDetails").is_none());
    assert!(models["slow-model"].get("aliases").is_none());
    assert_eq!(models["sub-model"]["ready"], false, "nothing listens there");

    // The server fails, then its port closes: false; it comes back: true again.
    up.status.store(503, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = app.public_get("/v1/models", Some("alice-token")).await;
    assert_eq!(by_id(&r.body)["up-model"]["ready"], false);
    up.stop().await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = app.public_get("/v1/models", Some("alice-token")).await;
    assert_eq!(by_id(&r.body)["up-model"]["ready"], false);
    up.status.store(200, Ordering::SeqCst);
    up.start().await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = app.public_get("/v1/models", Some("alice-token")).await;
    assert_eq!(by_id(&r.body)["up-model"]["ready"], true);

    // Dave has no tier but a subscription: its models, not an empty list. The external model
    // is of kind ExternalModel; its server answering counts as up.
    let r = app.public_get("/v1/models", Some("dave-token")).await;
    let models = by_id(&r.body);
    assert_eq!(
        models.keys().collect::<Vec<_>>(),
        ["ext-model", "sub-model"]
    );
    assert_eq!(models["ext-model"]["kind"], "ExternalModel");
    assert_eq!(models["ext-model"]["ready"], true);
    assert_eq!(
        models["sub-model"]["subscriptions"],
        json!([{"name": "dave-only"}])
    );

    // A key bound to team-a: team-a's models only.
    let key = app
        .mint(
            "alice-token",
            json!({"name": "k", "subscription": "team-a"}),
        )
        .await;
    let r = app
        .public_get("/v1/models", Some(key["key"].as_str().unwrap()))
        .await;
    assert_eq!(
        by_id(&r.body).keys().collect::<Vec<_>>(),
        ["sub-model", "up-model"]
    );
}

/// One probe per server per TTL, however many listings ask (concurrent ones share it).
#[tokio::test]
async fn probes_are_cached_for_the_ttl_and_shared() {
    let up = Backend::new().await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    let app = spawn(&policy(&up.url(), &down, &down), 60_000, 500).await;
    let listings = (0..8).map(|_| app.public_get("/v1/models", Some("alice-token")));
    for r in futures::future::join_all(listings).await {
        assert_eq!(by_id(&r.body)["up-model"]["ready"], true);
    }
    // up-model and ext-model share the server but not the rule (a provider's 401 counts): two.
    assert_eq!(up.probes.load(Ordering::SeqCst), 1);
    app.public_get("/v1/models", Some("dave-token")).await;
    assert_eq!(up.probes.load(Ordering::SeqCst), 2);
    app.public_get("/v1/models", Some("dave-token")).await;
    assert_eq!(up.probes.load(Ordering::SeqCst), 2);
}

/// `backend: simulator` models are probed at `--simulator-url` (the local stack's simulator).
#[tokio::test]
async fn simulator_models_are_probed_at_the_simulator_url() {
    let sim = Backend::new().await;
    let database_url = crate::helpers::create_database().await;
    let app = crate::helpers::spawn_app_on(database_url, |c| {
        c.model_probe.simulator_url = Some(sim.url());
    })
    .await;
    let r = app.public_get("/v1/models", Some("alice-token")).await;
    assert_eq!(by_id(&r.body)["sim-model"]["ready"], true, "{}", r.body);
    assert_eq!(sim.probes.load(Ordering::SeqCst), 1);
}
