//! KV transfer between two processes on one GPU or two: UCX puts from one process's device
//! memory into the other's (`cuda_ipc` when the loaded UCX has CUDA support), against a copy of
//! the same bytes within one process (`cuMemcpyDtoDAsync`; between two GPUs under unified
//! addressing a peer-to-peer copy over their link): the physical limit. `--gpus 0,1` puts the
//! sender on GPU 0 and the receiver on GPU 1 (the two-GPU run, issue 18).
//!
//! The layout is DeepSeek-V3's: 61 layers × 576 bf16 per token in 64-token blocks, as
//! `ferry bench-transfer` uses for host memory. The receiver is a child process (this binary
//! with `--receiver`) that registers its layers as CUDA memory, as a GPU decode worker does; the
//! sender puts every layer as runs of `--run-mib` (one run per layer by default, as a fresh
//! reservation's consecutive blocks coalesce), flushes, and times connect-to-flush-ack (and,
//! separately, the puts and flush after the connect). Each case reports the median of `--runs`
//! runs, each next to a copy measured right before it; `--lanes 1,2,4` measures writers that
//! spread the layers over that many progress threads, the arms taking turns run by run.
//!
//! ```text
//! FERRY_UCX_LIB=…/libucp.so.0 bench_transfer_gpu --tokens 1024,8192,32768 --lanes 1,2,4 --json out.json
//! ```
//! (an example rather than a `ferry` subcommand: it hands raw device addresses to the
//! transport, which takes `unsafe`, and the `ferry` binary has none).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use ferry_kernels::cuda::{CudaDevice, DeviceBuffer};
use ferry_kvtransfer::{
    DeviceBatch, DeviceRun, Dtype, Fence, KvLayoutDesc, KvRegion, LayerMemory, RemoteKey,
    Transport, UcxOptions, UcxTransport,
};
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// Prompt lengths in tokens (multiples of 64).
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768")]
    tokens: Vec<usize>,
    /// Largest put in MiB (0: one put per layer).
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    run_mib: Vec<usize>,
    /// Lanes of the UCX writer (`UcxOptions::lanes`), one arm each, interleaved run by run.
    /// Default: one lane and the transport's default of two.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    lanes: Vec<usize>,
    /// Runs per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// The sender's and the receiver's GPU (`0,0`: both processes on GPU 0).
    #[arg(long, value_delimiter = ',', default_value = "0,0")]
    gpus: Vec<usize>,
    /// Internal: run as the receiving process for one `--tokens` value.
    #[arg(long, hide = true)]
    receiver: bool,
}

const LAYERS: u32 = 61;
const PAGE: u32 = 64;

fn layout(tokens: usize) -> KvLayoutDesc {
    KvLayoutDesc {
        num_layers: LAYERS,
        page_size: PAGE,
        latent_width: 576,
        dtype: Dtype::Bf16,
        num_blocks: (tokens / PAGE as usize) as u32,
    }
}

fn layer_bytes(l: &KvLayoutDesc) -> usize {
    l.num_blocks as usize * l.block_bytes()
}

/// Every layer as its own device allocation, as the engine's cache is.
fn layers(dev: &CudaDevice, l: &KvLayoutDesc) -> anyhow::Result<Vec<DeviceBuffer<u8>>> {
    (0..l.num_layers)
        .map(|_| Ok(dev.zeros_shareable::<u8>(layer_bytes(l))?))
        .collect()
}

/// The receiving pool: every layer registered CUDA memory.
struct Pool {
    layout: KvLayoutDesc,
    layers: Vec<DeviceBuffer<u8>>,
    device: i32,
}

