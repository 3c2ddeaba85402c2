//! Provider credentials for external models, served to the filter only
//! (`GET /internal/v1/credentials`, ETag).
//!
//! Sources: a YAML file `credentials: {ref: key}` (local stack, re-read at each request so edits
//! apply at once; an entry may also be a map of the Secret data keys below), or Kubernetes
//! Secrets named by the policy's `credentialRef` (cluster), data key `api-key` for a static key,
//! `service-account.json` or `credential-config.json` (workload identity federation, see
//! [`crate::cloud_tokens::gcp_federation`]) (`auth: gcpServiceAccount`) or `tenant-id`, `client-id`,
//! `client-secret` (`auth: azureClientCredentials`) for cloud credentials, which the companion
//! exchanges for short-lived access tokens ([`crate::cloud_tokens`]) and serves in their place,
//! or `aws-access-key-id`, `aws-secret-access-key`, optional `aws-session-token`
//! (`auth: awsSigV4`), from which it derives the day's SigV4 signing key for each region its
//! models name ([`crate::cloud_tokens::aws_sigv4`]) and serves that, never the secret key
//! (Secrets cached for [`SECRET_CACHE_TTL`], well under the filter's poll interval,
//! so a rotated Secret is served at the filter's next poll but one at worst, and the ETag makes
//! an unchanged set a 304). A bare `name` is read in the credentials namespace (the platform's:
//! `--credentials-namespace`); `namespace/name` in that namespace — models from ExternalModels
//! always name their own namespace, never the platform's. A Secret the companion may not read
//! (403: no RoleBinding in that namespace) or that is missing is left out and logged, as only
//! that model's credential: the others are still served. Values are never logged.

use crate::cloud_tokens::{AzureClientCredentials, CloudSecret, CloudTokens, GcpServiceAccountKey};
use crate::http::json_with_etag;
use crate::policy::PolicyHandle;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use maas_types::{CredentialsDocument, PolicyDocument, ProviderAuth};
use secrecy::{ExposeSecret, SecretString};
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

/// The Secret data key holding a provider's API key (`auth: apiKey`).
pub const SECRET_KEY: &str = "api-key";
/// `auth: gcpServiceAccount`: the Google service-account key file.
pub const GCP_KEY: &str = "service-account.json";
/// `auth: gcpServiceAccount` without a key: Google's `external_account` configuration.
pub const GCP_FEDERATION: &str = "credential-config.json";
/// `auth: azureClientCredentials`: the Entra application's tenant, client id and secret.
pub const AZURE_TENANT: &str = "tenant-id";
pub const AZURE_CLIENT_ID: &str = "client-id";
pub const AZURE_CLIENT_SECRET: &str = "client-secret";
/// `auth: awsSigV4`: the AWS access key (the session token for temporary credentials).
pub const AWS_ACCESS_KEY_ID: &str = "aws-access-key-id";
pub const AWS_SECRET_ACCESS_KEY: &str = "aws-secret-access-key";
pub const AWS_SESSION_TOKEN: &str = "aws-session-token";
/// Every Secret data key read (others are never loaded).
const DATA_KEYS: [&str; 9] = [
    SECRET_KEY,
    GCP_KEY,
    GCP_FEDERATION,
    AZURE_TENANT,
    AZURE_CLIENT_ID,
    AZURE_CLIENT_SECRET,
    AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN,
];

/// Where the long-lived credentials are read, and the access tokens obtained from them.
pub struct CredentialsSource {
    origin: Origin,
    tokens: CloudTokens,
}

enum Origin {
    File(PathBuf),
    Kubernetes {
        client: kube::Client,
        namespace: String,
        cache: Mutex<Option<Box<CachedSecrets>>>,
    },
}

/// One credential as its source holds it: Secret data keys → values (never logged).
type SecretData = BTreeMap<String, SecretString>;
/// The credentials read, by `credentialRef`.
type Raw = BTreeMap<String, SecretData>;

/// One read of the referenced Secrets: when, which, and what came of it.
pub struct CachedSecrets {
    at: Instant,
    refs: BTreeSet<String>,
    result: Result<Arc<Raw>, String>,
}

