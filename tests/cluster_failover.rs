//! Routing around failures, through real processes: a decode worker SIGKILLed mid-stream
//! (the request migrates and gives exactly the text it would have given; with `n` = 2 each
//! sample is resumed on its own and gives its own text), one of two decode
//! workers SIGKILLed under load (no request fails; a dead worker is marked down at its first
//! connect error), and a prefill worker SIGSTOPped while requests wait on it (they recompute
//! as soon as the router drops it, not after `--prefill-timeout-s`).
mod cluster;

use std::time::{Duration, Instant};

use cluster::{Cluster, Role, Spec};
use ferry_proto::v1::{FinishReason, GenerateRequest, SamplingParams};
use futures::StreamExt;

/// Long enough that the kill lands mid-stream: prompt (211) + this stays within the context.
const LONG: u32 = 400;
/// Tokens the test reads before it kills the worker serving the stream.
const KILL_AFTER: usize = 24;

fn seeded() -> SamplingParams {
    SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.95),
        seed: Some(7),
        ..SamplingParams::default()
    }
}

/// The decode worker with a running request (exactly one of `ids` must have one).
async fn serving(cluster: &Cluster, ids: &[String]) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut busy = Vec::new();
        for id in ids {
            if cluster.stats(id).await.running_requests > 0 {
                busy.push(id.clone());
            }
        }
        if busy.len() == 1 {
            return busy.remove(0);
        }
        assert!(
            Instant::now() < deadline,
            "no single busy decode worker: {busy:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_request_whose_decode_worker_dies_mid_stream_migrates_and_gives_the_same_text() {
    // The prompt is prefilled remotely (211 tokens > the threshold); the resumed request is
    // prefilled on the new decode worker.
    let mut cluster = Cluster::start(Spec::new(1, 3)).await;
    let prompt = cluster::long_prompt();
    let mut client = cluster.grpc().await;
    // Both with the `speculative` field unset, as a client sends them: greedy requests
    // speculate on the workers' drafter (lossless for greedy); a seeded sampled request then
    // decodes without speculation, since a speculative round draws its randomness per round
    // and a migration moves the rounds' boundaries (docs/fault-tolerance.md).
    for (what, sampling) in [("greedy", cluster::greedy()), ("seeded", seeded())] {
        let req = cluster::request(&prompt, LONG, sampling, true);
        let want = cluster::generate(&mut client, req.clone())
            .await
            .unwrap_or_else(|e| panic!("{what}: the undisturbed run: {e:?}"));
        assert_eq!(want.token_ids.len(), LONG as usize, "{what}");

        let before = cluster::counter_value(
            &cluster.router_metrics().await,
            "ferry_request_migrations_total",
        );
        let started = Instant::now();
        let (got, usage, killed) = generate_samples(&mut cluster, req, Some(KILL_AFTER)).await;
        let (got, killed) = (&got[0], killed.expect("the stream ended before the kill"));
        eprintln!(
            "{what}: killed {killed} after {KILL_AFTER} tokens; the request finished in {:?}",
            started.elapsed()
        );
        assert_eq!(got.token_ids, want.token_ids, "{what}: the token ids");
        assert_eq!(got.text, want.text, "{what}: the text");
        assert_eq!(got.finish_reason, Some(FinishReason::Length), "{what}");
        let (usage, want_usage) = (
            usage.expect("usage on the last message"),
            want.usage.expect("usage"),
        );
        assert_eq!(usage.prompt_tokens, want_usage.prompt_tokens, "{what}");
        assert_eq!(usage.completion_tokens, LONG, "{what}");
        let after = cluster::counter_value(
            &cluster.router_metrics().await,
            "ferry_request_migrations_total",
        );
        assert_eq!(after, before + 1.0, "{what}: one migration counted");
    }
    cluster.assert_kv_blocks_released().await;
}

/// One sample of an `n` > 1 stream as the client read it.
#[derive(Debug, Default, Clone, PartialEq)]
struct Sample {
    token_ids: Vec<u32>,
    text: String,
    finish_reason: Option<FinishReason>,
}

