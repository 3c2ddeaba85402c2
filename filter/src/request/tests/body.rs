//! The body stage in both modes, and every refusal path of the request side.

use super::*;

const STREAM: &[u8] =
    br#"{"model":"sim","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

fn hit(fx: &Fx) {
    fx.cache(&key(2), allow_alice());
}

#[test]
fn default_mode_body_end_by_end_stream_rewrites_a_stream_for_usage() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Continue
    );
    // Chunks are buffered until the end.
    fx.host.enter(id);
    fx.host.set_buffer(Body::Request, &STREAM[..10]);
    assert_eq!(h.on_request_body(&fx.host, 10, false), Action::Pause);
    assert_eq!(fx.body(id, &h, STREAM, true), Action::Continue);
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert!(h.0.borrow().body.strip_usage_event);
    // Headers left before the body: their length was removed, not corrected.
    assert!(!fx.host.calls.borrow().iter().any(|c| matches!(
        c,
        Call::SetHeader(Headers::Request, n, Some(_)) if n == "content-length"
    )));
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn default_mode_body_end_by_trailers_is_decided() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, BODY, false), Action::Pause);
    assert!(fx.phase(&h).starts_with("BodyBuffering"));
    assert_eq!(h.on_request_trailers(&fx.host), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"));
    assert!(fx.tokens_used("alice") > 0, "reserved at admission");
}

#[test]
fn default_mode_trailers_refuse_a_wrong_model() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.body(id, &h, br#"{"model":"big","messages":[]}"#, false);
    assert_eq!(h.on_request_trailers(&fx.host), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "model_mismatch"));
}

fn held() -> Fx {
    Fx::with(json!({"pauseHeadersForBody": true}))
}

#[test]
fn held_mode_body_end_by_end_stream_decides_with_headers_held() {
    let fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert!(
        fx.phase(&h)
            .starts_with("BodyBuffering { headers_held: true }")
    );
    assert_eq!(fx.body(id, &h, STREAM, true), Action::Continue);
    // The length is kept and corrected after the rewrite.
    let len = fx.host.buffer(Body::Request).len().to_string();
    assert_eq!(
        fx.host.map_value(Headers::Request, "content-length"),
        Some(len)
    );
    assert!(fx.phase(&h).starts_with("Forwarding"));
    assert!(
        !fx.resumed(id),
        "continued by the body callback, not resumed"
    );
}

#[test]
fn held_mode_body_end_by_trailers_is_decided() {
    let fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, BODY, false), Action::Pause);
    assert_eq!(h.on_request_trailers(&fx.host), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn held_mode_body_refusal_starts_no_upstream_request() {
    let fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, b"{not json", true), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "invalid_body"));
    let e: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
    assert!(e["error"]["param"].is_null(), "{e}");
}

/// A field of the wrong type is named in the error's `param` (as OpenAI's errors do).
#[test]
fn a_body_field_of_the_wrong_type_is_named_in_param() {
    let fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    let body = br#"{"model":"sim-model","messages":[],"max_completion_tokens":-1}"#;
    assert_eq!(fx.body(id, &h, body, true), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "invalid_body"));
    let e: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
    assert_eq!(e["error"]["param"], "max_completion_tokens", "{e}");
}

#[test]
fn held_mode_body_read_while_authenticating_is_decided_by_the_answer() {
    let fx = held();
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, BODY, true), Action::Pause);
    assert!(fx.phase(&h).contains("Authenticating"));
    fx.answer(id, &h, Some(200), &alice());
    assert!(fx.resumed(id));
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn held_mode_a_request_refused_while_authenticating_still_interrupts_its_waiters() {
    let fx = held();
    let (a, ha) = fx.http();
    let (b, hb) = fx.http();
    fx.headers(a, &ha, &refs(&chat(&key(2))), false);
    fx.headers(b, &hb, &refs(&chat(&key(2))), false);
    // The maker's body is too large: refused, but its callout is still in flight.
    fx.host.enter(a);
    assert_eq!(ha.on_request_body(&fx.host, 2 << 20, true), Action::Pause);
    assert_eq!(fx.sent_to(a).unwrap().status, 413);
    ha.on_done(&fx.host);
    assert_eq!(fx.sent_to(b).unwrap().code(), "auth_interrupted");
}

