//! The `DecodeWorker` gRPC service.

use ferry_proto::auth::AttachToken;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_kvtransfer::{KvLayoutDesc, Registration};
use ferry_model::engine::{
    sample_seed, EngineError, EngineEvent, EngineHandle, FailureKind, FinishReason, GenerateJob,
    GenerateOptions, Generation, PrefillSource, SpecCounts, MAX_SAMPLES,
};
use ferry_model::grammar::{Grammar, GrammarCompiler};
use ferry_proto::internal::decode_worker_server::DecodeWorker;
use ferry_proto::internal::{
    CancelSampleRequest, CancelSampleResponse, DecodeRequest, DecodeResponse, GetStatsRequest,
    KvLayout, WorkerStats,
};
use ferry_proto::trace_ctx;
use ferry_proto::v1::FinishReason as WireFinish;
use ferry_worker::args::{
    controls, logprobs, logprobs_to_wire, prompt_logprobs, sampling, stop_params, validate_prompt,
};
use ferry_worker::registration::PrefillView;
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};
use tracing::{debug, field, info_span, Instrument, Span};

use crate::metrics::DecodeMetrics;
use crate::remote_prefill::{self, RemotePrefill};
use crate::samples::{LiveSamples, SampleSlot};
use crate::server::FailurePolicy;

/// Decode-side settings the service applies per request.
#[derive(Debug, Clone)]
pub struct DecodePolicy {
    /// Uncached prompt tokens at or below which the prompt is prefilled here.
    pub local_prefill_threshold: usize,
    /// What a failed remote prefill leads to.
    pub on_failure: FailurePolicy,
    /// How long a prefill peer may take.
    pub prefill_timeout: Duration,
    /// Signs the `Prefill` calls to peers with the cluster token.
    pub peer_auth: AttachToken,
}

/// The service state.
#[derive(Clone)]
pub struct DecodeService {
    worker_id: String,
    engine: EngineHandle,
    registration: Registration,
    layout: KvLayoutDesc,
    policy: Arc<DecodePolicy>,
    metrics: DecodeMetrics,
    prefill_view: watch::Receiver<PrefillView>,
    /// Compiles requests' `response_format` (structured output); `None`: they are refused.
    grammar: Option<GrammarCompiler>,
    /// The samples of the running `n` > 1 calls, for `CancelSample`.
    live: LiveSamples,
}

/// Where peers write this worker's KV: its transfer registration and pool layout.
#[derive(Debug, Clone)]
pub struct KvTarget {
    /// The transport registration of this worker's pool.
    pub registration: Registration,
    /// The pool's layout.
    pub layout: KvLayoutDesc,
}

impl DecodeService {
    /// A service over `engine`, whose pool peers reach through `target`, counting into
    /// `metrics`.
    pub fn new(
        worker_id: String,
        engine: EngineHandle,
        target: KvTarget,
        policy: DecodePolicy,
        metrics: DecodeMetrics,
    ) -> Self {
        Self {
            worker_id,
            engine,
            registration: target.registration,
            layout: target.layout,
            policy: Arc::new(policy),
            metrics,
            prefill_view: watch::channel(PrefillView::default()).1,
            grammar: None,
            live: LiveSamples::default(),
        }
    }

    /// Serves structured output with `compiler` (built once per worker,
    /// [`ferry_worker::grammar::load_compiler`]).
    pub fn with_grammar(self, compiler: Option<GrammarCompiler>) -> Self {
        Self {
            grammar: compiler,
            ..self
        }
    }

    /// Gives up on remote prefills whose peer the router stops listing in `view` (see
    /// [`remote_prefill`]); without it only the call's failure or timeout does.
    pub fn with_prefill_view(self, view: watch::Receiver<PrefillView>) -> Self {
        Self {
            prefill_view: view,
            ..self
        }
    }

    /// The engine this service drives.
    pub fn engine_handle(&self) -> EngineHandle {
        self.engine.clone()
    }

