//! Who is calling: cluster identities (static file, Kubernetes TokenReview, OIDC JWT) and
//! the public API's caller extractor.
//!
//! Identity comes only from the credential (`Authorization: Bearer …` or `x-api-key`). Headers
//! in the reserved `x-maas-*` namespace are never read: whatever sets them, they are not proof.
//!
//! Token checks are cached by SHA-256 of the token (the token itself is never kept as a key):
//! positive answers for `--token-cache-ttl-seconds`, never past the token's own expiry; refusals
//! for `--token-negative-cache-ttl-seconds`. "Cannot decide" (provider unreachable) is never
//! cached.
//!
//! Admin = membership of one of `--admin-groups` (the group list is part of the cached
//! identity, so the check is cached with it), or, when `--admin-sar-namespace` is set, a
//! SubjectAccessReview ("may `create` `maasauthpolicies.maas.opendatahub.io` in that
//! namespace", as the reference implementation does), cached 30 s when allowed and 2 s when
//! not; an API server error means "not admin" (fail closed) and is not cached.

use crate::authenticate::{self, AuthError};
use crate::startup::AppState;
use axum::extract::FromRequestParts;
use axum::http::HeaderMap;
use axum::http::request::Parts;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub username: String,
    pub groups: Vec<String>,
    /// Unix seconds when the token stops being valid, when known (OIDC `exp`).
    pub expires_at: Option<i64>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum IdentityError {
    #[error("invalid token")]
    InvalidToken,
    #[error("identity provider unavailable: {0}")]
    Unavailable(String),
}

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

fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl StaticIdentities {
    pub fn load(path: &Path) -> Result<StaticIdentities, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("identities file {}: {e}", path.display()))?;
        let file: IdentitiesFile = serde_yaml::from_slice(&bytes)
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

    fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
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

    async fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
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
fn unverified_jwt_claims(token: &str) -> Option<serde_json::Value> {
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

    async fn allows(&self, identity: &Identity) -> bool {
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
            if cache.len() >= TOKEN_CACHE_MAX {
                cache.retain(|_, (_, until)| *until > now);
            }
            cache.insert(key, (allowed, now + ttl));
        }
        allowed
    }
}

pub enum Provider {
    Static(StaticIdentities),
    /// TokenReview; with an OIDC verifier, JWTs whose (unverified) `iss` is its issuer are
    /// verified locally instead — the signature check decides, the `iss` only routes.
    Kubernetes(TokenReviewer, Option<crate::oidc::OidcVerifier>),
    Oidc(crate::oidc::OidcVerifier),
}

impl Provider {
    async fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
        match self {
            Provider::Static(s) => s.verify(token),
            Provider::Kubernetes(_, Some(oidc))
                if unverified_jwt_claims(token)
                    .and_then(|c| c.get("iss")?.as_str().map(str::to_string))
                    .is_some_and(|iss| iss == oidc.issuer()) =>
            {
                oidc.verify(token).await
            }
            Provider::Kubernetes(k, _) => k.verify(token).await,
            Provider::Oidc(o) => o.verify(token).await,
        }
    }
}

struct CacheEntry {
    result: Result<Identity, IdentityError>,
    until: Instant,
}

/// Cap on cached token answers; when full, expired entries go first, then everything.
const TOKEN_CACHE_MAX: usize = 50_000;

pub struct IdentityService {
    provider: Provider,
    cache: Mutex<HashMap<[u8; 32], CacheEntry>>,
    positive_ttl: Duration,
    negative_ttl: Duration,
    admin_groups: Vec<String>,
    admin_sar: Option<AdminSar>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
}

impl IdentityService {
    pub fn new(
        provider: Provider,
        positive_ttl: Duration,
        negative_ttl: Duration,
        admin_groups: Vec<String>,
        admin_sar: Option<AdminSar>,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
    ) -> IdentityService {
        IdentityService {
            provider,
            cache: Mutex::new(HashMap::new()),
            positive_ttl,
            negative_ttl,
            admin_groups,
            admin_sar,
            metrics,
        }
    }

    pub fn positive_ttl(&self) -> Duration {
        self.positive_ttl
    }

    /// Checks a cluster token (cached, see the module doc).
    pub async fn verify_token(&self, token: &str) -> Result<Identity, IdentityError> {
        let key = token_hash(token);
        let now = Instant::now();
        if let Ok(cache) = self.cache.lock()
            && let Some(entry) = cache.get(&key)
            && entry.until > now
        {
            self.metrics.token_cache_hits.inc();
            return entry.result.clone();
        }
        let result = self.provider.verify(token).await;
        let ttl = match &result {
            Ok(identity) => {
                let mut ttl = self.positive_ttl;
                if let Some(exp) = identity.expires_at {
                    let left = exp - chrono::Utc::now().timestamp();
                    if left <= 0 {
                        return Err(IdentityError::InvalidToken);
                    }
                    ttl = ttl.min(Duration::from_secs(left as u64));
                }
                Some(ttl)
            }
            Err(IdentityError::InvalidToken) => Some(self.negative_ttl),
            Err(IdentityError::Unavailable(_)) => None,
        };
        if let Some(ttl) = ttl
            && !ttl.is_zero()
            && let Ok(mut cache) = self.cache.lock()
        {
            if cache.len() >= TOKEN_CACHE_MAX {
                cache.retain(|_, e| e.until > now);
                if cache.len() >= TOKEN_CACHE_MAX {
                    cache.clear();
                }
            }
            cache.insert(
                key,
                CacheEntry {
                    result: result.clone(),
                    until: now + ttl,
                },
            );
        }
        result
    }

