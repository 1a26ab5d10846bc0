//! In-process transport: the "remote" region lives in this process, and writes land on the
//! writer's task: copied into the region's host memory, or passed to [`KvRegion::write`] for
//! layers it does not expose.
//!
//! Every clone of a [`LocalTransport`] shares one fabric (key → region), so a prefill and a
//! decode worker in one process reach each other by handing around clones. The only address is
//! [`LOCAL_ADDRESS`]. Used by tests and by single-process clusters (`ferry up`).

use std::sync::Arc;

use async_trait::async_trait;

use crate::registry::{Access, Entry, Registry};
use crate::{
    check_compatible, Fence, KvLayoutDesc, KvRegion, Registration, RemoteKey, RemoteWriter,
    TransferError, Transport, WriteBatch,
};

/// The address every [`LocalTransport`] registration returns.
pub const LOCAL_ADDRESS: &str = "local";

/// In-process transport; clones share one fabric.
#[derive(Clone)]
pub struct LocalTransport {
    fabric: Arc<Registry>,
}

impl LocalTransport {
    /// A transport with a new, empty fabric.
    pub fn new() -> Self {
        LocalTransport {
            fabric: Arc::new(Registry::new()),
        }
    }
}

impl Default for LocalTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for LocalTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTransport").finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn register(&self, region: Arc<dyn KvRegion>) -> Result<Registration, TransferError> {
        let key = self.fabric.insert(region);
        Ok(Registration {
            transport: "local",
            address: LOCAL_ADDRESS.to_owned(),
            key,
        })
    }

    async fn deregister(&self, key: RemoteKey) -> Result<(), TransferError> {
        self.fabric.remove(key)
    }

    async fn connect(
        &self,
        address: &str,
        key: RemoteKey,
        fence: Fence,
        writer_layout: &KvLayoutDesc,
    ) -> Result<Box<dyn RemoteWriter>, TransferError> {
        if address != LOCAL_ADDRESS {
            return Err(TransferError::Protocol(format!(
                "the local transport only reaches address {LOCAL_ADDRESS:?}, got {address:?}"
            )));
        }
        let entry = self.fabric.get(key)?;
        check_compatible(writer_layout, &entry.layout)?;
        Ok(Box::new(LocalWriter {
            entry,
            key,
            fence,
            written: 0,
            failed: false,
        }))
    }
}

/// Writes straight into a region of the same process.
struct LocalWriter {
    entry: Arc<Entry>,
    key: RemoteKey,
    fence: Fence,
    written: u64,
    failed: bool,
}

#[async_trait]
impl RemoteWriter for LocalWriter {
    async fn write(&mut self, batch: WriteBatch) -> Result<(), TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        batch.validate(&self.entry.layout)?;
        if !self.entry.is_live() {
            self.failed = true;
            return Err(TransferError::UnknownRegion(self.key));
        }
        for w in &batch.writes {
            let access = Access {
                key: self.key,
                fence: self.fence,
            };
            let landed = self.entry.land(access, batch.layer, w.block, &w.data);
            if let Err(e) = landed {
                self.failed = true;
                return Err(e);
            }
            self.written += w.data.len() as u64;
        }
        Ok(())
    }

    /// Each write is a copy into the region, made at once.
    fn reads_in_place(&self) -> bool {
        true
    }

    async fn flush(&mut self) -> Result<u64, TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        Ok(self.written)
    }
}
