//! `POST /internal/v1/authenticate`: the filter's question "who is this credential?".
//!
//! API keys: format check, hash lookup, status, expiry, then the tier from the stored groups
//! with the CURRENT policy (so policy changes apply to existing keys). A key bound to a
//! subscription is refused (403 `invalid_subscription`) once that subscription is gone or no
//! longer lists the key's owner or groups; it needs no tier (`tier` is then empty). Cluster tokens: through
//! the identity provider (cached). Every refusal says why; when it cannot decide (database or
//! identity provider down) it answers 503 — never a pass.

use crate::http::{ApiJson, error_response};
use crate::identity::IdentityError;
use crate::identity::service::IdentityService;
use crate::keys::store::{KeyCheck, KeyStore};
use crate::metrics::Metrics;
use crate::policy::PolicyHandle;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use maas_types::{AuthenticateRequest, AuthenticateResponse, CredentialError, ErrorKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("Authorization required")]
    Missing,
    /// A credential header the shared extraction refuses (other scheme, conflict, …).
    #[error("{0}")]
    BadCredential(CredentialError),
    #[error("invalid key format")]
    InvalidKeyFormat,
    #[error("key not found")]
    KeyNotFound,
    #[error("key revoked")]
    KeyRevoked,
    #[error("key expired")]
    KeyExpired,
    #[error("invalid token")]
    InvalidToken,
    #[error("no tier")]
    NoTier,
    /// The key's subscription is gone or no longer has the key's owner (the selection's reason).
    #[error("{}", .0.message())]
    Subscription(maas_types::SelectError),
    #[error("cannot authenticate now: {0}")]
    Unavailable(String),
}

impl AuthError {
    /// Label for `maas_authenticate_total{result}`.
    pub fn result_label(&self) -> &'static str {
        match self {
            AuthError::Missing | AuthError::BadCredential(_) => "missing",
            AuthError::InvalidKeyFormat => "invalid_key_format",
            AuthError::KeyNotFound => "key_not_found",
            AuthError::KeyRevoked => "key_revoked",
            AuthError::KeyExpired => "key_expired",
            AuthError::InvalidToken => "invalid_token",
            AuthError::NoTier => "no_tier",
            AuthError::Subscription(_) => "invalid_subscription",
            AuthError::Unavailable(_) => "unavailable",
        }
    }
}

impl From<IdentityError> for AuthError {
    fn from(e: IdentityError) -> Self {
        match e {
            IdentityError::InvalidToken => AuthError::InvalidToken,
            IdentityError::Unavailable(reason) => AuthError::Unavailable(reason),
        }
    }
}

impl From<CredentialError> for AuthError {
    fn from(e: CredentialError) -> Self {
        match e {
            CredentialError::Missing => AuthError::Missing,
            CredentialError::MalformedApiKey => AuthError::InvalidKeyFormat,
            other => AuthError::BadCredential(other),
        }
    }
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        let unauthorized = |code| {
            error_response(
                StatusCode::UNAUTHORIZED,
                message.clone(),
                ErrorKind::Authentication,
                Some(code),
            )
        };
        match self {
            AuthError::Missing => unauthorized("missing_credential"),
            AuthError::BadCredential(e) => error_response(
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::UNAUTHORIZED),
                message,
                e.kind(),
                Some("invalid_credential"),
            ),
            AuthError::InvalidKeyFormat
            | AuthError::KeyNotFound
            | AuthError::KeyRevoked
            | AuthError::KeyExpired => unauthorized("invalid_api_key"),
            AuthError::InvalidToken => unauthorized("invalid_token"),
            AuthError::NoTier => error_response(
                StatusCode::FORBIDDEN,
                message,
                ErrorKind::Permission,
                Some("no_tier"),
            ),
            AuthError::Subscription(_) => error_response(
                StatusCode::FORBIDDEN,
                message,
                ErrorKind::Permission,
                Some("invalid_subscription"),
            ),
            AuthError::Unavailable(reason) => {
                tracing::warn!(%reason, "cannot authenticate");
                crate::http::unavailable("authentication is temporarily unavailable")
            }
        }
    }
}

/// Decides who a credential belongs to: API keys from the store, tokens through the identity
/// service, the tier from the current policy.
#[derive(Clone)]
pub struct Authenticator {
    pub keys: KeyStore,
    pub identity: Arc<IdentityService>,
    pub policy: PolicyHandle,
    /// How long the filter may cache a positive API key answer.
    pub key_cache_ttl: Duration,
}

impl Authenticator {
    /// Checks an `sk-oai-…` key against the store and records its use (debounced).
    pub async fn api_key(&self, credential: &str) -> Result<KeyCheck, AuthError> {
        let parts =
            maas_types::apikey::parse(credential).map_err(|_| AuthError::InvalidKeyFormat)?;
        let hash = maas_types::apikey::hash(parts);
        let row = self
            .keys
            .find_by_hash(&hash)
            .await
            .map_err(|e| AuthError::Unavailable(e.to_string()))?;
        // The hash covers the key id too; comparing it again guards against a hash collision
        // between two keys, at no cost.
        let key = row
            .filter(|k| k.key_id == parts.key_id)
            .ok_or(AuthError::KeyNotFound)?;
        if key.status != "active" {
            return Err(AuthError::KeyRevoked);
        }
        let now = Utc::now();
        if key.expires_at <= now {
            return Err(AuthError::KeyExpired);
        }
        self.keys.record_use(key.id, now);
        Ok(key)
    }

