//! `maas-bench`: the benchmark of issue 6 (run it with `./scripts/bench.sh`).
//!
//! Starts its own local stack (PostgreSQL, companion, in-process model simulator), then its own
//! Envoys from the same rendered config — one without the wasm filter ("envoy"), one with it —
//! each with `--concurrency 1` pinned to CPU 0, and drives them with wrk pinned to CPU 1,
//! alternating the variants within every round (A B C … A B C …) so machine drift cancels.
//! Prints a table of medians (with the spread over rounds) and ratios against bare Envoy, the
//! stream time to first byte, Envoy's memory after N cached credentials, that Envoy's heap stays
//! bounded under distinct junk bearer tokens (`junk-bound`), and writes docs/benchmarks.md.
//!
//! Where things are: [`run`] the phases in order; [`variants`] what is measured and on which
//! Envoy ([`envoy`]); [`wrk`] one run and what it measured; the measurements after the rounds
//! ([`profile`], [`streams`], [`memory`], [`junk`], [`hostcalls`], [`instructions`],
//! [`two_replica`]); [`report`], [`issue14`] and [`issue31`] (the targets) the report; [`http`],
//! [`keys`], [`litellm`] and [`stats`] their helpers.

mod envoy;
mod hostcalls;
mod http;
mod instructions;
mod issue14;
mod issue31;
mod junk;
mod keys;
mod litellm;
mod memory;
mod observed;
mod profile;
mod report;
mod run;
mod stats;
mod streams;
mod two_replica;
mod variants;
mod wrk;

use anyhow::{Result, bail};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone)]
#[command(about = "Benchmark the MaaS filter against bare Envoy (and optionally LiteLLM)")]
struct Args {
    /// Seconds per wrk run.
    #[arg(long, env = "BENCH_SECONDS", default_value_t = 10)]
    seconds: u64,
    /// Rounds (every variant once per round, alternating).
    #[arg(long, env = "BENCH_ROUNDS", default_value_t = 3)]
    rounds: usize,
    /// Concurrencies (wrk connections), comma separated.
    #[arg(
        long,
        env = "BENCH_CONCURRENCY",
        value_delimiter = ',',
        default_value = "1,32"
    )]
    concurrency: Vec<u32>,
    /// Distinct cached credentials at which Envoy's memory is measured, comma separated.
    #[arg(
        long,
        env = "BENCH_CACHED_KEYS",
        value_delimiter = ',',
        default_value = "10000,100000"
    )]
    cached_keys: Vec<usize>,
    /// Distinct junk bearer tokens (`Bearer junk-<n>`, refused 401 by the companion and cached
    /// negatively) sent per round of the `junk-bound` measurement; 0 = skip it.
    #[arg(long, env = "BENCH_JUNK_TOKENS", default_value_t = 200_000)]
    junk_tokens: usize,
    /// Rounds of `junk-bound` (each with new tokens; the heap is read after each).
    #[arg(long, env = "BENCH_JUNK_ROUNDS", default_value_t = 3)]
    junk_rounds: usize,
    /// `cache.maxEntries` of the Envoy that takes the junk tokens (the configured bound).
    #[arg(long, env = "BENCH_JUNK_CACHE_ENTRIES", default_value_t = 100_000)]
    junk_cache_entries: u64,
    /// Streams sampled (per Envoy) for time to first byte.
    #[arg(long, env = "BENCH_TTFB_SAMPLES", default_value_t = 300)]
    ttfb_samples: usize,
    /// Quick check: 2 s runs, 3 rounds, small key counts (overrides the above).
    #[arg(long, env = "BENCH_QUICK")]
    quick: bool,
    /// Also benchmark the peers: LiteLLM proxy (installed from PyPI into .local/bench-venv);
    /// Kuadrant's cannot be built here (the report says why).
    #[arg(long, visible_alias = "peers", env = "BENCH_LITELLM")]
    litellm: bool,
    /// Only these variants (comma separated); default all.
    #[arg(long, env = "BENCH_ONLY", value_delimiter = ',')]
    only: Vec<String>,
    /// Skip the profile (by default Envoy is profiled with `perf record -e cpu-clock` during one
    /// run of envoy, wasm-noop, filter-cached and the streams at the highest concurrency: CPU
    /// time per request and where it goes).
    #[arg(long, env = "BENCH_NO_PROFILE")]
    no_profile: bool,
    /// Where the results go (markdown). Empty = do not write.
    #[arg(long, env = "BENCH_OUT", default_value = "docs/benchmarks.md")]
    out: String,
    /// The command line to record in the results file.
    #[arg(long, env = "BENCH_COMMAND", default_value = "./scripts/bench.sh")]
    command: String,
    /// The filter's host calls and allocations per request (JSON written by its budget tests
    /// with `MAAS_HOST_CALLS_OUT`; `./scripts/bench.sh` runs them): the report's host-call table.
    #[arg(long, env = "BENCH_HOST_CALLS")]
    host_calls: Option<PathBuf>,
    /// The filter's own instructions per cached JSON request (`{"cached_json": N}`, counted by
    /// `./scripts/bench.sh` with valgrind): the report's instruction count.
    #[arg(long, env = "BENCH_INSTRUCTIONS")]
    instructions: Option<PathBuf>,
    /// Seconds per wrk run of the host-call prices (default: BENCH_SECONDS, at most 4).
    #[arg(long, env = "BENCH_HOSTCALL_SECONDS")]
    hostcall_seconds: Option<u64>,
    /// Seconds the two-replica gateways sit idle before each of their runs, so that their
    /// subjects' leases are released and the subjects dropped for idleness first (as between
    /// the rounds of a full run, where the other variants run in between); 0 = back to back.
    #[arg(long, env = "BENCH_TWO_REPLICA_IDLE_S", default_value_t = 0)]
    two_replica_idle_s: u64,
}

