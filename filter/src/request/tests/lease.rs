//! Global limits in a request's life: a short lease → one callout (the request paused) →
//! granted → forwarded; denied → 429; unreachable → fallback (local share) or 503.

use super::*;
use crate::host::recording::Dispatched;
use crate::lease::{GlobalState, STATE_KEY};
use crate::limits::Kind;
use maas_types::lease::{LEASES_PATH, LeaseRequest};

/// One worker with global limits on, one Gateway replica configured (as the single-replica
/// local stack), `global` merged into `limits.global` (`"replicas": null` unsets it).
fn global(global: Value) -> Fx {
    let mut g = json!({"replicaId": "gw-a", "replicas": 1});
    for (k, v) in global.as_object().unwrap() {
        g[k] = v.clone();
    }
    let fx = Fx::with(json!({"limits": {"global": g}}));
    fx.cache(&key(2), allow_alice());
    fx
}

pub(super) fn lease_calls(fx: &Fx) -> Vec<Dispatched> {
    fx.host
        .dispatched
        .borrow()
        .iter()
        .filter(|d| d.headers.iter().any(|(_, v)| v == LEASES_PATH))
        .cloned()
        .collect()
}

fn last_lease(fx: &Fx) -> LeaseRequest {
    let d = lease_calls(fx).pop().expect("a lease callout");
    assert_eq!(d.cluster, COMPANION);
    assert!(d.headers.contains(&(":method".into(), "POST".into())));
    serde_json::from_slice(d.body.as_deref().unwrap()).unwrap()
}

/// A 200 answer granting each item what `f(item)` says: (granted, taken).
pub(super) fn grants(
    req: &LeaseRequest,
    f: impl Fn(&maas_types::lease::LeaseItem) -> (u64, u64),
) -> Vec<u8> {
    let grants: Vec<Value> = req
        .items
        .iter()
        .map(|i| {
            let (granted, taken) = f(i);
            json!({"granted": granted, "taken": taken})
        })
        .collect();
    json!({"replicas": 1, "store": "memory", "grants": grants})
        .to_string()
        .into_bytes()
}

/// (count, granted) of alice's requests counter now.
fn requests(fx: &Fx) -> (u64, u64) {
    let (c, g, _) = limits::lease_state(
        &fx.host.store,
        &limits::counter_key("alice", limits::DEFAULT_COUNTER_SLOTS),
        "alice",
        Kind::Requests,
        60,
        fx.host.now.get() / 1000,
    );
    (c, g)
}

/// A cached request of alice up to the end of its body (default mode).
fn to_body_end(fx: &Fx) -> (u32, Http, Action) {
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Continue
    );
    let a = fx.body(id, &h, BODY, true);
    (id, h, a)
}

fn shared_state(fx: &Fx) -> GlobalState {
    crate::lease::read_state(&fx.host.store).0
}

#[test]
fn a_short_lease_waits_for_one_callout_and_the_granted_request_is_forwarded() {
    let fx = global(json!({}));
    let (id, h, a) = to_body_end(&fx);
    assert_eq!(a, Action::Pause, "the body waits for the lease");
    assert_eq!(fx.phase(&h), "Leasing");
    assert_eq!(requests(&fx), (0, 0), "nothing counted while leasing");
    let req = last_lease(&fx);
    assert_eq!(req.replica, "gw-a");
    assert_eq!(req.items.len(), 2, "{req:?}");
    let r = req
        .items
        .iter()
        .find(|i| i.kind.as_str() == "requests")
        .unwrap();
    assert_eq!((r.subject.as_str(), r.need, r.limit), ("alice", 1, 3));
    let t = req
        .items
        .iter()
        .find(|i| i.kind.as_str() == "tokens")
        .unwrap();
    assert!(t.need > 0 && t.want >= t.need && t.limit == 1000, "{t:?}");
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.want, i.want)));
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    assert_eq!(requests(&fx).0, 1);
    assert!(requests(&fx).1 >= 1);
    fx.flush();
    assert_eq!(fx.host.metric("maas_lease_callouts_total"), 1);
    assert_eq!(
        fx.host
            .series_sum("maas_requests_total", &[("decision", "allowed")]),
        1
    );
    assert!(fx.host.sent.borrow().is_empty());
}

