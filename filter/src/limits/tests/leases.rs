//! Global limits (budget leases): records with `granted` / `others`, admission against the
//! lease, grants, claims, and the guarantee that admitted requests never exceed what was granted.

use super::super::grants::prefetch;
use super::*;
use maas_types::lease::{LeaseItem, apply_item};
use proptest::prelude::*;

const NOW: u64 = 6_000_010; // 10 s into a minute (6_000_000 is a multiple of 60 and 3600)

fn held() -> LeasePolicy {
    LeasePolicy {
        fallback_share: None,
        horizon_ms: 2000,
        short_retry_s: 4,
    }
}

fn fallback(share: f64) -> LeasePolicy {
    LeasePolicy {
        fallback_share: Some(share),
        ..held()
    }
}

/// One tier: 10 requests a minute, 1000 tokens a minute.
fn small() -> Tier {
    PolicyDocument::from_value(json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["g"],
          "limits": {"requests": [{"limit": 10, "window": "1m"}],
                     "tokens": [{"limit": 1000, "window": "1m"}]}}]
    }))
    .unwrap()
    .tiers[0]
        .clone()
}

fn admit_g(s: &dyn SharedStore, t: &Tier, reserve: u64, now: u64, p: &LeasePolicy) -> Admission {
    let key = counter_key("alice", SLOTS);
    let tiers = [t];
    let ask = Ask {
        key: &key,
        tiers: &tiers,
        subject: "alice",
        reserve,
        reserve_cost: 0,
        now,
        settled: &[],
    };
    admit_leased(s, &ask, None, Some(p))
}

fn grant(s: &dyn SharedStore, kind: Kind, granted: u64, taken: u64, now: u64) -> bool {
    apply_grants(
        s,
        &counter_key("alice", SLOTS),
        "alice",
        &[Grant {
            kind,
            window: 60,
            start: now - now % 60,
            granted,
            taken,
        }],
        now,
    )
}

fn state(s: &dyn SharedStore, kind: Kind, now: u64) -> (u64, u64, u64) {
    lease_state(s, &counter_key("alice", SLOTS), "alice", kind, 60, now)
}

fn needs(a: Admission) -> Vec<LeaseNeed> {
    match a {
        Admission::NeedsLease { items, .. } => items,
        other => panic!("expected a lease to be needed, got {other:?}"),
    }
}

#[test]
fn a_short_lease_counts_nothing_and_asks_for_need_and_want() {
    let s = MemStore::new();
    let t = small();
    let items = needs(admit_g(&s, &t, 100, NOW, &held()));
    assert_eq!(s.key_count(), 0, "nothing written");
    assert_eq!(items.len(), 2);
    let req = items.iter().find(|i| i.kind == Kind::Requests).unwrap();
    // This replica's first request in the window (its rate: 1 in at least 1 s), 2 s horizon:
    // want 2, however long ago the window started.
    assert_eq!(
        (req.need, req.want, req.limit, req.start),
        (1, 2, 10, 6_000_000)
    );
    let tok = items.iter().find(|i| i.kind == Kind::Tokens).unwrap();
    assert_eq!((tok.need, tok.want, tok.limit), (100, 200, 1000));
}

/// Both counters short: the refusal names the one nearest its limit across the replicas (the
/// tokens others hold), not the first in order (requests, far from its limit).
#[test]
fn a_short_lease_names_the_counter_nearest_its_limit() {
    let s = MemStore::new();
    let t = small();
    // Other replicas hold 950 of the 1000 tokens; nothing of the 10 requests.
    assert!(grant(&s, Kind::Tokens, 0, 950, NOW));
    match admit_g(&s, &t, 100, NOW, &held()) {
        Admission::NeedsLease { items, kind, .. } => {
            assert_eq!(items.len(), 2, "{items:?}");
            assert_eq!(kind, Kind::Tokens);
        }
        other => panic!("expected a lease to be needed, got {other:?}"),
    }
    // Requests nearer (9 of 10 held elsewhere): named instead.
    let s = MemStore::new();
    assert!(grant(&s, Kind::Requests, 0, 9, NOW));
    assert!(grant(&s, Kind::Tokens, 0, 100, NOW));
    match admit_g(&s, &t, 100, NOW, &held()) {
        Admission::NeedsLease { kind, .. } => assert_eq!(kind, Kind::Requests),
        other => panic!("expected a lease to be needed, got {other:?}"),
    }
}

