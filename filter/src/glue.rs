//! The proxy-wasm layer: contexts, host calls, pausing and resuming. Decisions live in the other
//! modules; this file moves data between Envoy and them.
//!
//! One `Worker` per VM (Envoy runs one VM per worker thread), shared by the root context and the
//! HTTP contexts of that thread through `Rc<RefCell<_>>`. Shared data (cache, counters) is shared
//! by all VMs of the plugin.

use crate::cache::{self, CachedAnswer, CachedIdentity};
use crate::config::PluginConfig;
use crate::credential::{self, CacheIdentity};
use crate::decide::{self, Seen};
use crate::encoding::{self, Coding, DecodingScanner};
use crate::hygiene;
use crate::limits::{self, Admission, RateHeaders, Reservation};
use crate::metrics;
use crate::operations;
use crate::path::{self, PathClass};
use crate::request_body::{self, RequestInfo};
use crate::response::{Decision, Refusal};
use crate::sse::SseScanner;
use crate::store::{CasMismatch, SharedStore};
use crate::usage::JsonUsageScanner;
use maas_types::{
    AuthenticateRequest, AuthenticateResponse, CredentialsDocument, ErrorBody, Model,
    PolicyDocument,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root::new(context_id))
    });
}}

/// Shared data through the host.
struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|_| CasMismatch)
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A header value; bytes that are not UTF-8 become U+FFFD (the SDK's string getters would panic
/// and trap the VM on them).
fn map_value(map: proxy_wasm::types::MapType, name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(map, name)
        .ok()
        .flatten()
        .map(lossy)
}

fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Every request header, values made UTF-8 as in [`map_value`] (names are tokens already).
fn request_headers() -> Vec<(String, String)> {
    hostcalls::get_map_bytes(proxy_wasm::types::MapType::HttpRequestHeaders)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, lossy(v)))
        .collect()
}

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

/// Metric ids of this VM (names are shared: Envoy aggregates them across VMs).
#[derive(Default)]
struct Metrics {
    decisions: Vec<u32>,
    cache_hit: u32,
    cache_miss: u32,
    callout_latency: u32,
    callout_failed: u32,
    callouts: u32,
    policy_updates: u32,
    policy_rejected: u32,
    malformed_upstream: u32,
    /// (tier, model, prompt id, completion id), defined on first use.
    tokens: Vec<(String, String, u32, u32)>,
}

fn define(kind: MetricType, name: &str) -> u32 {
    hostcalls::define_metric(kind, name).unwrap_or(0)
}

thread_local! {
    /// Counter increments not yet handed to Envoy: flushed every tick, so a request costs no
    /// metric host calls (counters lag by at most one tick).
    static PENDING: RefCell<Vec<(u32, u64)>> = const { RefCell::new(Vec::new()) };
}

fn inc(id: u32, by: u64) {
    if id == 0 || by == 0 {
        return;
    }
    PENDING.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            match p.iter_mut().find(|(i, _)| *i == id) {
                Some((_, n)) => *n = n.saturating_add(by),
                None => p.push((id, by)),
            }
        }
    });
}

fn flush_metrics() {
    PENDING.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            for (id, n) in p.iter_mut() {
                if *n > 0 {
                    let _ = hostcalls::increment_metric(*id, i64::try_from(*n).unwrap_or(i64::MAX));
                    *n = 0;
                }
            }
        }
    });
}

impl Metrics {
    fn define_all() -> Self {
        Metrics {
            decisions: Decision::ALL
                .iter()
                .map(|d| define(MetricType::Counter, &metrics::request_metric(*d)))
                .collect(),
            cache_hit: define(MetricType::Counter, metrics::CACHE_HIT),
            cache_miss: define(MetricType::Counter, metrics::CACHE_MISS),
            callout_latency: define(MetricType::Histogram, metrics::CALLOUT_LATENCY_MS),
            callout_failed: define(MetricType::Counter, metrics::CALLOUT_FAILED),
            callouts: define(MetricType::Counter, metrics::CALLOUTS),
            policy_updates: define(MetricType::Counter, metrics::POLICY_UPDATES),
            policy_rejected: define(MetricType::Counter, metrics::POLICY_REJECTED),
            malformed_upstream: define(MetricType::Counter, metrics::MALFORMED_UPSTREAM),
            tokens: Vec::new(),
        }
    }

    fn decision(&self, d: Decision) {
        if let Some(id) = self.decisions.get(d.index()) {
            inc(*id, 1);
        }
    }

    fn tokens(&mut self, tier: &str, model: &str, prompt: u64, completion: u64) {
        let found = self
            .tokens
            .iter()
            .find(|(t, m, _, _)| t == tier && m == model)
            .map(|(_, _, p, c)| (*p, *c));
        let (p, c) = match found {
            Some(ids) => ids,
            None => {
                let p = define(
                    MetricType::Counter,
                    &metrics::token_metric("prompt", tier, model),
                );
                let c = define(
                    MetricType::Counter,
                    &metrics::token_metric("completion", tier, model),
                );
                self.tokens
                    .push((tier.to_string(), model.to_string(), p, c));
                (p, c)
            }
        };
        inc(p, prompt);
        inc(c, completion);
    }
}

/// State of one VM (one worker thread).
struct Worker {
    config: Option<Rc<PluginConfig>>,
    policy: Option<Rc<PolicyDocument>>,
    policy_etag: Option<String>,
    /// Set once the companion answered a policy poll (the bootstrap policy is then replaced).
    revoked: HashSet<String>,
    credentials: Rc<CredentialsDocument>,
    credentials_etag: Option<String>,
    /// Requests of this worker waiting for a callout another request made for the same
    /// credential (flight key — the whole credential, never the key id alone → waiters).
    waiting: HashMap<String, Vec<Rc<RefCell<Request>>>>,
    metrics: Metrics,
}

type SharedWorker = Rc<RefCell<Worker>>;

