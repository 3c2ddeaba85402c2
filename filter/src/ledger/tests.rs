#![allow(clippy::indexing_slicing, clippy::panic, clippy::unwrap_used)]
//! The ledger alone: aggregation, batch shape, resend verbatim, the bound.

use super::*;
use maas_types::usage::{UsageRecord, validate};

const T0_MS: u64 = 1_764_561_600_000 + 1_800_000; // half past an hour

fn ledger(max_pending: usize) -> Ledger {
    let mut l = Ledger::default();
    l.configure(
        &UsageConfig {
            enabled: true,
            report_interval_ms: 1000,
            max_pending_records: max_pending,
        },
        "gw-a".into(),
        "w1".into(),
        T0_MS,
    );
    l
}

fn report(b: &Batch) -> UsageReport {
    serde_json::from_slice(&b.body).unwrap()
}

fn settled(prompt: u64, completion: u64) -> Event<'static> {
    Event::Settled {
        prompt,
        completion,
        cached: 0,
    }
}

#[test]
fn cached_input_tokens_add_up_in_the_record_and_the_report() {
    let mut l = ledger(10_000);
    let cached = |prompt, cached| Event::Settled {
        prompt,
        completion: 1,
        cached,
    };
    l.add("alice", Some("k1"), "free", "sim", cached(100, 64));
    l.add("alice", Some("k1"), "free", "sim", settled(10, 1));
    // A count beyond the prompt (a malformed usage) is capped at the prompt.
    l.add("alice", Some("k1"), "free", "sim", cached(5, 9));
    let b = l.due(T0_MS + 1000).unwrap().clone();
    let r = report(&b);
    assert!(validate(&r).is_ok());
    assert_eq!(
        (r.records[0].prompt_tokens, r.records[0].cached_input_tokens),
        (115, 69)
    );
    let v: serde_json::Value = serde_json::from_slice(&b.body).unwrap();
    assert_eq!(v["records"][0]["cachedInputTokens"], 69);
}

#[test]
fn requests_of_one_subject_key_tier_model_and_hour_add_up_in_one_record() {
    let mut l = ledger(10_000);
    l.add("alice", Some("k1"), "free", "sim", settled(10, 20));
    l.add("alice", Some("k1"), "free", "sim", settled(1, 2));
    l.add(
        "alice",
        Some("k1"),
        "free",
        "sim",
        Event::Refused("rate_limit_exceeded"),
    );
    l.add(
        "alice",
        Some("k1"),
        "free",
        "sim",
        Event::Refused("rate_limit_exceeded"),
    );
    l.add(
        "alice",
        Some("k1"),
        "free",
        "sim",
        Event::Refused("tokens_exceed_limit"),
    );
    // Another key, a token caller, another model, another tier, another subject: own records.
    l.add("alice", Some("k2"), "free", "sim", settled(1, 1));
    l.add("alice", None, "free", "sim", settled(1, 1));
    l.add("alice", Some("k1"), "free", "other", settled(1, 1));
    l.add("alice", Some("k1"), "premium", "sim", settled(1, 1));
    l.add("bob", Some("k1"), "free", "sim", settled(1, 1));
    assert_eq!(l.open_len(), 6);
    let key = RecordKey {
        subject: "alice".into(),
        key_id: Some("k1".into()),
        tier: "free".into(),
        model: "sim".into(),
        backend: None,
        hour_start: 1_764_561_600,
    };
    let c = l.open_counts(&key).unwrap();
    assert_eq!(
        (c.requests, c.prompt_tokens, c.completion_tokens),
        (2, 11, 22)
    );
    assert_eq!(
        c.refused,
        BTreeMap::from([
            ("rate_limit_exceeded".to_string(), 2),
            ("tokens_exceed_limit".to_string(), 1)
        ])
    );
    // The next hour (the tick's clock) opens a new record.
    assert!(l.due(T0_MS + 1_800_000).is_some());
    l.add("alice", Some("k1"), "free", "sim", settled(1, 1));
    let next = RecordKey {
        hour_start: 1_764_561_600 + 3600,
        ..key
    };
    assert_eq!(l.open_counts(&next).unwrap().requests, 1);
}

