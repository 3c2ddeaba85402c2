//! Envoy itself accepts what the EnvoyFilters add to the Gateway's Envoy: the companion cluster
//! (TLS backend on and off; mutual TLS to the internal port in both), in a bootstrap with an ADS
//! source for its SDS secrets, and the connection manager settings merged (as istiod's protobuf
//! MERGE does, field by field) into a connection manager like the one Istio generates. Each is
//! checked by `envoy --mode validate`, and a misspelt copy of each is refused.

use crate::renders::render;
use maas_e2e::manifest_checks::Docs;
use maas_e2e::tools::envoy_bin;
use serde_json::{Value, json};
use std::process::Command;

/// The EnvoyFilter's first patch value.
fn first_patch(docs: &Docs, name: &str) -> Value {
    let ef = docs
        .find("EnvoyFilter", Some(name))
        .first()
        .copied()
        .unwrap_or_else(|| panic!("no EnvoyFilter {name}"));
    ef.pointer("/spec/configPatches/0/patch/value")
        .cloned()
        .unwrap_or_else(|| panic!("EnvoyFilter {name} has no patch value"))
}

/// A bootstrap holding the companion cluster beside an ADS cluster (its SDS source).
fn cluster_bootstrap(docs: &Docs) -> Value {
    let cluster = first_patch(docs, "maas-companion-cluster");
    let xds = json!({"name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 15010}}}}]}]}});
    json!({"node": {"id": "gateway", "cluster": "maas-default-gateway"},
        "dynamic_resources": {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
        "static_resources": {"clusters": [xds, cluster]}})
}

/// Merges `extra` into `base` field by field (maps recursively, everything else replaced).
fn merge(base: &mut Value, extra: &Value) {
    let (Some(base), Some(extra)) = (base.as_object_mut(), extra.as_object()) else {
        return;
    };
    for (k, v) in extra {
        match base.get_mut(k) {
            Some(existing) if existing.is_object() && v.is_object() => merge(existing, v),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

/// A listener whose connection manager has the EnvoyFilter's settings merged in.
fn connection_manager_bootstrap(docs: &Docs) -> Value {
    let hcm_type = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
    let mut hcm = json!({"@type": hcm_type,
        "stat_prefix": "outbound_0.0.0.0_8080", "use_remote_address": true,
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]});
    let ef = docs
        .find("EnvoyFilter", Some("maas-gateway-connection-manager"))
        .first()
        .copied()
        .expect("EnvoyFilter maas-gateway-connection-manager");
    for p in ef["spec"]["configPatches"]
        .as_array()
        .expect("configPatches")
    {
        assert_eq!(p["applyTo"], json!("NETWORK_FILTER"), "{p}");
        assert_eq!(p["patch"]["operation"], json!("MERGE"), "{p}");
        let mut value = p["patch"]["value"]["typed_config"].clone();
        let kind = value.as_object_mut().and_then(|v| v.remove("@type"));
        assert_eq!(kind, Some(json!(hcm_type)));
        merge(&mut hcm, &value);
    }
    json!({"static_resources": {"listeners": [{"name": "gateway", "address": {"socket_address": {
        "address": "127.0.0.1", "port_value": 8080}}, "filter_chains": [{"filters": [{
        "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}]}})
}

/// `envoy --mode validate` on a bootstrap: Ok, or Envoy's complaint.
fn validate(bootstrap: &str) -> Result<(), String> {
    let envoy = envoy_bin().unwrap_or_else(|e| panic!("{e:#}"));
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("bootstrap.json");
    std::fs::write(&file, bootstrap).expect("write");
    let out = Command::new(&envoy)
        .args(["--mode", "validate", "--log-level", "error", "-c"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", envoy.display()));
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn envoy_accepts_the_companion_cluster_with_the_tls_backend_on() {
    validate(&cluster_bootstrap(render("odh")).to_string()).expect("Envoy accepts the cluster");
}

#[test]
fn envoy_accepts_the_companion_cluster_with_the_tls_backend_off() {
    validate(&cluster_bootstrap(render("odh-tls-off")).to_string())
        .expect("Envoy accepts the cluster");
}

#[test]
fn envoy_refuses_a_misspelt_companion_cluster() {
    let good = cluster_bootstrap(render("odh")).to_string();
    let broken = good.replace("\"connect_timeout\"", "\"connect_timout\"");
    assert_ne!(good, broken, "the breakage changed nothing");
    let why = validate(&broken).expect_err("Envoy refuses connect_timout");
    assert!(why.contains("connect_timout"), "{why}");
}

#[test]
fn envoy_accepts_the_connection_manager_settings_the_envoyfilter_merges() {
    validate(&connection_manager_bootstrap(render("odh")).to_string())
        .expect("Envoy accepts headers_with_underscores_action");
}

#[test]
fn envoy_refuses_a_misspelt_connection_manager_setting() {
    let mut bootstrap = connection_manager_bootstrap(render("odh"));
    let hcm = bootstrap
        .pointer_mut("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config")
        .expect("the connection manager");
    hcm["common_http_protocol_options"]["headers_with_underscores_action"] =
        json!("REJECT_REQUESTS");
    let why = validate(&bootstrap.to_string()).expect_err("Envoy refuses REJECT_REQUESTS");
    assert!(why.contains("REJECT_REQUESTS"), "{why}");
}
