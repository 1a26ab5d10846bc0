//! DSpark's two heads on top of the drafter backbone (arXiv 2607.05147).
//!
//! - **Markov head**: draft `k` is drawn left to right from `softmax(U_k + B(x_{k−1}))`, with
//!   `U_k` the backbone's LM-head logits at block position `k` and `B(x) = W2 · W1[x]` a rank-r
//!   bigram correction (`W1`: `[vocab][r]` embedding, `W2`: `[vocab][r]` projection back to the
//!   vocabulary). The corrected distribution is the `q` the verifier must be given.
//! - **Confidence head**: `c_k = σ(wᵀ[h_k ; W1[x_{k−1}]] + b)` predicts that draft `k` survives
//!   verification. It reads the previous draft, never draft `k` itself, so a verify length
//!   chosen from it is non-anticipating.

use ferry_kernels::cpu::gemm::{linear, Matrix};

use crate::ModelError;

/// `B(x) = W2 · W1[x]`.
#[derive(Debug)]
pub struct MarkovHead {
    /// `markov_head.w1.weight`: `[vocab][rank]` (an embedding).
    pub w1: Matrix,
    /// `markov_head.w2.weight`: `[vocab][rank]` (`nn.Linear(rank, vocab)`).
    pub w2: Matrix,
}

impl MarkovHead {
    /// The low rank r.
    pub fn rank(&self) -> usize {
        self.w1.cols()
    }

    /// `W1[x]` for each of `prev`, `[n][rank]`.
    pub fn embed(&self, prev: &[u32]) -> Result<Vec<f32>, ModelError> {
        let r = self.rank();
        let mut out = vec![0.0f32; prev.len() * r];
        for (row, &x) in out.chunks_exact_mut(r).zip(prev) {
            self.w1.row_f32(x as usize, row)?;
        }
        Ok(out)
    }

    /// Adds `W2 · e` to each logits row: `logits` is `[n][vocab]`, `e` is `[n][rank]`.
    pub fn add_bias(&self, e: &[f32], logits: &mut [f32]) -> Result<(), ModelError> {
        let mut b = vec![0.0f32; logits.len()];
        linear(e, &self.w2, &mut b)?;
        for (l, v) in logits.iter_mut().zip(b) {
            *l += v;
        }
        Ok(())
    }
}

/// `c = σ(wᵀ[h ; e] + b)`.
#[derive(Debug)]
pub struct ConfidenceHead {
    /// `confidence_head.weight`, flattened: `hidden + rank` entries.
    pub w: Vec<f32>,
    /// `confidence_head.bias`.
    pub b: f32,
}

impl ConfidenceHead {
    /// The survival estimate for a block position with final hidden state `h` whose previous
    /// token embeds to `e` (`h.len() + e.len()` must be the head's width).
    pub fn survival(&self, h: &[f32], e: &[f32]) -> f32 {
        let z: f32 = self
            .w
            .iter()
            .zip(h.iter().chain(e))
            .map(|(w, x)| w * x)
            .sum::<f32>()
            + self.b;
        1.0 / (1.0 + (-z).exp())
    }
}