#[test]
fn want_follows_the_rate_in_this_window_within_need_and_limit() {
    // 30 used 10 s in (3/s) over a 2 s horizon: 6 wanted.
    assert_eq!(prefetch(30, 10, 2000, 1, 100), 6);
    assert_eq!(prefetch(30, 10, 2000, 9, 100), 9, "at least the need");
    assert_eq!(prefetch(3000, 1, 2000, 1, 100), 100, "at most the limit");
    assert_eq!(
        prefetch(5, 0, 1000, 1, 100),
        5,
        "elapsed counts at least 1 s"
    );
}

#[test]
fn granted_budget_admits_until_it_is_used_then_asks_again() {
    let s = MemStore::new();
    let t = small();
    assert!(grant(&s, Kind::Requests, 2, 2, NOW));
    assert!(grant(&s, Kind::Tokens, 300, 300, NOW));
    allowed(admit_g(&s, &t, 100, NOW, &held()));
    allowed(admit_g(&s, &t, 100, NOW, &held()));
    assert_eq!(state(&s, Kind::Requests, NOW), (2, 2, 0));
    // The request lease is used up (the tokens one still has 100).
    let items = needs(admit_g(&s, &t, 100, NOW, &held()));
    assert_eq!(items.len(), 1);
    assert_eq!((items[0].kind, items[0].need), (Kind::Requests, 1));
    // The window's limit still refuses first, as without leases.
    assert!(grant(&s, Kind::Requests, 8, 10, NOW));
    for _ in 0..8 {
        allowed(admit_g(&s, &t, 1, NOW, &held()));
    }
    assert!(matches!(
        admit_g(&s, &t, 1, NOW, &held()),
        Admission::Limited {
            retry_after: 50,
            ..
        }
    ));
}

#[test]
fn a_grant_for_a_window_that_is_over_is_dropped() {
    let s = MemStore::new();
    let t = small();
    // Granted for the previous minute, applied now.
    assert!(apply_grants(
        &s,
        &counter_key("alice", SLOTS),
        "alice",
        &[Grant {
            kind: Kind::Requests,
            window: 60,
            start: NOW - NOW % 60 - 60,
            granted: 5,
            taken: 5,
        }],
        NOW,
    ));
    assert_eq!(state(&s, Kind::Requests, NOW), (0, 0, 0));
    assert!(matches!(
        admit_g(&s, &t, 1, NOW, &held()),
        Admission::NeedsLease { .. }
    ));
    // A lease of an older window counts 0 in the next one.
    assert!(grant(&s, Kind::Requests, 5, 5, NOW));
    assert!(grant(&s, Kind::Tokens, 5, 5, NOW));
    assert_eq!(state(&s, Kind::Requests, NOW + 60), (0, 0, 0));
    assert!(matches!(
        admit_g(&s, &t, 1, NOW + 60, &held()),
        Admission::NeedsLease { .. }
    ));
}

#[test]
fn remaining_headers_count_the_other_replicas() {
    let s = MemStore::new();
    let t = small();
    // Global taken 7 of 10 requests: 3 granted to us, 4 taken by others.
    assert!(grant(&s, Kind::Requests, 3, 7, NOW));
    assert!(grant(&s, Kind::Tokens, 500, 900, NOW));
    let (_, h) = allowed(admit_g(&s, &t, 10, NOW, &held()));
    assert_eq!(state(&s, Kind::Requests, NOW), (1, 3, 4));
    assert_eq!(h.requests.unwrap().remaining(), 10 - (1 + 4));
    assert_eq!(h.tokens.unwrap().remaining(), 1000 - (10 + 400));
}

