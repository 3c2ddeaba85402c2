//! Decisions once the caller is known: authorisation (subscription, else tier), body checks,
//! and what to settle.

use crate::cache::CachedIdentity;
use crate::limits;
use crate::request_body::RequestInfo;
use crate::response::{Deny, Refusal};
use crate::usage::Usage;
use maas_types::subscription::{self, SelectError, Subscription};
use maas_types::{Model, PolicyDocument, Tier, TokenWeights, UncappedRequests};

/// The subscription a request on `model` runs under, when one applies (`None`: the tiers, as
/// before subscriptions):
/// - an API key bound to a subscription (`identity.subscription`): that one, while it exists,
///   still lists the key's owner (user or group) and includes the model; else 403
///   (`invalid_subscription` when it is gone or no longer the owner's,
///   `model_not_in_subscription`);
/// - another API key: the tiers (a client's `X-MaaS-Subscription` is ignored);
/// - a token with `requested` (`X-MaaS-Subscription`): the reference's selection of it, its
///   refusals as 403 `permission_error` with the reference's codes;
/// - a token without: the one accessible subscription that includes the model; several → 403
///   `multiple_subscriptions` (name one in `X-MaaS-Subscription`); none → the tiers.
///
/// A policy without subscriptions ignores the header (tier-only policies behave as before).
pub fn subscription<'p>(
    policy: &'p PolicyDocument,
    identity: &CachedIdentity,
    api_key: bool,
    requested: Option<&str>,
    model: &Model,
) -> Result<Option<&'p Subscription>, Refusal> {
    let (user, groups) = (identity.subject.as_str(), identity.groups.as_slice());
    if let Some(bound) = identity.subscription.as_deref() {
        return match subscription::select(policy, user, groups, Some(bound), Some(&model.name)) {
            Ok(s) => Ok(Some(s)),
            Err(SelectError::ModelNotInSubscription) => Err(Refusal::new(
                Deny::ModelNotInSubscription,
                format!(
                    "the subscription of this API key does not include model {}",
                    model.name
                ),
            )),
            Err(_) => Err(Refusal::new(
                Deny::InvalidSubscription,
                "the subscription of this API key no longer exists or no longer includes you",
            )),
        };
    }
    if api_key || policy.subscriptions.is_empty() {
        return Ok(None);
    }
    match subscription::select(policy, user, groups, requested, Some(&model.name)) {
        Ok(s) => Ok(Some(s)),
        // Nothing requested and no subscription of the caller holds the model: the tiers.
        Err(SelectError::NoSubscription) if requested.is_none() => Ok(None),
        Err(e) => Err(Refusal::new(Deny::from(e), e.message())),
    }
}

/// The caller's tier, which must be allowed on the model.
pub fn authorize<'p>(
    policy: &'p PolicyDocument,
    identity: &CachedIdentity,
    model: &Model,
) -> Result<&'p Tier, Refusal> {
    let tier = policy
        .resolve_tier(&identity.groups, identity.pinned_tier.as_deref())
        .ok_or_else(|| Refusal::new(Deny::NoTier, "no tier: your groups qualify for none"))?;
    if !model.tiers.iter().any(|t| t == &tier.name) {
        return Err(Refusal::new(
            Deny::ModelNotAllowed,
            format!("tier {} may not use model {}", tier.name, model.name),
        ));
    }
    Ok(tier)
}

/// A body naming another model than the path's (by none of its ids: its name or an alias) is
/// refused, so one model cannot be billed as another.
pub fn check_body_model(info: &RequestInfo, model: &Model) -> Result<(), Refusal> {
    match &info.model {
        Some(m) if !model.answers_to(m) => Err(Refusal::new(
            Deny::ModelMismatch,
            format!(
                "body names model {m:?} but the path is for {:?}",
                model.name
            ),
        )),
        _ => Ok(()),
    }
}

/// Raw (unweighted) token counts: input (prompt, cached and cache-written included) and output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
}

impl Tokens {
    /// In the limits' unit: `input × weights.input + output × weights.output`.
    pub fn weighted(&self, weights: TokenWeights) -> u64 {
        weights.weigh(self.input, self.output)
    }
}

