//! The public key-management API: mint, get, revoke, search, bulk-revoke, config, cleanup.
//!
//! Subscriptions: a key is bound at mint to the subscription it names (which the caller must
//! have), else to the caller's default one (`maas_types::subscription::default_for_mint`), else
//! to none (it follows the tiers, as a key pinned to a tier does).
//!
//! Paths, camelCase fields and status codes follow the reference MaaS API. The plaintext key
//! is in the mint response only. Mint is one INSERT, so a key is never half-written.
//! `expired` is computed at read time.
//!
//! Who may do what: minting, revoking and bulk-revoking need a cluster identity (an API key
//! gets 403); an API key may read its owner's keys. Another user's key is 404 (not 403) unless
//! the caller is an admin, so ids cannot be probed.

use crate::caller::{Caller, CallerKind};
use crate::http::{ApiJson, database_failure, error_response};
use crate::keys::rules::{self, EPHEMERAL_MAX, InvalidField, invalid};
use crate::keys::store::{
    KeyRow, KeyStatus, KeyStore, NewKey, SearchQuery, SortColumn, StoreError,
};
use crate::metrics::Metrics;
use crate::policy::PolicyHandle;
use crate::settings::KeySettings;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maas_types::{ErrorBody, ErrorKind, PolicyDocument};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use utoipa::ToSchema;
use uuid::Uuid;

const SEARCH_DEFAULT_LIMIT: i64 = 50;
const SEARCH_MAX_LIMIT: i64 = 100;

#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    /// Same message whether the tier does not exist or the caller does not qualify (no
    /// enumeration of tiers).
    #[error("Unable to resolve the requested tier for this API key")]
    InvalidTier,
    #[error("no tier is available for your groups")]
    NoTier,
    /// The reference's one message whether the subscription does not exist, the caller does
    /// not have it, or there is none (no enumeration of subscriptions).
    #[error("Unable to resolve a subscription for this API key")]
    InvalidSubscription,
    #[error("API key not found")]
    NotFound,
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("an API key cannot do this: use your cluster identity (token)")]
    ApiKeyCannotMint,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl IntoResponse for ApiKeyError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        match self {
            ApiKeyError::Invalid(field) => {
                let mut body =
                    ErrorBody::new(message, ErrorKind::InvalidRequest, Some("invalid_request"));
                body.error.param = Some(field.param.to_string());
                (StatusCode::BAD_REQUEST, Json(body)).into_response()
            }
            ApiKeyError::InvalidTier => error_response(
                StatusCode::BAD_REQUEST,
                message,
                ErrorKind::InvalidRequest,
                Some("invalid_tier"),
            ),
            ApiKeyError::InvalidSubscription => error_response(
                StatusCode::BAD_REQUEST,
                message,
                ErrorKind::InvalidRequest,
                Some("invalid_subscription"),
            ),
            ApiKeyError::NoTier => error_response(
                StatusCode::FORBIDDEN,
                message,
                ErrorKind::Permission,
                Some("no_tier"),
            ),
            ApiKeyError::NotFound => error_response(
                StatusCode::NOT_FOUND,
                message,
                ErrorKind::InvalidRequest,
                Some("not_found"),
            ),
            ApiKeyError::Forbidden(_) | ApiKeyError::ApiKeyCannotMint => error_response(
                StatusCode::FORBIDDEN,
                message,
                ErrorKind::Permission,
                Some("forbidden"),
            ),
            ApiKeyError::Store(e) => database_failure(e.is_unavailable(), &e),
        }
    }
}

