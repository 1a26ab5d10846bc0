//! Kernel benchmarks on a CUDA device (run by `ferry bench-gpu`; results in BENCHMARKS.md).
//!
//! Every measurement: inputs filled on the device with deterministic noise, warm-up launches,
//! then GPU-event timing over `reps` launches, mean reported.
//!
//! | function | measures |
//! |---|---|
//! | [`copy_bandwidth`] | device-to-device copy, bytes read + written per second (the roofline) |
//! | [`mha_prefill`] | MHA-form causal prefill (qk 192 / v 128 by default), TFLOP/s at 640·H·N²/2 FLOP |
//! | [`absorbed_decode`] | absorbed decode over the bf16 latent cache: GB/s of latent read (batch · ctx · row bytes: 1,152 B, or 1,280 B for fast mode's split rows) |

use super::context::CudaDevice;
use super::mla::{
    mha_prefill as run_mha, mla_absorbed, mla_absorbed_padded, AbsorbedBatch, AbsorbedKernel,
    Elems, MhaBatch, MhaKernel, MlaShape,
};
use super::ops::{fill_random_bf16, PagesView};
use crate::error::KernelError;

/// One timing: mean milliseconds per launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Mean milliseconds per launch.
    pub ms: f64,
}

fn time<F: FnMut() -> Result<(), KernelError>>(
    dev: &CudaDevice,
    warmup: usize,
    reps: usize,
    mut f: F,
) -> Result<Timing, KernelError> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let t = dev.timer()?;
    t.start()?;
    for _ in 0..reps.max(1) {
        f()?;
    }
    let ms = f64::from(t.stop_ms()?) / reps.max(1) as f64;
    Ok(Timing { ms })
}

/// Device-to-device copy of `bytes`: returns GB/s counting bytes read plus bytes written.
pub fn copy_bandwidth(dev: &CudaDevice, bytes: usize) -> Result<f64, KernelError> {
    let n = bytes / 4;
    let src = dev.zeros::<f32>(n)?;
    let mut dst = dev.zeros::<f32>(n)?;
    let t = time(dev, 2, 10, || dev.copy(&src, &mut dst, n))?;
    Ok(2.0 * (n * 4) as f64 / (t.ms * 1e-3) / 1e9)
}

/// Which MHA implementation to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MhaImpl {
    /// The tensor-core flash kernel (`mma.sync`).
    Flash,
    /// The Hopper warpgroup-MMA kernel.
    Wgmma,
    /// The warp-specialised Hopper kernel (TMA producer, ping-pong consumers).
    WarpSpecialized,
    /// The f32 CUDA-core kernel.
    F32,
}

/// One causal self-attention of `tokens` fresh tokens over `heads` heads (batch 1): mean ms and
/// TFLOP/s at `2·(qk + v)·H·N²/2` FLOP.
pub fn mha_prefill(
    dev: &CudaDevice,
    shape: MlaShape,
    imp: MhaImpl,
    heads: usize,
    tokens: usize,
) -> Result<(Timing, f64), KernelError> {
    // bf16 kernels read split rows (`mha_qkb`); FLOP are counted at the logical width.
    let (qk, v) = (shape.mha_qk, shape.mha_v);
    let qkb = shape.mha_qkb();
    let cu = dev.upload(&[0i32, tokens as i32])?;
    let q_seq = dev.zeros::<i32>(tokens)?;
    let out = dev.zeros::<f32>(tokens * heads * v)?;
    let flops = 2.0 * (qk + v) as f64 * heads as f64 * (tokens as f64).powi(2) / 2.0;
    let reps = if tokens >= 32_768 { 3 } else { 10 };
    let t = match imp {
        MhaImpl::Flash | MhaImpl::Wgmma | MhaImpl::WarpSpecialized => {
            let kernel = match imp {
                MhaImpl::Flash => MhaKernel::Flash,
                MhaImpl::Wgmma => MhaKernel::Wgmma,
                _ => MhaKernel::WarpSpecialized,
            };
            let q = dev.alloc::<u16>(tokens * heads * qkb)?;
            let k = dev.alloc::<u16>(tokens * heads * qkb)?;
            let vv = dev.alloc::<u16>(tokens * heads * v)?;
            for (i, b) in [&q, &k, &vv].into_iter().enumerate() {
                fill_random_bf16(dev, b.v(), 11 + i as u64, 1.0)?;
            }
            let b = MhaBatch {
                q: Elems::Bf16(q.v()),
                k: Elems::Bf16(k.v()),
                v: Elems::Bf16(vv.v()),
                cu_q: cu.v(),
                cu_k: cu.v(),
                q_seq: q_seq.v(),
                batch: 1,
                max_q: tokens,
                heads,
                scale: (qk as f32).powf(-0.5),
            };
            time(dev, 2, reps, || run_mha(dev, shape, kernel, &b, out.v()))?
        }
        MhaImpl::F32 => {
            let q = dev.zeros::<f32>(tokens * heads * qk)?;
            let k = dev.zeros::<f32>(tokens * heads * qk)?;
            let vv = dev.zeros::<f32>(tokens * heads * v)?;
            let b = MhaBatch {
                q: Elems::F32(q.v()),
                k: Elems::F32(k.v()),
                v: Elems::F32(vv.v()),
                cu_q: cu.v(),
                cu_k: cu.v(),
                q_seq: q_seq.v(),
                batch: 1,
                max_q: tokens,
                heads,
                scale: (qk as f32).powf(-0.5),
            };
            time(dev, 1, 2, || {
                run_mha(dev, shape, MhaKernel::F32, &b, out.v())
            })?
        }
    };
    Ok((t, flops / (t.ms * 1e-3) / 1e12))
}

