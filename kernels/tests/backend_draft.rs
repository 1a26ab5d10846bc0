//! The drafter's ops (`backend::draft`) on every backend the machine has (the CPU always; a
//! CUDA device where `CudaDevice::open(0)` works — the H200 runs; with `--features rocm` a ROCm
//! device where `RocmDevice::open(0)` works, held to CUDA's bounds — the same launchers and
//! kernels, not yet run on an AMD GPU):
//!
//! - `block_attention` against a plain f64 reference over the definition (context rows from
//!   shuffled block tables, then the block rows, softmax at `1/sqrt(d)`, GQA) for several
//!   shapes. Tolerance (max |Δ| / max |reference|): on the CPU 1e-6 up to 512 keys and 1e-5 for
//!   the 5000-key case — f32 sums in the SGEMM's order and a polynomial `exp` (2 ulp), whose
//!   rounding grows with the key count; 1e-5 on CUDA — f32 too, an online softmax over 32-key
//!   tiles with split-K, so only the summation order differs (`cuda_parity.rs` states the same
//!   for its f32 attention kernels).
//! - On the CPU the paged op is also checked bit for bit against `cpu::draft::attend_block`
//!   over the same rows gathered into a contiguous context (the model's host-only drafter
//!   calls that function directly).
//! - `scatter_rows` (read the pages back), `gather_concat` (exact: a copy), `confidence`
//!   (against `ConfidenceHead::survival`, copied: bit-exact on the CPU, 1e-5 on CUDA).
//! - `markov_step` against an f64 reference of DSpark's Markov and confidence heads (f32 and
//!   bf16 weights, rank with and without the GPU's 8-wide loads, inputs filling one thread
//!   group and not): 1e-6 of max |reference| on the CPU, 1e-5 on a GPU (f32 sums of at most a
//!   few hundred terms in another order). A GPU's stated handling of ids it cannot check (a
//!   zero W1 row for a previous token outside the vocabulary, NaN for a row outside the pass);
//!   the CPU's errors naming them.
//! - Errors name the op and the operand: an out-of-range slot, a short block table, a host
//!   operand on a CUDA op.

mod common;

use ferry_kernels::backend::draft::{
    block_attention, confidence, gather_concat, markov_step, scatter_rows, BlockAttention,
    Confidence, GatherConcat, MarkovStep, ScatterRows,
};
use ferry_kernels::backend::{Backend, Pages, PagesMut, Precision, Tensor};
use ferry_kernels::cpu::draft::{attend_block, BlockAttnDims, BlockRows};
use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mla::LatentPages;
use ferry_kernels::KernelError;
use rand::seq::SliceRandom;

/// Every backend this machine can run.
fn backends() -> Vec<Backend> {
    #[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(unused_mut))]
    let mut all = vec![Backend::Cpu];
    #[cfg(feature = "cuda")]
    match ferry_kernels::cuda::CudaDevice::open(0) {
        Ok(d) => all.push(Backend::Cuda(d)),
        Err(e) => eprintln!("no CUDA backend: {e}"),
    }
    #[cfg(feature = "rocm")]
    match ferry_kernels::rocm::RocmDevice::open(0) {
        Ok(d) => all.push(Backend::Rocm(d)),
        Err(e) => eprintln!("no ROCm backend: {e}"),
    }
    all
}

/// The bound on max |Δ| / max |reference| against the f64 reference, for rows that attend to
/// at most `keys` keys. The CPU arm keeps the drafter's order (softmax sum and output
/// accumulated key by key in f32), so its rounding grows with the key count: 1e-6 up to 512
/// keys (2.7e-7 .. 9e-7 measured), 1e-5 beyond (4.6e-6 measured at 5004). CUDA sums in tiles
/// of 32 keys per warp, merged across warps and splits: 1e-5 at any length.
fn tolerance(b: &Backend, keys: usize) -> f64 {
    match b {
        Backend::Cpu if keys <= 512 => 1e-6,
        Backend::Cpu => 1e-5,
        #[cfg(feature = "cuda")]
        Backend::Cuda(_) => 1e-5,
        #[cfg(feature = "rocm")]
        Backend::Rocm(_) => 1e-5,
    }
}

#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
fn check(b: &Backend, what: &str, got: &[f32], want: &[f64]) {
    check_keys(b, what, got, want, 0);
}

fn check_keys(b: &Backend, what: &str, got: &[f32], want: &[f64], keys: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    let err = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(
            0.0f64,
            |m, x| if x.is_nan() { f64::INFINITY } else { m.max(x) },
        )
        / scale;
    assert!(
        err <= tolerance(b, keys),
        "{what} on the {}: rel err {err:.2e}",
        b.name()
    );
    eprintln!("{what} on the {}: rel err {err:.2e}", b.name());
}