/// Tokens reserved at admission (raw): the prompt estimate (from the body's text, see
/// [`crate::request_body::PROMPT_BYTES_PER_TOKEN`]) as input, and the completion budget —
/// the body's cap ([`crate::request_body::CAP_FIELDS`]: the largest of every API family's cap
/// fields; else the tier default, else a fallback) for every choice asked for (`n` /
/// `best_of`) — as output. A request without a readable body (uploads, discovery) reserves the
/// completion budget only. The limits take it weighted ([`Tokens::weighted`], [`weights`]).
///
/// The prompt is [`prompt_estimate`] (media parts and stored context included).
pub fn reservation(info: Option<&RequestInfo>, tier: &Tier, costs: PromptCosts) -> Tokens {
    let completion = limits::reservation_for(info.and_then(|i| i.max_tokens), tier);
    let (prompt, choices) = info.map_or((0, 1), |i| (prompt_estimate(i, costs), i.choices.max(1)));
    Tokens {
        input: prompt,
        output: completion.saturating_mul(choices),
    }
}

/// What a model's prompt may cost beyond its text ([`prompt_estimate`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptCosts {
    /// Per content part carrying media (`mediaTokens`).
    pub media_tokens: u64,
    /// The model's context window (`details.contextWindow`), when declared.
    pub context_window: Option<u64>,
}

impl PromptCosts {
    pub fn of(model: &maas_types::Model) -> Self {
        PromptCosts {
            media_tokens: model.media_tokens(),
            context_window: model.context_window_tokens(),
        }
    }
}

/// The prompt tokens a request is reserved: the text estimate, and `media_tokens` for each
/// content part carrying media (its cost is not in its bytes: an image URL is a few bytes, a
/// base64 image many, and neither says what the model charges); a request that makes the
/// provider read context it holds (`previous_response_id`…) at least the whole context window,
/// all the provider may read (admission refuses it when the model declares none).
pub fn prompt_estimate(info: &RequestInfo, costs: PromptCosts) -> u64 {
    let estimate = info
        .prompt_tokens_estimate
        .saturating_add(info.media_parts().saturating_mul(costs.media_tokens));
    match (info.stored_context(), costs.context_window) {
        (Some(_), Some(window)) => estimate.max(window),
        _ => estimate,
    }
}

/// The cap to set on a request whose body names none, when its tier (or subscription) injects
/// ([`UncappedRequests::Inject`]): the operation's cap field (`cap_field`, see
/// [`crate::operations::Operation::cap_field`]) and the completion budget per choice that
/// [`reservation`] reserves, so the backend generates no more than was reserved. `None`: the
/// body names a cap, the operation has no cap field, or the tier forwards as sent — unless the
/// backend requires a cap (`required`: a request translated to Anthropic Messages), which then
/// gets the reservation's whatever the tier says.
pub fn injected_cap(
    info: &RequestInfo,
    cap_field: Option<&'static str>,
    tier: &Tier,
    required: bool,
) -> Option<(&'static str, u64)> {
    if info.max_tokens.is_some()
        || (tier.uncapped_requests != UncappedRequests::Inject && !required)
    {
        return None;
    }
    Some((cap_field?, limits::reservation_for(None, tier)))
}

