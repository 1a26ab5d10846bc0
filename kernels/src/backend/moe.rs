//! Mixture of experts added into the residual stream: grouped sigmoid routing (noaux_tc, with
//! the correction bias), then the routed experts and the shared expert.
//!
//! CPU: [`MoeLayer::forward`] (each expert once over the tokens routed to it). GPU (CUDA and
//! ROCm, the same kernels): routing on the device, then two launches over every
//! `(token, slot)` pair, the shared expert stacked as extra expert slots so it costs no
//! separate pass, the weighted sum added straight into `h`. In captured graphs (by default;
//! `FERRY_SHARED_BESIDE=0` never, `=1` eager steps too), one token launches its shared slots on
//! CUDA's second stream beside the router and the routing (`gpu::ops::moe_token_beside`; the
//! same kernels, so the same `h`).

use super::{Backend, Precision, Tensor};
use crate::cpu::moe::MoeLayer;
use crate::KernelError;

/// An MoE layer's weights on one backend.
#[derive(Debug)]
pub enum Moe {
    /// Host weights.
    Host(MoeLayer),
    /// Device weights.
    #[cfg(feature = "cuda")]
    Cuda {
        /// `[n_experts][hidden]` router.
        router: crate::cuda::ops::GpuMatrix,
        /// `e_score_correction_bias`.
        bias: crate::cuda::DeviceBuffer<f32>,
        /// Routed experts then shared-expert chunks, stacked.
        experts: crate::cuda::ops::GpuExperts,
        /// Routing hyper-parameters as the kernel takes them.
        routing: crate::cuda::ops::RouteParams,
    },
    /// ROCm device weights (the same stacking as CUDA's).
    #[cfg(feature = "rocm")]
    Rocm {
        /// `[n_experts][hidden]` router.
        router: crate::gpu::ops::GpuMatrix<crate::rocm::RocmDevice>,
        /// `e_score_correction_bias`.
        bias: crate::rocm::HipBuffer<f32>,
        /// Routed experts then shared-expert chunks, stacked.
        experts: crate::gpu::ops::GpuExperts<crate::rocm::RocmDevice>,
        /// Routing hyper-parameters as the kernel takes them.
        routing: crate::gpu::ops::RouteParams,
    },
}

impl Moe {
    /// `m` on `b`; on a GPU the shared expert (if any) is split into `n_shared` chunks of the
    /// routed width, stacked after the routed experts.
    pub fn to_backend(m: &MoeLayer, n_shared: usize, b: &Backend) -> Result<Self, KernelError> {
        Ok(match b {
            Backend::Cpu => Moe::Host(m.clone()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(dev) => {
                let (router, bias, experts, routing) = upload(dev, m, n_shared)?;
                Moe::Cuda {
                    router,
                    bias,
                    experts,
                    routing,
                }
            }
            #[cfg(feature = "rocm")]
            Backend::Rocm(dev) => {
                let (router, bias, experts, routing) = upload(dev, m, n_shared)?;
                Moe::Rocm {
                    router,
                    bias,
                    experts,
                    routing,
                }
            }
        })
    }

    /// The host weights, or a mismatch error.
    pub fn host(&self) -> Result<&MoeLayer, KernelError> {
        match self {
            Moe::Host(m) => Ok(m),
            #[cfg(feature = "cuda")]
            Moe::Cuda { .. } => Err(super::mismatch(
                "moe",
                "weights",
                &Backend::Cpu,
                "CUDA device",
            )),
            #[cfg(feature = "rocm")]
            Moe::Rocm { .. } => Err(super::mismatch(
                "moe",
                "weights",
                &Backend::Cpu,
                "ROCm device",
            )),
        }
    }

    /// Bytes of weights read per token (router, `top_k` routed and the shared experts).
    pub fn active_bytes(&self) -> usize {
        match self {
            Moe::Host(m) => {
                let per = m.experts.first().map_or(0, |e| e.gate.bytes() * 3);
                let shared = m
                    .shared
                    .as_ref()
                    .map_or(0, |s| s.gate.bytes() + s.up.bytes() + s.down.bytes());
                m.router.bytes() + per * m.routing.top_k + shared
            }
            #[cfg(feature = "cuda")]
            Moe::Cuda {
                router,
                experts,
                routing,
                ..
            } => device_active_bytes(router, experts, routing),
            #[cfg(feature = "rocm")]
            Moe::Rocm {
                router,
                experts,
                routing,
                ..
            } => device_active_bytes(router, experts, routing),
        }
    }
}

/// `h += moe(x)`.
#[derive(Debug)]
pub struct MoeFfn<'a> {
    /// The weights.
    pub w: &'a Moe,
    /// `[T][hidden]` normalised inputs.
    pub x: &'a Tensor,
    /// `[T][hidden]` residual stream.
    pub h: &'a mut Tensor,
    /// GEMM input precision of the router on a GPU.
    pub precision: Precision,
}

