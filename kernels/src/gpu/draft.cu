// draft.cu: the speculative drafter's ops (see kernels/src/gpu/mod.rs), f32 math throughout.
//
//   draft_scatter_{f32,bf16}        rows into a paged layer at flat slots (block·page + offset)
//   draft_attn_{f32,bf16}_q{4,8,16}_d{32,64,128}
//                                   block attention: the B block rows of a sequence attend to its
//                                   n context rows (paged, natural [K | V] rows, f32 or bf16) and
//                                   to the B block rows themselves (no mask), GQA
//   draft_attn_combine              merges the attention's split-K partials
//   draft_concat                    one source's rows into a column range of the output
//   draft_confidence                σ(w·[h ; e] + bias), a warp per row
//   draft_markov_{f32,bf16}         one step of the Markov head: the backbone's logits at each
//                                   input's block position plus the bigram bias W2·W1[prev],
//                                   and the confidence head, in one launch
//
// Device-side indices the host could not check (slots, block ids, row ids, context lengths on
// the device) never make a kernel read or write outside its buffers: a bad slot is skipped, a
// bad row or block id turns the affected output into NaN, which the next host read surfaces.
#include "compat.cuh"

#define FERRY_NAN __int_as_float(0x7fc00000)

// ---------------------------------------------------------------------------------------------
// pages[slots[r]][:] = rows[r][:]. Grid: rows; block 128. Slots outside [0, total) are skipped.
template <typename KV>
__device__ void draft_scatter_impl(const float* rows, const long long* slots, KV* pages,
                                   int width, long long total) {
  long long s = slots[blockIdx.x];
  if (s < 0 || s >= total) return;
  const float* src = rows + (size_t)blockIdx.x * width;
  KV* dst = pages + (size_t)s * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) st_f(dst + i, src[i]);
}
extern "C" __global__ void draft_scatter_f32(const float* rows, const long long* slots,
                                             float* pages, int width, long long total) {
  pdl_enter();
  draft_scatter_impl(rows, slots, pages, width, total);
}
extern "C" __global__ void draft_scatter_bf16(const float* rows, const long long* slots,
                                              bf16_t* pages, int width, long long total) {
  pdl_enter();
  draft_scatter_impl(rows, slots, pages, width, total);
}

// ---------------------------------------------------------------------------------------------
// Block attention.
//
// Grid: (splits, heads · ⌈B / QB⌉, S); block DA_WARPS warps. A block takes one sequence s, one
// query head h (KV head g = h / (H / KV)), QB block rows and one split of the sequence's
// n + B keys (context positions 0..n, then the block rows). Its warps take 32-key tiles in turn;
// in a tile, lane j scores key j against every query row (queries in shared memory, read as
// broadcasts), the warp updates each row's running max / sum (online softmax, natural exp),
// then every lane accumulates its d / 32 output dimensions over the tile's values. The warps'
// states merge in shared memory; with one split the block writes the normalised rows, else
// unnormalised partials and (max, sum) for draft_attn_combine.
struct DraftAttnArgs {
  const float* q;        // [S·B][H·d]
  const float* k;        // [S·B][KV·d]: the block rows' keys
  const float* v;        // [S·B][KV·d]: the block rows' values
  const void* pages;     // [num_blocks][page][2·KV·d]: context rows, K then V
  const int* tables;     // [S][stride]
  const int* ctx;        // [S]: context lengths n_s
  float* out;            // [S·B][H·d] (splits == 1)
  float* o_part;         // [splits][S·B·H][d] (splits > 1)
  float* ml_part;        // [splits][S·B·H][2] (splits > 1)
  int stride, page, heads, kv_heads, head_dim, block, splits, keys_per_split;
  int max_ctx;           // the context length the launch was planned for (≥ every n_s)
  int num_blocks;        // blocks in the pool
  float scale;           // 1 / sqrt(d)
  int pad;
};

#define DA_WARPS 4

// sc[r] += Σ_dd q_s[r][dd] · kp[dd].
template <int QB, int DW, typename T>
__device__ __forceinline__ void draft_scores(const float (*q_s)[DW], const T* kp, int d,
                                             float* sc) {
  for (int dd = 0; dd < d; dd++) {
    float kv = ld_f(kp + dd);
#pragma unroll
    for (int r = 0; r < QB; r++) sc[r] += q_s[r][dd] * kv;
  }
}

