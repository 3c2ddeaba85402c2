//! The two-replica section: global limits across two gateway replicas.

use crate::envoy::BenchEnvoy;
use crate::http::get_text;
use crate::stats::{median, min_max};
use crate::wrk::{WrkResult, steady_window};
use crate::{Args, TWO_REPLICA_HEADING, TWO_REPLICA_REPLICAS, TWO_REPLICA_SUBJECTS};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;

/// `name: value` lines of Envoy's admin `/stats` (the `wasmcustom.` prefix dropped).
pub(crate) fn envoy_stats(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            let name = name.trim();
            let name = name.strip_prefix("wasmcustom.").unwrap_or(name);
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

pub(crate) fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The two-replica section: on vs off per concurrency, and the Redis round trips per subject per
/// replica per second against the target.
pub(crate) fn render_two_replica(
    args: &Args,
    results: &BTreeMap<(String, u32), Vec<WrkResult>>,
    lease_stats: &BTreeMap<(&str, String), f64>,
) -> String {
    let mut o = String::new();
    render_intro(&mut o, args);
    let (on_rates, on_off) = render_rows(&mut o, args, results);
    let stat = |name: &str| {
        lease_stats
            .get(&("two-replica-on", name.to_string()))
            .copied()
            .unwrap_or(0.0)
    };
    let _ = writeln!(
        o,
        "\nThe on Envoys over the whole benchmark, warm-up included (admin `/stats`): {:.0} lease calls (`maas_lease_callouts_total`: requests that waited for a lease and the workers' periodic batches), fallback entered {:.0} times (`maas_lease_fallback_entered_total`; 0 = every call was answered).\n",
        stat("maas_lease_callouts_total"),
        stat("maas_lease_fallback_entered_total")
    );
    let _ = writeln!(o, "| target (issue 13) | measured | met |");
    let _ = writeln!(o, "|---|---|---|");
    if !on_rates.is_empty() {
        let measured = on_rates
            .iter()
            .map(|(c, rps, per)| format!("{per:.3} at {rps:.0} req/s (c = {c} per gateway)"))
            .collect::<Vec<_>>()
            .join("; ");
        let met = on_rates
            .iter()
            .all(|(_, _, per)| per.is_finite() && *per <= 1.0);
        let _ = writeln!(
            o,
            "| ≤ 1 Redis round trip per subject per replica per second with global limits on, independent of the request rate | {measured} | {} |",
            if met { "met" } else { "**missed**" }
        );
    }
    for (c, rps, p50) in &on_off {
        let _ = writeln!(
            o,
            "| global limits cost no callout per request: on ≈ off (c = {c} per gateway) | {rps:.2}× req/s, {p50:.2}× p50 | — |"
        );
    }
    o
}

/// The heading and what was run and measured, how.
fn render_intro(o: &mut String, args: &Args) {
    let (s, r) = (TWO_REPLICA_SUBJECTS, TWO_REPLICA_REPLICAS);
    let (from, to) = steady_window(args.seconds);
    let _ = writeln!(o, "{TWO_REPLICA_HEADING}\n");
    let _ = writeln!(
        o,
        "Two Envoys with the filter (one worker each, both pinned to CPU 0), each talking to its own companion; the two companions share one Redis (`MAAS_REDIS_URL`); PostgreSQL and the simulator are the stack's. One wrk per gateway at the same time (`c` connections each, both on CPU 1); every request carries the next of {s} API keys of {s} users (`tests/bench/rotate.lua`), so all {s} subjects are busy at both replicas. **on** = global limits with the defaults (`limits.global`: one lease batch per worker every `reportIntervalMs` = 1000 ms, leases sized for `leaseHorizonMs` = 2000 ms); **off** = `limits.global.enabled: false` (each replica counts alone). The tier's limits are the benchmark's (never tripping). off and on alternate within each round; {} rounds × {} s per run, medians over rounds{}. Command: `{}` ({}).\n",
        args.rounds,
        args.seconds,
        if args.two_replica_idle_s > 0 {
            format!(
                "; each run follows {} s with no traffic on the gateways (`BENCH_TWO_REPLICA_IDLE_S`: leases released, subjects dropped for idleness)",
                args.two_replica_idle_s
            )
        } else if args.only.is_empty() {
            "; each run follows the other variants' runs (tens of seconds with no traffic on these gateways: leases released, subjects dropped for idleness)".to_string()
        } else {
            String::new()
        },
        args.command,
        utc_now()
    );
    let _ = writeln!(
        o,
        "Redis round trips = Δ of the companions' `maas_companion_redis_round_trips_total` (summed) from {:.1} s to {:.1} s into each run (the steady state) ÷ that time; per subject per replica = ÷ ({s} subjects × {r} replicas). It counts every call to Redis (lease batches and the companions' own calls); the off rows show the floor: the companions' own calls and the on Envoys' releases of their idle leases after their run. Lease batches = the companions' `maas_companion_lease_batches_total`, the same way. req/s is both gateways together; p50 = the two gateways' p50s weighted by their requests, p99 = the higher.\n",
        from.as_secs_f64(),
        to.as_secs_f64()
    );
}

/// The table (off and on per concurrency); returns the on rows' (concurrency, req/s, round
/// trips per subject per replica per second) and the on ÷ off ratios (req/s, p50).
#[allow(clippy::type_complexity)]
fn render_rows(
    o: &mut String,
    args: &Args,
    results: &BTreeMap<(String, u32), Vec<WrkResult>>,
) -> (Vec<(u32, f64, f64)>, Vec<(u32, f64, f64)>) {
    let (s, r) = (TWO_REPLICA_SUBJECTS, TWO_REPLICA_REPLICAS);
    let _ = writeln!(
        o,
        "| conc. per gateway | global limits | req/s (both gateways) | spread | p50 ms | p99 ms | req/s on ÷ off | p50 on ÷ off | Redis round trips / s | per subject per replica per s | lease batches / s | errors |"
    );
    let _ = writeln!(
        o,
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let of = |rs: &[WrkResult], f: &dyn Fn(&WrkResult) -> Option<f64>| {
        median(&rs.iter().filter_map(f).collect::<Vec<_>>())
    };
    // (concurrency, req/s, round trips per subject per replica per second) of the on rows.
    let mut on_rates: Vec<(u32, f64, f64)> = Vec::new();
    let mut on_off: Vec<(u32, f64, f64)> = Vec::new();
    for &c in &args.concurrency {
        let off = results.get(&("two-replica-off".to_string(), c));
        for (name, label) in [("two-replica-off", "off"), ("two-replica-on", "on")] {
            let Some(rs) = results.get(&(name.to_string(), c)) else {
                continue;
            };
            let rps = of(rs, &|x| Some(x.rps));
            let (lo, hi) = min_max(&rs.iter().map(|x| x.rps).collect::<Vec<_>>());
            let p50 = of(rs, &|x| Some(x.p50_ms));
            let p99 = of(rs, &|x| Some(x.p99_ms));
            let rt = of(rs, &|x| x.redis_rt_per_s);
            let batches = of(rs, &|x| x.lease_batches_per_s);
            let per = rt / (s * r) as f64;
            let errors: u64 = rs.iter().map(|x| x.errors).sum();
            let (ratio_rps, ratio_p50) = match off {
                Some(off) if label == "on" => {
                    let (orps, op50) = (of(off, &|x| Some(x.rps)), of(off, &|x| Some(x.p50_ms)));
                    on_off.push((c, rps / orps, p50 / op50));
                    (format!("{:.2}×", rps / orps), format!("{:.2}×", p50 / op50))
                }
                _ => ("—".into(), "—".into()),
            };
            if label == "on" {
                on_rates.push((c, rps, per));
            }
            let _ = writeln!(
                o,
                "| {c} | {label} | {rps:.0} | {lo:.0}–{hi:.0} | {p50:.3} | {p99:.3} | {ratio_rps} | {ratio_p50} | {rt:.2} | {per:.3} | {batches:.2} | {errors} |"
            );
        }
    }
    (on_rates, on_off)
}

/// `old` (the results file) with its two-replica section replaced by `section` — or, when it has
/// none, `section` inserted before "## How to run" (else appended). Nothing else changes.
pub(crate) fn splice_section(old: &str, section: &str) -> String {
    let section = format!("{}\n\n", section.trim_end_matches('\n'));
    let at_line_start = |heading: &str| {
        old.match_indices(heading)
            .map(|(i, _)| i)
            .find(|&i| i == 0 || old.get(..i).is_some_and(|b| b.ends_with('\n')))
    };
    if let Some(start) = at_line_start(TWO_REPLICA_HEADING) {
        let head = old.get(..start).unwrap_or_default();
        let after = start + TWO_REPLICA_HEADING.len();
        return match old.get(after..).and_then(|rest| rest.find("\n## ")) {
            // The next section's heading, after the blank line that ends this one.
            Some(i) => format!(
                "{head}{section}{}",
                old.get(after + i + 1..).unwrap_or_default()
            ),
            None => format!("{head}{}\n", section.trim_end_matches('\n')),
        };
    }
    if let Some(at) = at_line_start("## How to run") {
        let (head, tail) = old.split_at(at);
        return format!("{head}{section}{tail}");
    }
    let sep = if old.is_empty() || old.ends_with("\n\n") {
        ""
    } else if old.ends_with('\n') {
        "\n"
    } else {
        "\n\n"
    };
    format!("{old}{sep}{}\n", section.trim_end_matches('\n'))
}

/// The two-replica Envoys' lease counters, summed per variant (global limits on: how often
/// they called, whether they ever fell back to their local share); then they stop.
pub(crate) fn lease_stats(
    envoys: Vec<(&'static str, Vec<BenchEnvoy>)>,
) -> BTreeMap<(&'static str, String), f64> {
    let mut lease_stats = BTreeMap::new();
    for (name, pair) in &envoys {
        for e in pair {
            let stats = get_text(e.admin, "/stats?filter=maas_lease").unwrap_or_default();
            for (k, v) in envoy_stats(&stats) {
                *lease_stats.entry((*name, k)).or_insert(0.0) += v;
            }
        }
    }
    drop(envoys);
    lease_stats
}

#[cfg(test)]
mod tests;
