#!/usr/bin/env bash
# Benchmark: the filter against bare Envoy (and optionally LiteLLM), side by side (issue 6).
#
#   ./scripts/bench.sh                 full run (3 rounds × 10 s per variant and concurrency, the
#                                      host-call prices ~3 min and wasm-floor ~1 min of it), ~18 min
#   ./scripts/bench.sh --quick         quick check (2 s runs, small key counts), ~3 min
#   ./scripts/bench.sh --peers         also the peers doing the same job, as ratios to bare Envoy in
#                                      the same rounds: LiteLLM proxy (installed from PyPI into
#                                      .local/bench-venv); Kuadrant's wasm-shim + Limitador are not
#                                      published where this machine downloads from (the report says so)
#   ./scripts/bench.sh --litellm       the same as --peers
#   ./scripts/bench.sh --only envoy,filter-cached   a subset of the variants
#   ./scripts/bench.sh --no-profile    skip the perf profile of Envoy
#   ./scripts/bench.sh --only hostcalls   price every kind of host call (µs per call) and bill the
#                                      filter's calls (printed only); `hostcalls` with other variants
#                                      (`--only envoy,wasm-noop,wasm-floor,filter-cached,hostcalls`)
#                                      writes the prices and the bill into the report, as the full run
#   ./scripts/bench.sh --only instructions  Envoy's instructions per request under valgrind
#                                      (envoy, wasm-noop, wasm-floor, the filter, compared builds;
#                                      deterministic; ~7 min; printed only; part of the full run;
#                                      BENCH_FLOOR_PARTS=1 adds the floor without each of its parts)
#   ./scripts/bench.sh --only two-replica global limits across two gateway replicas (two Envoys,
#                                      two companions, one Redis): on vs off, Redis round trips per
#                                      subject per replica per second (~2.5 min; part of the full run);
#                                      replaces only its own section of docs/benchmarks.md
#
# Environment: BENCH_SECONDS, BENCH_ROUNDS, BENCH_CONCURRENCY (1,32), BENCH_CACHED_KEYS
# (10000,100000), BENCH_TTFB_SAMPLES, BENCH_OUT (docs/benchmarks.md; empty = do not write),
# BENCH_JUNK_TOKENS, BENCH_JUNK_ROUNDS, BENCH_JUNK_CACHE_ENTRIES (the junk-bound variant),
# BENCH_HOSTCALL_N (calls per request in the hostcalls mode, default 50), BENCH_HOSTCALL_SECONDS
# (per price run; default BENCH_SECONDS, at most 4), BENCH_HOSTCALL_KINDS (a subset of the priced
# kinds), BENCH_COMPARE_WASM (`label=path,…`: other builds of the filter as variants
# `filter-cached:<label>` in the same run), BENCH_TWO_REPLICA_IDLE_S (seconds with no traffic before each
# two-replica run: the subjects are released and dropped for idleness first; default 0),
# BENCH_OBSERVED (filter-observed: `all` by default, `events` or `traces` to measure one alone).
# The filter's host calls and allocations per request come from its budget tests (native, debug:
# `cargo test -p maas-filter --lib per_request_stay_within_budget` with MAAS_HOST_CALLS_OUT),
# run here first; maas-bench renders them (BENCH_HOST_CALLS names the file).
# Installs what it needs (wrk, taskset, Envoy, PostgreSQL, Redis, the wasm target), builds the filter
# (release wasm) and the companion and benchmark harness (release, without LTO), then runs
# target/release/maas-bench, which starts its own stack on loopback, prints the table and writes
# docs/benchmarks.md. Needs at least 2 CPUs (Envoy pinned to CPU 0, wrk to CPU 1).
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cd "$ROOT"

want_litellm=""
for a in "$@"; do
  case "$a" in
    --litellm | --peers) want_litellm=1 ;;
    -h | --help)
      awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
      exit 0
      ;;
  esac
done

[ "$(nproc)" -ge 2 ] || die "the benchmark pins Envoy and wrk to different CPUs: needs ≥ 2 cores (nproc = $(nproc))"
command -v wrk >/dev/null 2>&1 || apt_install wrk
command -v taskset >/dev/null 2>&1 || apt_install util-linux
# perf (profile of Envoy's CPU per request); optional: the benchmark skips it when perf cannot run.
command -v perf >/dev/null 2>&1 || apt_install linux-perf || log "linux-perf not installed: no profile"
ensure_all

if [ -n "$want_litellm" ] && [ ! -x "$ROOT/.local/bench-venv/bin/litellm" ]; then
  command -v python3 >/dev/null 2>&1 || apt_install python3
  mkdir -p "$ROOT/.local"
  if [ ! -x "$ROOT/.local/bench-venv/bin/pip" ]; then
    rm -rf "$ROOT/.local/bench-venv"
    python3 -m venv "$ROOT/.local/bench-venv" 2>/dev/null || {
      apt_install python3-venv
      rm -rf "$ROOT/.local/bench-venv"
      python3 -m venv "$ROOT/.local/bench-venv"
    }
  fi
  log "installing LiteLLM proxy (PyPI) into .local/bench-venv …"
  "$ROOT/.local/bench-venv/bin/pip" install -q --disable-pip-version-check 'litellm[proxy]'
fi

