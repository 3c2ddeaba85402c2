//! The Gateway's side: the EnvoyFilter that installs the filter (first, over ECDS, fail closed,
//! headers held for the body), the connection manager's settings, the Gateway's replica count
//! (which the filter's limits repeat), the companion cluster the filter calls, and the
//! usage-events Telemetry when it is rendered.

use super::context::{
    COMPANION, COMPANION_CLUSTER, COMPANION_CLUSTER_FILTER, Context, FILTER_ENVOYFILTER,
    GATEWAY_CLIENT_SECRET, GATEWAY_NAME, GATEWAY_OPTIONS, HCM, HCM_ENVOYFILTER, HCM_TYPE,
    INTERNAL_PORT, PUBLIC_PORT, RBAC_TYPE, WASM_TYPE,
};
use super::docs::{
    Docs, Verdict, at, ensure, is_true, list_at, list_or_empty, name_of, namespace_of, opt,
    opt_str, repr, repr_opt, str_at,
};
use serde_json::{Value, json};
use std::collections::BTreeSet;

/// The filter's Wasm extension config (the EXTENSION_CONFIG the EnvoyFilter maas-filter adds)
/// and its pluginConfig (JSON).
pub struct WasmExtension<'a> {
    pub envoy_filter: &'a Value,
    /// The EXTENSION_CONFIG patch.
    pub add: &'a Value,
    /// Its `patch.value` (name, typed_config).
    pub value: &'a Value,
    /// `typed_config.config`: the Wasm filter's settings.
    pub config: &'a Value,
    /// The pluginConfig, parsed.
    pub plugin: Value,
}

/// The `configPatches` of an EnvoyFilter that apply to `apply_to`.
pub fn patches<'a>(envoy_filter: &'a Value, apply_to: &str) -> Vec<&'a Value> {
    list_or_empty(envoy_filter, "spec.configPatches")
        .iter()
        .filter(|p| opt_str(p, "applyTo") == Some(apply_to))
        .collect()
}

pub fn wasm_extension(docs: &Docs) -> Result<WasmExtension<'_>, String> {
    let envoy_filter = docs.one("EnvoyFilter", FILTER_ENVOYFILTER)?;
    let adds = patches(envoy_filter, "EXTENSION_CONFIG");
    ensure!(
        adds.len() == 1,
        "{} EXTENSION_CONFIG patches in EnvoyFilter {FILTER_ENVOYFILTER}",
        adds.len()
    );
    let add = adds[0];
    let value = at(add, "patch.value")?;
    let config = at(value, "typed_config.config")?;
    let text = str_at(config, "configuration.value")?;
    let plugin =
        serde_json::from_str(text).map_err(|e| format!("pluginConfig is not JSON: {e}"))?;
    Ok(WasmExtension {
        envoy_filter,
        add,
        value,
        config,
        plugin,
    })
}

/// One way in only: a WasmPlugin beside the EnvoyFilter would run the filter twice, and a
/// WasmPlugin cannot set allow_on_headers_stop_iteration.
pub fn filter_install(cx: &Context) -> Verdict {
    if let Some(wp) = cx.docs.all("WasmPlugin").first() {
        return Err(format!(
            "WasmPlugin {} rendered: the filter comes from EnvoyFilter {FILTER_ENVOYFILTER} only",
            name_of(wp).unwrap_or("None")
        ));
    }
    let ext = wasm_extension(cx.docs)?;
    let selector = opt(ext.envoy_filter, "spec.workloadSelector.labels");
    ensure!(
        selector == Some(&Context::gateway_pods()),
        "EnvoyFilter {FILTER_ENVOYFILTER} selects {}, expected the Gateway's pods",
        repr_opt(selector)
    );
    let operation = str_at(ext.add, "patch.operation")?;
    ensure!(operation == "ADD", "{operation}");
    ensure!(
        opt_str(ext.add, "match.context") == Some("GATEWAY"),
        "{}",
        repr_opt(opt(ext.add, "match"))
    );
    let wasm_type = str_at(ext.value, "typed_config.@type")?;
    ensure!(wasm_type == WASM_TYPE, "{wasm_type}");
    http_filter_first(&ext)?;
    fail_closed_and_held(&ext)?;
    companion_reference(cx, &ext.plugin)
}

