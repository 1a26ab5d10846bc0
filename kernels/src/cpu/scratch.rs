//! Per-thread scratch buffers for the CPU kernels' intermediates.
//!
//! A prefill's attention needs a few MB of temporaries per layer (decompressed keys and values,
//! a block of scores). Allocated afresh each time they come from new mappings that the kernel
//! must fault in page by page, and glibc hands them back to the OS on free; keeping them per
//! thread makes every later call reuse warm memory. A buffer is taken out of its thread's pool
//! while in use, so a nested call on the same thread (rayon runs other jobs while one waits)
//! takes another one (or allocates it) instead of aliasing it.

use std::cell::RefCell;

/// Buffers a thread keeps at most (one per nesting level in use at once).
const KEPT: usize = 4;

/// Largest buffer kept for reuse (64 MiB of f32). Larger ones (a long prompt's decompressed
/// keys on a large model) are freed after use as before: faulting them in is small next to the
/// work they serve, and keeping them would hold that memory for the life of the thread.
const KEEP_MAX_FLOATS: usize = 16 << 20;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a zeroed `len`-float buffer, reusing one of this thread's scratch buffers when
/// one is free (a kept buffer's capacity only grows, up to the largest `len` it served, at
/// most [`KEEP_MAX_FLOATS`]).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    buf.clear();
    buf.resize(len, 0.0);
    let out = f(&mut buf);
    POOL.with(|p| {
        let mut pool = p.borrow_mut();
        if pool.len() < KEPT && buf.capacity() <= KEEP_MAX_FLOATS {
            pool.push(buf);
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::with_scratch;

    #[test]
    fn buffers_are_zeroed_reused_and_never_aliased_by_nested_calls() {
        let first = with_scratch(1000, |b| {
            assert!(b.iter().all(|&v| v == 0.0));
            b.fill(7.0);
            b.as_ptr() as usize
        });
        // Reused (same memory), and zeroed again.
        let again = with_scratch(500, |b| {
            assert_eq!(b.len(), 500);
            assert!(b.iter().all(|&v| v == 0.0));
            b.as_ptr() as usize
        });
        assert_eq!(first, again);
        // A buffer over the cap serves its call and is not kept.
        let big = with_scratch(super::KEEP_MAX_FLOATS + 1, |b| b.as_ptr() as usize);
        with_scratch(10, |b| assert_ne!(b.as_ptr() as usize, big));
        // A nested call gets a distinct buffer.
        with_scratch(10, |outer| {
            outer.fill(1.0);
            with_scratch(10, |inner| {
                assert!(inner.iter().all(|&v| v == 0.0));
                assert_ne!(inner.as_ptr(), outer.as_ptr());
                inner.fill(2.0);
            });
            assert!(outer.iter().all(|&v| v == 1.0));
        });
    }
}
