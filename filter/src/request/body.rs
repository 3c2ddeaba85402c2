//! The request body stage: buffered until its end (END_STREAM, trailers, or its one declared
//! length), inspected once (at the one base URL its `model` then names the model), rewritten at
//! most once (`stream_options`, the served model name, the output cap), then decided.

use super::{Known, Phase, Request, Step};
use crate::admission::{self, BodyIntent};
use crate::host::{Body, Headers, Host, read_body};
use crate::request_body::{self, BodyError, RequestInfo};
use crate::response::{Deny, Refusal};
use proxy_wasm::types::Action;

/// What signs a Bedrock request: the provider's model id, the day's key, the clock.
pub(super) struct ConverseTarget<'a> {
    pub model_id: &'a str,
    pub key: &'a maas_types::SigV4Key,
    pub now_s: u64,
}

/// Where the body is.
#[derive(Debug, Default)]
enum Stage {
    /// No body to read (none, or one streamed through unread).
    #[default]
    None,
    Buffering,
    /// Read and inspected (the error's message when it is not a body the gateway accepts).
    Done(Result<RequestInfo, BodyError>),
}

/// A request body kept from its end until admission.
#[derive(Debug)]
struct PendingBody {
    bytes: Vec<u8>,
    /// Not what the host holds yet (written when the request is forwarded).
    rewritten: bool,
}

/// The request body's state.
#[derive(Debug, Default)]
pub(super) struct RequestBody {
    stage: Stage,
    /// The headers wait for the body decision (pauseHeadersForBody).
    hold: bool,
    /// The request's one plain `content-length`: a body that reaches it is whole.
    declared: Option<usize>,
    /// Bytes buffered so far (the host's buffer size at the last chunk).
    pub(super) buffered: usize,
    /// The body was decided when it reached its declared length, before END_STREAM.
    decided_early: bool,
    /// The body kept from its end to admission: one that names no cap (admission sets the one
    /// it reserves), or one rewritten (`stream_options`) and not written yet, so a body is
    /// written once whatever is changed in it.
    pending: Option<PendingBody>,
    /// The gateway asked for the stream's usage: the usage-only event is removed.
    pub(super) strip_usage_event: bool,
    /// Translated to Anthropic Messages: what the client asked of the answer's shape.
    pub(super) translated: Option<crate::translate::request::ClientAsk>,
    /// Translated to Bedrock Converse (and signed): what the client asked of the answer.
    pub(super) converse: Option<crate::translate::request::ClientAsk>,
    /// Translated to Gemini `generateContent`: what the client asked of the answer.
    pub(super) gemini: Option<crate::translate::request::ClientAsk>,
    /// The body in the provider's own API (signed Converse, Gemini), written when forwarded
    /// instead of the kept OpenAI body (which stays, so a request decided again after a lease
    /// round is translated, and signed, again from it).
    native_body: Option<Vec<u8>>,
}

impl RequestBody {
    pub(super) fn start(&mut self, hold: bool, declared: Option<usize>) {
        self.stage = Stage::Buffering;
        self.hold = hold;
        self.declared = declared;
    }

    pub(super) fn is_buffering(&self) -> bool {
        matches!(self.stage, Stage::Buffering)
    }

    pub(super) fn holds(&self) -> bool {
        self.hold
    }

    pub(super) fn stop_holding(&mut self) {
        self.hold = false;
    }

    pub(super) fn intent(&self) -> BodyIntent {
        match self.stage {
            Stage::Buffering => BodyIntent::Read {
                hold: self.hold,
                declared: self.declared,
            },
            _ => BodyIntent::Unread,
        }
    }

    /// The inspected body, once read.
    pub(super) fn info(&self) -> Option<&Result<RequestInfo, BodyError>> {
        match &self.stage {
            Stage::Done(info) => Some(info),
            _ => None,
        }
    }

    /// Sets the output cap on the kept body (written when the request is forwarded).
    pub(super) fn set_cap(&mut self, field: &str, value: u64) -> Result<(), Refusal> {
        let Some(pending) = self.pending.as_mut() else {
            return Err(Refusal::internal(
                "the gateway could not set the request's output cap; retry",
            ));
        };
        request_body::set_number_member(&mut pending.bytes, field, value)
            .map_err(|e| Refusal::new(Deny::InvalidBody, e.to_string()))?;
        pending.rewritten = true;
        Ok(())
    }

