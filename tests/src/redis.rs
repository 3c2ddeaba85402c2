//! A throwaway redis-server for the stack's global limits (budget leases shared by several
//! companions): 127.0.0.1 on a free port, its working directory in the stack's, no persistence
//! (`--save '' --appendonly no`), supervised so it dies with the test. `stop`/`start` keep the
//! port (tests stop it and start it again mid-traffic; its counters are lost, as with a Redis
//! restart without persistence).
//!
//! Redis binds by address, so its port is picked free and released first;
//! [`Redis::start_on_free_port`] starts it again on a fresh port when another process took that
//! port in between. [`Redis::command`] is a tiny RESP client (no redis-cli needed), enough to
//! read counters and `INFO commandstats` (the benchmark counts round trips with it).
//!
//! Binary: `MAAS_REDIS_SERVER`, else `redis-server` on the PATH.

use crate::process::{ManagedProcess, is_addr_in_use, listens_on};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Starts on a port taken in between are retried this many times in all.
const START_ATTEMPTS: usize = 5;

/// redis-server: `MAAS_REDIS_SERVER`, else `redis-server` on the PATH.
pub fn redis_server_bin() -> Result<PathBuf> {
    if let Some(v) = std::env::var_os("MAAS_REDIS_SERVER").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        if p.is_file() {
            return Ok(p);
        }
        bail!("MAAS_REDIS_SERVER={} does not exist", p.display());
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("redis-server"))
                .find(|p| p.is_file())
        })
        .context(
            "redis-server not found (set MAAS_REDIS_SERVER or install it: ./scripts/run-local.sh and ./scripts/test.sh do)",
        )
}

/// A reply of the RESP protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The reply as text (simple or bulk string).
    pub fn text(&self) -> Option<String> {
        match self {
            Resp::Simple(s) => Some(s.clone()),
            Resp::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }
    /// The reply as an integer (an integer reply, or a string holding one).
    pub fn int(&self) -> Option<i64> {
        match self {
            Resp::Int(i) => Some(*i),
            other => other.text()?.trim().parse().ok(),
        }
    }
    pub fn items(&self) -> &[Resp] {
        match self {
            Resp::Array(Some(v)) => v,
            _ => &[],
        }
    }
}

fn read_line(r: &mut impl BufRead) -> Result<String> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("redis closed the connection");
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

fn read_reply(r: &mut impl BufRead) -> Result<Resp> {
    let line = read_line(r)?;
    let (kind, rest) = line.split_at_checked(1).context("empty RESP line")?;
    let len = || -> Result<i64> { rest.parse().with_context(|| format!("bad length {rest:?}")) };
    Ok(match kind {
        "+" => Resp::Simple(rest.to_string()),
        "-" => Resp::Error(rest.to_string()),
        ":" => Resp::Int(len()?),
        "$" => match usize::try_from(len()?) {
            Err(_) => Resp::Bulk(None),
            Ok(n) => {
                let mut buf = vec![0; n + 2];
                r.read_exact(&mut buf)?;
                buf.truncate(n);
                Resp::Bulk(Some(buf))
            }
        },
        "*" => match usize::try_from(len()?) {
            Err(_) => Resp::Array(None),
            Ok(n) => Resp::Array(Some((0..n).map(|_| read_reply(r)).collect::<Result<_>>()?)),
        },
        _ => bail!("unexpected RESP line {line:?}"),
    })
}

/// Sends one command to the Redis at `addr` and reads its reply (a `-ERR` reply is an error).
pub fn command(addr: SocketAddr, args: &[&str]) -> Result<Resp> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("cannot connect to redis at {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    (&stream).write_all(&out)?;
    match read_reply(&mut BufReader::new(&stream))? {
        Resp::Error(e) => bail!("redis {}: {e}", args.first().copied().unwrap_or("")),
        reply => Ok(reply),
    }
}

pub struct Redis {
    bin: PathBuf,
    dir: PathBuf,
    log_path: PathBuf,
    port: u16,
    process: Option<ManagedProcess>,
}

