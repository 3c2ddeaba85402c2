//! The stack's parts on their own, with real binaries: PostgreSQL restarts keep data, and the
//! Envoy config generated from a policy routes as intended (bare Envoy, no filter or companion).

use maas_e2e::envoy_config::{self, EnvoyConfigInput};
use maas_e2e::extra_envoy::{ExtraEnvoy, ExtraEnvoyOptions, Ready};
use maas_e2e::postgres::Postgres;
use maas_e2e::sim::{self, SimConfig};
use maas_e2e::stack::{free_ports, http_request};
use maas_e2e::tools;
use maas_types::PolicyDocument;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

fn psql(pg_bin: &std::path::Path, port: u16, sql: &str) -> std::process::Output {
    Command::new(pg_bin.join("psql"))
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            "maas",
            "-tAc",
            sql,
        ])
        .arg("-p")
        .arg(port.to_string())
        .output()
        .unwrap()
}

#[test]
fn postgres_restart_keeps_data() {
    let pg_bin = tools::pg_bin_dir().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("maas-pg-test-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut pg =
        Postgres::init_and_start_on_free_port(&pg_bin, dir.path(), || Ok(free_ports(1)?[0]))
            .unwrap();
    let port = pg.port();
    assert_eq!(
        pg.url("maas"),
        format!("postgres://postgres@127.0.0.1:{port}/maas")
    );
    let out = psql(
        &pg_bin,
        port,
        "CREATE TABLE t (v int); INSERT INTO t VALUES (42);",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pg.stop();
    assert!(
        !psql(&pg_bin, port, "SELECT 1").status.success(),
        "stopped server still answers"
    );
    pg.start().unwrap();
    let out = psql(&pg_bin, port, "SELECT v FROM t");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");
}

#[test]
fn bare_envoy_routes_generated_from_the_policy() {
    let sim = sim::spawn("127.0.0.1:0".parse().unwrap(), SimConfig::default()).unwrap();
    // A second simulator stands in for an external OpenAI-compatible server (backend URL).
    let other = sim::spawn("127.0.0.1:0".parse().unwrap(), SimConfig::default()).unwrap();
    let policy = PolicyDocument::from_value(json!({
        "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
        "models": [
            {"name": "sim-model", "path": "/llm/sim-model", "tiers": ["free"], "backend": "simulator"},
            {"name": "vllm", "path": "/ns/vllm", "tiers": ["free"], "backend": format!("{}/base", other.url())}
        ]
    }))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    // Nothing listens there: the public API route answers 503.
    let nowhere = free_ports(2).unwrap();
    let envoy = ExtraEnvoy::start(
        &ExtraEnvoyOptions::new("bare", dir.path(), Ready::Admin),
        |ports| {
            let config = envoy_config::render(&EnvoyConfigInput {
                policy: &policy,
                listen: ports.listen,
                admin: ports.admin,
                companion_public: local(nowhere[0]),
                companion_internal: local(nowhere[1]),
                simulator: sim.addr(),
                filter: None,
                companion_tls: None,
                usage_events_path: None,
            })?;
            Ok(serde_json::from_str(&config)?)
        },
    )
    .unwrap();
    let gateway = envoy.ports.listen;
    let t = Duration::from_secs(5);

    let (status, _) = http_request(gateway, "GET", "/llm/sim-model/v1/models", t).unwrap();
    assert_eq!(status, 200);
    let (status, _) = http_request(gateway, "GET", "/llm//sim-model/./v1/models?q=1", t).unwrap();
    assert_eq!(status, 200);
    let paths: Vec<String> = sim.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        ["/v1/models", "/v1/models?q=1"],
        "prefix rewritten to /, path normalized"
    );

    let (status, _) = http_request(gateway, "GET", "/ns/vllm/v1/models", t).unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        other.requests()[0].path,
        "/base/v1/models",
        "prefix rewritten to the backend URL's path"
    );

    // Segment boundary: /llm/sim-modelX is not the model.
    let (status, body) = http_request(gateway, "GET", "/llm/sim-modelX/v1/models", t).unwrap();
    assert_eq!(status, 404);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "not_found");

    for path in [
        "/maas-api/internal/v1/policy",
        "/maas-api//internal/v1/policy",
        "/maas-api/a/../internal",
    ] {
        let (status, _) = http_request(gateway, "GET", path, t).unwrap();
        assert_eq!(status, 404, "{path}");
    }
    let (status, _) = http_request(gateway, "GET", "/maas-api/health", t).unwrap();
    assert_eq!(status, 503, "public API routed to the (absent) companion");
    assert_eq!(
        sim.requests().len(),
        2,
        "nothing else reached the simulator"
    );
}
