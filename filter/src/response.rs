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

/// Every refusal the filter answers, a closed set: its `code`, HTTP status, error `type` and
/// metric decision are decided here and only here ([`Deny::code`], [`Deny::status`]). Each
/// code is listed in docs/contracts.md "Filter refusals" (a test checks both ways).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deny {
    /// 400: a path the gateway will not route (encoded separators, dot segments…).
    InvalidPath,
    /// 400: two different credentials, or a malformed one.
    InvalidCredential,
    /// 400: a body that is not a JSON object of the API's shape.
    InvalidBody,
    /// 400: the body names another model than the path's.
    ModelMismatch,
    /// 400: the reservation alone is larger than a token window's limit.
    TokensExceedLimit,
    /// 400: the request's worst-case cost exceeds a money budget's whole amount.
    CostExceedsLimit,
    /// 400: an OpenAI request the gateway cannot translate faithfully for the model's API.
    UntranslatableRequest,
    /// 401: no credential, or one that is unknown, expired or revoked.
    InvalidApiKey,
    /// 403: the caller's groups qualify for no tier.
    NoTier,
    /// 403: the caller's tier may not use the model.
    ModelNotAllowed,
    /// 403: an API key's subscription no longer exists or no longer includes its owner.
    InvalidSubscription,
    /// 403: the subscription does not include the model.
    ModelNotInSubscription,
    /// 403: the subscription named does not exist, or is not the caller's (one answer for both).
    SubscriptionNotFound,
    /// 403: several subscriptions hold the model and none is named.
    MultipleSubscriptions,
    /// 404: a path nobody serves.
    PathNotFound,
    /// 404: no model is served at the path.
    ModelNotFound,
    /// 404: the model does not serve this method and path.
    OperationNotAllowed,
    /// 413: the body is larger than `maxRequestBodyBytes`.
    RequestTooLarge,
    /// 429: a request or token window is full.
    RateLimitExceeded,
    /// 500: the filter's own state could not be read.
    GatewayInternal,
    /// 503: no pluginConfig.
    NotConfigured,
    /// 503: no policy loaded yet.
    NoPolicy,
    /// 503: the companion cannot authenticate now.
    AuthUnavailable,
    /// 503: the callout this request waited for went away.
    AuthInterrupted,
    /// 400: the request makes the provider read context it holds (`previous_response_id`…)
    /// and the model declares no context window to reserve for it.
    PromptNotReservable,
    /// 400: the request names a tool the provider runs itself and the model refuses those
    /// (`hostedTools`).
    HostedToolNotAllowed,
    /// 503: the model's provider credential is not loaded yet.
    ProviderCredentialMissing,
    /// 503: no valid SigV4 signing key for the model's provider (AWS Bedrock): never forwarded
    /// unsigned.
    SigningUnavailable,
    /// 503: Envoy routed the request away from the model's own upstream.
    UpstreamMismatch,
    /// 503: the rate limit counters (or the lease service, `onUnavailable: refuse`) cannot be
    /// read.
    LimitsUnavailable,
    /// 503: admission gave no decision.
    AdmissionUndecided,
    /// 503: the one base URL needs the request headers held for the body (its `model` picks the
    /// route), and this gateway cannot hold them.
    BodyRoutingUnavailable,
}

impl Deny {
    #[cfg(test)]
    pub const ALL: [Deny; 32] = [
        Deny::InvalidPath,
        Deny::InvalidCredential,
        Deny::InvalidBody,
        Deny::ModelMismatch,
        Deny::TokensExceedLimit,
        Deny::CostExceedsLimit,
        Deny::UntranslatableRequest,
        Deny::PromptNotReservable,
        Deny::HostedToolNotAllowed,
        Deny::InvalidApiKey,
        Deny::NoTier,
        Deny::ModelNotAllowed,
        Deny::InvalidSubscription,
        Deny::ModelNotInSubscription,
        Deny::SubscriptionNotFound,
        Deny::MultipleSubscriptions,
        Deny::PathNotFound,
        Deny::ModelNotFound,
        Deny::OperationNotAllowed,
        Deny::RequestTooLarge,
        Deny::RateLimitExceeded,
        Deny::GatewayInternal,
        Deny::NotConfigured,
        Deny::NoPolicy,
        Deny::AuthUnavailable,
        Deny::AuthInterrupted,
        Deny::ProviderCredentialMissing,
        Deny::SigningUnavailable,
        Deny::UpstreamMismatch,
        Deny::LimitsUnavailable,
        Deny::AdmissionUndecided,
        Deny::BodyRoutingUnavailable,
    ];

