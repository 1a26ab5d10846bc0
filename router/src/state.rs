//! [`AppState`]: the parts both front doors (gRPC and HTTP) share.
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use ferry_modelcard::config::ModelConfig;
use ferry_modelcard::grammar::GrammarCompiler;
use ferry_modelcard::tokenizer::Tokenizer;
use tokio_util::sync::CancellationToken;

use crate::auth::ApiKeys;
use crate::config::RouterConfig;
use crate::dispatch::{Dispatcher, DispatcherParams};
use crate::error::RouterError;
use crate::index::FlatIndex;
use crate::metrics::{Gauges, RouterMetrics};
use crate::policy::Policy;
use crate::registry::{Registry, RegistryParams, Role};
use crate::select::Selector;
use crate::tokenize::TokenizerPool;
use crate::validate::{Validator, ValidatorParams};

/// The served model, as listed to clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The name clients use.
    pub name: String,
    /// Longest prompt + completion, in tokens (`max_position_embeddings`).
    pub context_length: usize,
    /// Embedding rows; token ids must be below it.
    pub vocab_size: usize,
    /// Hugging Face architecture name.
    pub architecture: &'static str,
    /// When the router loaded it, in Unix seconds (OpenAI's `created`).
    pub created: u64,
}

/// Shared state of one router.
#[derive(Debug)]
pub struct AppState {
    /// The served model.
    pub model: ModelInfo,
    /// Turns client requests into valid ones.
    pub validator: Validator,
    /// Sends valid requests to workers.
    pub dispatcher: Dispatcher,
    /// The workers.
    pub registry: Registry,
    /// Prometheus metrics (`GET /metrics`).
    pub metrics: Arc<RouterMetrics>,
    /// The API keys of the public plane (off without `--api-keys-file`).
    pub keys: ApiKeys,
    drain: CancellationToken,
}

impl AppState {
    /// Checks `config`, loads the tokenizer and `config.json` from the model directory and
    /// the API keys file (on the blocking pool) and builds the registry, index, policy, validator and dispatcher.
    /// Spawns nothing.
    pub async fn load(config: &RouterConfig) -> Result<Arc<Self>, RouterError> {
        config.check()?;
        let dir = config.model_dir.clone();
        let keys_file = config.api_keys_file.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            let model_error = |source| RouterError::Model {
                dir: dir.clone(),
                source,
            };
            let (tokenizer, fallback) =
                Tokenizer::from_dir_or_embedded(&dir).map_err(model_error)?;
            if fallback {
                tracing::warn!(
                    model = %dir.display(),
                    "no tokenizer.json in the model directory (a config-only, dummy-weights \
                     model): using the embedded tokenizer"
                );
            }
            let model = ModelConfig::from_file(&dir.join("config.json")).map_err(model_error)?;
            let keys = ApiKeys::load(keys_file.as_deref())?;
            let tokenizer = Arc::new(tokenizer);
            // The grammar compiler (structured output), on the same tokenizer as the workers'.
            let eos: Vec<u32> = tokenizer
                .eos_token()
                .and_then(|t| tokenizer.token_id(t))
                .into_iter()
                .collect();
            let grammar = GrammarCompiler::new(tokenizer.clone(), model.vocab_size, &eos)
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "response_format and tool_choice will be refused")
                })
                .ok();
            Ok::<_, RouterError>((tokenizer, model, keys, grammar))
        })
        .await
        .map_err(|e| RouterError::Task(format!("model loading: {e}")))?;
        let (tokenizer, model_config, keys, grammar) = loaded?;

        let model = ModelInfo {
            name: config.model_name(),
            context_length: model_config.max_position_embeddings,
            vocab_size: model_config.vocab_size,
            architecture: ferry_modelcard::config::ARCHITECTURE,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let registry = Registry::new(RegistryParams {
            index: Arc::new(FlatIndex::new()),
            heartbeat_timeout: config.heartbeat_timeout(),
            page_size: config.page_size,
            cluster_token: config.token()?,
        });
        let validator = Validator::new(ValidatorParams {
            model_name: model.name.clone(),
            context_length: model.context_length,
            vocab_size: model.vocab_size,
            page_size: config.page_size,
            tokenizer: TokenizerPool::new(tokenizer.clone()),
            grammar,
        });
        let drain = CancellationToken::new();
        let metrics = Arc::new(RouterMetrics::new());
        let dispatcher = Dispatcher::new(DispatcherParams {
            selector: Selector::new(registry.clone(), Policy::new(config.policy))
                .with_ttft_slo(config.ttft_slo_ms),
            tokenizer,
            max_concurrent_requests: config.max_concurrent_requests,
            max_migrations: config.max_migrations,
            drain: drain.clone(),
            metrics: metrics.clone(),
        });
        Ok(Arc::new(Self {
            model,
            validator,
            dispatcher,
            registry,
            metrics,
            keys,
            drain,
        }))
    }

    /// The Prometheus text exposition of the router's metrics, with live gauges.
    pub fn render_metrics(&self) -> String {
        let now = Instant::now();
        let index = self
            .registry
            .healthy_workers(now)
            .into_iter()
            .map(|w| {
                let blocks = self.registry.index().worker_blocks(&w.id);
                (w.id.0, blocks)
            })
            .collect();
        self.metrics.render_with_index(
            Gauges {
                in_flight: self.dispatcher.in_flight(),
                prefill_workers: self.registry.count(Role::Prefill, now),
                decode_workers: self.registry.count(Role::Decode, now),
            },
            index,
        )
    }

    /// Healthy decode workers now.
    pub fn decode_workers(&self) -> usize {
        self.registry.count(Role::Decode, Instant::now())
    }

    /// Ends every open generation stream with an error (shutdown past the drain deadline).
    pub fn end_open_streams(&self) {
        self.drain.cancel();
    }
}
