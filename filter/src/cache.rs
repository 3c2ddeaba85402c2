//! Authentication cache in shared data (all worker VMs see it).
//!
//! Layout (see README): an entry lives under `maas/c/k/<key_id>` (API keys) or
//! `maas/c/t/<hex sha256(token)>` (tokens); its value carries the SHA-256 that proves it belongs
//! to the very credential presented (compared on every hit), never the credential. Entries are
//! bounded by a ring of `maxEntries` slots (`maas/c/ring/<n>` names the entry in slot n, the
//! head counter is `maas/c/ring`): taking a slot evicts the entry it named (oldest first).

use crate::store::{SharedStore, read_u64};
use maas_types::AuthenticateResponse;

const VERSION: u8 = 1;
const KIND_ALLOW: u8 = 1;
const KIND_DENY: u8 = 2;
const RING_HEAD: &str = "maas/c/ring";
/// Attempts at a CAS update before giving up (contention is between a handful of workers).
pub const CAS_ATTEMPTS: usize = 32;

/// What the companion said about a credential, as cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CachedAnswer {
    Allow(CachedIdentity),
    /// A refusal (401 / 403) and its message.
    Deny {
        status: u16,
        message: String,
    },
}

/// The identity behind a credential; the tier is resolved per request against the current policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedIdentity {
    pub subject: String,
    pub groups: Vec<String>,
    /// The tier the key was pinned to (`tier_pinned`), else empty.
    pub pinned_tier: Option<String>,
}

impl CachedIdentity {
    pub fn from_response(r: &AuthenticateResponse) -> Self {
        CachedIdentity {
            subject: r.subject.clone(),
            groups: r.groups.clone(),
            pinned_tier: r.tier_pinned.then(|| r.tier.clone()),
        }
    }
}

/// How long a positive answer may be cached: the companion's TTL, capped by config and by the
/// credential's expiry. 0 = do not cache.
pub fn positive_ttl(r: &AuthenticateResponse, max_ttl_seconds: u64, now: u64) -> u64 {
    let mut ttl = r.cache_ttl_seconds.min(max_ttl_seconds);
    if let Some(exp) = r.expires_at {
        let left = u64::try_from(exp).unwrap_or(0).saturating_sub(now);
        ttl = ttl.min(left);
    }
    ttl
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    let len = bytes.len().min(u16::MAX as usize);
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(bytes.get(..len).unwrap_or_default());
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1)?.first().copied()
    }
    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_le_bytes(b.try_into().ok()?))
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

/// Encodes an entry: version, kind, expiry (unix s), verifier, then the answer.
pub fn encode(answer: &CachedAnswer, verifier: &[u8; 32], expires_at: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.push(VERSION);
    match answer {
        CachedAnswer::Allow(id) => {
            out.push(KIND_ALLOW);
            out.extend_from_slice(&expires_at.to_le_bytes());
            out.extend_from_slice(verifier);
            match &id.pinned_tier {
                Some(t) => {
                    out.push(1);
                    put_str(&mut out, t);
                }
                None => out.push(0),
            }
            put_str(&mut out, &id.subject);
            let n = id.groups.len().min(u16::MAX as usize);
            out.extend_from_slice(&(n as u16).to_le_bytes());
            for g in id.groups.iter().take(n) {
                put_str(&mut out, g);
            }
        }
        CachedAnswer::Deny { status, message } => {
            out.push(KIND_DENY);
            out.extend_from_slice(&expires_at.to_le_bytes());
            out.extend_from_slice(verifier);
            out.extend_from_slice(&status.to_le_bytes());
            put_str(&mut out, message);
        }
    }
    out
}

/// A decoded entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub answer: CachedAnswer,
    pub verifier: [u8; 32],
    pub expires_at: u64,
}

