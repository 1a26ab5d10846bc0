//! The CPU HIP against what a GPU guarantees: kernels compiled through its hipRTC and launched
//! through its `hipModuleLaunchKernel` see their indices, barriers, warp shuffles, shared and
//! dynamic shared memory and atomics behave as on a GPU, and a kernel that breaks the rules (a
//! barrier some threads never reach, `__trap()`) fails its launch instead of hanging.

use std::ffi::{c_char, c_void, CString};

use ferry_hip_emu::*;

const SOURCE: &str = r#"
#define WARP 32
extern "C" __global__ void __launch_bounds__(256) block_sum(const float* x, float* out, int n) {
  __shared__ float partial[32];
  float v = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v += x[i];
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (threadIdx.x % WARP == 0) partial[threadIdx.x / WARP] = v;
  __syncthreads();
  if (threadIdx.x < WARP) {
    float w = threadIdx.x < blockDim.x / WARP ? partial[threadIdx.x] : 0.f;
    for (int m = 16; m > 0; m >>= 1) w += __shfl_xor_sync(0xffffffffu, w, m);
    if (threadIdx.x == 0) out[blockIdx.x] = w;
  }
}
// Lane i gets lane (i + 1) % 32's id; the block's ids reversed through dynamic shared memory.
extern "C" __global__ void rotate_and_reverse(int* rotated, int* reversed) {
  extern __shared__ int ids[];
  const int t = threadIdx.x, lane = t % WARP;
  rotated[blockIdx.x * blockDim.x + t] = __shfl_sync(0xffffffffu, t, (lane + 1) % WARP);
  ids[t] = t;
  __syncthreads();
  reversed[blockIdx.x * blockDim.x + t] = ids[blockDim.x - 1 - t];
}
extern "C" __global__ void count_blocks(unsigned* counter) {
  if (threadIdx.x == 0) atomicAdd(counter, 1u);
}
// Half of each warp waits for the whole warp, the other half for the whole block.
extern "C" __global__ void divergent_barrier(int* out) {
  if (threadIdx.x % WARP < 16) __syncwarp(); else __syncthreads();
  out[threadIdx.x] = 1;
}
extern "C" __global__ void traps(int* out) {
  if (threadIdx.x == 5) __trap();
  out[threadIdx.x] = 1;
}
"#;

/// Compiles `SOURCE` and returns its module.
fn module() -> *mut c_void {
    module_of(&CString::new(SOURCE).unwrap())
}

/// Compiles `src` through the CPU hipRTC and loads it.
fn module_of(src: &CString) -> *mut c_void {
    let mut prog = std::ptr::null_mut();
    // SAFETY: valid strings and out-pointers throughout; the program is destroyed at the end.
    unsafe {
        assert_eq!(
            hiprtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            0
        );
        let opt = CString::new("--offload-arch=gfx90a").unwrap();
        let opts = [opt.as_ptr()];
        let r = hiprtcCompileProgram(prog, 1, opts.as_ptr());
        if r != 0 {
            let mut n = 0;
            hiprtcGetProgramLogSize(prog, &mut n);
            let mut log = vec![0u8; n];
            hiprtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
            panic!("compile failed: {}", String::from_utf8_lossy(&log));
        }
        let mut size = 0;
        assert_eq!(hiprtcGetCodeSize(prog, &mut size), 0);
        let mut code = vec![0u8; size];
        assert_eq!(hiprtcGetCode(prog, code.as_mut_ptr() as *mut c_char), 0);
        hiprtcDestroyProgram(&mut prog);
        let mut m = std::ptr::null_mut();
        assert_eq!(hipModuleLoadData(&mut m, code.as_ptr() as *const c_void), 0);
        m
    }
}

fn function(m: *mut c_void, name: &str) -> *mut c_void {
    let name = CString::new(name).unwrap();
    let mut f = std::ptr::null_mut();
    // SAFETY: a live module and a valid name.
    assert_eq!(unsafe { hipModuleGetFunction(&mut f, m, name.as_ptr()) }, 0);
    f
}

