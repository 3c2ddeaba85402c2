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
}
