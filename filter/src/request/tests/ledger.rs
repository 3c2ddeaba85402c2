//! The usage ledger in a request's life: what settled and refused requests add in the worker
//! (no host call), and the root's report to `POST /internal/v1/usage`.

use super::*;
use crate::ledger::RecordKey;
use maas_types::usage::{USAGE_PATH, UsageReport, hour_start_of};
use std::collections::BTreeMap;

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
        backend: None,
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

/// A worker with no request limit in the way whose model `sim` has two backends (`a`, `b`),
/// or none.
fn fx_of(backends: bool) -> Fx {
    let mut p = policy();
    p["tiers"][0]["limits"]["requests"] = json!([{"limit": 1000, "window": "1m"}]);
    if backends {
        p["models"][0]["backends"] = json!([
            {"name": "a", "backend": "simulator", "weight": 3},
            {"name": "b", "backend": "simulator", "weight": 1}
        ]);
    }
    Fx::with(json!({"bootstrapPolicy": p}))
}

fn with_backends() -> Fx {
    fx_of(true)
}

/// A cached request of alice answered 200 with `served_by` as the response's
/// `x-maas-served-by`; the host calls it made.
fn served(fx: &Fx, served_by: Option<&str>) -> Vec<Call> {
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    fx.host.clear_calls();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.body(id, &h, BODY, true);
    fx.host.enter(id);
    let mut headers = vec![(":status", "200"), ("content-type", "application/json")];
    headers.extend(served_by.map(|v| (maas_types::SERVED_BY_HEADER, v)));
    fx.host.set_map(Headers::Response, &headers);
    h.on_response_headers(&fx.host);
    fx.host.set_buffer(Body::Response, JSON);
    h.on_response_body(&fx.host, JSON.len(), true);
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    fx.host.calls.borrow().clone()
}

/// Requests per backend in the worker's open records of alice on `sim`.
fn per_backend(fx: &Fx) -> BTreeMap<Option<String>, u64> {
    let w = fx.root.worker.borrow();
    [None, Some("a"), Some("b"), Some("zzz")]
        .into_iter()
        .filter_map(|b| {
            let key = RecordKey {
                backend: b.map(str::to_string),
                ..alice_sim(fx)
            };
            w.ledger
                .open_counts(&key)
                .map(|c| (b.map(str::to_string), c.requests))
        })
        .collect()
}

fn removes_served_by(calls: &[Call]) -> bool {
    calls.iter().any(|c| {
        matches!(c, Call::SetHeader(Headers::Response, name, None)
            if name.eq_ignore_ascii_case(maas_types::SERVED_BY_HEADER))
    })
}

#[test]
fn a_model_with_backends_records_the_backend_its_route_named_and_only_a_known_one() {
    let fx = with_backends();
    served(&fx, None);
    let plain = served(&fx, None);
    let named = served(&fx, Some("b"));
    served(&fx, Some("a"));
    served(&fx, Some("a"));
    // Not one of the model's backends: no backend.
    let unknown = served(&fx, Some("zzz"));
    assert_eq!(
        per_backend(&fx),
        BTreeMap::from([(None, 3), (Some("a".into()), 2), (Some("b".into()), 1)])
    );
    // The header never reaches the client: one removal, only when it came; the value was in the
    // map the filter reads anyway.
    assert!(!removes_served_by(&plain));
    assert!(removes_served_by(&named) && removes_served_by(&unknown));
    assert_eq!(named.len(), plain.len() + 1, "{named:#?}");
    assert_eq!(
        named
            .iter()
            .filter(|c| matches!(c, Call::Headers(Headers::Response)))
            .count(),
        1
    );
}

#[test]
fn a_model_without_backends_never_records_what_an_upstream_names() {
    let fx = fx_of(false);
    served(&fx, None);
    let plain = served(&fx, None);
    let spoofed = served(&fx, Some("a"));
    assert_eq!(per_backend(&fx), BTreeMap::from([(None, 3)]));
    // Removed all the same (the x-maas-* names are the gateway's), at one host call.
    assert!(removes_served_by(&spoofed));
    assert_eq!(spoofed.len(), plain.len() + 1);
    // The budget of a cached request (`respond::host_calls_per_request_stay_within_budget`).
    assert_eq!(plain.len(), 21, "{plain:#?}");
}

#[test]
fn discovery_of_a_model_with_backends_removes_the_backends_name() {
    for (fx, removed) in [(with_backends(), true), (Fx::new(), false)] {
        fx.cache(&key(2), allow_alice());
        let (id, h) = fx.http();
        let k = format!("Bearer {}", key(2));
        fx.headers(
            id,
            &h,
            &[
                (":method", "GET"),
                (":path", "/llm/sim/v1/models"),
                ("authorization", &k),
            ],
            true,
        );
        fx.host.clear_calls();
        fx.host.enter(id);
        fx.host.set_map(
            Headers::Response,
            &[(":status", "200"), (maas_types::SERVED_BY_HEADER, "a")],
        );
        h.on_response_headers(&fx.host);
        let calls = fx.host.calls.borrow().clone();
        assert_eq!(removes_served_by(&calls), removed, "{calls:#?}");
        assert_eq!(calls.len(), usize::from(removed), "{calls:#?}");
    }
}
