//! Who is calling: cluster identities (static file, Kubernetes TokenReview, OIDC JWT), checked
//! and cached by [`service::IdentityService`].
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

pub mod oidc;
pub mod providers;
pub mod service;

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
