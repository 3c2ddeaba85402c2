//! Checks on rendered MaaS Gateway manifests (what `kubectl kustomize wasm-plugin-crs/...` or
//! `scripts/deploy.sh --dry-run` prints), run by the `deploy_checks` test on every overlay and
//! by the `maas-manifest-checks` binary on deploy.sh's renders.
//!
//! 1. Schema: every object validates against `tests/fixtures/schemas/<group>_<version>_<Kind>`
//!    (a kind without a schema fails).
//! 2. Wiring, which no schema can see: the filter's Envoy cluster and authority name the
//!    rendered companion Service's namespace and internal port; no HTTPRoute reaches the internal
//!    port or /internal; the internal port admits only the Gateway's pods and the cleanup job,
//!    the public port only the Gateway's pods, the metrics port only Prometheus (which reaches no
//!    other port); the Service exposes the three ports; the companion runs hardened with probes,
//!    resources and its database Secret; TLS objects are present exactly when TLS is on; objects
//!    land in the expected namespaces; the filter is installed by the EnvoyFilter maas-filter
//!    (first in the Gateway's HTTP filters, its configuration over ECDS, fail closed, headers
//!    held for the body: the filter's pauseHeadersForBody and Envoy's
//!    allow_on_headers_stop_iteration always together, no WasmPlugin beside it); the Gateway's
//!    connection manager refuses underscore header names; the filter's companion cluster is the
//!    one the EnvoyFilter adds to the Gateway's Envoy (to the internal port, always with mutual
//!    TLS: the Gateway's client certificate and the internal CA over SDS, the service account
//!    allowed to fetch the key pair); the companion admits only client certificates of the
//!    internal CA naming the Gateway or the cleanup job, which presents its own; the
//!    ServiceMonitor, PodMonitor and PrometheusRules scrape the right ports and their alerts name
//!    only metrics the filter and the companion export (read from their sources); the Gateway's
//!    pod count (its parametersRef ConfigMap) is the filter's limits.global.replicas; the
//!    companion's Redis URL (budget leases) comes from an optional Secret, and a development
//!    Redis, when rendered, is single, hardened, unpersisted, password-protected and reachable
//!    from the companion only; the usage-events Telemetry, when rendered, logs only the
//!    Gateway's requests that carry a usage event.
//! 3. The sample model HTTPRoutes ([`model_routes`], on the `samples` render): each model of the
//!    policy they serve is also published at the one base URL (`/v1` + `x-maas-model`); a model
//!    with routed backends has, per backend, its rules by `x-maas-model` and `x-maas-backend`
//!    (`/v1`, the provider's own path or the model's prefix) to that backend's upstreamCluster.

mod companion;
mod context;
mod docs;
mod gateway;
mod monitoring;
mod network;
mod redis;
mod report;
mod schema;
mod scope;

pub use context::{LeaseStore, Options, Platform, Tls};
pub use docs::{Docs, Verdict, name_of, opt, repr};
pub use monitoring::{
    DASHBOARDS, dashboard, dashboard_files, dashboard_queries, exported_metrics,
    filter_metric_labels,
};
pub use network::model_routes;
pub use report::{Outcome, Report};
pub use schema::{Schemas, schema_file_name};

use context::{COMPANION, Context};
use std::path::Path;

