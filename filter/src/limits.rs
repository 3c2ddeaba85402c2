//! Per-subject, per-tier request and token limits over fixed windows, in shared data with CAS.
//!
//! All counters of one subject on one tier live under one key, `maas/l <tier> <subject>` (space
//! cannot occur in tier names, and the subject comes last), so that admitting a request is one
//! read and one compare-and-swap write, and settling it likewise. The value is a list of
//! 25-byte records: kind (u8: 0 requests, 1 tokens), window seconds, window start, count (u64 LE).
//! The key does not change per window: a record whose start is not the current window's counts 0.
//!
//! Tokens are reserved at admission (the request's max_tokens, or the tier default) and settled
//! to the real usage when the response ends, so concurrent requests overshoot a budget by at most
//! one reservation.

use crate::cache::CAS_ATTEMPTS;
use crate::store::{SharedStore, read_u64};
use maas_types::{Limit, Tier};

/// Reserved when neither the request nor the tier names a max_tokens.
pub const FALLBACK_RESERVATION: u64 = 256;

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
}

pub fn counter_key(tier: &str, subject: &str) -> String {
    format!("maas/l {tier} {subject}")
}

const RECORD: usize = 25;

/// One window's counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    kind: u8,
    window: u64,
    start: u64,
    count: u64,
}

fn decode(v: Option<&[u8]>) -> Vec<Record> {
    let Some(b) = v else { return Vec::new() };
    b.chunks_exact(RECORD)
        .filter_map(|r| {
            Some(Record {
                kind: *r.first()?,
                window: read_u64(r, 1)?,
                start: read_u64(r, 9)?,
                count: read_u64(r, 17)?,
            })
        })
        .collect()
}

fn encode(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::with_capacity(records.len() * RECORD);
    for r in records {
        out.push(r.kind);
        out.extend_from_slice(&r.window.to_le_bytes());
        out.extend_from_slice(&r.start.to_le_bytes());
        out.extend_from_slice(&r.count.to_le_bytes());
    }
    out
}

/// Count of `kind`/`limit`'s window in `records` at `now` (0 when absent or from an older window).
fn used(records: &[Record], kind: Kind, limit: &Limit, now: u64) -> u64 {
    let start = limit.window.start_of(now);
    records
        .iter()
        .find(|r| r.kind == kind.code() && r.window == limit.window.seconds())
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

/// The tightest request and token windows (least remaining), when the tier has such limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub requests: Option<WindowState>,
    pub tokens: Option<WindowState>,
}

impl RateHeaders {
    fn note(slot: &mut Option<WindowState>, w: WindowState) {
        match slot {
            Some(cur) if cur.remaining() <= w.remaining() => {}
            _ => *slot = Some(w),
        }
    }

