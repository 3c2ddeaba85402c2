//! The response side: usage scanning and settlement, and the host-call budget of a request.

use super::cost;
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
        fx.host.metric(&crate::metrics::series_name(
            &crate::metrics::TOKENS,
            &["output", "free", "none", "sim"]
        )),
        7
    );
    // Settled once: the end of the stream changes nothing.
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 12);
}

#[test]
fn the_upstreams_own_rate_limit_headers_are_replaced_the_others_added() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    // A provider's limits for the gateway's own account must not reach the client.
    response(
        &fx,
        id,
        &h,
        &[
            (":status", "200"),
            ("content-type", "application/json"),
            ("x-ratelimit-remaining-requests", "provider-own"),
            ("x-ratelimit-remaining-requests", "provider-again"),
            // A name the gateway never sends: removed, not passed on.
            ("X-RateLimit-Limit-Images", "provider-own"),
        ],
    );
    let calls = fx.host.calls.borrow().clone();
    let sets: Vec<&str> = calls
        .iter()
        .filter_map(|c| match c {
            Call::SetHeader(Headers::Response, n, Some(_)) => Some(n.as_str()),
            _ => None,
        })
        .collect();
    let adds = calls
        .iter()
        .filter(|c| matches!(c, Call::AddHeader(Headers::Response, ..)))
        .count();
    assert_eq!(sets, ["x-ratelimit-remaining-requests"]);
    assert_eq!(adds, 5);
    assert_eq!(
        fx.host
            .map_values(Headers::Response, "x-ratelimit-limit-images"),
        Vec::<String>::new()
    );
    let values = fx
        .host
        .map_values(Headers::Response, "x-ratelimit-remaining-requests");
    assert_eq!(values.len(), 1, "{values:?}");
    assert_ne!(values.first().map(String::as_str), Some("provider-own"));
    assert!(
        values.iter().all(|v| v.parse::<u64>().is_ok()),
        "{values:?}"
    );
    for name in [
        "x-ratelimit-limit-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ] {
        assert_eq!(
            fx.host.map_values(Headers::Response, name).len(),
            1,
            "{name}"
        );
    }
}

fn trailers(fx: &Fx, id: u32, h: &Http, trailers: &[(&str, &str)]) {
    fx.host.enter(id);
    fx.host.set_map(Headers::ResponseTrailers, trailers);
    assert_eq!(h.on_response_trailers(&fx.host), Action::Continue);
}

#[test]
fn the_upstreams_rate_limit_trailers_are_removed_and_trailers_settle() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, BODY);
    response(
        &fx,
        id,
        &h,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    chunk(&fx, id, &h, JSON, false);
    assert!(fx.phase(&h).starts_with("Responding"));
    trailers(
        &fx,
        id,
        &h,
        &[
            ("x-ratelimit-remaining-requests", "provider-own"),
            ("X-RateLimit-Remaining-Requests", "provider-again"),
            ("x-ratelimit-limit-images", "provider-own"),
            ("grpc-status", "0"),
        ],
    );
    let left = fx
        .host
        .maps
        .borrow()
        .get(&Headers::ResponseTrailers)
        .cloned()
        .unwrap_or_default();
    assert_eq!(left, [("grpc-status".to_string(), "0".to_string())]);
    // One removal per name, whatever its case and however often it came.
    let removals = fx
        .host
        .calls
        .borrow()
        .iter()
        .filter(|c| matches!(c, Call::SetHeader(Headers::ResponseTrailers, _, None)))
        .count();
    assert_eq!(removals, 2);
    // The trailers ended the response: settled to its usage there, once.
    assert!(fx.phase(&h).starts_with("Settled"));
    assert_eq!(fx.tokens_used("alice"), 12);
    fx.host.enter(id);
    h.on_log(&fx.host);
    assert_eq!(fx.tokens_used("alice"), 12);
}

