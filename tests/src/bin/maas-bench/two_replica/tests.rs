use super::*;

const FILE: &str = "# Benchmarks\n\n## Targets (issue 6)\n\n| a | b |\n\n## How to run, and how to read it\n\nnotes\n";

#[test]
fn splice_inserts_the_section_before_how_to_run_when_absent() {
    let section = format!("{TWO_REPLICA_HEADING}\n\n| x |\n");
    let out = splice_section(FILE, &section);
    assert_eq!(
        out,
        format!(
            "# Benchmarks\n\n## Targets (issue 6)\n\n| a | b |\n\n{TWO_REPLICA_HEADING}\n\n| x |\n\n## How to run, and how to read it\n\nnotes\n"
        )
    );
}

#[test]
fn splice_replaces_only_the_two_replica_section() {
    let first = splice_section(FILE, &format!("{TWO_REPLICA_HEADING}\n\nold figures\n"));
    let second = splice_section(&first, &format!("{TWO_REPLICA_HEADING}\n\nnew figures\n"));
    assert!(second.contains("new figures"), "{second}");
    assert!(!second.contains("old figures"), "{second}");
    // Everything around it is as before, and the section is there once.
    assert_eq!(second.replace("new figures", "old figures"), first);
    assert_eq!(second.matches(TWO_REPLICA_HEADING).count(), 1);
}

#[test]
fn splice_replaces_a_last_section_and_appends_when_no_notes() {
    let file = "# Benchmarks\n\n## Targets\n\nt\n";
    let first = splice_section(file, &format!("{TWO_REPLICA_HEADING}\n\nA\n"));
    assert_eq!(
        first,
        format!("# Benchmarks\n\n## Targets\n\nt\n\n{TWO_REPLICA_HEADING}\n\nA\n")
    );
    let second = splice_section(&first, &format!("{TWO_REPLICA_HEADING}\n\nB\n"));
    assert_eq!(second, first.replace("\nA\n", "\nB\n"));
}

#[test]
fn envoy_stats_drop_the_wasmcustom_prefix() {
    let s = envoy_stats(
        "wasmcustom.maas_lease_callouts_total: 12\nwasmcustom.maas_lease_fallback: 0\nbad line\n",
    );
    assert_eq!(
        s,
        vec![
            ("maas_lease_callouts_total".to_string(), 12.0),
            ("maas_lease_fallback".to_string(), 0.0)
        ]
    );
}
