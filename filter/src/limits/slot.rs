//! The counter slot: the shared-data key a subject hashes into, the value's layout read in
//! place, and the one compare-and-swap update ([`update`]) every write of a slot goes through.
//!
//! Slot value: `version(1) = 4`, then per subject `len(u16 LE) subject n(u8)` and `n` 49-byte
//! records: kind (u8: 0 requests, 1 tokens, 2 cost), window seconds, window start, count, granted, others,
//! since (u64 LE; `since`: when this replica first admitted in this window, 0 before). A record
//! whose start is not the current window's counts 0 everywhere (count, lease, others). Version 3
//! slots (41-byte records, no `since`) and version 2 slots (25-byte records, no lease) are still
//! read (since 0, lease 0).

use crate::cache::CAS_ATTEMPTS;
use crate::store::{SharedStore, read_u64};
use maas_types::Window;
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

/// Default of pluginConfig `limits.counterSlots`.
pub(crate) const DEFAULT_COUNTER_SLOTS: u64 = 65_536;

/// Subjects one counter slot holds at most (beyond: 503, never a dropped live count).
pub(super) const SLOT_SUBJECTS: usize = 16;

pub(super) const SLOT_VERSION: u8 = 4;
const RECORD: usize = 49;
/// Records of version 3 slots (no `since`).
const RECORD_V3: usize = 41;
/// Records of version 2 slots (no lease fields).
const RECORD_V2: usize = 25;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
    /// Money in nano-units ([`maas_types::money`]).
    Cost,
}

impl Kind {
    pub(super) fn code(self) -> u8 {
        match self {
            Kind::Requests => 0,
            Kind::Tokens => 1,
            Kind::Cost => 2,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Requests => "requests",
            Kind::Tokens => "tokens",
            Kind::Cost => "cost",
        }
    }

    /// The lease contract's kind.
    pub(crate) fn lease_kind(self) -> maas_types::lease::LeaseKind {
        match self {
            Kind::Requests => maas_types::lease::LeaseKind::Requests,
            Kind::Tokens => maas_types::lease::LeaseKind::Tokens,
            Kind::Cost => maas_types::lease::LeaseKind::Cost,
        }
    }
}

/// The slot (`0..slots`) that holds `subject`'s counters.
pub(super) fn slot_of(subject: &str, slots: u64) -> u64 {
    let digest = Sha256::digest(subject.as_bytes());
    let first: [u8; 8] = digest
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .unwrap_or_default();
    u64::from_le_bytes(first) % slots.max(1)
}

/// The shared-data key of `subject`'s counter slot.
pub(crate) fn counter_key(subject: &str, slots: u64) -> String {
    format!("maas/l/{}", slot_of(subject, slots))
}

/// Text held inline up to 32 bytes (a [`counter_key`] is at most 27, most subjects fit), on
/// the heap beyond: a reservation and a slot read carry their key and subject without
/// allocating.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum InlineStr {
    Inline(arrayvec::ArrayString<32>),
    Heap(Box<str>),
}

impl InlineStr {
    pub(super) fn new(s: &str) -> Self {
        match arrayvec::ArrayString::from(s) {
            Ok(inline) => InlineStr::Inline(inline),
            Err(_) => InlineStr::Heap(s.into()),
        }
    }

    /// No UTF-8 check on each read (it was one per read: several per request).
    pub(crate) fn as_str(&self) -> &str {
        match self {
            InlineStr::Inline(s) => s.as_str(),
            InlineStr::Heap(s) => s,
        }
    }
}

impl std::fmt::Debug for InlineStr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// One window's counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Record {
    pub(super) kind: u8,
    pub(super) window: u64,
    pub(super) start: u64,
    pub(super) count: u64,
    /// Lease this replica holds in this window (global limits).
    pub(super) granted: u64,
    /// Global taken minus `granted` as of the last answer (headers only).
    pub(super) others: u64,
    /// When this replica first admitted in this window (Unix s; 0: not yet): its rate in the
    /// window is count ÷ (now − since), whenever in the window it started.
    pub(super) since: u64,
}

impl Record {
    /// Still counts at `now` (its window is not over and it holds a count, a lease or what
    /// other replicas took).
    fn live(&self, now: u64) -> bool {
        (self.count > 0 || self.granted > 0 || self.others > 0)
            && self.start.saturating_add(self.window) > now
    }
}

/// One subject's records, inline (a subject has a few windows: no allocation per request).
pub(super) type Records = SmallVec<[Record; 4]>;

