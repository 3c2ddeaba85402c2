//! Streams: time to first byte and memory per stream.

use crate::envoy::BenchEnvoy;
use crate::memory::{Mem, mem_of};
use crate::report::{Ttfb, TtfbRow};
use crate::stats::{median, min_max};
use crate::variants::Envoys;
use crate::{Args, CHAT_PATH, MODEL, log};
use anyhow::{Result, bail};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How long the simulator waits: between stream chunks, or before its whole answer.
#[derive(Clone, Copy)]
pub(crate) enum SimDelay {
    Chunks(u32),
    Answer(u32),
}

impl SimDelay {
    pub(crate) fn header(self) -> String {
        match self {
            SimDelay::Chunks(ms) => format!("x-sim-chunk-delay-ms: {ms}\r\n"),
            SimDelay::Answer(ms) => format!("x-sim-response-delay-ms: {ms}\r\n"),
        }
    }
}

/// Sends one streamed request on a fresh connection; returns (time to the response headers'
/// first byte, time to the first SSE event), both from the end of the write.
pub(crate) fn ttfb_once(
    addr: SocketAddr,
    auth: &str,
    body: &[u8],
    delay: SimDelay,
) -> Result<(f64, f64)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let req = format!(
        "POST {CHAT_PATH} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nAuthorization: {auth}\r\n{}Connection: close\r\nContent-Length: {}\r\n\r\n",
        delay.header(),
        body.len()
    );
    let mut full = req.into_bytes();
    full.extend_from_slice(body);
    s.write_all(&full)?;
    let t0 = Instant::now();
    let mut buf = Vec::with_capacity(16384);
    let mut tmp = [0u8; 16384];
    let mut first_byte = None;
    let mut first_event = None;
    loop {
        let n = s.read(&mut tmp)?;
        if n == 0 {
            break;
        }
        if first_byte.is_none() {
            first_byte = Some(t0.elapsed());
        }
        buf.extend_from_slice(&tmp[..n]);
        if first_event.is_none()
            && let Some(h) = find(&buf, b"\r\n\r\n")
            && find(&buf[h..], b"data:").is_some()
        {
            first_event = Some(t0.elapsed());
        }
    }
    let text = String::from_utf8_lossy(&buf);
    if !text.starts_with("HTTP/1.1 200")
        || (body.windows(6).any(|w| w == b"stream") && !text.contains("[DONE]"))
    {
        bail!(
            "stream failed: {}",
            text.chars().take(400).collect::<String>()
        );
    }
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0).unwrap_or(f64::NAN);
    Ok((ms(first_byte), ms(first_event)))
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Peak memory of `envoy` while `n` streams of `tokens` chunks, `delay_ms` apart, are in flight.
pub(crate) fn stream_memory(
    envoy: &BenchEnvoy,
    auth: &str,
    n: usize,
    tokens: u32,
    delay_ms: u32,
) -> Result<Mem> {
    let body = stream_body(tokens);
    let addr = envoy.listen;
    let done = std::sync::atomic::AtomicUsize::new(0);
    let mut peak = Mem::default();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let body = body.as_bytes();
                let done = &done;
                s.spawn(move || {
                    let r = ttfb_once(addr, auth, body, SimDelay::Chunks(delay_ms));
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    r
                })
            })
            .collect();
        while done.load(std::sync::atomic::Ordering::SeqCst) < n {
            let m = mem_of(envoy.pid(), envoy.admin);
            peak.rss_kib = peak.rss_kib.max(m.rss_kib);
            peak.wasm_linear_kib = peak.wasm_linear_kib.max(m.wasm_linear_kib);
            peak.heap_allocated_kib = peak.heap_allocated_kib.max(m.heap_allocated_kib);
            std::thread::sleep(Duration::from_millis(100));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("stream thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(peak)
}

pub(crate) fn json_body(max_tokens: u32) -> String {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short about benchmarks please"}],
        "max_tokens": max_tokens
    })
    .to_string()
}

pub(crate) fn stream_body(max_tokens: u32) -> String {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short about benchmarks please"}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true}
    })
    .to_string()
}

/// Time to first byte, bare Envoy and Envoy with the filter alternating: response headers and
/// the first SSE event of streams; then the response headers of other answers, with the trivial
/// wasm filter too.
pub(crate) fn measure_ttfb(
    args: &Args,
    envoys: &Envoys,
    cached_auth: &str,
) -> Result<(Ttfb<'static>, Vec<TtfbRow>)> {
    let (bare, filtered) = (&envoys.bare, &envoys.filtered);
    let mut ttfb = BTreeMap::new();
    log(format!(
        "time to first byte: {} streams per Envoy, alternating …",
        args.ttfb_samples
    ));
    let body = stream_body(32);
    let (mut hb, mut eb, mut hf, mut ef) = (vec![], vec![], vec![], vec![]);
    for _ in 0..args.ttfb_samples {
        for (addr, heads, events) in [
            (bare.listen, &mut hb, &mut eb),
            (filtered.listen, &mut hf, &mut ef),
        ] {
            let (h, e) = ttfb_once(addr, cached_auth, body.as_bytes(), SimDelay::Chunks(1))?;
            heads.push(h);
            events.push(e);
        }
    }
    let ttfb_more = ttfb_by_answer(args, envoys, cached_auth, &body)?;
    ttfb.insert("envoy", (median(&hb), median(&eb), min_max(&eb)));
    ttfb.insert("filter", (median(&hf), median(&ef), min_max(&ef)));
    Ok((ttfb, ttfb_more))
}

/// The same on other answers and with the trivial wasm filter, to tell the request path from
/// the stream and the filter from having any wasm filter: response headers, fresh connections,
/// the Envoys alternating.
fn ttfb_by_answer(
    args: &Args,
    envoys: &Envoys,
    cached_auth: &str,
    body: &str,
) -> Result<Vec<TtfbRow>> {
    let mut ttfb_more: Vec<TtfbRow> = Vec::new();
    let json = json_body(16);
    let mut addrs = vec![envoys.bare.listen];
    addrs.extend(envoys.noop.as_ref().map(|n| n.listen));
    addrs.push(envoys.filtered.listen);
    // A JSON answer 1 ms late too: Envoy idle before the response, as before a stream's
    // later chunks (and before any real model's first token).
    for (name, b, delay) in [
        ("stream", body.as_bytes(), SimDelay::Chunks(1)),
        ("json", json.as_bytes(), SimDelay::Chunks(1)),
        ("json-delayed", json.as_bytes(), SimDelay::Answer(1)),
        ("stream-nodelay", body.as_bytes(), SimDelay::Chunks(0)),
    ] {
        let mut samples = vec![Vec::new(); addrs.len()];
        for _ in 0..args.ttfb_samples {
            for (addr, xs) in addrs.iter().zip(samples.iter_mut()) {
                xs.push(ttfb_once(*addr, cached_auth, b, delay)?.0);
            }
        }
        let medians: Vec<f64> = samples.iter().map(|xs| median(xs)).collect();
        let noop_ms = (medians.len() == 3)
            .then(|| medians.get(1).copied())
            .flatten();
        let (Some(&bare_ms), Some(&filter_ms)) = (medians.first(), medians.last()) else {
            continue;
        };
        ttfb_more.push(TtfbRow {
            answer: name,
            bare_ms,
            noop_ms,
            filter_ms,
        });
    }
    Ok(ttfb_more)
}
