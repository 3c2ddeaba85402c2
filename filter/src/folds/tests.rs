use super::*;
use crate::limits::{Admission, Ask, DEFAULT_COUNTER_SLOTS, RateHeaders, counter_key};
use crate::store::MemStore;
use maas_types::{PolicyDocument, Tier};
use serde_json::json;

/// 10 000 tokens a minute, 100 000 requests a minute: never refused by the tests below unless
/// they say so.
fn tier(tokens: u64) -> Tier {
    let doc = PolicyDocument::from_value(json!({
        "tiers": [{"name": "t", "level": 0, "groups": ["g"],
          "limits": {"requests": [{"limit": 100_000, "window": "1m"}],
                     "tokens": [{"limit": tokens, "window": "1m"}]}}]
    }))
    .unwrap();
    doc.tiers[0].clone()
}

const NOW: u64 = 60 * 1_000_000;

fn key() -> String {
    counter_key("alice", DEFAULT_COUNTER_SLOTS)
}

/// One admission of alice reserving `reserve`, with what `folds` holds for her, as the request
/// makes it (precheck's read, then the admission, then `admitted`).
fn admit(
    store: &MemStore,
    folds: &mut Folds,
    t: &Tier,
    reserve: u64,
    now: u64,
) -> Result<(Reservation, RateHeaders), Box<Admission>> {
    let key = key();
    let folded = folds.pending(&key, "alice");
    let tiers = [t];
    let (limited, read) = limits::precheck_folded(store, &key, &tiers, "alice", now, &folded);
    if let Some(l) = limited {
        return Err(Box::new(l));
    }
    let ask = Ask {
        key: &key,
        tiers: &tiers,
        subject: "alice",
        reserve,
        reserve_cost: 0,
        now,
        settled: &folded,
    };
    match limits::admit_leased(store, &ask, read, None) {
        Admission::Allowed {
            reservation,
            headers,
            ..
        } => {
            folds.admitted(&key, "alice");
            Ok((reservation, headers))
        }
        other => Err(Box::new(other)),
    }
}

/// What the slot holds for alice's token window (as another worker would read it).
fn slot_tokens(store: &MemStore, t: &Tier, now: u64) -> u64 {
    limits::token_state(store, &[t], "alice", now, DEFAULT_COUNTER_SLOTS).map_or(0, |w| w.used)
}

/// Settles as the request does: folded when `folds` takes it, else written.
fn settle(store: &MemStore, folds: &mut Folds, r: &Reservation, actual: u64, now: u64) -> bool {
    let folded = folds.fold(r, limits::Used::tokens(actual), now);
    if !folded {
        limits::settle(store, r, limits::Used::tokens(actual), now);
    }
    folded
}

#[test]
fn a_quiet_subjects_refunds_are_written_at_once() {
    let (store, mut folds, t) = (MemStore::new(), Folds::default(), tier(10_000));
    for i in 0..HOT_ADMISSIONS - 1 {
        let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
        assert!(!settle(&store, &mut folds, &r, 10, NOW), "admission {i}");
        assert_eq!(slot_tokens(&store, &t, NOW), 10 * u64::from(i + 1));
    }
}

#[test]
fn a_busy_subjects_refunds_fold_into_its_next_admission_and_its_own_view_stays_exact() {
    let (store, mut folds, t) = (MemStore::new(), Folds::default(), tier(10_000));
    let mut used = 0;
    let mut folded_any = false;
    for _ in 0..3 * HOT_ADMISSIONS {
        let (r, headers) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
        // The worker's own view (its headers) counts every earlier settlement exactly, folded
        // or written, plus this reservation.
        assert_eq!(headers.tokens.unwrap().used, used + 100);
        folded_any |= settle(&store, &mut folds, &r, 10, NOW);
        used += 10;
        // Another worker sees at most the last refund missing.
        let seen = slot_tokens(&store, &t, NOW);
        assert!(seen == used || seen == used + 90, "{seen} vs {used}");
    }
    assert!(folded_any);
    // The tick writes what is left: the slot is exact again.
    folds.tick(&store, NOW);
    assert_eq!(slot_tokens(&store, &t, NOW), used);
}

#[test]
fn usage_above_the_reservation_or_after_its_window_is_written_at_once() {
    let (store, mut folds, t) = (MemStore::new(), Folds::default(), tier(100_000));
    for _ in 0..HOT_ADMISSIONS {
        let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
        settle(&store, &mut folds, &r, 100, NOW);
    }
    let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
    assert!(
        !folds.fold(&r, limits::Used::tokens(101), NOW),
        "more than reserved is written now"
    );
    assert!(
        !folds.fold(&r, limits::Used::tokens(10), NOW + 60),
        "settled after its window: written now"
    );
    assert!(
        folds.fold(&r, limits::Used::tokens(10), NOW + 59),
        "a refund in its own window folds"
    );
}

