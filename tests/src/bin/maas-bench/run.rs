//! The run, phase by phase in the order they always ran: what to measure, the stack, the keys and
//! bodies, the Envoys and variants, the alternating rounds, then each measurement and the report.

use crate::envoy::{BenchEnvoy, EnvoyInputs, pin_to_cpu, start_envoy_with, url_addr};
use crate::hostcalls::{
    host_call_prices, measure_prices, price_kinds, read_host_call_counts, render_host_calls,
};
use crate::instructions::{EnvoyInstructionRow, measure_envoy_instructions};
use crate::junk::{Junk, junk_bound};
use crate::keys::insert_keys;
use crate::memory::{Mem, credential_memory_rows, mem_of};
use crate::profile::{Profile, profiles};
use crate::report::{Report, Ttfb, TtfbRow, write_report};
use crate::stats::median;
use crate::streams::{measure_ttfb, stream_memory};
use crate::two_replica::lease_stats;
use crate::variants::{Bodies, Envoys, Setup, check_variants, variants};
use crate::wrk::{Load, Variant, Wrk, WrkResult};
use crate::{Args, ENVOY_INSTRUCTIONS, IDENTITIES, POLICY, TWO_REPLICA, log};
use anyhow::{Context, Result};
use maas_e2e::{Stack, StackOptions, tools};
use maas_types::PolicyDocument;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// Results of the rounds: every run of each (variant, concurrency).
pub(crate) type Results = BTreeMap<(String, u32), Vec<WrkResult>>;

/// What this run measures, from `--only`, `--quick` and what is installed.
// Independent switches from the command line, not states of one thing.
#[allow(clippy::struct_excessive_bools)]
pub(crate) struct Plan {
    /// `hostcalls` alone: the prices of every kind, printed only; with other variants (and in
    /// the full run) the prices that bill the filter's calls, in the report.
    pub(crate) hostcalls_only: bool,
    pub(crate) want_prices: bool,
    /// Envoy's instructions per request under valgrind: the full run, or `--only instructions`
    /// (printed only).
    pub(crate) want_instructions: bool,
    pub(crate) instructions_only: bool,
    /// two-replica: a second companion and a Redis that both companions share.
    pub(crate) two_replica: bool,
    /// Only two-replica: its section is replaced in BENCH_OUT, the rest of the file kept.
    pub(crate) two_replica_only: bool,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        let only =
            |f: &dyn Fn(&str) -> bool| !args.only.is_empty() && args.only.iter().all(|o| f(o));
        let any = |f: &dyn Fn(&str) -> bool| args.only.is_empty() || args.only.iter().any(|o| f(o));
        let hostcalls_only = only(&|o| o == "hostcalls");
        let want_prices = any(&|o| o == "hostcalls");
        let valgrind_found = Command::new("valgrind")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        let instructions_only = only(&|o| o == ENVOY_INSTRUCTIONS);
        let want_instructions = !args.quick && any(&|o| o == ENVOY_INSTRUCTIONS);
        if want_instructions && !valgrind_found {
            log("valgrind not found: no count of Envoy's instructions per request");
        }
        Plan {
            hostcalls_only,
            want_prices,
            want_instructions: want_instructions && valgrind_found,
            instructions_only,
            two_replica: !hostcalls_only && any(&|o| o.starts_with(TWO_REPLICA)),
            two_replica_only: only(&|o| o.starts_with(TWO_REPLICA)),
        }
    }
}

/// The keys the variants send.
pub(crate) struct Keys {
    /// The key every fixed load sends (`Bearer <it>`), cached by the filter after its first use.
    pub(crate) cached_key: String,
    pub(crate) cached_auth: String,
    /// The most cached credentials the memory measurement fills.
    pub(crate) max_cached: usize,
    /// Keys in PostgreSQL (filter-miss sends each once).
    pub(crate) pool: usize,
    pub(crate) keys_file: PathBuf,
}