/// A wiring check: its name (what it proves; `{lease_store}` and `{tls}` stand for the
/// options) and the function that proves it.
type Wiring = (&'static str, fn(&Context) -> Verdict);

/// Every wiring check, in the order they report.
const WIRING: [Wiring; 22] = [
    (
        "namespaces: companion objects together, gateway objects in the Gateway's namespace ({platform})",
        scope::namespaces,
    ),
    (
        "filter: EnvoyFilter maas-filter inserts it first over ECDS, fail closed, headers held for the body \
             (pauseHeadersForBody with allow_on_headers_stop_iteration), cluster = the EnvoyFilter's companion \
             cluster, no WasmPlugin",
        gateway::filter_install,
    ),
    (
        "connection manager: the Gateway refuses header names with underscores (headers_with_underscores_action)",
        gateway::connection_manager,
    ),
    (
        "Gateway replicas: pinned by ConfigMap maas-gateway-options = the filter's limits.global.replicas",
        gateway::gateway_replicas,
    ),
    (
        "EnvoyFilter: adds the filter's cluster maas-companion-internal to the Gateway's Envoy, STRICT_DNS to \
             the companion's internal port, mutual TLS with the Gateway's certificate",
        gateway::companion_cluster,
    ),
    (
        "internal API: mutual TLS on the companion (files from its Secret, only the Gateway and the cleanup \
             job named), the Gateway's service account may fetch its key pair over SDS, the cleanup job presents \
             its own certificate",
        companion::internal_mtls,
    ),
    (
        "monitoring: ServiceMonitor on the metrics port (HTTPS with TLS on), PodMonitor on the Gateway's \
             Envoy, alerts on exported metrics only, the Gateway's proxy extracts the filter's metric labels",
        monitoring::monitoring,
    ),
    (
        "Service: public 8080, internal 8081 and metrics 9090 to the container ports of those names",
        companion::service_ports,
    ),
    (
        "HTTPRoutes: /maas-api → public port with prefix rewritten; nothing reaches 8081 or /internal",
        network::routes,
    ),
    (
        "Gateway: HTTPRoutes only from namespaces labelled maas.opendatahub.io/gateway-routes=true",
        network::gateway_routes,
    ),
    (
        "NetworkPolicies: default deny; internal port only from Gateway pods and the cleanup job, public \
             port only from Gateway pods, metrics port only from Prometheus",
        network::network_policies,
    ),
    (
        "companion Deployment: hardened, probes, resources, DB Secret, policy file from the ConfigMap",
        companion::deployment,
    ),
    (
        "lease store: MAAS_REDIS_URL from an optional Secret; a dev Redis only when asked, single, hardened, \
             unpersisted, password-protected, reachable from the companion only",
        redis::dev_redis,
    ),
    (
        "public URL: the companion names models under the Gateway's HTTPS hostname (MAAS_PUBLIC_URL)",
        companion::public_url,
    ),
    (
        "one budget: the companion's replicas fit its lease store ({lease_store})",
        companion::companion_replicas,
    ),
    (
        "RBAC: tokenreviews and subjectaccessreviews create cluster-wide; Secrets/ConfigMaps read-only in its \
             namespace",
        companion::rbac,
    ),
    (
        "admins: the reference's SubjectAccessReview rule (create maasauthpolicies.maas.opendatahub.io in the \
             subscription namespace, MAAS_ADMIN_SAR_NAMESPACE)",
        companion::admin_sar,
    ),
    (
        "policy resources: with MAAS_POLICY_SOURCE=kubernetes the four maas.opendatahub.io/v1alpha1 CRDs, \
             read-only access to them and Event writing, provider-key Secrets `get` only and bound per \
             namespace, never cluster-wide; none without",
        companion::policy_resources,
    ),
    (
        "status writer: with MAAS_WRITE_STATUS=true (needs MAAS_POLICY_SOURCE=kubernetes) `patch` on the \
             resources' status subresource only, bound to the companion; no such right without",
        companion::status_writer,
    ),
    (
        "TLS backend objects match --tls {tls}",
        companion::tls_objects,
    ),
    (
        "policy ConfigMap parses, its models name known tiers, external models their upstreamCluster",
        companion::policy_document,
    ),
    (
        "usage events: the Telemetry maas-usage-events, when rendered, has the Gateway's pods log only \
             requests with a usage event ('wasm.maas_event' in filter_state) to the provider maas-usage-events",
        gateway::usage_events,
    ),
];

/// A check's name with the options it was run with.
fn wiring_name(template: &str, options: &Options) -> String {
    template
        .replace("{lease_store}", &options.lease_store.to_string())
        .replace("{tls}", &options.tls.to_string())
        .replace("{platform}", options.platform.gateway_ns())
}

/// How many wiring checks a full run reports (beside one schema check per object).
pub const WIRING_CHECKS: usize = WIRING.len();

/// Runs the schema checks and, unless `kinds_only`, every wiring check.
pub fn check(docs: &Docs, options: &Options, schemas: &Schemas, repo_root: &Path) -> Report {
    let mut report = Report::default();
    if docs.0.is_empty() {
        report.record("render is not empty", Err("no objects".to_string()));
    }
    schemas.check(docs, &mut report);
    if options.kinds_only {
        return report;
    }
    let svc = match docs.one("Service", COMPANION) {
        Ok(svc) => svc,
        Err(why) => {
            report.record("the companion Service", Err(why));
            return report;
        }
    };
    let cx = Context::new(docs, options, svc, repo_root);
    for (template, wiring) in WIRING {
        report.record(&wiring_name(template, options), wiring(&cx));
    }
    report
}
