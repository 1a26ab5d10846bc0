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

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a zeroed `len`-float buffer, reusing one of this thread's scratch buffers when
/// one is free (a buffer's capacity only grows, up to the largest `len` it served).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    buf.clear();
    buf.resize(len, 0.0);
    let out = f(&mut buf);
    POOL.with(|p| {
        let mut pool = p.borrow_mut();
        if pool.len() < KEPT {
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
