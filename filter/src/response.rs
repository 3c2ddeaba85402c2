//! Refusals: OpenAI-style JSON errors with their status, headers and metric decision.

use crate::credential::CredentialError;
use crate::path::PathError;
use maas_types::ErrorBody;

/// What happened to a request (the `decision` of the requests metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    Unauthenticated,
    Forbidden,
    RateLimited,
    Unavailable,
    BadRequest,
    NotFound,
}

impl Decision {
    pub const ALL: [Decision; 7] = [
        Decision::Allowed,
        Decision::Unauthenticated,
        Decision::Forbidden,
        Decision::RateLimited,
        Decision::Unavailable,
        Decision::BadRequest,
        Decision::NotFound,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Unauthenticated => "unauthenticated",
            Decision::Forbidden => "forbidden",
            Decision::RateLimited => "rate_limited",
            Decision::Unavailable => "unavailable",
            Decision::BadRequest => "bad_request",
            Decision::NotFound => "not_found",
        }
    }

    pub fn index(&self) -> usize {
        *self as usize
    }
}

/// A request the filter answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u32,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub decision: Decision,
    pub headers: Vec<(String, String)>,
}

impl Refusal {
    fn new(
        status: u32,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
        decision: Decision,
    ) -> Self {
        Refusal {
            status,
            kind,
            code,
            message: message.into(),
            decision,
            headers: Vec::new(),
        }
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(
            401,
            "authentication_error",
            "invalid_api_key",
            message,
            Decision::Unauthenticated,
        )
    }

    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(403, "permission_error", code, message, Decision::Forbidden)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            code,
            message,
            Decision::NotFound,
        )
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            400,
            "invalid_request_error",
            code,
            message,
            Decision::BadRequest,
        )
    }

    pub fn too_large(limit: u64) -> Self {
        Self::new(
            413,
            "invalid_request_error",
            "request_too_large",
            format!("request body is larger than {limit} bytes"),
            Decision::BadRequest,
        )
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            503,
            "service_unavailable",
            code,
            message,
            Decision::Unavailable,
        )
    }

    /// The filter's own state could not be read: refused, never let through.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            500,
            "server_error",
            "gateway_internal",
            message,
            Decision::Unavailable,
        )
    }

    pub fn rate_limited(message: impl Into<String>, headers: Vec<(String, String)>) -> Self {
        let mut r = Self::new(
            429,
            "rate_limit_exceeded",
            "rate_limit_exceeded",
            message,
            Decision::RateLimited,
        );
        r.headers = headers;
        r
    }

    /// A refusal for a status the filter got from the companion (401 / 403 with its message).
    /// A 403 for a key whose subscription no longer resolves is `invalid_subscription`.
    pub fn from_companion(status: u32, message: &str) -> Self {
        match status {
            403 if maas_types::SelectError::from_message(message).is_some() => {
                Self::forbidden("invalid_subscription", message)
            }
            403 => Self::forbidden("no_tier", message),
            _ => Self::unauthenticated(message),
        }
    }

    pub fn body(&self) -> Vec<u8> {
        let body = ErrorBody::new(self.message.as_str(), self.kind, Some(self.code));
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }

    /// The headers of the local response: JSON, `www-authenticate: Bearer` on a 401, then the
    /// refusal's own (rate-limit headers, `retry-after`).
    pub fn response_headers(&self) -> Vec<(&str, &str)> {
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2 + self.headers.len());
        headers.push(("content-type", "application/json"));
        if self.status == 401 {
            headers.push(("www-authenticate", "Bearer"));
        }
        for (k, v) in &self.headers {
            headers.push((k.as_str(), v.as_str()));
        }
        headers
    }

    /// The request's state could not be read (a re-entrant callback): refused, never let through.
    pub fn undecidable() -> Self {
        Self::internal("the gateway could not decide on this request; retry")
    }

    pub fn not_configured() -> Self {
        Self::unavailable("not_configured", "gateway filter not configured")
    }

    pub fn no_policy() -> Self {
        Self::unavailable("no_policy", "no policy loaded yet; retry shortly")
    }

    pub fn model_not_found() -> Self {
        Self::not_found("model_not_found", "no model is served at this path")
    }

    pub fn auth_unavailable(message: &'static str) -> Self {
        Self::unavailable("auth_unavailable", message)
    }
}

impl From<PathError> for Refusal {
    fn from(e: PathError) -> Self {
        if e.status() == 404 {
            Refusal::not_found("not_found", e.message())
        } else {
            Refusal::bad_request("invalid_path", e.message())
        }
    }
}

impl From<CredentialError> for Refusal {
    fn from(e: CredentialError) -> Self {
        if e.status() == 400 {
            Refusal::bad_request("invalid_credential", e.message())
        } else {
            Refusal::unauthenticated(e.message())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_openai_shaped() {
        let r = Refusal::unauthenticated("key revoked");
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(r.status, 401);
        assert_eq!(v["error"]["message"], "key revoked");
        assert_eq!(v["error"]["type"], "authentication_error");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        let r = Refusal::rate_limited("tokens", vec![("retry-after".into(), "3".into())]);
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_exceeded");
        assert_eq!(r.status, 429);
        assert_eq!(r.decision, Decision::RateLimited);
        assert_eq!(Refusal::from_companion(403, "no tier").status, 403);
        assert_eq!(Refusal::too_large(10).status, 413);
        let r = Refusal::internal("x");
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(
            (r.status, v["error"]["code"].as_str()),
            (500, Some("gateway_internal"))
        );
        for (i, d) in Decision::ALL.iter().enumerate() {
            assert_eq!(d.index(), i);
        }
    }

    #[test]
    fn errors_become_refusals_of_their_status() {
        let r = Refusal::from(PathError::Internal);
        assert_eq!((r.status, r.code), (404, "not_found"));
        let r = Refusal::from(PathError::Invalid("dot segment"));
        assert_eq!((r.status, r.code), (400, "invalid_path"));
        let r = Refusal::from(CredentialError::Conflicting);
        assert_eq!((r.status, r.code), (400, "invalid_credential"));
        let r = Refusal::from(CredentialError::Missing);
        assert_eq!((r.status, r.decision), (401, Decision::Unauthenticated));
    }

    #[test]
    fn local_response_headers() {
        let r = Refusal::unauthenticated("x");
        assert_eq!(
            r.response_headers(),
            vec![
                ("content-type", "application/json"),
                ("www-authenticate", "Bearer")
            ]
        );
        let r = Refusal::rate_limited("t", vec![("retry-after".into(), "3".into())]);
        assert_eq!(
            r.response_headers(),
            vec![("content-type", "application/json"), ("retry-after", "3")]
        );
        assert_eq!(Refusal::undecidable().status, 500);
    }
}
