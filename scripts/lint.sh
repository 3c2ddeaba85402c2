#!/usr/bin/env bash
# The lints CI enforces (./scripts/test.sh runs this first): unformatted code or any clippy
# warning fails, natively for the whole workspace and for the filter's wasm32 target, where the
# no-unwrap/expect/panic/indexing lints guard the VM (a panic traps every stream of a worker).
set -euo pipefail
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
ensure_wasm_target
cd "$ROOT"
status=0
log "cargo fmt --check …"
cargo fmt --all --check || { log "FAILED: cargo fmt --check (run cargo fmt)"; status=1; }
log "cargo clippy (native, all targets) …"
cargo clippy -q --workspace --all-targets -- -D warnings || { log "FAILED: clippy (native)"; status=1; }
log "cargo clippy (wasm32-wasip1: filter, types) …"
cargo clippy -q -p maas-filter -p maas-types --target wasm32-wasip1 -- -D warnings ||
  { log "FAILED: clippy (wasm32-wasip1)"; status=1; }
exit "$status"