struct Root {
    id: u32,
    worker: SharedWorker,
    policy_call: Option<u32>,
    credentials_call: Option<u32>,
    next_poll_ms: u64,
    last_poll_warning_ms: u64,
}

/// Tick period: short so that the first poll happens soon after start; polls themselves follow
/// `pollIntervalMs`.
const TICK_MS: u64 = 200;

impl Root {
    fn new(id: u32) -> Self {
        Root {
            id,
            worker: Rc::new(RefCell::new(Worker {
                config: None,
                policy: None,
                policy_etag: None,
                revoked: HashSet::new(),
                credentials: Rc::new(CredentialsDocument::default()),
                credentials_etag: None,
                waiting: HashMap::new(),
                metrics: Metrics::default(),
            })),
            policy_call: None,
            credentials_call: None,
            next_poll_ms: 0,
            last_poll_warning_ms: 0,
        }
    }

    fn get_from_companion(
        &self,
        cfg: &PluginConfig,
        path: &str,
        etag: Option<&str>,
    ) -> Option<u32> {
        let mut headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", cfg.companion.authority.as_str()),
        ];
        if let Some(e) = etag {
            headers.push(("if-none-match", e));
        }
        match hostcalls::dispatch_http_call(
            &cfg.companion.cluster,
            headers,
            None,
            vec![],
            Duration::from_millis(cfg.companion.timeout_ms),
        ) {
            Ok(token) => Some(token),
            Err(e) => {
                log(
                    LogLevel::Warn,
                    &format!(
                        "maas: cannot call companion cluster {:?} for {path}: {e:?}",
                        cfg.companion.cluster
                    ),
                );
                None
            }
        }
    }

    fn warn_poll(&mut self, what: &str) {
        let now = now_ms();
        // At most one warning per 10 s per worker while the companion is away.
        if now.saturating_sub(self.last_poll_warning_ms) >= 10_000 {
            self.last_poll_warning_ms = now;
            log(LogLevel::Warn, &format!("maas: {what}"));
        }
    }

    fn on_policy_response(
        &mut self,
        status: Option<u32>,
        etag: Option<String>,
        body: Option<Vec<u8>>,
    ) {
        match status {
            Some(200) => {
                let body = body.unwrap_or_default();
                let mut w = self.worker.borrow_mut();
                match PolicyDocument::from_json(&body) {
                    Ok(doc) => {
                        let revoked: HashSet<String> =
                            doc.revoked_key_ids.iter().cloned().collect();
                        let store = HostStore;
                        let max_entries = w.config.as_ref().map_or(1, |c| c.cache.max_entries);
                        for id in revoked.difference(&w.revoked) {
                            cache::evict(&store, &credential::api_key_cache_key(id), max_entries);
                        }
                        w.revoked = revoked;
                        log(
                            LogLevel::Info,
                            &format!(
                                "maas: policy updated ({} tiers, {} models, {} revoked keys, etag {})",
                                doc.tiers.len(),
                                doc.models.len(),
                                doc.revoked_key_ids.len(),
                                etag.as_deref().unwrap_or("-")
                            ),
                        );
                        w.policy = Some(Rc::new(doc));
                        w.policy_etag = etag;
                        inc(w.metrics.policy_updates, 1);
                    }
                    Err(e) => {
                        // The old policy stays; remember the etag so the same document is not
                        // re-parsed (and re-logged) every poll.
                        log(
                            LogLevel::Error,
                            &format!(
                                "maas: policy from the companion refused, keeping the current one: {e}"
                            ),
                        );
                        w.policy_etag = etag;
                        inc(w.metrics.policy_rejected, 1);
                    }
                }
            }
            Some(304) => {}
            other => self.warn_poll(&format!(
                "policy poll failed (status {other:?}); keeping the current policy"
            )),
        }
    }

    fn on_credentials_response(
        &mut self,
        status: Option<u32>,
        etag: Option<String>,
        body: Option<Vec<u8>>,
    ) {
        match status {
            Some(200) => {
                let body = body.unwrap_or_default();
                match serde_json::from_slice::<CredentialsDocument>(&body) {
                    Ok(doc) => {
                        let mut w = self.worker.borrow_mut();
                        // Names only: never the values.
                        log(
                            LogLevel::Info,
                            &format!(
                                "maas: provider credentials updated: {:?}",
                                maas_types::auth::CredentialsDocumentRedacted(&doc)
                            ),
                        );
                        w.credentials = Rc::new(doc);
                        w.credentials_etag = etag;
                    }
                    Err(e) => log(
                        LogLevel::Error,
                        &format!(
                            "maas: credentials document refused at line {} column {}",
                            e.line(),
                            e.column()
                        ),
                    ),
                }
            }
            Some(304) => {}
            other => self.warn_poll(&format!("credentials poll failed (status {other:?})")),
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let status = map_value(
            proxy_wasm::types::MapType::HttpCallResponseHeaders,
            ":status",
        )
        .and_then(|s| s.parse::<u32>().ok());
        let etag = map_value(proxy_wasm::types::MapType::HttpCallResponseHeaders, "etag");
        let body = (body_size > 0).then(|| {
            read_buffer(
                proxy_wasm::types::BufferType::HttpCallResponseBody,
                body_size,
            )
        });
        if self.policy_call == Some(token) {
            self.policy_call = None;
            self.on_policy_response(status, etag, body);
        } else if self.credentials_call == Some(token) {
            self.credentials_call = None;
            self.on_credentials_response(status, etag, body);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = read_buffer(
            proxy_wasm::types::BufferType::PluginConfiguration,
            usize::MAX,
        );
        let cfg = match PluginConfig::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log(
                    LogLevel::Critical,
                    &format!("maas: invalid configuration, filter not started: {e}"),
                );
                return false;
            }
        };
        let mut w = self.worker.borrow_mut();
        if w.policy.is_none()
            && let Some(p) = &cfg.bootstrap_policy
        {
            w.revoked = p.revoked_key_ids.iter().cloned().collect();
            w.policy = Some(Rc::new(p.clone()));
        }
        w.config = Some(Rc::new(cfg));
        w.metrics = Metrics::define_all();
        drop(w);
        let _ = hostcalls::set_tick_period(Duration::from_millis(TICK_MS));
        // First poll now rather than at the first tick (provider credentials have no bootstrap).
        self.on_tick();
        log(
            LogLevel::Info,
            &format!("maas: filter configured (root context {})", self.id),
        );
        true
    }

    fn on_tick(&mut self) {
        flush_metrics();
        let now = now_ms();
        if now < self.next_poll_ms {
            return;
        }
        let (cfg, policy_etag, cred_etag, have_policy_answer) = {
            let w = self.worker.borrow();
            let Some(cfg) = w.config.clone() else { return };
            (
                cfg,
                w.policy_etag.clone(),
                w.credentials_etag.clone(),
                w.policy_etag.is_some(),
            )
        };
        if self.policy_call.is_none() {
            self.policy_call =
                self.get_from_companion(&cfg, "/internal/v1/policy", policy_etag.as_deref());
        }
        if self.credentials_call.is_none() {
            self.credentials_call =
                self.get_from_companion(&cfg, "/internal/v1/credentials", cred_etag.as_deref());
        }
        // Until the companion answered once, retry quickly.
        let interval = if have_policy_answer {
            cfg.poll_interval_ms
        } else {
            cfg.poll_interval_ms.min(500)
        };
        self.next_poll_ms = now.saturating_add(interval);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            req: Rc::new(RefCell::new(Request::new(context_id, self.worker.clone()))),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum AuthState {
    NotNeeded,
    /// Waiting for a callout (ours when `token` is set, else another request's).
    Pending {
        token: Option<u32>,
    },
    Done(Result<CachedIdentity, Refusal>),
}

#[derive(Debug)]
enum BodyState {
    None,
    Buffering,
    Done(Result<RequestInfo, String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Let the request go on (headers, or everything).
    Continue,
    /// Waiting for the companion.
    Wait,
    /// Answered with an error.
    Refused,
}

enum Scan {
    None,
    Json(JsonUsageScanner),
    Sse(SseScanner),
    /// A body the backend compressed anyway: decoded for the scanner, forwarded untouched.
    Decoding(DecodingScanner),
    /// A coding that cannot be read (br, zstd…): settles to the reservation.
    Unreadable,
}

/// One HTTP request's state.
struct Request {
    id: u32,
    worker: SharedWorker,
    /// The policy the request was decided with, and the model's and tier's index in it.
    policy: Option<Rc<PolicyDocument>>,
    model_idx: Option<usize>,
    tier_idx: Option<usize>,
    /// The subject's own highest tier (its windows apply to every request of the subject).
    highest_tier_idx: Option<usize>,
    /// Client headers to remove before forwarding (found in the one header scan).
    strip_headers: Vec<String>,
    client_anthropic_version: bool,
    discovery: bool,
    identity: Option<CacheIdentity>,
    auth: AuthState,
    body: BodyState,
    /// Headers returned StopIteration: the request must be resumed after an async decision.
    paused: bool,
    /// A final answer was given (forwarded or refused).
    decided: bool,
    callout_started_ms: u64,
    headers_decided: bool,
    /// pluginConfig `pauseHeadersForBody`: headers wait for the body decision.
    hold_headers: bool,
    subject: Option<String>,
    reservation: Option<Reservation>,
    rate_headers: RateHeaders,
    strip_usage_event: bool,
    /// The prompt estimate reserved at admission (settles an aborted stream).
    prompt_tokens_estimate: u64,
    /// Bytes of the request body buffered so far (the host's buffer size at the last chunk).
    buffered_body_bytes: usize,
    /// The API operation accepts `stream_options` (OpenAI chat/completions and completions):
    /// only then is `include_usage` added to a streamed request.
    accepts_stream_options: bool,
    /// The operation is a JSON API whose body is always inspected.
    always_inspect_body: bool,
    response_status: u32,
    scan: Scan,
    settled: bool,
}

impl Request {
    fn new(id: u32, worker: SharedWorker) -> Self {
        Request {
            id,
            worker,
            policy: None,
            model_idx: None,
            tier_idx: None,
            highest_tier_idx: None,
            strip_headers: Vec::new(),
            client_anthropic_version: false,
            discovery: false,
            identity: None,
            auth: AuthState::NotNeeded,
            body: BodyState::None,
            paused: false,
            decided: false,
            callout_started_ms: 0,
            headers_decided: false,
            hold_headers: false,
            subject: None,
            reservation: None,
            rate_headers: RateHeaders::default(),
            strip_usage_event: false,
            prompt_tokens_estimate: 0,
            buffered_body_bytes: 0,
            accepts_stream_options: false,
            always_inspect_body: false,
            response_status: 0,
            scan: Scan::None,
            settled: false,
        }
    }

    fn config(&self) -> Option<Rc<PluginConfig>> {
        self.worker.borrow().config.clone()
    }

    /// Answers the request with an error (on the effective context).
    fn refuse(&mut self, r: &Refusal) {
        self.decided = true;
        self.worker.borrow().metrics.decision(r.decision);
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2 + r.headers.len());
        headers.push(("content-type", "application/json"));
        if r.status == 401 {
            headers.push(("www-authenticate", "Bearer"));
        }
        for (k, v) in &r.headers {
            headers.push((k.as_str(), v.as_str()));
        }
        let _ = hostcalls::send_http_response(r.status, headers, Some(&r.body()));
    }

    /// Request headers: everything that can be decided without waiting.
    fn on_headers(&mut self, end_of_stream: bool) -> Action {
        let Some(cfg) = self.config() else {
            self.refuse(&Refusal::unavailable(
                "not_configured",
                "gateway filter not configured",
            ));
            return Action::Pause;
        };
        // One host call for every header (the path, the credential, what to strip).
        let headers = request_headers();
        let full_path = headers
            .iter()
            .find(|(k, _)| k == ":path")
            .map(|(_, v)| v.as_str())
            .unwrap_or_default();
        let class = match path::classify(full_path, &cfg.management_path_prefix) {
            Ok(c) => c,
            Err(e) => {
                let r = if e.status() == 404 {
                    Refusal::not_found("not_found", e.message())
                } else {
                    Refusal::bad_request("invalid_path", e.message())
                };
                self.refuse(&r);
                return Action::Pause;
            }
        };
        let model_path = match class {
            PathClass::Management => {
                // The companion authenticates these itself; only the reserved namespace goes.
                for (name, _) in &headers {
                    if hygiene::is_reserved(name) {
                        let _ = hostcalls::set_map_value(
                            proxy_wasm::types::MapType::HttpRequestHeaders,
                            name,
                            None,
                        );
                    }
                }
                self.decided = true;
                return Action::Continue;
            }
            PathClass::Model(p) => p,
        };
        let policy = self.worker.borrow().policy.clone();
        let Some(policy) = policy else {
            self.refuse(&Refusal::unavailable(
                "no_policy",
                "no policy loaded yet; retry shortly",
            ));
            return Action::Pause;
        };
        let Some(model) = policy.model_for_path(model_path) else {
            self.refuse(&Refusal::not_found(
                "model_not_found",
                "no model is served at this path",
            ));
            return Action::Pause;
        };
        // Only the model's allow-listed (method, path) pairs go on (404 otherwise).
        let method = headers
            .iter()
            .find(|(k, _)| k == ":method")
            .map(|(_, v)| v.as_str())
            .unwrap_or_default();
        let operation = match operations::allowed(model, method, model_path) {
            Ok(op) => op,
            Err(r) => {
                self.refuse(&r);
                return Action::Pause;
            }
        };
        self.discovery = operation.is_discovery();
        self.accepts_stream_options = operation.accepts_stream_options();
        // The metered JSON APIs are read whatever content-type the client claims (a backend may
        // parse the body as JSON anyway); only custom operations may stream uploads unread.
        self.always_inspect_body = operation != operations::Operation::Custom;
        self.model_idx = policy.models.iter().position(|m| std::ptr::eq(m, model));
        self.policy = Some(policy.clone());
        for (name, _) in &headers {
            if hygiene::strip_for_model(name, &cfg.remove_headers) {
                self.strip_headers.push(name.clone());
            } else if name.eq_ignore_ascii_case("anthropic-version") {
                self.client_anthropic_version = true;
            }
        }

        let find = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let cred = match credential::extract(find("authorization"), find("x-api-key")) {
            Ok(c) => c,
            Err(e) => {
                let r = if e.status() == 400 {
                    Refusal::bad_request("invalid_credential", e.message())
                } else {
                    Refusal::unauthenticated(e.message())
                };
                self.refuse(&r);
                return Action::Pause;
            }
        };
        let identity = cred.cache_identity();
        let now_s = now_ms() / 1000;
        let revoked = identity
            .key_id
            .as_ref()
            .is_some_and(|id| self.worker.borrow().revoked.contains(id));
        if revoked {
            cache::evict(&HostStore, &identity.cache_key, cfg.cache.max_entries);
            self.refuse(&Refusal::unauthenticated("key revoked"));
            return Action::Pause;
        }
        match cache::lookup(
            &HostStore,
            &identity.cache_key,
            &identity.verifier,
            now_s,
            cfg.cache.max_entries,
        ) {
            Some(answer) => {
                inc(self.worker.borrow().metrics.cache_hit, 1);
                self.auth = AuthState::Done(match answer {
                    CachedAnswer::Allow(id) => Ok(id),
                    CachedAnswer::Deny { status, message } => {
                        Err(Refusal::from_companion(u32::from(status), &message))
                    }
                });
            }
            None => {
                inc(self.worker.borrow().metrics.cache_miss, 1);
                let already = self
                    .worker
                    .borrow()
                    .waiting
                    .contains_key(&identity.flight_key());
                if already {
                    // Another request of this worker is asking for the same credential.
                    self.auth = AuthState::Pending { token: None };
                } else {
                    let body = serde_json::to_vec(&AuthenticateRequest {
                        credential: cred.raw().to_string(),
                    })
                    .unwrap_or_default();
                    match hostcalls::dispatch_http_call(
                        &cfg.companion.cluster,
                        vec![
                            (":method", "POST"),
                            (":path", "/internal/v1/authenticate"),
                            (":authority", cfg.companion.authority.as_str()),
                            ("content-type", "application/json"),
                        ],
                        Some(&body),
                        vec![],
                        Duration::from_millis(cfg.companion.timeout_ms),
                    ) {
                        Ok(token) => {
                            inc(self.worker.borrow().metrics.callouts, 1);
                            self.callout_started_ms = now_ms();
                            self.auth = AuthState::Pending { token: Some(token) };
                            self.worker
                                .borrow_mut()
                                .waiting
                                .insert(identity.flight_key(), Vec::new());
                        }
                        Err(e) => {
                            log(
                                LogLevel::Warn,
                                &format!("maas: cannot call the companion: {e:?}"),
                            );
                            inc(self.worker.borrow().metrics.callout_failed, 1);
                            self.refuse(&Refusal::unavailable(
                                "auth_unavailable",
                                "authentication service unavailable",
                            ));
                            return Action::Pause;
                        }
                    }
                }
            }
        }
        self.identity = Some(identity);
        if !end_of_stream
            && (self.always_inspect_body || hygiene::inspect_body(find("content-type")))
        {
            self.body = BodyState::Buffering;
            self.hold_headers = cfg.pause_headers_for_body;
        }
        match self.proceed() {
            Step::Continue => Action::Continue,
            Step::Wait => {
                self.paused = true;
                Action::Pause
            }
            Step::Refused => Action::Pause,
        }
    }

    /// Moves the request as far as the known facts allow. Envoy (without the
    /// `allow_on_headers_stop_iteration` knob, as under Istio) delivers the body only after the
    /// headers continue; so the headers go on once the caller is authenticated and authorised,
    /// and the body-dependent checks (model field, token reservation) come at the end of the
    /// body. A refusal then resets the upstream request before it has a body.
    fn proceed(&mut self) -> Step {
        if self.decided {
            return Step::Refused;
        }
        match &self.auth {
            AuthState::Pending { .. } => return Step::Wait,
            AuthState::Done(Err(r)) => {
                let r = r.clone();
                self.refuse(&r);
                return Step::Refused;
            }
            _ => {}
        }
        if !self.headers_decided {
            if let Err(r) = self.decide_headers() {
                self.refuse(&r);
                return Step::Refused;
            }
            self.headers_decided = true;
        }
        if matches!(self.body, BodyState::Buffering) {
            if self.hold_headers {
                // Envoy hands us the body while the headers wait (allow_on_headers_stop_iteration).
                return Step::Wait;
            }
            // Let the headers go so that the body arrives.
            return Step::Continue;
        }
        match self.decide_body() {
            Ok(()) => {
                self.decided = true;
                self.worker.borrow().metrics.decision(Decision::Allowed);
                Step::Continue
            }
            Err(r) => {
                self.refuse(&r);
                Step::Refused
            }
        }
    }

    /// Request body chunk (buffered until the end).
    fn on_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided || !matches!(self.body, BodyState::Buffering) {
            return Action::Continue;
        }
        let Some(cfg) = self.config() else {
            self.refuse(&Refusal::unavailable(
                "not_configured",
                "gateway filter not configured",
            ));
            return Action::Pause;
        };
        if body_size as u64 > cfg.max_request_body_bytes {
            self.refuse(&Refusal::too_large(cfg.max_request_body_bytes));
            return Action::Pause;
        }
        self.buffered_body_bytes = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.end_of_body()
    }

    /// Request trailers end the request: an HTTP/2 body whose last DATA frame has no END_STREAM
    /// (or an HTTP/1.1 chunked body with trailers) is decided here, exactly as at the end of a
    /// body, so no request reaches the backend undecided.
    fn on_trailers(&mut self) -> Action {
        if self.decided || !matches!(self.body, BodyState::Buffering) {
            return Action::Continue;
        }
        self.end_of_body()
    }

    /// The whole request body is buffered: inspect it (and rewrite it where the API accepts
    /// `stream_options`), then decide.
    fn end_of_body(&mut self) -> Action {
        let body_size = self.buffered_body_bytes;
        let bytes = read_buffer(proxy_wasm::types::BufferType::HttpRequestBody, body_size);
        if bytes.len() != body_size {
            self.refuse(&Refusal::internal(
                "the gateway could not read the request body; retry",
            ));
            return Action::Pause;
        }
        let info = request_body::inspect(&bytes).map_err(|e| e.to_string());
        if let Ok(i) = &info
            && i.stream
            && !i.include_usage
            && !self.discovery
            && self.accepts_stream_options
        {
            // Ask for usage so the stream can be counted (only APIs that accept
            // `stream_options`: OpenAI chat/completions and completions); the usage-only event is
            // removed from what the client sees.
            if let Ok(new_body) = request_body::with_include_usage(&bytes) {
                let _ = hostcalls::set_buffer(
                    proxy_wasm::types::BufferType::HttpRequestBody,
                    0,
                    body_size,
                    &new_body,
                );
                if self.hold_headers {
                    // Headers still held (allow_on_headers_stop_iteration): keep them exact.
                    let _ = hostcalls::set_map_value(
                        proxy_wasm::types::MapType::HttpRequestHeaders,
                        "content-length",
                        Some(&new_body.len().to_string()),
                    );
                }
                self.strip_usage_event = true;
            }
        }
        self.body = BodyState::Done(info);
        match self.proceed() {
            Step::Continue => {
                self.paused = false;
                Action::Continue
            }
            Step::Wait | Step::Refused => Action::Pause,
        }
    }

    /// The callout for this credential answered (on this request's context).
    fn apply_auth(&mut self, result: Result<CachedIdentity, Refusal>) {
        if self.decided {
            return;
        }
        self.auth = AuthState::Done(result);
        if self.proceed() == Step::Continue && self.paused {
            self.paused = false;
            let _ = hostcalls::resume_http_request();
        }
    }

    /// Once the caller is known: authorise, check the provider credential, clean the headers.
    fn decide_headers(&mut self) -> Result<(), Refusal> {
        let identity = match &self.auth {
            AuthState::Done(Ok(id)) => id.clone(),
            AuthState::Done(Err(r)) => return Err(r.clone()),
            _ => {
                return Err(Refusal::unavailable(
                    "auth_unavailable",
                    "authentication did not complete",
                ));
            }
        };
        let (policy, credentials) = {
            let w = self.worker.borrow();
            (w.policy.clone(), w.credentials.clone())
        };
        let Some(policy) = policy else {
            return Err(Refusal::unavailable(
                "no_policy",
                "no policy loaded yet; retry shortly",
            ));
        };
        // The policy may have changed while we waited: find the model again by name.
        let model_name = self.model().map(|m| m.name.clone()).unwrap_or_default();
        let Some(model_idx) = policy.models.iter().position(|m| m.name == model_name) else {
            return Err(Refusal::not_found(
                "model_not_found",
                "no model is served at this path",
            ));
        };
        let Some(model) = policy.models.get(model_idx) else {
            return Err(Refusal::not_found(
                "model_not_found",
                "no model is served at this path",
            ));
        };
        let tier = decide::authorize(&policy, &identity, model)?;
        let tier_idx = policy.tiers.iter().position(|t| std::ptr::eq(t, tier));
        // One budget per person: the subject's own highest tier's windows apply to every
        // request, a pinned (lower) tier's too.
        let highest = policy.resolve_tier(&identity.groups, None).unwrap_or(tier);
        let highest_tier_idx = policy.tiers.iter().position(|t| std::ptr::eq(t, highest));
        let counter_slots = self.config().map_or(1, |c| c.limits.counter_slots);
        let provider_key = match &model.provider {
            Some(p) => match credentials.credentials.get(&p.credential_ref) {
                Some(k) => Some((p.kind, k.as_str())),
                None => {
                    return Err(Refusal::unavailable(
                        "provider_credential_missing",
                        format!("no credential for model {} yet; retry shortly", model.name),
                    ));
                }
            },
            None => None,
        };

        // Headers are about to leave before the body is read: refuse now what is certain
        // (a full request or token window), so that such a 429 starts no upstream request.
        if matches!(self.body, BodyState::Buffering)
            && !self.hold_headers
            && !self.discovery
            && let Some(limited) = limits::precheck(
                &HostStore,
                &[tier, highest],
                &identity.subject,
                now_ms() / 1000,
                counter_slots,
            )
        {
            return Err(limited_refusal(limited));
        }

        // The request must go to the model's own upstream (Envoy's route decided the cluster):
        // a route the gateway did not create never gets the provider credential.
        operations::check_upstream(model, || {
            hostcalls::get_property(operations::CLUSTER_PROPERTY.to_vec())
                .ok()
                .flatten()
                .map(lossy)
        })?;

        // Hygiene: nothing the client sent reaches the backend as identity.
        for name in &self.strip_headers {
            let _ = hostcalls::set_map_value(
                proxy_wasm::types::MapType::HttpRequestHeaders,
                name,
                None,
            );
        }
        // Usage is read from the response body: ask the backend for it uncompressed (Envoy may
        // compress towards the client). A backend that compresses anyway is decoded for reading.
        let _ = hostcalls::set_map_value(
            proxy_wasm::types::MapType::HttpRequestHeaders,
            "accept-encoding",
            Some("identity"),
        );
        if let Some((kind, key)) = provider_key {
            for (name, value) in hygiene::provider_headers(kind, key, self.client_anthropic_version)
            {
                let _ = hostcalls::set_map_value(
                    proxy_wasm::types::MapType::HttpRequestHeaders,
                    name,
                    Some(&value),
                );
            }
        }
        if matches!(self.body, BodyState::Buffering) && !self.discovery && !self.hold_headers {
            // The body may be rewritten (stream_options.include_usage) after the headers left:
            // let the upstream codec frame it (chunked) instead of a length that may change.
            let _ = hostcalls::set_map_value(
                proxy_wasm::types::MapType::HttpRequestHeaders,
                "content-length",
                None,
            );
        }
        self.subject = Some(identity.subject);
        self.model_idx = Some(model_idx);
        self.tier_idx = tier_idx;
        self.highest_tier_idx = highest_tier_idx;
        self.policy = Some(policy);
        Ok(())
    }

    fn model(&self) -> Option<&Model> {
        self.policy.as_ref()?.models.get(self.model_idx?)
    }

    /// Once the body is known (or there is none): the model field and the limits.
    fn decide_body(&mut self) -> Result<(), Refusal> {
        let policy = self.policy.clone();
        let model = self.model();
        let tier = policy
            .as_ref()
            .and_then(|p| p.tiers.get(self.tier_idx.unwrap_or(usize::MAX)));
        let (Some(model), Some(tier), Some(subject)) = (model, tier, self.subject.clone()) else {
            return Err(Refusal::unavailable(
                "no_policy",
                "no policy loaded yet; retry shortly",
            ));
        };
        if let BodyState::Done(info) = &self.body {
            match info {
                Ok(info) => decide::check_body_model(info, model)?,
                Err(e) if !self.discovery => {
                    return Err(Refusal::bad_request("invalid_body", e.as_str()));
                }
                Err(_) => {}
            }
        }
        if self.discovery {
            return Ok(());
        }
        let info = match &self.body {
            BodyState::Done(Ok(info)) => Some(info),
            _ => None,
        };
        self.prompt_tokens_estimate = info.map_or(0, |i| i.prompt_tokens_estimate);
        let reserve = decide::reservation(info, tier);
        let highest = policy
            .as_ref()
            .and_then(|p| p.tiers.get(self.highest_tier_idx.unwrap_or(usize::MAX)))
            .unwrap_or(tier);
        let counter_slots = self.config().map_or(1, |c| c.limits.counter_slots);
        match limits::admit(
            &HostStore,
            &[tier, highest],
            &subject,
            reserve,
            now_ms() / 1000,
            counter_slots,
        ) {
            Admission::Allowed {
                reservation,
                headers,
            } => {
                self.reservation = Some(reservation);
                self.rate_headers = headers;
                Ok(())
            }
            refused => Err(limited_refusal(refused)),
        }
    }

    fn on_response_headers(&mut self) -> Action {
        self.response_status =
            map_value(proxy_wasm::types::MapType::HttpResponseHeaders, ":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
        if self.reservation.is_none() {
            return Action::Continue;
        }
        for (name, value) in self.rate_headers.headers() {
            let _ = hostcalls::set_map_value(
                proxy_wasm::types::MapType::HttpResponseHeaders,
                name,
                Some(&value),
            );
        }
        let content_type = map_value(
            proxy_wasm::types::MapType::HttpResponseHeaders,
            "content-type",
        )
        .unwrap_or_default()
        .to_ascii_lowercase();
        let coding = encoding::coding(
            map_value(
                proxy_wasm::types::MapType::HttpResponseHeaders,
                "content-encoding",
            )
            .as_deref(),
        );
        if coding != Coding::Identity {
            // Asked for identity, compressed anyway: read the usage from a decoded copy.
            let scanner = if content_type.starts_with("text/event-stream") {
                encoding::Scanner::Sse(SseScanner::new(false))
            } else {
                encoding::Scanner::Json(JsonUsageScanner::new())
            };
            self.scan = match DecodingScanner::new(coding, scanner) {
                Some(d) => Scan::Decoding(d),
                None => Scan::Unreadable,
            };
            return Action::Continue;
        }
        if content_type.starts_with("text/event-stream") {
            self.scan = Scan::Sse(SseScanner::new(self.strip_usage_event));
            if self.strip_usage_event {
                let _ = hostcalls::set_map_value(
                    proxy_wasm::types::MapType::HttpResponseHeaders,
                    "content-length",
                    None,
                );
            }
        } else if content_type.contains("json") {
            self.scan = Scan::Json(JsonUsageScanner::new());
        }
        Action::Continue
    }

    fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if matches!(self.scan, Scan::None) {
            if end_of_stream {
                self.settle();
            }
            return Action::Continue;
        }
        if matches!(self.scan, Scan::Unreadable) {
            if end_of_stream {
                self.settle();
            }
            return Action::Continue;
        }
        let chunk = read_buffer(proxy_wasm::types::BufferType::HttpResponseBody, body_size);
        match &mut self.scan {
            Scan::Json(s) => s.feed(&chunk),
            Scan::Decoding(d) => d.feed(&chunk),
            Scan::Sse(s) => {
                let forward = s.feed(&chunk);
                let held = if end_of_stream {
                    s.finish().0
                } else {
                    Vec::new()
                };
                // Only a stripped (or held-back) stream is rewritten; otherwise the chunk Envoy
                // already has goes on untouched, with no copy.
                let replacement: Option<Vec<u8>> = match forward {
                    std::borrow::Cow::Owned(mut out) => {
                        out.extend_from_slice(&held);
                        Some(out)
                    }
                    std::borrow::Cow::Borrowed(b) if !held.is_empty() => {
                        let mut out = Vec::with_capacity(b.len() + held.len());
                        out.extend_from_slice(b);
                        out.extend_from_slice(&held);
                        Some(out)
                    }
                    std::borrow::Cow::Borrowed(_) => None,
                };
                if let Some(out) = replacement {
                    let _ = hostcalls::set_buffer(
                        proxy_wasm::types::BufferType::HttpResponseBody,
                        0,
                        body_size,
                        &out,
                    );
                }
            }
            Scan::None | Scan::Unreadable => {}
        }
        if end_of_stream {
            self.settle();
        }
        Action::Continue
    }

    /// Settles the token reservation to what the response showed (once).
    fn settle(&mut self) {
        if self.settled {
            return;
        }
        self.settled = true;
        let Some(res) = self.reservation.take() else {
            return;
        };
        let (usage, content_events) = match &mut self.scan {
            Scan::Json(s) => (s.finish(), 0),
            Scan::Sse(s) => (s.usage(), s.content_events()),
            Scan::Decoding(d) => d.finish(),
            Scan::None | Scan::Unreadable => (None, 0),
        };
        if usage.is_none() && self.response_status == 200 && !matches!(self.scan, Scan::None) {
            inc(self.worker.borrow().metrics.malformed_upstream, 1);
            log(
                LogLevel::Warn,
                &format!(
                    "maas: no usage in a {} response from model {}",
                    self.response_status,
                    self.model().map(|m| m.name.as_str()).unwrap_or("-")
                ),
            );
        }
        let seen = Seen {
            usage,
            content_events,
            status: self.response_status,
            prompt_tokens_estimate: self.prompt_tokens_estimate,
        };
        let actual = decide::settle_amount(&seen, res.reserved);
        limits::settle(&HostStore, &res, actual, now_ms() / 1000);
        if let (Some(u), Some(m)) = (usage, self.model()) {
            self.worker.borrow_mut().metrics.tokens(
                &res.tier,
                &m.name,
                u.prompt_tokens,
                u.completion_tokens,
            );
        }
    }

    /// The companion answered our authenticate callout: cache, then wake this request and the
    /// requests of this worker waiting for the same credential.
    fn on_auth_response(&mut self, body_size: usize) {
        let Some(identity) = self.identity.clone() else {
            return;
        };
        let (cfg, metrics_latency, metrics_failed) = {
            let w = self.worker.borrow();
            (
                w.config.clone(),
                w.metrics.callout_latency,
                w.metrics.callout_failed,
            )
        };
        let Some(cfg) = cfg else { return };
        let now = now_ms();
        if metrics_latency != 0 {
            let _ = hostcalls::record_metric(
                metrics_latency,
                now.saturating_sub(self.callout_started_ms),
            );
        }
        let status = map_value(
            proxy_wasm::types::MapType::HttpCallResponseHeaders,
            ":status",
        )
        .and_then(|s| s.parse::<u32>().ok());
        let body = read_buffer(
            proxy_wasm::types::BufferType::HttpCallResponseBody,
            body_size,
        );
        let now_s = now / 1000;
        let store = HostStore;
        let result: Result<CachedIdentity, Refusal> = match status {
            Some(200) => match serde_json::from_slice::<AuthenticateResponse>(&body) {
                Ok(resp) => {
                    let id = CachedIdentity::from_response(&resp);
                    let ttl = cache::positive_ttl(&resp, cfg.cache.max_ttl_seconds, now_s);
                    cache::insert(
                        &store,
                        &identity.cache_key,
                        &identity.verifier,
                        &CachedAnswer::Allow(id.clone()),
                        ttl,
                        now_s,
                        cfg.cache.max_entries,
                    );
                    Ok(id)
                }
                Err(e) => {
                    log(
                        LogLevel::Error,
                        &format!("maas: unreadable authenticate answer from the companion: {e}"),
                    );
                    Err(Refusal::unavailable(
                        "auth_unavailable",
                        "authentication service answered badly",
                    ))
                }
            },
            Some(s @ (401 | 403)) => {
                let message = serde_json::from_slice::<ErrorBody>(&body)
                    .map(|b| b.error.message)
                    .unwrap_or_else(|_| "invalid credential".to_string());
                let message: String = message.chars().take(200).collect();
                cache::insert(
                    &store,
                    &identity.cache_key,
                    &identity.verifier,
                    &CachedAnswer::Deny {
                        status: s as u16,
                        message: message.clone(),
                    },
                    cfg.cache.negative_ttl_seconds,
                    now_s,
                    cfg.cache.max_entries,
                );
                Err(Refusal::from_companion(s, &message))
            }
            other => {
                inc(metrics_failed, 1);
                // Another worker may have cached an answer meanwhile.
                match cache::lookup(
                    &store,
                    &identity.cache_key,
                    &identity.verifier,
                    now_s,
                    cfg.cache.max_entries,
                ) {
                    Some(CachedAnswer::Allow(id)) => Ok(id),
                    Some(CachedAnswer::Deny { status, message }) => {
                        Err(Refusal::from_companion(u32::from(status), &message))
                    }
                    None => {
                        log(
                            LogLevel::Warn,
                            &format!("maas: authentication service unavailable (status {other:?})"),
                        );
                        Err(Refusal::unavailable(
                            "auth_unavailable",
                            "authentication service unavailable; retry shortly",
                        ))
                    }
                }
            }
        };
        let waiters = self
            .worker
            .borrow_mut()
            .waiting
            .remove(&identity.flight_key())
            .unwrap_or_default();
        self.apply_auth(result.clone());
        for w in waiters {
            let Ok(mut waiter) = w.try_borrow_mut() else {
                continue;
            };
            if hostcalls::set_effective_context(waiter.id).is_ok() {
                // Checked again before the answer is applied: only the very same credential
                // may take it.
                let same = waiter
                    .identity
                    .as_ref()
                    .is_some_and(|i| i.same_credential(&identity));
                if same {
                    waiter.apply_auth(result.clone());
                } else {
                    waiter.apply_auth(Err(Refusal::unavailable(
                        "auth_interrupted",
                        "authentication was interrupted; retry",
                    )));
                }
            }
        }
        let _ = hostcalls::set_effective_context(self.id);
    }

    /// The stream ends: settle from what was seen; hand waiters of our callout an answer.
    fn on_done(&mut self) {
        self.settle();
        if let AuthState::Pending { token: Some(_) } = self.auth
            && let Some(identity) = &self.identity
        {
            // Our callout dies with this stream; requests waiting for it must not hang.
            let waiters = self
                .worker
                .borrow_mut()
                .waiting
                .remove(&identity.flight_key())
                .unwrap_or_default();
            let r =
                Refusal::unavailable("auth_interrupted", "authentication was interrupted; retry");
            for w in waiters {
                let Ok(mut waiter) = w.try_borrow_mut() else {
                    continue;
                };
                if hostcalls::set_effective_context(waiter.id).is_ok() {
                    waiter.apply_auth(Err(r.clone()));
                }
            }
            let _ = hostcalls::set_effective_context(self.id);
        }
    }
}

