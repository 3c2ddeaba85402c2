//! The adapter's handle on a request: each proxy-wasm callback borrows the request's state and
//! runs one transition; a request-side callback that finds the state busy refuses. The worker's
//! requests are registered by context id: waiters, lease flights and held requests name them by
//! id, and this registry finds their state.

use super::Request;
use crate::FastMap;
use crate::host::Host;
use crate::response::Refusal;
use crate::state::SharedWorker;
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// This worker's live requests by context id.
#[derive(Debug, Clone, Default)]
pub struct Registry(Rc<RefCell<FastMap<u32, Weak<RefCell<Request>>>>>);

impl Registry {
    /// The request of context `id`, while it lives.
    pub(crate) fn get(&self, id: u32) -> Option<Rc<RefCell<Request>>> {
        self.0.try_borrow().ok()?.get(&id)?.upgrade()
    }

    fn insert(&self, id: u32, request: &Rc<RefCell<Request>>) {
        if let Ok(mut map) = self.0.try_borrow_mut() {
            map.insert(id, Rc::downgrade(request));
        }
    }

    fn remove(&self, id: u32) {
        if let Ok(mut map) = self.0.try_borrow_mut() {
            map.remove(&id);
        }
    }

    /// How many requests are registered (tests: none is left behind).
    pub fn len(&self) -> usize {
        self.0.try_borrow().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The handle the adapter's HTTP context holds: the request's state, registered with the
/// worker's requests (a waiter is woken through the registry). A callback that finds the state
/// busy (a re-entrant call) refuses on the request side, never lets it through.
#[derive(Debug, Clone)]
pub struct Http(pub(crate) Rc<RefCell<Request>>);

impl Http {
    pub fn new(id: u32, worker: SharedWorker, registry: &Registry) -> Self {
        let req = Rc::new(RefCell::new(Request::new(id, worker, registry.clone())));
        registry.insert(id, &req);
        Http(req)
    }

    pub fn on_request_headers(&self, host: &dyn Host, end_of_stream: bool) -> Action {
        match self.0.try_borrow_mut() {
            Ok(mut req) => {
                req.enter();
                req.on_headers(host, end_of_stream)
            }
            Err(_) => refuse_undecidable(host),
        }
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
            let flight = req.worker_mut().and_then(|mut w| {
                if w.lease_flights.is_empty() {
                    None
                } else {
                    w.lease_flights.remove(&token)
                }
            });
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
            req.registry.remove(req.id);
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
