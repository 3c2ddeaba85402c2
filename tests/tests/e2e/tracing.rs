//! Traces (issue 32) through real parts: Envoy's OpenTelemetry tracer and the companion's
//! OTLP exporter both send to an OTLP/HTTP receiver inside the test. A client's `traceparent`
//! joins the gateway's span and the companion's authentication spans in one trace (the filter
//! forwards it on its callout); the gateway's span carries the request's attributes when the
//! policy asks (`observability.traceAttributes`), the user only as a pseudonym; a key API call
//! through the gateway is a child of the gateway's span; with the attributes and the
//! companion's export off, neither shows.

use crate::helpers::*;
use maas_e2e::module_stack::Stoppable;
use maas_e2e::otlp::{OtlpReceiver, ReceivedSpan};
use maas_e2e::{Stack, StackOptions};
use serde_json::{Value, json};
use std::time::Duration;

const TIERS_AND_MODELS: &str = r#"
tiers:
  - name: traced
    level: 0
    groups: [system:authenticated]
    limits:
      requests: [{limit: 1000, window: 1m}]
      tokens: [{limit: 1000000, window: 1m}]
models:
  - name: sim-model
    path: /llm/sim-model
    tiers: [traced]
    backend: simulator
"#;

const IDENTITIES: &str = r#"
identities:
  - {token: tracy-token, username: tracy, groups: [system:authenticated]}
"#;

const CHAT: &str = "/llm/sim-model/v1/chat/completions";
const GATEWAY: &str = "maas-gateway";
const COMPANION: &str = "maas-companion";
const WAIT: Duration = Duration::from_secs(30);

/// A stack whose Envoy (and, when `companion_export`, companion) sends spans to `receiver`.
struct Traced {
    stack: Stack,
    receiver: OtlpReceiver,
}

impl Stoppable for Traced {
    fn stop(&self) {
        self.stack.shutdown();
    }
}

fn start(trace_attributes: bool, companion_export: bool) -> Result<Traced, String> {
    std::thread::spawn(move || {
        let receiver = OtlpReceiver::start().map_err(|e| format!("{e:#}"))?;
        let policy =
            format!("observability:\n  traceAttributes: {trace_attributes}\n{TIERS_AND_MODELS}");
        let mut options = StackOptions::default()
            .with_policy_yaml(&policy)
            .with_identities_yaml(IDENTITIES)
            .with_credentials_yaml("credentials: {}\n");
        options.envoy_traces_url = Some(receiver.url());
        if companion_export {
            options.companion_env = vec![
                ("MAAS_OTLP_TRACES_ENDPOINT".into(), receiver.url()),
                // The batch goes out every 200 ms (the SDK's OTEL_BSP_SCHEDULE_DELAY).
                ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
            ];
        }
        let stack = Stack::start(options).map_err(|e| format!("{e:#}"))?;
        Ok(Traced { stack, receiver })
    })
    .join()
    .unwrap_or_else(|_| Err("stack start panicked".into()))
}

fn traced() -> &'static Traced {
    static S: ModuleStack<Traced> = ModuleStack::new();
    S.get_or_start(|| start(true, true))
}

fn untraced() -> &'static Traced {
    static S: ModuleStack<Traced> = ModuleStack::new();
    S.get_or_start(|| start(false, false))
}

/// A random-enough trace id for one test (hex, 32 digits, not all zeros).
fn trace_id(seed: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(1);
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in seed.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("{:016x}{:016x}", h, nanos as u64 | 1)
}

const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent(trace: &str) -> String {
    format!("00-{trace}-{CLIENT_SPAN}-01")
}

fn of<'a>(spans: &'a [ReceivedSpan], service: &str, trace: &str) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|s| s.service == service && s.trace_id == trace)
        .collect()
}

