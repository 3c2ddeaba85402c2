//! The worker's side of global limits: the tick's batch of debts, releases and renewals
//! (claimed by CAS; a failed batch kept and re-sent verbatim with its batchId until a 200), the
//! shared fallback state, the replica id, and the lease callouts of a steady subject.

use super::*;
use crate::lease::{self, GlobalState, STATE_KEY};
use crate::limits::{self, Ask, Grant, Kind, LeasePolicy};
use crate::store::SharedStore;
use maas_types::lease::{LEASES_PATH, LeaseRequest};
use maas_types::{PolicyDocument, Tier};

fn tier() -> Tier {
    PolicyDocument::from_value(json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["g"],
          "limits": {"requests": [{"limit": 10, "window": "1m"}],
                     "tokens": [{"limit": 1000, "window": "1m"}]}}]
    }))
    .unwrap()
    .tiers[0]
        .clone()
}

fn global(extra: serde_json::Value) -> (RecordingHost, Root) {
    let mut g = json!({"replicaId": "gw-a"});
    for (k, v) in extra.as_object().unwrap() {
        g[k] = v.clone();
    }
    configured(json!({"limits": {"global": g}}))
}

fn key(subject: &str) -> String {
    limits::counter_key(subject, limits::DEFAULT_COUNTER_SLOTS)
}

fn now_s(host: &RecordingHost) -> u64 {
    host.now.get() / 1000
}

fn grant(host: &RecordingHost, subject: &str, kind: Kind, granted: u64) {
    let now = now_s(host);
    assert!(limits::apply_grants(
        &host.store,
        &key(subject),
        subject,
        &[Grant {
            kind,
            window: 60,
            start: now - now % 60,
            granted,
            taken: granted,
        }],
        now,
    ));
}

/// Admits one request of `subject` (share 1 in fallback, else against its lease) and tracks it
/// as the request path does.
fn admit(
    host: &RecordingHost,
    root: &Root,
    subject: &str,
    reserve: u64,
    fallback: bool,
) -> limits::Reservation {
    let t = tier();
    let tiers = [&t];
    let k = key(subject);
    let ask = Ask {
        key: &k,
        tiers: &tiers,
        subject,
        reserve,
        reserve_cost: 0,
        now: now_s(host),
        settled: &[],
    };
    let policy = LeasePolicy {
        fallback_share: fallback.then_some(1.0),
        horizon_ms: 2000,
        short_retry_s: 4,
    };
    match limits::admit_leased(&host.store, &ask, None, Some(&policy)) {
        limits::Admission::Allowed { reservation, .. } => {
            root.worker.borrow_mut().leases.track(
                subject,
                &k,
                || lease::counters(&tiers),
                host.now.get(),
            );
            reservation
        }
        other => panic!("{other:?}"),
    }
}

fn state(host: &RecordingHost, subject: &str, kind: Kind) -> (u64, u64, u64) {
    limits::lease_state(&host.store, &key(subject), subject, kind, 60, now_s(host))
}

/// Lease batches dispatched so far: (token, request).
fn batches(host: &RecordingHost) -> Vec<(u32, LeaseRequest)> {
    host.dispatched
        .borrow()
        .iter()
        .filter(|d| d.headers.iter().any(|(_, v)| v == LEASES_PATH))
        .map(|d| {
            (
                d.token,
                serde_json::from_slice(d.body.as_deref().unwrap()).unwrap(),
            )
        })
        .collect()
}

/// One report interval later, a tick.
fn next_report(host: &RecordingHost, root: &mut Root) {
    host.now.set(host.now.get() + 1000);
    root.tick(host);
}

fn ok_answer(req: &LeaseRequest, replicas: u32) -> Vec<u8> {
    let grants: Vec<_> = req
        .items
        .iter()
        .map(|i| json!({"granted": i.want, "taken": i.want + i.debt}))
        .collect();
    json!({"replicas": replicas, "store": "memory", "grants": grants})
        .to_string()
        .into_bytes()
}

