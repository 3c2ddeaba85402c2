use super::headers::{Short, WindowState};
use super::slot::{SLOT_SUBJECTS, SLOT_VERSION, Slot, read_slot, slot_of, used};
use super::*;
use crate::store::{MemStore, SharedStore};
use maas_types::PolicyDocument;
use maas_types::{RateLimitHeaders, Tier};
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
            ..
        } => (reservation, headers),
        other => panic!("expected allowed, got {other:?}"),
    }
}

/// A request of `subject` to admit in slot `key` (no folded settlements).
fn ask<'a>(
    key: &'a str,
    tiers: &'a [&'a Tier],
    subject: &'a str,
    reserve: u64,
    now: u64,
) -> Ask<'a> {
    Ask {
        key,
        tiers,
        subject,
        reserve,
        reserve_cost: 0,
        now,
        settled: &[],
    }
}

/// Admits a request of `subject` in its slot of `slots`, global limits off.
fn admit(
    s: &dyn SharedStore,
    tiers: &[&Tier],
    subject: &str,
    reserve: u64,
    now: u64,
    slots: u64,
) -> Admission {
    let key = counter_key(subject, slots);
    admit_leased(s, &ask(&key, tiers, subject, reserve, now), None, None)
}

/// The precheck of `subject` in its slot of `slots` (no folded settlements).
fn precheck(
    s: &dyn SharedStore,
    tiers: &[&Tier],
    subject: &str,
    now: u64,
    slots: u64,
) -> Option<Admission> {
    precheck_folded(s, &counter_key(subject, slots), tiers, subject, now, &[]).0
}

