//! Typed launchers for `gpu/common.cu`, and the device-resident weight type, generic over the
//! runtime ([`Gpu`]: CUDA or ROCm). The same launches on both, except the large GEMM behind
//! [`linear`] ([`Gpu::gemm`]); [`gemm_tiled`] is the portable one.
//!
//! Every launcher checks that each buffer holds what the kernel will index before launching;
//! buffers are passed as [`Dv`] views (address + length) so callers can hand in sub-ranges.

use std::ops::Range;

use half::bf16;

pub use super::launch::Dv;
use super::launch::{DeviceMem, Gpu, KernelArgs, KernelParam, LaunchDims};
use crate::cpu::gemm::{Matrix, MatrixData};
use crate::error::{c_int as int, KernelError};
use crate::gpu::{Defines, Source};

/// Largest row count served by the GEMV kernel (decode); more rows go through the runtime's
/// large GEMM ([`Gpu::gemm`]), or up to [`GEMV_MMA_MAX_M`] through [`gemv_mma`] where it fits.
pub const GEMV_MAX_M: usize = 8;

/// Largest row count [`gemv_mma`] (the tensor-core skinny GEMM) takes: one m16 tile.
pub const GEMV_MMA_MAX_M: usize = 16;

/// `got >= needed`, or a shape error naming the buffer.
pub(crate) fn need(
    op: &'static str,
    what: &'static str,
    needed: usize,
    got: usize,
) -> Result<(), KernelError> {
    if got >= needed {
        Ok(())
    } else {
        Err(KernelError::ShapeMismatch {
            op,
            what,
            expected: needed,
            got,
        })
    }
}

/// Storage of a [`GpuMatrix`] on the runtime `D`.
#[derive(Debug)]
pub enum GpuMatrixData<D: Gpu> {
    /// f32 weights.
    F32(D::Buffer<f32>),
    /// bf16 weights (raw bits).
    Bf16(D::Buffer<u16>),
}

/// A row-major `[rows][cols]` weight in device memory (torch `nn.Linear.weight` layout) of the
/// runtime `D`.
#[derive(Debug)]
pub struct GpuMatrix<D: Gpu> {
    rows: usize,
    cols: usize,
    data: GpuMatrixData<D>,
}

impl<D: Gpu> GpuMatrix<D> {
    /// Uploads a CPU [`Matrix`], keeping its element type.
    pub fn upload(dev: &D, m: &Matrix) -> Result<Self, KernelError> {
        let data = match m.data() {
            MatrixData::F32(d) => GpuMatrixData::F32(dev.upload(d)?),
            MatrixData::Bf16(d) => GpuMatrixData::Bf16(dev.upload(&bf16_bits(d))?),
        };
        Ok(Self {
            rows: m.rows(),
            cols: m.cols(),
            data,
        })
    }

    /// Wraps device data; its length must be `rows · cols`.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        data: GpuMatrixData<D>,
    ) -> Result<Self, KernelError> {
        let len = match &data {
            GpuMatrixData::F32(b) => b.v().len,
            GpuMatrixData::Bf16(b) => b.v().len,
        };
        crate::cpu::gemm::check_len("gpu_matrix", "data", rows * cols, len)?;
        Ok(Self { rows, cols, data })
    }

    /// Deterministic pseudo-random bf16 weights uniform in `[-scale, scale)` (benchmarks).
    pub fn random_bf16(
        dev: &D,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> Result<Self, KernelError> {
        let buf = dev.alloc::<u16>(rows * cols)?;
        fill_random_bf16(dev, buf.v(), seed, scale)?;
        Self::from_parts(rows, cols, GpuMatrixData::Bf16(buf))
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether the elements are bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, GpuMatrixData::Bf16(_))
    }

    /// The device data.
    pub fn data(&self) -> &GpuMatrixData<D> {
        &self.data
    }

    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        match &self.data {
            GpuMatrixData::F32(b) => b.ptr(),
            GpuMatrixData::Bf16(b) => b.ptr(),
        }
    }

    /// Bytes of weight data.
    pub fn bytes(&self) -> usize {
        match &self.data {
            GpuMatrixData::F32(b) => b.bytes(),
            GpuMatrixData::Bf16(b) => b.bytes(),
        }
    }

    /// The kernel-name suffix of the element type.
    pub(crate) fn suffix(&self) -> &'static str {
        if self.is_bf16() {
            "bf16"
        } else {
            "f32"
        }
    }
}

/// bf16 values as raw bits.
pub fn bf16_bits(d: &[bf16]) -> Vec<u16> {
    d.iter().map(|v| v.to_bits()).collect()
}

fn kernel<D: Gpu>(dev: &D, name: &'static str) -> Result<D::Function, KernelError> {
    dev.function(Source::Common, &Defines::new(), name)
}

/// How large GEMMs against bf16 weights treat the f32 activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmPrecision {
    /// Activations split into bf16 hi + lo (two tensor-core GEMMs): ~16 mantissa bits, within
    /// rounding of the CPU backend's f32 products.
    #[default]
    Exact,
    /// Activations rounded to bf16 (one GEMM): the production trade-off.
    Fast,
}

/// Where a large GEMM's product goes: written over `out`, or added into it.
#[derive(Debug, Clone, Copy)]
pub struct GemmOut {
    /// `[m][n]` output.
    pub out: Dv<f32>,
    /// Add into `out` (cuBLAS's beta = 1) instead of writing over it.
    pub accumulate: bool,
}

/// `out[m][n] = x[m][k] · Wᵀ` (`m = x.len / k`): one row by the GEMV; 2–16 rows by the
/// tensor-core skinny GEMM where it fits ([`gemv_mma_fits`]); else up to 8 rows by the GEMV and
/// more by the runtime's large GEMM ([`Gpu::gemm`]: cuBLAS on CUDA, [`gemm_tiled`] on ROCm).
pub fn linear<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    w: &GpuMatrix<D>,
    out: Dv<f32>,
    precision: GemmPrecision,
) -> Result<(), KernelError> {
    let out = GemmOut {
        out,
        accumulate: false,
    };
    project(dev, x, w, out, precision)
}

/// `out[m][n] += x[m][k] · Wᵀ`: [`linear`] adding into `out` (the GEMV's and the large GEMM's
/// accumulate mode; no separate add).
pub fn linear_add<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    w: &GpuMatrix<D>,
    out: Dv<f32>,
    precision: GemmPrecision,
) -> Result<(), KernelError> {
    let out = GemmOut {
        out,
        accumulate: true,
    };
    project(dev, x, w, out, precision)
}

/// [`linear`] and [`linear_add`]: the shape checks, then the GEMV or the large GEMM.
fn project<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    w: &GpuMatrix<D>,
    out: GemmOut,
    precision: GemmPrecision,
) -> Result<(), KernelError> {
    let op = if out.accumulate {
        "gpu_linear_add"
    } else {
        "gpu_linear"
    };
    let (n, k) = (w.rows, w.cols);
    if k == 0 || x.len % k != 0 {
        return Err(KernelError::NotDivisible {
            op,
            what: "x",
            len: x.len,
            width: k,
        });
    }
    let m = x.len / k;
    need(op, "out", m * n, out.out.len)?;
    if m == 0 {
        return Ok(());
    }
    if gemv_mma_fits(dev, m, x, w) {
        return gemv_mma(dev, x, (w, out.out), None, out.accumulate);
    }
    if m <= GEMV_MAX_M {
        return gemv(dev, x, w, out.out, out.accumulate);
    }
    dev.gemm(x, w, out, precision)
}

/// `FERRY_GEMV_MMA`: `0` turns [`gemv_mma`] off, giving the rule before session 36 (the GEMV up
/// to 8 rows, the large GEMM above) for A/B runs; anything else, or unset, leaves it on.
fn gemv_mma_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_GEMV_MMA").map_or(true, |v| v.trim() != "0"))
}

/// Whether [`gemv_mma`] takes `m` rows of `x` against `w` on `dev`: 2–16 rows (one row stays on
/// the GEMV, bitwise the decode step it has always been), bf16 weights whose width is a
/// multiple of 32, 16-byte-aligned rows, and tensor cores (CUDA sm_80+; not ROCm's builds).
pub fn gemv_mma_fits<D: Gpu>(dev: &D, m: usize, x: Dv<f32>, w: &GpuMatrix<D>) -> bool {
    D::TENSOR_CORES
        && (2..=GEMV_MMA_MAX_M).contains(&m)
        && w.is_bf16()
        && w.cols % 32 == 0
        && x.ptr % 16 == 0
        && gemv_mma_on()
        && dev.compute_capability() >= (8, 0)
}

/// `out1 (+)= x · W1ᵀ` (and, with `second`, `out2 (+)= x · W2ᵀ` in the same launch) for 2–16
/// rows of `x` on tensor cores (`gemv_mma_bf16` in `common.cu`): what [`gemv_mma_fits`] admits;
/// with a second matrix, `W1`'s rows must be a multiple of 8 and both widths equal. Each row's
/// result is independent of the other rows and of their count (a speculative round's verify
/// rows project alike whatever the round's length), but not bitwise the one-row GEMV's: `x`
/// enters as bf16 hi + lo (~16 mantissa bits, as exact-mode cuBLAS takes it).
pub fn gemv_mma<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    (w1, out1): (&GpuMatrix<D>, Dv<f32>),
    second: Option<(&GpuMatrix<D>, Dv<f32>)>,
    accumulate: bool,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_gemv_mma";
    let k = w1.cols;
    let m = x.len / k.max(1);
    if !gemv_mma_fits(dev, m, x, w1) || m * k != x.len {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "x rows",
            limit: "2..=16 rows, bf16 weights of a width that is a multiple of 32, tensor cores",
            value: format!("{} / {k}", x.len),
        });
    }
    need(OP, "out1", m * w1.rows, out1.len)?;
    let (w2, out2, n2) = match second {
        Some((w2, out2)) => {
            if w2.cols != k || !w2.is_bf16() || w1.rows % 8 != 0 {
                return Err(KernelError::InvalidParam {
                    op: OP,
                    field: "w2",
                    limit: "bf16, the width of w1, w1's rows a multiple of 8",
                    value: format!("{} columns (w1: {k} x {})", w2.cols, w1.rows),
                });
            }
            need(OP, "out2", m * w2.rows, out2.len)?;
            (w2.ptr(), out2.ptr, w2.rows)
        }
        None => (0, 0, 0),
    };
    let f = kernel(dev, "gemv_mma_bf16")?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(int(OP, "m", m)?)
        .push(w1.ptr())
        .push(int(OP, "n1", w1.rows)?)
        .push(out1.ptr)
        .push(w2)
        .push(int(OP, "n2", n2)?)
        .push(out2)
        .push(int(OP, "k", k)?)
        .push(i32::from(accumulate));
    let blocks = w1.rows.div_ceil(8) + n2.div_ceil(8);
    dev.launch(&f, LaunchDims::linear(blocks, 256), &mut a)
}

/// Rows and columns of one output tile of [`gemm_tiled`] (`GT_M` = `GT_N` in `common.cu`).
pub const GEMM_TILE: usize = 64;

/// `out[m][n] (+)= x[m][k] · Wᵀ` by the portable tiled kernel (`gemm_tiled_{f32,bf16}` in
/// `common.cu`): f32 activations, f32 or bf16 weights (widened exactly), f32 accumulation in
/// order of `k` — the CPU's f32 products within summation rounding, for any `m`. One block of
/// 256 threads per 64 × 64 output tile, 16-deep `k` steps through shared memory; no tensor
/// cores, no PTX. ROCm's large GEMM (there is no hipBLAS binding); CUDA keeps cuBLAS and runs
/// this only in its contract tests.
pub fn gemm_tiled<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    w: &GpuMatrix<D>,
    out: Dv<f32>,
    accumulate: bool,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_gemm_tiled";
    let (n, k) = (w.rows, w.cols);
    if k == 0 || x.len % k != 0 {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "x",
            len: x.len,
            width: k,
        });
    }
    let m = x.len / k;
    need(OP, "out", m * n, out.len)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (gx, gy) = (n.div_ceil(GEMM_TILE), m.div_ceil(GEMM_TILE));
    if gy > 65_535 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "x rows",
            limit: "<= 65535 · 64",
            value: m.to_string(),
        });
    }
    let name = if w.is_bf16() {
        "gemm_tiled_bf16"
    } else {
        "gemm_tiled_f32"
    };
    let f = kernel(dev, name)?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(w.ptr())
        .push(out.ptr)
        .push(int(OP, "m", m)?)
        .push(int(OP, "n", n)?)
        .push(int(OP, "k", k)?)
        .push(i32::from(accumulate));
    let dims = LaunchDims {
        grid: (int(OP, "column tiles", gx)? as u32, gy as u32, 1),
        block: (256, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)
}

/// The GEMV kernel alone: `out (+)= x · Wᵀ` for `x.len / k <= 8` rows.
pub fn gemv<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    w: &GpuMatrix<D>,
    out: Dv<f32>,
    accumulate: bool,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_gemv";
    let (n, k) = (w.rows, w.cols);
    let m = x.len / k.max(1);
    if m > GEMV_MAX_M || m * k != x.len {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "x rows",
            limit: "a whole number <= 8",
            value: format!("{} / {k}", x.len),
        });
    }
    need(OP, "out", m * n, out.len)?;
    let f = kernel(dev, if w.is_bf16() { "gemv_bf16" } else { "gemv_f32" })?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(int(OP, "m", m)?)
        .push(w.ptr())
        .push(int(OP, "n", n)?)
        .push(int(OP, "k", k)?)
        .push(out.ptr)
        .push(i32::from(accumulate));
    dev.launch(&f, LaunchDims::linear(n.div_ceil(8), 256), &mut a)
}

