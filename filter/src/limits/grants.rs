//! Global limits (budget leases), in the counter slot: how a lease bounds admission
//! ([`LeasePolicy`]), what a short counter asks for ([`LeaseNeed`], sized by [`prefetch`]), the
//! companion's answer added by CAS ([`apply_grants`]), and the worker's batch: the counters it
//! reports ([`tracked_counters`]), their debts and releases claimed and undone ([`claim`] /
//! [`unclaim`]), renewals sized by the recent rate ([`Meter`]).

use super::counters::{distinct, lease_counters};
use super::slot::{self, Edit, Kind, Record};
use crate::store::SharedStore;
use maas_types::Tier;

/// One short counter: what to ask the companion for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseNeed {
    pub(crate) kind: Kind,
    pub(crate) window: u64,
    pub(crate) start: u64,
    /// The tightest limit of the applicable tiers for this counter.
    pub(crate) limit: u64,
    /// count + add − granted.
    pub(crate) need: u64,
    /// The replica's rate in this window × the lease horizon, within `need..=limit`.
    pub(crate) want: u64,
}

/// How leases bound admission (global limits on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeasePolicy {
    /// Fallback (companion unreachable): each counter's lease is at least `⌊limit × share⌋`, and
    /// a short lease is a 429 (no callout). `None`: the lease is what was granted.
    pub(crate) fallback_share: Option<f64>,
    /// `leaseHorizonMs`: prefetch sized by the rate × this.
    pub(crate) horizon_ms: u64,
    /// Retry-after (s) of a 429 for a short lease while the limit is not reached.
    pub(crate) short_retry_s: u64,
}

impl LeasePolicy {
    /// The lease of a counter with `limit` that holds `granted`, when the other replicas held
    /// `others` at the last answer. In fallback the local share is also capped by what the
    /// others did not hold (so that a replica that held a large lease and one that held little
    /// do not both add a full share on top), never below what this replica was granted.
    pub(super) fn lease(&self, granted: u64, limit: u64, others: u64) -> u64 {
        match self.fallback_share {
            Some(share) => {
                let share = share.clamp(0.0, 1.0);
                // ⌊limit × share⌋ (as f64: exact enough below 2^53, clamped to the limit).
                let local = ((limit as f64) * share).floor();
                let local = if local >= limit as f64 {
                    limit
                } else {
                    local as u64
                };
                granted.max(local.min(limit.saturating_sub(others)))
            }
            None => granted,
        }
    }
}

/// Budget worth asking for: `count` used by this replica since it first admitted in this window
/// `elapsed` s ago (its own rate, whenever in the window it started: a daily window that
/// started hours before the first request does not dilute it), over `horizon_ms`, within
/// `need..=limit`.
pub(super) fn prefetch(count: u64, elapsed: u64, horizon_ms: u64, need: u64, limit: u64) -> u64 {
    let rate = u128::from(count) * u128::from(horizon_ms) / (u128::from(elapsed.max(1)) * 1000);
    let want = u64::try_from(rate).unwrap_or(u64::MAX);
    want.max(need).min(limit.max(need))
}

/// A counter's recent rate on this replica, as the worker's reports see it: the window's
/// average (what [`prefetch`] sizes by) lags a burst and starts from nothing at each new
/// window, so a lease sized by it alone runs dry between reports and every short request pays
/// a callout. Observed at each report (no host call of its own); carried over a window's
/// rollover, where the new window's count starts again from zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meter {
    /// The window of the last reading, its count then and when (ms).
    start: u64,
    count: u64,
    at_ms: u64,
    /// Units per second between the last two readings of one window (the last one known).
    per_s: u64,
    /// The highest `per_s` read since it was tracked (or resumed): the burst's rate, which the
    /// readings of its idle seconds (0 a second) must not erase before it is remembered.
    peak_per_s: u64,
}

impl Meter {
    /// Readings closer than this keep the rate (a retried claim, a report right after another).
    const MIN_SPAN_MS: u64 = 200;

