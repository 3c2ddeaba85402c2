//! The response side of a request's life: rate-limit headers, usage scanning as the body
//! passes, and settlement of the reservation (once: end of body, `on_log` or `on_done`).

use super::{Phase, Request};
use crate::decide::{self, Seen};
use crate::encoding::{self, Coding, DecodingScanner};
use crate::host::{Body, HeaderMap, Headers, Host, read_body};
use crate::ledger::Event;
use crate::limits;
use crate::metrics::{self, TokenReport};
use crate::response::Decision;
use crate::sse::{self, SseScanner};
use crate::usage::JsonUsageScanner;
use proxy_wasm::types::Action;

/// What every `x-ratelimit-*` header name starts with.
const RATE_LIMIT_PREFIX: &str = "x-ratelimit-";

fn is_rate_limit_header(name: &str) -> bool {
    name.get(..RATE_LIMIT_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(RATE_LIMIT_PREFIX))
        || [
            crate::limits::QUOTA_WARNING_HEADER,
            crate::limits::IETF_POLICY_HEADER,
            crate::limits::IETF_STATE_HEADER,
        ]
        .iter()
        .any(|h| name.eq_ignore_ascii_case(h))
}

/// Removes each `x-ratelimit-*` name of `map` (as read into `headers`) that `keep` does not
/// keep: once per name, whatever its case and however often it came.
fn remove_rate_limit_headers(
    host: &dyn Host,
    map: Headers,
    headers: &HeaderMap,
    keep: impl Fn(&str) -> bool,
) {
    let mut removed: smallvec::SmallVec<[&str; 4]> = smallvec::SmallVec::new();
    for name in headers
        .names()
        .filter(|n| is_rate_limit_header(n) && !keep(n))
    {
        if !removed.iter().any(|r| r.eq_ignore_ascii_case(name)) {
            host.set_header(map, name, None);
            removed.push(name);
        }
    }
}

/// How the response body is read for usage.
pub enum Scan {
    None,
    Json(JsonUsageScanner),
    Sse(SseScanner),
    /// A body the backend compressed anyway: decoded for the scanner, forwarded untouched.
    Decoding(Box<DecodingScanner>),
    /// A coding that cannot be read (br, zstd…): settles to the reservation.
    Unreadable,
    /// An answer translated for the client (Anthropic Messages → OpenAI chat): its usage is
    /// read by `usage` from what the provider sent, as for a direct call.
    Translated {
        usage: Box<Scan>,
        answer: Box<crate::translate::answer::Answer>,
    },
    /// An answer in the provider's own API translated for the client (Bedrock Converse,
    /// Gemini → OpenAI chat); it reads the usage the provider sent itself.
    Native(Box<crate::translate::NativeAnswer>),
}

impl Scan {
    /// An event stream the filter reads (translated or not).
    pub fn is_stream(&self) -> bool {
        match self {
            Scan::Sse(_) => true,
            Scan::Translated { usage, .. } => matches!(**usage, Scan::Sse(_)),
            Scan::Native(answer) => answer.is_stream(),
            _ => false,
        }
    }
}

impl std::fmt::Debug for Scan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scan::None => "None",
            Scan::Json(_) => "Json",
            Scan::Sse(_) => "Sse",
            Scan::Decoding(_) => "Decoding",
            Scan::Unreadable => "Unreadable",
            Scan::Translated { .. } => "Translated",
            Scan::Native(_) => "Native",
        })
    }
}

/// The scanner for a response, from its `content-type` (any case) and `content-encoding`.
pub fn scan_for(content_type: &str, coding: Coding, strip_usage_event: bool) -> Scan {
    const SSE: &str = "text/event-stream";
    let sse = content_type
        .get(..SSE.len())
        .is_some_and(|t| t.eq_ignore_ascii_case(SSE));
    if coding != Coding::Identity {
        // Asked for identity, compressed anyway: read the usage from a decoded copy.
        let scanner = if sse {
            encoding::Scanner::Sse(SseScanner::new(false))
        } else {
            encoding::Scanner::Json(JsonUsageScanner::new())
        };
        return match DecodingScanner::new(coding, scanner) {
            Some(d) => Scan::Decoding(Box::new(d)),
            None => Scan::Unreadable,
        };
    }
    if sse {
        Scan::Sse(SseScanner::new(strip_usage_event))
    } else if content_type
        .as_bytes()
        .windows(4)
        .any(|w| w.eq_ignore_ascii_case(b"json"))
    {
        Scan::Json(JsonUsageScanner::new())
    } else {
        Scan::None
    }
}

