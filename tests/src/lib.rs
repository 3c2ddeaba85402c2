//! MaaS Gateway local stack and end-to-end harness.
//!
//! - [`sim`]: the OpenAI-compatible model simulator (also the `model-sim` binary);
//! - [`stack`]: PostgreSQL + companion + simulator + Envoy with the filter (or several gateway
//!   replicas, each an Envoy with its own companion, sharing a Redis), used by the `maas-local`
//!   binary and by every e2e test ([`stack::Stack::shared`]);
//! - [`redis`]: a throwaway redis-server (global limits across replicas) and a tiny RESP client;
//! - [`envoy_config`]: the Envoy bootstrap generated from the policy;
//! - [`extra_envoy`]: more Envoys beside a stack's, started again on fresh ports when one is taken;
//! - [`istio_gateway`]: the Gateway's Envoy as Istio builds it from the shipped EnvoyFilters (the
//!   filter over ECDS, the connection manager's settings), on a local bootstrap;
//! - [`module_stack`]: one stack per e2e module in the one e2e test binary, stopped once the
//!   module's tests are done, a bounded number at once;
//! - [`kube_standin`]: a local Kubernetes API stand-in serving the reference's resources to a
//!   companion with `MAAS_POLICY_SOURCE=kubernetes`;
//! - [`internal_pki`]: the private CA and certificates of the companion's internal listener
//!   (mutual TLS: the gateway's Envoys present a client certificate);
//! - [`h2client`]: HTTP/2 (h2c, TLS + ALPN) and HTTP/1.1 chunked requests with chosen framing and
//!   trailers;
//! - [`tools`]: where Envoy, PostgreSQL, the companion and the .wasm are found;
//! - [`manifest_checks`]: the schema and wiring checks on rendered manifests (the `deploy_checks`
//!   test on every overlay, the `maas-manifest-checks` binary on deploy.sh's renders);
//! - [`migration_checks`]: the companion's migrations stay forward-only and additive;
//! - [`otlp`]: an OTLP/HTTP traces receiver (Envoy's and the companion's spans, for the tracing
//!   tests).

pub mod bedrock_sim;
pub mod cloud_sim;
pub mod envoy_config;
pub mod extra_envoy;
pub mod h2client;
pub mod internal_pki;
pub mod istio_gateway;
pub mod kube_standin;
pub mod manifest_checks;
pub mod migration_checks;
pub mod module_stack;
pub mod otlp;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod redis;
pub mod sim;
pub mod stack;
pub mod tools;

pub use sim::RecordedRequest;
pub use stack::{ConfigSource, Stack, StackOptions};

// No import cycles among the harness's modules (the checker: `lints/module_graph.rs`).
#[cfg(test)]
#[path = "../../lints/module_graph.rs"]
mod module_graph;

#[cfg(test)]
#[test]
fn harness_modules_import_each_other_without_cycles() {
    module_graph::assert_no_cycle(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        // Each binary is its own crate: it reaches the library as `maas_e2e::`.
        &["bin"],
        ("stack", "envoy_config"),
    );
}
