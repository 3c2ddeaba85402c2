//! Model simulator (see docs/contracts.md "Model simulator"): OpenAI chat/completions,
//! completions, Responses (`…/responses`) and embeddings, Anthropic Messages (`…/messages`), each
//! as strict as the real API about unknown fields (400 in that API's own error shape) and with
//! its own usage and stream shapes.
//!
//! Deterministic token rule, so tests can predict usage:
//! - `prompt_tokens` = whitespace-separated words in every message `content` string (or text
//!   part, or Anthropic plain-text document), `prompt`, `input`, `instructions` and `system`,
//!   plus every key and string word of `tools` (the schemas a template renders); at least 1;
//! - `completion_tokens` = the API's own cap, read as the servers read it: chat
//!   `max_completion_tokens or max_tokens` (vLLM's and SGLang's Python `or`: 0 or null is
//!   absent), completions and Anthropic `max_tokens`, Responses `max_output_tokens`; else 16
//!   (header `x-sim-uncapped-tokens: N`: N, as vLLM generates up to the context length when the
//!   body names no cap); header `x-sim-completion-tokens: N` overrides (a backend that ignores
//!   the cap); the completion text is `tok0 tok1 …`;
//! - header `x-sim-cached-tokens: N`: chat/completions usage says `min(N, prompt_tokens)` of the
//!   prompt came from the prompt cache (`prompt_tokens_details.cached_tokens`); else none is
//!   said.
//!
//! Faults (`x-sim-fault`, or for every request without one [`SimHandle::set_fault`]):
//! `status-500` (in the API's error shape: Anthropic's `api_error` for Messages), `status-503`,
//! `status-429`, `stall` (nothing for 60 s), `not-json`, `drop-mid-stream`, `no-usage`,
//! `no-done`.
//! Provider limits: `x-sim-ratelimit-headers` (any value) adds the provider's own
//! `x-ratelimit-remaining-requests` (twice), `x-ratelimit-limit-tokens` and
//! `x-ratelimit-limit-images` to the answer; `x-sim-ratelimit-trailers` (any value) ends the
//! body with trailers instead: `x-ratelimit-remaining-requests`, `x-ratelimit-limit-images` (the
//! provider's) and `x-sim-trailer: kept` (HTTP/2, or HTTP/1.1 to a client sending `TE: trailers`).
//! Delay: `x-sim-response-delay-ms: N` holds the answer back N ms (at most 60 s).
//! A hosted provider's header count: `x-sim-provider-headers: openai` adds the 15 headers
//! (rate limits aside) OpenAI's API answers a chat completion with (the benchmark prices header
//! edits at a realistic map size with it).
//! A spoofing upstream: `x-sim-served-by: NAME` answers with its own `x-maas-served-by: NAME`
//! (the header a backends route sets to the backend that served: the route must replace it and
//! the filter must never let it reach the client).
//! Compression: header `x-sim-compress: gzip` gzips the response when the request's
//! `accept-encoding` allows it; `x-sim-compress: always-gzip` gzips it regardless (a backend that
//! ignores `accept-encoding`); streams are compressed incrementally, flushed per event.
//! Served names: with `served_only` (`--served-only`) a body's `model` must be one of the
//! simulator's models, else vLLM's 404 `NotFoundError`.
//! Every request (except `/_sim/…`) is recorded with its exact header list; tests read the
//! record at `GET /_sim/requests` (or [`SimHandle::requests`] in-process).

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::Response;
use axum::serve::ListenerExt;
use futures_util::stream;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Oldest records are dropped beyond this, so a benchmark cannot exhaust memory.
pub const MAX_RECORDED: usize = 10_000;
/// Upper bound on generated completion tokens, so a huge `max_tokens` cannot exhaust memory.
pub const MAX_COMPLETION_TOKENS: u64 = 100_000;
const DEFAULT_COMPLETION_TOKENS: u64 = 16;
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedRequest {
    pub method: String,
    /// Path and query as received.
    pub path: String,
    /// Header names and values in the order received.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl RecordedRequest {
    /// First value of a header (name compared case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Delay between stream chunks unless the request sets `x-sim-chunk-delay-ms`.
    pub chunk_delay: Duration,
    /// Model ids listed by `GET …/v1/models`.
    pub models: Vec<String>,
    /// Serve only [`SimConfig::models`], as vLLM serves only its `--served-model-name`s: a body
    /// naming another `model` is a 404 `NotFoundError` (vLLM's answer). Off: any `model` is served.
    pub served_only: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            chunk_delay: Duration::ZERO,
            models: vec!["sim-model".to_string()],
            served_only: false,
        }
    }
}

struct SimState {
    config: SimConfig,
    recorded: Mutex<VecDeque<RecordedRequest>>,
    /// The fault of requests without `x-sim-fault` ([`SimHandle::set_fault`]).
    fault: Mutex<String>,
    /// The provider key every model request must carry ([`SimHandle::require_key`]).
    required_key: Mutex<Option<(String, String)>>,
}

/// Shared view of a running simulator's record.
#[derive(Clone)]
pub struct SimHandle {
    state: Arc<SimState>,
    addr: SocketAddr,
    /// The serving thread while the simulator listens (see [`SimHandle::stop`]).
    server: Arc<Mutex<Option<Serving>>>,
}

/// A serving thread and how to end it.
struct Serving {
    shutdown: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl SimHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Requests received so far, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.state.recorded).iter().cloned().collect()
    }
    pub fn clear(&self) {
        lock(&self.state.recorded).clear();
    }
    /// The fault of every request that names none in `x-sim-fault` ("" for none): a backend
    /// that is down in its own way (`status-503`, `status-429`, `stall`, `drop-mid-stream`…).
    pub fn set_fault(&self, fault: &str) {
        *lock(&self.state.fault) = fault.to_string();
    }
    /// A provider that requires its key: every model request without header `name` equal to
    /// `value` (exactly; `authorization` as `Bearer <key>`) is answered 401 as OpenAI answers
    /// a wrong key, and still recorded.
    pub fn require_key(&self, name: &str, value: &str) {
        *lock(&self.state.required_key) = Some((name.to_string(), value.to_string()));
    }
    /// Stops listening (a model server that went down): returns once the port is closed, so
    /// a connection after this is refused. Open connections are closed after their request.
    pub fn stop(&self) {
        let serving = lock(&self.server).take();
        if let Some(serving) = serving {
            let _ = serving.shutdown.send(());
            let _ = serving.thread.join();
        }
    }
    /// Listens again on the same address after [`SimHandle::stop`] (no-op while listening).
    pub fn start(&self) -> std::io::Result<()> {
        let mut server = lock(&self.server);
        if server.is_none() {
            let listener = std::net::TcpListener::bind(self.addr)?;
            *server = Some(serve_on_thread(listener, self.state.clone())?);
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Path and query as received.
fn path_and_query(uri: &axum::http::Uri) -> String {
    uri.path_and_query()
        .map_or_else(|| uri.path().to_string(), |p| p.as_str().to_string())
}

/// OpenAI's 401 for a request without the key [`SimHandle::require_key`] asked for (exactly
/// one header of that name, with exactly that value).
fn wrong_key(state: &SimState, headers: &HeaderMap) -> Option<Response> {
    let (name, value) = lock(&state.required_key).clone()?;
    let sent = headers.get_all(name.as_str());
    let mut values = sent.iter();
    let ok = values
        .next()
        .is_some_and(|v| v.as_bytes() == value.as_bytes())
        && values.next().is_none();
    (!ok).then(|| {
        error_response(
            StatusCode::UNAUTHORIZED,
            "Incorrect API key provided",
            "invalid_request_error",
        )
    })
}

/// A backend that is down before answering: `status-503` (overloaded), `status-429` (rate
/// limited), `stall` (answers nothing for 60 s).
async fn backend_down(fault: &str) -> Option<Response> {
    match fault {
        "status-503" => Some(error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "simulated overload",
            "server_error",
        )),
        "status-429" => Some(error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "simulated rate limit",
            "rate_limit_error",
        )),
        "stall" => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Some(error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "simulated stall",
                "server_error",
            ))
        }
        _ => None,
    }
}

