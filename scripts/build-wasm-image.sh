#!/usr/bin/env bash
# Builds the MaaS filter (release .wasm) into an OCI image that Istio's agent pulls for a Wasm
# module (a WasmPlugin's url, or the oci:// uri of the EnvoyFilter maas-filter's extension
# config) — the equivalent of `FROM scratch` + `COPY plugin.wasm /` — and pushes it
# with skopeo. The image is assembled byte for byte by this script (a tar with fixed mtime,
# owner and mode, gzip without name or time, canonical JSON), so the same .wasm always gives the
# same digest, on any machine. Prints the digest to pin: IMAGE@sha256:...
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  cat <<'EOF'
Usage: scripts/build-wasm-image.sh [options] REGISTRY/REPOSITORY[:TAG]

Builds target/wasm32-wasip1/release/maas_filter.wasm (cargo), packs it as plugin.wasm in a
one-layer OCI image and pushes it with skopeo. The last line printed is the pinned reference
REGISTRY/REPOSITORY@sha256:<digest>; put it in MAAS_WASM_IMAGE for scripts/deploy.sh.

Options:
  --wasm FILE          pack FILE instead of building the filter
  --no-build           pack the existing release build without running cargo
  --oci-dir DIR        also keep the OCI image layout in DIR
  --no-push            build the image (and print its digest) without pushing it
  --tls-verify=false   talk plain HTTP / skip certificate checks (a local test registry)
  --authfile FILE      registry credentials (default: skopeo's, e.g. ${XDG_RUNTIME_DIR}/containers/auth.json)
  -h, --help           this help
EOF
}

die() {
  echo "build-wasm-image: $*" >&2
  exit 1
}
info() { echo "build-wasm-image: $*" >&2; }
# need_value FLAG WHAT "$@": the flag at $1 of the remaining arguments must have a value.
need_value() {
  local flag=$1 what=$2
  shift 2
  if [ $# -lt 2 ] || [[ $2 == --* ]]; then die "$flag needs $what"; fi
}

WASM=""
BUILD=true
OCI_DIR=""
PUSH=true
TLS_VERIFY=true
AUTHFILE=""
IMAGE=""
while [ $# -gt 0 ]; do
  case $1 in
    --wasm)
      need_value "--wasm" "a file" "$@"
      WASM=$2
      BUILD=false
      shift 2
      ;;
    --no-build) BUILD=false; shift ;;
    --oci-dir)
      need_value "--oci-dir" "a directory" "$@"
      OCI_DIR=$2
      shift 2
      ;;
    --no-push) PUSH=false; shift ;;
    --tls-verify=false) TLS_VERIFY=false; shift ;;
    --tls-verify=true) TLS_VERIFY=true; shift ;;
    --authfile)
      need_value "--authfile" "a file" "$@"
      AUTHFILE=$2
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option: $1 (see --help)" ;;
    *)
      [ -z "$IMAGE" ] || die "one image reference only (got '$IMAGE' and '$1')"
      IMAGE=$1
      shift
      ;;
  esac
done

IMAGE=${IMAGE#oci://}
IMAGE=${IMAGE#docker://}
if [ "$PUSH" = true ] && [ -z "$IMAGE" ]; then die "give the image to push, e.g. quay.io/me/maas-filter:v0.1.0 (see --help)"; fi
if [ -n "$IMAGE" ]; then
  [[ $IMAGE =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$ ]] ||
    die "'$IMAGE' is not REGISTRY/REPOSITORY[:TAG] (no digest: the digest is what this script computes)"
  [[ ${IMAGE##*/} == *:* ]] || IMAGE=$IMAGE:latest
fi

for tool in tar gzip sha256sum; do command -v "$tool" >/dev/null 2>&1 || die "$tool is required"; done
if [ "$PUSH" = true ]; then command -v skopeo >/dev/null 2>&1 || die "skopeo is required to push (apt-get install skopeo)"; fi

if [ "$BUILD" = true ]; then
  info "building the filter: cargo build -p maas-filter --release --target wasm32-wasip1"
  (cd "$ROOT" && cargo build -q -p maas-filter --release --target wasm32-wasip1) || die "cargo build failed"
fi
if [ -z "$WASM" ]; then
  WASM=${CARGO_TARGET_DIR:-$ROOT/target}/wasm32-wasip1/release/maas_filter.wasm
fi
[ -s "$WASM" ] || die "no wasm module at $WASM"
[ "$(head -c 4 "$WASM" | od -An -tx1 | tr -d ' \n')" = 0061736d ] || die "$WASM is not a WebAssembly module"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LAYOUT=$WORK/layout
mkdir -p "$WORK/rootfs" "$LAYOUT/blobs/sha256"

# shellcheck source=scripts/lib/oci.sh
source "$ROOT/scripts/lib/oci.sh"

# The layer: one file, plugin.wasm, at the root; nothing in it depends on when or by whom it was
# built (ustar: no pax atime/ctime records).
cp "$WASM" "$WORK/rootfs/plugin.wasm"
tar --format=ustar --sort=name --owner=0 --group=0 --numeric-owner --mode=0644 \
  --mtime='1970-01-01 00:00:00Z' -C "$WORK/rootfs" -cf "$WORK/layer.tar" plugin.wasm
diff_id=$(sha256 "$WORK/layer.tar")
gzip -9 -n -c "$WORK/layer.tar" >"$WORK/layer.tar.gz"
printf '{"architecture":"wasm","os":"wasip1","config":{},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
  "$diff_id" >"$WORK/config.json"
info "plugin.wasm $(size "$WASM") bytes, sha256 $(sha256 "$WASM")"
oci_publish maas-filter "$WORK/config.json" "$WORK/layer.tar.gz" \
  ',"annotations":{"org.opencontainers.image.title":"plugin.wasm"}' \
  "pin it in EnvoyFilter maas-filter (deploy.sh MAAS_WASM_IMAGE): uri: oci://"