#[test]
fn the_tick_batch_reports_debt_claimed_by_cas_and_a_200_keeps_it() {
    let (host, mut root) = global(json!({}));
    grant(&host, "alice", Kind::Tokens, 100);
    grant(&host, "alice", Kind::Requests, 10);
    let r = admit(&host, &root, "alice", 100, false);
    // Usage above the reservation: 40 tokens of debt.
    limits::settle(&host.store, &r, limits::Used::tokens(140), now_s(&host));
    next_report(&host, &mut root);
    let b = batches(&host);
    assert_eq!(b.len(), 1);
    let (token, req) = &b[0];
    assert_eq!(req.replica, "gw-a");
    let tok = req
        .items
        .iter()
        .find(|i| i.kind.as_str() == "tokens")
        .unwrap();
    assert_eq!(
        (tok.subject.as_str(), tok.debt, tok.release, tok.need),
        ("alice", 40, 0, 0)
    );
    assert_eq!(
        state(&host, "alice", Kind::Tokens).1,
        140,
        "claimed before sending"
    );
    answer(&host, &mut root, *token, 200, "", &ok_answer(req, 1));
    // The debt stays claimed; a renewal (prefetch at this rate) is added to the lease.
    assert_eq!(
        state(&host, "alice", Kind::Tokens),
        (140, 140 + tok.want, 0)
    );
    // Nothing more to report: no batch while the answer is pending nor after.
    next_report(&host, &mut root);
    assert!(batches(&host).len() <= 2);
    root.worker.borrow().metrics.flush(&host);
    assert!(host.metric("maas_lease_callouts_total") >= 1);
}

/// Lease dispatches so far, as sent: (token, body bytes).
fn raw_batches(host: &RecordingHost) -> Vec<(u32, Vec<u8>)> {
    host.dispatched
        .borrow()
        .iter()
        .filter(|d| d.headers.iter().any(|(_, v)| v == LEASES_PATH))
        .map(|d| (d.token, d.body.clone().unwrap()))
        .collect()
}

#[test]
fn a_failed_batch_is_kept_with_its_claims_and_resent_verbatim_until_a_200() {
    let (host, mut root) = global(json!({}));
    grant(&host, "alice", Kind::Tokens, 100);
    grant(&host, "alice", Kind::Requests, 10);
    let r = admit(&host, &root, "alice", 100, false);
    limits::settle(&host.store, &r, limits::Used::tokens(140), now_s(&host));
    next_report(&host, &mut root);
    let (token, first) = raw_batches(&host)[0].clone();
    let req: LeaseRequest = serde_json::from_slice(&first).unwrap();
    assert!(req.batch_id.is_some(), "a batch carries its id");
    answer(&host, &mut root, token, 503, "", b"");
    // Not undone: the companion may still apply it (Redis paused); a re-send cannot double it.
    assert_eq!(state(&host, "alice", Kind::Tokens), (140, 140, 0), "kept");
    assert!(lease::read_state(&host.store).0.fallback);
    assert!(root.worker.borrow().leases.state.fallback);
    // More usage meanwhile: it waits for the next batch.
    let r = admit(&host, &root, "alice", 10, true);
    limits::settle(&host.store, &r, limits::Used::tokens(10), now_s(&host));
    // No answer at all (timeout) then a refused dispatch: the same bytes each report.
    next_report(&host, &mut root);
    let (token, again) = raw_batches(&host)[1].clone();
    assert_eq!(again, first, "re-sent verbatim: same id, same items");
    answer(&host, &mut root, token, 504, "", b"");
    host.dispatch_fails.set(true);
    next_report(&host, &mut root);
    host.dispatch_fails.set(false);
    next_report(&host, &mut root);
    let b = raw_batches(&host);
    assert_eq!(b.len(), 3);
    assert_eq!(b[2].1, first, "still verbatim");
    answer(&host, &mut root, b[2].0, 200, "", &ok_answer(&req, 1));
    assert!(!root.worker.borrow().leases.state.fallback);
    let tok = req
        .items
        .iter()
        .find(|i| i.kind.as_str() == "tokens")
        .unwrap();
    assert_eq!(
        state(&host, "alice", Kind::Tokens),
        (150, 140 + tok.want, 0),
        "its grants applied once"
    );
    assert!(
        root.worker.borrow().leases.outbox.is_empty(),
        "answered: gone"
    );
    // The next batch is a new one.
    let r = admit(&host, &root, "alice", 10, false);
    limits::settle(&host.store, &r, limits::Used::tokens(900), now_s(&host));
    host.now.set(host.now.get() + crate::worker::TICK_MS);
    root.tick(&host);
    let (_, next) = batches(&host).pop().unwrap();
    assert_ne!(next.batch_id, req.batch_id);
}

