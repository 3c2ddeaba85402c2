//! One HTTP request's life as a state machine over the [`Host`]: the proxy-wasm adapter calls
//! the [`Http`] handle's callbacks, which move the request through its [`Phase`]s. Decisions are
//! the plain functions of the other modules; this module sequences them and is where the host is
//! touched. The response side (scanning, settlement) is in `respond`.
//!
//! ```text
//! Headers ──management path──────────────────────────────────────────────▶ PassedThrough
//!    │ refusal (path, policy, model, operation, credential, revoked, cached deny, dispatch)
//!    ├─────────────────────────────────────────────────────────────────────▶ Refused
//!    │ cache miss: own callout, or wait for this worker's callout of the same credential
//!    ├──▶ Authenticating ──answer (or interruption) refused──────────────────▶ Refused
//!    │          │ allowed
//!    ▼          ▼
//! authorised: tier, provider key, upstream, hygiene ──refused──────────────▶ Refused
//!    │ body to read                          │ no body (or body already read while held)
//!    ▼                                       │
//! BodyBuffering ──END_STREAM / trailers──▶ admission (model field, limits) ─▶ Refused
//!                                            │ lease short (global limits): ──▶ Leasing ──▶ Refused
//!                                            │    one POST /internal/v1/leases    │ granted: admitted
//!                                            │ allowed ◀──────────────────────────┘ (resumed)
//!                                            ▼
//!                      Forwarding ──response headers──▶ Responding
//!                          │ end / client gone             │ end of body / on_log / on_done
//!                          └──────────────▶ Settled ◀──────┘
//! ```

use crate::authenticate::{self, AUTHENTICATE_PATH};
use crate::cache::{self, CachedAnswer, CachedIdentity, Caller};
use crate::credential::{self, CacheIdentity};
use crate::decide;
use crate::host::{Body, HeaderMap, Headers, Host, read_body};
use crate::hygiene;
use crate::lease;
use crate::limits::{self, Admission, LeaseNeed, RateHeaders, Reservation};
use crate::operations;
use crate::path::{self, PathClass};
use crate::request_body::{self, RequestInfo};
use crate::response::{Decision, Refusal};
use crate::worker::SharedWorker;
pub use leasing::{LeaseFlight, answer_flight, dispatch_pending};
use maas_types::{AuthenticateRequest, Model, PolicyDocument, Tier};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::{Rc, Weak};

mod handle;
mod leasing;
mod respond;
pub use handle::Http;
pub use respond::Scan;

/// Whose callout an authenticating request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// This request dispatched the callout (its answer comes on this context).
    OwnCallout,
    /// Another request of this worker is asking for the very same credential.
    OtherRequest,
}

/// Where a request is in its life.
#[derive(Debug)]
pub enum Phase {
    /// Before the request headers.
    Headers,
    /// A management path: passed with the client's `x-maas-*` removed, nothing more to do.
    PassedThrough,
    /// The headers wait for the companion's answer (the body may be buffered meanwhile when the
    /// headers are held for it).
    Authenticating { waiting: Waiting },
    /// Authorised and the headers decided; the body is buffered until its end (END_STREAM or
    /// trailers). `headers_held`: the headers wait for the body decision (pauseHeadersForBody).
    BodyBuffering { headers_held: bool },
    /// Global limits: the subject's lease is short; the request (headers or body, paused) waits
    /// for the answer to a `POST /internal/v1/leases` (nothing counted yet): its own (`own`), or
    /// the one another request of this worker made for the same subject.
    Leasing,
    /// Admitted and forwarded (`reservation`: the tokens taken; none for discovery).
    Forwarding {
        reservation: Option<Reservation>,
        rate_headers: RateHeaders,
    },
    /// The response is passing; its usage is read as it goes.
    Responding {
        reservation: Reservation,
        status: u32,
        scan: Box<Scan>,
    },
    /// The reservation was settled (or there was none): nothing more to do.
    Settled,
    /// Answered with a local error.
    Refused,
}

#[derive(Debug)]
enum BodyState {
    None,
    Buffering,
    Done(Result<RequestInfo, String>),
}

/// A callout this request made and that has not been answered yet.
#[derive(Debug, Clone, Copy)]
struct Flight {
    started_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Let the request go on (headers, or everything).
    Continue,
    /// The headers wait (companion, or the body while held).
    Wait,
    /// Answered with an error.
    Refused,
}

