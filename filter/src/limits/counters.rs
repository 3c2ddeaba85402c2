//! The counters a set of tiers defines: every limit with its kind and tier, the distinct
//! (kind, window) counters, and the tightest limit of each.

use super::slot::Kind;
use maas_types::{Limit, Tier, Window};
use smallvec::SmallVec;

/// Every limit of `tiers`, enforced and shadow, with its kind and tier name (a money budget
/// as a limit in nano-units).
fn every_limit<'a>(tiers: &'a [&'a Tier]) -> impl Iterator<Item = (Kind, Limit, &'a str)> + 'a {
    tiers.iter().flat_map(|t| {
        let name = t.name.as_str();
        t.limits
            .requests
            .iter()
            .map(move |l| (Kind::Requests, *l, name))
            .chain(
                t.limits
                    .tokens
                    .iter()
                    .map(move |l| (Kind::Tokens, *l, name)),
            )
            .chain(
                t.limits
                    .budgets
                    .iter()
                    .map(move |b| (Kind::Cost, b.as_limit(), name)),
            )
    })
}

/// Every enforced limit of `tiers` with its kind and tier name (shadow limits left out: they
/// never refuse, lease or show in headers).
pub(super) fn all_limits<'a>(
    tiers: &'a [&'a Tier],
) -> impl Iterator<Item = (Kind, Limit, &'a str)> + 'a {
    every_limit(tiers).filter(|(_, l, _)| !l.shadow)
}

/// Every shadow limit of `tiers`: evaluated, never refusing.
pub(super) fn shadow_limits<'a>(
    tiers: &'a [&'a Tier],
) -> impl Iterator<Item = (Kind, Limit, &'a str)> + 'a {
    every_limit(tiers).filter(|(_, l, _)| l.shadow)
}

/// `tiers` without repeats (by name), order kept.
pub(super) fn distinct<'a>(tiers: &[&'a Tier]) -> SmallVec<[&'a Tier; 2]> {
    let mut out: SmallVec<[&Tier; 2]> = SmallVec::new();
    for t in tiers {
        if !out.iter().any(|o| o.name == t.name) {
            out.push(t);
        }
    }
    out
}

/// The distinct (kind, window) counters of `tiers`.
pub(super) fn windows(tiers: &[&Tier]) -> SmallVec<[(Kind, Window); 8]> {
    let mut out: SmallVec<[(Kind, Window); 8]> = SmallVec::new();
    // Shadow limits count too: a shadow-only window has its own counter (in this gateway's
    // shared data; no lease, as nothing is enforced on it).
    for (kind, l, _) in every_limit(tiers) {
        if !out.contains(&(kind, l.window)) {
            out.push((kind, l.window));
        }
    }
    out
}

/// True when `tiers` have any window (an admission then writes the counter slot): any limit,
/// enforced or shadow, has one (no counters listed for it).
pub(crate) fn has_windows(tiers: &[&Tier]) -> bool {
    every_limit(tiers).next().is_some()
}

/// (kind, window, tightest limit, that limit's tier) of each distinct counter.
pub(super) type LeaseCounters<'a> = SmallVec<[(Kind, Window, u64, &'a str); 8]>;

/// The distinct counters of `tiers` with their tightest limit (and that limit's tier).
pub(super) fn lease_counters<'a>(tiers: &'a [&'a Tier]) -> LeaseCounters<'a> {
    let mut out = LeaseCounters::new();
    for (kind, l, tier) in all_limits(tiers) {
        match out
            .iter_mut()
            .find(|(k, w, _, _)| *k == kind && *w == l.window)
        {
            Some(c) if l.limit < c.2 => {
                c.2 = l.limit;
                c.3 = tier;
            }
            Some(_) => {}
            None => out.push((kind, l.window, l.limit, tier)),
        }
    }
    out
}
