#!/usr/bin/env bash
# Builds the companion (maas-companion) as a static binary (x86_64-unknown-linux-musl) and packs it
# into an OCI image without a container engine — the equivalent of `FROM scratch` + the binary +
# /etc/passwd + a CA bundle + the web UI — then pushes it with skopeo. The image is assembled byte
# for byte by `cargo xtask companion-image` (xtask/src/companion.rs: a tar with fixed mtime,
# owners and modes, gzip without name or time, canonical JSON): the same binary, CA bundle and UI
# always give the same digest. Prints the digest to pin: IMAGE@sha256:... (--help for the
# options; it installs the musl target, musl-tools and ca-certificates when missing).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec cargo run --manifest-path "$ROOT/Cargo.toml" -p xtask -- companion-image "$@"