#[test]
fn a_batch_the_companion_refuses_is_undone_and_dropped() {
    let (host, mut root) = global(json!({}));
    grant(&host, "alice", Kind::Tokens, 100);
    grant(&host, "alice", Kind::Requests, 10);
    let r = admit(&host, &root, "alice", 100, false);
    limits::settle(&host.store, &r, limits::Used::tokens(140), now_s(&host));
    next_report(&host, &mut root);
    let (token, _) = batches(&host)[0].clone();
    answer(&host, &mut root, token, 400, "", b"{}");
    assert_eq!(state(&host, "alice", Kind::Tokens), (140, 100, 0), "undone");
    assert!(root.worker.borrow().leases.outbox.is_empty());
}

#[test]
fn in_fallback_the_probe_carries_the_debt_accrued_meanwhile() {
    let (host, mut root) = global(json!({}));
    host.store
        .set(STATE_KEY, &[1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], None)
        .unwrap();
    root.tick(&host);
    assert!(
        root.worker.borrow().leases.state.fallback,
        "adopted at the tick"
    );
    let gauge = root.worker.borrow().metrics.lease_fallback;
    assert!(host.recorded.borrow().contains(&(gauge, 1)));
    // Admitted on the local share (no lease): 3 requests, 300 tokens.
    for _ in 0..3 {
        admit(&host, &root, "alice", 100, true);
    }
    assert_eq!(state(&host, "alice", Kind::Requests), (3, 0, 0));
    // The probe is the debt's batch (applied once however often it is re-sent).
    next_report(&host, &mut root);
    let (token, req) = batches(&host).pop().unwrap();
    let debts: Vec<(String, u64)> = req
        .items
        .iter()
        .map(|i| (i.kind.as_str().to_string(), i.debt))
        .collect();
    assert!(debts.contains(&("requests".into(), 3)), "{debts:?}");
    assert!(debts.contains(&("tokens".into(), 300)), "{debts:?}");
    answer(&host, &mut root, token, 200, "", &ok_answer(&req, 2));
    let st = lease::read_state(&host.store).0;
    assert!(!st.fallback, "a 200 batch leaves fallback");
    assert_eq!(st.replicas, 2);
    assert!(host.recorded.borrow().contains(&(gauge, 0)));
    assert!(
        state(&host, "alice", Kind::Requests).1 >= 3,
        "the debt is now leased"
    );
    assert_eq!(batches(&host).len(), 1, "one batch: no separate probe");
}

#[test]
fn an_idle_subject_releases_its_unused_lease_then_is_no_longer_tracked() {
    let (host, mut root) = global(json!({"idleReleaseMs": 2000}));
    grant(&host, "alice", Kind::Requests, 10);
    grant(&host, "alice", Kind::Tokens, 500);
    let r = admit(&host, &root, "alice", 100, false);
    limits::settle(&host.store, &r, limits::Used::tokens(100), now_s(&host));
    host.now.set(host.now.get() + 2000);
    root.tick(&host);
    let (token, req) = batches(&host).pop().unwrap();
    let rel: Vec<(String, u64)> = req
        .items
        .iter()
        .map(|i| (i.kind.as_str().to_string(), i.release))
        .collect();
    assert!(rel.contains(&("requests".into(), 9)), "{rel:?}");
    assert!(rel.contains(&("tokens".into(), 400)), "{rel:?}");
    assert_eq!(state(&host, "alice", Kind::Requests).1, 1, "claimed");
    answer(&host, &mut root, token, 200, "", &ok_answer(&req, 1));
    assert!(root.worker.borrow().leases.tracked.contains_key("alice"));
    next_report(&host, &mut root);
    assert!(!root.worker.borrow().leases.tracked.contains_key("alice"));
    assert_eq!(batches(&host).len(), 1, "nothing more to send");
}

#[test]
fn a_busy_subject_gets_a_renewal_before_its_lease_runs_out() {
    let (host, mut root) = global(json!({"leaseHorizonMs": 20000}));
    grant(&host, "alice", Kind::Requests, 5);
    grant(&host, "alice", Kind::Tokens, 1000);
    for _ in 0..4 {
        admit(&host, &root, "alice", 1, false);
    }
    next_report(&host, &mut root);
    let (token, req) = batches(&host).pop().unwrap();
    let r = req
        .items
        .iter()
        .find(|i| i.kind.as_str() == "requests")
        .unwrap();
    assert!(r.want > 0 && r.need == 0, "{r:?}");
    answer(&host, &mut root, token, 200, "", &ok_answer(&req, 1));
    assert_eq!(state(&host, "alice", Kind::Requests).1, 5 + r.want);
}

