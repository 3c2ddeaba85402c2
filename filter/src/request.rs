//! One HTTP request's life as a state machine over the [`Host`]: the proxy-wasm adapter calls
//! the [`Http`] handle's callbacks, which move the request through its [`Phase`]s. The request
//! is decided in [`crate::admission`] (route → authorize → ask: pure verdicts); this module is the
//! imperative shell that reads the facts once, calls them, and applies what they decide (cache,
//! callout, counters, headers, body, forward). The body stage is in `body`, the authentication
//! callout in `auth`, leases in `leasing`, the response side (scanning, settlement) in `respond`.
//!
//! ```text
//! Headers ──management path──────────────────────────────────────────────▶ PassedThrough
//!    │ refusal (path, policy, model, operation, credential, revoked, cached deny, dispatch)
//!    ├─────────────────────────────────────────────────────────────────────▶ Refused
//!    │ cache miss: own callout, or wait for this worker's callout of the same credential
//!    ├──▶ Authenticating ──answer (or interruption) refused──────────────────▶ Refused
//!    │          │ allowed        GET /v1/models (one base URL): the list ───▶ Settled
//!    │          │ one base URL, body not read yet ──▶ AwaitingModel (headers held)
//!    │          │                                        │ body: route_body (model by id)
//!    ▼          ▼                                        ▼
//! authorize: tier, provider key, upstream, header plan ──refused──────────▶ Refused
//!    (one base URL: the routing header set, then the upstream check)
//!    │ body to read                          │ no body (or body already read while held)
//!    ▼                                       │
//! BodyBuffering ──END_STREAM / trailers──▶ ask (model field, limits) ───────▶ Refused
//!                                            │ lease short (global limits): ──▶ Leasing ──▶ Refused
//!                                            │    one POST /internal/v1/leases    │ granted: admitted
//!                                            │ allowed ◀──────────────────────────┘ (resumed)
//!                                            ▼
//!                      Forwarding ──response headers──▶ Responding
//!                          │ end / client gone             │ end of body / on_log / on_done
//!                          └──────────────▶ Settled ◀──────┘
//! ```

use crate::admission::{
    self, Authorized, BodyIntent, HeaderFacts, HeaderPlan, Metering, OperationTraits, Route,
    RouteRefusal, SUBSCRIPTION_HEADER, Snapshot, Target, Upstream,
};
use crate::cache::{self, CachedAnswer, Caller};
use crate::config::PluginConfig;
use crate::credential::CacheIdentity;
use crate::host::{HeaderMap, Headers, Host};
use crate::hygiene;
use crate::lease;
use crate::limits::{self, Admission, LeaseNeed, RateHeaders, Reservation, SlotRead};
use crate::response::{Decision, Deny, Refusal};
use crate::state::{SharedWorker, Worker};
use maas_types::{CredentialsDocument, Model, PolicyDocument};
use proxy_wasm::types::Action;
use std::cell::RefMut;
use std::collections::HashSet;
use std::rc::Rc;

mod auth;
mod body;
mod handle;
mod held;
mod leasing;
mod respond;
mod scoped;
pub use handle::{Http, Registry};
pub use held::probe_held_headers;
pub(crate) use leasing::answer_flight;
pub use leasing::dispatch_pending;
pub use respond::Scan;

/// Whose callout an authenticating request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// This request dispatched the callout (its answer comes on this context).
    OwnCallout,
    /// Another request of this worker is asking for the very same credential.
    OtherRequest,
}

/// Where a request is in its life; each phase holds what only it needs.
pub(crate) enum Phase {
    /// Before the request headers.
    Headers,
    /// A management path: passed with the client's `x-maas-*` removed, nothing more to do.
    PassedThrough,
    /// The headers wait for the companion's answer (the body may be buffered meanwhile when the
    /// headers are held for it); the client's headers are kept for the decision
    /// (`names_subscription`: they carry `X-MaaS-Subscription`).
    Authenticating {
        waiting: Waiting,
        headers: HeaderMap,
        names_subscription: bool,
    },
    /// The one base URL: the caller is known, the headers wait (held) for the body, whose
    /// `model` names the model; the caller and the client's headers are kept for the decision.
    AwaitingModel { caller: Box<Known> },
    /// Authorised and the headers decided; the body is buffered until its end (END_STREAM or
    /// trailers). `headers_held`: the headers wait for the body decision (pauseHeadersForBody);
    /// `slot_read`: the counter slot as the precheck read it (admission starts from it).
    BodyBuffering {
        headers_held: bool,
        slot_read: Option<SlotRead>,
    },
    /// Global limits: the subject's lease is short; the request (headers or body, paused) waits
    /// for the answer to a `POST /internal/v1/leases` (nothing counted yet), with what it still
    /// needs, the flights it waited for, and the 429 to answer if the lease stays short.
    Leasing {
        needs: Vec<LeaseNeed>,
        rounds: u8,
        limited: Option<Admission>,
        /// Whose lease: the request's own counters (none) or a scope's (its index).
        scope: Option<u8>,
    },
    /// Admitted and forwarded (`reservation`: the tokens taken; none for discovery).
    Forwarding {
        reservation: Option<Reservation>,
        rate_headers: RateHeaders,
    },
    /// The response is passing; its usage is read as it goes.
    Responding {
        reservation: Reservation,
        /// The model's backend that served (its index in `backends`), as the route named it.
        backend: Option<u16>,
        status: u32,
        scan: Box<Scan>,
        /// An SSE comment (`: x-maas-quota-warning …`) to put before the first event, when the
        /// request left a window past a warning threshold: what a streaming client sees.
        sse_comment: Option<String>,
    },
    /// The reservation was settled (or there was none): nothing more to do.
    Settled,
    /// Answered with a local error.
    Refused,
}

