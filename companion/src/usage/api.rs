//! `GET /v1/usage` (the ledger) and `GET /v1/quota` (the lease store) on the public listener.
//!
//! Who sees what: a caller sees its own usage; an API key caller only its own key's; admins
//! (cluster identities in an admin group) may pass `user=` (a name, or `*` for everyone) and
//! `tier=`. A non-admin's `user=` naming someone else, or `tier=`, is a 403.

use super::Usage;
use super::store::{GroupBy, StoreError, UsageGroup, UsageQuery};
use crate::caller::{Caller, CallerKind};
use crate::http::{database_failure, error_response};
use crate::leases::Leases;
use crate::policy::PolicyHandle;
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::http::header::CACHE_CONTROL;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
use maas_types::{ErrorBody, ErrorKind, LeaseKind, Limit, PolicyDocument, Window};
use serde::Serialize;
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// Default period: the last 7 days.
pub const DEFAULT_PERIOD: TimeDelta = TimeDelta::days(7);
/// Longest period one query may cover.
pub const MAX_PERIOD: TimeDelta = TimeDelta::days(366);
/// Longest period of an hourly query.
pub const MAX_HOURLY_PERIOD: TimeDelta = TimeDelta::days(31);

#[derive(Debug, thiserror::Error)]
pub enum UsageApiError {
    /// 400 naming the parameter.
    #[error("{message}")]
    Invalid {
        param: &'static str,
        message: String,
    },
    /// 403: the parameter is for admins.
    #[error("only admins may pass {0}= (for anyone but yourself)")]
    Forbidden(&'static str),
    #[error("no tier is available for your groups")]
    NoTier,
    /// An API key whose subscription is gone from the policy.
    #[error("the subscription of this API key no longer exists")]
    NoSubscription,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the lease store cannot be reached")]
    LeaseStore,
    /// 500: the answer could not be written (logged).
    #[error("internal error")]
    Internal,
}

impl IntoResponse for UsageApiError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        match self {
            UsageApiError::Invalid { param, .. } => {
                let mut body = ErrorBody::new(
                    message,
                    ErrorKind::InvalidRequest,
                    Some("invalid_parameter"),
                );
                body.error.param = Some(param.to_string());
                (StatusCode::BAD_REQUEST, Json(body)).into_response()
            }
            UsageApiError::Forbidden(param) => {
                let mut body = ErrorBody::new(message, ErrorKind::Permission, Some("forbidden"));
                body.error.param = Some(param.to_string());
                (StatusCode::FORBIDDEN, Json(body)).into_response()
            }
            UsageApiError::NoTier => error_response(
                StatusCode::FORBIDDEN,
                message,
                ErrorKind::Permission,
                Some("no_tier"),
            ),
            UsageApiError::NoSubscription => error_response(
                StatusCode::FORBIDDEN,
                message,
                ErrorKind::Permission,
                Some("invalid_subscription"),
            ),
            UsageApiError::Store(e) => database_failure(e.is_unavailable(), &e),
            UsageApiError::LeaseStore => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the lease store (the limits' counters) cannot be reached; try again",
                ErrorKind::ServiceUnavailable,
                Some("lease_store_unavailable"),
            ),
            UsageApiError::Internal => error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                message,
                ErrorKind::Server,
                Some("internal_error"),
            ),
        }
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> UsageApiError {
    UsageApiError::Invalid {
        param,
        message: format!("{param}: {}", message.into()),
    }
}

/// The parameters of `GET /v1/usage`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageParams {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub group_by: GroupBy,
    pub user: Option<String>,
    pub tier: Option<String>,
}

/// The earliest time a query may name: 0001-01-01T00:00:00Z. PostgreSQL's `timestamptz` holds
/// 4713 BC to 294276 AD, chrono ±262,143 years: a bound inside both (and what RFC 3339 and a
/// date can spell) keeps every accepted time one the ledger's statement can take.
pub const EARLIEST: DateTime<Utc> = match NaiveDate::from_ymd_opt(1, 1, 1) {
    Some(d) => d.and_time(chrono::NaiveTime::MIN).and_utc(),
    None => DateTime::<Utc>::MIN_UTC,
};
/// The latest time a query may name: 10000-01-01T00:00:00Z (`to=9999-12-31` as a date).
pub const LATEST: DateTime<Utc> = match NaiveDate::from_ymd_opt(10000, 1, 1) {
    Some(d) => d.and_time(chrono::NaiveTime::MIN).and_utc(),
    None => DateTime::<Utc>::MAX_UTC,
};

/// `from` / `to`: RFC 3339, a UTC date `YYYY-MM-DD` (as `to`: the end of that day, so the day is
/// included), or Unix seconds; between [`EARLIEST`] and [`LATEST`].
fn parse_time(
    param: &'static str,
    s: &str,
    end_of_day: bool,
) -> Result<DateTime<Utc>, UsageApiError> {
    let t = parse_time_unbounded(param, s, end_of_day)?;
    if t < EARLIEST || t > LATEST {
        return Err(invalid(
            param,
            "must lie between 0001-01-01T00:00:00Z and 10000-01-01T00:00:00Z (Unix seconds -62135596800 to 253402300800)",
        ));
    }
    Ok(t)
}

