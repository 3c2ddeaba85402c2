//! HTTP plumbing every capability shares: the OpenAI-style error response, the JSON extractor
//! whose rejections are JSON errors, the JSON 404/405, and bodies with an ETag.
//!
//! Each capability's error type maps itself to a status and body beside its definition (its
//! `IntoResponse`), with [`error_response`] and the shared [`ErrorKind`]s. This module knows
//! none of them: it only maps the errors of the request itself ([`RequestError`]).

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::header::{CONTENT_TYPE, ETAG, IF_NONE_MATCH};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use maas_types::{ErrorBody, ErrorKind};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

/// A JSON error response `{"error":{"message","type","code"}}`.
pub fn error_response(
    status: StatusCode,
    message: impl Into<String>,
    kind: ErrorKind,
    code: Option<&str>,
) -> Response {
    (status, Json(ErrorBody::new(message, kind, code))).into_response()
}

/// The answer when the database (or another dependency) cannot be reached now.
pub fn unavailable(message: impl Into<String>) -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        message,
        ErrorKind::ServiceUnavailable,
        Some("unavailable"),
    )
}

/// The answer to a failed database call (a store's error, mapped by the capability that met
/// it): 503 while the database cannot be reached (retry), else 500 (logged here; the body never
/// carries the database's message). Takes what it needs, so persistence never names HTTP.
pub fn database_failure(unreachable: bool, error: &dyn std::fmt::Display) -> Response {
    if unreachable {
        tracing::warn!(error = %error, "database unavailable");
        return unavailable("database unavailable, try again");
    }
    tracing::error!(error = %error, "database error");
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal error",
        ErrorKind::Server,
        Some("internal_error"),
    )
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
        let (status, code) = match self {
            RequestError::BadJson(_) => (StatusCode::BAD_REQUEST, "invalid_json"),
            RequestError::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            RequestError::NoRoute => (StatusCode::NOT_FOUND, "not_found"),
            RequestError::MethodNotAllowed => {
                (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
            }
        };
        error_response(status, message, ErrorKind::InvalidRequest, Some(code))
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
    if resp.status() == StatusCode::METHOD_NOT_ALLOWED && !resp.headers().contains_key(CONTENT_TYPE)
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

/// A JSON body with a strong ETag (hex SHA-256 prefix of the body), answering 304 when the
/// client already holds it.
pub fn json_with_etag(headers: &HeaderMap, body: Vec<u8>) -> Response {
    let digest = hex::encode(Sha256::digest(&body));
    let etag = format!("\"{}\"", digest.get(..32).unwrap_or(&digest));
    let matches = headers
        .get(IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().trim_start_matches("W/") == etag)
        });
    if matches {
        return (StatusCode::NOT_MODIFIED, [(ETAG, etag)]).into_response();
    }
    (
        [(CONTENT_TYPE, "application/json".to_string()), (ETAG, etag)],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etag_roundtrip() {
        let r = json_with_etag(&HeaderMap::new(), b"{}".to_vec());
        assert_eq!(r.status(), StatusCode::OK);
        let etag = r.headers().get(ETAG).unwrap().clone();
        let mut h = HeaderMap::new();
        h.insert(IF_NONE_MATCH, etag);
        assert_eq!(
            json_with_etag(&h, b"{}".to_vec()).status(),
            StatusCode::NOT_MODIFIED
        );
        assert_eq!(json_with_etag(&h, b"{ }".to_vec()).status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn an_unknown_route_is_a_404_of_the_same_type_as_the_filters() {
        let r = no_route().await.into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "not_found");
    }
}