/// Two projections of the same `x` (`m <= 8` rows, equal input width and element type) in one
/// GEMV launch (`gemv_pair_*`): `out1 = x · W1ᵀ`, `out2 = x · W2ᵀ`, bitwise what two [`gemv`]
/// launches give. An attention layer's first query projection and `kv_a` (see
/// [`crate::backend::linear::linear_pair`]).
pub fn gemv_pair<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    (w1, out1): (&GpuMatrix<D>, Dv<f32>),
    (w2, out2): (&GpuMatrix<D>, Dv<f32>),
) -> Result<(), KernelError> {
    const OP: &str = "gpu_gemv_pair";
    let k = w1.cols;
    if w2.cols != k || w1.is_bf16() != w2.is_bf16() {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "w2",
            limit: "the input width and element type of w1",
            value: format!("{} columns (w1: {k})", w2.cols),
        });
    }
    let m = x.len / k.max(1);
    if m > GEMV_MAX_M || m * k != x.len {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "x rows",
            limit: "a whole number <= 8",
            value: format!("{} / {k}", x.len),
        });
    }
    need(OP, "out1", m * w1.rows, out1.len)?;
    need(OP, "out2", m * w2.rows, out2.len)?;
    let f = kernel(
        dev,
        if w1.is_bf16() {
            "gemv_pair_bf16"
        } else {
            "gemv_pair_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(int(OP, "m", m)?)
        .push(w1.ptr())
        .push(int(OP, "n1", w1.rows)?)
        .push(out1.ptr)
        .push(w2.ptr())
        .push(int(OP, "n2", w2.rows)?)
        .push(out2.ptr)
        .push(int(OP, "k", k)?);
    dev.launch(
        &f,
        LaunchDims::linear((w1.rows + w2.rows).div_ceil(8), 256),
        &mut a,
    )
}

/// `out[t] = table[ids[t]]` (f32); an id outside the table gives a zero row.
pub fn embed<D: Gpu>(
    dev: &D,
    table: &GpuMatrix<D>,
    ids: Dv<i32>,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    need("gpu_embed", "out", ids.len * table.cols, out.len)?;
    if ids.len == 0 {
        return Ok(());
    }
    let f = kernel(
        dev,
        if table.is_bf16() {
            "embed_bf16"
        } else {
            "embed_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(table.ptr())
        .push(ids.ptr)
        .push(out.ptr)
        .push(int("gpu_embed", "hidden", table.cols)?)
        .push(int("gpu_embed", "rows", table.rows)?);
    dev.launch(&f, LaunchDims::linear(ids.len, 256), &mut a)
}

/// Rows of `width` floats: residual add then RMSNorm.
#[derive(Debug, Clone, Copy)]
pub struct NormRows {
    /// The residual stream `[rows][width]`, updated in place when `delta` is given.
    pub h: Dv<f32>,
    /// Added into `h` first, if any.
    pub delta: Option<Dv<f32>>,
    /// Norm weight `[width]`.
    pub weight: Dv<f32>,
    /// Normalised output `[rows][width]`, if wanted.
    pub out: Option<Dv<f32>>,
    /// Row width.
    pub width: usize,
}

/// `h += delta` (if any), then `out = rmsnorm(h) · weight` (if any).
pub fn add_rms_norm<D: Gpu>(dev: &D, p: NormRows, eps: f32) -> Result<(), KernelError> {
    const OP: &str = "gpu_add_rms_norm";
    let rows = p.h.len / p.width.max(1);
    need(OP, "weight", p.width, p.weight.len)?;
    for (what, b) in [("delta", p.delta), ("out", p.out)] {
        if let Some(b) = b {
            need(OP, what, p.h.len, b.len)?;
        }
    }
    if rows == 0 {
        return Ok(());
    }
    let f = kernel(dev, "add_rms_norm")?;
    let mut a = KernelArgs::new();
    a.push(p.h.ptr)
        .push(p.delta.map_or(0, |d| d.ptr))
        .push(p.weight.ptr)
        .push(p.out.map_or(0, |d| d.ptr))
        .push(int(OP, "width", p.width)?)
        .push(eps);
    // Enough threads that the row fits the kernel's registers (4 float4 per thread).
    let threads = match p.width / 4 {
        0..=1024 => 256,
        1025..=2048 => 512,
        _ => 1024,
    };
    dev.launch(&f, LaunchDims::linear(rows, threads), &mut a)
}

/// In-place RMSNorm of the first `weight.len` floats of each `stride`-float row of `x`.
pub fn rms_norm_strided<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    stride: usize,
    weight: Dv<f32>,
    eps: f32,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_rms_norm_strided";
    let rows = x.len / stride.max(1);
    need(OP, "stride", weight.len, stride)?;
    if rows == 0 {
        return Ok(());
    }
    let f = kernel(dev, "rms_norm_strided")?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(int(OP, "stride", stride)?)
        .push(weight.ptr)
        .push(int(OP, "width", weight.len)?)
        .push(eps);
    dev.launch(&f, LaunchDims::linear(rows, 256), &mut a)
}

/// Per-token rotary tables: `[tokens][dim/2]` cos and sin, computed on the host exactly as the
/// CPU backend computes them, then uploaded.
#[derive(Debug)]
pub struct RopeTables<D: Gpu> {
    /// cos · attention factor.
    pub cos: D::Buffer<f32>,
    /// sin · attention factor.
    pub sin: D::Buffer<f32>,
    /// Rotated width.
    pub dim: usize,
    /// DeepSeek's interleaved pair layout.
    pub interleaved: bool,
}

impl<D: Gpu> RopeTables<D> {
    /// Host `(cos, sin)` for `positions`, `[tokens][dim/2]` each.
    pub fn host(
        rope: &crate::cpu::rope::Rope,
        positions: &[usize],
    ) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let half = rope.dim() / 2;
        let mut cos = vec![0.0f32; positions.len() * half];
        let mut sin = vec![0.0f32; positions.len() * half];
        for (i, &p) in positions.iter().enumerate() {
            rope.cos_sin(
                p,
                &mut cos[i * half..(i + 1) * half],
                &mut sin[i * half..(i + 1) * half],
            )?;
        }
        Ok((cos, sin))
    }

    /// Overwrites the tables in place for as many `positions` as they hold.
    pub fn refresh(
        &mut self,
        dev: &D,
        rope: &crate::cpu::rope::Rope,
        positions: &[usize],
    ) -> Result<(), KernelError> {
        let (cos, sin) = Self::host(rope, positions)?;
        dev.write(&mut self.cos, 0, &cos)?;
        dev.write(&mut self.sin, 0, &sin)
    }

    /// Tables for `positions`.
    pub fn new(
        dev: &D,
        rope: &crate::cpu::rope::Rope,
        positions: &[usize],
    ) -> Result<Self, KernelError> {
        let (cos, sin) = Self::host(rope, positions)?;
        Ok(Self {
            cos: dev.upload(&cos)?,
            sin: dev.upload(&sin)?,
            dim: rope.dim(),
            interleaved: rope.interleaved(),
        })
    }

    /// Tokens covered.
    pub fn tokens(&self) -> usize {
        self.cos.v().len / (self.dim / 2).max(1)
    }
}

/// Rotates `x[t][h][offset..offset + dim]` in place (`layout` as on the CPU).
pub fn rope<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    tables: &RopeTables<D>,
    layout: crate::cpu::rope::RotaryLayout,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_rope";
    let t = tables.tokens();
    need(OP, "x", t * layout.heads * layout.head_stride, x.len)?;
    need(
        OP,
        "head_stride",
        layout.offset + tables.dim,
        layout.head_stride,
    )?;
    if t == 0 || layout.heads == 0 {
        return Ok(());
    }
    let f = kernel(dev, "rope_apply")?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(tables.cos.ptr())
        .push(tables.sin.ptr())
        .push(int(OP, "heads", layout.heads)?)
        .push(int(OP, "head_stride", layout.head_stride)?)
        .push(int(OP, "offset", layout.offset)?)
        .push(int(OP, "dim", tables.dim)?)
        .push(i32::from(tables.interleaved));
    let dims = LaunchDims {
        grid: (t as u32, layout.heads as u32, 1),
        block: ((tables.dim / 2).max(32) as u32, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)
}

/// A paged latent cache of one layer in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagesView {
    /// Device address of block 0.
    pub ptr: u64,
    /// Element type of the cache.
    pub bf16: bool,
    /// Blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Logical elements per token row.
    pub width: usize,
    /// Trailing elements of each row stored as a bf16 hi/lo pair after it (the fast-mode MLA
    /// cache's RoPE key, `[latent | hi | lo]`; 0 = plain rows). Only bf16 pages split.
    pub split: usize,
}

impl PagesView {
    /// Rows in the pool.
    pub fn slots(&self) -> usize {
        self.num_blocks * self.page_size
    }

    /// Stored elements per row (`width + split`): the row stride.
    pub fn row(&self) -> usize {
        self.width + self.split
    }
}

/// The new tokens' latent rows after `kv_a_proj`: normalise, rotate, store.
#[derive(Debug)]
pub struct LatentFinish<'a, D: Gpu> {
    /// `[tokens][width]` raw latent rows (normalised and rotated in place).
    pub latent: Dv<f32>,
    /// `kv_a_layernorm` weight `[kv_lora]`.
    pub norm: Dv<f32>,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Rotary tables of the tokens.
    pub rope: &'a RopeTables<D>,
    /// Cache row of each token (`block · page_size + offset`).
    pub slots: Dv<i64>,
    /// The queries `[tokens][heads · head_stride]` whose rope parts the same launch rotates
    /// (what [`rope`] does), if any.
    pub queries: Option<(Dv<f32>, crate::cpu::rope::RotaryLayout)>,
}

impl<D: Gpu> Clone for LatentFinish<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: Gpu> Copy for LatentFinish<'_, D> {}

/// Normalises `c_kv`, rotates `k_pe` and writes each token's row into `pages`; with
/// `queries`, rotates their rope parts in the same launch (a rope dim above 512 takes a
/// separate [`rope`] launch).
pub fn latent_finish<D: Gpu>(
    dev: &D,
    p: &LatentFinish<'_, D>,
    pages: PagesView,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_latent_finish";
    let width = pages.width;
    check_split(OP, &pages, p.rope.dim)?;
    let t = p.slots.len;
    need(OP, "latent", t * width, p.latent.len)?;
    need(OP, "rope tokens", t, p.rope.tokens())?;
    let kv_lora = p.norm.len;
    if kv_lora + p.rope.dim != width || p.rope.dim > 1024 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "kv_lora + rope dim",
            limit: "== pages.width (rope dim <= 1024)",
            value: format!("{kv_lora} + {}", p.rope.dim),
        });
    }
    if t == 0 {
        return Ok(());
    }
    let mut queries = p.queries;
    if let Some((q, layout)) = queries {
        need(OP, "queries", t * layout.heads * layout.head_stride, q.len)?;
        need(
            OP,
            "queries head_stride",
            layout.offset + p.rope.dim,
            layout.head_stride,
        )?;
        if p.rope.dim > 512 || layout.heads == 0 {
            rope(dev, q, p.rope, layout)?;
            queries = None;
        }
    }
    let f = kernel(
        dev,
        if pages.bf16 {
            "latent_finish_bf16"
        } else {
            "latent_finish_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(p.latent.ptr)
        .push(int(OP, "width", width)?)
        .push(int(OP, "kv_lora", kv_lora)?)
        .push(p.norm.ptr)
        .push(p.eps)
        .push(p.rope.cos.ptr())
        .push(p.rope.sin.ptr())
        .push(i32::from(p.rope.interleaved))
        .push(p.slots.ptr)
        .push(pages.ptr);
    if pages.bf16 {
        a.push(int(OP, "split", pages.split)?);
    }
    let heads = match queries {
        Some((q, layout)) => {
            a.push(q.ptr)
                .push(int(OP, "queries head_stride", layout.head_stride)?)
                .push(int(OP, "queries offset", layout.offset)?)
                .push(int(OP, "queries heads", layout.heads)?);
            layout.heads
        }
        None => {
            a.push(0u64).push(0i32).push(0i32).push(0i32);
            0
        }
    };
    // A thread per rotated pair, whole heads to a block (the kernel's barrier orders a head's
    // reads before its writes); the rope dim is at most 512, so at least one head fits.
    const THREADS: usize = 256;
    let heads_per_block = (THREADS / (p.rope.dim / 2).max(1)).max(1);
    let dims = LaunchDims {
        grid: (
            int(OP, "tokens", t)? as u32,
            1 + int(OP, "queries blocks", heads.div_ceil(heads_per_block))? as u32,
            1,
        ),
        block: (THREADS as u32, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)
}

/// A split cache keeps exactly its rows' rope part as pairs, and only bf16 pages split.
fn check_split(op: &'static str, pages: &PagesView, rope: usize) -> Result<(), KernelError> {
    if pages.split == 0 || (pages.bf16 && pages.split == rope) {
        return Ok(());
    }
    Err(KernelError::InvalidParam {
        op,
        field: "pages.split",
        limit: "0, or the rope dim on bf16 pages",
        value: format!("{} (rope {rope}, bf16 {})", pages.split, pages.bf16),
    })
}

fn elementwise<D: Gpu>(
    dev: &D,
    name: &'static str,
    ptrs: &[u64],
    n: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    let f = kernel(dev, name)?;
    let mut a = KernelArgs::new();
    for &p in ptrs {
        a.push(p);
    }
    a.push(n as i64);
    dev.launch(&f, LaunchDims::elementwise(n), &mut a)
}

/// `g = silu(g) · u`.
pub fn silu_mul<D: Gpu>(dev: &D, g: Dv<f32>, u: Dv<f32>) -> Result<(), KernelError> {
    need("gpu_silu_mul", "u", g.len, u.len)?;
    elementwise(dev, "silu_mul", &[g.ptr, u.ptr], g.len)
}

/// `out = bf16(x)` (round to nearest even).
pub fn cast_f32_bf16<D: Gpu>(dev: &D, x: Dv<f32>, out: Dv<u16>) -> Result<(), KernelError> {
    need("gpu_cast", "out", x.len, out.len)?;
    elementwise(dev, "cast_f32_bf16", &[x.ptr, out.ptr], x.len)
}

/// Rows of `width` f32 → bf16 rows `[x[..width − split] | hi | hi | lo]` of `width + 2·split`
/// (a split query's RoPE part as the bf16 pairs the MHA kernels take; `gpu/mla.cu`'s top
/// comment); `split` 0 is [`cast_f32_bf16`].
pub fn split_pe_bf16<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    width: usize,
    split: usize,
    out: Dv<u16>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_split_pe_bf16";
    if split == 0 {
        return cast_f32_bf16(dev, x, out);
    }
    if width == 0 || split > width || x.len % width != 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "width / split",
            limit: "0 < split <= width, whole rows",
            value: format!("{width} / {split}, {} elements", x.len),
        });
    }
    let rows = x.len / width;
    let n = rows * (width + 2 * split);
    need(OP, "out", n, out.len)?;
    if n == 0 {
        return Ok(());
    }
    let f = kernel(dev, "split_pe_bf16")?;
    let mut a = KernelArgs::new();
    a.push(x.ptr)
        .push(out.ptr)
        .push(rows as i64)
        .push(int(OP, "width", width)?)
        .push(int(OP, "split", split)?);
    dev.launch(&f, LaunchDims::elementwise(n), &mut a)
}

/// `x ≈ hi + lo`, both bf16.
pub fn split_bf16<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    hi: Dv<u16>,
    lo: Dv<u16>,
) -> Result<(), KernelError> {
    need("gpu_split_bf16", "hi", x.len, hi.len)?;
    need("gpu_split_bf16", "lo", x.len, lo.len)?;
    elementwise(dev, "split_bf16", &[x.ptr, hi.ptr, lo.ptr], x.len)
}

/// `x`'s rows converted once for several large GEMMs against bf16 weights ([`Gpu::gemm_split`]):
/// rounded to bf16 in fast mode (what [`Gpu::gemm`]'s cast gives), split into bf16 hi then lo
/// rows in exact mode ([`split_bf16`]).
pub fn bf16_rows<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    precision: GemmPrecision,
) -> Result<D::Buffer<u16>, KernelError> {
    match precision {
        GemmPrecision::Fast => {
            let hi = dev.alloc::<u16>(x.len)?;
            cast_f32_bf16(dev, x, hi.v())?;
            Ok(hi)
        }
        GemmPrecision::Exact => {
            let xs = dev.alloc::<u16>(2 * x.len)?;
            split_bf16(dev, x, xs.v().sub(0, x.len)?, xs.v().sub(x.len, x.len)?)?;
            Ok(xs)
        }
    }
}