/// One HTTP request's state.
#[derive(Debug)]
pub struct Request {
    id: u32,
    worker: SharedWorker,
    phase: Phase,
    /// The policy the request was decided with, and the model's and tier's index in it.
    policy: Option<Rc<PolicyDocument>>,
    model_idx: Option<usize>,
    tier_idx: Option<usize>,
    /// The subject's own highest tier (its windows apply to every request of the subject).
    highest_tier_idx: Option<usize>,
    /// Whose counters the request counts in: under a subscription
    /// `maas_types::subscription::counter_subject` (per subject, subscription and model);
    /// `None`: the subject's own.
    counter_subject: Option<Rc<str>>,
    /// The subscription the request runs under (`decide::subscription`), if any: its limits on
    /// the model as a tier (`sub_tier`) replace the tiers' windows.
    subscription: Option<String>,
    sub_tier: Option<Tier>,
    subject: Option<Rc<str>>,
    /// The shared-data key of the subject's counter slot (hashed once per request, or shared
    /// with the worker's copy of the credential).
    counter_key: SlotKey,
    /// The counter slot as the precheck read it (admission starts from it).
    slot_read: Option<limits::SlotRead>,
    /// The request headers as read once (the client's `X-MaaS-Subscription`, what to strip),
    /// kept until the headers are decided (possibly after the companion answered).
    request_headers: HeaderMap,
    discovery: bool,
    /// The operation accepts `stream_options` (OpenAI chat/completions and completions).
    accepts_stream_options: bool,
    /// The operation is a JSON API whose body is always inspected.
    always_inspect_body: bool,
    /// The body field that caps the operation's output (`Operation::cap_field`).
    cap_field: Option<&'static str>,
    /// The body kept from its end to admission: one that names no cap (admission sets the
    /// one it reserves), or one rewritten (`stream_options`) and not written yet, so a body is
    /// written once whatever is changed in it.
    pending_body: Option<PendingBody>,
    identity: Option<CacheIdentity>,
    flight: Option<Flight>,
    body: BodyState,
    /// pluginConfig `pauseHeadersForBody`: headers wait for the body decision.
    hold_headers: bool,
    /// The request carries `X-MaaS-Subscription` (counted with the other headers' first read).
    subscription_header: bool,
    /// Bytes of the request body buffered so far (the host's buffer size at the last chunk).
    buffered_body_bytes: usize,
    /// The request's one `content-length` (none with `transfer-encoding`, several or a value
    /// that is not plain digits): a body that reaches it is whole, and is decided at once.
    declared_body_bytes: Option<usize>,
    /// The body was decided when it reached its declared length, before END_STREAM.
    body_decided_early: bool,
    strip_usage_event: bool,
    /// The prompt estimate reserved at admission (settles an aborted stream).
    prompt_tokens_estimate: u64,
    /// The raw tokens reserved at admission (input: the prompt estimate, output: the completion
    /// budget), and the weights that turned them into the limits' unit.
    reserved_tokens: decide::Tokens,
    token_weights: maas_types::TokenWeights,
    /// An operation that generates nothing (Anthropic `count_tokens`): a request in the
    /// request windows, no token reserved or settled, its response not scanned.
    unmetered: bool,
    /// The 429 to answer when the lease stays short (kept by the last admission).
    lease_limited: Option<Admission>,
    /// What this request still needs while it waits for the root's flight.
    lease_needs: Vec<LeaseNeed>,
    /// Lease flights this request waited for (bounded: then 429).
    lease_rounds: u8,
    /// This request's own handle (set by [`Http::new`]): it joins the worker's lease flights.
    me: Weak<RefCell<Request>>,
}

/// A request body kept from its end until admission.
#[derive(Debug)]
struct PendingBody {
    bytes: Vec<u8>,
    /// Not what the host holds yet (written when the request is forwarded).
    rewritten: bool,
}

/// What admission decided when it did not refuse.
enum Admitted {
    /// Forward (the reservation; none for discovery).
    Forward(Option<(Reservation, RateHeaders)>),
    /// Global limits: the lease is short (nothing counted).
    Short {
        items: Vec<LeaseNeed>,
        limited: Admission,
    },
}

impl Request {
    pub fn new(id: u32, worker: SharedWorker) -> Self {
        Request {
            id,
            worker,
            phase: Phase::Headers,
            policy: None,
            model_idx: None,
            tier_idx: None,
            highest_tier_idx: None,
            counter_subject: None,
            subscription: None,
            sub_tier: None,
            subject: None,
            counter_key: SlotKey::default(),
            slot_read: None,
            request_headers: HeaderMap::default(),
            discovery: false,
            accepts_stream_options: false,
            always_inspect_body: false,
            cap_field: None,
            pending_body: None,
            identity: None,
            flight: None,
            body: BodyState::None,
            hold_headers: false,
            subscription_header: false,
            buffered_body_bytes: 0,
            declared_body_bytes: None,
            body_decided_early: false,
            strip_usage_event: false,
            prompt_tokens_estimate: 0,
            reserved_tokens: decide::Tokens::default(),
            token_weights: maas_types::TokenWeights::default(),
            unmetered: false,
            lease_limited: None,
            lease_needs: Vec::new(),
            lease_rounds: 0,
            me: Weak::new(),
        }
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// A callback of this request runs: a callout dispatched now answers here.
    fn enter(&self) {
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.active = self.id;
        }
    }

    fn config(&self) -> Option<Rc<crate::config::PluginConfig>> {
        self.worker.borrow().config.clone()
    }

    fn model(&self) -> Option<&Model> {
        self.policy.as_ref()?.models.get(self.model_idx?)
    }

    fn decided(&self) -> bool {
        !matches!(
            self.phase,
            Phase::Headers
                | Phase::Authenticating { .. }
                | Phase::BodyBuffering { .. }
                | Phase::Leasing
        )
    }

    /// Whose counters this request counts in (and whose lease it asks for): the counter subject
    /// of its subscription, else the subject's own.
    fn limits_subject(&self) -> Option<Rc<str>> {
        self.counter_subject
            .clone()
            .or_else(|| self.subject.clone())
    }

    /// Answers the request with an error (on the effective context).
    fn refuse(&mut self, host: &dyn Host, r: &Refusal) {
        self.phase = Phase::Refused;
        self.worker.borrow().metrics.decision(r.decision);
        // The usage ledger counts refusals of a known subject (in the VM only).
        self.ledger_refused(r.code);
        host.send_response(r.status, &r.response_headers(), &r.body());
    }

    fn refused(&mut self, host: &dyn Host, r: &Refusal) -> Action {
        self.refuse(host, r);
        Action::Pause
    }

