//! Where a cluster identity comes from: a static file of tokens, a Kubernetes TokenReview,
//! and the admin SubjectAccessReview. (OIDC: [`crate::identity::oidc`].)

use crate::identity::{Identity, IdentityError};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The static identities file: tokens → user and groups.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentitiesFile {
    identities: Vec<StaticIdentityEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticIdentityEntry {
    token: SecretString,
    username: String,
    #[serde(default)]
    groups: Vec<String>,
}

pub struct StaticIdentities {
    by_token_hash: HashMap<[u8; 32], (String, Vec<String>)>,
}

pub fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl StaticIdentities {
    pub fn load(path: &Path) -> Result<StaticIdentities, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("identities file {}: {e}", path.display()))?;
        let file: IdentitiesFile = yaml_serde::from_slice(&bytes)
            .map_err(|e| format!("identities file {}: {e}", path.display()))?;
        let mut by_token_hash = HashMap::new();
        for (i, entry) in file.identities.into_iter().enumerate() {
            let token = entry.token.expose_secret();
            if token.is_empty() || entry.username.trim().is_empty() {
                return Err(format!(
                    "identities file {}: identities[{i}]: token and username must not be empty",
                    path.display()
                ));
            }
            if maas_types::apikey::has_key_prefix(token) {
                return Err(format!(
                    "identities file {}: identities[{i}].token must not look like an API key",
                    path.display()
                ));
            }
            by_token_hash.insert(token_hash(token), (entry.username, entry.groups));
        }
        Ok(StaticIdentities { by_token_hash })
    }

    pub fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
        self.by_token_hash
            .get(&token_hash(token))
            .map(|(username, groups)| Identity {
                username: username.clone(),
                groups: groups.clone(),
                expires_at: None,
            })
            .ok_or(IdentityError::InvalidToken)
    }
}

/// Kubernetes TokenReview through the API server.
pub struct TokenReviewer {
    client: kube::Client,
    audiences: Vec<String>,
}

impl TokenReviewer {
    pub fn new(client: kube::Client, audiences: Vec<String>) -> TokenReviewer {
        TokenReviewer { client, audiences }
    }

    pub async fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
        use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
        let api: kube::Api<TokenReview> = kube::Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: (!self.audiences.is_empty()).then(|| self.audiences.clone()),
            },
            ..Default::default()
        };
        let answer = api
            .create(&kube::api::PostParams::default(), &review)
            .await
            .map_err(|e| IdentityError::Unavailable(format!("TokenReview failed: {e}")))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(IdentityError::InvalidToken);
        }
        if !audiences_granted(&self.audiences, status.audiences.as_deref()) {
            return Err(IdentityError::InvalidToken);
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        if username.is_empty() {
            return Err(IdentityError::InvalidToken);
        }
        Ok(Identity {
            username,
            groups: user.groups.unwrap_or_default(),
            expires_at: unverified_jwt_exp(token),
        })
    }
}

/// Whether a TokenReview answer grants the audiences that were asked for. The API server answers
/// a review that named audiences with the ones the token is valid for among them
/// (`status.audiences`, the intersection): none, or no such field, means the token is not for
/// us, even when `authenticated` is true (an authenticator that ignored the audiences). No
/// audiences asked: the API server's default audience applied, nothing to check.
fn audiences_granted(requested: &[String], granted: Option<&[String]>) -> bool {
    requested.is_empty()
        || granted.is_some_and(|granted| granted.iter().any(|a| requested.contains(a)))
}

/// The `exp` claim of a JWT-shaped token, read WITHOUT verifying it. Used only to shorten how
/// long a TokenReview answer is cached (service account tokens are JWTs), never to trust it.
pub fn unverified_jwt_exp(token: &str) -> Option<i64> {
    unverified_jwt_claims(token)?.get("exp")?.as_i64()
}

