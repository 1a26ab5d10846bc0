//! One contract over every backend the machine has: each coarse op of `kernels::backend`, fed
//! the same inputs, must give what the CPU kernels give when called directly, sequence by
//! sequence, with the block tables and cache slots worked out by hand here. On the CPU this
//! checks the ops' own logic (splitting a run into sequences, padded block tables, slots, row
//! offsets) exactly: the arithmetic is the same code, so the result must be bit-identical. On a
//! CUDA device (the H200 runs; elsewhere only the CPU is tested) it checks the device arm
//! against the same reference within 1e-4 of max |reference| — f32 kernels in exact precision
//! differ from the CPU only in summation order (`cuda_parity.rs` states the same bound). Built
//! with `--features rocm` on a machine where `RocmDevice::open(0)` works, the ROCm arm is
//! held to the same 1e-4 (the same launchers over the portable f32 kernels, the tiled GEMM for
//! more than 8 rows); no AMD GPU has run it yet.

mod common;

use ferry_kernels::backend::latent::{latent_write, LatentWrite};
use ferry_kernels::backend::linear::{linear, linear_add, linear_pair, Linear, LinearPair};
use ferry_kernels::backend::mla_absorbed::{mla_absorbed, AbsorbedRun};
use ferry_kernels::backend::mla_mha::{mla_mha, MhaRun, MhaSeq};
use ferry_kernels::backend::moe::{moe, Moe, MoeFfn};
use ferry_kernels::backend::norm::{add_norm, rms_norm_into, AddNorm, RowNorm};
use ferry_kernels::backend::rope::RopeTable;
use ferry_kernels::backend::rows::{embed, gather, scatter_drafts, DraftIds, Embed, Gather};
use ferry_kernels::backend::{AttnKernels, Backend, Pages, PagesMut, Precision, Tensor, Weight};
use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mla::{
    mla_absorbed_form, mla_mha_attention, LatentContext, LatentPages, MlaDims, SeqAttn,
};
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::moe::{MoeLayer, MoeRouting};
use ferry_kernels::cpu::norm::{rms_norm, rms_norm_inplace};
use ferry_kernels::cpu::rope::{Rope, RopeParams, RopeScaling, RotaryLayout};

const DIMS: MlaDims = MlaDims {
    heads: 4,
    kv_lora_rank: 64,
    qk_nope_head_dim: 32,
    qk_rope_head_dim: 16,
    v_head_dim: 32,
};
const PAGE: usize = 8;
const BLOCKS: usize = 12;

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

/// Exact on the CPU (same code), summation order on a GPU.
fn tolerance(b: &Backend) -> f32 {
    match b {
        Backend::Cpu => 0.0,
        #[cfg(feature = "cuda")]
        Backend::Cuda(_) => 1e-4,
        #[cfg(feature = "rocm")]
        Backend::Rocm(_) => 1e-4,
    }
}

fn check(b: &Backend, what: &str, got: &[f32], want: &[f32]) {
    let err = common::max_abs_diff(got, want) / common::max_abs(want).max(1e-30);
    assert!(
        err <= tolerance(b),
        "{what} on the {}: rel err {err:.2e}",
        b.name()
    );
    eprintln!("{what} on the {}: rel err {err:.2e}", b.name());
}

/// The layer's pages as the backend's attention reads them (uploaded on a GPU); the buffer
/// that owns them, kept alive by the caller.
enum PageStore {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(ferry_kernels::cuda::DeviceBuffer<f32>),
    #[cfg(feature = "rocm")]
    Rocm(ferry_kernels::rocm::HipBuffer<f32>),
}

impl PageStore {
    fn new(b: &Backend, data: &[f32]) -> Self {
        match b {
            Backend::Cpu => PageStore::Host(data.to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => PageStore::Cuda(d.upload(data).expect("upload pages")),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => PageStore::Rocm(d.upload(data).expect("upload pages")),
        }
    }

    fn pages(&self) -> Pages<'_> {
        match self {
            PageStore::Host(data) => Pages::Host(LatentPages {
                data,
                page_size: PAGE,
                width: DIMS.latent_width(),
            }),
            #[cfg(feature = "cuda")]
            PageStore::Cuda(buf) => Pages::Cuda(view(buf.ptr())),
            #[cfg(feature = "rocm")]
            PageStore::Rocm(buf) => Pages::Rocm(view(buf.ptr())),
        }
    }

    fn pages_mut(&mut self) -> PagesMut<'_> {
        match self {
            PageStore::Host(data) => PagesMut::Host {
                data,
                width: DIMS.latent_width(),
            },
            #[cfg(feature = "cuda")]
            PageStore::Cuda(buf) => PagesMut::Cuda(view(buf.ptr())),
            #[cfg(feature = "rocm")]
            PageStore::Rocm(buf) => PagesMut::Rocm(view(buf.ptr())),
        }
    }

    fn to_host(&self) -> Vec<f32> {
        match self {
            PageStore::Host(d) => d.clone(),
            #[cfg(feature = "cuda")]
            PageStore::Cuda(buf) => buf.device().download(buf).expect("download pages"),
            #[cfg(feature = "rocm")]
            PageStore::Rocm(buf) => buf.device().download(buf).expect("download pages"),
        }
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn view(ptr: u64) -> ferry_kernels::gpu::ops::PagesView {
    ferry_kernels::gpu::ops::PagesView {
        ptr,
        bf16: false,
        num_blocks: BLOCKS,
        page_size: PAGE,
        width: DIMS.latent_width(),
        split: 0,
    }
}

fn kv_b(seed: u64) -> Matrix {
    let mut rng = common::rng(seed);
    let rows = DIMS.heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim);
    let data = common::uniform(&mut rng, rows * DIMS.kv_lora_rank, 0.2);
    Matrix::from_f32(rows, DIMS.kv_lora_rank, data).expect("kv_b")
}

/// The CPU reference's view of one sequence in the test cache (pages of `PAGE` rows of the
/// latent width): `queries` new tokens after `start` cached positions.
fn latent_context<'a>(
    cache: &'a [f32],
    table: &'a [u32],
    (start, queries): (usize, usize),
    scale: f32,
) -> LatentContext<'a> {
    LatentContext {
        pages: LatentPages {
            data: cache,
            page_size: PAGE,
            width: DIMS.latent_width(),
        },
        seq: SeqAttn {
            block_table: table,
            start_pos: start,
            num_queries: queries,
        },
        scale,
    }
}

