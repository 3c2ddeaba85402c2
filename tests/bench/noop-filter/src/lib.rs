//! Trivial filter: removes `Authorization` from requests and does nothing else.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;
impl Context for Root {}
impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        true
    }
    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Strip))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Strip;
impl Context for Strip {}
impl HttpContext for Strip {
    fn on_http_request_headers(&mut self, _n: usize, _end: bool) -> Action {
        if self.get_http_request_header("authorization").is_some() {
            self.set_http_request_header("authorization", None);
        }
        Action::Continue
    }
}
