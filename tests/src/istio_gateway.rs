//! The Gateway's Envoy as Istio builds it from the EnvoyFilters `wasm-plugin-crs/` ships, on a
//! local bootstrap: for tests that run the shipped objects in the real Envoy with the real
//! `.wasm` (issue 26 items 5 and 11).
//!
//! What istiod and the istio-agent do with them, done here by hand (read in Istio's sources,
//! 1.24–1.30; only a cluster runs their code):
//! - `EXTENSION_CONFIG` / `ADD`: istiod serves the value as an ECDS resource to the proxy that asks
//!   for its name (`envoyfilter::InsertedExtensionConfigurations`); the istio-agent turns a Wasm
//!   config's remote module into a local file (it pulls the OCI image) and removes the
//!   `ISTIO_META_*` variables it read (`pkg/wasm/convert.go`). Here: the ECDS resource is a file
//!   Envoy reads (`path_config_source`), its module the built `.wasm`.
//! - `HTTP_FILTER` / `INSERT_FIRST` under `envoy.filters.network.http_connection_manager`: the
//!   value goes first in every HTTP connection manager's filters; its `ads` config source (the
//!   istio-agent's ADS stream) becomes that file.
//! - `NETWORK_FILTER` / `MERGE` on the connection manager: a protobuf merge of the value's
//!   `typed_config` into the connection manager's (`util.MergeAnyWithAny`): messages merge field
//!   by field, scalars replace; the shipped patch holds no list.
//!
//! The local bootstrap ([`crate::envoy_config::render`]) brings the rest, first stripped of what
//! the shipped objects are meant to add: its own Wasm filter and its underscore setting (Istio
//! up to 1.30 generates neither).

use crate::envoy_config::merge_json;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// The EnvoyFilter installing the filter (ECDS) and the one hardening the connection manager.
pub const FILTER_MANIFEST: &str = "wasm-plugin-crs/base/gateway/filter.yaml";
pub const CONNECTION_MANAGER_MANIFEST: &str =
    "wasm-plugin-crs/base/gateway/connection-manager.yaml";

const HCM: &str = "envoy.filters.network.http_connection_manager";
const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const EXTENSION_CONFIG_TYPE: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";

/// One `configPatches` entry.
#[derive(Debug, Clone)]
pub struct Patch {
    pub apply_to: String,
    pub operation: String,
    /// `match.listener.filterChain.filter.name`, when the patch names one.
    pub filter: Option<String>,
    pub value: Value,
}

/// The patches of the EnvoyFilter in `path` (relative to the workspace root).
pub fn envoyfilter_patches(path: &str) -> Result<Vec<Patch>> {
    let file = crate::tools::workspace_root().join(path);
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let doc: Value =
        yaml_serde::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    if doc["kind"] != "EnvoyFilter" {
        bail!("{path}: not an EnvoyFilter");
    }
    let Some(patches) = doc["spec"]["configPatches"].as_array() else {
        bail!("{path}: no spec.configPatches");
    };
    patches
        .iter()
        .map(|p| {
            let text = |v: &Value| v.as_str().map(str::to_string);
            Ok(Patch {
                apply_to: text(&p["applyTo"]).context("a patch without applyTo")?,
                operation: text(&p["patch"]["operation"]).context("a patch without operation")?,
                filter: text(&p["match"]["listener"]["filterChain"]["filter"]["name"]),
                value: p["patch"]["value"].clone(),
            })
        })
        .collect()
}

/// What the shipped EnvoyFilters add to the Gateway's Envoy.
#[derive(Debug, Clone)]
pub struct ShippedGateway {
    /// The HTTP filter inserted first (its configuration from ECDS).
    pub http_filter: Value,
    /// The ECDS resource (a `TypedExtensionConfig`: name and Wasm filter config), as shipped.
    pub extension_config: Value,
    /// `typed_config` values merged into every HTTP connection manager.
    pub connection_manager_merges: Vec<Value>,
}