    /// The `n` > 1 calls running now (their samples can be stopped one by one).
    pub fn live_calls(&self) -> usize {
        self.live.len()
    }
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let started = Instant::now();
        // Recorded later: the id once parsed, the speculative counts with the request's end.
        let span = info_span!(
            "decode",
            otel.kind = "server",
            request_id = field::Empty,
            ferry.spec.rounds = field::Empty,
            ferry.spec.drafted_tokens = field::Empty,
            ferry.spec.accepted_tokens = field::Empty,
            ferry.spec.acceptance_length = field::Empty,
        );
        trace_ctx::set_parent_from_request(&span, &request);
        let r = request.into_inner();
        span.record("request_id", r.request_id.as_str());
        trace_ctx::set_attribute(&span, "rpc.system", "grpc");
        trace_ctx::set_attribute(&span, "rpc.service", "ferry.internal.v1.DecodeWorker");
        trace_ctx::set_attribute(&span, "rpc.method", "Decode");
        trace_ctx::set_attribute(
            &span,
            "gen_ai.usage.input_tokens",
            i64::try_from(r.prompt_tokens.len()).unwrap_or(i64::MAX),
        );
        let grammar =
            ferry_worker::grammar::compile(self.grammar.as_ref(), r.response_format.as_ref())
                .instrument(span.clone())
                .await;
        let submitted = grammar.and_then(|g| span.in_scope(|| self.submit(&r, g)));
        let (mut generations, peer) = submitted.inspect_err(|status| {
            let kind = match status.code() {
                Code::InvalidArgument => "invalid_argument",
                Code::ResourceExhausted => "overloaded",
                _ => "failed",
            };
            self.metrics.failure.with_label_values(&[kind]).inc();
            trace_ctx::set_error(&span, status.message());
            span.in_scope(|| debug!(error = status.message(), kind, "decode request refused"));
        })?;
        let (tx, rx) = mpsc::channel(64);
        let samples = generations.len();
        // With n > 1, the call's id (sample 0's engine id) names it in `CancelSample`, and
        // each sample can be stopped on its own.
        let call_id = generations.first().map_or(0, |g| g.id.0);
        let mut slots = if samples > 1 {
            self.live.register(call_id, &r.request_id, samples)
        } else {
            Vec::new()
        }
        .into_iter();
        let slot = slots.next();
        // Samples 1.. (n > 1) stream on their own, into the same response stream.
        let forks = generations.split_off(1.min(generations.len()));
        for ((i, g), slot) in forks.into_iter().enumerate().zip(slots) {
            let i = i + 1;
            let fork = Fork {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                call_id,
                slot,
                metrics: self.metrics.clone(),
            };
            tokio::spawn(drive_fork(fork, g, tx.clone()).instrument(span.clone()));
        }
        let Some(generation) = generations.pop() else {
            return Err(Status::internal("the engine started no sample"));
        };
        let ctx = Drive {
            samples,
            call_id: if samples > 1 { call_id } else { 0 },
            slot,
            engine: self.engine.clone(),
            request: r,
            peer,
            prefill_view: self.prefill_view.clone(),
            registration: self.registration.clone(),
            layout: self.layout,
            policy: self.policy.clone(),
            metrics: self.metrics.clone(),
            started,
        };
        tokio::spawn(drive(ctx, generation, tx).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn cancel_sample(
        &self,
        request: Request<CancelSampleRequest>,
    ) -> Result<Response<CancelSampleResponse>, Status> {
        let r = request.into_inner();
        let stopped = self.live.cancel(&r.request_id, r.call_id, r.index);
        debug!(
            request_id = r.request_id,
            call_id = r.call_id,
            index = r.index,
            stopped,
            "the router stops a sample"
        );
        Ok(Response::new(CancelSampleResponse { stopped }))
    }

    async fn get_stats(
        &self,
        _request: Request<GetStatsRequest>,
    ) -> Result<Response<WorkerStats>, Status> {
        let s = self.engine.stats().await.map_err(engine_status)?;
        Ok(Response::new(ferry_worker::stats::worker_stats(
            &self.worker_id,
            &s,
            s.kv_bytes_received,
        )))
    }
}

impl DecodeService {
    /// Validates `r` and submits it to the engine (in the request's span, which the engine
    /// keeps); returns the generation and the prefill peer, if any.
    fn submit(
        &self,
        r: &DecodeRequest,
        grammar: Option<Grammar>,
    ) -> Result<(Vec<Generation>, Option<Peer>), Status> {
        let stop = r
            .stop
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("`stop` is required"))?;
        if stop.max_tokens == 0 {
            return Err(Status::invalid_argument(
                "`stop.max_tokens` must be >= 1, got 0",
            ));
        }
        let max_tokens = stop.max_tokens as usize;
        let resumed = r.generated_tokens as usize;
        let n = (r.n as usize).max(1);
        if n > MAX_SAMPLES {
            return Err(Status::invalid_argument(format!(
                "`n` must be between 1 and {MAX_SAMPLES}, got {n}"
            )));
        }
        if r.prompt_logprobs.is_some() && resumed > 0 {
            return Err(Status::invalid_argument(format!(
                "`prompt_logprobs` must be unset for a resumed request (`generated_tokens` \
                 {resumed}): the prompt holds generated tokens"
            )));
        }
        if n > 1 && resumed > 0 {
            return Err(Status::invalid_argument(format!(
                "`n` must be 1 for a resumed request (`generated_tokens` {resumed}), got {n}"
            )));
        }
        let sample = r.sample_index as usize;
        if sample >= MAX_SAMPLES || (sample > 0 && n > 1) {
            return Err(Status::invalid_argument(format!(
                "`sample_index` must be < {MAX_SAMPLES}, and 0 with `n` > 1 (got `n` {n}), \
                 got {sample}"
            )));
        }
        if resumed >= max_tokens || resumed >= r.prompt_tokens.len() {
            return Err(Status::invalid_argument(format!(
                "`generated_tokens` must be < `stop.max_tokens` ({max_tokens}) and < the prompt \
                 length ({}), got {resumed}",
                r.prompt_tokens.len()
            )));
        }
        validate_prompt(
            self.engine.model_config(),
            &r.prompt_tokens,
            max_tokens - resumed,
        )?;
        let mut params = sampling(r.sampling.as_ref())?;
        // Sample i of a request alone draws the stream it would have drawn forked (n > 1).
        params.seed = params.seed.map(|s| sample_seed(s, sample));
        let vocab = self.engine.model_config().vocab_size;
        let controls = controls(r.sampling.as_ref(), vocab)?;
        let stop_params = stop_params(Some(stop), vocab)?;
        // A resumed request prefills here: a peer would draw its first token at step 0.
        let peer = r
            .prefill_peer
            .as_ref()
            .filter(|p| !p.grpc_address.is_empty() && resumed == 0)
            .map(|p| Peer {
                id: p.worker_id.clone(),
                address: p.grpc_address.clone(),
            });
        let prefill = match peer {
            Some(_) => PrefillSource::Remote {
                local_threshold: self.policy.local_prefill_threshold,
            },
            None => PrefillSource::Local,
        };
        let span = Span::current();
        trace_ctx::set_attribute(
            &span,
            "gen_ai.request.max_tokens",
            i64::from(stop.max_tokens),
        );
        if let Some(on) = r.speculative {
            trace_ctx::set_attribute(&span, "ferry.spec.requested", on);
        }
        if resumed > 0 {
            trace_ctx::set_attribute(
                &span,
                "ferry.migration.resumed_tokens",
                i64::from(r.generated_tokens),
            );
        }
        let job = GenerateJob {
            prompt: r.prompt_tokens.clone(),
            sampling: params,
            controls,
            stop: stop_params,
            prefill,
            grammar,
        };
        // Unset follows this worker: speculation iff it was started with a drafter, except for
        // seeded sampled requests (`GenerateOptions::speculates`).
        let options = GenerateOptions {
            speculative: r.speculative,
            resumed_tokens: resumed,
            logprobs: logprobs(r.logprobs)?,
            prompt_logprobs: prompt_logprobs(r.prompt_logprobs)?,
        };
        let generations = self
            .engine
            .generate_n(job, n, options)
            .map_err(engine_status)?;
        Ok((generations, peer))
    }
}