    /// Answers for any credential: API key or cluster token.
    pub async fn authenticate(&self, credential: &str) -> Result<AuthenticateResponse, AuthError> {
        let policy = self.policy.document();
        if maas_types::apikey::has_key_prefix(credential) {
            let key = self.api_key(credential).await?;
            let tier = policy.resolve_tier(&key.user_groups, key.tier.as_deref());
            let tier = match &key.subscription {
                None => tier.ok_or(AuthError::NoTier)?.name.clone(),
                Some(sub) => {
                    maas_types::subscription::select(
                        &policy,
                        &key.username,
                        &key.user_groups,
                        Some(sub),
                        None,
                    )
                    .map_err(AuthError::Subscription)?;
                    tier.map(|t| t.name.clone()).unwrap_or_default()
                }
            };
            let left = u64::try_from((key.expires_at - Utc::now()).num_seconds()).unwrap_or(0);
            // Limits that cannot be read are not dropped (the key would spend without them).
            let limits = match key.limits.as_deref() {
                Some(text) => Some(serde_json::from_str(text).map_err(|e| {
                    AuthError::Unavailable(format!("the key's limits cannot be read: {e}"))
                })?),
                None => None,
            };
            return Ok(AuthenticateResponse {
                pseudonym: Some(crate::pseudonym::subject(&key.username)),
                subject: key.username,
                tier,
                tier_pinned: key.tier.is_some(),
                groups: key.user_groups,
                key_id: Some(key.key_id),
                subscription: key.subscription,
                expires_at: Some(key.expires_at.timestamp()),
                limits,
                cache_ttl_seconds: self.key_cache_ttl.as_secs().min(left),
            });
        }
        let identity = self.identity.verify_token(credential).await?;
        // No tier but a subscription (a policy from the reference's resources: models reachable
        // through subscriptions only): authenticated with no tier, the filter selects the
        // subscription per request (as for a key bound to one).
        let tier = match policy.resolve_tier(&identity.groups, None) {
            Some(t) => t.name.clone(),
            None if !maas_types::subscription::accessible(
                &policy,
                &identity.username,
                &identity.groups,
            )
            .is_empty() =>
            {
                String::new()
            }
            None => return Err(AuthError::NoTier),
        };
        let mut ttl = self.identity.positive_ttl().as_secs();
        if let Some(exp) = identity.expires_at {
            ttl = ttl.min(u64::try_from(exp - Utc::now().timestamp()).unwrap_or(0));
        }
        Ok(AuthenticateResponse {
            pseudonym: Some(crate::pseudonym::subject(&identity.username)),
            subject: identity.username,
            tier,
            tier_pinned: false,
            groups: identity.groups,
            key_id: None,
            subscription: None,
            expires_at: identity.expires_at,
            limits: None,
            cache_ttl_seconds: ttl,
        })
    }
}

/// `POST /internal/v1/authenticate`. Its span says the result and the subject's pseudonym,
/// never the credential.
#[tracing::instrument(name = "authenticate", skip_all, fields(
    maas.result = tracing::field::Empty,
    maas.user = tracing::field::Empty,
))]
pub async fn handler(
    State(auth): State<Authenticator>,
    State(metrics): State<Arc<Metrics>>,
    ApiJson(req): ApiJson<AuthenticateRequest>,
) -> Result<Json<AuthenticateResponse>, AuthError> {
    let started = Instant::now();
    let credential = req.credential.trim();
    let result = if credential.is_empty() {
        Err(AuthError::Missing)
    } else {
        auth.authenticate(credential).await
    };
    let label = match &result {
        Ok(_) => "ok",
        Err(e) => e.result_label(),
    };
    metrics.record_validation(label, started);
    let span = tracing::Span::current();
    span.record("maas.result", label);
    if let Ok(Some(p)) = result.as_ref().map(|r| r.pseudonym.as_deref()) {
        span.record("maas.user", p);
    }
    result.map(Json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_refusals_map_to_the_shared_status_and_type() {
        let conflict: AuthError = CredentialError::Conflicting.into();
        let r = conflict.into_response();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let scheme: AuthError = CredentialError::UnsupportedScheme.into();
        assert_eq!(scheme.into_response().status(), StatusCode::UNAUTHORIZED);
        assert!(matches!(
            AuthError::from(CredentialError::Missing),
            AuthError::Missing
        ));
        assert!(matches!(
            AuthError::from(CredentialError::MalformedApiKey),
            AuthError::InvalidKeyFormat
        ));
    }
}
