//! Key → region map shared by a transport's `register` and its receiving side.
//!
//! A plain `RwLock<HashMap>`: every critical section is a lookup, insert or remove, never held
//! across an `.await`, and writes read an `AtomicBool` on the entry rather than the map.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{check_run, Fence, KvLayoutDesc, KvRegion, LayerMemory, RemoteKey, TransferError};

/// Who writes: the region's key and the writer's reservation fence.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Access {
    pub(crate) key: RemoteKey,
    pub(crate) fence: Fence,
}

/// A registered region, its layout and its memory, read once at registration.
pub(crate) struct Entry {
    pub(crate) region: Arc<dyn KvRegion>,
    pub(crate) layout: KvLayoutDesc,
    /// [`KvRegion::memory`] of each layer.
    pub(crate) memory: Vec<LayerMemory>,
    live: AtomicBool,
}

impl Entry {
    pub(crate) fn new(region: Arc<dyn KvRegion>) -> Self {
        let layout = region.layout();
        let memory = (0..layout.num_layers).map(|l| region.memory(l)).collect();
        Entry {
            layout,
            memory,
            region,
            live: AtomicBool::new(true),
        }
    }

    /// False once deregistered: connections holding the entry stop writing.
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Where a received run of `len` bytes at `block` of a host layer goes, so that its
    /// payload is read from the connection straight into the region: the run is checked
    /// against the layout and the registration, and every block of it admitted under
    /// `access.fence`, before the slice is handed out. `None` for a layer not in host memory
    /// (after the same layout and registration checks): read the payload into a buffer and
    /// [`Self::land`] it.
    #[allow(clippy::mut_from_ref)] // the region's memory, admitted for this run: see below
    pub(crate) fn host_destination(
        &self,
        access: Access,
        layer: u32,
        block: u32,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransferError> {
        check_run(&self.layout, layer, block, len)?;
        if !self.is_live() {
            return Err(TransferError::UnknownRegion(access.key));
        }
        let Some(m @ LayerMemory::Host(_)) = self.memory.get(layer as usize) else {
            return Ok(None);
        };
        let bb = self.layout.block_bytes();
        for b in block..block + (len / bb) as u32 {
            self.region.admit(b, access.fence)?;
        }
        // SAFETY: every block of the range was admitted for this transfer just above: the
        // region's owner leaves them alone until the flush is acknowledged, and the one
        // connection writing them holds the slice only while it reads this run.
        match unsafe { m.host_slice_mut(block as usize * bb, len) } {
            Some(dst) => Ok(Some(dst)),
            None => Err(TransferError::Region(format!(
                "layer {layer} block {block}: outside the layer's registered memory"
            ))),
        }
    }

    /// Lands one received run of blocks (`block, block + 1, …`): checks it against the layout,
    /// the registration (`access.key`) and the region's admission of every block under
    /// `access.fence`, then copies it into the layer's host memory in one go, or hands it to
    /// [`KvRegion::write_run`] (staged and device layers).
    pub(crate) fn land(
        &self,
        access: Access,
        layer: u32,
        block: u32,
        data: &[u8],
    ) -> Result<(), TransferError> {
        check_run(&self.layout, layer, block, data.len())?;
        if !self.is_live() {
            return Err(TransferError::UnknownRegion(access.key));
        }
        let bb = self.layout.block_bytes();
        let n = (data.len() / bb) as u32;
        for b in block..block + n {
            self.region.admit(b, access.fence)?;
        }
        let offset = block as usize * bb;
        match self.memory.get(layer as usize) {
            Some(m @ LayerMemory::Host(_)) => {
                if m.land_host(offset, data) {
                    Ok(())
                } else {
                    Err(TransferError::Region(format!(
                        "layer {layer} block {block}: outside the layer's registered memory"
                    )))
                }
            }
            _ => self.region.write_run(layer, block, data),
        }
    }
}

/// The regions of one transport (or one in-process fabric).
pub(crate) struct Registry {
    regions: RwLock<HashMap<RemoteKey, Arc<Entry>>>,
    seed: u64,
    counter: AtomicU64,
}

impl Registry {
    pub(crate) fn new() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Registry {
            regions: RwLock::new(HashMap::new()),
            seed: nanos ^ (u64::from(std::process::id()) << 32),
            counter: AtomicU64::new(0),
        }
    }

    /// Registers `region` under a fresh non-zero key.
    pub(crate) fn insert(&self, region: Arc<dyn KvRegion>) -> RemoteKey {
        let entry = Arc::new(Entry::new(region));
        let mut map = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        loop {
            let n = self.counter.fetch_add(1, Ordering::Relaxed);
            let key = RemoteKey(splitmix64(self.seed.wrapping_add(n)));
            if key.0 != 0 && !map.contains_key(&key) {
                map.insert(key, entry);
                return key;
            }
        }
    }

    pub(crate) fn remove(&self, key: RemoteKey) -> Result<(), TransferError> {
        let removed = self
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key);
        match removed {
            Some(entry) => {
                entry.live.store(false, Ordering::Release);
                Ok(())
            }
            None => Err(TransferError::UnknownRegion(key)),
        }
    }

    pub(crate) fn get(&self, key: RemoteKey) -> Result<Arc<Entry>, TransferError> {
        self.regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned()
            .ok_or(TransferError::UnknownRegion(key))
    }
}

/// SplitMix64 finaliser: spreads a counter over the key space.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