/// Which absorbed-form path to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbsorbedImpl {
    /// The dispatcher: tile kernel, zero-padding other head counts (12 → 16).
    Padded,
    /// Head-packed tiles.
    Packed,
    /// One block per (token, head).
    Generic,
}

/// A bf16 latent pool big enough for `max_tokens` tokens, reused across decode shapes.
pub struct LatentPool {
    pages: crate::cuda::DeviceBuffer<u16>,
    page: usize,
    shape: MlaShape,
}

impl LatentPool {
    /// Runs later measurements with another tile pipeline (same data).
    pub fn set_tile(&mut self, bk: usize, stages: usize) {
        self.shape = self.shape.with_tile(bk, stages);
    }

    /// Runs later measurements on the tile kernel `shape` describes (warps, keys per step,
    /// stages); the widths must be the pool's.
    pub fn set_shape(&mut self, shape: MlaShape) {
        self.shape = shape;
    }

    /// The shape measurements use.
    pub fn shape(&self) -> MlaShape {
        self.shape
    }

    /// Allocates and fills `max_tokens` rows (page size 64).
    pub fn new(dev: &CudaDevice, shape: MlaShape, max_tokens: usize) -> Result<Self, KernelError> {
        let page = 64;
        let blocks = max_tokens.div_ceil(page);
        let pages = dev.alloc::<u16>(blocks * page * shape.krow())?;
        fill_random_bf16(dev, pages.v(), 7, 1.0)?;
        Ok(Self { pages, page, shape })
    }
}

/// A decode shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// Sequences.
    pub batch: usize,
    /// Cached tokens per sequence.
    pub ctx: usize,
    /// Query heads.
    pub heads: usize,
    /// New tokens per sequence (1 = plain decode; more = speculative/MTP verification).
    pub sq: usize,
}

/// Absorbed attention over `batch` sequences of `ctx` cached tokens each: mean ms and GB/s of
/// latent read (`batch · ctx · krow · 2` bytes; the tiles read each row once per 16 heads).
pub fn absorbed_decode(
    dev: &CudaDevice,
    pool: &LatentPool,
    imp: AbsorbedImpl,
    s: DecodeShape,
) -> Result<(Timing, f64), KernelError> {
    let shape = pool.shape;
    let per_seq = s.ctx.div_ceil(pool.page);
    let blocks = pool.pages.len() / (pool.page * shape.krow());
    if per_seq * s.batch > blocks {
        return Err(KernelError::InvalidParam {
            op: "bench_absorbed",
            field: "batch · ctx",
            limit: "<= the pool",
            value: format!("{} blocks > {blocks}", per_seq * s.batch),
        });
    }
    let table: Vec<i32> = (0..(per_seq * s.batch) as i32).collect();
    let table = dev.upload(&table)?;
    let ctx = dev.upload(&vec![s.ctx as i32; s.batch])?;
    let rows = s.batch * s.sq * s.heads;
    let q = dev.alloc::<u16>(rows * shape.qrow())?;
    fill_random_bf16(dev, q.v(), 3, 1.0)?;
    let out = dev.zeros::<f32>(rows * shape.kv_lora)?;
    let b = AbsorbedBatch {
        q: Elems::Bf16(q.v()),
        pages: PagesView {
            ptr: pool.pages.ptr(),
            bf16: true,
            num_blocks: blocks,
            page_size: pool.page,
            width: shape.latent,
            split: shape.split,
        },
        block_table: table.v(),
        bt_stride: per_seq,
        ctx_len: ctx.v(),
        max_ctx: s.ctx,
        batch: s.batch,
        sq: s.sq,
        heads: s.heads,
        scale: 0.1352,
    };
    let bytes = (s.batch * s.ctx * shape.krow() * 2) as f64;
    let reps = if bytes > 4e9 { 5 } else { 20 };
    let t = time(dev, 2, reps, || match imp {
        AbsorbedImpl::Padded => mla_absorbed_padded(dev, shape, &b, out.v()),
        AbsorbedImpl::Packed => mla_absorbed(dev, shape, AbsorbedKernel::Packed, &b, out.v()),
        AbsorbedImpl::Generic => mla_absorbed(dev, shape, AbsorbedKernel::Generic, &b, out.v()),
    })?;
    Ok((t, bytes / (t.ms * 1e-3) / 1e9))
}
