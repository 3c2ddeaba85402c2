//! junk-bound: shared data stays bounded whatever clients send.

use crate::envoy::{EnvoyInputs, start_envoy};
use crate::http::{HttpConn, post_once};
use crate::memory::{Mem, mem_of, mib};
use crate::streams::json_body;
use crate::{Args, CHAT_PATH, log};
use anyhow::{Result, bail};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Sends `Bearer junk-<n>` for n in `from..to` (each distinct, each refused 401 by the companion
/// and then cached negatively), `threads` keep-alive connections in parallel. Returns the answers
/// that were not 401.
pub(crate) fn fill_junk(
    addr: SocketAddr,
    from: usize,
    to: usize,
    body: &[u8],
    threads: usize,
) -> Result<usize> {
    let ids: Vec<usize> = (from..to).collect();
    let chunk = ids.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || -> Result<usize> {
                    let mut conn = HttpConn::connect(addr)?;
                    let mut bad = 0;
                    for n in part {
                        let auth = format!("Bearer junk-{n}");
                        let status = match conn.post(CHAT_PATH, &[("Authorization", &auth)], body) {
                            Ok((s, _)) => s,
                            Err(_) => {
                                conn = HttpConn::connect(addr)?;
                                conn.post(CHAT_PATH, &[("Authorization", &auth)], body)?.0
                            }
                        };
                        if status != 401 {
                            bad += 1;
                        }
                    }
                    Ok(bad)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("junk thread panicked"))?
            })
            .sum::<Result<usize>>()
    })
}

pub(crate) struct JunkRound {
    /// Junk tokens sent so far.
    pub(crate) sent: usize,
    pub(crate) mem: Mem,
    /// Answers that were not 401.
    pub(crate) failed: usize,
    pub(crate) requests_per_s: f64,
}

pub(crate) struct Junk {
    pub(crate) cache_entries: u64,
    pub(crate) base: Mem,
    pub(crate) rounds: Vec<JunkRound>,
}

/// A fresh Envoy with the filter (`cache.maxEntries` = `cache_entries`) takes `per_round`
/// distinct junk bearer tokens, `rounds` times: Envoy's heap (tcmalloc `allocated`, which holds
/// proxy-wasm shared data) before and after each round.
pub(crate) fn junk_bound(
    inputs: &EnvoyInputs<'_>,
    cached_auth: &str,
    per_round: usize,
    rounds: usize,
    cache_entries: u64,
) -> Result<Junk> {
    log(format!(
        "junk-bound: fresh Envoy (cache.maxEntries {cache_entries}), {rounds} × {per_round} distinct junk bearer tokens …"
    ));
    let envoy = start_envoy(inputs, "envoy-junk", true, cache_entries)?;
    let body = json_body(16);
    // One good request first: the VM is warm and the policy loaded before the baseline.
    let (s, t) = post_once(
        envoy.listen,
        CHAT_PATH,
        &[("Authorization", cached_auth)],
        body.as_bytes(),
    )?;
    if s != 200 {
        bail!("envoy-junk: {s} {t}");
    }
    std::thread::sleep(Duration::from_millis(500));
    let base = mem_of(envoy.pid(), envoy.admin);
    let mut done = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let t = Instant::now();
        let from = round * per_round;
        let failed = fill_junk(envoy.listen, from, from + per_round, body.as_bytes(), 16)?;
        let secs = t.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(500));
        let m = mem_of(envoy.pid(), envoy.admin);
        log(format!(
            "junk-bound: {} junk tokens in {secs:.1} s ({failed} not 401): heap {} MiB (base {} MiB)",
            from + per_round,
            mib(m.heap_allocated_kib as i64),
            mib(base.heap_allocated_kib as i64)
        ));
        done.push(JunkRound {
            sent: from + per_round,
            mem: m,
            failed,
            requests_per_s: per_round as f64 / secs.max(1e-9),
        });
    }
    Ok(Junk {
        cache_entries,
        base,
        rounds: done,
    })
}

pub(crate) fn render_junk(j: &Junk, args: &Args) -> String {
    let mut o = String::new();
    let per_round = j.rounds.first().map_or(0, |r| r.sent);
    let _ = writeln!(
        o,
        "\n## Shared data stays bounded: distinct junk bearer tokens (`junk-bound`)\n"
    );
    let _ = writeln!(
        o,
        "A fresh Envoy with the filter (`cache.maxEntries` {}, `negativeTtlSeconds` 5) takes {} rounds of {per_round} requests, each with a new bearer token `junk-<n>` (the companion answers 401; the filter caches the refusal). The cache lives in `cache.maxEntries` fixed shared-data slots (two candidates per credential), so once the slots are full the heap must stop growing. Envoy heap = tcmalloc `allocated` from admin `/memory`. Command: `{}`.\n",
        j.cache_entries,
        j.rounds.len(),
        args.command
    );
    let _ = writeln!(
        o,
        "| junk tokens sent | Envoy heap MiB | Δ heap MiB (vs before) | Δ heap in this round MiB | not 401 | req/s |"
    );
    let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(
        o,
        "| 0 | {} | – | – | – | – |",
        mib(j.base.heap_allocated_kib as i64)
    );
    let mut prev = j.base.heap_allocated_kib as i64;
    let mut deltas = Vec::with_capacity(j.rounds.len());
    for r in &j.rounds {
        let h = r.mem.heap_allocated_kib as i64;
        deltas.push(h - prev);
        let _ = writeln!(
            o,
            "| {} | {} | {:+.1} | {:+.1} | {} | {:.0} |",
            r.sent,
            mib(h),
            (h - j.base.heap_allocated_kib as i64) as f64 / 1024.0,
            (h - prev) as f64 / 1024.0,
            r.failed,
            r.requests_per_s
        );
        prev = h;
    }
    if let (Some(&first), Some(&last)) = (deltas.first(), deltas.last()) {
        let total = prev - j.base.heap_allocated_kib as i64;
        let per_slot = total as f64 * 1024.0 / j.cache_entries.max(1) as f64;
        let _ = writeln!(
            o,
            "\nFirst round {:+.1} MiB, last round {:+.1} MiB; in all {:+.1} MiB = {per_slot:.0} bytes per configured cache slot — {}.",
            first as f64 / 1024.0,
            last as f64 / 1024.0,
            total as f64 / 1024.0,
            if last.abs() * 10 <= first.abs().max(1024) {
                "the heap plateaus within the configured bound"
            } else {
                "the heap did NOT plateau"
            }
        );
    }
    o
}
