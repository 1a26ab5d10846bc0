// common.cu: the non-attention ops of a DeepSeek-V3-family forward, for CUDA and HIP.
//
// Activations are f32 row-major; weights are `W` = float or bf16_t in torch's nn.Linear layout
// ([out][in]). Every kernel is instantiated for both weight types (suffix _f32 / _bf16); the
// latent cache type is likewise a suffix. Launch shapes are chosen by kernels/src/gpu/ops.rs.
#include "compat.cuh"

// Sum over the block (blockDim.x a multiple of 32, <= 1024); `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  int nw = blockDim.x / WARP;
  float t = lane < nw ? red[lane] : 0.0f;
  return warp_sum(t);
}

// ---------------------------------------------------------------------------------------------
// Embedding rows: out[t][:] = table[ids[t]][:] widened to f32; an id outside [0, rows) gives a
// zero row (ids computed on the device, e.g. a drafter's failed draw, are never trusted to
// index memory). Grid: tokens.
template <typename W>
__device__ void embed_impl(const W* table, const int* ids, float* out, int hidden, int rows) {
  int id = ids[blockIdx.x];
  float* dst = out + (size_t)blockIdx.x * hidden;
  if (id < 0 || id >= rows) {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = 0.0f;
    return;
  }
  const W* row = table + (size_t)id * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = ld_f(row + i);
}
extern "C" __global__ void embed_f32(const float* t, const int* ids, float* out, int hidden,
                                     int rows) {
  pdl_enter();
  embed_impl(t, ids, out, hidden, rows);
}
extern "C" __global__ void embed_bf16(const bf16_t* t, const int* ids, float* out, int hidden,
                                      int rows) {
  pdl_enter();
  embed_impl(t, ids, out, hidden, rows);
}

// ---------------------------------------------------------------------------------------------
// Residual add and RMSNorm: if delta, h[r] += delta[r]; then out[r] = w * (h[r] * rsqrt(mean(h²)+eps)).
// `out` may be null (add only). A row of up to NORM_V4 · 4 · blockDim floats (width a multiple
// of 4) is held in registers: every load of the row is issued before the first use, so the
// kernel pays one memory round trip instead of one per loop trip (a single-stream decode step
// runs 56 of these on one block each). Other widths take the strided loop.
// Grid: rows; block 256–1024 (ops.rs picks it from the width).
#define NORM_V4 4
extern "C" __global__ void add_rms_norm(float* h, const float* delta, const float* w, float* out,
                                        int width, float eps) {
  pdl_enter();
  __shared__ float red[32];
  float* x = h + (size_t)blockIdx.x * width;
  const float* d = delta ? delta + (size_t)blockIdx.x * width : nullptr;
  float ss = 0.0f;
  int n4 = width / 4;
  size_t align = (size_t)x | (size_t)d | (size_t)w | (size_t)out;
  if ((width & 3) == 0 && (align & 15) == 0 && n4 <= NORM_V4 * (int)blockDim.x) {
    float4 v[NORM_V4];
#pragma unroll
    for (int j = 0; j < NORM_V4; j++) {
      int i = threadIdx.x + j * blockDim.x;
      if (i < n4) v[j] = reinterpret_cast<const float4*>(x)[i];
    }
    if (d) {
#pragma unroll
      for (int j = 0; j < NORM_V4; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < n4) {
          float4 e = reinterpret_cast<const float4*>(d)[i];
          v[j].x += e.x, v[j].y += e.y, v[j].z += e.z, v[j].w += e.w;
          reinterpret_cast<float4*>(x)[i] = v[j];
        }
      }
    }
    if (!out) return;
#pragma unroll
    for (int j = 0; j < NORM_V4; j++)
      if (threadIdx.x + j * blockDim.x < n4)
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    float r = 1.0f / sqrtf(block_sum(ss, red) / (float)width + eps);
    float4* o = reinterpret_cast<float4*>(out + (size_t)blockIdx.x * width);
#pragma unroll
    for (int j = 0; j < NORM_V4; j++) {
      int i = threadIdx.x + j * blockDim.x;
      if (i < n4) {
        float4 g = reinterpret_cast<const float4*>(w)[i];
        o[i] = make_float4(g.x * (v[j].x * r), g.y * (v[j].y * r), g.z * (v[j].z * r),
                           g.w * (v[j].w * r));
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    float v = x[i];
    if (d) { v += d[i]; x[i] = v; }
    ss += v * v;
  }
  if (!out) return;
  float total = block_sum(ss, red);
  float r = 1.0f / sqrtf(total / (float)width + eps);
  float* o = out + (size_t)blockIdx.x * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = w[i] * (x[i] * r);
}

// In-place RMSNorm of the first `width` floats of rows `stride` apart. Grid: rows; block 256.
extern "C" __global__ void rms_norm_strided(float* x, int stride, const float* w, int width,
                                            float eps) {
  pdl_enter();
  __shared__ float red[32];
  float* row = x + (size_t)blockIdx.x * stride;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < width; i += blockDim.x) ss += row[i] * row[i];
  float total = block_sum(ss, red);
  float r = 1.0f / sqrtf(total / (float)width + eps);
  for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] = w[i] * (row[i] * r);
}

// ---------------------------------------------------------------------------------------------
// RoPE in place on x[t][h][offset .. offset+dim] (DeepSeek interleaved or rotate_half layout),
// cos/sin [t][dim/2] precomputed on the host exactly as the CPU backend does.
// Grid: (tokens, heads); block: dim/2 threads.
extern "C" __global__ void rope_apply(float* x, const float* cos_t, const float* sin_t, int heads,
                                      int head_stride, int offset, int dim, int interleaved) {
  pdl_enter();
  int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x, half = dim / 2;
  float* v = x + ((size_t)t * heads + h) * head_stride + offset;
  float x1 = 0.0f, x2 = 0.0f;
  if (j < half) {
    if (interleaved) { x1 = v[2 * j]; x2 = v[2 * j + 1]; } else { x1 = v[j]; x2 = v[j + half]; }
  }
  __syncthreads();
  if (j >= half) return;
  float c = cos_t[(size_t)t * half + j], s = sin_t[(size_t)t * half + j];
  v[j] = x1 * c + (-x2) * s;
  v[j + half] = x2 * c + x1 * s;
}

// ---------------------------------------------------------------------------------------------
// The new tokens' latent rows: RMSNorm of c_kv (first kv_lora), RoPE of k_pe (the rest), then
// the row is stored into the paged cache at slot[t] (= block * page + row). A split bf16 cache
// (split > 0, fast mode; mla.cu's top comment) stores the row's last `split` elements again
// after it as the lo half of a bf16 pair: [c_kv | k_pe hi | k_pe lo]. With `q` (not null) the
// same launch also rotates the queries' rope parts (rope_apply's work for q_heads heads of
// q_stride floats, the rope part at q_offset): blocks (t, 0) write the latent, blocks (t, 1 + b)
// rotate query heads b·hpb … b·hpb + hpb − 1, hpb = blockDim / (dim / 2) heads a block (a thread
// per rotated pair) — two independent jobs that a decode step used to launch apart. A block per
// head left 240 of its 256 threads idle at DeepSeek's rope dim of 64 and made a 1,024-token
// prompt launch 13 blocks a token, 12 of them for the queries.
// Grid: (tokens, 1 + ceil(q_heads / hpb)); block 256.
template <typename KV>
__device__ void latent_finish_impl(float* lat, int width, int kv_lora, const float* norm_w,
                                   float eps, const float* cos_t, const float* sin_t,
                                   int interleaved, const long long* slots, KV* pages,
                                   int split, float* q, int q_stride, int q_offset,
                                   int q_heads) {
  __shared__ float red[32];
  __shared__ float rot[1024];
  int t = blockIdx.x, dim = width - kv_lora, half = dim / 2;
  if (blockIdx.y > 0) {
    // rope_apply's body for pair j of query head h of token t. A head's pairs are all in this
    // block, so the barrier orders every read of a head before any write into it.
    int hpb = blockDim.x / half, h = (blockIdx.y - 1) * hpb + threadIdx.x / half;
    int j = threadIdx.x % half;
    bool live = threadIdx.x < hpb * half && h < q_heads;
    float* v = q + ((size_t)t * q_heads + h) * q_stride + q_offset;
    float x1 = 0.0f, x2 = 0.0f;
    if (live) {
      if (interleaved) { x1 = v[2 * j]; x2 = v[2 * j + 1]; } else { x1 = v[j]; x2 = v[j + half]; }
    }
    __syncthreads();
    if (!live) return;
    float c = cos_t[(size_t)t * half + j], s = sin_t[(size_t)t * half + j];
    v[j] = x1 * c + (-x2) * s;
    v[j + half] = x2 * c + x1 * s;
    return;
  }
  float* row = lat + (size_t)t * width;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < kv_lora; i += blockDim.x) ss += row[i] * row[i];
  float total = block_sum(ss, red);
  float r = 1.0f / sqrtf(total / (float)kv_lora + eps);
  for (int i = threadIdx.x; i < kv_lora; i += blockDim.x) row[i] = norm_w[i] * (row[i] * r);
  float* pe = row + kv_lora;
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    float x1, x2;
    if (interleaved) { x1 = pe[2 * j]; x2 = pe[2 * j + 1]; } else { x1 = pe[j]; x2 = pe[j + half]; }
    float c = cos_t[(size_t)t * half + j], s = sin_t[(size_t)t * half + j];
    rot[j] = x1 * c + (-x2) * s;
    rot[j + half] = x2 * c + x1 * s;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < dim; j += blockDim.x) pe[j] = rot[j];
  __syncthreads();
  KV* dst = pages + (size_t)slots[t] * (width + split);
  for (int i = threadIdx.x; i < width; i += blockDim.x) st_f(dst + i, row[i]);
  for (int j = threadIdx.x; j < split; j += blockDim.x) {
    float x = row[width - split + j];
    st_f(dst + width + j, x - bf2f(f2bf(x)));
  }
}
extern "C" __global__ void latent_finish_f32(float* lat, int width, int kv_lora, const float* nw,
                                             float eps, const float* c, const float* s, int il,
                                             const long long* slots, float* pages, float* q,
                                             int q_stride, int q_offset, int q_heads) {
  pdl_enter();
  latent_finish_impl(lat, width, kv_lora, nw, eps, c, s, il, slots, pages, 0, q, q_stride,
                     q_offset, q_heads);
}
extern "C" __global__ void latent_finish_bf16(float* lat, int width, int kv_lora, const float* nw,
                                              float eps, const float* c, const float* s, int il,
                                              const long long* slots, bf16_t* pages, int split,
                                              float* q, int q_stride, int q_offset,
                                              int q_heads) {
  pdl_enter();
  latent_finish_impl(lat, width, kv_lora, nw, eps, c, s, il, slots, pages, split, q, q_stride,
                     q_offset, q_heads);
}

// ---------------------------------------------------------------------------------------------
// Elementwise.
extern "C" __global__ void silu_mul(float* g, const float* u, long long n) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) g[i] = silu_f(g[i]) * u[i];
}
// A product of stacked hi and lo activation rows (ops.rs's shared_experts_gemm): g2 and u2 hold
// [hi rows | lo rows], n elements each half; g = silu(g2_hi + g2_lo) · (u2_hi + u2_lo).
extern "C" __global__ void silu_mul_halves(const float* g2, const float* u2, float* g, long long n) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) g[i] = silu_f(g2[i] + g2[n + i]) * (u2[i] + u2[n + i]);
}
// h[i] += parts[0][i] + parts[1][i] + … + parts[k − 1][i] (in that order), parts n apart.
extern "C" __global__ void add_parts(float* h, const float* parts, int k, long long n) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = 0.0f;
  for (int j = 0; j < k; j++) s += parts[(long long)j * n + i];
  h[i] += s;
}
extern "C" __global__ void cast_f32_bf16(const float* x, bf16_t* out, long long n) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = f2bf(x[i]);
}
// x = hi + lo with both halves bf16: products against bf16 weights keep ~16 mantissa bits.
extern "C" __global__ void split_bf16(const float* x, bf16_t* hi, bf16_t* lo, long long n) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    bf16_t h = f2bf(x[i]);
    hi[i] = h;
    lo[i] = f2bf(x[i] - bf2f(h));
  }
}
// Rows of `width` f32 → bf16 rows of width + 2·split whose last `split` elements become a
// split query's [hi | hi | lo] (mla.cu's top comment): [x[..w−s] | hi | hi | lo]. split 0 is a
// plain cast. Grid: ceil(rows·(width + 2·split) / 256); block 256.
extern "C" __global__ void split_pe_bf16(const float* x, bf16_t* out, long long rows, int width,
                                         int split) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  int ow = width + 2 * split;
  if (i >= rows * ow) return;
  long long r = i / ow;
  int j = (int)(i % ow);
  const float* src = x + r * width;
  if (j < width) {
    out[i] = f2bf(src[j]);
  } else {
    float v = src[width - split + (j - width) % split];
    out[i] = j < width + split ? f2bf(v) : f2bf(v - bf2f(f2bf(v)));
  }
}
extern "C" __global__ void widen_bf16(const bf16_t* x, float* out, long long n) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = bf2f(x[i]);
}
// A verify round's drafts put into its token ids on the device, without the host:
// ids[s·(g+1) + 1 + k] = drafts[k·width + s] for s < n, k < g. `drafts` is the drafter's
// step-major output (block position k's ids for every sequence of its pass, `width` of them);
// row s·(g+1) of `ids`, sequence s's anchor, is the host's.
extern "C" __global__ void scatter_drafts(const int* drafts, int* ids, int n, int g, int width) {
  pdl_enter();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * g) return;
  int s = i / g, k = i - s * g;
  ids[s * (g + 1) + 1 + k] = drafts[k * width + s];
}
// dst[i][:] = src[rows[i]][:]. Grid: (rows, ⌈width / (GATHER_U · blockDim)⌉): a block copies
// GATHER_U · blockDim columns of one row, each thread issuing its loads before its stores (a
// block looping over a whole vocabulary row paid one memory round trip per trip).
#define GATHER_U 4
extern "C" __global__ void gather_rows(const float* src, const int* rows, float* dst, int width) {
  pdl_enter();
  const float* s = src + (size_t)rows[blockIdx.x] * width;
  float* d = dst + (size_t)blockIdx.x * width;
  int base = blockIdx.y * GATHER_U * blockDim.x + threadIdx.x;
  float v[GATHER_U];
#pragma unroll
  for (int j = 0; j < GATHER_U; j++) {
    int i = base + j * blockDim.x;
    v[j] = i < width ? s[i] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < GATHER_U; j++) {
    int i = base + j * blockDim.x;
    if (i < width) d[i] = v[j];
  }
}

