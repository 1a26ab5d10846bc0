//! The one error type of `ferry-model`.
//!
//! Every variant names what failed (the file, the config field, the tensor) and, where there is
//! one, the limit and the offending value, so a message read in a log is enough to fix the input
//! (STYLE.md, "Errors"). Loading errors (`Card` … `UnsupportedDtype`) come from files on disk;
//! the rest (`PromptTooLong`, `Kernel`, `Kv`, `Invalid`) come from serving a request.
use std::path::PathBuf;

pub use ferry_modelcard::CardError;

/// Everything that can go wrong while loading or running a model.
#[derive(thiserror::Error, Debug)]
pub enum ModelError {
    /// Reading the model's description failed: a file, a `config.json` field, the
    /// architecture, the tokenizer or the chat template ([`CardError`] names which).
    #[error(transparent)]
    Card(#[from] CardError),
    /// A safetensors file or tensor is malformed (bad header, bad offsets, bad scale tensor…).
    #[error("tensor `{tensor}`: {message}")]
    Weights {
        /// The tensor (or file) concerned.
        tensor: String,
        /// What is wrong with it.
        message: String,
    },

    /// The checkpoint has no tensor of this name.
    #[error("tensor `{0}` is not in the checkpoint")]
    MissingTensor(String),

    /// A tensor exists but its shape is not the one the model needs.
    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor concerned.
        tensor: String,
        /// The shape the model config implies.
        expected: Vec<usize>,
        /// The shape found in the checkpoint.
        got: Vec<usize>,
    },

    /// A tensor is stored in a dtype this loader cannot convert.
    #[error("tensor `{tensor}` has unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// The tensor concerned.
        tensor: String,
        /// The dtype as safetensors spells it (e.g. `I64`).
        dtype: String,
    },

    /// A prompt has more tokens than the model or the deployment accepts.
    #[error("prompt has {tokens} tokens, limit is {limit}")]
    PromptTooLong {
        /// Tokens in the prompt.
        tokens: usize,
        /// The largest accepted prompt.
        limit: usize,
    },

    /// A compute kernel rejected its inputs.
    #[error("kernel: {0}")]
    Kernel(#[from] ferry_kernels::KernelError),

    /// The paged KV pool refused an operation (out of blocks, unknown block, bad table).
    #[error("kv cache: {0}")]
    Kv(String),

    /// A request to the forward is malformed (e.g. a token id outside the vocabulary).
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl ModelError {
    /// A [`ModelError::Config`] for `field`; `message` should give the value and the limit.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Card(CardError::config(field, message))
    }

    /// A [`CardError::MissingFile`] for `path`.
    pub fn missing_file(path: impl Into<PathBuf>) -> Self {
        Self::Card(CardError::MissingFile(path.into()))
    }

    /// A [`CardError::Io`] reading `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Card(CardError::Io {
            path: path.into(),
            source,
        })
    }

    /// A [`ModelError::Weights`] for `tensor`.
    pub fn weights(tensor: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Weights {
            tensor: tensor.into(),
            message: message.into(),
        }
    }

    /// A stable snake_case name for the variant, used as a metric label and in wire errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Card(e) => e.kind(),
            Self::Weights { .. } => "weights",
            Self::MissingTensor(_) => "missing_tensor",
            Self::ShapeMismatch { .. } => "shape_mismatch",
            Self::UnsupportedDtype { .. } => "unsupported_dtype",
            Self::PromptTooLong { .. } => "prompt_too_long",
            Self::Kernel(_) => "kernel",
            Self::Kv(_) => "kv",
            Self::Invalid(_) => "invalid",
        }
    }
}
