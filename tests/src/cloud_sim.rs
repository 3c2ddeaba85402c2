//! Strict simulators of cloud providers as they authenticate and speak (issue 29), on one
//! HTTP server (each model still gets its own Envoy cluster):
//!
//! - Azure OpenAI: only `POST /openai/deployments/<known deployment>/{chat/completions,
//!   completions, embeddings}` (else 404 `Resource not found`, as Azure answers), with an
//!   `api-version` it knows (missing or unknown: 400), authenticated by the `api-key` header
//!   (the configured key) or `Authorization: Bearer` with a valid Entra token it issued (else
//!   401).
//! - Vertex AI: only `POST /v1/projects/<project>/locations/<location>/endpoints/openapi/
//!   chat/completions` (else 404), with `Authorization: Bearer` and a Google access token it
//!   issued that has not expired (else 401 `UNAUTHENTICATED`).
//! - Claude on Vertex AI: only `POST /v1/projects/<project>/locations/<location>/publishers/
//!   anthropic/models/<VERTEX_CLAUDE_MODEL>:rawPredict` (a JSON Messages answer) and
//!   `:streamRawPredict` (Messages SSE), with the same bearer token; the body must be an
//!   Anthropic Messages body without `model`, with `anthropic_version: vertex-2023-10-16` and
//!   `max_tokens`, `stream: true` exactly at the stream method (else 400 `INVALID_ARGUMENT`).
//! - Gemini on Vertex AI: only `POST /v1/projects/<project>/locations/<location>/publishers/
//!   google/models/<VERTEX_GEMINI_MODEL>:generateContent` (JSON) and `:streamGenerateContent`
//!   with `alt=sse` (SSE), with the same bearer token; the body must be a `GenerateContentRequest`
//!   with only the fields Vertex knows (unknown names, roles or parts: 400 `INVALID_ARGUMENT`);
//!   with `toolConfig` mode `ANY` it answers a `functionCall` of the allowed (else first
//!   declared) function. Every Vertex answer is gzipped when the request says `x-sim-compress:
//!   always-gzip` (not Google's: a misbehaving upstream that ignores `accept-encoding`).
//! - Google's token endpoint `POST /gcp/token`: the JWT bearer grant only; the assertion's
//!   RS256 signature is verified against the service-account key's public key, and its `iss`
//!   (the key's `client_email`), `aud` (this very endpoint), `scope` (cloud-platform), `iat`
//!   and `exp` (at most an hour, not expired) checked; issues tokens valid for
//!   [`CloudSimConfig::token_lifetime`] seconds.
//! - Workload identity federation: Google's STS `POST /gcp/sts` (RFC 8693 token exchange of
//!   a Kubernetes token it accepts — [`CloudSimHandle::allow_subject_token`] — for the pool's
//!   [`WIF_AUDIENCE`], cloud-platform scope) and the IAM Credentials API `POST
//!   /gcp/iam/v1/projects/-/serviceAccounts/<WIF_SERVICE_ACCOUNT>:generateAccessToken`
//!   (bearer: a valid STS token; lifetime ≤ 3600 s), whose access tokens Vertex accepts.
//! - Microsoft Entra `POST /<tenant>/oauth2/v2.0/token`: the client credentials grant for the
//!   Cognitive Services scope, with the configured tenant, client id and secret.
//!
//! Every model request is recorded (path with query, the credential it carried) and answered
//! with a chat completion (streamed when the body asks, usage last when `stream_options` asks)
//! or an embedding, whose usage is fixed: 3 prompt, 2 completion tokens.