// ---------------------------------------------------------------------------------------------
// GEMV for decode-sized batches: out[m][n] = x[m][k] · W[n][k]ᵀ, m <= 8, f32 accumulation.
// One warp per weight row, 16-byte weight loads; memory-bound on W. Grid: ceil(n/8); block 256.
#define GEMV_MAX_M 8
// Loads in flight per lane before the FMAs that use them: a warp streams GEMV_U × 512 bytes of a
// weight row at once instead of one 16-byte load per lane per loop trip (memory-level
// parallelism is what a decode GEMV is short of, not arithmetic). 8 (a 2,048-wide bf16 row in
// one round trip) measured no better end to end on the H200 and costs registers.
#define GEMV_U 4
// Eight weights of a row: one 16-byte load.
struct W8b {
  uint4 v;
};
struct W8f {
  float4 a, b;
};
__device__ __forceinline__ W8b load8(const bf16_t* w) {
  return {__ldg(reinterpret_cast<const uint4*>(w))};
}
__device__ __forceinline__ W8f load8(const float* w) {
  return {__ldg(reinterpret_cast<const float4*>(w)), __ldg(reinterpret_cast<const float4*>(w + 4))};
}
// acc += x[0..8) · w, x given as two float4 already in registers.
__device__ __forceinline__ void fma8v(float* acc, float4 xa, float4 xb, W8b w) {
  unsigned p[4] = {w.v.x, w.v.y, w.v.z, w.v.w};
  float xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    *acc += xs[2 * j] * ferry_u2f(p[j] << 16);
    *acc += xs[2 * j + 1] * ferry_u2f(p[j] & 0xffff0000u);
  }
}
__device__ __forceinline__ void fma8v(float* acc, float4 xa, float4 xb, W8f w) {
  *acc += xa.x * w.a.x + xa.y * w.a.y + xa.z * w.a.z + xa.w * w.a.w;
  *acc += xb.x * w.b.x + xb.y * w.b.y + xb.z * w.b.z + xb.w * w.b.w;
}
// The same with x read from memory (16-byte aligned).
template <typename V>
__device__ __forceinline__ void fma8(float* acc, const float* x, V w) {
  fma8v(acc, *reinterpret_cast<const float4*>(x), *reinterpret_cast<const float4*>(x + 4), w);
}
template <typename W>
struct W8Of;
template <>
struct W8Of<bf16_t> {
  typedef W8b T;
};
template <>
struct W8Of<float> {
  typedef W8f T;
};

// Dot products of R weight rows (same width k) with m activation rows, reduced over the warp:
// acc[r][i] = wrow[r] · xrow(i). Each lane issues GEMV_U loads per row before using any.
// `xrow(i)` gives activation row i (strided rows, or rows gathered by index for grouped MoE).
template <int R, typename W, typename X>
__device__ __forceinline__ void warp_rows_dots_by(X xrow, int m, const W* const* wrow, int k,
                                                  float (*acc)[GEMV_MAX_M]) {
  int lane = threadIdx.x % WARP;
  if ((k & 7) == 0) {
    for (int c0 = lane * 8; c0 < k; c0 += GEMV_U * WARP * 8) {
      typename W8Of<W>::T wc[R][GEMV_U];
#pragma unroll
      for (int u = 0; u < GEMV_U; u++)
#pragma unroll
        for (int r = 0; r < R; r++)
          if (c0 + u * WARP * 8 < k) wc[r][u] = load8(wrow[r] + c0 + u * WARP * 8);
#pragma unroll
      for (int u = 0; u < GEMV_U; u++) {
        int c = c0 + u * WARP * 8;
        if (c < k)
#pragma unroll
          for (int i = 0; i < GEMV_MAX_M; i++)
            if (i < m)
#pragma unroll
              for (int r = 0; r < R; r++) fma8(&acc[r][i], xrow(i) + c, wc[r][u]);
      }
    }
  } else {
    for (int c = lane; c < k; c += WARP) {
#pragma unroll
      for (int r = 0; r < R; r++) {
        float wv = ld_f(wrow[r] + c);
#pragma unroll
        for (int i = 0; i < GEMV_MAX_M; i++)
          if (i < m) acc[r][i] += xrow(i)[c] * wv;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++)
      if (i < m) acc[r][i] = warp_sum(acc[r][i]);  // m is uniform: no divergence
}
// The same over m rows of x, ldx apart.
template <int R, typename W>
__device__ __forceinline__ void warp_rows_dots(const float* x, int m, int ldx,
                                               const W* const* wrow, int k,
                                               float (*acc)[GEMV_MAX_M]) {
  warp_rows_dots_by<R>([=](int i) { return x + (size_t)i * ldx; }, m, wrow, k, acc);
}
// One weight row.
template <typename W>
__device__ __forceinline__ void warp_row_dots(const float* x, int m, int ldx, const W* wrow, int k,
                                              float* acc) {
  const W* rows[1] = {wrow};
  warp_rows_dots<1>(x, m, ldx, rows, k, reinterpret_cast<float(*)[GEMV_MAX_M]>(acc));
}

template <typename W>
__device__ void gemv_impl(const float* x, int m, const W* w, int n, int k, float* out,
                          int accumulate) {
  int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (row >= n) return;
  float acc[GEMV_MAX_M];
#pragma unroll
  for (int i = 0; i < GEMV_MAX_M; i++) acc[i] = 0.0f;
  warp_row_dots(x, m, k, w + (size_t)row * k, k, acc);
  if (threadIdx.x % WARP == 0) {
    for (int i = 0; i < m; i++) {
      float* o = out + (size_t)i * n + row;
      *o = accumulate ? *o + acc[i] : acc[i];
    }
  }
}
// Before waiting for the kernel ahead (compat.cuh's pdl_enter), each warp pulls its weight row
// into L2: the weights are constants, so a projection's ramp-up overlaps the norm or attention
// that produces its input.
template <typename W>
__device__ __forceinline__ void gemv_prefetch(const W* w, int n, int k) {
  int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (row < n) prefetch_l2(w + (size_t)row * k, (size_t)k * sizeof(W));
}
extern "C" __global__ void gemv_f32(const float* x, int m, const float* w, int n, int k,
                                    float* out, int acc) {
  gemv_prefetch(w, n, k);
  pdl_enter();
  gemv_impl(x, m, w, n, k, out, acc);
}
extern "C" __global__ void gemv_bf16(const float* x, int m, const bf16_t* w, int n, int k,
                                     float* out, int acc) {
  gemv_prefetch(w, n, k);
  pdl_enter();
  gemv_impl(x, m, w, n, k, out, acc);
}

// Warms L2 with up to four byte ranges of weights ahead of the kernels that read them (a
// layer's shared experts and output projection while its attention chain, which leaves HBM
// mostly idle at small batches, runs; `gpu::l2`). Each lane hands the copy engine one 4 KB
// chunk at a time (compat.cuh's bulk prefetch, sm_90; elsewhere nothing), the grid's lanes
// striding over each range; `l2_warm_last` marks the lines evict-last. The host passes
// 16-byte-aligned ranges of whole 16-byte units. The weights are constants, so the requests
// go out before `pdl_enter()`; the wait after them keeps the stream's order for the kernels
// behind this one. Writes nothing. Grid: (blocks); block 256.
struct L2Ranges {
  const char* base[4];
  u64 len[4];
};
#define L2_WARM_CHUNK 4096
template <bool LAST>
__device__ __forceinline__ void l2_warm_impl(const L2Ranges& r) {
  u64 lane = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  u64 lanes = (u64)gridDim.x * blockDim.x;
#pragma unroll
  for (int i = 0; i < 4; i++)
    for (u64 o = lane * L2_WARM_CHUNK; o < r.len[i]; o += lanes * L2_WARM_CHUNK) {
      u64 n = r.len[i] - o;
      prefetch_l2_bulk<LAST>(r.base[i] + o, (unsigned)(n < L2_WARM_CHUNK ? n : L2_WARM_CHUNK));
    }
  pdl_enter();
}
extern "C" __global__ void l2_warm(L2Ranges r) { l2_warm_impl<false>(r); }
extern "C" __global__ void l2_warm_last(L2Ranges r) { l2_warm_impl<true>(r); }

// Two projections of the same activations in one launch: rows [0, n1) of the grid's warps
// compute out1 = x · W1ᵀ, rows [n1, n1 + n2) out2 = x · W2ᵀ — an attention layer's first query
// projection and its kv_a (576 rows alone fill 72 blocks of a 132-SM card). Each output row is
// the same arithmetic as gemv's, so the results are bitwise those of two launches.
// Grid: ceil((n1 + n2) / 8); block 256.
template <typename W>
__device__ __forceinline__ void gemv_pair_pick(const W* w1, int n1, float* o1, const W* w2, int n2,
                                               float* o2, int k, const W** w, float** out,
                                               int* n, int* row) {
  int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (r < n1) {
    *w = w1 + (size_t)r * k, *out = o1, *n = n1, *row = r;
  } else {
    *w = w2 + (size_t)(r - n1) * k, *out = o2, *n = n2, *row = r - n1;
  }
}
template <typename W>
__device__ void gemv_pair_impl(const float* x, int m, const W* w1, int n1, float* o1,
                               const W* w2, int n2, float* o2, int k) {
  const W* w;
  float* out;
  int n, row;
  gemv_pair_pick(w1, n1, o1, w2, n2, o2, k, &w, &out, &n, &row);
  if (row < n) prefetch_l2(w, (size_t)k * sizeof(W));
  pdl_enter();
  if (row >= n) return;
  float acc[GEMV_MAX_M];
#pragma unroll
  for (int i = 0; i < GEMV_MAX_M; i++) acc[i] = 0.0f;
  warp_row_dots(x, m, k, w, k, acc);
  if (threadIdx.x % WARP == 0)
    for (int i = 0; i < m; i++) out[(size_t)i * n + row] = acc[i];
}
extern "C" __global__ void gemv_pair_f32(const float* x, int m, const float* w1, int n1,
                                         float* o1, const float* w2, int n2, float* o2, int k) {
  gemv_pair_impl(x, m, w1, n1, o1, w2, n2, o2, k);
}
extern "C" __global__ void gemv_pair_bf16(const float* x, int m, const bf16_t* w1, int n1,
                                          float* o1, const bf16_t* w2, int n2, float* o2, int k) {
  gemv_pair_impl(x, m, w1, n1, o1, w2, n2, o2, k);
}

// ---------------------------------------------------------------------------------------------
// Portable tiled GEMM: out[m][n] (+)= x[m][k] · W[n][k]ᵀ for any m, f32 activations, f32
// accumulation. No tensor cores and no PTX, so the same code runs on every target: it is the
// ROCm backend's GEMM above the GEMV's 8 rows (CUDA uses cuBLAS there). Each output is summed
// in order of k (one FMA chain per output), so it differs from the CPU's f32 products only in
// rounding. Block: 256 threads = 16 × 16, each owning a 4 × 4 micro-tile of a 64 × 64 output
// tile (rows ty + 16·i, columns tx + 16·j: consecutive threads read consecutive shared words);
// 16-deep k steps through shared memory, both operands stored k-major.
// Grid: (ceil(n/64), ceil(m/64)); block 256; no dynamic shared memory.
#define GT_M 64
#define GT_N 64
#define GT_K 16
template <typename W>
__device__ void gemm_tiled_impl(const float* x, const W* w, float* out, int m, int n, int k,
                                int accumulate) {
  __shared__ float xs[GT_K][GT_M + 1];
  __shared__ float ws[GT_K][GT_N + 1];
  int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  int m0 = blockIdx.y * GT_M, n0 = blockIdx.x * GT_N;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
  for (int k0 = 0; k0 < k; k0 += GT_K) {
    // 64 rows × 16 k of each operand: 1024 elements, 4 per thread, k fastest (coalesced rows).
    for (int i = tid; i < GT_M * GT_K; i += blockDim.x) {
      int r = i / GT_K, c = i % GT_K, kk = k0 + c;
      int xr = m0 + r, wr = n0 + r;
      xs[c][r] = (xr < m && kk < k) ? x[(size_t)xr * k + kk] : 0.0f;
      ws[c][r] = (wr < n && kk < k) ? ld_f(w + (size_t)wr * k + kk) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < GT_K; c++) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; i++) a[i] = xs[c][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; j++) b[j] = ws[c][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; i++) {
    int r = m0 + ty + 16 * i;
    if (r >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int c = n0 + tx + 16 * j;
      if (c >= n) continue;
      float* o = out + (size_t)r * n + c;
      *o = accumulate ? *o + acc[i][j] : acc[i][j];
    }
  }
}
extern "C" __global__ void __launch_bounds__(256)
    gemm_tiled_f32(const float* x, const float* w, float* out, int m, int n, int k, int acc) {
  pdl_enter();
  gemm_tiled_impl(x, w, out, m, n, k, acc);
}
extern "C" __global__ void __launch_bounds__(256)
    gemm_tiled_bf16(const float* x, const bf16_t* w, float* out, int m, int n, int k, int acc) {
  pdl_enter();
  gemm_tiled_impl(x, w, out, m, n, k, acc);
}

// ---------------------------------------------------------------------------------------------
// MLA query absorption: out[t][h] = [q_nope(t,h) · W_UK_h | q_pe(t,h)], W_UK_h = kv_b rows
// h·(nope+v) .. +nope, each [kv_lora]. Output f32 or bf16, row width kv_lora + rope.
// Block: 8 warps; lane = one of 32 output columns, warp = one of 8 slices of the nope axis,
// summed through shared memory (enough blocks to keep a decode step's 2 MB read parallel).
// Grid: (ceil(kv_lora/32), heads, ceil(T/8)); block 256; dynamic smem: 8·nope floats.
#define ABS_TT 8
// Nope rows each warp holds in registers at once: all 16 of DeepSeek's 128 (8 warps × 16),
// loaded before the kernel waits for the one ahead of it (the weights are constants), so the
// 2 MB read of a decode step costs one memory round trip, overlapped with the RoPE launch.
#define ABS_PER 16
template <typename W, typename O>
__device__ void absorb_impl(const float* q, const W* kv_b, O* out, int T, int H, int nope,
                            int rope, int v, int kv_lora, int split) {
  extern __shared__ float qs[];  // [ABS_TT][nope]
  __shared__ float part[8][ABS_TT][33];
  // Output rows are [q_abs | q_pe], or with split == rope (bf16, fast mode) [q_abs | hi | hi |
  // lo] (mla.cu's top comment).
  int h = blockIdx.y, t0 = blockIdx.z * ABS_TT, qk = nope + rope, lw = kv_lora + rope + 2 * split;
  int nt = min(ABS_TT, T - t0), lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
  int j = blockIdx.x * WARP + lane;
  const W* wcol = kv_b + (size_t)h * (nope + v) * kv_lora + min(j, kv_lora - 1);
  float wv[ABS_PER];
#pragma unroll
  for (int i = 0; i < ABS_PER; i++) {
    int d = w + 8 * i;
    wv[i] = d < nope ? ld_f(wcol + (size_t)d * kv_lora) : 0.0f;
  }
  pdl_enter();
  for (int i = threadIdx.x; i < nt * nope; i += blockDim.x) {
    int tt = i / nope, d = i % nope;
    qs[i] = q[((size_t)(t0 + tt) * H + h) * qk + d];
  }
  __syncthreads();
  float acc[ABS_TT];
#pragma unroll
  for (int tt = 0; tt < ABS_TT; tt++) acc[tt] = 0.0f;
  for (int c0 = 0; c0 < nope; c0 += 8 * ABS_PER) {
    if (c0 > 0) {
#pragma unroll
      for (int i = 0; i < ABS_PER; i++) {
        int d = c0 + w + 8 * i;
        wv[i] = d < nope ? ld_f(wcol + (size_t)d * kv_lora) : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < ABS_PER; i++) {
      int d = c0 + w + 8 * i;
      if (d < nope)
#pragma unroll
        for (int tt = 0; tt < ABS_TT; tt++) acc[tt] += qs[tt * nope + d] * wv[i];
    }
  }
#pragma unroll
  for (int tt = 0; tt < ABS_TT; tt++) part[w][tt][lane] = acc[tt];
  __syncthreads();
  if (w == 0 && j < kv_lora) {
    for (int tt = 0; tt < nt; tt++) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; k++) sum += part[k][tt][lane];
      st_f(out + ((size_t)(t0 + tt) * H + h) * lw + j, sum);
    }
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < nt * rope; i += blockDim.x) {
      int tt = i / rope, r = i % rope;
      O* o = out + ((size_t)(t0 + tt) * H + h) * lw + kv_lora + r;
      float x = q[((size_t)(t0 + tt) * H + h) * qk + nope + r];
      st_f(o, x);
      if (split) {
        st_f(o + rope, x);
        st_f(o + 2 * rope, x - bf2f(f2bf(x)));
      }
    }
  }
}
// absorb_impl calls pdl_enter itself, after its weight loads.
#define ABSORB(NAME, W, O)                                                                    \
  extern "C" __global__ void NAME(const float* q, const W* kv_b, O* out, int T, int H,       \
                                  int nope, int rope, int v, int kv_lora, int split) {       \
    absorb_impl(q, kv_b, out, T, H, nope, rope, v, kv_lora, split);                          \
  }
