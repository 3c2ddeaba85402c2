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
//! a slot's value holds the counters of at most [`SLOT_SUBJECTS`] subjects (the subject is stored
//! inside). Subjects whose windows are all over are dropped whenever a slot is written; when a
//! slot still has no room, admission is refused with 503 `limits_unavailable` — live counts are
//! never dropped (that would let someone escape a limit). Admitting a request is one read and
//! one compare-and-swap write of its slot, and settling it likewise.
//!
//! Slot value: `version(1) = 4`, then per subject `len(u16 LE) subject n(u8)` and `n` 49-byte
//! records: kind (u8: 0 requests, 1 tokens), window seconds, window start, count, granted, others,
//! since (u64 LE; `since`: when this replica first admitted in this window, 0 before). A record
//! whose start is not the current window's counts 0 everywhere (count, lease, others). Version 3
//! slots (41-byte records, no `since`) and version 2 slots (25-byte records, no lease) are still
//! read (since 0, lease 0).
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

use crate::cache::CAS_ATTEMPTS;
use crate::response::Refusal;
use crate::store::{SharedStore, read_u64};
use maas_types::{Limit, Tier, Window};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

/// Reserved when neither the request nor the tier names a max_tokens.
pub const FALLBACK_RESERVATION: u64 = 256;

/// Default of pluginConfig `limits.counterSlots`.
pub const DEFAULT_COUNTER_SLOTS: u64 = 65_536;

/// Subjects one counter slot holds at most (beyond: 503, never a dropped live count).
pub const SLOT_SUBJECTS: usize = 16;

const SLOT_VERSION: u8 = 4;
const RECORD: usize = 49;
/// Records of version 3 slots (no `since`).
const RECORD_V3: usize = 41;
/// Records of version 2 slots (no lease fields).
const RECORD_V2: usize = 25;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Requests => 0,
            Kind::Tokens => 1,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Kind::Requests => "requests",
            Kind::Tokens => "tokens",
        }
    }

    /// The lease contract's kind.
    pub fn lease_kind(self) -> maas_types::lease::LeaseKind {
        match self {
            Kind::Requests => maas_types::lease::LeaseKind::Requests,
            Kind::Tokens => maas_types::lease::LeaseKind::Tokens,
        }
    }
}

/// The slot (`0..slots`) that holds `subject`'s counters.
pub fn slot_of(subject: &str, slots: u64) -> u64 {
    let digest = Sha256::digest(subject.as_bytes());
    let first: [u8; 8] = digest
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .unwrap_or_default();
    u64::from_le_bytes(first) % slots.max(1)
}

/// The shared-data key of `subject`'s counter slot.
pub fn counter_key(subject: &str, slots: u64) -> String {
    format!("maas/l/{}", slot_of(subject, slots))
}

/// Text held inline up to 32 bytes (a [`counter_key`] is at most 27, most subjects fit), on
/// the heap beyond: a reservation and a slot read carry their key and subject without
/// allocating.
#[derive(Clone, PartialEq, Eq)]
pub struct InlineStr(SmallVec<[u8; 32]>);

impl InlineStr {
    fn new(s: &str) -> Self {
        InlineStr(SmallVec::from_slice(s.as_bytes()))
    }