#[test]
fn a_stream_ending_in_trailers_reads_its_unterminated_last_event() {
    let fx = Fx::new();
    let (id, h) = admitted(&fx, STREAM);
    response(
        &fx,
        id,
        &h,
        &[(":status", "200"), ("content-type", "text/event-stream")],
    );
    // The usage event lacks its blank line: only the trailers say the stream is over.
    let cut = SSE.split("data: [DONE]").next().unwrap();
    let cut = cut.strip_suffix("\n\n").unwrap();
    chunk(&fx, id, &h, cut.as_bytes(), false);
    trailers(&fx, id, &h, &[("x-ratelimit-limit-tokens", "provider-own")]);
    assert_eq!(
        fx.host
            .map_values(Headers::ResponseTrailers, "x-ratelimit-limit-tokens"),
        Vec::<String>::new()
    );
    assert!(fx.phase(&h).starts_with("Settled"));
    assert_eq!(fx.tokens_used("alice"), 7);
}

#[test]
fn trailers_of_a_request_never_admitted_are_left_alone() {
    let fx = Fx::new();
    let (id, h) = fx.http();
    trailers(&fx, id, &h, &[("x-ratelimit-limit-tokens", "x")]);
    assert!(fx.host.calls.borrow().is_empty());
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
    let estimate = h.0.borrow().metering.prompt_tokens_estimate;
    assert_eq!(fx.tokens_used("alice"), estimate + 1);
}

/// Host calls of a whole request, from its headers to its settlement: the first of its
/// credential on the worker (the answer comes from shared data) and the second (from the
/// worker's own copy; token metrics are defined once per tier and model).
fn calls_of(
    fx: &Fx,
    body: &[u8],
    response_headers: &[(&str, &str)],
    chunks: &[&[u8]],
) -> (Vec<Call>, Vec<Call>) {
    let first = one_request(fx, body, response_headers, chunks);
    (first, one_request(fx, body, response_headers, chunks))
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

/// A JSON request whose credential no cache holds: callout, answer, resume, then as cached.
fn calls_of_miss(fx: &Fx) -> Vec<Call> {
    let (id, h) = fx.http();
    fx.host.clear_calls();
    fx.headers(id, &h, &refs(&chat(&key(2))), false);
    fx.answer(id, &h, Some(200), &alice());
    fx.body(id, &h, BODY, true);
    response(
        fx,
        id,
        &h,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    chunk(fx, id, &h, JSON, true);
    fx.host.enter(id);
    h.on_log(&fx.host);
    h.on_done(&fx.host);
    fx.host.calls.borrow().clone()
}

/// Host calls by kind (the kinds priced by `./scripts/bench.sh --only hostcalls`).
fn by_kind(calls: &[Call]) -> std::collections::BTreeMap<&'static str, usize> {
    let mut out = std::collections::BTreeMap::new();
    for c in calls {
        *out.entry(kind_of(c)).or_default() += 1;
    }
    out
}

fn kind_of(c: &Call) -> &'static str {
    match c {
        Call::Headers(_) => "header map read",
        Call::Header(..) => "header read",
        Call::SetHeader(_, _, Some(_)) => "header set",
        Call::SetHeader(_, _, None) => "header remove",
        Call::AddHeader(..) => "header add",
        Call::Body(_) => "body read",
        Call::SetBody(_) => "body write",
        Call::Dispatch(_) => "dispatch",
        Call::SendResponse(_) => "local response",
        Call::Resume => "resume",
        Call::SetEffectiveContext(_) => "effective context",
        Call::Now => "clock",
        Call::DefineMetric(_) => "metric define",
        Call::IncrementMetric(..) => "metric increment",
        Call::RecordMetric(..) => "metric record",
        Call::Property(_) => "property",
        Call::SetProperty(_) => "property set",
        Call::SharedGet(_) => "shared get",
        Call::SharedSet(_) => "shared set (CAS)",
    }
}

