#!/usr/bin/env bash
# scripts/build-images.sh and scripts/build-companion-image.sh against a real local registry
# (Debian's docker-registry on 127.0.0.1): both images are built and pushed and both digests
# printed; the companion image, pulled back by digest, has the static binary, a non-root user, the
# CA bundle, the web UI and the OCI config Kubernetes needs; the binary runs from the unpacked
# image (chroot: no shell, no libc, nothing else there) and answers --help, /health and the UI;
# building again gives the same digest.
# MAAS_IMAGES_NO_BUILD=1 packs the existing release builds (build-images.sh --no-build) instead of
# running cargo.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"

BUILD_ALL=$ROOT/scripts/build-images.sh
BUILD=$ROOT/scripts/build-companion-image.sh
BINARY=${CARGO_TARGET_DIR:-$ROOT/target}/x86_64-unknown-linux-musl/release/maas-companion
BUILD_ARGS=()
if [ "${MAAS_IMAGES_NO_BUILD:-}" = 1 ]; then BUILD_ARGS=(--no-build); fi
WORK=$(mktemp -d)
REGISTRY_PID=""
COMPANION_PID=""
cleanup() {
  if [ -n "$COMPANION_PID" ]; then kill "$COMPANION_PID" 2>/dev/null; wait "$COMPANION_PID" 2>/dev/null; fi
  if [ -n "$REGISTRY_PID" ]; then kill "$REGISTRY_PID" 2>/dev/null; wait "$REGISTRY_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

if ! ensure_apt_tool docker-registry docker-registry || ! ensure_apt_tool skopeo skopeo || ! ensure_apt_tool curl curl; then
  fail "test tools" "docker-registry, skopeo and curl are needed (Debian packages of the same names)"
  finish
  exit 1
fi
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

PORT=$(free_port)
cat >"$WORK/registry.yml" <<YAML
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: $WORK/registry-data
http:
  addr: 127.0.0.1:$PORT
YAML
docker-registry serve "$WORK/registry.yml" >"$WORK/registry.log" 2>&1 &
REGISTRY_PID=$!
for _ in $(seq 1 50); do
  curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null 2>&1 && break
  sleep 0.2
done
if curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null 2>&1; then
  pass "docker-registry listens on 127.0.0.1:$PORT"
else
  fail "docker-registry listens on 127.0.0.1:$PORT" "$(cat "$WORK/registry.log")"
  finish
  exit 1
fi
REPO=127.0.0.1:$PORT/maas

# 1. Both images, built with cargo (the scripts install the musl target and musl-tools if needed).
if "$BUILD_ALL" "${BUILD_ARGS[@]}" --tls-verify=false "$REPO" v1 >"$WORK/all.out" 2>"$WORK/all.err"; then
  pass "build-images.sh builds and pushes both images"
else
  fail "build-images.sh builds and pushes both images" "$(tail -n 8 "$WORK/all.err")"
  finish
  exit 1
fi
WASM_REF=$(sed -n 's/^MAAS_WASM_IMAGE=//p' "$WORK/all.out")
API_REF=$(sed -n 's/^MAAS_API_IMAGE=//p' "$WORK/all.out")
if [[ $WASM_REF =~ ^$REPO/maas-filter@sha256:[a-f0-9]{64}$ ]] && [[ $API_REF =~ ^$REPO/maas-companion@sha256:[a-f0-9]{64}$ ]] &&
  [ "$(tail -n 2 "$WORK/all.out" | cut -d= -f1 | tr '\n' ' ')" = "MAAS_WASM_IMAGE MAAS_API_IMAGE " ]; then
  pass "prints both pinned references last, as MAAS_WASM_IMAGE=... and MAAS_API_IMAGE=..."
else
  fail "prints both pinned references" "$(cat "$WORK/all.out")"
fi
DIGEST=${API_REF##*@}
for pair in "maas-filter:${WASM_REF##*@}" "maas-companion:$DIGEST"; do
  name=${pair%%:*}
  remote=$(skopeo inspect --tls-verify=false --format '{{.Digest}}' "docker://$REPO/$name:v1" 2>&1)
  if [ "$remote" = "${pair#*:}" ]; then pass "the registry's $name:v1 resolves to the printed digest"; else fail "$name:v1 → digest" "$remote"; fi
done
cp "$BINARY" "$WORK/build.bin"

# 2. Pull the companion back by digest and look inside.
if skopeo copy --quiet --src-tls-verify=false "docker://$API_REF" "oci:$WORK/pulled:x" >/dev/null 2>"$WORK/pull.err"; then
  pass "pulls the companion image back by digest"
else
  fail "pulls the companion image back by digest" "$(cat "$WORK/pull.err")"
fi
inspect=$(python3 - "$WORK/pulled" "$DIGEST" <<'PY' 2>&1
import hashlib, json, sys
layout, digest = sys.argv[1:]
blob = lambda d: open(f"{layout}/blobs/sha256/{d.split(':')[1]}", "rb").read()
index = json.load(open(f"{layout}/index.json"))
raw = blob(index["manifests"][0]["digest"])
problems = []
if "sha256:" + hashlib.sha256(raw).hexdigest() != digest: problems.append("manifest does not hash to the digest")
m = json.loads(raw)
if m.get("mediaType") != "application/vnd.oci.image.manifest.v1+json": problems.append(f"mediaType {m.get('mediaType')}")
if len(m["layers"]) != 1: problems.append(f"{len(m['layers'])} layers")
c = json.loads(blob(m["config"]["digest"]))
cfg = c.get("config", {})
want = {
    "architecture": (c.get("architecture"), "amd64"), "os": (c.get("os"), "linux"),
    "User": (cfg.get("User"), "65532:65532"),
    "Entrypoint": (cfg.get("Entrypoint"), ["/usr/local/bin/maas-companion"]),
    "ExposedPorts": (sorted(cfg.get("ExposedPorts", {})), ["8080/tcp", "8081/tcp", "9090/tcp"]),
}
for k, (got, exp) in want.items():
    if got != exp: problems.append(f"{k} {got!r}, expected {exp!r}")
labels = cfg.get("Labels", {})
for k in ("title", "source", "licenses", "version", "revision", "description"):
    if not labels.get(f"org.opencontainers.image.{k}"): problems.append(f"no label org.opencontainers.image.{k}")
if "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" not in cfg.get("Env", []): problems.append("no SSL_CERT_FILE")
if "MAAS_UI_DIR=/usr/share/maas-companion/ui" not in cfg.get("Env", []): problems.append("no MAAS_UI_DIR")
if problems: sys.exit("; ".join(problems))
print(m["layers"][0]["digest"].split(":")[1])
PY
)
if [[ $inspect =~ ^[a-f0-9]{64}$ ]]; then
  pass "config: amd64/linux, User 65532:65532, Entrypoint the binary, ports 8080/8081/9090, org.opencontainers labels"
  LAYER=$WORK/pulled/blobs/sha256/$inspect
else
  fail "image config" "$inspect"
  LAYER=/nonexistent
fi
full_listing=$(tar -tvzf "$LAYER" 2>&1 | awk '{print $1, $2, $4, $5, $6}')
# The web UI's files (their names hold content hashes) are checked apart, below.
listing=$(grep -v ' usr/share/' <<<"$full_listing")
ui_listing=$(grep ' usr/share/' <<<"$full_listing")
expected="drwxr-xr-x 0/0 1970-01-01 00:00 etc/
-rw-r--r-- 0/0 1970-01-01 00:00 etc/group
-rw-r--r-- 0/0 1970-01-01 00:00 etc/passwd
drwxr-xr-x 0/0 1970-01-01 00:00 etc/ssl/
drwxr-xr-x 0/0 1970-01-01 00:00 etc/ssl/certs/
-rw-r--r-- 0/0 1970-01-01 00:00 etc/ssl/certs/ca-certificates.crt
drwxrwxrwt 0/0 1970-01-01 00:00 tmp/
drwxr-xr-x 0/0 1970-01-01 00:00 usr/
drwxr-xr-x 0/0 1970-01-01 00:00 usr/local/
drwxr-xr-x 0/0 1970-01-01 00:00 usr/local/bin/
-rwxr-xr-x 0/0 1970-01-01 00:00 usr/local/bin/maas-companion"
if [ "$listing" = "$expected" ]; then
  pass "layer: the binary, passwd/group, the CA bundle and /tmp only; owners 0/0, mtime 1970-01-01, no shell"
else
  fail "layer contents" "$(diff <(echo "$expected") <(echo "$listing") | head -n 10)"
fi
if grep -q ' usr/share/maas-companion/ui/index.html$' <<<"$ui_listing" &&
  grep -Eq ' usr/share/maas-companion/ui/assets/index-[A-Za-z0-9_-]+\.js$' <<<"$ui_listing" &&
  ! grep -Ev '^(-rw-r--r--|drwxr-xr-x) 0/0 1970-01-01 00:00 usr/share/' <<<"$ui_listing" | grep -q .; then
  pass "layer: the web UI under /usr/share/maas-companion/ui (index.html, hashed assets; 0644/0755, 0/0, 1970-01-01)"
else
  fail "layer: the web UI" "$ui_listing"
fi
ROOTFS=$WORK/rootfs
mkdir -p "$ROOTFS"
tar -xzf "$LAYER" -C "$ROOTFS" 2>/dev/null
if cmp -s "$ROOTFS/usr/local/bin/maas-companion" "$WORK/build.bin"; then
  pass "the binary pulled by digest is byte-identical to the cargo build ($(wc -c <"$WORK/build.bin") bytes)"
else
  fail "binary byte-identical to the build" "$(cmp "$ROOTFS/usr/local/bin/maas-companion" "$WORK/build.bin" 2>&1)"
fi
if cmp -s "$ROOTFS/etc/ssl/certs/ca-certificates.crt" /etc/ssl/certs/ca-certificates.crt &&
  [ "$(grep -c 'BEGIN CERTIFICATE' "$ROOTFS/etc/ssl/certs/ca-certificates.crt")" -gt 50 ]; then
  pass "CA bundle: Debian's ca-certificates at /etc/ssl/certs/ca-certificates.crt ($(grep -c 'BEGIN CERTIFICATE' "$ROOTFS/etc/ssl/certs/ca-certificates.crt") certificates)"
else
  fail "CA bundle" "missing or not Debian's"
fi
if grep -qx 'maas:x:65532:65532:maas-companion:/:/sbin/nologin' "$ROOTFS/etc/passwd"; then
  pass "/etc/passwd: user maas, uid 65532 (non-root)"
else
  fail "/etc/passwd" "$(cat "$ROOTFS/etc/passwd")"
fi

# 3. The binary runs from the unpacked image alone: chroot into it as uid 65532 (nothing else is
#    there: a dynamically linked binary or one needing a shell would not start).
# `exec`: the companion replaces the (sub)shell it is started in, so the PID of `run_in_image … &`
# is the companion's own and cleanup's kill stops it (without exec the subshell died and the
# companion ran on). Only ever called in a subshell: `$(…)` or `&`.
if [ "$(id -u)" -eq 0 ] && command -v chroot >/dev/null 2>&1; then
  run_in_image() { exec chroot --userspec=65532:65532 "$ROOTFS" /usr/local/bin/maas-companion "$@"; }
  run_mode="chroot into the image as 65532"
else
  run_in_image() { exec "$ROOTFS/usr/local/bin/maas-companion" "$@"; }
  run_mode="from the unpacked image (not root: no chroot)"
fi
if help=$(run_in_image --help 2>&1) && grep -q -- "--database-url" <<<"$help" && grep -q -- "--metrics-addr" <<<"$help"; then
  pass "--help runs $run_mode"
else
  fail "--help runs $run_mode" "$(head -n 5 <<<"$help")"
fi
mkdir -p "$ROOTFS/config"
cp "$ROOT/config/local/policy.yaml" "$ROOT/config/local/identities.yaml" "$ROOT/config/local/credentials.yaml" "$ROOTFS/config/" 2>/dev/null
chmod -R a+rX "$ROOTFS/config"
P=$(free_port) I=$(free_port) M=$(free_port) DB=$(free_port)
prefix=""
[[ $run_mode == chroot* ]] || prefix=$ROOTFS
# The database is needed only for /ready (connections are lazy); /health answers without it. The
# internal listener's mutual TLS (needs certificates) is beside the point here: turned off.
run_in_image --database-url "postgres://maas@127.0.0.1:$DB/maas" --internal-auth none \
  --public-addr "127.0.0.1:$P" --internal-addr "127.0.0.1:$I" --metrics-addr "127.0.0.1:$M" \
  --policy-file "$prefix/config/policy.yaml" --identity-provider static --identities-file "$prefix/config/identities.yaml" \
  --credentials-source file --credentials-file "$prefix/config/credentials.yaml" \
  --ui-dir "$prefix/usr/share/maas-companion/ui" >"$WORK/companion.log" 2>&1 &
COMPANION_PID=$!
health=""
for _ in $(seq 1 50); do
  health=$(curl -fsS "http://127.0.0.1:$P/health" 2>/dev/null) && break
  sleep 0.2
done
metrics_health=$(curl -fsS "http://127.0.0.1:$M/health" 2>/dev/null)
if grep -q '"healthy"' <<<"$health" && grep -q '"healthy"' <<<"$metrics_health"; then
  pass "the companion started $run_mode answers /health (public and metrics listeners)"
else
  fail "the companion answers /health" "$health $(tail -n 5 "$WORK/companion.log")"
fi
ui_headers=$(curl -fsS -D - -o "$WORK/ui.html" "http://127.0.0.1:$P/ui/keys" 2>&1)
if grep -qi "^content-security-policy: .*script-src 'self'" <<<"$ui_headers" && grep -q '<div id="root">' "$WORK/ui.html"; then
  pass "the companion started $run_mode serves the packed web UI at /ui/ (with its Content-Security-Policy)"
else
  fail "the companion serves the packed web UI" "$ui_headers $(tail -n 5 "$WORK/companion.log")"
fi
kill "$COMPANION_PID" 2>/dev/null; wait "$COMPANION_PID" 2>/dev/null
COMPANION_PID=""

# 4. Reproducible: the same binary packed again — from a copy with another path, mtime and umask —
#    gives the same digest; another binary gives another.
mkdir -p "$WORK/elsewhere"
cp "$WORK/build.bin" "$WORK/elsewhere/maas-companion"
touch -d '2031-05-06 07:08:09' "$WORK/elsewhere/maas-companion"
again=$(cd "$WORK/elsewhere" && umask 0077 && "$BUILD" --binary maas-companion --tls-verify=false "$REPO/maas-companion:v2" 2>"$WORK/again.err" | tail -n 1)
if [ "$again" = "$API_REF" ]; then
  pass "packed again from another path, mtime and umask and pushed: the same digest"
else
  fail "packed again: the same digest" "$again vs $API_REF $(tail -n 3 "$WORK/again.err")"
fi
printf 'x' >>"$WORK/elsewhere/maas-companion"
other=$("$BUILD" --binary "$WORK/elsewhere/maas-companion" --no-push 2>/dev/null | tail -n 1)
if [[ $other =~ ^sha256:[a-f0-9]{64}$ ]] && [ "$other" != "$DIGEST" ]; then
  pass "another binary gives another digest"
else
  fail "another binary gives another digest" "$other"
fi
# The whole script again (cargo build included: nothing to rebuild) gives both digests again.
if "$BUILD_ALL" "${BUILD_ARGS[@]}" --tls-verify=false "$REPO" v3 >"$WORK/all3.out" 2>"$WORK/all3.err" &&
  [ "$(tail -n 2 "$WORK/all3.out")" = "$(tail -n 2 "$WORK/all.out")" ]; then
  pass "build-images.sh run again: the same two digests"
else
  fail "build-images.sh run again: the same two digests" "$(cat "$WORK/all3.out") $(tail -n 3 "$WORK/all3.err")"
fi

# 5. Refusals.
refused() { # refused SCRIPT NAME EXPECTED-TEXT ARGS...
  local script=$1 name=$2 text=$3 err rc=0
  shift 3
  err=$("$script" "$@" 2>&1 >/dev/null) || rc=$?
  if [ "$rc" -ne 0 ] && grep -qF -- "$text" <<<"$err"; then pass "refuses $name ($text)"; else fail "refuses $name" "exit $rc: $err"; fi
}
printf '#!/bin/sh\necho hi\n' >"$WORK/script.sh"
refused "$BUILD" "a binary that is not a static ELF" "is not a static x86_64 ELF executable" --binary "$WORK/script.sh" --no-push
refused "$BUILD" "a dynamically linked binary" "is not a static x86_64 ELF executable" --binary /bin/ls --no-push
refused "$BUILD" "a CA bundle without certificates" "holds no PEM certificate" --binary "$WORK/build.bin" --ca-bundle "$WORK/script.sh" --no-push
refused "$BUILD" "a digest reference" "is not REGISTRY/REPOSITORY[:TAG]" --no-build "$REPO/maas-companion@$DIGEST"
refused "$BUILD_ALL" "a missing tag" "give REGISTRY/NAMESPACE and TAG" "$REPO"
refused "$BUILD_ALL" "a bad tag" "is not an image tag" "$REPO" "v1/x"
refused "$BUILD_ALL" "an unknown option" "unknown option: --fast" --fast "$REPO" v1

finish
