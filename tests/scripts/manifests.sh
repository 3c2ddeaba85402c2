#!/usr/bin/env bash
# wasm-plugin-crs/: every overlay renders with `kubectl kustomize`, every rendered object validates
# against its schema (tests/fixtures/schemas), and the wiring checks hold (see
# scripts/lib/deploy-manifest-checks.py). Then broken copies prove the checks can fail.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"

CRS=$ROOT/wasm-plugin-crs
SCHEMAS=$ROOT/tests/fixtures/schemas
CHECKS=$ROOT/scripts/lib/deploy-manifest-checks.py
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! ensure_kubectl || ! ensure_venv; then
  fail "test tools" "could not install kubectl (pip $KUBECTL_WHEEL) or the Python venv ($DEPLOY_VENV)"
  finish
  exit 1
fi
PY=$DEPLOY_VENV/bin/python
echo "# kubectl: $KUBECTL ($("$KUBECTL" version --client 2>/dev/null | tr '\n' ' '))"

# run_checks NAME FILE ARGS...: one pass/fail per line the checker prints.
run_checks() {
  local name=$1 file=$2 out line
  shift 2
  out=$("$PY" "$CHECKS" --schemas "$SCHEMAS" "$@" "$file" 2>&1)
  local rc=$?
  while IFS= read -r line; do
    case $line in
      PASS\ *) pass "$name: ${line#PASS }" ;;
      FAIL\ *) fail "$name: ${line#FAIL }" ;;
    esac
  done <<<"$out"
  if [ $rc -ne 0 ] && ! grep -q '^FAIL ' <<<"$out"; then fail "$name: checker crashed" "$out"; fi
}

render() { # render DIR OUT
  "$KUBECTL" kustomize "$1" >"$2" 2>"$2.err"
}

for spec in odh:opendatahub:on odh-tls-off:opendatahub:off rhoai:redhat-ods-applications:on \
  rhoai-tls-off:redhat-ods-applications:off; do
  IFS=: read -r overlay ns tls <<<"$spec"
  if render "$CRS/overlays/$overlay" "$WORK/$overlay.yaml"; then
    pass "overlays/$overlay renders"
    run_checks "$overlay" "$WORK/$overlay.yaml" --namespace "$ns" --tls "$tls" --dev-redis no --lease-store memory
  else
    fail "overlays/$overlay renders" "$(cat "$WORK/$overlay.yaml.err")"
  fi
done
# The development Redis (components/redis-dev) is in no overlay; deploy.sh --dev-redis adds the
# component to the companion's kustomization, as rendered here (odh, TLS on).
mkdir -p "$WORK/dev-redis/companion"
printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: opendatahub\nresources:\n  - %s\ncomponents:\n  - %s\n' \
  "$(realpath -m --relative-to="$WORK/dev-redis/companion" "$CRS/base/companion")" \
  "$(realpath -m --relative-to="$WORK/dev-redis/companion" "$CRS/components/redis-dev")" >"$WORK/dev-redis/companion/kustomization.yaml"
printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\n  - companion\ncomponents:\n  - %s\n  - %s\n' \
  "$(realpath -m --relative-to="$WORK/dev-redis" "$CRS/base/gateway")" \
  "$(realpath -m --relative-to="$WORK/dev-redis" "$CRS/components/tls-backend")" \
  "$(realpath -m --relative-to="$WORK/dev-redis" "$CRS/components/wiring")" >"$WORK/dev-redis/kustomization.yaml"
if render "$WORK/dev-redis" "$WORK/dev-redis.yaml"; then
  pass "odh + components/redis-dev renders"
  # (its objects in the companion's namespace: the checker's namespaces check)
  run_checks "odh+dev-redis" "$WORK/dev-redis.yaml" --namespace opendatahub --tls on --dev-redis yes --lease-store redis
else
  fail "odh + components/redis-dev renders" "$(cat "$WORK/dev-redis.yaml.err")"
