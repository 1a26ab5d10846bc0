//! Flags every worker takes, and the device flags of every command that runs the model.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use ferry_kernels::cpu::logits::{LogitsControls, TokenLogprobs, MAX_TOP_LOGPROBS};
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_kernels::cuda::CudaDevice;
use ferry_kernels::Device;
use ferry_model::config::ModelConfig;
use ferry_model::deepseek::DeepseekModel;
use ferry_model::engine::StopParams;
use ferry_model::engine::{EngineConfig, GpuMode};
use ferry_model::ModelError;
use ferry_proto::auth::ClusterToken;
use ferry_proto::internal::{Sampling, Stop};
use tonic::Status;

use crate::serve::ServeError;

/// Options shared by prefill and decode workers.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Model directory (the CLI fills in the embedded model when omitted).
    #[arg(long, env = "FERRY_MODEL")]
    pub model: Option<PathBuf>,
    /// The router's internal gRPC address (its `--internal-addr`, where the Registry is),
    /// host:port.
    #[arg(long, env = "FERRY_ROUTER", default_value = "127.0.0.1:50052")]
    pub router: String,
    /// Join the events plane at this NATS server (`nats://host:port`) instead of registering
    /// with one router: heartbeats, KV snapshots and events go to every router there
    /// (docs/deploy.md, "Several routers"); `--router` is then unused.
    #[arg(long, env = "FERRY_EVENTS")]
    pub events: Option<ferry_events::EventsUrl>,
    /// File whose first line is the cluster token: sent on every call to the router and to
    /// peers, and required on every call to this worker's service and KV transfer listener.
    #[arg(long, env = "FERRY_CLUSTER_TOKEN_FILE")]
    pub cluster_token_file: Option<PathBuf>,
    /// The cluster token itself; set `FERRY_CLUSTER_TOKEN` rather than the flag, which other
    /// local users can read in the process list.
    #[arg(long, env = "FERRY_CLUSTER_TOKEN", hide = true, hide_env_values = true)]
    pub cluster_token: Option<ClusterToken>,
    /// This worker's id (default: role and port).
    #[arg(long)]
    pub worker_id: Option<String>,
    /// Address the worker's gRPC service binds.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub grpc_addr: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint (port 0: any free port, logged at start).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub metrics_addr: SocketAddr,
    /// KV blocks in the pool.
    #[arg(long, default_value_t = 1024)]
    pub kv_blocks: usize,
    /// New tokens per forward (at least 1: with none, no prompt would ever be scheduled).
    #[arg(long, default_value_t = 2048, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch_tokens: usize,
    /// Sequences decoding at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests in flight before new ones get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 512)]
    pub max_in_flight: usize,
    /// Heartbeat and KV-event period in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub heartbeat_ms: u64,
    /// How KV caches move between workers: `tcp`, or `ucx` (one-sided puts into the decode
    /// worker's registered memory; needs UCX's `libucp.so.0`, and follows `UCX_TLS` /
    /// `UCX_NET_DEVICES`). A decode worker receives on this transport; a prefill worker
    /// always speaks TCP and, with `ucx`, UCX too.
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp, env = "FERRY_TRANSPORT")]
    pub transport: TransportKind,
    /// Stop when standard input closes (set by `ferry up` for its children).
    #[arg(long, hide = true)]
    pub exit_on_stdin_close: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// `--transport`: the KV transfer transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TransportKind {
    /// Length-prefixed frames over TCP (the default; nothing to install).
    #[default]
    Tcp,
    /// UCX: one-sided RDMA-style puts (shared memory, TCP, InfiniBand/RoCE, CUDA IPC, as the
    /// machine's UCX offers).
    Ucx,
}

impl TransportKind {
    /// The flag's spelling, which is also the transport's wire name (`KvDestination.transport`).
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Ucx => "ucx",
        }
    }
}

