//! Settlements a worker folds into its next write of the subject's counter slot instead of
//! writing each one (issue 14): a busy subject's request then costs one slot write, at
//! admission, instead of two (admission, then settlement at the end of the response).
//!
//! What folds: a *refund* only — a reservation settled, in the window it was reserved in, to no
//! more than it reserved — and only for a subject this worker admits often (at least
//! [`HOT_ADMISSIONS`] admissions over the last two ticks), for at most [`MAX_SUBJECTS`]
//! subjects. Anything else (usage above the reservation, a settlement after its window, a
//! quiet subject) is written at once, as before. This worker's own precheck and admission apply
//! the folded refunds to the slot as they read it, and the admission's write carries them; every
//! tick writes what is still folded. So the worker's own requests (and their `x-ratelimit-*`
//! headers) never see a refund late; other workers see the count higher than it is by those
//! refunds for at most one tick: stricter for a moment, never an overshoot.

use crate::limits::{self, Reservation, Settled, Used};
use crate::store::SharedStore;
use smallvec::SmallVec;

/// Admissions of a subject over the last two ticks from which its refunds fold.
pub const HOT_ADMISSIONS: u32 = 8;

/// Subjects a worker tracks at most (beyond: their settlements are written at once).
pub const MAX_SUBJECTS: usize = 1024;

/// The folded settlements of one subject, per token window.
pub type Folded = SmallVec<[Settled; 2]>;

#[derive(Debug, Default)]
struct Subject {
    /// The subject's counter slot (what is folded belongs to it).
    key: Box<str>,
    admitted_this_tick: u32,
    admitted_last_tick: u32,
    folded: Folded,
}

impl Subject {
    fn hot(&self) -> bool {
        self.admitted_this_tick
            .saturating_add(self.admitted_last_tick)
            >= HOT_ADMISSIONS
    }
}

/// One worker's folded settlements and recent admissions per subject.
#[derive(Debug, Default)]
pub struct Folds {
    subjects: crate::FastMap<Box<str>, Subject>,
}

impl Folds {
    /// What is folded for `subject` in slot `key` (its precheck and admission apply it).
    pub fn pending(&self, key: &str, subject: &str) -> Folded {
        match self.subjects.get(subject) {
            Some(s) if &*s.key == key => s.folded.clone(),
            _ => Folded::new(),
        }
    }

    /// An admission of `subject` was written to slot `key` with what was folded for it (as
    /// [`Self::pending`] gave it in the same callback): nothing is folded any more.
    pub fn admitted(&mut self, key: &str, subject: &str) {
        let room = self.subjects.len() < MAX_SUBJECTS;
        match self.subjects.get_mut(subject) {
            Some(s) if &*s.key == key => {
                s.admitted_this_tick = s.admitted_this_tick.saturating_add(1);
                s.folded.clear();
            }
            // Its slot moved (a new `counterSlots`): what is folded is the tick's to write.
            Some(_) => {}
            None if room => {
                self.subjects.insert(
                    subject.into(),
                    Subject {
                        key: key.into(),
                        admitted_this_tick: 1,
                        ..Subject::default()
                    },
                );
            }
            None => {}
        }
    }

    /// Folds the settlement of `r` to `actual` (at `now`, Unix s) when it is a refund of a hot
    /// subject in the window it was reserved in; false: the caller writes it now.
    pub fn fold(&mut self, r: &Reservation, used: Used, now: u64) -> bool {
        if !r.refunds(used) || r.windows.is_empty() {
            return false;
        }
        let Some(s) = self.subjects.get_mut(r.subject.as_str()) else {
            return false;
        };
        let in_window = r
            .windows
            .iter()
            .all(|&(_, window, start)| start == now - now % window.max(1));
        if &*s.key != r.key.as_str() || !s.hot() || !in_window {
            return false;
        }
        for f in r.settled(used) {
            match s
                .folded
                .iter_mut()
                .find(|x| x.kind == f.kind && x.window == f.window && x.start == f.start)
            {
                Some(x) => {
                    x.reserved = x.reserved.saturating_add(f.reserved);
                    x.actual = x.actual.saturating_add(f.actual);
                }
                None => s.folded.push(f),
            }
        }
        true
    }

    /// The tick: writes what is still folded (one read and CAS write per such subject), and
    /// forgets subjects not admitted since the last tick.
    pub fn tick(&mut self, store: &dyn SharedStore, now: u64) {
        self.subjects.retain(|subject, s| {
            if !s.folded.is_empty() {
                limits::settle_folded(store, &s.key, subject, &s.folded, now);
                s.folded.clear();
            }
            s.admitted_last_tick = std::mem::take(&mut s.admitted_this_tick);
            s.admitted_last_tick > 0
        });
    }

    /// Subjects tracked (tests, bounds).
    pub fn len(&self) -> usize {
        self.subjects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.subjects.is_empty()
    }
}

#[cfg(test)]
mod tests;
