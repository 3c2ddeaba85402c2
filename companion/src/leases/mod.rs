//! Budget leases: the global counters that make request and token limits hold across gateway
//! replicas (`POST /internal/v1/leases`, contract in `maas_types::lease`).
//!
//! One counter *taken* per (subject, kind, window length, window start). With `--redis-url` the
//! counters live in Redis ([`redis::RedisStore`]: one Lua script call per batch), shared by
//! every companion behind the Service and kept across their restarts; without it they live in
//! this process ([`memory::MemoryStore`]: same rules, one companion, lost on restart). Both
//! apply a whole batch atomically and follow [`maas_types::lease::apply_item`] exactly.

pub mod api;
pub mod batch;
pub mod memory;
pub mod redis;

use crate::metrics::Metrics;
pub use batch::{Applied, Batch, CounterId, StoreError};
use maas_types::lease::{
    LeaseGrant, LeaseItem, LeaseKind, LeaseRequest, MAX_BATCH_ID_BYTES, MAX_BATCH_ITEMS,
};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Longest subject and replica id, in bytes.
pub const MAX_ID_BYTES: usize = 1024;

/// Largest number an item may carry: the Lua script computes in doubles, exact up to 2^53.
pub const MAX_NUMBER: u64 = (1 << 53) - 1;

/// Largest window length and start (seconds; year 2106): keeps `(start + length + 60) × 1000`
/// exact in the script.
pub const MAX_WINDOW_SECONDS: u64 = u32::MAX as u64;

/// Where the counters live.
pub enum LeaseStore {
    Redis(Box<redis::RedisStore>),
    Memory(memory::MemoryStore),
}

impl LeaseStore {
    pub fn kind(&self) -> &'static str {
        match self {
            LeaseStore::Redis(_) => "redis",
            LeaseStore::Memory(_) => "memory",
        }
    }

    async fn apply(&self, batch: &Batch<'_>, now_ms: u64) -> Result<Applied, StoreError> {
        match self {
            LeaseStore::Redis(r) => r.apply(batch, now_ms).await,
            LeaseStore::Memory(m) => Ok(m.apply(batch, now_ms)),
        }
    }

    async fn reachable(&self) -> bool {
        match self {
            LeaseStore::Redis(r) => r.ping().await,
            LeaseStore::Memory(_) => true,
        }
    }

    async fn taken(&self, counter: &CounterId<'_>, now_ms: u64) -> Result<u64, StoreError> {
        match self {
            LeaseStore::Redis(r) => r.taken(counter).await,
            LeaseStore::Memory(m) => Ok(m.taken(counter, now_ms)),
        }
    }
}

/// Told of every batch the store applied, with the global count after each item (the quota
/// webhook's detection: `crate::quota_webhook`). Called on the request's path: it must not
/// wait for anything (no I/O; hand work to a task of its own).
pub trait LeaseObserver: Send + Sync {
    fn applied(&self, items: &[LeaseItem], grants: &[LeaseGrant]);
}

/// The lease capability as handlers see it: the store and the metrics it feeds.
#[derive(Clone)]
pub struct Leases {
    store: Arc<LeaseStore>,
    metrics: Arc<Metrics>,
    observer: Option<Arc<dyn LeaseObserver>>,
}

impl Leases {
    pub fn new(store: LeaseStore, metrics: Arc<Metrics>) -> Leases {
        let up = i64::from(matches!(store, LeaseStore::Memory(_)));
        metrics.leases.store_up.set(up);
        Leases {
            store: Arc::new(store),
            metrics,
            observer: None,
        }
    }

    /// These leases, `observer` told of every applied batch.
    pub fn observed_by(mut self, observer: Arc<dyn LeaseObserver>) -> Leases {
        self.observer = Some(observer);
        self
    }

    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// Pings the store (Redis: one round trip, bounded by the call timeout) and records the
    /// answer in `maas_companion_lease_store_up`.
    pub async fn reachable(&self) -> bool {
        let up = self.store.reachable().await;
        self.metrics.leases.store_up.set(i64::from(up));
        up
    }

    /// The budget taken so far in one window (0 when nothing was taken or the counter expired):
    /// the number the gateways' leases are granted against (`GET /v1/quota` shows it as used).
    pub async fn taken(
        &self,
        subject: &str,
        kind: LeaseKind,
        window_seconds: u64,
        window_start: u64,
    ) -> Result<u64, StoreError> {
        let counter = CounterId {
            subject,
            kind,
            window_seconds,
            window_start,
        };
        self.store.taken(&counter, now_ms()).await
    }

    /// Applies a checked batch: the grants in item order, or the store's failure.
    pub async fn apply(&self, request: &LeaseRequest) -> Result<Applied, StoreError> {
        let outcome = self.store.apply(&Batch::of(request), now_ms()).await;
        let m = &self.metrics.leases;
        match &outcome {
            Ok(applied) => {
                if m.store_up.set(1) == 0 {
                    tracing::info!(store = self.store.kind(), "lease store reachable again");
                }
                m.batches.inc();
                m.items.inc_by(len_u64(request.items.len()));
                let denied = request
                    .items
                    .iter()
                    .zip(&applied.grants)
                    .filter(|(item, grant)| item.need > 0 && grant.granted == 0)
                    .count();
                m.grants_denied.inc_by(len_u64(denied));
                if let Some(observer) = &self.observer {
                    observer.applied(&request.items, &applied.grants);
                }
            }
            Err(e) => {
                // Once per outage: the replicas retry every tick.
                if m.store_up.set(0) != 0 {
                    tracing::warn!(error = %e, "lease store unreachable: lease batches answer 503");
                }
                m.store_errors.inc();
            }
        }
        outcome
    }
}

