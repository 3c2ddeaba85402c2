//! Monitoring: the ServiceMonitor and PodMonitor scrape the right ports, and every alert and
//! every Grafana panel names only metrics the filter and the companion export (read from their
//! sources, so a renamed metric fails here rather than in a silent dashboard).

use super::context::GATEWAY_POD_LABEL;
use super::context::{COMPANION, Context, Tls};
use super::docs::{
    Docs, Verdict, at, ensure, labels_match, list_at, list_or_empty, namespace_of, opt, opt_str,
    repr, repr_opt, string_map, truthy,
};
use regex::Regex;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::LazyLock;

/// A metric name of ours in a PromQL expression (Envoy prints the filter's without a prefix).
static METRIC: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(?:maas|gen_ai)_[a-z0-9_]+").expect("a valid regex"));

/// The alerts the PrometheusRules must hold.
const ALERTS: [&str; 10] = [
    "MaaSCompanionDown",
    "MaaSFilterUnavailableDecisionsRising",
    "MaaSFilterCalloutFailures",
    "MaaSPolicyRejected",
    "MaaSFilterPolicyRejected",
    "MaaSLeaseStoreDown",
    "MaaSGatewayLeaseFallback",
    "MaaSFilterHeadersNotHeld",
    "MaaSAuthFailureRateHigh",
    "MaaSGatewayAddedLatencyHigh",
];

/// The `.rs` files under `dir`, recursively, in name order.
fn rust_sources(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            out.extend(rust_sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs")
            && let Ok(text) = std::fs::read_to_string(&path)
        {
            out.push((path.display().to_string(), text));
        }
    }
    out
}

