//! API key lifecycle: mint, get, revoke, search, bulk-revoke, config, cleanup.
//!
//! Paths, camelCase fields and status codes follow the reference MaaS API. Keys are stored
//! only as hashes (`maas_types::apikey::hash`); the plaintext is in the mint response only.
//! Mint is one INSERT, so a key is never half-written. `expired` is computed at read time.
//!
//! Who may do what: minting, revoking and bulk-revoking need a cluster identity (an API key
//! gets 403); an API key may read its owner's keys. Another user's key is 404 (not 403) unless
//! the caller is an admin, so ids cannot be probed.

use crate::http_error::ApiJson;
use crate::identity::{Caller, CallerKind};
use crate::startup::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::{Postgres, QueryBuilder};
use std::time::Duration;
use uuid::Uuid;

/// Ephemeral keys live at most this long.
pub const EPHEMERAL_MAX: Duration = Duration::from_secs(3600);
pub const NAME_MAX_CHARS: usize = 128;
pub const DESCRIPTION_MAX_CHARS: usize = 1024;
pub const SEARCH_DEFAULT_LIMIT: i64 = 50;
pub const SEARCH_MAX_LIMIT: i64 = 100;

#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    #[error("{message}")]
    Invalid {
        message: String,
        param: Option<&'static str>,
    },
    /// Same message whether the tier does not exist or the caller does not qualify (no
    /// enumeration of tiers).
    #[error("Unable to resolve the requested tier for this API key")]
    InvalidTier,
    #[error("no tier is available for your groups")]
    NoTier,
    #[error("API key not found")]
    NotFound,
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("an API key cannot do this: use your cluster identity (token)")]
    ApiKeyCannotMint,
    #[error("database not ready")]
    NotReady,
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

fn invalid(message: impl Into<String>, param: &'static str) -> ApiKeyError {
    ApiKeyError::Invalid {
        message: message.into(),
        param: Some(param),
    }
}

// ---------------------------------------------------------------------------------------------
// expiresIn
// ---------------------------------------------------------------------------------------------

/// Parses a duration like `30d`, `1.5d`, `1h`, `2h30m`, `90s`, `500ms` (Go durations plus `d`).
/// Zero and negative durations are refused, as are unitless strings other than `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() || s == "0" {
        return Err("expiration must be positive".into());
    }
    if s.starts_with('-') {
        return Err("expiration must be positive".into());
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total = 0f64;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let number = &s[start..i];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(format!(
                "invalid duration {s:?}: expected e.g. 30d, 1h, 2h30m"
            ));
        }
        let value: f64 = number
            .parse()
            .map_err(|_| format!("invalid duration {s:?}: expected e.g. 30d, 1h, 2h30m"))?;
        let unit_start = i;
        while i < bytes.len() && !(bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let seconds_per_unit = match &s[unit_start..i] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            "" => {
                return Err(format!(
                    "invalid duration {s:?}: missing unit (s, m, h or d)"
                ));
            }
            other => {
                return Err(format!(
                    "invalid duration {s:?}: unknown unit {other:?} (use s, m, h or d)"
                ));
            }
        };
        total += value * seconds_per_unit;
    }
    seconds_to_duration(total)
}

fn seconds_to_duration(total: f64) -> Result<Duration, String> {
    if !total.is_finite() {
        return Err("expiration is too large".into());
    }
    if total <= 0.0 {
        return Err("expiration must be positive".into());
    }
    // Anything beyond ~31 years is over every configurable maximum anyway.
    Ok(Duration::from_secs_f64(total.min(1e9)))
}

/// `expiresIn` as sent: a duration string or a number of seconds.
pub fn parse_expires_in(v: &Value) -> Result<Duration, String> {
    match v {
        Value::String(s) => parse_duration(s),
        Value::Number(n) => seconds_to_duration(n.as_f64().unwrap_or(f64::NAN)),
        _ => Err("expiresIn must be a duration string like \"30d\" or a number of seconds".into()),
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => s.trim().to_string(),
        other => format!("{other}s"),
    }
}

