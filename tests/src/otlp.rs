//! A tiny OTLP/HTTP traces receiver for the tracing tests: `POST /v1/traces` with a protobuf
//! `ExportTraceServiceRequest` (gzip or not), as Envoy's OpenTelemetry tracer and the
//! companion's exporter send it. It keeps every span it was sent, flattened, in memory.

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One span as received.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    pub name: String,
    /// Lowercase hex.
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// Attributes with their values as text (strings as they are, numbers in decimal).
    pub attributes: BTreeMap<String, String>,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

type Spans = Arc<Mutex<Vec<ReceivedSpan>>>;

/// Spans kept (the first ones); later ones are decoded and answered, not kept.
const MAX_KEPT_SPANS: usize = 100_000;

/// The receiver: listening on 127.0.0.1 (port chosen by the system) until dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    spans: Spans,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn text(v: Option<&AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

/// The spans of an export request, flattened.
pub fn flatten(req: &ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in &req.resource_spans {
        let resource = rs
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service = resource.get("service.name").cloned().unwrap_or_default();
        for ss in &rs.scope_spans {
            for s in &ss.spans {
                out.push(ReceivedSpan {
                    service: service.clone(),
                    name: s.name.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    attributes: attributes(&s.attributes),
                });
            }
        }
    }
    out
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The request body, gunzipped when it says so.
fn decoded(headers: &HeaderMap, body: &[u8]) -> std::io::Result<Vec<u8>> {
    let gzip = headers
        .get("content-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("gzip"));
    if !gzip {
        return Ok(body.to_vec());
    }
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(body), &mut out)?;
    Ok(out)
}

async fn receive(
    State(spans): State<Spans>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 1], Vec<u8>) {
    let req = decoded(&headers, &body)
        .ok()
        .and_then(|b| ExportTraceServiceRequest::decode(b.as_slice()).ok());
    let Some(req) = req else {
        return (
            StatusCode::BAD_REQUEST,
            [("content-type", "text/plain")],
            b"not an ExportTraceServiceRequest".to_vec(),
        );
    };
    if let Ok(mut all) = spans.lock() {
        // Bounded: a benchmark sends spans for minutes (they are decoded, then dropped).
        let room = MAX_KEPT_SPANS.saturating_sub(all.len());
        all.extend(flatten(&req).into_iter().take(room));
    }
    (
        StatusCode::OK,
        [("content-type", "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

impl OtlpReceiver {
    /// Starts listening (its own thread and runtime).
    pub fn start() -> Result<OtlpReceiver> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("OTLP receiver bind")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let spans: Spans = Arc::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = spans.clone();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let app = axum::Router::new()
                    .route("/v1/traces", axum::routing::post(receive))
                    .with_state(state);
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        Ok(OtlpReceiver {
            addr,
            spans,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>/v1/traces`.
    pub fn url(&self) -> String {
        format!("http://{}/v1/traces", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits (polling, up to `timeout`) until `done` holds for the spans received; answers them.
    pub fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() >= deadline {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

    fn kv(k: &str, v: any_value::Value) -> KeyValue {
        KeyValue {
            key: k.into(),
            value: Some(AnyValue { value: Some(v) }),
            ..Default::default()
        }
    }

    #[test]
    fn a_posted_export_is_kept_gzip_or_not() {
        let req = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![kv(
                        "service.name",
                        any_value::Value::StringValue("svc".into()),
                    )],
                    ..Default::default()
                }),
                scope_spans: vec![ScopeSpans {
                    spans: vec![Span {
                        name: "op".into(),
                        trace_id: vec![0xab; 16],
                        span_id: vec![1; 8],
                        attributes: vec![kv("n", any_value::Value::IntValue(7))],
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        let receiver = OtlpReceiver::start().unwrap();
        let body = req.encode_to_vec();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &body).unwrap();
        let gzipped = gz.finish().unwrap();
        let http = reqwest::blocking::Client::new();
        for (payload, encoding) in [(body, None), (gzipped, Some("gzip"))] {
            let mut r = http
                .post(receiver.url())
                .header("content-type", "application/x-protobuf")
                .body(payload);
            if let Some(e) = encoding {
                r = r.header("content-encoding", e);
            }
            assert_eq!(r.send().unwrap().status(), 200);
        }
        let spans = receiver.spans();
        assert_eq!(spans.len(), 2);
        for s in spans {
            assert_eq!(s.service, "svc");
            assert_eq!(s.name, "op");
            assert_eq!(s.trace_id, "ab".repeat(16));
            assert_eq!(s.parent_span_id, "");
            assert_eq!(s.attr("n"), Some("7"));
        }
        let bad = http.post(receiver.url()).body("junk").send().unwrap();
        assert_eq!(bad.status(), 400);
    }
}
