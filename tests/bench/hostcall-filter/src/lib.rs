//! Makes `x-bench-n` host calls of the kind named by `x-bench-kind` on every request (the
//! benchmark's "hostcalls" mode): Envoy's CPU per request minus that of kind `none`, divided by
//! N, is the price of one call. Every kind reads the same two request headers and buffers the
//! request body to its end (as the MaaS filter does), so `none` is the common baseline.
//!
//! Kinds (request side unless `resp_`): `none`, `clock`, `shared_get`, `shared_set`,
//! `shared_get_cas_set` (a get then a CAS set: subtract `shared_get`), `header_get_all`,
//! `header_get`, `header_set`, `header_remove`, `header_set_map` (the whole map replaced),
//! `body_read`, `body_write`, `metric_inc`, `property`, `resp_header_get_all`, `resp_header_get`,
//! `resp_header_set`, `resp_header_remove`, `resp_header_set_map`; and work inside the VM, for
//! scale: `sha256` (one SHA-256 of 60 bytes, as a credential's verifier), `alloc` (a 64-byte
//! vector allocated, written and freed), `json_body` (the request body parsed with serde_json,
//! values skipped).

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { metric: 0 }) });
}}

/// A value the size of a cache entry or a counter slot.
const VALUE: [u8; 160] = [7u8; 160];
const SHARED_KEY: &str = "bench/v";

struct Root {
    metric: u32,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        self.metric = hostcalls::define_metric(MetricType::Counter, "bench_hostcall").unwrap_or(0);
        let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&VALUE), None);
        true
    }
    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Calls {
            kind: String::new(),
            n: 0,
            metric: self.metric,
        }))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Calls {
    kind: String,
    n: u32,
    metric: u32,
}

impl Context for Calls {}

fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten()
}

impl Calls {
    /// The header-map kinds, on `map`.
    fn map_calls(&self, kind: &str, map: MapType) {
        let all = if kind == "header_set_map" {
            hostcalls::get_map_bytes(map).unwrap_or_default()
        } else {
            Vec::new()
        };
        for _ in 0..self.n {
            match kind {
                "header_get_all" => {
                    std::hint::black_box(hostcalls::get_map_bytes(map).ok());
                }
                "header_get" => {
                    std::hint::black_box(header(map, "content-type"));
                }
                "header_set" => {
                    let _ = hostcalls::set_map_value(map, "x-bench-set", Some("12345"));
                }
                "header_remove" => {
                    let _ = hostcalls::set_map_value(map, "x-bench-absent", None);
                }
                "header_set_map" => {
                    let pairs: Vec<(&str, &[u8])> = all
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_slice()))
                        .collect();
                    let _ = hostcalls::set_map_bytes(map, pairs);
                }
                _ => {}
            }
        }
    }

    fn request_calls(&self) {
        for _ in 0..self.n {
            match self.kind.as_str() {
                "clock" => {
                    std::hint::black_box(hostcalls::get_current_time().ok());
                }
                "shared_get" => {
                    std::hint::black_box(hostcalls::get_shared_data(SHARED_KEY).ok());
                }
                "shared_set" => {
                    let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&VALUE), None);
                }
                "shared_get_cas_set" => {
                    if let Ok((_, cas)) = hostcalls::get_shared_data(SHARED_KEY) {
                        let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&VALUE), cas);
                    }
                }
                "metric_inc" => {
                    let _ = hostcalls::increment_metric(self.metric, 1);
                }
                "sha256" => {
                    use sha2::Digest;
                    std::hint::black_box(sha2::Sha256::digest(std::hint::black_box(&VALUE[..60])));
                }
                "alloc" => {
                    let v = std::hint::black_box(vec![1u8; 64]);
                    drop(v);
                }
                "property" => {
                    std::hint::black_box(hostcalls::get_property(vec!["xds", "cluster_name"]).ok());
                }
                _ => return,
            }
        }
    }
}

impl HttpContext for Calls {
    fn on_http_request_headers(&mut self, _n: usize, _end: bool) -> Action {
        let req = MapType::HttpRequestHeaders;
        self.kind = header(req, "x-bench-kind")
            .and_then(|v| String::from_utf8(v).ok())
            .unwrap_or_default();
        self.n = header(req, "x-bench-n")
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if self.kind.starts_with("header_") {
            self.map_calls(&self.kind, req);
        } else {
            self.request_calls();
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        for _ in 0..self.n {
            match self.kind.as_str() {
                "body_read" => {
                    std::hint::black_box(
                        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok(),
                    );
                }
                "json_body" => {
                    let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
                        .ok()
                        .flatten()
                        .unwrap_or_default();
                    for _ in 0..self.n {
                        std::hint::black_box(
                            serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok(),
                        );
                    }
                    break;
                }
                "body_write" => {
                    let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
                        .ok()
                        .flatten()
                        .unwrap_or_default();
                    let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, &body);
                }
                _ => break,
            }
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, _end: bool) -> Action {
        if let Some(kind) = self.kind.strip_prefix("resp_") {
            self.map_calls(kind, MapType::HttpResponseHeaders);
        }
        Action::Continue
    }
}
