//! One VM's state (Envoy runs one VM per worker thread) and the root context's logic:
//! configuration, policy and provider-credential polling, metric ids and their batched
//! increments. Plain code over the [`Host`]; the proxy-wasm adapter only delegates.

use crate::cache;
use crate::config::PluginConfig;
use crate::credential;
use crate::host::{Body, Headers, Host, MetricKind, read_body};
use crate::lease;
use crate::metrics;
use crate::request::Request;
use crate::response::Decision;
use maas_types::{CredentialsDocument, PolicyDocument};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

/// Metric ids of this VM (names are shared: Envoy aggregates them across VMs), and the counter
/// increments not yet handed to Envoy: flushed every tick, so a request costs no metric host
/// calls (counters lag by at most one tick).
#[derive(Debug, Default)]
pub struct Metrics {
    pub decisions: Vec<u32>,
    pub cache_hit: u32,
    pub cache_miss: u32,
    pub callout_latency: u32,
    pub callout_failed: u32,
    pub callouts: u32,
    pub policy_updates: u32,
    pub policy_rejected: u32,
    pub malformed_upstream: u32,
    pub lease_callouts: u32,
    pub lease_fallback_entered: u32,
    /// Gauge.
    pub lease_fallback: u32,
    /// Usage records dropped (ledger bound, or a batch the companion refused).
    pub usage_dropped: u32,
    /// Gauge: Envoy does not hand a held request's body over (see [`HeldHeaders`]).
    pub hold_unsupported: u32,
    /// (tier, model, prompt id, completion id), defined on first use.
    tokens: Vec<(String, String, u32, u32)>,
    pending: RefCell<Vec<(u32, u64)>>,
}

impl Metrics {
    pub fn define_all(host: &dyn Host) -> Self {
        let c = |name: &str| host.define_metric(MetricKind::Counter, name);
        Metrics {
            decisions: Decision::ALL
                .iter()
                .map(|d| c(&metrics::request_metric(*d)))
                .collect(),
            cache_hit: c(metrics::CACHE_HIT),
            cache_miss: c(metrics::CACHE_MISS),
            callout_latency: host.define_metric(MetricKind::Histogram, metrics::CALLOUT_LATENCY_MS),
            callout_failed: c(metrics::CALLOUT_FAILED),
            callouts: c(metrics::CALLOUTS),
            policy_updates: c(metrics::POLICY_UPDATES),
            policy_rejected: c(metrics::POLICY_REJECTED),
            malformed_upstream: c(metrics::MALFORMED_UPSTREAM),
            lease_callouts: c(metrics::LEASE_CALLOUTS),
            lease_fallback_entered: c(metrics::LEASE_FALLBACK_ENTERED),
            lease_fallback: host.define_metric(MetricKind::Gauge, metrics::LEASE_FALLBACK),
            usage_dropped: c(metrics::USAGE_RECORDS_DROPPED),
            hold_unsupported: host
                .define_metric(MetricKind::Gauge, metrics::HEADERS_HOLD_UNSUPPORTED),
            tokens: Vec::new(),
            pending: RefCell::new(Vec::new()),
        }
    }

    /// Counts `by` on metric `id` (handed to the host at the next flush).
    pub fn inc(&self, id: u32, by: u64) {
        if id == 0 || by == 0 {
            return;
        }
        if let Ok(mut p) = self.pending.try_borrow_mut() {
            match p.iter_mut().find(|(i, _)| *i == id) {
                Some((_, n)) => *n = n.saturating_add(by),
                None => p.push((id, by)),
            }
        }
    }

    pub fn decision(&self, d: Decision) {
        if let Some(id) = self.decisions.get(d.index()) {
            self.inc(*id, 1);
        }
    }

    pub fn flush(&self, host: &dyn Host) {
        if let Ok(mut p) = self.pending.try_borrow_mut() {
            for (id, n) in p.iter_mut() {
                if *n > 0 {
                    host.increment_metric(*id, i64::try_from(*n).unwrap_or(i64::MAX));
                    *n = 0;
                }
            }
        }
    }

