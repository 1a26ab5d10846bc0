//! Registered memory: where a region's blocks live, so a transport can put bytes straight into
//! them instead of calling back into the region.
//!
//! A [`KvRegion`](crate::KvRegion) describes each layer's memory with a [`LayerMemory`]:
//!
//! - [`LayerMemory::Host`]: host memory every transport writes into directly (TCP and
//!   in-process copy the received bytes there, UCX puts them there one-sidedly).
//! - [`LayerMemory::Cuda`]: device memory; a transport that can reach it (UCX with CUDA
//!   support: `cuda_copy`, `cuda_ipc`) puts into it directly, the others stage the bytes through
//!   [`KvRegion::write`](crate::KvRegion::write) (the region copies them host → device).
//! - [`LayerMemory::Staged`]: no memory is exposed; every transport goes through `write`.
//!
//! Layer `l`'s memory holds `num_blocks` blocks of [`block_bytes`](crate::KvLayoutDesc::block_bytes)
//! each, block `b` at offset `b × block_bytes`.
//!
//! Making a `Host` or `Cuda` value is `unsafe`: it promises that the memory stays valid, and is
//! written only by the transport, in blocks the region admits
//! ([`KvRegion::admit`](crate::KvRegion::admit)), while the region is registered. [`HostMemory`]
//! is an owned allocation that keeps that promise for as long as any clone of it lives.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

/// Where one layer's blocks live (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerMemory {
    /// Host memory.
    Host(Span),
    /// CUDA device memory of `device`.
    Cuda {
        /// The device allocation.
        span: Span,
        /// CUDA device ordinal.
        device: i32,
    },
    /// Not exposed: blocks arrive through [`KvRegion::write`](crate::KvRegion::write).
    Staged,
}

/// A range of memory: an address (host or device) and a length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    addr: u64,
    len: usize,
}

impl Span {
    /// The start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the span is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl LayerMemory {
    /// Host memory at `ptr..ptr + len`.
    ///
    /// # Safety
    /// The memory must stay allocated, and be written by nothing but transports (in blocks the
    /// region admits) and the region's owner (in blocks no transfer is writing), for as long
    /// as the region that returns this value is registered.
    pub unsafe fn host(ptr: *mut u8, len: usize) -> Self {
        LayerMemory::Host(Span {
            addr: ptr as u64,
            len,
        })
    }

    /// CUDA device memory at `addr..addr + len` on `device`.
    ///
    /// # Safety
    /// As for [`LayerMemory::host`], for the device allocation.
    pub unsafe fn cuda(addr: u64, len: usize, device: i32) -> Self {
        LayerMemory::Cuda {
            span: Span { addr, len },
            device,
        }
    }

    /// The host bytes `offset..offset + len` of this layer, to receive a block run into in
    /// place; `None` for device or staged memory, or a range outside the span.
    ///
    /// # Safety
    /// The caller must have admitted every block of the range for its transfer (so nothing else
    /// reads or writes those bytes until the transfer's flush is acknowledged, as for
    /// [`Self::land_host`]), and must drop the slice before then.
    #[allow(clippy::mut_from_ref)] // the memory is the region's, not `self`'s: see above
    pub(crate) unsafe fn host_slice_mut(&self, offset: usize, len: usize) -> Option<&mut [u8]> {
        let LayerMemory::Host(span) = self else {
            return None;
        };
        if offset.checked_add(len).is_none_or(|end| end > span.len) {
            return None;
        }
        // SAFETY: in range of a span whose validity `LayerMemory::host`'s caller promised; this
        // function's caller promises no other access to the range while the slice lives.
        Some(unsafe { std::slice::from_raw_parts_mut((span.addr as *mut u8).add(offset), len) })
    }

    /// Copies `data` to `offset` in host memory; `false` (nothing copied) for device or staged
    /// memory, or a range outside the span.
    ///
    /// Transports call it only for a checked, admitted block write.
    pub(crate) fn land_host(&self, offset: usize, data: &[u8]) -> bool {
        let LayerMemory::Host(span) = self else {
            return false;
        };
        if offset
            .checked_add(data.len())
            .is_none_or(|end| end > span.len)
        {
            return false;
        }
        // SAFETY: in range of a span whose validity `LayerMemory::host`'s caller promised; the
        // region admitted this block, so nothing else writes or reads these bytes now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (span.addr as *mut u8).add(offset),
                data.len(),
            );
        }
        true
    }
}

/// A zeroed, page-aligned host allocation shared by clones, freed when the last one drops: the
/// memory behind a [`LayerMemory::Host`] for regions that own their bytes (tests, benchmarks,
/// staging buffers, a decode worker's pool). Page alignment keeps registration (`ucp_mem_map`,
/// pinning) cheap. It comes from the heap ([`HostMemory::zeroed`]) or from a transport
/// ([`Transport::alloc_host`](crate::Transport::alloc_host): UCX's shared memory, which a
/// writer on the same machine copies into directly).
#[derive(Clone)]
pub struct HostMemory(Arc<Allocation>);

struct Allocation {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
}

