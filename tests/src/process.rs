//! Child processes that die with the stack.
//!
//! Every child is spawned by one long-lived supervisor thread with `PR_SET_PDEATHSIG`: the
//! kernel sends the death signal when the spawning *thread* exits, so spawning from a
//! short-lived test thread would kill the child early. The supervisor lives as long as the
//! process, so a crashed or killed test binary leaves nothing behind. Children get their own
//! process group, so a terminal's Ctrl-C reaches only the stack, which then stops them in order.

use anyhow::{Context, Result};
use std::fs::OpenOptions;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

type SpawnRequest = (Command, libc::c_int, mpsc::Sender<io::Result<Child>>);

fn supervisor() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SUPERVISOR: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SUPERVISOR.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        // The receiver never closes (the sender is in a static), so this thread lives as long
        // as the process: exactly what PR_SET_PDEATHSIG needs.
        let spawned = std::thread::Builder::new()
            .name("maas-supervisor".into())
            .spawn(move || {
                let parent = std::process::id() as libc::pid_t;
                while let Ok((mut cmd, signal, reply)) = rx.recv() {
                    // SAFETY: the closure only calls async-signal-safe functions (prctl, getppid, raise).
                    unsafe {
                        cmd.pre_exec(move || {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong) != 0 {
                                return Err(io::Error::last_os_error());
                            }
                            // The parent may have died between fork and prctl.
                            if libc::getppid() != parent {
                                libc::raise(signal);
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
            });
        if let Err(e) = spawned {
            eprintln!("cannot start the process supervisor thread: {e}");
        }
        Mutex::new(tx)
    })
}

/// Spawns `cmd` from the supervisor thread; the child receives `death_signal` when this
/// process dies. Applied after any uid switch (std runs pre_exec after setuid), because a
/// credential change clears the death signal.
pub fn spawn_supervised(mut cmd: Command, death_signal: libc::c_int) -> io::Result<Child> {
    cmd.process_group(0);
    let (tx, rx) = mpsc::channel();
    supervisor()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, death_signal, tx))
        .map_err(|_| io::Error::other("process supervisor is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("process supervisor is gone"))?
}

/// A child exited because a port it was told to listen on was taken ("Address already in use"
/// in what it logged since it started): the caller may start it again on fresh ports. Ports of
/// programs that cannot take an already-bound socket (Envoy, PostgreSQL, the companion binary)
/// are picked free and released first, so another process can take one in between.
#[derive(Debug)]
pub struct AddrInUse {
    pub process: String,
    pub detail: String,
}

impl std::fmt::Display for AddrInUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} could not listen: {}", self.process, self.detail)
    }
}

impl std::error::Error for AddrInUse {}

/// Was `e` (anywhere in its chain) an [`AddrInUse`]?
pub fn is_addr_in_use(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<AddrInUse>())
}

/// A named child with its log file (stdout and stderr, appended across restarts).
pub struct ManagedProcess {
    pub name: String,
    pub log_path: PathBuf,
    child: Option<Child>,
    /// Length of the log when this child started: what it wrote is after this offset.
    log_start: u64,
    /// Signal for a graceful stop (SIGTERM; SIGINT = fast shutdown for PostgreSQL).
    stop_signal: libc::c_int,
}

