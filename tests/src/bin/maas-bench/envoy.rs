//! The benchmark's Envoys: rendered from the stack's config on fresh ports, one worker pinned
//! to CPU 0.

use anyhow::{Context, Result, bail};
use maas_e2e::envoy_config::{self, EnvoyConfigInput, WasmFilterOptions};
use maas_e2e::process::ManagedProcess;
use maas_types::PolicyDocument;
use serde_json::{Value, json};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Pins this thread (and the threads and processes it starts after) to `cpu`.
pub(crate) fn pin_to_cpu(cpu: usize) -> Result<()> {
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

/// Distinct free ports (all held until all are picked).
pub(crate) fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    let mut ports = [0u16; N];
    for (p, l) in ports.iter_mut().zip(&held) {
        *p = l.local_addr()?.port();
    }
    Ok(ports)
}

pub(crate) fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub(crate) fn url_addr(url: &str) -> Result<SocketAddr> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("not host:port: {url}"))
}

pub(crate) struct BenchEnvoy {
    pub(crate) process: ManagedProcess,
    pub(crate) listen: SocketAddr,
    pub(crate) admin: SocketAddr,
}

impl BenchEnvoy {
    pub(crate) fn pid(&self) -> u32 {
        self.process.pid().unwrap_or(0)
    }
}

pub(crate) struct EnvoyInputs<'a> {
    pub(crate) policy: &'a PolicyDocument,
    pub(crate) companion_public: SocketAddr,
    pub(crate) companion_internal: SocketAddr,
    pub(crate) simulator: SocketAddr,
    pub(crate) wasm: PathBuf,
    pub(crate) envoy_bin: PathBuf,
    pub(crate) dir: PathBuf,
    /// Merged (deeply) over the filter's pluginConfig.
    pub(crate) plugin_extra: Option<Value>,
    /// Observability on the Envoy's side: the usage-event access log and the OpenTelemetry
    /// tracer (the filter-observed variant).
    pub(crate) observe: Option<Observe>,
}

/// Where an observed Envoy writes usage events and sends spans (each optional).
#[derive(Clone)]
pub(crate) struct Observe {
    pub(crate) events_path: Option<PathBuf>,
    pub(crate) traces_url: Option<String>,
}

impl<'a> EnvoyInputs<'a> {
    /// The same inputs for an Envoy that talks to another companion, with `plugin_extra`.
    pub(crate) fn for_replica(
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
            observe: None,
        }
    }
}

/// Renders the stack's Envoy config (with or without the filter) on fresh ports and starts it
/// with one worker, pinned to CPU 0.
pub(crate) fn start_envoy(
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
pub(crate) fn start_envoy_with(
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
pub(crate) fn start_envoy_wasm(
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
pub(crate) fn start_envoy_run(
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
        usage_events_path: inp.observe.as_ref().and_then(|o| o.events_path.clone()),
    };
    let mut config: Value = serde_json::from_str(&envoy_config::render(&input)?)?;
    if let Some(url) = inp.observe.as_ref().and_then(|o| o.traces_url.as_deref()) {
        envoy_config::enable_tracing(&mut config, url)?;
    }
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