#[test]
fn a_request_without_a_body_waits_for_its_lease_with_its_headers_paused() {
    let fx = global(json!({}));
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), true),
        Action::Pause
    );
    assert_eq!(fx.phase(&h), "Leasing");
    let req = last_lease(&fx);
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn a_lease_held_admits_without_a_callout() {
    let fx = global(json!({}));
    let (id, h, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    fx.answer(
        id,
        &h,
        Some(200),
        &grants(&req, |i| (i.limit.min(3 * i.need), 3 * i.need)),
    );
    let (_, _, a) = to_body_end(&fx);
    assert_eq!(a, Action::Continue);
    assert_eq!(lease_calls(&fx).len(), 1, "one callout for two requests");
    assert_eq!(requests(&fx), (2, 3));
}

#[test]
fn a_lease_denied_is_429_until_the_window_end_when_the_limit_is_reached_globally() {
    let fx = global(json!({}));
    let (id, h, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    // Other replicas took the whole window.
    fx.answer(id, &h, Some(200), &grants(&req, |i| (0, i.limit)));
    let sent = fx.sent_to(id).unwrap();
    assert_eq!(sent.status, 429);
    let left = 60 - (fx.host.now.get() / 1000) % 60;
    assert_eq!(sent.header("retry-after"), Some(left.to_string().as_str()));
    // remaining = limit − (count + others)
    assert_eq!(sent.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(requests(&fx).0, 0, "nothing counted");
    assert!(!fx.resumed(id));
}

#[test]
fn a_lease_short_while_budget_is_left_elsewhere_is_429_for_a_few_seconds() {
    let fx = global(json!({}));
    let (id, h, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    // Other replicas hold most of it as leases they have not used yet.
    fx.answer(id, &h, Some(200), &grants(&req, |i| (0, i.limit - 1)));
    let sent = fx.sent_to(id).unwrap();
    assert_eq!(sent.status, 429);
    // idleReleaseMs 3000 + reportIntervalMs 1000.
    assert_eq!(sent.header("retry-after"), Some("4"));
    assert!(
        !shared_state(&fx).fallback,
        "a 200 that grants nothing is no failure"
    );
}

#[test]
fn a_lease_service_error_enters_fallback_and_admits_within_the_local_share() {
    for status in [Some(503), Some(404), None] {
        let fx = global(json!({"fallbackFraction": 0.34}));
        let (id, h, _) = to_body_end(&fx);
        fx.answer(id, &h, status, b"");
        // ⌊3 × 0.34⌋ = 1 request of the minute's 3 on this replica.
        assert!(fx.resumed(id), "{status:?}");
        assert!(fx.phase(&h).starts_with("Forwarding"));
        assert!(shared_state(&fx).fallback, "shared by every worker");
        fx.flush();
        assert_eq!(fx.host.metric("maas_lease_fallback_entered_total"), 1);
        let gauge = fx.root.worker.borrow().metrics.lease_fallback;
        assert!(fx.host.recorded.borrow().contains(&(gauge, 1)));
        // In fallback: no callout; beyond the share → 429 with a short retry.
        let (id2, _, a) = to_body_end(&fx);
        assert_eq!(a, Action::Pause);
        let sent = fx.sent_to(id2).unwrap();
        assert_eq!(sent.status, 429);
        assert_eq!(sent.header("retry-after"), Some("4"));
        assert_eq!(lease_calls(&fx).len(), 1, "{status:?}");
        assert_eq!(requests(&fx), (1, 0));
    }
}

/// A fresh replica whose first lease callout fails (the store down from its start): it has
/// never been told how many replicas there are, and assumes the configured count. The
/// minute's limit is 3: ⌊3 ÷ 2⌋ = 1 on this replica (before: the default count 1 gave it all 3).
#[test]
fn before_any_answer_fallback_assumes_the_configured_replicas() {
    let fx = global(json!({"replicas": 2}));
    let (id, h, _) = to_body_end(&fx);
    fx.answer(id, &h, Some(503), b"");
    assert_eq!(shared_state(&fx).replicas, 1, "never answered");
    assert!(fx.resumed(id), "its share admits one");
    assert!(fx.phase(&h).starts_with("Forwarding"));
    for _ in 0..2 {
        let (id2, _, _) = to_body_end(&fx);
        let sent = fx.sent_to(id2).unwrap();
        assert_eq!(sent.status, 429, "beyond ⌊3 ÷ 2⌋");
    }
    assert_eq!(requests(&fx), (1, 0));
    assert_eq!(lease_calls(&fx).len(), 1, "no callout in fallback");
}

/// After a quiet spell longer than the companion's replica TTL (30 s), the first replica to
/// call is the only one the companion counts: its answer says 1 replica. When the store then
/// fails, the share is still the configured count's (before: that answer made it the whole
/// limit, and the other replica, back from its own quiet spell, took its share on top).
#[test]
fn after_a_quiet_spell_an_answer_counting_one_replica_does_not_widen_the_share() {
    let mut fx = global(json!({"replicas": 2}));
    fx.host.now.set(fx.host.now.get() + 45_000);
    let (id, h, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    // Exactly what it needs; the companion saw this replica alone (`grants` says 1).
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id));
    assert_eq!(shared_state(&fx).replicas, 1);
    assert_eq!(requests(&fx), (1, 1));
    // The store fails at the next request's callout.
    let (id2, h2, _) = to_body_end(&fx);
    fx.answer(id2, &h2, None, b"");
    assert!(shared_state(&fx).fallback);
    // Its lease (1) is used and ⌊3 ÷ 2⌋ = 1 is no more: 429, not 2 more on a share of 1.
    assert_eq!(fx.sent_to(id2).unwrap().status, 429);
    let (id3, _, _) = to_body_end(&fx);
    assert_eq!(fx.sent_to(id3).unwrap().status, 429);
    assert_eq!(requests(&fx), (1, 1));
    // The root's probe is answered: out of fallback, leases again.
    root_tick(&mut fx);
    fx.host.now.set(fx.host.now.get() + 1000);
    root_tick(&mut fx);
    let probe = last_lease(&fx);
    root_answer(&mut fx, 200, &grants(&probe, |_| (0, 1)));
    assert!(!shared_state(&fx).fallback);
}

/// No replica count and no fraction configured: a replica in fallback cannot know how many
/// others admit on their own, so beyond the leases it holds it refuses (503
/// `limits_unavailable`) instead of assuming it is alone, until a lease answer comes.
#[test]
fn without_a_replica_count_fallback_refuses_until_a_lease_answer() {
    let mut fx = global(json!({"replicas": null}));
    let (id, h, _) = to_body_end(&fx);
    fx.answer(id, &h, Some(503), b"");
    let sent = fx.sent_to(id).unwrap();
    assert_eq!(
        (sent.status, sent.code().as_str()),
        (503, "limits_unavailable")
    );
    assert!(!fx.resumed(id));
    let (id2, _, _) = to_body_end(&fx);
    assert_eq!(fx.sent_to(id2).unwrap().code(), "limits_unavailable");
    assert_eq!(lease_calls(&fx).len(), 1, "no callout in fallback");
    assert_eq!(requests(&fx), (0, 0));
    // The first callout is re-sent by the root (the probe); a 200 ends the fallback.
    fx.host.now.set(fx.host.now.get() + 1000);
    root_tick(&mut fx);
    let probe = last_lease(&fx);
    root_answer(&mut fx, 200, &grants(&probe, |i| (i.need, i.need)));
    assert!(!shared_state(&fx).fallback);
    let (_, h3, a) = to_body_end(&fx);
    assert_eq!(a, Action::Continue, "served on the lease the probe brought");
    assert!(fx.phase(&h3).starts_with("Forwarding"));
    assert_eq!(requests(&fx), (1, 1));
}

#[test]
fn a_lease_that_cannot_be_dispatched_falls_back_at_once() {
    let fx = global(json!({}));
    fx.host.dispatch_fails.set(true);
    let (_, h, a) = to_body_end(&fx);
    // One replica known: the full limit locally.
    assert_eq!(a, Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"));
    assert!(shared_state(&fx).fallback);
}

#[test]
fn refuse_mode_answers_503_while_the_lease_service_is_unreachable() {
    let fx = global(json!({"onUnavailable": "refuse"}));
    let (id, h, _) = to_body_end(&fx);
    fx.answer(id, &h, Some(503), b"");
    let sent = fx.sent_to(id).unwrap();
    assert_eq!(
        (sent.status, sent.code().as_str()),
        (503, "limits_unavailable")
    );
    assert!(!fx.resumed(id));
    // Later requests: 503 without a callout.
    let (id2, _, _) = to_body_end(&fx);
    assert_eq!(fx.sent_to(id2).unwrap().code(), "limits_unavailable");
    assert_eq!(lease_calls(&fx).len(), 1);
    assert_eq!(requests(&fx).0, 0);
}

#[test]
fn a_client_gone_while_leasing_counts_nothing_and_holds_nobody_up() {
    let fx = global(json!({}));
    let (id, h, _) = to_body_end(&fx);
    fx.host.enter(id);
    h.on_log(&fx.host);
    assert!(h.on_done(&fx.host));
    assert_eq!(requests(&fx), (0, 0));
    // Another request of the same subject asks and is answered on its own.
    let (id2, h2, a) = to_body_end(&fx);
    assert_eq!(a, Action::Pause);
    let req = last_lease(&fx);
    fx.answer(id2, &h2, Some(200), &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id2));
    assert_eq!(requests(&fx), (1, 1));
}

#[test]
fn trailers_ending_the_body_wait_for_the_lease_too() {
    let fx = global(json!({}));
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, BODY, false), Action::Pause);
    fx.host.enter(id);
    assert_eq!(h.on_request_trailers(&fx.host), Action::Pause);
    assert_eq!(fx.phase(&h), "Leasing");
    let req = last_lease(&fx);
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn held_headers_wait_for_the_lease_and_resume_with_the_body() {
    let fx = Fx::with(json!({"pauseHeadersForBody": true,
                             "limits": {"global": {"replicaId": "gw-a"}}}));
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert_eq!(fx.body(id, &h, BODY, true), Action::Pause);
    assert_eq!(fx.phase(&h), "Leasing");
    let req = last_lease(&fx);
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn an_admitted_subject_is_tracked_in_the_worker_without_host_calls() {
    let fx = global(json!({}));
    let (id, h, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.limit, i.limit)));
    let w = fx.root.worker.borrow();
    let t = w.leases.tracked.get("alice").unwrap();
    assert_eq!(
        t.key,
        limits::counter_key("alice", limits::DEFAULT_COUNTER_SLOTS)
    );
    assert_eq!(t.counters.len(), 2);
    assert_eq!(t.last_ms, fx.host.now.get() / 1000 * 1000);
    let _ = STATE_KEY;
}

#[test]
fn concurrent_requests_of_one_subject_share_one_lease_callout() {
    let fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, h2, a) = to_body_end(&fx);
    assert_eq!(a, Action::Pause);
    assert_eq!(fx.phase(&h2), "Leasing");
    assert_eq!(lease_calls(&fx).len(), 1, "single flight per subject");
    let req = last_lease(&fx);
    // Enough for both.
    fx.answer(
        id1,
        &h1,
        Some(200),
        &grants(&req, |i| (2 * i.need, 2 * i.need)),
    );
    assert!(fx.resumed(id1) && fx.resumed(id2));
    assert!(fx.phase(&h1).starts_with("Forwarding"));
    assert!(fx.phase(&h2).starts_with("Forwarding"));
    assert_eq!(requests(&fx), (2, 2));
    assert_eq!(lease_calls(&fx).len(), 1);
    assert_eq!(
        fx.host.effective.get(),
        id1,
        "back on the answering context"
    );
}

