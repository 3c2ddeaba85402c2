//! The usage ledger in a request's life: what settled and refused requests add in the worker
//! (no host call), and the root's report to `POST /internal/v1/usage`.

use super::*;
use crate::ledger::RecordKey;
use maas_types::usage::{USAGE_PATH, UsageReport, hour_start_of};

const JSON: &[u8] =
    br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;

fn key_id() -> String {
    credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity()
        .key_id()
        .unwrap()
        .to_string()
}

fn alice_sim(fx: &Fx) -> RecordKey {
    RecordKey {
        subject: "alice".into(),
        key_id: Some(key_id()),
        tier: "free".into(),
        model: "sim".into(),
        hour_start: hour_start_of(fx.host.now.get() / 1000),
    }
}

/// A cached request of alice with `body`; the response `(status, content type, body)` if admitted.
/// The host calls it made.
fn request(fx: &Fx, body: &[u8], response: Option<(&str, &str, &[u8])>) -> Vec<Call> {
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    fx.host.clear_calls();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    if fx.sent_to(id).is_none() {
        fx.body(id, &h, body, true);
    }
    if let Some((status, ct, bytes)) = response
        && fx.sent_to(id).is_none()
    {
        fx.host.enter(id);
        fx.host.set_map(
            Headers::Response,
            &[(":status", status), ("content-type", ct)],
        );
        h.on_response_headers(&fx.host);
        fx.host.set_buffer(Body::Response, bytes);
        h.on_response_body(&fx.host, bytes.len(), true);
    }
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    fx.host.calls.borrow().clone()
}

fn ok(fx: &Fx) -> Vec<Call> {
    request(fx, BODY, Some(("200", "application/json", JSON)))
}

