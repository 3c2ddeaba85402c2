use super::*;

#[test]
fn pair_results_sum_rates_and_weight_the_median_latency() {
    let a = WrkRun {
        requests: 3000,
        duration_us: 1e6,
        p50_us: 100.0,
        p99_us: 900.0,
        p999_us: 0.0,
        errors: 1,
    };
    let b = WrkRun {
        requests: 1000,
        duration_us: 2e6,
        p50_us: 500.0,
        p99_us: 400.0,
        p999_us: 0.0,
        errors: 2,
    };
    let r = combine_runs(&[a, b], None);
    assert!((r.rps - 3500.0).abs() < 1e-6, "{}", r.rps);
    assert!((r.p50_ms - 0.2).abs() < 1e-9, "{}", r.p50_ms);
    assert!((r.p99_ms - 0.9).abs() < 1e-9, "{}", r.p99_ms);
    assert_eq!(r.errors, 3);
    assert_eq!(r.cpu_us, 0.0);
}

#[test]
fn metric_value_reads_only_the_named_sample() {
    let text = "# HELP maas_companion_redis_round_trips Calls\n# TYPE maas_companion_redis_round_trips counter\nmaas_companion_redis_round_trips_total_created 1.7e9\nmaas_companion_redis_round_trips_total 42\nmaas_companion_lease_batches_total 7\n";
    assert_eq!(
        metric_value(text, "maas_companion_redis_round_trips_total"),
        Some(42.0)
    );
    assert_eq!(
        metric_value(text, "maas_companion_lease_batches_total"),
        Some(7.0)
    );
    assert_eq!(metric_value(text, "maas_companion_lease_items_total"), None);
}

#[test]
fn steady_window_skips_the_start_and_the_end_of_a_run() {
    assert_eq!(
        steady_window(10),
        (Duration::from_secs(2), Duration::from_millis(9700))
    );
    assert_eq!(
        steady_window(2),
        (Duration::from_millis(500), Duration::from_millis(1700))
    );
    let (from, to) = steady_window(1);
    assert!(from <= to && to <= Duration::from_secs(1));
}
