//! `--load-format dummy` (vLLM's name): a model with a checkpoint's shapes and seeded random
//! weights, for benchmarks and tests of models whose weights a machine does not have.
//!
//! [`DummyWeights`] answers the same requests a checkpoint does ([`TensorSource`]), so a dummy
//! model is built by the one loader ([`DeepseekModel::from_source`](crate::deepseek::DeepseekModel::from_source))
//! from `config.json` alone: every weight matrix uniform in `±sqrt(3 / cols)` (unit variance per
//! output, so activations stay bounded through the layers) as bf16, norm weights 1, routing
//! correction biases 0. Values depend only on the seed and the tensor's name, so two processes
//! (a prefill and a decode worker) with the same seed hold the same model. A CUDA engine draws
//! its dummy weights on the device instead (`DeepseekModel::random`), since a large model's
//! weights would take minutes to draw and upload from the host.

use ferry_kernels::cpu::gemm::Matrix;
use half::bf16;
use rayon::prelude::*;

use crate::error::ModelError;
use crate::weights::TensorSource;

/// The seed every command uses unless told otherwise (`--dummy-seed`).
pub const DEFAULT_SEED: u64 = 0;

/// How an engine gets its weights (`--load-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// The checkpoint in the model directory.
    #[default]
    Auto,
    /// `config.json` only, seeded random weights ([`DummyWeights`] on the host, drawn on the
    /// device by a CUDA engine).
    Dummy {
        /// The weights' seed.
        seed: u64,
    },
}

/// What an engine is started from: a model already built, or a config whose dummy weights the
/// engine draws where the model will live.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one value per engine start, moved once
pub enum ModelSource {
    /// A model on the host (loaded or built).
    Model(crate::deepseek::DeepseekModel),
    /// `config` with seeded random weights.
    Dummy {
        /// The model's config.
        config: crate::config::ModelConfig,
        /// The weights' seed.
        seed: u64,
    },
}

impl ModelSource {
    /// The model's config.
    pub fn config(&self) -> &crate::config::ModelConfig {
        match self {
            ModelSource::Model(m) => m.config(),
            ModelSource::Dummy { config, .. } => config,
        }
    }

    /// The model on the host: as it is, or with its dummy weights drawn there.
    pub fn into_host(self) -> Result<crate::deepseek::DeepseekModel, ModelError> {
        match self {
            ModelSource::Model(m) => Ok(m),
            ModelSource::Dummy { config, seed } => {
                crate::deepseek::DeepseekModel::from_source(config, &DummyWeights::new(seed))
            }
        }
    }
}

/// Seeded random tensors of whatever shape is asked (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct DummyWeights {
    seed: u64,
}

impl DummyWeights {
    /// Tensors drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// `n` values uniform in `±scale` from the stream of `name`.
    fn uniform(&self, name: &str, n: usize, scale: f32) -> Vec<f32> {
        let base = splitmix(self.seed ^ fnv1a(name));
        (0..n)
            .into_par_iter()
            .map(|i| {
                let bits = splitmix(base.wrapping_add(i as u64));
                // 24 random bits → [-1, 1).
                let u = (bits >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                u * scale
            })
            .collect()
    }
}

impl TensorSource for DummyWeights {
    fn get_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let n = expected_shape.iter().product();
        Ok(
            if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
                vec![1.0; n]
            } else if name.ends_with("e_score_correction_bias") {
                vec![0.0; n]
            } else {
                let cols = expected_shape.last().copied().unwrap_or(1).max(1);
                self.uniform(name, n, (3.0 / cols as f32).sqrt())
            },
        )
    }

    fn get_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let values = self.uniform(name, rows * cols, (3.0 / cols.max(1) as f32).sqrt());
        let values: Vec<bf16> = values.into_par_iter().map(bf16::from_f32).collect();
        Ok(Matrix::from_bf16(rows, cols, values)?)
    }
}

/// SplitMix64's finaliser.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a over a tensor name: each tensor its own stream.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_depend_on_seed_and_name_only_and_are_bounded() {
        let (a, b) = (DummyWeights::new(7), DummyWeights::new(8));
        let x = a
            .get_f32("model.layers.0.mlp.gate.weight", &[4, 64])
            .unwrap();
        assert_eq!(
            x,
            a.get_f32("model.layers.0.mlp.gate.weight", &[4, 64])
                .unwrap()
        );
        assert_ne!(
            x,
            b.get_f32("model.layers.0.mlp.gate.weight", &[4, 64])
                .unwrap()
        );
        assert_ne!(
            x,
            a.get_f32("model.layers.1.mlp.gate.weight", &[4, 64])
                .unwrap()
        );
        let bound = (3.0f32 / 64.0).sqrt();
        assert!(x.iter().all(|v| v.abs() <= bound));
        let mean = x.iter().sum::<f32>() / x.len() as f32;
        let var = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        assert!(
            mean.abs() < 0.05 && (var * 64.0 - 1.0).abs() < 0.3,
            "{mean} {var}"
        );
        assert_eq!(
            a.get_f32("model.layers.3.input_layernorm.weight", &[8])
                .unwrap(),
            vec![1.0; 8]
        );
        assert_eq!(
            a.get_f32("model.layers.3.mlp.gate.e_score_correction_bias", &[4])
                .unwrap(),
            vec![0.0; 4]
        );
        let m = a.get_matrix("lm_head.weight", 3, 5).unwrap();
        assert_eq!((m.rows(), m.cols()), (3, 5));
    }
}
