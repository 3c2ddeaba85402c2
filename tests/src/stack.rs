//! The local stack: throwaway PostgreSQL, the companion, the model simulator and Envoy with the
//! filter, on free ports, in one temp directory. Used by `maas-local` and by every e2e test
//! (one implementation). Everything it starts dies with it (see [`crate::process`]).
//!
//! Replicas ([`StackOptions::replicas`]): ONE PostgreSQL, ONE Redis (global limits, see
//! [`crate::redis`]), one simulator, and per replica `i` a companion and an Envoy (node id
//! `gateway-<i>`) that talks to companion `i` only, so stopping one companion affects one
//! replica. Replica 0 is what the single-replica accessors (`gateway_url`, `start_companion`, …)
//! mean; the `*_of(i)` ones name a replica. Replicas start in parallel; each Envoy waits for its
//! companion. [`Stack::add_replica`] adds one while the stack runs.
//!
//! Ports: the simulator runs in this process on a listener bound before anything else sees its
//! address. PostgreSQL, the companion and Envoy are other programs that bind by address (the
//! companion takes no inherited socket), so their ports are picked free and released; when one
//! exits because another process took its port in between ("Address already in use"), it is
//! started again on fresh ports (a bounded number of times). So many stacks can start at once.

use crate::envoy_config::{self, CompanionTls, EnvoyConfigInput, WasmFilterOptions};
use crate::internal_pki::InternalPki;
use crate::postgres::Postgres;
use crate::process::{ManagedProcess, is_addr_in_use, listens_on, log_tail};
use crate::redis::Redis;
use crate::sim::{self, RecordedRequest, SimConfig, SimHandle};
use crate::tools;
use anyhow::{Context, Result, bail};
use maas_types::PolicyDocument;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Where a config file comes from.
#[derive(Debug, Clone, Default)]
pub enum ConfigSource {
    /// The shipped file in config/local/, copied into the stack's directory.
    #[default]
    Default,
    /// This YAML, written into the stack's directory.
    Yaml(String),
    /// This file, used in place (the companion reloads it when the user edits it).
    File(PathBuf),
}

#[derive(Debug, Clone)]
pub struct StackOptions {
    pub policy: ConfigSource,
    pub identities: ConfigSource,
    pub credentials: ConfigSource,
    /// Gateway port; `None` = a free port.
    pub gateway_port: Option<u16>,
    /// Address the gateway listens on.
    pub gateway_host: std::net::IpAddr,
    pub envoy_concurrency: u32,
    /// The filter's policy poll interval.
    pub poll_interval_ms: u64,
    /// How often the companion checks its policy file.
    pub policy_reload_interval_ms: u64,
    /// Load the filter (false = bare Envoy, for benchmarks).
    pub with_filter: bool,
    pub sim_chunk_delay: Duration,
    pub ready_timeout: Duration,
    /// Extra environment for the companion (e.g. cache TTLs).
    pub companion_env: Vec<(String, String)>,
    /// Keep the stack's directory (logs) after it stops.
    pub keep_dir: bool,
    /// Merged (deeply) over the filter's pluginConfig, e.g. `{"removeHeaders":["cookie"]}`.
    pub plugin_config_extra: Option<Value>,
    /// Gateway replicas: each an Envoy with its own companion (default 1). With a fixed
    /// `gateway_port` P, replica i listens on P+i when that port is free, else on a free one.
    pub replicas: usize,
    /// Start a Redis and give every companion `MAAS_REDIS_URL` (global limits across replicas).
    /// `None` (the default) = only when `replicas > 1`.
    pub redis: Option<bool>,
    /// Envoy's routes and the simulator's models from this policy YAML instead of the
    /// companion's policy file: for a companion whose models come from elsewhere (the
    /// reference's Kubernetes resources, `MAAS_POLICY_SOURCE=kubernetes`).
    pub envoy_policy: Option<String>,
    /// The companions' internal listeners admit only the gateway's client certificate (a
    /// private CA generated at start, see [`crate::internal_pki`]), which every Envoy presents.
    /// `false` runs them with `--internal-auth none` (plain HTTP): only for tools that cannot
    /// present a certificate (the benchmark's `wrk` straight at the companion).
    pub internal_mtls: bool,
    /// Envoy's request spans (OpenTelemetry tracer, OTLP/HTTP) exported to this traces URL
    /// (`http://host:port/v1/traces`), with the filter's trace attributes as custom tags.
    /// `None` (the default): no tracing.
    pub envoy_traces_url: Option<String>,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            policy: ConfigSource::Default,
            identities: ConfigSource::Default,
            credentials: ConfigSource::Default,
            gateway_port: None,
            gateway_host: [127, 0, 0, 1].into(),
            envoy_concurrency: 2,
            poll_interval_ms: 500,
            policy_reload_interval_ms: 250,
            with_filter: true,
            sim_chunk_delay: Duration::ZERO,
            ready_timeout: Duration::from_secs(90),
            companion_env: Vec::new(),
            keep_dir: std::env::var_os("MAAS_KEEP_STACK").is_some(),
            plugin_config_extra: None,
            replicas: 1,
            redis: None,
            envoy_policy: None,
            internal_mtls: true,
            envoy_traces_url: None,
        }
    }
}

impl StackOptions {
    pub fn with_policy_yaml(mut self, yaml: &str) -> Self {
        self.policy = ConfigSource::Yaml(yaml.to_string());
        self
    }
    pub fn with_identities_yaml(mut self, yaml: &str) -> Self {
        self.identities = ConfigSource::Yaml(yaml.to_string());
        self
    }
    pub fn with_credentials_yaml(mut self, yaml: &str) -> Self {
        self.credentials = ConfigSource::Yaml(yaml.to_string());
        self
    }
    /// `n` gateway replicas (and, unless `redis` says otherwise, a Redis when `n > 1`).
    pub fn with_replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }
    /// Whether a Redis runs (`replicas > 1` unless set).
    pub fn redis_enabled(&self) -> bool {
        self.redis.unwrap_or(self.replicas > 1)
    }
}

/// The ports of one replica (its companion's and its Envoy's).
#[derive(Debug, Clone, Copy)]
struct ReplicaPorts {
    gateway: SocketAddr,
    admin: SocketAddr,
    companion_public: SocketAddr,
    companion_internal: SocketAddr,
    companion_metrics: SocketAddr,
}

/// A program that exits because its port was taken is started again on fresh ports, this many
/// times in all.
const START_ATTEMPTS: usize = 5;

