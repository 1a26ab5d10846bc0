//! 32 concurrent requests through a 2 prefill + 2 decode cluster, half over gRPC and half over
//! HTTP, short and long prompts, greedy and seeded sampling: all finish, and every KV block
//! comes back. `ferry bench` with a long-prompt mix, against a real cluster.
mod cluster;

use cluster::{Cluster, Role, Spec, MODEL};
use ferry_proto::v1::{FinishReason, SamplingParams};
use futures::future::join_all;
use serde_json::json;

const REQUESTS: usize = 32;
const MAX_TOKENS: u32 = 16;

/// How request `i` is made.
struct Case {
    prompt: String,
    sampling: Option<(f32, u64)>,
    http: bool,
}

fn cases() -> Vec<Case> {
    let golden = [
        cluster::golden_prompt(0),
        cluster::golden_prompt(1),
        cluster::golden_prompt(2),
    ];
    (0..REQUESTS)
        .map(|i| {
            // Distinct long prompts (the golden 211-token one with a different tail) so some
            // prefills share cached blocks and some do not.
            let prompt = match i % 4 {
                0 | 1 => golden[i % 2].clone(),
                2 => golden[2].clone(),
                _ => format!("{} And it came to pass on day {i},", golden[2]),
            };
            Case {
                prompt,
                sampling: (i % 3 == 0).then_some((0.8, i as u64)),
                http: i % 2 == 0,
            }
        })
        .collect()
}

/// Runs one request; returns (text, finish reason as OpenAI spells it).
async fn run(cluster: &Cluster, case: &Case) -> (String, String) {
    if case.http {
        let mut body = json!({
            "model": MODEL,
            "prompt": case.prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        });
        if let Some((t, seed)) = case.sampling {
            body["temperature"] = json!(t);
            body["top_k"] = json!(50);
            body["seed"] = json!(seed);
        }
        let (status, resp) = cluster.post_json("/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        let choice = &resp["choices"][0];
        (
            choice["text"].as_str().expect("text").to_string(),
            choice["finish_reason"]
                .as_str()
                .expect("finish_reason")
                .to_string(),
        )
    } else {
        let sampling = match case.sampling {
            Some((t, seed)) => SamplingParams {
                temperature: Some(t),
                top_k: Some(50),
                seed: Some(seed),
                ..SamplingParams::default()
            },
            None => cluster::greedy(),
        };
        let out = cluster::generate(
            &mut cluster.grpc().await,
            cluster::request(&case.prompt, MAX_TOKENS, sampling, false),
        )
        .await
        .expect("Generate");
        let finish = match out.finish_reason {
            Some(FinishReason::Length) => "length",
            Some(FinishReason::Stop) => "stop",
            other => panic!("finish reason {other:?}"),
        };
        let usage = out.usage.expect("usage");
        assert_eq!(usage.completion_tokens as usize, out.token_ids.len());
        (out.text, finish.to_string())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_mixed_requests_all_complete_and_free_their_blocks() {
    let cluster = Cluster::start(Spec::new(2, 2)).await;
    let cases = cases();
    let results = join_all(cases.iter().map(|c| run(&cluster, c))).await;
    for (i, (text, finish)) in results.iter().enumerate() {
        assert!(
            finish == "length" || finish == "stop",
            "request {i}: finish reason {finish}"
        );
        assert!(!text.is_empty(), "request {i} ({finish}) returned no text");
    }

    // The work was spread: both decode workers served requests, and the remote prefills
    // reached the prefill workers.
    let mut finished = 0;
    for d in cluster.live(Role::Decode) {
        let s = cluster.stats(&d).await;
        assert!(s.requests_finished > 0, "{d} served nothing: {s:?}");
        finished += s.requests_finished;
    }
    assert_eq!(finished, REQUESTS as u64);
    let mut remote = 0;
    for p in cluster.live(Role::Prefill) {
        remote += cluster.stats(&p).await.prefill_computed_tokens;
    }
    assert!(remote > 0, "no prompt was prefilled on a prefill worker");

    cluster.assert_kv_blocks_released().await;
}

/// `ferry bench` with a long-prompt mix against a real cluster: every request is counted in
/// its class, every one generates exactly `--output-tokens`, the long prompts were prefilled
/// on the prefill worker, and `--json` holds what the table printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_bench_runs_a_long_prompt_mix_and_writes_json() {
    let cluster = Cluster::start(Spec::new(1, 1)).await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let json_path = dir.path().join("bench.json");
    let addr = cluster.grpc_addr().to_string();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["bench", "--grpc-addr", &addr, "--concurrency", "1,4"])
        .args(["--requests-per-level", "8", "--prompt-tokens", "16"])
        .args(["--long-prompt-tokens", "600", "--long-every", "4"])
        .args(["--output-tokens", "6", "--json"])
        .arg(&json_path)
        .kill_on_drop(true)
        .output()
        .await
        .expect("ferry bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ferry bench failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| 4 | 8 (2) |"), "table row: {stdout}");

    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).expect("the JSON file")).expect("JSON");
    assert_eq!(doc["long_prompt_tokens"], 600);
    let levels = doc["levels"].as_array().expect("levels");
    assert_eq!(levels.len(), 2);
    for (level, c) in levels.iter().zip([1, 4]) {
        assert_eq!(level["concurrency"], c);
        assert_eq!(level["requests"], 8);
        // Requests 4 and 8 of each level are the long ones.
        assert_eq!(level["long"]["requests"], 2, "{level}");
        assert_eq!(level["short"]["requests"], 6, "{level}");
        assert_eq!(
            level["output_tokens"],
            8 * 6,
            "ignore_eos: every request its 6 tokens"
        );
        let ttft = level["long"]["ttft_ms"]["p50"].as_f64().expect("long TTFT");
        assert!(ttft > 0.0, "{level}");
        assert!(level["short"]["itl_ms"]["p99"].as_f64().expect("short ITL") > 0.0);
    }
    // The four long prompts (distinct, no shared prefix) were prefilled remotely.
    let prefill = cluster.live(Role::Prefill);
    let computed = cluster.stats(&prefill[0]).await.prefill_computed_tokens;
    assert!(
        computed >= 4 * 600,
        "prefill worker computed {computed} tokens"
    );
    cluster.assert_kv_blocks_released().await;
}
