#!/usr/bin/env bash
# Every shell script of the project (scripts/**, tests/scripts/*) passes shellcheck.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"

if ! ensure_apt_tool shellcheck shellcheck; then
  fail "shellcheck installed" "apt-get install shellcheck"
  finish
  exit 1
fi
cd "$ROOT" || exit 1
scripts=()
while IFS= read -r -d '' f; do scripts+=("$f"); done < <(
  find scripts tests/scripts -type f \( -name '*.sh' -o -perm -u+x \) ! -name '*.py' -print0 2>/dev/null | sort -z
)
for f in "${scripts[@]}"; do
  # Only shell scripts: a .sh name, or a shell shebang on an executable.
  case $f in *.sh) ;; *) head -n1 "$f" | grep -Eq '^#!.*\b(ba)?sh\b' || continue ;; esac
  check "shellcheck $f" shellcheck -x -P SCRIPTDIR "$f"
done
if [ ${#scripts[@]} -eq 0 ]; then fail "scripts found" "none under scripts/ or tests/scripts/"; fi
finish
