//! `ferry bench-transfer`: moving one prompt's KV cache between two processes, per transport.
//!
//! The layout is DeepSeek-V3's: 61 layers × 576 bf16 per token (70,272 bytes per token), in
//! 64-token blocks. For each prompt length the receiver is a child process (this binary with
//! `--receiver`) that registers a pool of exactly that many blocks; this process connects,
//! writes every layer's blocks (prepared before the clock starts) and flushes. A run's time is
//! connect-to-flush-ack, so it includes the handshake. The peer is `memcpy` of the same bytes,
//! block by block, within this process: the physical limit of a host-to-host move.
//!
//! Transports: the TCP transport, UCX over shared memory (`UCX_TLS=posix,sysv,cma`) and UCX
//! over TCP on loopback (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`). Each case reports the median of
//! `--runs` runs.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use ferry_kvtransfer::ucx::MAX_LANES;
use ferry_kvtransfer::{
    BlockWrite, Dtype, Fence, HostMemory, KvLayoutDesc, KvRegion, LayerMemory, RemoteKey,
    TcpTransport, Transport, UcxOptions, UcxTransport, WriteBatch, MAX_RUN_BYTES,
};
use serde_json::json;

/// Flags of `ferry bench-transfer`.
#[derive(Debug, Clone, Args)]
pub struct BenchTransferArgs {
    /// Prompt lengths in tokens (multiples of 64).
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768")]
    pub tokens: Vec<usize>,
    /// Tokens per block: one put per block (64 as in ferry's pools; larger shows what
    /// coalescing consecutive blocks would buy).
    #[arg(long, default_value_t = 64)]
    pub page: u32,
    /// Blocks per write (a run of consecutive blocks, one put / frame); default: as many as
    /// fit `MAX_RUN_BYTES` (1 MiB), as the prefill worker sends a fresh reservation.
    #[arg(long)]
    pub run_blocks: Option<usize>,
    /// Runs per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Which transports to measure (memcpy, the peer, always runs).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Case::Tcp, Case::UcxShm, Case::UcxTcp])]
    pub transports: Vec<Case>,
    /// Lanes of the UCX writer (`UcxOptions::lanes`: progress threads a transfer's layers are
    /// spread over); each count is a row of every UCX case. Default: one lane and the
    /// transport's default of two.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub ucx_lanes: Vec<usize>,
    /// Where the receiver's pool lives: the transport's memory (`Transport::alloc_host`, as a
    /// decode worker's pool: UCX shared memory for UCX) or the heap (the comparison).
    #[arg(long, value_enum, default_value_t = PoolMemory::Transport)]
    pub pool: PoolMemory,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Internal: run as the receiving process for `--transport` and one `--tokens` value.
    #[arg(long, hide = true)]
    pub receiver: bool,
    /// Internal: the receiver's transport.
    #[arg(long, value_enum, hide = true, default_value_t = Wire::Tcp)]
    pub transport: Wire,
}

/// The receiver's transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Wire {
    /// `TcpTransport` on 127.0.0.1.
    Tcp,
    /// `UcxTransport` (its `UCX_TLS` from the environment).
    Ucx,
}

/// Where the receiving pool is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PoolMemory {
    /// `Transport::alloc_host`.
    Transport,
    /// `HostMemory::zeroed`.
    Heap,
}

/// A transport setup the benchmark measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Case {
    /// The TCP transport.
    Tcp,
    /// UCX over shared memory (`UCX_TLS=posix,sysv,cma`).
    UcxShm,
    /// UCX over TCP on loopback (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`).
    UcxTcp,
}

impl Case {
    /// The row's name, the receiver's transport and both processes' environment.
    fn setup(self) -> (&'static str, Wire, Env) {
        match self {
            Case::Tcp => ("tcp transport", Wire::Tcp, &[]),
            Case::UcxShm => (
                "ucx shared memory",
                Wire::Ucx,
                &[("UCX_TLS", "posix,sysv,cma")],
            ),
            Case::UcxTcp => (
                "ucx tcp",
                Wire::Ucx,
                &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
            ),
        }
    }
}

/// Environment variables of one case's two processes.
type Env = &'static [(&'static str, &'static str)];