    pub fn tokens(
        &mut self,
        host: &dyn Host,
        tier: &str,
        model: &str,
        prompt: u64,
        completion: u64,
    ) {
        let found = self
            .tokens
            .iter()
            .find(|(t, m, _, _)| t == tier && m == model)
            .map(|(_, _, p, c)| (*p, *c));
        let (p, c) = match found {
            Some(ids) => ids,
            None => {
                let p = host.define_metric(
                    MetricKind::Counter,
                    &metrics::token_metric("prompt", tier, model),
                );
                let c = host.define_metric(
                    MetricKind::Counter,
                    &metrics::token_metric("completion", tier, model),
                );
                self.tokens
                    .push((tier.to_string(), model.to_string(), p, c));
                (p, c)
            }
        };
        self.inc(p, prompt);
        self.inc(c, completion);
    }
}

/// State of one VM (one worker thread), shared by the root context and the HTTP contexts of
/// that thread.
#[derive(Debug, Default)]
pub struct Worker {
    pub config: Option<Rc<PluginConfig>>,
    pub policy: Option<Rc<PolicyDocument>>,
    pub policy_etag: Option<String>,
    pub revoked: HashSet<String>,
    pub credentials: Rc<CredentialsDocument>,
    pub credentials_etag: Option<String>,
    /// Requests of this worker waiting for a callout another request made for the same
    /// credential (flight key — the whole credential, never the key id alone → waiters).
    pub waiting: HashMap<String, Vec<Rc<RefCell<Request>>>>,
    /// This worker's copy of shared allows (see [`cache::LocalCache`]).
    pub local_cache: cache::LocalCache,
    pub metrics: Metrics,
    /// Budget leases (global limits): replica id, fallback view, tracked subjects, batch.
    pub leases: lease::Leases,
    /// Lease callouts out (token → flight: the subject's requests waiting for it).
    pub lease_flights: HashMap<u32, crate::request::LeaseFlight>,
    /// Short requests waiting for the root's next lease flight.
    pub lease_pending: Vec<std::rc::Weak<RefCell<Request>>>,
    /// The context whose callback is running (the one a callout dispatched now answers to).
    pub active: u32,
    /// Usage records for the companion's ledger (`crate::ledger`).
    pub ledger: crate::ledger::Ledger,
    /// Refunds folded into the subject's next counter write (`crate::folds`).
    pub folds: crate::folds::Folds,
    /// Whether Envoy hands over the body of a request whose headers are held
    /// (`pauseHeadersForBody`), as far as this worker has seen.
    pub held: HeldHeaders,
}

/// Whether Envoy hands the body of a request whose headers the filter holds to the filter.
/// Envoy does only with the Wasm filter's `allow_on_headers_stop_iteration: true` (Envoy 1.35 or
/// newer); without it (an older Envoy, or a control plane that dropped the field) Envoy turns the
/// filter's pause into StopAllIterationAndWatermark: the body is buffered in Envoy and never
/// reaches the filter, and the request would wait until a timeout.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum HoldSupport {
    /// Nothing seen yet: held requests are watched.
    #[default]
    Unknown,
    /// A held request's body reached the filter.
    Confirmed,
    /// Envoy received a held request's body bytes and the filter did not: headers go on before
    /// the body on this worker from now on (the default mode's guarantees).
    Missing,
}

/// This worker's view of [`HoldSupport`] and, while it is unknown, the requests holding their
/// headers for a body that has not reached the filter yet (the root's tick looks at them:
/// `crate::request::probe_held_headers`).
#[derive(Debug, Default)]
pub struct HeldHeaders {
    pub support: HoldSupport,
    pub watched: Vec<(u32, std::rc::Weak<RefCell<Request>>)>,
}

impl HeldHeaders {
    /// A request now holds its headers for its body (watched only while support is unknown).
    pub fn watch(&mut self, id: u32, request: std::rc::Weak<RefCell<Request>>) {
        if self.support == HoldSupport::Unknown {
            self.watched.push((id, request));
        }
    }

    /// A held request's body (or trailers) reached the filter: Envoy hands it over.
    pub fn confirm(&mut self) {
        if self.support == HoldSupport::Unknown {
            self.support = HoldSupport::Confirmed;
            self.watched = Vec::new();
        }
    }

    pub fn missing(&self) -> bool {
        self.support == HoldSupport::Missing
    }
}

pub type SharedWorker = Rc<RefCell<Worker>>;

