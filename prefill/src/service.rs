//! The `PrefillWorker` gRPC service.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ferry_kvtransfer::handshake::check_compatible;
use ferry_kvtransfer::layerwise::LayerStreamer;
use ferry_kvtransfer::{
    Fence, KvLayoutDesc, RemoteKey, TcpTransport, TransferError, Transport, UcxTransport,
};
use ferry_model::engine::{EngineError, EngineHandle, PrefillWork};
use ferry_model::grammar::GrammarCompiler;
use ferry_proto::auth::ClusterToken;
use ferry_proto::internal::prefill_worker_server::PrefillWorker;
use ferry_proto::internal::{GetStatsRequest, PrefillRequest, PrefillResponse, WorkerStats};
use ferry_proto::trace_ctx;
use ferry_worker::args::{
    controls, logprobs, logprobs_to_wire, prompt_logprobs, sampling, stop_params, validate_prompt,
};
use tonic::{Request, Response, Status};
use tracing::{field, info_span, Instrument, Span};

use crate::metrics::PrefillMetrics;
use crate::push::{layer_pusher, offset_layer_pusher, wire_dtype, HostShip};

/// The transports this worker writes KV with: TCP always, UCX when started with
/// `--transport ucx`. The destination names the one to use (`KvDestination.transport`).
pub struct Outbound {
    tcp: TcpTransport,
    ucx: Option<UcxTransport>,
}

impl Outbound {
    /// TCP, plus UCX when `ucx` (an error when UCX cannot be loaded or started), presenting
    /// `token` (the cluster token) to the decode workers written to.
    pub fn new(token: Option<ClusterToken>, ucx: bool) -> Result<Self, TransferError> {
        let ucx = if ucx {
            Some(UcxTransport::with_token(token.clone())?)
        } else {
            None
        };
        Ok(Self {
            tcp: TcpTransport::client_with_token(token),
            ucx,
        })
    }

    /// The transports' names, as advertised at registration.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![self.tcp.name().to_owned()];
        names.extend(self.ucx.as_ref().map(|u| u.name().to_owned()));
        names
    }

    /// The transport called `name`; INVALID_ARGUMENT naming `destination.transport` for one
    /// this worker does not speak.
    #[allow(clippy::result_large_err)]
    fn get(&self, name: &str) -> Result<&dyn Transport, Status> {
        match (name, &self.ucx) {
            ("tcp", _) => Ok(&self.tcp),
            ("ucx", Some(u)) => Ok(u),
            _ => Err(Status::invalid_argument(format!(
                "`destination.transport` {name:?} is not spoken by this prefill worker (it speaks {}); start it with `--transport {name}`",
                self.names().join(", ")
            ))),
        }
    }
}

/// The service state: the engine handle and the outbound transports.
#[derive(Clone)]
pub struct PrefillService {
    worker_id: String,
    engine: EngineHandle,
    outbound: Arc<Outbound>,
    bytes_sent: Arc<AtomicU64>,
    metrics: PrefillMetrics,
    /// Compiles requests' `response_format` (the first token is constrained too); `None`:
    /// such requests are refused.
    grammar: Option<GrammarCompiler>,
}

