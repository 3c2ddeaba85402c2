//! The checks on what deploys, without a cluster: every kustomization under wasm-plugin-crs/
//! renders with `kubectl kustomize` and passes the schema and wiring checks
//! (`maas_e2e::manifest_checks`); broken copies of the renders are refused, each naming why;
//! Envoy itself accepts the cluster and connection-manager settings the EnvoyFilters add; the
//! Grafana dashboard names only exported metrics; the companion's migrations stay forward-only
//! and additive (`maas_e2e::migration_checks`).
//!
//! Needs kubectl with kustomize v5 (`KUBECTL`, see `maas_e2e::tools::kubectl`) and Envoy
//! (`MAAS_ENVOY_BIN` or the project's .venv, as the e2e tests).

mod dashboard;
mod envoy;
mod migrations;
mod mutations;
mod overlays;
mod renders;
