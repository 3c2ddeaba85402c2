//! A subject's counters read back, for tests (production reads them only to decide).

use super::counters::distinct;
use super::headers::{RateHeaders, WindowState};
use super::slot::{Kind, counter_key, read_slot};
use crate::store::SharedStore;
use maas_types::Tier;

/// (count, granted, others) of `subject`'s counter `kind`/`window` now.
pub(crate) fn lease_state(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    kind: Kind,
    window: u64,
    now: u64,
) -> (u64, u64, u64) {
    let (value, _) = store.get(key);
    let Ok(view) = read_slot(value.as_deref(), subject) else {
        return (0, 0, 0);
    };
    let start = now - now % window.max(1);
    view.mine
        .iter()
        .find(|r| r.kind == kind.code() && r.window == window && r.start == start)
        .map_or((0, 0, 0), |r| (r.count, r.granted, r.others))
}

/// The tightest token window of `tiers` now.
pub(crate) fn token_state(
    store: &dyn SharedStore,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
    slots: u64,
) -> Option<WindowState> {
    let (value, _) = store.get(&counter_key(subject, slots));
    let view = read_slot(value.as_deref(), subject).ok()?;
    RateHeaders::from_records(&distinct(tiers), &view.mine, now).tokens
}
