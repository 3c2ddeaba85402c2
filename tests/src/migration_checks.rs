//! Checks the companion's database migrations (companion/migrations/*.sql, applied by sqlx at
//! start). Upgrades and rollbacks depend on two rules:
//!
//! 1. Forward-only: files are named `NNNN_<name>.sql`, numbered 1, 2, 3 … without gaps or
//!    repeats; no down/revert migrations (sqlx's `*.down.sql` / `*.up.sql` pairs); a migration,
//!    once released, is never edited (sqlx stores its checksum and refuses to start when an
//!    applied file changed): every released file must be byte-identical here.
//! 2. Additive-only, so the previous companion release keeps working on the migrated schema for
//!    one release (during a rolling upgrade old and new pods share the database, and a rollback
//!    runs the old binary against the new schema): no DROP, no RENAME, no ALTER … TYPE, no SET NOT
//!    NULL, no ADD COLUMN … NOT NULL without a DEFAULT, no TRUNCATE/DELETE of existing rows. The
//!    first migration (which creates the schema) has nothing earlier to break.

use crate::manifest_checks::Report;
use regex::Regex;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

/// A statement pattern (on the upper-cased, comment- and literal-free text) and why it breaks
/// the previous release.
struct Forbidden {
    pattern: Regex,
    why: &'static str,
}

fn forbidden(pattern: &str, why: &'static str) -> Forbidden {
    Forbidden {
        pattern: Regex::new(pattern).expect("a valid regex"),
        why,
    }
}

static FORBIDDEN: LazyLock<Vec<Forbidden>> = LazyLock::new(|| {
    vec![
        forbidden(r"^DROP\b", "DROP (the previous release may still read it)"),
        forbidden(
            r"\bRENAME\b",
            "RENAME (the previous release uses the old name)",
        ),
        forbidden(
            r"\bALTER\s+(?:COLUMN\s+)?\S+\s+(?:SET\s+DATA\s+)?TYPE\b",
            "ALTER … TYPE (changes what the previous release reads)",
        ),
        forbidden(
            r"\bSET\s+NOT\s+NULL\b",
            "SET NOT NULL (the previous release may insert NULL)",
        ),
        forbidden(
            r"\bDROP\s+(?:COLUMN|CONSTRAINT|DEFAULT)\b",
            "DROP inside ALTER TABLE",
        ),
        forbidden(r"^TRUNCATE\b", "TRUNCATE (data loss on upgrade)"),
        forbidden(r"^DELETE\b", "DELETE of existing rows"),
    ]
});

static BLOCK_COMMENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)/\*.*?\*/").expect("a valid regex"));
static LINE_COMMENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"--[^\n]*").expect("a valid regex"));
static STRING_LITERAL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"'(?:[^']|'')*'").expect("a valid regex"));
static NOT_NULL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\bNOT\s+NULL\b").expect("a valid regex"));
static DEFAULT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\bDEFAULT\b").expect("a valid regex"));
static ADD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\bADD\s+(?:COLUMN\s+)?(?:IF\s+NOT\s+EXISTS\s+)?").expect("a valid regex")
});
static NEXT_ADD: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r",\s*ADD\b").expect("a valid regex"));
static TABLE_CONSTRAINT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(CONSTRAINT|PRIMARY|UNIQUE|CHECK|FOREIGN)\b").expect("a valid regex")
});
static FILE_NAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\d{4})_[a-z0-9_]+\.sql$").expect("a valid regex"));

/// The statements of a migration, comments removed, string literals emptied (they can neither
/// hide a keyword nor make one appear), whitespace collapsed.
pub fn statements(sql: &str) -> Vec<String> {
    let sql = BLOCK_COMMENT.replace_all(sql, " ");
    let sql = LINE_COMMENT.replace_all(&sql, " ");
    let sql = STRING_LITERAL.replace_all(&sql, "''");
    sql.split(';')
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
        .collect()
}

/// Why a statement would break the previous release, if it would.
pub fn check_statement(statement: &str) -> Option<&'static str> {
    let upper = statement.to_uppercase();
    if let Some(f) = FORBIDDEN.iter().find(|f| f.pattern.is_match(&upper)) {
        return Some(f.why);
    }
    // ADD COLUMN … NOT NULL needs a DEFAULT: the previous release inserts rows without the column.
    for add in ADD.find_iter(&upper) {
        let rest = &upper[add.end()..];
        let clause = NEXT_ADD
            .find(rest)
            .map_or(rest, |next| &rest[..next.start()]);
        if NOT_NULL.is_match(clause)
            && !DEFAULT.is_match(clause)
            && !TABLE_CONSTRAINT.is_match(clause)
        {
            return Some(
                "ADD COLUMN … NOT NULL without DEFAULT (the previous release's INSERTs would fail)",
            );
        }
    }
    None
}

