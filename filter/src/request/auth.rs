//! The authentication callout in a request's life: one `POST /internal/v1/authenticate` per
//! credential and worker (concurrent misses of the very same credential wait for it, by
//! context id), its answer cached and applied to the maker and its waiters, and the waiters
//! answered when the maker's stream goes away with its callout.

use super::{Flight, Phase, Request, Step, Waiting};
use crate::authenticate::{self, AUTHENTICATE_PATH};
use crate::cache::Caller;
use crate::config::PluginConfig;
use crate::credential::{CacheIdentity, Credential};
use crate::host::{Body, HeaderMap, Headers, Host, read_body};
use crate::response::Refusal;
use maas_types::AuthenticateRequest;

impl Request {
    /// A cache miss: wait for this worker's callout for the very same credential, or make one
    /// (`None`: refused, the companion cannot be called).
    pub(super) fn call_companion(
        &mut self,
        host: &dyn Host,
        cfg: &PluginConfig,
        cred: Credential<'_>,
        headers: &HeaderMap,
    ) -> Option<Waiting> {
        let Some(identity) = self.identity.as_ref() else {
            self.refuse(host, &Refusal::undecidable());
            return None;
        };
        let flight_key = identity.flight_key();
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            self.refuse(host, &Refusal::undecidable());
            return None;
        };
        let waiting = if let Some(list) = w.waiting.get_mut(&flight_key) {
            list.push(self.id);
            Waiting::OtherRequest
        } else {
            let body = serde_json::to_vec(&AuthenticateRequest {
                credential: cred.raw().to_string(),
            })
            .unwrap_or_default();
            // The client's trace context (when valid) joins the companion's span to its trace.
            let mut call_headers = vec![
                (":method", "POST"),
                (":path", AUTHENTICATE_PATH),
                (":authority", cfg.companion.authority.as_str()),
                ("content-type", "application/json"),
            ];
            call_headers.extend(crate::observe::trace_context(headers));
            let call = host.dispatch(
                &cfg.companion.cluster,
                &call_headers,
                Some(&body),
                cfg.companion.timeout_ms,
            );
            if let Err(e) = call {
                log::warn!("maas: cannot call the companion: {e}");
                w.metrics.inc(w.metrics.callout_failed, 1);
                drop(w);
                self.refuse(
                    host,
                    &Refusal::auth_unavailable("authentication service unavailable"),
                );
                return None;
            }
            w.metrics.inc(w.metrics.callouts, 1);
            w.waiting.insert(flight_key, Vec::new());
            drop(w);
            self.flight = Some(Flight {
                started_ms: host.now_ms(),
            });
            Waiting::OwnCallout
        };
        Some(waiting)
    }

    /// The answer for this request's credential (its own callout's, or another request's).
    pub(super) fn apply_auth(
        &mut self,
        host: &dyn Host,
        result: Result<Caller, Refusal>,
        now_s: u64,
    ) {
        let Phase::Authenticating {
            headers,
            names_subscription,
            ..
        } = std::mem::replace(&mut self.phase, Phase::Headers)
        else {
            return;
        };
        // The headers were paused for the answer.
        if self.authenticated(host, result, None, headers, names_subscription, now_s)
            == Step::Continue
        {
            host.resume_request();
        }
    }

    /// The companion answered this request's callout: cache, then wake this request and the
    /// requests of this worker waiting for the same credential.
    pub(super) fn on_auth_response(&mut self, host: &dyn Host, body_size: usize) {
        let Some(identity) = self.identity.clone() else {
            return;
        };
        let Some((cfg, latency_metric)) = self
            .worker
            .try_borrow()
            .ok()
            .and_then(|w| Some((w.config.clone()?, w.metrics.callout_latency)))
        else {
            return;
        };
        let now = host.now_ms();
        let started = self.flight.take().map_or(now, |f| f.started_ms);
        if latency_metric != 0 {
            host.record_metric(latency_metric, now.saturating_sub(started));
        }
        let status = host
            .header(Headers::CallResponse, ":status")
            .and_then(|s| s.parse::<u32>().ok());
        let body = read_body(host, Body::CallResponse, body_size);
        let outcome =
            authenticate::interpret(host, &cfg.cache, &identity, status, &body, now / 1000);
        let waiters = match self.worker_mut() {
            Some(mut w) => {
                if outcome.failed {
                    w.metrics.inc(w.metrics.callout_failed, 1);
                }
                w.waiting.remove(&identity.flight_key()).unwrap_or_default()
            }
            None => Vec::new(),
        };
        self.apply_auth(host, outcome.result.clone(), now / 1000);
        self.answer_waiters(host, &waiters, &identity, &outcome.result, now / 1000);
        host.set_effective_context(self.id);
    }

    /// Hands `result` to the waiters (context ids) of the callout for `identity`: checked again
    /// before it is applied, so only the very same credential may take it (any other is told
    /// its authentication was interrupted).
    fn answer_waiters(
        &self,
        host: &dyn Host,
        waiters: &[u32],
        identity: &CacheIdentity,
        result: &Result<Caller, Refusal>,
        now_s: u64,
    ) {
        for id in waiters {
            let Some(rc) = self.registry.get(*id) else {
                continue;
            };
            let Ok(mut waiter) = rc.try_borrow_mut() else {
                continue;
            };
            if host.set_effective_context(waiter.id) {
                let same = waiter
                    .identity
                    .as_ref()
                    .is_some_and(|i| i.same_credential(identity));
                let answer = if same {
                    result.clone()
                } else {
                    Err(authenticate::interrupted())
                };
                waiter.apply_auth(host, answer, now_s);
            }
        }
    }

    /// The stream ends: settle from what was seen; hand waiters of our unanswered callout an
    /// answer (Envoy cancels a callout with its stream); leave the worker's lists.
    pub(super) fn on_done(&mut self, host: &dyn Host) {
        self.leave_leasing();
        self.settle(host);
        let flight = self.flight.take();
        let Some(identity) = self.identity.as_ref() else {
            return;
        };
        let waiters = match self.worker.try_borrow_mut().ok() {
            // No flight key to build when this worker has no callout in flight.
            Some(w) if w.waiting.is_empty() => Vec::new(),
            Some(mut w) if flight.is_some() => {
                w.waiting.remove(&identity.flight_key()).unwrap_or_default()
            }
            Some(mut w) => {
                // A waiter that goes away leaves the waiters' list.
                if let Some(list) = w.waiting.get_mut(&identity.flight_key()) {
                    list.retain(|id| *id != self.id);
                }
                Vec::new()
            }
            None => Vec::new(),
        };
        if flight.is_some() {
            // A refusal reads no clock.
            self.answer_waiters(
                host,
                &waiters,
                identity,
                &Err(authenticate::interrupted()),
                0,
            );
            host.set_effective_context(self.id);
        }
    }
}
