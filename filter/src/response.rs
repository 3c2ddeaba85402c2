//! Refusals: OpenAI-style JSON errors with their status, headers and metric decision.

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
    pub fn from_companion(status: u32, message: &str) -> Self {
        match status {
            403 => Self::forbidden("no_tier", message),
            _ => Self::unauthenticated(message),
        }
    }

    pub fn body(&self) -> Vec<u8> {
        let body = ErrorBody::new(self.message.as_str(), self.kind, Some(self.code));
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
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
}
