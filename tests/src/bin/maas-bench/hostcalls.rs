//! Host-call prices (`--only hostcalls`, and in the full run) and the filter's host-call counts.

use crate::envoy::BenchEnvoy;
use crate::http::post_once;
use crate::stats::median;
use crate::streams::json_body;
use crate::wrk::{Load, Variant, Wrk};
use crate::{Args, CHAT_PATH, log};
use anyhow::{Result, bail};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

/// The kinds of host call `tests/bench/hostcall-filter` makes N of per request, and what each is.
pub(crate) const HOST_CALL_KINDS: &[(&str, &str)] = &[
    (
        "none",
        "baseline: the request header map read once, request body buffered",
    ),
    (
        "nobuf",
        "the request header map read once, the body never held (Δ vs `none`: holding the body to its end)",
    ),
    ("clock", "`get_current_time`"),
    (
        "floor",
        "a cached JSON request's host calls, all of them (N ignored; Δ = their whole cost)",
    ),
    (
        "floor_length",
        "`floor` with the request's `content-length` kept (Δ vs `floor`: the chunked upstream body)",
    ),
    (
        "strip",
        "as `wasm-noop` after the one map read: `authorization` removed, the body never held",
    ),
    (
        "floor-edits",
        "`floor` without its request header edits but `authorization`'s removal",
    ),
    (
        "floor-shared",
        "`floor` without the counter slot's shared-data get and CAS set",
    ),
    ("floor-clock", "`floor` without its 3 clock reads"),
    ("floor-reqbody", "`floor` without the request body read"),
    (
        "floor-respmap",
        "`floor` without the response header map read",
    ),
    (
        "floor-ratehdrs",
        "`floor` without the 6 `x-ratelimit-*` response header adds",
    ),
    ("floor-respbody", "`floor` without the response body read"),
    ("shared_get", "shared-data get (160-byte value)"),
    ("shared_set", "shared-data set without CAS (160 bytes)"),
    ("shared_get_cas_set", "shared-data get + CAS set"),
    ("header_get_all", "request headers: `get_map` (all)"),
    ("header_get", "request headers: one value"),
    ("header_set", "request headers: set one"),
    ("header_remove", "request headers: remove one (absent)"),
    (
        "header_set_map",
        "request headers: `set_map` (the whole map)",
    ),
    ("body_read", "request body read (whole buffer)"),
    ("body_write", "request body read + replaced (same bytes)"),
    ("metric_inc", "metric increment"),
    ("property", "property `xds.cluster_name`"),
    ("resp_header_get_all", "response headers: `get_map` (all)"),
    ("resp_header_get", "response headers: one value"),
    ("resp_header_set", "response headers: set one"),
    (
        "resp_header_add",
        "response headers: add one (a new value each time)",
    ),
    (
        "resp_header_remove",
        "response headers: remove one (absent)",
    ),
    (
        "resp_header_set_map",
        "response headers: `set_map` (the whole map)",
    ),
    ("resp_body_read", "response body read (the JSON response)"),
    (
        "resp_body_write",
        "response body read + replaced (same bytes)",
    ),
    (
        "sha256",
        "in the VM: one SHA-256 of 60 bytes (not a host call)",
    ),
    (
        "alloc",
        "in the VM: a 64-byte vector allocated and freed (not a host call)",
    ),
    (
        "json_body",
        "in the VM: the chat body (122 bytes) parsed by serde_json (not a host call)",
    ),
];

/// The filter's host-call kinds (as its budget tests name them) and how each is priced: the
/// hostcall filter's kind, minus another kind when a kind can only be measured with it (a CAS set
/// needs its get, a body write its read). Kinds not here have no price (the report says so).
pub(crate) const PRICED_CALLS: &[(&str, &str, Option<&str>)] = &[
    ("request header map read", "header_get_all", None),
    ("request header read", "header_get", None),
    ("request header set", "header_set", None),
    ("request header remove", "header_remove", None),
    ("response header map read", "resp_header_get_all", None),
    ("response header read", "resp_header_get", None),
    ("response header set", "resp_header_set", None),
    ("response header add", "resp_header_add", None),
    ("response header remove", "resp_header_remove", None),
    ("request body read", "body_read", None),
    ("request body write", "body_write", Some("body_read")),
    ("response body read", "resp_body_read", None),
    (
        "response body write",
        "resp_body_write",
        Some("resp_body_read"),
    ),
    ("clock", "clock", None),
    ("shared get", "shared_get", None),
    ("shared set (CAS)", "shared_get_cas_set", Some("shared_get")),
    ("metric increment", "metric_inc", None),
    ("property", "property", None),
];

