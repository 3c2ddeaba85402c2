//! Logs and traces. Logs: lines on stderr (text or JSON) filtered by `RUST_LOG`. Traces: only
//! with `--otlp-traces-endpoint`, the companion's spans are exported over OTLP/HTTP (protobuf)
//! in batches from the SDK's own thread (service.name `maas-companion`, a parent-based ratio
//! sampler); without it there is no exporter and no OpenTelemetry layer, and the spans below
//! are disabled callsites (the log layer never sees spans: log lines are the same either way).
//!
//! Spans: `http.request` for each request on the public and internal listeners (route template,
//! method, status, the caller's pseudonym), continuing the caller's W3C trace context
//! (`traceparent`, `tracestate`; an invalid one starts a new trace); `authenticate` (result,
//! pseudonym — never the credential), `leases`, `usage.ingest`, the key API's handlers, and
//! `db.query` around the database calls. Users appear only as [`crate::pseudonym::subject`].

use crate::settings::{LogFormat, TraceSettings};
use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::subscriber::Interest;
use tracing::{Instrument, Level, Metadata, span};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// The service name on every exported span.
pub const SERVICE_NAME: &str = "maas-companion";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (the HTTP span layer is added to the routers only then).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The exporting tracer provider, flushed at exit.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Exports what is buffered and stops the exporter (blocking: call off the async runtime).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "trace exporter did not shut down cleanly");
        }
    }
}

/// The subscriber under the output layers: the registry behind the [`Gate`].
type Gated = tracing_subscriber::layer::Layered<Gate, Registry>;
type BoxedLayer = Box<dyn Layer<Gated> + Send + Sync>;

/// Spans the export takes: the companion's own, at info and above.
fn exported_span(m: &Metadata<'_>) -> bool {
    m.is_span() && m.target().starts_with("maas_companion") && *m.level() <= Level::INFO
}

/// The one (global) filter: events as `RUST_LOG` says (default `info,sqlx=warn`); spans only
/// when they are exported ([`exported_span`]), whatever `RUST_LOG` says. Global, not per layer:
/// a per-layer filter dropped log lines after sqlx's query logging asked whether it was enabled.
pub struct Gate {
    env: EnvFilter,
    spans: bool,
}

impl<S> Layer<S> for Gate
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
        if m.is_span() {
            if self.spans && exported_span(m) {
                Interest::always()
            } else {
                Interest::never()
            }
        } else {
            Layer::<S>::register_callsite(&self.env, m)
        }
    }

    fn enabled(&self, m: &Metadata<'_>, cx: Context<'_, S>) -> bool {
        if m.is_span() {
            self.spans && exported_span(m)
        } else {
            Layer::<S>::enabled(&self.env, m, cx)
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        let env = Layer::<S>::max_level_hint(&self.env);
        match env {
            Some(level) if self.spans => Some(level.max(LevelFilter::INFO)),
            other => other,
        }
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: Context<'_, S>) {
        Layer::<S>::on_new_span(&self.env, attrs, id, cx);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: Context<'_, S>) {
        Layer::<S>::on_record(&self.env, id, values, cx);
    }

    fn on_enter(&self, id: &span::Id, cx: Context<'_, S>) {
        Layer::<S>::on_enter(&self.env, id, cx);
    }

    fn on_exit(&self, id: &span::Id, cx: Context<'_, S>) {
        Layer::<S>::on_exit(&self.env, id, cx);
    }

    fn on_close(&self, id: span::Id, cx: Context<'_, S>) {
        Layer::<S>::on_close(&self.env, id, cx);
    }
}

/// The log lines' layer (the span a line was logged in is not written: the lines are the same
/// with or without trace export; the text format names it when spans are exported).
fn log_layer(format: LogFormat) -> BoxedLayer {
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Json => layer
            .json()
            .with_current_span(false)
            .with_span_list(false)
            .boxed(),
        LogFormat::Text => layer
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
    }
}

/// The tracer provider exporting to `endpoint`.
fn provider(endpoint: &str, ratio: f64) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    // An https endpoint is reached with the process's rustls provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("--otlp-traces-endpoint {endpoint}: {e}"))?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio,
        ))))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(SERVICE_NAME)
                .build(),
        )
        .build())
}