    /// The error body's `code`.
    pub fn code(self) -> &'static str {
        match self {
            Deny::InvalidPath => "invalid_path",
            Deny::InvalidCredential => "invalid_credential",
            Deny::InvalidBody => "invalid_body",
            Deny::ModelMismatch => "model_mismatch",
            Deny::TokensExceedLimit => "tokens_exceed_limit",
            Deny::CostExceedsLimit => "cost_exceeds_limit",
            Deny::UntranslatableRequest => "untranslatable_request",
            Deny::PromptNotReservable => "prompt_not_reservable",
            Deny::HostedToolNotAllowed => "hosted_tool_not_allowed",
            Deny::InvalidApiKey => "invalid_api_key",
            Deny::NoTier => "no_tier",
            Deny::ModelNotAllowed => "model_not_allowed",
            Deny::InvalidSubscription => "invalid_subscription",
            Deny::ModelNotInSubscription => "model_not_in_subscription",
            // The reference's code for a subscription that is not found (or not the caller's).
            Deny::SubscriptionNotFound | Deny::PathNotFound => "not_found",
            Deny::MultipleSubscriptions => "multiple_subscriptions",
            Deny::ModelNotFound => "model_not_found",
            Deny::OperationNotAllowed => "operation_not_allowed",
            Deny::RequestTooLarge => "request_too_large",
            Deny::RateLimitExceeded => "rate_limit_exceeded",
            Deny::GatewayInternal => "gateway_internal",
            Deny::NotConfigured => "not_configured",
            Deny::NoPolicy => "no_policy",
            Deny::AuthUnavailable => "auth_unavailable",
            Deny::AuthInterrupted => "auth_interrupted",
            Deny::ProviderCredentialMissing => "provider_credential_missing",
            Deny::SigningUnavailable => "signing_unavailable",
            Deny::UpstreamMismatch => "upstream_mismatch",
            Deny::LimitsUnavailable => "limits_unavailable",
            Deny::AdmissionUndecided => "internal",
            Deny::BodyRoutingUnavailable => "body_routing_unavailable",
        }
    }

    pub fn status(self) -> u32 {
        match self {
            Deny::InvalidPath
            | Deny::InvalidCredential
            | Deny::InvalidBody
            | Deny::ModelMismatch
            | Deny::TokensExceedLimit
            | Deny::CostExceedsLimit
            | Deny::UntranslatableRequest
            | Deny::PromptNotReservable
            | Deny::HostedToolNotAllowed => 400,
            Deny::InvalidApiKey => 401,
            Deny::NoTier
            | Deny::ModelNotAllowed
            | Deny::InvalidSubscription
            | Deny::ModelNotInSubscription
            | Deny::SubscriptionNotFound
            | Deny::MultipleSubscriptions => 403,
            Deny::PathNotFound | Deny::ModelNotFound | Deny::OperationNotAllowed => 404,
            Deny::RequestTooLarge => 413,
            Deny::RateLimitExceeded => 429,
            Deny::GatewayInternal => 500,
            Deny::NotConfigured
            | Deny::NoPolicy
            | Deny::AuthUnavailable
            | Deny::AuthInterrupted
            | Deny::ProviderCredentialMissing
            | Deny::SigningUnavailable
            | Deny::UpstreamMismatch
            | Deny::LimitsUnavailable
            | Deny::AdmissionUndecided
            | Deny::BodyRoutingUnavailable => 503,
        }
    }

    /// The error body's `type`, fixed by the status (`maas_types::ErrorKind`).
    pub fn kind(self) -> &'static str {
        match self.status() {
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_exceeded",
            500 => "server_error",
            503 => "service_unavailable",
            _ => "invalid_request_error",
        }
    }

    /// The requests metric's decision.
    pub fn decision(self) -> Decision {
        match self.status() {
            401 => Decision::Unauthenticated,
            403 => Decision::Forbidden,
            404 => Decision::NotFound,
            429 => Decision::RateLimited,
            500 | 503 => Decision::Unavailable,
            _ => Decision::BadRequest,
        }
    }
}

