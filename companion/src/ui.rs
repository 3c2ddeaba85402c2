//! The self-service web UI (`ui/`, a React single-page app built into `ui/dist`), served on the
//! public listener under `/ui/` (through the Gateway: `/maas-api/ui/`) from the directory given
//! by `--ui-dir` (`MAAS_UI_DIR`).
//!
//! - `/ui` redirects to `/ui/` (relative `Location`, so it works behind the Gateway's prefix).
//! - A path whose last segment has a dot is a file of the build (`assets/index-<hash>.js`,
//!   `favicon.svg`): served as is with its content type, or a JSON 404 when absent.
//! - Any other path is a client route of the app (`/ui/keys`, `/ui/usage`): `index.html`.
//! - Every answer carries a `Content-Security-Policy` allowing scripts, styles and requests
//!   from this origin only, and `nosniff`; the hashed assets are cached for a year
//!   (`immutable`), everything else is revalidated (`no-cache`) so a new build shows at once.
//! - Without `--ui-dir`, `/ui/…` answers a JSON 404 with code `ui_not_installed`.

use crate::http::error_response;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, LOCATION, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
    X_FRAME_OPTIONS,
};
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use maas_types::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tower::ServiceExt;
use tower_http::services::{ServeDir, ServeFile};

/// Scripts, styles, images, fonts and API calls from this origin only; no plugins, no framing,
/// no `<base>` pointing elsewhere, forms post here only.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; \
frame-ancestors 'none'";

/// Hashed build output (`vite build` names them `assets/<name>-<hash>.<ext>`).
const IMMUTABLE: &str = "public, max-age=31536000, immutable";
/// `index.html` and unhashed files: always revalidated.
const REVALIDATE: &str = "no-cache";

/// What a path under `/ui/` is.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// A client route of the app: answer `index.html`.
    Index,
    /// A file of the build, relative to the UI directory.
    File(String),
    /// Nothing we serve (`..`, hidden files, empty segments).
    NotFound,
}

/// Classifies `rest`, the path after `/ui/` (without query, still percent-encoded).
fn classify(rest: &str) -> Target {
    let (path, trailing_slash) = match rest.strip_suffix('/') {
        Some(p) => (p, true),
        None => (rest, false),
    };
    if path.is_empty() || path == "index.html" {
        return Target::Index;
    }
    let bad = |s: &str| s.is_empty() || s.starts_with('.') || s.contains(['\\', '%']);
    if path.split('/').any(bad) {
        return Target::NotFound;
    }
    match path.rsplit('/').next() {
        Some(last) if last.contains('.') && trailing_slash => Target::NotFound,
        Some(last) if last.contains('.') => Target::File(path.to_string()),
        _ => Target::Index,
    }
}

fn not_installed() -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "the web UI is not installed on this server (start the companion with --ui-dir)",
        ErrorKind::InvalidRequest,
        Some("ui_not_installed"),
    )
}

fn not_found() -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "no such file in the web UI",
        ErrorKind::InvalidRequest,
        Some("not_found"),
    )
}

/// The security headers every UI answer carries, and its cache policy.
fn decorate(mut resp: Response, cache: &'static str) -> Response {
    let h = resp.headers_mut();
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    if resp.status().is_success() || resp.status() == StatusCode::NOT_MODIFIED {
        resp.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static(cache));
    }
    resp
}

async fn serve(State(dir): State<Option<Arc<PathBuf>>>, req: Request) -> Response {
    let Some(dir) = dir else {
        return not_installed();
    };
    let rest = req
        .uri()
        .path()
        .strip_prefix("/ui/")
        .unwrap_or_default()
        .to_string();
    match classify(&rest) {
        Target::NotFound => not_found(),
        Target::Index => {
            let (mut parts, body) = req.into_parts();
            parts.uri = Uri::from_static("/index.html");
            let req = Request::from_parts(parts, body);
            match ServeFile::new(dir.join("index.html")).oneshot(req).await {
                Ok(r) if r.status() == StatusCode::NOT_FOUND => not_found(),
                Ok(r) => decorate(r.map(axum::body::Body::new), REVALIDATE),
                Err(never) => match never {},
            }
        }
        Target::File(file) => {
            let cache = if file.starts_with("assets/") {
                IMMUTABLE
            } else {
                REVALIDATE
            };
            let (mut parts, body) = req.into_parts();
            match format!("/{file}").parse::<Uri>() {
                Ok(uri) => parts.uri = uri,
                Err(_) => return not_found(),
            }
            let req = Request::from_parts(parts, body);
            match ServeDir::new(dir.as_path())
                .append_index_html_on_directories(false)
                .oneshot(req)
                .await
            {
                Ok(r) if r.status() == StatusCode::NOT_FOUND => not_found(),
                Ok(r) => decorate(r.map(axum::body::Body::new), cache),
                Err(never) => match never {},
            }
        }
    }
}

/// `/ui` → `/ui/`, relative so that it holds behind the Gateway's `/maas-api` prefix.
async fn to_slash(State(dir): State<Option<Arc<PathBuf>>>) -> Response {
    if dir.is_none() {
        return not_installed();
    }
    (StatusCode::PERMANENT_REDIRECT, [(LOCATION, "ui/")]).into_response()
}