impl Record {
    /// A stored record of `size` bytes; fields a smaller (older) record does not have read 0.
    fn read(r: &[u8], size: usize) -> Option<Record> {
        let field = |at: usize| {
            if size >= at + 8 {
                read_u64(r, at)
            } else {
                Some(0)
            }
        };
        Some(Record {
            kind: *r.first()?,
            window: read_u64(r, 1)?,
            start: read_u64(r, 9)?,
            count: read_u64(r, 17)?,
            granted: field(25)?,
            others: field(33)?,
            since: field(41)?,
        })
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.push(self.kind);
        for v in [
            self.window,
            self.start,
            self.count,
            self.granted,
            self.others,
            self.since,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// One subject's entry of a slot value, read in place.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry<'a> {
    subject: &'a str,
    /// Its `n` records.
    records: &'a [u8],
    /// The whole entry as stored (length, subject, n, records).
    raw: &'a [u8],
}

/// A slot value checked whole (every entry readable: one that is not makes the value
/// unreadable, never guessed at), read in place: nothing is copied out but the records of the
/// subject being updated.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot<'a> {
    /// The entries (the value after its version byte).
    entries: &'a [u8],
    /// Record size of the value's version.
    size: usize,
}

impl<'a> Slot<'a> {
    /// `None` when the value is not one this version wrote.
    pub(super) fn parse(v: Option<&'a [u8]>) -> Option<Self> {
        let b = match v {
            None | Some([]) => {
                return Some(Slot {
                    entries: &[],
                    size: RECORD,
                });
            }
            Some(b) => b,
        };
        let (&version, entries) = b.split_first()?;
        let size = match version {
            SLOT_VERSION => RECORD,
            3 => RECORD_V3,
            2 => RECORD_V2,
            _ => return None,
        };
        let slot = Slot { entries, size };
        let mut rest = entries;
        while !rest.is_empty() {
            rest = slot.entry(rest)?.1;
        }
        Some(slot)
    }

    /// The entry at the start of `rest`, and what follows it.
    fn entry(&self, rest: &'a [u8]) -> Option<(Entry<'a>, &'a [u8])> {
        let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
        let subject = std::str::from_utf8(rest.get(2..2 + len)?).ok()?;
        let n = usize::from(*rest.get(2 + len)?);
        let at = 3 + len;
        let end = at + n * self.size;
        let entry = Entry {
            subject,
            records: rest.get(at..end)?,
            raw: rest.get(..end)?,
        };
        Some((entry, rest.get(end..)?))
    }

    pub(super) fn entries(self) -> impl Iterator<Item = Entry<'a>> {
        let mut rest = self.entries;
        std::iter::from_fn(move || {
            let (entry, next) = self.entry(rest)?;
            rest = next;
            Some(entry)
        })
    }

    fn records(self, e: Entry<'a>) -> impl Iterator<Item = Record> + Clone + 'a {
        let size = self.size;
        e.records
            .chunks_exact(size)
            .filter_map(move |r| Record::read(r, size))
    }
}

/// Why counters could not be updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotError {
    /// The slot holds a value this version cannot read.
    Unreadable,
    /// The slot holds [`SLOT_SUBJECTS`] subjects with live counts.
    Full,
    /// Every CAS write of an [`update`] found the slot changed since it was read.
    Contended,
}

/// A slot read for an update: the value in place and `subject`'s records.
pub(super) struct SlotView<'a> {
    slot: Slot<'a>,
    /// The position of `subject`'s entry (replaced when the slot is written).
    mine_at: Option<usize>,
    pub(super) mine: Records,
}

pub(super) fn read_slot<'a>(
    value: Option<&'a [u8]>,
    subject: &str,
) -> Result<SlotView<'a>, SlotError> {
    let slot = Slot::parse(value).ok_or(SlotError::Unreadable)?;
    let mut view = SlotView {
        slot,
        mine_at: None,
        mine: Records::new(),
    };
    if let Some((i, e)) = slot
        .entries()
        .enumerate()
        .find(|(_, e)| e.subject == subject)
    {
        view.mine_at = Some(i);
        view.mine = slot.records(e).collect();
    }
    Ok(view)
}

thread_local! {
    /// The worker's buffer for slot values being written (a write allocates nothing once it
    /// has grown to the slots' usual size).
    static SLOT_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with the worker's slot buffer (a fresh one if it is in use).
fn with_slot_buffer<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    SLOT_BUFFER.with(|b| match b.try_borrow_mut() {
        Ok(mut buf) => {
            let out = f(&mut buf);
            // A rare large slot does not stay held by the worker.
            if buf.capacity() > 16 * 1024 {
                *buf = Vec::new();
            }
            out
        }
        Err(_) => f(&mut Vec::new()),
    })
}

impl SlotView<'_> {
    /// Writes into `out` the slot value with `subject`'s records replaced by `records`;
    /// subjects (and records) whose windows are all over are dropped; no room for a subject
    /// with live counts → Full.
    fn write(
        &self,
        subject: &str,
        records: &[Record],
        now: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), SlotError> {
        out.clear();
        out.reserve(
            1 + self.slot.entries.len() / self.slot.size * RECORD
                + 3
                + subject.len()
                + records.len() * RECORD,
        );
        out.push(SLOT_VERSION);
        let mut others = 0usize;
        for (i, e) in self.slot.entries().enumerate() {
            if Some(i) == self.mine_at || !self.slot.records(e).any(|r| r.live(now)) {
                continue;
            }
            others += 1;
            if self.slot.size == RECORD {
                out.extend_from_slice(e.raw);
            } else {
                push_entry(out, e.subject, self.slot.records(e));
            }
        }
        let live = records.iter().copied().filter(|r| r.live(now));
        if live.clone().next().is_some() {
            if others >= SLOT_SUBJECTS {
                return Err(SlotError::Full);
            }
            push_entry(out, subject, live);
        }
        Ok(())
    }
}

