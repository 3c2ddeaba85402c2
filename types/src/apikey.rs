//! API key format: `sk-oai-{key_id}_{secret}`.
//!
//! `key_id` is base62 of 12 random bytes, `secret` base62 of 32 random bytes, both left-padded
//! with `0` to a fixed width (17 and 43 characters) so the shape can be checked exactly without
//! asking anyone. Stored and compared: hex SHA-256 of `key_id + "\0" + secret`.

use sha2::{Digest, Sha256};

pub const KEY_PREFIX: &str = "sk-oai-";
/// base62 width of 12 bytes (62^17 > 2^96).
pub const KEY_ID_LEN: usize = 17;
/// base62 width of 32 bytes (62^43 > 2^256).
pub const SECRET_LEN: usize = 43;
pub const KEY_ID_BYTES: usize = 12;
pub const SECRET_BYTES: usize = 32;
/// Length of a well-formed key: prefix + key_id + `_` + secret.
pub const KEY_LEN: usize = KEY_PREFIX.len() + KEY_ID_LEN + 1 + SECRET_LEN;

const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// The two halves of a well-formed key, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiKeyParts<'a> {
    pub key_id: &'a str,
    pub secret: &'a str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFormatError {
    /// Does not start with `sk-oai-`: not an API key at all (maybe a cluster token).
    NotAnApiKey,
    /// Starts with `sk-oai-` but is not `{17 base62}_{43 base62}`.
    Malformed,
}

impl std::fmt::Display for KeyFormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyFormatError::NotAnApiKey => f.write_str("not an API key"),
            KeyFormatError::Malformed => f.write_str("invalid key format"),
        }
    }
}

impl std::error::Error for KeyFormatError {}

/// True when `s` starts with the API key prefix (so it must be a well-formed key or nothing).
pub fn has_key_prefix(s: &str) -> bool {
    s.starts_with(KEY_PREFIX)
}

fn is_base62(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Checks the exact shape and splits the key. Never allocates.
pub fn parse(key: &str) -> Result<ApiKeyParts<'_>, KeyFormatError> {
    let Some(rest) = key.strip_prefix(KEY_PREFIX) else {
        return Err(KeyFormatError::NotAnApiKey);
    };
    if rest.len() != KEY_ID_LEN + 1 + SECRET_LEN {
        return Err(KeyFormatError::Malformed);
    }
    let (key_id, tail) = rest
        .split_at_checked(KEY_ID_LEN)
        .ok_or(KeyFormatError::Malformed)?;
    let secret = tail.strip_prefix('_').ok_or(KeyFormatError::Malformed)?;
    if !is_base62(key_id) || !is_base62(secret) {
        return Err(KeyFormatError::Malformed);
    }
    Ok(ApiKeyParts { key_id, secret })
}

/// True when `key_id` alone has the shape of a key id (17 base62 characters).
pub fn is_key_id(key_id: &str) -> bool {
    key_id.len() == KEY_ID_LEN && is_base62(key_id)
}

/// Hex SHA-256 of `key_id + "\0" + secret`: the only form a key is stored in.
pub fn hash(parts: ApiKeyParts<'_>) -> String {
    hex::encode(hash_bytes(parts))
}

/// Raw SHA-256 of `key_id + "\0" + secret` (the filter keeps these 32 bytes in its cache).
pub fn hash_bytes(parts: ApiKeyParts<'_>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(parts.key_id.as_bytes());
    h.update([0u8]);
    h.update(parts.secret.as_bytes());
    h.finalize().into()
}

/// `sk-oai-` + first 12 characters of the key id + `...` (shown in listings, never enough to use).
pub fn display_prefix(key_id: &str) -> String {
    let head: String = key_id.chars().take(12).collect();
    format!("{KEY_PREFIX}{head}...")
}

