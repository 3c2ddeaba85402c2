//! Where Envoy's CPU goes: `perf record` during a run.

use crate::wrk::{Variant, Wrk};
use crate::{Args, log};
use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

pub(crate) struct Profile {
    pub(crate) requests_per_s: f64,
    /// Envoy CPU time per request, µs.
    pub(crate) cpu_us_per_request: f64,
    /// (dso, share %) sorted by share.
    pub(crate) dsos: Vec<(String, f64)>,
}

pub(crate) const PERF_HZ: u64 = 2000;

/// Runs `v` under wrk while `perf record` samples Envoy's CPU clock.
pub(crate) fn profile_run(
    wrk: &mut Wrk<'_>,
    v: &Variant,
    c: u32,
    seconds: u64,
    pid: u32,
    dir: &Path,
) -> Result<Profile> {
    let data = dir.join(format!("perf-{}.data", v.name));
    let mut perf = Command::new("perf")
        .args([
            "record",
            "-e",
            "cpu-clock",
            "-F",
            &PERF_HZ.to_string(),
            "-p",
            &pid.to_string(),
            "-o",
        ])
        .arg(&data)
        .args(["--", "sleep", &seconds.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot run perf (apt-get install linux-perf)")?;
    let r = wrk.run(v, c, seconds)?;
    let status = perf.wait()?;
    if !status.success() {
        bail!("perf record failed ({status})");
    }
    let out = Command::new("perf")
        .args(["report", "--stdio", "-q", "--sort", "dso", "-i"])
        .arg(&data)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut dsos: Vec<(String, f64)> = text
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let pct = it.next()?.trim_end_matches('%').parse::<f64>().ok()?;
            Some((it.collect::<Vec<_>>().join(" "), pct))
        })
        .collect();
    dsos.truncate(6);
    let count = Command::new("perf")
        .args([
            "report", "--stdio", "-q", "--sort", "pid", "-F", "sample", "-i",
        ])
        .arg(&data)
        .output()?;
    let samples: f64 = String::from_utf8_lossy(&count.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .sum();
    let requests = r.rps * seconds as f64;
    Ok(Profile {
        requests_per_s: r.rps,
        cpu_us_per_request: samples / PERF_HZ as f64 * 1e6 / requests.max(1.0),
        dsos,
    })
}

/// Profiles of the `targets` (variant name, its Envoy's pid) whose variant runs, at the highest
/// concurrency, unless `--no-profile` or `perf record` does not work here.
pub(crate) fn profiles(
    args: &Args,
    variants: &[Variant],
    wrk: &mut Wrk<'_>,
    targets: &[(&'static str, u32)],
    dir: &Path,
) -> Vec<(&'static str, Profile)> {
    let mut profiles = Vec::new();
    let perf_works = Command::new("perf")
        .args([
            "record",
            "-q",
            "-e",
            "cpu-clock",
            "-o",
            "/dev/null",
            "--",
            "true",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !args.no_profile && !perf_works {
        log("perf record does not work here: no profile");
    }
    if !args.no_profile && perf_works {
        let c = args.concurrency.iter().copied().max().unwrap_or(32);
        for &(vname, pid) in targets {
            let Some(v) = variants.iter().find(|v| v.name == vname) else {
                continue;
            };
            log(format!(
                "profiling {vname} at c={c} (perf record -e cpu-clock) …"
            ));
            match profile_run(wrk, v, c, args.seconds, pid, dir) {
                Ok(p) => profiles.push((vname, p)),
                Err(e) => log(format!("profile of {vname} failed: {e:#}")),
            }
        }
    }
    profiles
}

/// The profile section: per profiled variant, req/s, Envoy's CPU per request and where it goes.
pub(crate) fn render_profiles(profiles: &[(&'static str, Profile)], seconds: u64) -> String {
    let mut report = String::new();
    let _ = writeln!(
        report,
        "\n## Profile: Envoy's CPU per request (perf record -e cpu-clock -F {PERF_HZ}, one {seconds} s run each)\n",
    );
    let _ = writeln!(
        report,
        "| variant | req/s | Envoy CPU µs / request | where (share of Envoy's samples) |"
    );
    let _ = writeln!(report, "|---|---:|---:|---|");
    for (name, p) in profiles {
        let wh = p
            .dsos
            .iter()
            .map(|(d, s)| format!("{d} {s:.1}%"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            report,
            "| {name} | {:.0} | {:.1} | {wh} |",
            p.requests_per_s, p.cpu_us_per_request
        );
    }
    let _ = writeln!(
        report,
        "\n`[unknown]` / `[JIT] tid …` is code V8 generated (the compiled filter); `envoy` includes V8's runtime and the proxy-wasm host calls (the binary is stripped, so no finer symbols)."
    );
    report
}
