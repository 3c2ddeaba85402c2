//! The host seam: everything the filter asks of Envoy, as one small trait. The proxy-wasm
//! adapter (`glue`, wasm32 only) implements it with `proxy_wasm::hostcalls`; native tests use
//! [`recording::RecordingHost`], which records every call. The request's state machine
//! (`request`) and the worker's polling (`worker`) are plain code over this trait.
//!
//! Shared data (the auth cache and the counters) is the [`SharedStore`] supertrait. Logging goes
//! through the `log` facade (backed by the proxy-wasm SDK in Envoy), not through the host.

use crate::store::SharedStore;

/// A header map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Headers {
    Request,
    Response,
    /// The answer to a dispatched HTTP call (inside its response callback).
    CallResponse,
}

/// A host buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Body {
    Request,
    Response,
    /// The answer to a dispatched HTTP call (inside its response callback).
    CallResponse,
    PluginConfiguration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Histogram,
    /// Set with [`Host::record_metric`].
    Gauge,
}

/// What the filter needs from Envoy. Every method is infallible from the caller's side: a host
/// error reads as "nothing" (no value, empty buffer, metric id 0), and the decisions over it fail
/// closed.
pub trait Host: SharedStore {
    /// Every header of `map`; values that are not UTF-8 become U+FFFD (never a trap).
    fn headers(&self, map: Headers) -> Vec<(String, String)>;
    /// One header value (U+FFFD for invalid bytes).
    fn header(&self, map: Headers, name: &str) -> Option<String>;
    /// Sets (`Some`) or removes (`None`) a header.
    fn set_header(&self, map: Headers, name: &str, value: Option<&str>);
    /// The first `size` bytes of a buffer (`usize::MAX`: all of it).
    fn body(&self, buf: Body, size: usize) -> Vec<u8>;
    /// Replaces the first `size` bytes of a buffer with `value`.
    fn set_body(&self, buf: Body, size: usize, value: &[u8]);
    /// Dispatches an HTTP call; the token identifies its answer.
    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String>;
    /// Answers the effective context's request locally.
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Resumes the effective context's paused request.
    fn resume_request(&self);
    /// Makes `context_id` the effective context (false when it is gone).
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Wall clock, milliseconds since the Unix epoch (0 when unreadable).
    fn now_ms(&self) -> u64;
    /// Defines a metric (0 when refused: increments of id 0 are dropped).
    fn define_metric(&self, kind: MetricKind, name: &str) -> u32;
    fn increment_metric(&self, id: u32, by: i64);
    fn record_metric(&self, id: u32, value: u64);
    /// A property of the stream (`["xds", "cluster_name"]`), as UTF-8 (U+FFFD for invalid bytes).
    fn property(&self, path: &[&str]) -> Option<String>;
}

/// The first `size` bytes of a buffer, without a host call when there are none.
pub fn read_body(host: &dyn Host, buf: Body, size: usize) -> Vec<u8> {
    if size == 0 {
        return Vec::new();
    }
    host.body(buf, size)
}

/// Bytes as text: invalid UTF-8 becomes U+FFFD.
pub fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

#[cfg(test)]
pub mod recording;
