//! What one speculative round's passes cost on a model and device, timed one at a time:
//! [`PassBench`] (shared by `ferry bench-engine --speculative` and `--verify-cost`) and
//! `--verify-cost` itself ([`run_verify_cost`]).
//!
//! `--verify-cost` is issue 15's "regime of a large model": on a large target (the
//! DeepSeek-V2-Lite-shaped model with dummy weights, `--load-format dummy`) and a drafter of a
//! given size (`--drafter-config`, dummy weights too: only its shapes matter for its cost), it
//! measures, per batch size, a plain decode step (one row per sequence), a verify forward of
//! k + 1 rows per sequence for each `--verify-k`, and one drafter pass. With acceptance lengths
//! τ measured elsewhere (`--tau K:T,…`, from a trained pair), the speed-up such a target would
//! get follows from those costs alone: τ · step / (draft + verify(k)) — a computed figure, said
//! to be one wherever it is printed.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context};
use ferry_kernels::backend::{Backend, Tensor};
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_model::deepseek::forward::Hooks;
use ferry_model::deepseek::{BatchInputs, DeepseekModel, LogitsWanted, SeqInput};
use ferry_model::drafter::{
    ContextRows, ContextSegment, DraftCtx, DraftInput, Drafter, DsparkDrafter,
};
use ferry_model::gpu::GpuKvCache;
use ferry_model::kv::layout::DEFAULT_PAGE_SIZE;
use ferry_model::kv::{BlockTable, KvPool, KvStore};

use super::bench_engine::{median, synthetic_prompts, write_json, BenchEngineArgs};

/// Timed passes over one batch of sequences, each with `context` tokens already in the cache
/// (prefilled with the drafter's taps, and the drafter's context extended over them). Every
/// measured forward writes its rows at positions `context..`, so the cache never grows and each
/// repetition costs the same.
pub struct PassBench<'a> {
    target: &'a DeepseekModel,
    drafter: &'a DsparkDrafter,
    pool: KvPool,
    /// The target's rows on a GPU (with the pool's block ids); `None` on the CPU.
    cache: Option<GpuKvCache>,
    dkv: KvStore,
    prompts: Vec<Vec<u32>>,
    tables: Vec<BlockTable>,
    context: usize,
    /// The drafter inputs' sampling temperature (0: greedy, argmax drafts).
    temperature: f32,
}

impl<'a> PassBench<'a> {
    /// Drafter passes for requests sampled at `temperature` (0, the default: greedy). A
    /// sampled pass builds each block position's distribution and draws from it.
    pub fn with_temperature(mut self, temperature: f32) -> Self {
        self.temperature = temperature;
        self
    }

