//! Runs one kernel launch: the grid's blocks spread over one OS thread per core (the calling
//! thread among them), each block's threads as fibers (stackful coroutines, `corosensei`) on
//! one OS thread, switched at barriers.
//!
//! A fiber runs until it reaches a barrier (`__syncthreads`, `__syncwarp` or a shuffle) or
//! returns. When no fiber can run, the scheduler releases a barrier: a block barrier once every
//! live thread of the block waits at one, a warp barrier once every live lane of that warp (32
//! lanes, as on CUDA and as ferry's kernels treat a HIP wavefront) waits at one. Threads that
//! returned count as arrived, as on the hardware. If nothing can be released, some thread waits
//! at a barrier its block or warp never reaches: the launch fails with the block and each
//! thread's state instead of hanging. Shared memory is `static thread_local` in the kernel's
//! code (prelude.h), so running a block's fibers on one OS thread makes it the block's; atomics
//! are real atomics, since blocks run side by side.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};

/// Stack of one GPU thread. Kernels keep small arrays in registers; 256 KiB leaves room for
/// the deepest of them (mmap'd lazily, with a guard page).
const STACK_BYTES: usize = 256 * 1024;

/// A kernel's trampoline in a compiled module: calls the kernel with `kernelParams`.
pub type Trampoline = unsafe extern "C" fn(*mut *mut c_void);

/// Three-dimensional sizes and indices, as `dim3` / `uint3` (prelude.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl Dim3 {
    fn count(self) -> usize {
        self.x as usize * self.y as usize * self.z as usize
    }
}

/// What a fiber's kernel code reads through `ferry_emu_ctx()` (layout: `FerryEmuCtx` in
/// prelude.h).
#[repr(C)]
struct Ctx {
    thread_idx: Dim3,
    block_idx: Dim3,
    block_dim: Dim3,
    grid_dim: Dim3,
    linear: u32,
    lane: u32,
    dyn_smem: *mut c_void,
    exchange: *mut u64,
    yielder: *const Yielder<(), Wait>,
    shuffles: u32,
}

/// Why a fiber stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    Block,
    Warp,
    Trap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Ready,
    At(Wait),
    Done,
}

thread_local! {
    /// The running fiber's context (null outside a launch).
    static CURRENT: Cell<*mut Ctx> = const { Cell::new(std::ptr::null_mut()) };
    /// Stacks of finished fibers, reused by the next block.
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
}

fn current() -> *mut Ctx {
    let c = CURRENT.with(Cell::get);
    assert!(
        !c.is_null(),
        "a GPU builtin was called outside a kernel launch"
    );
    c
}

fn suspend(w: Wait) {
    let c = current();
    // SAFETY: `c` is the running fiber's context, set by the scheduler before it resumed the
    // fiber; its yielder belongs to that fiber's coroutine, which is running now.
    unsafe { (*(*c).yielder).suspend(w) };
}

/// `ferry_emu_ctx()`: the running fiber's indices and block resources.
#[no_mangle]
pub extern "C" fn ferry_emu_ctx() -> *mut c_void {
    current() as *mut c_void
}

/// `__syncthreads()`.
#[no_mangle]
pub extern "C" fn ferry_emu_syncthreads() {
    suspend(Wait::Block);
}

/// `__syncwarp()` (and each half of a shuffle).
#[no_mangle]
pub extern "C" fn ferry_emu_syncwarp() {
    suspend(Wait::Warp);
}

/// `__trap()`: the launch fails.
#[no_mangle]
pub extern "C" fn ferry_emu_trap() {
    suspend(Wait::Trap);
}

/// A failed launch: which block, and why.
#[derive(Debug)]
pub struct LaunchError(pub String);

/// One launch's shape.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub grid: Dim3,
    pub block: Dim3,
    pub smem: usize,
}