/// A key as listed and fetched (never the key itself).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ApiKey)]
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
    /// The subscription the key is bound to; absent when it follows the tiers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// The key's own limits, set at mint (counted per key beside its tier's or
    /// subscription's; the strictest binds); absent when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub limits: Option<maas_types::Limits>,
    pub key_prefix: String,
    pub creation_date: DateTime<Utc>,
    pub expiration_date: DateTime<Utc>,
    /// `active`, `revoked` or `expired` (computed now).
    #[schema(value_type = String)]
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
            subscription: r.subscription,
            labels: serde_json::from_str(&r.labels).unwrap_or_default(),
            limits: r
                .limits
                .as_deref()
                .and_then(|l| serde_json::from_str(l).ok()),
            creation_date: r.created_at,
            expiration_date: r.expires_at,
            status,
            last_used_at: r.last_used_at,
            revoked_at: r.revoked_at,
            ephemeral: r.ephemeral,
        }
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

#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = CreateApiKeyRequest)]
pub struct CreateRequest {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// `30d`, `1.5d`, `1h`, `2h30m`, or a number of seconds; default and maximum: the
    /// configured maximum (ephemeral keys: 1 hour).
    #[serde(default)]
    #[schema(schema_with = expires_in_schema)]
    pub expires_in: Option<Value>,
    /// Pin the key to a tier the caller qualifies for (then no subscription is bound).
    #[serde(default)]
    pub tier: Option<String>,
    /// Bind the key to this subscription (`name` or `namespace/name`; the caller must have
    /// it). Left out: the caller's default subscription (highest priority), if it has any.
    #[serde(default)]
    pub subscription: Option<String>,
    /// At most 16; keys 1–63 of letters, digits, `.`, `_`, `-`, `/`; values ≤ 256 characters.
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub ephemeral: Option<bool>,
    /// The key's own limits: requests, tokens and money budgets per window, as a tier's
    /// `limits` (at least one). Counted per key beside the tier's or subscription's; the
    /// strictest binds, so a key can be held below what its owner may spend.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub limits: Option<maas_types::Limits>,
}

/// `expiresIn`: a duration string or a number of seconds.
fn expires_in_schema() -> utoipa::openapi::Schema {
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
    OneOfBuilder::new()
        .item(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .examples(["30d"]),
        )
        .item(
            ObjectBuilder::new()
                .schema_type(Type::Number)
                .description(Some("seconds")),
        )
        .build()
        .into()
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = CreateApiKeyResponse)]
pub struct CreateResponse {
    pub id: Uuid,
    /// The plaintext key: shown here once, never again.
    pub key: String,
    pub key_prefix: String,
    pub name: String,
    pub description: Option<String>,
    /// The tier the key gets now; absent for a key bound to a subscription when the caller
    /// qualifies for no tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// The subscription the key is bound to; absent when it follows the tiers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// The key's own limits, as minted.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub limits: Option<maas_types::Limits>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub ephemeral: bool,
}