use axum::Router;
use axum::extract::{Form, Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// The Claude model id the Vertex simulator serves (Vertex's `name@version` form).
pub const VERTEX_CLAUDE_MODEL: &str = "claude-sonnet-4@20250514";

/// The Gemini model id the Vertex simulator serves in Vertex's own API.
pub const VERTEX_GEMINI_MODEL: &str = "gemini-2.5-flash";

/// The `api-version`s the Azure simulator knows.
pub const AZURE_API_VERSIONS: &[&str] = &["2024-06-01", "2024-10-21", "2025-01-01-preview"];
pub const GCP_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
pub const AZURE_SCOPE: &str = "https://cognitiveservices.azure.com/.default";
/// The workload identity pool provider the STS simulator exchanges tokens for.
pub const WIF_AUDIENCE: &str =
    "//iam.googleapis.com/projects/123456/locations/global/workloadIdentityPools/ocp/providers/ocp";
/// The service account the federated token may impersonate.
pub const WIF_SERVICE_ACCOUNT: &str = "vertex-caller@proj-1.iam.gserviceaccount.com";

#[derive(Debug, Clone)]
pub struct CloudSimConfig {
    pub azure_deployment: String,
    /// The static key `api-key` must carry.
    pub azure_api_key: String,
    pub azure_tenant: String,
    pub azure_client_id: String,
    pub azure_client_secret: String,
    pub vertex_project: String,
    pub vertex_location: String,
    /// The service-account key's private key (PKCS#8 PEM): its public half verifies assertions.
    pub gcp_private_key_pem: String,
    pub gcp_client_email: String,
    /// Seconds the issued access tokens are valid.
    pub token_lifetime: u64,
}

/// One model request the simulator answered (or refused).
#[derive(Debug, Clone)]
pub struct CloudRequest {
    pub path: String,
    /// The `api-key` header.
    pub api_key: Option<String>,
    /// The `Authorization: Bearer` token.
    pub bearer: Option<String>,
    pub status: u16,
    /// The answer went out gzipped (`x-sim-compress: always-gzip`).
    pub gzipped: bool,
}

#[derive(Default)]
struct Recorded {
    requests: Vec<CloudRequest>,
    /// Issued tokens → expiry (unix ms), by kind (`gcp`, `entra`).
    tokens: HashMap<String, (&'static str, u128)>,
    issued: u32,
    /// Token requests refused, with why.
    refused_grants: Vec<String>,
}

struct Sim {
    config: CloudSimConfig,
    url: String,
    public_key: jwt_simple::prelude::RS256PublicKey,
    recorded: Mutex<Recorded>,
    /// The Kubernetes tokens the STS accepts now, and those it was sent (in order).
    subject_tokens: Mutex<(Vec<String>, Vec<String>)>,
}

#[derive(Clone)]
pub struct CloudSimHandle {
    sim: Arc<Sim>,
    pub addr: SocketAddr,
}

impl CloudSimHandle {
    pub fn url(&self) -> String {
        self.sim.url.clone()
    }
    pub fn gcp_token_uri(&self) -> String {
        format!("{}/gcp/token", self.sim.url)
    }
    pub fn requests(&self) -> Vec<CloudRequest> {
        self.sim.recorded.lock().unwrap().requests.clone()
    }
    pub fn tokens_issued(&self) -> u32 {
        self.sim.recorded.lock().unwrap().issued
    }
    /// A projected service-account token the STS accepts from now on (kubelet issued it).
    pub fn allow_subject_token(&self, token: &str) {
        self.sim
            .subject_tokens
            .lock()
            .unwrap()
            .0
            .push(token.to_string());
    }
    /// A token the STS refuses from now on (it expired).
    pub fn revoke_subject_token(&self, token: &str) {
        self.sim
            .subject_tokens
            .lock()
            .unwrap()
            .0
            .retain(|t| t != token);
    }
    /// The subject tokens the STS was sent, in order.
    pub fn subject_tokens_seen(&self) -> Vec<String> {
        self.sim.subject_tokens.lock().unwrap().1.clone()
    }
    pub fn gcp_sts_url(&self) -> String {
        format!("{}/gcp/sts", self.sim.url)
    }
    pub fn gcp_iam_credentials_url(&self) -> String {
        format!("{}/gcp/iam", self.sim.url)
    }
    /// Google's `external_account` configuration (`credential-config.json`) for this
    /// simulator, reading the subject token from `token_file`.
    pub fn gcp_federation_config(&self, token_file: &str) -> String {
        json!({
            "universe_domain": "googleapis.com",
            "type": "external_account",
            "audience": WIF_AUDIENCE,
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": self.gcp_sts_url(),
            "service_account_impersonation_url": format!(
                "{}/v1/projects/-/serviceAccounts/{WIF_SERVICE_ACCOUNT}:generateAccessToken",
                self.gcp_iam_credentials_url()
            ),
            "credential_source": {"file": token_file, "format": {"type": "text"}},
        })
        .to_string()
    }
    pub fn refused_grants(&self) -> Vec<String> {
        self.sim.recorded.lock().unwrap().refused_grants.clone()
    }
    /// The service-account key file (`service-account.json`) for this simulator's key.
    pub fn gcp_key_json(&self) -> String {
        let c = &self.sim.config;
        json!({
            "type": "service_account",
            "project_id": c.vertex_project,
            "private_key_id": "sim-key-1",
            "private_key": c.gcp_private_key_pem,
            "client_email": c.gcp_client_email,
            "client_id": "1234567890",
            "token_uri": self.gcp_token_uri(),
        })
        .to_string()
    }
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

/// Starts the simulator on a free port of 127.0.0.1, on the current tokio runtime.
pub async fn spawn(config: CloudSimConfig) -> anyhow::Result<CloudSimHandle> {
    use jwt_simple::prelude::*;
    let public_key = RS256KeyPair::from_pem(&config.gcp_private_key_pem)?.public_key();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let sim = Arc::new(Sim {
        config,
        url: format!("http://{addr}"),
        public_key,
        recorded: Mutex::default(),
        subject_tokens: Mutex::default(),
    });
    let app = Router::new()
        .route("/gcp/token", axum::routing::post(gcp_token))
        .route("/gcp/sts", axum::routing::post(gcp_sts))
        .route(
            "/gcp/iam/v1/projects/-/serviceAccounts/{account}",
            axum::routing::post(gcp_generate_access_token),
        )
        .route(
            "/{tenant}/oauth2/v2.0/token",
            axum::routing::post(entra_token),
        )
        .fallback(model_request)
        .with_state(sim.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(CloudSimHandle { sim, addr })
}

fn oauth_error(status: StatusCode, error: &str, why: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": error, "error_description": why})),
    )
        .into_response()
}

impl Sim {
    fn refuse_grant(&self, why: &str) -> Response {
        self.recorded
            .lock()
            .unwrap()
            .refused_grants
            .push(why.to_string());
        oauth_error(StatusCode::BAD_REQUEST, "invalid_grant", why)
    }

    fn issue(&self, kind: &'static str) -> Response {
        let lifetime = self.config.token_lifetime;
        let token = self.new_token(kind, lifetime);
        axum::Json(json!({"access_token": token, "token_type": "Bearer", "expires_in": lifetime}))
            .into_response()
    }

    /// A new token of `kind`, valid for `lifetime` seconds.
    fn new_token(&self, kind: &'static str, lifetime: u64) -> String {
        let mut r = self.recorded.lock().unwrap();
        r.issued += 1;
        let token = format!("{kind}-sim-token-{}", r.issued);
        r.tokens.insert(
            token.clone(),
            (kind, now_ms() + u128::from(lifetime) * 1000),
        );
        token
    }

    fn valid_token(&self, token: &str, kind: &str) -> bool {
        let r = self.recorded.lock().unwrap();
        r.tokens
            .get(token)
            .is_some_and(|(k, expires)| *k == kind && now_ms() < *expires)
    }
}

async fn gcp_token(
    State(sim): State<Arc<Sim>>,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    use jwt_simple::prelude::*;
    if form.get("grant_type").map(String::as_str)
        != Some("urn:ietf:params:oauth:grant-type:jwt-bearer")
    {
        return sim.refuse_grant("grant_type must be the JWT bearer grant");
    }
    let Some(assertion) = form.get("assertion") else {
        return sim.refuse_grant("no assertion");
    };
    let options = VerificationOptions {
        allowed_issuers: Some(HashSet::from_strings(&[&sim.config.gcp_client_email])),
        allowed_audiences: Some(HashSet::from_strings(&[format!("{}/gcp/token", sim.url)])),
        time_tolerance: Some(jwt_simple::prelude::Duration::from_secs(5)),
        ..Default::default()
    };
    let claims = match sim
        .public_key
        .verify_token::<Value>(assertion, Some(options))
    {
        Ok(c) => c,
        Err(e) => return sim.refuse_grant(&format!("invalid assertion: {e}")),
    };
    let scope_ok = claims.custom["scope"]
        .as_str()
        .is_some_and(|s| s.split(' ').any(|s| s == GCP_SCOPE));
    if !scope_ok {
        return sim.refuse_grant("scope must include cloud-platform");
    }
    match (claims.issued_at, claims.expires_at) {
        (Some(iat), Some(exp)) if exp > iat && (exp - iat).as_secs() <= 3600 => {}
        _ => return sim.refuse_grant("iat and exp required, at most an hour apart"),
    }
    sim.issue("gcp")
}

/// Google's STS: RFC 8693 token exchange of the current Kubernetes token for a federated
/// token, as `sts.googleapis.com/v1/token` checks it.
async fn gcp_sts(
    State(sim): State<Arc<Sim>>,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    let get = |k: &str| form.get(k).map(String::as_str);
    if get("grant_type") != Some("urn:ietf:params:oauth:grant-type:token-exchange") {
        return sim.refuse_grant("grant_type must be the token exchange grant");
    }
    if get("audience") != Some(WIF_AUDIENCE) {
        return sim.refuse_grant("audience is not the workload identity pool provider");
    }
    if get("requested_token_type") != Some("urn:ietf:params:oauth:token-type:access_token")
        || get("subject_token_type") != Some("urn:ietf:params:oauth:token-type:jwt")
        || !get("scope").is_some_and(|s| s.split(' ').any(|s| s == GCP_SCOPE))
    {
        return sim.refuse_grant("token types or scope not as Google requires");
    }
    let accepted = {
        let mut tokens = sim.subject_tokens.lock().unwrap();
        let sent = get("subject_token").unwrap_or_default().to_string();
        let accepted = tokens.0.contains(&sent);
        tokens.1.push(sent);
        accepted
    };
    if !accepted {
        return sim.refuse_grant("the subject token is not a valid Kubernetes token");
    }
    sim.issue("sts")
}

/// The IAM Credentials API's `generateAccessToken` for the one service account the federated
/// principal may impersonate.
async fn gcp_generate_access_token(
    State(sim): State<Arc<Sim>>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let google_error = |status: StatusCode, why: &str| {
        sim.recorded
            .lock()
            .unwrap()
            .refused_grants
            .push(why.to_string());
        (
            status,
            axum::Json(json!({"error": {"code": status.as_u16(), "message": why}})),
        )
            .into_response()
    };
    if account != format!("{WIF_SERVICE_ACCOUNT}:generateAccessToken") {
        return google_error(StatusCode::NOT_FOUND, "no such service account or method");
    }
    if !bearer(&headers).is_some_and(|t| sim.valid_token(t, "sts")) {
        return google_error(StatusCode::UNAUTHORIZED, "no valid federated token");
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let scoped = body["scope"]
        .as_array()
        .is_some_and(|s| s.iter().any(|s| s == GCP_SCOPE));
    let lifetime = body["lifetime"]
        .as_str()
        .and_then(|l| l.strip_suffix('s'))
        .and_then(|l| l.parse::<u64>().ok());
    let Some(lifetime) = lifetime.filter(|l| scoped && (1..=3600).contains(l)) else {
        return google_error(
            StatusCode::BAD_REQUEST,
            "scope must include cloud-platform, lifetime at most 3600s",
        );
    };
    let lifetime = lifetime.min(sim.config.token_lifetime);
    let token = sim.new_token("gcp", lifetime);
    let expire =
        chrono::Utc::now() + chrono::Duration::seconds(i64::try_from(lifetime).unwrap_or(3600));
    axum::Json(json!({
        "accessToken": token,
        "expireTime": expire.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    }))
    .into_response()
}

async fn entra_token(
    State(sim): State<Arc<Sim>>,
    Path(tenant): Path<String>,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    let c = &sim.config;
    let get = |k: &str| form.get(k).map(String::as_str);
    if tenant != c.azure_tenant {
        return oauth_error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "AADSTS90002: tenant not found",
        );
    }
    if get("grant_type") != Some("client_credentials") || get("scope") != Some(AZURE_SCOPE) {
        return sim.refuse_grant("client_credentials for the Cognitive Services scope only");
    }
    if get("client_id") != Some(c.azure_client_id.as_str())
        || get("client_secret") != Some(c.azure_client_secret.as_str())
    {
        sim.recorded
            .lock()
            .unwrap()
            .refused_grants
            .push("invalid client".into());
        return oauth_error(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            "AADSTS7000215: Invalid client secret provided.",
        );
    }
    sim.issue("entra")
}

fn azure_error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"code": code, "message": message}})),
    )
        .into_response()
}

