#![allow(clippy::indexing_slicing, clippy::panic, clippy::unwrap_used)]
//! Guard for issue 10 item 3: in the proxy-wasm glue, a request whose state cannot be read
//! (a `RefCell` already borrowed, no configuration) is refused, never let through. The glue is
//! compiled for wasm32 only, so this reads its source: every request-side callback's error arm
//! must refuse. (Native tests of the request's life come with the host seam, issue 11.)

use std::path::Path;

fn glue() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/glue.rs");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The body of `fn name(` up to the next `fn ` at the same indentation.
fn function<'a>(src: &'a str, name: &str) -> &'a str {
    let start = src
        .find(&format!("fn {name}("))
        .unwrap_or_else(|| panic!("glue has no fn {name}"));
    let rest = &src[start..];
    let end = rest[3..].find("\n    fn ").map_or(rest.len(), |i| i + 3);
    &rest[..end]
}

#[test]
fn request_callbacks_refuse_when_state_cannot_be_read() {
    let src = glue();
    for name in [
        "on_http_request_headers",
        "on_http_request_body",
        "on_http_request_trailers",
    ] {
        let f = function(&src, name);
        assert!(
            f.contains("Err(_) => refuse_undecidable()"),
            "{name} must refuse when the request state is busy:\n{f}"
        );
        assert!(
            !f.contains("Err(_) => Action::Continue"),
            "{name} lets a request through when it cannot decide:\n{f}"
        );
    }
    let body = function(&src, "on_body");
    assert!(
        !body
            .contains("let Some(cfg) = self.config() else {\n            return Action::Continue;"),
        "on_body lets a body through without configuration:\n{body}"
    );
    let refuse = function(&src, "refuse_undecidable");
    assert!(refuse.contains("send_http_response"), "{refuse}");
    assert!(refuse.contains("Action::Pause"), "{refuse}");
}

#[test]
fn request_trailers_are_decided() {
    let src = glue();
    let f = function(&src, "on_trailers");
    assert!(f.contains("self.end_of_body()"), "{f}");
}
