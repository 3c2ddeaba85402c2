#!/usr/bin/env bash
# Deploys MaaS Gateway on OpenShift (or, --platform kubernetes, on plain Kubernetes with Istio): the companion service (API keys, identity, policy,
# credentials), its database, the Gateway and the MaaS filter (EnvoyFilter maas-filter) in the Gateway's Envoy.
# Flags and variables follow the reference MaaS deploy script so its users can carry on.
# `--dry-run` prints every command it would run and the rendered manifests, and changes nothing.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
CRS_DIR=$REPO_ROOT/wasm-plugin-crs

# ---- defaults (each can come from the environment) -------------------------------------------
# Where the mode came from: on plain Kubernetes the default is kustomize, an explicit operator
# mode is refused.
DEPLOYMENT_MODE_GIVEN=${DEPLOYMENT_MODE:+true}
DEPLOYMENT_MODE=${DEPLOYMENT_MODE:-operator}
# openshift, kubernetes (any Gateway API cluster whose implementation is Istio: no oc, Routes,
# SCCs or service CA; overlays/kubernetes), or auto: openshift when `oc` is installed.
PLATFORM=${PLATFORM:-auto}
OPERATOR_TYPE=${OPERATOR_TYPE:-odh}
DEPLOYMENT_NAMESPACE=${DEPLOYMENT_NAMESPACE:-}
ENABLE_TLS_BACKEND=${ENABLE_TLS_BACKEND:-true}
VERBOSE=${VERBOSE:-false}
DRY_RUN=${DRY_RUN:-false}
OPERATOR_CATALOG=${OPERATOR_CATALOG:-}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-}
OPERATOR_CHANNEL=${OPERATOR_CHANNEL:-}
OPERATOR_STARTING_CSV=${OPERATOR_STARTING_CSV:-}
# No default images: nothing is published under a fixed name. scripts/build-images.sh builds and
# pushes both and prints the references (pass them with --images FILE or these variables).
MAAS_API_IMAGE=${MAAS_API_IMAGE:-}
MAAS_WASM_IMAGE=${MAAS_WASM_IMAGE:-}
MAAS_CONTROLLER_IMAGE=${MAAS_CONTROLLER_IMAGE:-}
POSTGRES_CONNECTION=${POSTGRES_CONNECTION:-}
POSTGRES_USER=${POSTGRES_USER:-maas}
POSTGRES_DB=${POSTGRES_DB:-maas}
# Budget leases (global limits across Gateway replicas): the companion's Redis. REDIS_URL is a
# given Redis; DEV_REDIS=true deploys the development one (components/redis-dev). Neither: the
# companion keeps the lease counters in process.
REDIS_URL=${REDIS_URL:-}
DEV_REDIS=${DEV_REDIS:-false}
# The Gateway's pods (its Deployment, through ConfigMap maas-gateway-options) and the filter's
# limits.global.replicas: always the same number (each replica's share of a limit while the
# lease service is unreachable is limit ÷ this).
GATEWAY_REPLICAS=${GATEWAY_REPLICAS:-1}
# The reference's development switch (its --dev: the dev overlay): here the development defaults,
# a development Redis (unless --redis-url) beside the development PostgreSQL (unless
# --postgres-connection).
DEV_MODE=${DEV_MODE:-false}
# External OIDC (the reference's --external-oidc, OIDC_ISSUER_URL, OIDC_CLIENT_ID): the companion
# verifies JWTs of that issuer itself (MAAS_OIDC_*), beside the cluster's tokens (TokenReview).
# OIDC_JWKS_URL: the issuer's keys; when empty, read from the issuer's discovery document.
EXTERNAL_OIDC=${EXTERNAL_OIDC:-false}
OIDC_ISSUER_URL=${OIDC_ISSUER_URL:-}
OIDC_CLIENT_ID=${OIDC_CLIENT_ID:-}
OIDC_JWKS_URL=${OIDC_JWKS_URL:-}
OIDC_GROUPS_CLAIM=${OIDC_GROUPS_CLAIM:-}
# The reference deploys a Keycloak (--enable-keycloak); MaaS Gateway does not (refused, naming
# what to pass instead).
ENABLE_KEYCLOAK=${ENABLE_KEYCLOAK:-false}
# The reference's --policy-engine: kuadrant (odh's default) or rhcl (rhoai's). Here the policies
# are enforced by the MaaS filter; the engine is what operator mode installs for the operator.
POLICY_ENGINE=${POLICY_ENGINE:-}
# Admins: whoever may create MaaSAuthPolicies in this namespace (the reference's
# MAAS_SUBSCRIPTION_NAMESPACE; the companion's MAAS_ADMIN_SAR_NAMESPACE).
MAAS_SUBSCRIPTION_NAMESPACE=${MAAS_SUBSCRIPTION_NAMESPACE:-models-as-a-service}
LOG_LEVEL=${LOG_LEVEL:-INFO}
CERT_NAME=${CERT_NAME:-}
CLUSTER_DOMAIN=${CLUSTER_DOMAIN:-}
FIELD_MANAGER=maas-gateway-deploy

CRD_TIMEOUT=${CRD_TIMEOUT:-180}
CSV_TIMEOUT=${CSV_TIMEOUT:-180}
CUSTOM_RESOURCE_TIMEOUT=${CUSTOM_RESOURCE_TIMEOUT:-600}
ROLLOUT_TIMEOUT=${ROLLOUT_TIMEOUT:-120}
RESOURCE_TIMEOUT=${RESOURCE_TIMEOUT:-300}

MIN_OPENSHIFT_VERSION=4.19.9
MIN_KUADRANT_VERSION=1.4.2
MIN_RHCL_VERSION=1.3.0
MIN_KUSTOMIZE_MAJOR=5
GATEWAY_NAMESPACE=openshift-ingress
# The cluster CLI: oc on OpenShift, kubectl on plain Kubernetes (validate_platform).
KCLI=oc
GATEWAY_NAME=maas-default-gateway
POLICY_ENGINE_NAMESPACE=kuadrant-system
OPERATOR_NAMESPACE=openshift-operators

# ---- output ------------------------------------------------------------------------------------
log_info() { echo "[INFO] $*"; }
log_warn() { echo "[WARN] $*" >&2; }
log_error() { echo "[ERROR] $*" >&2; }
log_debug() { if [ "$LOG_LEVEL" = DEBUG ]; then echo "[DEBUG] $*"; fi; }
die() {
  log_error "$*"
  exit 1
}