/// The lifetime a new key gets: the request's `expiresIn` checked against the maximum.
pub fn lifetime(
    expires_in: Option<&Value>,
    ephemeral: bool,
    max_days: u32,
) -> Result<Duration, ApiKeyError> {
    let max = Duration::from_secs(u64::from(max_days) * 86_400);
    let Some(v) = expires_in.filter(|v| !v.is_null()) else {
        return Ok(if ephemeral { EPHEMERAL_MAX } else { max });
    };
    let d = parse_expires_in(v).map_err(|m| invalid(m, "expiresIn"))?;
    if ephemeral && d > EPHEMERAL_MAX {
        return Err(invalid(
            format!(
                "ephemeral key expiration ({}) cannot exceed 1 hour",
                describe(v)
            ),
            "expiresIn",
        ));
    }
    if d > max {
        return Err(invalid(
            format!(
                "requested expiration ({}) exceeds maximum allowed ({max_days} days)",
                describe(v)
            ),
            "expiresIn",
        ));
    }
    Ok(d)
}

fn check_name(name: &str) -> Result<String, ApiKeyError> {
    let name = name.trim();
    if name.is_empty() {
        return Err(invalid("name is required for non-ephemeral keys", "name"));
    }
    if name.chars().count() > NAME_MAX_CHARS {
        return Err(invalid(
            format!("name must be at most {NAME_MAX_CHARS} characters"),
            "name",
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid("name must not contain control characters", "name"));
    }
    Ok(name.to_string())
}

fn check_description(d: Option<String>) -> Result<Option<String>, ApiKeyError> {
    let Some(d) = d else { return Ok(None) };
    if d.chars().count() > DESCRIPTION_MAX_CHARS {
        return Err(invalid(
            format!("description must be at most {DESCRIPTION_MAX_CHARS} characters"),
            "description",
        ));
    }
    if d.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(invalid(
            "description must not contain control characters",
            "description",
        ));
    }
    Ok(Some(d))
}

// ---------------------------------------------------------------------------------------------
// Rows and views
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, sqlx::FromRow)]
struct KeyRow {
    id: Uuid,
    key_id: String,
    username: String,
    name: String,
    description: Option<String>,
    tier: Option<String>,
    user_groups: Vec<String>,
    status: String,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    last_used_at: Option<DateTime<Utc>>,
    revoked_at: Option<DateTime<Utc>>,
    ephemeral: bool,
}

const KEY_COLUMNS: &str = "id, key_id, username, name, description, tier, user_groups, status, \
                           created_at, expires_at, last_used_at, revoked_at, ephemeral";

/// A key as listed and fetched (never the key itself).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyView {
    pub id: Uuid,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub username: String,
    pub groups: Vec<String>,
    /// The pinned tier; absent when the key follows its owner's highest tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    pub key_prefix: String,
    pub creation_date: DateTime<Utc>,
    pub expiration_date: DateTime<Utc>,
    /// `active`, `revoked` or `expired` (computed now).
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_used_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
    pub ephemeral: bool,
}

impl From<KeyRow> for ApiKeyView {
    fn from(r: KeyRow) -> Self {
        let status = if r.status == "revoked" {
            "revoked"
        } else if r.expires_at <= Utc::now() {
            "expired"
        } else {
            "active"
        };
        ApiKeyView {
            id: r.id,
            key_prefix: maas_types::apikey::display_prefix(&r.key_id),
            name: r.name,
            description: r.description,
            username: r.username,
            groups: r.user_groups,
            tier: r.tier,
            creation_date: r.created_at,
            expiration_date: r.expires_at,
            status,
            last_used_at: r.last_used_at,
            revoked_at: r.revoked_at,
            ephemeral: r.ephemeral,
        }
    }
}