impl ShippedGateway {
    /// Reads [`FILTER_MANIFEST`] and [`CONNECTION_MANAGER_MANIFEST`]; fails on any patch this
    /// module would not apply as Istio does.
    pub fn load() -> Result<Self> {
        let mut http_filter = None;
        let mut extension_config = None;
        let mut connection_manager_merges = Vec::new();
        for path in [FILTER_MANIFEST, CONNECTION_MANAGER_MANIFEST] {
            for p in envoyfilter_patches(path)? {
                match (p.apply_to.as_str(), p.operation.as_str()) {
                    ("EXTENSION_CONFIG", "ADD") => extension_config = Some(p.value),
                    ("HTTP_FILTER", "INSERT_FIRST") if p.filter.as_deref() == Some(HCM) => {
                        http_filter = Some(p.value)
                    }
                    ("NETWORK_FILTER", "MERGE") if p.filter.as_deref() == Some(HCM) => {
                        if p.value["typed_config"]["@type"] != HCM_TYPE {
                            bail!(
                                "{path}: a connection manager MERGE whose typed_config is not {HCM_TYPE}"
                            );
                        }
                        let mut typed = p.value["typed_config"].clone();
                        if let Some(o) = typed.as_object_mut() {
                            o.remove("@type");
                        }
                        connection_manager_merges.push(typed);
                    }
                    (a, o) => bail!("{path}: a {a}/{o} patch this harness does not apply"),
                }
            }
        }
        let http_filter = http_filter.context("no HTTP_FILTER INSERT_FIRST patch")?;
        let extension_config = extension_config.context("no EXTENSION_CONFIG ADD patch")?;
        if http_filter["name"] != extension_config["name"] {
            bail!(
                "the HTTP filter asks ECDS for {} but the extension config is named {}",
                http_filter["name"],
                extension_config["name"]
            );
        }
        if extension_config["typed_config"]["@type"] != WASM_TYPE {
            bail!("the extension config is not a Wasm HTTP filter");
        }
        Ok(ShippedGateway {
            http_filter,
            extension_config,
            connection_manager_merges,
        })
    }

    /// The ECDS resource as the istio-agent hands it to Envoy: the remote module replaced by
    /// `wasm` (a local file), the `ISTIO_META_*` variables removed (the environment dropped when
    /// nothing is left), everything else as shipped.
    pub fn agent_converted_extension_config(&self, wasm: &Path) -> Result<Value> {
        let mut ec = self.extension_config.clone();
        let vm = &mut ec["typed_config"]["config"]["vm_config"];
        if vm["code"]["remote"]["http_uri"]["uri"].as_str().is_none() {
            bail!("the shipped Wasm config has no remote module (vm_config.code.remote)");
        }
        vm["code"] = json!({"local": {"filename": wasm.to_string_lossy()}});
        if let Some(vm) = vm.as_object_mut() {
            let left = vm
                .get_mut("environment_variables")
                .and_then(|e| e.get_mut("key_values"))
                .and_then(Value::as_object_mut)
                .map(|kv| {
                    kv.retain(|k, _| !k.starts_with("ISTIO_META_"));
                    kv.len()
                });
            if left == Some(0) {
                vm.remove("environment_variables");
            }
        }
        Ok(ec)
    }
}

/// Merges `extra` over the pluginConfig (the JSON `configuration.value`) of an extension config.
pub fn merge_extension_plugin_config(extension_config: &mut Value, extra: &Value) -> Result<()> {
    let value = &mut extension_config["typed_config"]["config"]["configuration"]["value"];
    let mut plugin: Value = serde_json::from_str(value.as_str().unwrap_or(""))
        .context("the extension config's pluginConfig is not JSON")?;
    merge_json(&mut plugin, extra);
    *value = Value::String(plugin.to_string());
    Ok(())
}

/// The extension config's Wasm `PluginConfig` (to change a knob in a test).
pub fn wasm_plugin_config_mut(
    extension_config: &mut Value,
) -> Option<&mut serde_json::Map<String, Value>> {
    extension_config["typed_config"]["config"].as_object_mut()
}