/// The UI's routes, serving `dir` (`None`: every path answers `ui_not_installed`).
pub fn router<S: Clone + Send + Sync + 'static>(dir: Option<&Path>) -> Router<S> {
    let dir = dir.map(|d| Arc::new(d.to_path_buf()));
    Router::new()
        .route("/ui", get(to_slash))
        .route("/ui/", get(serve))
        .route("/ui/{*rest}", get(serve))
        .with_state(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    #[test]
    fn paths_are_client_routes_files_or_nothing() {
        assert_eq!(classify(""), Target::Index);
        assert_eq!(classify("keys"), Target::Index);
        assert_eq!(classify("keys/"), Target::Index);
        assert_eq!(classify("admin/users"), Target::Index);
        assert_eq!(
            classify("assets/index-AbC123.js"),
            Target::File("assets/index-AbC123.js".into())
        );
        assert_eq!(classify("favicon.svg"), Target::File("favicon.svg".into()));
        for bad in [
            "../secret.txt",
            "assets/../../etc/passwd",
            ".env",
            "assets/.hidden.js",
            "a//b.js",
            "%2e%2e/x.js",
            "assets\\x.js",
        ] {
            assert_eq!(classify(bad), Target::NotFound, "{bad}");
        }
    }

    /// `<tmp>/ui` holding a build, and `<tmp>/outside.txt` beside it that must stay unreachable.
    fn ui_dir() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("outside.txt"), "secret").unwrap();
        let d = root.path().join("ui");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(
            d.join("index.html"),
            "<!doctype html><title>MaaS</title><script type=module src=./assets/app-1a2b.js></script>",
        )
        .unwrap();
        std::fs::create_dir(d.join("assets")).unwrap();
        std::fs::write(d.join("assets/app-1a2b.js"), "console.log(1)").unwrap();
        std::fs::write(d.join("assets/app-1a2b.css"), "body{}").unwrap();
        std::fs::write(d.join("favicon.svg"), "<svg/>").unwrap();
        root
    }

    fn app(root: &tempfile::TempDir) -> Router {
        router(Some(&root.path().join("ui")))
    }

    async fn get_path(app: &Router, path: &str) -> (Response, String) {
        let r = app
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let (parts, body) = r.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        (
            Response::from_parts(parts, Body::empty()),
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    fn header<'a>(r: &'a Response, name: &str) -> &'a str {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    #[tokio::test]
    async fn the_app_and_its_client_routes_answer_index_html_revalidated_with_a_strict_csp() {
        let d = ui_dir();
        let app = app(&d);
        for path in [
            "/ui/",
            "/ui/keys",
            "/ui/usage?from=2026-12-01",
            "/ui/admin/",
        ] {
            let (r, body) = get_path(&app, path).await;
            assert_eq!(r.status(), StatusCode::OK, "{path}");
            assert!(body.contains("<title>MaaS</title>"), "{path}: {body}");
            assert!(
                header(&r, "content-type").starts_with("text/html"),
                "{path}"
            );
            assert_eq!(header(&r, "cache-control"), "no-cache", "{path}");
            let csp = header(&r, "content-security-policy");
            assert!(csp.contains("script-src 'self';"), "{csp}");
            assert!(!csp.contains("unsafe"), "{csp}");
            assert_eq!(header(&r, "x-content-type-options"), "nosniff");
        }
    }

    #[tokio::test]
    async fn hashed_assets_are_served_with_their_type_and_cached_for_a_year() {
        let d = ui_dir();
        let app = app(&d);
        let (r, body) = get_path(&app, "/ui/assets/app-1a2b.js").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(body, "console.log(1)");
        assert!(header(&r, "content-type").contains("javascript"));
        assert_eq!(
            header(&r, "cache-control"),
            "public, max-age=31536000, immutable"
        );
        let (r, _) = get_path(&app, "/ui/assets/app-1a2b.css").await;
        assert!(header(&r, "content-type").starts_with("text/css"));
        let (r, _) = get_path(&app, "/ui/favicon.svg").await;
        assert!(header(&r, "content-type").starts_with("image/svg+xml"));
        assert_eq!(header(&r, "cache-control"), "no-cache");
    }

    #[tokio::test]
    async fn a_missing_file_or_a_way_out_of_the_directory_is_a_json_404_not_the_app() {
        let d = ui_dir();
        let app = app(&d);
        for path in [
            "/ui/assets/missing-0000.js",
            "/ui/../outside.txt",
            "/ui/%2e%2e/outside.txt",
            "/ui/assets/%2e%2e/%2e%2e/outside.txt",
            "/ui/.hidden.txt",
            "/ui/favicon.svg/",
        ] {
            let (r, body) = get_path(&app, path).await;
            assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
            assert!(header(&r, "content-type").starts_with("application/json"));
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "not_found", "{path}");
        }
    }

    #[tokio::test]
    async fn ui_without_a_slash_redirects_relatively_so_the_gateway_prefix_is_kept() {
        let d = ui_dir();
        let app = app(&d);
        let (r, _) = get_path(&app, "/ui").await;
        assert_eq!(r.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(header(&r, "location"), "ui/");
    }

    #[tokio::test]
    async fn without_a_ui_directory_every_ui_path_is_a_json_404_ui_not_installed() {
        let app: Router = router(None);
        for path in ["/ui", "/ui/", "/ui/keys", "/ui/assets/app.js"] {
            let (r, body) = get_path(&app, path).await;
            assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "ui_not_installed", "{path}");
            assert_eq!(v["error"]["type"], "invalid_request_error");
        }
    }

    #[tokio::test]
    async fn a_conditional_request_for_an_asset_gets_304() {
        let d = ui_dir();
        let app = app(&d);
        let (r, _) = get_path(&app, "/ui/assets/app-1a2b.js").await;
        let modified = header(&r, "last-modified").to_string();
        assert!(!modified.is_empty());
        let r = app
            .clone()
            .oneshot(
                Request::get("/ui/assets/app-1a2b.js")
                    .header("if-modified-since", modified)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
    }
}