/// A verify round's drafts put into its token ids on the device: `ids[s·(g+1) + 1 + k] =
/// drafts[k·width + s]` for the first `n` sequences and `g` drafts each (the drafter's
/// step-major output, `width` sequences a block position). Each sequence's anchor row is left
/// as the host wrote it.
pub fn scatter_drafts<D: Gpu>(
    dev: &D,
    drafts: Dv<i32>,
    ids: Dv<i32>,
    (n, g, width): (usize, usize, usize),
) -> Result<(), KernelError> {
    const OP: &str = "gpu_scatter_drafts";
    if width < n {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "width",
            limit: "at least the sequences placed",
            value: format!("{width} (n {n})"),
        });
    }
    need(OP, "ids", n * (g + 1), ids.len)?;
    need(OP, "drafts", g * width, drafts.len)?;
    if n * g == 0 {
        return Ok(());
    }
    let f = kernel(dev, "scatter_drafts")?;
    let mut a = KernelArgs::new();
    a.push(drafts.ptr)
        .push(ids.ptr)
        .push(int(OP, "n", n)?)
        .push(int(OP, "g", g)?)
        .push(int(OP, "width", width)?);
    dev.launch(&f, LaunchDims::linear(n * g, 256), &mut a)
}

/// `out = f32(x)`.
pub fn widen_bf16<D: Gpu>(dev: &D, x: Dv<u16>, out: Dv<f32>) -> Result<(), KernelError> {
    need("gpu_widen", "out", x.len, out.len)?;
    elementwise(dev, "widen_bf16", &[x.ptr, out.ptr], x.len)
}

/// `dst[i] = src[rows[i]]` for rows of `width` floats.
pub fn gather_rows<D: Gpu>(
    dev: &D,
    src: Dv<f32>,
    rows: Dv<i32>,
    dst: Dv<f32>,
    width: usize,
) -> Result<(), KernelError> {
    need("gpu_gather_rows", "dst", rows.len * width, dst.len)?;
    if rows.len == 0 {
        return Ok(());
    }
    // `GATHER_U` columns a thread (common.cu).
    const SPAN: usize = 4 * 256;
    let spans = width.div_ceil(SPAN);
    if spans > 65_535 {
        return Err(KernelError::InvalidParam {
            op: "gpu_gather_rows",
            field: "width",
            limit: "<= 65535 * 1024",
            value: width.to_string(),
        });
    }
    let f = kernel(dev, "gather_rows")?;
    let mut a = KernelArgs::new();
    a.push(src.ptr)
        .push(rows.ptr)
        .push(dst.ptr)
        .push(int("gpu_gather_rows", "width", width)?);
    let dims = LaunchDims {
        grid: (rows.len as u32, spans.max(1) as u32, 1),
        block: (256, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)
}

/// MLA head shapes as the absorb/unabsorb kernels need them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Query heads.
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// `kv_lora_rank`.
    pub kv_lora: usize,
    /// Rope elements kept as bf16 pairs in bf16 outputs (fast mode's split rows: `rope` or 0;
    /// `gpu/mla.cu`'s top comment). f32 outputs never split.
    pub split: usize,
}

impl HeadShape {
    fn check_kv_b<D: Gpu>(&self, op: &'static str, kv_b: &GpuMatrix<D>) -> Result<(), KernelError> {
        crate::cpu::gemm::check_len(
            op,
            "kv_b.rows",
            self.heads * (self.nope + self.v),
            kv_b.rows,
        )?;
        crate::cpu::gemm::check_len(op, "kv_b.cols", self.kv_lora, kv_b.cols)
    }
}

/// Output of [`absorb`]: f32 `[T][H][kv_lora + rope]` or bf16 `[T][H][kv_lora + rope + 2·split]`
/// (a split query, [`HeadShape::split`]).
#[derive(Debug, Clone, Copy)]
pub enum AbsorbedOut {
    /// f32 rows.
    F32(Dv<f32>),
    /// bf16 rows (tensor-core attention input).
    Bf16(Dv<u16>),
}

/// `out[t][h] = [q_nope · W_UK_h | q_pe]` from `q [T][H][nope + rope]`.
pub fn absorb<D: Gpu>(
    dev: &D,
    q: Dv<f32>,
    kv_b: &GpuMatrix<D>,
    s: HeadShape,
    out: AbsorbedOut,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_absorb";
    s.check_kv_b(OP, kv_b)?;
    let qk = s.nope + s.rope;
    let t = q.len / (s.heads * qk).max(1);
    let (ptr, len, osuf, split) = match out {
        AbsorbedOut::F32(v) => (v.ptr, v.len, "f32", 0),
        AbsorbedOut::Bf16(v) => (v.ptr, v.len, "bf16", s.split),
    };
    if split != 0 && split != s.rope {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "split",
            limit: "0 or the rope dim",
            value: split.to_string(),
        });
    }
    let lw = s.kv_lora + s.rope + 2 * split;
    need(OP, "out", t * s.heads * lw, len)?;
    if t == 0 {
        return Ok(());
    }
    let name: &'static str = match (kv_b.suffix(), osuf) {
        ("f32", "f32") => "absorb_f32_f32",
        ("f32", _) => "absorb_f32_bf16",
        (_, "f32") => "absorb_bf16_f32",
        _ => "absorb_bf16_bf16",
    };
    let f = kernel(dev, name)?;
    let mut a = KernelArgs::new();
    a.push(q.ptr)
        .push(kv_b.ptr())
        .push(ptr)
        .push(int(OP, "T", t)?)
        .push(int(OP, "H", s.heads)?)
        .push(int(OP, "nope", s.nope)?)
        .push(int(OP, "rope", s.rope)?)
        .push(int(OP, "v", s.v)?)
        .push(int(OP, "kv_lora", s.kv_lora)?)
        .push(int(OP, "split", split)?);
    let dims = LaunchDims {
        grid: (
            s.kv_lora.div_ceil(32) as u32,
            s.heads as u32,
            t.div_ceil(8) as u32,
        ),
        block: (256, 1, 1),
        smem: (8 * s.nope * 4) as u32,
    };
    dev.launch(&f, dims, &mut a)
}

/// One product per attention head on the vendor BLAS ([`Gpu::gemm_heads`]):
/// `out_h[t][:n] = x_h[t][:k] · op(W_h)`, head `h`'s operands `h · *_head` elements after the
/// buffers' starts, rows `*_ld` apart. Built by [`absorb_gemm`] and [`unabsorb_gemm`], which
/// check every extent against the buffers.
#[derive(Debug, Clone, Copy)]
pub struct HeadGemm {
    /// f32 activations (the whole buffer: the runtime rounds or splits it to bf16 at once).
    pub x: Dv<f32>,
    /// Elements between a head's consecutive activation rows (tokens).
    pub x_ld: usize,
    /// Elements between consecutive heads' first activation rows.
    pub x_head: usize,
    /// Device address of head 0's bf16 weights (the only kind the tensor-core path takes:
    /// the builders check).
    pub w: u64,
    /// Elements between a weight matrix's rows.
    pub w_ld: usize,
    /// Elements between consecutive heads' weight matrices.
    pub w_head: usize,
    /// `W_h` is `[n][k]` (`x · W_hᵀ`), else `[k][n]` (`x · W_h`).
    pub w_rows_are_outputs: bool,
    /// f32 output.
    pub out: Dv<f32>,
    /// Elements between a head's consecutive output rows.
    pub out_ld: usize,
    /// Elements between consecutive heads' first output rows.
    pub out_head: usize,
    /// Tokens.
    pub m: usize,
    /// Outputs per head and token.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Heads.
    pub heads: usize,
    /// Add the product into `out` (cuBLAS's beta = 1) instead of writing over it.
    pub accumulate: bool,
    /// With [`GemmPrecision::Exact`]: the hi and lo rows as one product of `2m` rows (lo rows
    /// after the hi ones), so the weights are read once; `out` then gets `2m` rows per head
    /// and the caller adds the halves. Needs `x.len == m · x_ld`.
    pub stacked: bool,
    /// With `stacked`: `x` already split by [`split_bf16`] into `[hi | lo]` rows (`2 · x.len`
    /// elements), read instead of splitting `x` again (one MoE layer's input feeds several
    /// products, [`MoeInput`]). Ignored otherwise.
    pub x_split: Option<Dv<u16>>,
}

/// Tokens from which the query absorption and the output un-absorption run as per-head
/// tensor-core GEMMs ([`absorb_gemm`], [`unabsorb_gemm`]) instead of their CUDA-core kernels,
/// whose activation reads grow with the batch (`FERRY_HEAD_GEMM_MIN` overrides it for A/B
/// runs; docs/gpu.md).
pub const HEAD_GEMM_MIN_TOKENS: usize = 32;

/// [`HEAD_GEMM_MIN_TOKENS`], or `FERRY_HEAD_GEMM_MIN` when set (read once).
pub fn head_gemm_min_tokens() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| env_count("FERRY_HEAD_GEMM_MIN", HEAD_GEMM_MIN_TOKENS))
}

/// A threshold (tokens, bytes) from environment variable `name` (an A/B switch), else
/// `default`; a value that is not a whole number is logged and ignored.
pub(crate) fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "{name} is not a whole number; using {default}");
            default
        }),
        Err(_) => default,
    }
}

/// The weights of [`absorb_gemm`] / [`unabsorb_gemm`]: `kv_b_proj` and its head shape, with
/// the precision the activations take on the tensor cores.
#[derive(Debug)]
pub struct HeadWeights<'a, D: Gpu> {
    /// `kv_b_proj` (`W_UK` and `W_UV` per head).
    pub kv_b: &'a GpuMatrix<D>,
    /// Head dimensions.
    pub shape: HeadShape,
    /// bf16 activations, or split into bf16 hi + lo.
    pub precision: GemmPrecision,
}

impl<D: Gpu> HeadWeights<'_, D> {
    /// Checks `kv_b` against the head shape (an error names `op`), then whether the per-head
    /// GEMMs can run here: a vendor BLAS and bf16 weights (ROCm and f32 `kv_b` keep the
    /// CUDA-core kernels).
    fn usable(&self, op: &'static str) -> Result<bool, KernelError> {
        self.shape.check_kv_b(op, self.kv_b)?;
        Ok(D::VENDOR_GEMM.is_some() && self.kv_b.is_bf16())
    }
}

// By hand: a derive would ask `D: Copy`.
impl<D: Gpu> Clone for HeadWeights<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: Gpu> Copy for HeadWeights<'_, D> {}

/// [`absorb`] as per-head GEMMs `q_nope · W_UK_h` on the vendor BLAS (activations as
/// `precision` says), then `absorb_finish_*` writing the output rows (latent part and rope
/// part, the same layout). `Ok(false)`, with nothing launched, where the runtime has no such
/// path (ROCm, f32 `kv_b`): run [`absorb`].
pub fn absorb_gemm<D: Gpu>(
    dev: &D,
    q: Dv<f32>,
    w: HeadWeights<'_, D>,
    out: AbsorbedOut,
) -> Result<bool, KernelError> {
    const OP: &str = "gpu_absorb_gemm";
    if !w.usable(OP)? {
        return Ok(false);
    }
    let HeadWeights {
        kv_b,
        shape: s,
        precision,
    } = w;
    let qk = s.nope + s.rope;
    let t = q.len / (s.heads * qk).max(1);
    need(OP, "q", t * s.heads * qk, q.len)?;
    let (ptr, len, name, split) = match out {
        AbsorbedOut::F32(v) => (v.ptr, v.len, "absorb_finish_f32", 0),
        AbsorbedOut::Bf16(v) => (v.ptr, v.len, "absorb_finish_bf16", s.split),
    };
    let lw = s.kv_lora + s.rope + 2 * split;
    need(OP, "out", t * s.heads * lw, len)?;
    if t == 0 {
        return Ok(true);
    }
    let lat = dev.alloc::<f32>(t * s.heads * s.kv_lora)?;
    let g = HeadGemm {
        x: q,
        x_ld: s.heads * qk,
        x_head: qk,
        w: kv_b.ptr(),
        w_ld: s.kv_lora,
        w_head: (s.nope + s.v) * s.kv_lora,
        w_rows_are_outputs: false,
        out: lat.v(),
        out_ld: s.heads * s.kv_lora,
        out_head: s.kv_lora,
        m: t,
        n: s.kv_lora,
        k: s.nope,
        heads: s.heads,
        accumulate: false,
        stacked: false,
        x_split: None,
    };
    if !dev.gemm_heads(&g, precision)? {
        return Ok(false);
    }
    let f = kernel(dev, name)?;
    let mut a = KernelArgs::new();
    a.push(lat.ptr())
        .push(q.ptr)
        .push(ptr)
        .push(int(OP, "nope", s.nope)?)
        .push(int(OP, "rope", s.rope)?)
        .push(int(OP, "kv_lora", s.kv_lora)?)
        .push(int(OP, "split", split)?);
    dev.launch(&f, LaunchDims::linear(t * s.heads, 128), &mut a)?;
    Ok(true)
}

/// [`unabsorb`] as per-head GEMMs `o_lat · W_UV_hᵀ` on the vendor BLAS (activations as
/// `precision` says). `Ok(false)`, with nothing launched, where the runtime has no such path:
/// run [`unabsorb`].
pub fn unabsorb_gemm<D: Gpu>(
    dev: &D,
    o_lat: Dv<f32>,
    w: HeadWeights<'_, D>,
    out: Dv<f32>,
) -> Result<bool, KernelError> {
    const OP: &str = "gpu_unabsorb_gemm";
    if !w.usable(OP)? {
        return Ok(false);
    }
    let HeadWeights {
        kv_b,
        shape: s,
        precision,
    } = w;
    let t = o_lat.len / (s.heads * s.kv_lora).max(1);
    need(OP, "o_lat", t * s.heads * s.kv_lora, o_lat.len)?;
    need(OP, "out", t * s.heads * s.v, out.len)?;
    if t == 0 {
        return Ok(true);
    }
    let g = HeadGemm {
        x: o_lat,
        x_ld: s.heads * s.kv_lora,
        x_head: s.kv_lora,
        // W_UV_h: rows h·(nope + v) + nope .. + v of kv_b (bf16: two bytes an element).
        w: kv_b.ptr() + (s.nope * s.kv_lora * 2) as u64,
        w_ld: s.kv_lora,
        w_head: (s.nope + s.v) * s.kv_lora,
        w_rows_are_outputs: true,
        out,
        out_ld: s.heads * s.v,
        out_head: s.v,
        m: t,
        n: s.v,
        k: s.kv_lora,
        heads: s.heads,
        accumulate: false,
        stacked: false,
        x_split: None,
    };
    dev.gemm_heads(&g, precision)
}

/// Tokens from which an MoE layer's shared expert runs as a dense MLP on the vendor BLAS
/// ([`shared_experts_gemm`]) and the grouped expert kernels take only the routed slots: each
/// 16-pair chunk of a shared expert re-reads its weights, and a batch gives a shared expert a
/// chunk per 16 tokens (`FERRY_SHARED_GEMM_MIN` overrides it for A/B runs; docs/gpu.md).
pub const SHARED_GEMM_MIN_TOKENS: usize = 64;

/// [`SHARED_GEMM_MIN_TOKENS`], or `FERRY_SHARED_GEMM_MIN` when set (read once).
pub fn shared_gemm_min_tokens() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| env_count("FERRY_SHARED_GEMM_MIN", SHARED_GEMM_MIN_TOKENS))
}

