//! Decisions once the caller is known: authorisation, body checks, and what to settle.

use crate::cache::CachedIdentity;
use crate::limits;
use crate::request_body::RequestInfo;
use crate::response::Refusal;
use crate::usage::Usage;
use maas_types::{Model, PolicyDocument, Tier};

/// The caller's tier, which must be allowed on the model.
pub fn authorize<'p>(
    policy: &'p PolicyDocument,
    identity: &CachedIdentity,
    model: &Model,
) -> Result<&'p Tier, Refusal> {
    let tier = policy
        .resolve_tier(&identity.groups, identity.pinned_tier.as_deref())
        .ok_or_else(|| Refusal::forbidden("no_tier", "no tier: your groups qualify for none"))?;
    if !model.tiers.iter().any(|t| t == &tier.name) {
        return Err(Refusal::forbidden(
            "model_not_allowed",
            format!("tier {} may not use model {}", tier.name, model.name),
        ));
    }
    Ok(tier)
}

/// A body naming another model than the path's is refused, so one model cannot be billed as another.
pub fn check_body_model(info: &RequestInfo, model: &Model) -> Result<(), Refusal> {
    match &info.model {
        Some(m) if m != &model.name => Err(Refusal::bad_request(
            "model_mismatch",
            format!(
                "body names model {m:?} but the path is for {:?}",
                model.name
            ),
        )),
        _ => Ok(()),
    }
}

/// Tokens reserved at admission: the prompt estimate (from the body's text, see
/// [`crate::request_body::PROMPT_BYTES_PER_TOKEN`]) plus the completion budget — `max_tokens`
/// (else the tier default, else a fallback) for every choice asked for (`n` / `best_of`). A request
/// without a readable body (uploads, discovery) reserves the completion budget only.
pub fn reservation(info: Option<&RequestInfo>, tier: &Tier) -> u64 {
    let completion = limits::reservation_for(info.and_then(|i| i.max_tokens), tier);
    let (prompt, choices) = info.map_or((0, 1), |i| (i.prompt_tokens_estimate, i.choices.max(1)));
    prompt.saturating_add(completion.saturating_mul(choices))
}

/// What the response showed of token use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    pub usage: Option<Usage>,
    /// Content events of a stream (≈ completion tokens when usage never came).
    pub content_events: u64,
    /// Response status (0: no response at all).
    pub status: u32,
    /// The prompt estimate made at admission (used when usage never came).
    pub prompt_tokens_estimate: u64,
}