/// The HTTP filter: inserted first in the Gateway's connection manager, its config over ECDS
/// (ADS), waited for, with the RBAC fallback Istio's agent uses for a module it cannot fetch.
fn http_filter_first(ext: &WasmExtension) -> Verdict {
    let inserts = patches(ext.envoy_filter, "HTTP_FILTER");
    ensure!(
        inserts.len() == 1,
        "{} HTTP_FILTER patches in EnvoyFilter {FILTER_ENVOYFILTER}",
        inserts.len()
    );
    let ins = inserts[0];
    let operation = str_at(ins, "patch.operation")?;
    ensure!(
        operation == "INSERT_FIRST",
        "HTTP filter inserted with {operation}: it must run first (nothing before it)"
    );
    ensure!(
        opt_str(ins, "match.context") == Some("GATEWAY"),
        "{}",
        repr_opt(opt(ins, "match"))
    );
    ensure!(
        str_at(ins, "match.listener.filterChain.filter.name")? == HCM,
        "{}",
        repr_opt(opt(ins, "match"))
    );
    let http_filter = at(ins, "patch.value")?;
    let asked = at(http_filter, "name")?;
    let offered = at(ext.value, "name")?;
    ensure!(
        asked == offered,
        "the HTTP filter asks ECDS for {}, the extension config is {}",
        repr(asked),
        repr(offered)
    );
    let source = at(http_filter, "config_discovery.config_source")?;
    ensure!(source.get("ads").is_some(), "{}", repr(source));
    ensure!(
        opt_str(source, "initial_fetch_timeout") == Some("0s"),
        "initial_fetch_timeout must be 0s: the listener waits for the filter instead of running without it"
    );
    let type_urls = list_at(http_filter, "config_discovery.type_urls")?;
    ensure!(
        type_urls.contains(&json!(WASM_TYPE)) && type_urls.contains(&json!(RBAC_TYPE)),
        "type_urls {}: the Wasm filter and the RBAC filter Istio's agent puts in place of a module it cannot fetch (fail closed)",
        repr(&Value::Array(type_urls.to_vec()))
    );
    Ok(())
}

/// Fail closed, the module from an OCI registry, and headers held for the body: the filter's
/// pauseHeadersForBody and Envoy's allow_on_headers_stop_iteration always together.
fn fail_closed_and_held(ext: &WasmExtension) -> Verdict {
    let config = ext.config;
    let policy = opt(config, "failure_policy");
    ensure!(
        policy == Some(&json!("FAIL_CLOSED")),
        "failure_policy {}, expected FAIL_CLOSED",
        repr_opt(policy)
    );
    ensure!(
        matches!(
            opt(config, "fail_open"),
            None | Some(Value::Null | Value::Bool(false))
        ),
        "fail_open set"
    );
    let remote = at(config, "vm_config.code.remote.http_uri.uri")?;
    ensure!(
        remote.as_str().is_some_and(|u| u.starts_with("oci://")),
        "module url {}: expected oci://",
        repr(remote)
    );
    let env = opt(config, "vm_config.environment_variables.key_values");
    let pull = env.and_then(|e| opt_str(e, "ISTIO_META_WASM_IMAGE_PULL_POLICY"));
    ensure!(
        matches!(pull, Some("IfNotPresent" | "Always")),
        "{}",
        repr_opt(env)
    );
    let pause = is_true(&ext.plugin, "pauseHeadersForBody");
    let knob = is_true(config, "allow_on_headers_stop_iteration");
    ensure!(
        pause == knob,
        "pauseHeadersForBody {} but allow_on_headers_stop_iteration {}: both or neither \
         (the flag alone makes Envoy never hand a held body over)",
        repr(&json!(pause)),
        repr(&json!(knob))
    );
    ensure!(
        pause,
        "headers are not held for the body: a refusal on the body would open an upstream request"
    );
    Ok(())
}