/// Two sequences decoding one token each in one absorbed run (rows 1 and 2 of a three-row
/// batch, block tables of different lengths padded to one stride), and an MHA-form run of two
/// sequences (rows 1–11 of twelve): a 4-token chunk after 5 cached positions, then a fresh
/// 7-token prompt over three blocks — each equal to its own reference, row 0 untouched.
#[test]
fn attention_ops_match_the_cpu_kernels_on_every_backend() {
    let width = DIMS.latent_width();
    let mut rng = common::rng(7);
    let cache = common::uniform(&mut rng, BLOCKS * PAGE * width, 1.0);
    let kv_b_m = kv_b(8);
    let qk = DIMS.heads * DIMS.qk_head_dim();
    let hv = DIMS.heads * DIMS.v_head_dim;
    let q = common::uniform(&mut rng, 3 * qk, 1.0);
    let scale = 0.125;
    // Sequence A: blocks [5, 2, 7], context 20 (query at position 19); B: [1, 9], context 10.
    let tables: [&[u32]; 2] = [&[5, 2, 7], &[1, 9]];
    let ctx = [20usize, 10];
    let mut want = vec![0.0f32; 3 * hv];
    for i in 0..2 {
        let lc = latent_context(&cache, tables[i], (ctx[i] - 1, 1), scale);
        let row = 1 + i;
        mla_absorbed_form(
            &q[row * qk..(row + 1) * qk],
            &DIMS,
            &kv_b_m,
            &lc,
            &mut want[row * hv..(row + 1) * hv],
        )
        .expect("reference absorbed");
    }
    // MHA form, one run: C on blocks [3, 4], 4 queries after 5 cached positions; D on blocks
    // [10, 6, 11], a fresh prompt of 7 (its table the longer: the run's stride is 3).
    let mha_seqs = [
        (&[3u32, 4][..], MhaSeq { sq: 4, start: 5 }),
        (&[10u32, 6, 11][..], MhaSeq { sq: 7, start: 0 }),
    ];
    let mha_rows: usize = mha_seqs.iter().map(|(_, s)| s.sq).sum();
    let q_c = common::uniform(&mut rng, (1 + mha_rows) * qk, 1.0);
    let mut want_c = vec![0.0f32; (1 + mha_rows) * hv];
    let mut row = 1;
    for (table, s) in &mha_seqs {
        let lc = latent_context(&cache, table, (s.start, s.sq), scale);
        mla_mha_attention(
            &q_c[row * qk..(row + s.sq) * qk],
            &DIMS,
            &kv_b_m,
            &lc,
            &mut want_c[row * hv..(row + s.sq) * hv],
        )
        .expect("reference mha");
        row += s.sq;
    }

    for b in backends() {
        let store = PageStore::new(&b, &cache);
        let w = b.weight(&kv_b_m).expect("weight");
        let q_t = b.upload(&q).expect("q");
        let mut out = b.zeros(3 * hv).expect("out");
        let run = AbsorbedRun {
            q: &q_t,
            first_row: 1,
            seqs: 2,
            sq: 1,
            tables: &b.ints(vec![5, 2, 7, 1, 9, 0]).expect("tables"),
            stride: 3,
            ctx: &b.ints(vec![20, 10]).expect("ctx"),
            max_ctx: 20,
            kv_b: &w,
            pages: store.pages(),
            dims: DIMS,
            scale,
            kernels: AttnKernels {
                precision: Precision::Exact,
                ..AttnKernels::default()
            },
            out: &mut out,
        };
        mla_absorbed(&b, run).expect("absorbed run");
        let got = out.to_host().expect("download");
        assert!(
            got[..hv].iter().all(|&v| v == 0.0),
            "row 0 is not the run's"
        );
        check(&b, "absorbed run of 2 sequences", &got, &want);

        let q_t = b.upload(&q_c).expect("q");
        let mut out = b.zeros((1 + mha_rows) * hv).expect("out");
        let seqs = mha_seqs.map(|(_, s)| s);
        let run = MhaRun {
            q: &q_t,
            first_row: 1,
            seqs: &seqs,
            tables: &b.ints(vec![3, 4, 0, 10, 6, 11]).expect("tables"),
            stride: 3,
            cu_q: &b.ints(vec![0, 4, 11]).expect("cu_q"),
            cu_k: &b.ints(vec![0, 9, 16]).expect("cu_k"),
            q_seq: &b
                .ints([[0; 4].as_slice(), &[1; 7]].concat())
                .expect("q_seq"),
            kv_b: &w,
            pages: store.pages(),
            dims: DIMS,
            scale,
            precision: Precision::Exact,
            out: &mut out,
        };
        mla_mha(&b, run).expect("mha run");
        let got = out.to_host().expect("download");
        assert!(
            got[..hv].iter().all(|&v| v == 0.0),
            "row 0 is not the MHA run's"
        );
        check(&b, "MHA-form run of a chunk and a prompt", &got, &want_c);
    }
}

/// Three new tokens' latent rows (positions 19, 9 and 5 of three sequences) normalised,
/// rotated and written at their cache slots; every other row untouched. The same op rotates
/// the tokens' queries (3 or 37 heads of 40 floats, the rope part at 24) exactly as the CPU's
/// RoPE does: on a GPU in the latent's launch, bitwise what the rope kernel gives. A GPU block
/// rotates 32 heads of this rope dim, so 37 heads take two blocks, the second partly idle.
#[test]
fn latent_write_lands_each_row_at_its_slot_on_every_backend() {
    let width = DIMS.latent_width();
    let kv_lora = DIMS.kv_lora_rank;
    let mut rng = common::rng(11);
    let cache = common::uniform(&mut rng, BLOCKS * PAGE * width, 1.0);
    let latent = common::uniform(&mut rng, 3 * width, 2.0);
    let norm = common::uniform(&mut rng, kv_lora, 1.0);
    let rope = Rope::new(&RopeParams {
        dim: DIMS.qk_rope_head_dim,
        theta: 10_000.0,
        scaling: RopeScaling::None,
        interleaved: true,
    })
    .expect("rope");
    let positions = [19usize, 9, 5];
    // Position 19 of blocks [5, 2, 7] is block 7 offset 3; 9 of [1, 9] is block 9 offset 1;
    // 5 of [3, 4] is block 3 offset 5.
    let slots = vec![
        7 * PAGE as i64 + 3,
        9 * PAGE as i64 + 1,
        3 * PAGE as i64 + 5,
    ];
    let mut rows = latent.clone();
    for row in rows.chunks_exact_mut(width) {
        rms_norm_inplace(&mut row[..kv_lora], &norm, 1e-6).expect("norm");
    }
    let layout = RotaryLayout {
        heads: 1,
        head_stride: width,
        offset: kv_lora,
    };
    rope.apply(&mut rows, &positions, layout).expect("rope");
    let mut want = cache.clone();
    for (row, &s) in rows.chunks_exact(width).zip(&slots) {
        let s = s as usize;
        want[s * width..(s + 1) * width].copy_from_slice(row);
    }
    for heads in [3, 37] {
        let q_layout = RotaryLayout {
            heads,
            head_stride: 40,
            offset: 24,
        };
        let queries = common::uniform(&mut rng, 3 * heads * 40, 1.0);
        let mut want_q = queries.clone();
        rope.apply(&mut want_q, &positions, q_layout).expect("rope");
        latent_write_on_every_backend(
            (&cache, &want),
            (&latent, &norm, &rope, &positions, &slots),
            (&queries, q_layout, &want_q),
        );
    }
}

