//! Every render passes every check: one schema check per object plus every wiring check.

use crate::renders::{OVERLAYS, options_for, render, run};
use maas_e2e::manifest_checks::{Options, Platform, WIRING_CHECKS};

fn passes_every_check(name: &str) {
    let docs = render(name);
    let options = options_for(name);
    let report = run(docs, &options);
    println!("{name}:\n{report}");
    let failures: Vec<String> = report.failures().iter().map(ToString::to_string).collect();
    assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
    let wiring = if options.kinds_only { 0 } else { WIRING_CHECKS };
    assert_eq!(
        report.outcomes.len(),
        docs.0.len() + wiring,
        "{name}: one schema check per object and {wiring} wiring checks"
    );
}

#[test]
fn odh_passes_every_check() {
    passes_every_check(OVERLAYS[0]);
}

#[test]
fn odh_tls_off_passes_every_check() {
    passes_every_check(OVERLAYS[1]);
}

#[test]
fn rhoai_passes_every_check() {
    passes_every_check(OVERLAYS[2]);
}

#[test]
fn rhoai_tls_off_passes_every_check() {
    passes_every_check(OVERLAYS[3]);
}

#[test]
fn kubernetes_passes_every_check() {
    passes_every_check(OVERLAYS[4]);
}

/// The plain-Kubernetes render is not OpenShift's: no OpenShift GatewayClass, no service-CA
/// Secret for the companion, nothing in openshift-ingress, the Gateway on Istio's class, and the
/// OpenShift expectations refuse it.
#[test]
fn kubernetes_has_nothing_of_openshift() {
    let docs = render("kubernetes");
    assert!(
        docs.find("GatewayClass", None).is_empty(),
        "a GatewayClass rendered"
    );
    let text = serde_json::to_string(&docs.0).expect("JSON");
    for openshift in [
        "openshift-ingress",
        "serving-cert-secret-name",
        "openshift-default",
    ] {
        assert!(
            !text.contains(openshift),
            "{openshift} in the Kubernetes render"
        );
    }
    let gateway = docs
        .one("Gateway", "maas-default-gateway")
        .expect("the Gateway");
    assert_eq!(gateway["spec"]["gatewayClassName"], "istio");
    let report = run(
        docs,
        &Options {
            platform: Platform::OpenShift,
            ..options_for("kubernetes")
        },
    );
    assert!(
        report.refuses_with("expected openshift-ingress"),
        "{report}"
    );
}

#[test]
fn odh_with_the_dev_redis_passes_every_check() {
    passes_every_check("dev-redis");
}

#[test]
fn odh_with_the_reference_resources_passes_every_check() {
    passes_every_check("maas-resources");
}

#[test]
fn odh_with_the_companion_writing_status_passes_every_check() {
    passes_every_check("maas-status");
}

/// components/usage-events beside the Gateway's objects: its Telemetry in openshift-ingress.
#[test]
fn odh_with_usage_events_passes_every_check() {
    passes_every_check("usage-events");
    let docs = render("usage-events");
    let t = docs
        .one("Telemetry", "maas-usage-events")
        .expect("the Telemetry");
    assert_eq!(t["metadata"]["namespace"], "openshift-ingress");
    assert!(
        render("odh").find("Telemetry", None).is_empty(),
        "no Telemetry without the component"
    );
}

#[test]
fn postgres_and_samples_validate_against_their_schemas() {
    passes_every_check("base/postgres");
    passes_every_check("samples");
}

/// The default expectation (no dev Redis) refuses a render that brings one uninvited.
#[test]
fn a_render_with_the_dev_redis_is_refused_where_none_is_expected() {
    let options = Options {
        dev_redis: Some(false),
        ..options_for("dev-redis")
    };
    let report = run(render("dev-redis"), &options);
    assert!(
        report.refuses_with("development Redis rendered: True, expected False"),
        "{report}"
    );
}