/// Builds the simulator's router and the handle to its record.
fn router(config: SimConfig) -> (Router, Arc<SimState>) {
    let state = Arc::new(SimState {
        config,
        recorded: Mutex::new(VecDeque::new()),
        fault: Mutex::new(String::new()),
        required_key: Mutex::new(None),
    });
    (app(state.clone()), state)
}

fn app(state: Arc<SimState>) -> Router {
    Router::new().fallback(handle).with_state(state)
}

/// Serves the simulator on an already bound listener until the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, config: SimConfig) -> std::io::Result<()> {
    serve_with_fault(listener, config, "").await
}

/// As [`serve`], every request without `x-sim-fault` getting `fault` (see
/// [`SimHandle::set_fault`]; "" for none).
pub async fn serve_with_fault(
    listener: tokio::net::TcpListener,
    config: SimConfig,
    fault: &str,
) -> std::io::Result<()> {
    let (app, state) = router(config);
    *lock(&state.fault) = fault.to_string();
    axum::serve(nodelay(listener), app).await
}

/// TCP_NODELAY on every accepted connection: without it small SSE chunks wait for Nagle and
/// the peer's delayed ACK (~40 ms per stream), and benchmarks would measure the stub.
fn nodelay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = SocketAddr> {
    listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    })
}

/// Starts the simulator on `addr` on a dedicated runtime thread that lives as long as the
/// process (or until [`SimHandle::stop`]), so it outlives the tokio runtime of any one test.
pub fn spawn(addr: SocketAddr, config: SimConfig) -> std::io::Result<SimHandle> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    let addr = std_listener.local_addr()?;
    let (_, state) = router(config);
    let serving = serve_on_thread(std_listener, state.clone())?;
    Ok(SimHandle {
        state,
        addr,
        server: Arc::new(Mutex::new(Some(serving))),
    })
}

/// Serves `state` on `std_listener` on a thread with its own runtime until shut down.
fn serve_on_thread(
    std_listener: std::net::TcpListener,
    state: Arc<SimState>,
) -> std::io::Result<Serving> {
    std_listener.set_nonblocking(true)?;
    let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("model-sim".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("model-sim-worker")
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("model-sim: cannot start runtime: {e}");
                    return;
                }
            };
            runtime.block_on(async move {
                match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(listener) => {
                        let served = axum::serve(nodelay(listener), app(state))
                            .with_graceful_shutdown(async {
                                let _ = stopped.await;
                            })
                            .await;
                        if let Err(e) = served {
                            eprintln!("model-sim: server error: {e}");
                        }
                    }
                    Err(e) => eprintln!("model-sim: cannot listen: {e}"),
                }
            });
            // Connections still open (a stream in flight) end with the runtime.
            runtime.shutdown_background();
        })?;
    Ok(Serving { shutdown, thread })
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn error_response(status: StatusCode, message: &str, kind: &str) -> Response {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": null}}),
    )
}

/// Top-level fields of `POST /v1/chat/completions` (OpenAI API reference).
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "model",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
];

/// Top-level fields of `POST /v1/completions` (legacy completions).
const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
];

/// Top-level fields of `POST /v1/responses` (Responses API). Its `stream_options` has only
/// `include_obfuscation`: `include_usage` is refused (usage always comes in `response.completed`).
const RESPONSES_FIELDS: &[&str] = &[
    "background",
    "conversation",
    "include",
    "input",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "model",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt",
    "prompt_cache_key",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
];

/// Top-level fields of Anthropic `POST /v1/messages`.
const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "container",
    "context_management",
    "mcp_servers",
    "metadata",
    "service_tier",
    "stop_sequences",
    "stream",
    "system",
    "temperature",
    "thinking",
    "tool_choice",
    "tools",
    "top_k",
    "top_p",
];

/// Top-level fields of Anthropic `POST /v1/messages/count_tokens` (no `max_tokens`, no
/// `stream`: it generates nothing).
const COUNT_TOKENS_FIELDS: &[&str] = &[
    "model",
    "messages",
    "context_management",
    "mcp_servers",
    "system",
    "thinking",
    "tool_choice",
    "tools",
];

/// Anthropic `POST /v1/messages/count_tokens`, as strictly as the real API: a JSON object with
/// `model` and `messages` and no other field than the API's; the answer is
/// `{"input_tokens": n}` (the prompt's words, as the other operations count them).
fn count_tokens(config: &SimConfig, method: &Method, bytes: &[u8]) -> Response {
    if method != Method::POST {
        return anthropic_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "use POST",
        );
    }
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(bytes) else {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "body must be a JSON object",
        );
    };
    let message = match request
        .keys()
        .find(|k| !COUNT_TOKENS_FIELDS.contains(&k.as_str()))
    {
        Some(k) => Some(format!("{k}: Extra inputs are not permitted")),
        None => ["model", "messages"]
            .iter()
            .find(|r| !request.contains_key(**r))
            .map(|r| format!("{r}: Field required")),
    };
    if let Some(message) = message {
        return anthropic_error(StatusCode::BAD_REQUEST, "invalid_request_error", &message);
    }
    let request = Value::Object(request);
    if let Some(unserved) = unserved_model(config, &request) {
        return unserved;
    }
    json_response(
        StatusCode::OK,
        &json!({"input_tokens": prompt_tokens(&request)}),
    )
}

/// Top-level fields of `POST /v1/embeddings`.
const EMBEDDINGS_FIELDS: &[&str] = &["input", "model", "dimensions", "encoding_format", "user"];

/// Anthropic's error body (`{"type":"error","error":{…}}`).
fn anthropic_error(status: StatusCode, kind: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_sim"}),
    )
}

