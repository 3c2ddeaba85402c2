//! Issue 14: where filter-cached's Envoy CPU goes, and its targets.

use crate::memory::{Mem, mib};
use crate::report::Ttfb;
use crate::stats::median;
use crate::wrk::WrkResult;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Median Envoy CPU µs per request of `name` at `c` (runs with a reading only).
pub(crate) fn median_cpu(
    results: &BTreeMap<(String, u32), Vec<WrkResult>>,
    name: &str,
    c: u32,
) -> Option<f64> {
    let cpu: Vec<f64> = results
        .get(&(name.to_string(), c))?
        .iter()
        .map(|r| r.cpu_us)
        .filter(|&x| x > 0.0)
        .collect();
    (!cpu.is_empty()).then(|| median(&cpu))
}

/// Envoy's CPU µs per request of the variants that split filter-cached's cost, at one
/// concurrency (medians over rounds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CpuSplit {
    pub(crate) c: u32,
    pub(crate) envoy: f64,
    pub(crate) noop: Option<f64>,
    pub(crate) floor: Option<f64>,
    pub(crate) cached: f64,
}

/// What the issue-14 targets are checked against (None: not measured in this run).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Issue14 {
    /// (filter-cached, envoy) req/s at concurrency 32.
    pub(crate) rps_32: Option<(f64, f64)>,
    /// (filter-cached, envoy) p50 ms at concurrency 1.
    pub(crate) p50_1: Option<(f64, f64)>,
    /// At the highest concurrency that ran envoy and filter-cached.
    pub(crate) cpu: Option<CpuSplit>,
    /// First SSE event, (with the filter, bare) ms.
    pub(crate) first_event: Option<(f64, f64)>,
    /// (filter-miss, filter-cached) p50 ms at concurrency 1.
    pub(crate) miss_p50_1: Option<(f64, f64)>,
    /// (cached credentials, cost KiB, limit KiB).
    pub(crate) memory: Option<(usize, i64, i64)>,
}

/// (cached credentials, cost KiB, limit KiB) of the memory rows: the 100000 row (else the last);
/// the cost is the larger of Δ RSS and Δ (wasm + heap), the limit 64 MiB per 100k.
pub(crate) fn credential_memory(mem_rows: &[(usize, Mem, usize)]) -> Option<(usize, i64, i64)> {
    let (_, base, _) = mem_rows.first()?;
    if mem_rows.len() < 2 {
        return None;
    }
    let (n, m, _) = mem_rows
        .iter()
        .find(|(n, ..)| *n == 100_000)
        .or_else(|| mem_rows.last())?;
    let dw = m.wasm_linear_kib as i64 - base.wasm_linear_kib as i64;
    let dh = m.heap_allocated_kib as i64 - base.heap_allocated_kib as i64;
    let dr = m.rss_kib as i64 - base.rss_kib as i64;
    let cost = (dw.max(0) + dh.max(0)).max(dr);
    Some((*n, cost, 64 * 1024 * (*n as i64) / 100_000))
}

pub(crate) fn issue14_figures(
    concurrency: &[u32],
    results: &BTreeMap<(String, u32), Vec<WrkResult>>,
    ttfb: &Ttfb<'_>,
    mem_rows: &[(usize, Mem, usize)],
) -> Issue14 {
    let of = |name: &str, c: u32, f: fn(&WrkResult) -> f64| {
        results
            .get(&(name.to_string(), c))
            .map(|rs| median(&rs.iter().map(f).collect::<Vec<_>>()))
    };
    let pair = |a: &str, b: &str, c: u32, f: fn(&WrkResult) -> f64| of(a, c, f).zip(of(b, c, f));
    let cpu = concurrency
        .iter()
        .copied()
        .filter_map(|c| {
            Some(CpuSplit {
                c,
                envoy: median_cpu(results, "envoy", c)?,
                noop: median_cpu(results, "wasm-noop", c),
                floor: median_cpu(results, "wasm-floor", c),
                cached: median_cpu(results, "filter-cached", c)?,
            })
        })
        .max_by_key(|s| s.c);
    Issue14 {
        rps_32: pair("filter-cached", "envoy", 32, |r| r.rps),
        p50_1: pair("filter-cached", "envoy", 1, |r| r.p50_ms),
        cpu,
        first_event: ttfb
            .get("filter")
            .zip(ttfb.get("envoy"))
            .map(|(f, e)| (f.1, e.1)),
        miss_p50_1: pair("filter-miss", "filter-cached", 1, |r| r.p50_ms),
        memory: credential_memory(mem_rows),
    }
}

