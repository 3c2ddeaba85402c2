//! `POST /internal/v1/usage` (internal listener only): a gateway worker's usage report batch.

use super::Usage;
use super::store::{Applied, Chargeback, Rates};
use crate::http::{ApiJson, error_response};
use crate::policy::PolicyHandle;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maas_types::usage::UsageRecord;
use maas_types::usage::{HOUR_SECONDS, UsageAccepted, UsageInvalid, UsageReport, validate};
use maas_types::{ErrorBody, ErrorKind, PolicyDocument};

/// How far ahead of this companion's clock an `hourStart` may be (clock skew).
pub const MAX_FUTURE_SECONDS: u64 = HOUR_SECONDS;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// 400 naming the field: nothing applied, do not resend.
    #[error("{}", .0.message)]
    Invalid(UsageInvalid),
    /// 503: nothing applied; resend the batch (same `batchId`).
    #[error("the usage ledger cannot be written now")]
    Unavailable,
    /// 500: nothing applied.
    #[error("internal error")]
    Internal,
}

impl IntoResponse for ReportError {
    fn into_response(self) -> Response {
        match self {
            ReportError::Invalid(invalid) => {
                let mut body = ErrorBody::new(
                    invalid.message,
                    ErrorKind::InvalidRequest,
                    Some("invalid_usage_report"),
                );
                body.error.param = Some(invalid.field);
                (StatusCode::BAD_REQUEST, Json(body)).into_response()
            }
            ReportError::Unavailable => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the usage ledger cannot be written now; nothing was applied, send the batch again",
                ErrorKind::ServiceUnavailable,
                Some("unavailable"),
            ),
            ReportError::Internal => error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal error; nothing was applied",
                ErrorKind::Server,
                Some("internal_error"),
            ),
        }
    }
}

/// The contract's rules, and no hour beyond [`MAX_FUTURE_SECONDS`] ahead of `now_unix`.
pub fn check(report: &UsageReport, now_unix: u64) -> Result<(), UsageInvalid> {
    validate(report)?;
    let latest = now_unix.saturating_add(MAX_FUTURE_SECONDS);
    match report.records.iter().position(|r| r.hour_start > latest) {
        Some(i) => {
            let field = format!("records[{i}].hourStart");
            Err(UsageInvalid {
                message: format!(
                    "{field}: is in the future (more than {MAX_FUTURE_SECONDS} s ahead of the companion's clock)"
                ),
                field,
            })
        }
        None => Ok(()),
    }
}

/// What a record is charged to under `policy`: a subscription's usage (the ledger's tier
/// `subscription:<name>`) its `tokenMetadata` organisation and cost centre and the model's
/// `billingRate.perToken`; anything else (a tier, a subscription or model no longer in the
/// policy) nothing.
pub fn chargeback(policy: &PolicyDocument, r: &UsageRecord) -> Chargeback {
    // The tier's prices for the model, else the model's own.
    let model_pricing = policy
        .tiers
        .iter()
        .find(|t| t.name == r.tier)
        .and_then(|t| t.pricing_of(&r.model))
        .or_else(|| {
            policy
                .models
                .iter()
                .find(|m| m.name == r.model)
                .and_then(|m| m.pricing)
        });
    let sub = r
        .tier
        .strip_prefix("subscription:")
        .and_then(|name| policy.subscription(name));
    let sub_model = sub.and_then(|s| s.model(&r.model));
    // A subscription's flat billing rate, else its prices, else the model's (money budgets
    // charge the same prices), else nothing.
    let rates = match sub_model.and_then(|m| m.billing_rate.as_ref()) {
        // Validated with the policy; checked again because the statement casts it.
        Some(b) if maas_types::policy::is_decimal(&b.per_token) => Rates::flat(&b.per_token),
        _ => sub_model
            .and_then(|m| m.pricing)
            .or(model_pricing)
            .map(|p| Rates {
                input: p.input.to_string(),
                cached_input: p.cached_input.unwrap_or(p.input).to_string(),
                output: p.output.to_string(),
            })
            .unwrap_or_default(),
    };
    let meta = sub.map(|s| &s.token_metadata);
    Chargeback {
        organization: meta
            .and_then(|m| m.organization_id.clone())
            .unwrap_or_default(),
        cost_center: meta.and_then(|m| m.cost_center.clone()).unwrap_or_default(),
        rates,
    }
}