    pub fn as_str(&self) -> &str {
        // Always UTF-8: made from a `str`.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::fmt::Debug for InlineStr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// One window's counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    kind: u8,
    window: u64,
    start: u64,
    count: u64,
    /// Lease this replica holds in this window (global limits).
    granted: u64,
    /// Global taken minus `granted` as of the last answer (headers only).
    others: u64,
    /// When this replica first admitted in this window (Unix s; 0: not yet): its rate in the
    /// window is count ÷ (now − since), whenever in the window it started.
    since: u64,
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
type Records = SmallVec<[Record; 4]>;

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
struct Entry<'a> {
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
struct Slot<'a> {
    /// The entries (the value after its version byte).
    entries: &'a [u8],
    /// Record size of the value's version.
    size: usize,
}

impl<'a> Slot<'a> {
    /// `None` when the value is not one this version wrote.
    fn parse(v: Option<&'a [u8]>) -> Option<Self> {
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

    fn entries(self) -> impl Iterator<Item = Entry<'a>> {
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
enum SlotError {
    /// The slot holds a value this version cannot read.
    Unreadable,
    /// The slot holds [`SLOT_SUBJECTS`] subjects with live counts.
    Full,
}

/// A slot read for an update: the value in place and `subject`'s records.
struct SlotView<'a> {
    slot: Slot<'a>,
    /// The position of `subject`'s entry (replaced when the slot is written).
    mine_at: Option<usize>,
    mine: Records,
}

fn read_slot<'a>(value: Option<&'a [u8]>, subject: &str) -> Result<SlotView<'a>, SlotError> {
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

/// The record of `kind`/`window` in `records` for the window current at `now` (none when absent
/// or from an older window).
fn current(records: &[Record], kind: Kind, window: Window, now: u64) -> Option<&Record> {
    let start = window.start_of(now);
    records
        .iter()
        .find(|r| r.kind == kind.code() && r.window == window.seconds())
        .filter(|r| r.start == start)
}

/// Count of `kind`/`window` in `records` at `now` (0 when absent or from an older window).
fn used(records: &[Record], kind: Kind, window: Window, now: u64) -> u64 {
    current(records, kind, window, now).map_or(0, |r| r.count)
}

/// Used globally as far as this replica knows: its count plus the other replicas' taken.
fn used_globally(records: &[Record], kind: Kind, window: Window, now: u64) -> u64 {
    current(records, kind, window, now).map_or(0, |r| r.count.saturating_add(r.others))
}

/// State of one window after a decision, for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowState {
    pub limit: u64,
    pub used: u64,
    pub reset_seconds: u64,
}

impl WindowState {
    pub fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used)
    }
}

/// The tightest request and token windows (least remaining), when the tiers have such limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub requests: Option<WindowState>,
    pub tokens: Option<WindowState>,
}