#[test]
fn fallback_admits_within_the_local_share_then_429_with_a_short_retry() {
    let s = MemStore::new();
    let t = small();
    // Half of 10 requests a minute: 5 without any grant.
    for _ in 0..5 {
        allowed(admit_g(&s, &t, 1, NOW, &fallback(0.5)));
    }
    match admit_g(&s, &t, 1, NOW, &fallback(0.5)) {
        Admission::Limited {
            kind, retry_after, ..
        } => {
            assert_eq!(kind, Kind::Requests);
            assert_eq!(retry_after, 4);
        }
        other => panic!("{other:?}"),
    }
    // A lease held above the share still counts.
    assert!(grant(&s, Kind::Requests, 8, 8, NOW));
    allowed(admit_g(&s, &t, 1, NOW, &fallback(0.5)));
    // Share 1 (one replica known): the full limit, as without global limits.
    let s = MemStore::new();
    for _ in 0..10 {
        allowed(admit_g(&s, &t, 1, NOW, &fallback(1.0)));
    }
    assert!(matches!(
        admit_g(&s, &t, 1, NOW, &fallback(1.0)),
        Admission::Limited {
            retry_after: 50,
            ..
        }
    ));
}

#[test]
fn in_fallback_the_local_share_is_capped_by_what_the_other_replicas_held() {
    let s = MemStore::new();
    let t = small();
    // This replica holds 2 of 10 requests; the others held 6 at the last answer (taken 8).
    assert!(grant(&s, Kind::Requests, 2, 8, NOW));
    // Share ½ would be 5, but only 10 − 6 = 4 were not held by the others.
    for _ in 0..4 {
        allowed(admit_g(&s, &t, 1, NOW, &fallback(0.5)));
    }
    assert!(matches!(
        admit_g(&s, &t, 1, NOW, &fallback(0.5)),
        Admission::Limited { .. }
    ));
    // Never below what this replica was granted: others holding everything leaves its own.
    let s = MemStore::new();
    assert!(grant(&s, Kind::Requests, 3, 13, NOW));
    for _ in 0..3 {
        allowed(admit_g(&s, &t, 1, NOW, &fallback(0.5)));
    }
    assert!(matches!(
        admit_g(&s, &t, 1, NOW, &fallback(0.5)),
        Admission::Limited { .. }
    ));
}

#[test]
fn a_version_2_slot_is_read_with_no_lease() {
    let s = MemStore::new();
    let t = small();
    // The previous layout: 25-byte records, no lease fields.
    let mut v = vec![2u8];
    v.extend_from_slice(&5u16.to_le_bytes());
    v.extend_from_slice(b"alice");
    v.push(1);
    v.push(0);
    v.extend_from_slice(&60u64.to_le_bytes());
    v.extend_from_slice(&6_000_000u64.to_le_bytes());
    v.extend_from_slice(&4u64.to_le_bytes());
    s.set(&counter_key("alice", SLOTS), &v, None).unwrap();
    assert_eq!(state(&s, Kind::Requests, NOW), (4, 0, 0));
    // Counts as before; the next write is of this version.
    allowed(admit1(&s, &t, "alice", 1, NOW));
    assert_eq!(state(&s, Kind::Requests, NOW), (5, 0, 0));
    assert_eq!(
        s.get(&counter_key("alice", SLOTS)).0.unwrap()[0],
        SLOT_VERSION
    );
}

