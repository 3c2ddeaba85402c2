//! Stacks started at the same moment do not trip over each other's ports: each program that
//! binds by address (PostgreSQL, the companion, Envoy) is started again on fresh ports when
//! another process took one between the pick and the bind.

use maas_e2e::stack::http_request;
use maas_e2e::{Stack, StackOptions};
use std::collections::HashSet;
use std::time::{Duration, Instant};

const STACKS: usize = 4;

#[test]
fn four_stacks_start_concurrently_and_each_serves_on_its_own_ports() {
    let started = Instant::now();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(STACKS));
    let handles: Vec<_> = (0..STACKS)
        .map(|i| {
            let barrier = barrier.clone();
            std::thread::Builder::new()
                .name(format!("stack-{i}"))
                .spawn(move || {
                    barrier.wait();
                    Stack::start(StackOptions {
                        // Four at once on a small machine: room for a slow start.
                        ready_timeout: Duration::from_secs(180),
                        ..StackOptions::default()
                    })
                    .map_err(|e| format!("stack {i}: {e:#}"))
                })
                .unwrap()
        })
        .collect();
    let stacks: Vec<Stack> = handles
        .into_iter()
        .map(|h| h.join().expect("start thread panicked"))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{STACKS} stacks started in {:?}", started.elapsed());

    let mut urls = HashSet::new();
    for stack in &stacks {
        for url in [
            stack.gateway_url(),
            stack.envoy_admin_url(),
            stack.companion_public_url(),
            stack.companion_internal_url(),
            stack.companion_metrics_url(),
            stack.database_url(),
            stack.sim_url(),
        ] {
            assert!(urls.insert(url.clone()), "{url} is used twice");
        }
        let (status, body) = http_request(
            stack.gateway_addr(),
            "GET",
            "/maas-api/health",
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(status, 200, "{body}");
        stack.check_alive().unwrap();
    }
}