/// One MoE layer's input split once into bf16 rows `[hi | lo]` ([`split_bf16`]; `2 · x.len`
/// elements) where the layer's products would otherwise convert the same rows three times:
/// the shared experts' gate and up products ([`shared_experts_gemm`], a split each), the
/// pipelined routed-expert kernels (a split) and the router's large GEMM (a cast: the hi
/// rows). Each reads this instead, with bitwise the same products. `None`, with nothing
/// launched, unless the shared experts run as that GEMM (`shared_gemm`: the batch is past
/// [`shared_gemm_min_tokens`]), on a runtime with a vendor BLAS, with bf16 experts.
pub fn moe_input_split<D: Gpu>(
    dev: &D,
    x: Dv<f32>,
    experts: &GpuExperts<D>,
    n_shared: usize,
    shared_gemm: bool,
) -> Result<Option<D::Buffer<u16>>, KernelError> {
    if !shared_gemm || D::VENDOR_GEMM.is_none() || !experts.gate.is_bf16() || n_shared == 0 {
        return Ok(None);
    }
    bf16_rows(dev, x, GemmPrecision::Exact).map(Some)
}

/// `h[t] += shared(x[t])` for the `n_shared` shared-expert chunks stacked last in `experts`, as
/// one dense MLP on the vendor BLAS: `g = x · W_gateᵀ`, `u = x · W_upᵀ` over the chunks' rows
/// together (`[n_shared · inter]` wide), `g = silu(g) · u`, then each chunk's down projection
/// added into `h`. The activations are split into bf16 hi + lo in both modes: the grouped
/// expert kernels the shared expert leaves keep ~16 mantissa bits of them, and fast mode's
/// logits stay within their bound only so (rounding them to bf16 here measured outside it on
/// the golden prompts). `x_split`, where the caller split `x` already ([`moe_input_split`]),
/// is read instead of splitting it again. `Ok(false)`, with nothing launched, where the
/// runtime has no vendor BLAS or the experts are not bf16: route the shared experts as slots
/// instead.
pub fn shared_experts_gemm<D: Gpu>(
    dev: &D,
    (x, x_split): (Dv<f32>, Option<Dv<u16>>),
    experts: &GpuExperts<D>,
    n_shared: usize,
    h: Dv<f32>,
) -> Result<bool, KernelError> {
    const OP: &str = "gpu_shared_experts_gemm";
    let precision = GemmPrecision::Exact;
    experts.check(OP)?;
    if D::VENDOR_GEMM.is_none() || !experts.gate.is_bf16() || n_shared == 0 {
        return Ok(false);
    }
    let (hidden, inter) = (experts.hidden, experts.inter);
    let routed = experts
        .total()
        .checked_sub(n_shared)
        .ok_or(KernelError::InvalidParam {
            op: OP,
            field: "n_shared",
            limit: "<= the stacked experts",
            value: n_shared.to_string(),
        })?;
    let t = x.len / hidden.max(1);
    need(OP, "x", t * hidden, x.len)?;
    need(OP, "h", t * hidden, h.len)?;
    if t == 0 {
        return Ok(true);
    }
    let width = n_shared * inter;
    let bf16 = |elems: usize| (elems * 2) as u64;
    // Each product runs on [hi rows | lo rows] stacked (`HeadGemm::stacked`): 2T rows out.
    let g2 = dev.alloc::<f32>(2 * t * width)?;
    let u2 = dev.alloc::<f32>(2 * t * width)?;
    for (w, dst) in [(&experts.gate, &g2), (&experts.up, &u2)] {
        let p = HeadGemm {
            x,
            x_ld: hidden,
            x_head: 0,
            w: w.ptr() + bf16(routed * inter * hidden),
            w_ld: hidden,
            w_head: 0,
            w_rows_are_outputs: true,
            out: dst.v(),
            out_ld: width,
            out_head: 0,
            m: t,
            n: width,
            k: hidden,
            heads: 1,
            accumulate: false,
            stacked: true,
            x_split,
        };
        if !dev.gemm_heads(&p, precision)? {
            return Ok(false);
        }
    }
    let act = dev.alloc::<f32>(t * width)?;
    elementwise(
        dev,
        "silu_mul_halves",
        &[g2.ptr(), u2.ptr(), act.ptr()],
        t * width,
    )?;
    // Every chunk's down projection in one batched product (chunk s = "head" s), the 2 · n_shared
    // partial rows then added into h in a fixed order.
    let parts = dev.alloc::<f32>(n_shared * 2 * t * hidden)?;
    let p = HeadGemm {
        x: act.v(),
        x_ld: width,
        x_head: inter,
        w: experts.down.ptr() + bf16(routed * hidden * inter),
        w_ld: inter,
        w_head: hidden * inter,
        w_rows_are_outputs: true,
        out: parts.v(),
        out_ld: hidden,
        out_head: 2 * t * hidden,
        m: t,
        n: hidden,
        k: inter,
        heads: n_shared,
        accumulate: false,
        stacked: true,
        x_split: None,
    };
    dev.gemm_heads(&p, precision)?;
    let f = kernel(dev, "add_parts")?;
    let mut a = KernelArgs::new();
    a.push(h.ptr)
        .push(parts.ptr())
        .push(int(OP, "parts", 2 * n_shared)?)
        .push((t * hidden) as i64);
    dev.launch(&f, LaunchDims::elementwise(t * hidden), &mut a)?;
    Ok(true)
}