impl Request {
    pub(super) fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        // The one base URL: the answer of a cluster other than the model's never reaches the
        // client (what was reserved is settled as work the backend may have done).
        if matches!(self.phase, Phase::Forwarding { .. })
            && let Err(r) = self.check_routed(host)
        {
            log::warn!("{}", r.message);
            // Settled and refused: one usage event says both (written by the refusal).
            self.settle_usage(host);
            self.refuse(host, &r);
            return Action::Pause;
        }
        // Only an admitted request with a reservation is scanned and settled.
        let (reservation, rate_headers) = match std::mem::replace(&mut self.phase, Phase::Settled) {
            Phase::Forwarding {
                reservation: Some(reservation),
                rate_headers,
            } => (reservation, rate_headers),
            other => {
                self.pass_unread(host, other);
                return Action::Continue;
            }
        };
        // One read of the whole map (a read costs what several writes do: its answer is copied
        // into the VM) for the four values needed.
        let headers = host.headers(Headers::Response);
        let [status, content_type, coding, served_by] = headers.get_each([
            ":status",
            "content-type",
            "content-encoding",
            maas_types::SERVED_BY_HEADER,
        ]);
        let backend = self.served_by(host, served_by);
        let status = status.and_then(|s| s.parse().ok()).unwrap_or(0);
        self.learn_cooldowns(host, backend, status);
        let content_type = content_type.unwrap_or_default();
        let coding = encoding::coding(coding);
        // The upstream's own `x-ratelimit-*` (a provider's limits for the gateway's account)
        // never reach the client: a name the gateway sends replaces it, any other is removed.
        // Most upstreams send none (one pass says so): then each name is added, which spares
        // Envoy a search of the map.
        let style = self.rate_limit_style();
        let upstream_limits = headers.names().any(is_rate_limit_header);
        if upstream_limits {
            remove_rate_limit_headers(host, Headers::Response, &headers, |n| {
                rate_headers.sends(style, n)
            });
        }
        rate_headers.each(style, |name, value| {
            if upstream_limits && headers.get(name).is_some() {
                host.set_header(Headers::Response, name, Some(value));
            } else {
                host.add_header(Headers::Response, name, value);
            }
        });
        // An unmetered operation (count_tokens) generates nothing: its answer is not read.
        let strip = self.body.strip_usage_event;
        let mut scan = if self.traits().is_none_or(|t| t.unmetered) {
            Scan::None
        } else {
            scan_for(content_type, coding, strip)
        };
        if let Some(ask) = self.body.translated {
            // The body changes: its length is the upstream codec's to frame.
            host.set_header(Headers::Response, "content-length", None);
            let answer = crate::translate::answer::Answer::new(
                content_type,
                coding,
                ask,
                host.now_ms() / 1000,
            );
            if answer.drops_encoding() {
                host.set_header(Headers::Response, "content-encoding", None);
            }
            scan = Scan::Translated {
                usage: Box::new(scan),
                answer: Box::new(answer),
            };
        }
        if let Some((ask, gemini)) = self.body.native_ask() {
            scan = self.native_scan(host, content_type, coding, ask, gemini);
        }
        if matches!(scan, Scan::Sse(_)) && strip {
            host.set_header(Headers::Response, "content-length", None);
        }
        // Past a warning threshold, a stream also says so before its first event (a comment:
        // SSE clients skip it; a reader of the raw stream sees it). Only a stream the filter
        // reads as events; formatted, and the length dropped, only then.
        let streamed = scan.is_stream();
        let sse_comment = rate_headers
            .warning
            .filter(|_| streamed && (200..300).contains(&status))
            .map(|w| {
                format!(
                    ": {} {}\n\n",
                    crate::limits::QUOTA_WARNING_HEADER,
                    w.value()
                )
            });
        if sse_comment.is_some()
            && !strip
            && self.body.translated.is_none()
            && self.body.native_ask().is_none()
        {
            host.set_header(Headers::Response, "content-length", None);
        }
        self.phase = Phase::Responding {
            reservation,
            backend,
            status,
            scan: Box::new(scan),
            sse_comment,
        };
        Action::Continue
    }

    /// A response the filter does not read (discovery, or no request of its own): passed on.
    /// Discovery of a model with backends: its route named the backend (nothing reads it),
    /// which the client does not get (one removal, no read).
    fn pass_unread(&mut self, host: &dyn Host, phase: Phase) {
        if matches!(phase, Phase::Forwarding { .. })
            && self.model().is_some_and(|m| !m.backends.is_empty())
        {
            host.set_header(Headers::Response, maas_types::SERVED_BY_HEADER, None);
        }
        self.phase = phase;
    }

    /// The model's backend that served, from the route's [`maas_types::SERVED_BY_HEADER`] (as
    /// the response headers were read): its index among the model's backends, only for a name
    /// among them (a model without backends has none, whatever an upstream sent); for a routed
    /// backend the one drawn. The header never reaches the client (one host call, only when it
    /// came).
    fn served_by(&self, host: &dyn Host, value: Option<&str>) -> Option<u16> {
        if value.is_some() {
            host.set_header(Headers::Response, maas_types::SERVED_BY_HEADER, None);
        }
        // A routed backend: the one drawn (its own cluster answered: checked before this).
        let route = self.route.as_ref()?;
        if route.backend.is_some() {
            return route.backend;
        }
        let value = value?;
        let backends = &route.model()?.backends;
        let i = backends.iter().position(|b| b.name == value)?;
        u16::try_from(i).ok()
    }

    /// What the answer says of the backends Envoy tried (`crate::cooldown`), for a model with a
    /// cooldown whose order the filter gave: no host call, but a clock read when one is cooled.
    fn learn_cooldowns(&self, host: &dyn Host, backend: Option<u16>, status: u32) {
        // Most requests stop here: no order was kept for them.
        let Some(tried) = self.auth.as_ref().and_then(|a| a.tried_order.as_deref()) else {
            return;
        };
        let Some(model) = self.model() else { return };
        // The answering backend's endpoint; "" (in no order) for one the header cannot name:
        // every listed one still failed before it.
        let served = backend
            .and_then(|i| model.backends.get(usize::from(i)))
            .map(|b| {
                b.backend
                    .as_deref()
                    .and_then(crate::admission::endpoint_of)
                    .unwrap_or("")
            });
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            return;
        };
        let mut now_s = || host.now_ms() / 1000;
        for (endpoint, failed) in crate::cooldown::attempts(
            &tried.order,
            served,
            u16::try_from(status).is_ok_and(crate::cooldown::is_failure),
        ) {
            if failed {
                log::debug!("backend {endpoint} of model {} failed", model.name);
            }
            w.cooldowns.record(endpoint, failed, tried.rule, &mut now_s);
        }
    }

    pub(super) fn on_response_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        self.first_stream_bytes(host, body_size);
        if let Phase::Responding {
            scan, sse_comment, ..
        } = &mut self.phase
            && !matches!(**scan, Scan::None | Scan::Unreadable)
        {
            let chunk = read_body(host, Body::Response, body_size);
            // The warning comment goes before the first chunk (once).
            let comment = sse_comment.take();
            // The chunk as the client gets it; copied only with a comment to put first (rare).
            let write = |out: &[u8]| match &comment {
                Some(c) => host.set_body(Body::Response, body_size, &[c.as_bytes(), out].concat()),
                None => host.set_body(Body::Response, body_size, out),
            };
            let mut written = false;
            let scan = match scan.as_mut() {
                Scan::Native(answer) => {
                    write(&answer.feed(&chunk, end_of_stream));
                    written = true;
                    scan.as_mut()
                }
                Scan::Translated { usage, answer } => {
                    // What the client gets for this chunk now (the translation).
                    let out = answer.feed(&chunk, end_of_stream);
                    write(&out);
                    written = true;
                    usage.as_mut()
                }
                other => other,
            };
            match scan {
                Scan::Json(s) => s.feed(&chunk),
                Scan::Decoding(d) => d.feed(&chunk),
                Scan::Sse(s) => {
                    let forward = s.feed(&chunk);
                    let held = if end_of_stream {
                        s.finish().0
                    } else {
                        Vec::new()
                    };
                    // Only a stripped (or held-back) stream is rewritten; otherwise the chunk
                    // Envoy already has goes on untouched, with no copy.
                    if !written {
                        match sse::splice(forward, &held) {
                            Some(out) => write(&out),
                            None if comment.is_some() => write(&chunk),
                            None => {}
                        }
                    }
                }
                Scan::None | Scan::Unreadable | Scan::Translated { .. } | Scan::Native(_) => {}
            }
        }
        if end_of_stream {
            self.settle(host);
        }
        Action::Continue
    }

    /// Response trailers end the response (an HTTP/2 answer whose last DATA frame has no
    /// END_STREAM): the upstream's `x-ratelimit-*` are removed from them too (the gateway's own
    /// are in the headers), an unterminated last SSE event is read for usage, and the
    /// reservation is settled, as at the end of the body.
    pub(super) fn on_response_trailers(&mut self, host: &dyn Host) -> Action {
        let Phase::Responding { scan, .. } = &mut self.phase else {
            return Action::Continue;
        };
        let trailers = host.headers(Headers::ResponseTrailers);
        remove_rate_limit_headers(host, Headers::ResponseTrailers, &trailers, |_| false);
        if let Scan::Translated { answer, .. } = scan.as_mut()
            && answer.pending() > 0
        {
            log::warn!(
                "maas: a translated answer ended in trailers: {} untranslated bytes dropped",
                answer.pending()
            );
        }
        let scan = match scan.as_mut() {
            Scan::Translated { usage, .. } => usage.as_mut(),
            other => other,
        };
        if let Scan::Sse(s) = scan {
            // Bytes held back from an unterminated last event cannot be forwarded once the
            // trailers came (proxy-wasm adds no body data then); its usage is still read.
            let (held, _) = s.finish();
            if !held.is_empty() {
                log::warn!(
                    "maas: a stream ended in trailers after an unterminated event: {} held bytes dropped",
                    held.len()
                );
            }
        }
        self.settle(host);
        Action::Continue
    }

    /// A Bedrock or Gemini answer: translated for the client (a stream stays an event stream,
    /// its length the codec's to frame), its usage read from what the provider sent.
    fn native_scan(
        &self,
        host: &dyn Host,
        content_type: &str,
        coding: Coding,
        ask: crate::translate::request::ClientAsk,
        gemini: bool,
    ) -> Scan {
        use crate::translate::{NativeAnswer, converse, gemini as gem};
        let model = self.model().map(|m| m.name.as_str()).unwrap_or_default();
        let created = host.now_ms() / 1000;
        let answer = if gemini {
            NativeAnswer::Gemini(gem::Answer::new(content_type, coding, ask, model, created))
        } else {
            NativeAnswer::Converse(converse::Answer::new(
                content_type,
                coding,
                ask,
                model,
                created,
            ))
        };
        host.set_header(Headers::Response, "content-length", None);
        if answer.drops_encoding() {
            host.set_header(Headers::Response, "content-encoding", None);
        }
        if answer.is_stream() {
            host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
        }
        Scan::Native(Box::new(answer))
    }

    /// Settles the token reservation to what the response showed (once), and writes the
    /// request's usage event (when the policy asks for them).
    pub(super) fn settle(&mut self, host: &dyn Host) {
        self.settle_usage(host);
        self.write_usage_event(host);
    }

    /// The reservation `res` and the request's scopes' settled to `used`.
    fn settle_counters(
        &mut self,
        host: &dyn Host,
        res: &limits::Reservation,
        used: limits::Used,
        now_s: u64,
    ) {
        // A busy subject's refund is folded into its next counter write (`crate::folds`).
        let folded = self
            .worker
            .try_borrow_mut()
            .is_ok_and(|mut w| w.folds.fold(res, used, now_s));
        if !folded {
            limits::settle(host, res, used, now_s);
        }
        // Each scope the request counted in, likewise (written now: scopes are not folded).
        if let Some(scopes) = self.auth.as_mut().and_then(|a| a.scopes.as_mut()) {
            for r in std::mem::take(&mut scopes.reserved) {
                limits::settle(host, &r, used, now_s);
            }
        }
    }

    /// Settles the token reservation to what the response showed (once). Without response
    /// headers (the client left, the upstream reset) the status is 0: the reservation stands.
    fn settle_usage(&mut self, host: &dyn Host) {
        let (res, backend, status, mut scan) =
            match std::mem::replace(&mut self.phase, Phase::Settled) {
                Phase::Forwarding {
                    reservation: Some(res),
                    ..
                } => (res, None, 0, Box::new(Scan::None)),
                Phase::Responding {
                    reservation,
                    backend,
                    status,
                    scan,
                    ..
                } => (reservation, backend, status, scan),
                Phase::Forwarding {
                    reservation: None, ..
                } => {
                    self.observe(host, Decision::Allowed.as_str(), None);
                    return;
                }
                other => {
                    self.phase = other;
                    return;
                }
            };
        // A translated answer is metered from what the provider sent.
        let scan = match scan.as_mut() {
            Scan::Translated { usage, .. } => usage.as_mut(),
            other => other,
        };
        let (usage, content_events) = match scan {
            Scan::Native(a) => (a.usage(), a.content_events()),
            Scan::Json(s) => (s.finish(), 0),
            Scan::Sse(s) => (s.usage(), s.content_events()),
            Scan::Decoding(d) => d.finish(),
            Scan::None | Scan::Unreadable | Scan::Translated { .. } => (None, 0),
        };
        if usage.is_none() && status == 200 && !matches!(*scan, Scan::None) {
            if let Ok(w) = self.worker.try_borrow() {
                w.metrics.inc(w.metrics.malformed_upstream, 1);
            }
            log::warn!(
                "maas: no usage in a {status} response from model {}",
                self.model().map(|m| m.name.as_str()).unwrap_or("-")
            );
        }
        let seen = Seen {
            usage,
            content_events,
            status,
            prompt_tokens_estimate: self.metering.prompt_tokens_estimate,
        };
        // The limits count weighted tokens; the ledger and the metrics the raw ones.
        let settled = decide::settled_tokens(&seen, self.metering.reserved);
        // Money: the settled tokens at the prices, cached input at its own.
        let used = limits::Used {
            tokens: settled.weighted(self.metering.weights),
            cost: self
                .metering
                .cost(settled, usage.map_or(0, |u| u.cached_input_tokens)),
        };
        let now_ms = host.now_ms();
        let now_s = now_ms / 1000;
        self.settle_counters(host, &res, used, now_s);
        // The usage ledger (in the VM): the response's usage, else what was settled (the
        // prompt estimate as prompt tokens, the rest as completion), unweighted.
        let (prompt, completion, cached) = match usage {
            Some(u) => (u.prompt_tokens, u.completion_tokens, u.cached_input_tokens),
            None => (settled.input, settled.output, 0),
        };
        self.observe(host, Decision::Allowed.as_str(), Some((prompt, completion)));
        // The tier the request ran on (the first of the tiers admission counted in).
        let tier = self.tier_name().unwrap_or_default();
        self.ledger_add(
            tier,
            backend,
            Event::Settled {
                prompt,
                completion,
                cached,
            },
        );
        let operation = self.operation_name();
        if let (Some(u), Some(m), Ok(w)) = (usage, self.model(), self.worker.try_borrow()) {
            w.metrics.tokens(
                host,
                &TokenReport {
                    tier,
                    model: &m.name,
                    operation,
                    input: u.prompt_tokens,
                    output: u.completion_tokens,
                    cached: u.cached_input_tokens,
                },
            );
        }
        if status != 0 {
            self.record_latency(host, &metrics::GEN_AI_REQUEST_DURATION, now_ms);
        }
    }

    fn operation_name(&self) -> &'static str {
        self.traits().map_or("none", |t| t.operation.metric_name())
    }

    /// Records the time since the filter began to decide in a latency family (once the clock
    /// was read at the headers).
    fn record_latency(&self, host: &dyn Host, family: &metrics::Family, now_ms: u64) {
        if self.started_ms == 0 {
            return;
        }
        let model = self.model().map_or("none", |m| m.name.as_str());
        if let Ok(w) = self.worker.try_borrow() {
            w.metrics.record(
                host,
                family,
                &[self.operation_name(), model],
                now_ms.saturating_sub(self.started_ms),
            );
        }
    }

    /// A streamed answer's first bytes: the time to first token (one clock read per stream).
    fn first_stream_bytes(&mut self, host: &dyn Host, body_size: usize) {
        if self.first_bytes_seen || body_size == 0 || self.started_ms == 0 {
            return;
        }
        let streamed_ok = match &self.phase {
            Phase::Responding { status, scan, .. } => {
                (200..300).contains(status) && scan.is_stream()
            }
            _ => false,
        };
        if streamed_ok {
            self.first_bytes_seen = true;
            self.record_latency(host, &metrics::GEN_AI_TIME_TO_FIRST_TOKEN, host.now_ms());
        }
    }
}