/// The refusal the real API gives this request, if any: unknown top-level fields (each API with
/// its own words), `stream_options.include_usage` on the Responses API, missing required
/// Anthropic fields.
fn refusal(kind: Kind, request: &serde_json::Map<String, Value>) -> Option<Response> {
    let allowed = match kind {
        Kind::Chat => CHAT_FIELDS,
        Kind::Completion => COMPLETION_FIELDS,
        Kind::Responses => RESPONSES_FIELDS,
        Kind::Messages => MESSAGES_FIELDS,
        Kind::Embeddings => EMBEDDINGS_FIELDS,
    };
    let unknown = request.keys().find(|k| !allowed.contains(&k.as_str()));
    match kind {
        Kind::Chat | Kind::Completion | Kind::Embeddings => unknown.map(|k| {
            error_response(
                StatusCode::BAD_REQUEST,
                &format!("Unrecognized request argument supplied: {k}"),
                "invalid_request_error",
            )
        }),
        Kind::Responses => {
            let nested = request
                .get("stream_options")
                .and_then(Value::as_object)
                .and_then(|o| o.keys().find(|k| k.as_str() != "include_obfuscation"))
                .map(|k| format!("stream_options.{k}"));
            unknown.cloned().or(nested).map(|param| {
                json_response(
                    StatusCode::BAD_REQUEST,
                    &json!({"error": {
                        "message": format!("Unknown parameter: '{param}'."),
                        "type": "invalid_request_error",
                        "param": param,
                        "code": "unknown_parameter",
                    }}),
                )
            })
        }
        Kind::Messages => {
            let message = match unknown {
                Some(k) => format!("{k}: Extra inputs are not permitted"),
                None => match ["model", "messages", "max_tokens"]
                    .iter()
                    .find(|r| !request.contains_key(**r))
                {
                    Some(r) => format!("{r}: Field required"),
                    None => messages_shape(request)?,
                },
            };
            Some(anthropic_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &message,
            ))
        }
    }
}

/// Content block types of Anthropic messages and what each requires (its other fields are
/// checked by the real API too; the simulator checks the ones a translating gateway writes).
const BLOCK_TYPES: &[(&str, &[&str])] = &[
    ("text", &["text"]),
    ("image", &["source"]),
    ("document", &["source"]),
    ("tool_use", &["id", "name", "input"]),
    ("tool_result", &["tool_use_id"]),
    ("thinking", &["thinking"]),
    ("redacted_thinking", &["data"]),
];

/// Anthropic's refusal of a Messages body whose `messages`, `system`, `stop_sequences` or
/// `metadata` are not of the API's shape (its words: `messages.0.role: Input should be 'user' or
/// 'assistant'`): a role `system` in `messages`, an unknown content block, a block without what
/// it requires, an image source that is not base64 or a URL.
fn messages_shape(request: &serde_json::Map<String, Value>) -> Option<String> {
    let blocks = |at: &str, content: &Value, only_text: bool| -> Option<String> {
        let blocks = match content {
            Value::String(_) => return None,
            Value::Array(b) => b,
            _ => return Some(format!("{at}: Input should be a valid string or list")),
        };
        for (j, b) in blocks.iter().enumerate() {
            let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
            let Some((_, required)) = BLOCK_TYPES
                .iter()
                .find(|(t, _)| *t == kind && (!only_text || *t == "text"))
            else {
                return Some(format!(
                    "{at}.{j}: Input tag '{kind}' found using 'type' does not match any of the expected tags"
                ));
            };
            if let Some(r) = required.iter().find(|r| b.get(**r).is_none()) {
                return Some(format!("{at}.{j}.{kind}.{r}: Field required"));
            }
            if kind == "image" {
                let source = b
                    .get("source")
                    .and_then(|s| s.get("type"))
                    .and_then(Value::as_str);
                if !matches!(source, Some("base64" | "url")) {
                    return Some(format!("{at}.{j}.image.source: Input tag does not match"));
                }
            }
        }
        None
    };
    let Some(messages) = request.get("messages").and_then(Value::as_array) else {
        return Some("messages: Input should be a valid list".into());
    };
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if !matches!(role, "user" | "assistant") {
            return Some(format!(
                "messages.{i}.role: Input should be 'user' or 'assistant'"
            ));
        }
        if let Some(k) = m
            .as_object()
            .and_then(|o| o.keys().find(|k| !matches!(k.as_str(), "role" | "content")))
        {
            return Some(format!("messages.{i}.{k}: Extra inputs are not permitted"));
        }
        let content = m.get("content").unwrap_or(&Value::Null);
        if let Some(e) = blocks(&format!("messages.{i}.content"), content, false) {
            return Some(e);
        }
    }
    if let Some(system) = request.get("system")
        && let Some(e) = blocks("system", system, true)
    {
        return Some(e);
    }
    if let Some(stops) = request.get("stop_sequences")
        && !stops
            .as_array()
            .is_some_and(|a| a.iter().all(Value::is_string))
    {
        return Some("stop_sequences: Input should be a valid list".into());
    }
    if let Some(metadata) = request.get("metadata")
        && !metadata
            .as_object()
            .is_some_and(|o| o.keys().all(|k| k == "user_id"))
    {
        return Some("metadata: Extra inputs are not permitted".into());
    }
    None
}

/// Whether an `accept-encoding` value allows gzip (`gzip`, `x-gzip` or `*`, with q > 0).
pub fn accepts_gzip(accept_encoding: &str) -> bool {
    accept_encoding.split(',').any(|part| {
        let mut it = part.split(';');
        let coding = it.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = it
            .find_map(|p| p.trim().strip_prefix("q=").map(str::to_string))
            .map(|q| q.trim().parse::<f32>().unwrap_or(0.0))
            .unwrap_or(1.0);
        matches!(coding.as_str(), "gzip" | "x-gzip" | "*") && q > 0.0
    })
}

/// Gzips the response body as it goes, flushing after every frame (every SSE event), so a
/// compressed stream still streams. A body error (a dropped stream) ends it without a trailer.
/// A body followed by trailers.
struct WithTrailers {
    body: Body,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for WithTrailers {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        use std::task::Poll;
        match std::pin::Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Ready(None) => Poll::Ready(
                self.trailers
                    .take()
                    .map(|t| Ok(http_body::Frame::trailers(t))),
            ),
            other => other,
        }
    }
}