fn parse_time_unbounded(
    param: &'static str,
    s: &str,
    end_of_day: bool,
) -> Result<DateTime<Utc>, UsageApiError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.to_utc());
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        let d = if end_of_day {
            d.succ_opt().unwrap_or(d)
        } else {
            d
        };
        return Ok(d.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc());
    }
    if let Some(t) = s
        .parse::<i64>()
        .ok()
        .and_then(|n| DateTime::from_timestamp(n, 0))
    {
        return Ok(t);
    }
    Err(invalid(
        param,
        "must be an RFC 3339 time (2026-12-01T10:00:00Z), a date (2026-12-01) or Unix seconds",
    ))
}

/// Checks the query string of `GET /v1/usage` (each parameter at most once, none unknown).
pub fn parse_params(
    pairs: &[(String, String)],
    now: DateTime<Utc>,
) -> Result<UsageParams, UsageApiError> {
    const KNOWN: [&str; 5] = ["from", "to", "groupBy", "user", "tier"];
    let mut seen: BTreeMap<&'static str, &str> = BTreeMap::new();
    for (name, value) in pairs {
        let Some(known) = KNOWN.iter().find(|k| **k == name.as_str()) else {
            return Err(UsageApiError::Invalid {
                param: "query",
                message: format!(
                    "unknown parameter {name:?} (known: from, to, groupBy, user, tier)"
                ),
            });
        };
        if seen.insert(known, value.as_str()).is_some() {
            return Err(invalid(known, "given more than once"));
        }
    }
    let to = match seen.get("to") {
        Some(s) => parse_time("to", s, true)?,
        None => now,
    };
    let from = match seen.get("from") {
        Some(s) => parse_time("from", s, false)?,
        None => to - DEFAULT_PERIOD,
    };
    if from >= to {
        return Err(invalid("to", "must be after from"));
    }
    let group_by = match seen.get("groupBy") {
        None => GroupBy::Day,
        Some(s) => GroupBy::parse(s).ok_or_else(|| {
            invalid(
                "groupBy",
                "must be day, hour, model, key, user, subscription, organization, costCenter or backend",
            )
        })?,
    };
    let span = to - from;
    if span > MAX_PERIOD {
        return Err(invalid("from", "the period may cover at most 366 days"));
    }
    if group_by == GroupBy::Hour && span > MAX_HOURLY_PERIOD {
        return Err(invalid(
            "from",
            "with groupBy=hour the period may cover at most 31 days",
        ));
    }
    let text = |name: &'static str| -> Result<Option<String>, UsageApiError> {
        match seen.get(name) {
            None => Ok(None),
            Some(v) if v.is_empty() || v.len() > 1024 => {
                Err(invalid(name, "must be 1 to 1024 bytes"))
            }
            Some(v) => Ok(Some((*v).to_string())),
        }
    };
    Ok(UsageParams {
        from,
        to,
        group_by,
        user: text("user")?,
        tier: text("tier")?,
    })
}

/// Who the caller is, for [`scope`].
#[derive(Debug, Clone, Copy)]
pub struct Who<'a> {
    pub username: &'a str,
    pub is_admin: bool,
    /// The key API's id of the caller's API key (an API key caller), else `None`.
    pub key_id: Option<&'a str>,
}

/// Whose rows a query covers: `(subject, key_id, tier)` (`subject` `None`: everyone).
pub type Scope = (Option<String>, Option<String>, Option<String>);

/// Who may see what (module doc). An admin's `tier=` without `user=` covers everyone in it.
pub fn scope(who: Who<'_>, user: Option<&str>, tier: Option<&str>) -> Result<Scope, UsageApiError> {
    let own = || Some(who.username.to_string());
    if !who.is_admin {
        if user.is_some_and(|u| u != who.username) {
            return Err(UsageApiError::Forbidden("user"));
        }
        if tier.is_some() {
            return Err(UsageApiError::Forbidden("tier"));
        }
        return Ok((own(), who.key_id.map(str::to_string), None));
    }
    let subject = match (user, tier) {
        (Some("*"), _) | (None, Some(_)) => None,
        (Some(u), _) => Some(u.to_string()),
        (None, None) => own(),
    };
    Ok((subject, None, tier.map(str::to_string)))
}

/// One group of `GET /v1/usage`: the grouping fields present are those of `groupBy`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageRow {
    /// `groupBy=day`: the UTC day.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "2026-12-01")]
    pub day: Option<String>,
    /// `groupBy=hour`: the hour (rows rolled up to days: the day's 00:00).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "2026-12-01T10:00:00Z")]
    pub hour: Option<String>,
    /// `groupBy=model`, `day`, `hour` and `backend`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `groupBy=key`: the API key's id (the key API's: `GET /v1/api-keys/{id}`); `null` for
    /// usage with a token.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub key_id: Option<Option<String>>,
    /// `groupBy=key`: the key's name, while the key exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_name: Option<String>,
    /// `groupBy=user`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `groupBy=subscription`: the subscription's name; `""` for usage on a tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    /// `groupBy=organization`: the subscription's `tokenMetadata.organizationId` when the
    /// usage was reported; `""` for none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub organization: Option<String>,
    /// `groupBy=costCenter`: its `tokenMetadata.costCenter`; `""` for none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_center: Option<String>,
    /// `groupBy=backend`: the name of the model's backend that served (a model with several
    /// `backends`); only usage that named one (every request of such a model, as reported by a
    /// filter that sends it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Requests forwarded to the model.
    pub requests: u64,
    /// Requests the gateway refused, by reason (`rate_limit_exceeded`, `tokens_exceed_limit`, …).
    pub refused: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// The part of `promptTokens` served from the provider's prompt cache (OpenAI cached
    /// tokens, Anthropic cache reads); 0 when the provider said none or the gateway did not
    /// report it.
    pub cached_input_tokens: u64,
    /// Tokens × the subscription model's `billingRate.perToken` when reported, added up
    /// exactly (a decimal string, in the rates' unit); `"0"` without a rate.
    #[schema(example = "0.0042")]
    pub cost: String,
}

