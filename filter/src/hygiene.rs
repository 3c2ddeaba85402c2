//! Which request headers go and which provider credential comes in.

use maas_types::{Provider, ProviderKind};

pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// `x-amz-*` in any spelling: a signed request's (Bedrock) are the gateway's own, never the
/// client's (a client's `x-amz-security-token` would stand beside the gateway's signature).
pub fn is_aws_signing_header(name: &str) -> bool {
    name.get(..6).is_some_and(|p| same_header(p, "x-amz-"))
}

/// True for a client header that must not reach a model backend: the user's credential and the
/// project's reserved namespace (`x-maas-*`), plus the configured extras (lower case) — in every
/// spelling a backend may take for them: ASCII case ignored and `_` read as `-` (CGI and WSGI
/// servers turn `x_maas_user` and `x-maas-user` alike into `HTTP_X_MAAS_USER`).
pub fn strip_for_model(name: &str, extra: &[String]) -> bool {
    is_credential(name) || is_reserved(name) || extra.iter().any(|e| same_header(name, e))
}

/// True for a header a management request must not carry: the reserved namespace in any
/// spelling, and a credential header spelt with `_` (the companion reads the credential from
/// `authorization` itself, which stays; an underscore spelling can only confuse a backend that
/// reads `_` as `-`).
pub fn strip_for_management(name: &str) -> bool {
    is_reserved(name) || (is_credential(name) && name.contains('_'))
}

/// `authorization` or `x-api-key`, in any spelling.
fn is_credential(name: &str) -> bool {
    same_header(name, "authorization") || same_header(name, "x-api-key")
}

/// `x-maas-*` in any spelling (`X_MAAS_USER`, `x-maas_groups`): never accepted from a client,
/// on any path.
pub fn is_reserved(name: &str) -> bool {
    name.get(..RESERVED_PREFIX.len())
        .is_some_and(|p| same_header(p, RESERVED_PREFIX))
}

const RESERVED_PREFIX: &str = "x-maas-";

/// Header names equal as a backend may read them: ASCII case ignored, `_` and `-` alike.
pub fn same_header(a: &str, b: &str) -> bool {
    let fold = |c: u8| match c {
        b'_' => b'-',
        c => c.to_ascii_lowercase(),
    };
    a.len() == b.len() && a.bytes().zip(b.bytes()).all(|(x, y)| fold(x) == fold(y))
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

/// The provider's own key header when the gateway authenticates with a token instead: removed,
/// so a client's copy never reaches the provider beside the gateway's token (Azure OpenAI reads
/// `api-key` before `Authorization`).
pub fn provider_removes(provider: &Provider) -> Option<&'static str> {
    (provider.auth.is_token() && provider.kind == ProviderKind::AzureOpenai).then_some("api-key")
}

/// A client's `api-key` (any spelling) to a provider that does not get the gateway's key in
/// it: removed with the client's other credentials (a header the provider, or an
/// Azure-compatible server behind it, may read as one). Costs nothing when not sent.
pub fn strip_for_provider(name: &str, provider: &Provider) -> bool {
    let gateway_sets_it = provider.kind == ProviderKind::AzureOpenai && !provider.auth.is_token();
    // Where the gateway sets it, only another spelling (`api_key`) would stay beside it.
    same_header(name, "api-key") && (!gateway_sets_it || name.contains('_'))
}

