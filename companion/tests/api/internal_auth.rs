//! Only the gateway may use the internal listener: every internal route refuses, at the TLS
//! handshake, a caller without a client certificate, with one from another CA, or with one from
//! the CA that names no allowed caller; the gateway's certificate gets answers. The public and
//! metrics listeners are unchanged.

use crate::helpers::{
    GATEWAY_NAME, TestApp, internal_pki, issue, local_settings, new_ca, spawn_app, spawn_app_with,
};
use maas_types::lease::LEASES_PATH;
use maas_types::usage::USAGE_PATH;
use serde_json::{Value, json};

/// The provider key the test companion serves on `/internal/v1/credentials`.
const PROVIDER_KEY: &str = "sk-local-openai";

/// Every route of the internal listener, with a body it accepts.
fn internal_routes() -> Vec<(reqwest::Method, &'static str, Option<Value>)> {
    let hour = chrono::Utc::now().timestamp() / 3600 * 3600;
    vec![
        (
            reqwest::Method::POST,
            "/internal/v1/authenticate",
            Some(json!({"credential": "alice-token"})),
        ),
        (reqwest::Method::GET, "/internal/v1/policy", None),
        (reqwest::Method::GET, "/internal/v1/credentials", None),
        (reqwest::Method::POST, "/internal/v1/api-keys/cleanup", None),
        (
            reqwest::Method::POST,
            LEASES_PATH,
            Some(json!({"replica": "intruder", "items": [{
                "subject": "user:alice", "kind": "requests", "windowSeconds": 3600,
                "windowStart": hour, "limit": 10, "need": 0, "want": 0, "debt": 0, "release": 10
            }]})),
        ),
        (
            reqwest::Method::POST,
            USAGE_PATH,
            Some(json!({"replica": "intruder", "batchId": "b1", "records": [{
                "subject": "user:alice", "tier": "free", "model": "sim-model",
                "hourStart": hour, "requests": 1000, "promptTokens": 1, "completionTokens": 1
            }]})),
        ),
        (reqwest::Method::GET, "/health", None),
        (reqwest::Method::GET, "/ready", None),
    ]
}

/// What a caller got from one route: an HTTP answer (status, body) or a refused connection.
async fn call(
    http: &reqwest::Client,
    base: &str,
    method: &reqwest::Method,
    path: &str,
    body: &Option<Value>,
) -> Result<(u16, String), String> {
    let mut request = http.request(method.clone(), format!("{base}{path}"));
    if let Some(body) = body {
        request = request.json(body);
    }
    match request.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            // A connection cut after the headers is a refusal too.
            match r.text().await {
                Ok(text) => Ok((status, text)),
                Err(e) => Err(format!("{e:?}")),
            }
        }
        Err(e) => Err(format!("{e:?}")),
    }
}

