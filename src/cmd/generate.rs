//! `ferry generate`: load a model, run one prompt in this process, stream the text to stdout.
//!
//! The prompt runs through the in-process engine, the one a decode worker runs, on `--device`:
//! with DSpark speculative decoding when a drafter is configured (`--drafter`, or the embedded
//! one for the embedded model; on a GPU the drafter runs on the CPU beside it), plainly
//! otherwise. Greedy output is the same
//! either way; a seeded sampled run draws from the engine's (seed, step) streams, as a decode
//! worker does.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use ferry_decode::spec::SpecArgs;
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_model::config::ModelConfig;
use ferry_model::deepseek::DeepseekModel;
use ferry_model::drafter::DsparkDrafter;
use ferry_model::dummy::{LoadFormat, ModelSource};
use ferry_model::engine::{
    EngineConfig, EngineEvent, EngineHandle, GenerateJob, PrefillSource, StopParams,
};
use ferry_model::tokenizer::{ChatMessage, DecodeStream, Tokenizer};

/// Options of `ferry generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json); the embedded
    /// tiny-k3 model when omitted.
    #[arg(long, env = "FERRY_MODEL")]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub device: ferry_worker::args::DeviceArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// Sampling flags shared by every command that generates.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Softmax temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off); ties at the k-th value are all kept.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than min_p × the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// Validated sampling parameters.
    pub fn params(&self) -> anyhow::Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        };
        p.validate()?;
        Ok(p)
    }
}

/// Runs `ferry generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    if args.max_tokens == 0 {
        bail!("`--max-tokens` must be at least 1, got 0");
    }
    let dir = crate::embedded::model_dir(args.model.as_deref())?;
    let model = match args.device.load_format() {
        LoadFormat::Auto => ModelSource::Model(
            DeepseekModel::load(&dir)
                .with_context(|| format!("loading the model from {}", dir.display()))?,
        ),
        LoadFormat::Dummy { seed } => ModelSource::Dummy {
            config: ModelConfig::from_file(&dir.join("config.json"))
                .with_context(|| format!("reading {}/config.json", dir.display()))?,
            seed,
        },
    };
    let (tokenizer, fallback) = Tokenizer::from_dir_or_embedded(&dir)?;
    if fallback {
        eprintln!(
            "note: {} has no tokenizer.json; using the embedded model's tokenizer",
            dir.display()
        );
    }

    let text = if args.chat {
        tokenizer.apply_chat_template(&[ChatMessage::new("user", &args.prompt)], true)?
    } else {
        args.prompt.clone()
    };
    // A chat template writes its own BOS; a raw prompt gets the tokenizer's special tokens.
    let prompt = tokenizer.encode(&text, !args.chat)?;
    if args.prompt.is_empty() || prompt.is_empty() {
        bail!("`--prompt` must not be empty");
    }
    let context = model.config().max_position_embeddings;
    if prompt.len() >= context {
        bail!(
            "the prompt is {} tokens, but the model's context is {context} positions",
            prompt.len()
        );
    }
    if prompt.len() + args.max_tokens > context {
        bail!(
            "`--max-tokens` {} is too large: the prompt is {} tokens and the context is {context}, so at most {} new tokens fit",
            args.max_tokens,
            prompt.len(),
            context - prompt.len()
        );
    }

    let device = args.device.resolve()?;
    // Dummy weights come without a drafter (its weights would not match them).
    let drafter = match model {
        ModelSource::Model(_) => args.spec.drafter_dir(&dir, device)?,
        ModelSource::Dummy { .. } => None,
    };
    let run = Run {
        prompt,
        params,
        stop: StopParams {
            ignore_eos: args.ignore_eos,
            ..StopParams::max_tokens(args.max_tokens)
        },
        tokenizer: &tokenizer,
    };
    generate(model, drafter.as_deref(), &args, device, run)
}

/// One prompt for [`generate`].
struct Run<'a> {
    prompt: Vec<u32>,
    params: SamplingParams,
    stop: StopParams,
    tokenizer: &'a Tokenizer,
}

/// Generates through the in-process engine (the same one a decode worker runs) on `device`,
/// speculating with the DSpark drafter in `drafter_dir` when one is given.
fn generate(
    model: ModelSource,
    drafter_dir: Option<&Path>,
    args: &GenerateArgs,
    device: ferry_kernels::Device,
    run: Run<'_>,
) -> anyhow::Result<()> {
    let drafter = drafter_dir
        .map(|d| {
            DsparkDrafter::load(d, model.config())
                .with_context(|| format!("loading the drafter from {}", d.display()))
        })
        .transpose()?;
    let page = EngineConfig::default().page_size;
    // The prompt, every new token, one block of drafts in flight, and a spare block.
    let drafts = drafter.as_ref().map_or(0, |d| d.config().block_size);
    let positions = run.prompt.len() + run.stop.max_tokens + drafts;
    let config = EngineConfig {
        num_blocks: positions.div_ceil(page) + 1,
        max_in_flight: 1,
        spec: args.spec.spec_config(),
        device,
        gpu_mode: args.device.mode(),
        cuda_graphs: args.device.cuda_graphs,
        ..EngineConfig::default()
    };
    let drafter = drafter.map(|d| Box::new(d) as Box<dyn ferry_model::drafter::Drafter>);
    let engine = EngineHandle::spawn_source(model, drafter, config)?;
    let mut generation = engine.generate(GenerateJob {
        prompt: run.prompt,
        sampling: run.params,
        controls: Default::default(),
        stop: run.stop,
        prefill: PrefillSource::Local,
        grammar: None,
    })?;
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let mut stream = DecodeStream::new(true);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    rt.block_on(async {
        while let Some(event) = generation.events.recv().await {
            match event {
                EngineEvent::Token(t) => {
                    if let Some(chunk) = stream.step(run.tokenizer, t)? {
                        out.write_all(chunk.as_bytes())?;
                        out.flush()?;
                    }
                }
                EngineEvent::Finished(_) => return Ok(()),
                EngineEvent::Failed(e) => bail!("generation failed: {e}"),
                _ => {}
            }
        }
        bail!("the engine stopped before the request finished")
    })?;
    if let Some(rest) = stream.finish(run.tokenizer)? {
        out.write_all(rest.as_bytes())?;
    }
    writeln!(out)?;
    let stats = rt.block_on(engine.stats())?;
    if stats.spec_rounds > 0 {
        tracing::info!(
            rounds = stats.spec_rounds,
            drafted = stats.spec_drafted_tokens,
            accepted = stats.spec_accepted_tokens,
            acceptance_length =
                (stats.spec_accepted_tokens + stats.spec_rounds) as f64 / stats.spec_rounds as f64,
            "speculative decoding"
        );
    }
    Ok(())
}
