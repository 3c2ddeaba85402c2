//! Per-subject request and token limits over fixed windows, in shared data with CAS.
//!
//! **One person, one budget.** Counters belong to the subject, across all of its keys and tiers.
//! Every request counts against the windows of each *applicable* tier: the subject's own highest
//! tier (`resolve_tier(groups, None)`) and the tier the request runs on (a key pinned to a lower
//! tier). A pinned lower tier therefore only restricts: it never adds budget. Counts are kept per
//! (kind, window length), not per tier, so two tiers with a 1m token window share one count, each
//! checked against its own limit.
//!
//! **Bounded key space.** Subjects hash (SHA-256) into `counterSlots` fixed keys `maas/l/<n>`;
//! a slot's value holds the counters of at most [`slot::SLOT_SUBJECTS`] subjects (the subject is stored
//! inside). Subjects whose windows are all over are dropped whenever a slot is written; when a
//! slot still has no room, admission is refused with 503 `limits_unavailable` — live counts are
//! never dropped (that would let someone escape a limit). Admitting a request is one read and
//! one compare-and-swap write of its slot, and settling it likewise. The slot's layout (versions 2
//! to 4) is in [`slot`]; every write of a slot goes through its one CAS loop ([`slot::update`]).
//!
//! **Global limits (budget leases).** With `limits.global` on, a counter also holds `granted`:
//! the budget this replica (this Envoy, all its workers) was leased by the companion in this
//! window, and `others`: the global `taken` minus `granted` as of the last answer (only for the
//! `x-ratelimit-remaining-*` headers). A request fits when `count + add ≤ limit` and
//! `count + add ≤ lease` (lease = `granted`; in fallback `max(granted, ⌊limit × share⌋)`); a short
//! lease counts nothing and asks for one ([`Admission::NeedsLease`]). [`apply_grants`] adds the
//! answer's grants; [`claim`] / [`unclaim`] take the debts and releases of the worker's batch.
//!
//! Tokens are reserved at admission and settled to the real usage when the response ends, so
//! concurrent requests overshoot a budget by at most one reservation. A reservation larger than
//! the limit of any applicable token window can never fit and is refused up front (400).
//!
//! The parts, by job: [`slot`] (the key, the value's codec, the CAS update), [`counters`] (the
//! counters a set of tiers defines), [`admit`] (admission and the precheck), [`settle`](mod@settle)
//! (settlement), [`grants`] (leases: grants, claims, the recent rate), [`headers`] (the
//! `x-ratelimit-*` headers). This file only says what the rest of the crate uses.
//!
//! Nothing here leaves the crate (`limits` is `pub(crate)`): items are `pub(crate)`, or
//! `pub(super)` inside `limits`; the types that public signatures of other modules name
//! (`lease`, `folds`, `request`: Kind, Reservation, Settled, RateHeaders, LeaseNeed, LeasePolicy,
//! LeaseCounter, Grant, Claim, Meter) are declared `pub`, as the `private_interfaces` lint asks.

mod admit;
mod counters;
mod grants;
mod headers;
#[cfg(test)]
mod probe;
mod settle;
mod slot;

#[cfg(test)]
pub(crate) use admit::FALLBACK_RESERVATION;
pub(crate) use admit::{
    Admission, Ask, Shadowed, admit_leased, precheck_folded, reservation_for, unadmit,
};
pub(crate) use counters::has_windows;
pub(crate) use grants::{
    Claim, Grant, LeaseCounter, LeaseNeed, LeasePolicy, Meter, apply_grants, claim,
    tracked_counters, unclaim,
};
pub(crate) use headers::{
    IETF_POLICY_HEADER, IETF_STATE_HEADER, QUOTA_WARNING_HEADER, RateHeaders,
};
#[cfg(test)]
pub(crate) use probe::{lease_state, token_state};
pub(crate) use settle::{Reservation, Settled, Used, settle, settle_folded};
pub(crate) use slot::{DEFAULT_COUNTER_SLOTS, Kind, SlotRead, counter_key};

#[cfg(test)]
mod tests;
