//! Provider credentials for external models, served to the filter only
//! (`GET /internal/v1/credentials`, ETag).
//!
//! Sources: a YAML file `credentials: {ref: key}` (local stack, re-read at each request so edits
//! apply at once), or Kubernetes Secrets named by the policy's `credentialRef`, data key
//! `api-key` (cluster; cached for [`SECRET_CACHE_TTL`], well under the filter's poll interval,
//! so a rotated Secret is served at the filter's next poll but one at worst, and the ETag makes
//! an unchanged set a 304). A bare `name` is read in the credentials namespace (the platform's:
//! `--credentials-namespace`); `namespace/name` in that namespace — models from ExternalModels
//! always name their own namespace, never the platform's. A Secret the companion may not read
//! (403: no RoleBinding in that namespace) or that is missing is left out and logged, as only
//! that model's credential: the others are still served. Values are never logged.

use crate::http::json_with_etag;
use crate::policy::PolicyHandle;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use maas_types::{CredentialsDocument, PolicyDocument};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// How long what was read from Kubernetes (the Secrets, or the failure to read them) is reused.
///
/// Well under the filter's default `pollIntervalMs` (2 s), so a rotated Secret is served within
/// 0.5 s. It also bounds the load on the API server whatever the number of pollers: reads happen
/// under the cache lock, so one replica sends at most one GET per referenced Secret per TTL, i.e.
/// 2 GETs per second per Secret (and none while nobody polls).
pub const SECRET_CACHE_TTL: Duration = Duration::from_millis(500);

/// The Secret data key holding a provider's API key.
pub const SECRET_KEY: &str = "api-key";

pub enum CredentialsSource {
    File(PathBuf),
    Kubernetes {
        client: kube::Client,
        namespace: String,
        cache: Mutex<Option<Box<CachedSecrets>>>,
    },
}

/// One read of the referenced Secrets: when, which, and what came of it.
pub struct CachedSecrets {
    at: Instant,
    refs: BTreeSet<String>,
    result: Result<CredentialsDocument, String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsFile {
    #[serde(default)]
    credentials: BTreeMap<String, String>,
}

impl CredentialsSource {
    pub fn kubernetes(client: kube::Client, namespace: String) -> CredentialsSource {
        CredentialsSource::Kubernetes {
            client,
            namespace,
            cache: Mutex::new(None),
        }
    }

    /// Checks the source can be read at start (file parses).
    pub fn check(&self) -> Result<(), String> {
        match self {
            CredentialsSource::File(path) => read_file(path).map(|_| ()),
            CredentialsSource::Kubernetes { .. } => Ok(()),
        }
    }

    pub async fn load(&self, policy: &PolicyDocument) -> Result<CredentialsDocument, String> {
        let refs: BTreeSet<String> = policy
            .models
            .iter()
            .filter_map(|m| m.provider.as_ref().map(|p| p.credential_ref.clone()))
            .collect();
        match self {
            CredentialsSource::File(path) => read_file(path),
            CredentialsSource::Kubernetes {
                client,
                namespace,
                cache,
            } => {
                // Held across the read: concurrent polls wait for one read instead of each
                // sending their own.
                let mut cache = cache.lock().await;
                if let Some(cached) = cache.as_ref()
                    && cached.at.elapsed() < SECRET_CACHE_TTL
                    && cached.refs == refs
                {
                    return cached.result.clone();
                }
                let result = read_secrets(client, namespace, &refs).await;
                *cache = Some(Box::new(CachedSecrets {
                    at: Instant::now(),
                    refs,
                    result: result.clone(),
                }));
                result
            }
        }
    }
}

fn read_file(path: &PathBuf) -> Result<CredentialsDocument, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("credentials file {}: {e}", path.display()))?;
    let file: CredentialsFile = yaml_serde::from_slice(&bytes)
        .map_err(|e| format!("credentials file {}: {e}", path.display()))?;
    Ok(CredentialsDocument {
        credentials: file.credentials,
    })
}

async fn read_secrets(
    client: &kube::Client,
    default_namespace: &str,
    refs: &BTreeSet<String>,
) -> Result<CredentialsDocument, String> {
    use k8s_openapi::api::core::v1::Secret;
    let mut credentials = BTreeMap::new();
    for reference in refs {
        let (namespace, name) = match maas_types::policy::split_credential_ref(reference) {
            (Some(ns), name) => (ns, name),
            (None, name) => (default_namespace, name),
        };
        let api: kube::Api<Secret> = kube::Api::namespaced(client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(secret)) => {
                let value = secret
                    .data
                    .as_ref()
                    .and_then(|d| d.get(SECRET_KEY))
                    .and_then(|v| String::from_utf8(v.0.clone()).ok())
                    .or_else(|| {
                        secret
                            .string_data
                            .as_ref()
                            .and_then(|d| d.get(SECRET_KEY).cloned())
                    });
                match value {
                    Some(v) => {
                        credentials.insert(reference.clone(), v.trim().to_string());
                    }
                    None => {
                        tracing::warn!(secret = %name, %namespace, "Secret has no `api-key` entry")
                    }
                }
            }
            Ok(None) => tracing::warn!(secret = %name, %namespace, "credential Secret not found"),
            // Not granted in that namespace: that model's credential only (its requests get
            // 503 provider_credential_missing), never the others'.
            Err(kube::Error::Api(status)) if status.is_forbidden() => tracing::warn!(
                secret = %name,
                %namespace,
                "credential Secret not readable: bind the ClusterRole maas-companion-provider-secrets to the companion's ServiceAccount in that namespace (docs/deploy.md)"
            ),
            Err(e) => return Err(format!("reading Secret {namespace}/{name}: {e}")),
        }
    }
    Ok(CredentialsDocument { credentials })
}

/// The credentials cannot be read now (file unreadable, Kubernetes API error).
#[derive(Debug, thiserror::Error)]
#[error("credentials unavailable: {0}")]
pub struct CredentialsError(String);

impl IntoResponse for CredentialsError {
    fn into_response(self) -> Response {
        tracing::warn!(error = %self, "cannot serve the credentials");
        crate::http::unavailable(self.to_string())
    }
}

/// `GET /internal/v1/credentials`.
pub async fn serve(
    State(policy): State<PolicyHandle>,
    State(source): State<Arc<CredentialsSource>>,
    headers: HeaderMap,
) -> Result<Response, CredentialsError> {
    let doc = source
        .load(&policy.document())
        .await
        .map_err(CredentialsError)?;
    let body = serde_json::to_vec(&doc).unwrap_or_default();
    Ok(json_with_etag(&headers, body))
}