#[test]
fn settled_and_refused_requests_of_a_known_subject_add_up_in_the_worker_without_host_calls() {
    let fx = Fx::new();
    ok(&fx);
    ok(&fx);
    // 400 tokens_exceed_limit (counts nothing in the limits), 400 model_mismatch.
    request(
        &fx,
        br#"{"model":"sim","messages":[],"max_tokens":5000}"#,
        None,
    );
    request(&fx, br#"{"model":"big","messages":[]}"#, None);
    // A 2xx without readable usage: the reservation (prompt estimate + max_tokens 50).
    request(&fx, BODY, Some(("200", "application/json", b"{}")));
    // The free tier allows 3 requests a minute: this one is refused before its body (precheck).
    request(&fx, BODY, Some(("200", "application/json", JSON)));
    // Not authenticated: no subject, not in the ledger.
    let (id, h) = fx.http();
    fx.headers(id, &h, &[(":method", "POST"), (":path", CHAT)], true);
    assert_eq!(fx.sent_to(id).unwrap().status, 401);

    let w = fx.root.worker.borrow();
    assert_eq!(w.ledger.open_len(), 1);
    let c = w.ledger.open_counts(&alice_sim(&fx)).unwrap();
    let estimate = request_body::inspect(BODY).unwrap().prompt_tokens_estimate;
    assert_eq!(c.requests, 3);
    assert_eq!(c.prompt_tokens, 5 + 5 + estimate);
    assert_eq!(c.completion_tokens, 7 + 7 + 50);
    assert_eq!(
        c.refused,
        [
            ("model_mismatch".to_string(), 1),
            ("rate_limit_exceeded".to_string(), 1),
            ("tokens_exceed_limit".to_string(), 1)
        ]
        .into()
    );
}

#[test]
fn the_ledger_costs_a_request_no_host_call() {
    let on = Fx::new();
    let off = Fx::with(json!({"usage": {"enabled": false}}));
    for fx in [&on, &off] {
        ok(fx);
    }
    let (with, without) = (ok(&on), ok(&off));
    assert_eq!(with, without);
    assert_eq!(with.len(), 21, "{with:#?}");
    // A refusal neither.
    let refused = |fx: &Fx| {
        request(fx, br#"{"model":"big","messages":[]}"#, None);
        request(fx, br#"{"model":"big","messages":[]}"#, None)
    };
    assert_eq!(refused(&on), refused(&off));
    assert_eq!(on.root.worker.borrow().ledger.open_len(), 1);
    assert_eq!(off.root.worker.borrow().ledger.open_len(), 0);
}

fn usage_dispatches(fx: &Fx) -> Vec<crate::host::recording::Dispatched> {
    fx.host
        .dispatched
        .borrow()
        .iter()
        .filter(|d| d.headers.iter().any(|(_, v)| v == USAGE_PATH))
        .cloned()
        .collect()
}

fn tick(fx: &mut Fx, advance_ms: u64) {
    fx.host.now.set(fx.host.now.get() + advance_ms);
    fx.host.enter(fx.root.id);
    fx.root.tick(&fx.host);
}

fn answer_root(fx: &mut Fx, token: u32, status: Option<u32>, body: &[u8]) {
    fx.host.enter(fx.root.id);
    match status {
        Some(s) => fx
            .host
            .set_map(Headers::CallResponse, &[(":status", &s.to_string())]),
        None => fx.host.set_map(Headers::CallResponse, &[]),
    }
    fx.host.set_buffer(Body::CallResponse, body);
    fx.root.on_call_response(&fx.host, token, body.len());
}

#[test]
fn the_root_reports_every_interval_and_resends_a_failed_report_verbatim_until_a_200() {
    let mut fx =
        Fx::with(json!({"usage": {"reportIntervalMs": 1000}, "pollIntervalMs": 3_600_000}));
    ok(&fx);
    // Within the interval: nothing sent.
    tick(&mut fx, 500);
    assert!(usage_dispatches(&fx).is_empty());
    tick(&mut fx, 500);
    let sent = usage_dispatches(&fx);
    assert_eq!(sent.len(), 1);
    let d = &sent[0];
    assert_eq!(d.cluster, COMPANION);
    assert!(d.headers.contains(&(":method".into(), "POST".into())));
    // Dispatched from the root context (never cancelled with a request's stream).
    assert_eq!(fx.root.worker.borrow().active, fx.root.id);
    let report: UsageReport = serde_json::from_slice(d.body.as_deref().unwrap()).unwrap();
    assert!(maas_types::usage::validate(&report).is_ok());
    let worker = fx.root.worker.borrow().ledger.worker.clone();
    assert_eq!(
        report.batch_id,
        format!("{}/{worker}/0", report.replica),
        "replica/worker/sequence"
    );
    assert_eq!(report.records.len(), 1);
    let r = &report.records[0];
    assert_eq!(
        (
            r.subject.as_str(),
            r.key_id.clone(),
            r.tier.as_str(),
            r.model.as_str()
        ),
        ("alice", Some(key_id()), "free", "sim")
    );
    assert_eq!(
        (r.requests, r.prompt_tokens, r.completion_tokens),
        (1, 5, 7)
    );
    // The companion cannot take it: kept; a new request meanwhile waits for the next batch.
    answer_root(&mut fx, d.token, Some(503), b"");
    ok(&fx);
    tick(&mut fx, 1000);
    let second = usage_dispatches(&fx)[1].token;
    answer_root(&mut fx, second, None, b"");
    tick(&mut fx, 1000);
    let sent = usage_dispatches(&fx);
    assert_eq!(sent.len(), 3);
    assert_eq!(sent[1].body, d.body, "resent verbatim");
    assert_eq!(sent[2].body, d.body, "resent verbatim");
    answer_root(
        &mut fx,
        sent[2].token,
        Some(200),
        br#"{"accepted":1,"duplicate":false}"#,
    );
    tick(&mut fx, 1000);
    let sent = usage_dispatches(&fx);
    assert_eq!(sent.len(), 4);
    let next: UsageReport = serde_json::from_slice(sent[3].body.as_deref().unwrap()).unwrap();
    assert_eq!(next.batch_id, format!("{}/{worker}/1", report.replica));
    assert_eq!(next.records[0].requests, 1);
    answer_root(&mut fx, sent[3].token, Some(200), b"{}");
    // Nothing open: no more reports.
    tick(&mut fx, 5000);
    assert_eq!(usage_dispatches(&fx).len(), 4);
}

#[test]
fn dropped_records_are_counted_in_a_metric() {
    let mut fx = Fx::with(json!({"usage": {"maxPendingRecords": 1024}}));
    {
        let mut w = fx.root.worker.borrow_mut();
        for i in 0..1030 {
            w.ledger.add(
                &format!("u{i}"),
                None,
                "free",
                "sim",
                crate::ledger::Event::Refused("x"),
            );
        }
    }
    tick(&mut fx, 200);
    fx.flush();
    assert_eq!(fx.host.metric(crate::metrics::USAGE_RECORDS_DROPPED), 6);
}