/// The root context's tick (pending lease requests go out) and the answer to its last callout.
fn root_tick(fx: &mut Fx) {
    fx.host.now.set(fx.host.now.get() + crate::worker::TICK_MS);
    fx.root.tick(&fx.host);
}

fn root_answer(fx: &mut Fx, status: u32, body: &[u8]) {
    let token = lease_calls(fx).pop().unwrap().token;
    fx.host.enter(fx.root.id);
    fx.host
        .set_map(Headers::CallResponse, &[(":status", &status.to_string())]);
    fx.host.set_buffer(Body::CallResponse, body);
    fx.root.on_call_response(&fx.host, token, body.len());
}

#[test]
fn members_still_short_after_the_answer_get_the_roots_next_flight() {
    let mut fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, h2, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    fx.answer(id1, &h1, Some(200), &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id1));
    assert!(!fx.resumed(id2));
    assert_eq!(fx.phase(&h2), "Leasing");
    assert_eq!(
        lease_calls(&fx).len(),
        1,
        "nothing dispatched on another's context"
    );
    root_tick(&mut fx);
    assert_eq!(lease_calls(&fx).len(), 2);
    let follow = last_lease(&fx);
    let r = follow
        .items
        .iter()
        .find(|i| i.kind.as_str() == "requests")
        .unwrap();
    assert_eq!(r.need, 1, "what the member still needs");
    root_answer(&mut fx, 200, &grants(&follow, |i| (i.need, 2 * i.need)));
    assert!(fx.resumed(id2));
    assert!(fx.phase(&h2).starts_with("Forwarding"));
    assert_eq!(fx.host.effective.get(), fx.root.id, "back on the root");
    assert_eq!(requests(&fx), (2, 2));
}