/// One case of [`latent_write_lands_each_row_at_its_slot_on_every_backend`] on every backend:
/// `(cache, want)`, `(latent, norm, rope, positions, slots)`, `(queries, layout, want_q)`.
type LatentInputs<'a> = (&'a [f32], &'a [f32], &'a Rope, &'a [usize], &'a [i64]);
fn latent_write_on_every_backend(
    (cache, want): (&[f32], &[f32]),
    (latent, norm, rope, positions, slots): LatentInputs<'_>,
    (queries, q_layout, want_q): (&[f32], RotaryLayout, &[f32]),
) {
    for b in backends() {
        let mut store = PageStore::new(&b, cache);
        let mut lat = b.upload(latent).expect("latent");
        let mut q = b.upload(queries).expect("queries");
        let table = RopeTable::new(&b, rope, positions).expect("rope table");
        let p = LatentWrite {
            latent: &mut lat,
            norm: &b.upload(norm).expect("norm"),
            eps: 1e-6,
            rope: &table,
            slots: &b.slots(slots.to_vec()).expect("slots"),
            pages: store.pages_mut(),
            queries: Some((&mut q, q_layout)),
        };
        latent_write(&b, p).expect("latent write");
        check(&b, "latent write", &store.to_host(), want);
        let heads = q_layout.heads;
        check(
            &b,
            &format!("queries' rope, {heads} heads"),
            &q.to_host().expect("q"),
            want_q,
        );
    }
}

/// Embedding → `h += delta`, `x = norm(h)` → the wanted rows → a projection, as a forward
/// strings them together.
#[test]
fn row_norm_and_linear_ops_match_the_cpu_kernels_on_every_backend() {
    let (vocab, hidden, out_dim) = (50, 24, 40);
    let mut rng = common::rng(13);
    let table = Matrix::from_f32(
        vocab,
        hidden,
        common::uniform(&mut rng, vocab * hidden, 1.0),
    )
    .expect("table");
    let w = Matrix::from_f32(
        out_dim,
        hidden,
        common::uniform(&mut rng, out_dim * hidden, 0.3),
    )
    .expect("w");
    let ids = vec![3i32, 49, 0, 17, 3, 8, 22, 41, 9, 30];
    let delta = common::uniform(&mut rng, ids.len() * hidden, 1.0);
    let weight = common::uniform(&mut rng, hidden, 1.0);
    let picked = vec![9i32, 0, 4];

    let mut h = vec![0.0f32; ids.len() * hidden];
    for (row, &id) in h.chunks_exact_mut(hidden).zip(&ids) {
        table.row_f32(id as usize, row).expect("row");
    }
    for (a, d) in h.iter_mut().zip(&delta) {
        *a += d;
    }
    let mut x = vec![0.0f32; h.len()];
    rms_norm(&h, &weight, 1e-6, &mut x).expect("norm");
    let rows: Vec<f32> = picked
        .iter()
        .flat_map(|&r| x[r as usize * hidden..(r as usize + 1) * hidden].to_vec())
        .collect();
    let mut want = vec![0.0f32; picked.len() * out_dim];
    ferry_kernels::cpu::gemm::linear(&rows, &w, &mut want).expect("linear");

    for b in backends() {
        let ids_t = b.ints(ids.clone()).expect("ids");
        let table_w: Weight = b.weight(&table).expect("table");
        let mut h_t = embed(
            &b,
            Embed {
                table: &table_w,
                ids: &ids_t,
            },
        )
        .expect("embed");
        let mut x_t: Tensor = b.zeros(h.len()).expect("x");
        let p = AddNorm {
            h: &mut h_t,
            delta: Some(&b.upload(&delta).expect("delta")),
            weight: &b.upload(&weight).expect("weight"),
            out: Some(&mut x_t),
            width: hidden,
            eps: 1e-6,
        };
        add_norm(&b, p).expect("add_norm");
        check(&b, "embedding + residual", &h_t.to_host().expect("h"), &h);
        let g = gather(
            &b,
            Gather {
                src: &x_t,
                rows: &b.ints(picked.clone()).expect("rows"),
                width: hidden,
            },
        )
        .expect("gather");
        let w_t = b.weight(&w).expect("w");
        let y = linear(
            &b,
            Linear {
                x: &g,
                w: &w_t,
                precision: Precision::Exact,
            },
        )
        .expect("linear");
        check(
            &b,
            "norm → gather → linear",
            &y.to_host().expect("y"),
            &want,
        );
    }
}

/// More rows than the GEMV kernel takes (37): each backend's large GEMM — cuBLAS (split-bf16
/// activations against bf16 weights) on CUDA, the portable tiled kernel on ROCm — against the
/// CPU's, for f32 and bf16 weights and widths that are multiples of no tile.
#[test]
fn linear_above_the_gemv_rows_matches_the_cpu_on_every_backend() {
    let (m, k, n) = (37, 70, 93);
    let mut rng = common::rng(17);
    let x = common::uniform(&mut rng, m * k, 1.0);
    let wf = common::uniform(&mut rng, n * k, 0.3);
    let weights = [
        Matrix::from_f32(n, k, wf.clone()).expect("f32 w"),
        Matrix::from_bf16(n, k, wf.iter().map(|&v| half::bf16::from_f32(v)).collect())
            .expect("bf16 w"),
    ];
    for w in &weights {
        let mut want = vec![0.0f32; m * n];
        ferry_kernels::cpu::gemm::linear(&x, w, &mut want).expect("cpu linear");
        for b in backends() {
            let (x_t, w_t) = (b.upload(&x).expect("x"), b.weight(w).expect("w"));
            let p = Linear {
                x: &x_t,
                w: &w_t,
                precision: Precision::Exact,
            };
            let y = linear(&b, p).expect("linear").to_host().expect("y");
            let dtype = if w.bytes() == n * k * 2 {
                "bf16"
            } else {
                "f32"
            };
            check(&b, &format!("linear, {m} rows, {dtype} weights"), &y, &want);
        }
    }
}

