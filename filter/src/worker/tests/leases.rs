//! The worker's side of global limits: the tick's batch of debts, releases and renewals
//! (claimed by CAS, undone when the batch fails), the shared fallback state, the replica id.

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
        now: now_s(host),
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
    limits::settle(&host.store, &r, 140, now_s(&host));
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

#[test]
fn a_failed_batch_undoes_its_claims_enters_fallback_and_reports_again() {
    let (host, mut root) = global(json!({}));
    grant(&host, "alice", Kind::Tokens, 100);
    grant(&host, "alice", Kind::Requests, 10);
    let r = admit(&host, &root, "alice", 100, false);
    limits::settle(&host.store, &r, 140, now_s(&host));
    next_report(&host, &mut root);
    let (token, _) = batches(&host)[0].clone();
    answer(&host, &mut root, token, 503, "", b"");
    assert_eq!(state(&host, "alice", Kind::Tokens), (140, 100, 0), "undone");
    assert!(lease::read_state(&host.store).0.fallback);
    assert!(root.worker.borrow().leases.state.fallback);
    // In fallback the tick sends an empty probe (the failed batch may still be applied).
    next_report(&host, &mut root);
    let b = batches(&host);
    assert_eq!(b.len(), 2);
    assert!(b[1].1.items.is_empty());
    answer(&host, &mut root, b[1].0, 200, "", &ok_answer(&b[1].1, 1));
    assert!(!root.worker.borrow().leases.state.fallback);
    // Right after the probe's 200, the debt goes.
    host.now.set(host.now.get() + crate::worker::TICK_MS);
    root.tick(&host);
    let b = batches(&host);
    assert_eq!(b.len(), 3);
    let tok = b[2]
        .1
        .items
        .iter()
        .find(|i| i.kind.as_str() == "tokens")
        .unwrap();
    assert_eq!(tok.debt, 40);
    answer(&host, &mut root, b[2].0, 200, "", &ok_answer(&b[2].1, 1));
    // A batch that cannot be dispatched undoes its claims too.
    let r = admit(&host, &root, "alice", 10, true);
    limits::settle(&host.store, &r, 30, now_s(&host));
    let before = state(&host, "alice", Kind::Tokens);
    assert!(before.0 > before.1, "a debt still to report: {before:?}");
    host.dispatch_fails.set(true);
    next_report(&host, &mut root);
    assert_eq!(state(&host, "alice", Kind::Tokens), before);
}

#[test]
fn leaving_fallback_reports_the_debt_accrued_meanwhile() {
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
    // The probe (empty) answered 200: fallback left; the debt goes at the next tick.
    next_report(&host, &mut root);
    let (token, probe) = batches(&host).pop().unwrap();
    assert!(probe.items.is_empty());
    answer(&host, &mut root, token, 200, "", &ok_answer(&probe, 2));
    host.now.set(host.now.get() + crate::worker::TICK_MS);
    root.tick(&host);
    let (token, req) = batches(&host).pop().unwrap();
    let debts: Vec<(String, u64)> = req
        .items
        .iter()
        .map(|i| (i.kind.as_str().to_string(), i.debt))
        .collect();
    assert!(debts.contains(&("requests".into(), 3)), "{debts:?}");
    assert!(debts.contains(&("tokens".into(), 300)), "{debts:?}");
    answer(&host, &mut root, token, 200, "", &ok_answer(&req, 2));
    assert_eq!(batches(&host).len(), 2, "probe, then the debt");
    let st = lease::read_state(&host.store).0;
    assert!(!st.fallback, "a 200 batch leaves fallback");
    assert_eq!(st.replicas, 2);
    assert!(host.recorded.borrow().contains(&(gauge, 0)));
    assert_eq!(
        state(&host, "alice", Kind::Requests).1,
        3,
        "the debt is now leased"
    );
}

#[test]
fn an_idle_subject_releases_its_unused_lease_then_is_no_longer_tracked() {
    let (host, mut root) = global(json!({"idleReleaseMs": 2000}));
    grant(&host, "alice", Kind::Requests, 10);
    grant(&host, "alice", Kind::Tokens, 500);
    let r = admit(&host, &root, "alice", 100, false);
    limits::settle(&host.store, &r, 100, now_s(&host));
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
    host.properties
        .borrow_mut()
        .insert("node.id".into(), "envoy-7".into());
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
