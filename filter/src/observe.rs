//! Tracing: what the gateway's request span learns from the filter, and the client's trace
//! context on the authentication callout. Plain functions (unit-tested natively) and one
//! function that hands the attributes to the host.
//!
//! Trace attributes (policy `observability.traceAttributes`, off by default): set once, at the
//! end of the request (its settlement or its refusal), each as a stream property
//! `[<attribute>]`, which Envoy keeps in the stream's filter state as `wasm.<attribute>`; the
//! tracer's custom tags read them with `%FILTER_STATE(wasm.<attribute>:PLAIN)%`
//! (docs/contracts.md "Trace attributes"). Off costs no host call.

use crate::host::{HeaderMap, Host};
use crate::operations::Operation;

/// The model the policy names (its `name`).
pub const MODEL: &str = "gen_ai.request.model";
/// What the request asks for ([`operation_name`]).
pub const OPERATION: &str = "gen_ai.operation.name";
/// The caller as the companion's keyed pseudonym (never the subject).
pub const USER: &str = "maas.user";
/// `allowed`, or the refusal's code (`invalid_api_key`, `rate_limit_exceeded`, …).
pub const DECISION: &str = "maas.decision";
/// The usage the response reported (else what was settled), unweighted.
pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";

/// Every attribute the filter may set, for the tracer's custom tags.
pub const ATTRIBUTES: [&str; 6] = [
    MODEL,
    OPERATION,
    USER,
    DECISION,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
];

/// W3C trace context headers the authentication callout carries when the client sent them.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// A `tracestate` longer than this is not forwarded (W3C: 32 members of at most 256 bytes).
const TRACESTATE_MAX: usize = 512;

/// What the request span is told at the end of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Attributes<'a> {
    pub model: Option<&'a str>,
    pub operation: Option<Operation>,
    /// The caller's pseudonym (the authenticate answer's `pseudonym`), when known.
    pub user: Option<&'a str>,
    /// `allowed` or the refusal's code.
    pub decision: &'a str,
    /// (input, output) tokens of a settled request.
    pub tokens: Option<(u64, u64)>,
}

/// The (attribute, value) pairs to set, in [`ATTRIBUTES`] order; unknown ones are left out.
pub fn attributes(a: &Attributes<'_>) -> Vec<(&'static str, String)> {
    let mut out = Vec::with_capacity(ATTRIBUTES.len());
    if let Some(m) = a.model {
        out.push((MODEL, m.to_string()));
    }
    if let Some(op) = a.operation {
        // The metrics' `operation` label's names (`Operation::metric_name`).
        out.push((OPERATION, op.metric_name().to_string()));
    }
    if let Some(u) = a.user.filter(|u| !u.is_empty()) {
        out.push((USER, u.to_string()));
    }
    if !a.decision.is_empty() {
        out.push((DECISION, a.decision.to_string()));
    }
    if let Some((input, output)) = a.tokens {
        out.push((INPUT_TOKENS, input.to_string()));
        out.push((OUTPUT_TOKENS, output.to_string()));
    }
    out
}

/// Hands the attributes to the host: one property each.
pub fn set(host: &dyn Host, a: &Attributes<'_>) {
    for (name, value) in attributes(a) {
        host.set_property(&[name], value.as_bytes());
    }
}

