#!/usr/bin/env python3
"""Checks rendered MaaS Gateway manifests (a multi-document YAML on stdin or in a file).

1. Schema: every object validates against tests/fixtures/schemas/<group>_<version>_<Kind>
   (a kind without a schema fails).
2. Wiring, which no schema can see: the filter's Envoy cluster and authority name the rendered
   companion Service's namespace and internal port; no HTTPRoute reaches the internal port or
   /internal; the internal port admits only the Gateway's pods and the cleanup job, the public port
   only the Gateway's pods, the metrics port only Prometheus (which reaches no other port); the
   Service exposes the three ports; the companion runs hardened with probes, resources and its
   database Secret; TLS objects are present exactly when TLS is on; objects land in the expected
   namespaces; the filter is installed by the EnvoyFilter maas-filter (first in the Gateway's
   HTTP filters, its configuration over ECDS, fail closed, headers held for the body: the filter's
   pauseHeadersForBody and Envoy's allow_on_headers_stop_iteration always together, no WasmPlugin
   beside it); the Gateway's connection manager refuses underscore header names; the filter's
   companion cluster is the one the EnvoyFilter adds to the Gateway's
   Envoy (to the internal port, always with mutual TLS: the Gateway's client certificate and the
   internal CA over SDS, the service account allowed to fetch the key pair); the companion admits
   only client certificates of the internal CA naming the Gateway or the cleanup job, which
   presents its own; the ServiceMonitor, PodMonitor
   and PrometheusRules scrape the right ports and their alerts name only metrics the filter and
   the companion export (read from their sources); the Gateway's pod count (its parametersRef
   ConfigMap) is the filter's limits.global.replicas; the companion's Redis URL (budget leases)
   comes from an optional Secret, and a development Redis, when rendered (--dev-redis yes|no),
   is single, hardened, unpersisted, password-protected and reachable from the companion only.

Prints `PASS <check>` / `FAIL <check>: <why>` lines; exits 1 if anything failed.
Usage: deploy-manifest-checks.py --schemas DIR [--namespace NS] [--tls on|off|any]
       [--dev-redis yes|no|any] [--kinds-only] [FILE]
"""

import argparse
import json
import pathlib
import re
import sys

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

GATEWAY_NS = "openshift-ingress"
GATEWAY_NAME = "maas-default-gateway"
COMPANION = "maas-companion"
PUBLIC_PORT = 8080
INTERNAL_PORT = 8081
METRICS_PORT = 9090
# The Envoy cluster the filter calls the companion through: added by the EnvoyFilter below, not
# Istio's generated outbound|8081||... name (absent with PILOT_FILTER_GATEWAY_CLUSTER_CONFIG=true).
COMPANION_CLUSTER = "maas-companion-internal"
COMPANION_CLUSTER_FILTER = "maas-companion-cluster"
# The Gateway's Deployment options (Gateway.spec.infrastructure.parametersRef): its pod count,
# which the filter's limits.global.replicas must repeat.
GATEWAY_OPTIONS = "maas-gateway-options"
# The EnvoyFilter installing the filter (ECDS), and the one setting the connection manager.
FILTER_ENVOYFILTER = "maas-filter"
HCM_ENVOYFILTER = "maas-gateway-connection-manager"
HCM = "envoy.filters.network.http_connection_manager"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
RBAC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Container port name → number; NetworkPolicies may name either.
COMPANION_PORTS = {"public": PUBLIC_PORT, "internal": INTERNAL_PORT, "metrics": METRICS_PORT}
GATEWAY_POD_LABEL = ("gateway.networking.k8s.io/gateway-name", GATEWAY_NAME)
MONITORING_NS = ("openshift-monitoring", "openshift-user-workload-monitoring")
PROMETHEUS_POD_LABEL = ("app.kubernetes.io/name", "prometheus")
CLEANUP_POD_LABEL = ("app.kubernetes.io/name", "maas-api-key-cleanup")
# The lease store: the companion's optional Secret and the development Redis (components/redis-dev).
REDIS = "maas-redis"
REDIS_SECRET = "maas-redis"
DEV_ONLY_LABEL = "maas.opendatahub.io/dev-only"
# The internal port's mutual TLS (scripts/deploy.sh issues the certificates from a private CA):
# the Secrets, the callers' names (URI SANs) and the Gateway's service account, which istiod must
# let fetch the client key pair over SDS.
GATEWAY_CLIENT_SECRET = "maas-gateway-internal-client"
COMPANION_INTERNAL_SECRET = "maas-companion-internal-tls"
CLEANUP_CLIENT_SECRET = "maas-api-key-cleanup-client"
GATEWAY_CLIENT_NAME = "spiffe://maas.internal/gateway"
CLEANUP_CLIENT_NAME = "spiffe://maas.internal/api-key-cleanup"
GATEWAY_SERVICE_ACCOUNT = f"{GATEWAY_NAME}-openshift-default"
GATEWAY_SDS_RBAC = "maas-gateway-sds"
# Namespaces whose HTTPRoutes the Gateway admits (deploy.sh labels the companion's namespace).
ROUTES_NAMESPACE_LABEL = ("maas.opendatahub.io/gateway-routes", "true")

results = []


def record(name, ok, why=""):
    results.append((name, ok, why))


def schema_file_name(api_version, kind):
    group, _, version = api_version.rpartition("/")
    return f"{group or 'core'}_{version}_{kind}.schema.yaml"


def load_registry(schema_dir):
    resources = []
    for path in sorted(pathlib.Path(schema_dir).glob("*.schema.yaml")):
        contents = yaml.safe_load(path.read_text())
        resources.append((path.name, Resource.from_contents(
            contents, default_specification=__import__("referencing.jsonschema").jsonschema.DRAFT202012)))
    return Registry().with_resources(resources)


