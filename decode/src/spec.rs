//! Speculative-decoding flags (`ferry decode`, and reused by `ferry generate` and `ferry up`)
//! and starting an engine with its drafter.
//!
//! Speculation is on by default when a drafter is configured: `--drafter DIR`, or the embedded
//! DSpark drafter when the target is the embedded model. With `--speculative off`, or without a
//! drafter, the engine decodes exactly as before. A decode worker with a drafter advertises the
//! drafter's context as extra transfer layers after the target's (see [`crate::region`]), so a
//! prefill peer with the same drafter ships the prompt's drafter context with its KV and this
//! worker speculates from the first step.

use std::fmt;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use ferry_model::engine::{EngineConfig, EngineHandle, SpecConfig, VerifyLen};
use ferry_worker::serve::ServeError;
use tracing::info;

/// `on` / `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

impl fmt::Display for Switch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Switch::On => "on",
            Switch::Off => "off",
        })
    }
}

/// Speculative-decoding flags.
#[derive(Debug, Clone, Args)]
pub struct SpecArgs {
    /// Speculative decoding with the drafter (effective only when a drafter is configured).
    #[arg(long, value_enum, default_value_t = Switch::On, env = "FERRY_SPECULATIVE")]
    pub speculative: Switch,
    /// DSpark drafter directory (config.json + model.safetensors); the embedded drafter when
    /// the target is the embedded model.
    #[arg(long, env = "FERRY_DRAFTER")]
    pub drafter: Option<PathBuf>,
    /// Drafts verified per sequence per step: `confidence[:MIN_SURVIVAL]` (the confidence
    /// head picks, non-anticipating) or `fixed:N`.
    #[arg(long, default_value = "confidence:0.3")]
    pub verify_len: VerifyLen,
    /// Draft slots verified per step across the whole batch (the verify budget).
    #[arg(long, default_value_t = 64)]
    pub max_verify_tokens: usize,
}

impl Default for SpecArgs {
    fn default() -> Self {
        Self {
            speculative: Switch::On,
            drafter: None,
            verify_len: VerifyLen::default(),
            max_verify_tokens: 64,
        }
    }
}

impl SpecArgs {
    /// The drafter to load for the target in `model_dir`: none when speculation is off, else
    /// `--drafter`, else the embedded drafter for the embedded target.
    pub fn drafter_dir(&self, model_dir: &Path) -> Option<PathBuf> {
        match self.speculative {
            Switch::Off => None,
            Switch::On => self
                .drafter
                .clone()
                .or_else(|| ferry_model::drafter::default_for(model_dir)),
        }
    }

    /// The engine's speculation policy.
    pub fn spec_config(&self) -> SpecConfig {
        SpecConfig {
            verify_len: self.verify_len,
            max_verify_tokens: self.max_verify_tokens,
        }
    }

    /// Flags that reproduce these settings on a child process (`ferry up`).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--speculative".into(),
            self.speculative.to_string(),
            "--verify-len".into(),
            self.verify_len.to_string(),
            "--max-verify-tokens".into(),
            self.max_verify_tokens.to_string(),
        ];
        if let Some(d) = &self.drafter {
            v.extend(["--drafter".into(), d.to_string_lossy().into_owned()]);
        }
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
    let drafter = spec.drafter_dir(&model_dir);
    match (&drafter, spec.speculative) {
        (Some(d), _) => {
            info!(drafter = %d.display(), verify_len = %spec.verify_len, "speculative decoding on")
        }
        (None, Switch::On) => info!("speculative decoding off: no drafter configured"),
        (None, Switch::Off) => info!("speculative decoding off"),
    }
    tokio::task::spawn_blocking(move || {
        EngineHandle::load(&model_dir, drafter.as_deref(), config)
            .map_err(|e| ServeError::Model(format!("{}: {e}", model_dir.display())))
    })
    .await
    .map_err(|e| ServeError::Model(e.to_string()))?
}
