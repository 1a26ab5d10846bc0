//! Dense weights and `y = x · Wᵀ` with f32 accumulation.
//!
//! [`Matrix`] stores a weight exactly like torch's `nn.Linear.weight`: row-major
//! `[out_features][in_features]`, in bf16 or f32. [`linear`] picks one of two paths:
//!
//! | tokens `m` | path | why |
//! |---|---|---|
//! | `<= 4` (decode) | GEMV over weight rows, bf16 widened as it is read; rows split across rayon's threads from 64K multiply-adds | memory-bound: read each weight once, no scratch; a small product stays on the calling thread, where waking the pool would cost more than it saves |
//! | `> 4` (prefill) | `gemm` crate SGEMM with `W` passed through transposed strides | compute-bound: blocked, multi-threaded kernel |
//!
//! bf16 weights on the SGEMM path are widened to f32 one row panel at a time (about 4 MiB of
//! scratch) rather than keeping a second, f32 copy of every weight.

use half::bf16;
use rayon::prelude::*;

use crate::error::KernelError;

/// Largest token count served by the GEMV path.
pub(crate) const GEMV_MAX_TOKENS: usize = 4;
/// Weight rows per rayon task on the GEMV path.
const GEMV_ROWS_PER_TASK: usize = 32;
/// Multiply-adds below which a GEMV (and a decode step's MLA absorption) runs on the calling
/// thread: waking the pool's threads costs more than they save on a small product.
pub(crate) const GEMV_PAR_MIN_MACS: usize = 1 << 16;
/// f32 elements of widened bf16 weight per SGEMM panel (4 MiB).
const PANEL_ELEMS: usize = 1 << 20;

/// Element storage of a [`Matrix`].
#[derive(Debug, Clone, PartialEq)]
pub enum MatrixData {
    /// bfloat16 weights, as checkpoints ship them.
    Bf16(Vec<bf16>),
    /// f32 weights (tests, and tensors that checkpoints keep in f32).
    F32(Vec<f32>),
}

/// A row-major `[rows][cols]` weight, `rows = out_features`, `cols = in_features`.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: MatrixData,
}

impl Matrix {
    /// Bytes of storage (2 per bf16 element, 4 per f32).
    pub fn bytes(&self) -> usize {
        match &self.data {
            MatrixData::Bf16(d) => d.len() * 2,
            MatrixData::F32(d) => d.len() * 4,
        }
    }

    /// Wraps bf16 data; `data.len()` must be `rows * cols`.
    pub fn from_bf16(rows: usize, cols: usize, data: Vec<bf16>) -> Result<Self, KernelError> {
        check_elems(rows, cols, data.len())?;
        Ok(Self {
            rows,
            cols,
            data: MatrixData::Bf16(data),
        })
    }

    /// Wraps f32 data; `data.len()` must be `rows * cols`.
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, KernelError> {
        check_elems(rows, cols, data.len())?;
        Ok(Self {
            rows,
            cols,
            data: MatrixData::F32(data),
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored elements.
    pub fn data(&self) -> &MatrixData {
        &self.data
    }

    /// Copies row `r` into `out` as f32 (an embedding lookup when the matrix is a table).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if r >= self.rows {
            return Err(KernelError::IndexOutOfRange {
                op: "row_f32",
                what: "row",
                index: r,
                len: self.rows,
            });
        }
        check_len("row_f32", "out", self.cols, out.len())?;
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            MatrixData::F32(d) => out.copy_from_slice(&d[range]),
            MatrixData::Bf16(d) => widen(&d[range], out),
        }
        Ok(())
    }

    /// All elements as f32, row-major.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            MatrixData::F32(d) => d.clone(),
            MatrixData::Bf16(d) => d.iter().map(|v| v.to_f32()).collect(),
        }
    }

    /// A copy of rows `start..start + count`, in the same element type.
    pub fn slice_rows(&self, start: usize, count: usize) -> Result<Matrix, KernelError> {
        let end = start.checked_add(count).filter(|&e| e <= self.rows).ok_or(
            KernelError::IndexOutOfRange {
                op: "slice_rows",
                what: "end row",
                index: start.saturating_add(count),
                len: self.rows + 1,
            },
        )?;
        let range = start * self.cols..end * self.cols;
        let data = match &self.data {
            MatrixData::F32(d) => MatrixData::F32(d[range].to_vec()),
            MatrixData::Bf16(d) => MatrixData::Bf16(d[range].to_vec()),
        };
        Ok(Matrix {
            rows: count,
            cols: self.cols,
            data,
        })
    }
}

