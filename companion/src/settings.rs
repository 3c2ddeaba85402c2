//! Configuration: the command line (every flag also from the environment, docs/contracts.md
//! lists the names) parsed and checked ONCE into typed [`Settings`].
//!
//! [`Cli`] is what clap reads; [`Cli::into_settings`] applies the rules clap cannot express
//! (required-when, ranges, files that must exist) and answers either a [`Settings`] whose
//! required values are present by construction, or a message naming the flag. Nothing
//! downstream re-validates or unwraps an `Option` that "cannot be None".

use clap::{Parser, ValueEnum};
use secrecy::{ExposeSecret, SecretString};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IdentityProviderKind {
    /// Kubernetes / OpenShift tokens checked with a TokenReview (production).
    Kubernetes,
    /// A static file of tokens → user and groups (local stack and tests).
    Static,
    /// OIDC JWTs verified locally against the issuer's JWKS.
    Oidc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CredentialsSourceKind {
    /// Kubernetes Secrets named by the policy's `credentialRef`, key `api-key`.
    Kubernetes,
    /// A YAML file `credentials: {ref: key}` (local stack).
    File,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicySourceKind {
    /// The YAML policy file (the ConfigMap), reloaded when it changes.
    File,
    /// The reference's resources (MaaSModelRef, ExternalModel, MaaSAuthPolicy,
    /// MaaSSubscription) through kube watches, over the policy file's tiers when given.
    Kubernetes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InternalAuthKind {
    /// Mutual TLS: a caller must present a client certificate that chains to
    /// `--internal-client-ca` (and, with `--internal-client-names`, names one of them).
    Mtls,
    /// Whoever reaches the port (the NetworkPolicy alone). Development only.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogUserNames {
    Hmac,
    Clear,
}

/// The pseudonyms' key: the file's bytes (trailing whitespace trimmed; at least 32 bytes), or a
/// random key.
fn pseudonym_key(
    key_file: Option<PathBuf>,
) -> Result<std::sync::Arc<secrecy::SecretSlice<u8>>, String> {
    let Some(path) = key_file else {
        return Ok(crate::pseudonym::random_key());
    };
    let bytes = std::fs::read(&path)
        .map_err(|e| format!("--log-pseudonym-key-file {}: {e}", path.display()))?;
    let key = bytes.trim_ascii_end().to_vec();
    if key.len() < 32 {
        return Err(format!(
            "--log-pseudonym-key-file {}: the key must be at least 32 bytes",
            path.display()
        ));
    }
    Ok(std::sync::Arc::new(secrecy::SecretSlice::from(key)))
}

/// The logs' pseudonyms: clear names, or keyed by `key`.
fn log_pseudonyms(
    names: LogUserNames,
    key: &std::sync::Arc<secrecy::SecretSlice<u8>>,
) -> crate::pseudonym::Pseudonyms {
    use crate::pseudonym::Pseudonyms;
    match names {
        LogUserNames::Clear => Pseudonyms::Clear,
        LogUserNames::Hmac => Pseudonyms::Keyed(key.clone()),
    }
}

/// The command line as clap reads it. Turn it into [`Settings`] with [`Cli::into_settings`].
#[derive(Debug, Clone, Parser)]
#[command(
    name = "maas-companion",
    version,
    about = "MaaS Gateway companion service"
)]
pub struct Cli {
    /// PostgreSQL URL (postgres://…).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<SecretString>,
    /// Alternative name for the database URL, as the reference deployment's Secret spells it.
    #[arg(
        long = "db-connection-url",
        env = "DB_CONNECTION_URL",
        hide = true,
        hide_env_values = true
    )]
    pub db_connection_url: Option<SecretString>,
    #[arg(long, env = "DB_MAX_CONNECTIONS", default_value_t = 25)]
    pub db_max_connections: u32,
    /// How long a request waits for a database connection before answering 503.
    #[arg(long, env = "DB_ACQUIRE_TIMEOUT_MS", default_value_t = 1500)]
    pub db_acquire_timeout_ms: u64,
    #[arg(long, env = "MAAS_PUBLIC_ADDR", default_value = "0.0.0.0:8080")]
    pub public_addr: SocketAddr,
    #[arg(long, env = "MAAS_INTERNAL_ADDR", default_value = "0.0.0.0:8081")]
    pub internal_addr: SocketAddr,
    /// Serves `GET /metrics` (and `/health`) only, for Prometheus: kept apart from the internal
    /// listener, whose provider credentials no scraper may reach.
    #[arg(long, env = "MAAS_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,
    #[arg(long, env = "MAAS_POLICY_FILE")]
    pub policy_file: Option<PathBuf>,
    #[arg(long, env = "MAAS_POLICY_RELOAD_INTERVAL_MS", default_value_t = 2000)]
    pub policy_reload_interval_ms: u64,
    /// Where the policy comes from. `kubernetes`: the reference's resources (the policy file,
    /// optional then, gives the tiers and defaults).
    #[arg(long, env = "MAAS_POLICY_SOURCE", value_enum, default_value = "file")]
    pub policy_source: PolicySourceKind,
    /// With `--policy-source kubernetes`: the namespace of the MaaSSubscriptions and
    /// MaaSAuthPolicies (MaaSModelRefs and ExternalModels are read in all namespaces).
    #[arg(
        long,
        env = "MAAS_POLICY_NAMESPACE",
        default_value = maas_types::subscription::DEFAULT_NAMESPACE
    )]
    pub policy_namespace: String,
    /// With `--policy-source kubernetes`: write the resources' `status` (phase, conditions) as
    /// the reference's controller does. Only where no maas-controller runs: two writers of
    /// one `status` would fight.
    #[arg(long, env = "MAAS_WRITE_STATUS")]
    pub write_status: bool,
    #[arg(
        long,
        env = "MAAS_IDENTITY_PROVIDER",
        value_enum,
        default_value = "kubernetes"
    )]
    pub identity_provider: IdentityProviderKind,
    #[arg(long, env = "MAAS_IDENTITIES_FILE")]
    pub identities_file: Option<PathBuf>,
    /// TokenReview audiences (comma separated); empty = the API server's default.
    #[arg(long, env = "MAAS_TOKEN_AUDIENCES", value_delimiter = ',')]
    pub token_audiences: Vec<String>,
    /// OIDC issuer. With `oidc`: the only provider. With `kubernetes`: JWTs from this issuer
    /// are verified locally, other tokens by TokenReview.
    #[arg(long, env = "MAAS_OIDC_ISSUER")]
    pub oidc_issuer: Option<String>,
    #[arg(long, env = "MAAS_OIDC_AUDIENCE")]
    pub oidc_audience: Option<String>,
    /// The OIDC issuer's JWKS URL (required with `oidc`).
    #[arg(long, env = "MAAS_OIDC_JWKS_URL")]
    pub oidc_jwks_url: Option<String>,
    /// Claim holding the OIDC user's groups.
    #[arg(long, env = "MAAS_OIDC_GROUPS_CLAIM", default_value = "groups")]
    pub oidc_groups_claim: String,
    #[arg(
        long,
        env = "MAAS_CREDENTIALS_SOURCE",
        value_enum,
        default_value = "kubernetes"
    )]
    pub credentials_source: CredentialsSourceKind,
    #[arg(long, env = "MAAS_CREDENTIALS_FILE")]
    pub credentials_file: Option<PathBuf>,
    /// Namespace of the provider credential Secrets (default: the pod's namespace).
    #[arg(long, env = "MAAS_CREDENTIALS_NAMESPACE")]
    pub credentials_namespace: Option<String>,
    /// Microsoft Entra's authority for `auth: azureClientCredentials` (the token endpoint is
    /// `{authority}/{tenant}/oauth2/v2.0/token`); another cloud's, or a test's.
    #[arg(
        long,
        env = "MAAS_AZURE_AUTHORITY_URL",
        default_value = "https://login.microsoftonline.com"
    )]
    pub azure_authority_url: String,
    /// Workload identity federation (`credential-config.json`): the only Google STS token
    /// endpoint the pod's token is sent to.
    #[arg(
        long,
        env = "MAAS_GCP_STS_URL",
        default_value = "https://sts.googleapis.com/v1/token"
    )]
    pub gcp_sts_url: String,
    /// The IAM Credentials API a federation configuration may impersonate through.
    #[arg(
        long,
        env = "MAAS_GCP_IAM_CREDENTIALS_URL",
        default_value = "https://iamcredentials.googleapis.com"
    )]
    pub gcp_iam_credentials_url: String,
    /// The only directory a federation configuration's token file may be read from (the
    /// projected service-account token's volume).
    #[arg(
        long,
        env = "MAAS_GCP_SUBJECT_TOKEN_DIR",
        default_value = "/var/run/secrets/tokens"
    )]
    pub gcp_subject_token_dir: PathBuf,
    #[arg(
        long,
        env = "MAAS_ADMIN_GROUPS",
        value_delimiter = ',',
        default_value = "maas-admins"
    )]
    pub admin_groups: Vec<String>,
    /// Also admin: whoever a SubjectAccessReview allows to `--admin-sar-verb` the
    /// `--admin-sar-resource` in this namespace (needs the Kubernetes API). Unset: groups only.
    #[arg(long, env = "MAAS_ADMIN_SAR_NAMESPACE")]
    pub admin_sar_namespace: Option<String>,
    /// `resource.group` checked by the admin SubjectAccessReview.
    #[arg(
        long,
        env = "MAAS_ADMIN_SAR_RESOURCE",
        default_value = "maasauthpolicies.maas.opendatahub.io"
    )]
    pub admin_sar_resource: String,
    #[arg(long, env = "MAAS_ADMIN_SAR_VERB", default_value = "create")]
    pub admin_sar_verb: String,
    #[arg(long, env = "API_KEY_MAX_EXPIRATION_DAYS", default_value_t = 90)]
    pub api_key_max_expiration_days: u32,
    #[arg(long, env = "MAAS_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "MAAS_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Who may call the internal listener (provider credentials, usage, leases, authenticate,
    /// policy). `mtls`: only a caller whose client certificate chains to
    /// `--internal-client-ca`; `none`: whoever reaches the port (development only).
    #[arg(long, env = "MAAS_INTERNAL_AUTH", value_enum, default_value = "mtls")]
    pub internal_auth: InternalAuthKind,
    /// PEM file of the CA certificates a caller's client certificate must chain to
    /// (`--internal-auth mtls`).
    #[arg(long, env = "MAAS_INTERNAL_CLIENT_CA")]
    pub internal_client_ca: Option<PathBuf>,
    /// The callers allowed on the internal listener, by a subject alternative name of their
    /// client certificate (comma separated): a URI (`spiffe://…`) or a DNS name. Empty: any
    /// certificate from `--internal-client-ca`.
    #[arg(long, env = "MAAS_INTERNAL_CLIENT_NAMES", value_delimiter = ',')]
    pub internal_client_names: Vec<String>,
    /// The internal listener's own certificate (PEM chain); default `--tls-cert`.
    #[arg(long, env = "MAAS_INTERNAL_TLS_CERT")]
    pub internal_tls_cert: Option<PathBuf>,
    /// The internal listener's private key (PEM); default `--tls-key`.
    #[arg(long, env = "MAAS_INTERNAL_TLS_KEY")]
    pub internal_tls_key: Option<PathBuf>,
    /// Log lines on stderr as text or JSON (level from RUST_LOG, default info).
    #[arg(long, env = "MAAS_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// How users are named in the logs: `hmac` (keyed pseudonyms `u-…`) or `clear`.
    #[arg(long, env = "MAAS_LOG_USER_NAMES", value_enum, default_value = "hmac")]
    pub log_user_names: LogUserNames,
    /// The pseudonyms' key: a file of at least 32 bytes (a Secret; a new key rotates every
    /// pseudonym). Unset: a random key at each start. Also keys the pseudonym of the
    /// authenticate answer and the spans, which is keyed even with clear names in the logs.
    #[arg(long, env = "MAAS_LOG_PSEUDONYM_KEY_FILE")]
    pub log_pseudonym_key_file: Option<PathBuf>,
    /// Where the companion's spans go: an OTLP/HTTP (protobuf) traces endpoint, e.g.
    /// `http://otel-collector:4318/v1/traces`. Unset: no trace export (no exporter at all).
    #[arg(long, env = "MAAS_OTLP_TRACES_ENDPOINT")]
    pub otlp_traces_endpoint: Option<String>,
    /// The share of new traces sampled (0 to 1); a caller's sampling decision is followed.
    #[arg(long, env = "MAAS_OTLP_TRACE_SAMPLE_RATIO", default_value_t = 1.0)]
    pub otlp_trace_sample_ratio: f64,
    /// How long the filter may cache a positive API key answer.
    #[arg(long, env = "MAAS_KEY_CACHE_TTL_SECONDS", default_value_t = 60)]
    pub key_cache_ttl_seconds: u64,
    /// How long a successful token check is cached (here and by the filter).
    #[arg(long, env = "MAAS_TOKEN_CACHE_TTL_SECONDS", default_value_t = 30)]
    pub token_cache_ttl_seconds: u64,
    /// How long a refused token is cached here.
    #[arg(
        long,
        env = "MAAS_TOKEN_NEGATIVE_CACHE_TTL_SECONDS",
        default_value_t = 5
    )]
    pub token_negative_cache_ttl_seconds: u64,
    /// At most one `last_used_at` write per key per this interval.
    #[arg(
        long,
        env = "MAAS_LAST_USED_FLUSH_INTERVAL_MS",
        default_value_t = 10_000
    )]
    pub last_used_flush_interval_ms: u64,
    /// The self-service web UI's build (`ui/dist`, with `index.html`), served at `/ui/` on the
    /// public listener. Unset: `/ui/` answers 404 `ui_not_installed`.
    #[arg(long, env = "MAAS_UI_DIR")]
    pub ui_dir: Option<PathBuf>,
    /// The Gateway's public base URL (`https://maas.apps.example.com`): `GET /v1/models` gives
    /// each model's `url` under it. Unset: no `url` (a request's `Host` is never used: anyone
    /// can forge it).
    #[arg(long, env = "MAAS_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// How long a model server's probe answer (`ready` in `GET /v1/models`) is reused.
    #[arg(long, env = "MAAS_MODEL_READY_TTL_MS", default_value_t = 10_000)]
    pub model_ready_ttl_ms: u64,
    /// How long a model server's probe may take before the model shows `ready: false` (a
    /// listing waits at most this long).
    #[arg(long, env = "MAAS_MODEL_PROBE_TIMEOUT_MS", default_value_t = 2_000)]
    pub model_probe_timeout_ms: u64,
    /// Where the models with `backend: simulator` run (the local stack's simulator), for their
    /// readiness probe. Unset: they are not probed and show `ready: false`.
    #[arg(long, env = "MAAS_SIMULATOR_URL")]
    pub simulator_url: Option<String>,
    /// Redis holding the budget-lease counters (`redis://` or `rediss://` for TLS; user and
    /// password in the URL). Unset: the counters live in this process (one companion only).
    #[arg(long, env = "MAAS_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<SecretString>,
    /// How long one Redis call may take before the lease endpoint answers 503.
    #[arg(long, env = "MAAS_REDIS_TIMEOUT_MS", default_value_t = 500)]
    pub redis_timeout_ms: u64,
    /// Usage ledger: hourly rows older than this many days are rolled up into daily rows.
    #[arg(long, env = "MAAS_USAGE_HOURLY_RETENTION_DAYS", default_value_t = 31)]
    pub usage_hourly_retention_days: u32,
    /// How often the usage rollup runs (also once at start).
    #[arg(
        long,
        env = "MAAS_USAGE_ROLLUP_INTERVAL_MS",
        default_value_t = 3_600_000
    )]
    pub usage_rollup_interval_ms: u64,
    /// Adds a `user` label to the `maas_companion_usage_*` series (capped by
    /// `--usage-metrics-max-users`).
    #[arg(long, env = "MAAS_USAGE_METRICS_PER_USER")]
    pub usage_metrics_per_user: bool,
    /// With `--usage-metrics-per-user`: distinct users labelled at most; later ones are
    /// `user="other"`.
    #[arg(long, env = "MAAS_USAGE_METRICS_MAX_USERS", default_value_t = 1000)]
    pub usage_metrics_max_users: u32,
    /// Where quota warnings are POSTed (`https://…`; `http://` only to a loopback address or
    /// inside a mesh that encrypts it): one signed event per window per `warnAt` threshold.
    /// Unset: no webhook (no task, no cost).
    #[arg(long, env = "MAAS_QUOTA_WEBHOOK_URL", hide_env_values = true)]
    pub quota_webhook_url: Option<SecretString>,
    /// The webhook's signing secret: a file of at least 32 bytes (a Secret). Required with
    /// `--quota-webhook-url`.
    #[arg(long, env = "MAAS_QUOTA_WEBHOOK_SECRET_FILE")]
    pub quota_webhook_secret_file: Option<PathBuf>,
    /// How long one delivery attempt may take (connect and answer).
    #[arg(long, env = "MAAS_QUOTA_WEBHOOK_TIMEOUT_MS", default_value_t = 5000)]
    pub quota_webhook_timeout_ms: u64,
    /// Delivery attempts of one event at most; then it is dead.
    #[arg(long, env = "MAAS_QUOTA_WEBHOOK_MAX_ATTEMPTS", default_value_t = 8)]
    pub quota_webhook_max_attempts: u32,
    /// Undelivered events kept at most (all companions together); beyond, the oldest are
    /// dropped and counted.
    #[arg(long, env = "MAAS_QUOTA_WEBHOOK_MAX_PENDING", default_value_t = 10_000)]
    pub quota_webhook_max_pending: u32,
}

