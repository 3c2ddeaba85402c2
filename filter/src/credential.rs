//! Which credential a request carries: `Authorization: Bearer …` or `x-api-key`.
//!
//! Pure functions over header values. The credential itself is only borrowed: it is sent to the
//! companion on a miss and never stored or logged; the cache sees its key id and hashes only.

use maas_types::apikey::{self, ApiKeyParts, KeyFormatError};
use sha2::{Digest, Sha256};

/// A credential taken from the request, borrowed from the header value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential<'a> {
    /// A well-formed `sk-oai-…` key.
    ApiKey {
        raw: &'a str,
        parts: ApiKeyParts<'a>,
    },
    /// Anything else: a cluster token the companion verifies (TokenReview / OIDC / static).
    Token(&'a str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialError {
    /// No credential header at all (401).
    Missing,
    /// `Authorization` with a scheme other than Bearer, or an empty one (401).
    UnsupportedScheme,
    /// A header value that is empty after the scheme (401).
    Empty,
    /// Whitespace or control characters inside the credential (400).
    InvalidCharacters,
    /// `Authorization` and `x-api-key` both present with different values (400).
    Conflicting,
    /// `sk-oai-` prefix without the key shape (401, no callout).
    MalformedApiKey,
}

impl CredentialError {
    /// HTTP status for the refusal.
    pub fn status(&self) -> u32 {
        match self {
            CredentialError::InvalidCharacters | CredentialError::Conflicting => 400,
            _ => 401,
        }
    }

    pub fn message(&self) -> &'static str {
        match self {
            CredentialError::Missing => {
                "missing credential: send Authorization: Bearer <API key or token> or x-api-key"
            }
            CredentialError::UnsupportedScheme => "unsupported authorization scheme: use Bearer",
            CredentialError::Empty => "empty credential",
            CredentialError::InvalidCharacters => "credential holds invalid characters",
            CredentialError::Conflicting => {
                "Authorization and x-api-key carry different credentials: send one"
            }
            CredentialError::MalformedApiKey => "invalid key format",
        }
    }
}

fn bearer_value(authorization: &str) -> Result<&str, CredentialError> {
    let v = authorization.trim_matches(|c| c == ' ' || c == '\t');
    let (scheme, rest) = match v.find([' ', '\t']) {
        Some(i) => (v.get(..i).unwrap_or(""), v.get(i..).unwrap_or("")),
        None => (v, ""),
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(if v.is_empty() {
            CredentialError::Empty
        } else {
            CredentialError::UnsupportedScheme
        });
    }
    Ok(rest.trim_matches(|c| c == ' ' || c == '\t'))
}

fn check_value(v: &str) -> Result<&str, CredentialError> {
    if v.is_empty() {
        return Err(CredentialError::Empty);
    }
    // Credentials are visible ASCII (API keys, JWTs, service-account tokens); anything else,
    // including bytes that were not UTF-8 (U+FFFD after decoding), is refused.
    if v.bytes().any(|b| b <= b' ' || b >= 0x7f) {
        return Err(CredentialError::InvalidCharacters);
    }
    Ok(v)
}

/// Takes the credential from the header values (`None` = header absent).
pub fn extract<'a>(
    authorization: Option<&'a str>,
    x_api_key: Option<&'a str>,
) -> Result<Credential<'a>, CredentialError> {
    let from_auth = authorization.map(bearer_value).transpose()?;
    let from_key = x_api_key.map(|v| v.trim_matches(|c| c == ' ' || c == '\t'));
    let value = match (from_auth, from_key) {
        (None, None) => return Err(CredentialError::Missing),
        (Some(a), None) => a,
        (None, Some(k)) => k,
        (Some(a), Some(k)) if a == k => a,
        (Some(_), Some(_)) => return Err(CredentialError::Conflicting),
    };
    let value = check_value(value)?;
    match apikey::parse(value) {
        Ok(parts) => Ok(Credential::ApiKey { raw: value, parts }),
        Err(KeyFormatError::Malformed) => Err(CredentialError::MalformedApiKey),
        Err(KeyFormatError::NotAnApiKey) => Ok(Credential::Token(value)),
    }
}

/// Where a credential lives in the shared cache, and the hash its entry must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheIdentity {
    /// Shared-data key: `maas/c/k/<key_id>` for API keys, `maas/c/t/<hex sha256>` for tokens.
    pub cache_key: String,
    /// SHA-256 proving the entry belongs to this very credential (an API key: of
    /// `key_id\0secret`; a token: of the token).
    pub verifier: [u8; 32],
    /// The key id, for API keys (matched against the revocation list).
    pub key_id: Option<String>,
}

pub const CACHE_KEY_PREFIX: &str = "maas/c/";

impl CacheIdentity {
    /// Key under which concurrent cache misses of one worker share one companion callout: the
    /// whole credential (cache key and verifier), never the key id alone. Key ids are public, so
    /// a request with a real key id and a wrong secret must never receive the owner's answer, nor
    /// the owner the answer to a wrong secret.
    pub fn flight_key(&self) -> String {
        let mut k = String::with_capacity(self.cache_key.len() + 65);
        k.push_str(&self.cache_key);
        k.push(' ');
        k.push_str(&hex::encode(self.verifier));
        k
    }

    /// True when an answer obtained for `other` may be applied to this credential.
    pub fn same_credential(&self, other: &CacheIdentity) -> bool {
        self.cache_key == other.cache_key && self.verifier == other.verifier
    }
}

/// Cache key of an API key id (also used to evict revoked keys).
pub fn api_key_cache_key(key_id: &str) -> String {
    format!("{CACHE_KEY_PREFIX}k/{key_id}")
}