/// Tokens to settle a reservation to. Work the backend started is never free:
/// - the usage, when the response carried it;
/// - a stream cut short (client gone, upstream reset) after content: the prompt estimate plus one
///   token per content event forwarded;
/// - no response at all (the client went away, or the upstream reset, before the response
///   headers: the backend may have done the whole work): the reservation;
/// - a successful response without readable usage: the reservation;
/// - an upstream error status (≥ 400) without content: nothing (the backend refused the work).
pub fn settle_amount(seen: &Seen, reserved: u64) -> u64 {
    if let Some(u) = seen.usage {
        let total = u
            .total_tokens
            .max(u.prompt_tokens.saturating_add(u.completion_tokens));
        return total;
    }
    if seen.content_events > 0 {
        return seen
            .content_events
            .saturating_add(seen.prompt_tokens_estimate)
            .max(1);
    }
    if seen.status >= 400 {
        return 0;
    }
    reserved
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> PolicyDocument {
        PolicyDocument::from_value(json!({
            "tiers": [
                {"name": "free", "level": 0, "groups": ["system:authenticated"]},
                {"name": "premium", "level": 1, "groups": ["premium"]}
            ],
            "models": [
                {"name": "sim", "path": "/llm/sim", "tiers": ["free", "premium"]},
                {"name": "big", "path": "/llm/big", "tiers": ["premium"]}
            ]
        }))
        .unwrap()
    }

    fn who(groups: &[&str], pinned: Option<&str>) -> CachedIdentity {
        CachedIdentity {
            subject: "alice".into(),
            groups: groups.iter().map(|s| s.to_string()).collect(),
            pinned_tier: pinned.map(str::to_string),
        }
    }

    #[test]
    fn tiers_and_models() {
        let p = policy();
        let sim = p.model("sim").unwrap();
        let big = p.model("big").unwrap();
        let free = who(&["system:authenticated"], None);
        let both = who(&["system:authenticated", "premium"], None);
        assert_eq!(authorize(&p, &free, sim).unwrap().name, "free");
        assert_eq!(
            authorize(&p, &free, big).unwrap_err().code,
            "model_not_allowed"
        );
        assert_eq!(authorize(&p, &both, big).unwrap().name, "premium");
        // Pinned to free: the premium model is refused although the groups would allow it.
        let pinned = who(&["system:authenticated", "premium"], Some("free"));
        assert_eq!(authorize(&p, &pinned, big).unwrap_err().status, 403);
        assert_eq!(
            authorize(&p, &who(&["x"], None), sim).unwrap_err().code,
            "no_tier"
        );
    }

    #[test]
    fn body_model() {
        let p = policy();
        let sim = p.model("sim").unwrap();
        let mut info = RequestInfo::default();
        assert!(check_body_model(&info, sim).is_ok());
        info.model = Some("sim".into());
        assert!(check_body_model(&info, sim).is_ok());
        info.model = Some("big".into());
        assert_eq!(check_body_model(&info, sim).unwrap_err().status, 400);
    }

    #[test]
    fn settlement() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 5,
            total_tokens: 8,
        };
        let seen = Seen {
            usage: Some(usage),
            status: 200,
            ..Default::default()
        };
        assert_eq!(settle_amount(&seen, 100), 8);
        let streamed = Seen {
            content_events: 7,
            status: 200,
            prompt_tokens_estimate: 10,
            ..Default::default()
        };
        assert_eq!(settle_amount(&streamed, 100), 17);
        assert_eq!(
            settle_amount(
                &Seen {
                    status: 500,
                    ..Default::default()
                },
                100
            ),
            0
        );
        // The client went away before the response: the backend's work is charged.
        assert_eq!(settle_amount(&Seen::default(), 100), 100);
        assert_eq!(
            settle_amount(
                &Seen {
                    status: 200,
                    ..Default::default()
                },
                100
            ),
            100
        );
    }

    #[test]
    fn reservation_counts_the_prompt_and_every_choice() {
        let p = policy();
        let free = p.tiers.iter().find(|t| t.name == "free").unwrap();
        let info = RequestInfo {
            max_tokens: Some(1),
            prompt_tokens_estimate: 60_000,
            choices: 1,
            ..Default::default()
        };
        // A huge prompt with max_tokens 1 reserves the prompt too.
        assert_eq!(reservation(Some(&info), free), 60_001);
        let n3 = RequestInfo {
            max_tokens: Some(100),
            prompt_tokens_estimate: 5,
            choices: 3,
            ..Default::default()
        };
        assert_eq!(reservation(Some(&n3), free), 305);
        assert_eq!(reservation(None, free), limits::reservation_for(None, free));
    }

    proptest::proptest! {
        /// Work the backend started is never free: whatever the response showed, a request that
        /// got no answer, or was cut mid-stream, settles to more than zero; only an upstream
        /// error without content settles to zero, and usage, when it came, is what counts.
        #[test]
        fn settlement_is_never_free_for_started_work(
            reserved in 1u64..1_000_000,
            status in proptest::prop_oneof![proptest::strategy::Just(0u32), 200u32..600],
            content_events in 0u64..10_000,
            prompt in 0u64..100_000,
            usage in proptest::option::of((0u64..100_000, 0u64..100_000)),
        ) {
            let seen = Seen {
                usage: usage.map(|(p, c)| Usage { prompt_tokens: p, completion_tokens: c, total_tokens: p + c }),
                content_events,
                status,
                prompt_tokens_estimate: prompt,
            };
            let amount = settle_amount(&seen, reserved);
            match (usage, content_events, status) {
                (Some((p, c)), _, _) => proptest::prop_assert_eq!(amount, p + c),
                (None, n, _) if n > 0 => proptest::prop_assert_eq!(amount, n + prompt),
                (None, 0, 0) => proptest::prop_assert_eq!(amount, reserved),
                (None, 0, s) if s >= 400 => proptest::prop_assert_eq!(amount, 0),
                (None, 0, _) => proptest::prop_assert_eq!(amount, reserved),
                _ => {}
            }
        }
    }
}
