//! `POST /internal/v1/authenticate`: the filter's question "who is this credential?".
//!
//! API keys: format check, hash lookup, status, expiry, then the tier from the stored groups
//! with the CURRENT policy (so policy changes apply to existing keys). Cluster tokens: through
//! the identity provider (cached). Every refusal says why; when it cannot decide (database or
//! identity provider down) it answers 503 — never a pass.

use crate::startup::AppState;
use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use maas_types::{AuthenticateRequest, AuthenticateResponse};
use std::time::Instant;
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("Authorization required")]
    Missing,
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
    #[error("cannot authenticate now: {0}")]
    Unavailable(String),
}

impl AuthError {
    /// Label for `maas_authenticate_total{result}`.
    pub fn result_label(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::InvalidKeyFormat => "invalid_key_format",
            AuthError::KeyNotFound => "key_not_found",
            AuthError::KeyRevoked => "key_revoked",
            AuthError::KeyExpired => "key_expired",
            AuthError::InvalidToken => "invalid_token",
            AuthError::NoTier => "no_tier",
            AuthError::Unavailable(_) => "unavailable",
        }
    }
}

/// A valid (active, unexpired) API key's row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ValidKey {
    pub id: Uuid,
    pub key_id: String,
    pub username: String,
    pub user_groups: Vec<String>,
    pub tier: Option<String>,
    pub status: String,
    pub expires_at: DateTime<Utc>,
}

/// Checks an `sk-oai-…` key against the database and records its use (debounced).
pub async fn lookup_api_key(state: &AppState, credential: &str) -> Result<ValidKey, AuthError> {
    let parts = maas_types::apikey::parse(credential).map_err(|_| AuthError::InvalidKeyFormat)?;
    if !state.migrations.is_done() {
        return Err(AuthError::Unavailable("database not ready".into()));
    }
    let hash = maas_types::apikey::hash(parts);
    let row: Option<ValidKey> = sqlx::query_as(
        "SELECT id, key_id, username, user_groups, tier, status, expires_at \
         FROM api_keys WHERE key_hash = $1",
    )
    .bind(&hash)
    .fetch_optional(&state.pool)
    .await
    .map_err(|e| AuthError::Unavailable(format!("database: {e}")))?;
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
    state.last_used.record(key.id, now);
    Ok(key)
}

/// Answers for any credential: API key or cluster token.
pub async fn authenticate(
    state: &AppState,
    credential: &str,
) -> Result<AuthenticateResponse, AuthError> {
    let policy = state.policy.document();
    if maas_types::apikey::has_key_prefix(credential) {
        let key = lookup_api_key(state, credential).await?;
        let tier = policy
            .resolve_tier(&key.user_groups, key.tier.as_deref())
            .ok_or(AuthError::NoTier)?;
        let left = (key.expires_at - Utc::now()).num_seconds().max(0) as u64;
        return Ok(AuthenticateResponse {
            subject: key.username,
            tier: tier.name.clone(),
            tier_pinned: key.tier.is_some(),
            groups: key.user_groups,
            key_id: Some(key.key_id),
            expires_at: Some(key.expires_at.timestamp()),
            cache_ttl_seconds: state.config.key_cache_ttl_seconds.min(left),
        });
    }
    let identity = state.identity.verify_token(credential).await?;
    let tier = policy
        .resolve_tier(&identity.groups, None)
        .ok_or(AuthError::NoTier)?;
    let mut ttl = state.identity.positive_ttl().as_secs();
    if let Some(exp) = identity.expires_at {
        ttl = ttl.min((exp - Utc::now().timestamp()).max(0) as u64);
    }
    Ok(AuthenticateResponse {
        subject: identity.username,
        tier: tier.name.clone(),
        tier_pinned: false,
        groups: identity.groups,
        key_id: None,
        expires_at: identity.expires_at,
        cache_ttl_seconds: ttl,
    })
}

/// `POST /internal/v1/authenticate`.
pub async fn handler(
    State(state): State<AppState>,
    crate::http_error::ApiJson(req): crate::http_error::ApiJson<AuthenticateRequest>,
) -> Result<Json<AuthenticateResponse>, AuthError> {
    let started = Instant::now();
    let credential = req.credential.trim();
    let result = if credential.is_empty() {
        Err(AuthError::Missing)
    } else {
        authenticate(&state, credential).await
    };
    let label = match &result {
        Ok(_) => "ok",
        Err(e) => e.result_label(),
    };
    state.metrics.record_validation(label, started);
    result.map(Json)
}