impl Redis {
    /// Starts redis-server with its files under `dir` on a port from `pick_port`; when it exits
    /// because that port was taken meanwhile, starts it on the next one (up to
    /// [`START_ATTEMPTS`] ports).
    pub fn start_on_free_port(
        dir: &Path,
        mut pick_port: impl FnMut() -> Result<u16>,
    ) -> Result<Redis> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut redis = Redis {
            bin: redis_server_bin()?,
            dir: dir.to_path_buf(),
            log_path: dir.join("redis.log"),
            port: 0,
            process: None,
        };
        let mut attempt = 1;
        loop {
            redis.port = pick_port()?;
            match redis.start() {
                Ok(()) => return Ok(redis),
                Err(e) if attempt < START_ATTEMPTS && is_addr_in_use(&e) => {
                    eprintln!(
                        "redis: port {} was taken ({e:#}); trying another",
                        redis.port
                    );
                    redis.process = None;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
    /// `redis://127.0.0.1:PORT` (no password).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Starts the server (again) on the same port and waits until it answers PING. Its data
    /// starts empty (no persistence).
    pub fn start(&mut self) -> Result<()> {
        if self
            .process
            .as_mut()
            .is_some_and(ManagedProcess::is_running)
        {
            return Ok(());
        }
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no"]);
        self.process = Some(ManagedProcess::spawn(
            "redis",
            cmd,
            &self.log_path,
            libc::SIGTERM,
            libc::SIGKILL,
        )?);
        let mut process = self.process.take();
        let pid = process.as_ref().and_then(ManagedProcess::pid);
        let waited = match process.as_mut() {
            Some(p) => p.wait_ready(Duration::from_secs(30), Duration::from_millis(30), || {
                self.ping() && pid.is_some_and(|pid| listens_on(pid, self.port))
            }),
            None => Ok(()),
        };
        self.process = process;
        waited
    }

    /// Stops the server (SIGTERM, then SIGKILL); its port stays this server's for [`Redis::start`].
    pub fn stop(&mut self) {
        // A paused server handles SIGTERM only once it runs again.
        let _ = self.resume();
        if let Some(mut p) = self.process.take() {
            p.stop(Duration::from_secs(5));
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing answers, as with a
    /// Redis that hangs or a network partition; its data is kept for [`Redis::resume`].
    pub fn pause(&mut self) -> Result<()> {
        self.signal(libc::SIGSTOP)
    }

    /// Lets a paused server run again (SIGCONT), with the data it had.
    pub fn resume(&mut self) -> Result<()> {
        self.signal(libc::SIGCONT)
    }

    fn signal(&mut self, signal: libc::c_int) -> Result<()> {
        let pid = self
            .process
            .as_ref()
            .and_then(ManagedProcess::pid)
            .context("redis is not running")?;
        let pid = libc::pid_t::try_from(pid)?;
        // SAFETY: kill(2) on our own child, which we have not reaped (it is in `process`).
        if unsafe { libc::kill(pid, signal) } != 0 {
            bail!("kill({pid}, {signal}): {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn is_running(&mut self) -> bool {
        self.process
            .as_mut()
            .is_some_and(ManagedProcess::is_running)
    }

    /// Exit status if the server exited on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.process.as_mut().and_then(ManagedProcess::exited)
    }

    pub fn ping(&self) -> bool {
        matches!(command(self.addr(), &["PING"]), Ok(Resp::Simple(s)) if s == "PONG")
    }

    /// One command and its reply.
    pub fn command(&self, args: &[&str]) -> Result<Resp> {
        command(self.addr(), args)
    }

    /// Calls per command since the start (or `CONFIG RESETSTAT`), from `INFO commandstats`:
    /// `{"evalsha": 12, …}`. The commands this client sends (INFO itself) are counted too.
    pub fn command_calls(&self) -> Result<BTreeMap<String, u64>> {
        let info = self
            .command(&["INFO", "commandstats"])?
            .text()
            .context("INFO commandstats: not a string")?;
        Ok(parse_commandstats(&info))
    }

    /// Calls of every command but INFO and CONFIG (this client's own), e.g. a benchmark's
    /// round trips.
    pub fn data_command_calls(&self) -> Result<u64> {
        Ok(self
            .command_calls()?
            .iter()
            .filter(|(name, _)| !matches!(name.as_str(), "info" | "config" | "ping"))
            .map(|(_, n)| n)
            .sum())
    }

    /// Keys matching `pattern` (SCAN, so a big keyspace does not block the server).
    pub fn keys(&self, pattern: &str) -> Result<Vec<String>> {
        let mut cursor = "0".to_string();
        let mut keys = Vec::new();
        loop {
            let reply = self.command(&["SCAN", &cursor, "MATCH", pattern, "COUNT", "1000"])?;
            let items = reply.items();
            cursor = items.first().and_then(Resp::text).context("SCAN cursor")?;
            keys.extend(
                items
                    .get(1)
                    .map(Resp::items)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(Resp::text),
            );
            if cursor == "0" {
                return Ok(keys);
            }
        }
    }
}

/// `cmdstat_get:calls=3,usec=…` lines → `{"get": 3}`.
pub fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// The picked port is taken by another process: Redis starts on the next one, answers,
    /// counts commands, is paused (no answer) and resumed (data kept), and is stopped and
    /// started again on the same port (data gone).
    #[test]
    fn starts_on_a_fresh_port_counts_commands_pauses_and_restarts_on_its_port() {
        let dir = tempfile::Builder::new()
            .prefix("maas-redis-")
            .tempdir()
            .unwrap();
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut picks = vec![taken_port];
        let mut redis =
            Redis::start_on_free_port(dir.path(), || Ok(picks.pop().unwrap_or_else(free_port)))
                .unwrap();
        assert!(picks.is_empty(), "the taken port was tried first");
        assert_ne!(redis.port(), taken_port);
        assert!(
            std::fs::read_to_string(redis.log_path())
                .unwrap()
                .to_ascii_lowercase()
                .contains("address already in use"),
            "the first start really hit the taken port"
        );
        assert_eq!(redis.url(), format!("redis://127.0.0.1:{}", redis.port()));

        assert_eq!(
            redis.command(&["SET", "k", "41"]).unwrap(),
            Resp::Simple("OK".into())
        );
        assert_eq!(redis.command(&["INCR", "k"]).unwrap(), Resp::Int(42));
        assert_eq!(redis.command(&["GET", "k"]).unwrap().int(), Some(42));
        assert_eq!(redis.keys("k*").unwrap(), vec!["k".to_string()]);
        let calls = redis.command_calls().unwrap();
        assert_eq!(calls.get("set"), Some(&1), "{calls:?}");
        assert_eq!(calls.get("incr"), Some(&1), "{calls:?}");
        assert!(redis.command(&["NOSUCHCOMMAND"]).is_err());

        redis.pause().unwrap();
        assert!(!redis.ping(), "a paused server does not answer");
        redis.resume().unwrap();
        assert_eq!(
            redis.command(&["GET", "k"]).unwrap().int(),
            Some(42),
            "kept its data"
        );

        let port = redis.port();
        redis.stop();
        assert!(!redis.ping(), "stopped");
        redis.start().unwrap();
        assert_eq!(redis.port(), port, "same port after a restart");
        assert_eq!(redis.command(&["GET", "k"]).unwrap(), Resp::Bulk(None));
        redis.stop();
        drop(taken);
    }

    #[test]
    fn commandstats_lines_are_parsed() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=30,usec_per_call=2.5\r\ncmdstat_info:calls=1,usec=1\r\n";
        let calls = parse_commandstats(info);
        assert_eq!(calls.get("evalsha"), Some(&12));
        assert_eq!(calls.get("info"), Some(&1));
        assert_eq!(calls.len(), 2);
    }
}