#[test]
fn body_too_large_is_refused_413() {
    let fx = Fx::with(json!({"maxRequestBodyBytes": 1024}));
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.host.enter(id);
    assert_eq!(h.on_request_body(&fx.host, 1000, false), Action::Pause);
    assert_eq!(h.on_request_body(&fx.host, 1025, false), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (413, "request_too_large"));
    assert!(fx.phase(&h).starts_with("Refused"));
    // Later chunks are not looked at.
    assert_eq!(h.on_request_body(&fx.host, 2000, true), Action::Continue);
}

#[test]
fn an_unreadable_body_buffer_is_refused_500() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.host.set_buffer(Body::Request, b"{}");
    assert_eq!(h.on_request_body(&fx.host, 50, true), Action::Pause);
    assert_eq!(fx.sent_to(id).unwrap().status, 500);
}

/// A request with the given headers (a cached caller), refused at once: the local answer.
fn refused_at_headers(fx: &Fx, headers: &[(&str, &str)]) -> Sent {
    let (id, h) = fx.http();
    assert_eq!(fx.headers(id, &h, headers, true), Action::Pause);
    assert!(fx.phase(&h).starts_with("Refused"));
    fx.sent_to(id).unwrap()
}

#[test]
fn every_header_stage_refusal() {
    let fx = Fx::new();
    hit(&fx);
    let k = format!("Bearer {}", key(2));
    let auth = ("authorization", k.as_str());
    type Case<'a> = (Vec<(&'a str, &'a str)>, u32, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![(":method", "POST"), (":path", "/llm/sim/../x"), auth],
            400,
            "invalid_path",
        ),
        (
            vec![(":method", "POST"), (":path", "/internal/v1/policy"), auth],
            404,
            "not_found",
        ),
        (
            vec![
                (":method", "POST"),
                (":path", "/llm/none/v1/chat/completions"),
                auth,
            ],
            404,
            "model_not_found",
        ),
        (
            vec![(":method", "DELETE"), (":path", CHAT), auth],
            404,
            "operation_not_allowed",
        ),
        (
            vec![(":method", "POST"), (":path", CHAT)],
            401,
            "invalid_api_key",
        ),
        (
            vec![
                (":method", "POST"),
                (":path", CHAT),
                auth,
                ("x-api-key", "other"),
            ],
            400,
            "invalid_credential",
        ),
        (
            vec![
                (":method", "POST"),
                (":path", CHAT),
                ("authorization", "Basic x"),
            ],
            401,
            "invalid_api_key",
        ),
        (
            vec![
                (":method", "POST"),
                (":path", "/llm/big/v1/chat/completions"),
                auth,
            ],
            403,
            "model_not_allowed",
        ),
    ];
    for (headers, status, code) in cases {
        let s = refused_at_headers(&fx, &headers);
        assert_eq!((s.status, s.code().as_str()), (status, code), "{headers:?}");
    }
    assert_eq!(fx.dispatches(), 0);
    fx.flush();
    assert_eq!(
        fx.host
            .series_sum("maas_requests_total", &[("decision", "bad_request")]),
        2
    );
    assert_eq!(
        fx.host
            .series_sum("maas_requests_total", &[("decision", "not_found")]),
        3
    );
}

#[test]
fn no_policy_is_refused_503() {
    let fx = Fx::new();
    fx.root.worker.borrow_mut().policy = None;
    let s = refused_at_headers(&fx, &refs(&chat(&key(2))));
    assert_eq!((s.status, s.code().as_str()), (503, "no_policy"));
}

fn gpt(key: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":path", "/ext/gpt/v1/chat/completions".into()),
        ("x-api-key", key.to_string()),
    ]
}

#[test]
fn provider_models_get_their_key_only_on_their_own_upstream() {
    let fx = Fx::new();
    hit(&fx);
    let s = refused_at_headers(&fx, &refs(&gpt(&key(2))));
    assert_eq!((s.status, s.code().as_str()), (503, "upstream_mismatch"));
    fx.host.properties.borrow_mut().insert(
        "xds.cluster_name".into(),
        "outbound|443||api.openai.com".into(),
    );
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&gpt(&key(2))), true),
        Action::Continue
    );
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "authorization")
            .as_deref(),
        Some("Bearer sk-provider")
    );
    assert_eq!(fx.host.map_value(Headers::Request, "x-api-key"), None);
    fx.root.worker.borrow_mut().credentials = Rc::new(CredentialsDocument::default());
    let s = refused_at_headers(&fx, &refs(&gpt(&key(2))));
    assert_eq!(
        (s.status, s.code().as_str()),
        (503, "provider_credential_missing")
    );
}