    /// `batch` sequences of `context` tokens, room for `max_rows` more each.
    pub fn new(
        target: &'a DeepseekModel,
        drafter: &'a DsparkDrafter,
        batch: usize,
        context: usize,
        max_rows: usize,
    ) -> anyhow::Result<Self> {
        let vocab = target.config().vocab_size as u32;
        let per_seq = (context + max_rows).div_ceil(DEFAULT_PAGE_SIZE);
        let mut pool = target.new_kv_pool(per_seq * batch, DEFAULT_PAGE_SIZE)?;
        let mut cache = match target.backend() {
            Backend::Cpu => None,
            _ => Some(target.new_kv_cache(per_seq * batch, DEFAULT_PAGE_SIZE)?),
        };
        let layout = drafter.kv_layout().context("the drafter keeps context")?;
        let mut dkv = KvStore::new(target.backend(), layout.rows_layout(pool.layout()))?;
        let prompts = synthetic_prompts(vocab, batch, context.max(max_rows), 7);
        let mut tables = Vec::with_capacity(batch);
        for _ in 0..batch {
            let mut t = BlockTable::new();
            t.reserve(&mut pool, context + max_rows)?;
            tables.push(t);
        }
        // Prefill with the drafter's taps (copied on the device), then its context.
        let taps = drafter.taps().to_vec();
        let mut tapped = Vec::new();
        let hooks = Hooks {
            after_layer: None,
            taps: Some(&taps),
            hidden: None,
            tapped: Some(&mut tapped),
            tap_into: None,
        };
        let heads: Vec<Vec<u32>> = prompts.iter().map(|p| p[..context].to_vec()).collect();
        let prefill = batch_of(&heads, &tables, 0, LogitsWanted::Last);
        match cache.as_mut() {
            Some(cache) => target.forward_hooked(&prefill, cache, hooks)?,
            None => target.forward_hooked(&prefill, &mut pool, hooks)?,
        };
        let mut tapped: Vec<Option<(usize, Tensor)>> = tapped.into_iter().map(Some).collect();
        let tapped: Vec<Tensor> = taps
            .iter()
            .filter_map(|l| {
                tapped
                    .iter_mut()
                    .find(|t| t.as_ref().is_some_and(|(layer, _)| layer == l))
                    .and_then(Option::take)
                    .map(|(_, t)| t)
            })
            .collect();
        let segments: Vec<ContextSegment<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| ContextSegment {
                block_table: t.blocks(),
                start_pos: 0,
                first_row: i * context,
                rows: context,
            })
            .collect();
        drafter.extend_context(
            target,
            &mut dkv,
            &ContextRows {
                taps: &tapped,
                segments: &segments,
            },
        )?;
        Ok(Self {
            target,
            drafter,
            pool,
            cache,
            dkv,
            prompts,
            tables,
            context,
            temperature: 0.0,
        })
    }

    /// Milliseconds of one drafter pass over the batch (median of `reps`).
    pub fn draft_ms(&mut self, reps: usize) -> anyhow::Result<f64> {
        let drafter = self.drafter;
        self.draft_ms_with(drafter, reps)
    }

    /// [`Self::draft_ms`] with another copy of the bench's drafter (same weights; e.g. one
    /// that replays its pass from CUDA graphs).
    pub fn draft_ms_with(&mut self, drafter: &DsparkDrafter, reps: usize) -> anyhow::Result<f64> {
        let params = SamplingParams {
            temperature: self.temperature,
            ..SamplingParams::default()
        };
        // One uniform per block position (a sampled pass draws with them; values do not
        // change its cost).
        let uniforms: Vec<f64> = (0..drafter.block_size())
            .map(|k| (k as f64 + 0.5) / (drafter.block_size() as f64 + 1.0))
            .collect();
        let uniforms = if params.is_greedy() {
            &[][..]
        } else {
            &uniforms[..]
        };
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            let inputs: Vec<DraftInput<'_>> = self
                .prompts
                .iter()
                .zip(&self.tables)
                .map(|(p, t)| DraftInput {
                    anchor: p[self.context.saturating_sub(1)],
                    context_len: self.context,
                    block_table: t.blocks(),
                    tokens: &p[..self.context],
                    params: &params,
                    uniforms,
                })
                .collect();
            let ctx = DraftCtx {
                target: self.target,
                kv: Some(&self.dkv),
            };
            let start = Instant::now();
            let proposals = drafter.propose(&ctx, &inputs);
            ms.push(start.elapsed().as_secs_f64() * 1e3);
            if let Some(Err(e)) = proposals.each.into_iter().find(Result::is_err) {
                return Err(e).context("a drafter pass");
            }
        }
        Ok(median(&mut ms))
    }

    /// Milliseconds of one target forward with `rows` new tokens per sequence (1: a decode
    /// step, which asks for the last row's logits; more: a verify forward, every row's logits),
    /// as the engine runs it: the logits stay on the model's backend, where the engine samples
    /// and verifies them, and the clock stops when the device is done. (Copying every verify
    /// row's logits to the host, as [`DeepseekModel::forward`] does, would time the copy: 236 MB
    /// for 64 sequences × 9 rows of a 102,400-token vocabulary.)
    pub fn forward_ms(&mut self, rows: usize, reps: usize) -> anyhow::Result<f64> {
        let tokens: Vec<Vec<u32>> = self.prompts.iter().map(|p| p[..rows].to_vec()).collect();
        let logits = if rows == 1 {
            LogitsWanted::Last
        } else {
            LogitsWanted::All
        };
        let (target, policy) = (self.target, self.target.policy());
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            let batch = batch_of(&tokens, &self.tables, self.context, logits);
            let start = Instant::now();
            let out = match self.cache.as_mut() {
                Some(cache) => target.forward_logits(&batch, cache, policy, Hooks::default())?,
                None => target.forward_logits(&batch, &mut self.pool, policy, Hooks::default())?,
            };
            target.backend().synchronize()?;
            ms.push(start.elapsed().as_secs_f64() * 1e3);
            drop(out);
        }
        Ok(median(&mut ms))
    }
}

impl Drop for PassBench<'_> {
    fn drop(&mut self) {
        for t in &mut self.tables {
            // The pool goes with the bench; freeing only keeps its accounting straight.
            let _ = t.free(&mut self.pool);
        }
    }
}

/// One sequence per table, `tokens[i]` after `start` cached positions.
pub fn batch_of<'a>(
    tokens: &'a [Vec<u32>],
    tables: &'a [BlockTable],
    start: usize,
    logits: LogitsWanted,
) -> BatchInputs<'a> {
    BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: tokens
            .iter()
            .zip(tables)
            .map(|(t, table)| SeqInput {
                tokens: t,
                start_pos: start,
                block_table: table.blocks(),
                logits,
            })
            .collect(),
    }
}

