//! Global limits in a request's life: a short lease → one `POST /internal/v1/leases` per subject
//! and worker (a *flight*; requests of the same subject join it) → grants added → admitted again.
//!
//! Who carries a flight: the proxy-wasm SDK routes a callout's answer to the context whose
//! callback was running when it was dispatched, and Envoy cancels a callout with the stream of
//! the effective context it was dispatched on. So a request dispatches a flight only from its
//! own callback (it carries it, and waits for it: it lives until the answer unless its client
//! leaves). Every other short request — woken inside another request's callback (the
//! authentication's single flight), still short after an answer (a burst joined the flight
//! while it was out), or left by a carrier whose client went away — is *pending*: the root
//! context (never cancelled) dispatches one flight per subject for them at its next tick
//! (≤ 200 ms). Answers are found by token (`Worker::lease_flights`) wherever they arrive.
//!
//! A flight carries a `batchId`. When its answer never comes (timeout, error, or its carrier's
//! stream cancelled it), the companion may still have applied it: the flight joins the worker's
//! lease outbox and is re-sent verbatim by the root until a 200 — the grants made then reach
//! this replica (and are released when idle) instead of staying taken to the window's end.

use super::{Admitted, Phase, Registry, Request, Step, lease_unavailable, limited_refusal};
use crate::config::PluginConfig;
use crate::host::{Body, Headers, Host, read_body};
use crate::lease;
use crate::limits::{self, Admission, Kind, LeaseNeed, SlotRead};
use crate::state::SharedWorker;

/// Rounds a request waits for at most (a flight, then follow-ups while answers grant but it
/// is still short: other requests of the subject used the grant first). Then 429.
const MAX_ROUNDS: u8 = 8;

/// `needs` summed per counter (several requests' needs in one item).
fn summed(all: &[Vec<LeaseNeed>]) -> Vec<LeaseNeed> {
    let mut out: Vec<LeaseNeed> = Vec::new();
    for n in all.iter().flatten() {
        match out
            .iter_mut()
            .find(|o| o.kind == n.kind && o.window == n.window && o.start == n.start)
        {
            Some(o) => {
                o.need = o.need.saturating_add(n.need).min(o.limit);
                o.want = o.want.max(o.need);
            }
            None => out.push(*n),
        }
    }
    out
}

/// A flight for `needs` of `subject` (its batch id drawn, its body encoded). Each want is at
/// least what the subject's recent rate uses over `horizon_ms` (the worker's reports measure
/// it; remembered across idleness): the window's average lags a burst, restarts at each new
/// window and is diluted by idle time.
fn flight(
    worker: &SharedWorker,
    subject: String,
    key: String,
    mut needs: Vec<LeaseNeed>,
    carrier: u32,
    members: Vec<u32>,
    horizon_ms: u64,
) -> Result<lease::Flight, String> {
    let mut w = worker
        .try_borrow_mut()
        .map_err(|_| "the worker's state is busy".to_string())?;
    for n in &mut needs {
        let recent = w.leases.recent(&subject, n.kind, n.window, horizon_ms);
        n.want = n.want.max(recent.min(n.limit)).max(n.need);
    }
    let id = w.leases.next_batch_id();
    let body = lease::encode(&w.leases.replica, &id, lease::items_for(&subject, &needs))?;
    Ok(lease::Flight {
        subject,
        key,
        needs,
        carrier,
        members,
        id,
        body,
    })
}

/// Dispatches `flight` on the context that is running (and effective); registers it.
fn dispatch(
    host: &dyn Host,
    worker: &SharedWorker,
    cfg: &PluginConfig,
    flight: lease::Flight,
) -> Result<(), String> {
    let token = lease::dispatch(host, cfg, &flight.body)?;
    let mut w = worker
        .try_borrow_mut()
        .map_err(|_| "the worker's state is busy".to_string())?;
    w.metrics.inc(w.metrics.lease_callouts, 1);
    w.lease_flights.insert(token, flight);
    Ok(())
}

/// This Envoy enters fallback (a lease callout failed).
fn enter_fallback(host: &dyn Host, worker: &SharedWorker, now_s: u64) {
    let Ok(mut w) = worker.try_borrow_mut() else {
        return;
    };
    let w = &mut *w;
    if lease::enter_fallback(
        host,
        &mut w.leases,
        w.metrics.lease_fallback,
        now_s.saturating_mul(1000),
    ) {
        w.metrics.inc(w.metrics.lease_fallback_entered, 1);
    }
}