/// Another subject's entry of an older slot is rewritten in this version's layout, its counts
/// kept (the slot is read in place, not decoded whole).
#[test]
fn a_version_2_slot_keeps_the_other_subjects_counts_when_written() {
    let s = MemStore::new();
    let t = small();
    let key = counter_key("alice", SLOTS);
    let mut v = vec![2u8];
    for (who, count) in [("bob", 7u64), ("alice", 4)] {
        v.extend_from_slice(&(who.len() as u16).to_le_bytes());
        v.extend_from_slice(who.as_bytes());
        v.push(1);
        v.push(0);
        v.extend_from_slice(&60u64.to_le_bytes());
        v.extend_from_slice(&6_000_000u64.to_le_bytes());
        v.extend_from_slice(&count.to_le_bytes());
    }
    s.set(&key, &v, None).unwrap();
    allowed(admit_leased(
        &s,
        &ask(&key, &[&t], "alice", 1, NOW),
        None,
        None,
    ));
    assert_eq!(s.get(&key).0.unwrap()[0], SLOT_VERSION);
    assert_eq!(state(&s, Kind::Requests, NOW), (5, 0, 0));
    assert_eq!(
        lease_state(&s, &key, "bob", Kind::Requests, 60, NOW),
        (7, 0, 0)
    );
}

fn counters_of(t: &Tier) -> Vec<LeaseCounter> {
    tracked_counters(&[t])
}

/// alice's claims at `now` (s), her meters observed.
fn claim_at(
    s: &MemStore,
    t: &Tier,
    meters: &mut [Meter],
    now: u64,
    idle: bool,
    horizon_ms: u64,
) -> Vec<Claim> {
    let key = counter_key("alice", SLOTS);
    claim(
        s,
        &key,
        "alice",
        &counters_of(t),
        meters,
        now * 1000,
        idle,
        horizon_ms,
    )
}

#[test]
fn claims_take_debt_and_idle_release_by_cas_and_undo_restores_them() {
    let s = MemStore::new();
    let t = small();
    let key = counter_key("alice", SLOTS);
    assert!(grant(&s, Kind::Requests, 5, 5, NOW));
    assert!(grant(&s, Kind::Tokens, 100, 100, NOW));
    let (r, _) = allowed(admit_g(&s, &t, 100, NOW, &held()));
    // Usage settles above the reservation: 40 tokens of debt.
    settle(&s, &r, Used::tokens(140), NOW);
    assert_eq!(state(&s, Kind::Tokens, NOW), (140, 100, 0));
    let c = claim_at(&s, &t, &mut [], NOW, false, 2000);
    let tok = c.iter().find(|c| c.kind == Kind::Tokens).unwrap();
    assert_eq!((tok.debt, tok.release), (40, 0));
    assert_eq!(state(&s, Kind::Tokens, NOW), (140, 140, 0), "claimed");
    // A second claim finds nothing more to report.
    let again = claim_at(&s, &t, &mut [], NOW, false, 2000);
    assert!(again.iter().all(|c| c.debt == 0));
    // The batch failed: the claim is undone, reported again next time.
    unclaim(&s, &key, "alice", &c, NOW);
    assert_eq!(state(&s, Kind::Tokens, NOW), (140, 100, 0));
    // Idle: the unused request lease (5 granted, 1 used) goes back.
    let c = claim_at(&s, &t, &mut [], NOW, true, 2000);
    let req = c.iter().find(|c| c.kind == Kind::Requests).unwrap();
    assert_eq!((req.debt, req.release, req.want), (0, 4, 0));
    assert_eq!(state(&s, Kind::Requests, NOW), (1, 1, 0));
    unclaim(&s, &key, "alice", &c, NOW);
    assert_eq!(state(&s, Kind::Requests, NOW), (1, 5, 0));
    // An undo after the record moved on to the next window changes nothing there.
    let c = claim_at(&s, &t, &mut [], NOW, true, 2000);
    let next = NOW + 60;
    assert!(grant(&s, Kind::Requests, 3, 3, next));
    assert!(grant(&s, Kind::Tokens, 300, 300, next));
    allowed(admit_g(&s, &t, 100, next, &held()));
    unclaim(&s, &key, "alice", &c, next);
    assert_eq!(state(&s, Kind::Requests, next), (1, 3, 0));
    assert_eq!(state(&s, Kind::Tokens, next), (100, 300, 0));
}

