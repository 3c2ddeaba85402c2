//! Which credential a request carries: `Authorization: Bearer …` or `x-api-key`.
//!
//! One rule for the filter and the companion's public API: the `Bearer` scheme is matched
//! case-insensitively, spaces and tabs around the scheme and the value are ignored, both headers
//! may be sent only when they carry the same value (different values are a conflict, 400), any
//! other scheme is refused (401), and a credential is visible ASCII. A value with the API key
//! prefix must be a well-formed key. The credential is only borrowed from the header value.

use crate::apikey::{self, ApiKeyParts, KeyFormatError};
use crate::error_body::ErrorKind;

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

impl<'a> Credential<'a> {
    /// The credential as sent.
    pub fn raw(&self) -> &'a str {
        match self {
            Credential::ApiKey { raw, .. } => raw,
            Credential::Token(t) => t,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialError {
    /// No credential header at all (401).
    Missing,
    /// `Authorization` with a scheme other than Bearer (401).
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
    pub fn status(&self) -> u16 {
        match self {
            CredentialError::InvalidCharacters | CredentialError::Conflicting => 400,
            _ => 401,
        }
    }

    /// The OpenAI error type that goes with [`CredentialError::status`].
    pub fn kind(&self) -> ErrorKind {
        if self.status() == 400 {
            ErrorKind::InvalidRequest
        } else {
            ErrorKind::Authentication
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

impl std::fmt::Display for CredentialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for CredentialError {}

fn trim_blanks(v: &str) -> &str {
    v.trim_matches(|c| c == ' ' || c == '\t')
}

fn bearer_value(authorization: &str) -> Result<&str, CredentialError> {
    let v = trim_blanks(authorization);
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
    Ok(trim_blanks(rest))
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
    let from_key = x_api_key.map(trim_blanks);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> String {
        apikey::format_key(&[1u8; 12], &[2u8; 32]).1
    }

    #[test]
    fn bearer_in_any_case_with_extra_blanks_gives_the_value() {
        for header in [
            "Bearer tok",
            "bearer tok",
            "BEARER tok",
            "  Bearer \t tok  ",
            "Bearer  tok\t",
        ] {
            assert_eq!(
                extract(Some(header), None),
                Ok(Credential::Token("tok")),
                "{header:?}"
            );
        }
    }

    #[test]
    fn an_api_key_is_recognised_in_either_header() {
        let k = key();
        let auth = format!("Bearer {k}");
        let c = extract(Some(&auth), None).unwrap();
        assert!(matches!(c, Credential::ApiKey { .. }));
        assert_eq!(c.raw(), k);
        assert_eq!(extract(None, Some(&k)).unwrap().raw(), k);
        assert_eq!(extract(None, Some(&format!(" {k} "))).unwrap().raw(), k);
    }

    #[test]
    fn both_headers_must_carry_the_same_value() {
        let k = key();
        let auth = format!("Bearer {k}");
        assert_eq!(extract(Some(&auth), Some(&k)).unwrap().raw(), k);
        let conflict = extract(Some(&auth), Some("other"));
        assert_eq!(conflict, Err(CredentialError::Conflicting));
        assert_eq!(CredentialError::Conflicting.status(), 400);
        assert_eq!(
            CredentialError::Conflicting.kind(),
            ErrorKind::InvalidRequest
        );
    }

    #[test]
    fn another_scheme_is_refused_not_replaced_by_x_api_key() {
        assert_eq!(
            extract(Some("Basic dXNlcjpw"), None),
            Err(CredentialError::UnsupportedScheme)
        );
        assert_eq!(
            extract(Some("Basic dXNlcjpw"), Some("tok")),
            Err(CredentialError::UnsupportedScheme)
        );
        assert_eq!(CredentialError::UnsupportedScheme.status(), 401);
        assert_eq!(
            CredentialError::UnsupportedScheme.kind(),
            ErrorKind::Authentication
        );
    }

    #[test]
    fn refusals() {
        assert_eq!(extract(None, None), Err(CredentialError::Missing));
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
        assert_eq!(CredentialError::MalformedApiKey.status(), 401);
        assert_eq!(
            CredentialError::Missing.to_string(),
            CredentialError::Missing.message()
        );
    }

    proptest::proptest! {
        #[test]
        fn extract_never_panics_and_yields_visible_ascii(a in proptest::option::of(".{0,80}"), k in proptest::option::of(".{0,80}")) {
            if let Ok(c) = extract(a.as_deref(), k.as_deref()) {
                proptest::prop_assert!(c.raw().bytes().all(|b| b > b' ' && b < 0x7f));
            }
        }
    }
}
