//! Flags every worker takes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_model::config::ModelConfig;
use ferry_model::engine::EngineConfig;
use ferry_proto::internal::Sampling;
use tonic::Status;

/// Options shared by prefill and decode workers.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Model directory (the CLI fills in the embedded model when omitted).
    #[arg(long, env = "FERRY_MODEL")]
    pub model: Option<PathBuf>,
    /// The router's gRPC address, host:port.
    #[arg(long, env = "FERRY_ROUTER", default_value = "127.0.0.1:50051")]
    pub router: String,
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
    /// New tokens per forward.
    #[arg(long, default_value_t = 2048)]
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
    /// Stop when standard input closes (set by `ferry up` for its children).
    #[arg(long, hide = true)]
    pub exit_on_stdin_close: bool,
}

impl WorkerArgs {
    /// Engine sizing from the flags.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            num_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            max_in_flight: self.max_in_flight,
            ..EngineConfig::default()
        }
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
