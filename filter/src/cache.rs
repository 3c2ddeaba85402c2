//! Authentication cache in shared data (all worker VMs see it).
//!
//! Bounded whatever clients send: entries live in `cache.maxEntries` fixed slots `maas/c/<n>`,
//! never one key per credential (proxy-wasm shared data has no delete, so a key per junk token
//! would grow Envoy's heap for ever). A credential's cache key (`maas/c/k/<key_id>` for API keys,
//! `maas/c/t/<hex sha256(token)>` for tokens — a name, never stored) hashes (SHA-256) to two
//! candidate slots. An entry carries a 16-byte fingerprint of its cache key, so a lookup only
//! hits its own credential's entry, and the SHA-256 verifier that proves it belongs to the very
//! credential presented (compared on every hit), never the credential. A new entry takes the
//! better of its two slots: empty or expired, else the one holding a refusal, else the one that
//! expires first; a refusal never evicts another credential's fresh allow.

use crate::credential::CacheIdentity;
use crate::store::{SharedStore, read_u64};
use maas_types::AuthenticateResponse;
use sha2::{Digest, Sha256};
use std::rc::Rc;

/// 5: an allow carries the key's own limits (version 4 entries are misses: re-asked).
const VERSION: u8 = 5;
const KIND_ALLOW: u8 = 1;
const KIND_DENY: u8 = 2;
/// Attempts at a CAS update before giving up (contention is between a handful of workers).
pub const CAS_ATTEMPTS: usize = 32;

/// Fingerprint of a cache key, stored in its entry.
pub type Fingerprint = [u8; 16];

/// Where a credential's entry may live: its fingerprint and its two candidate slots
/// (`0..max_entries`; the same slot twice when there is only one).
pub fn placement(cache_key: &str, max_entries: u64) -> (Fingerprint, [u64; 2]) {
    let digest = Sha256::digest(cache_key.as_bytes());
    let part = |from: usize| -> u64 {
        let b: [u8; 8] = digest
            .get(from..from + 8)
            .and_then(|b| b.try_into().ok())
            .unwrap_or_default();
        u64::from_le_bytes(b) % max_entries.max(1)
    };
    let fp: Fingerprint = digest
        .get(..16)
        .and_then(|b| b.try_into().ok())
        .unwrap_or_default();
    (fp, [part(16), part(24)])
}

/// The shared-data key of slot `n`.
pub fn slot_key(n: u64) -> String {
    format!("maas/c/{n}")
}

/// The distinct slot keys a credential's entry may live in.
fn candidate_keys(slots: [u64; 2]) -> Vec<String> {
    let [a, b] = slots;
    if a == b {
        vec![slot_key(a)]
    } else {
        vec![slot_key(a), slot_key(b)]
    }
}

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
    /// The subscription the API key is bound to (the authenticate answer's `subscription`).
    pub subscription: Option<String>,
    /// The subject's keyed pseudonym from the companion (the answer's `pseudonym`): what
    /// telemetry names the caller by, never the clear subject.
    pub pseudonym: Option<String>,
    /// The API key's own limits (the answer's `limits`), as the scope they count in.
    pub key_scope: Option<Box<maas_types::Scope>>,
}

/// An allowed caller as a request holds it: shared with the worker's copy and the other
/// requests of the same answer, never copied per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub identity: Rc<CachedIdentity>,
    /// The identity's subject, shared (the request's counters and usage records name it).
    pub subject: Rc<str>,
}

impl Caller {
    pub fn new(identity: CachedIdentity) -> Self {
        Caller {
            subject: Rc::from(identity.subject.as_str()),
            identity: Rc::new(identity),
        }
    }
}

