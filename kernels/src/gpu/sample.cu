// sample.cu: sampling distributions, inverse-CDF draws, argmax and speculative verification,
// for CUDA and HIP. The reference semantics are the CPU sampler's (kernels/src/cpu/sample.rs,
// kernels/src/cpu/verify.rs); launch shapes and length checks are in kernels/src/cuda/sample.rs.
//
// Every kernel runs one block of SAMPLE_THREADS threads per row (or per verified sequence), so
// a row of any vocabulary size is handled in place, rows never interact, and every reduction
// has a fixed order (the results are deterministic for a given launch).
//
// Filters use pivot semantics: a filter finds a threshold value and keeps every entry >= it.
// The top-k and top-p thresholds are found by a radix search over the f32 bit patterns of the
// (non-negative) probabilities, 4 bits per pass: no sort, no shared copy of the row, so a
// 129k-entry vocabulary takes the same path as an 8-entry one.
#include "compat.cuh"

#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / WARP)
#define RADIX_BITS 4
#define RADIX_BINS 16
#define NO_INDEX 0x7fffffff
// One warp per radix bin sums that bin; block sums read one partial per warp from one warp.
static_assert(SAMPLE_WARPS >= RADIX_BINS && SAMPLE_WARPS <= WARP, "block shape");

// Per-row parameters, SAMPLE_PARAM_WORDS u32 per row (packed by cuda/sample.rs).
#define PARAM_TEMPERATURE 0  // f32 bits
#define PARAM_TOP_K 1        // u32
#define PARAM_TOP_P 2        // f32 bits
#define PARAM_MIN_P 3        // f32 bits
#define PARAM_GREEDY 4       // 1 when SamplingParams::is_greedy()
#define SAMPLE_PARAM_WORDS 5

// Verification result codes (slot 0 of a sequence's output row when negative).
#define VERIFY_DEGENERATE -1  // [code, position, f32 bits of the sum]
#define VERIFY_ZERO_Q -2      // [code, position, token, f32 bits of q(token)]
#define VERIFY_BAD_ID -3      // [code, position, token]

__device__ __forceinline__ bool finite_f(float v) { return fabsf(v) < FERRY_INF; }
__device__ __forceinline__ float nan_f() { return ferry_u2f(0x7fc00000u); }

template <typename T>
__device__ __forceinline__ T warp_sum_t(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += SHFL_XOR(v, m);
  return v;
}

// Sum over the block, in a fixed order; every thread gets the total. `red` holds SAMPLE_WARPS.
template <typename T>
__device__ __forceinline__ T block_sum_t(T v, T* red) {
  v = warp_sum_t(v);
  int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  T t = lane < SAMPLE_WARPS ? red[lane] : (T)0;
  return warp_sum_t(t);
}

// Max over the block (NaN-ignoring, like fmaxf); every thread gets it.
__device__ __forceinline__ float block_max_f(float v, float* red) {
  v = warp_max(v);
  int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  float t = lane < SAMPLE_WARPS ? red[lane] : -FERRY_INF;
  return warp_max(t);
}