/// `out[t][h] = W_UV_h · o_lat[t][h]`: `[T][H][kv_lora]` → `[T][H][v]`.
pub fn unabsorb<D: Gpu>(
    dev: &D,
    o_lat: Dv<f32>,
    kv_b: &GpuMatrix<D>,
    s: HeadShape,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_unabsorb";
    s.check_kv_b(OP, kv_b)?;
    let t = o_lat.len / (s.heads * s.kv_lora).max(1);
    need(OP, "out", t * s.heads * s.v, out.len)?;
    if t == 0 {
        return Ok(());
    }
    let f = kernel(
        dev,
        if kv_b.is_bf16() {
            "unabsorb_bf16"
        } else {
            "unabsorb_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(o_lat.ptr)
        .push(kv_b.ptr())
        .push(out.ptr)
        .push(int(OP, "T", t)?)
        .push(int(OP, "H", s.heads)?)
        .push(int(OP, "nope", s.nope)?)
        .push(int(OP, "v", s.v)?)
        .push(int(OP, "kv_lora", s.kv_lora)?);
    // One block per head, 8 output columns and chunk of GEMV_MAX_M tokens: a batch's tokens
    // run side by side instead of one chunk after another in each warp.
    // `FERRY_UNABSORB_Z=0`: one block column for all tokens, as before (A/B runs).
    let chunks = if crate::backend::unabsorb_z() {
        t.div_ceil(GEMV_MAX_M).min(MAX_GRID_Y)
    } else {
        1
    };
    let dims = LaunchDims {
        grid: (s.v.div_ceil(8) as u32, s.heads as u32, chunks as u32),
        block: (256, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)
}

/// Tokens up to which the absorbed-form forward merges the split-K partials inside the output
/// un-absorption ([`unabsorb_combine`]) rather than in `mla_combine`: each of a head's
/// `ceil(v / 8)` blocks merges every token's row of that head, so the merge's reads grow with
/// the batch; on the H200 (V2-Lite shape, 1k context) it saved 1.8 us a layer for one token
/// (7.3 us against 5.0 + 4.1) and cost 1.7 ms a step at 32 tokens.
pub const UNABSORB_COMBINE_MAX_TOKENS: usize = 2;

/// Whether [`unabsorb_combine`] takes `parts` of a model of shape `s` (its merged rows and split
/// weights fit 48 KiB of shared memory).
pub fn unabsorb_combine_fits<D: Gpu>(
    parts: &crate::gpu::mla::SplitParts<D>,
    s: &HeadShape,
) -> bool {
    (GEMV_MAX_M * s.kv_lora + parts.splits) * 4 <= 48 * 1024
}

/// [`unabsorb`] of the attention's split-K partials, merged inside the launch
/// (`unabsorb_combine_*`): bitwise `mla_combine` then [`unabsorb`], one launch and no merged
/// rows in memory.
pub fn unabsorb_combine<D: Gpu>(
    dev: &D,
    parts: &crate::gpu::mla::SplitParts<D>,
    kv_b: &GpuMatrix<D>,
    s: HeadShape,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_unabsorb_combine";
    s.check_kv_b(OP, kv_b)?;
    let t = parts.rows / s.heads.max(1);
    need(
        OP,
        "parts",
        parts.splits * parts.rows * s.kv_lora,
        parts.o_part.v().len,
    )?;
    need(
        OP,
        "parts",
        parts.splits * parts.rows * 2,
        parts.ml_part.v().len,
    )?;
    need(OP, "out", t * s.heads * s.v, out.len)?;
    let smem = (GEMV_MAX_M * s.kv_lora + parts.splits) * 4;
    if !unabsorb_combine_fits(parts, &s) || t * s.heads != parts.rows {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "parts",
            limit: "whole tokens of the heads, and (8 · kv_lora + splits) floats within 48 KiB",
            value: format!(
                "{} rows of {} heads, kv_lora {}, {} splits",
                parts.rows, s.heads, s.kv_lora, parts.splits
            ),
        });
    }
    if t == 0 {
        return Ok(());
    }
    let f = kernel(
        dev,
        if kv_b.is_bf16() {
            "unabsorb_combine_bf16"
        } else {
            "unabsorb_combine_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(parts.o_part.ptr())
        .push(parts.ml_part.ptr())
        .push(int(OP, "splits", parts.splits)?)
        .push(kv_b.ptr())
        .push(out.ptr)
        .push(int(OP, "T", t)?)
        .push(int(OP, "H", s.heads)?)
        .push(int(OP, "nope", s.nope)?)
        .push(int(OP, "v", s.v)?)
        .push(int(OP, "kv_lora", s.kv_lora)?);
    let dims = LaunchDims {
        grid: (s.v.div_ceil(8) as u32, s.heads as u32, 1),
        block: (256, 1, 1),
        smem: smem as u32,
    };
    dev.launch(&f, dims, &mut a)
}

/// Where [`gather_latent`] writes: all latent rows `[L][width]` and their c_kv part `[L][kv_lora]`.
#[derive(Debug, Clone, Copy)]
pub struct LatentRows {
    /// `[L][width]`.
    pub rows: Dv<f32>,
    /// `[L][kv_lora]`.
    pub ckv: Dv<f32>,
    /// `kv_lora`.
    pub kv_lora: usize,
}

/// A sequence's first `len` latent rows gathered (as f32) from the pages through `table`.
pub fn gather_latent<D: Gpu>(
    dev: &D,
    pages: PagesView,
    table: Dv<i32>,
    len: usize,
    out: LatentRows,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_gather_latent";
    need(OP, "block_table", len.div_ceil(pages.page_size), table.len)?;
    need(OP, "rows", len * pages.width, out.rows.len)?;
    need(OP, "ckv", len * out.kv_lora, out.ckv.len)?;
    need(OP, "width", out.kv_lora, pages.width)?;
    check_split(OP, &pages, pages.width - out.kv_lora.min(pages.width))?;
    if len == 0 {
        return Ok(());
    }
    let f = kernel(
        dev,
        if pages.bf16 {
            "gather_latent_bf16"
        } else {
            "gather_latent_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(pages.ptr)
        .push(table.ptr)
        .push(int(OP, "page", pages.page_size)?)
        .push(int(OP, "width", pages.width)?)
        .push(out.rows.ptr)
        .push(out.ckv.ptr)
        .push(int(OP, "kv_lora", out.kv_lora)?);
    if pages.bf16 {
        a.push(int(OP, "split", pages.split)?);
    }
    dev.launch(&f, LaunchDims::linear(len, 128), &mut a)
}

/// Per-head K and V of the MHA form (f32 or bf16 outputs).
#[derive(Debug, Clone, Copy)]
pub enum KvOut {
    /// f32 `K [L][H][nope+rope]`, `V [L][H][v]`.
    F32(Dv<f32>, Dv<f32>),
    /// bf16 (tensor-core flash attention input); K rows `[k_nope | hi | lo | hi]`,
    /// `nope + rope + 2·split` wide, where [`HeadShape::split`] is set.
    Bf16(Dv<u16>, Dv<u16>),
}

/// Splits `kv [L][H][nope+v]` (kv_b output) and the latents' `k_pe` into per-head K and V.
pub fn mha_build_kv<D: Gpu>(
    dev: &D,
    kv: Dv<f32>,
    latent: Dv<f32>,
    s: HeadShape,
    out: KvOut,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_mha_build_kv";
    let l = kv.len / (s.heads * (s.nope + s.v)).max(1);
    need(OP, "latent", l * (s.kv_lora + s.rope), latent.len)?;
    let (kp, kl, vp, vl, name, split) = match out {
        KvOut::F32(k, v) => (k.ptr, k.len, v.ptr, v.len, "mha_build_kv_f32", 0),
        KvOut::Bf16(k, v) => (k.ptr, k.len, v.ptr, v.len, "mha_build_kv_bf16", s.split),
    };
    if split != 0 && split != s.rope {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "split",
            limit: "0 or the rope dim",
            value: split.to_string(),
        });
    }
    need(OP, "K", l * s.heads * (s.nope + s.rope + 2 * split), kl)?;
    need(OP, "V", l * s.heads * s.v, vl)?;
    if l == 0 {
        return Ok(());
    }
    let f = kernel(dev, name)?;
    let mut a = KernelArgs::new();
    a.push(kv.ptr)
        .push(latent.ptr)
        .push(int(OP, "H", s.heads)?)
        .push(int(OP, "nope", s.nope)?)
        .push(int(OP, "rope", s.rope)?)
        .push(int(OP, "v", s.v)?)
        .push(int(OP, "kv_lora", s.kv_lora)?)
        .push(kp)
        .push(vp);
    if name == "mha_build_kv_bf16" {
        a.push(int(OP, "split", split)?);
    }
    let dims = LaunchDims {
        grid: (l as u32, s.heads as u32, 1),
        block: (128, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)
}

/// Routing hyper-parameters as `moe_route` takes them (`#[repr(C)]`, no padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteParams {
    /// Routed experts.
    pub n_experts: i32,
    /// Experts per token.
    pub top_k: i32,
    /// Expert groups.
    pub n_group: i32,
    /// Groups kept.
    pub topk_group: i32,
    /// Renormalise the picked weights (0/1).
    pub norm_topk: i32,
    /// Shared experts appended as slots `top_k..` with weight 1 (stacked after the routed ones).
    pub n_shared: i32,
    /// `routed_scaling_factor`.
    pub scale: f32,
    /// 1: DeepSeek-V2 routing (softmax scores, groups by their best, never renormalised);
    /// 0: DeepSeek-V3's (sigmoid, correction bias, groups by their two best).
    pub softmax: i32,
}
// SAFETY: repr(C), eight 4-byte fields, no padding; matches `struct RouteParams` in common.cu.
unsafe impl KernelParam for RouteParams {}

/// Stacked expert weights of one MoE layer: routed experts `0..E`, then the shared expert
/// split into `n_shared` chunks of `inter` rows (exact: the shared MLP's intermediate is the
/// sum of those chunks).
#[derive(Debug)]
pub struct GpuExperts<D: Gpu> {
    /// `[E_total·inter][hidden]`.
    pub gate: GpuMatrix<D>,
    /// `[E_total·inter][hidden]`.
    pub up: GpuMatrix<D>,
    /// `[E_total·hidden][inter]`.
    pub down: GpuMatrix<D>,
    /// Intermediate width of one expert.
    pub inter: usize,
    /// Model width.
    pub hidden: usize,
    /// The ids of the shared-expert chunks (`n_routed..E_total`), on the device: what
    /// [`moe_token_beside`] hands the kernels for the shared slots before routing has written
    /// them. `None` without a shared expert.
    pub shared_ids: Option<D::Buffer<i32>>,
    /// This layer's completion counter for [`moe_router_route`] (one `u32`, zero between
    /// launches: the kernel's last block sets it back).
    pub route_done: D::Buffer<u32>,
}

/// [`GpuExperts::shared_ids`] for `n_shared` shared-expert chunks stacked after `n_routed`
/// routed experts: their ids on `dev`, or `None` without a shared expert.
pub fn shared_expert_ids<D: Gpu>(
    dev: &D,
    n_routed: usize,
    n_shared: usize,
) -> Result<Option<D::Buffer<i32>>, KernelError> {
    if n_shared == 0 {
        return Ok(None);
    }
    let ids = (n_routed..n_routed + n_shared)
        .map(|e| {
            i32::try_from(e).map_err(|_| KernelError::InvalidParam {
                op: "gpu_moe_experts",
                field: "experts",
                limit: "< 2^31",
                value: e.to_string(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(dev.upload(&ids)?))
}

impl<D: Gpu> GpuExperts<D> {
    fn check(&self, op: &'static str) -> Result<(), KernelError> {
        let same =
            self.gate.is_bf16() == self.up.is_bf16() && self.up.is_bf16() == self.down.is_bf16();
        if !same || self.gate.cols != self.hidden || self.down.cols != self.inter {
            return Err(KernelError::InvalidParam {
                op,
                field: "experts",
                limit: "one element type, gate/up [E·inter][hidden], down [E·hidden][inter]",
                value: format!(
                    "gate {}x{}, down {}x{}",
                    self.gate.rows, self.gate.cols, self.down.rows, self.down.cols
                ),
            });
        }
        Ok(())
    }

    /// Experts stacked (routed + shared chunks).
    pub fn total(&self) -> usize {
        self.gate.rows / self.inter.max(1)
    }
}

/// Routing results: `ids [T][slots]`, `weights [T][slots]`.
#[derive(Debug, Clone, Copy)]
pub struct Routes {
    /// Expert of each slot.
    pub ids: Dv<i32>,
    /// Weight of each slot.
    pub weights: Dv<f32>,
    /// Slots per token (`top_k + n_shared`).
    pub slots: usize,
}

/// Which kernel [`moe_route`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKernel {
    /// `moe_route`: one warp per token, scores in shared memory, the picks in rounds separated
    /// by `__syncwarp` and a serial tail on lane 0 (before session 14; any E <= 1024).
    Shared,
    /// `moe_route_w2` / `moe_route_w8`: each lane's experts in registers, picks by warp
    /// shuffles, four tokens per block; bitwise the same ids and weights as [`Self::Shared`].
    /// E <= 256, n_group <= 32, top_k <= 32 ([`Self::fits`]).
    Registers,
}

impl RouteKernel {
    /// [`Self::Registers`] where it [`fits`](Self::fits) and fusion is on (`FERRY_FUSE=0`
    /// keeps the old kernel, for before/after measurements in one binary).
    pub fn pick(p: &RouteParams) -> Self {
        if crate::backend::fuse() && Self::Registers.fits(p) {
            Self::Registers
        } else {
            Self::Shared
        }
    }

    /// Whether this kernel takes the routing `p`.
    pub fn fits(self, p: &RouteParams) -> bool {
        match self {
            Self::Shared => p.n_experts <= 1024,
            Self::Registers => p.n_experts <= 256 && p.n_group <= 32 && p.top_k <= 32,
        }
    }
}

/// What [`moe_route_with`] routes, and where the routes go.
#[derive(Debug, Clone, Copy)]
pub struct RouteArgs {
    /// `[T][E]` router logits.
    pub logits: Dv<f32>,
    /// `[E]` correction bias (read in sigmoid mode only).
    pub bias: Dv<f32>,
    /// Routing hyper-parameters.
    pub p: RouteParams,
    /// `ids` and `weights`, `[T][slots]` each.
    pub out: Routes,
}

/// Routes every token of `logits [T][E]` with the kernel [`RouteKernel::pick`] chooses.
pub fn moe_route<D: Gpu>(
    dev: &D,
    logits: Dv<f32>,
    bias: Dv<f32>,
    p: RouteParams,
    out: Routes,
) -> Result<(), KernelError> {
    let args = RouteArgs {
        logits,
        bias,
        p,
        out,
    };
    moe_route_with(dev, RouteKernel::pick(&p), args)
}

/// The checks every routing launch makes: `a.p` in whole groups and within what `which`
/// takes, a bias of `p.n_experts`, and `a.out` sized for `t` tokens.
fn check_routing(
    op: &'static str,
    which: RouteKernel,
    a: &RouteArgs,
    t: usize,
) -> Result<(), KernelError> {
    let (p, out) = (&a.p, &a.out);
    let e = p.n_experts.max(1) as usize;
    if e > 1024 || p.n_group <= 0 || p.n_experts % p.n_group != 0 {
        return Err(KernelError::InvalidParam {
            op,
            field: "n_experts / n_group",
            limit: "<= 1024 experts in whole groups",
            value: format!("{} / {}", p.n_experts, p.n_group),
        });
    }
    if !which.fits(p) {
        return Err(KernelError::InvalidParam {
            op,
            field: "n_experts / n_group / top_k",
            limit: "<= 256 / 32 / 32 for the register kernel",
            value: format!("{} / {} / {}", p.n_experts, p.n_group, p.top_k),
        });
    }
    need(op, "bias", e, a.bias.len)?;
    let slots = (p.top_k + p.n_shared) as usize;
    crate::cpu::gemm::check_len(op, "slots", slots, out.slots)?;
    need(op, "ids", t * slots, out.ids.len)?;
    need(op, "weights", t * slots, out.weights.len)
}

/// [`moe_route`] on the given kernel (the tests compare the two bitwise).
pub fn moe_route_with<D: Gpu>(
    dev: &D,
    which: RouteKernel,
    a: RouteArgs,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_route";
    let (p, out) = (a.p, a.out);
    let e = p.n_experts.max(1) as usize;
    let t = a.logits.len / e;
    check_routing(OP, which, &a, t)?;
    if t == 0 {
        return Ok(());
    }
    let mut args = KernelArgs::new();
    args.push(a.logits.ptr)
        .push(a.bias.ptr)
        .push(p)
        .push(out.ids.ptr)
        .push(out.weights.ptr);
    let (f, dims) = match which {
        RouteKernel::Shared => (kernel(dev, "moe_route")?, LaunchDims::linear(t, 32)),
        RouteKernel::Registers => {
            args.push(int(OP, "T", t)?);
            let name = if e <= 64 {
                "moe_route_w2"
            } else {
                "moe_route_w8"
            };
            // Four tokens (one warp each) per block.
            (kernel(dev, name)?, LaunchDims::linear(t.div_ceil(4), 128))
        }
    };
    dev.launch(&f, dims, &mut args)
}

/// Whether small batches take the router GEMV and the routing in one launch
/// ([`moe_router_route`]; `FERRY_ROUTER_FUSED=1`, read once). Off by default until an H200 run
/// shows it pays (docs/gpu.md).
pub fn router_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_ROUTER_FUSED").is_ok_and(|v| v == "1"))
}

/// `a`'s router logits and routes: one launch ([`moe_router_route`]) when `fused` and the
/// batch is small enough (at most [`GEMV_MAX_M`] tokens whose projection [`linear`] gives to
/// the GEMV — not to [`gemv_mma`] — and routing the register kernel takes), else [`linear`]
/// then [`moe_route`]. Either way the same logits, ids and weights, bit for bit.
pub fn router_and_route<D: Gpu>(
    dev: &D,
    a: RouterRoute<'_, D>,
    fused: bool,
    gemm: GemmPrecision,
) -> Result<(), KernelError> {
    let t = a.x.len / a.router.cols().max(1);
    let by_gemv = (1..=GEMV_MAX_M).contains(&t) && !gemv_mma_fits(dev, t, a.x, a.router);
    if fused && by_gemv && RouteKernel::Registers.fits(&a.p) {
        return moe_router_route(dev, a);
    }
    // `linear`'s rule: past the GEMV and the skinny GEMM, the large GEMM.
    let large = t > GEMV_MAX_M && !gemv_mma_fits(dev, t, a.x, a.router);
    let out = GemmOut {
        out: a.logits,
        accumulate: false,
    };
    let done = match a.x_split {
        Some(xs) if large => {
            need("gpu_router", "logits", t * a.router.rows(), a.logits.len)?;
            dev.gemm_split((xs, t), a.router, out, gemm)?
        }
        _ => false,
    };
    if !done {
        linear(dev, a.x, a.router, a.logits, gemm)?;
    }
    moe_route(dev, a.logits, a.bias, a.p, a.out)
}

/// What [`moe_router_route`] computes: `x`'s router logits and their routes.
#[derive(Debug, Clone, Copy)]
pub struct RouterRoute<'a, D: Gpu> {
    /// `[T][hidden]` inputs, 1 ≤ T ≤ [`GEMV_MAX_M`].
    pub x: Dv<f32>,
    /// `[E][hidden]` router.
    pub router: &'a GpuMatrix<D>,
    /// `[E]` correction bias.
    pub bias: Dv<f32>,
    /// Routing hyper-parameters (the register kernel's limits, [`RouteKernel::fits`]).
    pub p: RouteParams,
    /// `[T][E]` logits (written).
    pub logits: Dv<f32>,
    /// `ids` and `weights`, `[T][slots]` each.
    pub out: Routes,
    /// The call site's counter (one `u32`, zero; [`GpuExperts::route_done`]).
    pub done: Dv<u32>,
    /// `x` split already ([`moe_input_split`]): a batch past the GEMV's rows reads its hi
    /// rows (fast mode) or both halves (exact) instead of converting `x` again.
    pub x_split: Option<Dv<u16>>,
}

/// The router GEMV and the routing in one launch (`moe_router_route_w{2,8}_*`): every block
/// computes eight router rows for every token, the last block to finish routes them (and sets
/// `done` back to zero). Bitwise [`linear`] then [`moe_route`] (the same GEMV and routing
/// code). `done` must not be shared with a launch that may run at the same time.
pub fn moe_router_route<D: Gpu>(dev: &D, a: RouterRoute<'_, D>) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_router_route";
    let (p, router) = (a.p, a.router);
    let (e, hidden) = (router.rows(), router.cols());
    let t = a.x.len / hidden.max(1);
    if !(1..=GEMV_MAX_M).contains(&t) || t * hidden != a.x.len {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "x",
            limit: "1 to 8 whole rows of the router's width",
            value: format!("{} values of width {hidden}", a.x.len),
        });
    }
    if e != p.n_experts.max(0) as usize {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "n_experts",
            limit: "the router's rows",
            value: format!("{} against {e} rows", p.n_experts),
        });
    }
    let route = RouteArgs {
        logits: a.logits,
        bias: a.bias,
        p,
        out: a.out,
    };
    check_routing(OP, RouteKernel::Registers, &route, t)?;
    need(OP, "logits", t * e, a.logits.len)?;
    need(OP, "done", 1, a.done.len)?;
    let name = match (e <= 64, router.is_bf16()) {
        (true, true) => "moe_router_route_w2_bf16",
        (true, false) => "moe_router_route_w2_f32",
        (false, true) => "moe_router_route_w8_bf16",
        (false, false) => "moe_router_route_w8_f32",
    };
    let mut args = KernelArgs::new();
    args.push(a.x.ptr)
        .push(int(OP, "T", t)?)
        .push(router.ptr())
        .push(int(OP, "hidden", hidden)?)
        .push(a.bias.ptr)
        .push(p)
        .push(a.logits.ptr)
        .push(a.out.ids.ptr)
        .push(a.out.weights.ptr)
        .push(a.done.ptr);
    dev.launch(
        &kernel(dev, name)?,
        LaunchDims::linear(e.div_ceil(8), 256),
        &mut args,
    )
}

/// Outputs per block of the per-pair `moe_down` kernels (`FERRY_MOE_DOWN_R` = 1, 4, 8 or 16).
/// Every choice gives bitwise the same `h` (common.cu keeps each output's summation order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeDownRows {
    /// `moe_down1_*` (`moe_down_impl<1>`): one output per block, 2,048 blocks at
    /// DeepSeek-V2-Lite's width (the kernel before session 13; what `FERRY_FUSE=0` runs).
    One,
    /// `moe_down_*` (`moe_down_impl<4>`: four rows per warp). 133 registers on sm_90a, so
    /// one block per SM: its 512 blocks run in four waves on a 132-SM card.
    Four,
    /// `moe_down8_*` (`moe_down_rows_impl<8, 8>`: each warp streams eight rows, software-
    /// pipelined). 115 registers, two blocks per SM: 256 blocks, one wave. The default:
    /// measured on the H200 at 15.2 us a V2-Lite layer against 21.7 us for `Four`, a
    /// single-stream step 2.94 → 2.74 ms (BENCHMARKS.md, session 14).
    #[default]
    Eight,
    /// `moe_down16_*` (`moe_down_rows_impl<16, 16>`). 206 registers, one block per SM: 128
    /// blocks, one wave.
    Sixteen,
}

impl MoeDownRows {
    /// Outputs per block.
    pub fn rows(self) -> usize {
        match self {
            Self::One => 1,
            Self::Four => 4,
            Self::Eight => 8,
            Self::Sixteen => 16,
        }
    }

    /// What runs for `inter`-wide expert rows: the streaming kernels load 16-byte chunks and
    /// need `inter % 8 == 0`; other widths take [`Self::Four`].
    pub fn fitting(self, inter: usize) -> Self {
        match self {
            Self::Eight | Self::Sixteen if inter % 8 != 0 => Self::Four,
            other => other,
        }
    }

    fn kernel(self, bf16: bool) -> &'static str {
        match (self, bf16) {
            (Self::One, true) => "moe_down1_bf16",
            (Self::One, false) => "moe_down1_f32",
            (Self::Four, true) => "moe_down_bf16",
            (Self::Four, false) => "moe_down_f32",
            (Self::Eight, true) => "moe_down8_bf16",
            (Self::Eight, false) => "moe_down8_f32",
            (Self::Sixteen, true) => "moe_down16_bf16",
            (Self::Sixteen, false) => "moe_down16_f32",
        }
    }
}

impl std::str::FromStr for MoeDownRows {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "1" => Ok(Self::One),
            "4" => Ok(Self::Four),
            "8" => Ok(Self::Eight),
            "16" => Ok(Self::Sixteen),
            other => Err(KernelError::InvalidParam {
                op: "moe_down",
                field: "FERRY_MOE_DOWN_R",
                limit: "1, 4, 8 or 16",
                value: other.to_string(),
            }),
        }
    }
}

impl std::fmt::Display for MoeDownRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.rows())
    }
}

/// The per-pair kernels [`moe_experts`] launches below [`MOE_GROUPED_MIN_TOKENS`] tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerPairKernels {
    /// Two gate/up rows per warp (`moe_gate_up_*`), else one (`moe_gate_up1_*`).
    pub gate_up_pairs: bool,
    /// The down kernel.
    pub down: MoeDownRows,
}

