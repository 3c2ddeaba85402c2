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
    pub(crate) reserved: u64,
    /// (window seconds, window start) of each token counter the reservation went into.
    pub(crate) token_windows: SmallVec<[(u64, u64); 4]>,
}

/// A reservation settled but not written yet: `reserved` tokens of token window `window` (s)
/// starting at `start` settled to `actual`. Several of one window add up (both sums).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub(crate) window: u64,
    pub(crate) start: u64,
    pub(crate) reserved: u64,
    pub(crate) actual: u64,
}

impl Reservation {
    /// Settling this reservation to `actual`, per token window it went into.
    pub(crate) fn settled(&self, actual: u64) -> impl Iterator<Item = Settled> + '_ {
        self.token_windows
            .iter()
            .map(move |&(window, start)| Settled {
                window,
                start,
                reserved: self.reserved,
                actual,
            })
    }
}

/// Applies a settlement to `records` at `now`: in its window, `reserved` is replaced by
/// `actual`; if that window is over, `actual` counts in the current one (the tokens were used
/// now). True when the records changed.
fn apply_settled(records: &mut Records, s: &Settled, now: u64) -> bool {
    let current = now - now % s.window.max(1);
    let rec = records
        .iter_mut()
        .find(|x| x.kind == Kind::Tokens.code() && x.window == s.window);
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
                kind: Kind::Tokens.code(),
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

/// Settles a reservation to the tokens really used: in every token window the reservation went
/// into, `reserved` is replaced by `actual`; if that window is over, `actual` counts in the
/// current one (the tokens were used now).
pub(crate) fn settle(store: &dyn SharedStore, r: &Reservation, actual: u64, now: u64) {
    let settled: SmallVec<[Settled; 4]> = r.settled(actual).collect();
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
