//! The authenticated caller of a public endpoint, as an extractor.
//!
//! Identity comes only from the credential, taken by the rule shared with the filter
//! ([`maas_types::credential::extract`]: `Authorization: Bearer …` or `x-api-key`, the same
//! value when both are sent). Headers in the reserved `x-maas-*` namespace are never read:
//! whatever sets them, they are not proof.

use crate::authenticate::{AuthError, Authenticator};
use axum::extract::{FromRef, FromRequestParts};
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use maas_types::{Credential, CredentialError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallerKind {
    /// A cluster identity (static token, TokenReview, OIDC): may mint keys.
    Cluster,
    /// An API key: may read, never mint. `tier` is the key's pinned tier, `id` the key API's
    /// id (the one the usage ledger names it by).
    ApiKey {
        tier: Option<String>,
        id: uuid::Uuid,
        /// The key's public id (the `key_id` of `sk-oai-{key_id}_{secret}`): what a scope
        /// `per: key` counts by, as the gateway does.
        key_id: String,
        /// The subscription the key is bound to.
        subscription: Option<String>,
        /// The key's own limits (set at mint) as JSON text, if any.
        limits: Option<String>,
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
    /// The API key's public id, when the caller is one.
    pub fn key_id(&self) -> Option<&str> {
        match &self.kind {
            CallerKind::ApiKey { key_id, .. } => Some(key_id),
            CallerKind::Cluster => None,
        }
    }

    pub fn pinned_tier(&self) -> Option<&str> {
        match &self.kind {
            CallerKind::ApiKey { tier, .. } => tier.as_deref(),
            CallerKind::Cluster => None,
        }
    }

    /// The API key caller's own limits (set at mint), as the scope the gateway counts them in.
    pub fn key_scope(&self) -> Option<maas_types::Scope> {
        match &self.kind {
            CallerKind::ApiKey {
                limits: Some(l), ..
            } => serde_json::from_str(l).ok().map(maas_types::Scope::of_key),
            _ => None,
        }
    }

    /// The subscription of an API key caller's key.
    pub fn bound_subscription(&self) -> Option<&str> {
        match &self.kind {
            CallerKind::ApiKey { subscription, .. } => subscription.as_deref(),
            CallerKind::Cluster => None,
        }
    }
}

/// The request's credential by the shared rule. A header that is not valid text counts as
/// holding invalid characters.
fn credential(headers: &HeaderMap) -> Result<Credential<'_>, CredentialError> {
    let text = |name| {
        headers
            .get(name)
            .map(|v| v.to_str().map_err(|_| CredentialError::InvalidCharacters))
            .transpose()
    };
    maas_types::credential::extract(text(AUTHORIZATION.as_str())?, text("x-api-key")?)
}

impl<S> FromRequestParts<S> for Caller
where
    Authenticator: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = AuthError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let auth = Authenticator::from_ref(state);
        let caller = match credential(&parts.headers)? {
            Credential::ApiKey { raw, parts } => {
                let key = auth.api_key(raw).await?;
                Caller {
                    username: key.username,
                    groups: key.user_groups,
                    kind: CallerKind::ApiKey {
                        tier: key.tier,
                        id: key.id,
                        key_id: parts.key_id.to_string(),
                        subscription: key.subscription,
                        limits: key.limits,
                    },
                    is_admin: false,
                }
            }
            Credential::Token(token) => {
                let identity = auth.identity.verify_token(token).await?;
                let is_admin = auth.identity.is_admin(&identity).await;
                Caller {
                    username: identity.username,
                    groups: identity.groups,
                    kind: CallerKind::Cluster,
                    is_admin,
                }
            }
        };
        // The request's span names the caller by pseudonym (when spans are exported).
        crate::telemetry::record_user(&caller.username);
        Ok(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn the_public_api_takes_the_credential_by_the_filters_rule() {
        let mut h = HeaderMap::new();
        assert_eq!(credential(&h), Err(CredentialError::Missing));
        h.insert("x-api-key", HeaderValue::from_static("k2"));
        assert_eq!(credential(&h), Ok(Credential::Token("k2")));
        h.insert("authorization", HeaderValue::from_static("bearer  k2 "));
        assert_eq!(credential(&h), Ok(Credential::Token("k2")));
        // Different credentials in the two headers: refused, as by the filter.
        h.insert("authorization", HeaderValue::from_static("Bearer k1"));
        assert_eq!(credential(&h), Err(CredentialError::Conflicting));
        // Another scheme is refused, not silently replaced by x-api-key.
        h.insert("authorization", HeaderValue::from_static("Basic abc"));
        assert_eq!(credential(&h), Err(CredentialError::UnsupportedScheme));
        // Reserved headers are never identity.
        let mut h = HeaderMap::new();
        h.insert("x-maas-username", HeaderValue::from_static("admin"));
        assert_eq!(credential(&h), Err(CredentialError::Missing));
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_bytes(b"Bearer \xff").unwrap(),
        );
        assert_eq!(credential(&h), Err(CredentialError::InvalidCharacters));
    }
}