def check_schemas(docs, schema_dir):
    registry = load_registry(schema_dir)
    for doc in docs:
        ident = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        name = schema_file_name(str(doc.get("apiVersion", "")), str(doc.get("kind", "")))
        path = pathlib.Path(schema_dir) / name
        if not path.exists():
            record(f"schema {ident}", False, f"no schema {name} for {doc.get('apiVersion')} {doc.get('kind')}")
            continue
        schema = registry.get_or_retrieve(name).value.contents
        validator = Draft202012Validator(schema, registry=registry)
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            why = "; ".join(
                f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message[:160]}" for e in errors[:5])
            record(f"schema {ident}", False, why)
        else:
            record(f"schema {ident}", True)


def find(docs, kind, name=None):
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind, name):
    found = find(docs, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected exactly one {kind} {name}, found {len(found)}")
    return found[0]


def labels_match(selector, labels):
    match = (selector or {}).get("matchLabels", {})
    return all(labels.get(k) == v for k, v in match.items())


def check(name, fn):
    try:
        fn()
        record(name, True)
    except AssertionError as e:
        record(name, False, str(e))
    except (KeyError, TypeError, IndexError) as e:
        record(name, False, f"missing or malformed field: {e!r}")


def check_wiring(docs, namespace, tls, dev_redis_expected=None, lease_store="any"):
    svc = one(docs, "Service", COMPANION)
    ns = svc["metadata"].get("namespace")
    fqdn = f"{COMPANION}.{ns}.svc.cluster.local"

    def namespaces():
        assert ns, "the companion Service has no namespace"
        if namespace:
            assert ns == namespace, f"companion namespace {ns}, expected {namespace}"
        gateway_side = {("EnvoyFilter", FILTER_ENVOYFILTER), ("EnvoyFilter", HCM_ENVOYFILTER),
                        ("Gateway", GATEWAY_NAME), ("ConfigMap", GATEWAY_OPTIONS),
                        ("DestinationRule", "maas-companion-tls"),
                        ("EnvoyFilter", COMPANION_CLUSTER_FILTER), ("PodMonitor", "maas-gateway-envoy"),
                        ("PrometheusRule", "maas-gateway-alerts"), ("Role", GATEWAY_SDS_RBAC),
                        ("RoleBinding", GATEWAY_SDS_RBAC)}
        cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "GatewayClass", "CustomResourceDefinition"}
        for d in docs:
            key = (d["kind"], d["metadata"]["name"])
            got = d["metadata"].get("namespace")
            if key in gateway_side:
                assert got == GATEWAY_NS, f"{key} in {got}, expected {GATEWAY_NS}"
            elif d["kind"] in cluster_scoped:
                assert got is None, f"cluster-scoped {key} has a namespace"
            elif key == ("ConfigMap", "maas-service-ca"):
                assert got in (ns, GATEWAY_NS), f"{key} in {got}"
            else:
                assert got == ns, f"{key} in {got}, expected the companion's namespace {ns}"
        for d in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
            if (d["kind"], d["metadata"]["name"]) in gateway_side:
                continue  # the Gateway's own service account (checked with the internal mTLS)
            for s in d.get("subjects", []):
                if s["kind"] == "ServiceAccount":
                    assert s.get("namespace") == ns, f"{d['kind']} {d['metadata']['name']} binds {s}"
    check("namespaces: companion objects together, gateway objects in openshift-ingress", namespaces)

    def wasm_extension():
        """The filter's Wasm config (the EXTENSION_CONFIG the EnvoyFilter maas-filter adds) and
        its pluginConfig (JSON)."""
        ef = one(docs, "EnvoyFilter", FILTER_ENVOYFILTER)
        adds = [p for p in ef["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
        assert len(adds) == 1, f"{len(adds)} EXTENSION_CONFIG patches in EnvoyFilter {FILTER_ENVOYFILTER}"
        value = adds[0]["patch"]["value"]
        config = value["typed_config"]["config"]
        plugin = json.loads(config["configuration"]["value"])
        return ef, adds[0], value, config, plugin

    def filter_install():
        # One way in only: a WasmPlugin beside the EnvoyFilter would run the filter twice, and
        # a WasmPlugin cannot set allow_on_headers_stop_iteration.
        for wp in find(docs, "WasmPlugin"):
            raise AssertionError(f"WasmPlugin {wp['metadata']['name']} rendered: the filter comes from "
                                 f"EnvoyFilter {FILTER_ENVOYFILTER} only")
        ef, add, value, config, plugin = wasm_extension()
        selector = ef["spec"].get("workloadSelector", {}).get("labels")
        assert selector == dict([GATEWAY_POD_LABEL]), \
            f"EnvoyFilter {FILTER_ENVOYFILTER} selects {selector}, expected the Gateway's pods"
        assert add["patch"]["operation"] == "ADD", add["patch"]["operation"]
        assert add.get("match", {}).get("context") == "GATEWAY", add.get("match")
        assert value["typed_config"]["@type"] == WASM_TYPE, value["typed_config"]["@type"]
        inserts = [p for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
        assert len(inserts) == 1, f"{len(inserts)} HTTP_FILTER patches in EnvoyFilter {FILTER_ENVOYFILTER}"
        ins = inserts[0]
        assert ins["patch"]["operation"] == "INSERT_FIRST", \
            f"HTTP filter inserted with {ins['patch']['operation']}: it must run first (nothing before it)"
        assert ins.get("match", {}).get("context") == "GATEWAY", ins.get("match")
        assert ins["match"]["listener"]["filterChain"]["filter"]["name"] == HCM, ins["match"]
        http_filter = ins["patch"]["value"]
        assert http_filter["name"] == value["name"], \
            f"the HTTP filter asks ECDS for {http_filter['name']!r}, the extension config is {value['name']!r}"
        cd = http_filter["config_discovery"]
        assert "ads" in cd["config_source"], cd["config_source"]
        assert cd["config_source"].get("initial_fetch_timeout") == "0s", \
            "initial_fetch_timeout must be 0s: the listener waits for the filter instead of running without it"
        assert WASM_TYPE in cd["type_urls"] and RBAC_TYPE in cd["type_urls"], \
            f"type_urls {cd['type_urls']}: the Wasm filter and the RBAC filter Istio's agent puts in " \
            "place of a module it cannot fetch (fail closed)"
        assert config.get("failure_policy") == "FAIL_CLOSED", \
            f"failure_policy {config.get('failure_policy')}, expected FAIL_CLOSED"
        assert config.get("fail_open") in (None, False), "fail_open set"
        remote = config["vm_config"]["code"]["remote"]["http_uri"]["uri"]
        assert remote.startswith("oci://"), f"module url {remote!r}: expected oci://"
        env = config["vm_config"].get("environment_variables", {}).get("key_values", {})
        assert env.get("ISTIO_META_WASM_IMAGE_PULL_POLICY") in ("IfNotPresent", "Always"), env
        pause = plugin.get("pauseHeadersForBody", False) is True
        knob = config.get("allow_on_headers_stop_iteration", False) is True
        assert pause == knob, \
            f"pauseHeadersForBody {pause} but allow_on_headers_stop_iteration {knob}: both or neither " \
            "(the flag alone makes Envoy never hand a held body over)"
        assert pause, "headers are not held for the body: a refusal on the body would open an upstream request"
        companion = plugin["companion"]
        assert companion["cluster"] == COMPANION_CLUSTER, \
            f"cluster {companion['cluster']!r}, expected {COMPANION_CLUSTER!r} (the EnvoyFilter's cluster)"
        assert companion.get("authority") in (None, fqdn), \
            f"authority {companion.get('authority')!r}, expected {fqdn!r} or none (the cluster's name)"
        assert plugin.get("failureMode", "closed") == "closed", "failureMode must stay closed"
        glob = plugin.get("limits", {}).get("global", {})
        assert glob.get("enabled", True) is True, \
            "limits.global.enabled is off: every Gateway replica counts alone (N replicas allow N× a tier)"
        assert glob.get("onUnavailable", "fallback") in ("fallback", "refuse"), glob.get("onUnavailable")
        ports = {p["port"] for p in svc["spec"]["ports"]}
        assert {PUBLIC_PORT, INTERNAL_PORT} <= ports, f"Service ports {ports}"
    check("filter: EnvoyFilter maas-filter inserts it first over ECDS, fail closed, headers held for the body "
          "(pauseHeadersForBody with allow_on_headers_stop_iteration), cluster = the EnvoyFilter's companion "
          "cluster, no WasmPlugin", filter_install)

    def connection_manager():
        ef = one(docs, "EnvoyFilter", HCM_ENVOYFILTER)
        selector = ef["spec"].get("workloadSelector", {}).get("labels")
        assert selector == dict([GATEWAY_POD_LABEL]), \
            f"EnvoyFilter {HCM_ENVOYFILTER} selects {selector}, expected the Gateway's pods"
        actions = []
        for p in ef["spec"]["configPatches"]:
            if p["applyTo"] != "NETWORK_FILTER" or p["patch"]["operation"] != "MERGE":
                continue
            assert p.get("match", {}).get("context") == "GATEWAY", p.get("match")
            assert p["match"]["listener"]["filterChain"]["filter"]["name"] == HCM, p["match"]
            tc = p["patch"]["value"]["typed_config"]
            assert tc["@type"] == HCM_TYPE, tc["@type"]
            actions.append(tc.get("common_http_protocol_options", {}).get("headers_with_underscores_action"))
        assert actions and all(a in ("REJECT_REQUEST", "DROP_HEADER") for a in actions), \
            f"headers_with_underscores_action {actions}: the Gateway lets x_maas_user through " \
            "(CGI/WSGI backends read it as x-maas-user)"
    check("connection manager: the Gateway refuses header names with underscores "
          "(headers_with_underscores_action)", connection_manager)

    def gateway_replicas():
        gw = one(docs, "Gateway", GATEWAY_NAME)
        ref = gw["spec"].get("infrastructure", {}).get("parametersRef")
        assert ref == {"group": "", "kind": "ConfigMap", "name": GATEWAY_OPTIONS}, \
            f"the Gateway's infrastructure.parametersRef is {ref}, expected ConfigMap {GATEWAY_OPTIONS}"
        cm = one(docs, "ConfigMap", GATEWAY_OPTIONS)
        assert cm["metadata"].get("namespace") == gw["metadata"].get("namespace"), \
            f"ConfigMap {GATEWAY_OPTIONS} is not beside the Gateway"
        patch = yaml.safe_load(cm["data"]["deployment"]) or {}
        pods = patch.get("spec", {}).get("replicas")
        assert isinstance(pods, int) and pods >= 1, f"the Gateway's deployment patch sets replicas {pods!r}"
        glob = wasm_extension()[4].get("limits", {}).get("global", {})
        assert glob.get("replicas") == pods, \
            f"limits.global.replicas {glob.get('replicas')!r} but the Gateway runs {pods} replicas: in " \
            "fallback each replica admits limit ÷ that number, so a smaller one lets them exceed the limit"
    check("Gateway replicas: pinned by ConfigMap maas-gateway-options = the filter's limits.global.replicas",
          gateway_replicas)

    def companion_cluster():
        name = wasm_extension()[4]["companion"]["cluster"]
        adding = [(f, p) for f in find(docs, "EnvoyFilter") for p in f["spec"]["configPatches"]
                  if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "ADD"
                  and p["patch"].get("value", {}).get("name") == name]
        assert len(adding) == 1, f"{len(adding)} EnvoyFilter patches add cluster {name!r}, expected exactly one"
        ef, patch = adding[0]
        assert ef["metadata"]["name"] == COMPANION_CLUSTER_FILTER, ef["metadata"]["name"]
        selector = ef["spec"].get("workloadSelector", {}).get("labels")
        assert selector == dict([GATEWAY_POD_LABEL]), \
            f"EnvoyFilter selects {selector}, expected the Gateway's pods {dict([GATEWAY_POD_LABEL])}"
        assert patch.get("match", {}).get("context") == "GATEWAY", patch.get("match")
        c = patch["patch"]["value"]
        assert c.get("type") == "STRICT_DNS", f"cluster type {c.get('type')}"
        la = c["load_assignment"]
        assert la["cluster_name"] == name, la["cluster_name"]
        endpoints = [e["endpoint"]["address"]["socket_address"]
                     for group in la["endpoints"] for e in group["lb_endpoints"]]
        assert endpoints == [{"address": fqdn, "port_value": INTERNAL_PORT}], \
            f"cluster endpoints {endpoints}, expected {fqdn}:{INTERNAL_PORT}"
        # Mutual TLS whatever --tls says: the internal port serves the provider keys.
        ts = c.get("transport_socket")
        assert ts, "the companion cluster has no TLS transport socket: the Gateway cannot prove who it is"
        tc = ts["typed_config"]
        assert tc["@type"].endswith("tls.v3.UpstreamTlsContext"), tc["@type"]
        assert tc.get("sni") == f"{COMPANION}.{ns}.svc", f"sni {tc.get('sni')}"
        ctx = tc["common_tls_context"]
        certs = [sds["name"] for sds in ctx.get("tls_certificate_sds_secret_configs", [])
                 if "ads" in sds.get("sds_config", {})]
        assert certs == [f"kubernetes://{GATEWAY_CLIENT_SECRET}"], \
            f"the companion cluster presents no client certificate from Secret {GATEWAY_CLIENT_SECRET} " \
            f"(over SDS): {ctx.get('tls_certificate_sds_secret_configs')}"
        cvc = ctx["combined_validation_context"]
        sans = [m["matcher"].get("exact") for m in
                cvc["default_validation_context"]["match_typed_subject_alt_names"]]
        assert sans == [f"{COMPANION}.{ns}.svc"], f"SANs {sans}"
        sds = cvc["validation_context_sds_secret_config"]
        want_sds = f"kubernetes://{GATEWAY_CLIENT_SECRET}-cacert"
        assert sds["name"] == want_sds, f"CA from {sds['name']!r}, expected {want_sds!r} (the internal CA)"
        assert "ads" in sds["sds_config"], sds["sds_config"]
    check(f"EnvoyFilter: adds the filter's cluster {COMPANION_CLUSTER} to the Gateway's Envoy, "
          f"STRICT_DNS to the companion's internal port, mutual TLS with the Gateway's certificate",
          companion_cluster)

    def internal_mtls():
        # The companion: mutual TLS on, its files from the internal Secret, both callers named.
        deploy = one(docs, "Deployment", COMPANION)
        pod = deploy["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("MAAS_INTERNAL_AUTH", "mtls") == "mtls", \
            f"MAAS_INTERNAL_AUTH={env.get('MAAS_INTERNAL_AUTH')}: the internal port would serve provider keys to anyone"
        mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}

        def secret_file(var, expected_key):
            path = env.get(var)
            assert path, f"{var} is not set"
            directory, _, key = path.rpartition("/")
            assert directory in mounts, f"{var}={path} is not in a mounted volume"
            secret = volumes[mounts[directory]].get("secret", {}).get("secretName")
            assert (secret, key) == (COMPANION_INTERNAL_SECRET, expected_key), \
                f"{var}={path} reads {secret}/{key}, expected {COMPANION_INTERNAL_SECRET}/{expected_key}"
        secret_file("MAAS_INTERNAL_CLIENT_CA", "ca.crt")
        secret_file("MAAS_INTERNAL_TLS_CERT", "tls.crt")
        secret_file("MAAS_INTERNAL_TLS_KEY", "tls.key")
        names = [n.strip() for n in (env.get("MAAS_INTERNAL_CLIENT_NAMES") or "").split(",") if n.strip()]
        assert sorted(names) == sorted([GATEWAY_CLIENT_NAME, CLEANUP_CLIENT_NAME]), \
            f"MAAS_INTERNAL_CLIENT_NAMES {names}, expected exactly the Gateway and the cleanup job"
        # istiod serves the Gateway its client key pair only if its service account may list
        # Secrets in openshift-ingress: exactly that, nothing more.
        role = one(docs, "Role", GATEWAY_SDS_RBAC)
        assert role["metadata"].get("namespace") == GATEWAY_NS, role["metadata"]
        assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}], role["rules"]
        binding = one(docs, "RoleBinding", GATEWAY_SDS_RBAC)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": GATEWAY_SDS_RBAC}, binding["roleRef"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY_SERVICE_ACCOUNT,
                                        "namespace": GATEWAY_NS}], binding["subjects"]
        # The cleanup job presents its own certificate and checks the companion's.
        job = one(docs, "CronJob", "maas-api-key-cleanup")
        jpod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        jc = jpod["containers"][0]
        command = " ".join(jc.get("command", []) + jc.get("args", []))
        jmounts = {m["mountPath"].rstrip("/"): m["name"] for m in jc.get("volumeMounts", [])}
        jvolumes = {v["name"]: v for v in jpod.get("volumes", [])}
        assert "https://" in command and "http://" not in command, \
            f"the cleanup job calls the internal port without TLS: {command!r}"
        for flag, key in (("--cacert", "ca.crt"), ("--cert", "tls.crt"), ("--key", "tls.key")):
            m = re.search(rf"{flag} (\S+)", command)
            assert m, f"the cleanup job's curl has no {flag}: {command!r}"
            directory, _, got_key = m.group(1).rpartition("/")
            assert directory in jmounts, f"the cleanup job's {flag} {m.group(1)} is not mounted"
            secret = jvolumes[jmounts[directory]].get("secret", {}).get("secretName")
            assert (secret, got_key) == (CLEANUP_CLIENT_SECRET, key), \
                f"the cleanup job's {flag} reads {secret}/{got_key}, expected {CLEANUP_CLIENT_SECRET}/{key}"
    check("internal API: mutual TLS on the companion (files from its Secret, only the Gateway and the "
          "cleanup job named), the Gateway's service account may fetch its key pair over SDS, the "
          "cleanup job presents its own certificate", internal_mtls)

    def monitoring():
        sm = one(docs, "ServiceMonitor", COMPANION)
        assert sm["metadata"].get("namespace") == ns, "ServiceMonitor not beside the companion"
        assert labels_match(sm["spec"]["selector"], svc["metadata"].get("labels", {})), \
            "the ServiceMonitor does not select the companion Service"
        names = {p.get("name") for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] == "metrics" and ep["port"] in names, f"scrapes port {ep['port']}"
            if tls == "on":
                assert ep.get("scheme") == "https", "TLS on but Prometheus scrapes plain HTTP"
                assert ep["tlsConfig"].get("serverName") == f"{COMPANION}.{ns}.svc", ep["tlsConfig"]
                assert ep["tlsConfig"]["ca"]["configMap"]["name"] == "maas-service-ca", ep["tlsConfig"]
            elif tls == "off":
                assert ep.get("scheme", "http") == "http", "TLS off but Prometheus scrapes HTTPS"
        pm = one(docs, "PodMonitor", "maas-gateway-envoy")
        assert pm["spec"]["selector"] == {"matchLabels": dict([GATEWAY_POD_LABEL])}, pm["spec"]["selector"]
        assert [e.get("path") for e in pm["spec"]["podMetricsEndpoints"]] == ["/stats/prometheus"]
        known = exported_metrics()
        alerts = set()
        for rule_doc in find(docs, "PrometheusRule"):
            for group in rule_doc["spec"]["groups"]:
                for rule in group["rules"]:
                    alerts.add(rule.get("alert"))
                    expr = re.sub(r'"(\\.|[^"\\])*"', '""', str(rule["expr"]))
                    for metric in re.findall(r"\b(?:envoy_wasmcustom_)?maas_[a-z0-9_]+", expr):
                        assert metric in known, \
                            f"alert {rule.get('alert')} uses unknown metric {metric} (not exported by the filter or companion)"
        want = {"MaaSCompanionDown", "MaaSFilterUnavailableDecisionsRising", "MaaSFilterCalloutFailures",
                "MaaSPolicyRejected", "MaaSFilterPolicyRejected", "MaaSLeaseStoreDown", "MaaSGatewayLeaseFallback",
                "MaaSFilterHeadersNotHeld"}
        assert want <= alerts, f"missing alerts {sorted(want - alerts)}"
    check("monitoring: ServiceMonitor on the metrics port (HTTPS with TLS on), PodMonitor on the "
          "Gateway's Envoy, alerts on exported metrics only", monitoring)

    def service_ports():
        deploy = one(docs, "Deployment", COMPANION)
        container = {p["name"]: p["containerPort"] for p in
                     deploy["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert container == COMPANION_PORTS, f"container ports {container}, expected {COMPANION_PORTS}"
        by_port = {p["port"]: p for p in svc["spec"]["ports"]}
        for name, number in COMPANION_PORTS.items():
            assert number in by_port, f"the Service has no port {number} ({name})"
            target = by_port[number].get("targetPort")
            assert target in (name, number), f"Service port {number} targets {target}, expected {name}"
        metrics = by_port[METRICS_PORT]
        assert metrics.get("name") == "metrics", f"Service port {METRICS_PORT} named {metrics.get('name')!r}"
    check(f"Service: public {PUBLIC_PORT}, internal {INTERNAL_PORT} and metrics {METRICS_PORT} "
          "to the container ports of those names", service_ports)

    def routes():
        public = None
        for r in find(docs, "HTTPRoute"):
            for rule in r["spec"].get("rules", []):
                for b in rule.get("backendRefs", []):
                    if b.get("name") == COMPANION:
                        assert b.get("port") == PUBLIC_PORT, \
                            f"HTTPRoute {r['metadata']['name']} reaches {COMPANION}:{b.get('port')}"
                for m in rule.get("matches", []):
                    value = m.get("path", {}).get("value", "/")
                    assert not value.startswith("/internal"), f"HTTPRoute {r['metadata']['name']} matches {value}"
            if r["metadata"]["name"] == "maas-api":
                public = r
        assert public is not None, "no HTTPRoute maas-api"
        assert public["metadata"].get("namespace") == ns, "maas-api route not beside the companion"
        rule = public["spec"]["rules"][0]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/maas-api"}}], rule["matches"]
        assert rule["filters"] == [{"type": "URLRewrite", "urlRewrite": {"path": {
            "type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}], rule["filters"]
        assert public["spec"]["parentRefs"][0]["name"] == GATEWAY_NAME
        assert public["spec"]["parentRefs"][0].get("namespace") == GATEWAY_NS
    check("HTTPRoutes: /maas-api → public port with prefix rewritten; nothing reaches 8081 or /internal", routes)

    def gateway_routes():
        gw = one(docs, "Gateway", GATEWAY_NAME)
        listeners = gw["spec"]["listeners"]
        assert listeners, "the Gateway has no listeners"
        for lst in listeners:
            ns_rule = (lst.get("allowedRoutes") or {}).get("namespaces") or {}
            origin = ns_rule.get("from", "Same")
            assert origin in ("Same", "Selector"), \
                f"listener {lst['name']} admits HTTPRoutes from {origin}: anyone who may create one " \
                "could attach a route under a model's path and receive its provider key"
            if origin == "Selector":
                selector = ns_rule.get("selector") or {}
                assert selector == {"matchLabels": dict([ROUTES_NAMESPACE_LABEL])}, \
                    f"listener {lst['name']} selector {selector}, expected matchLabels " \
                    f"{ROUTES_NAMESPACE_LABEL[0]}: \"{ROUTES_NAMESPACE_LABEL[1]}\""
            else:
                assert ns == GATEWAY_NS, \
                    f"listener {lst['name']} admits only {GATEWAY_NS} routes; maas-api lives in {ns}"
    check("Gateway: HTTPRoutes only from namespaces labelled "
          f"{ROUTES_NAMESPACE_LABEL[0]}={ROUTES_NAMESPACE_LABEL[1]}", gateway_routes)

    def network_policies():
        deploy = one(docs, "Deployment", COMPANION)
        pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
        policies = [p for p in find(docs, "NetworkPolicy")
                    if p["metadata"].get("namespace") == ns and labels_match(p["spec"]["podSelector"], pod_labels)]
        assert any(p["spec"].get("policyTypes") == ["Ingress"] and not p["spec"].get("ingress") for p in policies), \
            "no default-deny ingress policy for the companion"
        # Who may reach which port. Prometheus may scrape the metrics port and nothing else: the
        # internal port serves the provider credentials without authentication.
        allowed = {"public": {"gateway"}, "internal": {"gateway", "cleanup"}, "metrics": {"prometheus"}}
        admitted = {name: set() for name in COMPANION_PORTS}
        for p in policies:
            for rule in p["spec"].get("ingress", []):
                listed = [x.get("port") for x in rule.get("ports", [])]
                ports = [name for name, number in COMPANION_PORTS.items()
                         if not listed or name in listed or number in listed]
                peers = rule.get("from")
                for port in ports:
                    assert peers, f"{p['metadata']['name']} opens the {port} port to everyone"
                for peer in peers or []:
                    assert "ipBlock" not in peer, f"{p['metadata']['name']} opens {ports} to an ipBlock"
                    pod_sel = peer.get("podSelector", {}).get("matchLabels", {})
                    ns_sel = peer.get("namespaceSelector", {}).get("matchLabels")
                    gateway = ns_sel == {"kubernetes.io/metadata.name": GATEWAY_NS} and \
                        pod_sel.get(GATEWAY_POD_LABEL[0]) == GATEWAY_POD_LABEL[1]
                    cleanup = ns_sel is None and "namespaceSelector" not in peer and \
                        pod_sel.get(CLEANUP_POD_LABEL[0]) == CLEANUP_POD_LABEL[1]
                    prometheus = ns_sel in [{"kubernetes.io/metadata.name": n} for n in MONITORING_NS] and \
                        pod_sel == {PROMETHEUS_POD_LABEL[0]: PROMETHEUS_POD_LABEL[1]}
                    who = "gateway" if gateway else "cleanup" if cleanup else "prometheus" if prometheus else None
                    for port in ports:
                        assert who in allowed[port], \
                            f"{p['metadata']['name']} admits {peer} to the {port} port"
                        admitted[port].add(who)
        assert "gateway" in admitted["internal"], "the Gateway's pods cannot reach the internal port"
        assert "gateway" in admitted["public"], "the Gateway's pods cannot reach the public port"
        assert "prometheus" in admitted["metrics"], "Prometheus cannot reach the metrics port"
        job = one(docs, "CronJob", "maas-api-key-cleanup")
        job_labels = job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
        assert job_labels.get(CLEANUP_POD_LABEL[0]) == CLEANUP_POD_LABEL[1], "cleanup pods lack their label"
    check("NetworkPolicies: default deny; internal port only from Gateway pods and the cleanup job, "
          "public port only from Gateway pods, metrics port only from Prometheus", network_policies)

    def deployment():
        deploy = one(docs, "Deployment", COMPANION)
        pod = deploy["spec"]["template"]["spec"]
        assert pod["securityContext"].get("runAsNonRoot") is True, "pod not runAsNonRoot"
        c = pod["containers"][0]
        sc = c["securityContext"]
        assert sc.get("readOnlyRootFilesystem") is True, "root filesystem writable"
        assert sc.get("allowPrivilegeEscalation") is False, "privilege escalation allowed"
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities not dropped"
        for k in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"].get(k, {})), f"resources.{k} incomplete"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        env = {e["name"]: e for e in c["env"]}
        ref = env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("maas-db-config", "DB_CONNECTION_URL"), ref
        # The lease store is optional: without the Secret the companion keeps leases in process.
        redis_ref = env["MAAS_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert (redis_ref["name"], redis_ref["key"]) == (REDIS_SECRET, "url"), redis_ref
        assert redis_ref.get("optional") is True, \
            f"MAAS_REDIS_URL from Secret {REDIS_SECRET} is not optional: no companion starts without Redis"
        assert env["MAAS_IDENTITY_PROVIDER"]["value"] == "kubernetes"
        assert env["MAAS_CREDENTIALS_SOURCE"]["value"] == "kubernetes"
        assert env["MAAS_INTERNAL_ADDR"]["value"].endswith(f":{INTERNAL_PORT}")
        assert env["MAAS_PUBLIC_ADDR"]["value"].endswith(f":{PUBLIC_PORT}")
        assert env["MAAS_METRICS_ADDR"]["value"].endswith(f":{METRICS_PORT}"), \
            f"MAAS_METRICS_ADDR {env['MAAS_METRICS_ADDR']['value']}, expected port {METRICS_PORT}"
        policy_file = env["MAAS_POLICY_FILE"]["value"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = [n for n, m in mounts.items() if policy_file.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounted, f"{policy_file} is not under a mounted volume"
        cm_name = volumes[mounted[0]]["configMap"]["name"]
        cm = one(docs, "ConfigMap", cm_name)
        key = policy_file.rsplit("/", 1)[1]
        assert key in cm["data"], f"ConfigMap {cm_name} has no key {key}"
        assert pod["serviceAccountName"] == one(docs, "ServiceAccount", COMPANION)["metadata"]["name"]
        tls_env = "MAAS_TLS_CERT" in env and "MAAS_TLS_KEY" in env
        schemes = {c["livenessProbe"]["httpGet"].get("scheme", "HTTP"), c["readinessProbe"]["httpGet"].get("scheme", "HTTP")}
        if tls == "on":
            assert tls_env and schemes == {"HTTPS"}, "TLS on but the companion serves plain HTTP"
        elif tls == "off":
            assert not tls_env and schemes == {"HTTP"}, "TLS off but the companion is given a certificate"
    check("companion Deployment: hardened, probes, resources, DB Secret, policy file from the ConfigMap", deployment)

    def dev_redis():
        redis = find(docs, "Deployment", REDIS)
        if dev_redis_expected is not None:
            assert bool(redis) == dev_redis_expected, \
                f"development Redis rendered: {bool(redis)}, expected {dev_redis_expected}"
        if not redis:
            assert not find(docs, "Service", REDIS), "a Service maas-redis without the dev Redis"
            return
        d = redis[0]
        for obj in [d] + find(docs, "Service", REDIS) + find(docs, "NetworkPolicy", REDIS):
            assert obj["metadata"].get("labels", {}).get(DEV_ONLY_LABEL) == "true", \
                f"{obj['kind']} {REDIS} is not labelled {DEV_ONLY_LABEL}=true"
        assert d["spec"].get("replicas") == 1, f"dev Redis replicas {d['spec'].get('replicas')}, expected 1"
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"].get("runAsNonRoot") is True, "dev Redis pod not runAsNonRoot"
        c = pod["containers"][0]
        sc = c["securityContext"]
        assert sc.get("readOnlyRootFilesystem") is True, "dev Redis root filesystem writable"
        assert sc.get("allowPrivilegeEscalation") is False, "dev Redis privilege escalation allowed"
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], "dev Redis capabilities not dropped"
        for k in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"].get(k, {})), f"dev Redis resources.{k} incomplete"
        assert c.get("readinessProbe"), "dev Redis has no readiness probe"
        for v in pod.get("volumes", []):
            assert "persistentVolumeClaim" not in v, f"dev Redis volume {v['name']} is persistent"
        command = " ".join(c.get("command", []) + c.get("args", []))
        assert "--save ''" in command and "--appendonly no" in command, \
            f"dev Redis persists its data (expected --save '' --appendonly no): {command!r}"
        assert "requirepass" in command and "$REDIS_PASSWORD" in command, "dev Redis runs without a password"
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (REDIS_SECRET, "password"), ref
        svc_redis = one(docs, "Service", REDIS)
        assert svc_redis["spec"]["selector"] == {"app.kubernetes.io/name": REDIS}, svc_redis["spec"]["selector"]
        assert [p["port"] for p in svc_redis["spec"]["ports"]] == [6379], svc_redis["spec"]["ports"]
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        policies = [p for p in find(docs, "NetworkPolicy") if labels_match(p["spec"]["podSelector"], pod_labels)]
        assert policies, "no NetworkPolicy guards the dev Redis"
        for p in policies:
            for rule in p["spec"].get("ingress", []):
                peers = rule.get("from")
                assert peers, f"{p['metadata']['name']} opens the dev Redis to everyone"
                for peer in peers:
                    assert set(peer) == {"podSelector"} and \
                        peer["podSelector"].get("matchLabels") == {"app.kubernetes.io/name": COMPANION}, \
                        f"{p['metadata']['name']} admits {peer} to the dev Redis"
    check("lease store: MAAS_REDIS_URL from an optional Secret; a dev Redis only when asked, "
          "single, hardened, unpersisted, password-protected, reachable from the companion only", dev_redis)

    def public_url():
        dep = one(docs, "Deployment", COMPANION)
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert "MAAS_PUBLIC_URL" in env, \
            "MAAS_PUBLIC_URL is not set: GET /v1/models would list models without their url"
        url = env["MAAS_PUBLIC_URL"].get("value")
        gw = one(docs, "Gateway", GATEWAY_NAME)
        hosts = {l.get("hostname") for l in gw["spec"]["listeners"] if l.get("protocol") == "HTTPS"}
        assert len(hosts) == 1, f"the Gateway's HTTPS listeners name {sorted(map(str, hosts))}"
        want = f"https://{hosts.pop()}"
        assert url == want, f"MAAS_PUBLIC_URL {url!r}, expected {want!r} (the Gateway's HTTPS hostname)"
    check("public URL: the companion names models under the Gateway's HTTPS hostname (MAAS_PUBLIC_URL)",
          public_url)

    def companion_replicas():
        dep = one(docs, "Deployment", COMPANION)
        n = dep["spec"].get("replicas", 1)
        if lease_store == "memory":
            assert not find(docs, "Deployment", REDIS), "a dev Redis rendered where the counters are in process"
            assert n == 1, \
                f"companion replicas {n} with the lease counters in process: each replica is a budget of its " \
                f"own ({n}x every limit); run one, or give it a Redis (--redis-url / --dev-redis)"
        elif lease_store == "redis":
            assert n >= 1, f"companion replicas {n}"
    check(f"one budget: the companion's replicas fit its lease store ({lease_store})", companion_replicas)

    def rbac():
        cr = one(docs, "ClusterRole", "maas-companion-tokenreview")
        assert cr["rules"] == [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                                "verbs": ["create"]}], cr["rules"]
        role = one(docs, "Role", COMPANION)
        resources = sorted(r for rule in role["rules"] for r in rule["resources"])
        assert resources == ["configmaps", "secrets"], resources
        for rule in role["rules"]:
            assert sorted(rule["verbs"]) == ["get", "list", "watch"], rule
    check("RBAC: tokenreviews create cluster-wide; Secrets/ConfigMaps read-only in its namespace", rbac)

    def policy_resources():
        # components/maas-resources: the companion reads the reference's resources.
        dep = one(docs, "Deployment", COMPANION)
        env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        crds = find(docs, "CustomResourceDefinition")
        if env.get("MAAS_POLICY_SOURCE") != "kubernetes":
            assert not crds and not find(docs, "ClusterRole", "maas-companion-resources") \
                and not find(docs, "ClusterRole", "maas-companion-provider-secrets"), \
                "reference CRDs or their RBAC rendered without MAAS_POLICY_SOURCE=kubernetes"
            return
        # ExternalModels' provider keys: `get` on Secrets, bound per model namespace only.
        secrets = one(docs, "ClusterRole", "maas-companion-provider-secrets")
        assert secrets["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}], \
            f"maas-companion-provider-secrets rules {secrets['rules']}, expected get on secrets only"
        bound = [d["metadata"]["name"] for d in find(docs, "ClusterRoleBinding")
                 if d["roleRef"]["name"] == "maas-companion-provider-secrets"]
        assert not bound, f"maas-companion-provider-secrets bound cluster-wide by {bound}: " \
            "every namespace's Secrets readable (bind it per model namespace with a RoleBinding)"
        assert env.get("MAAS_POLICY_NAMESPACE"), "MAAS_POLICY_NAMESPACE is not set"
        plurals = {"maasmodelrefs": "MaaSModelRef", "externalmodels": "ExternalModel",
                   "maasauthpolicies": "MaaSAuthPolicy", "maassubscriptions": "MaaSSubscription"}
        got = {c["spec"]["names"]["plural"]: c for c in crds}
        assert set(got) == set(plurals), f"CRDs {sorted(got)}, expected {sorted(plurals)}"
        for plural, kind in plurals.items():
            c = got[plural]
            assert c["metadata"]["name"] == f"{plural}.maas.opendatahub.io", c["metadata"]["name"]
            assert c["spec"]["group"] == "maas.opendatahub.io" and c["spec"]["names"]["kind"] == kind, \
                f"{plural}: group {c['spec']['group']}, kind {c['spec']['names']['kind']}"
            assert [v["name"] for v in c["spec"]["versions"]] == ["v1alpha1"], c["spec"]["versions"]
        cr = one(docs, "ClusterRole", "maas-companion-resources")
        assert cr["rules"] == [
            {"apiGroups": ["maas.opendatahub.io"], "resources": sorted(plurals, key=list(plurals).index),
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}], cr["rules"]
        crb = one(docs, "ClusterRoleBinding", "maas-companion-resources")
        assert crb["roleRef"]["name"] == "maas-companion-resources" and \
            [s["name"] for s in crb["subjects"]] == [COMPANION], crb
    check("policy resources: with MAAS_POLICY_SOURCE=kubernetes the four maas.opendatahub.io/v1alpha1 CRDs, "
          "read-only access to them and Event writing, provider-key Secrets `get` only and bound "
          "per namespace, never cluster-wide; none without", policy_resources)

    def tls_objects():
        drs = find(docs, "DestinationRule", "maas-companion-tls")
        if tls == "on":
            assert len(drs) == 1, "TLS on but no DestinationRule"
            t = drs[0]["spec"]["trafficPolicy"]["tls"]
            assert drs[0]["spec"]["host"] == fqdn, drs[0]["spec"]["host"]
            assert t["mode"] == "SIMPLE" and t.get("credentialName") == "maas-companion-ca", t
            assert t.get("sni") == f"{COMPANION}.{ns}.svc", t.get("sni")
            ann = svc["metadata"].get("annotations", {})
            assert ann.get("service.beta.openshift.io/serving-cert-secret-name") == "maas-companion-tls", ann
        elif tls == "off":
            assert not drs, "TLS off but a TLS DestinationRule is rendered"
    check(f"TLS backend objects match --tls {tls}", tls_objects)

    def policy_document():
        cm = one(docs, "ConfigMap", "maas-policy")
        doc = yaml.safe_load(cm["data"]["policy.yaml"])
        tiers = {t["name"] for t in doc["tiers"]}
        for m in doc.get("models", []):
            assert set(m["tiers"]) <= tiers, f"model {m['name']} names unknown tiers"
            assert not m["path"].startswith(("/maas-api", "/internal")), m["path"]
            if m.get("provider"):
                assert m.get("upstreamCluster"), \
                    f"model {m['name']} has a provider but no upstreamCluster"
    check("policy ConfigMap parses, its models name known tiers, external models their upstreamCluster",
          policy_document)


def exported_metrics():
    """Metric names as Prometheus sees them, read from the filter's and the companion's sources."""
    filter_metrics = (REPO_ROOT / "filter/src/metrics.rs").read_text()
    decisions = (REPO_ROOT / "filter/src/response.rs").read_text()
    companion = (REPO_ROOT / "companion/src/metrics.rs").read_text()
    base = set(re.findall(r'pub const [A-Z_]+: &str = "(maas_[a-z0-9_]+)"', filter_metrics))
    if "maas_requests_{}" in filter_metrics:
        base |= {f"maas_requests_{d}" for d in re.findall(r'Decision::\w+ => "([a-z_]+)"', decisions)}
    known = set()
    for name in base:  # Envoy: counters as-is, histograms with _bucket/_sum/_count
        known |= {f"envoy_wasmcustom_{name}{suffix}" for suffix in ("", "_bucket", "_sum", "_count")}
    for name in re.findall(r'register\(\s*"(maas_[a-z0-9_]+)"', companion):  # OpenMetrics suffixes
        known |= {f"{name}{suffix}" for suffix in ("", "_total", "_bucket", "_sum", "_count", "_created")}
    assert len(known) > 20, f"could not read the metric names from the sources ({sorted(known)})"
    return known


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", required=True)
    ap.add_argument("--namespace")
    ap.add_argument("--tls", choices=["on", "off", "any"], default="any")
    ap.add_argument("--kinds-only", action="store_true", help="schemas only (samples, postgres)")
    ap.add_argument("--dev-redis", choices=["yes", "no", "any"], default="any",
                    help="whether the development Redis must (not) be rendered")
    ap.add_argument("--lease-store", choices=["memory", "redis", "any"], default="any",
                    help="where the companion's lease counters are: memory requires one companion replica")
    ap.add_argument("file", nargs="?")
    args = ap.parse_args()
    text = open(args.file).read() if args.file else sys.stdin.read()
    docs = [d for d in yaml.safe_load_all(text) if d]
    if not docs:
        record("render is not empty", False, "no objects")
    check_schemas(docs, args.schemas)
    if not args.kinds_only:
        check_wiring(docs, args.namespace, args.tls, {"yes": True, "no": False}.get(args.dev_redis),
                     args.lease_store)
    failed = 0
    for name, ok, why in results:
        print(f"PASS {name}" if ok else f"FAIL {name}: {why}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
