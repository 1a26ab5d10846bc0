//! The layer hook: engine thread → transfer stream.

use std::sync::Arc;

use ferry_kvtransfer::descriptor::{BlockWrite, DeviceBatch, DeviceRun, Payload, WriteBatch};
use ferry_kvtransfer::layerwise::LayerSink;
use ferry_kvtransfer::{convert, Dtype, MAX_RUN_BYTES};
use ferry_model::engine::LayerSinkFn;
use ferry_model::kv::{BlockId, KvDtype, LayerRows, Lease};

/// The transfer wire's name for a cache dtype.
pub fn wire_dtype(d: KvDtype) -> Dtype {
    match d {
        KvDtype::F32 => Dtype::F32,
        KvDtype::Bf16Split { rope } => Dtype::Bf16Split {
            rope: u32::try_from(rope).unwrap_or(u32::MAX),
        },
    }
}

/// The closure the engine calls after each layer: `blocks` are this worker's blocks from the
/// destination's first missing block on; `dest` maps them, in order, to the destination's
/// block ids starting at `dest_first`. Rows go out as `wire` (the destination cache's dtype):
/// as they are when the engine's cache holds that dtype, converted otherwise (a split bf16 row
/// → f32 as `hi + lo`, f32 → bf16 rounded to nearest even, `ferry_kvtransfer::convert`).
/// Blocks whose destination ids are consecutive go as one run (one put, one frame), up to
/// [`MAX_RUN_BYTES`].
///
/// Rows left in device memory ([`LayerRows::on_device`]: the job asked for them because the
/// writer puts from device memory into every target layer, and the dtypes agree) go as a
/// [`DeviceBatch`]: runs whose destination ids *and* source addresses are both consecutive,
/// uncapped, read by the transport in place under the layer's lease.
pub fn layer_pusher(
    sink: LayerSink,
    dest: Vec<u32>,
    dest_first: usize,
    wire: Dtype,
    host: HostShip,
) -> LayerSinkFn {
    offset_layer_pusher(sink, dest, dest_first, 0, (wire, host))
}

/// How host rows leave when the engine leases them ([`LayerRows::host_lease`]) and they are
/// already in the wire's dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostShip {
    /// Copied into buffers of their own (a writer that would hold the rows while a socket
    /// drains: `RemoteWriter::reads_in_place` is false).
    Copy,
    /// Read in place under the lease ([`Payload::in_place`]).
    InPlace,
}

/// [`layer_pusher`] for a pool whose layer `l` is destination layer `offset + l`: the drafter's
/// context pool, shipped as the transfer layers after the target's (its rows are f32, converted
/// to `wire` like the target's).
pub fn offset_layer_pusher(
    sink: LayerSink,
    dest: Vec<u32>,
    dest_first: usize,
    offset: usize,
    (wire, host): (Dtype, HostShip),
) -> LayerSinkFn {
    Box::new(move |pool_layer, blocks, rows| {
        let layer = u32::try_from(offset + pool_layer).map_err(|e| e.to_string())?;
        let dest_of = |j: usize| {
            dest.get(dest_first + j)
                .copied()
                .ok_or_else(|| format!("no destination block for prompt block {}", dest_first + j))
        };
        if rows.on_device().is_some() {
            let batch = device_batch(layer, blocks, rows, wire, dest_of)?;
            sink.send_device(batch).map_err(|e| e.to_string())
        } else {
            let batch = host_batch(layer, blocks, rows, (wire, host), dest_of)?;
            sink.send(batch).map_err(|e| e.to_string())
        }
    })
}

/// One layer's blocks read in place from the engine's device cache: runs whose destination
/// ids and source addresses are both consecutive, uncapped, under the layer's lease.
fn device_batch(
    layer: u32,
    blocks: &[BlockId],
    rows: &LayerRows<'_>,
    wire: Dtype,
    dest_of: impl Fn(usize) -> Result<u32, String>,
) -> Result<DeviceBatch, String> {
    let dev = rows
        .on_device()
        .ok_or_else(|| format!("layer {layer}'s rows are not on the device"))?;
    let held = wire_dtype(rows.dtype());
    if held != wire {
        return Err(format!(
            "rows left on the device are {held}, the destination wants {wire}"
        ));
    }
    let bb = rows.block_bytes();
    let mut runs: Vec<DeviceRun> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let block = dest_of(j)?;
        let src = dev
            .addr(*b, bb)
            .ok_or_else(|| format!("{b} of layer {layer} is not on the device"))?;
        match runs.last_mut() {
            Some(r)
                if u64::from(r.block) + (r.len / bb) as u64 == u64::from(block)
                    && r.src + r.len as u64 == src =>
            {
                r.len += bb
            }
            _ => runs.push(DeviceRun {
                block,
                src,
                len: bb,
            }),
        }
    }
    #[allow(unsafe_code)] // the one unsafe block of this crate: see the crate docs
    // SAFETY: the runs are the engine's device cache blocks of this layer, computed (the view
    // is handed out after the layer's compute) and unchanged until the lease is dropped: the
    // engine waits for every lease before it writes them again.
    let batch = unsafe { DeviceBatch::new(layer, dev.device, runs, Box::new(dev.lease())) };
    Ok(batch)
}