/// `http` gets no answer from any internal route (the handshake fails), so no provider key,
/// no ledger row, no lease release.
async fn refused_everywhere(app: &TestApp, who: &str, http: &reqwest::Client, base: &str) {
    for (method, path, body) in internal_routes() {
        match call(http, base, &method, path, &body).await {
            Err(_) => {}
            Ok((status, text)) => panic!(
                "{who}: {method} {path} answered {status}{}",
                if text.contains(PROVIDER_KEY) {
                    " WITH THE PROVIDER KEY"
                } else {
                    ""
                }
            ),
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM usage_hourly")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "{who}: a usage report was written");
}

#[tokio::test]
async fn every_internal_route_refuses_a_caller_without_the_gateways_certificate() {
    let app = spawn_app().await;
    let pki = internal_pki();

    // No client certificate at all (the listener's CA trusted, so only the client side fails).
    refused_everywhere(&app, "no certificate", &pki.client(None), &app.internal).await;
    // Plain HTTP to the TLS port.
    let plain = app.internal.replacen("https://", "http://", 1);
    refused_everywhere(&app, "plain HTTP", &reqwest::Client::new(), &plain).await;
    // A certificate naming the gateway, from another CA.
    let (_, other_ca) = new_ca("another CA");
    let (cert, key) = issue(&other_ca, &[GATEWAY_NAME], true);
    let forged = pki.client(Some(&format!("{cert}{key}")));
    refused_everywhere(&app, "another CA", &forged, &app.internal).await;
    // The right CA, but a name that is not an allowed caller (say, a tenant's workload).
    let tenant = pki.client(Some(&pki.client_identity(&[
        "spiffe://cluster.local/ns/tenant/sa/default",
        "maas-companion.opendatahub.svc",
    ])));
    refused_everywhere(&app, "a name not allowed", &tenant, &app.internal).await;

    // The gateway's certificate: every route answers, the credentials with the provider key.
    let gateway = pki.gateway_client();
    for (method, path, body) in internal_routes() {
        let (status, text) = call(&gateway, &app.internal, &method, path, &body)
            .await
            .unwrap_or_else(|e| panic!("the gateway: {method} {path} refused: {e}"));
        assert_eq!(status, 200, "the gateway: {method} {path}: {text}");
        if path == "/internal/v1/credentials" {
            assert!(text.contains(PROVIDER_KEY), "{text}");
        }
    }

    // Every refused handshake was counted (4 callers × 8 routes, at least once each).
    let refused = app
        .metric("maas_companion_internal_handshakes_failed_total")
        .await;
    assert!(refused >= 32.0, "{refused} refused handshakes counted");
}

#[tokio::test]
async fn a_server_certificate_of_the_ca_is_not_a_client_certificate() {
    let app = spawn_app().await;
    let pki = internal_pki();
    // The listener's own certificate and key, presented by a client: wrong usage (serverAuth).
    let identity = format!(
        "{}{}",
        std::fs::read_to_string(&pki.server_cert).unwrap(),
        std::fs::read_to_string(&pki.server_key).unwrap()
    );
    let r = pki
        .client(Some(&identity))
        .get(format!("{}/internal/v1/credentials", app.internal))
        .send()
        .await;
    assert!(r.is_err(), "{r:?}");
}

#[tokio::test]
async fn without_names_any_certificate_from_the_ca_is_admitted() {
    let app = spawn_app_with(|s| {
        if let maas_companion::settings::InternalAuth::Mtls(m) = &mut s.listeners.internal_auth {
            m.client_names.clear();
        }
    })
    .await;
    let pki = internal_pki();
    let other = pki.client(Some(
        &pki.client_identity(&["maas-api-key-cleanup.opendatahub"]),
    ));
    let r = other
        .post(format!("{}/internal/v1/api-keys/cleanup", app.internal))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    refused_everywhere(&app, "no certificate", &pki.client(None), &app.internal).await;
}

#[tokio::test]
async fn the_public_and_metrics_listeners_need_no_client_certificate() {
    let app = spawn_app().await;
    let plain = reqwest::Client::new();
    let health = plain
        .get(format!("{}/health", app.public))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let models = plain
        .get(format!("{}/v1/models", app.public))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    let scrape = plain
        .get(format!("{}/metrics", app.metrics))
        .send()
        .await
        .unwrap();
    assert_eq!(scrape.status(), 200);
    // ... and the internal API is still not on the public listener.
    let r = plain
        .get(format!("{}/internal/v1/credentials", app.public))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

/// A change to the internal listener's mTLS settings.
type Adjust<'a> = Box<dyn Fn(&mut maas_companion::settings::InternalMtls) + 'a>;

/// A file the internal listener's TLS needs that is missing or unusable stops the start with a
/// message naming its flag, and never quotes the private key file.
#[tokio::test]
async fn unusable_certificate_files_stop_the_start_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let policy = write("policy.yaml", &crate::helpers::local_policy());
    let ids = write("ids.yaml", crate::helpers::IDENTITIES);
    let creds = write("creds.yaml", "credentials: {}\n");
    let not_pem = write("garbage.pem", "this is not a certificate\n");
    let secret_key = write(
        "broken.key",
        "-----BEGIN PRIVATE KEY-----\nS3CRETKEYMATERIAL!!!\n-----END PRIVATE KEY-----\n",
    );
    let (_, other_ca) = new_ca("mismatch");
    let (other_cert, _) = issue(&other_ca, &["127.0.0.1"], false);
    let other_cert = write("other.crt", &other_cert);

    let start = |adjust: &dyn Fn(&mut maas_companion::settings::InternalMtls)| {
        let mut settings = local_settings(
            "postgres://postgres@127.0.0.1:1/none",
            &policy,
            &ids,
            &creds,
        );
        if let maas_companion::settings::InternalAuth::Mtls(m) =
            &mut settings.listeners.internal_auth
        {
            adjust(m);
        }
        maas_companion::Application::build(settings)
    };
    let cases: Vec<(&str, Adjust<'_>, String)> = vec![
        (
            "a CA file without a certificate",
            Box::new(|m| m.client_ca = not_pem.clone()),
            format!("--internal-client-ca {}: ", not_pem.display()),
        ),
        (
            "a certificate file without a certificate",
            Box::new(|m| m.server.cert = not_pem.clone()),
            format!("--internal-tls-cert {}: ", not_pem.display()),
        ),
        (
            "a key file that is not a key",
            Box::new(|m| m.server.key = secret_key.clone()),
            format!("--internal-tls-key {}: ", secret_key.display()),
        ),
        (
            "a key that does not belong to the certificate",
            Box::new(|m| m.server.cert = other_cert.clone()),
            format!(
                "--internal-tls-cert {}: unusable with --internal-tls-key",
                other_cert.display()
            ),
        ),
    ];
    for (what, adjust, expected) in cases {
        let err = match start(&*adjust).await {
            Ok(_) => panic!("{what}: started"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains(&expected), "{what}: {err}");
        assert!(!err.contains("S3CRETKEYMATERIAL"), "{what}: {err}");
    }
    // The untouched PKI starts (the cases above fail for their file, not for the setup).
    assert!(start(&|_| {}).await.is_ok());
}

/// Issues the internal PKI into `dir` as `scripts/deploy.sh` does (namespace `team-maas`).
fn issue_internal_pki(root: &std::path::Path, dir: &std::path::Path) {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(
            r#"set -e; source "$1/scripts/deploy.sh"; DEPLOYMENT_NAMESPACE=team-maas; issue_internal_pki "$2""#,
        )
        .arg("issue")
        .arg(root)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `MAAS_INTERNAL_CLIENT_NAMES` of the shipped companion Deployment.
fn shipped_internal_client_names(root: &std::path::Path) -> String {
    let deployment: Value = yaml_serde::from_str(
        &std::fs::read_to_string(root.join("wasm-plugin-crs/base/companion/deployment.yaml"))
            .unwrap(),
    )
    .unwrap();
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "MAAS_INTERNAL_CLIENT_NAMES")
        .and_then(|e| e["value"].as_str())
        .unwrap()
        .to_string()
}

/// The certificates `scripts/deploy.sh` issues (openssl, a private CA) work with the companion
/// as the shipped Deployment configures it: the Gateway's client certificate gets answers, the
/// key cleanup job's `curl` (the CronJob's command) too, both checking the companion's
/// certificate for `maas-companion.<ns>.svc`; the companion's own certificate is no client one.
#[tokio::test]
async fn the_certificates_deploy_sh_issues_admit_the_gateway_and_the_cleanup_job() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let pki = tempfile::tempdir().unwrap();
    issue_internal_pki(&root, pki.path());
    let file = |name: &str| pki.path().join(name);
    assert!(!file("ca.key").exists(), "the CA's key is not kept");

    // The allowed callers as the shipped Deployment names them.
    let names = shipped_internal_client_names(&root);
    let app = spawn_app_with(|s| {
        s.listeners.internal_auth =
            maas_companion::settings::InternalAuth::Mtls(maas_companion::settings::InternalMtls {
                server: maas_companion::settings::TlsFiles {
                    cert: file("server.crt"),
                    key: file("server.key"),
                },
                server_flags: ("--internal-tls-cert", "--internal-tls-key"),
                client_ca: file("server.ca"),
                client_names: names
                    .split(',')
                    .map(|n| maas_companion::settings::ClientName::Uri(n.to_string()))
                    .collect(),
            });
    })
    .await;
    let addr = app.app.internal_addr();
    let host = "maas-companion.team-maas.svc";
    let url = |path: &str| format!("https://{host}:{}{path}", addr.port());
    let client = |identity: Option<(&str, &str)>| {
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .resolve(host, addr)
            .add_root_certificate(
                reqwest::Certificate::from_pem(&std::fs::read(file("gateway.ca")).unwrap())
                    .unwrap(),
            );
        if let Some((cert, key)) = identity {
            let mut pem = std::fs::read(file(cert)).unwrap();
            pem.extend(std::fs::read(file(key)).unwrap());
            b = b.identity(reqwest::Identity::from_pem(&pem).unwrap());
        }
        b.build().unwrap()
    };
    let r = client(Some(("gateway.crt", "gateway.key")))
        .get(url("/internal/v1/credentials"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains(PROVIDER_KEY));
    for refused in [None, Some(("server.crt", "server.key"))] {
        let r = client(refused)
            .get(url("/internal/v1/credentials"))
            .send()
            .await;
        assert!(r.is_err(), "{refused:?}: {r:?}");
    }

    // The CronJob's curl, with the cleanup job's Secret's three files.
    let cronjob =
        std::fs::read_to_string(root.join("wasm-plugin-crs/base/companion/cleanup-cronjob.yaml"))
            .unwrap();
    assert!(
        cronjob.contains("--cert /etc/maas/internal-client/tls.crt"),
        "{cronjob}"
    );
    // Run beside the runtime: the companion answers on this test's own (single) thread.
    let mut command = std::process::Command::new("curl");
    command
        .args([
            "--fail",
            "--silent",
            "--show-error",
            "--max-time",
            "60",
            "-X",
            "POST",
        ])
        .arg("--cacert")
        .arg(file("cleanup.ca"))
        .arg("--cert")
        .arg(file("cleanup.crt"))
        .arg("--key")
        .arg(file("cleanup.key"))
        .arg("--resolve")
        .arg(format!("{host}:{}:127.0.0.1", addr.port()))
        .arg(url("/internal/v1/api-keys/cleanup"));
    let curl = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .expect("curl (the cleanup job's client) is installed");
    assert!(
        curl.status.success(),
        "{}",
        String::from_utf8_lossy(&curl.stderr)
    );
}