/// The pluginConfig names the EnvoyFilter's companion cluster, stays closed, counts globally.
fn companion_reference(cx: &Context, plugin: &Value) -> Verdict {
    let cluster = at(plugin, "companion.cluster")?;
    ensure!(
        cluster == &json!(COMPANION_CLUSTER),
        "cluster {}, expected {} (the EnvoyFilter's cluster)",
        repr(cluster),
        repr(&json!(COMPANION_CLUSTER))
    );
    let authority = opt(plugin, "companion.authority");
    ensure!(
        matches!(authority, None | Some(Value::Null)) || authority == Some(&json!(cx.fqdn)),
        "authority {}, expected {} or none (the cluster's name)",
        repr_opt(authority),
        repr(&json!(cx.fqdn))
    );
    ensure!(
        opt_str(plugin, "failureMode").unwrap_or("closed") == "closed"
            && opt(plugin, "failureMode").is_none_or(Value::is_string),
        "failureMode must stay closed"
    );
    let global = opt(plugin, "limits.global");
    let enabled = global.and_then(|g| g.get("enabled"));
    ensure!(
        enabled.is_none_or(|e| e == &json!(true)),
        "limits.global.enabled is off: every Gateway replica counts alone (N replicas allow N× a tier)"
    );
    let on_unavailable = global.and_then(|g| g.get("onUnavailable"));
    ensure!(
        on_unavailable.is_none_or(|v| v == &json!("fallback") || v == &json!("refuse")),
        "{}",
        repr_opt(on_unavailable)
    );
    let ports: BTreeSet<u64> = list_at(cx.svc, "spec.ports")?
        .iter()
        .filter_map(|p| p.get("port").and_then(Value::as_u64))
        .collect();
    ensure!(
        ports.contains(&PUBLIC_PORT) && ports.contains(&INTERNAL_PORT),
        "Service ports {ports:?}"
    );
    Ok(())
}

/// The Gateway's connection manager refuses header names with underscores.
pub fn connection_manager(cx: &Context) -> Verdict {
    let ef = cx.docs.one("EnvoyFilter", HCM_ENVOYFILTER)?;
    let selector = opt(ef, "spec.workloadSelector.labels");
    ensure!(
        selector == Some(&Context::gateway_pods()),
        "EnvoyFilter {HCM_ENVOYFILTER} selects {}, expected the Gateway's pods",
        repr_opt(selector)
    );
    let mut actions = Vec::new();
    for p in list_or_empty(ef, "spec.configPatches") {
        if opt_str(p, "applyTo") != Some("NETWORK_FILTER")
            || opt_str(p, "patch.operation") != Some("MERGE")
        {
            continue;
        }
        ensure!(
            opt_str(p, "match.context") == Some("GATEWAY"),
            "{}",
            repr_opt(opt(p, "match"))
        );
        ensure!(
            str_at(p, "match.listener.filterChain.filter.name")? == HCM,
            "{}",
            repr_opt(opt(p, "match"))
        );
        let typed = at(p, "patch.value.typed_config")?;
        let kind = str_at(typed, "@type")?;
        ensure!(kind == HCM_TYPE, "{kind}");
        actions.push(
            opt(
                typed,
                "common_http_protocol_options.headers_with_underscores_action",
            )
            .cloned()
            .unwrap_or(Value::Null),
        );
    }
    let refusing = |a: &Value| a == &json!("REJECT_REQUEST") || a == &json!("DROP_HEADER");
    ensure!(
        !actions.is_empty() && actions.iter().all(refusing),
        "headers_with_underscores_action {}: the Gateway lets x_maas_user through \
         (CGI/WSGI backends read it as x-maas-user)",
        repr(&Value::Array(actions))
    );
    Ok(())
}

