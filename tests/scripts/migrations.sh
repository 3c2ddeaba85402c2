#!/usr/bin/env bash
# The companion's migrations stay forward-only and additive, so upgrades and rollbacks are safe:
# the previous companion release keeps working on the migrated schema for one release (rolling
# upgrades run old and new pods on one database; a rollback runs the old binary on the new
# schema). scripts/lib/deploy-migration-checks.py checks companion/migrations/ against the last
# commit's copy (released files are never edited); broken copies prove each rule can fail.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/deploy-test-env.sh
. "$ROOT/scripts/lib/deploy-test-env.sh"

CHECKS=$ROOT/scripts/lib/deploy-migration-checks.py
MIGRATIONS=$ROOT/companion/migrations
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# run_checks NAME ARGS...: one pass/fail per line the checker prints.
run_checks() {
  local name=$1 out line rc=0
  shift
  out=$(python3 "$CHECKS" "$@" 2>&1) || rc=$?
  while IFS= read -r line; do
    case $line in
      PASS\ *) pass "$name: ${line#PASS }" ;;
      FAIL\ *) fail "$name: ${line#FAIL }" ;;
    esac
  done <<<"$out"
  if [ $rc -ne 0 ] && ! grep -q '^FAIL ' <<<"$out"; then fail "$name: checker crashed" "$out"; fi
}

released=()
mkdir -p "$WORK/released"
if git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
  git -C "$ROOT" archive HEAD companion/migrations 2>/dev/null | tar -x -C "$WORK/released" 2>/dev/null
  if [ -d "$WORK/released/companion/migrations" ]; then
    released=(--released-dir "$WORK/released/companion/migrations")
  fi
fi
[ ${#released[@]} -gt 0 ] || echo "# no git history: the released-files check is skipped"
run_checks "companion/migrations" "${released[@]}" "$MIGRATIONS"

# Broken copies: each must be refused, naming the rule.
expect_refused() { # expect_refused NAME EXPECTED-TEXT SQL-FILE-NAME SQL
  local name=$1 text=$2 file=$3 sql=$4 out rc=0
  rm -rf "$WORK/broken"
  cp -r "$MIGRATIONS" "$WORK/broken"
  [ -n "$file" ] && printf '%s\n' "$sql" >"$WORK/broken/$file"
  out=$(python3 "$CHECKS" --released-dir "$MIGRATIONS" "$WORK/broken" 2>&1) || rc=$?
  if [ "$rc" -ne 0 ] && grep -q "^FAIL .*$text" <<<"$out"; then
    pass "refuses $name ($text)"
  else
    fail "refuses $name" "expected a FAIL naming '$text', got: $(grep '^FAIL' <<<"$out" | head -3)"
  fi
}
next=$(printf '%04d' $(($(find "$MIGRATIONS" -name '*.sql' | wc -l) + 1)))
expect_refused "a dropped column" "DROP inside ALTER TABLE" "${next}_drop.sql" "ALTER TABLE api_keys DROP COLUMN description;"
expect_refused "a dropped table" "DROP (the previous release" "${next}_drop_table.sql" "DROP TABLE api_keys;"
expect_refused "a renamed column" "RENAME" "${next}_rename.sql" "ALTER TABLE api_keys RENAME COLUMN name TO title;"
expect_refused "a changed column type" "ALTER … TYPE" "${next}_type.sql" "ALTER TABLE api_keys ALTER COLUMN tier TYPE INTEGER USING 0;"
expect_refused "a new NOT NULL column without default" "NOT NULL without DEFAULT" "${next}_nn.sql" "ALTER TABLE api_keys ADD COLUMN owner TEXT NOT NULL;"
expect_refused "SET NOT NULL" "SET NOT NULL" "${next}_setnn.sql" "ALTER TABLE api_keys ALTER COLUMN description SET NOT NULL;"
expect_refused "a down migration" "no .up/.down" "${next}_add.down.sql" "ALTER TABLE api_keys DROP COLUMN x;"
expect_refused "a numbering gap" "without gaps" "$(printf '%04d' $((10#$next + 1)))_gap.sql" "CREATE INDEX i ON api_keys (name);"
expect_refused "an edited released migration" "edited or removed after release" "$(basename "$(find "$MIGRATIONS" -name '0001_*.sql' | head -n1)")" \
  "CREATE TABLE api_keys (id UUID PRIMARY KEY);"
# ... and accepts what an additive change looks like.
rm -rf "$WORK/good"
cp -r "$MIGRATIONS" "$WORK/good"
cat >"$WORK/good/${next}_additive.sql" <<'SQL'
-- New optional data: the previous release neither reads nor writes it.
ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS labels TEXT[];
ALTER TABLE api_keys ADD COLUMN scope TEXT NOT NULL DEFAULT 'all';
CREATE INDEX IF NOT EXISTS idx_api_keys_tier ON api_keys (tier);
COMMENT ON COLUMN api_keys.scope IS 'do not DROP or RENAME this';
SQL
if out=$(python3 "$CHECKS" --released-dir "$MIGRATIONS" "$WORK/good" 2>&1); then
  pass "accepts an additive migration (nullable column, NOT NULL with DEFAULT, index)"
else
  fail "accepts an additive migration" "$(grep '^FAIL' <<<"$out")"
fi

finish