template <typename KV, int QB, int DPL>
__device__ void draft_attn_impl(const DraftAttnArgs& a) {
  constexpr int DW = DPL * WARP;
  __shared__ float q_s[QB][DW];
  __shared__ float p_s[DA_WARPS][QB][WARP];
  // Where each lane's key of the current tile keeps its value row: an element offset into the
  // pages (>= 0), or -(offset into v) - 1 for a block row.
  __shared__ long long voff_s[DA_WARPS][WARP];
  __shared__ float ml_s[DA_WARPS][QB][2];
  __shared__ float o_s[QB][DW];
  __shared__ float row_s[QB][2];

  const int split = blockIdx.x, s = blockIdx.z;
  const int h = blockIdx.y % a.heads, chunk = blockIdx.y / a.heads;
  const int d = a.head_dim, g = h / (a.heads / a.kv_heads);
  const int kvw = a.kv_heads * d, width = 2 * kvw;
  const int r0 = chunk * QB, nr = min(QB, a.block - r0);
  const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
  int n = a.ctx[s];
  // A context length the launch was not planned for (or the table cannot hold) poisons the
  // sequence's rows instead of reading past the tables.
  const bool bad_ctx = n < 0 || n > a.max_ctx || n > a.stride * a.page;
  if (bad_ctx) n = 0;
  const int keys = n + a.block;
  const int start = split * a.keys_per_split, end = min(keys, start + a.keys_per_split);
  const KV* pages = (const KV*)a.pages;
  const int* table = a.tables + (size_t)s * a.stride;
  const int total_rows = gridDim.z * a.block * a.heads;

  for (int i = threadIdx.x; i < QB * DW; i += blockDim.x) {
    int r = i / DW, dd = i % DW;
    q_s[r][dd] =
        (r < nr && dd < d) ? a.q[((size_t)(s * a.block + r0 + r) * a.heads + h) * d + dd] : 0.0f;
  }
  __syncthreads();

  float m[QB], l[QB], acc[QB][DPL];
#pragma unroll
  for (int r = 0; r < QB; r++) {
    m[r] = -FERRY_INF;
    l[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < DPL; j++) acc[r][j] = 0.0f;
  }

  for (int t0 = start + w * WARP; t0 < end; t0 += DA_WARPS * WARP) {
    const int j = t0 + lane;
    const bool valid = j < end;
    bool bad = false;
    long long koff = 0;
    if (valid) {
      if (j < n) {
        int blk = table[j / a.page];
        bad = blk < 0 || blk >= a.num_blocks;
        koff = bad ? 0 : ((long long)blk * a.page + j % a.page) * width + (long long)g * d;
      } else {
        koff = -((long long)(s * a.block + j - n) * kvw + (long long)g * d) - 1;
      }
    }
    float sc[QB];
#pragma unroll
    for (int r = 0; r < QB; r++) sc[r] = 0.0f;
    if (valid && !bad) {
      if (koff >= 0) {
        draft_scores<QB, DW>(q_s, pages + koff, d, sc);
      } else {
        draft_scores<QB, DW>(q_s, a.k + (-(koff + 1)), d, sc);
      }
    }
    // Block rows' values share the keys' offsets (v has k's layout); context values follow K.
    voff_s[w][lane] = koff >= 0 ? koff + kvw : koff;
#pragma unroll
    for (int r = 0; r < QB; r++) {
      // A bad block id scores NaN: the row's sums, and so its output, become NaN.
      float x = !valid ? -FERRY_INF : (bad ? FERRY_NAN : sc[r] * a.scale);
      float mn = fmaxf(m[r], warp_max(x));
      float alpha = expf(m[r] - mn);
      float p = valid ? expf(x - mn) : 0.0f;
      l[r] = l[r] * alpha + warp_sum(p);
      m[r] = mn;
#pragma unroll
      for (int jj = 0; jj < DPL; jj++) acc[r][jj] *= alpha;
      p_s[w][r][lane] = p;
    }
    __syncwarp();
    const int cnt = min(WARP, end - t0);
    for (int jk = 0; jk < cnt; jk++) {
      const long long vo = voff_s[w][jk];
      float vv[DPL];
      if (vo >= 0) {
        const KV* vp = pages + vo;
#pragma unroll
        for (int jj = 0; jj < DPL; jj++) {
          int dd = lane + jj * WARP;
          vv[jj] = dd < d ? ld_f(vp + dd) : 0.0f;
        }
      } else {
        const float* vp = a.v + (-(vo + 1));
#pragma unroll
        for (int jj = 0; jj < DPL; jj++) {
          int dd = lane + jj * WARP;
          vv[jj] = dd < d ? vp[dd] : 0.0f;
        }
      }
#pragma unroll
      for (int r = 0; r < QB; r++) {
        float pr = p_s[w][r][jk];
#pragma unroll
        for (int jj = 0; jj < DPL; jj++) acc[r][jj] += pr * vv[jj];
      }
    }
    __syncwarp();
  }

  // Merge the warps: the block's max M and sum L per row, the output rescaled by e^(m_w − M).
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < QB; r++) {
      ml_s[w][r][0] = m[r];
      ml_s[w][r][1] = l[r];
    }
  }
  for (int i = threadIdx.x; i < QB * DW; i += blockDim.x) (&o_s[0][0])[i] = 0.0f;
  __syncthreads();
  if (threadIdx.x < QB) {
    int r = threadIdx.x;
    float M = -FERRY_INF, L = 0.0f;
    for (int ww = 0; ww < DA_WARPS; ww++) M = fmaxf(M, ml_s[ww][r][0]);
    for (int ww = 0; ww < DA_WARPS; ww++) {
      float mw = ml_s[ww][r][0];
      L += ml_s[ww][r][1] * (mw == -FERRY_INF ? 0.0f : expf(mw - M));
    }
    row_s[r][0] = M;
    row_s[r][1] = bad_ctx ? FERRY_NAN : L;
  }
  for (int ww = 0; ww < DA_WARPS; ww++) {
    if (w == ww) {
#pragma unroll
      for (int r = 0; r < QB; r++) {
        float M = -FERRY_INF;
        for (int x = 0; x < DA_WARPS; x++) M = fmaxf(M, ml_s[x][r][0]);
        float f = m[r] == -FERRY_INF ? 0.0f : expf(m[r] - M);
#pragma unroll
        for (int jj = 0; jj < DPL; jj++) {
          int dd = lane + jj * WARP;
          if (dd < d) o_s[r][dd] += acc[r][jj] * f;
        }
      }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < nr * d; i += blockDim.x) {
    int r = i / d, dd = i % d;
    size_t row = (size_t)(s * a.block + r0 + r) * a.heads + h;
    float o = bad_ctx ? FERRY_NAN : o_s[r][dd];
    if (a.splits == 1) {
      float L = row_s[r][1];
      a.out[row * d + dd] = L > 0.0f ? o / L : (L == 0.0f ? 0.0f : FERRY_NAN);
    } else {
      a.o_part[((size_t)split * total_rows + row) * d + dd] = o;
      if (dd == 0) {
        a.ml_part[((size_t)split * total_rows + row) * 2] = row_s[r][0];
        a.ml_part[((size_t)split * total_rows + row) * 2 + 1] = row_s[r][1];
      }
    }
  }
}