/// The token weights of a request counted against the windows of `tiers` (the tier it runs
/// on and the subject's highest tier; a subscription's stand-in tier alone): the larger weight
/// of each kind, so that, as with the windows, a pinned lower tier only restricts.
pub fn weights(tiers: &[&Tier]) -> TokenWeights {
    tiers
        .iter()
        .map(|t| t.token_weights)
        .reduce(TokenWeights::max)
        .unwrap_or_default()
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

/// Raw tokens to settle a reservation to. Work the backend started is never free:
/// - the usage, when the response carried it (input = prompt tokens; output = completion
///   tokens, or whatever the total holds beyond the prompt when that is more);
/// - a stream cut short (client gone, upstream reset) after content: the prompt estimate as
///   input plus one output token per content event forwarded;
/// - no response at all (the client went away, or the upstream reset, before the response
///   headers: the backend may have done the whole work): the reservation;
/// - a successful response without readable usage: the reservation;
/// - an upstream error status (≥ 400) without content: nothing (the backend refused the work).
pub fn settled_tokens(seen: &Seen, reserved: Tokens) -> Tokens {
    if let Some(u) = seen.usage {
        return Tokens {
            input: u.prompt_tokens,
            output: u
                .completion_tokens
                .max(u.total_tokens.saturating_sub(u.prompt_tokens)),
        };
    }
    if seen.content_events > 0 {
        return Tokens {
            input: seen.prompt_tokens_estimate,
            output: seen.content_events,
        };
    }
    if seen.status >= 400 {
        return Tokens::default();
    }
    reserved
}

#[cfg(test)]
/// What to settle a reservation to in the limits' unit: [`settled_tokens`] weighted.
pub fn settle_amount(seen: &Seen, reserved: Tokens, weights: TokenWeights) -> u64 {
    settled_tokens(seen, reserved).weighted(weights)
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
            subscription: None,
            pseudonym: None,
            key_scope: None,
        }
    }

    /// The tier policy plus two subscriptions: team-a (group team-a: sim) and premium-sub (user
    /// bob: sim and big).
    fn with_subscriptions() -> PolicyDocument {
        let mut v = serde_json::to_value(policy()).unwrap();
        v["subscriptions"] = json!([
            {"name": "team-a", "priority": 1, "owner": {"groups": ["team-a"]},
             "models": [{"name": "sim", "tokenRateLimits": [{"limit": 100, "window": "1m"}]}]},
            {"name": "premium-sub", "priority": 5, "owner": {"users": ["bob"]},
             "models": [{"name": "sim", "tokenRateLimits": [{"limit": 500, "window": "1m"}]},
                        {"name": "big", "tokenRateLimits": [{"limit": 900, "window": "1h"}]}]}
        ]);
        PolicyDocument::from_value(v).unwrap()
    }

    fn caller(subject: &str, groups: &[&str], bound: Option<&str>) -> CachedIdentity {
        CachedIdentity {
            subject: subject.into(),
            groups: groups.iter().map(|s| s.to_string()).collect(),
            pinned_tier: None,
            subscription: bound.map(str::to_string),
            pseudonym: None,
            key_scope: None,
        }
    }

    /// The selected subscription's name, or the refusal's (status, code).
    fn picked(
        p: &PolicyDocument,
        who: &CachedIdentity,
        api_key: bool,
        requested: Option<&str>,
        model: &str,
    ) -> Result<Option<String>, (u32, &'static str)> {
        subscription(p, who, api_key, requested, p.model(model).unwrap())
            .map(|s| s.map(|s| s.name.clone()))
            .map_err(|r| (r.status, r.code))
    }

    #[test]
    fn a_key_bound_to_a_subscription_runs_under_it_while_it_holds() {
        let p = with_subscriptions();
        let alice = caller("alice", &["system:authenticated", "team-a"], Some("team-a"));
        assert_eq!(
            picked(&p, &alice, true, None, "sim"),
            Ok(Some("team-a".into()))
        );
        // The client's header cannot move a bound key to another subscription.
        assert_eq!(
            picked(&p, &alice, true, Some("premium-sub"), "sim"),
            Ok(Some("team-a".into()))
        );
        assert_eq!(
            picked(&p, &alice, true, None, "big"),
            Err((403, "model_not_in_subscription"))
        );
        // The owner left the group: the key's subscription is no longer theirs.
        let left = caller("alice", &["system:authenticated"], Some("team-a"));
        assert_eq!(
            picked(&p, &left, true, None, "sim"),
            Err((403, "invalid_subscription"))
        );
        // The subscription is gone from the policy (even a tier-only one now).
        let gone = caller("alice", &["team-a"], Some("old-sub"));
        assert_eq!(
            picked(&p, &gone, true, None, "sim"),
            Err((403, "invalid_subscription"))
        );
        assert_eq!(
            picked(&policy(), &alice, true, None, "sim"),
            Err((403, "invalid_subscription"))
        );
    }

    #[test]
    fn a_key_without_a_subscription_follows_the_tiers_whatever_the_header_says() {
        let p = with_subscriptions();
        let bob = caller("bob", &["system:authenticated"], None);
        assert_eq!(picked(&p, &bob, true, None, "sim"), Ok(None));
        assert_eq!(picked(&p, &bob, true, Some("premium-sub"), "sim"), Ok(None));
    }

    #[test]
    fn a_token_selects_with_the_header_or_the_single_match() {
        let p = with_subscriptions();
        let bob = caller("bob", &["system:authenticated", "team-a"], None);
        // Two of bob's subscriptions hold sim: he must name one.
        assert_eq!(
            picked(&p, &bob, false, None, "sim"),
            Err((403, "multiple_subscriptions"))
        );
        assert_eq!(
            picked(&p, &bob, false, Some("team-a"), "sim"),
            Ok(Some("team-a".into()))
        );
        assert_eq!(
            picked(
                &p,
                &bob,
                false,
                Some("models-as-a-service/premium-sub"),
                "sim"
            ),
            Ok(Some("premium-sub".into()))
        );
        // Only one holds big.
        assert_eq!(
            picked(&p, &bob, false, None, "big"),
            Ok(Some("premium-sub".into()))
        );
        assert_eq!(
            picked(&p, &bob, false, Some("team-a"), "big"),
            Err((403, "model_not_in_subscription"))
        );
        assert_eq!(
            picked(&p, &bob, false, Some("gold"), "sim"),
            Err((403, "not_found"))
        );
        let alice = caller("alice", &["team-a"], None);
        // Someone else's subscription is answered as one that does not exist, message and all.
        assert_eq!(
            picked(&p, &alice, false, Some("premium-sub"), "sim"),
            Err((403, "not_found"))
        );
        let others = subscription(
            &p,
            &alice,
            false,
            Some("premium-sub"),
            p.model("sim").unwrap(),
        )
        .unwrap_err();
        let unknown =
            subscription(&p, &alice, false, Some("gold"), p.model("sim").unwrap()).unwrap_err();
        assert_eq!(others.body(), unknown.body());
        assert_eq!(others.status, unknown.status);
        // No subscription of the caller holds the model, or none at all: the tiers.
        assert_eq!(picked(&p, &alice, false, None, "big"), Ok(None));
        let carol = caller("carol", &["system:authenticated"], None);
        assert_eq!(picked(&p, &carol, false, None, "sim"), Ok(None));
        // A tier-only policy ignores the header.
        assert_eq!(
            picked(&policy(), &carol, false, Some("gold"), "sim"),
            Ok(None)
        );
    }

    #[test]
    fn the_companions_refusal_of_a_keys_subscription_is_invalid_subscription() {
        // The companion refuses a key whose subscription no longer resolves with the
        // selection's message (cached as status + message): the code follows it.
        for e in SelectError::ALL {
            let r = Refusal::from_companion(403, e.message());
            assert_eq!((r.status, r.code), (403, "invalid_subscription"), "{e:?}");
        }
        assert_eq!(Refusal::from_companion(403, "no tier").code, "no_tier");
    }

    #[test]
    fn the_multiple_subscriptions_refusal_asks_for_the_header() {
        let p = with_subscriptions();
        let bob = caller("bob", &["team-a"], None);
        let r = subscription(&p, &bob, false, None, p.model("sim").unwrap()).unwrap_err();
        let body: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(body["error"]["type"], "permission_error");
        assert_eq!(body["error"]["code"], "multiple_subscriptions");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("X-MaaS-Subscription")
        );
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

    const ONE: TokenWeights = TokenWeights {
        input: 1,
        output: 1,
    };
    const OUT4: TokenWeights = TokenWeights {
        input: 1,
        output: 4,
    };

    fn toks(input: u64, output: u64) -> Tokens {
        Tokens { input, output }
    }

    #[test]
    fn settlement() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 5,
            total_tokens: 8,
            cached_input_tokens: 0,
        };
        let seen = Seen {
            usage: Some(usage),
            status: 200,
            ..Default::default()
        };
        let reserved = toks(40, 60);
        assert_eq!(settle_amount(&seen, reserved, ONE), 8);
        let streamed = Seen {
            content_events: 7,
            status: 200,
            prompt_tokens_estimate: 10,
            ..Default::default()
        };
        assert_eq!(settle_amount(&streamed, reserved, ONE), 17);
        assert_eq!(
            settle_amount(
                &Seen {
                    status: 500,
                    ..Default::default()
                },
                reserved,
                ONE
            ),
            0
        );
        // The client went away before the response: the backend's work is charged.
        assert_eq!(settle_amount(&Seen::default(), reserved, ONE), 100);
        assert_eq!(
            settle_amount(
                &Seen {
                    status: 200,
                    ..Default::default()
                },
                reserved,
                ONE
            ),
            100
        );
    }

    #[test]
    fn weighted_settlement_weighs_input_and_output_of_every_outcome() {
        let reserved = toks(40, 60);
        // 10 prompt + 20 completion tokens with output × 4: 10 + 80.
        let seen = Seen {
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 20,
                total_tokens: 30,
                cached_input_tokens: 0,
            }),
            status: 200,
            ..Default::default()
        };
        assert_eq!(settle_amount(&seen, reserved, OUT4), 90);
        // Anthropic: cache creation and reads are input (part of prompt_tokens already).
        let anthropic = crate::usage::parse_usage(
            br#"{"input_tokens":2,"cache_creation_input_tokens":3,"cache_read_input_tokens":5,"output_tokens":1}"#,
        );
        let seen = Seen {
            usage: anthropic,
            status: 200,
            ..Default::default()
        };
        assert_eq!(settle_amount(&seen, reserved, OUT4), 10 + 4);
        // A total beyond prompt + completion is output (never less than before weights).
        let seen = Seen {
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 0,
                total_tokens: 15,
                cached_input_tokens: 0,
            }),
            status: 200,
            ..Default::default()
        };
        assert_eq!(settle_amount(&seen, reserved, OUT4), 10 + 20);
        assert_eq!(settle_amount(&seen, reserved, ONE), 15);
        // An aborted stream: the estimate as input, each content event as output.
        let streamed = Seen {
            content_events: 7,
            status: 200,
            prompt_tokens_estimate: 10,
            ..Default::default()
        };
        assert_eq!(settle_amount(&streamed, reserved, OUT4), 10 + 28);
        // No response: the reservation, weighted as it was reserved.
        assert_eq!(
            settle_amount(&Seen::default(), reserved, OUT4),
            reserved.weighted(OUT4)
        );
        assert_eq!(settled_tokens(&Seen::default(), reserved), reserved);
    }

    #[test]
    fn the_weights_of_several_tiers_are_the_larger_of_each() {
        let mut a = policy().tiers[0].clone();
        let mut b = policy().tiers[1].clone();
        assert_eq!(weights(&[&a, &b]), ONE);
        a.token_weights = OUT4;
        b.token_weights = TokenWeights {
            input: 2,
            output: 1,
        };
        assert_eq!(
            weights(&[&a, &b]),
            TokenWeights {
                input: 2,
                output: 4
            }
        );
        assert_eq!(weights(&[&a]), OUT4);
        assert_eq!(weights(&[]), ONE);
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
        assert_eq!(
            reservation(Some(&info), free, PromptCosts::default()),
            toks(60_000, 1)
        );
        assert_eq!(
            reservation(Some(&info), free, PromptCosts::default()).weighted(ONE),
            60_001
        );
        assert_eq!(
            reservation(Some(&info), free, PromptCosts::default()).weighted(OUT4),
            60_004
        );
        let n3 = RequestInfo {
            max_tokens: Some(100),
            prompt_tokens_estimate: 5,
            choices: 3,
            ..Default::default()
        };
        assert_eq!(
            reservation(Some(&n3), free, PromptCosts::default()),
            toks(5, 300)
        );
        // Output × 4: the prompt estimate plus max_tokens × n × 4.
        assert_eq!(
            reservation(Some(&n3), free, PromptCosts::default()).weighted(OUT4),
            1205
        );
        assert_eq!(
            reservation(None, free, PromptCosts::default()),
            toks(0, limits::reservation_for(None, free))
        );
        // Each media part adds the model's media tokens to the prompt (not to the output).
        let images = RequestInfo {
            max_tokens: Some(10),
            prompt_tokens_estimate: 20,
            beyond_text: beyond(3, None),
            choices: 2,
            ..Default::default()
        };
        assert_eq!(
            reservation(Some(&images), free, media(4096)),
            toks(20 + 3 * 4096, 20)
        );
        assert_eq!(
            reservation(Some(&images), free, PromptCosts::default()),
            toks(20, 20)
        );
        assert_eq!(prompt_estimate(&images, media(1000)), 3020);
        let absurd = RequestInfo {
            beyond_text: beyond(u64::MAX, None),
            ..images
        };
        assert_eq!(prompt_estimate(&absurd, media(4096)), u64::MAX);
        // Stored context: at least the context window, when the model declares one.
        let chained = RequestInfo {
            max_tokens: Some(10),
            prompt_tokens_estimate: 20,
            beyond_text: beyond(1, Some("previous_response_id")),
            choices: 1,
            ..Default::default()
        };
        let window = |w| PromptCosts {
            media_tokens: 100,
            context_window: Some(w),
        };
        assert_eq!(
            reservation(Some(&chained), free, window(8192)),
            toks(8192, 10)
        );
        assert_eq!(prompt_estimate(&chained, window(50)), 120);
        assert_eq!(prompt_estimate(&chained, media(100)), 120);
    }

    fn beyond(
        media_parts: u64,
        stored_context: Option<&'static str>,
    ) -> Option<Box<crate::request_body::BeyondText>> {
        Some(Box::new(crate::request_body::BeyondText {
            media_parts,
            stored_context,
            hosted_tool: None,
        }))
    }

    fn media(media_tokens: u64) -> PromptCosts {
        PromptCosts {
            media_tokens,
            context_window: None,
        }
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
            wi in 1u32..=1000, wo in 1u32..=1000,
        ) {
            let seen = Seen {
                usage: usage.map(|(p, c)| Usage { prompt_tokens: p, completion_tokens: c, total_tokens: p + c, cached_input_tokens: 0 }),
                content_events,
                status,
                prompt_tokens_estimate: prompt,
            };
            let w = TokenWeights { input: wi, output: wo };
            let (wi, wo) = (u64::from(wi), u64::from(wo));
            let reserved = toks(reserved / 2, reserved - reserved / 2);
            let amount = settle_amount(&seen, reserved, w);
            match (usage, content_events, status) {
                (Some((p, c)), _, _) => proptest::prop_assert_eq!(amount, p * wi + c * wo),
                (None, n, _) if n > 0 => proptest::prop_assert_eq!(amount, prompt * wi + n * wo),
                (None, 0, 0) => proptest::prop_assert_eq!(amount, reserved.weighted(w)),
                (None, 0, s) if s >= 400 => proptest::prop_assert_eq!(amount, 0),
                (None, 0, _) => proptest::prop_assert_eq!(amount, reserved.weighted(w)),
                _ => {}
            }
            if status < 400 || content_events > 0 {
                proptest::prop_assert!(amount > 0 || usage.is_some());
            }
        }
    }

    #[test]
    fn an_uncapped_request_gets_its_reservation_as_cap_unless_the_tier_forwards_as_sent() {
        let mut tier = policy().tiers[0].clone();
        tier.default_max_tokens = Some(300);
        let uncapped = crate::request_body::inspect(br#"{"model":"sim"}"#).unwrap();
        let capped = crate::request_body::inspect(br#"{"model":"sim","max_tokens":7}"#).unwrap();
        assert_eq!(
            injected_cap(&uncapped, Some("max_tokens"), &tier, false),
            Some(("max_tokens", 300))
        );
        // The injected cap is the completion budget reserved (per choice).
        assert_eq!(
            reservation(Some(&uncapped), &tier, PromptCosts::default()).output,
            300
        );
        assert_eq!(
            injected_cap(&capped, Some("max_tokens"), &tier, false),
            None
        );
        assert_eq!(injected_cap(&uncapped, None, &tier, false), None);
        tier.default_max_tokens = None;
        assert_eq!(
            injected_cap(&uncapped, Some("max_output_tokens"), &tier, false),
            Some(("max_output_tokens", limits::FALLBACK_RESERVATION))
        );
        tier.uncapped_requests = UncappedRequests::Reserve;
        assert_eq!(
            injected_cap(&uncapped, Some("max_tokens"), &tier, false),
            None
        );
        // A backend that requires a cap (translated to Anthropic Messages) gets the reservation
        // whatever the tier says; the client's own cap stands.
        assert_eq!(
            injected_cap(&uncapped, Some("max_tokens"), &tier, true),
            Some(("max_tokens", limits::FALLBACK_RESERVATION))
        );
        assert_eq!(injected_cap(&capped, Some("max_tokens"), &tier, true), None);
    }
}