/// The prefill worker the router named for a request.
struct Peer {
    /// Its worker id (to notice the router dropping it).
    id: String,
    /// Its gRPC address, host:port.
    address: String,
}

struct Drive {
    /// Samples of the request (n); with more than one, sample 0's failure is sent in-band
    /// (`DecodeResponse.error`) so the other samples' stream goes on.
    samples: usize,
    /// With n > 1, the call's id (sent on sample 0's first message); 0 otherwise.
    call_id: u64,
    /// With n > 1, sample 0's stop token (`CancelSample`).
    slot: Option<SampleSlot>,
    engine: EngineHandle,
    request: DecodeRequest,
    peer: Option<Peer>,
    prefill_view: watch::Receiver<PrefillView>,
    registration: Registration,
    layout: KvLayoutDesc,
    policy: Arc<DecodePolicy>,
    metrics: DecodeMetrics,
    /// When the request arrived.
    started: Instant,
}

/// Per-request timing and counts, turned into metrics and span attributes at the end.
struct Progress {
    tokens: u64,
    last_token: Option<Instant>,
}

impl Progress {
    fn token(&mut self, m: &DecodeMetrics, started: Instant) {
        let now = Instant::now();
        match self.last_token {
            None => m.ttft.observe((now - started).as_secs_f64()),
            Some(last) => m.itl.observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.tokens += 1;
    }
}

/// Gathers the tokens the engine has already queued after the one in hand into `ids` (each
/// with its log-probabilities into `logprobs` when the request asked): a speculative round
/// commits several tokens of a sequence in one step, and they go out as one message, so one
/// SSE chunk at the router, as vLLM streams one delta per engine step. Takes only what is
/// already queued, never waits; the first other event (and a token's log-probabilities whose
/// token is not queued yet) goes to `held`, to be handled next.
fn queued_tokens(
    events: &mut mpsc::UnboundedReceiver<EngineEvent>,
    ids: &mut Vec<u32>,
    logprobs: &mut Vec<ferry_proto::v1::TokenLogprob>,
    held: &mut VecDeque<EngineEvent>,
) {
    while let Ok(event) = events.try_recv() {
        match event {
            EngineEvent::Token(t) => ids.push(t),
            // A token's log-probabilities come right before it.
            EngineEvent::Logprobs(lp) => match events.try_recv() {
                Ok(EngineEvent::Token(t)) => {
                    logprobs.push(logprobs_to_wire(&lp));
                    ids.push(t);
                }
                Ok(other) => {
                    held.extend([EngineEvent::Logprobs(lp), other]);
                    return;
                }
                Err(_) => {
                    held.push_back(EngineEvent::Logprobs(lp));
                    return;
                }
            },
            other => {
                held.push_back(other);
                return;
            }
        }
    }
}

/// Records how a request ended on its span and in the metrics.
fn record_end(ctx: &Drive, p: &Progress, outcome: Result<&'static str, (&'static str, &str)>) {
    let span = Span::current();
    trace_ctx::set_attribute(
        &span,
        "gen_ai.usage.output_tokens",
        i64::try_from(p.tokens).unwrap_or(i64::MAX),
    );
    let m = &ctx.metrics;
    match outcome {
        Ok(reason) => {
            m.success.with_label_values(&[reason]).inc();
            m.e2e.observe(ctx.started.elapsed().as_secs_f64());
            m.prompt_tokens
                .inc_by(ctx.request.prompt_tokens.len() as u64);
            m.generation_tokens.inc_by(p.tokens);
            trace_ctx::set_attribute(&span, "gen_ai.response.finish_reasons", reason);
        }
        Err((kind, message)) => {
            m.failure.with_label_values(&[kind]).inc();
            trace_ctx::set_error(&span, message.to_string());
        }
    }
}

