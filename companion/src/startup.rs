//! Wiring: state, the three routers, the three listeners, background tasks, shutdown.
//!
//! The public listener serves the key-management API (routed by the Gateway under
//! `/maas-api`); the internal listener serves `/internal/*` for the filter (and the cleanup
//! job); the metrics listener serves `/metrics` (and `/health`) for Prometheus and nothing else.
//! `/metrics` is a 404 on the public and internal listeners: the public one is reachable through
//! the Gateway without authentication, and whoever may reach the internal one can read the
//! provider credentials, which a scraper must not.
//!
//! If any listener stops while the process is meant to be serving, the process stops too,
//! with an error (the binary exits 1) so that Kubernetes restarts it: part of a companion (say,
//! the public API without the internal one) must not keep passing its probes.

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

/// What every listener shares: JSON 404 and 405, request metrics labelled with the listener,
/// the body limit.
fn layers(router: Router<AppState>, state: &AppState, listener: &'static str) -> Router {
    router
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

/// [`layers`] plus the probes, for the public and internal listeners.
fn common_layers(router: Router<AppState>, state: &AppState, listener: &'static str) -> Router {
    let router = router
        .route("/health", get(health))
        .route("/ready", get(ready));
    layers(router, state, listener)
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

/// `/metrics` and `/health`, nothing else: Prometheus may reach this listener and no other.
/// (`/ready` stays off it: a scrape target's health should not depend on the database.)
pub fn metrics_router(state: &AppState) -> Router {
    let router = Router::new()
        .route(
            "/metrics",
            get(metrics::serve).with_state(state.metrics.clone()),
        )
        .route("/health", get(health));
    layers(router, state, "metrics")
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
    metrics_addr: SocketAddr,
    state: AppState,
    handles: Vec<axum_server::Handle<SocketAddr>>,
    servers: Vec<(&'static str, JoinHandle<std::io::Result<()>>)>,
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
        let metrics_listener = bind(config.metrics_addr, "metrics")?;
        let public_addr = public_listener.local_addr()?;
        let internal_addr = internal_listener.local_addr()?;
        let metrics_addr = metrics_listener.local_addr()?;

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
        for (name, listener, router) in [
            ("public", public_listener, public_router(&state)),
            ("internal", internal_listener, internal_router(&state)),
            ("metrics", metrics_listener, metrics_router(&state)),
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
            servers.push((name, server));
        }
        tracing::info!(
            "listening public={public_addr} internal={internal_addr} metrics={metrics_addr}"
        );
        Ok(Application {
            public_addr,
            internal_addr,
            metrics_addr,
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

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
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

    /// Serves until `stop` completes, then shuts down gracefully: `Ok`. If a listener stops
    /// first (its task ended, failed or panicked), the others are drained too and the answer
    /// is an error naming the listener, so that the process exits non-zero.
    pub async fn run_until(
        mut self,
        stop: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let servers = std::mem::take(&mut self.servers);
        let handles = self.handles.clone();
        let outcome = supervise(stop, servers, move || {
            for h in &handles {
                h.graceful_shutdown(Some(Duration::from_secs(10)));
            }
        })
        .await;
        self.shutdown_background().await;
        outcome
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

/// Waits for `stop` or for the first server task to end, whichever comes first; then calls
/// `drain` (graceful shutdown of every listener) and waits up to 11 s for the servers. `Ok`
/// only when `stop` came first: a server ending on its own is an error naming it.
async fn supervise(
    stop: impl std::future::Future<Output = ()>,
    servers: Vec<(&'static str, JoinHandle<std::io::Result<()>>)>,
    drain: impl FnOnce(),
) -> anyhow::Result<()> {
    // Room for every server's report: a waiter blocked on a full channel would hold up the
    // drain below until its timeout.
    let (tx, mut first_ended) =
        tokio::sync::mpsc::channel::<(&'static str, String)>(servers.len().max(1));
    let mut waiters = tokio::task::JoinSet::new();
    for (name, server) in servers {
        let tx = tx.clone();
        waiters.spawn(async move {
            let how = match server.await {
                Ok(Ok(())) => "stopped".to_string(),
                Ok(Err(e)) => format!("failed: {e}"),
                Err(e) if e.is_panic() => "panicked".to_string(),
                Err(e) => format!("was cancelled: {e}"),
            };
            let _ = tx.send((name, how)).await;
        });
    }
    drop(tx);
    let outcome = tokio::select! {
        () = stop => {
            tracing::info!("shutting down");
            Ok(())
        }
        ended = first_ended.recv() => {
            let (name, how) = ended.unwrap_or(("every", "stopped".to_string()));
            tracing::error!(listener = name, "{name} listener {how}: shutting down");
            Err(anyhow::anyhow!("the {name} listener {how}; stopping so that it is restarted"))
        }
    };
    drain();
    let _ = tokio::time::timeout(Duration::from_secs(11), waiters.join_all()).await;
    outcome
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener task that serves until drained.
    fn serving(drained: &tokio::sync::watch::Sender<bool>) -> JoinHandle<std::io::Result<()>> {
        let mut drained = drained.subscribe();
        tokio::spawn(async move {
            let _ = drained.wait_for(|d| *d).await;
            Ok(())
        })
    }

    /// Supervises the three listeners, `dying_name` being `dying` and the others healthy (no
    /// stop requested); returns the outcome and whether the healthy ones were drained.
    async fn supervise_dying(
        dying_name: &'static str,
        dying: JoinHandle<std::io::Result<()>>,
    ) -> (anyhow::Result<()>, bool) {
        let (drain, _) = tokio::sync::watch::channel(false);
        let mut dying = Some(dying);
        let servers = ["public", "internal", "metrics"]
            .into_iter()
            .map(|name| match dying.take_if(|_| name == dying_name) {
                Some(task) => (name, task),
                None => (name, serving(&drain)),
            })
            .collect();
        let outcome = tokio::time::timeout(
            Duration::from_secs(5),
            supervise(std::future::pending(), servers, || {
                drain.send_replace(true);
            }),
        )
        .await
        .expect("supervise returns promptly when a listener dies");
        (outcome, *drain.borrow())
    }

    async fn supervise_with(dying: JoinHandle<std::io::Result<()>>) -> (anyhow::Result<()>, bool) {
        supervise_dying("internal", dying).await
    }

    #[tokio::test]
    async fn a_listener_that_fails_is_an_error_naming_it() {
        let dying = tokio::spawn(async { Err(std::io::Error::other("accept loop broke")) });
        let (outcome, drained) = supervise_with(dying).await;
        let message = format!("{:#}", outcome.expect_err("a failed listener is an error"));
        assert!(
            message.contains("internal listener failed: accept loop broke"),
            "{message}"
        );
        assert!(drained, "the other listener is drained");
    }

    #[tokio::test]
    async fn a_listener_that_panics_or_just_ends_is_an_error() {
        let panicking = tokio::spawn(async { panic!("listener bug") });
        let (outcome, _) = supervise_with(panicking).await;
        let message = format!(
            "{:#}",
            outcome.expect_err("a panicked listener is an error")
        );
        assert!(message.contains("internal listener panicked"), "{message}");

        let ending = tokio::spawn(async { Ok(()) });
        let (outcome, _) = supervise_with(ending).await;
        let message = format!(
            "{:#}",
            outcome.expect_err("a listener ending early is an error")
        );
        assert!(message.contains("internal listener stopped"), "{message}");
    }

    #[tokio::test]
    async fn the_metrics_listener_dying_stops_the_process_too() {
        let dying = tokio::spawn(async { Err(std::io::Error::other("accept loop broke")) });
        let (outcome, drained) = supervise_dying("metrics", dying).await;
        let message = format!("{:#}", outcome.expect_err("a failed listener is an error"));
        assert!(
            message.contains("metrics listener failed: accept loop broke"),
            "{message}"
        );
        assert!(drained, "the public and internal listeners are drained");
    }

    #[tokio::test]
    async fn stop_requested_first_is_a_clean_exit() {
        let (drain, _) = tokio::sync::watch::channel(false);
        let servers = vec![
            ("public", serving(&drain)),
            ("internal", serving(&drain)),
            ("metrics", serving(&drain)),
        ];
        let outcome = tokio::time::timeout(
            Duration::from_secs(5),
            supervise(std::future::ready(()), servers, || {
                drain.send_replace(true);
            }),
        )
        .await
        .expect("drained promptly");
        assert!(outcome.is_ok(), "{outcome:?}");
    }
}
