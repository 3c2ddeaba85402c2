#!/usr/bin/env bash
# Builds the companion (maas-companion) as a static binary (x86_64-unknown-linux-musl) and packs it
# into an OCI image without a container engine — the equivalent of `FROM scratch` + the binary +
# /etc/passwd + a CA bundle + the web UI — then pushes it with skopeo. Like scripts/build-wasm-image.sh, the
# image is assembled byte for byte (tar with fixed mtime, owner and modes, gzip without name or
# time, canonical JSON): the same binary and CA bundle always give the same digest.
#
# The image: /usr/local/bin/maas-companion (0755), /etc/passwd and /etc/group with the non-root
# user maas (65532), /etc/ssl/certs/ca-certificates.crt (Debian's ca-certificates: the
# Kubernetes API, OIDC issuers and PostgreSQL over TLS), /usr/share/maas-companion/ui (the web UI,
# ui/ built with `npm ci && npm run build`; the config sets MAAS_UI_DIR to it, so the companion
# serves it at /ui/). No shell, no libc: nothing else.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=x86_64-unknown-linux-musl
UID_GID=65532
UI_IN_IMAGE=/usr/share/maas-companion/ui
CA_DEFAULT=/etc/ssl/certs/ca-certificates.crt

usage() {
  cat <<'EOF'
Usage: scripts/build-companion-image.sh [options] REGISTRY/REPOSITORY[:TAG]

Builds target/x86_64-unknown-linux-musl/release/maas-companion (cargo, static) and the web UI
(ui/: npm ci && npm run build, needs Node.js 18+ and npm), packs them with a CA bundle and a
non-root /etc/passwd into a one-layer OCI image and pushes it with skopeo. The
last line printed is the pinned reference REGISTRY/REPOSITORY@sha256:<digest>; put it in
MAAS_API_IMAGE for scripts/deploy.sh.

Installs what the build needs when it is missing and it may (root with apt-get): the rustup
target x86_64-unknown-linux-musl, musl-tools (ring's C code), ca-certificates.

Options:
  --binary FILE        pack FILE (a static x86_64 ELF) instead of building the companion
  --no-build           pack the existing musl release build without running cargo
  --ui-dir DIR         pack DIR (a built web UI with index.html) instead of building ui/
  --ca-bundle FILE     CA bundle for /etc/ssl/certs/ca-certificates.crt (default: Debian's)
  --oci-dir DIR        also keep the OCI image layout in DIR
  --no-push            build the image (and print its digest) without pushing it
  --tls-verify=false   talk plain HTTP / skip certificate checks (a local test registry)
  --authfile FILE      registry credentials (default: skopeo's)
  -h, --help           this help
EOF
}

die() {
  echo "build-companion-image: $*" >&2
  exit 1
}
info() { echo "build-companion-image: $*" >&2; }
need_value() {
  local flag=$1 what=$2
  shift 2
  if [ $# -lt 2 ] || [[ $2 == --* ]]; then die "$flag needs $what"; fi
}

BINARY=""
UI_DIR=""
BUILD=true
CA_BUNDLE=$CA_DEFAULT
OCI_DIR=""
PUSH=true
TLS_VERIFY=true
AUTHFILE=""
IMAGE=""
while [ $# -gt 0 ]; do
  case $1 in
    --binary)
      need_value "--binary" "a file" "$@"
      BINARY=$2
      BUILD=false
      shift 2
      ;;
    --no-build) BUILD=false; shift ;;
    --ca-bundle)
      need_value "--ca-bundle" "a file" "$@"
      CA_BUNDLE=$2
      shift 2
      ;;
    --ui-dir)
      need_value "--ui-dir" "a directory" "$@"
      UI_DIR=$2
      shift 2
      ;;
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

IMAGE=${IMAGE#docker://}
if [ "$PUSH" = true ] && [ -z "$IMAGE" ]; then die "give the image to push, e.g. quay.io/me/maas-companion:v0.1.0 (see --help)"; fi
if [ -n "$IMAGE" ]; then
  [[ $IMAGE =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$ ]] ||
    die "'$IMAGE' is not REGISTRY/REPOSITORY[:TAG] (no digest: the digest is what this script computes)"
  [[ ${IMAGE##*/} == *:* ]] || IMAGE=$IMAGE:latest
fi

# apt_tool COMMAND PACKAGE: installs PACKAGE when COMMAND is missing (root with apt-get only).
apt_tool() {
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    die "$1 is required: install the Debian package $2"
  fi
  info "installing $2 (apt-get)"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null 2>&1 ||
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null; }; } ||
    die "installing $2 failed"
}

for tool in tar gzip sha256sum python3; do command -v "$tool" >/dev/null 2>&1 || die "$tool is required"; done
if [ "$PUSH" = true ]; then apt_tool skopeo skopeo; fi
if [ "$CA_BUNDLE" = "$CA_DEFAULT" ] && [ ! -s "$CA_BUNDLE" ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then die "no CA bundle at $CA_BUNDLE: install ca-certificates"; fi
  info "installing ca-certificates (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ca-certificates >/dev/null 2>&1 ||
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ca-certificates >/dev/null; } ||
    die "installing ca-certificates failed"
fi
[ -s "$CA_BUNDLE" ] || die "no CA bundle at $CA_BUNDLE"
grep -q 'BEGIN CERTIFICATE' "$CA_BUNDLE" || die "$CA_BUNDLE holds no PEM certificate"

if [ "$BUILD" = true ]; then
  command -v cargo >/dev/null 2>&1 || die "cargo is required (rustup.rs)"
  if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
    info "adding the rust target $TARGET (rustup)"
    rustup target add "$TARGET" >&2 || die "rustup target add $TARGET failed"
  fi
  apt_tool musl-gcc musl-tools
  # Reproducible: the paths of this checkout and of cargo's registry are remapped, so the binary
  # does not depend on where it was built (strip = true and panic = abort come from the release
  # profile). RUSTFLAGS applies to the musl target only (build scripts and proc macros are host
  # builds), so the shared target directory's native builds are untouched.
  cargo_home=${CARGO_HOME:-$HOME/.cargo}
  info "building the companion: cargo build -p maas-companion --release --target $TARGET"
  (cd "$ROOT" && unset CARGO_ENCODED_RUSTFLAGS &&
    CC_x86_64_unknown_linux_musl=musl-gcc \
      RUSTFLAGS="--remap-path-prefix=$ROOT=/build --remap-path-prefix=$cargo_home=/cargo" \
      cargo build -q -p maas-companion --release --target "$TARGET") || die "cargo build failed"
fi
if [ -z "$BINARY" ]; then
  BINARY=${CARGO_TARGET_DIR:-$ROOT/target}/$TARGET/release/maas-companion
fi
[ -s "$BINARY" ] || die "no companion binary at $BINARY"
# A static x86_64 ELF executable: no program interpreter (PT_INTERP), no shared libraries.
python3 - "$BINARY" <<'PY' || die "$BINARY is not a static x86_64 ELF executable"
import struct, sys
data = open(sys.argv[1], "rb").read()
if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
    sys.exit("not a 64-bit little-endian ELF")
e_type, e_machine = struct.unpack_from("<HH", data, 16)
if e_machine != 62 or e_type not in (2, 3):
    sys.exit("not an x86_64 executable")
phoff, = struct.unpack_from("<Q", data, 32)
phentsize, phnum = struct.unpack_from("<HH", data, 54)
for i in range(phnum):
    p_type, = struct.unpack_from("<I", data, phoff + i * phentsize)
    if p_type == 3:
        sys.exit("dynamically linked (has an interpreter)")
PY

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LAYOUT=$WORK/layout
ROOTFS=$WORK/rootfs
mkdir -p "$LAYOUT/blobs/sha256" "$ROOTFS/etc/ssl/certs" "$ROOTFS/usr/local/bin" "$ROOTFS/tmp"

# The web UI: built from ui/ into the work directory (ui/dist is left alone), unless given.
if [ -z "$UI_DIR" ]; then
  command -v npm >/dev/null 2>&1 ||
    die "npm is required to build the web UI (apt-get install nodejs npm), or give a built one with --ui-dir DIR"
  info "building the web UI: npm ci && npm run build (ui/)"
  if [ ! -d "$ROOT/ui/node_modules" ] || [ "$ROOT/ui/package-lock.json" -nt "$ROOT/ui/node_modules/.package-lock.json" ]; then
    (cd "$ROOT/ui" && npm ci --no-audit --no-fund --loglevel=error >&2) || die "npm ci in ui/ failed"
  fi
  (cd "$ROOT/ui" && npm run build --silent -- --outDir "$WORK/ui" >&2) || die "building the web UI failed (cd ui && npm run build)"
  UI_DIR=$WORK/ui
fi
[ -f "$UI_DIR/index.html" ] || die "no index.html in the web UI $UI_DIR (build it: cd ui && npm ci && npm run build)"
mkdir -p "$ROOTFS$(dirname "$UI_IN_IMAGE")"
cp -R "$UI_DIR" "$ROOTFS$UI_IN_IMAGE"

# shellcheck source=scripts/lib/oci.sh
source "$ROOT/scripts/lib/oci.sh"

# The layer. Modes are set explicitly (the umask of whoever builds does not matter), owners are
# 0/0, mtimes 1970-01-01, entries sorted, ustar (no pax atime/ctime records).
cp "$BINARY" "$ROOTFS/usr/local/bin/maas-companion"
cp "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/:/sbin/nologin\nmaas:x:%s:%s:maas-companion:/:/sbin/nologin\n' "$UID_GID" "$UID_GID" >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nmaas:x:%s:\n' "$UID_GID" >"$ROOTFS/etc/group"
find "$ROOTFS" -type d -exec chmod 0755 {} +
chmod 1777 "$ROOTFS/tmp"
find "$ROOTFS" -type f -exec chmod 0644 {} +
chmod 0755 "$ROOTFS/usr/local/bin/maas-companion"
(cd "$ROOTFS" && tar --format=ustar --sort=name --owner=0 --group=0 --numeric-owner \
  --mtime='1970-01-01 00:00:00Z' -cf "$WORK/layer.tar" etc tmp usr)
diff_id=$(sha256 "$WORK/layer.tar")
gzip -9 -n -c "$WORK/layer.tar" >"$WORK/layer.tar.gz"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)
revision=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || true)
repository=$(sed -n 's/^repository = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)
# Canonical JSON (sorted keys, no spaces) from python: the same inputs give the same bytes.
python3 - "$WORK/config.json" "$diff_id" "$UID_GID" "${version:-0.0.0}" "$revision" "$repository" "$UI_IN_IMAGE" <<'PY'
import json, sys
out, diff_id, uid, version, revision, repository, ui_dir = sys.argv[1:]
labels = {
    "org.opencontainers.image.title": "maas-companion",
    "org.opencontainers.image.description":
        "MaaS Gateway companion: API keys in PostgreSQL, identity, policy and provider credentials",
    "org.opencontainers.image.licenses": "Apache-2.0",
    "org.opencontainers.image.version": version,
    "org.opencontainers.image.source": repository,
}
if revision:
    labels["org.opencontainers.image.revision"] = revision
config = {
    "architecture": "amd64",
    "os": "linux",
    "created": "1970-01-01T00:00:00Z",
    "config": {
        "User": f"{uid}:{uid}",
        "Entrypoint": ["/usr/local/bin/maas-companion"],
        "Env": ["PATH=/usr/local/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt", f"MAAS_UI_DIR={ui_dir}"],
        "WorkingDir": "/",
        "ExposedPorts": {"8080/tcp": {}, "8081/tcp": {}, "9090/tcp": {}},
        "Labels": labels,
    },
    "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
    "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/build-companion-image.sh"}],
}
open(out, "w").write(json.dumps(config, sort_keys=True, separators=(",", ":")))
PY
info "maas-companion $(size "$BINARY") bytes, sha256 $(sha256 "$BINARY")"
oci_publish maas-companion "$WORK/config.json" "$WORK/layer.tar.gz" "" \
  "deploy it with MAAS_API_IMAGE="
