//! Sampling on the backend: the distribution a batch of rows samples from, inverse-CDF draws,
//! argmax.
//!
//! The semantics are the CPU sampler's, row by row ([`crate::cpu::sample`]): [`probs`] is
//! [`probs_from_logits`] (softmax at temperature, top-k, top-p, min-p, pivot ties kept; a
//! one-hot at the argmax for greedy rows), [`draw`] is [`sample_from_probs`], [`argmax`] is
//! [`crate::cpu::sample::argmax`]. The CPU arm calls those functions (bit-identical); the GPU
//! arms (CUDA and ROCm, one launcher) run one block per row (`gpu/sample.cu`), within the
//! tolerances stated in `crate::gpu::sample`.
//!
//! **Failure isolation.** A row whose distribution is degenerate (non-finite logits, or no
//! positive kept mass) does not fail the batch: [`probs`] writes it as all NaN, and [`draw`]
//! gives -1 for it (as does `verify` for a sequence that reaches it), so the caller fails that
//! request alone.
//!
//! ```
//! use ferry_kernels::backend::sample::{draw, probs, Draw, Probs, RowParams, Uniforms};
//! use ferry_kernels::backend::Backend;
//! use ferry_kernels::cpu::sample::SamplingParams;
//!
//! let b = Backend::Cpu;
//! let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
//! let params = RowParams::new(&b, &[greedy, SamplingParams::default()]).unwrap();
//! let logits = b.upload(&[0.0, 3.0, 1.0, 0.0, 0.0, 9.0]).unwrap();
//! let p = probs(&b, Probs { logits: &logits, vocab: 3, params: &params }).unwrap();
//! let u = Uniforms::new(&b, &[0.5, 0.5]).unwrap();
//! let tokens = draw(&b, Draw { probs: &p, vocab: 3, uniforms: &u }).unwrap();
//! assert_eq!(tokens.to_host().unwrap(), vec![1, 2]);
//! ```

use super::{Backend, Ints, Tensor};
use crate::cpu::logits::{RowControls, RowLogprobs};
use crate::cpu::sample::{probs_from_logits, sample_from_probs, SamplingParams};
#[cfg(feature = "cuda")]
use crate::cuda::DeviceBuffer;
#[cfg(any(feature = "cuda", feature = "rocm"))]
use crate::gpu::launch::{DeviceMem, Dv};
#[cfg(feature = "rocm")]
use crate::rocm::HipBuffer;
use crate::KernelError;

/// Per-row sampling parameters on a backend (validated). On a GPU they are also uploaded,
/// packed as the distribution kernel reads them.
#[derive(Debug)]
pub struct RowParams {
    host: Vec<SamplingParams>,
    device: PackedParams,
}

/// [`RowParams`]' packed rows where the backend is a GPU.
#[derive(Debug)]
enum PackedParams {
    /// The CPU reads the parameters as given.
    Host,
    #[cfg(feature = "cuda")]
    Cuda(DeviceBuffer<u32>),
    #[cfg(feature = "rocm")]
    Rocm(HipBuffer<u32>),
}

impl RowParams {
    /// One row per entry of `params`, each checked with [`SamplingParams::validate`] (the error
    /// names the field).
    pub fn new(b: &Backend, params: &[SamplingParams]) -> Result<Self, KernelError> {
        for p in params {
            p.validate()?;
        }
        Ok(Self {
            device: match b {
                Backend::Cpu => PackedParams::Host,
                #[cfg(feature = "cuda")]
                Backend::Cuda(d) => {
                    PackedParams::Cuda(d.upload(&crate::gpu::sample::pack_params(params))?)
                }
                #[cfg(feature = "rocm")]
                Backend::Rocm(d) => {
                    PackedParams::Rocm(d.upload(&crate::gpu::sample::pack_params(params))?)
                }
            },
            host: params.to_vec(),
        })
    }

    /// Overwrites every row's parameters in place (same row count; each checked as in
    /// [`Self::new`]): a captured graph reads the new values on its next replay.
    pub fn write(&mut self, params: &[SamplingParams]) -> Result<(), KernelError> {
        check_len("row_params", "params", self.host.len(), params.len())?;
        for p in params {
            p.validate()?;
        }
        match &mut self.device {
            PackedParams::Host => {}
            #[cfg(feature = "cuda")]
            PackedParams::Cuda(buf) => {
                let dev = buf.device().clone();
                dev.write(buf, 0, &crate::gpu::sample::pack_params(params))?;
            }
            #[cfg(feature = "rocm")]
            PackedParams::Rocm(buf) => {
                let dev = buf.device().clone();
                dev.write(buf, 0, &crate::gpu::sample::pack_params(params))?;
            }
        }
        self.host.clone_from_slice(params);
        Ok(())
    }