/// Runs `f` on request `id` with its context effective (`me`: the request whose callback runs,
/// used directly when it is `id`); false when it is gone or busy.
fn on_member(
    host: &dyn Host,
    registry: &Registry,
    me: &mut Option<&mut Request>,
    id: u32,
    f: &mut dyn FnMut(&mut Request, &dyn Host),
) -> bool {
    if let Some(req) = me.as_deref_mut()
        && req.id == id
    {
        if !host.set_effective_context(req.id) {
            return false;
        }
        f(req, host);
        return true;
    }
    let Some(rc) = registry.get(id) else {
        return false;
    };
    let Ok(mut member) = rc.try_borrow_mut() else {
        return false;
    };
    if !host.set_effective_context(member.id) {
        return false;
    }
    f(&mut member, host);
    true
}

/// The grants of a flight's answer added to the subject's counter slot; `None` when the callout
/// failed (the flight is kept to be re-sent, and this Envoy enters fallback). Else whether it
/// granted anything, and when the limit is reached globally the retry-after of its window.
fn apply_answer(
    host: &dyn Host,
    worker: &SharedWorker,
    flight: &lease::Flight,
    body_size: usize,
    now_s: u64,
) -> (bool, Option<u64>) {
    let status = host
        .header(Headers::CallResponse, ":status")
        .and_then(|s| s.parse::<u32>().ok());
    let body = read_body(host, Body::CallResponse, body_size);
    let Some(resp) = lease::answer(status, &body, flight.needs.len()) else {
        log::warn!("maas: lease callout failed (status {status:?}); re-sent by the next report");
        if let Ok(mut w) = worker.try_borrow_mut() {
            w.leases.orphan(flight.orphan());
        }
        enter_fallback(host, worker, now_s);
        return (false, None);
    };
    let grants: Vec<limits::Grant> = flight
        .needs
        .iter()
        .zip(&resp.grants)
        .map(|(n, g)| limits::Grant {
            kind: n.kind,
            window: n.window,
            start: n.start,
            granted: g.granted,
            taken: g.taken,
        })
        .collect();
    limits::apply_grants(host, &flight.key, &flight.subject, &grants, now_s);
    if let Ok(mut w) = worker.try_borrow_mut() {
        let w = &mut *w;
        lease::answered(
            host,
            &mut w.leases,
            w.metrics.lease_fallback,
            resp.replicas,
            false,
        );
    }
    let any = resp.grants.iter().any(|g| g.granted > 0);
    (any, lease::exhausted_retry(&flight.needs, &resp, now_s))
}

/// The answer to a flight (found by its token; `me`: the request whose context it arrived on,
/// `back_to`: the context to leave effective): grants added, the members admitted again
/// (resumed when allowed); members still short wait for the root's next flight while answers
/// grant (at most [`MAX_ROUNDS`]), else 429.
pub(crate) fn answer_flight(
    host: &dyn Host,
    worker: &SharedWorker,
    registry: &Registry,
    flight: lease::Flight,
    body_size: usize,
    mut me: Option<&mut Request>,
    back_to: u32,
) {
    let now_s = host.now_ms() / 1000;
    let (granted, retry) = apply_answer(host, worker, &flight, body_size, now_s);
    let mut pending = Vec::new();
    for &m in &flight.members {
        let mut wait = false;
        on_member(host, registry, &mut me, m, &mut |req, host| {
            if !matches!(req.phase, Phase::Leasing { .. }) {
                return;
            }
            match req.readmit(host, now_s) {
                Ok(Step::Continue) => host.resume_request(),
                Ok(_) => {}
                Err(items) => {
                    // Short again: of this flight's subject, or now of another one (a scope's
                    // lease answered, its own counters' short, or the reverse).
                    let same = req
                        .short_subject()
                        .is_some_and(|s| s == flight.subject.as_str());
                    match after_answer(same, granted, retry, req.lease_rounds()) {
                        AfterAnswer::Wait => {
                            if let Phase::Leasing { needs, .. } = &mut req.phase {
                                *needs = items;
                            }
                            wait = true;
                        }
                        AfterAnswer::Refuse(retry) => req.refuse_short(host, retry),
                    }
                }
            }
        });
        if wait {
            pending.push(m);
        }
    }
    host.set_effective_context(back_to);
    if let Ok(mut w) = worker.try_borrow_mut() {
        w.lease_pending.extend(pending);
    }
}