/// The configuration, checked: required values are present, ranges hold, named files exist.
#[derive(Debug, Clone)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub listeners: ListenerSettings,
    pub policy: PolicySettings,
    pub identity: IdentitySettings,
    pub credentials: CredentialsSettings,
    /// `--azure-authority-url`, an http(s) URL.
    pub azure_authority_url: String,
    /// `--gcp-sts-url`, `--gcp-iam-credentials-url`, `--gcp-subject-token-dir`.
    pub gcp_federation: crate::cloud_tokens::gcp_federation::GcpFederation,
    pub keys: KeySettings,
    pub leases: LeaseSettings,
    pub usage: UsageSettings,
    pub model_probe: ModelProbeSettings,
    pub log_format: LogFormat,
    /// How users are named in the logs.
    pub log_pseudonyms: crate::pseudonym::Pseudonyms,
    /// The key of the pseudonyms outside the logs (authenticate answer, spans): always keyed.
    pub pseudonym_key: std::sync::Arc<secrecy::SecretSlice<u8>>,
    /// The quota-warning webhook; `None`: off.
    pub quota_webhook: Option<QuotaWebhookSettings>,
    pub traces: TraceSettings,
}

/// The companion's trace export.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// An http(s) URL; `None`: no export.
    pub endpoint: Option<String>,
    /// In `0..=1`.
    pub sample_ratio: f64,
}

