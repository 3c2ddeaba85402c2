//! Wiring: state, the two routers, the two listeners, background tasks, shutdown.
//!
//! The public listener serves the key-management API (routed by the Gateway under
//! `/maas-api`); the internal listener serves `/internal/*` for the filter only. `/internal` on
//! the public listener is a 404.

use crate::config::{Config, CredentialsSourceKind, IdentityProviderKind};
use crate::credentials::CredentialsSource;
use crate::db::MigrationState;
use crate::http_error::{self, error_response};
use crate::identity::{AdminSar, IdentityService, Provider, StaticIdentities, TokenReviewer};
use crate::last_used::LastUsedRecorder;
use crate::metrics::{self, Metrics};
use crate::policy::PolicyStore;
use crate::{api_keys, authenticate, credentials, models, openapi, policy};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use sqlx::PgPool;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Request bodies larger than this are refused (413).
pub const BODY_LIMIT_BYTES: usize = 1024 * 1024;

#[derive(Clone)]
pub struct AppState {
    pub config: Arc<Config>,
    pub pool: PgPool,
    pub migrations: MigrationState,
    pub policy: PolicyStore,
    pub identity: Arc<IdentityService>,
    pub credentials: Arc<CredentialsSource>,
    pub last_used: LastUsedRecorder,
    pub metrics: Arc<Metrics>,
}

/// A public endpoint: listed here, routed in [`public_router`], described in `/openapi.json`
/// (a test checks the three agree).
pub struct PublicRoute {
    pub path: &'static str,
    pub methods: &'static [&'static str],
}

pub const PUBLIC_ROUTES: &[PublicRoute] = &[
    PublicRoute {
        path: "/v1/api-keys",
        methods: &["post"],
    },
    PublicRoute {
        path: "/v1/api-keys/search",
        methods: &["post"],
    },
    PublicRoute {
        path: "/v1/api-keys/bulk-revoke",
        methods: &["post"],
    },
    PublicRoute {
        path: "/v1/api-keys/config",
        methods: &["get"],
    },
    PublicRoute {
        path: "/v1/api-keys/{id}",
        methods: &["get", "delete"],
    },
    PublicRoute {
        path: "/v1/models",
        methods: &["get"],
    },
    PublicRoute {
        path: "/v1/tiers",
        methods: &["get"],
    },
    PublicRoute {
        path: "/health",
        methods: &["get"],
    },
    PublicRoute {
        path: "/ready",
        methods: &["get"],
    },
    PublicRoute {
        path: "/metrics",
        methods: &["get"],
    },
    PublicRoute {
        path: "/openapi.json",
        methods: &["get"],
    },
];

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "healthy"}))
}

/// Ready when migrations are applied and PostgreSQL answers.
async fn ready(State(state): State<AppState>) -> Response {
    if state.migrations.is_done() && crate::db::ping(&state.pool).await {
        Json(serde_json::json!({"status": "ready"})).into_response()
    } else {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "database unreachable",
            http_error::UNAVAILABLE,
            Some("not_ready"),
        )
    }
}

fn common_layers(router: Router<AppState>, state: &AppState, listener: &'static str) -> Router {
    router
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route(
            "/metrics",
            get(metrics::serve).with_state(state.metrics.clone()),
        )
        .fallback(http_error::no_route)
        .layer(axum::middleware::from_fn(
            http_error::json_method_not_allowed,
        ))
        .layer(axum::middleware::from_fn_with_state(
            (state.metrics.clone(), listener),
            metrics::track,
        ))
        .layer(DefaultBodyLimit::max(BODY_LIMIT_BYTES))
        .with_state(state.clone())
}

pub fn public_router(state: &AppState) -> Router {
    let router = Router::new()
        .route("/v1/api-keys", post(api_keys::create))
        .route("/v1/api-keys/search", post(api_keys::search))
        .route("/v1/api-keys/bulk-revoke", post(api_keys::bulk_revoke))
        .route("/v1/api-keys/config", get(api_keys::config))
        .route(
            "/v1/api-keys/{id}",
            get(api_keys::get).merge(delete(api_keys::revoke)),
        )
        .route("/v1/models", get(models::list))
        .route("/v1/tiers", get(models::tiers))
        .route("/openapi.json", get(openapi::serve));
    common_layers(router, state, "public")
}

pub fn internal_router(state: &AppState) -> Router {
    let router = Router::new()
        .route("/internal/v1/authenticate", post(authenticate::handler))
        .route("/internal/v1/policy", get(policy::serve))
        .route("/internal/v1/credentials", get(credentials::serve))
        .route("/internal/v1/api-keys/cleanup", post(api_keys::cleanup));
    common_layers(router, state, "internal")
}

