//! OIDC JWTs verified locally (jwt-simple) against the issuer's JWKS.
//!
//! Accepted: RS256 and ES256 signatures, the configured issuer, the configured audience (client
//! id) in `aud` or as `azp`, an `exp` claim
//! (a token without one would never expire) that is not past, and `nbf`/`iat` not in the future;
//! every time check allows [`CLOCK_SKEW`] of clock difference with the issuer.
//! Username = `preferred_username`, else `sub`; groups = the configured claim (default
//! `groups`) plus `system:authenticated`. The JWKS is fetched at first use, refreshed every
//! 5 minutes, and at most every 10 s when a token names an unknown `kid`.

use crate::identity::{Identity, IdentityError};
use base64::Engine;
use jwt_simple::prelude::*;
use std::collections::{HashMap, HashSet};
use std::time::{Duration as StdDuration, Instant};
use tokio::sync::RwLock;

const JWKS_MAX_AGE: StdDuration = StdDuration::from_secs(300);
const JWKS_MIN_REFRESH: StdDuration = StdDuration::from_secs(10);
/// Tolerated clock difference with the issuer for `exp`, `nbf` and `iat`.
pub const CLOCK_SKEW: StdDuration = StdDuration::from_secs(60);

#[derive(serde::Deserialize)]
struct Jwks {
    keys: Vec<Jwk>,
}

#[derive(serde::Deserialize)]
struct Jwk {
    kty: String,
    #[serde(default)]
    kid: Option<String>,
    #[serde(default)]
    n: Option<String>,
    #[serde(default)]
    e: Option<String>,
    #[serde(default)]
    crv: Option<String>,
    #[serde(default)]
    x: Option<String>,
    #[serde(default)]
    y: Option<String>,
}

enum VerifyingKey {
    Rs256(Box<RS256PublicKey>),
    Es256(ES256PublicKey),
}

#[derive(Default)]
struct KeySet {
    keys: HashMap<String, VerifyingKey>,
    fetched_at: Option<Instant>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct OidcClaims {
    #[serde(default)]
    preferred_username: Option<String>,
    #[serde(flatten)]
    other: serde_json::Map<String, serde_json::Value>,
}

pub struct OidcVerifier {
    issuer: String,
    audience: String,
    jwks_url: String,
    groups_claim: String,
    http: reqwest::Client,
    keys: RwLock<KeySet>,
}

fn b64(s: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s.trim_end_matches('='))
        .map_err(|e| e.to_string())
}

fn parse_jwk(jwk: &Jwk) -> Result<VerifyingKey, String> {
    match jwk.kty.as_str() {
        "RSA" => {
            let n = b64(jwk.n.as_deref().ok_or("RSA key without n")?)?;
            let e = b64(jwk.e.as_deref().ok_or("RSA key without e")?)?;
            RS256PublicKey::from_components(&n, &e)
                .map(|k| VerifyingKey::Rs256(Box::new(k)))
                .map_err(|e| e.to_string())
        }
        "EC" if jwk.crv.as_deref() == Some("P-256") => {
            let x = b64(jwk.x.as_deref().ok_or("EC key without x")?)?;
            let y = b64(jwk.y.as_deref().ok_or("EC key without y")?)?;
            let mut sec1 = vec![0x04];
            sec1.extend_from_slice(&x);
            sec1.extend_from_slice(&y);
            ES256PublicKey::from_bytes(&sec1)
                .map(VerifyingKey::Es256)
                .map_err(|e| e.to_string())
        }
        other => Err(format!("unsupported key type {other}")),
    }
}