fn len_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Unix milliseconds now (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A refused batch: the JSON field at fault (`items[3].windowStart`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub field: String,
    pub message: String,
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> Invalid {
    let field = field.into();
    Invalid {
        message: format!("{field}: {}", message.into()),
        field,
    }
}

/// The batch rules the contract states (and those that keep the script's arithmetic exact).
pub fn validate(request: &LeaseRequest) -> Result<(), Invalid> {
    if request.replica.is_empty() {
        return Err(invalid("replica", "must not be empty"));
    }
    if request.replica.len() > MAX_ID_BYTES {
        return Err(invalid(
            "replica",
            format!("must be at most {MAX_ID_BYTES} bytes"),
        ));
    }
    if let Some(id) = &request.batch_id {
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
        if id.is_empty() || id.len() > MAX_BATCH_ID_BYTES || !id.chars().all(ok) {
            return Err(invalid(
                "batchId",
                format!(
                    "must be 1 to {MAX_BATCH_ID_BYTES} ASCII letters, digits, '-', '_', '.' or ':'"
                ),
            ));
        }
    }
    if request.items.len() > MAX_BATCH_ITEMS {
        return Err(invalid(
            "items",
            format!("at most {MAX_BATCH_ITEMS} items per batch"),
        ));
    }
    for (i, item) in request.items.iter().enumerate() {
        let at = |name: &str| format!("items[{i}].{name}");
        if item.subject.is_empty() {
            return Err(invalid(at("subject"), "must not be empty"));
        }
        if item.subject.len() > MAX_ID_BYTES {
            return Err(invalid(
                at("subject"),
                format!("must be at most {MAX_ID_BYTES} bytes"),
            ));
        }
        if item.window_seconds == 0 {
            return Err(invalid(at("windowSeconds"), "must be at least 1"));
        }
        if item.window_seconds > MAX_WINDOW_SECONDS {
            return Err(invalid(
                at("windowSeconds"),
                format!("must be at most {MAX_WINDOW_SECONDS}"),
            ));
        }
        if item.window_start > MAX_WINDOW_SECONDS {
            return Err(invalid(
                at("windowStart"),
                format!("must be at most {MAX_WINDOW_SECONDS}"),
            ));
        }
        if item.window_start % item.window_seconds != 0 {
            return Err(invalid(
                at("windowStart"),
                "must be a multiple of windowSeconds",
            ));
        }
        for (name, value) in [
            ("limit", item.limit),
            ("need", item.need),
            ("want", item.want),
            ("debt", item.debt),
            ("release", item.release),
        ] {
            if value > MAX_NUMBER {
                return Err(invalid(at(name), format!("must be at most {MAX_NUMBER}")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::batch::expires_at_ms;
    use super::*;
    use maas_types::LeaseKind;
    use maas_types::lease::LeaseItem;

    fn item() -> LeaseItem {
        LeaseItem {
            subject: "alice".into(),
            kind: LeaseKind::Requests,
            window_seconds: 60,
            window_start: 120,
            limit: 10,
            need: 1,
            want: 0,
            debt: 0,
            release: 0,
        }
    }

    fn field_of(items: Vec<LeaseItem>, replica: &str) -> Option<String> {
        validate(&LeaseRequest {
            replica: replica.into(),
            batch_id: None,
            items,
        })
        .err()
        .map(|e| e.field)
    }

    #[test]
    fn a_bad_batch_names_the_field() {
        assert_eq!(field_of(vec![item()], "r1"), None);
        assert_eq!(field_of(vec![item()], ""), Some("replica".into()));
        let too_many = vec![item(); MAX_BATCH_ITEMS + 1];
        assert_eq!(field_of(too_many, "r1"), Some("items".into()));
        assert_eq!(field_of(vec![item(); MAX_BATCH_ITEMS], "r1"), None);
        type Spoil = fn(&mut LeaseItem);
        let cases: [(Spoil, &str); 6] = [
            (|i| i.subject.clear(), "items[1].subject"),
            (|i| i.subject = "x".repeat(1025), "items[1].subject"),
            (|i| i.window_seconds = 0, "items[1].windowSeconds"),
            (|i| i.window_start = 90, "items[1].windowStart"),
            (|i| i.debt = 1 << 53, "items[1].debt"),
            (|i| i.window_start = 1 << 40, "items[1].windowStart"),
        ];
        for (spoil, field) in cases {
            let mut bad = item();
            spoil(&mut bad);
            assert_eq!(
                field_of(vec![item(), bad], "r1").as_deref(),
                Some(field),
                "{field}"
            );
        }
    }

    #[test]
    fn a_bad_batch_id_is_refused() {
        let with = |id: &str| {
            validate(&LeaseRequest {
                replica: "r1".into(),
                batch_id: Some(id.into()),
                items: vec![item()],
            })
            .err()
            .map(|e| e.field)
        };
        assert_eq!(with("0a1b-7:3"), None);
        for bad in ["", "a b", "x/y", &"x".repeat(MAX_BATCH_ID_BYTES + 1)] {
            assert_eq!(with(bad).as_deref(), Some("batchId"), "{bad:?}");
        }
    }

    #[test]
    fn counters_expire_a_minute_after_their_window() {
        assert_eq!(expires_at_ms(&item()), (120 + 60 + 60) * 1000);
    }
}