/// The usage ledger's side of a request (in the VM: no host call), and its usage event (one
/// host call, with the policy's `observability.usageEvents` only).
impl Request {
    /// `backend`: the index of the model's backend that served (settlements only).
    fn ledger_add(&self, tier: &str, backend: Option<u16>, event: Event<'static>) {
        let (Some(auth), Some(model)) = (
            self.auth.as_ref(),
            self.route.as_ref().and_then(|r| r.listed_model()),
        ) else {
            return;
        };
        let subject = &auth.subject;
        let key_id = self.identity.as_ref().and_then(|i| i.key_id());
        let backend = backend
            .and_then(|i| model.backends.get(usize::from(i)))
            .map(|b| b.name.as_str());
        if let Ok(mut w) = self.worker.try_borrow_mut()
            && w.ledger.enabled
        {
            w.ledger
                .add_served(subject, key_id, tier, &model.name, backend, event);
        }
        self.count_for_event(event, None);
    }

    /// The usage event counts what the ledger counted (`tier`: the ledger's, when the request
    /// holds none yet). Only with the policy's `observability.usageEvents`.
    fn count_for_event(&self, event: Event<'static>, tier: Option<String>) {
        if !self
            .route
            .as_ref()
            .is_some_and(|r| r.policy.observability.usage_events)
        {
            return;
        }
        let Ok(mut slot) = self.usage_event.try_borrow_mut() else {
            return;
        };
        let counted = slot.get_or_insert_default();
        if tier.is_some() {
            counted.tier = tier;
        }
        match event {
            Event::Settled {
                prompt,
                completion,
                cached,
            } => {
                counted.settled = Some(crate::usage_event::Tokens {
                    input: prompt,
                    output: completion,
                    cached,
                });
            }
            Event::Refused(code) if code.starts_with("shadow_") => counted.shadow = Some(code),
            Event::Refused(code) => counted.refused = Some(code),
        }
    }