/// Overrides for embedding and tests.
#[derive(Default)]
pub struct Overrides {
    /// Kubernetes client to use instead of the one inferred from the environment.
    pub kube_client: Option<kube::Client>,
}

pub struct Application {
    public_addr: SocketAddr,
    internal_addr: SocketAddr,
    state: AppState,
    handles: Vec<axum_server::Handle<SocketAddr>>,
    servers: Vec<JoinHandle<std::io::Result<()>>>,
    background: Vec<JoinHandle<()>>,
}

fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)
        .map_err(|e| anyhow::anyhow!("cannot listen on {what} address {addr}: {e}"))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

impl Application {
    pub async fn build(config: Config) -> anyhow::Result<Application> {
        Self::build_with(config, Overrides::default()).await
    }

    pub async fn build_with(config: Config, overrides: Overrides) -> anyhow::Result<Application> {
        // One TLS crypto provider for every rustls user in the process (kube, axum-server).
        let _ = rustls::crypto::ring::default_provider().install_default();
        config.validate().map_err(anyhow::Error::msg)?;
        let metrics = Metrics::new();
        let policy_path = config
            .policy_file
            .clone()
            .ok_or_else(|| anyhow::anyhow!("--policy-file is required"))?;
        let (policy, policy_digest) =
            PolicyStore::load(&policy_path).map_err(anyhow::Error::msg)?;

        let needs_kube = config.identity_provider == IdentityProviderKind::Kubernetes
            || config.credentials_source == CredentialsSourceKind::Kubernetes
            || config.admin_sar_namespace.is_some();
        let kube_client = match (overrides.kube_client, needs_kube) {
            (Some(c), _) => Some(c),
            (None, true) => Some(kube::Client::try_default().await.map_err(|e| {
                anyhow::anyhow!(
                    "Kubernetes client (needed by --identity-provider kubernetes, --credentials-source kubernetes or --admin-sar-namespace): {e}"
                )
            })?),
            (None, false) => None,
        };
        let provider = match config.identity_provider {
            IdentityProviderKind::Static => {
                let path = config.identities_file.clone().unwrap_or_default();
                Provider::Static(StaticIdentities::load(&path).map_err(anyhow::Error::msg)?)
            }
            IdentityProviderKind::Kubernetes => Provider::Kubernetes(
                TokenReviewer::new(
                    kube_client
                        .clone()
                        .ok_or_else(|| anyhow::anyhow!("no Kubernetes client"))?,
                    config.token_audiences.clone(),
                ),
                match (
                    &config.oidc_issuer,
                    &config.oidc_audience,
                    &config.oidc_jwks_url,
                ) {
                    (Some(issuer), Some(audience), Some(jwks)) => {
                        Some(crate::oidc::OidcVerifier::new(
                            issuer.clone(),
                            audience.clone(),
                            jwks.clone(),
                            config.oidc_groups_claim.clone(),
                        ))
                    }
                    _ => None,
                },
            ),
            IdentityProviderKind::Oidc => Provider::Oidc(crate::oidc::OidcVerifier::new(
                config.oidc_issuer.clone().unwrap_or_default(),
                config.oidc_audience.clone().unwrap_or_default(),
                config.oidc_jwks_url.clone().unwrap_or_default(),
                config.oidc_groups_claim.clone(),
            )),
        };
        let identity = Arc::new(IdentityService::new(
            provider,
            Duration::from_secs(config.token_cache_ttl_seconds),
            Duration::from_secs(config.token_negative_cache_ttl_seconds),
            config.admin_groups.clone(),
            match (&config.admin_sar_namespace, &kube_client) {
                (Some(namespace), Some(client)) => Some(AdminSar::new(
                    client.clone(),
                    namespace.clone(),
                    &config.admin_sar_resource,
                    config.admin_sar_verb.clone(),
                )),
                _ => None,
            },
            metrics.clone(),
        ));
        let credentials = match config.credentials_source {
            CredentialsSourceKind::File => {
                CredentialsSource::File(config.credentials_file.clone().unwrap_or_default())
            }
            CredentialsSourceKind::Kubernetes => {
                let client = kube_client
                    .clone()
                    .ok_or_else(|| anyhow::anyhow!("no Kubernetes client"))?;
                let namespace = config
                    .credentials_namespace
                    .clone()
                    .unwrap_or_else(|| client.default_namespace().to_string());
                CredentialsSource::kubernetes(client, namespace)
            }
        };
        credentials.check().map_err(anyhow::Error::msg)?;

        let url = config
            .database_url()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("--database-url is required"))?;
        let pool = crate::db::pool(
            &url,
            config.db_max_connections,
            Duration::from_millis(config.db_acquire_timeout_ms),
        )
        .map_err(anyhow::Error::msg)?;