/// `out[m][rows] = x[m][cols] · Wᵀ`, f32 accumulation; `m = x.len() / w.cols()`.
pub fn linear(x: &[f32], w: &Matrix, out: &mut [f32]) -> Result<(), KernelError> {
    let (n, k) = (w.rows, w.cols);
    if k == 0 {
        return Err(KernelError::InvalidParam {
            op: "linear",
            field: "w.cols",
            limit: "> 0",
            value: "0".into(),
        });
    }
    if x.len() % k != 0 {
        return Err(KernelError::NotDivisible {
            op: "linear",
            what: "x",
            len: x.len(),
            width: k,
        });
    }
    let m = x.len() / k;
    check_len("linear", "out", m * n, out.len())?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if m <= GEMV_MAX_TOKENS {
        gemv(x, m, w, out);
        return Ok(());
    }
    match &w.data {
        MatrixData::F32(d) => {
            let call = GemmCall {
                m,
                k,
                n,
                lhs: x,
                rhs: d,
                rhs_rs: 1,
                rhs_cs: k,
            };
            sgemm(&call, out, n);
        }
        MatrixData::Bf16(d) => {
            let panel_rows = (PANEL_ELEMS / k).max(16).min(n);
            let mut scratch = vec![0.0f32; panel_rows * k];
            for j0 in (0..n).step_by(panel_rows) {
                let p = panel_rows.min(n - j0);
                let panel = &mut scratch[..p * k];
                panel
                    .par_chunks_mut(k)
                    .zip(d[j0 * k..(j0 + p) * k].par_chunks(k))
                    .for_each(|(dst, src)| widen(src, dst));
                let call = GemmCall {
                    m,
                    k,
                    n: p,
                    lhs: x,
                    rhs: panel,
                    rhs_rs: 1,
                    rhs_cs: k,
                };
                sgemm(&call, &mut out[j0..], n);
            }
        }
    }
    Ok(())
}

/// Shape of a [`matmul_f32`] product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulDims {
    /// Rows of `a` and of `out`.
    pub m: usize,
    /// Contraction length.
    pub k: usize,
    /// Columns of `out`.
    pub n: usize,
    /// `b` is stored `[n][k]` (use it transposed) rather than `[k][n]`.
    pub b_transposed: bool,
}

/// `out[m][n] = a[m][k] · b`, with `b` either `[k][n]` or (transposed) `[n][k]`; all f32.
pub fn matmul_f32(
    a: &[f32],
    b: &[f32],
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let MatmulDims {
        m,
        k,
        n,
        b_transposed,
    } = dims;
    check_len("matmul_f32", "a", m * k, a.len())?;
    check_len("matmul_f32", "b", k * n, b.len())?;
    check_len("matmul_f32", "out", m * n, out.len())?;
    let (rhs_rs, rhs_cs) = if b_transposed { (1, k) } else { (n, 1) };
    sgemm(
        &GemmCall {
            m,
            k,
            n,
            lhs: a,
            rhs: b,
            rhs_rs,
            rhs_cs,
        },
        out,
        n,
    );
    Ok(())
}

/// One SGEMM: `lhs` is contiguous row-major `[m][k]`; element `(kk, j)` of the right-hand
/// `[k][n]` operand is `rhs[kk * rhs_rs + j * rhs_cs]`.
struct GemmCall<'a> {
    m: usize,
    k: usize,
    n: usize,
    lhs: &'a [f32],
    rhs: &'a [f32],
    rhs_rs: usize,
    rhs_cs: usize,
}

/// `dst[i * dst_rs + j] = Σ_kk lhs[i][kk] · rhs(kk, j)` for `i < m`, `j < n`, multi-threaded.
fn sgemm(call: &GemmCall<'_>, dst: &mut [f32], dst_rs: usize) {
    let GemmCall {
        m,
        k,
        n,
        lhs,
        rhs,
        rhs_rs,
        rhs_cs,
    } = *call;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            dst[i * dst_rs..i * dst_rs + n].fill(0.0);
        }
        return;
    }
    // The raw-pointer call below is only sound if every element it touches is in bounds.
    assert!(lhs.len() >= m * k, "invariant: lhs holds [m][k]");
    assert!(
        rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs,
        "invariant: rhs holds [k][n] at its strides"
    );
    assert!(
        dst.len() >= (m - 1) * dst_rs + n && dst_rs >= n,
        "invariant: dst holds [m][n] at its stride"
    );
    let to_isize = |v: usize| {
        isize::try_from(v).expect("invariant: strides of in-memory buffers fit in isize")
    };
    // SAFETY: the asserts above prove that every index the kernel forms, `i * dst_rs + j` into
    // `dst`, `i * k + kk` into `lhs` and `kk * rhs_rs + j * rhs_cs` into `rhs` (i < m, j < n,
    // kk < k), lies inside its slice; `dst` is borrowed mutably, so nothing else aliases it while
    // `gemm` writes, and `lhs`/`rhs` are shared borrows that outlive the call. All strides are
    // non-negative and fit in `isize` (checked by `to_isize`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            to_isize(dst_rs),
            false,
            lhs.as_ptr(),
            1,
            to_isize(k),
            rhs.as_ptr(),
            to_isize(rhs_cs),
            to_isize(rhs_rs),
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