impl OidcVerifier {
    pub fn new(
        issuer: String,
        audience: String,
        jwks_url: String,
        groups_claim: String,
    ) -> OidcVerifier {
        OidcVerifier {
            issuer,
            audience,
            jwks_url,
            groups_claim,
            http: reqwest::Client::builder()
                .timeout(StdDuration::from_secs(5))
                .build()
                .unwrap_or_default(),
            keys: RwLock::new(KeySet::default()),
        }
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    async fn refresh(&self) -> Result<(), IdentityError> {
        let unavailable = |e: String| IdentityError::Unavailable(format!("JWKS: {e}"));
        let jwks: Jwks = self
            .http
            .get(&self.jwks_url)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| unavailable(e.to_string()))?
            .json()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let mut keys = HashMap::new();
        for jwk in &jwks.keys {
            match parse_jwk(jwk) {
                Ok(k) => {
                    keys.insert(jwk.kid.clone().unwrap_or_default(), k);
                }
                Err(e) => tracing::debug!(error = %e, "skipping JWKS entry"),
            }
        }
        let mut set = self.keys.write().await;
        set.keys = keys;
        set.fetched_at = Some(Instant::now());
        Ok(())
    }

    /// The token is for this client: `aud` names it, or `azp` (the party it was issued to) is
    /// it — the reference's rule (`auth.identity.azp == clientId`), which Keycloak's access
    /// tokens need (their `aud` is `account` unless an audience mapper is added).
    fn bound_to_client(&self, claims: &JWTClaims<OidcClaims>) -> bool {
        let audience = HashSet::from([self.audience.clone()]);
        claims
            .audiences
            .as_ref()
            .is_some_and(|a| a.contains(&audience))
            || claims.custom.other.get("azp").and_then(|v| v.as_str()) == Some(&self.audience)
    }

    pub async fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
        let meta = Token::decode_metadata(token).map_err(|_| IdentityError::InvalidToken)?;
        let kid = meta.key_id().unwrap_or_default().to_string();
        let needs_refresh = {
            let set = self.keys.read().await;
            match set.fetched_at {
                None => true,
                Some(at) => {
                    at.elapsed() > JWKS_MAX_AGE
                        || (!set.keys.contains_key(&kid) && at.elapsed() > JWKS_MIN_REFRESH)
                }
            }
        };
        if needs_refresh {
            self.refresh().await?;
        }
        let options = VerificationOptions {
            allowed_issuers: Some(HashSet::from([self.issuer.clone()])),
            // Checked below: `aud` or `azp` (the library knows only `aud`).
            allowed_audiences: None,
            time_tolerance: Some(Duration::from_secs(CLOCK_SKEW.as_secs())),
            // `nbf` and `iat` later than now + the skew are refused (stated, not left to the
            // library's default).
            accept_future: false,
            ..Default::default()
        };
        let set = self.keys.read().await;
        let key = set.keys.get(&kid).ok_or(IdentityError::InvalidToken)?;
        let claims = match (key, meta.algorithm()) {
            (VerifyingKey::Rs256(k), "RS256") => k.verify_token::<OidcClaims>(token, Some(options)),
            (VerifyingKey::Es256(k), "ES256") => k.verify_token::<OidcClaims>(token, Some(options)),
            _ => return Err(IdentityError::InvalidToken),
        }
        .map_err(|_| IdentityError::InvalidToken)?;
        if !self.bound_to_client(&claims) {
            return Err(IdentityError::InvalidToken);
        }
        // The library checks `exp` only when present: a token without one is refused here.
        let expires_at = claims.expires_at.ok_or(IdentityError::InvalidToken)?;
        let username = claims
            .custom
            .preferred_username
            .clone()
            .or(claims.subject.clone())
            .filter(|u| !u.is_empty())
            .ok_or(IdentityError::InvalidToken)?;
        let mut groups = vec!["system:authenticated".to_string()];
        if let Some(serde_json::Value::Array(list)) = claims.custom.other.get(&self.groups_claim) {
            groups.extend(list.iter().filter_map(|v| v.as_str().map(str::to_string)));
        }
        Ok(Identity {
            username,
            groups,
            expires_at: Some(i64::try_from(expires_at.as_secs()).unwrap_or(i64::MAX)),
        })
    }
}
