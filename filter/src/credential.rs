//! Which credential a request carries, and where its answer lives in the shared cache.
//!
//! The extraction rule (`Authorization: Bearer …` / `x-api-key`, conflicts, refusals) is the
//! one shared with the companion: [`maas_types::credential::extract`]. The credential itself is
//! only borrowed: it is sent to the companion on a miss and never stored or logged; the cache
//! sees its key id and hashes only.

use maas_types::apikey;
pub use maas_types::credential::CredentialError;
use sha2::{Digest, Sha256};

/// The request's credential ([`maas_types::Credential`]), with what the cache needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credential<'a>(pub maas_types::Credential<'a>);

/// Takes the credential from the header values (`None` = header absent), by the shared rule.
pub fn extract<'a>(
    authorization: Option<&'a str>,
    x_api_key: Option<&'a str>,
) -> Result<Credential<'a>, CredentialError> {
    maas_types::credential::extract(authorization, x_api_key).map(Credential)
}

/// Where a credential lives in the shared cache, and the hash its entry must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheIdentity {
    /// Shared-data key: `maas/c/k/<key_id>` for API keys, `maas/c/t/<hex sha256>` for tokens.
    pub cache_key: String,
    /// SHA-256 proving the entry belongs to this very credential (an API key: of
    /// `key_id\0secret`; a token: of the token).
    pub verifier: [u8; 32],
}

pub const CACHE_KEY_PREFIX: &str = "maas/c/";
/// The cache key prefix of API keys (then the key id).
const API_KEY_PREFIX: &str = "maas/c/k/";

impl CacheIdentity {
    /// The key id, for API keys (matched against the revocation list): the cache key names it.
    pub fn key_id(&self) -> Option<&str> {
        key_id_of(&self.cache_key)
    }

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

/// The key id a cache key names (API keys only).
pub fn key_id_of(cache_key: &str) -> Option<&str> {
    cache_key.strip_prefix(API_KEY_PREFIX)
}

/// Cache key of an API key id (also used to evict revoked keys).
pub fn api_key_cache_key(key_id: &str) -> String {
    let mut k = String::with_capacity(API_KEY_PREFIX.len() + key_id.len());
    k.push_str(API_KEY_PREFIX);
    k.push_str(key_id);
    k
}

impl Credential<'_> {
    pub fn raw(&self) -> &str {
        self.0.raw()
    }

    /// The key id of an API key (public: matched against the revocation list without hashing).
    pub fn key_id(&self) -> Option<&str> {
        match self.0 {
            maas_types::Credential::ApiKey { parts, .. } => Some(parts.key_id),
            maas_types::Credential::Token(_) => None,
        }
    }

    pub fn cache_identity(&self) -> CacheIdentity {
        match self.0 {
            maas_types::Credential::ApiKey { parts, .. } => CacheIdentity {
                cache_key: api_key_cache_key(parts.key_id),
                verifier: apikey::hash_bytes(parts),
            },
            maas_types::Credential::Token(t) => {
                let digest: [u8; 32] = Sha256::digest(t.as_bytes()).into();
                CacheIdentity {
                    cache_key: format!("{CACHE_KEY_PREFIX}t/{}", hex::encode(digest)),
                    verifier: digest,
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
        assert_eq!(a.key_id(), b.key_id());
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
    fn extraction_is_the_shared_rule() {
        let k = key();
        let auth = format!("Bearer {k}");
        assert!(matches!(
            extract(Some(&auth), None).unwrap().0,
            maas_types::Credential::ApiKey { .. }
        ));
        assert_eq!(extract(Some(&auth), None).unwrap().raw(), k);
        assert_eq!(
            extract(Some(&auth), Some("other")),
            Err(CredentialError::Conflicting)
        );
        assert_eq!(CredentialError::Conflicting.status(), 400);
        assert_eq!(
            extract(Some("Basic dXNlcjpw"), None),
            Err(CredentialError::UnsupportedScheme)
        );
    }

    #[test]
    fn cache_identity_never_holds_the_secret() {
        let k = key();
        let c = extract(None, Some(&k)).unwrap();
        let id = c.cache_identity();
        let parts = apikey::parse(&k).unwrap();
        assert_eq!(id.cache_key, format!("maas/c/k/{}", parts.key_id));
        assert_eq!(id.key_id(), Some(parts.key_id));
        assert!(!id.cache_key.contains(parts.secret));
        assert_eq!(id.verifier, apikey::hash_bytes(parts));
        let t = extract(Some("Bearer cluster-token"), None)
            .unwrap()
            .cache_identity();
        assert!(t.cache_key.starts_with("maas/c/t/"));
        assert!(!t.cache_key.contains("cluster-token"));
        assert_eq!(t.key_id(), None);
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