#[cfg(test)]
thread_local! {
    /// What the next call of `free_ports(n)` on this thread hands out, by `n` (to make a
    /// start meet taken ports: PostgreSQL asks for 1, the companion 3, Envoy 2). Here, not in
    /// the tests module: `free_ports` reads it, and code does not reach into its tests.
    static FORCED_PORTS: std::cell::RefCell<std::collections::HashMap<usize, Vec<u16>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Picks distinct free ports (all held until all are picked, then released: see the module
/// doc for why that is not enough on its own: start a program on them through a retrying start,
/// e.g. [`crate::extra_envoy`], or use them only where nothing has to listen).
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    #[cfg_attr(not(test), allow(unused_mut))]
    let mut ports = listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect::<Result<Vec<u16>>>()?;
    #[cfg(test)]
    if let Some(forced) = FORCED_PORTS.with_borrow_mut(|f| f.remove(&n)) {
        ports.iter_mut().zip(forced).for_each(|(p, f)| *p = f);
    }
    Ok(ports)
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Runs `start` again (after `repick`) while it fails with [`crate::process::AddrInUse`], up to
/// [`START_ATTEMPTS`] times in all.
pub(crate) fn retry_on_taken_port<S, T>(
    state: &mut S,
    mut repick: impl FnMut(&mut S) -> Result<()>,
    mut start: impl FnMut(&S) -> Result<T>,
) -> Result<T> {
    let mut attempt = 1;
    loop {
        repick(state)?;
        match start(state) {
            Err(e) if attempt < START_ATTEMPTS && is_addr_in_use(&e) => {
                eprintln!("maas stack: {e:#}; starting it again on fresh ports");
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Minimal HTTP/1.1 request for readiness checks: works in any thread, with or without a tokio
/// runtime. Returns the status and body.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| std::io::Error::other("no HTTP status line"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// How every companion is started (each on its own ports, with its own log).
struct CompanionSpec {
    bin: PathBuf,
    /// Everything but the listen addresses (from the replica's ports).
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// How every Envoy's bootstrap is rendered and Envoy started.
struct EnvoySpec {
    bin: PathBuf,
    concurrency: u32,
    policy: PolicyDocument,
    filter: Option<WasmFilterOptions>,
    plugin_config_extra: Option<Value>,
    /// The stack's replica count, the filter's `limits.global.replicas` (as deploy.sh sets the
    /// Gateway's): what a replica in fallback assumes at least.
    gateway_replicas: usize,
    gateway_host: std::net::IpAddr,
    /// The user's gateway port: replica 0 listens there (it was checked free), replica i on
    /// port + i when free.
    gateway_port: Option<u16>,
    /// What the companion cluster presents and checks (`None`: plain HTTP).
    companion_tls: Option<CompanionTls>,
    /// Where Envoy's spans go ([`StackOptions::envoy_traces_url`]).
    traces_url: Option<String>,
}

/// One gateway replica: a companion and the Envoy that talks to it. Its ports stay its own
/// across stops and starts.
struct Replica {
    index: usize,
    node_id: String,
    ports: ReplicaPorts,
    companion: Mutex<Option<ManagedProcess>>,
    envoy: Mutex<Option<ManagedProcess>>,
    companion_log: PathBuf,
    envoy_log: PathBuf,
    envoy_config_path: PathBuf,
    /// Where this replica's Envoy writes the filter's usage events (one JSON line each).
    usage_events_path: PathBuf,
}

impl Replica {
    fn gateway_connect_addr(&self) -> SocketAddr {
        connect_addr(self.ports.gateway)
    }
}

/// Where a client reaches a listener bound to `addr` (an unspecified address: this host).
fn connect_addr(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    }
}

/// What must be stopped and removed. Registered globally (weakly) so that stacks kept in
/// statics, which are never dropped, are still stopped and removed when the process exits.
struct Resources {
    dir: Mutex<Option<tempfile::TempDir>>,
    postgres: Mutex<Option<Postgres>>,
    redis: Mutex<Option<Redis>>,
    replicas: Mutex<Vec<Arc<Replica>>>,
    /// Set by [`Resources::shutdown`]: no replica may be added after it.
    stopped: AtomicBool,
}

fn live_stacks() -> &'static Mutex<Vec<Weak<Resources>>> {
    static LIVE: OnceLock<Mutex<Vec<Weak<Resources>>>> = OnceLock::new();
    LIVE.get_or_init(|| {
        extern "C" fn stop_live_stacks_at_exit() {
            let live: Vec<Weak<Resources>> = std::mem::take(&mut *lock(live_stacks()));
            for res in live.iter().filter_map(Weak::upgrade) {
                res.shutdown();
            }
        }
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe {
            libc::atexit(stop_live_stacks_at_exit);
        }
        Mutex::new(Vec::new())
    })
}

impl Resources {
    fn register(res: Resources) -> Arc<Resources> {
        let res = Arc::new(res);
        let mut live = lock(live_stacks());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&res));
        res
    }

    fn replicas(&self) -> Vec<Arc<Replica>> {
        lock(&self.replicas).clone()
    }

    /// The Envoys, the companions, Redis, then PostgreSQL (gracefully); then the directory.
    /// Idempotent.
    fn shutdown(&self) {
        let replicas = {
            let replicas = lock(&self.replicas);
            self.stopped.store(true, Ordering::SeqCst);
            replicas.clone()
        };
        for r in &replicas {
            if let Some(mut p) = lock(&r.envoy).take() {
                p.stop(Duration::from_secs(5));
            }
        }
        for r in &replicas {
            if let Some(mut p) = lock(&r.companion).take() {
                p.stop(Duration::from_secs(5));
            }
        }
        if let Some(mut redis) = lock(&self.redis).take() {
            redis.stop();
        }
        if let Some(mut pg) = lock(&self.postgres).take() {
            pg.stop();
        }
        drop(lock(&self.dir).take());
    }

    fn log_paths(&self) -> Vec<PathBuf> {
        let mut paths = Vec::new();
        for r in self.replicas() {
            paths.push(r.companion_log.clone());
            paths.push(r.envoy_log.clone());
        }
        if let Some(pg) = lock(&self.postgres).as_ref() {
            paths.push(pg.log_path().to_path_buf());
        }
        if let Some(redis) = lock(&self.redis).as_ref() {
            paths.push(redis.log_path().to_path_buf());
        }
        paths
    }

    fn log_tails(&self) -> String {
        self.log_paths()
            .iter()
            .map(|p| format!("--- {} (tail) ---\n{}", p.display(), log_tail(p, 3000)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Everything a replica needs to start (shared by the replicas started at once, and by
/// [`Stack::add_replica`] later).
struct Core {
    /// Processes and directory, shared with the exit-time cleanup registry.
    res: Arc<Resources>,
    dir_path: PathBuf,
    companion: CompanionSpec,
    envoy: EnvoySpec,
    sim_addr: SocketAddr,
    ready_timeout: Duration,
}

pub struct Stack {
    core: Core,
    /// Replica 0 (also `res.replicas[0]`): what the single-replica accessors mean.
    primary: Arc<Replica>,
    /// Serialises [`Stack::add_replica`] (indexes and ports).
    adding: Mutex<()>,
    postgres_port: u16,
    redis_addr: Option<SocketAddr>,
    policy_path: PathBuf,
    identities_path: PathBuf,
    credentials_path: PathBuf,
    sim: SimHandle,
    /// The internal listeners' PKI (`None` with `internal_mtls: false`).
    internal_pki: Option<InternalPki>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn place_config(source: &ConfigSource, default_name: &str, dir: &Path) -> Result<PathBuf> {
    Ok(match source {
        ConfigSource::Default => {
            let target = dir.join(default_name);
            std::fs::copy(tools::local_config(default_name)?, &target)?;
            target
        }
        ConfigSource::Yaml(yaml) => {
            let target = dir.join(default_name);
            std::fs::write(&target, yaml)?;
            target
        }
        ConfigSource::File(path) => path
            .canonicalize()
            .with_context(|| format!("{} not found", path.display()))?,
    })
}

fn load_policy(path: &Path) -> Result<PolicyDocument> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    // YAML → JSON value → the shared parser, so errors name the field exactly as the companion's do.
    let value: Value =
        yaml_serde::from_str(&text).with_context(|| format!("{}: not YAML", path.display()))?;
    PolicyDocument::from_value(value).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// File name of replica `index`'s `stem.ext` (replica 0 keeps the single-replica names).
fn replica_file(dir: &Path, stem: &str, ext: &str, index: usize) -> PathBuf {
    if index == 0 {
        dir.join(format!("{stem}.{ext}"))
    } else {
        dir.join(format!("{stem}-{index}.{ext}"))
    }
}

impl Core {
    /// Polls `check` until it returns true; fails with the log tails when `process` exits (as
    /// [`crate::process::AddrInUse`] when its port was taken) or the timeout passes.
    fn wait_for(
        &self,
        what: &str,
        process: &mut ManagedProcess,
        mut check: impl FnMut() -> Result<bool>,
    ) -> Result<()> {
        let deadline = Instant::now() + self.ready_timeout;
        let mut last_err: String;
        loop {
            match check() {
                Ok(true) => return Ok(()),
                Ok(false) => last_err = "not ready yet".into(),
                Err(e) => last_err = e.to_string(),
            }
            if let Some(taken) = process.exited_addr_in_use() {
                return Err(anyhow::Error::new(taken)
                    .context(format!("{} exited while waiting for {what}", process.name)));
            }
            if let Some(status) = process.exited() {
                bail!(
                    "{} exited ({status}) while waiting for {what}\n{}",
                    process.name,
                    self.res.log_tails()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} not ready after {:?} ({last_err})\n{}",
                    self.ready_timeout,
                    self.res.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts a companion on `ports` and waits until it answers.
    fn spawn_companion(
        &self,
        index: usize,
        ports: &ReplicaPorts,
        log: &Path,
    ) -> Result<ManagedProcess> {
        let spec = &self.companion;
        let mut cmd = Command::new(&spec.bin);
        cmd.arg(format!("--public-addr={}", ports.companion_public))
            .arg(format!("--internal-addr={}", ports.companion_internal))
            .arg(format!("--metrics-addr={}", ports.companion_metrics))
            .args(&spec.args);
        // The model URLs of `GET /v1/models` are this replica's gateway's, as a cluster's
        // companion has the Gateway's hostname; a MAAS_PUBLIC_URL of the caller's wins.
        let public_url_given = std::env::var_os("MAAS_PUBLIC_URL").is_some()
            || spec.env.iter().any(|(k, _)| k == "MAAS_PUBLIC_URL");
        if !public_url_given && ports.gateway.port() != 0 {
            cmd.env(
                "MAAS_PUBLIC_URL",
                format!("http://{}", connect_addr(ports.gateway)),
            );
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let name = if index == 0 {
            "companion".to_string()
        } else {
            format!("companion-{index}")
        };
        let mut process = ManagedProcess::spawn(&name, cmd, log, libc::SIGTERM, libc::SIGKILL)?;
        let public = ports.companion_public;
        let internal = ports.companion_internal;
        let metrics = ports.companion_metrics;
        // Another stack's companion may answer on a port taken between the pick and the bind:
        // only this process's own listeners count.
        let pid = process.pid().unwrap_or_default();
        self.wait_for(&format!("{name} /health"), &mut process, || {
            Ok(
                http_request(public, "GET", "/health", Duration::from_secs(1))?.0 == 200
                    && TcpStream::connect_timeout(&internal, Duration::from_secs(1)).is_ok()
                    && [public, internal, metrics]
                        .iter()
                        .all(|a| listens_on(pid, a.port())),
            )
        })?;
        Ok(process)
    }

    /// Writes replica `index`'s Envoy bootstrap for `ports` (its own companion, node id, usage
    /// events file).
    fn write_envoy_config(
        &self,
        ports: &ReplicaPorts,
        node_id: &str,
        usage_events: &Path,
        path: &Path,
    ) -> Result<()> {
        let spec = &self.envoy;
        let rendered = envoy_config::render(&EnvoyConfigInput {
            policy: &spec.policy,
            listen: ports.gateway,
            admin: ports.admin,
            companion_public: ports.companion_public,
            companion_internal: ports.companion_internal,
            simulator: self.sim_addr,
            filter: spec.filter.clone(),
            companion_tls: spec.companion_tls.clone(),
            usage_events_path: Some(usage_events.to_path_buf()),
        })?;
        // Merged before the test's extra, which may replace it (`null` unsets it).
        let rendered = match &spec.filter {
            Some(_) => envoy_config::with_plugin_config_extra(
                &rendered,
                &serde_json::json!({"limits": {"global": {"replicas": spec.gateway_replicas}}}),
            )?,
            None => rendered,
        };
        let rendered = match &spec.plugin_config_extra {
            Some(extra) => envoy_config::with_plugin_config_extra(&rendered, extra)?,
            None => rendered,
        };
        let rendered = envoy_config::with_node_id(&rendered, node_id)?;
        let rendered = match &spec.traces_url {
            Some(url) => envoy_config::with_tracing(&rendered, url)?,
            None => rendered,
        };
        std::fs::write(path, rendered)?;
        Ok(())
    }

    /// Starts Envoy with the bootstrap at `config` and waits until its admin says ready and its
    /// gateway serves `/maas-api/health` (through its companion).
    fn spawn_envoy(
        &self,
        index: usize,
        ports: &ReplicaPorts,
        config: &Path,
        log: &Path,
    ) -> Result<ManagedProcess> {
        let mut cmd = Command::new(&self.envoy.bin);
        cmd.arg("-c")
            .arg(config)
            .arg("--disable-hot-restart")
            .args(["--concurrency", &self.envoy.concurrency.to_string()])
            // The usage events file is written within a quarter second (default: 10 s).
            .args(["--file-flush-interval-msec", "250"])
            .args([
                "-l",
                &std::env::var("MAAS_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
            ]);
        let name = if index == 0 {
            "envoy".to_string()
        } else {
            format!("envoy-{index}")
        };
        let mut process = ManagedProcess::spawn(&name, cmd, log, libc::SIGTERM, libc::SIGKILL)?;
        let admin = ports.admin;
        let pid = process.pid().unwrap_or_default();
        self.wait_for(&format!("{name} admin /ready"), &mut process, || {
            Ok(
                http_request(admin, "GET", "/ready", Duration::from_secs(1))?.0 == 200
                    && listens_on(pid, admin.port())
                    && listens_on(pid, ports.gateway.port()),
            )
        })?;
        let g = ports.gateway;
        let gateway = if g.ip().is_unspecified() {
            local(g.port())
        } else {
            g
        };
        self.wait_for(
            &format!("{name} gateway /maas-api/health"),
            &mut process,
            || {
                Ok(
                    http_request(gateway, "GET", "/maas-api/health", Duration::from_secs(2))?.0
                        == 200,
                )
            },
        )?;
        Ok(process)
    }

    /// Starts replica `index`: its companion on fresh ports, then its Envoy (pointing at that
    /// companion), each started again on fresh ports when one was taken meanwhile.
    fn start_replica(&self, index: usize) -> Result<Arc<Replica>> {
        let ip = self.envoy.gateway_host;
        let companion_log = replica_file(&self.dir_path, "companion", "log", index);
        let envoy_log = replica_file(&self.dir_path, "envoy", "log", index);
        let envoy_config_path = replica_file(&self.dir_path, "envoy", "json", index);
        let usage_events_path = replica_file(&self.dir_path, "usage-events", "jsonl", index);
        let node_id = format!("gateway-{index}");
        // Replica 0 takes the user's port (checked free before anything started) on every
        // attempt; replica i takes port + i on its first attempt when it is free. The gateway
        // port is chosen before the companion starts: the companion names it (its public URL).
        let fixed = (index == 0).then_some(self.envoy.gateway_port).flatten();
        let mut preferred = self
            .envoy
            .gateway_port
            .filter(|_| index > 0)
            .and_then(|p| u16::try_from(usize::from(p) + index).ok())
            .filter(|p| TcpListener::bind((ip, *p)).is_ok());
        let mut ports = ReplicaPorts {
            gateway: SocketAddr::new(ip, 0),
            admin: local(0),
            companion_public: local(0),
            companion_internal: local(0),
            companion_metrics: local(0),
        };
        ports.gateway = SocketAddr::new(
            ip,
            match fixed.or(preferred.take()) {
                Some(p) => p,
                None => free_ports(1)?[0],
            },
        );
        let mut companion = retry_on_taken_port(
            &mut ports,
            |ports| {
                let p = free_ports(3)?;
                ports.companion_public = local(p[0]);
                ports.companion_internal = local(p[1]);
                ports.companion_metrics = local(p[2]);
                Ok(())
            },
            |ports| self.spawn_companion(index, ports, &companion_log),
        )?;
        let companion_gateway = ports.gateway;
        let mut first = true;
        let mut state = ports;
        let envoy = retry_on_taken_port(
            &mut state,
            |ports| {
                let p = free_ports(2)?;
                ports.admin = local(p[0]);
                // After a taken gateway port, a fresh one (the companion is started again
                // below to name it).
                if !std::mem::take(&mut first) && fixed.is_none() {
                    ports.gateway = SocketAddr::new(ip, p[1]);
                }
                self.write_envoy_config(ports, &node_id, &usage_events_path, &envoy_config_path)
            },
            |ports| self.spawn_envoy(index, ports, &envoy_config_path, &envoy_log),
        );
        let envoy = match envoy {
            Ok(envoy) => envoy,
            Err(e) => {
                companion.stop(Duration::from_secs(5));
                return Err(e);
            }
        };
        if state.gateway != companion_gateway {
            companion.stop(Duration::from_secs(5));
            companion = self.spawn_companion(index, &state, &companion_log)?;
        }
        Ok(Arc::new(Replica {
            index,
            node_id,
            ports: state,
            companion: Mutex::new(Some(companion)),
            envoy: Mutex::new(Some(envoy)),
            companion_log,
            envoy_log,
            envoy_config_path,
            usage_events_path,
        }))
    }
}

/// The model simulator, serving the models whose backend is `simulator`.
fn spawn_sim(policy: &PolicyDocument, chunk_delay: Duration) -> Result<sim::SimHandle> {
    let sim_models = policy
        .models
        .iter()
        .filter(|m| m.backend.as_deref().unwrap_or("simulator") == "simulator")
        .map(|m| m.name.clone())
        .collect();
    Ok(sim::spawn(
        local(0),
        SimConfig {
            chunk_delay,
            models: sim_models,
            served_only: false,
        },
    )?)
}

/// PostgreSQL (in `dir`/postgres) and, when asked for, Redis (in `dir`/redis), started side by
/// side on free ports.
fn start_postgres_and_redis(
    pg_bin: &Path,
    dir: &Path,
    with_redis: bool,
) -> Result<(Postgres, Option<Redis>)> {
    let pg_dir = dir.join("postgres");
    std::fs::create_dir_all(&pg_dir)?;
    let redis_dir = dir.join("redis");
    // PostgreSQL and Redis start side by side.
    let (postgres, redis) = std::thread::scope(|s| {
        let redis = s.spawn(|| {
            with_redis
                .then(|| Redis::start_on_free_port(&redis_dir, || Ok(free_ports(1)?[0])))
                .transpose()
        });
        let postgres =
            Postgres::init_and_start_on_free_port(pg_bin, &pg_dir, || Ok(free_ports(1)?[0]));
        let redis = redis
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("starting redis panicked")));
        (postgres, redis)
    });
    Ok((postgres?, redis?))
}

/// The companion's environment: `RUST_LOG` (ours, else `info`), the Redis URL, the options'.
fn companion_env(redis: Option<&Redis>, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env = vec![(
        "RUST_LOG".to_string(),
        std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
    )];
    if let Some(redis) = redis {
        env.push(("MAAS_REDIS_URL".to_string(), redis.url()));
    }
    env.extend(extra.iter().cloned());
    env
}

/// Starts the `n` replicas; if any fails, stops the stack and answers the first error.
fn start_replicas(core: &Core, n: usize) -> Result<Vec<Arc<Replica>>> {
    // Replicas start side by side; each Envoy waits for its own companion. One replica
    // starts on this thread.
    let started: Vec<Result<Arc<Replica>>> = if n == 1 {
        vec![core.start_replica(0)]
    } else {
        std::thread::scope(|s| {
            let core = &core;
            let handles: Vec<_> = (0..n)
                .map(|i| s.spawn(move || core.start_replica(i)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("starting a replica panicked")))
                })
                .collect()
        })
    };
    let mut replicas = Vec::with_capacity(started.len());
    let mut first_err = None;
    for r in started {
        match r {
            Ok(r) => replicas.push(r),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    *lock(&core.res.replicas) = replicas.clone();
    if let Some(e) = first_err {
        core.res.shutdown();
        return Err(e);
    }
    Ok(replicas)
}

/// The companion's command line: its database, the policy, identities and credentials files
/// (`files`, in that order), where the simulator runs (the readiness probe of `backend:
/// simulator` models) and how the internal listener authenticates callers.
fn companion_args(
    postgres: &Postgres,
    policy_reload_interval_ms: u64,
    files: [&Path; 3],
    simulator: SocketAddr,
    internal_pki: Option<&InternalPki>,
) -> Vec<String> {
    let [policy_path, identities_path, credentials_path] = files;
    let internal_auth_args = match internal_pki {
        Some(pki) => pki.companion_args(),
        None => vec!["--internal-auth=none".to_string()],
    };
    vec![
        format!("--database-url={}", postgres.url("maas")),
        format!("--policy-file={}", policy_path.display()),
        format!("--policy-reload-interval-ms={policy_reload_interval_ms}"),
        "--identity-provider=static".to_string(),
        format!("--identities-file={}", identities_path.display()),
        "--credentials-source=file".to_string(),
        format!("--credentials-file={}", credentials_path.display()),
        format!("--simulator-url=http://{}", connect_addr(simulator)),
    ]
    .into_iter()
    .chain(internal_auth_args)
    .collect()
}

/// The policy Envoy's routes are rendered from: the stack's own, or the one the options give
/// Envoy alone (written beside it as `envoy-policy.yaml`).
fn envoy_policy(yaml: Option<&str>, policy_path: &Path, dir: &Path) -> Result<PolicyDocument> {
    match yaml {
        None => load_policy(policy_path),
        Some(yaml) => {
            let path = dir.join("envoy-policy.yaml");
            std::fs::write(&path, yaml)?;
            load_policy(&path)
        }
    }
}

/// How each replica's Envoy is started and configured.
fn envoy_spec(
    options: &StackOptions,
    bin: PathBuf,
    policy: PolicyDocument,
    wasm: Option<PathBuf>,
    companion_tls: Option<crate::envoy_config::CompanionTls>,
) -> EnvoySpec {
    EnvoySpec {
        bin,
        concurrency: options.envoy_concurrency,
        policy,
        filter: wasm.map(|wasm_path| WasmFilterOptions {
            wasm_path,
            poll_interval_ms: options.poll_interval_ms,
        }),
        plugin_config_extra: options.plugin_config_extra.clone(),
        gateway_replicas: options.replicas,
        gateway_host: options.gateway_host,
        gateway_port: options.gateway_port,
        companion_tls,
        traces_url: options.envoy_traces_url.clone(),
    }
}

impl Stack {
    /// Starts everything and waits until every piece answers.
    pub fn start(options: StackOptions) -> Result<Stack> {
        if options.replicas == 0 {
            bail!("a stack needs at least one replica");
        }
        // Find every tool first, so a missing one fails fast with a clear message.
        let pg_bin = tools::pg_bin_dir()?;
        let companion_bin = tools::companion_bin()?;
        let envoy_bin = tools::envoy_bin()?;
        let with_redis = options.redis_enabled();
        if with_redis {
            crate::redis::redis_server_bin()?;
        }
        let wasm = if options.with_filter {
            Some(tools::wasm_file()?)
        } else {
            None
        };

        let dir = tempfile::Builder::new().prefix("maas-stack-").tempdir()?;
        let dir_path = dir.path().to_path_buf();
        // PostgreSQL runs as another user when we are root: it must reach its subdirectory.
        std::fs::set_permissions(
            &dir_path,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;

        let policy_path = place_config(&options.policy, "policy.yaml", &dir_path)?;
        let identities_path = place_config(&options.identities, "identities.yaml", &dir_path)?;
        let credentials_path = place_config(&options.credentials, "credentials.yaml", &dir_path)?;
        let policy = envoy_policy(options.envoy_policy.as_deref(), &policy_path, &dir_path)?;

        let ip = options.gateway_host;
        if let Some(p) = options.gateway_port
            && let Err(e) = TcpListener::bind((ip, p))
        {
            bail!(
                "gateway port {p} is not free ({e}): choose another with --port N or MAAS_GATEWAY_PORT"
            );
        }

        let sim = spawn_sim(&policy, options.sim_chunk_delay)?;

        let (postgres, redis) = start_postgres_and_redis(&pg_bin, &dir_path, with_redis)?;
        let postgres_port = postgres.port();
        let redis_addr = redis.as_ref().map(Redis::addr);

        let env = companion_env(redis.as_ref(), &options.companion_env);
        let internal_pki = if options.internal_mtls {
            Some(InternalPki::generate(&dir_path.join("internal-pki"))?)
        } else {
            None
        };
        let companion = CompanionSpec {
            bin: companion_bin,
            args: companion_args(
                &postgres,
                options.policy_reload_interval_ms,
                [&policy_path, &identities_path, &credentials_path],
                sim.addr(),
                internal_pki.as_ref(),
            ),
            env,
        };

        let dir_slot = if options.keep_dir {
            let _ = dir.keep();
            None
        } else {
            Some(dir)
        };
        let core = Core {
            res: Resources::register(Resources {
                dir: Mutex::new(dir_slot),
                postgres: Mutex::new(Some(postgres)),
                redis: Mutex::new(redis),
                replicas: Mutex::new(Vec::new()),
                stopped: AtomicBool::new(false),
            }),
            dir_path,
            companion,
            envoy: envoy_spec(
                &options,
                envoy_bin,
                policy,
                wasm,
                internal_pki.as_ref().map(InternalPki::envoy_tls),
            ),
            sim_addr: sim.addr(),
            ready_timeout: options.ready_timeout,
        };
        if options.keep_dir {
            eprintln!("maas stack directory (kept): {}", core.dir_path.display());
        }
        let replicas = start_replicas(&core, options.replicas)?;
        let primary = replicas.first().cloned().context("no replica started")?;
        Ok(Stack {
            core,
            primary,
            adding: Mutex::new(()),
            postgres_port,
            redis_addr,
            policy_path,
            identities_path,
            credentials_path,
            sim,
            internal_pki,
        })
    }

    /// The stack shared by all tests of one test binary: started once, lazily, on a dedicated
    /// thread; stopped (and its directory removed) when the process exits, like every stack
    /// still alive then (e.g. kept in a test's own static).
    pub fn shared() -> &'static Stack {
        static SHARED: OnceLock<std::result::Result<Stack, String>> = OnceLock::new();
        let result = SHARED.get_or_init(|| {
            std::thread::Builder::new()
                .name("maas-stack-start".into())
                .spawn(|| Stack::start(StackOptions::default()).map_err(|e| format!("{e:#}")))
                .map_err(|e| e.to_string())
                .and_then(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("stack start panicked".into()))
                })
        });
        match result {
            Ok(stack) => stack,
            Err(e) => panic!("the local stack did not start: {e}"),
        }
    }

    /// Fails when an Envoy, a companion, PostgreSQL or Redis has exited on its own (ones
    /// stopped on purpose do not count).
    pub fn check_alive(&self) -> Result<()> {
        for r in self.core.res.replicas() {
            for (name, slot) in [("companion", &r.companion), ("envoy", &r.envoy)] {
                if let Some(status) = lock(slot).as_mut().and_then(ManagedProcess::exited) {
                    bail!(
                        "{name} of replica {} exited ({status})\n{}",
                        r.index,
                        self.log_tails()
                    );
                }
            }
        }
        if let Some(status) = lock(&self.core.res.postgres)
            .as_mut()
            .and_then(Postgres::exited)
        {
            bail!("postgres exited ({status})\n{}", self.log_tails());
        }
        if let Some(status) = lock(&self.core.res.redis).as_mut().and_then(Redis::exited) {
            bail!("redis exited ({status})\n{}", self.log_tails());
        }
        Ok(())
    }

    fn log_tails(&self) -> String {
        self.core.res.log_tails()
    }

    // ---- replicas ----

    fn replica(&self, index: usize) -> Result<Arc<Replica>> {
        lock(&self.core.res.replicas)
            .get(index)
            .cloned()
            .with_context(|| format!("no replica {index}"))
    }

    /// How many replicas the stack has (stopped ones included).
    pub fn replica_count(&self) -> usize {
        lock(&self.core.res.replicas).len()
    }

    /// Every replica's gateway URL, replica 0 first.
    pub fn gateway_urls(&self) -> Vec<String> {
        self.core
            .res
            .replicas()
            .iter()
            .map(|r| format!("http://{}", r.gateway_connect_addr()))
            .collect()
    }

    /// Replica `index`'s gateway URL (panics on a replica that does not exist).
    pub fn gateway_url_of(&self, index: usize) -> String {
        match self.replica(index) {
            Ok(r) => format!("http://{}", r.gateway_connect_addr()),
            Err(e) => panic!("{e}"),
        }
    }

    fn replica_or_panic(&self, index: usize) -> Arc<Replica> {
        self.replica(index).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn envoy_admin_url_of(&self, index: usize) -> String {
        format!("http://{}", self.replica_or_panic(index).ports.admin)
    }
    /// Replica `index`'s internal listener: `https://…` behind mutual TLS (call it with
    /// [`Stack::internal_client`]), `http://…` with `internal_mtls: false`.
    pub fn companion_internal_url_of(&self, index: usize) -> String {
        format!(
            "{}://{}",
            self.internal_scheme(),
            self.replica_or_panic(index).ports.companion_internal
        )
    }
    pub fn companion_public_url_of(&self, index: usize) -> String {
        format!(
            "http://{}",
            self.replica_or_panic(index).ports.companion_public
        )
    }
    pub fn companion_metrics_url_of(&self, index: usize) -> String {
        format!(
            "http://{}",
            self.replica_or_panic(index).ports.companion_metrics
        )
    }
    /// Replica `index`'s Envoy node id (`gateway-<index>`): the filter's default replica id.
    pub fn node_id_of(&self, index: usize) -> String {
        self.replica_or_panic(index).node_id.clone()
    }

    /// Starts replica `index`'s companion again (same ports) unless it runs.
    pub fn start_companion_of(&self, index: usize) -> Result<()> {
        let r = self.replica(index)?;
        let mut slot = lock(&r.companion);
        if slot.as_mut().is_some_and(ManagedProcess::is_running) {
            return Ok(());
        }
        *slot = Some(
            self.core
                .spawn_companion(index, &r.ports, &r.companion_log)?,
        );
        Ok(())
    }

    /// Stops replica `index`'s companion (SIGTERM, then SIGKILL after 5 s).
    pub fn stop_companion_of(&self, index: usize) {
        if let Ok(r) = self.replica(index)
            && let Some(mut p) = lock(&r.companion).take()
        {
            p.stop(Duration::from_secs(5));
        }
    }

    /// Kills replica `index`'s companion at once (SIGKILL: no graceful shutdown).
    pub fn kill_companion_of(&self, index: usize) {
        if let Ok(r) = self.replica(index)
            && let Some(mut p) = lock(&r.companion).take()
        {
            p.stop(Duration::ZERO);
        }
    }

    /// Starts replica `index`'s Envoy again (same ports and bootstrap) unless it runs; waits
    /// until its gateway serves (which needs its companion).
    pub fn start_envoy_of(&self, index: usize) -> Result<()> {
        let r = self.replica(index)?;
        let mut slot = lock(&r.envoy);
        if slot.as_mut().is_some_and(ManagedProcess::is_running) {
            return Ok(());
        }
        *slot = Some(
            self.core
                .spawn_envoy(index, &r.ports, &r.envoy_config_path, &r.envoy_log)?,
        );
        Ok(())
    }

    /// Stops replica `index`'s Envoy (SIGTERM, then SIGKILL after 5 s).
    pub fn stop_envoy_of(&self, index: usize) {
        if let Ok(r) = self.replica(index)
            && let Some(mut p) = lock(&r.envoy).take()
        {
            p.stop(Duration::from_secs(5));
        }
    }

    /// Adds a replica (a companion and an Envoy) while the stack runs; returns its index.
    pub fn add_replica(&self) -> Result<usize> {
        let _adding = lock(&self.adding);
        let index = self.replica_count();
        let replica = self.core.start_replica(index)?;
        let mut replicas = lock(&self.core.res.replicas);
        if self.core.res.stopped.load(Ordering::SeqCst) {
            // Shut down meanwhile.
            drop(replicas);
            if let Some(mut p) = lock(&replica.envoy).take() {
                p.stop(Duration::from_secs(5));
            }
            if let Some(mut p) = lock(&replica.companion).take() {
                p.stop(Duration::from_secs(5));
            }
            bail!("the stack is shut down");
        }
        replicas.push(replica);
        Ok(index)
    }

    // ---- Redis ----

    /// Whether the stack runs a Redis (its companions share it).
    pub fn has_redis(&self) -> bool {
        self.redis_addr.is_some()
    }

    /// `redis://127.0.0.1:PORT` when the stack has a Redis.
    pub fn redis_url(&self) -> Option<String> {
        self.redis_addr.map(|a| format!("redis://{a}"))
    }

    /// Stops Redis (its port stays reserved to it; its data is lost: no persistence).
    pub fn stop_redis(&self) {
        if let Some(redis) = lock(&self.core.res.redis).as_mut() {
            redis.stop();
        }
    }

    /// Starts Redis again on its port (empty).
    pub fn start_redis(&self) -> Result<()> {
        match lock(&self.core.res.redis).as_mut() {
            Some(redis) => redis.start(),
            None => bail!("the stack has no redis (or is shut down)"),
        }
    }

    /// Freezes Redis (SIGSTOP): the companions' calls time out, its data is kept.
    pub fn pause_redis(&self) -> Result<()> {
        match lock(&self.core.res.redis).as_mut() {
            Some(redis) => redis.pause(),
            None => bail!("the stack has no redis (or is shut down)"),
        }
    }

    /// Lets a paused Redis run again, with its data.
    pub fn resume_redis(&self) -> Result<()> {
        match lock(&self.core.res.redis).as_mut() {
            Some(redis) => redis.resume(),
            None => bail!("the stack has no redis (or is shut down)"),
        }
    }

    /// One command to the stack's Redis (e.g. `["GET", key]`).
    pub fn redis_command(&self, args: &[&str]) -> Result<crate::redis::Resp> {
        let addr = self.redis_addr.context("the stack has no redis")?;
        crate::redis::command(addr, args)
    }

    /// Calls per command since Redis (re)started (`INFO commandstats`), e.g. `{"evalsha": 12}`.
    pub fn redis_command_calls(&self) -> Result<std::collections::BTreeMap<String, u64>> {
        let info = self
            .redis_command(&["INFO", "commandstats"])?
            .text()
            .context("INFO commandstats: not a string")?;
        Ok(crate::redis::parse_commandstats(&info))
    }

    /// Keys matching `pattern` in the stack's Redis.
    pub fn redis_keys(&self, pattern: &str) -> Result<Vec<String>> {
        match lock(&self.core.res.redis).as_ref() {
            Some(redis) => redis.keys(pattern),
            None => bail!("the stack has no redis (or is shut down)"),
        }
    }

    // ---- accessors (replica 0) ----

    pub fn gateway_url(&self) -> String {
        format!("http://{}", self.primary.gateway_connect_addr())
    }
    pub fn gateway_addr(&self) -> SocketAddr {
        self.primary.gateway_connect_addr()
    }
    pub fn companion_public_url(&self) -> String {
        format!("http://{}", self.primary.ports.companion_public)
    }
    /// The internal listener: `https://…` behind mutual TLS (call it with
    /// [`Stack::internal_client`]), `http://…` with `internal_mtls: false`.
    pub fn companion_internal_url(&self) -> String {
        format!(
            "{}://{}",
            self.internal_scheme(),
            self.primary.ports.companion_internal
        )
    }
    fn internal_scheme(&self) -> &'static str {
        if self.internal_pki.is_some() {
            "https"
        } else {
            "http"
        }
    }
    /// The internal listeners' PKI (`None` with `internal_mtls: false`).
    pub fn internal_pki(&self) -> Option<&InternalPki> {
        self.internal_pki.as_ref()
    }
    /// A client for the internal listeners that presents the gateway's certificate, as the
    /// stack's Envoys do (a plain client with `internal_mtls: false`).
    pub fn internal_client(&self) -> reqwest::Client {
        match &self.internal_pki {
            Some(pki) => pki.gateway_client().unwrap_or_else(|e| {
                panic!("the gateway's client certificate cannot be loaded: {e:#}")
            }),
            None => self.client(),
        }
    }
    /// The companion's metrics listener (`GET /metrics`).
    pub fn companion_metrics_url(&self) -> String {
        format!("http://{}", self.primary.ports.companion_metrics)
    }
    pub fn sim_url(&self) -> String {
        self.sim.url()
    }
    pub fn envoy_admin_url(&self) -> String {
        format!("http://{}", self.primary.ports.admin)
    }
    /// `postgres://postgres@127.0.0.1:PORT/maas` (trust auth).
    pub fn database_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/maas", self.postgres_port)
    }
    pub fn dir(&self) -> &Path {
        &self.core.dir_path
    }
    pub fn policy_path(&self) -> &Path {
        &self.policy_path
    }
    /// The models Envoy routes (name and path prefix), as the stack started.
    pub fn routed_models(&self) -> Vec<(String, String)> {
        self.core
            .envoy
            .policy
            .models
            .iter()
            .map(|m| (m.name.clone(), m.path.clone()))
            .collect()
    }
    pub fn identities_path(&self) -> &Path {
        &self.identities_path
    }
    pub fn credentials_path(&self) -> &Path {
        &self.credentials_path
    }
    pub fn envoy_config_path(&self) -> &Path {
        &self.primary.envoy_config_path
    }
    /// Where Envoy writes the filter's usage events (policy `observability.usageEvents`): one
    /// JSON line per request the usage ledger counts (docs/contracts.md "Usage events").
    pub fn usage_events_path(&self) -> &Path {
        &self.primary.usage_events_path
    }
    /// Replica `index`'s usage events file (each Envoy writes its own).
    pub fn usage_events_path_of(&self, index: usize) -> PathBuf {
        self.replica_or_panic(index).usage_events_path.clone()
    }
    /// Envoy's pid while it runs.
    pub fn envoy_pid(&self) -> Option<u32> {
        lock(&self.primary.envoy)
            .as_ref()
            .and_then(ManagedProcess::pid)
    }

    // ---- process control (fault tests) ----

    pub fn start_companion(&self) -> Result<()> {
        self.start_companion_of(0)
    }

    pub fn stop_companion(&self) {
        self.stop_companion_of(0)
    }

    /// Stops PostgreSQL (fast shutdown), keeping its data.
    pub fn stop_postgres(&self) {
        if let Some(pg) = lock(&self.core.res.postgres).as_mut() {
            pg.stop();
        }
    }

    pub fn start_postgres(&self) -> Result<()> {
        match lock(&self.core.res.postgres).as_mut() {
            Some(pg) => pg.start(),
            None => bail!("the stack is shut down"),
        }
    }

    /// Writes the policy file atomically; the companions reload it (within their reload
    /// interval) and the filters pick it up at their next poll.
    pub fn replace_policy(&self, yaml: &str) -> Result<()> {
        let tmp = self.policy_path.with_extension("yaml.tmp");
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, &self.policy_path)?;
        Ok(())
    }

    // ---- simulator ----

    pub fn sim(&self) -> &SimHandle {
        &self.sim
    }
    /// Requests the simulator received, oldest first.
    pub fn sim_requests(&self) -> Vec<RecordedRequest> {
        self.sim.requests()
    }
    /// Requests carrying header `x-test-id: <id>` (how tests tell their requests apart).
    pub fn sim_requests_with_test_id(&self, id: &str) -> Vec<RecordedRequest> {
        self.sim
            .requests()
            .into_iter()
            .filter(|r| r.header("x-test-id") == Some(id))
            .collect()
    }
    pub fn clear_sim_requests(&self) {
        self.sim.clear()
    }

    // ---- HTTP helpers ----

    /// A new async client (60 s timeout). New per call on purpose: pooled connections belong
    /// to the tokio runtime that opened them, and every `#[tokio::test]` has its own runtime.
    pub fn client(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap_or_default()
    }

    /// `POST $GATEWAY/maas-api/v1/api-keys` as the identity `token`; returns the 201 body (its
    /// `key` is the plaintext key).
    pub async fn mint_key(&self, token: &str, body: Value) -> Result<Value> {
        let resp = self
            .client()
            .post(format!("{}/maas-api/v1/api-keys", self.gateway_url()))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await?;
        let status = resp.status();
        let text = resp.text().await?;
        if status.as_u16() != 201 {
            bail!("minting a key returned {status}: {text}");
        }
        Ok(serde_json::from_str(&text)?)
    }

    /// Mints a key named `name` for `token` and returns the plaintext key.
    pub async fn mint_key_plain(&self, token: &str, name: &str) -> Result<String> {
        let v = self
            .mint_key(token, serde_json::json!({"name": name}))
            .await?;
        v["key"]
            .as_str()
            .map(str::to_string)
            .context("mint response has no key")
    }

    // ---- logs ----

    /// Every replica's companion and Envoy log (replica 0 first), PostgreSQL's and Redis's.
    pub fn log_paths(&self) -> Vec<PathBuf> {
        self.core.res.log_paths()
    }

    /// Every process log and every usage events file, concatenated (tests scan it for leaked
    /// credentials).
    pub fn logs_text(&self) -> String {
        let events = self
            .core
            .res
            .replicas()
            .iter()
            .map(|r| r.usage_events_path.clone())
            .collect::<Vec<_>>();
        self.log_paths()
            .iter()
            .chain(&events)
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops everything (the Envoys, the companions, Redis, then PostgreSQL gracefully) and
    /// removes the directory unless kept. Idempotent.
    pub fn shutdown(&self) {
        self.core.res.shutdown();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every program's first ports are taken by someone else (as when stacks start at once and
    /// another one binds a port between our pick and the program's bind): PostgreSQL, the
    /// companion and Envoy each exit on "Address already in use" and are started again on fresh
    /// ports, and the stack serves.
    #[test]
    fn every_program_is_restarted_on_fresh_ports_when_its_ports_are_taken() {
        // PostgreSQL picks 1 port, the companion 3, Envoy 2 (admin, gateway): all taken.
        let taken: Vec<TcpListener> = (0..6)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let taken_ports: Vec<u16> = taken
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect();
        FORCED_PORTS.with_borrow_mut(|f| {
            f.extend([
                (1, taken_ports[..1].to_vec()),
                (3, taken_ports[1..4].to_vec()),
                (2, taken_ports[4..].to_vec()),
            ])
        });
        let stack = Stack::start(StackOptions {
            // The ports are under test, not the filter (no .wasm build needed).
            with_filter: false,
            ..StackOptions::default()
        });
        let left = FORCED_PORTS.with_borrow_mut(std::mem::take);
        let stack = stack.unwrap();
        assert!(left.is_empty(), "every taken port was tried: {left:?}");
        let ports = stack.primary.ports;
        let used = [
            ports.gateway.port(),
            ports.admin.port(),
            ports.companion_public.port(),
            ports.companion_internal.port(),
            ports.companion_metrics.port(),
            stack.postgres_port,
        ];
        for port in used {
            assert!(
                !taken_ports.contains(&port),
                "{port} is one of the taken ports"
            );
        }
        for log in stack.log_paths() {
            let text = std::fs::read_to_string(&log).unwrap();
            assert!(
                text.to_ascii_lowercase().contains("address already in use"),
                "{} shows no first start on a taken port:\n{text}",
                log.display()
            );
        }
        let (status, _) = http_request(
            stack.gateway_addr(),
            "GET",
            "/maas-api/health",
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(status, 200);
        stack.check_alive().unwrap();
        drop(taken);
    }

    /// Two replicas: one PostgreSQL and one Redis, each Envoy (own node id) talks to its own
    /// companion only, so stopping companion 1 takes down replica 1's API and not replica 0's;
    /// a replica added while running serves too, and stopping/starting Redis keeps its port.
    #[test]
    fn replicas_each_talk_to_their_own_companion_and_share_one_redis() {
        let stack = Stack::start(StackOptions {
            with_filter: false,
            ..StackOptions::default().with_replicas(2)
        })
        .unwrap();
        assert!(stack.has_redis(), "replicas > 1 start a Redis by default");
        let urls = stack.gateway_urls();
        assert_eq!(urls.len(), 2);
        assert_eq!(urls[0], stack.gateway_url(), "replica 0 is the default");
        let health = |url: &str| {
            let addr: SocketAddr = url.trim_start_matches("http://").parse().unwrap();
            http_request(addr, "GET", "/maas-api/health", Duration::from_secs(5))
                .map(|r| r.0)
                .unwrap_or(0)
        };
        for i in 0..2 {
            let r = stack.replica(i).unwrap();
            let config: Value =
                serde_json::from_str(&std::fs::read_to_string(&r.envoy_config_path).unwrap())
                    .unwrap();
            assert_eq!(config["node"]["id"], format!("gateway-{i}"));
            let companion = config["static_resources"]["clusters"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == envoy_config::COMPANION_INTERNAL_CLUSTER)
                .unwrap()
                .clone();
            assert_eq!(
                companion["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                    ["socket_address"]["port_value"],
                r.ports.companion_internal.port(),
                "replica {i} reaches its own companion"
            );
            let env = std::fs::read_to_string(format!(
                "/proc/{}/environ",
                lock(&r.companion).as_ref().unwrap().pid().unwrap()
            ))
            .unwrap();
            assert!(
                env.contains(&format!("MAAS_REDIS_URL={}", stack.redis_url().unwrap())),
                "companion {i} has the shared Redis"
            );
        }
        stack.stop_companion_of(1);
        assert_eq!(health(&urls[1]), 503, "replica 1 lost its companion");
        assert_eq!(health(&urls[0]), 200, "replica 0 did not");
        stack.start_companion_of(1).unwrap();
        assert_eq!(health(&urls[1]), 200, "replica 1 is back");

        let added = stack.add_replica().unwrap();
        assert_eq!(added, 2);
        assert_eq!(stack.gateway_urls().len(), 3);
        assert_eq!(health(&stack.gateway_url_of(2)), 200);
        stack.stop_envoy_of(2);
        assert_eq!(
            health(&stack.gateway_url_of(2)),
            0,
            "replica 2's Envoy is stopped"
        );
        stack.start_envoy_of(2).unwrap();
        assert_eq!(health(&stack.gateway_url_of(2)), 200);

        stack.redis_command(&["SET", "k", "1"]).unwrap();
        stack.stop_redis();
        assert!(stack.redis_command(&["PING"]).is_err(), "Redis is down");
        stack.start_redis().unwrap();
        assert_eq!(
            stack.redis_command(&["GET", "k"]).unwrap(),
            crate::redis::Resp::Bulk(None),
            "Redis came back empty on its port"
        );
        stack.check_alive().unwrap();
        let dir = stack.dir().to_path_buf();
        stack.shutdown();
        assert!(!dir.exists(), "directory removed");
        assert!(stack.add_replica().is_err(), "no replica after shutdown");
    }

    /// A fixed gateway port that is taken is the user's choice: no retry, a clear error.
    #[test]
    fn a_taken_fixed_gateway_port_is_refused_not_replaced() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let err = Stack::start(StackOptions {
            gateway_port: Some(port),
            with_filter: false,
            ..StackOptions::default()
        })
        .err()
        .expect("the gateway port is taken");
        assert!(
            format!("{err:#}").contains(&format!("gateway port {port} is not free")),
            "{err:#}"
        );
    }
}
