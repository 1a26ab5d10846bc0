//! `ferry bench-engine`: prefill and decode throughput of the in-process CPU engine.
//!
//! For each batch size it prefills `batch` prompts of `--prompt-len` tokens in one forward
//! (a fresh-prompt batch, MHA form), then runs `--decode-steps` batched decode steps (absorbed
//! form), and prints tokens/s for each phase as a Markdown table row. Timing covers the forward
//! only: tokenization, sampling and allocation are outside the measured region.
//!
//! With `--speculative`, it compares speculative decoding with the DSpark drafter against plain
//! decoding through the real engine instead (see [`run_speculative`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::pass_cost::PassBench;
use anyhow::{bail, Context};
use clap::Args;
use ferry_kernels::backend::Backend;
use ferry_kernels::cpu::sample::{argmax, SamplingParams};
use ferry_model::deepseek::{BatchInputs, DeepseekModel, LogitsWanted, SeqInput};
use ferry_model::drafter::{Drafter, DsparkDrafter};
use ferry_model::engine::{
    DraftBudget, EngineConfig, EngineEvent, EngineHandle, EngineStats, GenerateJob, PrefillSource,
    SpecConfig, StepTimes, StopParams, VerifyLen,
};
use ferry_model::kv::layout::DEFAULT_PAGE_SIZE;
use ferry_model::kv::BlockTable;

/// Options of `ferry bench-engine`.
#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    /// Model directory; the embedded tiny-k3 model when omitted.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    #[command(flatten)]
    pub device: ferry_worker::args::DeviceArgs,
    /// Compare speculative decoding with plain decoding through the engine: `--batch` is the
    /// number of concurrent requests, `--decode-steps` the tokens each generates.
    #[arg(long)]
    pub speculative: bool,
    /// DSpark drafter (with `--speculative`); the embedded drafter for the embedded model.
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// Verify length (with `--speculative`): `goodput` (the serving default),
    /// `confidence[:MIN]` or `fixed:N`.
    #[arg(long, default_value = "goodput")]
    pub verify_len: VerifyLen,
    /// Draft slots verified per engine step across the batch (with `--speculative`).
    #[arg(long, default_value_t = 64)]
    pub max_verify_tokens: usize,
    /// Where drafts take their rows (with `--speculative`): `shared` with prompts, or `beside`
    /// them (`ferry decode --draft-budget`).
    #[arg(long, default_value_t = DraftBudget::Beside, env = "FERRY_DRAFT_BUDGET")]
    pub draft_budget: DraftBudget,
    /// Sampling temperature of the requests (with `--speculative`; with `--verify-cost`, of
    /// the drafter pass's inputs; 0 = greedy). Sampled requests are unseeded, so they
    /// speculate as a user's unseeded request does (a seeded one decodes plainly by default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Measure plain decoding through the serving engine on `--device`, decode steps replayed
    /// from CUDA graphs against eager ones: `--batch` is the number of concurrent requests.
    #[arg(long)]
    pub serving: bool,
    /// Measure prefill jobs on `--device` (what a prefill worker runs): forward plus shipping
    /// every layer's blocks to a sink, layer-wise during the forward against after it;
    /// `--batch` is the number of jobs per measurement.
    #[arg(long)]
    pub prefill_ship: bool,
    /// What a speculative round's passes cost against a decode step on `--device`, per batch
    /// size and verify length (issue 15's "regime of a large model"; see `pass_cost.rs`):
    /// `--batch` is the batch, `--prompt-len` the cached tokens per sequence.
    #[arg(long)]
    pub verify_cost: bool,
    /// With `--verify-cost`: the verify lengths k (k + 1 rows per sequence).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,5,7,9,11,13,15")]
    pub verify_k: Vec<usize>,
    /// With `--verify-cost`: a drafter `config.json` whose shapes are measured with seeded
    /// random weights, instead of a trained `--drafter`.
    #[arg(long)]
    pub drafter_config: Option<PathBuf>,
    /// With `--verify-cost`: acceptance lengths measured elsewhere, `K:T` per verify length;
    /// each row with one gets the speed-up computed from its measured costs.
    #[arg(long, value_delimiter = ',')]
    pub tau: Vec<super::pass_cost::Tau>,
    /// With `--speculative`: requests per concurrency level, at least the level's `c` (0, the
    /// default: `c`). Closed loop: `c` in flight, the next prompt starting as one finishes, so
    /// that a low level is measured over several prompts rather than one prompt's luck
    /// (acceptance varies from text to text).
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// With `--speculative`: at least this many times `c` requests per level (default 1). One
    /// wave's requests start together, and speculation finishes them at different times, so
    /// its tail runs below `c` in flight while plain decoding's does not; several waves measure
    /// the level's steady state instead (the closed loop refills each client).
    #[arg(long, default_value_t = 1)]
    pub waves: usize,
    /// With `--speculative` or `--serving`: before a level is timed, `c` requests of this many
    /// tokens run together through the same engine, so the level is measured as a server that
    /// has been serving at that width runs: the level's graphs captured (a capture costs
    /// ~10 ms, a dozen steps of a small model), and `goodput`'s step costs and acceptance
    /// measured. They take the prompt file's last prompts (or synthetic ones). 0: one 4-token
    /// request only (kernel compiles and first-touch allocations), as before session 38.
    #[arg(long, default_value_t = 32)]
    pub warmup_tokens: usize,
    /// With `--speculative`: the engine's new tokens per step (prompt chunks, decode rows and
    /// verified drafts together). 4,096 by default, as every `--speculative` figure before
    /// session 45 used; a cluster's workers default to 2,048 (`ferry up --max-batch-tokens`),
    /// so pass that to measure the engine as a decode worker runs it.
    #[arg(long, default_value_t = 4096, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch_tokens: usize,
    /// With `--speculative`: token-id prompts instead of synthetic ones — JSON lines, each with
    /// an `ids` array (scripts/heldout_prompts.py's output), cut to `--prompt-len`; a level's
    /// requests take them in turn. Acceptance depends on the text, so a trained pair is
    /// measured on text like what it serves.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// With `--serving`, `--prefill-ship`, `--speculative` or `--verify-cost`: also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl BenchEngineArgs {
    /// Requests in a `--speculative` level of `c` clients: `--requests`, at least `--waves`
    /// times `c`, at least `c`.
    fn level_requests(&self, c: usize) -> usize {
        self.requests.max(self.waves.saturating_mul(c)).max(c)
    }
}