    /// `count` read at `now_ms` in the window starting at `start`.
    pub(crate) fn observe(&mut self, start: u64, count: u64, now_ms: u64) -> Self {
        let span = now_ms.saturating_sub(self.at_ms);
        if self.at_ms > 0 && span < Self::MIN_SPAN_MS {
            return *self;
        }
        if self.at_ms > 0 && start == self.start {
            // Refunds can lower a count: a falling count is no use, not a negative rate.
            let used = count.saturating_sub(self.count);
            self.per_s = u64::try_from(u128::from(used) * 1000 / u128::from(span.max(1)))
                .unwrap_or(u64::MAX);
        }
        *self = Meter {
            start,
            count,
            at_ms: now_ms.max(1),
            per_s: self.per_s,
            peak_per_s: self.peak_per_s.max(self.per_s),
        };
        *self
    }

    /// The prior of a counter that comes back after idling: the last burst's peak rate (or the
    /// prior it was given, when no reading came since); its next reading starts a new span
    /// instead of averaging over the idle time.
    pub(crate) fn resumed(self) -> Self {
        Meter {
            at_ms: 0,
            per_s: self.peak_per_s.max(self.per_s),
            peak_per_s: 0,
            ..self
        }
    }

    /// What the recent rate uses over `horizon_ms`.
    pub(crate) fn for_horizon(&self, horizon_ms: u64) -> u64 {
        u64::try_from(u128::from(self.per_s) * u128::from(horizon_ms) / 1000).unwrap_or(u64::MAX)
    }
}

/// A counter a worker reports on: (kind, window seconds, tightest limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCounter {
    pub(crate) kind: Kind,
    pub(crate) window: u64,
    pub(crate) limit: u64,
}

/// The counters a tracked subject's batch reports: (kind, window seconds, tightest limit).
pub(crate) fn tracked_counters(tiers: &[&Tier]) -> Vec<LeaseCounter> {
    let tiers = distinct(tiers);
    lease_counters(&tiers)
        .into_iter()
        .map(|(kind, window, limit, _)| LeaseCounter {
            kind,
            window: window.seconds(),
            limit,
        })
        .collect()
}

/// What the companion answered for one counter of a subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub(crate) kind: Kind,
    pub(crate) window: u64,
    /// The window the item was for (a grant for a window that is over is dropped).
    pub(crate) start: u64,
    pub(crate) granted: u64,
    /// The window's global taken after the item.
    pub(crate) taken: u64,
}

/// Adds the companion's grants to `subject`'s records by CAS (a grant whose window is no longer
/// the current one is dropped) and stores `others` = taken − granted. False when the slot could
/// not be written (unreadable, full, contention): the grant is then lost to this replica (the
/// companion counts it as taken until the window ends).
pub(crate) fn apply_grants(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    grants: &[Grant],
    now: u64,
) -> bool {
    let applied = slot::update(store, key, subject, now, None, |records| {
        let mut changed = false;
        for g in grants {
            let current_start = now - now % g.window.max(1);
            if g.start != current_start {
                continue;
            }
            let rec = records
                .iter_mut()
                .find(|r| r.kind == g.kind.code() && r.window == g.window);
            match rec {
                Some(r) if r.start == g.start => {
                    r.granted = r.granted.saturating_add(g.granted);
                    r.others = g.taken.saturating_sub(r.granted);
                    changed = true;
                }
                Some(r) => {
                    *r = Record {
                        kind: g.kind.code(),
                        window: g.window,
                        start: g.start,
                        count: 0,
                        granted: g.granted,
                        others: g.taken.saturating_sub(g.granted),
                        since: 0,
                    };
                    changed = true;
                }
                None if g.granted > 0 || g.taken > 0 => {
                    records.push(Record {
                        kind: g.kind.code(),
                        window: g.window,
                        start: g.start,
                        count: 0,
                        granted: g.granted,
                        others: g.taken.saturating_sub(g.granted),
                        since: 0,
                    });
                    changed = true;
                }
                None => {}
            }
        }
        Edit::write_if(changed, ())
    });
    applied.is_ok()
}

