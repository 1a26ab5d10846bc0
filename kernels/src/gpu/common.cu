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
  embed_impl(t, ids, out, hidden, rows);
}
extern "C" __global__ void embed_bf16(const bf16_t* t, const int* ids, float* out, int hidden,
                                      int rows) {
  embed_impl(t, ids, out, hidden, rows);
}

// ---------------------------------------------------------------------------------------------
// Residual add and RMSNorm: if delta, h[r] += delta[r]; then out[r] = w * (h[r] * rsqrt(mean(h²)+eps)).
// `out` may be null (add only). Grid: rows; block 256.
extern "C" __global__ void add_rms_norm(float* h, const float* delta, const float* w, float* out,
                                        int width, float eps) {
  __shared__ float red[32];
  float* x = h + (size_t)blockIdx.x * width;
  const float* d = delta ? delta + (size_t)blockIdx.x * width : nullptr;
  float ss = 0.0f;
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
// after it as the lo half of a bf16 pair: [c_kv | k_pe hi | k_pe lo]. Grid: tokens; block 256.
template <typename KV>
__device__ void latent_finish_impl(float* lat, int width, int kv_lora, const float* norm_w,
                                   float eps, const float* cos_t, const float* sin_t,
                                   int interleaved, const long long* slots, KV* pages,
                                   int split) {
  __shared__ float red[32];
  __shared__ float rot[1024];
  int t = blockIdx.x, dim = width - kv_lora, half = dim / 2;
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
                                             const long long* slots, float* pages) {
  latent_finish_impl(lat, width, kv_lora, nw, eps, c, s, il, slots, pages, 0);
}
extern "C" __global__ void latent_finish_bf16(float* lat, int width, int kv_lora, const float* nw,
                                              float eps, const float* c, const float* s, int il,
                                              const long long* slots, bf16_t* pages, int split) {
  latent_finish_impl(lat, width, kv_lora, nw, eps, c, s, il, slots, pages, split);
}

// ---------------------------------------------------------------------------------------------
// Elementwise.
extern "C" __global__ void silu_mul(float* g, const float* u, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) g[i] = silu_f(g[i]) * u[i];
}
extern "C" __global__ void cast_f32_bf16(const float* x, bf16_t* out, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = f2bf(x[i]);
}
// x = hi + lo with both halves bf16: products against bf16 weights keep ~16 mantissa bits.
extern "C" __global__ void split_bf16(const float* x, bf16_t* hi, bf16_t* lo, long long n) {
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
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = bf2f(x[i]);
}
// dst[i][:] = src[rows[i]][:]. Grid: rows.
extern "C" __global__ void gather_rows(const float* src, const int* rows, float* dst, int width) {
  const float* s = src + (size_t)rows[blockIdx.x] * width;
  float* d = dst + (size_t)blockIdx.x * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
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
__device__ __forceinline__ void fma8(float* acc, const float* x, W8b w) {
  unsigned p[4] = {w.v.x, w.v.y, w.v.z, w.v.w};
  float4 xa = *reinterpret_cast<const float4*>(x);
  float4 xb = *reinterpret_cast<const float4*>(x + 4);
  float xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    *acc += xs[2 * j] * ferry_u2f(p[j] << 16);
    *acc += xs[2 * j + 1] * ferry_u2f(p[j] & 0xffff0000u);
  }
}
__device__ __forceinline__ void fma8(float* acc, const float* x, W8f w) {
  float4 xa = *reinterpret_cast<const float4*>(x);
  float4 xb = *reinterpret_cast<const float4*>(x + 4);
  *acc += xa.x * w.a.x + xa.y * w.a.y + xa.z * w.a.z + xa.w * w.a.w;
  *acc += xb.x * w.b.x + xb.y * w.b.y + xb.z * w.b.z + xb.w * w.b.w;
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
// acc[r][i] = wrow[r] · x[i]. Each lane issues GEMV_U loads per row before using any.
template <int R, typename W>
__device__ __forceinline__ void warp_rows_dots(const float* x, int m, int ldx,
                                               const W* const* wrow, int k,
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
              for (int r = 0; r < R; r++) fma8(&acc[r][i], x + (size_t)i * ldx + c, wc[r][u]);
      }
    }
  } else {
    for (int c = lane; c < k; c += WARP) {
#pragma unroll
      for (int r = 0; r < R; r++) {
        float wv = ld_f(wrow[r] + c);
#pragma unroll
        for (int i = 0; i < GEMV_MAX_M; i++)
          if (i < m) acc[r][i] += x[(size_t)i * ldx + c] * wv;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++)
      if (i < m) acc[r][i] = warp_sum(acc[r][i]);  // m is uniform: no divergence
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
extern "C" __global__ void gemv_f32(const float* x, int m, const float* w, int n, int k,
                                    float* out, int acc) {
  gemv_impl(x, m, w, n, k, out, acc);
}
extern "C" __global__ void gemv_bf16(const float* x, int m, const bf16_t* w, int n, int k,
                                     float* out, int acc) {
  gemv_impl(x, m, w, n, k, out, acc);
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
  gemm_tiled_impl(x, w, out, m, n, k, acc);
}
extern "C" __global__ void __launch_bounds__(256)
    gemm_tiled_bf16(const float* x, const bf16_t* w, float* out, int m, int n, int k, int acc) {
  gemm_tiled_impl(x, w, out, m, n, k, acc);
}

// ---------------------------------------------------------------------------------------------
// MLA query absorption: out[t][h] = [q_nope(t,h) · W_UK_h | q_pe(t,h)], W_UK_h = kv_b rows
// h·(nope+v) .. +nope, each [kv_lora]. Output f32 or bf16, row width kv_lora + rope.
// Block: 8 warps; lane = one of 32 output columns, warp = one of 8 slices of the nope axis,
// summed through shared memory (enough blocks to keep a decode step's 2 MB read parallel).
// Grid: (ceil(kv_lora/32), heads, ceil(T/8)); block 256; dynamic smem: 8·nope floats.
#define ABS_TT 8
template <typename W, typename O>
__device__ void absorb_impl(const float* q, const W* kv_b, O* out, int T, int H, int nope,
                            int rope, int v, int kv_lora, int split) {
  extern __shared__ float qs[];  // [ABS_TT][nope]
  __shared__ float part[8][ABS_TT][33];
  // Output rows are [q_abs | q_pe], or with split == rope (bf16, fast mode) [q_abs | hi | hi |
  // lo] (mla.cu's top comment).
  int h = blockIdx.y, t0 = blockIdx.z * ABS_TT, qk = nope + rope, lw = kv_lora + rope + 2 * split;
  int nt = min(ABS_TT, T - t0), lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
  for (int i = threadIdx.x; i < nt * nope; i += blockDim.x) {
    int tt = i / nope, d = i % nope;
    qs[i] = q[((size_t)(t0 + tt) * H + h) * qk + d];
  }
  __syncthreads();
  int j = blockIdx.x * WARP + lane;
  float acc[ABS_TT];
#pragma unroll
  for (int tt = 0; tt < ABS_TT; tt++) acc[tt] = 0.0f;
  if (j < kv_lora) {
    const W* wcol = kv_b + (size_t)h * (nope + v) * kv_lora + j;
#pragma unroll 4
    for (int d = w; d < nope; d += 8) {
      float wv = ld_f(wcol + (size_t)d * kv_lora);
#pragma unroll
      for (int tt = 0; tt < ABS_TT; tt++) acc[tt] += qs[tt * nope + d] * wv;
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
#define ABSORB(NAME, W, O)                                                                    \
  extern "C" __global__ void NAME(const float* q, const W* kv_b, O* out, int T, int H,       \
                                  int nope, int rope, int v, int kv_lora, int split) {       \
    absorb_impl(q, kv_b, out, T, H, nope, rope, v, kv_lora, split);                          \
  }
ABSORB(absorb_f32_f32, float, float)
ABSORB(absorb_f32_bf16, float, bf16_t)
ABSORB(absorb_bf16_f32, bf16_t, float)
ABSORB(absorb_bf16_bf16, bf16_t, bf16_t)

// Output un-absorption: out[t][h][c] = W_UV_h[c] · o_lat[t][h], W_UV_h = kv_b rows
// h·(nope+v)+nope .. +v. One warp per (head, c), looping over tokens.
// Grid: (ceil(v/8), heads); block 256.
template <typename W>
__device__ void unabsorb_impl(const float* o_lat, const W* kv_b, float* out, int T, int H,
                              int nope, int v, int kv_lora) {
  int h = blockIdx.y, c = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (c >= v) return;
  const W* wrow = kv_b + ((size_t)h * (nope + v) + nope + c) * kv_lora;
  for (int t0 = 0; t0 < T; t0 += GEMV_MAX_M) {
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
  unabsorb_impl(o, w, out, T, H, nope, v, kv_lora);
}
extern "C" __global__ void unabsorb_bf16(const float* o, const bf16_t* w, float* out, int T, int H,
                                         int nope, int v, int kv_lora) {
  unabsorb_impl(o, w, out, T, H, nope, v, kv_lora);
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
  gather_latent_impl(pages, table, page, width, out, ckv, kv_lora, 0);
}
extern "C" __global__ void gather_latent_bf16(const bf16_t* pages, const int* table, int page,
                                              int width, float* out, float* ckv, int kv_lora,
                                              int split) {
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
  mha_build_kv_impl(kv, lat, H, nope, rope, v, kv_lora, K, V, 0);
}
extern "C" __global__ void mha_build_kv_bf16(const float* kv, const float* lat, int H, int nope,
                                             int rope, int v, int kv_lora, bf16_t* K, bf16_t* V,
                                             int split) {
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

// act[t·K+s][r] = silu(gate_e[r]·x_t) · (up_e[r]·x_t), e = ids[t][s]; experts stacked
// [E_total][inter][hidden]; a warp streams the gate and up rows together.
// Grid: (ceil(inter/8), T·K); block 256.
template <typename W>
__device__ void moe_gate_up_impl(const float* x, const int* ids, const W* gate, const W* up,
                                 float* act, int K, int inter, int hidden) {
  int slot = blockIdx.y, t = slot / K;
  int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (r >= inter) return;
  size_t e = (size_t)ids[slot];
  float gu[2][GEMV_MAX_M];
#pragma unroll
  for (int i = 0; i < GEMV_MAX_M; i++) gu[0][i] = gu[1][i] = 0.0f;
  const W* rows[2] = {gate + (e * inter + r) * hidden, up + (e * inter + r) * hidden};
  warp_rows_dots<2>(x + (size_t)t * hidden, 1, hidden, rows, hidden, gu);
  if (threadIdx.x % WARP == 0) act[(size_t)slot * inter + r] = silu_f(gu[0][0]) * gu[1][0];
}
extern "C" __global__ void moe_gate_up_f32(const float* x, const int* ids, const float* gate,
                                           const float* up, float* act, int K, int inter,
                                           int hidden) {
  moe_gate_up_impl(x, ids, gate, up, act, K, inter, hidden);
}
extern "C" __global__ void moe_gate_up_bf16(const float* x, const int* ids, const bf16_t* gate,
                                            const bf16_t* up, float* act, int K, int inter,
                                            int hidden) {
  moe_gate_up_impl(x, ids, gate, up, act, K, inter, hidden);
}

// h[t][j] += Σ_s w[t][s] · (down_e[j] · act[t·K+s]); down stacked [E_total][hidden][inter].
// One block per (j, t): warp w takes slots w, w + 8, …, and the per-warp partials are summed in
// a fixed order (deterministic), so the K expert rows of an output stream in parallel.
// Grid: (hidden, T); block 256.
template <typename W>
__device__ void moe_down_impl(const float* act, const int* ids, const float* wts, const W* down,
                              float* h, int K, int inter, int hidden) {
  __shared__ float part[8];
  int t = blockIdx.y, j = blockIdx.x, w = threadIdx.x / WARP;
  float total = 0.0f;
  for (int s = w; s < K; s += blockDim.x / WARP) {
    size_t e = (size_t)ids[(size_t)t * K + s];
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int i = 0; i < GEMV_MAX_M; i++) acc[i] = 0.0f;
    warp_row_dots(act + ((size_t)t * K + s) * inter, 1, inter, down + (e * hidden + j) * inter,
                  inter, acc);
    total += wts[(size_t)t * K + s] * acc[0];
  }
  if (threadIdx.x % WARP == 0) part[w] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int x = 0; x < blockDim.x / WARP; x++) sum += part[x];
    h[(size_t)t * hidden + j] += sum;
  }
}
extern "C" __global__ void moe_down_f32(const float* act, const int* ids, const float* w,
                                        const float* down, float* h, int K, int inter,
                                        int hidden) {
  moe_down_impl(act, ids, w, down, h, K, inter, hidden);
}
extern "C" __global__ void moe_down_bf16(const float* act, const int* ids, const float* w,
                                         const bf16_t* down, float* h, int K, int inter,
                                         int hidden) {
  moe_down_impl(act, ids, w, down, h, K, inter, hidden);
}

// ---------------------------------------------------------------------------------------------
// Deterministic pseudo-random weights (benchmarks): x[i] = bf16(scale · u), u uniform in
// [-1, 1) from a 64-bit mix of (seed, i).
extern "C" __global__ void fill_random_bf16(bf16_t* x, long long n, unsigned long long seed,
                                            float scale) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned long long z = seed + 0x9e3779b97f4a7c15ull * (unsigned long long)(i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  float u = (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
  x[i] = f2bf(u * scale);
}