/// The OpenTelemetry layer over `provider`.
pub fn trace_layer(provider: &SdkTracerProvider) -> BoxedLayer {
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SERVICE_NAME))
        .boxed()
}

/// Sets up the logs, and the trace export when configured (`None`: no export). Once per
/// process (the binary's start).
pub fn init(format: LogFormat, traces: &TraceSettings) -> Result<Option<Telemetry>, String> {
    let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn".into());
    let mut layers = vec![log_layer(format)];
    let telemetry = match &traces.endpoint {
        Some(endpoint) => {
            let provider = provider(endpoint, traces.sample_ratio)?;
            layers.push(trace_layer(&provider));
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            ENABLED.store(true, Ordering::Relaxed);
            Some(Telemetry { provider })
        }
        None => None,
    };
    let gate = Gate {
        env,
        spans: telemetry.is_some(),
    };
    tracing_subscriber::registry()
        .with(gate)
        .with(layers)
        .try_init()
        .map_err(|e| format!("logging: {e}"))?;
    Ok(telemetry)
}

/// Reads trace context from request headers.
struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The caller's trace context (`traceparent`, `tracestate`): an absent or invalid one is an
/// empty context, so the span starts a new trace.
pub fn caller_context(headers: &axum::http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// Middleware: one `http.request` span per request, child of the caller's trace context.
pub async fn http_span(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let method = req.method().as_str().to_string();
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        maas.user = tracing::field::Empty,
    );
    let _ = span.set_parent(caller_context(req.headers()));
    let response = next.run(req).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    response
}

/// Names the caller on the current span (`maas.user`) by pseudonym, when spans are recorded.
pub fn record_user(name: &str) {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("maas.user", crate::pseudonym::subject(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::body::Body;
    use axum::routing::get;
    use opentelemetry::trace::{SpanId, TraceId};
    use opentelemetry_sdk::trace::InMemorySpanExporter;
    use tower::ServiceExt;

    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT_ID: &str = "00f067aa0ba902b7";

    /// The spans of one request with `traceparent` through a router with the span layer.
    async fn spans_of(traceparent: &str) -> Vec<opentelemetry_sdk::trace::SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        // Spans are exported whatever RUST_LOG lets the log lines show.
        let gate = Gate {
            env: EnvFilter::new("warn"),
            spans: true,
        };
        let subscriber = tracing_subscriber::registry()
            .with(gate)
            .with(trace_layer(&provider));
        let _guard = tracing::subscriber::set_default(subscriber);
        let app = Router::new()
            .route("/v1/things/{id}", get(|| async { "ok" }))
            .layer(axum::middleware::from_fn(http_span));
        let req = axum::http::Request::get("/v1/things/7")
            .header("traceparent", traceparent)
            .body(Body::empty())
            .unwrap();
        let resp = app.oneshot(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        provider.force_flush().unwrap();
        exporter.get_finished_spans().unwrap()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_valid_traceparent_is_continued_and_an_invalid_one_starts_a_new_trace() {
        let valid = format!("00-{TRACE_ID}-{PARENT_ID}-01");
        let spans = spans_of(&valid).await;
        assert_eq!(spans.len(), 1, "{spans:?}");
        let span = &spans[0];
        assert_eq!(
            span.span_context.trace_id(),
            TraceId::from_hex(TRACE_ID).unwrap()
        );
        assert_eq!(span.parent_span_id, SpanId::from_hex(PARENT_ID).unwrap());
        assert_eq!(span.name, "GET /v1/things/{id}");
        let attr = |k: &str| {
            span.attributes
                .iter()
                .find(|kv| kv.key.as_str() == k)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(attr("http.route").as_deref(), Some("/v1/things/{id}"));
        assert_eq!(attr("http.response.status_code").as_deref(), Some("200"));

        // Version ff, and a malformed one: a new trace, no parent.
        for bad in [
            format!("ff-{TRACE_ID}-{PARENT_ID}-01"),
            "00-garbage".to_string(),
        ] {
            let spans = spans_of(&bad).await;
            assert_eq!(spans.len(), 1, "{spans:?}");
            let span = &spans[0];
            assert_ne!(
                span.span_context.trace_id(),
                TraceId::from_hex(TRACE_ID).unwrap()
            );
            assert!(span.span_context.is_valid());
            assert_eq!(span.parent_span_id, SpanId::INVALID, "{bad}");
        }
    }
}