impl PerPairKernels {
    /// From the environment, read once: `FERRY_FUSE=0` gives the kernels before session 13
    /// (one gate/up row per warp, [`MoeDownRows::One`]); otherwise two gate/up rows per warp
    /// and `FERRY_MOE_DOWN_R` (default 8).
    pub fn from_env() -> Self {
        if crate::backend::fuse() {
            Self {
                gate_up_pairs: true,
                down: crate::backend::moe_down_rows(),
            }
        } else {
            Self {
                gate_up_pairs: false,
                down: MoeDownRows::One,
            }
        }
    }
}

/// What [`moe_experts_per_pair`] computes: `h += Σ_slots w · expert(x)`.
#[derive(Debug)]
pub struct MoeArgs<'a, D: Gpu> {
    /// `[T][hidden]` activations.
    pub x: Dv<f32>,
    /// Each token's slots.
    pub routes: Routes,
    /// The layer's stacked experts.
    pub experts: &'a GpuExperts<D>,
    /// `[T][hidden]` residual, added to.
    pub h: Dv<f32>,
    /// `x` split already ([`moe_input_split`]): the pipelined kernels read it instead of
    /// splitting `x` again; the other kernels read `x`.
    pub x_split: Option<Dv<u16>>,
}

/// Gate/up rows per warp of `moe_gate_up_*` (common.cu's `moe_gate_up_impl<2>`).
const MOE_GATE_UP_R: usize = 2;

/// `h[t] += Σ_slots w · expert(x[t])` for routed slots (shared experts included as slots).
pub fn moe_experts<D: Gpu>(dev: &D, a: MoeArgs<'_, D>) -> Result<(), KernelError> {
    let t = a.x.len / a.experts.hidden.max(1);
    if moe_grouped(t, a.routes.slots, a.experts) {
        a.experts.check("gpu_moe_experts")?;
        need("gpu_moe_experts", "h", t * a.experts.hidden, a.h.len)?;
        let which = GroupedKernels::pick(dev, a.experts);
        return moe_experts_grouped_by(dev, a, which);
    }
    moe_experts_per_pair(dev, a, PerPairKernels::from_env())
}

/// [`moe_experts`] by the per-pair kernels `which` (any token count; a batch re-reads an
/// expert once per pair routed to it): gate/up, then down with its in-block slot sum.
pub fn moe_experts_per_pair<D: Gpu>(
    dev: &D,
    a: MoeArgs<'_, D>,
    which: PerPairKernels,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_experts";
    let MoeArgs {
        x,
        routes,
        experts,
        h,
        ..
    } = a;
    experts.check(OP)?;
    let (hidden, inter, k) = (experts.hidden, experts.inter, routes.slots);
    let t = x.len / hidden.max(1);
    need(OP, "h", t * hidden, h.len)?;
    need(OP, "ids", t * k, routes.ids.len)?;
    if t == 0 {
        return Ok(());
    }
    let act = dev.alloc::<f32>(t * k * inter)?;
    let pairs = PairKernels::new(dev, experts, which)?;
    // The grids' y dimension counts (token, slot) pairs and tokens, and CUDA caps it at
    // 65,535: a long prefill (8,192 tokens × 8 slots) launches in token chunks below it.
    let per_launch = (MAX_GRID_Y / k.max(1)).max(1);
    for t0 in (0..t).step_by(per_launch) {
        let n = per_launch.min(t - t0);
        let at = GateUpAt {
            x: x.ptr + words(t0 * hidden),
            ids: routes.ids.ptr + words(t0 * k),
            act: act.ptr() + words(t0 * k * inter),
            pairs: n * k,
            slots: k,
        };
        pairs.gate_up(dev, at)?;
    }
    for t0 in (0..t).step_by(MAX_GRID_Y) {
        let n = MAX_GRID_Y.min(t - t0);
        let at = DownAt {
            act: act.ptr() + words(t0 * k * inter),
            ids: routes.ids.ptr + words(t0 * k),
            weights: routes.weights.ptr + words(t0 * k),
            h: h.ptr + words(t0 * hidden),
            tokens: n,
            slots: k,
        };
        pairs.down(dev, at)?;
    }
    Ok(())
}

/// Bytes of `n` f32 / i32 elements, for offsetting device pointers.
fn words(n: usize) -> u64 {
    (n * 4) as u64
}

/// The per-pair gate/up and down kernels of one expert stack, compiled, and how to launch
/// them over a range of (token, slot) pairs.
struct PairKernels<'a, D: Gpu> {
    experts: &'a GpuExperts<D>,
    gate_up: D::Function,
    gate_up_rows: usize,
    down: D::Function,
    down_rows: usize,
}

/// Where one gate/up launch reads and writes: `pairs` consecutive pairs from `ids`, token
/// `p / slots` of `x` for pair `p`, `act` rows `0..pairs`.
struct GateUpAt {
    x: u64,
    ids: u64,
    act: u64,
    pairs: usize,
    slots: usize,
}

/// Where one down launch reads and adds: `tokens` rows of `h`, each the weighted sum of its
/// `slots` rows of `act`.
struct DownAt {
    act: u64,
    ids: u64,
    weights: u64,
    h: u64,
    tokens: usize,
    slots: usize,
}

impl<'a, D: Gpu> PairKernels<'a, D> {
    fn new(
        dev: &D,
        experts: &'a GpuExperts<D>,
        which: PerPairKernels,
    ) -> Result<Self, KernelError> {
        let bf16 = experts.gate.is_bf16();
        let gate_up = kernel(
            dev,
            match (bf16, which.gate_up_pairs) {
                (true, true) => "moe_gate_up_bf16",
                (false, true) => "moe_gate_up_f32",
                (true, false) => "moe_gate_up1_bf16",
                (false, false) => "moe_gate_up1_f32",
            },
        )?;
        let down = which.down.fitting(experts.inter);
        Ok(Self {
            experts,
            gate_up,
            gate_up_rows: if which.gate_up_pairs {
                MOE_GATE_UP_R
            } else {
                1
            },
            down: kernel(dev, down.kernel(bf16))?,
            down_rows: down.rows(),
        })
    }

    /// `act[p] = silu(gate_e · x) ⊙ (up_e · x)` for the launch's pairs, on `dev`'s stream.
    fn gate_up(&self, dev: &D, at: GateUpAt) -> Result<(), KernelError> {
        const OP: &str = "gpu_moe_experts";
        let (e, inter) = (self.experts, self.experts.inter);
        let mut a = KernelArgs::new();
        a.push(at.x)
            .push(at.ids)
            .push(e.gate.ptr())
            .push(e.up.ptr())
            .push(at.act)
            .push(int(OP, "K", at.slots)?)
            .push(int(OP, "inter", inter)?)
            .push(int(OP, "hidden", e.hidden)?);
        let dims = LaunchDims {
            grid: (
                inter.div_ceil(8 * self.gate_up_rows) as u32,
                at.pairs as u32,
                1,
            ),
            block: (256, 1, 1),
            smem: 0,
        };
        dev.launch(&self.gate_up, dims, &mut a)
    }

    /// `h[t] += Σ_s w[t][s] · down_e · act[t][s]` for the launch's tokens.
    fn down(&self, dev: &D, at: DownAt) -> Result<(), KernelError> {
        const OP: &str = "gpu_moe_experts";
        let e = self.experts;
        let mut a = KernelArgs::new();
        a.push(at.act)
            .push(at.ids)
            .push(at.weights)
            .push(e.down.ptr())
            .push(at.h)
            .push(int(OP, "K", at.slots)?)
            .push(int(OP, "inter", e.inter)?)
            .push(int(OP, "hidden", e.hidden)?);
        let dims = LaunchDims {
            grid: (
                e.hidden.div_ceil(self.down_rows) as u32,
                at.tokens as u32,
                1,
            ),
            block: (256, 1, 1),
            smem: 0,
        };
        dev.launch(&self.down, dims, &mut a)
    }
}

/// One token's MoE layer (router GEMV, routing, experts) for a single-stream decode step.
#[derive(Debug)]
pub struct MoeToken<'a, D: Gpu> {
    /// `[hidden]` normed activation.
    pub x: Dv<f32>,
    /// `[n_experts][hidden]` router.
    pub router: &'a GpuMatrix<D>,
    /// The routing's correction bias.
    pub bias: Dv<f32>,
    /// Routing hyper-parameters; `n_shared` > 0 (the layer has a shared expert).
    pub routing: RouteParams,
    /// The layer's stacked experts, with their `shared_ids`.
    pub experts: &'a GpuExperts<D>,
    /// `[hidden]` residual, added to.
    pub h: Dv<f32>,
    /// How the router GEMV treats its activation.
    pub gemm: GemmPrecision,
}

/// [`MoeToken`] with the shared-expert slots' gate/up launched on `side` (the device's second
/// stream, [`Gpu::side`]) before the router: they need only `x`, so they stream their weights
/// while the router GEMV and the routing — short, latency-bound launches — run on the main
/// stream; the routed slots' gate/up follow the routing, and the down projection sums every
/// slot after both. The same kernels on the same operands as [`moe_experts_per_pair`] after
/// the router and [`moe_route`], so `h` is bitwise what that path gives. `side` may be `dev`
/// itself (the same work, in order on one stream).
///
/// One token only: the kernels index a pair's activation row by its position in the launch,
/// which for one token is its slot, so the two gate/up launches write one `[slots][inter]`
/// block that the down kernel reads as usual.
pub fn moe_token_beside<D: Gpu>(dev: &D, side: &D, m: MoeToken<'_, D>) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_token";
    let MoeToken {
        x,
        router,
        bias,
        routing,
        experts,
        h,
        gemm,
    } = m;
    experts.check(OP)?;
    let (hidden, inter) = (experts.hidden, experts.inter);
    need(OP, "x", hidden, x.len)?;
    need(OP, "h", hidden, h.len)?;
    let top_k = usize::try_from(routing.top_k).unwrap_or(0);
    let n_shared = usize::try_from(routing.n_shared).unwrap_or(0);
    let shared_ids = experts
        .shared_ids
        .as_ref()
        .filter(|ids| n_shared > 0 && ids.v().len == n_shared)
        .ok_or_else(|| KernelError::InvalidParam {
            op: OP,
            field: "n_shared",
            limit: "> 0, the experts' shared-expert ids",
            value: n_shared.to_string(),
        })?;
    let slots = top_k + n_shared;
    let logits = dev.alloc::<f32>(router.rows())?;
    let ids = dev.alloc::<i32>(slots)?;
    let weights = dev.alloc::<f32>(slots)?;
    let act = dev.alloc::<f32>(slots * inter)?;
    let pairs = PairKernels::new(dev, experts, PerPairKernels::from_env())?;
    // The shared slots (rows top_k.. of `act`), beside the router and the routing.
    side.wait_for(dev)?;
    let shared = GateUpAt {
        x: x.ptr,
        ids: shared_ids.ptr(),
        act: act.ptr() + words(top_k * inter),
        pairs: n_shared,
        slots: n_shared,
    };
    pairs.gate_up(side, shared)?;
    let routes = Routes {
        ids: ids.v(),
        weights: weights.v(),
        slots,
    };
    let rr = RouterRoute {
        x,
        router,
        bias,
        p: routing,
        logits: logits.v(),
        out: routes,
        done: experts.route_done.v(),
        x_split: None,
    };
    router_and_route(dev, rr, router_fused(), gemm)?;
    let routed = GateUpAt {
        x: x.ptr,
        ids: ids.ptr(),
        act: act.ptr(),
        pairs: top_k,
        slots: top_k,
    };
    pairs.gate_up(dev, routed)?;
    dev.wait_for(side)?;
    let down = DownAt {
        act: act.ptr(),
        ids: ids.ptr(),
        weights: weights.ptr(),
        h: h.ptr,
        tokens: 1,
        slots,
    };
    pairs.down(dev, down)
}

/// When a one-token MoE step launches its shared-expert slots beside the router
/// ([`moe_token_beside`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedBeside {
    /// Never (`FERRY_SHARED_BESIDE=0`): the router, routing, then all slots.
    Never,
    /// In captured graphs only (the default; `FERRY_SHARED_BESIDE=graphs`): a graph-replayed
    /// V2-Lite-shaped step took 2.661 ms against 2.690 on the H200 (session 32, four
    /// interleaved pairs) and 1 % less on an H100 (session 35, six of seven pairs faster), while
    /// an eager step, which pays the two events' host calls every layer, took 2.81–2.86 ms
    /// against 2.71–2.74 on the H200.
    Graphs,
    /// Always (`FERRY_SHARED_BESIDE=1`), eager steps too.
    Always,
}

impl SharedBeside {
    /// From `FERRY_SHARED_BESIDE` (read once): `0`, `1`, else [`SharedBeside::Graphs`].
    pub fn from_env() -> Self {
        static MODE: std::sync::OnceLock<SharedBeside> = std::sync::OnceLock::new();
        *MODE.get_or_init(|| match std::env::var("FERRY_SHARED_BESIDE").as_deref() {
            Ok("1") => SharedBeside::Always,
            Ok("0") => SharedBeside::Never,
            _ => SharedBeside::Graphs,
        })
    }

    /// Whether work queued on `dev` now takes [`moe_token_beside`].
    pub fn applies<D: Gpu>(self, dev: &D) -> bool {
        match self {
            SharedBeside::Never => false,
            SharedBeside::Graphs => dev.capturing(),
            SharedBeside::Always => true,
        }
    }
}

/// CUDA's (and HIP's) limit on a grid's y and z dimensions.
pub const MAX_GRID_Y: usize = 65_535;

/// Tokens from which [`moe_experts`] groups the (token, slot) pairs by expert. Below it the
/// two per-pair launches win: on the H200 with DeepSeek-V2-Lite's experts (64 routed top-6 +
/// 2 shared), a batch of 4 decoded in 7.97 ms per step per pair against 9.57 ms grouped (few
/// pairs share an expert, and grouping adds two launches and thinner grids), a batch of 16 in
/// 21.95 ms against 17.60 ms (BENCHMARKS.md).
pub const MOE_GROUPED_MIN_TOKENS: usize = 8;

/// Tokens up to which a batch of small experts stays on the per-pair kernels
/// ([`MOE_PER_PAIR_MAX_BYTES`]): a speculative round's verify forward (block 8 + the anchor).
pub const MOE_PER_PAIR_MAX_TOKENS: usize = 16;

/// Bytes of expert weights the per-pair kernels may read for a batch of
/// [`MOE_GROUPED_MIN_TOKENS`]`..=`[`MOE_PER_PAIR_MAX_TOKENS`] tokens (one read per (token,
/// slot) pair) and still be taken over the grouped ones. Grouping adds two launches and thin
/// grids; with small experts that costs more than re-reading them: on the H200 the DSpark
/// target's experts (512 × 256) took 38 us a layer grouped for 8 tokens (`moe_group`,
/// `moe_gate_up_mma3`, `moe_down_mma3`, `moe_sum_slots`, each alone under ncu) against 12 us
/// per pair for one token. DeepSeek-V2-Lite's 17 MB experts are past it from 1 token × 8 slots.
/// `FERRY_MOE_PER_PAIR_MAX_BYTES` overrides it for A/B runs (0: grouped from 8 tokens).
pub const MOE_PER_PAIR_MAX_BYTES: usize = 64 << 20;

/// [`MOE_PER_PAIR_MAX_BYTES`], or `FERRY_MOE_PER_PAIR_MAX_BYTES` when set (read once).
pub fn moe_per_pair_max_bytes() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| env_count("FERRY_MOE_PER_PAIR_MAX_BYTES", MOE_PER_PAIR_MAX_BYTES))
}

