//! The checkout the tasks build from: its root, its target directory, and cargo run there
//! (so .cargo/config.toml applies, e.g. the filter's wasm32 SIMD flag).

use crate::tools;
use std::path::{Path, PathBuf};

pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    /// The workspace this xtask was built in.
    pub fn here() -> Workspace {
        let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root = manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf();
        Workspace { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `CARGO_TARGET_DIR`, else `<root>/target`.
    pub fn target_dir(&self) -> PathBuf {
        std::env::var_os("CARGO_TARGET_DIR")
            .filter(|d| !d.is_empty())
            .map_or_else(|| self.root.join("target"), PathBuf::from)
    }

    /// `cargo ARGS` in the workspace root (cargo's progress on stderr).
    pub fn cargo(&self, args: &[&str], env: &[(&str, Option<&str>)]) -> Result<(), String> {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        tools::run_to_stderr(&cargo, args, Some(&self.root), env)
    }

    /// A line of the workspace's Cargo.toml: the first `KEY = "VALUE"`.
    pub fn manifest_value(&self, key: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.root.join("Cargo.toml")).ok()?;
        let prefix = format!("{key} = \"");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix)?.strip_suffix('"'))
            .map(String::from)
    }

    /// The checked-out commit, if this is a git checkout.
    pub fn revision(&self) -> Option<String> {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&self.root)
            .args(["rev-parse", "HEAD"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let rev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (!rev.is_empty()).then_some(rev)
    }
}
