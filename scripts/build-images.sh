#!/usr/bin/env bash
# Builds and pushes both MaaS Gateway images — the filter (REPO/maas-filter:TAG, for the
# EnvoyFilter maas-filter) and the companion (REPO/maas-companion:TAG) — without a container engine, and prints
# both pinned references, ready for scripts/deploy.sh:
#   MAAS_WASM_IMAGE=REPO/maas-filter@sha256:...
#   MAAS_API_IMAGE=REPO/maas-companion@sha256:...
# Both images are assembled byte for byte (scripts/build-wasm-image.sh,
# scripts/build-companion-image.sh): the same sources give the same digests.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  cat <<'EOF'
Usage: scripts/build-images.sh [options] REGISTRY/NAMESPACE TAG

Builds the filter (wasm32-wasip1) and the companion (static, x86_64-unknown-linux-musl), pushes
REGISTRY/NAMESPACE/maas-filter:TAG and REGISTRY/NAMESPACE/maas-companion:TAG with skopeo, and
prints, last, two lines to paste (or eval) before scripts/deploy.sh:
  MAAS_WASM_IMAGE=REGISTRY/NAMESPACE/maas-filter@sha256:<digest>
  MAAS_API_IMAGE=REGISTRY/NAMESPACE/maas-companion@sha256:<digest>

Options (passed to both image builds):
  --no-build           pack the existing release builds without running cargo
  --tls-verify=false   talk plain HTTP / skip certificate checks (a local test registry)
  --authfile FILE      registry credentials (default: skopeo's)
  -h, --help           this help
EOF
}

die() {
  echo "build-images: $*" >&2
  exit 1
}

common=()
positional=()
while [ $# -gt 0 ]; do
  case $1 in
    --no-build | --tls-verify=false | --tls-verify=true) common+=("$1"); shift ;;
    --authfile)
      if [ $# -lt 2 ] || [[ $2 == --* ]]; then die "--authfile needs a file"; fi
      common+=("$1" "$2")
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option: $1 (see --help)" ;;
    *) positional+=("$1"); shift ;;
  esac
done
[ ${#positional[@]} -eq 2 ] || die "give REGISTRY/NAMESPACE and TAG, e.g. quay.io/me v0.1.0 (see --help)"
REPO=${positional[0]%/}
REPO=${REPO#docker://}
TAG=${positional[1]}
[[ $TAG =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "'$TAG' is not an image tag"
[[ $REPO =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+$ ]] ||
  die "'$REPO' is not REGISTRY/NAMESPACE (e.g. quay.io/me or 127.0.0.1:5000/maas)"

wasm=$("$ROOT/scripts/build-wasm-image.sh" "${common[@]}" "$REPO/maas-filter:$TAG" | tail -n 1) ||
  die "the filter image failed"
companion=$("$ROOT/scripts/build-companion-image.sh" "${common[@]}" "$REPO/maas-companion:$TAG" | tail -n 1) ||
  die "the companion image failed"
[[ $wasm == "$REPO/maas-filter@sha256:"* ]] || die "unexpected filter reference '$wasm'"
[[ $companion == "$REPO/maas-companion@sha256:"* ]] || die "unexpected companion reference '$companion'"
echo "MAAS_WASM_IMAGE=$wasm"
echo "MAAS_API_IMAGE=$companion"