fn require_ready(state: &AppState) -> Result<(), ApiKeyError> {
    if state.migrations.is_done() {
        Ok(())
    } else {
        Err(ApiKeyError::NotReady)
    }
}

fn require_cluster_identity(caller: &Caller) -> Result<(), ApiKeyError> {
    match caller.kind {
        CallerKind::Cluster => Ok(()),
        CallerKind::ApiKey { .. } => Err(ApiKeyError::ApiKeyCannotMint),
    }
}

// ---------------------------------------------------------------------------------------------
// POST /v1/api-keys
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateRequest {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub expires_in: Option<Value>,
    #[serde(default)]
    pub tier: Option<String>,
    #[serde(default)]
    pub ephemeral: Option<bool>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateResponse {
    pub id: Uuid,
    /// The plaintext key: shown here once, never again.
    pub key: String,
    pub key_prefix: String,
    pub name: String,
    pub description: Option<String>,
    pub tier: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub ephemeral: bool,
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateRequest>,
) -> Result<(StatusCode, Json<CreateResponse>), ApiKeyError> {
    require_cluster_identity(&caller)?;
    let ephemeral = req.ephemeral.unwrap_or(false);
    let name = match req.name.as_deref().map(str::trim) {
        Some(n) if !n.is_empty() => check_name(n)?,
        _ if ephemeral => format!(
            "ephemeral-{}",
            Utc::now().timestamp_nanos_opt().unwrap_or(0)
        ),
        _ => return Err(invalid("name is required for non-ephemeral keys", "name")),
    };
    let description = check_description(req.description)?;
    let lifetime = lifetime(
        req.expires_in.as_ref(),
        ephemeral,
        state.config.api_key_max_expiration_days,
    )?;
    let policy = state.policy.document();
    let pinned = match req.tier.as_deref().map(str::trim) {
        Some(t) if !t.is_empty() => {
            if !policy.qualifying_tiers(&caller.groups).any(|q| q.name == t) {
                return Err(ApiKeyError::InvalidTier);
            }
            Some(t.to_string())
        }
        _ => None,
    };
    let tier = policy
        .resolve_tier(&caller.groups, pinned.as_deref())
        .ok_or(ApiKeyError::NoTier)?
        .name
        .clone();
    require_ready(&state)?;

    let mut key_id_bytes = [0u8; maas_types::apikey::KEY_ID_BYTES];
    let mut secret_bytes = [0u8; maas_types::apikey::SECRET_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut key_id_bytes);
    rand::rngs::OsRng.fill_bytes(&mut secret_bytes);
    let (key_id, key) = maas_types::apikey::format_key(&key_id_bytes, &secret_bytes);
    let hash = match maas_types::apikey::parse(&key) {
        Ok(parts) => maas_types::apikey::hash(parts),
        Err(_) => {
            return Err(ApiKeyError::Database(sqlx::Error::Protocol(
                "generated key does not parse".into(),
            )));
        }
    };
    let id = Uuid::new_v4();
    let now = Utc::now();
    let expires_at =
        now + chrono::Duration::from_std(lifetime).unwrap_or_else(|_| chrono::Duration::days(1));
    let (created_at, expires_at): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "INSERT INTO api_keys (id, key_id, key_hash, username, name, description, tier, \
         user_groups, status, created_at, expires_at, ephemeral) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'active', $9, $10, $11) \
         RETURNING created_at, expires_at",
    )
    .bind(id)
    .bind(&key_id)
    .bind(&hash)
    .bind(&caller.username)
    .bind(&name)
    .bind(&description)
    .bind(&pinned)
    .bind(&caller.groups)
    .bind(now)
    .bind(expires_at)
    .bind(ephemeral)
    .fetch_one(&state.pool)
    .await?;
    state.metrics.keys_minted.inc();
    tracing::info!(user = %caller.username, key_id = %key_id, %tier, ephemeral, "API key minted");
    Ok((
        StatusCode::CREATED,
        Json(CreateResponse {
            id,
            key_prefix: maas_types::apikey::display_prefix(&key_id),
            key,
            name,
            description,
            tier,
            created_at,
            expires_at,
            ephemeral,
        }),
    ))
}

