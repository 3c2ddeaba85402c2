//! Wiring: builds the state from the [`Settings`], starts the three listeners and the
//! background tasks, supervises them, shuts down.
//!
//! If any listener stops while the process is meant to be serving, the process stops too,
//! with an error (the binary exits 1) so that Kubernetes restarts it: part of a companion (say,
//! the public API without the internal one) must not keep passing its probes.

use crate::authenticate::Authenticator;
use crate::credentials::CredentialsSource;
use crate::db::MigrationState;
use crate::identity::oidc::OidcVerifier;
use crate::identity::providers::{AdminSar, StaticIdentities, TokenReviewer};
use crate::identity::service::{IdentityService, Provider};
use crate::keys::store::KeyStore;
use crate::leases::{LeaseStore, Leases};
use crate::metrics::Metrics;
use crate::policy::PolicyHandle;
use crate::quota_webhook::store::WebhookStore;
use crate::routes::{internal_router, metrics_router, public_router};
use crate::settings::{
    ClientName, CredentialsSettings, IdentityProvider, IdentitySettings, InternalAuth,
    OidcSettings, Settings,
};
use crate::state::AppState;
use crate::usage::Usage;
use crate::usage::store::UsageStore;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How long the start waits for the first listing of the policy resources
/// (`--policy-source kubernetes`).
const POLICY_RESOURCES_WAIT: Duration = Duration::from_secs(10);

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

fn oidc_verifier(s: &OidcSettings) -> OidcVerifier {
    OidcVerifier::new(
        s.issuer.clone(),
        s.audience.clone(),
        s.jwks_url.clone(),
        s.groups_claim.clone(),
    )
}