/// Checks the trace flags: an http(s) endpoint with a host, a ratio in `0..=1`.
fn trace_settings(endpoint: Option<&str>, ratio: f64) -> Result<TraceSettings, String> {
    if !(0.0..=1.0).contains(&ratio) {
        return Err(format!(
            "--otlp-trace-sample-ratio {ratio}: expected a number from 0 to 1"
        ));
    }
    let endpoint = match endpoint.map(str::trim).filter(|e| !e.is_empty()) {
        None => None,
        Some(e) => {
            let rest = e
                .strip_prefix("http://")
                .or_else(|| e.strip_prefix("https://"));
            match rest {
                Some(r) if !r.is_empty() && !r.starts_with('/') => Some(e.to_string()),
                _ => {
                    return Err(format!(
                        "--otlp-traces-endpoint {e}: expected an http(s) URL such as http://collector:4318/v1/traces"
                    ));
                }
            }
        }
    };
    Ok(TraceSettings {
        endpoint,
        sample_ratio: ratio,
    })
}

/// The quota-warning webhook (`--quota-webhook-*`), checked.
#[derive(Debug, Clone)]
pub struct QuotaWebhookSettings {
    /// An absolute `http(s)` URL with a host and no fragment (it may hold a token: never logged).
    pub url: SecretString,
    /// `scheme://host:port` only: what logs may show.
    pub endpoint: String,
    /// At least 32 bytes; never logged.
    pub secret: std::sync::Arc<secrecy::SecretSlice<u8>>,
    /// One attempt's limit (connect and answer); at least 1 ms.
    pub timeout: Duration,
    /// At least 1.
    pub max_attempts: u32,
    /// At least 1.
    pub max_pending: u32,
    /// The first retry's delay (doubled at each attempt, jittered); not a flag (tests lower it).
    pub retry_base: Duration,
    /// The longest delay between two attempts (a `Retry-After` may ask for more, up to
    /// [`MAX_RETRY_AFTER`]).
    pub retry_max: Duration,
    /// How often a companion looks for events due (its own are sent at once).
    pub poll_interval: Duration,
}

/// The longest `Retry-After` a receiver is granted.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Checks the webhook flags: the URL (`https://`, or `http://` — a warning at start unless to a
/// loopback address), the secret file (required with the URL, at least 32 bytes, trailing
/// whitespace trimmed), the bounds. The messages name the flag, never the URL or the secret.
fn quota_webhook_settings(
    url: Option<SecretString>,
    secret_file: Option<PathBuf>,
    timeout_ms: u64,
    max_attempts: u32,
    max_pending: u32,
) -> Result<Option<QuotaWebhookSettings>, String> {
    const BAD: &str = "--quota-webhook-url (MAAS_QUOTA_WEBHOOK_URL) must be an https:// (or http://) URL with a host and no fragment";
    let Some(url) = url else {
        if secret_file.is_some() {
            return Err("--quota-webhook-secret-file applies only with --quota-webhook-url".into());
        }
        return Ok(None);
    };
    let parsed = reqwest::Url::parse(url.expose_secret().trim()).map_err(|_| BAD.to_string())?;
    let ok = matches!(parsed.scheme(), "http" | "https")
        && parsed.host_str().is_some_and(|h| !h.is_empty())
        && parsed.fragment().is_none();
    if !ok {
        return Err(BAD.into());
    }
    let endpoint = format!(
        "{}://{}:{}",
        parsed.scheme(),
        parsed.host_str().unwrap_or_default(),
        parsed.port_or_known_default().unwrap_or(0)
    );
    let path = secret_file.ok_or(
        "--quota-webhook-secret-file (MAAS_QUOTA_WEBHOOK_SECRET_FILE) is required with --quota-webhook-url",
    )?;
    let bytes = std::fs::read(&path)
        .map_err(|e| format!("--quota-webhook-secret-file {}: {e}", path.display()))?;
    let secret = bytes.trim_ascii_end().to_vec();
    if secret.len() < 32 {
        return Err(format!(
            "--quota-webhook-secret-file {}: the secret must be at least 32 bytes",
            path.display()
        ));
    }
    at_least("--quota-webhook-timeout-ms", timeout_ms, 1)?;
    at_most("--quota-webhook-timeout-ms", timeout_ms, 600_000)?;
    at_least("--quota-webhook-max-attempts", max_attempts.into(), 1)?;
    at_most("--quota-webhook-max-attempts", max_attempts.into(), 100)?;
    at_least("--quota-webhook-max-pending", max_pending.into(), 1)?;
    Ok(Some(QuotaWebhookSettings {
        url: SecretString::from(parsed.to_string()),
        endpoint,
        secret: std::sync::Arc::new(secrecy::SecretSlice::from(secret)),
        timeout: Duration::from_millis(timeout_ms),
        max_attempts,
        max_pending,
        retry_base: Duration::from_secs(5),
        retry_max: Duration::from_secs(15 * 60),
        poll_interval: Duration::from_secs(1),
    }))
}

/// The model servers' readiness probe (`ready` in `GET /v1/models`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelProbeSettings {
    /// How long a probe's answer is reused (at least 1 ms).
    pub ttl: Duration,
    /// How long a probe may take (at least 1 ms).
    pub timeout: Duration,
    /// Where `backend: simulator` models run; unset: not probed.
    pub simulator_url: Option<String>,
}

/// The usage ledger and its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageSettings {
    /// At least 1.
    pub hourly_retention_days: u32,
    /// At least 100 ms.
    pub rollup_interval: Duration,
    /// `None`: no `user` label; `Some(n)`: at most `n` (≥ 1) distinct users labelled.
    pub metrics_max_users: Option<u32>,
}

/// Where the budget-lease counters live.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// `None`: in process.
    pub redis: Option<RedisSettings>,
}

#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// A `redis://` or `rediss://` URL that parses (it may hold a password: never logged).
    pub url: SecretString,
    /// `scheme://host:port` only: what logs may show.
    pub endpoint: String,
    /// Not zero.
    pub timeout: Duration,
}

