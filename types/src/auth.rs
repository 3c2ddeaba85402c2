//! The filter ↔ companion contract on the internal port.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /internal/v1/authenticate` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthenticateRequest {
    /// An API key (`sk-oai-…`) or a cluster token. Never logged by either side.
    pub credential: String,
}

/// `POST /internal/v1/authenticate` 200 body. Refusals are 401 (unknown, revoked, expired, bad
/// format) or 403 (`no tier`) with an [`crate::ErrorBody`]; 503 when the companion cannot decide.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthenticateResponse {
    /// Username (API key: its owner; token: the TokenReview user).
    pub subject: String,
    /// Groups: the snapshot stored with the key, or the token's groups.
    pub groups: Vec<String>,
    /// Tier resolved by the companion with its current policy; empty for a key bound to a
    /// subscription whose owner's groups qualify for no tier (a filter that does not know
    /// subscriptions then refuses it: no tier).
    pub tier: String,
    /// True when the key was minted for an explicit tier: the filter then keeps that tier (while the
    /// groups still qualify) instead of taking the highest one.
    #[serde(default)]
    pub tier_pinned: bool,
    /// For API keys: the key id (public half), used for the cache and the revocation list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// For API keys bound to a subscription: its name. The filter then limits the key by that
    /// subscription (while it still grants access and holds the model) instead of the tiers.
    /// Absent for tier keys and tokens, so a filter that predates subscriptions parses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    /// For API keys minted with limits of their own: those limits, counted per key as the
    /// scope [`crate::policy::scope::KEY_SCOPE`] beside the tier's or subscription's (the
    /// strictest binds). Absent for keys without and for tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<crate::Limits>,
    /// Unix seconds after which the credential is no longer valid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// How long the filter may cache this answer (it also never caches past `expires_at`).
    pub cache_ttl_seconds: u64,
    /// The subject as a keyed pseudonym (`u-` and 16 hex digits of HMAC-SHA256 with the
    /// companion's pseudonym key, whatever its log setting): what the gateway's telemetry (trace
    /// attributes, usage events) names the user by, never the clear name. Absent from a companion
    /// that predates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pseudonym: Option<String>,
}

/// `GET /internal/v1/credentials` body: provider credentials by `credentialRef` — a static key,
/// or the current short-lived access token the companion obtained (never the long-lived secret
/// behind it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialsDocument {
    pub credentials: BTreeMap<String, String>,
    /// For access tokens: unix seconds at which the token expires. The companion replaces a
    /// token well before (see docs/design.md), so the filter, polling every `pollIntervalMs`,
    /// always holds a valid one; a token past its expiry is never sent (503, as a missing one).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expires_at: BTreeMap<String, u64>,
    /// For `auth: awsSigV4` (bedrock): the SigV4 signing keys the companion derived from the
    /// AWS secret key, by `credentialRef` — today's (UTC) and, in the last hour of the day,
    /// tomorrow's too. The secret access key itself never leaves the companion.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sigv4: BTreeMap<String, Vec<SigV4Key>>,
}

/// A SigV4 signing key for one UTC day, region and service: `kSigning` of AWS's derivation
/// (`HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service), "aws4_request")`). It signs
/// requests of that day only (the credential scope names the date), so it is worth little once
/// the day is over; it cannot be turned back into the secret.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigV4Key {
    pub access_key_id: String,
    /// `yyyymmdd`, UTC.
    pub date: String,
    pub region: String,
    pub service: String,
    /// The 32-byte signing key, hex.
    pub signing_key: String,
    /// A temporary credential's `x-amz-security-token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token: Option<String>,
    /// Unix seconds: the end of `date` (UTC).
    pub expires_at: u64,
}

impl std::fmt::Debug for SigV4Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigV4Key")
            .field("date", &self.date)
            .field("region", &self.region)
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for CredentialsDocumentRedacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.credentials.keys().chain(self.0.sigv4.keys()))
            .finish()
    }
}

/// Debug view of a credentials document that shows only the names.
pub struct CredentialsDocumentRedacted<'a>(pub &'a CredentialsDocument);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subscription_field_is_optional_both_ways() {
        // An answer of a companion that predates subscriptions parses.
        let old = r#"{"subject":"a","groups":[],"tier":"free","cache_ttl_seconds":5}"#;
        let r: AuthenticateResponse = serde_json::from_str(old).unwrap();
        assert_eq!(r.subscription, None);
        // None is left out, so a filter that predates subscriptions sees what it saw before.
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("subscription").is_none(), "{json}");
        let bound = AuthenticateResponse {
            subscription: Some("team-a".into()),
            ..r
        };
        let json = serde_json::to_value(&bound).unwrap();
        assert_eq!(json["subscription"], "team-a");
    }

    #[test]
    fn the_pseudonym_field_is_optional_both_ways() {
        let old = r#"{"subject":"a","groups":[],"tier":"free","cache_ttl_seconds":5}"#;
        let r: AuthenticateResponse = serde_json::from_str(old).unwrap();
        assert_eq!(r.pseudonym, None);
        assert!(serde_json::to_value(&r).unwrap().get("pseudonym").is_none());
        let named = AuthenticateResponse {
            pseudonym: Some("u-0123456789abcdef".into()),
            ..r
        };
        let json = serde_json::to_value(&named).unwrap();
        assert_eq!(json["pseudonym"], "u-0123456789abcdef");
    }
}