    /// Request headers: everything that can be decided without waiting.
    fn on_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        let Some(cfg) = self.config() else {
            return self.refused(host, &Refusal::not_configured());
        };
        // One host call for every header (the path, the credential, what to strip).
        let headers = host.headers(Headers::Request);
        let [
            (full_path, _),
            (method, _),
            (authorization, _),
            (x_api_key, _),
            (content_type, _),
            content_length,
            (transfer_encoding, _),
            (_, subscriptions),
        ] = headers.get_each_counted([
            ":path",
            ":method",
            "authorization",
            "x-api-key",
            "content-type",
            "content-length",
            "transfer-encoding",
            SUBSCRIPTION_HEADER,
        ]);
        // Most requests name no subscription: then its values are never looked for again.
        self.subscription_header = subscriptions > 0;
        let full_path = full_path.unwrap_or_default();
        let model_path = match path::classify(full_path, &cfg.management_path_prefix) {
            Ok(PathClass::Model(p)) => p,
            Ok(PathClass::Management) => {
                // The companion authenticates these itself; only the reserved namespace (and a
                // credential header spelt with `_`) goes, in every spelling.
                for name in headers.names() {
                    if hygiene::strip_for_management(name) {
                        host.set_header(Headers::Request, name, None);
                    }
                }
                self.phase = Phase::PassedThrough;
                return Action::Continue;
            }
            Err(e) => return self.refused(host, &e.into()),
        };
        let policy = self.worker.borrow().policy.clone();
        let Some(policy) = policy else {
            return self.refused(host, &Refusal::no_policy());
        };
        let Some(model) = policy.model_for_path(model_path) else {
            return self.refused(host, &Refusal::model_not_found());
        };
        // Only the model's allow-listed (method, path) pairs go on (404 otherwise).
        let method = method.unwrap_or_default();
        let operation = match operations::allowed(model, method, model_path) {
            Ok(op) => op,
            Err(r) => return self.refused(host, &r),
        };
        self.discovery = operation.is_discovery();
        self.unmetered = operation.is_unmetered();
        self.accepts_stream_options = operation.accepts_stream_options();
        // The metered JSON APIs are read whatever content-type the client claims (a backend may
        // parse the body as JSON anyway); only custom operations may stream uploads unread.
        self.always_inspect_body = operation != operations::Operation::Custom;
        self.cap_field = operation.cap_field(model.provider.as_ref().map(|p| p.kind));
        self.model_idx = policy.models.iter().position(|m| std::ptr::eq(m, model));
        self.policy = Some(policy.clone());
        let cred = match credential::extract(authorization, x_api_key) {
            Ok(c) => c,
            Err(e) => return self.refused(host, &e.into()),
        };
        if let Some(key_id) = cred.key_id()
            && self.worker.borrow().revoked.contains(key_id)
        {
            let cache_key = credential::api_key_cache_key(key_id);
            cache::evict(host, &cache_key, cfg.cache.max_entries);
            return self.refused(host, &Refusal::unauthenticated("key revoked"));
        }
        if !end_of_stream && (self.always_inspect_body || hygiene::inspect_body(content_type)) {
            self.body = BodyState::Buffering;
            // Unless this worker found that Envoy would never hand the held body over.
            self.hold_headers = cfg.pause_headers_for_body && !self.worker.borrow().held.missing();
            self.declared_body_bytes = match (content_length, transfer_encoding) {
                ((Some(value), 1), None) => declared_length(value),
                _ => None,
            };
        }
        let now_s = host.now_ms() / 1000;
        // This worker's copy first (no shared-data read, no SHA-256, nothing copied), then the
        // shared cache.
        let local_key = self.worker.borrow().local_cache.key(cred.raw());
        let local = self.worker.borrow().local_cache.get(local_key, now_s);
        let (identity, cached) = match local {
            Some((caller, counter_key, identity)) => {
                self.counter_key = SlotKey::Shared(counter_key);
                (identity, Some(Ok(caller)))
            }
            None => {
                let identity = cred.cache_identity();
                let cached = match cache::lookup_entry(
                    host,
                    &identity.cache_key,
                    &identity.verifier,
                    now_s,
                    cfg.cache.max_entries,
                ) {
                    Some((CachedAnswer::Allow(id), expires_at)) => {
                        let caller = Caller::new(id);
                        self.worker.borrow_mut().local_cache.put(
                            (local_key, &identity),
                            &caller,
                            || limits::counter_key(&caller.subject, cfg.limits.counter_slots),
                            expires_at,
                            cfg.poll_interval_ms / 1000,
                            now_s,
                        );
                        Some(Ok(caller))
                    }
                    Some((answer, _)) => Some(authenticate::cached_result(answer)),
                    None => None,
                };
                (identity, cached)
            }
        };
        let step = match cached {
            Some(result) => {
                {
                    let w = self.worker.borrow();
                    w.metrics.inc(w.metrics.cache_hit, 1);
                }
                self.identity = Some(identity);
                self.request_headers = headers;
                self.authenticated(host, result, now_s)
            }
            None => {
                let flight_key = identity.flight_key();
                let already = {
                    let w = self.worker.borrow();
                    w.metrics.inc(w.metrics.cache_miss, 1);
                    w.waiting.contains_key(&flight_key)
                };
                if already {
                    self.phase = Phase::Authenticating {
                        waiting: Waiting::OtherRequest,
                    };
                } else {
                    let body = serde_json::to_vec(&AuthenticateRequest {
                        credential: cred.raw().to_string(),
                    })
                    .unwrap_or_default();
                    let call = host.dispatch(
                        &cfg.companion.cluster,
                        &[
                            (":method", "POST"),
                            (":path", AUTHENTICATE_PATH),
                            (":authority", cfg.companion.authority.as_str()),
                            ("content-type", "application/json"),
                        ],
                        Some(&body),
                        cfg.companion.timeout_ms,
                    );
                    let mut w = self.worker.borrow_mut();
                    match call {
                        Ok(_token) => {
                            w.metrics.inc(w.metrics.callouts, 1);
                            w.waiting.insert(flight_key, Vec::new());
                            drop(w);
                            self.flight = Some(Flight {
                                started_ms: host.now_ms(),
                            });
                            self.phase = Phase::Authenticating {
                                waiting: Waiting::OwnCallout,
                            };
                        }
                        Err(e) => {
                            log::warn!("maas: cannot call the companion: {e}");
                            w.metrics.inc(w.metrics.callout_failed, 1);
                            drop(w);
                            return self.refused(
                                host,
                                &Refusal::auth_unavailable("authentication service unavailable"),
                            );
                        }
                    }
                }
                self.identity = Some(identity);
                self.request_headers = headers;
                Step::Wait
            }
        };
        match step {
            Step::Continue => Action::Continue,
            Step::Wait | Step::Refused => Action::Pause,
        }
    }

    /// The caller's authentication is known: refuse, or authorise and go as far as the body
    /// allows.
    /// `now_s`: the clock read by the callback this runs in.
    fn authenticated(
        &mut self,
        host: &dyn Host,
        result: Result<Caller, Refusal>,
        now_s: u64,
    ) -> Step {
        let caller = match result {
            Ok(c) => c,
            Err(r) => {
                self.refuse(host, &r);
                return Step::Refused;
            }
        };
        if let Err(r) = self.decide_headers(host, &caller.identity, now_s) {
            self.ledger_refused_as(&caller.identity, r.code);
            self.refuse(host, &r);
            return Step::Refused;
        }
        // Decided: the headers are not read again.
        self.request_headers = HeaderMap::default();
        self.subject = Some(caller.subject);
        if matches!(self.body, BodyState::Buffering) {
            // Envoy (without `allow_on_headers_stop_iteration`) hands the body over only after
            // the headers continue: they go on now, unless held for the body.
            if self.hold_headers && self.worker.borrow().held.missing() {
                // Found out while this request waited for the companion.
                self.stop_holding(host);
            }
            self.phase = Phase::BodyBuffering {
                headers_held: self.hold_headers,
            };
            if !self.hold_headers {
                return Step::Continue;
            }
            if self.buffered_body_bytes == 0 {
                self.worker
                    .borrow_mut()
                    .held
                    .watch(self.id, self.me.clone());
            }
            return Step::Wait;
        }
        self.admit(host, now_s)
    }

    /// The body is known (or there is none): the model field and the limits.
    fn admit(&mut self, host: &dyn Host, now_s: u64) -> Step {
        match self.decide_body(host, now_s) {
            Ok(Admitted::Forward(reservation)) => self.forward(host, reservation),
            Ok(Admitted::Short { items, .. }) => self.ask_lease(host, items, now_s),
            Err(r) => {
                self.refuse(host, &r);
                Step::Refused
            }
        }
    }

    fn forward(
        &mut self,
        host: &dyn Host,
        reservation: Option<(Reservation, RateHeaders)>,
    ) -> Step {
        // A body changed after its end (its cap, `stream_options`) is written once, now.
        if let Some(p) = self.pending_body.take().filter(|p| p.rewritten) {
            self.replace_body(host, &p.bytes);
        }
        let (reservation, rate_headers) = match reservation {
            Some((r, h)) => (Some(r), h),
            None => (None, RateHeaders::default()),
        };
        self.phase = Phase::Forwarding {
            reservation,
            rate_headers,
        };
        self.worker.borrow().metrics.decision(Decision::Allowed);
        Step::Continue
    }

    /// The headers go on before the body after all (this worker found Envoy does not hand a held
    /// body over): what the default mode does when the headers leave first. The body may be
    /// rewritten later, so the upstream codec frames it (`content-length` removed).
    fn stop_holding(&mut self, host: &dyn Host) {
        self.hold_headers = false;
        if matches!(self.body, BodyState::Buffering) && !self.discovery {
            host.set_header(Headers::Request, "content-length", None);
        }
        if let Phase::BodyBuffering { headers_held } = &mut self.phase {
            *headers_held = false;
        }
    }

    /// Holding its headers, this request waits for a body that has not reached the filter.
    fn waits_for_held_body(&self) -> bool {
        matches!(self.phase, Phase::BodyBuffering { headers_held: true })
            && self.buffered_body_bytes == 0
    }

    /// Request body chunk (buffered until the end, or until it reaches its declared length).
    fn on_body(&mut self, host: &dyn Host, body_size: usize, end_of_stream: bool) -> Action {
        if self.hold_headers {
            // The body of a request whose headers are held reached the filter.
            self.worker.borrow_mut().held.confirm();
        }
        if self.body_decided_early {
            return self.after_early_body();
        }
        if self.decided() || !matches!(self.body, BodyState::Buffering) {
            return Action::Continue;
        }
        let Some(cfg) = self.config() else {
            return self.refused(host, &Refusal::not_configured());
        };
        if body_size as u64 > cfg.max_request_body_bytes {
            return self.refused(host, &Refusal::too_large(cfg.max_request_body_bytes));
        }
        self.buffered_body_bytes = body_size;
        if !end_of_stream {
            // The whole declared body is here (Envoy's codecs hold a request to its
            // `content-length`): decided now, without holding it to END_STREAM. Only once the
            // caller is authorised; while authenticating the answer decides.
            if self.declared_body_bytes == Some(body_size)
                && matches!(self.phase, Phase::BodyBuffering { .. })
            {
                self.body_decided_early = true;
                return self.end_of_body(host);
            }
            return Action::Pause;
        }
        self.end_of_body(host)
    }

    /// A body chunk, trailers or the end of the stream after the body was decided at its
    /// declared length: a request that still waits (lease) or was refused stays paused, any
    /// other goes on. Envoy's codecs end the body there: HTTP/1.1 frames it by its length (what
    /// follows is the next request), HTTP/2 resets a stream whose DATA exceed it.
    fn after_early_body(&self) -> Action {
        // Only a request decided and let through goes on: any phase still deciding pauses.
        if !self.decided() || matches!(self.phase, Phase::Refused) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// Request trailers end the request: an HTTP/2 body whose last DATA frame has no END_STREAM
    /// (or an HTTP/1.1 chunked body with trailers) is decided here, exactly as at the end of a
    /// body, so no request reaches the backend undecided.
    fn on_trailers(&mut self, host: &dyn Host) -> Action {
        if self.hold_headers {
            self.worker.borrow_mut().held.confirm();
        }
        if self.body_decided_early {
            return self.after_early_body();
        }
        if self.decided() || !matches!(self.body, BodyState::Buffering) {
            return Action::Continue;
        }
        self.end_of_body(host)
    }

    /// The whole request body is buffered: inspect it (and rewrite it where the API accepts
    /// `stream_options`), then decide if the caller is already authorised.
    fn end_of_body(&mut self, host: &dyn Host) -> Action {
        let body_size = self.buffered_body_bytes;
        let bytes = read_body(host, Body::Request, body_size);
        if bytes.len() != body_size {
            return self.refused(
                host,
                &Refusal::internal("the gateway could not read the request body; retry"),
            );
        }
        let info = request_body::inspect(&bytes).map_err(|e| e.to_string());
        if let Ok(i) = &info
            && i.stream
            && !i.include_usage
            && !self.discovery
            && self.accepts_stream_options
            // Ask for usage so the stream can be counted (only APIs that accept
            // `stream_options`); the usage-only event is removed from what the client sees.
            // `inspect` accepted the body just above: splice without parsing it again.
            && let Ok(new_body) = request_body::splice_include_usage(&bytes)
        {
            self.strip_usage_event = true;
            if self.may_take_a_cap(&info) {
                // Written at admission, with the cap it may set (one write).
                self.pending_body = Some(PendingBody {
                    bytes: new_body,
                    rewritten: true,
                });
            } else {
                self.replace_body(host, &new_body);
            }
        } else if self.may_take_a_cap(&info) {
            self.pending_body = Some(PendingBody {
                bytes,
                rewritten: false,
            });
        }
        self.body = BodyState::Done(info);
        if !matches!(self.phase, Phase::BodyBuffering { .. }) {
            // Still authenticating (headers held): the answer decides.
            return Action::Pause;
        }
        match self.admit(host, host.now_ms() / 1000) {
            Step::Continue => Action::Continue,
            Step::Wait | Step::Refused => Action::Pause,
        }
    }

    /// Replaces the whole buffered request body (held headers get its new length).
    fn replace_body(&mut self, host: &dyn Host, new_body: &[u8]) {
        host.set_body(Body::Request, self.buffered_body_bytes, new_body);
        self.buffered_body_bytes = new_body.len();
        if self.hold_headers {
            // Headers still held (allow_on_headers_stop_iteration): keep them exact.
            host.set_header(
                Headers::Request,
                "content-length",
                Some(&new_body.len().to_string()),
            );
        }
    }

    /// A body that names no cap, of an operation that has a cap field: admission may set the
    /// cap it reserves (no other body is kept past its end).
    fn may_take_a_cap(&self, info: &Result<RequestInfo, String>) -> bool {
        info.as_ref().is_ok_and(|i| i.max_tokens.is_none())
            && self.cap_field.is_some()
            && !self.discovery
            && !self.unmetered
    }

    /// The answer for this request's credential (its own callout's, or another request's).
    fn apply_auth(&mut self, host: &dyn Host, result: Result<Caller, Refusal>, now_s: u64) {
        if !matches!(self.phase, Phase::Authenticating { .. }) {
            return;
        }
        // The headers were paused for the answer.
        if self.authenticated(host, result, now_s) == Step::Continue {
            host.resume_request();
        }
    }

    /// `X-MaaS-Subscription` as the client sent it.
    pub(super) fn requested_subscription(&self) -> Option<&str> {
        if !self.subscription_header {
            return None;
        }
        requested_subscription(&self.request_headers)
    }

    /// Once the caller is known: authorise, check the provider credential, clean the headers
    /// (read once at the request headers, kept in the request until then).
    fn decide_headers(
        &mut self,
        host: &dyn Host,
        identity: &CachedIdentity,
        now_s: u64,
    ) -> Result<(), Refusal> {
        let headers = std::mem::take(&mut self.request_headers);
        let decided = self.decide_headers_from(host, identity, &headers, now_s);
        // Still read by a refusal's ledger record (the subscription asked for).
        self.request_headers = headers;
        decided
    }

    fn decide_headers_from(
        &mut self,
        host: &dyn Host,
        identity: &CachedIdentity,
        headers: &HeaderMap,
        now_s: u64,
    ) -> Result<(), Refusal> {
        let (cfg, policy, credentials) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.policy.clone(), w.credentials.clone())
        };
        let Some(cfg) = cfg else {
            return Err(Refusal::not_configured());
        };
        let Some(policy) = policy else {
            return Err(Refusal::no_policy());
        };
        // `X-MaaS-Subscription` as the client sent it (last non-empty value); never forwarded.
        let requested_subscription = if self.subscription_header {
            requested_subscription(headers)
        } else {
            None
        };
        // The policy may have changed while we waited: find the model again by name (the same
        // policy document: the model found at the headers stands).
        let same_policy = self.policy.as_ref().is_some_and(|p| Rc::ptr_eq(p, &policy));
        let model_idx = match self.model_idx {
            Some(i) if same_policy => Some(i),
            _ => {
                let name = self.model().map(|m| m.name.as_str()).unwrap_or_default();
                policy.models.iter().position(|m| m.name == name)
            }
        };
        let Some(model_idx) = model_idx else {
            return Err(Refusal::model_not_found());
        };
        let Some(model) = policy.models.get(model_idx) else {
            return Err(Refusal::model_not_found());
        };
        // A subscription's limits on the model (as a tier), counted per (subject, subscription,
        // model); else the tiers, one budget per person.
        let api_key = self.identity.as_ref().is_some_and(|i| i.key_id().is_some());
        let selected =
            decide::subscription(&policy, identity, api_key, requested_subscription, model)?;
        let sub_tier = match selected {
            Some(sub) => Some((
                sub.name.clone(),
                sub.limits_tier(&model.name).ok_or_else(|| {
                    Refusal::forbidden("model_not_in_subscription", "model not in subscription")
                })?,
                maas_types::subscription::counter_subject(
                    &identity.subject,
                    &sub.name,
                    &model.name,
                ),
            )),
            None => None,
        };
        let (tier_idx, highest_tier_idx) = match &sub_tier {
            Some(_) => (None, None),
            None => {
                let tier = decide::authorize(&policy, identity, model)?;
                // One budget per person: the subject's own highest tier's windows apply to every
                // request, a pinned (lower) tier's too.
                let highest = policy.resolve_tier(&identity.groups, None).unwrap_or(tier);
                (
                    policy.tiers.iter().position(|t| std::ptr::eq(t, tier)),
                    policy.tiers.iter().position(|t| std::ptr::eq(t, highest)),
                )
            }
        };
        let counter_subject = sub_tier
            .as_ref()
            .map_or(identity.subject.as_str(), |(_, _, c)| c.as_str());
        let tier_of = |idx: Option<usize>| idx.and_then(|i| policy.tiers.get(i));
        // The windows that apply (one or two tiers; no allocation for them).
        let (first, second) = match &sub_tier {
            Some((_, t, _)) => (Some(t), None),
            None => (tier_of(tier_idx), tier_of(highest_tier_idx)),
        };
        let (two, one): ([&Tier; 2], [&Tier; 1]);
        let windows: &[&Tier] = match (first, second) {
            (Some(a), Some(b)) => {
                two = [a, b];
                &two
            }
            (Some(a), None) | (None, Some(a)) => {
                one = [a];
                &one
            }
            (None, None) => &[],
        };
        // The counter slot, hashed once for the whole request (or known from the worker's copy
        // of the credential: the subject's own, so not under a subscription).
        let counter_key = if self.counter_key.is_empty() || sub_tier.is_some() {
            SlotKey::Own(limits::counter_key(
                counter_subject,
                cfg.limits.counter_slots,
            ))
        } else {
            std::mem::take(&mut self.counter_key)
        };
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
        let buffering = matches!(self.body, BodyState::Buffering);

        // Headers are about to leave before the body is read: refuse now what is certain
        // (a full request or token window), so that such a 429 starts no upstream request.
        if buffering && !self.hold_headers && !self.discovery {
            let folded = self
                .worker
                .borrow()
                .folds
                .pending(&counter_key, counter_subject);
            let (limited, read) = limits::precheck_folded(
                host,
                &counter_key,
                windows,
                counter_subject,
                now_s,
                &folded,
            );
            if let Some(limited) = limited {
                return Err(limited_refusal(limited));
            }
            // Admission starts from this read: no second read when nothing was written since.
            self.slot_read = read;
        }

        // The request must go to the model's own upstream (Envoy's route decided the cluster):
        // a route the gateway did not create never gets the provider credential.
        operations::check_upstream(model, || host.property(&operations::CLUSTER_PROPERTY))?;

        // Hygiene: nothing the client sent reaches the backend as identity.
        let mut client_anthropic_version = false;
        for name in headers.names() {
            if hygiene::strip_for_model(name, &cfg.remove_headers) {
                host.set_header(Headers::Request, name, None);
            } else if name.eq_ignore_ascii_case("anthropic-version") {
                client_anthropic_version = true;
            }
        }
        // Usage is read from the response body: ask the backend for it uncompressed (Envoy may
        // compress towards the client). A backend that compresses anyway is decoded for reading.
        host.set_header(Headers::Request, "accept-encoding", Some("identity"));
        if let Some((kind, key)) = provider_key {
            for (name, value) in hygiene::provider_headers(kind, key, client_anthropic_version) {
                host.set_header(Headers::Request, name, Some(&value));
            }
        }
        // The backend learns the subscription the gateway selected (as the reference's gateway
        // injects it), never the client's value (stripped above).
        if let Some((name, _, _)) = &sub_tier {
            host.set_header(Headers::Request, SUBSCRIPTION_HEADER, Some(name));
        }
        if buffering && !self.discovery && !self.hold_headers {
            // The body may be rewritten (stream_options.include_usage) after the headers left:
            // let the upstream codec frame it (chunked) instead of a length that may change.
            host.set_header(Headers::Request, "content-length", None);
        }
        self.counter_key = counter_key;
        self.model_idx = Some(model_idx);
        self.tier_idx = tier_idx;
        self.highest_tier_idx = highest_tier_idx;
        (self.subscription, self.sub_tier, self.counter_subject) = match sub_tier {
            Some((name, tier, counter)) => (Some(name), Some(tier), Some(Rc::from(counter))),
            None => (None, None, None),
        };
        self.policy = Some(policy);
        Ok(())
    }

    /// The model field and the limits; `Some` reservation unless discovery.
    fn decide_body(&mut self, host: &dyn Host, now_s: u64) -> Result<Admitted, Refusal> {
        let policy = self.policy.clone();
        let model = self.model();
        // Borrowed field by field (no copy of the subject or the subscription's tier).
        let tier = match &self.sub_tier {
            Some(t) => Some(t),
            None => policy
                .as_ref()
                .and_then(|p| p.tiers.get(self.tier_idx.unwrap_or(usize::MAX))),
        };
        // The limits' subject, as `limits_subject` says.
        let subject = self.counter_subject.as_deref().or(self.subject.as_deref());
        let (Some(model), Some(tier), Some(subject)) = (model, tier, subject) else {
            return Err(Refusal::no_policy());
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
            return Ok(Admitted::Forward(None));
        }
        let info = match &self.body {
            BodyState::Done(Ok(info)) => Some(info),
            _ => None,
        };
        // Under a subscription only its windows apply (highest: the same tier).
        let highest = policy
            .as_ref()
            .and_then(|p| p.tiers.get(self.highest_tier_idx.unwrap_or(usize::MAX)))
            .filter(|_| self.sub_tier.is_none())
            .unwrap_or(tier);
        // Tokens in the limits' unit: input and output weighted (the larger weights of the
        // tiers whose windows apply). An unmetered operation reserves none.
        self.token_weights = decide::weights(&[tier, highest]);
        (self.prompt_tokens_estimate, self.reserved_tokens) = if self.unmetered {
            (0, decide::Tokens::default())
        } else {
            (
                info.map_or(0, |i| i.prompt_tokens_estimate),
                decide::reservation(info, tier),
            )
        };
        // A body that names no cap is given the one reserved (unless the tier forwards it as
        // sent), so the backend generates no more; set before anything is counted, so a body
        // that cannot take it is refused with nothing to undo (written when forwarded).
        if let Some((field, value)) =
            info.and_then(|i| decide::injected_cap(i, self.cap_field, tier))
            && !self.unmetered
        {
            let Some(pending) = self.pending_body.as_mut() else {
                return Err(Refusal::internal(
                    "the gateway could not set the request's output cap; retry",
                ));
            };
            request_body::set_number_member(&mut pending.bytes, field, value)
                .map_err(|e| Refusal::bad_request("invalid_body", e.to_string()))?;
            pending.rewritten = true;
        }
        let reserve = self.reserved_tokens.weighted(self.token_weights);
        let lease_policy = {
            let w = self.worker.borrow();
            w.config
                .as_ref()
                .and_then(|c| lease::policy(c, &w.leases.state))
        };
        let tiers = [tier, highest];
        let folded = self
            .worker
            .borrow()
            .folds
            .pending(&self.counter_key, subject);
        let ask = limits::Ask {
            key: &self.counter_key,
            tiers: &tiers,
            subject,
            reserve,
            now: now_s,
            settled: &folded,
        };
        match limits::admit_leased(host, &ask, self.slot_read.take(), lease_policy.as_ref()) {
            Admission::Allowed {
                reservation,
                headers,
            } => {
                if limits::has_windows(&tiers) {
                    // Written with what was folded for the subject.
                    self.worker
                        .borrow_mut()
                        .folds
                        .admitted(&self.counter_key, subject);
                }
                if lease_policy.is_some() {
                    // The worker's batch reports this subject's debts and releases (in-VM only).
                    self.worker.borrow_mut().leases.track(
                        subject,
                        &self.counter_key,
                        || lease::counters(&tiers),
                        now_s.saturating_mul(1000),
                    );
                }
                Ok(Admitted::Forward(Some((reservation, headers))))
            }
            Admission::NeedsLease {
                items,
                kind,
                tier,
                headers,
            } => Ok(Admitted::Short {
                items,
                limited: Admission::NeedsLease {
                    items: Vec::new(),
                    kind,
                    tier,
                    headers,
                },
            }),
            refused => Err(limited_refusal(refused)),
        }
    }

    /// The companion answered this request's callout: cache, then wake this request and the
    /// requests of this worker waiting for the same credential.
    fn on_auth_response(&mut self, host: &dyn Host, body_size: usize) {
        let Some(identity) = self.identity.clone() else {
            return;
        };
        let (cfg, latency_metric) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.metrics.callout_latency)
        };
        let Some(cfg) = cfg else { return };
        let now = host.now_ms();
        let started = self.flight.take().map_or(now, |f| f.started_ms);
        if latency_metric != 0 {
            host.record_metric(latency_metric, now.saturating_sub(started));
        }
        let status = host
            .header(Headers::CallResponse, ":status")
            .and_then(|s| s.parse::<u32>().ok());
        let body = read_body(host, Body::CallResponse, body_size);
        let outcome =
            authenticate::interpret(host, &cfg.cache, &identity, status, &body, now / 1000);
        let waiters = {
            let mut w = self.worker.borrow_mut();
            if outcome.failed {
                w.metrics.inc(w.metrics.callout_failed, 1);
            }
            w.waiting.remove(&identity.flight_key()).unwrap_or_default()
        };
        self.apply_auth(host, outcome.result.clone(), now / 1000);
        for w in waiters {
            let Ok(mut waiter) = w.try_borrow_mut() else {
                continue;
            };
            if host.set_effective_context(waiter.id) {
                // Checked again before the answer is applied: only the very same credential
                // may take it.
                let same = waiter
                    .identity
                    .as_ref()
                    .is_some_and(|i| i.same_credential(&identity));
                if same {
                    waiter.apply_auth(host, outcome.result.clone(), now / 1000);
                } else {
                    waiter.apply_auth(host, Err(authenticate::interrupted()), now / 1000);
                }
            }
        }
        host.set_effective_context(self.id);
    }

    /// The stream ends: settle from what was seen; hand waiters of our unanswered callout an
    /// answer (Envoy cancels a callout with its stream).
    fn on_done(&mut self, host: &dyn Host) {
        self.leave_leasing();
        self.settle(host);
        if self.flight.take().is_some()
            && let Some(identity) = &self.identity
        {
            let waiters = self
                .worker
                .borrow_mut()
                .waiting
                .remove(&identity.flight_key())
                .unwrap_or_default();
            for w in waiters {
                let Ok(mut waiter) = w.try_borrow_mut() else {
                    continue;
                };
                if host.set_effective_context(waiter.id) {
                    // A refusal reads no clock.
                    waiter.apply_auth(host, Err(authenticate::interrupted()), 0);
                }
            }
            host.set_effective_context(self.id);
        }
    }
}

