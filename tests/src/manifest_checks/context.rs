//! The names the manifests must agree on, what a run is asked to expect (`Options`), and what
//! every wiring check reads (`Context`).

use super::docs::{Docs, namespace_of};
use serde_json::Value;
use std::fmt;
use std::path::Path;

/// The Gateway's namespace on OpenShift (its own Gateway API implementation's namespace).
pub const GATEWAY_NS: &str = "openshift-ingress";
/// The Gateway's namespace on plain Kubernetes (overlays/kubernetes, deploy.sh --platform kubernetes).
pub const KUBERNETES_GATEWAY_NS: &str = "maas-gateway";
pub const GATEWAY_NAME: &str = "maas-default-gateway";
pub const COMPANION: &str = "maas-companion";
pub const PUBLIC_PORT: u64 = 8080;
pub const INTERNAL_PORT: u64 = 8081;
pub const METRICS_PORT: u64 = 9090;
/// Container port name → number; NetworkPolicies may name either.
pub const COMPANION_PORTS: [(&str, u64); 3] = [
    ("public", PUBLIC_PORT),
    ("internal", INTERNAL_PORT),
    ("metrics", METRICS_PORT),
];
/// The Envoy cluster the filter calls the companion through: added by the EnvoyFilter below, not
/// Istio's generated outbound|8081||... name (absent with PILOT_FILTER_GATEWAY_CLUSTER_CONFIG=true).
pub const COMPANION_CLUSTER: &str = "maas-companion-internal";
pub const COMPANION_CLUSTER_FILTER: &str = "maas-companion-cluster";
/// The Gateway's Deployment options (Gateway.spec.infrastructure.parametersRef): its pod count,
/// which the filter's limits.global.replicas must repeat.
pub const GATEWAY_OPTIONS: &str = "maas-gateway-options";
/// The EnvoyFilter installing the filter (ECDS), and the one setting the connection manager.
pub const FILTER_ENVOYFILTER: &str = "maas-filter";
pub const HCM_ENVOYFILTER: &str = "maas-gateway-connection-manager";
pub const HCM: &str = "envoy.filters.network.http_connection_manager";
pub const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
pub const RBAC_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";
pub const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
pub const GATEWAY_POD_LABEL: (&str, &str) =
    ("gateway.networking.k8s.io/gateway-name", GATEWAY_NAME);
pub const MONITORING_NS: [&str; 2] = ["openshift-monitoring", "openshift-user-workload-monitoring"];
pub const PROMETHEUS_POD_LABEL: (&str, &str) = ("app.kubernetes.io/name", "prometheus");
pub const CLEANUP_POD_LABEL: (&str, &str) = ("app.kubernetes.io/name", "maas-api-key-cleanup");
/// The lease store: the companion's optional Secret and the development Redis (components/redis-dev).
pub const REDIS: &str = "maas-redis";
pub const REDIS_SECRET: &str = "maas-redis";
pub const DEV_ONLY_LABEL: &str = "maas.opendatahub.io/dev-only";
/// The internal port's mutual TLS (scripts/deploy.sh issues the certificates from a private CA):
/// the Secrets, the callers' names (URI SANs) and the Gateway's service account, which istiod must
/// let fetch the client key pair over SDS.
pub const GATEWAY_CLIENT_SECRET: &str = "maas-gateway-internal-client";
pub const COMPANION_INTERNAL_SECRET: &str = "maas-companion-internal-tls";
pub const CLEANUP_CLIENT_SECRET: &str = "maas-api-key-cleanup-client";
pub const GATEWAY_CLIENT_NAME: &str = "spiffe://maas.internal/gateway";
pub const CLEANUP_CLIENT_NAME: &str = "spiffe://maas.internal/api-key-cleanup";
pub const GATEWAY_SERVICE_ACCOUNT: &str = "maas-default-gateway-openshift-default";
/// Istio names the Gateway's service account <gateway>-<gatewayclass>: class `istio` on Kubernetes.
pub const KUBERNETES_GATEWAY_SERVICE_ACCOUNT: &str = "maas-default-gateway-istio";
pub const GATEWAY_SDS_RBAC: &str = "maas-gateway-sds";
/// Namespaces whose HTTPRoutes the Gateway admits (deploy.sh labels the companion's namespace).
pub const ROUTES_NAMESPACE_LABEL: (&str, &str) = ("maas.opendatahub.io/gateway-routes", "true");

/// What the TLS backend (`--tls`) must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tls {
    On,
    Off,
    #[default]
    Any,
}

/// Where the companion's lease counters must be (`--lease-store`): in process requires one
/// companion replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LeaseStore {
    Memory,
    Redis,
    #[default]
    Any,
}

impl fmt::Display for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tls::On => "on",
            Tls::Off => "off",
            Tls::Any => "any",
        })
    }
}

impl fmt::Display for LeaseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LeaseStore::Memory => "memory",
            LeaseStore::Redis => "redis",
            LeaseStore::Any => "any",
        })
    }
}

/// Where the render runs: OpenShift (its GatewayClass, openshift-ingress, the service CA) or
/// plain Kubernetes with Istio (class `istio`, the Gateway in maas-gateway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Platform {
    #[default]
    OpenShift,
    Kubernetes,
}

impl Platform {
    /// The Gateway's namespace.
    pub fn gateway_ns(self) -> &'static str {
        match self {
            Platform::OpenShift => GATEWAY_NS,
            Platform::Kubernetes => KUBERNETES_GATEWAY_NS,
        }
    }

    /// The service account Istio runs the Gateway's pods as.
    pub fn gateway_service_account(self) -> &'static str {
        match self {
            Platform::OpenShift => GATEWAY_SERVICE_ACCOUNT,
            Platform::Kubernetes => KUBERNETES_GATEWAY_SERVICE_ACCOUNT,
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Platform::OpenShift => "openshift",
            Platform::Kubernetes => "kubernetes",
        })
    }
}

/// What a run expects of the render.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub platform: Platform,
    /// The companion's namespace, when it must be this one.
    pub namespace: Option<String>,
    pub tls: Tls,
    /// Whether the development Redis must (`Some(true)`) or must not be rendered.
    pub dev_redis: Option<bool>,
    pub lease_store: LeaseStore,
    /// Schemas only (base/postgres, samples: no companion to wire).
    pub kinds_only: bool,
}

/// What the wiring checks read: the render, the options, the companion Service and its names.
pub struct Context<'a> {
    pub docs: &'a Docs,
    pub options: &'a Options,
    /// The companion Service.
    pub svc: &'a Value,
    /// The companion's namespace (the Service's).
    pub ns: String,
    /// `maas-companion.<ns>.svc.cluster.local`.
    pub fqdn: String,
    /// The repository (the metric names are read from the filter's and the companion's sources).
    pub repo_root: &'a Path,
    /// The Gateway's namespace (by platform).
    pub gateway_ns: &'static str,
}

impl<'a> Context<'a> {
    pub fn new(
        docs: &'a Docs,
        options: &'a Options,
        svc: &'a Value,
        repo_root: &'a Path,
    ) -> Context<'a> {
        let ns = namespace_of(svc).unwrap_or_default().to_string();
        let fqdn = format!("{COMPANION}.{ns}.svc.cluster.local");
        Context {
            docs,
            options,
            svc,
            ns,
            fqdn,
            repo_root,
            gateway_ns: options.platform.gateway_ns(),
        }
    }

    /// `{"<gateway pod label>": "maas-default-gateway"}`.
    pub fn gateway_pods() -> Value {
        super::docs::string_map(&[GATEWAY_POD_LABEL])
    }
}