/// The allowed callers for the start log: their names, or that any certificate from the CA is.
fn allowed_names(names: &[ClientName]) -> String {
    if names.is_empty() {
        return "any certificate from the CA".to_string();
    }
    names
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn kube_needed(client: Option<&kube::Client>) -> anyhow::Result<kube::Client> {
    client
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no Kubernetes client"))
}

/// The lease store the settings name. Redis is connected lazily: an unreachable Redis is a
/// warning, not a failed start (authentication must not depend on it).
async fn lease_store(settings: &Settings, metrics: &Arc<Metrics>) -> anyhow::Result<Leases> {
    let Some(redis) = &settings.leases.redis else {
        tracing::info!("budget leases: in process (no --redis-url; one companion only)");
        return Ok(Leases::new(
            LeaseStore::Memory(crate::leases::memory::MemoryStore::new()),
            metrics.clone(),
        ));
    };
    let store =
        crate::leases::redis::RedisStore::new(redis, metrics.leases.redis_round_trips.clone())
            .map_err(anyhow::Error::msg)?;
    let leases = Leases::new(LeaseStore::Redis(Box::new(store)), metrics.clone());
    if leases.reachable().await {
        tracing::info!(redis = %redis.endpoint, "budget leases: in Redis");
    } else {
        tracing::warn!(
            redis = %redis.endpoint,
            "budget leases: Redis unreachable at start; lease batches answer 503 until it answers (retried on each call)"
        );
    }
    Ok(leases)
}

/// The leases, observed by the quota webhook when `--quota-webhook-url` is given (its tasks
/// pushed to `background`); else unchanged (no task, no cost).
fn with_quota_webhook(
    leases: Leases,
    settings: &Settings,
    store: WebhookStore,
    policy: &PolicyHandle,
    metrics: &Arc<Metrics>,
    background: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<Leases> {
    let Some(webhook) = &settings.quota_webhook else {
        return Ok(leases);
    };
    let (observer, tasks) =
        crate::quota_webhook::start(webhook, store, policy.clone(), metrics.clone())?;
    background.extend(tasks);
    Ok(leases.observed_by(observer))
}

/// The file policy, loaded (and refused when invalid) before anything else starts, with its
/// digest; `None` with `--policy-source kubernetes`.
fn load_file_policy(settings: &Settings) -> anyhow::Result<Option<(PolicyHandle, [u8; 32])>> {
    let file_policy = match (&settings.policy.source, &settings.policy.file) {
        (crate::settings::PolicySource::File, Some(file)) => {
            Some(PolicyHandle::load(file).map_err(anyhow::Error::msg)?)
        }
        (crate::settings::PolicySource::File, None) => {
            anyhow::bail!("--policy-file is required with --policy-source file")
        }
        (crate::settings::PolicySource::Kubernetes { .. }, _) => None,
    };
    Ok(file_policy)
}

/// The Kubernetes client: the one given, else the environment's when a setting needs one.
async fn kube_client(
    overrides: Overrides,
    settings: &Settings,
) -> anyhow::Result<Option<kube::Client>> {
    let kube_client = match (overrides.kube_client, settings.needs_kubernetes()) {
    (Some(c), _) => Some(c),
    (None, true) => Some(kube::Client::try_default().await.map_err(|e| {
        anyhow::anyhow!(
            "Kubernetes client (needed by --identity-provider kubernetes, --credentials-source kubernetes or --admin-sar-namespace): {e}"
        )
    })?),
    (None, false) => None,
};
    Ok(kube_client)
}

/// The policy: the file's (with the task that reloads it), or the reference's resources (with
/// the tasks that watch them), waiting a while for their first listing.
async fn policy_handle(
    file_policy: Option<(PolicyHandle, [u8; 32])>,
    settings: &Settings,
    kube_client: Option<&kube::Client>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(PolicyHandle, Vec<JoinHandle<()>>)> {
    let mut policy_tasks = Vec::new();
    let (policy, policy_digest) = match (file_policy, &settings.policy.source) {
        (Some(loaded), _) => (loaded.0, Some(loaded.1)),
        (None, crate::settings::PolicySource::Kubernetes { namespace }) => {
            let source = crate::policy_source::KubernetesPolicy {
                client: kube_needed(kube_client)?,
                namespace: namespace.clone(),
                base_file: settings.policy.file.clone(),
                reload_interval: settings.policy.reload_interval,
                write_status: settings
                    .policy
                    .write_status
                    .then(|| crate::readiness::Readiness::new(settings.model_probe.clone())),
            };
            let initial = source.initial().map_err(anyhow::Error::msg)?;
            let handle = PolicyHandle::from_document(
                initial,
                std::path::PathBuf::from(format!("kubernetes:{namespace}")),
            );
            let (tasks, ready) = source.spawn(handle.clone(), metrics.clone());
            policy_tasks = tasks;
            // Serve the resources' policy from the first answer when the API server lists
            // them in time; else start with the base document and catch up.
            if tokio::time::timeout(POLICY_RESOURCES_WAIT, ready)
                .await
                .is_err()
            {
                tracing::warn!("policy resources not listed yet: starting with the base document");
            }
            (handle, None)
        }
        (None, crate::settings::PolicySource::File) => {
            anyhow::bail!("--policy-file is required with --policy-source file")
        }
    };
    if let Some(digest) = policy_digest {
        policy_tasks.push(policy.spawn_reloader(
            settings.policy.reload_interval,
            digest,
            metrics.clone(),
        ));
    }
    Ok((policy, policy_tasks))
}

/// Who callers are (the identity provider the settings name) and who is an admin.
fn identity_service(
    identity_settings: &IdentitySettings,
    kube_client: Option<&kube::Client>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Arc<IdentityService>> {
    let provider = match &identity_settings.provider {
        IdentityProvider::Static { identities_file } => {
            Provider::Static(StaticIdentities::load(identities_file).map_err(anyhow::Error::msg)?)
        }
        IdentityProvider::Kubernetes { audiences, oidc } => Provider::Kubernetes(
            TokenReviewer::new(kube_needed(kube_client)?, audiences.clone()),
            oidc.as_ref().map(oidc_verifier),
        ),
        IdentityProvider::Oidc(oidc) => Provider::Oidc(oidc_verifier(oidc)),
    };
    let admin_sar = match (&identity_settings.admin_sar, kube_client) {
        (Some(sar), Some(client)) => Some(AdminSar::new(
            client.clone(),
            sar.namespace.clone(),
            &sar.resource,
            sar.verb.clone(),
        )),
        _ => None,
    };
    let identity = Arc::new(IdentityService::new(
        provider,
        identity_settings.token_cache_ttl,
        identity_settings.token_negative_cache_ttl,
        identity_settings.admin_groups.clone(),
        admin_sar,
        metrics.clone(),
    ));
    Ok(identity)
}

/// Where provider credentials are read, checked once before the start goes on.
fn credentials_source(
    settings: &CredentialsSettings,
    azure_authority_url: &str,
    gcp_federation: &crate::cloud_tokens::gcp_federation::GcpFederation,
    kube_client: Option<&kube::Client>,
) -> anyhow::Result<CredentialsSource> {
    let tokens = crate::cloud_tokens::CloudTokens::new(azure_authority_url)
        .map_err(|e| anyhow::anyhow!("--azure-authority-url: {e}"))?
        .with_gcp_federation(gcp_federation.clone())
        .map_err(anyhow::Error::msg)?;
    let credentials = match settings {
        CredentialsSettings::File(path) => CredentialsSource::file(path.clone(), tokens),
        CredentialsSettings::Kubernetes { namespace } => {
            let client = kube_needed(kube_client)?;
            let namespace = namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string());
            CredentialsSource::kubernetes(client, namespace, tokens)
        }
    };
    credentials.check().map_err(anyhow::Error::msg)?;
    Ok(credentials)
}

/// The internal listener's mutual TLS (its certificate files are read now, so a bad one
/// stops the start), unless `--internal-auth none`.
fn internal_mtls(
    auth: &InternalAuth,
) -> anyhow::Result<Option<axum_server::tls_rustls::RustlsConfig>> {
    let internal_mtls = match auth {
        InternalAuth::Mtls(mtls) => {
            let config = crate::internal_tls::server_config(mtls)?;
            tracing::info!(
                client_ca = %mtls.client_ca.display(),
                allowed = %allowed_names(&mtls.client_names),
                "internal listener: mutual TLS, callers need a client certificate from the CA"
            );
            Some(axum_server::tls_rustls::RustlsConfig::from_config(
                Arc::new(config),
            ))
        }
        InternalAuth::None => None,
    };
    Ok(internal_mtls)
}

/// Applies the migrations once, in line, so a reachable database is ready when the start
/// returns; else the task that retries them in the background (503 meanwhile).
async fn migrate_at_start(pool: &sqlx::PgPool) -> (MigrationState, Option<JoinHandle<()>>) {
    let migrations = MigrationState::default();
    let mut retrying = None;
    match crate::db::MIGRATOR.run(pool).await {
        Ok(()) => migrations.set_done(),
        Err(e) => {
            tracing::warn!(error = %e, "migrations failed at start (database unreachable?), retrying in the background");
            retrying = Some(tokio::spawn(crate::db::migrate_with_retry(
                pool.clone(),
                migrations.clone(),
            )));
        }
    }
    (migrations, retrying)
}

/// The public (and metrics) listener's TLS, from `--tls-cert`/`--tls-key`.
async fn public_tls(
    files: Option<&crate::settings::TlsFiles>,
) -> anyhow::Result<Option<axum_server::tls_rustls::RustlsConfig>> {
    let tls = match files {
        Some(files) => Some(
            axum_server::tls_rustls::RustlsConfig::from_pem_file(&files.cert, &files.key)
                .await
                .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?,
        ),
        None => None,
    };
    Ok(tls)
}

/// The internal listener's TLS: mutual TLS unless explicitly turned off (then the public
/// listener's, with a warning).
fn internal_tls(
    mtls: Option<axum_server::tls_rustls::RustlsConfig>,
    tls: &Option<axum_server::tls_rustls::RustlsConfig>,
    internal_addr: SocketAddr,
) -> Option<axum_server::tls_rustls::RustlsConfig> {
    match mtls {
        Some(config) => Some(config),
        None => {
            tracing::warn!(
                "internal listener: NO caller authentication (--internal-auth none): whoever reaches {internal_addr} reads every provider credential; development only"
            );
            tls.clone()
        }
    }
}

/// Serves `router` on `listener` (over TLS when given; the internal listener counts and logs
/// refused handshakes): the handle that stops it and its task.
fn serve(
    name: &'static str,
    listener: std::net::TcpListener,
    router: axum::Router,
    tls: &Option<axum_server::tls_rustls::RustlsConfig>,
    metrics: &Metrics,
) -> anyhow::Result<(
    axum_server::Handle<SocketAddr>,
    JoinHandle<std::io::Result<()>>,
)> {
    let handle = axum_server::Handle::new();
    let service = router.into_make_service();
    let server = match tls {
        Some(tls) if name == "internal" => {
            let refused = metrics.internal_handshakes_failed.clone();
            tokio::spawn(
            axum_server::from_tcp_rustls(listener, tls.clone())?
                .accept_error_handler(move |peer, error| {
                    // A connection closed before its handshake began (a TCP probe,
                    // a port check) is no caller.
                    if error.kind() == std::io::ErrorKind::UnexpectedEof {
                        tracing::debug!(peer = ?peer, %error, "internal listener: connection closed before the TLS handshake");
                        return;
                    }
                    refused.inc();
                    tracing::warn!(
                        peer = ?peer,
                        %error,
                        "internal listener: connection refused at the TLS handshake"
                    );
                })
                .handle(handle.clone())
                .serve(service),
        )
        }
        Some(tls) => tokio::spawn(
            axum_server::from_tcp_rustls(listener, tls.clone())?
                .handle(handle.clone())
                .serve(service),
        ),
        None => tokio::spawn(
            axum_server::from_tcp(listener)?
                .handle(handle.clone())
                .serve(service),
        ),
    };
    Ok((handle, server))
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        Self::build_with(settings, Overrides::default()).await
    }

    pub async fn build_with(
        settings: Settings,
        overrides: Overrides,
    ) -> anyhow::Result<Application> {
        // One TLS crypto provider for every rustls user in the process (kube, axum-server).
        let _ = rustls::crypto::ring::default_provider().install_default();
        // How users are named in the logs, before anything logs one.
        crate::pseudonym::init(
            settings.log_pseudonyms.clone(),
            settings.pseudonym_key.clone(),
        );
        let metrics = Metrics::new();
        // The file policy is loaded (and refused when invalid) before anything else starts.
        let file_policy = load_file_policy(&settings)?;

        let kube_client = kube_client(overrides, &settings).await?;
        let (policy, policy_tasks) =
            policy_handle(file_policy, &settings, kube_client.as_ref(), &metrics).await?;
        let identity = identity_service(&settings.identity, kube_client.as_ref(), &metrics)?;
        let credentials = credentials_source(
            &settings.credentials,
            &settings.azure_authority_url,
            &settings.gcp_federation,
            kube_client.as_ref(),
        )?;
        // Its certificate files are read before anything listens: a bad one stops the start.
        let internal_mtls = internal_mtls(&settings.listeners.internal_auth)?;

        let pool = crate::db::pool(&settings.database).map_err(anyhow::Error::msg)?;

        let listeners = &settings.listeners;
        let public_listener = bind(listeners.public, "public")?;
        let internal_listener = bind(listeners.internal, "internal")?;
        let metrics_listener = bind(listeners.metrics, "metrics")?;
        let public_addr = public_listener.local_addr()?;
        let internal_addr = internal_listener.local_addr()?;
        let metrics_addr = metrics_listener.local_addr()?;

        let (migrations, retrying) = migrate_at_start(&pool).await;
        let mut background: Vec<JoinHandle<()>> =
            retrying.into_iter().chain(policy_tasks).collect();

        let usage = Usage::new(
            UsageStore::new(pool.clone(), migrations.clone()),
            metrics.clone(),
            settings.usage,
        );
        let keys = KeyStore::new(pool.clone(), migrations.clone());
        let state = AppState {
            keys: keys.clone(),
            key_settings: settings.keys,
            policy: policy.clone(),
            auth: Authenticator {
                keys: keys.clone(),
                identity,
                policy: policy.clone(),
                key_cache_ttl: settings.keys.cache_ttl,
            },
            credentials: Arc::new(credentials),
            metrics: metrics.clone(),
            leases: with_quota_webhook(
                lease_store(&settings, &metrics).await?,
                &settings,
                WebhookStore::new(pool, migrations),
                &policy,
                &metrics,
                &mut background,
            )?,
            usage: usage.clone(),
            public_url: crate::public_url::PublicUrl::new(settings.listeners.public_url.clone()),
            readiness: crate::readiness::Readiness::new(settings.model_probe.clone()),
        };
        background
            .push(keys.spawn_flusher(settings.keys.last_used_flush_interval, metrics.clone()));
        background.push(usage.spawn_rollup());

        let tls = public_tls(listeners.tls.as_ref()).await?;
        let internal_tls = internal_tls(internal_mtls, &tls, internal_addr);
        let mut handles = Vec::new();
        let mut servers = Vec::new();
        for (name, listener, router, tls) in [
            (
                "public",
                public_listener,
                public_router(&state, listeners.ui_dir.as_deref()),
                &tls,
            ),
            (
                "internal",
                internal_listener,
                internal_router(&state),
                &internal_tls,
            ),
            ("metrics", metrics_listener, metrics_router(&state), &tls),
        ] {
            let (handle, server) = serve(name, listener, router, tls, &metrics)?;
            handles.push(handle);
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

    /// Serves until SIGTERM/SIGINT, then drains connections (up to 10 s) and flushes
    /// `last_used_at`.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let signal = shutdown_signal();
        self.run_until(signal).await
    }

    /// Serves until `stop` completes, then shuts down gracefully: `Ok`. If a listener stops
    /// first (its task ended, failed or panicked), the others are drained too and the answer
    /// is an error naming the listener, so that the process exits non-zero.
    pub async fn run_until(mut self, stop: impl Future<Output = ()>) -> anyhow::Result<()> {
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
        self.state.keys.flush_last_used(&self.state.metrics).await;
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
    stop: impl Future<Output = ()>,
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

/// SIGTERM or SIGINT. The handlers are installed when this is called, not when the future is
/// first polled: a signal that arrives between the "listening" log line and the first poll
/// must stop the service gracefully, not kill it with the default action.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let terminate = signal(SignalKind::terminate()).ok();
        let interrupt = signal(SignalKind::interrupt()).ok();
        async move {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(terminate) => {},
                () = wait(interrupt) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
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