ABSORB(absorb_f32_f32, float, float)
ABSORB(absorb_f32_bf16, float, bf16_t)
ABSORB(absorb_bf16_f32, bf16_t, float)
ABSORB(absorb_bf16_bf16, bf16_t, bf16_t)

// The query absorption's rows from a per-head GEMM's f32 product lat [T·H][kv_lora] (ops.rs's
// absorb_gemm, for batches): the latent part stored in the output's type, then the rope part
// exactly as absorb_impl writes it. Grid: T·H; block 128.
template <typename O>
__device__ void absorb_finish_impl(const float* lat, const float* q, O* out, int nope, int rope,
                                   int kv_lora, int split) {
  size_t row = blockIdx.x;
  int qk = nope + rope, lw = kv_lora + rope + 2 * split;
  O* o = out + row * lw;
  for (int j = threadIdx.x; j < kv_lora; j += blockDim.x) st_f(o + j, lat[row * kv_lora + j]);
  for (int r = threadIdx.x; r < rope; r += blockDim.x) {
    float x = q[row * qk + nope + r];
    st_f(o + kv_lora + r, x);
    if (split) {
      st_f(o + kv_lora + rope + r, x);
      st_f(o + kv_lora + 2 * rope + r, x - bf2f(f2bf(x)));
    }
  }
}
extern "C" __global__ void absorb_finish_f32(const float* lat, const float* q, float* out,
                                             int nope, int rope, int kv_lora, int split) {
  pdl_enter();
  absorb_finish_impl(lat, q, out, nope, rope, kv_lora, split);
}
extern "C" __global__ void absorb_finish_bf16(const float* lat, const float* q, bf16_t* out,
                                              int nope, int rope, int kv_lora, int split) {
  pdl_enter();
  absorb_finish_impl(lat, q, out, nope, rope, kv_lora, split);
}

// Output un-absorption: out[t][h][c] = W_UV_h[c] · o_lat[t][h], W_UV_h = kv_b rows
// h·(nope+v)+nope .. +v. One warp per (head, c) and chunk of GEMV_MAX_M tokens: block z takes
// chunks z, z + gridDim.z, … (a batch's chunks run side by side; each output's arithmetic does
// not depend on which block computes it).
// Grid: (ceil(v/8), heads, chunks up to 65,535); block 256.
template <typename W>
__device__ void unabsorb_impl(const float* o_lat, const W* kv_b, float* out, int T, int H,
                              int nope, int v, int kv_lora) {
  int h = blockIdx.y, c = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (c >= v) return;
  const W* wrow = kv_b + ((size_t)h * (nope + v) + nope + c) * kv_lora;
  for (int t0 = blockIdx.z * GEMV_MAX_M; t0 < T; t0 += GEMV_MAX_M * gridDim.z) {
    int m = min(GEMV_MAX_M, T - t0);
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++) acc[i] = 0.0f;
    warp_row_dots(o_lat + ((size_t)t0 * H + h) * kv_lora, m, H * kv_lora, wrow, kv_lora, acc);
    if (threadIdx.x % WARP == 0)
      for (int i = 0; i < m; i++) out[((size_t)(t0 + i) * H + h) * v + c] = acc[i];
  }
}
extern "C" __global__ void unabsorb_f32(const float* o, const float* w, float* out, int T, int H,
                                        int nope, int v, int kv_lora) {
  pdl_enter();
  unabsorb_impl(o, w, out, T, H, nope, v, kv_lora);
}
extern "C" __global__ void unabsorb_bf16(const float* o, const bf16_t* w, float* out, int T, int H,
                                         int nope, int v, int kv_lora) {
  pdl_enter();
  unabsorb_impl(o, w, out, T, H, nope, v, kv_lora);
}

// unabsorb with mla_combine folded in: the attention's split-K partials (o_part [S][rows][kv_lora],
// ml_part [S][rows][2] = log2-domain max and sum, rows = T·H) are merged by each block for its
// head's rows into shared memory, then un-absorbed from there — one launch instead of two, and
// the merged rows never go through memory. The merge is mla_combine's arithmetic in its order
// (the sum L over the splits by 128 threads, shuffles, then 4 warp partials; the output column
// by four interleaved accumulators), so the result is bitwise combine-then-unabsorb.
// Grid: (ceil(v/8), heads); block 256; dynamic shared memory: (GEMV_MAX_M · kv_lora + splits)
// floats.
template <typename W>
__device__ void unabsorb_combine_impl(const float* o_part, const float* ml_part, int splits,
                                      const W* kv_b, float* out, int T, int H, int nope, int v,
                                      int kv_lora) {
  extern __shared__ float s_uc[];
  float* xs = s_uc;                                  // [GEMV_MAX_M][kv_lora] merged rows
  float* s_w = s_uc + GEMV_MAX_M * kv_lora;          // [splits] weights of the current row
  __shared__ float s_red[32];
  int h = blockIdx.y, c = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  const int CT = 128;  // mla_combine's block size: the merge's summation order follows it
  size_t rows = (size_t)T * H, step = rows * kv_lora;
  const W* wrow = kv_b + ((size_t)h * (nope + v) + nope + min(c, v - 1)) * kv_lora;
  prefetch_l2(wrow, (size_t)kv_lora * sizeof(W));
  pdl_enter();
  for (int t0 = 0; t0 < T; t0 += GEMV_MAX_M) {
    int m = min(GEMV_MAX_M, T - t0);
    for (int i = 0; i < m; i++) {
      size_t r = (size_t)(t0 + i) * H + h;
      float M = -FERRY_INF;
      for (int s = tid; s < splits; s += blockDim.x) M = fmaxf(M, ml_part[((size_t)s * rows + r) * 2]);
      for (int k = 16; k > 0; k >>= 1) M = fmaxf(M, SHFL_XOR(M, k));
      if (lane == 0) s_red[warp] = M;
      __syncthreads();
      M = -FERRY_INF;
      for (int x = 0; x < (int)blockDim.x / WARP; x++) M = fmaxf(M, s_red[x]);
      __syncthreads();
      float L = 0.0f;
      if (tid < CT)
        for (int s = tid; s < splits; s += CT) {
          float mx = ml_part[((size_t)s * rows + r) * 2];
          float w = mx == -FERRY_INF ? 0.0f : exp2f(mx - M);
          s_w[s] = w;
          L += ml_part[((size_t)s * rows + r) * 2 + 1] * w;
        }
      for (int k = 16; k > 0; k >>= 1) L += SHFL_XOR(L, k);
      if (lane == 0) s_red[warp] = L;
      __syncthreads();
      L = 0.0f;
      for (int x = 0; x < CT / WARP; x++) L += s_red[x];
      for (int d = tid; d < kv_lora; d += blockDim.x) {
        const float* src = o_part + r * kv_lora + d;
        float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f;
        int s = 0;
        for (; s + 4 <= splits; s += 4) {
          o0 += s_w[s] * src[(size_t)s * step];
          o1 += s_w[s + 1] * src[(size_t)(s + 1) * step];
          o2 += s_w[s + 2] * src[(size_t)(s + 2) * step];
          o3 += s_w[s + 3] * src[(size_t)(s + 3) * step];
        }
        for (; s < splits; s++) o0 += s_w[s] * src[(size_t)s * step];
        float o = (o0 + o1) + (o2 + o3);
        xs[(size_t)i * kv_lora + d] = L > 0.0f ? o / L : 0.0f;
      }
      __syncthreads();  // s_w and s_red are reused by the next row
    }
    if (c < v) {
      float acc[GEMV_MAX_M];
#pragma unroll
      for (int i = 0; i < GEMV_MAX_M; i++) acc[i] = 0.0f;
      warp_row_dots(xs, m, kv_lora, wrow, kv_lora, acc);
      if (lane == 0)
        for (int i = 0; i < m; i++) out[((size_t)(t0 + i) * H + h) * v + c] = acc[i];
    }
    __syncthreads();  // xs is rewritten by the next chunk of tokens
  }
}
extern "C" __global__ void unabsorb_combine_f32(const float* op, const float* ml, int splits,
                                                const float* w, float* out, int T, int H,
                                                int nope, int v, int kv_lora) {
  unabsorb_combine_impl(op, ml, splits, w, out, T, H, nope, v, kv_lora);
}
extern "C" __global__ void unabsorb_combine_bf16(const float* op, const float* ml, int splits,
                                                 const bf16_t* w, float* out, int T, int H,
                                                 int nope, int v, int kv_lora) {
  unabsorb_combine_impl(op, ml, splits, w, out, T, H, nope, v, kv_lora);
}

// ---------------------------------------------------------------------------------------------
// MHA-form inputs: gather a sequence's latent rows from the pages (all `width`, and the
// c_kv part alone for kv_b_proj), then split kv_b's output into per-head K = [k_nope | k_pe]
// and V. Grid: L; block 128.
// A split bf16 row's last `split` elements are widened as hi + lo.
template <typename KV>
__device__ void gather_latent_impl(const KV* pages, const int* table, int page, int width,
                                   float* out, float* ckv, int kv_lora, int split) {
  int p = blockIdx.x;
  const KV* src = pages + ((size_t)table[p / page] * page + p % page) * (width + split);
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    float v = ld_f(src + i);
    if (i >= width - split) v += ld_f(src + i + split);
    out[(size_t)p * width + i] = v;
    if (i < kv_lora) ckv[(size_t)p * kv_lora + i] = v;
  }
}
extern "C" __global__ void gather_latent_f32(const float* pages, const int* table, int page,
                                             int width, float* out, float* ckv, int kv_lora) {
  pdl_enter();
  gather_latent_impl(pages, table, page, width, out, ckv, kv_lora, 0);
}
extern "C" __global__ void gather_latent_bf16(const bf16_t* pages, const int* table, int page,
                                              int width, float* out, float* ckv, int kv_lora,
                                              int split) {
  pdl_enter();
  gather_latent_impl(pages, table, page, width, out, ckv, kv_lora, split);
}

