//! The UCX transport between two real processes: a receiver process registers a region and a
//! writer process puts blocks into it, over shared memory (`UCX_TLS=posix,sysv,cma`) and over
//! TCP on loopback (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`), into a heap pool or one the
//! transport allocated (`Transport::alloc_host`: UCX shared memory, which the writer maps and
//! copies into), from a writer on one lane or three (`FERRY_UCX_LANES`); and a writer whose
//! receiver died gets an error, not a hang.
//!
//! Each process is this test binary re-run on the ignored `role` test with `FERRY_UCX_ROLE`
//! set, so both ends load UCX with exactly the environment the case gives.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_kvtransfer::{
    BlockWrite, Dtype, Fence, HostMemory, KvLayoutDesc, KvRegion, LayerMemory, RemoteKey,
    Transport, UcxTransport, WriteBatch,
};

/// 3 layers × 8 blocks of 16 tokens × 576 bf16: 18 KiB blocks, like a small V3 page.
const LAYOUT: KvLayoutDesc = KvLayoutDesc {
    num_layers: 3,
    page_size: 16,
    latent_width: 576,
    dtype: Dtype::Bf16,
    num_blocks: 8,
};

/// The blocks the writer fills, per layer (the rest must stay zero).
const BLOCKS: [u32; 3] = [6, 1, 4];

fn pattern(layer: u32, block: u32) -> Vec<u8> {
    (0..LAYOUT.block_bytes())
        .map(|i| (i as u32).wrapping_mul(7) ^ layer.wrapping_mul(101) ^ block.wrapping_mul(13))
        .map(|v| v as u8)
        .collect()
}

/// The receiver's pool: every layer exposed as registered host memory.
struct Pool(HostMemory);

impl KvRegion for Pool {
    fn layout(&self) -> KvLayoutDesc {
        LAYOUT
    }
    fn memory(&self, layer: u32) -> LayerMemory {
        let len = LAYOUT.num_blocks as usize * LAYOUT.block_bytes();
        self.0.layer(layer as usize * len, len).unwrap()
    }
}

/// One end, when this binary runs as a child (`FERRY_UCX_ROLE` = `receiver` | `writer`).
#[test]
#[ignore = "runs only as a child process of the tests below"]
fn role() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    match std::env::var("FERRY_UCX_ROLE").as_deref() {
        Ok("receiver") => rt.block_on(receiver()),
        Ok("writer") => rt.block_on(writer()),
        _ => {}
    }
}

/// Registers the pool (from the heap, or `alloc_host` with `FERRY_UCX_POOL=transport`), prints
/// `REG <address> <key>`, waits for a line on stdin, then prints `DUMP <hex of the whole pool>`.
async fn receiver() {
    let t = UcxTransport::new().unwrap();
    let len = LAYOUT.num_layers as usize * LAYOUT.num_blocks as usize * LAYOUT.block_bytes();
    let memory = match std::env::var("FERRY_UCX_POOL").as_deref() {
        Ok("transport") => t.alloc_host(len).unwrap(),
        _ => HostMemory::zeroed(len),
    };
    assert!(memory.read(0, len).unwrap().iter().all(|&b| b == 0));
    let reg = t.register(Arc::new(Pool(memory.clone()))).await.unwrap();
    println!("REG {} {}", reg.address, reg.key.0);
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let bytes = memory.read(0, len).unwrap();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    println!("DUMP {hex}");
}

/// Connects to `FERRY_UCX_ADDRESS` / `FERRY_UCX_KEY`, writes [`BLOCKS`], flushes, prints
/// `FLUSHED <bytes> MAPPED <receivers' memory mapped here>` or `FAILED <error>`.
async fn writer() {
    let address = std::env::var("FERRY_UCX_ADDRESS").unwrap();
    let key = RemoteKey(std::env::var("FERRY_UCX_KEY").unwrap().parse().unwrap());
    let t = UcxTransport::new().unwrap();
    let result = async {
        let mut w = t.connect(&address, key, Fence::NONE, &LAYOUT).await?;
        for (layer, &block) in BLOCKS.iter().enumerate() {
            let layer = layer as u32;
            w.write(WriteBatch {
                layer,
                writes: vec![BlockWrite {
                    block,
                    data: pattern(layer, block).into(),
                }],
            })
            .await?;
        }
        w.flush().await
    }
    .await;
    match result {
        Ok(n) => println!("FLUSHED {n} MAPPED {}", t.mapped()),
        Err(e) => println!("FAILED {e}"),
    }
}

fn spawn(role: &str, env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "role",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("FERRY_UCX_ROLE", role)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// What follows the first of `tags` in `child`'s stdout (the test harness may print its own
/// text before it on the same line), from that tag on.
fn read_tagged(child: &mut Child, tags: &[&str]) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("child ended before printing one of {tags:?}"))
            .unwrap();
        if let Some(at) = tags.iter().filter_map(|t| line.find(t)).min() {
            return line[at..].trim().to_owned();
        }
    }
}

fn start_receiver(env: &[(&str, &str)]) -> (Child, String, String) {
    let mut rx = spawn("receiver", env);
    let reg = read_tagged(&mut rx, &["REG "]);
    let (address, key) = reg["REG ".len()..].split_once(' ').unwrap();
    (rx, address.to_owned(), key.to_owned())
}

fn run_writer(env: &[(&str, &str)], address: &str, key: &str) -> String {
    let mut all = env.to_vec();
    all.push(("FERRY_UCX_ADDRESS", address));
    all.push(("FERRY_UCX_KEY", key));
    let mut w = spawn("writer", &all);
    let out = read_tagged(&mut w, &["FLUSHED ", "FAILED "]);
    let status = w.wait().unwrap();
    assert!(status.success(), "writer exited with {status}");
    out
}