/// Runs [`MoeFfn`].
pub fn moe(b: &Backend, p: MoeFfn<'_>) -> Result<(), KernelError> {
    const OP: &str = "moe";
    match (b, p.w) {
        (Backend::Cpu, Moe::Host(m)) => {
            super::add_residual_host(OP, p.x, p.h, |x, y| m.forward(x, y))
        }
        #[cfg(feature = "cuda")]
        (
            Backend::Cuda(dev),
            Moe::Cuda {
                router,
                bias,
                experts,
                routing,
            },
        ) => moe_on(dev, (router, bias, experts, *routing), p),
        #[cfg(feature = "rocm")]
        (
            Backend::Rocm(dev),
            Moe::Rocm {
                router,
                bias,
                experts,
                routing,
            },
        ) => moe_on(dev, (router, bias, experts, *routing), p),
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        (b, _) => Err(KernelError::DeviceMismatch {
            op: OP,
            what: "weights",
            expected: b.name(),
            got: "another backend",
        }),
    }
}

/// One MoE layer's device weights: router, correction bias, stacked experts, routing.
#[cfg(any(feature = "cuda", feature = "rocm"))]
type DeviceMoe<D> = (
    crate::gpu::ops::GpuMatrix<D>,
    <D as crate::gpu::launch::Gpu>::Buffer<f32>,
    crate::gpu::ops::GpuExperts<D>,
    crate::gpu::ops::RouteParams,
);

/// `m` on the device `dev`: the router, the bias, the experts stacked with the shared expert
/// split into `n_shared` chunks of the routed width.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn upload<D: crate::gpu::launch::Gpu>(
    dev: &D,
    m: &MoeLayer,
    n_shared: usize,
) -> Result<DeviceMoe<D>, KernelError> {
    let n_shared = if m.shared.is_some() {
        n_shared.max(1)
    } else {
        0
    };
    let r = &m.routing;
    Ok((
        crate::gpu::ops::GpuMatrix::upload(dev, &m.router)?,
        dev.upload(&m.correction_bias)?,
        stack::experts(dev, &m.experts, m.shared.as_ref(), n_shared)?,
        crate::gpu::ops::RouteParams {
            n_experts: r.n_experts as i32,
            top_k: r.top_k as i32,
            n_group: r.n_group as i32,
            topk_group: r.topk_group as i32,
            norm_topk: i32::from(r.norm_topk_prob),
            n_shared: n_shared as i32,
            scale: r.routed_scaling_factor,
            softmax: i32::from(r.scoring == crate::cpu::moe::RouteScoring::Softmax),
        },
    ))
}

/// Bytes of a device layer's weights read per token.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn device_active_bytes<D: crate::gpu::launch::Gpu>(
    router: &crate::gpu::ops::GpuMatrix<D>,
    experts: &crate::gpu::ops::GpuExperts<D>,
    routing: &crate::gpu::ops::RouteParams,
) -> usize {
    let per =
        (experts.gate.bytes() + experts.up.bytes() + experts.down.bytes()) / experts.total().max(1);
    router.bytes() + per * (routing.top_k + routing.n_shared) as usize
}