usage() {
  cat <<'EOF'
Usage: scripts/deploy.sh [options]

Deploys MaaS Gateway on OpenShift (>= 4.19.9, Gateway API): the companion service and its
database, the Gateway maas-default-gateway and the MaaS filter (EnvoyFilter maas-filter) in its Envoy.

Options:
  --platform P               openshift, kubernetes or auto (default: openshift when oc is
                             installed, else kubernetes). kubernetes: any Gateway API cluster whose
                             implementation is Istio (1.24+, GatewayClass istio): kubectl only, the
                             Gateway in maas-gateway, the companion in maas (--namespace), TLS from
                             this script's private CA; kustomize mode only; CLUSTER_DOMAIN and the
                             Gateway's certificate Secret maas-gateway/CERT_NAME (default
                             maas-gateway-tls, e.g. from cert-manager) are yours
  --deployment-mode MODE     operator (default): install the ODH/RHOAI operator and the policy
                             engine first; kustomize: apply MaaS Gateway's manifests only
  --operator-type TYPE       odh (default) or rhoai
  --enable-tls-backend       TLS to the companion's public and metrics ports (default)
  --disable-tls-backend      plain HTTP to those two ports; the internal port (provider keys)
                             always serves mutual TLS: only the Gateway's client certificate
                             (a private CA this script issues into Secrets) is admitted
  --namespace NS             companion namespace (kustomize mode; default opendatahub;
                             operator mode uses the operator's: opendatahub / redhat-ods-applications)
  --postgres-connection URL  use this PostgreSQL (postgres://...); without it a development
                             PostgreSQL with a PersistentVolumeClaim is deployed
  --redis-url URL            the Redis that holds the budget-lease counters, so that limits hold
                             across Gateway replicas (and companion replicas): redis://, or
                             rediss:// for TLS, password (and user) in the URL:
                             rediss://:PASSWORD@HOST:6380/0. One endpoint (a primary that follows
                             failover; no Sentinel discovery), not Redis Cluster. Stored in
                             Secret maas-redis (key url), never printed
  --dev-redis                deploy a development Redis (one pod, no persistence, a generated
                             password) and point the companion at it; not for production
                             Without either, the companion runs ONE replica keeping the lease
                             counters in process (one budget across Gateway replicas; the counts
                             of the current windows are lost on its restart); with either, two
                             replicas sharing the Redis. A Secret maas-redis from an earlier run
                             stays in use (and two replicas with it) until deleted.
  --gateway-replicas N       Gateway pods (default 1; 1..10000), pinned on the Gateway's Deployment
                             (ConfigMap maas-gateway-options) and given to the filter as
                             limits.global.replicas: while the companion or Redis cannot be
                             reached, each pod admits a user within limit ÷ N, so together they
                             stay within the limit. Change the pod count only this way
  --images FILE              the MAAS_WASM_IMAGE=... and MAAS_API_IMAGE=... lines that
                             scripts/build-images.sh prints (required, or the two below)
  --maas-api-image IMG       companion image, repo@sha256:... or repo:tag (env MAAS_API_IMAGE)
  --maas-wasm-image IMG      filter OCI image, repo@sha256:... or repo:tag (env MAAS_WASM_IMAGE)
  --operator-catalog IMG     custom operator catalog image (env OPERATOR_CATALOG)
  --operator-image IMG       custom operator image (env OPERATOR_IMAGE)
  --channel CH               operator subscription channel (env OPERATOR_CHANNEL)
  --maas-controller-image IMG  accepted for compatibility and ignored (no controller here)
  --dev                      development defaults (the reference's --dev): a development Redis
                             (as --dev-redis, unless --redis-url) and the development PostgreSQL
                             (unless --postgres-connection); images are still required
  --external-oidc            users may also sign in with JWTs of an external OIDC issuer: the
                             companion verifies them itself (MAAS_OIDC_*), beside OpenShift
                             tokens. Needs --oidc-issuer-url and --oidc-client-id
  --oidc-issuer-url URL      the issuer (https://..., the tokens' iss; env OIDC_ISSUER_URL)
  --oidc-client-id ID        the client the tokens are for: required in their aud
                             (env OIDC_CLIENT_ID)
  --oidc-jwks-url URL        the issuer's signing keys (env OIDC_JWKS_URL); default: jwks_uri of
                             URL/.well-known/openid-configuration, read at deploy time
  --enable-keycloak          refused: MaaS Gateway deploys no Keycloak; run one and pass
                             --external-oidc --oidc-issuer-url ... --oidc-client-id ...
  --policy-engine ENGINE     kuadrant (default for odh) or rhcl (default for rhoai): the engine
                             operator mode installs; MaaS Gateway's filter enforces the policies
  --verbose                  debug logging (LOG_LEVEL=DEBUG), also for the companion
  --dry-run                  print every command and the rendered manifests; change nothing
  -h, --help                 this help

Environment: DEPLOYMENT_MODE, OPERATOR_TYPE, DEPLOYMENT_NAMESPACE, ENABLE_TLS_BACKEND, VERBOSE,
DRY_RUN, OPERATOR_CATALOG, OPERATOR_IMAGE, OPERATOR_CHANNEL, OPERATOR_STARTING_CSV,
MAAS_API_IMAGE, MAAS_WASM_IMAGE, MAAS_CONTROLLER_IMAGE (ignored, warns), POSTGRES_CONNECTION,
DEV_MODE, EXTERNAL_OIDC, OIDC_ISSUER_URL, OIDC_CLIENT_ID, OIDC_JWKS_URL, OIDC_GROUPS_CLAIM,
ENABLE_KEYCLOAK (refused), POLICY_ENGINE, MAAS_SUBSCRIPTION_NAMESPACE (admins: who may create
MaaSAuthPolicies there; default models-as-a-service),
POSTGRES_USER, POSTGRES_DB, REDIS_URL, DEV_REDIS, GATEWAY_REPLICAS, LOG_LEVEL (DEBUG|INFO|WARN|ERROR), CERT_NAME (Gateway certificate
Secret in openshift-ingress), CLUSTER_DOMAIN (default: the cluster's apps domain), timeouts
CRD_TIMEOUT, CSV_TIMEOUT, CUSTOM_RESOURCE_TIMEOUT, ROLLOUT_TIMEOUT, RESOURCE_TIMEOUT (seconds).

Build and push both images first, then deploy exactly those digests:
  scripts/build-images.sh REGISTRY/NAMESPACE TAG | tail -n 2 >images.env
  scripts/deploy.sh --images images.env
There is no default image: without both references the script stops. Applying again with the same
inputs changes nothing; a new filter digest rolls out in place (docs/deploy.md, Upgrades).
EOF
}

# ---- arguments ---------------------------------------------------------------------------------
# require_flag_value FLAG VALUE-OR-EMPTY: a value must follow and must not be another flag.
require_flag_value() {
  if [ $# -lt 2 ] || [ -z "$2" ] || [[ $2 == --* ]]; then
    log_error "$1 needs a value"
    echo "Run scripts/deploy.sh --help for usage." >&2
    exit 1
  fi
}

parse_arguments() {
  while [ $# -gt 0 ]; do
    case $1 in
      --deployment-mode) require_flag_value "$@"; DEPLOYMENT_MODE=$2; DEPLOYMENT_MODE_GIVEN=true; shift 2 ;;
      --platform) require_flag_value "$@"; PLATFORM=$2; shift 2 ;;
      --operator-type) require_flag_value "$@"; OPERATOR_TYPE=$2; shift 2 ;;
      --enable-tls-backend) ENABLE_TLS_BACKEND=true; shift ;;
      --disable-tls-backend) ENABLE_TLS_BACKEND=false; shift ;;
      --namespace) require_flag_value "$@"; DEPLOYMENT_NAMESPACE=$2; shift 2 ;;
      --verbose) VERBOSE=true; shift ;;
      --dry-run) DRY_RUN=true; shift ;;
      --operator-catalog) require_flag_value "$@"; OPERATOR_CATALOG=$2; shift 2 ;;
      --operator-image) require_flag_value "$@"; OPERATOR_IMAGE=$2; shift 2 ;;
      --channel) require_flag_value "$@"; OPERATOR_CHANNEL=$2; shift 2 ;;
      --postgres-connection) require_flag_value "$@"; POSTGRES_CONNECTION=$2; shift 2 ;;
      --redis-url) require_flag_value "$@"; REDIS_URL=$2; shift 2 ;;
      --dev-redis) DEV_REDIS=true; shift ;;
      --gateway-replicas) require_flag_value "$@"; GATEWAY_REPLICAS=$2; shift 2 ;;
      --images) require_flag_value "$@"; read_images_file "$2"; shift 2 ;;
      --maas-api-image) require_flag_value "$@"; MAAS_API_IMAGE=$2; shift 2 ;;
      --maas-wasm-image) require_flag_value "$@"; MAAS_WASM_IMAGE=$2; shift 2 ;;
      --maas-controller-image) require_flag_value "$@"; MAAS_CONTROLLER_IMAGE=$2; shift 2 ;;
      --dev) DEV_MODE=true; shift ;;
      --external-oidc) EXTERNAL_OIDC=true; shift ;;
      --oidc-issuer-url) require_flag_value "$@"; OIDC_ISSUER_URL=$2; shift 2 ;;
      --oidc-client-id) require_flag_value "$@"; OIDC_CLIENT_ID=$2; shift 2 ;;
      --oidc-jwks-url) require_flag_value "$@"; OIDC_JWKS_URL=$2; shift 2 ;;
      --enable-keycloak) ENABLE_KEYCLOAK=true; shift ;;
      --policy-engine) require_flag_value "$@"; POLICY_ENGINE=$2; shift 2 ;;
      -h | --help) usage; exit 0 ;;
      *)
        log_error "unknown option: $1"
        echo "Run scripts/deploy.sh --help for usage." >&2
        exit 1
        ;;
    esac
  done
}

# read_images_file FILE: takes MAAS_WASM_IMAGE=... and MAAS_API_IMAGE=... lines (what
# scripts/build-images.sh prints); other lines are ignored, nothing is executed.
read_images_file() {
  [ -r "$1" ] || die "--images: cannot read $1"
  local line found=0
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in
      MAAS_WASM_IMAGE=?*) MAAS_WASM_IMAGE=${line#MAAS_WASM_IMAGE=}; found=$((found + 1)) ;;
      MAAS_API_IMAGE=?*) MAAS_API_IMAGE=${line#MAAS_API_IMAGE=}; found=$((found + 1)) ;;
    esac
  done <"$1"
  [ "$found" -eq 2 ] || die "--images $1: expected the MAAS_WASM_IMAGE=... and MAAS_API_IMAGE=... lines of scripts/build-images.sh"
}

is_true() { case ${1,,} in true | 1 | yes | on) return 0 ;; *) return 1 ;; esac; }

# An image reference: [host[:port]/]path[:tag][@sha256:<64 hex>].
valid_image() {
  [[ $1 =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$ ]]
}

# validate_platform: openshift or kubernetes (auto: by the presence of oc) and what follows from it.
validate_platform() {
  case $PLATFORM in
    auto)
      if command -v oc >/dev/null 2>&1; then PLATFORM=openshift; else
        PLATFORM=kubernetes
        log_info "oc is not installed: deploying for plain Kubernetes (--platform kubernetes; --platform openshift to insist)"
      fi ;;
    openshift | kubernetes) ;;
    *) die "--platform must be openshift, kubernetes or auto, not '$PLATFORM'" ;;
  esac
  [ "$PLATFORM" = kubernetes ] || return 0
  KCLI=kubectl
  GATEWAY_NAMESPACE=maas-gateway
  if [ "$DEPLOYMENT_MODE_GIVEN" = true ] && [ "$DEPLOYMENT_MODE" = operator ]; then
    die "--platform kubernetes: operator mode installs the ODH/RHOAI operator from OpenShift's OperatorHub; use --deployment-mode kustomize (the default on Kubernetes)"
  fi
  DEPLOYMENT_MODE=kustomize
  DEPLOYMENT_NAMESPACE=${DEPLOYMENT_NAMESPACE:-maas}
  CERT_NAME=${CERT_NAME:-maas-gateway-tls}
  [ -n "$CLUSTER_DOMAIN" ] || die "--platform kubernetes needs CLUSTER_DOMAIN: the Gateway answers at maas.<CLUSTER_DOMAIN> (there is no OpenShift ingress domain to read)"
  [[ $CLUSTER_DOMAIN =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$ ]] || die "CLUSTER_DOMAIN '$CLUSTER_DOMAIN' is not a DNS name"
  [[ $CERT_NAME =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$ ]] || die "CERT_NAME '$CERT_NAME' is not a Secret name"
}