// Whether `a` beats `b` for argmax: larger, or equal at a lower index. NaN never beats anything.
__device__ __forceinline__ bool arg_better(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    float ov = SHFL_XOR(v, m);
    int oi = SHFL_XOR(i, m);
    if (arg_better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// The best (value, index) of x[lo..hi) over the block, by `arg_better`; (-inf, NO_INDEX) when
// nothing beats -inf (empty, all -inf or all NaN). Every thread gets it. Each thread takes
// ARGMAX_UNROLL strided entries a trip, loading them all before comparing (one memory round
// trip a trip, not one per entry), and visits its indices in increasing order, so `>` keeps
// its lowest tied index.
#define ARGMAX_UNROLL 4
__device__ void block_argmax_range(const float* x, int lo, int hi, float* red_v, int* red_i,
                                   float* out_v, int* out_i) {
  float bv = -FERRY_INF;
  int bi = NO_INDEX;
  for (int base = lo + threadIdx.x; base < hi; base += ARGMAX_UNROLL * SAMPLE_THREADS) {
    float v[ARGMAX_UNROLL];
#pragma unroll
    for (int j = 0; j < ARGMAX_UNROLL; j++) {
      int i = base + j * SAMPLE_THREADS;
      v[j] = i < hi ? x[i] : -FERRY_INF;
    }
#pragma unroll
    for (int j = 0; j < ARGMAX_UNROLL; j++)
      if (v[j] > bv) { bv = v[j]; bi = base + j * SAMPLE_THREADS; }
  }
  warp_argmax(bv, bi);
  int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  __syncthreads();
  if (lane == 0) { red_v[w] = bv; red_i[w] = bi; }
  __syncthreads();
  bv = lane < SAMPLE_WARPS ? red_v[lane] : -FERRY_INF;
  bi = lane < SAMPLE_WARPS ? red_i[lane] : NO_INDEX;
  warp_argmax(bv, bi);
  *out_v = bv;
  *out_i = bi;
}

// cpu::sample::argmax over x[0..n): the largest value, ties to the lowest index, NaN never
// chosen; 0 when nothing beats -inf (empty, all -inf or all NaN). Every thread gets it.
__device__ int block_argmax(const float* x, int n, float* red_v, int* red_i) {
  float bv;
  int bi;
  block_argmax_range(x, 0, n, red_v, red_i, &bv, &bi);
  return bi == NO_INDEX ? 0 : bi;
}

// Shared scratch of the distribution kernel.
struct ProbsSmem {
  float hist[RADIX_BINS * SAMPLE_THREADS];  // per-thread private bins of one radix pass
  float bins[RADIX_BINS];
  float red[SAMPLE_WARPS];
  int red_i[SAMPLE_WARPS];
};

// The sort key of a non-negative probability: its bit pattern (monotone for v >= 0); -0 is 0.
__device__ __forceinline__ u32 prob_key(float v) {
  u32 k = ferry_f2u(v);
  return (k & 0x80000000u) ? 0u : k;
}

// The largest non-negative f32 bit pattern t with W(t) >= target, where W(t) sums w_i over the
// entries whose key is >= t, with w_i = 1 (MASS = false: counts, exact in f32 below 2^24
// entries) or p_i (MASS = true). W only changes at entry values, so t is an entry's value:
// - counts with target k: the k-th largest value (top-k's pivot);
// - mass with target p·total: the value at which the descending cumulative sum first reaches
//   the target (top-p's pivot).
// Found 4 bits at a time from the top: each pass sums, per thread, the weight of the entries
// above the fixed prefix and the weight of each next-digit bin of the entries on it, then takes
// the largest digit whose candidate (prefix, digit, zeros) still reaches the target. If
// rounding leaves no digit reaching it on a later pass, digit 0 is taken (its candidate
// reached the target on the pass before). Returns false when even t = 0 misses the target
// (mass only, through rounding): the caller leaves the row untouched, as the CPU does.
template <bool MASS>
__device__ bool radix_pivot(const float* p, int n, float target, ProbsSmem& s, u32* pivot) {
  int tid = threadIdx.x, w = tid / WARP, lane = tid % WARP;
  u32 prefix = 0;
  for (int shift = 32 - RADIX_BITS; shift >= 0; shift -= RADIX_BITS) {
    // Bits above this digit: the fixed prefix (none on the first pass).
    u32 high = shift + RADIX_BITS >= 32 ? 0u : (0xffffffffu << (shift + RADIX_BITS));
#pragma unroll
    for (int b = 0; b < RADIX_BINS; b++) s.hist[b * SAMPLE_THREADS + tid] = 0.0f;
    float above = 0.0f;
    for (int i = tid; i < n; i += SAMPLE_THREADS) {
      float v = p[i];
      u32 key = prob_key(v);
      float wt = MASS ? v : 1.0f;
      u32 h = key & high;
      if (h > prefix) {
        above += wt;
      } else if (h == prefix) {
        s.hist[((key >> shift) & (RADIX_BINS - 1)) * SAMPLE_THREADS + tid] += wt;
      }
    }
    __syncthreads();
    if (w < RADIX_BINS) {
      float t = 0.0f;
      for (int j = lane; j < SAMPLE_THREADS; j += WARP) t += s.hist[w * SAMPLE_THREADS + j];
      t = warp_sum_t(t);
      if (lane == 0) s.bins[w] = t;
    }
    above = block_sum_t(above, s.red);  // its barriers also publish s.bins
    int digit = -1;
    float cum = above;
    for (int b = RADIX_BINS - 1; b >= 0; b--) {
      cum += s.bins[b];
      if (cum >= target) { digit = b; break; }
    }
    if (digit < 0) {
      if (shift == 32 - RADIX_BITS) return false;
      digit = 0;
    }
    prefix |= (u32)digit << shift;
    // The next pass rewrites s.bins only after its first barrier, which every thread reaches
    // after reading them here.
  }
  *pivot = prefix;
  return true;
}

// cpu::sample's keep_at_least: zero entries < threshold and divide the rest by their sum.
// Returns false (leaving the row as it is) when the kept mass is not finite and positive.
__device__ bool keep_at_least(float* p, int n, float threshold, ProbsSmem& s) {
  float kept = 0.0f;
  for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
    float v = p[i];
    if (v >= threshold) kept += v;
  }
  kept = block_sum_t(kept, s.red);
  if (!(finite_f(kept) && kept > 0.0f)) return false;
  for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
    float v = p[i];
    p[i] = v >= threshold ? v / kept : 0.0f;
  }
  return true;
}

// A row with no distribution: all NaN, which draw and verify report as degenerate.
__device__ void mark_degenerate(float* p, int n) {
  for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) p[i] = nan_f();
}

// Whether a (non-greedy) row has a filter to apply after its softmax.
__device__ __forceinline__ bool has_filters(const u32* prm, int vocab) {
  u32 k = prm[PARAM_TOP_K];
  return (k != 0 && k < (u32)vocab) || ferry_u2f(prm[PARAM_TOP_P]) < 1.0f ||
         ferry_u2f(prm[PARAM_MIN_P]) > 0.0f;
}