/// One layer's blocks from host rows, consecutive destination blocks as runs of up to
/// [`MAX_RUN_BYTES`]: read in place when `host` allows it, the rows are leased
/// ([`LayerRows::host_lease`]) and already in `wire`'s dtype, else copied (converted where the
/// cache holds another dtype).
fn host_batch(
    layer: u32,
    blocks: &[BlockId],
    rows: &LayerRows<'_>,
    (wire, host): (Dtype, HostShip),
    dest_of: impl Fn(usize) -> Result<u32, String>,
) -> Result<WriteBatch, String> {
    let held = wire_dtype(rows.dtype());
    if held == wire && host == HostShip::InPlace {
        if let Some(lease) = rows.host_lease() {
            return in_place_batch(layer, blocks, rows, dest_of, Arc::new(lease));
        }
    }
    let mut writes: Vec<(u32, Vec<u8>)> = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        let block = dest_of(j)?;
        let bytes = rows.block(*b).map_err(|e| e.to_string())?;
        let data = if held == wire {
            bytes.to_vec()
        } else {
            convert(bytes, held, wire, rows.width()).map_err(|e| e.to_string())?
        };
        match writes.last_mut() {
            Some((first, run))
                if run.len() % data.len().max(1) == 0
                    && u64::from(*first) + (run.len() / data.len().max(1)) as u64
                        == u64::from(block)
                    && run.len() + data.len() <= MAX_RUN_BYTES =>
            {
                run.extend_from_slice(&data)
            }
            _ => writes.push((block, data)),
        }
    }
    let writes = writes
        .into_iter()
        .map(|(block, data)| BlockWrite {
            block,
            data: data.into(),
        })
        .collect();
    Ok(WriteBatch { layer, writes })
}

