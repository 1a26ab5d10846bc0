//! DeepSeek-V3 mixture of experts: grouped sigmoid routing and the expert sum.
//!
//! Routing follows transformers' (5.x) `DeepseekV3TopkRouter` (the `noaux_tc` method) step by
//! step:
//!
//! 1. `scores = sigmoid(logits)`; `choice = scores + e_score_correction_bias`.
//! 2. Group score = sum of the two largest `choice` values in each of `n_group` equal groups
//!    (one value if a group has a single expert); keep the `topk_group` best groups.
//! 3. Experts outside kept groups get choice `-inf` (`masked_fill(~mask, -inf)`, as in
//!    transformers 5.x and DeepSeek's inference code; transformers 4.x filled `0.0`, which only
//!    differs when the correction bias drives a kept expert's choice below zero).
//! 4. Pick the `top_k` experts by choice; their weights are the *unbiased* `scores`, divided by
//!    `sum + 1e-20` when `norm_topk_prob`, then multiplied by `routed_scaling_factor`.
//!
//! DeepSeek-V2's routing ([`RouteScoring::Softmax`]) follows transformers' (5.x)
//! `DeepseekV2TopkRouter`: `scores = softmax(logits)` (no bias; `choice = scores`); with
//! `group_limited_greedy`, a group's score is its best expert's and the experts of groups not
//! kept get choice `0.0` (`masked_fill(~mask, 0.0)`); `greedy` is one group; the `top_k` best by
//! choice are weighted by their scores times `routed_scaling_factor`, never renormalised
//! (transformers' V2 router ignores `norm_topk_prob`).
//!
//! Ties (equal group scores or choice values) go to the lower index; torch leaves them
//! unspecified. [`MoeLayer::forward`] sums expert outputs in ascending expert order, as the
//! transformers loop does, so f32 rounding matches it as closely as possible.

use rayon::prelude::*;

use super::gemm::{check_len, linear, Matrix};
use super::mlp::GatedMlp;
use crate::error::KernelError;

/// How the router turns logits into scores (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouteScoring {
    /// DeepSeek-V3: sigmoid, the correction bias in the choice, groups by their two best.
    #[default]
    Sigmoid,
    /// DeepSeek-V2: softmax, no bias, groups by their best, masked experts 0, no renormalising.
    Softmax,
}