/// Runs the benchmark.
pub fn run(args: BenchEngineArgs) -> anyhow::Result<()> {
    let dir = crate::embedded::model_dir(args.model.as_deref())?;
    let cfg = ferry_model::config::ModelConfig::from_file(&dir.join("config.json"))?;
    if args.prompt_len == 0 || args.prompt_len + args.decode_steps > cfg.max_position_embeddings {
        bail!(
            "`--prompt-len` + `--decode-steps` must be in 1..={}",
            cfg.max_position_embeddings
        );
    }
    let dummy = args.device.load_format();
    if args.verify_cost {
        return super::pass_cost::run_verify_cost(&args, &dir);
    }
    if args.speculative {
        return run_speculative(&args, &dir);
    }
    if args.serving {
        return run_serving(&args, &dir);
    }
    if args.prefill_ship {
        return run_prefill_ship(&args, &dir);
    }
    let model = match dummy {
        ferry_model::dummy::LoadFormat::Auto => DeepseekModel::load(&dir)?,
        ferry_model::dummy::LoadFormat::Dummy { seed } => DeepseekModel::dummy(&dir, seed)?,
    };
    let model = match args.device.gpu_model(&model)? {
        Some(gpu) => gpu,
        None => model,
    };
    println!(
        "| batch | prompt | prefill tok/s | decode steps | decode tok/s | threads |\n|---|---|---|---|---|---|"
    );
    for &batch in &args.batch {
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        for rep in 0..args.repeat.max(1) {
            let shape = EngineBench {
                batch,
                prompt_len: args.prompt_len,
                decode_steps: args.decode_steps,
                salt: rep as u32,
            };
            let (p, d) = measure(&model, shape)?;
            prefill.push(p);
            decode.push(d);
        }
        println!(
            "| {batch} | {} | {:.0} | {} | {:.1} | {} |",
            args.prompt_len,
            median(&mut prefill),
            args.decode_steps,
            median(&mut decode),
            rayon::current_num_threads()
        );
    }
    Ok(())
}

