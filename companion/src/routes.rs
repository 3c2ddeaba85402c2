//! The three routers. The public listener serves the key-management API (routed by the
//! Gateway under `/maas-api`); the internal listener serves `/internal/*` for the filter (and
//! the cleanup job); the metrics listener serves `/metrics` (and `/health`) for Prometheus and
//! nothing else. `/metrics` is a 404 on the public and internal listeners: the public one is
//! reachable through the Gateway without authentication, and whoever may reach the internal
//! one can read the provider credentials, which a scraper must not.

use crate::keys::store::KeyStore;
use crate::leases::Leases;
use crate::state::AppState;
use crate::{
    authenticate, credentials, http, keys, leases, metrics, models, openapi, policy, telemetry, ui,
    usage,
};
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use maas_types::ErrorBody;
use std::sync::{Arc, LazyLock};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Request bodies larger than this are refused (413).
const BODY_LIMIT_BYTES: usize = 1024 * 1024;

#[utoipa::path(get, path = "/health", summary = "Liveness",
    responses((status = 200, description = "healthy"))
)]
async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "healthy"}))
}

/// Ready when migrations are applied and PostgreSQL answers. The lease store is reported, not
/// required: authentication keeps working without Redis (the filters fall back to local shares).
#[utoipa::path(get, path = "/ready", summary = "Readiness (PostgreSQL reachable, migrations applied)",
    responses(
        (status = 200, description = "ready"),
        (status = 503, description = "not ready", body = ErrorBody)
    )
)]
async fn ready(State(keys): State<KeyStore>, State(leases): State<Leases>) -> Response {
    if keys.is_ready().await {
        let reachable = leases.reachable().await;
        Json(serde_json::json!({
            "status": "ready",
            "leases": {"store": leases.store_kind(), "reachable": reachable},
        }))
        .into_response()
    } else {
        http::error_response(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "database unreachable",
            maas_types::ErrorKind::ServiceUnavailable,
            Some("not_ready"),
        )
    }
}

/// What every listener shares: JSON 404 and 405, request metrics labelled with the listener,
/// the body limit; on the public and internal listeners, when traces are exported, the
/// request's span (continuing the caller's trace context).
fn layers(router: Router<AppState>, state: &AppState, listener: &'static str) -> Router {
    let router = router
        .fallback(http::no_route)
        .layer(axum::middleware::from_fn(http::json_method_not_allowed))
        .layer(axum::middleware::from_fn_with_state(
            (state.metrics.clone(), listener),
            metrics::track,
        ));
    let router = if listener != "metrics" && telemetry::enabled() {
        router.layer(axum::middleware::from_fn(telemetry::http_span))
    } else {
        router
    };
    router
        .layer(DefaultBodyLimit::max(BODY_LIMIT_BYTES))
        .with_state(state.clone())
}

/// [`layers`] plus the probes, for the internal listener.
fn common_layers(router: Router<AppState>, state: &AppState, listener: &'static str) -> Router {
    let router = router
        .route("/health", get(health))
        .route("/ready", get(ready));
    layers(router, state, listener)
}

/// The public API with its description: each route is registered from its handler's
/// `#[utoipa::path]`, which also documents it.
fn public_api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::Frame::openapi())
        .routes(routes!(keys::api::create))
        .routes(routes!(keys::api::search))
        .routes(routes!(keys::api::bulk_revoke))
        .routes(routes!(keys::api::config))
        .routes(routes!(keys::api::get, keys::api::revoke))
        .routes(routes!(models::list))
        .routes(routes!(models::tiers))
        .routes(routes!(usage::api::usage))
        .routes(routes!(usage::api::quota))
        .routes(routes!(models::subscriptions))
        .routes(routes!(models::model_subscriptions))
        .routes(routes!(health))
        .routes(routes!(ready))
        .routes(routes!(openapi_json))
}

/// The description of the public API, built once.
static PUBLIC_API_DOC: LazyLock<Arc<utoipa::openapi::OpenApi>> =
    LazyLock::new(|| Arc::new(public_api().into_openapi()));

#[utoipa::path(get, path = "/openapi.json", summary = "This document",
    responses((status = 200, description = "OpenAPI document"))
)]
async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(PUBLIC_API_DOC.as_ref().clone())
}

/// The public API, and the web UI at `/ui/` (served from `ui_dir`; `None`: a JSON 404
/// `ui_not_installed`). The UI is not in the OpenAPI document: it is not an API.
pub fn public_router(state: &AppState, ui_dir: Option<&std::path::Path>) -> Router {
    let (router, _) = public_api().split_for_parts();
    layers(router.merge(ui::router(ui_dir)), state, "public")
}

pub fn internal_router(state: &AppState) -> Router {
    let router = Router::new()
        .route("/internal/v1/authenticate", post(authenticate::handler))
        .route("/internal/v1/policy", get(policy::serve))
        .route("/internal/v1/credentials", get(credentials::serve))
        .route("/internal/v1/api-keys/cleanup", post(keys::api::cleanup))
        .route(maas_types::lease::LEASES_PATH, post(leases::api::handler))
        .route(maas_types::usage::USAGE_PATH, post(usage::ingest::handler));
    common_layers(router, state, "internal")
}

/// `/metrics` and `/health`, nothing else: Prometheus may reach this listener and no other.
/// (`/ready` stays off it: a scrape target's health should not depend on the database.)
pub fn metrics_router(state: &AppState) -> Router {
    let router = Router::new()
        .route("/metrics", get(metrics::serve))
        .route("/health", get(health));
    layers(router, state, "metrics")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `$ref` in `v`.
    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v.as_str()) {
                        ("$ref", Some(r)) => out.push(r.to_string()),
                        _ => refs(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn the_generated_document_is_whole() {
        let doc = serde_json::to_value(PUBLIC_API_DOC.as_ref()).unwrap();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let mut found = Vec::new();
        refs(&doc, &mut found);
        assert!(found.len() > 10, "{found:?}");
        for r in found {
            let name = r.strip_prefix("#/components/schemas/").unwrap();
            assert!(schemas.contains_key(name), "{r} is not defined");
        }
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        // Key management needs a credential; the probes and this document do not.
        let paths = doc["paths"].as_object().unwrap();
        for (path, ops) in paths {
            for (method, op) in ops.as_object().unwrap() {
                let secured = op.get("security").is_some();
                let open = matches!(path.as_str(), "/health" | "/ready" | "/openapi.json");
                assert_eq!(secured, !open, "{method} {path}");
            }
        }
        // The error body is the shared contract's.
        let detail = &schemas["ErrorDetail"]["properties"];
        for field in ["message", "type", "param", "code"] {
            assert!(detail.get(field).is_some(), "{field}");
        }
    }
}
