//! Renders (each `kubectl kustomize` once per test process) and running the checks on them.

use maas_e2e::manifest_checks::{self, Docs, LeaseStore, Options, Platform, Report, Schemas, Tls};
use maas_e2e::tools::{kubectl, workspace_root};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::{LazyLock, Mutex};

/// The kustomizations the checks run on: the five overlays (OpenShift's four, plain
/// Kubernetes'), two compositions deploy.sh and docs/deploy.md make (the development Redis; the
/// policy from the reference's resources), and the schema-only ones.
pub const OVERLAYS: [&str; 5] = ["odh", "odh-tls-off", "rhoai", "rhoai-tls-off", "kubernetes"];

static RENDERS: LazyLock<Mutex<HashMap<String, &'static Docs>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static SCHEMAS: LazyLock<Schemas> = LazyLock::new(|| {
    Schemas::load(&workspace_root().join("tests/fixtures/schemas")).expect("the schemas load")
});

/// `kubectl kustomize DIR`, parsed.
pub fn kustomize(dir: &Path) -> Docs {
    let kubectl = kubectl().unwrap_or_else(|e| panic!("{e:#}"));
    let out = Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("running {} kustomize: {e}", kubectl.display()));
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Docs::parse(&String::from_utf8_lossy(&out.stdout)).expect("the render is YAML")
}

/// `to` as a path relative to `from` (kustomize takes relative resource paths).
fn relative(from: &Path, to: &Path) -> String {
    let ups = from
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count();
    let down: PathBuf = to
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect();
    format!("{}{}", "../".repeat(ups), down.display())
}

/// The odh overlay's gateway side (TLS backend on) with the companion's base plus components
/// (`components`, the companion's; `gateway_components`, the Gateway's side), as deploy.sh
/// --dev-redis and docs/deploy.md compose them.
fn compose(components: &[&str], gateway_components: &[&str]) -> Docs {
    let crs = workspace_root().join("wasm-plugin-crs");
    let dir = tempfile::tempdir().expect("a temp dir");
    let companion = dir.path().join("companion");
    std::fs::create_dir_all(&companion).expect("mkdir");
    let listed: String = components
        .iter()
        .map(|c| {
            format!(
                "  - {}\n",
                relative(&companion, &crs.join("components").join(c))
            )
        })
        .collect();
    let listed = if listed.is_empty() {
        listed
    } else {
        format!("components:\n{listed}")
    };
    let inner = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: opendatahub\n\
         resources:\n  - {}\n{listed}",
        relative(&companion, &crs.join("base/companion")),
    );
    std::fs::write(companion.join("kustomization.yaml"), inner).expect("write");
    let gateway_listed: String = gateway_components
        .iter()
        .map(|c| {
            format!(
                "  - {}\n",
                relative(dir.path(), &crs.join("components").join(c))
            )
        })
        .collect();
    let outer = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - {}\n  - companion\ncomponents:\n  - {}\n  - {}\n{gateway_listed}",
        relative(dir.path(), &crs.join("base/gateway")),
        relative(dir.path(), &crs.join("components/tls-backend")),
        relative(dir.path(), &crs.join("components/wiring")),
    );
    std::fs::write(dir.path().join("kustomization.yaml"), outer).expect("write");
    kustomize(dir.path())
}

/// A render by name: an overlay, `dev-redis`, `maas-resources`, `maas-status` (with
/// `maas-resources`), `usage-events` (the Gateway's side), `base/postgres` or `samples`.
pub fn render(name: &str) -> &'static Docs {
    if let Some(docs) = RENDERS.lock().expect("renders").get(name) {
        return docs;
    }
    let crs = workspace_root().join("wasm-plugin-crs");
    let docs = match name {
        "dev-redis" => compose(&["redis-dev"], &[]),
        "maas-resources" => compose(&["maas-resources"], &[]),
        "maas-status" => compose(&["maas-resources", "maas-status"], &[]),
        "usage-events" => compose(&[], &["usage-events"]),
        "base/postgres" | "samples" => kustomize(&crs.join(name)),
        overlay => kustomize(&crs.join("overlays").join(overlay)),
    };
    let docs: &'static Docs = Box::leak(Box::new(docs));
    RENDERS
        .lock()
        .expect("renders")
        .insert(name.to_string(), docs);
    docs
}

/// What a render is checked with: its companion namespace and TLS backend, no dev Redis and
/// the lease counters in process unless it is the dev-Redis render.
pub fn options_for(name: &str) -> Options {
    let (namespace, tls) = match name {
        "odh-tls-off" => ("opendatahub", Tls::Off),
        "rhoai" => ("redhat-ods-applications", Tls::On),
        "rhoai-tls-off" => ("redhat-ods-applications", Tls::Off),
        "kubernetes" => ("maas", Tls::On),
        _ => ("opendatahub", Tls::On),
    };
    let dev_redis = name == "dev-redis";
    Options {
        platform: if name == "kubernetes" {
            Platform::Kubernetes
        } else {
            Platform::OpenShift
        },
        namespace: Some(namespace.to_string()),
        tls,
        dev_redis: Some(dev_redis),
        lease_store: if dev_redis {
            LeaseStore::Redis
        } else {
            LeaseStore::Memory
        },
        kinds_only: matches!(name, "base/postgres" | "samples"),
    }
}

/// Every check on `docs`.
pub fn run(docs: &Docs, options: &Options) -> Report {
    manifest_checks::check(docs, options, &SCHEMAS, &workspace_root())
}