impl Credential<'_> {
    pub fn raw(&self) -> &str {
        match self {
            Credential::ApiKey { raw, .. } => raw,
            Credential::Token(t) => t,
        }
    }

    pub fn cache_identity(&self) -> CacheIdentity {
        match self {
            Credential::ApiKey { parts, .. } => CacheIdentity {
                cache_key: api_key_cache_key(parts.key_id),
                verifier: apikey::hash_bytes(*parts),
                key_id: Some(parts.key_id.to_string()),
            },
            Credential::Token(t) => {
                let digest: [u8; 32] = Sha256::digest(t.as_bytes()).into();
                CacheIdentity {
                    cache_key: format!("{CACHE_KEY_PREFIX}t/{}", hex::encode(digest)),
                    verifier: digest,
                    key_id: None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> String {
        apikey::format_key(&[1u8; 12], &[2u8; 32]).1
    }

    #[test]
    fn a_wrong_secret_never_shares_the_owners_callout() {
        let owner = apikey::format_key(&[1u8; 12], &[2u8; 32]).1;
        let wrong = apikey::format_key(&[1u8; 12], &[3u8; 32]).1;
        let a = extract(None, Some(&owner)).unwrap().cache_identity();
        let b = extract(None, Some(&wrong)).unwrap().cache_identity();
        // Same key id, same cache key…
        assert_eq!(a.key_id, b.key_id);
        assert_eq!(a.cache_key, b.cache_key);
        // …but never the same flight, and never the same credential.
        assert_ne!(a.flight_key(), b.flight_key());
        assert!(!a.same_credential(&b));
        let again = extract(Some(&format!("Bearer {owner}")), None)
            .unwrap()
            .cache_identity();
        assert_eq!(a.flight_key(), again.flight_key());
        assert!(a.same_credential(&again));
        // Tokens: the flight is the token's digest.
        let t1 = extract(Some("Bearer tok-1"), None)
            .unwrap()
            .cache_identity();
        let t2 = extract(Some("Bearer tok-2"), None)
            .unwrap()
            .cache_identity();
        assert_ne!(t1.flight_key(), t2.flight_key());
    }

    #[test]
    fn bearer_and_x_api_key() {
        let k = key();
        let auth = format!("Bearer {k}");
        let c = extract(Some(&auth), None).unwrap();
        assert!(matches!(c, Credential::ApiKey { .. }));
        assert_eq!(c.raw(), k);
        let c = extract(None, Some(&k)).unwrap();
        assert_eq!(c.raw(), k);
        // Same value in both: accepted.
        assert_eq!(extract(Some(&auth), Some(&k)).unwrap().raw(), k);
        // Scheme is case-insensitive.
        assert_eq!(
            extract(Some("bearer  tok"), None).unwrap(),
            Credential::Token("tok")
        );
    }

    #[test]
    fn refusals() {
        let k = key();
        let auth = format!("Bearer {k}");
        assert_eq!(extract(None, None), Err(CredentialError::Missing));
        assert_eq!(
            extract(Some(&auth), Some("other")),
            Err(CredentialError::Conflicting)
        );
        assert_eq!(
            extract(Some("Basic dXNlcjpw"), None),
            Err(CredentialError::UnsupportedScheme)
        );
        assert_eq!(extract(Some("Bearer"), None), Err(CredentialError::Empty));
        assert_eq!(
            extract(Some("Bearer   "), None),
            Err(CredentialError::Empty)
        );
        assert_eq!(extract(Some(""), None), Err(CredentialError::Empty));
        assert_eq!(extract(None, Some("")), Err(CredentialError::Empty));
        assert_eq!(
            extract(Some("Bearer a b"), None),
            Err(CredentialError::InvalidCharacters)
        );
        assert_eq!(
            extract(None, Some("a\u{1}b")),
            Err(CredentialError::InvalidCharacters)
        );
        // Non-UTF-8 bytes arrive as U+FFFD; non-ASCII is never a credential.
        assert_eq!(
            extract(Some("Bearer \u{fffd}\u{fffd}"), None),
            Err(CredentialError::InvalidCharacters)
        );
        assert_eq!(
            extract(None, Some("sk-oai-\u{e9}")),
            Err(CredentialError::InvalidCharacters)
        );
        assert_eq!(
            extract(Some("Bearer sk-oai-short"), None),
            Err(CredentialError::MalformedApiKey)
        );
        assert_eq!(CredentialError::Conflicting.status(), 400);
        assert_eq!(CredentialError::MalformedApiKey.status(), 401);
    }

    #[test]
    fn cache_identity_never_holds_the_secret() {
        let k = key();
        let c = extract(None, Some(&k)).unwrap();
        let id = c.cache_identity();
        let parts = apikey::parse(&k).unwrap();
        assert_eq!(id.cache_key, format!("maas/c/k/{}", parts.key_id));
        assert!(!id.cache_key.contains(parts.secret));
        assert_eq!(id.verifier, apikey::hash_bytes(parts));
        let t = extract(Some("Bearer cluster-token"), None)
            .unwrap()
            .cache_identity();
        assert!(t.cache_key.starts_with("maas/c/t/"));
        assert!(!t.cache_key.contains("cluster-token"));
        assert_eq!(t.key_id, None);
    }

    proptest::proptest! {
        #[test]
        fn extract_never_panics(a in proptest::option::of(".{0,80}"), k in proptest::option::of(".{0,80}")) {
            if let Ok(c) = extract(a.as_deref(), k.as_deref()) {
                proptest::prop_assert!(c.raw().bytes().all(|b| b > b' ' && b < 0x7f));
                let _ = c.cache_identity();
            }
        }
    }
}