    /// A Bedrock request, its body final (the cap set): the kept OpenAI body becomes the Converse
    /// body (written when forwarded), and the held headers get Bedrock's path and host and the
    /// SigV4 signature of exactly that body. Refused (503 `signing_unavailable`) when the
    /// headers are not held (they would leave unsigned) or no key can sign it.
    pub(super) fn sign_converse(
        &mut self,
        host: &dyn Host,
        target: &ConverseTarget<'_>,
    ) -> Result<(), Refusal> {
        let unavailable = |why: &str| Refusal::new(Deny::SigningUnavailable, why.to_string());
        if !self.hold {
            return Err(unavailable(
                "this gateway cannot hold request headers for the body (pauseHeadersForBody), so it cannot sign requests to this model",
            ));
        }
        let (Some(pending), Some(ask)) = (self.pending.as_mut(), self.converse) else {
            // No body read (none, or one of a type streamed through unread).
            return Err(Refusal::new(
                Deny::UntranslatableRequest,
                "this model takes an OpenAI chat body (JSON), translated to AWS Bedrock Converse",
            ));
        };
        let (converse, _) = crate::translate::converse::request(&pending.bytes)
            .map_err(|e| Refusal::new(Deny::UntranslatableRequest, e.0))?;
        let path = crate::provider::bedrock_path(target.model_id, ask.stream);
        let authority = crate::provider::bedrock_host(&target.key.region);
        let input = crate::sigv4::SignInput {
            method: "POST",
            host: &authority,
            path: &path,
            query: "",
            content_type: "application/json",
            body: &converse,
            now_s: target.now_s,
        };
        let signed = crate::sigv4::sign(target.key, &input).ok_or_else(|| {
            unavailable("the gateway's AWS signing key is not usable; retry shortly")
        })?;
        pending.rewritten = true;
        self.native_body = Some(converse);
        host.set_header(Headers::Request, ":path", Some(&path));
        host.set_header(Headers::Request, ":authority", Some(&authority));
        host.set_header(Headers::Request, "content-type", Some("application/json"));
        host.set_header(
            Headers::Request,
            "accept",
            Some(if ask.stream {
                crate::translate::converse::EVENTSTREAM
            } else {
                "application/json"
            }),
        );
        for (name, value) in &signed {
            host.set_header(Headers::Request, name, Some(value));
        }
        Ok(())
    }

    /// A Gemini request, its body final (the cap set): the kept OpenAI body becomes the
    /// `generateContent` body (written when forwarded); what cannot be translated is refused
    /// (400 `untranslatable_request`), before anything is counted.
    pub(super) fn translate_gemini(&mut self) -> Result<(), Refusal> {
        let Some(pending) = self.pending.as_mut() else {
            return Err(Refusal::new(
                Deny::UntranslatableRequest,
                "this model takes an OpenAI chat body (JSON), translated to Gemini generateContent",
            ));
        };
        let (body, _) = crate::translate::gemini::request(&pending.bytes)
            .map_err(|e| Refusal::new(Deny::UntranslatableRequest, e.0))?;
        pending.rewritten = true;
        self.native_body = Some(body);
        Ok(())
    }

    /// Translated to a provider's own API (Converse, Gemini): what the client asked of the
    /// answer, and whether the API is Gemini's.
    pub(super) fn native_ask(&self) -> Option<(crate::translate::request::ClientAsk, bool)> {
        self.gemini
            .map(|ask| (ask, true))
            .or(self.converse.map(|ask| (ask, false)))
    }

    /// Writes a body changed since its end (once), and drops the kept copy.
    pub(super) fn write_pending(&mut self, host: &dyn Host) {
        if let Some(signed) = self.native_body.take() {
            self.pending = None;
            self.replace(host, &signed);
            return;
        }
        if let Some(p) = self.pending.take().filter(|p| p.rewritten) {
            self.replace(host, &p.bytes);
        }
    }

    /// Replaces the whole buffered request body (held headers get its new length).
    fn replace(&mut self, host: &dyn Host, new_body: &[u8]) {
        host.set_body(Body::Request, self.buffered, new_body);
        self.buffered = new_body.len();
        if self.hold {
            // Headers still held (allow_on_headers_stop_iteration): keep them exact.
            host.set_header(
                Headers::Request,
                "content-length",
                Some(&new_body.len().to_string()),
            );
        }
    }
}