// The filters of cpu::sample::probs_from_logits on a softmax row p, in place: top-k, top-p,
// min-p, each renormalising with pivot ties kept; a degenerate kept mass marks the row NaN.
__device__ void apply_filters(float* p, const u32* prm, int vocab, ProbsSmem& s) {
  int tid = threadIdx.x;
  u32 k = prm[PARAM_TOP_K];
  if (k != 0 && k < (u32)vocab) {
    u32 pivot = 0;
    radix_pivot<false>(p, vocab, (float)k, s, &pivot);  // always found: W(0) = vocab > k
    if (!keep_at_least(p, vocab, ferry_u2f(pivot), s)) {
      mark_degenerate(p, vocab);
      return;
    }
    __syncthreads();
  }
  float top_p = ferry_u2f(prm[PARAM_TOP_P]);
  if (top_p < 1.0f) {
    float total = 0.0f;
    for (int i = tid; i < vocab; i += SAMPLE_THREADS) total += p[i];
    total = block_sum_t(total, s.red);
    u32 pivot = 0;
    if (radix_pivot<true>(p, vocab, top_p * total, s, &pivot)) {
      if (!keep_at_least(p, vocab, ferry_u2f(pivot), s)) {
        mark_degenerate(p, vocab);
        return;
      }
      __syncthreads();
    }
  }
  float min_p = ferry_u2f(prm[PARAM_MIN_P]);
  if (min_p > 0.0f) {
    float mx = -FERRY_INF;
    for (int i = tid; i < vocab; i += SAMPLE_THREADS) mx = fmaxf(mx, p[i]);
    mx = block_max_f(mx, s.red);
    if (!keep_at_least(p, vocab, min_p * mx, s)) mark_degenerate(p, vocab);
  }
}

// cpu::sample::probs_from_logits per row: a one-hot at the argmax for greedy rows; otherwise
// softmax(logits / T) (max subtracted), top-k, top-p, min-p, each renormalising with pivot
// ties kept. A row whose softmax or kept mass is degenerate is written as all NaN.
// Grid: rows; block: SAMPLE_THREADS. `vocab` < 2^24 (counts are exact in f32).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_probs(const float* logits, float* probs, const u32* params, int vocab) {
  pdl_enter();
  __shared__ ProbsSmem s;
  const float* x = logits + (size_t)blockIdx.x * vocab;
  float* p = probs + (size_t)blockIdx.x * vocab;
  const u32* prm = params + (size_t)blockIdx.x * SAMPLE_PARAM_WORDS;
  int tid = threadIdx.x;
  if (prm[PARAM_GREEDY]) {
    int a = block_argmax(x, vocab, s.red, s.red_i);
    for (int i = tid; i < vocab; i += SAMPLE_THREADS) p[i] = i == a ? 1.0f : 0.0f;
    return;
  }
  float temp = ferry_u2f(prm[PARAM_TEMPERATURE]);
  // Softmax of x / T: the CPU divides first, then subtracts the max of the quotients.
  float m = -FERRY_INF, has_nan = 0.0f;
  for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
    float y = x[i] / temp;
    m = fmaxf(m, y);
    if (y != y) has_nan = 1.0f;
  }
  m = block_max_f(m, s.red);
  has_nan = block_max_f(has_nan, s.red);
  if (has_nan > 0.0f || !finite_f(m)) {
    mark_degenerate(p, vocab);
    return;
  }
  float sum = 0.0f;
  for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
    float e = expf(x[i] / temp - m);
    p[i] = e;
    sum += e;
  }
  sum = block_sum_t(sum, s.red);
  for (int i = tid; i < vocab; i += SAMPLE_THREADS) p[i] = p[i] / sum;
  __syncthreads();

  apply_filters(p, prm, vocab, s);
}

// cpu::sample::argmax per row. Grid: rows; block: SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_argmax(const float* logits, int vocab, int* out) {
  pdl_enter();
  __shared__ float red_v[SAMPLE_WARPS];
  __shared__ int red_i[SAMPLE_WARPS];
  int a = block_argmax(logits + (size_t)blockIdx.x * vocab, vocab, red_v, red_i);
  if (threadIdx.x == 0) out[blockIdx.x] = a;
}

// The same argmax with each row split over `parts` blocks, for a few long rows (one block
// walking a 100k-entry row alone is one SM's latency-bound loop; a single-stream decode step
// and each Markov step of a drafter pass pay it). Grid: (parts, rows); block: SAMPLE_THREADS.
// Block (c, r) writes the best of row r's entries [c·chunk, (c+1)·chunk) to part r·parts + c.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_argmax_part(const float* logits, int vocab, int chunk, float* part_v, int* part_i) {
  pdl_enter();
  __shared__ float red_v[SAMPLE_WARPS];
  __shared__ int red_i[SAMPLE_WARPS];
  int c = blockIdx.x, parts = gridDim.x;
  int lo = c * chunk, hi = min(vocab, lo + chunk);
  float bv;
  int bi;
  block_argmax_range(logits + (size_t)blockIdx.y * vocab, lo, hi, red_v, red_i, &bv, &bi);
  if (threadIdx.x == 0) {
    part_v[(size_t)blockIdx.y * parts + c] = bv;
    part_i[(size_t)blockIdx.y * parts + c] = bi;
  }
}

// Merges a row's parts (written by sample_argmax_part) by `arg_better`: the same winner as
// one block over the whole row, whatever the order. Grid: rows; block: one warp.
extern "C" __global__ void sample_argmax_merge(const float* part_v, const int* part_i, int parts,
                                               int* out) {
  pdl_enter();
  float bv = -FERRY_INF;
  int bi = NO_INDEX;
  const float* pv = part_v + (size_t)blockIdx.x * parts;
  const int* pi = part_i + (size_t)blockIdx.x * parts;
  for (int c = threadIdx.x; c < parts; c += WARP)
    if (arg_better(pv[c], pi[c], bv, bi)) { bv = pv[c]; bi = pi[c]; }
  warp_argmax(bv, bi);
  if (threadIdx.x == 0) out[blockIdx.x] = bi == NO_INDEX ? 0 : bi;
}

// ---------------------------------------------------------------------------------------------
// Inverse-CDF draws.

struct DrawSmem {
  double chunk[SAMPLE_WARPS];  // each warp's chunk mass
  int last[SAMPLE_WARPS];      // each warp's last positive index
  int bad[SAMPLE_WARPS];       // each warp saw a negative entry
  int result;
  float sum;
};

