//! The Grafana dashboard (base/companion/grafana-dashboard.json): valid JSON with panels whose
//! queries name only metrics the filter and the companion export, shipped as the ConfigMap with
//! Grafana's dashboard label. A copy naming an unknown metric is refused.

use crate::renders::render;
use maas_e2e::manifest_checks::dashboard;
use maas_e2e::tools::workspace_root;

fn dashboard_file() -> String {
    let path = workspace_root().join("wasm-plugin-crs/base/companion/grafana-dashboard.json");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_dashboard_names_known_metrics_and_ships_as_a_labelled_configmap() {
    dashboard(render("odh"), &dashboard_file(), &workspace_root()).expect("the dashboard passes");
}

#[test]
fn a_dashboard_naming_an_unknown_metric_is_refused() {
    let text = dashboard_file();
    let broken = text.replace(
        "maas_companion_usage_tokens_total",
        "maas_companion_usage_tokenz_total",
    );
    assert_ne!(text, broken, "the breakage changed nothing");
    let why = dashboard(render("odh"), &broken, &workspace_root()).expect_err("refused");
    assert!(
        why.contains("unknown metric maas_companion_usage_tokenz_total"),
        "{why}"
    );
}