#[test]
fn renewals_are_asked_when_the_lease_left_is_below_the_rate_times_horizon() {
    let s = MemStore::new();
    let t = small();
    assert!(grant(&s, Kind::Requests, 10, 10, NOW));
    assert!(grant(&s, Kind::Tokens, 1000, 1000, NOW));
    for _ in 0..9 {
        allowed(admit_g(&s, &t, 1, NOW, &held()));
    }
    // 9 used 10 s in with a 20 s horizon → 18 wanted.
    let c = claim_at(&s, &t, &mut [], NOW, false, 20_000);
    let req = c.iter().find(|c| c.kind == Kind::Requests).unwrap();
    // 9 of 10 used: 1 left < 18 → renewal of 2 × 18, at most the limit: 10.
    assert_eq!((req.want, req.debt, req.release), (10, 0, 0));
    // Plenty left: no renewal.
    let s = MemStore::new();
    assert!(grant(&s, Kind::Requests, 10, 10, NOW));
    allowed(admit_g(&s, &t, 1, NOW, &fallback(1.0)));
    let c = claim_at(&s, &t, &mut [], NOW, false, 2000);
    assert!(c.iter().all(|c| c.kind != Kind::Requests), "{c:?}");
}

#[derive(Debug, Clone)]
enum Op {
    /// Admit a request reserving n tokens (and ask for a lease when short).
    Admit(u64),
    /// Settle the oldest open reservation to n tokens.
    Settle(u64),
    /// The worker's batch (idle or not).
    Tick(bool),
    /// Time passes (seconds).
    Wait(u64),
    /// Another replica takes budget.
    Other(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..300).prop_map(Op::Admit),
        2 => (0u64..400).prop_map(Op::Settle),
        1 => any::<bool>().prop_map(Op::Tick),
        1 => (0u64..30).prop_map(Op::Wait),
        1 => (0u64..5).prop_map(Op::Other),
    ]
}

/// The companion's counters for one replica's subject: (kind, window start) → taken.
#[derive(Default)]
struct Companion {
    taken: std::collections::HashMap<(u8, u64), u64>,
    /// Requests granted to us, per window.
    granted_requests: std::collections::HashMap<u64, u64>,
}

impl Companion {
    fn apply(&mut self, kind: Kind, start: u64, item: &LeaseItem, replicas: u32) -> (u64, u64) {
        let taken = self.taken.entry((kind.code(), start)).or_default();
        let (t, g) = apply_item(*taken, item, replicas);
        *taken = t;
        if kind == Kind::Requests {
            *self.granted_requests.entry(start).or_default() += g;
            // Releases give requests back.
            let e = self.granted_requests.entry(start).or_default();
            *e = e.saturating_sub(item.release);
        }
        (t, g)
    }
}

fn item(c: &LeaseNeed) -> LeaseItem {
    LeaseItem {
        subject: "alice".into(),
        kind: c.kind.lease_kind(),
        window_seconds: c.window,
        window_start: c.start,
        limit: c.limit,
        need: c.need,
        want: c.want,
        debt: 0,
        release: 0,
    }
}