impl From<maas_types::SelectError> for Deny {
    fn from(e: maas_types::SelectError) -> Self {
        use maas_types::SelectError;
        match e {
            SelectError::NoSubscription | SelectError::NotFound => Deny::SubscriptionNotFound,
            SelectError::MultipleSubscriptions => Deny::MultipleSubscriptions,
            SelectError::ModelNotInSubscription => Deny::ModelNotInSubscription,
        }
    }
}

/// A request the filter answers itself: a [`Deny`] with its message (and, for a 429, its
/// rate-limit headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub deny: Deny,
    pub status: u32,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub decision: Decision,
    pub headers: Vec<(String, String)>,
    /// The request field at fault (OpenAI's `param`), when one is.
    pub param: Option<&'static str>,
}

impl Refusal {
    /// The one constructor: status, type, code and decision come from `deny`.
    pub fn new(deny: Deny, message: impl Into<String>) -> Self {
        Refusal {
            deny,
            status: deny.status(),
            kind: deny.kind(),
            code: deny.code(),
            message: message.into(),
            decision: deny.decision(),
            headers: Vec::new(),
            param: None,
        }
    }

    /// A body the filter cannot accept: 400 `invalid_body`, its `param` the field at fault.
    pub fn invalid_body(e: &crate::request_body::BodyError) -> Self {
        let mut r = Self::new(Deny::InvalidBody, e.to_string());
        r.param = e.field();
        r
    }

    /// 400 `prompt_not_reservable`: `field` makes the provider read context it holds, and
    /// `model` declares no context window to reserve for it (`param`: the field).
    pub fn prompt_not_reservable(field: &'static str, model: &str) -> Self {
        let mut r = Self::new(
            Deny::PromptNotReservable,
            format!(
                "{field} makes the provider read context it holds, which the gateway cannot \
                 count; model {model} declares no context window (details.contextWindow) to \
                 reserve for it: send the whole conversation instead, or ask the platform team \
                 to declare the model's context window"
            ),
        );
        r.param = Some(field);
        r
    }

