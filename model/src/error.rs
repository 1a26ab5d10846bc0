//! The one error type of `ferry-model`.
//!
//! Every variant names what failed (the file, the config field, the tensor) and, where there is
//! one, the limit and the offending value, so a message read in a log is enough to fix the input
//! (STYLE.md, "Errors"). Loading errors (`Io` … `ChatTemplate`) come from files on disk; the
//! rest (`PromptTooLong`, `Kernel`, `Kv`, `Invalid`) come from serving a request.
use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(thiserror::Error, Debug)]
pub enum ModelError {
    /// A file exists (or should) but could not be read or mapped.
    #[error("cannot read `{}`: {source}", path.display())]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },

    /// A `config.json` field is missing, malformed or out of range. `message` names the value
    /// and the limit; `field` is the JSON key (dotted for nested keys, e.g. `rope_scaling.type`).
    #[error("config field `{field}`: {message}")]
    Config {
        /// The offending field, as spelled in `config.json`.
        field: String,
        /// What is wrong with it: the value found and what was expected.
        message: String,
    },

    /// `architectures` names a model class ferry does not implement.
    #[error(
        "unsupported architecture `{0}`: ferry serves `DeepseekV3ForCausalLM` models \
         (DeepSeek-V3, Kimi K2)"
    )]
    UnsupportedArchitecture(String),

    /// A required file is absent.
    #[error("required file `{}` does not exist", .0.display())]
    MissingFile(PathBuf),

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

    /// `tokenizer.json` could not be loaded, or encoding/decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The chat template is absent, does not compile, or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),

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

impl From<ferry_modelcard::CardError> for ModelError {
    /// Each description error becomes the variant of the same name.
    fn from(e: ferry_modelcard::CardError) -> Self {
        use ferry_modelcard::CardError as C;
        match e {
            C::Io { path, source } => Self::Io { path, source },
            C::Config { field, message } => Self::Config { field, message },
            C::UnsupportedArchitecture(a) => Self::UnsupportedArchitecture(a),
            C::MissingFile(p) => Self::MissingFile(p),
            C::Tokenizer(m) => Self::Tokenizer(m),
            C::ChatTemplate(m) => Self::ChatTemplate(m),
        }
    }
}

impl ModelError {
    /// A [`ModelError::Config`] for `field`; `message` should give the value and the limit.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
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
            Self::Io { .. } => "io",
            Self::Config { .. } => "config",
            Self::UnsupportedArchitecture(_) => "unsupported_architecture",
            Self::MissingFile(_) => "missing_file",
            Self::Weights { .. } => "weights",
            Self::MissingTensor(_) => "missing_tensor",
            Self::ShapeMismatch { .. } => "shape_mismatch",
            Self::UnsupportedDtype { .. } => "unsupported_dtype",
            Self::Tokenizer(_) => "tokenizer",
            Self::ChatTemplate(_) => "chat_template",
            Self::PromptTooLong { .. } => "prompt_too_long",
            Self::Kernel(_) => "kernel",
            Self::Kv(_) => "kv",
            Self::Invalid(_) => "invalid",
        }
    }
}
