//! OpenAI-style error body: `{"error":{"message","type","param","code"}}`, and the error types
//! (`type`) the filter and the companion answer with.

use serde::{Deserialize, Serialize};

/// The `type` of an OpenAI-style error: one list for the filter and the companion.
///
/// A 404 is an `invalid_request_error` (as OpenAI answers an unknown model or route), whoever
/// answers it: the filter (an operation not allowed) or the companion (an unknown key or route).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// 400, 404, 405, 413: the request itself is wrong.
    InvalidRequest,
    /// 401: no credential, or one that is not valid.
    Authentication,
    /// 403: valid credential, not allowed.
    Permission,
    /// 429: a request or token limit.
    RateLimitExceeded,
    /// 500: a bug or unreadable own state.
    Server,
    /// 503: cannot decide now (database, identity provider, policy unavailable).
    ServiceUnavailable,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::InvalidRequest,
        ErrorKind::Authentication,
        ErrorKind::Permission,
        ErrorKind::RateLimitExceeded,
        ErrorKind::Server,
        ErrorKind::ServiceUnavailable,
    ];

    /// The wire spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::RateLimitExceeded => "rate_limit_exceeded",
            ErrorKind::Server => "server_error",
            ErrorKind::ServiceUnavailable => "service_unavailable",
        }
    }
}

impl AsRef<str> for ErrorKind {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    pub message: String,
    /// The error type (an `ErrorKind` as spelled on the wire), e.g. `invalid_request_error`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub code: Option<String>,
}

impl ErrorBody {
    /// `kind`: an [`ErrorKind`] (or its wire spelling).
    pub fn new(message: impl Into<String>, kind: impl AsRef<str>, code: Option<&str>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.as_ref().to_string(),
                param: None,
                code: code.map(str::to_string),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kinds_are_spelled_as_openai_does() {
        let spelled: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            spelled,
            [
                "invalid_request_error",
                "authentication_error",
                "permission_error",
                "rate_limit_exceeded",
                "server_error",
                "service_unavailable"
            ]
        );
    }

    #[test]
    fn a_body_takes_a_kind_or_its_spelling_alike() {
        let a = ErrorBody::new("m", ErrorKind::Permission, Some("no_tier"));
        let b = ErrorBody::new("m", "permission_error", Some("no_tier"));
        assert_eq!(a, b);
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(v["error"]["type"], "permission_error");
        assert_eq!(v["error"]["code"], "no_tier");
    }
}
