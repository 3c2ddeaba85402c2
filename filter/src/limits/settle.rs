//! Settlement: a reservation's tokens replaced by the tokens really used, written at the end of
//! the response or folded into the subject's next write ([`crate::folds`]).

use super::slot::{self, Edit, InlineStr, Kind, Record, Records};
use crate::store::SharedStore;
use smallvec::SmallVec;

/// What was taken at admission, to settle at the end of the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub(crate) subject: InlineStr,
    /// The subject's counter slot.
    pub(crate) key: InlineStr,
    /// Tokens reserved in each token window (weighted).
    pub(crate) reserved: u64,
    /// Money reserved in each cost window (nano-units).
    pub(crate) reserved_cost: u64,
    /// (kind — tokens or cost —, window seconds, window start) of each counter the reservation
    /// went into.
    pub(crate) windows: SmallVec<[(Kind, u64, u64); 4]>,
}

/// What a response really used, in the counters' units: weighted tokens and nano-units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Used {
    pub tokens: u64,
    pub cost: u64,
}

impl Used {
    /// Tokens only (no money budget applies, or a test).
    pub fn tokens(tokens: u64) -> Used {
        Used { tokens, cost: 0 }
    }
}

/// A reservation settled but not written yet: `reserved` of the `kind` window `window` (s)
/// starting at `start` settled to `actual`. Several of one window add up (both sums).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub(crate) kind: Kind,
    pub(crate) window: u64,
    pub(crate) start: u64,
    pub(crate) reserved: u64,
    pub(crate) actual: u64,
}

impl Reservation {
    /// Settling this reservation to `used`, per token and cost window it went into.
    pub(crate) fn settled(&self, used: Used) -> impl Iterator<Item = Settled> + '_ {
        self.windows.iter().map(move |&(kind, window, start)| {
            let (reserved, actual) = match kind {
                Kind::Cost => (self.reserved_cost, used.cost),
                _ => (self.reserved, used.tokens),
            };
            Settled {
                kind,
                window,
                start,
                reserved,
                actual,
            }
        })
    }

    /// `used` is no more than what was reserved, in every unit (a refund, or exact).
    pub(crate) fn refunds(&self, used: Used) -> bool {
        used.tokens <= self.reserved && used.cost <= self.reserved_cost
    }
}

/// Applies a settlement to `records` at `now`: in its window, `reserved` is replaced by
/// `actual`; if that window is over, `actual` counts in the current one (the tokens were used
/// now). True when the records changed.
fn apply_settled(records: &mut Records, s: &Settled, now: u64) -> bool {
    let current = now - now % s.window.max(1);
    let rec = records
        .iter_mut()
        .find(|x| x.kind == s.kind.code() && x.window == s.window);
    let (new_start, new_count) = match &rec {
        Some(x) if x.start == s.start && s.start == current => (
            s.start,
            x.count.saturating_sub(s.reserved).saturating_add(s.actual),
        ),
        Some(x) if x.start == current => (current, x.count.saturating_add(s.actual)),
        _ => (current, s.actual),
    };
    match rec {
        Some(x) => {
            if x.start == new_start && x.count == new_count {
                return false;
            }
            if x.start != new_start {
                // An older window's lease is over with it.
                x.granted = 0;
                x.others = 0;
                x.since = now;
            } else if x.since == 0 {
                x.since = now;
            }
            x.start = new_start;
            x.count = new_count;
            true
        }
        None => {
            records.push(Record {
                kind: s.kind.code(),
                window: s.window,
                start: new_start,
                count: new_count,
                granted: 0,
                others: 0,
                since: now,
            });
            true
        }
    }
}

/// Applies a folded settlement (a refund settled in its own window, see [`crate::folds`]):
/// as [`apply_settled`] while that window lasts; once it is over the refund is moot (its
/// window's count no longer matters).
pub(super) fn apply_folded(records: &mut Records, s: &Settled, now: u64) -> bool {
    let current = now - now % s.window.max(1);
    s.start == current && apply_settled(records, s, now)
}

/// Settles a reservation to what was really used: in every token (cost) window the
/// reservation went into, what was reserved is replaced by the tokens (money) used; if that
/// window is over, they count in the current one (they were used now).
pub(crate) fn settle(store: &dyn SharedStore, r: &Reservation, used: Used, now: u64) {
    let settled: SmallVec<[Settled; 4]> = r.settled(used).collect();
    write_settled(
        store,
        r.key.as_str(),
        r.subject.as_str(),
        &settled,
        now,
        apply_settled,
    );
}

/// Writes folded settlements of `subject` (slot `key`): each while its window lasts.
pub(crate) fn settle_folded(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    settled: &[Settled],
    now: u64,
) {
    write_settled(store, key, subject, settled, now, apply_folded);
}

/// Writes `settled` into `subject`'s records with `apply`. Best effort: an unreadable slot, or
/// a full one (the subject's counters had all expired and others took the room), cannot take
/// the tokens: they go uncounted rather than displace a live count; so does persistent
/// contention.
fn write_settled(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    settled: &[Settled],
    now: u64,
    apply: fn(&mut Records, &Settled, u64) -> bool,
) {
    if settled.is_empty() {
        return;
    }
    let _ = slot::update(store, key, subject, now, None, |records| {
        let mut changed = false;
        for s in settled {
            changed |= apply(records, s, now);
        }
        Edit::write_if(changed, ())
    });
}
