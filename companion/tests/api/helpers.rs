//! Test harness: a fresh PostgreSQL database per test and the companion in-process on port 0.
//!
//! Needs `MAAS_TEST_DATABASE_URL` (an admin URL to a running server); `./scripts/test.sh`
//! starts one and exports it.

use clap::Parser;
use maas_companion::{Application, Cli, Settings};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};
use std::path::Path;
use std::path::PathBuf;
use std::sync::OnceLock;
use tempfile::TempDir;

pub const IDENTITIES: &str = "\
identities:
  - token: alice-token
    username: alice
    groups: [system:authenticated, tier-free-users]
  - token: bob-token
    username: bob
    groups: [system:authenticated, tier-premium-users]
  - token: carol-token
    username: carol
    groups: [system:authenticated, tier-enterprise-users, maas-admins]
  - token: dave-token
    username: dave
    groups: [no-tier-group]
";

/// The gateway's identity on the internal listener in these tests: a URI subject alternative
/// name of its client certificate, as the mesh would name the Gateway's service account.
pub const GATEWAY_NAME: &str =
    "spiffe://cluster.local/ns/openshift-ingress/sa/maas-default-gateway-openshift-default";

/// A throwaway PKI for the internal listener's mutual TLS: a CA, the listener's certificate
/// (127.0.0.1 and localhost) and, issued on demand, client certificates.
pub struct InternalPki {
    _dir: TempDir,
    /// The CA certificate (PEM file): `--internal-client-ca`.
    pub ca: PathBuf,
    pub ca_pem: String,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// The gateway's client certificate and key (one PEM, a reqwest identity).
    pub gateway_identity: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

/// A CA: its certificate (PEM) and the issuer that signs with it.
pub fn new_ca(name: &str) -> (String, rcgen::Issuer<'static, rcgen::KeyPair>) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), rcgen::Issuer::new(params, key))
}

/// A leaf certificate and its key (PEM) from `issuer`, for `sans` (`scheme://…` as URIs,
/// addresses as IPs, the rest as DNS names), for a client or a server.
pub fn issue(
    issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
    sans: &[&str],
    client: bool,
) -> (String, String) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = sans
        .iter()
        .map(|san| {
            if san.contains("://") {
                rcgen::SanType::URI(rcgen::string::Ia5String::try_from(*san).unwrap())
            } else if let Ok(ip) = san.parse() {
                rcgen::SanType::IpAddress(ip)
            } else {
                rcgen::SanType::DnsName(rcgen::string::Ia5String::try_from(*san).unwrap())
            }
        })
        .collect();
    params.extended_key_usages = vec![if client {
        rcgen::ExtendedKeyUsagePurpose::ClientAuth
    } else {
        rcgen::ExtendedKeyUsagePurpose::ServerAuth
    }];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl InternalPki {
    fn new() -> InternalPki {
        let dir = tempfile::tempdir().unwrap();
        let (ca_pem, issuer) = new_ca("maas-internal test CA");
        let (server_pem, server_key_pem) = issue(&issuer, &["127.0.0.1", "localhost"], false);
        let (gateway_pem, gateway_key) = issue(&issuer, &[GATEWAY_NAME], true);
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        InternalPki {
            ca: write("ca.crt", &ca_pem),
            server_cert: write("tls.crt", &server_pem),
            server_key: write("tls.key", &server_key_pem),
            ca_pem,
            gateway_identity: format!("{gateway_pem}{gateway_key}"),
            issuer,
            _dir: dir,
        }
    }

    /// A client certificate from this CA naming `sans` (one PEM with its key).
    pub fn client_identity(&self, sans: &[&str]) -> String {
        let (cert, key) = issue(&self.issuer, sans, true);
        format!("{cert}{key}")
    }

    /// The companion's flags for this PKI (the gateway is the one allowed caller).
    pub fn args(&self) -> Vec<String> {
        vec![
            format!("--internal-client-ca={}", self.ca.display()),
            format!("--internal-tls-cert={}", self.server_cert.display()),
            format!("--internal-tls-key={}", self.server_key.display()),
            format!("--internal-client-names={GATEWAY_NAME}"),
        ]
    }

    /// The same as environment variables (for the binary).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("MAAS_INTERNAL_CLIENT_CA", self.ca.display().to_string()),
            (
                "MAAS_INTERNAL_TLS_CERT",
                self.server_cert.display().to_string(),
            ),
            (
                "MAAS_INTERNAL_TLS_KEY",
                self.server_key.display().to_string(),
            ),
            ("MAAS_INTERNAL_CLIENT_NAMES", GATEWAY_NAME.to_string()),
        ]
    }

    /// A client trusting this CA, presenting `identity` (a PEM certificate and key) if any.
    pub fn client(&self, identity: Option<&str>) -> reqwest::Client {
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(self.ca_pem.as_bytes()).unwrap());
        if let Some(identity) = identity {
            b = b.identity(reqwest::Identity::from_pem(identity.as_bytes()).unwrap());
        }
        b.build().unwrap()
    }

    /// The gateway's client: what these tests call the internal listener with.
    pub fn gateway_client(&self) -> reqwest::Client {
        self.client(Some(&self.gateway_identity))
    }
}