impl std::fmt::Debug for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Headers => f.write_str("Headers"),
            Phase::PassedThrough => f.write_str("PassedThrough"),
            Phase::Authenticating { waiting, .. } => f
                .debug_struct("Authenticating")
                .field("waiting", waiting)
                .finish_non_exhaustive(),
            Phase::AwaitingModel { .. } => f.write_str("AwaitingModel"),
            Phase::BodyBuffering { headers_held, .. } => f
                .debug_struct("BodyBuffering")
                .field("headers_held", headers_held)
                .finish(),
            Phase::Leasing { .. } => f.write_str("Leasing"),
            Phase::Forwarding {
                reservation,
                rate_headers,
            } => f
                .debug_struct("Forwarding")
                .field("reservation", reservation)
                .field("rate_headers", rate_headers)
                .finish(),
            Phase::Responding {
                reservation,
                status,
                scan,
                ..
            } => f
                .debug_struct("Responding")
                .field("reservation", reservation)
                .field("status", status)
                .field("scan", scan)
                .finish(),
            Phase::Settled => f.write_str("Settled"),
            Phase::Refused => f.write_str("Refused"),
        }
    }
}

/// A request for a model, as routed at its headers (or, at the one base URL, by its body): the
/// policy it is decided with, the model, and what its operation means.
#[derive(Debug)]
struct Routed {
    policy: Rc<PolicyDocument>,
    model_idx: usize,
    traits: OperationTraits,
    /// The body named the model (the one base URL): Envoy routes by [`admission::ROUTING_HEADER`].
    by_body: bool,
    /// The filter rewrote the path to the provider's (and set the routing header): Envoy chose
    /// the route again, so the upstream check also runs at the response, as at the one base URL.
    rerouted: bool,
    /// The routed backend drawn at authorisation (its index among the model's backends): from
    /// then on the request is the model as that backend serves it ([`Routed::model`]).
    backend: Option<u16>,
}

/// A request to the one base URL whose model is not known yet.
#[derive(Debug)]
enum Unrouted {
    /// The body's `model` names it; `rest`: the operation's path.
    Body {
        policy: Rc<PolicyDocument>,
        rest: &'static str,
    },
    /// `GET /v1/models[/{id}]`: answered from the policy once the caller is known.
    Catalog {
        policy: Rc<PolicyDocument>,
        id: Option<String>,
    },
}

/// An authenticated caller whose request waits for its model (the one base URL): what
/// authorisation reads once the body names it.
#[derive(Debug)]
pub(crate) struct Known {
    caller: Caller,
    counter_key: Option<Rc<str>>,
    headers: HeaderMap,
    names_subscription: bool,
}

impl Routed {
    /// A request for the model at `model_idx` of `policy`: its routed backend
    /// drawn when it has them, and what the operation means for the model as it serves it.
    fn new(
        policy: Rc<PolicyDocument>,
        model_idx: usize,
        operation: crate::operations::Operation,
        credentials: &maas_types::CredentialsDocument,
        now_ms: u64,
    ) -> Result<Routed, Refusal> {
        // None can serve: refused at authorisation, once the caller is known (a stranger
        // learns nothing of the model's credentials).
        let backend = admission::draw_backend(
            &policy,
            model_idx,
            credentials,
            operation,
            now_ms / 1000,
            admission::draw,
        )
        .unwrap_or(None);
        let model = model_in(&policy, model_idx, backend).ok_or_else(Refusal::model_not_found)?;
        let traits = OperationTraits::of(operation, model);
        Ok(Routed {
            policy,
            model_idx,
            traits,
            by_body: false,
            rerouted: false,
            backend,
        })
    }

    /// The model the request is for, as its drawn routed backend serves it when it has one.
    fn model(&self) -> Option<&Model> {
        model_in(&self.policy, self.model_idx, self.backend)
    }

    /// The name of the routed backend drawn for the request.
    fn backend_name(&self) -> Option<&str> {
        let b = self
            .listed_model()?
            .backends
            .get(usize::from(self.backend?))?;
        Some(&b.name)
    }

    /// The model as the policy lists it (its backends, whatever was drawn).
    fn listed_model(&self) -> Option<&Model> {
        self.policy.models.get(self.model_idx)
    }
}

/// The model at `model_idx` of `policy`, as its routed backend `backend` serves it.
fn model_in(policy: &PolicyDocument, model_idx: usize, backend: Option<u16>) -> Option<&Model> {
    match backend {
        Some(j) => policy.backend_variant(model_idx, usize::from(j)),
        None => policy.models.get(model_idx),
    }
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
    /// Answered locally (a refusal, or the gateway's own answer: `GET /v1/models`).
    Refused,
}

/// The subscription the client's `X-MaaS-Subscription` names (read only when the headers'
/// first read saw one).
fn requested_subscription(headers: &HeaderMap, names_subscription: bool) -> Option<&str> {
    names_subscription
        .then(|| {
            maas_types::subscription::requested_from_header(headers.get_all(SUBSCRIPTION_HEADER))
        })
        .flatten()
}

/// A cached answer for the credential, and the subject's counter key from the worker's copy of
/// the credential when it came from there.
type CachedCaller = (Result<Caller, Refusal>, Option<Rc<str>>);

/// What admission decided when it did not refuse.
enum Admitted {
    /// Forward (the reservation; none for discovery).
    Forward(Option<(Reservation, RateHeaders)>),
    /// Global limits: the lease is short (nothing counted): the request's own (`scope` none)
    /// or a scope's (its index in the request's scopes).
    Short {
        items: Vec<LeaseNeed>,
        limited: Admission,
        scope: Option<u8>,
    },
}