    fn from_records(tier: &Tier, records: &[Record], now: u64) -> Self {
        let mut h = RateHeaders::default();
        for (kind, limits) in [
            (Kind::Requests, &tier.limits.requests),
            (Kind::Tokens, &tier.limits.tokens),
        ] {
            for l in limits {
                let w = WindowState {
                    limit: l.limit,
                    used: used(records, kind, l, now),
                    reset_seconds: l.window.seconds_left(now),
                };
                match kind {
                    Kind::Requests => Self::note(&mut h.requests, w),
                    Kind::Tokens => Self::note(&mut h.tokens, w),
                }
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
    pub tier: String,
    pub subject: String,
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
    Limited {
        kind: Kind,
        /// Seconds to the end of the (latest) blocking window.
        retry_after: u64,
        headers: RateHeaders,
    },
}

/// Tokens to reserve: the request's max_tokens, else the tier default, else a fallback.
pub fn reservation_for(max_tokens: Option<u64>, tier: &Tier) -> u64 {
    max_tokens
        .or(tier.default_max_tokens)
        .unwrap_or(FALLBACK_RESERVATION)
        .max(1)
}

/// Admits one request for `subject` on `tier`: counts it against every request window and
/// reserves `reserve` tokens against every token window — one read and one CAS write — or
/// refuses without counting.
pub fn admit(
    store: &dyn SharedStore,
    tier: &Tier,
    subject: &str,
    reserve: u64,
    now: u64,
) -> Admission {
    if tier.limits.requests.is_empty() && tier.limits.tokens.is_empty() {
        return Admission::Allowed {
            reservation: Reservation {
                tier: tier.name.clone(),
                subject: subject.to_string(),
                reserved: reserve,
                token_windows: Vec::new(),
            },
            headers: RateHeaders::default(),
        };
    }
    let key = counter_key(&tier.name, subject);
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(&key);
        let records = decode(value.as_deref());
        let mut blocked: Option<(Kind, u64)> = None;
        let mut next: Vec<Record> =
            Vec::with_capacity(tier.limits.requests.len() + tier.limits.tokens.len());
        for (kind, limits, add) in [
            (Kind::Requests, &tier.limits.requests, 1),
            (Kind::Tokens, &tier.limits.tokens, reserve),
        ] {
            for l in limits {
                let u = used(&records, kind, l, now);
                // A request larger than a whole window still runs in an empty window.
                let need = add.min(l.limit);
                if u.saturating_add(need) > l.limit {
                    let retry = l.window.seconds_left(now);
                    blocked = Some(match blocked {
                        Some((k, r)) if r >= retry => (k, r),
                        _ => (kind, retry),
                    });
                }
                next.push(Record {
                    kind: kind.code(),
                    window: l.window.seconds(),
                    start: l.window.start_of(now),
                    count: u.saturating_add(add),
                });
            }
        }
        if let Some((kind, retry_after)) = blocked {
            return Admission::Limited {
                kind,
                retry_after,
                headers: RateHeaders::from_records(tier, &records, now),
            };
        }
        if store.set(&key, &encode(&next), cas).is_ok() {
            return Admission::Allowed {
                reservation: Reservation {
                    tier: tier.name.clone(),
                    subject: subject.to_string(),
                    reserved: reserve,
                    token_windows: tier
                        .limits
                        .tokens
                        .iter()
                        .map(|l| (l.window.seconds(), l.window.start_of(now)))
                        .collect(),
                },
                headers: RateHeaders::from_records(tier, &next, now),
            };
        }
    }
    // Persistent contention: refuse rather than count wrong.
    Admission::Limited {
        kind: Kind::Requests,
        retry_after: 1,
        headers: RateHeaders::default(),
    }
}

/// Refusal that is certain before the body is read: a request window already full, or a token
/// window with no token left. Read-only (one shared-data read); `admit` decides for real later.
pub fn precheck(
    store: &dyn SharedStore,
    tier: &Tier,
    subject: &str,
    now: u64,
) -> Option<Admission> {
    if tier.limits.requests.is_empty() && tier.limits.tokens.is_empty() {
        return None;
    }
    let (value, _) = store.get(&counter_key(&tier.name, subject));
    let records = decode(value.as_deref());
    let mut blocked: Option<(Kind, u64)> = None;
    for (kind, limits) in [
        (Kind::Requests, &tier.limits.requests),
        (Kind::Tokens, &tier.limits.tokens),
    ] {
        for l in limits {
            if used(&records, kind, l, now).saturating_add(1) > l.limit {
                let retry = l.window.seconds_left(now);
                blocked = Some(match blocked {
                    Some((k, r)) if r >= retry => (k, r),
                    _ => (kind, retry),
                });
            }
        }
    }
    blocked.map(|(kind, retry_after)| Admission::Limited {
        kind,
        retry_after,
        headers: RateHeaders::from_records(tier, &records, now),
    })
}

/// Settles a reservation to the tokens really used: in the window the reservation went into,
/// `reserved` is replaced by `actual`; if that window is over, `actual` counts in the current one
/// (the tokens were used now).
pub fn settle(store: &dyn SharedStore, r: &Reservation, actual: u64, now: u64) {
    if r.token_windows.is_empty() {
        return;
    }
    let key = counter_key(&r.tier, &r.subject);
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = store.get(&key);
        let mut records = decode(value.as_deref());
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
        if !changed || store.set(&key, &encode(&records), cas).is_ok() {
            return;
        }
    }
}

/// The tightest token window now (for tests and diagnostics).
pub fn token_state(
    store: &dyn SharedStore,
    tier: &Tier,
    subject: &str,
    now: u64,
) -> Option<WindowState> {
    let (value, _) = store.get(&counter_key(&tier.name, subject));
    RateHeaders::from_records(tier, &decode(value.as_deref()), now).tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;
    use maas_types::PolicyDocument;
    use serde_json::json;

    fn tier() -> Tier {
        let doc = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"], "defaultMaxTokens": 50,
              "limits": {"requests": [{"limit": 3, "window": "1m"}, {"limit": 5, "window": "1h"}],
                         "tokens": [{"limit": 100, "window": "1m"}, {"limit": 1000, "window": "1d"}]}}]
        }))
        .unwrap();
        doc.tiers[0].clone()
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

    #[test]
    fn requests_per_window_with_retry_after() {
        let s = MemStore::new();
        let t = tier();
        let now = 6000; // start of a minute
        for i in 0..3 {
            let (r, h) = allowed(admit(&s, &t, "alice", 1, now + i));
            settle(&s, &r, 1, now + i);
            assert_eq!(h.requests.unwrap().remaining(), 2 - i);
        }
        match admit(&s, &t, "alice", 1, now + 10) {
            Admission::Limited {
                kind,
                retry_after,
                headers,
            } => {
                assert_eq!(kind, Kind::Requests);
                assert_eq!(retry_after, 50);
                assert_eq!(headers.requests.unwrap().remaining(), 0);
            }
            other => panic!("{other:?}"),
        }
        // Another subject is not affected; the next minute is open again.
        allowed(admit(&s, &t, "bob", 1, now + 10));
        allowed(admit(&s, &t, "alice", 1, now + 60));
        // Hour window: 4 used by alice now, 5th allowed, 6th refused with the hour's retry.
        allowed(admit(&s, &t, "alice", 1, now + 61));
        match admit(&s, &t, "alice", 1, now + 62) {
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
        let (r1, h) = allowed(admit(&s, &t, "alice", 60, now));
        assert_eq!(h.tokens.unwrap().remaining(), 40);
        // 60 reserved + 50 does not fit in 100.
        assert!(matches!(
            admit(&s, &t, "alice", 50, now),
            Admission::Limited {
                kind: Kind::Tokens,
                ..
            }
        ));
        // A refused request counts nothing (request counter unchanged).
        let recs = decode(s.get(&counter_key("free", "alice")).0.as_deref());
        let req_1m = recs.iter().find(|r| r.kind == 0 && r.window == 60).unwrap();
        assert_eq!(req_1m.count, 1);
        // Settle to 10 actually used: refund.
        settle(&s, &r1, 10, now + 1);
        let (_, h) = allowed(admit(&s, &t, "alice", 50, now + 2));
        assert_eq!(h.tokens.unwrap().remaining(), 40);
        assert_eq!(token_state(&s, &t, "alice", now + 2).unwrap().used, 60);
        // Top-up beyond the reservation is counted too.
        let (r3, _) = allowed(admit(&s, &t, "carol", 10, now));
        settle(&s, &r3, 95, now + 1);
        assert_eq!(token_state(&s, &t, "carol", now + 1).unwrap().used, 95);
        assert!(matches!(
            admit(&s, &t, "carol", 10, now + 2),
            Admission::Limited { .. }
        ));
    }

    #[test]
    fn oversized_request_runs_in_an_empty_window_only() {
        let s = MemStore::new();
        let t = tier();
        let (r, _) = allowed(admit(&s, &t, "alice", 500, 120));
        assert!(matches!(
            admit(&s, &t, "alice", 1, 121),
            Admission::Limited { .. }
        ));
        settle(&s, &r, 20, 122);
        allowed(admit(&s, &t, "alice", 1, 123));
    }

    #[test]
    fn settlement_after_window_rollover_counts_in_new_window() {
        let s = MemStore::new();
        let t = tier();
        let (r, _) = allowed(admit(&s, &t, "alice", 90, 59));
        settle(&s, &r, 30, 61);
        let st = token_state(&s, &t, "alice", 61).unwrap();
        // 1m window: the new minute holds the 30 used; the day window: 30.
        assert_eq!(st.used, 30);
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
            if let Admission::Allowed { reservation, .. } = admit(&s, &t, "alice", 30, now) {
                admitted += 1;
                open.push(reservation);
            }
        }
        assert_eq!(admitted, 3); // 3 × 30 = 90 ≤ 100 (and the request limit is 3)
        for r in &open {
            settle(&s, r, 35, now + 1); // each used a bit more than reserved
        }
        let used = token_state(&s, &t, "alice", now + 1).unwrap().used;
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
        allowed(admit(&s, &t, "alice", 10, 0));
        assert_eq!(token_state(&s, &t, "alice", 0).unwrap().used, 10);
    }

    #[test]
    fn precheck_refuses_only_what_is_certain() {
        let s = MemStore::new();
        let t = tier();
        assert!(precheck(&s, &t, "alice", 0).is_none());
        for i in 0..3 {
            let (r, _) = allowed(admit(&s, &t, "alice", 1, i));
            settle(&s, &r, 1, i);
        }
        match precheck(&s, &t, "alice", 5) {
            Some(Admission::Limited {
                kind, retry_after, ..
            }) => {
                assert_eq!(kind, Kind::Requests);
                assert_eq!(retry_after, 55);
            }
            other => panic!("{other:?}"),
        }
        // Tokens: 99 of 100 used still passes the precheck (a 1-token request fits)...
        let (r, _) = allowed(admit(&s, &t, "bob", 10, 0));
        settle(&s, &r, 99, 0);
        assert!(precheck(&s, &t, "bob", 1).is_none());
        // ... 100 of 100 does not.
        let (r, _) = allowed(admit(&s, &t, "bob", 1, 1));
        settle(&s, &r, 1, 1);
        assert!(matches!(
            precheck(&s, &t, "bob", 2),
            Some(Admission::Limited {
                kind: Kind::Tokens,
                ..
            })
        ));
    }
}