#[test]
fn in_fallback_an_empty_batch_is_the_probe() {
    let (host, mut root) = global(json!({}));
    next_report(&host, &mut root);
    assert!(
        batches(&host).is_empty(),
        "nothing to send, not in fallback"
    );
    let mut w = root.worker.borrow_mut();
    let w2 = &mut *w;
    assert!(lease::enter_fallback(
        &host,
        &mut w2.leases,
        0,
        host.now.get()
    ));
    drop(w);
    next_report(&host, &mut root);
    let b = batches(&host);
    assert_eq!(b.len(), 1);
    assert!(b[0].1.items.is_empty());
}

#[test]
fn a_batch_holds_at_most_max_batch_items_and_the_rest_goes_next() {
    let (host, mut root) = global(json!({}));
    // 600 subjects with a debt in both counters: 1200 items.
    for i in 0..600 {
        let s = format!("u{i}");
        admit(&host, &root, &s, 10, true);
    }
    next_report(&host, &mut root);
    let (token, req) = batches(&host).pop().unwrap();
    assert_eq!(req.items.len(), maas_types::lease::MAX_BATCH_ITEMS);
    answer(&host, &mut root, token, 200, "", &ok_answer(&req, 1));
    next_report(&host, &mut root);
    let (_, rest) = batches(&host).pop().unwrap();
    assert_eq!(rest.items.len(), 1200 - maas_types::lease::MAX_BATCH_ITEMS);
    let first: std::collections::HashSet<&str> =
        req.items.iter().map(|i| i.subject.as_str()).collect();
    assert!(
        rest.items
            .iter()
            .all(|i| !first.contains(i.subject.as_str()))
    );
}

#[test]
fn every_worker_adopts_the_shared_fallback_state_at_its_tick() {
    let (host, mut a) = global(json!({}));
    let mut b = Root::new(2);
    assert!(b.configure(&host));
    {
        let mut w = a.worker.borrow_mut();
        let w = &mut *w;
        lease::enter_fallback(
            &host,
            &mut w.leases,
            w.metrics.lease_fallback,
            host.now.get(),
        );
    }
    assert!(!b.worker.borrow().leases.state.fallback);
    b.tick(&host);
    assert!(b.worker.borrow().leases.state.fallback);
    a.tick(&host);
    assert_eq!(
        lease::read_state(&host.store).0,
        GlobalState {
            fallback: true,
            since_ms: host.now.get(),
            replicas: 1
        }
    );
}

#[test]
fn the_replica_id_comes_from_config_else_node_id_else_one_draw_per_envoy() {
    let (_, root) = global(json!({}));
    assert_eq!(root.worker.borrow().leases.replica, "gw-a");
    // node.id
    let host = RecordingHost::new();
    // Envoy's attribute is `xds.node` (a top-level `node` was read before and never found).
    host.properties
        .borrow_mut()
        .insert("xds.node.id".into(), "envoy-7".into());
    host.set_buffer(
        Body::PluginConfiguration,
        br#"{"companion":{"cluster":"c"},"pollIntervalMs":5000}"#,
    );
    let mut root = Root::new(1);
    assert!(root.configure(&host));
    assert_eq!(root.worker.borrow().leases.replica, "envoy-7");
    // Drawn: every worker of the Envoy (one shared data) gets the first draw.
    let host = RecordingHost::new();
    host.set_buffer(
        Body::PluginConfiguration,
        br#"{"companion":{"cluster":"c"},"pollIntervalMs":5000}"#,
    );
    let (mut r1, mut r2) = (Root::new(1), Root::new(2));
    assert!(r1.configure(&host));
    assert!(r2.configure(&host));
    let id = r1.worker.borrow().leases.replica.clone();
    assert!(id.starts_with("maas-"), "{id}");
    assert_eq!(r2.worker.borrow().leases.replica, id);
    // Global limits off: no id.
    let (_, root) = configured(json!({}));
    assert!(root.worker.borrow().leases.replica.is_empty());
}