#[utoipa::path(post, path = "/v1/api-keys", summary = "Mint an API key (the plaintext key is in this response only)",
    request_body = CreateRequest,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "created", body = CreateResponse),
        (status = 400, description = "invalid request", body = ErrorBody),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "not allowed", body = ErrorBody),
        (status = 413, description = "body too large", body = ErrorBody),
        (status = 503, description = "database unavailable", body = ErrorBody)
    )
)]
#[tracing::instrument(name = "keys.create", skip_all)]
pub async fn create(
    State(store): State<KeyStore>,
    State(policy): State<PolicyHandle>,
    State(limits): State<KeySettings>,
    State(metrics): State<Arc<Metrics>>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateRequest>,
) -> Result<(StatusCode, Json<CreateResponse>), ApiKeyError> {
    require_cluster_identity(&caller)?;
    let ephemeral = req.ephemeral.unwrap_or(false);
    let name = match req.name.as_deref().map(str::trim) {
        Some(n) if !n.is_empty() => rules::check_name(n)?,
        _ if ephemeral => format!(
            "ephemeral-{}",
            Utc::now().timestamp_nanos_opt().unwrap_or(0)
        ),
        _ => return Err(invalid("name is required for non-ephemeral keys", "name").into()),
    };
    let description = rules::check_description(req.description)?;
    let lifetime = rules::lifetime(
        req.expires_in.as_ref(),
        ephemeral,
        limits.max_expiration_days,
    )?;
    let labels_map = req.labels.unwrap_or_default();
    let labels = rules::check_labels(&labels_map, "labels")?;
    let key_limits = match &req.limits {
        Some(l) => Some(rules::check_key_limits(l)?),
        None => None,
    };
    let policy = policy.document();
    let Binding {
        pinned,
        tier,
        subscription,
    } = binding(
        &policy,
        &caller,
        req.tier.as_deref(),
        req.subscription.as_deref(),
    )?;

    let (key_id, key, hash) = generate_key()?;
    let id = Uuid::new_v4();
    let now = Utc::now();
    let expires_at =
        now + chrono::Duration::from_std(lifetime).unwrap_or_else(|_| chrono::Duration::days(1));
    let (created_at, expires_at) = store
        .insert(&NewKey {
            id,
            key_id: &key_id,
            hash: &hash,
            username: &caller.username,
            name: &name,
            description: description.as_deref(),
            pinned_tier: pinned.as_deref(),
            subscription: subscription.as_deref(),
            labels: &labels,
            groups: &caller.groups,
            limits: key_limits.as_deref(),
            created_at: now,
            expires_at,
            ephemeral,
        })
        .await?;
    metrics.keys_minted.inc();
    tracing::info!(user = %crate::pseudonym::user(&caller.username), key_id = %key_id, tier = tier.as_deref().unwrap_or(""), subscription = subscription.as_deref().unwrap_or(""), ephemeral, "API key minted");
    Ok((
        StatusCode::CREATED,
        Json(CreateResponse {
            id,
            key_prefix: maas_types::apikey::display_prefix(&key_id),
            key,
            name,
            description,
            tier,
            subscription,
            labels: labels_map,
            limits: req.limits,
            created_at,
            expires_at,
            ephemeral,
        }),
    ))
}

/// What a new key follows: a tier pinned at mint, or a subscription (named, else the caller's
/// default one), and the tier it resolves to now.
struct Binding {
    pinned: Option<String>,
    tier: Option<String>,
    subscription: Option<String>,
}

/// Checks the tier or subscription a mint names against the policy and the caller.
fn binding(
    policy: &PolicyDocument,
    caller: &Caller,
    tier: Option<&str>,
    subscription: Option<&str>,
) -> Result<Binding, ApiKeyError> {
    let requested_tier = tier.map(str::trim).filter(|t| !t.is_empty());
    let requested_sub = subscription.map(str::trim).filter(|s| !s.is_empty());
    if requested_tier.is_some() && requested_sub.is_some() {
        return Err(invalid(
            "tier and subscription cannot both be given: a key follows either a tier or a subscription",
            "subscription",
        )
        .into());
    }
    let subscription = match requested_sub {
        Some(r) => Some(
            maas_types::subscription::select(
                policy,
                &caller.username,
                &caller.groups,
                Some(r),
                None,
            )
            .map_err(|e| {
                tracing::info!(user = %crate::pseudonym::user(&caller.username), reason = e.code(), "mint refused: subscription");
                ApiKeyError::InvalidSubscription
            })?
            .name
            .clone(),
        ),
        None if requested_tier.is_none() => {
            maas_types::subscription::default_for_mint(policy, &caller.username, &caller.groups)
                .map(|s| s.name.clone())
        }
        None => None,
    };
    let pinned = match requested_tier {
        Some(t) => {
            if !policy.qualifying_tiers(&caller.groups).any(|q| q.name == t) {
                return Err(ApiKeyError::InvalidTier);
            }
            Some(t.to_string())
        }
        None => None,
    };
    let tier = policy
        .resolve_tier(&caller.groups, pinned.as_deref())
        .map(|t| t.name.clone());
    if tier.is_none() && subscription.is_none() {
        return Err(ApiKeyError::NoTier);
    }
    Ok(Binding {
        pinned,
        tier,
        subscription,
    })
}

