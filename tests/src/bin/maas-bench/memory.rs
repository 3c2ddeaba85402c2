//! Envoy's memory, and filling its credential cache.

use crate::envoy::{EnvoyInputs, start_envoy};
use crate::http::{HttpConn, get_text, post_once};
use crate::run::Keys;
use crate::streams::json_body;
use crate::{Args, CHAT_PATH, log};
use anyhow::{Result, bail};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Mem {
    pub(crate) rss_kib: u64,
    /// Resident part of the huge reservations V8 makes for wasm linear memory.
    pub(crate) wasm_linear_kib: u64,
    /// tcmalloc's allocated bytes (Envoy's heap, which holds proxy-wasm shared data).
    pub(crate) heap_allocated_kib: u64,
}

pub(crate) fn mem_of(pid: u32, admin: SocketAddr) -> Mem {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    // V8 reserves 8 GiB (PROT_NONE) per wasm memory and makes the used part readable just below
    // it: count the resident pages of a rw mapping that ends where such a reservation starts.
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut maps: Vec<(u64, u64, bool, u64)> = Vec::new(); // start, end, rw, rss KiB
    for l in smaps.lines() {
        let mut fields = l.split_whitespace();
        let first = fields.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            let rw = fields.next().is_some_and(|p| p.starts_with("rw"));
            maps.push((a, b, rw, 0));
            continue;
        }
        if let Some(v) = l.strip_prefix("Rss:")
            && let Some(last) = maps.last_mut()
        {
            last.3 = v
                .split_whitespace()
                .next()
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
        }
    }
    let wasm_linear_kib = maps
        .windows(2)
        .filter(|w| w[0].2 && w[0].1 == w[1].0 && w[1].1 - w[1].0 >= 4 << 30)
        .map(|w| w[0].3 + w[1].3)
        .sum();
    let heap_allocated_kib = get_text(admin, "/memory")
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["allocated"].as_str()?.parse::<u64>().ok())
        .map(|b| b / 1024)
        .unwrap_or(0);
    Mem {
        rss_kib,
        wasm_linear_kib,
        heap_allocated_kib,
    }
}

pub(crate) fn mib(kib: i64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// Sends `keys[from..to]` through the filter, `threads` keep-alive connections in parallel.
pub(crate) fn fill_keys(
    addr: SocketAddr,
    keys: &[String],
    body: &[u8],
    threads: usize,
) -> Result<usize> {
    let chunk = keys.len().div_ceil(threads.max(1)).max(1);
    let failures = std::thread::scope(|s| {
        let handles: Vec<_> = keys
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || -> Result<usize> {
                    let mut conn = HttpConn::connect(addr)?;
                    let mut bad = 0;
                    for k in part {
                        let auth = format!("Bearer {k}");
                        let (status, _) =
                            match conn.post(CHAT_PATH, &[("Authorization", &auth)], body) {
                                Ok(r) => r,
                                Err(_) => {
                                    conn = HttpConn::connect(addr)?;
                                    conn.post(CHAT_PATH, &[("Authorization", &auth)], body)?
                                }
                            };
                        if status != 200 {
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
                    .map_err(|_| anyhow::anyhow!("fill thread panicked"))?
            })
            .sum::<Result<usize>>()
    })?;
    Ok(failures)
}

/// A fresh Envoy with the filter, its cache filled with `args.cached_keys` distinct cached
/// credentials in turn: its memory first (one cached request) and after each fill, with the
/// fills' failures.
pub(crate) fn credential_memory_rows(
    args: &Args,
    inputs: &EnvoyInputs<'_>,
    keys: &Keys,
    dir: &Path,
) -> Result<Vec<(usize, Mem, usize)>> {
    let mut mem_rows = Vec::new();
    log("memory: fresh Envoy with the filter, filling its cache …");
    let max_cached = keys.max_cached;
    let cached: Vec<String> = std::fs::read_to_string(&keys.keys_file)?
        .lines()
        .take(max_cached)
        .map(str::to_string)
        .collect();
    let envoy = start_envoy(inputs, "envoy-mem", true, max_cached as u64 + 1000)?;
    let body = json_body(16);
    // One cached request first, so the baseline has the VM warm and the policy loaded.
    let (s, t) = post_once(
        envoy.listen,
        CHAT_PATH,
        &[("Authorization", &keys.cached_auth)],
        body.as_bytes(),
    )?;
    if s != 200 {
        bail!("envoy-mem: {s} {t}");
    }
    std::thread::sleep(Duration::from_millis(500));
    let base = mem_of(envoy.pid(), envoy.admin);
    mem_rows.push((1usize, base, 0usize));
    let mut sorted = args.cached_keys.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let mut done = 0usize;
    for n in sorted {
        let t = Instant::now();
        let failed = fill_keys(envoy.listen, &cached[done..n], body.as_bytes(), 16)?;
        done = n;
        std::thread::sleep(Duration::from_millis(500));
        let m = mem_of(envoy.pid(), envoy.admin);
        log(format!(
            "{n} keys cached in {:.1} s ({failed} failed): RSS {} MiB, wasm linear {} MiB, heap {} MiB",
            t.elapsed().as_secs_f64(),
            mib(m.rss_kib as i64),
            mib(m.wasm_linear_kib as i64),
            mib(m.heap_allocated_kib as i64)
        ));
        mem_rows.push((n, m, failed));
    }
    let stats = get_text(envoy.admin, "/stats?filter=wasm").unwrap_or_default();
    std::fs::write(dir.join("envoy-mem-wasm-stats.txt"), stats)?;
    Ok(mem_rows)
}
