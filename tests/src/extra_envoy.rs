//! Extra Envoys for tests that need a gateway of their own beside a stack's (another filter mode,
//! extra routes, a TLS listener, a broken filter config, no filter at all).
//!
//! Envoy binds by address, so its ports are picked free and released, and another process can
//! take one in between: as for the stack's own Envoy, the bootstrap is built again for fresh
//! ports and Envoy started again when it exits on "Address already in use" (a bounded number of
//! times; see [`crate::stack`]).

use crate::process::ManagedProcess;
use crate::stack::{Stack, free_ports, http_request, retry_on_taken_port};
use crate::tools;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The ports of one attempt, all on 127.0.0.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyPorts {
    pub admin: SocketAddr,
    /// The first listener (the gateway).
    pub listen: SocketAddr,
    /// One more port for a second listener (e.g. TLS), when asked for.
    pub second: Option<SocketAddr>,
}

/// When a started Envoy counts as up.
#[derive(Debug, Clone, Copy)]
pub enum Ready {
    /// Admin `/ready` answers 200, and so does `GET <path>` on the first listener.
    Serving(&'static str),
    /// Admin `/ready` answers 200.
    Admin,
    /// Admin `/ready` answers 200, or Envoy exits on its own for another reason than a taken
    /// port (for configurations Envoy may refuse).
    AdminOrExit,
}

/// What to start: a bootstrap built by [`ExtraEnvoy::start`]'s closure for each attempt's ports.
#[derive(Debug, Clone)]
pub struct ExtraEnvoyOptions {
    /// Names the process and its files (`envoy-<name>.json`, `envoy-<name>.log`).
    pub name: String,
    /// Where the config and the log go.
    pub dir: PathBuf,
    /// Pick a port for a second listener ([`EnvoyPorts::second`]).
    pub second_port: bool,
    pub ready: Ready,
    pub ready_timeout: Duration,
}

impl ExtraEnvoyOptions {
    pub fn new(name: &str, dir: &Path, ready: Ready) -> Self {
        ExtraEnvoyOptions {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            second_port: false,
            ready,
            ready_timeout: Duration::from_secs(90),
        }
    }
}

/// A running extra Envoy (stopped on drop; supervised, so it dies with the test binary too).
pub struct ExtraEnvoy {
    pub ports: EnvoyPorts,
    pub process: ManagedProcess,
    /// The bootstrap it runs.
    pub config_path: PathBuf,
}

impl ExtraEnvoy {
    /// Starts Envoy (`--concurrency 1`) with the bootstrap `bootstrap` builds for the ports it is
    /// given, and waits for `options.ready`; when Envoy exits because one of its ports was taken
    /// meanwhile, starts it again with a bootstrap for fresh ports.
    pub fn start(
        options: &ExtraEnvoyOptions,
        mut bootstrap: impl FnMut(&EnvoyPorts) -> Result<Value>,
    ) -> Result<ExtraEnvoy> {
        let envoy_bin = tools::envoy_bin()?;
        std::fs::create_dir_all(&options.dir)
            .with_context(|| format!("cannot create {}", options.dir.display()))?;
        let name = &options.name;
        let config_path = options.dir.join(format!("envoy-{name}.json"));
        let log_path = options.dir.join(format!("envoy-{name}.log"));
        let local = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let mut ports = EnvoyPorts {
            admin: local(0),
            listen: local(0),
            second: None,
        };
        let process = retry_on_taken_port(
            &mut ports,
            |ports| {
                let picked = free_ports(if options.second_port { 3 } else { 2 })?;
                ports.admin = local(picked[0]);
                ports.listen = local(picked[1]);
                ports.second = picked.get(2).copied().map(local);
                Ok(())
            },
            |ports| {
                let config = bootstrap(ports)?;
                std::fs::write(&config_path, serde_json::to_string_pretty(&config)?)?;
                let mut cmd = Command::new(&envoy_bin);
                cmd.arg("-c").arg(&config_path).args([
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "-l",
                    "info",
                ]);
                let mut process = ManagedProcess::spawn(
                    &format!("envoy-{name}"),
                    cmd,
                    &log_path,
                    libc::SIGTERM,
                    libc::SIGKILL,
                )?;
                wait_ready(&mut process, ports, options)?;
                Ok(process)
            },
        )?;
        Ok(ExtraEnvoy {
            ports,
            process,
            config_path,
        })
    }

    /// Another gateway in front of `stack`'s companion and simulator: the stack's bootstrap
    /// with its admin and first listener moved to fresh ports, then changed by `change`; up when
    /// its `/maas-api/health` answers 200 (config and log in `<stack dir>/<name>/`).
    pub fn beside(
        stack: &Stack,
        name: &str,
        second_port: bool,
        mut change: impl FnMut(&mut Value, &EnvoyPorts) -> Result<()>,
    ) -> Result<ExtraEnvoy> {
        let text = std::fs::read_to_string(stack.envoy_config_path())?;
        let options = ExtraEnvoyOptions {
            second_port,
            ..ExtraEnvoyOptions::new(
                name,
                &stack.dir().join(name),
                Ready::Serving("/maas-api/health"),
            )
        };
        ExtraEnvoy::start(&options, |ports| {
            let mut v: Value = serde_json::from_str(&text)?;
            v["admin"]["address"]["socket_address"]["port_value"] = json!(ports.admin.port());
            v["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] =
                json!(ports.listen.port());
            change(&mut v, ports)?;
            Ok(v)
        })
    }

    /// `http://<first listener>`.
    pub fn gateway_url(&self) -> String {
        format!("http://{}", self.ports.listen)
    }

    /// `http://<admin>`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.ports.admin)
    }