/// One prefill batch, then batched greedy decode steps, straight through the model's forward
/// on its device (the KV rows in the host pool on the CPU, in a device cache with the pool's
/// block ids on a GPU); returns (prefill tok/s, decode tok/s), timed around the forward calls.
fn measure(model: &DeepseekModel, b: EngineBench) -> anyhow::Result<(f64, f64)> {
    let vocab = model.config().vocab_size as u32;
    let per_seq = (b.prompt_len + b.decode_steps).div_ceil(DEFAULT_PAGE_SIZE);
    let mut pool = model.new_kv_pool(per_seq * b.batch, DEFAULT_PAGE_SIZE)?;
    let mut device = match model.backend() {
        Backend::Cpu => None,
        _ => Some(model.new_kv_cache(per_seq * b.batch, DEFAULT_PAGE_SIZE)?),
    };
    let prompts = synthetic_prompts(vocab, b.batch, b.prompt_len, b.salt);
    let mut tables = Vec::with_capacity(b.batch);
    for _ in 0..b.batch {
        let mut t = BlockTable::new();
        t.reserve(&mut pool, b.prompt_len + b.decode_steps)?;
        tables.push(t);
    }
    let mut forward = |inputs: &BatchInputs<'_>| match device.as_mut() {
        Some(cache) => model.forward(inputs, cache),
        None => model.forward(inputs, &mut pool),
    };

    let inputs = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| SeqInput {
                tokens: p,
                start_pos: 0,
                block_table: t.blocks(),
                logits: LogitsWanted::Last,
            })
            .collect(),
    };
    let start = Instant::now();
    let out = forward(&inputs)?;
    let prefill_s = start.elapsed().as_secs_f64();

    let mut next: Vec<[u32; 1]> = (0..b.batch)
        .map(|i| [out.last_row(i).map(argmax).unwrap_or(0)])
        .collect();
    let mut decode_s = 0.0;
    for step in 0..b.decode_steps {
        let inputs = BatchInputs {
            prompt_logprobs: Vec::new(),
            drafts_on_device: None,
            seqs: next
                .iter()
                .zip(&tables)
                .map(|(tok, t)| SeqInput {
                    tokens: tok,
                    start_pos: b.prompt_len + step,
                    block_table: t.blocks(),
                    logits: LogitsWanted::Last,
                })
                .collect(),
        };
        let start = Instant::now();
        let out = forward(&inputs)?;
        decode_s += start.elapsed().as_secs_f64();
        for (i, n) in next.iter_mut().enumerate() {
            n[0] = out.last_row(i).map(argmax).unwrap_or(0);
        }
    }
    for mut t in tables {
        t.free(&mut pool)?;
    }
    let prefill_tps = (b.batch * b.prompt_len) as f64 / prefill_s;
    let decode_tps = (b.batch * b.decode_steps) as f64 / decode_s.max(f64::MIN_POSITIVE);
    Ok((prefill_tps, decode_tps))
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Deterministic, distinct prompts (a simple LCG over the vocabulary, skipping specials).
pub(super) fn synthetic_prompts(vocab: u32, batch: usize, len: usize, salt: u32) -> Vec<Vec<u32>> {
    (0..batch as u32)
        .map(|b| {
            let mut x = 0x9e37_79b9u32 ^ (b.wrapping_mul(7919) + salt);
            (0..len)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    16 + (x >> 8) % (vocab - 16)
                })
                .collect()
        })
        .collect()
}

