//! The Grafana dashboards (base/companion/dashboards/*.json): valid JSON with panels whose
//! queries name only metrics the filter and the companion export, shipped as the ConfigMap with
//! Grafana's dashboard label. A copy naming an unknown metric is refused. (That every panel
//! shows data is proven against a real Prometheus: tests/tests/e2e/observability.rs.)

use crate::renders::render;
use maas_e2e::manifest_checks::{dashboard, dashboard_files};
use maas_e2e::tools::workspace_root;

fn files() -> Vec<(String, String)> {
    dashboard_files(&workspace_root()).expect("the dashboards read")
}

#[test]
fn the_dashboards_name_known_metrics_and_ship_as_a_labelled_configmap() {
    dashboard(render("odh"), &files(), &workspace_root()).expect("the dashboards pass");
}

#[test]
fn a_dashboard_naming_an_unknown_metric_is_refused() {
    let mut files = files();
    let usage = files
        .iter_mut()
        .find(|(_, text)| text.contains("maas_companion_usage_tokens_total"))
        .expect("a dashboard on the usage tokens");
    let broken = usage.1.replace(
        "maas_companion_usage_tokens_total",
        "maas_companion_usage_tokenz_total",
    );
    assert_ne!(usage.1, broken, "the breakage changed nothing");
    usage.1 = broken;
    let why = dashboard(render("odh"), &files, &workspace_root()).expect_err("refused");
    assert!(
        why.contains("unknown metric maas_companion_usage_tokenz_total"),
        "{why}"
    );
}