    pub fn is_admin_groups(&self, groups: &[String]) -> bool {
        groups.iter().any(|g| self.admin_groups.contains(g))
    }

    /// Admin group member, or allowed by the SubjectAccessReview when configured.
    pub async fn is_admin(&self, identity: &Identity) -> bool {
        if self.is_admin_groups(&identity.groups) {
            return true;
        }
        match &self.admin_sar {
            Some(sar) => sar.allows(identity).await,
            None => false,
        }
    }
}

/// The credential of a request: `Authorization: Bearer …`, else `x-api-key`.
pub fn credential_from_headers(headers: &HeaderMap) -> Option<String> {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|t| !t.is_empty());
    if let Some(token) = bearer {
        return Some(token.to_string());
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallerKind {
    /// A cluster identity (static token, TokenReview, OIDC): may mint keys.
    Cluster,
    /// An API key: may read, never mint. `tier` is the key's pinned tier.
    ApiKey {
        id: uuid::Uuid,
        tier: Option<String>,
    },
}

/// The authenticated caller of a public endpoint.
#[derive(Debug, Clone)]
pub struct Caller {
    pub username: String,
    pub groups: Vec<String>,
    pub kind: CallerKind,
    /// Admins see and revoke everyone's keys. API key callers are never admin: a leaked key
    /// must not carry more than its owner's own keys.
    pub is_admin: bool,
}

impl Caller {
    pub fn pinned_tier(&self) -> Option<&str> {
        match &self.kind {
            CallerKind::ApiKey { tier, .. } => tier.as_deref(),
            CallerKind::Cluster => None,
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = AuthError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let credential = credential_from_headers(&parts.headers).ok_or(AuthError::Missing)?;
        if maas_types::apikey::has_key_prefix(&credential) {
            let key = authenticate::lookup_api_key(state, &credential).await?;
            return Ok(Caller {
                username: key.username,
                groups: key.user_groups,
                kind: CallerKind::ApiKey {
                    id: key.id,
                    tier: key.tier,
                },
                is_admin: false,
            });
        }
        let identity = state.identity.verify_token(&credential).await?;
        let is_admin = state.identity.is_admin(&identity).await;
        Ok(Caller {
            username: identity.username,
            groups: identity.groups,
            kind: CallerKind::Cluster,
            is_admin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn credential_sources() {
        let mut h = HeaderMap::new();
        assert_eq!(credential_from_headers(&h), None);
        h.insert("x-api-key", HeaderValue::from_static("k2"));
        assert_eq!(credential_from_headers(&h).as_deref(), Some("k2"));
        h.insert("authorization", HeaderValue::from_static("Bearer  k1 "));
        assert_eq!(credential_from_headers(&h).as_deref(), Some("k1"));
        // Not a bearer credential: x-api-key is used.
        h.insert("authorization", HeaderValue::from_static("Basic abc"));
        assert_eq!(credential_from_headers(&h).as_deref(), Some("k2"));
        h.remove("x-api-key");
        assert_eq!(credential_from_headers(&h), None);
        // Reserved headers are never identity.
        let mut h = HeaderMap::new();
        h.insert("x-maas-username", HeaderValue::from_static("admin"));
        assert_eq!(credential_from_headers(&h), None);
    }

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

    #[tokio::test]
    async fn negative_and_positive_answers_are_cached_separately() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.yaml");
        std::fs::write(
            &path,
            "identities:\n  - token: t1\n    username: u1\n    groups: [g]\n",
        )
        .unwrap();
        let metrics = crate::metrics::Metrics::new();
        let svc = IdentityService::new(
            Provider::Static(StaticIdentities::load(&path).unwrap()),
            Duration::from_secs(60),
            Duration::from_millis(50),
            vec!["g".into()],
            None,
            metrics.clone(),
        );
        assert_eq!(svc.verify_token("t1").await.unwrap().username, "u1");
        assert_eq!(svc.verify_token("t1").await.unwrap().username, "u1");
        assert!(matches!(
            svc.verify_token("nope").await,
            Err(IdentityError::InvalidToken)
        ));
        assert!(matches!(
            svc.verify_token("nope").await,
            Err(IdentityError::InvalidToken)
        ));
        assert_eq!(metrics.token_cache_hits.get(), 2);
        tokio::time::sleep(Duration::from_millis(80)).await;
        let _ = svc.verify_token("nope").await;
        assert_eq!(metrics.token_cache_hits.get(), 2, "negative entry expired");
        assert!(svc.is_admin_groups(&["g".into()]));
        assert!(!svc.is_admin_groups(&["h".into()]));
    }
}
