//! wrk runs: the variants, their loads, and what one run (or a pair of runs) measured.

use crate::http::get_text;
use crate::log;
use anyhow::{Context, Result};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default)]
pub(crate) struct WrkResult {
    /// Requests answered (all runs together).
    pub(crate) requests: u64,
    pub(crate) rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) p999_ms: f64,
    pub(crate) errors: u64,
    /// Envoy's CPU time (user + system, all threads) per request, µs; 0 when unknown.
    pub(crate) cpu_us: f64,
    /// Two-replica variants: the companions' Redis round trips and lease batches per second
    /// during the run's steady state (all companions together).
    pub(crate) redis_rt_per_s: Option<f64>,
    pub(crate) lease_batches_per_s: Option<f64>,
}

#[derive(Clone)]
pub(crate) enum Load {
    /// post.lua: the same request every time.
    Fixed {
        auth: Option<String>,
        extra_headers: String,
    },
    /// miss.lua: a new key every request.
    Miss,
    /// rotate.lua: the keys of `keys_file` in turn (a handful of subjects, all busy).
    Rotate { keys_file: PathBuf },
}

#[derive(Clone)]
pub(crate) struct Variant {
    pub(crate) name: &'static str,
    /// What its ratios are against.
    pub(crate) baseline: &'static str,
    pub(crate) addr: SocketAddr,
    pub(crate) path: String,
    pub(crate) body_file: PathBuf,
    pub(crate) load: Load,
    /// Concurrencies it runs at (None = all).
    pub(crate) only_c: Option<Vec<u32>>,
    /// The Envoy serving it (0: none of ours), whose CPU per request is measured.
    pub(crate) envoy_pid: u32,
    /// Two gateways at once (`two-replica`): one wrk per gateway, both at the same time.
    pub(crate) pair: Option<Pair>,
}

/// The second gateway of a two-replica variant, and where the companions count Redis calls.
#[derive(Clone)]
pub(crate) struct Pair {
    pub(crate) addr: SocketAddr,
    pub(crate) envoy_pid: u32,
    /// Every companion's metrics listener (`maas_companion_redis_round_trips_total`, …).
    pub(crate) companion_metrics: Vec<SocketAddr>,
}

pub(crate) struct Wrk<'a> {
    pub(crate) lua_dir: &'a Path,
    pub(crate) keys_file: &'a Path,
    pub(crate) keys_total: usize,
    pub(crate) key_offset: usize,
}

impl Wrk<'_> {
    /// wrk (pinned to CPU 1) against `addr` with `v`'s load; `key_start`: where rotate.lua
    /// starts in its keys (each wrk of a pair starts elsewhere).
    pub(crate) fn command(
        &self,
        v: &Variant,
        addr: SocketAddr,
        c: u32,
        seconds: u64,
        key_start: usize,
    ) -> Command {
        let script = match v.load {
            Load::Fixed { .. } => "post.lua",
            Load::Miss => "miss.lua",
            Load::Rotate { .. } => "rotate.lua",
        };
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "1", "wrk", "-t1"])
            .arg(format!("-c{c}"))
            .arg(format!("-d{seconds}s"))
            .args(["--timeout", "10s", "-s"])
            .arg(self.lua_dir.join(script))
            .arg(format!("http://{addr}{}", v.path))
            .env("BENCH_LUA_DIR", self.lua_dir)
            .env("BENCH_BODY_FILE", &v.body_file)
            .stdin(Stdio::null());
        match &v.load {
            Load::Fixed {
                auth,
                extra_headers,
            } => {
                cmd.env("BENCH_AUTH", auth.as_deref().unwrap_or(""));
                cmd.env("BENCH_HEADERS", extra_headers);
            }
            Load::Miss => {
                cmd.env("BENCH_KEYS_FILE", self.keys_file);
                cmd.env("BENCH_KEY_OFFSET", self.key_offset.to_string());
            }
            Load::Rotate { keys_file } => {
                cmd.env("BENCH_KEYS_FILE", keys_file);
                cmd.env("BENCH_KEY_START", key_start.to_string());
            }
        }
        cmd
    }

    pub(crate) fn run(&mut self, v: &Variant, c: u32, seconds: u64) -> Result<WrkResult> {
        if let Some(pair) = &v.pair {
            return self.run_pair(v, pair, c, seconds);
        }
        let mut cmd = self.command(v, v.addr, c, seconds, 0);
        let cpu_before = cpu_ticks(v.envoy_pid);
        let out = cmd
            .output()
            .context("cannot run wrk (taskset -c 1 wrk …)")?;
        let cpu_after = cpu_ticks(v.envoy_pid);
        let run = WrkRun::parse(&out)?;
        if let Load::Miss = v.load {
            // Every key this run may have sent (completed + in flight at the end).
            self.key_offset += run.requests as usize + 2 * c as usize + 8;
            if self.key_offset > self.keys_total {
                log(format!(
                    "warning: filter-miss ran out of fresh keys ({} > {}): raise the pool",
                    self.key_offset, self.keys_total
                ));
            }
        }
        let cpu = match (cpu_before, cpu_after) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        Ok(combine_runs(&[run], cpu))
    }

    /// One wrk per gateway of the pair, at the same time (`c` connections each); the companions'
    /// Redis round trips and lease batches are read after the first quarter of the run (at most
    /// 2 s: leases settle) and shortly before its end — the steady state.
    pub(crate) fn run_pair(
        &mut self,
        v: &Variant,
        pair: &Pair,
        c: u32,
        seconds: u64,
    ) -> Result<WrkResult> {
        let pids = [v.envoy_pid, pair.envoy_pid];
        let cpu_before = pids.map(cpu_ticks);
        let t0 = Instant::now();
        let mut children = Vec::with_capacity(2);
        for (i, addr) in [v.addr, pair.addr].into_iter().enumerate() {
            let child = self
                .command(v, addr, c, seconds, i)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("cannot run wrk (taskset -c 1 wrk …)")?;
            children.push(child);
        }
        let (from, to) = steady_window(seconds);
        std::thread::sleep(from.saturating_sub(t0.elapsed()));
        let first = lease_counters(&pair.companion_metrics);
        let t_first = Instant::now();
        std::thread::sleep(to.saturating_sub(t0.elapsed()));
        let last = lease_counters(&pair.companion_metrics);
        let steady_s = t_first.elapsed().as_secs_f64();
        let mut runs = Vec::with_capacity(2);
        for child in children {
            runs.push(WrkRun::parse(&child.wait_with_output()?)?);
        }
        let cpu_after = pids.map(cpu_ticks);
        let cpu = match (cpu_before, cpu_after) {
            ([Some(a0), Some(a1)], [Some(b0), Some(b1)]) => {
                Some(b0.saturating_sub(a0) + b1.saturating_sub(a1))
            }
            _ => None,
        };
        let mut r = combine_runs(&runs, cpu);
        let (first, last) = (first?, last?);
        r.redis_rt_per_s = Some((last.0 - first.0) / steady_s.max(1e-3));
        r.lease_batches_per_s = Some((last.1 - first.1) / steady_s.max(1e-3));
        Ok(r)
    }
}

