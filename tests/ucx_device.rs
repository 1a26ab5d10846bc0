//! The prompt's KV between two GPU processes over UCX with CUDA support (`cuda_ipc` on one
//! GPU): the prefill process's engine leaves the shipped rows in its device cache and the
//! transport puts them straight into the decode engine's device cache, no host memory between.
//!
//! The decode side (this test) runs two CUDA engines in fast mode: engine A registered with UCX
//! (its cache layers as CUDA memory), engine B with TCP (staged: bytes through host memory,
//! the path whose bytes are the prefill cache's own, bit for bit — `engine_device.rs`). One
//! prefill process (this binary re-run on the ignored `role` test) prefills the same prompt
//! for both: first into A from its device cache, then into B from the same cache blocks (its
//! prefix cache), through the page-locked ring. So:
//!
//! - the transfer into A went from device memory (`puts_from_device` on every layer);
//! - A's rows of the prompt are bit-identical to B's, i.e. to what the prefill engine computed
//!   (every block the second prefill reused from its prefix cache: all but the last, partial
//!   one, which it recomputed);
//! - A decodes exactly what B decodes and what a local prefill on a third engine decodes;
//! - both engines count the bytes the transfers acknowledged, and every block comes back.
//!
//! `#[ignore]`d: needs an NVIDIA GPU and a CUDA-enabled UCX (PyPI's `libucx-cu13`, loaded with
//! `FERRY_UCX_LIB`; see docs/gpu.md). Without a GPU it prints why it skips and passes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use ferry_decode::region::EngineRegion;
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_kernels::Device;
use ferry_kvtransfer::{
    Dtype, Fence, KvLayoutDesc, LayerStreamer, RemoteKey, TcpTransport, Transport, UcxTransport,
};
use ferry_model::deepseek::DeepseekModel;
use ferry_model::engine::{
    EngineConfig, EngineEvent, EngineHandle, FinishReason, GenerateJob, GpuMode, PrefillSource,
    PrefillWork, StopParams,
};
use ferry_model::kv::KvDtype;

const MAX_TOKENS: usize = 24;

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// A greedy job of [`MAX_TOKENS`] tokens that ignores end-of-sequence tokens.
fn job(prompt: &[u32], prefill: PrefillSource) -> GenerateJob {
    GenerateJob {
        prompt: prompt.to_vec(),
        sampling: greedy(),
        controls: Default::default(),
        stop: StopParams {
            ignore_eos: true,
            ..StopParams::max_tokens(MAX_TOKENS)
        },
        prefill,
        grammar: None,
    }
}

fn engine() -> EngineHandle {
    let model = DeepseekModel::load(&ferry_model::embedded::default_model_dir()).expect("model");
    let config = EngineConfig {
        num_blocks: 64,
        max_batch_tokens: 512,
        device: Device::Cuda(0),
        gpu_mode: GpuMode::Fast,
        ..EngineConfig::default()
    };
    EngineHandle::spawn(model, config).expect("engine")
}

/// The transfer layout of `e` (what the decode region advertises; the prefill side writes it).
fn layout(e: &EngineHandle) -> KvLayoutDesc {
    let l = e.kv_layout();
    KvLayoutDesc {
        num_layers: l.num_layers as u32,
        page_size: l.page_size as u32,
        latent_width: l.width as u32,
        dtype: match e.kv_dtype() {
            KvDtype::F32 => Dtype::F32,
            KvDtype::Bf16Split { rope } => Dtype::Bf16Split { rope: rope as u32 },
        },
        num_blocks: l.num_blocks as u32,
    }
}

/// A prompt of a few hundred tokens of the embedded model's vocabulary.
fn prompt() -> Vec<u32> {
    (0..300u32).map(|i| 3 + (i * 37 + i / 7) % 500).collect()
}

