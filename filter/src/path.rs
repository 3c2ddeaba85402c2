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

/// What one pass over a path finds; the rules are then applied in their order, so a path
/// breaking several gets the same refusal whatever their positions.
#[allow(clippy::struct_excessive_bools)] // independent findings of one pass, each its own refusal
#[derive(Debug, Default, PartialEq, Eq)]
struct Findings {
    /// A byte outside visible ASCII.
    invalid_byte: bool,
    /// `\`, `;` or `#`.
    separator: bool,
    /// `//`.
    empty_segment: bool,
    /// A `.` or `..` segment.
    dot_segment: bool,
    /// `%2F`, `%2E`, `%5C` or `%00` (any case).
    encoded_separator: bool,
}

fn is_dot_segment(segment: &[u8]) -> bool {
    matches!(segment, b"." | b"..")
}

fn is_encoded_separator(hex: &[u8]) -> bool {
    matches!(hex, [hi, lo] if matches!(
        (hi.to_ascii_uppercase(), lo.to_ascii_uppercase()),
        (b'2', b'F') | (b'2', b'E') | (b'5', b'C') | (b'0', b'0')
    ))
}

fn scan(path: &[u8]) -> Findings {
    let mut f = Findings::default();
    let mut segment_start = 0usize;
    let mut previous = 0u8;
    for (i, &b) in path.iter().enumerate() {
        f.invalid_byte |= !(0x21..=0x7e).contains(&b);
        match b {
            b'\\' | b';' | b'#' => f.separator = true,
            b'/' => {
                f.empty_segment |= previous == b'/';
                f.dot_segment |= is_dot_segment(path.get(segment_start..i).unwrap_or_default());
                segment_start = i.saturating_add(1);
            }
            b'%' => {
                let hex = path.get(i.saturating_add(1)..i.saturating_add(3));
                f.encoded_separator |= is_encoded_separator(hex.unwrap_or_default());
            }
            _ => {}
        }
        previous = b;
    }
    f.dot_segment |= is_dot_segment(path.get(segment_start..).unwrap_or_default());
    f
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
    // One pass over the path for every check below.
    let found = scan(path.as_bytes());
    if found.invalid_byte {
        return Err(PathError::Invalid("path holds invalid characters"));
    }
    if found.separator {
        return Err(PathError::Invalid("path holds '\\', ';' or '#'"));
    }
    if found.empty_segment {
        return Err(PathError::Invalid("path holds an empty segment"));
    }
    if found.dot_segment {
        return Err(PathError::Invalid("path holds a '.' or '..' segment"));
    }
    if found.encoded_separator {
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

#[cfg(test)]
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

    /// The checks as they were written first, one pass each: the single pass must agree.
    fn classify_by_each_rule<'a>(
        full_path: &'a str,
        management_prefix: &str,
    ) -> Result<PathClass<'a>, PathError> {
        let path = match full_path.find('?') {
            Some(i) => &full_path[..i],
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
        let encoded = path.as_bytes().windows(3).any(|w| {
            matches!(w, [b'%', hi, lo] if matches!(
                (hi.to_ascii_uppercase(), lo.to_ascii_uppercase()),
                (b'2', b'F') | (b'2', b'E') | (b'5', b'C') | (b'0', b'0')
            ))
        });
        if encoded {
            return Err(PathError::Invalid(
                "path holds an encoded '/', '.', '\\' or NUL",
            ));
        }
        if under_ci(path, "/internal") {
            return Err(PathError::Internal);
        }
        if under_ci(path, management_prefix) {
            let rest = &path[management_prefix.len()..];
            if under_ci(rest, "/internal") {
                return Err(PathError::Internal);
            }
            if path.starts_with(management_prefix) {
                return Ok(PathClass::Management);
            }
        }
        Ok(PathClass::Model(path))
    }

    #[test]
    fn one_pass_finds_what_each_rule_finds() {
        for p in [
            "/",
            "/.",
            "/..",
            "/a/.",
            "/a/..",
            "/./a",
            "/a/.b",
            "/a/..b",
            "/...",
            "//",
            "/a//",
            "/%",
            "/%2",
            "/%2f",
            "/a%5c",
            "/%00",
            "/%2e%2E",
            "/a;b#c\\d",
            "/a b",
            "/\u{e9}",
            "/a/%2",
            "/a?/..",
            "/?%2F",
        ] {
            assert_eq!(classify(p, P), classify_by_each_rule(p, P), "{p:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn the_single_pass_agrees_with_each_rule(p in "[/.%;#?\\\\ a-zA-Z0-9\u{e9}\u{0}]{0,24}") {
            proptest::prop_assert_eq!(classify(&p, P), classify_by_each_rule(&p, P));
        }

        #[test]
        fn the_single_pass_agrees_on_any_text(p in "\\PC{0,40}") {
            proptest::prop_assert_eq!(classify(&p, P), classify_by_each_rule(&p, P));
            let slash = format!("/{p}");
            proptest::prop_assert_eq!(classify(&slash, P), classify_by_each_rule(&slash, P));
        }

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
