//! The response side: usage scanning and settlement, and the host-call budget of a request.

use super::*;
use std::io::Write;

const STREAM: &[u8] =
    br#"{"model":"sim","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

const SSE: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
    "data: [DONE]\n\n",
);

const JSON: &[u8] =
    br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;

/// A cached caller's request admitted with `body`, on a fresh context.
fn admitted(fx: &Fx, body: &[u8]) -> (u32, Http) {
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    assert_eq!(fx.body(id, &h, body, true), Action::Continue);
    (id, h)
}

fn response(fx: &Fx, id: u32, h: &Http, headers: &[(&str, &str)]) {
    fx.host.enter(id);
    fx.host.set_map(Headers::Response, headers);
    assert_eq!(h.on_response_headers(&fx.host), Action::Continue);
}

fn chunk(fx: &Fx, id: u32, h: &Http, bytes: &[u8], eos: bool) -> Vec<u8> {
    fx.host.enter(id);
    fx.host.set_buffer(Body::Response, bytes);
    assert_eq!(
        h.on_response_body(&fx.host, bytes.len(), eos),
        Action::Continue
    );
    fx.host.buffer(Body::Response)
}

#[test]
fn a_json_response_settles_to_its_usage() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    let reserved = fx.tokens_used("alice");
    assert!(reserved > 12);
    response(
        &fx,
        id,
        &h,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    assert!(fx.phase(&h).starts_with("Responding"));
    assert!(
        fx.host
            .map_value(Headers::Response, "x-ratelimit-remaining-tokens")
            .is_some()
    );
    let (head, tail) = JSON.split_at(20);
    assert_eq!(chunk(&fx, id, &h, head, false), head, "passes untouched");
    chunk(&fx, id, &h, tail, true);
    assert!(fx.phase(&h).starts_with("Settled"));
    assert_eq!(fx.tokens_used("alice"), 12);
    fx.flush();
    assert_eq!(
        fx.host
            .metric(&crate::metrics::token_metric("completion", "free", "sim")),
        7
    );
    // Settled once: the end of the stream changes nothing.
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 12);
}

#[test]
fn an_sse_response_loses_the_usage_event_it_did_not_ask_for_and_settles() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, STREAM);
    response(
        &fx,
        id,
        &h,
        &[
            (":status", "200"),
            ("content-type", "text/event-stream"),
            ("content-length", "300"),
        ],
    );
    assert_eq!(fx.host.map_value(Headers::Response, "content-length"), None);
    let out = chunk(&fx, id, &h, SSE.as_bytes(), true);
    let out = String::from_utf8(out).unwrap();
    assert!(!out.contains("usage"), "{out}");
    assert!(out.contains("[DONE]"));
    assert_eq!(fx.tokens_used("alice"), 7);
}

#[test]
fn a_compressed_response_settles_from_the_decoded_usage() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(JSON).unwrap();
    let gz = gz.finish().unwrap();
    response(
        &fx,
        id,
        &h,
        &[
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ],
    );
    assert_eq!(chunk(&fx, id, &h, &gz, true), gz, "forwarded compressed");
    assert_eq!(fx.tokens_used("alice"), 12);
}

#[test]
fn an_unreadable_coding_settles_to_the_reservation() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    let reserved = fx.tokens_used("alice");
    response(
        &fx,
        id,
        &h,
        &[
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-encoding", "br"),
        ],
    );
    chunk(&fx, id, &h, b"\x0b\x02", true);
    assert_eq!(fx.tokens_used("alice"), reserved);
}

#[test]
fn a_success_without_usage_settles_to_the_reservation_and_is_counted() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    let reserved = fx.tokens_used("alice");
    response(
        &fx,
        id,
        &h,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    chunk(&fx, id, &h, b"{\"choices\":[]}", true);
    assert_eq!(fx.tokens_used("alice"), reserved);
    fx.flush();
    assert_eq!(fx.host.metric(crate::metrics::MALFORMED_UPSTREAM), 1);
}

#[test]
fn an_upstream_error_without_content_settles_to_nothing() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    response(
        &fx,
        id,
        &h,
        &[(":status", "500"), ("content-type", "text/plain")],
    );
    chunk(&fx, id, &h, b"oops", true);
    assert_eq!(fx.tokens_used("alice"), 0);
}

#[test]
fn a_client_abort_before_the_response_settles_to_the_reservation() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    let reserved = fx.tokens_used("alice");
    assert!(reserved > 0);
    fx.host.enter(id);
    h.on_log(&fx.host);
    assert!(fx.phase(&h).starts_with("Settled"));
    assert_eq!(
        fx.tokens_used("alice"),
        reserved,
        "status 0: the work may be done"
    );
}

#[test]
fn a_stream_cut_short_settles_to_what_was_seen() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, STREAM);
    response(
        &fx,
        id,
        &h,
        &[(":status", "200"), ("content-type", "text/event-stream")],
    );
    chunk(
        &fx,
        id,
        &h,
        SSE.split("\n\n").next().unwrap().as_bytes(),
        false,
    );
    chunk(&fx, id, &h, b"\n\n", false);
    fx.host.enter(id);
    h.on_done(&fx.host);
    let estimate = h.0.borrow().prompt_tokens_estimate;
    assert_eq!(fx.tokens_used("alice"), estimate + 1);
}

/// Host calls of a whole request, from its headers to its settlement (the second of its kind
/// on the worker: token metrics are defined once per tier and model).
fn calls_of(
    fx: &Fx,
    body: &[u8],
    response_headers: &[(&str, &str)],
    chunks: &[&[u8]],
) -> Vec<Call> {
    one_request(fx, body, response_headers, chunks);
    one_request(fx, body, response_headers, chunks)
}

fn one_request(
    fx: &Fx,
    body: &[u8],
    response_headers: &[(&str, &str)],
    chunks: &[&[u8]],
) -> Vec<Call> {
    fx.cache(&key(2), allow_alice());
    let (id, h) = fx.http();
    fx.host.clear_calls();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.body(id, &h, body, true);
    response(fx, id, &h, response_headers);
    for (i, c) in chunks.iter().enumerate() {
        chunk(fx, id, &h, c, i + 1 == chunks.len());
    }
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    fx.host.calls.borrow().clone()
}

/// The budget in filter/README.md: a cached JSON request costs 26 host calls, a cached stream
/// of three chunks (include_usage added, usage event stripped) 31 — the very calls the old glue
/// made, one by one.
#[test]
fn host_calls_per_request_stay_within_budget() {
    let fx = Fx::new();
    let json = calls_of(
        &fx,
        BODY,
        &[(":status", "200"), ("content-type", "application/json")],
        &[JSON],
    );
    let fx = Fx::new();
    let parts: Vec<&[u8]> = SSE.split_inclusive("\n\n").map(str::as_bytes).collect();
    let stream = calls_of(
        &fx,
        STREAM,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &parts,
    );
    eprintln!(
        "json: {} calls {json:?}\nstream: {} calls {stream:?}",
        json.len(),
        stream.len()
    );
    assert_eq!(json.len(), 26, "{json:#?}");
    assert_eq!(stream.len(), 31, "{stream:#?}");
}