#[test]
fn each_backend_of_a_model_has_its_own_record_and_names_it_in_the_report() {
    let mut l = ledger(10_000);
    for backend in [Some("a"), Some("b"), Some("a"), None] {
        l.add_served("alice", None, "free", "duo", backend, settled(1, 2));
    }
    // A name the companion would refuse is not recorded (as any other id).
    l.add_served("alice", None, "free", "duo", Some(""), settled(1, 2));
    assert_eq!(l.open_len(), 3);
    let key = |backend: Option<&str>| RecordKey {
        subject: "alice".into(),
        key_id: None,
        tier: "free".into(),
        model: "duo".into(),
        backend: backend.map(str::to_string),
        hour_start: 1_764_561_600,
    };
    let requests = |b| l.open_counts(&key(b)).map(|c| c.requests);
    assert_eq!(
        (requests(Some("a")), requests(Some("b")), requests(None)),
        (Some(2), Some(1), Some(1))
    );
    let r = report(&l.due(T0_MS + 1000).unwrap().clone());
    assert!(validate(&r).is_ok());
    let by_backend: BTreeMap<Option<String>, u64> = r
        .records
        .iter()
        .map(|r| (r.backend.clone(), r.requests))
        .collect();
    assert_eq!(
        by_backend,
        BTreeMap::from([(None, 1), (Some("a".into()), 2), (Some("b".into()), 1)])
    );
    // On the wire: `backend` only where one served.
    let v: serde_json::Value = serde_json::from_slice(&l.batch.as_ref().unwrap().body).unwrap();
    let named = v["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r.get("backend").is_some())
        .count();
    assert_eq!(named, 2, "{v}");
}

/// A companion older than the `backend` field refuses a batch naming one (400, nothing applied):
/// the same batch goes again at once without backends, their records added into one per key,
/// and records leave backends out for an hour, then name them again.
#[test]
fn a_batch_naming_backends_refused_400_is_resent_without_them_and_nothing_is_lost() {
    let mut l = ledger(10_000);
    for backend in [Some("a"), Some("b"), Some("a"), None] {
        l.add_served("alice", None, "free", "duo", backend, settled(1, 2));
    }
    l.add("bob", None, "free", "sim", settled(5, 5));
    l.due(T0_MS + 1000).unwrap();
    l.sent(1);
    assert_eq!(
        l.answered(Some(400), T0_MS + 1100),
        Outcome::ResentWithoutBackends("gw-a/w1/0".into())
    );
    assert_eq!(l.dropped_total, 0);
    let again = l.due(T0_MS + 1100).unwrap().clone();
    assert!(!again.with_backends);
    let r = report(&again);
    assert_eq!(r.batch_id, "gw-a/w1/0");
    assert!(validate(&r).is_ok());
    assert!(r.records.iter().all(|r| r.backend.is_none()));
    let totals: BTreeMap<&str, (u64, u64, u64)> = r
        .records
        .iter()
        .map(|r| {
            (
                r.subject.as_str(),
                (r.requests, r.prompt_tokens, r.completion_tokens),
            )
        })
        .collect();
    assert_eq!(
        totals,
        BTreeMap::from([("alice", (4, 4, 8)), ("bob", (1, 5, 5))])
    );
    // Refused again without backends: dropped and counted, as any refused batch.
    l.sent(2);
    assert_eq!(
        l.answered(Some(400), T0_MS + 1200),
        Outcome::Refused("gw-a/w1/0".into())
    );
    assert_eq!(l.dropped_total, 2);
    // Within the hour, new records are sent without backends; after it, with them again.
    l.add_served("alice", None, "free", "duo", Some("a"), settled(1, 1));
    let b = l.due(T0_MS + 10_000).unwrap().clone();
    assert!(!b.with_backends && report(&b).records[0].backend.is_none());
    l.sent(3);
    l.answered(Some(200), T0_MS + 10_100);
    let later = T0_MS + (super::BACKENDS_RETRY_S + 10) * 1000;
    l.now_s = later / 1000;
    l.add_served("alice", None, "free", "duo", Some("a"), settled(1, 1));
    let b = l.due(later).unwrap().clone();
    assert!(b.with_backends);
    assert_eq!(report(&b).records[0].backend.as_deref(), Some("a"));
}

#[test]
fn ids_the_companion_would_refuse_are_not_recorded_and_nothing_is_recorded_when_off() {
    let mut l = ledger(10_000);
    l.add("", Some("k"), "free", "sim", settled(1, 1));
    l.add("a\nb", None, "free", "sim", settled(1, 1));
    l.add("alice", Some(""), "free", "sim", settled(1, 1));
    l.add("alice", None, "", "sim", settled(1, 1));
    l.add("alice", None, "free", &"m".repeat(1025), settled(1, 1));
    assert_eq!(l.open_len(), 0);
    l.add("alice", None, "free", "sim", Event::Refused("Not A Reason"));
    assert_eq!(
        l.open_counts(&RecordKey {
            subject: "alice".into(),
            key_id: None,
            tier: "free".into(),
            model: "sim".into(),
            backend: None,
            hour_start: 1_764_561_600,
        })
        .unwrap()
        .refused
        .len(),
        0
    );
    let mut off = ledger(10_000);
    off.enabled = false;
    off.add("alice", None, "free", "sim", settled(1, 1));
    assert_eq!(off.open_len(), 0);
    assert!(off.due(T0_MS + 10_000).is_none());
}

#[test]
fn one_batch_per_interval_with_at_most_1024_records_the_oldest_first_and_the_rest_at_the_next_tick()
{
    let mut l = ledger(10_000);
    for i in 0..1500 {
        l.add(&format!("u{i}"), None, "free", "sim", settled(i, 1));
    }
    // Not before the interval.
    assert!(l.due(T0_MS + 999).is_none());
    let b = l.due(T0_MS + 1000).unwrap().clone();
    let r = report(&b);
    assert!(validate(&r).is_ok());
    assert_eq!(r.replica, "gw-a");
    assert_eq!(r.batch_id, "gw-a/w1/0");
    assert_eq!(b.batch_id, r.batch_id);
    assert_eq!(r.records.len(), MAX_USAGE_RECORDS);
    assert_eq!(
        r.records[0],
        UsageRecord {
            subject: "u0".into(),
            key_id: None,
            tier: "free".into(),
            model: "sim".into(),
            hour_start: 1_764_561_600,
            requests: 1,
            refused: BTreeMap::new(),
            prompt_tokens: 0,
            completion_tokens: 1,
            cached_input_tokens: 0,
            backend: None,
        }
    );
    assert_eq!(r.records[1023].subject, "u1023");
    l.sent(7);
    assert!(l.is_batch(7));
    // In flight: nothing more goes, however long the answer takes.
    assert!(l.due(T0_MS + 5000).is_none());
    assert_eq!(l.answered(Some(200), T0_MS + 5000), Outcome::Applied);
    // More open: the rest goes at the next tick, not an interval later.
    let b2 = l.due(T0_MS + 5000).unwrap().clone();
    let r2 = report(&b2);
    assert_eq!(r2.batch_id, "gw-a/w1/1");
    assert_eq!(r2.records.len(), 1500 - MAX_USAGE_RECORDS);
    assert_eq!(r2.records[0].subject, "u1024");
    l.sent(8);
    assert_eq!(l.answered(Some(200), T0_MS + 5100), Outcome::Applied);
    assert!(l.due(T0_MS + 5200).is_none());
    assert!(l.due(T0_MS + 60_000).is_none(), "nothing open: no report");
    assert_eq!(l.dropped_total, 0);
}

#[test]
fn a_failed_batch_is_resent_verbatim_with_the_same_batch_id_until_a_200_while_new_records_wait() {
    for failure in [Some(503), Some(500), None] {
        let mut l = ledger(10_000);
        l.add("alice", Some("k1"), "free", "sim", settled(3, 4));
        let first = l.due(T0_MS + 1000).unwrap().clone();
        l.sent(1);
        assert_eq!(l.answered(failure, T0_MS + 1100), Outcome::Kept);
        // New records accumulate meanwhile (also for the very same key: a new open record).
        l.add("alice", Some("k1"), "free", "sim", settled(1, 1));
        l.add("bob", None, "free", "sim", settled(1, 1));
        assert_eq!(l.pending(), 3);
        // Not before the next interval; then the same bytes.
        assert!(l.due(T0_MS + 1500).is_none());
        let again = l.due(T0_MS + 2000).unwrap().clone();
        assert_eq!(again.body, first.body, "{failure:?}");
        assert_eq!(again.batch_id, "gw-a/w1/0");
        // A dispatch error keeps it too.
        l.not_sent();
        let third = l.due(T0_MS + 3000).unwrap().clone();
        assert_eq!(third.body, first.body);
        l.sent(2);
        assert_eq!(l.answered(Some(200), T0_MS + 3100), Outcome::Applied);
        // Then the new records, in a new batch.
        let next = report(l.due(T0_MS + 4000).unwrap());
        assert_eq!(next.batch_id, "gw-a/w1/1");
        assert_eq!(next.records.len(), 2);
        assert_eq!(l.dropped_total, 0);
    }
}

#[test]
fn a_batch_the_companion_refuses_with_400_is_dropped_and_counted_never_resent() {
    let mut l = ledger(10_000);
    l.add("alice", None, "free", "sim", settled(1, 1));
    l.add("bob", None, "free", "sim", settled(1, 1));
    l.due(T0_MS + 1000).unwrap();
    l.sent(1);
    assert_eq!(
        l.answered(Some(400), T0_MS + 1100),
        Outcome::Refused("gw-a/w1/0".into())
    );
    assert_eq!((l.dropped_total, l.dropped_unflushed), (2, 2));
    assert!(l.due(T0_MS + 2000).is_none());
    // An answer to no batch of ours changes nothing.
    assert_eq!(l.answered(Some(200), T0_MS + 2100), Outcome::Unknown);
}

#[test]
fn memory_is_bounded_the_oldest_open_records_go_first_and_are_counted() {
    let mut l = ledger(2048);
    for i in 0..2048 {
        l.add(&format!("u{i}"), None, "free", "sim", settled(1, 1));
    }
    assert_eq!((l.pending(), l.dropped_total), (2048, 0));
    // A record that exists already costs no room.
    l.add("u5", None, "free", "sim", settled(1, 1));
    assert_eq!(l.dropped_total, 0);
    for i in 2048..2058 {
        l.add(&format!("u{i}"), None, "free", "sim", settled(1, 1));
    }
    assert_eq!((l.pending(), l.dropped_total), (2048, 10));
    // The ten oldest went; u10 is now the oldest.
    let b = report(l.due(T0_MS + 1000).unwrap());
    assert_eq!(b.records[0].subject, "u10");
    // A batch kept for a resend counts against the bound: open records make room for it.
    l.sent(1);
    assert_eq!(l.answered(Some(503), T0_MS + 1100), Outcome::Kept);
    assert_eq!(l.pending(), 2048);
    l.add("new", None, "free", "sim", settled(1, 1));
    assert_eq!((l.pending(), l.dropped_total), (2048, 11));
    // The log line: once a minute at most.
    assert!(l.drop_log(T0_MS).is_some());
    assert!(l.drop_log(T0_MS + 59_999).is_none());
    assert!(l.drop_log(T0_MS + 60_000).is_some());
}

#[test]
fn counts_saturate_at_the_contract_maximum() {
    let mut l = ledger(10_000);
    l.add("alice", None, "free", "sim", settled(MAX_USAGE_COUNT, 1));
    l.add("alice", None, "free", "sim", settled(MAX_USAGE_COUNT, 1));
    let r = report(l.due(T0_MS + 1000).unwrap());
    assert_eq!(r.records[0].prompt_tokens, MAX_USAGE_COUNT);
    assert!(validate(&r).is_ok());
}

#[test]
fn batch_ids_leave_the_replica_out_when_it_would_be_too_long_and_worker_ids_differ() {
    assert_eq!(batch_id("r", "w1", 3), "r/w1/3");
    assert_eq!(batch_id(&"r".repeat(1024), "w1", 3), "w1/3");
    assert_ne!(draw_worker_id(1, 1), draw_worker_id(1, 1));
}