/// A paged layer on a backend (f32, or bf16 on a GPU), kept alive by the test.
enum PageStore {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(ferry_kernels::cuda::DeviceBuffer<f32>),
    #[cfg(feature = "cuda")]
    CudaBf16(ferry_kernels::cuda::DeviceBuffer<u16>),
    #[cfg(feature = "rocm")]
    Rocm(ferry_kernels::rocm::HipBuffer<f32>),
    #[cfg(feature = "rocm")]
    RocmBf16(ferry_kernels::rocm::HipBuffer<u16>),
}

struct Layer {
    store: PageStore,
    page: usize,
    width: usize,
}

impl Layer {
    fn new(b: &Backend, data: &[f32], page: usize, width: usize) -> Self {
        let store = match b {
            Backend::Cpu => PageStore::Host(data.to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => PageStore::Cuda(d.upload(data).expect("upload pages")),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => PageStore::Rocm(d.upload(data).expect("upload pages")),
        };
        Layer { store, page, width }
    }

    fn pages(&self) -> Pages<'_> {
        match &self.store {
            PageStore::Host(data) => Pages::Host(LatentPages {
                data,
                page_size: self.page,
                width: self.width,
            }),
            #[cfg(feature = "cuda")]
            PageStore::Cuda(buf) => {
                Pages::Cuda(view(self.page, self.width, buf.ptr(), buf.len(), false))
            }
            #[cfg(feature = "cuda")]
            PageStore::CudaBf16(buf) => {
                Pages::Cuda(view(self.page, self.width, buf.ptr(), buf.len(), true))
            }
            #[cfg(feature = "rocm")]
            PageStore::Rocm(buf) => {
                Pages::Rocm(view(self.page, self.width, buf.ptr(), buf.len(), false))
            }
            #[cfg(feature = "rocm")]
            PageStore::RocmBf16(buf) => {
                Pages::Rocm(view(self.page, self.width, buf.ptr(), buf.len(), true))
            }
        }
    }

