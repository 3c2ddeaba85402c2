//! Runs the manifest checks (`maas_e2e::manifest_checks`) on a rendered multi-document YAML (a
//! file, or stdin), for scripts/deploy.sh's dry-run renders in tests/scripts/deploy-script.sh.
//! Prints `PASS <check>` / `FAIL <check>: <why>` lines and exits 1 if anything failed. With
//! `--facts` it prints what the render says instead: `companion-replicas N`,
//! `gateway-replicas N` (the Gateway's deployment patch) and `filter-global-replicas N`
//! (the filter's limits.global.replicas), one per line, `none` when absent.

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use maas_e2e::manifest_checks::{self, Docs, LeaseStore, Options, Platform, Schemas, Tls, opt};
use maas_e2e::tools::workspace_root;
use serde_json::Value;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Clone, Copy, ValueEnum)]
enum PlatformArg {
    Openshift,
    Kubernetes,
}

#[derive(Clone, Copy, ValueEnum)]
enum TlsArg {
    On,
    Off,
    Any,
}

#[derive(Clone, Copy, ValueEnum)]
enum YesNo {
    Yes,
    No,
    Any,
}

#[derive(Clone, Copy, ValueEnum)]
enum LeaseArg {
    Memory,
    Redis,
    Any,
}

#[derive(Parser)]
#[command(about = "Schema and wiring checks on rendered MaaS Gateway manifests")]
struct Args {
    /// The schemas (default: tests/fixtures/schemas of this checkout).
    #[arg(long)]
    schemas: Option<PathBuf>,
    /// The companion's namespace, when it must be this one.
    #[arg(long)]
    namespace: Option<String>,
    /// Whether the TLS backend is on.
    #[arg(long, value_enum, default_value = "any")]
    tls: TlsArg,
    /// Where the render runs: OpenShift, or plain Kubernetes with Istio (overlays/kubernetes).
    #[arg(long, value_enum, default_value = "openshift")]
    platform: PlatformArg,
    /// Whether the development Redis must (not) be rendered.
    #[arg(long, value_enum, default_value = "any")]
    dev_redis: YesNo,
    /// Where the companion's lease counters are: memory requires one companion replica.
    #[arg(long, value_enum, default_value = "any")]
    lease_store: LeaseArg,
    /// Schemas only (samples, postgres).
    #[arg(long)]
    kinds_only: bool,
    /// Print the render's replica counts instead of checking it.
    #[arg(long)]
    facts: bool,
    /// The render (default: stdin).
    file: Option<PathBuf>,
}

fn read_render(file: Option<&PathBuf>) -> Result<String> {
    match file {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
        }
        None => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("reading stdin")?;
            Ok(text)
        }
    }
}

fn show(value: Option<&Value>) -> String {
    value.map_or_else(|| "none".to_string(), |v| v.to_string())
}

/// The replica counts the render sets.
fn facts(docs: &Docs) -> String {
    let companion = docs
        .one("Deployment", "maas-companion")
        .ok()
        .map(|d| opt(d, "spec.replicas").cloned().unwrap_or(Value::from(1)));
    let gateway = docs
        .one("ConfigMap", "maas-gateway-options")
        .ok()
        .and_then(|cm| opt(cm, "data.deployment")?.as_str())
        .and_then(|text| yaml_serde::from_str::<Value>(text).ok())
        .and_then(|patch| opt(&patch, "spec.replicas").cloned());
    let filter = docs
        .one("EnvoyFilter", "maas-filter")
        .ok()
        .and_then(|ef| {
            opt(ef, "spec.configPatches")?
                .as_array()?
                .iter()
                .find(|p| p.get("applyTo").and_then(Value::as_str) == Some("EXTENSION_CONFIG"))
        })
        .and_then(|p| opt(p, "patch.value.typed_config.config.configuration.value")?.as_str())
        .and_then(|text| serde_json::from_str::<Value>(text).ok())
        .and_then(|plugin| opt(&plugin, "limits.global.replicas").cloned());
    format!(
        "companion-replicas {}\ngateway-replicas {}\nfilter-global-replicas {}\n",
        show(companion.as_ref()),
        show(gateway.as_ref()),
        show(filter.as_ref())
    )
}

fn main() -> Result<ExitCode> {
    let args = Args::parse();
    let docs = Docs::parse(&read_render(args.file.as_ref())?).map_err(anyhow::Error::msg)?;
    if args.facts {
        print!("{}", facts(&docs));
        return Ok(ExitCode::SUCCESS);
    }
    let root = workspace_root();
    let schemas_dir = args
        .schemas
        .unwrap_or_else(|| root.join("tests/fixtures/schemas"));
    let schemas = Schemas::load(&schemas_dir).map_err(anyhow::Error::msg)?;
    let options = Options {
        platform: match args.platform {
            PlatformArg::Openshift => Platform::OpenShift,
            PlatformArg::Kubernetes => Platform::Kubernetes,
        },
        namespace: args.namespace,
        tls: match args.tls {
            TlsArg::On => Tls::On,
            TlsArg::Off => Tls::Off,
            TlsArg::Any => Tls::Any,
        },
        dev_redis: match args.dev_redis {
            YesNo::Yes => Some(true),
            YesNo::No => Some(false),
            YesNo::Any => None,
        },
        lease_store: match args.lease_store {
            LeaseArg::Memory => LeaseStore::Memory,
            LeaseArg::Redis => LeaseStore::Redis,
            LeaseArg::Any => LeaseStore::Any,
        },
        kinds_only: args.kinds_only,
    };
    let report = manifest_checks::check(&docs, &options, &schemas, &root);
    print!("{report}");
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