#[test]
fn a_full_request_window_is_refused_429_before_the_body() {
    let fx = Fx::new();
    hit(&fx);
    for _ in 0..3 {
        let (id, h) = fx.http();
        fx.headers(id, &h, &refs(&chat(&key(2))), false);
        assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    }
    // Default mode: the headers would leave before the body; the certain 429 comes now.
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    let s = fx.sent_to(id).unwrap();
    assert_eq!(s.status, 429);
    assert!(s.header("retry-after").is_some());
    assert!(s.header("x-ratelimit-remaining-requests").is_some());
}

#[test]
fn a_full_request_window_is_refused_429_at_the_body_when_headers_are_held() {
    let fx = held();
    hit(&fx);
    for _ in 0..3 {
        let (id, h) = fx.http();
        fx.headers(id, &h, &refs(&chat(&key(2))), false);
        fx.body(id, &h, BODY, true);
    }
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert!(fx.sent_to(id).is_none());
    assert_eq!(fx.body(id, &h, BODY, true), Action::Pause);
    assert_eq!(fx.sent_to(id).unwrap().status, 429);
}

#[test]
fn a_reservation_larger_than_a_window_is_refused_400() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    let body = br#"{"model":"sim","messages":[],"max_tokens":5000}"#;
    assert_eq!(fx.body(id, &h, body, true), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "tokens_exceed_limit"));
    assert_eq!(fx.tokens_used("alice"), 0, "nothing counted");
}

#[test]
fn discovery_is_authenticated_but_counts_nothing() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    let k = format!("Bearer {}", key(2));
    let a = fx.headers(
        id,
        &h,
        &[
            (":method", "GET"),
            (":path", "/llm/sim/v1/models"),
            ("authorization", &k),
        ],
        true,
    );
    assert_eq!(a, Action::Continue);
    assert!(fx.phase(&h).contains("Forwarding { reservation: None"));
    assert_eq!(fx.tokens_used("alice"), 0);
    fx.host.enter(id);
    h.on_log(&fx.host);
    assert!(fx.phase(&h).starts_with("Settled"));
}