/// One PKI per test binary.
pub fn internal_pki() -> &'static InternalPki {
    static PKI: OnceLock<InternalPki> = OnceLock::new();
    PKI.get_or_init(InternalPki::new)
}

/// The settings of an in-process companion, parsed from flags as the binary does: static
/// identities, file credentials, every listener on 127.0.0.1 port 0, short intervals, the
/// internal listener behind mutual TLS ([`internal_pki`]).
pub fn local_settings(
    database_url: &str,
    policy_file: &Path,
    identities_file: &Path,
    credentials_file: &Path,
) -> Settings {
    let path = |p: &Path| p.to_str().unwrap().to_string();
    Cli::try_parse_from(
        [
            "maas-companion".to_string(),
            format!("--database-url={database_url}"),
            "--db-max-connections=10".into(),
            "--db-acquire-timeout-ms=1000".into(),
            "--public-addr=127.0.0.1:0".into(),
            "--internal-addr=127.0.0.1:0".into(),
            "--metrics-addr=127.0.0.1:0".into(),
            format!("--policy-file={}", path(policy_file)),
            "--policy-reload-interval-ms=200".into(),
            "--identity-provider=static".into(),
            format!("--identities-file={}", path(identities_file)),
            "--credentials-source=file".into(),
            format!("--credentials-file={}", path(credentials_file)),
        ]
        .into_iter()
        .chain(internal_pki().args()),
    )
    .unwrap()
    .into_settings()
    .unwrap()
}

pub fn local_policy() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/local/policy.yaml");
    std::fs::read_to_string(path).expect("config/local/policy.yaml")
}

pub fn admin_url() -> String {
    match std::env::var("MAAS_TEST_DATABASE_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => panic!(
            "MAAS_TEST_DATABASE_URL is not set. These tests need a running PostgreSQL: run them with \
             ./scripts/test.sh (it starts a throwaway server and exports the variable), or export \
             MAAS_TEST_DATABASE_URL=postgres://USER@HOST:PORT/postgres yourself."
        ),
    }
}

/// The admin URL with its database name replaced.
pub fn url_for_db(admin: &str, db: &str) -> String {
    let (base, query) = match admin.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (admin, String::new()),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let authority_end = base[scheme_end..]
        .find('/')
        .map(|i| scheme_end + i)
        .unwrap_or(base.len());
    format!("{}/{db}{query}", &base[..authority_end])
}

pub async fn create_database() -> String {
    let name = format!("maas_test_{}", uuid::Uuid::new_v4().simple());
    create_named_database(&name).await
}

pub async fn create_named_database(name: &str) -> String {
    let admin = admin_url();
    let mut conn = PgConnection::connect(&admin)
        .await
        .expect("connect to MAAS_TEST_DATABASE_URL");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .expect("create test database");
    url_for_db(&admin, name)
}

fn init_tracing() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var("TEST_LOG").is_ok() {
            tracing_subscriber::fmt()
                .with_env_filter("info,sqlx=warn")
                .with_test_writer()
                .init();
        }
    });
}

