#!/usr/bin/env bash
# Every entry point keeps its run bit, on disk and in git's index: the test suites
# (tests/scripts/*.sh; ./scripts/test.sh fails one that is not executable rather than skip it),
# the commands users run (scripts/*.sh) and cargo's wasm32-wasip1 runner (scripts/wasi-run.mjs).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"
cd "$ROOT" || exit 1

# in_index_executable FILE: git records FILE as 100755, or git does not track it (a new file,
# or no git checkout at all: the on-disk check still applies).
in_index_executable() {
  local mode
  mode=$(git ls-files -s -- "$1" 2>/dev/null | awk '{print $1; exit}')
  [ -z "$mode" ] || [ "$mode" = 100755 ] || {
    echo "git records $1 as $mode: git update-index --chmod=+x $1"
    return 1
  }
}
on_disk_executable() {
  [ -x "$1" ] || {
    echo "$1 is not executable: chmod +x $1"
    return 1
  }
}

entries=(tests/scripts/*.sh scripts/*.sh scripts/wasi-run.mjs)
for f in "${entries[@]}"; do
  [ -e "$f" ] || continue
  check "$f executable" on_disk_executable "$f"
  check "$f executable in git's index" in_index_executable "$f"
done
# The runner is named in .cargo/config.toml: it must exist.
check "cargo's wasm32-wasip1 runner exists" test -f scripts/wasi-run.mjs
finish
