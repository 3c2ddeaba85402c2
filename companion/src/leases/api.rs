//! `POST /internal/v1/leases` (internal listener only) and its errors.

use super::{Invalid, Leases, StoreError, validate};
use crate::http::{ApiJson, error_response};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maas_types::lease::{LeaseRequest, LeaseResponse};
use maas_types::{ErrorBody, ErrorKind};

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// 400 naming the field.
    #[error("{}", .0.message)]
    Invalid(Invalid),
    /// 503: the store could not be reached; nothing was applied.
    #[error("lease store unavailable")]
    Unavailable(#[source] StoreError),
}

impl IntoResponse for LeaseError {
    fn into_response(self) -> Response {
        match self {
            LeaseError::Invalid(invalid) => {
                let mut body = ErrorBody::new(
                    invalid.message,
                    ErrorKind::InvalidRequest,
                    Some("invalid_lease_request"),
                );
                body.error.param = Some(invalid.field);
                (StatusCode::BAD_REQUEST, Json(body)).into_response()
            }
            LeaseError::Unavailable(_) => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "the lease store cannot be reached; nothing was applied",
                ErrorKind::ServiceUnavailable,
                Some("lease_store_unavailable"),
            ),
        }
    }
}

/// Checks the batch, applies it, answers one grant per item in item order.
#[tracing::instrument(name = "leases", skip_all, fields(maas.items = request.items.len()))]
pub async fn handler(
    State(leases): State<Leases>,
    ApiJson(request): ApiJson<LeaseRequest>,
) -> Result<Json<LeaseResponse>, LeaseError> {
    validate(&request).map_err(LeaseError::Invalid)?;
    let applied = leases.apply(&request).await.map_err(|e| {
        tracing::debug!(error = %e, "lease batch not applied");
        LeaseError::Unavailable(e)
    })?;
    Ok(Json(LeaseResponse {
        replicas: applied.replicas,
        store: leases.store_kind().to_string(),
        grants: applied.grants,
    }))
}