// kv [L][H][nope+v] (kv_b output), lat [L][width] → K [L][H][nope+rope], V [L][H][v]; with
// split == rope (bf16, fast mode) K rows are [k_nope | hi | lo | hi] (mla.cu's top comment).
// Grid: (L, H); block 128.
template <typename O>
__device__ void mha_build_kv_impl(const float* kv, const float* lat, int H, int nope, int rope,
                                  int v, int kv_lora, O* K, O* V, int split) {
  int p = blockIdx.x, h = blockIdx.y, width = kv_lora + rope, qk = nope + rope + 2 * split;
  const float* src = kv + ((size_t)p * H + h) * (nope + v);
  O* kd = K + ((size_t)p * H + h) * qk;
  O* vd = V + ((size_t)p * H + h) * v;
  for (int i = threadIdx.x; i < nope; i += blockDim.x) st_f(kd + i, src[i]);
  for (int i = threadIdx.x; i < rope; i += blockDim.x) {
    float x = lat[(size_t)p * width + kv_lora + i];
    st_f(kd + nope + i, x);
    if (split) {
      st_f(kd + nope + rope + i, x - bf2f(f2bf(x)));
      st_f(kd + nope + 2 * rope + i, x);
    }
  }
  for (int i = threadIdx.x; i < v; i += blockDim.x) st_f(vd + i, src[nope + i]);
}
extern "C" __global__ void mha_build_kv_f32(const float* kv, const float* lat, int H, int nope,
                                            int rope, int v, int kv_lora, float* K, float* V) {
  pdl_enter();
  mha_build_kv_impl(kv, lat, H, nope, rope, v, kv_lora, K, V, 0);
}
extern "C" __global__ void mha_build_kv_bf16(const float* kv, const float* lat, int H, int nope,
                                             int rope, int v, int kv_lora, bf16_t* K, bf16_t* V,
                                             int split) {
  pdl_enter();
  mha_build_kv_impl(kv, lat, H, nope, rope, v, kv_lora, K, V, split);
}

// ---------------------------------------------------------------------------------------------
// MoE. Routing follows kernels/src/cpu/moe.rs (noaux_tc): sigmoid scores, bias-corrected
// choice, top-2-sum group scores, keep topk_group groups, top_k experts by choice (ties to the
// lower index), unbiased weights, optional renormalisation, routed scaling. Shared experts are
// appended as extra slots (ids E.., weight 1). One warp per token; E <= 1024.
struct RouteParams {
  int n_experts, top_k, n_group, topk_group, norm_topk, n_shared;
  float scale;
  // 1: DeepSeek-V2 routing (softmax scores, no bias, groups by their best, masked experts 0,
  // never renormalised); 0: DeepSeek-V3's (see kernels/src/cpu/moe.rs).
  int softmax;
};

__device__ __forceinline__ void warp_argmax(float v, int i, float* bv, int* bi) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    float ov = SHFL_XOR(v, m);
    int oi = SHFL_XOR(i, m);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  *bv = v;
  *bi = i;
}

