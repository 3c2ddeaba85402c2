//! Backends that keep failing are tried last for a while (docs/design.md "Cooldown"; LiteLLM's
//! cooldowns, Envoy's outlier ejection). Envoy's own outlier detection cannot do it for a model
//! whose order the filter gives (`x-maas-endpoints`): its `override_host` policy takes the listed
//! endpoint whatever its health (Envoy 1.40, checked). So the downstream filter learns it: the
//! order it gave Envoy and the backend that answered (the route's `x-maas-served-by`, in the
//! response-header map it reads anyway) say which attempts failed — every endpoint listed before
//! the one that answered, and that one too when its answer is a failover status. Per worker (the
//! filter's own state: no host call; a clock read only when a backend is cooled).

use maas_types::policy::{CooldownRule, FAILOVER_STATUSES};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

/// The endpoints cooled down on this worker (`ip:port` → until, seconds), shared read-only
/// with the requests (copied on the rare change). An entry stays past its end: one more failure
/// then cools the endpoint again at once (its probation); a success removes it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cooled(BTreeMap<Box<str>, u64>);

impl Cooled {
    /// Whether `endpoint` is cooling at `now_s`.
    pub fn is_cooling(&self, endpoint: &str, now_s: u64) -> bool {
        self.0.get(endpoint).is_some_and(|&until| now_s < until)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// This worker's view of its backends' health.
#[derive(Debug, Default)]
pub struct Cooldowns {
    /// Failed attempts in a row, per endpoint not cooled (bounded by the endpoints the policy
    /// lists: an entry is made only for an endpoint the filter put in an order).
    failures: HashMap<Box<str>, u32>,
    cooled: Rc<Cooled>,
}

impl Cooldowns {
    /// The cooled endpoints, for a request's decision (a reference count, no copy).
    pub fn cooled(&self) -> Rc<Cooled> {
        self.cooled.clone()
    }

    /// One attempt's outcome on `endpoint`. `now_s` is asked only when the endpoint is cooled
    /// now (the steady state reads no clock).
    pub fn record(
        &mut self,
        endpoint: &str,
        failed: bool,
        rule: CooldownRule,
        now_s: &mut impl FnMut() -> u64,
    ) {
        let on_probation = self.cooled.0.contains_key(endpoint);
        if !failed {
            if on_probation {
                Rc::make_mut(&mut self.cooled).0.remove(endpoint);
            }
            self.failures.remove(endpoint);
            return;
        }
        let in_a_row = match self.failures.get_mut(endpoint) {
            Some(n) => {
                *n = n.saturating_add(1);
                *n
            }
            None => {
                self.failures.insert(endpoint.into(), 1);
                1
            }
        };
        if on_probation || in_a_row >= rule.failures {
            self.failures.remove(endpoint);
            let until = now_s().saturating_add(rule.seconds);
            Rc::make_mut(&mut self.cooled)
                .0
                .insert(endpoint.into(), until);
        }
    }
}

/// Whether an answer with this status failed over (the route's retriable statuses).
pub fn is_failure(status: u16) -> bool {
    FAILOVER_STATUSES.contains(&status)
}

/// What one request's answer says of each attempt Envoy made in `order` (the endpoints the
/// filter listed, in the order Envoy tries them): `(endpoint, failed)`. `served` is the endpoint
/// of the backend that answered. Every endpoint before it failed (Envoy moved on); it failed when
/// its answer did. Served by an endpoint not listed (the fallback policy chose, after every
/// listed one was tried): each listed one failed. Nothing is learned when the answer names no
/// backend (a reply Envoy made itself: what was tried is not known).
pub fn attempts<'o>(
    order: &'o str,
    served: Option<&str>,
    answer_failed: bool,
) -> impl Iterator<Item = (&'o str, bool)> {
    let listed = if served.is_some() { usize::MAX } else { 0 };
    let mut done = false;
    order.split(',').take(listed).map_while(move |endpoint| {
        if done {
            return None;
        }
        if Some(endpoint) == served {
            done = true;
            return Some((endpoint, answer_failed));
        }
        Some((endpoint, true))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: CooldownRule = CooldownRule {
        failures: 3,
        seconds: 30,
    };

    fn fail(c: &mut Cooldowns, e: &str, now: u64) {
        c.record(e, true, RULE, &mut || now);
    }

    #[test]
    fn what_an_answer_says_of_each_attempt() {
        let order = "10.0.0.1:80,10.0.0.2:80,10.0.0.3:80";
        let got: Vec<_> = attempts(order, Some("10.0.0.2:80"), false).collect();
        assert_eq!(got, [("10.0.0.1:80", true), ("10.0.0.2:80", false)]);
        let got: Vec<_> = attempts(order, Some("10.0.0.1:80"), false).collect();
        assert_eq!(got, [("10.0.0.1:80", false)]);
        // The last one answered 503 too: all three failed.
        let got: Vec<_> = attempts(order, Some("10.0.0.3:80"), true).collect();
        assert_eq!(got.iter().filter(|(_, f)| *f).count(), 3);
        // Served by one not listed (the fallback chose): every listed one failed first.
        let got: Vec<_> = attempts(order, Some("10.0.0.9:80"), false).collect();
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|(_, f)| *f));
        // No backend named: nothing learned.
        assert_eq!(attempts(order, None, true).count(), 0);
        assert!(is_failure(503) && is_failure(429) && !is_failure(200) && !is_failure(404));
    }

    #[test]
    fn failures_in_a_row_cool_a_backend_for_its_duration() {
        let mut c = Cooldowns::default();
        let e = "10.0.0.1:80";
        fail(&mut c, e, 100);
        fail(&mut c, e, 100);
        assert!(c.cooled().is_empty(), "two of three");
        // A success in between starts the count again.
        c.record(e, false, RULE, &mut || {
            unreachable!("no clock for a success")
        });
        fail(&mut c, e, 100);
        fail(&mut c, e, 100);
        assert!(!c.cooled().is_cooling(e, 100));
        fail(&mut c, e, 100);
        assert!(c.cooled().is_cooling(e, 100));
        assert!(c.cooled().is_cooling(e, 129));
        assert!(!c.cooled().is_cooling(e, 130), "30 s, no more");
        assert!(!c.cooled().is_cooling("10.0.0.2:80", 100), "only that one");
    }

    #[test]
    fn after_its_cooldown_one_failure_cools_it_again_and_one_success_clears_it() {
        let mut c = Cooldowns::default();
        let e = "10.0.0.1:80";
        for _ in 0..3 {
            fail(&mut c, e, 100);
        }
        fail(&mut c, e, 140);
        assert!(
            c.cooled().is_cooling(e, 140),
            "on probation: one failure is enough"
        );
        assert!(c.cooled().is_cooling(e, 169));
        c.record(e, false, RULE, &mut || 0);
        assert!(c.cooled().is_empty(), "a success clears it");
        fail(&mut c, e, 200);
        assert!(!c.cooled().is_cooling(e, 200), "a fresh count again");
    }

    #[test]
    fn the_steady_state_reads_no_clock_and_shares_the_cooled_set_without_copying() {
        let mut c = Cooldowns::default();
        let before = c.cooled();
        for _ in 0..100 {
            c.record("10.0.0.1:80", false, RULE, &mut || unreachable!());
        }
        fail(&mut c, "10.0.0.1:80", 1);
        assert!(Rc::ptr_eq(&before, &c.cooled()), "unchanged: not copied");
    }
}
