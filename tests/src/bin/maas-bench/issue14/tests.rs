use super::*;

fn figures() -> Issue14 {
    Issue14 {
        rps_32: Some((18000.0, 20000.0)),
        p50_1: Some((0.2, 0.16)),
        cpu: Some(CpuSplit {
            c: 32,
            envoy: 30.0,
            noop: Some(34.0),
            floor: Some(40.0),
            cached: 50.0,
        }),
        first_event: Some((1.15, 1.1)),
        miss_p50_1: None,
        memory: Some((100_000, 35 * 1024, 64 * 1024)),
    }
}

#[test]
fn issue14_targets_say_met_or_missed_and_by_how_much() {
    let t = issue14_targets(&figures());
    let row = |i: usize| {
        let t = &t[i];
        (t.measured.as_str(), t.by.as_str(), t.met)
    };
    assert_eq!(
        row(0),
        ("0.90× (18000 vs 20000 req/s)", "0.00× to spare", Some(true))
    );
    assert_eq!(
        row(1),
        ("1.25× (0.200 vs 0.160 ms)", "0.10× over", Some(false))
    );
    assert_eq!(
        row(2),
        ("+16.0 µs (50.0 vs 34.0 µs)", "1.0 µs over", Some(false))
    );
    assert_eq!(
        t[2].what,
        "Envoy CPU per request: filter-cached − wasm-noop ≤ +15 µs (concurrency 32)"
    );
    assert_eq!(
        row(3),
        (
            "+0.050 ms (1.150 vs 1.100 ms)",
            "0.050 ms to spare",
            Some(true)
        )
    );
    assert_eq!(row(4), ("not measured in this run", "—", None));
    assert_eq!(
        row(5),
        (
            "35.0 MiB (max of Δ RSS and Δ wasm + Δ heap)",
            "29.0 MiB to spare",
            Some(true)
        )
    );
    assert_eq!(t.len(), 6);
}

#[test]
fn issue14_section_splits_filter_cached_cpu_into_three_parts() {
    let out = render_issue14(&figures(), Some(5.5), Some(12.0));
    assert!(out.starts_with("## Targets (issue 14)\n"), "{out}");
    assert!(out.contains("| 100000 cached credentials cost ≤ 64.0 MiB (64 MiB per 100k) | 35.0 MiB (max of Δ RSS and Δ wasm + Δ heap) | 29.0 MiB to spare | met |"), "{out}");
    assert!(out.contains("| filter-miss p50 ≤ 3× filter-cached p50 (concurrency 1) | not measured in this run | — | — |"), "{out}");
    assert!(out.contains("| bare Envoy (`envoy`) | 30.0 | — |"), "{out}");
    assert!(
        out.contains("(`wasm-noop` − `envoy`) | +4.0 | 20% |"),
        "{out}"
    );
    assert!(
        out.contains("(`wasm-floor` − `wasm-noop`) | +6.0 | 30% |"),
        "{out}"
    );
    assert!(
        out.contains("(`filter-cached` − `wasm-floor`) | +10.0 | 50% |"),
        "{out}"
    );
    assert!(out.contains("is 5.5 µs"), "{out}");
    assert!(out.contains("12.0% of Envoy's samples"), "{out}");
    // Without wasm-floor the split says so.
    let mut f = figures();
    f.cpu = f.cpu.map(|s| CpuSplit { floor: None, ..s });
    let out = render_issue14(&f, None, None);
    assert!(
        out.contains("(`wasm-floor` − `wasm-noop`) | not measured | — |"),
        "{out}"
    );
    assert!(!out.contains("For scale"), "{out}");
}

#[test]
fn issue14_figures_come_from_the_rounds() {
    let r = |rps: f64, p50_ms: f64, cpu_us: f64| WrkResult {
        rps,
        p50_ms,
        cpu_us,
        ..WrkResult::default()
    };
    let mut results = BTreeMap::new();
    for (name, c, runs) in [
        (
            "envoy",
            32,
            vec![
                r(20000.0, 1.0, 30.0),
                r(22000.0, 1.0, 31.0),
                r(21000.0, 1.0, 29.0),
            ],
        ),
        ("filter-cached", 32, vec![r(15000.0, 1.0, 50.0)]),
        ("wasm-noop", 32, vec![r(19000.0, 1.0, 0.0)]),
        ("envoy", 1, vec![r(5000.0, 0.16, 40.0)]),
        ("filter-cached", 1, vec![r(4000.0, 0.2, 60.0)]),
    ] {
        results.insert((name.to_string(), c), runs);
    }
    let f = issue14_figures(&[1, 32], &results, &Ttfb::new(), &[]);
    assert_eq!(f.rps_32, Some((15000.0, 21000.0)));
    assert_eq!(f.p50_1, Some((0.2, 0.16)));
    // The highest concurrency; a variant without a CPU reading has none.
    assert_eq!(
        f.cpu,
        Some(CpuSplit {
            c: 32,
            envoy: 30.0,
            noop: None,
            floor: None,
            cached: 50.0
        })
    );
    assert_eq!((f.first_event, f.miss_p50_1, f.memory), (None, None, None));
}
