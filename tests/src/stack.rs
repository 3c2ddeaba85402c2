//! The local stack: throwaway PostgreSQL, the companion, the model simulator and Envoy with the
//! filter, on free ports, in one temp directory. Used by `maas-local` and by every e2e test
//! (one implementation). Everything it starts dies with it (see [`crate::process`]).
//!
//! Ports: the simulator runs in this process on a listener bound before anything else sees its
//! address. PostgreSQL, the companion and Envoy are other programs that bind by address (the
//! companion takes no inherited socket), so their ports are picked free and released; when one
//! exits because another process took its port in between ("Address already in use"), it is
//! started again on fresh ports (a bounded number of times). So many stacks can start at once.

use crate::envoy_config::{self, EnvoyConfigInput, WasmFilterOptions};
use crate::postgres::Postgres;
use crate::process::{ManagedProcess, is_addr_in_use, log_tail};
use crate::sim::{self, RecordedRequest, SimConfig, SimHandle};
use crate::tools;
use anyhow::{Context, Result, bail};
use maas_types::PolicyDocument;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
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
}

struct Ports {
    gateway: SocketAddr,
    admin: SocketAddr,
    companion_public: SocketAddr,
    companion_internal: SocketAddr,
    companion_metrics: SocketAddr,
    postgres: u16,
}