/// What the measurements after the rounds found (each `None`/empty when not run).
pub(crate) struct Measured {
    pub(crate) results: Results,
    pub(crate) profiles: Vec<(&'static str, Profile)>,
    pub(crate) ttfb: Ttfb<'static>,
    pub(crate) ttfb_more: Vec<TtfbRow>,
    pub(crate) stream_mem: Option<(Mem, Mem, Mem)>,
    pub(crate) prices: Option<crate::hostcalls::Prices>,
    pub(crate) instructions: Option<Vec<EnvoyInstructionRow>>,
    pub(crate) lease_stats: BTreeMap<(&'static str, String), f64>,
    pub(crate) mem_rows: Vec<(usize, Mem, usize)>,
    pub(crate) junk: Option<Junk>,
}

/// What every phase after the stack's start works with.
pub(crate) struct Ctx<'a> {
    pub(crate) args: &'a Args,
    pub(crate) plan: &'a Plan,
    pub(crate) root: &'a Path,
    /// tests/bench: wrk's scripts and the notes after the report.
    pub(crate) lua_dir: &'a Path,
    /// Where the benchmark's files go (in the stack's directory).
    pub(crate) dir: &'a Path,
    pub(crate) stack: &'a Stack,
    pub(crate) inputs: &'a EnvoyInputs<'a>,
    pub(crate) pg_bin: &'a Path,
}

pub(crate) fn run() -> Result<()> {
    let args = Args::from_command_line()?;
    // Envoy gets CPU 0 to itself; this process (the simulator, the measuring threads) and what it
    // starts (companion, PostgreSQL) share CPU 1 with wrk. Threads inherit the mask.
    pin_to_cpu(1)?;
    let root = tools::workspace_root();
    let lua_dir = root.join("tests/bench");
    let started_at = SystemTime::now();
    let plan = Plan::new(&args);
    let stack = start_stack(plan.two_replica)?;
    let dir = stack.dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let policy = PolicyDocument::from_value(yaml_serde::from_str::<Value>(POLICY)?)
        .map_err(|e| anyhow::anyhow!("bench policy: {e}"))?;
    let inputs = envoy_inputs(&stack, &policy, &dir)?;
    let pg_bin = tools::pg_bin_dir()?;
    let ctx = Ctx {
        args: &args,
        plan: &plan,
        root: &root,
        lua_dir: &lua_dir,
        dir: &dir,
        stack: &stack,
        inputs: &inputs,
        pg_bin: &pg_bin,
    };
    // The filter's host calls per request (its budget tests' figures), and the hostcall filter
    // (`tests/bench/hostcall-filter`): the wasm-floor variant and the prices.
    let counts = read_host_call_counts(args.host_calls.as_deref());
    if let Err(why) = &counts {
        log(format!("no host-call counts: {why}"));
    }
    let hostcall_wasm = built_wasm(
        &root,
        "BENCH_HOSTCALL_WASM",
        "target/bench-hostcall/wasm32-wasip1/release/maas_bench_hostcall_filter.wasm",
    );
    let hostcall_envoy = start_hostcall_envoy(&args, &plan, &inputs, &hostcall_wasm)?;
    let price_kinds = price_kinds(plan.hostcalls_only, &counts);
    if plan.hostcalls_only {
        // Its own mode: prices of host calls, nothing else (printed, never written to BENCH_OUT).
        let envoy = hostcall_envoy.context("the hostcall filter is not built")?;
        let prices = host_call_prices(&args, &envoy, &price_kinds, &lua_dir, &dir)?;
        println!("{}", render_host_calls(&counts, Some(&prices)));
        stack.shutdown();
        return Ok(());
    }

    let keys = insert_bench_keys(&args, &stack, &pg_bin, &dir)?;
    let bodies = Bodies::write(&dir, &keys.cached_key)?;
    log("starting bare Envoy and Envoy with the filter (--concurrency 1, CPU 0) …");
    let envoys = Envoys::start(&inputs, &root, keys.pool)?;
    let (variants, extras) = variants(&Setup {
        ctx: &ctx,
        envoys: &envoys,
        hostcall: hostcall_envoy.as_ref(),
        bodies: &bodies,
        cached_auth: &keys.cached_auth,
    })?;
    check_variants(&variants, &keys.cached_auth)?;
    // Warm-up: connections, JIT, caches.
    let mut wrk = Wrk {
        lua_dir: &lua_dir,
        keys_file: &keys.keys_file,
        keys_total: keys.pool,
        key_offset: keys.max_cached, // keys below this are kept for the memory measurement
    };
    log("warming up …");
    for v in variants.iter().filter(|v| !matches!(v.load, Load::Miss)) {
        wrk.run(v, 8, 1)?;
    }
    let results = rounds(&args, &stack, &variants, &mut wrk)?;
    log_summary(&args, &variants, &results);
    let after = AfterRounds {
        keys: &keys,
        bodies: &bodies,
        variants: &variants,
        price_kinds: &price_kinds,
        hostcall_wasm: &hostcall_wasm,
    };
    let running = (envoys, hostcall_envoy, extras.two_replica_envoys);
    let measured = measure(&ctx, &after, &mut wrk, results, running)?;
    let report = Report {
        args: &args,
        plan: &plan,
        root: &root,
        lua_dir: &lua_dir,
        started_at,
        variants: &variants,
        counts: &counts,
        stream_tokens: bodies.stream_tokens,
    };
    write_report(&report, &measured)?;
    drop(extras.observed);
    stack.shutdown();
    drop(extras.litellm);
    Ok(())
}

/// What the measurements after the rounds need beside the context.
struct AfterRounds<'a> {
    keys: &'a Keys,
    bodies: &'a Bodies,
    variants: &'a [Variant],
    price_kinds: &'a [&'static str],
    hostcall_wasm: &'a Path,
}

