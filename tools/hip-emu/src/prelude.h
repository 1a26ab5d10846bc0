// prelude.h: what a CUDA/HIP kernel source needs to compile as C++ for the CPU and run under
// ferry-hip-emu's block scheduler (src/fiber.rs). ferry-hip-emu's hipRTC puts this in front of
// the source it is given (compat.cuh + a `gpu/*.cu` file); compat.cuh then takes its CUDA
// branch without `__CUDA_ARCH__`, i.e. the portable scalar paths (FERRY_MMA 0, no PTX).
//
// Every GPU thread of a block is a fiber on one OS thread (blocks run side by side, one OS
// thread each), so:
// - `__shared__` variables are `static thread_local`: one instance per OS thread, shared by
//   the fibers of the block it runs;
// - `__syncthreads()` / `__syncwarp()` / the shuffles suspend the fiber until every live
//   thread of the block / warp (32 lanes) has arrived; a barrier some live threads never reach
//   fails the launch instead of hanging;
// - atomics are the host's atomics (blocks run side by side).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <type_traits>
#include <utility>

struct uint3 {
  unsigned x, y, z;
};
typedef uint3 dim3;

// What the scheduler keeps per fiber (layout shared with src/fiber.rs `Ctx`).
struct FerryEmuCtx {
  uint3 thread_idx;
  uint3 block_idx;
  uint3 block_dim;
  uint3 grid_dim;
  unsigned linear;  // thread index within the block
  unsigned lane;    // linear % 32
  void* dyn_smem;
  unsigned long long* exchange;  // two slots per thread of the block (shuffles)
  void* yielder;
  unsigned shuffles;  // this thread's shuffles so far (which exchange slot is next)
};

// The running fiber's context. `const`: a fiber always gets its own, unchanged for the launch,
// so the compiler may call it once per function.
extern "C" __attribute__((const)) FerryEmuCtx* ferry_emu_ctx();
extern "C" void ferry_emu_syncthreads();
extern "C" void ferry_emu_syncwarp();
extern "C" void ferry_emu_trap();

#define threadIdx (ferry_emu_ctx()->thread_idx)
#define blockIdx (ferry_emu_ctx()->block_idx)
#define blockDim (ferry_emu_ctx()->block_dim)
#define gridDim (ferry_emu_ctx()->grid_dim)

#ifdef FERRY_EMU_SCAN
#define __global__ FERRY_EMU_KERNEL
#else
#define __global__ __attribute__((visibility("default")))
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local

inline void __syncthreads() { ferry_emu_syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ferry_emu_syncwarp(); }
inline void __threadfence() {}
[[noreturn]] inline void __trap() {
  ferry_emu_trap();
  __builtin_unreachable();
}

// A shuffle: each lane writes its value, the warp meets, each lane reads its source lane's.
// Shuffles alternate between two exchange buffers, so one barrier each is enough: a lane
// writes a buffer again only two shuffles later, after a barrier every lane reached once done
// reading it (a warp's lanes execute the same shuffles, as CUDA requires with a full mask).
template <class T>
inline T ferry_emu_shfl_at(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
  FerryEmuCtx* c = ferry_emu_ctx();
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const size_t threads = (size_t)c->block_dim.x * c->block_dim.y * c->block_dim.z;
  unsigned long long* ex = c->exchange + (c->shuffles++ & 1u) * threads;
  ex[c->linear] = bits;
  ferry_emu_syncwarp();
  unsigned long long r = ex[c->linear - c->lane + (src_lane & 31u)];
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
  return ferry_emu_shfl_at(v, ferry_emu_ctx()->lane ^ (unsigned)m);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  return ferry_emu_shfl_at(v, (unsigned)src);
}

template <class To, class From>
inline To ferry_emu_bits(From f) {
  static_assert(sizeof(To) == sizeof(From), "bit cast between sizes");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}
inline float __int_as_float(int i) { return ferry_emu_bits<float>(i); }
inline float __uint_as_float(unsigned u) { return ferry_emu_bits<float>(u); }
inline unsigned __float_as_uint(float f) { return ferry_emu_bits<unsigned>(f); }
inline int __float_as_int(float f) { return ferry_emu_bits<int>(f); }

template <class A, class B>
inline typename std::common_type<A, B>::type min(A a, B b) {
  typedef typename std::common_type<A, B>::type T;
  return (T)b < (T)a ? (T)b : (T)a;
}
template <class A, class B>
inline typename std::common_type<A, B>::type max(A a, B b) {
  typedef typename std::common_type<A, B>::type T;
  return (T)a < (T)b ? (T)b : (T)a;
}

template <class T>
inline T __ldg(const T* p) {
  return *p;
}
// Blocks run side by side on OS threads: atomics are the host's.
template <class T>
inline T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  } else {
    T old = *p, want;
    do {
      want = old + v;
    } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
  }
}

struct __attribute__((aligned(8))) float2 {
  float x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// Calls kernel `f` with the parameters `a[i]` points at (hipModuleLaunchKernel's
// kernelParams), once per fiber.
template <class... A, std::size_t... I>
inline void ferry_emu_call(void (*f)(A...), void** a, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_cv<typename std::remove_reference<A>::type>::type*>(a[I])...);
}
template <class... A>
inline void ferry_emu_invoke(void (*f)(A...), void** a) {
  ferry_emu_call(f, a, std::index_sequence_for<A...>{});
}