/// Forwards engine events to the client; starts the remote prefill when blocks are reserved.
/// Returning drops the generation, which cancels the request in the engine.
async fn drive(
    ctx: Drive,
    mut generation: Generation,
    tx: mpsc::Sender<Result<DecodeResponse, Status>>,
) {
    let mut cached = 0u32;
    let mut mode = "local";
    let mut first = true;
    let mut pending_logprobs = None;
    // The prompt's log-probabilities go out with the first token (sample 0's first message).
    let mut pending_prompt = Vec::new();
    let mut progress = Progress {
        tokens: 0,
        last_token: None,
    };
    // Events taken while gathering a step's tokens, handled next.
    let mut held = VecDeque::new();
    loop {
        let event = match held.pop_front() {
            Some(e) => Some(e),
            None => tokio::select! {
                _ = tx.closed() => {
                    debug!("client went away; cancelling");
                    record_end(&ctx, &progress, Err(("cancelled", "the client went away")));
                    return;
                }
                _ = stopped(ctx.slot.as_ref()) => {
                    debug!("the router stopped sample 0; cancelling it");
                    record_end(&ctx, &progress, Err(("cancelled", "the router stopped the sample")));
                    return;
                }
                e = generation.events.recv() => e,
            },
        };
        let msg = match event {
            None => Err(Status::internal(
                "the engine ended the request without a reason",
            )),
            Some(EngineEvent::Reserved {
                blocks,
                cached_tokens,
            }) => {
                cached = u32::try_from(cached_tokens).unwrap_or(u32::MAX);
                mode = "remote";
                record_prefill(mode, cached);
                let (peer, peer_id) = ctx
                    .peer
                    .as_ref()
                    .map(|p| (p.address.clone(), p.id.clone()))
                    .unwrap_or_default();
                let job = RemotePrefill {
                    request_id: ctx.request.request_id.clone(),
                    peer,
                    peer_id,
                    view: ctx.prefill_view.clone(),
                    prompt: ctx.request.prompt_tokens.clone(),
                    sampling: ctx.request.sampling.clone().unwrap_or_default(),
                    stop: ctx.request.stop.clone(),
                    logprobs: ctx.request.logprobs,
                    prompt_logprobs: ctx.request.prompt_logprobs,
                    vocab: ctx.engine.model_config().vocab_size,
                    response_format: ctx.request.response_format.clone(),
                    blocks,
                    cached_tokens,
                    registration: ctx.registration.clone(),
                    layout: KvLayout::from(ctx.layout),
                    fence: ferry_kvtransfer::Fence(generation.id.0),
                    timeout: ctx.policy.prefill_timeout,
                    auth: ctx.policy.peer_auth.clone(),
                    metrics: ctx.metrics.clone(),
                };
                tokio::spawn(
                    remote_prefill::run(
                        job,
                        ctx.engine.clone(),
                        generation.id,
                        ctx.policy.on_failure,
                    )
                    .in_current_span(),
                );
                continue;
            }
            Some(EngineEvent::LocalPrefill { cached_tokens }) => {
                cached = u32::try_from(cached_tokens).unwrap_or(u32::MAX);
                record_prefill(mode, cached);
                continue;
            }
            Some(EngineEvent::Speculation(counts)) => {
                record_spec(&counts);
                continue;
            }
            Some(EngineEvent::PromptLogprobs(lps)) => {
                pending_prompt = lps.iter().map(logprobs_to_wire).collect();
                continue;
            }
            Some(EngineEvent::Logprobs(lp)) => {
                // Sent with the token that follows.
                pending_logprobs = Some(logprobs_to_wire(&lp));
                continue;
            }
            Some(EngineEvent::Token(t)) => {
                let mut ids = vec![t];
                let mut logprobs: Vec<_> = pending_logprobs.take().into_iter().collect();
                queued_tokens(&mut generation.events, &mut ids, &mut logprobs, &mut held);
                for _ in &ids {
                    progress.token(&ctx.metrics, ctx.started);
                }
                Ok(DecodeResponse {
                    token_ids: ids,
                    logprobs,
                    prompt_logprobs: std::mem::take(&mut pending_prompt),
                    ..Default::default()
                })
            }
            Some(EngineEvent::Finished(r)) => Ok(DecodeResponse {
                finish_reason: match r {
                    FinishReason::Stop => WireFinish::Stop,
                    FinishReason::Length => WireFinish::Length,
                } as i32,
                // A first token that was a stop token is not sent: its prompt's entries are.
                prompt_logprobs: std::mem::take(&mut pending_prompt),
                ..Default::default()
            }),
            Some(EngineEvent::Failed(e)) if ctx.samples > 1 => Ok(DecodeResponse {
                error_code: failure_code(e.kind) as u32,
                error: e.message,
                ..Default::default()
            }),
            Some(EngineEvent::Failed(e)) => Err(Status::new(failure_code(e.kind), e.message)),
        };
        let done = !matches!(&msg, Ok(m) if m.finish_reason == WireFinish::Unspecified as i32 && m.error.is_empty());
        if done {
            let outcome = match &msg {
                Ok(m) if !m.error.is_empty() => Err(("failed", m.error.as_str())),
                Ok(m) if m.finish_reason == WireFinish::Stop as i32 => Ok("stop"),
                Ok(_) => Ok("length"),
                Err(status) => Err(("failed", status.message())),
            };
            record_end(&ctx, &progress, outcome);
        }
        let msg = msg.map(|mut m| {
            if first {
                m.cached_prompt_tokens = cached;
                m.prefill_mode = mode.into();
                m.call_id = ctx.call_id;
                first = false;
            }
            // Sample 0, or the one sample a `sample_index` call generates.
            m.index = ctx.request.sample_index;
            m
        });
        if tx.send(msg).await.is_err() {
            if !done {
                record_end(&ctx, &progress, Err(("cancelled", "the client went away")));
            }
            return;
        }
        if done {
            return;
        }
    }
}