/// A file entry: a bare string (the API key) or the Secret's data keys.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum FileEntry {
    Key(String),
    Data(BTreeMap<String, String>),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsFile {
    #[serde(default)]
    credentials: BTreeMap<String, FileEntry>,
}

impl CredentialsSource {
    pub fn file(path: PathBuf, tokens: CloudTokens) -> CredentialsSource {
        CredentialsSource {
            origin: Origin::File(path),
            tokens,
        }
    }

    pub fn kubernetes(
        client: kube::Client,
        namespace: String,
        tokens: CloudTokens,
    ) -> CredentialsSource {
        CredentialsSource {
            origin: Origin::Kubernetes {
                client,
                namespace,
                cache: Mutex::new(None),
            },
            tokens,
        }
    }

    /// Checks the source can be read at start (file parses).
    pub fn check(&self) -> Result<(), String> {
        match &self.origin {
            Origin::File(path) => read_file(path).map(|_| ()),
            Origin::Kubernetes { .. } => Ok(()),
        }
    }

    /// What the filter gets: each API key as read, and for cloud credentials the current
    /// access token and its expiry (never the long-lived secret). A credential that cannot be
    /// used is left out and logged, as only its models' (503 `provider_credential_missing`).
    pub async fn load(&self, policy: &PolicyDocument) -> Result<CredentialsDocument, String> {
        let raw = self.read(policy).await?;
        Ok(resolve(policy, &raw, &self.tokens).await)
    }