/// A chat completion streamed as OpenAI streams it (Azure OpenAI and Vertex's OpenAI endpoint
/// alike): two content chunks, then the usage chunk when `stream_options.include_usage` asks
/// for it, then `[DONE]`.
fn streamed(include_usage: bool) -> Response {
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": "sim",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events = vec![
        chunk(json!({"role": "assistant", "content": "tok0"}), Value::Null),
        chunk(json!({"content": " tok1"}), json!("length")),
    ];
    if include_usage {
        events.push(
            json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0,
            "model": "sim", "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        );
    }
    let mut body = String::new();
    for e in events {
        body.push_str(&format!("data: {e}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    ([("content-type", "text/event-stream")], body).into_response()
}

fn completion(op: &str) -> Response {
    let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
    let body = if op == "embeddings" {
        json!({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
               "model": "sim", "usage": {"prompt_tokens": 3, "total_tokens": 3}})
    } else {
        json!({"id": "chatcmpl-sim", "object": "chat.completion", "created": 0, "model": "sim",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok0 tok1"},
                            "finish_reason": "length"}],
               "usage": usage})
    };
    axum::Json(body).into_response()
}

fn google_error(status: StatusCode, message: &str) -> Response {
    let code = status.as_u16();
    let name = if code == 401 {
        "UNAUTHENTICATED"
    } else {
        "INVALID_ARGUMENT"
    };
    (
        status,
        axum::Json(json!({"error": {"code": code, "status": name, "message": message}})),
    )
        .into_response()
}

/// Claude on Vertex: the body checked as Vertex checks it, answered as Anthropic answers (text
/// `tok0 tok1`, usage 3 input and 2 output tokens).
fn claude_on_vertex(method: &str, body: &Value) -> Response {
    let stream = body["stream"] == json!(true);
    let problem = if !body.is_object() {
        Some("the body is not a JSON object")
    } else if body.get("model").is_some() {
        Some("Invalid JSON payload received. Unknown name \"model\": the model is in the URL")
    } else if body["anthropic_version"] != json!("vertex-2023-10-16") {
        Some("anthropic_version: must be vertex-2023-10-16")
    } else if !body["max_tokens"].is_u64() || !body["messages"].is_array() {
        Some("max_tokens and messages are required")
    } else if stream != (method == "streamRawPredict") {
        Some("stream: true goes to streamRawPredict, and only there")
    } else {
        None
    };
    if let Some(why) = problem {
        return google_error(StatusCode::BAD_REQUEST, why);
    }
    let usage = json!({"input_tokens": 3, "output_tokens": 2});
    if !stream {
        return axum::Json(
            json!({"id": "msg_vrtx", "type": "message", "role": "assistant",
            "model": VERTEX_CLAUDE_MODEL, "content": [{"type": "text", "text": "tok0 tok1"}],
            "stop_reason": "max_tokens", "stop_sequence": null, "usage": usage}),
        )
        .into_response();
    }
    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_vrtx",
            "type": "message", "role": "assistant", "model": VERTEX_CLAUDE_MODEL, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "tok0"}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": " tok1"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
            "usage": {"output_tokens": 2}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let mut text = String::new();
    for (event, data) in events {
        text.push_str(&format!("event: {event}\ndata: {data}\n\n"));
    }
    ([("content-type", "text/event-stream")], text).into_response()
}

