//! Whether a model's server is up, for `ready` in `GET /v1/models`: a probe of the server
//! (`GET <base>/v1/models`), cached per server for a TTL, bounded by a timeout so a slow or
//! silent server costs a listing at most that long and shows `false`.
//!
//! Up means: the server answered 2xx; for a model with a provider (an external API the
//! companion holds no key for in this probe) also 401 or 403 — the API answered, it only
//! wants the key the gateway injects. A refused connection, a timeout, a 5xx or any other
//! status is down. A model without a probe target (no `http(s)://` backend, `simulator`
//! without `--simulator-url`) is not known to be up: `false`.

use crate::settings::ModelProbeSettings;
use maas_types::Model;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One server's last answer; the lock also makes concurrent listings share one probe.
type Slot = Arc<tokio::sync::Mutex<Option<(bool, Instant)>>>;

/// The probes and their cache, shared by every listing.
#[derive(Clone)]
pub struct Readiness {
    settings: Arc<ModelProbeSettings>,
    http: reqwest::Client,
    slots: Arc<Mutex<HashMap<(String, bool), Slot>>>,
}

impl Readiness {
    pub fn new(settings: ModelProbeSettings) -> Readiness {
        let http = reqwest::Client::builder()
            .timeout(settings.timeout)
            .connect_timeout(settings.timeout)
            // A probe must not follow a redirect to somewhere else.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        Readiness {
            settings: Arc::new(settings),
            http,
            slots: Arc::default(),
        }
    }

    /// The URL probed for `model`: `<base>/v1/models`, or `None` (no probe target). A model
    /// with several backends: its first with a weight above 0 (see [`Readiness::probe_urls`]).
    pub fn probe_url(&self, model: &Model) -> Option<String> {
        self.probe_urls(model)
            .into_iter()
            .next()
            .map(|(url, _)| url)
    }

    /// Every URL probed for `model`: its server's, or each backend's with a weight above 0 (the
    /// model is ready when one of them answers: requests fail over to it, or routed backends
    /// are drawn among those that can serve), each with whether
    /// it is an external provider's (probed without its credential: a 401 or 403 is up).
    pub fn probe_urls(&self, model: &Model) -> Vec<(String, bool)> {
        if model.backends.is_empty() {
            let external = model.provider.is_some();
            return self
                .url_of(model.backend.as_deref(), external)
                .map(|url| (url, external))
                .into_iter()
                .collect();
        }
        model
            .backends
            .iter()
            .filter(|b| b.weight > 0)
            .filter_map(|b| {
                let external = b.provider.is_some();
                Some((self.url_of(b.backend.as_deref(), external)?, external))
            })
            .collect()
    }

    /// `<base>/v1/models` of a `backend` (`simulator` or none: the stack's simulator, unless
    /// `external`).
    fn url_of(&self, backend: Option<&str>, external: bool) -> Option<String> {
        let base = match backend {
            Some("simulator") | None if !external => self.settings.simulator_url.as_deref()?,
            Some(b) if b.starts_with("http://") || b.starts_with("https://") => b,
            _ => return None,
        };
        Some(format!("{}/v1/models", base.trim_end_matches('/')))
    }

    /// Whether each model's server is up (same order), probing those whose answer is older
    /// than the TTL, all at once; the whole call takes at most the probe timeout. A model with
    /// several backends is up when one of them is.
    pub async fn ready(&self, models: &[&Model]) -> Vec<bool> {
        let checks = models.iter().map(|m| {
            let targets = self.probe_urls(m);
            async move {
                if targets.is_empty() {
                    return false;
                }
                // Waiting for another listing's probe of the same server counts too.
                let any_up = futures::future::select_ok(targets.into_iter().map(|target| {
                    Box::pin(async move {
                        if self.check(target).await {
                            Ok(())
                        } else {
                            Err(())
                        }
                    })
                }));
                matches!(
                    tokio::time::timeout(self.settings.timeout, any_up).await,
                    Ok(Ok(_))
                )
            }
        });
        futures::future::join_all(checks).await
    }

    async fn check(&self, target: (String, bool)) -> bool {
        let slot = {
            let mut slots = self
                .slots
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slots.entry(target.clone()).or_default().clone()
        };
        // Another listing probing the same server: wait for its answer (the caller bounds it).
        let mut last = slot.lock().await;
        if let Some((up, at)) = *last
            && at.elapsed() < self.settings.ttl
        {
            return up;
        }
        let up = self.probe(&target.0, target.1).await;
        *last = Some((up, Instant::now()));
        up
    }

    async fn probe(&self, url: &str, has_provider: bool) -> bool {
        match self.http.get(url).send().await {
            Ok(r) => {
                let s = r.status();
                s.is_success() || (has_provider && matches!(s.as_u16(), 401 | 403))
            }
            Err(e) => {
                tracing::debug!(%url, error = %e, "model probe failed");
                false
            }
        }
    }
}
