#!/usr/bin/env bash
# Runs every test: unit tests, the companion's tests against a real (throwaway) PostgreSQL, the
# end-to-end tests through real Envoy with the real filter (one test binary; each of its modules
# starts its own local stack, stopped once the module's tests are done), the filter's and types'
# unit tests again for wasm32-wasip1 (under Node's WASI), then every suite in tests/scripts/ (one
# that is not executable fails). Installs what is missing.
# Extra arguments go to `cargo test` (e.g. ./scripts/test.sh -p maas-e2e).
set -euo pipefail
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

ensure_all
ensure_browser
build_all
# The web UI: built once here (tests/tests/e2e/ui_browser.rs builds it too when run alone).
build_ui

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Throwaway PostgreSQL for the companion's tests (trust auth, 127.0.0.1, a free port).
PG_DIR="$(mktemp -d /tmp/maas-test-pg.XXXXXX)"
PG_PORT="$(free_port)"
chmod 755 "$PG_DIR"
run_pg() {
  if [ "$(id -u)" -eq 0 ]; then
    # initdb and postgres refuse to run as root.
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}
stop_pg() {
  run_pg "$MAAS_PG_BIN_DIR/pg_ctl" -D "$PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$PG_DIR"
}
trap stop_pg EXIT
trap 'exit 130' INT TERM
if [ "$(id -u)" -eq 0 ]; then
  chown postgres: "$PG_DIR"
fi
run_pg "$MAAS_PG_BIN_DIR/initdb" -D "$PG_DIR/data" -U postgres --auth=trust -E UTF8 --no-sync --locale=C >"$PG_DIR/initdb.log" 2>&1 ||
  { cat "$PG_DIR/initdb.log" >&2; die "initdb failed"; }
run_pg "$MAAS_PG_BIN_DIR/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/postgres.log" -w \
  -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300" \
  start >/dev/null || { cat "$PG_DIR/postgres.log" >&2; die "PostgreSQL did not start"; }
export MAAS_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"

# The manifest tests (the filter's manifest_plugin_config, maas-e2e's deploy_checks) render the
# kustomizations with `kubectl kustomize` (v5+).
if KUBECTL="$(bash -c '. "$1/scripts/lib/deploy-test-env.sh" && ensure_kubectl >/dev/null && printf "%s" "$KUBECTL"' _ "$ROOT")"; then
  export KUBECTL
else
  log "warning: no kubectl with kustomize v5; the manifest tests will say what is missing"
fi

status=0
# Lints are part of the tests: CI fails on unformatted code or any clippy warning.
"$ROOT/scripts/lint.sh" || status=1
log "cargo test --workspace …"
(cd "$ROOT" && cargo test --workspace --no-fail-fast "$@") || status=1
# The same unit tests compiled for the filter's target (32-bit usize, the wasm allocator, the
# serde paths Envoy runs), run under Node's WASI: .cargo/config.toml names scripts/wasi-run.mjs.
log "cargo test (wasm32-wasip1 under node:wasi: filter, types) …"
# The test modules start with 256 MiB of linear memory (wasi-libc's malloc uses it before it
# grows the memory): Node 20's V8 can crash (SIGSEGV in the GC's stack walk) when a garbage
# collection runs inside `memory.grow` called from wasm, as the large SSE tests' growth made it
# do in about one run in three. Only these test binaries are linked so; the filter is not.
# This variable replaces .cargo/config.toml's rustflags: the filter's SIMD flag is repeated.
(cd "$ROOT" && CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="-C target-feature=+simd128 -C link-arg=--initial-memory=268435456" \
  cargo test -p maas-filter -p maas-types --target wasm32-wasip1 --lib --no-fail-fast) ||
  { log "FAILED: unit tests on wasm32-wasip1"; status=1; }

passed=0
failed=0
for suite in "$ROOT"/tests/scripts/*.sh; do
  # A suite that lost its run bit fails (tests/scripts/executable-bits.sh says which): skipping
  # it would hide its tests.
  if [ ! -x "$suite" ]; then
    failed=$((failed + 1))
    log "FAILED: ${suite#"$ROOT"/} is not executable (chmod +x it)"
    continue
  fi
  log "suite ${suite#"$ROOT"/} …"
  if "$suite"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    log "FAILED: ${suite#"$ROOT"/}"
  fi
done
echo "script suites: $passed passed, $failed failed"
if [ "$status" -ne 0 ]; then
  log "lints or cargo test failed"
fi
if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ]; then
  exit 1
fi
