//! DSpark's two heads on top of the drafter backbone (arXiv 2607.05147), on the drafter's
//! backend.
//!
//! - **Markov head**: draft `k` is drawn left to right from `softmax(U_k + B(x_{k−1}))`, with
//!   `U_k` the backbone's LM-head logits at block position `k` and `B(x) = W2 · W1[x]` a rank-r
//!   bigram correction (`W1`: `[vocab][r]` embedding, `W2`: `[vocab][r]` projection back to the
//!   vocabulary). The corrected distribution is the `q` the verifier must be given.
//! - **Confidence head**: `c_k = σ(wᵀ[h_k ; W1[x_{k−1}]] + b)` predicts that draft `k` survives
//!   verification. It reads the previous draft, never draft `k` itself, so a verify length
//!   chosen from it is non-anticipating.
//!
//! A pass applies both heads one block position at a time with
//! `ferry_kernels::backend::draft::markov_step` (one launch a position on a GPU).

use ferry_kernels::backend::{Backend, Tensor, Weight};

use crate::ModelError;

/// `B(x) = W2 · W1[x]`.
#[derive(Debug)]
pub struct MarkovHead {
    /// `markov_head.w1.weight`: `[vocab][rank]` (an embedding).
    pub w1: Weight,
    /// `markov_head.w2.weight`: `[vocab][rank]` (`nn.Linear(rank, vocab)`).
    pub w2: Weight,
}

impl MarkovHead {
    /// The low rank r.
    pub fn rank(&self) -> usize {
        self.w1.cols()
    }

    /// The head on `b`.
    pub fn to_backend(&self, b: &Backend) -> Result<Self, ModelError> {
        Ok(Self {
            w1: b.weight(self.w1.host("to_backend", "markov_head.w1")?)?,
            w2: b.weight(self.w2.host("to_backend", "markov_head.w2")?)?,
        })
    }
}

/// `c = σ(wᵀ[h ; e] + b)`.
#[derive(Debug)]
pub struct ConfidenceHead {
    /// `confidence_head.weight`, flattened: `hidden + rank` entries.
    pub w: Tensor,
    /// `confidence_head.bias`.
    pub b: f32,
}

impl ConfidenceHead {
    /// The head on `b`.
    pub fn to_backend(&self, b: &Backend) -> Result<Self, ModelError> {
        Ok(Self {
            w: b.upload(self.w.host("to_backend", "confidence_head.weight")?)?,
            b: self.b,
        })
    }
}