/// Headers to set (replacing any value) for an external provider: its key in the provider's
/// key header, or a short-lived access token (cloud credentials) as `Authorization: Bearer`.
pub fn provider_headers(
    provider: &Provider,
    key: &str,
    client_sent_anthropic_version: bool,
) -> Vec<(&'static str, String)> {
    if provider.auth.is_token() {
        return vec![("authorization", format!("Bearer {key}"))];
    }
    match provider.kind {
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
        // Signed once the body is final (`crate::sigv4`), not at the headers.
        ProviderKind::Bedrock => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maas_types::ProviderAuth;

    #[test]
    fn strips_credentials_reserved_and_extras() {
        let extra = vec!["cookie".to_string(), "x-debug-user".to_string()];
        for h in [
            "Authorization",
            "x-api-key",
            "X-MaaS-Username",
            "x-maas-",
            "cookie",
            "COOKIE",
            "x_debug_user",
        ] {
            assert!(strip_for_model(h, &extra), "{h}");
        }
        for h in [
            "content-type",
            "x-maa",
            "x-request-id",
            "api-key",
            "anthropic-version",
            "x_request_id",
            "x-debug-users",
        ] {
            assert!(!strip_for_model(h, &extra), "{h}");
        }
        assert!(is_reserved("X-MAAS-GROUP"));
        assert!(is_aws_signing_header("X_Amz_Security-Token"));
        assert!(is_aws_signing_header("x-amz-date"));
        assert!(!is_aws_signing_header("x-amzn-trace"));
        assert!(!is_reserved("x-maasx"));
    }

    /// Every spelling a CGI/WSGI backend reads as a reserved or credential header goes: `_` for
    /// `-` anywhere, any case (issue 26 item 5).
    #[test]
    fn underscore_and_case_spellings_are_the_same_header() {
        for h in [
            "x_maas_user",
            "X_MAAS_USER",
            "x-maas_groups",
            "x_maas-subject",
            "X_Maas_Subscription",
            "x_maas_",
        ] {
            assert!(is_reserved(h), "{h}");
            assert!(strip_for_model(h, &[]), "{h}");
            assert!(strip_for_management(h), "{h}");
        }
        for h in ["x_api_key", "X_API_KEY", "x-api_key", "X_Api-Key"] {
            assert!(strip_for_model(h, &[]), "{h}");
            assert!(strip_for_management(h), "{h}");
        }
        // The companion reads these itself on management paths: they stay there.
        for h in ["authorization", "Authorization", "x-api-key", "X-API-KEY"] {
            assert!(!strip_for_management(h), "{h}");
            assert!(strip_for_model(h, &[]), "{h}");
        }
        for h in [
            "x_maa",
            "xmaas_user",
            "x_maasuser",
            "x-request_id",
            "x_api_keys",
        ] {
            assert!(!strip_for_model(h, &[]), "{h}");
            assert!(!strip_for_management(h), "{h}");
        }
        assert!(same_header("X_A-b", "x-a_B"));
        assert!(!same_header("x-a", "x-ab"));
        // Non-ASCII is compared byte for byte, never folded.
        assert!(!same_header("x-maas-\u{e9}", "x-maas-\u{c9}"));
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

    fn p(kind: ProviderKind) -> Provider {
        Provider::api_key(kind, "ref".into())
    }

    #[test]
    fn a_clients_api_key_reaches_no_provider_but_azure_with_the_gateways_key_replacing_it() {
        let provider = |kind, auth| Provider {
            auth,
            ..Provider::api_key(kind, "k".into())
        };
        for (kind, auth) in [
            (ProviderKind::Openai, maas_types::ProviderAuth::ApiKey),
            (
                ProviderKind::Vertex,
                maas_types::ProviderAuth::GcpServiceAccount,
            ),
            (ProviderKind::Anthropic, maas_types::ProviderAuth::ApiKey),
            (
                ProviderKind::AzureOpenai,
                maas_types::ProviderAuth::AzureClientCredentials,
            ),
        ] {
            for name in ["api-key", "API-Key", "api_key"] {
                assert!(
                    strip_for_provider(name, &provider(kind, auth)),
                    "{kind:?} {name}"
                );
            }
            assert!(!strip_for_provider("x-request-id", &provider(kind, auth)));
        }
        // Azure with a static key: the gateway's key replaces it (a set, not a removal); an
        // underscore spelling would stay beside it, so it goes.
        let azure = provider(ProviderKind::AzureOpenai, maas_types::ProviderAuth::ApiKey);
        assert!(!strip_for_provider("api-key", &azure));
        assert!(strip_for_provider("api_key", &azure));
    }

    #[test]
    fn provider_credentials() {
        assert_eq!(
            provider_headers(&p(ProviderKind::Openai), "k", false),
            vec![("authorization", "Bearer k".to_string())]
        );
        assert_eq!(
            provider_headers(&p(ProviderKind::Vertex), "k", true),
            vec![("authorization", "Bearer k".to_string())]
        );
        assert_eq!(
            provider_headers(&p(ProviderKind::Anthropic), "k", false),
            vec![
                ("x-api-key", "k".to_string()),
                ("anthropic-version", "2023-06-01".to_string())
            ]
        );
        assert_eq!(
            provider_headers(&p(ProviderKind::Anthropic), "k", true),
            vec![("x-api-key", "k".to_string())]
        );
        assert_eq!(
            provider_headers(&p(ProviderKind::AzureOpenai), "k", false),
            vec![("api-key", "k".to_string())]
        );
        // Cloud credentials: the access token as a bearer token, whatever the provider type.
        for (kind, auth) in [
            (
                ProviderKind::AzureOpenai,
                ProviderAuth::AzureClientCredentials,
            ),
            (ProviderKind::Vertex, ProviderAuth::GcpServiceAccount),
        ] {
            let provider = Provider { auth, ..p(kind) };
            assert_eq!(
                provider_headers(&provider, "tok", false),
                vec![("authorization", "Bearer tok".to_string())]
            );
        }
        let entra = Provider {
            auth: ProviderAuth::AzureClientCredentials,
            ..p(ProviderKind::AzureOpenai)
        };
        assert_eq!(provider_removes(&entra), Some("api-key"));
        assert_eq!(
            provider_removes(&p(ProviderKind::AzureOpenai)),
            None,
            "set instead"
        );
        assert_eq!(provider_removes(&p(ProviderKind::Openai)), None);
    }
}
