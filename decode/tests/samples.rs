//! The decode service's `n` > 1 calls, on the embedded model through the service itself (no
//! network): `CancelSample` stops one forked sample (its blocks return while the others run,
//! and they give the tokens they give without the cancel), and a `sample_index` call resumes
//! one sample exactly where it left off (what the router sends after a migration), and a
//! sample failed by an unreachable prefill peer says UNAVAILABLE in its `error_code` (the router
//! resumes it elsewhere).
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ferry_decode::region::EngineRegion;
use ferry_decode::service::{DecodePolicy, DecodeService, KvTarget};
use ferry_decode::FailurePolicy;
use ferry_kvtransfer::{KvRegion, LocalTransport, Transport};
use ferry_model::deepseek::DeepseekModel;
use ferry_model::engine::{EngineConfig, EngineHandle};
use ferry_proto::auth::AttachToken;
use ferry_proto::internal::decode_worker_server::DecodeWorker;
use ferry_proto::internal::{CancelSampleRequest, DecodeRequest, DecodeResponse, Sampling, Stop};
use ferry_proto::v1::FinishReason;
use futures::StreamExt;
use tonic::Request;

async fn service() -> DecodeService {
    service_with(1024, FailurePolicy::Recompute).await
}

/// The service with prompts of more than `local_prefill_threshold` uncached tokens prefilled
/// by the request's peer, and `on_failure` when that fails.
async fn service_with(local_prefill_threshold: usize, on_failure: FailurePolicy) -> DecodeService {
    let dir = ferry_model::embedded::default_model_dir();
    let model = DeepseekModel::load(&dir).expect("model");
    let engine = EngineHandle::spawn(
        model,
        EngineConfig {
            num_blocks: 256,
            max_batch_tokens: 256,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let region = std::sync::Arc::new(EngineRegion::new(engine.clone()));
    let layout = region.layout();
    let registration = LocalTransport::new()
        .register(region)
        .await
        .expect("register");
    let metrics = ferry_decode::metrics::DecodeMetrics::register(&prometheus::Registry::new())
        .expect("metrics");
    DecodeService::new(
        "d0".into(),
        engine,
        KvTarget {
            registration,
            layout,
        },
        DecodePolicy {
            local_prefill_threshold,
            on_failure,
            prefill_timeout: Duration::from_secs(60),
            peer_auth: AttachToken::new(None),
        },
        metrics,
    )
}

/// A seeded (temperature 0.8) request for `max_tokens` tokens, ignoring end-of-sequence.
fn seeded(prompt: Vec<u32>, max_tokens: u32, n: u32) -> DecodeRequest {
    DecodeRequest {
        request_id: "r-1".into(),
        prompt_tokens: prompt,
        sampling: Some(Sampling {
            temperature: 0.8,
            top_p: 1.0,
            seed: Some(7),
            ..Default::default()
        }),
        stop: Some(Stop {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        n,
        // Exactness across a resumption holds for non-speculative seeded sampling.
        speculative: Some(false),
        ..Default::default()
    }
}

fn prompt() -> Vec<u32> {
    (0..37u32).map(|i| 3 + (i * 7) % 200).collect()
}

/// Each sample's tokens and finish over a whole call.
async fn run(s: &DecodeService, req: DecodeRequest) -> BTreeMap<u32, (Vec<u32>, i32)> {
    let mut stream = s
        .decode(Request::new(req))
        .await
        .expect("decode")
        .into_inner();
    let mut out: BTreeMap<u32, (Vec<u32>, i32)> = BTreeMap::new();
    while let Some(m) = stream.next().await {
        let m = m.expect("message");
        assert!(m.error.is_empty(), "{m:?}");
        let e = out.entry(m.index).or_default();
        e.0.extend(&m.token_ids);
        if m.finish_reason != FinishReason::Unspecified as i32 {
            e.1 = m.finish_reason;
        }
    }
    out
}

async fn wait_idle(e: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = e.stats().await.expect("stats");
        if s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "engine did not go idle: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_sample_stops_one_sample_and_the_others_give_the_same_tokens() {
    const MAX: u32 = 160;
    let s = service().await;
    let engine = s.engine_handle();
    let want = run(&s, seeded(prompt(), MAX, 3)).await;
    assert_eq!(want.len(), 3);
    for (i, (tokens, finish)) in &want {
        assert_eq!(tokens.len(), MAX as usize, "sample {i}");
        assert_eq!(*finish, FinishReason::Length as i32, "sample {i}");
    }
    assert_ne!(
        want[&1].0, want[&2].0,
        "seeded samples draw their own streams"
    );
    wait_idle(&engine).await;

    let mut stream = s
        .decode(Request::new(seeded(prompt(), MAX, 3)))
        .await
        .expect("decode")
        .into_inner();
    let mut got: BTreeMap<u32, (Vec<u32>, i32)> = BTreeMap::new();
    let mut call_id = 0;
    // Read until sample 1's first message, which names the call.
    while !got.contains_key(&1) {
        let m: DecodeResponse = stream.next().await.expect("a message").expect("ok");
        if m.index == 1 {
            call_id = m.call_id;
        }
        got.entry(m.index).or_default().0.extend(&m.token_ids);
    }
    assert_ne!(call_id, 0, "each sample's first message names the call");
    let cancel = |request_id: &str, call_id: u64, index: u32| {
        let s = s.clone();
        let request = CancelSampleRequest {
            request_id: request_id.into(),
            call_id,
            index,
        };
        async move {
            s.cancel_sample(Request::new(request))
                .await
                .expect("CancelSample never fails")
                .into_inner()
                .stopped
        }
    };
    assert!(!cancel("r-2", call_id, 1).await, "another request's call");
    assert!(!cancel("r-1", call_id + 1000, 1).await, "an unknown call");
    assert!(!cancel("r-1", call_id, 3).await, "no sample 3");
    assert!(cancel("r-1", call_id, 1).await);
    assert!(!cancel("r-1", call_id, 1).await, "already stopped");
    // Sample 1 leaves the engine (its blocks with it) while samples 0 and 2 still run.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = engine.stats().await.expect("stats");
        if st.running + st.waiting == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "sample 1 still runs: {st:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    while let Some(m) = stream.next().await {
        let m = m.expect("message");
        assert!(m.error.is_empty(), "{m:?}");
        let e = got.entry(m.index).or_default();
        e.0.extend(&m.token_ids);
        if m.finish_reason != FinishReason::Unspecified as i32 {
            e.1 = m.finish_reason;
        }
    }
    assert_eq!(got[&0], want[&0], "sample 0 as without the cancel");
    assert_eq!(got[&2], want[&2], "sample 2 as without the cancel");
    let (one, finish) = &got[&1];
    assert_eq!(
        *finish,
        FinishReason::Unspecified as i32,
        "sample 1 never finished"
    );
    assert!(
        one.len() < MAX as usize,
        "sample 1 stopped early: {}",
        one.len()
    );
    assert_eq!(
        one[..],
        want[&1].0[..one.len()],
        "sample 1's tokens until the stop"
    );
    wait_idle(&engine).await;
    // The call leaves with its samples' tasks (which end right after their last message).
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.live_calls() > 0 {
        assert!(Instant::now() < deadline, "the call never left");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_index_call_resumes_that_sample_exactly() {
    const MAX: u32 = 24;
    let s = service().await;
    let want = run(&s, seeded(prompt(), MAX, 3)).await;
    for (sample, k) in [(2u32, 9usize), (1, 1), (0, 17)] {
        let full = &want[&sample].0;
        let mut req = seeded([prompt(), full[..k].to_vec()].concat(), MAX, 1);
        req.sample_index = sample;
        req.generated_tokens = k as u32;
        let got = run(&s, req).await;
        assert_eq!(
            got.keys().copied().collect::<Vec<_>>(),
            vec![sample],
            "index"
        );
        assert_eq!(
            got[&sample].0,
            full[k..],
            "sample {sample} resumed after {k}"
        );
        assert_eq!(got[&sample].1, FinishReason::Length as i32);
    }
    // Refused: an index out of range, or with n > 1.
    for (n, sample) in [(1, 16), (2, 1)] {
        let mut req = seeded(prompt(), MAX, n);
        req.sample_index = sample;
        let status = match s.decode(Request::new(req)).await {
            Err(status) => status,
            Ok(_) => panic!("n {n} with sample_index {sample} was accepted"),
        };
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("`sample_index`"), "{status:?}");
    }
    wait_idle(&s.engine_handle()).await;
}

/// Under `--on-prefill-failure fail`, an `n` = 2 call whose prefill peer cannot be reached
/// fails each sample in-band with UNAVAILABLE in `error_code` (the router resumes such a sample
/// on another worker) and frees every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_failed_by_an_unreachable_peer_says_unavailable() {
    let s = service_with(4, FailurePolicy::Fail).await;
    // A port nothing listens on: bind one, note it, let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let req = DecodeRequest {
        prefill_peer: Some(ferry_proto::internal::PrefillPeer {
            worker_id: "p-gone".into(),
            grpc_address: format!("127.0.0.1:{port}"),
        }),
        ..seeded(prompt(), 8, 2)
    };
    let mut stream = s
        .decode(Request::new(req))
        .await
        .expect("decode")
        .into_inner();
    let mut failed = BTreeMap::new();
    while let Some(m) = stream.next().await {
        let m = m.expect("in-band failures, not a failed stream");
        assert!(m.token_ids.is_empty(), "no token without a prefill: {m:?}");
        assert!(!m.error.is_empty(), "{m:?}");
        failed.insert(m.index, m.error_code);
    }
    let unavailable = tonic::Code::Unavailable as u32;
    assert_eq!(failed, BTreeMap::from([(0, unavailable), (1, unavailable)]));
    wait_idle(&s.engine_handle()).await;
}
