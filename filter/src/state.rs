//! One VM's state (Envoy runs one VM per worker thread), shared by the root context and the
//! HTTP contexts of that thread: configuration, policy, provider credentials, the worker's
//! caches, metric ids and their batched increments, lease and ledger state. Requests are named
//! by context id here (the request layer's registry finds their state), so this module sits
//! below both the root context (`worker`) and the requests (`request`).

use crate::cache;
use crate::config::PluginConfig;
use crate::host::{Host, MetricKind};
use crate::lease;
use crate::metrics;
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
    /// Key ids revoked recently (shared with the decisions of a callback, no copy).
    pub revoked: Rc<HashSet<String>>,
    pub credentials: Rc<CredentialsDocument>,
    pub credentials_etag: Option<String>,
    /// Requests of this worker waiting for a callout another request made for the same
    /// credential (flight key — the whole credential, never the key id alone → waiters).
    /// Context ids: the request layer's registry finds their state.
    pub waiting: HashMap<String, Vec<u32>>,
    /// This worker's copy of shared allows (see [`cache::LocalCache`]).
    pub local_cache: cache::LocalCache,
    pub metrics: Metrics,
    /// Budget leases (global limits): replica id, fallback view, tracked subjects, batch.
    pub leases: lease::Leases,
    /// Lease callouts out (token → flight: the subject's requests waiting for it).
    pub lease_flights: HashMap<u32, lease::Flight>,
    /// Short requests (context ids) waiting for the root's next lease flight.
    pub lease_pending: Vec<u32>,
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
/// `crate::request::probe_held_headers`), by context id.
#[derive(Debug, Default)]
pub struct HeldHeaders {
    pub support: HoldSupport,
    pub watched: Vec<u32>,
}

impl HeldHeaders {
    /// A request now holds its headers for its body (watched only while support is unknown).
    pub fn watch(&mut self, id: u32) {
        if self.support == HoldSupport::Unknown {
            self.watched.push(id);
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