extern "C" __global__ void moe_route(const float* logits, const float* bias, RouteParams p,
                                     int* ids, float* weights) {
  pdl_enter();
  __shared__ float score[1024];
  __shared__ float choice[1024];
  __shared__ float gscore[1024];
  __shared__ int kept[1024];
  int t = blockIdx.x, lane = threadIdx.x, E = p.n_experts, gsz = E / p.n_group;
  int slots = p.top_k + p.n_shared;
  const float* row = logits + (size_t)t * E;
  if (p.softmax) {
    float m = -FERRY_INF;
    for (int e = lane; e < E; e += WARP) m = fmaxf(m, row[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, SHFL_XOR(m, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += WARP) {
      float x = expf(row[e] - m);
      score[e] = x;
      sum += x;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += SHFL_XOR(sum, o);
    __syncwarp();
    for (int e = lane; e < E; e += WARP) {
      score[e] = score[e] / sum;
      choice[e] = score[e];
    }
  } else {
    for (int e = lane; e < E; e += WARP) {
      float s = 1.0f / (1.0f + expf(-row[e]));
      score[e] = s;
      choice[e] = s + bias[e];
    }
  }
  __syncwarp();
  for (int g = lane; g < p.n_group; g += WARP) {
    float a = -FERRY_INF, b = -FERRY_INF;
    for (int e = g * gsz; e < (g + 1) * gsz; e++) {
      float c = choice[e];
      if (c > a) { b = a; a = c; } else if (c > b) { b = c; }
    }
    gscore[g] = (gsz >= 2 && !p.softmax) ? a + b : a;
    kept[g] = 0;
  }
  __syncwarp();
  // Keep the topk_group best groups: mark the others by masking their experts.
  for (int round = 0; round < p.topk_group; round++) {
    float bv = -FERRY_INF;
    int bi = 0x7fffffff;
    for (int g = lane; g < p.n_group; g += WARP)
      if (!kept[g] && (gscore[g] > bv || (gscore[g] == bv && g < bi))) { bv = gscore[g]; bi = g; }
    warp_argmax(bv, bi, &bv, &bi);
    __syncwarp();
    if (lane == 0 && bi < p.n_group) kept[bi] = 1;
    __syncwarp();
  }
  for (int e = lane; e < E; e += WARP)
    if (!kept[e / gsz]) choice[e] = p.softmax ? 0.0f : -FERRY_INF;
  __syncwarp();
  float sum = 0.0f;
  for (int k = 0; k < p.top_k; k++) {
    float bv = -FERRY_INF;
    int bi = 0x7fffffff;
    for (int e = lane; e < E; e += WARP)
      if (choice[e] > bv || (choice[e] == bv && e < bi)) { bv = choice[e]; bi = e; }
    warp_argmax(bv, bi, &bv, &bi);
    __syncwarp();
    if (lane == 0) {
      ids[(size_t)t * slots + k] = bi;
      weights[(size_t)t * slots + k] = score[bi];
      choice[bi] = -FERRY_INF;
      sum += score[bi];
    }
    __syncwarp();
  }
  if (lane == 0) {
    float denom = sum + 1e-20f;
    for (int k = 0; k < p.top_k; k++) {
      float w = weights[(size_t)t * slots + k];
      if (p.norm_topk && !p.softmax) w = w / denom;
      weights[(size_t)t * slots + k] = w * p.scale;
    }
    for (int s = 0; s < p.n_shared; s++) {
      ids[(size_t)t * slots + p.top_k + s] = E + s;
      weights[(size_t)t * slots + p.top_k + s] = 1.0f;
    }
  }
}

// The same routing with each lane's experts in registers (session 14; ops.rs takes it for
// E <= 32·NPL, n_group <= 32, top_k <= 32 unless FERRY_FUSE=0). Expert e sits in lane e % 32,
// register e / 32: the lanes and order the strided loops above give it, so the softmax max and
// sum, and hence every score, are bitwise moe_route's. The group scores are moe_route's (each
// group's best, or best two, scanned in expert order); the topk_group kept groups are those
// with fewer than topk_group better groups (a larger score, or an equal one and a lower
// index: the order of moe_route's rounds; a NaN score never counts and is never kept, as
// there); the top_k experts are picked by warp shuffles of (choice, id, score) with
// moe_route's comparison, the picked register set to -inf, and lane k keeps pick k. No
// shared-memory rounds and no serial lane-0 tail: only the group scan goes through shared
// memory, and not at all for DeepSeek-V2's softmax routing when every group is kept (V2-Lite's
// one group), where the scan and ranking decide nothing.
// One warp routes token t; `c` is the warp's NPL · (WARP + 1) floats of shared memory (a
// token's choices with one pad word per 32, expert e at e + e / 32, so that lanes scanning
// 32-expert groups hit different banks). The logits are read through a volatile pointer (past
// L1): in moe_router_route other blocks of the same launch wrote them.
template <int NPL>
__device__ void moe_route_token(const float* logits, const float* bias, RouteParams p, int* ids,
                                float* weights, int t, float* c) {
  int lane = threadIdx.x % WARP;
  int E = p.n_experts, slots = p.top_k + p.n_shared;
  const volatile float* row = logits + (size_t)t * E;
  float score[NPL], choice[NPL], b[NPL];
#pragma unroll
  for (int j = 0; j < NPL; j++) {
    int e = lane + j * WARP;
    score[j] = e < E ? row[e] : 0.0f;
    b[j] = (!p.softmax && e < E) ? bias[e] : 0.0f;
  }
  if (p.softmax) {
    float m = -FERRY_INF;
#pragma unroll
    for (int j = 0; j < NPL; j++)
      if (lane + j * WARP < E) m = fmaxf(m, score[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, SHFL_XOR(m, o));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NPL; j++)
      if (lane + j * WARP < E) {
        float x = expf(score[j] - m);
        score[j] = x;
        sum += x;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += SHFL_XOR(sum, o);
#pragma unroll
    for (int j = 0; j < NPL; j++) {
      score[j] = score[j] / sum;
      choice[j] = score[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < NPL; j++) {
      float s = 1.0f / (1.0f + expf(-score[j]));
      score[j] = s;
      choice[j] = s + b[j];
    }
  }
  if (!(p.softmax && p.topk_group >= p.n_group)) {
    int gsz = E / p.n_group;
#pragma unroll
    for (int j = 0; j < NPL; j++)
      if (lane + j * WARP < E) c[lane + j * (WARP + 1)] = choice[j];
    __syncwarp();
    float gs = -FERRY_INF;
    if (lane < p.n_group) {
      float a = -FERRY_INF, b2 = -FERRY_INF;
      for (int e = lane * gsz; e < (lane + 1) * gsz; e++) {
        float v = c[e + e / WARP];
        if (v > a) { b2 = a; a = v; } else if (v > b2) { b2 = v; }
      }
      gs = (gsz >= 2 && !p.softmax) ? a + b2 : a;
    }
    int better = 0;
    for (int g = 0; g < p.n_group; g++) {
      float o = SHFL(gs, g);
      better += (o > gs || (o == gs && g < lane)) ? 1 : 0;
    }
    unsigned kept = (lane < p.n_group && better < p.topk_group && gs == gs) ? 1u << lane : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) kept |= SHFL_XOR(kept, o);
#pragma unroll
    for (int j = 0; j < NPL; j++) {
      int e = lane + j * WARP;
      if (e < E && !((kept >> (e / gsz)) & 1u)) choice[j] = p.softmax ? 0.0f : -FERRY_INF;
    }
  }
  float sum = 0.0f, my_w = 0.0f;
  int my_id = 0;
  for (int k = 0; k < p.top_k; k++) {
    float bv = -FERRY_INF, bs = 0.0f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < NPL; j++) {
      int e = lane + j * WARP;
      if (e < E && (choice[j] > bv || (choice[j] == bv && e < bi))) {
        bv = choice[j];
        bi = e;
        bs = score[j];
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      float ov = SHFL_XOR(bv, m), os = SHFL_XOR(bs, m);
      int oi = SHFL_XOR(bi, m);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; bs = os; }
    }
#pragma unroll
    for (int j = 0; j < NPL; j++)
      if (lane + j * WARP == bi) choice[j] = -FERRY_INF;
    if (lane == k) { my_id = bi; my_w = bs; }
    sum += bs;
  }
  if (lane < p.top_k) {
    float wt = my_w;
    if (p.norm_topk && !p.softmax) wt = wt / (sum + 1e-20f);
    ids[(size_t)t * slots + lane] = my_id;
    weights[(size_t)t * slots + lane] = wt * p.scale;
  }
  for (int s = lane; s < p.n_shared; s += WARP) {
    ids[(size_t)t * slots + p.top_k + s] = E + s;
    weights[(size_t)t * slots + p.top_k + s] = 1.0f;
  }
}
// Four tokens per block, one warp each.
template <int NPL>
__device__ void moe_route_reg_impl(const float* logits, const float* bias, RouteParams p,
                                   int* ids, float* weights, int T) {
  __shared__ float sh[4][NPL * (WARP + 1)];
  int w = threadIdx.x / WARP;
  int t = blockIdx.x * (blockDim.x / WARP) + w;
  if (t >= T) return;
  moe_route_token<NPL>(logits, bias, p, ids, weights, t, sh[w]);
}
// E <= 64 (DeepSeek-V2-Lite) and E <= 256 (DeepSeek-V2, V3). Grid: ceil(T / 4); block 128.
extern "C" __global__ void moe_route_w2(const float* logits, const float* bias, RouteParams p,
                                        int* ids, float* weights, int T) {
  pdl_enter();
  moe_route_reg_impl<2>(logits, bias, p, ids, weights, T);
}
extern "C" __global__ void moe_route_w8(const float* logits, const float* bias, RouteParams p,
                                        int* ids, float* weights, int T) {
  pdl_enter();
  moe_route_reg_impl<8>(logits, bias, p, ids, weights, T);
}

// The router GEMV and the routing of up to 8 tokens in one launch (a decode step's MoE at small
// batches; `gpu::ops::moe_router_route`, `FERRY_ROUTER_FUSED`). Every block computes 8 of the
// router's rows for every token with gemv_impl (so the logits are bitwise the GEMV's), then
// the last block to finish — counted on `done`, which it sets back to 0 for the next launch —
// routes the tokens, one warp each, with moe_route_token (so the ids and weights are bitwise
// the routing kernels'). The fence before the count makes each block's logits visible to the
// block that counts last. Grid: ceil(E / 8); block 256.
template <int NPL, typename W>
__device__ void moe_router_route_impl(const float* x, int T, const W* w, int hidden,
                                      const float* bias, RouteParams p, float* logits, int* ids,
                                      float* weights, unsigned* done) {
  __shared__ float sh[8][NPL * (WARP + 1)];
  __shared__ int last;
  gemv_impl(x, T, w, p.n_experts, hidden, logits, 0);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  int wi = threadIdx.x / WARP;
  if (wi < T) moe_route_token<NPL>(logits, bias, p, ids, weights, wi, sh[wi]);
  if (threadIdx.x == 0) *done = 0u;
}
#define ROUTER_ROUTE(NAME, NPL, W)                                                              \
  extern "C" __global__ void NAME(const float* x, int T, const W* w, int hidden,                \
                                  const float* bias, RouteParams p, float* logits, int* ids,    \
                                  float* weights, unsigned* done) {                             \
    gemv_prefetch(w, p.n_experts, hidden);                                                      \
    pdl_enter();                                                                                \
    moe_router_route_impl<NPL>(x, T, w, hidden, bias, p, logits, ids, weights, done);           \
  }
ROUTER_ROUTE(moe_router_route_w2_f32, 2, float)
ROUTER_ROUTE(moe_router_route_w2_bf16, 2, bf16_t)
ROUTER_ROUTE(moe_router_route_w8_f32, 8, float)
ROUTER_ROUTE(moe_router_route_w8_bf16, 8, bf16_t)

// act[t·K+s][r] = silu(gate_e[r]·x_t) · (up_e[r]·x_t), e = ids[t][s]; experts stacked
// [E_total][inter][hidden]; a warp streams R gate rows and their R up rows together.
// `moe_gate_up_*` take R = 2 (704 blocks for 8 slots of 1,408 rows: one wave on a 132-SM card,
// and four weight rows in flight per warp), `moe_gate_up1_*` R = 1 (the kernel before session
// 13, kept for FERRY_FUSE=0's before/after). Each output is the same arithmetic either way.
// Grid: (ceil(inter / (8·R)), T·K); block 256.
template <int R, typename W>
__device__ void moe_gate_up_impl(const float* x, const int* ids, const W* gate, const W* up,
                                 float* act, int K, int inter, int hidden) {
  int slot = blockIdx.y, t = slot / K;
  int r0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * R;
  if (r0 >= inter) return;
  size_t e = (size_t)ids[slot];
  float gu[2 * R][GEMV_MAX_M];
  const W* rows[2 * R];
#pragma unroll
  for (int k = 0; k < R; k++) {
    // Rows past the end repeat the last one (computed, never written).
    size_t r = (size_t)min(r0 + k, inter - 1);
    rows[k] = gate + (e * inter + r) * hidden;
    rows[R + k] = up + (e * inter + r) * hidden;
  }
#pragma unroll
  for (int k = 0; k < 2 * R; k++)
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++) gu[k][i] = 0.0f;
  warp_rows_dots<2 * R>(x + (size_t)t * hidden, 1, hidden, rows, hidden, gu);
  if (threadIdx.x % WARP == 0)
#pragma unroll
    for (int k = 0; k < R; k++)
      if (r0 + k < inter) act[(size_t)slot * inter + r0 + k] = silu_f(gu[k][0]) * gu[R + k][0];
}
extern "C" __global__ void moe_gate_up_f32(const float* x, const int* ids, const float* gate,
                                            const float* up, float* act, int K, int inter,
                                            int hidden) {
  pdl_enter();
  moe_gate_up_impl<2>(x, ids, gate, up, act, K, inter, hidden);
}
extern "C" __global__ void moe_gate_up_bf16(const float* x, const int* ids, const bf16_t* gate,
                                            const bf16_t* up, float* act, int K, int inter,
                                            int hidden) {
  pdl_enter();
  moe_gate_up_impl<2>(x, ids, gate, up, act, K, inter, hidden);
}
extern "C" __global__ void moe_gate_up1_f32(const float* x, const int* ids, const float* gate,
                                            const float* up, float* act, int K, int inter,
                                            int hidden) {
  pdl_enter();
  moe_gate_up_impl<1>(x, ids, gate, up, act, K, inter, hidden);
}
extern "C" __global__ void moe_gate_up1_bf16(const float* x, const int* ids, const bf16_t* gate,
                                            const bf16_t* up, float* act, int K, int inter,
                                            int hidden) {
  pdl_enter();
  moe_gate_up_impl<1>(x, ids, gate, up, act, K, inter, hidden);
}

// h[t][j] += Σ_s w[t][s] · (down_e[j] · act[t·K+s]); down stacked [E_total][hidden][inter].
// One block per (MOE_DOWN_R outputs j, token t): warp w takes slots w, w + 8, … and streams
// the MOE_DOWN_R expert rows of its slot together (one row of 1,408 bf16 alone is too short to
// keep a warp's loads in flight); the per-warp partials are summed in a fixed order
// (deterministic), each output's dot products in the same order as with one row per block.
// `moe_down_*` take 4 outputs per block, `moe_down1_*` one (the kernel before session 13,
// kept for FERRY_FUSE=0's before/after). Grid: (ceil(hidden / R), T); block 256.
template <int MOE_DOWN_R, typename W>
__device__ void moe_down_impl(const float* act, const int* ids, const float* wts, const W* down,
                              float* h, int K, int inter, int hidden) {
  __shared__ float part[8][MOE_DOWN_R];
  int t = blockIdx.y, j0 = blockIdx.x * MOE_DOWN_R, w = threadIdx.x / WARP;
  float total[MOE_DOWN_R];
#pragma unroll
  for (int r = 0; r < MOE_DOWN_R; r++) total[r] = 0.0f;
  for (int s = w; s < K; s += blockDim.x / WARP) {
    size_t e = (size_t)ids[(size_t)t * K + s];
    float acc[MOE_DOWN_R][GEMV_MAX_M];
    const W* rows[MOE_DOWN_R];
#pragma unroll
    for (int r = 0; r < MOE_DOWN_R; r++) {
      // Rows past the end repeat the last one (computed, never written).
      rows[r] = down + (e * hidden + min(j0 + r, hidden - 1)) * inter;
#pragma unroll
      for (int i = 0; i < GEMV_MAX_M; i++) acc[r][i] = 0.0f;
    }
    warp_rows_dots<MOE_DOWN_R>(act + ((size_t)t * K + s) * inter, 1, inter, rows, inter, acc);
    float ws = wts[(size_t)t * K + s];
#pragma unroll
    for (int r = 0; r < MOE_DOWN_R; r++) total[r] += ws * acc[r][0];
  }
  if (threadIdx.x % WARP == 0)
#pragma unroll
    for (int r = 0; r < MOE_DOWN_R; r++) part[w][r] = total[r];
  __syncthreads();
  int r = threadIdx.x;
  if (r < MOE_DOWN_R && j0 + r < hidden) {
    float sum = 0.0f;
    for (int x = 0; x < blockDim.x / WARP; x++) sum += part[x][r];
    h[(size_t)t * hidden + j0 + r] += sum;
  }
}
extern "C" __global__ void moe_down_f32(const float* act, const int* ids, const float* w,
                                         const float* down, float* h, int K, int inter,
                                         int hidden) {
  pdl_enter();
  moe_down_impl<4>(act, ids, w, down, h, K, inter, hidden);
}
extern "C" __global__ void moe_down_bf16(const float* act, const int* ids, const float* w,
                                         const bf16_t* down, float* h, int K, int inter,
                                         int hidden) {
  pdl_enter();
  moe_down_impl<4>(act, ids, w, down, h, K, inter, hidden);
}
extern "C" __global__ void moe_down1_f32(const float* act, const int* ids, const float* w,
                                         const float* down, float* h, int K, int inter,
                                         int hidden) {
  pdl_enter();
  moe_down_impl<1>(act, ids, w, down, h, K, inter, hidden);
}
extern "C" __global__ void moe_down1_bf16(const float* act, const int* ids, const float* w,
                                         const bf16_t* down, float* h, int K, int inter,
                                         int hidden) {
  pdl_enter();
  moe_down_impl<1>(act, ids, w, down, h, K, inter, hidden);
}

// Decode's down projection with many outputs per block (FERRY_MOE_DOWN_R=8|16, ops.rs): the
// same blocks, slots and reduction as moe_down_impl<R>, but each warp streams its slot's R
// expert rows (j0..j0+R-1 of one expert: R·inter contiguous weights) a 16-byte column chunk of
// every row at a time, software-pipelined: chunk n+1 of all the rows is loaded (with the eight
// activations it meets) before chunk n's FMAs. So a warp keeps RP × 512 bytes of weights in
// flight from its first load to its last, reads its slot's activation once per RP rows instead
// of once per four, and the registers stay bounded by RP (moe_down_impl<4> needs 133 on sm_90a:
// one block per SM, and its 512 blocks ran in four waves). Needs inter % 8 == 0 (ops.rs falls
// back to moe_down_impl<4> otherwise). Lane L adds columns L·8 + 256·n in ascending n with
// fma8's arithmetic, then warp_sum; the slot and warp sums are moe_down_impl's: every output
// is bitwise what moe_down_impl<1> and <4> give.
// acc[r] = row(j + r) · x over `inter` columns, rows past `hidden` repeating the last one.
template <int RP, typename W>
__device__ __forceinline__ void warp_rows_stream(const float* x, const W* w0, int j, int hidden,
                                                 int inter, float* acc) {
  typedef typename W8Of<W>::T V;
  int lane = threadIdx.x % WARP;
  const W* rows[RP];
#pragma unroll
  for (int r = 0; r < RP; r++) rows[r] = w0 + (size_t)min(j + r, hidden - 1) * inter;
  V cur[RP], nxt[RP];
  float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), xb = xa, na = xa, nb = xa;
  int c = lane * 8;
  if (c < inter) {
    xa = *reinterpret_cast<const float4*>(x + c);
    xb = *reinterpret_cast<const float4*>(x + c + 4);
#pragma unroll
    for (int r = 0; r < RP; r++) cur[r] = load8(rows[r] + c);
  }
  for (; c < inter; c += WARP * 8) {
    int cn = c + WARP * 8;
    if (cn < inter) {
      na = *reinterpret_cast<const float4*>(x + cn);
      nb = *reinterpret_cast<const float4*>(x + cn + 4);
#pragma unroll
      for (int r = 0; r < RP; r++) nxt[r] = load8(rows[r] + cn);
    }
#pragma unroll
    for (int r = 0; r < RP; r++) fma8v(&acc[r], xa, xb, cur[r]);
    xa = na, xb = nb;
#pragma unroll
    for (int r = 0; r < RP; r++) cur[r] = nxt[r];
  }
#pragma unroll
  for (int r = 0; r < RP; r++) acc[r] = warp_sum(acc[r]);
}
// R outputs per block, the rows streamed RP at a time (RP < R for f32 weights, whose chunks
// take twice the registers). Grid: (ceil(hidden / R), T); block 256.
template <int R, int RP, typename W>
__device__ void moe_down_rows_impl(const float* act, const int* ids, const float* wts,
                                   const W* down, float* h, int K, int inter, int hidden) {
  __shared__ float part[8][R];
  int t = blockIdx.y, j0 = blockIdx.x * R, w = threadIdx.x / WARP;
  float total[R];
#pragma unroll
  for (int r = 0; r < R; r++) total[r] = 0.0f;
  for (int s = w; s < K; s += blockDim.x / WARP) {
    size_t e = (size_t)ids[(size_t)t * K + s];
    const float* x = act + ((size_t)t * K + s) * inter;
    float ws = wts[(size_t)t * K + s];
#pragma unroll
    for (int p = 0; p < R; p += RP) {
      float acc[RP];
#pragma unroll
      for (int r = 0; r < RP; r++) acc[r] = 0.0f;
      warp_rows_stream<RP>(x, down + e * hidden * inter, j0 + p, hidden, inter, acc);
#pragma unroll
      for (int r = 0; r < RP; r++) total[p + r] += ws * acc[r];
    }
  }
  if (threadIdx.x % WARP == 0)
#pragma unroll
    for (int r = 0; r < R; r++) part[w][r] = total[r];
  __syncthreads();
  int r = threadIdx.x;
  if (r < R && j0 + r < hidden) {
    float sum = 0.0f;
    for (int x = 0; x < blockDim.x / WARP; x++) sum += part[x][r];
    h[(size_t)t * hidden + j0 + r] += sum;
  }
}
// R = 8: 256 blocks at T = 1, two per SM (hence the register bound): one wave on 132 SMs.
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_down8_f32(const float* act, const int* ids, const float* w, const float* down, float* h,
                  int K, int inter, int hidden) {
  pdl_enter();
  moe_down_rows_impl<8, 2>(act, ids, w, down, h, K, inter, hidden);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_down8_bf16(const float* act, const int* ids, const float* w, const bf16_t* down,
                   float* h, int K, int inter, int hidden) {
  pdl_enter();
  moe_down_rows_impl<8, 8>(act, ids, w, down, h, K, inter, hidden);
}
// R = 16: 128 blocks at T = 1, one per SM.
extern "C" __global__ void __launch_bounds__(256, 1)
    moe_down16_f32(const float* act, const int* ids, const float* w, const float* down,
                   float* h, int K, int inter, int hidden) {
  pdl_enter();
  moe_down_rows_impl<16, 4>(act, ids, w, down, h, K, inter, hidden);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    moe_down16_bf16(const float* act, const int* ids, const float* w, const bf16_t* down,
                    float* h, int K, int inter, int hidden) {
  pdl_enter();
  moe_down_rows_impl<16, 16>(act, ids, w, down, h, K, inter, hidden);
}

// ---------------------------------------------------------------------------------------------
// Expert-grouped MoE for batches. The per-pair kernels above read an expert's weights once per
// (token, slot) pair routed to it, so a batch re-reads the same expert once per token. Here the
// pairs are first grouped by expert (moe_group), and each expert's rows are streamed once per
// chunk of up to GEMV_MAX_M of its pairs: a step's weight traffic grows with the distinct
// experts touched (times ceil(pairs / GEMV_MAX_M) per expert), not with batch × slots.
// Every pair's result is computed by the same arithmetic wherever it sits in its chunk (the
// dot products are per row; the slot sum runs in slot order), so the output does not depend on
// the order moe_group's atomics put the pairs in.
#define MOE_GROUP_THREADS 1024
#define MOE_MAX_EXPERTS 2048

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); *total = the sum.
// scratch: WARP + 1 shared ints. Every thread of the block must call it.
__device__ int block_exclusive_scan(int v, int* scratch, int* total) {
  int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
  int x = v;
#pragma unroll
  for (int o = 1; o < WARP; o <<= 1) {
    int y = SHFL(x, (lane - o) & (WARP - 1));
    if (lane >= o) x += y;
  }
  if (lane == WARP - 1) scratch[w] = x;
  __syncthreads();
  if (w == 0) {
    int s = lane < nw ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
      int y = SHFL(s, (lane - o) & (WARP - 1));
      if (lane >= o) s += y;
    }
    scratch[lane] = s;
    if (lane == WARP - 1) scratch[WARP] = s;
  }
  __syncthreads();
  int excl = x - v + (w > 0 ? scratch[w - 1] : 0);
  *total = scratch[WARP];
  __syncthreads();  // scratch is free again
  return excl;
}

// Groups `pairs` (token, slot) pairs by expert: order[] lists pair indices expert by expert,
// chunks[3c..3c+3] = {expert, first index into order, pairs (<= chunk)}, *n_chunks the
// chunks written. Ids outside [0, n_total) are left out (moe_route never writes one).
// Grid: 1; block MOE_GROUP_THREADS; n_total <= MOE_MAX_EXPERTS.
extern "C" __global__ void moe_group(const int* ids, int pairs, int n_total, int chunk,
                                     int* order, int* chunks, int* n_chunks) {
  pdl_enter();
  __shared__ int count[MOE_MAX_EXPERTS];
  __shared__ int next[MOE_MAX_EXPERTS];
  __shared__ int scratch[WARP + 1];
  for (int e = threadIdx.x; e < n_total; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    int e = ids[p];
    if (e >= 0 && e < n_total) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Thread i owns experts [i·per, (i+1)·per): their pairs and chunks are laid out in order.
  int per = (n_total + blockDim.x - 1) / blockDim.x;
  int e0 = min((int)threadIdx.x * per, n_total), e1 = min(e0 + per, n_total);
  int mine = 0, mine_chunks = 0;
  for (int e = e0; e < e1; e++) {
    mine += count[e];
    mine_chunks += (count[e] + chunk - 1) / chunk;
  }
  int total_pairs, total_chunks;
  int off = block_exclusive_scan(mine, scratch, &total_pairs);
  int c = block_exclusive_scan(mine_chunks, scratch, &total_chunks);
  for (int e = e0; e < e1; e++) {
    int n = count[e];
    next[e] = off;
    for (int j = 0; j < n; j += chunk, c++) {
      chunks[3 * c] = e;
      chunks[3 * c + 1] = off + j;
      chunks[3 * c + 2] = min(chunk, n - j);
    }
    off += n;
  }
  if (threadIdx.x == 0) *n_chunks = total_chunks;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    int e = ids[p];
    if (e >= 0 && e < n_total) order[atomicAdd(&next[e], 1)] = p;
  }
}

// A chunk's expert and its pairs (indices t·K + s), read by every lane of the block.
struct MoeChunk {
  int expert, m;
  int pair[GEMV_MAX_M];
};
__device__ __forceinline__ MoeChunk moe_chunk(const int* order, const int* chunks, int c) {
  MoeChunk ch;
  ch.expert = chunks[3 * c];
  int first = chunks[3 * c + 1];
  ch.m = chunks[3 * c + 2];
#pragma unroll
  for (int i = 0; i < GEMV_MAX_M; i++) ch.pair[i] = i < ch.m ? order[first + i] : 0;
  return ch;
}

// act[p][r] = silu(gate_e[r]·x_t) · (up_e[r]·x_t) for the pairs p = t·K + s of each chunk.
// Grid: (ceil(inter/8), chunk bound); block 256; blocks past *n_chunks return at once.
template <typename W>
__device__ void moe_gate_up_grouped_impl(const float* x, const int* order, const int* chunks,
                                         const int* n_chunks, const W* gate, const W* up,
                                         float* act, int K, int inter, int hidden) {
  int c = blockIdx.y;
  if (c >= *n_chunks) return;
  int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (r >= inter) return;
  MoeChunk ch = moe_chunk(order, chunks, c);
  size_t e = (size_t)ch.expert;
  float gu[2][GEMV_MAX_M];
#pragma unroll
  for (int i = 0; i < GEMV_MAX_M; i++) gu[0][i] = gu[1][i] = 0.0f;
  const W* rows[2] = {gate + (e * inter + r) * hidden, up + (e * inter + r) * hidden};
  warp_rows_dots_by<2>([&](int i) { return x + (size_t)(ch.pair[i] / K) * hidden; }, ch.m, rows,
                       hidden, gu);
  if (threadIdx.x % WARP == 0)
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++)
      if (i < ch.m) act[(size_t)ch.pair[i] * inter + r] = silu_f(gu[0][i]) * gu[1][i];
}
extern "C" __global__ void moe_gate_up_grouped_f32(const float* x, const int* order,
                                                   const int* chunks, const int* n_chunks,
                                                   const float* gate, const float* up, float* act,
                                                   int K, int inter, int hidden) {
  pdl_enter();
  moe_gate_up_grouped_impl(x, order, chunks, n_chunks, gate, up, act, K, inter, hidden);
}
extern "C" __global__ void moe_gate_up_grouped_bf16(const float* x, const int* order,
                                                    const int* chunks, const int* n_chunks,
                                                    const bf16_t* gate, const bf16_t* up,
                                                    float* act, int K, int inter, int hidden) {
  pdl_enter();
  moe_gate_up_grouped_impl(x, order, chunks, n_chunks, gate, up, act, K, inter, hidden);
}