/// A counter slot's shared-data key: the worker's copy of the credential shares its own (no
/// copy per request); one hashed for this request (under a subscription) is owned.
#[derive(Debug, Clone)]
enum SlotKey {
    Shared(Rc<str>),
    Own(String),
}

impl Default for SlotKey {
    fn default() -> Self {
        SlotKey::Own(String::new())
    }
}

impl std::ops::Deref for SlotKey {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            SlotKey::Shared(k) => k,
            SlotKey::Own(k) => k,
        }
    }
}

/// Every tick, while this worker does not know whether Envoy hands a held request's body to the
/// filter ([`HoldSupport`](crate::worker::HoldSupport)): for each request still holding its
/// headers for a body the filter has not seen, compare what Envoy received for the stream
/// (`request.total_size`: its body bytes plus the header map's bytes) with the header map's
/// bytes. Body bytes Envoy has and the filter never got mean the Wasm filter runs without
/// `allow_on_headers_stop_iteration`: the worker stops holding headers, and every watched
/// request goes on as in the default mode (headers first, then the body Envoy buffered, which
/// the filter then reads and decides as usual). A client that is merely slow has sent no body
/// bytes: it is not taken for a missing knob. `root`: the context to leave effective.
pub fn probe_held_headers(host: &dyn Host, worker: &SharedWorker, root: u32) {
    let watched = {
        let mut w = worker.borrow_mut();
        if w.held.support != crate::worker::HoldSupport::Unknown || w.held.watched.is_empty() {
            return;
        }
        std::mem::take(&mut w.held.watched)
    };
    let mut still = Vec::with_capacity(watched.len());
    let mut missing = false;
    for (id, weak) in watched {
        let Some(rc) = weak.upgrade() else { continue };
        let waits = rc.try_borrow().is_ok_and(|r| r.waits_for_held_body());
        if !waits {
            continue;
        }
        if !missing && host.set_effective_context(id) {
            let header_bytes = host.headers(Headers::Request).byte_size() as u64;
            missing = host
                .property_u64(&["request", "total_size"])
                .is_some_and(|total| total > header_bytes);
        }
        still.push((id, weak));
    }
    if !missing {
        let mut w = worker.borrow_mut();
        // Confirmed meanwhile (a body arrived while the list was out): nothing to keep.
        if w.held.support == crate::worker::HoldSupport::Unknown {
            w.held.watched.extend(still);
        }
        drop(w);
        host.set_effective_context(root);
        return;
    }
    {
        let mut w = worker.borrow_mut();
        w.held.support = crate::worker::HoldSupport::Missing;
        let gauge = w.metrics.hold_unsupported;
        if gauge != 0 {
            host.record_metric(gauge, 1);
        }
    }
    log::error!(
        "maas: pauseHeadersForBody is on but Envoy does not hand the body of a request whose \
         headers are held to the filter (the Wasm filter's allow_on_headers_stop_iteration is \
         not set, or this Envoy is older than 1.35): request headers now go on before the body \
         on this worker, and a refusal decided on the body resets an upstream request that has \
         started; set allow_on_headers_stop_iteration: true (docs/deploy.md)"
    );
    for (id, weak) in still {
        let Some(rc) = weak.upgrade() else { continue };
        let Ok(mut req) = rc.try_borrow_mut() else {
            continue;
        };
        if req.waits_for_held_body() && host.set_effective_context(id) {
            req.stop_holding(host);
            host.resume_request();
        }
    }
    host.set_effective_context(root);
}