/// OpenAI-style duration as text.
fn duration(seconds: u64) -> String {
    Short::duration(seconds).as_str().to_string()
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
        settle(&s, &r, Used::tokens(1), now + i);
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
    settle(&s, &r1, Used::tokens(10), now + 1);
    let (_, h) = allowed(admit1(&s, &t, "alice", 50, now + 2));
    assert_eq!(h.tokens.unwrap().remaining(), 40);
    assert_eq!(tokens_used(&s, &t, "alice", now + 2), 60);
    // Top-up beyond the reservation is counted too.
    let (r3, _) = allowed(admit1(&s, &t, "carol", 10, now));
    settle(&s, &r3, Used::tokens(95), now + 1);
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
            ..
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
        .into_refusal(RateLimitHeaders::Openai)
        .unwrap();
    assert_eq!(
        (r.status, r.kind, r.code),
        (400, "invalid_request_error", "tokens_exceed_limit")
    );
    assert_eq!(
        r.message,
        "this request reserves 70000 tokens (prompt estimate, media parts at the model's \
         mediaTokens each, + max_tokens) but tier low allows 100 per 1d; lower max_tokens, \
         shorten the prompt or send fewer media parts"
    );
    let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
    assert_eq!(v["error"]["code"], "tokens_exceed_limit");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let t = tier();
    for i in 0..3 {
        allowed(admit1(&s, &t, "b", 1, 6000 + i));
    }
    let r = admit1(&s, &t, "b", 1, 6010)
        .into_refusal(RateLimitHeaders::Openai)
        .unwrap();
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
    .into_refusal(RateLimitHeaders::Openai)
    .unwrap();
    assert_eq!((r.status, r.code), (503, "limits_unavailable"));
    assert!(
        admit1(&s, &t, "c", 1, 0)
            .into_refusal(RateLimitHeaders::Openai)
            .is_none()
    );
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
        if let Admission::Allowed { reservation, .. } = admit(&s, &tiers, "carol", 20, now, SLOTS) {
            settle(&s, &reservation, Used::tokens(20), now);
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
        settle(&s, &reservation, Used::tokens(10), now);
        low_spent += 10;
        assert!(low_spent <= 1000);
    }
    assert_eq!(low_spent, 100);
    // What was spent on the low key counts on the high tier's budget: 250 (1h) - 100 left.
    let mut high_spent = 0;
    while let Admission::Allowed { reservation, .. } =
        admit(&s, &[&high, &high], "dave", 10, now, SLOTS)
    {
        settle(&s, &reservation, Used::tokens(10), now);
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
    settle(&s, &r, Used::tokens(30), 61);
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
        settle(&s, r, Used::tokens(35), now + 1); // each used a bit more than reserved
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
    assert_eq!(duration(0), "0s");
    assert_eq!(duration(3600), "1h0m0s");
    let h = RateHeaders {
        cost: None,
        requests: Some(WindowState {
            limit: 3,
            used: 1,
            reset_seconds: 5,
            window_seconds: 60,
        }),
        tokens: Some(WindowState {
            limit: 100,
            used: 120,
            reset_seconds: 65,
            window_seconds: 3600,
        }),
        warning: None,
    };
    let hs = h.headers(RateLimitHeaders::Openai);
    assert!(hs.contains(&("x-ratelimit-remaining-requests", "2".to_string())));
    assert!(hs.contains(&("x-ratelimit-remaining-tokens", "0".to_string())));
    assert!(hs.contains(&("x-ratelimit-reset-tokens", "1m5s".to_string())));
}

/// The policy's `rateLimitHeaders`: the IETF pair names each window kind with its quota and
/// window (`RateLimit-Policy`) and what remains and when it resets (`RateLimit`); `none` sends
/// no limit header (a warning still goes); only the chosen names are the gateway's to send.
#[test]
fn rate_limit_headers_in_each_style() {
    let h = RateHeaders {
        cost: None,
        requests: Some(WindowState {
            limit: 30,
            used: 1,
            reset_seconds: 58,
            window_seconds: 60,
        }),
        tokens: Some(WindowState {
            limit: 2000,
            used: 500,
            reset_seconds: 3000,
            window_seconds: 86_400,
        }),
        warning: None,
    };
    assert_eq!(
        h.headers(RateLimitHeaders::Ietf),
        [
            (
                "ratelimit-policy",
                "\"requests\";q=30;w=60, \"tokens\";q=2000;w=86400".to_string()
            ),
            (
                "ratelimit",
                "\"requests\";r=29;t=58, \"tokens\";r=1500;t=3000".to_string()
            ),
        ]
    );
    assert!(h.sends(RateLimitHeaders::Ietf, "RateLimit"));
    assert!(!h.sends(RateLimitHeaders::Ietf, "x-ratelimit-limit-requests"));
    assert_eq!(h.headers(RateLimitHeaders::Openai).len(), 6);
    assert!(h.headers(RateLimitHeaders::None).is_empty());
    assert!(!h.sends(RateLimitHeaders::None, "ratelimit"));
    let only_tokens = RateHeaders {
        requests: None,
        ..h
    };
    assert_eq!(
        only_tokens.headers(RateLimitHeaders::Ietf)[1].1,
        "\"tokens\";r=1500;t=3000"
    );
    assert!(
        RateHeaders::default()
            .headers(RateLimitHeaders::Ietf)
            .is_empty()
    );
}

/// The fullest window past a threshold of its tier after admission (this request counted):
/// none below 80 %, 80 from 80 %, 95 from 95 %; a tier with `warnAt: []` never warns; the
/// header names the window and is what a refusal carries too.
#[test]
fn early_warnings_name_the_fullest_window_past_a_threshold() {
    let s = MemStore::new();
    let t = tier(); // tokens 100/1m and 1000/1d, requests 3/1m and 5/1h; warnAt default
    let now = 120;
    let warning = |a: Admission| allowed(a).1.warning;
    // 70 of 100 tokens in the minute: no warning.
    assert_eq!(warning(admit(&s, &[&t], "u", 70, now, SLOTS)), None);
    // 2 of 3 requests (66 %) and 85 of 100 tokens: tokens 1m at 85 %, past 80.
    let w = warning(admit(&s, &[&t], "u", 15, now, SLOTS)).expect("a warning");
    assert_eq!((w.threshold, w.percent, w.kind), (80, 85, Kind::Tokens));
    assert_eq!(w.window.to_string(), "1m");
    assert_eq!(w.reset_seconds, 60);
    let h = admit(&s, &[&t], "u", 12, now, SLOTS);
    let (_, headers) = allowed(h);
    // 3 of 3 requests (100 %) is the fullest now, past 95.
    let w = headers.warning.expect("a warning");
    assert_eq!((w.threshold, w.percent, w.kind), (95, 100, Kind::Requests));
    assert!(
        headers.headers(RateLimitHeaders::Openai).contains(&(
            "x-maas-quota-warning",
            "threshold=95, used=100, kind=requests, window=1m, reset=60".to_string()
        )),
        "{:?}",
        headers.headers(RateLimitHeaders::Openai)
    );
    assert!(headers.sends(RateLimitHeaders::Openai, "X-Maas-Quota-Warning"));
    // The refusal that follows carries it too.
    let refused = admit(&s, &[&t], "u", 1, now, SLOTS);
    let Admission::Limited { headers, .. } = refused else {
        panic!("expected a 429, got {refused:?}")
    };
    assert_eq!(headers.warning.map(|w| w.threshold), Some(95));

    let mut quiet = tier();
    quiet.warn_at = Vec::new();
    let s = MemStore::new();
    assert_eq!(warning(admit(&s, &[&quiet], "u", 99, now, SLOTS)), None);
}

/// Shadow limits count and evaluate, never refuse: the request goes on with what they would
/// have said; the headers, warnings and leases know only the enforced limits.
#[test]
fn shadow_limits_count_and_never_refuse() {
    let doc = PolicyDocument::from_value(json!({
        "tiers": [{"name": "trial", "level": 0, "groups": ["g"], "warnAt": [],
          "limits": {"requests": [{"limit": 2, "window": "1m", "shadow": true}],
                     "tokens": [{"limit": 100, "window": "1d"},
                                {"limit": 50, "window": "1d", "shadow": true},
                                {"limit": 30, "window": "1h", "shadow": true}]}}]
    }))
    .unwrap();
    let t = doc.tiers[0].clone();
    let s = MemStore::new();
    let now = 7200;
    let shadowed = |a: Admission| match a {
        Admission::Allowed { shadowed, .. } => shadowed,
        other => panic!("expected allowed, got {other:?}"),
    };
    // 20 tokens: under every limit.
    assert_eq!(shadowed(admit(&s, &[&t], "u", 20, now, SLOTS)), None);
    // 25 more: 45 in the hour is past its shadow 30: allowed, noted.
    let sh = shadowed(admit(&s, &[&t], "u", 25, now, SLOTS)).expect("a shadow refusal");
    assert_eq!(sh.code, "rate_limit_exceeded");
    assert_eq!(
        (sh.kind, sh.window.to_string()),
        (Kind::Tokens, "1h".to_string())
    );
    assert_eq!(sh.tier, "trial");
    // 35: a reservation above the hour's shadow 30 would be too large (checked first, as
    // enforced limits are), beside the third request of the shadow 2 per minute.
    let a = admit(&s, &[&t], "u", 35, now, SLOTS);
    let (_, headers) = allowed(a.clone());
    let sh = shadowed(a).expect("a shadow refusal");
    assert_eq!(
        (sh.code, sh.window.to_string()),
        ("tokens_exceed_limit", "1h".to_string())
    );
    // The headers show the enforced day window only: 100 - 80.
    assert_eq!(
        headers.tokens.map(|w| (w.limit, w.remaining())),
        Some((100, 20))
    );
    assert_eq!(headers.requests, None);
    // The enforced limit still refuses.
    let refused = admit(&s, &[&t], "u", 25, now, SLOTS);
    assert!(matches!(refused, Admission::Limited { .. }), "{refused:?}");
    // Only enforced limits are leased.
    let tiers = [&t];
    let leased = super::counters::lease_counters(&tiers);
    assert_eq!(leased.len(), 1, "{leased:?}");
    assert_eq!(leased[0].2, 100);
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
        assert!(Slot::parse(Some(&v[..cut])).is_none(), "cut {cut}");
    }
    assert_eq!(Slot::parse(Some(&v)).unwrap().entries().count(), 1);
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
                    settle(&self.inner, &reservation, Used::tokens(2), 0);
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
        Used::tokens(0),
        0,
    );
    s.racing.set(true);
    for _ in 0..10 {
        let (r, _) = allowed(admit(&s, &[&t], "alice", 5, 0, 1));
        settle(&s, &r, Used::tokens(3), 0);
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
        settle(&s, &r, Used::tokens(1), i);
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
    settle(&s, &r, Used::tokens(99), 0);
    assert!(precheck(&s, &[&t], "bob", 1, SLOTS).is_none());
    // ... 100 of 100 does not.
    let (r, _) = allowed(admit1(&s, &t, "bob", 1, 1));
    settle(&s, &r, Used::tokens(1), 1);
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
    settle(&s, &r, Used::tokens(50), 0);
    assert!(precheck(&s, &[mid], "erin", 1, SLOTS).is_none());
    match precheck(&s, &[mid, top], "erin", 1, SLOTS) {
        Some(Admission::Limited { tier, .. }) => assert_eq!(tier, "top"),
        other => panic!("{other:?}"),
    }
}

