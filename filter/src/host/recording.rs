//! A native [`Host`] that records every call (tests of the request's life and the host-call
//! budget). One recording host plays Envoy for a whole worker: `enter(id)` makes a context the
//! effective one, as Envoy does before each callback.

use super::{Body, HeaderMap, Headers, Host, MetricKind};
use crate::store::{CasMismatch, MemStore, SharedStore};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// One host call, by name (counted per request in the README).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Headers(Headers),
    Header(Headers, String),
    SetHeader(Headers, String, Option<String>),
    AddHeader(Headers, String, String),
    Body(Body),
    SetBody(Body),
    Dispatch(String),
    SendResponse(u32),
    Resume,
    SetEffectiveContext(u32),
    Now,
    DefineMetric(String),
    IncrementMetric(u32, i64),
    RecordMetric(u32, u64),
    Property(String),
    SetProperty(String),
    SharedGet(String),
    SharedSet(String),
}

/// A dispatched HTTP call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u64,
}

/// A local response sent on a context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub context: u32,
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Sent {
    /// The OpenAI error `code` of the body.
    pub fn code(&self) -> String {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
            .unwrap_or_default()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Default)]
pub struct RecordingHost {
    pub calls: RefCell<Vec<Call>>,
    pub maps: RefCell<HashMap<Headers, Vec<(String, String)>>>,
    /// Maps handed over truncated (a host answer the filter cannot read).
    pub truncated_maps: RefCell<Vec<Headers>>,
    pub buffers: RefCell<HashMap<Body, Vec<u8>>>,
    pub properties: RefCell<HashMap<String, String>>,
    /// Properties set, by context: `(context, name, value)`.
    pub set_properties: RefCell<Vec<(u32, String, Vec<u8>)>>,
    /// Numeric properties per context (`(context, "request.total_size")`).
    pub numbers: RefCell<HashMap<(u32, String), u64>>,
    pub store: MemStore,
    pub now: Cell<u64>,
    pub effective: Cell<u32>,
    /// Contexts that are gone (`set_effective_context` fails for them).
    pub gone: RefCell<Vec<u32>>,
    pub dispatch_fails: Cell<bool>,
    pub dispatched: RefCell<Vec<Dispatched>>,
    pub sent: RefCell<Vec<Sent>>,
    /// Contexts resumed.
    pub resumed: RefCell<Vec<u32>>,
    pub metric_names: RefCell<Vec<String>>,
    pub metric_values: RefCell<HashMap<u32, i64>>,
    pub recorded: RefCell<Vec<(u32, u64)>>,
}

impl RecordingHost {
    pub fn new() -> Self {
        let h = Self::default();
        h.now.set(1_700_000_000_000);
        h
    }

    /// Envoy calls into context `id` (not recorded: not a host call of the filter).
    pub fn enter(&self, id: u32) {
        self.effective.set(id);
    }

    pub fn set_map(&self, map: Headers, headers: &[(&str, &str)]) {
        let _host_side = crate::alloc_count::pause();
        self.maps.borrow_mut().insert(
            map,
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }

    pub fn map_value(&self, map: Headers, name: &str) -> Option<String> {
        self.maps.borrow().get(&map).and_then(|m| {
            m.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        })
    }

    /// Every value of `name` in `map`, in order.
    pub fn map_values(&self, map: Headers, name: &str) -> Vec<String> {
        self.maps.borrow().get(&map).map_or_else(Vec::new, |m| {
            m.iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
                .collect()
        })
    }

    pub fn set_buffer(&self, buf: Body, bytes: &[u8]) {
        let _host_side = crate::alloc_count::pause();
        self.buffers.borrow_mut().insert(buf, bytes.to_vec());
    }

    pub fn buffer(&self, buf: Body) -> Vec<u8> {
        self.buffers.borrow().get(&buf).cloned().unwrap_or_default()
    }

    pub fn clear_calls(&self) {
        self.calls.borrow_mut().clear();
    }

    pub fn call_count(&self) -> usize {
        self.calls.borrow().len()
    }

    /// The sum of a labelled family's counters over the series whose labels include `with`.
    pub fn series_sum(&self, family: &str, with: &[(&str, &str)]) -> i64 {
        let names = self.metric_names.borrow();
        let values = self.metric_values.borrow();
        names
            .iter()
            .zip(1u32..)
            .filter(|(name, _)| {
                let (f, labels) = crate::metrics::parse_series(name);
                f == family
                    && with
                        .iter()
                        .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, id)| values.get(&id).copied().unwrap_or(0))
            .sum()
    }

    /// The value of a counter by name (0 when never incremented).
    pub fn metric(&self, name: &str) -> i64 {
        let names = self.metric_names.borrow();
        names
            .iter()
            .position(|n| n == name)
            .and_then(|i| self.metric_values.borrow().get(&(i as u32 + 1)).copied())
            .unwrap_or(0)
    }

    pub fn last_sent(&self) -> Option<Sent> {
        self.sent.borrow().last().cloned()
    }

    fn record(&self, c: impl FnOnce() -> Call) {
        let _not_the_filters = crate::alloc_count::pause();
        self.calls.borrow_mut().push(c());
    }
}

impl SharedStore for RecordingHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.record(|| Call::SharedGet(key.to_string()));
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        self.record(|| Call::SharedSet(key.to_string()));
        let _host_side = crate::alloc_count::pause();
        self.store.set(key, value, cas)
    }
}