proptest! {
    /// Over any interleaving of admissions, settlements, batches and other replicas' use, the
    /// requests admitted in a window never exceed what the companion granted this replica
    /// (never above the limit), and the tokens admitted never exceed the limit by more than
    /// the reported overruns.
    #[test]
    fn admitted_requests_never_exceed_what_was_granted(ops in proptest::collection::vec(op(), 1..80)) {
        let s = MemStore::new();
        let t = small();
        let key = counter_key("alice", SLOTS);
        let mut companion = Companion::default();
        let mut now = NOW;
        let mut open: Vec<Reservation> = Vec::new();
        let mut meters = vec![Meter::default(); counters_of(&t).len()];
        let mut admitted: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        for op in ops {
            match op {
                Op::Admit(reserve) => {
                    let mut a = admit_g(&s, &t, reserve, now, &held());
                    if let Admission::NeedsLease { items, .. } = &a {
                        let grants: Vec<Grant> = items.iter().map(|n| {
                            let (taken, granted) = companion.apply(n.kind, n.start, &item(n), 2);
                            Grant { kind: n.kind, window: n.window, start: n.start, granted, taken }
                        }).collect();
                        prop_assert!(apply_grants(&s, &key, "alice", &grants, now));
                        a = admit_g(&s, &t, reserve, now, &held());
                    }
                    if let Admission::Allowed { reservation, .. } = a {
                        *admitted.entry(now - now % 60).or_default() += 1;
                        open.push(reservation);
                    }
                }
                Op::Settle(actual) => {
                    if !open.is_empty() {
                        let r = open.remove(0);
                        settle(&s, &r, Used::tokens(actual), now);
                    }
                }
                Op::Tick(idle) => {
                    let claims = claim_at(&s, &t, &mut meters, now, idle, 2000);
                    let grants: Vec<Grant> = claims.iter().map(|c| {
                        let it = LeaseItem {
                            subject: "alice".into(), kind: c.kind.lease_kind(), window_seconds: c.window,
                            window_start: c.start, limit: c.limit, need: 0, want: c.want,
                            debt: c.debt, release: c.release,
                        };
                        let (taken, granted) = companion.apply(c.kind, c.start, &it, 2);
                        Grant { kind: c.kind, window: c.window, start: c.start, granted, taken }
                    }).collect();
                    prop_assert!(apply_grants(&s, &key, "alice", &grants, now));
                }
                Op::Wait(secs) => now += secs,
                Op::Other(n) => {
                    let start = now - now % 60;
                    *companion.taken.entry((Kind::Requests.code(), start)).or_default() += n;
                }
            }
            let start = now - now % 60;
            let (count, granted, _) = state(&s, Kind::Requests, now);
            prop_assert!(count <= granted, "count {count} above lease {granted}");
            let ours = admitted.get(&start).copied().unwrap_or(0);
            prop_assert_eq!(ours, count, "every admitted request is counted");
            let granted_net = companion.granted_requests.get(&start).copied().unwrap_or(0);
            prop_assert!(ours <= granted_net, "admitted {ours} above the {granted_net} granted");
            prop_assert!(ours <= 10, "admitted {ours} above the limit");
            let taken = companion.taken.get(&(Kind::Requests.code(), start)).copied().unwrap_or(0);
            prop_assert!(count <= taken, "counted {count} but only {taken} taken globally");
        }
    }

    /// Fallback with one known replica (share 1) admits exactly what global-off admission does:
    /// the same outcomes and headers over any sequence.
    #[test]
    fn fallback_with_one_replica_is_admission_without_leases(
        ops in proptest::collection::vec((1u64..400, 0u64..500, 0u64..40), 1..60)
    ) {
        let (on, off) = (MemStore::new(), MemStore::new());
        let t = small();
        let mut now = NOW;
        for (reserve, actual, wait) in ops {
            let a = admit_g(&on, &t, reserve, now, &fallback(1.0));
            let b = admit1(&off, &t, "alice", reserve, now);
            prop_assert_eq!(&a, &b);
            if let (Admission::Allowed { reservation: ra, .. }, Admission::Allowed { reservation: rb, .. }) = (a, b) {
                settle(&on, &ra, Used::tokens(actual), now);
                settle(&off, &rb, Used::tokens(actual), now);
            }
            now += wait;
        }
    }
}