/// Tick period: short so that the first poll happens soon after start; polls themselves follow
/// `pollIntervalMs`.
pub const TICK_MS: u64 = 200;

pub const POLICY_PATH: &str = "/internal/v1/policy";
pub const CREDENTIALS_PATH: &str = "/internal/v1/credentials";

/// The root context: configuration and polling.
#[derive(Debug)]
pub struct Root {
    pub id: u32,
    pub worker: SharedWorker,
    pub policy_call: Option<u32>,
    pub credentials_call: Option<u32>,
    pub next_poll_ms: u64,
    pub last_poll_warning_ms: u64,
}

impl Root {
    pub fn new(id: u32) -> Self {
        Root {
            id,
            worker: Rc::new(RefCell::new(Worker::default())),
            policy_call: None,
            credentials_call: None,
            next_poll_ms: 0,
            last_poll_warning_ms: 0,
        }
    }

    /// pluginConfig arrived: parse it (false: the filter does not start), define the metrics and
    /// poll at once (provider credentials have no bootstrap). The adapter sets the tick period.
    pub fn configure(&mut self, host: &dyn Host) -> bool {
        let bytes = host.body(Body::PluginConfiguration, usize::MAX);
        let cfg = match PluginConfig::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("maas: invalid configuration, filter not started: {e}");
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
        if cfg.limits.global.enabled && w.leases.replica.is_empty() {
            w.leases.replica = lease::replica_id(host, &cfg.limits.global, self.id);
            w.leases.nonce = lease::draw(host, self.id);
            log::info!("maas: global limits on, replica id {:?}", w.leases.replica);
        }
        if cfg.limits.global.enabled {
            match lease::fallback_rule(&cfg.limits.global) {
                (true, rule) => log::warn!("maas: {rule}"),
                (false, rule) => log::info!("maas: {rule}"),
            }
        }
        if w.ledger.replica.is_empty() {
            let now = host.now_ms();
            let worker = crate::ledger::draw_worker_id(now, self.id);
            let replica = crate::ledger::replica(host, &cfg, &w.leases.replica, &worker);
            w.ledger.configure(&cfg.usage, replica, worker, now);
        } else {
            w.ledger.enabled = cfg.usage.enabled;
            w.ledger.config = cfg.usage;
        }
        w.config = Some(Rc::new(cfg));
        w.local_cache.clear();
        w.metrics = Metrics::define_all(host);
        drop(w);
        self.tick(host);
        log::info!("maas: filter configured (root context {})", self.id);
        true
    }

    /// Every [`TICK_MS`]: hand counters to the host; poll when due.
    pub fn tick(&mut self, host: &dyn Host) {
        crate::request::probe_held_headers(host, &self.worker, self.id);
        let (cfg, policy_etag, cred_etag, have_policy_answer) = {
            let w = self.worker.borrow();
            w.metrics.flush(host);
            let Some(cfg) = w.config.clone() else { return };
            (
                cfg,
                w.policy_etag.clone(),
                w.credentials_etag.clone(),
                w.policy_etag.is_some(),
            )
        };
        let now = host.now_ms();
        // Folded refunds are written before the lease batch reads the counters.
        self.worker.borrow_mut().folds.tick(host, now / 1000);
        if cfg.limits.global.enabled {
            self.lease_tick(host, &cfg, now);
        }
        crate::ledger::tick(host, &self.worker, &cfg, self.id, now);
        if now < self.next_poll_ms {
            return;
        }
        if self.policy_call.is_none() {
            self.policy_call = get_from_companion(host, &cfg, POLICY_PATH, policy_etag.as_deref());
        }
        if self.credentials_call.is_none() {
            self.credentials_call =
                get_from_companion(host, &cfg, CREDENTIALS_PATH, cred_etag.as_deref());
        }
        // Until the companion answered once, retry quickly.
        let interval = if have_policy_answer {
            cfg.poll_interval_ms
        } else {
            cfg.poll_interval_ms.min(500)
        };
        self.next_poll_ms = now.saturating_add(interval);
    }