impl UsageRow {
    fn from_group(g: UsageGroup, by: GroupBy) -> UsageRow {
        let mut row = UsageRow {
            day: None,
            hour: None,
            model: g.model,
            key_id: None,
            key_name: g.key_name,
            user: None,
            subscription: None,
            organization: None,
            cost_center: None,
            backend: None,
            requests: g.counts.requests,
            refused: g.counts.refused,
            prompt_tokens: g.counts.prompt_tokens,
            completion_tokens: g.counts.completion_tokens,
            total_tokens: g
                .counts
                .prompt_tokens
                .saturating_add(g.counts.completion_tokens),
            cached_input_tokens: g.counts.cached_input_tokens,
            cost: g.cost,
        };
        match by {
            GroupBy::Day => row.day = Some(g.group),
            GroupBy::Hour => row.hour = Some(g.group),
            GroupBy::Model => row.model = Some(g.group),
            GroupBy::Key => row.key_id = Some(Some(g.group).filter(|k| !k.is_empty())),
            GroupBy::User => row.user = Some(g.group),
            GroupBy::Subscription => row.subscription = Some(g.group),
            GroupBy::Organization => row.organization = Some(g.group),
            GroupBy::CostCenter => row.cost_center = Some(g.group),
            GroupBy::Backend => row.backend = Some(g.group),
        }
        row
    }
}

/// The CSV columns of a grouping: its own, then the counts.
fn csv_header(by: GroupBy) -> Vec<&'static str> {
    let mut h = match by {
        GroupBy::Day => vec!["day", "model"],
        GroupBy::Hour => vec!["hour", "model"],
        GroupBy::Model => vec!["model"],
        GroupBy::Key => vec!["keyId", "keyName"],
        GroupBy::User => vec!["user"],
        GroupBy::Subscription => vec!["subscription"],
        GroupBy::Organization => vec!["organization"],
        GroupBy::CostCenter => vec!["costCenter"],
        GroupBy::Backend => vec!["backend", "model"],
    };
    h.extend([
        "requests",
        "refused",
        "promptTokens",
        "completionTokens",
        "totalTokens",
        "cachedInputTokens",
        "cost",
    ]);
    h
}

/// A text cell a spreadsheet will not run: one starting with `=`, `+`, `-`, `@`, tab or CR (a
/// formula to Excel and its kin) gets a leading `'`. User names come from identity providers,
/// key names from users: a name must not become a formula in an admin's export.
fn text_cell(s: Option<&str>) -> String {
    let s = s.unwrap_or_default();
    if s.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        format!("'{s}")
    } else {
        s.to_string()
    }
}

/// `GET /v1/usage` as CSV (`Accept: text/csv`): one header line, one line per group; `refused`
/// as `reason=count` pairs joined by `;`; text cells never formulas ([`text_cell`]).
pub fn to_csv(by: GroupBy, rows: &[UsageRow]) -> Result<Vec<u8>, UsageApiError> {
    let mut w = csv::Writer::from_writer(Vec::new());
    let fail = |e: csv::Error| {
        tracing::error!(error = %e, "writing the usage CSV");
        UsageApiError::Internal
    };
    w.write_record(csv_header(by)).map_err(fail)?;
    for r in rows {
        let key_id = r.key_id.clone().flatten();
        let cells: Vec<Option<&str>> = match by {
            GroupBy::Day => vec![r.day.as_deref(), r.model.as_deref()],
            GroupBy::Hour => vec![r.hour.as_deref(), r.model.as_deref()],
            GroupBy::Model => vec![r.model.as_deref()],
            GroupBy::Key => vec![key_id.as_deref(), r.key_name.as_deref()],
            GroupBy::User => vec![r.user.as_deref()],
            GroupBy::Subscription => vec![r.subscription.as_deref()],
            GroupBy::Organization => vec![r.organization.as_deref()],
            GroupBy::CostCenter => vec![r.cost_center.as_deref()],
            GroupBy::Backend => vec![r.backend.as_deref(), r.model.as_deref()],
        };
        let mut line: Vec<String> = cells.into_iter().map(text_cell).collect();
        let refused: Vec<String> = r.refused.iter().map(|(k, v)| format!("{k}={v}")).collect();
        line.extend([
            r.requests.to_string(),
            refused.join(";"),
            r.prompt_tokens.to_string(),
            r.completion_tokens.to_string(),
            r.total_tokens.to_string(),
            r.cached_input_tokens.to_string(),
            r.cost.clone(),
        ]);
        w.write_record(&line).map_err(fail)?;
    }
    w.into_inner().map_err(|e| fail(e.into_error().into()))
}

/// Whether the client asked for CSV (`Accept` naming `text/csv`).
fn wants_csv(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/csv"))
        })
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageList {
    #[schema(value_type = String)]
    pub object: &'static str,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    #[schema(value_type = String)]
    pub group_by: &'static str,
    pub data: Vec<UsageRow>,
}

