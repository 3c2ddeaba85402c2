//! `GET /v1/models` (OpenAI list of what the caller's tier may call) and `GET /v1/tiers`.

use crate::caller::Caller;
use crate::policy::PolicyHandle;
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::header::{CACHE_CONTROL, HOST};
use axum::response::{IntoResponse, Response};
use maas_types::ErrorBody;
use maas_types::Limits;
use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelEntry {
    pub id: String,
    #[schema(value_type = String)]
    pub object: &'static str,
    pub created: i64,
    pub owned_by: String,
    pub ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    #[schema(value_type = String)]
    pub object: &'static str,
    /// Always an array, empty when the caller's tier may use nothing.
    pub data: Vec<ModelEntry>,
}

/// Base URL the caller reached us at, from `Host` (and `X-Forwarded-Proto` set by the gateway).
fn base_url(headers: &HeaderMap) -> Option<String> {
    let host = headers.get(HOST)?.to_str().ok()?;
    if host.is_empty() || host.contains(['/', ' ']) {
        return None;
    }
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .filter(|p| *p == "https" || *p == "http")
        .unwrap_or("http");
    Some(format!("{scheme}://{host}"))
}

#[utoipa::path(get, path = "/v1/models", summary = "Models the caller's tier may use (OpenAI list)",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "models", body = ModelList),
        (status = 401, description = "no valid credential", body = ErrorBody)
    )
)]
pub async fn list(
    State(policy): State<PolicyHandle>,
    caller: Caller,
    headers: HeaderMap,
) -> Response {
    let loaded = policy.current();
    let policy = &loaded.document;
    let base = base_url(&headers);
    let data = match policy.resolve_tier(&caller.groups, caller.pinned_tier()) {
        None => Vec::new(),
        Some(tier) => policy
            .models_for_tier(&tier.name)
            .map(|m| ModelEntry {
                id: m.name.clone(),
                object: "model",
                created: loaded.loaded_at,
                owned_by: m.owned_by.clone().unwrap_or_else(|| "maas".to_string()),
                ready: true,
                url: base.as_ref().map(|b| format!("{b}{}", m.path)),
            })
            .collect(),
    };
    (
        [(CACHE_CONTROL, "no-store")],
        Json(ModelList {
            object: "list",
            data,
        }),
    )
        .into_response()
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TierEntry {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub level: i64,
    #[schema(value_type = Object)]
    pub limits: Limits,
    /// The caller's groups qualify for this tier (it may pin a key to it).
    pub qualified: bool,
    /// The tier the caller gets now (its highest qualifying tier).
    pub current: bool,
    /// Models this tier may call.
    pub models: Vec<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TierList {
    #[schema(value_type = String)]
    pub object: &'static str,
    pub data: Vec<TierEntry>,
}

#[utoipa::path(get, path = "/v1/tiers", summary = "Tiers, their limits and models, and which the caller qualifies for",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "tiers", body = TierList),
        (status = 401, description = "no valid credential", body = ErrorBody)
    )
)]
pub async fn tiers(State(policy): State<PolicyHandle>, caller: Caller) -> Json<TierList> {
    let policy = policy.document();
    let current = policy
        .resolve_tier(&caller.groups, caller.pinned_tier())
        .map(|t| t.name.clone());
    let qualified: Vec<&str> = policy
        .qualifying_tiers(&caller.groups)
        .map(|t| t.name.as_str())
        .collect();
    let mut data: Vec<TierEntry> = policy
        .tiers
        .iter()
        .map(|t| TierEntry {
            name: t.name.clone(),
            display_name: t.display_name.clone(),
            description: t.description.clone(),
            level: t.level,
            limits: t.limits.clone(),
            qualified: qualified.contains(&t.name.as_str()),
            current: current.as_deref() == Some(t.name.as_str()),
            models: policy
                .models_for_tier(&t.name)
                .map(|m| m.name.clone())
                .collect(),
        })
        .collect();
    data.sort_by_key(|t| t.level);
    Json(TierList {
        object: "list",
        data,
    })
}