validate_configuration() {
  validate_platform
  case $DEPLOYMENT_MODE in operator | kustomize) ;; *) die "--deployment-mode must be operator or kustomize, not '$DEPLOYMENT_MODE'" ;; esac
  case $OPERATOR_TYPE in odh | rhoai) ;; *) die "--operator-type must be odh or rhoai, not '$OPERATOR_TYPE'" ;; esac
  case ${LOG_LEVEL^^} in DEBUG | INFO | WARN | ERROR) LOG_LEVEL=${LOG_LEVEL^^} ;; *) die "LOG_LEVEL must be DEBUG, INFO, WARN or ERROR, not '$LOG_LEVEL'" ;; esac
  if is_true "$VERBOSE"; then LOG_LEVEL=DEBUG; fi
  if is_true "$ENABLE_TLS_BACKEND"; then ENABLE_TLS_BACKEND=true; else ENABLE_TLS_BACKEND=false; fi
  if is_true "$DRY_RUN"; then DRY_RUN=true; else DRY_RUN=false; fi

  local operator_namespace
  if [ "$OPERATOR_TYPE" = rhoai ]; then operator_namespace=redhat-ods-applications; else operator_namespace=opendatahub; fi
  if [ "$DEPLOYMENT_MODE" = operator ]; then
    if [ -n "$DEPLOYMENT_NAMESPACE" ] && [ "$DEPLOYMENT_NAMESPACE" != "$operator_namespace" ]; then
      log_warn "operator mode uses the $OPERATOR_TYPE namespace $operator_namespace; --namespace $DEPLOYMENT_NAMESPACE ignored"
    fi
    DEPLOYMENT_NAMESPACE=$operator_namespace
  else
    DEPLOYMENT_NAMESPACE=${DEPLOYMENT_NAMESPACE:-opendatahub}
  fi
  if [[ ! $DEPLOYMENT_NAMESPACE =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || [ ${#DEPLOYMENT_NAMESPACE} -gt 63 ]; then
    die "--namespace '$DEPLOYMENT_NAMESPACE' is not a valid namespace name (DNS-1123 label)"
  fi

  local name
  for name in MAAS_API_IMAGE MAAS_WASM_IMAGE; do
    [ -n "${!name}" ] || die "$name is not set: there is no default image. Build and push both images with
  scripts/build-images.sh REGISTRY/NAMESPACE TAG | tail -n 2 >images.env
then run scripts/deploy.sh --images images.env (or set MAAS_API_IMAGE and MAAS_WASM_IMAGE)"
  done
  valid_image "$MAAS_API_IMAGE" || die "MAAS_API_IMAGE '$MAAS_API_IMAGE' is not an image reference"
  MAAS_WASM_IMAGE=${MAAS_WASM_IMAGE#oci://}
  valid_image "$MAAS_WASM_IMAGE" || die "MAAS_WASM_IMAGE '$MAAS_WASM_IMAGE' is not an image reference"
  for name in MAAS_API_IMAGE MAAS_WASM_IMAGE; do
    [[ ${!name} == *@sha256:* ]] ||
      log_warn "$name ${!name} is a tag, not a digest: a tag can move, so a re-run may roll out something else (scripts/build-images.sh prints digests)"
  done
  if [ -n "$OPERATOR_CATALOG" ]; then valid_image "$OPERATOR_CATALOG" || die "--operator-catalog '$OPERATOR_CATALOG' is not an image reference"; fi
  if [ -n "$OPERATOR_IMAGE" ]; then valid_image "$OPERATOR_IMAGE" || die "--operator-image '$OPERATOR_IMAGE' is not an image reference"; fi
  if [ -n "$MAAS_CONTROLLER_IMAGE" ]; then
    log_warn "MAAS_CONTROLLER_IMAGE / --maas-controller-image is ignored: MaaS Gateway has no controller (the filter and the companion do its work)"
  fi
  if [ -n "$POSTGRES_CONNECTION" ] && [[ ! $POSTGRES_CONNECTION =~ ^postgres(ql)?:// ]]; then
    die "--postgres-connection must start with postgres:// or postgresql://"
  fi
  if is_true "$DEV_REDIS"; then DEV_REDIS=true; else DEV_REDIS=false; fi
  if is_true "$DEV_MODE"; then DEV_MODE=true; else DEV_MODE=false; fi
  if [ "$DEV_MODE" = true ] && [ -z "$REDIS_URL" ]; then DEV_REDIS=true; fi
  validate_identity_options
  if [ -n "$REDIS_URL" ]; then
    # Only the scheme is checked here (the companion parses the rest and refuses a bad URL by
    # name): never echo the URL itself, it carries the password.
    [[ $REDIS_URL =~ ^rediss?://[^[:space:]]+$ ]] || die "--redis-url must start with redis:// or rediss:// (and hold no whitespace)"
    [ "$DEV_REDIS" = false ] || die "--redis-url and --dev-redis exclude each other: give a Redis, or deploy the development one"
  fi
  if [[ ! $GATEWAY_REPLICAS =~ ^[1-9][0-9]{0,4}$ ]] || [ "$GATEWAY_REPLICAS" -gt 10000 ]; then
    die "--gateway-replicas must be a whole number from 1 to 10000, not '$GATEWAY_REPLICAS'"
  fi
  if [ "$DEPLOYMENT_MODE" = kustomize ] && { [ -n "$OPERATOR_CATALOG" ] || [ -n "$OPERATOR_IMAGE" ] || [ -n "$OPERATOR_CHANNEL" ]; }; then
    log_warn "--operator-catalog/--operator-image/--channel only apply to --deployment-mode operator; ignored"
  fi
  if [ -z "$OPERATOR_CHANNEL" ]; then
    if [ "$OPERATOR_TYPE" = rhoai ]; then OPERATOR_CHANNEL=fast-3.x; else OPERATOR_CHANNEL=fast-3; fi
  fi
  [[ $OPERATOR_CHANNEL =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "--channel '$OPERATOR_CHANNEL' is not a channel name"
  validate_policy_engine
}

# validate_identity_options: --enable-keycloak refused; --external-oidc needs the issuer and the
# client id (each refusal names the flag and its variable).
validate_identity_options() {
  if is_true "$ENABLE_KEYCLOAK"; then
    die "--enable-keycloak (ENABLE_KEYCLOAK): MaaS Gateway does not deploy a Keycloak. Run your OIDC provider
  (e.g. Keycloak: a realm, a client, and an audience mapper so that its tokens carry the client id in aud),
then pass --external-oidc --oidc-issuer-url https://<keycloak>/realms/<realm> --oidc-client-id <client>"
  fi
  if is_true "$EXTERNAL_OIDC"; then EXTERNAL_OIDC=true; else EXTERNAL_OIDC=false; fi
  if [ "$EXTERNAL_OIDC" = false ]; then
    if [ -n "$OIDC_ISSUER_URL$OIDC_CLIENT_ID$OIDC_JWKS_URL" ]; then
      log_warn "OIDC_ISSUER_URL / OIDC_CLIENT_ID / OIDC_JWKS_URL are ignored without --external-oidc (EXTERNAL_OIDC=true)"
    fi
    return 0
  fi
  [ -n "$OIDC_ISSUER_URL" ] || die "--external-oidc needs the issuer: --oidc-issuer-url https://... (OIDC_ISSUER_URL)"
  [ -n "$OIDC_CLIENT_ID" ] || die "--external-oidc needs the client id its tokens carry in aud: --oidc-client-id ID (OIDC_CLIENT_ID)"
  https_url "$OIDC_ISSUER_URL" || die "--oidc-issuer-url must be an https:// URL without spaces, quotes or a query, not '$OIDC_ISSUER_URL'"
  [[ $OIDC_CLIENT_ID =~ ^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,254}$ ]] || die "--oidc-client-id '$OIDC_CLIENT_ID' is not a client id (letters, digits, . _ : / @ -)"
  if [ -n "$OIDC_JWKS_URL" ]; then
    https_url "$OIDC_JWKS_URL" || die "--oidc-jwks-url must be an https:// URL without spaces, quotes or a query, not '$OIDC_JWKS_URL'"
  fi
  if [ -n "$OIDC_GROUPS_CLAIM" ] && [[ ! $OIDC_GROUPS_CLAIM =~ ^[A-Za-z0-9_.:/-]+$ ]]; then
    die "OIDC_GROUPS_CLAIM '$OIDC_GROUPS_CLAIM' is not a claim name"
  fi
}

# https_url URL: https://, then no whitespace, quote, backslash, query or fragment (the value goes
# into YAML and the companion's settings as is).
https_url() { [[ $1 =~ ^https://[^[:space:]\"\'\\?#]+$ ]]; }

# validate_policy_engine: the reference's values. Operator mode installs that engine for the
# operator (default: kuadrant for odh, rhcl for rhoai); kustomize mode installs none (the filter
# enforces the policies), so there it only notes the value.
validate_policy_engine() {
  local default=kuadrant
  if [ "$OPERATOR_TYPE" = rhoai ]; then default=rhcl; fi
  case ${POLICY_ENGINE:-$default} in
    kuadrant | rhcl) POLICY_ENGINE=${POLICY_ENGINE:-$default} ;;
    *) die "--policy-engine must be kuadrant or rhcl (the reference's values), not '$POLICY_ENGINE': MaaS Gateway enforces
  the policies in its filter; operator mode installs Kuadrant (odh's default) or Red Hat Connectivity Link (rhcl,
  rhoai's default) for the operator, kustomize mode none" ;;
  esac
  if [ "$DEPLOYMENT_MODE" = kustomize ] && [ "$POLICY_ENGINE" != "$default" ]; then
    log_warn "--policy-engine $POLICY_ENGINE: kustomize mode installs no policy engine (the MaaS filter enforces the policies); noted only"
  fi
  if [[ ! $MAAS_SUBSCRIPTION_NAMESPACE =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || [ ${#MAAS_SUBSCRIPTION_NAMESPACE} -gt 63 ]; then
    die "MAAS_SUBSCRIPTION_NAMESPACE '$MAAS_SUBSCRIPTION_NAMESPACE' is not a valid namespace name (DNS-1123 label)"
  fi
}

# ---- running commands --------------------------------------------------------------------------
# Every command that changes the cluster goes through run / run_stdin: in dry-run they are
# printed, not run. Read-only queries (query) run in both modes; in dry-run a failed query only
# warns, so a plan can be printed without a cluster login.
run() {
  if [ "$DRY_RUN" = true ]; then
    echo "+ $*"
    return 0
  fi
  log_debug "run: $*"
  "$@"
}

# run_stdin DESCRIPTION CMD...: feeds stdin to CMD (manifests, Secrets). In dry-run the input is
# printed with Secret values masked.
run_stdin() {
  local description=$1
  shift
  if [ "$DRY_RUN" = true ]; then
    echo "+ $* <<'<$description>'"
    mask_secrets
    echo "<$description>"
    return 0
  fi
  log_debug "run: $* < $description"
  "$@"
}

# mask_secrets: copies stdin to stdout, hiding the values under Secret data/stringData.
mask_secrets() {
  awk '
    /^---/ { in_secret = 0; in_data = 0 }
    /^kind: Secret$/ { in_secret = 1 }
    in_secret && /^(data|stringData):/ { in_data = 1; print; next }
    in_data && /^[^ ]/ { in_data = 0 }
    in_data && /^  [^ ]/ { sub(/:.*/, ": <redacted>"); print; next }
    { print }'
}

query() {
  log_debug "query: $*"
  "$@"
}

# ---- checks ------------------------------------------------------------------------------------
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# prerequisite MESSAGE: fails the deployment, or only warns in dry-run.
prerequisite_failed() {
  if [ "$DRY_RUN" = true ]; then
    log_warn "would stop here: $*"
  else
    die "$*"
  fi
}

check_required_tools() {
  command -v kubectl >/dev/null 2>&1 || die "kubectl is required (it renders the manifests)"
  if [ "$PLATFORM" = openshift ] && ! command -v oc >/dev/null 2>&1; then
    prerequisite_failed "oc is required (install the OpenShift CLI)"
    HAVE_OC=false
  fi
  local kustomize_version
  kustomize_version=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v//p' | head -n1)
  if [ -z "$kustomize_version" ] || [ "${kustomize_version%%.*}" -lt "$MIN_KUSTOMIZE_MAJOR" ]; then
    die "kubectl with kustomize v$MIN_KUSTOMIZE_MAJOR or newer is required (found '${kustomize_version:-none}')"
  fi
  log_debug "kubectl kustomize v$kustomize_version"
  command -v openssl >/dev/null 2>&1 || die "openssl is required (it issues the certificates of the companion's internal API)"
}

check_cluster() {
  log_info "Checking the cluster"
  if [ "$PLATFORM" = kubernetes ]; then
    check_kubernetes_cluster
    return 0
  fi
  if [ "${HAVE_OC:-true}" = false ] || ! query "$KCLI" whoami >/dev/null 2>&1; then
    prerequisite_failed "not logged in to a cluster (oc login ...)"
    return 0
  fi
  local version
  version=$(query "$KCLI" get clusterversion version -o jsonpath='{.status.desired.version}' 2>/dev/null || true)
  if [ -z "$version" ]; then
    prerequisite_failed "cannot read the OpenShift version (is this OpenShift?)"
  elif ! version_ge "$version" "$MIN_OPENSHIFT_VERSION"; then
    prerequisite_failed "OpenShift $version is too old: MaaS Gateway needs $MIN_OPENSHIFT_VERSION or newer (Gateway API support)"
  else
    log_info "  OpenShift $version"
  fi
  local crd
  for crd in gatewayclasses.gateway.networking.k8s.io gateways.gateway.networking.k8s.io httproutes.gateway.networking.k8s.io; do
    if ! query "$KCLI" get crd "$crd" >/dev/null 2>&1; then
      prerequisite_failed "Gateway API CRD $crd is missing (OpenShift >= $MIN_OPENSHIFT_VERSION installs it)"
    fi
  done
  if [ -z "$CLUSTER_DOMAIN" ]; then
    CLUSTER_DOMAIN=$(query "$KCLI" get ingresses.config.openshift.io cluster -o jsonpath='{.spec.domain}' 2>/dev/null || true)
  fi
  if [ -z "$CERT_NAME" ]; then
    CERT_NAME=$(query "$KCLI" get ingresscontroller default -n openshift-ingress-operator \
      -o jsonpath='{.spec.defaultCertificate.name}' 2>/dev/null || true)
    CERT_NAME=${CERT_NAME:-router-certs-default}
  fi
}

# check_kubernetes_cluster: reachable, Gateway API CRDs, Istio's EnvoyFilter CRD and GatewayClass
# istio; the Gateway's certificate Secret (only warns: cert-manager may issue it later).
check_kubernetes_cluster() {
  if ! query kubectl get --raw /version >/dev/null 2>&1; then
    prerequisite_failed "cannot reach the cluster with kubectl (check your kubeconfig context)"
    return 0
  fi
  local crd
  for crd in gatewayclasses.gateway.networking.k8s.io gateways.gateway.networking.k8s.io httproutes.gateway.networking.k8s.io \
    envoyfilters.networking.istio.io destinationrules.networking.istio.io; do
    if ! query kubectl get crd "$crd" >/dev/null 2>&1; then
      prerequisite_failed "CRD $crd is missing: install the Gateway API CRDs and Istio (1.24 or newer) first"
    fi
  done
  if ! query kubectl get gatewayclass istio >/dev/null 2>&1; then
    prerequisite_failed "GatewayClass istio is missing: MaaS Gateway runs on Istio's Gateway API implementation"
  fi
  if ! query kubectl get secret "$CERT_NAME" -n "$GATEWAY_NAMESPACE" >/dev/null 2>&1; then
    log_warn "Secret $GATEWAY_NAMESPACE/$CERT_NAME (the Gateway's certificate for maas.$CLUSTER_DOMAIN) does not exist yet: create it (cert-manager Certificate, or kubectl create secret tls) or set CERT_NAME; until then the HTTPS listener is not programmed"
  fi
}

# Reads the policy engine's CSV version; prints nothing when it is not installed.
policy_engine_version() {
  local prefix=$1
  query "$KCLI" get csv -n "$POLICY_ENGINE_NAMESPACE" -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.version}{"\n"}{end}' 2>/dev/null |
    awk -v p="$prefix" 'index($1, p) == 1 { print $2; exit }'
}

# ---- operator mode -----------------------------------------------------------------------------
operator_package() { if [ "$OPERATOR_TYPE" = rhoai ]; then echo rhods-operator; else echo opendatahub-operator; fi; }
operator_source() {
  if [ -n "$OPERATOR_CATALOG" ]; then echo maas-operator-catalog
  elif [ "$OPERATOR_TYPE" = rhoai ]; then echo redhat-operators
  else echo community-operators; fi
}

check_conflicting_operators() {
  local other
  if [ "$OPERATOR_TYPE" = rhoai ]; then other=opendatahub-operator; else other=rhods-operator; fi
  if query "$KCLI" get subscriptions.operators.coreos.com -A -o jsonpath='{.items[*].spec.name}' 2>/dev/null | tr ' ' '\n' | grep -qx "$other"; then
    prerequisite_failed "$other is installed: ODH and RHOAI operators cannot run side by side (remove one or pick --operator-type)"
  fi
}

install_policy_engine() {
  local package source prefix minimum channel catalog_yaml=""
  if [ "$POLICY_ENGINE" = rhcl ]; then
    package=rhcl-operator source=redhat-operators prefix=rhcl-operator minimum=$MIN_RHCL_VERSION channel=stable
  else
    package=kuadrant-operator source=maas-kuadrant-catalog prefix=kuadrant-operator minimum=$MIN_KUADRANT_VERSION channel=stable
    catalog_yaml="apiVersion: operators.coreos.com/v1alpha1
kind: CatalogSource
metadata:
  name: maas-kuadrant-catalog
  namespace: openshift-marketplace
spec:
  sourceType: grpc
  image: quay.io/kuadrant/kuadrant-operator-catalog:v$MIN_KUADRANT_VERSION
  displayName: Kuadrant
---
"
  fi
  local installed
  installed=$(policy_engine_version "$prefix")
  if [ -n "$installed" ]; then
    if version_ge "$installed" "$minimum"; then
      log_info "  policy engine $package $installed already installed"
      return 0
    fi
    prerequisite_failed "$package $installed is installed but $minimum or newer is required"
    return 0
  fi
  log_info "Installing the policy engine ($package >= $minimum)"
  ensure_namespace "$POLICY_ENGINE_NAMESPACE"
  printf '%sapiVersion: operators.coreos.com/v1
kind: OperatorGroup
metadata:
  name: kuadrant
  namespace: %s
spec: {}
---
apiVersion: operators.coreos.com/v1alpha1
kind: Subscription
metadata:
  name: %s
  namespace: %s
spec:
  name: %s
  channel: %s
  source: %s
  sourceNamespace: openshift-marketplace
  installPlanApproval: Automatic
' "$catalog_yaml" "$POLICY_ENGINE_NAMESPACE" "$package" "$POLICY_ENGINE_NAMESPACE" "$package" "$channel" "$source" |
    run_stdin "policy engine subscription" "$KCLI" apply -f -
  wait_for_csv "$POLICY_ENGINE_NAMESPACE" "$prefix" "$minimum"
  printf 'apiVersion: kuadrant.io/v1beta1
kind: Kuadrant
metadata:
  name: kuadrant
  namespace: %s
spec: {}
' "$POLICY_ENGINE_NAMESPACE" | run_stdin "Kuadrant CR" "$KCLI" apply -f -
}

wait_for_csv() {
  local namespace=$1 prefix=$2 minimum=$3 deadline version
  if [ "$DRY_RUN" = true ]; then
    echo "+ wait up to ${CSV_TIMEOUT}s for CSV $prefix >= $minimum to succeed in $namespace"
    return 0
  fi
  deadline=$((SECONDS + CSV_TIMEOUT))
  while [ $SECONDS -lt $deadline ]; do
    version=$(query "$KCLI" get csv -n "$namespace" -o jsonpath='{range .items[?(@.status.phase=="Succeeded")]}{.metadata.name}{" "}{.spec.version}{"\n"}{end}' 2>/dev/null |
      awk -v p="$prefix" 'index($1, p) == 1 { print $2; exit }')
    if [ -n "$version" ]; then
      version_ge "$version" "$minimum" || die "$prefix $version installed, $minimum or newer required"
      log_info "  $prefix $version ready"
      return 0
    fi
    sleep 5
  done
  die "timed out after ${CSV_TIMEOUT}s waiting for $prefix in $namespace"
}

install_primary_operator() {
  local package source
  package=$(operator_package)
  source=$(operator_source)
  log_info "Installing the $OPERATOR_TYPE operator ($package, channel $OPERATOR_CHANNEL)"
  if [ -n "$OPERATOR_CATALOG" ]; then
    printf 'apiVersion: operators.coreos.com/v1alpha1
kind: CatalogSource
metadata:
  name: maas-operator-catalog
  namespace: openshift-marketplace
spec:
  sourceType: grpc
  image: %s
  displayName: MaaS operator catalog
' "$OPERATOR_CATALOG" | run_stdin "custom catalog" "$KCLI" apply -f -
  fi
  {
    printf 'apiVersion: operators.coreos.com/v1alpha1
kind: Subscription
metadata:
  name: %s
  namespace: %s
spec:
  name: %s
  channel: %s
  source: %s
  sourceNamespace: openshift-marketplace
  installPlanApproval: Automatic
' "$package" "$OPERATOR_NAMESPACE" "$package" "$OPERATOR_CHANNEL" "$source"
    if [ -n "$OPERATOR_STARTING_CSV" ] && [ "$OPERATOR_STARTING_CSV" != - ]; then
      printf '  startingCSV: %s\n' "$OPERATOR_STARTING_CSV"
    fi
  } | run_stdin "operator subscription" "$KCLI" apply -f -
  wait_for_csv "$OPERATOR_NAMESPACE" "$package" 0
  if [ -n "$OPERATOR_IMAGE" ]; then
    local csv
    csv=$(query "$KCLI" get subscription "$package" -n "$OPERATOR_NAMESPACE" -o jsonpath='{.status.installedCSV}' 2>/dev/null || true)
    csv=${csv:-<installed CSV of $package>}
    run "$KCLI" patch csv "$csv" -n "$OPERATOR_NAMESPACE" --type json \
      -p "[{\"op\":\"replace\",\"path\":\"/spec/install/spec/deployments/0/spec/template/spec/containers/0/image\",\"value\":\"$OPERATOR_IMAGE\"}]"
  fi
}

# KServe serves the models; MaaS Gateway replaces the operator's own models-as-a-service
# component, so that one stays Removed.
apply_data_science_cluster() {
  log_info "Configuring the $OPERATOR_TYPE DataScienceCluster (KServe on, built-in MaaS off)"
  wait_for_crd datascienceclusters.datasciencecluster.opendatahub.io
  printf 'apiVersion: dscinitialization.opendatahub.io/v1
kind: DSCInitialization
metadata:
  name: default-dsci
spec:
  applicationsNamespace: %s
  monitoring:
    managementState: Removed
---
apiVersion: datasciencecluster.opendatahub.io/v1
kind: DataScienceCluster
metadata:
  name: default-dsc
spec:
  components:
    kserve:
      managementState: Managed
      modelsAsService:
        managementState: Removed
    dashboard:
      managementState: Managed
' "$DEPLOYMENT_NAMESPACE" | run_stdin "DSCInitialization and DataScienceCluster" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER" -f -
  run "$KCLI" wait --for=jsonpath='{.status.phase}'=Ready datasciencecluster/default-dsc --timeout="${CUSTOM_RESOURCE_TIMEOUT}s"
}

wait_for_crd() {
  run "$KCLI" wait --for=condition=Established "crd/$1" --timeout="${CRD_TIMEOUT}s"
}

# ---- the companion's replicas follow the lease store ----------------------------------------------
# Without a Redis each companion replica keeps its own lease counters: two replicas would be two
# budgets (a user could spend each limit twice). So the companion runs one replica unless the
# counters are in a Redis (--redis-url, --dev-redis, or Secret maas-redis left by an earlier run);
# then two, for availability. COMPANION_REPLICAS and LEASE_STORE_WHY say which and why.
COMPANION_REPLICAS=1
LEASE_STORE_WHY="no Redis: one replica, whose in-process lease counters are the one budget across all Gateway replicas"
choose_companion_replicas() {
  local redis=""
  if [ -n "$REDIS_URL" ]; then
    redis="the given Redis"
  elif [ "$DEV_REDIS" = true ]; then
    redis="the development Redis"
  elif [ "$DRY_RUN" != true ] && query "$KCLI" get secret maas-redis -n "$DEPLOYMENT_NAMESPACE" >/dev/null 2>&1; then
    redis="the Redis of Secret maas-redis from an earlier run"
  fi
  if [ -n "$redis" ]; then
    COMPANION_REPLICAS=2
    LEASE_STORE_WHY="sharing the lease counters in $redis: one budget across Gateway and companion replicas"
  else
    COMPANION_REPLICAS=1
    LEASE_STORE_WHY="no Redis: one replica, whose in-process lease counters are the one budget across all Gateway replicas (--redis-url or --dev-redis for two)"
  fi
}

# ---- rendering ---------------------------------------------------------------------------------
# split_image REF: prints "name" and either "tag T" or "digest D" for kustomize's images field.
image_kustomization() {
  local original=$1 ref=$2 name tag=""
  printf '  - name: %s\n' "$original"
  if [[ $ref == *@* ]]; then
    printf '    newName: %s\n    digest: %s\n' "${ref%@*}" "${ref#*@}"
    return
  fi
  name=$ref
  if [[ ${ref##*/} == *:* ]]; then
    tag=${ref##*:}
    name=${ref%:*}
  fi
  printf '    newName: %s\n' "$name"
  # Quoted: a tag like 1 or 1.2 would otherwise be a YAML number, which kustomize refuses.
  if [ -n "$tag" ]; then printf '    newTag: "%s"\n' "$tag"; fi
}

# render_manifests DIR: writes DIR/kustomization.yaml (the companion in DEPLOYMENT_NAMESPACE,
# the images, TLS on/off, the Gateway's hostname) and prints the rendered objects.
render_manifests() {
  local dir=$1 crs_rel crs_rel_companion rust_log
  mkdir -p "$dir/companion" "$dir/gateway"
  crs_rel=$(realpath -m --relative-to="$dir" "$CRS_DIR")
  crs_rel_companion=$(realpath -m --relative-to="$dir/companion" "$CRS_DIR")
  # On Kubernetes the Gateway's objects move to maas-gateway (base/gateway names
  # openshift-ingress; kustomize would give the GatewayClass a namespace too, but
  # components/kubernetes drops it).
  {
    echo "# Generated by scripts/deploy.sh"
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "namespace: $GATEWAY_NAMESPACE"
    echo "resources:"
    echo "  - $(realpath -m --relative-to="$dir/gateway" "$CRS_DIR")/base/gateway"
  } >"$dir/gateway/kustomization.yaml"
  {
    echo "# Generated by scripts/deploy.sh"
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "namespace: $DEPLOYMENT_NAMESPACE"
    echo "resources:"
    echo "  - $crs_rel_companion/base/companion"
    if [ -z "$POSTGRES_CONNECTION" ]; then echo "  - $crs_rel_companion/base/postgres"; fi
    if [ "$DEV_REDIS" = true ]; then
      echo "components:"
      echo "  - $crs_rel_companion/components/redis-dev"
    fi
  } >"$dir/companion/kustomization.yaml"
  case $LOG_LEVEL in DEBUG) rust_log=debug ;; WARN) rust_log=warn ;; ERROR) rust_log=error ;; *) rust_log=info ;; esac
  {
    echo "# Generated by scripts/deploy.sh"
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "resources:"
    if [ "$PLATFORM" = kubernetes ]; then echo "  - gateway"; else echo "  - $crs_rel/base/gateway"; fi
    echo "  - companion"
    echo "components:"
    if [ "$ENABLE_TLS_BACKEND" = true ]; then echo "  - $crs_rel/components/tls-backend"; fi
    echo "  - $crs_rel/components/wiring"
    if [ "$PLATFORM" = kubernetes ]; then
      echo "  - $crs_rel/components/kubernetes"
      if [ "$ENABLE_TLS_BACKEND" = true ]; then echo "  - $crs_rel/components/tls-backend-kubernetes"; fi
    fi
    echo "images:"
    image_kustomization quay.io/maas-gateway/maas-companion "$MAAS_API_IMAGE"
    echo "patches:"
    # The module the istio-agent pulls (the EnvoyFilter's extension config, patch 0).
    echo "  - target: {group: networking.istio.io, kind: EnvoyFilter, name: maas-filter}"
    echo "    patch: |-"
    echo "      - op: replace"
    echo "        path: /spec/configPatches/0/patch/value/typed_config/config/vm_config/code/remote/http_uri/uri"
    echo "        value: oci://$MAAS_WASM_IMAGE"
    echo "  - target: {version: v1, kind: ConfigMap, name: maas-gateway-options}"
    echo "    patch: |-"
    echo "      - op: replace"
    echo "        path: /data/deployment"
    echo "        value: |"
    # The base's Deployment patch (proxy config included) with the replica count set.
    sed -n '/^  deployment: |$/,$p' "$CRS_DIR/base/gateway/gateway-options.yaml" | tail -n +2 |
      sed -e "s/^\(      replicas: \).*/\1$GATEWAY_REPLICAS/" -e 's/^    /          /'
    echo "  - target: {group: gateway.networking.k8s.io, kind: Gateway, name: $GATEWAY_NAME}"
    echo "    patch: |-"
    echo "      - op: replace"
    echo "        path: /spec/listeners/0/hostname"
    echo "        value: $(gateway_hostname)"
    echo "      - op: replace"
    echo "        path: /spec/listeners/1/hostname"
    echo "        value: $(gateway_hostname)"
    echo "      - op: replace"
    echo "        path: /spec/listeners/1/tls/certificateRefs/0/name"
    echo "        value: ${CERT_NAME:-router-certs-default}"
    echo "  - target: {group: apps, kind: Deployment, name: maas-companion}"
    echo "    patch: |-"
    echo "      apiVersion: apps/v1"
    echo "      kind: Deployment"
    echo "      metadata: {name: maas-companion}"
    echo "      spec:"
    echo "        replicas: $COMPANION_REPLICAS"
    echo "        template:"
    echo "          spec:"
    echo "            containers:"
    echo "              - name: companion"
    echo "                env:"
    echo "                  - {name: RUST_LOG, value: $rust_log}"
    echo "                  - {name: MAAS_PUBLIC_URL, value: \"https://$(gateway_hostname)\"}"
    echo "                  - {name: MAAS_ADMIN_SAR_NAMESPACE, value: $MAAS_SUBSCRIPTION_NAMESPACE}"
    if [ "$EXTERNAL_OIDC" = true ]; then
      # Validated (https, no quotes): safe inside double quotes.
      echo "                  - {name: MAAS_OIDC_ISSUER, value: \"$OIDC_ISSUER_URL\"}"
      echo "                  - {name: MAAS_OIDC_AUDIENCE, value: \"$OIDC_CLIENT_ID\"}"
      echo "                  - {name: MAAS_OIDC_JWKS_URL, value: \"$OIDC_JWKS_URL\"}"
      if [ -n "$OIDC_GROUPS_CLAIM" ]; then
        echo "                  - {name: MAAS_OIDC_GROUPS_CLAIM, value: \"$OIDC_GROUPS_CLAIM\"}"
      fi
    fi
  } >"$dir/kustomization.yaml"
  # The filter's limits.global.replicas follows the Gateway's replica count: the pluginConfig is
  # a JSON string inside the EnvoyFilter, out of kustomize's reach (its only `"replicas"` key).
  kubectl kustomize "$dir" | sed "s/\"replicas\": 1\b/\"replicas\": $GATEWAY_REPLICAS/"
}

# resolve_oidc_jwks_url: with --external-oidc and no --oidc-jwks-url, the jwks_uri of the issuer's
# discovery document (read-only; in a dry run a failure only warns and a placeholder is rendered).
resolve_oidc_jwks_url() {
  [ "$EXTERNAL_OIDC" = true ] && [ -z "$OIDC_JWKS_URL" ] || return 0
  local discovery=${OIDC_ISSUER_URL%/}/.well-known/openid-configuration document=""
  if command -v curl >/dev/null 2>&1; then
    document=$(query curl -fsS --max-time 10 "$discovery" 2>/dev/null || true)
  fi
  # One JSON string value; the URL has no quotes (https_url refuses them anyway).
  OIDC_JWKS_URL=$(printf '%s' "$document" | tr -d '\n' |
    sed -n 's/.*"jwks_uri"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p')
  if [ -n "$OIDC_JWKS_URL" ] && https_url "$OIDC_JWKS_URL"; then
    log_info "OIDC: the issuer's keys at $OIDC_JWKS_URL (jwks_uri of $discovery)"
    return 0
  fi
  OIDC_JWKS_URL=""
  prerequisite_failed "--external-oidc: could not read an https jwks_uri from $discovery (curl needed, and the issuer reachable from here); pass the issuer's keys URL with --oidc-jwks-url https://... (OIDC_JWKS_URL)"
  OIDC_JWKS_URL=${OIDC_ISSUER_URL%/}/jwks-url-not-discovered
}

gateway_hostname() { echo "maas.${CLUSTER_DOMAIN:-apps.cluster.example.com}"; }

# select_kinds FILE KIND...: the documents of FILE whose top-level kind is one of KIND.
select_kinds() {
  local file=$1
  shift
  awk -v kinds=" $* " '
    function flush() { if (doc != "" && keep) { printf "%s", (n++ ? "---\n" : ""); printf "%s", doc } doc = ""; keep = 0 }
    /^---/ { flush(); next }
    /^kind: / { keep = index(kinds, " " $2 " ") > 0 }
    { doc = doc $0 "\n" }
    END { flush() }' "$file"
}

# select_named FILE NAME KIND...: the documents of FILE of one of KIND whose metadata.name is NAME.
select_named() {
  local file=$1 name=$2
  shift 2
  select_kinds "$file" "$@" | awk -v name="$name" '
    function flush() { if (doc != "" && keep) { printf "%s", (n++ ? "---\n" : ""); printf "%s", doc } doc = ""; keep = 0 }
    /^---/ { flush(); next }
    /^  name: / && in_meta { keep = ($2 == name) }
    /^metadata:/ { in_meta = 1 }
    /^[^ ]/ && !/^metadata:/ { in_meta = 0 }
    { doc = doc $0 "\n" }
    END { flush() }'
}

# ---- deployment steps --------------------------------------------------------------------------
ensure_namespace() {
  printf 'apiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n' "$1" | run_stdin "Namespace $1" "$KCLI" apply -f -
}

# The Gateway admits HTTPRoutes only from namespaces with this label (base/gateway/gateway.yaml);
# the companion's maas-api route lives in its namespace. Model namespaces are labelled the same way.
label_routes_namespace() {
  run "$KCLI" label namespace "$1" maas.opendatahub.io/gateway-routes=true --overwrite
}

deploy_gateway() {
  if [ "$PLATFORM" = kubernetes ]; then
    log_info "Gateway: $GATEWAY_NAME in $GATEWAY_NAMESPACE on Istio's GatewayClass istio"
    ensure_namespace "$GATEWAY_NAMESPACE"
    run "$KCLI" wait --for=condition=Accepted gatewayclass/istio --timeout="${RESOURCE_TIMEOUT}s"
  else
    log_info "Gateway: GatewayClass openshift-default and Gateway $GATEWAY_NAME in $GATEWAY_NAMESPACE"
    select_kinds "$RENDERED" GatewayClass | run_stdin "GatewayClass" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER" -f -
    # OpenShift installs its Istio (and the EnvoyFilter CRD) once a GatewayClass is accepted.
    run "$KCLI" wait --for=condition=Accepted gatewayclass/openshift-default --timeout="${RESOURCE_TIMEOUT}s"
  fi
  wait_for_crd envoyfilters.networking.istio.io
  # The Gateway's pod count first: the Gateway names this ConfigMap (infrastructure.parametersRef).
  log_info "  $GATEWAY_REPLICAS Gateway replica(s) (ConfigMap maas-gateway-options; the filter's limits.global.replicas)"
  select_named "$RENDERED" maas-gateway-options ConfigMap |
    run_stdin "ConfigMap maas-gateway-options" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER" -f -
  select_kinds "$RENDERED" Gateway | run_stdin "Gateway" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER" -f -
  # Before the EnvoyFilter asks istiod for the Gateway's client key pair (the manifests, later):
  # istiod serves it only once this Role lets the Gateway's service account list Secrets.
  select_named "$RENDERED" maas-gateway-sds Role RoleBinding |
    run_stdin "Role and RoleBinding $GATEWAY_NAMESPACE/maas-gateway-sds" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER" -f -
}

# 24 random bytes as hex: od reads exactly that much, so no pipe is cut short (pipefail).
random_password() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }

deploy_database() {
  local url
  if [ -n "$POSTGRES_CONNECTION" ]; then
    log_info "Database: the given PostgreSQL (Secret maas-db-config)"
    url=$POSTGRES_CONNECTION
  else
    log_info "Database: development PostgreSQL maas-postgres (PersistentVolumeClaim maas-postgres-data)"
    local password=""
    if [ "$DRY_RUN" != true ] && query "$KCLI" get secret postgres-creds -n "$DEPLOYMENT_NAMESPACE" >/dev/null 2>&1; then
      # Keep the existing password: the database on the volume was initialised with it.
      password=$(query "$KCLI" get secret postgres-creds -n "$DEPLOYMENT_NAMESPACE" -o jsonpath='{.data.POSTGRES_PASSWORD}' | base64 -d)
      log_info "  reusing the existing Secret postgres-creds"
    else
      password=$(random_password)
    fi
    secret_yaml postgres-creds app.kubernetes.io/name=maas-postgres \
      POSTGRES_USER "$POSTGRES_USER" POSTGRES_PASSWORD "$password" POSTGRES_DB "$POSTGRES_DB" |
      run_stdin "Secret postgres-creds" "$KCLI" apply -f -
    url="postgresql://$POSTGRES_USER:$password@maas-postgres.$DEPLOYMENT_NAMESPACE.svc:5432/$POSTGRES_DB?sslmode=disable"
    select_kinds "$RENDERED" PersistentVolumeClaim | run_stdin "PersistentVolumeClaim" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER" -f -
  fi
  secret_yaml maas-db-config app.kubernetes.io/name=maas-companion DB_CONNECTION_URL "$url" |
    run_stdin "Secret maas-db-config" "$KCLI" apply -f -
}

# redis_display URL: scheme://host[:port] of a Redis URL, without user, password or database.
redis_display() {
  local rest=${1#*://}
  rest=${rest##*@}
  echo "${1%%://*}://${rest%%/*}"
}

# deploy_lease_store: the Secret maas-redis the companion reads MAAS_REDIS_URL from (optional in
# the Deployment). --redis-url: that URL. --dev-redis: a generated password (kept across runs: the
# running Redis was started with it) and the URL of the development Redis. Neither: nothing (an
# existing Secret from an earlier run is left alone). A changed URL restarts the companion
# afterwards (restart_companion_if_lease_store_changed): env from a Secret is read at start only.
LEASE_STORE_CHANGED=false
deploy_lease_store() {
  local url="" password="" old=""
  if [ -n "$REDIS_URL" ]; then
    log_info "Lease store: the given Redis $(redis_display "$REDIS_URL") (Secret maas-redis)"
    url=$REDIS_URL
  elif [ "$DEV_REDIS" = true ]; then
    log_info "Lease store: development Redis maas-redis (one pod, no persistence; Secret maas-redis)"
    if [ "$DRY_RUN" != true ] && query "$KCLI" get secret maas-redis -n "$DEPLOYMENT_NAMESPACE" >/dev/null 2>&1; then
      password=$(query "$KCLI" get secret maas-redis -n "$DEPLOYMENT_NAMESPACE" -o jsonpath='{.data.password}' | base64 -d)
      [ -z "$password" ] || log_info "  reusing the password in the existing Secret maas-redis"
    fi
    password=${password:-$(random_password)}
    url="redis://:$password@maas-redis.$DEPLOYMENT_NAMESPACE.svc:6379/0"
  else
    if [ "$DRY_RUN" != true ] && query "$KCLI" get secret maas-redis -n "$DEPLOYMENT_NAMESPACE" >/dev/null 2>&1; then
      log_info "Lease store: Secret maas-redis from an earlier run stays in use (delete it for the in-process store)"
    else
      log_info "Lease store: in process in the one companion replica (no --redis-url / --dev-redis)"
    fi
    return 0
  fi
  if [ "$DRY_RUN" != true ]; then
    old=$(query "$KCLI" get secret maas-redis -n "$DEPLOYMENT_NAMESPACE" -o jsonpath='{.data.url}' 2>/dev/null | base64 -d 2>/dev/null || true)
    if [ "$old" != "$url" ] && query "$KCLI" get deployment maas-companion -n "$DEPLOYMENT_NAMESPACE" >/dev/null 2>&1; then
      LEASE_STORE_CHANGED=true
    fi
  fi
  if [ -n "$password" ]; then
    secret_yaml maas-redis app.kubernetes.io/name=maas-redis url "$url" password "$password"
  else
    secret_yaml maas-redis app.kubernetes.io/name=maas-companion url "$url"
  fi | run_stdin "Secret maas-redis" "$KCLI" apply -f -
}

restart_companion_if_lease_store_changed() {
  if [ "$DRY_RUN" = true ] && { [ -n "$REDIS_URL" ] || [ "$DEV_REDIS" = true ]; }; then
    echo "+ $KCLI rollout restart deployment/maas-companion -n $DEPLOYMENT_NAMESPACE  (only when Secret maas-redis changed on a running companion)"
    return 0
  fi
  [ "$LEASE_STORE_CHANGED" = true ] || return 0
  log_info "  the lease store changed: restarting the companion to read Secret maas-redis"
  run "$KCLI" rollout restart deployment/maas-companion -n "$DEPLOYMENT_NAMESPACE"
}

# secret_yaml NAME LABEL KEY VALUE...: a Secret manifest on stdout (values never in argv of oc).
secret_yaml() {
  local name=$1 label=$2
  shift 2
  printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n  labels:\n    %s: %s\n    app.kubernetes.io/part-of: maas-gateway\ntype: Opaque\nstringData:\n' \
    "$name" "$DEPLOYMENT_NAMESPACE" "${label%%=*}" "${label#*=}"
  while [ $# -ge 2 ]; do
    # Single-quoted YAML scalar: only ' needs escaping.
    printf "  %s: '%s'\n" "$1" "${2//\'/\'\'}"
    shift 2
  done
}

apply_manifests() {
  log_info "Applying the manifests (companion in $DEPLOYMENT_NAMESPACE, filter on $GATEWAY_NAME)"
  if [ "$DRY_RUN" = true ]; then
    echo "+ $KCLI apply --server-side --force-conflicts --field-manager=$FIELD_MANAGER -f - <<'<the rendered manifests above>'"
    return 0
  fi
  local manifests=$RENDERED
  if [ "$PLATFORM" = kubernetes ] && ! query kubectl get crd servicemonitors.monitoring.coreos.com >/dev/null 2>&1; then
    log_warn "no Prometheus Operator (CRD servicemonitors.monitoring.coreos.com): the ServiceMonitor, PodMonitor and PrometheusRules are left out"
    manifests=$WORK_DIR/without-monitoring.yaml
    drop_kinds "$RENDERED" ServiceMonitor PodMonitor PrometheusRule >"$manifests"
  fi
  run_stdin "rendered manifests" "$KCLI" apply --server-side --force-conflicts --field-manager="$FIELD_MANAGER" -f - <"$manifests"
}

# drop_kinds FILE KIND...: the documents of FILE whose kind is none of KIND.
drop_kinds() {
  local file=$1
  shift
  awk -v kinds=" $* " '
    function flush() { if (doc != "" && keep) { printf "%s", (n++ ? "---\n" : ""); printf "%s", doc } doc = ""; keep = 1 }
    BEGIN { keep = 1 }
    /^---/ { flush(); next }
    /^kind: / { keep = index(kinds, " " $2 " ") == 0 }
    { doc = doc $0 "\n" }
    END { flush() }' "$file"
}

# remove_old_wasmplugin: a deployment made before the filter moved to the EnvoyFilter maas-filter
# left a WasmPlugin maas-filter behind (apply never deletes). Both would run the filter, each
# counting every request against the limits: the WasmPlugin goes once the EnvoyFilter is
# applied (after, not before: in between the Gateway would have no filter at all).
remove_old_wasmplugin() {
  if [ "$DRY_RUN" != true ] && ! query "$KCLI" get crd wasmplugins.extensions.istio.io >/dev/null 2>&1; then
    return 0
  fi
  log_info "The filter comes from EnvoyFilter maas-filter: removing an older WasmPlugin maas-filter, if any"
  run "$KCLI" delete wasmplugin maas-filter -n "$GATEWAY_NAMESPACE" --ignore-not-found
}

configure_tls_backend() {
  [ "$ENABLE_TLS_BACKEND" = true ] || return 0
  if [ "$PLATFORM" = kubernetes ]; then
    configure_tls_backend_private_ca
    return 0
  fi
  log_info "TLS backend: the Gateway verifies the companion against the OpenShift service CA"
  if [ "$DRY_RUN" = true ]; then
    echo "+ wait for the service CA to fill ConfigMap $GATEWAY_NAMESPACE/maas-service-ca (key service-ca.crt)"
    echo "+ $KCLI apply -f - <<'<Secret $GATEWAY_NAMESPACE/maas-companion-ca with ca.crt = that bundle>'"
    return 0
  fi
  local deadline=$((SECONDS + RESOURCE_TIMEOUT)) ca=""
  while [ $SECONDS -lt $deadline ]; do
    ca=$(query "$KCLI" get configmap maas-service-ca -n "$GATEWAY_NAMESPACE" -o jsonpath='{.data.service-ca\.crt}' 2>/dev/null || true)
    [ -n "$ca" ] && break
    sleep 3
  done
  [ -n "$ca" ] || die "the service CA did not fill ConfigMap $GATEWAY_NAMESPACE/maas-service-ca within ${RESOURCE_TIMEOUT}s"
  {
    printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: maas-companion-ca\n  namespace: %s\n  labels:\n    app.kubernetes.io/part-of: maas-gateway\ntype: Opaque\ndata:\n' "$GATEWAY_NAMESPACE"
    printf '  ca.crt: %s\n' "$(printf '%s\n' "$ca" | base64 | tr -d '\n')"
  } | run_stdin "Secret maas-companion-ca" "$KCLI" apply -f -
}

# configure_tls_backend_private_ca: on plain Kubernetes the companion's public port serves the
# internal CA's server certificate (components/tls-backend-kubernetes); the Gateway verifies it
# with that CA (Secret maas-companion-ca) and Prometheus too (ConfigMap maas-service-ca).
configure_tls_backend_private_ca() {
  log_info "TLS backend: the Gateway verifies the companion against this script's private CA"
  local ca=$WORK_DIR/internal-pki/server.ca
  {
    printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: maas-companion-ca\n  namespace: %s\n  labels:\n    app.kubernetes.io/part-of: maas-gateway\ntype: Opaque\ndata:\n' "$GATEWAY_NAMESPACE"
    printf '  ca.crt: %s\n' "$(base64 <"$ca" | tr -d '\n')"
  } | run_stdin "Secret $GATEWAY_NAMESPACE/maas-companion-ca" "$KCLI" apply -f -
  {
    printf 'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: maas-service-ca\n  namespace: %s\n  labels:\n    app.kubernetes.io/part-of: maas-gateway\ndata:\n  service-ca.crt: |\n' "$DEPLOYMENT_NAMESPACE"
    sed 's/^/    /' "$ca"
  } | run_stdin "ConfigMap $DEPLOYMENT_NAMESPACE/maas-service-ca" "$KCLI" apply --server-side --field-manager="$FIELD_MANAGER-ca" -f -
}

# ---- the internal API's mutual TLS -------------------------------------------------------------
# Only the Gateway may call the companion's internal port (every provider key, usage rows, lease
# counters): its Envoy presents a client certificate of a private CA on the companion cluster
# (EnvoyFilter maas-companion-cluster, over SDS), and the companion admits only certificates of
# that CA naming an allowed caller (the Gateway, the key cleanup job). Three Secrets, each holding
# the CA certificate (ca.crt) and one key pair (tls.crt, tls.key):
#   <ns>/maas-companion-internal-tls           the companion's certificate, maas-companion.<ns>.svc
#   openshift-ingress/maas-gateway-internal-client  the Gateway's, spiffe://maas.internal/gateway
#   <ns>/maas-api-key-cleanup-client           the cleanup job's, spiffe://maas.internal/api-key-cleanup
# The CA's private key is used once and kept nowhere: nothing can issue another caller's
# certificate later. A run reuses the three when they hold one CA, each pair matches, the names
# are right and every certificate has more than INTERNAL_RENEW_DAYS left; otherwise it issues all
# three again (a new CA) and restarts a running companion, which reads its files at start (the
# Gateway's Envoy takes the new Secret over SDS; the cleanup job mounts it at its next run).
INTERNAL_GATEWAY_NAME=spiffe://maas.internal/gateway
INTERNAL_CLEANUP_NAME=spiffe://maas.internal/api-key-cleanup
INTERNAL_CA_DAYS=${INTERNAL_CA_DAYS:-3650}
INTERNAL_CERT_DAYS=${INTERNAL_CERT_DAYS:-730}
INTERNAL_RENEW_DAYS=${INTERNAL_RENEW_DAYS:-30}
INTERNAL_CERTS_CHANGED=false

# internal_secrets: "PREFIX NAMESPACE SECRET" per key pair.
internal_secrets() {
  printf '%s\n' "server $DEPLOYMENT_NAMESPACE maas-companion-internal-tls" \
    "gateway $GATEWAY_NAMESPACE maas-gateway-internal-client" \
    "cleanup $DEPLOYMENT_NAMESPACE maas-api-key-cleanup-client"
}

# read_internal_secrets DIR: writes DIR/PREFIX.{ca,crt,key} from the existing Secrets; fails when
# one is missing or incomplete.
read_internal_secrets() {
  local dir=$1 prefix namespace secret key file value
  while read -r prefix namespace secret; do
    for key in ca.crt tls.crt tls.key; do
      case $key in ca.crt) file=$dir/$prefix.ca ;; tls.crt) file=$dir/$prefix.crt ;; *) file=$dir/$prefix.key ;; esac
      value=$(query "$KCLI" get secret "$secret" -n "$namespace" -o "jsonpath={.data.${key//./\\.}}" 2>/dev/null) || return 1
      [ -n "$value" ] || return 1
      printf '%s' "$value" | base64 -d >"$file" 2>/dev/null || return 1
    done
  done < <(internal_secrets)
}

# internal_pki_usable DIR: one CA, each pair matching and issued by it for the right name, and
# nothing expiring within INTERNAL_RENEW_DAYS.
internal_pki_usable() {
  local dir=$1 prefix namespace secret want
  local margin=$((INTERNAL_RENEW_DAYS * 86400))
  openssl x509 -in "$dir/server.ca" -noout -checkend "$margin" >/dev/null 2>&1 || return 1
  while read -r prefix namespace secret; do
    cmp -s "$dir/server.ca" "$dir/$prefix.ca" || return 1
    openssl x509 -in "$dir/$prefix.crt" -noout -checkend "$margin" >/dev/null 2>&1 || return 1
    openssl verify -CAfile "$dir/$prefix.ca" "$dir/$prefix.crt" >/dev/null 2>&1 || return 1
    [ "$(openssl x509 -in "$dir/$prefix.crt" -noout -pubkey 2>/dev/null)" = "$(openssl pkey -in "$dir/$prefix.key" -pubout 2>/dev/null)" ] || return 1
    case $prefix in
      server) want="DNS:maas-companion.$DEPLOYMENT_NAMESPACE.svc" ;;
      gateway) want="URI:$INTERNAL_GATEWAY_NAME" ;;
      *) want="URI:$INTERNAL_CLEANUP_NAME" ;;
    esac
    openssl x509 -in "$dir/$prefix.crt" -noout -ext subjectAltName 2>/dev/null | tr ',' '\n' | sed 's/^ *//' | grep -qxF "$want" || return 1
  done < <(internal_secrets)
}

# issue_internal_pki DIR: a new CA (its key only in DIR) and the three key pairs.
issue_internal_pki() {
  local dir=$1 prefix namespace secret san eku
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/ca.key" 2>/dev/null &&
    openssl req -x509 -new -key "$dir/ca.key" -sha256 -days "$INTERNAL_CA_DAYS" \
      -subj "/CN=MaaS Gateway internal CA ($DEPLOYMENT_NAMESPACE)" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -addext "subjectKeyIdentifier=hash" -out "$dir/ca.crt" 2>/dev/null || return 1
  while read -r prefix namespace secret; do
    case $prefix in
      server) san="DNS:maas-companion.$DEPLOYMENT_NAMESPACE.svc,DNS:maas-companion.$DEPLOYMENT_NAMESPACE.svc.cluster.local" eku=serverAuth ;;
      gateway) san="URI:$INTERNAL_GATEWAY_NAME" eku=clientAuth ;;
      *) san="URI:$INTERNAL_CLEANUP_NAME" eku=clientAuth ;;
    esac
    printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\nsubjectAltName=%s\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n' \
      "$eku" "$san" >"$dir/$prefix.ext"
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/$prefix.key" 2>/dev/null &&
      openssl req -new -key "$dir/$prefix.key" -subj "/CN=$secret" -out "$dir/$prefix.csr" 2>/dev/null &&
      openssl x509 -req -in "$dir/$prefix.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
        -days "$INTERNAL_CERT_DAYS" -sha256 -extfile "$dir/$prefix.ext" -out "$dir/$prefix.crt" 2>/dev/null || return 1
    cp "$dir/ca.crt" "$dir/$prefix.ca"
  done < <(internal_secrets)
  rm -f "$dir/ca.key"
}

# internal_secret_yaml NAME NAMESPACE DIR PREFIX: a kubernetes.io/tls Secret on stdout.
internal_secret_yaml() {
  local b64
  printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n  labels:\n    app.kubernetes.io/part-of: maas-gateway\ntype: kubernetes.io/tls\ndata:\n' "$1" "$2"
  for b64 in "ca.crt $3/$4.ca" "tls.crt $3/$4.crt" "tls.key $3/$4.key"; do
    printf '  %s: %s\n' "${b64%% *}" "$(base64 <"${b64#* }" | tr -d '\n')"
  done
}

configure_internal_mtls() {
  log_info "Internal API: mutual TLS (only the Gateway and the key cleanup job, by client certificate)"
  local dir=$WORK_DIR/internal-pki prefix namespace secret
  mkdir -m 700 "$dir"
  if [ "$DRY_RUN" != true ] && read_internal_secrets "$dir" && internal_pki_usable "$dir"; then
    log_info "  reusing the certificates in Secrets maas-companion-internal-tls, $GATEWAY_NAMESPACE/maas-gateway-internal-client and maas-api-key-cleanup-client"
  else
    rm -f "$dir"/*
    issue_internal_pki "$dir" || die "openssl could not issue the internal API's certificates"
    log_info "  issued a private CA (its key kept nowhere) and, valid ${INTERNAL_CERT_DAYS} days: the companion's certificate (maas-companion.$DEPLOYMENT_NAMESPACE.svc), the Gateway's ($INTERNAL_GATEWAY_NAME) and the cleanup job's ($INTERNAL_CLEANUP_NAME)"
    if [ "$DRY_RUN" != true ] && query "$KCLI" get deployment maas-companion -n "$DEPLOYMENT_NAMESPACE" >/dev/null 2>&1; then
      INTERNAL_CERTS_CHANGED=true
    fi
  fi
  while read -r prefix namespace secret; do
    internal_secret_yaml "$secret" "$namespace" "$dir" "$prefix" |
      run_stdin "Secret $namespace/$secret" "$KCLI" apply -f -
  done < <(internal_secrets)
}

# (A dry run reads no Secret, so it cannot tell: it prints no restart.)
restart_companion_if_internal_certs_changed() {
  [ "$INTERNAL_CERTS_CHANGED" = true ] || return 0
  log_info "  the internal certificates were issued again: restarting the companion to read them"
  run "$KCLI" rollout restart deployment/maas-companion -n "$DEPLOYMENT_NAMESPACE"
}

wait_for_readiness() {
  log_info "Waiting for readiness"
  if [ -z "$POSTGRES_CONNECTION" ]; then
    run "$KCLI" rollout status deployment/maas-postgres -n "$DEPLOYMENT_NAMESPACE" --timeout="${ROLLOUT_TIMEOUT}s"
  fi
  if [ "$DEV_REDIS" = true ]; then
    run "$KCLI" rollout status deployment/maas-redis -n "$DEPLOYMENT_NAMESPACE" --timeout="${ROLLOUT_TIMEOUT}s"
  fi
  run "$KCLI" rollout status deployment/maas-companion -n "$DEPLOYMENT_NAMESPACE" --timeout="${ROLLOUT_TIMEOUT}s"
  run "$KCLI" wait --for=condition=Programmed "gateway/$GATEWAY_NAME" -n "$GATEWAY_NAMESPACE" --timeout="${RESOURCE_TIMEOUT}s"
}

print_next_steps() {
  local host
  host=$(gateway_hostname)
  if [ "$DRY_RUN" = true ]; then
    echo
    echo "Dry run finished: nothing was changed. After a real run:"
  else
    echo
    echo "MaaS Gateway is deployed."
  fi
  cat <<EOF
  Gateway:   https://$host  (Gateway $GATEWAY_NAME in $GATEWAY_NAMESPACE, filter EnvoyFilter maas-filter)
  Companion: deployment/maas-companion in $DEPLOYMENT_NAMESPACE, $COMPANION_REPLICAS replica(s): $LEASE_STORE_WHY
             policy: ConfigMap maas-policy

Mint an API key with your $(if [ "$PLATFORM" = kubernetes ]; then echo "cluster identity (a token the API server's TokenReview accepts, or an OIDC JWT with --external-oidc)"; else echo "OpenShift identity"; fi):
  HOST=$host
  TOKEN=$(if [ "$PLATFORM" = kubernetes ]; then echo "<your token>"; else echo "\$(oc whoami -t)"; fi)
  curl -sS -X POST "https://\$HOST/maas-api/v1/api-keys" -H "Authorization: Bearer \$TOKEN" \\
    -H 'Content-Type: application/json' -d '{"name":"my-key","expiresIn":"30d"}'
  # the response's "key" (sk-oai-...) is shown once: keep it, e.g. in KEY

List the models your tier may use, then call one:
  curl -sS "https://\$HOST/maas-api/v1/models" -H "Authorization: Bearer \$KEY"
  curl -sS "https://\$HOST/llm/facebook-opt-125m-simulated/v1/chat/completions" \\
    -H "Authorization: Bearer \$KEY" -H 'Content-Type: application/json' \\
    -d '{"model":"facebook/opt-125m","messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'

Models, tiers and limits: $KCLI edit configmap maas-policy -n $DEPLOYMENT_NAMESPACE (reloaded live).
Samples (KServe route, external OpenAI, Azure OpenAI, Bedrock, a weighted OpenAI/Azure split): wasm-plugin-crs/samples.
EOF
}

print_plan() {
  log_info "Deployment plan"
  log_info "  platform:          $PLATFORM (Gateway $GATEWAY_NAME in $GATEWAY_NAMESPACE, $KCLI)"
  log_info "  mode:              $DEPLOYMENT_MODE ($OPERATOR_TYPE)"
  log_info "  namespace:         $DEPLOYMENT_NAMESPACE"
  log_info "  TLS backend:       $ENABLE_TLS_BACKEND (public and metrics ports)"
  log_info "  internal API:      mutual TLS, a private CA: only the Gateway ($INTERNAL_GATEWAY_NAME) and the key cleanup job"
  log_info "                     (certificates reused while valid > ${INTERNAL_RENEW_DAYS} days; issued again, the companion restarts)"
  log_info "  companion image:   $MAAS_API_IMAGE"
  log_info "  filter image:      oci://$MAAS_WASM_IMAGE"
  if [ -n "$POSTGRES_CONNECTION" ]; then
    log_info "  database:          given connection (${POSTGRES_CONNECTION%%://*}://<redacted>)"
  else
    log_info "  database:          development PostgreSQL with a PersistentVolumeClaim"
  fi
  if [ -n "$REDIS_URL" ]; then
    log_info "  lease store:       Redis $(redis_display "$REDIS_URL")"
  elif [ "$DEV_REDIS" = true ]; then
    log_info "  lease store:       development Redis (no persistence; not for production)"
  else
    log_info "  lease store:       in process (no Redis: one companion replica, the one budget across Gateway replicas)"
  fi
  log_info "  Gateway replicas:  $GATEWAY_REPLICAS (the filter's limits.global.replicas: while the lease service is unreachable each admits limit ÷ $GATEWAY_REPLICAS)"
  if [ "$DEPLOYMENT_MODE" = operator ]; then
    log_info "  operator:          $(operator_package) from $(operator_source), channel $OPERATOR_CHANNEL"
  fi
  if [ "$DEPLOYMENT_MODE" = operator ]; then
    log_info "  policy engine:     $POLICY_ENGINE (installed for the operator; the MaaS filter enforces the policies)"
  fi
  if [ "$EXTERNAL_OIDC" = true ]; then
    log_info "  identity:          OpenShift tokens (TokenReview) and OIDC JWTs of $OIDC_ISSUER_URL for client $OIDC_CLIENT_ID"
  else
    log_info "  identity:          OpenShift tokens (TokenReview)"
  fi
  log_info "  admins:            who may create MaaSAuthPolicies in $MAAS_SUBSCRIPTION_NAMESPACE (SubjectAccessReview), and group maas-admins"
  if [ "$DEV_MODE" = true ]; then
    log_info "  dev mode:          development Redis and PostgreSQL where none is given (not for production)"
  fi
  log_info "  log level:         $LOG_LEVEL"
  if [ "$DRY_RUN" = true ]; then log_info "DRY RUN MODE - no changes will be applied"; fi
}

main() {
  parse_arguments "$@"
  validate_configuration
  check_required_tools
  print_plan
  check_cluster
  resolve_oidc_jwks_url
  choose_companion_replicas
  log_info "Companion: $COMPANION_REPLICAS replica(s), $LEASE_STORE_WHY"

  WORK_DIR=$(mktemp -d)
  trap 'rm -rf "$WORK_DIR"' EXIT
  RENDERED=$WORK_DIR/rendered.yaml
  render_manifests "$WORK_DIR/render" >"$RENDERED" || die "rendering the manifests failed"
  if [ "$DRY_RUN" = true ]; then
    echo "---- rendered manifests ($(grep -c '^kind: ' "$RENDERED") objects) ----"
    mask_secrets <"$RENDERED"
    echo "---- end of rendered manifests ----"
    echo "---- commands ----"
  fi

  if [ "$DEPLOYMENT_MODE" = operator ]; then
    check_conflicting_operators
    install_policy_engine
    install_primary_operator
    apply_data_science_cluster
  fi
  ensure_namespace "$DEPLOYMENT_NAMESPACE"
  label_routes_namespace "$DEPLOYMENT_NAMESPACE"
  deploy_gateway
  deploy_database
  deploy_lease_store
  configure_internal_mtls
  apply_manifests
  remove_old_wasmplugin
  restart_companion_if_lease_store_changed
  restart_companion_if_internal_certs_changed
  configure_tls_backend
  wait_for_readiness
  print_next_steps
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
