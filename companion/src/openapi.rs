//! The frame of `/openapi.json`: title, description, the bearer security scheme. The paths and
//! schemas come from the handlers' `#[utoipa::path]` attributes and their types, collected
//! while the public router is built (`crate::routes`), so the document cannot list a route
//! that is not routed nor miss one that is.

use utoipa::openapi::OpenApi as Document;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "MaaS Gateway companion API",
        description = "API keys, tiers, subscriptions, model listing, usage (`/v1/usage`) and remaining quota (`/v1/quota`). Through the gateway every path is under /maas-api. Authenticate with `Authorization: Bearer <cluster token | sk-oai-… key>`; only a cluster identity may mint or revoke keys."
    ),
    modifiers(&BearerScheme)
)]
pub struct Frame;

struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}
