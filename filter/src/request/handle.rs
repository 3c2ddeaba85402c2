//! The adapter's handle on a request: each proxy-wasm callback borrows the request's state and
//! runs one transition; a request-side callback that finds the state busy refuses.

use super::{Phase, Request, Waiting};
use crate::host::Host;
use crate::response::Refusal;
use crate::worker::SharedWorker;
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

/// The handle the adapter's HTTP context holds: the request's state, shared with the worker's
/// waiters' lists (a waiter is woken through it). A callback that finds the state busy (a
/// re-entrant call) refuses on the request side, never lets it through.
#[derive(Debug, Clone)]
pub struct Http(pub Rc<RefCell<Request>>);

impl Http {
    pub fn new(id: u32, worker: SharedWorker) -> Self {
        let req = Rc::new(RefCell::new(Request::new(id, worker)));
        if let Ok(mut r) = req.try_borrow_mut() {
            r.me = Rc::downgrade(&req);
        }
        Http(req)
    }

    pub fn on_request_headers(&self, host: &dyn Host, end_of_stream: bool) -> Action {
        let action = match self.0.try_borrow_mut() {
            Ok(mut req) => {
                req.enter();
                req.on_headers(host, end_of_stream)
            }
            Err(_) => return refuse_undecidable(host),
        };
        // A request that waits for another request's callout joins the worker's waiters for its
        // credential (the handle is needed to resume it from the request that made the callout).
        if let Ok(req) = self.0.try_borrow()
            && matches!(
                req.phase,
                Phase::Authenticating {
                    waiting: Waiting::OtherRequest
                }
            )
            && let Some(identity) = &req.identity
        {
            let key = identity.flight_key();
            let worker = req.worker.clone();
            drop(req);
            if let Some(list) = worker.borrow_mut().waiting.get_mut(&key) {
                list.push(self.0.clone());
            }
        }
        action
    }

    pub fn on_request_body(
        &self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        match self.0.try_borrow_mut() {
            Ok(mut req) => {
                req.enter();
                req.on_body(host, body_size, end_of_stream)
            }
            Err(_) => refuse_undecidable(host),
        }
    }

    pub fn on_request_trailers(&self, host: &dyn Host) -> Action {
        match self.0.try_borrow_mut() {
            Ok(mut req) => {
                req.enter();
                req.on_trailers(host)
            }
            Err(_) => refuse_undecidable(host),
        }
    }

    /// The response side cannot refuse any more: a busy state lets the response pass.
    pub fn on_response_headers(&self, host: &dyn Host) -> Action {
        match self.0.try_borrow_mut() {
            Ok(mut req) => req.on_response_headers(host),
            Err(_) => Action::Continue,
        }
    }

    pub fn on_response_body(
        &self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        match self.0.try_borrow_mut() {
            Ok(mut req) => req.on_response_body(host, body_size, end_of_stream),
            Err(_) => Action::Continue,
        }
    }

    pub fn on_response_trailers(&self, host: &dyn Host) -> Action {
        match self.0.try_borrow_mut() {
            Ok(mut req) => req.on_response_trailers(host),
            Err(_) => Action::Continue,
        }
    }

    /// A callout's answer: a lease flight this context carries (by its token), else this
    /// request's authentication callout.
    pub fn on_call_response(&self, host: &dyn Host, token: u32, body_size: usize) {
        if let Ok(mut req) = self.0.try_borrow_mut() {
            req.enter();
            let flight = {
                let mut w = req.worker.borrow_mut();
                if w.lease_flights.is_empty() {
                    None
                } else {
                    w.lease_flights.remove(&token)
                }
            };
            match flight {
                Some(f) => req.on_lease_answer(host, f, body_size),
                None => req.on_auth_response(host, body_size),
            }
        }
    }

    pub fn on_log(&self, host: &dyn Host) {
        if let Ok(mut req) = self.0.try_borrow_mut() {
            req.settle(host);
        }
    }

    pub fn on_done(&self, host: &dyn Host) -> bool {
        if let Ok(mut req) = self.0.try_borrow_mut() {
            req.on_done(host);
        }
        // A waiter that goes away leaves the waiters' list (nothing to look for, and no flight
        // key to build, when this worker has no callout in flight).
        if let Ok(req) = self.0.try_borrow()
            && let Some(identity) = &req.identity
            && !req.worker.borrow().waiting.is_empty()
        {
            let key = identity.flight_key();
            let worker = req.worker.clone();
            drop(req);
            if let Some(list) = worker.borrow_mut().waiting.get_mut(&key) {
                list.retain(|w| !Rc::ptr_eq(w, &self.0));
            }
        }
        true
    }
}

/// A request whose state cannot be read is refused, never let through (an auth filter that
/// cannot decide must not continue).
fn refuse_undecidable(host: &dyn Host) -> Action {
    let r = Refusal::undecidable();
    host.send_response(r.status, &[("content-type", "application/json")], &r.body());
    Action::Pause
}