/// `--speculative`: whether the engine runs with a DSpark drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum SpecMode {
    /// With a drafter when one is configured (`--drafter`, or the embedded drafter for the
    /// embedded model); plainly otherwise, saying so.
    #[default]
    Auto,
    /// With a drafter, or not at all: no usable drafter is an error at start.
    On,
    /// Never.
    Off,
}

impl SpecMode {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SpecMode::Auto => "auto",
            SpecMode::On => "on",
            SpecMode::Off => "off",
        }
    }
}

/// `--speculative` and `--drafter`: on both workers (a decode worker speculates; a prefill
/// worker computes the drafter's context and ships it with the KV), `ferry up` and `generate`.
#[derive(Debug, Clone, Default, Args)]
pub struct DrafterArgs {
    /// Speculative decoding: `auto` uses a drafter when one is configured, `on` requires one,
    /// `off` never speculates.
    #[arg(long, value_enum, default_value_t = SpecMode::Auto, env = "FERRY_SPECULATIVE")]
    pub speculative: SpecMode,
    /// DSpark drafter directory (config.json + model.safetensors); for the embedded target the
    /// embedded drafter, which is compiled into the binary.
    #[arg(long, env = "FERRY_DRAFTER")]
    pub drafter: Option<PathBuf>,
}

impl DrafterArgs {
    /// The drafter to load for the target in `model_dir`: none when `off`; else `--drafter`,
    /// else the embedded drafter for the embedded target; `on` without either is an error
    /// naming what to pass. The drafter's files are checked when the engine loads them.
    pub fn resolve(&self, model_dir: &std::path::Path) -> Result<Option<PathBuf>, ServeError> {
        if self.speculative == SpecMode::Off {
            return Ok(None);
        }
        let found = match &self.drafter {
            Some(d) => Some(d.clone()),
            None => ferry_model::drafter::default_for(model_dir)
                .map_err(|e| ServeError::Model(format!("the embedded drafter: {e}")))?,
        };
        match (found, self.speculative) {
            (None, SpecMode::On) => Err(ServeError::Config(format!(
                "--speculative on needs a drafter: pass --drafter DIR (the embedded drafter \
                 fits only the embedded model, and {} is not it)",
                model_dir.display()
            ))),
            (found, _) => Ok(found),
        }
    }

    /// [`Self::resolve`] for an engine on `device`: under `auto`, a GPU decodes plainly — the
    /// drafter runs on the device, but its rounds run eagerly while plain steps replay CUDA
    /// graphs, so with the embedded pair it costs more than it saves today (BENCHMARKS.md,
    /// "The drafter on the device"); `auto` does not turn it on there, `on` still does.
    pub fn resolve_for(
        &self,
        model_dir: &std::path::Path,
        device: ferry_kernels::Device,
    ) -> Result<Option<PathBuf>, ServeError> {
        let drafter = self.resolve(model_dir)?;
        if drafter.is_some() && device.is_gpu() && self.speculative == SpecMode::Auto {
            tracing::info!(
                %device,
                "speculative decoding off under --speculative auto on a GPU (its rounds run \
                 eagerly and cost more than they save); --speculative on to use it"
            );
            return Ok(None);
        }
        Ok(drafter)
    }

    /// Flags that reproduce these settings on a child process (`ferry up`).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec!["--speculative".into(), self.speculative.as_str().into()];
        if let Some(d) = &self.drafter {
            v.extend(["--drafter".into(), d.to_string_lossy().into_owned()]);
        }
        v
    }
}

/// GPU numerics, as a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuModeArg {
    /// f32 activations, latent cache and attention: matches the CPU backend.
    Exact,
    /// bf16 latent cache (the RoPE key as a bf16 pair) and tensor-core attention: the serving
    /// configuration, within 2e-2 · max|logit| of exact mode.
    Fast,
}

impl GpuModeArg {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuModeArg::Exact => "exact",
            GpuModeArg::Fast => "fast",
        }
    }
}