// The row as drawn: p itself.
struct RowProbs {
  const float* p;
  __device__ __forceinline__ float operator()(int i) const { return p[i]; }
};

// The correction's row: max(0, p − q) in f32, as cpu::verify forms it (fmaxf, like Rust's
// f32::max, turns a NaN difference into 0).
struct RowResidual {
  const float* p;
  const float* q;
  __device__ __forceinline__ float operator()(int i) const { return fmaxf(p[i] - q[i], 0.0f); }
};

// A greedy draft's correction row: q is a point mass at the draft x, so max(0, p − q) is p with
// entry x zeroed (cpu::verify's DraftProbs::Greedy rule), with no q row in memory.
struct RowResidualGreedy {
  const float* p;
  int x;
  __device__ __forceinline__ float operator()(int i) const { return i == x ? 0.0f : p[i]; }
};

__device__ __forceinline__ int warp_min_i(int v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = min(v, (int)SHFL_XOR(v, m));
  return v;
}

__device__ __forceinline__ int warp_max_i(int v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = max(v, (int)SHFL_XOR(v, m));
  return v;
}

// Inclusive prefix sum over the warp's lanes (lane i gets Σ_{j<=i} x_j), in a fixed order.
__device__ __forceinline__ double warp_scan_incl(double x, int lane) {
#pragma unroll
  for (int off = 1; off < WARP; off <<= 1) {
    double y = SHFL(x, (lane - off) & (WARP - 1));
    if (lane >= off) x += y;
  }
  return x;
}

// One entry of a draw's totals: a positive entry adds its mass and is the last positive so
// far; NaN adds to the total (making it NaN), as on the CPU; a negative entry is an error there.
__device__ __forceinline__ void draw_tally(float v, int i, double& mass, int& last, int& bad) {
  if (v > 0.0f) {
    mass += (double)v;
    last = i;
  } else if (v < 0.0f || v != v) {
    if (v != v) mass += (double)v; else bad = 1;
  }
}

// cpu::sample::sample_from_probs over value(0..n), by the whole block: the first index whose
// cumulative mass exceeds u·total (u clamped to [0, 1]); the last positive index when rounding
// leaves the cumulative a hair short of the target at the end. Cumulation is in f64 like the
// CPU's, in another order (per-warp chunks, then 32-wide warp scans), so a draw can differ from
// the CPU's only when u·total lies within a few f64 ulps of a CDF boundary.
// Returns -1 when the total is not finite and positive or an entry is negative; `*sum` gets
// the total (as f32) for the error message. Every thread gets the result.
template <typename F>
__device__ int block_draw(F value, int n, double u, DrawSmem& s, float* sum) {
  int tid = threadIdx.x, w = tid / WARP, lane = tid % WARP;
  int chunk = (n + SAMPLE_WARPS - 1) / SAMPLE_WARPS;
  int begin = min(w * chunk, n), end = min(begin + chunk, n);
  double mass = 0.0;
  int last = -1, bad = 0;
  for (int i = begin + lane; i < end; i += WARP) draw_tally(value(i), i, mass, last, bad);
  mass = warp_sum_t(mass);
  last = warp_max_i(last);
  bad = warp_max_i(bad);
  __syncthreads();
  if (lane == 0) {
    s.chunk[w] = mass;
    s.last[w] = last;
    s.bad[w] = bad;
  }
  __syncthreads();
  // Every thread walks the chunk totals in the same order: same total, same chunk.
  double total = 0.0;
  int last_pos = -1, any_bad = 0;
  for (int c = 0; c < SAMPLE_WARPS; c++) {
    total += s.chunk[c];
    last_pos = max(last_pos, s.last[c]);
    any_bad |= s.bad[c];
  }
  *sum = (float)total;
  if (!(total == total && total > 0.0 && total < 1.0e308) || any_bad) return -1;
  double uc = u < 0.0 ? 0.0 : (u > 1.0 ? 1.0 : u);
  double target = uc * total;
  int start_chunk = -1;
  double base = 0.0;
  for (int c = 0; c < SAMPLE_WARPS; c++) {
    if (base + s.chunk[c] > target) { start_chunk = c; break; }
    base += s.chunk[c];
  }
  if (start_chunk < 0) return last_pos;
  if (tid == 0) s.result = last_pos;
  __syncthreads();
  if (w == start_chunk) {
    // Scan from this chunk's start to the end of the row (past the chunk only if rounding
    // put the crossing just beyond it), 32 entries at a time.
    for (int t0 = min(start_chunk * chunk, n); t0 < n; t0 += WARP) {
      int i = t0 + lane;
      float v = i < n ? value(i) : 0.0f;
      double x = v > 0.0f ? (double)v : 0.0;
      x = warp_scan_incl(x, lane);
      int hit = (v > 0.0f && base + x > target) ? lane : WARP;
      hit = warp_min_i(hit);
      if (hit < WARP) {
        if (lane == 0) s.result = t0 + hit;
        break;
      }
      base += SHFL(x, WARP - 1);
    }
  }
  __syncthreads();
  int r = s.result;
  __syncthreads();
  return r;
}

// cpu::sample::sample_from_probs per row with uniforms[row]; -1 for a degenerate row.
// Grid: rows; block: SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_draw(const float* probs, const double* uniforms, int vocab, int* out) {
  pdl_enter();
  __shared__ DrawSmem s;
  RowProbs row = {probs + (size_t)blockIdx.x * vocab};
  float sum;
  int r = block_draw(row, vocab, uniforms[blockIdx.x], s, &sum);
  if (threadIdx.x == 0) out[blockIdx.x] = r;
}

