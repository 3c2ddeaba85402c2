#!/usr/bin/env python3
"""Checks the companion's database migrations (companion/migrations/*.sql, applied by sqlx at start).

Upgrades and rollbacks depend on two rules:
1. Forward-only: files are named NNNN_<name>.sql, numbered 1, 2, 3 … without gaps or repeats; no
   down/revert migrations (sqlx's *.down.sql / *.up.sql pairs); a migration, once released, is
   never edited (sqlx stores its checksum and refuses to start when an applied file changed):
   with --released-dir, every file there must be byte-identical here.
2. Additive-only, so the previous companion release keeps working on the migrated schema for one
   release (during a rolling upgrade old and new pods share the database, and a rollback runs the
   old binary against the new schema): no DROP, no RENAME, no ALTER … TYPE, no SET NOT NULL, no
   ADD COLUMN … NOT NULL without a DEFAULT, no TRUNCATE/DELETE/UPDATE of existing rows. The first
   migration (which creates the schema) is exempt from nothing but has nothing to break.

Prints `PASS <check>` / `FAIL <check>: <why>` lines; exits 1 if anything failed.
Usage: deploy-migration-checks.py [--released-dir DIR] MIGRATIONS_DIR
"""

import argparse
import pathlib
import re
import sys

results = []


def record(name, ok, why=""):
    results.append((name, ok, why))


def strip_sql_comments(sql):
    sql = re.sub(r"/\*.*?\*/", " ", sql, flags=re.S)
    sql = re.sub(r"--[^\n]*", " ", sql)
    # String literals cannot hide a keyword from us, nor make one appear.
    return re.sub(r"'(?:[^']|'')*'", "''", sql)


def statements(sql):
    return [" ".join(s.split()) for s in strip_sql_comments(sql).split(";") if s.strip()]


FORBIDDEN = [
    (r"^DROP\b", "DROP (the previous release may still read it)"),
    (r"\bRENAME\b", "RENAME (the previous release uses the old name)"),
    (r"\bALTER\s+(?:COLUMN\s+)?\S+\s+(?:SET\s+DATA\s+)?TYPE\b", "ALTER … TYPE (changes what the previous release reads)"),
    (r"\bSET\s+NOT\s+NULL\b", "SET NOT NULL (the previous release may insert NULL)"),
    (r"\bDROP\s+(?:COLUMN|CONSTRAINT|DEFAULT)\b", "DROP inside ALTER TABLE"),
    (r"^TRUNCATE\b", "TRUNCATE (data loss on upgrade)"),
    (r"^DELETE\b", "DELETE of existing rows"),
]


def check_statement(stmt):
    upper = stmt.upper()
    for pattern, why in FORBIDDEN:
        if re.search(pattern, upper):
            return why
    # ADD COLUMN … NOT NULL needs a DEFAULT: the previous release inserts rows without the column.
    for add in re.findall(r"\bADD\s+(?:COLUMN\s+)?(?:IF\s+NOT\s+EXISTS\s+)?(.*?)(?=,\s*ADD\b|$)", upper):
        if re.search(r"\bNOT\s+NULL\b", add) and not re.search(r"\bDEFAULT\b", add) and \
                not re.match(r"(CONSTRAINT|PRIMARY|UNIQUE|CHECK|FOREIGN)\b", add):
            return "ADD COLUMN … NOT NULL without DEFAULT (the previous release's INSERTs would fail)"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--released-dir", help="the migrations of the last release, to prove none was edited")
    ap.add_argument("dir")
    args = ap.parse_args()
    d = pathlib.Path(args.dir)
    files = sorted(d.glob("*.sql"))
    if not files:
        record("migrations found", False, f"no *.sql under {d}")
    names_ok, numbers = True, []
    for f in files:
        m = re.fullmatch(r"(\d{4})_[a-z0-9_]+\.sql", f.name)
        if not m:
            names_ok = False
            record(f"{f.name}: named NNNN_<name>.sql, no .up/.down (forward-only)", False,
                   "sqlx would read a reversible or unordered migration")
            continue
        numbers.append(int(m.group(1)))
    if names_ok and files:
        record("migrations named NNNN_<name>.sql (no down/revert migrations)", True)
    if numbers:
        want = list(range(1, len(numbers) + 1))
        record("migrations numbered 1..N without gaps or repeats", sorted(numbers) == want,
               f"numbers {sorted(numbers)}")
    for i, f in enumerate(files):
        if i == 0 and f.name.startswith("0001_"):
            continue  # creates the schema: nothing earlier to stay compatible with
        bad = [(s, why) for s in statements(f.read_text()) if (why := check_statement(s))]
        record(f"{f.name}: additive only (the previous release keeps working on it)", not bad,
               "; ".join(f"{why}: {s[:100]}" for s, why in bad))
    if args.released_dir:
        released = sorted(pathlib.Path(args.released_dir).glob("*.sql"))
        changed = [r.name for r in released
                   if not (d / r.name).exists() or (d / r.name).read_bytes() != r.read_bytes()]
        record(f"released migrations unchanged ({len(released)} in the last release)", not changed,
               f"edited or removed after release: {changed} (sqlx refuses to start on a changed checksum; add a new migration instead)")
    failed = 0
    for name, ok, why in results:
        print(f"PASS {name}" if ok else f"FAIL {name}: {why}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