/// Writes [`BLOCKS`] from a writer process into a receiver process under `env`; the writer
/// must have mapped `mapped` receivers' memory (copies instead of puts) and every byte of the
/// pool must be what was written, or still zero.
fn puts_land_between_processes(env: &[(&str, &str)], mapped: usize) {
    let (mut rx, address, key) = start_receiver(env);
    let out = run_writer(env, &address, &key);
    let block = LAYOUT.block_bytes();
    assert_eq!(
        out,
        format!("FLUSHED {} MAPPED {mapped}", 3 * block),
        "writer said {out:?}"
    );
    writeln!(rx.stdin.as_mut().unwrap(), "dump").unwrap();
    let dump = read_tagged(&mut rx, &["DUMP "]);
    let dump = &dump["DUMP ".len()..];
    assert!(rx.wait().unwrap().success());
    let bytes: Vec<u8> = (0..dump.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&dump[i..i + 2], 16).unwrap())
        .collect();
    let mut expected = HashMap::new();
    for (layer, &b) in BLOCKS.iter().enumerate() {
        expected.insert((layer as u32, b), pattern(layer as u32, b));
    }
    for layer in 0..LAYOUT.num_layers {
        for b in 0..LAYOUT.num_blocks {
            let at = (layer as usize * LAYOUT.num_blocks as usize + b as usize) * block;
            let got = &bytes[at..at + block];
            match expected.get(&(layer, b)) {
                Some(want) => assert!(got == &want[..], "layer {layer} block {b}: wrong bytes"),
                None => assert!(
                    got.iter().all(|&x| x == 0),
                    "layer {layer} block {b} was written"
                ),
            }
        }
    }
}

#[test]
fn puts_land_between_processes_over_shared_memory() {
    puts_land_between_processes(&[("UCX_TLS", "posix,sysv,cma")], 0);
}

#[test]
fn puts_land_between_processes_over_tcp() {
    puts_land_between_processes(&[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")], 0);
}

/// A pool in UCX shared memory: the writer maps it once per lane (the default two) and copies
/// into it.
#[test]
fn copies_land_in_a_shared_memory_pool() {
    let env = [
        ("UCX_TLS", "posix,sysv,cma"),
        ("FERRY_UCX_POOL", "transport"),
    ];
    puts_land_between_processes(&env, ferry_kvtransfer::ucx::DEFAULT_LANES);
}

/// The same with one lane (`FERRY_UCX_LANES=1`): one mapping.
#[test]
fn one_lane_copies_into_a_shared_memory_pool() {
    let env = [
        ("UCX_TLS", "posix,sysv,cma"),
        ("FERRY_UCX_POOL", "transport"),
        ("FERRY_UCX_LANES", "1"),
    ];
    puts_land_between_processes(&env, 1);
}

/// The same pool written by puts (`FERRY_UCX_RKEY_PTR=0`, the comparison arm).
#[test]
fn puts_land_in_a_shared_memory_pool() {
    let env = [
        ("UCX_TLS", "posix,sysv,cma"),
        ("FERRY_UCX_POOL", "transport"),
        ("FERRY_UCX_RKEY_PTR", "0"),
    ];
    puts_land_between_processes(&env, 0);
}

/// Without the shared-memory transports UCX allocates the pool elsewhere (zeroed here); the
/// writer cannot map it and puts over TCP.
#[test]
fn a_transport_pool_without_shared_memory_takes_puts() {
    let env = [
        ("UCX_TLS", "tcp"),
        ("UCX_NET_DEVICES", "lo"),
        ("FERRY_UCX_POOL", "transport"),
    ];
    puts_land_between_processes(&env, 0);
}

/// A writer with three lanes (`FERRY_UCX_LANES`): each layer goes over its own lane's
/// connection and endpoint, over TCP.
#[test]
fn a_writer_s_lanes_put_between_processes_over_tcp() {
    let env = [
        ("UCX_TLS", "tcp"),
        ("UCX_NET_DEVICES", "lo"),
        ("FERRY_UCX_LANES", "3"),
    ];
    puts_land_between_processes(&env, 0);
}

/// Three lanes copying into a shared-memory pool: each lane maps the pool for itself.
#[test]
fn a_writer_s_lanes_copy_into_a_shared_memory_pool() {
    let env = [
        ("UCX_TLS", "posix,sysv,cma"),
        ("FERRY_UCX_POOL", "transport"),
        ("FERRY_UCX_LANES", "3"),
    ];
    puts_land_between_processes(&env, 3);
}

/// The receiver is killed before the writer connects: the writer reports an error within the
/// connect bound instead of waiting forever.
#[test]
fn a_dead_receiver_is_an_error_not_a_hang() {
    dead_receiver(&[("UCX_TLS", "posix,sysv,cma")]);
}

/// The same for a writer of three lanes, each connecting on its own.
#[test]
fn a_dead_receiver_is_an_error_for_a_writer_of_three_lanes() {
    dead_receiver(&[("UCX_TLS", "posix,sysv,cma"), ("FERRY_UCX_LANES", "3")]);
}

fn dead_receiver(env: &[(&str, &str)]) {
    let (mut rx, address, key) = start_receiver(env);
    rx.kill().unwrap();
    rx.wait().unwrap();
    let started = Instant::now();
    let out = run_writer(env, &address, &key);
    assert!(out.starts_with("FAILED "), "writer said {out:?}");
    assert!(
        started.elapsed() < ferry_kvtransfer::ucx::CONNECT_TIMEOUT + Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}