/// A syntactically valid W3C `traceparent` of version 00: `00-<32 hex>-<16 hex>-<2 hex>`, 55
/// characters, lowercase hex, trace id and parent id not all zeros. Anything else is not
/// forwarded (the companion then starts a trace of its own).
pub fn valid_traceparent(v: &str) -> bool {
    let b = v.as_bytes();
    if b.len() != 55 {
        return false;
    }
    let hex = |s: &[u8]| {
        s.iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    let all_zero = |s: &[u8]| s.iter().all(|c| *c == b'0');
    let (Some(version), Some(trace_id), Some(parent_id), Some(flags)) =
        (b.get(0..2), b.get(3..35), b.get(36..52), b.get(53..55))
    else {
        return false;
    };
    let dashes = [2, 35, 52].iter().all(|i| b.get(*i) == Some(&b'-'));
    dashes
        && version == b"00"
        && hex(trace_id)
        && hex(parent_id)
        && hex(flags)
        && !all_zero(trace_id)
        && !all_zero(parent_id)
}

/// A `tracestate` worth forwarding: printable ASCII, bounded.
fn valid_tracestate(v: &str) -> bool {
    !v.is_empty() && v.len() <= TRACESTATE_MAX && v.bytes().all(|c| (0x20..0x7f).contains(&c))
}

/// The client's trace context for the authentication callout, read from the headers the
/// request already holds (no host call): `traceparent` when valid, and then `tracestate` when
/// sane; nothing otherwise.
pub fn trace_context(headers: &HeaderMap) -> Vec<(&'static str, &str)> {
    let [parent, state] = headers.get_each([TRACEPARENT, TRACESTATE]);
    let Some(parent) = parent.filter(|p| valid_traceparent(p)) else {
        return Vec::new();
    };
    let mut out = vec![(TRACEPARENT, parent)];
    if let Some(state) = state.filter(|s| valid_tracestate(s)) {
        out.push((TRACESTATE, state));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn only_a_well_formed_version_00_traceparent_is_valid() {
        assert!(valid_traceparent(VALID));
        assert!(valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        ));
        for bad in [
            "",
            "garbage",
            // Version ff is forbidden, others are not what we parse.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // Uppercase hex, a non-hex character, a missing dash.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736x00f067aa0ba902b7-01",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // One character too many or too few; trailing data.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            // Multi-byte text of the right byte length.
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
        ] {
            assert!(!valid_traceparent(bad), "{bad:?}");
        }
    }

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let wire: Vec<(&[u8], &[u8])> = pairs
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        HeaderMap::from_wire(crate::host::encode(wire.iter().copied()))
    }

    #[test]
    fn the_callout_carries_the_clients_trace_context_only_when_valid() {
        let h = map(&[("traceparent", VALID), ("tracestate", "vendor=abc")]);
        assert_eq!(
            trace_context(&h),
            vec![(TRACEPARENT, VALID), (TRACESTATE, "vendor=abc")]
        );
        // A tracestate alone, or beside an invalid traceparent, is not forwarded.
        assert!(trace_context(&map(&[("tracestate", "vendor=abc")])).is_empty());
        let bad = map(&[("traceparent", "00-xyz"), ("tracestate", "vendor=abc")]);
        assert!(trace_context(&bad).is_empty());
        // A control character or an oversized tracestate is dropped, the traceparent kept.
        let long = "a=".to_string() + &"b".repeat(TRACESTATE_MAX);
        for state in ["v=a\u{1}b", long.as_str()] {
            let h = map(&[("traceparent", VALID), ("tracestate", state)]);
            assert_eq!(trace_context(&h), vec![(TRACEPARENT, VALID)]);
        }
        assert!(trace_context(&map(&[])).is_empty());
    }

    #[test]
    fn attributes_name_what_is_known_and_never_more() {
        let settled = Attributes {
            model: Some("sim"),
            operation: Some(Operation::ChatCompletions),
            user: Some("u-0123456789abcdef"),
            decision: "allowed",
            tokens: Some((5, 7)),
        };
        assert_eq!(
            attributes(&settled),
            vec![
                (MODEL, "sim".to_string()),
                (OPERATION, "chat".to_string()),
                (USER, "u-0123456789abcdef".to_string()),
                (DECISION, "allowed".to_string()),
                (INPUT_TOKENS, "5".to_string()),
                (OUTPUT_TOKENS, "7".to_string()),
            ]
        );
        // A refusal before the caller or the model is known: the decision alone.
        let refused = Attributes {
            decision: "missing_credential",
            user: Some(""),
            ..Attributes::default()
        };
        assert_eq!(
            attributes(&refused),
            vec![(DECISION, "missing_credential".to_string())]
        );
        assert!(attributes(&Attributes::default()).is_empty());
        assert_eq!(Operation::Embeddings.metric_name(), "embeddings");
        assert_eq!(Operation::Completions.metric_name(), "text_completion");
        assert_eq!(Operation::Messages.metric_name(), "chat");
    }
}