/// The GPU arm: the router GEMM, routing on the device, then the experts (shared ones as extra
/// slots) added into `h`.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn moe_on<D: super::OnDevice>(
    dev: &D,
    (router, bias, experts, routing): (
        &crate::gpu::ops::GpuMatrix<D>,
        &D::Buffer<f32>,
        &crate::gpu::ops::GpuExperts<D>,
        crate::gpu::ops::RouteParams,
    ),
    p: MoeFfn<'_>,
) -> Result<(), KernelError> {
    use crate::gpu::launch::DeviceMem;
    use crate::gpu::ops;
    const OP: &str = "moe";
    let gemm = p.precision.gemm();
    let x = super::tv::<D>(p.x, OP, "x")?;
    let h = super::tv::<D>(p.h, OP, "h")?;
    let t = x.len / router.cols().max(1);
    // A batch's shared expert as one dense MLP on the vendor BLAS, the routed slots alone
    // through the expert kernels (where the runtime has no BLAS the shared expert stays slots).
    let n_shared = routing.n_shared.max(0) as usize;
    let shared_gemm = t >= ops::shared_gemm_min_tokens();
    // Those products, the router's and the pipelined experts' read one split of x.
    let split = ops::moe_input_split(dev, x, experts, n_shared, shared_gemm)?;
    let x_split = split.as_ref().map(|s| s.v());
    let routing =
        if shared_gemm && ops::shared_experts_gemm(dev, (x, x_split), experts, n_shared, h)? {
            crate::gpu::ops::RouteParams {
                n_shared: 0,
                ..routing
            }
        } else {
            routing
        };
    // One token (a single-stream decode step) in a captured graph, unless `FERRY_SHARED_BESIDE`
    // says otherwise: the shared slots stream their weights on the side stream while the router
    // and the routing run.
    let beside = routing.n_shared > 0 && ops::SharedBeside::from_env().applies(dev);
    if let (1, true, Some(side)) = (t, beside, dev.side()) {
        let m = ops::MoeToken {
            x,
            router,
            bias: bias.v(),
            routing,
            experts,
            h,
            gemm,
        };
        return ops::moe_token_beside(dev, &side, m);
    }
    let logits = dev.alloc::<f32>(t * router.rows())?;
    let slots = (routing.top_k + routing.n_shared) as usize;
    let ids = dev.alloc::<i32>(t * slots)?;
    let w = dev.alloc::<f32>(t * slots)?;
    let routes = ops::Routes {
        ids: ids.v(),
        weights: w.v(),
        slots,
    };
    // One launch for both at small batches where `FERRY_ROUTER_FUSED` asks.
    let rr = ops::RouterRoute {
        x,
        router,
        bias: bias.v(),
        p: routing,
        logits: logits.v(),
        out: routes,
        done: experts.route_done.v(),
        x_split,
    };
    ops::router_and_route(dev, rr, ops::router_fused(), gemm)?;
    let a = ops::MoeArgs {
        x,
        routes,
        experts,
        h,
        x_split,
    };
    ops::moe_experts(dev, a)
}