/// The Gateway's pod count, pinned by ConfigMap maas-gateway-options, is the filter's
/// limits.global.replicas: in fallback each replica admits limit ÷ that number.
pub fn gateway_replicas(cx: &Context) -> Verdict {
    let gw = cx.docs.one("Gateway", GATEWAY_NAME)?;
    let reference = opt(gw, "spec.infrastructure.parametersRef");
    let expected = json!({"group": "", "kind": "ConfigMap", "name": GATEWAY_OPTIONS});
    ensure!(
        reference == Some(&expected),
        "the Gateway's infrastructure.parametersRef is {}, expected ConfigMap {GATEWAY_OPTIONS}",
        repr_opt(reference)
    );
    let cm = cx.docs.one("ConfigMap", GATEWAY_OPTIONS)?;
    ensure!(
        namespace_of(cm) == namespace_of(gw),
        "ConfigMap {GATEWAY_OPTIONS} is not beside the Gateway"
    );
    let patch: Value = yaml_serde::from_str(str_at(cm, "data.deployment")?)
        .map_err(|e| format!("ConfigMap {GATEWAY_OPTIONS} data.deployment is not YAML: {e}"))?;
    let pods = opt(&patch, "spec.replicas");
    let Some(count) = pods.and_then(Value::as_u64).filter(|n| *n >= 1) else {
        return Err(format!(
            "the Gateway's deployment patch sets replicas {}",
            repr_opt(pods)
        ));
    };
    let plugin = wasm_extension(cx.docs)?.plugin;
    let replicas = opt(&plugin, "limits.global.replicas");
    ensure!(
        replicas.and_then(Value::as_u64) == Some(count),
        "limits.global.replicas {} but the Gateway runs {count} replicas: in fallback each replica \
         admits limit ÷ that number, so a smaller one lets them exceed the limit",
        repr_opt(replicas)
    );
    Ok(())
}

/// The filter's cluster, added to the Gateway's Envoy by the EnvoyFilter maas-companion-cluster:
/// STRICT_DNS to the companion's internal port, always mutual TLS (the internal port serves the
/// provider keys).
pub fn companion_cluster(cx: &Context) -> Verdict {
    let plugin = wasm_extension(cx.docs)?.plugin;
    let name = str_at(&plugin, "companion.cluster")?.to_string();
    let mut adding = Vec::new();
    for ef in cx.docs.all("EnvoyFilter") {
        for p in patches(ef, "CLUSTER") {
            if opt_str(p, "patch.operation") == Some("ADD")
                && opt_str(p, "patch.value.name") == Some(name.as_str())
            {
                adding.push((ef, p));
            }
        }
    }
    ensure!(
        adding.len() == 1,
        "{} EnvoyFilter patches add cluster {}, expected exactly one",
        adding.len(),
        repr(&json!(name))
    );
    let (ef, patch) = adding[0];
    let ef_name = name_of(ef).unwrap_or("None");
    ensure!(ef_name == COMPANION_CLUSTER_FILTER, "{ef_name}");
    let selector = opt(ef, "spec.workloadSelector.labels");
    ensure!(
        selector == Some(&Context::gateway_pods()),
        "EnvoyFilter selects {}, expected the Gateway's pods {}",
        repr_opt(selector),
        repr(&Context::gateway_pods())
    );
    ensure!(
        opt_str(patch, "match.context") == Some("GATEWAY"),
        "{}",
        repr_opt(opt(patch, "match"))
    );
    let cluster = at(patch, "patch.value")?;
    cluster_endpoint(cx, cluster, &name)?;
    cluster_mutual_tls(cx, cluster)
}

fn cluster_endpoint(cx: &Context, cluster: &Value, name: &str) -> Verdict {
    let kind = opt(cluster, "type");
    ensure!(
        kind == Some(&json!("STRICT_DNS")),
        "cluster type {}",
        repr_opt(kind)
    );
    let assignment = at(cluster, "load_assignment")?;
    let cluster_name = str_at(assignment, "cluster_name")?;
    ensure!(cluster_name == name, "{cluster_name}");
    let mut endpoints = Vec::new();
    for group in list_at(assignment, "endpoints")? {
        for e in list_at(group, "lb_endpoints")? {
            endpoints.push(at(e, "endpoint.address.socket_address")?.clone());
        }
    }
    let expected = vec![json!({"address": cx.fqdn, "port_value": INTERNAL_PORT})];
    ensure!(
        endpoints == expected,
        "cluster endpoints {}, expected {}:{INTERNAL_PORT}",
        repr(&Value::Array(endpoints)),
        cx.fqdn
    );
    Ok(())
}

