// mla.cu: MLA attention kernels for CUDA and HIP.
//
// Compile-time shape (defines from kernels/src/gpu/mla.rs):
//   MLA_DQK  logical latent row / absorbed query width (kv_lora + rope; 576 for the family)
//   MLA_DV   value width in the absorbed form (kv_lora; 512)
//   MHA_DQK  per-head query/key width in the MHA form (nope + rope; 192)
//   MHA_DV   per-head value width in the MHA form (128)
//   MLA_SPLIT  rope elements a bf16 cache keeps as a hi/lo pair (fast mode; 0 = plain rows)
//
// Split rows (fast mode). The RoPE half of an MLA score is too sensitive for one bf16 rounding
// of either factor, so bf16 kernels keep it to ~16 bits as bf16 pairs and let the tensor cores
// sum three products, q_hi·k_hi + q_hi·k_lo + q_lo·k_hi, in f32:
//   cache row  [c_kv (kv_lora) | k_pe hi | k_pe lo]               MLA_KROW = MLA_DQK + S
//   query row  [q_abs (kv_lora) | q_pe hi | q_pe hi | q_pe lo]      MLA_QROW = MLA_DQK + 2S
// The score is the dot product over the cache row's MLA_KROW elements plus a tail: the query's
// last S elements (q_lo) against the cache row's k_pe hi (elements MLA_DQK − S …). The MHA
// form's bf16 kernels see the same product as plain width-MHA_QKB rows: Q [q_nope | hi | hi |
// lo], K [k_nope | hi | lo | hi] (built by common.cu). f32 kernels never split.
//
// Kernels (extern "C"):
//   mla_tile_bf16      absorbed form over the paged bf16 latent cache; one block = one 16-row
//                      tile of query heads of one token (H ∈ {4, 8, 16k}; 4 and 8 fill the
//                      tile's first rows); split-K over the keys, merged by mla_combine.
//   mla_packed_bf16    the same kernel with (query token × head) rows packed densely into
//                      16-row tiles, per-row causal limits: any head count, no padded rows.
//   mla_tile8_bf16 / mla_packed8_bf16   8-warp variant: latent width split over warp pairs.
//   mla_tile_ws_bf16 / mla_packed_ws_bf16   sm_90: the 4-warp math fed by a bulk-copy
//                      producer warp through an mbarrier ring (the Hopper default).
//   mla_generic_*      the per-head fallback: one block per (token, head), f32 math, any
//                      shape; reads the cache once per head (what the tiles avoid).
//   mla_combine        merges split-K partials (log2-domain max, sum, unnormalised output).
//   pad_heads_bf16 / unpad_heads_f32   the 12 → 16 zero-pad dispatcher's copies.
//   mha_f32            MHA-form causal attention, f32, variable-length batch, any head count.
//   mha_flash_bf16     the same on tensor cores (FlashAttention-2 style, mma.sync bf16,
//                      f32 accumulation), CUDA sm_80+ only.
//   mha_wgmma_bf16     sm_90a: warpgroup MMA, cp.async loads by the compute warps.
//   mha_ws_bf16        sm_90a: TMA producer warp + two consumer warpgroups (the Hopper default).
//
// Softmax runs in the log2 domain: scores are multiplied by scale·log2(e) and exponentiated
// with exp2f; partial maxima are stored in that domain too.
#include "compat.cuh"

#ifndef MLA_DQK
#define MLA_DQK 576
#endif
#ifndef MLA_DV
#define MLA_DV 512
#endif
#ifndef MHA_DQK
#define MHA_DQK 192
#endif
#ifndef MHA_DV
#define MHA_DV 128
#endif
#ifndef MLA_SPLIT
#define MLA_SPLIT 0
#endif
#define MLA_KROW (MLA_DQK + MLA_SPLIT)
#define MLA_QROW (MLA_DQK + 2 * MLA_SPLIT)
#define MLA_PE_HI (MLA_DQK - MLA_SPLIT)  // a split row's k_pe hi part (the tail's keys)
#define MHA_QKB (MHA_DQK + 2 * MLA_SPLIT)

// Where a query row of the absorbed kernels comes from and how far it may look.
struct MlaArgs {
  const void* q;          // [B·SQ·H][MLA_QROW] bf16 or [..][MLA_DQK] f32, per kernel
  const void* pages;      // [blocks][page][MLA_KROW] bf16 or [..][MLA_DQK] f32
  const int* block_table; // [B][bt_stride]
  const int* ctx_len;     // [B]: keys visible to the sequence's last query
  float* o_part;          // [splits][B·SQ·H][MLA_DV] (splits > 1)
  float* ml_part;         // [splits][B·SQ·H][2] (splits > 1)
  float* out;             // [B·SQ·H][MLA_DV] (splits == 1)
  int bt_stride, sq, heads, page, splits, keys_per_split;
  float scale_log2;
  int page_shift;         // log2(page) (the tile kernels need a power-of-two page)
};

// Element offset of position p's row in rows of `row` elements.
__device__ __forceinline__ size_t key_offset(const MlaArgs& a, int b, int p, int row) {
  int blk = a.block_table[(size_t)b * a.bt_stride + p / a.page];
  return ((size_t)blk * a.page + p % a.page) * row;
}

// The same for a power-of-two page and bf16 rows (MLA_KROW): shifts instead of divisions (the
// tile kernels' hot loop).
__device__ __forceinline__ size_t key_offset_pow2(const MlaArgs& a, int b, int p) {
  int blk = a.block_table[(size_t)b * a.bt_stride + (p >> a.page_shift)];
  return (((size_t)blk << a.page_shift) + (p & (a.page - 1))) * MLA_KROW;
}