/// The chat request of `key` declaring `len` as its body length (`extra`: more headers).
fn chat_declaring(
    key: &str,
    len: &str,
    extra: &[(&'static str, &str)],
) -> Vec<(&'static str, String)> {
    let mut h: Vec<(&'static str, String)> = chat(key)
        .into_iter()
        .filter(|(k, _)| *k != "content-length")
        .collect();
    h.push(("content-length", len.to_string()));
    h.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    h
}

fn body_reads(fx: &Fx) -> usize {
    fx.host
        .calls
        .borrow()
        .iter()
        .filter(|c| matches!(c, Call::Body(Body::Request)))
        .count()
}

#[test]
fn a_body_that_reaches_its_content_length_is_decided_before_its_stream_ends() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    let len = BODY.len().to_string();
    fx.headers(id, &h, &refs(&chat_declaring(&key(2), &len, &[])), false);
    // The whole declared body in its first chunk: decided and passed on, not held.
    assert_eq!(fx.body(id, &h, BODY, false), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"), "{}", fx.phase(&h));
    let reserved = fx.tokens_used("alice");
    assert!(reserved > 0, "reserved at admission");
    // The end of the stream (no bytes) and trailers change nothing, count nothing again.
    fx.host.enter(id);
    fx.host.set_buffer(Body::Request, b"");
    assert_eq!(h.on_request_body(&fx.host, 0, true), Action::Continue);
    assert_eq!(h.on_request_trailers(&fx.host), Action::Continue);
    assert_eq!(fx.tokens_used("alice"), reserved);
    assert_eq!(body_reads(&fx), 1, "the body is read once");
    assert!(fx.sent_to(id).is_none());
}

#[test]
fn a_body_in_pieces_is_decided_when_it_reaches_its_content_length() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    let len = STREAM.len().to_string();
    fx.headers(id, &h, &refs(&chat_declaring(&key(2), &len, &[])), false);
    fx.host.enter(id);
    fx.host.set_buffer(Body::Request, &STREAM[..10]);
    assert_eq!(h.on_request_body(&fx.host, 10, false), Action::Pause);
    assert!(fx.phase(&h).starts_with("BodyBuffering"));
    // Envoy's buffer holds every chunk so far: the whole body now, its stream not ended.
    assert_eq!(fx.body(id, &h, STREAM, false), Action::Continue);
    // Decided as at END_STREAM: the stream asks for its usage.
    let sent: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert!(fx.phase(&h).starts_with("Forwarding"));
}

#[test]
fn a_wrong_model_in_a_body_at_its_content_length_is_refused_at_once() {
    let fx = Fx::new();
    hit(&fx);
    let (id, h) = fx.http();
    let body = br#"{"model":"big","messages":[]}"#;
    let len = body.len().to_string();
    fx.headers(id, &h, &refs(&chat_declaring(&key(2), &len, &[])), false);
    assert_eq!(fx.body(id, &h, body, false), Action::Pause);
    let s = fx.sent_to(id).unwrap();
    assert_eq!((s.status, s.code().as_str()), (400, "model_mismatch"));
    // What follows stays paused; nothing is refused twice.
    assert_eq!(fx.body(id, &h, body, true), Action::Pause);
    assert_eq!(h.on_request_trailers(&fx.host), Action::Pause);
    assert_eq!(fx.host.sent.borrow().len(), 1);
}

#[test]
fn without_one_plain_content_length_the_body_is_held_to_its_end() {
    let len = BODY.len().to_string();
    let twice: &[(&'static str, &str)] = &[("content-length", len.as_str())];
    let cases: Vec<(Vec<(&'static str, String)>, &str)> = vec![
        (chat(&key(2)), "another length"),
        (chat_declaring(&key(2), &format!("+{len}"), &[]), "a sign"),
        (chat_declaring(&key(2), &format!("{len} "), &[]), "a blank"),
        (
            chat_declaring(&key(2), &format!("0{len}x"), &[]),
            "not digits",
        ),
        (chat_declaring(&key(2), "", &[]), "empty"),
        (chat_declaring(&key(2), &len, twice), "repeated"),
        (
            chat_declaring(&key(2), &len, &[("transfer-encoding", "chunked")]),
            "with transfer-encoding",
        ),
    ];
    for (headers, why) in cases {
        let fx = Fx::new();
        hit(&fx);
        let (id, h) = fx.http();
        fx.headers(id, &h, &refs(&headers), false);
        assert_eq!(fx.body(id, &h, BODY, false), Action::Pause, "{why}");
        assert!(fx.phase(&h).starts_with("BodyBuffering"), "{why}");
        assert_eq!(fx.body(id, &h, BODY, true), Action::Continue, "{why}");
        assert!(fx.phase(&h).starts_with("Forwarding"), "{why}");
    }
    // (Repeated `content-length` headers are counted by the caller: the cases above.)
    assert_eq!(crate::admission::declared_length("60"), Some(60));
    for bad in ["9999999999999", "+60", "", "6 0", "0x3c"] {
        assert_eq!(crate::admission::declared_length(bad), None, "{bad:?}");
    }
}

#[test]
fn while_authenticating_a_whole_declared_body_still_waits_for_the_answer() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    let len = BODY.len().to_string();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat_declaring(&key(2), &len, &[])), false),
        Action::Pause
    );
    assert!(fx.phase(&h).starts_with("Authenticating"));
    // Held mode off: Envoy gives no body before the headers continue; were it to, it waits.
    assert_eq!(fx.body(id, &h, BODY, false), Action::Pause);
    assert!(fx.phase(&h).starts_with("Authenticating"));
}

/// What Envoy's `request.total_size` is for the request headers in the host's map plus `body`
/// bytes received (the headers as the filter left them).
fn total_size(fx: &Fx, id: u32, body: u64) {
    let header_bytes = fx.host.headers(Headers::Request).byte_size() as u64;
    fx.host
        .numbers
        .borrow_mut()
        .insert((id, "request.total_size".into()), header_bytes + body);
}

fn support(fx: &Fx) -> crate::worker::HoldSupport {
    fx.root.worker.borrow().held.support
}

/// Issue 26 item 11: `pauseHeadersForBody` without Envoy's `allow_on_headers_stop_iteration`
/// (an Envoy older than 1.35, or a control plane that dropped the field): Envoy buffers the body
/// of a request whose headers the filter holds and never hands it over. The tick sees body bytes
/// Envoy received that the filter never got: the held requests go on as in the default mode
/// (content-length removed, resumed), the worker stops holding, and it says so (gauge, log).
#[test]
fn held_headers_without_the_knob_go_on_as_in_the_default_mode() {
    let mut fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    assert_eq!(
        fx.headers(id, &h, &refs(&chat(&key(2))), false),
        Action::Pause
    );
    assert_eq!(support(&fx), crate::worker::HoldSupport::Unknown);
    // A tick before any body byte arrived: a slow client, not a missing knob.
    total_size(&fx, id, 0);
    fx.root.tick(&fx.host);
    assert_eq!(support(&fx), crate::worker::HoldSupport::Unknown);
    assert!(!fx.resumed(id));
    assert!(
        fx.phase(&h)
            .starts_with("BodyBuffering { headers_held: true }")
    );
    // Envoy received the body; the filter was never called.
    total_size(&fx, id, BODY.len() as u64);
    fx.root.tick(&fx.host);
    assert_eq!(support(&fx), crate::worker::HoldSupport::Missing);
    assert!(fx.resumed(id), "the held request goes on");
    assert!(
        fx.phase(&h)
            .starts_with("BodyBuffering { headers_held: false }")
    );
    assert_eq!(fx.host.map_value(Headers::Request, "content-length"), None);
    let gauge = fx.root.worker.borrow().metrics.hold_unsupported;
    assert!(fx.host.recorded.borrow().contains(&(gauge, 1)));
    // Envoy then hands the buffered body over: decided as in the default mode.
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert!(fx.phase(&h).starts_with("Forwarding"));
    // The next request on this worker does not hold its headers.
    let (id2, h2) = fx.http();
    assert_eq!(
        fx.headers(id2, &h2, &refs(&chat(&key(2))), false),
        Action::Continue
    );
    assert!(
        fx.phase(&h2)
            .starts_with("BodyBuffering { headers_held: false }")
    );
    // And a refusal on its body is still a refusal.
    assert_eq!(
        fx.body(id2, &h2, br#"{"model":"big","messages":[]}"#, true),
        Action::Pause
    );
    assert_eq!(fx.sent_to(id2).unwrap().code(), "model_mismatch");
}

/// With the knob, a held request's body reaches the filter: the worker knows, watches nothing
/// more, and a later tick changes nothing even when a held request waits (a slow client).
#[test]
fn held_headers_with_the_knob_are_confirmed_by_the_first_body() {
    let mut fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.root.worker.borrow().held.watched.len(), 1);
    assert_eq!(fx.body(id, &h, BODY, true), Action::Continue);
    assert_eq!(support(&fx), crate::worker::HoldSupport::Confirmed);
    assert!(fx.root.worker.borrow().held.watched.is_empty());
    let (id2, h2) = fx.http();
    fx.headers(id2, &h2, &refs(&chat(&key(2))), false);
    assert!(fx.root.worker.borrow().held.watched.is_empty());
    // Even bytes Envoy has not handed over yet (they are on their way) change nothing now.
    total_size(&fx, id2, 10);
    fx.host.clear_calls();
    fx.root.tick(&fx.host);
    assert!(!fx.resumed(id2));
    assert!(
        !fx.host
            .calls
            .borrow()
            .iter()
            .any(|c| matches!(c, Call::Property(p) if p == "request.total_size")),
        "no probe once confirmed"
    );
    assert_eq!(support(&fx), crate::worker::HoldSupport::Confirmed);
}

/// A request that waited for the companion while the worker found the knob missing goes on
/// with its headers when the answer comes (not held, content-length removed).
#[test]
fn a_request_authenticating_when_the_knob_is_found_missing_is_not_held() {
    let mut fx = held();
    hit(&fx);
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    // A second credential: a callout.
    let (id2, h2) = fx.http();
    assert_eq!(
        fx.headers(id2, &h2, &refs(&chat(&key(3))), false),
        Action::Pause
    );
    total_size(&fx, id, BODY.len() as u64);
    fx.host.enter(1);
    fx.root.tick(&fx.host);
    assert_eq!(support(&fx), crate::worker::HoldSupport::Missing);
    fx.host.set_map(Headers::Request, &refs(&chat(&key(3))));
    fx.answer(id2, &h2, Some(200), &alice());
    assert!(fx.resumed(id2));
    assert!(
        fx.phase(&h2)
            .starts_with("BodyBuffering { headers_held: false }")
    );
    assert_eq!(fx.host.map_value(Headers::Request, "content-length"), None);
}