/// Checks a Redis URL without connecting: the scheme, then the crate's own parse. The message
/// names the flag and never holds the URL (it may carry a password).
fn redis_settings(url: SecretString, timeout_ms: u64) -> Result<RedisSettings, String> {
    const BAD: &str = "--redis-url (MAAS_REDIS_URL) must be a redis:// or rediss:// URL";
    let u = url.expose_secret();
    if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
        return Err(BAD.into());
    }
    let client = redis::Client::open(u).map_err(|_| format!("{BAD} that parses"))?;
    let addr = client.get_connection_info().addr();
    let scheme = match addr {
        redis::ConnectionAddr::TcpTls { .. } => "rediss",
        _ => "redis",
    };
    let endpoint = format!("{scheme}://{addr}");
    at_least("--redis-timeout-ms", timeout_ms, 1)?;
    Ok(RedisSettings {
        url,
        endpoint,
        timeout: Duration::from_millis(timeout_ms),
    })
}

#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    /// A `postgres://` or `postgresql://` URL.
    pub url: SecretString,
    /// At least 1.
    pub max_connections: u32,
    /// Not zero.
    pub acquire_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct ListenerSettings {
    pub public: SocketAddr,
    pub internal: SocketAddr,
    pub metrics: SocketAddr,
    /// The public and metrics listeners serve TLS when set (and the internal one with
    /// [`InternalAuth::None`]).
    pub tls: Option<TlsFiles>,
    /// Who may call the internal listener.
    pub internal_auth: InternalAuth,
    /// A directory holding `index.html`: the web UI, on the public listener at `/ui/`.
    pub ui_dir: Option<PathBuf>,
    /// The Gateway's base URL as clients reach it ([`public_url`]: `http(s)://host[:port][/path]`,
    /// no trailing `/`), under which `GET /v1/models` names each model's `url`.
    pub public_url: Option<String>,
}

/// Checks `--public-url`: an absolute `http` or `https` URL with a host and without user,
/// password, query or fragment; answered without a trailing `/`.
pub fn public_url(raw: &str) -> Result<String, String> {
    const BAD: &str = "--public-url (MAAS_PUBLIC_URL) must be an http:// or https:// URL with a host and no user, query or fragment (e.g. https://maas.apps.example.com)";
    let url = reqwest::Url::parse(raw.trim()).map_err(|e| format!("{BAD}: {e}"))?;
    let ok = matches!(url.scheme(), "http" | "https")
        && url.host_str().is_some_and(|h| !h.is_empty())
        && url.username().is_empty()
        && url.password().is_none()
        && url.query().is_none()
        && url.fragment().is_none();
    if !ok {
        return Err(BAD.into());
    }
    Ok(url.as_str().trim_end_matches('/').to_string())
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Who may call the internal listener.
#[derive(Debug, Clone)]
pub enum InternalAuth {
    /// Mutual TLS (the default).
    Mtls(InternalMtls),
    /// Whoever reaches the port (`--internal-auth none`).
    None,
}

/// The internal listener's mutual TLS: every file exists.
#[derive(Debug, Clone)]
pub struct InternalMtls {
    /// The listener's certificate and key (`--internal-tls-*`, else `--tls-*`).
    pub server: TlsFiles,
    /// The flags `server` came from, for messages.
    pub server_flags: (&'static str, &'static str),
    /// The CA bundle a client certificate must chain to.
    pub client_ca: PathBuf,
    /// Empty: any certificate from `client_ca`; else one of its SANs must be one of these.
    pub client_names: Vec<ClientName>,
}

/// An allowed caller: a subject alternative name of its client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientName {
    /// A URI SAN, compared exactly (`spiffe://cluster.local/ns/…/sa/…`).
    Uri(String),
    /// A DNS SAN, compared without regard to ASCII case.
    Dns(String),
}

impl ClientName {
    /// `scheme://…` is a URI, anything else a DNS name; neither may be empty or hold spaces,
    /// and a DNS name holds no wildcard (each caller is named).
    fn parse(raw: &str) -> Result<ClientName, String> {
        let name = raw.trim();
        let bad = |why: &str| {
            Err(format!(
                "--internal-client-names: {name:?} {why} (give URIs like spiffe://cluster.local/ns/NS/sa/SA or DNS names)"
            ))
        };
        if name.is_empty() {
            return bad("is empty");
        }
        if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return bad("holds whitespace");
        }
        if let Some((scheme, rest)) = name.split_once("://") {
            if scheme.is_empty() || rest.is_empty() {
                return bad("is not a URI");
            }
            return Ok(ClientName::Uri(name.to_string()));
        }
        if name.contains('*') {
            return bad("is a wildcard");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        {
            return bad("is neither a URI nor a DNS name");
        }
        Ok(ClientName::Dns(name.to_ascii_lowercase()))
    }
}