    /// The rows of a batch of drafted blocks: sequence `s`'s parameters repeated `γ_s + 1`
    /// times (its draft positions and the bonus position), as `verify`'s `p` rows are laid out.
    pub fn for_blocks(
        b: &Backend,
        per_sequence: &[SamplingParams],
        gammas: &[usize],
    ) -> Result<Self, KernelError> {
        if per_sequence.len() != gammas.len() {
            return Err(KernelError::ShapeMismatch {
                op: "row_params",
                what: "gammas",
                expected: per_sequence.len(),
                got: gammas.len(),
            });
        }
        let rows: Vec<SamplingParams> = per_sequence
            .iter()
            .zip(gammas)
            .flat_map(|(p, &g)| std::iter::repeat_n(p.clone(), g + 1))
            .collect();
        Self::new(b, &rows)
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The parameters as given.
    pub fn params(&self) -> &[SamplingParams] {
        &self.host
    }

    /// The packed device rows on the runtime `D`, or a mismatch error when they were built
    /// for another backend.
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    fn dv<D: OnSample>(&self, op: &'static str) -> Result<Dv<u32>, KernelError> {
        let got = match &self.device {
            PackedParams::Host => "CPU",
            #[cfg(feature = "cuda")]
            PackedParams::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            PackedParams::Rocm(_) => "ROCm device",
        };
        D::params(self)
            .map(|b| b.v())
            .ok_or_else(|| super::mismatch_on::<D>(op, "params", got))
    }
}

/// Where the sampling buffers of a runtime live in [`RowParams`] and [`Uniforms`].
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) trait OnSample: super::OnDevice {
    /// The packed parameter rows, if they live on this runtime.
    fn params(p: &RowParams) -> Option<&Self::Buffer<u32>>;
    /// The uniforms, if they live on this runtime.
    fn uniforms(u: &Uniforms) -> Option<&Self::Buffer<f64>>;
}

#[cfg(feature = "cuda")]
impl OnSample for crate::cuda::CudaDevice {
    fn params(p: &RowParams) -> Option<&DeviceBuffer<u32>> {
        match &p.device {
            PackedParams::Cuda(b) => Some(b),
            _ => None,
        }
    }
    fn uniforms(u: &Uniforms) -> Option<&DeviceBuffer<f64>> {
        match u {
            Uniforms::Cuda(b) => Some(b),
            _ => None,
        }
    }
}

#[cfg(feature = "rocm")]
impl OnSample for crate::rocm::RocmDevice {
    fn params(p: &RowParams) -> Option<&HipBuffer<u32>> {
        match &p.device {
            PackedParams::Rocm(b) => Some(b),
            _ => None,
        }
    }
    fn uniforms(u: &Uniforms) -> Option<&HipBuffer<f64>> {
        match u {
            Uniforms::Rocm(b) => Some(b),
            _ => None,
        }
    }
}

/// Uniform draws in `[0, 1)` as f64, one per row drawn (or, for `verify`, per draft plus one
/// per sequence), on a backend.
#[derive(Debug)]
pub enum Uniforms {
    /// Host memory.
    Host(Vec<f64>),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(DeviceBuffer<f64>),
    /// ROCm device memory.
    #[cfg(feature = "rocm")]
    Rocm(HipBuffer<f64>),
}

/// Every `u` finite and in `[0, 1)`.
fn check_uniforms(u: &[f64]) -> Result<(), KernelError> {
    match u.iter().position(|v| !(0.0..1.0).contains(v)) {
        None => Ok(()),
        Some(i) => Err(KernelError::InvalidParam {
            op: "uniforms",
            field: "uniforms",
            limit: "in [0, 1)",
            value: format!("{} at index {i}", u[i]),
        }),
    }
}