/// `resp` gzipped frame by frame (each frame flushed: a stream stays a stream).
pub fn gzip_response(resp: Response) -> Response {
    use flate2::{Compression, write::GzEncoder};
    use futures_util::StreamExt;
    use std::io::Write;
    let (mut parts, body) = resp.into_parts();
    parts.headers.insert(
        header::CONTENT_ENCODING,
        header::HeaderValue::from_static("gzip"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    let encoder = GzEncoder::new(Vec::new(), Compression::default());
    let frames = body.into_data_stream();
    let gz = stream::unfold(Some((frames, encoder)), |state| async move {
        let (mut frames, mut encoder) = state?;
        match frames.next().await {
            Some(Ok(bytes)) => {
                let written = encoder.write_all(&bytes).and_then(|()| encoder.flush());
                match written {
                    Ok(()) => {
                        let out = Bytes::from(std::mem::take(encoder.get_mut()));
                        Some((Ok(out), Some((frames, encoder))))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
            Some(Err(e)) => Some((Err(std::io::Error::other(e)), None)),
            None => Some((encoder.finish().map(Bytes::from), None)),
        }
    });
    Response::from_parts(parts, Body::from_stream(gz))
}

/// What OpenAI's API answers a chat completion with besides `content-type`, `content-length`,
/// `date` and its own rate limits (as seen from its Python SDK, values of the same length).
const OPENAI_RESPONSE_HEADERS: [(&str, &str); 15] = [
    ("access-control-expose-headers", "X-Request-ID"),
    ("openai-organization", "user-abcdefghijklmnopqrstuvwx"),
    ("openai-processing-ms", "412"),
    ("openai-project", "proj_abcdefghijklmnopqrstuvwx"),
    ("openai-version", "2020-10-01"),
    ("x-request-id", "req_0123456789abcdef0123456789abcdef"),
    (
        "strict-transport-security",
        "max-age=31536000; includeSubDomains; preload",
    ),
    ("cf-cache-status", "DYNAMIC"),
    (
        "set-cookie",
        "__cf_bm=0123456789abcdef0123456789abcdef0123456789abcdef-1733300000-1.0.1.1-abcdefghijklmnopqrstuvwxyz0123456789; path=/; expires=Wed, 04-Dec-24 08:51:34 GMT; domain=.api.openai.com; HttpOnly; Secure; SameSite=None",
    ),
    (
        "set-cookie",
        "_cfuvid=abcdefghijklmnopqrstuvwxyz0123456789abcdefg-1733300000000-0.0.1.1-604800000; path=/; domain=.api.openai.com; HttpOnly; Secure; SameSite=None",
    ),
    ("x-content-type-options", "nosniff"),
    ("server", "cloudflare"),
    ("cf-ray", "8ecb0123456789ab-IAD"),
    ("alt-svc", "h3=\":443\"; ma=86400"),
    ("x-envoy-decorator-operation", "chat.completions"),
];

async fn handle(State(state): State<Arc<SimState>>, req: Request) -> Response {
    let compress = header_str(req.headers(), "x-sim-compress").unwrap_or("");
    let gzip = compress == "always-gzip"
        || (compress == "gzip"
            && req
                .headers()
                .get_all(header::ACCEPT_ENCODING)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(accepts_gzip));
    let control = req.uri().path().starts_with("/_sim/");
    let provider_limits = req.headers().contains_key("x-sim-ratelimit-headers");
    let provider_trailers = req.headers().contains_key("x-sim-ratelimit-trailers");
    let provider_headers = header_str(req.headers(), "x-sim-provider-headers") == Some("openai");
    let served_by = req.headers().get("x-sim-served-by").cloned();
    let mut resp = handle_model(&state, req).await;
    if let Some(v) = served_by {
        resp.headers_mut().append(maas_types::SERVED_BY_HEADER, v);
    }
    if provider_headers {
        let h = resp.headers_mut();
        for (name, value) in OPENAI_RESPONSE_HEADERS {
            h.append(name, header::HeaderValue::from_static(value));
        }
    }
    if provider_trailers {
        let mut trailers = HeaderMap::new();
        for (name, value) in [
            ("x-ratelimit-remaining-requests", "provider-own"),
            ("x-ratelimit-limit-images", "provider-own"),
            ("x-sim-trailer", "kept"),
        ] {
            trailers.append(name, header::HeaderValue::from_static(value));
        }
        let (mut parts, body) = resp.into_parts();
        // Trailers need a body of unknown length (chunked, or DATA frames without END_STREAM).
        parts.headers.remove(header::CONTENT_LENGTH);
        resp = Response::from_parts(
            parts,
            Body::new(WithTrailers {
                body,
                trailers: Some(trailers),
            }),
        );
    }
    if provider_limits {
        // As a provider answers: its own limits for the account the gateway calls it with.
        let h = resp.headers_mut();
        for (name, value) in [
            ("x-ratelimit-remaining-requests", "provider-own"),
            ("x-ratelimit-remaining-requests", "provider-again"),
            ("x-ratelimit-limit-tokens", "provider-own"),
            ("x-ratelimit-limit-images", "provider-own"),
            // A warning the gateway did not give must not reach the client either.
            ("x-maas-quota-warning", "provider-own"),
            // The IETF pair, as a provider following the draft sends it.
            ("ratelimit", "\"provider\";r=1;t=1"),
            ("ratelimit-policy", "\"provider\";q=1;w=1"),
        ] {
            h.append(name, header::HeaderValue::from_static(value));
        }
    }
    if gzip && !control {
        gzip_response(resp)
    } else {
        resp
    }
}

/// Keeps the request for `/_sim/requests` (the oldest goes past [`MAX_RECORDED`]).
fn record(state: &SimState, parts: &http::request::Parts, path: String, bytes: &[u8]) {
    let mut rec = lock(&state.recorded);
    if rec.len() >= MAX_RECORDED {
        rec.pop_front();
    }
    rec.push_back(RecordedRequest {
        method: parts.method.to_string(),
        path,
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: String::from_utf8_lossy(bytes).into_owned(),
    });
}

/// The operation a model path ends with (`None`: not one the simulator answers as a model).
fn model_kind(path: &str) -> Option<Kind> {
    if path.ends_with("/chat/completions") {
        Some(Kind::Chat)
    } else if path.ends_with("/completions") {
        Some(Kind::Completion)
    } else if path.ends_with("/responses") {
        Some(Kind::Responses)
    } else if path.ends_with("/messages") {
        Some(Kind::Messages)
    } else if path.ends_with("/embeddings") {
        Some(Kind::Embeddings)
    } else {
        None
    }
}

/// `GET …/models`: the simulator's models.
fn list_models(state: &SimState, method: &Method, fault: &str) -> Response {
    if method != Method::GET {
        return error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET",
            "invalid_request_error",
        );
    }
    if fault == "not-json" {
        return not_json();
    }
    let data: Vec<Value> = state
        .config
        .models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "model-sim"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn handle_model(state: &SimState, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = path_and_query(&parts.uri);
    let bytes = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(_) => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body too large",
                "invalid_request_error",
            );
        }
    };
    let only_path = parts.uri.path();
    if let Some(rest) = only_path.strip_prefix("/_sim/") {
        return sim_control(state, &parts.method, rest);
    }
    record(state, &parts, path, &bytes);
    if let Some(refused) = wrong_key(state, &parts.headers) {
        return refused;
    }
    // `x-sim-response-delay-ms: N` (≤ 60 s): the answer starts N ms late (a slow backend; a client
    // that gives up first abandons work the backend has started).
    if let Some(ms) =
        header_str(&parts.headers, "x-sim-response-delay-ms").and_then(|v| v.parse::<u64>().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms.min(60_000))).await;
    }
    let default_fault = lock(&state.fault).clone();
    let fault = header_str(&parts.headers, "x-sim-fault").unwrap_or(&default_fault);
    if let Some(refused) = backend_down(fault).await {
        return refused;
    }
    if fault == "status-500" && only_path.ends_with("/messages") {
        // Anthropic's own 500.
        return anthropic_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "simulated failure",
        );
    }
    if fault == "status-500" {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated failure",
            "server_error",
        );
    }
    if only_path.ends_with("/messages/count_tokens") {
        return count_tokens(&state.config, &parts.method, &bytes);
    }
    let kind = match model_kind(only_path) {
        Some(kind) => kind,
        None if only_path.ends_with("/models") => return list_models(state, &parts.method, fault),
        None => {
            return error_response(
                StatusCode::NOT_FOUND,
                "unknown path",
                "invalid_request_error",
            );
        }
    };
    if parts.method != Method::POST {
        return error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "use POST",
            "invalid_request_error",
        );
    }
    let request: Value = match serde_json::from_slice(&bytes) {
        Ok(v @ Value::Object(_)) => v,
        _ if kind == Kind::Messages => {
            return anthropic_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "body must be a JSON object",
            );
        }
        _ => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "body must be a JSON object",
                "invalid_request_error",
            );
        }
    };
    if let Some(refused) = request.as_object().and_then(|obj| refusal(kind, obj)) {
        return refused;
    }
    if let Some(unserved) = unserved_model(&state.config, &request) {
        return unserved;
    }
    if fault == "not-json" {
        return not_json();
    }
    let plan = Plan::new(kind, &request, &parts.headers, &state.config, fault);
    if kind != Kind::Embeddings && request.get("stream").and_then(Value::as_bool) == Some(true) {
        plan.stream()
    } else {
        json_response(StatusCode::OK, &plan.full_response(&request))
    }
}

