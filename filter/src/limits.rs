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
//! Slot value: `version(1) = 2`, then per subject `len(u16 LE) subject n(u8)` and `n` 25-byte
//! records: kind (u8: 0 requests, 1 tokens), window seconds, window start, count (u64 LE). A record
//! whose start is not the current window's counts 0.
//!
//! Tokens are reserved at admission and settled to the real usage when the response ends, so
//! concurrent requests overshoot a budget by at most one reservation. A reservation larger than
//! the limit of any applicable token window can never fit and is refused up front (400).

use crate::cache::CAS_ATTEMPTS;
use crate::response::Refusal;
use crate::store::{SharedStore, read_u64};
use maas_types::{Limit, Tier, Window};
use sha2::{Digest, Sha256};

/// Reserved when neither the request nor the tier names a max_tokens.
pub const FALLBACK_RESERVATION: u64 = 256;

/// Default of pluginConfig `limits.counterSlots`.
pub const DEFAULT_COUNTER_SLOTS: u64 = 65_536;

/// Subjects one counter slot holds at most (beyond: 503, never a dropped live count).
pub const SLOT_SUBJECTS: usize = 16;

const SLOT_VERSION: u8 = 2;
const RECORD: usize = 25;

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

/// One window's counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    kind: u8,
    window: u64,
    start: u64,
    count: u64,
}

impl Record {
    /// Still counts at `now` (its window is not over and it holds something).
    fn live(&self, now: u64) -> bool {
        self.count > 0 && self.start.saturating_add(self.window) > now
    }
}

/// The counters of one subject in a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Counters {
    subject: String,
    records: Vec<Record>,
}

/// Decodes a slot value; `None` when it is not one this version wrote (never guessed at).
fn decode_slot(v: Option<&[u8]>) -> Option<Vec<Counters>> {
    let b = match v {
        None | Some([]) => return Some(Vec::new()),
        Some(b) => b,
    };
    let (&version, mut rest) = b.split_first()?;
    if version != SLOT_VERSION {
        return None;
    }
    let mut out = Vec::new();
    while !rest.is_empty() {
        let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
        let subject = std::str::from_utf8(rest.get(2..2 + len)?).ok()?.to_string();
        let n = usize::from(*rest.get(2 + len)?);
        let at = 3 + len;
        let recs = rest.get(at..at + n * RECORD)?;
        let records = recs
            .chunks_exact(RECORD)
            .map(|r| {
                Some(Record {
                    kind: *r.first()?,
                    window: read_u64(r, 1)?,
                    start: read_u64(r, 9)?,
                    count: read_u64(r, 17)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        out.push(Counters { subject, records });
        rest = rest.get(at + n * RECORD..)?;
    }
    Some(out)
}

fn encode_slot(entries: &[Counters]) -> Vec<u8> {
    let mut out = vec![SLOT_VERSION];
    for e in entries {
        let subject = e.subject.as_bytes();
        let len = subject.len().min(usize::from(u16::MAX));
        let n = e.records.len().min(usize::from(u8::MAX));
        out.extend_from_slice(&(len as u16).to_le_bytes());
        out.extend_from_slice(subject.get(..len).unwrap_or_default());
        out.push(n as u8);
        for r in e.records.iter().take(n) {
            out.push(r.kind);
            out.extend_from_slice(&r.window.to_le_bytes());
            out.extend_from_slice(&r.start.to_le_bytes());
            out.extend_from_slice(&r.count.to_le_bytes());
        }
    }
    out
}

/// Why counters could not be updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotError {
    /// The slot holds a value this version cannot read.
    Unreadable,
    /// The slot holds [`SLOT_SUBJECTS`] subjects with live counts.
    Full,
}

/// A slot read for an update: the other subjects and `subject`'s records.
struct SlotView {
    others: Vec<Counters>,
    mine: Vec<Record>,
}

fn read_slot(value: Option<&[u8]>, subject: &str) -> Result<SlotView, SlotError> {
    let mut others = decode_slot(value).ok_or(SlotError::Unreadable)?;
    let mine = match others.iter().position(|c| c.subject == subject) {
        Some(i) => others.swap_remove(i).records,
        None => Vec::new(),
    };
    Ok(SlotView { others, mine })
}

impl SlotView {
    /// The slot value with `subject`'s records replaced by `records`; subjects (and records)
    /// whose windows are all over are dropped; no room for a subject with live counts → Full.
    fn write(
        mut self,
        subject: &str,
        records: Vec<Record>,
        now: u64,
    ) -> Result<Vec<u8>, SlotError> {
        self.others
            .retain(|c| c.records.iter().any(|r| r.live(now)));
        let records: Vec<Record> = records.into_iter().filter(|r| r.live(now)).collect();
        if !records.is_empty() {
            if self.others.len() >= SLOT_SUBJECTS {
                return Err(SlotError::Full);
            }
            self.others.push(Counters {
                subject: subject.to_string(),
                records,
            });
        }
        Ok(encode_slot(&self.others))
    }
}

/// Count of `kind`/`window` in `records` at `now` (0 when absent or from an older window).
fn used(records: &[Record], kind: Kind, window: Window, now: u64) -> u64 {
    let start = window.start_of(now);
    records
        .iter()
        .find(|r| r.kind == kind.code() && r.window == window.seconds())
        .filter(|r| r.start == start)
        .map_or(0, |r| r.count)
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
                used: used(records, kind, l.window, now),
                reset_seconds: l.window.seconds_left(now),
            };
            match kind {
                Kind::Requests => Self::note(&mut h.requests, w),
                Kind::Tokens => Self::note(&mut h.tokens, w),
            }
        }
        h
    }

    /// `x-ratelimit-*` headers as OpenAI sends them.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(6);
        if let Some(r) = self.requests {
            out.push(("x-ratelimit-limit-requests", r.limit.to_string()));
            out.push(("x-ratelimit-remaining-requests", r.remaining().to_string()));
            out.push(("x-ratelimit-reset-requests", duration(r.reset_seconds)));
        }
        if let Some(t) = self.tokens {
            out.push(("x-ratelimit-limit-tokens", t.limit.to_string()));
            out.push(("x-ratelimit-remaining-tokens", t.remaining().to_string()));
            out.push(("x-ratelimit-reset-tokens", duration(t.reset_seconds)));
        }
        out
    }
}

