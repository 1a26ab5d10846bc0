//! `ferry bench`: drives a running cluster through the public gRPC API at several concurrency
//! levels and reports time to first token, inter-token latency and throughput percentiles.
//!
//! Each level runs `--requests-per-level` requests (at least the concurrency) with `concurrency`
//! of them in flight at any time. Prompts are random token ids (seeded, distinct per request so
//! no prefix is shared) of `--prompt-tokens`; every request generates exactly
//! `--output-tokens` (`ignore_eos`). The default shape, 512 in / 200 out, is the reference
//! workload's 1,024 / 400 scaled to the embedded model's 1,024-token context.
//!
//! A long-prompt mix (`--long-prompt-tokens N --long-every K`: every K-th request of a level
//! has an N-token prompt) shows what disaggregation is for: a long prefill on the worker that
//! also decodes stalls every sequence decoding there. The short requests' TTFT and ITL are then
//! reported on their own next to the long ones' TTFT. `--json` writes every level's figures
//! for `benchmarks/results/`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use ferry_proto::v1::generate_request::Input;
use ferry_proto::v1::inference_client::InferenceClient;
use ferry_proto::v1::{GenerateRequest, SamplingParams, StopConditions, TokenIds};
use serde_json::json;
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
    /// Sampling temperature (0 = greedy). Sampled requests are unseeded, so a speculating
    /// cluster speculates on them (a seeded sampled request decodes token by token unless it
    /// asks to speculate).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Prompt length of the long requests of a mix (0: no mix, every prompt is
    /// `--prompt-tokens`).
    #[arg(long, default_value_t = 0)]
    pub long_prompt_tokens: usize,
    /// With `--long-prompt-tokens`: every K-th request of a level is a long one.
    #[arg(long, default_value_t = 8)]
    pub long_every: usize,
    /// Also write every level's figures here as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

impl BenchArgs {
    /// Whether a level's `i`-th request (1-based) is a long one of the mix.
    fn is_long(&self, i: usize) -> bool {
        self.mix() && i % self.long_every == 0
    }

    /// The prompt length of a level's `i`-th request (1-based).
    fn prompt_len(&self, i: usize) -> usize {
        if self.is_long(i) {
            self.long_prompt_tokens
        } else {
            self.prompt_tokens
        }
    }

    fn mix(&self) -> bool {
        self.long_prompt_tokens > 0
    }
}

