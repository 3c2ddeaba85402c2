//! What the lease stores take and answer: a checked batch, a counter's identity, the grants
//! applied or why nothing was. Below the stores (`memory`, `redis`) and the capability that
//! picks one (`leases`), so neither points back up.

use maas_types::lease::{LeaseGrant, LeaseItem, LeaseKind, LeaseRequest};

/// Counters are kept this long after their window's end.
pub const EXPIRY_MARGIN_SECONDS: u64 = 60;

/// What the store answered for a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub replicas: u32,
    pub grants: Vec<LeaseGrant>,
}

/// The store could not apply the batch (nothing was applied, or — after a response timeout —
/// possibly all of it: the replica's retry then over-counts, never under-counts).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

/// A checked batch as the stores take it.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub replica: &'a str,
    /// Its idempotency key: a repeated id is answered from memory, nothing applied again.
    pub id: Option<&'a str>,
    pub items: &'a [LeaseItem],
}

impl<'a> Batch<'a> {
    pub fn of(request: &'a LeaseRequest) -> Batch<'a> {
        Batch {
            replica: &request.replica,
            id: request.batch_id.as_deref(),
            items: &request.items,
        }
    }
}

/// One counter's identity: (subject, kind, window length, window start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterId<'a> {
    pub subject: &'a str,
    pub kind: LeaseKind,
    pub window_seconds: u64,
    pub window_start: u64,
}

/// When an item's counter may be forgotten: its window's end plus a margin (Unix ms).
pub fn expires_at_ms(item: &LeaseItem) -> u64 {
    item.window_start
        .saturating_add(item.window_seconds)
        .saturating_add(EXPIRY_MARGIN_SECONDS)
        .saturating_mul(1000)
}