#[test]
fn members_still_short_when_the_limit_is_reached_globally_get_429_at_once() {
    let fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, _h2, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    fx.answer(id1, &h1, Some(200), &grants(&req, |i| (0, i.limit)));
    assert_eq!(fx.sent_to(id1).unwrap().status, 429);
    assert_eq!(fx.sent_to(id2).unwrap().status, 429);
    assert!(fx.root.worker.borrow().lease_pending.is_empty());
}

#[test]
fn waiters_of_a_failed_lease_callout_fall_back_too() {
    let fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, h2, _) = to_body_end(&fx);
    fx.answer(id1, &h1, None, b"");
    assert!(fx.resumed(id1) && fx.resumed(id2));
    assert!(fx.phase(&h2).starts_with("Forwarding"));
    assert_eq!(lease_calls(&fx).len(), 1);
    assert_eq!(requests(&fx), (2, 0));
}

#[test]
fn the_members_of_a_carrier_gone_get_the_roots_next_flight() {
    let mut fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, h2, _) = to_body_end(&fx);
    fx.host.enter(id1);
    assert!(h1.on_done(&fx.host));
    // Envoy cancelled the callout with its stream: the member waits, not refused.
    assert!(fx.sent_to(id2).is_none());
    assert_eq!(fx.phase(&h2), "Leasing");
    root_tick(&mut fx);
    assert_eq!(lease_calls(&fx).len(), 2);
    let req = last_lease(&fx);
    root_answer(&mut fx, 200, &grants(&req, |i| (i.need, i.need)));
    assert!(fx.resumed(id2));
    assert_eq!(requests(&fx), (1, 1));
    assert!(fx.root.worker.borrow().lease_flights.is_empty());
}