// Writes one row's result: final (normalised) when there is one split, else the partial.
__device__ __forceinline__ void write_row(const MlaArgs& a, int split, size_t grow, int col,
                                          float o, float m, float l, int total_rows) {
  if (a.splits == 1) {
    a.out[grow * MLA_DV + col] = l > 0.0f ? o / l : 0.0f;
  } else {
    a.o_part[((size_t)split * total_rows + grow) * MLA_DV + col] = o;
    if (col == 0) {
      a.ml_part[((size_t)split * total_rows + grow) * 2] = m;
      a.ml_part[((size_t)split * total_rows + grow) * 2 + 1] = l;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Generic per-head kernel. Grid: (splits, SQ·H, B); block 128 (4 warps stride over keys).
// QR / KR: query and cache row widths; SP: the split tail (see the top of the file).
#define G_QPL ((MLA_QROW + WARP - 1) / WARP)
#define G_VPL ((MLA_DV + WARP - 1) / WARP)
template <typename Q, typename KV, int QR, int KR, int SP>
__device__ void mla_generic_impl(const MlaArgs& a) {
  __shared__ float s_m[4], s_l[4];
  __shared__ float s_o[4][MLA_DV];
  int split = blockIdx.x, row = blockIdx.y, b = blockIdx.z;
  int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
  int total_rows = gridDim.z * gridDim.y;
  int i = row / a.heads;
  size_t grow = (size_t)b * gridDim.y + row;
  int lim = a.ctx_len[b] - a.sq + i + 1;
  int start = split * a.keys_per_split, end = min(lim, start + a.keys_per_split);
  const Q* q = (const Q*)a.q + grow * QR;
  const KV* pages = (const KV*)a.pages;
  float qv[G_QPL];
#pragma unroll
  for (int j = 0; j < G_QPL; j++) {
    int d = lane + j * WARP;
    qv[j] = d < QR ? ld_f(q + d) : 0.0f;
  }
  float m = -FERRY_INF, l = 0.0f, acc[G_VPL];
#pragma unroll
  for (int j = 0; j < G_VPL; j++) acc[j] = 0.0f;
  for (int p = start + w; p < end; p += 4) {
    const KV* kr = pages + key_offset(a, b, p, KR);
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < G_QPL; j++) {
      int d = lane + j * WARP;
      if (d < QR) dot += qv[j] * ld_f(kr + (d < KR ? d : d - KR + (MLA_DQK - SP)));
    }
    float s = warp_sum(dot) * a.scale_log2;
    float mn = fmaxf(m, s);
    float alpha = exp2f(m - mn), pw = exp2f(s - mn);
    l = l * alpha + pw;
#pragma unroll
    for (int j = 0; j < G_VPL; j++) {
      int d = lane + j * WARP;
      float vv = d < MLA_DV ? ld_f(kr + d) : 0.0f;
      acc[j] = acc[j] * alpha + pw * vv;
    }
    m = mn;
  }
  if (lane == 0) { s_m[w] = m; s_l[w] = l; }
#pragma unroll
  for (int j = 0; j < G_VPL; j++) {
    int d = lane + j * WARP;
    if (d < MLA_DV) s_o[w][d] = acc[j];
  }
  __syncthreads();
  float M = fmaxf(fmaxf(s_m[0], s_m[1]), fmaxf(s_m[2], s_m[3]));
  float sc[4], L = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    sc[k] = M == -FERRY_INF ? 0.0f : exp2f(s_m[k] - M);
    L += s_l[k] * sc[k];
  }
  for (int d = threadIdx.x; d < MLA_DV; d += blockDim.x) {
    float o = s_o[0][d] * sc[0] + s_o[1][d] * sc[1] + s_o[2][d] * sc[2] + s_o[3][d] * sc[3];
    write_row(a, split, grow, d, o, M, L, total_rows);
  }
}
extern "C" __global__ void mla_generic_f32(MlaArgs a) {
  pdl_enter();
  mla_generic_impl<float, float, MLA_DQK, MLA_DQK, 0>(a);
}
extern "C" __global__ void mla_generic_bf16(MlaArgs a) {
  pdl_enter();
  mla_generic_impl<bf16_t, bf16_t, MLA_QROW, MLA_KROW, MLA_SPLIT>(a);
}

// Merge split partials. Grid: (rows, ceil(MLA_DV / 128)); block 128; dynamic shared memory:
// one float per split. The block first finds the row's global maximum and each split's weight
// 2^(m_s − M) (threads stride over the splits), then each thread sums its output column over
// the splits with independent, coalesced loads — a single long context is split ~256 ways, and
// a serial per-thread walk over the splits cost more than the attention itself.
extern "C" __global__ void mla_combine(const float* o_part, const float* ml_part, int splits,
                                       int total_rows, float* out) {
  pdl_enter();
  extern __shared__ float s_w[];  // [splits]
  __shared__ float s_red[32];
  size_t r = blockIdx.x;
  int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, nwarps = blockDim.x / WARP;
  float M = -FERRY_INF;
  for (int s = tid; s < splits; s += blockDim.x)
    M = fmaxf(M, ml_part[((size_t)s * total_rows + r) * 2]);
  for (int m = 16; m > 0; m >>= 1) M = fmaxf(M, SHFL_XOR(M, m));
  if (lane == 0) s_red[warp] = M;
  __syncthreads();
  M = -FERRY_INF;
  for (int x = 0; x < nwarps; x++) M = fmaxf(M, s_red[x]);
  __syncthreads();  // s_red is reused for the sum below
  float L = 0.0f;
  for (int s = tid; s < splits; s += blockDim.x) {
    float m = ml_part[((size_t)s * total_rows + r) * 2];
    float w = m == -FERRY_INF ? 0.0f : exp2f(m - M);
    s_w[s] = w;
    L += ml_part[((size_t)s * total_rows + r) * 2 + 1] * w;
  }
  for (int m = 16; m > 0; m >>= 1) L += SHFL_XOR(L, m);
  if (lane == 0) s_red[warp] = L;
  __syncthreads();
  L = 0.0f;
  for (int x = 0; x < nwarps; x++) L += s_red[x];
  int d = blockIdx.y * blockDim.x + tid;
  if (d >= MLA_DV) return;
  const float* src = o_part + r * MLA_DV + d;
  size_t step = (size_t)total_rows * MLA_DV;
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
  out[r * MLA_DV + d] = L > 0.0f ? o / L : 0.0f;
}

// [T][H][W] → [T][Hp][W] with zero rows H..Hp (bf16). Grid: T·Hp; block 128.
extern "C" __global__ void pad_heads_bf16(const bf16_t* src, bf16_t* dst, int H, int Hp, int W) {
  pdl_enter();
  int t = blockIdx.x / Hp, h = blockIdx.x % Hp;
  bf16_t* d = dst + (size_t)blockIdx.x * W;
  for (int i = threadIdx.x; i < W; i += blockDim.x)
    d[i] = h < H ? src[((size_t)t * H + h) * W + i] : (bf16_t)0;
}
// [T][Hp][W] → [T][H][W] (f32). Grid: T·H; block 128.
extern "C" __global__ void unpad_heads_f32(const float* src, float* dst, int H, int Hp, int W) {
  pdl_enter();
  int t = blockIdx.x / H, h = blockIdx.x % H;
  const float* s = src + ((size_t)t * Hp + h) * W;
  for (int i = threadIdx.x; i < W; i += blockDim.x) dst[(size_t)blockIdx.x * W + i] = s[i];
}

// ---------------------------------------------------------------------------------------------
// Tensor-core helpers (PTX; CUDA sm_80+).
#if FERRY_MMA
// (smem_u32, ldmatrix, cp.async: compat.cuh)

// Online softmax of one step's scores held in the m16n8 accumulator layout of one warp (the
// layout of mma.sync's C fragment and of each warp's share of a wgmma accumulator), in place:
// scales (log2 domain) and causally masks the scores, updates the running row maxima and sums, leaves the exponentials in `s` and returns
// in `al0` / `al1` the factors by which the rows' earlier output must be rescaled. The
// accumulator layout: thread (g = lane / 4, c = lane % 4) of warp wl holds, for each 8-key
// group n, keys n·8 + 2c, +1 of rows g (j = 0, 1) and g + 8 (j = 2, 3).
struct RowState {
  float m0, m1, l0, l1;
};
template <int NK>
__device__ __forceinline__ void acc_row_softmax(float* s, RowState& r, float& al0, float& al1,
                                               int key0, int lim0, int lim1, int k_len,
                                               bool need_mask, float scale_log2, int c) {
  float mx0 = -FERRY_INF, mx1 = -FERRY_INF;
#pragma unroll
  for (int n = 0; n < NK / 8; n++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float v = s[4 * n + j] * scale_log2;
      if (need_mask) {
        int key = key0 + n * 8 + 2 * c + (j & 1);
        int lim = j < 2 ? lim0 : lim1;
        if (key >= lim || key >= k_len) v = -FERRY_INF;
      }
      s[4 * n + j] = v;
      if (j < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
    }
  mx0 = fmaxf(mx0, SHFL_XOR(mx0, 1));
  mx0 = fmaxf(mx0, SHFL_XOR(mx0, 2));
  mx1 = fmaxf(mx1, SHFL_XOR(mx1, 1));
  mx1 = fmaxf(mx1, SHFL_XOR(mx1, 2));
  float n0 = fmaxf(r.m0, mx0), n1 = fmaxf(r.m1, mx1);
  float off0 = n0 == -FERRY_INF ? 0.0f : n0, off1 = n1 == -FERRY_INF ? 0.0f : n1;
  al0 = fast_exp2(r.m0 - off0);
  al1 = fast_exp2(r.m1 - off1);
  r.m0 = n0;
  r.m1 = n1;
  float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
  for (int n = 0; n < NK / 8; n++) {
    s[4 * n] = fast_exp2(s[4 * n] - off0);
    s[4 * n + 1] = fast_exp2(s[4 * n + 1] - off0);
    s[4 * n + 2] = fast_exp2(s[4 * n + 2] - off1);
    s[4 * n + 3] = fast_exp2(s[4 * n + 3] - off1);
    ps0 += s[4 * n] + s[4 * n + 1];
    ps1 += s[4 * n + 2] + s[4 * n + 3];
  }
  r.l0 = r.l0 * al0 + ps0;
  r.l1 = r.l1 * al1 + ps1;
}
// The exponentials as bf16 A fragments of P·V (16 keys per fragment; the accumulator layout of
// two 8-key groups is the A-fragment layout of one 16-key step).
template <int NK>
__device__ __forceinline__ void acc_pack_p(const float* s, u32 (*pf)[4]) {
#pragma unroll
  for (int n = 0; n < NK / 8; n++) {
    pf[n / 2][(n & 1) * 2] = pack_bf2(s[4 * n], s[4 * n + 1]);
    pf[n / 2][(n & 1) * 2 + 1] = pack_bf2(s[4 * n + 2], s[4 * n + 3]);
  }
}
// Rescales N accumulator registers of O (rows g and g + 8 alternate in pairs).
template <int N>
__device__ __forceinline__ void acc_rescale(float* o, float al0, float al1) {
#pragma unroll
  for (int j = 0; j < N; j += 4) {
    o[j] *= al0; o[j + 1] *= al0; o[j + 2] *= al1; o[j + 3] *= al1;
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Hopper (sm_90) asynchronous-copy machinery shared by the warp-specialised kernels: mbarriers
// (a phase completes when its expected arrivals and transaction bytes are in), bulk copies
// global → shared that complete on an mbarrier, and named barriers over a subset of warps.
#if FERRY_MMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FERRY_SM90 1
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// The producer's arrival, announcing `bytes` of TMA traffic that will complete the phase.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits for the phase with this parity to complete. A wait that never ends (a pipeline bug)
// traps after ~2^26 polls instead of hanging the card.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  for (int spin = 0;; spin++) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if (spin > (1 << 26)) __trap();
  }
}
// A bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) into shared
// memory, completing `bytes` of transaction on `bar`.
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Barrier `id` (1..15) over `n` threads (a multiple of 32): the warps taking part.
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
#endif

// ---------------------------------------------------------------------------------------------
// Absorbed tile kernel: 16 query rows × BK keys per step, 4 warps, MLA_STAGES-deep cp.async
// pipeline. BK = MLA_BK (64: each warp scores 16 keys; 32: 8 keys, needs MLA_KROW and
// MLA_SPLIT % 32 == 0).
// Grid: (splits, tiles, B); block 128; dynamic shared memory from MlaShape::tile_smem().
#ifndef MLA_BK
#define MLA_BK 64
#endif
#ifndef MLA_STAGES
#define MLA_STAGES 2
#endif
#define TROWS 16
#define BK MLA_BK
#define NWT 4
#define KPW (BK / NWT)
#define KSTR (MLA_KROW + 8)  // bf16 elements per shared key row (pad: conflict-free ldmatrix)
#define QSTR (MLA_QROW + 8)  // bf16 elements per shared query row
#define PSTR (BK + 8)

// Row r of tile `tile` of sequence b: global row index (or -1) and causal key limit.
__device__ __forceinline__ void tile_row(const MlaArgs& a, int packed, int tile, int b, int r,
                                         long long* grow, int* lim) {
  int H = a.heads, rows_per_seq = a.sq * H;
  int local;
  if (packed) {
    local = tile * TROWS + r;
    if (local >= rows_per_seq) { *grow = -1; *lim = 0; return; }
  } else {
    int tr = H < TROWS ? H : TROWS, tiles_per_tok = H / tr;
    if (r >= tr) { *grow = -1; *lim = 0; return; }
    int i = tile / tiles_per_tok, t = tile % tiles_per_tok;
    local = i * H + t * tr + r;
  }
  *grow = (long long)b * rows_per_seq + local;
  *lim = a.ctx_len[b] - a.sq + local / H + 1;
}

#ifndef MLA_L2PF
#define MLA_L2PF 0
#endif

#if FERRY_MMA
// Asks L2 for keys c0 … c0 + nkeys - 1 (below `end`) some steps before their cp.async, so the
// copies that follow hit L2: one 128-byte line per request (MLA_L2PF steps ahead; 0 = off).
__device__ __forceinline__ void l2_prefetch_keys(const MlaArgs& a, const bf16_t* pages, int b,
                                                 int c0, int nkeys, int end, int tid,
                                                 int nthreads) {
  const int LINES = MLA_KROW * 2 / 128;
  for (int idx = tid; idx < nkeys * LINES; idx += nthreads) {
    int key = idx % nkeys, line = idx / nkeys, p = c0 + key;
    if (p < end) {
      const char* addr = (const char*)(pages + key_offset_pow2(a, b, p)) + line * 128;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(addr));
    }
  }
}

// The tile kernels' common start: each row's global index and causal limit into shared memory
// (with a barrier), the keys [start, end) this split covers, and the tile's queries staged in
// shared memory (zero rows for padding; no barrier after: the pipeline's first one covers it).
// G tile groups (packed kernels only): group gi takes tile blockIdx.y·G + gi, its row info and
// queries `stride` bytes after group gi − 1's, and the span covers every group's rows.
struct TileSpan {
  int start, end;
};
template <int PACKED, int G = 1>
__device__ __forceinline__ TileSpan tile_setup(const MlaArgs& a, int* s_lim, long long* s_row,
                                               bf16_t* s_q, int stride = 0) {
  static_assert(PACKED || G == 1, "tile groups take packed tiles only");
  auto lim_of = [&](int gi) { return (int*)((unsigned char*)s_lim + gi * stride); };
  auto row_of = [&](int gi) { return (long long*)((unsigned char*)s_row + gi * stride); };
  int tid = threadIdx.x, b = blockIdx.z;
  if (tid < G * TROWS) {
    int gi = tid / TROWS, r = tid % TROWS;
    long long gr;
    int lim;
    tile_row(a, PACKED, blockIdx.y * G + gi, b, r, &gr, &lim);
    row_of(gi)[r] = gr;
    lim_of(gi)[r] = lim;
  }
  __syncthreads();
  int lim_max = 0;
#pragma unroll
  for (int gi = 0; gi < G; gi++)
#pragma unroll
    for (int r = 0; r < TROWS; r++) lim_max = max(lim_max, lim_of(gi)[r]);
  int start = blockIdx.x * a.keys_per_split;
  TileSpan sp = {start, min(lim_max, start + a.keys_per_split)};
  const bf16_t* q = (const bf16_t*)a.q;
  for (int idx = tid; idx < G * TROWS * (MLA_QROW / 8); idx += blockDim.x) {
    int gr_ = idx / (MLA_QROW / 8), seg = idx % (MLA_QROW / 8);
    int gi = gr_ / TROWS, r = gr_ % TROWS;
    long long gr = row_of(gi)[r];
    uint4 v = make_uint4(0, 0, 0, 0);
    if (gr >= 0) v = *reinterpret_cast<const uint4*>(q + (size_t)gr * MLA_QROW + seg * 8);
    bf16_t* dst = (bf16_t*)((unsigned char*)s_q + gi * stride);
    *reinterpret_cast<uint4*>(dst + r * QSTR + seg * 8) = v;
  }
  return sp;
}

// cp.async of KEYS latent rows from position c0 of sequence b (rows at or past `end`
// zero-filled) into dst [KEYS][KSTR], spread over THREADS threads. A compile-time trip count
// lets every block-table lookup be issued before any copy.
template <int KEYS, int THREADS>
__device__ __forceinline__ void tile_load_keys(const MlaArgs& a, bf16_t* dst, int b, int c0,
                                               int end, int tid) {
  const bf16_t* pages = (const bf16_t*)a.pages;
  const int SEGS = KEYS * (MLA_KROW / 8), PER = (SEGS + THREADS - 1) / THREADS;
#pragma unroll
  for (int i = 0; i < PER; i++) {
    int idx = tid + i * THREADS;
    if (idx >= SEGS) break;
    int key = idx / (MLA_KROW / 8), seg = idx % (MLA_KROW / 8);
    int p = c0 + key;
    const bf16_t* src = pages;
    int bytes = 0;
    if (p < end) { src = pages + key_offset_pow2(a, b, p) + seg * 8; bytes = 16; }
    cp_async16(smem_u32(dst + key * KSTR + seg * 8), src, bytes);
  }
}

// The 4-warp tile kernels' shared memory: a ring of STAGES key steps, then per tile group (one
// for the cp.async kernel; one per 16-row tile sharing the ring in the grouped warp-specialised
// kernel) the staged queries, P, the cross-warp row maxima and sums, each row's causal limit
// and global index; `end` is the first byte past all groups (the warp-specialised kernel puts
// its mbarriers there). A group's share is TILE_GROUP_BYTES, a multiple of 16.
struct TileSmem {
  bf16_t* k;       // [STAGES][BK][KSTR]
  bf16_t* q;       // [16][QSTR]
  bf16_t* p;       // [16][PSTR]
  float* red;      // [NWT][16]
  float* l;        // [NWT][16]
  int* lim;        // [16]
  long long* row;  // [16]
  void* end;
};
#define TILE_GROUP_BYTES \
  (TROWS * QSTR * 2 + TROWS * PSTR * 2 + 2 * NWT * TROWS * 4 + TROWS * 4 + TROWS * 8)
template <int STAGES>
__device__ __forceinline__ TileSmem tile_smem(unsigned char* base, int group = 0,
                                              int groups = 1) {
  TileSmem t;
  t.k = (bf16_t*)base;
  unsigned char* gb = base + STAGES * BK * KSTR * 2;
  t.q = (bf16_t*)(gb + group * TILE_GROUP_BYTES);
  t.p = t.q + TROWS * QSTR;
  t.red = (float*)(t.p + TROWS * PSTR);
  t.l = t.red + NWT * TROWS;
  t.lim = (int*)(t.l + NWT * TROWS);
  t.row = (long long*)(t.lim + TROWS);
  t.end = gb + groups * TILE_GROUP_BYTES;
  return t;
}

// Row `row` of ring slot `st` of the key ring at k ([STAGES][BK][KSTR]).
__device__ __forceinline__ bf16_t* s_k_row(bf16_t* k, int st, int row) {
  return k + (st * BK + row) * KSTR;
}

// The 4-warp tile's running state per thread: O for this warp's output columns and the online
// softmax of rows g and g + 8.
struct TileAcc {
  float o[MLA_DV / (8 * NWT)][4];
  float m0, m1, l0, l1;
};

// One step of the 4-warp tile over the BK keys at kb (shared, [BK][KSTR]) from position c0:
// S = Q·Kᵀ (KPW keys per warp), the online softmax with the row maxima exchanged through s_red,
// P through s_p, then O += P·V over this warp's columns. `sync` is the barrier among the four
// compute warps (__syncthreads, or a named barrier when a producer warp is not taking part);
// its second call also orders this step's s_p writes after the previous step's P·V reads.
template <typename Sync>
__device__ __forceinline__ void tile_step(const MlaArgs& a, const bf16_t* kb, const bf16_t* s_q,
                                          bf16_t* s_p, float* s_red, int c0, int end, int lim0,
                                          int lim1, TileAcc& acc, Sync sync) {
  // w: the warp within its 4-warp group (a grouped block runs several).
  int lane = threadIdx.x % WARP, w = (threadIdx.x / WARP) % NWT, g = lane / 4, c = lane % 4;
  const int NT = MLA_DV / (8 * NWT);
  // S = Q · Kᵀ for this warp's KPW keys (NPW 8-key tiles); two accumulator sets so
  // consecutive mma do not wait on each other.
  const int NPW = KPW / 8;
  float s[2][NPW][4];
#pragma unroll
  for (int x = 0; x < 2; x++)
#pragma unroll
    for (int y = 0; y < NPW; y++) s[x][y][0] = s[x][y][1] = s[x][y][2] = s[x][y][3] = 0.0f;
  u32 qa = smem_u32(s_q + (lane % 16) * QSTR + (lane / 16) * 8);
#if KPW == 16
  u32 ka = smem_u32(kb + (w * 16 + (lane % 8) + 8 * (lane / 16)) * KSTR + 8 * ((lane / 8) % 2));
#pragma unroll 4
  for (int kk = 0; kk < MLA_KROW / 16; kk++) {
    u32 af[4], bf[4];
    ldsm_x4(af, qa + kk * 32);
    ldsm_x4(bf, ka + kk * 32);
    mma_bf16(s[kk & 1][0], af, bf[0], bf[1]);
    mma_bf16(s[kk & 1][1], af, bf[2], bf[3]);
  }
  // The split tail: q_pe lo against k_pe hi.
#pragma unroll
  for (int t = 0; t < MLA_SPLIT / 16; t++) {
    u32 af[4], bf[4];
    ldsm_x4(af, qa + (MLA_KROW / 16 + t) * 32);
    ldsm_x4(bf, ka + (MLA_PE_HI / 16 + t) * 32);
    mma_bf16(s[t & 1][0], af, bf[0], bf[1]);
    mma_bf16(s[t & 1][1], af, bf[2], bf[3]);
  }
#else
  // 8 keys per warp: one x4 ldmatrix covers two k-steps of the 8-key tile.
  u32 ka = smem_u32(kb + (w * 8 + (lane % 8)) * KSTR + 8 * (lane / 8));
#pragma unroll 4
  for (int k2 = 0; k2 < MLA_KROW / 32; k2++) {
    u32 af0[4], af1[4], bf[4];
    ldsm_x4(af0, qa + (2 * k2) * 32);
    ldsm_x4(af1, qa + (2 * k2 + 1) * 32);
    ldsm_x4(bf, ka + k2 * 64);
    mma_bf16(s[0][0], af0, bf[0], bf[1]);
    mma_bf16(s[1][0], af1, bf[2], bf[3]);
  }
  // The split tail (MLA_SPLIT % 32 == 0 on this path): q_pe lo against k_pe hi.
#pragma unroll
  for (int t = 0; t < MLA_SPLIT / 32; t++) {
    u32 af0[4], af1[4], bf[4];
    ldsm_x4(af0, qa + (MLA_KROW / 16 + 2 * t) * 32);
    ldsm_x4(af1, qa + (MLA_KROW / 16 + 2 * t + 1) * 32);
    ldsm_x4(bf, ka + (MLA_PE_HI / 32 + t) * 64);
    mma_bf16(s[0][0], af0, bf[0], bf[1]);
    mma_bf16(s[1][0], af1, bf[2], bf[3]);
  }
#endif
  float sc[NPW][4];
  float mx0 = -FERRY_INF, mx1 = -FERRY_INF;
#pragma unroll
  for (int n = 0; n < NPW; n++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int key = c0 + w * KPW + n * 8 + 2 * c + (j & 1);
      int lim = (j < 2) ? lim0 : lim1;
      float v = (s[0][n][j] + s[1][n][j]) * a.scale_log2;
      v = (key < lim && key < end) ? v : -FERRY_INF;
      sc[n][j] = v;
      if (j < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
    }
  mx0 = fmaxf(mx0, SHFL_XOR(mx0, 1));
  mx0 = fmaxf(mx0, SHFL_XOR(mx0, 2));
  mx1 = fmaxf(mx1, SHFL_XOR(mx1, 1));
  mx1 = fmaxf(mx1, SHFL_XOR(mx1, 2));
  if (c == 0) { s_red[w * TROWS + g] = mx0; s_red[w * TROWS + g + 8] = mx1; }
  sync();
  float n0 = acc.m0, n1 = acc.m1;
#pragma unroll
  for (int x = 0; x < NWT; x++) {
    n0 = fmaxf(n0, s_red[x * TROWS + g]);
    n1 = fmaxf(n1, s_red[x * TROWS + g + 8]);
  }
  float off0 = n0 == -FERRY_INF ? 0.0f : n0, off1 = n1 == -FERRY_INF ? 0.0f : n1;
  float al0 = fast_exp2(acc.m0 - off0), al1 = fast_exp2(acc.m1 - off1);
  acc.m0 = n0;
  acc.m1 = n1;
  float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
  for (int n = 0; n < NPW; n++) {
    float p0 = fast_exp2(sc[n][0] - off0), p1 = fast_exp2(sc[n][1] - off0);
    float p2 = fast_exp2(sc[n][2] - off1), p3 = fast_exp2(sc[n][3] - off1);
    ps0 += p0 + p1;
    ps1 += p2 + p3;
    int col = w * KPW + n * 8 + 2 * c;
    *reinterpret_cast<u32*>(s_p + g * PSTR + col) = pack_bf2(p0, p1);
    *reinterpret_cast<u32*>(s_p + (g + 8) * PSTR + col) = pack_bf2(p2, p3);
  }
  acc.l0 = acc.l0 * al0 + ps0;
  acc.l1 = acc.l1 * al1 + ps1;
  sync();
#pragma unroll
  for (int n = 0; n < NT; n++) {
    acc.o[n][0] *= al0; acc.o[n][1] *= al0; acc.o[n][2] *= al1; acc.o[n][3] *= al1;
  }
  // O[:, this warp's columns] += P · V.
  u32 pa = smem_u32(s_p + (lane % 16) * PSTR + (lane / 16) * 8);
  u32 va = smem_u32(kb + ((lane % 8) + 8 * ((lane / 8) % 2)) * KSTR + w * (MLA_DV / NWT) +
                    8 * (lane / 16));
#pragma unroll
  for (int kk = 0; kk < BK / 16; kk++) {
    u32 af[4];
    ldsm_x4(af, pa + kk * 32);
#pragma unroll
    for (int np = 0; np < NT / 2; np++) {
      u32 bf[4];
      ldsm_x4_t(bf, va + (kk * 16 * KSTR + np * 16) * 2);
      mma_bf16(acc.o[2 * np], af, bf[0], bf[1]);
      mma_bf16(acc.o[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// The 4-warp tile's end: row sums over the quad and the warps (through s_l, after `sync`),
// then each row's output — final, or this split's partial.
template <typename Sync>
__device__ __forceinline__ void tile_finish(const MlaArgs& a, int split, const TileAcc& acc,
                                            float* s_l, const long long* s_row, Sync sync) {
  int lane = threadIdx.x % WARP, w = (threadIdx.x / WARP) % NWT, g = lane / 4, c = lane % 4;
  int total_rows = gridDim.z * a.sq * a.heads;
  float l0 = acc.l0, l1 = acc.l1;
  l0 += SHFL_XOR(l0, 1);
  l0 += SHFL_XOR(l0, 2);
  l1 += SHFL_XOR(l1, 1);
  l1 += SHFL_XOR(l1, 2);
  if (c == 0) { s_l[w * TROWS + g] = l0; s_l[w * TROWS + g + 8] = l1; }
  sync();
  float L0 = 0.0f, L1 = 0.0f;
#pragma unroll
  for (int x = 0; x < NWT; x++) { L0 += s_l[x * TROWS + g]; L1 += s_l[x * TROWS + g + 8]; }
  long long r0 = s_row[g], r1 = s_row[g + 8];
#pragma unroll
  for (int n = 0; n < MLA_DV / (8 * NWT); n++) {
    int col = w * (MLA_DV / NWT) + n * 8 + 2 * c;
    if (r0 >= 0) {
      write_row(a, split, r0, col, acc.o[n][0], acc.m0, L0, total_rows);
      write_row(a, split, r0, col + 1, acc.o[n][1], acc.m0, L0, total_rows);
    }
    if (r1 >= 0) {
      write_row(a, split, r1, col, acc.o[n][2], acc.m1, L1, total_rows);
      write_row(a, split, r1, col + 1, acc.o[n][3], acc.m1, L1, total_rows);
    }
  }
}
__device__ __forceinline__ void tile_acc_init(TileAcc& acc) {
#pragma unroll
  for (int n = 0; n < MLA_DV / (8 * NWT); n++)
    acc.o[n][0] = acc.o[n][1] = acc.o[n][2] = acc.o[n][3] = 0.0f;
  acc.m0 = acc.m1 = -FERRY_INF;
  acc.l0 = acc.l1 = 0.0f;
}

template <int PACKED>
__device__ void mla_tile_mma(const MlaArgs& a) {
  extern __shared__ __align__(16) unsigned char smem[];
  TileSmem sm = tile_smem<MLA_STAGES>(smem);
  bf16_t *s_k = sm.k, *s_q = sm.q, *s_p = sm.p;
  float *s_red = sm.red, *s_l = sm.l;
  int* s_lim = sm.lim;
  long long* s_row = sm.row;

  int split = blockIdx.x, b = blockIdx.z;
  int tid = threadIdx.x, g = (tid % WARP) / 4;
  TileSpan sp = tile_setup<PACKED>(a, s_lim, s_row, s_q);
  int start = sp.start, end = sp.end, lim0 = s_lim[g], lim1 = s_lim[g + 8];
#if MLA_L2PF > 0
  const bf16_t* pages = (const bf16_t*)a.pages;
#endif
  auto load_chunk = [&](int buf, int c0) {
    tile_load_keys<BK, 128>(a, s_k + buf * BK * KSTR, b, c0, end, tid);
  };

  TileAcc acc;
  tile_acc_init(acc);

  int nchunks = start < end ? (end - start + BK - 1) / BK : 0;
#pragma unroll
  for (int st = 0; st < MLA_STAGES - 1; st++) {
    if (st < nchunks) load_chunk(st, start + st * BK);
    cp_async_commit();
  }
#if MLA_L2PF > 0
  for (int st = MLA_STAGES - 1; st < MLA_STAGES - 1 + MLA_L2PF && st < nchunks; st++)
    l2_prefetch_keys(a, pages, b, start + st * BK, BK, end, tid, 128);
#endif
  for (int it = 0; it < nchunks; it++) {
    int c0 = start + it * BK;
    int nxt = it + MLA_STAGES - 1;
    if (nxt < nchunks) load_chunk(nxt % MLA_STAGES, start + nxt * BK);
    cp_async_commit();
#if MLA_L2PF > 0
    if (nxt + MLA_L2PF < nchunks)
      l2_prefetch_keys(a, pages, b, start + (nxt + MLA_L2PF) * BK, BK, end, tid, 128);
#endif
    cp_async_wait<MLA_STAGES - 1>();
    __syncthreads();
    const bf16_t* kb = s_k + (it % MLA_STAGES) * BK * KSTR;
    tile_step(a, kb, s_q, s_p, s_red, c0, end, lim0, lim1, acc, [] { __syncthreads(); });
    __syncthreads();  // the stage is free for the next load
  }
  cp_async_wait0();
  tile_finish(a, split, acc, s_l, s_row, [] { __syncthreads(); });
}
#endif

// Scalar version of the tile kernel (HIP, and CUDA targets without mma): the same tiling —
// every key row is read once per 16-row tile — with f32 FMA. Block 128; same shared layout.
#define SC_VPT ((MLA_DV + 127) / 128)
template <int PACKED>
__device__ void mla_tile_scalar(const MlaArgs& a) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16_t* s_k = (bf16_t*)smem;                        // [BK][KSTR] (one buffer used)
  bf16_t* s_q = s_k + MLA_STAGES * BK * KSTR;         // [16][QSTR]
  float* s_p = (float*)(s_q + TROWS * QSTR);          // [16][BK]
  int* s_lim = (int*)(s_p + TROWS * BK);              // [16]
  long long* s_row = (long long*)(s_lim + TROWS);     // [16]
  float* s_m = (float*)(s_row + TROWS);               // [16]
  float* s_al = s_m + TROWS;                          // [16]
  float* s_l = s_al + TROWS;                          // [16]
  int split = blockIdx.x, tile = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  int total_rows = gridDim.z * a.sq * a.heads;
  if (tid < TROWS) {
    long long gr;
    int lim;
    tile_row(a, PACKED, tile, b, tid, &gr, &lim);
    s_row[tid] = gr;
    s_lim[tid] = lim;
    s_m[tid] = -FERRY_INF;
    s_l[tid] = 0.0f;
  }
  __syncthreads();
  int lim_max = 0;
  for (int r = 0; r < TROWS; r++) lim_max = max(lim_max, s_lim[r]);
  int start = split * a.keys_per_split, end = min(lim_max, start + a.keys_per_split);
  const bf16_t* q = (const bf16_t*)a.q;
  for (int idx = tid; idx < TROWS * MLA_QROW; idx += blockDim.x) {
    int r = idx / MLA_QROW, d = idx % MLA_QROW;
    s_q[r * QSTR + d] = s_row[r] >= 0 ? q[(size_t)s_row[r] * MLA_QROW + d] : (bf16_t)0;
  }
  float acc[TROWS][SC_VPT];
  for (int r = 0; r < TROWS; r++)
    for (int j = 0; j < SC_VPT; j++) acc[r][j] = 0.0f;
  const bf16_t* pages = (const bf16_t*)a.pages;
  for (int c0 = start; c0 < end; c0 += BK) {
    __syncthreads();
    for (int idx = tid; idx < BK * MLA_KROW; idx += blockDim.x) {
      int key = idx / MLA_KROW, d = idx % MLA_KROW, p = c0 + key;
      s_k[key * KSTR + d] = p < end ? pages[key_offset(a, b, p, MLA_KROW) + d] : (bf16_t)0;
    }
    __syncthreads();
    for (int idx = tid; idx < TROWS * BK; idx += blockDim.x) {
      int r = idx / BK, key = idx % BK, p = c0 + key;
      float dot = 0.0f;
      for (int d = 0; d < MLA_QROW; d++) {
        int kd = d < MLA_KROW ? d : d - MLA_KROW + MLA_PE_HI;
        dot += bf2f(s_q[r * QSTR + d]) * bf2f(s_k[key * KSTR + kd]);
      }
      s_p[idx] = (p < end && p < s_lim[r]) ? dot * a.scale_log2 : -FERRY_INF;
    }
    __syncthreads();
    if (tid < TROWS) {
      int r = tid;
      float mx = s_m[r];
      for (int k = 0; k < BK; k++) mx = fmaxf(mx, s_p[r * BK + k]);
      float off = mx == -FERRY_INF ? 0.0f : mx, sum = 0.0f;
      for (int k = 0; k < BK; k++) {
        float pv = exp2f(s_p[r * BK + k] - off);
        s_p[r * BK + k] = pv;
        sum += pv;
      }
      float al = exp2f(s_m[r] - off);
      s_al[r] = al;
      s_l[r] = s_l[r] * al + sum;
      s_m[r] = mx;
    }
    __syncthreads();
    for (int r = 0; r < TROWS; r++)
      for (int j = 0; j < SC_VPT; j++) {
        int col = tid + 128 * j;
        if (col >= MLA_DV) continue;
        float v = acc[r][j] * s_al[r];
        for (int k = 0; k < BK; k++) v += s_p[r * BK + k] * bf2f(s_k[k * KSTR + col]);
        acc[r][j] = v;
      }
  }
  __syncthreads();
  for (int r = 0; r < TROWS; r++) {
    if (s_row[r] < 0) continue;
    for (int j = 0; j < SC_VPT; j++) {
      int col = tid + 128 * j;
      if (col < MLA_DV) write_row(a, split, s_row[r], col, acc[r][j], s_m[r], s_l[r], total_rows);
    }
  }
}

#if FERRY_MMA
#define MLA_TILE_BODY(P) mla_tile_mma<P>(a)
#else
#define MLA_TILE_BODY(P) mla_tile_scalar<P>(a)
#endif
extern "C" __global__ void __launch_bounds__(128) mla_tile_bf16(MlaArgs a) {
  pdl_enter(); MLA_TILE_BODY(0); }
extern "C" __global__ void __launch_bounds__(128) mla_packed_bf16(MlaArgs a) {
  pdl_enter(); MLA_TILE_BODY(1); }

// ---------------------------------------------------------------------------------------------
// Absorbed tile kernel, warp-specialised (sm_90): the 4-warp kernel's tiling and math, with the
// loads taken off the compute warps. A producer warp (the last) fills the key ring: for each
// 32-key step it waits until the ring slot is free (an `empty` mbarrier every compute thread
// arrives on), then each lane issues one bulk copy of one latent row (page-table lookup
// included) into the padded slot, completing on the slot's `full` mbarrier; rows past the
// split's end are zero-filled by plain stores. The compute warps wait on `full`, and meet only
// at the two barriers the softmax needs (row maxima, then P), named so the producer is not
// held: the third barrier of the cp.async kernel (stage reuse) is the `empty` mbarrier.
//
// G tile groups (packed tiles only): G sets of 4 compute warps, each on its own 16-row tile of
// the same sequence (tiles blockIdx.y·G … +G−1), read one key ring. A verify step's sequence
// spans several tiles ((drafts + 1) × heads rows): one block streams its keys once instead of
// once per tile. A group past the sequence's rows only keeps the ring's count.
// Needs 32-key steps (one latent row per producer lane).
// Grid: (splits, ceil(tiles / G), B); block 32·(4G + 1); smem: MlaShape::tile_smem_groups(G).
#if FERRY_SM90 && MLA_KROW % 32 == 0 && MLA_SPLIT % 32 == 0 && MLA_BK == 32
#define FERRY_TILE_WS 1
#ifndef MLA_WS_ST
#define MLA_WS_ST 2
#endif
template <int PACKED, int G>
__device__ void mla_tile_ws(const MlaArgs& a) {
  extern __shared__ __align__(16) unsigned char smem[];
  int split = blockIdx.x, b = blockIdx.z;
  int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, g = lane / 4;
  const int PRODUCER = G * NWT;
  int gi = w < PRODUCER ? w / NWT : 0;  // this warp's tile group (the producer: none)
  TileSmem sm = tile_smem<MLA_WS_ST>(smem, gi, G);
  TileSmem sm0 = tile_smem<MLA_WS_ST>(smem, 0, G);
  u32 bars = smem_u32(sm.end);  // full[MLA_WS_ST], empty[MLA_WS_ST]
  auto full = [&](int i) { return bars + 8 * i; };
  auto empty = [&](int i) { return bars + 8 * (MLA_WS_ST + i); };

  if (tid == 0) {
    for (int i = 0; i < MLA_WS_ST; i++) {
      mbar_init(full(i), WARP);
      mbar_init(empty(i), PRODUCER * WARP);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Its barrier covers the inits.
  TileSpan sp = tile_setup<PACKED, G>(a, sm0.lim, sm0.row, sm0.q, TILE_GROUP_BYTES);
  __syncthreads();  // the staged queries
  int start = sp.start, end = sp.end;
  int nchunks = start < end ? (end - start + BK - 1) / BK : 0;

  if (w == PRODUCER) {
    // Producer: lane l moves key row l of every step.
    const bf16_t* pages = (const bf16_t*)a.pages;
    for (int it = 0; it < nchunks; it++) {
      int st = it % MLA_WS_ST, use = it / MLA_WS_ST;
      if (use > 0) mbar_wait(empty(st), (use - 1) & 1);
      int c0 = start + it * BK, p = c0 + lane;
      u32 dst = smem_u32(s_k_row(sm.k, st, lane));
      if (p < end) {
        bulk_g2s(dst, pages + key_offset_pow2(a, b, p), MLA_KROW * 2, full(st));
      } else {
        // Masked keys get probability 0, but 0 · (stale bits) could be NaN: zero the row.
        uint4* row = (uint4*)s_k_row(sm.k, st, lane);
        for (int x = 0; x < MLA_KROW / 8; x++) row[x] = make_uint4(0, 0, 0, 0);
      }
      int bytes = (min(end - c0, BK)) * MLA_KROW * 2;
      if (lane == 0) mbar_expect_tx(full(st), bytes); else mbar_arrive(full(st));
    }
    return;
  }

  // Packed rows fill tiles from row 0, so a group whose row 0 is padding has no rows at all.
  bool live = sm.row[0] >= 0;
  int lim0 = sm.lim[g], lim1 = sm.lim[g + 8];
  TileAcc acc;
  tile_acc_init(acc);
  auto sync = [gi] { named_sync(1 + gi, NWT * WARP); };  // this group's compute warps only
  for (int it = 0; it < nchunks; it++) {
    int st = it % MLA_WS_ST;
    mbar_wait(full(st), (it / MLA_WS_ST) & 1);
    if (live)
      tile_step(a, s_k_row(sm.k, st, 0), sm.q, sm.p, sm.red, start + it * BK, end, lim0, lim1,
                acc, sync);
    mbar_arrive(empty(st));  // this thread is done reading the slot
  }
  if (live) tile_finish(a, split, acc, sm.l, sm.row, sync);
}
#define WS_KERNEL(name, P, G)                                                       \
  extern "C" __global__ void __launch_bounds__(32 * (NWT * G + 1)) name(MlaArgs a) { \
    pdl_enter();                                                                     \
    mla_tile_ws<P, G>(a);                                                            \
  }
WS_KERNEL(mla_tile_ws_bf16, 0, 1)
WS_KERNEL(mla_packed_ws_bf16, 1, 1)
WS_KERNEL(mla_packed_ws2_bf16, 1, 2)
WS_KERNEL(mla_packed_ws3_bf16, 1, 3)
WS_KERNEL(mla_packed_ws4_bf16, 1, 4)
#endif

// ---------------------------------------------------------------------------------------------
// Absorbed tile kernel, 8-warp variant: the same 16-row tile and 32-key steps, but the score
// product is split over the latent width instead of only over keys. Warp w scores keys
// (w % 4)·8 … +7 over half (w / 4) of the 576 dims with that half of Q held in registers for
// the whole block (no per-step Q reloads), the two halves' partial scores meet in shared memory,
// every warp then runs the (identical) online softmax for all 32 keys and keeps P in registers
// as the A operand of P·V over its own 64 output columns. Two barriers per step instead of
// three, half the ldmatrix traffic of the 4-warp kernel, a T8_STAGES-deep cp.async pipeline.
// Needs MLA_KROW % 64 == 0, MLA_SPLIT % 32 == 0 and MLA_DV % 128 == 0 (the split tail runs on
// the second half's warps). Grid: (splits, tiles, B); block 256.
#if FERRY_MMA
#ifndef T8_STAGES
#define T8_STAGES 4
#endif
#define T8K 32
#define SPS (T8K + 4)  // floats per row of the partial-score exchange
template <int PACKED>
__device__ void mla_tile8_mma(const MlaArgs& a) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16_t* s_k = (bf16_t*)smem;                       // [T8_STAGES][T8K][KSTR]
  bf16_t* s_q = s_k + T8_STAGES * T8K * KSTR;        // [16][QSTR]
  float* s_sp = (float*)(s_q + TROWS * QSTR);        // [2 (parity)][2 (half)][16][SPS]
  int* s_lim = (int*)(s_sp + 2 * 2 * TROWS * SPS);   // [16]
  long long* s_row = (long long*)(s_lim + TROWS);    // [16]

  int split = blockIdx.x, b = blockIdx.z;
  int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, g = lane / 4, c = lane % 4;
  int kg = w % 4, dh = w / 4;
  int total_rows = gridDim.z * a.sq * a.heads;
  TileSpan sp = tile_setup<PACKED>(a, s_lim, s_row, s_q);
  int start = sp.start, end = sp.end, lim0 = s_lim[g], lim1 = s_lim[g + 8];

  const bf16_t* pages = (const bf16_t*)a.pages;
  auto load_chunk = [&](int buf, int c0) {
    tile_load_keys<T8K, 256>(a, s_k + buf * T8K * KSTR, b, c0, end, tid);
  };

  int nchunks = start < end ? (end - start + T8K - 1) / T8K : 0;
#pragma unroll
  for (int st = 0; st < T8_STAGES - 1; st++) {
    if (st < nchunks) load_chunk(st, start + st * T8K);
    cp_async_commit();
  }
#if MLA_L2PF > 0
  for (int st = T8_STAGES - 1; st < T8_STAGES - 1 + MLA_L2PF && st < nchunks; st++)
    l2_prefetch_keys(a, pages, b, start + st * T8K, T8K, end, tid, 256);
#endif
  __syncthreads();  // s_q written
  // 32-dim pairs of k-steps per half of the cache row, and of the split tail (second half's
  // warps).
  const int HALF = MLA_KROW / 2, QK2 = HALF / 32, TK2 = MLA_SPLIT / 32;
  u32 qf[2 * QK2][4];
  u32 qt[TK2 > 0 ? 2 * TK2 : 1][4];
  {
    u32 qa = smem_u32(s_q + (lane % 16) * QSTR + (lane / 16) * 8 + dh * HALF);
#pragma unroll
    for (int kk = 0; kk < 2 * QK2; kk++) ldsm_x4(qf[kk], qa + kk * 32);
    u32 qta = smem_u32(s_q + (lane % 16) * QSTR + (lane / 16) * 8 + MLA_KROW);
    if (dh == 1)
#pragma unroll
      for (int kk = 0; kk < 2 * TK2; kk++) ldsm_x4(qt[kk], qta + kk * 32);
  }
  const int NT = MLA_DV / (8 * 8);  // 8-column output tiles per warp
  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = -FERRY_INF, m1 = -FERRY_INF, l0 = 0.0f, l1 = 0.0f;

  for (int it = 0; it < nchunks; it++) {
    int c0 = start + it * T8K;
    cp_async_wait<T8_STAGES - 2>();
    __syncthreads();  // chunk `it` landed for everyone; everyone is done with step it - 1
    int nxt = it + T8_STAGES - 1;
    if (nxt < nchunks) load_chunk(nxt % T8_STAGES, start + nxt * T8K);
    cp_async_commit();
#if MLA_L2PF > 0
    if (nxt + MLA_L2PF < nchunks)
      l2_prefetch_keys(a, pages, b, start + (nxt + MLA_L2PF) * T8K, T8K, end, tid, 256);
#endif
    const bf16_t* kb = s_k + (it % T8_STAGES) * T8K * KSTR;

    // Partial scores: this warp's 8 keys over its half of the dims.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    u32 ka = smem_u32(kb + (kg * 8 + (lane % 8)) * KSTR + dh * HALF + 8 * (lane / 8));
#pragma unroll
    for (int k2 = 0; k2 < QK2; k2++) {
      u32 bf[4];
      ldsm_x4(bf, ka + k2 * 64);
      mma_bf16(s[0], qf[2 * k2], bf[0], bf[1]);
      mma_bf16(s[1], qf[2 * k2 + 1], bf[2], bf[3]);
    }
    if (dh == 1) {  // the split tail: q_pe lo against k_pe hi
      u32 kt = smem_u32(kb + (kg * 8 + (lane % 8)) * KSTR + MLA_PE_HI + 8 * (lane / 8));
#pragma unroll
      for (int t = 0; t < TK2; t++) {
        u32 bf[4];
        ldsm_x4(bf, kt + t * 64);
        mma_bf16(s[0], qt[2 * t], bf[0], bf[1]);
        mma_bf16(s[1], qt[2 * t + 1], bf[2], bf[3]);
      }
    }
    float* sp = s_sp + ((it & 1) * 2 + dh) * TROWS * SPS;
    *reinterpret_cast<float2*>(sp + g * SPS + kg * 8 + 2 * c) =
        make_float2(s[0][0] + s[1][0], s[0][1] + s[1][1]);
    *reinterpret_cast<float2*>(sp + (g + 8) * SPS + kg * 8 + 2 * c) =
        make_float2(s[0][2] + s[1][2], s[0][3] + s[1][3]);
    __syncthreads();

    // Full scores for all 32 keys in the accumulator layout; online softmax (every warp).
    const float* sp0 = s_sp + ((it & 1) * 2) * TROWS * SPS;
    const float* sp1 = sp0 + TROWS * SPS;
    float sc[4][4];
    float mx0 = -FERRY_INF, mx1 = -FERRY_INF;
#pragma unroll
    for (int n = 0; n < 4; n++) {
      int col = n * 8 + 2 * c;
      float2 a0 = *reinterpret_cast<const float2*>(sp0 + g * SPS + col);
      float2 b0 = *reinterpret_cast<const float2*>(sp1 + g * SPS + col);
      float2 a1 = *reinterpret_cast<const float2*>(sp0 + (g + 8) * SPS + col);
      float2 b1 = *reinterpret_cast<const float2*>(sp1 + (g + 8) * SPS + col);
      float v[4] = {a0.x + b0.x, a0.y + b0.y, a1.x + b1.x, a1.y + b1.y};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        int key = c0 + col + (j & 1);
        int lim = j < 2 ? lim0 : lim1;
        float x = (key < lim && key < end) ? v[j] * a.scale_log2 : -FERRY_INF;
        sc[n][j] = x;
        if (j < 2) mx0 = fmaxf(mx0, x); else mx1 = fmaxf(mx1, x);
      }
    }
    mx0 = fmaxf(mx0, SHFL_XOR(mx0, 1));
    mx0 = fmaxf(mx0, SHFL_XOR(mx0, 2));
    mx1 = fmaxf(mx1, SHFL_XOR(mx1, 1));
    mx1 = fmaxf(mx1, SHFL_XOR(mx1, 2));
    float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    float off0 = n0 == -FERRY_INF ? 0.0f : n0, off1 = n1 == -FERRY_INF ? 0.0f : n1;
    float al0 = fast_exp2(m0 - off0), al1 = fast_exp2(m1 - off1);
    m0 = n0;
    m1 = n1;
    float ps0 = 0.0f, ps1 = 0.0f;
    u32 pf[2][4];
#pragma unroll
    for (int n = 0; n < 4; n++) {
      float p0 = fast_exp2(sc[n][0] - off0), p1 = fast_exp2(sc[n][1] - off0);
      float p2 = fast_exp2(sc[n][2] - off1), p3 = fast_exp2(sc[n][3] - off1);
      ps0 += p0 + p1;
      ps1 += p2 + p3;
      pf[n / 2][(n & 1) * 2] = pack_bf2(p0, p1);
      pf[n / 2][(n & 1) * 2 + 1] = pack_bf2(p2, p3);
    }
    l0 = l0 * al0 + ps0;
    l1 = l1 * al1 + ps1;
#pragma unroll
    for (int n = 0; n < NT; n++) {
      o[n][0] *= al0; o[n][1] *= al0; o[n][2] *= al1; o[n][3] *= al1;
    }
    // O[:, this warp's 64 columns] += P · V.
    u32 va = smem_u32(kb + ((lane % 8) + 8 * ((lane / 8) % 2)) * KSTR + w * (MLA_DV / 8) +
                      8 * (lane / 16));
#pragma unroll
    for (int kk = 0; kk < T8K / 16; kk++) {
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {
        u32 bf[4];
        ldsm_x4_t(bf, va + (kk * 16 * KSTR + np * 16) * 2);
        mma_bf16(o[2 * np], pf[kk], bf[0], bf[1]);
        mma_bf16(o[2 * np + 1], pf[kk], bf[2], bf[3]);
      }
    }
  }
  cp_async_wait0();

  // Every warp holds the same row statistics; sum the lanes' partial row sums.
  l0 += SHFL_XOR(l0, 1);
  l0 += SHFL_XOR(l0, 2);
  l1 += SHFL_XOR(l1, 1);
  l1 += SHFL_XOR(l1, 2);
  long long r0 = s_row[g], r1 = s_row[g + 8];
#pragma unroll
  for (int n = 0; n < NT; n++) {
    int col = w * (MLA_DV / 8) + n * 8 + 2 * c;
    if (r0 >= 0) {
      write_row(a, split, r0, col, o[n][0], m0, l0, total_rows);
      write_row(a, split, r0, col + 1, o[n][1], m0, l0, total_rows);
    }
    if (r1 >= 0) {
      write_row(a, split, r1, col, o[n][2], m1, l1, total_rows);
      write_row(a, split, r1, col + 1, o[n][3], m1, l1, total_rows);
    }
  }
}
extern "C" __global__ void __launch_bounds__(256, 1) mla_tile8_bf16(MlaArgs a) {
  pdl_enter();
  mla_tile8_mma<0>(a);
}
extern "C" __global__ void __launch_bounds__(256, 1) mla_packed8_bf16(MlaArgs a) {
  pdl_enter();
  mla_tile8_mma<1>(a);
}
#endif

// ---------------------------------------------------------------------------------------------
// MHA form. Sequence b's queries are rows cu_q[b]..cu_q[b+1] of q, its keys rows
// cu_k[b]..cu_k[b+1] of k/v; query i sits at position (k_len - q_len) + i and sees keys up to
// and including it.
struct MhaArgs {
  const void* q;    // [Tq][H][MHA_DQK]
  const void* k;    // [Tk][H][MHA_DQK]
  const void* v;    // [Tk][H][MHA_DV]
  const int* cu_q;  // [B+1]
  const int* cu_k;  // [B+1]
  const int* q_seq; // [Tq]: sequence of each query row (mha_f32 only)
  float* out;       // [Tq][H][MHA_DV]
  int heads;
  float scale_log2;
};

// f32, one block per (query row, head); 4 warps stride over keys. Grid: Tq·H; block 128.
#define M_QPL ((MHA_DQK + WARP - 1) / WARP)
#define M_VPL ((MHA_DV + WARP - 1) / WARP)
extern "C" __global__ void mha_f32(MhaArgs a) {
  pdl_enter();
  __shared__ float s_m[4], s_l[4];
  __shared__ float s_o[4][MHA_DV];
  int H = a.heads, qrow = blockIdx.x / H, h = blockIdx.x % H;
  int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
  int b = a.q_seq[qrow];
  int q0 = a.cu_q[b], k0 = a.cu_k[b];
  int q_len = a.cu_q[b + 1] - q0, k_len = a.cu_k[b + 1] - k0;
  int lim = k_len - q_len + (qrow - q0) + 1;
  const float* q = (const float*)a.q + ((size_t)qrow * H + h) * MHA_DQK;
  const float* K = (const float*)a.k;
  const float* V = (const float*)a.v;
  float qv[M_QPL];
#pragma unroll
  for (int j = 0; j < M_QPL; j++) {
    int d = lane + j * WARP;
    qv[j] = d < MHA_DQK ? q[d] : 0.0f;
  }
  float m = -FERRY_INF, l = 0.0f, acc[M_VPL];
#pragma unroll
  for (int j = 0; j < M_VPL; j++) acc[j] = 0.0f;
  for (int p = w; p < lim; p += 4) {
    const float* kr = K + ((size_t)(k0 + p) * H + h) * MHA_DQK;
    const float* vr = V + ((size_t)(k0 + p) * H + h) * MHA_DV;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < M_QPL; j++) {
      int d = lane + j * WARP;
      if (d < MHA_DQK) dot += qv[j] * kr[d];
    }
    float s = warp_sum(dot) * a.scale_log2;
    float mn = fmaxf(m, s), alpha = exp2f(m - mn), pw = exp2f(s - mn);
    l = l * alpha + pw;
#pragma unroll
    for (int j = 0; j < M_VPL; j++) {
      int d = lane + j * WARP;
      acc[j] = acc[j] * alpha + pw * (d < MHA_DV ? vr[d] : 0.0f);
    }
    m = mn;
  }
  if (lane == 0) { s_m[w] = m; s_l[w] = l; }
#pragma unroll
  for (int j = 0; j < M_VPL; j++) {
    int d = lane + j * WARP;
    if (d < MHA_DV) s_o[w][d] = acc[j];
  }
  __syncthreads();
  float M = fmaxf(fmaxf(s_m[0], s_m[1]), fmaxf(s_m[2], s_m[3]));
  float sc[4], L = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    sc[k] = s_m[k] == -FERRY_INF ? 0.0f : exp2f(s_m[k] - M);
    L += s_l[k] * sc[k];
  }
  float* o = a.out + ((size_t)qrow * H + h) * MHA_DV;
  for (int d = threadIdx.x; d < MHA_DV; d += blockDim.x)
    o[d] = (s_o[0][d] * sc[0] + s_o[1][d] * sc[1] + s_o[2][d] * sc[2] + s_o[3][d] * sc[3]) / L;
}

#if FERRY_MMA
// FlashAttention-2-style causal attention on tensor cores: 64 query rows per block (16 per
// warp), 64-key blocks double-buffered through cp.async, Q fragments in registers, online
// softmax in registers, P reused as the A operand of P·V without leaving registers.
// Grid: (ceil(max_q_len/64), H, B); block 128; dynamic shared memory: flash_smem() on the host.
#define FQ 64
#define FK 64
#define FKS (MHA_QKB + 8)
#define FVS (MHA_DV + 8)
extern "C" __global__ void __launch_bounds__(128) mha_flash_bf16(MhaArgs a) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem[];
  bf16_t* s_q = (bf16_t*)smem;             // [FQ][FKS]
  bf16_t* s_k = s_q + FQ * FKS;            // [2][FK][FKS]
  bf16_t* s_v = s_k + 2 * FK * FKS;        // [2][FK][FVS]
  int H = a.heads, h = blockIdx.y, b = blockIdx.z;
  int qb = gridDim.x - 1 - blockIdx.x;     // longest blocks first
  int q0 = a.cu_q[b], k0 = a.cu_k[b];
  int q_len = a.cu_q[b + 1] - q0, k_len = a.cu_k[b + 1] - k0;
  if (qb * FQ >= q_len) return;
  int offset = k_len - q_len;
  int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP, g = lane / 4, c = lane % 4;
  const bf16_t* Q = (const bf16_t*)a.q;
  const bf16_t* K = (const bf16_t*)a.k;
  const bf16_t* V = (const bf16_t*)a.v;
  const int QSEG = MHA_QKB / 8, VSEG = MHA_DV / 8;

  for (int idx = tid; idx < FQ * QSEG; idx += blockDim.x) {
    int r = idx / QSEG, seg = idx % QSEG, qi = qb * FQ + r;
    const bf16_t* src = Q;
    int bytes = 0;
    if (qi < q_len) { src = Q + ((size_t)(q0 + qi) * H + h) * MHA_QKB + seg * 8; bytes = 16; }
    cp_async16(smem_u32(s_q + r * FKS + seg * 8), src, bytes);
  }
  int kv_end = min(k_len, offset + qb * FQ + FQ);  // keys any row of this block can see
  int n_kb = (kv_end + FK - 1) / FK;
  auto load_kv = [&](int buf, int kb) {
    bf16_t* dk = s_k + buf * FK * FKS;
    bf16_t* dv = s_v + buf * FK * FVS;
    const int SEGS = FK * (QSEG + VSEG), PER = (SEGS + 127) / 128;
#pragma unroll
    for (int i = 0; i < PER; i++) {
      int idx = tid + i * 128;
      if (idx >= SEGS) break;
      int r = idx / (QSEG + VSEG), seg = idx % (QSEG + VSEG), key = kb * FK + r;
      bool ok = key < k_len;
      if (seg < QSEG) {
        const bf16_t* src = ok ? K + ((size_t)(k0 + key) * H + h) * MHA_QKB + seg * 8 : K;
        cp_async16(smem_u32(dk + r * FKS + seg * 8), src, ok ? 16 : 0);
      } else {
        int sv = seg - QSEG;
        const bf16_t* src = ok ? V + ((size_t)(k0 + key) * H + h) * MHA_DV + sv * 8 : V;
        cp_async16(smem_u32(dv + r * FVS + sv * 8), src, ok ? 16 : 0);
      }
    }
  };
  if (n_kb > 0) load_kv(0, 0);
  cp_async_commit();

  const int KS = MHA_QKB / 16, NV = MHA_DV / 8;
  u32 qf[KS][4];
  float o[NV][4];
#pragma unroll
  for (int n = 0; n < NV; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  RowState row = {-FERRY_INF, -FERRY_INF, 0.0f, 0.0f};
  int row0 = qb * FQ + w * 16 + g, row1 = row0 + 8;  // query index within the sequence
  int lim0 = offset + row0 + 1, lim1 = offset + row1 + 1;

  for (int kb = 0; kb < n_kb; kb++) {
    if (kb + 1 < n_kb) load_kv((kb + 1) & 1, kb + 1);
    cp_async_commit();
    cp_async_wait1();
    __syncthreads();
    if (kb == 0) {
      u32 qa = smem_u32(s_q + (w * 16 + lane % 16) * FKS + (lane / 16) * 8);
#pragma unroll
      for (int kk = 0; kk < KS; kk++) ldsm_x4(qf[kk], qa + kk * 32);
    }
    const bf16_t* kbuf = s_k + (kb & 1) * FK * FKS;
    const bf16_t* vbuf = s_v + (kb & 1) * FK * FVS;
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    u32 ka = smem_u32(kbuf + ((lane % 8) + 8 * (lane / 16)) * FKS + 8 * ((lane / 8) % 2));
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
#pragma unroll
      for (int np = 0; np < 4; np++) {
        u32 bf[4];
        ldsm_x4(bf, ka + (np * 16 * FKS + kk * 16) * 2);
        mma_bf16(s[2 * np], qf[kk], bf[0], bf[1]);
        mma_bf16(s[2 * np + 1], qf[kk], bf[2], bf[3]);
      }
    }
    bool need_mask = (kb + 1) * FK > offset + qb * FQ + 1 || (kb + 1) * FK > k_len;
    float al0, al1;
    acc_row_softmax<FK>(&s[0][0], row, al0, al1, kb * FK, lim0, lim1, k_len, need_mask,
                        a.scale_log2, c);
    u32 pf[FK / 16][4];
    acc_pack_p<FK>(&s[0][0], pf);
    acc_rescale<4 * NV>(&o[0][0], al0, al1);
    u32 va = smem_u32(vbuf + ((lane % 8) + 8 * ((lane / 8) % 2)) * FVS + 8 * (lane / 16));
#pragma unroll
    for (int kk = 0; kk < FK / 16; kk++) {
#pragma unroll
      for (int np = 0; np < NV / 2; np++) {
        u32 bf[4];
        ldsm_x4_t(bf, va + (kk * 16 * FVS + np * 16) * 2);
        mma_bf16(o[2 * np], pf[kk], bf[0], bf[1]);
        mma_bf16(o[2 * np + 1], pf[kk], bf[2], bf[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait0();
  float l0 = row.l0, l1 = row.l1;
  l0 += SHFL_XOR(l0, 1);
  l0 += SHFL_XOR(l0, 2);
  l1 += SHFL_XOR(l1, 1);
  l1 += SHFL_XOR(l1, 2);
#pragma unroll
  for (int n = 0; n < NV; n++) {
    int col = n * 8 + 2 * c;
    if (row0 < q_len) {
      float* dst = a.out + ((size_t)(q0 + row0) * H + h) * MHA_DV + col;
      dst[0] = o[n][0] / l0;
      dst[1] = o[n][1] / l0;
    }
    if (row1 < q_len) {
      float* dst = a.out + ((size_t)(q0 + row1) * H + h) * MHA_DV + col;
      dst[0] = o[n][2] / l1;
      dst[1] = o[n][3] / l1;
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Hopper (sm_90a) MHA-form causal prefill on warpgroup MMA (wgmma), the tensor-core path of
// Hopper; NVRTC compiles it when the target is sm_90a (see nvrtc.rs).
//
// One block = MHA_WGS warpgroups × 64 query rows of one (sequence, head), MHA_WGK-key steps
// through an MHA_WGST-deep cp.async pipeline shared by the warpgroups. Per step and warpgroup:
// S(64×WGK) = Q·Kᵀ as DQK/16 wgmma (Q as register fragments loaded once when MHA_WG_QREG, else
// from shared memory; K in shared memory, K-major), online softmax on the accumulator
// registers, then O(64×DV) += P·V with P from registers (the accumulator layout is the
// A-fragment layout) and V in shared memory (MN-major) in 64-column chunks. With
// MHA_WG_OVERLAP the next step's Q·Kᵀ is issued before this step's softmax, so the tensor
// cores work while the CUDA cores exponentiate. K and V tiles use wgmma's 128-byte-swizzle
// layout (MHA_WG_SWZ, the default where qk % 64 == 0: see wg_load_tile_sw128), else the
// no-swizzle canonical layout — 8 rows × 16 bytes per core matrix, stored [16-byte
// chunk][row][8] — whose wgmma reads conflict on banks (11 % slower on the H200).
// Grid: (ceil(max_q_len / (64·MHA_WGS)), H, B); block 128·MHA_WGS; smem: WgmmaConfig::smem().
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && MHA_QKB % 32 == 0 && MHA_DV % 64 == 0
#define FERRY_WGMMA 1
#ifndef MHA_WGS
#define MHA_WGS 2
#endif
#ifndef MHA_WGK
#define MHA_WGK 128
#endif
#ifndef MHA_WG_QREG
#define MHA_WG_QREG 1
#endif
#ifndef MHA_WG_OVERLAP
#define MHA_WG_OVERLAP 0
#endif
#define WGQ (64 * MHA_WGS)
#define WGK MHA_WGK
#ifndef MHA_WG_SWZ
#define MHA_WG_SWZ (MHA_QKB % 64 == 0)
#endif
#if MHA_WG_SWZ && (!MHA_WG_QREG || MHA_QKB % 64 != 0)
#error "the swizzled K/V layout needs Q in registers and qk a multiple of 64"
#endif
#ifndef MHA_WGST
#define MHA_WGST (MHA_WG_OVERLAP ? 4 : 2)
#endif
#define WGST MHA_WGST  // K/V stages: the overlap loop needs 3 or more, the plain loop 2 or more
#if WGK == 64
#define WG_SS wg_ss64
#define WG_RS wg_rs64
#else
#define WG_SS wg_ss128
#define WG_RS wg_rs128
#endif
#define QCH (MHA_QKB / 8)
#define VCH (MHA_DV / 8)

// Shared-memory matrix descriptor, no swizzle: start, leading (K-direction) and stride
// (M/N-direction) byte offsets between core matrices, each in 16-byte units.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
         ((u64)((sbo >> 4) & 0x3FFF) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// Pins accumulator registers after a wait: later reads cannot be scheduled above it.
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// Makes this thread's completed shared-memory writes visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// d(64xN) (+)= a(64x16) · b(16xN), f32 accumulate; acc = 0 overwrites d. `ss`: both operands
// in shared memory, K-major; `rs`: a in registers (the mma.sync A-fragment layout per warp),
// b in shared memory, TB = 1 for MN-major b.
__device__ __forceinline__ void wg_ss64(float* d, u64 da, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_ss128(float* d, u64 da, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_ss96(float* d, u64 da, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "l"(da), "l"(db), "r"(acc));
}
template <int TB>
__device__ __forceinline__ void wg_rs64(float* d, const u32* a, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs128(float* d, const u32* a, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

// The 128-byte-swizzle layout (MHA_WG_SWZ) of a K or V tile: rows of ROWS keys, the width cut
// into 64-element (128-byte) atoms stored [atom][row][128 B], and within each 1024-byte group of
// 8 rows the 16-byte chunk c of row r stored at chunk c ^ (r % 8) — the address-bit swizzle
// wgmma applies in its SW128 mode, so the banks of a chunk column differ across rows.
__device__ __forceinline__ u64 wg_desc_sw128(u32 addr, u32 lbo, u32 sbo) {
  return wg_desc(addr, lbo, sbo) | (1ull << 62);
}
template <int ROWS, int CH>
__device__ __forceinline__ void wg_load_tile_sw128(bf16_t* dst, const bf16_t* src,
                                                   size_t row_stride, int valid,
                                                   const bf16_t* dummy, int warp, int nwarps,
                                                   int lane) {
  const int ITEMS = (ROWS / 8) * (CH / 4);
  for (int it = warp; it < ITEMS; it += nwarps) {
    int r = (it % (ROWS / 8)) * 8 + (lane & 7);
    int ch = (it / (ROWS / 8)) * 4 + (lane >> 3);
    bool ok = r < valid;
    const bf16_t* s = ok ? src + (size_t)r * row_stride + ch * 8 : dummy;
    size_t off = (size_t)(ch / 8) * ROWS * 64 + (size_t)r * 64 + (((ch % 8) ^ (r & 7)) * 8);
    cp_async16(smem_u32(dst + off), s, ok ? 16 : 0);
  }
}

// Copies rows [0, valid) of a tile of ROWS rows × CH 16-byte chunks into [CH][ROWS][8];
// rows past `valid` are zero-filled. A warp moves 8 rows × 4 chunks per item: each source row
// contributes 64 contiguous bytes, each destination run is 128 contiguous bytes.
template <int ROWS, int CH>
__device__ __forceinline__ void wg_load_tile(bf16_t* dst, const bf16_t* src, size_t row_stride,
                                             int valid, const bf16_t* dummy, int warp,
                                             int nwarps, int lane) {
  const int ITEMS = (ROWS / 8) * (CH / 4);
  for (int it = warp; it < ITEMS; it += nwarps) {
    int r = (it % (ROWS / 8)) * 8 + (lane & 7);
    int ch = (it / (ROWS / 8)) * 4 + (lane >> 3);
    bool ok = r < valid;
    const bf16_t* s = ok ? src + (size_t)r * row_stride + ch * 8 : dummy;
    cp_async16(smem_u32(dst + ((size_t)ch * ROWS + r) * 8), s, ok ? 16 : 0);
  }
}

// One step's scores for this warpgroup: S(64×WGK) = Q·K_stageᵀ (Q from registers or shared).
struct WgQ {
#if MHA_WG_QREG
  u32 f[MHA_QKB / 16][4];
#else
  u32 addr;
#endif
};
__device__ __forceinline__ void wg_scores(float* s, const WgQ& q, u32 k_addr) {
#pragma unroll
  for (int kk = 0; kk < MHA_QKB / 16; kk++) {
#if MHA_WG_SWZ
    u64 kd = wg_desc_sw128(k_addr + (kk / 4) * WGK * 128 + (kk % 4) * 32, 16, 1024);
#else
    u64 kd = wg_desc(k_addr + kk * 2 * WGK * 16, WGK * 16, 128);
#endif
#if MHA_WG_QREG
    WG_RS<0>(s, q.f[kk], kd, kk > 0);
#else
    WG_SS(s, wg_desc(q.addr + kk * 2 * WGQ * 16, WGQ * 16, 128), kd, kk > 0);
#endif
  }
}

// The whole step for the cp.async kernel: softmax, P fragments, O rescaled.
__device__ __forceinline__ void wg_softmax(float* s, u32 (*pf)[4], float (*o)[32], RowState& r,
                                           int key0, int lim0, int lim1, int k_len,
                                           bool need_mask, float scale_log2, int c) {
  float al0, al1;
  acc_row_softmax<WGK>(s, r, al0, al1, key0, lim0, lim1, k_len, need_mask, scale_log2, c);
  acc_pack_p<WGK>(s, pf);
#pragma unroll
  for (int n = 0; n < MHA_DV / 64; n++) acc_rescale<32>(o[n], al0, al1);
}

// O(64×DV) += P·V_stage, V MN-major in 64-column chunks.
__device__ __forceinline__ void wg_pv(float (*o)[32], u32 (*pf)[4], u32 v_addr) {
#pragma unroll
  for (int n = 0; n < MHA_DV / 64; n++)
#pragma unroll
    for (int kk = 0; kk < WGK / 16; kk++)
#if MHA_WG_SWZ
      wg_rs64<1>(o[n], pf[kk], wg_desc_sw128(v_addr + n * WGK * 128 + kk * 2048, WGK * 128, 1024),
                 1);
#else
      wg_rs64<1>(o[n], pf[kk], wg_desc(v_addr + n * 8 * WGK * 16 + kk * 2 * 128, 128, WGK * 16),
                 1);
#endif
}

extern "C" __global__ void __launch_bounds__(128 * MHA_WGS, 3 - MHA_WGS) mha_wgmma_bf16(MhaArgs a) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem[];
  // Swizzled tiles need 1024-byte-aligned atoms: the host allots 1 KB of slack for this.
  unsigned char* base = smem + ((1024 - (smem_u32(smem) & 1023)) & 1023) * MHA_WG_SWZ;
  bf16_t* s_q = (bf16_t*)base;               // [QCH][WGQ][8]
  bf16_t* s_k = s_q + QCH * WGQ * 8;         // [WGST][QCH][WGK][8]
  bf16_t* s_v = s_k + WGST * QCH * WGK * 8;  // [WGST][VCH][WGK][8]
  int H = a.heads, h = blockIdx.y, b = blockIdx.z;
  int qb = gridDim.x - 1 - blockIdx.x;       // longest blocks first
  int q0 = a.cu_q[b], k0 = a.cu_k[b];
  int q_len = a.cu_q[b + 1] - q0, k_len = a.cu_k[b + 1] - k0;
  if (qb * WGQ >= q_len) return;
  int offset = k_len - q_len;
  int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, nwarps = blockDim.x / WARP;
  int wg = warp / 4, wl = warp % 4, g = lane / 4, c = lane % 4;
  const bf16_t* Q = (const bf16_t*)a.q;
  const bf16_t* K = (const bf16_t*)a.k;
  const bf16_t* V = (const bf16_t*)a.v;

  wg_load_tile<WGQ, QCH>(s_q, Q + ((size_t)(q0 + qb * WGQ) * H + h) * MHA_QKB,
                         (size_t)H * MHA_QKB, q_len - qb * WGQ, Q, warp, nwarps, lane);
  int kv_end = min(k_len, offset + qb * WGQ + WGQ);  // keys any row of this block can see
  int n_kb = (kv_end + WGK - 1) / WGK;
  auto load_kv = [&](int kb) {
    int buf = kb % WGST, valid = k_len - kb * WGK;
    size_t first = (size_t)(k0 + kb * WGK) * H + h;
#if MHA_WG_SWZ
    wg_load_tile_sw128<WGK, QCH>(s_k + buf * QCH * WGK * 8, K + first * MHA_QKB,
                                 (size_t)H * MHA_QKB, valid, K, warp, nwarps, lane);
    wg_load_tile_sw128<WGK, VCH>(s_v + buf * VCH * WGK * 8, V + first * MHA_DV,
                                 (size_t)H * MHA_DV, valid, V, warp, nwarps, lane);
#else
    wg_load_tile<WGK, QCH>(s_k + buf * QCH * WGK * 8, K + first * MHA_QKB, (size_t)H * MHA_QKB,
                           valid, K, warp, nwarps, lane);
    wg_load_tile<WGK, VCH>(s_v + buf * VCH * WGK * 8, V + first * MHA_DV, (size_t)H * MHA_DV,
                           valid, V, warp, nwarps, lane);
#endif
  };
  auto k_addr = [&](int kb) { return smem_u32(s_k + (kb % WGST) * QCH * WGK * 8); };
  auto v_addr = [&](int kb) { return smem_u32(s_v + (kb % WGST) * VCH * WGK * 8); };
  // Stages 0 … WGST - 2 in flight before the loop (Q travels with stage 0's group).
#pragma unroll
  for (int st = 0; st < WGST - 1; st++) {
    if (st < n_kb) load_kv(st);
    cp_async_commit();
  }

  float o[MHA_DV / 64][32];
#pragma unroll
  for (int n = 0; n < MHA_DV / 64; n++)
#pragma unroll
    for (int j = 0; j < 32; j++) o[n][j] = 0.0f;
  RowState row = {-FERRY_INF, -FERRY_INF, 0.0f, 0.0f};
  int wg_first = qb * WGQ + wg * 64;             // this warpgroup's first query row
  int row0 = wg_first + wl * 16 + g, row1 = row0 + 8;
  int lim0 = offset + row0 + 1, lim1 = offset + row1 + 1;
  // Whether key step kb holds any key a row of this warpgroup sees (uniform per warpgroup).
  auto visible = [&](int kb) { return kb * WGK < offset + wg_first + 64 && wg_first < q_len; };
  auto masked = [&](int kb) {
    return (kb + 1) * WGK > offset + wg_first + 1 || (kb + 1) * WGK > k_len;
  };
  WgQ q;
#if !MHA_WG_QREG
  q.addr = smem_u32(s_q) + wg * 64 * 16;
#endif
  u32 pf[WGK / 16][4];

#if !MHA_WG_OVERLAP
  for (int kb = 0; kb < n_kb; kb++) {
    if (kb + WGST - 1 < n_kb) load_kv(kb + WGST - 1);  // into the stage step kb - 1 used
    cp_async_commit();
    cp_async_wait<WGST - 1>();
    fence_async_smem();
    __syncthreads();
#if MHA_WG_QREG
    if (kb == 0) {
      // Q's A fragments: rows wl·16 … +15 of this warpgroup, 16 dims per k-step.
      int r = wg * 64 + wl * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
      for (int kk = 0; kk < MHA_QKB / 16; kk++)
        ldsm_x4(q.f[kk], smem_u32(s_q + ((size_t)(2 * kk + lane / 16) * WGQ + r) * 8));
    }
#endif
    if (visible(kb)) {
      float s[WGK / 2];
      wg_fence();
      wg_scores(s, q, k_addr(kb));
      wg_commit();
      wg_wait0();
      wg_fence_regs<WGK / 2>(s);
      wg_softmax(s, pf, o, row, kb * WGK, lim0, lim1, k_len, masked(kb), a.scale_log2, c);
      wg_fence();
      wg_pv(o, pf, v_addr(kb));
      wg_commit();
      wg_wait0();
#pragma unroll
      for (int n = 0; n < MHA_DV / 64; n++) wg_fence_regs<32>(o[n]);
    }
    __syncthreads();
  }
#else
  // Three stages: while this step's softmax runs on the CUDA cores, the next step's Q·Kᵀ is
  // already on the tensor cores.
  cp_async_wait<WGST - 2>();
  fence_async_smem();
  __syncthreads();
#if MHA_WG_QREG
  {
    int r = wg * 64 + wl * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
    for (int kk = 0; kk < MHA_QKB / 16; kk++)
      ldsm_x4(q.f[kk], smem_u32(s_q + ((size_t)(2 * kk + lane / 16) * WGQ + r) * 8));
  }
#endif
  float s_cur[WGK / 2], s_nxt[WGK / 2];
  if (n_kb > 0 && visible(0)) {
    wg_fence();
    wg_scores(s_cur, q, k_addr(0));
    wg_commit();
    wg_wait0();
    wg_fence_regs<WGK / 2>(s_cur);
  }
  for (int kb = 0; kb < n_kb; kb++) {
    cp_async_wait<WGST - 3>();
    fence_async_smem();
    __syncthreads();  // step kb + 1 landed; every warpgroup is done with step kb - 1
    if (kb + WGST - 1 < n_kb) load_kv(kb + WGST - 1);  // into the stage step kb - 1 used
    cp_async_commit();
    if (visible(kb)) {
      bool next = kb + 1 < n_kb && visible(kb + 1);
      if (next) {
        wg_fence();
        wg_scores(s_nxt, q, k_addr(kb + 1));
        wg_commit();
      }
      wg_softmax(s_cur, pf, o, row, kb * WGK, lim0, lim1, k_len, masked(kb), a.scale_log2, c);
      wg_fence();
      wg_pv(o, pf, v_addr(kb));
      wg_commit();
      wg_wait0();
      wg_fence_regs<WGK / 2>(s_nxt);
#pragma unroll
      for (int n = 0; n < MHA_DV / 64; n++) wg_fence_regs<32>(o[n]);
#pragma unroll
      for (int j = 0; j < WGK / 2; j++) s_cur[j] = s_nxt[j];
    }
  }
#endif
  cp_async_wait0();
  float l0 = row.l0, l1 = row.l1;
  l0 += SHFL_XOR(l0, 1);
  l0 += SHFL_XOR(l0, 2);
  l1 += SHFL_XOR(l1, 1);
  l1 += SHFL_XOR(l1, 2);
#pragma unroll
  for (int n = 0; n < MHA_DV / 64; n++)
#pragma unroll
    for (int t = 0; t < 8; t++) {
      int col = n * 64 + t * 8 + 2 * c;
      if (row0 < q_len) {
        float* dst = a.out + ((size_t)(q0 + row0) * H + h) * MHA_DV + col;
        *(float2*)dst = make_float2(o[n][4 * t] / l0, o[n][4 * t + 1] / l0);
      }
      if (row1 < q_len) {
        float* dst = a.out + ((size_t)(q0 + row1) * H + h) * MHA_DV + col;
        *(float2*)dst = make_float2(o[n][4 * t + 2] / l1, o[n][4 * t + 3] / l1);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Warp-specialised Hopper prefill (FlashAttention-3 structure): the same math and layouts as
// mha_wgmma_bf16, with the loads and the scheduling taken off the compute warps.
//
// Block = 2 consumer warpgroups + 1 producer warp (288 threads), 128 query rows of one
// (sequence, head). One thread of the producer warp (warp 8) issues TMA copies (the tensor
// maps come from the host, 128-byte swizzle, so the tiles land in exactly the layout wgmma
// reads) for Q once and for each 128-key step's K and V into MHA_WS_ST-deep rings, each slot
// guarded by a full / empty mbarrier pair. The producer is one warp, not a warpgroup handing
// its registers over through setmaxnreg: ptxas did not honour setmaxnreg for the consumer
// region, so every thread gets 168 registers either way. Warpgroups 0 and 1 consume, 64 query
// rows each:
//   - ping-pong (MHA_WS_PINGPONG): the two consumers take turns issuing their GEMMs (named
//     barriers 1 and 2), so one's softmax runs under the other's GEMMs: the tensor cores see
//     S_A, S_B, PV_A, PV_B, S_A, ... while A and B exponentiate in between;
//   - intra-warpgroup overlap (MHA_WS_OVERLAP): step j issues S_j = Q·K_jᵀ and then
//     P_{j-1}·V_{j-1}, and runs step j's softmax while P_{j-1}·V_{j-1} is on the tensor cores.
//     It keeps S, P and O live at once (160 registers at 128-key steps); ptxas gives a block of
//     9 warps 168 registers per thread (it rounds to warpgroups and does not honour setmaxnreg
//     for the consumer region here), so the overlap form needs 96- or 64-key steps.
// Keys past the sequence's end inside a step are masked; TMA zero-fills rows past the tensor,
// and rows of the next sequence (finite values) get probability 0.
// Grid: (ceil(max_q_len / 128), H, B); block 288; smem: MhaWsConfig::smem() on the host.
#if MHA_QKB % 64 == 0 && MHA_DV % 64 == 0
#define FERRY_MHA_WS 1
#ifndef MHA_WS_ST
#define MHA_WS_ST 2
#endif
#ifndef MHA_WS_PVN
#define MHA_WS_PVN 128
#endif
#ifndef MHA_WS_PINGPONG
#define MHA_WS_PINGPONG 0
#endif
#ifndef MHA_WS_K
#define MHA_WS_K 128
#endif
#ifndef MHA_WS_OVERLAP
#define MHA_WS_OVERLAP 0
#endif
#define WS_K MHA_WS_K                 // keys per step (64, 96 or 128)
#if WS_K == 128
#define WS_SS wg_ss128
#elif WS_K == 96
#define WS_SS wg_ss96
#else
#define WS_SS wg_ss64
#endif
#define WS_QB (64 * MHA_QKB * 2)      // bytes of one consumer's Q tile
#define WS_KB (WS_K * MHA_QKB * 2)    // bytes of one K step
#define WS_VB (WS_K * MHA_DV * 2)     // bytes of one V step

// A CUtensorMap, passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaMap {
  u64 v[16];
};

// One box of a 3-D tensor map (dims: width, head, row) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap* map, u32 bar, int x, int y,
                                            int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// S(64×WS_K) = Q·Kᵀ, both from shared memory (swizzled, K-major).
__device__ __forceinline__ void ws_scores(float* s, u32 q_addr, u32 k_addr) {
#pragma unroll
  for (int kk = 0; kk < MHA_QKB / 16; kk++)
    WS_SS(s, wg_desc_sw128(q_addr + (kk / 4) * 64 * 128 + (kk % 4) * 32, 16, 1024),
          wg_desc_sw128(k_addr + (kk / 4) * WS_K * 128 + (kk % 4) * 32, 16, 1024), kk > 0);
}
// O(64×DV) += P·V, V MN-major: MHA_WS_PVN-column wgmma (128 spans two swizzle atoms, LBO apart).
__device__ __forceinline__ void ws_pv(float (*o)[MHA_WS_PVN / 2], u32 (*pf)[4], u32 v_addr) {
#pragma unroll
  for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++)
#pragma unroll
    for (int kk = 0; kk < WS_K / 16; kk++) {
      u64 vd = wg_desc_sw128(v_addr + n * (MHA_WS_PVN / 64) * WS_K * 128 + kk * 2048, WS_K * 128,
                             1024);
#if MHA_WS_PVN == 128
      wg_rs128<1>(o[n], pf[kk], vd, 1);
#else
      wg_rs64<1>(o[n], pf[kk], vd, 1);
#endif
    }
}

extern "C" __global__ void __launch_bounds__(288, 1)
    mha_ws_bf16(MhaArgs a, const __grid_constant__ TmaMap tm_q,
                const __grid_constant__ TmaMap tm_k, const __grid_constant__ TmaMap tm_v) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem[];
  // Swizzled tiles need 1024-byte-aligned atoms: the host allots 1 KB of slack.
  u32 s_q = smem_u32(smem);
  s_q += (1024 - (s_q & 1023)) & 1023;                  // [2][DQK/64][64 rows][128 B]
  u32 s_k = s_q + 2 * WS_QB;                            // [ST][DQK/64][128 keys][128 B]
  u32 s_v = s_k + MHA_WS_ST * WS_KB;                    // [ST][DV/64][128 keys][128 B]
  u32 bars = s_v + MHA_WS_ST * WS_VB;                   // q_full, then 4 rings of ST
  const u32 q_full = bars;
  auto k_full = [&](int i) { return bars + 8 * (1 + i); };
  auto k_empty = [&](int i) { return bars + 8 * (1 + MHA_WS_ST + i); };
  auto v_full = [&](int i) { return bars + 8 * (1 + 2 * MHA_WS_ST + i); };
  auto v_empty = [&](int i) { return bars + 8 * (1 + 3 * MHA_WS_ST + i); };

  int h = blockIdx.y, b = blockIdx.z;
  int qb = gridDim.x - 1 - blockIdx.x;  // longest blocks first
  int q0 = a.cu_q[b], k0 = a.cu_k[b];
  int q_len = a.cu_q[b + 1] - q0, k_len = a.cu_k[b + 1] - k0;
  if (qb * 128 >= q_len) return;  // the whole block: before any barrier
  int offset = k_len - q_len;
  int kv_end = min(k_len, offset + qb * 128 + 128);  // keys any row of this block can see
  int n_kb = (kv_end + WS_K - 1) / WS_K;
  int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(q_full, 1);
    for (int i = 0; i < MHA_WS_ST; i++) {
      mbar_init(k_full(i), 1);
      mbar_init(v_full(i), 1);
      mbar_init(k_empty(i), 256);
      mbar_init(v_empty(i), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (tid >= 256) {
    // Producer.
    if (tid == 256) {
      mbar_expect_tx(q_full, 2 * WS_QB);
#pragma unroll
      for (int w = 0; w < 2; w++)
#pragma unroll
        for (int at = 0; at < MHA_QKB / 64; at++)
          tma_load_3d(s_q + w * WS_QB + at * 64 * 128, &tm_q, q_full, at * 64, h,
                      q0 + qb * 128 + w * 64);
      for (int kb = 0; kb < n_kb; kb++) {
        int st = kb % MHA_WS_ST, use = kb / MHA_WS_ST;
        if (use > 0) mbar_wait(k_empty(st), (use - 1) & 1);
        mbar_expect_tx(k_full(st), WS_KB);
#pragma unroll
        for (int at = 0; at < MHA_QKB / 64; at++)
          tma_load_3d(s_k + st * WS_KB + at * WS_K * 128, &tm_k, k_full(st), at * 64, h,
                      k0 + kb * WS_K);
        if (use > 0) mbar_wait(v_empty(st), (use - 1) & 1);
        mbar_expect_tx(v_full(st), WS_VB);
#pragma unroll
        for (int at = 0; at < MHA_DV / 64; at++)
          tma_load_3d(s_v + st * WS_VB + at * WS_K * 128, &tm_v, v_full(st), at * 64, h,
                      k0 + kb * WS_K);
      }
    }
    return;
  }

  // Consumers.
  int cw = tid / 128, tl = tid % 128, wl = tl / WARP, lane = tl % WARP;
  int g = lane / 4, c = lane % 4;
  int wg_first = qb * 128 + cw * 64;
  int row0 = wg_first + wl * 16 + g, row1 = row0 + 8;
  int lim0 = offset + row0 + 1, lim1 = offset + row1 + 1;
  // Whether step kb needs the causal / end-of-sequence mask for some row of this warpgroup.
  auto masked = [&](int kb) {
    return (kb + 1) * WS_K > offset + wg_first + 1 || (kb + 1) * WS_K > k_len;
  };
  const u32 my_q = s_q + cw * WS_QB;
#if MHA_WS_PINGPONG
  const int my_bar = 1 + cw, other_bar = 2 - cw;
  if (cw == 1) named_arrive(1, 256);  // consumer 0 issues first
#define WS_TURN() named_sync(my_bar, 256)
#define WS_DONE() named_arrive(other_bar, 256)
#else
#define WS_TURN()
#define WS_DONE()
#endif

  float o[MHA_DV / MHA_WS_PVN][MHA_WS_PVN / 2];
#pragma unroll
  for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++)
#pragma unroll
    for (int j = 0; j < MHA_WS_PVN / 2; j++) o[n][j] = 0.0f;
  RowState row = {-FERRY_INF, -FERRY_INF, 0.0f, 0.0f};
  float s[WS_K / 2], al0 = 1.0f, al1 = 1.0f;
  u32 pf[WS_K / 16][4];
  mbar_wait(q_full, 0);

#if !MHA_WS_OVERLAP
  for (int kb = 0; kb < n_kb; kb++) {
    int st = kb % MHA_WS_ST;
    u32 par = (kb / MHA_WS_ST) & 1;
    mbar_wait(k_full(st), par);
    WS_TURN();
    wg_fence();
    ws_scores(s, my_q, s_k + st * WS_KB);
    wg_commit();
    WS_DONE();
    wg_wait<0>();
    wg_fence_regs<WS_K / 2>(s);
    mbar_arrive(k_empty(st));
    acc_row_softmax<WS_K>(s, row, al0, al1, kb * WS_K, lim0, lim1, k_len, masked(kb),
                         a.scale_log2, c);
    acc_pack_p<WS_K>(s, pf);
#pragma unroll
    for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++) acc_rescale<MHA_WS_PVN / 2>(o[n], al0, al1);
    mbar_wait(v_full(st), par);
    WS_TURN();
    wg_fence();
    ws_pv(o, pf, s_v + st * WS_VB);
    wg_commit();
    WS_DONE();
    wg_wait<0>();
#pragma unroll
    for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++) wg_fence_regs<MHA_WS_PVN / 2>(o[n]);
    mbar_arrive(v_empty(st));
  }
#else
  // Step 0: scores and softmax only (there is no P·V to overlap yet).
  mbar_wait(k_full(0), 0);
  WS_TURN();
  wg_fence();
  ws_scores(s, my_q, s_k);
  wg_commit();
  WS_DONE();
  wg_wait<0>();
  wg_fence_regs<WS_K / 2>(s);
  mbar_arrive(k_empty(0));
  acc_row_softmax<WS_K>(s, row, al0, al1, 0, lim0, lim1, k_len, masked(0), a.scale_log2, c);
  acc_pack_p<WS_K>(s, pf);

  for (int kb = 1; kb < n_kb; kb++) {
    int st = kb % MHA_WS_ST, pst = (kb - 1) % MHA_WS_ST;
    mbar_wait(k_full(st), (kb / MHA_WS_ST) & 1);
    WS_TURN();
    wg_fence();
    ws_scores(s, my_q, s_k + st * WS_KB);
    wg_commit();
    // O is idle here (the last P·V was waited for): apply step kb - 1's rescale, then issue
    // P_{kb-1}·V_{kb-1} behind the scores.
#pragma unroll
    for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++) acc_rescale<MHA_WS_PVN / 2>(o[n], al0, al1);
    mbar_wait(v_full(pst), ((kb - 1) / MHA_WS_ST) & 1);
    wg_fence();
    ws_pv(o, pf, s_v + pst * WS_VB);
    wg_commit();
    WS_DONE();
    wg_wait<1>();  // the scores
    wg_fence_regs<WS_K / 2>(s);
    mbar_arrive(k_empty(st));
    acc_row_softmax<WS_K>(s, row, al0, al1, kb * WS_K, lim0, lim1, k_len, masked(kb),
                         a.scale_log2, c);
    wg_wait<0>();  // P_{kb-1}·V_{kb-1}: pf and O are free again
#pragma unroll
    for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++) wg_fence_regs<MHA_WS_PVN / 2>(o[n]);
    mbar_arrive(v_empty(pst));
    acc_pack_p<WS_K>(s, pf);
  }

  // The last step's P·V.
  {
    int pst = (n_kb - 1) % MHA_WS_ST;
#pragma unroll
    for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++) acc_rescale<MHA_WS_PVN / 2>(o[n], al0, al1);
    mbar_wait(v_full(pst), ((n_kb - 1) / MHA_WS_ST) & 1);
    WS_TURN();
    wg_fence();
    ws_pv(o, pf, s_v + pst * WS_VB);
    wg_commit();
    WS_DONE();
    wg_wait<0>();
#pragma unroll
    for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++) wg_fence_regs<MHA_WS_PVN / 2>(o[n]);
  }
#endif
#undef WS_TURN
#undef WS_DONE

  float l0 = row.l0, l1 = row.l1;
  l0 += SHFL_XOR(l0, 1);
  l0 += SHFL_XOR(l0, 2);
  l1 += SHFL_XOR(l1, 1);
  l1 += SHFL_XOR(l1, 2);
  int H = a.heads;
#pragma unroll
  for (int n = 0; n < MHA_DV / MHA_WS_PVN; n++)
#pragma unroll
    for (int t = 0; t < MHA_WS_PVN / 8; t++) {
      int col = n * MHA_WS_PVN + t * 8 + 2 * c;
      if (row0 < q_len) {
        float* dst = a.out + ((size_t)(q0 + row0) * H + h) * MHA_DV + col;
        *(float2*)dst = make_float2(o[n][4 * t] / l0, o[n][4 * t + 1] / l0);
      }
      if (row1 < q_len) {
        float* dst = a.out + ((size_t)(q0 + row1) * H + h) * MHA_DV + col;
        *(float2*)dst = make_float2(o[n][4 * t + 2] / l1, o[n][4 * t + 3] / l1);
      }
    }
}
#endif
#endif