impl CachedIdentity {
    pub fn from_response(r: &AuthenticateResponse) -> Self {
        CachedIdentity {
            subject: r.subject.clone(),
            groups: r.groups.clone(),
            pinned_tier: r.tier_pinned.then(|| r.tier.clone()),
            subscription: r.subscription.clone().filter(|s| !s.is_empty()),
            pseudonym: r.pseudonym.clone().filter(|s| !s.is_empty()),
            key_scope: r
                .limits
                .clone()
                .map(|l| Box::new(maas_types::Scope::of_key(l))),
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
    /// A presence byte, then the string when present.
    fn optional_string(&mut self) -> Option<Option<String>> {
        match self.u8()? {
            0 => Some(None),
            _ => self.string().map(Some),
        }
    }
}

/// Encodes an entry: version, kind, expiry (unix s), fingerprint, verifier, then the answer.
pub fn encode(
    answer: &CachedAnswer,
    fingerprint: &Fingerprint,
    verifier: &[u8; 32],
    expires_at: u64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.push(VERSION);
    out.push(match answer {
        CachedAnswer::Allow(_) => KIND_ALLOW,
        CachedAnswer::Deny { .. } => KIND_DENY,
    });
    out.extend_from_slice(&expires_at.to_le_bytes());
    out.extend_from_slice(fingerprint);
    out.extend_from_slice(verifier);
    match answer {
        CachedAnswer::Allow(id) => {
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
            let limits = id
                .key_scope
                .as_ref()
                .and_then(|s| serde_json::to_string(&s.limits).ok());
            for field in [&id.subscription, &id.pseudonym, &limits] {
                match field {
                    Some(s) => {
                        out.push(1);
                        put_str(&mut out, s);
                    }
                    None => out.push(0),
                }
            }
        }
        CachedAnswer::Deny { status, message } => {
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
    pub fingerprint: Fingerprint,
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
    let fingerprint: Fingerprint = r.take(16)?.try_into().ok()?;
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
            let subscription = r.optional_string()?;
            let pseudonym = r.optional_string()?;
            // Limits that do not parse make the entry a miss (re-asked), never a key without.
            let key_scope = match r.optional_string()? {
                Some(json) => Some(Box::new(maas_types::Scope::of_key(
                    serde_json::from_str(&json).ok()?,
                ))),
                None => None,
            };
            CachedAnswer::Allow(CachedIdentity {
                subject,
                groups,
                pinned_tier,
                subscription,
                pseudonym,
                key_scope,
            })
        }
        KIND_DENY => {
            let status = r.u16()?;
            let message = r.string()?;
            CachedAnswer::Deny { status, message }
        }
        _ => return None,
    };
    if r.at != bytes.len() {
        return None;
    }
    Some(Entry {
        answer,
        fingerprint,
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
    max_entries: u64,
) -> Option<CachedAnswer> {
    lookup_entry(store, cache_key, verifier, now, max_entries).map(|(a, _)| a)
}

/// [`lookup`], with the entry's expiry (unix s).
pub fn lookup_entry(
    store: &dyn SharedStore,
    cache_key: &str,
    verifier: &[u8; 32],
    now: u64,
    max_entries: u64,
) -> Option<(CachedAnswer, u64)> {
    let (fp, slots) = placement(cache_key, max_entries);
    candidate_keys(slots).iter().find_map(|k| {
        let entry = decode(&store.get(k).0?)?;
        (entry.fingerprint == fp && entry.expires_at > now && &entry.verifier == verifier)
            .then_some((entry.answer, entry.expires_at))
    })
}

/// Entries a worker's [`LocalCache`] holds at most (beyond: expired ones go, then all).
pub const LOCAL_ENTRIES: usize = 4096;

/// A worker's own copy of the allows it read from the shared cache (one VM per worker thread): a
/// hit costs no shared-data read, no slot hashing and no entry decoding. Shared data stays the
/// source across workers: an entry is only copied from a fresh shared allow of the very
/// credential, expires no later than that shared entry and no later than one poll interval
/// after it was copied (so whatever changes in shared data — an eviction, a refusal cached by
/// another worker — is seen within one poll), and is dropped when its key id is revoked. Refusals
/// are never copied (junk credentials cannot fill it).
///
/// Entries are found by [`LocalKey`]: 128 bits of SipHash of the credential under keys drawn at
/// random when the VM starts, so a hit computes no SHA-256 (in the VM, hashing the credential for
/// its verifier was a tenth of the filter's own work per request) and the credential is still
/// never held. Whoever does not know the VM's keys cannot aim a credential at another's entry:
/// a match by chance is 2⁻¹²⁸ per entry. The entry keeps the credential's cache identity (cache
/// key and SHA-256 verifier) from the miss that copied it, for revocations and callouts.
#[derive(Debug, Default)]
pub struct LocalCache {
    entries: crate::FastMap<LocalKey, LocalEntry>,
    keys: std::hash::RandomState,
}

/// Where a credential's copy lives in a [`LocalCache`] (see there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalKey(u64, u64);

#[derive(Debug, Clone)]
struct LocalEntry {
    /// The credential's cache key (its key id, for API keys) and verifier.
    identity: CacheIdentity,
    caller: Caller,
    /// The subject's counter slot key (hashed once per copy, not per request).
    counter_key: Rc<str>,
    expires_at: u64,
}

impl LocalCache {
    /// The key of the credential `raw` (as [`crate::credential::Credential::raw`] gives it).
    pub fn key(&self, raw: &str) -> LocalKey {
        use std::hash::{BuildHasher, Hasher};
        let half = |domain: u8| {
            let mut h = self.keys.build_hasher();
            h.write_u8(domain);
            h.write(raw.as_bytes());
            h.finish()
        };
        LocalKey(half(0), half(1))
    }

    /// The caller behind this very credential, its subject's counter slot key (shared, not
    /// copied) and the credential's cache identity, when copied and not expired at `now` (unix s).
    pub fn get(&self, key: LocalKey, now: u64) -> Option<(Caller, Rc<str>, CacheIdentity)> {
        self.entries
            .get(&key)
            .filter(|e| e.expires_at > now)
            .map(|e| (e.caller.clone(), e.counter_key.clone(), e.identity.clone()))
    }

    /// Copies a shared allow that expires at `shared_expires_at`, for at most `max_age_s`
    /// (one poll interval; 0: not copied), with its subject's counter slot key.
    /// `credential`: where its copy lives and its cache identity.
    pub fn put(
        &mut self,
        (key, id): (LocalKey, &CacheIdentity),
        caller: &Caller,
        counter_key: impl FnOnce() -> String,
        shared_expires_at: u64,
        max_age_s: u64,
        now: u64,
    ) {
        let expires_at = shared_expires_at.min(now.saturating_add(max_age_s));
        if expires_at <= now {
            return;
        }
        if self.entries.len() >= LOCAL_ENTRIES && !self.entries.contains_key(&key) {
            self.entries.retain(|_, e| e.expires_at > now);
            if self.entries.len() >= LOCAL_ENTRIES {
                self.entries.clear();
            }
        }
        self.entries.insert(
            key,
            LocalEntry {
                identity: id.clone(),
                caller: caller.clone(),
                counter_key: Rc::from(counter_key()),
                expires_at,
            },
        );
    }

    /// Drops every entry of API key `key_id` (revoked).
    pub fn revoke(&mut self, key_id: &str) {
        self.entries
            .retain(|_, e| e.identity.key_id() != Some(key_id));
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// How much a slot's current entry is worth keeping: lower is evicted first.
fn keep_rank(entry: Option<&Entry>, now: u64) -> (u8, u64) {
    match entry {
        None => (0, 0),
        Some(e) if e.expires_at <= now => (0, 0),
        Some(
            e @ Entry {
                answer: CachedAnswer::Deny { .. },
                ..
            },
        ) => (1, e.expires_at),
        Some(e) => (2, e.expires_at),
    }
}

/// Stores an answer for `ttl` seconds (0: not cached) in one of the credential's two slots.
/// A refusal never replaces a fresh positive entry of a different credential with the same key
/// id (a wrong secret must not evict the owner), nor a fresh positive entry of another key.
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
    let (fp, slots) = placement(cache_key, max_entries);
    let keys = candidate_keys(slots);
    let value = encode(answer, &fp, verifier, now.saturating_add(ttl));
    let is_deny = matches!(answer, CachedAnswer::Deny { .. });
    for _ in 0..CAS_ATTEMPTS {
        let current: Vec<(&String, Option<Entry>, Option<u32>)> = keys
            .iter()
            .map(|k| {
                let (v, cas) = store.get(k);
                (k, v.as_deref().and_then(decode), cas)
            })
            .collect();
        let own = current
            .iter()
            .find(|(_, e, _)| e.as_ref().is_some_and(|e| e.fingerprint == fp));
        let target = match own {
            Some((_, Some(old), _))
                if is_deny
                    && matches!(old.answer, CachedAnswer::Allow(_))
                    && &old.verifier != verifier
                    && old.expires_at > now =>
            {
                return;
            }
            Some(t) => t,
            None => {
                let Some(victim) = current
                    .iter()
                    .min_by_key(|(_, e, _)| keep_rank(e.as_ref(), now))
                else {
                    return;
                };
                if is_deny && keep_rank(victim.1.as_ref(), now).0 == 2 {
                    return;
                }
                victim
            }
        };
        if store.set(target.0, &value, target.2).is_ok() {
            return;
        }
    }
}

/// Drops a credential's entry (revoked key): a slot is cleared only when it holds that entry.
pub fn evict(store: &dyn SharedStore, cache_key: &str, max_entries: u64) {
    let (fp, slots) = placement(cache_key, max_entries);
    for k in candidate_keys(slots) {
        for _ in 0..CAS_ATTEMPTS {
            let (v, cas) = store.get(&k);
            let holds = v
                .as_deref()
                .and_then(decode)
                .is_some_and(|e| e.fingerprint == fp);
            if !holds || store.set(&k, &[], cas).is_ok() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn the_local_copy_is_bounded_and_never_outlives_its_bounds() {
        let allow = Caller::new(CachedIdentity {
            subject: "s".into(),
            groups: vec![],
            pinned_tier: None,
            subscription: None,
            pseudonym: None,
            key_scope: None,
        });
        let id = |n: u32| CacheIdentity {
            cache_key: format!("maas/c/t/{n}"),
            verifier: {
                let mut v = [0u8; 32];
                v[..4].copy_from_slice(&n.to_le_bytes());
                v
            },
        };
        let mut c = LocalCache::default();
        let k = |c: &LocalCache, n: u32| c.key(&format!("credential-{n}"));
        // No longer than the shared entry, nor than the poll interval; 0 s: not copied.
        c.put((k(&c, 1), &id(1)), &allow, String::new, 1003, 60, 1000);
        assert_eq!(c.get(k(&c, 1), 1002).map(|e| e.2), Some(id(1)));
        assert!(c.get(k(&c, 1), 1003).is_none());
        c.put((k(&c, 2), &id(2)), &allow, String::new, 5000, 2, 1000);
        assert!(c.get(k(&c, 2), 1001).is_some());
        assert!(c.get(k(&c, 2), 1002).is_none());
        c.put((k(&c, 3), &id(3)), &allow, String::new, 5000, 0, 1000);
        assert!(c.get(k(&c, 3), 1000).is_none());
        // Another credential finds nothing, whatever it shares with the copied one.
        assert!(c.get(k(&c, 4), 1000).is_none());
        assert!(c.get(c.key("credential-1 "), 1000).is_none());
        // The keys are the VM's own: another cache keys the same credential elsewhere.
        assert_ne!(LocalCache::default().key("credential-1"), k(&c, 1));
        assert_eq!(c.key("credential-1"), k(&c, 1));
        // Bounded.
        for n in 0..(LOCAL_ENTRIES as u32 * 2) {
            c.put(
                (k(&c, n + 10), &id(n + 10)),
                &allow,
                String::new,
                5000,
                60,
                1000,
            );
            assert!(c.len() <= LOCAL_ENTRIES);
        }
    }

    fn allow(subject: &str) -> CachedAnswer {
        CachedAnswer::Allow(CachedIdentity {
            subject: subject.into(),
            groups: vec!["system:authenticated".into(), "tier-premium-users".into()],
            pinned_tier: Some("premium".into()),
            subscription: None,
            pseudonym: None,
            key_scope: None,
        })
    }

    fn resp(ttl: u64, expires_at: Option<i64>) -> AuthenticateResponse {
        AuthenticateResponse {
            subject: "alice".into(),
            groups: vec![],
            tier: "free".into(),
            tier_pinned: false,
            key_id: None,
            subscription: None,
            expires_at,
            limits: None,
            cache_ttl_seconds: ttl,
            pseudonym: None,
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
                subscription: None,
                pseudonym: None,
                key_scope: None,
            }),
            CachedAnswer::Allow(CachedIdentity {
                subject: "alice".into(),
                groups: vec!["team-a".into()],
                pinned_tier: None,
                subscription: Some("team-a".into()),
                pseudonym: Some("u-0123456789abcdef".into()),
                key_scope: None,
            }),
        ] {
            let bytes = encode(&a, &[3; 16], &[7; 32], 1234);
            let e = decode(&bytes).unwrap();
            assert_eq!(e.answer, a);
            assert_eq!(e.fingerprint, [3; 16]);
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
    fn the_cached_identity_carries_the_keys_subscription() {
        let mut bound = resp(60, None);
        bound.subscription = Some("team-a".into());
        let id = CachedIdentity::from_response(&bound);
        assert_eq!(id.subscription.as_deref(), Some("team-a"));
        let bytes = encode(&CachedAnswer::Allow(id.clone()), &[1; 16], &[2; 32], 99);
        assert_eq!(decode(&bytes).unwrap().answer, CachedAnswer::Allow(id));
        assert_eq!(
            CachedIdentity::from_response(&resp(60, None)).subscription,
            None
        );
        // An entry of the previous version (no subscription field) is a miss, never read as a
        // key without a subscription.
        let mut old = bytes.clone();
        old[0] = 2;
        // Without the flag byte, the length and the name.
        old.truncate(old.len() - (1 + 2 + "team-a".len()));
        assert!(decode(&old).is_none());
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

    fn deny() -> CachedAnswer {
        CachedAnswer::Deny {
            status: 401,
            message: "key not found".into(),
        }
    }

    #[test]
    fn lookup_checks_expiry_and_verifier() {
        let s = MemStore::new();
        let n = 10;
        insert(&s, "maas/c/k/a", &[1; 32], &allow("alice"), 10, 100, n);
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 100, n),
            Some(allow("alice"))
        );
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 109, n),
            Some(allow("alice"))
        );
        assert_eq!(lookup(&s, "maas/c/k/a", &[1; 32], 110, n), None);
        // Same key id, different secret: not this credential's entry.
        assert_eq!(lookup(&s, "maas/c/k/a", &[2; 32], 100, n), None);
        // ... and its refusal does not evict the owner's fresh entry.
        insert(&s, "maas/c/k/a", &[2; 32], &deny(), 5, 100, n);
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 101, n),
            Some(allow("alice"))
        );
        // ttl 0: not stored.
        insert(&s, "maas/c/k/b", &[1; 32], &allow("bob"), 0, 100, n);
        assert_eq!(lookup(&s, "maas/c/k/b", &[1; 32], 100, n), None);
        evict(&s, "maas/c/k/a", n);
        assert_eq!(lookup(&s, "maas/c/k/a", &[1; 32], 101, n), None);
    }

    #[test]
    fn a_lookup_only_hits_its_own_credential() {
        // One slot: every credential competes for it; the verifier alone would not tell two
        // tokens' entries apart if they shared it — the fingerprint does.
        let s = MemStore::new();
        insert(&s, "maas/c/t/aa", &[1; 32], &allow("alice"), 60, 0, 1);
        assert_eq!(lookup(&s, "maas/c/t/bb", &[1; 32], 1, 1), None);
        assert_eq!(
            lookup(&s, "maas/c/t/aa", &[1; 32], 1, 1),
            Some(allow("alice"))
        );
        // Revoking another key id leaves the slot alone; revoking this one clears it.
        evict(&s, "maas/c/k/other", 1);
        assert_eq!(
            lookup(&s, "maas/c/t/aa", &[1; 32], 1, 1),
            Some(allow("alice"))
        );
        evict(&s, "maas/c/t/aa", 1);
        assert_eq!(lookup(&s, "maas/c/t/aa", &[1; 32], 1, 1), None);
    }

    #[test]
    fn junk_cache_keys_leave_at_most_max_entries_keys() {
        let s = MemStore::new();
        let max = 500;
        for i in 0..10_000u64 {
            let key = format!("maas/c/t/junk-{i}");
            insert(&s, &key, &[9; 32], &deny(), 5, i / 100, max);
            // The refusal just cached is found (it is in one of its two slots).
            assert!(lookup(&s, &key, &[9; 32], i / 100, max).is_some(), "{i}");
        }
        assert!(s.key_count() <= max as usize, "{} keys", s.key_count());
        assert!(s.key_count() > max as usize / 2, "{} keys", s.key_count());
    }

    #[test]
    fn refusals_do_not_evict_fresh_allows_of_other_keys() {
        let s = MemStore::new();
        let max = 64;
        let users: Vec<String> = (0..20).map(|i| format!("maas/c/k/user{i}")).collect();
        for u in &users {
            insert(&s, u, &[1; 32], &allow("u"), 300, 0, max);
        }
        let cached = |s: &MemStore| {
            users
                .iter()
                .filter(|u| lookup(s, u, &[1; 32], 10, max).is_some())
                .count()
        };
        let before = cached(&s);
        assert!(before >= 18, "{before}");
        for i in 0..5_000 {
            insert(
                &s,
                &format!("maas/c/t/junk-{i}"),
                &[9; 32],
                &deny(),
                5,
                10,
                max,
            );
        }
        assert_eq!(cached(&s), before);
        // A new allow does replace another key's allow when it must (the earliest to expire).
        let s = MemStore::new();
        insert(&s, "maas/c/k/late", &[1; 32], &allow("l"), 300, 20, 1);
        insert(&s, "maas/c/k/later", &[1; 32], &allow("l"), 300, 21, 1);
        assert!(lookup(&s, "maas/c/k/later", &[1; 32], 22, 1).is_some());
        assert!(lookup(&s, "maas/c/k/late", &[1; 32], 22, 1).is_none());
    }

    #[test]
    fn refreshing_an_entry_keeps_its_slot() {
        let s = MemStore::new();
        let (_, slots) = placement("maas/c/k/a", 1000);
        insert(&s, "maas/c/k/a", &[1; 32], &allow("a"), 60, 0, 1000);
        insert(&s, "maas/c/k/a", &[1; 32], &allow("b"), 60, 1, 1000);
        assert_eq!(s.key_count(), 1);
        assert!(slots.iter().any(|n| s.get(&slot_key(*n)).0.is_some()));
        assert_eq!(
            lookup(&s, "maas/c/k/a", &[1; 32], 2, 1000),
            Some(allow("b"))
        );
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = decode(&bytes);
        }
    }
}