pub fn decode(bytes: &[u8]) -> Option<Entry> {
    let mut r = Reader { bytes, at: 0 };
    if r.u8()? != VERSION {
        return None;
    }
    let kind = r.u8()?;
    let expires_at = read_u64(r.take(8)?, 0)?;
    let verifier: [u8; 32] = r.take(32)?.try_into().ok()?;
    let answer = match kind {
        KIND_ALLOW => {
            let pinned_tier = match r.u8()? {
                0 => None,
                _ => Some(r.string()?),
            };
            let subject = r.string()?;
            let n = r.u16()? as usize;
            let mut groups = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                groups.push(r.string()?);
            }
            CachedAnswer::Allow(CachedIdentity {
                subject,
                groups,
                pinned_tier,
            })
        }
        KIND_DENY => {
            let status = r.u16()?;
            let message = r.string()?;
            CachedAnswer::Deny { status, message }
        }
        _ => return None,
    };
    Some(Entry {
        answer,
        verifier,
        expires_at,
    })
}

/// The cached answer for this credential, when present, fresh and made for this very credential.
pub fn lookup(
    store: &dyn SharedStore,
    cache_key: &str,
    verifier: &[u8; 32],
    now: u64,
) -> Option<CachedAnswer> {
    let (value, _) = store.get(cache_key);
    let entry = decode(&value?)?;
    if entry.expires_at <= now || &entry.verifier != verifier {
        return None;
    }
    Some(entry.answer)
}

/// Stores an answer for `ttl` seconds (0: not cached). A refusal never replaces a fresh positive
/// entry of a different credential with the same key id (a wrong secret must not evict the owner).
pub fn insert(
    store: &dyn SharedStore,
    cache_key: &str,
    verifier: &[u8; 32],
    answer: &CachedAnswer,
    ttl: u64,
    now: u64,
    max_entries: u64,
) {
    if ttl == 0 {
        return;
    }
    let (existing, _) = store.get(cache_key);
    let existing = existing.filter(|v| !v.is_empty());
    if let (CachedAnswer::Deny { .. }, Some(old)) = (answer, existing.as_deref())
        && let Some(old) = decode(old)
        && matches!(old.answer, CachedAnswer::Allow(_))
        && &old.verifier != verifier
        && old.expires_at > now
    {
        return;
    }
    let value = encode(answer, verifier, now.saturating_add(ttl));
    if existing.is_none() {
        take_slot(store, cache_key, max_entries);
    }
    let _ = store.set(cache_key, &value, None);
}

/// Takes the next ring slot for `cache_key`, evicting the entry that held it.
fn take_slot(store: &dyn SharedStore, cache_key: &str, max_entries: u64) {
    let max_entries = max_entries.max(1);
    for _ in 0..CAS_ATTEMPTS {
        let (head, cas) = store.get(RING_HEAD);
        let n = head.as_deref().and_then(|h| read_u64(h, 0)).unwrap_or(0);
        if store
            .set(RING_HEAD, &n.wrapping_add(1).to_le_bytes(), cas)
            .is_err()
        {
            continue;
        }
        let slot_key = format!("{RING_HEAD}/{}", n % max_entries);
        if let (Some(old), _) = store.get(&slot_key)
            && !old.is_empty()
            && old != cache_key.as_bytes()
            && let Ok(old_key) = std::str::from_utf8(&old)
        {
            let _ = store.set(old_key, &[], None);
        }
        let _ = store.set(&slot_key, cache_key.as_bytes(), None);
        return;
    }
}