/// The refusal (429, 400 or 503) for a refused admission.
fn limited_refusal(a: Admission) -> Refusal {
    a.into_refusal()
        .unwrap_or_else(|| Refusal::unavailable("internal", "admission refused without a reason"))
}

/// The HTTP context: a handle on the request's state (waiters are woken through it).
struct Http {
    req: Rc<RefCell<Request>>,
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Ok(mut req) = self.req.try_borrow_mut() else {
            return;
        };
        req.on_auth_response(body_size);
    }

    fn on_done(&mut self) -> bool {
        if let Ok(mut req) = self.req.try_borrow_mut() {
            req.on_done();
        }
        // A waiter that goes away leaves the waiters' list.
        if let Ok(req) = self.req.try_borrow()
            && matches!(req.auth, AuthState::Pending { token: None })
            && let Some(identity) = &req.identity
        {
            let key = identity.flight_key();
            let worker = req.worker.clone();
            drop(req);
            if let Some(list) = worker.borrow_mut().waiting.get_mut(&key) {
                list.retain(|w| !Rc::ptr_eq(w, &self.req));
            }
        }
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let action = match self.req.try_borrow_mut() {
            Ok(mut req) => req.on_headers(end_of_stream),
            Err(_) => refuse_undecidable(),
        };
        // A request that waits for the companion joins the worker's waiters for its credential
        // (the handle is needed to resume it from the request that made the callout).
        if let Ok(req) = self.req.try_borrow()
            && matches!(req.auth, AuthState::Pending { token: None })
            && let Some(identity) = &req.identity
        {
            let key = identity.flight_key();
            let worker = req.worker.clone();
            drop(req);
            if let Some(list) = worker.borrow_mut().waiting.get_mut(&key) {
                list.push(self.req.clone());
            }
        }
        action
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.req.try_borrow_mut() {
            Ok(mut req) => req.on_body(body_size, end_of_stream),
            Err(_) => refuse_undecidable(),
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        match self.req.try_borrow_mut() {
            Ok(mut req) => req.on_trailers(),
            Err(_) => refuse_undecidable(),
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        match self.req.try_borrow_mut() {
            Ok(mut req) => req.on_response_headers(),
            Err(_) => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.req.try_borrow_mut() {
            Ok(mut req) => req.on_response_body(body_size, end_of_stream),
            Err(_) => Action::Continue,
        }
    }

    fn on_log(&mut self) {
        if let Ok(mut req) = self.req.try_borrow_mut() {
            req.settle();
        }
    }
}

/// A request whose state cannot be read is refused, never let through (an auth filter that
/// cannot decide must not continue).
fn refuse_undecidable() -> Action {
    let r = Refusal::internal("the gateway could not decide on this request; retry");
    let _ = hostcalls::send_http_response(
        r.status,
        vec![("content-type", "application/json")],
        Some(&r.body()),
    );
    Action::Pause
}

/// The first `size` bytes of a host buffer; empty when there are none or the host refuses.
fn read_buffer(kind: proxy_wasm::types::BufferType, size: usize) -> Vec<u8> {
    if size == 0 {
        return Vec::new();
    }
    hostcalls::get_buffer(kind, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}