/// Sample `index` ≥ 1 of an `n` > 1 request.
struct Fork {
    index: u32,
    /// The call's id (sent on the sample's first message).
    call_id: u64,
    /// The sample's stop token (`CancelSample`).
    slot: SampleSlot,
    metrics: DecodeMetrics,
}

/// Forwards a forked sample's events into the request's stream, tagged with its index; its
/// failure is sent in-band ([`DecodeResponse::error`]) and ends this sample only. Returning
/// (the stream or the sample stopped, or its end) drops the generation, which cancels the
/// sample in the engine.
async fn drive_fork(
    fork: Fork,
    mut generation: Generation,
    tx: mpsc::Sender<Result<DecodeResponse, Status>>,
) {
    let mut pending_logprobs = None;
    let mut first = true;
    let mut held = VecDeque::new();
    loop {
        let event = match held.pop_front() {
            Some(e) => Some(e),
            None => tokio::select! {
                _ = tx.closed() => return,
                _ = fork.slot.stop.cancelled() => {
                    debug!(index = fork.index, "the router stopped the sample; cancelling it");
                    return;
                }
                e = generation.events.recv() => e,
            },
        };
        let msg = match event {
            None => DecodeResponse {
                error: "the engine ended the sample without a reason".into(),
                ..Default::default()
            },
            Some(
                EngineEvent::Reserved { .. }
                | EngineEvent::LocalPrefill { .. }
                | EngineEvent::PromptLogprobs(_)
                | EngineEvent::Speculation(_),
            ) => continue,
            Some(EngineEvent::Logprobs(lp)) => {
                pending_logprobs = Some(logprobs_to_wire(&lp));
                continue;
            }
            Some(EngineEvent::Token(t)) => {
                let mut ids = vec![t];
                let mut logprobs: Vec<_> = pending_logprobs.take().into_iter().collect();
                queued_tokens(&mut generation.events, &mut ids, &mut logprobs, &mut held);
                fork.metrics.generation_tokens.inc_by(ids.len() as u64);
                DecodeResponse {
                    token_ids: ids,
                    logprobs,
                    ..Default::default()
                }
            }
            Some(EngineEvent::Finished(r)) => DecodeResponse {
                finish_reason: match r {
                    FinishReason::Stop => WireFinish::Stop,
                    FinishReason::Length => WireFinish::Length,
                } as i32,
                ..Default::default()
            },
            Some(EngineEvent::Failed(e)) => DecodeResponse {
                error_code: failure_code(e.kind) as u32,
                error: e.message,
                ..Default::default()
            },
        };
        let done = msg.finish_reason != WireFinish::Unspecified as i32 || !msg.error.is_empty();
        let msg = DecodeResponse {
            index: fork.index,
            call_id: if first { fork.call_id } else { 0 },
            ..msg
        };
        first = false;
        if tx.send(Ok(msg)).await.is_err() || done {
            return;
        }
    }
}

