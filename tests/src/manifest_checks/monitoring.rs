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

/// A metric name in a PromQL expression (Envoy prefixes the filter's with envoy_wasmcustom_).
static METRIC: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(?:envoy_wasmcustom_)?maas_[a-z0-9_]+").expect("a valid regex")
});

/// The alerts the PrometheusRules must hold.
const ALERTS: [&str; 8] = [
    "MaaSCompanionDown",
    "MaaSFilterUnavailableDecisionsRising",
    "MaaSFilterCalloutFailures",
    "MaaSPolicyRejected",
    "MaaSFilterPolicyRejected",
    "MaaSLeaseStoreDown",
    "MaaSGatewayLeaseFallback",
    "MaaSFilterHeadersNotHeld",
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
/// the filter's `pub const …: &str = "maas_…"` (and `maas_requests_<decision>` for each
/// `Decision::… => "<decision>"`), Envoy's histogram suffixes; the companion's registered
/// names with OpenMetrics' suffixes.
pub fn exported_metrics(repo_root: &Path) -> Result<BTreeSet<String>, String> {
    let constant = Regex::new(r#"pub const [A-Z_]+: &str = "(maas_[a-z0-9_]+)""#)
        .map_err(|e| e.to_string())?;
    let decision = Regex::new(r#"Decision::\w+ => "([a-z_]+)""#).map_err(|e| e.to_string())?;
    let registered =
        Regex::new(r#"register\(\s*"(maas_[a-z0-9_]+)""#).map_err(|e| e.to_string())?;
    let filter = rust_sources(&repo_root.join("filter/src"));
    let mut base = BTreeSet::new();
    for (path, text) in &filter {
        if path.contains("metrics") {
            base.extend(constant.captures_iter(text).map(|c| c[1].to_string()));
        }
    }
    if filter
        .iter()
        .any(|(_, text)| text.contains("maas_requests_{}"))
    {
        for (_, text) in &filter {
            base.extend(
                decision
                    .captures_iter(text)
                    .map(|c| format!("maas_requests_{}", &c[1])),
            );
        }
    }
    let mut known = BTreeSet::new();
    for name in &base {
        for suffix in ["", "_bucket", "_sum", "_count"] {
            known.insert(format!("envoy_wasmcustom_{name}{suffix}"));
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
    alerts_on_known_metrics(cx)
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

/// The Grafana dashboard (`text`, base/companion/grafana-dashboard.json): valid JSON with
/// panels whose queries name only exported metrics, shipped in the render as the ConfigMap
/// maas-grafana-dashboard with Grafana's dashboard label.
pub fn dashboard(docs: &Docs, text: &str, repo_root: &Path) -> Verdict {
    let dash: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    ensure!(
        truthy(dash.get("title")) && truthy(dash.get("uid")),
        "no title or uid"
    );
    let all_panels = list_at(&dash, "panels")?;
    let panels: Vec<&Value> = all_panels
        .iter()
        .filter(|p| opt_str(p, "type") != Some("row"))
        .collect();
    ensure!(panels.len() >= 8, "{} panels", panels.len());
    let ids: Vec<String> = all_panels
        .iter()
        .map(|p| at(p, "id").map(Value::to_string))
        .collect::<Result<_, _>>()?;
    ensure!(
        ids.iter().collect::<BTreeSet<_>>().len() == ids.len(),
        "panel ids repeat"
    );
    let known = exported_metrics(repo_root)?;
    ensure!(
        panels.iter().all(|p| truthy(p.get("targets"))),
        "a panel without a query"
    );
    let mut exprs = Vec::new();
    for p in &panels {
        for t in list_or_empty(p, "targets") {
            exprs.push(at(t, "expr")?.as_str().unwrap_or_default());
        }
    }
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
    for needed in [
        "maas_companion_usage_tokens_total",
        "maas_companion_usage_refused_total",
        "envoy_wasmcustom_maas_auth_callout_latency_ms_bucket",
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
    let data: Vec<&Value> = opt(cms[0], "data")
        .and_then(Value::as_object)
        .map(|d| d.values().collect())
        .unwrap_or_default();
    ensure!(
        data == [&json!(text)],
        "the ConfigMap does not hold the dashboard file"
    );
    Ok(())
}
