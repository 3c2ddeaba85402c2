#!/usr/bin/env bash
# Builds the MaaS filter (release .wasm) into an OCI image that Istio's agent pulls for a Wasm
# module (a WasmPlugin's url, or the oci:// uri of the EnvoyFilter maas-filter's extension
# config) — the equivalent of `FROM scratch` + `COPY plugin.wasm /` — and pushes it with skopeo.
# The image is assembled byte for byte by `cargo xtask wasm-image` (xtask/src/wasm.rs: a tar in
# GNU tar's bytes with fixed mtime, owner and mode, gzip without name or time, canonical JSON),
# so the same .wasm always gives the same digest, on any machine. Prints the digest to pin:
# IMAGE@sha256:... (--help for the options).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec cargo run --manifest-path "$ROOT/Cargo.toml" -p xtask -- wasm-image "$@"