/// 2–16 rows (small decode batches, a speculative round's verify forward): on a CUDA card the
/// tensor-core skinny GEMM takes bf16 weights whose width is a multiple of 32
/// (`gemv_mma_bf16`), elsewhere the GEMV (≤ 8 rows) or the large GEMM. Every backend must match
/// the CPU (1e-4: x enters the tensor cores as bf16 hi + lo, ~16 mantissa bits) for
/// `linear` and for `linear_add` into a residual; and on CUDA a row's result must not depend
/// on the rows beside it or on their count, so the verify rows of rounds of any length project
/// alike. Negative control: one changed input row moves its own output row and no other.
#[test]
fn projections_of_two_to_sixteen_rows_match_the_cpu_and_keep_rows_apart() {
    let mut rng = common::rng(29);
    // 64 and 96: the skinny GEMM's widths; 70: not a multiple of 32 (GEMV / large GEMM).
    for (k, n) in [(64, 40), (96, 19), (70, 24)] {
        let wf = common::uniform(&mut rng, n * k, 0.3);
        let weights = [
            Matrix::from_f32(n, k, wf.clone()).expect("f32 w"),
            Matrix::from_bf16(n, k, wf.iter().map(|&v| half::bf16::from_f32(v)).collect())
                .expect("bf16 w"),
        ];
        let x = common::uniform(&mut rng, 16 * k, 1.0);
        let h0 = common::uniform(&mut rng, 16 * n, 1.0);
        for w in &weights {
            let bf16 = w.bytes() == n * k * 2;
            for b in backends() {
                let w_t = b.weight(w).expect("w");
                let project = |x: &[f32]| {
                    let x_t = b.upload(x).expect("x");
                    let p = Linear {
                        x: &x_t,
                        w: &w_t,
                        precision: Precision::Exact,
                    };
                    linear(&b, p).expect("linear").to_host().expect("y")
                };
                let all = project(&x);
                for m in [2, 5, 8, 9, 16] {
                    let what = format!("{} k {k} m {m} bf16 {bf16}", b.name());
                    let xs = &x[..m * k];
                    let mut want = vec![0.0f32; m * n];
                    ferry_kernels::cpu::gemm::linear(xs, w, &mut want).expect("cpu linear");
                    let y = project(xs);
                    check(&b, &format!("linear, {what}"), &y, &want);
                    let mut h_t = b.upload(&h0[..m * n]).expect("h");
                    let x_t = b.upload(xs).expect("x");
                    let p = Linear {
                        x: &x_t,
                        w: &w_t,
                        precision: Precision::Exact,
                    };
                    linear_add(&b, p, &mut h_t).expect("linear_add");
                    let summed: Vec<f32> = h0.iter().zip(&want).map(|(a, c)| a + c).collect();
                    let got = h_t.to_host().expect("h");
                    check(&b, &format!("linear_add, {what}"), &got, &summed);
                    #[cfg(feature = "cuda")]
                    if matches!(b, Backend::Cuda(_)) && bf16 && k % 32 == 0 {
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&y), bits(&all[..m * n]), "{what}: rows depend on m");
                        let sum = bits(&y.iter().zip(&h0).map(|(a, c)| c + a).collect::<Vec<_>>());
                        assert_eq!(bits(&got), sum, "{what}: linear_add is not h + linear");
                        let mut x2 = xs.to_vec();
                        x2[k] += 1.0;
                        let y2 = project(&x2);
                        let moved: Vec<usize> = (0..m)
                            .filter(|r| {
                                bits(&y[r * n..(r + 1) * n]) != bits(&y2[r * n..(r + 1) * n])
                            })
                            .collect();
                        assert_eq!(moved, vec![1], "{what}: rows a changed input row moved");
                    }
                }
            }
        }
    }
}

/// Two projections of one input (an attention layer's first query projection and kv_a):
/// `linear_pair` must give bitwise what two `linear` calls give on every backend — on a GPU
/// one `gemv_mma_bf16` launch for 2–16 rows of bf16 weights where the skinny GEMM takes both
/// (the first's rows a multiple of 8), else one `gemv_pair` launch up to 8 rows, two launches
/// above (on CUDA, bf16 weights: both on cuBLAS from one conversion of `x`) — for f32 and bf16
/// weights, widths on and off the GEMV's 8-wide vector path and the skinny GEMM's, weights of
/// different element types (which are never fused), and both GEMM precisions.
#[test]
fn linear_pair_is_bitwise_two_linears_on_every_backend() {
    let mut rng = common::rng(19);
    for (k, n1, n2) in [(64, 40, 9), (96, 33, 17), (70, 33, 17)] {
        let w1 = common::uniform(&mut rng, n1 * k, 0.3);
        let w2 = common::uniform(&mut rng, n2 * k, 0.3);
        let bf = |v: &[f32]| {
            v.iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect::<Vec<_>>()
        };
        let pairs = [
            (
                Matrix::from_f32(n1, k, w1.clone()).expect("w1"),
                Matrix::from_f32(n2, k, w2.clone()).expect("w2"),
            ),
            (
                Matrix::from_bf16(n1, k, bf(&w1)).expect("w1"),
                Matrix::from_bf16(n2, k, bf(&w2)).expect("w2"),
            ),
            (
                Matrix::from_bf16(n1, k, bf(&w1)).expect("w1"),
                Matrix::from_f32(n2, k, w2.clone()).expect("w2"),
            ),
        ];
        for (m, precision) in [1, 3, 8, 9, 16, 17, 64]
            .into_iter()
            .flat_map(|m| [(m, Precision::Exact), (m, Precision::Fast)])
        {
            let x = common::uniform(&mut rng, m * k, 1.0);
            for (a, c) in &pairs {
                for b in backends() {
                    let (x_t, a_t, c_t) = (
                        b.upload(&x).expect("x"),
                        b.weight(a).expect("a"),
                        b.weight(c).expect("c"),
                    );
                    let one = |w| {
                        let p = Linear {
                            x: &x_t,
                            w,
                            precision,
                        };
                        linear(&b, p).expect("linear").to_host().expect("y")
                    };
                    let p = LinearPair {
                        x: &x_t,
                        first: &a_t,
                        second: &c_t,
                        precision,
                    };
                    let (y1, y2) = linear_pair(&b, p).expect("linear_pair");
                    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                    let what = format!("{} k {k} m {m} {precision:?}", b.name());
                    assert_eq!(
                        bits(y1.to_host().expect("y1")),
                        bits(one(&a_t)),
                        "{what}: first"
                    );
                    assert_eq!(
                        bits(y2.to_host().expect("y2")),
                        bits(one(&c_t)),
                        "{what}: second"
                    );
                }
            }
        }
    }
}