/// A fresh key from the OS's randomness: its public id, the key itself, its stored hash.
fn generate_key() -> Result<(String, String, String), ApiKeyError> {
    let mut key_id_bytes = [0u8; maas_types::apikey::KEY_ID_BYTES];
    let mut secret_bytes = [0u8; maas_types::apikey::SECRET_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut key_id_bytes);
    rand::rngs::OsRng.fill_bytes(&mut secret_bytes);
    let (key_id, key) = maas_types::apikey::format_key(&key_id_bytes, &secret_bytes);
    let hash = match maas_types::apikey::parse(&key) {
        Ok(parts) => maas_types::apikey::hash(parts),
        Err(_) => {
            return Err(StoreError::Database(sqlx::Error::Protocol(
                "generated key does not parse".into(),
            ))
            .into());
        }
    };
    Ok((key_id, key, hash))
}

// ---------------------------------------------------------------------------------------------
// GET / DELETE /v1/api-keys/{id}
// ---------------------------------------------------------------------------------------------

#[utoipa::path(get, path = "/v1/api-keys/{id}", summary = "Get an API key (never the key itself); another user's key is 404",
    params(("id" = Uuid, Path, description = "the key's id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the key", body = ApiKeyView),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 404, description = "no such key (or another user's)", body = ErrorBody),
        (status = 503, description = "database unavailable", body = ErrorBody)
    )
)]
#[tracing::instrument(name = "keys.get", skip_all)]
pub async fn get(
    State(store): State<KeyStore>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ApiKeyView>, ApiKeyError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiKeyError::NotFound)?;
    let row = store
        .find(id)
        .await?
        .filter(|r| caller.is_admin || r.username == caller.username)
        .ok_or(ApiKeyError::NotFound)?;
    Ok(Json(row.into()))
}

#[utoipa::path(delete, path = "/v1/api-keys/{id}", summary = "Revoke an API key; again or unknown is 404",
    params(("id" = Uuid, Path, description = "the key's id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "revoked", body = ApiKeyView),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "not allowed", body = ErrorBody),
        (status = 404, description = "no such key (or another user's)", body = ErrorBody),
        (status = 503, description = "database unavailable", body = ErrorBody)
    )
)]
#[tracing::instrument(name = "keys.revoke", skip_all)]
pub async fn revoke(
    State(store): State<KeyStore>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ApiKeyView>, ApiKeyError> {
    require_cluster_identity(&caller)?;
    let id = Uuid::parse_str(&id).map_err(|_| ApiKeyError::NotFound)?;
    let row = store
        .revoke(id, caller.is_admin, &caller.username)
        .await?
        .ok_or(ApiKeyError::NotFound)?;
    tracing::info!(user = %crate::pseudonym::user(&caller.username), key_id = %row.key_id, owner = %crate::pseudonym::user(&row.username), "API key revoked");
    Ok(Json(row.into()))
}

// ---------------------------------------------------------------------------------------------
// POST /v1/api-keys/search
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct SearchRequest {
    pub filters: SearchFilters,
    pub sort: SearchSort,
    pub pagination: SearchPagination,
}

// Serialize: for the schema's defaults.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct SearchFilters {
    pub username: Option<String>,
    /// Only keys bound to this subscription.
    pub subscription: Option<String>,
    /// Only keys holding every one of these labels.
    pub labels_contain: Option<BTreeMap<String, String>>,
    pub status: Option<Vec<String>>,
    pub include_ephemeral: bool,
}

// Serialize: for the schema's defaults.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(default)]
pub struct SearchSort {
    pub by: Option<String>,
    pub order: Option<String>,
}

// Serialize: for the schema's defaults.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(default)]
pub struct SearchPagination {
    pub limit: Option<i64>,
    pub offset: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ApiKeyList)]
pub struct SearchResponse {
    #[schema(value_type = String)]
    pub object: &'static str,
    pub data: Vec<ApiKeyView>,
    pub has_more: bool,
}