/// The first field of a `GenerateContentRequest` that Vertex would refuse (an unknown name, a
/// wrong type or role), as its 400 says it.
fn gemini_problem(body: &Value) -> Option<String> {
    let Some(top) = body.as_object() else {
        return Some("the body is not a JSON object".into());
    };
    const TOP: &[&str] = &[
        "contents",
        "systemInstruction",
        "generationConfig",
        "safetySettings",
        "tools",
        "toolConfig",
        "cachedContent",
        "labels",
    ];
    const CONFIG: &[&str] = &[
        "maxOutputTokens",
        "temperature",
        "topP",
        "topK",
        "stopSequences",
        "seed",
        "presencePenalty",
        "frequencyPenalty",
        "responseMimeType",
        "responseJsonSchema",
        "candidateCount",
    ];
    let unknown = |name: &str| {
        Some(format!(
            "Invalid JSON payload received. Unknown name \"{name}\": Cannot find field."
        ))
    };
    if let Some(k) = top.keys().find(|k| !TOP.contains(&k.as_str())) {
        return unknown(k);
    }
    if let Some(config) = top.get("generationConfig") {
        let Some(config) = config.as_object() else {
            return Some("generationConfig must be an object".into());
        };
        if let Some(k) = config.keys().find(|k| !CONFIG.contains(&k.as_str())) {
            return unknown(&format!("generation_config.{k}"));
        }
    }
    let part_ok = |p: &Value| {
        p.as_object().is_some_and(|o| {
            o.len() == 1
                && (o.get("text").is_some_and(Value::is_string)
                    || o.get("inlineData")
                        .is_some_and(|d| d["mimeType"].is_string() && d["data"].is_string())
                    || o.get("functionCall")
                        .is_some_and(|c| c["name"].is_string() && c["args"].is_object())
                    || o.get("functionResponse")
                        .is_some_and(|r| r["name"].is_string() && r["response"].is_object()))
        })
    };
    if let Some(tools) = top.get("tools")
        && !tools
            .as_array()
            .is_some_and(|t| t.iter().all(declares_functions))
    {
        return Some("tools: each must be {functionDeclarations: [{name, …}]}".into());
    }
    if let Some(config) = top.get("toolConfig")
        && !matches!(
            config["functionCallingConfig"]["mode"].as_str(),
            Some("AUTO" | "ANY" | "NONE")
        )
    {
        return Some("toolConfig.functionCallingConfig.mode must be AUTO, ANY or NONE".into());
    }
    let Some(contents) = top
        .get("contents")
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty())
    else {
        return Some("contents is not specified".into());
    };
    for c in contents {
        if !matches!(c["role"].as_str(), Some("user" | "model")) {
            return Some("Please use a valid role: user, model.".into());
        }
        let parts = c["parts"].as_array();
        if !parts.is_some_and(|p| !p.is_empty() && p.iter().all(part_ok)) {
            return Some("contents.parts must not be empty and hold text or inlineData".into());
        }
    }
    if let Some(system) = top.get("systemInstruction")
        && !system["parts"]
            .as_array()
            .is_some_and(|p| p.iter().all(part_ok))
    {
        return Some("systemInstruction.parts must hold text".into());
    }
    None
}