/// With [`SimConfig::served_only`], a body naming a model the simulator does not serve: vLLM's
/// 404 (`The model `x` does not exist.`).
fn unserved_model(config: &SimConfig, request: &Value) -> Option<Response> {
    let model = request.get("model").and_then(Value::as_str).unwrap_or("");
    if !config.served_only || config.models.iter().any(|m| m == model) {
        return None;
    }
    Some(json_response(
        StatusCode::NOT_FOUND,
        &json!({"error": {"message": format!("The model `{model}` does not exist."),
                          "type": "NotFoundError", "param": "model", "code": 404}}),
    ))
}

fn not_json() -> Response {
    let mut resp = Response::new(Body::from("this is not json {"));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn sim_control(state: &SimState, method: &Method, rest: &str) -> Response {
    match (method, rest) {
        (&Method::GET, "requests") => {
            let rec: Vec<RecordedRequest> = lock(&state.recorded).iter().cloned().collect();
            json_response(StatusCode::OK, &json!(rec))
        }
        (&Method::DELETE, "requests") => {
            lock(&state.recorded).clear();
            Response::builder()
                .status(StatusCode::NO_CONTENT)
                .body(Body::empty())
                .unwrap_or_default()
        }
        _ => error_response(
            StatusCode::NOT_FOUND,
            "unknown simulator endpoint",
            "invalid_request_error",
        ),
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Which API a request speaks (from the path's last segments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// OpenAI `…/chat/completions`.
    Chat,
    /// OpenAI `…/completions`.
    Completion,
    /// OpenAI `…/responses`.
    Responses,
    /// Anthropic `…/messages`.
    Messages,
    /// OpenAI `…/embeddings`.
    Embeddings,
}

/// Counts whitespace-separated words in every string that counts as prompt text: message
/// `content` (strings, text parts, Anthropic plain-text documents), `prompt`, Responses `input`
/// (a string, or items with `content`) and `instructions`, Anthropic `system`, embeddings
/// `input` (strings, or token arrays: one token per number); and the tool definitions as a chat
/// template renders them: every key and every word of every string in `tools`.
pub fn prompt_tokens(request: &Value) -> u64 {
    fn words(s: &str) -> u64 {
        s.split_whitespace().count() as u64
    }
    fn content_words(content: &Value) -> u64 {
        match content {
            Value::String(s) => words(s),
            // Content parts: [{"type":"text","text":"…"}, …]; Responses items: {"content": …};
            // Anthropic documents: {"type":"document","source":{"type":"text","data":"…"}}.
            Value::Array(parts) => parts
                .iter()
                .map(|p| match p {
                    Value::String(s) => words(s),
                    Value::Number(_) => 1,
                    Value::Array(_) => content_words(p),
                    Value::Object(o) => match (o.get("text"), o.get("content"), o.get("source")) {
                        (Some(Value::String(t)), _, _) => words(t),
                        (_, Some(c), _) => content_words(c),
                        (_, _, Some(source))
                            if source.get("type").and_then(Value::as_str) == Some("text") =>
                        {
                            source.get("data").and_then(Value::as_str).map_or(0, words)
                        }
                        _ => 0,
                    },
                    _ => 0,
                })
                .sum(),
            _ => 0,
        }
    }
    /// Every key and every word of every string (a tool's name, description and schema).
    fn schema_words(v: &Value) -> u64 {
        match v {
            Value::String(s) => words(s),
            Value::Array(items) => items.iter().map(schema_words).sum(),
            Value::Object(o) => o
                .iter()
                .map(|(k, v)| words(k).max(1) + schema_words(v))
                .sum(),
            _ => 0,
        }
    }
    let mut n = 0;
    if let Some(messages) = request.get("messages").and_then(Value::as_array) {
        n += messages
            .iter()
            .filter_map(|m| m.get("content"))
            .map(content_words)
            .sum::<u64>();
    }
    for field in ["prompt", "input", "instructions", "system"] {
        if let Some(v) = request.get(field) {
            n += content_words(v);
        }
    }
    if let Some(tools) = request.get("tools") {
        n += schema_words(tools);
    }
    n.max(1)
}

/// The cap fields an API reads, in the order it reads them: the first that is truthy in Python's
/// sense (present, not null, not 0) is the cap. Chat is vLLM's and SGLang's
/// `max_completion_tokens or max_tokens` (vLLM `vllm/entrypoints/utils.py` `get_max_tokens`,
/// SGLang `python/sglang/srt/entrypoints/openai/protocol.py`
/// `ChatCompletionRequest.to_sampling_params`): `{"max_completion_tokens": 0, "max_tokens":
/// 50000}` generates 50,000.
fn cap_fields(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Chat => &["max_completion_tokens", "max_tokens"],
        Kind::Completion | Kind::Messages => &["max_tokens"],
        Kind::Responses => &["max_output_tokens"],
        Kind::Embeddings => &[],
    }
}

/// Completion tokens from the request (headers override the body).
fn completion_tokens(kind: Kind, request: &Value, headers: &HeaderMap) -> u64 {
    let from_header =
        header_str(headers, "x-sim-completion-tokens").and_then(|v| v.parse::<u64>().ok());
    let from_body = cap_fields(kind)
        .iter()
        .find_map(|k| request.get(*k).and_then(Value::as_u64).filter(|n| *n != 0));
    let uncapped = header_str(headers, "x-sim-uncapped-tokens").and_then(|v| v.parse::<u64>().ok());
    from_header
        .or(from_body)
        .or(uncapped)
        .unwrap_or(DEFAULT_COMPLETION_TOKENS)
        .min(MAX_COMPLETION_TOKENS)
}

struct Plan {
    kind: Kind,
    model: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// `x-sim-cached-tokens` (at most the prompt): reported by chat/completions usage.
    cached_tokens: u64,
    include_usage_chunk: bool,
    chunk_delay: Duration,
    fault: String,
    created: u64,
    /// Responses: `instructions` and `max_output_tokens` as sent (echoed in the response).
    instructions: Value,
    max_output_tokens: Value,
}

impl Plan {
    fn new(
        kind: Kind,
        request: &Value,
        headers: &HeaderMap,
        config: &SimConfig,
        fault: &str,
    ) -> Plan {
        let chunk_delay = header_str(headers, "x-sim-chunk-delay-ms")
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(config.chunk_delay);
        Plan {
            kind,
            model: request
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| config.models.first().cloned())
                .unwrap_or_default(),
            prompt_tokens: prompt_tokens(request),
            completion_tokens: if kind == Kind::Embeddings {
                0
            } else {
                completion_tokens(kind, request, headers)
            },
            cached_tokens: header_str(headers, "x-sim-cached-tokens")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                .min(prompt_tokens(request)),
            include_usage_chunk: request
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            chunk_delay,
            fault: fault.to_string(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            instructions: request.get("instructions").cloned().unwrap_or(Value::Null),
            max_output_tokens: request
                .get("max_output_tokens")
                .cloned()
                .unwrap_or(Value::Null),
        }
    }

    fn no_usage(&self) -> bool {
        self.fault == "no-usage"
    }

    /// OpenAI chat/completions usage.
    fn usage(&self) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        });
        if self.cached_tokens > 0 {
            usage["prompt_tokens_details"] = json!({"cached_tokens": self.cached_tokens});
        }
        usage
    }

    /// Responses API usage.
    fn responses_usage(&self) -> Value {
        if self.no_usage() {
            return Value::Null;
        }
        json!({
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    /// Anthropic usage with `output_tokens` as given.
    fn anthropic_usage(&self, output_tokens: u64) -> Value {
        json!({
            "input_tokens": self.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": output_tokens,
            "service_tier": "standard",
        })
    }

    fn id(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chatcmpl-sim",
            Kind::Completion => "cmpl-sim",
            Kind::Responses => "resp_sim",
            Kind::Messages => "msg_sim",
            Kind::Embeddings => "emb-sim",
        }
    }

    /// The Responses API `response` object in state `status` with `output` items.
    fn response_object(&self, status: &str, output: Value, usage: Value) -> Value {
        json!({
            "id": self.id(), "object": "response", "created_at": self.created, "status": status,
            "error": null, "incomplete_details": null, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": true, "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null}, "store": true, "temperature": 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": 1.0, "truncation": "disabled", "usage": usage, "user": null, "metadata": {},
        })
    }

    fn output_message(&self, status: &str, text: Option<&str>) -> Value {
        let content = match text {
            Some(t) => json!([{"type": "output_text", "text": t, "annotations": []}]),
            None => json!([]),
        };
        json!({"id": "msg_sim_out", "type": "message", "status": status, "role": "assistant", "content": content})
    }

    fn full_response(&self, request: &Value) -> Value {
        let text = completion_text(self.completion_tokens);
        let mut v = match self.kind {
            Kind::Chat => json!({
                "id": self.id(), "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            }),
            Kind::Completion => json!({
                "id": self.id(), "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
            }),
            Kind::Responses => {
                return self.response_object(
                    "completed",
                    json!([self.output_message("completed", Some(&text))]),
                    self.responses_usage(),
                );
            }
            Kind::Messages => {
                let mut v = json!({
                    "id": self.id(), "type": "message", "role": "assistant", "model": self.model,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn", "stop_sequence": null,
                });
                if !self.no_usage() {
                    v["usage"] = self.anthropic_usage(self.completion_tokens);
                }
                return v;
            }
            Kind::Embeddings => {
                let inputs = match request.get("input") {
                    Some(Value::Array(a)) if !a.iter().all(Value::is_number) => a.len(),
                    _ => 1,
                };
                let dims = request
                    .get("dimensions")
                    .and_then(Value::as_u64)
                    .unwrap_or(8)
                    .min(4096) as usize;
                let data: Vec<Value> = (0..inputs)
                    .map(|i| {
                        let e: Vec<f64> = (0..dims)
                            .map(|d| ((i + d) % 7) as f64 / 7.0 - 0.5)
                            .collect();
                        json!({"object": "embedding", "index": i, "embedding": e})
                    })
                    .collect();
                let mut v = json!({"object": "list", "data": data, "model": self.model});
                if !self.no_usage() {
                    v["usage"] = json!({"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens});
                }
                return v;
            }
        };
        if !self.no_usage() {
            v["usage"] = self.usage();
        }
        v
    }

    fn chunk(&self, piece: Option<String>, finish: bool, first: bool) -> Value {
        let finish_reason = if finish { json!("stop") } else { Value::Null };
        match self.kind {
            Kind::Completion => json!({
                "id": self.id(), "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": piece.unwrap_or_default(), "finish_reason": finish_reason, "logprobs": null}],
            }),
            _ => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(p) = piece {
                    delta.insert("content".into(), json!(p));
                }
                json!({
                    "id": self.id(), "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                })
            }
        }
    }

    /// The completion's words as stream pieces: `tok0`, ` tok1`, ….
    fn pieces(&self) -> impl Iterator<Item = String> {
        (0..self.completion_tokens).map(|i| {
            if i == 0 {
                "tok0".to_string()
            } else {
                format!(" tok{i}")
            }
        })
    }

    /// OpenAI chat/completions events (`data: …\n\n`).
    fn openai_events(&self) -> Vec<Bytes> {
        let mut events = Vec::with_capacity(self.completion_tokens as usize + 3);
        for (i, piece) in self.pieces().enumerate() {
            events.push(sse(&self.chunk(Some(piece), false, i == 0)));
        }
        events.push(sse(&self.chunk(None, true, self.completion_tokens == 0)));
        if self.include_usage_chunk && !self.no_usage() {
            let object = match self.kind {
                Kind::Completion => "text_completion",
                _ => "chat.completion.chunk",
            };
            events.push(sse(&json!({
                "id": self.id(), "object": object, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage(),
            })));
        }
        if self.fault != "no-done" {
            events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        }
        events
    }

    /// Responses API events (`event: <type>\ndata: {"type":<type>,"sequence_number":…}`), as
    /// OpenAI sends them; usage only in `response.completed`.
    fn responses_events(&self) -> Vec<Bytes> {
        let mut events = Vec::with_capacity(self.completion_tokens as usize + 9);
        let mut seq = 0u64;
        let mut push = |v: Value| {
            let mut v = v;
            v["sequence_number"] = json!(seq);
            seq += 1;
            events.push(named_sse(&v));
        };
        let in_progress = self.response_object("in_progress", json!([]), Value::Null);
        push(json!({"type": "response.created", "response": in_progress}));
        push(json!({"type": "response.in_progress", "response": in_progress}));
        push(
            json!({"type": "response.output_item.added", "output_index": 0,
                    "item": self.output_message("in_progress", None)}),
        );
        let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
        push(
            json!({"type": "response.content_part.added", "item_id": "msg_sim_out",
                    "output_index": 0, "content_index": 0, "part": part("")}),
        );
        for piece in self.pieces() {
            push(
                json!({"type": "response.output_text.delta", "item_id": "msg_sim_out",
                        "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []}),
            );
        }
        let text = completion_text(self.completion_tokens);
        push(
            json!({"type": "response.output_text.done", "item_id": "msg_sim_out",
                    "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
        );
        push(
            json!({"type": "response.content_part.done", "item_id": "msg_sim_out",
                    "output_index": 0, "content_index": 0, "part": part(&text)}),
        );
        let done = self.output_message("completed", Some(&text));
        push(json!({"type": "response.output_item.done", "output_index": 0, "item": done}));
        let completed = self.response_object("completed", json!([done]), self.responses_usage());
        push(json!({"type": "response.completed", "response": completed}));
        events
    }

    /// Anthropic Messages events: `message_start` (input tokens, output 1), a text block with
    /// one delta per token, `message_delta` (cumulative output tokens), `message_stop`.
    fn anthropic_events(&self) -> Vec<Bytes> {
        let mut events = Vec::with_capacity(self.completion_tokens as usize + 7);
        let mut message = json!({
            "id": self.id(), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
        });
        if !self.no_usage() {
            message["usage"] = self.anthropic_usage(1);
        }
        events.push(named_sse(
            &json!({"type": "message_start", "message": message}),
        ));
        events.push(named_sse(
            &json!({"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}),
        ));
        events.push(named_sse(&json!({"type": "ping"})));
        for piece in self.pieces() {
            events.push(named_sse(
                &json!({"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": piece}}),
            ));
        }
        events.push(named_sse(
            &json!({"type": "content_block_stop", "index": 0}),
        ));
        let mut delta = json!({"type": "message_delta",
                               "delta": {"stop_reason": "end_turn", "stop_sequence": null}});
        if !self.no_usage() {
            delta["usage"] = json!({"output_tokens": self.completion_tokens});
        }
        events.push(named_sse(&delta));
        if self.fault != "no-done" {
            events.push(named_sse(&json!({"type": "message_stop"})));
        }
        events
    }

    /// All SSE events of the stream, in order, plus where to drop it for the `drop-mid-stream`
    /// fault.
    fn events(&self) -> (Vec<Bytes>, Option<usize>) {
        let events = match self.kind {
            Kind::Responses => self.responses_events(),
            Kind::Messages => self.anthropic_events(),
            _ => self.openai_events(),
        };
        let drop_at = (self.fault == "drop-mid-stream").then(|| (events.len() / 2).max(1));
        (events, drop_at)
    }

    fn stream(self) -> Response {
        let (events, drop_at) = self.events();
        let delay = self.chunk_delay;
        // State: (events, next index, drop point). Delay applies between chunks, not before the first.
        let body_stream = stream::unfold(
            (events, 0usize, drop_at),
            move |(events, i, drop_at)| async move {
                if drop_at == Some(i) {
                    // Let the chunks already produced reach the client before the cut.
                    tokio::time::sleep(delay.max(Duration::from_millis(20))).await;
                    let err = std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "simulated drop",
                    );
                    return Some((Err(err), (events, usize::MAX, None)));
                }
                if i >= events.len() {
                    return None;
                }
                if i > 0 && !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let item = events[i].clone();
                Some((Ok::<Bytes, std::io::Error>(item), (events, i + 1, drop_at)))
            },
        );
        let mut resp = Response::new(Body::from_stream(body_stream));
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
        resp
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// An event named after its data's `type` (Anthropic and Responses streams).
fn named_sse(v: &Value) -> Bytes {
    let name = v.get("type").and_then(Value::as_str).unwrap_or("message");
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

/// `tok0 tok1 … tok{n-1}`.
pub fn completion_text(n: u64) -> String {
    let mut s = String::with_capacity(n as usize * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str("tok");
        s.push_str(&i.to_string());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_tokens_count_words_of_all_messages() {
        let req = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello  there world"}]},
        ]});
        assert_eq!(prompt_tokens(&req), 5);
        assert_eq!(prompt_tokens(&json!({"prompt": "one two"})), 2);
        assert_eq!(prompt_tokens(&json!({"messages": []})), 1);
    }

    #[test]
    fn completion_tokens_from_body_or_header() {
        let empty = HeaderMap::new();
        let chat = |body: Value| completion_tokens(Kind::Chat, &body, &empty);
        assert_eq!(chat(json!({})), 16);
        assert_eq!(chat(json!({"max_tokens": 3})), 3);
        assert_eq!(
            chat(json!({"max_completion_tokens": 4, "max_tokens": 3})),
            4
        );
        // vLLM / SGLang: `max_completion_tokens or max_tokens`, 0 and null falsy.
        assert_eq!(
            chat(json!({"max_completion_tokens": 0, "max_tokens": 50})),
            50
        );
        assert_eq!(
            chat(json!({"max_completion_tokens": null, "max_tokens": 50})),
            50
        );
        assert_eq!(chat(json!({"max_completion_tokens": 0})), 16);
        assert_eq!(chat(json!({"max_tokens": 0})), 16);
        let mut h = HeaderMap::new();
        h.insert("x-sim-completion-tokens", "7".parse().unwrap());
        assert_eq!(
            completion_tokens(Kind::Chat, &json!({"max_tokens": 3}), &h),
            7
        );
        assert_eq!(chat(json!({"max_tokens": u64::MAX})), MAX_COMPLETION_TOKENS);
        // Each API reads its own field only.
        let body = json!({"max_tokens": 5, "max_output_tokens": 9, "max_completion_tokens": 7});
        assert_eq!(completion_tokens(Kind::Completion, &body, &empty), 5);
        assert_eq!(completion_tokens(Kind::Messages, &body, &empty), 5);
        assert_eq!(completion_tokens(Kind::Responses, &body, &empty), 9);
        assert_eq!(completion_tokens(Kind::Chat, &body, &empty), 7);
    }

    /// `x-sim-cached-tokens`: chat usage names that many cached prompt tokens, at most the
    /// prompt; without it, no `prompt_tokens_details`.
    #[test]
    fn cached_tokens_from_the_header() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "a b c"}]});
        let plan = |cached: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(c) = cached {
                h.insert("x-sim-cached-tokens", c.parse().unwrap());
            }
            Plan::new(Kind::Chat, &body, &h, &SimConfig::default(), "").usage()
        };
        assert_eq!(plan(Some("2"))["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(plan(Some("9"))["prompt_tokens_details"]["cached_tokens"], 3);
        assert!(plan(None).get("prompt_tokens_details").is_none());
    }

    #[test]
    fn prompt_tokens_of_responses_anthropic_and_embeddings_inputs() {
        // Responses: input string or items, plus instructions.
        assert_eq!(
            prompt_tokens(&json!({"input": "a b c", "instructions": "be nice"})),
            5
        );
        assert_eq!(
            prompt_tokens(&json!({"input": [
                {"role": "user", "content": "one two"},
                {"role": "user", "content": [{"type": "input_text", "text": "three"}]},
            ]})),
            3
        );
        // Anthropic: system as a string or text blocks, content blocks.
        assert_eq!(
            prompt_tokens(&json!({"system": [{"type": "text", "text": "x y"}],
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": "z"}]}]})),
            3
        );
        // Embeddings: a list of strings, or token arrays.
        assert_eq!(prompt_tokens(&json!({"input": ["a b", "c"]})), 3);
        assert_eq!(prompt_tokens(&json!({"input": [[1, 2, 3], [4]]})), 4);
    }

    #[test]
    fn completion_tokens_from_max_output_tokens() {
        let empty = HeaderMap::new();
        assert_eq!(
            completion_tokens(Kind::Responses, &json!({"max_output_tokens": 9}), &empty),
            9
        );
    }

    #[test]
    fn prompt_tokens_of_documents_and_tool_schemas() {
        let doc = json!({"messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a b c d"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUFB QUFB"}},
            {"type": "text", "text": "e"},
        ]}]});
        assert_eq!(prompt_tokens(&doc), 5);
        let tools = json!({"messages": [], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"alpha": {}, "beta": {}}}}}]});
        // Keys: type, function, name, parameters, type, properties, alpha, beta (8); strings:
        // "function", "f", "object" (3).
        assert_eq!(prompt_tokens(&tools), 11);
    }

    #[test]
    fn accept_encoding_allows_gzip() {
        for (v, ok) in [
            ("gzip", true),
            ("deflate, gzip;q=0.5", true),
            ("br, *", true),
            ("GZIP", true),
            ("x-gzip", true),
            ("gzip;q=0", false),
            ("identity", false),
            ("br, deflate", false),
            ("", false),
        ] {
            assert_eq!(accepts_gzip(v), ok, "{v}");
        }
    }

    #[test]
    fn unknown_fields_refused_per_api() {
        let refused = |kind: Kind, v: Value| refusal(kind, v.as_object().unwrap()).is_some();
        let chat_ok =
            json!({"model": "m", "messages": [], "stream_options": {"include_usage": true}});
        assert!(!refused(Kind::Chat, chat_ok));
        assert!(refused(Kind::Chat, json!({"model": "m", "input": "x"})));
        let completion_ok = json!({"model": "m", "prompt": "x", "stream_options": {}});
        assert!(!refused(Kind::Completion, completion_ok));
        let obfuscation =
            json!({"model": "m", "input": "x", "stream_options": {"include_obfuscation": false}});
        assert!(!refused(Kind::Responses, obfuscation));
        let include_usage = json!({"model": "m", "stream_options": {"include_usage": true}});
        assert!(refused(Kind::Responses, include_usage));
        let messages_ok = json!({"model": "m", "messages": [], "max_tokens": 1});
        assert!(!refused(Kind::Messages, messages_ok));
        assert!(refused(
            Kind::Messages,
            json!({"model": "m", "messages": []})
        ));
        // As Anthropic: no system role in messages, known blocks only, system as text.
        let translated = json!({"model": "m", "max_tokens": 1, "stop_sequences": ["x"],
            "metadata": {"user_id": "u"}, "system": [{"type": "text", "text": "s"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]},
                {"role": "assistant", "content": "y"}]});
        assert!(!refused(Kind::Messages, translated));
        for bad in [
            json!([{"role": "system", "content": "s"}]),
            json!([{"role": "user", "content": "x", "name": "n"}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            json!([{"role": "user", "content": [{"type": "text"}]}]),
            json!([{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]),
        ] {
            let v = json!({"model": "m", "max_tokens": 1, "messages": bad});
            assert!(refused(Kind::Messages, v.clone()), "{v}");
        }
        let bad_system = json!({"model": "m", "max_tokens": 1, "messages": [],
                                "system": [{"type": "image", "source": {}}]});
        assert!(refused(Kind::Messages, bad_system));
        let embeddings_stream = json!({"model": "m", "input": "x", "stream": true});
        assert!(refused(Kind::Embeddings, embeddings_stream));
    }

    #[tokio::test]
    async fn count_tokens_answers_input_tokens_and_refuses_what_the_api_refuses() {
        let body = |v: Value| serde_json::to_vec(&v).unwrap();
        let read = |r: Response| async move {
            let status = r.status();
            let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
            (status, serde_json::from_slice::<Value>(&bytes).unwrap())
        };
        let ok = count_tokens(
            &SimConfig::default(),
            &Method::POST,
            &body(
                json!({"model": "m", "messages": [{"role": "user", "content": "one two three"}]}),
            ),
        );
        assert_eq!(read(ok).await, (StatusCode::OK, json!({"input_tokens": 3})));
        for (v, message) in [
            (
                json!({"model": "m", "messages": [], "max_tokens": 5}),
                "max_tokens: Extra inputs are not permitted",
            ),
            (
                json!({"model": "m", "messages": [], "stream": true}),
                "stream: Extra inputs are not permitted",
            ),
            (json!({"model": "m"}), "messages: Field required"),
        ] {
            let (status, b) =
                read(count_tokens(&SimConfig::default(), &Method::POST, &body(v))).await;
            assert_eq!(status, StatusCode::BAD_REQUEST);
            assert_eq!(b["error"]["message"], message);
            assert_eq!(b["type"], "error");
        }
        let (status, _) = read(count_tokens(&SimConfig::default(), &Method::GET, b"")).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    }

    #[test]
    fn completion_text_is_numbered_words() {
        assert_eq!(completion_text(3), "tok0 tok1 tok2");
        assert_eq!(completion_text(0), "");
    }
}