#define DRAFT_ATTN(KV, kvname, QB, D)                                               \
  extern "C" __global__ void __launch_bounds__(DA_WARPS * WARP)                     \
      draft_attn_##kvname##_q##QB##_d##D(DraftAttnArgs a) { pdl_enter();                         \
    draft_attn_impl<KV, QB, D / WARP>(a);                                           \
  }
#define DRAFT_ATTN_D(KV, kvname, QB) \
  DRAFT_ATTN(KV, kvname, QB, 32)     \
  DRAFT_ATTN(KV, kvname, QB, 64)     \
  DRAFT_ATTN(KV, kvname, QB, 128)
DRAFT_ATTN_D(float, f32, 4)
DRAFT_ATTN_D(float, f32, 8)
DRAFT_ATTN_D(float, f32, 16)
DRAFT_ATTN_D(bf16_t, bf16, 4)
DRAFT_ATTN_D(bf16_t, bf16, 8)
DRAFT_ATTN_D(bf16_t, bf16, 16)

// Merges split partials: out[r] = Σ_s o_s · e^(m_s − M) / Σ_s l_s · e^(m_s − M). Grid: rows
// (S·B·H); block 128; dynamic shared memory: one float per split. A split with no keys has
// m = −inf and weight 0; a NaN partial (a bad index) stays NaN.
extern "C" __global__ void draft_attn_combine(const float* o_part, const float* ml_part,
                                              int splits, int rows, int d, float* out) {
  pdl_enter();
  extern __shared__ float w_s[];
  size_t r = blockIdx.x;
  float M = -FERRY_INF;
  for (int s = 0; s < splits; s++) M = fmaxf(M, ml_part[((size_t)s * rows + r) * 2]);
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    float ms = ml_part[((size_t)s * rows + r) * 2];
    w_s[s] = ms == -FERRY_INF ? 0.0f : expf(ms - M);
  }
  __syncthreads();
  float L = 0.0f;
  for (int s = 0; s < splits; s++) L += ml_part[((size_t)s * rows + r) * 2 + 1] * w_s[s];
  for (int dd = threadIdx.x; dd < d; dd += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; s++) o += o_part[((size_t)s * rows + r) * d + dd] * w_s[s];
    out[r * d + dd] = L > 0.0f ? o / L : (L == 0.0f ? 0.0f : FERRY_NAN);
  }
}