// ---------------------------------------------------------------------------------------------
// The distribution and the draw of a few long rows, each row split over several blocks.
//
// One block walking a 100k-entry row is one SM's latency-bound loop, several times over (the
// softmax's three passes, the draw's cumulation and scan): at batch 1 that is a large part of a
// sampled decode step, and a drafter pass pays it at each of its block positions. These kernels
// give a row `parts` blocks of `chunk` entries each (grid (parts, rows); the launcher picks the
// split from the row count only, so a captured graph stays valid whatever the parameters):
//
//   sample_softmax_max   part max of x / T and whether it saw a NaN (greedy rows: the part's
//                        argmax)
//   sample_softmax_exp   the row max from its parts; e = exp(x / T − max) into p; part sums
//   sample_softmax_norm  the row sum from its parts (fixed order: every block the same sum);
//                        p /= it
//   sample_probs_finish  one block a row: a greedy row's one-hot at its parts' argmax; a row with
//                        top-k / top-p / min-p filters them as sample_probs does; others return
//   sample_draw_part     part mass (f64), last positive index, negative-entry flag
//   sample_draw_pick     one block a row: the total, then the part holding u · total, scanned
//                        512 entries at a time by the whole block
//
// The exp and norm kernels skip greedy rows (sample_probs_finish writes them). Numerics are
// sample_probs' and sample_draw's up to summation order.

// The row's part values reduced by the block (max, or the sum in a fixed tree order): every
// block of a row gets the same value. `red` holds SAMPLE_WARPS.
__device__ __forceinline__ float parts_max(const float* part, int parts, float* red) {
  float m = -FERRY_INF;
  for (int c = threadIdx.x; c < parts; c += SAMPLE_THREADS) m = fmaxf(m, part[c]);
  return block_max_f(m, red);
}
__device__ __forceinline__ float parts_sum(const float* part, int parts, float* red) {
  float t = 0.0f;
  for (int c = threadIdx.x; c < parts; c += SAMPLE_THREADS) t += part[c];
  return block_sum_t(t, red);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_softmax_max(const float* logits, const u32* params, int vocab, int chunk,
                       float* part_m, float* part_nan, int* part_i) {
  pdl_enter();
  __shared__ float red[SAMPLE_WARPS];
  __shared__ int red_i[SAMPLE_WARPS];
  int r = blockIdx.y, parts = gridDim.x;
  const u32* prm = params + (size_t)r * SAMPLE_PARAM_WORDS;
  const float* x = logits + (size_t)r * vocab;
  int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
  if (prm[PARAM_GREEDY]) {
    // The part's argmax, merged by sample_probs_finish.
    float bv;
    int bi;
    block_argmax_range(x, lo, hi, red, red_i, &bv, &bi);
    if (threadIdx.x == 0) {
      part_m[(size_t)r * parts + blockIdx.x] = bv;
      part_i[(size_t)r * parts + blockIdx.x] = bi;
    }
    return;
  }
  float temp = ferry_u2f(prm[PARAM_TEMPERATURE]);
  float m = -FERRY_INF, has_nan = 0.0f;
  for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) {
    float y = x[i] / temp;
    m = fmaxf(m, y);
    if (y != y) has_nan = 1.0f;
  }
  m = block_max_f(m, red);
  has_nan = block_max_f(has_nan, red);
  if (threadIdx.x == 0) {
    part_m[(size_t)r * parts + blockIdx.x] = m;
    part_nan[(size_t)r * parts + blockIdx.x] = has_nan;
  }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_softmax_exp(const float* logits, const u32* params, int vocab, int chunk,
                       const float* part_m, const float* part_nan, float* probs,
                       float* part_s) {
  pdl_enter();
  __shared__ float red[SAMPLE_WARPS];
  int r = blockIdx.y, parts = gridDim.x;
  const u32* prm = params + (size_t)r * SAMPLE_PARAM_WORDS;
  if (prm[PARAM_GREEDY]) return;
  float temp = ferry_u2f(prm[PARAM_TEMPERATURE]);
  float m = parts_max(part_m + (size_t)r * parts, parts, red);
  float has_nan = parts_max(part_nan + (size_t)r * parts, parts, red);
  const float* x = logits + (size_t)r * vocab;
  float* p = probs + (size_t)r * vocab;
  int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
  if (has_nan > 0.0f || !finite_f(m)) {
    for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) p[i] = nan_f();
    if (threadIdx.x == 0) part_s[(size_t)r * parts + blockIdx.x] = nan_f();
    return;
  }
  float sum = 0.0f;
  for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) {
    float e = expf(x[i] / temp - m);
    p[i] = e;
    sum += e;
  }
  sum = block_sum_t(sum, red);
  if (threadIdx.x == 0) part_s[(size_t)r * parts + blockIdx.x] = sum;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_softmax_norm(const u32* params, int vocab, int chunk, const float* part_s,
                        float* probs) {
  pdl_enter();
  __shared__ float red[SAMPLE_WARPS];
  int r = blockIdx.y, parts = gridDim.x;
  if (params[(size_t)r * SAMPLE_PARAM_WORDS + PARAM_GREEDY]) return;
  float sum = parts_sum(part_s + (size_t)r * parts, parts, red);
  if (sum != sum) return;  // a degenerate row, already NaN
  float* p = probs + (size_t)r * vocab;
  int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
  for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) p[i] = p[i] / sum;
}

