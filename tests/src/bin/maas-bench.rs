//! `maas-bench`: the benchmark of issue 6 (run it with `./scripts/bench.sh`).
//!
//! Starts its own local stack (PostgreSQL, companion, in-process model simulator), then its own
//! Envoys from the same rendered config — one without the wasm filter ("envoy"), one with it —
//! each with `--concurrency 1` pinned to CPU 0, and drives them with wrk pinned to CPU 1,
//! alternating the variants within every round (A B C … A B C …) so machine drift cancels.
//! Prints a table of medians (with the spread over rounds) and ratios against bare Envoy, the
//! stream time to first byte, Envoy's memory after N cached credentials, that Envoy's heap stays
//! bounded under distinct junk bearer tokens (`junk-bound`), and writes docs/benchmarks.md.

use anyhow::{Context, Result, bail};
use clap::Parser;
use maas_e2e::envoy_config::{self, EnvoyConfigInput, WasmFilterOptions};
use maas_e2e::process::ManagedProcess;
use maas_e2e::{Stack, StackOptions, tools};
use maas_types::PolicyDocument;
use maas_types::apikey;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    /// Also benchmark LiteLLM proxy (installed from PyPI into .local/bench-venv).
    #[arg(long, env = "BENCH_LITELLM")]
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
    if let Err(e) = run() {
        eprintln!("maas-bench: {e:#}");
        std::process::exit(1);
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

// ---------------------------------------------------------------------------------------------
// small HTTP/1.1 client (keep-alive, Content-Length or chunked), for checks and memory fills

struct HttpConn {
    reader: BufReader<TcpStream>,
    addr: SocketAddr,
}

impl HttpConn {
    fn connect(addr: SocketAddr) -> Result<HttpConn> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.set_nodelay(true)?;
        Ok(HttpConn {
            reader: BufReader::new(s),
            addr,
        })
    }

    fn post(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(u16, Vec<u8>)> {
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            let _ = write!(req, "{k}: {v}\r\n");
        }
        req.push_str("\r\n");
        let s = self.reader.get_mut();
        s.write_all(req.as_bytes())?;
        s.write_all(body)?;
        self.read_response()
    }

    fn get(&mut self, path: &str) -> Result<(u16, Vec<u8>)> {
        let req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.addr);
        self.reader.get_mut().write_all(req.as_bytes())?;
        self.read_response()
    }

    fn read_response(&mut self) -> Result<(u16, Vec<u8>)> {
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {line:?}"))?;
        let mut length: Option<usize> = None;
        let mut chunked = false;
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                if k == "content-length" {
                    length = v.parse().ok();
                } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                    chunked = true;
                }
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                self.reader.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                    .with_context(|| format!("bad chunk size {line:?}"))?;
                if size == 0 {
                    line.clear();
                    self.reader.read_line(&mut line)?;
                    break;
                }
                let start = body.len();
                body.resize(start + size, 0);
                self.reader.read_exact(&mut body[start..])?;
                let mut crlf = [0u8; 2];
                self.reader.read_exact(&mut crlf)?;
            }
        } else if let Some(n) = length {
            body.resize(n, 0);
            self.reader.read_exact(&mut body)?;
        } else {
            self.reader.read_to_end(&mut body)?;
        }
        Ok((status, body))
    }
}

fn post_once(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(u16, String)> {
    let (status, body) = HttpConn::connect(addr)?.post(path, headers, body)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn get_text(addr: SocketAddr, path: &str) -> Result<String> {
    let (status, body) = HttpConn::connect(addr)?.get(path)?;
    let body = String::from_utf8_lossy(&body).into_owned();
    if status != 200 {
        bail!("GET {path} → {status}: {body}");
    }
    Ok(body)
}

// ---------------------------------------------------------------------------------------------
// processes

/// Distinct free ports (all held until all are picked).
fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "sched_setaffinity(CPU {cpu}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    let mut ports = [0u16; N];
    for (p, l) in ports.iter_mut().zip(&held) {
        *p = l.local_addr()?.port();
    }
    Ok(ports)
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn url_addr(url: &str) -> Result<SocketAddr> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("not host:port: {url}"))
}

struct BenchEnvoy {
    process: ManagedProcess,
    listen: SocketAddr,
    admin: SocketAddr,
}

impl BenchEnvoy {
    fn pid(&self) -> u32 {
        self.process.pid().unwrap_or(0)
    }
}

struct EnvoyInputs<'a> {
    policy: &'a PolicyDocument,
    companion_public: SocketAddr,
    companion_internal: SocketAddr,
    simulator: SocketAddr,
    wasm: PathBuf,
    envoy_bin: PathBuf,
    dir: PathBuf,
    /// Merged (deeply) over the filter's pluginConfig.
    plugin_extra: Option<Value>,
}

impl<'a> EnvoyInputs<'a> {
    /// The same inputs for an Envoy that talks to another companion, with `plugin_extra`.
    fn for_replica(
        &self,
        companion_public: SocketAddr,
        companion_internal: SocketAddr,
        plugin_extra: Value,
    ) -> EnvoyInputs<'a> {
        EnvoyInputs {
            policy: self.policy,
            companion_public,
            companion_internal,
            simulator: self.simulator,
            wasm: self.wasm.clone(),
            envoy_bin: self.envoy_bin.clone(),
            dir: self.dir.clone(),
            plugin_extra: Some(plugin_extra),
        }
    }
}

/// Renders the stack's Envoy config (with or without the filter) on fresh ports and starts it
/// with one worker, pinned to CPU 0.
fn start_envoy(
    inp: &EnvoyInputs<'_>,
    name: &str,
    filter: bool,
    cache_entries: u64,
) -> Result<BenchEnvoy> {
    start_envoy_with(
        inp,
        name,
        filter.then_some(inp.wasm.as_path()),
        cache_entries,
    )
}

/// Like [`start_envoy`] with any wasm module in the filter's place (`None` = bare Envoy).
fn start_envoy_with(
    inp: &EnvoyInputs<'_>,
    name: &str,
    wasm: Option<&Path>,
    cache_entries: u64,
) -> Result<BenchEnvoy> {
    start_envoy_wasm(
        inp,
        name,
        wasm,
        wasm == Some(inp.wasm.as_path()),
        cache_entries,
    )
}

/// Like [`start_envoy_with`]; `maas`: the module is a build of the MaaS filter (it gets the
/// stack's pluginConfig).
fn start_envoy_wasm(
    inp: &EnvoyInputs<'_>,
    name: &str,
    wasm: Option<&Path>,
    filter: bool,
    cache_entries: u64,
) -> Result<BenchEnvoy> {
    start_envoy_run(inp, name, wasm, filter, cache_entries, None)
}

