//! Structured output on a worker: the one [`GrammarCompiler`] per process, built from the
//! served tokenizer when the worker starts, and each request's wire `response_format` compiled
//! into the [`Grammar`] its engine job carries. Both are CPU work and run on tokio's blocking
//! pool, never on the runtime's workers (STYLE.md 9).

use std::path::Path;
use std::sync::Arc;

use ferry_model::config::ModelConfig;
use ferry_modelcard::grammar::{Grammar, GrammarCompiler, OutputGrammar};
use ferry_modelcard::tokenizer::Tokenizer;
use ferry_proto::v1::response_format::Format;
use ferry_proto::v1::ResponseFormat;
use tonic::Status;
use tracing::{info, warn};

/// The grammar compiler for the model in `model_dir` (its tokenizer, or the embedded one for a
/// directory with only a `config.json`), sized to `config`'s vocabulary and end-of-sequence
/// tokens. `None`, with a warning, when the tokenizer cannot be loaded or turned into a token
/// trie: the worker then serves, and refuses requests with a `response_format`.
pub async fn load_compiler(model_dir: &Path, config: &ModelConfig) -> Option<GrammarCompiler> {
    let dir = model_dir.to_path_buf();
    let vocab = config.vocab_size;
    let eos = config.eos_token_ids.clone();
    let started = std::time::Instant::now();
    let built = tokio::task::spawn_blocking(move || {
        let (tokenizer, _) = Tokenizer::from_dir_or_embedded(&dir).map_err(|e| e.to_string())?;
        GrammarCompiler::new(Arc::new(tokenizer), vocab, &eos).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    match built {
        Ok(c) => {
            info!(
                vocab,
                ms = started.elapsed().as_millis() as u64,
                "grammar compiler ready (structured output)"
            );
            Some(c)
        }
        Err(e) => {
            warn!(error = %e, "no grammar compiler: requests with a response_format will be refused");
            None
        }
    }
}

/// The wire's response format → what the output must be (INVALID_ARGUMENT naming the field
/// for a schema that is not JSON); `None` when unset.
pub fn output_grammar(f: Option<&ResponseFormat>) -> Result<Option<OutputGrammar>, Status> {
    match f.and_then(|f| f.format.as_ref()) {
        None => Ok(None),
        Some(Format::JsonObject(_)) => Ok(Some(OutputGrammar::JsonObject)),
        Some(Format::JsonSchema(text)) => serde_json::from_str(text)
            .map(|v| Some(OutputGrammar::JsonSchema(v)))
            .map_err(|e| {
                Status::invalid_argument(format!("`response_format.json_schema` is not JSON: {e}"))
            }),
    }
}

/// Compiles the request's `response_format` with `compiler` on the blocking pool;
/// `None` when the request has none. INVALID_ARGUMENT naming `response_format` when it does
/// not compile; FAILED_PRECONDITION when this worker has no compiler.
pub async fn compile(
    compiler: Option<&GrammarCompiler>,
    f: Option<&ResponseFormat>,
) -> Result<Option<Grammar>, Status> {
    let Some(spec) = output_grammar(f)? else {
        return Ok(None);
    };
    let compiler = compiler.cloned().ok_or_else(|| {
        Status::failed_precondition(
            "`response_format`: this worker cannot constrain output (its tokenizer could not \
             be turned into a token trie; see its log)",
        )
    })?;
    tokio::task::spawn_blocking(move || compiler.compile(&spec))
        .await
        .map_err(|e| Status::internal(format!("compiling the grammar: {e}")))?
        .map(Some)
        .map_err(|e| Status::invalid_argument(format!("`response_format`: {e}")))
}