impl KvRegion for Pool {
    fn layout(&self) -> KvLayoutDesc {
        self.layout
    }
    fn memory(&self, layer: u32) -> LayerMemory {
        match self.layers.get(layer as usize) {
            // SAFETY: the allocation lives as long as the pool, which the registration holds;
            // only the transport writes it.
            Some(b) => unsafe { LayerMemory::cuda(b.ptr(), b.bytes(), self.device) },
            None => LayerMemory::Staged,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // `FERRY_LOG=ferry_kvtransfer=debug` prints each transfer's breakdown (time in the puts'
    // posting, to the flush, to local completion, to the receiver's acknowledgement).
    if let Ok(filter) = std::env::var("FERRY_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let rt = tokio::runtime::Runtime::new()?;
    let &[send_gpu, recv_gpu] = args.gpus.as_slice() else {
        bail!(
            "`--gpus` takes two GPUs (sender,receiver), got {:?}",
            args.gpus
        );
    };
    if args.receiver {
        let dev = CudaDevice::open(recv_gpu).with_context(|| format!("GPU {recv_gpu}"))?;
        let tokens = *args.tokens.first().context("--tokens")?;
        return rt.block_on(receive(&dev, layout(tokens)));
    }
    for &t in &args.tokens {
        if t == 0 || t % PAGE as usize != 0 {
            bail!("`--tokens` must be positive multiples of {PAGE}, got {t}");
        }
    }
    let dev = CudaDevice::open(send_gpu).with_context(|| format!("GPU {send_gpu}"))?;
    // The copy's destination: on the receiver's GPU, so two GPUs are compared with a
    // peer-to-peer copy between them.
    let dst_dev = if recv_gpu == send_gpu {
        dev.clone()
    } else {
        CudaDevice::open(recv_gpu).with_context(|| format!("GPU {recv_gpu}"))?
    };
    let ucx = UcxTransport::available().map_err(anyhow::Error::msg)?;
    println!(
        "GPU {send_gpu} → GPU {recv_gpu}: {}; UCX {}.{}.{}",
        dev.name(),
        ucx.0,
        ucx.1,
        ucx.2
    );
    let copy_case = if recv_gpu == send_gpu {
        "cuMemcpyDtoDAsync, one process".to_string()
    } else {
        format!("cuMemcpyDtoDAsync GPU {send_gpu} -> GPU {recv_gpu} (peer), one process")
    };
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "case", "tokens", "MB", "ms", "GB/s", "% copy"
    );
    let mut rows = Vec::new();
    for &tokens in &args.tokens {
        let l = layout(tokens);
        let bytes = l.num_layers as usize * layer_bytes(&l);
        let src = layers(&dev, &l)?;
        let mut dst = layers(&dst_dev, &l)?;
        let copy_once = |dst: &mut Vec<DeviceBuffer<u8>>| -> anyhow::Result<f64> {
            dev.synchronize()?;
            dst_dev.synchronize()?;
            let started = Instant::now();
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                dev.copy(s, d, s.len())?;
            }
            dev.synchronize()?;
            Ok(started.elapsed().as_secs_f64())
        };
        let mut copies = Vec::new();
        for _ in 0..args.runs {
            copies.push(copy_once(&mut dst)?);
        }
        let copy = median(copies);
        let copy_gbs = bytes as f64 / copy / 1e9;
        println!(
            "{:<22} {tokens:>7} {:>9.1} {:>9.3} {copy_gbs:>9.1} {:>9}",
            if recv_gpu == send_gpu {
                "device copy (1 proc)"
            } else {
                "peer copy (1 proc)"
            },
            bytes as f64 / 1e6,
            copy * 1e3,
            "100"
        );
        rows.push(json!({"case": copy_case, "tokens": tokens,
            "bytes": bytes, "median_s": copy, "gb_per_s": copy_gbs}));
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--receiver", "--tokens", &tokens.to_string()])
            .args(["--gpus", &format!("{send_gpu},{recv_gpu}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().context("receiver stdout")?).read_line(&mut line)?;
        let mut parts = line.split_whitespace();
        let (Some("REG"), Some(address), Some(key)) = (parts.next(), parts.next(), parts.next())
        else {
            bail!("the receiver said {line:?}");
        };
        let key = RemoteKey(key.parse()?);
        // One writer per lane count; the arms take turns within each run.
        let arms = args
            .lanes
            .iter()
            .map(|&lanes| {
                UcxTransport::with_options(UcxOptions { token: None, lanes })
                    .map(|t| (lanes, t))
                    .with_context(|| format!("a UCX writer of {lanes} lanes"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        for &mib in &args.run_mib {
            let run = if mib == 0 {
                layer_bytes(&l)
            } else {
                (mib << 20) / l.block_bytes() * l.block_bytes()
            };
            // Per arm: connect → flush ack, puts + flush, and the copy measured right before.
            let mut times = vec![Vec::new(); arms.len()];
            let mut moves = vec![Vec::new(); arms.len()];
            let mut copies = vec![Vec::new(); arms.len()];
            for _ in 0..args.runs {
                for (arm, (_, transport)) in arms.iter().enumerate() {
                    copies[arm].push(copy_once(&mut dst)?);
                    let started = Instant::now();
                    let mut w = rt.block_on(transport.connect(address, key, Fence::NONE, &l))?;
                    let connected = Instant::now();
                    anyhow::ensure!(
                        w.puts_from_device(0),
                        "the receiver's layers do not take device puts (is the loaded UCX CUDA-enabled?)"
                    );
                    for (layer, s) in src.iter().enumerate() {
                        let runs = (0..layer_bytes(&l))
                            .step_by(run)
                            .map(|at| DeviceRun {
                                block: (at / l.block_bytes()) as u32,
                                src: s.ptr() + at as u64,
                                len: run.min(layer_bytes(&l) - at),
                            })
                            .collect();
                        // SAFETY: `src` outlives the transfer (flushed below) and nothing
                        // writes it.
                        let batch =
                            unsafe { DeviceBatch::new(layer as u32, 0, runs, Box::new(())) };
                        rt.block_on(w.write_device(batch))?;
                    }
                    let n = rt.block_on(w.flush())?;
                    times[arm].push(started.elapsed().as_secs_f64());
                    moves[arm].push(connected.elapsed().as_secs_f64());
                    anyhow::ensure!(n as usize == bytes, "flushed {n} of {bytes} bytes");
                }
            }
            for (arm, &(lanes, _)) in arms.iter().enumerate() {
                let secs = median(std::mem::take(&mut times[arm]));
                let copy = median(std::mem::take(&mut copies[arm]));
                let moved = median(std::mem::take(&mut moves[arm]));
                let gbs = bytes as f64 / secs / 1e9;
                let move_gbs = bytes as f64 / moved / 1e9;
                let copy_gbs = bytes as f64 / copy / 1e9;
                let runs = if mib == 0 {
                    "layer runs".to_string()
                } else {
                    format!("{mib} MiB runs")
                };
                let name = match lanes {
                    1 => format!("ucx put, {runs}"),
                    n => format!("ucx put, {runs}, {n} lanes"),
                };
                println!(
                    "{name:<22} {tokens:>7} {:>9.1} {:>9.3} {gbs:>9.1} {:>9.0}   puts+flush only: {:.3} ms, {move_gbs:.1} GB/s, {:.0} %",
                    bytes as f64 / 1e6,
                    secs * 1e3,
                    100.0 * gbs / copy_gbs,
                    moved * 1e3,
                    100.0 * move_gbs / copy_gbs
                );
                rows.push(json!({"case": name, "tokens": tokens, "bytes": bytes,
                    "lanes": lanes, "put_bytes": run, "median_s": secs, "gb_per_s": gbs,
                    "puts_and_flush_median_s": moved, "puts_and_flush_gb_per_s": move_gbs,
                    "copy_interleaved_gb_per_s": copy_gbs, "of_copy": gbs / copy_gbs,
                    "puts_and_flush_of_copy": move_gbs / copy_gbs}));
            }
        }
        drop(arms);
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"done\n");
        }
        let _ = child.wait();
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "benchmark": "kv transfer between two processes (sender GPU -> receiver GPU): UCX puts device to device vs a copy of the same bytes in one process; DeepSeek-V3 layout (61 x 576 bf16 per token, 64-token blocks)",
            "gpus": [send_gpu, recv_gpu],
            "command": format!("bench_transfer_gpu --gpus {send_gpu},{recv_gpu} --tokens {} --run-mib {} --lanes {} --runs {}",
                args.tokens.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
                args.run_mib.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
                args.lanes.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
                args.runs),
            "gpu": dev.name(),
            "ucx": format!("{}.{}.{}", ucx.0, ucx.1, ucx.2),
            "ucx_tls": std::env::var("UCX_TLS").unwrap_or_default(),
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// The receiving process: registers its layers, prints `REG <address> <key>`, serves until
/// stdin has a line or closes.
async fn receive(dev: &CudaDevice, l: KvLayoutDesc) -> anyhow::Result<()> {
    let pool = Pool {
        layout: l,
        layers: layers(dev, &l)?,
        device: i32::try_from(dev.ordinal())?,
    };
    dev.synchronize()?;
    let transport = UcxTransport::new()?;
    let reg = transport.register(Arc::new(pool)).await?;
    println!("REG {} {}", reg.address, reg.key.0);
    std::io::stdout().flush()?;
    tokio::task::spawn_blocking(|| {
        let mut s = String::new();
        let _ = std::io::stdin().read_line(&mut s);
    })
    .await?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