    fn pages_mut(&mut self) -> PagesMut<'_> {
        match &mut self.store {
            PageStore::Host(data) => PagesMut::Host {
                data,
                width: self.width,
            },
            #[cfg(feature = "cuda")]
            PageStore::Cuda(buf) => {
                PagesMut::Cuda(view(self.page, self.width, buf.ptr(), buf.len(), false))
            }
            #[cfg(feature = "cuda")]
            PageStore::CudaBf16(buf) => {
                PagesMut::Cuda(view(self.page, self.width, buf.ptr(), buf.len(), true))
            }
            #[cfg(feature = "rocm")]
            PageStore::Rocm(buf) => {
                PagesMut::Rocm(view(self.page, self.width, buf.ptr(), buf.len(), false))
            }
            #[cfg(feature = "rocm")]
            PageStore::RocmBf16(buf) => {
                PagesMut::Rocm(view(self.page, self.width, buf.ptr(), buf.len(), true))
            }
        }
    }

    fn to_host(&self) -> Vec<f32> {
        match &self.store {
            PageStore::Host(d) => d.clone(),
            #[cfg(feature = "cuda")]
            PageStore::Cuda(buf) => buf.device().download(buf).expect("download pages"),
            #[cfg(feature = "cuda")]
            PageStore::CudaBf16(buf) => widen(buf.device().download(buf).expect("download pages")),
            #[cfg(feature = "rocm")]
            PageStore::Rocm(buf) => buf.device().download(buf).expect("download pages"),
            #[cfg(feature = "rocm")]
            PageStore::RocmBf16(buf) => widen(buf.device().download(buf).expect("download pages")),
        }
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn widen(bits: Vec<u16>) -> Vec<f32> {
    bits.into_iter()
        .map(|b| half::bf16::from_bits(b).to_f32())
        .collect()
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn view(
    page: usize,
    width: usize,
    ptr: u64,
    len: usize,
    bf16: bool,
) -> ferry_kernels::gpu::ops::PagesView {
    ferry_kernels::gpu::ops::PagesView {
        ptr,
        bf16,
        num_blocks: len / (page * width),
        page_size: page,
        width,
        split: 0,
    }
}

/// One block-attention case: random queries / keys / values, a pool of context rows, block
/// tables drawn from a shuffled pool and padded with -1 (never read).
struct Case {
    d: BlockAttnDims,
    page: usize,
    ctx: Vec<usize>,
    stride: usize,
    tables: Vec<i32>,
    pool: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Case {
    fn new(d: BlockAttnDims, page: usize, ctx: &[usize], seed: u64) -> Self {
        let mut rng = common::rng(seed);
        let stride = ctx
            .iter()
            .map(|n| n.div_ceil(page))
            .max()
            .unwrap_or(0)
            .max(1);
        let used: usize = ctx.iter().map(|n| n.div_ceil(page)).sum();
        let blocks = used + 3;
        let mut ids: Vec<i32> = (0..blocks as i32).collect();
        ids.shuffle(&mut rng);
        let mut tables = vec![-1i32; ctx.len() * stride];
        let mut next = ids.into_iter();
        for (s, n) in ctx.iter().enumerate() {
            for e in &mut tables[s * stride..s * stride + n.div_ceil(page)] {
                *e = next.next().expect("enough blocks");
            }
        }
        let width = d.ctx_width();
        let rows = ctx.len() * d.block;
        // Values offset by 1 so outputs stay away from zero (the error is relative to max |out|).
        let offset = |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|v| v + 1.0).collect() };
        let mut pool = common::uniform(&mut rng, blocks * page * width, 1.0);
        let kvw = d.kv_width();
        for row in pool.chunks_exact_mut(width) {
            for x in &mut row[kvw..] {
                *x += 1.0;
            }
        }
        Case {
            d,
            page,
            ctx: ctx.to_vec(),
            stride,
            tables,
            q: common::uniform(&mut rng, rows * d.q_width(), 1.0),
            k: common::uniform(&mut rng, rows * kvw, 1.0),
            v: offset(common::uniform(&mut rng, rows * kvw, 1.0)),
            pool,
        }
    }

    /// Context row `p` of sequence `s` in `pool`.
    fn ctx_row<'a>(&self, pool: &'a [f32], s: usize, p: usize) -> &'a [f32] {
        let w = self.d.ctx_width();
        let blk = self.tables[s * self.stride + p / self.page] as usize;
        let at = blk * self.page + p % self.page;
        &pool[at * w..(at + 1) * w]
    }

    /// The definition in f64: `[S·B][H·d]`.
    fn reference(&self, pool: &[f32]) -> Vec<f64> {
        let d = &self.d;
        let (b, hd, kvw) = (d.block, d.head_dim, d.kv_width());
        let group = d.heads / d.kv_heads;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0.0f64; self.ctx.len() * b * d.q_width()];
        for (s, &n) in self.ctx.iter().enumerate() {
            // (key, value) of every key j of sequence s, KV head g.
            let kv = |j: usize, g: usize| -> (&[f32], &[f32]) {
                if j < n {
                    let row = self.ctx_row(pool, s, j);
                    (
                        &row[g * hd..(g + 1) * hd],
                        &row[kvw + g * hd..kvw + (g + 1) * hd],
                    )
                } else {
                    let r = (s * b + j - n) * kvw + g * hd;
                    (&self.k[r..r + hd], &self.v[r..r + hd])
                }
            };
            for i in 0..b {
                for h in 0..d.heads {
                    let g = h / group;
                    let qo = ((s * b + i) * d.heads + h) * hd;
                    let q = &self.q[qo..qo + hd];
                    let scores: Vec<f64> = (0..n + b)
                        .map(|j| {
                            let key = kv(j, g).0;
                            q.iter()
                                .zip(key)
                                .map(|(x, y)| *x as f64 * *y as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for (j, w) in e.iter().enumerate() {
                        for (o, x) in out[qo..qo + hd].iter_mut().zip(kv(j, g).1) {
                            *o += w / sum * *x as f64;
                        }
                    }
                }
            }
        }
        out
    }

    fn run(&self, b: &Backend, layer: &Layer) -> Vec<f32> {
        self.try_run(b, layer)
            .expect("block_attention")
            .into_host()
            .expect("download")
    }

    fn try_run(&self, b: &Backend, layer: &Layer) -> Result<Tensor, KernelError> {
        let q = b.upload(&self.q).expect("q");
        let k = b.upload(&self.k).expect("k");
        let v = b.upload(&self.v).expect("v");
        let tables = b.ints(self.tables.clone()).expect("tables");
        let ctx = b
            .ints(self.ctx.iter().map(|&n| n as i32).collect())
            .expect("ctx");
        let p = BlockAttention {
            q: &q,
            k: &k,
            v: &v,
            pages: layer.pages(),
            tables: &tables,
            stride: self.stride,
            ctx: &ctx,
            ctx_host: &self.ctx,
            heads: self.d.heads,
            kv_heads: self.d.kv_heads,
            head_dim: self.d.head_dim,
            block: self.d.block,
        };
        block_attention(b, p)
    }
}

const fn dims(block: usize, heads: usize, kv_heads: usize, head_dim: usize) -> BlockAttnDims {
    BlockAttnDims {
        heads,
        kv_heads,
        head_dim,
        block,
    }
}

/// `(what, dims, page, contexts)`: the tiny drafter's shape (d 32, GQA 4:1), a K3-like shape
/// (B 16, d 128), a block alone (no context), 20 block rows (two row chunks on a GPU), a head
/// dim that is not a power of two, and a context long enough to be split on a GPU.
const CASES: [(&str, BlockAttnDims, usize, &[usize]); 6] = [
    ("tiny", dims(4, 8, 2, 32), 8, &[0, 5, 37]),
    ("k3-like", dims(16, 16, 4, 128), 16, &[300, 1]),
    ("block only", dims(4, 4, 4, 64), 8, &[0, 0]),
    ("B = 20", dims(20, 4, 1, 64), 16, &[9, 130]),
    ("d = 96", dims(5, 6, 3, 96), 16, &[70]),
    ("long context", dims(4, 8, 2, 64), 64, &[5000]),
];

#[test]
fn block_attention_matches_the_definition() {
    for (i, (what, d, page, ctx)) in CASES.iter().enumerate() {
        let case = Case::new(*d, *page, ctx, 100 + i as u64);
        let want = case.reference(&case.pool);
        for b in backends() {
            let layer = Layer::new(&b, &case.pool, case.page, d.ctx_width());
            let got = case.run(&b, &layer);
            let keys = ctx.iter().max().copied().unwrap_or(0) + d.block;
            check_keys(&b, what, &got, &want, keys);
        }
    }
}

#[test]
fn the_cpu_arm_is_attend_block_bit_for_bit() {
    for (i, (what, d, page, ctx)) in CASES.iter().enumerate() {
        let case = Case::new(*d, *page, ctx, 200 + i as u64);
        let layer = Layer::new(&Backend::Cpu, &case.pool, case.page, d.ctx_width());
        let got = case.run(&Backend::Cpu, &layer);
        let (qw, kvw, w) = (d.block * d.q_width(), d.block * d.kv_width(), d.ctx_width());
        for (s, &n) in ctx.iter().enumerate() {
            let rows: Vec<f32> = (0..n)
                .flat_map(|p| case.ctx_row(&case.pool, s, p).iter().copied())
                .collect();
            let (q, k, v) = (
                &case.q[s * qw..(s + 1) * qw],
                &case.k[s * kvw..(s + 1) * kvw],
                &case.v[s * kvw..(s + 1) * kvw],
            );
            let mut want = vec![0.0f32; qw];
            let row = |p: usize| &rows[p * w..(p + 1) * w];
            attend_block(d, BlockRows { q, k, v }, n, row, &mut want).expect("attend_block");
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got[s * qw..(s + 1) * qw]),
                bits(&want),
                "{what}, sequence {s}: the paged op vs attend_block over the gathered rows"
            );
        }
    }
}