/// Resolves when the router stopped this sample (`CancelSample`); never without a slot.
async fn stopped(slot: Option<&SampleSlot>) {
    match slot {
        Some(s) => s.stop.cancelled().await,
        None => std::future::pending().await,
    }
}

/// Where the prompt KV comes from, on the request's span.
fn record_prefill(mode: &'static str, cached_tokens: u32) {
    let span = Span::current();
    trace_ctx::set_attribute(&span, "ferry.prefill.mode", mode);
    trace_ctx::set_attribute(
        &span,
        "ferry.prefill.cached_tokens",
        i64::from(cached_tokens),
    );
}

/// This request's speculative rounds, on the request's span (sent by the engine right before
/// the end of a request that was allowed to speculate).
fn record_spec(c: &SpecCounts) {
    let span = Span::current();
    span.record("ferry.spec.rounds", c.rounds);
    span.record("ferry.spec.drafted_tokens", c.drafted_tokens);
    span.record("ferry.spec.accepted_tokens", c.accepted_tokens);
    if let Some(len) = c.acceptance_length() {
        span.record("ferry.spec.acceptance_length", len);
    }
}

/// Engine errors → gRPC status.
pub fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::Overloaded { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::Stopped => Status::unavailable(e.to_string()),
        EngineError::Job(m) => Status::internal(m),
    }
}

