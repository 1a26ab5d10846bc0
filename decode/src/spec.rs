//! Speculative-decoding flags (`ferry decode`, and reused by `ferry generate` and `ferry up`)
//! and starting an engine with its drafter.
//!
//! Speculation is on by default (`--speculative auto`) when a drafter is configured: `--drafter
//! DIR`, or the embedded DSpark drafter (compiled into the binary) when the target is the
//! embedded model. `--speculative on` without a drafter is an error at start; with
//! `--speculative off`, or `auto` without a drafter, the engine decodes exactly as before. A decode worker with a drafter advertises the
//! drafter's context as extra transfer layers after the target's (see [`crate::region`]), so a
//! prefill peer with the same drafter ships the prompt's drafter context with its KV and this
//! worker speculates from the first step.

use std::path::{Path, PathBuf};

use clap::Args;
use ferry_model::engine::{DraftBudget, EngineConfig, EngineHandle, SpecConfig, VerifyLen};
use ferry_worker::args::{DrafterArgs, SpecMode};
use ferry_worker::serve::ServeError;
use tracing::info;

/// Speculative-decoding flags.
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// `--speculative` and `--drafter`.
    #[command(flatten)]
    pub drafter: DrafterArgs,
    /// Drafts verified per sequence per step: `goodput` (the default: the confidence head's
    /// survivals against this engine's measured step costs at the batch's current size: as
    /// many drafts as pay, none — and no drafter pass — when speculation would not),
    /// `confidence[:MIN_SURVIVAL]` (the confidence head picks, non-anticipating, under
    /// `--max-verify-tokens`; 0.3 when not given) or `fixed:N` (on a GPU: N drafts of every
    /// running sequence, one verify graph's shape).
    #[arg(long, default_value = "goodput")]
    pub verify_len: VerifyLen,
    /// Draft slots verified per step across the whole batch (the verify budget).
    #[arg(long, default_value_t = 64)]
    pub max_verify_tokens: usize,
    /// Where a step's drafts take their rows: `beside` (the default: a budget of their own, so
    /// prompts keep what plain decoding gives them and a step may carry up to twice
    /// `--max-batch-tokens` rows) or `shared` (from `--max-batch-tokens`, before the prompts
    /// waiting beside them; the rule before session 58).
    #[arg(long, default_value_t = DraftBudget::Beside, env = "FERRY_DRAFT_BUDGET")]
    pub draft_budget: DraftBudget,
}

impl Default for SpecArgs {
    fn default() -> Self {
        Self {
            drafter: DrafterArgs::default(),
            verify_len: VerifyLen::default(),
            max_verify_tokens: 64,
            draft_budget: DraftBudget::default(),
        }
    }
}

impl SpecArgs {
    /// The drafter to load for the target in `model_dir` on `device`
    /// ([`DrafterArgs::resolve_for`]).
    pub fn drafter_dir(
        &self,
        model_dir: &Path,
        device: ferry_kernels::Device,
    ) -> Result<Option<PathBuf>, ServeError> {
        self.drafter.resolve_for(model_dir, device)
    }

    /// The engine's speculation policy.
    pub fn spec_config(&self) -> SpecConfig {
        SpecConfig {
            verify_len: self.verify_len,
            max_verify_tokens: self.max_verify_tokens,
            draft_budget: self.draft_budget,
        }
    }

    /// Flags that reproduce these settings on a child process (`ferry up`).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = self.drafter.to_args();
        v.extend([
            "--verify-len".into(),
            self.verify_len.to_string(),
            "--max-verify-tokens".into(),
            self.max_verify_tokens.to_string(),
            "--draft-budget".into(),
            self.draft_budget.to_string(),
        ]);
        v
    }
}

/// Loads the target (and the drafter `spec` selects) and starts the engine, off the runtime.
pub async fn load_engine(
    model_dir: PathBuf,
    spec: &SpecArgs,
    mut config: EngineConfig,
) -> Result<EngineHandle, ServeError> {
    config.spec = spec.spec_config();
    let device = config
        .device
        .resolve()
        .map_err(|e| ServeError::Config(format!("--device: {e}")))?;
    let drafter = spec.drafter_dir(&model_dir, device)?;
    match (&drafter, spec.drafter.speculative) {
        (Some(d), _) => {
            info!(drafter = %d.display(), verify_len = %spec.verify_len, "speculative decoding on")
        }
        (None, SpecMode::Off) => info!("speculative decoding off"),
        (None, _) => info!("speculative decoding off: no drafter for this model (--drafter)"),
    }
    tokio::task::spawn_blocking(move || {
        EngineHandle::load(&model_dir, drafter.as_deref(), config)
            .map_err(|e| ServeError::Model(format!("{}: {e}", model_dir.display())))
    })
    .await
    .map_err(|e| ServeError::Model(e.to_string()))?
}