impl Request {
    /// A body of a request whose headers are held reached the filter: Envoy hands it over.
    fn confirm_held(&self) {
        if self.body.hold
            && let Some(mut w) = self.worker_mut()
        {
            w.held.confirm();
        }
    }

    /// Request body chunk (buffered until the end, or until it reaches its declared length).
    pub(super) fn on_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        self.confirm_held();
        if self.body.decided_early {
            return self.after_early_body();
        }
        if self.decided() || !self.body.is_buffering() {
            return Action::Continue;
        }
        let Some(cfg) = self.config() else {
            return self.refused(host, &Refusal::not_configured());
        };
        if body_size as u64 > cfg.max_request_body_bytes {
            return self.refused(host, &Refusal::too_large(cfg.max_request_body_bytes));
        }
        self.body.buffered = body_size;
        if !end_of_stream {
            // The whole declared body is here (Envoy's codecs hold a request to its
            // `content-length`): decided now, without holding it to END_STREAM. Only once the
            // caller is authorised; while authenticating the answer decides.
            if self.body.declared == Some(body_size)
                && matches!(
                    self.phase,
                    Phase::BodyBuffering { .. } | Phase::AwaitingModel { .. }
                )
            {
                self.body.decided_early = true;
                return self.end_of_body(host);
            }
            return Action::Pause;
        }
        self.end_of_body(host)
    }

    /// A body chunk, trailers or the end of the stream after the body was decided at its
    /// declared length: a request that still waits (lease) or was refused stays paused, any
    /// other goes on. Envoy's codecs end the body there: HTTP/1.1 frames it by its length (what
    /// follows is the next request), HTTP/2 resets a stream whose DATA exceed it.
    fn after_early_body(&self) -> Action {
        // Only a request decided and let through goes on: any phase still deciding pauses.
        if !self.decided() || matches!(self.phase, Phase::Refused) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// Request trailers end the request: an HTTP/2 body whose last DATA frame has no END_STREAM
    /// (or an HTTP/1.1 chunked body with trailers) is decided here, exactly as at the end of a
    /// body, so no request reaches the backend undecided.
    pub(super) fn on_trailers(&mut self, host: &dyn Host) -> Action {
        self.confirm_held();
        if self.body.decided_early {
            return self.after_early_body();
        }
        if self.decided() || !self.body.is_buffering() {
            return Action::Continue;
        }
        self.end_of_body(host)
    }

    /// The whole request body is buffered: inspect it (at the one base URL its `model` names
    /// the model), rewrite it where needed (`stream_options`, the served model name), then
    /// decide if the caller is already known.
    fn end_of_body(&mut self, host: &dyn Host) -> Action {
        let body_size = self.body.buffered;
        let bytes = read_body(host, Body::Request, body_size);
        if bytes.len() != body_size {
            return self.refused(
                host,
                &Refusal::internal("the gateway could not read the request body; retry"),
            );
        }
        let info = request_body::inspect(&bytes);
        self.body.stage = Stage::Done(info);
        if let Err(r) = self
            .route_by_body()
            .and_then(|()| self.keep_or_rewrite(host, bytes))
        {
            return self.refused(host, &r);
        }
        let step = match std::mem::replace(&mut self.phase, Phase::Headers) {
            Phase::BodyBuffering { slot_read, .. } => {
                self.admit(host, slot_read, host.now_ms() / 1000)
            }
            Phase::AwaitingModel { caller } => {
                let Known {
                    caller,
                    counter_key,
                    headers,
                    names_subscription,
                } = *caller;
                self.authorize_known(
                    host,
                    caller,
                    counter_key,
                    headers,
                    names_subscription,
                    host.now_ms() / 1000,
                )
            }
            other => {
                // Still authenticating (headers held): the answer decides.
                self.phase = other;
                Step::Wait
            }
        };
        match step {
            Step::Continue => Action::Continue,
            Step::Wait | Step::Refused => Action::Pause,
        }
    }

    /// Asks a stream for its usage (only APIs that accept `stream_options`; the usage-only
    /// event is removed from what the client sees), gives the body's `model` the model's served
    /// name, and keeps a body that may take a cap until admission, so it is written once.
    fn keep_or_rewrite(&mut self, host: &dyn Host, bytes: Vec<u8>) -> Result<(), Refusal> {
        let (Some(route), Some(info)) = (self.route.as_ref(), self.body.info()) else {
            return Ok(());
        };
        let traits = route.traits;
        // The policy the request is decided with (a reference count, no copy): the served name
        // is borrowed from it while the body changes.
        let policy = route.policy.clone();
        let model = super::model_in(&policy, route.model_idx, route.backend);
        let rename = model.and_then(|m| admission::served_name(m, info));
        let may_take_a_cap = info.as_ref().is_ok_and(|i| i.max_tokens.is_none())
            && traits.cap_field.is_some()
            && !traits.discovery
            && !traits.unmetered;
        let ask_usage = info.as_ref().is_ok_and(|i| i.stream && !i.include_usage)
            && !traits.discovery
            && traits.accepts_stream_options;
        let mut bytes = bytes;
        let mut rewritten = false;
        // `inspect` accepted the body just above: splice without parsing it again.
        let mut strip_usage_event = false;
        if ask_usage && let Ok(new_body) = request_body::splice_include_usage(&bytes) {
            strip_usage_event = true;
            bytes = new_body;
            rewritten = true;
        }
        if let Some(name) = rename {
            request_body::set_string_member(&mut bytes, "model", name)
                .map_err(|e| Refusal::new(Deny::InvalidBody, e.to_string()))?;
            rewritten = true;
        }
        // Before anything is counted: what cannot be translated is refused here. The cap the
        // client named was read for the reservation; none, admission sets the one it reserves
        // (`may_take_a_cap`).
        let client_cap = info.as_ref().ok().and_then(|i| i.max_tokens);
        let converse_ask = crate::translate::request::ClientAsk {
            stream: info.as_ref().is_ok_and(|i| i.stream),
            include_usage: info.as_ref().is_ok_and(|i| i.include_usage),
        };
        let mut translated = None;
        if traits.translate {
            let (body, ask) = crate::translate::request::translate(&bytes, client_cap)
                .map_err(|e| Refusal::new(Deny::UntranslatableRequest, e.0))?;
            translated = Some(ask);
            bytes = body;
            rewritten = true;
        }
        // Claude on Vertex AI: the Messages body without `model`, with Vertex's version; a
        // stream goes to the stream method, a path only held headers can still change.
        let provider = model.and_then(|m| m.provider.as_ref());
        if crate::provider::path_follows_stream(provider) {
            if !traits.gemini {
                bytes = crate::translate::vertex_messages_body(&bytes)
                    .map_err(|e| Refusal::new(Deny::InvalidBody, e))?;
                rewritten = true;
            }
            if info.as_ref().is_ok_and(|i| i.stream) {
                if !self.headers_held() {
                    return Err(Refusal::new(
                        Deny::BodyRoutingUnavailable,
                        "this model streams at another provider path, which this gateway cannot \
                         choose now (request headers are not held for the body); retry without \
                         stream",
                    ));
                }
                let id = model.map_or("", |m| m.served_name.as_deref().unwrap_or(&m.name));
                if let Some(path) =
                    crate::provider::upstream_path(provider, id, traits.operation, true)?
                {
                    host.set_header(Headers::Request, ":path", Some(&path));
                }
            }
        }
        self.body.translated = translated;
        if strip_usage_event {
            self.body.strip_usage_event = true;
        }
        if traits.converse || traits.gemini {
            // Translated (and signed) once the body is final, at admission, before anything is
            // counted ([`RequestBody::sign_converse`], [`RequestBody::translate_gemini`]: what
            // cannot be translated is refused there); what the client asked of the answer is
            // read already.
            if traits.gemini {
                self.body.gemini = Some(converse_ask);
            } else {
                self.body.converse = Some(converse_ask);
            }
            self.body.pending = Some(PendingBody {
                bytes,
                rewritten: true,
            });
            return Ok(());
        }
        if may_take_a_cap {
            // Written at admission, with the cap it may set (one write).
            self.body.pending = Some(PendingBody { bytes, rewritten });
        } else if rewritten {
            self.body.replace(host, &bytes);
        }
        Ok(())
    }
}