/// Every limit of `tiers` with its kind and tier name.
fn all_limits<'a>(tiers: &'a [&'a Tier]) -> impl Iterator<Item = (Kind, &'a Limit, &'a str)> + 'a {
    tiers.iter().flat_map(|t| {
        let name = t.name.as_str();
        t.limits
            .requests
            .iter()
            .map(move |l| (Kind::Requests, l, name))
            .chain(t.limits.tokens.iter().map(move |l| (Kind::Tokens, l, name)))
    })
}

impl RateHeaders {
    fn note(slot: &mut Option<WindowState>, w: WindowState) {
        match slot {
            Some(cur) if cur.remaining() <= w.remaining() => {}
            _ => *slot = Some(w),
        }
    }

    fn from_records(tiers: &[&Tier], records: &[Record], now: u64) -> Self {
        let mut h = RateHeaders::default();
        for (kind, l, _) in all_limits(tiers) {
            let w = WindowState {
                limit: l.limit,
                used: used_globally(records, kind, l.window, now),
                reset_seconds: l.window.seconds_left(now),
            };
            match kind {
                Kind::Requests => Self::note(&mut h.requests, w),
                Kind::Tokens => Self::note(&mut h.tokens, w),
            }
        }
        h
    }

    /// `x-ratelimit-*` headers as OpenAI sends them, each handed to `f` (formatted on the
    /// stack: per request on every response, nothing allocated).
    pub fn each(&self, mut f: impl FnMut(&'static str, &str)) {
        let [limit, remaining, reset] = REQUEST_RATE_HEADERS;
        if let Some(r) = self.requests {
            f(limit, Short::decimal(r.limit).as_str());
            f(remaining, Short::decimal(r.remaining()).as_str());
            f(reset, Short::duration(r.reset_seconds).as_str());
        }
        let [limit, remaining, reset] = TOKEN_RATE_HEADERS;
        if let Some(t) = self.tokens {
            f(limit, Short::decimal(t.limit).as_str());
            f(remaining, Short::decimal(t.remaining()).as_str());
            f(reset, Short::duration(t.reset_seconds).as_str());
        }
    }

    /// Whether [`Self::each`] hands over a header `name` (any case).
    pub fn sends(&self, name: &str) -> bool {
        let among = |names: [&str; 3]| names.iter().any(|n| n.eq_ignore_ascii_case(name));
        (self.requests.is_some() && among(REQUEST_RATE_HEADERS))
            || (self.tokens.is_some() && among(TOKEN_RATE_HEADERS))
    }

    /// [`Self::each`] as owned pairs (a refusal's headers).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(6);
        self.each(|name, value| out.push((name, value.to_string())));
        out
    }
}

/// The `x-ratelimit-*` names of request windows and of token windows (limit, remaining, reset).
const REQUEST_RATE_HEADERS: [&str; 3] = [
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
];
const TOKEN_RATE_HEADERS: [&str; 3] = [
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
];

/// A short ASCII text on the stack: a number or a duration (without the formatting machinery,
/// which is slow inside the VM, and without allocating). Holds the longest duration of a u64.
struct Short {
    bytes: [u8; 32],
    len: usize,
}

impl Short {
    fn new() -> Self {
        Short {
            bytes: [0; 32],
            len: 0,
        }
    }

    fn push(&mut self, b: u8) {
        if let Some(slot) = self.bytes.get_mut(self.len) {
            *slot = b;
            self.len += 1;
        }
    }

    /// Appends `n` in decimal.
    fn push_decimal(&mut self, n: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut n = n;
        loop {
            at -= 1;
            if let Some(d) = digits.get_mut(at) {
                *d = b'0' + (n % 10) as u8;
            }
            n /= 10;
            if n == 0 || at == 0 {
                break;
            }
        }
        for &d in digits.get(at..).unwrap_or_default() {
            self.push(d);
        }
    }

    fn decimal(n: u64) -> Self {
        let mut out = Short::new();
        out.push_decimal(n);
        out
    }

    /// OpenAI-style duration: `59s`, `6m0s`, `1h2m3s`.
    fn duration(seconds: u64) -> Self {
        let (h, m, s) = (seconds / 3600, (seconds % 3600) / 60, seconds % 60);
        let mut out = Short::new();
        if h > 0 {
            out.push_decimal(h);
            out.push(b'h');
        }
        if h > 0 || m > 0 {
            out.push_decimal(m);
            out.push(b'm');
        }
        out.push_decimal(s);
        out.push(b's');
        out
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(self.bytes.get(..self.len).unwrap_or_default()).unwrap_or_default()
    }
}

/// OpenAI-style duration: `59s`, `6m0s`, `1h2m3s`.
pub fn duration(seconds: u64) -> String {
    Short::duration(seconds).as_str().to_string()
}

/// What was taken at admission, to settle at the end of the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub subject: InlineStr,
    /// The subject's counter slot.
    pub key: InlineStr,
    pub reserved: u64,
    /// (window seconds, window start) of each token counter the reservation went into.
    pub token_windows: SmallVec<[(u64, u64); 4]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    Allowed {
        reservation: Reservation,
        headers: RateHeaders,
    },
    /// A window is full: 429, nothing counted.
    Limited {
        kind: Kind,
        /// Seconds to the end of the (latest) blocking window.
        retry_after: u64,
        /// The tier whose limit blocks (the latest blocking window's).
        tier: String,
        headers: RateHeaders,
    },
    /// The reservation exceeds the limit of a token window: it can never fit. 400, nothing counted.
    TooLarge {
        requested: u64,
        limit: u64,
        window: Window,
        tier: String,
    },
    /// The counters cannot be updated (slot full of live subjects, unreadable, or persistent
    /// contention): 503, nothing counted.
    Unavailable { reason: &'static str },
    /// Global limits: the replica's lease of a counter is short (the limit is not reached):
    /// nothing counted; ask the companion for `items`, apply the grants, admit again.
    NeedsLease {
        items: Vec<LeaseNeed>,
        /// The first short counter's kind and tier (for a 429 when the lease stays short).
        kind: Kind,
        tier: String,
        headers: RateHeaders,
    },
}

/// One short counter: what to ask the companion for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseNeed {
    pub kind: Kind,
    pub window: u64,
    pub start: u64,
    /// The tightest limit of the applicable tiers for this counter.
    pub limit: u64,
    /// count + add − granted.
    pub need: u64,
    /// The replica's rate in this window × the lease horizon, within `need..=limit`.
    pub want: u64,
}

