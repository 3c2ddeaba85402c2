//! One VM's state (Envoy runs one VM per worker thread), shared by the root context and the
//! HTTP contexts of that thread: configuration, policy, provider credentials, the worker's
//! caches, metric ids and their batched increments, lease and ledger state. Requests are named
//! by context id here (the request layer's registry finds their state), so this module sits
//! below both the root context (`worker`) and the requests (`request`).

use crate::cache;
use crate::config::PluginConfig;
use crate::lease;
pub use crate::metrics::Metrics;
use maas_types::{CredentialsDocument, PolicyDocument};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

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
    /// Backends that keep failing, tried last for a while (`crate::cooldown`).
    pub cooldowns: crate::cooldown::Cooldowns,
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