/// [`host_batch`] reading the engine's rows in place: runs whose destination ids and source
/// rows are both consecutive, up to [`MAX_RUN_BYTES`], each a view of the rows under `lease`.
fn in_place_batch(
    layer: u32,
    blocks: &[BlockId],
    rows: &LayerRows<'_>,
    dest_of: impl Fn(usize) -> Result<u32, String>,
    lease: Arc<Lease>,
) -> Result<WriteBatch, String> {
    let bb = rows.block_bytes();
    // (first destination block, first source byte, length)
    let mut runs: Vec<(u32, *const u8, usize)> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let block = dest_of(j)?;
        let bytes = rows.block(*b).map_err(|e| e.to_string())?;
        match runs.last_mut() {
            Some((first, src, len))
                if u64::from(*first) + (*len / bb) as u64 == u64::from(block)
                    && src.wrapping_add(*len) == bytes.as_ptr()
                    && *len + bb <= MAX_RUN_BYTES =>
            {
                *len += bb
            }
            _ => runs.push((block, bytes.as_ptr(), bb)),
        }
    }
    let writes = runs
        .into_iter()
        .map(|(block, src, len)| {
            #[allow(unsafe_code)] // see the crate docs
            // SAFETY: `src..src + len` are consecutive blocks of the engine's rows (each came
            // from `rows.block`, and their addresses follow one another), computed before the
            // hook, and unwritten until `lease` is dropped: the engine waits for every lease of
            // the forward before anything writes those rows.
            let data = unsafe { Payload::in_place(src, len, lease.clone()) };
            BlockWrite { block, data }
        })
        .collect();
    Ok(WriteBatch { layer, writes })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use ferry_kvtransfer::{
        check_write, KvLayoutDesc, KvRegion, LayerStreamer, LocalTransport, TransferError,
        Transport,
    };
    use ferry_model::kv::{BlockId, KvLayout, KvPool, LayerRows};

    use super::*;

    /// Every write that landed: `(layer, block, bytes)`.
    struct Region {
        layout: KvLayoutDesc,
        writes: Mutex<Vec<(u32, u32, Vec<u8>)>>,
    }

    impl KvRegion for Region {
        fn layout(&self) -> KvLayoutDesc {
            self.layout
        }
        fn write(&self, layer: u32, block: u32, data: &[u8]) -> Result<(), TransferError> {
            check_write(&self.layout, layer, block, data.len())?;
            self.writes
                .lock()
                .unwrap()
                .push((layer, block, data.to_vec()));
            Ok(())
        }
    }

    /// Pushes `rows` (blocks `blocks` of pool layer 0) into a region of `wire` dtype whose
    /// layer `offset` receives them; returns what landed.
    async fn push(
        rows: &LayerRows<'_>,
        blocks: &[BlockId],
        offset: usize,
        wire: Dtype,
    ) -> Vec<(u32, u32, Vec<u8>)> {
        let layout = KvLayoutDesc {
            num_layers: 2,
            page_size: 2,
            latent_width: 2,
            dtype: wire,
            num_blocks: 8,
        };
        let region = Arc::new(Region {
            layout,
            writes: Mutex::default(),
        });
        let t = LocalTransport::new();
        let reg = t.register(region.clone()).await.unwrap();
        let writer = t
            .connect(
                &reg.address,
                reg.key,
                ferry_kvtransfer::Fence::NONE,
                &layout,
            )
            .await
            .unwrap();
        let (sink, streamer) = LayerStreamer::spawn(writer);
        // Destination blocks 5, 6, 7 for prompt blocks 0, 1, 2; the job ships from block 1.
        let mut hook = offset_layer_pusher(
            sink.clone(),
            vec![5, 6, 7],
            1,
            offset,
            (wire, HostShip::InPlace),
        );
        hook(0, blocks, rows).unwrap();
        streamer.finish(sink).await.unwrap();
        let landed = std::mem::take(&mut *region.writes.lock().unwrap());
        landed
    }

    fn bf16_bytes(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect()
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[tokio::test]
    async fn rows_leave_in_the_destination_dtype() {
        // An f32 pool (a CPU engine, or a drafter's wire pool).
        let mut pool = KvPool::new(KvLayout {
            num_layers: 1,
            num_blocks: 4,
            page_size: 2,
            width: 2,
        })
        .unwrap();
        let a = [1.0f32, 1.0 + 1.0 / 256.0, -3.5, 1.0 + 3.0 / 256.0];
        let b = [0.25f32, 7.0, -0.125, 1e-3];
        pool.block_mut(0, BlockId(3)).unwrap().copy_from_slice(&a);
        pool.block_mut(0, BlockId(1)).unwrap().copy_from_slice(&b);
        let rows = LayerRows::pool(&pool, 0).unwrap();
        let blocks = [BlockId(3), BlockId(1)];
        // f32 → f32: the bytes as they are; f32 → bf16: rounded to nearest even (1 + 2⁻⁸ is a
        // tie that rounds down to 1, 1 + 3·2⁻⁸ one that rounds up to 1 + 2⁻⁶).
        assert_eq!(
            push(&rows, &blocks, 0, Dtype::F32).await,
            vec![(0, 6, f32_bytes(&a)), (0, 7, f32_bytes(&b))]
        );
        let landed = push(&rows, &blocks, 1, Dtype::Bf16).await;
        assert_eq!(landed, vec![(1, 6, bf16_bytes(&a)), (1, 7, bf16_bytes(&b))]);
        assert_eq!(&landed[0].2[2..4], &0x3F80u16.to_le_bytes());
        assert_eq!(&landed[0].2[6..8], &0x3F82u16.to_le_bytes());
        // A fast-mode GPU's staging slot (split rows: the last element of each row as a bf16
        // pair): untouched to a destination of the same dtype, widened to `hi + lo` for an f32
        // one, and an f32 pool's rows split the same way on the way to a split destination.
        let split = KvDtype::Bf16Split { rope: 1 };
        let wire_split = Dtype::Bf16Split { rope: 1 };
        let encode = |v: &[f32]| {
            let mut out = Vec::new();
            split.encode_into(v, 2, &mut out);
            out
        };
        let staged = [encode(&a), encode(&b)].concat();
        let ids = [BlockId(1), BlockId(3)];
        let rows = LayerRows::staged(0, (split, 2), 12, &ids, &staged).unwrap();
        let blocks = [BlockId(1), BlockId(3)];
        assert_eq!(
            push(&rows, &blocks, 0, wire_split).await,
            vec![(0, 6, encode(&a)), (0, 7, encode(&b))]
        );
        // A staged view keeps its blocks in id order (the drafter's context, `Speculator::ship`);
        // the prompt's own order decides where each goes.
        assert_eq!(
            push(&rows, &[BlockId(3), BlockId(1)], 0, wire_split).await,
            vec![(0, 6, encode(&b)), (0, 7, encode(&a))]
        );
        // Latent elements widen from bf16; the split ones come back within 2⁻¹⁶.
        let widened = |v: &[f32]| -> Vec<f32> {
            let mut w = Vec::new();
            for r in v.chunks(2) {
                w.push(half::bf16::from_f32(r[0]).to_f32());
                let hi = half::bf16::from_f32(r[1]).to_f32();
                w.push(hi + half::bf16::from_f32(r[1] - hi).to_f32());
            }
            w
        };
        assert_eq!(widened(&a)[1], a[1], "1 + 2⁻⁸ survives the pair");
        assert_eq!(
            push(&rows, &blocks, 0, Dtype::F32).await,
            vec![
                (0, 6, f32_bytes(&widened(&a))),
                (0, 7, f32_bytes(&widened(&b)))
            ]
        );
        let rows = LayerRows::pool(&pool, 0).unwrap();
        assert_eq!(
            push(&rows, &[BlockId(3), BlockId(1)], 0, wire_split).await,
            vec![(0, 6, encode(&a)), (0, 7, encode(&b))]
        );
    }
}

