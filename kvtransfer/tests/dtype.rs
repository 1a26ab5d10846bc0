//! The dtype on the wire is the destination's: a writer whose cache holds another dtype converts
//! its rows ([`ferry_kvtransfer::convert`]) and connects with the destination's dtype; rows then
//! land as exactly the destination dtype's bytes — bf16 → f32 widened exactly, f32 → bf16
//! rounded to nearest even — over every transport. A writer that connects with the dtype it
//! merely holds is still refused by the handshake, before any byte moves.

use std::sync::{Arc, Mutex};

use ferry_kvtransfer::{
    check_write, convert, BlockWrite, Dtype, Fence, KvLayoutDesc, KvRegion, LayerStreamer,
    LocalTransport, TcpTransport, TransferError, Transport, WriteBatch,
};

/// 2 layers × 4 blocks of 2 tokens × 8 elements.
fn layout(dtype: Dtype) -> KvLayoutDesc {
    KvLayoutDesc {
        num_layers: 2,
        page_size: 2,
        latent_width: 8,
        dtype,
        num_blocks: 4,
    }
}

/// A destination cache as raw bytes, `[layer][block][bytes]`.
struct Region {
    layout: KvLayoutDesc,
    data: Mutex<Vec<u8>>,
}

impl Region {
    fn new(layout: KvLayoutDesc) -> Arc<Self> {
        let len = (layout.num_layers * layout.num_blocks) as usize * layout.block_bytes();
        Arc::new(Self {
            layout,
            data: Mutex::new(vec![0; len]),
        })
    }

    fn block(&self, layer: u32, block: u32) -> Vec<u8> {
        let n = self.layout.block_bytes();
        let at = (layer * self.layout.num_blocks + block) as usize * n;
        self.data.lock().unwrap()[at..at + n].to_vec()
    }
}

impl KvRegion for Region {
    fn layout(&self) -> KvLayoutDesc {
        self.layout
    }