/// OpenAI-style duration: `59s`, `6m0s`, `1h2m3s`.
pub fn duration(seconds: u64) -> String {
    let (h, m, s) = (seconds / 3600, (seconds % 3600) / 60, seconds % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

/// What was taken at admission, to settle at the end of the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The tier the request ran on (for metrics).
    pub tier: String,
    pub subject: String,
    /// The shared-data key of the subject's counter slot.
    pub key: String,
    pub reserved: u64,
    /// (window seconds, window start) of each token counter the reservation went into.
    pub token_windows: Vec<(u64, u64)>,
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
        }
    }
}

/// Tokens to reserve: the request's max_tokens, else the tier default, else a fallback.
pub fn reservation_for(max_tokens: Option<u64>, tier: &Tier) -> u64 {
    max_tokens
        .or(tier.default_max_tokens)
        .unwrap_or(FALLBACK_RESERVATION)
        .max(1)
}

/// `tiers` without repeats (by name), order kept.
fn distinct<'a>(tiers: &[&'a Tier]) -> Vec<&'a Tier> {
    let mut out: Vec<&Tier> = Vec::with_capacity(tiers.len());
    for t in tiers {
        if !out.iter().any(|o| o.name == t.name) {
            out.push(t);
        }
    }
    out
}

/// The distinct (kind, window) counters of `tiers`.
fn windows(tiers: &[&Tier]) -> Vec<(Kind, Window)> {
    let mut out: Vec<(Kind, Window)> = Vec::new();
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
    let tiers = distinct(tiers);
    let request_tier = tiers.first().map(|t| t.name.clone()).unwrap_or_default();
    let key = counter_key(subject, slots);
    let counters = windows(&tiers);
    if counters.is_empty() {
        return Admission::Allowed {
            reservation: Reservation {
                tier: request_tier,
                subject: subject.to_string(),
                key,
                reserved: reserve,
                token_windows: Vec::new(),
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
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(&key);
        let view = match read_slot(value.as_deref(), subject) {
            Ok(v) => v,
            Err(e) => return slot_error(e),
        };
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
        let mut next: Vec<Record> = view
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
            next.push(Record {
                kind: kind.code(),
                window: window.seconds(),
                start: window.start_of(now),
                count: used(&view.mine, kind, window, now).saturating_add(add(kind)),
            });
        }
        let headers = RateHeaders::from_records(&tiers, &next, now);
        let bytes = match view.write(subject, next, now) {
            Ok(b) => b,
            Err(e) => return slot_error(e),
        };
        if store.set(&key, &bytes, cas).is_ok() {
            return Admission::Allowed {
                reservation: Reservation {
                    tier: request_tier,
                    subject: subject.to_string(),
                    key,
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
    let tiers = distinct(tiers);
    if windows(&tiers).is_empty() {
        return None;
    }
    let (value, _) = store.get(&counter_key(subject, slots));
    // An unreadable slot is `admit`'s to refuse.
    let view = read_slot(value.as_deref(), subject).ok()?;
    let mut blocked: Option<(Kind, u64, &str)> = None;
    for (kind, l, tier) in all_limits(&tiers) {
        if used(&view.mine, kind, l.window, now).saturating_add(1) > l.limit {
            let retry = l.window.seconds_left(now);
            if blocked.is_none_or(|(_, r, _)| retry > r) {
                blocked = Some((kind, retry, tier));
            }
        }
    }
    blocked.map(|(kind, retry_after, tier)| Admission::Limited {
        kind,
        retry_after,
        tier: tier.to_string(),
        headers: RateHeaders::from_records(&tiers, &view.mine, now),
    })
}

/// Settles a reservation to the tokens really used: in every token window the reservation went
/// into, `reserved` is replaced by `actual`; if that window is over, `actual` counts in the
/// current one (the tokens were used now).
pub fn settle(store: &dyn SharedStore, r: &Reservation, actual: u64, now: u64) {
    if r.token_windows.is_empty() {
        return;
    }
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(&r.key);
        let Ok(view) = read_slot(value.as_deref(), &r.subject) else {
            return;
        };
        let mut records = view.mine.clone();
        let mut changed = false;
        for &(window, start) in &r.token_windows {
            let current = now - now % window.max(1);
            let rec = records
                .iter_mut()
                .find(|x| x.kind == Kind::Tokens.code() && x.window == window);
            let (new_start, new_count) = match &rec {
                Some(x) if x.start == start && start == current => (
                    start,
                    x.count.saturating_sub(r.reserved).saturating_add(actual),
                ),
                Some(x) if x.start == current => (current, x.count.saturating_add(actual)),
                _ => (current, actual),
            };
            match rec {
                Some(x) => {
                    if x.start != new_start || x.count != new_count {
                        x.start = new_start;
                        x.count = new_count;
                        changed = true;
                    }
                }
                None => {
                    records.push(Record {
                        kind: Kind::Tokens.code(),
                        window,
                        start: new_start,
                        count: new_count,
                    });
                    changed = true;
                }
            }
        }
        if !changed {
            return;
        }
        // A full slot (the subject's counters had all expired and others took the room) cannot
        // take the tokens: they go uncounted rather than displace a live count.
        let Ok(bytes) = view.write(&r.subject, records, now) else {
            return;
        };
        if store.set(&r.key, &bytes, cas).is_ok() {
            return;
        }
    }
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
mod tests {
    use super::*;
    use crate::store::MemStore;
    use maas_types::PolicyDocument;
    use serde_json::json;

    const SLOTS: u64 = DEFAULT_COUNTER_SLOTS;

    fn tier() -> Tier {
        let doc = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"], "defaultMaxTokens": 50,
              "limits": {"requests": [{"limit": 3, "window": "1m"}, {"limit": 5, "window": "1h"}],
                         "tokens": [{"limit": 100, "window": "1m"}, {"limit": 1000, "window": "1d"}]}}]
        }))
        .unwrap();
        doc.tiers[0].clone()
    }

    /// A low tier (small budget) and a high tier (bigger budget, same windows plus one).
    fn two_tiers() -> (Tier, Tier) {
        let doc = PolicyDocument::from_value(json!({
            "tiers": [
              {"name": "low", "level": 0, "groups": ["lo"],
               "limits": {"requests": [{"limit": 100, "window": "1m"}],
                          "tokens": [{"limit": 100, "window": "1d"}]}},
              {"name": "high", "level": 1, "groups": ["hi"],
               "limits": {"requests": [{"limit": 1000, "window": "1m"}],
                          "tokens": [{"limit": 300, "window": "1d"}, {"limit": 250, "window": "1h"}]}}]
        }))
        .unwrap();
        (doc.tiers[0].clone(), doc.tiers[1].clone())
    }

    fn allowed(a: Admission) -> (Reservation, RateHeaders) {
        match a {
            Admission::Allowed {
                reservation,
                headers,
            } => (reservation, headers),
            other => panic!("expected allowed, got {other:?}"),
        }
    }

    fn admit1(s: &dyn SharedStore, t: &Tier, subject: &str, reserve: u64, now: u64) -> Admission {
        admit(s, &[t], subject, reserve, now, SLOTS)
    }

    fn tokens_used(s: &dyn SharedStore, t: &Tier, subject: &str, now: u64) -> u64 {
        token_state(s, &[t], subject, now, SLOTS).unwrap().used
    }

    /// Every key the store ever held (the ABI has no delete: emptied keys still count).
    fn keys(s: &MemStore) -> usize {
        s.key_count()
    }

    #[test]
    fn requests_per_window_with_retry_after() {
        let s = MemStore::new();
        let t = tier();
        let now = 6000; // start of a minute
        for i in 0..3 {
            let (r, h) = allowed(admit1(&s, &t, "alice", 1, now + i));
            settle(&s, &r, 1, now + i);
            assert_eq!(h.requests.unwrap().remaining(), 2 - i);
        }
        match admit1(&s, &t, "alice", 1, now + 10) {
            Admission::Limited {
                kind,
                retry_after,
                headers,
                tier,
            } => {
                assert_eq!(kind, Kind::Requests);
                assert_eq!(retry_after, 50);
                assert_eq!(tier, "free");
                assert_eq!(headers.requests.unwrap().remaining(), 0);
            }
            other => panic!("{other:?}"),
        }
        // Another subject is not affected; the next minute is open again.
        allowed(admit1(&s, &t, "bob", 1, now + 10));
        allowed(admit1(&s, &t, "alice", 1, now + 60));
        // Hour window: 4 used by alice now, 5th allowed, 6th refused with the hour's retry.
        allowed(admit1(&s, &t, "alice", 1, now + 61));
        match admit1(&s, &t, "alice", 1, now + 62) {
            Admission::Limited { retry_after, .. } => assert_eq!(
                retry_after,
                t.limits.requests[1].window.seconds_left(now + 62)
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tokens_reserve_then_settle() {
        let s = MemStore::new();
        let t = tier();
        let now = 60 * 1000;
        let (r1, h) = allowed(admit1(&s, &t, "alice", 60, now));
        assert_eq!(h.tokens.unwrap().remaining(), 40);
        // 60 reserved + 50 does not fit in 100.
        assert!(matches!(
            admit1(&s, &t, "alice", 50, now),
            Admission::Limited {
                kind: Kind::Tokens,
                ..
            }
        ));
        // A refused request counts nothing (request counter unchanged).
        let h = RateHeaders::from_records(
            &[&t],
            &read_slot(s.get(&counter_key("alice", SLOTS)).0.as_deref(), "alice")
                .unwrap()
                .mine,
            now,
        );
        assert_eq!(h.requests.unwrap().used, 1);
        // Settle to 10 actually used: refund.
        settle(&s, &r1, 10, now + 1);
        let (_, h) = allowed(admit1(&s, &t, "alice", 50, now + 2));
        assert_eq!(h.tokens.unwrap().remaining(), 40);
        assert_eq!(tokens_used(&s, &t, "alice", now + 2), 60);
        // Top-up beyond the reservation is counted too.
        let (r3, _) = allowed(admit1(&s, &t, "carol", 10, now));
        settle(&s, &r3, 95, now + 1);
        assert_eq!(tokens_used(&s, &t, "carol", now + 1), 95);
        assert!(matches!(
            admit1(&s, &t, "carol", 10, now + 2),
            Admission::Limited { .. }
        ));
    }

    #[test]
    fn reservation_above_a_window_limit_is_refused_without_counting() {
        let s = MemStore::new();
        let t = tier();
        // 101 > the 1m window's 100: can never fit, even in an empty window.
        match admit1(&s, &t, "alice", 101, 120) {
            Admission::TooLarge {
                requested,
                limit,
                window,
                tier,
            } => {
                assert_eq!((requested, limit, tier.as_str()), (101, 100, "free"));
                assert_eq!(window.to_string(), "1m");
            }
            other => panic!("{other:?}"),
        }
        // Nothing was counted: no key was even written, and the full budget is still there.
        assert_eq!(keys(&s), 0);
        let (_, h) = allowed(admit1(&s, &t, "alice", 100, 121));
        assert_eq!(h.requests.unwrap().used, 1);
        assert_eq!(h.tokens.unwrap().used, 100);
        // The pinned lower tier's limit counts too, though the higher tier would allow it.
        let (low, high) = two_tiers();
        assert!(matches!(
            admit(&s, &[&low, &high], "bob", 150, 0, SLOTS),
            Admission::TooLarge { limit: 100, .. }
        ));
        allowed(admit(&s, &[&high], "bob", 150, 0, SLOTS));
    }

    #[test]
    fn refusals_are_openai_shaped() {
        let (low, _) = two_tiers();
        let s = MemStore::new();
        let r = admit(&s, &[&low], "a", 70_000, 0, SLOTS)
            .into_refusal()
            .unwrap();
        assert_eq!(
            (r.status, r.kind, r.code),
            (400, "invalid_request_error", "tokens_exceed_limit")
        );
        assert_eq!(
            r.message,
            "this request reserves 70000 tokens (prompt estimate + max_tokens) but tier low \
             allows 100 per 1d; lower max_tokens or shorten the prompt"
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(v["error"]["code"], "tokens_exceed_limit");
        assert_eq!(v["error"]["type"], "invalid_request_error");

        let t = tier();
        for i in 0..3 {
            allowed(admit1(&s, &t, "b", 1, 6000 + i));
        }
        let r = admit1(&s, &t, "b", 1, 6010).into_refusal().unwrap();
        assert_eq!((r.status, r.code), (429, "rate_limit_exceeded"));
        assert_eq!(
            r.message,
            "rate limit reached for requests on tier free: retry in 50s"
        );
        assert!(r.headers.contains(&("retry-after".into(), "50".into())));
        assert!(
            r.headers
                .contains(&("x-ratelimit-remaining-requests".into(), "0".into()))
        );

        let r = Admission::Unavailable {
            reason: "counter slot full",
        }
        .into_refusal()
        .unwrap();
        assert_eq!((r.status, r.code), (503, "limits_unavailable"));
        assert!(admit1(&s, &t, "c", 1, 0).into_refusal().is_none());
    }

    #[test]
    fn two_tiers_keys_of_one_subject_share_one_budget() {
        // carol holds a key on her own (highest) tier and one pinned to the low tier: together
        // they never spend more than the high tier allows.
        let s = MemStore::new();
        let (low, high) = two_tiers();
        let now = 86_400;
        let mut spent = 0;
        for i in 0..40 {
            // Alternate the keys: request tier first, then the subject's highest tier.
            let tiers: [&Tier; 2] = if i % 2 == 0 {
                [&high, &high]
            } else {
                [&low, &high]
            };
            if let Admission::Allowed { reservation, .. } =
                admit(&s, &tiers, "carol", 20, now, SLOTS)
            {
                settle(&s, &reservation, 20, now);
                spent += 20;
            }
        }
        // The hour window of the high tier (250) is the tightest for both keys together.
        assert_eq!(spent, 240, "spent {spent}");
        assert_eq!(
            token_state(&s, &[&high], "carol", now, SLOTS).unwrap().used,
            240
        );
    }

    #[test]
    fn pinned_lower_tier_restricts_but_does_not_add() {
        let s = MemStore::new();
        let (low, high) = two_tiers();
        let now = 86_400;
        // On the pinned low key: the low tier's 100 a day binds, though the subject's high
        // tier would allow more.
        let mut low_spent = 0;
        while let Admission::Allowed { reservation, .. } =
            admit(&s, &[&low, &high], "dave", 10, now, SLOTS)
        {
            settle(&s, &reservation, 10, now);
            low_spent += 10;
            assert!(low_spent <= 1000);
        }
        assert_eq!(low_spent, 100);
        // What was spent on the low key counts on the high tier's budget: 250 (1h) - 100 left.
        let mut high_spent = 0;
        while let Admission::Allowed { reservation, .. } =
            admit(&s, &[&high, &high], "dave", 10, now, SLOTS)
        {
            settle(&s, &reservation, 10, now);
            high_spent += 10;
            assert!(high_spent <= 1000);
        }
        assert_eq!(low_spent + high_spent, 250);
        // And the low key is refused (the high tier's hour is spent), naming the high tier.
        match admit(&s, &[&low, &high], "dave", 1, now, SLOTS) {
            Admission::Limited { tier, kind, .. } => {
                assert_eq!(kind, Kind::Tokens);
                assert!(tier == "low" || tier == "high", "{tier}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn settlement_after_window_rollover_counts_in_new_window() {
        let s = MemStore::new();
        let t = tier();
        let (r, _) = allowed(admit1(&s, &t, "alice", 90, 59));
        settle(&s, &r, 30, 61);
        // 1m window: the new minute holds the 30 used; the day window: 30.
        assert_eq!(tokens_used(&s, &t, "alice", 61), 30);
    }

    #[test]
    fn concurrent_reservations_never_overshoot_more_than_one() {
        // Interleave admissions and settlements as concurrent streams would.
        let s = MemStore::new();
        let t = tier();
        let now = 600;
        let mut open = Vec::new();
        let mut admitted = 0;
        for _ in 0..20 {
            if let Admission::Allowed { reservation, .. } = admit1(&s, &t, "alice", 30, now) {
                admitted += 1;
                open.push(reservation);
            }
        }
        assert_eq!(admitted, 3); // 3 × 30 = 90 ≤ 100 (and the request limit is 3)
        for r in &open {
            settle(&s, r, 35, now + 1); // each used a bit more than reserved
        }
        let used = tokens_used(&s, &t, "alice", now + 1);
        assert!(used <= 100 + 30, "{used}");
    }

    #[test]
    fn reservation_sources_and_headers() {
        let t = tier();
        assert_eq!(reservation_for(Some(7), &t), 7);
        assert_eq!(reservation_for(None, &t), 50);
        let mut t2 = t.clone();
        t2.default_max_tokens = None;
        assert_eq!(reservation_for(None, &t2), FALLBACK_RESERVATION);
        assert_eq!(duration(59), "59s");
        assert_eq!(duration(360), "6m0s");
        assert_eq!(duration(3723), "1h2m3s");
        let h = RateHeaders {
            requests: Some(WindowState {
                limit: 3,
                used: 1,
                reset_seconds: 5,
            }),
            tokens: Some(WindowState {
                limit: 100,
                used: 120,
                reset_seconds: 65,
            }),
        };
        let hs = h.headers();
        assert!(hs.contains(&("x-ratelimit-remaining-requests", "2".to_string())));
        assert!(hs.contains(&("x-ratelimit-remaining-tokens", "0".to_string())));
        assert!(hs.contains(&("x-ratelimit-reset-tokens", "1m5s".to_string())));
    }

    #[test]
    fn counters_for_10k_subjects_use_at_most_counter_slots_keys() {
        let s = MemStore::new();
        let t = tier();
        let slots = 4096;
        let mut refused = 0;
        // 10k subjects, all live at once (the day window): they share at most `slots` keys.
        for i in 0..10_000u64 {
            match admit(&s, &[&t], &format!("user-{i}"), 1, i, slots) {
                Admission::Allowed { .. } => {}
                _ => refused += 1,
            }
        }
        assert_eq!(refused, 0);
        assert!(keys(&s) <= slots as usize, "{} keys", keys(&s));
        assert!(keys(&s) > slots as usize / 2, "{} keys", keys(&s));
        // And every key is a slot key.
        for n in 0..slots {
            let _ = s.get(&format!("maas/l/{n}"));
        }
        assert_eq!(slot_of("user-1", 1), 0);
        assert!(counter_key("user-1", slots).starts_with("maas/l/"));
    }

    #[test]
    fn full_slot_refuses_rather_than_drops_live_counts() {
        let s = MemStore::new();
        let t = tier();
        let now = 1_000_000;
        // One slot: the first SLOT_SUBJECTS subjects fit, each with a live count.
        for i in 0..SLOT_SUBJECTS {
            allowed(admit(&s, &[&t], &format!("u{i}"), 1, now, 1));
        }
        assert_eq!(
            admit(&s, &[&t], "one-too-many", 1, now, 1),
            Admission::Unavailable {
                reason: "counter slot full"
            }
        );
        // Nobody's count was dropped to make room.
        for i in 0..SLOT_SUBJECTS {
            assert_eq!(
                token_state(&s, &[&t], &format!("u{i}"), now, 1)
                    .unwrap()
                    .used,
                1,
                "u{i}"
            );
        }
        // Subjects already in the slot still count.
        allowed(admit(&s, &[&t], "u0", 1, now, 1));
        // Once their windows are over (the day window's too), the slot makes room.
        allowed(admit(&s, &[&t], "one-too-many", 1, now + 86_400, 1));
        assert_eq!(keys(&s), 1);
    }

    #[test]
    fn unreadable_slot_refuses() {
        let s = MemStore::new();
        let t = tier();
        s.set(&counter_key("alice", SLOTS), &[9, 9, 9], None)
            .unwrap();
        assert!(matches!(
            admit1(&s, &t, "alice", 1, 0),
            Admission::Unavailable { .. }
        ));
        // A truncated slot of this version is refused too, never half-read.
        let s = MemStore::new();
        allowed(admit1(&s, &t, "alice", 1, 0));
        let key = counter_key("alice", SLOTS);
        let v = s.get(&key).0.unwrap();
        for cut in 2..v.len() {
            assert!(decode_slot(Some(&v[..cut])).is_none(), "cut {cut}");
        }
        assert_eq!(decode_slot(Some(&v)).unwrap().len(), 1);
    }

    #[test]
    fn contention_is_retried() {
        // A store that fails the first CAS of every write still ends with the right count.
        struct Flaky {
            inner: MemStore,
            fail: std::cell::Cell<bool>,
        }
        impl SharedStore for Flaky {
            fn get(&self, k: &str) -> (Option<Vec<u8>>, Option<u32>) {
                self.inner.get(k)
            }
            fn set(
                &self,
                k: &str,
                v: &[u8],
                cas: Option<u32>,
            ) -> Result<(), crate::store::CasMismatch> {
                if self.fail.replace(!self.fail.get()) {
                    return Err(crate::store::CasMismatch);
                }
                self.inner.set(k, v, cas)
            }
        }
        let s = Flaky {
            inner: MemStore::new(),
            fail: std::cell::Cell::new(true),
        };
        let t = tier();
        allowed(admit1(&s, &t, "alice", 10, 0));
        assert_eq!(tokens_used(&s, &t, "alice", 0), 10);
    }

    #[test]
    fn concurrent_cas_retries_still_exact() {
        // Another worker writes the same slot between our read and our write, every time but
        // the last: every admission and settlement of both subjects is still counted once.
        struct Racing<'a> {
            inner: MemStore,
            tier: &'a Tier,
            /// Race the next write (then let the retry through).
            racing: std::cell::Cell<bool>,
            raced: std::cell::Cell<u32>,
        }
        impl SharedStore for Racing<'_> {
            fn get(&self, k: &str) -> (Option<Vec<u8>>, Option<u32>) {
                self.inner.get(k)
            }
            fn set(
                &self,
                k: &str,
                v: &[u8],
                cas: Option<u32>,
            ) -> Result<(), crate::store::CasMismatch> {
                if self.racing.replace(false) {
                    // The other worker: one admission of bob (1 token), settled to 2.
                    if let Admission::Allowed { reservation, .. } =
                        admit(&self.inner, &[self.tier], "bob", 1, 0, 1)
                    {
                        settle(&self.inner, &reservation, 2, 0);
                    }
                    self.raced.set(self.raced.get() + 1);
                    let r = self.inner.set(k, v, cas);
                    assert!(r.is_err(), "the race was not seen");
                    return r;
                }
                self.racing.set(true);
                self.inner.set(k, v, cas)
            }
        }
        let doc = PolicyDocument::from_value(json!({
            "tiers": [{"name": "t", "level": 0, "groups": ["g"],
              "limits": {"requests": [{"limit": 1000, "window": "1d"}],
                         "tokens": [{"limit": 100000, "window": "1d"}]}}]
        }))
        .unwrap();
        let t = doc.tiers[0].clone();
        let s = Racing {
            inner: MemStore::new(),
            tier: &t,
            racing: std::cell::Cell::new(false),
            raced: std::cell::Cell::new(0),
        };
        // Seed the slot so that every write of alice is a CAS write.
        allowed(admit(&s.inner, &[&t], "alice", 1, 0, 1));
        settle(
            &s.inner,
            &allowed(admit(&s.inner, &[&t], "alice", 1, 0, 1)).0,
            0,
            0,
        );
        s.racing.set(true);
        for _ in 0..10 {
            let (r, _) = allowed(admit(&s, &[&t], "alice", 5, 0, 1));
            settle(&s, &r, 3, 0);
        }
        let raced = s.raced.get();
        assert_eq!(raced, 20);
        let state = |who: &str| {
            let v = s.inner.get(&counter_key(who, 1)).0;
            let mine = read_slot(v.as_deref(), who).unwrap().mine;
            RateHeaders::from_records(&[&t], &mine, 0)
        };
        let alice = state("alice");
        assert_eq!(alice.requests.unwrap().used, 12);
        assert_eq!(alice.tokens.unwrap().used, 1 + 10 * 3);
        let bob = state("bob");
        assert_eq!(bob.requests.unwrap().used, u64::from(raced));
        assert_eq!(bob.tokens.unwrap().used, 2 * u64::from(raced));
    }

    #[test]
    fn precheck_refuses_only_what_is_certain() {
        let s = MemStore::new();
        let t = tier();
        assert!(precheck(&s, &[&t], "alice", 0, SLOTS).is_none());
        for i in 0..3 {
            let (r, _) = allowed(admit1(&s, &t, "alice", 1, i));
            settle(&s, &r, 1, i);
        }
        match precheck(&s, &[&t], "alice", 5, SLOTS) {
            Some(Admission::Limited {
                kind, retry_after, ..
            }) => {
                assert_eq!(kind, Kind::Requests);
                assert_eq!(retry_after, 55);
            }
            other => panic!("{other:?}"),
        }
        // Tokens: 99 of 100 used still passes the precheck (a 1-token request fits)...
        let (r, _) = allowed(admit1(&s, &t, "bob", 10, 0));
        settle(&s, &r, 99, 0);
        assert!(precheck(&s, &[&t], "bob", 1, SLOTS).is_none());
        // ... 100 of 100 does not.
        let (r, _) = allowed(admit1(&s, &t, "bob", 1, 1));
        settle(&s, &r, 1, 1);
        assert!(matches!(
            precheck(&s, &[&t], "bob", 2, SLOTS),
            Some(Admission::Limited {
                kind: Kind::Tokens,
                ..
            })
        ));
        // The subject's highest tier counts in the precheck of a pinned key too.
        let doc = PolicyDocument::from_value(json!({
            "tiers": [
              {"name": "mid", "level": 0, "groups": ["m"],
               "limits": {"tokens": [{"limit": 1000, "window": "1d"}]}},
              {"name": "top", "level": 1, "groups": ["t"],
               "limits": {"tokens": [{"limit": 50, "window": "1h"}]}}]
        }))
        .unwrap();
        let (mid, top) = (&doc.tiers[0], &doc.tiers[1]);
        let (r, _) = allowed(admit(&s, &[top], "erin", 10, 0, SLOTS));
        settle(&s, &r, 50, 0);
        assert!(precheck(&s, &[mid], "erin", 1, SLOTS).is_none());
        match precheck(&s, &[mid, top], "erin", 1, SLOTS) {
            Some(Admission::Limited { tier, .. }) => assert_eq!(tier, "top"),
            other => panic!("{other:?}"),
        }
    }
}