// y[p][j] = w[p] · (down_e[j] · act[p]) for the pairs p of each chunk.
// Grid: (ceil(hidden/8), chunk bound); block 256.
template <typename W>
__device__ void moe_down_grouped_impl(const float* act, const int* order, const int* chunks,
                                      const int* n_chunks, const float* wts, const W* down,
                                      float* y, int inter, int hidden) {
  int c = blockIdx.y;
  if (c >= *n_chunks) return;
  int j = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (j >= hidden) return;
  MoeChunk ch = moe_chunk(order, chunks, c);
  float acc[1][GEMV_MAX_M];
#pragma unroll
  for (int i = 0; i < GEMV_MAX_M; i++) acc[0][i] = 0.0f;
  const W* rows[1] = {down + ((size_t)ch.expert * hidden + j) * inter};
  warp_rows_dots_by<1>([&](int i) { return act + (size_t)ch.pair[i] * inter; }, ch.m, rows,
                       inter, acc);
  if (threadIdx.x % WARP == 0)
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++)
      if (i < ch.m) y[(size_t)ch.pair[i] * hidden + j] = wts[ch.pair[i]] * acc[0][i];
}
extern "C" __global__ void moe_down_grouped_f32(const float* act, const int* order,
                                                const int* chunks, const int* n_chunks,
                                                const float* w, const float* down, float* y,
                                                int inter, int hidden) {
  pdl_enter();
  moe_down_grouped_impl(act, order, chunks, n_chunks, w, down, y, inter, hidden);
}
extern "C" __global__ void moe_down_grouped_bf16(const float* act, const int* order,
                                                 const int* chunks, const int* n_chunks,
                                                 const float* w, const bf16_t* down, float* y,
                                                 int inter, int hidden) {
  pdl_enter();
  moe_down_grouped_impl(act, order, chunks, n_chunks, w, down, y, inter, hidden);
}

#if FERRY_MMA
// The same two grouped products on tensor cores (CUDA sm_80+, bf16 experts; chunks of up to
// 16 pairs): a warp computes 16 pairs × 32 output rows of one expert with m16n8k16 bf16 MMAs.
// The f32 activations are split into bf16 hi + lo parts (two MMAs against the same weights,
// ~16 mantissa bits, as the exact cuBLAS path does), so the result stays within rounding of
// the CUDA-core kernels while the FMAs leave the CUDA cores: those kernels are bound by
// reading the activations once per weight row, not by the weights.
// Lane l (g = l / 4, q = l % 4) holds pair rows g and g + 8. Within each 32-wide k step, the
// k order of both operands is permuted alike (a dot product does not depend on it) so that a
// lane's B operand is one 16-byte load of 8 consecutive weights, k0 + 8q .. k0 + 8q + 8:
// MMA s (0, 1) takes elements 4s + {0, 1} (registers a0 / a1, b0) and 4s + {2, 3} (a2 / a3, b1).
#define MOE_MMA_M 16
#define MOE_MMA_NT 4  // n8 tiles per warp: 32 output rows
struct MoeAFrag {
  u32 hi[2][4], lo[2][4];
};
// (x0, x1) as packed bf16 hi parts and the packed bf16 rounding of what they leave (lo):
// hi + lo keeps ~16 mantissa bits of each value.
__device__ __forceinline__ void split_bf2(float x0, float x1, u32& hi, u32& lo) {
  hi = pack_bf2(x0, x1);
  lo = pack_bf2(x0 - ferry_u2f(hi << 16), x1 - ferry_u2f(hi & 0xffff0000u));
}
__device__ __forceinline__ void moe_a_frag(const float* r0, const float* r1, MoeAFrag& f) {
  float v[2][8];
  const float* rows[2] = {r0, r1};
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float4 a = {0.0f, 0.0f, 0.0f, 0.0f}, b = a;
    if (rows[r]) {
      a = *reinterpret_cast<const float4*>(rows[r]);
      b = *reinterpret_cast<const float4*>(rows[r] + 4);
    }
    v[r][0] = a.x, v[r][1] = a.y, v[r][2] = a.z, v[r][3] = a.w;
    v[r][4] = b.x, v[r][5] = b.y, v[r][6] = b.z, v[r][7] = b.w;
  }
#pragma unroll
  for (int s = 0; s < 2; s++)
#pragma unroll
    for (int h = 0; h < 2; h++)      // elements 4s + 2h, 4s + 2h + 1
#pragma unroll
      for (int r = 0; r < 2; r++) {  // register a[2h + r]
        split_bf2(v[r][4 * s + 2 * h], v[r][4 * s + 2 * h + 1], f.hi[s][2 * h + r],
                  f.lo[s][2 * h + r]);
      }
}
__device__ __forceinline__ void moe_mma(float* c, const MoeAFrag& a, uint4 w) {
  mma_bf16(c, a.hi[0], w.x, w.y);
  mma_bf16(c, a.lo[0], w.x, w.y);
  mma_bf16(c, a.hi[1], w.z, w.w);
  mma_bf16(c, a.lo[1], w.z, w.w);
}
#endif

// act[p][n] = silu(gate_e[n]·x_t) · (up_e[n]·x_t) on tensor cores; inter and hidden multiples
// of 32. Grid: (ceil(inter / 128), chunk bound); block 128 (4 warps × 32 rows).
extern "C" __global__ void moe_gate_up_mma(const float* x, const int* order, const int* chunks,
                                           const int* n_chunks, const bf16_t* gate,
                                           const bf16_t* up, float* act, int K, int inter,
                                           int hidden) {
  pdl_enter();
#if FERRY_MMA
  int c = blockIdx.y;
  if (c >= *n_chunks) return;
  int lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
  int n0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * 8 * MOE_MMA_NT;
  if (n0 >= inter) return;
  size_t e = (size_t)chunks[3 * c];
  int first = chunks[3 * c + 1], m = chunks[3 * c + 2];
  int p0 = g < m ? order[first + g] : -1, p1 = g + 8 < m ? order[first + g + 8] : -1;
  const float* r0 = p0 >= 0 ? x + (size_t)(p0 / K) * hidden + 8 * q : nullptr;
  const float* r1 = p1 >= 0 ? x + (size_t)(p1 / K) * hidden + 8 * q : nullptr;
  const bf16_t* gw = gate + (e * inter + n0 + g) * hidden + 8 * q;
  const bf16_t* uw = up + (e * inter + n0 + g) * hidden + 8 * q;
  float cg[MOE_MMA_NT][4], cu[MOE_MMA_NT][4];
#pragma unroll
  for (int t = 0; t < MOE_MMA_NT; t++)
#pragma unroll
    for (int i = 0; i < 4; i++) cg[t][i] = cu[t][i] = 0.0f;
  for (int k = 0; k < hidden; k += 32) {
    uint4 wg[MOE_MMA_NT], wu[MOE_MMA_NT];
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++) {
      wg[t] = __ldg(reinterpret_cast<const uint4*>(gw + (size_t)t * 8 * hidden + k));
      wu[t] = __ldg(reinterpret_cast<const uint4*>(uw + (size_t)t * 8 * hidden + k));
    }
    MoeAFrag a;
    moe_a_frag(r0 ? r0 + k : nullptr, r1 ? r1 + k : nullptr, a);
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++) {
      moe_mma(cg[t], a, wg[t]);
      moe_mma(cu[t], a, wu[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < MOE_MMA_NT; t++) {
    int n = n0 + t * 8 + 2 * q;
    if (p0 >= 0) {
      act[(size_t)p0 * inter + n] = silu_f(cg[t][0]) * cu[t][0];
      act[(size_t)p0 * inter + n + 1] = silu_f(cg[t][1]) * cu[t][1];
    }
    if (p1 >= 0) {
      act[(size_t)p1 * inter + n] = silu_f(cg[t][2]) * cu[t][2];
      act[(size_t)p1 * inter + n + 1] = silu_f(cg[t][3]) * cu[t][3];
    }
  }
#endif
}

// y[p][j] = w[p] · (down_e[j] · act[p]) on tensor cores; hidden and inter multiples of 32.
// Grid: (ceil(hidden / 128), chunk bound); block 128.
extern "C" __global__ void moe_down_mma(const float* act, const int* order, const int* chunks,
                                        const int* n_chunks, const float* wts,
                                        const bf16_t* down, float* y, int inter, int hidden) {
  pdl_enter();
#if FERRY_MMA
  int c = blockIdx.y;
  if (c >= *n_chunks) return;
  int lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
  int j0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * 8 * MOE_MMA_NT;
  if (j0 >= hidden) return;
  size_t e = (size_t)chunks[3 * c];
  int first = chunks[3 * c + 1], m = chunks[3 * c + 2];
  int p0 = g < m ? order[first + g] : -1, p1 = g + 8 < m ? order[first + g + 8] : -1;
  const float* r0 = p0 >= 0 ? act + (size_t)p0 * inter + 8 * q : nullptr;
  const float* r1 = p1 >= 0 ? act + (size_t)p1 * inter + 8 * q : nullptr;
  const bf16_t* dw = down + (e * hidden + j0 + g) * inter + 8 * q;
  float cd[MOE_MMA_NT][4];
#pragma unroll
  for (int t = 0; t < MOE_MMA_NT; t++)
#pragma unroll
    for (int i = 0; i < 4; i++) cd[t][i] = 0.0f;
  for (int k = 0; k < inter; k += 32) {
    uint4 wd[MOE_MMA_NT];
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++)
      wd[t] = __ldg(reinterpret_cast<const uint4*>(dw + (size_t)t * 8 * inter + k));
    MoeAFrag a;
    moe_a_frag(r0 ? r0 + k : nullptr, r1 ? r1 + k : nullptr, a);
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++) moe_mma(cd[t], a, wd[t]);
  }
  float w0 = p0 >= 0 ? wts[p0] : 0.0f, w1 = p1 >= 0 ? wts[p1] : 0.0f;