impl Uniforms {
    /// `u` on `b`; each value must be in `[0, 1)`.
    pub fn new(b: &Backend, u: &[f64]) -> Result<Self, KernelError> {
        check_uniforms(u)?;
        Ok(match b {
            Backend::Cpu => Uniforms::Host(u.to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Uniforms::Cuda(d.upload(u)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Uniforms::Rocm(d.upload(u)?),
        })
    }

    /// Overwrites the first `u.len()` draws in place (a captured graph reads the new values).
    pub fn write(&mut self, u: &[f64]) -> Result<(), KernelError> {
        check_uniforms(u)?;
        match self {
            Uniforms::Host(h) => {
                let got = h.len();
                let dst = h.get_mut(..u.len()).ok_or(KernelError::ShapeMismatch {
                    op: "uniforms_write",
                    what: "dst",
                    expected: u.len(),
                    got,
                })?;
                dst.copy_from_slice(u);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Uniforms::Cuda(buf) => buf.device().clone().write(buf, 0, u),
            #[cfg(feature = "rocm")]
            Uniforms::Rocm(buf) => buf.device().clone().write(buf, 0, u),
        }
    }

    /// Draws.
    pub fn len(&self) -> usize {
        match self {
            Uniforms::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Uniforms::Cuda(b) => b.len(),
            #[cfg(feature = "rocm")]
            Uniforms::Rocm(b) => b.len(),
        }
    }

    /// Whether it holds no draw.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host slice, or a mismatch error.
    pub fn host(&self, op: &'static str) -> Result<&[f64], KernelError> {
        match self {
            Uniforms::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            u => Err(super::mismatch(op, "uniforms", &Backend::Cpu, u.place())),
        }
    }

    fn place(&self) -> &'static str {
        match self {
            Uniforms::Host(_) => "CPU",
            #[cfg(feature = "cuda")]
            Uniforms::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Uniforms::Rocm(_) => "ROCm device",
        }
    }

    /// The CUDA device view, or a mismatch error.
    #[cfg(feature = "cuda")]
    pub fn dv(&self, op: &'static str) -> Result<Dv<f64>, KernelError> {
        self.view::<crate::cuda::CudaDevice>(op)
    }

    /// The device view on the runtime `D`, or a mismatch error.
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    pub(crate) fn view<D: OnSample>(&self, op: &'static str) -> Result<Dv<f64>, KernelError> {
        D::uniforms(self)
            .map(|b| b.v())
            .ok_or_else(|| super::mismatch_on::<D>(op, "uniforms", self.place()))
    }
}

/// `vocab` in `1..=i32::MAX` (token ids travel as i32).
pub(crate) fn check_vocab(op: &'static str, vocab: usize) -> Result<(), KernelError> {
    if vocab == 0 || i32::try_from(vocab).is_err() {
        return Err(KernelError::InvalidParam {
            op,
            field: "vocab",
            limit: "in 1..2^31",
            value: vocab.to_string(),
        });
    }
    Ok(())
}

/// `got == expected`, or a shape error naming `op` and `what`.
pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if got == expected {
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

/// Applies each listed row's [`RowControls`] (penalties, `logit_bias`, `min_tokens` mask) to
/// `[rows][vocab]` logits in place: [`crate::cpu::logits::apply_controls`] on every backend,
/// so plain draws, argmax and verification all see the processed rows.
///
/// On the CPU the rows are processed where they are. On a GPU the listed rows are gathered,
/// copied to the host, processed there and written back (one gather, one download, one upload
/// and one device copy per row): only batches holding a request that uses these controls pay
/// it, every other batch keeps the device-only path.
pub fn apply_controls(
    b: &Backend,
    logits: &mut Tensor,
    vocab: usize,
    rows: &[(usize, RowControls<'_>)],
) -> Result<(), KernelError> {
    const OP: &str = "apply_controls";
    check_vocab(OP, vocab)?;
    let total = logits.len() / vocab;
    if let Some(&(r, _)) = rows.iter().find(|(r, _)| *r >= total) {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "row",
            limit: "below the logits' rows",
            value: format!("{r} of {total}"),
        });
    }
    let rows: Vec<&(usize, RowControls<'_>)> = rows.iter().filter(|(_, c)| !c.is_noop()).collect();
    if rows.is_empty() {
        return Ok(());
    }
    match b {
        Backend::Cpu => {
            let x = logits.host_mut(OP, "logits")?;
            for &&(r, ref c) in &rows {
                crate::cpu::logits::apply_controls(&mut x[r * vocab..(r + 1) * vocab], c)?;
            }
            Ok(())
        }
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        _ => apply_controls_through_host(b, logits, vocab, &rows),
    }
}

/// [`apply_controls`] on a GPU: gather the rows, process them on the host, write them back.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn apply_controls_through_host(
    b: &Backend,
    logits: &mut Tensor,
    vocab: usize,
    rows: &[&(usize, RowControls<'_>)],
) -> Result<(), KernelError> {
    let at = b.ints(rows.iter().map(|(r, _)| *r as i32).collect())?;
    let picked = super::rows::gather(
        b,
        super::rows::Gather {
            src: logits,
            rows: &at,
            width: vocab,
        },
    )?;
    let mut host = picked.into_host()?;
    for (&&(r, ref c), row) in rows.iter().zip(host.chunks_exact_mut(vocab)) {
        crate::cpu::logits::apply_controls(row, c)?;
        b.copy_into(&b.upload(row)?, logits, r * vocab)?;
    }
    Ok(())
}

/// The raw log-softmax of the listed `(row, top_n)` rows of `[rows][vocab]` logits
/// ([`RowLogprobs`], in list order), for requests that ask for log-probabilities. The rows are
/// copied to the host (on a GPU one gather and one download for all of them) and reduced
/// there; nothing is copied when the list is empty. A row without a finite maximum is an
/// error for that row alone.
pub fn row_logprobs(
    b: &Backend,
    logits: &Tensor,
    vocab: usize,
    rows: &[(usize, usize)],
) -> Result<Vec<Result<RowLogprobs, KernelError>>, KernelError> {
    const OP: &str = "row_logprobs";
    check_vocab(OP, vocab)?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let at = b.ints(rows.iter().map(|&(r, _)| r as i32).collect())?;
    let host = super::rows::gather(
        b,
        super::rows::Gather {
            src: logits,
            rows: &at,
            width: vocab,
        },
    )?
    .into_host()?;
    Ok(host
        .chunks_exact(vocab)
        .zip(rows)
        .map(|(row, &(_, n))| RowLogprobs::new(row.to_vec(), n))
        .collect())
}

/// The sampling distributions of a batch of rows.
#[derive(Debug, Clone, Copy)]
pub struct Probs<'a> {
    /// `[rows][vocab]` logits, `rows = params.len()`.
    pub logits: &'a Tensor,
    /// Entries per row.
    pub vocab: usize,
    /// One row of parameters per logits row.
    pub params: &'a RowParams,
}

/// `[rows][vocab]` probabilities, a new tensor on `b`: per row
/// [`probs_from_logits`]`(row, params[row])`, or all NaN for a degenerate row.
pub fn probs(b: &Backend, p: Probs<'_>) -> Result<Tensor, KernelError> {
    let mut out = b.scratch(p.params.len() * p.vocab)?;
    probs_into(b, p, &mut out)?;
    Ok(out)
}

/// [`probs`] into an existing `[rows][vocab]` tensor (a captured graph's buffer).
pub fn probs_into(b: &Backend, p: Probs<'_>, out: &mut Tensor) -> Result<(), KernelError> {
    const OP: &str = "sample_probs";
    check_vocab(OP, p.vocab)?;
    let rows = p.params.len();
    check_len(OP, "logits", rows * p.vocab, p.logits.len())?;
    check_len(OP, "out", rows * p.vocab, out.len())?;
    match b {
        Backend::Cpu => {
            let logits = p.logits.host(OP, "logits")?;
            let dst = out.host_mut(OP, "out")?;
            let rows = logits
                .chunks_exact(p.vocab)
                .zip(dst.chunks_exact_mut(p.vocab));
            for ((x, y), params) in rows.zip(p.params.params()) {
                match probs_from_logits(x, params) {
                    Ok(v) => y.copy_from_slice(&v),
                    Err(KernelError::DegenerateDistribution { .. }) => y.fill(f32::NAN),
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => probs_on(dev, p, out),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => probs_on(dev, p, out),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn probs_on<D: OnSample>(dev: &D, p: Probs<'_>, out: &Tensor) -> Result<(), KernelError> {
    const OP: &str = "sample_probs";
    let (x, y, prm) = (
        super::tv::<D>(p.logits, OP, "logits")?,
        super::tv::<D>(out, OP, "out")?,
        p.params.dv::<D>(OP)?,
    );
    crate::gpu::sample::probs(dev, x, y, prm, p.vocab)
}

/// One inverse-CDF draw per row.
#[derive(Debug, Clone, Copy)]
pub struct Draw<'a> {
    /// `[rows][vocab]` probabilities (from [`probs`]), `rows = uniforms.len()`.
    pub probs: &'a Tensor,
    /// Entries per row.
    pub vocab: usize,
    /// One uniform per row.
    pub uniforms: &'a Uniforms,
}

/// `[rows]` token ids, a new index array on `b`: per row
/// [`sample_from_probs`]`(row, uniforms[row])`, or -1 where the row has no distribution (total
/// not finite and positive, or a negative entry — a row [`probs`] marked degenerate).
pub fn draw(b: &Backend, d: Draw<'_>) -> Result<Ints, KernelError> {
    draw_rows(b, d, 0, d.uniforms.len())
}

/// [`draw`] of `probs.len() / vocab` rows with the draws `uniforms[first..]`: a drafter pass
/// keeps every block position's draws in one buffer, written once per pass.
pub fn draw_at(b: &Backend, d: Draw<'_>, first: usize) -> Result<Ints, KernelError> {
    const OP: &str = "sample_draw";
    check_vocab(OP, d.vocab)?;
    let rows = d.probs.len() / d.vocab;
    if first + rows > d.uniforms.len() {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            what: "uniforms",
            expected: first + rows,
            got: d.uniforms.len(),
        });
    }
    draw_rows(b, d, first, rows)
}

fn draw_rows(b: &Backend, d: Draw<'_>, first: usize, rows: usize) -> Result<Ints, KernelError> {
    const OP: &str = "sample_draw";
    check_vocab(OP, d.vocab)?;
    check_len(OP, "probs", rows * d.vocab, d.probs.len())?;
    match b {
        Backend::Cpu => {
            let probs = d.probs.host(OP, "probs")?;
            let u = &d.uniforms.host(OP)?[first..first + rows];
            let mut out = Vec::with_capacity(rows);
            for (row, &u) in probs.chunks_exact(d.vocab).zip(u) {
                out.push(match sample_from_probs(row, u) {
                    // Below vocab, which fits an i32 (checked above).
                    Ok(t) => t as i32,
                    Err(KernelError::DegenerateDistribution { .. }) => -1,
                    Err(e) => return Err(e),
                });
            }
            Ok(Ints::Host(out))
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => draw_on(dev, d, first, rows),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => draw_on(dev, d, first, rows),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn draw_on<D: OnSample>(
    dev: &D,
    d: Draw<'_>,
    first: usize,
    rows: usize,
) -> Result<Ints, KernelError> {
    const OP: &str = "sample_draw";
    let out = dev.alloc::<i32>(rows)?;
    let (probs, u) = (
        super::tv::<D>(d.probs, OP, "probs")?,
        d.uniforms.view::<D>(OP)?.sub(first, rows)?,
    );
    crate::gpu::sample::draw(dev, probs, u, out.v(), d.vocab)?;
    Ok(D::into_ints(out))
}

/// `[rows]` argmax of each `[vocab]` row of `logits` (ties to the lowest index, NaN never
/// chosen), a new index array on `b`.
pub fn argmax(b: &Backend, logits: &Tensor, vocab: usize) -> Result<Ints, KernelError> {
    const OP: &str = "sample_argmax";
    check_vocab(OP, vocab)?;
    if logits.len() % vocab != 0 {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "logits",
            len: logits.len(),
            width: vocab,
        });
    }
    let rows = logits.len() / vocab;
    match b {
        Backend::Cpu => {
            let x = logits.host(OP, "logits")?;
            let out = x
                .chunks_exact(vocab)
                .map(|r| crate::cpu::sample::argmax(r) as i32)
                .collect();
            Ok(Ints::Host(out))
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => argmax_on(dev, logits, rows, vocab),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => argmax_on(dev, logits, rows, vocab),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn argmax_on<D: super::OnDevice>(
    dev: &D,
    logits: &Tensor,
    rows: usize,
    vocab: usize,
) -> Result<Ints, KernelError> {
    const OP: &str = "sample_argmax";
    let out = dev.alloc::<i32>(rows)?;
    let x = super::tv::<D>(logits, OP, "logits")?;
    crate::gpu::sample::argmax(dev, x, out.v(), rows, vocab)?;
    Ok(D::into_ints(out))
}

/// Plain sampling of a batch of rows, end to end.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// `[rows][vocab]` logits, `rows = params.len()`.
    pub logits: &'a Tensor,
    /// Entries per row.
    pub vocab: usize,
    /// One row of parameters per logits row.
    pub params: &'a RowParams,
    /// One uniform per row (a greedy row's draw ignores it: its distribution is a point mass).
    pub uniforms: &'a Uniforms,
}

/// One token per row: [`probs`] then [`draw`] where the logits live, then one download of the
/// `[rows]` ids. A degenerate row is an error for that row alone.
pub fn sample(b: &Backend, s: Sample<'_>) -> Result<Vec<Result<u32, KernelError>>, KernelError> {
    check_len("sample", "uniforms", s.params.len(), s.uniforms.len())?;
    let p = probs(
        b,
        Probs {
            logits: s.logits,
            vocab: s.vocab,
            params: s.params,
        },
    )?;
    let ids = draw(
        b,
        Draw {
            probs: &p,
            vocab: s.vocab,
            uniforms: s.uniforms,
        },
    )?;
    Ok(ids
        .to_host()?
        .into_iter()
        .map(|t| {
            u32::try_from(t).map_err(|_| KernelError::DegenerateDistribution {
                op: "sample",
                sum: f64::NAN,
            })
        })
        .collect())
}
