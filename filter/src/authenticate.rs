//! The companion's answer to `POST /internal/v1/authenticate`, interpreted: what to cache and
//! what the waiting requests get. Plain code over the shared store.

use crate::cache::{self, CachedAnswer, CachedIdentity, Caller};
use crate::config::CacheConfig;
use crate::credential::CacheIdentity;
use crate::response::{Deny, Refusal};
use crate::store::SharedStore;
use maas_types::{AuthenticateResponse, ErrorBody};

pub const AUTHENTICATE_PATH: &str = "/internal/v1/authenticate";

/// What the requests waiting for a callout are answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// (Shared by every waiter: cloned without copying the identity.)
    pub result: Result<Caller, Refusal>,
    /// The companion did not answer usefully (counted in `maas_auth_callout_failed`).
    pub failed: bool,
}

/// Interprets the answer (`status` None: no answer, e.g. a timeout) for `identity`:
/// - 200 with a readable identity → allow, cached for its positive TTL;
/// - 200 unreadable → 503 `auth_unavailable` (not cached);
/// - 401 / 403 → that refusal (message cut to 200 characters), cached for the negative TTL;
/// - anything else → what another worker cached meanwhile, else 503 `auth_unavailable`.
pub fn interpret(
    store: &dyn SharedStore,
    cfg: &CacheConfig,
    identity: &CacheIdentity,
    status: Option<u32>,
    body: &[u8],
    now_s: u64,
) -> Outcome {
    let result = match status {
        Some(200) => match serde_json::from_slice::<AuthenticateResponse>(body) {
            Ok(resp) => {
                let id = CachedIdentity::from_response(&resp);
                let ttl = cache::positive_ttl(&resp, cfg.max_ttl_seconds, now_s);
                cache::insert(
                    store,
                    &identity.cache_key,
                    &identity.verifier,
                    &CachedAnswer::Allow(id.clone()),
                    ttl,
                    now_s,
                    cfg.max_entries,
                );
                Ok(Caller::new(id))
            }
            Err(e) => {
                log::error!("maas: unreadable authenticate answer from the companion: {e}");
                Err(Refusal::auth_unavailable(
                    "authentication service answered badly",
                ))
            }
        },
        Some(s @ (401 | 403)) => {
            let message = serde_json::from_slice::<ErrorBody>(body)
                .map(|b| b.error.message)
                .unwrap_or_else(|_| "invalid credential".to_string());
            let message: String = message.chars().take(200).collect();
            cache::insert(
                store,
                &identity.cache_key,
                &identity.verifier,
                &CachedAnswer::Deny {
                    status: s as u16,
                    message: message.clone(),
                },
                cfg.negative_ttl_seconds,
                now_s,
                cfg.max_entries,
            );
            Err(Refusal::from_companion(s, &message))
        }
        other => {
            // Another worker may have cached an answer meanwhile.
            let result = match cache::lookup(
                store,
                &identity.cache_key,
                &identity.verifier,
                now_s,
                cfg.max_entries,
            ) {
                Some(answer) => cached_result(answer),
                None => {
                    log::warn!("maas: authentication service unavailable (status {other:?})");
                    Err(Refusal::auth_unavailable(
                        "authentication service unavailable; retry shortly",
                    ))
                }
            };
            return Outcome {
                result,
                failed: true,
            };
        }
    };
    Outcome {
        result,
        failed: false,
    }
}

/// A cache hit as the request's authentication result.
pub fn cached_result(answer: CachedAnswer) -> Result<Caller, Refusal> {
    match answer {
        CachedAnswer::Allow(id) => Ok(Caller::new(id)),
        CachedAnswer::Deny { status, message } => {
            Err(Refusal::from_companion(u32::from(status), &message))
        }
    }
}

/// What waiters get when the request that made the callout goes away, or when the answer is
/// not for their very credential.
pub fn interrupted() -> Refusal {
    Refusal::new(
        Deny::AuthInterrupted,
        "authentication was interrupted; retry",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn identity() -> CacheIdentity {
        CacheIdentity {
            cache_key: "maas/c/t/x".into(),
            verifier: [1; 32],
        }
    }

    const CFG: CacheConfig = CacheConfig {
        max_entries: 64,
        max_ttl_seconds: 300,
        negative_ttl_seconds: 5,
    };

    #[test]
    fn a_refusal_message_is_cut_and_cached_for_the_negative_ttl() {
        let s = MemStore::new();
        let long = "x".repeat(500);
        let body = serde_json::to_vec(&ErrorBody::new(long.as_str(), "authentication_error", None))
            .unwrap();
        let o = interpret(&s, &CFG, &identity(), Some(401), &body, 1000);
        let r = o.result.unwrap_err();
        assert_eq!((r.status, r.message.len(), o.failed), (401, 200, false));
        let id = identity();
        assert!(cache::lookup(&s, &id.cache_key, &id.verifier, 1004, 64).is_some());
        assert!(cache::lookup(&s, &id.cache_key, &id.verifier, 1006, 64).is_none());
    }

    #[test]
    fn no_answer_is_a_failure_that_caches_nothing() {
        let s = MemStore::new();
        let o = interpret(&s, &CFG, &identity(), None, b"", 1000);
        assert!(o.failed);
        assert_eq!(o.result.unwrap_err().code, "auth_unavailable");
        assert!(s.is_empty());
    }
}