/// `ferry bench-engine --speculative`: for each concurrency, the same requests through an
/// engine without and with the drafter (generated tokens per second of wall time, prefill
/// included; median of `--repeat`), the mean acceptance length (tokens per speculative round),
/// and the cost of one drafter pass and of one verify pass over the whole batch, next to a
/// plain decode step of the same batch.
///
/// With `--load-format dummy` the target and the drafter (`--drafter DIR`'s config.json) get
/// seeded random weights: the drafts are then almost never accepted, so the speed-up means
/// nothing, but what a drafter pass, a verify forward and a round cost on that model's shape
/// (the step counters in the JSON) is measured through the real engine.
fn run_speculative(args: &BenchEngineArgs, dir: &Path) -> anyhow::Result<()> {
    let drafter_dir = match args.drafter.clone() {
        Some(d) => d,
        None => ferry_model::drafter::default_for(dir)?
            .context("no drafter for this model: pass `--drafter DIR`")?,
    };
    // The engines run on `--device`; so do the per-pass costs (the target's forwards and the
    // drafter's passes on that device, as in the engine).
    let device = args.device.resolve()?;
    let load_format = args.device.load_format();
    let target = super::pass_cost::bench_target(args, dir)?;
    if load_format != ferry_model::dummy::LoadFormat::Auto {
        println!("--load-format dummy: random target and drafter; the speed-up and acceptance mean nothing, the pass and step costs do\n");
    }
    let mut drafter = DsparkDrafter::load_as(&drafter_dir, target.config(), load_format)?;
    let ctx_limit = target.config().max_position_embeddings;
    if args.prompt_len + args.decode_steps + drafter.block_size() > ctx_limit {
        bail!("`--prompt-len` + `--decode-steps` + the block size must fit the context of {ctx_limit}");
    }
    drafter.to_backend(target.backend())?;
    drafter.set_graphs(args.device.cuda_graphs && device.is_gpu());
    let base = EngineConfig {
        device,
        gpu_mode: args.device.mode(),
        cuda_graphs: args.device.cuda_graphs,
        load_format,
        ..EngineConfig::default()
    };
    let file_prompts = args
        .prompts
        .as_deref()
        .map(|p| load_prompts(p, args.prompt_len, target.config().vocab_size as u32))
        .transpose()?;
    println!("engines on {device}\n");
    println!(
        "| concurrency | no-spec tok/s | spec tok/s | speedup | acceptance length | drafts verified / round | draft pass ms | verify pass ms | decode step ms | steady speedup |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut rows = Vec::new();
    for &c in &args.batch {
        let (mut plain, mut plain_steady) = (Vec::new(), Vec::new());
        let (mut spec, mut spec_steady) = (Vec::new(), Vec::new());
        let mut stats = EngineStats::default();
        let mut plain_stats = EngineStats::default();
        for rep in 0..args.repeat.max(1) {
            let plain_setup = EngineSetup {
                dir,
                drafter: None,
                base: base.clone(),
                prompts: file_prompts.as_deref(),
            };
            let spec_setup = EngineSetup {
                dir,
                drafter: Some(&drafter_dir),
                base: base.clone(),
                prompts: file_prompts.as_deref(),
            };
            let run = engine_run(&plain_setup, c, args, rep as u32)?;
            plain.push(run.tok_s);
            plain_steady.push(run.steady_tok_s);
            plain_stats = run.stats;
            let run = engine_run(&spec_setup, c, args, rep as u32)?;
            spec.push(run.tok_s);
            spec_steady.push(run.steady_tok_s);
            stats = run.stats;
        }
        let b = drafter.block_size();
        let mut passes = PassBench::new(&target, &drafter, c, args.prompt_len, b + 1)?
            .with_temperature(args.temperature);
        let (d, v, st) = (
            passes.draft_ms(5)?,
            passes.forward_ms(b + 1, 5)?,
            passes.forward_ms(1, 5)?,
        );
        drop(passes);
        let (p, s) = (median(&mut plain), median(&mut spec));
        let (p_steady, s_steady) = (median(&mut plain_steady), median(&mut spec_steady));
        let rounds = stats.spec_rounds.max(1) as f64;
        let acceptance = (stats.spec_accepted_tokens + stats.spec_rounds) as f64 / rounds;
        let drafted = stats.spec_drafted_tokens as f64 / rounds;
        println!(
            "| {c} | {p:.1} | {s:.1} | {:.2}x | {acceptance:.2} | {drafted:.2} | {d:.2} | {v:.2} | {st:.2} | {:.2}x |",
            s / p,
            s_steady / p_steady,
        );
        // Where the last repetition's engines spent their steps: by kind, steps, mean ms per
        // step in all and by phase, and how full the steps were.
        let steps = |t: &StepTimes| {
            let mut out = serde_json::Map::new();
            for (name, k) in t.kinds() {
                out.insert(
                    name.into(),
                    serde_json::json!({
                        "steps": k.steps, "ms": k.mean_ms(k.total_us()),
                        "plan_ms": k.mean_ms(k.plan_us), "launch_ms": k.mean_ms(k.launch_us),
                        "sample_ms": k.mean_ms(k.sample_us), "commit_ms": k.mean_ms(k.commit_us),
                        "sequences_per_step": (k.steps > 0).then(|| k.sequences as f64 / k.steps as f64),
                        "decode_rows_per_step": (k.steps > 0).then(|| k.decode_rows as f64 / k.steps as f64),
                        "graphed_steps": k.graphed,
                    }),
                );
            }
            serde_json::Value::Object(out)
        };
        rows.push(serde_json::json!({
            "concurrency": c, "requests": args.level_requests(c), "plain_tok_s": p, "spec_tok_s": s,
            "plain_steady_tok_s": p_steady, "spec_steady_tok_s": s_steady,
            "acceptance_length": acceptance,
            "drafts_per_round": drafted, "draft_pass_ms": d, "verify_pass_ms": v,
            "decode_step_ms": st,
            "engine_steps": {
                "plain": steps(&plain_stats.step_times),
                "spec": steps(&stats.step_times),
            },
            "spec_by_prediction": by_prediction(&stats.spec_by_prediction),
            "spec_skipped_by_prediction": by_prediction(&stats.spec_skipped_by_prediction),
            "spec_rounds_by_width": &stats.spec_rounds_by_width,
            "spec_queued_steps": stats.spec_queued_steps,
        }));
        // Rewritten after every level: a run cut short (a device lease's time limit) keeps
        // the levels it finished.
        write_json(
            args,
            device,
            serde_json::json!({
                "benchmark": "bench-engine --speculative",
                "prompts": args.prompts.as_ref().map(|p| p.display().to_string()),
                "decode_steps": args.decode_steps,
                "repeat": args.repeat,
                "waves": args.waves,
                "warmup_tokens": args.warmup_tokens,
                "max_batch_tokens": args.max_batch_tokens,
                "rows": rows,
            }),
        )?;
    }
    Ok(())
}

/// `--serving`: `c` concurrent plain requests through the serving engine on `--device`, with
/// decode steps replayed from CUDA graphs and eagerly; tokens/s of wall time (prefill
/// included), median of `--repeat`.
fn run_serving(args: &BenchEngineArgs, dir: &Path) -> anyhow::Result<()> {
    let device = args.device.resolve()?;
    println!(
        "device {device}, {:?} mode, prompt {} tokens, {} new tokens per request\n",
        args.device.mode(),
        args.prompt_len,
        args.decode_steps
    );
    println!(
        "| concurrency | eager tok/s | graphs tok/s | speedup | steps from graphs |\n|---|---|---|---|---|"
    );
    let mut rows = Vec::new();
    for &c in &args.batch {
        let mut eager = Vec::new();
        let mut graphs = Vec::new();
        let mut replayed = 0;
        for rep in 0..args.repeat.max(1) {
            for (on, out) in [(false, &mut eager), (true, &mut graphs)] {
                let setup = EngineSetup {
                    dir,
                    drafter: None,
                    base: EngineConfig {
                        device,
                        gpu_mode: args.device.mode(),
                        cuda_graphs: on,
                        load_format: args.device.load_format(),
                        ..EngineConfig::default()
                    },
                    prompts: None,
                };
                let run = engine_run(&setup, c, args, rep as u32)?;
                out.push(run.tok_s);
                if on {
                    replayed = run.stats.graph_steps;
                }
            }
        }
        let (e, g) = (median(&mut eager), median(&mut graphs));
        println!("| {c} | {e:.1} | {g:.1} | {:.2}x | {replayed} |", g / e);
        rows.push(serde_json::json!({
            "concurrency": c, "eager_tok_s": e, "graphs_tok_s": g, "graph_steps": replayed,
        }));
    }
    write_json(
        args,
        device,
        serde_json::json!({
            "benchmark": "bench-engine --serving",
            "decode_steps": args.decode_steps,
            "repeat": args.repeat,
            "rows": rows,
        }),
    )?;
    Ok(())
}

/// Writes `doc` (a JSON object) to `--json` when given, with the device, the GPU mode and the
/// prompt length added: the benchmark result files of `benchmarks/results/`.
pub(super) fn write_json(
    args: &BenchEngineArgs,
    device: ferry_kernels::Device,
    mut doc: serde_json::Value,
) -> anyhow::Result<()> {
    let Some(path) = &args.json else {
        return Ok(());
    };
    if let Some(obj) = doc.as_object_mut() {
        obj.insert("device".into(), device.to_string().into());
        obj.insert(
            "gpu_mode".into(),
            format!("{:?}", args.device.mode()).into(),
        );
        obj.insert("prompt_len".into(), args.prompt_len.into());
    }
    std::fs::write(path, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// `--prefill-ship`: prefill jobs of `--prompt-len` tokens, one after another, each shipping
/// every layer's blocks to a sink that copies the rows out (as a transport's write does), on an
/// engine that ships layer-wise and on one that ships after the forward. Reports the mean wall
/// time per job (submit → first token, shipping included) and the mean ship tail: from the end
/// of the forward to the last layer handed to the sink.
fn run_prefill_ship(args: &BenchEngineArgs, dir: &Path) -> anyhow::Result<()> {
    let device = args.device.resolve()?;
    println!(
        "device {device}, {:?} mode, prompt {} tokens, {} jobs per measurement\n",
        args.device.mode(),
        args.prompt_len,
        args.batch.first().copied().unwrap_or(8)
    );
    println!(
        "| shipping | job ms (mean) | ship tail after the forward µs (mean) | layers at the sink before the last layer was computed |\n|---|---|---|---|"
    );
    let jobs = args.batch.first().copied().unwrap_or(8).max(1);
    let mut rows = Vec::new();
    for layerwise in [false, true] {
        let config = EngineConfig {
            num_blocks: (args.prompt_len.div_ceil(DEFAULT_PAGE_SIZE) + 1) * (jobs + 2),
            max_batch_tokens: args.prompt_len.max(1),
            device,
            gpu_mode: args.device.mode(),
            gpu_layerwise_shipping: layerwise,
            load_format: args.device.load_format(),
            ..EngineConfig::default()
        };
        let engine = EngineHandle::load(dir, None, config)?;
        let vocab = engine.model_config().vocab_size as u32;
        let layers = engine.kv_layout().num_layers;
        let rt = tokio::runtime::Builder::new_current_thread().build()?;
        let (ms, stats) = rt.block_on(async {
            let sink = || -> ferry_model::engine::LayerSinkFn {
                let mut out: Vec<u8> = Vec::new();
                Box::new(move |_, blocks, rows| {
                    out.clear();
                    for &b in blocks {
                        out.extend_from_slice(rows.block(b).map_err(|e| e.to_string())?);
                    }
                    std::hint::black_box(&out);
                    Ok(())
                })
            };
            // Warm-up (kernel compiles, the pinned ring, the copy stream).
            let warm = synthetic_prompts(vocab, 1, args.prompt_len, 0xfeed)[0].clone();
            engine
                .prefill(warm, SamplingParams::default(), 0, sink())
                .await?;
            let before = engine.stats().await?;
            let mut total = 0.0;
            let salt = if layerwise { 2 } else { 1 };
            for p in synthetic_prompts(vocab, jobs, args.prompt_len, salt) {
                let start = Instant::now();
                engine
                    .prefill(p, SamplingParams::default(), 0, sink())
                    .await?;
                total += start.elapsed().as_secs_f64() * 1e3;
            }
            let after = engine.stats().await?;
            anyhow::Ok((
                total / jobs as f64,
                (
                    after.kv_ship_tail_us - before.kv_ship_tail_us,
                    after.kv_ship_forwards - before.kv_ship_forwards,
                    after.kv_layers_shipped_early - before.kv_layers_shipped_early,
                ),
            ))
        })?;
        let (tail_us, forwards, early) = stats;
        let tail = tail_us as f64 / forwards.max(1) as f64;
        let name = if layerwise {
            "layer-wise (during the forward)"
        } else {
            "after the forward"
        };
        println!(
            "| {name} | {ms:.3} | {tail:.0} | {early} of {} |",
            forwards as usize * layers
        );
        rows.push(serde_json::json!({
            "layerwise": layerwise, "job_ms": ms, "ship_tail_us": tail,
            "layers_early": early, "layers_shipped": forwards as usize * layers,
        }));
    }
    write_json(
        args,
        device,
        serde_json::json!({
            "benchmark": "bench-engine --prefill-ship",
            "jobs": jobs,
            "rows": rows,
        }),
    )?;
    Ok(())
}

/// The speculating engine's rounds by the head's prediction (`EngineStats::spec_by_prediction`):
/// per bin its bounds, rounds, and mean predicted and accepted drafts.
fn by_prediction(bins: &ferry_model::engine::PredictionBins) -> serde_json::Value {
    use ferry_model::engine::PREDICTION_EDGES;
    let bins = bins.0.iter().enumerate().map(|(i, b)| {
        let per = |x: f64| (b.rounds > 0).then(|| x / b.rounds as f64);
        serde_json::json!({
            "from": if i == 0 { 0.0 } else { PREDICTION_EDGES[i - 1] },
            "below": PREDICTION_EDGES.get(i),
            "rounds": b.rounds,
            "predicted_mean": per(b.predicted_milli as f64 / 1e3),
            "accepted_mean": per(b.accepted as f64),
        })
    });
    serde_json::Value::Array(bins.collect())
}

/// Which engine [`engine_run`] starts: the model, the drafter (if any), and the device settings
/// taken from `base`.
struct EngineSetup<'a> {
    dir: &'a Path,
    drafter: Option<&'a Path>,
    base: EngineConfig,
    /// `--prompts`, cut to `--prompt-len`; synthetic prompts when `None`.
    prompts: Option<&'a [Vec<u32>]>,
}

/// What one level of [`engine_run`] measured.
struct LevelRun {
    /// Generated tokens per second of the level's wall time.
    tok_s: f64,
    /// Generated tokens per second until the first client found no request left: the window
    /// in which all `c` were in flight, without the drain that follows (requests that end at
    /// different times, as speculative ones do, leave fewer than `c` running at the end).
    steady_tok_s: f64,
    /// The engine's counters over the level.
    stats: EngineStats,
}

/// `c` concurrent requests through a fresh engine (with the drafter in `drafter` when given).
fn engine_run(
    setup: &EngineSetup<'_>,
    c: usize,
    args: &BenchEngineArgs,
    salt: u32,
) -> anyhow::Result<LevelRun> {
    let EngineSetup {
        dir,
        drafter,
        base,
        prompts,
    } = setup;
    let (dir, drafter) = (*dir, *drafter);
    let per_seq = (args.prompt_len + args.decode_steps + 16).div_ceil(DEFAULT_PAGE_SIZE) + 1;
    let config = EngineConfig {
        num_blocks: per_seq * (c + 1),
        max_batch_tokens: args.max_batch_tokens,
        max_running: c.max(1),
        max_in_flight: c + 1,
        spec: SpecConfig {
            verify_len: args.verify_len,
            max_verify_tokens: args.max_verify_tokens,
            draft_budget: args.draft_budget,
        },
        device: base.device,
        gpu_mode: base.gpu_mode,
        cuda_graphs: base.cuda_graphs,
        load_format: base.load_format,
        ..EngineConfig::default()
    };
    let engine = EngineHandle::load(dir, drafter, config)?;
    let vocab = engine.model_config().vocab_size as u32;
    // Sampled requests go unseeded, as most users send them: a seeded sampled request decodes
    // plainly unless it asks to speculate (`GenerateOptions::speculates`), which would leave a
    // speculating engine nothing to speculate on.
    let sampling = SamplingParams {
        temperature: args.temperature,
        seed: (args.temperature <= 0.0).then_some(u64::from(salt)),
        ..SamplingParams::default()
    };
    let job = |prompt: Vec<u32>, max_tokens: usize| GenerateJob {
        prompt,
        sampling: sampling.clone(),
        controls: Default::default(),
        stop: StopParams {
            ignore_eos: true,
            ..StopParams::max_tokens(max_tokens)
        },
        prefill: PrefillSource::Local,
        grammar: None,
    };
    let n = args.level_requests(c);
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    rt.block_on(async {
        // Warm-up: thread pools, first-touch allocations and (with `--warmup-tokens`) the
        // level's graphs and `goodput`'s estimates stay out of the measurement.
        let (width, tokens) = match args.warmup_tokens {
            0 => (1, 4),
            t => (c.max(1), t),
        };
        let warm: Vec<Vec<u32>> = match prompts {
            // From the file's end: the level's own requests take it from the start.
            Some(file) => (0..width)
                .map(|i| file[file.len() - 1 - i % file.len()].clone())
                .collect(),
            None => synthetic_prompts(vocab, width, args.prompt_len, salt ^ 0xffff),
        };
        let warm = engine.generate_all(warm.into_iter().map(|p| job(p, tokens)).collect())?;
        for mut g in warm {
            while let Some(e) = g.events.recv().await {
                match e {
                    EngineEvent::Finished(_) => break,
                    EngineEvent::Failed(e) => bail!("a warm-up request failed: {e}"),
                    _ => {}
                }
            }
        }
        let before = engine.stats().await?;
        // `FERRY_SYNC_SITES=1` / `FERRY_HOST_TIME=1`: the level's only, not the warm-up's.
        let _ = ferry_kernels::cuda::sync_sites::take();
        let _ = ferry_kernels::cuda::host_time::take();
        let start = Instant::now();
        let batch: Vec<Vec<u32>> = match prompts {
            // The level's requests take the file's prompts in turn, each repetition the next n.
            Some(file) => (0..n)
                .map(|i| file[(salt as usize * n + i) % file.len()].clone())
                .collect(),
            None => synthetic_prompts(vocab, n, args.prompt_len, salt),
        };
        let mut jobs: std::collections::VecDeque<_> = batch
            .into_iter()
            .map(|p| job(p, args.decode_steps))
            .collect();
        // The level's first `c` requests go in as one command, so the engine has all `c` in
        // flight from its first step (sent one by one, the engine could start a prompt step
        // between two sends and split the batch's prompts in two).
        let first = engine.generate_all(jobs.drain(..c.min(jobs.len())).collect())?;
        // `c` clients, each taking the next request when its last one finished.
        let queue = std::sync::Arc::new(std::sync::Mutex::new(jobs));
        // Tokens so far, and (seconds, tokens) when the first client found the queue empty.
        let generated = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let drained = std::sync::Arc::new(std::sync::OnceLock::<(f64, usize)>::new());
        let mut clients = tokio::task::JoinSet::new();
        for g in first {
            let (engine, queue) = (engine.clone(), queue.clone());
            let (generated, drained) = (generated.clone(), drained.clone());
            clients.spawn(async move {
                let mut tokens = 0usize;
                let mut current = Some(g);
                loop {
                    let mut g = match current.take() {
                        Some(g) => g,
                        None => {
                            let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                            let Some(job) = next else {
                                let at = generated.load(std::sync::atomic::Ordering::Relaxed);
                                drained.get_or_init(|| (start.elapsed().as_secs_f64(), at));
                                return anyhow::Ok(tokens);
                            };
                            engine.generate(job)?
                        }
                    };
                    while let Some(e) = g.events.recv().await {
                        match e {
                            EngineEvent::Token(_) => {
                                tokens += 1;
                                generated.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            EngineEvent::Finished(_) => break,
                            EngineEvent::Failed(e) => bail!("a benchmark request failed: {e}"),
                            _ => {}
                        }
                    }
                }
            });
        }
        let mut tokens = 0usize;
        while let Some(done) = clients.join_next().await {
            tokens += done??;
        }
        let secs = start.elapsed().as_secs_f64();
        let (steady_secs, steady_tokens) = drained.get().copied().unwrap_or((secs, tokens));
        let after = engine.stats().await?;
        let stats = EngineStats {
            spec_rounds: after.spec_rounds - before.spec_rounds,
            spec_drafted_tokens: after.spec_drafted_tokens - before.spec_drafted_tokens,
            spec_accepted_tokens: after.spec_accepted_tokens - before.spec_accepted_tokens,
            spec_rounds_by_width: after
                .spec_rounds_by_width
                .iter()
                .enumerate()
                .map(|(g, n)| {
                    n.saturating_sub(before.spec_rounds_by_width.get(g).copied().unwrap_or(0))
                })
                .collect(),
            spec_queued_steps: after.spec_queued_steps - before.spec_queued_steps,
            graph_steps: after.graph_steps - before.graph_steps,
            step_times: after.step_times.since(&before.step_times),
            spec_by_prediction: after.spec_by_prediction.since(&before.spec_by_prediction),
            spec_skipped_by_prediction: after
                .spec_skipped_by_prediction
                .since(&before.spec_skipped_by_prediction),
            ..after
        };
        print_host_diagnostics(if drafter.is_some() { "spec" } else { "plain" }, c, &stats);
        Ok(LevelRun {
            tok_s: tokens as f64 / secs,
            steady_tok_s: steady_tokens as f64 / steady_secs.max(f64::MIN_POSITIVE),
            stats,
        })
    })
}

/// The level's host diagnostics, each when switched on, per step of the level's engine:
/// where it made the host wait on the GPU (`FERRY_SYNC_SITES=1`,
/// `ferry_kernels::cuda::sync_sites`, by call site) and its host time by CUDA call
/// (`FERRY_HOST_TIME=1`, `ferry_kernels::cuda::host_time`: the host work before each kind of
/// call and inside it).
fn print_host_diagnostics(arm: &str, c: usize, stats: &EngineStats) {
    use ferry_kernels::cuda::{host_time, sync_sites};
    if !sync_sites::enabled() && !host_time::enabled() {
        return;
    }
    let steps: u64 = stats
        .step_times
        .kinds()
        .into_iter()
        .map(|(_, k)| k.steps)
        .sum();
    let per_step = |n: u64| n as f64 / steps.max(1) as f64;
    if sync_sites::enabled() {
        println!("\nhost waits on the GPU, {arm} engine at c = {c} ({steps} steps):\n");
        println!("| waits | a step | ms waited | call site |\n|---|---|---|---|");
        for s in sync_sites::take().iter().take(20) {
            let (waits, ms) = (s.count, s.waited_s * 1e3);
            println!(
                "| {waits} | {:.2} | {ms:.1} | `{}` |",
                per_step(waits),
                s.site
            );
        }
    }
    if host_time::enabled() {
        let rows = host_time::take();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let total: f64 = rows.iter().map(|r| ms(r.gap + r.call)).sum();
        println!(
            "\nhost time by CUDA call, {arm} engine at c = {c} ({steps} steps, {total:.1} ms in all, gaps of 1 ms or more left out):\n"
        );
        // The engine thread's phases (the scheduler names them), dearest first.
        let mut phases: Vec<(&str, u64, f64, f64)> = Vec::new();
        for r in &rows {
            match phases.iter_mut().find(|p| p.0 == r.phase) {
                Some(p) => {
                    p.1 += r.count;
                    p.2 += ms(r.gap);
                    p.3 += ms(r.call);
                }
                None => phases.push((r.phase, r.count, ms(r.gap), ms(r.call))),
            }
        }
        phases.sort_by(|a, b| (b.2 + b.3).total_cmp(&(a.2 + a.3)));
        println!("| phase | calls | ms before (host work) | ms inside |\n|---|---|---|---|");
        for (phase, calls, before, inside) in &phases {
            let phase = if phase.is_empty() {
                "(none named)"
            } else {
                phase
            };
            println!("| {phase} | {calls} | {before:.1} | {inside:.1} |");
        }
        println!();
        println!("| phase | call | calls | a step | ms before (host work) | ms inside | µs a call, before + inside | gaps ≥ 1 ms |\n|---|---|---|---|---|---|---|---|");
        for r in rows.iter().take(40) {
            let (before, inside) = (ms(r.gap), ms(r.call));
            println!(
                "| {} | `{}` | {} | {:.2} | {before:.1} | {inside:.1} | {:.1} | {} |",
                r.phase,
                r.name,
                r.count,
                per_step(r.count),
                (before + inside) * 1e3 / r.count.max(1) as f64,
                r.long_gaps
            );
        }
    }
    println!();
}

/// `--prompts`: every line's `ids`, cut to `len` tokens; a line that is not JSON with an `ids`
/// array of token ids below `vocab`, or is shorter than `len`, is an error naming the line.
fn load_prompts(path: &Path, len: usize, vocab: u32) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading `--prompts` {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("`--prompts` {} line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(at)?;
        let ids: Vec<u32> = v
            .get("ids")
            .and_then(|x| x.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect()
            })
            .with_context(|| format!("{}: no `ids` array of token ids", at()))?;
        if ids.len() < len {
            bail!("{}: {} ids, `--prompt-len` is {len}", at(), ids.len());
        }
        if let Some(&t) = ids.iter().find(|&&t| t >= vocab) {
            bail!(
                "{}: token id {t} is outside the vocabulary of {vocab}",
                at()
            );
        }
        out.push(ids[..len].to_vec());
    }
    if out.is_empty() {
        bail!("`--prompts` {}: no prompts", path.display());
    }
    Ok(out)
}

/// Shape of one `bench-engine` measurement.
#[derive(Debug, Clone, Copy)]
struct EngineBench {
    /// Sequences.
    batch: usize,
    /// Prompt tokens per sequence.
    prompt_len: usize,
    /// Decode steps.
    decode_steps: usize,
    /// Seed for the prompts.
    salt: u32,
}