/// How leases bound admission (global limits on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeasePolicy {
    /// Fallback (companion unreachable): each counter's lease is at least `⌊limit × share⌋`, and
    /// a short lease is a 429 (no callout). `None`: the lease is what was granted.
    pub fallback_share: Option<f64>,
    /// `leaseHorizonMs`: prefetch sized by the rate × this.
    pub horizon_ms: u64,
    /// Retry-after (s) of a 429 for a short lease while the limit is not reached.
    pub short_retry_s: u64,
}

impl LeasePolicy {
    /// The lease of a counter with `limit` that holds `granted`, when the other replicas held
    /// `others` at the last answer. In fallback the local share is also capped by what the
    /// others did not hold (so that a replica that held a large lease and one that held little
    /// do not both add a full share on top), never below what this replica was granted.
    fn lease(&self, granted: u64, limit: u64, others: u64) -> u64 {
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
fn prefetch(count: u64, elapsed: u64, horizon_ms: u64, need: u64, limit: u64) -> u64 {
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
    pub fn observe(&mut self, start: u64, count: u64, now_ms: u64) -> Self {
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
    pub fn resumed(self) -> Self {
        Meter {
            at_ms: 0,
            per_s: self.peak_per_s.max(self.per_s),
            peak_per_s: 0,
            ..self
        }
    }

    /// What the recent rate uses over `horizon_ms`.
    pub fn for_horizon(&self, horizon_ms: u64) -> u64 {
        u64::try_from(u128::from(self.per_s) * u128::from(horizon_ms) / 1000).unwrap_or(u64::MAX)
    }
}

impl Admission {
    /// The refusal to answer with; `None` for an allowed request.
    pub fn into_refusal(self) -> Option<Refusal> {
        match self {
            Admission::Allowed { .. } => None,
            Admission::Limited {
                kind,
                retry_after,
                tier,
                headers,
            } => {
                let mut h: Vec<(String, String)> = headers
                    .headers()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                h.push(("retry-after".to_string(), retry_after.to_string()));
                Some(Refusal::rate_limited(
                    format!(
                        "rate limit reached for {} on tier {tier}: retry in {retry_after}s",
                        kind.as_str()
                    ),
                    h,
                ))
            }
            Admission::TooLarge {
                requested,
                limit,
                window,
                tier,
            } => Some(Refusal::bad_request(
                "tokens_exceed_limit",
                format!(
                    "this request reserves {requested} tokens (prompt estimate + max_tokens) but \
                     tier {tier} allows {limit} per {window}; lower max_tokens or shorten the prompt"
                ),
            )),
            Admission::Unavailable { reason } => Some(Refusal::unavailable(
                "limits_unavailable",
                format!("rate limit counters are unavailable ({reason}); retry shortly"),
            )),
            // A short lease that is not asked for (the caller's choice) refuses like a window
            // that is full for a moment.
            Admission::NeedsLease {
                kind,
                tier,
                headers,
                ..
            } => Admission::Limited {
                kind,
                retry_after: 1,
                tier,
                headers,
            }
            .into_refusal(),
        }
    }
}

/// Tokens to reserve: the request's cap (`None`: the body has none), else the tier default, else a
/// fallback.
pub fn reservation_for(max_tokens: Option<u64>, tier: &Tier) -> u64 {
    max_tokens
        .or(tier.default_max_tokens)
        .unwrap_or(FALLBACK_RESERVATION)
        .max(1)
}

/// `tiers` without repeats (by name), order kept.
fn distinct<'a>(tiers: &[&'a Tier]) -> SmallVec<[&'a Tier; 2]> {
    let mut out: SmallVec<[&Tier; 2]> = SmallVec::new();
    for t in tiers {
        if !out.iter().any(|o| o.name == t.name) {
            out.push(t);
        }
    }
    out
}

/// The distinct (kind, window) counters of `tiers`.
fn windows(tiers: &[&Tier]) -> SmallVec<[(Kind, Window); 8]> {
    let mut out: SmallVec<[(Kind, Window); 8]> = SmallVec::new();
    for (kind, l, _) in all_limits(tiers) {
        if !out.contains(&(kind, l.window)) {
            out.push((kind, l.window));
        }
    }
    out
}

fn slot_error(e: SlotError) -> Admission {
    Admission::Unavailable {
        reason: match e {
            SlotError::Unreadable => "unreadable counter slot",
            SlotError::Full => "counter slot full",
        },
    }
}

/// Admits one request of `subject`: `tiers` are the tiers whose windows apply — the tier the
/// request runs on first (named in the reservation), then the subject's highest tier (repeats
/// are ignored). Counts one request in every request window and reserves `reserve` tokens in
/// every token window — one read and one CAS write — or refuses without counting.
pub fn admit(
    store: &dyn SharedStore,
    tiers: &[&Tier],
    subject: &str,
    reserve: u64,
    now: u64,
    slots: u64,
) -> Admission {
    admit_in(
        store,
        &counter_key(subject, slots),
        tiers,
        subject,
        reserve,
        now,
    )
}

/// [`admit`] in the counter slot `key` (the subject's [`counter_key`], hashed by the caller).
pub fn admit_in(
    store: &dyn SharedStore,
    key: &str,
    tiers: &[&Tier],
    subject: &str,
    reserve: u64,
    now: u64,
) -> Admission {
    admit_from(store, key, tiers, subject, reserve, now, None)
}

/// A counter slot as read (value and CAS token): the next update of that slot may start from
/// it instead of reading again. Its CAS write only succeeds if nothing was written since; when
/// something was, the update reads the slot again (so nothing is ever decided on a stale count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRead {
    key: InlineStr,
    value: Option<Vec<u8>>,
    cas: u32,
}