// ---------------------------------------------------------------------------------------------
// dst[r][col0 + c] = src[rows[r]][c] for c < width; a row id outside [0, n) writes NaN.
// Grid: rows; block 128.
extern "C" __global__ void draft_concat(const float* src, int n, const int* rows, int width,
                                        float* dst, int dst_stride, int col0) {
  pdl_enter();
  int sr = rows[blockIdx.x];
  bool ok = sr >= 0 && sr < n;
  const float* s = src + (size_t)(ok ? sr : 0) * width;
  float* o = dst + (size_t)blockIdx.x * dst_stride + col0;
  for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = ok ? s[c] : FERRY_NAN;
}

// ---------------------------------------------------------------------------------------------
// out[r] = σ(Σ_i w[i]·h[r][i] + Σ_i w[hid + i]·e[r][i] + bias). A warp per row; block 256.
extern "C" __global__ void draft_confidence(const float* h, const float* e, const float* w,
                                            int rows, int hid, int rank, float bias, float* out) {
  pdl_enter();
  int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  float acc = 0.0f;
  if (r < rows) {
    for (int i = lane; i < hid; i += WARP) acc += w[i] * h[(size_t)r * hid + i];
    for (int i = lane; i < rank; i += WARP) acc += w[hid + i] * e[(size_t)r * rank + i];
  }
  float z = warp_sum(acc) + bias;
  if (r < rows && lane == 0) out[r] = 1.0f / (1.0f + expf(-z));
}

// ---------------------------------------------------------------------------------------------
// One left-to-right step of DSpark's Markov head for n inputs (W1, W2: [vocab][rank]):
//   out[s][v] = logits[at[s]][v] + Σ_r W2[v][r] · W1[prev[s]][r]
//   conf[s]   = σ(Σ_i cw[i]·hidden[at[s]][i] + Σ_r cw[hid + r]·W1[prev[s]][r] + cb)
// which the host would otherwise issue as seven launches (an embedding, the bias GEMV, two
// gathers, the add, the confidence head), one of them a single block walking a whole
// vocabulary row. A prev outside [0, vocab) reads a zero W1 row, as the embedding does (a failed
// draw's -1); an `at` outside [0, rows) gives NaN logits and confidence.
//
// Grid: (⌈vocab / MK_THREADS⌉, ⌈n / MK_ROWS⌉); block MK_THREADS; dynamic shared memory
// MK_ROWS · rank floats (the group's W1 rows). Thread t of block (x, g) takes vocabulary entry
// x · MK_THREADS + t for the group's MK_ROWS inputs: its W2 row is read once (16-byte loads when
// rank % 8 == 0) and dotted with each input's W1 row, read from shared memory as broadcasts, so
// W2 crosses memory once a step for up to MK_ROWS inputs. Blocks (0, g) also compute the group's
// confidences, a warp per input.
#define MK_THREADS 256
#define MK_ROWS 8
static_assert(MK_THREADS / WARP == MK_ROWS, "a warp per input for the confidences");