/// Measured host-call prices: Envoy's CPU per request for each kind (medians over rounds).
#[derive(Debug, Clone, Default)]
pub(crate) struct Prices {
    /// Calls per request.
    pub(crate) n: u32,
    pub(crate) concurrency: u32,
    pub(crate) seconds: u64,
    pub(crate) rounds: usize,
    /// (kind, req/s, Envoy CPU µs per request), in HOST_CALL_KINDS order.
    pub(crate) rows: Vec<(String, f64, f64)>,
}

impl Prices {
    pub(crate) fn cpu(&self, kind: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|(k, ..)| k == kind)
            .map(|r| r.2)
            .filter(|c| c.is_finite())
    }

    /// µs per call of a hostcall-filter kind: its CPU per request minus that of `minus` (default
    /// `none`), divided by N.
    pub(crate) fn per_call(&self, kind: &str, minus: Option<&str>) -> Option<f64> {
        let base = self.cpu(minus.unwrap_or("none"))?;
        Some((self.cpu(kind)? - base) / f64::from(self.n.max(1)))
    }

    /// µs per call of one of the filter's host-call kinds (PRICED_CALLS); None when unpriced.
    pub(crate) fn of_call(&self, label: &str) -> Option<f64> {
        let (_, kind, minus) = PRICED_CALLS.iter().find(|(l, ..)| *l == label)?;
        self.per_call(kind, *minus)
    }
}

/// The hostcall-filter kinds that price `labels` (with `none`), in HOST_CALL_KINDS order.
pub(crate) fn kinds_pricing<'a>(labels: impl IntoIterator<Item = &'a str>) -> Vec<&'static str> {
    // `nobuf`: what holding a request body to its end costs (the filter no longer does when
    // the body has its content-length).
    let mut want = vec!["none", "nobuf"];
    for label in labels {
        if let Some((_, kind, minus)) = PRICED_CALLS.iter().find(|(l, ..)| *l == label) {
            want.push(kind);
            want.extend(*minus);
        }
    }
    HOST_CALL_KINDS
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| want.contains(k))
        .collect()
}

/// The kinds to price: BENCH_HOSTCALL_KINDS (a subset, comma separated; `none` is always
/// measured), every kind with `--only hostcalls`, else only the kinds that price the filter's
/// calls (all of them when the counts are missing).
pub(crate) fn price_kinds(
    hostcalls_only: bool,
    counts: &Result<HostCallCounts, String>,
) -> Vec<&'static str> {
    let wanted: Vec<String> = std::env::var("BENCH_HOSTCALL_KINDS")
        .unwrap_or_default()
        .split(',')
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .collect();
    if !wanted.is_empty() || hostcalls_only {
        HOST_CALL_KINDS
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| wanted.is_empty() || *k == "none" || wanted.iter().any(|w| w == k))
            .collect()
    } else {
        // The full run: only the kinds that price the filter's calls (all of them when the
        // counts are missing).
        match counts {
            Ok(c) => kinds_pricing(
                c.calls
                    .iter()
                    .flat_map(|v| v.by_kind.keys().map(String::as_str)),
            ),
            Err(_) => kinds_pricing(PRICED_CALLS.iter().map(|(l, ..)| *l)),
        }
    }
}