        let public_listener = bind(config.public_addr, "public")?;
        let internal_listener = bind(config.internal_addr, "internal")?;
        let public_addr = public_listener.local_addr()?;
        let internal_addr = internal_listener.local_addr()?;

        let migrations = MigrationState::default();
        let mut background = Vec::new();
        // Try once in line so a reachable database is ready when build returns; otherwise keep
        // retrying in the background and serve 503 meanwhile.
        match crate::db::MIGRATOR.run(&pool).await {
            Ok(()) => migrations.set_done(),
            Err(e) => {
                tracing::warn!(error = %e, "migrations failed at start (database unreachable?), retrying in the background");
                background.push(tokio::spawn(crate::db::migrate_with_retry(
                    pool.clone(),
                    migrations.clone(),
                )));
            }
        }

        let config = Arc::new(config);
        let last_used = LastUsedRecorder::default();
        let state = AppState {
            config: config.clone(),
            pool: pool.clone(),
            migrations,
            policy: policy.clone(),
            identity,
            credentials: Arc::new(credentials),
            last_used: last_used.clone(),
            metrics: metrics.clone(),
        };
        background.push(policy.spawn_reloader(
            config.policy_reload_interval(),
            policy_digest,
            metrics.clone(),
        ));
        background.push(last_used.spawn_flusher(
            pool.clone(),
            config.last_used_flush_interval(),
            metrics.clone(),
        ));

        let tls = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(
                axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
                    .await
                    .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?,
            ),
            _ => None,
        };
        let mut handles = Vec::new();
        let mut servers = Vec::new();
        for (listener, router) in [
            (public_listener, public_router(&state)),
            (internal_listener, internal_router(&state)),
        ] {
            let handle = axum_server::Handle::new();
            handles.push(handle.clone());
            let service = router.into_make_service();
            let server = match &tls {
                Some(tls) => tokio::spawn(
                    axum_server::from_tcp_rustls(listener, tls.clone())?
                        .handle(handle)
                        .serve(service),
                ),
                None => tokio::spawn(
                    axum_server::from_tcp(listener)?
                        .handle(handle)
                        .serve(service),
                ),
            };
            servers.push(server);
        }
        tracing::info!("listening public={public_addr} internal={internal_addr}");
        Ok(Application {
            public_addr,
            internal_addr,
            state,
            handles,
            servers,
            background,
        })
    }

    pub fn public_addr(&self) -> SocketAddr {
        self.public_addr
    }

    pub fn internal_addr(&self) -> SocketAddr {
        self.internal_addr
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until SIGTERM/SIGINT, then drains connections (up to 10 s) and flushes
    /// `last_used_at`.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let signal = shutdown_signal();
        self.run_until(signal).await
    }

    /// Serves until `stop` completes (or a server fails), then shuts down gracefully.
    pub async fn run_until(
        mut self,
        stop: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let servers = std::mem::take(&mut self.servers);
        let mut servers = futures_join(servers);
        tokio::select! {
            () = stop => {
                tracing::info!("shutting down");
            }
            res = &mut servers => {
                tracing::error!(?res, "a listener stopped");
            }
        }
        for h in &self.handles {
            h.graceful_shutdown(Some(Duration::from_secs(10)));
        }
        let _ = tokio::time::timeout(Duration::from_secs(11), servers).await;
        self.shutdown_background().await;
        Ok(())
    }

    async fn shutdown_background(&mut self) {
        for task in self.background.drain(..) {
            task.abort();
        }
        self.state
            .last_used
            .flush(&self.state.pool, &self.state.metrics)
            .await;
    }
}

impl Drop for Application {
    fn drop(&mut self) {
        for h in &self.handles {
            h.shutdown();
        }
        for task in &self.background {
            task.abort();
        }
    }
}

/// Resolves when the first of the servers stops.
fn futures_join(
    servers: Vec<JoinHandle<std::io::Result<()>>>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>> {
    Box::pin(async move {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(servers.len().max(1));
        for s in servers {
            let tx = tx.clone();
            tokio::spawn(async move {
                let r = match s.await {
                    Ok(Ok(())) => "stopped".to_string(),
                    Ok(Err(e)) => format!("error: {e}"),
                    Err(e) => format!("panicked: {e}"),
                };
                let _ = tx.send(r).await;
            });
        }
        drop(tx);
        rx.recv().await.unwrap_or_default()
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}
