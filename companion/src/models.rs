//! `GET /v1/models` (OpenAI list of what the caller may call — its key's subscription, or its
//! tier and subscriptions — in the reference's shape, `ready` from [`Readiness`]), `GET /v1/tiers`, and the subscription listings `GET /v1/subscriptions` and
//! `GET /v1/model/{id}/subscriptions` (the reference's item shape, snake_case).

use crate::caller::Caller;
use crate::policy::PolicyHandle;
use crate::public_url::PublicUrl;
use crate::readiness::Readiness;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::http::header::CACHE_CONTROL;
use axum::response::{IntoResponse, Response};
use maas_types::subscription::Subscription;
use maas_types::{ErrorBody, ErrorKind, Limits, Model, PolicyDocument};
use serde::Serialize;
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// The reference's `modelDetails`: from the model's `details` (a MaaSModelRef's annotations).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelDetailsEntry {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub genai_use_case: Option<String>,
    /// Tokens, a string as the reference gives it (`"8192"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_window: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub model_capabilities: Vec<String>,
}

/// A subscription through which the caller may use a model.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSubscription {
    /// The value for `X-MaaS-Subscription` (and for naming at mint).
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// One model, in the reference's shape (OpenAI's model object plus `kind`, `url`, `ready`,
/// `modelDetails`, `aliases`, `subscriptions`).
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelEntry {
    /// What clients send as the body's `model`.
    pub id: String,
    #[schema(value_type = String)]
    pub object: &'static str,
    pub created: i64,
    pub owned_by: String,
    /// `ExternalModel` for a model with a provider, else `llmisvc` (the reference's values).
    #[schema(value_type = String)]
    pub kind: &'static str,
    /// Whether the model's server answered its probe (cached; `false` when down, slow, or not
    /// probed).
    pub ready: bool,
    /// The model's base URL at the Gateway (`--public-url` + its path); absent when the
    /// companion has no `--public-url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(rename = "modelDetails", skip_serializing_if = "Option::is_none")]
    pub model_details: Option<ModelDetailsEntry>,
    /// Other ids the body's `model` may carry for this model.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The caller's subscriptions that include the model (sorted by name); absent when the
    /// caller reaches it through its tier only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub subscriptions: Vec<ModelSubscription>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    #[schema(value_type = String)]
    pub object: &'static str,
    /// Always an array, empty when the caller may use nothing.
    pub data: Vec<ModelEntry>,
}

fn details_entry(m: &Model) -> Option<ModelDetailsEntry> {
    m.details
        .as_ref()
        .filter(|d| !d.is_empty())
        .map(|d| ModelDetailsEntry {
            display_name: d.display_name.clone(),
            description: d.description.clone(),
            genai_use_case: d.genai_use_case.clone(),
            context_window: d.context_window.clone(),
            model_capabilities: d.capabilities.clone(),
        })
}

/// The models the caller may use, each with the caller's subscriptions that include it.
/// A key bound to a subscription: that subscription's models. A key pinned to a tier: the
/// tier's. Anyone else: the models of their tier and of every subscription they have.
fn callers_models<'a>(
    policy: &'a PolicyDocument,
    caller: &Caller,
) -> Result<Vec<(&'a Model, Vec<&'a Subscription>)>, maas_types::SelectError> {
    let mut out: Vec<(&Model, Vec<&Subscription>)> = Vec::new();
    let mut add = |m: &'a Model, sub: Option<&'a Subscription>| match out
        .iter_mut()
        .find(|(o, _)| o.name == m.name)
    {
        Some((_, subs)) => subs.extend(sub),
        None => out.push((m, sub.into_iter().collect())),
    };
    if let Some(bound) = caller.bound_subscription() {
        let sub = maas_types::subscription::select(
            policy,
            &caller.username,
            &caller.groups,
            Some(bound),
            None,
        )?;
        for m in sub.models.iter().filter_map(|m| policy.model(&m.name)) {
            add(m, Some(sub));
        }
        return Ok(out);
    }
    if let Some(tier) = policy.resolve_tier(&caller.groups, caller.pinned_tier()) {
        for m in policy.models_for_tier(&tier.name) {
            add(m, None);
        }
    }
    if caller.pinned_tier().is_none() {
        for sub in maas_types::subscription::accessible(policy, &caller.username, &caller.groups) {
            for m in sub.models.iter().filter_map(|m| policy.model(&m.name)) {
                add(m, Some(sub));
            }
        }
    }
    Ok(out)
}