/// An MoE layer: 8 routed experts in 4 groups (2 kept), top-2, and a shared expert twice the
/// routed width (two stacked chunks on a GPU), so each token has 4 slots. The router favours
/// expert 5 for tokens whose first feature is large, which a third of the tokens get: its
/// group of pairs then spans many chunks of the grouped kernels, most experts a few.
fn moe_layer(
    rng: &mut rand_chacha::ChaCha8Rng,
    hidden: usize,
    inter: usize,
    bf16: bool,
) -> MoeLayer {
    let mut mlp = |w: usize| {
        GatedMlp::new(
            matrix_weight(rng, w, hidden, bf16),
            matrix_weight(rng, w, hidden, bf16),
            matrix_weight(rng, hidden, w, bf16),
        )
        .expect("shapes")
    };
    let experts = (0..8).map(|_| mlp(inter)).collect();
    let shared = Some(mlp(2 * inter));
    let mut router = common::uniform(rng, 8 * hidden, 0.5);
    router[5 * hidden] = 3.0;
    MoeLayer {
        routing: MoeRouting {
            n_experts: 8,
            top_k: 2,
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            scoring: Default::default(),
        },
        router: Matrix::from_f32(8, hidden, router).expect("len"),
        correction_bias: common::uniform(rng, 8, 0.1),
        experts,
        shared,
    }
}

/// The MoE op adds what the CPU layer computes into `h`, for a few tokens (the per-pair device
/// kernels) and for batches (the expert-grouped kernels: one chunk, many chunks per expert,
/// and more tokens than one grouped pass takes), with bf16 and f32 experts. On CUDA, bf16
/// experts of widths that are multiples of 32 take the tensor-core kernels (activations split
/// into bf16 hi + lo, so the same 1e-4 bound holds), the rest the CUDA-core ones.
#[test]
fn moe_matches_the_cpu_layer_on_every_backend() {
    let mut rng = common::rng(23);
    for ((hidden, inter), bf16) in [((64, 40), true), ((64, 40), false), ((96, 64), true)] {
        let layer = moe_layer(&mut rng, hidden, inter, bf16);
        // 9 tokens of these small experts stay per pair (`moe_grouped`); 20 on are grouped
        // (on CUDA's tensor cores: chunks of 16 pairs up to 128 tokens, of 32 at 150, of 16
        // again from 300).
        for tokens in [1, 3, 9, 20, 37, 150, 300, 2100] {
            let mut x = common::uniform(&mut rng, tokens * hidden, 1.0);
            for t in (0..tokens).step_by(3) {
                x[t * hidden] = 2.0;
            }
            let h0 = common::uniform(&mut rng, tokens * hidden, 1.0);
            let mut y = vec![0.0f32; x.len()];
            layer.forward(&x, &mut y).expect("cpu moe");
            let want: Vec<f32> = h0.iter().zip(&y).map(|(h, y)| h + y).collect();
            for b in backends() {
                let w = Moe::to_backend(&layer, 2, &b).expect("upload");
                let (x_t, mut h_t) = (b.upload(&x).expect("x"), b.upload(&h0).expect("h"));
                let p = MoeFfn {
                    w: &w,
                    x: &x_t,
                    h: &mut h_t,
                    precision: Precision::Exact,
                };
                moe(&b, p).expect("moe");
                let got = h_t.to_host().expect("h");
                let dtype = if bf16 { "bf16" } else { "f32" };
                let what = format!("moe {hidden}x{inter}, {tokens} tokens, {dtype} experts");
                check(&b, &what, &got, &want);
            }
        }
    }
}

