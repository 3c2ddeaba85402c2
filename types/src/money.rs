//! Money in the policy (issue 30): prices per token and budgets per window, as exact integers of
//! nano-units (10⁻⁹ of the document's currency) — enough for per-token prices such as
//! $0.15 per million tokens (150 nano-dollars a token) with no float anywhere. Written and
//! read as decimal strings (`"10.50"`, `"0.0000025"`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Nano-units in one unit of the currency.
pub const NANOS_PER_UNIT: u64 = 1_000_000_000;
/// The largest amount a document may name (units): 9 × 10¹⁵ nano-units, under 2⁵³ — the
/// largest count the lease contract carries exactly (JSON numbers).
pub const MAX_UNITS: u64 = 9_000_000;
/// The largest cost a counter takes (nano-units): 2⁵³ − 1, what the lease contract carries.
pub const MAX_COUNTED: u64 = (1 << 53) - 1;

/// An amount of money in nano-units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Money(pub u64);

impl Money {
    pub fn nanos(self) -> u64 {
        self.0
    }

    /// Parses a non-negative decimal of at most 9 decimal places and at most [`MAX_UNITS`].
    pub fn parse(s: &str) -> Option<Money> {
        let (int, frac) = s.split_once('.').unwrap_or((s, ""));
        let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
        if int.is_empty() || int.len() > 10 || !digits(int) || frac.len() > 9 || !digits(frac) {
            return None;
        }
        if s.ends_with('.') {
            return None;
        }
        let units: u64 = int.parse().ok()?;
        if units > MAX_UNITS {
            return None;
        }
        let mut nanos: u64 = 0;
        for (i, b) in frac.bytes().enumerate() {
            let place = 10u64.pow(8 - u32::try_from(i).ok()?);
            nanos += u64::from(b - b'0') * place;
        }
        units
            .checked_mul(NANOS_PER_UNIT)?
            .checked_add(nanos)
            .map(Money)
    }
}

impl std::fmt::Display for Money {
    /// The shortest exact decimal: `10.5`, `0.0000025`, `3`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = self.0 / NANOS_PER_UNIT;
        let nanos = self.0 % NANOS_PER_UNIT;
        if nanos == 0 {
            return write!(f, "{units}");
        }
        let frac = format!("{nanos:09}");
        write!(f, "{units}.{}", frac.trim_end_matches('0'))
    }
}

const EXPECTED: &str = "must be a decimal amount such as \"10.50\" or \"0.0000025\" (at most 9 decimal places, at most 9000000)";

impl Serialize for Money {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Money::parse(&s).ok_or_else(|| serde::de::Error::custom(EXPECTED))
    }
}

/// Prices of a model, per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Pricing {
    /// Per input (prompt) token.
    pub input: Money,
    /// Per output (completion) token.
    pub output: Money,
    /// Per input token served from the provider's prompt cache (default: `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<Money>,
}

impl Pricing {
    /// The worst-case cost of a request that may read `input` tokens and write `output`
    /// (nothing assumed cached), at most [`MAX_COUNTED`].
    pub fn reserve(&self, input: u64, output: u64) -> u64 {
        input
            .saturating_mul(self.input.0)
            .saturating_add(output.saturating_mul(self.output.0))
            .min(MAX_COUNTED)
    }

    /// What `input` tokens (of which `cached` from the prompt cache) and `output` tokens cost,
    /// at most [`MAX_COUNTED`] (a backend reporting absurd usage cannot push a counter past
    /// what the lease contract carries).
    pub fn charge(&self, input: u64, cached: u64, output: u64) -> u64 {
        let cached = cached.min(input);
        let cached_price = self.cached_input.unwrap_or(self.input).0;
        (input - cached)
            .saturating_mul(self.input.0)
            .saturating_add(cached.saturating_mul(cached_price))
            .saturating_add(output.saturating_mul(self.output.0))
            .min(MAX_COUNTED)
    }
}

/// A money budget: at most `amount` per `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Budget {
    pub amount: Money,
    pub window: crate::Window,
    /// As a limit's `shadow`: counted, never refusing.
    #[serde(default, skip_serializing_if = "crate::policy::is_false")]
    pub shadow: bool,
}