/// `by_kind` with the side of header and body calls (`request header set`, `response body
/// read`, …): the benchmark report prices each (request and response calls differ in price).
fn by_side_and_kind(calls: &[Call]) -> serde_json::Map<String, serde_json::Value> {
    let mut out = std::collections::BTreeMap::<String, usize>::new();
    for c in calls {
        let side = match c {
            Call::Headers(m)
            | Call::Header(m, _)
            | Call::SetHeader(m, ..)
            | Call::AddHeader(m, ..) => match m {
                Headers::Request => "request ",
                Headers::Response => "response ",
                Headers::ResponseTrailers => "response trailer ",
                Headers::CallResponse => "callout ",
            },
            Call::Body(b) | Call::SetBody(b) => match b {
                Body::Request => "request ",
                Body::Response => "response ",
                Body::CallResponse => "callout ",
                Body::PluginConfiguration => "configuration ",
            },
            _ => "",
        };
        *out.entry(format!("{side}{}", kind_of(c))).or_default() += 1;
    }
    out.into_iter().map(|(k, n)| (k, n.into())).collect()
}

/// Writes `figures` under `section` of the JSON file named by `MAAS_HOST_CALLS_OUT`, when set
/// (`./scripts/bench.sh` renders it in docs/benchmarks.md). The two budget tests share the file.
fn write_figures(section: &str, figures: serde_json::Value) {
    static FILE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let Some(path) = std::env::var_os("MAAS_HOST_CALLS_OUT") else {
        return;
    };
    let _held = FILE.lock().unwrap();
    let mut all: serde_json::Value = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({}));
    all[section] = figures;
    std::fs::write(&path, serde_json::to_vec_pretty(&all).unwrap()).unwrap();
}

/// The budget in filter/README.md (`cargo test -p maas-filter host_calls_per_request --
/// --nocapture` prints the breakdown): a cached JSON request costs 21 host calls once this
/// worker holds its credential (25 on the worker's first: one shared cache read, the token
/// metrics of its tier and model defined, and the subject's counter slot read again at admission:
/// never written before, its precheck read cannot start a CAS write), a cached stream of three
/// chunks (include_usage added, usage event stripped) 26, a JSON request whose credential no cache holds 37 (on a fresh
/// worker: both candidate slots read, the answer cached, the metrics defined). Each shared-data read, header
/// read and body read copies its answer into the VM and costs what 3–6 writes do.
#[test]
fn host_calls_per_request_stay_within_budget() {
    let fx = Fx::new();
    let (json_first, json) = calls_of(
        &fx,
        BODY,
        &[(":status", "200"), ("content-type", "application/json")],
        &[JSON],
    );
    let fx = Fx::new();
    let parts: Vec<&[u8]> = SSE.split_inclusive("\n\n").map(str::as_bytes).collect();
    let (_, stream) = calls_of(
        &fx,
        STREAM,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &parts,
    );
    let miss = calls_of_miss(&Fx::new());
    // Headers held for the body (the shipped and local default: pauseHeadersForBody with Envoy's
    // allow_on_headers_stop_iteration): once the worker saw a held body, nothing is watched.
    let fx = Fx::with(serde_json::json!({"pauseHeadersForBody": true}));
    let (_, held) = calls_of(
        &fx,
        BODY,
        &[(":status", "200"), ("content-type", "application/json")],
        &[JSON],
    );
    let fx = Fx::with(serde_json::json!({"pauseHeadersForBody": true}));
    let (_, held_stream) = calls_of(
        &fx,
        STREAM,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &parts,
    );
    // A subject this worker admits often: its refund folds into its next admission's write.
    let fx = busy_fx();
    for _ in 0..crate::folds::HOT_ADMISSIONS {
        one_request(
            &fx,
            BODY,
            &[(":status", "200"), ("content-type", "application/json")],
            &[JSON],
        );
    }
    let busy = one_request(
        &fx,
        BODY,
        &[(":status", "200"), ("content-type", "application/json")],
        &[JSON],
    );
    for (name, calls) in [
        ("cached JSON, this worker's copy", &json),
        ("cached JSON, a busy subject", &busy),
        ("cached JSON, shared cache", &json_first),
        ("cached stream", &stream),
        ("miss JSON", &miss),
        ("cached JSON, headers held", &held),
        ("cached stream, headers held", &held_stream),
    ] {
        eprintln!("{name}: {} calls {:?}", calls.len(), by_kind(calls));
    }
    let variants = [
        ("cached JSON", &json),
        ("cached JSON, busy subject", &busy),
        ("cached stream", &stream),
        ("miss JSON", &miss),
        ("cached JSON, first on the worker", &json_first),
    ];
    write_figures(
        "host_calls",
        variants
            .iter()
            .map(|(name, calls)| {
                serde_json::json!({"variant": name, "total": calls.len(), "by_kind": by_side_and_kind(calls)})
            })
            .collect(),
    );
    assert_eq!(json.len(), 21, "{json:#?}");
    // Held: the length is kept (no removal); a rewritten stream body corrects it (a set instead).
    assert_eq!(held.len(), 20, "{held:#?}");
    // A stream reads the clock once more, at its first bytes (time to first token).
    assert_eq!(held_stream.len(), 27, "{held_stream:#?}");
    // No settlement read or write: one counter read (precheck) and one CAS write (admission).
    assert_eq!(busy.len(), 19, "{busy:#?}");
    let slot_calls = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::SharedGet(k) | Call::SharedSet(k) if k.starts_with("maas/l/")))
            .count()
    };
    assert_eq!((slot_calls(&json), slot_calls(&busy)), (4, 2));
    // The first request of a worker also defines its labelled series (decision, tokens by type,
    // the token-usage and duration histograms): once per series and VM.
    assert_eq!(json_first.len(), 29, "{json_first:#?}");
    assert_eq!(stream.len(), 27, "{stream:#?}");
    assert_eq!(miss.len(), 41, "{miss:#?}");
    // What makes a request expensive is what it reads: the worker's copy reads no cache slot.
    let reads = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| matches!(c, Call::SharedGet(k) if k.starts_with("maas/c/")))
            .count()
    };
    assert_eq!((reads(&json_first), reads(&json)), (1, 0));
    // Response headers: one map read for status, content type and coding.
    assert_eq!(by_kind(&json).get("header read"), None);
}