/// bf16 pages on a GPU: the kernel widens the stored bf16 context rows; the reference uses the
/// same rounded values.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[test]
fn block_attention_over_bf16_pages() {
    let gpus: Vec<Backend> = backends()
        .into_iter()
        .filter(|b| !matches!(b, Backend::Cpu))
        .collect();
    if gpus.is_empty() {
        eprintln!("skipping: no GPU");
    }
    for gpu in gpus {
        bf16_pages_on(&gpu);
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn bf16_pages_on(gpu: &Backend) {
    let (what, d, page, ctx) = CASES[0];
    let case = Case::new(d, page, ctx, 300);
    let bits: Vec<u16> = case
        .pool
        .iter()
        .map(|x| half::bf16::from_f32(*x).to_bits())
        .collect();
    let rounded: Vec<f32> = bits
        .iter()
        .map(|b| half::bf16::from_bits(*b).to_f32())
        .collect();
    let want = case.reference(&rounded);
    let store = match gpu {
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => PageStore::CudaBf16(dev.upload(&bits).expect("upload")),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => PageStore::RocmBf16(dev.upload(&bits).expect("upload")),
        Backend::Cpu => unreachable!("bf16 pages are a GPU layout"),
    };
    let layer = Layer {
        store,
        page,
        width: d.ctx_width(),
    };
    check(
        gpu,
        &format!("{what}, bf16 pages"),
        &case.run(gpu, &layer),
        &want,
    );
}

#[test]
fn scatter_rows_writes_each_row_at_its_slot() {
    let (page, width, blocks) = (4, 6, 5);
    let mut rng = common::rng(7);
    let base = common::uniform(&mut rng, blocks * page * width, 1.0);
    let rows = common::uniform(&mut rng, 3 * width, 1.0);
    let slots = vec![13i64, 0, 19];
    let mut want = base.clone();
    for (r, &s) in slots.iter().enumerate() {
        let s = s as usize;
        want[s * width..(s + 1) * width].copy_from_slice(&rows[r * width..(r + 1) * width]);
    }
    for b in backends() {
        let mut layer = Layer::new(&b, &base, page, width);
        let (t, sl) = (
            b.upload(&rows).expect("rows"),
            b.slots(slots.clone()).expect("slots"),
        );
        let p = ScatterRows {
            rows: &t,
            pages: layer.pages_mut(),
            slots: &sl,
        };
        scatter_rows(&b, p).expect("scatter_rows");
        assert_eq!(layer.to_host(), want, "scatter_rows on the {}", b.name());

        // Rows that are not a whole number of slots' rows: refused before anything runs.
        let short = b.upload(&rows[..width]).expect("rows");
        let p = ScatterRows {
            rows: &short,
            pages: layer.pages_mut(),
            slots: &sl,
        };
        let e = scatter_rows(&b, p).expect_err("too few rows").to_string();
        assert!(e.contains("scatter_rows") && e.contains("`rows`"), "{e}");
    }
}

#[test]
fn an_out_of_range_slot_is_an_error_naming_it() {
    let (page, width) = (4, 2);
    let mut data = vec![0.0f32; 2 * page * width];
    let rows = Backend::Cpu.upload(&[1.0, 2.0]).expect("rows");
    for bad in [8i64, -1] {
        let slots = Backend::Cpu.slots(vec![bad]).expect("slots");
        let p = ScatterRows {
            rows: &rows,
            pages: PagesMut::Host {
                data: &mut data,
                width,
            },
            slots: &slots,
        };
        let e = scatter_rows(&Backend::Cpu, p).expect_err("slot outside the pool");
        let msg = e.to_string();
        assert!(
            msg.contains("scatter_rows") && msg.contains("`slot`"),
            "{msg}"
        );
    }
    assert!(data.iter().all(|&x| x == 0.0), "nothing written");
}

#[test]
fn gather_concat_is_an_exact_copy() {
    let (width, n) = (5, 7);
    let mut rng = common::rng(11);
    let taps: Vec<Vec<f32>> = (0..3)
        .map(|_| common::uniform(&mut rng, n * width, 1.0))
        .collect();
    let rows = vec![6i32, 0, 3, 3];
    let mut want = Vec::new();
    for &r in &rows {
        for t in &taps {
            want.extend_from_slice(&t[r as usize * width..(r as usize + 1) * width]);
        }
    }
    for b in backends() {
        let srcs: Vec<_> = taps.iter().map(|t| b.upload(t).expect("tap")).collect();
        let refs: Vec<_> = srcs.iter().collect();
        let ids = b.ints(rows.clone()).expect("rows");
        let p = GatherConcat {
            srcs: &refs,
            rows: &ids,
            width,
        };
        let got = gather_concat(&b, p).expect("gather_concat").into_host();
        assert_eq!(got.expect("download"), want, "on the {}", b.name());
    }
    // A row past a source's end (host-checked on the CPU).
    let srcs: Vec<_> = taps
        .iter()
        .map(|t| Backend::Cpu.upload(t).expect("tap"))
        .collect();
    let refs: Vec<_> = srcs.iter().collect();
    let ids = Backend::Cpu.ints(vec![n as i32]).expect("rows");
    let p = GatherConcat {
        srcs: &refs,
        rows: &ids,
        width,
    };
    let e = gather_concat(&Backend::Cpu, p).expect_err("row 7 of 7");
    assert!(e.to_string().contains("gather_concat"), "{e}");
}

/// `ConfidenceHead::survival` (model/src/drafter/heads.rs) as it is today.
fn survival_as_in_heads(w: &[f32], b: f32, h: &[f32], e: &[f32]) -> f32 {
    let z: f32 = w
        .iter()
        .zip(h.iter().chain(e))
        .map(|(w, x)| w * x)
        .sum::<f32>()
        + b;
    1.0 / (1.0 + (-z).exp())
}

#[test]
fn confidence_is_the_survival_head() {
    let (rows, hid, rank) = (9, 96, 16);
    let mut rng = common::rng(13);
    let h = common::uniform(&mut rng, rows * hid, 1.0);
    let e = common::uniform(&mut rng, rows * rank, 1.0);
    let w = common::uniform(&mut rng, hid + rank, 0.2);
    let bias = 0.25;
    let want: Vec<f32> = (0..rows)
        .map(|r| {
            let (hr, er) = (&h[r * hid..(r + 1) * hid], &e[r * rank..(r + 1) * rank]);
            survival_as_in_heads(&w, bias, hr, er)
        })
        .collect();
    for b in backends() {
        let (ht, et, wt) = (
            b.upload(&h).expect("h"),
            b.upload(&e).expect("e"),
            b.upload(&w).expect("w"),
        );
        let p = Confidence {
            h: &ht,
            e: &et,
            w: &wt,
            bias,
        };
        let got = confidence(&b, p)
            .expect("confidence")
            .into_host()
            .expect("download");
        match b {
            Backend::Cpu => assert_eq!(got, want, "the CPU arm is survival, bit for bit"),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            _ => {
                let want64: Vec<f64> = want.iter().map(|&x| x as f64).collect();
                check(&b, "confidence", &got, &want64)
            }
        }
        // Lengths that no (rows, hidden, rank) explains.
        let short = b.upload(&h[..hid + 1]).expect("h");
        let p = Confidence {
            h: &short,
            e: &et,
            w: &wt,
            bias,
        };
        let err = confidence(&b, p).expect_err("bad h").to_string();
        assert!(err.contains("confidence"), "{err}");
    }
}

#[test]
fn block_attention_refuses_bad_shapes() {
    let d = dims(4, 8, 2, 32);
    let case = Case::new(d, 8, &[5, 37], 17);
    for b in backends() {
        let layer = Layer::new(&b, &case.pool, case.page, d.ctx_width());
        let q = b.upload(&case.q).expect("q");
        let k = b.upload(&case.k).expect("k");
        let v = b.upload(&case.v).expect("v");
        let tables = b.ints(case.tables.clone()).expect("tables");
        let ctx = b.ints(vec![5, 37]).expect("ctx");
        let ok = BlockAttention {
            q: &q,
            k: &k,
            v: &v,
            pages: layer.pages(),
            tables: &tables,
            stride: case.stride,
            ctx: &ctx,
            ctx_host: &case.ctx,
            heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
            block: d.block,
        };
        let msg = |p| block_attention(&b, p).expect_err("refused").to_string();
        // A context longer than the table covers.
        let e = msg(BlockAttention {
            ctx_host: &[5, 41],
            ..ok
        });
        assert!(
            e.contains("block_attention") && e.contains("needs 41"),
            "{e}"
        );
        // Queries of the wrong length.
        let e = msg(BlockAttention { k: &q, ..ok });
        assert!(e.contains("block_attention") && e.contains("`k`"), "{e}");
        // Heads not a multiple of the KV heads.
        let e = msg(BlockAttention { kv_heads: 3, ..ok });
        assert!(
            e.contains("block_attention") && e.contains("`heads`"),
            "{e}"
        );
        // Pages of another width.
        let e = msg(BlockAttention { head_dim: 16, ..ok });
        assert!(e.contains("block_attention"), "{e}");
    }
}

#[test]
fn cpu_block_ids_and_lengths_are_checked() {
    let d = dims(4, 8, 2, 32);
    let mut case = Case::new(d, 8, &[5, 37], 19);
    case.tables[case.stride + 2] = 1000;
    let layer = Layer::new(&Backend::Cpu, &case.pool, case.page, d.ctx_width());
    let e = case
        .try_run(&Backend::Cpu, &layer)
        .expect_err("block id 1000");
    assert!(e.to_string().contains("`block id`"), "{e}");
    let b = Backend::Cpu;
    let (q, k, v) = (
        b.upload(&case.q).expect("q"),
        b.upload(&case.k).expect("k"),
        b.upload(&case.v).expect("v"),
    );
    let tables = b.ints(case.tables.clone()).expect("tables");
    let ctx = b.ints(vec![5, 36]).expect("ctx");
    let p = BlockAttention {
        q: &q,
        k: &k,
        v: &v,
        pages: layer.pages(),
        tables: &tables,
        stride: case.stride,
        ctx: &ctx,
        ctx_host: &case.ctx,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        block: d.block,
    };
    let e = block_attention(&b, p).expect_err("ctx differs").to_string();
    assert!(e.contains("`ctx`"), "{e}");
}

/// An op handed an operand from another backend fails naming the op and the operand.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[test]
fn a_mixed_device_call_names_the_op_and_operand() {
    let Some(gpu) = backends().into_iter().find(|b| !matches!(b, Backend::Cpu)) else {
        eprintln!("skipping: no GPU");
        return;
    };
    let d = dims(4, 8, 2, 32);
    let case = Case::new(d, 8, &[5], 23);
    let layer = Layer::new(&gpu, &case.pool, case.page, d.ctx_width());
    let q = Backend::Cpu.upload(&case.q).expect("host q");
    let k = gpu.upload(&case.k).expect("k");
    let v = gpu.upload(&case.v).expect("v");
    let tables = gpu.ints(case.tables.clone()).expect("tables");
    let ctx = gpu.ints(vec![5]).expect("ctx");
    let p = BlockAttention {
        q: &q,
        k: &k,
        v: &v,
        pages: layer.pages(),
        tables: &tables,
        stride: case.stride,
        ctx: &ctx,
        ctx_host: &case.ctx,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        block: d.block,
    };
    let e = block_attention(&gpu, p).expect_err("host q").to_string();
    assert!(e.contains("block_attention") && e.contains("`q`"), "{e}");

    // Host pages into a GPU scatter.
    let mut data = vec![0.0f32; 8 * d.ctx_width()];
    let rows = gpu.upload(&vec![1.0; d.ctx_width()]).expect("rows");
    let slots = gpu.slots(vec![0]).expect("slots");
    let p = ScatterRows {
        rows: &rows,
        pages: PagesMut::Host {
            data: &mut data,
            width: d.ctx_width(),
        },
        slots: &slots,
    };
    let e = scatter_rows(&gpu, p).expect_err("host pages").to_string();
    assert!(e.contains("scatter_rows") && e.contains("`pages`"), "{e}");

    // A host tap into a GPU concatenation.
    let host = Backend::Cpu.upload(&[1.0, 2.0]).expect("tap");
    let ids = gpu.ints(vec![0]).expect("rows");
    let p = GatherConcat {
        srcs: &[&host],
        rows: &ids,
        width: 2,
    };
    let e = gather_concat(&gpu, p).expect_err("host src").to_string();
    assert!(e.contains("gather_concat") && e.contains("`src`"), "{e}");
}

/// One Markov-step case on the host: a block pass of `rows` rows, `n` inputs.
struct MarkovCase {
    vocab: usize,
    rank: usize,
    hid: usize,
    logits: Vec<f32>,
    hidden: Vec<f32>,
    /// W1 and W2 as stored (bf16-rounded when `bf16`).
    w1: Vec<f32>,
    w2: Vec<f32>,
    bf16: bool,
    cw: Vec<f32>,
    bias: f32,
    at: Vec<i32>,
    prev: Vec<i32>,
}

impl MarkovCase {
    fn new(vocab: usize, rank: usize, n: usize, bf16: bool, seed: u64) -> Self {
        let (rows, hid) = (40, 96);
        let mut rng = common::rng(seed);
        let round = |v: Vec<f32>| -> Vec<f32> {
            if bf16 {
                v.into_iter()
                    .map(|x| half::bf16::from_f32(x).to_f32())
                    .collect()
            } else {
                v
            }
        };
        let logits = common::uniform(&mut rng, rows * vocab, 2.0);
        let hidden = common::uniform(&mut rng, rows * hid, 1.0);
        let w1 = round(common::uniform(&mut rng, vocab * rank, 0.5));
        let w2 = round(common::uniform(&mut rng, vocab * rank, 0.5));
        let cw = common::uniform(&mut rng, hid + rank, 0.2);
        let at = (0..n).map(|s| ((s * 7 + 3) % rows) as i32).collect();
        // The last token, the first, and repeats.
        let mut prev: Vec<i32> = (0..n).map(|s| ((s * 131 + 5) % vocab) as i32).collect();
        prev[0] = vocab as i32 - 1;
        if n > 2 {
            prev[1] = 0;
            prev[2] = prev[0];
        }
        Self {
            vocab,
            rank,
            hid,
            logits,
            hidden,
            w1,
            w2,
            bf16,
            cw,
            bias: -0.1,
            at,
            prev,
        }
    }

    fn matrix(&self, w: &[f32]) -> Matrix {
        if self.bf16 {
            let bits = w.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Matrix::from_bf16(self.vocab, self.rank, bits).expect("bf16 matrix")
        } else {
            Matrix::from_f32(self.vocab, self.rank, w.to_vec()).expect("f32 matrix")
        }
    }

    /// `(logits [n][vocab], confidence [n])` in f64 for previous tokens `prev`; a token
    /// outside the vocabulary reads a zero W1 row.
    fn reference(&self, prev: &[i32]) -> (Vec<f64>, Vec<f64>) {
        let (v, r, h) = (self.vocab, self.rank, self.hid);
        let mut logits = Vec::new();
        let mut conf = Vec::new();
        for (&a, &t) in self.at.iter().zip(prev) {
            let a = a as usize;
            let e: Vec<f64> = match usize::try_from(t).ok().filter(|&t| t < v) {
                Some(t) => self.w1[t * r..(t + 1) * r]
                    .iter()
                    .map(|&x| x as f64)
                    .collect(),
                None => vec![0.0; r],
            };
            for j in 0..v {
                let bias: f64 = (0..r).map(|i| self.w2[j * r + i] as f64 * e[i]).sum();
                logits.push(self.logits[a * v + j] as f64 + bias);
            }
            let zh: f64 = (0..h)
                .map(|i| self.cw[i] as f64 * self.hidden[a * h + i] as f64)
                .sum();
            let ze: f64 = (0..r).map(|i| self.cw[h + i] as f64 * e[i]).sum();
            conf.push(1.0 / (1.0 + (-(zh + ze + self.bias as f64)).exp()));
        }
        (logits, conf)
    }

    fn run(
        &self,
        b: &Backend,
        at: &[i32],
        prev: &[i32],
    ) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        self.run_with(b, at, prev, &self.matrix(&self.w2))
    }

    /// [`Self::run`] with another W2.
    fn run_with(
        &self,
        b: &Backend,
        at: &[i32],
        prev: &[i32],
        w2: &Matrix,
    ) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let (w1, w2) = (
            b.weight(&self.matrix(&self.w1)).expect("w1"),
            b.weight(w2).expect("w2"),
        );
        let (logits, hidden, cw) = (
            b.upload(&self.logits).expect("logits"),
            b.upload(&self.hidden).expect("hidden"),
            b.upload(&self.cw).expect("cw"),
        );
        let (at, prev) = (
            b.ints(at.to_vec()).expect("at"),
            b.ints(prev.to_vec()).expect("prev"),
        );
        let out = markov_step(
            b,
            MarkovStep {
                logits: &logits,
                hidden: &hidden,
                at: &at,
                prev: &prev,
                w1: &w1,
                w2: &w2,
                conf_w: &cw,
                conf_bias: self.bias,
                precision: Precision::Exact,
            },
        )?;
        Ok((
            out.logits.into_host().expect("logits"),
            out.confidence.into_host().expect("confidence"),
        ))
    }
}