fn group_by_name(g: GroupBy) -> &'static str {
    match g {
        GroupBy::Day => "day",
        GroupBy::Hour => "hour",
        GroupBy::Model => "model",
        GroupBy::Key => "key",
        GroupBy::User => "user",
        GroupBy::Subscription => "subscription",
        GroupBy::Organization => "organization",
        GroupBy::CostCenter => "costCenter",
        GroupBy::Backend => "backend",
    }
}

/// The key API's id of an API key caller (the ledger's key id).
fn key_id_of(caller: &Caller) -> Option<String> {
    match &caller.kind {
        CallerKind::ApiKey { id, .. } => Some(id.to_string()),
        CallerKind::Cluster => None,
    }
}

#[utoipa::path(get, path = "/v1/usage", summary = "Usage from the ledger: requests, refusals and tokens, grouped",
    description = "The caller's own usage (an API key: its own key's only), as the gateways reported it (at most one report interval behind). Rows older than the hourly retention are kept per day. Admins may pass user= (a name or *) and tier= (alone: everyone in the tier).",
    security(("bearer" = [])),
    params(
        ("from" = Option<String>, Query, description = "Start (RFC 3339, YYYY-MM-DD or Unix seconds; 0001-01-01 to 10000-01-01); default: 7 days before `to`"),
        ("to" = Option<String>, Query, description = "End, exclusive (a date: the end of that day); default: now"),
        ("groupBy" = Option<String>, Query, description = "day (default; per day and model), hour (per hour and model), model, key, user, subscription, organization or costCenter (chargeback: the subscription's tokenMetadata when the usage was reported), or backend (per backend and model: the backend of a model with several that served, as the route's x-maas-served-by named it)"),
        ("user" = Option<String>, Query, description = "Admins: whose usage (`*`: everyone)"),
        ("tier" = Option<String>, Query, description = "Admins: only rows of this tier")
    ),
    responses(
        (status = 200, description = "usage (as CSV with `Accept: text/csv`: a header line, then one line per group)", body = UsageList),
        (status = 400, description = "a bad parameter (named in `param`)", body = ErrorBody),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "user= or tier= from a non-admin", body = ErrorBody),
        (status = 503, description = "database unavailable", body = ErrorBody)
    )
)]
pub async fn usage(
    State(usage): State<Usage>,
    caller: Caller,
    headers: axum::http::HeaderMap,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Response, UsageApiError> {
    let Query(pairs) = query.map_err(|e| UsageApiError::Invalid {
        param: "query",
        message: format!("query: {}", e.body_text()),
    })?;
    let params = parse_params(&pairs, Utc::now())?;
    let own_key = key_id_of(&caller);
    let who = Who {
        username: &caller.username,
        is_admin: caller.is_admin,
        key_id: own_key.as_deref(),
    };
    let (subject, key_id, tier) = scope(who, params.user.as_deref(), params.tier.as_deref())?;
    let query = UsageQuery {
        subject,
        key_id,
        tier,
        from: params.from,
        to: params.to,
        group_by: params.group_by,
    };
    let groups = usage.store.query(&query).await?;
    let data: Vec<UsageRow> = groups
        .into_iter()
        .map(|g| UsageRow::from_group(g, params.group_by))
        .collect();
    if wants_csv(&headers) {
        return Ok((
            [
                (CACHE_CONTROL, "no-store"),
                (axum::http::header::CONTENT_TYPE, "text/csv; charset=utf-8"),
            ],
            to_csv(params.group_by, &data)?,
        )
            .into_response());
    }
    Ok((
        [(CACHE_CONTROL, "no-store")],
        Json(UsageList {
            object: "list",
            from: params.from,
            to: params.to,
            group_by: group_by_name(params.group_by),
            data,
        }),
    )
        .into_response())
}

/// One limit window that applies to the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaWindow {
    pub kind: LeaseKind,
    pub window: Window,
    /// The smallest limit among the applicable tiers for this (kind, window).
    pub limit: u64,
    /// Under a subscription: the model whose window it is (counted per subject, subscription
    /// and model); `None`: the subject's own (tier) counter.
    pub model: Option<String>,
    /// The warning thresholds (percent) of the tier or subscription whose limit this is.
    pub warn_at: Vec<u8>,
}

/// The windows of a key bound to `subscription`, as the gateway counts them: for each of its
/// models, its request windows then its token windows (shortest first), each its own counter
/// ([`maas_types::subscription::counter_subject`]). `None`: no such subscription.
pub fn subscription_quota_windows(
    policy: &PolicyDocument,
    subscription: &str,
) -> Option<Vec<QuotaWindow>> {
    let sub = policy.subscription(subscription)?;
    let mut out = Vec::new();
    for m in &sub.models {
        let budgets: Vec<Limit> = m.budgets.iter().map(maas_types::Budget::as_limit).collect();
        for (kind, limits) in [
            (LeaseKind::Requests, &m.request_rate_limits),
            (LeaseKind::Tokens, &m.token_rate_limits),
            (LeaseKind::Cost, &budgets),
        ] {
            // Shadow limits are tried, not enforced: not a quota.
            let mut limits: Vec<_> = limits.iter().filter(|l| !l.shadow).copied().collect();
            limits.sort_by_key(|l| l.window);
            out.extend(limits.into_iter().map(|l| QuotaWindow {
                kind,
                window: l.window,
                limit: l.limit,
                model: Some(m.name.clone()),
                warn_at: sub.warn_at.clone(),
            }));
        }
    }
    Some(out)
}