/// A worker whose limits never bind (a busy subject stays admitted).
fn busy_fx() -> Fx {
    let mut p = policy();
    p["tiers"][0]["limits"] = serde_json::json!({
        "requests": [{"limit": 1_000_000_000u64, "window": "1m"}],
        "tokens": [{"limit": 1_000_000_000_000u64, "window": "1m"}]});
    Fx::with(serde_json::json!({"bootstrapPolicy": p, "pollIntervalMs": 60000}))
}

/// Heap allocations (count, bytes, count per callback) of one cached request's callbacks, from its headers to `on_done` (the
/// fixture's and the recording host's bookkeeping not counted; what the host hands over —
/// header maps, bodies, shared-data values — counted, as the SDK allocates them in the VM).
fn allocations_of(
    fx: &Fx,
    body: &[u8],
    response_headers: &[(&str, &str)],
    chunks: &[&[u8]],
) -> (u64, u64, Vec<u64>) {
    fx.cache(&key(2), allow_alice());
    // The worker's first request of the credential takes its copy; the steady state is the next.
    one_request(fx, body, response_headers, chunks);
    let (id, h) = fx.http();
    let headers = chat(&key(2));
    let headers = refs(&headers);
    let mut spent = (0, 0, Vec::new());
    let mut count = |f: &mut dyn FnMut()| {
        let (a0, b0) = crate::alloc_count::snapshot();
        f();
        let (a1, b1) = crate::alloc_count::snapshot();
        spent.0 += a1 - a0;
        spent.1 += b1 - b0;
        spent.2.push(a1 - a0);
    };
    fx.host.enter(id);
    fx.host.set_map(Headers::Request, &headers);
    count(&mut || {
        h.on_request_headers(&fx.host, false);
    });
    fx.host.set_buffer(Body::Request, body);
    count(&mut || {
        h.on_request_body(&fx.host, body.len(), true);
    });
    fx.host.set_map(Headers::Response, response_headers);
    count(&mut || {
        h.on_response_headers(&fx.host);
    });
    for (i, c) in chunks.iter().enumerate() {
        fx.host.set_buffer(Body::Response, c);
        count(&mut || {
            h.on_response_body(&fx.host, c.len(), i + 1 == chunks.len());
        });
    }
    count(&mut || {
        h.on_log(&fx.host);
        h.on_done(&fx.host);
    });
    spent
}

