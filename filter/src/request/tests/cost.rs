//! What the native cost harnesses share (the ignored `native_cost_of_*` tests, whose
//! instructions `./scripts/bench.sh` counts with valgrind: `--toggle-collect` on each harness's
//! own `…_callbacks` function and on [`put_chunk`]).

use super::*;

/// How many requests a run makes: `MAAS_NATIVE_COST_N` (fewer under an instruction counter),
/// else `default`.
pub fn rounds(default: u32) -> u32 {
    std::env::var("MAAS_NATIVE_COST_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Not inlined, so valgrind's `--toggle-collect` on it leaves the host's side out.
#[inline(never)]
pub fn put_chunk(host: &RecordingHost, chunk: &[u8]) {
    host.set_buffer(Body::Response, chunk);
}

/// `n` requests, each through `callbacks` on a fresh context, with what Envoy hands over set up
/// before them (the request's headers and `body`, the `response` headers, a `response_body`):
/// the callbacks alone are the filter's work. The µs per request.
pub fn run(
    fx: &Fx,
    headers: &[(&str, &str)],
    body: &[u8],
    response: &[(&str, &str)],
    response_body: Option<&[u8]>,
    n: u32,
    callbacks: impl Fn(&Fx, u32),
) -> f64 {
    let t = std::time::Instant::now();
    for _ in 0..n {
        let id = fx.context_id();
        fx.host.clear_calls();
        fx.host.enter(id);
        fx.host.set_map(Headers::Request, headers);
        fx.host.set_buffer(Body::Request, body);
        fx.host.set_map(Headers::Response, response);
        if let Some(b) = response_body {
            fx.host.set_buffer(Body::Response, b);
        }
        callbacks(fx, id);
    }
    t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

/// One request's life through the filter's callbacks, its answer in `chunks` (the host's maps
/// set up by [`run`]); the body must go on, whatever the headers did (held or not).
pub fn request_life(fx: &Fx, id: u32, body_len: usize, chunks: &[Vec<u8>]) {
    let h = fx.root.http(id);
    let host = &fx.host;
    h.on_request_headers(host, false);
    assert_eq!(h.on_request_body(host, body_len, true), Action::Continue);
    assert_eq!(h.on_response_headers(host), Action::Continue);
    for (i, c) in chunks.iter().enumerate() {
        put_chunk(host, c);
        h.on_response_body(host, c.len(), i + 1 == chunks.len());
    }
    h.on_log(host);
    h.on_done(host);
}