fi
# ... and the default render is checked against it: the dev Redis must not appear uninvited.
if [ -s "$WORK/dev-redis.yaml" ]; then
  out=$("$PY" "$CHECKS" --schemas "$SCHEMAS" --namespace opendatahub --tls on --dev-redis no "$WORK/dev-redis.yaml" 2>&1)
  if grep -q "^FAIL .*development Redis rendered: True, expected False" <<<"$out"; then
    pass "a render with the dev Redis is refused where none is expected"
  else
    fail "a render with the dev Redis is refused where none is expected" "$(grep '^FAIL' <<<"$out" | head -3)"
  fi
fi

# The policy from the reference's resources (components/maas-resources) is in no overlay either:
# added to the companion's kustomization (odh, TLS on) as docs/deploy.md shows.
mkdir -p "$WORK/maas-resources/companion"
printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: opendatahub\nresources:\n  - %s\ncomponents:\n  - %s\n' \
  "$(realpath -m --relative-to="$WORK/maas-resources/companion" "$CRS/base/companion")" \
  "$(realpath -m --relative-to="$WORK/maas-resources/companion" "$CRS/components/maas-resources")" >"$WORK/maas-resources/companion/kustomization.yaml"
# (the same gateway side as the dev-Redis render; the paths are relative to a sibling directory)
cp "$WORK/dev-redis/kustomization.yaml" "$WORK/maas-resources/kustomization.yaml"
if render "$WORK/maas-resources" "$WORK/maas-resources.yaml"; then
  pass "odh + components/maas-resources renders"
  run_checks "odh+maas-resources" "$WORK/maas-resources.yaml" --namespace opendatahub --tls on --dev-redis no --lease-store memory
else
  fail "odh + components/maas-resources renders" "$(cat "$WORK/maas-resources.yaml.err")"
fi

# Envoy itself accepts the companion cluster the EnvoyFilter adds (TLS backend on and off; mutual
# TLS to the internal port in both): the cluster goes into a bootstrap, with an ADS source for the
# SDS secrets (the Gateway's key pair and the internal CA), and `envoy --mode validate`
# checks it as the Gateway's Envoy would. Needs the project's Envoy (scripts/test.sh installs it
# into .venv; or MAAS_ENVOY_BIN).
ENVOY_BIN=${MAAS_ENVOY_BIN:-}
if [ -z "$ENVOY_BIN" ]; then
  for candidate in "$ROOT"/.venv/lib/python3*/site-packages/envoy/_bin/envoy; do
    if [ -x "$candidate" ]; then ENVOY_BIN=$candidate; fi
  done
fi
for overlay in odh odh-tls-off; do
  [ -s "$WORK/$overlay.yaml" ] || continue
  if [ -z "$ENVOY_BIN" ]; then
    echo "# skip: no Envoy (.venv or MAAS_ENVOY_BIN) to validate the $overlay companion cluster"
    continue
  fi
  if ! "$PY" - "$WORK/$overlay.yaml" "$WORK/$overlay-bootstrap.json" <<'PYEOF'; then
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
ef = next(d for d in docs if d["kind"] == "EnvoyFilter" and d["metadata"]["name"] == "maas-companion-cluster")
cluster = ef["spec"]["configPatches"][0]["patch"]["value"]
xds = {"name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
       "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
           "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
           "explicit_http_config": {"http2_protocol_options": {}}}},
       "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
           "address": {"socket_address": {"address": "127.0.0.1", "port_value": 15010}}}}]}]}}
