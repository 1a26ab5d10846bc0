//! The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))` (HF `DeepseekV3MLP`).

use super::gemm::{check_len, linear, Matrix};
use crate::error::KernelError;

/// A gated MLP: dense layers, routed experts and shared experts all use it.
#[derive(Debug, Clone, PartialEq)]
pub struct GatedMlp {
    /// `[intermediate][hidden]`.
    pub gate: Matrix,
    /// `[intermediate][hidden]`.
    pub up: Matrix,
    /// `[hidden][intermediate]`.
    pub down: Matrix,
}

impl GatedMlp {
    /// Builds the block, checking that the three weights agree on `hidden` and `intermediate`.
    pub fn new(gate: Matrix, up: Matrix, down: Matrix) -> Result<Self, KernelError> {
        let mlp = Self { gate, up, down };
        mlp.check_shapes()?;
        Ok(mlp)
    }

    /// Model width (input and output features).
    pub fn hidden(&self) -> usize {
        self.gate.cols()
    }

    /// Width of the gated activation.
    pub fn intermediate(&self) -> usize {
        self.gate.rows()
    }

    /// `out[m][hidden] = down(silu(gate(x)) * up(x))` for `x[m][hidden]`.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
        self.check_shapes()?;
        let hidden = self.hidden();
        if x.len() % hidden != 0 {
            return Err(KernelError::NotDivisible {
                op: "gated_mlp",
                what: "x",
                len: x.len(),
                width: hidden,
            });
        }
        let m = x.len() / hidden;
        check_len("gated_mlp", "out", m * hidden, out.len())?;
        let inter = self.intermediate();
        let mut g = vec![0.0f32; m * inter];
        let mut u = vec![0.0f32; m * inter];
        linear(x, &self.gate, &mut g)?;
        linear(x, &self.up, &mut u)?;
        silu_mul(&mut g, &u)?;
        linear(&g, &self.down, out)
    }

    fn check_shapes(&self) -> Result<(), KernelError> {
        let (inter, hidden) = (self.gate.rows(), self.gate.cols());
        check_len("gated_mlp", "up.rows", inter, self.up.rows())?;
        check_len("gated_mlp", "up.cols", hidden, self.up.cols())?;
        check_len("gated_mlp", "down.rows", hidden, self.down.rows())?;
        check_len("gated_mlp", "down.cols", inter, self.down.cols())?;
        if hidden == 0 {
            return Err(KernelError::InvalidParam {
                op: "gated_mlp",
                field: "hidden",
                limit: "> 0",
                value: "0".into(),
            });
        }
        Ok(())
    }
}

/// `silu(v) = v / (1 + exp(-v))`, evaluated as torch's CPU kernel does.
pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    check_len("silu_mul", "up", gate.len(), up.len())?;
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        // f32 exp and division: a couple of ulp.
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((silu(-2.0) - (-0.238_405_84)).abs() < 1e-6);
        assert!(silu_mul(&mut [1.0, 2.0], &[1.0]).is_err());
    }

    #[test]
    fn forward_matches_composition() {
        let m = |r, c, v: Vec<f32>| Matrix::from_f32(r, c, v).expect("len matches");
        let mlp = GatedMlp::new(
            m(2, 3, vec![0.1, -0.2, 0.3, 0.5, 0.4, -0.1]),
            m(2, 3, vec![1.0, 0.0, -1.0, 0.5, 0.5, 0.5]),
            m(3, 2, vec![1.0, 2.0, -1.0, 0.5, 0.0, 1.0]),
        )
        .expect("consistent shapes");
        let x = [1.0f32, 2.0, 3.0];
        let g = [0.1 - 0.4 + 0.9, 0.5 + 0.8 - 0.3];
        let u = [1.0 - 3.0, 0.5 + 1.0 + 1.5];
        let a = [silu(g[0]) * u[0], silu(g[1]) * u[1]];
        let want = [a[0] + 2.0 * a[1], -a[0] + 0.5 * a[1], a[1]];
        let mut out = [0.0f32; 3];
        mlp.forward(&x, &mut out).expect("shapes match");
        for (o, w) in out.iter().zip(want) {
            // Three-term f32 dot products: a few ulp.
            assert!((o - w).abs() < 1e-5, "{o} vs {w}");
        }
        assert!(GatedMlp::new(
            m(2, 3, vec![0.0; 6]),
            m(2, 2, vec![0.0; 4]),
            m(3, 2, vec![0.0; 6])
        )
        .is_err());
    }
}