#[test]
fn a_member_gone_leaves_the_lease_flight() {
    let fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, h2, _) = to_body_end(&fx);
    fx.host.enter(id2);
    assert!(h2.on_done(&fx.host));
    let req = last_lease(&fx);
    fx.answer(
        id1,
        &h1,
        Some(200),
        &grants(&req, |i| (2 * i.need, 2 * i.need)),
    );
    assert!(fx.resumed(id1));
    assert!(!fx.resumed(id2));
    assert!(fx.sent_to(id2).is_none());
    assert_eq!(
        requests(&fx),
        (1, 2),
        "only the request still there is counted"
    );
    assert!(fx.root.worker.borrow().lease_flights.is_empty());
}

#[test]
fn a_request_short_forever_is_refused_after_the_last_round() {
    let mut fx = global(json!({}));
    let (id1, h1, _) = to_body_end(&fx);
    let (id2, _h2, _) = to_body_end(&fx);
    let req = last_lease(&fx);
    fx.answer(id1, &h1, Some(200), &grants(&req, |i| (i.need, i.need)));
    // Each answer grants something, but less than the member needs.
    for _ in 0..8 {
        root_tick(&mut fx);
        let req = last_lease(&fx);
        if fx.sent_to(id2).is_some() {
            break;
        }
        root_answer(&mut fx, 200, &grants(&req, |_| (0, 1)));
        let rounds = fx.root.worker.borrow().lease_pending.len();
        if rounds == 0 {
            break;
        }
    }
    root_tick(&mut fx);
    assert_eq!(fx.sent_to(id2).map(|s| s.status), Some(429));
}