// Eight consecutive weights widened to f32 (16-byte aligned).
__device__ __forceinline__ void mk_load8(const bf16_t* w, float* f) {
  uint4 v = *reinterpret_cast<const uint4*>(w);
  unsigned p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    f[2 * j] = ferry_u2f(p[j] << 16);
    f[2 * j + 1] = ferry_u2f(p[j] & 0xffff0000u);
  }
}
__device__ __forceinline__ void mk_load8(const float* w, float* f) {
  float4 a = *reinterpret_cast<const float4*>(w), b = *reinterpret_cast<const float4*>(w + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

struct MarkovArgs {
  const float* logits;  // [rows][vocab] the backbone's logits
  const float* hidden;  // [rows][hid] its final hidden states
  const int* at;        // [n] each input's row at this block position
  const int* prev;      // [n] each input's previous token
  const void* w1;       // [vocab][rank]
  const void* w2;       // [vocab][rank]
  const float* cw;      // [hid + rank] confidence head weight
  float* out;           // [n][vocab]
  float* conf;          // [n]
  float cb;
  int n, rows, vocab, rank, hid;
};

template <typename W>
__device__ void draft_markov_impl(const MarkovArgs& a) {
  extern __shared__ float e_s[];  // [MK_ROWS][rank]
  const W* w1 = static_cast<const W*>(a.w1);
  const W* w2 = static_cast<const W*>(a.w2);
  int rank = a.rank, g0 = blockIdx.y * MK_ROWS;
  int nr = min(MK_ROWS, a.n - g0);
  for (int i = threadIdx.x; i < MK_ROWS * rank; i += blockDim.x) {
    int j = i / rank, r = i - j * rank;
    float x = 0.0f;
    if (j < nr) {
      int id = a.prev[g0 + j];
      if (id >= 0 && id < a.vocab) x = ld_f(w1 + (size_t)id * rank + r);
    }
    e_s[i] = x;
  }
  __syncthreads();
  int v = blockIdx.x * MK_THREADS + threadIdx.x;
  if (v < a.vocab) {
    float acc[MK_ROWS];
#pragma unroll
    for (int j = 0; j < MK_ROWS; j++) acc[j] = 0.0f;
    const W* wr = w2 + (size_t)v * rank;
    if ((rank & 7) == 0) {
      for (int r = 0; r < rank; r += 8) {
        float w[8];
        mk_load8(wr + r, w);
#pragma unroll
        for (int j = 0; j < MK_ROWS; j++) {
          if (j >= nr) break;  // uniform: a single stream does one input's FMAs, not eight
#pragma unroll
          for (int q = 0; q < 8; q++) acc[j] += w[q] * e_s[j * rank + r + q];
        }
      }
    } else {
      for (int r = 0; r < rank; r++) {
        float w = ld_f(wr + r);
#pragma unroll
        for (int j = 0; j < MK_ROWS; j++) {
          if (j >= nr) break;
          acc[j] += w * e_s[j * rank + r];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < MK_ROWS; j++) {
      if (j >= nr) break;
      int row = a.at[g0 + j];
      float x = row >= 0 && row < a.rows ? a.logits[(size_t)row * a.vocab + v] + acc[j] : FERRY_NAN;
      a.out[(size_t)(g0 + j) * a.vocab + v] = x;
    }
  }
  if (blockIdx.x != 0) return;
  int j = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  if (j >= nr) return;
  int row = a.at[g0 + j];
  bool ok = row >= 0 && row < a.rows;
  float z = 0.0f;
  if (ok)
    for (int i = lane; i < a.hid; i += WARP) z += a.cw[i] * a.hidden[(size_t)row * a.hid + i];
  for (int i = lane; i < rank; i += WARP) z += a.cw[a.hid + i] * e_s[j * rank + i];
  z = warp_sum(z) + a.cb;
  if (lane == 0) a.conf[g0 + j] = ok ? 1.0f / (1.0f + expf(-z)) : FERRY_NAN;
}
extern "C" __global__ void __launch_bounds__(MK_THREADS) draft_markov_f32(MarkovArgs a) {
  pdl_enter();
  draft_markov_impl<float>(a);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS) draft_markov_bf16(MarkovArgs a) {
  pdl_enter();
  draft_markov_impl<bf16_t>(a);
}