/// One checked target: what, measured, by how much, met (None: not measured).
pub(crate) struct Checked {
    pub(crate) what: String,
    pub(crate) measured: String,
    pub(crate) by: String,
    pub(crate) met: Option<bool>,
}

/// `value` against an upper (`at_most`) or lower bound: (met, "<margin> to spare" / "over" /
/// "short"), the margin formatted by `fmt`.
pub(crate) fn margin(
    value: f64,
    bound: f64,
    at_most: bool,
    fmt: &dyn Fn(f64) -> String,
) -> (bool, String) {
    let met = if at_most {
        value <= bound
    } else {
        value >= bound
    };
    let word = match (met, at_most) {
        (true, _) => "to spare",
        (false, true) => "over",
        (false, false) => "short",
    };
    (met, format!("{} {word}", fmt((value - bound).abs())))
}

pub(crate) fn issue14_targets(m: &Issue14) -> Vec<Checked> {
    let unmeasured = |what: String| Checked {
        what,
        measured: "not measured in this run".into(),
        by: "—".into(),
        met: None,
    };
    let check = |what: String, measured: String, (met, by): (bool, String)| Checked {
        what,
        measured,
        by,
        met: Some(met),
    };
    let ratio = |x: f64| format!("{x:.2}×");
    let mut out = Vec::new();
    let what = "filter-cached ≥ 0.90× envoy req/s (concurrency 32)".to_string();
    out.push(match m.rps_32 {
        Some((f, e)) => check(
            what,
            format!("{:.2}× ({f:.0} vs {e:.0} req/s)", f / e),
            margin(f / e, 0.90, false, &ratio),
        ),
        None => unmeasured(what),
    });
    let what = "filter-cached p50 ≤ 1.15× envoy p50 (concurrency 1)".to_string();
    out.push(match m.p50_1 {
        Some((f, e)) => check(
            what,
            format!("{:.2}× ({f:.3} vs {e:.3} ms)", f / e),
            margin(f / e, 1.15, true, &ratio),
        ),
        None => unmeasured(what),
    });
    let what = |c: &str| format!("Envoy CPU per request: filter-cached − wasm-noop ≤ +15 µs{c}");
    out.push(match m.cpu.and_then(|s| Some((s.c, s.cached, s.noop?))) {
        Some((c, f, n)) => check(
            what(&format!(" (concurrency {c})")),
            format!("{:+.1} µs ({f:.1} vs {n:.1} µs)", f - n),
            margin(f - n, 15.0, true, &|x| format!("{x:.1} µs")),
        ),
        None => unmeasured(what("")),
    });
    let what = "filter-stream adds ≤ 0.10 ms to the first SSE event".to_string();
    out.push(match m.first_event {
        Some((f, e)) => check(
            what,
            format!("{:+.3} ms ({f:.3} vs {e:.3} ms)", f - e),
            margin(f - e, 0.10, true, &|x| format!("{x:.3} ms")),
        ),
        None => unmeasured(what),
    });
    let what = "filter-miss p50 ≤ 3× filter-cached p50 (concurrency 1)".to_string();
    out.push(match m.miss_p50_1 {
        Some((miss, f)) => check(
            what,
            format!("{:.2}× ({miss:.3} vs {f:.3} ms)", miss / f),
            margin(miss / f, 3.0, true, &ratio),
        ),
        None => unmeasured(what),
    });
    out.push(match m.memory {
        Some((n, cost, limit)) => check(
            format!(
                "{n} cached credentials cost ≤ {} MiB (64 MiB per 100k)",
                mib(limit)
            ),
            format!("{} MiB (max of Δ RSS and Δ wasm + Δ heap)", mib(cost)),
            margin(cost as f64, limit as f64, true, &|x| {
                format!("{} MiB", mib(x as i64))
            }),
        ),
        None => unmeasured("100000 cached credentials cost ≤ 64 MiB".into()),
    });
    out
}

