//! The proxy-wasm adapter: Envoy's contexts delegate to the worker (`worker::Root`) and the
//! request state machine (`request::Http`); [`ProxyHost`] implements the [`Host`] seam with
//! `proxy_wasm::hostcalls`. No decision lives here.

use crate::host::{Body, HeaderMap, Headers, Host, MetricKind, lossy};
use crate::request::Http;
use crate::store::{CasMismatch, SharedStore};
use crate::worker::{Root, TICK_MS};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    // The `log` facade goes to Envoy's log through the SDK.
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(RootCtx(Root::new(context_id)))
    });
}}

/// Envoy, through the proxy-wasm ABI.
struct ProxyHost;

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    /// The whole header map `map_type`, serialized (see [`HeaderMap`]) into memory the host
    /// allocates in the VM.
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
}

/// The ABI's `Ok` status (any other: no map).
const STATUS_OK: u32 = 0;

fn map(m: Headers) -> MapType {
    match m {
        Headers::Request => MapType::HttpRequestHeaders,
        Headers::Response => MapType::HttpResponseHeaders,
        Headers::ResponseTrailers => MapType::HttpResponseTrailers,
        Headers::CallResponse => MapType::HttpCallResponseHeaders,
    }
}

fn buffer(b: Body) -> BufferType {
    match b {
        Body::Request => BufferType::HttpRequestBody,
        Body::Response => BufferType::HttpResponseBody,
        Body::CallResponse => BufferType::HttpCallResponseBody,
        Body::PluginConfiguration => BufferType::PluginConfiguration,
    }
}

impl SharedStore for ProxyHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|_| CasMismatch)
    }
}

impl Host for ProxyHost {
    // The raw call, not the SDK's `get_map_bytes`: that one copies every name and value into a
    // `String` and a `Vec` of its own (2 allocations per header), panics (traps the VM) on an
    // unexpected status and on a name that is not UTF-8. Here the host's one buffer is the map.
    fn headers(&self, m: Headers) -> HeaderMap {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: the host writes a pointer and a size into the two locals; the pointer is
        // memory it allocated in this VM through the SDK's exported `proxy_on_memory_allocate`
        // (a boxed `[u8]` of exactly `size` bytes), whose ownership passes to us: the SDK's own
        // `get_map_bytes` takes it back with `Vec::from_raw_parts(data, size, size)` the same way.
        let status = unsafe { proxy_get_header_map_pairs(map(m), &mut data, &mut size) };
        if status != STATUS_OK || data.is_null() {
            return HeaderMap::default();
        }
        // SAFETY: see above (allocated with this size and capacity, owned by us from here).
        let wire = unsafe { Vec::from_raw_parts(data, size, size) };
        HeaderMap::from_wire(wire)
    }

    fn header(&self, m: Headers, name: &str) -> Option<String> {
        hostcalls::get_map_value_bytes(map(m), name)
            .ok()
            .flatten()
            .map(lossy)
    }

    fn set_header(&self, m: Headers, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(map(m), name, value);
    }

    fn add_header(&self, m: Headers, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(map(m), name, value);
    }

    fn body(&self, b: Body, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(buffer(b), 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn set_body(&self, b: Body, size: usize, value: &[u8]) {
        let _ = hostcalls::set_buffer(buffer(b), 0, size, value);
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String> {
        hostcalls::dispatch_http_call(
            cluster,
            headers.to_vec(),
            body,
            vec![],
            Duration::from_millis(timeout_ms),
        )
        .map_err(|e| format!("{e:?}"))
    }

    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }

    fn resume_request(&self) {
        let _ = hostcalls::resume_http_request();
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        hostcalls::set_effective_context(context_id).is_ok()
    }

    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> u32 {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Histogram => MetricType::Histogram,
            MetricKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name).unwrap_or(0)
    }

    fn increment_metric(&self, id: u32, by: i64) {
        let _ = hostcalls::increment_metric(id, by);
    }

    fn record_metric(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }

    fn property(&self, path: &[&str]) -> Option<String> {
        hostcalls::get_property(path.to_vec())
            .ok()
            .flatten()
            .map(lossy)
    }

    fn property_u64(&self, path: &[&str]) -> Option<u64> {
        hostcalls::get_property(path.to_vec())
            .ok()
            .flatten()
            .and_then(|b| crate::host::property_u64_from(&b))
    }

    fn set_property(&self, path: &[&str], value: &[u8]) {
        let _ = hostcalls::set_property(path.to_vec(), Some(value));
    }
}

struct RootCtx(Root);

impl Context for RootCtx {
    fn on_http_call_response(&mut self, token: u32, _h: usize, body_size: usize, _t: usize) {
        self.0.on_call_response(&ProxyHost, token, body_size);
    }
}

impl RootContext for RootCtx {
    fn on_configure(&mut self, _size: usize) -> bool {
        if !self.0.configure(&ProxyHost) {
            return false;
        }
        let _ = hostcalls::set_tick_period(Duration::from_millis(TICK_MS));
        true
    }

    fn on_tick(&mut self) {
        self.0.tick(&ProxyHost);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        if self.0.upstream_mode() {
            return Some(Box::new(UpstreamHttp(
                self.0.worker.clone(),
                crate::upstream::Attempt::default(),
            )));
        }
        Some(Box::new(self.0.http(context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One upstream attempt of the upstream mode (`crate::upstream`): its request headers, and
/// its body only for a backend that takes a model name of its own.
struct UpstreamHttp(crate::worker::SharedWorker, crate::upstream::Attempt);

impl Context for UpstreamHttp {}

impl HttpContext for UpstreamHttp {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.1
            .on_request_headers(&ProxyHost, &self.0, end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.1.on_request_body(&ProxyHost, body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        self.1.on_request_trailers(&ProxyHost)
    }
}

impl Context for Http {
    fn on_http_call_response(&mut self, token: u32, _h: usize, body_size: usize, _t: usize) {
        Http::on_call_response(self, &ProxyHost, token, body_size);
    }

    fn on_done(&mut self) -> bool {
        Http::on_done(self, &ProxyHost)
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        Http::on_request_headers(self, &ProxyHost, end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        Http::on_request_body(self, &ProxyHost, body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        Http::on_request_trailers(self, &ProxyHost)
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        Http::on_response_headers(self, &ProxyHost)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        Http::on_response_body(self, &ProxyHost, body_size, end_of_stream)
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        Http::on_response_trailers(self, &ProxyHost)
    }

    fn on_log(&mut self) {
        Http::on_log(self, &ProxyHost);
    }
}