    /// 400 `hosted_tool_not_allowed`: the request names `tool`, which the provider runs itself,
    /// and `model` refuses such tools (`param`: the field naming it).
    pub fn hosted_tool(tool: &str, model: &str) -> Self {
        let field = match tool {
            "web_search_options" => "web_search_options",
            "mcp_servers" => "mcp_servers",
            _ => "tools",
        };
        let mut r = Self::new(
            Deny::HostedToolNotAllowed,
            format!(
                "{tool} is a tool the provider runs itself, reading content and taking turns \
                 the gateway cannot count before the answer; model {model} does not allow such \
                 tools (hostedTools): use function tools, or ask the platform team to allow them"
            ),
        );
        r.param = Some(field);
        r
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Deny::InvalidApiKey, message)
    }

    pub fn too_large(limit: u64) -> Self {
        Self::new(
            Deny::RequestTooLarge,
            format!("request body is larger than {limit} bytes"),
        )
    }

    /// The filter's own state could not be read: refused, never let through.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Deny::GatewayInternal, message)
    }

    pub fn rate_limited(message: impl Into<String>, headers: Vec<(String, String)>) -> Self {
        let mut r = Self::new(Deny::RateLimitExceeded, message);
        r.headers = headers;
        r
    }

    /// A refusal for a status the filter got from the companion (401 / 403 with its message).
    /// A 403 for a key whose subscription no longer resolves is `invalid_subscription`.
    pub fn from_companion(status: u32, message: &str) -> Self {
        match status {
            403 if maas_types::SelectError::from_message(message).is_some() => {
                Self::new(Deny::InvalidSubscription, message)
            }
            403 => Self::new(Deny::NoTier, message),
            _ => Self::unauthenticated(message),
        }
    }

    pub fn body(&self) -> Vec<u8> {
        let mut body = ErrorBody::new(self.message.as_str(), self.kind, Some(self.code));
        body.error.param = self.param.map(str::to_string);
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
        Self::new(Deny::NotConfigured, "gateway filter not configured")
    }

    pub fn no_policy() -> Self {
        Self::new(Deny::NoPolicy, "no policy loaded yet; retry shortly")
    }

    pub fn model_not_found() -> Self {
        Self::new(Deny::ModelNotFound, "no model is served at this path")
    }

    pub fn auth_unavailable(message: &'static str) -> Self {
        Self::new(Deny::AuthUnavailable, message)
    }
}

impl From<PathError> for Refusal {
    fn from(e: PathError) -> Self {
        if e.status() == 404 {
            Refusal::new(Deny::PathNotFound, e.message())
        } else {
            Refusal::new(Deny::InvalidPath, e.message())
        }
    }
}

impl From<CredentialError> for Refusal {
    fn from(e: CredentialError) -> Self {
        if e.status() == 400 {
            Refusal::new(Deny::InvalidCredential, e.message())
        } else {
            Refusal::unauthenticated(e.message())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/contracts.md "Filter refusals": its rows are exactly the refusals (code, status).
    #[test]
    fn every_refusal_is_in_the_contract_and_every_listed_one_exists() {
        let doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/contracts.md"));
        let table = doc
            .split("<!-- filter-refusals -->")
            .nth(1)
            .and_then(|t| t.split("<!-- /filter-refusals -->").next())
            .expect("the Filter refusals table in docs/contracts.md");
        let listed: std::collections::BTreeSet<(String, u32)> = table
            .lines()
            .filter_map(|l| {
                let mut cells = l.split('|').map(str::trim).skip(1);
                let code = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
                let status = cells.next()?.parse().ok()?;
                Some((code.to_string(), status))
            })
            .collect();
        let built: std::collections::BTreeSet<(String, u32)> = Deny::ALL
            .iter()
            .map(|d| (d.code().to_string(), d.status()))
            .collect();
        assert_eq!(
            built.len(),
            Deny::ALL.len(),
            "two refusals share a code and status"
        );
        let undocumented: Vec<_> = built.difference(&listed).collect();
        let unbuilt: Vec<_> = listed.difference(&built).collect();
        assert!(
            undocumented.is_empty(),
            "not in docs/contracts.md: {undocumented:?}"
        );
        assert!(
            unbuilt.is_empty(),
            "in docs/contracts.md, not a refusal: {unbuilt:?}"
        );
    }

    #[test]
    fn a_refusal_takes_everything_from_its_deny() {
        for d in Deny::ALL {
            let r = Refusal::new(d, "m");
            assert_eq!((r.status, r.code, r.kind), (d.status(), d.code(), d.kind()));
            assert_eq!(
                r.kind,
                maas_types::ErrorKind::ALL
                    .into_iter()
                    .find(|k| k.as_str() == r.kind)
                    .map_or("", |k| k.as_str()),
                "{d:?}: a type maas_types knows"
            );
        }
        // The subscription codes are the reference's (as the companion answers them).
        for e in maas_types::SelectError::ALL {
            assert_eq!(Deny::from(e).code(), e.code(), "{e:?}");
        }
    }

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