    async fn read(&self, policy: &PolicyDocument) -> Result<Arc<Raw>, String> {
        let refs = credential_refs(policy);
        match &self.origin {
            Origin::File(path) => read_file(path).map(Arc::new),
            Origin::Kubernetes {
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
                let result = read_secrets(client, namespace, &refs).await.map(Arc::new);
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

/// Every credential the policy names: each model's provider's and its backends' providers'.
fn credential_refs(policy: &PolicyDocument) -> BTreeSet<String> {
    policy
        .models
        .iter()
        .flat_map(|m| m.providers().map(|p| p.credential_ref.clone()))
        .collect()
}

/// The credentials document from what was read: how each credential is used is its models'
/// `auth` (`apiKey` for a credential no model names).
async fn resolve(policy: &PolicyDocument, raw: &Raw, tokens: &CloudTokens) -> CredentialsDocument {
    let auth_of: BTreeMap<&str, ProviderAuth> = policy
        .models
        .iter()
        .flat_map(|m| m.providers())
        .map(|p| (p.credential_ref.as_str(), p.auth))
        .collect();
    let mut doc = CredentialsDocument::default();
    let mut cloud = Vec::new();
    for (reference, data) in raw {
        let auth = auth_of.get(reference.as_str()).copied().unwrap_or_default();
        if auth == ProviderAuth::AwsSigV4 {
            aws_signing_keys(policy, reference, data, &mut doc);
            continue;
        }
        let secret = match cloud_secret(auth, data) {
            Ok(None) => {
                match data.get(SECRET_KEY) {
                    Some(k) => {
                        doc.credentials
                            .insert(reference.clone(), k.expose_secret().trim().to_string());
                    }
                    None => {
                        tracing::warn!(credential = %reference, "credential has no `api-key` entry")
                    }
                }
                continue;
            }
            Ok(Some(secret)) => secret,
            Err(e) => {
                tracing::warn!(credential = %reference, auth = auth.as_str(), error = %e, "credential not usable");
                continue;
            }
        };
        cloud.push((reference, secret));
    }
    // Exchanged side by side: one slow token endpoint delays no other credential.
    let exchanged = futures::future::join_all(
        cloud
            .iter()
            .map(|(reference, secret)| tokens.token(reference, secret)),
    )
    .await;
    for ((reference, _), result) in cloud.iter().zip(exchanged) {
        match result {
            Ok(t) => {
                doc.credentials
                    .insert((*reference).clone(), t.value.expose_secret().to_string());
                doc.expires_at.insert((*reference).clone(), t.expires_at);
            }
            Err(e) => tracing::warn!(credential = %reference, error = %e, "no access token"),
        }
    }
    doc
}

/// The SigV4 signing keys of an AWS access key, for each region the models naming it sign for
/// (now: today's, near midnight tomorrow's too); the secret key stays here.
fn aws_signing_keys(
    policy: &PolicyDocument,
    reference: &str,
    data: &SecretData,
    doc: &mut CredentialsDocument,
) {
    use crate::cloud_tokens::aws_sigv4::{self, AwsAccessKey};
    let field = |k: &str| {
        data.get(k)
            .map(|v| v.expose_secret().trim())
            .filter(|v| !v.is_empty())
    };
    let (Some(id), Some(secret)) = (field(AWS_ACCESS_KEY_ID), field(AWS_SECRET_ACCESS_KEY)) else {
        tracing::warn!(credential = %reference, "credential has no `{AWS_ACCESS_KEY_ID}` and `{AWS_SECRET_ACCESS_KEY}` entries");
        return;
    };
    let key = AwsAccessKey {
        access_key_id: id.to_string(),
        secret_access_key: SecretString::from(secret),
        session_token: field(AWS_SESSION_TOKEN).map(SecretString::from),
    };
    if let Err(e) = key.check() {
        tracing::warn!(credential = %reference, error = %e, "credential not usable");
        return;
    }
    let regions: BTreeSet<&str> = policy
        .models
        .iter()
        .flat_map(|m| m.providers())
        .filter(|p| p.credential_ref == reference && p.auth == ProviderAuth::AwsSigV4)
        .filter_map(|p| p.region.as_deref())
        .collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let keys = regions
        .into_iter()
        .flat_map(|region| aws_sigv4::signing_keys(&key, region, now))
        .collect();
    doc.sigv4.insert(reference.to_string(), keys);
}

/// The cloud secret `auth` needs from `data` (`None`: an API key).
fn cloud_secret(
    auth: ProviderAuth,
    data: &SecretData,
) -> Result<Option<CloudSecret>, crate::cloud_tokens::TokenError> {
    use crate::cloud_tokens::TokenError;
    let field = |k: &str| {
        data.get(k)
            .map(|v| v.expose_secret().trim())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| TokenError::Invalid(format!("no `{k}` entry")))
    };
    Ok(match auth {
        // Derived, not exchanged: see `aws_signing_keys`.
        ProviderAuth::ApiKey | ProviderAuth::AwsSigV4 => None,
        // A key when the Secret has one, else a federation configuration.
        ProviderAuth::GcpServiceAccount => Some(match field(GCP_KEY) {
            Ok(key) => CloudSecret::Gcp(GcpServiceAccountKey::parse(key)?),
            Err(_) => match field(GCP_FEDERATION) {
                Ok(config) => CloudSecret::GcpFederated(Box::new(
                    crate::cloud_tokens::gcp_federation::ExternalAccount::parse(config)?,
                )),
                Err(_) => {
                    return Err(TokenError::Invalid(format!(
                        "no `{GCP_KEY}` or `{GCP_FEDERATION}` entry"
                    )));
                }
            },
        }),
        ProviderAuth::AzureClientCredentials => Some(CloudSecret::Azure(AzureClientCredentials {
            tenant_id: field(AZURE_TENANT)?.to_string(),
            client_id: field(AZURE_CLIENT_ID)?.to_string(),
            client_secret: SecretString::from(field(AZURE_CLIENT_SECRET)?),
        })),
    })
}

fn read_file(path: &PathBuf) -> Result<Raw, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("credentials file {}: {e}", path.display()))?;
    let file: CredentialsFile = yaml_serde::from_slice(&bytes)
        .map_err(|e| format!("credentials file {}: {e}", path.display()))?;
    Ok(file
        .credentials
        .into_iter()
        .map(|(reference, entry)| {
            let data = match entry {
                FileEntry::Key(k) => [(SECRET_KEY.to_string(), SecretString::from(k))].into(),
                FileEntry::Data(d) => d
                    .into_iter()
                    .map(|(k, v)| (k, SecretString::from(v)))
                    .collect(),
            };
            (reference, data)
        })
        .collect())
}

async fn read_secrets(
    client: &kube::Client,
    default_namespace: &str,
    refs: &BTreeSet<String>,
) -> Result<Raw, String> {
    use k8s_openapi::api::core::v1::Secret;
    let mut credentials = Raw::new();
    for reference in refs {
        let (namespace, name) = match maas_types::policy::split_credential_ref(reference) {
            (Some(ns), name) => (ns, name),
            (None, name) => (default_namespace, name),
        };
        let api: kube::Api<Secret> = kube::Api::namespaced(client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(secret)) => {
                let mut data = SecretData::new();
                for key in DATA_KEYS {
                    let value = secret
                        .data
                        .as_ref()
                        .and_then(|d| d.get(key))
                        .and_then(|v| String::from_utf8(v.0.clone()).ok())
                        .or_else(|| {
                            secret
                                .string_data
                                .as_ref()
                                .and_then(|d| d.get(key).cloned())
                        });
                    if let Some(v) = value {
                        data.insert(key.to_string(), SecretString::from(v));
                    }
                }
                if data.is_empty() {
                    tracing::warn!(secret = %name, %namespace, "Secret has none of the entries api-key, service-account.json, credential-config.json, tenant-id/client-id/client-secret, aws-access-key-id/aws-secret-access-key");
                } else {
                    credentials.insert(reference.clone(), data);
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
    Ok(credentials)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> PolicyDocument {
        let model = |name: &str, region: &str| {
            serde_json::json!({"name": name, "path": format!("/ext/{name}"), "tiers": ["free"],
                "upstreamCluster": format!("ext-{name}"),
                "provider": {"type": "bedrock", "credentialRef": "aws", "auth": "awsSigV4",
                             "region": region}})
        };
        PolicyDocument::from_value(serde_json::json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [model("a", "us-east-1"), model("b", "eu-west-1"), model("c", "us-east-1")]
        }))
        .unwrap()
    }

    /// The Secrets read (Kubernetes) are every provider's, a model's several backends' too.
    #[test]
    fn every_backends_credential_is_read() {
        let mut doc = policy();
        let backends = PolicyDocument::from_value(serde_json::json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [{"name": "gpt", "path": "/llm/gpt", "tiers": ["free"],
                "upstreamCluster": "gpt-backends", "backends": [
                    {"name": "a", "backend": "http://127.0.0.1:9001",
                     "provider": {"type": "openai", "credentialRef": "key-a"}},
                    {"name": "b", "backend": "http://127.0.0.1:9002",
                     "provider": {"type": "azure-openai", "credentialRef": "ns-1/key-b"}},
                    {"name": "local", "backend": "http://127.0.0.1:9003"}
                ]}]
        }))
        .unwrap();
        doc.models.extend(backends.models);
        assert_eq!(
            credential_refs(&doc),
            BTreeSet::from(["aws".to_string(), "key-a".into(), "ns-1/key-b".into()])
        );
    }