/// The windows of the scopes the caller's requests count in (under `subscription`, else on a
/// tier: for any model the subscription holds, or any model), with each scope's name and
/// the counter the gateways count the caller's requests in ([`maas_types::Scope::counter_subject`]).
/// Shortest window first within a scope; shadow limits left out. An API key's own limits
/// (set at mint) come last, as scope `key`.
pub fn scope_windows(
    policy: &PolicyDocument,
    subscription: Option<&str>,
    caller: &Caller,
) -> Vec<(QuotaWindow, String, String)> {
    let sub = subscription.and_then(|s| policy.subscription(s));
    let models: Vec<&str> = match sub {
        Some(s) => s.models.iter().map(|m| m.name.as_str()).collect(),
        None => policy.models.iter().map(|m| m.name.as_str()).collect(),
    };
    let mut out = Vec::new();
    let key_scope = caller.key_scope();
    for scope in policy
        .scopes
        .iter()
        .filter(|sc| models.iter().any(|m| sc.applies(m, sub)))
        .chain(key_scope.as_ref())
    {
        let counter = scope.counter_subject(&caller.username, caller.key_id());
        let budgets: Vec<Limit> = scope
            .limits
            .budgets
            .iter()
            .map(maas_types::Budget::as_limit)
            .collect();
        for (kind, limits) in [
            (LeaseKind::Requests, &scope.limits.requests),
            (LeaseKind::Tokens, &scope.limits.tokens),
            (LeaseKind::Cost, &budgets),
        ] {
            let mut limits: Vec<_> = limits.iter().filter(|l| !l.shadow).copied().collect();
            limits.sort_by_key(|l| l.window);
            out.extend(limits.into_iter().map(|l| {
                (
                    QuotaWindow {
                        kind,
                        window: l.window,
                        limit: l.limit,
                        model: None,
                        warn_at: Vec::new(),
                    },
                    scope.name.clone(),
                    counter.clone(),
                )
            }));
        }
    }
    out
}

/// The windows that apply to a caller, as the gateway counts them: those of the tier the
/// request runs on (a key's pinned tier) and of the subject's own highest tier, one count per
/// (kind, window length), each checked against its limit (so the smallest binds). `None`: no
/// tier. Requests first, then tokens, shortest window first.
pub fn quota_windows(
    policy: &PolicyDocument,
    groups: &[String],
    pinned: Option<&str>,
) -> Option<(String, Vec<QuotaWindow>)> {
    let running = policy.resolve_tier(groups, pinned)?;
    let own = policy.resolve_tier(groups, None);
    // The smallest limit of each window, with its tier's thresholds.
    let mut windows: BTreeMap<(u8, Window), (u64, &[u8])> = BTreeMap::new();
    for tier in std::iter::once(running).chain(own) {
        let budgets: Vec<Limit> = tier
            .limits
            .budgets
            .iter()
            .map(maas_types::Budget::as_limit)
            .collect();
        for (rank, limits) in [
            (0, &tier.limits.requests),
            (1, &tier.limits.tokens),
            (2, &budgets),
        ] {
            for l in limits.iter().filter(|l| !l.shadow) {
                let entry = windows
                    .entry((rank, l.window))
                    .or_insert((l.limit, &tier.warn_at));
                if l.limit < entry.0 {
                    *entry = (l.limit, &tier.warn_at);
                }
            }
        }
    }
    let list = windows
        .into_iter()
        .map(|((rank, window), (limit, warn_at))| QuotaWindow {
            kind: match rank {
                0 => LeaseKind::Requests,
                1 => LeaseKind::Tokens,
                _ => LeaseKind::Cost,
            },
            window,
            limit,
            model: None,
            warn_at: warn_at.to_vec(),
        })
        .collect();
    Some((running.name.clone(), list))
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaRow {
    /// `requests`, `tokens` or `cost` (a money budget).
    #[schema(value_type = String)]
    pub kind: &'static str,
    /// `1m`, `1h`, `1d`, …
    pub window: String,
    pub window_seconds: u64,
    pub limit: u64,
    /// Taken in the current window by the gateways (leases granted included): what they enforce
    /// against, at most one report interval behind.
    pub used: u64,
    pub remaining: u64,
    pub window_start: DateTime<Utc>,
    pub resets_at: DateTime<Utc>,
    /// A key bound to a subscription: the model this window is for (each model of the
    /// subscription has its own budget).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The subscription's limits are one pool for all its users (`subscriptions[].pool`):
    /// `used` is everyone's.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub pool: bool,
    /// A scope's window (`scopes[].name`): its counter is the scope's (everyone's it matches,
    /// the user's or the key's, as its `per` says), counted beside the caller's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// `used` as a percentage of `limit` (at most 100).
    pub percent_used: u64,
    /// The highest `warnAt` threshold the window is past (the gateway then sends
    /// `x-maas-quota-warning`); absent below the first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<u8>,
    /// What has been taken per hour on average since the window started.
    pub burn_rate_per_hour: u64,
    /// When the limit is reached at that rate, if before the window resets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub projected_exhaustion_at: Option<DateTime<Utc>>,
    /// Kind `cost` (a money budget; `limit`, `used`, `remaining` and the burn rate are then in
    /// nano-units): the same as exact decimals of the currency.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amounts: Option<QuotaAmounts>,
}

/// A money budget's figures as decimal strings (`"10.5"`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaAmounts {
    #[schema(example = "10")]
    pub limit: String,
    pub used: String,
    pub remaining: String,
    pub burn_rate_per_hour: String,
}

