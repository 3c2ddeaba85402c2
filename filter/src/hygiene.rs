//! Which request headers go and which provider credential comes in.

use maas_types::ProviderKind;

pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// True for a client header that must not reach a model backend: the user's credential and the
/// project's reserved namespace (`x-maas-*`), plus the configured extras (lower case).
pub fn strip_for_model(name: &str, extra: &[String]) -> bool {
    name.eq_ignore_ascii_case("authorization")
        || name.eq_ignore_ascii_case("x-api-key")
        || is_reserved(name)
        || extra.iter().any(|e| name.eq_ignore_ascii_case(e))
}

/// `x-maas-*`: never accepted from a client, on any path.
pub fn is_reserved(name: &str) -> bool {
    name.len() >= 7
        && name
            .get(..7)
            .is_some_and(|p| p.eq_ignore_ascii_case("x-maas-"))
}

/// True when a request body of this content type is buffered and read for `model` and
/// `max_tokens` (JSON, or unlabelled); uploads (multipart, audio, images, octet-stream) stream
/// through unread and reserve the tier default.
pub fn inspect_body(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else { return true };
    let ct = ct.trim_start();
    let starts = |p: &str| ct.get(..p.len()).is_some_and(|h| h.eq_ignore_ascii_case(p));
    !(starts("multipart/")
        || starts("audio/")
        || starts("image/")
        || starts("video/")
        || starts("application/octet-stream"))
}

/// Headers to set (replacing any value) for an external provider.
pub fn provider_headers(
    kind: ProviderKind,
    key: &str,
    client_sent_anthropic_version: bool,
) -> Vec<(&'static str, String)> {
    match kind {
        ProviderKind::Openai | ProviderKind::Vertex => {
            vec![("authorization", format!("Bearer {key}"))]
        }
        ProviderKind::Anthropic => {
            let mut h = vec![("x-api-key", key.to_string())];
            if !client_sent_anthropic_version {
                h.push(("anthropic-version", ANTHROPIC_VERSION.to_string()));
            }
            h
        }
        ProviderKind::AzureOpenai => vec![("api-key", key.to_string())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_credentials_reserved_and_extras() {
        let extra = vec!["cookie".to_string()];
        for h in [
            "Authorization",
            "x-api-key",
            "X-MaaS-Username",
            "x-maas-",
            "cookie",
            "COOKIE",
        ] {
            assert!(strip_for_model(h, &extra), "{h}");
        }
        for h in [
            "content-type",
            "x-maa",
            "x-request-id",
            "api-key",
            "anthropic-version",
        ] {
            assert!(!strip_for_model(h, &extra), "{h}");
        }
        assert!(is_reserved("X-MAAS-GROUP"));
        assert!(!is_reserved("x-maasx"));
    }

    #[test]
    fn which_bodies_are_read() {
        assert!(inspect_body(None));
        assert!(inspect_body(Some("application/json")));
        assert!(inspect_body(Some("text/plain")));
        assert!(!inspect_body(Some("multipart/form-data; boundary=x")));
        assert!(!inspect_body(Some("Audio/wav")));
        assert!(!inspect_body(Some("application/octet-stream")));
    }

    #[test]
    fn provider_credentials() {
        assert_eq!(
            provider_headers(ProviderKind::Openai, "k", false),
            vec![("authorization", "Bearer k".to_string())]
        );
        assert_eq!(
            provider_headers(ProviderKind::Vertex, "k", true),
            vec![("authorization", "Bearer k".to_string())]
        );
        assert_eq!(
            provider_headers(ProviderKind::Anthropic, "k", false),
            vec![
                ("x-api-key", "k".to_string()),
                ("anthropic-version", "2023-06-01".to_string())
            ]
        );
        assert_eq!(
            provider_headers(ProviderKind::Anthropic, "k", true),
            vec![("x-api-key", "k".to_string())]
        );
        assert_eq!(
            provider_headers(ProviderKind::AzureOpenai, "k", false),
            vec![("api-key", "k".to_string())]
        );
    }
}