#[test]
fn markov_step_is_the_bigram_bias_and_the_confidence_head() {
    // (vocab, rank, inputs): a vocabulary that is no multiple of the GPU's 256-entry blocks,
    // two thread groups (8 + 3 inputs); a rank the GPU takes without its 8-wide loads; one
    // input (a single stream).
    for (i, (vocab, rank, n)) in [(1000, 24, 11), (777, 20, 3), (300, 64, 1)]
        .into_iter()
        .enumerate()
    {
        for bf16 in [false, true] {
            let case = MarkovCase::new(vocab, rank, n, bf16, 300 + i as u64);
            let (want_logits, want_conf) = case.reference(&case.prev);
            for b in backends() {
                let (logits, conf) = case.run(&b, &case.at, &case.prev).expect("markov_step");
                let what = format!("vocab {vocab} rank {rank} n {n} bf16 {bf16}");
                check(&b, &format!("{what}: logits"), &logits, &want_logits);
                check(&b, &format!("{what}: confidence"), &conf, &want_conf);
            }
        }
    }
}

#[test]
fn markov_step_ids_it_cannot_use() {
    let case = MarkovCase::new(500, 16, 4, false, 400);
    for b in backends() {
        let mut bad_prev = case.prev.clone();
        bad_prev[1] = -1;
        bad_prev[3] = 500;
        let mut bad_at = case.at.clone();
        bad_at[2] = 40;
        match b {
            Backend::Cpu => {
                let e = case.run(&b, &case.at, &bad_prev).expect_err("prev -1");
                let msg = e.to_string();
                assert!(msg.contains("markov_step") && msg.contains("prev"), "{msg}");
                let e = case.run(&b, &bad_at, &case.prev).expect_err("at 40 of 40");
                let msg = e.to_string();
                assert!(msg.contains("markov_step") && msg.contains("at"), "{msg}");
            }
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            _ => {
                // A previous token outside the vocabulary is a zero W1 row.
                let (logits, conf) = case.run(&b, &case.at, &bad_prev).expect("bad prev");
                let (want_logits, want_conf) = case.reference(&bad_prev);
                check(&b, "out-of-vocabulary prev: logits", &logits, &want_logits);
                check(&b, "out-of-vocabulary prev: confidence", &conf, &want_conf);
                // A row outside the pass is NaN, that input only.
                let (logits, conf) = case.run(&b, &bad_at, &case.prev).expect("bad at");
                let v = case.vocab;
                assert!(logits[2 * v..3 * v].iter().all(|x| x.is_nan()) && conf[2].is_nan());
                assert!(logits[..2 * v].iter().all(|x| x.is_finite()) && conf[3].is_finite());
            }
        }
        // W2 of another shape, on every backend.
        let short = Matrix::from_f32(499, 16, case.w2[..499 * 16].to_vec()).expect("w2");
        let e = case
            .run_with(&b, &case.at, &case.prev, &short)
            .expect_err("w2 [499][16]");
        assert!(e.to_string().contains("w2"), "{e}");
    }
}