/// Streams `req` (any `n`); with `kill_after`, SIGKILLs the decode worker serving it once that
/// many tokens (all samples) came. Returns each sample, the usage and the killed worker.
async fn generate_samples(
    cluster: &mut Cluster,
    req: GenerateRequest,
    kill_after: Option<usize>,
) -> (Vec<Sample>, Option<ferry_proto::v1::Usage>, Option<String>) {
    let n = req.n.unwrap_or(1) as usize;
    let decode = cluster.live(Role::Decode);
    let mut client = cluster.grpc().await;
    let mut stream = client
        .generate(req)
        .await
        .expect("Generate starts")
        .into_inner();
    let (mut samples, mut usage, mut killed) = (vec![Sample::default(); n], None, None);
    let mut tokens = 0;
    while let Some(msg) = stream.next().await {
        let msg = msg.unwrap_or_else(|e| panic!("the stream failed after {tokens} tokens: {e:?}"));
        let s = &mut samples[msg.index as usize];
        s.text.push_str(&msg.text);
        s.token_ids.extend(&msg.token_ids);
        tokens += msg.token_ids.len();
        if msg.finish_reason != FinishReason::Unspecified as i32 {
            assert_eq!(s.finish_reason, None, "one finish per sample");
            s.finish_reason = FinishReason::try_from(msg.finish_reason).ok();
        }
        if msg.usage.is_some() {
            usage = msg.usage;
        }
        if killed.is_none() && kill_after.is_some_and(|k| tokens >= k) {
            let id = serving(cluster, &decode).await;
            cluster.kill(&id);
            killed = Some(id);
        }
    }
    (samples, usage, killed)
}

