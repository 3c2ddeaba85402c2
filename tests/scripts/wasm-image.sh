#!/usr/bin/env bash
# scripts/build-wasm-image.sh against a real local registry (Debian's docker-registry on
# 127.0.0.1): the image is pushed, pulled back by digest, its plugin.wasm is byte-identical to
# the cargo build, its shape is what Istio's WasmPlugin fetcher reads, and building again — even
# from a copy with another mtime, path and umask — gives the same digest.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"

BUILD=$ROOT/scripts/build-wasm-image.sh
WASM=${CARGO_TARGET_DIR:-$ROOT/target}/wasm32-wasip1/release/maas_filter.wasm
WORK=$(mktemp -d)
REGISTRY_PID=""
cleanup() {
  if [ -n "$REGISTRY_PID" ]; then kill "$REGISTRY_PID" 2>/dev/null; wait "$REGISTRY_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

if ! ensure_apt_tool docker-registry docker-registry || ! ensure_apt_tool skopeo skopeo || ! ensure_apt_tool curl curl; then
  fail "test tools" "docker-registry, skopeo and curl are needed (Debian packages of the same names)"
  finish
  exit 1
fi

# A throwaway registry on a free loopback port, storing into $WORK.
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$WORK/registry.yml" <<YAML
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: $WORK/registry-data
  delete:
    enabled: true
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
REPO=127.0.0.1:$PORT/maas/maas-filter

# 1. Build with cargo (through the script), keep a snapshot of that build — other builds in the
#    shared target directory must not change what the pushes below are compared with — and push.
if "$BUILD" --no-push >"$WORK/build.out" 2>"$WORK/build.err"; then
  pass "build-wasm-image.sh builds the filter with cargo ($(tail -n 1 "$WORK/build.out"))"
else
  fail "build-wasm-image.sh builds the filter with cargo" "$(tail -n 5 "$WORK/build.err")"
  finish
  exit 1
fi
cp "$WASM" "$WORK/build.wasm"
WASM=$WORK/build.wasm
if "$BUILD" --wasm "$WASM" --tls-verify=false --oci-dir "$WORK/layout1" "$REPO:v1" >"$WORK/push1.out" 2>"$WORK/push1.err"; then
  pass "build-wasm-image.sh pushes $REPO:v1"
else
  fail "build-wasm-image.sh pushes" "$(tail -n 5 "$WORK/push1.err")"
  finish
  exit 1
fi
PINNED=$(tail -n 1 "$WORK/push1.out")
DIGEST=${PINNED##*@}
if [[ $PINNED == "$REPO@sha256:"* ]] && [[ $DIGEST =~ ^sha256:[a-f0-9]{64}$ ]]; then
  pass "prints the pinned reference REPO@sha256:<64 hex> ($DIGEST)"
else
  fail "prints the pinned reference" "last line: $PINNED"
fi

# 2. The registry serves that digest under the tag.
remote=$(skopeo inspect --tls-verify=false --format '{{.Digest}}' "docker://$REPO:v1" 2>&1)
if [ "$remote" = "$DIGEST" ]; then pass "the registry's tag v1 resolves to the printed digest"; else fail "tag v1 → digest" "$remote"; fi

# 3. Pull back by digest and compare plugin.wasm with the build, byte for byte.
if skopeo copy --quiet --src-tls-verify=false "docker://$PINNED" "oci:$WORK/pulled:x" >/dev/null 2>"$WORK/pull.err"; then
  pass "pulls back by digest"
else
  fail "pulls back by digest" "$(cat "$WORK/pull.err")"
fi
MANIFEST_BLOB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"].split(":")[1])' "$WORK/pulled/index.json" 2>/dev/null)
MANIFEST=$WORK/pulled/blobs/sha256/$MANIFEST_BLOB
if [ -f "$MANIFEST" ] && [ "sha256:$(sha256sum "$MANIFEST" | cut -d' ' -f1)" = "$DIGEST" ]; then
  pass "the pulled manifest hashes to the pinned digest"
else
  fail "the pulled manifest hashes to the pinned digest" "manifest ${MANIFEST_BLOB:-missing}"
fi
shape=$(python3 - "$MANIFEST" <<'PY' 2>&1
import json, sys
m = json.load(open(sys.argv[1]))
problems = []
if m.get("mediaType") != "application/vnd.oci.image.manifest.v1+json": problems.append(f"mediaType {m.get('mediaType')}")
if m["config"]["mediaType"] != "application/vnd.oci.image.config.v1+json": problems.append("config mediaType")
if len(m["layers"]) != 1: problems.append(f"{len(m['layers'])} layers")
elif m["layers"][0]["mediaType"] != "application/vnd.oci.image.layer.v1.tar+gzip": problems.append("layer mediaType")
else: print(m["layers"][0]["digest"].split(":")[1])
if problems: sys.exit("; ".join(problems))
PY
)
if [[ $shape =~ ^[a-f0-9]{64}$ ]]; then
  pass "manifest: OCI image, one tar+gzip layer (what Istio's fetcher reads)"
  LAYER=$WORK/pulled/blobs/sha256/$shape
else
  fail "manifest shape" "$shape"
  LAYER=/nonexistent
fi
listing=$(tar -tvzf "$LAYER" 2>&1)
if [ "$(tar -tzf "$LAYER" 2>&1)" = plugin.wasm ] && grep -q '^-rw-r--r-- 0/0 .* 1970-01-01 00:00 plugin.wasm$' <<<"$listing"; then
  pass "layer: exactly plugin.wasm at the root, 0644, owner 0/0, mtime 1970-01-01"
else
  fail "layer contents" "$listing"
fi
mkdir -p "$WORK/extracted"
tar -xzf "$LAYER" -C "$WORK/extracted" 2>/dev/null
if cmp -s "$WORK/extracted/plugin.wasm" "$WASM"; then
  pass "plugin.wasm pulled by digest is byte-identical to the cargo build ($(wc -c <"$WASM") bytes)"
else
  fail "plugin.wasm byte-identical to the build" "$(cmp "$WORK/extracted/plugin.wasm" "$WASM" 2>&1)"
fi

# 4. Reproducible: build the image again, and from a copy elsewhere with another mtime and umask.
if again=$("$BUILD" --wasm "$WASM" --tls-verify=false "$REPO:v2" 2>"$WORK/push2.err" | tail -n 1) && [ "${again##*@}" = "$DIGEST" ]; then
  pass "a second image build and push gives the same digest"
else
  fail "a second image build and push gives the same digest" "${again:-} $(tail -n 3 "$WORK/push2.err")"
fi
mkdir -p "$WORK/elsewhere"
cp "$WASM" "$WORK/elsewhere/copy.wasm"
touch -d '2031-05-06 07:08:09' "$WORK/elsewhere/copy.wasm"
copy_digest=$(cd "$WORK/elsewhere" && umask 0077 && "$BUILD" --wasm copy.wasm --no-push 2>/dev/null | tail -n 1)
if [ "$copy_digest" = "$DIGEST" ]; then
  pass "the same .wasm from another path, mtime and umask gives the same digest"
else
  fail "same digest from a copy" "$copy_digest vs $DIGEST"
fi
kept=$WORK/layout1/blobs/sha256/${DIGEST#sha256:}
if [ -f "$kept" ] && grep -qF "\"digest\":\"$DIGEST\"" "$WORK/layout1/index.json"; then
  pass "--oci-dir keeps the layout whose manifest is the pushed one"
else
  fail "--oci-dir layout" "$(find "$WORK/layout1" | head)"
fi

# 5. A different module gives a different digest (the digest really depends on the content).
printf '\0asm\1\0\0\0' >"$WORK/empty.wasm"
other=$("$BUILD" --wasm "$WORK/empty.wasm" --no-push 2>/dev/null | tail -n 1)
if [[ $other =~ ^sha256:[a-f0-9]{64}$ ]] && [ "$other" != "$DIGEST" ]; then
  pass "another module gives another digest"
else
  fail "another module gives another digest" "$other"
fi

# 6. Refusals.
refused() { # refused NAME EXPECTED-TEXT ARGS...
  local name=$1 text=$2 err rc=0
  shift 2
  err=$("$BUILD" "$@" 2>&1 >/dev/null) || rc=$?
  if [ "$rc" -ne 0 ] && grep -qF -- "$text" <<<"$err"; then pass "refuses $name ($text)"; else fail "refuses $name" "exit $rc: $err"; fi
}
refused "a digest reference" "is not REGISTRY/REPOSITORY[:TAG]" --no-build "$REPO@$DIGEST"
refused "no image" "give the image to push" --no-build
refused "an unknown option" "unknown option: --fast" --fast "$REPO:x"
refused "a missing value" "--wasm needs a file" --wasm
refused "a file that is not wasm" "is not a WebAssembly module" --wasm "$WORK/registry.yml" --no-push
refused "an unreachable registry" "pushing to 127.0.0.1:1/maas/x:y failed" --no-build --tls-verify=false 127.0.0.1:1/maas/x:y

finish
