//! OpenAI-compatible model simulator (see docs/contracts.md "Model simulator").
//!
//! Deterministic token rule, so tests can predict usage:
//! - `prompt_tokens` = whitespace-separated words in every message `content` string (or text
//!   part), or in `prompt`; at least 1;
//! - `completion_tokens` = `max_tokens` / `max_completion_tokens` when given, else 16; header
//!   `x-sim-completion-tokens: N` overrides; the completion text is `tok0 tok1 …`.
//!
//! Faults (`x-sim-fault`): `status-500`, `not-json`, `drop-mid-stream`, `no-usage`, `no-done`.
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
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            chunk_delay: Duration::ZERO,
            models: vec!["sim-model".to_string()],
        }
    }
}

struct SimState {
    config: SimConfig,
    recorded: Mutex<VecDeque<RecordedRequest>>,
}

/// Shared view of a running simulator's record.
#[derive(Clone)]
pub struct SimHandle {
    state: Arc<SimState>,
    addr: SocketAddr,
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
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Builds the simulator's router and the handle to its record.
fn router(config: SimConfig) -> (Router, Arc<SimState>) {
    let state = Arc::new(SimState {
        config,
        recorded: Mutex::new(VecDeque::new()),
    });
    let app = Router::new().fallback(handle).with_state(state.clone());
    (app, state)
}

/// Serves the simulator on an already bound listener until the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, config: SimConfig) -> std::io::Result<()> {
    let (app, _) = router(config);
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
/// process, so it outlives the tokio runtime of any one test.
pub fn spawn(addr: SocketAddr, config: SimConfig) -> std::io::Result<SimHandle> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let (app, state) = router(config);
    std::thread::Builder::new()
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
                        if let Err(e) = axum::serve(nodelay(listener), app).await {
                            eprintln!("model-sim: server error: {e}");
                        }
                    }
                    Err(e) => eprintln!("model-sim: cannot listen: {e}"),
                }
            });
        })?;
    Ok(SimHandle { state, addr })
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

async fn handle(State(state): State<Arc<SimState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| parts.uri.path().to_string());
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
        return sim_control(&state, &parts.method, rest);
    }
    {
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
            body: String::from_utf8_lossy(&bytes).into_owned(),
        });
    }
    let fault = header_str(&parts.headers, "x-sim-fault").unwrap_or("");
    if fault == "status-500" {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated failure",
            "server_error",
        );
    }
    let kind = if only_path.ends_with("/chat/completions") {
        Kind::Chat
    } else if only_path.ends_with("/completions") {
        Kind::Completion
    } else if only_path.ends_with("/models") {
        if parts.method != Method::GET {
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
        return json_response(StatusCode::OK, &json!({"object": "list", "data": data}));
    } else {
        return error_response(
            StatusCode::NOT_FOUND,
            "unknown path",
            "invalid_request_error",
        );
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
        _ => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "body must be a JSON object",
                "invalid_request_error",
            );
        }
    };
    if fault == "not-json" {
        return not_json();
    }
    let plan = Plan::new(kind, &request, &parts.headers, &state.config, fault);
    if request.get("stream").and_then(Value::as_bool) == Some(true) {
        plan.stream()
    } else {
        json_response(StatusCode::OK, &plan.full_response())
    }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// Counts whitespace-separated words in every string that counts as prompt text.
pub fn prompt_tokens(request: &Value) -> u64 {
    fn words(s: &str) -> u64 {
        s.split_whitespace().count() as u64
    }
    fn content_words(content: &Value) -> u64 {
        match content {
            Value::String(s) => words(s),
            // Content parts: [{"type":"text","text":"…"}, …]
            Value::Array(parts) => parts
                .iter()
                .map(|p| match p {
                    Value::String(s) => words(s),
                    Value::Object(o) => o
                        .get("text")
                        .and_then(Value::as_str)
                        .map(words)
                        .unwrap_or(0),
                    _ => 0,
                })
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
    if let Some(prompt) = request.get("prompt") {
        n += content_words(prompt);
    }
    n.max(1)
}

/// Completion tokens from the request (headers override the body).
pub fn completion_tokens(request: &Value, headers: &HeaderMap) -> u64 {
    let from_header =
        header_str(headers, "x-sim-completion-tokens").and_then(|v| v.parse::<u64>().ok());
    let from_body = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| request.get(*k).and_then(Value::as_u64));
    from_header
        .or(from_body)
        .unwrap_or(DEFAULT_COMPLETION_TOKENS)
        .min(MAX_COMPLETION_TOKENS)
}

struct Plan {
    kind: Kind,
    model: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    include_usage_chunk: bool,
    chunk_delay: Duration,
    fault: String,
    created: u64,
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
            completion_tokens: completion_tokens(request, headers),
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
        }
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    fn id(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chatcmpl-sim",
            Kind::Completion => "cmpl-sim",
        }
    }

    fn full_response(&self) -> Value {
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
        };
        if self.fault != "no-usage" {
            v["usage"] = self.usage();
        }
        v
    }

    fn chunk(&self, piece: Option<String>, finish: bool, first: bool) -> Value {
        let finish_reason = if finish { json!("stop") } else { Value::Null };
        match self.kind {
            Kind::Chat => {
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
            Kind::Completion => json!({
                "id": self.id(), "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": piece.unwrap_or_default(), "finish_reason": finish_reason, "logprobs": null}],
            }),
        }
    }

    /// All SSE events of the stream, in order (`data: …\n\n`), plus where to drop it for the
    /// `drop-mid-stream` fault.
    fn events(&self) -> (Vec<Bytes>, Option<usize>) {
        let mut events = Vec::with_capacity(self.completion_tokens as usize + 3);
        for i in 0..self.completion_tokens {
            let piece = if i == 0 {
                "tok0".to_string()
            } else {
                format!(" tok{i}")
            };
            events.push(sse(&self.chunk(Some(piece), false, i == 0)));
        }
        events.push(sse(&self.chunk(None, true, self.completion_tokens == 0)));
        if self.include_usage_chunk && self.fault != "no-usage" {
            let usage_chunk = match self.kind {
                Kind::Chat => json!({
                    "id": self.id(), "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [], "usage": self.usage(),
                }),
                Kind::Completion => json!({
                    "id": self.id(), "object": "text_completion", "created": self.created,
                    "model": self.model, "choices": [], "usage": self.usage(),
                }),
            };
            events.push(sse(&usage_chunk));
        }
        if self.fault != "no-done" {
            events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        }
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
        assert_eq!(completion_tokens(&json!({}), &empty), 16);
        assert_eq!(completion_tokens(&json!({"max_tokens": 3}), &empty), 3);
        assert_eq!(
            completion_tokens(
                &json!({"max_completion_tokens": 4, "max_tokens": 3}),
                &empty
            ),
            4
        );
        let mut h = HeaderMap::new();
        h.insert("x-sim-completion-tokens", "7".parse().unwrap());
        assert_eq!(completion_tokens(&json!({"max_tokens": 3}), &h), 7);
        assert_eq!(
            completion_tokens(&json!({"max_tokens": u64::MAX}), &empty),
            MAX_COMPLETION_TOKENS
        );
    }

    #[test]
    fn completion_text_is_numbered_words() {
        assert_eq!(completion_text(3), "tok0 tok1 tok2");
        assert_eq!(completion_text(0), "");
    }
}
