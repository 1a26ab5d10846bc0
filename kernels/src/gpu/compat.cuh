// compat.cuh: the few definitions that differ between CUDA (NVRTC) and HIP (hipRTC).
//
// Every kernel source in this folder is written once against these names. The Rust side
// prepends this file to each source before handing it to NVRTC or hipRTC (neither compiler
// is given an include path), so the sources never include a system header.
//
// Conventions:
// - bf16 travels as raw `bf16_t` (unsigned short) bits; the helpers below widen (exact) and
//   round to nearest even. No vendor bf16 header is needed on either side.
// - A "warp" is 32 lanes everywhere. On AMD (64-lane wavefronts) the shuffles take width 32,
//   so a wavefront behaves as two independent 32-lane warps.
// - FERRY_MMA is 1 where the tensor-core path (PTX mma.sync / ldmatrix / cp.async, sm_80+) is
//   available; other targets compile the scalar path of the same kernels.
#pragma once

#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define FERRY_HIP 1
#define FERRY_MMA 0
#define SHFL_XOR(v, m) __shfl_xor((v), (m), 32)
#define SHFL(v, src) __shfl((v), (src), 32)
// A warp is half a 64-lane wavefront or a whole 32-lane one; both execute in lockstep, so the
// barrier orders the wavefront's shared-memory accesses (fences) and code motion (as HIP's own
// __syncwarp does since ROCm 6.2).
#define __syncwarp()                                    \
  do {                                                  \
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront"); \
    __builtin_amdgcn_wave_barrier();                    \
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront"); \
  } while (0)
__device__ __forceinline__ float ferry_u2f(unsigned u) { return __builtin_bit_cast(float, u); }
__device__ __forceinline__ unsigned ferry_f2u(float f) { return __builtin_bit_cast(unsigned, f); }
#else
#define FERRY_HIP 0
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FERRY_MMA 1
#else
#define FERRY_MMA 0
#endif
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src))
__device__ __forceinline__ float ferry_u2f(unsigned u) { return __uint_as_float(u); }
__device__ __forceinline__ unsigned ferry_f2u(float f) { return __float_as_uint(f); }
#endif

#define FERRY_INF __int_as_float(0x7f800000)
#define WARP 32

// Programmatic dependent launch (sm_90+, CUDA). The host launches every kernel with the
// programmatic-stream-serialization attribute (kernels/src/cuda/context.rs), which lets a
// kernel's blocks start while the kernel before it in the stream is still running. So every
// kernel's first statement is `pdl_enter()`: `griddepcontrol.wait` blocks until the previous
// grid has completed and its writes are visible (so nothing a kernel reads or writes can race
// with its predecessor), then `griddepcontrol.launch_dependents` lets the next kernel's blocks
// be scheduled now, into the slots this grid leaves free, instead of after it retires. A
// kernel may do work that touches no data another kernel writes (e.g. prefetch its weights
// into L2) before `pdl_enter()`. Without the attribute (FERRY_PDL=0, graphs captured without
// it, other vendors) both instructions are no-ops.
#if !FERRY_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Pulls `bytes` from `p` into L2 (128-byte lines, spread over the calling warp's lanes).
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = (size_t)(threadIdx.x % WARP) * 128; o < bytes; o += WARP * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
}
// Asks the copy engine (TMA) to pull `bytes` from `p` into L2, without waiting (sm_90's bulk
// prefetch: `p` 16-byte aligned, `bytes` a multiple of 16). LAST marks the lines evict-last,
// so streams that pass through L2 before their reader evict other lines first.
template <bool LAST>
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, unsigned bytes) {
  if (LAST) {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p),
                 "r"(bytes), "l"(policy)
                 : "memory");
  } else {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
  }
}
#else
__device__ __forceinline__ void pdl_enter() {}
__device__ __forceinline__ void prefetch_l2(const void*, size_t) {}
template <bool LAST>
__device__ __forceinline__ void prefetch_l2_bulk(const void*, unsigned) {}
#endif

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf2f(bf16_t h) { return ferry_u2f(((unsigned)h) << 16); }

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16_t f2bf(float f) {
  unsigned u = ferry_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16_t)(u >> 16);
}

// Two floats as one packed bf16x2 register (low half = first), round to nearest even: one
// cvt instruction on sm_80+, the integer path elsewhere.
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
#if FERRY_MMA
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
#endif
}

#if FERRY_MMA
// c += a(16x16, row) · b(16x8, col), bf16 in, f32 accumulate (tensor cores, sm_80+).
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Shared-memory addresses, ldmatrix and cp.async (the attention and the pipelined expert
// kernels).
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
               : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// 16-byte global → shared copy; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;"); }
#endif

// 2^x for softmax weights: the hardware approximation (2 ulp) on CUDA; exp2f elsewhere.
// exp2(-inf) = 0 either way.
__device__ __forceinline__ float fast_exp2(float x) {
#if FERRY_MMA
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return exp2f(x);
#endif
}

// Element loads that widen to float, for templates over the stored type.
__device__ __forceinline__ float ld_f(const float* p) { return *p; }
__device__ __forceinline__ float ld_f(const bf16_t* p) { return bf2f(*p); }
__device__ __forceinline__ void st_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void st_f(bf16_t* p, float v) { *p = f2bf(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += SHFL_XOR(v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, SHFL_XOR(v, m));
  return v;
}

__device__ __forceinline__ float silu_f(float v) { return v / (1.0f + expf(-v)); }