/// A `Tool` of function declarations only, each with a name and only the fields Vertex knows.
fn declares_functions(tool: &Value) -> bool {
    let known = |f: &Value| {
        f["name"].is_string()
            && f.as_object().is_some_and(|o| {
                o.keys()
                    .all(|k| matches!(k.as_str(), "name" | "description" | "parametersJsonSchema"))
            })
    };
    tool.as_object().is_some_and(|o| o.len() == 1)
        && tool["functionDeclarations"]
            .as_array()
            .is_some_and(|d| d.iter().all(known))
}

/// Gemini on Vertex in its own API: the body checked as Vertex checks it (see
/// [`gemini_problem`]); `generateContent` answers JSON, `streamGenerateContent` SSE only with
/// `alt=sse` (else one JSON array); the text `tok0 tok1`, usage 3 prompt and 2 candidates
/// tokens (the stream's last event), and a thought part the client must never see.
fn gemini_on_vertex(method: &str, query: Option<&str>, body: &Value) -> Response {
    if let Some(why) = gemini_problem(body) {
        return google_error(StatusCode::BAD_REQUEST, &why);
    }
    let usage = json!({"promptTokenCount": 3, "candidatesTokenCount": 2, "totalTokenCount": 5});
    if method == "generateContent" {
        if query.is_some_and(|q| !q.is_empty()) {
            return google_error(StatusCode::BAD_REQUEST, "generateContent takes no query");
        }
        // A function the caller must call: called, with {"city": "Paris"}.
        let config = &body["toolConfig"]["functionCallingConfig"];
        if config["mode"] == "ANY" {
            let name = config["allowedFunctionNames"][0]
                .as_str()
                .or_else(|| body["tools"][0]["functionDeclarations"][0]["name"].as_str())
                .unwrap_or_default();
            return axum::Json(json!({
                "candidates": [{"content": {"role": "model", "parts": [
                    {"functionCall": {"name": name, "args": {"city": "Paris"}}}
                ]}, "finishReason": "STOP"}],
                "usageMetadata": usage, "modelVersion": VERTEX_GEMINI_MODEL
            }))
            .into_response();
        }
        return axum::Json(json!({
            "candidates": [{"content": {"role": "model", "parts": [
                {"text": "a plan", "thought": true}, {"text": "tok0 tok1"}
            ]}, "finishReason": "MAX_TOKENS"}],
            "usageMetadata": usage, "modelVersion": VERTEX_GEMINI_MODEL
        }))
        .into_response();
    }
    if query != Some("alt=sse") {
        return google_error(
            StatusCode::BAD_REQUEST,
            "this simulator streams with alt=sse only (Vertex answers one JSON array without it)",
        );
    }
    let events = [
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "tok0"}]}}],
               "usageMetadata": {"promptTokenCount": 3, "totalTokenCount": 3},
               "modelVersion": VERTEX_GEMINI_MODEL}),
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": " tok1"}]},
                               "finishReason": "MAX_TOKENS"}],
               "usageMetadata": usage, "modelVersion": VERTEX_GEMINI_MODEL}),
    ];
    let mut text = String::new();
    for data in events {
        text.push_str(&format!("data: {data}\r\n\r\n"));
    }
    ([("content-type", "text/event-stream")], text).into_response()
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