/// Expert stacking for the device kernels.
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod stack {
    use half::bf16;

    use crate::cpu::gemm::{Matrix, MatrixData};
    use crate::cpu::mlp::GatedMlp;
    use crate::gpu::launch::Gpu;
    use crate::gpu::ops::{GpuExperts, GpuMatrix, GpuMatrixData};
    use crate::KernelError;

    fn invalid(value: String) -> KernelError {
        KernelError::InvalidParam {
            op: "moe_upload",
            field: "experts",
            limit: "at least one routed expert; shared width n_shared × routed width",
            value,
        }
    }

    /// Routed experts (and the shared expert split into `n_shared` chunks of the routed
    /// width) as one `[E_total·inter][hidden]` gate/up and `[E_total·hidden][inter]` down.
    /// All-bf16 experts stay bf16; anything else is widened to f32 (exact).
    pub(super) fn experts<D: Gpu>(
        dev: &D,
        experts: &[GatedMlp],
        shared: Option<&GatedMlp>,
        n_shared: usize,
    ) -> Result<GpuExperts<D>, KernelError> {
        let first = experts
            .first()
            .ok_or_else(|| invalid("no routed expert".into()))?;
        let (inter, hidden) = (first.intermediate(), first.hidden());
        let mut gates: Vec<Matrix> = Vec::new();
        let mut ups: Vec<Matrix> = Vec::new();
        let mut downs: Vec<Matrix> = Vec::new();
        for e in experts {
            gates.push(e.gate.clone());
            ups.push(e.up.clone());
            downs.push(e.down.clone());
        }
        if let Some(s) = shared {
            if s.intermediate() != inter * n_shared {
                return Err(invalid(format!(
                    "shared expert width {} is not {n_shared} × the routed width {inter}",
                    s.intermediate()
                )));
            }
            for k in 0..n_shared {
                gates.push(s.gate.slice_rows(k * inter, inter)?);
                ups.push(s.up.slice_rows(k * inter, inter)?);
                downs.push(columns(&s.down, k * inter, inter)?);
            }
        }
        let all_bf16 = gates
            .iter()
            .chain(&ups)
            .chain(&downs)
            .all(|m| matches!(m.data(), MatrixData::Bf16(_)));
        let stack = |ms: &[Matrix], cols: usize| -> Result<GpuMatrix<D>, KernelError> {
            let rows: usize = ms.iter().map(Matrix::rows).sum();
            let data = if all_bf16 {
                let mut v: Vec<u16> = Vec::with_capacity(rows * cols);
                for m in ms {
                    if let MatrixData::Bf16(d) = m.data() {
                        v.extend(d.iter().map(|x| x.to_bits()));
                    }
                }
                GpuMatrixData::Bf16(dev.upload(&v)?)
            } else {
                let mut v: Vec<f32> = Vec::with_capacity(rows * cols);
                for m in ms {
                    v.extend(m.to_f32_vec());
                }
                GpuMatrixData::F32(dev.upload(&v)?)
            };
            GpuMatrix::from_parts(rows, cols, data)
        };
        let n_shared = if shared.is_some() { n_shared } else { 0 };
        let shared_ids = crate::gpu::ops::shared_expert_ids(dev, experts.len(), n_shared)?;
        let route_done = dev.zeros::<u32>(1)?;
        Ok(GpuExperts {
            gate: stack(&gates, hidden)?,
            up: stack(&ups, hidden)?,
            down: stack(&downs, inter)?,
            inter,
            hidden,
            shared_ids,
            route_done,
        })
    }

    /// Columns `start..start + count` of `m` as a new matrix of the same element type.
    fn columns(m: &Matrix, start: usize, count: usize) -> Result<Matrix, KernelError> {
        let cols = m.cols();
        if start + count > cols {
            return Err(invalid(format!(
                "columns {start}..{} of a {cols}-column matrix",
                start + count
            )));
        }
        Ok(match m.data() {
            MatrixData::Bf16(d) => {
                let v: Vec<bf16> = d
                    .chunks_exact(cols)
                    .flat_map(|r| r[start..start + count].iter().copied())
                    .collect();
                Matrix::from_bf16(m.rows(), count, v)?
            }
            MatrixData::F32(d) => {
                let v: Vec<f32> = d
                    .chunks_exact(cols)
                    .flat_map(|r| r[start..start + count].iter().copied())
                    .collect();
                Matrix::from_f32(m.rows(), count, v)?
            }
        })
    }
}