/// The `*.sql` files of a directory, by name.
fn sql_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sql"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Every rule over `dir`; with `released`, the last release's migrations must be unchanged.
pub fn check(dir: &Path, released: Option<&Path>) -> Report {
    let mut report = Report::default();
    let files = sql_files(dir);
    if files.is_empty() {
        report.record(
            "migrations found",
            Err(format!("no *.sql under {}", dir.display())),
        );
    }
    naming(&files, &mut report);
    for (i, f) in files.iter().enumerate() {
        let name = file_name(f);
        if i == 0 && name.starts_with("0001_") {
            continue; // creates the schema: nothing earlier to stay compatible with
        }
        let sql = std::fs::read_to_string(f).unwrap_or_default();
        let bad: Vec<String> = statements(&sql)
            .iter()
            .filter_map(|s| {
                let why = check_statement(s)?;
                Some(format!(
                    "{why}: {}",
                    s.chars().take(100).collect::<String>()
                ))
            })
            .collect();
        let verdict = if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        };
        report.record(
            &format!("{name}: additive only (the previous release keeps working on it)"),
            verdict,
        );
    }
    if let Some(released) = released {
        unchanged(dir, released, &mut report);
    }
    report
}

/// Named NNNN_<name>.sql (no .up/.down), numbered 1..N.
fn naming(files: &[PathBuf], report: &mut Report) {
    let mut names_ok = true;
    let mut numbers = Vec::new();
    for f in files {
        let name = file_name(f);
        match FILE_NAME
            .captures(&name)
            .and_then(|c| c[1].parse::<u32>().ok())
        {
            Some(n) => numbers.push(n),
            None => {
                names_ok = false;
                report.record(
                    &format!("{name}: named NNNN_<name>.sql, no .up/.down (forward-only)"),
                    Err("sqlx would read a reversible or unordered migration".to_string()),
                );
            }
        }
    }
    if names_ok && !files.is_empty() {
        report.record(
            "migrations named NNNN_<name>.sql (no down/revert migrations)",
            Ok(()),
        );
    }
    if !numbers.is_empty() {
        numbers.sort_unstable();
        let want: Vec<u32> = (1..).take(numbers.len()).collect();
        let verdict = if numbers == want {
            Ok(())
        } else {
            Err(format!("numbers {numbers:?}"))
        };
        report.record("migrations numbered 1..N without gaps or repeats", verdict);
    }
}

/// Released files are never edited nor removed.
fn unchanged(dir: &Path, released: &Path, report: &mut Report) {
    let old = sql_files(released);
    let changed: Vec<String> = old
        .iter()
        .filter(|r| std::fs::read(dir.join(file_name(r))).ok() != std::fs::read(r).ok())
        .map(|r| format!("'{}'", file_name(r)))
        .collect();
    let verdict = if changed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "edited or removed after release: [{}] (sqlx refuses to start on a changed checksum; \
             add a new migration instead)",
            changed.join(", ")
        ))
    };
    report.record(
        &format!(
            "released migrations unchanged ({} in the last release)",
            old.len()
        ),
        verdict,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_drop_comments_and_literals() {
        let sql =
            "-- DROP TABLE x;\nCREATE TABLE a (b TEXT DEFAULT 'DROP; it');\n/* RENAME */ SELECT 1;";
        assert_eq!(
            statements(sql),
            vec!["CREATE TABLE a (b TEXT DEFAULT '')", "SELECT 1"]
        );
    }

    #[test]
    fn each_rule_names_what_breaks() {
        let cases = [
            ("ALTER TABLE t DROP COLUMN c", "DROP inside ALTER TABLE"),
            ("DROP TABLE t", "DROP (the previous release"),
            ("ALTER TABLE t RENAME COLUMN a TO b", "RENAME"),
            (
                "ALTER TABLE t ALTER COLUMN c TYPE INTEGER USING 0",
                "ALTER … TYPE",
            ),
            ("ALTER TABLE t ALTER COLUMN c SET NOT NULL", "SET NOT NULL"),
            (
                "ALTER TABLE t ADD COLUMN c TEXT NOT NULL",
                "NOT NULL without DEFAULT",
            ),
            ("TRUNCATE t", "TRUNCATE"),
            ("delete from t", "DELETE"),
        ];
        for (sql, why) in cases {
            let got = check_statement(sql).unwrap_or("accepted");
            assert!(got.contains(why), "{sql}: {got}");
        }
    }

    #[test]
    fn additive_statements_pass() {
        for sql in [
            "ALTER TABLE t ADD COLUMN IF NOT EXISTS labels TEXT[]",
            "ALTER TABLE t ADD COLUMN scope TEXT NOT NULL DEFAULT 'all'",
            "ALTER TABLE t ADD CONSTRAINT c CHECK (x IS NOT NULL)",
            "ALTER TABLE t ADD COLUMN a TEXT, ADD COLUMN b INT NOT NULL DEFAULT 0",
            "CREATE INDEX IF NOT EXISTS i ON t (c)",
        ] {
            assert_eq!(check_statement(sql), None, "{sql}");
        }
        assert!(
            check_statement(
                "ALTER TABLE t ADD COLUMN a INT NOT NULL DEFAULT 0, ADD COLUMN b INT NOT NULL"
            )
            .is_some()
        );
    }
}
