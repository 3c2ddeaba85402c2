//! Instructions per request: Envoy's under valgrind's callgrind, and the filter's own (counted
//! by `./scripts/bench.sh`).

use crate::envoy::{EnvoyInputs, start_envoy_run};
use crate::variants::Bodies;
use crate::wrk::{Load, Variant, Wrk};
use crate::{Args, CHAT_PATH, log};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One Envoy build's instructions per request (valgrind callgrind).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EnvoyInstructionRow {
    pub(crate) variant: String,
    /// Instructions per request, Envoy's idle work (timers, the filter's ticks) subtracted.
    pub(crate) per_request: f64,
    pub(crate) requests: u64,
    /// Instructions per second while idle (subtracted above for the run's length).
    pub(crate) idle_per_s: f64,
}

/// Every build of `builds` (variant name, module, whether it is the MaaS filter) in an Envoy
/// under valgrind's callgrind, all started at once (each takes minutes to compile its module
/// there); then, one at a time: warmed up, its idle rate counted, and one wrk connection for
/// `seconds` counted between a zero and a dump of callgrind's counters. Instructions are
/// every thread's, user space only: Envoy, V8 (its compiled filter included) and the host calls.
fn envoy_instructions(
    inputs: &EnvoyInputs<'_>,
    builds: &[(&'static str, Option<&Path>, bool)],
    wrk: &mut Wrk<'_>,
    auth: &str,
    (body_json, body_stream): (&Path, &Path),
    seconds: u64,
    dir: &Path,
) -> Result<Vec<EnvoyInstructionRow>> {
    log(format!(
        "Envoy instructions per request: {} Envoys under valgrind (callgrind), starting (minutes) …",
        builds.len()
    ));
    let mut envoys = Vec::new();
    for (name, wasm, filter) in builds {
        let tag = name.replace(':', "-");
        let out = dir.join(format!("callgrind-{tag}.out"));
        let envoy = start_envoy_run(
            inputs,
            &format!("envoy-callgrind-{tag}"),
            *wasm,
            *filter,
            1000,
            Some(&out),
        );
        envoys.push((*name, *filter, out, envoy));
    }
    let mut rows = Vec::new();
    for (name, filter, out, envoy) in envoys {
        let envoy = envoy?;
        let runs = callgrind_runs(name, filter, body_json, body_stream);
        for (variant, body, headers) in runs {
            let v = Variant {
                name: "callgrind",
                baseline: "envoy",
                addr: envoy.listen,
                path: CHAT_PATH.into(),
                body_file: body,
                load: Load::Fixed {
                    auth: Some(auth.to_string()),
                    extra_headers: headers,
                },
                only_c: None,
                envoy_pid: envoy.pid(),
                pair: None,
            };
            let row = count_instructions(wrk, &v, &out, seconds)
                .with_context(|| format!("{variant} under callgrind"))?;
            log(format!(
                "{variant:<22} {:>9.0} instructions per request ({} requests)",
                row.0, row.1
            ));
            rows.push(EnvoyInstructionRow {
                variant,
                per_request: row.0,
                requests: row.1,
                idle_per_s: row.2,
            });
        }
    }
    Ok(rows)
}

/// The loads counted on build `name`'s Envoy: (variant, body, extra headers).
fn callgrind_runs(
    name: &str,
    filter: bool,
    body_json: &Path,
    body_stream: &Path,
) -> Vec<(String, PathBuf, String)> {
    let mut runs: Vec<(String, PathBuf, String)> = vec![(
        name.to_string(),
        body_json.to_path_buf(),
        if name == "wasm-floor" {
            "x-bench-kind: floor".to_string()
        } else {
            String::new()
        },
    )];
    if filter {
        // The filter's stream, and a compared build's (`filter-cached:<label>`) too.
        runs.push((
            name.replacen("filter-cached", "filter-stream", 1),
            body_stream.to_path_buf(),
            String::new(),
        ));
    }
    if name == "wasm-floor" && std::env::var_os("BENCH_FLOOR_PARTS").is_some() {
        // What each part of the floor really costs: the floor without it (`floor-<part>`).
        for part in FLOOR_PARTS {
            runs.push((
                format!("wasm-floor-{part}"),
                body_json.to_path_buf(),
                format!("x-bench-kind: floor-{part}"),
            ));
        }
    }
    if name == "wasm-floor" {
        // One header-map replacement instead of single edits: at the benchmark's header count,
        // and at a realistic one (the OpenAI SDK's request headers, a hosted provider's answer).
        for (suffix, extra) in [("", ""), ("-sdk", SDK_AND_PROVIDER_HEADERS)] {
            for kind in ["floor", "floor-reqset", "floor-respset"] {
                if suffix.is_empty() && kind == "floor" {
                    continue;
                }
                runs.push((
                    format!("wasm-{kind}{suffix}"),
                    body_json.to_path_buf(),
                    format!("x-bench-kind: {kind}{extra}"),
                ));
            }
        }
    }
    if name == "envoy" || name == "wasm-noop" {
        runs.push((
            format!("{name}-stream"),
            body_stream.to_path_buf(),
            String::new(),
        ));
    }
    if name == "wasm-floor" {
        // The floor's calls on a stream (every chunk read): the host's share of a stream.
        runs.push((
            "wasm-floor-stream".into(),
            body_stream.to_path_buf(),
            "x-bench-kind: floor".to_string(),
        ));
    }
    runs
}

/// Envoy's instructions per request for the builds of this run (bare Envoy, wasm-noop and
/// wasm-floor when built, the filter and any compared builds), saying how long it took; `None`
/// (and why, logged) when counting failed.
pub(crate) fn measure_envoy_instructions(
    args: &Args,
    inputs: &EnvoyInputs<'_>,
    (noop_wasm, hostcall_wasm, compare_wasm): (&Path, &Path, &[(&'static str, PathBuf)]),
    wrk: &mut Wrk<'_>,
    cached_auth: &str,
    bodies: &Bodies,
    dir: &Path,
) -> Option<Vec<EnvoyInstructionRow>> {
    let mut builds: Vec<(&'static str, Option<&Path>, bool)> = vec![("envoy", None, false)];
    if noop_wasm.is_file() {
        builds.push(("wasm-noop", Some(noop_wasm), false));
    }
    if hostcall_wasm.is_file() {
        builds.push(("wasm-floor", Some(hostcall_wasm), false));
    }
    builds.push(("filter-cached", Some(&inputs.wasm), true));
    for (name, path) in compare_wasm {
        builds.push((name, Some(path), true));
    }
    let t = Instant::now();
    let rows = match envoy_instructions(
        inputs,
        &builds,
        wrk,
        cached_auth,
        (&bodies.json, &bodies.stream),
        args.seconds.clamp(2, 6),
        dir,
    ) {
        Ok(rows) => Some(rows),
        Err(e) => {
            log(format!("Envoy instruction count failed: {e:#}"));
            None
        }
    };
    log(format!(
        "Envoy instruction count took {:.0} s",
        t.elapsed().as_secs_f64()
    ));
    rows
}

/// The request headers OpenAI's Python SDK adds to what wrk sends (`host`, `content-type`,
/// `authorization`, `content-length`), and the simulator's switch to answer with a hosted
/// provider's 15 more response headers (`|`-separated, after the kind).
const SDK_AND_PROVIDER_HEADERS: &str = "|accept: application/json|accept-encoding: gzip, deflate\
    |user-agent: OpenAI/Python 1.54.4|x-stainless-lang: python|x-stainless-package-version: 1.54.4\
    |x-stainless-os: Linux|x-stainless-arch: x64|x-stainless-runtime: CPython\
    |x-stainless-runtime-version: 3.11.2|x-stainless-async: false|x-stainless-retry-count: 0\
    |x-stainless-read-timeout: 600|x-sim-provider-headers: openai";

/// The parts of the hostcall filter's `floor` (kinds `floor-<part>`: the floor without it).
pub(crate) const FLOOR_PARTS: [&str; 7] = [
    "edits", "shared", "clock", "reqbody", "respmap", "ratehdrs", "respbody",
];

/// (instructions per request, requests, idle instructions per second) of one load on an Envoy
/// under callgrind whose dumps go to `out`.
pub(crate) fn count_instructions(
    wrk: &mut Wrk<'_>,
    v: &Variant,
    out: &Path,
    seconds: u64,
) -> Result<(f64, u64, f64)> {
    // The first requests under valgrind are slow (V8 compiles the module's functions lazily):
    // warm up until the answers come steadily.
    let mut warm = 0;
    for _ in 0..30 {
        let r = wrk.run(v, 1, 4)?;
        if r.errors == 0 && r.requests > 50 {
            warm += 1;
            if warm == 2 {
                break;
            }
        }
    }
    if warm < 2 {
        bail!("no steady answers within the warm-up");
    }
    let pid = v.envoy_pid;
    callgrind_control(pid, "-z")?;
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let idle_s = t.elapsed().as_secs_f64();
    let idle = callgrind_dump(pid, out)?;
    callgrind_control(pid, "-z")?;
    let t = Instant::now();
    let r = wrk.run(v, 1, seconds)?;
    let busy_s = t.elapsed().as_secs_f64();
    let busy = callgrind_dump(pid, out)?;
    if r.errors > 0 || r.requests == 0 {
        bail!("{} errors, {} requests", r.errors, r.requests);
    }
    let idle_per_s = idle as f64 / idle_s;
    let per_request = (busy as f64 - idle_per_s * busy_s) / r.requests as f64;
    Ok((per_request, r.requests, idle_per_s))
}

pub(crate) fn callgrind_control(pid: u32, what: &str) -> Result<()> {
    let status = Command::new("callgrind_control")
        .arg(what)
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("cannot run callgrind_control (valgrind)")?;
    if !status.success() {
        bail!("callgrind_control {what} {pid}: {status}");
    }
    Ok(())
}

/// Dumps callgrind's counters (since the last zero) and reads their total from the new dump
/// (`<out>.<n>`, the highest n).
pub(crate) fn callgrind_dump(pid: u32, out: &Path) -> Result<u64> {
    let newest = || newest_dump(out).map(|(n, _)| n).unwrap_or(0);
    let before = newest();
    callgrind_control(pid, "-d")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((n, path)) = newest_dump(out)
            && n > before
            && let Some(total) = std::fs::read_to_string(&path)
                .ok()
                .as_deref()
                .and_then(callgrind_total)
        {
            return Ok(total);
        }
        if Instant::now() > deadline {
            bail!("no callgrind dump of {} within 60 s", out.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The highest-numbered dump `<out>.<n>`.
pub(crate) fn newest_dump(out: &Path) -> Option<(u32, PathBuf)> {
    let dir = out.parent()?;
    let prefix = format!("{}.", out.file_name()?.to_str()?);
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let n: u32 = e
                .file_name()
                .to_str()?
                .strip_prefix(&prefix)?
                .parse()
                .ok()?;
            Some((n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
}

/// The event total of a callgrind dump (`summary:` or `totals:`; instructions, the only event).
pub(crate) fn callgrind_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The section: Envoy's instructions per request by variant, and the differences that matter.
pub(crate) fn render_envoy_instructions(rows: &[EnvoyInstructionRow]) -> String {
    let mut o = String::from(
        "
## Envoy's instructions per request, counted (issue 14)

",
    );
    let get = |name: &str| per_request(rows, name);
    let _ = writeln!(
        o,
        "Each build in its own Envoy (one worker) under valgrind (`--tool=callgrind --smc-check=all-non-file`), one wrk connection: the instructions of every Envoy thread between a zero and a dump of callgrind's counters, minus the same Envoy's idle instructions per second (timers, the filter's ticks and polls) for that long, ÷ the requests answered. User space only (no kernel), V8's compiled filter and the host calls included. Unlike CPU time on this machine it repeats to within a fraction of a percent: compare variants and builds with it. `./scripts/bench.sh --only instructions` prints it alone.
"
    );
    let _ = writeln!(
        o,
        "| variant | instructions / request | vs envoy | requests counted | idle instructions / s |"
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|");
    for r in rows {
        // A compared build's row (`filter-stream:<label>`) by its variant's name.
        let base = if r
            .variant
            .split(':')
            .next()
            .is_some_and(|v| v.ends_with("stream"))
        {
            get("envoy-stream")
        } else {
            get("envoy")
        };
        let vs = base.map_or_else(
            || "—".to_string(),
            |b| format!("{:+.0} ({:.2}×)", r.per_request - b, r.per_request / b),
        );
        let _ = writeln!(
            o,
            "| {} | {:.0} | {vs} | {} | {:.0} |",
            r.variant, r.per_request, r.requests, r.idle_per_s
        );
    }
    let lines = instruction_parts(rows);
    if !lines.is_empty() {
        let _ = writeln!(
            o,
            "
| part | instructions / request |
|---|---:|"
        );
        for l in lines {
            let _ = writeln!(o, "{l}");
        }
    }
    o
}

/// Instructions per request of the row named `name`.
fn per_request(rows: &[EnvoyInstructionRow], name: &str) -> Option<f64> {
    rows.iter()
        .find(|r| r.variant == name)
        .map(|r| r.per_request)
}

/// The differences that matter, one table row each: what any wasm filter, the host calls and
/// the filter's own work cost; with BENCH_FLOOR_PARTS each part of the floor; and this build
/// against each compared one.
fn instruction_parts(rows: &[EnvoyInstructionRow]) -> Vec<String> {
    let get = |name: &str| per_request(rows, name);
    let parts = [
        (
            "any wasm filter (`wasm-noop` − `envoy`)",
            "wasm-noop",
            "envoy",
        ),
        (
            "the filter's host calls (`wasm-floor` − `wasm-noop`)",
            "wasm-floor",
            "wasm-noop",
        ),
        (
            "the filter's own work in the VM (`filter-cached` − `wasm-floor`)",
            "filter-cached",
            "wasm-floor",
        ),
        (
            "the filter in all (`filter-cached` − `wasm-noop`)",
            "filter-cached",
            "wasm-noop",
        ),
        (
            "a stream through any wasm filter (`wasm-noop-stream` − `envoy-stream`: a callback per chunk)",
            "wasm-noop-stream",
            "envoy-stream",
        ),
        (
            "a stream through the filter (`filter-stream` − `wasm-noop-stream`)",
            "filter-stream",
            "wasm-noop-stream",
        ),
        (
            "a stream's host calls (`wasm-floor-stream` − `wasm-noop-stream`: every chunk read)",
            "wasm-floor-stream",
            "wasm-noop-stream",
        ),
        (
            "a stream's work in the VM (`filter-stream` − `wasm-floor-stream`)",
            "filter-stream",
            "wasm-floor-stream",
        ),
        (
            "the request edits as one `set_map` instead of 3 single edits (`wasm-floor-reqset` − `wasm-floor`; < 0 saves)",
            "wasm-floor-reqset",
            "wasm-floor",
        ),
        (
            "the 6 `x-ratelimit-*` as one response `set_map` instead of 6 adds (`wasm-floor-respset` − `wasm-floor`; < 0 saves)",
            "wasm-floor-respset",
            "wasm-floor",
        ),
        (
            "the SDK's 12 request headers and a hosted provider's 15 response headers (`wasm-floor-sdk` − `wasm-floor`)",
            "wasm-floor-sdk",
            "wasm-floor",
        ),
        (
            "with them, the request edits as one `set_map` (`wasm-floor-reqset-sdk` − `wasm-floor-sdk`; < 0 saves)",
            "wasm-floor-reqset-sdk",
            "wasm-floor-sdk",
        ),
        (
            "with them, the 6 `x-ratelimit-*` as one response `set_map` (`wasm-floor-respset-sdk` − `wasm-floor-sdk`; < 0 saves)",
            "wasm-floor-respset-sdk",
            "wasm-floor-sdk",
        ),
    ];
    let mut lines: Vec<String> = parts
        .iter()
        .filter_map(|(what, a, b)| Some(format!("| {what} | {:+.0} |", get(a)? - get(b)?)))
        .collect();
    // BENCH_FLOOR_PARTS: what each part of the floor costs.
    for part in FLOOR_PARTS {
        if let (Some(all), Some(without)) = (get("wasm-floor"), get(&format!("wasm-floor-{part}")))
        {
            lines.push(format!(
                "| `wasm-floor`'s {} (`wasm-floor` − `wasm-floor-{part}`) | {:+.0} |",
                floor_part_what(part),
                all - without
            ));
        }
    }
    // Other builds of the filter (BENCH_COMPARE_WASM): this build against each.
    for r in rows {
        for variant in ["filter-cached", "filter-stream"] {
            let label = r
                .variant
                .strip_prefix(variant)
                .and_then(|l| l.strip_prefix(':'));
            if let (Some(label), Some(this)) = (label, get(variant)) {
                lines.push(format!(
                    "| this build of the filter − build `{label}` (`{variant}`) | {:+.0} |",
                    this - r.per_request
                ));
            }
        }
    }
    lines
}

pub(crate) fn floor_part_what(part: &str) -> &'static str {
    match part {
        "edits" => "request header edits but `authorization`'s removal",
        "shared" => "counter slot read and CAS write (shared data)",
        "clock" => "3 clock reads",
        "reqbody" => "request body read",
        "respmap" => "response header map read",
        "ratehdrs" => "6 `x-ratelimit-*` adds",
        "respbody" => "response body read",
        _ => "part",
    }
}

/// The filter's own instructions, counted natively by `./scripts/bench.sh` (valgrind).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct FilterInstructions {
    /// Per cached JSON request.
    pub(crate) cached_json: Option<u64>,
    /// Per cached stream (the benchmark's: 64 content chunks, usage asked for).
    pub(crate) cached_stream: Option<u64>,
    /// Per 64-token Anthropic stream translated for an OpenAI chat client.
    pub(crate) translated_stream: Option<u64>,
    /// Per the same Messages stream passed through (the comparison).
    pub(crate) messages_stream: Option<u64>,
    /// Per signed Bedrock JSON request (translated to Converse, SigV4, answer translated back).
    pub(crate) signed_json: Option<u64>,
    /// Per signed 64-token ConverseStream translated to OpenAI SSE.
    pub(crate) signed_stream: Option<u64>,
    /// Per 64-token Gemini stream (Vertex AI's own API) translated to OpenAI SSE.
    pub(crate) gemini_stream: Option<u64>,
}

/// `{"cached_json": N, "cached_stream": M}` from `path` (`None`: no file, or unreadable).
pub(crate) fn read_instructions(path: Option<&Path>) -> Option<FilterInstructions> {
    let text = std::fs::read_to_string(path?).ok()?;
    let v = serde_json::from_str::<Value>(&text).ok()?;
    let counts = FilterInstructions {
        cached_json: v["cached_json"].as_u64(),
        cached_stream: v["cached_stream"].as_u64(),
        translated_stream: v["translated_stream"].as_u64(),
        messages_stream: v["messages_stream"].as_u64(),
        signed_json: v["bedrock_signed_json"].as_u64(),
        signed_stream: v["bedrock_signed_stream"].as_u64(),
        gemini_stream: v["gemini_stream"].as_u64(),
    };
    (counts != FilterInstructions::default()).then_some(counts)
}

/// The filter's own work per cached JSON request and per stream as instruction counts.
pub(crate) fn render_instructions(counts: Option<FilterInstructions>) -> String {
    let mut o = String::from("## The filter's own work, counted (issue 14)\n\n");
    let counts = counts.unwrap_or_default();
    if let Some(n) = counts.cached_json {
        let _ = writeln!(
            o,
            "**{n} instructions** per cached JSON request: the filter's code from its context's creation to its end (headers, body, admission, response headers, usage, settlement, ledger), natively (x86-64, release, LTO off), counted by valgrind (`--tool=callgrind`, `--toggle-collect` on `cached_request_callbacks` of the ignored test `native_cost_of_a_cached_request`, the recording host's calls toggled off), the difference of a 1200- and a 200-request run ÷ 1000. Unlike Envoy's CPU time above it does not move with this machine's load: compare builds with it. In Envoy the same work is V8's compiled wasm (slower than native) plus the host calls priced below.\n"
        );
    }
    if let Some(n) = counts.cached_stream {
        let per_chunk = counts
            .cached_json
            .map(|json| {
                format!(
                    ", i.e. {:+.0} per chunk beyond a JSON request's",
                    (n as f64 - json as f64) / 66.0
                )
            })
            .unwrap_or_default();
        let _ = writeln!(
            o,
            "**{n} instructions** per cached stream (the benchmark's filter-stream: 64 content chunks, the usage chunk and `[DONE]`, one event per chunk, usage asked for by the client), counted the same way over `native_cost_of_a_cached_stream`{per_chunk}.\n"
        );
    }
    if let (Some(t), Some(m)) = (counts.translated_stream, counts.messages_stream) {
        let _ = writeln!(
            o,
            "**{t} instructions** per translated stream (an OpenAI chat client to an Anthropic model: the request translated, a 64-token Messages stream of 70 events turned into chunks, the usage chunk and `[DONE]`, one event per chunk) against **{m}** for the same Messages stream passed through untranslated: {:+} per stream, {:+.0} per event (`native_cost_of_a_translated_stream` and `native_cost_of_a_messages_stream` in `filter/src/request/tests/translate.rs`, counted the same way).\n",
            t as i64 - m as i64,
            (t as f64 - m as f64) / 70.0
        );
    }
    if let (Some(j), Some(st)) = (counts.signed_json, counts.signed_stream) {
        let over_cached = counts
            .cached_json
            .map(|c| format!(" ({:+} over a cached JSON request)", j as i64 - c as i64))
            .unwrap_or_default();
        let _ = writeln!(
            o,
            "**{j} instructions** per signed Bedrock JSON request{over_cached}: the OpenAI chat body translated to Converse, SigV4-signed (the body's SHA-256, the canonical request, the HMAC with the day's derived key), a 64-token Converse answer translated back and settled; **{st}** per signed 64-token ConverseStream translated frame by frame to OpenAI SSE (`native_cost_of_a_signed_json_request` and `native_cost_of_a_converse_stream` in `filter/src/request/tests/bedrock.rs`, counted the same way).\n"
        );
    }
    if let Some(g) = counts.gemini_stream {
        let _ = writeln!(
            o,
            "**{g} instructions** per translated 64-token Gemini stream (an OpenAI chat client to Gemini on Vertex AI: the request translated to `generateContent`, 64 SSE events turned into chunks, the usage chunk and `[DONE]`; `native_cost_of_a_gemini_stream` in `filter/src/request/tests/gemini.rs`, counted the same way).\n"
        );
    }
    if counts == FilterInstructions::default() {
        let _ = writeln!(
            o,
            "Not counted in this run (`./scripts/bench.sh` counts it when valgrind is installed).\n"
        );
    }
    o
}

#[cfg(test)]
mod tests;