log "building (release: filter wasm, companion, maas-bench) …"
cargo build -q -p maas-filter --release --target wasm32-wasip1
# The trivial wasm filter of the wasm-noop variant (its own workspace, in tests/bench/noop-filter).
(cd tests/bench/noop-filter && cargo build -q --release --target wasm32-wasip1 --target-dir "$(target_dir)/bench-noop")
# The filter of the hostcalls mode (N host calls of one kind per request: their prices).
(cd tests/bench/hostcall-filter && cargo build -q --release --target wasm32-wasip1 --target-dir "$(target_dir)/bench-hostcall")
# The simulator runs inside maas-bench and must not be the bottleneck, nor the companion for
# filter-miss: both in release. LTO off keeps the build short; it barely changes these figures.
CARGO_PROFILE_RELEASE_LTO=off CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
  cargo build -q --release -p maas-companion -p maas-e2e --bin maas-companion --bin maas-bench

TARGET="$(target_dir)"
export MAAS_COMPANION_BIN="$TARGET/release/maas-companion"
export BENCH_NOOP_WASM="${BENCH_NOOP_WASM:-$TARGET/bench-noop/wasm32-wasip1/release/maas_bench_noop_filter.wasm}"
export BENCH_HOSTCALL_WASM="${BENCH_HOSTCALL_WASM:-$TARGET/bench-hostcall/wasm32-wasip1/release/maas_bench_hostcall_filter.wasm}"
# The filter's host calls and allocations per request, from its recording host (the figures are
# written before the tests' asserts: a budget exceeded still reports what was measured).
export BENCH_HOST_CALLS="$TARGET/bench-host-calls.json"
rm -f "$BENCH_HOST_CALLS"
log "counting the filter's host calls per request (cargo test -p maas-filter --lib per_request_stay_within_budget) …"
MAAS_HOST_CALLS_OUT="$BENCH_HOST_CALLS" cargo test -q -p maas-filter --lib per_request_stay_within_budget >/dev/null 2>&1 ||
  log "warning: the filter's budget tests failed (the report shows what they measured, if anything)"
# The filter's own instructions per cached JSON request, natively (valgrind callgrind, the host
# calls excluded): a count that does not move with the machine's load, unlike Envoy's CPU time.
export BENCH_INSTRUCTIONS="$TARGET/bench-instructions.json"
rm -f "$BENCH_INSTRUCTIONS"
command -v valgrind >/dev/null 2>&1 || apt_install valgrind || log "valgrind not installed: no instruction count"
if command -v valgrind >/dev/null 2>&1; then
  log "counting the filter's instructions per cached request and stream (valgrind --tool=callgrind) …"
  # Symbols kept (callgrind toggles on function names); LTO off keeps the build short.
  test_bin="$(CARGO_PROFILE_RELEASE_STRIP=false CARGO_PROFILE_RELEASE_LTO=off \
    cargo test -q -p maas-filter --release --lib --no-run --message-format=json 2>/dev/null |
    grep '"name":"maas_filter"' | grep '"test":true' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)"
  # $1: the requests; $2: the ignored test; $3: the function whose calls are counted.
  collected() {
    MAAS_NATIVE_COST_N="$1" valgrind --tool=callgrind --callgrind-out-file=/dev/null \
      --collect-atstart=no --toggle-collect="*$3*" --toggle-collect='*put_chunk*' \
      --toggle-collect='*RecordingHost as maas_filter::host::Host>::*' \
      --toggle-collect='*RecordingHost as maas_filter::store::SharedStore>::*' \
      "$test_bin" --ignored "$2" --exact --test-threads=1 2>&1 |
      sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
  }
  # Two runs' difference ÷ the requests between them: the setup cancels out.
  per_request() {
    local few many
    few="$(collected 200 "$1" "$2")" && many="$(collected 1200 "$1" "$2")" &&
      [ -n "$few" ] && [ -n "$many" ] && echo $(((many - few) / 1000))
  }
  if [ -n "$test_bin" ] &&
    json="$(per_request request::tests::respond::native_cost_of_a_cached_request cached_request_callbacks)" &&
    stream="$(per_request request::tests::respond::native_cost_of_a_cached_stream cached_stream_callbacks)" &&
    translated="$(per_request request::tests::translate::native_cost_of_a_translated_stream translated_stream_callbacks)" &&
    messages="$(per_request request::tests::translate::native_cost_of_a_messages_stream messages_stream_callbacks)"; then
    # Bedrock: a signed JSON request and a signed, translated ConverseStream (issue 29).
    signed=""
    if signed_json="$(per_request request::tests::bedrock::native_cost_of_a_signed_json_request signed_request_callbacks)" &&
      signed_stream="$(per_request request::tests::bedrock::native_cost_of_a_converse_stream signed_request_callbacks)" &&
      [ -n "$signed_json" ] && [ -n "$signed_stream" ]; then
      signed=", \"bedrock_signed_json\": $signed_json, \"bedrock_signed_stream\": $signed_stream"
    else
      log "warning: the Bedrock instruction count failed (the report shows none)"
    fi
    # Gemini on Vertex AI: a translated stream (issue 29).
    if gemini_stream="$(per_request request::tests::gemini::native_cost_of_a_gemini_stream gemini_stream_callbacks)" &&
      [ -n "$gemini_stream" ]; then
      signed="$signed, \"gemini_stream\": $gemini_stream"
    else
      log "warning: the Gemini instruction count failed (the report shows none)"
    fi
    echo "{\"cached_json\": $json, \"cached_stream\": $stream, \"translated_stream\": $translated, \"messages_stream\": $messages$signed}" >"$BENCH_INSTRUCTIONS"
  else
    log "warning: the instruction count failed (the report shows none)"
  fi
fi
# MAAS_WASM may name another build of the filter (e.g. an older one, to compare).
export MAAS_WASM="${MAAS_WASM:-$TARGET/wasm32-wasip1/release/maas_filter.wasm}"
export BENCH_COMMAND="${BENCH_COMMAND:-./scripts/bench.sh${*:+ $*}}"
exec "$TARGET/release/maas-bench" "$@"