#pragma unroll
  for (int t = 0; t < MOE_MMA_NT; t++) {
    int j = j0 + t * 8 + 2 * q;
    if (p0 >= 0) {
      y[(size_t)p0 * hidden + j] = w0 * cd[t][0];
      y[(size_t)p0 * hidden + j + 1] = w0 * cd[t][1];
    }
    if (p1 >= 0) {
      y[(size_t)p1 * hidden + j] = w1 * cd[t][2];
      y[(size_t)p1 * hidden + j + 1] = w1 * cd[t][3];
    }
  }
#endif
}

// Projections of 2–16 rows on tensor cores ("skinny" GEMM): out[m][n] (+)= x[m][k] · W[n][k]ᵀ,
// bf16 W, k a multiple of 32, x rows 16-byte aligned. A decode batch of a few sequences, or a
// speculative round's verify forward (k drafts + 1 rows), where the GEMV re-reads each x row
// per weight element from L1 (8 rows: 16 bytes of x per byte of weight; 2.5–4× a one-row
// GEMV) and cuBLAS costs a cast launch and GEMM launches outside the PDL chain. Here a block of
// 8 warps takes 8 weight rows (one n8 tile, so a grid as wide as the GEMV's) and splits k over
// its warps (warp w: the 32-wide k steps w, w + 8, …, GEMV_MMA_U of them in flight); each
// warp's m16n8 product (x rows past m are zero) goes through shared memory and is summed over
// the warps in warp order, so a row's result depends on neither the other rows nor m. The x
// fragments are split into bf16 hi + lo (moe_a_frag: ~16 mantissa bits, as exact-mode cuBLAS
// does), and the k order is permuted alike in both operands (moe_mma) so each lane's weights
// are one 16-byte load. With a second matrix (n2 > 0; linear_pair's q + kv_a) the blocks past
// n1 / 8 take W2 → out2, so n1 must be a multiple of 8. Each warp pulls one of its block's
// weight rows into L2 before waiting for the kernel ahead. Grid: ceil(n1 / 8) + ceil(n2 / 8);
// block 256.
#define GEMV_MMA_U 4
extern "C" __global__ void __launch_bounds__(256)
    gemv_mma_bf16(const float* x, int m, const bf16_t* w1, int n1, float* o1, const bf16_t* w2,
                  int n2, float* o2, int k, int accumulate) {
  int first = blockIdx.x * 8;
  const bf16_t* w = first < n1 ? w1 : w2;
  float* out = first < n1 ? o1 : o2;
  int n = first < n1 ? n1 : n2, n0 = first < n1 ? first : first - n1;
  int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP, g = lane / 4, q = lane % 4;
  if (n0 + wi < n) prefetch_l2(w + (size_t)(n0 + wi) * k, (size_t)k * sizeof(bf16_t));
  pdl_enter();
#if FERRY_MMA
  __shared__ float part[8][WARP][4];
  // Rows past the end repeat the last one (computed, never written).
  const bf16_t* wr = w + (size_t)min(n0 + g, n - 1) * k + 8 * q;
  const float* r0 = g < m ? x + (size_t)g * k + 8 * q : nullptr;
  const float* r1 = g + 8 < m ? x + (size_t)(g + 8) * k + 8 * q : nullptr;
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int steps = k / 32;
  for (int s0 = wi; s0 < steps; s0 += 8 * GEMV_MMA_U) {
    uint4 wv[GEMV_MMA_U];
#pragma unroll
    for (int u = 0; u < GEMV_MMA_U; u++) {
      int s = s0 + 8 * u;
      if (s < steps) wv[u] = __ldg(reinterpret_cast<const uint4*>(wr + (size_t)s * 32));
    }
#pragma unroll
    for (int u = 0; u < GEMV_MMA_U; u++) {
      int s = s0 + 8 * u;
      if (s < steps) {
        MoeAFrag a;
        moe_a_frag(r0 ? r0 + (size_t)s * 32 : nullptr, r1 ? r1 + (size_t)s * 32 : nullptr, a);
        moe_mma(c, a, wv[u]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; i++) part[wi][lane][i] = c[i];
  __syncthreads();
  // Thread t < 128 sums element t % 4 of lane t / 4's fragment: x row (lane / 4) (+ 8 for
  // elements 2, 3), weight row n0 + 2 · (lane % 4) (+ 1 for elements 1, 3).
  int t = threadIdx.x;
  if (t < 4 * WARP) {
    int l = t / 4, i = t % 4;
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < 8; v++) sum += part[v][l][i];
    int row = l / 4 + (i >= 2 ? 8 : 0), col = n0 + 2 * (l % 4) + (i & 1);
    if (row < m && col < n) {
      float* o = out + (size_t)row * n + col;
      *o = accumulate ? *o + sum : sum;
    }
  }
#endif
}

// The two products again, with the weights streamed two k steps ahead (`FERRY_MOE_MMA=stream`;
// `mma3` below adds an L2 prefetch; the kernels above are the "before" arm). Above, a warp issues one k step's
// weights (4 KB a warp for gate/up) and waits for them before its MMAs, so a warp is bound by
// memory latency, and the last, partial wave of blocks (about 680 blocks on 528 slots at batch
// 32 of V2-Lite) ran at a fraction of the bandwidth: 2.3 TB/s for gate/up and 1.7 for down,
// 80 % of a batch-32 step (ncu, BENCHMARKS.md session 19). Here two register buffers alternate:
// while one step's MMAs run, the next step's weights are in flight and the one after is issued
// as soon as a buffer frees. Each accumulator sees the same k steps in the same order, so the
// results are bitwise those of the kernels above.
#if FERRY_MMA
template <int NW>
__device__ __forceinline__ void moe_mma_load(uint4 (&b)[NW][MOE_MMA_NT], const bf16_t* const* w,
                                             size_t ld, int k) {
#pragma unroll
  for (int m = 0; m < NW; m++)
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++)
      b[m][t] = __ldg(reinterpret_cast<const uint4*>(w[m] + (size_t)t * 8 * ld + k));
}
// One k step for MT m-tiles of 16 pairs: each m-tile's A fragment is built from its two rows
// (r[2i], r[2i + 1]: this lane's pairs g + 16i and g + 16i + 8) and multiplied by the same
// weight registers, so a chunk of 16 · MT pairs reads its expert's weights once.
template <int NW, int MT>
__device__ __forceinline__ void moe_mma_step(float (*c)[MT][MOE_MMA_NT][4],
                                             const uint4 (&b)[NW][MOE_MMA_NT],
                                             const float* const* r, int k) {
#pragma unroll
  for (int i = 0; i < MT; i++) {
    MoeAFrag a;
    moe_a_frag(r[2 * i] ? r[2 * i] + k : nullptr, r[2 * i + 1] ? r[2 * i + 1] + k : nullptr, a);
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++)
#pragma unroll
      for (int m = 0; m < NW; m++) moe_mma(c[m][i][t], a, b[m][t]);
  }
}
// c[m][i] += the chunk's pairs (m-tile i: rows r[2i], r[2i + 1] of this lane) times weight
// matrix m's 32 rows at w[m] (row stride ld), over k_total (a multiple of 32), two register
// buffers alternating. Every accumulator sees the k steps in the same order whatever MT is, so
// a pair's outputs are bitwise the same in a chunk of 16 or of 32.
// PF > 0 (`FERRY_MOE_MMA=prefetch`): each iteration also asks L2 for the 128-byte lines of its
// rows PF elements ahead (one lane of each four that share a line), which keeps more of the
// weight stream in flight than the two register buffers hold without costing registers.
template <int NW, int MT, int PF = 0>
__device__ __forceinline__ void moe_mma_stream(const float* const* r, const bf16_t* const* w,
                                               size_t ld, int k_total,
                                               float (*c)[MT][MOE_MMA_NT][4]) {
  uint4 b0[NW][MOE_MMA_NT], b1[NW][MOE_MMA_NT];
  moe_mma_load<NW>(b0, w, ld, 0);
  if (32 < k_total) moe_mma_load<NW>(b1, w, ld, 32);
  for (int k = 0; k < k_total; k += 64) {
    if (PF > 0 && threadIdx.x % 4 == 0 && k + PF < k_total)
#pragma unroll
      for (int m = 0; m < NW; m++)
#pragma unroll
        for (int t = 0; t < MOE_MMA_NT; t++)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(w[m] + (size_t)t * 8 * ld + k + PF));
    moe_mma_step<NW, MT>(c, b0, r, k);
    if (k + 64 < k_total) moe_mma_load<NW>(b0, w, ld, k + 64);
    if (k + 32 < k_total) {
      moe_mma_step<NW, MT>(c, b1, r, k + 32);
      if (k + 96 < k_total) moe_mma_load<NW>(b1, w, ld, k + 96);
    }
  }
}
// This lane's pairs of chunk c (pair g + 8j for j < 2 · MT, -1 past the chunk's m) and the
// chunk's expert.
template <int MT>
__device__ __forceinline__ size_t moe_mma_pairs(const int* order, const int* chunks, int c, int g,
                                                int (&p)[2 * MT]) {
  int first = chunks[3 * c + 1], m = chunks[3 * c + 2];
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) p[j] = g + 8 * j < m ? order[first + g + 8 * j] : -1;
  return (size_t)chunks[3 * c];
}
#endif

// moe_gate_up_mma with the weights streamed ahead (PF: moe_mma_stream's L2 prefetch distance),
// for chunks of 16 · MT pairs. Grid and block as moe_gate_up_mma.
template <int PF, int MT>
__device__ __forceinline__ void moe_gate_up_stream_impl(const float* x, const int* order,
                                                        const int* chunks, const int* n_chunks,
                                                        const bf16_t* gate, const bf16_t* up,
                                                        float* act, int K, int inter,
                                                        int hidden) {
#if FERRY_MMA
  int c = blockIdx.y;
  if (c >= *n_chunks) return;
  int lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
  int n0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * 8 * MOE_MMA_NT;
  if (n0 >= inter) return;
  int p[2 * MT];
  size_t e = moe_mma_pairs<MT>(order, chunks, c, g, p);
  const float* r[2 * MT];
#pragma unroll
  for (int j = 0; j < 2 * MT; j++)
    r[j] = p[j] >= 0 ? x + (size_t)(p[j] / K) * hidden + 8 * q : nullptr;
  const bf16_t* w[2] = {gate + (e * inter + n0 + g) * hidden + 8 * q,
                        up + (e * inter + n0 + g) * hidden + 8 * q};
  float acc[2][MT][MOE_MMA_NT][4];
#pragma unroll
  for (int m = 0; m < 2; m++)
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
      for (int t = 0; t < MOE_MMA_NT; t++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[m][i][t][j] = 0.0f;
  moe_mma_stream<2, MT, PF>(r, w, hidden, hidden, acc);
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++) {
      int n = n0 + t * 8 + 2 * q;
#pragma unroll
      for (int h = 0; h < 2; h++) {  // rows g + 16i (h = 0) and g + 16i + 8 (h = 1)
        int pp = p[2 * i + h];
        if (pp < 0) continue;
        act[(size_t)pp * inter + n] = silu_f(acc[0][i][t][2 * h]) * acc[1][i][t][2 * h];
        act[(size_t)pp * inter + n + 1] =
            silu_f(acc[0][i][t][2 * h + 1]) * acc[1][i][t][2 * h + 1];
      }
    }
#endif
}

// moe_down_mma with the weights streamed ahead, for chunks of 16 · MT pairs. Grid and block as
// moe_down_mma.
template <int PF, int MT>
__device__ __forceinline__ void moe_down_stream_impl(const float* act, const int* order,
                                                     const int* chunks, const int* n_chunks,
                                                     const float* wts, const bf16_t* down,
                                                     float* y, int inter, int hidden) {
#if FERRY_MMA
  int c = blockIdx.y;
  if (c >= *n_chunks) return;
  int lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
  int j0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * 8 * MOE_MMA_NT;
  if (j0 >= hidden) return;
  int p[2 * MT];
  size_t e = moe_mma_pairs<MT>(order, chunks, c, g, p);
  const float* r[2 * MT];
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) r[j] = p[j] >= 0 ? act + (size_t)p[j] * inter + 8 * q : nullptr;
  const bf16_t* w[1] = {down + (e * hidden + j0 + g) * inter + 8 * q};
  float cd[1][MT][MOE_MMA_NT][4];
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++)
#pragma unroll
      for (int j = 0; j < 4; j++) cd[0][i][t][j] = 0.0f;
  moe_mma_stream<1, MT, PF>(r, w, inter, inter, cd);
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int t = 0; t < MOE_MMA_NT; t++) {
      int j = j0 + t * 8 + 2 * q;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        int pp = p[2 * i + h];
        if (pp < 0) continue;
        float wp = wts[pp];
        y[(size_t)pp * hidden + j] = wp * cd[0][i][t][2 * h];
        y[(size_t)pp * hidden + j + 1] = wp * cd[0][i][t][2 * h + 1];
      }
    }
#endif
}

// The streamed kernels: `mma2` as measured in session 19; `mma3` adds the L2 prefetch 64
// elements (one iteration, one 128-byte line per row) ahead. ncu at batch 32: `mma2`'s warps
// wait on memory ~80 % of their cycles at 3 (gate/up) and 5 (down) blocks per SM. On the H200
// (V2-Lite shape, graph steps, same run) the prefetch took batch 16 / 32 / 64 / 128 from
// 11.64 / 13.74 / 15.53 / 19.20 ms to 9.75 / 11.18 / 12.81 / 16.76; 128 and 192 elements ahead
// gained less or lost (12.79 / 15.59 ms at batch 32). At 256 every distance lost 7–8 %
// (24.9 → 26.7 ms: each shared expert's 16 chunks re-read its lines from L2, and prefetched
// lines evict them), so ops.rs takes it up to 128 tokens a pass. Capping registers for more
// blocks per SM (4 and 6) lost 4–26 % (BENCHMARKS.md, session 20).
// The `_m32` kernels take chunks of 32 pairs (two m-tiles per warp on the same weight
// registers): an expert with 17–32 pairs in a pass, which a batch of 256 gives most of
// DeepSeek-V2-Lite's 64 experts, has its weights read once instead of twice.
#define MOE_STREAM_KERNELS(SUFFIX, PF, MT)                                                     \
  extern "C" __global__ void moe_gate_up_##SUFFIX(                                             \
      const float* x, const int* order, const int* chunks, const int* n_chunks,                \
      const bf16_t* gate, const bf16_t* up, float* act, int K, int inter, int hidden) {        \
    pdl_enter();                                                                               \
    moe_gate_up_stream_impl<PF, MT>(x, order, chunks, n_chunks, gate, up, act, K, inter,       \
                                    hidden);                                                   \
  }                                                                                            \
  extern "C" __global__ void moe_down_##SUFFIX(                                                \
      const float* act, const int* order, const int* chunks, const int* n_chunks,              \
      const float* wts, const bf16_t* down, float* y, int inter, int hidden) {                 \
    pdl_enter();                                                                               \
    moe_down_stream_impl<PF, MT>(act, order, chunks, n_chunks, wts, down, y, inter, hidden);   \
  }