    fn write(&self, layer: u32, block: u32, data: &[u8]) -> Result<(), TransferError> {
        check_write(&self.layout, layer, block, data.len())?;
        let at = (layer * self.layout.num_blocks + block) as usize * data.len();
        self.data.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
}

/// 16 f32 values (one block of 2 × 8): the rounding cases of f32 → bf16 first, then ordinary
/// values varying with `seed`.
fn f32_rows(seed: u32) -> Vec<f32> {
    let mut v = vec![
        f32::from_bits(0x3F80_8000), // 1 + 2⁻⁸: a tie, the even neighbour is below (→ 0x3F80)
        f32::from_bits(0x3F81_8000), // a tie whose even neighbour is above (→ 0x3F82)
        f32::from_bits(0x3F80_8001), // just above the tie (→ 0x3F81)
        f32::from_bits(0x3F80_7FFF), // just below it (→ 0x3F80)
        -2.5,                        // exact in bf16
        f32::MAX,                    // rounds up past the largest bf16: +inf
        f32::NAN,
        0.0,
    ];
    v.extend((0..8).map(|i| (seed * 8 + i) as f32 * 0.377 - 3.1));
    v
}

/// 16 bf16 bit patterns (one block), varying with `seed`.
fn bf16_rows(seed: u32) -> Vec<u16> {
    let mut v = vec![
        0x3F80, 0xC020, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8000, 0x3F81,
    ];
    v.extend((0..8).map(|i| 0x3C00 + (seed * 8 + i) as u16 * 37));
    v
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Round to nearest even by integer arithmetic (independent of the crate's implementation);
/// NaN is checked separately.
fn rne(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Fast mode's split rows: each row of 8 ends in a rope part of 2 kept as a bf16 pair.
const SPLIT: Dtype = Dtype::Bf16Split { rope: 2 };

fn bf(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `v` (rows of 8) stored split, computed independently of the crate: each element rounded,
/// then each row's last two again as `rne(x − hi)`.
fn split_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for row in v.chunks_exact(8) {
        out.extend(row.iter().flat_map(|&x| rne_nan(x).to_le_bytes()));
        out.extend(
            row[6..]
                .iter()
                .flat_map(|&x| rne_nan(x - bf(rne_nan(x))).to_le_bytes()),
        );
    }
    out
}

/// [`rne`] with NaN kept a quiet NaN.
fn rne_nan(x: f32) -> u16 {
    if x.is_nan() {
        0x7FC0
    } else {
        rne(x)
    }
}

/// What the writer's cache holds for `(layer, block)`, in the writer's dtype.
fn source_block(from: Dtype, layer: u32, block: u32) -> Vec<u8> {
    let seed = layer * 4 + block;
    match from {
        Dtype::F32 => f32_bytes(&f32_rows(seed)),
        Dtype::Bf16 => bf16_bytes(&bf16_rows(seed)),
        Dtype::Bf16Split { .. } => split_bytes(&f32_rows(seed)),
    }
}

/// Checks that `got` (destination bytes) is `src` (the writer's bytes) as the destination dtype.
fn assert_arrived(from: Dtype, to: Dtype, src: &[u8], got: &[u8]) {
    match (from, to) {
        (Dtype::F32, Dtype::F32) | (Dtype::Bf16, Dtype::Bf16) => assert_eq!(got, src),
        (a, b) if a == b => assert_eq!(got, src),
        (Dtype::Bf16, Dtype::F32) => {
            for (s, g) in src.chunks_exact(2).zip(got.chunks_exact(4)) {
                let bits = u16::from_le_bytes([s[0], s[1]]);
                let v = u32::from_le_bytes([g[0], g[1], g[2], g[3]]);
                assert_eq!(v, u32::from(bits) << 16, "bf16 {bits:#06x} widened exactly");
            }
        }
        (Dtype::Bf16Split { .. }, Dtype::F32) => {
            // Latent elements widen exactly; a pair widens to hi + lo.
            let u = |b: &[u8], i: usize| u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
            for (s, g) in src.chunks_exact(20).zip(got.chunks_exact(32)) {
                for i in 0..8 {
                    let want = if i < 6 {
                        bf(u(s, i))
                    } else {
                        bf(u(s, i)) + bf(u(s, i + 2))
                    };
                    let v =
                        f32::from_le_bytes([g[4 * i], g[4 * i + 1], g[4 * i + 2], g[4 * i + 3]]);
                    assert!(v == want || (v.is_nan() && want.is_nan()), "{v} vs {want}");
                }
            }
        }
        (Dtype::F32, Dtype::Bf16Split { .. }) => assert_eq!(
            got,
            split_bytes(
                &src.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<_>>()
            )
        ),
        (Dtype::F32, Dtype::Bf16) => {
            for (s, g) in src.chunks_exact(4).zip(got.chunks_exact(2)) {
                let x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                let v = u16::from_le_bytes([g[0], g[1]]);
                if x.is_nan() {
                    assert!(
                        v & 0x7F80 == 0x7F80 && v & 0x7F != 0,
                        "NaN stays NaN: {v:#06x}"
                    );
                } else {
                    assert_eq!(v, rne(x), "{x:e} ({:#010x}) rounded", x.to_bits());
                }
            }
        }
        (from, to) => panic!("{from} → {to} is not a pair this test sends"),
    }
}

async fn rows_arrive_in_the_destination_dtype(t: Arc<dyn Transport>) {
    // The rounding cases themselves, so the check above cannot pass vacuously.
    assert_eq!(
        [0x3F80_8000, 0x3F81_8000, 0x3F80_8001, 0x3F80_7FFF].map(|b| rne(f32::from_bits(b))),
        [0x3F80, 0x3F82, 0x3F81, 0x3F80]
    );
    assert_eq!(rne(f32::MAX), 0x7F80);
    for (from, to) in [
        (Dtype::F32, Dtype::Bf16),
        (Dtype::Bf16, Dtype::F32),
        (Dtype::Bf16, Dtype::Bf16),
        (Dtype::F32, Dtype::F32),
        (Dtype::F32, SPLIT),
        (SPLIT, Dtype::F32),
        (SPLIT, SPLIT),
    ] {
        let region = Region::new(layout(to));
        let reg = t.register(region.clone()).await.unwrap();
        // Connecting with the dtype the writer's cache holds is refused when it differs.
        if from != to {
            let held = KvLayoutDesc {
                num_blocks: 9,
                ..layout(from)
            };
            match t.connect(&reg.address, reg.key, Fence::NONE, &held).await {
                Err(TransferError::LayoutMismatch {
                    field,
                    ours,
                    theirs,
                }) => {
                    assert_eq!(field, "dtype");
                    assert_eq!((ours, theirs), (from.to_string(), to.to_string()));
                }
                Err(e) => panic!("{from} → {to}: expected a dtype mismatch, got {e}"),
                Ok(_) => panic!("{from} → {to}: a writer with the wrong dtype connected"),
            }
        }
        // The wire's dtype is the destination's.
        let wire = KvLayoutDesc {
            num_blocks: 9,
            ..layout(to)
        };
        let writer = t
            .connect(&reg.address, reg.key, Fence::NONE, &wire)
            .await
            .unwrap();
        let (sink, streamer) = LayerStreamer::spawn(writer);
        // Writer block b of layer l goes to destination block 3 - b.
        for layer in 0..2 {
            let writes = (0..2)
                .map(|b| BlockWrite {
                    block: 3 - b,
                    data: convert(&source_block(from, layer, b), from, to, 8)
                        .unwrap()
                        .into(),
                })
                .collect();
            sink.send(WriteBatch { layer, writes }).unwrap();
        }
        let total = streamer.finish(sink).await.unwrap();
        assert_eq!(total, 4 * layout(to).block_bytes() as u64, "{from} → {to}");
        for layer in 0..2 {
            for b in 0..2 {
                let src = source_block(from, layer, b);
                assert_arrived(from, to, &src, &region.block(layer, 3 - b));
            }
            for untouched in 0..2 {
                assert!(region.block(layer, untouched).iter().all(|&x| x == 0));
            }
        }
        t.deregister(reg.key).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_arrive_in_the_destination_dtype_over_tcp() {
    let t = Arc::new(TcpTransport::bind("127.0.0.1:0".parse().unwrap()).unwrap());
    rows_arrive_in_the_destination_dtype(t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_arrive_in_the_destination_dtype_in_process() {
    rows_arrive_in_the_destination_dtype(Arc::new(LocalTransport::new())).await;
}