/// Decode path: each weight row is read once and dotted with every token.
fn gemv(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    // Row-major over weight rows so each task owns a contiguous slice: `[n][m]`.
    let mut by_row = vec![0.0f32; n * m];
    let task = |(task, dst): (usize, &mut [f32])| {
        let first = task * GEMV_ROWS_PER_TASK;
        for (i, dst_row) in dst.chunks_exact_mut(m).enumerate() {
            for (t, v) in dst_row.iter_mut().enumerate() {
                *v = row_dot(w, first + i, &x[t * k..(t + 1) * k]);
            }
        }
    };
    if n * k * m >= GEMV_PAR_MIN_MACS {
        by_row
            .par_chunks_mut(m * GEMV_ROWS_PER_TASK)
            .enumerate()
            .for_each(task);
    } else {
        by_row
            .chunks_mut(m * GEMV_ROWS_PER_TASK)
            .enumerate()
            .for_each(task);
    }
    for (r, vals) in by_row.chunks_exact(m).enumerate() {
        for (t, v) in vals.iter().enumerate() {
            out[t * n + r] = *v;
        }
    }
}

/// f32 dot product with 16 independent accumulators (vectorisable, deterministic order).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(a, b, |v| v)
}

/// [`dot`] against bf16 weights widened as they are read (no widened copy of the row): the
/// same products in the same order, so bitwise `dot(a, widen(b))`.
fn dot_bf16(a: &[f32], b: &[bf16]) -> f32 {
    dot_with(a, b, bf16_bits_to_f32)
}

/// `Σ_j x[j] · W[row][j]`: one weight row (bf16 widened as read) dotted with `x`, in [`dot`]'s
/// order. `row < w.rows()` and `x.len() == w.cols()` are the caller's invariants.
pub(crate) fn row_dot(w: &Matrix, row: usize, x: &[f32]) -> f32 {
    let cols = row * w.cols..(row + 1) * w.cols;
    match &w.data {
        MatrixData::F32(d) => dot(x, &d[cols]),
        MatrixData::Bf16(d) => dot_bf16(x, &d[cols]),
    }
}

/// `acc[j] += alpha · W[row][j]` over one weight row (bf16 widened as read). `row < w.rows()`
/// and `acc.len() == w.cols()` are the caller's invariants.
pub(crate) fn row_axpy(w: &Matrix, row: usize, alpha: f32, acc: &mut [f32]) {
    let cols = row * w.cols..(row + 1) * w.cols;
    match &w.data {
        MatrixData::F32(d) => {
            for (a, v) in acc.iter_mut().zip(&d[cols]) {
                *a += alpha * v;
            }
        }
        MatrixData::Bf16(d) => {
            for (a, v) in acc.iter_mut().zip(&d[cols]) {
                *a += alpha * bf16_bits_to_f32(*v);
            }
        }
    }
}

/// The dot product behind [`dot`] and [`dot_bf16`]: `Σ a[i] · f(b[i])` over 16 lanes, then a
/// pairwise fold of the lanes and the tail added last.
#[inline(always)]
fn dot_with<T: Copy>(a: &[f32], b: &[T], f: impl Fn(T) -> f32) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * f(*y))
        .sum();
    for (xa, xb) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += xa[l] * f(xb[l]);
        }
    }
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// One bf16 as f32 (exact: bf16 is the top half of an f32). A plain shift, which the compiler
/// vectorises; `bf16::to_f32` also quiets signalling NaNs, a branch that kept loops over it
/// scalar (a NaN weight stays a NaN either way).
#[inline(always)]
fn bf16_bits_to_f32(v: bf16) -> f32 {
    f32::from_bits(u32::from(v.to_bits()) << 16)
}

/// Widens bf16 to f32 ([`bf16_bits_to_f32`]).
fn widen(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_bits_to_f32(*s);
    }
}

fn check_elems(rows: usize, cols: usize, len: usize) -> Result<(), KernelError> {
    let expected = rows.checked_mul(cols).ok_or(KernelError::InvalidParam {
        op: "matrix",
        field: "rows * cols",
        limit: "representable in usize",
        value: format!("{rows} * {cols}"),
    })?;
    check_len("matrix", "data", expected, len)
}

pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::ShapeMismatch {
            op,
            what,
            expected,
            got,
        })
    }
}