/// One counter's part of a worker's batch, claimed in the slot before it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub(crate) kind: Kind,
    pub(crate) window: u64,
    pub(crate) start: u64,
    pub(crate) limit: u64,
    /// count − granted (usage above the lease): claimed as granted += debt.
    pub(crate) debt: u64,
    /// granted − count of an idle subject: claimed as granted −= release.
    pub(crate) release: u64,
    /// Renewal (prefetch) wanted; nothing claimed for it.
    pub(crate) want: u64,
}

/// Claims `subject`'s debts (and its unused lease when `idle`) by CAS and sizes renewals:
/// the items of the worker's batch for it (none when there is nothing to report, or when the
/// slot could not be written: unreadable, full, contention).
/// `meters` (one per counter, in the same order; fewer: no recent rate) are observed with the
/// counts read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn claim(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    counters: &[LeaseCounter],
    meters: &mut [Meter],
    now_ms: u64,
    idle: bool,
    horizon_ms: u64,
) -> Vec<Claim> {
    let now = now_ms / 1000;
    let claimed = slot::update(store, key, subject, now, None, |records| {
        let mut claims = Vec::new();
        let mut changed = false;
        for (i, c) in counters.iter().enumerate() {
            let start = now - now % c.window.max(1);
            let Some(r) = records
                .iter_mut()
                .find(|r| r.kind == c.kind.code() && r.window == c.window && r.start == start)
            else {
                continue;
            };
            let recent = meters.get_mut(i).map_or(0, |m| {
                m.observe(start, r.count, now_ms).for_horizon(horizon_ms)
            });
            let debt = r.count.saturating_sub(r.granted);
            let mut granted = r.granted.max(r.count);
            let release = if idle {
                granted.saturating_sub(r.count)
            } else {
                0
            };
            granted = granted.saturating_sub(release);
            let mut want = 0;
            if !idle && r.count < c.limit {
                let since = if r.since > 0 { r.since } else { start };
                let target = prefetch(r.count, now.saturating_sub(since), horizon_ms, 0, c.limit)
                    .max(recent.min(c.limit));
                // Renew while a horizon's worth is still left, for two horizons: the rate is an
                // average over the window (idle gaps included), and a burst above it must not
                // run dry before the next tick (a request waiting for a lease pays a callout).
                if granted.saturating_sub(r.count) < target {
                    want = target.saturating_mul(2).min(c.limit);
                }
            }
            if granted != r.granted {
                r.granted = granted;
                changed = true;
            }
            if debt > 0 || release > 0 || want > 0 {
                claims.push(Claim {
                    kind: c.kind,
                    window: c.window,
                    start,
                    limit: c.limit,
                    debt,
                    release,
                    want,
                });
            }
        }
        Edit::write_if(changed, claims)
    });
    claimed.unwrap_or_default()
}

/// Undoes `claims` after a failed batch (only in records still of the claimed window):
/// granted −= debt, granted += release, so the next batch reports them again. Best effort: a
/// slot that cannot be written (unreadable, full, contention) keeps the claims.
pub(crate) fn unclaim(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    claims: &[Claim],
    now: u64,
) {
    if claims.iter().all(|c| c.debt == 0 && c.release == 0) {
        return;
    }
    let _ = slot::update(store, key, subject, now, None, |records| {
        let mut changed = false;
        for c in claims {
            if let Some(r) = records
                .iter_mut()
                .find(|r| r.kind == c.kind.code() && r.window == c.window && r.start == c.start)
            {
                let granted = r.granted.saturating_sub(c.debt).saturating_add(c.release);
                if granted != r.granted {
                    r.granted = granted;
                    changed = true;
                }
            }
        }
        Edit::write_if(changed, ())
    });
}