#[utoipa::path(get, path = "/v1/models", summary = "Models the caller may use (OpenAI list, the reference's fields): an API key bound to a subscription, that subscription's; a key pinned to a tier, the tier's; else the caller's tier's and every subscription's it has",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "models", body = ModelList),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "the key's subscription is gone or no longer has its owner", body = ErrorBody)
    )
)]
pub async fn list(
    State(policy): State<PolicyHandle>,
    State(public): State<PublicUrl>,
    State(readiness): State<Readiness>,
    caller: Caller,
) -> Response {
    let loaded = policy.current();
    let policy = &loaded.document;
    let models = match callers_models(policy, &caller) {
        Ok(m) => m,
        Err(e) => {
            return crate::http::error_response(
                StatusCode::FORBIDDEN,
                e.message(),
                ErrorKind::Permission,
                Some("invalid_subscription"),
            );
        }
    };
    let ready = readiness
        .ready(&models.iter().map(|(m, _)| *m).collect::<Vec<_>>())
        .await;
    let data = models
        .into_iter()
        .zip(ready)
        .map(|((m, subs), ready)| ModelEntry {
            id: m.name.clone(),
            object: "model",
            created: loaded.loaded_at,
            owned_by: m.owned_by.clone().unwrap_or_else(|| "maas".to_string()),
            kind: if m.providers().next().is_some() {
                "ExternalModel"
            } else {
                "llmisvc"
            },
            ready,
            url: public.model_url(m),
            model_details: details_entry(m),
            aliases: m.aliases.clone(),
            subscriptions: {
                let mut subs: Vec<ModelSubscription> = subs
                    .into_iter()
                    .map(|s| ModelSubscription {
                        name: s.name.clone(),
                        display_name: s.display_name.clone(),
                        description: s.description.clone(),
                    })
                    .collect();
                subs.sort_by(|a, b| a.name.cmp(&b.name));
                subs.dedup_by(|a, b| a.name == b.name);
                subs
            },
        })
        .collect();
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

// ---------------------------------------------------------------------------------------------
// GET /v1/subscriptions, GET /v1/model/{id}/subscriptions
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenRateLimitInfo {
    pub limit: u64,
    /// `<n>s|m|h|d`.
    pub window: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BillingRateInfo {
    /// A decimal string.
    pub per_token: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SubscriptionModelRef {
    pub name: String,
    /// The model's `ownedBy`, else the first segment of its path (KServe: its namespace).
    pub namespace: String,
    pub token_rate_limits: Vec<TokenRateLimitInfo>,
    /// Ours (the reference limits tokens only); absent when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub request_rate_limits: Vec<TokenRateLimitInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub billing_rate: Option<BillingRateInfo>,
}

/// One subscription, in the reference's shape.
#[derive(Debug, Serialize, ToSchema)]
pub struct SubscriptionInfo {
    /// The value to send in `X-MaaS-Subscription` (and to name at mint).
    pub subscription_id_header: String,
    /// `description`, else `displayName`, else the name.
    pub subscription_description: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    pub priority: i32,
    pub model_refs: Vec<SubscriptionModelRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub organization_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_center: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

fn limits_info(limits: &[maas_types::Limit]) -> Vec<TokenRateLimitInfo> {
    limits
        .iter()
        .map(|l| TokenRateLimitInfo {
            limit: l.limit,
            window: l.window.to_string(),
        })
        .collect()
}

fn model_namespace(policy: &PolicyDocument, name: &str) -> String {
    policy
        .model(name)
        .and_then(|m| {
            // `ownedBy` is a namespace, or (models from the reference's resources, as the
            // reference's `owned_by`) `namespace/name`.
            m.owned_by
                .as_deref()
                .and_then(|o| o.split('/').next())
                .map(str::to_string)
                .or_else(|| {
                    m.path
                        .trim_start_matches('/')
                        .split('/')
                        .next()
                        .map(str::to_string)
                })
        })
        .unwrap_or_default()
}

fn subscription_info(policy: &PolicyDocument, s: &Subscription) -> SubscriptionInfo {
    SubscriptionInfo {
        subscription_id_header: s.name.clone(),
        subscription_description: s
            .description
            .clone()
            .filter(|d| !d.is_empty())
            .or_else(|| s.display_name.clone())
            .unwrap_or_else(|| s.name.clone()),
        display_name: s.display_name.clone(),
        priority: s.priority,
        model_refs: s
            .models
            .iter()
            .map(|m| SubscriptionModelRef {
                name: m.name.clone(),
                namespace: model_namespace(policy, &m.name),
                token_rate_limits: limits_info(&m.token_rate_limits),
                request_rate_limits: limits_info(&m.request_rate_limits),
                billing_rate: m.billing_rate.as_ref().map(|b| BillingRateInfo {
                    per_token: b.per_token.clone(),
                }),
            })
            .collect(),
        organization_id: s.token_metadata.organization_id.clone(),
        cost_center: s.token_metadata.cost_center.clone(),
        labels: Some(s.token_metadata.labels.clone()).filter(|l| !l.is_empty()),
    }
}

#[utoipa::path(get, path = "/v1/subscriptions", summary = "The subscriptions the caller has (sorted by name)",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "subscriptions", body = [SubscriptionInfo]),
        (status = 401, description = "no valid credential", body = ErrorBody)
    )
)]
pub async fn subscriptions(
    State(policy): State<PolicyHandle>,
    caller: Caller,
) -> Json<Vec<SubscriptionInfo>> {
    let policy = policy.document();
    Json(
        maas_types::subscription::accessible(&policy, &caller.username, &caller.groups)
            .into_iter()
            .map(|s| subscription_info(&policy, s))
            .collect(),
    )
}

#[utoipa::path(get, path = "/v1/model/{id}/subscriptions", summary = "The caller's subscriptions that include a model (sorted by name)",
    params(("id" = String, Path, description = "the model's name")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "subscriptions", body = [SubscriptionInfo]),
        (status = 401, description = "no valid credential", body = ErrorBody)
    )
)]
pub async fn model_subscriptions(
    State(policy): State<PolicyHandle>,
    caller: Caller,
    Path(id): Path<String>,
) -> Json<Vec<SubscriptionInfo>> {
    let policy = policy.document();
    Json(
        maas_types::subscription::accessible(&policy, &caller.username, &caller.groups)
            .into_iter()
            .filter(|s| s.includes_model(&id))
            .map(|s| subscription_info(&policy, s))
            .collect(),
    )
}
