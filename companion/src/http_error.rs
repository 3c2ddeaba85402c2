//! The one place where errors become HTTP responses.
//!
//! Each capability has its own error enum (in its module); this module maps every one of them
//! to a status and an OpenAI-style body `{"error":{"message","type","code"}}`
//! ([`maas_types::ErrorBody`]). Internal details (database errors) are logged, not returned.

use crate::api_keys::ApiKeyError;
use crate::authenticate::AuthError;
use crate::identity::IdentityError;
use crate::policy::PolicyServeError;
use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maas_types::ErrorBody;
use serde::de::DeserializeOwned;

pub const INVALID_REQUEST: &str = "invalid_request_error";
pub const AUTHENTICATION: &str = "authentication_error";
pub const PERMISSION: &str = "permission_error";
pub const NOT_FOUND: &str = "not_found_error";
pub const SERVER: &str = "server_error";
pub const UNAVAILABLE: &str = "service_unavailable";

/// A JSON error response.
pub fn error_response(
    status: StatusCode,
    message: impl Into<String>,
    kind: &str,
    code: Option<&str>,
) -> Response {
    (status, Json(ErrorBody::new(message, kind, code))).into_response()
}

/// True for database errors that mean "cannot reach it now" (answer 503, not 500).
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed
    )
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        match self {
            AuthError::Missing => error_response(
                StatusCode::UNAUTHORIZED,
                message,
                AUTHENTICATION,
                Some("missing_credential"),
            ),
            AuthError::InvalidKeyFormat
            | AuthError::KeyNotFound
            | AuthError::KeyRevoked
            | AuthError::KeyExpired => error_response(
                StatusCode::UNAUTHORIZED,
                message,
                AUTHENTICATION,
                Some("invalid_api_key"),
            ),
            AuthError::InvalidToken => error_response(
                StatusCode::UNAUTHORIZED,
                message,
                AUTHENTICATION,
                Some("invalid_token"),
            ),
            AuthError::NoTier => {
                error_response(StatusCode::FORBIDDEN, message, PERMISSION, Some("no_tier"))
            }
            AuthError::Unavailable(reason) => {
                tracing::warn!(%reason, "cannot authenticate");
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "authentication is temporarily unavailable",
                    UNAVAILABLE,
                    Some("unavailable"),
                )
            }
        }
    }
}

impl From<IdentityError> for AuthError {
    fn from(e: IdentityError) -> Self {
        match e {
            IdentityError::InvalidToken => AuthError::InvalidToken,
            IdentityError::Unavailable(reason) => AuthError::Unavailable(reason),
        }
    }
}

impl IntoResponse for ApiKeyError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        match self {
            ApiKeyError::Invalid { param, .. } => {
                let mut body = ErrorBody::new(message, INVALID_REQUEST, Some("invalid_request"));
                body.error.param = param.map(str::to_string);
                (StatusCode::BAD_REQUEST, Json(body)).into_response()
            }
            ApiKeyError::InvalidTier => error_response(
                StatusCode::BAD_REQUEST,
                message,
                INVALID_REQUEST,
                Some("invalid_tier"),
            ),
            ApiKeyError::NoTier => {
                error_response(StatusCode::FORBIDDEN, message, PERMISSION, Some("no_tier"))
            }
            ApiKeyError::NotFound => {
                error_response(StatusCode::NOT_FOUND, message, NOT_FOUND, Some("not_found"))
            }
            ApiKeyError::Forbidden(_) | ApiKeyError::ApiKeyCannotMint => error_response(
                StatusCode::FORBIDDEN,
                message,
                PERMISSION,
                Some("forbidden"),
            ),
            ApiKeyError::NotReady => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "database unavailable, try again",
                UNAVAILABLE,
                Some("unavailable"),
            ),
            ApiKeyError::Database(e) if is_unavailable(&e) => {
                tracing::warn!(error = %e, "database unavailable");
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database unavailable, try again",
                    UNAVAILABLE,
                    Some("unavailable"),
                )
            }
            ApiKeyError::Database(e) => {
                tracing::error!(error = %e, "database error");
                error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error",
                    SERVER,
                    Some("internal_error"),
                )
            }
        }
    }
}

impl IntoResponse for PolicyServeError {
    fn into_response(self) -> Response {
        tracing::warn!(error = %self, "cannot serve");
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            self.to_string(),
            UNAVAILABLE,
            Some("unavailable"),
        )
    }
}

/// Errors of the request itself (body not JSON, too large, unknown route).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    BadJson(String),
    #[error("request body too large (limit 1 MiB)")]
    TooLarge,
    #[error("no such endpoint")]
    NoRoute,
    #[error("method not allowed")]
    MethodNotAllowed,
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        match self {
            RequestError::BadJson(_) => error_response(
                StatusCode::BAD_REQUEST,
                message,
                INVALID_REQUEST,
                Some("invalid_json"),
            ),
            RequestError::TooLarge => error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                message,
                INVALID_REQUEST,
                Some("body_too_large"),
            ),
            RequestError::NoRoute => {
                error_response(StatusCode::NOT_FOUND, message, NOT_FOUND, Some("not_found"))
            }
            RequestError::MethodNotAllowed => error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                message,
                INVALID_REQUEST,
                Some("method_not_allowed"),
            ),
        }
    }
}

impl From<JsonRejection> for RequestError {
    fn from(r: JsonRejection) -> Self {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            RequestError::TooLarge
        } else {
            RequestError::BadJson(r.body_text())
        }
    }
}

/// `Json` whose rejections are JSON errors too.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = RequestError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(v) = Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(v))
    }
}

/// Fallback for unknown routes (also makes `/internal/*` on the public listener a JSON 404).
pub async fn no_route() -> RequestError {
    RequestError::NoRoute
}

/// Turns axum's empty 405 into a JSON error.
pub async fn json_method_not_allowed(req: Request, next: axum::middleware::Next) -> Response {
    let resp = next.run(req).await;
    if resp.status() == StatusCode::METHOD_NOT_ALLOWED
        && !resp
            .headers()
            .contains_key(axum::http::header::CONTENT_TYPE)
    {
        let allow = resp.headers().get(axum::http::header::ALLOW).cloned();
        let mut out = RequestError::MethodNotAllowed.into_response();
        if let Some(allow) = allow {
            out.headers_mut().insert(axum::http::header::ALLOW, allow);
        }
        return out;
    }
    resp
}
