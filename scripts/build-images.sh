#!/usr/bin/env bash
# Builds and pushes both MaaS Gateway images — the filter (REPO/maas-filter:TAG, for the
# EnvoyFilter maas-filter) and the companion (REPO/maas-companion:TAG) — without a container
# engine, and prints both pinned references last, ready for scripts/deploy.sh:
#   MAAS_WASM_IMAGE=REPO/maas-filter@sha256:...
#   MAAS_API_IMAGE=REPO/maas-companion@sha256:...
# Both images are assembled byte for byte by `cargo xtask images` (xtask/): the same sources give
# the same digests. Usage: scripts/build-images.sh [options] REGISTRY/NAMESPACE TAG (--help).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec cargo run --manifest-path "$ROOT/Cargo.toml" -p xtask -- images "$@"