/// Runs `kernel(params)` over the grid; returns once every block has finished.
///
/// # Safety
/// `kernel` must be a trampoline of a loaded module and `params` its kernel's parameters, as
/// `hipModuleLaunchKernel` takes them; the kernel may read and write any memory its pointers
/// name, like a GPU would.
pub unsafe fn run(
    kernel: Trampoline,
    params: *mut *mut c_void,
    l: Launch,
) -> Result<(), LaunchError> {
    let threads = l.block.count();
    if threads == 0 || threads > 1024 || l.grid.count() == 0 {
        return Err(LaunchError(format!(
            "bad launch shape: grid {:?}, block {:?}",
            l.grid, l.block
        )));
    }
    let count = l.grid.count();
    let (gx, gy) = (l.grid.x as usize, l.grid.y as usize);
    let block_at = |i: usize| Dim3 {
        x: (i % gx) as u32,
        y: ((i / gx) % gy) as u32,
        z: (i / (gx * gy)) as u32,
    };
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(count);
    let grid = Grid {
        kernel: kernel as usize,
        params: params as usize,
        launch: l,
    };
    // Each worker takes the next block until none is left or one failed. Blocks of a grid run
    // in no set order on a GPU, so running them side by side on OS threads is faithful; a
    // worker's `static thread_local` shared memory is its blocks'.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(None::<LaunchError>);
    let work = || {
        let mut scratch = Scratch::new(l.smem, threads);
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let stop = failed.lock().map_or(true, |f| f.is_some());
            if i >= count || stop {
                break;
            }
            // SAFETY: forwarded from the caller.
            if let Err(e) = unsafe { run_block(grid, block_at(i), &mut scratch) } {
                if let Ok(mut f) = failed.lock() {
                    f.get_or_insert(e);
                }
                break;
            }
        }
    };
    if workers <= 1 {
        work();
    } else {
        std::thread::scope(|s| {
            for _ in 1..workers {
                s.spawn(work);
            }
            work();
        });
    }
    match failed.into_inner() {
        Ok(None) => Ok(()),
        Ok(Some(e)) => Err(e),
        Err(_) => Err(LaunchError("a block worker panicked".into())),
    }
}

/// A launch as the block workers share it: the trampoline and parameter array as addresses
/// (valid for the whole launch, see [`run`]), and the shape.
#[derive(Clone, Copy)]
struct Grid {
    kernel: usize,
    params: usize,
    launch: Launch,
}

/// One worker's per-block memory, reused block after block.
struct Scratch {
    smem: Vec<u8>,
    /// Two slots per thread: shuffles alternate between two buffers (prelude.h).
    exchange: Vec<u64>,
}

impl Scratch {
    fn new(smem_bytes: usize, threads: usize) -> Self {
        Self {
            // Dynamic shared memory starts as garbage (0xFF bytes: NaN as f32), as on a GPU it
            // holds whatever the last block left: a kernel that reads it before writing shows.
            smem: vec![0xFFu8; smem_bytes.max(1) + 256],
            exchange: vec![0u64; 2 * threads],
        }
    }

    /// The dynamic shared memory, 256-byte aligned.
    fn smem_at(&mut self) -> *mut c_void {
        let at = self.smem.as_ptr().align_offset(256);
        self.smem.as_mut_ptr().wrapping_add(at) as *mut c_void
    }
}

struct Fiber {
    co: Coroutine<(), Wait, (), DefaultStack>,
    ctx: Box<Ctx>,
    state: State,
}

/// Runs one block to completion.
///
/// # Safety
/// As [`run`], for `grid`'s trampoline and parameters.
unsafe fn run_block(grid: Grid, block: Dim3, scratch: &mut Scratch) -> Result<(), LaunchError> {
    let (l, b) = (grid.launch, grid.launch.block);
    let mut fibers: Vec<Fiber> = Vec::with_capacity(b.count());
    let (params_addr, kernel_addr) = (grid.params, grid.kernel);
    let (dyn_smem, exchange) = (scratch.smem_at(), scratch.exchange.as_mut_ptr());
    for tz in 0..b.z {
        for ty in 0..b.y {
            for tx in 0..b.x {
                let linear = tx + b.x * (ty + b.y * tz);
                let mut ctx = Box::new(Ctx {
                    thread_idx: Dim3 {
                        x: tx,
                        y: ty,
                        z: tz,
                    },
                    block_idx: block,
                    block_dim: b,
                    grid_dim: l.grid,
                    linear,
                    lane: linear % 32,
                    dyn_smem,
                    exchange,
                    yielder: std::ptr::null(),
                    shuffles: 0,
                });
                let ctx_addr = &mut *ctx as *mut Ctx as usize;
                let stack = STACKS
                    .with(|s| s.borrow_mut().pop())
                    .map_or_else(|| DefaultStack::new(STACK_BYTES), Ok)
                    .map_err(|e| LaunchError(format!("fiber stack: {e}")))?;
                let co = Coroutine::with_stack(stack, move |y: &Yielder<(), Wait>, ()| {
                    // SAFETY: the context is boxed and outlives the coroutine (both live in
                    // `fibers` until the block ends); the trampoline and parameters are the
                    // caller's, valid for the whole launch.
                    unsafe {
                        (*(ctx_addr as *mut Ctx)).yielder = y as *const _;
                        let k: Trampoline = std::mem::transmute::<usize, Trampoline>(kernel_addr);
                        k(params_addr as *mut *mut c_void);
                    }
                });
                fibers.push(Fiber {
                    co,
                    ctx,
                    state: State::Ready,
                });
            }
        }
    }
    let result = schedule(&mut fibers, block);
    for mut f in fibers {
        if f.state != State::Done {
            // SAFETY: the fiber is suspended at a barrier of a failed launch; its stack holds
            // only the kernel's plain locals (no destructors to run), so it is dropped
            // without unwinding.
            unsafe { f.co.force_reset() };
        }
        let stack = f.co.into_stack();
        STACKS.with(|s| s.borrow_mut().push(stack));
    }
    result
}

