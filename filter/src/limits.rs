//! Per-subject, per-tier request and token limits over fixed windows, in shared data with CAS.
//!
//! Counter key: `maas/l/<r|t> <tier> <window seconds> <subject>` (space cannot occur in tier
//! names, and the subject comes last), value: window start (u64 LE) + count (u64 LE). The key
//! does not change per window: a counter whose stored start is not the current window's counts 0.
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

pub fn counter_key(kind: Kind, tier: &str, window_seconds: u64, subject: &str) -> String {
    let k = match kind {
        Kind::Requests => 'r',
        Kind::Tokens => 't',
    };
    format!("maas/l/{k} {tier} {window_seconds} {subject}")
}

fn decode(v: Option<&[u8]>) -> (u64, u64) {
    match v {
        Some(b) => (read_u64(b, 0).unwrap_or(0), read_u64(b, 8).unwrap_or(0)),
        None => (0, 0),
    }
}

fn encode(start: u64, count: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&start.to_le_bytes());
    out[8..].copy_from_slice(&count.to_le_bytes());
    out
}

/// Current count of a counter in the window that holds `now`.
fn read_current(
    store: &dyn SharedStore,
    key: &str,
    limit: &Limit,
    now: u64,
) -> (u64, Option<u32>, u64) {
    let (v, cas) = store.get(key);
    let (start, count) = decode(v.as_deref());
    let current_start = limit.window.start_of(now);
    let used = if start == current_start { count } else { 0 };
    (used, cas, current_start)
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
/// reserves `reserve` tokens against every token window, or refuses without counting.
pub fn admit(
    store: &dyn SharedStore,
    tier: &Tier,
    subject: &str,
    reserve: u64,
    now: u64,
) -> Admission {
    // Each counter: (key, limit, amount to add, amount that must fit).
    let mut plan: Vec<(String, Kind, &Limit, u64, u64)> =
        Vec::with_capacity(tier.limits.requests.len() + tier.limits.tokens.len());
    for l in &tier.limits.requests {
        plan.push((
            counter_key(Kind::Requests, &tier.name, l.window.seconds(), subject),
            Kind::Requests,
            l,
            1,
            1,
        ));
    }
    for l in &tier.limits.tokens {
        // A request larger than a whole window still runs in an empty window.
        let need = reserve.min(l.limit);
        plan.push((
            counter_key(Kind::Tokens, &tier.name, l.window.seconds(), subject),
            Kind::Tokens,
            l,
            reserve,
            need,
        ));
    }

    let mut headers = RateHeaders::default();
    let mut blocked: Option<(Kind, u64)> = None;
    let mut applied: Vec<usize> = Vec::with_capacity(plan.len());
    let mut starts: Vec<u64> = vec![0; plan.len()];

    'outer: for (i, (key, kind, limit, add, need)) in plan.iter().enumerate() {
        for _ in 0..CAS_ATTEMPTS {
            let (used, cas, start) = read_current(store, key, limit, now);
            if used.saturating_add(*need) > limit.limit {
                let retry = limit.window.seconds_left(now);
                blocked = Some(match blocked {
                    Some((k, r)) if r >= retry => (k, r),
                    _ => (*kind, retry),
                });
                break 'outer;
            }
            if store
                .set(key, &encode(start, used.saturating_add(*add)), cas)
                .is_ok()
            {
                applied.push(i);
                if let Some(s) = starts.get_mut(i) {
                    *s = start;
                }
                continue 'outer;
            }
        }
        // Persistent contention: refuse rather than count wrong.
        blocked = Some((*kind, 1));
        break;
    }

    if let Some((kind, retry_after)) = blocked {
        for &i in &applied {
            if let (Some((key, _, limit, add, _)), Some(&start)) = (plan.get(i), starts.get(i)) {
                adjust(store, key, limit, start, *add, 0, now);
            }
        }
        // Headers show the state that refused (nothing of this request counted).
        for (key, kind, limit, _, _) in &plan {
            let (used, _, _) = read_current(store, key, limit, now);
            let w = WindowState {
                limit: limit.limit,
                used,
                reset_seconds: limit.window.seconds_left(now),
            };
            match kind {
                Kind::Requests => RateHeaders::note(&mut headers.requests, w),
                Kind::Tokens => RateHeaders::note(&mut headers.tokens, w),
            }
        }
        return Admission::Limited {
            kind,
            retry_after,
            headers,
        };
    }

    let mut token_windows = Vec::with_capacity(tier.limits.tokens.len());
    for (i, (key, kind, limit, _, _)) in plan.iter().enumerate() {
        let (used, _, _) = read_current(store, key, limit, now);
        let w = WindowState {
            limit: limit.limit,
            used,
            reset_seconds: limit.window.seconds_left(now),
        };
        match kind {
            Kind::Requests => RateHeaders::note(&mut headers.requests, w),
            Kind::Tokens => {
                RateHeaders::note(&mut headers.tokens, w);
                token_windows.push((limit.window.seconds(), starts.get(i).copied().unwrap_or(0)));
            }
        }
    }
    Admission::Allowed {
        reservation: Reservation {
            tier: tier.name.clone(),
            subject: subject.to_string(),
            reserved: reserve,
            token_windows,
        },
        headers,
    }
}

/// Replaces `reserved` by `actual` in a counter whose reservation went into window `start`;
/// if that window is over, `actual` counts in the current one (the tokens were used now).
fn adjust(
    store: &dyn SharedStore,
    key: &str,
    limit: &Limit,
    start: u64,
    reserved: u64,
    actual: u64,
    now: u64,
) {
    for _ in 0..CAS_ATTEMPTS {
        let (v, cas) = store.get(key);
        let (stored_start, count) = decode(v.as_deref());
        let current = limit.window.start_of(now);
        let (new_start, new_count) = if stored_start == start && start == current {
            (start, count.saturating_sub(reserved).saturating_add(actual))
        } else if stored_start == current {
            (current, count.saturating_add(actual))
        } else {
            (current, actual)
        };
        if stored_start == new_start && count == new_count {
            return;
        }
        if store.set(key, &encode(new_start, new_count), cas).is_ok() {
            return;
        }
    }
}

/// Settles a reservation to the tokens really used.
pub fn settle(store: &dyn SharedStore, r: &Reservation, actual: u64, now: u64) {
    for &(window_seconds, start) in &r.token_windows {
        let Ok(window) = maas_types::Window::from_seconds(window_seconds) else {
            continue;
        };
        let limit = Limit {
            limit: u64::MAX,
            window,
        };
        let key = counter_key(Kind::Tokens, &r.tier, window_seconds, &r.subject);
        adjust(store, &key, &limit, start, r.reserved, actual, now);
    }
}

/// Tokens left in the tightest token window (for the response headers after settlement).
pub fn token_state(
    store: &dyn SharedStore,
    tier: &Tier,
    subject: &str,
    now: u64,
) -> Option<WindowState> {
    let mut out = None;
    for l in &tier.limits.tokens {
        let key = counter_key(Kind::Tokens, &tier.name, l.window.seconds(), subject);
        let (used, _, _) = read_current(store, &key, l, now);
        RateHeaders::note(
            &mut out,
            WindowState {
                limit: l.limit,
                used,
                reset_seconds: l.window.seconds_left(now),
            },
        );
    }
    out
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
        let key = counter_key(Kind::Requests, "free", 60, "alice");
        assert_eq!(decode(s.get(&key).0.as_deref()).1, 1);
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
}
