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

use super::{Admitted, Phase, Request, Step, lease_unavailable, limited_refusal};
use crate::config::PluginConfig;
use crate::host::{Body, Headers, Host, read_body};
use crate::lease;
use crate::limits::{self, Admission, Kind, LeaseNeed};
use crate::worker::SharedWorker;
use std::cell::RefCell;
use std::rc::Weak;

/// Rounds a request waits for at most (a flight, then follow-ups while answers grant but it
/// is still short: other requests of the subject used the grant first). Then 429.
const MAX_ROUNDS: u8 = 8;

/// A lease callout of this worker, for the requests of one subject waiting for it.
#[derive(Debug)]
pub struct LeaseFlight {
    pub subject: String,
    /// The subject's counter slot key.
    pub key: String,
    pub needs: Vec<LeaseNeed>,
    /// The context that dispatched it (a request, or the root context).
    pub carrier: u32,
    pub members: Vec<Weak<RefCell<Request>>>,
    /// Its `batchId` and body as sent (re-sent by the outbox when unanswered).
    pub id: String,
    pub body: Vec<u8>,
}

impl LeaseFlight {
    /// This flight as a batch of the outbox (its answer never came).
    pub fn orphan(&self) -> lease::Batch {
        lease::Batch {
            id: self.id.clone(),
            body: self.body.clone(),
            claims: vec![(
                self.subject.clone(),
                self.key.clone(),
                lease::asked(&self.needs),
            )],
            token: None,
        }
    }
}

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
    members: Vec<Weak<RefCell<Request>>>,
    horizon_ms: u64,
) -> Result<LeaseFlight, String> {
    let mut w = worker.borrow_mut();
    for n in &mut needs {
        let recent = w.leases.recent(&subject, n.kind, n.window, horizon_ms);
        n.want = n.want.max(recent.min(n.limit)).max(n.need);
    }
    let id = w.leases.next_batch_id();
    let body = lease::encode(&w.leases.replica, &id, lease::items_for(&subject, &needs))?;
    Ok(LeaseFlight {
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
    flight: LeaseFlight,
) -> Result<(), String> {
    let token = lease::dispatch(host, cfg, &flight.body)?;
    let mut w = worker.borrow_mut();
    w.metrics.inc(w.metrics.lease_callouts, 1);
    w.lease_flights.insert(token, flight);
    Ok(())
}

/// This Envoy enters fallback (a lease callout failed).
fn enter_fallback(host: &dyn Host, worker: &SharedWorker, now_s: u64) {
    let mut w = worker.borrow_mut();
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

/// Runs `f` on `m` with its context effective (`me`: the request whose callback runs, used
/// directly when it is `m`); false when `m` is gone or busy.
fn on_member(
    host: &dyn Host,
    me: &mut Option<&mut Request>,
    m: &Weak<RefCell<Request>>,
    f: &mut dyn FnMut(&mut Request, &dyn Host),
) -> bool {
    if let Some(req) = me.as_deref_mut()
        && m.ptr_eq(&req.me)
    {
        if !host.set_effective_context(req.id) {
            return false;
        }
        f(req, host);
        return true;
    }
    let Some(rc) = m.upgrade() else { return false };
    let Ok(mut member) = rc.try_borrow_mut() else {
        return false;
    };
    if !host.set_effective_context(member.id) {
        return false;
    }
    f(&mut member, host);
    true
}

/// The answer to a flight (found by its token; `me`: the request whose context it arrived on,
/// `back_to`: the context to leave effective): grants added, the members admitted again
/// (resumed when allowed); members still short wait for the root's next flight while answers
/// grant (at most [`MAX_ROUNDS`]), else 429.
pub fn answer_flight(
    host: &dyn Host,
    worker: &SharedWorker,
    flight: LeaseFlight,
    body_size: usize,
    mut me: Option<&mut Request>,
    back_to: u32,
) {
    let status = host
        .header(Headers::CallResponse, ":status")
        .and_then(|s| s.parse::<u32>().ok());
    let body = read_body(host, Body::CallResponse, body_size);
    let now_s = host.now_ms() / 1000;
    let (granted, retry) = match lease::answer(status, &body, flight.needs.len()) {
        Some(resp) => {
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
            {
                let mut w = worker.borrow_mut();
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
        None => {
            log::warn!(
                "maas: lease callout failed (status {status:?}); re-sent by the next report"
            );
            worker.borrow_mut().leases.orphan(flight.orphan());
            enter_fallback(host, worker, now_s);
            (false, None)
        }
    };
    let mut pending = Vec::new();
    for m in &flight.members {
        let mut wait = false;
        on_member(host, &mut me, m, &mut |req, host| {
            if !matches!(req.phase, Phase::Leasing) {
                return;
            }
            match req.readmit(host, now_s) {
                Ok(Step::Continue) => host.resume_request(),
                Ok(_) => {}
                Err(items) if granted && retry.is_none() && req.lease_rounds < MAX_ROUNDS => {
                    req.lease_needs = items;
                    wait = true;
                }
                Err(_) => req.refuse_short(host, retry),
            }
        });
        if wait {
            pending.push(m.clone());
        }
    }
    host.set_effective_context(back_to);
    worker.borrow_mut().lease_pending.extend(pending);
}

/// Pending requests of one subject.
struct Group {
    subject: String,
    key: String,
    members: Vec<Weak<RefCell<Request>>>,
    needs: Vec<Vec<LeaseNeed>>,
}

/// The root's tick: one flight per subject for the pending requests (carried by the root
/// context, which is never cancelled). In fallback they are admitted on the local share.
pub fn dispatch_pending(host: &dyn Host, worker: &SharedWorker, cfg: &PluginConfig, root: u32) {
    let pending = std::mem::take(&mut worker.borrow_mut().lease_pending);
    if pending.is_empty() {
        return;
    }
    let now_s = host.now_ms() / 1000;
    let mut groups: Vec<Group> = Vec::new();
    let fallback = worker.borrow().leases.state.fallback;
    for m in pending {
        let Some(rc) = m.upgrade() else { continue };
        let Ok(mut req) = rc.try_borrow_mut() else {
            continue;
        };
        if !matches!(req.phase, Phase::Leasing) {
            continue;
        }
        if fallback {
            if host.set_effective_context(req.id)
                && req.final_admission(host, now_s, None) == Step::Continue
            {
                host.resume_request();
            }
            continue;
        }
        req.lease_rounds = req.lease_rounds.saturating_add(1);
        let subject = req
            .limits_subject()
            .as_deref()
            .unwrap_or_default()
            .to_string();
        let needs = std::mem::take(&mut req.lease_needs);
        match groups.iter_mut().find(|g| g.subject == subject) {
            Some(g) => {
                g.members.push(m.clone());
                g.needs.push(needs);
            }
            None => groups.push(Group {
                subject,
                key: req.counter_key.to_string(),
                members: vec![m.clone()],
                needs: vec![needs],
            }),
        }
    }
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
            for m in &members {
                on_member(host, &mut None, m, &mut |req, host| {
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
    /// The lease is short: join this worker's flight for the subject, or make one from this
    /// request's own callback (the request waits), or wait for the root's next flight;
    /// in fallback with `onUnavailable: refuse` 503. A callout that cannot be dispatched enters
    /// fallback and admits again against the local share.
    pub(super) fn ask_lease(&mut self, host: &dyn Host, items: Vec<LeaseNeed>, now_s: u64) -> Step {
        let Some(cfg) = self.config() else {
            self.refuse(host, &crate::response::Refusal::not_configured());
            return Step::Refused;
        };
        if self.worker.borrow().leases.state.fallback {
            // Only `refuse` mode gets here in fallback (the share mode answers without a lease).
            self.refuse(host, &lease_unavailable());
            return Step::Refused;
        }
        let subject = self
            .limits_subject()
            .as_deref()
            .unwrap_or_default()
            .to_string();
        self.phase = Phase::Leasing;
        // Kept: asked for again by the root when this request ends up pending.
        self.lease_needs = items.clone();
        {
            let mut w = self.worker.borrow_mut();
            if let Some(f) = w.lease_flights.values_mut().find(|f| f.subject == subject) {
                f.members.push(self.me.clone());
                return Step::Wait;
            }
            if w.active != self.id {
                // Inside another context's callback: the root dispatches at its next tick.
                w.lease_pending.push(self.me.clone());
                return Step::Wait;
            }
        }
        let sent = flight(
            &self.worker,
            subject,
            self.counter_key.to_string(),
            items,
            self.id,
            vec![self.me.clone()],
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
        match self.decide_body(host, now_s) {
            Ok(Admitted::Forward(reservation)) => Ok(self.forward(host, reservation)),
            Ok(Admitted::Short { items, limited }) => {
                if self.worker.borrow().leases.state.fallback {
                    self.refuse(host, &lease_unavailable());
                    return Ok(Step::Refused);
                }
                self.lease_limited = Some(limited);
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
            .worker
            .borrow()
            .config
            .as_ref()
            .map_or(1, |c| lease::short_retry_s(&c.limits.global));
        let retry_after = retry.unwrap_or(short_retry);
        let refusal = match self.lease_limited.take() {
            Some(Admission::NeedsLease {
                kind,
                tier,
                headers,
                ..
            }) => limited_refusal(Admission::Limited {
                kind,
                retry_after,
                tier,
                headers,
            }),
            Some(other) => limited_refusal(other),
            None => limited_refusal(Admission::Limited {
                kind: Kind::Requests,
                retry_after,
                tier: String::new(),
                headers: limits::RateHeaders::default(),
            }),
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
        flight: LeaseFlight,
        body_size: usize,
    ) {
        let worker = self.worker.clone();
        let id = self.id;
        answer_flight(host, &worker, flight, body_size, Some(self), id);
    }

    /// The stream ends: a waiting request leaves its flight; the flights this request carries
    /// are cancelled with its stream, their other members wait for the root's next flight.
    pub(super) fn leave_leasing(&mut self) {
        let mut w = self.worker.borrow_mut();
        if w.lease_flights.is_empty() && w.lease_pending.is_empty() {
            return;
        }
        let me = self.me.clone();
        w.lease_pending.retain(|m| !m.ptr_eq(&me));
        for f in w.lease_flights.values_mut() {
            f.members.retain(|m| !m.ptr_eq(&me));
        }
        let tokens: Vec<u32> = w
            .lease_flights
            .iter()
            .filter(|(_, f)| f.carrier == self.id)
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
        if matches!(self.phase, Phase::Leasing) {
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
}