// ---------------------------------------------------------------------------------------------
// GET / DELETE /v1/api-keys/{id}
// ---------------------------------------------------------------------------------------------

async fn fetch_visible(state: &AppState, caller: &Caller, id: &str) -> Result<KeyRow, ApiKeyError> {
    let id = Uuid::parse_str(id).map_err(|_| ApiKeyError::NotFound)?;
    require_ready(state)?;
    let row: Option<KeyRow> =
        sqlx::query_as(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1"))
            .bind(id)
            .fetch_optional(&state.pool)
            .await?;
    row.filter(|r| caller.is_admin || r.username == caller.username)
        .ok_or(ApiKeyError::NotFound)
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ApiKeyView>, ApiKeyError> {
    Ok(Json(fetch_visible(&state, &caller, &id).await?.into()))
}

pub async fn revoke(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ApiKeyView>, ApiKeyError> {
    require_cluster_identity(&caller)?;
    let id = Uuid::parse_str(&id).map_err(|_| ApiKeyError::NotFound)?;
    require_ready(&state)?;
    let row: Option<KeyRow> = sqlx::query_as(&format!(
        "UPDATE api_keys SET status = 'revoked', revoked_at = now() \
         WHERE id = $1 AND status = 'active' AND ($2 OR username = $3) RETURNING {KEY_COLUMNS}"
    ))
    .bind(id)
    .bind(caller.is_admin)
    .bind(&caller.username)
    .fetch_optional(&state.pool)
    .await?;
    let row = row.ok_or(ApiKeyError::NotFound)?;
    tracing::info!(user = %caller.username, key_id = %row.key_id, owner = %row.username, "API key revoked");
    Ok(Json(row.into()))
}

// ---------------------------------------------------------------------------------------------
// POST /v1/api-keys/search
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SearchRequest {
    pub filters: SearchFilters,
    pub sort: SearchSort,
    pub pagination: SearchPagination,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SearchFilters {
    pub username: Option<String>,
    pub status: Option<Vec<String>>,
    pub include_ephemeral: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SearchSort {
    pub by: Option<String>,
    pub order: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SearchPagination {
    pub limit: Option<i64>,
    pub offset: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct SearchResponse {
    pub object: &'static str,
    pub data: Vec<ApiKeyView>,
    pub has_more: bool,
}

pub async fn search(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<SearchRequest>,
) -> Result<Json<SearchResponse>, ApiKeyError> {
    let sort_column = match req.sort.by.as_deref().unwrap_or("created_at") {
        c @ ("created_at" | "expires_at" | "last_used_at" | "name") => c,
        _ => {
            return Err(invalid(
                "invalid sort.by: must be one of: created_at, expires_at, last_used_at, name",
                "sort.by",
            ));
        }
    };
    let order = match req.sort.order.as_deref().unwrap_or("desc") {
        "asc" => "ASC",
        "desc" => "DESC",
        _ => {
            return Err(invalid(
                "invalid sort.order: must be asc or desc",
                "sort.order",
            ));
        }
    };
    let limit = req.pagination.limit.unwrap_or(SEARCH_DEFAULT_LIMIT);
    if limit < 1 {
        return Err(invalid(
            "pagination.limit must be at least 1",
            "pagination.limit",
        ));
    }
    let limit = limit.min(SEARCH_MAX_LIMIT);
    let offset = req.pagination.offset.unwrap_or(0);
    if offset < 0 {
        return Err(invalid(
            "pagination.offset must be non-negative",
            "pagination.offset",
        ));
    }
    let statuses = req.filters.status.unwrap_or_default();
    for s in &statuses {
        if !matches!(s.as_str(), "active" | "revoked" | "expired") {
            return Err(invalid(
                format!("invalid filters.status '{s}': must be active, revoked, or expired"),
                "filters.status",
            ));
        }
    }
    let requested_user = req
        .filters
        .username
        .as_deref()
        .map(str::trim)
        .filter(|u| !u.is_empty());
    let username = match requested_user {
        Some(u) if u != caller.username && !caller.is_admin => {
            return Err(ApiKeyError::Forbidden(
                "non-admin users can only search their own API keys",
            ));
        }
        Some(u) => Some(u.to_string()),
        None if caller.is_admin => None,
        None => Some(caller.username.clone()),
    };
    require_ready(&state)?;

    let mut q: QueryBuilder<Postgres> =
        QueryBuilder::new(format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE TRUE"));
    if let Some(u) = &username {
        q.push(" AND username = ").push_bind(u.clone());
    }
    if !req.filters.include_ephemeral {
        q.push(" AND NOT ephemeral");
    }
    if !statuses.is_empty() {
        let mut clauses = Vec::new();
        for s in &statuses {
            clauses.push(match s.as_str() {
                "active" => "(status = 'active' AND expires_at > now())",
                "expired" => "(status = 'active' AND expires_at <= now())",
                _ => "(status = 'revoked')",
            });
        }
        q.push(format!(" AND ({})", clauses.join(" OR ")));
    }
    // Only last_used_at can be NULL; "NULLS LAST" on the others would stop PostgreSQL from
    // reading the (username, created_at DESC, id DESC) index in order.
    let nulls = if sort_column == "last_used_at" {
        " NULLS LAST"
    } else {
        ""
    };
    q.push(format!(
        " ORDER BY {sort_column} {order}{nulls}, id {order} LIMIT "
    ));
    q.push_bind(limit + 1);
    q.push(" OFFSET ").push_bind(offset);
    let mut rows: Vec<KeyRow> = q.build_query_as().fetch_all(&state.pool).await?;
    let has_more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    Ok(Json(SearchResponse {
        object: "list",
        data: rows.into_iter().map(ApiKeyView::from).collect(),
        has_more,
    }))
}

// ---------------------------------------------------------------------------------------------
// POST /v1/api-keys/bulk-revoke
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
pub struct BulkRevokeRequest {
    #[serde(default)]
    pub username: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BulkRevokeResponse {
    pub revoked_count: u64,
    pub message: String,
}

pub async fn bulk_revoke(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<BulkRevokeRequest>,
) -> Result<Json<BulkRevokeResponse>, ApiKeyError> {
    require_cluster_identity(&caller)?;
    let username = req
        .username
        .as_deref()
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .ok_or_else(|| invalid("username is required", "username"))?
        .to_string();
    if username != caller.username && !caller.is_admin {
        return Err(ApiKeyError::Forbidden(
            "Access denied: you can only bulk revoke your own API keys",
        ));
    }
    require_ready(&state)?;
    let done = sqlx::query(
        "UPDATE api_keys SET status = 'revoked', revoked_at = now() \
         WHERE username = $1 AND status = 'active'",
    )
    .bind(&username)
    .execute(&state.pool)
    .await?;
    let n = done.rows_affected();
    tracing::info!(user = %caller.username, owner = %username, revoked = n, "bulk revoke");
    Ok(Json(BulkRevokeResponse {
        revoked_count: n,
        message: format!("Successfully revoked {n} active API key(s) for user {username}"),
    }))
}

// ---------------------------------------------------------------------------------------------
// GET /v1/api-keys/config, POST /internal/v1/api-keys/cleanup
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyConfigResponse {
    pub max_expiration_days: u32,
    pub default_expiration_days: u32,
    pub ephemeral_max_expiration_seconds: u64,
    /// The reference API's spelling, for scripts written against it.
    #[serde(rename = "max_expiration_days")]
    pub max_expiration_days_compat: u32,
    #[serde(rename = "ephemeral_max_expiration")]
    pub ephemeral_max_expiration_compat: &'static str,
}

pub async fn config(State(state): State<AppState>, _caller: Caller) -> Json<KeyConfigResponse> {
    let days = state.config.api_key_max_expiration_days;
    Json(KeyConfigResponse {
        max_expiration_days: days,
        default_expiration_days: days,
        ephemeral_max_expiration_seconds: EPHEMERAL_MAX.as_secs(),
        max_expiration_days_compat: days,
        ephemeral_max_expiration_compat: "1h0m0s",
    })
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CleanupResponse {
    pub deleted_count: u64,
    pub message: String,
}

/// Deletes ephemeral keys that expired more than 30 minutes ago.
pub async fn cleanup(State(state): State<AppState>) -> Result<Json<CleanupResponse>, ApiKeyError> {
    require_ready(&state)?;
    let done = sqlx::query(
        "DELETE FROM api_keys WHERE ephemeral AND expires_at < now() - interval '30 minutes'",
    )
    .execute(&state.pool)
    .await?;
    let n = done.rows_affected();
    Ok(Json(CleanupResponse {
        deleted_count: n,
        message: format!("Successfully deleted {n} expired ephemeral key(s)"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("30d").unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!(
            parse_duration("1.5d").unwrap(),
            Duration::from_secs(129_600)
        );
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("2h30m").unwrap(), Duration::from_secs(9000));
        assert_eq!(parse_duration(" 90s ").unwrap(), Duration::from_secs(90));
        assert_eq!(
            parse_duration("1500ms").unwrap(),
            Duration::from_millis(1500)
        );
        for bad in [
            "", "0", "-1h", "1", "h", "1x", "1..5h", "1h-5m", ".h", "0s", "0d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(
            parse_expires_in(&json!(3600)).unwrap(),
            Duration::from_secs(3600)
        );
        assert!(parse_expires_in(&json!(0)).is_err());
        assert!(parse_expires_in(&json!(-5)).is_err());
        assert!(parse_expires_in(&json!(true)).is_err());
    }

    #[test]
    fn lifetime_rules() {
        assert_eq!(
            lifetime(None, false, 90).unwrap(),
            Duration::from_secs(90 * 86_400)
        );
        assert_eq!(lifetime(None, true, 90).unwrap(), EPHEMERAL_MAX);
        assert_eq!(
            lifetime(Some(&Value::Null), false, 30).unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        let over = lifetime(Some(&json!("91d")), false, 90).unwrap_err();
        assert!(over.to_string().contains("exceeds maximum"), "{over}");
        let eph = lifetime(Some(&json!("2h")), true, 90).unwrap_err();
        assert!(eph.to_string().contains("cannot exceed 1 hour"), "{eph}");
        assert!(lifetime(Some(&json!("")), false, 90).is_err());
        assert_eq!(
            lifetime(Some(&json!("30m")), true, 90).unwrap(),
            Duration::from_secs(1800)
        );
    }

    #[test]
    fn names() {
        assert_eq!(check_name("  k1 ").unwrap(), "k1");
        assert!(check_name("   ").is_err());
        assert!(check_name("a\u{7}b").is_err());
        assert!(check_name(&"x".repeat(129)).is_err());
        assert!(check_name(&"é".repeat(128)).is_ok());
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,40}") {
            let _ = parse_duration(&s);
        }

        #[test]
        fn composed_durations_add_up(d in 0u64..400, h in 0u64..24, m in 0u64..60, s in 0u64..60) {
            prop_assume!(d + h + m + s > 0);
            let text = format!("{d}d{h}h{m}m{s}s");
            let got = parse_duration(&text).unwrap();
            prop_assert_eq!(got.as_secs(), d * 86_400 + h * 3600 + m * 60 + s);
        }

        #[test]
        fn seconds_number_equals_s_suffix(n in 1u64..10_000_000) {
            prop_assert_eq!(parse_expires_in(&json!(n)).unwrap(), parse_duration(&format!("{n}s")).unwrap());
        }
    }
}