/// One companion for one replica: `maas_types::lease::apply_item` over its own counters.
#[derive(Default)]
struct FakeCompanion {
    taken: std::collections::HashMap<(String, String, u64, u64), u64>,
}

impl FakeCompanion {
    fn apply(&mut self, items: &[maas_types::lease::LeaseItem]) -> Vec<maas_types::LeaseGrant> {
        items
            .iter()
            .map(|i| {
                let k = (
                    i.subject.clone(),
                    i.kind.as_str().to_string(),
                    i.window_seconds,
                    i.window_start,
                );
                let t = self.taken.entry(k).or_default();
                let (taken, granted) = maas_types::lease::apply_item(*t, i, 1);
                *t = taken;
                maas_types::LeaseGrant { granted, taken }
            })
            .collect()
    }
}

/// A subject sending 10 requests a second for 60 s to one replica whose window (`window`,
/// `limit` requests) started long before (a day's at 10:00): every lease callout counted —
/// the request path's and the tick batches.
fn lease_callouts_of_a_steady_subject(window: &str, limit: u64) -> usize {
    let t = PolicyDocument::from_value(json!({
        "tiers": [{"name": "steady", "level": 0, "groups": ["g"],
          "limits": {"requests": [{"limit": limit, "window": window}]}}]
    }))
    .unwrap()
    .tiers[0]
        .clone();
    let (host, mut root) = global(json!({}));
    // 10:00:00.000 of some day (and of a minute).
    host.now.set((20_000 * 86_400 + 36_000) * 1000);
    root.tick(&host);
    let tiers = [&t];
    let k = key("steady");
    let policy = LeasePolicy {
        fallback_share: None,
        horizon_ms: 2000,
        short_retry_s: 4,
    };
    let mut companion = FakeCompanion::default();
    let mut request_callouts = 0;
    let mut answered = 0;
    for step in 0..600 {
        host.now.set(host.now.get() + 100);
        let now = now_s(&host);
        let ask = Ask {
            key: &k,
            tiers: &tiers,
            subject: "steady",
            reserve: 1,
            reserve_cost: 0,
            now,
            settled: &[],
        };
        let mut admitted = false;
        for _ in 0..3 {
            match limits::admit_leased(&host.store, &ask, None, Some(&policy)) {
                limits::Admission::Allowed { .. } => {
                    root.worker.borrow_mut().leases.track(
                        "steady",
                        &k,
                        || lease::counters(&tiers),
                        host.now.get(),
                    );
                    admitted = true;
                    break;
                }
                limits::Admission::NeedsLease { items, .. } => {
                    request_callouts += 1;
                    let got = companion.apply(&lease::items_for("steady", &items));
                    let grants: Vec<Grant> = items
                        .iter()
                        .zip(&got)
                        .map(|(n, g)| Grant {
                            kind: n.kind,
                            window: n.window,
                            start: n.start,
                            granted: g.granted,
                            taken: g.taken,
                        })
                        .collect();
                    assert!(limits::apply_grants(
                        &host.store,
                        &k,
                        "steady",
                        &grants,
                        now
                    ));
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(admitted, "step {step}: admitted within its budget");
        if step % 2 == 1 {
            root.tick(&host);
            let sent = batches(&host);
            for (token, req) in sent.iter().skip(answered) {
                let grants = companion.apply(&req.items);
                let body = json!({"replicas": 1, "store": "memory", "grants": grants});
                answer(
                    &host,
                    &mut root,
                    *token,
                    200,
                    "",
                    body.to_string().as_bytes(),
                );
            }
            answered = sent.len();
        }
    }
    request_callouts + batches(&host).len()
}

#[test]
fn a_steady_subject_makes_at_most_one_lease_callout_a_second_whenever_its_window_started() {
    // A daily window that started 10 hours before the subject's first request: the rate is
    // this replica's own since its first admission, not count ÷ time since 00:00 (which asked
    // for ≈ nothing and made one callout per request: 600).
    let daily = lease_callouts_of_a_steady_subject("1d", 1_000_000);
    let minute = lease_callouts_of_a_steady_subject("1m", 100_000);
    eprintln!("lease callouts in 60 s at 10 req/s: daily window {daily}, minute window {minute}");
    assert!(daily <= 60, "daily window: {daily} lease callouts in 60 s");
    assert!(
        minute <= 60,
        "minute window: {minute} lease callouts in 60 s"
    );
}