async fn model_request(
    State(sim): State<Arc<Sim>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let path = uri.path().to_string();
    let api_key = headers
        .get("api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bearer = bearer(&headers).map(str::to_string);
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let response = answer(&sim, &method, &path, query.as_deref(), &headers, &body);
    sim.recorded.lock().unwrap().requests.push(CloudRequest {
        path: uri.path_and_query().map_or(path, |p| p.to_string()),
        api_key,
        bearer,
        status: response.status().as_u16(),
        gzipped: response
            .headers()
            .get("content-encoding")
            .is_some_and(|v| v == "gzip"),
    });
    response
}

fn answer(
    sim: &Sim,
    method: &axum::http::Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: &Value,
) -> Response {
    let c = &sim.config;
    let stream = body["stream"] == json!(true);
    let include_usage = body["stream_options"]["include_usage"] == json!(true);
    if let Some(rest) = path.strip_prefix("/openai/deployments/") {
        let (deployment, op) = rest.split_once('/').unwrap_or((rest, ""));
        if deployment != c.azure_deployment
            || !matches!(op, "chat/completions" | "completions" | "embeddings")
            || method != axum::http::Method::POST
        {
            return azure_error(StatusCode::NOT_FOUND, "404", "Resource not found");
        }
        // Values here are plain tokens: no percent-decoding needed.
        let api_version = query.unwrap_or("").split('&').find_map(|p| {
            p.split_once('=')
                .filter(|(k, _)| *k == "api-version")
                .map(|(_, v)| v)
        });
        match api_version {
            None => {
                return azure_error(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "Missing required query parameter: api-version",
                );
            }
            Some(v) if !AZURE_API_VERSIONS.contains(&v) => {
                return azure_error(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "API version not supported",
                );
            }
            Some(_) => {}
        }
        let key_ok = headers
            .get("api-key")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|k| k == c.azure_api_key);
        let token_ok = bearer(headers).is_some_and(|t| sim.valid_token(t, "entra"));
        if !key_ok && !token_ok {
            return azure_error(
                StatusCode::UNAUTHORIZED,
                "401",
                "Access denied due to invalid subscription key or wrong API endpoint.",
            );
        }
        if stream && op != "embeddings" {
            return streamed(include_usage);
        }
        return completion(op);
    }
    if let Some(answered) = vertex_request(sim, method, path, query, headers, body) {
        return answered;
    }
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"error": {"code": 404, "status": "NOT_FOUND", "message": "not found"}})),
    )
        .into_response()
}