/// Like [`start_envoy_wasm`]; `callgrind_out`: run Envoy under valgrind's callgrind (its dumps
/// at that path), so its instructions per request can be counted (much slower to start).
fn start_envoy_run(
    inp: &EnvoyInputs<'_>,
    name: &str,
    wasm: Option<&Path>,
    filter: bool,
    cache_entries: u64,
    callgrind_out: Option<&Path>,
) -> Result<BenchEnvoy> {
    let [listen, admin] = free_ports::<2>()?.map(local);
    let input = EnvoyConfigInput {
        policy: inp.policy,
        listen,
        admin,
        companion_public: inp.companion_public,
        companion_internal: inp.companion_internal,
        simulator: inp.simulator,
        filter: wasm.map(|w| WasmFilterOptions {
            wasm_path: w.to_path_buf(),
            poll_interval_ms: 2000,
        }),
        companion_tls: None,
    };
    let mut config: Value = serde_json::from_str(&envoy_config::render(&input)?)?;
    if filter {
        // The stack's pluginConfig, with a cache big enough for the memory measurement and TTLs
        // longer than the benchmark.
        let mut plugin = envoy_config::plugin_config(&input, 2000);
        plugin["cache"] = json!({
            "maxEntries": cache_entries,
            "maxTtlSeconds": 3600,
            "negativeTtlSeconds": 5
        });
        if let Some(extra) = &inp.plugin_extra {
            envoy_config::merge_json(&mut plugin, extra);
        }
        let value = config
            .pointer_mut("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters/0/typed_config/config/configuration/value")
            .context("rendered Envoy config has no wasm configuration where expected")?;
        *value = Value::String(plugin.to_string());
    }
    let path = inp.dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", "0"]);
    if let Some(out) = callgrind_out {
        // V8 writes the compiled filter's code at run time: valgrind must look for it.
        cmd.args(["valgrind", "--tool=callgrind", "--smc-check=all-non-file"])
            .arg(format!("--callgrind-out-file={}", out.display()));
    }
    cmd.arg(&inp.envoy_bin).arg("-c").arg(&path).args([
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "-l",
        "warning",
    ]);
    let log_path = inp.dir.join(format!("{name}.log"));
    let mut process = ManagedProcess::spawn(name, cmd, &log_path, libc::SIGTERM, libc::SIGKILL)?;
    let ready_within = Duration::from_secs(if callgrind_out.is_some() { 900 } else { 60 });
    let deadline = Instant::now() + ready_within;
    loop {
        if let Ok((200, _)) =
            maas_e2e::stack::http_request(admin, "GET", "/ready", Duration::from_secs(1))
        {
            break;
        }
        if let Some(status) = process.exited() {
            bail!("{name} exited ({status}):\n{}", process.log_tail(3000));
        }
        if Instant::now() > deadline {
            bail!(
                "{name} not ready after {} s:\n{}",
                ready_within.as_secs(),
                process.log_tail(3000)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(BenchEnvoy {
        process,
        listen,
        admin,
    })
}

// ---------------------------------------------------------------------------------------------
// keys straight into PostgreSQL

/// xorshift64*: benchmark keys need to be distinct, not secret.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

fn psql(pg_bin: &Path, db_url: &str, sql: &str, stdin: Option<&[u8]>) -> Result<String> {
    let mut child = Command::new(pg_bin.join("psql"))
        .args([db_url, "-v", "ON_ERROR_STOP=1", "-Atq", "-c", sql])
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run psql")?;
    if let Some(data) = stdin {
        let mut pipe = child.stdin.take().context("psql stdin")?;
        pipe.write_all(data)?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Inserts `n` active keys (key `i` of user `username(i)`) with the stored hash
/// (`maas_types::apikey`), and writes their plaintexts, one per fixed-width line, to `keys_file`.
fn insert_keys(
    pg_bin: &Path,
    db_url: &str,
    n: usize,
    keys_file: &Path,
    username: &dyn Fn(usize) -> String,
) -> Result<()> {
    // The companion creates the table at start (it may still be migrating).
    let deadline = Instant::now() + Duration::from_secs(60);
    while psql(pg_bin, db_url, "SELECT 1 FROM api_keys LIMIT 1", None).is_err() {
        if Instant::now() > deadline {
            bail!("table api_keys never appeared");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let expires = psql(
        pg_bin,
        db_url,
        "SELECT to_char((now() + interval '30 days') AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || '+00'",
        None,
    )?;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        ^ (u64::from(std::process::id()) << 32)
        | 1;
    let mut rng = Rng(seed);
    let mut rows = String::with_capacity(n * 200);
    let mut plain = String::with_capacity(n * (apikey::KEY_LEN + 1));
    for i in 0..n {
        let mut id = [0u8; apikey::KEY_ID_BYTES];
        let mut secret = [0u8; apikey::SECRET_BYTES];
        rng.fill(&mut id);
        rng.fill(&mut secret);
        let (key_id, key) = apikey::format_key(&id, &secret);
        let parts = apikey::parse(&key).map_err(|e| anyhow::anyhow!("generated key: {e}"))?;
        let hash = apikey::hash(parts);
        let mut u = [0u8; 16];
        rng.fill(&mut u);
        let h = hex(&u);
        let uuid = format!(
            "{}-{}-4{}-a{}-{}",
            &h[0..8],
            &h[8..12],
            &h[13..16],
            &h[17..20],
            &h[20..32]
        );
        let _ = writeln!(
            rows,
            "{uuid}\t{key_id}\t{hash}\t{}\tbench-{i}\t\\N\t{{system:authenticated,tier-bench-users}}\t{expires}",
            username(i)
        );
        plain.push_str(&key);
        plain.push('\n');
    }
    psql(
        pg_bin,
        db_url,
        "COPY api_keys (id, key_id, key_hash, username, name, tier, user_groups, expires_at) FROM STDIN",
        Some(rows.as_bytes()),
    )?;
    std::fs::write(keys_file, plain)?;
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// wrk

#[derive(Debug, Clone, Default)]
struct WrkResult {
    /// Requests answered (all runs together).
    requests: u64,
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// Envoy's CPU time (user + system, all threads) per request, µs; 0 when unknown.
    cpu_us: f64,
    /// Two-replica variants: the companions' Redis round trips and lease batches per second
    /// during the run's steady state (all companions together).
    redis_rt_per_s: Option<f64>,
    lease_batches_per_s: Option<f64>,
}

#[derive(Clone)]
enum Load {
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
struct Variant {
    name: &'static str,
    /// What its ratios are against.
    baseline: &'static str,
    addr: SocketAddr,
    path: String,
    body_file: PathBuf,
    load: Load,
    /// Concurrencies it runs at (None = all).
    only_c: Option<Vec<u32>>,
    /// The Envoy serving it (0: none of ours), whose CPU per request is measured.
    envoy_pid: u32,
    /// Two gateways at once (`two-replica`): one wrk per gateway, both at the same time.
    pair: Option<Pair>,
}

/// The second gateway of a two-replica variant, and where the companions count Redis calls.
#[derive(Clone)]
struct Pair {
    addr: SocketAddr,
    envoy_pid: u32,
    /// Every companion's metrics listener (`maas_companion_redis_round_trips_total`, …).
    companion_metrics: Vec<SocketAddr>,
}

struct Wrk<'a> {
    lua_dir: &'a Path,
    keys_file: &'a Path,
    keys_total: usize,
    key_offset: usize,
}

impl Wrk<'_> {
    /// wrk (pinned to CPU 1) against `addr` with `v`'s load; `key_start`: where rotate.lua
    /// starts in its keys (each wrk of a pair starts elsewhere).
    fn command(
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

    fn run(&mut self, v: &Variant, c: u32, seconds: u64) -> Result<WrkResult> {
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
    fn run_pair(&mut self, v: &Variant, pair: &Pair, c: u32, seconds: u64) -> Result<WrkResult> {
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
struct WrkRun {
    requests: u64,
    duration_us: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
}

impl WrkRun {
    fn parse(out: &std::process::Output) -> Result<WrkRun> {
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
            errors: (n("connect") + n("read") + n("write") + n("status") + n("timeout")) as u64,
        })
    }
}

/// Runs side by side as one result: req/s summed, p50 = the runs' p50s weighted by their
/// requests, p99 = the highest, errors summed; `cpu_ticks`: the serving Envoys' CPU during them.
fn combine_runs(runs: &[WrkRun], cpu_ticks: Option<u64>) -> WrkResult {
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
        errors: runs.iter().map(|r| r.errors).sum(),
        cpu_us,
        redis_rt_per_s: None,
        lease_batches_per_s: None,
    }
}

/// The steady part of a run of `seconds` (from its start): from a quarter in (at most 2 s) to
/// 0.3 s before its end.
fn steady_window(seconds: u64) -> (Duration, Duration) {
    let total = Duration::from_secs(seconds);
    let from = (total / 4).min(Duration::from_secs(2));
    let to = total.saturating_sub(Duration::from_millis(300)).max(from);
    (from, to)
}

/// Redis round trips and lease batches so far, summed over the companions' `/metrics`.
fn lease_counters(metrics: &[SocketAddr]) -> Result<(f64, f64)> {
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
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let value = rest.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// User + system CPU time of process `pid` (all threads), in clock ticks; None for pid 0 or
/// when unreadable.
fn cpu_ticks(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces), from field 3 on: utime is 14, stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

// ---------------------------------------------------------------------------------------------
// host-call prices (`--only hostcalls`, and in the full run) and the filter's host-call counts

/// The kinds of host call `tests/bench/hostcall-filter` makes N of per request, and what each is.
const HOST_CALL_KINDS: &[(&str, &str)] = &[
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
const PRICED_CALLS: &[(&str, &str, Option<&str>)] = &[
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
struct Prices {
    /// Calls per request.
    n: u32,
    concurrency: u32,
    seconds: u64,
    rounds: usize,
    /// (kind, req/s, Envoy CPU µs per request), in HOST_CALL_KINDS order.
    rows: Vec<(String, f64, f64)>,
}

impl Prices {
    fn cpu(&self, kind: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|(k, ..)| k == kind)
            .map(|r| r.2)
            .filter(|c| c.is_finite())
    }

    /// µs per call of a hostcall-filter kind: its CPU per request minus that of `minus` (default
    /// `none`), divided by N.
    fn per_call(&self, kind: &str, minus: Option<&str>) -> Option<f64> {
        let base = self.cpu(minus.unwrap_or("none"))?;
        Some((self.cpu(kind)? - base) / f64::from(self.n.max(1)))
    }

    /// µs per call of one of the filter's host-call kinds (PRICED_CALLS); None when unpriced.
    fn of_call(&self, label: &str) -> Option<f64> {
        let (_, kind, minus) = PRICED_CALLS.iter().find(|(l, ..)| *l == label)?;
        self.per_call(kind, *minus)
    }
}

/// The hostcall-filter kinds that price `labels` (with `none`), in HOST_CALL_KINDS order.
fn kinds_pricing<'a>(labels: impl IntoIterator<Item = &'a str>) -> Vec<&'static str> {
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

/// Envoy's CPU per request with N host calls of each of `kinds` (the hostcall filter, chosen per
/// request by `x-bench-kind` / `x-bench-n`), medians over rounds; `kinds` must hold `none`.
fn host_call_prices(
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
fn render_prices(p: &Prices) -> String {
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
struct CallCounts {
    variant: String,
    total: u64,
    by_kind: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct AllocCounts {
    variant: String,
    count: u64,
    bytes: u64,
    per_callback: Vec<u64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct HostCallCounts {
    calls: Vec<CallCounts>,
    allocations: Vec<AllocCounts>,
}

/// The file the filter's budget tests wrote; Err says why there is none.
fn read_host_call_counts(path: Option<&Path>) -> Result<HostCallCounts, String> {
    let path = path.ok_or("no file given (BENCH_HOST_CALLS; `./scripts/bench.sh` sets it)")?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_host_call_counts(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse_host_call_counts(text: &str) -> Result<HostCallCounts, String> {
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
fn bill(counts: &CallCounts, prices: &Prices) -> (f64, u64) {
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
// TODO(issue 27): the split of maas-bench.rs (another branch) brings this under 100 lines.
#[allow(clippy::too_many_lines)]
fn render_host_calls(counts: &Result<HostCallCounts, String>, prices: Option<&Prices>) -> String {
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
    o.push('\n');
    if let Some(p) = prices {
        o.push_str(&render_prices(p));
        o.push('\n');
    }
    o
}

// ---------------------------------------------------------------------------------------------
// memory

#[derive(Debug, Clone, Copy, Default)]
struct Mem {
    rss_kib: u64,
    /// Resident part of the huge reservations V8 makes for wasm linear memory.
    wasm_linear_kib: u64,
    /// tcmalloc's allocated bytes (Envoy's heap, which holds proxy-wasm shared data).
    heap_allocated_kib: u64,
}

fn mem_of(pid: u32, admin: SocketAddr) -> Mem {
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

fn mib(kib: i64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// Sends `keys[from..to]` through the filter, `threads` keep-alive connections in parallel.
fn fill_keys(addr: SocketAddr, keys: &[String], body: &[u8], threads: usize) -> Result<usize> {
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

// ---------------------------------------------------------------------------------------------
// junk-bound: shared data stays bounded whatever clients send

/// Sends `Bearer junk-<n>` for n in `from..to` (each distinct, each refused 401 by the companion
/// and then cached negatively), `threads` keep-alive connections in parallel. Returns the answers
/// that were not 401.
fn fill_junk(
    addr: SocketAddr,
    from: usize,
    to: usize,
    body: &[u8],
    threads: usize,
) -> Result<usize> {
    let ids: Vec<usize> = (from..to).collect();
    let chunk = ids.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || -> Result<usize> {
                    let mut conn = HttpConn::connect(addr)?;
                    let mut bad = 0;
                    for n in part {
                        let auth = format!("Bearer junk-{n}");
                        let status = match conn.post(CHAT_PATH, &[("Authorization", &auth)], body) {
                            Ok((s, _)) => s,
                            Err(_) => {
                                conn = HttpConn::connect(addr)?;
                                conn.post(CHAT_PATH, &[("Authorization", &auth)], body)?.0
                            }
                        };
                        if status != 401 {
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
                    .map_err(|_| anyhow::anyhow!("junk thread panicked"))?
            })
            .sum::<Result<usize>>()
    })
}

struct JunkRound {
    /// Junk tokens sent so far.
    sent: usize,
    mem: Mem,
    /// Answers that were not 401.
    failed: usize,
    requests_per_s: f64,
}

struct Junk {
    cache_entries: u64,
    base: Mem,
    rounds: Vec<JunkRound>,
}

/// A fresh Envoy with the filter (`cache.maxEntries` = `cache_entries`) takes `per_round`
/// distinct junk bearer tokens, `rounds` times: Envoy's heap (tcmalloc `allocated`, which holds
/// proxy-wasm shared data) before and after each round.
fn junk_bound(
    inputs: &EnvoyInputs<'_>,
    cached_auth: &str,
    per_round: usize,
    rounds: usize,
    cache_entries: u64,
) -> Result<Junk> {
    log(format!(
        "junk-bound: fresh Envoy (cache.maxEntries {cache_entries}), {rounds} × {per_round} distinct junk bearer tokens …"
    ));
    let envoy = start_envoy(inputs, "envoy-junk", true, cache_entries)?;
    let body = json_body(16);
    // One good request first: the VM is warm and the policy loaded before the baseline.
    let (s, t) = post_once(
        envoy.listen,
        CHAT_PATH,
        &[("Authorization", cached_auth)],
        body.as_bytes(),
    )?;
    if s != 200 {
        bail!("envoy-junk: {s} {t}");
    }
    std::thread::sleep(Duration::from_millis(500));
    let base = mem_of(envoy.pid(), envoy.admin);
    let mut done = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let t = Instant::now();
        let from = round * per_round;
        let failed = fill_junk(envoy.listen, from, from + per_round, body.as_bytes(), 16)?;
        let secs = t.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(500));
        let m = mem_of(envoy.pid(), envoy.admin);
        log(format!(
            "junk-bound: {} junk tokens in {secs:.1} s ({failed} not 401): heap {} MiB (base {} MiB)",
            from + per_round,
            mib(m.heap_allocated_kib as i64),
            mib(base.heap_allocated_kib as i64)
        ));
        done.push(JunkRound {
            sent: from + per_round,
            mem: m,
            failed,
            requests_per_s: per_round as f64 / secs.max(1e-9),
        });
    }
    Ok(Junk {
        cache_entries,
        base,
        rounds: done,
    })
}

fn render_junk(j: &Junk, args: &Args) -> String {
    let mut o = String::new();
    let per_round = j.rounds.first().map_or(0, |r| r.sent);
    let _ = writeln!(
        o,
        "\n## Shared data stays bounded: distinct junk bearer tokens (`junk-bound`)\n"
    );
    let _ = writeln!(
        o,
        "A fresh Envoy with the filter (`cache.maxEntries` {}, `negativeTtlSeconds` 5) takes {} rounds of {per_round} requests, each with a new bearer token `junk-<n>` (the companion answers 401; the filter caches the refusal). The cache lives in `cache.maxEntries` fixed shared-data slots (two candidates per credential), so once the slots are full the heap must stop growing. Envoy heap = tcmalloc `allocated` from admin `/memory`. Command: `{}`.\n",
        j.cache_entries,
        j.rounds.len(),
        args.command
    );
    let _ = writeln!(
        o,
        "| junk tokens sent | Envoy heap MiB | Δ heap MiB (vs before) | Δ heap in this round MiB | not 401 | req/s |"
    );
    let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(
        o,
        "| 0 | {} | – | – | – | – |",
        mib(j.base.heap_allocated_kib as i64)
    );
    let mut prev = j.base.heap_allocated_kib as i64;
    let mut deltas = Vec::with_capacity(j.rounds.len());
    for r in &j.rounds {
        let h = r.mem.heap_allocated_kib as i64;
        deltas.push(h - prev);
        let _ = writeln!(
            o,
            "| {} | {} | {:+.1} | {:+.1} | {} | {:.0} |",
            r.sent,
            mib(h),
            (h - j.base.heap_allocated_kib as i64) as f64 / 1024.0,
            (h - prev) as f64 / 1024.0,
            r.failed,
            r.requests_per_s
        );
        prev = h;
    }
    if let (Some(&first), Some(&last)) = (deltas.first(), deltas.last()) {
        let total = prev - j.base.heap_allocated_kib as i64;
        let per_slot = total as f64 * 1024.0 / j.cache_entries.max(1) as f64;
        let _ = writeln!(
            o,
            "\nFirst round {:+.1} MiB, last round {:+.1} MiB; in all {:+.1} MiB = {per_slot:.0} bytes per configured cache slot — {}.",
            first as f64 / 1024.0,
            last as f64 / 1024.0,
            total as f64 / 1024.0,
            if last.abs() * 10 <= first.abs().max(1024) {
                "the heap plateaus within the configured bound"
            } else {
                "the heap did NOT plateau"
            }
        );
    }
    o
}

// ---------------------------------------------------------------------------------------------
// streams: time to first byte and memory per stream

/// How long the simulator waits: between stream chunks, or before its whole answer.
#[derive(Clone, Copy)]
enum SimDelay {
    Chunks(u32),
    Answer(u32),
}

impl SimDelay {
    fn header(self) -> String {
        match self {
            SimDelay::Chunks(ms) => format!("x-sim-chunk-delay-ms: {ms}\r\n"),
            SimDelay::Answer(ms) => format!("x-sim-response-delay-ms: {ms}\r\n"),
        }
    }
}

/// Sends one streamed request on a fresh connection; returns (time to the response headers'
/// first byte, time to the first SSE event), both from the end of the write.
fn ttfb_once(addr: SocketAddr, auth: &str, body: &[u8], delay: SimDelay) -> Result<(f64, f64)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let req = format!(
        "POST {CHAT_PATH} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nAuthorization: {auth}\r\n{}Connection: close\r\nContent-Length: {}\r\n\r\n",
        delay.header(),
        body.len()
    );
    let mut full = req.into_bytes();
    full.extend_from_slice(body);
    s.write_all(&full)?;
    let t0 = Instant::now();
    let mut buf = Vec::with_capacity(16384);
    let mut tmp = [0u8; 16384];
    let mut first_byte = None;
    let mut first_event = None;
    loop {
        let n = s.read(&mut tmp)?;
        if n == 0 {
            break;
        }
        if first_byte.is_none() {
            first_byte = Some(t0.elapsed());
        }
        buf.extend_from_slice(&tmp[..n]);
        if first_event.is_none()
            && let Some(h) = find(&buf, b"\r\n\r\n")
            && find(&buf[h..], b"data:").is_some()
        {
            first_event = Some(t0.elapsed());
        }
    }
    let text = String::from_utf8_lossy(&buf);
    if !text.starts_with("HTTP/1.1 200")
        || (body.windows(6).any(|w| w == b"stream") && !text.contains("[DONE]"))
    {
        bail!(
            "stream failed: {}",
            text.chars().take(400).collect::<String>()
        );
    }
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0).unwrap_or(f64::NAN);
    Ok((ms(first_byte), ms(first_event)))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Peak memory of `envoy` while `n` streams of `tokens` chunks, `delay_ms` apart, are in flight.
fn stream_memory(
    envoy: &BenchEnvoy,
    auth: &str,
    n: usize,
    tokens: u32,
    delay_ms: u32,
) -> Result<Mem> {
    let body = stream_body(tokens);
    let addr = envoy.listen;
    let done = std::sync::atomic::AtomicUsize::new(0);
    let mut peak = Mem::default();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let body = body.as_bytes();
                let done = &done;
                s.spawn(move || {
                    let r = ttfb_once(addr, auth, body, SimDelay::Chunks(delay_ms));
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    r
                })
            })
            .collect();
        while done.load(std::sync::atomic::Ordering::SeqCst) < n {
            let m = mem_of(envoy.pid(), envoy.admin);
            peak.rss_kib = peak.rss_kib.max(m.rss_kib);
            peak.wasm_linear_kib = peak.wasm_linear_kib.max(m.wasm_linear_kib);
            peak.heap_allocated_kib = peak.heap_allocated_kib.max(m.heap_allocated_kib);
            std::thread::sleep(Duration::from_millis(100));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("stream thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(peak)
}

fn json_body(max_tokens: u32) -> String {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short about benchmarks please"}],
        "max_tokens": max_tokens
    })
    .to_string()
}

fn stream_body(max_tokens: u32) -> String {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short about benchmarks please"}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true}
    })
    .to_string()
}

// ---------------------------------------------------------------------------------------------
// LiteLLM

fn start_litellm(root: &Path, dir: &Path, sim: SocketAddr) -> Result<(ManagedProcess, SocketAddr)> {
    let bin = root.join(".local/bench-venv/bin/litellm");
    if !bin.is_file() {
        bail!(
            "{} missing: ./scripts/bench.sh --litellm installs it",
            bin.display()
        );
    }
    let [port] = free_ports::<1>()?;
    let config = dir.join("litellm.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      api_base: http://{sim}/v1\n      api_key: sk-sim\ngeneral_settings:\n  master_key: {LITELLM_MASTER_KEY}\nlitellm_settings:\n  telemetry: false\n"
        ),
    )?;
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", "0"])
        .arg(&bin)
        .arg("--config")
        .arg(&config)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--num_workers",
            "1",
        ])
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_TELEMETRY", "False")
        .env("DISABLE_SCHEMA_UPDATE", "True");
    let mut p = ManagedProcess::spawn(
        "litellm",
        cmd,
        &dir.join("litellm.log"),
        libc::SIGTERM,
        libc::SIGKILL,
    )?;
    let addr = local(port);
    let deadline = Instant::now() + Duration::from_secs(180);
    let body = json_body(16);
    loop {
        let auth = format!("Bearer {LITELLM_MASTER_KEY}");
        if let Ok((200, _)) = post_once(
            addr,
            "/v1/chat/completions",
            &[("Authorization", &auth)],
            body.as_bytes(),
        ) {
            break;
        }
        if let Some(status) = p.exited() {
            bail!("litellm exited ({status}):\n{}", p.log_tail(3000));
        }
        if Instant::now() > deadline {
            bail!("litellm not answering after 180 s:\n{}", p.log_tail(3000));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok((p, addr))
}

// ---------------------------------------------------------------------------------------------
// statistics and report

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

struct Target {
    what: String,
    measured: String,
    met: Option<bool>,
}

// TODO(issue 27): the split of maas-bench.rs (another branch) brings this under 100 lines.
#[allow(clippy::too_many_lines)]
fn run() -> Result<()> {
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
    // Envoy gets CPU 0 to itself; this process (the simulator, the measuring threads) and what it
    // starts (companion, PostgreSQL) share CPU 1 with wrk. Threads inherit the mask.
    pin_to_cpu(1)?;
    let root = tools::workspace_root();
    let lua_dir = root.join("tests/bench");
    let started_at = std::time::SystemTime::now();
    // `hostcalls` alone: the prices of every kind, printed only; with other variants (and in
    // the full run) the prices that bill the filter's calls, in the report.
    let hostcalls_only = !args.only.is_empty() && args.only.iter().all(|o| o == "hostcalls");
    let want_prices = args.only.is_empty() || args.only.iter().any(|o| o == "hostcalls");
    // two-replica: a second companion and a Redis that both companions share.
    // Envoy's instructions per request under valgrind: the full run, or `--only instructions`
    // (printed only).
    let valgrind_found = Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let instructions_only =
        !args.only.is_empty() && args.only.iter().all(|o| o == ENVOY_INSTRUCTIONS);
    let want_instructions =
        !args.quick && (args.only.is_empty() || args.only.iter().any(|o| o == ENVOY_INSTRUCTIONS));
    if want_instructions && !valgrind_found {
        log("valgrind not found: no count of Envoy's instructions per request");
    }
    let want_instructions = want_instructions && valgrind_found;
    let two_replica = !hostcalls_only
        && (args.only.is_empty() || args.only.iter().any(|o| o.starts_with(TWO_REPLICA)));
    // Only two-replica: its section is replaced in BENCH_OUT, the rest of the file kept.
    let two_replica_only =
        !args.only.is_empty() && args.only.iter().all(|o| o.starts_with(TWO_REPLICA));

    // ---- the stack ----
    log(format!(
        "starting the stack (PostgreSQL, {}, simulator) …",
        if two_replica {
            "2 companions, Redis"
        } else {
            "companion"
        }
    ));
    let stack = Stack::start(StackOptions {
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
    })?;
    let dir = stack.dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let policy = PolicyDocument::from_value(yaml_serde::from_str::<Value>(POLICY)?)
        .map_err(|e| anyhow::anyhow!("bench policy: {e}"))?;
    let inputs = EnvoyInputs {
        policy: &policy,
        companion_public: url_addr(&stack.companion_public_url())?,
        companion_internal: url_addr(&stack.companion_internal_url())?,
        simulator: stack.sim().addr(),
        wasm: tools::wasm_file()?,
        envoy_bin: tools::envoy_bin()?,
        dir: dir.clone(),
        plugin_extra: None,
    };
    let pg_bin = tools::pg_bin_dir()?;
    // The filter's host calls per request (its budget tests' figures), and the hostcall filter
    // (`tests/bench/hostcall-filter`): the wasm-floor variant and the prices.
    let counts = read_host_call_counts(args.host_calls.as_deref());
    if let Err(why) = &counts {
        log(format!("no host-call counts: {why}"));
    }
    let hostcall_wasm = std::env::var_os("BENCH_HOSTCALL_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            root.join("target/bench-hostcall/wasm32-wasip1/release/maas_bench_hostcall_filter.wasm")
        });
    let want_floor = args.only.is_empty() || args.only.iter().any(|o| o == "wasm-floor");
    let hostcall_envoy = if !want_prices && !want_floor {
        None
    } else if hostcall_wasm.is_file() {
        Some(start_envoy_with(
            &inputs,
            "envoy-hostcall",
            Some(&hostcall_wasm),
            1000,
        )?)
    } else {
        log(format!(
            "{} not built (./scripts/bench.sh builds tests/bench/hostcall-filter): no wasm-floor variant, no host-call prices",
            hostcall_wasm.display()
        ));
        None
    };
    // BENCH_HOSTCALL_KINDS: a subset (comma separated; `none` is always measured).
    let wanted: Vec<String> = std::env::var("BENCH_HOSTCALL_KINDS")
        .unwrap_or_default()
        .split(',')
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .collect();
    let price_kinds: Vec<&'static str> = if !wanted.is_empty() || hostcalls_only {
        HOST_CALL_KINDS
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| wanted.is_empty() || *k == "none" || wanted.iter().any(|w| w == k))
            .collect()
    } else {
        // The full run: only the kinds that price the filter's calls (all of them when the
        // counts are missing).
        match &counts {
            Ok(c) => kinds_pricing(
                c.calls
                    .iter()
                    .flat_map(|v| v.by_kind.keys().map(String::as_str)),
            ),
            Err(_) => kinds_pricing(PRICED_CALLS.iter().map(|(l, ..)| *l)),
        }
    };
    if hostcalls_only {
        // Its own mode: prices of host calls, nothing else (printed, never written to BENCH_OUT).
        let envoy = hostcall_envoy.context("the hostcall filter is not built")?;
        let prices = host_call_prices(&args, &envoy, &price_kinds, &lua_dir, &dir)?;
        println!("{}", render_host_calls(&counts, Some(&prices)));
        stack.shutdown();
        return Ok(());
    }

    // ---- keys ----
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
    insert_keys(&pg_bin, &stack.database_url(), pool, &keys_file, &|_| {
        "bench".to_string()
    })?;
    log(format!("… done in {:.1} s", t.elapsed().as_secs_f64()));

    // ---- bodies ----
    let body_json = dir.join("chat.json");
    std::fs::write(&body_json, json_body(16))?;
    let body_stream = dir.join("chat-stream.json");
    let stream_tokens = 64;
    std::fs::write(&body_stream, stream_body(stream_tokens))?;
    let body_auth = dir.join("authenticate.json");
    std::fs::write(&body_auth, json!({"credential": cached_key}).to_string())?;

    // ---- Envoys ----
    log("starting bare Envoy and Envoy with the filter (--concurrency 1, CPU 0) …");
    let bare = start_envoy(&inputs, "envoy-bare", false, 1000)?;
    let filtered = start_envoy(
        &inputs,
        "envoy-filter",
        true,
        (pool as u64 + 1000).max(100_000),
    )?;

    // A trivial Rust wasm filter (tests/bench/noop-filter), when built: the cost of any filter.
    let noop_wasm = std::env::var_os("BENCH_NOOP_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            root.join("target/bench-noop/wasm32-wasip1/release/maas_bench_noop_filter.wasm")
        });
    let noop = if noop_wasm.is_file() {
        Some(start_envoy_with(
            &inputs,
            "envoy-noop",
            Some(&noop_wasm),
            1000,
        )?)
    } else {
        log(format!(
            "{} not built: no wasm-noop variant",
            noop_wasm.display()
        ));
        None
    };

    // Other builds of the filter, measured side by side with this one (BENCH_COMPARE_WASM:
    // `label=path,…`, e.g. `old=/tmp/old_filter.wasm`): variants `filter-cached:<label>`.
    let mut compare = Vec::new();
    let mut compare_wasm: Vec<(&'static str, PathBuf)> = Vec::new();
    for item in std::env::var("BENCH_COMPARE_WASM")
        .unwrap_or_default()
        .split(',')
        .filter(|i| !i.trim().is_empty())
    {
        let (label, path) = item
            .split_once('=')
            .with_context(|| format!("BENCH_COMPARE_WASM: `{item}` is not label=path"))?;
        let envoy = start_envoy_wasm(
            &inputs,
            &format!("envoy-filter-{label}"),
            Some(Path::new(path.trim())),
            true,
            (pool as u64 + 1000).max(100_000),
        )?;
        let name: &'static str =
            Box::leak(format!("filter-cached:{}", label.trim()).into_boxed_str());
        compare.push((name, envoy));
        compare_wasm.push((name, PathBuf::from(path.trim())));
    }

    let fixed = |auth: Option<&str>| Load::Fixed {
        auth: auth.map(str::to_string),
        extra_headers: String::new(),
    };
    let mut variants = vec![
        Variant {
            name: "direct",
            baseline: "envoy",
            addr: stack.sim().addr(),
            path: SIM_CHAT_PATH.into(),
            body_file: body_json.clone(),
            load: fixed(Some(&cached_auth)),
            only_c: None,
            envoy_pid: 0,
            pair: None,
        },
        Variant {
            name: "envoy",
            baseline: "envoy",
            addr: bare.listen,
            path: CHAT_PATH.into(),
            body_file: body_json.clone(),
            load: fixed(Some(&cached_auth)),
            only_c: None,
            envoy_pid: bare.pid(),
            pair: None,
        },
        Variant {
            name: "filter-cached",
            baseline: "envoy",
            addr: filtered.listen,
            path: CHAT_PATH.into(),
            body_file: body_json.clone(),
            load: fixed(Some(&cached_auth)),
            only_c: None,
            envoy_pid: filtered.pid(),
            pair: None,
        },
        Variant {
            name: "envoy-stream",
            baseline: "envoy-stream",
            addr: bare.listen,
            path: CHAT_PATH.into(),
            body_file: body_stream.clone(),
            load: fixed(Some(&cached_auth)),
            only_c: None,
            envoy_pid: bare.pid(),
            pair: None,
        },
        Variant {
            name: "filter-stream",
            baseline: "envoy-stream",
            addr: filtered.listen,
            path: CHAT_PATH.into(),
            body_file: body_stream.clone(),
            load: fixed(Some(&cached_auth)),
            only_c: None,
            envoy_pid: filtered.pid(),
            pair: None,
        },
        Variant {
            name: "filter-miss",
            baseline: "envoy",
            addr: filtered.listen,
            path: CHAT_PATH.into(),
            body_file: body_json.clone(),
            load: Load::Miss,
            only_c: None,
            envoy_pid: filtered.pid(),
            pair: None,
        },
        Variant {
            name: "companion-auth",
            baseline: "-",
            addr: inputs.companion_internal,
            path: "/internal/v1/authenticate".into(),
            body_file: body_auth.clone(),
            load: fixed(None),
            only_c: Some(vec![32]),
            envoy_pid: 0,
            pair: None,
        },
    ];
    let mut _litellm = None;
    if args.litellm {
        log("starting LiteLLM proxy (CPU 0) …");
        let (p, addr) = start_litellm(&root, &dir, stack.sim().addr())?;
        _litellm = Some(p);
        variants.push(Variant {
            name: "litellm",
            baseline: "envoy",
            addr,
            path: "/v1/chat/completions".into(),
            body_file: body_json.clone(),
            load: fixed(Some(&format!("Bearer {LITELLM_MASTER_KEY}"))),
            only_c: None,
            envoy_pid: 0,
            pair: None,
        });
    }
    if let Some(noop) = &noop {
        let at = variants
            .iter()
            .position(|v| v.name == "envoy")
            .map_or(0, |i| i + 1);
        variants.insert(
            at,
            Variant {
                name: "wasm-noop",
                baseline: "envoy",
                addr: noop.listen,
                path: CHAT_PATH.into(),
                body_file: body_json.clone(),
                load: fixed(Some(&cached_auth)),
                only_c: None,
                envoy_pid: noop.pid(),
                pair: None,
            },
        );
    }
    // The host calls of a cached JSON request and nothing else: the same request as
    // filter-cached's (route, body, credential), to the hostcall filter's kind `floor`.
    if let Some(floor) = &hostcall_envoy {
        let at = variants
            .iter()
            .position(|v| v.name == "filter-cached")
            .unwrap_or(variants.len());
        variants.insert(
            at,
            Variant {
                name: "wasm-floor",
                baseline: "envoy",
                addr: floor.listen,
                path: CHAT_PATH.into(),
                body_file: body_json.clone(),
                load: Load::Fixed {
                    auth: Some(cached_auth.clone()),
                    extra_headers: "x-bench-kind: floor".into(),
                },
                only_c: None,
                envoy_pid: floor.pid(),
                pair: None,
            },
        );
    }
    for (name, envoy) in &compare {
        let at = variants
            .iter()
            .position(|v| v.name == "filter-cached")
            .map_or(variants.len(), |i| i + 1);
        variants.insert(
            at,
            Variant {
                name,
                baseline: "envoy",
                addr: envoy.listen,
                path: CHAT_PATH.into(),
                body_file: body_json.clone(),
                load: fixed(Some(&cached_auth)),
                only_c: None,
                envoy_pid: envoy.pid(),
                pair: None,
            },
        );
    }
    // Two gateways (each its own companion; one Redis), global limits off and on.
    let mut two_replica_envoys = Vec::new();
    if two_replica {
        let keys_2r = dir.join("two-replica-keys.txt");
        insert_keys(
            &pg_bin,
            &stack.database_url(),
            TWO_REPLICA_SUBJECTS,
            &keys_2r,
            &|i| format!("bench-user-{i}"),
        )?;
        let companion_metrics = (0..2)
            .map(|i| url_addr(&stack.companion_metrics_url_of(i)))
            .collect::<Result<Vec<_>>>()?;
        log("starting two-replica Envoys: 2 with global limits off, 2 on (CPU 0) …");
        for (name, enabled) in [("two-replica-off", false), ("two-replica-on", true)] {
            let mut pair = Vec::with_capacity(2);
            for i in 0..2 {
                let mut global = json!({"enabled": enabled});
                if enabled {
                    global["replicaId"] = json!(format!("bench-gateway-{i}"));
                }
                let inp = inputs.for_replica(
                    url_addr(&stack.companion_public_url_of(i))?,
                    url_addr(&stack.companion_internal_url_of(i))?,
                    json!({"limits": {"global": global}}),
                );
                pair.push(start_envoy(&inp, &format!("envoy-{name}-{i}"), true, 1000)?);
            }
            variants.push(Variant {
                name,
                baseline: "two-replica-off",
                addr: pair[0].listen,
                path: CHAT_PATH.into(),
                body_file: body_json.clone(),
                load: Load::Rotate {
                    keys_file: keys_2r.clone(),
                },
                only_c: None,
                envoy_pid: pair[0].pid(),
                pair: Some(Pair {
                    addr: pair[1].listen,
                    envoy_pid: pair[1].pid(),
                    companion_metrics: companion_metrics.clone(),
                }),
            });
            two_replica_envoys.push((name, pair));
        }
    }
    if !args.only.is_empty() {
        variants.retain(|v| {
            args.only.iter().any(|o| {
                o == v.name
                    || (o == "filter-cached" && v.name.starts_with("filter-cached:"))
                    || (o == TWO_REPLICA && v.pair.is_some())
            })
        });
    }

    // ---- sanity: each variant answers 200 with usage ----
    for v in &variants {
        let body = std::fs::read(&v.body_file)?;
        let auth = match &v.load {
            Load::Fixed { auth, .. } => auth.clone(),
            Load::Miss => Some(cached_auth.clone()),
            Load::Rotate { keys_file } => {
                // Every key at every gateway of the pair.
                let addrs = std::iter::once(v.addr).chain(v.pair.as_ref().map(|p| p.addr));
                for addr in addrs {
                    for key in std::fs::read_to_string(keys_file)?.lines() {
                        let auth = format!("Bearer {key}");
                        let (status, text) =
                            post_once(addr, &v.path, &[("Authorization", &auth)], &body)?;
                        if status != 200 || !text.contains("usage") {
                            bail!(
                                "{} at {addr}: POST {} → {status}: {}",
                                v.name,
                                v.path,
                                text.chars().take(300).collect::<String>()
                            );
                        }
                    }
                }
                continue;
            }
        };
        let mut headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| vec![("Authorization", a)])
            .unwrap_or_default();
        if let Load::Fixed { extra_headers, .. } = &v.load {
            headers.extend(extra_headers.split('|').filter_map(|h| {
                let (name, value) = h.split_once(':')?;
                Some((name.trim(), value.trim()))
            }));
        }
        let (status, text) = post_once(v.addr, &v.path, &headers, &body)
            .with_context(|| format!("{}: POST http://{}{}", v.name, v.addr, v.path))?;
        let ok = status == 200 && (v.name == "companion-auth" || text.contains("usage"));
        if !ok {
            bail!(
                "{}: POST {} → {status}: {}",
                v.name,
                v.path,
                text.chars().take(300).collect::<String>()
            );
        }
    }
    // Warm-up: connections, JIT, caches.
    let mut wrk = Wrk {
        lua_dir: &lua_dir,
        keys_file: &keys_file,
        keys_total: pool,
        key_offset: max_cached, // keys below this are kept for the memory measurement
    };
    log("warming up …");
    for v in variants.iter().filter(|v| !matches!(v.load, Load::Miss)) {
        wrk.run(v, 8, 1)?;
    }

    // ---- rounds ----
    let mut results: BTreeMap<(String, u32), Vec<WrkResult>> = BTreeMap::new();
    for round in 1..=args.rounds {
        for &c in &args.concurrency {
            for v in &variants {
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

    // Envoy's CPU per request (robust on a shared machine: it does not depend on how much CPU
    // Envoy got), with req/s against the baseline, per variant.
    for &c in &args.concurrency {
        for v in &variants {
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

    // ---- profile ----
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
        let mut targets = vec![("envoy", bare.pid())];
        if let Some(n) = &noop {
            targets.push(("wasm-noop", n.pid()));
        }
        if let Some(f) = &hostcall_envoy {
            targets.push(("wasm-floor", f.pid()));
        }
        targets.extend([
            ("filter-cached", filtered.pid()),
            ("filter-stream", filtered.pid()),
            ("envoy-stream", bare.pid()),
        ]);
        for (vname, pid) in targets {
            let Some(v) = variants.iter().find(|v| v.name == vname) else {
                continue;
            };
            log(format!(
                "profiling {vname} at c={c} (perf record -e cpu-clock) …"
            ));
            match profile_run(&mut wrk, v, c, args.seconds, pid, &dir) {
                Ok(p) => profiles.push((vname, p)),
                Err(e) => log(format!("profile of {vname} failed: {e:#}")),
            }
        }
    }

    // ---- time to first byte (alternating bare / filter) ----
    let mut ttfb = BTreeMap::new();
    let mut ttfb_more: Vec<TtfbRow> = Vec::new();
    if variants.iter().any(|v| v.name == "filter-stream") {
        log(format!(
            "time to first byte: {} streams per Envoy, alternating …",
            args.ttfb_samples
        ));
        let body = stream_body(32);
        let (mut hb, mut eb, mut hf, mut ef) = (vec![], vec![], vec![], vec![]);
        for _ in 0..args.ttfb_samples {
            for (addr, heads, events) in [
                (bare.listen, &mut hb, &mut eb),
                (filtered.listen, &mut hf, &mut ef),
            ] {
                let (h, e) = ttfb_once(addr, &cached_auth, body.as_bytes(), SimDelay::Chunks(1))?;
                heads.push(h);
                events.push(e);
            }
        }
        // The same on other answers and with the trivial wasm filter, to tell the request
        // path from the stream and the filter from having any wasm filter: response headers,
        // fresh connections, the Envoys alternating.
        let json = json_body(16);
        let mut envoys = vec![bare.listen];
        envoys.extend(noop.as_ref().map(|n| n.listen));
        envoys.push(filtered.listen);
        // A JSON answer 1 ms late too: Envoy idle before the response, as before a stream's
        // later chunks (and before any real model's first token).
        for (name, b, delay) in [
            ("stream", body.as_bytes(), SimDelay::Chunks(1)),
            ("json", json.as_bytes(), SimDelay::Chunks(1)),
            ("json-delayed", json.as_bytes(), SimDelay::Answer(1)),
            ("stream-nodelay", body.as_bytes(), SimDelay::Chunks(0)),
        ] {
            let mut samples = vec![Vec::new(); envoys.len()];
            for _ in 0..args.ttfb_samples {
                for (addr, xs) in envoys.iter().zip(samples.iter_mut()) {
                    xs.push(ttfb_once(*addr, &cached_auth, b, delay)?.0);
                }
            }
            let medians: Vec<f64> = samples.iter().map(|xs| median(xs)).collect();
            let noop_ms = (medians.len() == 3)
                .then(|| medians.get(1).copied())
                .flatten();
            let (Some(&bare_ms), Some(&filter_ms)) = (medians.first(), medians.last()) else {
                continue;
            };
            ttfb_more.push(TtfbRow {
                answer: name,
                bare_ms,
                noop_ms,
                filter_ms,
            });
        }
        ttfb.insert("envoy", (median(&hb), median(&eb), min_max(&eb)));
        ttfb.insert("filter", (median(&hf), median(&ef), min_max(&ef)));
    }

    // ---- memory per stream: short vs long streams in flight ----
    let mut stream_mem = None;
    if variants.iter().any(|v| v.name == "filter-stream") {
        log("memory per stream: 32 short streams, then 32 long ones …");
        let base = mem_of(filtered.pid(), filtered.admin);
        let short = stream_memory(&filtered, &cached_auth, 32, 50, 60)?;
        let long = stream_memory(&filtered, &cached_auth, 32, 3000, 1)?;
        stream_mem = Some((base, short, long));
    }

    // ---- host-call prices (the hostcall filter, N calls of one kind per request) ----
    let mut prices = None;
    if want_prices && let Some(envoy) = &hostcall_envoy {
        let t = Instant::now();
        prices = Some(host_call_prices(
            &args,
            envoy,
            &price_kinds,
            &lua_dir,
            &dir,
        )?);
        log(format!(
            "host-call prices took {:.0} s",
            t.elapsed().as_secs_f64()
        ));
    }
    drop(hostcall_envoy);

    // ---- Envoy's instructions per request, counted under valgrind (deterministic) ----
    let mut instructions = None;
    if want_instructions {
        let mut builds: Vec<(&'static str, Option<&Path>, bool)> = vec![("envoy", None, false)];
        if noop_wasm.is_file() {
            builds.push(("wasm-noop", Some(&noop_wasm), false));
        }
        if hostcall_wasm.is_file() {
            builds.push(("wasm-floor", Some(&hostcall_wasm), false));
        }
        builds.push(("filter-cached", Some(&inputs.wasm), true));
        for (name, path) in &compare_wasm {
            builds.push((name, Some(path), true));
        }
        let t = Instant::now();
        match envoy_instructions(
            &inputs,
            &builds,
            &mut wrk,
            &cached_auth,
            &body_json,
            &body_stream,
            args.seconds.clamp(2, 6),
            &dir,
        ) {
            Ok(rows) => instructions = Some(rows),
            Err(e) => log(format!("Envoy instruction count failed: {e:#}")),
        }
        log(format!(
            "Envoy instruction count took {:.0} s",
            t.elapsed().as_secs_f64()
        ));
    }

    // ---- memory after N distinct cached credentials, on a fresh Envoy with the filter ----
    drop(filtered);
    drop(bare);
    drop(noop);
    drop(compare);
    // The two-replica Envoys' lease counters (global limits on: how often they called, whether
    // they ever fell back to their local share).
    let mut lease_stats = BTreeMap::new();
    for (name, pair) in &two_replica_envoys {
        for e in pair {
            let stats = get_text(e.admin, "/stats?filter=maas_lease").unwrap_or_default();
            for (k, v) in envoy_stats(&stats) {
                *lease_stats.entry((*name, k)).or_insert(0.0) += v;
            }
        }
    }
    drop(two_replica_envoys);
    let mut mem_rows = Vec::new();
    if max_cached > 0 && (args.only.is_empty() || args.only.iter().any(|o| o == "filter-miss")) {
        log("memory: fresh Envoy with the filter, filling its cache …");
        let keys: Vec<String> = std::fs::read_to_string(&keys_file)?
            .lines()
            .take(max_cached)
            .map(str::to_string)
            .collect();
        let envoy = start_envoy(&inputs, "envoy-mem", true, max_cached as u64 + 1000)?;
        let body = json_body(16);
        // One cached request first, so the baseline has the VM warm and the policy loaded.
        let (s, t) = post_once(
            envoy.listen,
            CHAT_PATH,
            &[("Authorization", &cached_auth)],
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
            let failed = fill_keys(envoy.listen, &keys[done..n], body.as_bytes(), 16)?;
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
    }

    // ---- shared data stays bounded: distinct junk bearer tokens, on a fresh Envoy ----
    let mut junk = None;
    if args.junk_tokens > 0 && (args.only.is_empty() || args.only.iter().any(|o| o == "junk-bound"))
    {
        junk = Some(junk_bound(
            &inputs,
            &cached_auth,
            args.junk_tokens,
            args.junk_rounds.max(2),
            args.junk_cache_entries,
        )?);
    }

    // ---- report ----
    let two_replica_section = variants
        .iter()
        .any(|v| v.pair.is_some())
        .then(|| render_two_replica(&args, &results, &lease_stats));
    if instructions_only {
        if let Some(rows) = &instructions {
            println!("{}", render_envoy_instructions(rows));
        }
        stack.shutdown();
        return Ok(());
    }
    if two_replica_only {
        let section = two_replica_section.unwrap_or_default();
        println!("{section}");
        if !args.out.is_empty() {
            let out = root.join(&args.out);
            let old = std::fs::read_to_string(&out).unwrap_or_default();
            std::fs::write(&out, splice_section(&old, &section))?;
            log(format!(
                "replaced the two-replica section of {}",
                out.display()
            ));
        }
        stack.shutdown();
        return Ok(());
    }
    let mut report = render_report(
        &args,
        started_at,
        &results,
        &variants,
        &ttfb,
        &ttfb_more,
        stream_mem,
        &mem_rows,
        stream_tokens,
    )?;
    let figures = issue14_figures(&args.concurrency, &results, &ttfb, &mem_rows);
    let cached_bill = match (&counts, &prices) {
        (Ok(c), Some(p)) => c
            .calls
            .iter()
            .find(|v| v.variant == "cached JSON")
            .map(|v| bill(v, p).0),
        _ => None,
    };
    let jit_share = profiles
        .iter()
        .find(|(name, _)| *name == "filter-cached")
        .map(|(_, p)| {
            p.dsos
                .iter()
                .filter(|(d, _)| d.starts_with("[JIT]") || d == "[unknown]")
                .map(|(_, share)| share)
                .sum()
        });
    report.push('\n');
    report.push_str(&render_issue14(&figures, cached_bill, jit_share));
    report.push_str(&render_instructions(read_instructions(
        args.instructions.as_deref(),
    )));
    report.push_str(&render_host_calls(&counts, prices.as_ref()));
    if let Some(rows) = &instructions {
        report.push_str(&render_envoy_instructions(rows));
    }
    if let Some(j) = &junk {
        report.push_str(&render_junk(j, &args));
    }
    if let Some(section) = &two_replica_section {
        report.push('\n');
        report.push_str(section);
    }
    if !profiles.is_empty() {
        let _ = writeln!(
            report,
            "\n## Profile: Envoy's CPU per request (perf record -e cpu-clock -F {PERF_HZ}, one {} s run each)\n",
            args.seconds
        );
        let _ = writeln!(
            report,
            "| variant | req/s | Envoy CPU µs / request | where (share of Envoy's samples) |"
        );
        let _ = writeln!(report, "|---|---:|---:|---|");
        for (name, p) in &profiles {
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
    }
    println!("{report}");
    if !args.out.is_empty() {
        let out = root.join(&args.out);
        let notes = std::fs::read_to_string(lua_dir.join("notes.md")).unwrap_or_default();
        std::fs::write(&out, format!("{report}\n{notes}"))?;
        log(format!("wrote {}", out.display()));
    }
    stack.shutdown();
    Ok(())
}

/// One Envoy build's instructions per request (valgrind callgrind).
#[derive(Debug, Clone, PartialEq)]
struct EnvoyInstructionRow {
    variant: String,
    /// Instructions per request, Envoy's idle work (timers, the filter's ticks) subtracted.
    per_request: f64,
    requests: u64,
    /// Instructions per second while idle (subtracted above for the run's length).
    idle_per_s: f64,
}

/// Every build of `builds` (variant name, module, whether it is the MaaS filter) in an Envoy
/// under valgrind's callgrind, all started at once (each takes minutes to compile its module
/// there); then, one at a time: warmed up, its idle rate counted, and one wrk connection for
/// `seconds` counted between a zero and a dump of callgrind's counters. Instructions are
/// every thread's, user space only: Envoy, V8 (its compiled filter included) and the host calls.
#[allow(clippy::too_many_arguments)]
fn envoy_instructions(
    inputs: &EnvoyInputs<'_>,
    builds: &[(&'static str, Option<&Path>, bool)],
    wrk: &mut Wrk<'_>,
    auth: &str,
    body_json: &Path,
    body_stream: &Path,
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

/// The parts of the hostcall filter's `floor` (kinds `floor-<part>`: the floor without it).
const FLOOR_PARTS: [&str; 7] = [
    "edits", "shared", "clock", "reqbody", "respmap", "ratehdrs", "respbody",
];

/// (instructions per request, requests, idle instructions per second) of one load on an Envoy
/// under callgrind whose dumps go to `out`.
fn count_instructions(
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

fn callgrind_control(pid: u32, what: &str) -> Result<()> {
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
fn callgrind_dump(pid: u32, out: &Path) -> Result<u64> {
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
fn newest_dump(out: &Path) -> Option<(u32, PathBuf)> {
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
fn callgrind_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The section: Envoy's instructions per request by variant, and the differences that matter.
// TODO(issue 27): the split of maas-bench.rs (another branch) brings this under 100 lines.
#[allow(clippy::too_many_lines)]
fn render_envoy_instructions(rows: &[EnvoyInstructionRow]) -> String {
    let mut o = String::from(
        "
## Envoy's instructions per request, counted (issue 14)

",
    );
    let get = |name: &str| {
        rows.iter()
            .find(|r| r.variant == name)
            .map(|r| r.per_request)
    };
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

fn floor_part_what(part: &str) -> &'static str {
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

/// `name: value` lines of Envoy's admin `/stats` (the `wasmcustom.` prefix dropped).
fn envoy_stats(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            let name = name.trim();
            let name = name.strip_prefix("wasmcustom.").unwrap_or(name);
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The two-replica section: on vs off per concurrency, and the Redis round trips per subject per
/// replica per second against the target.
// TODO(issue 27): the split of maas-bench.rs (another branch) brings this under 100 lines.
#[allow(clippy::too_many_lines)]
fn render_two_replica(
    args: &Args,
    results: &BTreeMap<(String, u32), Vec<WrkResult>>,
    lease_stats: &BTreeMap<(&str, String), f64>,
) -> String {
    let (s, r) = (TWO_REPLICA_SUBJECTS, TWO_REPLICA_REPLICAS);
    let (from, to) = steady_window(args.seconds);
    let mut o = String::new();
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

/// `old` (the results file) with its two-replica section replaced by `section` — or, when it has
/// none, `section` inserted before "## How to run" (else appended). Nothing else changes.
fn splice_section(old: &str, section: &str) -> String {
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

struct Profile {
    requests_per_s: f64,
    /// Envoy CPU time per request, µs.
    cpu_us_per_request: f64,
    /// (dso, share %) sorted by share.
    dsos: Vec<(String, f64)>,
}

const PERF_HZ: u64 = 2000;

/// Runs `v` under wrk while `perf record` samples Envoy's CPU clock.
fn profile_run(
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

/// Median req/s, p50 ms, p99 ms, (min, max) req/s, errors.
type Summary = (f64, f64, f64, (f64, f64), u64);

type Ttfb<'a> = BTreeMap<&'a str, (f64, f64, (f64, f64))>;

/// Time to the response headers of one kind of answer: bare Envoy, with the trivial wasm
/// filter (when it runs), with the filter (medians, ms).
struct TtfbRow {
    answer: &'static str,
    bare_ms: f64,
    noop_ms: Option<f64>,
    filter_ms: f64,
}

#[allow(clippy::too_many_arguments)]
// TODO(issue 27): the split of maas-bench.rs (another branch) brings this under 100 lines.
#[allow(clippy::too_many_lines)]
fn render_report(
    args: &Args,
    started_at: std::time::SystemTime,
    results: &BTreeMap<(String, u32), Vec<WrkResult>>,
    variants: &[Variant],
    ttfb: &Ttfb<'_>,
    ttfb_more: &[TtfbRow],
    stream_mem: Option<(Mem, Mem, Mem)>,
    mem_rows: &[(usize, Mem, usize)],
    stream_tokens: u32,
) -> Result<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    // SAFETY: sysconf has no preconditions. (Not available_parallelism: this process is pinned.)
    let cores = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let envoy_version = tools::envoy_bin()
        .ok()
        .and_then(|b| Command::new(b).arg("--version").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .and_then(|s| {
            s.split_whitespace()
                .find(|w| w.contains("/1."))
                .map(|w| w.split('/').nth(1).unwrap_or(w).to_string())
        })
        .unwrap_or_else(|| "?".into());
    let wall = started_at.elapsed().map(|d| d.as_secs()).unwrap_or(0);

    let med = |name: &str, c: u32| -> Option<Summary> {
        let rs = results.get(&(name.to_string(), c))?;
        let rps: Vec<f64> = rs.iter().map(|r| r.rps).collect();
        Some((
            median(&rps),
            median(&rs.iter().map(|r| r.p50_ms).collect::<Vec<_>>()),
            median(&rs.iter().map(|r| r.p99_ms).collect::<Vec<_>>()),
            min_max(&rps),
            rs.iter().map(|r| r.errors).sum(),
        ))
    };

    let mut o = String::new();
    let _ = writeln!(o, "# Benchmarks\n");
    let _ = writeln!(
        o,
        "Generated by `maas-bench` (`./scripts/bench.sh`); do not edit by hand — rerun it when performance changes.\n"
    );
    let _ = writeln!(
        o,
        "- date: {date} (run took {} min {} s)",
        wall / 60,
        wall % 60
    );
    let _ = writeln!(
        o,
        "- machine: {cores} cores, {model}; Envoy {envoy_version}, one worker (`--concurrency 1`) pinned to CPU 0 (`taskset -c 0`); wrk `-t1`, the simulator (in the harness process), the companion and PostgreSQL share CPU 1"
    );
    let _ = writeln!(
        o,
        "- command: `{}` ({} rounds × {} s per run, concurrency {:?}, variants alternating within each round)",
        args.command, args.rounds, args.seconds, args.concurrency
    );
    let _ = writeln!(
        o,
        "- request: `POST {CHAT_PATH}` chat completion, JSON response with `usage` (16 completion tokens); streams: `stream: true` with usage, {stream_tokens} chunks\n"
    );

    let _ = writeln!(
        o,
        "## Throughput and latency (medians over rounds; spread = min–max req/s)\n"
    );
    let _ = writeln!(
        o,
        "| variant | conc. | req/s | spread | p50 ms | p99 ms | req/s vs base | p50 vs base | errors |"
    );
    let _ = writeln!(o, "|---|---:|---:|---|---:|---:|---:|---:|---:|");
    for &c in &args.concurrency {
        for v in variants.iter().filter(|v| v.pair.is_none()) {
            let Some((rps, p50, p99, (lo, hi), errors)) = med(v.name, c) else {
                continue;
            };
            let (ratio_rps, ratio_p50) = match med(v.baseline, c) {
                Some((brps, bp50, ..)) if v.baseline != "-" && v.baseline != v.name => (
                    format!("{:.2}× {}", rps / brps, v.baseline),
                    format!("{:.2}×", p50 / bp50),
                ),
                _ => ("—".into(), "—".into()),
            };
            let _ = writeln!(
                o,
                "| {} | {c} | {rps:.0} | {lo:.0}–{hi:.0} | {p50:.3} | {p99:.3} | {ratio_rps} | {ratio_p50} | {errors} |",
                v.name
            );
        }
    }
    let _ = writeln!(
        o,
        "\nvariants: direct = wrk → simulator; envoy = the same Envoy config without the wasm filter; wasm-noop = the same Envoy with a trivial Rust proxy-wasm filter (tests/bench/noop-filter: strips `Authorization`, nothing else) — the cost of having any wasm filter; wasm-floor = the same Envoy with `tests/bench/hostcall-filter` making exactly the host calls of a cached JSON request of the filter (kind `floor`: the request header map read, 3 header edits (`authorization` and `content-length` removed, `accept-encoding` set; the request sends no `x-maas-*` to remove), the body read once when it reaches its content-length, the counter slot read with the headers and CAS-written at admission (a busy subject's refund folds into its next admission), 3 clock reads, the response header map read, 6 `x-ratelimit-*` adds, the response body read) and nothing else; filter-cached = the filter, cached key, request + token limits on (never tripping), JSON usage counted; envoy-stream / filter-stream = the same with `stream: true`; filter-miss = a key never seen before on every request (companion callout + PostgreSQL); companion-auth = wrk straight at the companion's `POST /internal/v1/authenticate` (a valid key); litellm = LiteLLM proxy with a master key in front of the same simulator (only with `--litellm`).\n"
    );

    let mut targets: Vec<Target> = Vec::new();
    if let (Some(f), Some(e)) = (med("filter-cached", 32), med("envoy", 32)) {
        let r = f.0 / e.0;
        targets.push(Target {
            what: "filter-cached ≥ 0.90× envoy req/s at concurrency 32".into(),
            measured: format!("{r:.2}× ({:.0} vs {:.0})", f.0, e.0),
            met: Some(r >= 0.90),
        });
    }
    if let (Some(f), Some(e)) = (med("filter-cached", 1), med("envoy", 1)) {
        let r = f.1 / e.1;
        targets.push(Target {
            what: "filter-cached p50 ≤ 1.15× envoy p50 at concurrency 1".into(),
            measured: format!("{r:.2}× ({:.3} vs {:.3} ms)", f.1, e.1),
            met: Some(r <= 1.15),
        });
    }

    if let (Some(b), Some(f)) = (ttfb.get("envoy"), ttfb.get("filter")) {
        let _ = writeln!(
            o,
            "## Streams: time to first byte (medians of {} streams per Envoy, alternating)\n",
            args.ttfb_samples
        );
        let _ = writeln!(
            o,
            "| Envoy | response headers ms | first SSE event ms | first event min–max ms |"
        );
        let _ = writeln!(o, "|---|---:|---:|---|");
        for (name, (h, e, (lo, hi))) in [("bare", b), ("with filter", f)] {
            let _ = writeln!(o, "| {name} | {h:.3} | {e:.3} | {lo:.3}–{hi:.3} |");
        }
        let d = f.1 - b.1;
        let _ = writeln!(
            o,
            "\nThe filter adds {d:.3} ms to the first SSE event (32-chunk stream, 1 ms between chunks).\n"
        );
        if !ttfb_more.is_empty() {
            let _ = writeln!(
                o,
                "Where it comes from: the time to the response headers again (fresh connections, the Envoys alternating, {} per answer and Envoy) for a JSON answer and for a stream whose chunks come at once, and with the trivial wasm filter (`wasm-noop`) too. The first chunk is sent at once in every case; with chunks 1 ms apart Envoy sits idle between them, and any wasm filter then adds more (the noop column).\n",
                args.ttfb_samples
            );
            let _ = writeln!(
                o,
                "| answer | bare ms | wasm-noop ms | with filter ms | wasm-noop adds | the filter adds | the filter over wasm-noop |"
            );
            let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|");
            let dash = || "—".to_string();
            for r in ttfb_more {
                let label = match r.answer {
                    "stream" => "stream, chunks 1 ms apart",
                    "json" => "JSON chat completion",
                    "json-delayed" => "JSON chat completion, answered 1 ms late",
                    "stream-nodelay" => "stream, chunks at once",
                    other => other,
                };
                let _ = writeln!(
                    o,
                    "| {label} | {:.3} | {} | {:.3} | {} | {:+.3} | {} |",
                    r.bare_ms,
                    r.noop_ms.map_or_else(dash, |n| format!("{n:.3}")),
                    r.filter_ms,
                    r.noop_ms
                        .map_or_else(dash, |n| format!("{:+.3}", n - r.bare_ms)),
                    r.filter_ms - r.bare_ms,
                    r.noop_ms
                        .map_or_else(dash, |n| format!("{:+.3}", r.filter_ms - n)),
                );
            }
            let _ = writeln!(o);
        }
        targets.push(Target {
            what: "filter-stream adds ≤ 0.2 ms to time to first byte".into(),
            measured: format!("{d:+.3} ms (first SSE event)"),
            met: Some(d <= 0.2),
        });
    }
    if let Some((base, short, long)) = stream_mem {
        let _ = writeln!(
            o,
            "## Streams: memory while 32 streams are in flight (peaks, Envoy with the filter)\n"
        );
        let _ = writeln!(
            o,
            "| streams | RSS MiB | wasm linear memory MiB | Envoy heap MiB |"
        );
        let _ = writeln!(o, "|---|---:|---:|---:|");
        for (name, m) in [
            ("none (before)", base),
            ("32 × 50 chunks (60 ms apart)", short),
            ("32 × 3000 chunks (1 ms apart)", long),
        ] {
            let _ = writeln!(
                o,
                "| {name} | {} | {} | {} |",
                mib(m.rss_kib as i64),
                mib(m.wasm_linear_kib as i64),
                mib(m.heap_allocated_kib as i64)
            );
        }
        let grow_kib = long.wasm_linear_kib as i64 - short.wasm_linear_kib as i64;
        let heap_grow_kib = long.heap_allocated_kib as i64 - short.heap_allocated_kib as i64;
        let per_stream = (grow_kib.max(0) + heap_grow_kib.max(0)) as f64 / 32.0;
        let _ = writeln!(
            o,
            "\nLong streams (60× the chunks) vs short: wasm memory {grow_kib:+} KiB, Envoy heap {heap_grow_kib:+} KiB, i.e. {per_stream:.1} KiB more per stream.\n"
        );
        targets.push(Target {
            what: "memory per stream does not grow with the stream's length".into(),
            measured: format!("{per_stream:.1} KiB more per stream for 60× longer streams"),
            met: Some(per_stream < 64.0),
        });
    }
    if let (Some(m), Some(f)) = (med("filter-miss", 1), med("filter-cached", 1)) {
        let r = m.1 / f.1;
        targets.push(Target {
            what: "filter-miss p50 ≤ 3× filter-cached p50 (concurrency 1)".into(),
            measured: format!("{r:.2}× ({:.3} vs {:.3} ms)", m.1, f.1),
            met: Some(r <= 3.0),
        });
    }
    if mem_rows.len() > 1 {
        let base = mem_rows[0].1;
        let _ = writeln!(
            o,
            "## Memory after N distinct cached credentials (fresh Envoy with the filter)\n"
        );
        let _ = writeln!(
            o,
            "| cached keys | RSS MiB | Δ RSS MiB | wasm linear memory MiB | Δ wasm MiB | Envoy heap MiB | Δ heap MiB | Δ (wasm + heap) per key, bytes | failed |"
        );
        let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (n, m, failed) in mem_rows {
            let dr = m.rss_kib as i64 - base.rss_kib as i64;
            let dw = m.wasm_linear_kib as i64 - base.wasm_linear_kib as i64;
            let dh = m.heap_allocated_kib as i64 - base.heap_allocated_kib as i64;
            let per = if *n > 1 {
                format!("{:.0}", (dw + dh) as f64 * 1024.0 / (*n as f64 - 1.0))
            } else {
                "—".into()
            };
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} | {} | {per} | {failed} |",
                mib(m.rss_kib as i64),
                mib(dr),
                mib(m.wasm_linear_kib as i64),
                mib(dw),
                mib(m.heap_allocated_kib as i64),
                mib(dh)
            );
        }
        let _ = writeln!(
            o,
            "\nwasm linear memory = resident pages of every wasm VM's linear memory (the rw mapping just below each of V8's 8 GiB reservations in /proc/PID/smaps; Envoy runs one VM per worker plus one on the main thread); Envoy heap = tcmalloc `allocated` from admin `/memory`, which holds proxy-wasm shared data (the credential cache lives there, outside the VM's linear memory). Envoy 1.40 exposes no wasm memory gauge in `/stats` (only `wasm.envoy.wasm.runtime.v8.*` VM counts).\n"
        );
        if let Some((n, cost, limit)) = credential_memory(mem_rows) {
            targets.push(Target {
                what: format!(
                    "{n} cached credentials cost ≤ {} MiB (64 MiB per 100k)",
                    mib(limit)
                ),
                measured: format!("{} MiB (max of Δ RSS and Δ wasm + Δ heap)", mib(cost)),
                met: Some(cost <= limit),
            });
        }
    }
    if let Some(s) = med("companion-auth", 32) {
        let _ = writeln!(
            o,
            "Companion `POST /internal/v1/authenticate` (API key, PostgreSQL lookup) at concurrency 32: **{:.0} req/s**, p50 {:.3} ms, p99 {:.3} ms.\n",
            s.0, s.1, s.2
        );
    }
    if let (Some(f), Some(l)) = (med("filter-cached", 32), med("litellm", 32)) {
        let r = f.0 / l.0;
        targets.push(Target {
            what: "≥ 100× LiteLLM's req/s with enforcement on (concurrency 32)".into(),
            measured: format!("{r:.0}× ({:.0} vs {:.0})", f.0, l.0),
            met: Some(r >= 100.0),
        });
    } else {
        targets.push(Target {
            what: "≥ 100× LiteLLM's req/s with enforcement on".into(),
            measured: "not measured in this run (`./scripts/bench.sh --litellm`)".into(),
            met: None,
        });
    }
    let _ = writeln!(o, "## Targets (issue 6)\n");
    let _ = writeln!(o, "| target | measured | met |");
    let _ = writeln!(o, "|---|---|---|");
    for t in &targets {
        let met = match t.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "—",
        };
        let _ = writeln!(o, "| {} | {} | {met} |", t.what, t.measured);
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// issue 14: where filter-cached's Envoy CPU goes, and its targets

/// Median Envoy CPU µs per request of `name` at `c` (runs with a reading only).
fn median_cpu(
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
struct CpuSplit {
    c: u32,
    envoy: f64,
    noop: Option<f64>,
    floor: Option<f64>,
    cached: f64,
}

/// What the issue-14 targets are checked against (None: not measured in this run).
#[derive(Debug, Clone, Default, PartialEq)]
struct Issue14 {
    /// (filter-cached, envoy) req/s at concurrency 32.
    rps_32: Option<(f64, f64)>,
    /// (filter-cached, envoy) p50 ms at concurrency 1.
    p50_1: Option<(f64, f64)>,
    /// At the highest concurrency that ran envoy and filter-cached.
    cpu: Option<CpuSplit>,
    /// First SSE event, (with the filter, bare) ms.
    first_event: Option<(f64, f64)>,
    /// (filter-miss, filter-cached) p50 ms at concurrency 1.
    miss_p50_1: Option<(f64, f64)>,
    /// (cached credentials, cost KiB, limit KiB).
    memory: Option<(usize, i64, i64)>,
}

/// (cached credentials, cost KiB, limit KiB) of the memory rows: the 100000 row (else the last);
/// the cost is the larger of Δ RSS and Δ (wasm + heap), the limit 64 MiB per 100k.
fn credential_memory(mem_rows: &[(usize, Mem, usize)]) -> Option<(usize, i64, i64)> {
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

fn issue14_figures(
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
struct Checked {
    what: String,
    measured: String,
    by: String,
    met: Option<bool>,
}

/// `value` against an upper (`at_most`) or lower bound: (met, "<margin> to spare" / "over" /
/// "short"), the margin formatted by `fmt`.
fn margin(value: f64, bound: f64, at_most: bool, fmt: &dyn Fn(f64) -> String) -> (bool, String) {
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

fn issue14_targets(m: &Issue14) -> Vec<Checked> {
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
fn render_issue14(m: &Issue14, cached_bill: Option<f64>, jit_share: Option<f64>) -> String {
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

/// The filter's own instructions, counted natively by `./scripts/bench.sh` (valgrind).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct FilterInstructions {
    /// Per cached JSON request.
    cached_json: Option<u64>,
    /// Per cached stream (the benchmark's: 64 content chunks, usage asked for).
    cached_stream: Option<u64>,
}

/// `{"cached_json": N, "cached_stream": M}` from `path` (`None`: no file, or unreadable).
fn read_instructions(path: Option<&Path>) -> Option<FilterInstructions> {
    let text = std::fs::read_to_string(path?).ok()?;
    let v = serde_json::from_str::<Value>(&text).ok()?;
    let counts = FilterInstructions {
        cached_json: v["cached_json"].as_u64(),
        cached_stream: v["cached_stream"].as_u64(),
    };
    (counts != FilterInstructions::default()).then_some(counts)
}

/// The filter's own work per cached JSON request and per stream as instruction counts.
fn render_instructions(counts: Option<FilterInstructions>) -> String {
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
    if counts == FilterInstructions::default() {
        let _ = writeln!(
            o,
            "Not counted in this run (`./scripts/bench.sh` counts it when valgrind is installed).\n"
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "# Benchmarks\n\n## Targets (issue 6)\n\n| a | b |\n\n## How to run, and how to read it\n\nnotes\n";

    #[test]
    fn envoys_instructions_are_read_from_a_callgrind_dump_and_rendered_by_part() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\npid: 7\ncmd: envoy\npart: 2\n\nevents: Ir\nsummary: 135467197\n\nfn=x\n0 5\ntotals: 135467197\n";
        assert_eq!(callgrind_total(dump), Some(135_467_197));
        assert_eq!(callgrind_total("events: Ir\n"), None);
        let dir = std::env::temp_dir().join(format!("maas-bench-cg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("callgrind-envoy.out");
        for n in [1, 2, 10] {
            std::fs::write(dir.join(format!("callgrind-envoy.out.{n}")), dump).unwrap();
        }
        std::fs::write(dir.join("callgrind-envoy.out.x"), dump).unwrap();
        assert_eq!(newest_dump(&out).map(|(n, _)| n), Some(10));
        std::fs::remove_dir_all(&dir).unwrap();
        let row = |variant: &str, per_request: f64| EnvoyInstructionRow {
            variant: variant.into(),
            per_request,
            requests: 500,
            idle_per_s: 1000.0,
        };
        let text = render_envoy_instructions(&[
            row("envoy", 180_000.0),
            row("envoy-stream", 230_000.0),
            row("wasm-noop", 220_000.0),
            row("wasm-floor", 320_000.0),
            row("filter-cached", 350_000.0),
            row("filter-stream", 600_000.0),
            row("filter-cached:old", 360_000.0),
            row("filter-stream:old", 640_000.0),
        ]);
        assert!(
            text.contains("| filter-stream:old | 640000 | +410000 (2.78×) |"),
            "{text}"
        );
        assert!(
            text.contains("build `old` (`filter-stream`) | -40000 |"),
            "{text}"
        );
        assert!(
            text.contains("build `old` (`filter-cached`) | -10000 |"),
            "{text}"
        );
        assert!(
            text.contains("| wasm-noop | 220000 | +40000 (1.22×) | 500 | 1000 |"),
            "{text}"
        );
        assert!(
            text.contains("| filter-stream | 600000 | +370000 (2.61×) |"),
            "{text}"
        );
        assert!(
            text.contains("(`wasm-floor` − `wasm-noop`) | +100000 |"),
            "{text}"
        );
        assert!(
            text.contains("(`filter-cached` − `wasm-floor`) | +30000 |"),
            "{text}"
        );
        assert!(
            text.contains("(`filter-cached` − `wasm-noop`) | +130000 |"),
            "{text}"
        );
    }

    #[test]
    fn the_instruction_count_is_read_from_its_file_and_rendered() {
        let dir = std::env::temp_dir().join(format!("maas-bench-ins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ins.json");
        std::fs::write(&file, r#"{"cached_json": 33648}"#).unwrap();
        let json_only = FilterInstructions {
            cached_json: Some(33648),
            cached_stream: None,
        };
        assert_eq!(read_instructions(Some(&file)), Some(json_only));
        let text = render_instructions(Some(json_only));
        assert!(text.contains("**33648 instructions**"), "{text}");
        assert!(!text.contains("per cached stream"), "{text}");
        std::fs::write(&file, r#"{"cached_json": 30000, "cached_stream": 96000}"#).unwrap();
        let both = read_instructions(Some(&file));
        assert_eq!(
            both,
            Some(FilterInstructions {
                cached_json: Some(30000),
                cached_stream: Some(96000),
            })
        );
        let text = render_instructions(both);
        assert!(
            text.contains("**96000 instructions** per cached stream"),
            "{text}"
        );
        assert!(text.contains("+1000 per chunk"), "{text}");
        std::fs::write(&file, "not json").unwrap();
        assert_eq!(read_instructions(Some(&file)), None);
        assert_eq!(read_instructions(Some(&dir.join("missing.json"))), None);
        assert_eq!(read_instructions(None), None);
        assert!(render_instructions(None).contains("Not counted"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn splice_inserts_the_section_before_how_to_run_when_absent() {
        let section = format!("{TWO_REPLICA_HEADING}\n\n| x |\n");
        let out = splice_section(FILE, &section);
        assert_eq!(
            out,
            format!(
                "# Benchmarks\n\n## Targets (issue 6)\n\n| a | b |\n\n{TWO_REPLICA_HEADING}\n\n| x |\n\n## How to run, and how to read it\n\nnotes\n"
            )
        );
    }

    #[test]
    fn splice_replaces_only_the_two_replica_section() {
        let first = splice_section(FILE, &format!("{TWO_REPLICA_HEADING}\n\nold figures\n"));
        let second = splice_section(&first, &format!("{TWO_REPLICA_HEADING}\n\nnew figures\n"));
        assert!(second.contains("new figures"), "{second}");
        assert!(!second.contains("old figures"), "{second}");
        // Everything around it is as before, and the section is there once.
        assert_eq!(second.replace("new figures", "old figures"), first);
        assert_eq!(second.matches(TWO_REPLICA_HEADING).count(), 1);
    }

    #[test]
    fn splice_replaces_a_last_section_and_appends_when_no_notes() {
        let file = "# Benchmarks\n\n## Targets\n\nt\n";
        let first = splice_section(file, &format!("{TWO_REPLICA_HEADING}\n\nA\n"));
        assert_eq!(
            first,
            format!("# Benchmarks\n\n## Targets\n\nt\n\n{TWO_REPLICA_HEADING}\n\nA\n")
        );
        let second = splice_section(&first, &format!("{TWO_REPLICA_HEADING}\n\nB\n"));
        assert_eq!(second, first.replace("\nA\n", "\nB\n"));
    }

    #[test]
    fn pair_results_sum_rates_and_weight_the_median_latency() {
        let a = WrkRun {
            requests: 3000,
            duration_us: 1e6,
            p50_us: 100.0,
            p99_us: 900.0,
            errors: 1,
        };
        let b = WrkRun {
            requests: 1000,
            duration_us: 2e6,
            p50_us: 500.0,
            p99_us: 400.0,
            errors: 2,
        };
        let r = combine_runs(&[a, b], None);
        assert!((r.rps - 3500.0).abs() < 1e-6, "{}", r.rps);
        assert!((r.p50_ms - 0.2).abs() < 1e-9, "{}", r.p50_ms);
        assert!((r.p99_ms - 0.9).abs() < 1e-9, "{}", r.p99_ms);
        assert_eq!(r.errors, 3);
        assert_eq!(r.cpu_us, 0.0);
    }

    #[test]
    fn metric_value_reads_only_the_named_sample() {
        let text = "# HELP maas_companion_redis_round_trips Calls\n# TYPE maas_companion_redis_round_trips counter\nmaas_companion_redis_round_trips_total_created 1.7e9\nmaas_companion_redis_round_trips_total 42\nmaas_companion_lease_batches_total 7\n";
        assert_eq!(
            metric_value(text, "maas_companion_redis_round_trips_total"),
            Some(42.0)
        );
        assert_eq!(
            metric_value(text, "maas_companion_lease_batches_total"),
            Some(7.0)
        );
        assert_eq!(metric_value(text, "maas_companion_lease_items_total"), None);
    }

    #[test]
    fn steady_window_skips_the_start_and_the_end_of_a_run() {
        assert_eq!(
            steady_window(10),
            (Duration::from_secs(2), Duration::from_millis(9700))
        );
        assert_eq!(
            steady_window(2),
            (Duration::from_millis(500), Duration::from_millis(1700))
        );
        let (from, to) = steady_window(1);
        assert!(from <= to && to <= Duration::from_secs(1));
    }

    #[test]
    fn envoy_stats_drop_the_wasmcustom_prefix() {
        let s = envoy_stats(
            "wasmcustom.maas_lease_callouts_total: 12\nwasmcustom.maas_lease_fallback: 0\nbad line\n",
        );
        assert_eq!(
            s,
            vec![
                ("maas_lease_callouts_total".to_string(), 12.0),
                ("maas_lease_fallback".to_string(), 0.0)
            ]
        );
    }

    /// What the filter's budget tests write (`MAAS_HOST_CALLS_OUT`), abridged.
    const COUNTS: &str = r#"{
      "host_calls": [
        {"variant": "cached JSON", "total": 6, "by_kind": {"clock": 3, "shared set (CAS)": 2, "request header map read": 1}},
        {"variant": "miss JSON", "total": 5, "by_kind": {"clock": 4, "dispatch": 1}}
      ],
      "allocations": [{"variant": "cached JSON", "count": 91, "bytes": 4475, "per_callback": [32, 22, 14, 23, 0]}]
    }"#;

    fn prices() -> Prices {
        // N = 10: clock 0.1 µs, shared get 0.5, get + CAS set 0.7 (CAS set alone 0.2); header
        // map not measured.
        Prices {
            n: 10,
            concurrency: 32,
            seconds: 4,
            rounds: 3,
            rows: [
                ("none", 30.0),
                ("clock", 31.0),
                ("shared_get", 35.0),
                ("shared_get_cas_set", 37.0),
            ]
            .iter()
            .map(|(k, cpu)| (k.to_string(), 1000.0, *cpu))
            .collect(),
        }
    }

    #[test]
    fn host_call_counts_are_read_as_the_filter_tests_write_them() {
        let c = parse_host_call_counts(COUNTS).unwrap();
        assert_eq!(c.calls.len(), 2);
        assert_eq!(c.calls[0].variant, "cached JSON");
        assert_eq!(c.calls[0].total, 6);
        assert_eq!(c.calls[0].by_kind.get("shared set (CAS)"), Some(&2));
        assert_eq!(c.allocations[0].per_callback, vec![32, 22, 14, 23, 0]);
        assert!(parse_host_call_counts("{}").is_err());
        assert!(parse_host_call_counts("not json").is_err());
    }

    #[test]
    fn a_derived_price_subtracts_the_call_it_needs() {
        let p = prices();
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(close(p.of_call("clock"), 0.1));
        assert!(close(p.of_call("shared get"), 0.5));
        assert!(close(p.of_call("shared set (CAS)"), 0.2));
        // Not measured, or not a priced kind: no price, never a guess.
        assert_eq!(p.of_call("request header map read"), None);
        assert_eq!(p.of_call("dispatch"), None);
        let c = parse_host_call_counts(COUNTS).unwrap();
        let (us, unpriced) = bill(&c.calls[0], &p);
        assert!((us - (3.0 * 0.1 + 2.0 * 0.2)).abs() < 1e-9, "{us}");
        assert_eq!(unpriced, 1);
    }

    #[test]
    fn the_full_run_prices_only_the_kinds_the_counts_hold_and_the_body_hold() {
        assert_eq!(
            kinds_pricing(["shared set (CAS)", "clock", "dispatch"]),
            vec!["none", "nobuf", "clock", "shared_get", "shared_get_cas_set"]
        );
        // Every priced call names kinds the hostcall filter makes.
        for (label, kind, minus) in PRICED_CALLS {
            for k in std::iter::once(kind).chain(minus) {
                assert!(HOST_CALL_KINDS.iter().any(|(h, _)| h == k), "{label}: {k}");
            }
        }
    }

    #[test]
    fn the_host_call_table_has_variants_as_columns_and_the_priced_bill() {
        let out = render_host_calls(&parse_host_call_counts(COUNTS), Some(&prices()));
        assert!(
            out.starts_with("## Host calls per request (issue 14)\n"),
            "{out}"
        );
        assert!(
            out.contains("| kind | µs per call | cached JSON | miss JSON |"),
            "{out}"
        );
        assert!(out.contains("| clock | 0.10 | 3 | 4 |"), "{out}");
        assert!(out.contains("| shared set (CAS) | 0.20 | 2 | 0 |"), "{out}");
        assert!(
            out.contains("| request header map read | — | 1 | 0 |"),
            "{out}"
        );
        assert!(out.contains("| dispatch | — | 0 | 1 |"), "{out}");
        assert!(out.contains("| **total** | | **6** | **5** |"), "{out}");
        assert!(
            out.contains(
                "| priced bill µs (Σ count × price) | | 0.7 + 1 unpriced | 0.4 + 1 unpriced |"
            ),
            "{out}"
        );
        assert!(out.contains("| 91 / 4475 | — |"), "{out}");
        assert!(out.contains("| `shared_get_cas_set` |"), "{out}");
        // Without prices: counts only, no bill.
        let out = render_host_calls(&parse_host_call_counts(COUNTS), None);
        assert!(out.contains("| clock | — | 3 | 4 |"), "{out}");
        assert!(!out.contains("priced bill"), "{out}");
    }

    #[test]
    fn missing_host_call_counts_are_said_not_invented() {
        let out = render_host_calls(
            &read_host_call_counts(Some(Path::new("/nonexistent/x.json"))),
            None,
        );
        assert!(
            out.contains("No host-call counts in this run (/nonexistent/x.json: "),
            "{out}"
        );
        assert!(!out.contains("| kind |"), "{out}");
        let out = render_host_calls(&read_host_call_counts(None), Some(&prices()));
        assert!(
            out.contains("No host-call counts in this run (no file given"),
            "{out}"
        );
        // The prices measured are still reported.
        assert!(out.contains("| `clock` |"), "{out}");
    }

    fn figures() -> Issue14 {
        Issue14 {
            rps_32: Some((18000.0, 20000.0)),
            p50_1: Some((0.2, 0.16)),
            cpu: Some(CpuSplit {
                c: 32,
                envoy: 30.0,
                noop: Some(34.0),
                floor: Some(40.0),
                cached: 50.0,
            }),
            first_event: Some((1.15, 1.1)),
            miss_p50_1: None,
            memory: Some((100_000, 35 * 1024, 64 * 1024)),
        }
    }

    #[test]
    fn issue14_targets_say_met_or_missed_and_by_how_much() {
        let t = issue14_targets(&figures());
        let row = |i: usize| {
            let t = &t[i];
            (t.measured.as_str(), t.by.as_str(), t.met)
        };
        assert_eq!(
            row(0),
            ("0.90× (18000 vs 20000 req/s)", "0.00× to spare", Some(true))
        );
        assert_eq!(
            row(1),
            ("1.25× (0.200 vs 0.160 ms)", "0.10× over", Some(false))
        );
        assert_eq!(
            row(2),
            ("+16.0 µs (50.0 vs 34.0 µs)", "1.0 µs over", Some(false))
        );
        assert_eq!(
            t[2].what,
            "Envoy CPU per request: filter-cached − wasm-noop ≤ +15 µs (concurrency 32)"
        );
        assert_eq!(
            row(3),
            (
                "+0.050 ms (1.150 vs 1.100 ms)",
                "0.050 ms to spare",
                Some(true)
            )
        );
        assert_eq!(row(4), ("not measured in this run", "—", None));
        assert_eq!(
            row(5),
            (
                "35.0 MiB (max of Δ RSS and Δ wasm + Δ heap)",
                "29.0 MiB to spare",
                Some(true)
            )
        );
        assert_eq!(t.len(), 6);
    }

    #[test]
    fn issue14_section_splits_filter_cached_cpu_into_three_parts() {
        let out = render_issue14(&figures(), Some(5.5), Some(12.0));
        assert!(out.starts_with("## Targets (issue 14)\n"), "{out}");
        assert!(out.contains("| 100000 cached credentials cost ≤ 64.0 MiB (64 MiB per 100k) | 35.0 MiB (max of Δ RSS and Δ wasm + Δ heap) | 29.0 MiB to spare | met |"), "{out}");
        assert!(out.contains("| filter-miss p50 ≤ 3× filter-cached p50 (concurrency 1) | not measured in this run | — | — |"), "{out}");
        assert!(out.contains("| bare Envoy (`envoy`) | 30.0 | — |"), "{out}");
        assert!(
            out.contains("(`wasm-noop` − `envoy`) | +4.0 | 20% |"),
            "{out}"
        );
        assert!(
            out.contains("(`wasm-floor` − `wasm-noop`) | +6.0 | 30% |"),
            "{out}"
        );
        assert!(
            out.contains("(`filter-cached` − `wasm-floor`) | +10.0 | 50% |"),
            "{out}"
        );
        assert!(out.contains("is 5.5 µs"), "{out}");
        assert!(out.contains("12.0% of Envoy's samples"), "{out}");
        // Without wasm-floor the split says so.
        let mut f = figures();
        f.cpu = f.cpu.map(|s| CpuSplit { floor: None, ..s });
        let out = render_issue14(&f, None, None);
        assert!(
            out.contains("(`wasm-floor` − `wasm-noop`) | not measured | — |"),
            "{out}"
        );
        assert!(!out.contains("For scale"), "{out}");
    }

    #[test]
    fn issue14_figures_come_from_the_rounds() {
        let r = |rps: f64, p50_ms: f64, cpu_us: f64| WrkResult {
            rps,
            p50_ms,
            cpu_us,
            ..WrkResult::default()
        };
        let mut results = BTreeMap::new();
        for (name, c, runs) in [
            (
                "envoy",
                32,
                vec![
                    r(20000.0, 1.0, 30.0),
                    r(22000.0, 1.0, 31.0),
                    r(21000.0, 1.0, 29.0),
                ],
            ),
            ("filter-cached", 32, vec![r(15000.0, 1.0, 50.0)]),
            ("wasm-noop", 32, vec![r(19000.0, 1.0, 0.0)]),
            ("envoy", 1, vec![r(5000.0, 0.16, 40.0)]),
            ("filter-cached", 1, vec![r(4000.0, 0.2, 60.0)]),
        ] {
            results.insert((name.to_string(), c), runs);
        }
        let f = issue14_figures(&[1, 32], &results, &Ttfb::new(), &[]);
        assert_eq!(f.rps_32, Some((15000.0, 21000.0)));
        assert_eq!(f.p50_1, Some((0.2, 0.16)));
        // The highest concurrency; a variant without a CPU reading has none.
        assert_eq!(
            f.cpu,
            Some(CpuSplit {
                c: 32,
                envoy: 30.0,
                noop: None,
                floor: None,
                cached: 50.0
            })
        );
        assert_eq!((f.first_event, f.miss_p50_1, f.memory), (None, None, None));
    }
}