/// A request woken inside another request's callback (the authentication's single flight)
/// never dispatches there (the proxy-wasm SDK would route the answer to that context): it
/// waits for the root's next flight.
#[test]
fn an_auth_waiter_short_of_lease_waits_for_the_roots_flight() {
    let mut fx = Fx::with(json!({"limits": {"global": {"replicaId": "gw-a"}}}));
    // Lease for one request: the first is admitted at once, the second is short.
    let now = fx.host.now.get() / 1000;
    let grant = |kind, granted| limits::Grant {
        kind,
        window: 60,
        start: now - now % 60,
        granted,
        taken: granted,
    };
    assert!(limits::apply_grants(
        &fx.host.store,
        &limits::counter_key("alice", limits::DEFAULT_COUNTER_SLOTS),
        "alice",
        &[grant(Kind::Requests, 1), grant(Kind::Tokens, 1000)],
        now,
    ));
    let (id1, h1) = fx.http();
    let (id2, h2) = fx.http();
    // Both without a body: admitted as soon as the credential is known.
    fx.headers(id1, &h1, &refs(&chat(&key(2))), true);
    fx.headers(id2, &h2, &refs(&chat(&key(2))), true);
    assert_eq!(fx.dispatches(), 1, "one authentication callout");
    fx.answer(id1, &h1, Some(200), &alice());
    // id1 is admitted; id2 (woken on id1's context) is pending: nothing dispatched there.
    assert!(fx.resumed(id1));
    assert_eq!(lease_calls(&fx).len(), 0);
    assert_eq!(fx.phase(&h2), "Leasing");
    assert_eq!(fx.root.worker.borrow().lease_pending.len(), 1);
    root_tick(&mut fx);
    assert_eq!(lease_calls(&fx).len(), 1);
    let req = last_lease(&fx);
    root_answer(&mut fx, 200, &grants(&req, |i| (i.need, 2 * i.need)));
    assert!(fx.resumed(id2));
    assert_eq!(requests(&fx), (2, 2));
}