/// Checks the batch, applies it once (a known batch id adds nothing), counts it.
#[tracing::instrument(name = "usage.ingest", skip_all, fields(maas.records = report.records.len()))]
pub async fn handler(
    State(usage): State<Usage>,
    State(policy): State<PolicyHandle>,
    ApiJson(report): ApiJson<UsageReport>,
) -> Result<Json<UsageAccepted>, ReportError> {
    let now = u64::try_from(chrono::Utc::now().timestamp()).unwrap_or(0);
    if let Err(invalid) = check(&report, now) {
        usage.count_report("invalid");
        return Err(ReportError::Invalid(invalid));
    }
    let document = policy.document();
    let outcome = usage
        .store
        .apply(&report.replica, &report.batch_id, &report.records, |r| {
            chargeback(&document, r)
        })
        .await;
    match outcome {
        Ok(Applied::Rows(_)) => {
            usage.database_up(true);
            usage.count_report("applied");
            usage.count_records(&report.records, |r| chargeback(&document, r));
            Ok(Json(UsageAccepted {
                accepted: u64::try_from(report.records.len()).unwrap_or(u64::MAX),
                duplicate: false,
            }))
        }
        Ok(Applied::Duplicate) => {
            usage.database_up(true);
            usage.count_report("duplicate");
            tracing::debug!(replica = %report.replica, batch_id = %report.batch_id, "usage batch already applied");
            Ok(Json(UsageAccepted {
                accepted: 0,
                duplicate: true,
            }))
        }
        Err(e) if e.is_unavailable() => {
            usage.database_up(false);
            usage.count_report("unavailable");
            tracing::warn!(error = %e, "usage batch not applied (database unavailable)");
            Err(ReportError::Unavailable)
        }
        Err(e) => {
            usage.count_report("error");
            tracing::error!(error = %e, "usage batch not applied");
            Err(ReportError::Internal)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::usage::UsageRecord;

    #[test]
    fn an_hour_ahead_of_the_clock_is_refused_naming_the_record() {
        let now = 1_764_565_000;
        let record = |hour_start| UsageRecord {
            subject: "alice".into(),
            key_id: None,
            tier: "free".into(),
            model: "m".into(),
            hour_start,
            requests: 1,
            refused: Default::default(),
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_input_tokens: 0,
            backend: None,
        };
        let report = |records| UsageReport {
            replica: "r".into(),
            batch_id: "b".into(),
            records,
        };
        // The current hour and the next (skew) are fine; two hours ahead is not.
        let ok = report(vec![record(1_764_561_600), record(1_764_565_200)]);
        assert_eq!(check(&ok, now), Ok(()));
        let bad = report(vec![record(1_764_561_600), record(1_764_572_400)]);
        assert_eq!(
            check(&bad, now).map_err(|e| e.field),
            Err("records[1].hourStart".to_string())
        );
    }

    /// A record's prices: the subscription's flat billing rate first, then its model's
    /// `pricing`, then the model's own (tier usage too: money budgets charge the same), else 0.
    #[test]
    fn the_ledger_charges_what_money_budgets_charge() {
        let policy = PolicyDocument::from_value(serde_json::json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]},
                      {"name": "partner", "level": 1, "groups": ["p"],
                       "prices": {"priced": {"input": "0.000001", "output": "0.000005"}}}],
            "models": [
                {"name": "priced", "path": "/llm/priced", "tiers": ["free", "partner"],
                 "pricing": {"input": "0.000003", "output": "0.000015", "cachedInput": "0.0000003"}},
                {"name": "free-model", "path": "/llm/free-model", "tiers": ["free"]}],
            "subscriptions": [
                {"name": "flat", "owner": {"groups": ["g"]}, "tokenMetadata": {"organizationId": "o"},
                 "models": [{"name": "priced", "tokenRateLimits": [{"limit": 9, "window": "1m"}],
                             "billingRate": {"perToken": "0.000002"}}]},
                {"name": "own", "owner": {"groups": ["g"]},
                 "models": [{"name": "priced", "tokenRateLimits": [{"limit": 9, "window": "1m"}],
                             "pricing": {"input": "0.000001", "output": "0.000004"}}]}]
        }))
        .unwrap();
        let record = |tier: &str, model: &str| UsageRecord {
            subject: "alice".into(),
            key_id: None,
            tier: tier.into(),
            model: model.into(),
            hour_start: 0,
            requests: 1,
            refused: Default::default(),
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_input_tokens: 0,
            backend: None,
        };
        let rates = |tier: &str, model: &str| chargeback(&policy, &record(tier, model)).rates;
        let r = |i: &str, c: &str, o: &str| Rates {
            input: i.into(),
            cached_input: c.into(),
            output: o.into(),
        };
        assert_eq!(
            rates("subscription:flat", "priced"),
            Rates::flat("0.000002")
        );
        assert_eq!(
            chargeback(&policy, &record("subscription:flat", "priced")).organization,
            "o"
        );
        assert_eq!(
            rates("subscription:own", "priced"),
            r("0.000001", "0.000001", "0.000004")
        );
        assert_eq!(
            rates("free", "priced"),
            r("0.000003", "0.0000003", "0.000015")
        );
        assert_eq!(rates("free", "free-model"), Rates::flat("0"));
        assert_eq!(
            rates("partner", "priced"),
            r("0.000001", "0.000001", "0.000005")
        );
        assert_eq!(rates("subscription:gone", "free-model"), Rates::flat("0"));
    }
}