/// `--device` and `--gpu-mode`: on every command that runs the model (the workers, `ferry up`
/// which forwards them to its workers, `generate`, `bench-engine`).
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Where the model runs: auto (the first GPU that opens, else the CPU), cpu, cuda[:N] or
    /// rocm[:N]. A named GPU that cannot be opened is an error naming the reason.
    #[arg(long, env = "FERRY_DEVICE", default_value = "auto")]
    pub device: Device,
    /// Numerics on a GPU.
    #[arg(long, env = "FERRY_GPU_MODE", value_enum, default_value_t = GpuModeArg::Exact)]
    pub gpu_mode: GpuModeArg,
    /// On CUDA, replay decode steps and verify forwards from CUDA graphs (per batch-size
    /// bucket, up to 256 sequences; `FERRY_GRAPH_MAX_BATCH` changes it); `false` runs every
    /// step eagerly.
    #[arg(long, env = "FERRY_CUDA_GRAPHS", default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_graphs: bool,
    /// Where the weights come from: `auto` (the checkpoint in the model directory) or `dummy`
    /// (vLLM's name: `config.json` only, seeded random weights of its shapes, drawn on the GPU
    /// by a CUDA engine) — to serve and benchmark a model whose weights this machine does not
    /// have. Outputs mean nothing; every process with the same `--dummy-seed` on the same
    /// kind of device holds the same weights.
    #[arg(long, env = "FERRY_LOAD_FORMAT", value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// The dummy weights' seed (`--load-format dummy`).
    #[arg(long, env = "FERRY_DUMMY_SEED", default_value_t = ferry_model::dummy::DEFAULT_SEED)]
    pub dummy_seed: u64,
}

/// `--load-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LoadFormatArg {
    /// The checkpoint's weights.
    #[default]
    Auto,
    /// Seeded random weights of `config.json`'s shapes.
    Dummy,
}

impl LoadFormatArg {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadFormatArg::Auto => "auto",
            LoadFormatArg::Dummy => "dummy",
        }
    }
}

impl Default for DeviceArgs {
    fn default() -> Self {
        Self {
            device: Device::Auto,
            gpu_mode: GpuModeArg::Exact,
            cuda_graphs: true,
            load_format: LoadFormatArg::Auto,
            dummy_seed: ferry_model::dummy::DEFAULT_SEED,
        }
    }
}

impl DeviceArgs {
    /// The engine's [`LoadFormat`](ferry_model::dummy::LoadFormat).
    pub fn load_format(&self) -> ferry_model::dummy::LoadFormat {
        match self.load_format {
            LoadFormatArg::Auto => ferry_model::dummy::LoadFormat::Auto,
            LoadFormatArg::Dummy => ferry_model::dummy::LoadFormat::Dummy {
                seed: self.dummy_seed,
            },
        }
    }

    /// The GPU numerics.
    pub fn mode(&self) -> GpuMode {
        match self.gpu_mode {
            GpuModeArg::Exact => GpuMode::Exact,
            GpuModeArg::Fast => GpuMode::Fast,
        }
    }

    /// The device that runs: `auto` resolved, a named GPU checked (an error naming the reason
    /// if it cannot be opened).
    pub fn resolve(&self) -> Result<Device, ModelError> {
        Ok(self.device.resolve()?)
    }

    /// The CUDA device to use, or `None` when the resolved device is the CPU; a named GPU that
    /// cannot be opened (or a ROCm device: the GPU benchmarks are CUDA's) is an error.
    pub fn cuda(&self) -> Result<Option<CudaDevice>, ModelError> {
        match self.resolve()? {
            Device::Cpu => Ok(None),
            d => ferry_model::engine::open_cuda(d).map(Some),
        }
    }

    /// The model uploaded to the GPU, if a GPU is used.
    pub fn gpu_model(&self, model: &DeepseekModel) -> Result<Option<DeepseekModel>, ModelError> {
        self.cuda()?
            .map(|dev| model.upload(&dev, self.mode()))
            .transpose()
    }