/// Writes the ECDS file Envoy reads: a discovery response holding `extension_config`.
pub fn write_ecds_file(path: &Path, extension_config: &Value) -> Result<()> {
    let mut resource = extension_config.clone();
    if let Some(o) = resource.as_object_mut() {
        o.insert("@type".into(), json!(EXTENSION_CONFIG_TYPE));
    }
    let response = json!({"version_info": "1", "resources": [resource]});
    std::fs::write(path, serde_json::to_string_pretty(&response)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Turns a rendered local bootstrap into the Gateway as Istio builds it with the shipped
/// EnvoyFilters: in every HTTP connection manager the local Wasm filter and underscore setting
/// go, the shipped HTTP filter goes first (its ECDS source the file `ecds`), the shipped
/// connection-manager settings are merged in.
pub fn apply(bootstrap: &mut Value, shipped: &ShippedGateway, ecds: &Path) -> Result<()> {
    let Some(listeners) = bootstrap
        .pointer_mut("/static_resources/listeners")
        .and_then(Value::as_array_mut)
    else {
        bail!("no listeners in the bootstrap");
    };
    let mut managers = 0;
    for listener in listeners {
        let Some(chains) = listener["filter_chains"].as_array_mut() else {
            continue;
        };
        for chain in chains {
            let Some(filters) = chain["filters"].as_array_mut() else {
                continue;
            };
            for filter in filters.iter_mut().filter(|f| f["name"] == HCM) {
                let hcm = &mut filter["typed_config"];
                if let Some(options) = hcm
                    .get_mut("common_http_protocol_options")
                    .and_then(Value::as_object_mut)
                {
                    options.remove("headers_with_underscores_action");
                }
                let Some(http_filters) = hcm["http_filters"].as_array_mut() else {
                    bail!("a connection manager without http_filters");
                };
                http_filters.retain(|f| f["name"] != "envoy.filters.http.wasm");
                let mut inserted = shipped.http_filter.clone();
                let source = &mut inserted["config_discovery"]["config_source"];
                let Some(source_map) = source.as_object_mut() else {
                    bail!("the shipped HTTP filter has no config_discovery.config_source");
                };
                if source_map.remove("ads").is_none() {
                    bail!("the shipped HTTP filter's config source is not ADS");
                }
                source_map.insert(
                    "path_config_source".into(),
                    json!({"path": ecds.to_string_lossy()}),
                );
                http_filters.insert(0, inserted);
                for merge in &shipped.connection_manager_merges {
                    merge_json(hcm, merge);
                }
                managers += 1;
            }
        }
    }
    if managers == 0 {
        bail!("no HTTP connection manager in the bootstrap");
    }
    Ok(())
}

/// The model HTTPRoutes `wasm-plugin-crs/` ships as samples (each a prefix rule and the one base
/// URL's `/v1` rule matching `x-maas-model`; the weighted model's, with routed backends, per
/// backend its rules matching `x-maas-model` and `x-maas-backend`).
pub const MODEL_ROUTE_SAMPLES: [&str; 5] = [
    "wasm-plugin-crs/samples/kserve-model/httproute.yaml",
    "wasm-plugin-crs/samples/external-model/httproute.yaml",
    "wasm-plugin-crs/samples/azure-openai-model/httproute.yaml",
    "wasm-plugin-crs/samples/bedrock-model/httproute.yaml",
    "wasm-plugin-crs/samples/weighted-model/httproute.yaml",
];

/// The HTTPRoute in `path` (relative to the workspace root).
pub fn load_httproute(path: &str) -> Result<Value> {
    let file = crate::tools::workspace_root().join(path);
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let doc: Value =
        yaml_serde::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    if doc["kind"] != "HTTPRoute" {
        bail!("{path}: not an HTTPRoute");
    }
    Ok(doc)
}

/// The Envoy cluster Istio gives a backendRef (`outbound|<port>||<host>`): a Service's host is
/// `<name>.<namespace>.svc.cluster.local` (the route's namespace unless the ref names one), an
/// Istio `Hostname` (a ServiceEntry host) is its name as written.
pub fn istio_cluster(backend_ref: &Value, route_namespace: &str) -> Result<String> {
    let group = backend_ref["group"].as_str().unwrap_or("");
    let kind = backend_ref["kind"].as_str().unwrap_or("Service");
    let name = backend_ref["name"]
        .as_str()
        .context("a backendRef without a name")?;
    let port = backend_ref["port"]
        .as_u64()
        .context("a backendRef without a port")?;
    let host = match (group, kind) {
        ("", "Service") => {
            let ns = backend_ref["namespace"].as_str().unwrap_or(route_namespace);
            format!("{name}.{ns}.svc.cluster.local")
        }
        ("networking.istio.io", "Hostname") => name.to_string(),
        (g, k) => bail!("a backendRef of {g}/{k}: not translated"),
    };
    Ok(format!("outbound|{port}||{host}"))
}

/// Go's `regexp.QuoteMeta` (Istio quotes the matched prefix with it).
fn quote_meta(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if r"\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A Gateway API duration (`300s`, `1m`, `1h30m`) as Envoy's (seconds).
fn envoy_duration(text: &str) -> Result<String> {
    let re = regex::Regex::new(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$").context("regex")?;
    let caps = re
        .captures(text)
        .filter(|_| !text.is_empty())
        .with_context(|| format!("the duration {text:?}: not translated"))?;
    let part = |i: usize, unit: u64| -> u64 {
        caps.get(i)
            .and_then(|m| m.as_str().parse::<u64>().ok())
            .unwrap_or(0)
            * unit
    };
    Ok(format!("{}s", part(1, 3600) + part(2, 60) + part(3, 1)))
}

/// One HTTPRoute match as Istio's route match (`TranslateRouteMatch` with Gateway semantics): a
/// `PathPrefix` other than `/` becomes `path_separated_prefix` (trailing `/` trimmed), `Exact` a
/// `path`; header matches sorted by (lower-cased) name; case-sensitive.
fn istio_match(m: &Value) -> Result<Value> {
    let path_type = m["path"]["type"].as_str().unwrap_or("PathPrefix");
    let value = m["path"]["value"].as_str().unwrap_or("/");
    let mut out = match path_type {
        "PathPrefix" if value != "/" => {
            json!({"path_separated_prefix": value.trim_end_matches('/')})
        }
        "PathPrefix" => json!({"prefix": "/"}),
        "Exact" => json!({"path": value}),
        t => bail!("a {t} path match: not translated"),
    };
    let mut headers = Vec::new();
    for h in m["headers"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let name = h["name"]
            .as_str()
            .context("a header match without a name")?
            .to_ascii_lowercase();
        let value = h["value"]
            .as_str()
            .context("a header match without a value")?;
        let string_match = match h["type"].as_str().unwrap_or("Exact") {
            "Exact" => json!({"exact": value}),
            "RegularExpression" => json!({"safe_regex": {"regex": value}}),
            t => bail!("a {t} header match: not translated"),
        };
        headers.push(json!({"name": name, "string_match": string_match}));
    }
    if m.get("queryParams").is_some() || m.get("method").is_some() {
        bail!("query or method matches: not translated");
    }
    headers.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    if !headers.is_empty() {
        out["headers"] = json!(headers);
    }
    out["case_sensitive"] = json!(true);
    Ok(out)
}

/// The retry policy Istio gives a route when neither the route nor the mesh sets one (mesh
/// default: 2 attempts on connection failures and 503).
fn istio_default_retry_policy() -> Value {
    json!({
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": 2,
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}
        }],
        "host_selection_retry_max_attempts": "5",
        "retriable_status_codes": [503]
    })
}

/// The Envoy routes Istio generates for one HTTPRoute (its gateway conversion, then
/// `translateRoute`): one route per match of each rule, named `<ns>.<name>.<rule index>`;
/// `URLRewrite` hostname → `host_rewrite_literal`, `ReplacePrefixMatch: /` → a `regex_rewrite`
/// removing the matched prefix (`^<prefix>(/?)(.*)` → `/\2`), another prefix → `prefix_rewrite`;
/// `RequestHeaderModifier` remove → `request_headers_to_remove`; the single backendRef → its
/// `outbound|…` cluster (unknown cluster → 500); `timeouts.request` → `timeout` (none: no
/// timeout). What this does not translate (weights, mirrors, redirects, set/add headers…) is an
/// error, not skipped.
pub fn istio_routes(httproute: &Value) -> Result<Vec<Value>> {
    let ns = httproute["metadata"]["namespace"]
        .as_str()
        .context("an HTTPRoute without a namespace")?;
    let name = httproute["metadata"]["name"]
        .as_str()
        .context("an HTTPRoute without a name")?;
    let rules = httproute["spec"]["rules"]
        .as_array()
        .with_context(|| format!("HTTPRoute {ns}/{name}: no rules"))?;
    let mut out = Vec::new();
    for (i, rule) in rules.iter().enumerate() {
        let route_name = format!("{ns}.{name}.{i}");
        let refs = rule["backendRefs"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let [backend] = refs else {
            bail!(
                "{route_name}: {} backendRefs, only one is translated",
                refs.len()
            );
        };
        let timeout = match rule["timeouts"]["request"].as_str() {
            Some(t) => envoy_duration(t)?,
            None => "0s".to_string(),
        };
        let mut action = json!({
            "cluster": istio_cluster(backend, ns)?,
            "timeout": timeout,
            "cluster_not_found_response_code": "INTERNAL_SERVER_ERROR",
            "retry_policy": istio_default_retry_policy(),
        });
        let mut remove = Vec::new();
        let mut path_rewrite = None;
        for f in rule["filters"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            match f["type"].as_str() {
                Some("URLRewrite") => {
                    let rw = &f["urlRewrite"];
                    if let Some(host) = rw["hostname"].as_str() {
                        action["host_rewrite_literal"] = json!(host);
                    }
                    if let Some(path) = rw.get("path") {
                        match path["type"].as_str() {
                            Some("ReplacePrefixMatch") => {
                                path_rewrite = Some(
                                    path["replacePrefixMatch"]
                                        .as_str()
                                        .unwrap_or("/")
                                        .to_string(),
                                )
                            }
                            t => bail!("{route_name}: a {t:?} path rewrite: not translated"),
                        }
                    }
                }
                Some("RequestHeaderModifier") => {
                    let m = &f["requestHeaderModifier"];
                    if m.get("set").is_some() || m.get("add").is_some() {
                        bail!("{route_name}: setting or adding headers: not translated");
                    }
                    for h in m["remove"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                        let h = h.as_str().context("a header to remove that is not text")?;
                        remove.push(json!(h.to_ascii_lowercase()));
                    }
                }
                t => bail!("{route_name}: a {t:?} filter: not translated"),
            }
        }
        let matches = match rule["matches"].as_array() {
            Some(m) if !m.is_empty() => m.clone(),
            _ => vec![json!({"path": {"type": "PathPrefix", "value": "/"}})],
        };
        for m in &matches {
            let route_match = istio_match(m)?;
            let mut action = action.clone();
            match path_rewrite.as_deref() {
                None => {}
                Some("/") => {
                    let Some(prefix) = route_match["path_separated_prefix"].as_str() else {
                        bail!("{route_name}: ReplacePrefixMatch without a path prefix");
                    };
                    action["regex_rewrite"] = json!({
                        "pattern": {"regex": format!("^{}(/?)(.*)", quote_meta(prefix))},
                        "substitution": "/\\2"
                    });
                }
                Some(other) => action["prefix_rewrite"] = json!(other),
            }
            let mut route = json!({"name": route_name, "match": route_match, "route": action});
            if !remove.is_empty() {
                route["request_headers_to_remove"] = json!(remove);
            }
            out.push(route);
        }
    }
    Ok(out)
}

/// The routes of several HTTPRoutes on one Gateway host in Istio's order (Gateway API
/// precedence, `sortHTTPRoutes`): exact paths first, then longer path prefixes, then more header
/// matches; otherwise as given.
pub fn istio_gateway_routes(httproutes: &[Value]) -> Result<Vec<Value>> {
    let mut routes = Vec::new();
    for r in httproutes {
        routes.extend(istio_routes(r)?);
    }
    let key = |r: &Value| {
        let m = &r["match"];
        let exact = m.get("path").is_some();
        let len = m["path"]
            .as_str()
            .or(m["path_separated_prefix"].as_str())
            .or(m["prefix"].as_str())
            .map_or(0, str::len);
        let headers = m["headers"].as_array().map_or(0, Vec::len);
        (!exact, std::cmp::Reverse(len), std::cmp::Reverse(headers))
    };
    routes.sort_by_key(key);
    Ok(routes)
}

/// Replaces the model routes of a rendered local bootstrap (every route to a cluster other than
/// the companion's) with `routes`, before the catch-all 404, and points each cluster in
/// `clusters` (name, address; replacing one of that name) at a plain HTTP endpoint.
pub fn replace_model_routes(
    bootstrap: &mut Value,
    routes: Vec<Value>,
    clusters: &[(String, std::net::SocketAddr)],
) -> Result<()> {
    let Some(local) = crate::envoy_config::routes_mut(bootstrap) else {
        bail!("no routes in the bootstrap");
    };
    let companion = |r: &Value| {
        r["route"]["cluster"] == crate::envoy_config::COMPANION_PUBLIC_CLUSTER
            || r["route"]["cluster"] == crate::envoy_config::COMPANION_INTERNAL_CLUSTER
    };
    let Some(catch_all) = local.pop().filter(|r| r["match"] == json!({"prefix": "/"})) else {
        bail!("the bootstrap's last route is not the catch-all");
    };
    local.retain(|r| r.get("direct_response").is_some() || companion(r));
    local.extend(routes);
    local.push(catch_all);
    let Some(all) = bootstrap
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
    else {
        bail!("no clusters in the bootstrap");
    };
    all.retain(|c| !clusters.iter().any(|(name, _)| c["name"] == name.as_str()));
    for (name, addr) in clusters {
        crate::envoy_config::add_addr_cluster(bootstrap, name, *addr)?;
    }
    Ok(())
}

/// Where the built filter is, for the agent's local copy.
pub fn wasm_path() -> Result<PathBuf> {
    crate::tools::wasm_file()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envoy_config::{EnvoyConfigInput, WasmFilterOptions, render};
    use maas_types::PolicyDocument;
    use std::net::SocketAddr;

    #[test]
    fn the_shipped_objects_load_and_apply_as_istio_would() {
        let shipped = ShippedGateway::load().unwrap();
        let cfg = &shipped.extension_config["typed_config"]["config"];
        assert_eq!(cfg["allow_on_headers_stop_iteration"], true);
        let plugin: Value =
            serde_json::from_str(cfg["configuration"]["value"].as_str().unwrap()).unwrap();
        assert_eq!(plugin["pauseHeadersForBody"], true);
        let converted = shipped
            .agent_converted_extension_config(Path::new("/m.wasm"))
            .unwrap();
        let vm = &converted["typed_config"]["config"]["vm_config"];
        assert_eq!(vm["code"]["local"]["filename"], "/m.wasm");
        assert!(vm.get("environment_variables").is_none(), "{vm}");

        let policy = PolicyDocument::from_value(json!({
            "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
            "models": [{"name": "sim", "path": "/llm/sim", "tiers": ["free"]}]
        }))
        .unwrap();
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let mut v: Value = serde_json::from_str(
            &render(&EnvoyConfigInput {
                policy: &policy,
                listen: a(8080),
                admin: a(9901),
                companion_public: a(7001),
                companion_internal: a(7002),
                simulator: a(7003),
                filter: Some(WasmFilterOptions {
                    wasm_path: "/x.wasm".into(),
                    poll_interval_ms: 500,
                }),
                companion_tls: None,
                usage_events_path: None,
            })
            .unwrap(),
        )
        .unwrap();
        apply(&mut v, &shipped, Path::new("/tmp/ecds.json")).unwrap();
        let hcm = &v["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        let names: Vec<&str> = hcm["http_filters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["maas-filter", "envoy.filters.http.router"]);
        assert_eq!(
            hcm["http_filters"][0]["config_discovery"]["config_source"]["path_config_source"]["path"],
            "/tmp/ecds.json"
        );
        assert_eq!(
            hcm["common_http_protocol_options"]["headers_with_underscores_action"],
            "REJECT_REQUEST",
            "from the shipped MERGE"
        );
        assert_eq!(hcm["stream_idle_timeout"], "300s", "the rest kept");
    }

    /// The sample HTTPRoutes as Istio translates them: each model's prefix route and its one base
    /// URL route (`/v1` with `x-maas-model` naming the policy's model, the header removed before
    /// the backend, the path kept) — and the Azure sample's provider-path route — all to the
    /// cluster the sample policy names as the model's `upstreamCluster`.
    #[test]
    fn the_sample_httproutes_translate_as_istio_would() {
        let routes = sample_routes();
        let named = |n: &str| named_route(&routes, n);
        let kserve = "outbound|80||facebook-opt-125m-simulated-predictor.llm.svc.cluster.local";
        let prefix = named("llm.facebook-opt-125m-simulated.0");
        assert_eq!(
            prefix["match"],
            json!({"path_separated_prefix": "/llm/facebook-opt-125m-simulated", "case_sensitive": true})
        );
        assert_eq!(prefix["route"]["cluster"], kserve);
        assert_eq!(
            prefix["route"]["regex_rewrite"]["pattern"]["regex"],
            "^/llm/facebook-opt-125m-simulated(/?)(.*)"
        );
        assert_eq!(prefix["route"]["timeout"], "300s");
        let one_url = named("llm.facebook-opt-125m-simulated.1");
        assert_eq!(
            one_url["match"],
            json!({"path_separated_prefix": "/v1", "case_sensitive": true, "headers": [
                {"name": "x-maas-model", "string_match": {"exact": "facebook/opt-125m"}}
            ]})
        );
        assert_eq!(one_url["route"]["cluster"], kserve);
        assert!(one_url["route"].get("regex_rewrite").is_none(), "{one_url}");
        assert!(
            one_url["route"].get("prefix_rewrite").is_none(),
            "{one_url}"
        );
        assert_eq!(
            one_url["request_headers_to_remove"],
            json!(["x-maas-model"])
        );
        assert_eq!(one_url["route"]["timeout"], "300s");

        let openai = named("llm.gpt-4o.1");
        assert_eq!(
            openai["match"]["headers"],
            json!([{"name": "x-maas-model", "string_match": {"exact": "gpt-4o"}}])
        );
        assert_eq!(openai["route"]["cluster"], "outbound|443||api.openai.com");
        assert_eq!(openai["route"]["host_rewrite_literal"], "api.openai.com");
        assert_eq!(openai["request_headers_to_remove"], json!(["x-maas-model"]));
        assert_eq!(
            named("llm.gpt-4o.0")["route"]["host_rewrite_literal"],
            "api.openai.com"
        );
        // The Azure sample's provider path: the filter's rewrite with the header, kept as sent.
        let azure = named("llm.gpt-4o-azure.2");
        assert_eq!(
            azure["match"],
            json!({"path_separated_prefix": "/openai/deployments/gpt-4o-prod", "case_sensitive": true,
                   "headers": [{"name": "x-maas-model", "string_match": {"exact": "gpt-4o-azure"}}]})
        );
        assert_eq!(
            azure["route"]["cluster"],
            "outbound|443||example-resource.openai.azure.com"
        );
        assert!(azure["route"].get("regex_rewrite").is_none(), "{azure}");
        assert_eq!(azure["request_headers_to_remove"], json!(["x-maas-model"]));

        // Each routing-header route names a model of the sample policy (and, for routed
        // backends, one of its backends), and leads to the cluster that model's (or backend's)
        // upstreamCluster names (else the filter answers 503 upstream_mismatch).
        let policy = sample_policy();
        for r in routes.iter().filter(|r| r["match"]["headers"].is_array()) {
            let header = |name: &str| {
                r["match"]["headers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|h| h["name"] == name)
                    .map(|h| h["string_match"]["exact"].as_str().unwrap())
            };
            let model = header(maas_types::MODEL_ROUTING_HEADER).unwrap();
            let entry = policy["models"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["name"] == model)
                .unwrap_or_else(|| panic!("{model}: not a model of the sample policy"));
            let entry = match header(maas_types::BACKEND_ROUTING_HEADER) {
                None => entry,
                Some(b) => entry["backends"]
                    .as_array()
                    .and_then(|all| all.iter().find(|x| x["name"] == b))
                    .unwrap_or_else(|| panic!("{model}: no backend {b}")),
            };
            assert_eq!(entry["upstreamCluster"], r["route"]["cluster"], "{model}");
        }
    }

    /// The sample policy (ConfigMap maas-policy's policy.yaml), checked as the companion reads
    /// it.
    fn sample_policy() -> Value {
        let text = std::fs::read_to_string(
            crate::tools::workspace_root()
                .join("wasm-plugin-crs/base/companion/policy-configmap.yaml"),
        )
        .unwrap();
        let cm: Value = yaml_serde::from_str(&text).unwrap();
        let policy: Value =
            yaml_serde::from_str(cm["data"]["policy.yaml"].as_str().unwrap()).unwrap();
        if let Err(e) = PolicyDocument::from_value(policy.clone()) {
            panic!("the sample policy does not validate: {e}");
        }
        policy
    }

    /// The weighted sample (routed backends) as Istio translates it: per backend, routes
    /// matching both routing headers — the model's prefix (stripped), the one base URL and,
    /// for Azure, the deployment path (both kept) — to that backend's cluster, both headers
    /// removed; sorted before the model's plain prefix route (more headers), which goes to the
    /// first backend.
    #[test]
    fn the_weighted_sample_translates_as_istio_would() {
        let routes = sample_routes();
        let named = |n: &str| named_route(&routes, n);
        let openai = "outbound|443||api.openai.com";
        let azure = "outbound|443||example-resource.openai.azure.com";
        let headers = |backend: &str| {
            json!([
                {"name": "x-maas-backend", "string_match": {"exact": backend}},
                {"name": "x-maas-model", "string_match": {"exact": "gpt-4o-split"}}
            ])
        };
        for (route, prefix, backend, cluster, strips) in [
            (
                "llm.gpt-4o-split.0",
                "/llm/gpt-4o-split",
                "openai",
                openai,
                true,
            ),
            ("llm.gpt-4o-split.1", "/v1", "openai", openai, false),
            (
                "llm.gpt-4o-split.2",
                "/llm/gpt-4o-split",
                "azure",
                azure,
                true,
            ),
            ("llm.gpt-4o-split.3", "/v1", "azure", azure, false),
            (
                "llm.gpt-4o-split.4",
                "/openai/deployments/gpt-4o-prod",
                "azure",
                azure,
                false,
            ),
        ] {
            let r = named(route);
            assert_eq!(
                r["match"],
                json!({"path_separated_prefix": prefix, "case_sensitive": true,
                       "headers": headers(backend)}),
                "{route}"
            );
            assert_eq!(r["route"]["cluster"], cluster, "{route}");
            assert_eq!(
                r["route"]["host_rewrite_literal"],
                cluster.trim_start_matches("outbound|443||"),
                "{route}"
            );
            assert_eq!(
                r["request_headers_to_remove"],
                json!(["x-maas-model", "x-maas-backend"]),
                "{route}"
            );
            assert_eq!(
                r["route"].get("regex_rewrite").is_some(),
                strips,
                "{route}: {r}"
            );
            assert_eq!(r["route"]["timeout"], "300s");
        }
        let plain = named("llm.gpt-4o-split.5");
        assert_eq!(
            plain["match"],
            json!({"path_separated_prefix": "/llm/gpt-4o-split", "case_sensitive": true})
        );
        assert_eq!(plain["route"]["cluster"], openai);
        let at = |n: &str| routes.iter().position(|r| r["name"] == n).unwrap();
        assert!(at("llm.gpt-4o-split.0") < at("llm.gpt-4o-split.5"));
        assert!(at("llm.gpt-4o-split.2") < at("llm.gpt-4o-split.5"));
    }

    /// Every sample HTTPRoute's routes, as Istio translates them.
    fn sample_routes() -> Vec<Value> {
        let samples: Vec<Value> = MODEL_ROUTE_SAMPLES
            .iter()
            .map(|p| load_httproute(p).unwrap())
            .collect();
        istio_gateway_routes(&samples).unwrap()
    }

    fn named_route<'r>(routes: &'r [Value], name: &str) -> &'r Value {
        routes
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("no route {name} in {routes:#?}"))
    }

    /// The Bedrock sample's signed path as Istio translates it (by the header, to Bedrock,
    /// nothing rewritten but the host the filter signed), and every sample's routes in the
    /// order Istio sorts them.
    #[test]
    fn the_bedrock_sample_translates_and_the_routes_sort_as_istio_would() {
        let routes = sample_routes();
        let named = |n: &str| named_route(&routes, n);
        // The Bedrock sample's signed path: by the header, to Bedrock, nothing rewritten but the
        // host the filter signed.
        let bedrock = named("llm.claude-bedrock.2");
        assert_eq!(
            bedrock["match"],
            json!({"path_separated_prefix": "/model", "case_sensitive": true,
                   "headers": [{"name": "x-maas-model", "string_match": {"exact": "claude-bedrock"}}]})
        );
        assert_eq!(
            bedrock["route"]["cluster"],
            "outbound|443||bedrock-runtime.us-east-1.amazonaws.com"
        );
        assert!(bedrock["route"].get("regex_rewrite").is_none(), "{bedrock}");
        assert_eq!(
            bedrock["request_headers_to_remove"],
            json!(["x-maas-model"])
        );
        // Longer prefixes first, more headers first at one prefix; the /v1 routes last.
        let order: Vec<&str> = routes.iter().map(|r| r["name"].as_str().unwrap()).collect();
        assert_eq!(
            order,
            [
                "llm.facebook-opt-125m-simulated.0",
                "llm.gpt-4o-split.4",
                "llm.gpt-4o-azure.2",
                "llm.claude-bedrock.0",
                "llm.gpt-4o-split.0",
                "llm.gpt-4o-split.2",
                "llm.gpt-4o-azure.0",
                "llm.gpt-4o-split.5",
                "llm.gpt-4o.0",
                "llm.claude-bedrock.2",
                "llm.gpt-4o-split.1",
                "llm.gpt-4o-split.3",
                "llm.facebook-opt-125m-simulated.1",
                "llm.gpt-4o.1",
                "llm.gpt-4o-azure.1",
                "llm.claude-bedrock.1"
            ]
        );
    }

    #[test]
    fn what_is_not_translated_is_refused() {
        let route = |rule: Value| {
            json!({"kind": "HTTPRoute", "metadata": {"name": "r", "namespace": "n"},
                   "spec": {"rules": [rule]}})
        };
        let backend = json!([{"name": "svc", "port": 80}]);
        let ok = istio_routes(&route(json!({"backendRefs": backend}))).unwrap();
        assert_eq!(
            ok[0]["route"]["cluster"],
            "outbound|80||svc.n.svc.cluster.local"
        );
        assert_eq!(
            ok[0]["match"],
            json!({"prefix": "/", "case_sensitive": true})
        );
        for bad in [
            json!({"backendRefs": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]}),
            json!({"backendRefs": backend, "filters": [{"type": "RequestMirror"}]}),
            json!({"backendRefs": backend, "filters": [{"type": "RequestHeaderModifier",
                   "requestHeaderModifier": {"set": [{"name": "a", "value": "b"}]}}]}),
            json!({"backendRefs": backend, "matches": [{"method": "POST"}]}),
            json!({"backendRefs": [{"kind": "Pod", "name": "p", "port": 80}]}),
            json!({"backendRefs": backend, "timeouts": {"request": "5 minutes"}}),
        ] {
            assert!(istio_routes(&route(bad.clone())).is_err(), "{bad}");
        }
        assert_eq!(envoy_duration("1h2m3s").unwrap(), "3723s");
        assert_eq!(quote_meta("/a-b.c"), r"/a-b\.c");
    }
}