/// A store that counts its reads.
#[derive(Default)]
struct Counting {
    inner: MemStore,
    gets: std::cell::Cell<usize>,
}

impl SharedStore for Counting {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.gets.set(self.gets.get() + 1);
        self.inner.get(key)
    }
    fn set(
        &self,
        key: &str,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<(), crate::store::CasMismatch> {
        self.inner.set(key, value, cas)
    }
}

fn requests_used(s: &dyn SharedStore, t: &Tier, subject: &str, now: u64) -> u64 {
    let (value, _) = s.get(&counter_key(subject, SLOTS));
    let view = read_slot(value.as_deref(), subject).unwrap();
    used(&view.mine, Kind::Requests, t.limits.requests[0].window, now)
}

#[test]
fn admission_starts_from_the_prechecks_read_without_reading_again() {
    let s = Counting::default();
    let t = tier();
    let key = counter_key("alice", SLOTS);
    allowed(admit1(&s, &t, "alice", 10, 0));
    let (refused, read) = precheck_folded(&s, &key, &[&t], "alice", 1, &[]);
    assert!(refused.is_none());
    assert!(read.is_some());
    s.gets.set(0);
    allowed(admit_leased(
        &s,
        &ask(&key, &[&t], "alice", 10, 1),
        read,
        None,
    ));
    assert_eq!(s.gets.get(), 0, "no second read");
    assert_eq!(requests_used(&s, &t, "alice", 1), 2);
    assert_eq!(tokens_used(&s, &t, "alice", 1), 20);
}