    /// The answer to one of the root's polls.
    pub fn on_call_response(&mut self, host: &dyn Host, token: u32, body_size: usize) {
        // A lease flight the root carried for pending requests (it reads its own answer).
        let flight = {
            let mut w = self.worker.borrow_mut();
            if w.lease_flights.is_empty() {
                None
            } else {
                w.lease_flights.remove(&token)
            }
        };
        if let Some(f) = flight {
            crate::request::answer_flight(host, &self.worker, f, body_size, None, self.id);
            return;
        }
        let status = host
            .header(Headers::CallResponse, ":status")
            .and_then(|s| s.parse::<u32>().ok());
        if self.worker.borrow().ledger.is_batch(token) {
            crate::ledger::on_answer(host, &self.worker, status);
            return;
        }
        let etag = host.header(Headers::CallResponse, "etag");
        let body = (body_size > 0).then(|| read_body(host, Body::CallResponse, body_size));
        let batch = {
            let mut w = self.worker.borrow_mut();
            w.leases.take_answered(token)
        };
        if let Some(batch) = batch {
            self.on_batch_answer(host, batch, status, &body.unwrap_or_default());
            return;
        }
        if self.policy_call == Some(token) {
            self.policy_call = None;
            self.on_policy_response(host, status, etag, body);
        } else if self.credentials_call == Some(token) {
            self.credentials_call = None;
            self.on_credentials_response(host, status, etag, body);
        }
    }

    /// Global limits, every tick: adopt the shared fallback state; every `reportIntervalMs`
    /// (no batch out) send the outbox's first batch again (unanswered: verbatim, same id), else
    /// a new batch of this worker's claims (in fallback even an empty one: the probe).
    fn lease_tick(&mut self, host: &dyn Host, cfg: &PluginConfig, now: u64) {
        {
            let mut w = self.worker.borrow_mut();
            let w = &mut *w;
            lease::sync(host, &mut w.leases, w.metrics.lease_fallback);
            // Callouts dispatched from here answer to the root context.
            w.active = self.id;
        }
        crate::request::dispatch_pending(host, &self.worker, cfg, self.id);
        let mut w = self.worker.borrow_mut();
        let w = &mut *w;
        let out = w.leases.outbox.front().is_some_and(|b| b.token.is_some());
        if out || now < w.leases.next_report_ms {
            return;
        }
        let g = &cfg.limits.global;
        w.leases.next_report_ms = now.saturating_add(g.report_interval_ms);
        if w.leases.outbox.is_empty() {
            // Debts go in probes too: a batch is applied once however often it is re-sent.
            let (items, claims) = lease::build_batch(host, g, &mut w.leases, now);
            if items.is_empty() && !w.leases.state.fallback {
                return;
            }
            let id = w.leases.next_batch_id();
            match lease::encode(&w.leases.replica, &id, items) {
                Ok(body) => w.leases.outbox.push_back(lease::Batch {
                    id,
                    body,
                    claims,
                    token: None,
                }),
                Err(e) => {
                    log::warn!("maas: cannot encode the lease batch: {e}");
                    lease::undo(host, &claims, now / 1000);
                    return;
                }
            }
        }
        let Some(batch) = w.leases.outbox.front_mut() else {
            return;
        };
        match lease::dispatch(host, cfg, &batch.body) {
            Ok(token) => {
                batch.token = Some(token);
                w.metrics.inc(w.metrics.lease_callouts, 1);
            }
            Err(e) => {
                // Kept (claims and all): sent again at the next report.
                log::debug!("maas: cannot send the lease batch: {e}");
                if lease::enter_fallback(host, &mut w.leases, w.metrics.lease_fallback, now) {
                    w.metrics.inc(w.metrics.lease_fallback_entered, 1);
                }
            }
        }
    }

