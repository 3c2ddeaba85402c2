//! Command line and environment configuration, validated at start.
//!
//! Every flag can also be set from the environment (docs/contracts.md lists the names). The
//! database URL usually comes from a Secret through `DATABASE_URL` / `DB_CONNECTION_URL`.

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
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "maas-companion",
    version,
    about = "MaaS Gateway companion service"
)]
pub struct Config {
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
    /// Log lines on stderr as text or JSON (level from RUST_LOG, default info).
    #[arg(long, env = "MAAS_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
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
}

impl Config {
    /// The database URL from either variable.
    pub fn database_url(&self) -> Option<&SecretString> {
        self.database_url
            .as_ref()
            .or(self.db_connection_url.as_ref())
    }

    /// Checks what clap cannot: required-when rules and sane ranges. The message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        let url = self
            .database_url()
            .ok_or("--database-url (DATABASE_URL or DB_CONNECTION_URL) is required")?;
        let url = url.expose_secret();
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err("--database-url must start with postgres:// or postgresql://".into());
        }
        if self.db_max_connections == 0 {
            return Err("--db-max-connections must be at least 1".into());
        }
        if self.db_acquire_timeout_ms == 0 {
            return Err("--db-acquire-timeout-ms must be at least 1".into());
        }
        match &self.policy_file {
            None => return Err("--policy-file (MAAS_POLICY_FILE) is required".into()),
            Some(p) if !p.is_file() => {
                return Err(format!("--policy-file {}: no such file", p.display()));
            }
            Some(_) => {}
        }
        if self.policy_reload_interval_ms < 100 {
            return Err("--policy-reload-interval-ms must be at least 100".into());
        }
        match self.identity_provider {
            IdentityProviderKind::Static => match &self.identities_file {
                None => {
                    return Err(
                        "--identities-file (MAAS_IDENTITIES_FILE) is required with --identity-provider static"
                            .into(),
                    );
                }
                Some(p) if !p.is_file() => {
                    return Err(format!("--identities-file {}: no such file", p.display()));
                }
                Some(_) => {}
            },
            IdentityProviderKind::Oidc => {
                for (flag, v) in [
                    ("--oidc-issuer", &self.oidc_issuer),
                    ("--oidc-audience", &self.oidc_audience),
                    ("--oidc-jwks-url", &self.oidc_jwks_url),
                ] {
                    if v.as_deref().is_none_or(str::is_empty) {
                        return Err(format!("{flag} is required with --identity-provider oidc"));
                    }
                }
            }
            IdentityProviderKind::Kubernetes => {
                // OIDC next to TokenReview: all three flags or none.
                let set = [&self.oidc_issuer, &self.oidc_audience, &self.oidc_jwks_url]
                    .iter()
                    .filter(|v| v.as_deref().is_some_and(|s| !s.is_empty()))
                    .count();
                if set != 0 && set != 3 {
                    return Err(
                        "--oidc-issuer, --oidc-audience and --oidc-jwks-url go together".into(),
                    );
                }
            }
        }
        if self.credentials_source == CredentialsSourceKind::File {
            match &self.credentials_file {
                None => {
                    return Err(
                        "--credentials-file (MAAS_CREDENTIALS_FILE) is required with --credentials-source file"
                            .into(),
                    );
                }
                Some(p) if !p.is_file() => {
                    return Err(format!("--credentials-file {}: no such file", p.display()));
                }
                Some(_) => {}
            }
        }
        if self.admin_groups.iter().any(|g| g.trim().is_empty()) {
            return Err("--admin-groups must not hold empty names".into());
        }
        if self.admin_sar_namespace.as_deref() == Some("") {
            return Err("--admin-sar-namespace must not be empty".into());
        }
        if self.admin_sar_resource.trim().is_empty() || self.admin_sar_verb.trim().is_empty() {
            return Err("--admin-sar-resource and --admin-sar-verb must not be empty".into());
        }
        if self.api_key_max_expiration_days == 0 {
            return Err("--api-key-max-expiration-days must be at least 1".into());
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err("--tls-cert and --tls-key must be given together".into());
        }
        if self.last_used_flush_interval_ms == 0 {
            return Err("--last-used-flush-interval-ms must be at least 1".into());
        }
        Ok(())
    }

    pub fn policy_reload_interval(&self) -> Duration {
        Duration::from_millis(self.policy_reload_interval_ms)
    }

    pub fn last_used_flush_interval(&self) -> Duration {
        Duration::from_millis(self.last_used_flush_interval_ms)
    }

    pub fn max_expiration(&self) -> Duration {
        Duration::from_secs(u64::from(self.api_key_max_expiration_days) * 86_400)
    }

    /// A configuration for tests and embedding: static identities, file credentials, all three
    /// listeners on 127.0.0.1 port 0, short intervals.
    pub fn for_local(
        database_url: &str,
        policy_file: PathBuf,
        identities_file: PathBuf,
        credentials_file: PathBuf,
    ) -> Config {
        Config {
            database_url: Some(SecretString::from(database_url.to_string())),
            db_connection_url: None,
            db_max_connections: 10,
            db_acquire_timeout_ms: 1000,
            public_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            internal_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            policy_file: Some(policy_file),
            policy_reload_interval_ms: 200,
            identity_provider: IdentityProviderKind::Static,
            identities_file: Some(identities_file),
            token_audiences: Vec::new(),
            oidc_issuer: None,
            oidc_audience: None,
            oidc_jwks_url: None,
            oidc_groups_claim: "groups".into(),
            credentials_source: CredentialsSourceKind::File,
            credentials_file: Some(credentials_file),
            credentials_namespace: None,
            admin_groups: vec!["maas-admins".into()],
            admin_sar_namespace: None,
            admin_sar_resource: "maasauthpolicies.maas.opendatahub.io".into(),
            admin_sar_verb: "create".into(),
            api_key_max_expiration_days: 90,
            tls_cert: None,
            tls_key: None,
            log_format: LogFormat::Text,
            key_cache_ttl_seconds: 60,
            token_cache_ttl_seconds: 30,
            token_negative_cache_ttl_seconds: 5,
            last_used_flush_interval_ms: 10_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        let mut all = vec!["maas-companion"];
        all.extend_from_slice(args);
        Config::try_parse_from(all).unwrap()
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
    }

    #[test]
    fn validation_names_the_flag() {
        let c = parse(&["--database-url", "postgres://x/y"]);
        assert!(c.validate().unwrap_err().contains("--policy-file"));
        let c = parse(&["--database-url", "mysql://x/y"]);
        assert!(c.validate().unwrap_err().contains("--database-url"));
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("p.yaml");
        std::fs::write(&policy, "tiers: []").unwrap();
        let c = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-file",
            policy.to_str().unwrap(),
            "--identity-provider",
            "static",
        ]);
        assert!(c.validate().unwrap_err().contains("--identities-file"));
        let c = parse(&[
            "--database-url",
            "postgres://x/y",
            "--policy-file",
            policy.to_str().unwrap(),
            "--admin-groups",
            "a,b",
            "--tls-cert",
            "/x",
        ]);
        assert_eq!(c.admin_groups, vec!["a".to_string(), "b".to_string()]);
        assert!(c.validate().unwrap_err().contains("--tls-cert"));
    }
}