/// Every allocation is work in the VM on every request (allocator, copy, free): the budget
/// holds what a cached request costs (`cargo test -p maas-filter allocations_per_request --
/// --nocapture` prints it).
#[test]
fn allocations_per_request_stay_within_budget() {
    let json = allocations_of(
        &Fx::new(),
        BODY,
        &[(":status", "200"), ("content-type", "application/json")],
        &[JSON],
    );
    let parts: Vec<&[u8]> = SSE.split_inclusive("\n\n").map(str::as_bytes).collect();
    let stream = allocations_of(
        &Fx::new(),
        STREAM,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &parts,
    );
    eprintln!(
        "cached JSON: {} allocations, {} bytes; per callback {:?}",
        json.0, json.1, json.2
    );
    eprintln!(
        "cached stream: {} allocations, {} bytes; per callback {:?}",
        stream.0, stream.1, stream.2
    );
    write_figures(
        "allocations",
        [("cached JSON", &json), ("cached stream", &stream)]
            .iter()
            .map(|(name, (count, bytes, per_callback))| {
                serde_json::json!({"variant": name, "count": count, "bytes": bytes, "per_callback": per_callback})
            })
            .collect(),
    );
    assert!(json.0 <= 9, "{json:?}");
    assert!(stream.0 <= 13, "{stream:?}");
}

/// Global limits on and a lease held (the steady state): a request costs the same host calls
/// as without global limits — the lease is in the counter slot admission reads and writes
/// anyway, the fallback state and the subject's tracking are in the worker.
#[test]
fn host_calls_per_request_do_not_grow_with_global_limits_and_a_lease_held() {
    let held = || {
        let fx = Fx::with(serde_json::json!({"limits": {"global": {"replicaId": "gw-a"}}}));
        let now = fx.host.now.get() / 1000;
        let key = limits::counter_key("alice", limits::DEFAULT_COUNTER_SLOTS);
        let grant = |kind, granted| limits::Grant {
            kind,
            window: 60,
            start: now - now % 60,
            granted,
            taken: granted,
        };
        assert!(limits::apply_grants(
            &fx.host.store,
            &key,
            "alice",
            &[
                grant(limits::Kind::Requests, 3),
                grant(limits::Kind::Tokens, 1000)
            ],
            now,
        ));
        fx
    };
    let fx = held();
    let (_, json) = calls_of(
        &fx,
        BODY,
        &[(":status", "200"), ("content-type", "application/json")],
        &[JSON],
    );
    let fx2 = held();
    let parts: Vec<&[u8]> = SSE.split_inclusive("\n\n").map(str::as_bytes).collect();
    let (_, stream) = calls_of(
        &fx2,
        STREAM,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &parts,
    );
    assert!(
        !json.iter().any(|c| matches!(c, Call::Dispatch(_))),
        "no callout"
    );
    assert_eq!(json.len(), 21, "{json:#?}");
    assert_eq!(stream.len(), 27, "{stream:#?}");
    assert!(fx.root.worker.borrow().leases.tracked.contains_key("alice"));
}

/// A worker whose cache holds key 2 as alice's, with limits that never trip (the benchmark's
/// filter-cached): the native cost harnesses' setup.
fn cached_fixture() -> Fx {
    let mut p = policy();
    p["tiers"][0]["limits"] = serde_json::json!({
        "requests": [{"limit": 1_000_000_000u64, "window": "1m"}],
        "tokens": [{"limit": 1_000_000_000_000u64, "window": "1m"}]});
    let fx = Fx::with(serde_json::json!({"bootstrapPolicy": p, "pollIntervalMs": 60000}));
    let cached = CachedAnswer::Allow(CachedIdentity {
        subject: "alice".into(),
        groups: vec!["system:authenticated".into()],
        pinned_tier: None,
        subscription: None,
        pseudonym: None,
        key_scope: None,
    });
    let id = credential::extract(None, Some(&key(2)))
        .unwrap()
        .cache_identity();
    cache::insert(
        &fx.host.store,
        &id.cache_key,
        &id.verifier,
        &cached,
        1 << 40,
        fx.host.now.get() / 1000,
        100_000,
    );
    fx
}