/// Whether [`moe_experts`] groups the (token, slot) pairs of `t` tokens with `slots` slots each
/// by expert: from [`MOE_GROUPED_MIN_TOKENS`] tokens, unless the batch is small and its pairs'
/// expert weights are too ([`MOE_PER_PAIR_MAX_BYTES`]), and never past what `moe_group` counts.
pub fn moe_grouped<D: Gpu>(t: usize, slots: usize, experts: &GpuExperts<D>) -> bool {
    let elem = if experts.gate.is_bf16() { 2 } else { 4 };
    let expert_bytes = 3 * experts.inter * experts.hidden * elem;
    let batch = MoeBatch {
        tokens: t,
        slots,
        expert_bytes,
        experts: experts.total(),
    };
    batch.grouped(moe_per_pair_max_bytes())
}

/// What [`moe_grouped`] decides from: a batch's tokens and slots, one expert's bytes and the
/// experts stacked.
#[derive(Debug, Clone, Copy)]
struct MoeBatch {
    tokens: usize,
    slots: usize,
    expert_bytes: usize,
    experts: usize,
}

impl MoeBatch {
    /// [`moe_grouped`] with the per-pair byte bound `per_pair_max`.
    fn grouped(self, per_pair_max: usize) -> bool {
        let t = self.tokens;
        let small =
            t <= MOE_PER_PAIR_MAX_TOKENS && t * self.slots * self.expert_bytes <= per_pair_max;
        t >= MOE_GROUPED_MIN_TOKENS && !small && self.experts <= MOE_MAX_EXPERTS
    }
}

/// Stacked experts (routed + shared chunks) `moe_group` can count (`MOE_MAX_EXPERTS` in
/// common.cu); a layer with more takes the per-pair kernels.
pub const MOE_MAX_EXPERTS: usize = 2048;

/// Tokens per grouped pass: bounds the per-pass scratch (`act` and the per-slot outputs, 4 ·
/// slots · (inter + hidden) bytes per token: ~110 MB at 2,048 tokens of DeepSeek-V2-Lite)
/// while every expert still gets whole chunks of pairs from a long prefill.
const MOE_GROUPED_MAX_TOKENS: usize = 2048;

/// The tensor-core grouped expert kernels (`FERRY_MOE_MMA`, read once per process so one binary
/// measures each; docs/gpu.md). A warp computes 16 or 32 pairs × 32 rows of one expert; every
/// choice gives bitwise the same outputs (same fragments, same order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeMma {
    /// `auto` (the default): [`Self::Pipe`] from [`MOE_PIPE_MIN_TOKENS`] tokens where the
    /// experts' shape fits it ([`moe_pipe_fits`]); otherwise [`Self::Prefetch`] for passes of up
    /// to [`MOE_PREFETCH_MAX_TOKENS`] tokens, [`Self::Prefetch32`] up to
    /// [`MOE_CHUNK32_MAX_TOKENS`], [`Self::Stream`] above.
    #[default]
    Auto,
    /// `wait`: `moe_{gate_up,down}_mma` (session 11): each 32-wide k step's weights are waited
    /// for before its MMAs.
    Wait,
    /// `stream`: `moe_{gate_up,down}_mma2` (session 19): two register buffers of weights
    /// alternate, the next step's in flight during the MMAs.
    Stream,
    /// `prefetch`: `moe_{gate_up,down}_mma3` (session 20): `stream` plus an L2 prefetch of each
    /// row's next 128-byte line (64 elements ahead), more of the weight stream in flight at no
    /// register cost.
    Prefetch,
    /// `stream32`: `stream` over chunks of 32 pairs (`moe_{gate_up,down}_mma2_m32`): two m-tiles
    /// per warp on the same weight registers, so an expert with 17–32 pairs in a pass reads
    /// its weights once instead of twice.
    Stream32,
    /// `prefetch32`: `prefetch` over chunks of 32 pairs (`moe_{gate_up,down}_mma3_m32`).
    Prefetch32,
    /// `pipe`: a pipelined grouped GEMM over chunks of 32 pairs (`moe_{gate_up,down}_pipe`):
    /// weights and bf16 hi + lo activation rows staged in shared memory by a 3-deep cp.async
    /// pipeline, fragments by ldmatrix. Outputs match the other arms to f32 rounding, not
    /// bitwise (natural k order). Needs `inter` a multiple of 64 and `hidden` of 128
    /// ([`moe_pipe_fits`]); other shapes, and [`Self::Auto`] below [`MOE_PIPE_MIN_TOKENS`],
    /// take the register-streamed kernels.
    Pipe,
}

/// Tokens a grouped pass may have for [`MoeMma::Auto`] to take the prefetching kernels over
/// chunks of 16 pairs. On the H200 (V2-Lite shape, graph steps, same run) they won 13–19 % at
/// batch 16–128 and lost 7 % at 256, where each shared expert's 16 chunks re-read its lines
/// from L2 and the prefetched lines evict them (BENCHMARKS.md, session 20).
pub const MOE_PREFETCH_MAX_TOKENS: usize = 128;

/// Tokens a grouped pass may have for [`MoeMma::Auto`] to take chunks of 32 pairs
/// ([`MoeMma::Prefetch32`]) above [`MOE_PREFETCH_MAX_TOKENS`]. A decode batch of 256 gives most
/// of V2-Lite's experts 17–32 pairs: chunks of 32 took its step from 20.65 / 20.72 ms
/// (`stream`) to 19.56 / 19.64 on the H200. They lose where an expert gets many chunks anyway:
/// a 1,024-token prefill 43.1 / 43.8 → 47.8 / 47.6 ms, 8,192 tokens 342 / 345 → 358 / 358, and
/// a batch of 128 (13.8 → 16.1 ms): the 32-pair kernels hold 206 registers a thread, two
/// blocks per SM instead of three (BENCHMARKS.md, session 26). Passes between 256 and 1,024
/// tokens were not measured and keep `stream`.
pub const MOE_CHUNK32_MAX_TOKENS: usize = 256;

/// Tokens a grouped call needs for [`MoeMma::Auto`] to take the pipelined kernels
/// ([`MoeMma::Pipe`]) where the experts fit them. On the H200 (DeepSeek-V2-Lite shape, graph
/// steps, BENCHMARKS.md session 29) they beat the register-streamed kernels at every size
/// measured: batch 8 8.95 → 8.88 ms a step, 16 9.77 → 9.43, 24 10.76 → 10.43, 32 10.75 →
/// 10.52, 128 13.67 → 13.41, 256 19.29 → 16.64 (49 → 57 % of copy bandwidth); prefill of 1,024
/// tokens 43.4 → 39.9 ms, 8,192 tokens 338 → 314 ms. 8 is also where a decode batch starts
/// grouping ([`MOE_GROUPED_MIN_TOKENS`]); a smaller grouped call (tests force them) keeps the
/// register-streamed kernels, which were not measured against these there.
pub const MOE_PIPE_MIN_TOKENS: usize = 8;

impl MoeMma {
    /// Whether a grouped call of `tokens` tokens runs the pipelined kernels (where the experts
    /// fit them).
    fn pipelined(self, tokens: usize) -> bool {
        match self {
            Self::Pipe => true,
            Self::Auto => tokens >= MOE_PIPE_MIN_TOKENS,
            _ => false,
        }
    }

    /// The register-streamed kernels for a pass of `tokens` tokens: `(gate_up, down)` names and
    /// pairs per chunk.
    fn kernels(self, tokens: usize) -> (&'static str, &'static str, usize) {
        match self {
            Self::Auto if tokens <= MOE_PREFETCH_MAX_TOKENS => Self::Prefetch.kernels(tokens),
            Self::Auto if tokens <= MOE_CHUNK32_MAX_TOKENS => Self::Prefetch32.kernels(tokens),
            Self::Auto => Self::Stream.kernels(tokens),
            Self::Wait => ("moe_gate_up_mma", "moe_down_mma", 16),
            Self::Stream => ("moe_gate_up_mma2", "moe_down_mma2", 16),
            Self::Prefetch => ("moe_gate_up_mma3", "moe_down_mma3", 16),
            Self::Stream32 => ("moe_gate_up_mma2_m32", "moe_down_mma2_m32", 32),
            Self::Prefetch32 => ("moe_gate_up_mma3_m32", "moe_down_mma3_m32", 32),
            // What a shape the pipelined kernels do not take falls back to.
            Self::Pipe => Self::Auto.kernels(tokens),
        }
    }

    const ALL: [(Self, &'static str); 7] = [
        (Self::Auto, "auto"),
        (Self::Wait, "wait"),
        (Self::Stream, "stream"),
        (Self::Prefetch, "prefetch"),
        (Self::Stream32, "stream32"),
        (Self::Prefetch32, "prefetch32"),
        (Self::Pipe, "pipe"),
    ];
}

impl std::str::FromStr for MoeMma {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Self::ALL
            .iter()
            .find(|(_, name)| *name == s)
            .map(|(m, _)| *m)
            .ok_or_else(|| KernelError::InvalidParam {
                op: "moe_experts_grouped",
                field: "FERRY_MOE_MMA",
                limit: "auto, wait, stream, prefetch, stream32, prefetch32 or pipe",
                value: s.to_string(),
            })
    }
}

impl std::fmt::Display for MoeMma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = Self::ALL
            .iter()
            .find(|(m, _)| m == self)
            .map_or("?", |(_, n)| n);
        f.write_str(name)
    }
}

/// Which grouped kernels [`moe_experts_grouped_by`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupedKernels {
    /// Tensor cores (CUDA sm_80+, bf16 experts, widths multiples of 32): [`MoeMma`]'s pick.
    TensorCores(MoeMma),
    /// `moe_{gate_up,down}_grouped_*`: the portable CUDA-core kernels, chunks of
    /// [`GEMV_MAX_M`] pairs.
    CudaCores,
}

/// One grouped pass's two launches: kernel names, pairs per chunk, rows per block, threads per
/// block.
struct GroupedLaunch {
    gate_up: &'static str,
    down: &'static str,
    chunk: usize,
    rows: usize,
    threads: u32,
}

impl GroupedKernels {
    fn pick<D: Gpu>(dev: &D, experts: &GpuExperts<D>) -> Self {
        let cc = dev.compute_capability();
        let mma = cc >= (8, 0)
            && experts.gate.is_bf16()
            && experts.inter % 32 == 0
            && experts.hidden % 32 == 0;
        if mma {
            Self::TensorCores(crate::backend::moe_mma())
        } else {
            Self::CudaCores
        }
    }

    /// The launches of a pass of up to `tokens` tokens.
    fn launch(self, bf16: bool, tokens: usize) -> GroupedLaunch {
        match self {
            Self::TensorCores(mma) => {
                let (gate_up, down, chunk) = mma.kernels(tokens);
                GroupedLaunch {
                    gate_up,
                    down,
                    chunk,
                    rows: 128,
                    threads: 128,
                }
            }
            Self::CudaCores => GroupedLaunch {
                gate_up: if bf16 {
                    "moe_gate_up_grouped_bf16"
                } else {
                    "moe_gate_up_grouped_f32"
                },
                down: if bf16 {
                    "moe_down_grouped_bf16"
                } else {
                    "moe_down_grouped_f32"
                },
                chunk: GEMV_MAX_M,
                rows: 8,
                threads: 256,
            },
        }
    }
}

/// [`moe_experts`] by the tensor-core grouped kernels `mma`, whatever the batch's size (the
/// experts must be bf16, their widths multiples of 32, the device sm_80 or newer): what the
/// tests use to check that every [`MoeMma`] choice adds bitwise the same into `h`.
pub fn moe_experts_grouped_mma<D: Gpu>(
    dev: &D,
    a: MoeArgs<'_, D>,
    mma: MoeMma,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_experts_grouped";
    a.experts.check(OP)?;
    let t = a.x.len / a.experts.hidden.max(1);
    need(OP, "h", t * a.experts.hidden, a.h.len)?;
    match GroupedKernels::pick(dev, a.experts) {
        GroupedKernels::TensorCores(_) => {
            moe_experts_grouped_by(dev, a, GroupedKernels::TensorCores(mma))
        }
        GroupedKernels::CudaCores => Err(KernelError::InvalidParam {
            op: OP,
            field: "experts",
            limit: "bf16, widths multiples of 32, on sm_80 or newer",
            value: format!("{} x {}", a.experts.inter, a.experts.hidden),
        }),
    }
}

/// [`moe_experts`] for a batch: `moe_group` sorts the pairs by expert into chunks, the grouped
/// gate/up and down kernels read each expert's rows once per chunk (on tensor cores where
/// [`GroupedKernels::pick`] allows), and `moe_sum_slots` adds each token's slots into `h` in
/// slot order. The chunk count is known only on the device, so the grids are sized for the most
/// chunks the pass can have (`pairs / chunk` rounded up, plus one partial chunk per expert
/// touched) and the extra blocks return at once; nothing waits for the host, so a captured
/// decode graph replays it. `which`: the kernels.
fn moe_experts_grouped_by<D: Gpu>(
    dev: &D,
    a: MoeArgs<'_, D>,
    which: GroupedKernels,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_experts_grouped";
    let t = a.x.len / a.experts.hidden.max(1);
    if let GroupedKernels::TensorCores(mma) = which {
        if mma.pipelined(t) && moe_pipe_fits(a.experts) {
            return moe_experts_pipelined(dev, a);
        }
    }
    // The kernels (and so the chunk) for the largest pass; a pass halved below to fit the grid
    // keeps them.
    let plan = which.launch(a.experts.gate.is_bf16(), MOE_GROUPED_MAX_TOKENS.min(t));
    let passes = GroupedPasses::new(dev, &a, plan.chunk)?;
    let MoeArgs {
        x,
        routes,
        experts,
        h,
        ..
    } = a;
    let (hidden, inter, k) = (experts.hidden, experts.inter, routes.slots);
    let pairs_max = passes.per_pass * k;
    let act = dev.alloc::<f32>(pairs_max * inter)?;
    let y = dev.alloc::<f32>(pairs_max * hidden)?;
    let (gate_up, down) = (kernel(dev, plan.gate_up)?, kernel(dev, plan.down)?);
    let (k_i, inter_i, hidden_i) = (
        int(OP, "K", k)?,
        int(OP, "inter", inter)?,
        int(OP, "hidden", hidden)?,
    );
    let (order, chunks, n_chunks) = (&passes.order, &passes.chunks, &passes.n_chunks);
    for t0 in (0..t).step_by(passes.per_pass) {
        let n = passes.per_pass.min(t - t0);
        let bound = passes.chunk_bound(n * k) as u32;
        let wts = routes.weights.ptr + words(t0 * k);
        passes.group(dev, routes, t0..t0 + n)?;

        let mut a = KernelArgs::new();
        a.push(x.ptr + words(t0 * hidden))
            .push(order.ptr())
            .push(chunks.ptr())
            .push(n_chunks.ptr())
            .push(experts.gate.ptr())
            .push(experts.up.ptr())
            .push(act.ptr())
            .push(k_i)
            .push(inter_i)
            .push(hidden_i);
        let dims = LaunchDims {
            grid: (inter.div_ceil(plan.rows) as u32, bound, 1),
            block: (plan.threads, 1, 1),
            smem: 0,
        };
        dev.launch(&gate_up, dims, &mut a)?;

        let mut a = KernelArgs::new();
        a.push(act.ptr())
            .push(order.ptr())
            .push(chunks.ptr())
            .push(n_chunks.ptr())
            .push(wts)
            .push(experts.down.ptr())
            .push(y.ptr())
            .push(inter_i)
            .push(hidden_i);
        let dims = LaunchDims {
            grid: (hidden.div_ceil(plan.rows) as u32, bound, 1),
            block: (plan.threads, 1, 1),
            smem: 0,
        };
        dev.launch(&down, dims, &mut a)?;
        passes.sum_slots(dev, y.v(), h, t0..t0 + n)?;
    }
    Ok(())
}