/// A request's lease callout that got no answer (the companion may have applied it all the
/// same: Redis paused) is re-sent by the root, verbatim, until a 200 — whose grants are then
/// added to this replica's lease (not stranded until the window's end).
#[test]
fn an_unanswered_lease_callout_is_resent_verbatim_by_the_root_and_its_grants_kept() {
    let mut fx = global(json!({}));
    let (id, h, _) = to_body_end(&fx);
    let first = lease_calls(&fx).pop().unwrap();
    let req: LeaseRequest = serde_json::from_slice(first.body.as_deref().unwrap()).unwrap();
    assert!(req.batch_id.is_some(), "the callout carries a batch id");
    fx.answer(id, &h, None, b"");
    assert!(shared_state(&fx).fallback);
    // The next report re-sends the same bytes (the probe), until a 200.
    fx.host.now.set(fx.host.now.get() + 1000);
    fx.root.tick(&fx.host);
    let again = lease_calls(&fx).pop().unwrap();
    assert_ne!(again.token, first.token);
    assert_eq!(again.body, first.body, "verbatim: same id, same items");
    root_answer(&mut fx, 200, &grants(&req, |i| (i.want, i.want)));
    assert!(!shared_state(&fx).fallback);
    let want = req.items[0].want;
    assert_eq!(
        requests(&fx),
        (1, want),
        "its grant is this replica's lease"
    );
    assert!(
        fx.root.worker.borrow().leases.tracked.contains_key("alice"),
        "tracked: released when idle"
    );
}

#[test]
fn a_body_decided_at_its_content_length_waits_for_its_lease_to_its_end() {
    let fx = global(json!({}));
    let (id, h) = fx.http();
    let mut headers: Vec<(&'static str, String)> = chat(&key(2))
        .into_iter()
        .filter(|(k, _)| *k != "content-length")
        .collect();
    headers.push(("content-length", BODY.len().to_string()));
    assert_eq!(fx.headers(id, &h, &refs(&headers), false), Action::Continue);
    // Whole at its declared length: admission runs now, and the lease is short.
    assert_eq!(fx.body(id, &h, BODY, false), Action::Pause);
    assert_eq!(fx.phase(&h), "Leasing");
    // The stream ends while the lease is asked for (Envoy still holds the body): still paused,
    // and neither the end nor trailers let it through.
    assert_eq!(fx.body(id, &h, BODY, true), Action::Pause);
    assert_eq!(h.on_request_trailers(&fx.host), Action::Pause);
    assert_eq!(fx.phase(&h), "Leasing");
    // Granted: resumed, and what comes after goes on.
    let req = last_lease(&fx);
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.want, i.want)));
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    assert_eq!(fx.body(id, &h, b"", true), Action::Continue);
    assert!(fx.sent_to(id).is_none());
}

/// `global` with a tier that never trips (so leases, not limits, decide).
fn global_roomy() -> Fx {
    let mut p = policy();
    p["tiers"][0]["limits"] = json!({
        "requests": [{"limit": 1_000_000, "window": "1m"}],
        "tokens": [{"limit": 1_000_000_000u64, "window": "1m"}]
    });
    let fx = Fx::with(json!({
        "bootstrapPolicy": p,
        "limits": {"global": {"replicaId": "gw-a"}},
    }));
    fx.cache(&key(2), allow_alice());
    fx
}

fn report(fx: &mut Fx, after_ms: u64) {
    fx.host.now.set(fx.host.now.get() + after_ms);
    fx.root.tick(&fx.host);
}

/// A first lease (answered with plenty), then 50 requests in a second, measured by two reports.
fn a_burst_of_50_a_second(fx: &mut Fx) {
    let (id, h, _) = to_body_end(fx);
    let req = last_lease(fx);
    fx.answer(
        id,
        &h,
        Some(200),
        &grants(&req, |i| (i.need * 1000, i.need * 1000)),
    );
    assert!(fx.phase(&h).starts_with("Forwarding"));
    report(fx, 1000);
    for _ in 0..50 {
        assert_eq!(to_body_end(fx).2, Action::Continue);
    }
    report(fx, 1000);
}