impl Budget {
    /// The budget as a counter limit (in nano-units).
    pub fn as_limit(&self) -> crate::Limit {
        crate::Limit {
            limit: self.amount.0,
            window: self.window,
            shadow: self.shadow,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_are_exact_nano_units_both_ways() {
        for (text, nanos, shown) in [
            ("10.50", 10_500_000_000, "10.5"),
            ("0.0000025", 2_500, "0.0000025"),
            ("0.00000015", 150, "0.00000015"),
            ("3", 3_000_000_000, "3"),
            ("0.000000001", 1, "0.000000001"),
            ("9000000", 9_000_000_000_000_000, "9000000"),
            ("0", 0, "0"),
        ] {
            let m = Money::parse(text).unwrap();
            assert_eq!(m.0, nanos, "{text}");
            assert_eq!(m.to_string(), shown, "{text}");
            assert_eq!(Money::parse(&m.to_string()), Some(m));
        }
        for bad in [
            "",
            ".5",
            "5.",
            "-1",
            "1e3",
            "0.0000000001",
            "1000000001",
            "1,5",
            " 1",
            "NaN",
            "99999999999",
        ] {
            assert_eq!(Money::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn prices_reserve_the_worst_case_and_charge_cached_input_at_its_price() {
        let p = Pricing {
            input: Money::parse("0.0000025").unwrap(),
            output: Money::parse("0.00001").unwrap(),
            cached_input: Some(Money::parse("0.00000125").unwrap()),
        };
        // 1000 in, 500 out: 2.5 mµ + 5 mµ.
        assert_eq!(p.reserve(1000, 500), 2_500_000 + 5_000_000);
        // 400 of the 1000 cached: 600 × 2500 + 400 × 1250 + 500 × 10000.
        assert_eq!(p.charge(1000, 400, 500), 1_500_000 + 500_000 + 5_000_000);
        // More cached than input is read as all cached.
        assert_eq!(p.charge(10, 50, 0), 12_500);
        let no_cache_price = Pricing {
            cached_input: None,
            ..p
        };
        assert_eq!(no_cache_price.charge(1000, 400, 0), 2_500_000);
        assert_eq!(p.reserve(u64::MAX, 1), MAX_COUNTED);
        assert_eq!(p.charge(1 << 60, 0, 1 << 60), MAX_COUNTED);
    }

    #[test]
    fn budgets_and_prices_in_a_policy_are_checked_naming_the_field() {
        use crate::PolicyDocument;
        use serde_json::json;
        let doc = |budgets: serde_json::Value, pricing: serde_json::Value| {
            json!({
                "tiers": [{"name": "free", "level": 0, "groups": ["g"],
                           "limits": {"budgets": budgets}}],
                "models": [{"name": "m", "path": "/llm/m", "tiers": ["free"], "pricing": pricing}],
                "subscriptions": [{"name": "team-a", "owner": {"groups": ["g"]},
                    "models": [{"name": "m", "tokenRateLimits": [{"limit": 10, "window": "1m"}],
                                "budgets": [{"amount": "5", "window": "30d"}],
                                "pricing": {"input": "0.000001", "output": "0.000002"}}]}]
            })
        };
        let ok = PolicyDocument::from_value(doc(
            json!([{"amount": "10.50", "window": "1d"}, {"amount": "1", "window": "1d", "shadow": true}]),
            json!({"input": "0.0000025", "output": "0.00001", "cachedInput": "0.00000125"}),
        ))
        .unwrap();
        assert_eq!(ok.tiers[0].limits.budgets[0].amount.nanos(), 10_500_000_000);
        let sub_tier = ok.subscriptions[0].limits_tier("m").unwrap();
        assert_eq!(
            sub_tier.limits.budgets[0].as_limit().limit,
            5 * NANOS_PER_UNIT
        );
        assert_eq!(sub_tier.pricing.unwrap().output.nanos(), 2_000);
        // Served as written (canonical decimals), read back the same.
        let again = PolicyDocument::from_value(serde_json::to_value(&ok).unwrap()).unwrap();
        assert_eq!(again, ok);
        let fails = |v: serde_json::Value, at: &str| {
            let e = PolicyDocument::from_value(v).unwrap_err().to_string();
            assert!(e.contains(at), "{at}: {e}");
        };
        let price = json!({"input": "1", "output": "1"});
        fails(
            doc(json!([{"amount": "0", "window": "1d"}]), price.clone()),
            "tiers[0].limits.budgets[0].amount: must be more than 0",
        );
        fails(
            doc(
                json!([{"amount": "1.0000000001", "window": "1d"}]),
                price.clone(),
            ),
            "tiers[0].limits.budgets[0].amount",
        );
        fails(
            doc(json!([{"amount": 5, "window": "1d"}]), price.clone()),
            "tiers[0].limits.budgets[0].amount",
        );
        fails(
            doc(
                json!([{"amount": "1", "window": "1d"}, {"amount": "2", "window": "1d"}]),
                price.clone(),
            ),
            "tiers[0].limits.budgets[1].window",
        );
        fails(
            doc(json!([]), json!({"input": "-1", "output": "1"})),
            "models[0].pricing.input",
        );
        fails(doc(json!([]), json!({"input": "1"})), "models[0].pricing");
        fails(
            doc(
                json!([]),
                json!({"input": "1", "output": "1", "cached": "1"}),
            ),
            "models[0].pricing",
        );
        // A tier's prices name models of the document, and replace the model's on that tier.
        let mut tiered = doc(json!([]), price.clone());
        tiered["tiers"][0]["prices"] = json!({"m": {"input": "0.000001", "output": "0.000003"}});
        let read = PolicyDocument::from_value(tiered.clone()).unwrap();
        assert_eq!(read.tiers[0].pricing_of("m").unwrap().output.nanos(), 3_000);
        assert_eq!(read.tiers[0].pricing_of("other"), None);
        tiered["tiers"][0]["prices"] = json!({"gone": {"input": "1", "output": "1"}});
        fails(
            tiered.clone(),
            "tiers[0].prices.gone: not a model of the document",
        );
        tiered["tiers"][0]["prices"] = json!({"m": {"input": "x", "output": "1"}});
        fails(tiered, "tiers[0].prices");
    }
}