/// What a member still short after its flight's answer does.
#[derive(Debug, PartialEq, Eq)]
enum AfterAnswer {
    /// Wait for the root's next flight.
    Wait,
    /// 429, retry-after as given (else a few seconds).
    Refuse(Option<u64>),
}

/// A member still short after the answer to its flight: `same` when it is short of the
/// flight's subject (else it is now short of another: a request in scopes leases each of its
/// subjects in turn, and this answer says nothing about the other one), `granted` when the
/// answer granted anything, `retry` when it found the limit reached globally, `rounds` the
/// flights it waited for. Waits while rounds remain and the answer does not say "exhausted"
/// (or was about another subject); never past [`MAX_ROUNDS`].
fn after_answer(same: bool, granted: bool, retry: Option<u64>, rounds: u8) -> AfterAnswer {
    if rounds >= MAX_ROUNDS {
        AfterAnswer::Refuse(if same { retry } else { None })
    } else if !same || (granted && retry.is_none()) {
        AfterAnswer::Wait
    } else {
        AfterAnswer::Refuse(retry)
    }
}

/// Pending requests of one subject.
struct Group {
    subject: String,
    key: String,
    members: Vec<u32>,
    needs: Vec<Vec<LeaseNeed>>,
}

/// The pending requests grouped by subject (each counted one more round); in fallback each is
/// admitted on the local share instead.
fn group_pending(
    host: &dyn Host,
    registry: &Registry,
    pending: Vec<u32>,
    fallback: bool,
    now_s: u64,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for m in pending {
        let Some(rc) = registry.get(m) else { continue };
        let Ok(mut req) = rc.try_borrow_mut() else {
            continue;
        };
        let Phase::Leasing {
            needs,
            rounds,
            scope,
            ..
        } = &mut req.phase
        else {
            continue;
        };
        let scope = *scope;
        if fallback {
            if host.set_effective_context(req.id)
                && req.final_admission(host, now_s, None) == Step::Continue
            {
                host.resume_request();
            }
            continue;
        }
        *rounds = rounds.saturating_add(1);
        let needs = std::mem::take(needs);
        let Some((subject, key)) = req.lease_subject(scope) else {
            continue;
        };
        match groups.iter_mut().find(|g| g.subject == subject) {
            Some(g) => {
                g.members.push(m);
                g.needs.push(needs);
            }
            None => groups.push(Group {
                subject: subject.to_string(),
                key: key.to_string(),
                members: vec![m],
                needs: vec![needs],
            }),
        }
    }
    groups
}

/// The root's tick: one flight per subject for the pending requests (carried by the root
/// context, which is never cancelled). In fallback they are admitted on the local share.
pub fn dispatch_pending(
    host: &dyn Host,
    worker: &SharedWorker,
    registry: &Registry,
    cfg: &PluginConfig,
    root: u32,
) {
    let (pending, fallback) = match worker.try_borrow_mut() {
        Ok(mut w) if !w.lease_pending.is_empty() => (
            std::mem::take(&mut w.lease_pending),
            w.leases.state.fallback,
        ),
        _ => return,
    };
    let now_s = host.now_ms() / 1000;
    let groups = group_pending(host, registry, pending, fallback, now_s);
    host.set_effective_context(root);
    for g in groups {
        let members = g.members.clone();
        let sent = flight(
            worker,
            g.subject,
            g.key,
            summed(&g.needs),
            root,
            g.members,
            cfg.limits.global.lease_horizon_ms,
        )
        .and_then(|f| dispatch(host, worker, cfg, f));
        if let Err(e) = sent {
            log::warn!("maas: cannot call the companion for a lease: {e}");
            enter_fallback(host, worker, now_s);
            for &m in &members {
                on_member(host, registry, &mut None, m, &mut |req, host| {
                    if req.final_admission(host, now_s, None) == Step::Continue {
                        host.resume_request();
                    }
                });
            }
            host.set_effective_context(root);
        }
    }
}

impl Request {
    /// Whose lease a short request waits for — its own counters' subject and slot (`scope`
    /// none) or its scope's — once authorised.
    fn lease_subject(&self, scope: Option<u8>) -> Option<(&str, &str)> {
        let auth = self.auth.as_ref()?;
        match scope {
            None => Some((auth.limits_subject(), &auth.counter_key)),
            Some(i) => {
                let run = auth.scopes.as_ref()?.runs.get(usize::from(i))?;
                Some((&run.counter_subject, &run.counter_key))
            }
        }
    }

