//! MaaS Gateway filter: authentication, credential hygiene, provider credentials and per-tier
//! request and token limits, as a Proxy-WASM HTTP filter for Envoy.
//!
//! The decisions are plain functions over plain data (native unit tests); `request` (one request's
//! life as a state machine) and `worker` (the root context's polling) sequence them over the
//! `host::Host` seam, natively tested with a recording host; `glue` is the thin proxy-wasm adapter
//! (compiled for wasm32 only). See README.md for the module map.

// A panic traps the VM and drops every stream of the worker: production code refuses instead
// (clippy.toml allows these in tests).
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
// Tests may borrow a RefCell (a panic there is a failed test); the filter itself may not
// (filter/clippy.toml `disallowed-methods`, checked on the library and wasm32 targets).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub(crate) mod admission;
pub(crate) mod authenticate;
pub(crate) mod cache;
pub mod config;
pub(crate) mod cooldown;
pub(crate) mod credential;
pub(crate) mod decide;
pub(crate) mod encoding;
pub(crate) mod folds;
pub mod host;
pub(crate) mod hygiene;
pub(crate) mod lease;
pub(crate) mod ledger;
pub(crate) mod limits;
pub(crate) mod metrics;
pub(crate) mod observe;
pub(crate) mod operations;
pub(crate) mod path;
pub(crate) mod provider;
pub mod request;
pub mod request_body;
pub(crate) mod response;
pub mod sigv4;
pub mod sse;
pub mod state;
pub(crate) mod store;
pub mod translate;
pub mod upstream;
pub mod usage;
pub(crate) mod usage_event;
pub mod worker;

#[cfg(target_arch = "wasm32")]
mod glue;

/// A map in the worker's memory looked up on every request: foldhash (minimally DoS-resistant,
/// seeded per map) instead of SipHash, which cost more than the lookups themselves. Keys are
/// authenticated subjects, slot and ledger keys derived from them, or credential copies' keyed
/// SipHash (random per VM): nothing a client picks freely.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

#[cfg(test)]
pub(crate) mod alloc_count;
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: alloc_count::Counting = alloc_count::Counting;