pub struct TestApp {
    pub app: Application,
    pub public: String,
    /// `https://…`: behind mutual TLS; [`TestApp::http`] presents the gateway's certificate.
    pub internal: String,
    /// The metrics listener (`/metrics` and `/health` only).
    pub metrics: String,
    /// Presents the gateway's client certificate to the internal listener (plain HTTP elsewhere).
    pub http: reqwest::Client,
    pub pool: PgPool,
    /// Holds the policy, identities and credentials files for the app's lifetime.
    pub _dir: TempDir,
    pub policy_path: PathBuf,
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

pub async fn spawn_app_with(adjust: impl FnOnce(&mut Settings)) -> TestApp {
    let database_url = create_database().await;
    spawn_app_on(database_url, adjust).await
}

/// The app over an existing database (e.g. one a test prepared at an older migration).
pub async fn spawn_app_on(database_url: String, adjust: impl FnOnce(&mut Settings)) -> TestApp {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let policy_path = dir.path().join("policy.yaml");
    let identities = dir.path().join("identities.yaml");
    let credentials = dir.path().join("credentials.yaml");
    std::fs::write(&policy_path, local_policy()).unwrap();
    std::fs::write(&identities, IDENTITIES).unwrap();
    std::fs::write(&credentials, "credentials: {openai-key: sk-local-openai}\n").unwrap();
    let mut config = local_settings(&database_url, &policy_path, &identities, &credentials);
    adjust(&mut config);
    spawn_with_config(config, dir, policy_path, database_url, Default::default()).await
}

pub async fn spawn_with_config(
    config: Settings,
    dir: TempDir,
    policy_path: PathBuf,
    database_url: String,
    overrides: maas_companion::Overrides,
) -> TestApp {
    let internal_scheme = match config.listeners.internal_auth {
        maas_companion::settings::InternalAuth::Mtls(_) => "https",
        maas_companion::settings::InternalAuth::None => "http",
    };
    let app = Application::build_with(config, overrides)
        .await
        .expect("companion starts");
    let public = format!("http://{}", app.public_addr());
    let internal = format!("{internal_scheme}://{}", app.internal_addr());
    let metrics = format!("http://{}", app.metrics_addr());
    let pool = PgPool::connect(&database_url).await.unwrap();
    TestApp {
        app,
        public,
        internal,
        metrics,
        http: internal_pki().gateway_client(),
        pool,
        _dir: dir,
        policy_path,
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Reply {
    async fn from(r: reqwest::Response) -> Reply {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply {
            status,
            headers,
            body,
        }
    }

    /// The error message of an OpenAI-style error body.
    pub fn message(&self) -> &str {
        self.body["error"]["message"].as_str().unwrap_or_default()
    }

    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
}

impl TestApp {
    pub async fn public_get(&self, path: &str, token: Option<&str>) -> Reply {
        let mut r = self.http.get(format!("{}{path}", self.public));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        Reply::from(r.send().await.unwrap()).await
    }

    pub async fn public_post(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        let mut r = self.http.post(format!("{}{path}", self.public)).json(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        Reply::from(r.send().await.unwrap()).await
    }

    pub async fn public_delete(&self, path: &str, token: Option<&str>) -> Reply {
        let mut r = self.http.delete(format!("{}{path}", self.public));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        Reply::from(r.send().await.unwrap()).await
    }

    pub async fn internal_get(&self, path: &str) -> Reply {
        Reply::from(
            self.http
                .get(format!("{}{path}", self.internal))
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    pub async fn internal_post(&self, path: &str, body: &Value) -> Reply {
        Reply::from(
            self.http
                .post(format!("{}{path}", self.internal))
                .json(body)
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    pub async fn authenticate(&self, credential: &str) -> Reply {
        self.internal_post(
            "/internal/v1/authenticate",
            &json!({"credential": credential}),
        )
        .await
    }

    /// Mints a key and returns the 201 body (panics otherwise).
    pub async fn mint(&self, token: &str, body: Value) -> Value {
        let r = self.public_post("/v1/api-keys", Some(token), &body).await;
        assert_eq!(r.status, 201, "mint failed: {}", r.body);
        r.body
    }

    pub async fn mint_named(&self, token: &str, name: &str) -> Value {
        self.mint(token, json!({"name": name})).await
    }

    /// `GET /metrics` on the metrics listener: the exposition text (panics unless 200).
    pub async fn scrape(&self) -> String {
        let r = self
            .http
            .get(format!("{}/metrics", self.metrics))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "GET /metrics on the metrics listener");
        r.text().await.unwrap()
    }

    /// A counter's value from `GET /metrics` (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.scrape().await;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.strip_prefix(' '))
            })
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0.0)
    }
}

/// Replaces a file the way a ConfigMap update does: write aside, then rename (so the reloader
/// never reads a half-written file).
pub fn write_atomic(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
