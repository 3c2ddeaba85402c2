//! Budget leases: the filter ↔ companion contract that makes limits hold across gateway replicas.
//!
//! The global truth is one counter per (subject, kind, window length, window start): the budget
//! *taken* from the limit so far — handed to replicas as leases, plus usage reported above what
//! was leased. A replica admits requests against the slice it holds (no callout per request);
//! it asks for more when its slice runs short, gives back what it did not use, and reports
//! usage above its slice (debt) — all in one batched `POST /internal/v1/leases`.
//!
//! The companion applies a batch atomically per item (Redis: one Lua script, one round trip for
//! the whole batch; without Redis: the same rules in process). For each item, in this order:
//! 1. `taken = max(0, taken − release) + debt` (debt is added even above the limit: usage that
//!    happened is never dropped);
//! 2. `remaining = max(0, limit − taken)`;
//! 3. when `need > 0` or `want > 0`: if `remaining ≥ need`, grant
//!    `min(remaining, max(need, min(want, fair)))` with `fair = max(need, remaining ÷ replicas)`
//!    (budget held idle by one replica stays a fraction of what is left); else grant 0 (nothing
//!    is taken: the need cannot be met);
//! 4. `taken += granted`; the counter expires at the window's end (plus a margin).
//!
//! `replicas` is the number of distinct replica ids that called in the last
//! [`REPLICA_TTL_SECONDS`] (the caller included).
//!
//! **Exactly once.** A batch may carry a `batchId` (unique per replica). The companion remembers
//! the answer of an applied batch id per replica for [`BATCH_MEMORY_SECONDS`] and answers a
//! repeated id with the SAME answer without applying anything again. A replica whose batch got
//! no answer (timeout, 503, connection lost) re-sends it verbatim — same id, same items — until
//! a 200: a batch the store applied late (Redis paused) is then counted once, and the grants it
//! made reach the replica instead of being stranded until the window's end. Without a
//! `batchId` every call is applied.

use serde::{Deserialize, Serialize};

/// `POST` path of the lease endpoint (internal listener only).
pub const LEASES_PATH: &str = "/internal/v1/leases";

/// A replica counts as active this long after its last lease call.
pub const REPLICA_TTL_SECONDS: u64 = 30;

/// Items one batch may carry at most (the companion refuses larger batches with 400).
pub const MAX_BATCH_ITEMS: usize = 1024;

/// How long the companion remembers the answer of an applied `batchId` (per replica).
pub const BATCH_MEMORY_SECONDS: u64 = 300;

/// Longest `batchId`, in bytes (ASCII letters, digits, `-`, `_`, `.`, `:`).
pub const MAX_BATCH_ID_BYTES: usize = 128;

/// Which counter of a subject's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseKind {
    Requests,
    Tokens,
    /// Money, in nano-units ([`crate::money`]).
    Cost,
}

impl LeaseKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseKind::Requests => "requests",
            LeaseKind::Tokens => "tokens",
            LeaseKind::Cost => "cost",
        }
    }
}

/// `POST /internal/v1/leases` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRequest {
    /// The asking replica (Envoy's node id, or an id the filter drew at start). Only counted, to
    /// size grants and to tell replicas their number.
    pub replica: String,
    /// Idempotency key of this batch (unique per replica): a repeated id gets the first
    /// answer again, nothing applied twice. Absent: applied every time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    pub items: Vec<LeaseItem>,
}

/// One counter's change and ask.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseItem {
    pub subject: String,
    pub kind: LeaseKind,
    pub window_seconds: u64,
    /// Unix seconds at which the window started (a multiple of `window_seconds`).
    pub window_start: u64,
    /// The window's limit as the replica's policy says.
    pub limit: u64,
    /// Budget needed now (a request waits for it); 0 when only reporting.
    #[serde(default)]
    pub need: u64,
    /// Budget wanted beyond `need` (prefetch sized by the replica's own rate); a hint.
    #[serde(default)]
    pub want: u64,
    /// Used above what this replica was leased (added unconditionally).
    #[serde(default)]
    pub debt: u64,
    /// Leased but unused budget handed back.
    #[serde(default)]
    pub release: u64,
}