    /// Hands the request's usage event to Envoy (filter state `wasm.maas_event`), once, when
    /// the ledger counted something for it: at settlement or at the refusal.
    pub(super) fn write_usage_event(&self, host: &dyn Host) {
        let Ok(mut slot) = self.usage_event.try_borrow_mut() else {
            return;
        };
        let Some(counted) = slot.as_mut().filter(|c| !c.written) else {
            return;
        };
        counted.written = true;
        let (Some(route), Some(model)) = (self.route.as_ref(), self.model()) else {
            return;
        };
        let Some(tier) = counted.tier.as_deref().or_else(|| self.tier_name()) else {
            return;
        };
        let about = crate::usage_event::About {
            user: self.caller.as_ref().and_then(|c| c.pseudonym.as_deref()),
            key_id: self.identity.as_ref().and_then(|i| i.key_id()),
            tier,
            model: &model.name,
            operation: Some(route.traits.operation),
        };
        if let Some(event) = crate::usage_event::build(&route.policy, &about, counted) {
            host.set_property(&[crate::usage_event::PROPERTY], &event);
        }
    }

    /// The tier the request runs on: under a subscription its stand-in tier
    /// (`subscription:<S>`), else its tier in the policy it was decided with.
    fn tier_name(&self) -> Option<&str> {
        let policy = &self.route.as_ref()?.policy;
        self.auth.as_ref()?.tier(policy).map(|t| t.name.as_str())
    }