/// Metric names as Prometheus sees them, read from the filter's and the companion's sources:
/// the filter's `pub const …: &str = "maas_…"` and its labelled families' `name: "…"`, with
/// Envoy's histogram suffixes; the companion's registered names with OpenMetrics' suffixes.
pub fn exported_metrics(repo_root: &Path) -> Result<BTreeSet<String>, String> {
    let constant = Regex::new(r#"pub const [A-Z_]+: &str = "(maas_[a-z0-9_]+)""#)
        .map_err(|e| e.to_string())?;
    let family =
        Regex::new(r#"name: "((?:maas|gen_ai)_[a-z0-9_]+)""#).map_err(|e| e.to_string())?;
    let registered =
        Regex::new(r#"register\(\s*"(maas_[a-z0-9_]+)""#).map_err(|e| e.to_string())?;
    let filter = rust_sources(&repo_root.join("filter/src"));
    let mut base = BTreeSet::new();
    for (path, text) in &filter {
        if path.contains("metrics") {
            base.extend(constant.captures_iter(text).map(|c| c[1].to_string()));
            base.extend(family.captures_iter(text).map(|c| c[1].to_string()));
        }
    }
    let mut known = BTreeSet::new();
    for name in &base {
        for suffix in ["", "_bucket", "_sum", "_count"] {
            known.insert(format!("{name}{suffix}"));
        }
    }
    for (_, text) in rust_sources(&repo_root.join("companion/src")) {
        for c in registered.captures_iter(&text) {
            for suffix in ["", "_total", "_bucket", "_sum", "_count", "_created"] {
                known.insert(format!("{}{suffix}", &c[1]));
            }
        }
    }
    ensure!(
        known.len() > 20,
        "could not read the metric names from the sources ({})",
        repr(&json!(known))
    );
    Ok(known)
}

/// ServiceMonitor on the metrics port (HTTPS with TLS on), PodMonitor on the Gateway's Envoy,
/// alerts on exported metrics only.
pub fn monitoring(cx: &Context) -> Verdict {
    let sm = cx.docs.one("ServiceMonitor", COMPANION)?;
    ensure!(
        namespace_of(sm) == Some(cx.ns.as_str()),
        "ServiceMonitor not beside the companion"
    );
    ensure!(
        labels_match(opt(sm, "spec.selector"), opt(cx.svc, "metadata.labels")),
        "the ServiceMonitor does not select the companion Service"
    );
    let names: Vec<&Value> = list_at(cx.svc, "spec.ports")?
        .iter()
        .map(|p| p.get("name").unwrap_or(&Value::Null))
        .collect();
    for ep in list_at(sm, "spec.endpoints")? {
        let port = at(ep, "port")?;
        ensure!(
            port == &json!("metrics") && names.contains(&port),
            "scrapes port {}",
            port.as_str().unwrap_or("None")
        );
        scrape_scheme(cx, ep)?;
    }
    let pm = cx.docs.one("PodMonitor", "maas-gateway-envoy")?;
    let selector = at(pm, "spec.selector")?;
    ensure!(
        selector == &json!({"matchLabels": string_map(&[GATEWAY_POD_LABEL])}),
        "{}",
        repr(selector)
    );
    let paths: Vec<Value> = list_at(pm, "spec.podMetricsEndpoints")?
        .iter()
        .map(|e| e.get("path").cloned().unwrap_or(Value::Null))
        .collect();
    ensure!(
        paths == [json!("/stats/prometheus")],
        "{}",
        repr(&json!(paths))
    );
    alerts_on_known_metrics(cx)?;
    gateway_stat_tags(cx.docs, cx.repo_root)
}

fn scrape_scheme(cx: &Context, ep: &Value) -> Verdict {
    match cx.options.tls {
        Tls::On => {
            ensure!(
                opt_str(ep, "scheme") == Some("https"),
                "TLS on but Prometheus scrapes plain HTTP"
            );
            let tls = opt(ep, "tlsConfig");
            ensure!(
                opt_str(ep, "tlsConfig.serverName") == Some(&format!("{COMPANION}.{}.svc", cx.ns)),
                "{}",
                repr_opt(tls)
            );
            ensure!(
                opt_str(ep, "tlsConfig.ca.configMap.name") == Some("maas-service-ca"),
                "{}",
                repr_opt(tls)
            );
        }
        Tls::Off => ensure!(
            opt_str(ep, "scheme").unwrap_or("http") == "http",
            "TLS off but Prometheus scrapes HTTPS"
        ),
        Tls::Any => {}
    }
    Ok(())
}

fn alerts_on_known_metrics(cx: &Context) -> Verdict {
    let known = exported_metrics(cx.repo_root)?;
    // Label values ("…") may hold anything: only the names outside them are metrics.
    let quoted = Regex::new(r#""(\\.|[^"\\])*""#).map_err(|e| e.to_string())?;
    let mut alerts = BTreeSet::new();
    for rules in cx.docs.all("PrometheusRule") {
        for group in list_at(rules, "spec.groups")? {
            for rule in list_at(group, "rules")? {
                let alert = opt_str(rule, "alert");
                alerts.extend(alert);
                let expr = match at(rule, "expr")? {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let expr = quoted.replace_all(&expr, "\"\"");
                for metric in METRIC.find_iter(&expr) {
                    ensure!(
                        known.contains(metric.as_str()),
                        "alert {} uses unknown metric {} (not exported by the filter or companion)",
                        alert.unwrap_or("None"),
                        metric.as_str()
                    );
                }
            }
        }
    }
    let missing: Vec<&str> = ALERTS
        .iter()
        .filter(|a| !alerts.contains(**a))
        .copied()
        .collect();
    ensure!(
        missing.is_empty(),
        "missing alerts {}",
        repr(&json!(missing))
    );
    Ok(())
}

/// The dashboards shipped in base/companion/kustomization.yaml's ConfigMap (`key`, file).
pub const DASHBOARDS: [(&str, &str); 4] = [
    ("maas-platform-admin.json", "platform-admin.json"),
    ("maas-models.json", "models.json"),
    ("maas-usage.json", "usage.json"),
    ("maas-auth.json", "auth.json"),
];

/// The dashboards' files as (ConfigMap key, text).
pub fn dashboard_files(repo_root: &Path) -> Result<Vec<(String, String)>, String> {
    DASHBOARDS
        .iter()
        .map(|(key, file)| {
            let path = repo_root
                .join("wasm-plugin-crs/base/companion/dashboards")
                .join(file);
            std::fs::read_to_string(&path)
                .map(|text| (key.to_string(), text))
                .map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}

/// Every query of a dashboard: its panels' targets and its query variables' metrics.
pub fn dashboard_queries(dash: &Value) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for p in list_at(dash, "panels")? {
        if opt_str(p, "type") == Some("row") {
            continue;
        }
        let title = opt_str(p, "title").unwrap_or_default();
        for t in list_or_empty(p, "targets") {
            let expr = at(t, "expr")?.as_str().unwrap_or_default();
            out.push((title.to_string(), expr.to_string()));
        }
    }
    let label_values =
        Regex::new(r"^label_values\((.+),\s*[a-z_]+\)$").map_err(|e| e.to_string())?;
    for v in list_or_empty(dash, "templating.list") {
        if let Some(def) = opt_str(v, "definition")
            && let Some(c) = label_values.captures(def)
        {
            out.push((
                format!("variable {}", opt_str(v, "name").unwrap_or_default()),
                c[1].to_string(),
            ));
        }
    }
    Ok(out)
}

/// One dashboard: valid JSON, a title and uid, panels with unique ids, each with a query naming
/// only exported metrics.
fn one_dashboard(key: &str, text: &str, known: &BTreeSet<String>) -> Result<Vec<String>, String> {
    let dash: Value = serde_json::from_str(text).map_err(|e| format!("{key}: not JSON: {e}"))?;
    ensure!(
        truthy(dash.get("title")) && truthy(dash.get("uid")),
        "{key}: no title or uid"
    );
    let all_panels = list_at(&dash, "panels")?;
    let panels: Vec<&Value> = all_panels
        .iter()
        .filter(|p| opt_str(p, "type") != Some("row"))
        .collect();
    ensure!(panels.len() >= 5, "{key}: {} panels", panels.len());
    let ids: Vec<String> = all_panels
        .iter()
        .map(|p| at(p, "id").map(Value::to_string))
        .collect::<Result<_, _>>()?;
    ensure!(
        ids.iter().collect::<BTreeSet<_>>().len() == ids.len(),
        "{key}: panel ids repeat"
    );
    ensure!(
        panels.iter().all(|p| truthy(p.get("targets"))),
        "{key}: a panel without a query"
    );
    let exprs: Vec<String> = dashboard_queries(&dash)?
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    for expr in &exprs {
        for metric in METRIC.find_iter(expr) {
            ensure!(
                known.contains(metric.as_str()),
                "unknown metric {} in {}",
                metric.as_str(),
                repr(&json!(expr))
            );
        }
    }
    Ok(exprs)
}

/// The Grafana dashboards (`files`: ConfigMap key and text, from [`dashboard_files`]): each
/// valid with panels whose queries name only exported metrics, together covering the series
/// each persona needs, shipped in the render as the ConfigMap maas-grafana-dashboard with
/// Grafana's dashboard label and exactly these files.
pub fn dashboard(docs: &Docs, files: &[(String, String)], repo_root: &Path) -> Verdict {
    let known = exported_metrics(repo_root)?;
    let mut exprs = Vec::new();
    for (key, text) in files {
        exprs.extend(one_dashboard(key, text, &known)?);
    }
    for needed in [
        "maas_requests_total",
        "maas_tokens_total",
        "gen_ai_server_time_to_first_token_ms_bucket",
        "maas_companion_usage_tokens_total",
        "maas_companion_usage_cost_total",
        "maas_companion_usage_refused_total",
        "maas_auth_callout_latency_ms_bucket",
        "maas_authenticate_total",
        "maas_lease_fallback",
        "maas_companion_database_up",
    ] {
        ensure!(
            exprs.iter().any(|e| e.contains(needed)),
            "no panel on {needed}"
        );
    }
    let cms = docs.find("ConfigMap", Some("maas-grafana-dashboard"));
    ensure!(
        cms.len() == 1,
        "{} ConfigMaps maas-grafana-dashboard",
        cms.len()
    );
    ensure!(
        opt_str(cms[0], "metadata.labels.grafana_dashboard") == Some("1"),
        "no grafana_dashboard label"
    );
    let data = opt(cms[0], "data").cloned().unwrap_or(Value::Null);
    let want: serde_json::Map<String, Value> =
        files.iter().map(|(k, t)| (k.clone(), json!(t))).collect();
    ensure!(
        data == Value::Object(want),
        "the ConfigMap does not hold exactly the dashboard files"
    );
    Ok(())
}

/// The filter's metric label names (filter/src/metrics.rs `LABELS`), read from its source.
pub fn filter_metric_labels(repo_root: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(repo_root.join("filter/src/metrics.rs"))
        .map_err(|e| e.to_string())?;
    let block = Regex::new(r"(?s)pub const LABELS: \[&str; \d+\] = \[(.*?)\];")
        .map_err(|e| e.to_string())?;
    let item = Regex::new(r#""([a-z_]+)""#).map_err(|e| e.to_string())?;
    let inner = block
        .captures(&text)
        .and_then(|c| c.get(1))
        .ok_or("no LABELS in filter/src/metrics.rs")?
        .as_str();
    Ok(item
        .captures_iter(inner)
        .map(|c| c[1].to_string())
        .collect())
}

/// The Gateway's Envoy extracts every label the filter writes: the Deployment patch in
/// ConfigMap maas-gateway-options gives the proxy `extraStatTags` equal to the filter's label
/// names (and the local stack's bootstrap lists the same), and keeps the filter's series.
pub fn gateway_stat_tags(docs: &Docs, repo_root: &Path) -> Verdict {
    let labels = filter_metric_labels(repo_root)?;
    let local: Vec<String> = crate::envoy_config::FILTER_METRIC_LABELS
        .iter()
        .map(|s| (*s).to_string())
        .collect();
    ensure!(
        labels == local,
        "the local bootstrap's stats tags {} differ from the filter's labels {}",
        repr(&json!(local)),
        repr(&json!(labels))
    );
    let cm = docs.one("ConfigMap", "maas-gateway-options")?;
    let patch: Value = yaml_serde::from_str(opt_str(cm, "data.deployment").unwrap_or_default())
        .map_err(|e| format!("maas-gateway-options deployment: {e}"))?;
    let proxy = patch
        .pointer("/spec/template/metadata/annotations")
        .and_then(|a| a.get("proxy.istio.io/config"))
        .and_then(Value::as_str)
        .ok_or("maas-gateway-options: no proxy.istio.io/config annotation on the Gateway's pods")?;
    let proxy: Value =
        yaml_serde::from_str(proxy).map_err(|e| format!("proxy.istio.io/config: {e}"))?;
    let tags: Vec<String> = list_or_empty(&proxy, "extraStatTags")
        .iter()
        .filter_map(|t| t.as_str().map(str::to_string))
        .collect();
    ensure!(
        tags == labels,
        "extraStatTags {} differ from the filter's labels {}",
        repr(&json!(tags)),
        repr(&json!(labels))
    );
    let prefixes = list_or_empty(&proxy, "proxyStatsMatcher.inclusionPrefixes");
    ensure!(
        prefixes.contains(&json!("wasmcustom")),
        "proxyStatsMatcher does not keep the filter's series (wasmcustom)"
    );
    Ok(())
}
