//! Makes `x-bench-n` host calls of the kind named by `x-bench-kind` on every request (the
//! benchmark's "hostcalls" mode): Envoy's CPU per request minus that of kind `none`, divided by
//! N, is the price of one call. Every kind reads the request header map once (as the MaaS filter
//! does; `x-bench-kind` and `x-bench-n` come from it) and buffers the request body to its end, so
//! `none` is the common baseline.
//!
//! Kinds (request side unless `resp_`): `none`, `clock`, `shared_get`, `shared_set`,
//! `shared_get_cas_set` (a get then a CAS set: subtract `shared_get`), `header_get_all`,
//! `header_get`, `header_set`, `header_remove`, `header_set_map` (the whole map replaced),
//! `body_read`, `body_write`, `metric_inc`, `property`, `resp_header_get_all`, `resp_header_get`,
//! `resp_header_set`, `resp_header_add`, `resp_header_remove`, `resp_header_set_map`, `resp_body_read` (the first
//! non-empty response chunk), `resp_body_write` (read + replaced: subtract `resp_body_read`); and
//! work inside the VM, for scale: `sha256` (one SHA-256 of 60 bytes, as a credential's verifier),
//! `alloc` (a 64-byte vector allocated, written and freed), `json_body` (the request body parsed
//! with serde_json, values skipped).
//!
//! `floor-reqset` is the floor with its request header edits made as one `set_map` of the map
//! it read (edited in the VM), `floor-respset` with its 6 `x-ratelimit-*` adds made as one
//! `set_map` of the response map it read plus the 6: what replacing single edits by one
//! header-map replacement saves or costs (Δ vs `floor`, at the request's and response's size).
//!
//! `floor` (N ignored) makes exactly the host calls a cached JSON request of a busy subject
//! makes in the MaaS filter (`cargo test -p maas-filter --lib host_calls_per_request --
//! --nocapture`), in the same callbacks, and nothing else: the benchmark's `wasm-floor` variant, the cost of those calls
//! with no work in the VM around them.

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
            cas: None,
            done: false,
            body_calls: Vec::new(),
            admitted: false,
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
    /// `floor`: the CAS of the counter slot read with the request headers (admission writes
    /// from it, as the MaaS filter's does).
    cas: Option<u32>,
    /// `floor`: the request settled; `resp_body_*`: the response chunk read.
    done: bool,
    /// (size, end of stream) of each request body callback (`probe` answers with them).
    body_calls: Vec<(usize, bool)>,
    /// `floor`: the body read and the request admitted.
    admitted: bool,
}

impl Context for Calls {}

fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten()
}

/// The response headers a cached JSON request of the MaaS filter sets.
const RATE_LIMIT_HEADERS: [(&str, &str); 6] = [
    ("x-ratelimit-limit-requests", "1000000000000"),
    ("x-ratelimit-remaining-requests", "999999999999"),
    ("x-ratelimit-reset-requests", "40s"),
    ("x-ratelimit-limit-tokens", "1000000000000000"),
    ("x-ratelimit-remaining-tokens", "999999999999936"),
    ("x-ratelimit-reset-tokens", "40s"),
];