/// Writes `view` with `subject`'s `records` by CAS: `Ok(false)` when the slot changed since it
/// was read (read it again).
fn write_slot(
    store: &dyn SharedStore,
    key: &str,
    view: &SlotView,
    subject: &str,
    records: &[Record],
    now: u64,
    cas: Option<u32>,
) -> Result<bool, SlotError> {
    with_slot_buffer(|buf| {
        view.write(subject, records, now, buf)?;
        Ok(store.set(key, buf, cas).is_ok())
    })
}

/// Appends one subject's entry (at most 255 records, the subject cut to 65535 bytes).
fn push_entry(out: &mut Vec<u8>, subject: &str, records: impl Iterator<Item = Record> + Clone) {
    let subject = subject.as_bytes();
    let len = subject.len().min(usize::from(u16::MAX));
    let n = records.clone().count().min(usize::from(u8::MAX));
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(subject.get(..len).unwrap_or_default());
    out.push(n as u8);
    for r in records.take(n) {
        r.write(out);
    }
}

/// A counter slot as read (value and CAS token): the next update of that slot may start from
/// it instead of reading again. Its CAS write only succeeds if nothing was written since; when
/// something was, the update reads the slot again (so nothing is ever decided on a stale count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotRead {
    key: InlineStr,
    value: Option<Vec<u8>>,
    cas: u32,
}

impl SlotRead {
    /// The slot `key` as read: none when it was never written (its first write cannot be a
    /// CAS, so it must not start from an old read).
    pub(super) fn new(key: &str, value: Option<Vec<u8>>, cas: Option<u32>) -> Option<Self> {
        cas.map(|cas| SlotRead {
            key: InlineStr::new(key),
            value,
            cas,
        })
    }
}

/// What an edit of a subject's records decided.
pub(super) enum Edit<T> {
    /// Write the edited records by CAS; `T` is the update's outcome once they are written.
    Write(T),
    /// Leave the slot as it is (nothing changed, or nothing is to be counted): `T` is the
    /// update's outcome at once.
    Keep(T),
}

impl<T> Edit<T> {
    /// Write when the edit `changed` the records, else keep the slot as it is.
    pub(super) fn write_if(changed: bool, out: T) -> Self {
        if changed {
            Edit::Write(out)
        } else {
            Edit::Keep(out)
        }
    }
}

/// The one read → edit → compare-and-swap loop over a counter slot: reads slot `key` (or starts
/// from `read`, a read of that same slot kept from earlier: a read of another slot is not
/// used), hands `edit` `subject`'s records, and writes them back by CAS when it says so. A CAS
/// write that finds the slot changed since it was read reads again and edits again (so nothing
/// is decided on a stale count), at most [`CAS_ATTEMPTS`] times: then
/// [`SlotError::Contended`]. An unreadable slot, or a full one that cannot take `subject`'s live
/// records, ends the update at once (never a guess, never a dropped live count).
pub(super) fn update<T>(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    now: u64,
    read: Option<SlotRead>,
    mut edit: impl FnMut(&mut Records) -> Edit<T>,
) -> Result<T, SlotError> {
    let mut read = read.filter(|r| r.key.as_str() == key);
    for _ in 0..CAS_ATTEMPTS {
        // A CAS write from an earlier read fails if the slot changed since: then read again.
        let (value, cas) = match read.take() {
            Some(r) => (r.value, Some(r.cas)),
            None => store.get(key),
        };
        let mut view = read_slot(value.as_deref(), subject)?;
        let mut records = std::mem::take(&mut view.mine);
        match edit(&mut records) {
            Edit::Keep(out) => return Ok(out),
            Edit::Write(out) => {
                if write_slot(store, key, &view, subject, &records, now, cas)? {
                    return Ok(out);
                }
            }
        }
    }
    Err(SlotError::Contended)
}

/// The record of `kind`/`window` in `records` for the window current at `now` (none when absent
/// or from an older window).
pub(super) fn current(records: &[Record], kind: Kind, window: Window, now: u64) -> Option<&Record> {
    let start = window.start_of(now);
    records
        .iter()
        .find(|r| r.kind == kind.code() && r.window == window.seconds())
        .filter(|r| r.start == start)
}

/// Count of `kind`/`window` in `records` at `now` (0 when absent or from an older window).
pub(super) fn used(records: &[Record], kind: Kind, window: Window, now: u64) -> u64 {
    current(records, kind, window, now).map_or(0, |r| r.count)
}

/// Used globally as far as this replica knows: its count plus the other replicas' taken.
pub(super) fn used_globally(records: &[Record], kind: Kind, window: Window, now: u64) -> u64 {
    current(records, kind, window, now).map_or(0, |r| r.count.saturating_add(r.others))
}
