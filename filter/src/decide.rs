//! Decisions once the caller is known: authorisation, body checks, and what to settle.

use crate::cache::CachedIdentity;
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

/// What the response showed of token use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    pub usage: Option<Usage>,
    /// Content events of a stream (≈ completion tokens when usage never came).
    pub content_events: u64,
    /// Response status (0: no response at all).
    pub status: u32,
    /// Request body bytes (≈ 4 per prompt token when usage never came).
    pub request_body_bytes: u64,
}

/// Tokens to settle a reservation to: the usage when it came; else an estimate from what streamed
/// (client abort mid-stream); nothing for upstream errors without content; the reservation when
/// a successful response carried no usage (assume it was used).
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
            .saturating_add(seen.request_body_bytes / 4)
            .max(1);
    }
    if seen.status == 0 || seen.status >= 400 {
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
            request_body_bytes: 40,
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
        assert_eq!(settle_amount(&Seen::default(), 100), 0);
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
}
