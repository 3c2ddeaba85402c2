//! Tracing in the request's life: the client's trace context on the authentication callout,
//! and the request span's attributes at the end (only when the policy asks for them).

use super::*;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const JSON: &[u8] =
    br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;

fn traced_fx(on: bool) -> Fx {
    let mut p = policy();
    p["observability"] = json!({"traceAttributes": on});
    Fx::with(json!({"bootstrapPolicy": p}))
}

fn alice_named() -> Vec<u8> {
    json!({"subject": "alice", "groups": ["system:authenticated"], "tier": "free",
           "cache_ttl_seconds": 60, "pseudonym": "u-0123456789abcdef"})
    .to_string()
    .into_bytes()
}

/// A JSON chat request through a callout (answered with `answer`), its response and its end;
/// the host calls it made.
fn miss_request(fx: &Fx, extra: &[(&'static str, &str)], answer: &[u8]) -> (u32, Vec<Call>) {
    let (id, h) = fx.http();
    fx.host.clear_calls();
    let mut headers = chat(&key(2));
    headers.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    fx.headers(id, &h, &refs(&headers), false);
    fx.answer(id, &h, Some(200), answer);
    fx.body(id, &h, BODY, true);
    fx.host.enter(id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    assert_eq!(h.on_response_headers(&fx.host), Action::Continue);
    fx.host.set_buffer(Body::Response, JSON);
    h.on_response_body(&fx.host, JSON.len(), true);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    (id, fx.host.calls.borrow().clone())
}

fn set_properties(fx: &Fx, id: u32) -> Vec<(String, String)> {
    fx.host
        .set_properties
        .borrow()
        .iter()
        .filter(|(c, _, _)| *c == id)
        .map(|(_, k, v)| (k.clone(), String::from_utf8(v.clone()).unwrap()))
        .collect()
}

#[test]
fn the_callout_carries_a_valid_client_trace_context_at_no_extra_host_call() {
    let fx = Fx::new();
    let (_, plain) = miss_request(&fx, &[], &alice());
    let fx = Fx::new();
    let (_, traced) = miss_request(
        &fx,
        &[("traceparent", TRACEPARENT), ("tracestate", "v=1")],
        &alice(),
    );
    assert_eq!(plain.len(), traced.len(), "{traced:#?}");
    let d = fx.host.dispatched.borrow()[0].clone();
    let header = |n: &str| {
        d.headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("traceparent").as_deref(), Some(TRACEPARENT));
    assert_eq!(header("tracestate").as_deref(), Some("v=1"));
    // Anything but a valid traceparent goes nowhere (its tracestate neither).
    let fx = Fx::new();
    miss_request(
        &fx,
        &[("traceparent", "00-not-a-trace"), ("tracestate", "v=1")],
        &alice(),
    );
    let d = fx.host.dispatched.borrow()[0].clone();
    assert!(
        !d.headers.iter().any(|(k, _)| k.starts_with("trace")),
        "{:?}",
        d.headers
    );
}

#[test]
fn a_settled_request_tells_its_span_model_operation_user_decision_and_tokens() {
    let fx = traced_fx(true);
    let (id, calls) = miss_request(&fx, &[], &alice_named());
    assert_eq!(
        set_properties(&fx, id),
        [
            ("gen_ai.request.model", "sim"),
            ("gen_ai.operation.name", "chat"),
            ("maas.user", "u-0123456789abcdef"),
            ("maas.decision", "allowed"),
            ("gen_ai.usage.input_tokens", "5"),
            ("gen_ai.usage.output_tokens", "7"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    // One host call per attribute, and only these beyond the request without them.
    let fx_off = traced_fx(false);
    let (off_id, off_calls) = miss_request(&fx_off, &[], &alice_named());
    assert!(set_properties(&fx_off, off_id).is_empty());
    assert!(!off_calls.iter().any(|c| matches!(c, Call::SetProperty(_))));
    assert_eq!(calls.len(), off_calls.len() + 6);
}

#[test]
fn a_refusal_tells_its_span_the_refusals_code() {
    let fx = traced_fx(true);
    let (id, h) = fx.http();
    let mut headers = chat(&key(2));
    headers.retain(|(k, _)| *k != "authorization");
    fx.headers(id, &h, &refs(&headers), false);
    assert_eq!(fx.host.last_sent().unwrap().status, 401);
    let props = set_properties(&fx, id);
    let code = fx.host.last_sent().unwrap().code();
    assert!(
        props.contains(&("maas.decision".to_string(), code.clone())),
        "{code}: {props:?}"
    );
    assert!(!props.iter().any(|(k, _)| k == "maas.user"), "{props:?}");
    // The same refusal with the attributes off sets nothing.
    let fx = traced_fx(false);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&headers), false);
    assert!(set_properties(&fx, id).is_empty());
}