/// Routing hyper-parameters of one MoE layer.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeRouting {
    /// Routed experts `E` (`n_routed_experts`).
    pub n_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Expert groups (`n_group`); `E` must divide evenly.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`).
    pub topk_group: usize,
    /// Renormalise the picked weights to sum to 1 before scaling.
    pub norm_topk_prob: bool,
    /// Multiplier on the final weights (`routed_scaling_factor`).
    pub routed_scaling_factor: f32,
    /// How logits become scores.
    pub scoring: RouteScoring,
}

/// One token's routing: `(expert, weight)`, best choice score first.
pub type TokenRoute = Vec<(usize, f32)>;

impl MoeRouting {
    /// Checks the hyper-parameters are consistent.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |field, limit, value: usize| {
            Err(KernelError::InvalidParam {
                op: "moe_routing",
                field,
                limit,
                value: value.to_string(),
            })
        };
        if self.n_experts == 0 {
            return bad("n_experts", "> 0", self.n_experts);
        }
        if self.n_group == 0 || self.n_experts % self.n_group != 0 {
            return bad("n_group", "> 0 and a divisor of n_experts", self.n_group);
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return bad("topk_group", "in 1..=n_group", self.topk_group);
        }
        let reachable = self.topk_group * (self.n_experts / self.n_group);
        if self.top_k == 0 || self.top_k > reachable {
            return bad(
                "top_k",
                "in 1..=topk_group * (n_experts / n_group)",
                self.top_k,
            );
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(KernelError::InvalidParam {
                op: "moe_routing",
                field: "routed_scaling_factor",
                limit: "finite",
                value: self.routed_scaling_factor.to_string(),
            });
        }
        Ok(())
    }

    /// Routes every token of `router_logits` (`[tokens][n_experts]`).
    pub fn route(
        &self,
        router_logits: &[f32],
        correction_bias: &[f32],
    ) -> Result<Vec<TokenRoute>, KernelError> {
        self.validate()?;
        let e = self.n_experts;
        check_len("moe_route", "correction_bias", e, correction_bias.len())?;
        if router_logits.len() % e != 0 {
            return Err(KernelError::NotDivisible {
                op: "moe_route",
                what: "router_logits",
                len: router_logits.len(),
                width: e,
            });
        }
        Ok(router_logits
            .chunks_exact(e)
            .map(|logits| self.route_token(logits, correction_bias))
            .collect())
    }

    fn route_token(&self, logits: &[f32], bias: &[f32]) -> TokenRoute {
        let group_size = self.n_experts / self.n_group;
        let softmax = self.scoring == RouteScoring::Softmax;
        let (scores, mut choice): (Vec<f32>, Vec<f32>) = if softmax {
            let scores = softmax_f32(logits);
            (scores.clone(), scores)
        } else {
            let scores: Vec<f32> = logits.iter().map(|&v| sigmoid(v)).collect();
            let choice = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            (scores, choice)
        };

        let group_scores: Vec<f32> = choice
            .chunks_exact(group_size)
            .map(|g| {
                let best = top_indices(g, g.len().min(if softmax { 1 } else { 2 }));
                let (a, b) = (g[best[0]], best.get(1).map_or(0.0, |&i| g[i]));
                a + b
            })
            .collect();
        let mut kept = vec![false; self.n_group];
        for g in top_indices(&group_scores, self.topk_group) {
            kept[g] = true;
        }
        for (g, block) in choice.chunks_exact_mut(group_size).enumerate() {
            if !kept[g] {
                block.fill(if softmax { 0.0 } else { f32::NEG_INFINITY });
            }
        }

        let picked = top_indices(&choice, self.top_k);
        let mut weights: Vec<f32> = picked.iter().map(|&i| scores[i]).collect();
        if self.norm_topk_prob && !softmax {
            let denom = weights.iter().sum::<f32>() + 1e-20;
            for w in &mut weights {
                *w /= denom;
            }
        }
        picked
            .into_iter()
            .zip(weights)
            .map(|(i, w)| (i, w * self.routed_scaling_factor))
            .collect()
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// `softmax(v)` in f32 (max subtracted), as torch's CPU `softmax(dim=-1, dtype=float32)`.
fn softmax_f32(v: &[f32]) -> Vec<f32> {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = v.iter().map(|&x| (x - m).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// `1 / (1 + exp(-v))` in f32, as torch's CPU `sigmoid`.
fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// A full MoE layer: router, routed experts and the optional shared expert.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeLayer {
    /// Routing hyper-parameters.
    pub routing: MoeRouting,
    /// Router weight `[n_experts][hidden]` (applied in f32, as transformers does).
    pub router: Matrix,
    /// `e_score_correction_bias`, one per routed expert.
    pub correction_bias: Vec<f32>,
    /// Routed experts, indexed by expert id.
    pub experts: Vec<GatedMlp>,
    /// Shared expert(s) fused into one MLP, applied to every token.
    pub shared: Option<GatedMlp>,
}

impl MoeLayer {
    /// `out[m][hidden] = Σ_e w_e · expert_e(x) + shared(x)` for `x[m][hidden]`.
    ///
    /// Each expert runs once on the batch of tokens routed to it; experts run in parallel.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
        let hidden = self.router.cols();
        check_len(
            "moe_forward",
            "router.rows",
            self.routing.n_experts,
            self.router.rows(),
        )?;
        check_len(
            "moe_forward",
            "experts",
            self.routing.n_experts,
            self.experts.len(),
        )?;
        if hidden == 0 || x.len() % hidden != 0 {
            return Err(KernelError::NotDivisible {
                op: "moe_forward",
                what: "x",
                len: x.len(),
                width: hidden,
            });
        }
        check_len("moe_forward", "out", x.len(), out.len())?;
        let tokens = x.len() / hidden;

        let mut logits = vec![0.0f32; tokens * self.routing.n_experts];
        linear(x, &self.router, &mut logits)?;
        let routes = self.routing.route(&logits, &self.correction_bias)?;

        // Gather: per expert, the tokens routed to it and their weights (token order).
        let mut batches: Vec<(Vec<usize>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.routing.n_experts];
        for (t, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                batches[e].0.push(t);
                batches[e].1.push(w);
            }
        }
        let outputs: Vec<Option<Vec<f32>>> = batches
            .par_iter()
            .zip(self.experts.par_iter())
            .map(|((toks, _), expert)| {
                if toks.is_empty() {
                    return Ok(None);
                }
                let mut input = Vec::with_capacity(toks.len() * hidden);
                for &t in toks {
                    input.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
                }
                let mut y = vec![0.0f32; input.len()];
                expert.forward(&input, &mut y)?;
                Ok(Some(y))
            })
            .collect::<Result<_, KernelError>>()?;

        // Scatter in ascending expert order: final[t] += y_e[t] * w_e[t].
        out.fill(0.0);
        for ((toks, ws), y) in batches.iter().zip(&outputs) {
            let Some(y) = y else { continue };
            for ((&t, &w), row) in toks.iter().zip(ws).zip(y.chunks_exact(hidden)) {
                for (o, v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(row) {
                    *o += v * w;
                }
            }
        }
        if let Some(shared) = &self.shared {
            let mut s = vec![0.0f32; x.len()];
            shared.forward(x, &mut s)?;
            for (o, v) in out.iter_mut().zip(&s) {
                *o += v;
            }
        }
        Ok(())
    }
}