/// `POST /internal/v1/leases` 200 body: one grant per item, same order. 503 (with an
/// [`crate::ErrorBody`]) when the store cannot be reached: nothing was applied, the replica
/// keeps its debt and releases and falls back to its local share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseResponse {
    /// Active replicas (at least 1).
    pub replicas: u32,
    /// `redis` or `memory`.
    pub store: String,
    pub grants: Vec<LeaseGrant>,
}

/// What one item got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseGrant {
    /// Budget added to the replica's slice (0: the need could not be met).
    pub granted: u64,
    /// The window's global `taken` after this item (all replicas' leases and debts).
    pub taken: u64,
}

/// The pure grant rule above, for one item: `(new taken, granted)`. Shared by the companion's
/// in-process store and its tests (the Redis script implements the same arithmetic).
pub fn apply_item(taken: u64, item: &LeaseItem, replicas: u32) -> (u64, u64) {
    let taken = taken.saturating_sub(item.release).saturating_add(item.debt);
    let remaining = item.limit.saturating_sub(taken);
    let mut granted = 0;
    if (item.need > 0 || item.want > 0) && remaining >= item.need {
        let fair = item.need.max(remaining / u64::from(replicas.max(1)));
        granted = remaining.min(item.need.max(item.want.min(fair)));
    }
    (taken.saturating_add(granted), granted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(limit: u64, need: u64, want: u64, debt: u64, release: u64) -> LeaseItem {
        LeaseItem {
            subject: "s".into(),
            kind: LeaseKind::Tokens,
            window_seconds: 60,
            window_start: 0,
            limit,
            need,
            want,
            debt,
            release,
        }
    }

    #[test]
    fn grants_never_exceed_the_limit() {
        assert_eq!(apply_item(0, &item(100, 10, 1000, 0, 0), 1), (100, 100));
        assert_eq!(apply_item(95, &item(100, 10, 0, 0, 0), 1), (95, 0));
        assert_eq!(apply_item(90, &item(100, 10, 0, 0, 0), 1), (100, 10));
    }

    #[test]
    fn fair_share_splits_what_is_left_among_replicas() {
        // 100 left, 4 replicas: a replica wanting everything gets a quarter.
        assert_eq!(apply_item(0, &item(100, 1, 1000, 0, 0), 4), (25, 25));
        // The need is always met when it fits, even above the fair share.
        assert_eq!(apply_item(0, &item(100, 60, 0, 0, 0), 4), (60, 60));
    }

    #[test]
    fn debt_counts_above_the_limit_and_release_returns() {
        assert_eq!(apply_item(100, &item(100, 0, 0, 7, 0), 1), (107, 0));
        assert_eq!(apply_item(100, &item(100, 0, 0, 0, 30), 1), (70, 0));
        assert_eq!(apply_item(10, &item(100, 0, 0, 0, 30), 1), (0, 0));
    }

    #[test]
    fn wire_shape_is_camel_case() {
        let r = LeaseRequest {
            replica: "r1".into(),
            batch_id: Some("b-1".into()),
            items: vec![item(100, 1, 2, 3, 4)],
        };
        let v = serde_json::to_value(&r).unwrap_or_default();
        assert_eq!(v["items"][0]["windowSeconds"], 60);
        assert_eq!(v["items"][0]["kind"], "tokens");
        assert_eq!(v["batchId"], "b-1");
        let old: LeaseRequest =
            serde_json::from_value(serde_json::json!({"replica": "r1", "items": []}))
                .unwrap_or_else(|_| r.clone());
        assert_eq!(old.batch_id, None, "batchId is optional");
        let back: LeaseItem = serde_json::from_value(serde_json::json!({
            "subject": "s", "kind": "requests", "windowSeconds": 60, "windowStart": 0, "limit": 5
        }))
        .unwrap_or_else(|_| item(0, 0, 0, 0, 0));
        assert_eq!(back.kind, LeaseKind::Requests);
        assert_eq!(
            (back.need, back.want, back.debt, back.release),
            (0, 0, 0, 0)
        );
    }
}