    /// An AWS access key: the filter gets a derived signing key per region its models name,
    /// never the secret key; a key without its secret is left out.
    #[tokio::test]
    async fn aws_access_keys_are_served_as_derived_signing_keys_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("credentials.yaml");
        std::fs::write(
            &path,
            "credentials:\n  aws: {aws-access-key-id: AKIDEXAMPLE, aws-secret-access-key: wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY, aws-session-token: tok-1}\n",
        )
        .unwrap();
        let tokens = CloudTokens::new("https://login.example").unwrap();
        let source = CredentialsSource::file(path.clone(), tokens);
        let doc = source.load(&policy()).await.unwrap();
        let keys = &doc.sigv4["aws"];
        let regions: BTreeSet<&str> = keys.iter().map(|k| k.region.as_str()).collect();
        assert_eq!(regions, BTreeSet::from(["eu-west-1", "us-east-1"]));
        assert!(keys.iter().all(|k| k.access_key_id == "AKIDEXAMPLE"
            && k.session_token.as_deref() == Some("tok-1")
            && k.signing_key.len() == 64));
        assert!(doc.credentials.is_empty());
        let served = serde_json::to_string(&doc).unwrap();
        assert!(!served.contains("wJalrXUtnFEMI"), "{served}");

        std::fs::write(
            &path,
            "credentials:\n  aws: {aws-access-key-id: AKIDEXAMPLE}\n",
        )
        .unwrap();
        let tokens = CloudTokens::new("https://login.example").unwrap();
        let doc = CredentialsSource::file(path, tokens)
            .load(&policy())
            .await
            .unwrap();
        assert!(doc.sigv4.is_empty(), "{doc:?}");
    }
}