/// Checks a search request against the rules and the caller's rights.
fn search_query(req: SearchRequest, caller: &Caller) -> Result<SearchQuery, ApiKeyError> {
    let sort = match req.sort.by.as_deref().unwrap_or("created_at") {
        "created_at" => SortColumn::CreatedAt,
        "expires_at" => SortColumn::ExpiresAt,
        "last_used_at" => SortColumn::LastUsedAt,
        "name" => SortColumn::Name,
        _ => {
            return Err(invalid(
                "invalid sort.by: must be one of: created_at, expires_at, last_used_at, name",
                "sort.by",
            )
            .into());
        }
    };
    let descending = match req.sort.order.as_deref().unwrap_or("desc") {
        "asc" => false,
        "desc" => true,
        _ => {
            return Err(invalid("invalid sort.order: must be asc or desc", "sort.order").into());
        }
    };
    let limit = req.pagination.limit.unwrap_or(SEARCH_DEFAULT_LIMIT);
    if limit < 1 {
        return Err(invalid("pagination.limit must be at least 1", "pagination.limit").into());
    }
    let offset = req.pagination.offset.unwrap_or(0);
    if offset < 0 {
        return Err(invalid(
            "pagination.offset must be non-negative",
            "pagination.offset",
        )
        .into());
    }
    let statuses = req
        .filters
        .status
        .unwrap_or_default()
        .iter()
        .map(|s| match s.as_str() {
            "active" => Ok(KeyStatus::Active),
            "revoked" => Ok(KeyStatus::Revoked),
            "expired" => Ok(KeyStatus::Expired),
            _ => Err(invalid(
                format!("invalid filters.status '{s}': must be active, revoked, or expired"),
                "filters.status",
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
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
    let labels_contain = req
        .filters
        .labels_contain
        .as_ref()
        .filter(|l| !l.is_empty())
        .map(|l| rules::check_labels(l, "filters.labelsContain"))
        .transpose()?;
    Ok(SearchQuery {
        username,
        subscription: req
            .filters
            .subscription
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        labels_contain,
        include_ephemeral: req.filters.include_ephemeral,
        statuses,
        sort,
        descending,
        limit: limit.min(SEARCH_MAX_LIMIT),
        offset,
    })
}

#[utoipa::path(post, path = "/v1/api-keys/search", summary = "Search API keys (own keys; admins: anyone's)",
    request_body = SearchRequest,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "keys", body = SearchResponse),
        (status = 400, description = "invalid request", body = ErrorBody),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "not allowed", body = ErrorBody),
        (status = 503, description = "database unavailable", body = ErrorBody)
    )
)]
#[tracing::instrument(name = "keys.search", skip_all)]
pub async fn search(
    State(store): State<KeyStore>,
    caller: Caller,
    ApiJson(req): ApiJson<SearchRequest>,
) -> Result<Json<SearchResponse>, ApiKeyError> {
    let query = search_query(req, &caller)?;
    let mut rows = store.search(&query).await?;
    let limit = usize::try_from(query.limit).unwrap_or(usize::MAX);
    let has_more = rows.len() > limit;
    rows.truncate(limit);
    Ok(Json(SearchResponse {
        object: "list",
        data: rows.into_iter().map(ApiKeyView::from).collect(),
        has_more,
    }))
}

// ---------------------------------------------------------------------------------------------
// POST /v1/api-keys/bulk-revoke
// ---------------------------------------------------------------------------------------------

/// At least one of `username` and `subscription`; both: the user's keys of that subscription.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BulkRevokeRequest {
    /// Whose keys (a non-admin: only their own).
    #[serde(default)]
    pub username: Option<String>,
    /// Keys bound to this subscription (a non-admin: only their own keys of it).
    #[serde(default)]
    pub subscription: Option<String>,
    /// Count what would be revoked, revoke nothing.
    #[serde(default)]
    pub dry_run: bool,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BulkRevokeResponse {
    /// Keys revoked (0 in a dry run).
    pub revoked_count: u64,
    /// Active keys that matched (revoked, or that a dry run would revoke).
    pub matched_count: u64,
    pub dry_run: bool,
    pub message: String,
}