/// A program that exits because its port was taken is started again on fresh ports, this many
/// times in all.
const START_ATTEMPTS: usize = 5;

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
    if let Some(forced) = tests::FORCED_PORTS.with_borrow_mut(|f| f.remove(&n)) {
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

struct CompanionSpec {
    bin: PathBuf,
    /// Everything but the listen addresses (from the stack's current ports).
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
}

/// What must be stopped and removed. Registered globally (weakly) so that stacks kept in
/// statics, which are never dropped, are still stopped and removed when the process exits.
struct Resources {
    dir: Mutex<Option<tempfile::TempDir>>,
    postgres: Mutex<Option<Postgres>>,
    companion: Mutex<Option<ManagedProcess>>,
    envoy: Mutex<Option<ManagedProcess>>,
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

    /// Envoy, the companion, then PostgreSQL (gracefully); then the directory. Idempotent.
    fn shutdown(&self) {
        if let Some(mut p) = lock(&self.envoy).take() {
            p.stop(Duration::from_secs(5));
        }
        if let Some(mut p) = lock(&self.companion).take() {
            p.stop(Duration::from_secs(5));
        }
        if let Some(mut pg) = lock(&self.postgres).take() {
            pg.stop();
        }
        drop(lock(&self.dir).take());
    }
}

pub struct Stack {
    /// Processes and directory, shared with the exit-time cleanup registry.
    res: Arc<Resources>,
    dir_path: PathBuf,
    ports: Ports,
    policy_path: PathBuf,
    identities_path: PathBuf,
    credentials_path: PathBuf,
    sim: SimHandle,
    companion_spec: CompanionSpec,
    envoy_config_path: PathBuf,
    envoy_log: PathBuf,
    ready_timeout: Duration,
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

impl Stack {
    /// Starts everything and waits until every piece answers.
    pub fn start(options: StackOptions) -> Result<Stack> {
        // Find every tool first, so a missing one fails fast with a clear message.
        let pg_bin = tools::pg_bin_dir()?;
        let companion_bin = tools::companion_bin()?;
        let envoy_bin = tools::envoy_bin()?;
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
        let policy = load_policy(&policy_path)?;

        let ip = options.gateway_host;
        if let Some(p) = options.gateway_port
            && let Err(e) = TcpListener::bind((ip, p))
        {
            bail!(
                "gateway port {p} is not free ({e}): choose another with --port N or MAAS_GATEWAY_PORT"
            );
        }
        // Chosen for real just before each program starts (see `retry_on_taken_port`).
        let ports = Ports {
            gateway: SocketAddr::new(ip, options.gateway_port.unwrap_or(0)),
            admin: local(0),
            companion_public: local(0),
            companion_internal: local(0),
            postgres: 0,
            companion_metrics: local(0),
        };

        let sim_models = policy
            .models
            .iter()
            .filter(|m| m.backend.as_deref().unwrap_or("simulator") == "simulator")
            .map(|m| m.name.clone())
            .collect();
        let sim = sim::spawn(
            local(0),
            SimConfig {
                chunk_delay: options.sim_chunk_delay,
                models: sim_models,
            },
        )?;

        let pg_dir = dir_path.join("postgres");
        std::fs::create_dir_all(&pg_dir)?;
        let postgres =
            Postgres::init_and_start_on_free_port(&pg_bin, &pg_dir, || Ok(free_ports(1)?[0]))?;
        let ports = Ports {
            postgres: postgres.port(),
            ..ports
        };

        let mut env = vec![(
            "RUST_LOG".to_string(),
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )];
        env.extend(options.companion_env.iter().cloned());
        let companion_spec = CompanionSpec {
            bin: companion_bin,
            args: vec![
                format!("--database-url={}", postgres.url("maas")),
                format!("--policy-file={}", policy_path.display()),
                format!(
                    "--policy-reload-interval-ms={}",
                    options.policy_reload_interval_ms
                ),
                "--identity-provider=static".to_string(),
                format!("--identities-file={}", identities_path.display()),
                "--credentials-source=file".to_string(),
                format!("--credentials-file={}", credentials_path.display()),
            ],
            env,
            log: dir_path.join("companion.log"),
        };

        let envoy_config_path = dir_path.join("envoy.json");
        let sim_addr = sim.addr();
        // Envoy's config names every port, so it is written again for each attempt.
        let write_envoy_config = |ports: &Ports| -> Result<()> {
            let rendered = envoy_config::render(&EnvoyConfigInput {
                policy: &policy,
                listen: ports.gateway,
                admin: ports.admin,
                companion_public: ports.companion_public,
                companion_internal: ports.companion_internal,
                simulator: sim_addr,
                filter: wasm.clone().map(|wasm_path| WasmFilterOptions {
                    wasm_path,
                    poll_interval_ms: options.poll_interval_ms,
                }),
            })?;
            let rendered = match &options.plugin_config_extra {
                Some(extra) => envoy_config::with_plugin_config_extra(&rendered, extra)?,
                None => rendered,
            };
            std::fs::write(&envoy_config_path, rendered)?;
            Ok(())
        };

        let dir_slot = if options.keep_dir {
            let _ = dir.keep();
            None
        } else {
            Some(dir)
        };
        let mut stack = Stack {
            res: Resources::register(Resources {
                dir: Mutex::new(dir_slot),
                postgres: Mutex::new(Some(postgres)),
                companion: Mutex::new(None),
                envoy: Mutex::new(None),
            }),
            envoy_log: dir_path.join("envoy.log"),
            dir_path,
            ports,
            policy_path,
            identities_path,
            credentials_path,
            sim,
            companion_spec,
            envoy_config_path: envoy_config_path.clone(),
            ready_timeout: options.ready_timeout,
        };
        if options.keep_dir {
            eprintln!("maas stack directory (kept): {}", stack.dir_path.display());
        }
        retry_on_taken_port(
            &mut stack,
            |stack| {
                let p = free_ports(3)?;
                stack.ports.companion_public = local(p[0]);
                stack.ports.companion_internal = local(p[1]);
                stack.ports.companion_metrics = local(p[2]);
                Ok(())
            },
            Stack::start_companion,
        )?;
        let gateway_fixed = options.gateway_port.is_some();
        retry_on_taken_port(
            &mut stack,
            |stack| {
                let p = free_ports(2)?;
                stack.ports.admin = local(p[0]);
                if !gateway_fixed {
                    stack.ports.gateway = SocketAddr::new(ip, p[1]);
                }
                write_envoy_config(&stack.ports)
            },
            |stack| stack.start_envoy(&envoy_bin, options.envoy_concurrency),
        )?;
        stack.wait_gateway_ready()?;
        Ok(stack)
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

    fn start_envoy(&self, envoy_bin: &Path, concurrency: u32) -> Result<()> {
        let mut cmd = Command::new(envoy_bin);
        cmd.arg("-c")
            .arg(&self.envoy_config_path)
            .arg("--disable-hot-restart")
            .args(["--concurrency", &concurrency.to_string()])
            .args([
                "-l",
                &std::env::var("MAAS_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
            ]);
        let process =
            ManagedProcess::spawn("envoy", cmd, &self.envoy_log, libc::SIGTERM, libc::SIGKILL)?;
        *lock(&self.res.envoy) = Some(process);
        let admin = self.ports.admin;
        self.wait_until("envoy admin /ready", || {
            Ok(http_request(admin, "GET", "/ready", Duration::from_secs(1))?.0 == 200)
        })
        .map_err(|e| self.addr_in_use_or(&self.res.envoy, e))
    }

    /// `e`, or [`crate::process::AddrInUse`] when the process in `slot` exited because its port was taken.
    fn addr_in_use_or(
        &self,
        slot: &Mutex<Option<ManagedProcess>>,
        e: anyhow::Error,
    ) -> anyhow::Error {
        match lock(slot)
            .as_mut()
            .and_then(ManagedProcess::exited_addr_in_use)
        {
            Some(taken) => anyhow::Error::new(taken).context(format!("{e:#}")),
            None => e,
        }
    }

    fn wait_gateway_ready(&self) -> Result<()> {
        let gateway = self.gateway_connect_addr();
        self.wait_until("gateway /maas-api/health", || {
            Ok(http_request(gateway, "GET", "/maas-api/health", Duration::from_secs(2))?.0 == 200)
        })
    }

    /// Polls `check` until it returns true; fails with the log tails when a process exits or
    /// the timeout passes.
    fn wait_until(&self, what: &str, mut check: impl FnMut() -> Result<bool>) -> Result<()> {
        let deadline = Instant::now() + self.ready_timeout;
        let mut last_err: String;
        loop {
            match check() {
                Ok(true) => return Ok(()),
                Ok(false) => last_err = "not ready yet".into(),
                Err(e) => last_err = e.to_string(),
            }
            for (name, slot) in [
                ("companion", &self.res.companion),
                ("envoy", &self.res.envoy),
            ] {
                if let Some(status) = lock(slot).as_mut().and_then(ManagedProcess::exited) {
                    bail!(
                        "{name} exited ({status}) while waiting for {what}\n{}",
                        self.log_tails()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} not ready after {:?} ({last_err})\n{}",
                    self.ready_timeout,
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_tails(&self) -> String {
        self.log_paths()
            .iter()
            .map(|p| format!("--- {} (tail) ---\n{}", p.display(), log_tail(p, 3000)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Fails when Envoy, the companion or PostgreSQL has exited on its own.
    pub fn check_alive(&self) -> Result<()> {
        for (name, slot) in [
            ("companion", &self.res.companion),
            ("envoy", &self.res.envoy),
        ] {
            if let Some(status) = lock(slot).as_mut().and_then(ManagedProcess::exited) {
                bail!("{name} exited ({status})\n{}", self.log_tails());
            }
        }
        if let Some(status) = lock(&self.res.postgres).as_mut().and_then(Postgres::exited) {
            bail!("postgres exited ({status})\n{}", self.log_tails());
        }
        Ok(())
    }

    // ---- accessors ----

    fn gateway_connect_addr(&self) -> SocketAddr {
        let g = self.ports.gateway;
        if g.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], g.port()))
        } else {
            g
        }
    }
    pub fn gateway_url(&self) -> String {
        format!("http://{}", self.gateway_connect_addr())
    }
    pub fn gateway_addr(&self) -> SocketAddr {
        self.gateway_connect_addr()
    }
    pub fn companion_public_url(&self) -> String {
        format!("http://{}", self.ports.companion_public)
    }
    pub fn companion_internal_url(&self) -> String {
        format!("http://{}", self.ports.companion_internal)
    }
    /// The companion's metrics listener (`GET /metrics`).
    pub fn companion_metrics_url(&self) -> String {
        format!("http://{}", self.ports.companion_metrics)
    }
    pub fn sim_url(&self) -> String {
        self.sim.url()
    }
    pub fn envoy_admin_url(&self) -> String {
        format!("http://{}", self.ports.admin)
    }
    /// `postgres://postgres@127.0.0.1:PORT/maas` (trust auth).
    pub fn database_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/maas", self.ports.postgres)
    }
    pub fn dir(&self) -> &Path {
        &self.dir_path
    }
    pub fn policy_path(&self) -> &Path {
        &self.policy_path
    }
    pub fn identities_path(&self) -> &Path {
        &self.identities_path
    }
    pub fn credentials_path(&self) -> &Path {
        &self.credentials_path
    }
    pub fn envoy_config_path(&self) -> &Path {
        &self.envoy_config_path
    }
    /// Envoy's pid while it runs.
    pub fn envoy_pid(&self) -> Option<u32> {
        lock(&self.res.envoy).as_ref().and_then(ManagedProcess::pid)
    }

    // ---- process control (fault tests) ----

    pub fn start_companion(&self) -> Result<()> {
        {
            let mut slot = lock(&self.res.companion);
            if slot.as_mut().is_some_and(ManagedProcess::is_running) {
                return Ok(());
            }
            let spec = &self.companion_spec;
            let mut cmd = Command::new(&spec.bin);
            cmd.arg(format!("--public-addr={}", self.ports.companion_public))
                .arg(format!("--internal-addr={}", self.ports.companion_internal))
                .arg(format!("--metrics-addr={}", self.ports.companion_metrics))
                .args(&spec.args);
            for (k, v) in &spec.env {
                cmd.env(k, v);
            }
            *slot = Some(ManagedProcess::spawn(
                "companion",
                cmd,
                &spec.log,
                libc::SIGTERM,
                libc::SIGKILL,
            )?);
        }
        let public = self.ports.companion_public;
        let internal = self.ports.companion_internal;
        self.wait_until("companion /health", || {
            Ok(
                http_request(public, "GET", "/health", Duration::from_secs(1))?.0 == 200
                    && TcpStream::connect_timeout(&internal, Duration::from_secs(1)).is_ok(),
            )
        })
        .map_err(|e| self.addr_in_use_or(&self.res.companion, e))
    }

    pub fn stop_companion(&self) {
        if let Some(mut p) = lock(&self.res.companion).take() {
            p.stop(Duration::from_secs(5));
        }
    }

    /// Stops PostgreSQL (fast shutdown), keeping its data.
    pub fn stop_postgres(&self) {
        if let Some(pg) = lock(&self.res.postgres).as_mut() {
            pg.stop();
        }
    }

    pub fn start_postgres(&self) -> Result<()> {
        match lock(&self.res.postgres).as_mut() {
            Some(pg) => pg.start(),
            None => bail!("the stack is shut down"),
        }
    }

    /// Writes the policy file atomically; the companion reloads it (within its reload
    /// interval) and the filter picks it up at its next poll.
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

    pub fn log_paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.companion_spec.log.clone(), self.envoy_log.clone()];
        if let Some(pg) = lock(&self.res.postgres).as_ref() {
            paths.push(pg.log_path().to_path_buf());
        }
        paths
    }

    /// Every process log, concatenated (tests scan it for leaked credentials).
    pub fn logs_text(&self) -> String {
        self.log_paths()
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops everything (Envoy, companion, then PostgreSQL gracefully) and removes the
    /// directory unless kept. Idempotent.
    pub fn shutdown(&self) {
        self.res.shutdown();
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
    use std::cell::RefCell;
    use std::collections::HashMap;

    thread_local! {
        /// What the next call of `free_ports(n)` on this thread hands out, by `n` (to make a
        /// start meet taken ports: PostgreSQL asks for 1, the companion 3, Envoy 2).
        pub(super) static FORCED_PORTS: RefCell<HashMap<usize, Vec<u16>>> =
            RefCell::new(HashMap::new());
    }

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
        let used = [
            stack.ports.gateway.port(),
            stack.ports.admin.port(),
            stack.ports.companion_public.port(),
            stack.ports.companion_internal.port(),
            stack.ports.companion_metrics.port(),
            stack.ports.postgres,
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