impl Calls {
    /// `floor-<part>`: the floor without one part of its calls (what that part really costs:
    /// Δ vs `floor`). Parts: `edits` (the 4 request header edits), `shared` (the counter slot's
    /// read and CAS write), `clock`, `reqbody` (the request body read), `respmap` (the response
    /// header map read), `ratehdrs` (the 6 `x-ratelimit-*` sets), `respbody` (the response body
    /// reads).
    fn floor_has(&self, part: &str) -> bool {
        self.kind.strip_prefix("floor-") != Some(part)
    }

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
                "header_add" => {
                    let _ = hostcalls::add_map_value(map, "x-bench-add", "12345");
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
        // One map read, as the MaaS filter makes: `floor` may make no other read.
        let mut reserved = false;
        let map = hostcalls::get_map(req).unwrap_or_default();
        for (name, value) in &map {
            match name.as_str() {
                "x-bench-kind" => self.kind.clone_from(value),
                "x-bench-n" => self.n = value.parse().unwrap_or(0),
                "x-maas-subject" => reserved = true,
                _ => {}
            }
        }
        if self.kind == "floor-reqset" {
            // The floor's precheck, then its edits as one replacement of the whole map.
            std::hint::black_box(hostcalls::get_current_time().ok());
            self.cas = hostcalls::get_shared_data(SHARED_KEY)
                .ok()
                .and_then(|(_, cas)| cas);
            let mut pairs: Vec<(&str, &str)> = map
                .iter()
                .filter(|(n, _)| {
                    !matches!(
                        n.as_str(),
                        "authorization" | "content-length" | "x-maas-subject" | "accept-encoding"
                    )
                })
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            pairs.push(("accept-encoding", "identity"));
            let _ = hostcalls::set_map(req, pairs);
        } else if self.kind.starts_with("floor") {
            // Precheck: the clock and the subject's counter slot; then the header hygiene.
            if self.floor_has("clock") {
                std::hint::black_box(hostcalls::get_current_time().ok());
            }
            if self.floor_has("shared") {
                self.cas = hostcalls::get_shared_data(SHARED_KEY)
                    .ok()
                    .and_then(|(_, cas)| cas);
            }
            let _ = hostcalls::set_map_value(req, "authorization", None);
            if self.floor_has("edits") {
                // The filter removes the client's `x-maas-*` only when sent (the benchmark's
                // request sends none; the budget tests' fixture does).
                if reserved {
                    let _ = hostcalls::set_map_value(req, "x-maas-subject", None);
                }
                let _ = hostcalls::set_map_value(req, "accept-encoding", Some("identity"));
            }
            // `floor_length`: the same calls, the length kept (the upstream body not chunked).
            let length = if self.kind == "floor_length" {
                "x-bench-absent"
            } else {
                "content-length"
            };
            if self.floor_has("edits") {
                let _ = hostcalls::set_map_value(req, length, None);
            }
        } else if self.kind == "strip" {
            // As the trivial filter (`wasm-noop`) does, after this filter's one map read.
            let _ = hostcalls::set_map_value(req, "authorization", None);
        } else if self.kind.starts_with("header_") {
            self.map_calls(&self.kind, req);
        } else {
            self.request_calls();
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.body_calls.push((size, end_of_stream));
        if self.kind.starts_with("floor") {
            // The filter decides a body once it reaches its content-length (wrk sends one):
            // the body read once, the clock, the counter slot written (CAS); then passed on.
            if !self.admitted && size > 0 {
                self.admitted = true;
                if self.floor_has("reqbody") {
                    std::hint::black_box(
                        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok(),
                    );
                }
                if self.floor_has("clock") {
                    std::hint::black_box(hostcalls::get_current_time().ok());
                }
                if self.floor_has("shared") {
                    let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&VALUE), self.cas);
                }
            }
            return Action::Continue;
        }
        // `nobuf`: the body never held (Δ vs `none`: the price of buffering it to its end).
        if self.kind == "nobuf" || self.kind == "strip" || self.kind == "probe_continue" {
            return Action::Continue;
        }
        // `probe_rewrite`: the first chunk replaced by itself and a blank, and passed on.
        if self.kind == "probe_rewrite" {
            if self.body_calls.len() == 1 {
                let mut body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                body.push(b' ');
                let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, &body);
            }
            return Action::Continue;
        }
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
        let resp = MapType::HttpResponseHeaders;
        if self.kind.starts_with("probe") {
            // How Envoy handed the request body over: `size/end` per callback.
            let calls: Vec<String> = self
                .body_calls
                .iter()
                .map(|(size, end)| format!("{size}/{end}"))
                .collect();
            let _ = hostcalls::set_map_value(resp, "x-bench-body-calls", Some(&calls.join(",")));
        }
        if self.kind.starts_with("floor") {
            if self.kind == "floor-respset" {
                // The map read, the 6 added to it in the VM, the whole map written back once.
                let mut map = hostcalls::get_map(resp).unwrap_or_default();
                map.extend(
                    RATE_LIMIT_HEADERS
                        .iter()
                        .map(|(n, v)| ((*n).to_string(), (*v).to_string())),
                );
                let pairs: Vec<(&str, &str)> =
                    map.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                let _ = hostcalls::set_map(resp, pairs);
                return Action::Continue;
            }
            if self.floor_has("respmap") {
                std::hint::black_box(hostcalls::get_map(resp).ok());
            }
            if self.floor_has("ratehdrs") {
                // Added, as the filter does for names the upstream did not send.
                for (name, value) in RATE_LIMIT_HEADERS {
                    let _ = hostcalls::add_map_value(resp, name, value);
                }
            }
        } else if let Some(kind) = self.kind.strip_prefix("resp_") {
            self.map_calls(kind, resp);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        let body = BufferType::HttpResponseBody;
        match self.kind.as_str() {
            kind if kind.starts_with("floor") => {
                // Every non-empty chunk read (usage scan); settlement at the end.
                if size > 0 && self.floor_has("respbody") {
                    std::hint::black_box(hostcalls::get_buffer(body, 0, size).ok());
                }
                if end_of_stream {
                    self.settle();
                }
            }
            "resp_body_read" | "resp_body_write" if size > 0 && !self.done => {
                self.done = true;
                for _ in 0..self.n {
                    let chunk = hostcalls::get_buffer(body, 0, size).ok().flatten();
                    if self.kind == "resp_body_write" {
                        let chunk = chunk.unwrap_or_default();
                        let _ = hostcalls::set_buffer(body, 0, size, &chunk);
                    } else {
                        std::hint::black_box(chunk);
                    }
                }
            }
            _ => {}
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.kind.starts_with("floor") {
            self.settle();
        }
    }
}

impl Calls {
    /// `floor`'s settlement (once): the clock; the refund of a busy subject (the benchmark's
    /// filter-cached) is folded into its next admission, so no counter slot read or write.
    fn settle(&mut self) {
        if std::mem::replace(&mut self.done, true) || !self.floor_has("clock") {
            return;
        }
        std::hint::black_box(hostcalls::get_current_time().ok());
    }
}