MOE_STREAM_KERNELS(mma2, 0, 1)
MOE_STREAM_KERNELS(mma3, 64, 1)
MOE_STREAM_KERNELS(mma2_m32, 0, 2)
MOE_STREAM_KERNELS(mma3_m32, 64, 2)

// ---------------------------------------------------------------------------------------------
// The grouped expert products as a pipelined grouped GEMM (`FERRY_MOE_MMA=pipe`). A block
// multiplies one chunk of up to 32 pairs by 128 weight rows of the chunk's expert, staging both
// operands in shared memory through a MOE_PIPE_STAGES-deep cp.async pipeline and taking its MMA
// fragments with ldmatrix. The register-streamed kernels above are bound by how many weight
// bytes they keep in flight (registers cap them at 2–3 blocks an SM; BENCHMARKS.md, session 26);
// here two 16 KB stages of weights per block are in flight whatever the registers. Session 20's
// shared-memory attempt lost to instruction issue, each warp rebuilding bf16 hi + lo fragments
// from f32 activations; here the activations are split into bf16 hi and lo rows once (the host
// side's `split_bf16` of x for gate/up; the gate/up epilogue writes act that way for down) and
// ldmatrix takes fragments of both halves as they are. The two halves are two MMAs against the
// same weight fragment, as in the kernels above (~16 mantissa bits of the activations), but the
// k order is the natural one, so the results match those kernels to f32 rounding, not bitwise.
//
// A stage: B = 128 weight rows × 64 k, then A hi and A lo = 32 pair rows × 64 k each; rows
// padded to 72 elements (144 bytes) so the 8 rows one ldmatrix phase reads fall in distinct
// banks. Warp w owns B rows 32w .. 32w + 31 as four n8 tiles; each warp computes both 16-pair
// m-tiles. 82,944 bytes of dynamic shared memory (ops.rs `MOE_PIPE_SMEM`): two blocks an SM.
#define MOE_PIPE_PAIRS 32
#define MOE_PIPE_ROWS 128
#define MOE_PIPE_BK 64
#define MOE_PIPE_LD (MOE_PIPE_BK + 8)
#define MOE_PIPE_STAGES 3
#define MOE_PIPE_STAGE_ELEMS ((MOE_PIPE_ROWS + 2 * MOE_PIPE_PAIRS) * MOE_PIPE_LD)
#if FERRY_MMA
// acc[i][t] = A(pair rows 16i .. 16i + 15) · W(B rows 32w + 8t .. 32w + 8t + 7)ᵀ over k_total
// (a multiple of MOE_PIPE_BK), for the 128 threads of the block. This thread copies, each stage,
// 16-byte segment `seg` of B rows brow + 16j (w_src[j], advanced by 64 elements a stage) and of
// A rows arow and arow + 16 (a_src[r], null past the chunk: zero-filled), hi and, `lo_off`
// elements on, lo.
__device__ __forceinline__ void moe_pipe_gemm(const bf16_t* const (&w_src)[8],
                                              const bf16_t* const (&a_src)[2], long long lo_off,
                                              int k_total, bf16_t* smem, float (&acc)[2][4][4]) {
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int t = 0; t < 4; t++)
#pragma unroll
      for (int j = 0; j < 4; j++) acc[i][t][j] = 0.0f;
  // Shared addresses in bytes, worked out once (no address conversion in the loop).
  constexpr u32 ROW = MOE_PIPE_LD * 2, STAGE = MOE_PIPE_STAGE_ELEMS * 2;
  constexpr u32 A_HI = MOE_PIPE_ROWS * ROW, A_LO = A_HI + MOE_PIPE_PAIRS * ROW;
  int tid = threadIdx.x, seg = tid % 8, row = tid / 8;
  int lane = tid % WARP, w = tid / WARP;
  const u32 base = smem_u32(smem);
  const u32 copy_at = row * ROW + seg * 16;  // + 16 rows a step of j or r
  // A (16 × 16, row-major): lanes 0–15 address rows 0–15 at k, lanes 16–31 at k + 8.
  const u32 a_at = (lane % 16) * ROW + (lane / 16) * 16;
  // B (weight rows n, k contiguous): one x4 covers two n8 tiles × k16; lanes 0–7 / 8–15
  // address the first tile's rows at k / k + 8, lanes 16–31 the second tile's.
  const u32 b_at = (32 * w + (lane / 16) * 8 + lane % 8) * ROW + ((lane / 8) % 2) * 16;
  const int kt_total = k_total / MOE_PIPE_BK;
  auto load = [&](int slot, int kt) {
    u32 st = base + slot * STAGE;
    int k = kt * MOE_PIPE_BK;
#pragma unroll
    for (int j = 0; j < 8; j++) cp_async16(st + copy_at + 16 * j * ROW, w_src[j] + k, 16);
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const bf16_t* hi = a_src[r] ? a_src[r] + k : w_src[0];
      const bf16_t* lo = a_src[r] ? hi + lo_off : hi;
      int bytes = a_src[r] ? 16 : 0;  // rows past the chunk: zero-filled
      cp_async16(st + A_HI + copy_at + 16 * r * ROW, hi, bytes);
      cp_async16(st + A_LO + copy_at + 16 * r * ROW, lo, bytes);
    }
  };
#pragma unroll
  for (int s = 0; s < MOE_PIPE_STAGES - 1; s++) {
    if (s < kt_total) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < kt_total; kt++) {
    cp_async_wait<MOE_PIPE_STAGES - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1's slot is free
    int next = kt + MOE_PIPE_STAGES - 1;
    if (next < kt_total) load(next % MOE_PIPE_STAGES, next);
    cp_async_commit();
    const u32 st = base + (kt % MOE_PIPE_STAGES) * STAGE;
#pragma unroll
    for (int kk = 0; kk < MOE_PIPE_BK; kk += 16) {
      u32 ahi[2][4], alo[2][4], b[2][4];
#pragma unroll
      for (int i = 0; i < 2; i++) {
        ldsm_x4(ahi[i], st + A_HI + 16 * i * ROW + a_at + kk * 2);
        ldsm_x4(alo[i], st + A_LO + 16 * i * ROW + a_at + kk * 2);
      }
#pragma unroll
      for (int tp = 0; tp < 2; tp++) ldsm_x4(b[tp], st + 16 * tp * ROW + b_at + kk * 2);
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int t = 0; t < 4; t++) {
          u32 b0 = b[t / 2][2 * (t % 2)], b1 = b[t / 2][2 * (t % 2) + 1];
          mma_bf16(acc[i][t], ahi[i], b0, b1);
          mma_bf16(acc[i][t], alo[i], b0, b1);
        }
    }
  }
  cp_async_wait0();
}

// One chunk of a grouped pass, as moe_group wrote it: expert `e`, first position `first` in
// `order`, `m` pairs (≤ MOE_PIPE_PAIRS). False for the grid's blocks past the pass's chunks.
struct MoePipeChunk {
  size_t e;
  int first, m;
};
__device__ __forceinline__ bool moe_pipe_chunk(const int* chunks, const int* n_chunks,
                                               MoePipeChunk& ck) {
  int c = blockIdx.y;
  if (c >= *n_chunks) return false;
  ck.e = (size_t)chunks[3 * c];
  ck.first = chunks[3 * c + 1];
  ck.m = chunks[3 * c + 2];
  return true;
}
#endif

// act = silu(gate_e · x_t) · (up_e · x_t) for the pairs of each chunk, written as bf16 hi rows
// and, `act_lo` elements on, lo rows, at the pairs' positions in `order` (what moe_down_pipe
// reads). xs: x split into bf16 hi rows [T][hidden] and, `x_lo` elements on, lo rows. Block row
// b of the 128 is gate row n0 + 16 (b / 32) + b % 16 when b % 32 < 16, else that up row, so
// each warp's tiles 0–1 (gate) and 2–3 (up) hold the same output rows. inter a multiple of 64,
// hidden of 64. Grid: (inter / 64, chunk bound); block 128; MOE_PIPE_SMEM dynamic shared bytes.
extern "C" __global__ void moe_gate_up_pipe(const bf16_t* xs, long long x_lo, const int* order,
                                            const int* chunks, const int* n_chunks,
                                            const bf16_t* gate, const bf16_t* up, bf16_t* act,
                                            long long act_lo, int K, int inter, int hidden) {
  pdl_enter();
#if FERRY_MMA
  extern __shared__ __align__(16) bf16_t moe_pipe_smem[];
  MoePipeChunk ck;
  if (!moe_pipe_chunk(chunks, n_chunks, ck)) return;
  const size_t e = ck.e;
  const int first = ck.first, m = ck.m;
  int n0 = blockIdx.x * 64, seg = threadIdx.x % 8, row = threadIdx.x / 8;
  const bf16_t* w_src[8];
#pragma unroll
  for (int j = 0; j < 8; j++) {
    int b = row + 16 * j;
    const bf16_t* mat = b % 32 < 16 ? gate : up;
    w_src[j] = mat + (e * inter + n0 + 16 * (b / 32) + b % 16) * hidden + seg * 8;
  }
  const bf16_t* a_src[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int pr = row + 16 * r;
    a_src[r] = pr < m ? xs + (size_t)(order[first + pr] / K) * hidden + seg * 8 : nullptr;
  }
  float acc[2][4][4];
  moe_pipe_gemm(w_src, a_src, x_lo, hidden, moe_pipe_smem, acc);
  int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {  // pair rows 16i + g (h = 0) and 16i + g + 8 (h = 1)
      int pr = 16 * i + g + 8 * h;
      if (pr >= m) continue;
      bf16_t* dst = act + (size_t)(first + pr) * inter;
#pragma unroll
      for (int t = 0; t < 2; t++) {
        float v0 = silu_f(acc[i][t][2 * h]) * acc[i][t + 2][2 * h];
        float v1 = silu_f(acc[i][t][2 * h + 1]) * acc[i][t + 2][2 * h + 1];
        u32 hi, lo;
        split_bf2(v0, v1, hi, lo);
        int n = n0 + 16 * w + 8 * t + 2 * q;
        *reinterpret_cast<u32*>(dst + n) = hi;
        *reinterpret_cast<u32*>(dst + act_lo + n) = lo;
      }
    }
#endif
}

// y[p][j] = w[p] · (down_e[j] · act[p]) for the pairs p of each chunk, act as moe_gate_up_pipe
// wrote it. inter a multiple of 64, hidden of 128. Grid: (hidden / 128, chunk bound); block 128;
// MOE_PIPE_SMEM dynamic shared bytes.
extern "C" __global__ void moe_down_pipe(const bf16_t* act, long long act_lo, const int* order,
                                         const int* chunks, const int* n_chunks, const float* wts,
                                         const bf16_t* down, float* y, int inter, int hidden) {
  pdl_enter();
#if FERRY_MMA
  extern __shared__ __align__(16) bf16_t moe_pipe_smem[];
  MoePipeChunk ck;
  if (!moe_pipe_chunk(chunks, n_chunks, ck)) return;
  const size_t e = ck.e;
  const int first = ck.first, m = ck.m;
  int j0 = blockIdx.x * MOE_PIPE_ROWS, seg = threadIdx.x % 8, row = threadIdx.x / 8;
  const bf16_t* w_src[8];
#pragma unroll
  for (int j = 0; j < 8; j++)
    w_src[j] = down + (e * hidden + j0 + row + 16 * j) * inter + seg * 8;
  const bf16_t* a_src[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int pr = row + 16 * r;
    a_src[r] = pr < m ? act + (size_t)(first + pr) * inter + seg * 8 : nullptr;
  }
  float acc[2][4][4];
  moe_pipe_gemm(w_src, a_src, act_lo, inter, moe_pipe_smem, acc);
  int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int pr = 16 * i + g + 8 * h;
      if (pr >= m) continue;
      int p = order[first + pr];
      float wp = wts[p];
      float* dst = y + (size_t)p * hidden;
#pragma unroll
      for (int t = 0; t < 4; t++) {
        int j = j0 + 32 * w + 8 * t + 2 * q;
        float2 v;
        v.x = wp * acc[i][t][2 * h];
        v.y = wp * acc[i][t][2 * h + 1];
        *reinterpret_cast<float2*>(dst + j) = v;
      }
    }
#endif
}

// h[t][j] += Σ_s y[t·K + s][j], the slots summed in order. Grid: ceil(T·hidden / 256); block 256.
extern "C" __global__ void moe_sum_slots(const float* y, float* h, int K, int hidden,
                                         long long n) {
  pdl_enter();
  long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  long long t = idx / hidden, j = idx % hidden;
  float s = 0.0f;
  for (int k = 0; k < K; k++) s += y[(t * K + k) * hidden + j];
  h[idx] += s;
}

// ---------------------------------------------------------------------------------------------
// Deterministic pseudo-random weights (benchmarks): x[i] = bf16(scale · u), u uniform in
// [-1, 1) from a 64-bit mix of (seed, i).
extern "C" __global__ void fill_random_bf16(bf16_t* x, long long n, unsigned long long seed,
                                            float scale) {
  pdl_enter();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned long long z = seed + 0x9e3779b97f4a7c15ull * (unsigned long long)(i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  float u = (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
  x[i] = f2bf(u * scale);
}