/// Device memory holding `v`.
fn upload<T: Copy>(v: &[T]) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    let bytes = std::mem::size_of_val(v);
    // SAFETY: `p` receives an allocation of `bytes`, then `v`'s bytes.
    unsafe {
        assert_eq!(hipMalloc(&mut p, bytes), 0);
        assert_eq!(hipMemcpyHtoD(p, v.as_ptr() as *mut c_void, bytes), 0);
    }
    p
}

fn download<T: Copy + Default>(p: *mut c_void, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    // SAFETY: `p` holds at least `n` elements (the tests allocate them).
    unsafe {
        assert_eq!(
            hipMemcpyDtoH(
                v.as_mut_ptr() as *mut c_void,
                p,
                n * std::mem::size_of::<T>()
            ),
            0
        )
    };
    v
}

/// Launches `f` with `args` (each a pointer to a parameter's value).
fn launch(f: *mut c_void, grid: u32, block: u32, smem: u32, args: &mut [*mut c_void]) -> i32 {
    // SAFETY: `args` match the kernel's parameters; the buffers they name are live.
    unsafe {
        hipModuleLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            smem,
            std::ptr::null_mut(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

#[test]
fn reductions_shuffles_shared_memory_and_atomics_behave_as_on_a_gpu() {
    let m = module();
    // A grid-strided sum, warp shuffles, then one block's partials.
    let n = 10_000i32;
    let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let (dx, dout) = (upload(&x), upload(&[0f32; 3]));
    let (mut px, mut pout, mut pn) = (dx, dout, n);
    let code = launch(
        function(m, "block_sum"),
        3,
        256,
        0,
        &mut [
            &mut px as *mut _ as *mut c_void,
            &mut pout as *mut _ as *mut c_void,
            &mut pn as *mut _ as *mut c_void,
        ],
    );
    assert_eq!(code, 0);
    let sums: Vec<f32> = download(dout, 3);
    let want: f32 = x.iter().sum();
    assert_eq!(sums.iter().sum::<f32>(), want, "block sums {sums:?}");

    // Shuffles by source lane, and dynamic shared memory seen by the whole block.
    let (rot, rev) = (upload(&[0i32; 2 * 96]), upload(&[0i32; 2 * 96]));
    let (mut prot, mut prev) = (rot, rev);
    let code = launch(
        function(m, "rotate_and_reverse"),
        2,
        96,
        96 * 4,
        &mut [
            &mut prot as *mut _ as *mut c_void,
            &mut prev as *mut _ as *mut c_void,
        ],
    );
    assert_eq!(code, 0);
    let (rotated, reversed): (Vec<i32>, Vec<i32>) = (download(rot, 192), download(rev, 192));
    for b in 0..2 {
        for t in 0..96 {
            let warp_base = t / 32 * 32;
            assert_eq!(rotated[b * 96 + t], (warp_base + (t % 32 + 1) % 32) as i32);
            assert_eq!(reversed[b * 96 + t], (95 - t) as i32);
        }
    }

    // Atomics from blocks that run side by side.
    let counter = upload(&[0u32]);
    let mut pc = counter;
    assert_eq!(
        launch(
            function(m, "count_blocks"),
            500,
            64,
            0,
            &mut [&mut pc as *mut _ as *mut c_void]
        ),
        0
    );
    assert_eq!(download::<u32>(counter, 1), vec![500]);
    // SAFETY: allocated above, freed once.
    unsafe {
        for p in [dx, dout, rot, rev, counter] {
            assert_eq!(hipFree(p), 0);
        }
        assert_eq!(hipModuleUnload(m), 0);
    }
}

#[test]
fn a_barrier_some_threads_never_reach_and_a_trap_fail_the_launch() {
    let m = module();
    let out = upload(&[0i32; 128]);
    let mut p = out;
    // Lanes 0-15 of each warp wait for lanes that wait at a block barrier: the hardware would
    // hang or worse.
    let code = launch(
        function(m, "divergent_barrier"),
        1,
        128,
        0,
        &mut [&mut p as *mut _ as *mut c_void],
    );
    assert_ne!(code, 0, "a divergent barrier launched fine");
    let code = launch(
        function(m, "traps"),
        2,
        64,
        0,
        &mut [&mut p as *mut _ as *mut c_void],
    );
    assert_ne!(code, 0, "__trap() launched fine");
    // The device still works after failed launches.
    let counter = upload(&[0u32]);
    let mut pc = counter;
    assert_eq!(
        launch(
            function(m, "count_blocks"),
            3,
            32,
            0,
            &mut [&mut pc as *mut _ as *mut c_void]
        ),
        0
    );
    assert_eq!(download::<u32>(counter, 1), vec![3]);
}

/// A race a GPU may or may not show: thread t reads the shared slot thread t + 1 writes, with
/// no barrier between. Fibers run one after another between barriers, so in forward order
/// (the default) thread t reads the old value, and in reverse order (`FERRY_HIP_EMU_ORDER=
/// reverse`) the new one. The two orders disagree, which is how `scripts/hip_emu.sh`, running
/// the contract tests in both, turns such a race into a failure.
#[test]
fn the_fiber_order_decides_what_a_missing_barrier_reads() {
    let src = CString::new(
        r#"
extern "C" __global__ void racy_neighbour(int* out) {
  __shared__ int slot[64];
  slot[threadIdx.x] = 0;
  __syncthreads();
  slot[threadIdx.x] = (int)threadIdx.x + 1;
  out[threadIdx.x] = slot[(threadIdx.x + 1) % 64];  // no barrier before: a race
}
"#,
    )
    .unwrap();
    let m = module_of(&src);
    let out = upload(&[-1i32; 64]);
    let mut p = out;
    assert_eq!(
        launch(
            function(m, "racy_neighbour"),
            1,
            64,
            0,
            &mut [&mut p as *mut _ as *mut c_void]
        ),
        0
    );
    let got: Vec<i32> = download(out, 64);
    let reverse = std::env::var("FERRY_HIP_EMU_ORDER").is_ok_and(|v| v == "reverse");
    let want: Vec<i32> = (0..64)
        .map(|t| match (reverse, t) {
            // Forward: t + 1 has not written yet, except thread 0, which wrote before 63 ran.
            (false, 63) => 1,
            (false, _) => 0,
            // Reverse: t + 1 wrote already, except thread 0, which runs last.
            (true, 63) => 0,
            (true, t) => t + 2,
        })
        .collect();
    assert_eq!(got, want, "reverse order: {reverse}");
}

/// Device buffers end at an inaccessible page: a kernel reading past the end (by more than the
/// rounding to 256 bytes) faults at once, as it may on a GPU. The fault kills the process, so
/// the launch runs in a child process (this test binary again) and the parent checks that it
/// died of SIGSEGV.
#[test]
fn reading_past_a_buffer_faults() {
    const CHILD: &str = "FERRY_HIP_EMU_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let src = CString::new(
            r#"
extern "C" __global__ void read_at(const float* x, int i, float* out) { out[0] = x[i]; }
"#,
        )
        .unwrap();
        let m = module_of(&src);
        let (x, out) = (upload(&[1.0f32; 64]), upload(&[0f32]));
        let (mut px, mut pout) = (x, out);
        // The last element is fine; 64 floats are exactly 256 bytes, so one past the end is on
        // the guard page.
        for mut i in [63i32, 64] {
            let mut args = [
                &mut px as *mut _ as *mut c_void,
                &mut i as *mut _ as *mut c_void,
                &mut pout as *mut _ as *mut c_void,
            ];
            assert_eq!(launch(function(m, "read_at"), 1, 1, 0, &mut args), 0);
            assert_eq!(download::<f32>(out, 1), vec![1.0]);
        }
        std::process::exit(0);
    }
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "reading_past_a_buffer_faults", "--nocapture"])
        .env(CHILD, "1")
        .status()
        .expect("the child runs");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(libc::SIGSEGV),
        "the out-of-bounds read did not fault: {status}"
    );
}
