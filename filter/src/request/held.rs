//! Whether Envoy hands over the body of a request whose headers the filter holds: without the
//! Wasm filter's `allow_on_headers_stop_iteration` it never does, and a held request would wait
//! for a timeout. The root's tick watches held requests until the first held body arrives.

use super::Registry;
use crate::host::{Headers, Host};
use crate::state::{HoldSupport, SharedWorker};

/// Every tick, while this worker does not know whether Envoy hands a held request's body to the
/// filter ([`HoldSupport`]): for each request still holding its headers for a body the filter
/// has not seen, compare what Envoy received for the stream (`request.total_size`: its body
/// bytes plus the header map's bytes) with the header map's bytes. Body bytes Envoy has and the
/// filter never got mean the Wasm filter runs without `allow_on_headers_stop_iteration`: the
/// worker stops holding headers, and every watched request goes on as in the default mode
/// (headers first, then the body Envoy buffered, which the filter then reads and decides as
/// usual). A client that is merely slow has sent no body bytes: it is not taken for a missing
/// knob. A request to the one base URL still waiting for its body is refused (503
/// `body_routing_unavailable`): its route depends on the body. `root`: the context to leave
/// effective.
pub fn probe_held_headers(host: &dyn Host, worker: &SharedWorker, registry: &Registry, root: u32) {
    let watched = match worker.try_borrow_mut() {
        Ok(mut w) if w.held.support == HoldSupport::Unknown && !w.held.watched.is_empty() => {
            std::mem::take(&mut w.held.watched)
        }
        _ => return,
    };
    let mut still = Vec::with_capacity(watched.len());
    let mut missing = false;
    for id in watched {
        let waits = registry
            .get(id)
            .is_some_and(|rc| rc.try_borrow().is_ok_and(|r| r.waits_for_held_body()));
        if !waits {
            continue;
        }
        if !missing && host.set_effective_context(id) {
            let header_bytes = host.headers(Headers::Request).byte_size() as u64;
            missing = host
                .property_u64(&["request", "total_size"])
                .is_some_and(|total| total > header_bytes);
        }
        still.push(id);
    }
    if !missing {
        if let Ok(mut w) = worker.try_borrow_mut()
            // Confirmed meanwhile (a body arrived while the list was out): nothing to keep.
            && w.held.support == HoldSupport::Unknown
        {
            w.held.watched.extend(still);
        }
        host.set_effective_context(root);
        return;
    }
    if let Ok(mut w) = worker.try_borrow_mut() {
        w.held.support = HoldSupport::Missing;
        let gauge = w.metrics.hold_unsupported;
        if gauge != 0 {
            host.record_metric(gauge, 1);
        }
    }
    log::error!(
        "maas: pauseHeadersForBody is on but Envoy does not hand the body of a request whose \
         headers are held to the filter (the Wasm filter's allow_on_headers_stop_iteration is \
         not set, or this Envoy is older than 1.35): request headers now go on before the body \
         on this worker, and a refusal decided on the body resets an upstream request that has \
         started; set allow_on_headers_stop_iteration: true (docs/deploy.md)"
    );
    for id in still {
        let Some(rc) = registry.get(id) else { continue };
        let Ok(mut req) = rc.try_borrow_mut() else {
            continue;
        };
        if req.waits_for_held_body() && host.set_effective_context(id) {
            if req.routes_by_body() {
                // The one base URL cannot go on undecided: its route depends on the body.
                req.refuse(host, &crate::admission::body_routing_unavailable());
            } else {
                req.stop_holding(host);
                host.resume_request();
            }
        }
    }
    host.set_effective_context(root);
}