/// The burn of a window at `now`: what was taken per hour on average since `start`, and when
/// `limit` is reached at that rate (unix seconds) if before the window ends (`None`: not in this
/// window, or nothing taken). Integer arithmetic, rounding the exhaustion time up.
pub fn burn(used: u64, limit: u64, start: u64, seconds: u64, now: u64) -> (u64, Option<u64>) {
    let elapsed = u128::from(now.saturating_sub(start).max(1));
    let used128 = u128::from(used);
    let per_hour = u64::try_from(used128 * 3600 / elapsed).unwrap_or(u64::MAX);
    if used == 0 {
        return (per_hour, None);
    }
    let remaining = u128::from(limit.saturating_sub(used));
    let to_go = u64::try_from((remaining * elapsed).div_ceil(used128)).unwrap_or(u64::MAX);
    let at = now.saturating_add(to_go);
    (per_hour, (at < start.saturating_add(seconds)).then_some(at))
}

/// `used` as a percentage of `limit` (a zero limit: 100), at most 100, and the highest of
/// `warn_at` it is past.
pub fn warning(used: u64, limit: u64, warn_at: &[u8]) -> (u64, Option<u8>) {
    let pct = if limit == 0 {
        100
    } else {
        u64::try_from((u128::from(used) * 100 / u128::from(limit)).min(100)).unwrap_or(100)
    };
    (
        pct,
        warn_at
            .iter()
            .rev()
            .find(|t| u64::from(**t) <= pct)
            .copied(),
    )
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaList {
    #[schema(value_type = String)]
    pub object: &'static str,
    pub subject: String,
    /// The tier requests with this credential run on (`subscription:<name>` for a key bound to
    /// a subscription, as the gateway names it).
    pub tier: String,
    /// The subscription of an API key bound to one: the rows are its windows per model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    /// Where the counters live: `redis` or `memory`.
    #[schema(value_type = String)]
    pub store: &'static str,
    pub data: Vec<QuotaRow>,
}

fn at(unix: u64) -> DateTime<Utc> {
    DateTime::from_timestamp(i64::try_from(unix).unwrap_or(i64::MAX), 0).unwrap_or_default()
}

#[utoipa::path(get, path = "/v1/quota", summary = "What is left of each limit window now",
    description = "For each request and token window of the caller's tier (and of the user's own highest tier, when an API key is pinned lower: both apply): the limit, what the gateways have taken in the current window (the global budget-lease counter they enforce against, within one report interval; leases granted to gateways but not used yet count as used until given back), what remains and when the window resets.",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "quota", body = QuotaList),
        (status = 401, description = "no valid credential", body = ErrorBody),
        (status = 403, description = "no tier for the caller's groups", body = ErrorBody),
        (status = 503, description = "the lease store cannot be reached", body = ErrorBody)
    )
)]
pub async fn quota(
    State(policy): State<PolicyHandle>,
    State(leases): State<Leases>,
    caller: Caller,
) -> Result<Response, UsageApiError> {
    let policy = policy.document();
    let subscription = caller.bound_subscription().map(str::to_string);
    let (tier, windows) = match &subscription {
        Some(sub) => (
            maas_types::subscription::limits_tier_name(sub),
            subscription_quota_windows(&policy, sub).ok_or(UsageApiError::NoSubscription)?,
        ),
        None => quota_windows(&policy, &caller.groups, caller.pinned_tier())
            .ok_or(UsageApiError::NoTier)?,
    };
    let pooled = subscription
        .as_deref()
        .and_then(|s| policy.subscription(s))
        .is_some_and(|s| s.pool);
    let now = u64::try_from(Utc::now().timestamp()).unwrap_or(0);
    let scoped = scope_windows(&policy, subscription.as_deref(), &caller);
    let mut data = Vec::with_capacity(windows.len() + scoped.len());
    let own = windows.into_iter().map(|w| (w, None));
    for (w, scope) in own.chain(scoped.into_iter().map(|(w, s, c)| (w, Some((s, c))))) {
        let seconds = w.window.seconds();
        let start = w.window.start_of(now);
        // The counter the gateways enforce against (the same function as theirs).
        let counter = match (&scope, &subscription, &w.model) {
            (Some((_, counter)), ..) => counter.clone(),
            (None, Some(sub), Some(model)) => match policy.subscription(sub) {
                Some(s) => s.counter_subject_of(&caller.username, model),
                None => maas_types::subscription::counter_subject(&caller.username, sub, model),
            },
            _ => caller.username.clone(),
        };
        let used = leases
            .taken(&counter, w.kind, seconds, start)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "quota: lease store unreachable");
                UsageApiError::LeaseStore
            })?;
        let (percent_used, warning) = warning(used, w.limit, &w.warn_at);
        let (burn_rate_per_hour, exhaustion) = burn(used, w.limit, start, seconds, now);
        data.push(QuotaRow {
            kind: w.kind.as_str(),
            window: w.window.to_string(),
            window_seconds: seconds,
            limit: w.limit,
            used,
            remaining: w.limit.saturating_sub(used),
            window_start: at(start),
            resets_at: at(start.saturating_add(seconds)),
            pool: w.model.is_some() && pooled && scope.is_none(),
            scope: scope.map(|(name, _)| name),
            model: w.model,
            percent_used,
            warning,
            burn_rate_per_hour,
            projected_exhaustion_at: exhaustion.map(at),
            amounts: (w.kind == LeaseKind::Cost).then(|| {
                let money = |n: u64| maas_types::Money(n).to_string();
                QuotaAmounts {
                    limit: money(w.limit),
                    used: money(used),
                    remaining: money(w.limit.saturating_sub(used)),
                    burn_rate_per_hour: money(burn_rate_per_hour),
                }
            }),
        });
    }
    Ok((
        [(CACHE_CONTROL, "no-store")],
        Json(QuotaList {
            object: "list",
            subject: caller.username,
            tier,
            subscription,
            store: leases.store_kind(),
            data,
        }),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(q: &[(&str, &str)]) -> Vec<(String, String)> {
        q.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-12-08T10:30:00Z")
            .unwrap()
            .to_utc()
    }

    fn param_of(q: &[(&str, &str)]) -> Option<&'static str> {
        match parse_params(&pairs(q), now()) {
            Err(UsageApiError::Invalid { param, .. }) => Some(param),
            _ => None,
        }
    }

    #[test]
    fn burn_rate_and_projected_exhaustion() {
        // A day window started at 0; at 6 h 25 % is used: 4 %/h... exhausted at 24 h = the
        // reset, so not projected; at 50 % after 6 h it is reached at 12 h.
        let day = 86_400;
        assert_eq!(burn(250, 1000, 0, day, 6 * 3600), (41, None));
        assert_eq!(burn(500, 1000, 0, day, 6 * 3600), (83, Some(12 * 3600)));
        // Nothing taken: no projection; all taken: now.
        assert_eq!(burn(0, 1000, 0, day, 3600), (0, None));
        assert_eq!(burn(1000, 1000, 0, day, 3600), (1000, Some(3600)));
        // The first second of a window, and rounding up.
        assert_eq!(burn(1, 3, 60, 60, 60), (3600, Some(62)));
        assert_eq!(burn(u64::MAX, u64::MAX, 0, day, 0), (u64::MAX, Some(0)));
    }

    #[test]
    fn warnings_are_the_highest_threshold_passed() {
        assert_eq!(warning(79, 100, &[80, 95]), (79, None));
        assert_eq!(warning(80, 100, &[80, 95]), (80, Some(80)));
        assert_eq!(warning(99, 100, &[80, 95]), (99, Some(95)));
        assert_eq!(warning(150, 100, &[80, 95]), (100, Some(95)));
        assert_eq!(warning(5, 0, &[]), (100, None));
    }

    #[test]
    fn defaults_are_the_last_7_days_by_day() {
        let p = parse_params(&[], now()).unwrap();
        assert_eq!(p.to, now());
        assert_eq!(p.from, now() - TimeDelta::days(7));
        assert_eq!(p.group_by, GroupBy::Day);
    }

    #[test]
    fn dates_rfc3339_and_unix_seconds_are_accepted_and_a_to_date_includes_its_day() {
        let p = parse_params(
            &pairs(&[
                ("from", "2026-12-01"),
                ("to", "2026-12-07"),
                ("groupBy", "model"),
            ]),
            now(),
        )
        .unwrap();
        assert_eq!(p.from.to_rfc3339(), "2026-12-01T00:00:00+00:00");
        assert_eq!(p.to.to_rfc3339(), "2026-12-08T00:00:00+00:00");
        let p = parse_params(
            &pairs(&[("from", "2026-12-01T10:00:00+01:00"), ("to", "1796119200")]),
            now(),
        )
        .unwrap();
        assert_eq!(p.from.to_rfc3339(), "2026-12-01T09:00:00+00:00");
        assert_eq!(p.to.timestamp(), 1_796_119_200);
    }

    #[test]
    fn a_bad_parameter_is_named() {
        assert_eq!(param_of(&[("from", "yesterday")]), Some("from"));
        assert_eq!(param_of(&[("to", "2026-13-01")]), Some("to"));
        assert_eq!(param_of(&[("groupBy", "week")]), Some("groupBy"));
        assert_eq!(
            param_of(&[("from", "2026-12-09")]),
            Some("to"),
            "from after to"
        );
        assert_eq!(
            param_of(&[("from", "2024-01-01")]),
            Some("from"),
            "too long"
        );
        assert_eq!(
            param_of(&[("from", "2026-10-01"), ("groupBy", "hour")]),
            Some("from")
        );
        assert_eq!(param_of(&[("user", "")]), Some("user"));
        assert_eq!(param_of(&[("model", "m")]), Some("query"), "unknown");
        assert_eq!(param_of(&[("tier", "a"), ("tier", "b")]), Some("tier"));
        assert_eq!(param_of(&[("groupBy", "key"), ("user", "bob")]), None);
    }

    #[test]
    fn times_beyond_what_the_ledger_holds_are_named() {
        // Unix seconds chrono takes but PostgreSQL's timestamptz does not (was a 500).
        assert_eq!(
            param_of(&[("from", "-8000000000000"), ("to", "-7999990000000")]),
            Some("to")
        );
        assert_eq!(param_of(&[("from", "-8000000000000")]), Some("from"));
        assert_eq!(
            param_of(&[("from", "8000000000000"), ("to", "8000000010000")]),
            Some("to")
        );
        assert_eq!(
            param_of(&[("from", "2026-12-01"), ("to", "8000000000000")]),
            Some("to")
        );
        // The bounds themselves are accepted.
        let p = parse_params(
            &pairs(&[("from", "-62135596800"), ("to", "0001-01-02")]),
            now(),
        )
        .unwrap();
        assert_eq!(p.from, EARLIEST);
        let p = parse_params(
            &pairs(&[("from", "9999-12-31"), ("to", "9999-12-31")]),
            now(),
        )
        .unwrap();
        assert_eq!(p.to, LATEST);
        assert_eq!(LATEST.timestamp(), 253_402_300_800);
        assert_eq!(
            param_of(&[("from", "9999-12-31"), ("to", "253402300801")]),
            Some("to")
        );
    }

    fn who<'a>(username: &'a str, is_admin: bool, key_id: Option<&'a str>) -> Who<'a> {
        Who {
            username,
            is_admin,
            key_id,
        }
    }

    fn own(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn callers_see_their_own_usage_keys_their_own_key_and_admins_whom_they_ask() {
        let alice = who("alice", false, None);
        assert_eq!(
            scope(alice, None, None).unwrap(),
            (own("alice"), None, None)
        );
        assert_eq!(
            scope(alice, Some("alice"), None).unwrap(),
            (own("alice"), None, None)
        );
        assert!(matches!(
            scope(alice, Some("bob"), None),
            Err(UsageApiError::Forbidden("user"))
        ));
        assert!(matches!(
            scope(alice, Some("*"), None),
            Err(UsageApiError::Forbidden("user"))
        ));
        assert!(matches!(
            scope(alice, None, Some("free")),
            Err(UsageApiError::Forbidden("tier"))
        ));
        let key = who("alice", false, Some("k1"));
        assert_eq!(
            scope(key, None, None).unwrap(),
            (own("alice"), own("k1"), None)
        );
        let carol = who("carol", true, None);
        assert_eq!(
            scope(carol, None, None).unwrap(),
            (own("carol"), None, None)
        );
        assert_eq!(
            scope(carol, Some("alice"), None).unwrap(),
            (own("alice"), None, None)
        );
        assert_eq!(scope(carol, Some("*"), None).unwrap(), (None, None, None));
        assert_eq!(
            scope(carol, None, Some("free")).unwrap(),
            (None, None, own("free"))
        );
        assert_eq!(
            scope(carol, Some("alice"), Some("free")).unwrap(),
            (own("alice"), None, own("free"))
        );
    }

    const POLICY: &str = r#"{"tiers":[
        {"name":"free","level":0,"groups":["all"],
         "limits":{"requests":[{"limit":30,"window":"1m"}],
                   "tokens":[{"limit":2000,"window":"1m"},{"limit":100000,"window":"1d"}]}},
        {"name":"premium","level":1,"groups":["premium"],
         "limits":{"requests":[{"limit":300,"window":"1m"}],"tokens":[{"limit":50000,"window":"1m"}]}}],
        "models":[]}"#;

    #[test]
    fn quota_windows_are_the_running_tier_and_the_own_tier_the_smallest_limit_binding() {
        let policy: PolicyDocument = serde_json::from_str(POLICY).unwrap();
        let groups = vec!["all".to_string(), "premium".to_string()];
        let (tier, w) = quota_windows(&policy, &groups, None).unwrap();
        assert_eq!(tier, "premium");
        let shown: Vec<(LeaseKind, String, u64)> = w
            .iter()
            .map(|w| (w.kind, w.window.to_string(), w.limit))
            .collect();
        assert_eq!(
            shown,
            vec![
                (LeaseKind::Requests, "1m".into(), 300),
                (LeaseKind::Tokens, "1m".into(), 50000)
            ]
        );
        // A key pinned to free: free's windows, and premium's own (the same 1m count, free's
        // smaller limit binds), plus free's daily token window.
        let (tier, w) = quota_windows(&policy, &groups, Some("free")).unwrap();
        assert_eq!(tier, "free");
        let shown: Vec<(LeaseKind, String, u64)> = w
            .iter()
            .map(|w| (w.kind, w.window.to_string(), w.limit))
            .collect();
        assert_eq!(
            shown,
            vec![
                (LeaseKind::Requests, "1m".into(), 30),
                (LeaseKind::Tokens, "1m".into(), 2000),
                (LeaseKind::Tokens, "1d".into(), 100000)
            ]
        );
        assert!(quota_windows(&policy, &["nobody".to_string()], None).is_none());
    }

    /// Shadow limits are tried, not enforced: never a quota row, never the binding limit.
    #[test]
    fn shadow_limits_are_no_quota() {
        let mut policy: PolicyDocument = serde_json::from_str(POLICY).unwrap();
        let premium = policy
            .tiers
            .iter_mut()
            .find(|t| t.name == "premium")
            .unwrap();
        premium.limits.requests.push(Limit {
            limit: 1,
            window: serde_json::from_value(serde_json::json!("1m")).unwrap(),
            shadow: true,
        });
        premium.limits.tokens.push(Limit {
            limit: 5,
            window: serde_json::from_value(serde_json::json!("1h")).unwrap(),
            shadow: true,
        });
        let groups = vec!["all".to_string(), "premium".to_string()];
        let (_, w) = quota_windows(&policy, &groups, None).unwrap();
        let shown: Vec<(String, u64)> = w.iter().map(|w| (w.window.to_string(), w.limit)).collect();
        assert_eq!(shown, [("1m".to_string(), 300), ("1m".to_string(), 50000)]);
    }
}
