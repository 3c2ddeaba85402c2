//! Where objects land: the companion's objects together in its namespace, the Gateway's in
//! openshift-ingress, cluster-scoped ones in none, and every binding to a service account of the
//! companion's namespace (the Gateway's own bindings apart).

use super::context::{
    COMPANION_CLUSTER_FILTER, Context, FILTER_ENVOYFILTER, GATEWAY_NAME, GATEWAY_OPTIONS,
    GATEWAY_SDS_RBAC, HCM_ENVOYFILTER,
};
use super::docs::{Verdict, ensure, list_or_empty, name_of, namespace_of, opt_str, repr, repr_str};
use serde_json::Value;

/// The objects deployed beside the Gateway, by kind and name.
const GATEWAY_SIDE: [(&str, &str); 11] = [
    ("EnvoyFilter", FILTER_ENVOYFILTER),
    ("EnvoyFilter", HCM_ENVOYFILTER),
    ("Gateway", GATEWAY_NAME),
    ("ConfigMap", GATEWAY_OPTIONS),
    ("DestinationRule", "maas-companion-tls"),
    ("EnvoyFilter", COMPANION_CLUSTER_FILTER),
    ("PodMonitor", "maas-gateway-envoy"),
    ("PrometheusRule", "maas-gateway-alerts"),
    ("Role", GATEWAY_SDS_RBAC),
    ("RoleBinding", GATEWAY_SDS_RBAC),
    ("Telemetry", super::gateway::USAGE_EVENTS_TELEMETRY),
];
const CLUSTER_SCOPED: [&str; 4] = [
    "ClusterRole",
    "ClusterRoleBinding",
    "GatewayClass",
    "CustomResourceDefinition",
];

fn gateway_side(kind: &str, name: &str) -> bool {
    GATEWAY_SIDE.contains(&(kind, name))
}

/// `('Kind', 'name')`, as the messages have always named an object.
fn key(kind: &str, name: &str) -> String {
    format!("({}, {})", repr_str(kind), repr_str(name))
}

pub fn namespaces(cx: &Context) -> Verdict {
    let ns = cx.ns.as_str();
    ensure!(!ns.is_empty(), "the companion Service has no namespace");
    if let Some(expected) = &cx.options.namespace {
        ensure!(
            ns == expected,
            "companion namespace {ns}, expected {expected}"
        );
    }
    for d in &cx.docs.0 {
        let kind = opt_str(d, "kind").unwrap_or("None");
        let name = name_of(d).unwrap_or("None");
        let got = namespace_of(d);
        let shown = got.unwrap_or("None");
        if gateway_side(kind, name) {
            ensure!(
                got == Some(cx.gateway_ns),
                "{} in {shown}, expected {}",
                key(kind, name),
                cx.gateway_ns
            );
        } else if CLUSTER_SCOPED.contains(&kind) {
            ensure!(
                got.is_none(),
                "cluster-scoped {} has a namespace",
                key(kind, name)
            );
        } else if (kind, name) == ("ConfigMap", "maas-service-ca") {
            ensure!(
                got == Some(ns) || got == Some(cx.gateway_ns),
                "{} in {shown}",
                key(kind, name)
            );
        } else {
            ensure!(
                got == Some(ns),
                "{} in {shown}, expected the companion's namespace {ns}",
                key(kind, name)
            );
        }
    }
    let bindings = cx
        .docs
        .all("RoleBinding")
        .into_iter()
        .chain(cx.docs.all("ClusterRoleBinding"));
    for d in bindings {
        let kind = opt_str(d, "kind").unwrap_or("None");
        let name = name_of(d).unwrap_or("None");
        if gateway_side(kind, name) {
            continue; // the Gateway's own service account (checked with the internal mTLS)
        }
        for s in list_or_empty(d, "subjects") {
            if opt_str(s, "kind") == Some("ServiceAccount") {
                ensure!(
                    s.get("namespace") == Some(&Value::String(ns.to_string())),
                    "{kind} {name} binds {}",
                    repr(s)
                );
            }
        }
    }
    Ok(())
}