/// Mints an API key for tracy through the gateway.
async fn mint(stack: &Stack) -> String {
    let r = send(
        client()
            .post(format!("{}/maas-api/v1/api-keys", stack.gateway_url()))
            .header("authorization", bearer("tracy-token"))
            .json(&json!({"name": "traced"})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()["key"].as_str().unwrap().to_string()
}

async fn chat_traced(stack: &Stack, key: &str, trace: &str) -> Value {
    let parent = traceparent(trace);
    let auth = bearer(key);
    let r = chat(
        stack,
        CHAT,
        "tracing",
        &[("authorization", &auth), ("traceparent", &parent)],
        json!({"model": "sim-model", "max_tokens": 7,
               "messages": [{"role": "user", "content": "hello traces"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// A fresh key's first request (a cache miss: the filter asks the companion) with the client's
/// trace context: Envoy's span and the companion's authenticate spans are in the client's
/// trace, and Envoy's span has the request's attributes, the user as the companion's pseudonym.
#[tokio::test]
async fn a_clients_trace_joins_the_gateway_and_the_companions_authentication() {
    let t = traced();
    let key = mint(&t.stack).await;
    let trace = trace_id("join");
    let answer = chat_traced(&t.stack, &key, &trace).await;
    let spans = t.receiver.wait_for(WAIT, |s| {
        !of(s, GATEWAY, &trace).is_empty()
            && of(s, COMPANION, &trace)
                .iter()
                .any(|s| s.name == "authenticate")
    });
    let gateway = of(&spans, GATEWAY, &trace);
    assert_eq!(gateway.len(), 1, "{spans:#?}");
    let gw = gateway[0];
    assert_eq!(gw.parent_span_id, CLIENT_SPAN, "{gw:#?}");
    let usage = &answer["usage"];
    assert_eq!(
        gw.attr("gen_ai.request.model"),
        Some("sim-model"),
        "{gw:#?}"
    );
    assert_eq!(gw.attr("gen_ai.operation.name"), Some("chat"));
    assert_eq!(gw.attr("maas.decision"), Some("allowed"));
    assert_eq!(
        gw.attr("gen_ai.usage.input_tokens"),
        Some(usage["prompt_tokens"].to_string().as_str()),
        "{answer}"
    );
    assert_eq!(
        gw.attr("gen_ai.usage.output_tokens"),
        Some(usage["completion_tokens"].to_string().as_str()),
        "{answer}"
    );
    let user = gw.attr("maas.user").unwrap_or_default();
    assert!(
        user.starts_with("u-") && user.len() == 18 && !user.contains("tracy"),
        "{user:?}"
    );

    let companion = of(&spans, COMPANION, &trace);
    let auth = companion
        .iter()
        .find(|s| s.name == "authenticate")
        .unwrap_or_else(|| panic!("{companion:#?}"));
    assert_eq!(auth.attr("maas.result"), Some("ok"));
    // The same pseudonym on both sides, and never the name or the key.
    assert_eq!(auth.attr("maas.user"), Some(user));
    let http = companion
        .iter()
        .find(|s| s.name == "POST /internal/v1/authenticate")
        .unwrap_or_else(|| panic!("{companion:#?}"));
    assert_eq!(auth.parent_span_id, http.span_id);
    assert_eq!(http.attr("http.response.status_code"), Some("200"));
    for s in spans.iter().filter(|s| s.service == COMPANION) {
        for v in s.attributes.values() {
            assert!(!v.contains(&key) && !v.contains("tracy"), "{s:#?}");
        }
    }
}

/// A key API call through the gateway: Envoy injects its span's context upstream, so the
/// companion's request span is the gateway span's child. A call straight to the companion
/// with an invalid `traceparent` starts a new trace (no parent).
#[tokio::test]
async fn a_key_api_call_through_the_gateway_is_a_child_of_the_gateways_span() {
    let t = traced();
    let trace = trace_id("keys");
    let r = send(
        client()
            .get(format!("{}/maas-api/v1/models", t.stack.gateway_url()))
            .header("authorization", bearer("tracy-token"))
            .header("traceparent", traceparent(&trace)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let spans = t.receiver.wait_for(WAIT, |s| {
        !of(s, GATEWAY, &trace).is_empty()
            && of(s, COMPANION, &trace)
                .iter()
                .any(|s| s.name == "GET /v1/models")
    });
    let gateway = of(&spans, GATEWAY, &trace);
    assert_eq!(gateway.len(), 1, "{spans:#?}");
    let companion = of(&spans, COMPANION, &trace);
    let http = companion
        .iter()
        .find(|s| s.name == "GET /v1/models")
        .unwrap_or_else(|| panic!("{spans:#?}"));
    assert_eq!(http.parent_span_id, gateway[0].span_id, "{spans:#?}");
    assert_eq!(http.attr("http.route"), Some("/v1/models"));
    let user = http.attr("maas.user").unwrap_or_default();
    assert!(
        user.starts_with("u-") && !user.contains("tracy"),
        "{http:#?}"
    );

    let bad = send(
        client()
            .get(format!("{}/v1/models", t.stack.companion_public_url()))
            .header("authorization", bearer("tracy-token"))
            .header("traceparent", format!("ff-{trace}-{CLIENT_SPAN}-01")),
    )
    .await;
    assert_eq!(bad.status, 200, "{}", bad.body);
    let spans = t.receiver.wait_for(WAIT, |s| {
        s.iter().any(|s| {
            s.service == COMPANION && s.name == "GET /v1/models" && s.parent_span_id.is_empty()
        })
    });
    let fresh = spans
        .iter()
        .find(|s| {
            s.service == COMPANION && s.name == "GET /v1/models" && s.parent_span_id.is_empty()
        })
        .unwrap_or_else(|| panic!("{spans:#?}"));
    assert_ne!(fresh.trace_id, trace);
}

/// The policy's attributes off and the companion's export off: Envoy's span has none of the
/// filter's attributes, and nothing of the companion reaches the receiver.
#[tokio::test]
async fn with_the_attributes_and_the_export_off_neither_shows() {
    let t = untraced();
    let key = mint(&t.stack).await;
    let trace = trace_id("off");
    chat_traced(&t.stack, &key, &trace).await;
    let spans = t
        .receiver
        .wait_for(WAIT, |s| !of(s, GATEWAY, &trace).is_empty());
    let gateway = of(&spans, GATEWAY, &trace);
    assert_eq!(gateway.len(), 1, "{spans:#?}");
    for name in maas_e2e::envoy_config::TRACE_ATTRIBUTES {
        let v = gateway[0].attr(name).unwrap_or_default();
        assert!(v.is_empty(), "{name}={v:?} with traceAttributes off");
    }
    assert!(!spans.iter().any(|s| s.service == COMPANION), "{spans:#?}");
    // The mint's and the authentication's spans were the companion's to send: none came.
    assert!(
        spans
            .iter()
            .any(|s| s.service == GATEWAY && s.trace_id != trace)
    );
}