const LAYERS: u32 = 61;
const WIDTH: u32 = 576;

fn layout(tokens: usize, page: u32) -> KvLayoutDesc {
    KvLayoutDesc {
        num_layers: LAYERS,
        page_size: page,
        latent_width: WIDTH,
        dtype: Dtype::Bf16,
        num_blocks: (tokens / page as usize) as u32,
    }
}

/// The receiving pool: every layer registered host memory.
struct Pool {
    layout: KvLayoutDesc,
    memory: HostMemory,
}

impl KvRegion for Pool {
    fn layout(&self) -> KvLayoutDesc {
        self.layout
    }
    fn memory(&self, layer: u32) -> LayerMemory {
        let len = self.layout.num_blocks as usize * self.layout.block_bytes();
        self.memory
            .layer(layer as usize * len, len)
            .unwrap_or(LayerMemory::Staged)
    }
}

/// Runs the benchmark, or the receiver side of one case.
pub fn run(args: BenchTransferArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    if args.receiver {
        let tokens = *args.tokens.first().context("--tokens")?;
        return rt.block_on(receive(
            args.transport,
            args.pool,
            layout(tokens, args.page),
        ));
    }
    let page = args.page;
    for &t in &args.tokens {
        if page == 0 || t == 0 || t % page as usize != 0 {
            bail!("`--tokens` must be positive multiples of `--page` {page}, got {t}");
        }
    }
    if let Some(&n) = args.ucx_lanes.iter().find(|&&n| n == 0 || n > MAX_LANES) {
        bail!("`--ucx-lanes` takes 1 to {MAX_LANES} lanes, got {n}");
    }
    // (name, wire, environment, writer lanes): a TCP case once, a UCX case per lane count.
    let mut cases = Vec::new();
    for c in &args.transports {
        let (name, wire, env) = c.setup();
        match wire {
            Wire::Tcp => cases.push((name.to_owned(), wire, env, 1)),
            Wire::Ucx => {
                for &lanes in &args.ucx_lanes {
                    let name = match lanes {
                        1 => name.to_owned(),
                        n => format!("{name}, {n} lanes"),
                    };
                    cases.push((name, wire, env, lanes));
                }
            }
        }
    }
    let mut rows = Vec::new();
    println!(
        "{:<27} {:>7} {:>10} {:>10} {:>9} {:>9}",
        "transport", "tokens", "MB", "ms", "GB/s", "% memcpy"
    );
    for &tokens in &args.tokens {
        let l = layout(tokens, page);
        let bytes = l.num_layers as usize * l.num_blocks as usize * l.block_bytes();
        let run_blocks = match args.run_blocks {
            Some(n) => n,
            None => (MAX_RUN_BYTES / l.block_bytes()).max(1),
        };
        let batches = batches(&l, run_blocks);
        // The limit: the faster of copying block by block and run by run, into one touched
        // buffer of the pool's size (a decode worker's pool is allocated once and warm).
        let per_block = batches_of_single_blocks(&batches, l.block_bytes());
        let dst = HostMemory::zeroed(bytes);
        dst.write(0, &vec![1u8; bytes]);
        let limit = || memcpy_once(&l, &batches, &dst).min(memcpy_once(&l, &per_block, &dst));
        let copy = median((0..args.runs).map(|_| limit()).collect());
        let copy_gbs = bytes as f64 / copy / 1e9;
        println!(
            "{:<27} {tokens:>7} {:>10.1} {:>10.2} {copy_gbs:>9.2} {:>9}",
            "memcpy",
            bytes as f64 / 1e6,
            copy * 1e3,
            "100"
        );
        rows.push(
            json!({"transport": "memcpy", "tokens": tokens, "bytes": bytes,
            "median_s": copy, "gb_per_s": copy_gbs}),
        );
        for (name, wire, env, lanes) in &cases {
            let (wire, env, lanes) = (*wire, *env, *lanes);
            let (secs, copy) = rt.block_on(case(
                (wire, env, args.pool, lanes),
                &l,
                &batches,
                args.runs,
                limit,
            ))?;
            let gbs = bytes as f64 / secs / 1e9;
            let copy_gbs = bytes as f64 / copy / 1e9;
            println!(
                "{name:<27} {tokens:>7} {:>10.1} {:>10.2} {gbs:>9.2} {:>9.0}",
                bytes as f64 / 1e6,
                secs * 1e3,
                100.0 * gbs / copy_gbs
            );
            rows.push(json!({"transport": name, "tokens": tokens, "bytes": bytes,
                "lanes": lanes, "median_s": secs, "gb_per_s": gbs,
                "memcpy_interleaved_gb_per_s": copy_gbs, "of_memcpy": gbs / copy_gbs}));
        }
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "benchmark": "kv transfer between two processes, DeepSeek-V3 layout (61 x 576 bf16 per token, 64-token blocks)",
            "pool": args.pool.to_possible_value().map(|v| v.get_name().to_owned()),
            "command": format!("ferry bench-transfer --tokens {} --page {page} --runs {}{} --transports {} --ucx-lanes {}",
                args.tokens.iter().map(usize::to_string).collect::<Vec<_>>().join(","), args.runs,
                args.run_blocks.map(|n| format!(" --run-blocks {n}")).unwrap_or_default(),
                args.transports.iter().map(|c| c.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default()).collect::<Vec<_>>().join(","),
                args.ucx_lanes.iter().map(usize::to_string).collect::<Vec<_>>().join(",")),
            "ucx": UcxTransport::available().map(|(a, b, c)| format!("{a}.{b}.{c}")).unwrap_or_else(|e| e),
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// Every layer's blocks, in the wire dtype, distinct per block, as the prefill worker sends
/// them to a fresh reservation: consecutive destination blocks in runs of up to
/// `MAX_RUN_BYTES` (`--runs-of 1`: one write per block).
fn batches(l: &KvLayoutDesc, run_blocks: usize) -> Vec<WriteBatch> {
    let per_run = run_blocks.max(1);
    (0..l.num_layers)
        .map(|layer| WriteBatch {
            layer,
            writes: (0..l.num_blocks)
                .collect::<Vec<u32>>()
                .chunks(per_run)
                .map(|run| BlockWrite {
                    block: run[0],
                    data: run
                        .iter()
                        .flat_map(|&b| vec![(layer ^ b) as u8; l.block_bytes()])
                        .collect::<Vec<u8>>()
                        .into(),
                })
                .collect(),
        })
        .collect()
}

/// The same bytes as one write per block.
fn batches_of_single_blocks(batches: &[WriteBatch], block_bytes: usize) -> Vec<WriteBatch> {
    batches
        .iter()
        .map(|b| WriteBatch {
            layer: b.layer,
            writes: b
                .writes
                .iter()
                .flat_map(|w| {
                    w.blocks(block_bytes).map(|(block, d)| BlockWrite {
                        block,
                        data: d.to_vec().into(),
                    })
                })
                .collect(),
        })
        .collect()
}

/// Seconds to copy `batches` into `dst` (touched, `batches_bytes(l)` long) in one process.
/// Allocating and touching a destination per call cost more than the copy it framed (seconds
/// per run at 32k tokens, enough to push the bench past a device call's limit).
fn memcpy_once(l: &KvLayoutDesc, batches: &[WriteBatch], dst: &HostMemory) -> f64 {
    let started = Instant::now();
    for b in batches {
        for w in &b.writes {
            let at =
                (b.layer as usize * l.num_blocks as usize + w.block as usize) * l.block_bytes();
            dst.write(at, &w.data);
        }
    }
    started.elapsed().as_secs_f64()
}

/// One transport at one length: spawns the receiver, times `runs` transfers, each right after
/// a `limit()` (memcpy) measurement, so both see the same machine (this VM drifts by ±20 %
/// between minutes); returns both medians.
async fn case(
    (wire, env, pool, lanes): (Wire, Env, PoolMemory, usize),
    l: &KvLayoutDesc,
    batches: &[WriteBatch],
    runs: usize,
    limit: impl Fn() -> f64,
) -> anyhow::Result<(f64, f64)> {
    let tokens = l.num_blocks as usize * l.page_size as usize;
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "bench-transfer",
            "--receiver",
            "--transport",
            match wire {
                Wire::Tcp => "tcp",
                Wire::Ucx => "ucx",
            },
            "--tokens",
            &tokens.to_string(),
            "--page",
            &l.page_size.to_string(),
            "--pool",
            match pool {
                PoolMemory::Transport => "transport",
                PoolMemory::Heap => "heap",
            },
        ])
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().context("receiver stdout")?).read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (Some("REG"), Some(address), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("the receiver said {line:?}");
    };
    let key = RemoteKey(key.parse()?);
    // The writer's UCX follows the same environment.
    for (k, v) in env {
        std::env::set_var(k, v);
    }
    let transport: Arc<dyn Transport> = match wire {
        Wire::Tcp => Arc::new(TcpTransport::client()),
        Wire::Ucx => Arc::new(UcxTransport::with_options(UcxOptions {
            token: None,
            lanes,
        })?),
    };
    let l = *l;
    let mut times = Vec::new();
    let mut copies = Vec::new();
    for _ in 0..runs {
        copies.push(limit());
        let batches = batches.to_vec();
        let started = Instant::now();
        let mut w = transport.connect(address, key, Fence::NONE, &l).await?;
        for b in batches {
            w.write(b).await?;
        }
        let n = w.flush().await?;
        times.push(started.elapsed().as_secs_f64());
        anyhow::ensure!(n as usize == batches_bytes(&l), "flushed {n} bytes");
    }
    drop(transport);
    for (k, _) in env {
        std::env::remove_var(k);
    }
    // The receiver checks that its pool holds every byte the last run wrote.
    let mut stdin = child.stdin.take().context("receiver stdin")?;
    stdin.write_all(b"done\n")?;
    drop(stdin);
    let mut verdict = String::new();
    BufReader::new(child.stdout.as_mut().context("receiver stdout")?).read_line(&mut verdict)?;
    let _ = child.wait();
    anyhow::ensure!(
        verdict.trim() == "OK",
        "the receiver's pool does not hold what was written: {verdict:?}"
    );
    Ok((median(times), median(copies)))
}