/// One token's MoE with the shared-expert slots launched beside the router
/// (`ops::moe_token_beside`: on the device's second stream where it has one, CUDA; in order on
/// the one stream otherwise) is bitwise the per-pair path after the router and the routing —
/// the same kernels on the same operands, only the launch order differs. (With `--features
/// cuda` the test above already takes the side stream for its one-token case, against the
/// CPU.)
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[test]
fn one_token_moe_beside_the_router_is_bitwise_the_per_pair_path() {
    let mut rng = common::rng(29);
    for ((hidden, inter), bf16) in [((64, 40), true), ((96, 64), false)] {
        let layer = moe_layer(&mut rng, hidden, inter, bf16);
        for first in [2.0f32, -1.0] {
            let mut x = common::uniform(&mut rng, hidden, 1.0);
            x[0] = first; // 2.0 favours expert 5 (see `moe_layer`)
            let h0 = common::uniform(&mut rng, hidden, 1.0);
            for b in backends() {
                let w = Moe::to_backend(&layer, 2, &b).expect("upload");
                match (&b, &w) {
                    #[cfg(feature = "cuda")]
                    (
                        Backend::Cuda(dev),
                        Moe::Cuda {
                            router,
                            bias,
                            experts,
                            routing,
                        },
                    ) => beside_equals_per_pair(dev, (router, bias, experts, *routing), &x, &h0),
                    #[cfg(feature = "rocm")]
                    (
                        Backend::Rocm(dev),
                        Moe::Rocm {
                            router,
                            bias,
                            experts,
                            routing,
                        },
                    ) => beside_equals_per_pair(dev, (router, bias, experts, *routing), &x, &h0),
                    _ => {}
                }
            }
        }
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn beside_equals_per_pair<D: ferry_kernels::gpu::launch::Gpu>(
    dev: &D,
    (router, bias, experts, routing): (
        &ferry_kernels::gpu::ops::GpuMatrix<D>,
        &D::Buffer<f32>,
        &ferry_kernels::gpu::ops::GpuExperts<D>,
        ferry_kernels::gpu::ops::RouteParams,
    ),
    x: &[f32],
    h0: &[f32],
) {
    use ferry_kernels::gpu::launch::DeviceMem;
    use ferry_kernels::gpu::ops::{self, GemmPrecision, MoeArgs, MoeToken, PerPairKernels, Routes};
    assert!(routing.n_shared > 0 && experts.shared_ids.is_some());
    let gemm = GemmPrecision::Exact;
    let slots = (routing.top_k + routing.n_shared) as usize;
    // 0: router, routing, per-pair kernels; 1: beside, one stream; 2: beside, side stream.
    let run = |path: u8| -> Option<Vec<u32>> {
        let side = match path {
            0 | 1 => dev.clone(),
            _ => dev.side()?,
        };
        let x_d = dev.upload(x).expect("x");
        let h_d = dev.upload(h0).expect("h");
        if path == 0 {
            let logits = dev.alloc::<f32>(router.rows()).expect("logits");
            ops::linear(dev, x_d.v(), router, logits.v(), gemm).expect("router");
            let ids = dev.alloc::<i32>(slots).expect("ids");
            let w = dev.alloc::<f32>(slots).expect("weights");
            let routes = Routes {
                ids: ids.v(),
                weights: w.v(),
                slots,
            };
            ops::moe_route(dev, logits.v(), bias.v(), routing, routes).expect("route");
            let a = MoeArgs {
                x: x_d.v(),
                routes,
                experts,
                h: h_d.v(),
                x_split: None,
            };
            ops::moe_experts_per_pair(dev, a, PerPairKernels::from_env()).expect("experts");
        } else {
            let m = MoeToken {
                x: x_d.v(),
                router,
                bias: bias.v(),
                routing,
                experts,
                h: h_d.v(),
                gemm,
            };
            ops::moe_token_beside(dev, &side, m).expect("beside");
        }
        let h = dev.download(&h_d).expect("h");
        Some(h.iter().map(|v| v.to_bits()).collect())
    };
    let want = run(0).expect("per pair");
    assert_ne!(
        want,
        h0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "h changed"
    );
    assert_eq!(run(1).expect("one stream"), want, "beside, one stream");
    if let Some(got) = run(2) {
        assert_eq!(got, want, "beside, side stream");
    }
}

/// The L2 warm-up of a layer (`FERRY_L2_WARM`, `gpu::l2`, `backend::l2`) names exactly the
/// shared experts' bytes in the stacked device matrices — gate and up rows, and each chunk's
/// columns of the down projection — and warming changes nothing the layer computes: `h` is
/// bitwise the same after a warm-up of every part (with `o_proj`, and evict-last or not). (On
/// CUDA sm_90 the prefetch kernel runs; elsewhere nothing is queued and the ranges are still
/// checked.)
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[test]
fn l2_warm_names_the_shared_experts_and_changes_no_result() {
    use ferry_kernels::gpu::l2::L2Warm;
    let mut rng = common::rng(37);
    let parts = |gate_up, down, o_proj, last| L2Warm {
        gate_up,
        down,
        o_proj,
        last,
        ..L2Warm::default()
    };
    for ((hidden, inter), bf16) in [((64, 40), true), ((96, 64), false)] {
        let layer = moe_layer(&mut rng, hidden, inter, bf16);
        let o_proj = matrix_weight(&mut rng, hidden, hidden, bf16);
        let x = common::uniform(&mut rng, 3 * hidden, 1.0);
        let h0 = common::uniform(&mut rng, 3 * hidden, 1.0);
        for b in backends() {
            let w = Moe::to_backend(&layer, 2, &b).expect("upload");
            let o = b.weight(&o_proj).expect("o_proj");
            match (&b, &w) {
                #[cfg(feature = "cuda")]
                (Backend::Cuda(dev), Moe::Cuda { experts, .. }) => {
                    warm_names_the_shared_experts(dev, experts, &layer, 2)
                }
                #[cfg(feature = "rocm")]
                (Backend::Rocm(dev), Moe::Rocm { experts, .. }) => {
                    warm_names_the_shared_experts(dev, experts, &layer, 2)
                }
                _ => continue,
            }
            let run = |warm: Option<L2Warm>| -> Vec<u32> {
                let (x_t, mut h_t) = (b.upload(&x).expect("x"), b.upload(&h0).expect("h"));
                if let Some(what) = warm {
                    warm_on(&b, &w, &o, what);
                }
                let p = MoeFfn {
                    w: &w,
                    x: &x_t,
                    h: &mut h_t,
                    precision: Precision::Exact,
                };
                moe(&b, p).expect("moe");
                h_t.to_host()
                    .expect("h")
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let want = run(None);
            for what in [
                parts(true, false, false, false),
                parts(true, true, false, false),
                parts(true, true, true, false),
                parts(true, true, true, true),
            ] {
                assert_eq!(run(Some(what)), want, "{} after {what:?}", b.name());
            }
        }
    }
}

/// A random `[rows][cols]` weight (bf16 or f32), uniform in ±0.3.
fn matrix_weight(
    rng: &mut rand_chacha::ChaCha8Rng,
    rows: usize,
    cols: usize,
    bf16: bool,
) -> Matrix {
    let v = common::uniform(rng, rows * cols, 0.3);
    if bf16 {
        Matrix::from_bf16(
            rows,
            cols,
            v.iter().map(|&x| half::bf16::from_f32(x)).collect(),
        )
    } else {
        Matrix::from_f32(rows, cols, v)
    }
    .expect("len")
}

/// Queues `what`'s warm-up of `w` and `o` on `b` (`backend::l2` with the parts given rather
/// than read from the environment; on ROCm the launcher, which queues nothing there).
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn warm_on(b: &Backend, w: &Moe, o: &Weight, what: ferry_kernels::gpu::l2::L2Warm) {
    match (b, w) {
        #[cfg(feature = "cuda")]
        (Backend::Cuda(dev), _) => {
            let layer = ferry_kernels::backend::l2::LayerWeights {
                o_proj: o,
                moe: Some(w),
            };
            ferry_kernels::backend::l2::warm_cuda(dev, layer, what).expect("warm");
        }
        #[cfg(feature = "rocm")]
        (
            Backend::Rocm(dev),
            Moe::Rocm {
                experts, routing, ..
            },
        ) => {
            use ferry_kernels::gpu::l2;
            let _ = o;
            let ranges = l2::shared_expert_ranges(experts, routing.n_shared as usize, what);
            l2::warm(dev, &ranges, what.last).expect("warm");
        }
        _ => {}
    }
}

/// The bytes at `shared_expert_ranges` on the device are the layer's shared expert, chunk by
/// chunk, as the expert kernels read it; no part named, no range.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn warm_names_the_shared_experts<D: ferry_kernels::gpu::launch::Gpu>(
    dev: &D,
    experts: &ferry_kernels::gpu::ops::GpuExperts<D>,
    layer: &MoeLayer,
    n_shared: usize,
) {
    use ferry_kernels::gpu::l2::{shared_expert_ranges, L2Warm};
    use ferry_kernels::gpu::ops::{GpuMatrix, GpuMatrixData};
    let none = L2Warm::default();
    assert!(shared_expert_ranges(experts, n_shared, none).is_empty());
    let shared = layer.shared.as_ref().expect("a shared expert");
    let inter = experts.inter;
    // The f32 values at a byte range of one stacked matrix.
    let read = |m: &GpuMatrix<D>, (ptr, len): (u64, usize)| -> Vec<f32> {
        let offset = (ptr - m.ptr()) as usize;
        match m.data() {
            GpuMatrixData::Bf16(buf) => dev
                .download_range(buf, offset / 2, len / 2)
                .expect("bf16 range")
                .into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect(),
            GpuMatrixData::F32(buf) => dev
                .download_range(buf, offset / 4, len / 4)
                .expect("f32 range"),
        }
    };
    let gate_up = L2Warm {
        gate_up: true,
        ..none
    };
    let ranges = shared_expert_ranges(experts, n_shared, gate_up);
    assert_eq!(ranges.len(), 2);
    assert_eq!(read(&experts.gate, ranges[0]), shared.gate.to_f32_vec());
    assert_eq!(read(&experts.up, ranges[1]), shared.up.to_f32_vec());
    let down = L2Warm { down: true, ..none };
    let ranges = shared_expert_ranges(experts, n_shared, down);
    assert_eq!(ranges.len(), 1);
    // The down projection `[hidden][n_shared·inter]`, stacked as n_shared chunks of
    // `[hidden][inter]` (each chunk a band of columns).
    let rows = shared.down.to_f32_vec();
    let width = n_shared * inter;
    let chunks: Vec<f32> = (0..n_shared)
        .flat_map(|k| {
            rows.chunks(width)
                .flat_map(move |row| row[k * inter..(k + 1) * inter].to_vec())
        })
        .collect();
    assert_eq!(read(&experts.down, ranges[0]), chunks);
    let all = L2Warm {
        gate_up: true,
        down: true,
        ..none
    };
    assert_eq!(shared_expert_ranges(experts, n_shared, all).len(), 3);
}

/// The router GEMV and the routing in one launch (`ops::moe_router_route`,
/// `FERRY_ROUTER_FUSED`) give bitwise the logits, ids and weights of `linear` then
/// `moe_route`: 1, 3 and 8 tokens; 64 experts (the two-register kernel) and 256 in groups (the
/// eight-register one); sigmoid and softmax scoring; f32 and bf16 routers. The same counter
/// serves three launches in a row, so the last block sets it back. Nine tokens (past the GEMV),
/// and on CUDA 3 and 8 tokens of a bf16 router (which `linear` projects on the tensor cores),
/// take the two launches through `router_and_route`.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[test]
fn fused_router_and_routing_are_bitwise_the_two_launches() {
    for b in backends() {
        match &b {
            #[cfg(feature = "cuda")]
            Backend::Cuda(dev) => router_route_is_bitwise(dev),
            #[cfg(feature = "rocm")]
            Backend::Rocm(dev) => router_route_is_bitwise(dev),
            _ => {}
        }
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn router_route_is_bitwise<D: ferry_kernels::gpu::launch::Gpu>(dev: &D) {
    use ferry_kernels::gpu::launch::DeviceMem;
    use ferry_kernels::gpu::ops::{
        self, GemmPrecision, GpuMatrix, RouteParams, RouterRoute, Routes,
    };
    let mut rng = common::rng(41);
    let hidden = 96;
    // (experts, top_k, groups, groups kept, softmax)
    for (e, top_k, n_group, topk_group, softmax) in [
        (64, 6, 1, 1, false),
        (256, 8, 8, 4, false),
        (64, 6, 1, 1, true),
    ] {
        for bf16 in [false, true] {
            let router =
                GpuMatrix::upload(dev, &matrix_weight(&mut rng, e, hidden, bf16)).expect("router");
            let bias = dev
                .upload(&common::uniform(&mut rng, e, 0.5))
                .expect("bias");
            let p = RouteParams {
                n_experts: e as i32,
                top_k: top_k as i32,
                n_group,
                topk_group,
                norm_topk: 1,
                n_shared: 2,
                scale: 2.5,
                softmax: i32::from(softmax),
            };
            let slots = top_k + 2;
            let done = dev.zeros::<u32>(1).expect("counter");
            for t in [1, 3, 8, 9, 1] {
                let x = dev
                    .upload(&common::uniform(&mut rng, t * hidden, 1.0))
                    .expect("x");
                let run = |fused: bool| -> (Vec<u32>, Vec<i32>, Vec<u32>) {
                    let logits = dev.zeros::<f32>(t * e).expect("logits");
                    let ids = dev.zeros::<i32>(t * slots).expect("ids");
                    let w = dev.zeros::<f32>(t * slots).expect("weights");
                    let a = RouterRoute {
                        x: x.v(),
                        router: &router,
                        bias: bias.v(),
                        p,
                        logits: logits.v(),
                        out: Routes {
                            ids: ids.v(),
                            weights: w.v(),
                            slots,
                        },
                        done: done.v(),
                        x_split: None,
                    };
                    ops::router_and_route(dev, a, fused, GemmPrecision::Exact).expect("route");
                    let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect();
                    (
                        bits(dev.download(&logits).expect("logits")),
                        dev.download(&ids).expect("ids"),
                        bits(dev.download(&w).expect("weights")),
                    )
                };
                let want = run(false);
                assert!(want.1[..top_k].iter().all(|&i| (0..e as i32).contains(&i)));
                let what = format!("{e} experts, {t} tokens, bf16 {bf16}, softmax {softmax}");
                assert_eq!(run(true), want, "{what}");
                assert_eq!(dev.download(&done).expect("counter"), vec![0], "{what}");
            }
        }
    }
}

/// `rms_norm_into` (the forward's input and post-attention norms): the CPU's RMSNorm of every
/// row, the input rows untouched; widths on and off the norm kernel's float4 path.
#[test]
fn rms_norm_into_matches_the_cpu_norm_on_every_backend() {
    let mut rng = common::rng(31);
    for (rows, width) in [(1, 64), (3, 2048), (9, 70)] {
        let h = common::uniform(&mut rng, rows * width, 2.0);
        let g: Vec<f32> = common::uniform(&mut rng, width, 0.5)
            .iter()
            .map(|v| v + 1.0)
            .collect();
        let mut want = vec![0.0f32; h.len()];
        rms_norm(&h, &g, 1e-6, &mut want).expect("norm");
        for b in backends() {
            let (h_t, g_t) = (b.upload(&h).expect("h"), b.upload(&g).expect("g"));
            let mut x_t = b.zeros(h.len()).expect("x");
            let norm = RowNorm {
                weight: &g_t,
                eps: 1e-6,
            };
            rms_norm_into(&b, &h_t, norm, &mut x_t).expect("rms_norm_into");
            let what = format!("rms_norm_into {rows} x {width}");
            check(&b, &what, &x_t.to_host().expect("x"), &want);
            assert_eq!(
                h_t.to_host().expect("h"),
                h,
                "{what}: the input was written"
            );
        }
    }
}

/// `linear_add` (an output projection added into the residual stream): `h + x · Wᵀ` as the CPU
/// computes it, through the accumulating GEMV up to 8 rows and the accumulating large GEMM
/// above on a GPU, for f32 and bf16 weights.
#[test]
fn linear_add_adds_the_projection_into_h_on_every_backend() {
    let mut rng = common::rng(37);
    let (k, n) = (72, 48);
    for bf16 in [false, true] {
        let v = common::uniform(&mut rng, n * k, 0.3);
        let w = if bf16 {
            let v = v.iter().map(|&v| half::bf16::from_f32(v)).collect();
            Matrix::from_bf16(n, k, v).expect("w")
        } else {
            Matrix::from_f32(n, k, v).expect("w")
        };
        for m in [1, 5, 8, 9, 40] {
            let x = common::uniform(&mut rng, m * k, 1.0);
            let h0 = common::uniform(&mut rng, m * n, 1.0);
            let mut y = vec![0.0f32; m * n];
            ferry_kernels::cpu::gemm::linear(&x, &w, &mut y).expect("linear");
            let want: Vec<f32> = h0.iter().zip(&y).map(|(h, y)| h + y).collect();
            for b in backends() {
                let (x_t, w_t) = (b.upload(&x).expect("x"), b.weight(&w).expect("w"));
                let mut h_t = b.upload(&h0).expect("h");
                let p = Linear {
                    x: &x_t,
                    w: &w_t,
                    precision: Precision::Exact,
                };
                linear_add(&b, p, &mut h_t).expect("linear_add");
                let what = format!("linear_add m {m}, bf16 {bf16}");
                check(&b, &what, &h_t.to_host().expect("h"), &want);
            }
        }
    }
}

/// An op handed an operand from another backend fails naming the op and the operand.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[test]
fn a_mixed_device_call_names_the_op_and_operand() {
    let Some(gpu) = backends().into_iter().find(|b| !matches!(b, Backend::Cpu)) else {
        eprintln!("skipping: no GPU");
        return;
    };
    let w = Weight::Host(Matrix::from_f32(2, 2, vec![1.0; 4]).expect("w"));
    let x = gpu.upload(&[1.0, 2.0]).expect("x");
    let p = Linear {
        x: &x,
        w: &w,
        precision: Precision::Exact,
    };
    let e = linear(&gpu, p)
        .expect_err("a host weight on a GPU op")
        .to_string();
    assert!(e.contains("linear") && e.contains("`w`"), "{e}");
}

/// `gather` is a copy on every backend: exact, for rows picked out of order and twice, at
/// widths below, at and past a GPU block's 1,024 columns, up to a vocabulary row.
#[test]
fn gather_copies_rows_exactly_at_every_width() {
    let mut rng = common::rng(61);
    for width in [1, 1000, 1024, 1025, 102_403] {
        let n = 5;
        let src = common::uniform(&mut rng, n * width, 1.0);
        let picked = vec![4, 0, 4, 2];
        let want: Vec<f32> = picked
            .iter()
            .flat_map(|&r: &i32| src[r as usize * width..(r as usize + 1) * width].to_vec())
            .collect();
        for b in backends() {
            let got = gather(
                &b,
                Gather {
                    src: &b.upload(&src).expect("src"),
                    rows: &b.ints(picked.clone()).expect("rows"),
                    width,
                },
            )
            .expect("gather")
            .to_host()
            .expect("download");
            assert!(got == want, "width {width} on the {}", b.name());
        }
    }
}

#[test]
fn drafts_land_after_each_anchor_on_every_backend() {
    // A pass of 5 inputs (the last two padding) and blocks of 4: draft k of input s is
    // 100·k + s; a round of the first 3 sequences verifies 2 drafts each.
    let (width, block, seqs, gamma) = (5, 4, 3, 2);
    let drafts: Vec<i32> = (0..block)
        .flat_map(|k| (0..width).map(move |s| (100 * k + s) as i32))
        .collect();
    let anchors = [7, 8, 9];
    let mut host_ids = Vec::new();
    for a in anchors {
        host_ids.push(a);
        host_ids.extend([-1; 2]);
    }
    // A padding sequence's rows after the round's must be left alone.
    host_ids.extend([-5, -5, -5]);
    let want = [7, 0, 100, 8, 1, 101, 9, 2, 102, -5, -5, -5];
    for b in backends() {
        let src = b.ints(drafts.clone()).expect("drafts");
        let mut ids = b.ints(host_ids.clone()).expect("ids");
        let p = DraftIds {
            drafts: &src,
            width,
            seqs,
            gamma,
        };
        scatter_drafts(&b, p, &mut ids).expect("scatter");
        assert_eq!(
            ids.to_host().expect("download"),
            want,
            "on the {}",
            b.name()
        );
        // A pass narrower than the round, or ids too short for it, is refused.
        let narrow = DraftIds { width: 2, ..p };
        assert!(
            scatter_drafts(&b, narrow, &mut ids).is_err(),
            "{}",
            b.name()
        );
        let mut short = b.ints(vec![0; 8]).expect("ids");
        assert!(scatter_drafts(&b, p, &mut short).is_err(), "{}", b.name());
    }
}
