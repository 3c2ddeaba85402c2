//! The checks refuse a broken render and say why: each test breaks one thing in a copy of a
//! render (odh unless named) and expects a failure whose line names it.

use crate::renders::{render, run};
use maas_e2e::manifest_checks::{self, Docs, LeaseStore, Options, Tls};
use serde_json::{Value, json};

/// The object of that kind and name in a render being broken.
fn doc<'a>(docs: &'a mut Docs, kind: &str, name: &str) -> &'a mut Value {
    docs.get_mut(kind, name)
        .unwrap_or_else(|| panic!("the render has no {kind} {name} to break"))
}

/// The value at a JSON pointer.
fn at<'a>(value: &'a mut Value, pointer: &str) -> &'a mut Value {
    value
        .pointer_mut(pointer)
        .unwrap_or_else(|| panic!("nothing at {pointer} to break"))
}

/// Removes the field at a JSON pointer.
fn remove(value: &mut Value, pointer: &str) {
    let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
    at(value, parent)
        .as_object_mut()
        .and_then(|o| o.remove(&key.replace("~1", "/").replace("~0", "~")))
        .unwrap_or_else(|| panic!("no {pointer} to remove"));
}

/// Drops every object of that name.
fn drop_named(docs: &mut Docs, name: &str) {
    let before = docs.0.len();
    docs.0
        .retain(|d| d.pointer("/metadata/name") != Some(&json!(name)));
    assert!(docs.0.len() < before, "no {name} to drop");
}

/// The index of an EnvoyFilter's patch that applies to `apply_to`.
fn patch_index(ef: &Value, apply_to: &str) -> usize {
    ef.pointer("/spec/configPatches")
        .and_then(Value::as_array)
        .and_then(|p| p.iter().position(|p| p["applyTo"] == json!(apply_to)))
        .unwrap_or_else(|| panic!("no {apply_to} patch"))
}

/// The Wasm filter's settings (the EnvoyFilter maas-filter's extension config).
fn wasm(docs: &mut Docs) -> &mut Value {
    let ef = doc(docs, "EnvoyFilter", "maas-filter");
    let i = patch_index(ef, "EXTENSION_CONFIG");
    at(
        ef,
        &format!("/spec/configPatches/{i}/patch/value/typed_config/config"),
    )
}

/// The EnvoyFilter maas-filter's HTTP_FILTER patch.
fn http_filter(docs: &mut Docs) -> &mut Value {
    let ef = doc(docs, "EnvoyFilter", "maas-filter");
    let i = patch_index(ef, "HTTP_FILTER");
    at(ef, &format!("/spec/configPatches/{i}"))
}

/// Edits the filter's pluginConfig (JSON in the extension config).
fn edit_plugin(docs: &mut Docs, edit: impl FnOnce(&mut Value)) {
    let value = at(wasm(docs), "/configuration/value");
    let mut plugin: Value = serde_json::from_str(value.as_str().expect("JSON text")).expect("JSON");
    edit(&mut plugin);
    *value = json!(plugin.to_string());
}

/// The cluster the EnvoyFilter maas-companion-cluster adds.
fn companion_cluster(docs: &mut Docs) -> &mut Value {
    at(
        doc(docs, "EnvoyFilter", "maas-companion-cluster"),
        "/spec/configPatches/0/patch/value",
    )
}

/// The companion's container.
fn container(docs: &mut Docs) -> &mut Value {
    at(
        doc(docs, "Deployment", "maas-companion"),
        "/spec/template/spec/containers/0",
    )
}

/// The companion's env entry of that name.
fn env<'a>(docs: &'a mut Docs, name: &str) -> &'a mut Value {
    at(container(docs), "/env")
        .as_array_mut()
        .and_then(|e| e.iter_mut().find(|e| e["name"] == json!(name)))
        .unwrap_or_else(|| panic!("no env {name}"))
}

/// Replaces text in the last word of a container's command (its shell script).
fn edit_script(container: &mut Value, from: &str, to: &str) {
    let script = at(container, "/command")
        .as_array_mut()
        .and_then(|c| c.last_mut())
        .expect("a command");
    let text = script.as_str().expect("a string").to_string();
    assert!(text.contains(from), "{from:?} not in {text:?}");
    *script = json!(text.replace(from, to));
}