/// Not a test: the filter's own work per cached request, natively (for profiling with
/// `perf record`; `cargo test -p maas-filter --release --lib -- --ignored native_cost --nocapture`;
/// `./scripts/bench.sh` counts its instructions with valgrind).
#[test]
#[ignore]
fn native_cost_of_a_cached_request() {
    native_cost(
        "request",
        BODY,
        "application/json",
        Some(JSON),
        cached_request_callbacks,
    );
}

/// The native cost harnesses' loop: `callbacks` for [`cost::rounds`] cached requests of
/// `body`, each on a fresh context, with what Envoy hands over set up before the callbacks (the
/// recording host keeps each header map and body apart), so the callbacks alone are the
/// filter's work; prints the time per `unit`.
fn native_cost(
    unit: &str,
    body: &[u8],
    content_type: &str,
    response_body: Option<&[u8]>,
    callbacks: impl Fn(&Fx, u32),
) {
    let fx = cached_fixture();
    let headers = chat(&key(2));
    let resp = [(":status", "200"), ("content-type", content_type)];
    let n = cost::rounds(20_000);
    let us = cost::run(
        &fx,
        &refs(&headers),
        body,
        &resp,
        response_body,
        n,
        callbacks,
    );
    eprintln!("{us:.2} µs per {unit}");
}

/// One cached request's life in the filter, from its context's creation to its end (the
/// host's maps and buffers set up by the caller). Not inlined: valgrind counts instructions
/// from its entry (`--toggle-collect`), the host calls inside excluded.
#[inline(never)]
fn cached_request_callbacks(fx: &Fx, id: u32) {
    let h = fx.root.http(id);
    let host = &fx.host;
    assert_eq!(h.on_request_headers(host, false), Action::Continue);
    assert_eq!(h.on_request_body(host, BODY.len(), true), Action::Continue);
    assert_eq!(h.on_response_headers(host), Action::Continue);
    assert_eq!(h.on_response_body(host, JSON.len(), true), Action::Continue);
    h.on_log(host);
    h.on_done(host);
}

/// The benchmark's stream request: usage asked for by the client (nothing stripped).
const BENCH_STREAM: &[u8] = br#"{"model":"sim","messages":[{"role":"user","content":"Say something short about benchmarks please"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}"#;