#[tokio::test]
async fn an_n_2_request_whose_decode_worker_dies_resumes_each_sample_and_gives_the_same_text() {
    // Seeded, so without speculation unless asked (exact across a migration,
    // docs/fault-tolerance.md), and the two samples draw different streams: each must
    // continue its own.
    const MAX: u32 = 160;
    let mut cluster = Cluster::start(Spec::new(0, 3)).await;
    let req = GenerateRequest {
        n: Some(2),
        ..cluster::request(&cluster::long_prompt(), MAX, seeded(), true)
    };
    let (want, want_usage, _) = generate_samples(&mut cluster, req.clone(), None).await;
    assert_ne!(
        want[0].token_ids, want[1].token_ids,
        "seeded samples differ"
    );
    let before = cluster::counter_value(
        &cluster.router_metrics().await,
        "ferry_request_migrations_total",
    );
    let (got, usage, killed) = generate_samples(&mut cluster, req, Some(KILL_AFTER)).await;
    let killed = killed.expect("the stream ended before the kill");
    eprintln!("n = 2: killed {killed} after {KILL_AFTER} tokens");
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        assert_eq!(got.token_ids.len(), MAX as usize, "sample {i}");
        assert_eq!(got.token_ids, want.token_ids, "sample {i}: the token ids");
        assert_eq!(got.text, want.text, "sample {i}: the text");
        assert_eq!(got.finish_reason, Some(FinishReason::Length), "sample {i}");
    }
    let (usage, want_usage) = (usage.expect("usage"), want_usage.expect("usage"));
    assert_eq!(usage.prompt_tokens, want_usage.prompt_tokens);
    assert_eq!(usage.completion_tokens, 2 * MAX);
    let after = cluster::counter_value(
        &cluster.router_metrics().await,
        "ferry_request_migrations_total",
    );
    assert_eq!(after, before + 1.0, "one migration counted");
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn killing_one_of_two_decode_workers_under_load_fails_no_request() {
    // A minute of heartbeat timeout: only a connect error or a broken stream can tell the
    // router that a worker is gone.
    let mut cluster = Cluster::start(Spec::new(0, 2).router(&[
        "--heartbeat-timeout-ms",
        "60000",
        "--policy",
        "round_robin",
    ]))
    .await;
    let decode = cluster.live(Role::Decode);
    let client = cluster.grpc().await;
    const N: usize = 32;
    const MAX: u32 = 48;
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let mut client = client.clone();
            let req =
                cluster::greedy_request(&format!("Request {i}: {}", cluster::short_prompt()), MAX);
            tokio::spawn(async move { cluster::generate(&mut client, req).await })
        })
        .collect();
    // Kill once both workers are streaming.
    for id in &decode {
        cluster
            .wait_stats(id, Duration::from_secs(30), "running requests", |s| {
                s.running_requests > 0
            })
            .await;
    }
    cluster.kill(&decode[0]);
    for (i, task) in tasks.into_iter().enumerate() {
        let out = task
            .await
            .expect("the request task")
            .unwrap_or_else(|e| panic!("request {i} failed: {e:?}"));
        assert_eq!(out.token_ids.len(), MAX as usize, "request {i}");
        assert_eq!(out.finish_reason, Some(FinishReason::Length), "request {i}");
    }
    let metrics = cluster.router_metrics().await;
    assert!(
        cluster::counter_value(&metrics, "ferry_request_migrations_total") >= 1.0,
        "some in-flight requests migrated:\n{metrics}"
    );
    cluster.wait_health(0, 1, Duration::from_secs(2)).await;

    // An idle worker dies: the next requests meet a refused connection, mark it down and go
    // to the other worker; none fails, and `/health` stops counting it at once.
    cluster.add_worker(Role::Decode, "decode-2").await;
    cluster.kill("decode-2");
    let mut client = client.clone();
    for i in 0..6 {
        let req = cluster::greedy_request(&cluster::short_prompt(), 4);
        let out = cluster::generate(&mut client, req)
            .await
            .unwrap_or_else(|e| panic!("request {i} right after the kill: {e:?}"));
        assert_eq!(out.token_ids.len(), 4, "request {i}");
    }
    assert_eq!(
        cluster.health_counts().await,
        Some((0, 1)),
        "the dead worker is not counted"
    );
    let metrics = cluster.router_metrics().await;
    assert!(
        cluster::counter_value(&metrics, "ferry_routing_workers_marked_down_total") >= 2.0,
        "both dead workers were marked down:\n{metrics}"
    );
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn requests_waiting_on_a_stopped_prefill_worker_recompute_once_the_router_drops_it() {
    // Every prompt goes to the prefill worker; its peer timeout is a minute, the router's
    // heartbeat timeout one second.
    let cluster = Cluster::start(
        Spec::new(1, 1)
            .router(&["--heartbeat-timeout-ms", "1000"])
            .decode(&[
                "--local-prefill-threshold",
                "0",
                "--prefill-timeout-s",
                "60",
            ]),
    )
    .await;
    let (prefill, decode) = (
        cluster.live(Role::Prefill)[0].clone(),
        cluster.live(Role::Decode)[0].clone(),
    );
    let client = cluster.grpc().await;
    let before = cluster.stats(&decode).await;
    cluster.pause(&prefill);
    let stopped = Instant::now();
    const N: usize = 4;
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let mut client = client.clone();
            let req = cluster::greedy_request(&format!("Part {i}. {}", cluster::long_prompt()), 8);
            tokio::spawn(async move {
                let out = cluster::generate(&mut client, req).await;
                (out, Instant::now())
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let (out, done) = task.await.expect("the request task");
        let out = out.unwrap_or_else(|e| panic!("request {i}: {e:?}"));
        assert_eq!(out.token_ids.len(), 8, "request {i}");
        let waited = done - stopped;
        eprintln!("request {i} completed {waited:?} after the prefill worker stopped");
        assert!(
            waited < Duration::from_secs(10),
            "request {i} took {waited:?}: it waited for the stopped peer, not for the router"
        );
    }
    let after = cluster.stats(&decode).await;
    assert_eq!(
        after.recomputed_prefills,
        before.recomputed_prefills + N as u64,
        "every request was sent to the stopped peer and recomputed: {after:?}"
    );

    // The stopped peer may still write into the blocks it was given (one-sided puts cannot
    // be refused on arrival): they stay quarantined on the decode worker until its calls end.
    assert!(
        after.kv_blocks_used > 0,
        "the abandoned transfers' blocks are held while the peer is stopped: {after:?}"
    );

    // Continued, it registers again and prefills for the decode worker again; its abandoned
    // calls end, and the quarantined blocks come back (checked at the end).
    cluster.resume(&prefill);
    cluster.wait_health(1, 1, Duration::from_secs(10)).await;
    let mut client = client.clone();
    let req = cluster::greedy_request(&format!("Later. {}", cluster::long_prompt()), 8);
    cluster::generate(&mut client, req)
        .await
        .expect("a request after SIGCONT");
    let last = cluster.stats(&decode).await;
    assert_eq!(last.remote_prefills, after.remote_prefills + 1, "{last:?}");
    cluster.assert_kv_blocks_released().await;
}
