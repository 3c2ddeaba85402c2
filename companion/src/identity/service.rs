//! Checks cluster tokens through the configured provider, with the caches described in
//! [`crate::identity`], and decides who is an admin.

use crate::identity::oidc::OidcVerifier;
use crate::identity::providers::{
    AdminSar, StaticIdentities, TokenReviewer, token_hash, unverified_jwt_claims,
};
use crate::identity::{Identity, IdentityError};
use crate::metrics::Metrics;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub enum Provider {
    Static(StaticIdentities),
    /// TokenReview; with an OIDC verifier, JWTs whose (unverified) `iss` is its issuer are
    /// verified locally instead — the signature check decides, the `iss` only routes.
    Kubernetes(TokenReviewer, Option<OidcVerifier>),
    Oidc(OidcVerifier),
}

impl Provider {
    async fn verify(&self, token: &str) -> Result<Identity, IdentityError> {
        match self {
            Provider::Static(s) => s.verify(token),
            Provider::Kubernetes(_, Some(oidc))
                if unverified_jwt_claims(token)
                    .and_then(|c| c.get("iss")?.as_str().map(str::to_string))
                    .is_some_and(|iss| iss == oidc.issuer()) =>
            {
                oidc.verify(token).await
            }
            Provider::Kubernetes(k, _) => k.verify(token).await,
            Provider::Oidc(o) => o.verify(token).await,
        }
    }
}

struct CacheEntry {
    result: Result<Identity, IdentityError>,
    until: Instant,
}

/// Cap on cached token answers; when full, expired entries go first, then everything.
const TOKEN_CACHE_MAX: usize = 50_000;

pub struct IdentityService {
    provider: Provider,
    cache: Mutex<HashMap<[u8; 32], CacheEntry>>,
    positive_ttl: Duration,
    negative_ttl: Duration,
    admin_groups: Vec<String>,
    admin_sar: Option<AdminSar>,
    metrics: Arc<Metrics>,
}

impl IdentityService {
    pub fn new(
        provider: Provider,
        positive_ttl: Duration,
        negative_ttl: Duration,
        admin_groups: Vec<String>,
        admin_sar: Option<AdminSar>,
        metrics: Arc<Metrics>,
    ) -> IdentityService {
        IdentityService {
            provider,
            cache: Mutex::new(HashMap::new()),
            positive_ttl,
            negative_ttl,
            admin_groups,
            admin_sar,
            metrics,
        }
    }

    pub fn positive_ttl(&self) -> Duration {
        self.positive_ttl
    }

    /// Checks a cluster token (cached, see the module doc).
    pub async fn verify_token(&self, token: &str) -> Result<Identity, IdentityError> {
        let key = token_hash(token);
        let now = Instant::now();
        if let Ok(cache) = self.cache.lock()
            && let Some(entry) = cache.get(&key)
            && entry.until > now
        {
            self.metrics.token_cache_hits.inc();
            return entry.result.clone();
        }
        let result = self.provider.verify(token).await;
        let ttl = match &result {
            Ok(identity) => {
                let mut ttl = self.positive_ttl;
                if let Some(exp) = identity.expires_at {
                    let left = exp - chrono::Utc::now().timestamp();
                    if left <= 0 {
                        return Err(IdentityError::InvalidToken);
                    }
                    ttl = ttl.min(Duration::from_secs(left.unsigned_abs()));
                }
                Some(ttl)
            }
            Err(IdentityError::InvalidToken) => Some(self.negative_ttl),
            Err(IdentityError::Unavailable(_)) => None,
        };
        if let Some(ttl) = ttl
            && !ttl.is_zero()
            && let Ok(mut cache) = self.cache.lock()
        {
            if cache.len() >= TOKEN_CACHE_MAX {
                cache.retain(|_, e| e.until > now);
                if cache.len() >= TOKEN_CACHE_MAX {
                    cache.clear();
                }
            }
            cache.insert(
                key,
                CacheEntry {
                    result: result.clone(),
                    until: now + ttl,
                },
            );
        }
        result
    }

    pub fn is_admin_groups(&self, groups: &[String]) -> bool {
        groups.iter().any(|g| self.admin_groups.contains(g))
    }

    /// Admin group member, or allowed by the SubjectAccessReview when configured.
    pub async fn is_admin(&self, identity: &Identity) -> bool {
        if self.is_admin_groups(&identity.groups) {
            return true;
        }
        match &self.admin_sar {
            Some(sar) => sar.allows(identity).await,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn negative_and_positive_answers_are_cached_separately() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.yaml");
        std::fs::write(
            &path,
            "identities:\n  - token: t1\n    username: u1\n    groups: [g]\n",
        )
        .unwrap();
        let metrics = Metrics::new();
        let svc = IdentityService::new(
            Provider::Static(StaticIdentities::load(&path).unwrap()),
            Duration::from_secs(60),
            Duration::from_millis(50),
            vec!["g".into()],
            None,
            metrics.clone(),
        );
        assert_eq!(svc.verify_token("t1").await.unwrap().username, "u1");
        assert_eq!(svc.verify_token("t1").await.unwrap().username, "u1");
        assert!(matches!(
            svc.verify_token("nope").await,
            Err(IdentityError::InvalidToken)
        ));
        assert!(matches!(
            svc.verify_token("nope").await,
            Err(IdentityError::InvalidToken)
        ));
        assert_eq!(metrics.token_cache_hits.get(), 2);
        tokio::time::sleep(Duration::from_millis(80)).await;
        let _ = svc.verify_token("nope").await;
        assert_eq!(metrics.token_cache_hits.get(), 2, "negative entry expired");
        assert!(svc.is_admin_groups(&["g".into()]));
        assert!(!svc.is_admin_groups(&["h".into()]));
    }
}