/// The Envoys still running after the rounds: stopped as the measurements go.
type Running = (
    Envoys,
    Option<BenchEnvoy>,
    Vec<(&'static str, Vec<BenchEnvoy>)>,
);

/// The measurements after the rounds, in order: profiles, time to first byte and memory per
/// stream, host-call prices, Envoy's instructions; then (those Envoys stopped) the lease
/// counters, memory per cached credential and junk-bound on fresh Envoys.
fn measure(
    ctx: &Ctx<'_>,
    after: &AfterRounds<'_>,
    wrk: &mut Wrk<'_>,
    results: Results,
    (envoys, hostcall_envoy, two_replica_envoys): Running,
) -> Result<Measured> {
    let (args, keys, variants) = (ctx.args, after.keys, after.variants);
    let profiles = profiles(
        args,
        variants,
        wrk,
        &profile_targets(&envoys, hostcall_envoy.as_ref()),
        ctx.dir,
    );
    let streams = variants.iter().any(|v| v.name == "filter-stream");
    let (ttfb, ttfb_more) = if streams {
        measure_ttfb(args, &envoys, &keys.cached_auth)?
    } else {
        Default::default()
    };
    // ---- memory per stream: short vs long streams in flight ----
    let mut stream_mem = None;
    if streams {
        log("memory per stream: 32 short streams, then 32 long ones …");
        let filtered = &envoys.filtered;
        let base = mem_of(filtered.pid(), filtered.admin);
        let short = stream_memory(filtered, &keys.cached_auth, 32, 50, 60)?;
        let long = stream_memory(filtered, &keys.cached_auth, 32, 3000, 1)?;
        stream_mem = Some((base, short, long));
    }
    let prices = match (ctx.plan.want_prices, &hostcall_envoy) {
        (true, Some(envoy)) => Some(measure_prices(
            args,
            envoy,
            after.price_kinds,
            ctx.lua_dir,
            ctx.dir,
        )?),
        _ => None,
    };
    drop(hostcall_envoy);
    let instructions = ctx.plan.want_instructions.then(|| {
        let wasm = (
            envoys.noop_wasm.as_path(),
            after.hostcall_wasm,
            envoys.compare_wasm.as_slice(),
        );
        let bodies = after.bodies;
        measure_envoy_instructions(
            args,
            ctx.inputs,
            wasm,
            wrk,
            &keys.cached_auth,
            bodies,
            ctx.dir,
        )
    });
    // ---- memory after N distinct cached credentials, on a fresh Envoy with the filter ----
    envoys.stop();
    let lease_stats = lease_stats(two_replica_envoys);
    let mem_rows = if keys.max_cached > 0
        && (args.only.is_empty() || args.only.iter().any(|o| o == "filter-miss"))
    {
        credential_memory_rows(args, ctx.inputs, keys, ctx.dir)?
    } else {
        Vec::new()
    };
    // ---- shared data stays bounded: distinct junk bearer tokens, on a fresh Envoy ----
    let mut junk = None;
    if args.junk_tokens > 0 && (args.only.is_empty() || args.only.iter().any(|o| o == "junk-bound"))
    {
        junk = Some(junk_bound(
            ctx.inputs,
            &keys.cached_auth,
            args.junk_tokens,
            args.junk_rounds.max(2),
            args.junk_cache_entries,
        )?);
    }
    Ok(Measured {
        results,
        profiles,
        ttfb,
        ttfb_more,
        stream_mem,
        prices,
        instructions: instructions.flatten(),
        lease_stats,
        mem_rows,
        junk,
    })
}

/// The stack: PostgreSQL, the companion (two and a Redis for two-replica), the simulator.
fn start_stack(two_replica: bool) -> Result<Stack> {
    log(format!(
        "starting the stack (PostgreSQL, {}, simulator) …",
        if two_replica {
            "2 companions, Redis"
        } else {
            "companion"
        }
    ));
    Stack::start(StackOptions {
        envoy_concurrency: 1,
        replicas: if two_replica { 2 } else { 1 },
        companion_env: vec![
            ("MAAS_KEY_CACHE_TTL_SECONDS".into(), "3600".into()),
            ("RUST_LOG".into(), "warn".into()),
        ],
        // Plain HTTP to the companions' internal listeners, as in the figures so far: `wrk`
        // (the companion-auth variant) cannot present the gateway's client certificate.
        internal_mtls: false,
        ..StackOptions::default()
            .with_policy_yaml(POLICY)
            .with_identities_yaml(IDENTITIES)
    })
}

fn envoy_inputs<'a>(
    stack: &Stack,
    policy: &'a PolicyDocument,
    dir: &Path,
) -> Result<EnvoyInputs<'a>> {
    Ok(EnvoyInputs {
        policy,
        companion_public: url_addr(&stack.companion_public_url())?,
        companion_internal: url_addr(&stack.companion_internal_url())?,
        simulator: stack.sim().addr(),
        wasm: tools::wasm_file()?,
        envoy_bin: tools::envoy_bin()?,
        dir: dir.to_path_buf(),
        plugin_extra: None,
        observe: None,
    })
}

