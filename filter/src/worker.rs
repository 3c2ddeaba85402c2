//! The root context's logic: configuration, policy and provider-credential polling, the tick
//! (metrics, folds, leases, ledger). Plain code over the [`Host`]; the proxy-wasm adapter only
//! delegates. The VM's state it shares with the requests is in [`crate::state`].

use crate::cache;
use crate::config::PluginConfig;
use crate::credential;
use crate::host::{Body, Headers, Host, read_body};
use crate::lease;
use crate::request::Registry;
pub use crate::state::{HeldHeaders, HoldSupport, Metrics, SharedWorker, Worker};
use maas_types::{CredentialsDocument, PolicyDocument};
use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

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
    /// This worker's requests by context id.
    pub requests: Registry,
    pub policy_call: Option<u32>,
    pub credentials_call: Option<u32>,
    pub next_poll_ms: u64,
    pub last_poll_warning_ms: u64,
    /// Configured in the upstream mode (pluginConfig `upstream`).
    pub upstream: bool,
}

impl Root {
    pub fn new(id: u32) -> Self {
        Root {
            id,
            worker: Rc::new(RefCell::new(Worker::default())),
            requests: Registry::default(),
            policy_call: None,
            credentials_call: None,
            next_poll_ms: 0,
            last_poll_warning_ms: 0,
            upstream: false,
        }
    }

    /// A new HTTP context of this worker: its request, registered.
    pub fn http(&self, id: u32) -> crate::request::Http {
        crate::request::Http::new(id, self.worker.clone(), &self.requests)
    }

    /// Configured as an upstream filter (`upstream: true`): its HTTP contexts are upstream
    /// attempts (`crate::upstream`).
    pub fn upstream_mode(&self) -> bool {
        self.upstream
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
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            log::error!("maas: the worker's state is busy at configure, filter not started");
            return false;
        };
        if w.policy.is_none()
            && let Some(p) = &cfg.bootstrap_policy
        {
            w.revoked = Rc::new(p.revoked_key_ids.iter().cloned().collect());
            w.policy = Some(Rc::new(p.clone()));
        }
        self.upstream = cfg.upstream;
        if cfg.upstream {
            // An upstream filter: the policy and the credentials only (no limits, no ledger,
            // no metrics of its own beside the downstream filter's).
            // No poll here: Envoy configures a cluster's upstream filters while it builds the
            // clusters, and a callout then crashes Envoy 1.40 (SIGSEGV, checked); the first
            // tick polls.
            w.config = Some(Rc::new(cfg));
            drop(w);
            log::info!(
                "maas: filter configured in upstream mode (root context {})",
                self.id
            );
            return true;
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
        crate::request::probe_held_headers(host, &self.worker, &self.requests, self.id);
        let (cfg, policy_etag, cred_etag, have_policy_answer) = {
            let Ok(w) = self.worker.try_borrow() else {
                return;
            };
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
        if cfg.upstream {
            self.poll(host, &cfg, now, policy_etag, cred_etag, have_policy_answer);
            return;
        }
        // Folded refunds are written before the lease batch reads the counters.
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.folds.tick(host, now / 1000);
        }
        if cfg.limits.global.enabled {
            self.lease_tick(host, &cfg, now);
        }
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            let w = &mut *w;
            // A report dispatched now answers to the root context (never cancelled).
            w.active = self.id;
            crate::ledger::tick(host, &mut w.ledger, &w.metrics, &cfg, now);
        }
        self.poll(host, &cfg, now, policy_etag, cred_etag, have_policy_answer);
    }

    /// Polls the policy and the credentials when due.
    fn poll(
        &mut self,
        host: &dyn Host,
        cfg: &PluginConfig,
        now: u64,
        policy_etag: Option<String>,
        cred_etag: Option<String>,
        have_policy_answer: bool,
    ) {
        if now < self.next_poll_ms {
            return;
        }
        if self.policy_call.is_none() {
            self.policy_call = get_from_companion(host, cfg, POLICY_PATH, policy_etag.as_deref());
        }
        if self.credentials_call.is_none() {
            self.credentials_call =
                get_from_companion(host, cfg, CREDENTIALS_PATH, cred_etag.as_deref());
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
        let flight = match self.worker.try_borrow_mut() {
            Ok(mut w) if !w.lease_flights.is_empty() => w.lease_flights.remove(&token),
            _ => None,
        };
        if let Some(f) = flight {
            crate::request::answer_flight(
                host,
                &self.worker,
                &self.requests,
                f,
                body_size,
                None,
                self.id,
            );
            return;
        }
        let status = host
            .header(Headers::CallResponse, ":status")
            .and_then(|s| s.parse::<u32>().ok());
        if let Ok(mut w) = self.worker.try_borrow_mut()
            && w.ledger.is_batch(token)
        {
            let w = &mut *w;
            crate::ledger::on_answer(host, &mut w.ledger, &w.metrics, status);
            return;
        }
        let etag = host.header(Headers::CallResponse, "etag");
        let body = (body_size > 0).then(|| read_body(host, Body::CallResponse, body_size));
        let batch = self
            .worker
            .try_borrow_mut()
            .ok()
            .and_then(|mut w| w.leases.take_answered(token));
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
            let Ok(mut w) = self.worker.try_borrow_mut() else {
                return;
            };
            let w = &mut *w;
            lease::sync(host, &mut w.leases, w.metrics.lease_fallback);
            // Callouts dispatched from here answer to the root context.
            w.active = self.id;
        }
        crate::request::dispatch_pending(host, &self.worker, &self.requests, cfg, self.id);
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            return;
        };
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
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            // Callbacks do not re-enter, so this does not happen; if it did, nothing is applied
            // and the batch's claims stay counted (never a grant counted twice).
            log::error!(
                "maas: lease batch {} answer not applied (worker busy)",
                batch.id
            );
            return;
        };
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
                let Ok(mut w) = self.worker.try_borrow_mut() else {
                    return;
                };
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
                        w.revoked = Rc::new(revoked);
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
                        let Ok(mut w) = self.worker.try_borrow_mut() else {
                            return;
                        };
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
