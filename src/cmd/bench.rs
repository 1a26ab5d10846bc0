//! `ferry bench`: drives a running cluster through the public gRPC API at several concurrency
//! levels and reports time to first token, inter-token latency and throughput percentiles.
//!
//! Each level runs `--requests-per-level` requests (at least the concurrency) with `concurrency`
//! of them in flight at any time. Prompts are random token ids (seeded, distinct per request so
//! no prefix is shared) of `--prompt-tokens`; every request generates exactly
//! `--output-tokens` (`ignore_eos`). The default shape, 512 in / 200 out, is the reference
//! workload's 1,024 / 400 scaled to the embedded model's 1,024-token context.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use ferry_proto::v1::generate_request::Input;
use ferry_proto::v1::inference_client::InferenceClient;
use ferry_proto::v1::{GenerateRequest, SamplingParams, StopConditions, TokenIds};
use tokio::task::JoinSet;

/// Options of `ferry bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The router's public gRPC address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub grpc_addr: String,
    /// Concurrency levels to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Requests per level (at least the concurrency).
    #[arg(long, default_value_t = 16)]
    pub requests_per_level: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 200)]
    pub output_tokens: u32,
    /// Vocabulary size to draw prompt tokens from (the embedded model's by default).
    #[arg(long, default_value_t = 2048)]
    pub vocab: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
}

/// One request's timings.
struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

/// Runs the benchmark and prints one Markdown row per level.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench(args))
}

async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if args.prompt_tokens == 0 || args.output_tokens == 0 {
        bail!("`--prompt-tokens` and `--output-tokens` must be at least 1");
    }
    let uri = format!("http://{}", args.grpc_addr);
    let client = InferenceClient::connect(uri.clone())
        .await
        .with_context(|| format!("connecting to {uri}"))?;
    println!(
        "| concurrency | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | output tok/s | req/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut salt = 0u64;
    for &c in &args.concurrency {
        let n = args.requests_per_level.max(c);
        let start = Instant::now();
        let mut set = JoinSet::new();
        let mut samples = Vec::with_capacity(n);
        let mut issued = 0;
        while issued < n || !set.is_empty() {
            while issued < n && set.len() < c.max(1) {
                salt += 1;
                let req = request(&args, salt);
                let mut client = client.clone();
                set.spawn(async move { one(&mut client, req).await });
                issued += 1;
            }
            if let Some(r) = set.join_next().await {
                samples.push(r.context("bench task")??);
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let mut ttft: Vec<f64> = samples.iter().map(|s| ms(s.ttft)).collect();
        let mut itl: Vec<f64> = samples
            .iter()
            .flat_map(|s| s.gaps.iter().map(|g| ms(*g)))
            .collect();
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        println!(
            "| {c} | {n} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} |",
            pct(&mut ttft, 50.0),
            pct(&mut ttft, 90.0),
            pct(&mut ttft, 99.0),
            pct(&mut itl, 50.0),
            pct(&mut itl, 90.0),
            pct(&mut itl, 99.0),
            tokens as f64 / wall,
            n as f64 / wall
        );
    }
    Ok(())
}

fn request(args: &BenchArgs, salt: u64) -> GenerateRequest {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let ids = (0..args.prompt_tokens)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            16 + (x % u64::from(args.vocab.saturating_sub(16).max(1))) as u32
        })
        .collect();
    GenerateRequest {
        model: String::new(),
        input: Some(Input::Tokens(TokenIds { ids })),
        sampling: Some(SamplingParams {
            temperature: Some(args.temperature),
            seed: Some(salt),
            ..Default::default()
        }),
        stop: Some(StopConditions {
            max_tokens: args.output_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        request_id: format!("bench-{salt}"),
        ..Default::default()
    }
}

async fn one(
    client: &mut InferenceClient<tonic::transport::Channel>,
    req: GenerateRequest,
) -> anyhow::Result<Sample> {
    let start = Instant::now();
    let mut stream = client.generate(req).await?.into_inner();
    let mut ttft = None;
    let mut last = start;
    let mut gaps = Vec::new();
    let mut tokens = 0;
    while let Some(msg) = stream.message().await? {
        if msg.token_ids.is_empty() {
            continue;
        }
        let now = Instant::now();
        match ttft {
            None => ttft = Some(now - start),
            Some(_) => gaps.push(now - last),
        }
        last = now;
        tokens += msg.token_ids.len();
    }
    Ok(Sample {
        ttft: ttft.context("the stream ended without a token")?,
        gaps,
        tokens,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile.
fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}