    /// The answer to the outbox's first batch: a 200 adds its grants and leaves fallback; a 400
    /// (refused: never applied) undoes its claims and drops it; anything else enters fallback
    /// and keeps it, to be re-sent verbatim.
    fn on_batch_answer(
        &mut self,
        host: &dyn Host,
        mut batch: lease::Batch,
        status: Option<u32>,
        body: &[u8],
    ) {
        let now = host.now_ms();
        let mut w = self.worker.borrow_mut();
        let w = &mut *w;
        match lease::answer(status, body, batch.items()) {
            Some(resp) => {
                let mut grants = resp.grants.iter();
                for (subject, key, claims) in &batch.claims {
                    let mine: Vec<_> = grants.by_ref().take(claims.len()).copied().collect();
                    let g = lease::grants_of(claims, &mine);
                    crate::limits::apply_grants(host, key, subject, &g, now / 1000);
                    if mine.iter().any(|g| g.granted > 0) {
                        // A request's callout answered late: its grants are released when idle.
                        w.leases
                            .track_quietly(subject, key, lease::counters_of(claims), now);
                    }
                }
                let was_fallback = w.leases.state.fallback;
                lease::answered(
                    host,
                    &mut w.leases,
                    w.metrics.lease_fallback,
                    resp.replicas,
                    true,
                );
                if was_fallback || !w.leases.outbox.is_empty() {
                    // Fallback left, or more waiting: the next batch goes at the next tick.
                    w.leases.next_report_ms = now;
                }
            }
            None if status == Some(400) => {
                log::warn!(
                    "maas: lease batch {} refused by the companion (400)",
                    batch.id
                );
                lease::undo(host, &batch.claims, now / 1000);
            }
            None => {
                log::debug!("maas: lease batch failed (status {status:?}); kept to re-send");
                batch.token = None;
                w.leases.outbox.push_front(batch);
                if lease::enter_fallback(host, &mut w.leases, w.metrics.lease_fallback, now) {
                    w.metrics.inc(w.metrics.lease_fallback_entered, 1);
                }
            }
        }
    }

    fn warn_poll(&mut self, host: &dyn Host, what: &str) {
        let now = host.now_ms();
        // At most one warning per 10 s per worker while the companion is away.
        if now.saturating_sub(self.last_poll_warning_ms) >= 10_000 {
            self.last_poll_warning_ms = now;
            log::warn!("maas: {what}");
        }
    }

    fn on_policy_response(
        &mut self,
        host: &dyn Host,
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
                        let max_entries = w.config.as_ref().map_or(1, |c| c.cache.max_entries);
                        let newly: Vec<String> = revoked.difference(&w.revoked).cloned().collect();
                        for id in &newly {
                            cache::evict(host, &credential::api_key_cache_key(id), max_entries);
                            w.local_cache.revoke(id);
                        }
                        w.revoked = revoked;
                        log::info!(
                            "maas: policy updated ({} tiers, {} models, {} revoked keys, etag {})",
                            doc.tiers.len(),
                            doc.models.len(),
                            doc.revoked_key_ids.len(),
                            etag.as_deref().unwrap_or("-")
                        );
                        w.policy = Some(Rc::new(doc));
                        w.policy_etag = etag;
                        w.metrics.inc(w.metrics.policy_updates, 1);
                    }
                    Err(e) => {
                        // The old policy stays; remember the etag so the same document is not
                        // re-parsed (and re-logged) every poll.
                        log::error!(
                            "maas: policy from the companion refused, keeping the current one: {e}"
                        );
                        w.policy_etag = etag;
                        w.metrics.inc(w.metrics.policy_rejected, 1);
                    }
                }
            }
            Some(304) => {}
            other => self.warn_poll(
                host,
                &format!("policy poll failed (status {other:?}); keeping the current policy"),
            ),
        }
    }

    fn on_credentials_response(
        &mut self,
        host: &dyn Host,
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
                        log::info!(
                            "maas: provider credentials updated: {:?}",
                            maas_types::auth::CredentialsDocumentRedacted(&doc)
                        );
                        w.credentials = Rc::new(doc);
                        w.credentials_etag = etag;
                    }
                    Err(e) => log::error!(
                        "maas: credentials document refused at line {} column {}",
                        e.line(),
                        e.column()
                    ),
                }
            }
            Some(304) => {}
            other => self.warn_poll(host, &format!("credentials poll failed (status {other:?})")),
        }
    }
}

fn get_from_companion(
    host: &dyn Host,
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
    match host.dispatch(
        &cfg.companion.cluster,
        &headers,
        None,
        cfg.companion.timeout_ms,
    ) {
        Ok(token) => Some(token),
        Err(e) => {
            log::warn!(
                "maas: cannot call companion cluster {:?} for {path}: {e}",
                cfg.companion.cluster
            );
            None
        }
    }
}

#[cfg(test)]
mod tests;