/// Who frees an [`Allocation`].
enum Owner {
    /// `std::alloc` with this layout.
    Heap(Layout),
    /// Whatever allocated it: freed when this value drops.
    Foreign(#[allow(dead_code)] Box<dyn Send + Sync>),
}

// SAFETY: the allocation is plain bytes; every access is a raw copy whose exclusivity the
// users arrange (see the module docs).
unsafe impl Send for Allocation {}
// SAFETY: as above.
unsafe impl Sync for Allocation {}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Owner::Heap(layout) = self.owner {
            // SAFETY: allocated in `HostMemory::zeroed` with this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
        // A foreign owner frees its memory when it drops, after this.
    }
}

/// Alignment of [`HostMemory`].
pub(crate) const PAGE: usize = 4096;

impl HostMemory {
    /// `len` zero bytes (at least one byte is allocated).
    pub fn zeroed(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .unwrap_or_else(|_| alloc::handle_alloc_error(Layout::new::<u8>()));
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        HostMemory(Arc::new(Allocation {
            ptr,
            len: layout.size(),
            owner: Owner::Heap(layout),
        }))
    }

    /// `len` bytes at `ptr` that `owner` frees when it drops (after the last clone of the
    /// returned value).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be zeroed (or initialised), writable host memory, aligned to
    /// 4,096 bytes, that stays valid until `owner` drops and that nothing else frees.
    pub unsafe fn from_owner(ptr: NonNull<u8>, len: usize, owner: Box<dyn Send + Sync>) -> Self {
        HostMemory(Arc::new(Allocation {
            ptr,
            len,
            owner: Owner::Foreign(owner),
        }))
    }

    /// `len` bytes, each `fill`.
    pub fn filled(len: usize, fill: u8) -> Self {
        let m = Self::zeroed(len);
        // SAFETY: fresh allocation of at least `len` bytes, not shared yet.
        unsafe { std::ptr::write_bytes(m.0.ptr.as_ptr(), fill, len) };
        m
    }

    /// Length in bytes (as asked for).
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes `offset..offset + len` as a [`LayerMemory::Host`] (`None` outside the
    /// allocation). The caller keeps a clone of `self` for as long as the region is registered.
    pub fn layer(&self, offset: usize, len: usize) -> Option<LayerMemory> {
        if offset.checked_add(len)? > self.len() {
            return None;
        }
        // SAFETY: in range; the allocation lives while the region holds a clone; writes go
        // only into admitted blocks (the region's contract).
        Some(unsafe { LayerMemory::host(self.0.ptr.as_ptr().add(offset), len) })
    }

    /// A copy of `offset..offset + len` (`None` outside the allocation).
    ///
    /// Reads racing a transfer into the same bytes see some mix of old and new bytes; read
    /// a block once its transfer has been flushed.
    pub fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        if offset.checked_add(len)? > self.len() {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: in range; see the docs on racing reads.
        unsafe {
            std::ptr::copy_nonoverlapping(self.0.ptr.as_ptr().add(offset), out.as_mut_ptr(), len)
        };
        Some(out)
    }

    /// Copies `data` to `offset` (`false` outside the allocation). For owners filling blocks no
    /// transfer is writing.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        match self.layer(0, self.len()) {
            Some(m) => m.land_host(offset, data),
            None => false,
        }
    }

    /// The start of the allocation (for registration with a NIC or a GPU runtime).
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.ptr.as_ptr()
    }
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_aligned_and_bounded() {
        let m = HostMemory::filled(10_000, 7);
        assert_eq!(m.as_ptr() as usize % PAGE, 0);
        assert_eq!(m.read(9_998, 2), Some(vec![7, 7]));
        assert_eq!(m.read(9_999, 2), None);
        assert!(m.write(4, &[1, 2, 3]));
        assert_eq!(m.read(3, 5), Some(vec![7, 1, 2, 3, 7]));
        assert!(!m.write(9_999, &[1, 2]));
        let layer = m.layer(4096, 4096).unwrap();
        assert!(layer.land_host(4095, &[9]));
        assert!(!layer.land_host(4096, &[9]));
        assert_eq!(m.read(8191, 1), Some(vec![9]));
        assert!(m.layer(8192, 4096).is_none());
        assert!(!LayerMemory::Staged.land_host(0, &[1]));
    }

    /// Memory from elsewhere is freed by its owner, once, after the last clone.
    #[test]
    fn a_foreign_owner_frees_after_the_last_clone() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        struct Owner(Arc<AtomicUsize>, #[allow(dead_code)] HostMemory);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let backing = HostMemory::zeroed(2 * PAGE);
        let freed = Arc::new(AtomicUsize::new(0));
        let ptr = NonNull::new(backing.as_ptr()).unwrap();
        // SAFETY: `backing` is zeroed, page-aligned and lives in the owner.
        let m = unsafe {
            HostMemory::from_owner(ptr, 2 * PAGE, Box::new(Owner(freed.clone(), backing)))
        };
        assert_eq!(m.len(), 2 * PAGE);
        let clone = m.clone();
        assert!(m.write(PAGE, &[3]));
        drop(m);
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        assert_eq!(clone.read(PAGE, 1), Some(vec![3]));
        drop(clone);
        assert_eq!(freed.load(Ordering::SeqCst), 1);
    }
}
