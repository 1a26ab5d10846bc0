//! `--device` on the workers: a cluster whose prefill and decode workers are asked for
//! `cuda:0` serves the same greedy text as `ferry generate` on the CPU. On a machine where the
//! GPU cannot be opened each worker warns and runs on the CPU (asserted from its log); on a GPU
//! machine the workers run the CUDA engine in exact mode, whose greedy tokens equal the CPU's.
mod cluster;

use cluster::{Cluster, Role, Spec};
use ferry_kernels::Device;

const MAX_TOKENS: u32 = 32;

#[tokio::test]
async fn workers_asked_for_cuda_serve_the_reference_text() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = cluster::reference_generate(&short, MAX_TOKENS).await;
    let long_ref = cluster::reference_generate(&long, MAX_TOKENS).await;

    let device = ["--device", "cuda:0", "--gpu-mode", "exact"];
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
            "cluster on --device cuda:0 vs ferry generate"
        );
    }
    let decode = cluster.live(Role::Decode)[0].clone();
    let d = cluster.stats(&decode).await;
    assert_eq!(
        d.remote_prefills, 1,
        "the long prompt came from the prefill worker: {d:?}"
    );

    if Device::Cuda(0).probe().is_err() {
        let logs = strip_ansi(&cluster.logs_report());
        for role in ["prefill", "decode"] {
            // This worker's section of the report: from its header to the next one.
            let section = logs
                .split("---- ")
                .find(|s| s.starts_with(role))
                .unwrap_or_else(|| panic!("no {role} log in:\n{logs}"));
            assert!(
                section.contains("running on the CPU instead") && section.contains("device=cpu"),
                "the {role} worker falls back to the CPU with a warning:\n{section}"
            );
        }
    }
    cluster.assert_kv_blocks_released().await;
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
