//! Issue 31: the performance targets, each a ratio or a difference within this one run.

use crate::issue14::{Checked, margin, median_cpu};
use crate::profile::Profile;
use crate::stats::median;
use crate::wrk::WrkResult;
use std::collections::BTreeMap;
use std::fmt::Write as _;

type Results = BTreeMap<(String, u32), Vec<WrkResult>>;

/// Median (req/s, p50 ms, p99 ms) of `name` at `c`.
fn figures(results: &Results, name: &str, c: u32) -> Option<(f64, f64, f64)> {
    let rs = results.get(&(name.to_string(), c))?;
    let m = |f: fn(&WrkResult) -> f64| median(&rs.iter().map(f).collect::<Vec<_>>());
    Some((m(|r| r.rps), m(|r| r.p50_ms), m(|r| r.p99_ms)))
}

/// What the issue-31 targets are checked against (None: not measured in this run).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Issue31 {
    /// Envoy CPU µs per request (filter-cached, wasm-noop) and where it came from.
    pub(crate) cpu: Option<(f64, f64, &'static str)>,
    /// (filter-cached, envoy) req/s at concurrency 32.
    pub(crate) rps_32: Option<(f64, f64)>,
    /// (filter-cached, envoy) p50 ms at concurrency 1.
    pub(crate) p50_1: Option<(f64, f64)>,
    /// (filter-cached, envoy) p99 ms at concurrency 32.
    pub(crate) p99_32: Option<(f64, f64)>,
    /// At concurrency 32, ms: filter-cached's p99 gap to envoy, and its allowance (wasm-noop's
    /// p99 gap plus filter-cached's p50 gap).
    pub(crate) p99_gap_32: Option<(f64, f64)>,
    /// LiteLLM ran in the same rounds.
    pub(crate) litellm: bool,
}