impl PrefillService {
    /// A service over `engine`, counting into `metrics`, writing KV with `outbound`.
    pub fn new(
        worker_id: String,
        engine: EngineHandle,
        metrics: PrefillMetrics,
        outbound: Outbound,
    ) -> Self {
        Self {
            worker_id,
            engine,
            outbound: Arc::new(outbound),
            bytes_sent: Arc::new(AtomicU64::new(0)),
            metrics,
            grammar: None,
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

    /// The engine this service drives.
    pub fn engine_handle(&self) -> EngineHandle {
        self.engine.clone()
    }

    /// This worker's KV layout, with its engine's cache dtype (what it holds; what it sends is
    /// the destination's dtype, converted where they differ).
    pub fn layout(&self) -> KvLayoutDesc {
        let l = self.engine.kv_layout();
        let u = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        KvLayoutDesc {
            num_layers: u(l.num_layers),
            page_size: u(l.page_size),
            latent_width: u(l.width),
            dtype: wire_dtype(self.engine.kv_dtype()),
            num_blocks: u(l.num_blocks),
        }
    }

    async fn run(&self, r: PrefillRequest) -> Result<PrefillResponse, Status> {
        validate_prompt(self.engine.model_config(), &r.prompt_tokens, 0)?;
        let params = sampling(r.sampling.as_ref())?;
        let vocab = self.engine.model_config().vocab_size;
        let controls = controls(r.sampling.as_ref(), vocab)?;
        let stop = stop_params(r.stop.as_ref(), vocab)?;
        let prompt_lps = prompt_logprobs(r.prompt_logprobs)?;
        let grammar =
            ferry_worker::grammar::compile(self.grammar.as_ref(), r.response_format.as_ref())
                .await?;
        let dest = r
            .destination
            .ok_or_else(|| Status::invalid_argument("`destination` is required"))?;
        let theirs = dest
            .layout
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("`destination.layout` is required"))
            .and_then(|l| {
                KvLayoutDesc::try_from(l).map_err(|e| Status::invalid_argument(e.to_string()))
            })?;
        // Drafter context travels as transfer layers after the target's (`ferry_decode::region`).
        // A destination that advertises exactly our drafter's extra layers gets them; one with
        // a different count (another drafter, or ours is off) gets the target layers only and
        // decodes those requests without speculation.
        let target = self.layout();
        let extra = u32::try_from(self.engine.draft_kv_layers()).unwrap_or(0);
        let ship_drafter = extra > 0 && theirs.num_layers == target.num_layers + extra;
        // The wire carries the destination cache's dtype (`ferry_kvtransfer`'s crate docs): we
        // send rows in `theirs.dtype`, converting from our cache's where they differ, and the
        // handshake checks that dtype against the region's.
        let ours = KvLayoutDesc {
            num_layers: theirs.num_layers.max(target.num_layers),
            dtype: theirs.dtype,
            ..target
        };
        check_compatible(&ours, &theirs).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let page = ours.page_size as usize;
        let skip = r.skip_tokens as usize;
        let prompt_len = r.prompt_tokens.len();
        if skip % page != 0 || skip >= prompt_len {
            return Err(Status::invalid_argument(format!(
                "`skip_tokens` must be a multiple of {page} below the prompt length {prompt_len}, got {skip}"
            )));
        }
        if dest.block_ids.len() < prompt_len.div_ceil(page) {
            return Err(Status::invalid_argument(format!(
                "`destination.block_ids` has {} blocks; a {prompt_len}-token prompt needs {}",
                dest.block_ids.len(),
                prompt_len.div_ceil(page)
            )));
        }
        let transport = self.outbound.get(&dest.transport)?;
        // The transfer's span: connect (whose hello carries it to the receiver) → flush ack.
        // Counts are signed: `tracing` hands unsigned fields to OpenTelemetry as strings.
        let transfer = info_span!(
            "kv_transfer",
            otel.kind = "client",
            ferry.kv_transfer.transport = transport.name(),
            ferry.kv_transfer.destination = %dest.transfer_address,
            ferry.kv_transfer.bytes = field::Empty,
            ferry.kv_transfer.layers = i64::from(ours.num_layers),
            ferry.kv_transfer.blocks = count(prompt_len.div_ceil(page) - skip / page),
            ferry.kv_transfer.duration_s = field::Empty,
            ferry.kv_transfer.tail_s = field::Empty,
        );
        let started = Instant::now();
        let writer = transport
            .connect(
                &dest.transfer_address,
                RemoteKey(dest.remote_key),
                Fence(dest.fence),
                &ours,
            )
            .instrument(transfer.clone())
            .await
            .map_err(|e| self.transfer_failed(&transfer, format!("KV transfer connect: {e}")))?;
        // Straight from the device cache when the writer puts from device memory into every
        // target layer and the wire carries our cache's dtype (a GPU pair over UCX with CUDA).
        let rows_on_device = self.engine.device().is_gpu()
            && ours.dtype == target.dtype
            && (0..target.num_layers).all(|l| writer.puts_from_device(l));
        if rows_on_device {
            tracing::debug!("KV leaves from the device cache: puts into the peer's GPU memory");
        }
        // A CPU engine's rows are read in place by a writer that does not hold them while a
        // socket drains (the engine waits for them before its next forward).
        let host = if writer.reads_in_place() {
            HostShip::InPlace
        } else {
            HostShip::Copy
        };
        let (sink, streamer) = LayerStreamer::spawn(writer);
        let draft_hook = ship_drafter.then(|| {
            let layers = target.num_layers as usize;
            offset_layer_pusher(
                sink.clone(),
                dest.block_ids.clone(),
                skip / page,
                layers,
                (ours.dtype, HostShip::Copy),
            )
        });
        let hook = layer_pusher(sink.clone(), dest.block_ids, skip / page, ours.dtype, host);
        let outcome = self
            .engine
            .prefill_work(PrefillWork {
                prompt: r.prompt_tokens,
                sampling: params,
                controls,
                stop,
                logprobs: logprobs(r.logprobs)?,
                prompt_logprobs: prompt_lps,
                grammar,
                skip_tokens: skip,
                on_layer: hook,
                on_draft_layer: draft_hook,
                rows_on_device,
            })
            .await
            .map_err(engine_status);
        let computed = Instant::now();
        let bytes = streamer.finish(sink).instrument(transfer.clone()).await;
        let tail = outcome
            .as_ref()
            .map(|o| o.ship_tail + computed.elapsed())
            .unwrap_or_default();
        let outcome = outcome?;
        let bytes =
            bytes.map_err(|e| self.transfer_failed(&transfer, format!("KV transfer: {e}")))?;
        let took = started.elapsed().as_secs_f64();
        transfer.record(
            "ferry.kv_transfer.bytes",
            i64::try_from(bytes).unwrap_or(i64::MAX),
        );
        transfer.record("ferry.kv_transfer.duration_s", took);
        transfer.record("ferry.kv_transfer.tail_s", tail.as_secs_f64());
        self.metrics.kv_bytes.inc_by(bytes);
        self.metrics.kv_duration.observe(took);
        self.metrics.kv_tail.observe(tail.as_secs_f64());
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        let span = Span::current();
        trace_ctx::set_attribute(
            &span,
            "ferry.prefill.computed_tokens",
            count(outcome.computed_tokens),
        );
        trace_ctx::set_attribute(
            &span,
            "ferry.prefill.reused_tokens",
            count(outcome.reused_tokens),
        );
        Ok(PrefillResponse {
            first_token: outcome.first_token,
            first_logprobs: outcome.first_logprobs.as_ref().map(logprobs_to_wire),
            prompt_logprobs: outcome
                .prompt_logprobs
                .iter()
                .map(logprobs_to_wire)
                .collect(),
            computed_tokens: u32::try_from(outcome.computed_tokens).unwrap_or(u32::MAX),
            reused_tokens: u32::try_from(outcome.reused_tokens).unwrap_or(u32::MAX),
            bytes_transferred: bytes,
        })
    }
}

/// A count as a signed span attribute.
fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl PrefillService {
    /// Counts and marks a failed transfer; the status to answer with.
    fn transfer_failed(&self, span: &Span, message: String) -> Status {
        self.metrics.kv_failures.inc();
        trace_ctx::set_error(span, message.clone());
        Status::unavailable(message)
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

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let span = info_span!(
            "prefill",
            otel.kind = "server",
            request_id = field::Empty,
            prompt_tokens = field::Empty,
        );
        trace_ctx::set_parent_from_request(&span, &request);
        let r = request.into_inner();
        span.record("request_id", r.request_id.as_str());
        span.record("prompt_tokens", count(r.prompt_tokens.len()));
        trace_ctx::set_attribute(&span, "rpc.system", "grpc");
        trace_ctx::set_attribute(&span, "rpc.service", "ferry.internal.v1.PrefillWorker");
        trace_ctx::set_attribute(&span, "rpc.method", "Prefill");
        trace_ctx::set_attribute(&span, "ferry.prefill.skip_tokens", i64::from(r.skip_tokens));
        let prompt_tokens = r.prompt_tokens.len() as u64;
        let started = Instant::now();
        let result = self.run(r).instrument(span.clone()).await;
        match &result {
            Ok(_) => {
                self.metrics.requests.with_label_values(&["ok"]).inc();
                self.metrics.prompt_tokens.inc_by(prompt_tokens);
                self.metrics
                    .duration
                    .observe(started.elapsed().as_secs_f64());
            }
            Err(status) => {
                self.metrics.requests.with_label_values(&["error"]).inc();
                trace_ctx::set_error(&span, status.message());
                span.in_scope(|| tracing::warn!(code = ?status.code(), error = status.message(), "prefill failed"));
            }
        }
        result.map(Response::new)
    }

    async fn get_stats(
        &self,
        _request: Request<GetStatsRequest>,
    ) -> Result<Response<WorkerStats>, Status> {
        let s = self.engine.stats().await.map_err(engine_status)?;
        Ok(Response::new(ferry_worker::stats::worker_stats(
            &self.worker_id,
            &s,
            self.bytes_sent.load(Ordering::Relaxed),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_destination_transport_this_worker_lacks_is_refused_naming_the_field() {
        let tcp_only = Outbound::new(None, false).unwrap();
        assert_eq!(tcp_only.names(), vec!["tcp".to_string()]);
        assert_eq!(tcp_only.get("tcp").map(|t| t.name()).ok(), Some("tcp"));
        let e = tcp_only.get("ucx").err().expect("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("`destination.transport`")
                && e.message().contains("--transport ucx"),
            "{}",
            e.message()
        );
        let e = tcp_only.get("rdma").err().expect("refused");
        assert!(e.message().contains("\"rdma\""), "{}", e.message());
        // With UCX (the machine's libucp; CI installs it), both are spoken.
        let both = Outbound::new(None, true).expect("UCX loads");
        assert_eq!(both.names(), vec!["tcp".to_string(), "ucx".to_string()]);
        assert_eq!(both.get("ucx").map(|t| t.name()).ok(), Some("ucx"));
    }
}