impl std::fmt::Display for ClientName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientName::Uri(u) => write!(f, "URI:{u}"),
            ClientName::Dns(d) => write!(f, "DNS:{d}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct PolicySettings {
    /// An existing file; always given with [`PolicySource::File`].
    pub file: Option<PathBuf>,
    pub source: PolicySource,
    /// At least 100 ms.
    pub reload_interval: Duration,
    /// `--write-status` (only with [`PolicySource::Kubernetes`]).
    pub write_status: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySource {
    File,
    /// The reference's resources; subscriptions and auth policies in `namespace` (a DNS label).
    Kubernetes {
        namespace: String,
    },
}

#[derive(Debug, Clone)]
pub struct IdentitySettings {
    pub provider: IdentityProvider,
    pub token_cache_ttl: Duration,
    pub token_negative_cache_ttl: Duration,
    /// No empty names.
    pub admin_groups: Vec<String>,
    pub admin_sar: Option<AdminSarSettings>,
}

#[derive(Debug, Clone)]
pub enum IdentityProvider {
    /// TokenReview; with OIDC settings, JWTs from that issuer are verified locally instead.
    Kubernetes {
        audiences: Vec<String>,
        oidc: Option<OidcSettings>,
    },
    /// An existing identities file.
    Static {
        identities_file: PathBuf,
    },
    Oidc(OidcSettings),
}

/// Every field non-empty.
#[derive(Debug, Clone)]
pub struct OidcSettings {
    pub issuer: String,
    pub audience: String,
    pub jwks_url: String,
    pub groups_claim: String,
}

#[derive(Debug, Clone)]
pub struct AdminSarSettings {
    pub namespace: String,
    /// `resource.group`.
    pub resource: String,
    pub verb: String,
}

#[derive(Debug, Clone)]
pub enum CredentialsSettings {
    /// Secrets in `namespace` (default: the client's namespace).
    Kubernetes { namespace: Option<String> },
    /// An existing credentials file.
    File(PathBuf),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySettings {
    /// At least 1.
    pub max_expiration_days: u32,
    /// How long the filter may cache a positive API key answer.
    pub cache_ttl: Duration,
    /// Not zero.
    pub last_used_flush_interval: Duration,
}

impl Settings {
    /// True when something needs the Kubernetes API.
    pub fn needs_kubernetes(&self) -> bool {
        matches!(self.identity.provider, IdentityProvider::Kubernetes { .. })
            || matches!(self.credentials, CredentialsSettings::Kubernetes { .. })
            || self.identity.admin_sar.is_some()
            || matches!(self.policy.source, PolicySource::Kubernetes { .. })
    }
}

/// The database URL (`--database-url`, else `DB_CONNECTION_URL`): present, and PostgreSQL's.
fn database_url(
    database_url: Option<SecretString>,
    db_connection_url: Option<SecretString>,
) -> Result<SecretString, String> {
    let url = database_url
        .or(db_connection_url)
        .ok_or("--database-url (DATABASE_URL or DB_CONNECTION_URL) is required")?;
    let scheme_ok = {
        let u = url.expose_secret();
        u.starts_with("postgres://") || u.starts_with("postgresql://")
    };
    if !scheme_ok {
        return Err("--database-url must start with postgres:// or postgresql://".into());
    }
    Ok(url)
}

/// Where the policy comes from: `--policy-file` (required with `file`), or the reference's
/// resources in `--policy-namespace` (and a file to start from, if given); how often it is
/// read again.
fn policy_settings(
    kind: PolicySourceKind,
    policy_file: Option<PathBuf>,
    policy_namespace: String,
    reload_interval_ms: u64,
    write_status: bool,
) -> Result<PolicySettings, String> {
    if write_status && kind != PolicySourceKind::Kubernetes {
        return Err(
            "--write-status (MAAS_WRITE_STATUS) needs --policy-source kubernetes: there is no resource to write a status on"
                .into(),
        );
    }
    let (file, source) = match kind {
        PolicySourceKind::File => (
            Some(existing_file(
                "--policy-file",
                policy_file,
                "(MAAS_POLICY_FILE) is required",
            )?),
            PolicySource::File,
        ),
        PolicySourceKind::Kubernetes => {
            if !maas_types::subscription::is_dns_label(&policy_namespace) {
                return Err(
                    "--policy-namespace must be a DNS label (a-z, 0-9, '-', at most 63)".into(),
                );
            }
            let file = match policy_file {
                None => None,
                Some(p) => Some(existing_file(
                    "--policy-file",
                    Some(p),
                    "(MAAS_POLICY_FILE)",
                )?),
            };
            (
                file,
                PolicySource::Kubernetes {
                    namespace: policy_namespace,
                },
            )
        }
    };
    at_least("--policy-reload-interval-ms", reload_interval_ms, 100)?;
    Ok(PolicySettings {
        file,
        source,
        reload_interval: Duration::from_millis(reload_interval_ms),
        write_status,
    })
}

/// The OIDC settings: all three of issuer, audience and JWKS URL, or none (an error naming
/// the first missing one, for the `oidc` provider).
fn oidc_settings(
    issuer: Option<String>,
    audience: Option<String>,
    jwks_url: Option<String>,
    groups_claim: String,
    provider: IdentityProviderKind,
) -> Result<Option<OidcSettings>, String> {
    let oidc = match (non_empty(issuer), non_empty(audience), non_empty(jwks_url)) {
        (Some(issuer), Some(audience), Some(jwks_url)) => Some(OidcSettings {
            issuer,
            audience,
            jwks_url,
            groups_claim,
        }),
        (None, None, None) => None,
        (issuer, audience, _) => {
            let missing = if issuer.is_none() {
                "--oidc-issuer"
            } else if audience.is_none() {
                "--oidc-audience"
            } else {
                "--oidc-jwks-url"
            };
            if provider == IdentityProviderKind::Oidc {
                return Err(format!(
                    "{missing} is required with --identity-provider oidc"
                ));
            }
            return Err("--oidc-issuer, --oidc-audience and --oidc-jwks-url go together".into());
        }
    };
    Ok(oidc)
}

/// Who callers are: a static identities file, OIDC tokens, or Kubernetes tokens (with OIDC
/// beside them when configured).
fn identity_provider(
    kind: IdentityProviderKind,
    oidc_issuer: Option<String>,
    oidc_audience: Option<String>,
    oidc_jwks_url: Option<String>,
    oidc_groups_claim: String,
    identities_file: Option<PathBuf>,
    token_audiences: Vec<String>,
) -> Result<IdentityProvider, String> {
    let oidc = oidc_settings(
        oidc_issuer,
        oidc_audience,
        oidc_jwks_url,
        oidc_groups_claim,
        kind,
    )?;
    let provider = match kind {
        IdentityProviderKind::Static => IdentityProvider::Static {
            identities_file: existing_file(
                "--identities-file",
                identities_file,
                "(MAAS_IDENTITIES_FILE) is required with --identity-provider static",
            )?,
        },
        IdentityProviderKind::Oidc => IdentityProvider::Oidc(
            oidc.ok_or("--oidc-issuer is required with --identity-provider oidc")?,
        ),
        IdentityProviderKind::Kubernetes => IdentityProvider::Kubernetes {
            audiences: token_audiences,
            oidc,
        },
    };
    Ok(provider)
}

/// The public listener's certificate and key: both or neither.
fn tls_files(cert: Option<PathBuf>, key: Option<PathBuf>) -> Result<Option<TlsFiles>, String> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
        (None, None) => Ok(None),
        _ => Err("--tls-cert and --tls-key must be given together".into()),
    }
}

/// The usage ledger's retention and roll-up, and whether metrics are labelled per user.
fn usage_settings(
    hourly_retention_days: u32,
    rollup_interval_ms: u64,
    metrics_per_user: bool,
    metrics_max_users: u32,
) -> Result<UsageSettings, String> {
    at_least(
        "--usage-hourly-retention-days",
        hourly_retention_days.into(),
        1,
    )?;
    at_least("--usage-rollup-interval-ms", rollup_interval_ms, 100)?;
    at_least("--usage-metrics-max-users", metrics_max_users.into(), 1)?;
    Ok(UsageSettings {
        hourly_retention_days,
        rollup_interval: Duration::from_millis(rollup_interval_ms),
        metrics_max_users: metrics_per_user.then_some(metrics_max_users),
    })
}

/// The database settings, checked (at least one connection, a positive acquire timeout).
fn database_settings(
    url: SecretString,
    max_connections: u32,
    acquire_timeout_ms: u64,
) -> Result<DatabaseSettings, String> {
    at_least("--db-max-connections", max_connections.into(), 1)?;
    at_least("--db-acquire-timeout-ms", acquire_timeout_ms, 1)?;
    Ok(DatabaseSettings {
        url,
        max_connections,
        acquire_timeout: Duration::from_millis(acquire_timeout_ms),
    })
}

/// Where provider credentials come from: `--credentials-file`, or Secrets.
fn credentials_settings(
    kind: CredentialsSourceKind,
    credentials_file: Option<PathBuf>,
    credentials_namespace: Option<String>,
) -> Result<CredentialsSettings, String> {
    let credentials = match kind {
        CredentialsSourceKind::File => CredentialsSettings::File(existing_file(
            "--credentials-file",
            credentials_file,
            "(MAAS_CREDENTIALS_FILE) is required with --credentials-source file",
        )?),
        CredentialsSourceKind::Kubernetes => CredentialsSettings::Kubernetes {
            namespace: credentials_namespace,
        },
    };
    Ok(credentials)
}

/// Who is an admin: `--admin-groups` (no empty name), and the SubjectAccessReview asked when
/// `--admin-sar-namespace` is given.
fn admin_sar(
    admin_groups: &[String],
    namespace: Option<String>,
    resource: String,
    verb: String,
) -> Result<Option<AdminSarSettings>, String> {
    if admin_groups.iter().any(|g| g.trim().is_empty()) {
        return Err("--admin-groups must not hold empty names".into());
    }
    if resource.trim().is_empty() || verb.trim().is_empty() {
        return Err("--admin-sar-resource and --admin-sar-verb must not be empty".into());
    }
    let admin_sar = match namespace {
        Some(n) if n.is_empty() => {
            return Err("--admin-sar-namespace must not be empty".into());
        }
        Some(namespace) => Some(AdminSarSettings {
            namespace,
            resource,
            verb,
        }),
        None => None,
    };
    Ok(admin_sar)
}

/// The web UI's files: a directory holding `index.html`, if given.
fn ui_dir(ui_dir: Option<PathBuf>) -> Result<Option<PathBuf>, String> {
    let ui_dir = match ui_dir {
        Some(d) if !d.join("index.html").is_file() => {
            return Err(format!(
                "--ui-dir {}: no index.html there (build the UI: cd ui && npm ci && npm run build, then give ui/dist)",
                d.display()
            ));
        }
        d => d,
    };
    Ok(ui_dir)
}

fn existing_file(flag: &str, path: Option<PathBuf>, required: &str) -> Result<PathBuf, String> {
    match path {
        None => Err(format!("{flag} {required}")),
        Some(p) if !p.is_file() => Err(format!("{flag} {}: no such file", p.display())),
        Some(p) => Ok(p),
    }
}

fn non_empty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.is_empty())
}

/// The model servers' probe settings from their flags.
fn model_probe_settings(
    ttl_ms: u64,
    timeout_ms: u64,
    simulator_url: Option<String>,
) -> Result<ModelProbeSettings, String> {
    at_least("--model-ready-ttl-ms", ttl_ms, 1)?;
    at_least("--model-probe-timeout-ms", timeout_ms, 1)?;
    Ok(ModelProbeSettings {
        ttl: Duration::from_millis(ttl_ms),
        timeout: Duration::from_millis(timeout_ms),
        simulator_url: non_empty(simulator_url)
            .map(|u| {
                public_url(&u).map_err(|e| {
                    e.replace(
                        "--public-url (MAAS_PUBLIC_URL)",
                        "--simulator-url (MAAS_SIMULATOR_URL)",
                    )
                })
            })
            .transpose()?,
    })
}