#[cfg(test)]
mod device_tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_trait::async_trait;
    use ferry_kvtransfer::{
        DeviceBatch, DeviceRun, LayerStreamer, RemoteWriter, TransferError, WriteBatch,
    };
    use ferry_model::kv::{BlockId, DeviceRows, KvDtype, LayerRows, Leases};

    use super::*;

    /// A writer that puts from device memory into every layer and records the runs it got; it
    /// keeps each batch (and so its lease) until flushed, as a transport does until its puts
    /// complete.
    /// `(layer, runs)` of every device batch written.
    type Seen = Arc<Mutex<Vec<(u32, Vec<DeviceRun>)>>>;

    #[derive(Default)]
    struct Recorder {
        runs: Seen,
        held: Vec<DeviceBatch>,
    }

    #[async_trait]
    impl RemoteWriter for Recorder {
        async fn write(&mut self, _: WriteBatch) -> Result<(), TransferError> {
            Err(TransferError::Protocol(
                "host rows were not expected".into(),
            ))
        }
        async fn flush(&mut self) -> Result<u64, TransferError> {
            let bytes = self.held.iter().map(DeviceBatch::bytes).sum();
            self.held.clear();
            Ok(bytes)
        }
        fn puts_from_device(&self, _: u32) -> bool {
            true
        }
        async fn write_device(&mut self, batch: DeviceBatch) -> Result<(), TransferError> {
            self.runs
                .lock()
                .unwrap()
                .push((batch.layer, batch.runs().to_vec()));
            self.held.push(batch);
            Ok(())
        }
    }

    /// `(layer, first block, bytes, read in place)` of every host write.
    type HostSeen = Arc<Mutex<Vec<(u32, u32, Vec<u8>, bool)>>>;

    /// A writer for host rows that records each run and keeps the batches until flushed (a
    /// transport keeps them no longer than it reads them; holding them shows the lease is out
    /// meanwhile).
    #[derive(Default)]
    struct HostRecorder {
        seen: HostSeen,
        held: Vec<WriteBatch>,
    }

    #[async_trait]
    impl RemoteWriter for HostRecorder {
        async fn write(&mut self, batch: WriteBatch) -> Result<(), TransferError> {
            for w in &batch.writes {
                let write = (batch.layer, w.block, w.data.to_vec(), w.data.is_in_place());
                self.seen.lock().unwrap().push(write);
            }
            self.held.push(batch);
            Ok(())
        }
        async fn flush(&mut self) -> Result<u64, TransferError> {
            let bytes = self.held.iter().map(WriteBatch::bytes).sum();
            self.held.clear();
            Ok(bytes)
        }
    }

    #[tokio::test]
    async fn leased_host_rows_leave_in_place_and_come_back() {
        use ferry_model::kv::{KvLayout, KvPool};
        let mut pool = KvPool::new(KvLayout {
            num_layers: 1,
            num_blocks: 8,
            page_size: 2,
            width: 2,
        })
        .unwrap();
        for b in 0..8u32 {
            let v = [b as f32, 0.5, -(b as f32), 2.0];
            pool.block_mut(0, BlockId(b)).unwrap().copy_from_slice(&v);
        }
        let bytes = |b: u32| -> Vec<u8> {
            [b as f32, 0.5, -(b as f32), 2.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect()
        };
        let run = |blocks: &[u32]| blocks.iter().flat_map(|&b| bytes(b)).collect::<Vec<u8>>();
        let ids = [BlockId(1), BlockId(2), BlockId(3), BlockId(6)];
        // Destination 10, 11, 12, 20: blocks 1-3 are one run on both sides, 6 its own.
        let dest = vec![10, 11, 12, 20];
        let leases = Leases::new();
        let leased = LayerRows::pool_leased(&pool, 0, &leases).unwrap();
        let recorder = HostRecorder::default();
        let seen = recorder.seen.clone();
        let (sink, streamer) = LayerStreamer::spawn(Box::new(recorder));
        let mut hook = layer_pusher(sink.clone(), dest.clone(), 0, Dtype::F32, HostShip::InPlace);
        hook(0, &ids, &leased).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(leases.outstanding(), 1, "the rows are leased while held");
        assert_eq!(streamer.finish(sink).await.unwrap(), 4 * 16);
        assert!(
            leases.wait_idle(Duration::from_secs(5)),
            "the lease came back"
        );
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(0, 10, run(&[1, 2, 3]), true), (0, 20, run(&[6]), true)]
        );
        // Rows without a lease (the hook's own view), in another dtype than the wire's, or for
        // a writer that copies (`HostShip::Copy`) leave as copies; no lease is taken.
        let plain = LayerRows::pool(&pool, 0).unwrap();
        let cases = [
            (&plain, Dtype::F32, HostShip::InPlace),
            (&leased, Dtype::Bf16, HostShip::InPlace),
            (&leased, Dtype::F32, HostShip::Copy),
        ];
        for (rows, wire, host) in cases {
            let recorder = HostRecorder::default();
            let seen = recorder.seen.clone();
            let (sink, streamer) = LayerStreamer::spawn(Box::new(recorder));
            let mut hook = layer_pusher(sink.clone(), dest.clone(), 0, wire, host);
            hook(0, &ids, rows).unwrap();
            assert_eq!(leases.outstanding(), 0, "{wire}");
            streamer.finish(sink).await.unwrap();
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), 2, "{wire}");
            assert!(seen.iter().all(|w| !w.3), "{wire}: copies");
        }
    }

    #[tokio::test]
    async fn device_rows_leave_as_leased_runs_coalesced_on_both_sides() {
        // Blocks 4, 5, 6 of layer 0 lie back to back on the device (one run at 0x1000), block
        // 9 elsewhere; 1,280-byte blocks (bf16 split rows of 576 + 64 at page 1).
        let split = KvDtype::Bf16Split { rope: 64 };
        let bb = 1280;
        let device_runs = [(BlockId(4), 3, 0x1000u64), (BlockId(9), 1, 0x9000u64)];
        let leases = Leases::new();
        let ids = [BlockId(4), BlockId(5), BlockId(6), BlockId(9)];
        let rows = LayerRows::device(
            0,
            (split, 576),
            bb,
            &ids,
            DeviceRows::new(0, &device_runs, &leases),
        );
        assert!(rows.block(BlockId(4)).is_err(), "no host bytes to read");
        let recorder = Recorder::default();
        let seen = recorder.runs.clone();
        let (sink, streamer) = LayerStreamer::spawn(Box::new(recorder));
        // Destination blocks 20, 21, 30, 31: consecutive on both sides only for 4 → 20, 5 → 21;
        // 6 → 30 breaks the destination run, 9 → 31 the source run.
        let wire = Dtype::Bf16Split { rope: 64 };
        let mut hook = layer_pusher(sink.clone(), vec![20, 21, 30, 31], 0, wire, HostShip::Copy);
        hook(0, &ids, &rows).unwrap();
        // The lease stays out while the transport holds the batch...
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(leases.outstanding(), 1);
        // ...and comes back once the transfer is done with it.
        assert_eq!(streamer.finish(sink).await.unwrap(), 4 * bb as u64);
        assert!(leases.wait_idle(Duration::from_secs(5)));
        let run = |block, src, n: usize| DeviceRun {
            block,
            src,
            len: n * bb,
        };
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(
                0,
                vec![
                    run(20, 0x1000, 2),
                    run(30, 0x1000 + 2 * bb as u64, 1),
                    run(31, 0x9000, 1)
                ]
            )]
        );
        // Device rows in another dtype than the wire's cannot be converted in place.
        let (sink, _streamer) = LayerStreamer::spawn(Box::new(Recorder::default()));
        let mut f32_hook = layer_pusher(sink, vec![20, 21, 30, 31], 0, Dtype::F32, HostShip::Copy);
        let e = f32_hook(0, &ids, &rows).unwrap_err();
        assert!(e.contains("the destination wants f32"), "{e}");
    }
}
