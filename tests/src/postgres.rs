//! A throwaway PostgreSQL: initdb in a directory, trust auth, 127.0.0.1 on a free port, the unix
//! socket in the same directory. Run as the `postgres` user when we are root (initdb and
//! postgres refuse root). `stop`/`start` keep the data, for fault tests.
//!
//! PostgreSQL cannot be handed a bound socket, so its port is picked free and released first;
//! [`Postgres::init_and_start_on_free_port`] starts it again on a fresh port when another process
//! took that port in between.

use crate::process::{ManagedProcess, is_addr_in_use, listens_on};
use anyhow::{Context, Result, bail};
use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub struct Postgres {
    bin_dir: PathBuf,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    log_path: PathBuf,
    port: u16,
    /// (uid, gid) to run as, when we are root.
    run_as: Option<(u32, u32)>,
    process: Option<ManagedProcess>,
}

fn postgres_user() -> Result<(u32, u32)> {
    let name = CString::new("postgres").unwrap_or_default();
    // SAFETY: getpwnam returns a pointer to static storage or null; read immediately.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        bail!(
            "running as root but there is no `postgres` user to run PostgreSQL as (apt-get install postgresql creates it)"
        );
    }
    // SAFETY: non-null result of getpwnam.
    Ok(unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

fn chown_recursive(path: &Path, uid: u32, gid: u32) -> Result<()> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .with_context(|| format!("chown {}", path.display()))?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_recursive(&entry?.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// Starts on a port taken in between are retried this many times in all.
const START_ATTEMPTS: usize = 5;

impl Postgres {
    /// initdb into `dir/data` and start on `port`; creates database `maas`.
    pub fn init_and_start(bin_dir: &Path, dir: &Path, port: u16) -> Result<Postgres> {
        let mut pg = Self::init(bin_dir, dir)?;
        pg.port = port;
        pg.start()?;
        pg.create_database("maas")?;
        Ok(pg)
    }

    /// initdb into `dir/data` and start on a port from `pick_port`; when the server exits
    /// because that port was taken meanwhile, starts it on the next one (up to
    /// [`START_ATTEMPTS`] ports). Creates database `maas`.
    pub fn init_and_start_on_free_port(
        bin_dir: &Path,
        dir: &Path,
        mut pick_port: impl FnMut() -> Result<u16>,
    ) -> Result<Postgres> {
        let mut pg = Self::init(bin_dir, dir)?;
        let mut attempt = 1;
        loop {
            pg.port = pick_port()?;
            match pg.start() {
                Ok(()) => break,
                Err(e) if attempt < START_ATTEMPTS && is_addr_in_use(&e) => {
                    eprintln!(
                        "postgres: port {} was taken ({e:#}); trying another",
                        pg.port
                    );
                    pg.process = None;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
        pg.create_database("maas")?;
        Ok(pg)
    }

    /// initdb into `dir/data`; not started (port 0 until one is chosen).
    fn init(bin_dir: &Path, dir: &Path) -> Result<Postgres> {
        // SAFETY: geteuid has no preconditions.
        let run_as = if unsafe { libc::geteuid() } == 0 {
            Some(postgres_user()?)
        } else {
            None
        };
        let data_dir = dir.join("data");
        let socket_dir = dir.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        if let Some((uid, gid)) = run_as {
            chown_recursive(dir, uid, gid)?;
        }
        let log_path = dir.join("postgres.log");
        let init_log = dir.join("initdb.log");
        let mut initdb = Command::new(bin_dir.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data_dir)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ])
            .stdout(std::fs::File::create(&init_log)?)
            .stderr(std::fs::File::create(dir.join("initdb.err"))?);
        if let Some((uid, gid)) = run_as {
            initdb.uid(uid).gid(gid);
        }
        let status = initdb.status().context("cannot run initdb")?;
        if !status.success() {
            bail!(
                "initdb failed ({status}): {}",
                crate::process::log_tail(&dir.join("initdb.err"), 2000)
            );
        }
        Ok(Postgres {
            bin_dir: bin_dir.to_path_buf(),
            data_dir,
            socket_dir,
            log_path,
            port: 0,
            run_as,
            process: None,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// `postgres://postgres@127.0.0.1:PORT/<db>`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Starts the server (again) on the same port and data, and waits until it accepts queries.
    pub fn start(&mut self) -> Result<()> {
        if self
            .process
            .as_mut()
            .is_some_and(ManagedProcess::is_running)
        {
            return Ok(());
        }
        let mut cmd = Command::new(self.bin_dir.join("postgres"));
        cmd.arg("-D")
            .arg(&self.data_dir)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(&self.socket_dir)
            // Throwaway data: durability off for speed.
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(["-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
            .args(["-c", "max_connections=200"]);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        // SIGINT = fast shutdown; SIGQUIT on our death = immediate shutdown of all backends.
        self.process = Some(ManagedProcess::spawn(
            "postgres",
            cmd,
            &self.log_path,
            libc::SIGINT,
            libc::SIGQUIT,
        )?);
        self.wait_ready(Duration::from_secs(30))
    }

    /// Exit status if the server exited on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.process.as_mut().and_then(ManagedProcess::exited)
    }

    /// Fast shutdown (clients disconnected), keeping the data.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.stop(Duration::from_secs(10));
        }
    }

    fn pg_isready(&self) -> bool {
        Command::new(self.bin_dir.join("pg_isready"))
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-q",
                "-t",
                "1",
            ])
            .arg("-p")
            .arg(self.port.to_string())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let mut process = self.process.take();
        let pid = process.as_ref().and_then(ManagedProcess::pid);
        let waited = match process.as_mut() {
            // Another server may hold this port (taken between the pick and our bind): it would
            // answer pg_isready while ours exits; only our own listener counts.
            Some(p) => p.wait_ready(timeout, Duration::from_millis(50), || {
                self.pg_isready() && pid.is_some_and(|pid| listens_on(pid, self.port))
            }),
            None => Ok(()),
        };
        self.process = process;
        waited
    }

    fn create_database(&self, name: &str) -> Result<()> {
        let out = Command::new(self.bin_dir.join("createdb"))
            .args(["-h", "127.0.0.1", "-U", "postgres"])
            .arg("-p")
            .arg(self.port.to_string())
            .arg(name)
            .output()
            .context("cannot run createdb")?;
        if !out.status.success() {
            bail!(
                "createdb {name} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A directory for a throwaway server, readable by the `postgres` user.
    fn pg_dir() -> tempfile::TempDir {
        let dir = tempfile::Builder::new()
            .prefix("maas-pg-port-")
            .tempdir()
            .unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        dir
    }

    /// Another process takes the picked port before PostgreSQL binds it: the server is started
    /// again on the next port instead of failing the stack.
    #[test]
    fn a_taken_port_is_replaced_by_a_fresh_one() {
        let bin = crate::tools::pg_bin_dir().unwrap();
        let dir = pg_dir();
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut picks = vec![taken_port];
        let mut pg = Postgres::init_and_start_on_free_port(&bin, dir.path(), || {
            Ok(match picks.pop() {
                Some(p) => p,
                None => TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
            })
        })
        .unwrap();
        assert!(picks.is_empty(), "the taken port was tried first");
        assert_ne!(pg.port(), taken_port);
        assert!(pg.pg_isready(), "serves on its new port {}", pg.port());
        assert!(
            std::fs::read_to_string(pg.log_path())
                .unwrap()
                .contains("Address already in use"),
            "the first start really hit the taken port"
        );
        pg.stop();
    }

    /// The port is taken by another PostgreSQL, which answers `pg_isready` there while ours
    /// exits: ours is still started again elsewhere, and its database is its own (the other
    /// server's answer once made a stack create `maas` in the other's cluster, failing on a
    /// duplicate under four concurrent stacks).
    #[test]
    fn a_port_taken_by_another_postgres_is_not_taken_for_ours() {
        let bin = crate::tools::pg_bin_dir().unwrap();
        let (first_dir, second_dir) = (pg_dir(), pg_dir());
        let free = || -> Result<u16> { Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()) };
        let mut first =
            Postgres::init_and_start_on_free_port(&bin, first_dir.path(), free).unwrap();
        let mut picks = vec![first.port()];
        let mut second = Postgres::init_and_start_on_free_port(&bin, second_dir.path(), || {
            picks.pop().map_or_else(free, Ok)
        })
        .unwrap();
        assert!(picks.is_empty(), "the other server's port was tried first");
        assert_ne!(second.port(), first.port());
        assert!(
            second.pg_isready(),
            "serves on its own port {}",
            second.port()
        );
        assert!(second.exited().is_none(), "the second server runs");
        second.stop();
        first.stop();
    }

    /// Retries are bounded: when every picked port is taken the start fails, saying so.
    #[test]
    fn retries_are_bounded() {
        let bin = crate::tools::pg_bin_dir().unwrap();
        let dir = pg_dir();
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut tries = 0;
        let err = Postgres::init_and_start_on_free_port(&bin, dir.path(), || {
            tries += 1;
            Ok(taken_port)
        })
        .err()
        .expect("every port is taken");
        assert_eq!(tries, START_ATTEMPTS, "{err:#}");
        assert!(is_addr_in_use(&err), "{err:#}");
    }
}