#[test]
fn admission_from_a_stale_read_reads_again_and_loses_no_count() {
    let s = Counting::default();
    let t = tier();
    let key = counter_key("alice", SLOTS);
    allowed(admit1(&s, &t, "alice", 10, 0));
    let (_, read) = precheck_folded(&s, &key, &[&t], "alice", 1, &[]);
    // Another request of the subject is admitted in between (another worker, or this one).
    allowed(admit1(&s, &t, "alice", 10, 1));
    s.gets.set(0);
    allowed(admit_leased(
        &s,
        &ask(&key, &[&t], "alice", 10, 1),
        read,
        None,
    ));
    assert_eq!(s.gets.get(), 1, "the CAS write failed: read again");
    assert_eq!(requests_used(&s, &t, "alice", 1), 3);
    // A stale read that saw room never lets a request past a full window: bob's third request
    // lands between his precheck (2 used) and his admission (limit 3 a minute).
    let bob = counter_key("bob", SLOTS);
    allowed(admit1(&s, &t, "bob", 10, 1));
    allowed(admit1(&s, &t, "bob", 10, 1));
    let (refused, stale) = precheck_folded(&s, &bob, &[&t], "bob", 1, &[]);
    assert!(refused.is_none());
    allowed(admit1(&s, &t, "bob", 10, 1));
    assert!(matches!(
        admit_leased(&s, &ask(&bob, &[&t], "bob", 10, 1), stale, None),
        Admission::Limited { .. }
    ));
}

