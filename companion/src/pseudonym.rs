//! Who the logs name: a user as a keyed pseudonym (`u-` and the first 16 hex digits of
//! HMAC-SHA256(key, name)) unless clear names are turned on (`--log-user-names clear`). The
//! key comes from `--log-pseudonym-key-file` (a Secret: the same key gives the same pseudonym
//! across replicas and restarts; a new key rotates them all); without one, a random key per
//! process. An operator who knows a user's name finds their lines by computing the pseudonym
//! with the key (`maas-companion pseudonym <name>` is not provided: `printf %s NAME | openssl
//! dgst -sha256 -hmac KEY`). Set once at start; until then (tests) names show in clear.
//!
//! [`subject`] is the same pseudonym, always keyed whatever the logs do (the key file when one
//! is configured, else the process's random key): the authenticate answer carries it, so the
//! gateway's telemetry (trace attributes, usage events) and the companion's spans name a user
//! the same way and never by name.

use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretSlice};
use sha2::Sha256;
use std::sync::{Arc, OnceLock};

/// How users appear in the logs.
#[derive(Clone)]
pub enum Pseudonyms {
    Clear,
    /// The key, never logged.
    Keyed(Arc<SecretSlice<u8>>),
}

impl std::fmt::Debug for Pseudonyms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pseudonyms::Clear => write!(f, "Clear"),
            Pseudonyms::Keyed(_) => write!(f, "Keyed([REDACTED])"),
        }
    }
}

impl Pseudonyms {
    /// Pseudonyms with a random key (they change at each start).
    pub fn random() -> Pseudonyms {
        Pseudonyms::Keyed(random_key())
    }
}

static CURRENT: OnceLock<Pseudonyms> = OnceLock::new();
static SUBJECT_KEY: OnceLock<Arc<SecretSlice<u8>>> = OnceLock::new();

/// A random pseudonym key (32 bytes).
pub fn random_key() -> Arc<SecretSlice<u8>> {
    use rand::RngCore;
    let mut key = vec![0u8; 32];
    rand::thread_rng().fill_bytes(&mut key);
    Arc::new(SecretSlice::from(key))
}

/// Sets how users appear in the logs, and the key of [`subject`], from now on (the first call
/// wins).
pub fn init(p: Pseudonyms, subject_key: Arc<SecretSlice<u8>>) {
    let _ = CURRENT.set(p);
    let _ = SUBJECT_KEY.set(subject_key);
}

/// `name`'s keyed pseudonym, whatever the logs do: with the configured key, else (not set yet)
/// a random key drawn once for the process.
pub fn subject(name: &str) -> String {
    pseudonym(SUBJECT_KEY.get_or_init(random_key).expose_secret(), name)
}

/// `name` as the logs show it (see the module doc).
pub fn user(name: &str) -> String {
    match CURRENT.get() {
        None | Some(Pseudonyms::Clear) => name.to_string(),
        Some(Pseudonyms::Keyed(key)) => pseudonym(key.expose_secret(), name),
    }
}

/// `u-` and the first 8 bytes of HMAC-SHA256(`key`, `name`) in hex.
pub fn pseudonym(key: &[u8], name: &str) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return "u-unknown".into();
    };
    mac.update(name.as_bytes());
    let digest = mac.finalize().into_bytes();
    let mut out = String::with_capacity(18);
    out.push_str("u-");
    for b in digest.iter().take(8) {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pseudonym_is_the_keyed_hmac_and_changes_with_the_key() {
        // RFC 4231 test case 2: HMAC-SHA256("Jefe", "what do ya want for nothing?").
        assert_eq!(
            pseudonym(b"Jefe", "what do ya want for nothing?"),
            "u-5bdcc146bf60754e"
        );
        assert_ne!(pseudonym(b"key-1", "alice"), pseudonym(b"key-2", "alice"));
        assert_ne!(pseudonym(b"key-1", "alice"), pseudonym(b"key-1", "bob"));
        assert!(!pseudonym(b"key-1", "alice").contains("alice"));
    }

    #[test]
    fn a_subject_pseudonym_is_always_keyed_and_stable() {
        // Keyed even before (or without) any setting: never the clear name.
        let p = subject("alice");
        assert!(p.starts_with("u-") && p.len() == 18, "{p}");
        assert!(!p.contains("alice"));
        assert_eq!(subject("alice"), p);
        assert_ne!(subject("bob"), p);
    }
}
