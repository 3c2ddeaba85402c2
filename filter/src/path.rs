//! Request path checks: what kind of request this is, and paths refused before anything else.

/// What a request path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathClass<'a> {
    /// Under the management prefix (public key-management API): no model enforcement.
    Management,
    /// A path that may name a model (query stripped); the policy decides.
    Model(&'a str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// Not a normalized absolute path (400).
    Invalid(&'static str),
    /// Companion internal paths through the gateway (404).
    Internal,
}

impl PathError {
    pub fn status(&self) -> u32 {
        match self {
            PathError::Invalid(_) => 400,
            PathError::Internal => 404,
        }
    }

    pub fn message(&self) -> &'static str {
        match self {
            PathError::Invalid(m) => m,
            PathError::Internal => "not found",
        }
    }
}

/// `rest` equals `prefix` or continues it at a segment boundary, ASCII case-insensitively.
fn under_ci(path: &str, prefix: &str) -> bool {
    path.len() >= prefix.len()
        && path
            .get(..prefix.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
        && matches!(path.as_bytes().get(prefix.len()), None | Some(b'/'))
}

fn has_encoded_separator(path: &str) -> bool {
    let b = path.as_bytes();
    b.windows(3).any(|w| {
        matches!(w, [b'%', hi, lo] if matches!(
            (hi.to_ascii_uppercase(), lo.to_ascii_uppercase()),
            (b'2', b'F') | (b'2', b'E') | (b'5', b'C') | (b'0', b'0')
        ))
    })
}

/// Classifies `:path` (with its query). Checks come first so that no later decision sees an
/// ambiguous path.
pub fn classify<'a>(
    full_path: &'a str,
    management_prefix: &str,
) -> Result<PathClass<'a>, PathError> {
    let path = match full_path.find('?') {
        Some(i) => full_path.get(..i).unwrap_or(""),
        None => full_path,
    };
    if !path.starts_with('/') {
        return Err(PathError::Invalid("path must be absolute"));
    }
    if path.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
        return Err(PathError::Invalid("path holds invalid characters"));
    }
    if path.contains('\\') || path.contains(';') || path.contains('#') {
        return Err(PathError::Invalid("path holds '\\', ';' or '#'"));
    }
    if path.contains("//") {
        return Err(PathError::Invalid("path holds an empty segment"));
    }
    if path.split('/').any(|s| s == "." || s == "..") {
        return Err(PathError::Invalid("path holds a '.' or '..' segment"));
    }
    if has_encoded_separator(path) {
        return Err(PathError::Invalid(
            "path holds an encoded '/', '.', '\\' or NUL",
        ));
    }
    if under_ci(path, "/internal") {
        return Err(PathError::Internal);
    }
    if under_ci(path, management_prefix) {
        let rest = path.get(management_prefix.len()..).unwrap_or("");
        if under_ci(rest, "/internal") {
            return Err(PathError::Internal);
        }
        if path.starts_with(management_prefix) {
            return Ok(PathClass::Management);
        }
    }
    Ok(PathClass::Model(path))
}

/// True for model discovery (`<model prefix>/v1/models[/…]`): authenticated, never token-limited.
pub fn is_discovery(path: &str, model_prefix: &str) -> bool {
    path.strip_prefix(model_prefix)
        .and_then(|rest| rest.strip_prefix("/v1/models"))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "/maas-api";

    #[test]
    fn classes() {
        assert_eq!(
            classify("/maas-api/v1/api-keys", P),
            Ok(PathClass::Management)
        );
        assert_eq!(classify("/maas-api", P), Ok(PathClass::Management));
        assert_eq!(
            classify("/llm/sim/v1/chat/completions?x=1", P),
            Ok(PathClass::Model("/llm/sim/v1/chat/completions"))
        );
        assert_eq!(
            classify("/maas-apix/v1", P),
            Ok(PathClass::Model("/maas-apix/v1"))
        );
        assert_eq!(
            classify("/query?a=//../;", P),
            Ok(PathClass::Model("/query"))
        );
    }

    #[test]
    fn internal_is_404_in_any_case() {
        for p in [
            "/internal/v1/authenticate",
            "/internal",
            "/Internal/v1/policy",
            "/maas-api/internal/v1/policy",
            "/maas-api/INTERNAL",
            "/MAAS-API/internal/v1/credentials",
        ] {
            assert_eq!(classify(p, P), Err(PathError::Internal), "{p}");
        }
        assert_eq!(
            classify("/internalx", P),
            Ok(PathClass::Model("/internalx"))
        );
    }

    #[test]
    fn ambiguous_paths_are_400() {
        for p in [
            "llm/sim",
            "/llm//sim",
            "/llm/./sim",
            "/llm/../internal/v1/policy",
            "/llm/sim/..",
            "/llm%2Fsim",
            "/llm%2fsim",
            "/llm/%2E%2E/x",
            "/llm/sim;x",
            "/llm\\sim",
            "/llm/s\u{e9}m",
            "/llm/ sim",
            "/maas-api/%2e%2e/internal",
        ] {
            let r = classify(p, P);
            assert!(matches!(r, Err(PathError::Invalid(_))), "{p}: {r:?}");
            assert_eq!(r.unwrap_err().status(), 400);
        }
    }

    #[test]
    fn discovery() {
        assert!(is_discovery("/llm/sim/v1/models", "/llm/sim"));
        assert!(is_discovery("/llm/sim/v1/models/sim", "/llm/sim"));
        assert!(!is_discovery("/llm/sim/v1/modelsx", "/llm/sim"));
        assert!(!is_discovery("/llm/sim/v1/chat/completions", "/llm/sim"));
    }

    proptest::proptest! {
        #[test]
        fn classify_never_panics_and_model_paths_are_clean(p in "[ -~]{0,40}") {
            if let Ok(PathClass::Model(m)) = classify(&p, P) {
                proptest::prop_assert!(m.starts_with('/'));
                proptest::prop_assert!(!m.contains("//") && !m.contains("/../") && !m.contains("/./"));
                let lower = m.to_ascii_lowercase();
                proptest::prop_assert!(lower != "/internal" && !lower.starts_with("/internal/"));
            }
        }
    }
}
