//! Who reaches what: the HTTPRoutes (only the public port, never /internal), the Gateway's
//! listeners (routes only from labelled namespaces), and the NetworkPolicies in front of the
//! companion's three ports.

use super::context::{
    CLEANUP_POD_LABEL, COMPANION, COMPANION_PORTS, Context, GATEWAY_NAME, GATEWAY_NS,
    GATEWAY_POD_LABEL, MONITORING_NS, PROMETHEUS_POD_LABEL, PUBLIC_PORT, ROUTES_NAMESPACE_LABEL,
};
use super::docs::{
    Verdict, at, ensure, labels_match, list_at, list_or_empty, name_of, namespace_of, opt, opt_str,
    repr, repr_opt, string_map, truthy,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};

/// /maas-api → the public port with the prefix rewritten; nothing reaches 8081 or /internal.
pub fn routes(cx: &Context) -> Verdict {
    let mut public = None;
    for r in cx.docs.all("HTTPRoute") {
        let name = name_of(r).unwrap_or("None");
        for rule in list_or_empty(r, "spec.rules") {
            for b in list_or_empty(rule, "backendRefs") {
                if opt_str(b, "name") == Some(COMPANION) {
                    let port = b.get("port");
                    ensure!(
                        port == Some(&json!(PUBLIC_PORT)),
                        "HTTPRoute {name} reaches {COMPANION}:{}",
                        port.map_or_else(|| "None".to_string(), Value::to_string)
                    );
                }
            }
            for m in list_or_empty(rule, "matches") {
                let value = opt_str(m, "path.value").unwrap_or("/");
                ensure!(
                    !value.starts_with("/internal"),
                    "HTTPRoute {name} matches {value}"
                );
            }
        }
        if name == "maas-api" {
            public = Some(r);
        }
    }
    let Some(public) = public else {
        return Err("no HTTPRoute maas-api".to_string());
    };
    ensure!(
        namespace_of(public) == Some(cx.ns.as_str()),
        "maas-api route not beside the companion"
    );
    let rule = at(public, "spec.rules.0")?;
    let matches = at(rule, "matches")?;
    ensure!(
        matches == &json!([{"path": {"type": "PathPrefix", "value": "/maas-api"}}]),
        "{}",
        repr(matches)
    );
    let filters = at(rule, "filters")?;
    ensure!(
        filters
            == &json!([{"type": "URLRewrite", "urlRewrite": {"path": {
                "type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}]),
        "{}",
        repr(filters)
    );
    let parent = at(public, "spec.parentRefs.0")?;
    ensure!(
        opt_str(parent, "name") == Some(GATEWAY_NAME),
        "maas-api's parent {}",
        repr(parent)
    );
    ensure!(
        opt_str(parent, "namespace") == Some(GATEWAY_NS),
        "maas-api's parent {}",
        repr(parent)
    );
    Ok(())
}

/// HTTPRoutes only from namespaces labelled maas.opendatahub.io/gateway-routes=true: anyone who
/// may create one elsewhere could attach a route under a model's path and receive its key.
pub fn gateway_routes(cx: &Context) -> Verdict {
    let gw = cx.docs.one("Gateway", GATEWAY_NAME)?;
    let listeners = list_at(gw, "spec.listeners")?;
    ensure!(!listeners.is_empty(), "the Gateway has no listeners");
    let empty = json!({});
    for listener in listeners {
        let name = opt_str(listener, "name").unwrap_or("None");
        let rule = opt(listener, "allowedRoutes.namespaces")
            .filter(|r| truthy(Some(r)))
            .unwrap_or(&empty);
        let origin = opt_str(rule, "from").unwrap_or("Same");
        ensure!(
            matches!(origin, "Same" | "Selector"),
            "listener {name} admits HTTPRoutes from {origin}: anyone who may create one \
             could attach a route under a model's path and receive its provider key"
        );
        if origin == "Selector" {
            let selector = rule
                .get("selector")
                .filter(|s| truthy(Some(s)))
                .unwrap_or(&empty);
            let expected = json!({"matchLabels": string_map(&[ROUTES_NAMESPACE_LABEL])});
            ensure!(
                selector == &expected,
                "listener {name} selector {}, expected matchLabels {}: \"{}\"",
                repr(selector),
                ROUTES_NAMESPACE_LABEL.0,
                ROUTES_NAMESPACE_LABEL.1
            );
        } else {
            ensure!(
                cx.ns == GATEWAY_NS,
                "listener {name} admits only {GATEWAY_NS} routes; maas-api lives in {}",
                cx.ns
            );
        }
    }
    Ok(())
}

/// Who a NetworkPolicy peer is: the Gateway's pods, the cleanup job, Prometheus, or someone else.
fn peer_kind(peer: &Value) -> Option<&'static str> {
    let pod_labels = opt(peer, "podSelector.matchLabels");
    let pod_label = |(k, v): (&str, &str)| pod_labels.and_then(|l| l.get(k)) == Some(&json!(v));
    let ns_labels = opt(peer, "namespaceSelector.matchLabels");
    let namespace_is = |ns: &str| ns_labels == Some(&json!({"kubernetes.io/metadata.name": ns}));
    if namespace_is(GATEWAY_NS) && pod_label(GATEWAY_POD_LABEL) {
        Some("gateway")
    } else if peer.get("namespaceSelector").is_none() && pod_label(CLEANUP_POD_LABEL) {
        Some("cleanup")
    } else if MONITORING_NS.iter().any(|ns| namespace_is(ns))
        && pod_labels == Some(&string_map(&[PROMETHEUS_POD_LABEL]))
    {
        Some("prometheus")
    } else {
        None
    }
}

/// Default deny; the internal port only from the Gateway's pods and the cleanup job, the public
/// port only from the Gateway's pods, the metrics port only from Prometheus (which reaches no
/// other port: the internal port serves the provider credentials).
pub fn network_policies(cx: &Context) -> Verdict {
    let deploy = cx.docs.one("Deployment", COMPANION)?;
    let pod_labels = opt(deploy, "spec.template.metadata.labels");
    let policies: Vec<&Value> = cx
        .docs
        .all("NetworkPolicy")
        .into_iter()
        .filter(|p| namespace_of(p) == Some(cx.ns.as_str()))
        .filter(|p| labels_match(opt(p, "spec.podSelector"), pod_labels))
        .collect();
    ensure!(
        policies.iter().any(|p| {
            opt(p, "spec.policyTypes") == Some(&json!(["Ingress"]))
                && !truthy(opt(p, "spec.ingress"))
        }),
        "no default-deny ingress policy for the companion"
    );
    let allowed: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("public", &["gateway"][..]),
        ("internal", &["gateway", "cleanup"][..]),
        ("metrics", &["prometheus"][..]),
    ]);
    let mut admitted: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for p in &policies {
        let name = name_of(p).unwrap_or("None");
        for rule in list_or_empty(p, "spec.ingress") {
            let listed: Vec<&Value> = list_or_empty(rule, "ports")
                .iter()
                .filter_map(|x| x.get("port"))
                .collect();
            let ports: Vec<&str> = COMPANION_PORTS
                .iter()
                .filter(|(n, number)| {
                    listed.is_empty()
                        || listed.contains(&&json!(n))
                        || listed.contains(&&json!(number))
                })
                .map(|(n, _)| *n)
                .collect();
            let peers = rule.get("from").filter(|f| truthy(Some(f)));
            for port in &ports {
                ensure!(peers.is_some(), "{name} opens the {port} port to everyone");
            }
            for peer in peers
                .and_then(Value::as_array)
                .map_or(&[][..], Vec::as_slice)
            {
                ensure!(
                    peer.get("ipBlock").is_none(),
                    "{name} opens {} to an ipBlock",
                    repr(&json!(ports))
                );
                let who = peer_kind(peer);
                for port in &ports {
                    ensure!(
                        who.is_some_and(|w| allowed[port].contains(&w)),
                        "{name} admits {} to the {port} port",
                        repr(peer)
                    );
                    admitted.entry(port).or_default().extend(who);
                }
            }
        }
    }
    let has = |port: &str, who: &str| admitted.get(port).is_some_and(|s| s.contains(who));
    ensure!(
        has("internal", "gateway"),
        "the Gateway's pods cannot reach the internal port"
    );
    ensure!(
        has("public", "gateway"),
        "the Gateway's pods cannot reach the public port"
    );
    ensure!(
        has("metrics", "prometheus"),
        "Prometheus cannot reach the metrics port"
    );
    let job = cx.docs.one("CronJob", "maas-api-key-cleanup")?;
    let job_labels = opt(job, "spec.jobTemplate.spec.template.metadata.labels");
    ensure!(
        job_labels.and_then(|l| l.get(CLEANUP_POD_LABEL.0)) == Some(&json!(CLEANUP_POD_LABEL.1)),
        "cleanup pods lack their label {}",
        repr_opt(job_labels)
    );
    Ok(())
}
