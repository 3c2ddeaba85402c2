use super::*;

/// What the filter's budget tests write (`MAAS_HOST_CALLS_OUT`), abridged.
const COUNTS: &str = r#"{
  "host_calls": [
    {"variant": "cached JSON", "total": 6, "by_kind": {"clock": 3, "shared set (CAS)": 2, "request header map read": 1}},
    {"variant": "miss JSON", "total": 5, "by_kind": {"clock": 4, "dispatch": 1}}
  ],
  "allocations": [{"variant": "cached JSON", "count": 91, "bytes": 4475, "per_callback": [32, 22, 14, 23, 0]}]
}"#;

fn prices() -> Prices {
    // N = 10: clock 0.1 µs, shared get 0.5, get + CAS set 0.7 (CAS set alone 0.2); header
    // map not measured.
    Prices {
        n: 10,
        concurrency: 32,
        seconds: 4,
        rounds: 3,
        rows: [
            ("none", 30.0),
            ("clock", 31.0),
            ("shared_get", 35.0),
            ("shared_get_cas_set", 37.0),
        ]
        .iter()
        .map(|(k, cpu)| (k.to_string(), 1000.0, *cpu))
        .collect(),
    }
}

#[test]
fn host_call_counts_are_read_as_the_filter_tests_write_them() {
    let c = parse_host_call_counts(COUNTS).unwrap();
    assert_eq!(c.calls.len(), 2);
    assert_eq!(c.calls[0].variant, "cached JSON");
    assert_eq!(c.calls[0].total, 6);
    assert_eq!(c.calls[0].by_kind.get("shared set (CAS)"), Some(&2));
    assert_eq!(c.allocations[0].per_callback, vec![32, 22, 14, 23, 0]);
    assert!(parse_host_call_counts("{}").is_err());
    assert!(parse_host_call_counts("not json").is_err());
}

#[test]
fn a_derived_price_subtracts_the_call_it_needs() {
    let p = prices();
    let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
    assert!(close(p.of_call("clock"), 0.1));
    assert!(close(p.of_call("shared get"), 0.5));
    assert!(close(p.of_call("shared set (CAS)"), 0.2));
    // Not measured, or not a priced kind: no price, never a guess.
    assert_eq!(p.of_call("request header map read"), None);
    assert_eq!(p.of_call("dispatch"), None);
    let c = parse_host_call_counts(COUNTS).unwrap();
    let (us, unpriced) = bill(&c.calls[0], &p);
    assert!((us - (3.0 * 0.1 + 2.0 * 0.2)).abs() < 1e-9, "{us}");
    assert_eq!(unpriced, 1);
}

#[test]
fn the_full_run_prices_only_the_kinds_the_counts_hold_and_the_body_hold() {
    assert_eq!(
        kinds_pricing(["shared set (CAS)", "clock", "dispatch"]),
        vec!["none", "nobuf", "clock", "shared_get", "shared_get_cas_set"]
    );
    // Every priced call names kinds the hostcall filter makes.
    for (label, kind, minus) in PRICED_CALLS {
        for k in std::iter::once(kind).chain(minus) {
            assert!(HOST_CALL_KINDS.iter().any(|(h, _)| h == k), "{label}: {k}");
        }
    }
}

#[test]
fn the_host_call_table_has_variants_as_columns_and_the_priced_bill() {
    let out = render_host_calls(&parse_host_call_counts(COUNTS), Some(&prices()));
    assert!(
        out.starts_with("## Host calls per request (issue 14)\n"),
        "{out}"
    );
    assert!(
        out.contains("| kind | µs per call | cached JSON | miss JSON |"),
        "{out}"
    );
    assert!(out.contains("| clock | 0.10 | 3 | 4 |"), "{out}");
    assert!(out.contains("| shared set (CAS) | 0.20 | 2 | 0 |"), "{out}");
    assert!(
        out.contains("| request header map read | — | 1 | 0 |"),
        "{out}"
    );
    assert!(out.contains("| dispatch | — | 0 | 1 |"), "{out}");
    assert!(out.contains("| **total** | | **6** | **5** |"), "{out}");
    assert!(
        out.contains(
            "| priced bill µs (Σ count × price) | | 0.7 + 1 unpriced | 0.4 + 1 unpriced |"
        ),
        "{out}"
    );
    assert!(out.contains("| 91 / 4475 | — |"), "{out}");
    assert!(out.contains("| `shared_get_cas_set` |"), "{out}");
    // Without prices: counts only, no bill.
    let out = render_host_calls(&parse_host_call_counts(COUNTS), None);
    assert!(out.contains("| clock | — | 3 | 4 |"), "{out}");
    assert!(!out.contains("priced bill"), "{out}");
}

#[test]
fn missing_host_call_counts_are_said_not_invented() {
    let out = render_host_calls(
        &read_host_call_counts(Some(Path::new("/nonexistent/x.json"))),
        None,
    );
    assert!(
        out.contains("No host-call counts in this run (/nonexistent/x.json: "),
        "{out}"
    );
    assert!(!out.contains("| kind |"), "{out}");
    let out = render_host_calls(&read_host_call_counts(None), Some(&prices()));
    assert!(
        out.contains("No host-call counts in this run (no file given"),
        "{out}"
    );
    // The prices measured are still reported.
    assert!(out.contains("| `clock` |"), "{out}");
}