/// The worker's state a decision reads, held for one callback (reference counts, no copy).
struct View {
    cfg: Rc<PluginConfig>,
    policy: Option<Rc<PolicyDocument>>,
    credentials: Rc<CredentialsDocument>,
    revoked: Rc<HashSet<String>>,
    cooled: Rc<crate::cooldown::Cooled>,
    hold_headers: bool,
}

impl View {
    fn of(w: &Worker) -> Option<View> {
        let cfg = w.config.clone()?;
        Some(View {
            hold_headers: cfg.pause_headers_for_body && !w.held.missing(),
            cfg,
            policy: w.policy.clone(),
            credentials: w.credentials.clone(),
            revoked: w.revoked.clone(),
            cooled: w.cooldowns.cooled(),
        })
    }

    fn snapshot(&self) -> Snapshot<'_> {
        Snapshot {
            cfg: &self.cfg,
            policy: self.policy.as_deref(),
            credentials: &self.credentials,
            revoked: &self.revoked,
            cooled: &self.cooled,
            hold_headers: self.hold_headers,
        }
    }
}

/// One HTTP request's state.
#[derive(Debug)]
pub(crate) struct Request {
    id: u32,
    worker: SharedWorker,
    /// The worker's requests by context id (waiters and lease flights name requests by id).
    registry: Registry,
    phase: Phase,
    /// Set at the headers of a model request (at the one base URL, once the body named it).
    route: Option<Routed>,
    /// The one base URL, until the model is known.
    unrouted: Option<Unrouted>,
    /// The credential's place in the cache (its flight key; the key id for the ledger).
    identity: Option<CacheIdentity>,
    /// This request's authentication callout, while it is out.
    flight: Option<Flight>,
    body: body::RequestBody,
    /// Who the caller is for the limits, once authorised.
    auth: Option<Authorized>,
    /// What admission reserved (settles the response).
    metering: Metering,
    /// The clock when the filter began to decide (ms; 0 before): request duration and time to
    /// first token count from it.
    started_ms: u64,
    /// A streamed answer's first bytes were seen (time to first token recorded).
    first_bytes_seen: bool,
    /// The authenticated caller (the usage event names them by their pseudonym).
    caller: Option<Rc<crate::cache::CachedIdentity>>,
    /// With the policy's `observability.usageEvents`: what the ledger counted for this request,
    /// until its usage event is written (a cell: the ledger's side reads `&self`).
    usage_event: std::cell::RefCell<Option<Box<crate::usage_event::Counted>>>,
}

impl Request {
    /// The rate-limit headers the policy in force chooses.
    fn rate_limit_style(&self) -> maas_types::RateLimitHeaders {
        self.route
            .as_ref()
            .map(|r| r.policy.rate_limit_headers)
            .unwrap_or_default()
    }

    pub fn new(id: u32, worker: SharedWorker, registry: Registry) -> Self {
        Request {
            id,
            worker,
            registry,
            phase: Phase::Headers,
            route: None,
            unrouted: None,
            identity: None,
            flight: None,
            body: body::RequestBody::default(),
            auth: None,
            metering: Metering::default(),
            started_ms: 0,
            first_bytes_seen: false,
            caller: None,
            usage_event: std::cell::RefCell::new(None),
        }
    }