#[utoipa::path(post, path = "/v1/api-keys/bulk-revoke", summary = "Revoke every active key of a user and/or a subscription (dryRun: count only)",
    request_body = BulkRevokeRequest,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "revoked", body = BulkRevokeResponse),
        (status = 400, description = "invalid request", body = ErrorBody),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "not allowed", body = ErrorBody),
        (status = 503, description = "database unavailable", body = ErrorBody)
    )
)]
#[tracing::instrument(name = "keys.bulk_revoke", skip_all)]
pub async fn bulk_revoke(
    State(store): State<KeyStore>,
    caller: Caller,
    ApiJson(req): ApiJson<BulkRevokeRequest>,
) -> Result<Json<BulkRevokeResponse>, ApiKeyError> {
    require_cluster_identity(&caller)?;
    let trimmed = |v: &Option<String>| {
        v.as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
    };
    let username = trimmed(&req.username);
    let subscription = trimmed(&req.subscription);
    if username.is_none() && subscription.is_none() {
        return Err(invalid("username or subscription is required", "username").into());
    }
    let owner = match username {
        Some(u) if u != caller.username && !caller.is_admin => {
            return Err(ApiKeyError::Forbidden(
                "Access denied: you can only bulk revoke your own API keys",
            ));
        }
        Some(u) => Some(u),
        None if caller.is_admin => None,
        None => Some(caller.username.clone()),
    };
    let n = store
        .revoke_all(owner.as_deref(), subscription.as_deref(), req.dry_run)
        .await?;
    let scope = match (&owner, &subscription) {
        (Some(u), Some(s)) => format!("for user {u} in subscription {s}"),
        (Some(u), None) => format!("for user {u}"),
        (None, Some(s)) => format!("in subscription {s}"),
        (None, None) => String::new(),
    };
    tracing::info!(user = %crate::pseudonym::user(&caller.username), owner = %owner.as_deref().map_or_else(|| "*".to_string(), crate::pseudonym::user), subscription = subscription.as_deref().unwrap_or("*"), matched = n, dry_run = req.dry_run, "bulk revoke");
    Ok(Json(if req.dry_run {
        BulkRevokeResponse {
            revoked_count: 0,
            matched_count: n,
            dry_run: true,
            message: format!("Dry run: {n} active API key(s) {scope} would be revoked"),
        }
    } else {
        BulkRevokeResponse {
            revoked_count: n,
            matched_count: n,
            dry_run: false,
            message: format!("Successfully revoked {n} active API key(s) {scope}"),
        }
    }))
}

// ---------------------------------------------------------------------------------------------
// GET /v1/api-keys/config, POST /internal/v1/api-keys/cleanup
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = KeyConfig)]
pub struct KeyConfigResponse {
    pub max_expiration_days: u32,
    pub default_expiration_days: u32,
    pub ephemeral_max_expiration_seconds: u64,
    /// The reference API's spelling, for scripts written against it.
    #[serde(rename = "max_expiration_days")]
    pub max_expiration_days_compat: u32,
    #[serde(rename = "ephemeral_max_expiration")]
    #[schema(value_type = String)]
    pub ephemeral_max_expiration_compat: &'static str,
}

#[utoipa::path(get, path = "/v1/api-keys/config", summary = "Key lifetime limits",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "limits", body = KeyConfigResponse),
        (status = 401, description = "no valid credential", body = ErrorBody)
    )
)]
#[tracing::instrument(name = "keys.config", skip_all)]
pub async fn config(State(limits): State<KeySettings>, _caller: Caller) -> Json<KeyConfigResponse> {
    let days = limits.max_expiration_days;
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
#[tracing::instrument(name = "keys.cleanup", skip_all)]
pub async fn cleanup(State(store): State<KeyStore>) -> Result<Json<CleanupResponse>, ApiKeyError> {
    let n = store.delete_expired_ephemeral().await?;
    Ok(Json(CleanupResponse {
        deleted_count: n,
        message: format!("Successfully deleted {n} expired ephemeral key(s)"),
    }))
}