fn cluster_mutual_tls(cx: &Context, cluster: &Value) -> Verdict {
    let Some(socket) = cluster.get("transport_socket").filter(|t| !t.is_null()) else {
        return Err(
            "the companion cluster has no TLS transport socket: the Gateway cannot prove who it is"
                .to_string(),
        );
    };
    let tc = at(socket, "typed_config")?;
    let kind = str_at(tc, "@type")?;
    ensure!(kind.ends_with("tls.v3.UpstreamTlsContext"), "{kind}");
    let sni = opt(tc, "sni");
    let service = format!("{COMPANION}.{}.svc", cx.ns);
    ensure!(
        sni == Some(&json!(service)),
        "sni {}",
        sni.and_then(Value::as_str).unwrap_or("None")
    );
    let ctx = at(tc, "common_tls_context")?;
    let sds_certs = opt(ctx, "tls_certificate_sds_secret_configs");
    let certs: Vec<&str> = list_or_empty(ctx, "tls_certificate_sds_secret_configs")
        .iter()
        .filter(|s| opt(s, "sds_config.ads").is_some())
        .filter_map(|s| opt_str(s, "name"))
        .collect();
    let want_cert = format!("kubernetes://{GATEWAY_CLIENT_SECRET}");
    ensure!(
        certs == [want_cert.as_str()],
        "the companion cluster presents no client certificate from Secret {GATEWAY_CLIENT_SECRET} \
         (over SDS): {}",
        repr_opt(sds_certs)
    );
    let cvc = at(ctx, "combined_validation_context")?;
    let sans: Vec<Value> = list_at(
        cvc,
        "default_validation_context.match_typed_subject_alt_names",
    )?
    .iter()
    .map(|m| opt(m, "matcher.exact").cloned().unwrap_or(Value::Null))
    .collect();
    ensure!(
        sans == [json!(service)],
        "SANs {}",
        repr(&Value::Array(sans))
    );
    let sds = at(cvc, "validation_context_sds_secret_config")?;
    let want_sds = format!("kubernetes://{GATEWAY_CLIENT_SECRET}-cacert");
    let got = at(sds, "name")?;
    ensure!(
        got == &json!(want_sds),
        "CA from {}, expected {} (the internal CA)",
        repr(got),
        repr(&json!(want_sds))
    );
    ensure!(
        opt(sds, "sds_config.ads").is_some(),
        "{}",
        repr_opt(sds.get("sds_config"))
    );
    Ok(())
}

/// The Telemetry of components/usage-events.
pub const USAGE_EVENTS_TELEMETRY: &str = "maas-usage-events";

/// components/usage-events, when rendered: its Telemetry selects the Gateway's pods and has them
/// log, to the provider `maas-usage-events` only, only the requests the filter left a usage
/// event (the CEL filter on `wasm.maas_event`; without it every request would be logged).
pub fn usage_events(cx: &Context) -> Verdict {
    let Some(t) = cx
        .docs
        .find("Telemetry", Some(USAGE_EVENTS_TELEMETRY))
        .first()
        .copied()
    else {
        return Ok(());
    };
    let selector = opt(t, "spec.selector.matchLabels");
    let (label, gateway) = super::context::GATEWAY_POD_LABEL;
    ensure!(
        selector == Some(&json!({label: gateway})),
        "Telemetry {USAGE_EVENTS_TELEMETRY} selects {}, expected the Gateway's pods ({label}: {gateway})",
        repr_opt(selector)
    );
    let logs = list_at(t, "spec.accessLogging")?;
    ensure!(
        logs.len() == 1,
        "Telemetry {USAGE_EVENTS_TELEMETRY} has {} accessLogging entries, expected 1",
        logs.len()
    );
    let providers: Vec<Option<&str>> = list_or_empty(&logs[0], "providers")
        .iter()
        .map(|p| opt_str(p, "name"))
        .collect();
    ensure!(
        providers == [Some(USAGE_EVENTS_TELEMETRY)],
        "Telemetry {USAGE_EVENTS_TELEMETRY} logs to {providers:?}, expected the provider {USAGE_EVENTS_TELEMETRY} only"
    );
    let expression = opt_str(&logs[0], "filter.expression");
    let wanted = crate::envoy_config::USAGE_EVENT_FILTER;
    ensure!(
        expression == Some(wanted),
        "Telemetry {USAGE_EVENTS_TELEMETRY} filters on {expression:?}, expected {wanted:?} (requests without a usage event would be logged)"
    );
    Ok(())
}
