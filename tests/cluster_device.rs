//! `--device` on the workers.
//!
//! - A cluster whose workers run on `--device auto` serves the same greedy text as `ferry
//!   generate` on the CPU, and each worker's log says where it runs: the CPU on a machine
//!   without a GPU, the CUDA engine in exact mode (whose greedy tokens equal the CPU's) on one
//!   with a GPU.
//! - A worker asked for a GPU that cannot be opened refuses to start, naming the device and the
//!   reason: it never serves at CPU speed in its place.
//! - On a GPU with a CUDA-enabled UCX (`FERRY_UCX_LIB`, docs/gpu.md), GPU workers on
//!   `--transport ucx` move the prompt's KV device to device (the decode worker registers its
//!   device cache with UCX, the prefill worker puts from its own) and serve the reference text;
//!   both count the same bytes. Skipped (with the reason printed) without a GPU.
mod cluster;

use std::time::Duration;

use cluster::{Cluster, Role, Spec};
use ferry_kernels::Device;

const MAX_TOKENS: u32 = 32;

#[tokio::test]
async fn workers_on_device_auto_serve_the_reference_text() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = cluster::reference_generate(&short, MAX_TOKENS).await;
    let long_ref = cluster::reference_generate(&long, MAX_TOKENS).await;

    let device = ["--device", "auto", "--gpu-mode", "exact"];
    let cluster = Cluster::start(Spec::new(1, 1).prefill(&device).decode(&device)).await;
    let mut client = cluster.grpc().await;
    // The short prompt is prefilled on the decode worker, the long one on the prefill worker
    // and its KV shipped.
    for (prompt, want) in [(&short, &short_ref), (&long, &long_ref)] {
        let out = cluster::generate(&mut client, cluster::greedy_request(prompt, MAX_TOKENS))
            .await
            .expect("Generate succeeds");
        assert_eq!(
            &out.text, want,
            "cluster on --device auto vs ferry generate"
        );
    }
    let decode = cluster.live(Role::Decode)[0].clone();
    let d = cluster.stats(&decode).await;
    assert_eq!(
        d.remote_prefills, 1,
        "the long prompt came from the prefill worker: {d:?}"
    );

    let on_gpu = Device::Cuda(0).probe().is_ok();
    let logs = strip_ansi(&cluster.logs_report());
    for role in ["prefill", "decode"] {
        // This worker's section of the report: from its header to the next one.
        let section = logs
            .split("---- ")
            .find(|s| s.starts_with(role))
            .unwrap_or_else(|| panic!("no {role} log in:\n{logs}"));
        let said = if on_gpu {
            "running on the GPU"
        } else {
            "device=cpu"
        };
        assert!(
            section.contains(said),
            "the {role} worker says where it runs ({said}):\n{section}"
        );
        assert!(
            !section.contains("running on the CPU instead"),
            "no silent fall-back:\n{section}"
        );
    }
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn gpu_workers_over_ucx_move_the_cache_device_to_device() {
    if let Err(e) = Device::Cuda(0).probe() {
        eprintln!("skipping: {e}");
        return;
    }
    let long = cluster::long_prompt();
    let want = cluster::reference_generate(&long, MAX_TOKENS).await;
    let args = [
        "--device",
        "cuda",
        "--gpu-mode",
        "exact",
        "--transport",
        "ucx",
    ];
    let cluster = Cluster::start(Spec::new(1, 1).prefill(&args).decode(&args)).await;
    let mut client = cluster.grpc().await;
    let out = cluster::generate(&mut client, cluster::greedy_request(&long, MAX_TOKENS))
        .await
        .expect("Generate succeeds");
    assert_eq!(out.text, want, "GPU workers over UCX vs ferry generate");
    let (prefill, decode) = (
        cluster.live(Role::Prefill)[0].clone(),
        cluster.live(Role::Decode)[0].clone(),
    );
    let (p, d) = (cluster.stats(&prefill).await, cluster.stats(&decode).await);
    assert_eq!(d.remote_prefills, 1, "{d:?}");
    assert!(
        p.kv_transfer_bytes > 0 && p.kv_transfer_bytes == d.kv_transfer_bytes,
        "both sides count the bytes moved: {p:?} {d:?}"
    );
    let logs = strip_ansi(&cluster.logs_report());
    assert!(
        logs.contains("device KV layers registered with UCX"),
        "the decode worker exposes its device cache to UCX (a CUDA-enabled UCX is loaded):\n{logs}"
    );
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn a_named_gpu_that_cannot_be_opened_is_an_error() {
    // No machine has GPU 99; `rocm` has no whole-model forward yet. Both must refuse to start.
    for device in ["cuda:99", "rocm:0"] {
        for role in ["decode", "prefill"] {
            let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"));
            cmd.args([role, "--device", device, "--router", "127.0.0.1:9"])
                .env_remove("FERRY_DEVICE")
                .kill_on_drop(true);
            let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
                .await
                .expect("the worker exits instead of serving")
                .expect("ferry runs");
            let stderr = strip_ansi(&String::from_utf8_lossy(&out.stderr));
            assert!(
                !out.status.success(),
                "{role} --device {device} started:\n{stderr}"
            );
            assert!(
                stderr.contains(device) && stderr.contains("unavailable"),
                "{role} --device {device}: the error names the device and why:\n{stderr}"
            );
        }
    }
}

#[tokio::test]
async fn ferry_up_checks_each_roles_devices_before_starting_anything() {
    // A role's device list is resolved and checked up front: a GPU that cannot be opened stops
    // `ferry up` with the flag, the device and the reason, before any child starts.
    for (flag, list, bad) in [
        ("--prefill-devices", "cuda:99", "cuda:99"),
        ("--decode-devices", "cpu,cuda:98", "cuda:98"),
    ] {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.args(["up", "--device", "cpu", flag, list])
            .args(["--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0"])
            .env_remove("FERRY_DEVICE")
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .expect("ferry up exits instead of serving")
            .expect("ferry runs");
        let stderr = strip_ansi(&String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success(),
            "ferry up {flag} {list} started:\n{stderr}"
        );
        assert!(
            stderr.contains(flag) && stderr.contains(bad) && stderr.contains("unavailable"),
            "{flag} {list}: the error names the flag, the device and why:\n{stderr}"
        );
        assert!(
            !stdout.contains("ferry is up") && !stderr.contains("router listening"),
            "nothing started:\n{stdout}\n{stderr}"
        );
    }
}

/// `text` without ANSI colour sequences (`ESC [ … m`), as the workers' logs are coloured.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