/// The simulator's answer to [`BENCH_STREAM`], one event per chunk as it sends them: 64
/// content chunks, the usage chunk, `[DONE]`.
fn bench_stream_chunks() -> Vec<Vec<u8>> {
    let head = r#"{"id":"chatcmpl-sim-1","object":"chat.completion.chunk","created":1700000000,"model":"sim""#;
    let mut out: Vec<Vec<u8>> = (0..64)
        .map(|i| {
            let piece = if i == 0 {
                "tok0".to_string()
            } else {
                format!(" tok{i}")
            };
            let finish = if i == 63 { r#""length""# } else { "null" };
            format!(
                "data: {head},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{piece}\"}},\"finish_reason\":{finish}}}]}}\n\n"
            )
            .into_bytes()
        })
        .collect();
    out.push(
        format!(
            "data: {head},\"choices\":[],\"usage\":{{\"prompt_tokens\":6,\"completion_tokens\":64,\"total_tokens\":70}}}}\n\n"
        )
        .into_bytes(),
    );
    out.push(b"data: [DONE]\n\n".to_vec());
    out
}

/// The harness's stream is what the filter reads as 64 content events and their usage.
#[test]
fn the_native_cost_streams_usage_is_read() {
    let fx = cached_fixture();
    let chunks = bench_stream_chunks();
    let parts: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let calls = one_request(
        &fx,
        BENCH_STREAM,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        &parts,
    );
    assert!(
        !calls.iter().any(|c| matches!(c, Call::SetBody(_))),
        "nothing stripped: {calls:#?}"
    );
    // Settled to its usage (70 tokens), not to the reservation (64 + the prompt estimate).
    assert_eq!(fx.tokens_used("alice"), 70);
}

/// Not a test: the filter's own work per cached stream (the benchmark's filter-stream: 64
/// content chunks, usage asked for), natively; `./scripts/bench.sh` counts its instructions.
#[test]
#[ignore]
fn native_cost_of_a_cached_stream() {
    let chunks = bench_stream_chunks();
    native_cost(
        "stream",
        BENCH_STREAM,
        "text/event-stream",
        None,
        |fx, id| cached_stream_callbacks(fx, id, &chunks),
    );
}

/// [`cached_request_callbacks`] for a stream: each chunk is put in the host's buffer between
/// the callbacks (host side: not counted).
#[inline(never)]
fn cached_stream_callbacks(fx: &Fx, id: u32, chunks: &[Vec<u8>]) {
    let h = fx.root.http(id);
    let host = &fx.host;
    assert_eq!(h.on_request_headers(host, false), Action::Continue);
    assert_eq!(
        h.on_request_body(host, BENCH_STREAM.len(), true),
        Action::Continue
    );
    assert_eq!(h.on_response_headers(host), Action::Continue);
    for (i, c) in chunks.iter().enumerate() {
        cost::put_chunk(host, c);
        let last = i + 1 == chunks.len();
        assert_eq!(h.on_response_body(host, c.len(), last), Action::Continue);
    }
    h.on_log(host);
    h.on_done(host);
}

/// A worker whose policy asks for usage events (`observability.usageEvents`).
fn events_fx() -> Fx {
    let mut p = policy();
    p["observability"] = serde_json::json!({"usageEvents": true});
    Fx::with(serde_json::json!({"bootstrapPolicy": p}))
}

fn set_properties(calls: &[Call]) -> Vec<&Call> {
    calls
        .iter()
        .filter(|c| matches!(c, Call::SetProperty(_)))
        .collect()
}

/// Usage events off (the default) cost no host call; on, exactly one property set per request
/// (its event, at settlement), whatever the response's shape, and nothing else changes.
#[test]
fn host_calls_per_request_stay_within_budget_with_usage_events() {
    let json_headers = [(":status", "200"), ("content-type", "application/json")];
    let sse_headers = [(":status", "200"), ("content-type", "text/event-stream")];
    let parts: Vec<&[u8]> = SSE.split_inclusive("\n\n").map(str::as_bytes).collect();
    for (body, headers, chunks) in [
        (BODY, &json_headers, vec![JSON]),
        (STREAM, &sse_headers, parts),
    ] {
        let (_, off) = calls_of(&Fx::new(), body, headers, &chunks);
        assert!(set_properties(&off).is_empty(), "{off:#?}");
        let (_, on) = calls_of(&events_fx(), body, headers, &chunks);
        assert_eq!(
            set_properties(&on),
            [&Call::SetProperty("maas_event".into())]
        );
        let without: Vec<Call> = on
            .iter()
            .filter(|c| !matches!(c, Call::SetProperty(_)))
            .cloned()
            .collect();
        assert_eq!(without, off);
    }
    assert!(set_properties(&calls_of_miss(&Fx::new())).is_empty());
    // A refusal: one set too (429 at the precheck: the free tier allows 3 a minute).
    let fx = events_fx();
    for _ in 0..3 {
        one_request(&fx, BODY, &json_headers, &[JSON]);
    }
    let refused = one_request(&fx, BODY, &json_headers, &[JSON]);
    assert_eq!(fx.host.last_sent().unwrap().status, 429);
    assert_eq!(set_properties(&refused).len(), 1, "{refused:#?}");
}