/// [`host_call_prices`], saying how long it took.
pub(crate) fn measure_prices(
    args: &Args,
    envoy: &BenchEnvoy,
    kinds: &[&'static str],
    lua_dir: &Path,
    dir: &Path,
) -> Result<Prices> {
    let t = Instant::now();
    let prices = host_call_prices(args, envoy, kinds, lua_dir, dir)?;
    log(format!(
        "host-call prices took {:.0} s",
        t.elapsed().as_secs_f64()
    ));
    Ok(prices)
}

/// Envoy's CPU per request with N host calls of each of `kinds` (the hostcall filter, chosen per
/// request by `x-bench-kind` / `x-bench-n`), medians over rounds; `kinds` must hold `none`.
pub(crate) fn host_call_prices(
    args: &Args,
    envoy: &BenchEnvoy,
    kinds: &[&'static str],
    lua_dir: &Path,
    dir: &Path,
) -> Result<Prices> {
    let n: u32 = std::env::var("BENCH_HOSTCALL_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
        .max(1);
    let c = args.concurrency.iter().copied().max().unwrap_or(32);
    let seconds = args.hostcall_seconds.unwrap_or(args.seconds.min(4)).max(1);
    let body = dir.join("chat.json");
    std::fs::write(&body, json_body(16))?;
    let variants: Vec<Variant> = kinds
        .iter()
        .map(|kind| Variant {
            name: kind,
            baseline: "none",
            addr: envoy.listen,
            path: CHAT_PATH.into(),
            body_file: body.clone(),
            load: Load::Fixed {
                auth: None,
                extra_headers: format!("x-bench-kind: {kind}|x-bench-n: {n}"),
            },
            only_c: None,
            envoy_pid: envoy.pid(),
            pair: None,
        })
        .collect();
    let keys = dir.join("no-keys.txt");
    std::fs::write(&keys, "")?;
    let mut wrk = Wrk {
        lua_dir,
        keys_file: &keys,
        keys_total: 0,
        key_offset: 0,
    };
    let (status, text) = post_once(
        envoy.listen,
        CHAT_PATH,
        &[("x-bench-kind", "shared_get"), ("x-bench-n", "1")],
        &std::fs::read(&body)?,
    )?;
    if status != 200 {
        bail!("hostcall filter: POST {CHAT_PATH} → {status}: {text}");
    }
    log(format!(
        "host-call prices: {} kinds, {n} calls per request, c={c}, {} rounds × {seconds} s, warming up …",
        kinds.len(),
        args.rounds
    ));
    for v in &variants {
        wrk.run(v, 8, 1)?;
    }
    let mut cpu: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut rps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 1..=args.rounds {
        for v in &variants {
            let r = wrk.run(v, c, seconds)?;
            if r.errors > 0 || r.cpu_us <= 0.0 {
                bail!("{}: {} errors, cpu {:.1} µs", v.name, r.errors, r.cpu_us);
            }
            log(format!(
                "round {round}/{} {:<22} {:>8.0} req/s  Envoy CPU {:>7.1} µs/req",
                args.rounds, v.name, r.rps, r.cpu_us
            ));
            cpu.entry(v.name).or_default().push(r.cpu_us);
            rps.entry(v.name).or_default().push(r.rps);
        }
    }
    let med = |m: &BTreeMap<&str, Vec<f64>>, k: &str| m.get(k).map_or(f64::NAN, |v| median(v));
    Ok(Prices {
        n,
        concurrency: c,
        seconds,
        rounds: args.rounds,
        rows: kinds
            .iter()
            .map(|k| (k.to_string(), med(&rps, k), med(&cpu, k)))
            .collect(),
    })
}

/// The price table: one row per measured kind.
pub(crate) fn render_prices(p: &Prices) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Prices in this Envoy build: `tests/bench/hostcall-filter` makes N = {} calls of one kind per request (`x-bench-kind`); Envoy's CPU time per request (user + system from `/proc/<pid>/stat`, all threads: it does not depend on how much CPU Envoy got) minus that of kind `none`, ÷ N. Envoy one worker on CPU 0, wrk c = {} on CPU 1, {} rounds × {} s per kind, medians over rounds. All kinds: `./scripts/bench.sh --only hostcalls` (`BENCH_HOSTCALL_KINDS` picks a subset).\n",
        p.n, p.concurrency, p.rounds, p.seconds
    );
    let _ = writeln!(
        out,
        "| kind | what | req/s | Envoy CPU µs / request | Δ vs none µs | µs per call |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|");
    let base = p.cpu("none").unwrap_or(f64::NAN);
    for (kind, rps, cpu) in &p.rows {
        let what = HOST_CALL_KINDS
            .iter()
            .find(|(k, _)| k == kind)
            .map_or("", |(_, w)| *w);
        let per_call = match p.per_call(kind, None) {
            // Whole-request kinds: their Δ is the figure, not a per-call price.
            Some(x)
                if !matches!(kind.as_str(), "none" | "nobuf" | "strip")
                    && !kind.starts_with("floor") =>
            {
                format!("{x:.2}")
            }
            _ => "—".into(),
        };
        let _ = writeln!(
            out,
            "| `{kind}` | {what} | {rps:.0} | {cpu:.1} | {:+.1} | {per_call} |",
            cpu - base
        );
    }
    let derived: Vec<String> = [
        ("CAS set", "shared_get_cas_set", "shared_get"),
        ("request body write", "body_write", "body_read"),
        ("response body write", "resp_body_write", "resp_body_read"),
    ]
    .iter()
    .filter_map(|(what, a, b)| {
        let x = p.per_call(a, Some(b))?;
        Some(format!("{what} alone ≈ {x:.2} µs (`{a}` − `{b}`)"))
    })
    .collect();
    if !derived.is_empty() {
        let _ = writeln!(out, "\nDerived: {}.", derived.join("; "));
    }
    out
}

/// One variant of the filter's recording-host measurement (`MAAS_HOST_CALLS_OUT`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct CallCounts {
    pub(crate) variant: String,
    pub(crate) total: u64,
    pub(crate) by_kind: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct AllocCounts {
    pub(crate) variant: String,
    pub(crate) count: u64,
    pub(crate) bytes: u64,
    pub(crate) per_callback: Vec<u64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct HostCallCounts {
    pub(crate) calls: Vec<CallCounts>,
    pub(crate) allocations: Vec<AllocCounts>,
}

/// The file the filter's budget tests wrote; Err says why there is none.
pub(crate) fn read_host_call_counts(path: Option<&Path>) -> Result<HostCallCounts, String> {
    let path = path.ok_or("no file given (BENCH_HOST_CALLS; `./scripts/bench.sh` sets it)")?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_host_call_counts(&text).map_err(|e| format!("{}: {e}", path.display()))
}

pub(crate) fn parse_host_call_counts(text: &str) -> Result<HostCallCounts, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let num = |v: &Value, k: &str| {
        v.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("`{k}` missing"))
    };
    let name = |v: &Value| {
        v.get("variant")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or("`variant` missing".to_string())
    };
    let list = |k: &str| {
        v.get(k)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let mut out = HostCallCounts::default();
    for c in list("host_calls") {
        let mut by_kind = BTreeMap::new();
        for (k, n) in c
            .get("by_kind")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            by_kind.insert(k.clone(), n.as_u64().ok_or(format!("`{k}` not a count"))?);
        }
        out.calls.push(CallCounts {
            variant: name(&c)?,
            total: num(&c, "total")?,
            by_kind,
        });
    }
    for a in list("allocations") {
        out.allocations.push(AllocCounts {
            variant: name(&a)?,
            count: num(&a, "count")?,
            bytes: num(&a, "bytes")?,
            per_callback: a
                .get("per_callback")
                .and_then(Value::as_array)
                .map(|l| l.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default(),
        });
    }
    if out.calls.is_empty() {
        return Err("no `host_calls` figures".into());
    }
    Ok(out)
}

/// The priced bill of one variant's calls: (µs, calls without a price).
pub(crate) fn bill(counts: &CallCounts, prices: &Prices) -> (f64, u64) {
    counts
        .by_kind
        .iter()
        .fold((0.0, 0), |(us, unpriced), (label, &n)| {
            match prices.of_call(label) {
                Some(p) => (us + p * n as f64, unpriced),
                None => (us, unpriced + n),
            }
        })
}

/// The host-call section: counts per request by kind (variants as columns), each kind's price
/// and each variant's priced bill, allocations; then the price table.
pub(crate) fn render_host_calls(
    counts: &Result<HostCallCounts, String>,
    prices: Option<&Prices>,
) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## Host calls per request (issue 14)\n");
    let counts = match counts {
        Ok(c) => c,
        Err(why) => {
            let _ = writeln!(
                o,
                "No host-call counts in this run ({why}): they come from `cargo test -p maas-filter --lib per_request_stay_within_budget` with `MAAS_HOST_CALLS_OUT=<file>`, which `./scripts/bench.sh` runs.\n"
            );
            if let Some(p) = prices {
                o.push_str(&render_prices(p));
                o.push('\n');
            }
            return o;
        }
    };
    let _ = writeln!(
        o,
        "Counts from the filter's recording host (`cargo test -p maas-filter --lib per_request_stay_within_budget`, run by `./scripts/bench.sh` for this report; the tests assert them): a cached JSON chat request from its headers to its settlement, the same for a subject the worker admits often (its refund folded into its next admission's counter write: the benchmark's filter-cached), a cached stream of three chunks (`include_usage` added, usage event stripped), a JSON request whose credential no cache holds (on a fresh worker), and a cached JSON request that is its credential's first on the worker. µs per call: the price table below{}.\n",
        if prices.is_some() {
            ", measured in this run"
        } else {
            " (not measured in this run: no price, no bill)"
        }
    );
    render_count_table(&mut o, counts, prices);
    render_allocations(&mut o, counts);
    o.push('\n');
    if let Some(p) = prices {
        o.push_str(&render_prices(p));
        o.push('\n');
    }
    o
}

