//! Who reaches what: the HTTPRoutes (only the public port, never /internal), the Gateway's
//! listeners (routes only from labelled namespaces), and the NetworkPolicies in front of the
//! companion's three ports.

use super::context::{
    CLEANUP_POD_LABEL, COMPANION, COMPANION_PORTS, Context, GATEWAY_NAME, GATEWAY_POD_LABEL,
    MONITORING_NS, PROMETHEUS_POD_LABEL, PUBLIC_PORT, ROUTES_NAMESPACE_LABEL,
};
use super::docs::{
    Docs, Verdict, at, ensure, labels_match, list_at, list_or_empty, name_of, namespace_of, opt,
    opt_str, repr, repr_opt, str_at, string_map, truthy,
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
        opt_str(parent, "namespace") == Some(cx.gateway_ns),
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
                cx.ns == cx.gateway_ns,
                "listener {name} admits only {} routes; maas-api lives in {}",
                cx.gateway_ns,
                cx.ns
            );
        }
    }
    Ok(())
}

/// Who a NetworkPolicy peer is: the Gateway's pods, the cleanup job, Prometheus, or someone else.
fn peer_kind(peer: &Value, gateway_ns: &str) -> Option<&'static str> {
    let pod_labels = opt(peer, "podSelector.matchLabels");
    let pod_label = |(k, v): (&str, &str)| pod_labels.and_then(|l| l.get(k)) == Some(&json!(v));
    let ns_labels = opt(peer, "namespaceSelector.matchLabels");
    let namespace_is = |ns: &str| ns_labels == Some(&json!({"kubernetes.io/metadata.name": ns}));
    if namespace_is(gateway_ns) && pod_label(GATEWAY_POD_LABEL) {
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
                let who = peer_kind(peer, cx.gateway_ns);
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

/// Every model HTTPRoute (the samples) publishes its model at the one base URL too: beside each
/// prefix rule serving a model of `policy` (the policy document: its `models[].path`), a rule
/// matching PathPrefix `/v1` with the header `x-maas-model` exactly the model's `name` (what the
/// filter sets), to the same backendRefs, with the same host rewrite and timeouts, no path
/// rewrite (the client's `/v1/…` is the server's), and `x-maas-model` removed before the
/// backend. Without it a model is reachable only at its path prefix. A model whose provider has
/// its own path (an `azure-openai` `deployment`: the filter sends
/// `/openai/deployments/<deployment>/…` with the header at both URL forms) also needs a rule
/// for that path prefix with the same header, alike; without it the rewritten request finds no
/// route. A `bedrock` model needs one for `/model` (its host rewrite, if any, the very host the
/// filter signed). A model with routed backends (each naming its own `upstreamCluster`) is
/// checked per backend instead ([`routed_backend_rules`]).
pub fn model_routes(docs: &Docs, policy: &Value) -> Verdict {
    let header = maas_types::MODEL_ROUTING_HEADER;
    let models = list_at(policy, "models")?;
    let routes = docs.all("HTTPRoute");
    ensure!(!routes.is_empty(), "no model HTTPRoute");
    for r in routes {
        let name = format!(
            "{}/{}",
            namespace_of(r).unwrap_or("None"),
            name_of(r).unwrap_or("None")
        );
        let rules = list_at(r, "spec.rules")?;
        let mut served = 0;
        let by_header = |rule: &Value, model_name: &str| {
            list_or_empty(rule, "matches").iter().any(|m| {
                list_or_empty(m, "headers").iter().any(|h| {
                    opt_str(h, "name").is_some_and(|n| n.eq_ignore_ascii_case(header))
                        && matches!(opt_str(h, "type"), None | Some("Exact"))
                        && (model_name.is_empty() || opt_str(h, "value") == Some(model_name))
                })
            })
        };
        for rule in rules {
            // The routing header's rules (the one base URL, a provider's path) follow a prefix
            // rule's model.
            if by_header(rule, "") {
                continue;
            }
            let Some(path) = list_or_empty(rule, "matches")
                .iter()
                .find_map(|m| opt_str(m, "path.value"))
                .filter(|p| *p != maas_types::ONE_BASE_PATH)
            else {
                continue;
            };
            let model = models
                .iter()
                .find(|m| opt_str(m, "path") == Some(path))
                .ok_or_else(|| {
                    format!("HTTPRoute {name} serves {path}: no model of the policy has that path")
                })?;
            let model_name = str_at(model, "name")?;
            served += 1;
            if routes_backends(model) {
                routed_backend_rules(r, model, rules, rule)?;
                continue;
            }
            let at_path = |prefix: &str| {
                rules.iter().find(|other| {
                    by_header(other, model_name)
                        && list_or_empty(other, "matches").iter().any(|m| {
                            opt_str(m, "path.type") == Some("PathPrefix")
                                && opt_str(m, "path.value") == Some(prefix)
                        })
                })
            };
            let Some(one_url) = at_path(maas_types::ONE_BASE_PATH) else {
                return Err(format!(
                    "HTTPRoute {name}: no rule for the one base URL of model {model_name} \
                     (PathPrefix {} with header {header}: {model_name}, Exact)",
                    maas_types::ONE_BASE_PATH
                ));
            };
            like_prefix_rule(&name, model_name, "the one base URL", one_url, rule)?;
            if opt_str(model, "provider.type") == Some("azure-openai")
                && let Some(deployment) = opt_str(model, "provider.deployment")
            {
                let prefix = format!("/openai/deployments/{deployment}");
                let Some(provider_rule) = at_path(&prefix) else {
                    return Err(format!(
                        "HTTPRoute {name}: no rule for the provider path of model {model_name} \
                         (PathPrefix {prefix} with header {header}: {model_name}, Exact): the \
                         filter's rewritten request would find no route"
                    ));
                };
                like_prefix_rule(&name, model_name, "the provider path", provider_rule, rule)?;
            }
            // Bedrock: the filter sends /model/<id>/converse[-stream], signed over path and host.
            if opt_str(model, "provider.type") == Some("bedrock") {
                let Some(provider_rule) = at_path(BEDROCK_PATH_PREFIX) else {
                    return Err(format!(
                        "HTTPRoute {name}: no rule for the provider path of model {model_name} \
                         (PathPrefix {BEDROCK_PATH_PREFIX} with header {header}: {model_name}, \
                         Exact): the filter's signed request would find no route"
                    ));
                };
                like_prefix_rule(&name, model_name, "the provider path", provider_rule, rule)?;
                bedrock_host_kept(&name, model_name, model, provider_rule)?;
            }
        }
        ensure!(served > 0, "HTTPRoute {name} serves no model path");
    }
    Ok(())
}

/// Whether a policy model's backends are routed: each names its own `upstreamCluster`
/// (`maas_types::Model::routes_backends`: the first one decides, the policy has all or none).
fn routes_backends(model: &Value) -> bool {
    list_or_empty(model, "backends")
        .first()
        .is_some_and(|b| opt_str(b, "upstreamCluster").is_some())
}

/// Where a routed backend's own rules must be, besides the one base URL: its provider's own
/// path (an `azure-openai` `deployment`: `/openai/deployments/<deployment>`; `bedrock`:
/// `/model`) when the filter rewrites to one outside `/v1` (Vertex AI's are under it), else the
/// model's prefix (the filter keeps the client's path). `None`: the provider's paths are all
/// under `/v1`.
fn routed_backend_path(
    model_path: &str,
    provider: Option<&maas_types::Provider>,
) -> Option<String> {
    match provider.and_then(maas_types::Provider::path) {
        Some(maas_types::ProviderPath::AzureDeployment { deployment, .. }) => {
            Some(format!("/openai/deployments/{deployment}"))
        }
        Some(maas_types::ProviderPath::Bedrock { .. }) => Some(BEDROCK_PATH_PREFIX.to_string()),
        Some(_) => None,
        None => Some(model_path.to_string()),
    }
}

/// A model with routed backends: the filter draws one backend per request and sets
/// `x-maas-model` (the model's name) and `x-maas-backend` (the backend's), and Envoy chooses the
/// route again by both. So, in the HTTPRoute `route` serving the model's prefix (`plain`: its
/// rule without headers, where requests start), per backend: a rule at `/v1` (the one base
/// URL) matching both headers exactly, and one at the path [`routed_backend_path`] names (the
/// provider's own, or the model's prefix); each to a single backendRef whose Istio cluster
/// (`outbound|<port>||<host>`) is the backend's `upstreamCluster` — anywhere else the filter
/// answers 503 `upstream_mismatch` — with both headers removed before the backend, the same
/// host rewrite and timeouts (a Bedrock backend's host the one the filter signed), no path
/// rewrite but at the model's prefix. The plain prefix rule leads to one of the backends.
fn routed_backend_rules(route: &Value, model: &Value, rules: &[Value], plain: &Value) -> Verdict {
    let name = route_name(route);
    let model_name = str_at(model, "name")?;
    let model_path = str_at(model, "path")?;
    let (model_header, backend_header) = (
        maas_types::MODEL_ROUTING_HEADER,
        maas_types::BACKEND_ROUTING_HEADER,
    );
    let mut clusters = Vec::new();
    for b in list_at(model, "backends")? {
        let backend = str_at(b, "name")?;
        let cluster = str_at(b, "upstreamCluster")?;
        clusters.push(cluster);
        let provider: Option<maas_types::Provider> = b
            .get("provider")
            .map(|p| serde_json::from_value(p.clone()))
            .transpose()
            .map_err(|e| format!("model {model_name}: backend {backend}: its provider: {e}"))?;
        let exact = |m: &Value, header: &str, value: &str| {
            list_or_empty(m, "headers").iter().any(|h| {
                opt_str(h, "name").is_some_and(|n| n.eq_ignore_ascii_case(header))
                    && matches!(opt_str(h, "type"), None | Some("Exact"))
                    && opt_str(h, "value") == Some(value)
            })
        };
        let at_path = |prefix: &str, what: &str| {
            rules
                .iter()
                .find(|rule| {
                    list_or_empty(rule, "matches").iter().any(|m| {
                        opt_str(m, "path.type") == Some("PathPrefix")
                            && opt_str(m, "path.value") == Some(prefix)
                            && exact(m, model_header, model_name)
                            && exact(m, backend_header, backend)
                    })
                })
                .ok_or_else(|| {
                    format!(
                        "HTTPRoute {name}: no rule for {what} of backend {backend} of model \
                         {model_name} (PathPrefix {prefix} with headers {model_header}: \
                         {model_name} and {backend_header}: {backend}, Exact): the filter's \
                         requests drawn for that backend would find no route to it"
                    )
                })
        };
        let what = format!("backend {backend} of model {model_name}");
        let one_url = at_path(maas_types::ONE_BASE_PATH, "the one base URL")?;
        routed_rule(route, &what, "the one base URL", one_url, one_url, cluster)?;
        match routed_backend_path(model_path, provider.as_ref()) {
            Some(prefix) if prefix == model_path => {
                let rule = at_path(&prefix, "the model's path prefix")?;
                routed_rule(
                    route,
                    &what,
                    "the model's path prefix",
                    rule,
                    one_url,
                    cluster,
                )?;
            }
            Some(prefix) => {
                let rule = at_path(&prefix, "the provider path")?;
                routed_rule(route, &what, "the provider path", rule, one_url, cluster)?;
                if prefix == BEDROCK_PATH_PREFIX {
                    bedrock_host_kept(&name, model_name, b, rule)?;
                }
            }
            None => {}
        }
    }
    let first = single_cluster(
        route,
        plain,
        &format!("the prefix rule of model {model_name}"),
    )?;
    ensure!(
        clusters.contains(&first.as_str()),
        "HTTPRoute {name}: the prefix rule of model {model_name} leads to {first}, none of its \
         backends' upstreamClusters ({})",
        clusters.join(", ")
    );
    Ok(())
}

/// `<namespace>/<name>` of an object.
fn route_name(route: &Value) -> String {
    format!(
        "{}/{}",
        namespace_of(route).unwrap_or("None"),
        name_of(route).unwrap_or("None")
    )
}

/// The Envoy cluster Istio gives the single backendRef of `rule` (`what`) of HTTPRoute `route`.
fn single_cluster(route: &Value, rule: &Value, what: &str) -> Result<String, String> {
    match list_or_empty(rule, "backendRefs") {
        [one] => crate::istio_gateway::istio_cluster(one, namespace_of(route).unwrap_or("default"))
            .map_err(|e| format!("HTTPRoute {}: {what}: {e:#}", route_name(route))),
        refs => Err(format!(
            "HTTPRoute {}: {what} has {} backendRefs, expected one",
            route_name(route),
            refs.len()
        )),
    }
}

/// A rule of a routed backend (`what`; `at`: where the rule matches) in HTTPRoute `route`: its
/// single backendRef is the backend's `cluster` as Istio names it, both routing headers are
/// removed before the backend, the host rewrite and timeouts are those of `reference` (the
/// backend's one base URL rule), and the path is not rewritten — but at the model's prefix,
/// which the rule may strip as the model's plain prefix rule does.
fn routed_rule(
    route: &Value,
    what: &str,
    at: &str,
    rule: &Value,
    reference: &Value,
    cluster: &str,
) -> Verdict {
    let name = route_name(route);
    let leads_to = single_cluster(route, rule, &format!("the rule of {what} ({at})"))?;
    ensure!(
        leads_to == cluster,
        "HTTPRoute {name}: the rule of {what} ({at}) leads to {leads_to}, but the backend's \
         upstreamCluster is {cluster}: the filter would answer 503 upstream_mismatch"
    );
    let filters = list_or_empty(rule, "filters");
    for header in [
        maas_types::MODEL_ROUTING_HEADER,
        maas_types::BACKEND_ROUTING_HEADER,
    ] {
        ensure!(
            filters.iter().any(|f| {
                list_or_empty(f, "requestHeaderModifier.remove")
                    .iter()
                    .any(|h| h.as_str().is_some_and(|h| h.eq_ignore_ascii_case(header)))
            }),
            "HTTPRoute {name}: the rule of {what} ({at}) does not remove {header} before the \
             backend (RequestHeaderModifier remove)"
        );
    }
    let strips = at == "the model's path prefix";
    ensure!(
        strips || !filters.iter().any(|f| opt(f, "urlRewrite.path").is_some()),
        "HTTPRoute {name}: the rule of {what} ({at}) rewrites the path (the path the filter sends \
         is the server's)"
    );
    ensure!(
        rewritten_host(rule) == rewritten_host(reference),
        "HTTPRoute {name}: the rule of {what} ({at}) rewrites the host to {:?}, its one base URL \
         rule to {:?}",
        rewritten_host(rule),
        rewritten_host(reference)
    );
    ensure!(
        rule.get("timeouts") == reference.get("timeouts"),
        "HTTPRoute {name}: the rule of {what} ({at}) has timeouts {}, its one base URL rule {}",
        repr_opt(rule.get("timeouts")),
        repr_opt(reference.get("timeouts"))
    );
    Ok(())
}

/// Where the filter sends a Bedrock model's requests (`/model/<id>/converse[-stream]`).
const BEDROCK_PATH_PREFIX: &str = "/model";

/// A Bedrock model's provider-path rule leaves the host the filter signed: no host rewrite, or
/// one to exactly `bedrock-runtime.<region>.amazonaws.com` (anything else breaks the SigV4
/// signature: Bedrock answers 403).
fn bedrock_host_kept(name: &str, model_name: &str, model: &Value, rule: &Value) -> Verdict {
    let region = opt_str(model, "provider.region").unwrap_or_default();
    let signed = format!("bedrock-runtime.{region}.amazonaws.com");
    let rewritten = list_or_empty(rule, "filters")
        .iter()
        .find_map(|f| opt_str(f, "urlRewrite.hostname"));
    ensure!(
        rewritten.is_none_or(|h| h == signed),
        "HTTPRoute {name}: the provider-path rule of Bedrock model {model_name} rewrites the host \
         to {:?}, but the filter signed {signed}: Bedrock would refuse every request (403)",
        rewritten.unwrap_or_default()
    );
    Ok(())
}

/// A routing-header rule (`what`: the one base URL, the provider path) of `model_name` in
/// HTTPRoute `name` leads where its prefix rule does (backendRefs, host rewrite, timeouts), keeps
/// the path and removes the header before the backend.
fn like_prefix_rule(
    name: &str,
    model_name: &str,
    what: &str,
    other: &Value,
    rule: &Value,
) -> Verdict {
    let header = maas_types::MODEL_ROUTING_HEADER;
    ensure!(
        other.get("backendRefs") == rule.get("backendRefs"),
        "HTTPRoute {name}: the {header} rule of {model_name} ({what}) leads to {}, its prefix \
         rule to {}",
        repr_opt(other.get("backendRefs")),
        repr_opt(rule.get("backendRefs"))
    );
    ensure!(
        rewritten_host(other) == rewritten_host(rule),
        "HTTPRoute {name}: the {header} rule of {model_name} ({what}) rewrites the host to {:?}, \
         its prefix rule to {:?}",
        rewritten_host(other),
        rewritten_host(rule)
    );
    ensure!(
        other.get("timeouts") == rule.get("timeouts"),
        "HTTPRoute {name}: the {header} rule of {model_name} ({what}) has timeouts {}, its \
         prefix rule {}",
        repr_opt(other.get("timeouts")),
        repr_opt(rule.get("timeouts"))
    );
    let filters = list_or_empty(other, "filters");
    ensure!(
        !filters.iter().any(|f| opt(f, "urlRewrite.path").is_some()),
        "HTTPRoute {name}: the {header} rule of {model_name} ({what}) rewrites the path (the \
         path the filter sends is the server's)"
    );
    ensure!(
        filters.iter().any(|f| {
            list_or_empty(f, "requestHeaderModifier.remove")
                .iter()
                .any(|h| h.as_str().is_some_and(|h| h.eq_ignore_ascii_case(header)))
        }),
        "HTTPRoute {name}: the {header} rule of {model_name} ({what}) does not remove {header} \
         before the backend (RequestHeaderModifier remove)"
    );
    Ok(())
}

/// The host a rule's `URLRewrite` gives the request, when it rewrites it.
fn rewritten_host(rule: &Value) -> Option<String> {
    list_or_empty(rule, "filters")
        .iter()
        .find_map(|f| opt_str(f, "urlRewrite.hostname"))
        .map(str::to_string)
}