/// The prefill process: one request per stdin line `transport address key fence blocks…`,
/// answered `DONE first_token bytes from_device`.
#[test]
#[ignore = "runs only as a child process of the test below"]
fn role() {
    if std::env::var("FERRY_UCX_DEVICE_ROLE").as_deref() != Ok("prefill") {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let e = engine();
        let ucx = UcxTransport::new().expect("UCX loads");
        let tcp = TcpTransport::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let ours = layout(&e);
        for line in std::io::stdin().lock().lines() {
            let line = line.unwrap();
            let f: Vec<&str> = line.split_whitespace().collect();
            let transport: &dyn Transport = if f[0] == "ucx" { &ucx } else { &tcp };
            let key = RemoteKey(f[2].parse().unwrap());
            let fence = Fence(f[3].parse().unwrap());
            let blocks: Vec<u32> = f[4..].iter().map(|b| b.parse().unwrap()).collect();
            let writer = transport
                .connect(f[1], key, fence, &ours)
                .await
                .expect("connect");
            let from_device = (0..ours.num_layers).all(|l| writer.puts_from_device(l));
            let (sink, streamer) = LayerStreamer::spawn(writer);
            // A CUDA engine's rows are on the device or in its staging ring: no host lease.
            let copy = ferry_prefill::push::HostShip::Copy;
            let hook = ferry_prefill::push::layer_pusher(sink.clone(), blocks, 0, ours.dtype, copy);
            let out = e
                .prefill_work(PrefillWork {
                    prompt: prompt(),
                    sampling: greedy(),
                    controls: Default::default(),
                    stop: StopParams::max_tokens(1),
                    logprobs: None,
                    prompt_logprobs: None,
                    skip_tokens: 0,
                    on_layer: hook,
                    on_draft_layer: None,
                    grammar: None,
                    rows_on_device: from_device,
                })
                .await
                .expect("prefill");
            let bytes = streamer.finish(sink).await.expect("transfer");
            println!("DONE {} {bytes} {from_device}", out.first_token);
            std::io::stdout().flush().unwrap();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU and a CUDA-enabled UCX (docs/gpu.md)"]
async fn gpu_to_gpu_puts_land_bit_identical_and_decode_like_a_local_prefill() {
    if let Err(e) = Device::Cuda(0).probe() {
        eprintln!("skipping: {e}");
        return;
    }
    let (a, b, local) = (engine(), engine(), engine());
    let ucx = UcxTransport::new().expect("UCX loads");
    let tcp = TcpTransport::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let reg_a = ucx
        .register(Arc::new(EngineRegion::new(a.clone())))
        .await
        .unwrap();
    let reg_b = tcp
        .register(Arc::new(EngineRegion::new(b.clone())))
        .await
        .unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "role", "--nocapture"])
        .env("FERRY_UCX_DEVICE_ROLE", "prefill")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("prefill process");
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap());
    let prompt = prompt();
    let page = a.kv_layout().page_size;
    let mut runs = Vec::new();
    for (e, reg, name) in [(&a, &reg_a, "ucx"), (&b, &reg_b, "tcp")] {
        let mut g = e
            .generate(job(&prompt, PrefillSource::Remote { local_threshold: 0 }))
            .unwrap();
        let Some(EngineEvent::Reserved {
            blocks,
            cached_tokens: 0,
        }) = g.events.recv().await
        else {
            panic!("expected a reservation of the whole prompt");
        };
        let ids: Vec<String> = blocks.iter().map(|b| b.0.to_string()).collect();
        writeln!(
            to_child,
            "{name} {} {} {} {}",
            reg.address,
            reg.key.0,
            g.id.0,
            ids.join(" ")
        )
        .unwrap();
        let done = loop {
            let mut line = String::new();
            assert!(
                from_child.read_line(&mut line).unwrap() > 0,
                "the prefill process ended"
            );
            if let Some(rest) = line.strip_prefix("DONE ") {
                break rest.trim().to_string();
            }
        };
        let f: Vec<&str> = done.split(' ').collect();
        let (first, bytes, from_device): (u32, u64, bool) =
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2] == "true");
        e.remote_done(g.id, first, bytes).unwrap();
        let mut toks = Vec::new();
        let end = loop {
            match g.events.recv().await {
                Some(EngineEvent::Token(t)) => toks.push(t),
                Some(EngineEvent::Finished(r)) => break Ok(r),
                Some(EngineEvent::Failed(f)) => break Err(f.message),
                Some(_) => {}
                None => break Err("stream ended".into()),
            }
        };
        assert_eq!(end, Ok(FinishReason::Length), "{name}");
        // The prompt's rows as this engine holds them, per (layer, prompt block).
        let bb = e.kv_dtype().block_bytes(&e.kv_layout());
        let row = bb / page;
        let mut rows = Vec::new();
        for l in 0..e.kv_layout().num_layers {
            let layer = e.read_kv_layer(l).await.unwrap();
            for (i, blk) in blocks.iter().enumerate() {
                let n = (prompt.len() - i * page).min(page);
                let at = blk.0 as usize * bb;
                rows.push(((l, i), layer[at..at + n * row].to_vec()));
            }
        }
        let received = e.stats().await.unwrap().kv_bytes_received;
        eprintln!(
            "{name}: from device {from_device}, {bytes} bytes acknowledged, {received} counted, first token {first}"
        );
        assert_eq!(received, bytes, "{name}: the engine counts what landed");
        runs.push((from_device, rows, toks));
    }
    drop(to_child);
    let _ = child.wait();
    let (ucx_run, tcp_run) = (&runs[0], &runs[1]);
    assert!(
        ucx_run.0,
        "UCX with CUDA puts from the prefill engine's device cache"
    );
    assert!(!tcp_run.0, "TCP stages through host memory");
    // The second prefill (into B) reused every full block from the prefill engine's prefix
    // cache and recomputed only the last, partial one (as a chunk after a cached prefix, whose
    // kernels round differently), so every block but the last is the same cache bytes shipped
    // twice: once device to device, once through the ring.
    let last = prompt.len().div_ceil(page) - 1;
    let differ: Vec<(usize, usize)> = ucx_run
        .1
        .iter()
        .zip(&tcp_run.1)
        .filter(|((at, a), (_, b))| at.1 != last && a != b)
        .map(|((at, _), _)| *at)
        .collect();
    let bytes: usize = ucx_run.1.iter().map(|(_, r)| r.len()).sum();
    assert!(
        differ.is_empty(),
        "device-to-device rows are bit-identical to the prefill cache's ({bytes} bytes); \
         (layer, block) that differ: {differ:?}"
    );
    let mut g = local.generate(job(&prompt, PrefillSource::Local)).unwrap();
    let mut want = Vec::new();
    while let Some(ev) = g.events.recv().await {
        match ev {
            EngineEvent::Token(t) => want.push(t),
            EngineEvent::Finished(_) | EngineEvent::Failed(_) => break,
            _ => {}
        }
    }
    assert_eq!(
        ucx_run.2, want,
        "decode after device puts vs a local prefill"
    );
    assert_eq!(tcp_run.2, want, "decode after TCP vs a local prefill");
    for e in [&a, &b, &local] {
        let s = e.stats().await.unwrap();
        assert_eq!(s.kv_blocks_used, 0, "every block back: {s:?}");
    }
}