const MODEL: &str = "sim-model";
const CHAT_PATH: &str = "/llm/sim-model/v1/chat/completions";
const SIM_CHAT_PATH: &str = "/v1/chat/completions";
const LITELLM_MASTER_KEY: &str = "sk-bench-master";
/// `--only two-replica`: the variants `two-replica-off` and `two-replica-on`.
const TWO_REPLICA: &str = "two-replica";
/// Users (one key each) whose requests the two-replica variants rotate through.
const TWO_REPLICA_SUBJECTS: usize = 4;
const TWO_REPLICA_REPLICAS: usize = 2;
/// `--only instructions`: Envoy's instructions per request, counted under valgrind.
const ENVOY_INSTRUCTIONS: &str = "instructions";

/// The heading of the two-replica section (what `--only two-replica` replaces in BENCH_OUT).
const TWO_REPLICA_HEADING: &str = "## Global limits across two gateway replicas (`two-replica`)";

/// The benchmark's policy: one tier whose limits are on but can never trip during a run.
const POLICY: &str = r#"
tiers:
  - name: bench
    displayName: Benchmark
    level: 0
    groups: [tier-bench-users]
    limits:
      requests: [{limit: 1000000000000, window: 1m}]
      tokens: [{limit: 1000000000000000, window: 1m}, {limit: 1000000000000000, window: 1d}]
    defaultMaxTokens: 16
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [bench]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - token: bench-token
    username: bench
    groups: [system:authenticated, tier-bench-users]
"#;

fn main() {
    if let Err(e) = run::run() {
        eprintln!("maas-bench: {e:#}");
        std::process::exit(1);
    }
}

impl Args {
    /// The command line, `--quick` applied, checked.
    fn from_command_line() -> Result<Args> {
        let mut args = Args::parse();
        if args.quick {
            args.seconds = 2;
            args.rounds = 3;
            args.cached_keys = vec![1000, 5000];
            args.ttfb_samples = 60;
            args.junk_tokens = args.junk_tokens.min(20_000);
            args.junk_cache_entries = args.junk_cache_entries.min(10_000);
        }
        if args.rounds == 0 || args.seconds == 0 {
            bail!("BENCH_ROUNDS and BENCH_SECONDS must be at least 1");
        }
        Ok(args)
    }
}

fn log(msg: impl AsRef<str>) {
    eprintln!("[{}] {}", chrono_like_now(), msg.as_ref());
}

fn chrono_like_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    format!("{h:02}:{m:02}:{s:02}")
}