/// A wasm module `./scripts/bench.sh` builds: `$env`, else `default` under the workspace.
pub(crate) fn built_wasm(root: &Path, env: &str, default: &str) -> PathBuf {
    std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(default))
}

/// The Envoy with the hostcall filter, when the prices or the wasm-floor variant are wanted and
/// it is built.
fn start_hostcall_envoy(
    args: &Args,
    plan: &Plan,
    inputs: &EnvoyInputs<'_>,
    hostcall_wasm: &Path,
) -> Result<Option<BenchEnvoy>> {
    let want_floor = args.only.is_empty() || args.only.iter().any(|o| o == "wasm-floor");
    if !plan.want_prices && !want_floor {
        Ok(None)
    } else if hostcall_wasm.is_file() {
        Ok(Some(start_envoy_with(
            inputs,
            "envoy-hostcall",
            Some(hostcall_wasm),
            1000,
        )?))
    } else {
        log(format!(
            "{} not built (./scripts/bench.sh builds tests/bench/hostcall-filter): no wasm-floor variant, no host-call prices",
            hostcall_wasm.display()
        ));
        Ok(None)
    }
}

/// Mints the cached key and inserts the pool of keys into PostgreSQL.
fn insert_bench_keys(args: &Args, stack: &Stack, pg_bin: &Path, dir: &Path) -> Result<Keys> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let cached_key = runtime.block_on(stack.mint_key_plain("bench-token", "bench-cached"))?;
    let cached_auth = format!("Bearer {cached_key}");
    let max_cached = args.cached_keys.iter().copied().max().unwrap_or(0);
    // filter-miss uses each key once: enough for the fastest plausible miss rate.
    let miss_runs: usize = args.rounds * args.seconds as usize;
    let small_pool = !args.only.is_empty()
        && args
            .only
            .iter()
            .all(|o| o == "junk-bound" || o.starts_with(TWO_REPLICA));
    let pool = if small_pool {
        1000
    } else {
        (miss_runs * 12_000).max(max_cached).max(1000)
    };
    let keys_file = dir.join("keys.txt");
    log(format!("inserting {pool} API keys into PostgreSQL …"));
    let t = Instant::now();
    insert_keys(pg_bin, &stack.database_url(), pool, &keys_file, &|_| {
        "bench".to_string()
    })?;
    log(format!("… done in {:.1} s", t.elapsed().as_secs_f64()));
    Ok(Keys {
        cached_key,
        cached_auth,
        max_cached,
        pool,
        keys_file,
    })
}