/// One request's timings.
struct Sample {
    long: bool,
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

/// TTFT and ITL percentiles (ms) of a set of requests.
fn latencies<'a>(samples: impl Iterator<Item = &'a Sample> + Clone) -> serde_json::Value {
    let mut ttft: Vec<f64> = samples.clone().map(|s| ms(s.ttft)).collect();
    let mut itl: Vec<f64> = samples
        .flat_map(|s| s.gaps.iter().map(|g| ms(*g)))
        .collect();
    json!({
        "requests": ttft.len(),
        "ttft_ms": {"p50": pct(&mut ttft, 50.0), "p90": pct(&mut ttft, 90.0), "p99": pct(&mut ttft, 99.0)},
        "itl_ms": {"p50": pct(&mut itl, 50.0), "p90": pct(&mut itl, 90.0), "p99": pct(&mut itl, 99.0)},
    })
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
    if args.mix() && args.long_every == 0 {
        bail!("`--long-every` must be at least 1");
    }
    let uri = format!("http://{}", args.grpc_addr);
    let client = InferenceClient::connect(uri.clone())
        .await
        .with_context(|| format!("connecting to {uri}"))?;
    if args.mix() {
        println!(
            "| concurrency | requests (long) | short TTFT p50 ms | short TTFT p99 ms | long TTFT p50 ms | short ITL p50 ms | short ITL p99 ms | ITL p99 ms (all) | output tok/s | req/s |"
        );
    } else {
        println!(
            "| concurrency | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | output tok/s | req/s |"
        );
    }
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut salt = 0u64;
    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let n = args.requests_per_level.max(c);
        let start = Instant::now();
        let mut set = JoinSet::new();
        let mut samples = Vec::with_capacity(n);
        let mut issued = 0;
        while issued < n || !set.is_empty() {
            while issued < n && set.len() < c.max(1) {
                salt += 1;
                issued += 1;
                let req = request(&args, args.prompt_len(issued), salt);
                let long = args.is_long(issued);
                let mut client = client.clone();
                set.spawn(async move { one(&mut client, req, long).await });
            }
            if let Some(r) = set.join_next().await {
                samples.push(r.context("bench task")??);
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        let all = latencies(samples.iter());
        let short = latencies(samples.iter().filter(|s| !s.long));
        let long = latencies(samples.iter().filter(|s| s.long));
        let f = |v: &serde_json::Value, k: &str, p: &str| v[k][p].as_f64().unwrap_or(f64::NAN);
        let (tok_s, req_s) = (tokens as f64 / wall, n as f64 / wall);
        if args.mix() {
            println!(
                "| {c} | {n} ({}) | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {tok_s:.1} | {req_s:.2} |",
                long["requests"],
                f(&short, "ttft_ms", "p50"),
                f(&short, "ttft_ms", "p99"),
                f(&long, "ttft_ms", "p50"),
                f(&short, "itl_ms", "p50"),
                f(&short, "itl_ms", "p99"),
                f(&all, "itl_ms", "p99"),
            );
        } else {
            println!(
                "| {c} | {n} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {tok_s:.1} | {req_s:.2} |",
                f(&all, "ttft_ms", "p50"),
                f(&all, "ttft_ms", "p90"),
                f(&all, "ttft_ms", "p99"),
                f(&all, "itl_ms", "p50"),
                f(&all, "itl_ms", "p90"),
                f(&all, "itl_ms", "p99"),
            );
        }
        levels.push(json!({
            "concurrency": c,
            "requests": n,
            "output_tokens": tokens,
            "wall_s": wall,
            "output_tok_s": tok_s,
            "req_s": req_s,
            "all": all,
            "short": short,
            "long": long,
        }));
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "grpc_addr": args.grpc_addr,
            "prompt_tokens": args.prompt_tokens,
            "long_prompt_tokens": args.long_prompt_tokens,
            "long_every": if args.mix() { args.long_every } else { 0 },
            "output_tokens_per_request": args.output_tokens,
            "temperature": args.temperature,
            "levels": levels,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn request(args: &BenchArgs, prompt_tokens: usize, salt: u64) -> GenerateRequest {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let ids = (0..prompt_tokens)
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
        // Sampled requests go unseeded, as most users send them: a seeded sampled request
        // decodes token by token unless it asks to speculate, so a seed would hide a
        // speculating cluster's rounds from the benchmark.
        sampling: Some(SamplingParams {
            temperature: Some(args.temperature),
            seed: (args.temperature <= 0.0).then_some(salt),
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
    long: bool,
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
        long,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn args(extra: &[&str]) -> BenchArgs {
        Cli::try_parse_from(["bench"].iter().chain(extra))
            .expect("bench arguments")
            .bench
    }

    /// A seeded sampled request decodes token by token unless it asks to speculate, so a
    /// benchmark that seeded its sampled requests would measure a speculating cluster without
    /// a single round: sampled requests go unseeded (as most users send them), greedy ones keep
    /// their seed (it changes nothing there). Prompts stay seeded either way.
    #[test]
    fn sampled_requests_go_unseeded_so_a_speculating_cluster_speculates_on_them() {
        let greedy = request(&args(&[]), 8, 3);
        let sampled = request(&args(&["--temperature", "0.7"]), 8, 3);
        let seed = |r: &GenerateRequest| r.sampling.as_ref().and_then(|s| s.seed);
        assert_eq!(seed(&greedy), Some(3));
        assert_eq!(seed(&sampled), None);
        assert_eq!(sampled.speculative, None, "the worker's setting decides");
        assert_eq!(
            greedy.input, sampled.input,
            "prompts are the salt's either way"
        );
    }
}