/// The issue-14 targets table, then where filter-cached's Envoy CPU goes (the why);
/// `cached_bill`: the priced bill of a cached JSON request's host calls, µs; `jit_share`: the
/// share of Envoy's perf samples in V8's generated code during filter-cached, %.
pub(crate) fn render_issue14(
    m: &Issue14,
    cached_bill: Option<f64>,
    jit_share: Option<f64>,
) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## Targets (issue 14)\n");
    let _ = writeln!(o, "| target | measured | by how much | met |");
    let _ = writeln!(o, "|---|---|---|---|");
    for t in issue14_targets(m) {
        let met = match t.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "—",
        };
        let _ = writeln!(o, "| {} | {} | {} | {met} |", t.what, t.measured, t.by);
    }
    let Some(s) = m.cpu else {
        let _ = writeln!(
            o,
            "\nWhere filter-cached's Envoy CPU goes: not measured in this run (needs envoy and filter-cached).\n"
        );
        return o;
    };
    let _ = writeln!(
        o,
        "\nWhy, from where filter-cached's Envoy CPU goes (concurrency {}; Envoy's CPU time per request from `/proc/<pid>/stat`, medians over rounds; the three parts add up to filter-cached − envoy):\n",
        s.c
    );
    let _ = writeln!(
        o,
        "| part | Envoy CPU µs / request | share of filter-cached − envoy |"
    );
    let _ = writeln!(o, "|---|---:|---:|");
    let extra = s.cached - s.envoy;
    let part = |x: Option<f64>| match x {
        Some(x) => (
            format!("{x:+.1}"),
            if extra > 0.0 {
                format!("{:.0}%", 100.0 * x / extra)
            } else {
                "—".into()
            },
        ),
        None => ("not measured".into(), "—".into()),
    };
    let _ = writeln!(o, "| bare Envoy (`envoy`) | {:.1} | — |", s.envoy);
    for (what, x) in [
        (
            "any wasm filter (`wasm-noop` − `envoy`)",
            s.noop.map(|n| n - s.envoy),
        ),
        (
            "the host calls a cached JSON request of the filter makes, and its request body buffered (`wasm-floor` − `wasm-noop`)",
            s.floor.zip(s.noop).map(|(f, n)| f - n),
        ),
        (
            "the filter's own work in the VM around those calls (`filter-cached` − `wasm-floor`)",
            s.floor.map(|f| s.cached - f),
        ),
    ] {
        let (us, share) = part(x);
        let _ = writeln!(o, "| {what} | {us} | {share} |");
    }
    let _ = writeln!(o, "| `filter-cached` | {:.1} | 100% |", s.cached);
    let mut notes = Vec::new();
    if let Some(b) = cached_bill {
        notes.push(format!(
            "the priced bill of a cached JSON request's host calls (next section) is {b:.1} µs, to compare with `wasm-floor` − `wasm-noop`, which also holds the request body buffering that `wasm-noop` does not do"
        ));
    }
    if let Some(j) = jit_share {
        notes.push(format!(
            "during filter-cached's profile {j:.1}% of Envoy's samples are in V8's generated code (the compiled filter; see the profile)"
        ));
    }
    if !notes.is_empty() {
        let _ = writeln!(o, "\nFor scale: {}.", notes.join("; "));
    }
    o.push('\n');
    o
}

#[cfg(test)]
mod tests;