    #[cfg(test)]
    pub(crate) fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The worker's state, when it is not busy (a re-entrant call is refused by the caller).
    fn worker_mut(&self) -> Option<RefMut<'_, Worker>> {
        self.worker.try_borrow_mut().ok()
    }

    /// Counts one decision (a busy worker counts nothing: metrics never decide).
    fn count_decision(&self, host: &dyn Host, d: Decision, code: &str) {
        let model = self.model().map_or("none", |m| m.name.as_str());
        if let Ok(w) = self.worker.try_borrow() {
            w.metrics.decision(host, d, code, model);
        }
    }

    /// A callback of this request runs: a callout dispatched now answers here.
    fn enter(&self) {
        if let Some(mut w) = self.worker_mut() {
            w.active = self.id;
        }
    }

    fn view(&self) -> Option<View> {
        View::of(&*self.worker.try_borrow().ok()?)
    }

    fn config(&self) -> Option<Rc<PluginConfig>> {
        self.worker.try_borrow().ok()?.config.clone()
    }

    fn model(&self) -> Option<&Model> {
        self.route.as_ref()?.model()
    }

    fn traits(&self) -> Option<OperationTraits> {
        self.route.as_ref().map(|r| r.traits)
    }

    fn decided(&self) -> bool {
        !matches!(
            self.phase,
            Phase::Headers
                | Phase::Authenticating { .. }
                | Phase::AwaitingModel { .. }
                | Phase::BodyBuffering { .. }
                | Phase::Leasing { .. }
        )
    }

    /// The request span's attributes, once, at the request's end (settled or refused), when
    /// the policy asks for them (`observability.traceAttributes`; off: no host call).
    fn observe(&self, host: &dyn Host, decision: &str, tokens: Option<(u64, u64)>) {
        let on = match &self.route {
            Some(r) => r.policy.observability.trace_attributes,
            None => self.worker.try_borrow().ok().is_some_and(|w| {
                w.policy
                    .as_ref()
                    .is_some_and(|p| p.observability.trace_attributes)
            }),
        };
        if !on {
            return;
        }
        let attributes = crate::observe::Attributes {
            model: self.model().map(|m| m.name.as_str()),
            operation: self.traits().map(|t| t.operation),
            user: self.caller.as_ref().and_then(|c| c.pseudonym.as_deref()),
            decision,
            tokens,
        };
        crate::observe::set(host, &attributes);
    }

    /// Answers the request with an error (on the effective context).
    fn refuse(&mut self, host: &dyn Host, r: &Refusal) {
        self.phase = Phase::Refused;
        self.observe(host, r.code, None);
        self.count_decision(host, r.decision, r.code);
        // The usage ledger counts refusals of a known subject (in the VM only), and the usage
        // event reports them.
        self.ledger_refused(r.code);
        self.write_usage_event(host);
        host.send_response(r.status, &r.response_headers(), &r.body());
    }

    fn refused(&mut self, host: &dyn Host, r: &Refusal) -> Action {
        self.refuse(host, r);
        Action::Pause
    }

    /// Request headers: route the request, then authenticate (cache or callout) and go as far
    /// as the body allows.
    /// A management path: the companion authenticates these itself; only the reserved namespace
    /// (and a credential header spelt with `_`) goes, in every spelling.
    fn pass_management(&mut self, host: &dyn Host, headers: &HeaderMap) -> Action {
        for name in headers.names() {
            if hygiene::strip_for_management(name) {
                host.set_header(Headers::Request, name, None);
            }
        }
        self.phase = Phase::PassedThrough;
        Action::Continue
    }

    fn on_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        let Some(view) = self.view() else {
            return self.refused(host, &Refusal::not_configured());
        };
        // One host call for every header (the path, the credential, what to strip).
        let headers = host.headers(Headers::Request);
        let [
            (path, _),
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
        let facts = HeaderFacts {
            path: path.unwrap_or_default(),
            method: method.unwrap_or_default(),
            authorization,
            x_api_key,
            content_type,
            content_length,
            transfer_encoding,
            end_of_stream,
        };
        let model = match admission::route(&facts, &view.snapshot()) {
            Ok(Route::Model(m)) => m,
            Ok(Route::Management) => return self.pass_management(host, &headers),
            Err(RouteRefusal::Refused(r)) => return self.refused(host, &r),
            Err(RouteRefusal::Revoked { cache_key }) => {
                cache::evict(host, &cache_key, view.cfg.cache.max_entries);
                return self.refused(host, &Refusal::unauthenticated("key revoked"));
            }
        };
        let Some(policy) = view.policy.clone() else {
            return self.refused(host, &Refusal::no_policy());
        };
        let now_ms = host.now_ms();
        match model.target {
            Target::Path(model_idx) => {
                match Routed::new(
                    policy,
                    model_idx,
                    model.operation,
                    &view.credentials,
                    now_ms,
                ) {
                    Ok(route) => self.route = Some(route),
                    Err(r) => return self.refused(host, &r),
                }
            }
            Target::Body(rest) => self.unrouted = Some(Unrouted::Body { policy, rest }),
            Target::Catalog(id) => {
                self.unrouted = Some(Unrouted::Catalog {
                    policy,
                    id: id.map(str::to_string),
                })
            }
        }
        if let BodyIntent::Read { hold, declared } = model.body {
            self.body.start(hold, declared);
        }
        self.started_ms = now_ms;
        let now_s = now_ms / 1000;
        let step = match self.cached(host, &view.cfg, model.credential, now_s) {
            Some((result, counter_key)) => {
                self.authenticated(host, result, counter_key, headers, subscriptions > 0, now_s)
            }
            None => match self.call_companion(host, &view.cfg, model.credential, &headers) {
                Some(waiting) => {
                    // The client's headers wait with the request (what to strip, the
                    // subscription named).
                    self.phase = Phase::Authenticating {
                        waiting,
                        headers,
                        names_subscription: subscriptions > 0,
                    };
                    Step::Wait
                }
                None => Step::Refused,
            },
        };
        match step {
            Step::Continue => Action::Continue,
            Step::Wait | Step::Refused => Action::Pause,
        }
    }

    /// The credential's answer from this worker's copy (no shared-data read, no SHA-256,
    /// nothing copied), else from the shared cache: the answer and, for the worker's copy, the
    /// subject's counter key. Sets the request's cache identity.
    fn cached(
        &mut self,
        host: &dyn Host,
        cfg: &PluginConfig,
        cred: crate::credential::Credential<'_>,
        now_s: u64,
    ) -> Option<CachedCaller> {
        let mut w = self.worker.try_borrow_mut().ok()?;
        let local_key = w.local_cache.key(cred.raw());
        if let Some((caller, counter_key, identity)) = w.local_cache.get(local_key, now_s) {
            w.metrics.inc(w.metrics.cache_hit, 1);
            self.identity = Some(identity);
            return Some((Ok(caller), Some(counter_key)));
        }
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
                w.local_cache.put(
                    (local_key, &identity),
                    &caller,
                    || limits::counter_key(&caller.subject, cfg.limits.counter_slots),
                    expires_at,
                    cfg.poll_interval_ms / 1000,
                    now_s,
                );
                Some((Ok(caller), None))
            }
            Some((answer, _)) => Some((crate::authenticate::cached_result(answer), None)),
            None => None,
        };
        let counter = if cached.is_some() {
            w.metrics.cache_hit
        } else {
            w.metrics.cache_miss
        };
        w.metrics.inc(counter, 1);
        self.identity = Some(identity);
        cached
    }

    /// The caller's authentication is known: refuse, or authorise and go as far as the body
    /// allows. `headers`: the client's, as read at the request headers; `now_s`: the clock read
    /// by the callback this runs in.
    fn authenticated(
        &mut self,
        host: &dyn Host,
        result: Result<Caller, Refusal>,
        counter_key: Option<Rc<str>>,
        headers: HeaderMap,
        names_subscription: bool,
        now_s: u64,
    ) -> Step {
        let caller = match result {
            Ok(c) => c,
            Err(r) => {
                self.refuse(host, &r);
                return Step::Refused;
            }
        };
        self.caller = Some(caller.identity.clone());
        match &self.unrouted {
            Some(Unrouted::Catalog { .. }) => {
                return self.answer_catalog(host, &caller, &headers, names_subscription);
            }
            // The body names the model: authorised once it is read (the headers are held).
            Some(Unrouted::Body { .. }) if self.route.is_none() => {
                let known = Box::new(Known {
                    caller,
                    counter_key,
                    headers,
                    names_subscription,
                });
                return self.await_model(host, known);
            }
            _ => {}
        }
        self.authorize_known(
            host,
            caller,
            counter_key,
            headers,
            names_subscription,
            now_s,
        )
    }

    /// The caller and its model are known: authorise (the subscription named, if any), apply
    /// the header plan, and go as far as the body allows.
    fn authorize_known(
        &mut self,
        host: &dyn Host,
        caller: Caller,
        counter_key: Option<Rc<str>>,
        headers: HeaderMap,
        names_subscription: bool,
        now_s: u64,
    ) -> Step {
        let requested = requested_subscription(&headers, names_subscription);
        let decided = self.authorize(host, &caller, counter_key, &headers, requested, now_s);
        let (plan, slot_read) = match decided {
            Ok(d) => d,
            Err(r) => {
                self.ledger_refused_as(&caller.identity, requested, r.code);
                self.refuse(host, &r);
                return Step::Refused;
            }
        };
        apply_header_plan(host, &plan);
        drop(plan);
        // A partner model on Vertex has its path from the plan (Vertex's own, not /v1/messages),
        // and its version in the body; a provider with a chat path of its own, its path.
        let provider = self.model().and_then(|m| m.provider.as_ref());
        let own_path = provider.is_some_and(|p| p.path.is_some());
        if self.traits().is_some_and(|t| t.translate)
            && !crate::provider::path_follows_stream(provider)
            && let Err(r) = translate_headers(host, &headers, !own_path)
        {
            self.refuse(host, &r);
            return Step::Refused;
        }
        if self.body.is_buffering() {
            return self.wait_for_body(host, slot_read);
        }
        self.admit(host, slot_read, now_s)
    }

    /// The one base URL, at the response: the upstream check against the cluster that answered.
    /// Envoy chooses the route again once the filter set the routing header, but only when its
    /// router asks for it, after the filter let the request go: before that, `xds.cluster_name`
    /// still names the route chosen for the headers as the client sent them (Envoy 1.40). So
    /// the check runs where the cluster is known; a path prefix is checked at authorisation.
    pub(super) fn check_routed(&self, host: &dyn Host) -> Result<(), Refusal> {
        match &self.route {
            Some(route) if route.by_body || route.rerouted => {
                let model = route.model().ok_or_else(Refusal::no_policy)?;
                admission::check_routed(model, || {
                    host.property(&crate::operations::CLUSTER_PROPERTY)
                })
            }
            _ => Ok(()),
        }
    }

    /// The one base URL, the caller known before the body: the headers stay held until the body
    /// names the model.
    fn await_model(&mut self, host: &dyn Host, known: Box<Known>) -> Step {
        if !self.body.holds() || self.worker_mut().is_some_and(|w| w.held.missing()) {
            // Found out while this request waited for the companion: never forwarded undecided.
            self.refuse(host, &admission::body_routing_unavailable());
            return Step::Refused;
        }
        self.phase = Phase::AwaitingModel { caller: known };
        if self.body.buffered == 0
            && let Some(mut w) = self.worker_mut()
        {
            w.held.watch(self.id);
        }
        Step::Wait
    }

    /// The body of a request to the one base URL is read: the model it names (by name or alias)
    /// becomes the request's route.
    fn route_by_body(&mut self) -> Result<(), Refusal> {
        let Some(Unrouted::Body { policy, rest }) = &self.unrouted else {
            return Ok(());
        };
        let body = self.body.info().ok_or_else(Refusal::no_policy)?;
        let (model_idx, operation) = admission::route_body(policy, body, rest)?;
        let policy = policy.clone();
        // The credentials only (one reference count), not the whole view.
        let credentials = self
            .worker
            .try_borrow()
            .map_err(|_| Refusal::undecidable())?
            .credentials
            .clone();
        let mut route = Routed::new(policy, model_idx, operation, &credentials, self.started_ms)?;
        route.by_body = true;
        self.unrouted = None;
        self.route = Some(route);
        Ok(())
    }

    /// `GET /v1/models[/{id}]` at the one base URL, the caller known: answered from the policy.
    fn answer_catalog(
        &mut self,
        host: &dyn Host,
        caller: &Caller,
        headers: &HeaderMap,
        names_subscription: bool,
    ) -> Step {
        let Some(Unrouted::Catalog { policy, id }) = &self.unrouted else {
            self.refuse(host, &Refusal::undecidable());
            return Step::Refused;
        };
        let requested = requested_subscription(headers, names_subscription);
        let api_key = self.identity.as_ref().is_some_and(|i| i.key_id().is_some());
        match admission::catalog(policy, &caller.identity, api_key, requested, id.as_deref()) {
            Ok(body) => {
                self.phase = Phase::Settled;
                self.observe(host, Decision::Allowed.as_str(), None);
                self.count_decision(host, Decision::Allowed, "ok");
                host.send_response(
                    200,
                    &[
                        ("content-type", "application/json"),
                        ("cache-control", "no-store"),
                    ],
                    &body,
                );
                Step::Refused
            }
            Err(r) => {
                self.refuse(host, &r);
                Step::Refused
            }
        }
    }

    /// [`admission::authorize`] with this request's facts, then (the headers about to leave
    /// before the body is read) the precheck that refuses now what is certain — a full request
    /// or token window — so that such a 429 starts no upstream request.
    fn authorize<'h>(
        &mut self,
        host: &dyn Host,
        caller: &Caller,
        counter_key: Option<Rc<str>>,
        headers: &'h HeaderMap,
        requested: Option<&str>,
        now_s: u64,
    ) -> Result<(HeaderPlan<'h>, Option<SlotRead>), Refusal> {
        let view = self.view().ok_or_else(Refusal::not_configured)?;
        let snapshot = view.snapshot();
        if let Some(policy) = &view.policy {
            self.refresh_model(policy)?;
        }
        let route = self.route.as_ref().ok_or_else(Refusal::no_policy)?;
        let names: smallvec::SmallVec<[&str; 16]> = headers.names().collect();
        let cluster = || host.property(&crate::operations::CLUSTER_PROPERTY);
        let (auth, plan) = admission::authorize(
            &snapshot,
            (route.model_idx, route.backend),
            self.body.intent(),
            route.traits,
            admission::Caller {
                identity: &caller.identity,
                subject: caller.subject.clone(),
                key_id: self.identity.as_ref().and_then(|i| i.key_id()),
                requested_subscription: requested,
                header_names: &names,
                counter_key,
                now_s,
                stream: self
                    .body
                    .info()
                    .is_some_and(|i| i.as_ref().is_ok_and(|i| i.stream)),
            },
            if route.by_body {
                Upstream::AfterRouting
            } else {
                Upstream::Now(&cluster)
            },
        )?;
        let slot_read = if self.body.is_buffering() && !self.body.holds() && !route.traits.discovery
        {
            self.precheck(host, &route.policy, &auth, now_s)?
        } else {
            None
        };
        if let Some(route) = self.route.as_mut() {
            // A drawn backend's route is chosen by the routing headers.
            route.rerouted =
                route.backend.is_some() || plan.set.iter().any(|(name, _)| *name == ":path");
        }
        self.auth = Some(auth);
        Ok((plan, slot_read))
    }

    /// The policy may have changed while the request waited: the model is found again by name
    /// (in the same policy document, the model found at the headers stands).
    fn refresh_model(&mut self, policy: &Rc<PolicyDocument>) -> Result<(), Refusal> {
        let route = self.route.as_mut().ok_or_else(Refusal::no_policy)?;
        if Rc::ptr_eq(&route.policy, policy) {
            return Ok(());
        }
        let name = route.model().map(|m| m.name.as_str()).unwrap_or_default();
        let model_idx = policy
            .models
            .iter()
            .position(|m| m.name == name)
            .ok_or_else(Refusal::model_not_found)?;
        // A drawn routed backend stays drawn only as it was: the body may already be written
        // for it (its served name, its API).
        let backend = match route.backend {
            None => None,
            Some(_) => {
                let drawn = route.backend_name().unwrap_or_default();
                let j = policy
                    .models
                    .get(model_idx)
                    .and_then(|m| m.backends.iter().position(|b| b.name == drawn))
                    .and_then(|j| u16::try_from(j).ok());
                if model_in(policy, model_idx, j).is_none_or(|m| Some(m) != route.model()) {
                    return Err(Refusal::new(
                        Deny::AdmissionUndecided,
                        format!("model {name} changed while this request waited; retry"),
                    ));
                }
                j
            }
        };
        route.model_idx = model_idx;
        route.backend = backend;
        route.policy = policy.clone();
        Ok(())
    }

    /// The windows' state before the headers leave: a full one refuses (429).
    fn precheck(
        &self,
        host: &dyn Host,
        policy: &PolicyDocument,
        auth: &Authorized,
        now_s: u64,
    ) -> Result<Option<SlotRead>, Refusal> {
        let subject = auth.limits_subject();
        let folded = self
            .worker
            .try_borrow()
            .map_err(|_| Refusal::undecidable())?
            .folds
            .pending(&auth.counter_key, subject);
        let windows = auth.windows(policy);
        let (limited, read) =
            limits::precheck_folded(host, &auth.counter_key, &windows, subject, now_s, &folded);
        match limited {
            Some(limited) => Err(limited_refusal(limited, policy.rate_limit_headers)),
            None => Ok(read),
        }
    }

    /// The body is still to come: the headers go on now (Envoy hands a wasm filter the body
    /// only after its headers continue), unless held for it.
    fn wait_for_body(&mut self, host: &dyn Host, slot_read: Option<SlotRead>) -> Step {
        if self.body.holds() && self.worker_mut().is_some_and(|w| w.held.missing()) {
            // Found out while this request waited for the companion.
            self.stop_holding(host);
        }
        let held = self.body.holds();
        self.phase = Phase::BodyBuffering {
            headers_held: held,
            slot_read,
        };
        if !held {
            return Step::Continue;
        }
        if self.body.buffered == 0
            && let Some(mut w) = self.worker_mut()
        {
            w.held.watch(self.id);
        }
        Step::Wait
    }

    /// The body is known (or there is none): the model field and the limits.
    fn admit(&mut self, host: &dyn Host, slot_read: Option<SlotRead>, now_s: u64) -> Step {
        match self.decide(host, slot_read, now_s) {
            Ok(Admitted::Forward(reservation)) => self.forward(host, reservation),
            // The first round's 429 names no window (as before the lease was asked for).
            Ok(Admitted::Short { items, scope, .. }) => {
                self.ask_lease(host, items, None, scope, now_s)
            }
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
        self.body.write_pending(host);
        let (reservation, rate_headers) = match reservation {
            Some((r, h)) => (Some(r), h),
            None => (None, RateHeaders::default()),
        };
        self.phase = Phase::Forwarding {
            reservation,
            rate_headers,
        };
        self.count_decision(host, Decision::Allowed, "ok");
        Step::Continue
    }

    /// A shadow limit would have refused this admitted request: counted (metric, and in the
    /// ledger as the refusal's code prefixed `shadow_`), never answered.
    fn shadow_refused(&self, s: &limits::Shadowed) {
        log::debug!(
            "shadow limit ({} per {} of tier {}) would refuse: {}",
            s.kind.as_str(),
            s.window,
            s.tier,
            s.code
        );
        if let Ok(w) = self.worker.try_borrow() {
            w.metrics.inc(w.metrics.shadow_refusals, 1);
        }
        // (The usage event reports it as the request's `shadow`.)
        self.ledger_refused(match s.code {
            "tokens_exceed_limit" => "shadow_tokens_exceed_limit",
            "cost_exceeds_limit" => "shadow_cost_exceeds_limit",
            _ => "shadow_rate_limit_exceeded",
        });
    }

    /// [`admission::ask`], the cap it sets, and the limits; `Some` reservation unless
    /// discovery.
    fn decide(
        &mut self,
        host: &dyn Host,
        slot_read: Option<SlotRead>,
        now_s: u64,
    ) -> Result<Admitted, Refusal> {
        let (Some(route), Some(auth)) = (self.route.as_ref(), self.auth.as_ref()) else {
            return Err(Refusal::no_policy());
        };
        let model = route.model().ok_or_else(Refusal::no_policy)?;
        let windows = auth.windows(&route.policy);
        let Some(metering) = admission::ask(model, &windows, self.body.info(), route.traits)?
        else {
            return Ok(Admitted::Forward(None));
        };
        // A body that names no cap is given the one reserved, so the backend generates no more;
        // set before anything is counted (written when forwarded).
        if let Some((field, value)) = metering.cap {
            self.body.set_cap(field, value)?;
        }
        if route.traits.gemini {
            self.body.translate_gemini()?;
        }
        if route.traits.converse {
            // The body is final: translated and signed now, before anything is counted.
            let credentials = self
                .worker
                .try_borrow()
                .map_err(|_| Refusal::undecidable())?
                .credentials
                .clone();
            let key = admission::signing_key(&credentials, model, now_s)?;
            let target = body::ConverseTarget {
                model_id: model.served_name.as_deref().unwrap_or(&model.name),
                key,
                now_s,
            };
            self.body.sign_converse(host, &target)?;
        }
        self.metering = metering;
        drop(windows);
        self.count(host, slot_read, now_s)
    }

    /// The request counted in its scopes and its own counters (all of them, or none):
    /// forwarded with its reservation, short of a lease, or refused.
    fn count(
        &mut self,
        host: &dyn Host,
        slot_read: Option<SlotRead>,
        now_s: u64,
    ) -> Result<Admitted, Refusal> {
        let (Some(route), Some(auth)) = (self.route.as_ref(), self.auth.as_ref()) else {
            return Err(Refusal::no_policy());
        };
        let windows = auth.windows(&route.policy);
        let metering = self.metering;
        let subject = auth.limits_subject();
        let (lease_policy, folded) = {
            let w = self
                .worker
                .try_borrow()
                .map_err(|_| Refusal::undecidable())?;
            let policy = w
                .config
                .as_ref()
                .and_then(|c| lease::policy(c, &w.leases.state));
            (policy, w.folds.pending(&auth.counter_key, subject))
        };
        let take = scoped::Take {
            reserve: metering.reserve(),
            reserve_cost: metering.reserve_cost(),
            now: now_s,
        };
        let style = route.policy.rate_limit_headers;
        // The scopes first: counted in all, or in none.
        let runs = auth
            .scopes
            .as_deref()
            .map_or(&[][..], |s| s.runs.as_slice());
        // (A request in no scope skips them: nothing built, nothing merged.)
        let scopes_counted = if runs.is_empty() {
            None
        } else {
            match scopes_counted(
                scoped::admit(host, runs, take, lease_policy.as_ref()),
                style,
            ) {
                Ok(counted) => Some(counted),
                Err(done) => return *done,
            }
        };
        let ask = limits::Ask {
            key: &auth.counter_key,
            tiers: &windows,
            subject,
            reserve: take.reserve,
            reserve_cost: take.reserve_cost,
            now: now_s,
            settled: &folded,
        };
        let admitted = limits::admit_leased(host, &ask, slot_read, lease_policy.as_ref());
        if !matches!(admitted, Admission::Allowed { .. }) {
            // Refused or short on its own counters: out of the scopes again.
            scoped::take_back(host, runs, take);
        }
        match admitted {
            Admission::Allowed {
                reservation,
                headers,
                shadowed,
            } => {
                let mut w = self
                    .worker
                    .try_borrow_mut()
                    .map_err(|_| Refusal::undecidable())?;
                noted_admitted(&mut w, auth, &windows, lease_policy.is_some(), now_s);
                drop(w);
                // (`windows` borrows the request's authorisation.)
                drop(windows);
                let (headers, shadowed) = match scopes_counted {
                    Some(counted) => {
                        if let Some(scopes) = self.auth.as_mut().and_then(|a| a.scopes.as_mut()) {
                            scopes.reserved = counted.reserved;
                        }
                        // The headers say the tightest window of all the request counted in.
                        (
                            headers.merged(&counted.headers),
                            shadowed.or(counted.shadowed),
                        )
                    }
                    None => (headers, shadowed),
                };
                if let Some(s) = shadowed {
                    self.shadow_refused(&s);
                }
                Ok(Admitted::Forward(Some((reservation, headers))))
            }
            other => match other.split_lease() {
                (Some(items), limited) => Ok(Admitted::Short {
                    items,
                    limited,
                    scope: None,
                }),
                (None, refused) => Err(limited_refusal(refused, style)),
            },
        }
    }

    /// The headers go on before the body after all (this worker found Envoy does not hand a held
    /// body over): what the default mode does when the headers leave first. The body may be
    /// rewritten later, so the upstream codec frames it (`content-length` removed).
    fn stop_holding(&mut self, host: &dyn Host) {
        self.body.stop_holding();
        if self.body.is_buffering() && !self.traits().is_some_and(|t| t.discovery) {
            host.set_header(Headers::Request, "content-length", None);
        }
        if let Phase::BodyBuffering { headers_held, .. } = &mut self.phase {
            *headers_held = false;
        }
    }

    /// The request headers still wait for the body (so they may still change).
    pub(super) fn headers_held(&self) -> bool {
        matches!(
            self.phase,
            Phase::BodyBuffering {
                headers_held: true,
                ..
            } | Phase::AwaitingModel { .. }
        )
    }

    /// Holding its headers, this request waits for a body that has not reached the filter.
    fn waits_for_held_body(&self) -> bool {
        matches!(
            self.phase,
            Phase::BodyBuffering {
                headers_held: true,
                ..
            } | Phase::AwaitingModel { .. }
        ) && self.body.buffered == 0
    }

    /// The one base URL while its model is still to be read from the body.
    fn routes_by_body(&self) -> bool {
        matches!(self.unrouted, Some(Unrouted::Body { .. }))
            || self.route.as_ref().is_some_and(|r| r.by_body)
    }
}