/// The body length a request declares in its only `content-length` (the caller counts them):
/// plain ASCII digits that fit; else none (the body is then held to its end).
fn declared_length(value: &str) -> Option<usize> {
    let digits =
        !value.is_empty() && value.len() <= 12 && value.bytes().all(|b| b.is_ascii_digit());
    if !digits {
        return None;
    }
    value.parse().ok()
}

/// The request header that names a subscription (client → gateway, and gateway → backend).
pub const SUBSCRIPTION_HEADER: &str = "x-maas-subscription";

/// The subscription the client's `X-MaaS-Subscription` names (last non-empty value).
fn requested_subscription(headers: &HeaderMap) -> Option<&str> {
    maas_types::subscription::requested_from_header(headers.get_all(SUBSCRIPTION_HEADER))
}

/// 503 `limits_unavailable`: the lease service is unreachable and `onUnavailable` is `refuse`.
fn lease_unavailable() -> Refusal {
    Refusal::unavailable(
        "limits_unavailable",
        "global rate limits cannot be checked now (lease service not answering); retry shortly",
    )
}

/// The refusal (429, 400 or 503) for a refused admission.
fn limited_refusal(a: Admission) -> Refusal {
    a.into_refusal()
        .unwrap_or_else(|| Refusal::unavailable("internal", "admission refused without a reason"))
}

#[cfg(test)]
mod tests;