pub(crate) fn issue31_figures(results: &Results, profiles: &[(&'static str, Profile)]) -> Issue31 {
    let profiled = |name: &str| {
        profiles
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| p.cpu_us_per_request)
    };
    // The profile's table, as the issue measures it; else the rounds' CPU at concurrency 32.
    let cpu = match (profiled("filter-cached"), profiled("wasm-noop")) {
        (Some(f), Some(n)) => Some((f, n, "the profile's table")),
        _ => median_cpu(results, "filter-cached", 32)
            .zip(median_cpu(results, "wasm-noop", 32))
            .map(|(f, n)| (f, n, "the rounds at concurrency 32")),
    };
    let f32 = figures(results, "filter-cached", 32);
    let e32 = figures(results, "envoy", 32);
    let n32 = figures(results, "wasm-noop", 32);
    let f1 = figures(results, "filter-cached", 1);
    let e1 = figures(results, "envoy", 1);
    Issue31 {
        cpu,
        rps_32: f32.zip(e32).map(|(f, e)| (f.0, e.0)),
        p50_1: f1.zip(e1).map(|(f, e)| (f.1, e.1)),
        p99_32: f32.zip(e32).map(|(f, e)| (f.2, e.2)),
        p99_gap_32: match (f32, e32, n32) {
            (Some(f), Some(e), Some(n)) => Some((f.2 - e.2, (n.2 - e.2) + (f.1 - e.1))),
            _ => None,
        },
        litellm: results.keys().any(|(name, _)| name == "litellm"),
    }
}

pub(crate) fn issue31_targets(m: &Issue31) -> Vec<Checked> {
    let unmeasured = |what: &str| Checked {
        what: what.to_string(),
        measured: "not measured in this run".into(),
        by: "—".into(),
        met: None,
    };
    let check = |what: &str, measured: String, (met, by): (bool, String)| Checked {
        what: what.to_string(),
        measured,
        by,
        met: Some(met),
    };
    let ratio = |x: f64| format!("{x:.2}×");
    let mut out = Vec::new();
    let what = "Envoy CPU µs per request, filter-cached − wasm-noop ≤ +30";
    out.push(match m.cpu {
        Some((f, n, from)) => check(
            what,
            format!("{:+.1} µs ({f:.1} vs {n:.1}; {from})", f - n),
            margin(f - n, 30.0, true, &|x| format!("{x:.1} µs")),
        ),
        None => unmeasured(what),
    });
    let what = "filter-cached req/s vs bare Envoy, c=32 ≥ 0.62×";
    out.push(match m.rps_32 {
        Some((f, e)) => check(
            what,
            format!("{:.2}× ({f:.0} vs {e:.0} req/s)", f / e),
            margin(f / e, 0.62, false, &ratio),
        ),
        None => unmeasured(what),
    });
    let what = "filter-cached p50 vs bare Envoy, c=1 ≤ 1.35×";
    out.push(match m.p50_1 {
        Some((f, e)) => check(
            what,
            format!("{:.2}× ({f:.3} vs {e:.3} ms)", f / e),
            margin(f / e, 1.35, true, &ratio),
        ),
        None => unmeasured(what),
    });
    let what = "filter-cached p99 vs bare Envoy, c=32 ≤ 1.40×";
    out.push(match m.p99_32 {
        Some((f, e)) => check(
            what,
            format!("{:.2}× ({f:.3} vs {e:.3} ms)", f / e),
            margin(f / e, 1.40, true, &ratio),
        ),
        None => unmeasured(what),
    });
    let what = "filter-cached's p99 gap to bare Envoy ≤ wasm-noop's p99 gap + filter-cached's p50 gap, c=32";
    out.push(match m.p99_gap_32 {
        Some((gap, allowed)) => check(
            what,
            format!("{gap:+.3} ms (allowed {allowed:+.3} ms)"),
            margin(gap, allowed, true, &|x| format!("{x:.3} ms")),
        ),
        None => unmeasured(what),
    });
    let what = "peers (LiteLLM, Kuadrant) as ratios in the same run, every run";
    out.push(Checked {
        what: what.to_string(),
        measured: format!(
            "LiteLLM {}; Kuadrant not built (see the peers' table)",
            if m.litellm {
                "in this run"
            } else {
                "not in this run (`--peers`)"
            }
        ),
        by: "Kuadrant's parts are not reachable from this machine".into(),
        met: Some(false),
    });
    out
}

/// The issue-31 targets table.
pub(crate) fn render_issue31(m: &Issue31) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## Targets (issue 31)\n");
    let _ = writeln!(o, "| target | measured | by how much | met |");
    let _ = writeln!(o, "|---|---|---|---|");
    for t in issue31_targets(m) {
        let met = match t.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "—",
        };
        let _ = writeln!(o, "| {} | {} | {} | {met} |", t.what, t.measured, t.by);
    }
    o.push('\n');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rps: f64, p50_ms: f64, p99_ms: f64, cpu_us: f64) -> Vec<WrkResult> {
        vec![WrkResult {
            requests: 1000,
            rps,
            p50_ms,
            p99_ms,
            p999_ms: p99_ms,
            errors: 0,
            cpu_us,
            redis_rt_per_s: None,
            lease_batches_per_s: None,
        }]
    }

    #[test]
    fn each_target_is_checked_against_its_bound_within_the_run() {
        let mut results = Results::new();
        results.insert(("envoy".into(), 32), run(10_000.0, 2.0, 4.0, 100.0));
        results.insert(("wasm-noop".into(), 32), run(8_000.0, 2.4, 5.0, 120.0));
        results.insert(("filter-cached".into(), 32), run(6_500.0, 3.0, 6.0, 160.0));
        results.insert(("envoy".into(), 1), run(3_000.0, 0.30, 0.5, 100.0));
        results.insert(("filter-cached".into(), 1), run(2_000.0, 0.42, 0.7, 160.0));
        let m = issue31_figures(&results, &[]);
        assert_eq!(m.cpu, Some((160.0, 120.0, "the rounds at concurrency 32")));
        let out = render_issue31(&m);
        assert!(out.contains("| +40.0 µs (160.0 vs 120.0; the rounds at concurrency 32) | 10.0 µs over | **missed** |"), "{out}");
        assert!(
            out.contains("| 0.65× (6500 vs 10000 req/s) | 0.03× to spare | met |"),
            "{out}"
        );
        assert!(
            out.contains("| 1.40× (0.420 vs 0.300 ms) | 0.05× over | **missed** |"),
            "{out}"
        );
        assert!(
            out.contains("| 1.50× (6.000 vs 4.000 ms) | 0.10× over | **missed** |"),
            "{out}"
        );
        // p99 gap 2.0 ms; allowed (5.0 − 4.0) + (3.0 − 2.0) = 2.0 ms.
        assert!(
            out.contains("| +2.000 ms (allowed +2.000 ms) | 0.000 ms to spare | met |"),
            "{out}"
        );
        assert!(out.contains("LiteLLM not in this run"), "{out}");
        let profiles = [
            (
                "wasm-noop",
                Profile {
                    requests_per_s: 1.0,
                    cpu_us_per_request: 200.0,
                    dsos: vec![],
                },
            ),
            (
                "filter-cached",
                Profile {
                    requests_per_s: 1.0,
                    cpu_us_per_request: 225.0,
                    dsos: vec![],
                },
            ),
        ];
        let m = issue31_figures(&results, &profiles);
        assert!(render_issue31(&m).contains(
            "| +25.0 µs (225.0 vs 200.0; the profile's table) | 5.0 µs to spare | met |"
        ));
    }
}
