//! A request's scopes at admission ([`maas_types::Scope`]): counted in each scope's counters
//! before its own, so that a refusal anywhere leaves nothing counted anywhere — the scopes
//! counted before it are taken back ([`limits::unadmit`]).
//!
//! Order: scopes first (in document order), then the request's own counters (which also write
//! this worker's folded settlements: once written they must never be taken back, so they come
//! last and are never rolled back). Each scope is one more read and CAS of its slot, and one
//! more at settlement; a request in no scope pays nothing.

use crate::admission::ScopeRun;
use crate::limits::{self, Admission, LeaseNeed, LeasePolicy, RateHeaders, Reservation, Shadowed};
use crate::store::SharedStore;

/// Counted in every scope: their reservations, their windows for the rate-limit headers
/// (merged), and what a shadow limit of one would have refused.
pub(super) struct Counted {
    pub(super) reserved: Vec<Reservation>,
    pub(super) headers: RateHeaders,
    pub(super) shadowed: Option<Shadowed>,
}

/// What the scopes said.
pub(super) enum ScopesAdmitted {
    All(Counted),
    /// Scope `scope`'s lease is short (global limits): nothing is counted in any scope.
    Short {
        scope: u8,
        items: Vec<LeaseNeed>,
        limited: Admission,
    },
    /// A scope refused: nothing is counted in any scope.
    Refused(Admission),
}

/// What the request takes in each counter.
#[derive(Debug, Clone, Copy)]
pub(super) struct Take {
    pub(super) reserve: u64,
    pub(super) reserve_cost: u64,
    pub(super) now: u64,
}

fn ask<'a>(run: &'a ScopeRun, tiers: &'a [&'a maas_types::Tier], take: Take) -> limits::Ask<'a> {
    limits::Ask {
        key: &run.counter_key,
        tiers,
        subject: &run.counter_subject,
        reserve: take.reserve,
        reserve_cost: take.reserve_cost,
        now: take.now,
        settled: &[],
    }
}

/// Counts the request in every scope of `runs`, or in none.
pub(super) fn admit(
    store: &dyn SharedStore,
    runs: &[ScopeRun],
    take: Take,
    lease: Option<&LeasePolicy>,
) -> ScopesAdmitted {
    let mut reserved: Vec<Reservation> = Vec::with_capacity(runs.len());
    let mut merged = RateHeaders::default();
    let mut shadowed = None;
    for (i, run) in runs.iter().enumerate() {
        let tiers = [&run.tier];
        match limits::admit_leased(store, &ask(run, &tiers, take), None, lease) {
            Admission::Allowed {
                reservation,
                headers,
                shadowed: s,
            } => {
                reserved.push(reservation);
                merged = merged.merged(&headers);
                shadowed = shadowed.or(s);
            }
            refused => {
                take_back(store, runs.get(..i).unwrap_or_default(), take);
                return match refused.split_lease() {
                    (Some(items), limited) => ScopesAdmitted::Short {
                        scope: u8::try_from(i).unwrap_or(u8::MAX),
                        items,
                        limited,
                    },
                    (None, other) => ScopesAdmitted::Refused(other),
                };
            }
        }
    }
    ScopesAdmitted::All(Counted {
        reserved,
        headers: merged,
        shadowed,
    })
}

/// Takes the request back out of the scopes of `runs` (each counted it at `take`).
pub(super) fn take_back(store: &dyn SharedStore, runs: &[ScopeRun], take: Take) {
    for run in runs {
        let tiers = [&run.tier];
        limits::unadmit(store, &ask(run, &tiers, take));
    }
}
