//! The filter-observed variant: the filter with everything an operator can turn on to watch
//! requests — the policy's `observability` (a usage event and the trace attributes on every
//! request) and, on Envoy's side, the usage-event access log (a file) and the OpenTelemetry
//! tracer exporting every span to an OTLP receiver. The policy lives in the companion, so this
//! Envoy talks to a stack of its own (its companion serves the same policy with observability
//! on); same model, same simulator kind, its own cached key. Compared with filter-cached and
//! bare Envoy in the same rounds: what watching costs per request.

use crate::envoy::{BenchEnvoy, EnvoyInputs, Observe, start_envoy, url_addr};
use crate::log;
use crate::run::Ctx;
use anyhow::Result;
use maas_e2e::otlp::OtlpReceiver;
use maas_e2e::{Stack, StackOptions};

pub(crate) const FILTER_OBSERVED: &str = "filter-observed";

/// What runs for the variant until the end (dropped in this order: Envoy, receiver, stack).
pub(crate) struct Observed {
    pub(crate) envoy: BenchEnvoy,
    _receiver: OtlpReceiver,
    stack: Stack,
    /// `Authorization` of the key minted on this stack.
    pub(crate) auth: String,
}

impl Drop for Observed {
    fn drop(&mut self) {
        self.stack.shutdown();
    }
}

/// What the variant turns on (`BENCH_OBSERVED`: `all`, the default; `events`: usage events and
/// the access log only; `traces`: trace attributes and the tracer only) — to tell their costs
/// apart.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Watch {
    All,
    Events,
    Traces,
}

impl Watch {
    pub(crate) fn from_env() -> anyhow::Result<Watch> {
        match std::env::var("BENCH_OBSERVED").as_deref() {
            Err(_) | Ok("" | "all") => Ok(Watch::All),
            Ok("events") => Ok(Watch::Events),
            Ok("traces") => Ok(Watch::Traces),
            Ok(other) => anyhow::bail!("BENCH_OBSERVED={other}: expected all, events or traces"),
        }
    }
    fn events(self) -> bool {
        self != Watch::Traces
    }
    fn traces(self) -> bool {
        self != Watch::Events
    }
}

/// The benchmark's policy with the per-request observability switches `watch` names on.
pub(crate) fn observed_policy(policy: &str, watch: Watch) -> String {
    format!(
        "{policy}observability: {{usageEvents: {}, traceAttributes: {}}}\n",
        watch.events(),
        watch.traces()
    )
}

pub(crate) fn start(ctx: &Ctx<'_>, policy: &str, identities: &str) -> Result<Observed> {
    let watch = Watch::from_env()?;
    log(format!(
        "starting the filter-observed stack ({watch:?}: its companion's policy turns it on; OTLP receiver; Envoy with the access log and/or the tracer, CPU 0) …"
    ));
    let stack = Stack::start(StackOptions {
        envoy_concurrency: 1,
        companion_env: vec![
            ("MAAS_KEY_CACHE_TTL_SECONDS".into(), "3600".into()),
            ("RUST_LOG".into(), "warn".into()),
        ],
        internal_mtls: false,
        ..StackOptions::default()
            .with_policy_yaml(&observed_policy(policy, watch))
            .with_identities_yaml(identities)
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let key = runtime.block_on(stack.mint_key_plain("bench-token", "bench-observed"))?;
    let receiver = OtlpReceiver::start()?;
    let mut inputs: EnvoyInputs<'_> = ctx.inputs.for_replica(
        url_addr(&stack.companion_public_url())?,
        url_addr(&stack.companion_internal_url())?,
        serde_json::json!({}),
    );
    inputs.simulator = stack.sim().addr();
    inputs.observe = Some(Observe {
        events_path: watch
            .events()
            .then(|| ctx.dir.join("observed-usage-events.jsonl")),
        traces_url: watch.traces().then(|| receiver.url()),
    });
    let envoy = start_envoy(&inputs, "envoy-observed", true, 1000)?;
    Ok(Observed {
        envoy,
        _receiver: receiver,
        stack,
        auth: format!("Bearer {key}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_observed_policy_turns_both_switches_on() {
        let doc = |w| -> maas_types::PolicyDocument {
            yaml_serde::from_str(&observed_policy(crate::POLICY, w)).expect("a policy")
        };
        let all = doc(Watch::All).observability;
        assert!(all.usage_events && all.trace_attributes);
        let events = doc(Watch::Events).observability;
        assert!(events.usage_events && !events.trace_attributes);
        let traces = doc(Watch::Traces).observability;
        assert!(!traces.usage_events && traces.trace_attributes);
    }
}