/// The gRPC code a failed sample ends with: on the stream's status for a request of one
/// sample, in `DecodeResponse.error_code` for one of several (the router resumes UNAVAILABLE
/// elsewhere, as it does a worker going away).
fn failure_code(kind: FailureKind) -> Code {
    match kind {
        FailureKind::PeerUnavailable => Code::Unavailable,
        FailureKind::Internal => Code::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_model::engine::TokenLogprobs;

    fn lp(token: u32) -> EngineEvent {
        EngineEvent::Logprobs(TokenLogprobs {
            token,
            logprob: -0.5,
            top: Vec::new(),
        })
    }

    /// What a round's commit queues for one sequence, after the first token the caller holds.
    fn queue(events: Vec<EngineEvent>) -> mpsc::UnboundedReceiver<EngineEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        for e in events {
            tx.send(e).expect("open");
        }
        rx
    }

    #[test]
    fn a_rounds_tokens_go_out_in_one_message_and_what_follows_is_kept() {
        let mut rx = queue(vec![
            EngineEvent::Token(11),
            EngineEvent::Token(12),
            EngineEvent::Finished(FinishReason::Length),
            EngineEvent::Token(99),
        ]);
        let (mut ids, mut logprobs, mut held) = (vec![10], Vec::new(), VecDeque::new());
        queued_tokens(&mut rx, &mut ids, &mut logprobs, &mut held);
        assert_eq!(ids, [10, 11, 12]);
        assert!(logprobs.is_empty());
        assert!(matches!(
            held.pop_front(),
            Some(EngineEvent::Finished(FinishReason::Length))
        ));
        assert!(held.is_empty());
        // Nothing past the first other event was taken.
        assert!(matches!(rx.try_recv(), Ok(EngineEvent::Token(99))));
    }

    #[test]
    fn each_token_keeps_its_log_probabilities_and_a_lone_one_waits_for_its_token() {
        let mut rx = queue(vec![lp(21), EngineEvent::Token(21), lp(22)]);
        let mut ids = vec![20];
        let mut logprobs = vec![logprobs_to_wire(&TokenLogprobs {
            token: 20,
            logprob: -0.5,
            top: Vec::new(),
        })];
        let mut held = VecDeque::new();
        queued_tokens(&mut rx, &mut ids, &mut logprobs, &mut held);
        assert_eq!(ids, [20, 21]);
        assert_eq!(
            logprobs.iter().map(|l| l.token_id).collect::<Vec<_>>(),
            [20, 21],
            "aligned with the ids"
        );
        // Token 22's log-probabilities arrived without it: handled next, before its token.
        assert!(matches!(held.pop_front(), Some(EngineEvent::Logprobs(l)) if l.token == 22));
        // And an empty queue takes nothing.
        let (mut ids, mut held) = (vec![1], VecDeque::new());
        queued_tokens(&mut queue(vec![]), &mut ids, &mut Vec::new(), &mut held);
        assert_eq!(ids, [1]);
        assert!(held.is_empty());
    }
}