/// Pairs per chunk of the pipelined expert kernels (common.cu's `MOE_PIPE_PAIRS`).
const MOE_PIPE_PAIRS: usize = 32;
/// Weight rows per block of the pipelined expert kernels (`MOE_PIPE_ROWS`): 64 gate + 64 up
/// output rows, or 128 down rows.
const MOE_PIPE_ROWS: usize = 128;
/// Dynamic shared memory of a pipelined expert block: `MOE_PIPE_STAGES` (3) stages of 128 weight
/// rows and 32 + 32 activation rows (hi, lo), each 64 + 8 bf16 wide.
const MOE_PIPE_SMEM: u32 = 3 * (MOE_PIPE_ROWS as u32 + 2 * MOE_PIPE_PAIRS as u32) * 72 * 2;

/// Whether the pipelined expert kernels ([`MoeMma::Pipe`]) take these experts: bf16, `inter` a
/// multiple of their 64-wide k step and gate/up blocks, `hidden` of the 128-row down blocks
/// (DeepSeek-V2-Lite: 1408 × 2048; V3: 2048 × 7168).
pub fn moe_pipe_fits<D: Gpu>(experts: &GpuExperts<D>) -> bool {
    experts.gate.is_bf16() && experts.inter % 64 == 0 && experts.hidden % MOE_PIPE_ROWS == 0
}

/// [`moe_experts_grouped_by`] by the pipelined kernels (`moe_{gate_up,down}_pipe`, common.cu):
/// `x` split once into bf16 hi and lo rows, then per pass `moe_group` into chunks of 32 pairs,
/// gate/up writing each pair's activation as bf16 hi and lo rows in `order`'s positions, down
/// reading them there, and the slot sum.
fn moe_experts_pipelined<D: Gpu>(dev: &D, a: MoeArgs<'_, D>) -> Result<(), KernelError> {
    const OP: &str = "gpu_moe_experts_pipelined";
    let passes = GroupedPasses::new(dev, &a, MOE_PIPE_PAIRS)?;
    let MoeArgs {
        x,
        routes,
        experts,
        h,
        x_split,
    } = a;
    let (hidden, inter, k) = (experts.hidden, experts.inter, routes.slots);
    let t = x.len / hidden.max(1);
    // The caller's split of x, or one made here; `_own` keeps the latter alive.
    let (_own, xs) = match x_split {
        Some(xs) => {
            need(OP, "x_split", 2 * x.len, xs.len)?;
            (None, xs.ptr)
        }
        None => {
            let own = bf16_rows(dev, x, GemmPrecision::Exact)?;
            let ptr = own.ptr();
            (Some(own), ptr)
        }
    };
    let pairs_max = passes.per_pass * k;
    let act = dev.alloc::<u16>(2 * pairs_max * inter)?;
    let y = dev.alloc::<f32>(pairs_max * hidden)?;
    let (gate_up, down) = (
        kernel(dev, "moe_gate_up_pipe")?,
        kernel(dev, "moe_down_pipe")?,
    );
    let (k_i, inter_i, hidden_i) = (
        int(OP, "K", k)?,
        int(OP, "inter", inter)?,
        int(OP, "hidden", hidden)?,
    );
    let (x_lo, act_lo) = (x.len as i64, (pairs_max * inter) as i64);
    for t0 in (0..t).step_by(passes.per_pass) {
        let n = passes.per_pass.min(t - t0);
        let bound = passes.chunk_bound(n * k) as u32;
        passes.group(dev, routes, t0..t0 + n)?;
        // A pass's pairs index tokens from t0: its hi rows start there, its lo rows x_lo on.
        let mut a = KernelArgs::new();
        a.push(xs + (t0 * hidden * 2) as u64)
            .push(x_lo)
            .push(passes.order.ptr())
            .push(passes.chunks.ptr())
            .push(passes.n_chunks.ptr())
            .push(experts.gate.ptr())
            .push(experts.up.ptr())
            .push(act.ptr())
            .push(act_lo)
            .push(k_i)
            .push(inter_i)
            .push(hidden_i);
        let dims = LaunchDims {
            grid: ((inter / 64) as u32, bound, 1),
            block: (128, 1, 1),
            smem: MOE_PIPE_SMEM,
        };
        dev.launch(&gate_up, dims, &mut a)?;

        let mut a = KernelArgs::new();
        a.push(act.ptr())
            .push(act_lo)
            .push(passes.order.ptr())
            .push(passes.chunks.ptr())
            .push(passes.n_chunks.ptr())
            .push(routes.weights.ptr + (t0 * k * 4) as u64)
            .push(experts.down.ptr())
            .push(y.ptr())
            .push(inter_i)
            .push(hidden_i);
        let dims = LaunchDims {
            grid: ((hidden / MOE_PIPE_ROWS) as u32, bound, 1),
            block: (128, 1, 1),
            smem: MOE_PIPE_SMEM,
        };
        dev.launch(&down, dims, &mut a)?;
        passes.sum_slots(dev, y.v(), h, t0..t0 + n)?;
    }
    Ok(())
}

/// The most chunks of up to `chunk` pairs that `pairs` pairs over `experts` experts can make:
/// whole chunks, plus one partial chunk per expert touched.
fn chunk_bound(pairs: usize, chunk: usize, experts: usize) -> usize {
    pairs.div_ceil(chunk) + experts.min(pairs)
}

/// The grouping shared by every grouped pass: tokens per pass, `moe_group`'s outputs, and the
/// slot sum that adds a pass's per-pair outputs into `h`.
struct GroupedPasses<D: Gpu> {
    /// Tokens per pass: the scratch bound, and the chunk bound within a grid's y dimension.
    per_pass: usize,
    /// (Token, slot) pairs of a token.
    slots: usize,
    /// Width of `h`'s rows.
    hidden: usize,
    /// Experts stacked.
    experts: usize,
    /// Pairs per chunk.
    chunk: usize,
    /// Pair indices, expert by expert.
    order: D::Buffer<i32>,
    /// `{expert, first index into order, pairs}` per chunk.
    chunks: D::Buffer<i32>,
    /// Chunks written.
    n_chunks: D::Buffer<i32>,
}

impl<D: Gpu> GroupedPasses<D> {
    const OP: &'static str = "gpu_moe_experts_grouped";

    /// Passes over the `t` tokens of `a`, grouped into chunks of up to `chunk` pairs.
    fn new(dev: &D, a: &MoeArgs<'_, D>, chunk: usize) -> Result<Self, KernelError> {
        let (hidden, slots, experts) = (a.experts.hidden, a.routes.slots, a.experts.total());
        let t = a.x.len / hidden.max(1);
        let chunk_bound = |pairs: usize| chunk_bound(pairs, chunk, experts);
        let mut per_pass = MOE_GROUPED_MAX_TOKENS.min(t);
        while per_pass > 1 && chunk_bound(per_pass * slots) > MAX_GRID_Y {
            per_pass /= 2;
        }
        let pairs_max = per_pass * slots;
        Ok(Self {
            per_pass,
            slots,
            hidden,
            experts,
            chunk,
            order: dev.alloc::<i32>(pairs_max)?,
            chunks: dev.alloc::<i32>(3 * chunk_bound(pairs_max))?,
            n_chunks: dev.alloc::<i32>(1)?,
        })
    }

    /// The most chunks `pairs` pairs can make: whole chunks, plus one partial chunk per expert
    /// touched. Grids are sized for it; blocks past the chunks written return at once.
    fn chunk_bound(&self, pairs: usize) -> usize {
        chunk_bound(pairs, self.chunk, self.experts)
    }

    /// `moe_group` over the pass's `tokens`.
    fn group(&self, dev: &D, routes: Routes, tokens: Range<usize>) -> Result<(), KernelError> {
        let op = Self::OP;
        let (t0, n) = (tokens.start, tokens.len());
        let mut a = KernelArgs::new();
        a.push(routes.ids.ptr + (t0 * self.slots * 4) as u64)
            .push(int(op, "pairs", n * self.slots)?)
            .push(int(op, "experts", self.experts)?)
            .push(int(op, "chunk", self.chunk)?)
            .push(self.order.ptr())
            .push(self.chunks.ptr())
            .push(self.n_chunks.ptr());
        dev.launch(
            &kernel(dev, "moe_group")?,
            LaunchDims::linear(1, 1024),
            &mut a,
        )
    }

    /// `h[t] += Σ_slots y[(t − start) · slots + s]` for the pass's `tokens`, slots in order.
    fn sum_slots(
        &self,
        dev: &D,
        y: Dv<f32>,
        h: Dv<f32>,
        tokens: Range<usize>,
    ) -> Result<(), KernelError> {
        let op = Self::OP;
        let (t0, n) = (tokens.start, tokens.len());
        let hidden = self.hidden;
        let mut a = KernelArgs::new();
        a.push(y.ptr)
            .push(h.ptr + (t0 * hidden * 4) as u64)
            .push(int(op, "K", self.slots)?)
            .push(int(op, "hidden", hidden)?)
            .push((n * hidden) as i64);
        let f = kernel(dev, "moe_sum_slots")?;
        dev.launch(&f, LaunchDims::elementwise(n * hidden), &mut a)
    }
}

/// Fills `x` with deterministic bf16 noise in `[-scale, scale)`.
pub fn fill_random_bf16<D: Gpu>(
    dev: &D,
    x: Dv<u16>,
    seed: u64,
    scale: f32,
) -> Result<(), KernelError> {
    if x.len == 0 {
        return Ok(());
    }
    let f = kernel(dev, "fill_random_bf16")?;
    let mut a = KernelArgs::new();
    a.push(x.ptr).push(x.len as i64).push(seed).push(scale);
    dev.launch(&f, LaunchDims::elementwise(x.len), &mut a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_batches_of_small_experts_stay_per_pair() {
        // The DSpark lease target: 512 × 256 bf16 experts (0.79 MB), 4 routed + 2 shared slots,
        // 34 stacked; DeepSeek-V2-Lite: 2048 × 1408 (17.3 MB), 6 + 2 slots, 66 stacked.
        let dspark = |tokens| MoeBatch {
            tokens,
            slots: 6,
            expert_bytes: 3 * 512 * 256 * 2,
            experts: 34,
        };
        let v2_lite = |tokens| MoeBatch {
            tokens,
            slots: 8,
            expert_bytes: 3 * 2048 * 1408 * 2,
            experts: 66,
        };
        let max = MOE_PER_PAIR_MAX_BYTES;
        // A verify forward of 9 rows stays per pair; 16 tokens × 6 slots read 75 MB: grouped.
        assert!(!dspark(7).grouped(max) && !dspark(9).grouped(max) && !dspark(13).grouped(max));
        assert!(dspark(16).grouped(max) && dspark(17).grouped(max));
        // The old rule when the bound is 0, and always for V2-Lite's experts.
        assert!(dspark(8).grouped(0) && !dspark(7).grouped(0));
        assert!(v2_lite(8).grouped(max) && !v2_lite(7).grouped(max));
        // Never past what `moe_group` counts.
        let many = MoeBatch {
            experts: MOE_MAX_EXPERTS + 1,
            ..v2_lite(64)
        };
        assert!(!many.grouped(max));
    }

    #[test]
    fn moe_down_rows_parse_print_and_fall_back() {
        for r in [
            MoeDownRows::One,
            MoeDownRows::Four,
            MoeDownRows::Eight,
            MoeDownRows::Sixteen,
        ] {
            assert_eq!(r.to_string().parse::<MoeDownRows>().expect("round trip"), r);
            assert_eq!(r.fitting(1408), r);
        }
        let e = "3".parse::<MoeDownRows>().expect_err("3 rows").to_string();
        assert!(e.contains("FERRY_MOE_DOWN_R") && e.contains('3'), "{e}");
        assert_eq!(MoeDownRows::default(), MoeDownRows::Eight);
        assert_eq!(MoeDownRows::Sixteen.fitting(36), MoeDownRows::Four);
        assert_eq!(MoeDownRows::One.fitting(36), MoeDownRows::One);
    }

    #[test]
    fn moe_mma_parses_and_prints_every_arm() {
        for (m, name) in MoeMma::ALL {
            assert_eq!(m.to_string(), name);
            assert_eq!(name.parse::<MoeMma>().expect("round trip"), m);
        }
        let e = "tiled".parse::<MoeMma>().expect_err("tiled").to_string();
        assert!(e.contains("FERRY_MOE_MMA") && e.contains("tiled"), "{e}");
        // The default prefetches up to the measured crossover and streams above it.
        let auto = MoeMma::default();
        assert_eq!(auto.kernels(1), MoeMma::Prefetch.kernels(1));
        assert_eq!(
            auto.kernels(MOE_PREFETCH_MAX_TOKENS),
            MoeMma::Prefetch.kernels(MOE_PREFETCH_MAX_TOKENS)
        );
        assert_eq!(
            auto.kernels(MOE_PREFETCH_MAX_TOKENS + 1),
            MoeMma::Prefetch32.kernels(MOE_PREFETCH_MAX_TOKENS + 1)
        );
        assert_eq!(auto.kernels(256), MoeMma::Prefetch32.kernels(256));
        assert_eq!(auto.kernels(257), MoeMma::Stream.kernels(257));
        assert_eq!(auto.kernels(2048), MoeMma::Stream.kernels(2048));
        assert_eq!(MoeMma::Stream32.kernels(1).2, 32);
        // A shape the pipelined kernels do not take falls back to `auto`'s register-streamed
        // choice.
        for t in [1, 200, 4096] {
            assert_eq!(MoeMma::Pipe.kernels(t), auto.kernels(t));
        }
        // Where the shape fits, `auto` takes the pipelined kernels from the measured size up;
        // `pipe` at every size; the other arms never.
        assert!(!auto.pipelined(MOE_PIPE_MIN_TOKENS - 1));
        assert!(auto.pipelined(MOE_PIPE_MIN_TOKENS));
        assert!(auto.pipelined(8192));
        assert!(MoeMma::Pipe.pipelined(1));
        for (m, _) in MoeMma::ALL {
            if !matches!(m, MoeMma::Auto | MoeMma::Pipe) {
                assert!(!m.pipelined(4096), "{m}");
            }
        }
    }

    #[test]
    fn the_register_router_takes_up_to_256_experts_32_groups_and_top_32() {
        let p = |n_experts, n_group, top_k| RouteParams {
            n_experts,
            top_k,
            n_group,
            topk_group: 1,
            norm_topk: 0,
            n_shared: 0,
            scale: 1.0,
            softmax: 1,
        };
        assert!(RouteKernel::Registers.fits(&p(64, 1, 6)));
        assert!(RouteKernel::Registers.fits(&p(256, 8, 8)));
        assert!(!RouteKernel::Registers.fits(&p(384, 8, 8)));
        assert!(!RouteKernel::Registers.fits(&p(256, 64, 8)));
        assert!(!RouteKernel::Registers.fits(&p(256, 8, 33)));
        assert!(RouteKernel::Shared.fits(&p(384, 8, 8)));
    }
}