    /// The subject whose lease a request in [`Phase::Leasing`] is short of.
    fn short_subject(&self) -> Option<&str> {
        match self.phase {
            Phase::Leasing { scope, .. } => self.lease_subject(scope).map(|(s, _)| s),
            _ => None,
        }
    }

    /// Flights this request waited for.
    fn lease_rounds(&self) -> u8 {
        match self.phase {
            Phase::Leasing { rounds, .. } => rounds,
            _ => 0,
        }
    }

    /// The lease is short: join this worker's flight for the subject, or make one from this
    /// request's own callback (the request waits), or wait for the root's next flight;
    /// in fallback with `onUnavailable: refuse` 503. A callout that cannot be dispatched enters
    /// fallback and admits again against the local share.
    pub(super) fn ask_lease(
        &mut self,
        host: &dyn Host,
        items: Vec<LeaseNeed>,
        limited: Option<Admission>,
        scope: Option<u8>,
        now_s: u64,
    ) -> Step {
        let (Some(cfg), Some((subject, key))) = (self.config(), self.lease_subject(scope)) else {
            self.refuse(host, &crate::response::Refusal::not_configured());
            return Step::Refused;
        };
        let (subject, key) = (subject.to_string(), key.to_string());
        let Some(mut w) = self.worker_mut() else {
            self.refuse(host, &crate::response::Refusal::undecidable());
            return Step::Refused;
        };
        if w.leases.state.fallback {
            // Only `refuse` mode gets here in fallback (the share mode answers without a lease).
            drop(w);
            self.refuse(host, &lease_unavailable());
            return Step::Refused;
        }
        // The needs are kept: asked for again by the root when this request ends up pending.
        let joined = if let Some(f) = w.lease_flights.values_mut().find(|f| f.subject == subject) {
            f.members.push(self.id);
            true
        } else if w.active != self.id {
            // Inside another context's callback: the root dispatches at its next tick.
            w.lease_pending.push(self.id);
            true
        } else {
            false
        };
        drop(w);
        self.phase = Phase::Leasing {
            needs: items.clone(),
            rounds: 0,
            limited,
            scope,
        };
        if joined {
            return Step::Wait;
        }
        let sent = flight(
            &self.worker,
            subject,
            key,
            items,
            self.id,
            vec![self.id],
            cfg.limits.global.lease_horizon_ms,
        )
        .and_then(|f| dispatch(host, &self.worker, &cfg, f));
        match sent {
            Ok(()) => Step::Wait,
            Err(e) => {
                log::warn!("maas: cannot call the companion for a lease: {e}");
                enter_fallback(host, &self.worker, now_s);
                self.final_admission(host, now_s, None)
            }
        }
    }

    /// Admission after a lease answer: forwarded, refused, or still short (`Err`: the needs;
    /// the 429 to answer is kept). In fallback with `onUnavailable: refuse` a short lease is 503.
    fn readmit(&mut self, host: &dyn Host, now_s: u64) -> Result<Step, Vec<LeaseNeed>> {
        match self.decide(host, None::<SlotRead>, now_s) {
            Ok(Admitted::Forward(reservation)) => Ok(self.forward(host, reservation)),
            Ok(Admitted::Short {
                items,
                limited,
                scope,
            }) => {
                if self
                    .worker
                    .try_borrow()
                    .map_or(true, |w| w.leases.state.fallback)
                {
                    self.refuse(host, &lease_unavailable());
                    return Ok(Step::Refused);
                }
                if let Phase::Leasing {
                    limited: kept,
                    scope: whose,
                    ..
                } = &mut self.phase
                {
                    *kept = Some(limited);
                    *whose = scope;
                }
                Err(items)
            }
            Err(r) => {
                self.refuse(host, &r);
                Ok(Step::Refused)
            }
        }
    }