/// [`admit_in`], starting from `read` (the same slot, read by [`precheck_read`]) when given.
pub fn admit_from(
    store: &dyn SharedStore,
    key: &str,
    tiers: &[&Tier],
    subject: &str,
    reserve: u64,
    now: u64,
    read: Option<SlotRead>,
) -> Admission {
    let ask = Ask {
        key,
        tiers,
        subject,
        reserve,
        now,
        settled: &[],
    };
    admit_leased(store, &ask, read, None)
}

/// One request to admit.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The subject's counter slot ([`counter_key`]).
    pub key: &'a str,
    /// The tier the request runs on first, then the subject's highest tier.
    pub tiers: &'a [&'a Tier],
    pub subject: &'a str,
    pub reserve: u64,
    /// Unix seconds.
    pub now: u64,
    /// Settlements of this subject this worker folded and did not write yet
    /// ([`crate::folds`]): applied to the slot as read, and written with the admission.
    pub settled: &'a [Settled],
}

/// (kind, window, tightest limit, that limit's tier) of each distinct counter.
type LeaseCounters<'a> = SmallVec<[(Kind, Window, u64, &'a str); 8]>;

/// The distinct counters of `tiers` with their tightest limit (and that limit's tier).
fn lease_counters<'a>(tiers: &'a [&'a Tier]) -> LeaseCounters<'a> {
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

/// The counters a tracked subject's batch reports: (kind, window seconds, tightest limit).
pub fn tracked_counters(tiers: &[&Tier]) -> Vec<LeaseCounter> {
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

/// [`admit_from`] with global limits (`lease`: `None` = off, exactly [`admit_from`]).
pub fn admit_leased(
    store: &dyn SharedStore,
    ask: &Ask,
    read: Option<SlotRead>,
    lease: Option<&LeasePolicy>,
) -> Admission {
    let Ask {
        key,
        tiers,
        subject,
        reserve,
        now,
        settled,
    } = *ask;
    let mut read = read.filter(|r| r.key.as_str() == key);
    let tiers = distinct(tiers);
    let counters = windows(&tiers);
    if counters.is_empty() {
        return Admission::Allowed {
            reservation: Reservation {
                subject: InlineStr::new(subject),
                key: InlineStr::new(key),
                reserved: reserve,
                token_windows: SmallVec::new(),
            },
            headers: RateHeaders::default(),
        };
    }
    // A reservation above a token window's limit can never fit: refuse without counting.
    if let Some((l, tier)) = all_limits(&tiers)
        .filter(|(k, l, _)| *k == Kind::Tokens && reserve > l.limit)
        .map(|(_, l, t)| (l, t))
        .min_by_key(|(l, _)| l.limit)
    {
        return Admission::TooLarge {
            requested: reserve,
            limit: l.limit,
            window: l.window,
            tier: tier.to_string(),
        };
    }
    let leased = lease.map(|_| lease_counters(&tiers)).unwrap_or_default();
    for _ in 0..CAS_ATTEMPTS {
        // A CAS write from an earlier read fails if the slot changed since: then read again.
        let (value, cas) = match read.take() {
            Some(r) => (r.value, Some(r.cas)),
            None => store.get(key),
        };
        let mut view = match read_slot(value.as_deref(), subject) {
            Ok(v) => v,
            Err(e) => return slot_error(e),
        };
        // This worker's folded settlements count as written (and are, with this admission).
        for f in settled {
            apply_folded(&mut view.mine, f, now);
        }
        let add = |kind: Kind| match kind {
            Kind::Requests => 1,
            Kind::Tokens => reserve,
        };
        let mut blocked: Option<(Kind, u64, &str)> = None;
        for (kind, l, tier) in all_limits(&tiers) {
            if used(&view.mine, kind, l.window, now).saturating_add(add(kind)) > l.limit {
                let retry = l.window.seconds_left(now);
                if blocked.is_none_or(|(_, r, _)| retry > r) {
                    blocked = Some((kind, retry, tier));
                }
            }
        }
        if let Some((kind, retry_after, tier)) = blocked {
            return Admission::Limited {
                kind,
                retry_after,
                tier: tier.to_string(),
                headers: RateHeaders::from_records(&tiers, &view.mine, now),
            };
        }
        // Global limits: every counter must fit in this replica's lease too.
        if let Some(policy) = lease {
            let mut items: Vec<LeaseNeed> = Vec::new();
            let mut first: Option<(Kind, &str, u64)> = None;
            for &(kind, window, limit, tier) in &leased {
                let rec = current(&view.mine, kind, window, now);
                let count = rec.map_or(0, |r| r.count);
                let granted = rec.map_or(0, |r| r.granted);
                let others = rec.map_or(0, |r| r.others);
                let after = count.saturating_add(add(kind));
                if after <= policy.lease(granted, limit, others) {
                    continue;
                }
                let start = window.start_of(now);
                let need = after.saturating_sub(granted);
                let since = rec.map_or(0, |r| r.since);
                let since = if since > 0 { since } else { now };
                items.push(LeaseNeed {
                    kind,
                    window: window.seconds(),
                    start,
                    limit,
                    need,
                    want: prefetch(
                        after,
                        now.saturating_sub(since),
                        policy.horizon_ms,
                        need,
                        limit,
                    ),
                });
                if first.is_none() {
                    first = Some((kind, tier, window.seconds_left(now)));
                }
            }
            if let Some((kind, tier, left)) = first {
                let headers = RateHeaders::from_records(&tiers, &view.mine, now);
                if policy.fallback_share.is_some() {
                    return Admission::Limited {
                        kind,
                        retry_after: policy.short_retry_s.clamp(1, left.max(1)),
                        tier: tier.to_string(),
                        headers,
                    };
                }
                return Admission::NeedsLease {
                    items,
                    kind,
                    tier: tier.to_string(),
                    headers,
                };
            }
        }
        let mut next: Records = view
            .mine
            .iter()
            .filter(|r| {
                !counters
                    .iter()
                    .any(|(k, w)| r.kind == k.code() && r.window == w.seconds())
            })
            .copied()
            .collect();
        for &(kind, window) in &counters {
            let (granted, others, since) = current(&view.mine, kind, window, now)
                .map_or((0, 0, 0), |r| (r.granted, r.others, r.since));
            next.push(Record {
                kind: kind.code(),
                window: window.seconds(),
                start: window.start_of(now),
                count: used(&view.mine, kind, window, now).saturating_add(add(kind)),
                granted,
                others,
                since: if since > 0 { since } else { now },
            });
        }
        let headers = RateHeaders::from_records(&tiers, &next, now);
        let written = match write_slot(store, key, &view, subject, &next, now, cas) {
            Ok(w) => w,
            Err(e) => return slot_error(e),
        };
        if written {
            return Admission::Allowed {
                reservation: Reservation {
                    subject: InlineStr::new(subject),
                    key: InlineStr::new(key),
                    reserved: reserve,
                    token_windows: counters
                        .iter()
                        .filter(|(k, _)| *k == Kind::Tokens)
                        .map(|(_, w)| (w.seconds(), w.start_of(now)))
                        .collect(),
                },
                headers,
            };
        }
    }
    // Persistent contention: refuse rather than count wrong.
    Admission::Unavailable {
        reason: "contention",
    }
}

/// Refusal that is certain before the body is read: a request window already full, or a token
/// window with no token left, in any of `tiers`. Read-only (one shared-data read); `admit`
/// decides for real later.
pub fn precheck(
    store: &dyn SharedStore,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
    slots: u64,
) -> Option<Admission> {
    precheck_in(store, &counter_key(subject, slots), tiers, subject, now)
}

/// [`precheck`] in the counter slot `key` (the subject's [`counter_key`], hashed by the caller).
pub fn precheck_in(
    store: &dyn SharedStore,
    key: &str,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
) -> Option<Admission> {
    precheck_read(store, key, tiers, subject, now).0
}

/// [`precheck_in`], with the slot as read (for [`admit_from`]; none when the slot was never
/// written: its first write cannot be a CAS, so it must not start from an old read).
pub fn precheck_read(
    store: &dyn SharedStore,
    key: &str,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
) -> (Option<Admission>, Option<SlotRead>) {
    precheck_folded(store, key, tiers, subject, now, &[])
}

/// [`precheck_read`] with this worker's folded settlements of the subject (`settled`) counted
/// as written.
pub fn precheck_folded(
    store: &dyn SharedStore,
    key: &str,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
    settled: &[Settled],
) -> (Option<Admission>, Option<SlotRead>) {
    let tiers = distinct(tiers);
    if windows(&tiers).is_empty() {
        return (None, None);
    }
    let (value, cas) = store.get(key);
    // An unreadable slot is `admit`'s to refuse.
    let Ok(mut view) = read_slot(value.as_deref(), subject) else {
        return (None, None);
    };
    for f in settled {
        apply_folded(&mut view.mine, f, now);
    }
    let mut blocked: Option<(Kind, u64, &str)> = None;
    for (kind, l, tier) in all_limits(&tiers) {
        if used(&view.mine, kind, l.window, now).saturating_add(1) > l.limit {
            let retry = l.window.seconds_left(now);
            if blocked.is_none_or(|(_, r, _)| retry > r) {
                blocked = Some((kind, retry, tier));
            }
        }
    }
    let refusal = blocked.map(|(kind, retry_after, tier)| Admission::Limited {
        kind,
        retry_after,
        tier: tier.to_string(),
        headers: RateHeaders::from_records(&tiers, &view.mine, now),
    });
    let read = cas.map(|cas| SlotRead {
        key: InlineStr::new(key),
        value,
        cas,
    });
    (refusal, read)
}

/// A reservation settled but not written yet: `reserved` tokens of token window `window` (s)
/// starting at `start` settled to `actual`. Several of one window add up (both sums).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub window: u64,
    pub start: u64,
    pub reserved: u64,
    pub actual: u64,
}

impl Reservation {
    /// Settling this reservation to `actual`, per token window it went into.
    pub fn settled(&self, actual: u64) -> impl Iterator<Item = Settled> + '_ {
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
fn apply_folded(records: &mut Records, s: &Settled, now: u64) -> bool {
    let current = now - now % s.window.max(1);
    s.start == current && apply_settled(records, s, now)
}

/// Settles a reservation to the tokens really used: in every token window the reservation went
/// into, `reserved` is replaced by `actual`; if that window is over, `actual` counts in the
/// current one (the tokens were used now).
pub fn settle(store: &dyn SharedStore, r: &Reservation, actual: u64, now: u64) {
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
pub fn settle_folded(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    settled: &[Settled],
    now: u64,
) {
    write_settled(store, key, subject, settled, now, apply_folded);
}

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
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(key);
        let Ok(view) = read_slot(value.as_deref(), subject) else {
            return;
        };
        let mut records = view.mine.clone();
        let mut changed = false;
        for s in settled {
            changed |= apply(&mut records, s, now);
        }
        if !changed {
            return;
        }
        // A full slot (the subject's counters had all expired and others took the room) cannot
        // take the tokens: they go uncounted rather than displace a live count.
        match write_slot(store, key, &view, subject, &records, now, cas) {
            Ok(true) | Err(_) => return,
            Ok(false) => {}
        }
    }
}

/// True when `tiers` have any window (an admission then writes the counter slot).
pub fn has_windows(tiers: &[&Tier]) -> bool {
    !windows(&distinct(tiers)).is_empty()
}

/// A counter a worker reports on: (kind, window seconds, tightest limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCounter {
    pub kind: Kind,
    pub window: u64,
    pub limit: u64,
}

/// What the companion answered for one counter of a subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub kind: Kind,
    pub window: u64,
    /// The window the item was for (a grant for a window that is over is dropped).
    pub start: u64,
    pub granted: u64,
    /// The window's global taken after the item.
    pub taken: u64,
}