/// The worker's books of an admitted request: its folded settlements written with it; with
/// global limits, its subject and its scopes' tracked (their debts and releases reported by
/// the worker's batch, in-VM only).
fn noted_admitted(
    w: &mut Worker,
    auth: &Authorized,
    windows: &[&maas_types::Tier],
    leased: bool,
    now_s: u64,
) {
    let subject = auth.limits_subject();
    if limits::has_windows(windows) {
        w.folds.admitted(&auth.counter_key, subject);
    }
    if leased {
        let now_ms = now_s.saturating_mul(1000);
        w.leases.track(
            subject,
            &auth.counter_key,
            || lease::counters(windows),
            now_ms,
        );
        for run in auth.scopes.iter().flat_map(|s| &s.runs) {
            w.leases.track(
                &run.counter_subject,
                &run.counter_key,
                || lease::counters(&[&run.tier]),
                now_ms,
            );
        }
    }
}

/// Applies a [`HeaderPlan`]: removals, then sets.
fn apply_header_plan(host: &dyn Host, plan: &HeaderPlan<'_>) {
    for name in &plan.remove {
        host.set_header(Headers::Request, name, None);
    }
    for (name, value) in &plan.set {
        host.set_header(Headers::Request, name, value.as_deref());
    }
}

/// A request translated to Anthropic Messages goes with the API version its body is written
/// for and, when `path` (no path of the plan's), to the model's `/v1/messages` (the client's
/// headers as read at the request headers).
fn translate_headers(host: &dyn Host, headers: &HeaderMap, path: bool) -> Result<(), Refusal> {
    if path {
        let path = headers
            .get(":path")
            .and_then(crate::translate::messages_path)
            .ok_or_else(|| Refusal::internal("the gateway could not translate the request path"))?;
        host.set_header(Headers::Request, ":path", Some(&path));
    }
    host.set_header(
        Headers::Request,
        "anthropic-version",
        Some(crate::translate::ANTHROPIC_VERSION),
    );
    Ok(())
}

