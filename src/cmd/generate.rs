//! `ferry generate`: load a model, run one prompt in this process, stream the text to stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use ferry_kernels::cpu::sample::{Sampler, SamplingParams};
use ferry_model::deepseek::DeepseekModel;
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
    pub device: super::device::DeviceArgs,
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
    let model = DeepseekModel::load(&dir)
        .with_context(|| format!("loading the model from {}", dir.display()))?;
    let tokenizer = Tokenizer::from_dir(&dir)?;

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

    let mut runner = super::device::Runner::new(&args.device, &model, prompt.len() + args.max_tokens)?;
    let mut sampler = Sampler::for_params(&params);
    let mut stream = DecodeStream::new(true);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();

    let mut logits = runner.extend(&prompt)?;
    for i in 0..args.max_tokens {
        let token = sampler.sample(&logits, &params)?;
        if !args.ignore_eos && model.config().eos_token_ids.contains(&token) {
            break;
        }
        if let Some(chunk) = stream.step(&tokenizer, token)? {
            out.write_all(chunk.as_bytes())?;
            out.flush()?;
        }
        if i + 1 < args.max_tokens {
            logits = runner.extend(&[token])?;
        }
    }
    if let Some(rest) = stream.finish(&tokenizer)? {
        out.write_all(rest.as_bytes())?;
    }
    writeln!(out)?;
    runner.finish()?;
    Ok(())
}