// Grid: rows; block: SAMPLE_THREADS. A greedy row's argmax comes from its parts
// (sample_softmax_max wrote them): the same winner as one block over the row.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_probs_finish(float* probs, const u32* params, int vocab, int parts,
                        const float* part_m, const int* part_i) {
  pdl_enter();
  __shared__ ProbsSmem s;
  __shared__ int s_arg;
  float* p = probs + (size_t)blockIdx.x * vocab;
  const u32* prm = params + (size_t)blockIdx.x * SAMPLE_PARAM_WORDS;
  if (prm[PARAM_GREEDY]) {
    if (threadIdx.x < WARP) {
      const float* pv = part_m + (size_t)blockIdx.x * parts;
      const int* pi = part_i + (size_t)blockIdx.x * parts;
      float bv = -FERRY_INF;
      int bi = NO_INDEX;
      for (int c = threadIdx.x; c < parts; c += WARP)
        if (arg_better(pv[c], pi[c], bv, bi)) { bv = pv[c]; bi = pi[c]; }
      warp_argmax(bv, bi);
      if (threadIdx.x == 0) s_arg = bi == NO_INDEX ? 0 : bi;
    }
    __syncthreads();
    int a = s_arg;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) p[i] = i == a ? 1.0f : 0.0f;
    return;
  }
  // A degenerate row is NaN everywhere; it stays as it is.
  if (!has_filters(prm, vocab) || p[0] != p[0]) return;
  apply_filters(p, prm, vocab, s);
}

// Max over the block; every thread gets it. `red` holds SAMPLE_WARPS.
__device__ __forceinline__ int block_max_i(int v, int* red) {
  v = warp_max_i(v);
  int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  return warp_max_i(lane < SAMPLE_WARPS ? red[lane] : -0x7fffffff - 1);
}

// A split draw's part totals over value(lo..hi) of one row: mass (f64), last positive index,
// negative-entry flag, written by thread 0 to slot `at`.
template <typename F>
__device__ void draw_part_impl(F value, int lo, int hi, double* part_mass, int* part_last,
                               int* part_bad, size_t at) {
  __shared__ double red_d[SAMPLE_WARPS];
  __shared__ int red_i[SAMPLE_WARPS];
  double mass = 0.0;
  int last = -1, bad = 0;
  for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS)
    draw_tally(value(i), i, mass, last, bad);
  mass = block_sum_t(mass, red_d);
  last = block_max_i(last, red_i);
  bad = block_max_i(bad, red_i);
  if (threadIdx.x == 0) {
    part_mass[at] = mass;
    part_last[at] = last;
    part_bad[at] = bad;
  }
}

// block_draw over value(0..n) from the row's part totals (draw_part_impl): the total, then the
// part holding u · total (found by one warp, 32 parts at a time, in part order), scanned
// SAMPLE_THREADS entries at a time by the whole block. -1 when the total is not finite and
// positive or an entry is negative; `*sum` gets the total. Every thread gets the result.
template <typename F>
__device__ int draw_pick_impl(F value, int n, int chunk, int parts, const double* pm,
                              const int* pl, const int* pb, double u, float* sum) {
  __shared__ double wsum[SAMPLE_WARPS];
  __shared__ int whit[SAMPLE_WARPS];
  __shared__ double s_target, s_base, s_total;
  __shared__ int s_start, s_last, s_bad;
  int tid = threadIdx.x, w = tid / WARP, lane = tid % WARP;
  if (w == 0) {
    double total = 0.0;
    int last = -1, bad = 0;
    for (int c = lane; c < parts; c += WARP) {
      total += pm[c];
      last = max(last, pl[c]);
      bad |= pb[c];
    }
    total = warp_sum_t(total);
    last = warp_max_i(last);
    bad = warp_max_i(bad);
    bool ok = total == total && total > 0.0 && total < 1.0e308 && !bad;
    double uc = u < 0.0 ? 0.0 : (u > 1.0 ? 1.0 : u);
    double target = uc * total;
    int start = -1;
    double base = 0.0;
    if (ok) {
      for (int c0 = 0; c0 < parts && start < 0; c0 += WARP) {
        double x = c0 + lane < parts ? pm[c0 + lane] : 0.0;
        x = warp_scan_incl(x, lane);
        int hit = base + x > target ? lane : WARP;
        hit = warp_min_i(hit);
        if (hit < WARP) {
          start = c0 + hit;
          double before = SHFL(x, (hit + WARP - 1) & (WARP - 1));
          if (hit > 0) base += before;
        } else {
          base += SHFL(x, WARP - 1);
        }
      }
    }
    if (lane == 0) {
      s_target = target;
      s_base = base;
      s_total = total;
      s_start = start;
      s_last = last;
      s_bad = !ok;
    }
  }
  __syncthreads();
  *sum = (float)s_total;
  int result = s_last;
  if (s_bad) {
    result = -1;
  } else if (s_start >= 0) {
    double target = s_target, base = s_base;
    for (int t0 = s_start * chunk; t0 < n; t0 += SAMPLE_THREADS) {
      int i = t0 + tid;
      float v = i < n ? value(i) : 0.0f;
      double x = v > 0.0f ? (double)v : 0.0;
      x = warp_scan_incl(x, lane);
      if (lane == WARP - 1) wsum[w] = x;
      __syncthreads();
      double before = 0.0, all = 0.0;
      for (int k = 0; k < SAMPLE_WARPS; k++) {
        if (k < w) before += wsum[k];
        all += wsum[k];
      }
      int hit = (v > 0.0f && base + before + x > target) ? i : NO_INDEX;
      hit = warp_min_i(hit);
      if (lane == 0) whit[w] = hit;
      __syncthreads();
      int first = NO_INDEX;
      for (int k = 0; k < SAMPLE_WARPS; k++) first = min(first, whit[k]);
      __syncthreads();  // wsum and whit are rewritten by the next trip
      if (first != NO_INDEX) {
        result = first;
        break;
      }
      base += all;
    }
    // Not found: rounding left the cumulative a hair short of the target; the last positive.
  }
  __syncthreads();  // the shared results are read by every thread before any reuse
  return result;
}