/// alice's meters know 50 a second (each counter).
fn assert_tracked_at_50_a_second(fx: &Fx) {
    let w = fx.root.worker.borrow();
    let t = w.leases.tracked.get("alice").unwrap();
    assert_eq!(t.meters.len(), 2);
    assert!(
        t.meters.iter().all(|m| m.for_horizon(1000) >= 50),
        "{:?}",
        t.meters
    );
}

/// A request whose lease is short: it waits for its callout (returned with the request).
fn short_of_lease(fx: &Fx) -> (u32, Http, LeaseRequest) {
    let (id, h, a) = to_body_end(fx);
    assert_eq!(a, Action::Pause);
    assert_eq!(fx.phase(&h), "Leasing");
    (id, h, last_lease(fx))
}

fn item<'a>(req: &'a LeaseRequest, kind: &str) -> &'a maas_types::lease::LeaseItem {
    req.items.iter().find(|i| i.kind.as_str() == kind).unwrap()
}

#[test]
fn a_new_windows_first_lease_is_sized_by_the_rate_the_reports_saw() {
    let mut fx = global_roomy();
    a_burst_of_50_a_second(&mut fx);
    assert_eq!(
        lease_calls(&fx).len(),
        1,
        "the lease held: no callout, no renewal yet"
    );
    assert_tracked_at_50_a_second(&fx);
    // The next window: nothing granted there yet, the window's own average knows one request.
    let now = fx.host.now.get();
    fx.host.now.set(now - now % 60_000 + 60_000 + 100);
    let (_, _, req) = short_of_lease(&fx);
    let r = item(&req, "requests");
    // 50 a second over the 2 s horizon (the window's average alone: 2).
    assert_eq!((r.need, r.want), (1, 100), "{r:?}");
    let t = item(&req, "tokens");
    assert!(t.want >= 100 * t.need, "{t:?}");
}

#[test]
fn a_subject_back_from_idling_is_leased_by_its_last_bursts_rate_not_the_diluted_average() {
    let mut fx = global_roomy();
    // Start at a window's beginning, so that everything below stays in one window.
    let now = fx.host.now.get();
    fx.host.now.set(now - now % 60_000 + 60_000 + 100);
    a_burst_of_50_a_second(&mut fx);
    // Idle: the reports release its lease and stop tracking it (each batch answered).
    let mut reports = 0;
    while fx.root.worker.borrow().leases.tracked.contains_key("alice") {
        reports += 1;
        assert!(reports < 20, "an idle subject is dropped");
        let before = lease_calls(&fx).len();
        report(&mut fx, 1000);
        if lease_calls(&fx).len() > before {
            let req = last_lease(&fx);
            root_answer(&mut fx, 200, &grants(&req, |_| (0, 0)));
        }
    }
    let remembered = |fx: &Fx| {
        fx.root
            .worker
            .borrow()
            .leases
            .remembered
            .contains_key("alice")
    };
    assert!(remembered(&fx), "its rates are remembered");
    let (count, granted) = requests(&fx);
    assert_eq!(granted, count, "its unused lease was released");
    // Back, in the same window: the window's average is diluted by the idle seconds (51
    // requests since its start, about 2 s × 51 / 7 s ≈ 14 over the horizon); the burst's
    // rate is 50 a second, 100 over the 2 s horizon.
    let (id, h, req) = short_of_lease(&fx);
    let r = item(&req, "requests");
    assert!(r.want >= 100, "{r:?}");
    // Admitted: tracked again, with the remembered rate as its prior (the reports renew by it).
    fx.answer(id, &h, Some(200), &grants(&req, |i| (i.want, i.want)));
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    assert!(!remembered(&fx));
    assert_tracked_at_50_a_second(&fx);
}