    /// Exit status once Envoy has exited on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.process.exited()
    }

    /// Everything this Envoy logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.process.log_path).unwrap_or_default()
    }
}

fn wait_ready(
    process: &mut ManagedProcess,
    ports: &EnvoyPorts,
    options: &ExtraEnvoyOptions,
) -> Result<()> {
    let up = |addr, path| {
        matches!(
            http_request(addr, "GET", path, Duration::from_secs(1)),
            Ok((200, _))
        )
    };
    let deadline = Instant::now() + options.ready_timeout;
    loop {
        if let Some(status) = process.exited() {
            if let Some(taken) = process.exited_addr_in_use() {
                return Err(anyhow::Error::new(taken));
            }
            if matches!(options.ready, Ready::AdminOrExit) {
                return Ok(());
            }
            bail!(
                "{} exited ({status}) before it was ready:\n{}",
                process.name,
                process.log_tail(4000)
            );
        }
        // Another program may answer on a port taken between the pick and Envoy's bind: only
        // this Envoy's own listeners count.
        let owns = |addr: SocketAddr| process.listens_on(addr.port());
        let ready = up(ports.admin, "/ready")
            && owns(ports.admin)
            && match options.ready {
                Ready::Serving(path) => up(ports.listen, path) && owns(ports.listen),
                Ready::Admin | Ready::AdminOrExit => true,
            };
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{} not ready after {:?}:\n{}",
                process.name,
                options.ready_timeout,
                process.log_tail(4000)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A bare bootstrap: admin, and a listener answering 200 on every path.
    fn direct_200(ports: &EnvoyPorts) -> Value {
        json!({
            "admin": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": ports.admin.port()}}},
            "static_resources": {"listeners": [{
                "name": "gateway",
                "address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": ports.listen.port()}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"},
                                        "direct_response": {"status": 200}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
                    }}]}]
            }]}
        })
    }

    /// Another process takes the gateway port between the pick and Envoy's bind (the race of
    /// every bind-and-release pick): Envoy exits on "Address already in use" and is started
    /// again on fresh ports, and serves there.
    #[test]
    fn an_extra_envoy_whose_port_is_taken_is_started_again_on_fresh_ports() {
        let dir = tempfile::tempdir().unwrap();
        let options = ExtraEnvoyOptions::new("taken", dir.path(), Ready::Serving("/any"));
        let mut taken: Vec<TcpListener> = Vec::new();
        let mut attempts = Vec::new();
        let envoy = ExtraEnvoy::start(&options, |ports| {
            if taken.is_empty() {
                taken.push(TcpListener::bind(ports.listen).unwrap());
            }
            attempts.push(*ports);
            Ok(direct_200(ports))
        })
        .unwrap();
        assert_eq!(attempts.len(), 2, "{attempts:?}");
        assert_eq!(envoy.ports, attempts[1]);
        assert_ne!(envoy.ports.listen, attempts[0].listen);
        assert!(
            envoy
                .log()
                .to_ascii_lowercase()
                .contains("address already in use"),
            "the first start did not meet the taken port:\n{}",
            envoy.log()
        );
        let (status, _) =
            http_request(envoy.ports.listen, "GET", "/any", Duration::from_secs(5)).unwrap();
        assert_eq!(status, 200);
    }

    /// A bootstrap Envoy refuses is not a taken port: one start, and the error shows the log;
    /// with [`Ready::AdminOrExit`] the exit is the outcome the caller wanted to see.
    #[test]
    fn an_extra_envoy_that_refuses_its_config_is_not_started_again() {
        let dir = tempfile::tempdir().unwrap();
        let broken = |ports: &EnvoyPorts| {
            let mut v = direct_200(ports);
            v["static_resources"]["listeners"][0]["no_such_field"] = json!(1);
            Ok(v)
        };
        let mut starts = 0;
        let err = ExtraEnvoy::start(
            &ExtraEnvoyOptions::new("broken", dir.path(), Ready::Admin),
            |ports| {
                starts += 1;
                broken(ports)
            },
        )
        .err()
        .expect("Envoy refuses the config");
        assert_eq!(starts, 1);
        assert!(format!("{err:#}").contains("no_such_field"), "{err:#}");
        let mut envoy = ExtraEnvoy::start(
            &ExtraEnvoyOptions::new("broken-ok", dir.path(), Ready::AdminOrExit),
            broken,
        )
        .unwrap();
        assert!(envoy.exited().is_some());
    }
}