fn at_most(flag: &str, value: u64, max: u64) -> Result<(), String> {
    if value > max {
        return Err(format!("{flag} must be at most {max}"));
    }
    Ok(())
}

fn at_least(flag: &str, value: u64, min: u64) -> Result<(), String> {
    if value < min {
        return Err(format!("{flag} must be at least {min}"));
    }
    Ok(())
}

/// The internal listener's caller check from its flags. `mtls` needs the client CA and a
/// certificate for the listener (its own, or the other listeners'); `none` takes none of the
/// mTLS flags, so a half-configured check is never silently off.
fn internal_auth(
    kind: InternalAuthKind,
    client_ca: Option<PathBuf>,
    client_names: Vec<String>,
    own: (Option<PathBuf>, Option<PathBuf>),
    shared: Option<&TlsFiles>,
) -> Result<InternalAuth, String> {
    let client_names: Vec<String> = client_names
        .into_iter()
        .filter(|n| !n.trim().is_empty())
        .collect();
    match kind {
        InternalAuthKind::None => {
            if client_ca.is_some() || !client_names.is_empty() || own.0.is_some() || own.1.is_some()
            {
                return Err("--internal-client-ca, --internal-client-names and --internal-tls-cert/--internal-tls-key apply only with --internal-auth mtls (given: none)".into());
            }
            Ok(InternalAuth::None)
        }
        InternalAuthKind::Mtls => {
            let client_ca = existing_file(
                "--internal-client-ca",
                client_ca,
                "(MAAS_INTERNAL_CLIENT_CA) is required: the internal listener serves provider credentials and admits only callers whose client certificate chains to this CA bundle (--internal-auth none runs it open, for development only)",
            )?;
            let (server, server_flags) = match own {
                (Some(cert), Some(key)) => (
                    TlsFiles {
                        cert: existing_file("--internal-tls-cert", Some(cert), "")?,
                        key: existing_file("--internal-tls-key", Some(key), "")?,
                    },
                    ("--internal-tls-cert", "--internal-tls-key"),
                ),
                (None, None) => match shared {
                    Some(files) => (files.clone(), ("--tls-cert", "--tls-key")),
                    None => {
                        return Err("--internal-tls-cert and --internal-tls-key (MAAS_INTERNAL_TLS_CERT, MAAS_INTERNAL_TLS_KEY) are required with --internal-auth mtls, unless --tls-cert and --tls-key give the listeners' certificate".into());
                    }
                },
                _ => {
                    return Err(
                        "--internal-tls-cert and --internal-tls-key must be given together".into(),
                    );
                }
            };
            let client_names = client_names
                .iter()
                .map(|n| ClientName::parse(n))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(InternalAuth::Mtls(InternalMtls {
                server,
                server_flags,
                client_ca,
                client_names,
            }))
        }
    }
}

/// The API keys' settings: a positive maximum lifetime and flush interval.
fn key_settings(
    max_expiration_days: u32,
    cache_ttl_seconds: u64,
    last_used_flush_interval_ms: u64,
) -> Result<KeySettings, String> {
    at_least(
        "--api-key-max-expiration-days",
        max_expiration_days.into(),
        1,
    )?;
    at_least(
        "--last-used-flush-interval-ms",
        last_used_flush_interval_ms,
        1,
    )?;
    Ok(KeySettings {
        max_expiration_days,
        cache_ttl: Duration::from_secs(cache_ttl_seconds),
        last_used_flush_interval: Duration::from_millis(last_used_flush_interval_ms),
    })
}

impl Cli {
    /// The webhook's settings from its flags (taken out of `self`).
    fn quota_webhook(&mut self) -> Result<Option<QuotaWebhookSettings>, String> {
        quota_webhook_settings(
            self.quota_webhook_url.take(),
            self.quota_webhook_secret_file.take(),
            self.quota_webhook_timeout_ms,
            self.quota_webhook_max_attempts,
            self.quota_webhook_max_pending,
        )
    }

    /// The trace flags, checked (read before the rest: logging is set up with them).
    pub fn trace_settings(&self) -> Result<TraceSettings, String> {
        trace_settings(
            self.otlp_traces_endpoint.as_deref(),
            self.otlp_trace_sample_ratio,
        )
    }

    fn gcp_federation(&mut self) -> crate::cloud_tokens::gcp_federation::GcpFederation {
        crate::cloud_tokens::gcp_federation::GcpFederation {
            sts_url: std::mem::take(&mut self.gcp_sts_url),
            iam_credentials_url: std::mem::take(&mut self.gcp_iam_credentials_url),
            subject_token_dir: std::mem::take(&mut self.gcp_subject_token_dir),
        }
    }