#[test]
fn a_never_written_slot_gives_no_read_to_start_from() {
    let s = MemStore::new();
    let t = tier();
    let key = counter_key("alice", SLOTS);
    let (refused, read) = precheck_folded(&s, &key, &[&t], "alice", 0, &[]);
    assert!(refused.is_none());
    assert!(read.is_none(), "its first write cannot be a CAS");
    // A read of another slot is not used.
    allowed(admit1(&s, &t, "alice", 10, 0));
    allowed(admit1(&s, &t, "bob", 10, 0));
    let (_, bobs) = precheck_folded(&s, &counter_key("bob", SLOTS), &[&t], "bob", 0, &[]);
    allowed(admit_leased(
        &s,
        &ask(&key, &[&t], "alice", 10, 0),
        bobs,
        None,
    ));
    assert_eq!(requests_used(&s, &t, "alice", 0), 2);
    assert_eq!(requests_used(&s, &t, "bob", 0), 1);
}

/// The production sources of `limits` (its tests aside), as compiled.
const SOURCES: [(&str, &str); 8] = [
    ("limits.rs", include_str!("../limits.rs")),
    ("admit.rs", include_str!("admit.rs")),
    ("counters.rs", include_str!("counters.rs")),
    ("grants.rs", include_str!("grants.rs")),
    ("headers.rs", include_str!("headers.rs")),
    ("probe.rs", include_str!("probe.rs")),
    ("settle.rs", include_str!("settle.rs")),
    ("slot.rs", include_str!("slot.rs")),
];

/// Every write of a counter slot goes through the one read → edit → CAS loop
/// (`slot::update`): no other loop over CAS attempts, no other call of the CAS write.
#[test]
fn one_cas_loop_writes_every_counter_slot() {
    let code = |src: &str| -> String {
        src.lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let count = |needle: &str| -> Vec<(&str, usize)> {
        SOURCES
            .iter()
            .map(|(name, src)| (*name, code(src).matches(needle).count()))
            .filter(|(_, n)| *n > 0)
            .collect()
    };
    assert_eq!(count("0..CAS_ATTEMPTS"), [("slot.rs", 1)], "CAS loops");
    // The definition and its one call.
    assert_eq!(count("write_slot("), [("slot.rs", 2)], "CAS writes");
    assert_eq!(count(".set("), [("slot.rs", 1)], "shared-data writes");
}

/// [`SOURCES`] names every production file of `limits` (a new one is checked too).
#[cfg(not(target_arch = "wasm32"))]
#[test]
fn every_limits_source_is_checked() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/limits");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|f| f.ends_with(".rs") && f != "tests.rs")
        .collect();
    files.push("limits.rs".into());
    files.sort();
    let mut checked: Vec<&str> = SOURCES.iter().map(|(name, _)| *name).collect();
    checked.sort();
    assert_eq!(files, checked);
}

proptest::proptest! {
    #[test]
    fn decimal_is_to_string(n in proptest::prelude::any::<u64>()) {
        let decimal = Short::decimal(n);
        proptest::prop_assert_eq!(decimal.as_str(), n.to_string());
    }
}

mod leases;
mod money;