/// A Vertex AI model endpoint the simulator serves (with the method a publisher path named).
enum VertexEndpoint {
    Claude(&'static str),
    Gemini(&'static str),
    Openapi,
}

/// Vertex AI's model paths (the OpenAI-compatible endpoint, Claude's and Gemini's publisher
/// paths), each with the same Google bearer token; `None` for any other path.
fn vertex_request(
    sim: &Sim,
    method: &axum::http::Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: &Value,
) -> Option<Response> {
    let c = &sim.config;
    let stream = body["stream"] == json!(true);
    let include_usage = body["stream_options"]["include_usage"] == json!(true);
    let vertex = format!(
        "/v1/projects/{}/locations/{}/endpoints/openapi/chat/completions",
        c.vertex_project, c.vertex_location
    );
    let claude = format!(
        "/v1/projects/{}/locations/{}/publishers/anthropic/models/{VERTEX_CLAUDE_MODEL}:",
        c.vertex_project, c.vertex_location
    );
    let gemini = format!(
        "/v1/projects/{}/locations/{}/publishers/google/models/{VERTEX_GEMINI_MODEL}:",
        c.vertex_project, c.vertex_location
    );
    if method != axum::http::Method::POST {
        return None;
    }
    let model_method = |prefix: &str, methods: [&'static str; 2]| {
        path.strip_prefix(prefix)
            .and_then(|m| methods.into_iter().find(|known| *known == m))
    };
    let endpoint = if let Some(m) = model_method(&claude, ["rawPredict", "streamRawPredict"]) {
        VertexEndpoint::Claude(m)
    } else if let Some(m) = model_method(&gemini, ["generateContent", "streamGenerateContent"]) {
        VertexEndpoint::Gemini(m)
    } else if path == vertex {
        VertexEndpoint::Openapi
    } else {
        return None;
    };
    if !bearer(headers).is_some_and(|t| sim.valid_token(t, "gcp")) {
        return Some(google_error(
            StatusCode::UNAUTHORIZED,
            "Request had invalid authentication credentials.",
        ));
    }
    let answer = match endpoint {
        VertexEndpoint::Claude(m) => claude_on_vertex(m, body),
        VertexEndpoint::Gemini(m) => gemini_on_vertex(m, query, body),
        VertexEndpoint::Openapi if stream => streamed(include_usage),
        VertexEndpoint::Openapi => completion("chat/completions"),
    };
    let gzip = headers
        .get("x-sim-compress")
        .is_some_and(|v| v.as_bytes() == b"always-gzip");
    Some(if gzip {
        crate::sim::gzip_response(answer)
    } else {
        answer
    })
}