/// Every variant once per round and concurrency, alternating.
fn rounds(args: &Args, stack: &Stack, variants: &[Variant], wrk: &mut Wrk<'_>) -> Result<Results> {
    let mut results: Results = BTreeMap::new();
    for round in 1..=args.rounds {
        for &c in &args.concurrency {
            for v in variants {
                if v.only_c.as_ref().is_some_and(|cs| !cs.contains(&c)) {
                    continue;
                }
                stack.check_alive()?;
                if args.two_replica_idle_s > 0 && v.name.starts_with(TWO_REPLICA) {
                    std::thread::sleep(Duration::from_secs(args.two_replica_idle_s));
                }
                let r = wrk.run(v, c, args.seconds)?;
                log(format!(
                    "round {round}/{} c={c:<3} {:<15} {:>9.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms{}{}",
                    args.rounds,
                    v.name,
                    r.rps,
                    r.p50_ms,
                    r.p99_ms,
                    if r.cpu_us > 0.0 {
                        format!("  Envoy CPU {:>6.1} µs/req", r.cpu_us)
                    } else {
                        String::new()
                    },
                    if r.errors > 0 {
                        format!("  ERRORS {}", r.errors)
                    } else {
                        String::new()
                    }
                ));
                results.entry((v.name.to_string(), c)).or_default().push(r);
            }
        }
    }
    Ok(results)
}

/// Envoy's CPU per request (robust on a shared machine: it does not depend on how much CPU
/// Envoy got), with req/s against the baseline, per variant.
fn log_summary(args: &Args, variants: &[Variant], results: &Results) {
    for &c in &args.concurrency {
        for v in variants {
            let Some(rs) = results.get(&(v.name.to_string(), c)) else {
                continue;
            };
            let cpu: Vec<f64> = rs.iter().map(|r| r.cpu_us).filter(|&x| x > 0.0).collect();
            let rps = median(&rs.iter().map(|r| r.rps).collect::<Vec<_>>());
            let base = results
                .get(&(v.baseline.to_string(), c))
                .map(|b| median(&b.iter().map(|r| r.rps).collect::<Vec<_>>()))
                .unwrap_or(0.0);
            log(format!(
                "summary c={c:<3} {:<22} {rps:>8.0} req/s  {:.2}× {}  Envoy CPU {} µs/req",
                v.name,
                if base > 0.0 { rps / base } else { 0.0 },
                v.baseline,
                if cpu.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.1}", median(&cpu))
                }
            ));
        }
    }
}

/// The Envoys profiled (when their variant runs), in order.
fn profile_targets(envoys: &Envoys, hostcall: Option<&BenchEnvoy>) -> Vec<(&'static str, u32)> {
    let mut targets = vec![("envoy", envoys.bare.pid())];
    if let Some(n) = &envoys.noop {
        targets.push(("wasm-noop", n.pid()));
    }
    if let Some(f) = hostcall {
        targets.push(("wasm-floor", f.pid()));
    }
    targets.extend([
        ("filter-cached", envoys.filtered.pid()),
        ("filter-stream", envoys.filtered.pid()),
        ("envoy-stream", envoys.bare.pid()),
    ]);
    targets
}