/// 503 `limits_unavailable`: the lease service is unreachable and `onUnavailable` is `refuse`.
fn lease_unavailable() -> Refusal {
    Refusal::new(
        Deny::LimitsUnavailable,
        "global rate limits cannot be checked now (lease service not answering); retry shortly",
    )
}

/// The scopes' answer: counted in all, or the request's answer already (short of a scope's
/// lease, or refused by a scope; boxed, as only those rare paths pay for it).
fn scopes_counted(
    admitted: scoped::ScopesAdmitted,
    style: maas_types::RateLimitHeaders,
) -> Result<scoped::Counted, Box<Result<Admitted, Refusal>>> {
    match admitted {
        scoped::ScopesAdmitted::All(counted) => Ok(counted),
        scoped::ScopesAdmitted::Short {
            scope,
            items,
            limited,
        } => Err(Box::new(Ok(Admitted::Short {
            items,
            limited,
            scope: Some(scope),
        }))),
        scoped::ScopesAdmitted::Refused(refused) => {
            Err(Box::new(Err(limited_refusal(refused, style))))
        }
    }
}

fn limited_refusal(a: Admission, style: maas_types::RateLimitHeaders) -> Refusal {
    a.into_refusal(style).unwrap_or_else(|| {
        Refusal::new(
            Deny::AdmissionUndecided,
            "admission refused without a reason",
        )
    })
}

#[cfg(test)]
mod tests;