/// What one wrk printed (its `BENCH {…}` line).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct WrkRun {
    pub(crate) requests: u64,
    pub(crate) duration_us: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) p999_us: f64,
    pub(crate) errors: u64,
}

impl WrkRun {
    pub(crate) fn parse(out: &std::process::Output) -> Result<WrkRun> {
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("BENCH "))
            .with_context(|| {
                format!(
                    "wrk printed no result: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
        let j: Value = serde_json::from_str(line)?;
        let n = |k: &str| j[k].as_f64().unwrap_or(0.0);
        Ok(WrkRun {
            requests: n("requests") as u64,
            duration_us: n("duration_us"),
            p50_us: n("p50_us"),
            p99_us: n("p99_us"),
            p999_us: n("p999_us"),
            errors: (n("connect") + n("read") + n("write") + n("status") + n("timeout")) as u64,
        })
    }
}

/// Runs side by side as one result: req/s summed, p50 = the runs' p50s weighted by their
/// requests, p99 and p99.9 = the highest, errors summed; `cpu_ticks`: the serving Envoys' CPU during them.
pub(crate) fn combine_runs(runs: &[WrkRun], cpu_ticks: Option<u64>) -> WrkResult {
    let requests: u64 = runs.iter().map(|r| r.requests).sum();
    let weight = requests.max(1) as f64;
    let cpu_us = match cpu_ticks {
        Some(t) if requests > 0 => t as f64 * 1e6 / clock_ticks_per_s() / requests as f64,
        _ => 0.0,
    };
    WrkResult {
        requests,
        rps: runs
            .iter()
            .map(|r| r.requests as f64 / (r.duration_us / 1e6).max(1e-9))
            .sum(),
        p50_ms: runs
            .iter()
            .map(|r| r.p50_us * r.requests as f64)
            .sum::<f64>()
            / weight
            / 1000.0,
        p99_ms: runs.iter().map(|r| r.p99_us).fold(0.0, f64::max) / 1000.0,
        p999_ms: runs.iter().map(|r| r.p999_us).fold(0.0, f64::max) / 1000.0,
        errors: runs.iter().map(|r| r.errors).sum(),
        cpu_us,
        redis_rt_per_s: None,
        lease_batches_per_s: None,
    }
}

/// The steady part of a run of `seconds` (from its start): from a quarter in (at most 2 s) to
/// 0.3 s before its end.
pub(crate) fn steady_window(seconds: u64) -> (Duration, Duration) {
    let total = Duration::from_secs(seconds);
    let from = (total / 4).min(Duration::from_secs(2));
    let to = total.saturating_sub(Duration::from_millis(300)).max(from);
    (from, to)
}

/// Redis round trips and lease batches so far, summed over the companions' `/metrics`.
pub(crate) fn lease_counters(metrics: &[SocketAddr]) -> Result<(f64, f64)> {
    let mut sum = (0.0, 0.0);
    for &addr in metrics {
        let text =
            get_text(addr, "/metrics").with_context(|| format!("companion metrics at {addr}"))?;
        sum.0 +=
            metric_value(&text, "maas_companion_redis_round_trips_total").with_context(|| {
                format!("{addr}/metrics has no maas_companion_redis_round_trips_total")
            })?;
        sum.1 += metric_value(&text, "maas_companion_lease_batches_total").unwrap_or(0.0);
    }
    Ok(sum)
}

/// The value of the sample `name` (no labels) in a Prometheus text exposition.
pub(crate) fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let value = rest.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// User + system CPU time of process `pid` (all threads), in clock ticks; None for pid 0 or
/// when unreadable.
pub(crate) fn cpu_ticks(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces), from field 3 on: utime is 14, stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub(crate) fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

#[cfg(test)]
mod tests;