fn schedule(fibers: &mut [Fiber], block: Dim3) -> Result<(), LaunchError> {
    let prev = CURRENT.with(Cell::get);
    let out = schedule_inner(fibers, block);
    CURRENT.with(|c| c.set(prev));
    out
}

/// Resumes ready fibers until all returned, releasing barriers between rounds. Counts are kept
/// as fibers stop, so a round costs the fibers it resumes plus one pass over the warps.
fn schedule_inner(fibers: &mut [Fiber], block: Dim3) -> Result<(), LaunchError> {
    let n = fibers.len();
    let warps = n.div_ceil(32);
    let mut warp_wait = vec![0usize; warps];
    let mut warp_done = vec![0usize; warps];
    let (mut at_block, mut done) = (0usize, 0usize);
    let mut ready: Vec<usize> = (0..n).collect();
    let reverse = reverse_order();
    loop {
        if reverse {
            ready.reverse();
        }
        for &i in &ready {
            let f = &mut fibers[i];
            CURRENT.with(|c| c.set(&mut *f.ctx as *mut Ctx));
            f.state = match f.co.resume(()) {
                CoroutineResult::Yield(Wait::Trap) => {
                    f.state = State::At(Wait::Trap);
                    return Err(LaunchError(format!(
                        "block {block:?}: thread {i} called __trap()"
                    )));
                }
                CoroutineResult::Yield(Wait::Block) => {
                    at_block += 1;
                    State::At(Wait::Block)
                }
                CoroutineResult::Yield(Wait::Warp) => {
                    warp_wait[i / 32] += 1;
                    State::At(Wait::Warp)
                }
                CoroutineResult::Return(()) => {
                    done += 1;
                    warp_done[i / 32] += 1;
                    State::Done
                }
            };
        }
        ready.clear();
        if done == n {
            return Ok(());
        }
        if at_block + done == n {
            // Every live thread is at a block barrier.
            for (i, f) in fibers.iter_mut().enumerate() {
                if f.state == State::At(Wait::Block) {
                    f.state = State::Ready;
                    ready.push(i);
                }
            }
            at_block = 0;
            continue;
        }
        for w in 0..warps {
            let lanes = 32.min(n - 32 * w);
            if warp_wait[w] > 0 && warp_wait[w] + warp_done[w] == lanes {
                for (i, f) in fibers.iter_mut().enumerate().skip(32 * w).take(lanes) {
                    if f.state == State::At(Wait::Warp) {
                        f.state = State::Ready;
                        ready.push(i);
                    }
                }
                warp_wait[w] = 0;
            }
        }
        if ready.is_empty() {
            return Err(LaunchError(format!(
                "block {block:?}: barrier never completes (divergent __syncthreads / __syncwarp / \
                 shuffle): {}",
                describe(fibers)
            )));
        }
    }
}

/// Whether a block's ready fibers run from the highest thread index down
/// (`FERRY_HIP_EMU_ORDER=reverse`) instead of up.
///
/// Between two barriers the fibers run one after another, so a thread that reads shared
/// memory another thread writes with no barrier between sees the write if the writer runs
/// first. A GPU gives no such order: running the tests in both orders makes such a race fail
/// one of them, whichever thread has the lower index.
fn reverse_order() -> bool {
    static REVERSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REVERSE.get_or_init(|| std::env::var("FERRY_HIP_EMU_ORDER").is_ok_and(|v| v == "reverse"))
}

/// Runs of threads in the same state, e.g. `0-31 warp barrier, 32-255 block barrier`.
fn describe(fibers: &[Fiber]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut start = 0;
    for i in 1..=fibers.len() {
        if i == fibers.len() || fibers[i].state != fibers[start].state {
            let what = match fibers[start].state {
                State::Ready => "ready",
                State::At(Wait::Block) => "block barrier",
                State::At(Wait::Warp) => "warp barrier",
                State::At(Wait::Trap) => "trap",
                State::Done => "returned",
            };
            out.push(format!("threads {}-{} {what}", start, i - 1));
            start = i;
        }
    }
    out.join(", ")
}