#[test]
fn a_refund_folded_for_a_window_that_ended_is_dropped() {
    let (store, mut folds, t) = (MemStore::new(), Folds::default(), tier(100_000));
    for _ in 0..HOT_ADMISSIONS {
        admit(&store, &mut folds, &t, 100, NOW).unwrap();
    }
    let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
    assert!(folds.fold(&r, limits::Used::tokens(10), NOW));
    // The next window: the refund is moot, the new window counts only what it admits.
    let (_, headers) = admit(&store, &mut folds, &t, 50, NOW + 60).unwrap();
    assert_eq!(headers.tokens.unwrap().used, 50);
    folds.tick(&store, NOW + 60);
    assert_eq!(slot_tokens(&store, &t, NOW + 60), 50);
}

#[test]
fn a_folded_refund_makes_room_for_the_workers_own_next_request() {
    // 1000 tokens: 9 requests reserve 100 and use 10; the tenth still fits because the
    // worker's own refunds count, folded or not (the slot alone would say 900 + 100).
    let (store, mut folds, t) = (MemStore::new(), Folds::default(), tier(1000));
    let mut last = None;
    for _ in 0..HOT_ADMISSIONS + 2 {
        let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
        settle(&store, &mut folds, &r, 10, NOW);
        last = Some(r);
    }
    assert!(last.is_some());
    // Fill to the limit exactly: what is used plus a reservation of what is left fits.
    let used = u64::from(HOT_ADMISSIONS + 2) * 10;
    let (r, headers) = admit(&store, &mut folds, &t, 1000 - used, NOW).unwrap();
    assert_eq!(headers.tokens.unwrap().remaining(), 0);
    settle(&store, &mut folds, &r, 1000 - used, NOW);
    // Nothing more fits, for this worker or another.
    assert!(matches!(
        admit(&store, &mut folds, &t, 1, NOW).map_err(|e| *e),
        Err(Admission::Limited { .. })
    ));
    folds.tick(&store, NOW);
    assert_eq!(slot_tokens(&store, &t, NOW), 1000);
}

#[test]
fn a_slot_written_in_between_makes_the_admission_read_again_with_the_folds() {
    let (store, mut folds, t) = (MemStore::new(), Folds::default(), tier(100_000));
    for _ in 0..HOT_ADMISSIONS {
        let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
        settle(&store, &mut folds, &r, 100, NOW);
    }
    let (r, _) = admit(&store, &mut folds, &t, 100, NOW).unwrap();
    assert!(folds.fold(&r, limits::Used::tokens(40), NOW));
    let key = key();
    let folded = folds.pending(&key, "alice");
    assert_eq!(folded.len(), 1);
    let tiers = [&t];
    let (_, read) = limits::precheck_folded(&store, &key, &tiers, "alice", NOW, &folded);
    // Another worker admits meanwhile (its CAS write changes the slot).
    let another = Ask {
        key: &key,
        tiers: &tiers,
        subject: "alice",
        reserve: 7,
        reserve_cost: 0,
        now: NOW,
        settled: &[],
    };
    let (other, _) = match limits::admit_leased(&store, &another, None, None) {
        Admission::Allowed {
            reservation,
            headers,
            ..
        } => (reservation, headers),
        other => panic!("{other:?}"),
    };
    assert_eq!(other.reserved, 7);
    let ask = Ask {
        key: &key,
        tiers: &tiers,
        subject: "alice",
        reserve: 5,
        reserve_cost: 0,
        now: NOW,
        settled: &folded,
    };
    let Admission::Allowed { headers, .. } = limits::admit_leased(&store, &ask, read, None) else {
        panic!("admitted")
    };
    folds.admitted(&key, "alice");
    // 8 × 100 + 100 settled to 40 + 7 + 5: the refund counted once.
    let expected = 800 + 40 + 7 + 5;
    assert_eq!(headers.tokens.unwrap().used, expected);
    assert_eq!(slot_tokens(&store, &t, NOW), expected);
    folds.tick(&store, NOW);
    assert_eq!(
        slot_tokens(&store, &t, NOW),
        expected,
        "nothing written twice"
    );
}

#[test]
fn subjects_are_bounded_and_idle_ones_forgotten_at_the_tick() {
    let mut folds = Folds::default();
    for i in 0..MAX_SUBJECTS + 10 {
        folds.admitted("maas/l/1", &format!("user-{i}"));
    }
    assert_eq!(folds.len(), MAX_SUBJECTS);
    let store = MemStore::new();
    folds.tick(&store, NOW);
    assert_eq!(folds.len(), MAX_SUBJECTS, "admitted during the last tick");
    folds.tick(&store, NOW);
    assert!(folds.is_empty(), "idle for a tick: forgotten");
    // Another slot key for the same subject (a new counterSlots): nothing pending there.
    folds.admitted("maas/l/1", "bob");
    assert!(folds.pending("maas/l/2", "bob").is_empty());
}