// Part totals of the draw. Grid: (parts, rows); block: SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_draw_part(const float* probs, int vocab, int chunk, double* part_mass,
                     int* part_last, int* part_bad) {
  pdl_enter();
  int r = blockIdx.y, parts = gridDim.x;
  RowProbs row = {probs + (size_t)r * vocab};
  int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
  draw_part_impl(row, lo, hi, part_mass, part_last, part_bad, (size_t)r * parts + blockIdx.x);
}

// The draw from the part totals. Grid: rows; block: SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_draw_pick(const float* probs, const double* uniforms, int vocab, int chunk, int parts,
                     const double* part_mass, const int* part_last, const int* part_bad,
                     int* out) {
  pdl_enter();
  int r = blockIdx.x;
  size_t at = (size_t)r * parts;
  RowProbs row = {probs + (size_t)r * vocab};
  float sum;
  int y = draw_pick_impl(row, vocab, chunk, parts, part_mass + at, part_last + at,
                         part_bad + at, uniforms[r], &sum);
  if (threadIdx.x == 0) out[r] = y;
}

// ---------------------------------------------------------------------------------------------
// Speculative verification: cpu::verify::verify_probs with DraftProbs::Sampled per sequence.
//
// Sequence s has gamma_s = q_offsets[s + 1] - q_offsets[s] drafts; its drafts start at
// q_offsets[s], its p rows and uniforms at q_offsets[s] + s (gamma_s + 1 of each). Its q rows
// start at row q_rows[s] of q, or q_rows[s] < 0 for greedy drafts (q a point mass at each
// draft: no rows). The output row out[s][0..width) holds the accepted count then the accepted
// drafts and the correction or bonus token, or a negative VERIFY_* code and its details.
// Grid: sequences; block: SAMPLE_THREADS; width >= gamma_max + 3.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    spec_verify(const float* p, const float* q, const int* drafts, const double* uniforms,
                const int* q_offsets, const int* q_rows, int vocab, int* out, int width) {
  pdl_enter();
  __shared__ DrawSmem s;
  int seq = blockIdx.x, tid = threadIdx.x;
  int q0 = q_offsets[seq], gamma = q_offsets[seq + 1] - q0;
  int p0 = q0 + seq;
  int qr = q_rows[seq];
  const double* u = uniforms + p0;
  int* o = out + (size_t)seq * width;
  // Every draft id is checked before any is accepted, as on the CPU.
  for (int k = 0; k < gamma; k++) {
    int x = drafts[q0 + k];
    if (x < 0 || x >= vocab) {
      if (tid == 0) { o[0] = VERIFY_BAD_ID; o[1] = k; o[2] = x; }
      return;
    }
  }
  float sum;
  for (int k = 0; k < gamma; k++) {
    int x = drafts[q0 + k];
    const float* pk = p + (size_t)(p0 + k) * vocab;
    const float* qk = qr < 0 ? nullptr : q + (size_t)(qr + k) * vocab;
    float qx = qk ? qk[x] : 1.0f;
    if (!(qx > 0.0f && finite_f(qx))) {
      if (tid == 0) { o[0] = VERIFY_ZERO_Q; o[1] = k; o[2] = x; o[3] = (int)ferry_f2u(qx); }
      return;
    }
    if (u[k] * (double)qx < (double)pk[x]) {
      if (tid == 0) o[1 + k] = x;
      continue;
    }
    // Rejected: the correction from norm(max(0, p − q)), else from p when that has no mass.
    int y;
    if (qk) {
      RowResidual res = {pk, qk};
      y = block_draw(res, vocab, u[gamma], s, &sum);
    } else {
      RowResidualGreedy res = {pk, x};
      y = block_draw(res, vocab, u[gamma], s, &sum);
    }
    if (y < 0) {
      RowProbs row = {pk};
      y = block_draw(row, vocab, u[gamma], s, &sum);
    }
    if (tid == 0) {
      if (y < 0) {
        o[0] = VERIFY_DEGENERATE; o[1] = k; o[2] = (int)ferry_f2u(sum);
      } else {
        o[0] = k; o[1 + k] = y;
      }
    }
    return;
  }
  RowProbs bonus = {p + (size_t)(p0 + gamma) * vocab};
  int y = block_draw(bonus, vocab, u[gamma], s, &sum);
  if (tid == 0) {
    if (y < 0) {
      o[0] = VERIFY_DEGENERATE; o[1] = gamma; o[2] = (int)ferry_f2u(sum);
    } else {
      o[0] = gamma; o[1 + gamma] = y;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The same verification for a few sequences, its one draw split over several blocks (see the
// split section above): spec_verify_accept runs each sequence's accept tests (no row scans)
// and leaves a draw job, spec_verify_part sums the job's row in parts, spec_verify_pick draws
// and writes the result row exactly as spec_verify does.

// A draw job, VERIFY_JOB_WORDS ints per sequence.
#define VERIFY_JOB_WORDS 6
// JOB_KIND: -1 none (an error is written); 0 the bonus row p; 1 max(0, p − q); 2 p, x zeroed.
#define JOB_KIND 0
#define JOB_POS 1    // the position drawn at (the rejected draft's, or γ for the bonus)
#define JOB_DRAFT 2  // the rejected greedy draft x (kind 2)
#define JOB_P 3      // the p row
#define JOB_Q 4      // the q row (kind 1)
#define JOB_U 5      // the uniform's index

// The row a job draws from (RowProbs, RowResidual or RowResidualGreedy by kind).
struct JobRow {
  const float* p;
  const float* q;
  int x, kind;
  __device__ __forceinline__ float operator()(int i) const {
    float v = p[i];
    if (kind == 1) return fmaxf(v - q[i], 0.0f);
    if (kind == 2) return i == x ? 0.0f : v;
    return v;
  }
};

__device__ __forceinline__ JobRow job_row(const int* job, const float* p, const float* q,
                                          int vocab) {
  JobRow r;
  r.kind = job[JOB_KIND];
  r.p = p + (size_t)job[JOB_P] * vocab;
  r.q = r.kind == 1 ? q + (size_t)job[JOB_Q] * vocab : nullptr;
  r.x = job[JOB_DRAFT];
  return r;
}

// Grid: sequences; block: one warp (thread 0 works: a sequence's γ accept tests read two
// entries each).
extern "C" __global__ void spec_verify_accept(const float* p, const float* q, const int* drafts,
                                              const double* uniforms, const int* q_offsets,
                                              const int* q_rows, int vocab, int* out, int width,
                                              int* jobs) {
  pdl_enter();
  if (threadIdx.x != 0) return;
  int seq = blockIdx.x;
  int q0 = q_offsets[seq], gamma = q_offsets[seq + 1] - q0;
  int p0 = q0 + seq;
  int qr = q_rows[seq];
  const double* u = uniforms + p0;
  int* o = out + (size_t)seq * width;
  int* job = jobs + (size_t)seq * VERIFY_JOB_WORDS;
  job[JOB_KIND] = -1;
  for (int k = 0; k < gamma; k++) {
    int x = drafts[q0 + k];
    if (x < 0 || x >= vocab) {
      o[0] = VERIFY_BAD_ID; o[1] = k; o[2] = x;
      return;
    }
  }
  job[JOB_U] = p0 + gamma;
  for (int k = 0; k < gamma; k++) {
    int x = drafts[q0 + k];
    const float* pk = p + (size_t)(p0 + k) * vocab;
    float qx = qr < 0 ? 1.0f : q[(size_t)(qr + k) * vocab + x];
    if (!(qx > 0.0f && finite_f(qx))) {
      o[0] = VERIFY_ZERO_Q; o[1] = k; o[2] = x; o[3] = (int)ferry_f2u(qx);
      return;
    }
    if (u[k] * (double)qx < (double)pk[x]) {
      o[1 + k] = x;
      continue;
    }
    job[JOB_KIND] = qr < 0 ? 2 : 1;
    job[JOB_POS] = k;
    job[JOB_DRAFT] = x;
    job[JOB_P] = p0 + k;
    job[JOB_Q] = qr + k;
    return;
  }
  job[JOB_KIND] = 0;
  job[JOB_POS] = gamma;
  job[JOB_DRAFT] = -1;
  job[JOB_P] = p0 + gamma;
  job[JOB_Q] = 0;
}

// Grid: (parts, sequences); block: SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    spec_verify_part(const float* p, const float* q, const int* jobs, int vocab, int chunk,
                     double* part_mass, int* part_last, int* part_bad) {
  pdl_enter();
  int seq = blockIdx.y, parts = gridDim.x;
  const int* job = jobs + (size_t)seq * VERIFY_JOB_WORDS;
  if (job[JOB_KIND] < 0) return;
  JobRow row = job_row(job, p, q, vocab);
  int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
  draw_part_impl(row, lo, hi, part_mass, part_last, part_bad, (size_t)seq * parts + blockIdx.x);
}

// Grid: sequences; block: SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    spec_verify_pick(const float* p, const float* q, const double* uniforms, const int* jobs,
                     int vocab, int chunk, int parts, const double* part_mass,
                     const int* part_last, const int* part_bad, int* out, int width) {
  pdl_enter();
  __shared__ DrawSmem s;
  int seq = blockIdx.x;
  const int* job = jobs + (size_t)seq * VERIFY_JOB_WORDS;
  int kind = job[JOB_KIND];
  if (kind < 0) return;
  int k = job[JOB_POS];
  double u = uniforms[job[JOB_U]];
  size_t at = (size_t)seq * parts;
  float sum;
  JobRow row = job_row(job, p, q, vocab);
  int y = draw_pick_impl(row, vocab, chunk, parts, part_mass + at, part_last + at,
                         part_bad + at, u, &sum);
  if (y < 0 && kind != 0) {
    // The residual has no mass: the correction comes from p (one block; rare).
    RowProbs pk = {row.p};
    y = block_draw(pk, vocab, u, s, &sum);
  }
  if (threadIdx.x == 0) {
    int* o = out + (size_t)seq * width;
    if (y < 0) {
      o[0] = VERIFY_DEGENERATE; o[1] = k; o[2] = (int)ferry_f2u(sum);
    } else {
      o[0] = k; o[1 + k] = y;
    }
  }
}
