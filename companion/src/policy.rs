//! The policy: loaded from a YAML file (the ConfigMap), reloaded when its content changes,
//! served to the filter as JSON with an ETag and the list of recently revoked key ids.
//!
//! Warnings of a valid version (duplicate subscription priorities sharing an owner) are logged.
//! A new version that does not validate is rejected (log line + `maas_policy_reload_total
//! {result="rejected"}`) and the old one stays in force.

use crate::http::json_with_etag;
use crate::keys::store::{KeyStore, StoreError};
use crate::metrics::{Metrics, ResultLabels};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use maas_types::{PolicyDocument, PolicyError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Parses and validates a YAML policy; errors name the field.
pub fn parse_yaml(bytes: &[u8]) -> Result<PolicyDocument, PolicyError> {
    let de = yaml_serde::Deserializer::from_slice(bytes);
    maas_types::policy::from_deserializer(de)
}

#[derive(Debug, Clone)]
pub struct LoadedPolicy {
    pub document: Arc<PolicyDocument>,
    /// Unix seconds when this version was loaded (the `created` of listed models).
    pub loaded_at: i64,
}

/// The policy in force, shared by every handler; replaced by the reloader.
#[derive(Clone)]
pub struct PolicyHandle {
    current: Arc<RwLock<LoadedPolicy>>,
    path: PathBuf,
}

/// Logs what is valid but probably a mistake.
fn log_warnings(path: &Path, document: &PolicyDocument) {
    for warning in document.warnings() {
        tracing::warn!(path = %path.display(), %warning, "policy warning");
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl PolicyHandle {
    /// Loads the file; an invalid policy at start is an error (the service must not start).
    pub fn load(path: &Path) -> Result<(PolicyHandle, [u8; 32]), String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("policy file {}: {e}", path.display()))?;
        let document =
            parse_yaml(&bytes).map_err(|e| format!("policy file {}: {e}", path.display()))?;
        log_warnings(path, &document);
        let store = PolicyHandle {
            current: Arc::new(RwLock::new(LoadedPolicy {
                document: Arc::new(document),
                loaded_at: chrono::Utc::now().timestamp(),
            })),
            path: path.to_path_buf(),
        };
        Ok((store, digest(&bytes)))
    }

    pub fn current(&self) -> LoadedPolicy {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn document(&self) -> Arc<PolicyDocument> {
        self.current().document
    }

    /// A handle over a document built elsewhere (the Kubernetes resources: `crate::policy_source`);
    /// no file reloader is started for it.
    pub fn from_document(document: PolicyDocument, path: PathBuf) -> PolicyHandle {
        log_warnings(&path, &document);
        PolicyHandle {
            current: Arc::new(RwLock::new(LoadedPolicy {
                document: Arc::new(document),
                loaded_at: chrono::Utc::now().timestamp(),
            })),
            path,
        }
    }

    pub(crate) fn replace(&self, document: PolicyDocument) {
        let loaded = LoadedPolicy {
            document: Arc::new(document),
            loaded_at: chrono::Utc::now().timestamp(),
        };
        match self.current.write() {
            Ok(mut g) => *g = loaded,
            Err(poisoned) => *poisoned.into_inner() = loaded,
        }
    }

    /// Polls the file's content every `interval`; a changed, valid version replaces the current
    /// one. A rejected version is remembered so it is reported once, not at every poll.
    pub fn spawn_reloader(
        &self,
        interval: Duration,
        initial_digest: [u8; 32],
        metrics: Arc<Metrics>,
    ) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut last_seen = initial_digest;
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let bytes = match tokio::fs::read(&store.path).await {
                    Ok(b) => b,
                    Err(e) => {
                        // A ConfigMap update swaps a symlink: a missing file for a moment is normal.
                        tracing::debug!(path = %store.path.display(), error = %e, "policy file unreadable");
                        continue;
                    }
                };
                let d = digest(&bytes);
                if d == last_seen {
                    continue;
                }
                last_seen = d;
                match parse_yaml(&bytes) {
                    Ok(doc) => {
                        log_warnings(&store.path, &doc);
                        store.replace(doc);
                        metrics
                            .policy_reloads
                            .get_or_create(&ResultLabels { result: "accepted" })
                            .inc();
                        tracing::info!(path = %store.path.display(), "policy reloaded");
                    }
                    Err(e) => {
                        metrics
                            .policy_reloads
                            .get_or_create(&ResultLabels { result: "rejected" })
                            .inc();
                        tracing::warn!(path = %store.path.display(), error = %e, "new policy rejected, keeping the previous one");
                    }
                }
            }
        })
    }
}

/// The served policy carries the recent revocations: without the database it cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("revocation list unavailable: {0}")]
pub struct PolicyServeError(#[from] StoreError);

impl IntoResponse for PolicyServeError {
    fn into_response(self) -> Response {
        tracing::warn!(error = %self, "cannot serve the policy");
        let message = match self.0 {
            StoreError::NotReady => "revocation list unavailable: database not ready",
            StoreError::Database(_) => "revocation list unavailable: database unavailable",
        };
        crate::http::unavailable(message)
    }
}

/// `GET /internal/v1/policy`.
pub async fn serve(
    State(policy): State<PolicyHandle>,
    State(keys): State<KeyStore>,
    State(public): State<crate::public_url::PublicUrl>,
    headers: HeaderMap,
) -> Result<Response, PolicyServeError> {
    let mut doc = (*policy.document()).clone();
    // The filter's `GET /v1/models` gives each model its url from this, never from a Host.
    doc.public_url = public.0.as_deref().map(str::to_string);
    let revoked = keys.recently_revoked().await?;
    doc.revoked_key_ids.extend(revoked);
    doc.revoked_key_ids.sort();
    doc.revoked_key_ids.dedup();
    let body = serde_json::to_vec(&doc).unwrap_or_default();
    Ok(json_with_etag(&headers, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_policy_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/local/policy.yaml");
        let doc = parse_yaml(&std::fs::read(path).unwrap()).unwrap();
        assert!(doc.tier("free").is_some());
    }

    #[test]
    fn the_local_subscriptions_example_parses() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/local/policy-subscriptions.yaml");
        let doc = parse_yaml(&std::fs::read(path).unwrap()).unwrap();
        assert!(doc.subscription("team-a").is_some());
        assert!(doc.subscription("premium-sub").is_some());
        assert!(doc.warnings().is_empty(), "{:?}", doc.warnings());
        // The tiers are the local policy's, unchanged.
        let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/local/policy.yaml");
        let local = parse_yaml(&std::fs::read(local).unwrap()).unwrap();
        assert_eq!(doc.tiers, local.tiers);
        assert_eq!(doc.models, local.models);
    }

    #[test]
    fn yaml_errors_name_the_field() {
        let e = parse_yaml(b"tiers:\n  - name: free\n    level: 0\n    groups: [a]\n    limits: {requests: [{limit: 1, window: 0m}]}\n")
            .unwrap_err();
        assert!(
            e.to_string().contains("tiers[0].limits.requests[0].window"),
            "{e}"
        );
    }
}