fn expect_refused(
    source: &str,
    lease_store: LeaseStore,
    text: &str,
    mutate: impl FnOnce(&mut Docs),
) {
    let mut docs = render(source).clone();
    mutate(&mut docs);
    let options = Options {
        namespace: Some("opendatahub".to_string()),
        tls: Tls::On,
        lease_store,
        ..Options::default()
    };
    let report = run(&docs, &options);
    assert!(
        report.refuses_with(text),
        "expected a FAIL naming {text:?}, got:\n{}",
        report
            .failures()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// `name: [source,] "expected text", |docs| { break it }` → a test `name`.
macro_rules! refused {
    ($($name:ident: $(@$source:literal,)? $(lease $lease:ident,)? $text:literal, $mutate:expr;)*) => {
        $(
            #[test]
            fn $name() {
                let source = ["odh" $(, $source)?][refused!(@count $($source)?)];
                let lease = [LeaseStore::Any $(, LeaseStore::$lease)?][refused!(@count $($lease)?)];
                expect_refused(source, lease, $text, $mutate);
            }
        )*
    };
    (@count) => { 0 };
    (@count $x:tt) => { 1 };
}

refused! {
    typo_field: "imagePulPolicy", |d: &mut Docs| {
        container(d)["imagePulPolicy"] = json!("Always");
    };
    bad_enum: "IfNotPresnt", |d: &mut Docs| {
        container(d)["imagePullPolicy"] = json!("IfNotPresnt");
    };
    fail_open: "FAIL_OPEN", |d: &mut Docs| {
        wasm(d)["failure_policy"] = json!("FAIL_OPEN");
    };
    pause_without_knob: "both or neither", |d: &mut Docs| {
        remove(wasm(d), "/allow_on_headers_stop_iteration");
    };
    knob_without_pause: "both or neither", |d: &mut Docs| {
        edit_plugin(d, |p| p["pauseHeadersForBody"] = json!(false));
    };
    filter_not_first: "INSERT_BEFORE", |d: &mut Docs| {
        *at(http_filter(d), "/patch/operation") = json!("INSERT_BEFORE");
    };
    ecds_name_mismatch: "maas-filtr", |d: &mut Docs| {
        *at(http_filter(d), "/patch/value/name") = json!("maas-filtr");
    };
    no_rbac_fallback_type: "RBAC filter", |d: &mut Docs| {
        *at(http_filter(d), "/patch/value/config_discovery/type_urls") =
            json!(["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]);
    };
    filter_waits_not: "initial_fetch_timeout", |d: &mut Docs| {
        *at(http_filter(d), "/patch/value/config_discovery/config_source/initial_fetch_timeout") = json!("5s");
    };
    also_a_wasmplugin: "WasmPlugin maas-filter rendered", |d: &mut Docs| {
        let text = at(wasm(d), "/configuration/value").as_str().expect("JSON text").to_string();
        let mut plugin: Value = serde_json::from_str(&text).expect("JSON");
        plugin["pauseHeadersForBody"] = json!(true);
        d.0.push(json!({"apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin",
            "metadata": {"name": "maas-filter", "namespace": "openshift-ingress"},
            "spec": {"url": "oci://quay.io/maas-gateway/maas-filter:v0.1.0", "pluginConfig": plugin}}));
    };
    underscores_allowed: "['ALLOW']", |d: &mut Docs| {
        *at(doc(d, "EnvoyFilter", "maas-gateway-connection-manager"),
            "/spec/configPatches/0/patch/value/typed_config/common_http_protocol_options/headers_with_underscores_action")
            = json!("ALLOW");
    };
    no_connection_manager_filter: "maas-gateway-connection-manager", |d: &mut Docs| {
        drop_named(d, "maas-gateway-connection-manager");
    };
    wrong_cluster_namespace: "maas-api.svc.cluster.local", |d: &mut Docs| {
        *at(companion_cluster(d), "/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address/address")
            = json!("maas-companion.maas-api.svc.cluster.local");
    };
    route_to_internal: "maas-companion:8081", |d: &mut Docs| {
        *at(doc(d, "HTTPRoute", "maas-api"), "/spec/rules/0/backendRefs/0/port") = json!(8081);
    };
    internal_open_to_all: "opens the internal port to everyone", |d: &mut Docs| {
        remove(doc(d, "NetworkPolicy", "maas-companion-internal"), "/spec/ingress/0/from");
    };
    prometheus_to_internal: "to the internal port", |d: &mut Docs| {
        let prometheus = at(doc(d, "NetworkPolicy", "maas-companion-metrics"), "/spec/ingress/0/from/0").clone();
        at(doc(d, "NetworkPolicy", "maas-companion-internal"), "/spec/ingress/0/from")
            .as_array_mut().expect("a list").push(prometheus);
    };
    metrics_open_to_all: "opens the metrics port to everyone", |d: &mut Docs| {
        remove(doc(d, "NetworkPolicy", "maas-companion-metrics"), "/spec/ingress/0/from");
    };
    no_metrics_port: "no port 9090", |d: &mut Docs| {
        at(doc(d, "Service", "maas-companion"), "/spec/ports")
            .as_array_mut().expect("a list").retain(|p| p["port"] != json!(9090));
    };
    unknown_kind: "no schema core_v1_Pod", |d: &mut Docs| {
        d.0.push(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stray"}, "spec": {}}));
    };
    subject_without_namespace: "namespace", |d: &mut Docs| {
        remove(doc(d, "ClusterRoleBinding", "maas-companion-tokenreview"), "/subjects/0/namespace");
    };
    writable_root: "root filesystem writable", |d: &mut Docs| {
        *at(container(d), "/securityContext/readOnlyRootFilesystem") = json!(false);
    };
    bad_url_scheme: "url", |d: &mut Docs| {
        *at(wasm(d), "/vm_config/code/remote/http_uri/uri") = json!("quay.io/maas-gateway/maas-filter:v0.1.0");
    };
    routes_from_all: "admits HTTPRoutes from All", |d: &mut Docs| {
        *at(doc(d, "Gateway", "maas-default-gateway"), "/spec/listeners/1/allowedRoutes")
            = json!({"namespaces": {"from": "All"}});
    };
    routes_empty_selector: "selector {}", |d: &mut Docs| {
        *at(doc(d, "Gateway", "maas-default-gateway"), "/spec/listeners/0/allowedRoutes/namespaces/selector") = json!({});
    };
    provider_without_upstream: "no upstreamCluster", |d: &mut Docs| {
        let text = at(doc(d, "ConfigMap", "maas-policy"), "/data/policy.yaml");
        let mut policy: Value = yaml_serde::from_str(text.as_str().expect("text")).expect("YAML");
        for model in policy["models"].as_array_mut().expect("models") {
            model.as_object_mut().expect("a model").remove("upstreamCluster");
        }
        *text = json!(yaml_serde::to_string(&policy).expect("YAML"));
    };
    routed_backends_without_upstream: "has backends with providers but no upstreamCluster", |d: &mut Docs| {
        let text = at(doc(d, "ConfigMap", "maas-policy"), "/data/policy.yaml");
        let mut policy: Value = yaml_serde::from_str(text.as_str().expect("text")).expect("YAML");
        for model in policy["models"].as_array_mut().expect("models") {
            for b in model.get_mut("backends").and_then(Value::as_array_mut).into_iter().flatten() {
                b.as_object_mut().expect("a backend").remove("upstreamCluster");
            }
        }
        *text = json!(yaml_serde::to_string(&policy).expect("YAML"));
    };
    no_companion_cluster: "0 EnvoyFilter patches add cluster 'maas-companion-internal'", |d: &mut Docs| {
        drop_named(d, "maas-companion-cluster");
    };
    plugin_uses_istio_cluster_name: "expected 'maas-companion-internal'", |d: &mut Docs| {
        edit_plugin(d, |p| p["companion"]["cluster"] = json!("outbound|8081||maas-companion.opendatahub.svc.cluster.local"));
    };
    companion_cluster_public_port: "expected maas-companion.opendatahub.svc.cluster.local:8081", |d: &mut Docs| {
        *at(companion_cluster(d), "/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address/port_value")
            = json!(8080);
    };
    companion_cluster_without_tls: "no TLS transport socket", |d: &mut Docs| {
        remove(companion_cluster(d), "/transport_socket");
    };
    companion_cluster_without_client_cert: "presents no client certificate", |d: &mut Docs| {
        remove(companion_cluster(d), "/transport_socket/typed_config/common_tls_context/tls_certificate_sds_secret_configs");
    };
    companion_cluster_other_ca: "kubernetes://other-ca-cacert", |d: &mut Docs| {
        *at(companion_cluster(d),
            "/transport_socket/typed_config/common_tls_context/combined_validation_context/validation_context_sds_secret_config/name")
            = json!("kubernetes://other-ca-cacert");
    };
    companion_cluster_on_every_proxy: "EnvoyFilter selects None", |d: &mut Docs| {
        remove(doc(d, "EnvoyFilter", "maas-companion-cluster"), "/spec/workloadSelector");
    };
    internal_auth_none: "MAAS_INTERNAL_AUTH=none", |d: &mut Docs| {
        env(d, "MAAS_INTERNAL_AUTH")["value"] = json!("none");
    };
    internal_any_caller_of_the_ca: "MAAS_INTERNAL_CLIENT_NAMES []", |d: &mut Docs| {
        at(container(d), "/env").as_array_mut().expect("a list")
            .retain(|e| e["name"] != json!("MAAS_INTERNAL_CLIENT_NAMES"));
    };
    internal_ca_from_elsewhere: "reads some-other-secret/ca.crt", |d: &mut Docs| {
        let volumes = at(doc(d, "Deployment", "maas-companion"), "/spec/template/spec/volumes");
        let volume = volumes.as_array_mut().expect("a list").iter_mut()
            .find(|v| v["name"] == json!("internal-tls")).expect("volume internal-tls");
        volume["secret"]["secretName"] = json!("some-other-secret");
    };
    no_gateway_sds_rbac: "expected exactly one Role maas-gateway-sds", |d: &mut Docs| {
        d.0.retain(|x| !(x["kind"] == json!("Role") && x["metadata"]["name"] == json!("maas-gateway-sds")));
    };
    gateway_sds_rbac_reads_secrets: "'get', 'list', 'watch'", |d: &mut Docs| {
        *at(doc(d, "Role", "maas-gateway-sds"), "/rules/0/verbs") = json!(["get", "list", "watch"]);
    };
    cleanup_plain_http: "calls the internal port without TLS", |d: &mut Docs| {
        let job = doc(d, "CronJob", "maas-api-key-cleanup");
        edit_script(at(job, "/spec/jobTemplate/spec/template/spec/containers/0"), "https://", "http://");
    };
    cleanup_without_client_cert: "has no --cert", |d: &mut Docs| {
        let job = doc(d, "CronJob", "maas-api-key-cleanup");
        edit_script(at(job, "/spec/jobTemplate/spec/template/spec/containers/0"),
            "--cert /etc/maas/internal-client/tls.crt", "");
    };
    alert_on_unknown_metric: "unknown metric maas_requests_totl", |d: &mut Docs| {
        let expr = at(doc(d, "PrometheusRule", "maas-gateway-alerts"), "/spec/groups/0/rules/0/expr");
        let text = expr.as_str().expect("text").to_string();
        assert!(text.contains("maas_requests_total"), "{text}");
        *expr = json!(text.replace("maas_requests_total", "maas_requests_totl"));
    };
    gateway_without_stat_tags: "no proxy.istio.io/config annotation", |d: &mut Docs| {
        let data = at(doc(d, "ConfigMap", "maas-gateway-options"), "/data/deployment");
        *data = json!("spec:\n  replicas: 1\n");
    };
    gateway_missing_a_stat_tag: "extraStatTags", |d: &mut Docs| {
        let data = at(doc(d, "ConfigMap", "maas-gateway-options"), "/data/deployment");
        let text = data.as_str().expect("text").to_string();
        assert!(text.contains(", operation]"), "{text}");
        *data = json!(text.replace(", operation]", "]"));
    };
    scrape_plain_http_with_tls: "scrapes plain HTTP", |d: &mut Docs| {
        *at(doc(d, "ServiceMonitor", "maas-companion"), "/spec/endpoints/0/scheme") = json!("http");
    };
    global_limits_off: "limits.global.enabled is off", |d: &mut Docs| {
        edit_plugin(d, |p| p["limits"]["global"]["enabled"] = json!(false));
    };
    gateway_replicas_disagree: "limits.global.replicas 1 but the Gateway runs 3 replicas", |d: &mut Docs| {
        *at(doc(d, "ConfigMap", "maas-gateway-options"), "/data/deployment") = json!("spec:\n  replicas: 3\n");
    };
    gateway_replicas_unset: "limits.global.replicas None but the Gateway runs 1 replicas", |d: &mut Docs| {
        edit_plugin(d, |p| remove(p, "/limits/global/replicas"));
    };
    gateway_replicas_unpinned: "infrastructure.parametersRef is None", |d: &mut Docs| {
        remove(doc(d, "Gateway", "maas-default-gateway"), "/spec/infrastructure");
    };
    redis_secret_required: "is not optional", |d: &mut Docs| {
        *at(env(d, "MAAS_REDIS_URL"), "/valueFrom/secretKeyRef/optional") = json!(false);
    };
    no_lease_fallback_alert: "missing alerts ['MaaSGatewayLeaseFallback']", |d: &mut Docs| {
        at(doc(d, "PrometheusRule", "maas-gateway-alerts"), "/spec/groups/0/rules")
            .as_array_mut().expect("a list")
            .retain(|r| r["alert"] != json!("MaaSGatewayLeaseFallback"));
    };
    public_url_elsewhere:
        "MAAS_PUBLIC_URL 'https://evil.example.net', expected 'https://maas.apps.cluster.example.com'",
        |d: &mut Docs| { env(d, "MAAS_PUBLIC_URL")["value"] = json!("https://evil.example.net"); };
    public_url_missing: "MAAS_PUBLIC_URL is not set", |d: &mut Docs| {
        at(container(d), "/env").as_array_mut().expect("a list")
            .retain(|e| e["name"] != json!("MAAS_PUBLIC_URL"));
    };
    two_companions_without_redis: lease Memory, "companion replicas 2 with the lease counters in process", |d: &mut Docs| {
        doc(d, "Deployment", "maas-companion")["spec"]["replicas"] = json!(2);
    };
    dev_redis_persistent: @"dev-redis", "persists its data", |d: &mut Docs| {
        let redis = doc(d, "Deployment", "maas-redis");
        edit_script(at(redis, "/spec/template/spec/containers/0"), "--save ''", "--save '60 1'");
    };
    dev_redis_open_to_all: @"dev-redis", "opens the dev Redis to everyone", |d: &mut Docs| {
        remove(doc(d, "NetworkPolicy", "maas-redis"), "/spec/ingress/0/from");
    };
    dev_redis_two_replicas: @"dev-redis", "replicas 2, expected 1", |d: &mut Docs| {
        doc(d, "Deployment", "maas-redis")["spec"]["replicas"] = json!(2);
    };
    dev_redis_no_password: @"dev-redis", "without a password", |d: &mut Docs| {
        let c = at(doc(d, "Deployment", "maas-redis"), "/spec/template/spec/containers/0");
        let last = at(c, "/command").as_array_mut().and_then(|c| c.last_mut()).expect("a command");
        *last = json!("exec redis-server --save '' --appendonly no");
    };
    dev_redis_unlabelled: @"dev-redis", "is not labelled maas.opendatahub.io/dev-only=true", |d: &mut Docs| {
        remove(doc(d, "Deployment", "maas-redis"), "/metadata/labels/maas.opendatahub.io~1dev-only");
    };
    resources_no_watch: @"maas-resources", "policy resources", |d: &mut Docs| {
        *at(doc(d, "ClusterRole", "maas-companion-resources"), "/rules/0/verbs") = json!(["get", "list"]);
    };
    resources_crd_wrong_group: @"maas-resources", "group maas.example.com", |d: &mut Docs| {
        *at(doc(d, "CustomResourceDefinition", "maassubscriptions.maas.opendatahub.io"), "/spec/group")
            = json!("maas.example.com");
    };
    provider_secrets_cluster_wide: @"maas-resources", "bound cluster-wide", |d: &mut Docs| {
        d.0.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "maas-companion-provider-secrets"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "maas-companion-provider-secrets"},
            "subjects": [{"kind": "ServiceAccount", "name": "maas-companion", "namespace": "opendatahub"}]}));
    };
    provider_secrets_list: @"maas-resources", "expected get on secrets only", |d: &mut Docs| {
        *at(doc(d, "ClusterRole", "maas-companion-provider-secrets"), "/rules/0/verbs") = json!(["get", "list", "watch"]);
    };
    status_writer_may_update_spec: @"maas-status", "maas-companion-status rules", |d: &mut Docs| {
        *at(doc(d, "ClusterRole", "maas-companion-status"), "/rules/0/verbs") = json!(["patch", "update"]);
    };
    status_writer_on_the_resources: @"maas-status", "maas-companion-status rules", |d: &mut Docs| {
        *at(doc(d, "ClusterRole", "maas-companion-status"), "/rules/1/resources") = json!(["externalmodels", "externalproviders"]);
    };
    status_writer_unbound: @"maas-status", "not bound to the companion", |d: &mut Docs| {
        d.0.retain(|o| !(o["kind"] == json!("ClusterRoleBinding") && o["metadata"]["name"] == json!("maas-companion-status")));
    };
    status_writer_without_resources: @"maas-status", "MAAS_WRITE_STATUS needs MAAS_POLICY_SOURCE=kubernetes", |d: &mut Docs| {
        at(container(d), "/env").as_array_mut().expect("env")
            .retain(|e| e["name"] != json!("MAAS_POLICY_SOURCE"));
    };
    status_right_without_writing: @"maas-status", "without MAAS_WRITE_STATUS", |d: &mut Docs| {
        at(container(d), "/env").as_array_mut().expect("env")
            .retain(|e| e["name"] != json!("MAAS_WRITE_STATUS"));
    };
    // Admins by the reference's SubjectAccessReview rule, out of the box.
    admins_by_groups_only: "MAAS_ADMIN_SAR_NAMESPACE is not set", |d: &mut Docs| {
        at(container(d), "/env").as_array_mut().expect("env")
            .retain(|e| e["name"] != json!("MAAS_ADMIN_SAR_NAMESPACE"));
    };
    admins_by_another_verb: "MAAS_ADMIN_SAR_VERB 'get'", |d: &mut Docs| {
        at(container(d), "/env").as_array_mut().expect("env")
            .push(json!({"name": "MAAS_ADMIN_SAR_VERB", "value": "get"}));
    };
    no_subject_access_review_right: "subjectaccessreviews", |d: &mut Docs| {
        at(doc(d, "ClusterRole", "maas-companion-tokenreview"), "/rules").as_array_mut().expect("rules")
            .retain(|r| r["resources"] != json!(["subjectaccessreviews"]));
    };
    // The usage-events Telemetry logs only requests with an event, on the Gateway's pods.
    usage_events_unfiltered: @"usage-events", "requests without a usage event would be logged", |d: &mut Docs| {
        remove(at(doc(d, "Telemetry", "maas-usage-events"), "/spec/accessLogging/0"), "/filter");
    };
    usage_events_elsewhere: @"usage-events", "expected the Gateway's pods", |d: &mut Docs| {
        *at(doc(d, "Telemetry", "maas-usage-events"), "/spec/selector/matchLabels")
            = json!({"app": "something-else"});
    };
    admins_elsewhere_than_the_subscriptions: @"maas-resources", "but the subscriptions are in MAAS_POLICY_NAMESPACE", |d: &mut Docs| {
        *at(env(d, "MAAS_ADMIN_SAR_NAMESPACE"), "/value") = json!("team-a");
    };
}

/// The sample policy (ConfigMap maas-policy of the odh render).
fn sample_policy() -> Value {
    let cm = render("odh")
        .one("ConfigMap", "maas-policy")
        .expect("the policy ConfigMap");
    yaml_serde::from_str(cm["data"]["policy.yaml"].as_str().expect("policy.yaml"))
        .expect("the policy is YAML")
}

/// The samples changed by `mutate` are refused by `model_routes` with a reason naming `text`.
fn model_routes_refuse(policy: &Value, text: &str, mutate: &dyn Fn(&mut Docs)) {
    let mut docs = render("samples").clone();
    mutate(&mut docs);
    let verdict = manifest_checks::model_routes(&docs, policy);
    assert!(
        verdict.as_ref().is_err_and(|why| why.contains(text)),
        "expected a refusal naming {text:?}, got {verdict:?}"
    );
}

/// The sample model HTTPRoutes publish each model at the one base URL (a `/v1` rule matching
/// `x-maas-model`: the policy's model name), and the check refuses a sample without it.
#[test]
fn the_sample_model_routes_publish_the_one_base_url() {
    let policy = sample_policy();
    assert_eq!(
        manifest_checks::model_routes(render("samples"), &policy),
        Ok(())
    );
    let refused = |text: &str, mutate: &dyn Fn(&mut Docs)| {
        model_routes_refuse(&policy, text, mutate);
    };
    let one_url_rule = |d: &mut Docs, name: &str| -> usize {
        at(doc(d, "HTTPRoute", name), "/spec/rules")
            .as_array()
            .and_then(|r| {
                r.iter()
                    .position(|r| r.pointer("/matches/0/path/value") == Some(&json!("/v1")))
            })
            .expect("a /v1 rule")
    };
    refused("no rule for the one base URL of model gpt-4o", &|d| {
        let i = one_url_rule(d, "gpt-4o");
        at(doc(d, "HTTPRoute", "gpt-4o"), "/spec/rules")
            .as_array_mut()
            .expect("rules")
            .remove(i);
    });
    refused(
        "no rule for the one base URL of model facebook/opt-125m",
        &|d| {
            let i = one_url_rule(d, "facebook-opt-125m-simulated");
            *at(
                doc(d, "HTTPRoute", "facebook-opt-125m-simulated"),
                &format!("/spec/rules/{i}/matches/0/headers/0/value"),
            ) = json!("facebook-opt-125m-simulated");
        },
    );
    refused("does not remove x-maas-model", &|d| {
        let i = one_url_rule(d, "gpt-4o");
        let filters = at(
            doc(d, "HTTPRoute", "gpt-4o"),
            &format!("/spec/rules/{i}/filters"),
        );
        filters
            .as_array_mut()
            .expect("filters")
            .retain(|f| f["type"] != "RequestHeaderModifier");
    });
    refused("rewrites the host to None", &|d| {
        let i = one_url_rule(d, "gpt-4o");
        let filters = at(
            doc(d, "HTTPRoute", "gpt-4o"),
            &format!("/spec/rules/{i}/filters"),
        );
        filters
            .as_array_mut()
            .expect("filters")
            .retain(|f| f["type"] != "URLRewrite");
    });
    refused("rewrites the path", &|d| {
        let i = one_url_rule(d, "facebook-opt-125m-simulated");
        at(
            doc(d, "HTTPRoute", "facebook-opt-125m-simulated"),
            &format!("/spec/rules/{i}/filters"),
        )
        .as_array_mut()
        .expect("filters")
        .push(json!({"type": "URLRewrite", "urlRewrite": {"path": {
            "type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}));
    });
    refused("leads to", &|d| {
        let i = one_url_rule(d, "facebook-opt-125m-simulated");
        *at(
            doc(d, "HTTPRoute", "facebook-opt-125m-simulated"),
            &format!("/spec/rules/{i}/backendRefs/0/port"),
        ) = json!(8080);
    });
    refused("no model of the policy has that path", &|d| {
        *at(
            doc(d, "HTTPRoute", "gpt-4o"),
            "/spec/rules/0/matches/0/path/value",
        ) = json!("/llm/gpt-5");
    });
}

/// The Azure sample routes the filter's rewritten path (/openai/deployments/<deployment>) by
/// the routing header, as its prefix rule does, the header removed and the path kept.
#[test]
fn the_azure_sample_routes_its_provider_path() {
    let policy = sample_policy();
    let refused = |text: &str, mutate: &dyn Fn(&mut Docs)| {
        model_routes_refuse(&policy, text, mutate);
    };
    let provider_rule = |d: &mut Docs| -> usize {
        at(doc(d, "HTTPRoute", "gpt-4o-azure"), "/spec/rules")
            .as_array()
            .and_then(|r| {
                r.iter().position(|r| {
                    r.pointer("/matches/0/path/value")
                        == Some(&json!("/openai/deployments/gpt-4o-prod"))
                })
            })
            .expect("a provider-path rule")
    };
    refused(
        "no rule for the provider path of model gpt-4o-azure",
        &|d| {
            let i = provider_rule(d);
            at(doc(d, "HTTPRoute", "gpt-4o-azure"), "/spec/rules")
                .as_array_mut()
                .expect("rules")
                .remove(i);
        },
    );
    refused(
        "no rule for the provider path of model gpt-4o-azure",
        &|d| {
            let i = provider_rule(d);
            *at(
                doc(d, "HTTPRoute", "gpt-4o-azure"),
                &format!("/spec/rules/{i}/matches/0/path/value"),
            ) = json!("/openai/deployments/other");
        },
    );
    refused("(the provider path) rewrites the path", &|d| {
        let i = provider_rule(d);
        at(
            doc(d, "HTTPRoute", "gpt-4o-azure"),
            &format!("/spec/rules/{i}/filters"),
        )
        .as_array_mut()
        .expect("filters")
        .push(json!({"type": "URLRewrite", "urlRewrite": {"path": {
            "type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}));
    });
    refused("(the provider path) does not remove x-maas-model", &|d| {
        let i = provider_rule(d);
        at(
            doc(d, "HTTPRoute", "gpt-4o-azure"),
            &format!("/spec/rules/{i}/filters"),
        )
        .as_array_mut()
        .expect("filters")
        .retain(|f| f["type"] != "RequestHeaderModifier");
    });
}

/// The Bedrock sample routes the filter's signed path (/model/…) by the routing header, and no
/// rule may move the host away from the one the filter signed.
#[test]
fn the_bedrock_sample_routes_its_signed_path_to_the_signed_host() {
    let policy = sample_policy();
    let refused = |text: &str, mutate: &dyn Fn(&mut Docs)| {
        model_routes_refuse(&policy, text, mutate);
    };
    refused(
        "no rule for the provider path of model claude-bedrock (PathPrefix /model",
        &|d| {
            at(doc(d, "HTTPRoute", "claude-bedrock"), "/spec/rules")
                .as_array_mut()
                .expect("rules")
                .retain(|r| r.pointer("/matches/0/path/value") != Some(&json!("/model")));
        },
    );
    // Every rule alike (so only the signature check can refuse it): another host.
    refused(
        "but the filter signed bedrock-runtime.us-east-1.amazonaws.com",
        &|d| {
            let rules = at(doc(d, "HTTPRoute", "claude-bedrock"), "/spec/rules");
            for rule in rules.as_array_mut().expect("rules") {
                for f in rule["filters"].as_array_mut().expect("filters") {
                    if let Some(h) = f.pointer_mut("/urlRewrite/hostname") {
                        *h = json!("bedrock-proxy.example.com");
                    }
                }
            }
        },
    );
}

/// The weighted sample (routed backends) routes each backend by both routing headers —
/// `x-maas-model` and `x-maas-backend` — at the one base URL, at its provider's path (Azure's
/// deployment) or the model's prefix (OpenAI keeps the path), to the host its upstreamCluster
/// names, both headers removed; the check refuses a sample missing any of it.
#[test]
fn the_weighted_sample_routes_each_backend_by_both_headers() {
    let policy = sample_policy();
    let refused = |text: &str, mutate: &dyn Fn(&mut Docs)| {
        model_routes_refuse(&policy, text, mutate);
    };
    // The rule of the weighted sample at `path` for `backend` (`None`: the plain prefix rule).
    let rule = |d: &mut Docs, path: &str, backend: Option<&str>| -> usize {
        at(doc(d, "HTTPRoute", "gpt-4o-split"), "/spec/rules")
            .as_array()
            .and_then(|r| {
                r.iter().position(|r| {
                    r.pointer("/matches/0/path/value") == Some(&json!(path))
                        && r.pointer("/matches/0/headers/1/value")
                            .and_then(Value::as_str)
                            == backend
                })
            })
            .unwrap_or_else(|| panic!("a rule at {path} for {backend:?}"))
    };
    refused(
        "no rule for the provider path of backend azure of model gpt-4o-split \
         (PathPrefix /openai/deployments/gpt-4o-prod",
        &|d| {
            let i = rule(d, "/openai/deployments/gpt-4o-prod", Some("azure"));
            weighted_rules(d).remove(i);
        },
    );
    refused(
        "no rule for the one base URL of backend openai of model gpt-4o-split",
        &|d| {
            let i = rule(d, "/v1", Some("openai"));
            weighted_rules(d).remove(i);
        },
    );
    // Only the model header: a request drawn for OpenAI would take the plain rule.
    refused(
        "no rule for the model's path prefix of backend openai",
        &|d| {
            let i = rule(d, "/llm/gpt-4o-split", Some("openai"));
            weighted_rules(d)[i]["matches"][0]["headers"]
                .as_array_mut()
                .expect("headers")
                .pop();
        },
    );
    refused(
        "leads to outbound|443||api.openai.com, but the backend's upstreamCluster is \
         outbound|443||example-resource.openai.azure.com: the filter would answer 503 \
         upstream_mismatch",
        &|d| {
            let i = rule(d, "/v1", Some("azure"));
            weighted_rules(d)[i]["backendRefs"][0]["name"] = json!("api.openai.com");
        },
    );
    refused("(the provider path) does not remove x-maas-backend", &|d| {
        let i = rule(d, "/openai/deployments/gpt-4o-prod", Some("azure"));
        weighted_rules(d)[i]["filters"][1]["requestHeaderModifier"]["remove"] =
            json!(["x-maas-model"]);
    });
    refused("(the one base URL) rewrites the path", &|d| {
        let i = rule(d, "/v1", Some("openai"));
        weighted_rules(d)[i]["filters"][0]["urlRewrite"]["path"] =
            json!({"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"});
    });
    refused("none of its backends' upstreamClusters", &|d| {
        let i = rule(d, "/llm/gpt-4o-split", None);
        weighted_rules(d)[i]["backendRefs"][0]["name"] = json!("api.example.com");
    });
}

/// The rules of the weighted sample's HTTPRoute.
fn weighted_rules(d: &mut Docs) -> &mut Vec<Value> {
    at(doc(d, "HTTPRoute", "gpt-4o-split"), "/spec/rules")
        .as_array_mut()
        .expect("rules")
}
