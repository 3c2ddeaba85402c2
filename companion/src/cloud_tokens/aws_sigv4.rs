//! AWS SigV4 signing keys (bedrock, `auth: awsSigV4`): the companion keeps the AWS secret access
//! key and hands the filter only the day's derived signing key.
//!
//! `kSigning = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, yyyymmdd), region), service), "aws4_request")`
//! signs the requests of that UTC day, region and service only, and cannot be turned back into
//! the secret. Keys are derived at each poll (four HMACs): today's, and in the last
//! [`AHEAD`] of the UTC day tomorrow's too, so a filter that polled before midnight signs the
//! first request after it with the new day's key. Each expires at the end of its day.

use hmac::{Hmac, Mac};
use maas_types::SigV4Key;
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;

/// The SigV4 service name of Bedrock's runtime API.
pub const SERVICE: &str = "bedrock";
/// How long before midnight (UTC) the next day's key is served too.
pub const AHEAD: u64 = 3600;
const DAY: u64 = 86_400;

/// An AWS access key as its Secret holds it (`aws-access-key-id`, `aws-secret-access-key`,
/// optional `aws-session-token`). Debug never shows the secret or the session token.
#[derive(Debug)]
pub struct AwsAccessKey {
    pub access_key_id: String,
    pub secret_access_key: SecretString,
    pub session_token: Option<SecretString>,
}

impl AwsAccessKey {
    /// Checks what goes into headers: the key id and token are header-safe, the key id shaped as
    /// AWS's (letters and digits).
    pub fn check(&self) -> Result<(), super::TokenError> {
        let id_ok = !self.access_key_id.is_empty()
            && self.access_key_id.len() <= 128
            && self
                .access_key_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric());
        if !id_ok {
            return Err(super::TokenError::Invalid(
                "aws-access-key-id must be letters and digits".into(),
            ));
        }
        if self.secret_access_key.expose_secret().is_empty() {
            return Err(super::TokenError::Invalid(
                "aws-secret-access-key is empty".into(),
            ));
        }
        if let Some(t) = &self.session_token
            && !super::header_safe(t.expose_secret())
        {
            return Err(super::TokenError::Invalid(
                "aws-session-token is not a header value".into(),
            ));
        }
        Ok(())
    }
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length: `new_from_slice` cannot fail.
    let Ok(mut m) = Hmac::<Sha256>::new_from_slice(key) else {
        return [0; 32];
    };
    m.update(data);
    m.finalize().into_bytes().into()
}

/// AWS's signing key derivation for `date` (`yyyymmdd`), `region`, `service`.
pub fn derive(secret: &SecretString, date: &str, region: &str, service: &str) -> [u8; 32] {
    let mut seed = String::with_capacity(4 + secret.expose_secret().len());
    seed.push_str("AWS4");
    seed.push_str(secret.expose_secret());
    let seed = SecretString::from(seed);
    let k_date = hmac(seed.expose_secret().as_bytes(), date.as_bytes());
    let k_region = hmac(&k_date, region.as_bytes());
    let k_service = hmac(&k_region, service.as_bytes());
    hmac(&k_service, b"aws4_request")
}

/// `yyyymmdd` of the UTC day starting at `day_start` (unix seconds).
fn date_of(day_start: u64) -> String {
    i64::try_from(day_start)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
        .map(|t| t.format("%Y%m%d").to_string())
        .unwrap_or_default()
}

/// The signing keys the filter gets for `region` at `now` (unix seconds): today's, and in the
/// last [`AHEAD`] of the day tomorrow's.
pub fn signing_keys(key: &AwsAccessKey, region: &str, now: u64) -> Vec<SigV4Key> {
    let today = now - now % DAY;
    let mut days = vec![today];
    if now >= today + DAY - AHEAD {
        days.push(today + DAY);
    }
    days.into_iter()
        .map(|start| {
            let date = date_of(start);
            SigV4Key {
                access_key_id: key.access_key_id.clone(),
                signing_key: hex::encode(derive(&key.secret_access_key, &date, region, SERVICE)),
                date,
                region: region.to_string(),
                service: SERVICE.to_string(),
                session_token: key
                    .session_token
                    .as_ref()
                    .map(|t| t.expose_secret().to_string()),
                expires_at: start + DAY,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(token: Option<&str>) -> AwsAccessKey {
        AwsAccessKey {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: SecretString::from("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
            session_token: token.map(SecretString::from),
        }
    }

    /// AWS's documented example (IAM, us-east-1, 2015-08-30).
    #[test]
    fn the_documented_signing_key_is_derived() {
        assert_eq!(
            hex::encode(derive(
                &key(None).secret_access_key,
                "20150830",
                "us-east-1",
                "iam"
            )),
            "c4afb1cc5771d871763a393e44b703571b55cc28424d1a5e86da6ed3c154a4b9"
        );
    }

    #[test]
    fn todays_key_and_near_midnight_tomorrows() {
        let noon = 1_440_938_160; // 2015-08-30T12:36:00Z
        let keys = signing_keys(&key(Some("tok")), "us-east-1", noon);
        assert_eq!(keys.len(), 1);
        let k = &keys[0];
        assert_eq!(
            (k.date.as_str(), k.region.as_str(), k.service.as_str()),
            ("20150830", "us-east-1", "bedrock")
        );
        assert_eq!(k.expires_at, 1_440_979_200);
        assert_eq!(k.session_token.as_deref(), Some("tok"));
        assert_eq!(
            k.signing_key,
            hex::encode(derive(
                &key(None).secret_access_key,
                "20150830",
                "us-east-1",
                "bedrock"
            ))
        );
        // The secret itself is nowhere in what the filter gets, nor in Debug.
        let served = serde_json::to_string(&keys).unwrap();
        assert!(!served.contains("wJalrXUtnFEMI"), "{served}");
        assert!(!format!("{:?}", key(Some("tok"))).contains("wJalrXUtnFEMI"));
        assert!(!format!("{keys:?}").contains(&k.signing_key));
        // 23:30: tomorrow's key too, expiring a day later.
        let late = 1_440_979_200 - 1800;
        let keys = signing_keys(&key(None), "us-east-1", late);
        let dates: Vec<_> = keys
            .iter()
            .map(|k| (k.date.as_str(), k.expires_at))
            .collect();
        assert_eq!(
            dates,
            [("20150830", 1_440_979_200), ("20150831", 1_441_065_600)]
        );
    }

    #[test]
    fn bad_keys_are_refused_by_name() {
        let mut k = key(None);
        k.access_key_id = "AKID\nX".into();
        assert!(
            k.check()
                .unwrap_err()
                .to_string()
                .contains("aws-access-key-id")
        );
        let mut k = key(Some("a b"));
        assert!(
            k.check()
                .unwrap_err()
                .to_string()
                .contains("aws-session-token")
        );
        k.session_token = None;
        k.secret_access_key = SecretString::from("");
        assert!(
            k.check()
                .unwrap_err()
                .to_string()
                .contains("aws-secret-access-key")
        );
        assert!(key(Some("tok")).check().is_ok());
    }
}