/// One row per kind (priced kinds first), the totals, and each variant's priced bill.
fn render_count_table(o: &mut String, counts: &HostCallCounts, prices: Option<&Prices>) {
    let mut labels: Vec<&str> = Vec::new();
    for (l, ..) in PRICED_CALLS {
        if counts.calls.iter().any(|c| c.by_kind.contains_key(*l)) {
            labels.push(l);
        }
    }
    for c in &counts.calls {
        for l in c.by_kind.keys() {
            if !labels.contains(&l.as_str()) {
                labels.push(l);
            }
        }
    }
    let header: Vec<&str> = counts.calls.iter().map(|c| c.variant.as_str()).collect();
    let _ = writeln!(o, "| kind | µs per call | {} |", header.join(" | "));
    let _ = writeln!(o, "|---|---:|{}", "---:|".repeat(header.len()));
    for l in &labels {
        let price = prices
            .and_then(|p| p.of_call(l))
            .map_or("—".to_string(), |p| format!("{p:.2}"));
        let cells: Vec<String> = counts
            .calls
            .iter()
            .map(|c| c.by_kind.get(*l).copied().unwrap_or(0).to_string())
            .collect();
        let _ = writeln!(o, "| {l} | {price} | {} |", cells.join(" | "));
    }
    let totals: Vec<String> = counts
        .calls
        .iter()
        .map(|c| format!("**{}**", c.total))
        .collect();
    let _ = writeln!(o, "| **total** | | {} |", totals.join(" | "));
    if let Some(p) = prices {
        let bills: Vec<String> = counts
            .calls
            .iter()
            .map(|c| match bill(c, p) {
                (us, 0) => format!("{us:.1}"),
                (us, k) => format!("{us:.1} + {k} unpriced"),
            })
            .collect();
        let _ = writeln!(
            o,
            "| priced bill µs (Σ count × price) | | {} |",
            bills.join(" | ")
        );
    }
}

/// The VM's heap allocations per variant, in all and per callback.
fn render_allocations(o: &mut String, counts: &HostCallCounts) {
    let alloc = |f: &dyn Fn(&AllocCounts) -> String| -> Vec<String> {
        counts
            .calls
            .iter()
            .map(|c| {
                counts
                    .allocations
                    .iter()
                    .find(|a| a.variant == c.variant)
                    .map_or("—".to_string(), f)
            })
            .collect()
    };
    if !counts.allocations.is_empty() {
        let _ = writeln!(
            o,
            "| heap allocations in the VM (count / bytes) | | {} |",
            alloc(&|a| format!("{} / {}", a.count, a.bytes)).join(" | ")
        );
        let _ = writeln!(
            o,
            "| allocations per callback (request headers, request body, response headers, response body chunks…, log + done) | | {} |",
            alloc(&|a| format!("{:?}", a.per_callback)).join(" | ")
        );
    }
}

#[cfg(test)]
mod tests;
