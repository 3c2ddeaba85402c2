//! The programs a task runs (cargo, rustup, npm, skopeo, apt-get) and finding them.

use crate::log::Log;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The program on PATH, if there is one.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Runs a program with its stdout sent to our stderr (stdout is for the task's result) and
/// its stderr shown; `Err` with its exit status when it fails or cannot start.
pub fn run_to_stderr<S: AsRef<OsStr>>(
    program: &str,
    args: &[S],
    dir: Option<&Path>,
    env: &[(&str, Option<&str>)],
) -> Result<(), String> {
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::io::stderr());
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    for (key, value) in env {
        match value {
            Some(v) => command.env(key, v),
            None => command.env_remove(key),
        };
    }
    let status = command.status().map_err(|e| format!("{program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{program} {status}"))
    }
}

/// Runs a program quietly; true when it succeeds.
fn quiet(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// True when we run as root (apt-get installs).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Installs a Debian package with apt-get (root only), updating the lists once if needed.
pub fn apt_install(package: &str, log: &Log) -> Result<(), String> {
    log.info(&format!("installing {package} (apt-get)"));
    let install = ["install", "-y", "-qq", package];
    if quiet("apt-get", &install)
        || (quiet("apt-get", &["update", "-qq"]) && quiet("apt-get", &install))
    {
        Ok(())
    } else {
        Err(format!("installing {package} failed"))
    }
}

/// Makes sure `command` exists, installing `package` when it is missing and we may (root with
/// apt-get).
pub fn apt_tool(command: &str, package: &str, log: &Log) -> Result<(), String> {
    if which(command).is_some() {
        return Ok(());
    }
    if !is_root() || which("apt-get").is_none() {
        return Err(format!(
            "{command} is required: install the Debian package {package}"
        ));
    }
    apt_install(package, log)
}