    /// Flags that reproduce these settings on a child process (`ferry up`).
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--device".into(),
            self.device.to_string(),
            "--gpu-mode".into(),
            self.gpu_mode.as_str().into(),
            "--cuda-graphs".into(),
            self.cuda_graphs.to_string(),
            "--load-format".into(),
            self.load_format.as_str().into(),
            "--dummy-seed".into(),
            self.dummy_seed.to_string(),
        ]
    }
}

impl WorkerArgs {
    /// Engine sizing from the flags.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            num_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            max_in_flight: self.max_in_flight,
            device: self.device.device,
            gpu_mode: self.device.mode(),
            cuda_graphs: self.device.cuda_graphs,
            load_format: self.device.load_format(),
            ..EngineConfig::default()
        }
    }

    /// The cluster token (read from `--cluster-token-file` if given), `None` without one.
    pub fn cluster_token(&self) -> Result<Option<ClusterToken>, ServeError> {
        ClusterToken::resolve(
            self.cluster_token_file.as_deref(),
            self.cluster_token.as_ref(),
        )
        .map_err(|e| ServeError::Config(e.to_string()))
    }

    /// The heartbeat period.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms.max(10))
    }

    /// The router endpoint as a URI.
    pub fn router_uri(&self) -> String {
        if self.router.contains("://") {
            self.router.clone()
        } else {
            format!("http://{}", self.router)
        }
    }
}

/// Checks a prompt from a peer against the model: non-empty, in the vocabulary, and with
/// `extra` more positions inside the context. Errors name the field.
pub fn validate_prompt(cfg: &ModelConfig, prompt: &[u32], extra: usize) -> Result<(), Status> {
    if prompt.is_empty() {
        return Err(Status::invalid_argument(
            "`prompt_tokens` must not be empty",
        ));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(Status::invalid_argument(format!(
            "`prompt_tokens` contains {t}, outside the vocabulary of {}",
            cfg.vocab_size
        )));
    }
    let need = prompt.len() + extra;
    if need > cfg.max_position_embeddings {
        return Err(Status::invalid_argument(format!(
            "`prompt_tokens` ({}) + {extra} new tokens exceed the context of {}",
            prompt.len(),
            cfg.max_position_embeddings
        )));
    }
    Ok(())
}

/// Wire sampling → validated engine parameters (INVALID_ARGUMENT naming the field).
pub fn sampling(s: Option<&Sampling>) -> Result<SamplingParams, Status> {
    let s = s.ok_or_else(|| Status::invalid_argument("`sampling` is required"))?;
    let p = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed,
    };
    p.validate()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(p)
}

/// Wire penalties and `logit_bias` → checked engine controls (INVALID_ARGUMENT naming the
/// field): the router's checks, run again on peer data. Unset penalties are off.
pub fn controls(s: Option<&Sampling>, vocab: usize) -> Result<LogitsControls, Status> {
    let Some(s) = s else {
        return Ok(LogitsControls::default());
    };
    let logit_bias =
        LogitsControls::logit_bias_from(s.logit_bias.iter().map(|b| (b.token, b.bias)), vocab)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let c = LogitsControls {
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        logit_bias,
    };
    c.validate()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(c)
}

/// The wire's `logprobs` (alternatives per token) → the engine's, checked against
/// [`MAX_TOP_LOGPROBS`] (INVALID_ARGUMENT naming the field).
pub fn logprobs(n: Option<u32>) -> Result<Option<usize>, Status> {
    top_n("logprobs", n)
}

/// The wire's `prompt_logprobs` (alternatives per prompt token) → the engine's, checked
/// against [`MAX_TOP_LOGPROBS`] (INVALID_ARGUMENT naming the field).
pub fn prompt_logprobs(n: Option<u32>) -> Result<Option<usize>, Status> {
    top_n("prompt_logprobs", n)
}