/// Drops an entry (revoked key).
pub fn evict(store: &dyn SharedStore, cache_key: &str) {
    if let (Some(v), _) = store.get(cache_key)
        && !v.is_empty()
    {
        let _ = store.set(cache_key, &[], None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn allow(subject: &str) -> CachedAnswer {
        CachedAnswer::Allow(CachedIdentity {
            subject: subject.into(),
            groups: vec!["system:authenticated".into(), "tier-premium-users".into()],
            pinned_tier: Some("premium".into()),
        })
    }

    fn resp(ttl: u64, expires_at: Option<i64>) -> AuthenticateResponse {
        AuthenticateResponse {
            subject: "alice".into(),
            groups: vec![],
            tier: "free".into(),
            tier_pinned: false,
            key_id: None,
            expires_at,
            cache_ttl_seconds: ttl,
        }
    }

    #[test]
    fn encode_decode_roundtrip() {
        for a in [
            allow("alice"),
            CachedAnswer::Deny {
                status: 401,
                message: "key revoked".into(),
            },
            CachedAnswer::Allow(CachedIdentity {
                subject: "system:serviceaccount:ns:sa".into(),
                groups: vec![],
                pinned_tier: None,
            }),
        ] {
            let bytes = encode(&a, &[7; 32], 1234);
            let e = decode(&bytes).unwrap();
            assert_eq!(e.answer, a);
            assert_eq!(e.verifier, [7; 32]);
            assert_eq!(e.expires_at, 1234);
            // Every truncation decodes to nothing, never panics.
            for cut in 0..bytes.len() {
                assert!(decode(&bytes[..cut]).is_none(), "cut {cut}");
            }
        }
        assert!(decode(&[]).is_none());
        assert!(decode(&[9, 1]).is_none());
    }

    #[test]
    fn ttl_is_capped_by_config_and_expiry() {
        assert_eq!(positive_ttl(&resp(60, None), 300, 1000), 60);
        assert_eq!(positive_ttl(&resp(600, None), 300, 1000), 300);
        assert_eq!(positive_ttl(&resp(60, Some(1010)), 300, 1000), 10);
        assert_eq!(positive_ttl(&resp(60, Some(900)), 300, 1000), 0);
        assert_eq!(positive_ttl(&resp(60, Some(-5)), 300, 1000), 0);
        assert_eq!(positive_ttl(&resp(60, None), 0, 1000), 0);
        let mut pinned = resp(1, None);
        pinned.tier_pinned = true;
        assert_eq!(
            CachedIdentity::from_response(&pinned)
                .pinned_tier
                .as_deref(),
            Some("free")
        );
        assert_eq!(
            CachedIdentity::from_response(&resp(1, None)).pinned_tier,
            None
        );
    }

    #[test]
    fn lookup_checks_expiry_and_verifier() {
        let s = MemStore::new();
        insert(&s, "maas/c/k/a", &[1; 32], &allow("alice"), 10, 100, 10);
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 100),
            Some(allow("alice"))
        );
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 109),
            Some(allow("alice"))
        );
        assert_eq!(lookup(&s, "maas/c/k/a", &[1; 32], 110), None);
        // Same key id, different secret: not this credential's entry.
        assert_eq!(lookup(&s, "maas/c/k/a", &[2; 32], 100), None);
        // ... and its refusal does not evict the owner's fresh entry.
        let deny = CachedAnswer::Deny {
            status: 401,
            message: "key not found".into(),
        };
        insert(&s, "maas/c/k/a", &[2; 32], &deny, 5, 100, 10);
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 101),
            Some(allow("alice"))
        );
        // ttl 0: not stored.
        insert(&s, "maas/c/k/b", &[1; 32], &allow("bob"), 0, 100, 10);
        assert_eq!(lookup(&s, "maas/c/k/b", &[1; 32], 100), None);
        evict(&s, "maas/c/k/a");
        assert_eq!(lookup(&s, "maas/c/k/a", &[1; 32], 101), None);
    }

    #[test]
    fn bounded_oldest_evicted() {
        let s = MemStore::new();
        for i in 0..5 {
            insert(
                &s,
                &format!("maas/c/t/{i}"),
                &[1; 32],
                &allow("a"),
                60,
                0,
                3,
            );
        }
        let present: Vec<bool> = (0..5)
            .map(|i| lookup(&s, &format!("maas/c/t/{i}"), &[1; 32], 1).is_some())
            .collect();
        assert_eq!(present, vec![false, false, true, true, true]);
        // Refreshing an existing entry takes no new slot.
        insert(&s, "maas/c/t/4", &[1; 32], &allow("b"), 60, 0, 3);
        assert!(lookup(&s, "maas/c/t/2", &[1; 32], 1).is_some());
        // Entries plus ring bookkeeping stay bounded.
        for i in 5..100 {
            insert(
                &s,
                &format!("maas/c/t/{i}"),
                &[1; 32],
                &allow("a"),
                60,
                0,
                3,
            );
        }
        let live = (0..100)
            .filter(|i| lookup(&s, &format!("maas/c/t/{i}"), &[1; 32], 1).is_some())
            .count();
        assert_eq!(live, 3);
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = decode(&bytes);
        }
    }
}