json.dump({"node": {"id": "gateway", "cluster": "maas-default-gateway"},
           "dynamic_resources": {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                                                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
           "static_resources": {"clusters": [xds, cluster]}}, open(sys.argv[2], "w"))
PYEOF
    fail "$overlay: companion cluster extracted for Envoy" "no EnvoyFilter maas-companion-cluster"
    continue
  fi
  if out=$("$ENVOY_BIN" --mode validate -c "$WORK/$overlay-bootstrap.json" --log-level error 2>&1); then
    pass "$overlay: Envoy accepts the companion cluster the EnvoyFilter adds"
  else
    fail "$overlay: Envoy accepts the companion cluster" "$(tail -n 5 <<<"$out")"
  fi
done
# ... and the validation can fail: a misspelt field in that cluster is refused by Envoy.
if [ -n "$ENVOY_BIN" ] && [ -s "$WORK/odh-bootstrap.json" ]; then
  sed 's/"connect_timeout"/"connect_timout"/g' "$WORK/odh-bootstrap.json" >"$WORK/broken-bootstrap.json"
  if cmp -s "$WORK/odh-bootstrap.json" "$WORK/broken-bootstrap.json"; then
    fail "Envoy refuses a misspelt companion cluster" "the breakage changed nothing"
  elif out=$("$ENVOY_BIN" --mode validate -c "$WORK/broken-bootstrap.json" --log-level error 2>&1); then
    fail "Envoy refuses a misspelt companion cluster" "accepted"
  elif grep -q "connect_timout" <<<"$out"; then
    pass "Envoy refuses a misspelt companion cluster (connect_timout)"
  else
    fail "Envoy refuses a misspelt companion cluster" "$(tail -n 3 <<<"$out")"
  fi
fi

# ... and the connection manager settings the EnvoyFilter maas-gateway-connection-manager merges
# into the Gateway's HTTP connection manager: merged (as istiod's protobuf MERGE does, field by
# field) into a connection manager like the one Istio generates, and validated by Envoy. A
# misspelt value is refused.
hcm_bootstrap() { # hcm_bootstrap RENDER OUT [BREAK]
  "$PY" - "$@" <<'PYEOF'
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
ef = next(d for d in docs if d["kind"] == "EnvoyFilter" and d["metadata"]["name"] == "maas-gateway-connection-manager")
def merge(base, extra):
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
       "stat_prefix": "outbound_0.0.0.0_8080", "use_remote_address": True,
       "common_http_protocol_options": {"idle_timeout": "3600s"},
       "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
           {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
       "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
           "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
for p in ef["spec"]["configPatches"]:
    assert p["applyTo"] == "NETWORK_FILTER" and p["patch"]["operation"] == "MERGE", p
    value = dict(p["patch"]["value"]["typed_config"])
    assert value.pop("@type") == hcm["@type"]
    merge(hcm, value)
if len(sys.argv) > 3:
    hcm["common_http_protocol_options"]["headers_with_underscores_action"] = sys.argv[3]
json.dump({"static_resources": {"listeners": [{"name": "gateway", "address": {"socket_address": {
    "address": "127.0.0.1", "port_value": 8080}}, "filter_chains": [{"filters": [{
    "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}]}},
    open(sys.argv[2], "w"))
PYEOF
}
if [ -n "$ENVOY_BIN" ] && [ -s "$WORK/odh.yaml" ]; then
  if ! hcm_bootstrap "$WORK/odh.yaml" "$WORK/hcm-bootstrap.json"; then
    fail "connection manager settings extracted for Envoy" "no EnvoyFilter maas-gateway-connection-manager"
  elif out=$("$ENVOY_BIN" --mode validate -c "$WORK/hcm-bootstrap.json" --log-level error 2>&1); then
    pass "Envoy accepts the connection manager settings the EnvoyFilter merges (headers_with_underscores_action)"
  else
    fail "Envoy accepts the connection manager settings" "$(tail -n 5 <<<"$out")"
  fi
  if ! hcm_bootstrap "$WORK/odh.yaml" "$WORK/hcm-broken.json" REJECT_REQUESTS; then
    fail "Envoy refuses a misspelt connection manager setting" "could not build the broken copy"
  elif out=$("$ENVOY_BIN" --mode validate -c "$WORK/hcm-broken.json" --log-level error 2>&1); then
    fail "Envoy refuses a misspelt connection manager setting" "accepted"
  elif grep -q "REJECT_REQUESTS" <<<"$out"; then
    pass "Envoy refuses a misspelt connection manager setting (REJECT_REQUESTS)"
  else
    fail "Envoy refuses a misspelt connection manager setting" "$(tail -n 3 <<<"$out")"
  fi
fi

for dir in base/postgres samples; do
  if render "$CRS/$dir" "$WORK/${dir//\//-}.yaml"; then
    pass "$dir renders"
    run_checks "$dir" "$WORK/${dir//\//-}.yaml" --kinds-only
  else
    fail "$dir renders" "$(cat "$WORK/${dir//\//-}.yaml.err")"
  fi
done

# The checks must refuse a broken render, and say why. mutate NAME writes a broken copy of odh
# (of odh + the dev Redis with MUTATE_SRC=dev-redis).
mutate() {
  "$PY" - "$1" "$WORK/${MUTATE_SRC:-odh}.yaml" "$WORK/broken.yaml" <<'PYEOF'
import sys, yaml
name, src, dst = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(src)) if d]
def get(kind, n):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == n)
dep = get("Deployment", "maas-companion")
filt = get("EnvoyFilter", "maas-filter")
ext = next(p for p in filt["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG")
wasm = ext["patch"]["value"]["typed_config"]["config"]
http_filter = next(p for p in filt["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER")
import json
plugin = json.loads(wasm["configuration"]["value"])
def set_plugin():
    wasm["configuration"]["value"] = json.dumps(plugin)
if name == "typo-field":
    dep["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
elif name == "bad-enum":
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresnt"
elif name == "fail-open":
    wasm["failure_policy"] = "FAIL_OPEN"
elif name == "pause-without-knob":
    wasm.pop("allow_on_headers_stop_iteration")
elif name == "knob-without-pause":
    plugin["pauseHeadersForBody"] = False
    set_plugin()
elif name == "filter-not-first":
    http_filter["patch"]["operation"] = "INSERT_BEFORE"
elif name == "ecds-name-mismatch":
    http_filter["patch"]["value"]["name"] = "maas-filtr"
elif name == "no-rbac-fallback-type":
    http_filter["patch"]["value"]["config_discovery"]["type_urls"] = [
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]
elif name == "filter-waits-not":
    http_filter["patch"]["value"]["config_discovery"]["config_source"]["initial_fetch_timeout"] = "5s"
elif name == "also-a-wasmplugin":
    docs.append({"apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin",
                 "metadata": {"name": "maas-filter", "namespace": "openshift-ingress"},
                 "spec": {"url": "oci://quay.io/maas-gateway/maas-filter:v0.1.0",
                          "pluginConfig": dict(plugin, pauseHeadersForBody=True)}})
elif name == "underscores-allowed":
    hcm = get("EnvoyFilter", "maas-gateway-connection-manager")
    hcm["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["common_http_protocol_options"][
        "headers_with_underscores_action"] = "ALLOW"
elif name == "no-connection-manager-filter":
    docs = [d for d in docs if d["metadata"]["name"] != "maas-gateway-connection-manager"]
elif name == "wrong-cluster-namespace":
    ef = get("EnvoyFilter", "maas-companion-cluster")
    ef["spec"]["configPatches"][0]["patch"]["value"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["address"] = "maas-companion.maas-api.svc.cluster.local"
elif name == "route-to-internal":
    get("HTTPRoute", "maas-api")["spec"]["rules"][0]["backendRefs"][0]["port"] = 8081
elif name == "internal-open-to-all":
    get("NetworkPolicy", "maas-companion-internal")["spec"]["ingress"][0].pop("from")
elif name == "prometheus-to-internal":
    get("NetworkPolicy", "maas-companion-internal")["spec"]["ingress"][0]["from"].append(
        get("NetworkPolicy", "maas-companion-metrics")["spec"]["ingress"][0]["from"][0])
elif name == "metrics-open-to-all":
    get("NetworkPolicy", "maas-companion-metrics")["spec"]["ingress"][0].pop("from")
elif name == "no-metrics-port":
    svc = get("Service", "maas-companion")
    svc["spec"]["ports"] = [p for p in svc["spec"]["ports"] if p["port"] != 9090]
elif name == "unknown-kind":
    docs.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stray"}, "spec": {}})
elif name == "subject-without-namespace":
    get("ClusterRoleBinding", "maas-companion-tokenreview")["subjects"][0].pop("namespace")
elif name == "writable-root":
    dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
elif name == "bad-url-scheme":
    wasm["vm_config"]["code"]["remote"]["http_uri"]["uri"] = "quay.io/maas-gateway/maas-filter:v0.1.0"
elif name == "routes-from-all":
    get("Gateway", "maas-default-gateway")["spec"]["listeners"][1]["allowedRoutes"] = {"namespaces": {"from": "All"}}
elif name == "routes-empty-selector":
    get("Gateway", "maas-default-gateway")["spec"]["listeners"][0]["allowedRoutes"]["namespaces"]["selector"] = {}
elif name == "provider-without-upstream":
    cm = get("ConfigMap", "maas-policy")
    policy = yaml.safe_load(cm["data"]["policy.yaml"])
    for m in policy["models"]:
        m.pop("upstreamCluster", None)
    cm["data"]["policy.yaml"] = yaml.safe_dump(policy)
elif name == "no-companion-cluster":
    docs = [d for d in docs if d["metadata"]["name"] != "maas-companion-cluster"]
elif name == "plugin-uses-istio-cluster-name":
    plugin["companion"]["cluster"] = "outbound|8081||maas-companion.opendatahub.svc.cluster.local"
    set_plugin()
elif name == "companion-cluster-public-port":
    ef = get("EnvoyFilter", "maas-companion-cluster")
    ef["spec"]["configPatches"][0]["patch"]["value"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["port_value"] = 8080
elif name == "companion-cluster-without-tls":
    get("EnvoyFilter", "maas-companion-cluster")["spec"]["configPatches"][0]["patch"]["value"].pop("transport_socket")
elif name == "companion-cluster-other-ca":
    ts = get("EnvoyFilter", "maas-companion-cluster")["spec"]["configPatches"][0]["patch"]["value"]["transport_socket"]
    ts["typed_config"]["common_tls_context"]["combined_validation_context"][
        "validation_context_sds_secret_config"]["name"] = "kubernetes://other-ca-cacert"
elif name == "companion-cluster-without-client-cert":
    ctx = get("EnvoyFilter", "maas-companion-cluster")["spec"]["configPatches"][0]["patch"]["value"][
        "transport_socket"]["typed_config"]["common_tls_context"]
    ctx.pop("tls_certificate_sds_secret_configs")
elif name == "internal-auth-none":
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "MAAS_INTERNAL_AUTH")["value"] = "none"
elif name == "internal-any-caller-of-the-ca":
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "MAAS_INTERNAL_CLIENT_NAMES"]
elif name == "internal-ca-from-elsewhere":
    vols = dep["spec"]["template"]["spec"]["volumes"]
    next(v for v in vols if v["name"] == "internal-tls")["secret"]["secretName"] = "some-other-secret"
elif name == "no-gateway-sds-rbac":
    docs = [d for d in docs if not (d["kind"] == "Role" and d["metadata"]["name"] == "maas-gateway-sds")]
elif name == "gateway-sds-rbac-reads-secrets":
    get("Role", "maas-gateway-sds")["rules"][0]["verbs"] = ["get", "list", "watch"]
elif name == "cleanup-plain-http":
    c = get("CronJob", "maas-api-key-cleanup")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    c["command"][-1] = c["command"][-1].replace("https://", "http://")
elif name == "cleanup-without-client-cert":
    c = get("CronJob", "maas-api-key-cleanup")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    c["command"][-1] = c["command"][-1].replace("--cert /etc/maas/internal-client/tls.crt", "")
elif name == "companion-cluster-on-every-proxy":
    get("EnvoyFilter", "maas-companion-cluster")["spec"].pop("workloadSelector")
elif name == "alert-on-unknown-metric":
    rule = get("PrometheusRule", "maas-gateway-alerts")["spec"]["groups"][0]["rules"][0]
    rule["expr"] = rule["expr"].replace("maas_requests_unavailable", "maas_requests_unavailble")
elif name == "gateway-replicas-disagree":
    cm = get("ConfigMap", "maas-gateway-options")
    cm["data"]["deployment"] = "spec:\n  replicas: 3\n"
elif name == "gateway-replicas-unset":
    plugin["limits"]["global"].pop("replicas")
    set_plugin()
elif name == "gateway-replicas-unpinned":
    get("Gateway", "maas-default-gateway")["spec"].pop("infrastructure")
elif name == "global-limits-off":
    plugin["limits"]["global"]["enabled"] = False
    set_plugin()
elif name == "redis-secret-required":
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "MAAS_REDIS_URL")["valueFrom"]["secretKeyRef"]["optional"] = False
elif name == "no-lease-fallback-alert":
    rules = get("PrometheusRule", "maas-gateway-alerts")["spec"]["groups"][0]["rules"]
    rules[:] = [r for r in rules if r.get("alert") != "MaaSGatewayLeaseFallback"]
elif name in ("dev-redis-persistent", "dev-redis-open-to-all", "dev-redis-two-replicas", "dev-redis-no-password",
              "dev-redis-unlabelled"):
    redis = get("Deployment", "maas-redis")
    c = redis["spec"]["template"]["spec"]["containers"][0]
    if name == "dev-redis-persistent":
        c["command"][-1] = c["command"][-1].replace("--save ''", "--save '60 1'")
    elif name == "dev-redis-open-to-all":
        get("NetworkPolicy", "maas-redis")["spec"]["ingress"][0].pop("from")
    elif name == "dev-redis-two-replicas":
        redis["spec"]["replicas"] = 2
    elif name == "dev-redis-no-password":
        c["command"][-1] = "exec redis-server --save '' --appendonly no"
    else:
        redis["metadata"]["labels"].pop("maas.opendatahub.io/dev-only")
elif name == "resources-no-watch":
    get("ClusterRole", "maas-companion-resources")["rules"][0]["verbs"] = ["get", "list"]
elif name == "two-companions-without-redis":
    dep["spec"]["replicas"] = 2
elif name == "provider-secrets-cluster-wide":
    docs.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": {"name": "maas-companion-provider-secrets"},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": "maas-companion-provider-secrets"},
                 "subjects": [{"kind": "ServiceAccount", "name": "maas-companion", "namespace": "opendatahub"}]})
elif name == "provider-secrets-list":
    get("ClusterRole", "maas-companion-provider-secrets")["rules"][0]["verbs"] = ["get", "list", "watch"]
elif name == "resources-crd-wrong-group":
    get("CustomResourceDefinition", "maassubscriptions.maas.opendatahub.io")["spec"]["group"] = "maas.example.com"
elif name in ("public-url-elsewhere", "public-url-missing"):
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    if name == "public-url-missing":
        env[:] = [e for e in env if e["name"] != "MAAS_PUBLIC_URL"]
    else:
        next(e for e in env if e["name"] == "MAAS_PUBLIC_URL")["value"] = "https://evil.example.net"
elif name == "scrape-plain-http-with-tls":
    get("ServiceMonitor", "maas-companion")["spec"]["endpoints"][0]["scheme"] = "http"
else:
    sys.exit(f"unknown mutation {name}")
yaml.safe_dump_all(docs, open(dst, "w"))
PYEOF
}
expect_refused() { # expect_refused MUTATION EXPECTED-TEXT
  local out
  if ! mutate "$1"; then fail "broken render '$1' refused" "mutation failed"; return; fi
  local rc=0
  out=$("$PY" "$CHECKS" --schemas "$SCHEMAS" --namespace opendatahub --tls on ${LEASE_STORE:+--lease-store "$LEASE_STORE"} "$WORK/broken.yaml" 2>&1) || rc=$?
  if [ "$rc" -ne 0 ] && grep -q "^FAIL .*$2" <<<"$out"; then
    pass "broken render '$1' refused ($2)"
  else
    fail "broken render '$1' refused" "expected a FAIL naming '$2', got: $(grep '^FAIL' <<<"$out" | head -3)"
  fi
}
if [ -s "$WORK/odh.yaml" ]; then
  expect_refused typo-field "imagePulPolicy"
  expect_refused bad-enum "IfNotPresnt"
  expect_refused fail-open "FAIL_OPEN"
  expect_refused pause-without-knob "both or neither"
  expect_refused knob-without-pause "both or neither"
  expect_refused filter-not-first "INSERT_BEFORE"
  expect_refused ecds-name-mismatch "maas-filtr"
  expect_refused no-rbac-fallback-type "RBAC filter"
  expect_refused filter-waits-not "initial_fetch_timeout"
  expect_refused also-a-wasmplugin "WasmPlugin maas-filter rendered"
  expect_refused underscores-allowed "\\['ALLOW'\\]"
  expect_refused no-connection-manager-filter "maas-gateway-connection-manager"
  expect_refused wrong-cluster-namespace "maas-api.svc.cluster.local"
  expect_refused route-to-internal "maas-companion:8081"
  expect_refused internal-open-to-all "opens the internal port to everyone"
  expect_refused prometheus-to-internal "to the internal port"
  expect_refused metrics-open-to-all "opens the metrics port to everyone"
  expect_refused no-metrics-port "no port 9090"
  expect_refused unknown-kind "no schema core_v1_Pod"
  expect_refused subject-without-namespace "namespace"
  expect_refused writable-root "root filesystem writable"
  expect_refused bad-url-scheme "url"
  expect_refused routes-from-all "admits HTTPRoutes from All"
  expect_refused routes-empty-selector "selector {}"
  expect_refused provider-without-upstream "no upstreamCluster"
  expect_refused no-companion-cluster "0 EnvoyFilter patches add cluster 'maas-companion-internal'"
  expect_refused plugin-uses-istio-cluster-name "expected 'maas-companion-internal'"
  expect_refused companion-cluster-public-port "expected maas-companion.opendatahub.svc.cluster.local:8081"
  expect_refused companion-cluster-without-tls "no TLS transport socket"
  expect_refused companion-cluster-without-client-cert "presents no client certificate"
  expect_refused internal-auth-none "MAAS_INTERNAL_AUTH=none"
  expect_refused internal-any-caller-of-the-ca "MAAS_INTERNAL_CLIENT_NAMES \\[\\]"
  expect_refused internal-ca-from-elsewhere "reads some-other-secret/ca.crt"
  expect_refused no-gateway-sds-rbac "expected exactly one Role maas-gateway-sds"
  expect_refused gateway-sds-rbac-reads-secrets "'get', 'list', 'watch'"
  expect_refused cleanup-plain-http "calls the internal port without TLS"
  expect_refused cleanup-without-client-cert "has no --cert"
  expect_refused companion-cluster-other-ca "kubernetes://other-ca-cacert"
  expect_refused companion-cluster-on-every-proxy "EnvoyFilter selects None"
  expect_refused alert-on-unknown-metric "unknown metric envoy_wasmcustom_maas_requests_unavailble"
  expect_refused scrape-plain-http-with-tls "scrapes plain HTTP"
  expect_refused global-limits-off "limits.global.enabled is off"
  expect_refused gateway-replicas-disagree "limits.global.replicas 1 but the Gateway runs 3 replicas"
  expect_refused gateway-replicas-unset "limits.global.replicas None but the Gateway runs 1 replicas"
  expect_refused gateway-replicas-unpinned "infrastructure.parametersRef is None"
  expect_refused redis-secret-required "is not optional"
  expect_refused no-lease-fallback-alert "missing alerts \\['MaaSGatewayLeaseFallback'\\]"
  expect_refused public-url-elsewhere "MAAS_PUBLIC_URL 'https://evil.example.net', expected 'https://maas.apps.cluster.example.com'"
  expect_refused public-url-missing "MAAS_PUBLIC_URL is not set"
  LEASE_STORE=memory expect_refused two-companions-without-redis "companion replicas 2 with the lease counters in process"
fi
if [ -s "$WORK/dev-redis.yaml" ]; then
  MUTATE_SRC=dev-redis expect_refused dev-redis-persistent "persists its data"
  MUTATE_SRC=dev-redis expect_refused dev-redis-open-to-all "opens the dev Redis to everyone"
  MUTATE_SRC=dev-redis expect_refused dev-redis-two-replicas "replicas 2, expected 1"
  MUTATE_SRC=dev-redis expect_refused dev-redis-no-password "without a password"
  MUTATE_SRC=dev-redis expect_refused dev-redis-unlabelled "is not labelled maas.opendatahub.io/dev-only=true"
fi
if [ -s "$WORK/maas-resources.yaml" ]; then
  MUTATE_SRC=maas-resources expect_refused resources-no-watch "policy resources"
  MUTATE_SRC=maas-resources expect_refused resources-crd-wrong-group "group maas.example.com"
  MUTATE_SRC=maas-resources expect_refused provider-secrets-cluster-wide "bound cluster-wide"
  MUTATE_SRC=maas-resources expect_refused provider-secrets-list "expected get on secrets only"
fi

# The Grafana dashboard (base/companion/grafana-dashboard.json): valid JSON with panels whose
# queries name only metrics the filter and the companion export, shipped as the ConfigMap with
# Grafana's dashboard label. A copy naming an unknown metric is refused.
check_dashboard() { # check_dashboard FILE RENDER
  "$PY" - "$CHECKS" "$1" "$2" <<'PYEOF'
import importlib.util, json, re, sys, yaml
spec = importlib.util.spec_from_file_location("checks", sys.argv[1])
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)
text = open(sys.argv[2]).read()
dash = json.loads(text)
assert dash.get("title") and dash.get("uid"), "no title or uid"
panels = [p for p in dash["panels"] if p.get("type") != "row"]
assert len(panels) >= 8, f"{len(panels)} panels"
ids = [p["id"] for p in dash["panels"]]
assert len(ids) == len(set(ids)), "panel ids repeat"
known = checks.exported_metrics()
exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
assert all(p.get("targets") for p in panels), "a panel without a query"
for expr in exprs:
    for metric in re.findall(r"\b(?:envoy_wasmcustom_)?maas_[a-z0-9_]+", expr):
        assert metric in known, f"unknown metric {metric} in {expr!r}"
for needed in ("maas_companion_usage_tokens_total", "maas_companion_usage_refused_total",
               "envoy_wasmcustom_maas_auth_callout_latency_ms_bucket", "maas_companion_database_up"):
    assert any(needed in e for e in exprs), f"no panel on {needed}"
docs = [d for d in yaml.safe_load_all(open(sys.argv[3])) if d]
cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "maas-grafana-dashboard"]
assert len(cms) == 1, f"{len(cms)} ConfigMaps maas-grafana-dashboard"
assert cms[0]["metadata"].get("labels", {}).get("grafana_dashboard") == "1", "no grafana_dashboard label"
assert list(cms[0]["data"].values()) == [text], "the ConfigMap does not hold the dashboard file"
PYEOF
}
DASHBOARD=$CRS/base/companion/grafana-dashboard.json
if [ -s "$WORK/odh.yaml" ]; then
  if out=$(check_dashboard "$DASHBOARD" "$WORK/odh.yaml" 2>&1); then
    pass "Grafana dashboard: valid JSON, known metrics, shipped as a labelled ConfigMap"
  else
    fail "Grafana dashboard" "$(tail -n 3 <<<"$out")"
  fi
  sed 's/maas_companion_usage_tokens_total/maas_companion_usage_tokenz_total/' "$DASHBOARD" >"$WORK/broken-dashboard.json"
  if out=$(check_dashboard "$WORK/broken-dashboard.json" "$WORK/odh.yaml" 2>&1); then
    fail "a dashboard naming an unknown metric is refused" "accepted"
  elif grep -q "unknown metric maas_companion_usage_tokenz_total" <<<"$out"; then
    pass "a dashboard naming an unknown metric is refused"
  else
    fail "a dashboard naming an unknown metric is refused" "$(tail -n 3 <<<"$out")"
  fi
fi

finish