fn top_n(field: &str, n: Option<u32>) -> Result<Option<usize>, Status> {
    match n {
        Some(n) if n as usize > MAX_TOP_LOGPROBS => Err(Status::invalid_argument(format!(
            "`{field}` must be <= {MAX_TOP_LOGPROBS}, got {n}"
        ))),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// A peer's prompt log-probabilities for `prompt`, checked: one entry per prompt token after
/// the first, each naming that token, with at most `top` alternatives (ids below `vocab`).
/// The error names what is wrong (the peer's fault).
pub fn prompt_logprobs_from_wire(
    entries: &[ferry_proto::v1::TokenLogprob],
    prompt: &[u32],
    top: usize,
    vocab: usize,
) -> Result<Vec<TokenLogprobs>, String> {
    let want = prompt.get(1..).unwrap_or_default();
    if entries.len() != want.len() {
        return Err(format!(
            "{} prompt log-probabilities for a prompt of {} tokens (want {})",
            entries.len(),
            prompt.len(),
            want.len()
        ));
    }
    for (i, (e, &t)) in entries.iter().zip(want).enumerate() {
        if e.token_id != t {
            return Err(format!(
                "prompt log-probability {i} is for token {}, the prompt has {t} there",
                e.token_id
            ));
        }
        if e.top_logprobs.len() > top {
            return Err(format!(
                "prompt log-probability {i} has {} alternatives, the request asked for {top}",
                e.top_logprobs.len()
            ));
        }
        if let Some(bad) = e.top_logprobs.iter().find(|a| a.token_id as usize >= vocab) {
            return Err(format!(
                "prompt log-probability {i} names token {}, outside the vocabulary of {vocab}",
                bad.token_id
            ));
        }
    }
    Ok(entries.iter().map(logprobs_from_wire).collect())
}

/// An engine token's log-probabilities in the wire's shape.
pub fn logprobs_to_wire(lp: &TokenLogprobs) -> ferry_proto::v1::TokenLogprob {
    ferry_proto::v1::TokenLogprob {
        token_id: lp.token,
        logprob: lp.logprob,
        top_logprobs: lp
            .top
            .iter()
            .map(|&(token_id, logprob)| ferry_proto::v1::TopLogprob { token_id, logprob })
            .collect(),
    }
}

/// A peer's token log-probabilities in the engine's shape.
pub fn logprobs_from_wire(lp: &ferry_proto::v1::TokenLogprob) -> TokenLogprobs {
    TokenLogprobs {
        token: lp.token_id,
        logprob: lp.logprob,
        top: lp
            .top_logprobs
            .iter()
            .map(|t| (t.token_id, t.logprob))
            .collect(),
    }
}

/// Stop token ids per request, at most (as the router enforces).
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Wire stop conditions → engine [`StopParams`] (INVALID_ARGUMENT naming the field):
/// `stop_token_ids` below `vocab` (at most [`MAX_STOP_TOKEN_IDS`]) and `min_tokens` at most
/// `max_tokens`. Unset: `max_tokens` only (a prefill job's first token, which uses none).
pub fn stop_params(stop: Option<&Stop>, vocab: usize) -> Result<StopParams, Status> {
    let Some(s) = stop else {
        return Ok(StopParams::max_tokens(1));
    };
    if s.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(Status::invalid_argument(format!(
            "`stop_token_ids` must hold at most {MAX_STOP_TOKEN_IDS} ids, got {}",
            s.stop_token_ids.len()
        )));
    }
    if let Some(t) = s.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(Status::invalid_argument(format!(
            "`stop_token_ids` must be < {vocab} (the vocabulary size), got {t}"
        )));
    }
    if s.min_tokens > s.max_tokens {
        return Err(Status::invalid_argument(format!(
            "`min_tokens` must be <= `max_tokens` ({}), got {}",
            s.max_tokens, s.min_tokens
        )));
    }
    Ok(StopParams {
        max_tokens: s.max_tokens as usize,
        ignore_eos: s.ignore_eos,
        stop_token_ids: s.stop_token_ids.clone(),
        min_tokens: s.min_tokens as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        worker: WorkerArgs,
    }

    #[test]
    fn device_flags_reach_the_engine_and_round_trip_to_children() {
        let cli = Cli::try_parse_from([
            "w",
            "--device",
            "cuda:1",
            "--gpu-mode",
            "fast",
            "--cuda-graphs",
            "false",
        ])
        .unwrap();
        let config = cli.worker.engine_config();
        assert_eq!(config.device, Device::Cuda(1));
        assert_eq!(config.gpu_mode, GpuMode::Fast);
        assert!(!config.cuda_graphs);
        // What `ferry up` forwards parses back to the same settings.
        let mut argv = vec!["w".to_string()];
        argv.extend(cli.worker.device.to_args());
        let child = Cli::try_parse_from(argv).unwrap();
        assert_eq!(child.worker.device.device, Device::Cuda(1));
        assert_eq!(child.worker.device.gpu_mode, GpuModeArg::Fast);
        assert!(!child.worker.device.cuda_graphs);
        // The default is `auto`: the engine resolves it to the first GPU that opens.
        let plain = Cli::try_parse_from(["w"]).unwrap().worker.engine_config();
        if std::env::var_os("FERRY_DEVICE").is_none() {
            assert_eq!(plain.device, Device::Auto);
        }
        assert!(Cli::try_parse_from(["w", "--device", "tpu"]).is_err());
    }

    #[derive(Debug, Parser)]
    struct SpecCli {
        #[command(flatten)]
        spec: DrafterArgs,
    }

    #[test]
    fn speculation_on_without_a_drafter_is_an_error_auto_is_not() {
        let elsewhere = tempfile::tempdir().unwrap();
        let parse = |args: &[&str]| {
            let mut argv = vec!["w"];
            argv.extend_from_slice(args);
            SpecCli::try_parse_from(argv).unwrap().spec
        };
        // A model that is not the embedded one has no default drafter.
        let err = parse(&["--speculative", "on"])
            .resolve(elsewhere.path())
            .expect_err("on without a drafter");
        assert!(err.to_string().contains("--drafter"), "{err}");
        assert_eq!(
            parse(&["--speculative", "auto"])
                .resolve(elsewhere.path())
                .unwrap(),
            None
        );
        assert_eq!(
            parse(&["--speculative", "off"])
                .resolve(elsewhere.path())
                .unwrap(),
            None
        );
        // The embedded target finds the compiled-in drafter, whatever directory holds it.
        let target = ferry_model::embedded::TARGET.dir().unwrap();
        let copy = tempfile::tempdir().unwrap();
        std::fs::copy(target.join("config.json"), copy.path().join("config.json")).unwrap();
        let found = parse(&["--speculative", "on"])
            .resolve(copy.path())
            .unwrap();
        let found = found.expect("the embedded drafter");
        assert!(
            found.join("model.safetensors").is_file(),
            "{}",
            found.display()
        );
        // Under `auto` a GPU decodes plainly; `on` speculates there too; the CPU follows `auto`.
        let auto = parse(&["--speculative", "auto"]);
        assert_eq!(
            auto.resolve_for(copy.path(), Device::Cuda(0)).unwrap(),
            None
        );
        assert!(auto
            .resolve_for(copy.path(), Device::Cpu)
            .unwrap()
            .is_some());
        let on = parse(&["--speculative", "on"]);
        assert!(on
            .resolve_for(copy.path(), Device::Cuda(0))
            .unwrap()
            .is_some());
        // An explicit drafter wins and round-trips to children.
        let explicit = parse(&["--speculative", "on", "--drafter", "/d"]);
        assert_eq!(
            explicit.resolve(elsewhere.path()).unwrap(),
            Some("/d".into())
        );
        let mut argv = vec!["w".to_string()];
        argv.extend(explicit.to_args());
        let child = SpecCli::try_parse_from(argv).unwrap().spec;
        assert_eq!(child.speculative, SpecMode::On);
        assert_eq!(child.drafter, Some("/d".into()));
    }
}