    /// A refusal of a request whose subject and tier are known.
    pub(super) fn ledger_refused(&self, code: &'static str) {
        if let Some(tier) = self.tier_name() {
            self.ledger_add(tier, None, Event::Refused(code));
        }
    }

    /// A refusal while the headers were decided (the subject is known, not kept yet): counted
    /// under the tier the caller resolves to, when there is one.
    pub(super) fn ledger_refused_as(
        &self,
        identity: &crate::cache::CachedIdentity,
        requested_subscription: Option<&str>,
        code: &'static str,
    ) {
        let (Some(policy), Some(model)) = (self.route.as_ref().map(|r| &r.policy), self.model())
        else {
            return;
        };
        let key_id = self.identity.as_ref().and_then(|i| i.key_id());
        // Under a subscription its stand-in tier (`subscription:<S>`), as settlements are;
        // else the tier the caller resolves to.
        let sub_tier = crate::decide::subscription(
            policy,
            identity,
            key_id.is_some(),
            requested_subscription,
            model,
        )
        .ok()
        .flatten()
        .and_then(|s| s.limits_tier(&model.name))
        .map(|t| t.name);
        let tier = match sub_tier {
            Some(t) => t,
            None => {
                let Some(tier) =
                    policy.resolve_tier(&identity.groups, identity.pinned_tier.as_deref())
                else {
                    return;
                };
                tier.name.clone()
            }
        };
        if let Ok(mut w) = self.worker.try_borrow_mut()
            && w.ledger.enabled
        {
            w.ledger.add(
                &identity.subject,
                key_id,
                &tier,
                &model.name,
                Event::Refused(code),
            );
        }
        self.count_for_event(Event::Refused(code), Some(tier));
    }
}