#[test]
fn a_meter_reads_the_rate_between_reports_and_keeps_it_over_a_rollover() {
    let mut m = Meter::default();
    assert_eq!(
        m.observe(60, 10, 1_000).for_horizon(2000),
        0,
        "one reading: no rate"
    );
    assert_eq!(
        m.observe(60, 60, 2_000).for_horizon(2000),
        100,
        "50 a second"
    );
    assert_eq!(
        m.observe(60, 90, 2_100).for_horizon(2000),
        100,
        "too close: skipped"
    );
    assert_eq!(
        m.observe(60, 55, 3_000).for_horizon(2000),
        0,
        "refunds: no negative rate"
    );
    assert_eq!(
        m.observe(60, 80, 3_500).for_horizon(1000),
        50,
        "25 in 500 ms"
    );
    // A new window: its count starts again; the rate is kept until two readings of it.
    assert_eq!(m.observe(120, 3, 4_500).for_horizon(1000), 50);
    assert_eq!(m.observe(120, 23, 5_500).for_horizon(1000), 20);
    assert_eq!(Meter::default().for_horizon(u64::MAX), 0);
}

/// One tier: a million requests a minute, a billion tokens a minute.
fn roomy() -> Tier {
    PolicyDocument::from_value(json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["g"],
          "limits": {"requests": [{"limit": 1_000_000, "window": "1m"}],
                     "tokens": [{"limit": 1_000_000_000u64, "window": "1m"}]}}]
    }))
    .unwrap()
    .tiers[0]
        .clone()
}

#[test]
fn a_burst_renews_by_its_recent_rate_not_the_windows_average() {
    let s = MemStore::new();
    let t = roomy();
    assert!(grant(&s, Kind::Requests, 100, 100, NOW - 9));
    assert!(grant(&s, Kind::Tokens, 100, 100, NOW - 9));
    allowed(admit_g(&s, &t, 1, NOW - 9, &held()));
    for _ in 0..30 {
        allowed(admit_g(&s, &t, 1, NOW, &held()));
    }
    let mut meters = vec![Meter::default(); counters_of(&t).len()];
    let c = claim_at(&s, &t, &mut meters, NOW, false, 2000);
    assert!(
        c.is_empty(),
        "69 left of 100 covers the average rate: {c:?}"
    );
    for _ in 0..40 {
        allowed(admit_g(&s, &t, 1, NOW + 1, &held()));
    }
    // 71 used over 10 s (the average: 14 per horizon, 29 left covers it); 40 in the last
    // second: 80 per horizon, renewed for two horizons.
    let without = claim_at(&s, &t, &mut [], NOW + 1, false, 2000);
    assert!(without.is_empty(), "{without:?}");
    let c = claim_at(&s, &t, &mut meters, NOW + 1, false, 2000);
    let req = c.iter().find(|c| c.kind == Kind::Requests).unwrap();
    assert_eq!((req.want, req.debt, req.release), (160, 0, 0));
}

#[test]
fn a_meters_peak_survives_its_idle_readings_and_is_the_prior_when_it_resumes() {
    let mut m = Meter::default();
    let start = NOW - NOW % 60;
    m.observe(start, 0, 1_000);
    // 50 a second, then two idle seconds.
    m.observe(start, 50, 2_000);
    assert_eq!(m.for_horizon(1000), 50);
    m.observe(start, 50, 3_000);
    m.observe(start, 50, 4_000);
    assert_eq!(m.for_horizon(1000), 0, "idle: the current rate is 0");
    let mut back = m.resumed();
    assert_eq!(back.for_horizon(2000), 100, "the burst's rate over 2 s");
    // Its first reading after the idle time starts a new span: no rate over the idle gap.
    back.observe(start, 51, 60_000);
    assert_eq!(back.for_horizon(1000), 50);
    back.observe(start, 251, 61_000);
    assert_eq!(back.for_horizon(1000), 200, "measured again");
    // Resumed again without a reading in between: the prior it had.
    assert_eq!(back.resumed().resumed().for_horizon(1000), 200);
}