impl ManagedProcess {
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        log_path: &Path,
        stop_signal: libc::c_int,
        death_signal: libc::c_int,
    ) -> Result<Self> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
        let log_err = log.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
        let program = cmd.get_program().to_string_lossy().into_owned();
        let child = spawn_supervised(cmd, death_signal)
            .with_context(|| format!("cannot start {name} ({program})"))?;
        Ok(ManagedProcess {
            name: name.to_string(),
            log_path: log_path.to_path_buf(),
            child: Some(child),
            log_start,
            stop_signal,
        })
    }

    /// Polls `ready` every `every` until it answers, the process exits (its port taken:
    /// [`AddrInUse`], for the caller to retry elsewhere; else an error with its log's tail) or
    /// `timeout` passes.
    pub fn wait_ready(
        &mut self,
        timeout: Duration,
        every: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(taken) = self.exited_addr_in_use() {
                return Err(taken.into());
            }
            if let Some(status) = self.exited() {
                anyhow::bail!(
                    "{} exited ({status}):\n{}",
                    self.name,
                    log_tail(&self.log_path, 3000)
                );
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "{} not ready after {timeout:?}:\n{}",
                    self.name,
                    log_tail(&self.log_path, 3000)
                );
            }
            std::thread::sleep(every);
        }
    }

    /// What this child (not an earlier run with the same log) has logged so far.
    pub fn log_since_start(&self) -> String {
        match std::fs::read(&self.log_path) {
            Ok(bytes) => {
                let start = usize::try_from(self.log_start)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                String::from_utf8_lossy(bytes.get(start..).unwrap_or_default()).into_owned()
            }
            Err(_) => String::new(),
        }
    }

    /// `Some` when the child has exited after logging "Address already in use" (Envoy,
    /// PostgreSQL and the companion all say so when a listen address is taken).
    pub fn exited_addr_in_use(&mut self) -> Option<AddrInUse> {
        self.exited()?;
        let log = self.log_since_start();
        let line = log
            .lines()
            .find(|l| l.to_ascii_lowercase().contains("address already in use"))?;
        Some(AddrInUse {
            process: self.name.clone(),
            detail: line.trim().to_string(),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Still running (not exited, not stopped)?
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Does this child itself hold a TCP socket listening on `port`? A readiness probe by
    /// address alone can be answered by another program that took the port between the pick
    /// and this child's bind (this child then exits with "Address already in use", possibly
    /// after the probe said ready): check this beside the probe.
    pub fn listens_on(&self, port: u16) -> bool {
        self.pid().is_some_and(|pid| listens_on(pid, port))
    }

    /// Exit status if the process has exited on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Graceful stop with `grace`, then SIGKILL. Idempotent.
    pub fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        // SAFETY: plain kill(2) on our own child's pid, which we have not reaped yet.
        unsafe {
            libc::kill(child.id() as libc::pid_t, self.stop_signal);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Last `max_bytes` of the log.
    pub fn log_tail(&self, max_bytes: usize) -> String {
        log_tail(&self.log_path, max_bytes)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(3));
    }
}

pub fn log_tail(path: &Path, max_bytes: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let start = bytes.len().saturating_sub(max_bytes);
            String::from_utf8_lossy(&bytes[start..]).into_owned()
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Does process `pid` hold a TCP socket listening on `port` ([`ManagedProcess::listens_on`])?
pub fn listens_on(pid: u32, port: u16) -> bool {
    listening_inodes(port)
        .iter()
        .any(|inode| owns_socket(pid, *inode))
}

/// Inodes of the TCP sockets (v4 and v6) listening on `port` in this network namespace.
fn listening_inodes(port: u16) -> Vec<u64> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        inodes.extend(text.lines().skip(1).filter_map(|line| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit_once(':')?.1;
            let listening = *fields.get(3)? == "0A";
            (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                .then(|| fields.get(9)?.parse::<u64>().ok())
                .flatten()
        }));
    }
    inodes
}

/// Does process `pid` hold the socket with this inode among its open files?
fn owns_socket(pid: u32, inode: u64) -> bool {
    let wanted = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
        fds.filter_map(Result::ok)
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .any(|target| target.as_os_str() == wanted.as_str())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_port_is_owned_by_the_process_that_listens_on_it_and_no_other() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let inodes = listening_inodes(port);
        assert!(
            !inodes.is_empty(),
            "the listener on {port} is not in /proc/net/tcp"
        );
        assert!(inodes.iter().any(|i| owns_socket(std::process::id(), *i)));

        let dir = tempfile::tempdir().unwrap();
        let mut sleeper = Command::new("sleep");
        sleeper.arg("30");
        let child = ManagedProcess::spawn(
            "sleeper",
            sleeper,
            &dir.path().join("sleeper.log"),
            libc::SIGTERM,
            libc::SIGKILL,
        )
        .unwrap();
        assert!(
            !child.listens_on(port),
            "a child that listens on nothing was taken for the owner of {port}"
        );
        drop(listener);
        assert!(listening_inodes(port).is_empty());
    }
}