impl Host for RecordingHost {
    fn headers(&self, map: Headers) -> HeaderMap {
        self.record(|| Call::Headers(map));
        // Envoy's serialization of the map, as the VM receives it.
        let wire = {
            let _host_side = crate::alloc_count::pause();
            let maps = self.maps.borrow();
            let pairs = maps.get(&map).map(Vec::as_slice).unwrap_or_default();
            let mut wire = super::encode(pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
            if self.truncated_maps.borrow().contains(&map) {
                wire.pop();
            }
            wire
        };
        // The one allocation the VM makes for the answer (`proxy_on_memory_allocate`).
        HeaderMap::from_wire(wire.as_slice().to_vec())
    }

    fn header(&self, map: Headers, name: &str) -> Option<String> {
        self.record(|| Call::Header(map, name.to_string()));
        self.map_value(map, name)
    }

    fn set_header(&self, map: Headers, name: &str, value: Option<&str>) {
        self.record(|| Call::SetHeader(map, name.to_string(), value.map(str::to_string)));
        let _host_side = crate::alloc_count::pause();
        let mut maps = self.maps.borrow_mut();
        let m = maps.entry(map).or_default();
        m.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        if let Some(v) = value {
            m.push((name.to_string(), v.to_string()));
        }
    }

    fn add_header(&self, map: Headers, name: &str, value: &str) {
        self.record(|| Call::AddHeader(map, name.to_string(), value.to_string()));
        let _host_side = crate::alloc_count::pause();
        let mut maps = self.maps.borrow_mut();
        maps.entry(map)
            .or_default()
            .push((name.to_string(), value.to_string()));
    }

    fn body(&self, buf: Body, size: usize) -> Vec<u8> {
        self.record(|| Call::Body(buf));
        let b = {
            let _host_side = crate::alloc_count::pause();
            self.buffer(buf)
        };
        b.get(..size.min(b.len())).unwrap_or_default().to_vec()
    }

    fn set_body(&self, buf: Body, size: usize, value: &[u8]) {
        self.record(|| Call::SetBody(buf));
        let _host_side = crate::alloc_count::pause();
        let mut bufs = self.buffers.borrow_mut();
        let b = bufs.entry(buf).or_default();
        let rest = b.split_off(size.min(b.len()));
        *b = value.to_vec();
        b.extend_from_slice(&rest);
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String> {
        self.record(|| Call::Dispatch(cluster.to_string()));
        if self.dispatch_fails.get() {
            return Err("BadArgument".to_string());
        }
        let mut d = self.dispatched.borrow_mut();
        let token = d.len() as u32 + 1;
        d.push(Dispatched {
            token,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.map(<[u8]>::to_vec),
            timeout_ms,
        });
        Ok(token)
    }

    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.record(|| Call::SendResponse(status));
        self.sent.borrow_mut().push(Sent {
            context: self.effective.get(),
            status,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
        });
    }

    fn resume_request(&self) {
        self.record(|| Call::Resume);
        self.resumed.borrow_mut().push(self.effective.get());
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        self.record(|| Call::SetEffectiveContext(context_id));
        if self.gone.borrow().contains(&context_id) {
            return false;
        }
        self.effective.set(context_id);
        true
    }

    fn now_ms(&self) -> u64 {
        self.record(|| Call::Now);
        self.now.get()
    }

    fn define_metric(&self, _kind: MetricKind, name: &str) -> u32 {
        self.record(|| Call::DefineMetric(name.to_string()));
        let mut names = self.metric_names.borrow_mut();
        match names.iter().position(|n| n == name) {
            Some(i) => i as u32 + 1,
            None => {
                names.push(name.to_string());
                names.len() as u32
            }
        }
    }

    fn increment_metric(&self, id: u32, by: i64) {
        self.record(|| Call::IncrementMetric(id, by));
        *self.metric_values.borrow_mut().entry(id).or_default() += by;
    }

    fn record_metric(&self, id: u32, value: u64) {
        self.record(|| Call::RecordMetric(id, value));
        self.recorded.borrow_mut().push((id, value));
    }

    fn property(&self, path: &[&str]) -> Option<String> {
        let key = path.join(".");
        self.record(|| Call::Property(key.clone()));
        self.properties.borrow().get(&key).cloned()
    }

    fn property_u64(&self, path: &[&str]) -> Option<u64> {
        let key = path.join(".");
        self.record(|| Call::Property(key.clone()));
        self.numbers
            .borrow()
            .get(&(self.effective.get(), key))
            .copied()
    }

    fn set_property(&self, path: &[&str], value: &[u8]) {
        let key = path.join(".");
        self.record(|| Call::SetProperty(key.clone()));
        let _host_side = crate::alloc_count::pause();
        self.set_properties
            .borrow_mut()
            .push((self.effective.get(), key, value.to_vec()));
    }
}
