//! The one error type of `ferry-modelcard`: reading a model's description from disk.
//!
//! Every variant names what failed (the file, the config field) and, where there is one, the
//! limit and the offending value (STYLE.md, "Errors"). `ferry_model::ModelError` carries it
//! whole (`ModelError::Card`), so an engine error and a router error read alike.
use std::path::PathBuf;

/// Everything that can go wrong reading a config, a tokenizer or a chat template.
#[derive(thiserror::Error, Debug)]
pub enum CardError {
    /// A file exists (or should) but could not be read or written.
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

    /// `tokenizer.json` could not be loaded, or encoding/decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The chat template is absent, does not compile, or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

impl CardError {
    /// A stable snake_case name for the variant, used as a metric label and in wire errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::Config { .. } => "config",
            Self::UnsupportedArchitecture(_) => "unsupported_architecture",
            Self::MissingFile(_) => "missing_file",
            Self::Tokenizer(_) => "tokenizer",
            Self::ChatTemplate(_) => "chat_template",
        }
    }

    /// A [`CardError::Config`] for `field`; `message` should give the value and the limit.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}