/// The claims of a JWT-shaped token, NOT verified: only for routing and cache bounds.
pub fn unverified_jwt_claims(token: &str) -> Option<serde_json::Value> {
    use base64::Engine;
    let mut parts = token.split('.');
    let (_, payload, _) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Admin by SubjectAccessReview.
pub struct AdminSar {
    client: kube::Client,
    namespace: String,
    resource: String,
    group: String,
    verb: String,
    cache: Mutex<HashMap<[u8; 32], (bool, Instant)>>,
}

const SAR_ALLOWED_TTL: Duration = Duration::from_secs(30);
const SAR_DENIED_TTL: Duration = Duration::from_secs(2);
/// Cap on cached SubjectAccessReview answers; when full, expired entries go first.
const SAR_CACHE_MAX: usize = 50_000;

impl AdminSar {
    /// `resource_and_group` is `resource.group` (e.g. `maasauthpolicies.maas.opendatahub.io`);
    /// a bare `resource` means the core group.
    pub fn new(
        client: kube::Client,
        namespace: String,
        resource_and_group: &str,
        verb: String,
    ) -> AdminSar {
        let (resource, group) = resource_and_group
            .split_once('.')
            .unwrap_or((resource_and_group, ""));
        AdminSar {
            client,
            namespace,
            resource: resource.to_string(),
            group: group.to_string(),
            verb,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub async fn allows(&self, identity: &Identity) -> bool {
        use k8s_openapi::api::authorization::v1::{
            ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
        };
        let mut h = Sha256::new();
        h.update(identity.username.as_bytes());
        for g in &identity.groups {
            h.update([0u8]);
            h.update(g.as_bytes());
        }
        let key: [u8; 32] = h.finalize().into();
        let now = Instant::now();
        if let Ok(cache) = self.cache.lock()
            && let Some((allowed, until)) = cache.get(&key)
            && *until > now
        {
            return *allowed;
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(identity.username.clone()),
                groups: Some(identity.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(self.namespace.clone()),
                    group: Some(self.group.clone()),
                    resource: Some(self.resource.clone()),
                    verb: Some(self.verb.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: kube::Api<SubjectAccessReview> = kube::Api::all(self.client.clone());
        let allowed = match api.create(&kube::api::PostParams::default(), &review).await {
            Ok(answer) => answer.status.is_some_and(|s| s.allowed),
            Err(e) => {
                tracing::warn!(error = %e, "admin SubjectAccessReview failed: treating as not admin");
                return false;
            }
        };
        let ttl = if allowed {
            SAR_ALLOWED_TTL
        } else {
            SAR_DENIED_TTL
        };
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= SAR_CACHE_MAX {
                cache.retain(|_, (_, until)| *until > now);
            }
            cache.insert(key, (allowed, now + ttl));
        }
        allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_review_audiences_must_intersect_what_was_asked() {
        let asked = ["maas".to_string(), "maas-b".to_string()];
        let maas = ["maas".to_string()];
        let other = ["https://kubernetes.default.svc".to_string()];
        assert!(audiences_granted(&asked, Some(&maas)));
        assert!(!audiences_granted(&asked, Some(&other)), "no intersection");
        assert!(!audiences_granted(&asked, Some(&[])), "empty intersection");
        assert!(!audiences_granted(&asked, None), "field missing");
        assert!(audiences_granted(&[], None), "none asked");
        assert!(audiences_granted(&[], Some(&other)), "none asked");
    }

    #[test]
    fn jwt_exp_is_read_only_from_jwt_shapes() {
        // {"alg":"none"} . {"exp":1700000000,"sub":"x"} . sig
        let token = "eyJhbGciOiJub25lIn0.eyJleHAiOjE3MDAwMDAwMDAsInN1YiI6IngifQ.c2ln";
        assert_eq!(unverified_jwt_exp(token), Some(1_700_000_000));
        assert_eq!(unverified_jwt_exp("alice-token"), None);
        assert_eq!(unverified_jwt_exp("a.b.c"), None);
        assert_eq!(unverified_jwt_exp("a.b.c.d"), None);
    }
}