    /// Checks what clap cannot (required-when rules, ranges, files) and builds the settings.
    /// The message names the flag and never holds the database password.
    pub fn into_settings(mut self) -> Result<Settings, String> {
        let traces = self.trace_settings()?;
        let quota_webhook = self.quota_webhook()?;
        let gcp_federation = self.gcp_federation();
        let database = database_settings(
            database_url(self.database_url, self.db_connection_url)?,
            self.db_max_connections,
            self.db_acquire_timeout_ms,
        )?;
        let policy = policy_settings(
            self.policy_source,
            self.policy_file,
            self.policy_namespace,
            self.policy_reload_interval_ms,
            self.write_status,
        )?;
        let provider = identity_provider(
            self.identity_provider,
            self.oidc_issuer,
            self.oidc_audience,
            self.oidc_jwks_url,
            self.oidc_groups_claim,
            self.identities_file,
            self.token_audiences,
        )?;
        let credentials = credentials_settings(
            self.credentials_source,
            self.credentials_file,
            self.credentials_namespace,
        )?;
        let admin_sar = admin_sar(
            &self.admin_groups,
            self.admin_sar_namespace,
            self.admin_sar_resource,
            self.admin_sar_verb,
        )?;
        let keys = key_settings(
            self.api_key_max_expiration_days,
            self.key_cache_ttl_seconds,
            self.last_used_flush_interval_ms,
        )?;
        let tls = tls_files(self.tls_cert, self.tls_key)?;
        let internal_auth = internal_auth(
            self.internal_auth,
            self.internal_client_ca,
            self.internal_client_names,
            (self.internal_tls_cert, self.internal_tls_key),
            tls.as_ref(),
        )?;
        let pseudonym_key = pseudonym_key(self.log_pseudonym_key_file)?;
        let usage = usage_settings(
            self.usage_hourly_retention_days,
            self.usage_rollup_interval_ms,
            self.usage_metrics_per_user,
            self.usage_metrics_max_users,
        )?;
        Ok(Settings {
            database,
            listeners: ListenerSettings {
                public: self.public_addr,
                internal: self.internal_addr,
                metrics: self.metrics_addr,
                tls,
                internal_auth,
                ui_dir: ui_dir(self.ui_dir)?,
                public_url: non_empty(self.public_url)
                    .map(|u| public_url(&u))
                    .transpose()?,
            },
            policy,
            identity: IdentitySettings {
                provider,
                token_cache_ttl: Duration::from_secs(self.token_cache_ttl_seconds),
                token_negative_cache_ttl: Duration::from_secs(
                    self.token_negative_cache_ttl_seconds,
                ),
                admin_groups: self.admin_groups,
                admin_sar,
            },
            credentials,
            azure_authority_url: self.azure_authority_url,
            gcp_federation,
            keys,
            leases: LeaseSettings {
                redis: self
                    .redis_url
                    .map(|url| redis_settings(url, self.redis_timeout_ms))
                    .transpose()?,
            },
            usage,
            model_probe: model_probe_settings(
                self.model_ready_ttl_ms,
                self.model_probe_timeout_ms,
                self.simulator_url,
            )?,
            log_format: self.log_format,
            log_pseudonyms: log_pseudonyms(self.log_user_names, &pseudonym_key),
            pseudonym_key,
            quota_webhook,
            traces,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag_path(p: &std::path::Path) -> String {
        p.display().to_string()
    }

    fn parse(args: &[&str]) -> Cli {
        let mut all = vec!["maas-companion"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap()
    }

    #[test]
    fn defaults_follow_the_contract() {
        let c = parse(&["--database-url", "postgres://x/y"]);
        assert_eq!(c.db_max_connections, 25);
        assert_eq!(c.public_addr.to_string(), "0.0.0.0:8080");
        assert_eq!(c.internal_addr.to_string(), "0.0.0.0:8081");
        assert_eq!(c.metrics_addr.to_string(), "0.0.0.0:9090");
        assert_eq!(c.policy_reload_interval_ms, 2000);
        assert_eq!(c.identity_provider, IdentityProviderKind::Kubernetes);
        assert_eq!(c.credentials_source, CredentialsSourceKind::Kubernetes);
        assert_eq!(c.admin_groups, vec!["maas-admins".to_string()]);
        assert_eq!(c.api_key_max_expiration_days, 90);
        assert_eq!(c.internal_auth, InternalAuthKind::Mtls);
    }

    #[test]
    fn trace_export_is_off_by_default_and_its_flags_are_checked() {
        let c = parse(&["--database-url", "postgres://x/y"]);
        let t = c.trace_settings().unwrap();
        assert_eq!(t.endpoint, None);
        assert_eq!(t.sample_ratio, 1.0);
        let c = parse(&[
            "--otlp-traces-endpoint",
            "http://collector:4318/v1/traces",
            "--otlp-trace-sample-ratio",
            "0.25",
        ]);
        let t = c.trace_settings().unwrap();
        assert_eq!(
            t.endpoint.as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(t.sample_ratio, 0.25);
        for (flag, value) in [
            ("--otlp-trace-sample-ratio", "1.5"),
            ("--otlp-trace-sample-ratio", "-0.1"),
            ("--otlp-traces-endpoint", "collector:4318"),
            ("--otlp-traces-endpoint", "http://"),
        ] {
            let arg = format!("{flag}={value}");
            let e = parse(&[&arg]).trace_settings().unwrap_err();
            assert!(e.contains(flag), "{e}");
        }
    }

    #[test]
    fn the_kubernetes_policy_source_needs_no_file_and_a_dns_label_namespace() {
        let c = parse(&["--database-url", "postgres://x/y"]);
        assert_eq!(c.policy_source, PolicySourceKind::File);
        assert_eq!(c.policy_namespace, "models-as-a-service");
        let s = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-source",
            "kubernetes",
            "--internal-auth",
            "none",
        ])
        .into_settings()
        .unwrap();
        assert_eq!(s.policy.file, None);
        assert_eq!(
            s.policy.source,
            PolicySource::Kubernetes {
                namespace: "models-as-a-service".into()
            }
        );
        assert!(s.needs_kubernetes());
        let e = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-source",
            "kubernetes",
            "--policy-namespace",
            "Not_A_Label",
        ])
        .into_settings()
        .unwrap_err();
        assert!(e.contains("--policy-namespace"), "{e}");
        assert!(!s.policy.write_status);
        let s = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-source",
            "kubernetes",
            "--internal-auth",
            "none",
            "--write-status",
        ])
        .into_settings()
        .unwrap();
        assert!(s.policy.write_status);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.yaml");
        std::fs::write(&file, "tiers: []\n").unwrap();
        let e = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-file",
            file.to_str().unwrap(),
            "--write-status",
        ])
        .into_settings()
        .unwrap_err();
        assert!(
            e.contains("--write-status") && e.contains("--policy-source kubernetes"),
            "{e}"
        );
    }

    #[test]
    fn validation_names_the_flag() {
        let c = parse(&["--database-url", "postgres://x/y"]);
        assert!(c.into_settings().unwrap_err().contains("--policy-file"));
        let c = parse(&["--database-url", "mysql://x/y"]);
        assert!(c.into_settings().unwrap_err().contains("--database-url"));
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        std::fs::write(&policy, "tiers: []").unwrap();
        let policy = flag_path(&policy);
        let c = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-file",
            &policy,
            "--identity-provider",
            "static",
        ]);
        assert!(c.into_settings().unwrap_err().contains("--identities-file"));
        let c = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-file",
            &policy,
            "--admin-groups",
            "a,b",
            "--tls-cert",
            "/x",
        ]);
        assert_eq!(c.admin_groups, vec!["a".to_string(), "b".to_string()]);
        assert!(c.into_settings().unwrap_err().contains("--tls-cert"));
        let c = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-file",
            &policy,
            "--identity-provider",
            "oidc",
            "--oidc-issuer",
            "https://issuer",
        ]);
        assert!(
            c.into_settings()
                .unwrap_err()
                .contains("--oidc-audience is required with --identity-provider oidc")
        );
    }

    #[test]
    fn a_public_url_is_an_http_base_without_user_query_or_fragment() {
        assert_eq!(
            public_url("https://maas.apps.example.com/").unwrap(),
            "https://maas.apps.example.com"
        );
        assert_eq!(
            public_url("http://127.0.0.1:8080").unwrap(),
            "http://127.0.0.1:8080"
        );
        assert_eq!(
            public_url("https://gw.example.com/prefix/").unwrap(),
            "https://gw.example.com/prefix"
        );
        for bad in [
            "maas.apps.example.com",
            "ftp://maas.example.com",
            "https://user:pw@maas.example.com",
            "https://maas.example.com/?x=1",
            "https://maas.example.com/#top",
            "https://",
        ] {
            let err = public_url(bad).unwrap_err();
            assert!(err.contains("--public-url"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_ui_dir_must_hold_a_built_index_html() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        std::fs::write(&policy, "tiers: []").unwrap();
        let policy = flag_path(&policy);
        let ui = dir.path().join("dist");
        std::fs::create_dir(&ui).unwrap();
        let with = |args: &[&str]| {
            let mut all = vec![
                "--database-url",
                "postgres://x/y",
                "--policy-file",
                &policy,
                "--internal-auth",
                "none",
            ];
            all.extend_from_slice(args);
            parse(&all).into_settings()
        };
        let err = with(&["--ui-dir", &flag_path(&ui)]).unwrap_err();
        assert!(
            err.contains("--ui-dir") && err.contains("npm run build"),
            "{err}"
        );
        std::fs::write(ui.join("index.html"), "<!doctype html>").unwrap();
        let s = with(&["--ui-dir", &flag_path(&ui)]).unwrap();
        assert_eq!(s.listeners.ui_dir.as_deref(), Some(ui.as_path()));
    }

    #[test]
    fn valid_flags_become_typed_settings_without_options_left_to_check() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        let creds = dir.path().join("c.yaml");
        let pem = |name: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, "(PEM)").unwrap();
            flag_path(&p)
        };
        let (ca, cert, key) = (pem("ca.pem"), pem("cert.pem"), pem("key.pem"));
        std::fs::write(&policy, "tiers: []").unwrap();
        std::fs::write(&creds, "credentials: {}").unwrap();
        let s = parse(&[
            "--internal-client-ca",
            &ca,
            "--internal-tls-cert",
            &cert,
            "--internal-tls-key",
            &key,
            "--internal-client-names",
            "spiffe://cluster.local/ns/openshift-ingress/sa/gw, Gateway.Example",
            "--db-connection-url",
            "postgresql://u@h/db",
            "--policy-file",
            &flag_path(&policy),
            "--credentials-source",
            "file",
            "--credentials-file",
            &flag_path(&creds),
            "--oidc-issuer",
            "https://issuer",
            "--oidc-audience",
            "maas",
            "--oidc-jwks-url",
            "https://issuer/jwks",
            "--admin-sar-namespace",
            "maas",
            "--policy-reload-interval-ms",
            "500",
        ])
        .into_settings()
        .unwrap();
        assert_eq!(s.database.url.expose_secret(), "postgresql://u@h/db");
        assert_eq!(s.policy.file, Some(policy));
        assert_eq!(s.policy.reload_interval, Duration::from_millis(500));
        assert!(matches!(s.credentials, CredentialsSettings::File(ref p) if *p == creds));
        match &s.identity.provider {
            IdentityProvider::Kubernetes {
                oidc: Some(oidc), ..
            } => {
                assert_eq!(oidc.issuer, "https://issuer");
                assert_eq!(oidc.groups_claim, "groups");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            s.identity.admin_sar.as_ref().map(|a| a.verb.as_str()),
            Some("create")
        );
        assert!(s.needs_kubernetes());
        assert_eq!(s.keys.max_expiration_days, 90);
        assert!(
            s.leases.redis.is_none(),
            "no --redis-url: leases in process"
        );
        assert_eq!(s.usage.hourly_retention_days, 31);
        assert_eq!(s.usage.rollup_interval, Duration::from_secs(3600));
        assert_eq!(s.usage.metrics_max_users, None, "no user label by default");
        match &s.listeners.internal_auth {
            InternalAuth::Mtls(m) => {
                assert_eq!(flag_path(&m.client_ca), ca);
                assert_eq!(flag_path(&m.server.cert), cert);
                assert_eq!(m.server_flags.1, "--internal-tls-key");
                assert_eq!(
                    m.client_names,
                    vec![
                        ClientName::Uri("spiffe://cluster.local/ns/openshift-ingress/sa/gw".into()),
                        ClientName::Dns("gateway.example".into()),
                    ]
                );
            }
            InternalAuth::None => panic!("mtls is the default"),
        }
    }

    /// The internal listener checks its callers unless told not to, and says which flag is
    /// missing or wrong.
    #[test]
    fn the_internal_listener_needs_a_client_ca_and_a_certificate_unless_turned_off() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, "x").unwrap();
            flag_path(&p)
        };
        let (policy, ca, cert, key) =
            (file("p.yaml"), file("ca.pem"), file("c.pem"), file("k.pem"));
        let with = |args: &[&str]| {
            let mut all = vec!["--database-url", "postgres://x/y", "--policy-file", &policy];
            all.extend_from_slice(args);
            parse(&all).into_settings()
        };
        let e = with(&[]).unwrap_err();
        assert!(
            e.contains("--internal-client-ca (MAAS_INTERNAL_CLIENT_CA) is required"),
            "{e}"
        );
        let e = with(&["--internal-client-ca", "/nonexistent/ca.pem"]).unwrap_err();
        assert!(
            e.contains("--internal-client-ca /nonexistent/ca.pem: no such file"),
            "{e}"
        );
        let e = with(&["--internal-client-ca", &ca]).unwrap_err();
        assert!(
            e.contains("--internal-tls-cert and --internal-tls-key"),
            "{e}"
        );
        let e = with(&["--internal-client-ca", &ca, "--internal-tls-cert", &cert]).unwrap_err();
        assert!(e.contains("must be given together"), "{e}");
        let e = with(&[
            "--internal-client-ca",
            &ca,
            "--internal-tls-cert",
            &cert,
            "--internal-tls-key",
            "/nonexistent/key.pem",
        ])
        .unwrap_err();
        assert!(e.contains("--internal-tls-key /nonexistent/key.pem"), "{e}");
        // The other listeners' certificate serves when the internal one has none of its own.
        let s = with(&[
            "--internal-client-ca",
            &ca,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ])
        .unwrap();
        let InternalAuth::Mtls(m) = s.listeners.internal_auth else {
            panic!("mtls")
        };
        assert_eq!(m.server_flags, ("--tls-cert", "--tls-key"));
        assert!(m.client_names.is_empty());
        for bad in ["gate way", "*.example", "spiffe://", "a/b", "https://x y"] {
            let e = with(&[
                "--internal-client-ca",
                &ca,
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--internal-client-names",
                bad,
            ])
            .unwrap_err();
            assert!(e.contains("--internal-client-names"), "{bad}: {e}");
        }
        // `none` is explicit, and takes none of the mTLS flags (no half-configured check).
        let s = with(&["--internal-auth", "none"]).unwrap();
        assert!(matches!(s.listeners.internal_auth, InternalAuth::None));
        let e = with(&["--internal-auth", "none", "--internal-client-ca", &ca]).unwrap_err();
        assert!(e.contains("apply only with --internal-auth mtls"), "{e}");
    }

    #[test]
    fn usage_metrics_per_user_are_capped_and_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        std::fs::write(&policy, "tiers: []").unwrap();
        let policy = flag_path(&policy);
        let with = |args: &[&str]| {
            let mut all = vec![
                "--database-url",
                "postgres://x/y",
                "--policy-file",
                &policy,
                "--internal-auth",
                "none",
            ];
            all.extend_from_slice(args);
            parse(&all).into_settings()
        };
        let s = with(&["--usage-metrics-per-user"]).unwrap();
        assert_eq!(s.usage.metrics_max_users, Some(1000));
        let s = with(&["--usage-metrics-per-user", "--usage-metrics-max-users", "2"]).unwrap();
        assert_eq!(s.usage.metrics_max_users, Some(2));
        for (flag, value) in [
            ("--usage-metrics-max-users", "0"),
            ("--usage-hourly-retention-days", "0"),
            ("--usage-rollup-interval-ms", "99"),
        ] {
            let e = with(&[flag, value]).unwrap_err();
            assert!(e.contains(flag), "{e}");
        }
    }

    #[test]
    fn the_quota_webhook_needs_a_url_and_a_long_secret_and_names_the_bad_flag() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        std::fs::write(&policy, "tiers: []").unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{}\n", "s".repeat(32))).unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "s".repeat(31)).unwrap();
        let (policy, secret, short) = (flag_path(&policy), flag_path(&secret), flag_path(&short));
        let with = |extra: &[&str]| {
            let mut args = vec![
                "--database-url",
                "postgres://x/y",
                "--policy-file",
                &policy,
                "--internal-auth",
                "none",
            ];
            args.extend_from_slice(extra);
            parse(&args).into_settings()
        };
        assert!(with(&[]).unwrap().quota_webhook.is_none(), "off by default");
        let url = "https://hooks.example.com/maas?token=t0ps3cret";
        let s = with(&[
            "--quota-webhook-url",
            url,
            "--quota-webhook-secret-file",
            &secret,
        ])
        .unwrap()
        .quota_webhook
        .unwrap();
        assert_eq!(s.endpoint, "https://hooks.example.com:443");
        assert_eq!(
            s.secret.expose_secret(),
            "s".repeat(32).as_bytes(),
            "trimmed"
        );
        assert_eq!(
            (s.timeout, s.max_attempts, s.max_pending),
            (Duration::from_millis(5000), 8, 10_000)
        );
        let shown = format!("{s:?}");
        assert!(
            !shown.contains("t0ps3cret") && !shown.contains("sssss"),
            "{shown}"
        );
        let refused = |extra: &[&str], flag: &str| {
            let e = with(extra).unwrap_err();
            assert!(e.contains(flag), "{e}");
            assert!(!e.contains("t0ps3cret"), "{e}");
        };
        refused(&["--quota-webhook-url", url], "--quota-webhook-secret-file");
        refused(
            &["--quota-webhook-secret-file", &secret],
            "--quota-webhook-url",
        );
        refused(
            &[
                "--quota-webhook-url",
                url,
                "--quota-webhook-secret-file",
                &short,
            ],
            "--quota-webhook-secret-file",
        );
        for bad in ["ftp://x/y", "not a url", "https://x/y#frag"] {
            refused(
                &[
                    "--quota-webhook-url",
                    bad,
                    "--quota-webhook-secret-file",
                    &secret,
                ],
                "--quota-webhook-url",
            );
        }
        for (flag, value) in [
            ("--quota-webhook-timeout-ms", "0"),
            ("--quota-webhook-max-attempts", "0"),
            ("--quota-webhook-max-pending", "0"),
        ] {
            refused(
                &[
                    "--quota-webhook-url",
                    url,
                    "--quota-webhook-secret-file",
                    &secret,
                    flag,
                    value,
                ],
                flag,
            );
        }
    }

    #[test]
    fn a_redis_url_is_checked_and_only_its_endpoint_is_shown() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        std::fs::write(&policy, "tiers: []").unwrap();
        let policy = flag_path(&policy);
        let with = |url: &str| {
            parse(&[
                "--database-url",
                "postgres://x/y",
                "--policy-file",
                &policy,
                "--internal-auth",
                "none",
                "--redis-url",
                url,
            ])
            .into_settings()
        };
        let s = with("rediss://user:hunter2@redis.example:6380/0").unwrap();
        let redis = s.leases.redis.unwrap();
        assert_eq!(redis.endpoint, "rediss://redis.example:6380");
        assert_eq!(redis.timeout, Duration::from_millis(500));
        assert!(!format!("{redis:?}").contains("hunter2"));
        let s = with("redis://:pw@127.0.0.1:7000").unwrap();
        assert_eq!(s.leases.redis.unwrap().endpoint, "redis://127.0.0.1:7000");
        for bad in ["http://h:1", "redis://:hunter2@[::1", "hunter2"] {
            let e = with(bad).unwrap_err();
            assert!(e.contains("--redis-url"), "{bad}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }
}