/// Adds the companion's grants to `subject`'s records by CAS (a grant whose window is no longer
/// the current one is dropped) and stores `others` = taken − granted. False when the slot could
/// not be written (unreadable, full, contention): the grant is then lost to this replica (the
/// companion counts it as taken until the window ends).
pub fn apply_grants(
    store: &dyn SharedStore,
    key: &str,
    subject: &str,
    grants: &[Grant],
    now: u64,
) -> bool {
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(key);
        let Ok(view) = read_slot(value.as_deref(), subject) else {
            return false;
        };
        let mut records = view.mine.clone();
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
        if !changed {
            return true;
        }
        match write_slot(store, key, &view, subject, &records, now, cas) {
            Ok(true) => return true,
            Err(_) => return false,
            Ok(false) => {}
        }
    }
    false
}

/// One counter's part of a worker's batch, claimed in the slot before it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub kind: Kind,
    pub window: u64,
    pub start: u64,
    pub limit: u64,
    /// count − granted (usage above the lease): claimed as granted += debt.
    pub debt: u64,
    /// granted − count of an idle subject: claimed as granted −= release.
    pub release: u64,
    /// Renewal (prefetch) wanted; nothing claimed for it.
    pub want: u64,
}

/// Claims `subject`'s debts (and its unused lease when `idle`) by CAS and sizes renewals:
/// the items of the worker's batch for it (none when there is nothing to report).
/// `meters` (one per counter, in the same order; fewer: no recent rate) are observed with the
/// counts read.
#[allow(clippy::too_many_arguments)]
pub fn claim(
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
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(key);
        let Ok(view) = read_slot(value.as_deref(), subject) else {
            return Vec::new();
        };
        let mut records = view.mine.clone();
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
        if !changed {
            return claims;
        }
        match write_slot(store, key, &view, subject, &records, now, cas) {
            Ok(true) => return claims,
            Err(_) => return Vec::new(),
            Ok(false) => {}
        }
    }
    Vec::new()
}

/// Undoes `claims` after a failed batch (only in records still of the claimed window):
/// granted −= debt, granted += release, so the next batch reports them again.
pub fn unclaim(store: &dyn SharedStore, key: &str, subject: &str, claims: &[Claim], now: u64) {
    if claims.iter().all(|c| c.debt == 0 && c.release == 0) {
        return;
    }
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(key);
        let Ok(view) = read_slot(value.as_deref(), subject) else {
            return;
        };
        let mut records = view.mine.clone();
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
        if !changed {
            return;
        }
        match write_slot(store, key, &view, subject, &records, now, cas) {
            Ok(true) | Err(_) => return,
            Ok(false) => {}
        }
    }
}

/// (count, granted, others) of `subject`'s counter `kind`/`window` now (tests, diagnostics).
pub fn lease_state(
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

/// The tightest token window of `tiers` now (for tests and diagnostics).
pub fn token_state(
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

#[cfg(test)]
mod tests;