/// Acceptance lengths by verify length: `K:T` pairs (`--tau 3:2.6,7:3.4`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tau {
    /// Drafts verified per round.
    pub k: usize,
    /// Tokens per round (accepted drafts plus the target's own token), 1..=k + 1.
    pub tau: f64,
}

impl std::str::FromStr for Tau {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (k, tau) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}`: expected K:T (drafts verified : tokens per round)"))?;
        let k: usize = k.trim().parse().map_err(|e| format!("`{s}`: K: {e}"))?;
        let tau: f64 = tau.trim().parse().map_err(|e| format!("`{s}`: T: {e}"))?;
        if k == 0 || !(1.0..=(k + 1) as f64).contains(&tau) {
            return Err(format!(
                "`{s}`: K must be at least 1 and T within 1..=K+1 (a round gives at most K+1 tokens)"
            ));
        }
        Ok(Self { k, tau })
    }
}

/// The speed-up over plain decoding that `tau` tokens per round give when a round costs one
/// drafter pass plus one verify forward and a plain token costs one decode step.
pub fn computed_speedup(tau: f64, step_ms: f64, draft_ms: f64, verify_ms: f64) -> f64 {
    tau * step_ms / (draft_ms + verify_ms)
}

/// The target a pass benchmark times, where `--device` runs it: the checkpoint in `dir`, or
/// with `--load-format dummy` its config with seeded random weights (drawn on a CUDA device
/// directly: a large model's would take minutes from the host).
pub fn bench_target(args: &BenchEngineArgs, dir: &Path) -> anyhow::Result<DeepseekModel> {
    let config = ferry_model::config::ModelConfig::from_file(&dir.join("config.json"))?;
    Ok(match (args.device.load_format(), args.device.cuda()?) {
        (ferry_model::dummy::LoadFormat::Dummy { seed }, Some(dev)) => {
            DeepseekModel::random_seeded(&dev, config, args.device.mode(), seed)?
        }
        (ferry_model::dummy::LoadFormat::Dummy { seed }, None) => DeepseekModel::dummy(dir, seed)?,
        (ferry_model::dummy::LoadFormat::Auto, dev) => {
            let host = DeepseekModel::load(dir)?;
            match dev {
                Some(dev) => host.upload(&dev, args.device.mode())?,
                None => host,
            }
        }
    })
}

/// `ferry bench-engine --verify-cost` (see the module docs).
pub fn run_verify_cost(args: &BenchEngineArgs, dir: &Path) -> anyhow::Result<()> {
    let device = args.device.resolve()?;
    let target = bench_target(args, dir)?;
    let make_drafter = |graphs: bool| -> anyhow::Result<DsparkDrafter> {
        let mut drafter = match (&args.drafter_config, &args.drafter) {
            (Some(_), Some(_)) => bail!("give `--drafter` or `--drafter-config`, not both"),
            (Some(file), None) => {
                let c = ferry_model::drafter::DrafterConfig::from_file(file)?;
                DsparkDrafter::dummy(c, target.config(), args.device.dummy_seed)?
            }
            (None, Some(dir)) => DsparkDrafter::load(dir, target.config())?,
            (None, None) => {
                let found = ferry_model::drafter::default_for(dir)?.context(
                    "no drafter for this model: pass `--drafter DIR` or `--drafter-config FILE`",
                )?;
                DsparkDrafter::load(&found, target.config())?
            }
        };
        drafter.to_backend(target.backend())?;
        drafter.set_graphs(graphs);
        Ok(drafter)
    };
    let drafter = make_drafter(false)?;
    // The serving engine replays the drafter's pass from a CUDA graph (per batch bucket, up to
    // 256 sequences by default): a second copy of the drafter, with graphs, times that too.
    let graphed = match device {
        ferry_kernels::Device::Cuda(_) if args.device.cuda_graphs => Some(make_drafter(true)?),
        _ => None,
    };
    let mut ks: Vec<usize> = args.verify_k.iter().copied().filter(|&k| k >= 1).collect();
    ks.sort_unstable();
    ks.dedup();
    let max_rows = ks.iter().copied().max().unwrap_or(1) + 1;
    if args.prompt_len + max_rows > target.config().max_position_embeddings {
        bail!("`--prompt-len` + the largest `--verify-k` + 1 must fit the model's context");
    }
    let reps = args.repeat.max(1) * 3;
    println!(
        "{device}, {:?} mode, {} cached tokens per sequence; drafter: {} layers, block {}, \
         {} (eager forwards, median of {reps})\n",
        args.device.mode(),
        args.prompt_len,
        drafter.config().num_layers,
        drafter.block_size(),
        if args.temperature > 0.0 {
            format!("drafts sampled at T = {}", args.temperature)
        } else {
            "greedy drafts".into()
        },
    );
    println!("| batch | k | decode step ms | verify (k+1 rows) ms | verify / step | drafter pass ms (eager / graph) | draft / step | computed speed-up at τ |\n|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &batch in &args.batch {
        let mut bench = PassBench::new(&target, &drafter, batch, args.prompt_len, max_rows)?
            .with_temperature(args.temperature);
        // One of each first: the first launches of a shape compile and allocate.
        bench.forward_ms(1, 1)?;
        bench.draft_ms(1)?;
        let step = bench.forward_ms(1, reps)?;
        let eager = bench.draft_ms(reps)?;
        // The first graphed pass of a bucket captures its graph.
        let graph = match graphed.as_ref().filter(|_| batch <= 64) {
            Some(g) => {
                bench.draft_ms_with(g, 1)?;
                Some(bench.draft_ms_with(g, reps)?)
            }
            None => None,
        };
        // What serving pays: the graph replay where there is one.
        let draft = graph.unwrap_or(eager);
        for &k in &ks {
            let verify = bench.forward_ms(k + 1, reps)?;
            let tau = args.tau.iter().find(|t| t.k == k).map(|t| t.tau);
            let speedup = tau.map(|t| computed_speedup(t, step, draft, verify));
            println!(
                "| {batch} | {k} | {step:.2} | {verify:.2} | {:.2} | {eager:.2} / {} | {:.2} | {} |",
                verify / step,
                graph.map_or("—".into(), |g| format!("{g:.2}")),
                draft / step,
                match (tau, speedup) {
                    (Some(t), Some(s)) => format!("{s:.2}x (τ {t})"),
                    _ => "—".into(),
                }
            );
            rows.push(serde_json::json!({
                "batch": batch, "k": k, "decode_step_ms": step, "verify_ms": verify,
                "draft_pass_ms": draft, "draft_pass_eager_ms": eager,
                "draft_pass_graph_ms": graph, "verify_over_step": verify / step,
                "tau": tau, "computed_speedup": speedup,
            }));
        }
    }
    write_json(
        args,
        device,
        serde_json::json!({
            "benchmark": "bench-engine --verify-cost",
            "model": dir.display().to_string(),
            "load_format": args.device.load_format.as_str(),
            "drafter_layers": drafter.config().num_layers,
            "drafter_block_size": drafter.block_size(),
            "draft_temperature": args.temperature,
            "note": "computed_speedup = tau * decode_step / (draft_pass + verify): computed from measured costs and an acceptance length measured elsewhere; draft_pass_ms is the graph replay where the engine would use one (CUDA, batch <= 64), else the eager pass; every target forward is eager",
            "rows": rows,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tau_pairs_parse_and_are_bounded_by_a_round() {
        assert_eq!("3:2.5".parse::<Tau>(), Ok(Tau { k: 3, tau: 2.5 }));
        assert!(
            "3:4.5".parse::<Tau>().is_err(),
            "at most k + 1 tokens a round"
        );
        assert!("0:1".parse::<Tau>().is_err());
        assert!("3".parse::<Tau>().is_err());
        assert!("3:0.5".parse::<Tau>().is_err());
    }

    #[test]
    fn the_v2_lite_drafter_config_fits_both_v2_lite_targets() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/dummy");
        let drafter = ferry_model::drafter::DrafterConfig::from_file(
            &root.join("v2-lite-drafter/config.json"),
        )
        .expect("the drafter config parses");
        assert_eq!((drafter.num_layers, drafter.block_size), (2, 16));
        for target in ["deepseek-v2-lite", "v2-lite-shape"] {
            let t =
                ferry_model::config::ModelConfig::from_file(&root.join(target).join("config.json"))
                    .expect("the target config parses");
            drafter
                .check_target(&t)
                .unwrap_or_else(|e| panic!("{target}: {e}"));
        }
    }

    #[test]
    fn the_computed_speedup_is_tokens_per_round_over_the_round_in_steps() {
        // A round of 4 tokens costing 2 decode steps is twice as fast as plain decoding.
        assert!((computed_speedup(4.0, 1.0, 0.5, 1.5) - 2.0).abs() < 1e-12);
        // Free drafts and a verify as cheap as a step: τ itself.
        assert!((computed_speedup(3.2, 2.0, 0.0, 2.0) - 3.2).abs() < 1e-12);
    }
}