fn batches_bytes(l: &KvLayoutDesc) -> usize {
    l.num_layers as usize * l.num_blocks as usize * l.block_bytes()
}

/// The receiving process: registers a pool, prints `REG <address> <key>`, serves until stdin
/// has a line or closes.
async fn receive(wire: Wire, pool: PoolMemory, l: KvLayoutDesc) -> anyhow::Result<()> {
    let transport: Arc<dyn Transport> = match wire {
        Wire::Tcp => Arc::new(TcpTransport::bind("127.0.0.1:0".parse()?)?),
        Wire::Ucx => Arc::new(UcxTransport::new()?),
    };
    let memory = match pool {
        PoolMemory::Transport => transport.alloc_host(batches_bytes(&l))?,
        PoolMemory::Heap => HostMemory::zeroed(batches_bytes(&l)),
    };
    // Touch every page, as a running decode worker's pool is.
    memory.write(0, &vec![0u8; batches_bytes(&l)]);
    let pool = Arc::new(Pool { layout: l, memory });
    let reg = transport.register(pool.clone()).await?;
    println!("REG {} {}", reg.address, reg.key.0);
    std::io::stdout().flush()?;
    tokio::task::spawn_blocking(|| {
        let mut s = String::new();
        let _ = std::io::stdin().read_line(&mut s);
    })
    .await?;
    match first_wrong_block(&l, &pool.memory) {
        None => println!("OK"),
        Some((layer, block)) => println!("WRONG layer {layer} block {block}"),
    }
    std::io::stdout().flush()?;
    Ok(())
}

/// The first block whose bytes are not `batches`' pattern (`layer ^ block`), if any.
fn first_wrong_block(l: &KvLayoutDesc, memory: &HostMemory) -> Option<(u32, u32)> {
    let bb = l.block_bytes();
    for layer in 0..l.num_layers {
        for block in 0..l.num_blocks {
            let at = (layer as usize * l.num_blocks as usize + block as usize) * bb;
            let ok = memory
                .read(at, bb)
                .is_some_and(|b| b.iter().all(|&x| x == (layer ^ block) as u8));
            if !ok {
                return Some((layer, block));
            }
        }
    }
    None
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