/// Base62 of `bytes` as a big-endian number, left-padded with `0` to `width`.
pub fn base62_fixed(bytes: &[u8], width: usize) -> String {
    // Repeated division of the big-endian number by 62.
    let mut num: Vec<u8> = bytes.to_vec();
    let mut digits: Vec<u8> = Vec::with_capacity(width);
    while num.iter().any(|&b| b != 0) {
        let mut rem: u32 = 0;
        for byte in num.iter_mut() {
            let acc = (rem << 8) | u32::from(*byte);
            *byte = (acc / 62) as u8;
            rem = acc % 62;
        }
        digits.push(ALPHABET[rem as usize]);
    }
    while digits.len() < width {
        digits.push(b'0');
    }
    digits.reverse();
    String::from_utf8(digits).unwrap_or_default()
}

/// Builds the plaintext key from its random bytes (the companion draws them from a CSPRNG).
pub fn format_key(
    key_id_bytes: &[u8; KEY_ID_BYTES],
    secret_bytes: &[u8; SECRET_BYTES],
) -> (String, String) {
    let key_id = base62_fixed(key_id_bytes, KEY_ID_LEN);
    let secret = base62_fixed(secret_bytes, SECRET_LEN);
    let key = format!("{KEY_PREFIX}{key_id}_{secret}");
    (key_id, key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn extremes_fit_fixed_width() {
        assert_eq!(base62_fixed(&[0u8; 12], KEY_ID_LEN), "0".repeat(17));
        assert_eq!(base62_fixed(&[0xffu8; 12], KEY_ID_LEN).len(), KEY_ID_LEN);
        assert_eq!(base62_fixed(&[0xffu8; 32], SECRET_LEN).len(), SECRET_LEN);
        assert_eq!(base62_fixed(&[1], 3), "001");
        assert_eq!(base62_fixed(&[62], 3), "010");
    }

    #[test]
    fn parse_accepts_formatted_and_rejects_shapes() {
        let (key_id, key) = format_key(&[7u8; 12], &[9u8; 32]);
        let parts = parse(&key).unwrap();
        assert_eq!(parts.key_id, key_id);
        assert_eq!(key.len(), KEY_LEN);
        assert_eq!(parse("Bearer-ish"), Err(KeyFormatError::NotAnApiKey));
        assert_eq!(parse("sk-oai-"), Err(KeyFormatError::Malformed));
        assert_eq!(parse("sk-oai-abc_def"), Err(KeyFormatError::Malformed));
        let no_sep = key.replace('_', "x");
        assert_eq!(parse(&no_sep), Err(KeyFormatError::Malformed));
        let bad_char = format!("{}!", &key[..key.len() - 1]);
        assert_eq!(parse(&bad_char), Err(KeyFormatError::Malformed));
    }

    #[test]
    fn hash_is_sha256_of_id_nul_secret() {
        let parts = ApiKeyParts {
            key_id: "abc",
            secret: "def",
        };
        // sha256("abc\0def")
        let expected = {
            let mut h = Sha256::new();
            h.update(b"abc\0def");
            hex::encode(h.finalize())
        };
        assert_eq!(hash(parts), expected);
        assert_eq!(
            display_prefix("0123456789ABCDEFG"),
            "sk-oai-0123456789AB..."
        );
    }

    proptest! {
        #[test]
        fn roundtrip(id in proptest::array::uniform12(any::<u8>()), secret in proptest::array::uniform32(any::<u8>())) {
            let (key_id, key) = format_key(&id, &secret);
            let parts = parse(&key).unwrap();
            prop_assert_eq!(parts.key_id, key_id.as_str());
            prop_assert!(is_key_id(parts.key_id));
        }

        #[test]
        fn parse_never_panics(s in ".{0,80}") {
            let _ = parse(&s);
        }

        #[test]
        fn distinct_inputs_distinct_keys(a in proptest::array::uniform32(any::<u8>()), b in proptest::array::uniform32(any::<u8>())) {
            prop_assume!(a != b);
            prop_assert_ne!(base62_fixed(&a, SECRET_LEN), base62_fixed(&b, SECRET_LEN));
        }
    }
}