    /// Still short with no callout to come: 429 (`retry`: the window's end when the limit is
    /// reached globally, else a few seconds: other replicas hand back idle leases).
    fn refuse_short(&mut self, host: &dyn Host, retry: Option<u64>) {
        let short_retry = self
            .config()
            .map_or(1, |c| lease::short_retry_s(&c.limits.global));
        let retry_after = retry.unwrap_or(short_retry);
        let kept = match &mut self.phase {
            Phase::Leasing { limited, .. } => limited.take(),
            _ => None,
        };
        let style = self.rate_limit_style();
        let refusal = match kept {
            Some(Admission::NeedsLease {
                kind,
                tier,
                headers,
                ..
            }) => limited_refusal(
                Admission::Limited {
                    kind,
                    retry_after,
                    tier,
                    headers,
                },
                style,
            ),
            Some(other) => limited_refusal(other, style),
            None => limited_refusal(
                Admission::Limited {
                    kind: Kind::Requests,
                    retry_after,
                    tier: String::new(),
                    headers: limits::RateHeaders::default(),
                },
                style,
            ),
        };
        self.refuse(host, &refusal);
    }

    /// Admission with no callout to come: forwarded, else refused.
    fn final_admission(&mut self, host: &dyn Host, now_s: u64, retry: Option<u64>) -> Step {
        match self.readmit(host, now_s) {
            Ok(step) => step,
            Err(_) => {
                self.refuse_short(host, retry);
                Step::Refused
            }
        }
    }

    /// The answer to a flight that arrived on this request's context.
    pub(super) fn on_lease_answer(
        &mut self,
        host: &dyn Host,
        flight: lease::Flight,
        body_size: usize,
    ) {
        let worker = self.worker.clone();
        let registry = self.registry.clone();
        let id = self.id;
        answer_flight(host, &worker, &registry, flight, body_size, Some(self), id);
    }

    /// The stream ends: a waiting request leaves its flight; the flights this request carries
    /// are cancelled with its stream, their other members wait for the root's next flight.
    pub(super) fn leave_leasing(&mut self) {
        let Some(mut w) = self.worker_mut() else {
            return;
        };
        if w.lease_flights.is_empty() && w.lease_pending.is_empty() {
            return;
        }
        let me = self.id;
        w.lease_pending.retain(|m| *m != me);
        for f in w.lease_flights.values_mut() {
            f.members.retain(|m| *m != me);
        }
        let tokens: Vec<u32> = w
            .lease_flights
            .iter()
            .filter(|(_, f)| f.carrier == me)
            .map(|(t, _)| *t)
            .collect();
        for t in tokens {
            if let Some(f) = w.lease_flights.remove(&t) {
                // Cancelled with this stream: the companion may have answered it all the same.
                w.leases.orphan(f.orphan());
                w.lease_pending.extend(f.members);
            }
        }
        drop(w);
        if matches!(self.phase, Phase::Leasing { .. }) {
            self.phase = Phase::Settled;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_of_several_requests_sum_per_counter_within_the_limit() {
        let n = |kind, need| LeaseNeed {
            kind,
            window: 60,
            start: 0,
            limit: 10,
            need,
            want: 3,
        };
        let s = summed(&[
            vec![n(Kind::Requests, 1), n(Kind::Tokens, 4)],
            vec![n(Kind::Requests, 1), n(Kind::Tokens, 8)],
        ]);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].need, s[0].want), (2, 3));
        assert_eq!((s[1].need, s[1].want), (10, 10), "at most the limit");
    }

    #[test]
    fn a_member_short_of_another_subject_than_its_answer_waits_for_that_ones_lease() {
        // Short again of the flight's own subject: as ever.
        assert_eq!(after_answer(true, true, None, 0), AfterAnswer::Wait);
        assert_eq!(
            after_answer(true, true, Some(60), 0),
            AfterAnswer::Refuse(Some(60))
        );
        assert_eq!(
            after_answer(true, false, None, 0),
            AfterAnswer::Refuse(None)
        );
        // Admitted in the scope this answer leased, now short of its own counters: the
        // scope's exhaustion (or a grant of nothing more) says nothing about those.
        assert_eq!(after_answer(false, true, Some(60), 0), AfterAnswer::Wait);
        assert_eq!(after_answer(false, false, None, 1), AfterAnswer::Wait);
        // Never past the rounds, and never with another subject's retry-after.
        assert_eq!(
            after_answer(false, true, Some(60), MAX_ROUNDS),
            AfterAnswer::Refuse(None)
        );
        assert_eq!(
            after_answer(true, true, None, MAX_ROUNDS),
            AfterAnswer::Refuse(None)
        );
    }
}
