//! The two planes through real processes (router + 1 prefill + 1 decode, every child holding
//! the cluster token): the attack from issue 11 — registering a live worker's id with an
//! address of the attacker's choosing — fails on the public port (no Registry there), on the
//! internal port without the token, and with the token from another address; the workers'
//! own services and KV transfer listeners refuse callers without the token; and users'
//! requests (prefilled remotely, so KV crosses the authenticated transfer) succeed throughout.
mod cluster;

use std::net::SocketAddr;

use cluster::{Cluster, Spec};
use ferry_proto::auth::{AttachToken, ClusterToken};
use ferry_proto::internal::decode_worker_client::DecodeWorkerClient;
use ferry_proto::internal::prefill_worker_client::PrefillWorkerClient;
use ferry_proto::internal::registry_client::RegistryClient;
use ferry_proto::internal::{self, GetStatsRequest};
use tonic::transport::Channel;
use tonic::Code;

/// Long enough that the prompt is prefilled on the prefill worker and shipped.
fn prompt() -> String {
    cluster::long_prompt()
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

/// The attacker's registration: `decode-0`, the live decode worker's id, at an address of
/// the attacker's choosing.
fn hijack() -> internal::RegisterRequest {
    internal::RegisterRequest {
        worker_id: "decode-0".into(),
        role: internal::WorkerRole::Decode as i32,
        grpc_address: "127.0.0.1:9".into(),
        page_size: 64,
        total_blocks: 1 << 20,
        cached_block_hashes: vec![],
        last_event_id: 0,
        instance_id: 666,
        transports: vec![],
    }
}

#[tokio::test]
async fn nobody_without_the_cluster_token_can_take_over_routing_or_a_worker() {
    let cluster = Cluster::start(Spec::new(1, 1).decode(&["--local-prefill-threshold", "0"])).await;
    let expected = cluster::reference_generate(&prompt(), 16).await;
    let users = cluster.grpc().await;
    let served = |what: &'static str| {
        let mut users = users.clone();
        let expected = expected.clone();
        async move {
            let out = cluster::generate(&mut users, cluster::greedy_request(&prompt(), 16))
                .await
                .unwrap_or_else(|e| panic!("a user request failed {what}: {e:?}"));
            assert_eq!(out.text, expected, "{what}");
        }
    };
    served("before the attack").await;

    // 1. The public gRPC port has no Registry.
    let err = RegistryClient::new(channel(cluster.grpc_addr()).await)
        .register(hijack())
        .await
        .expect_err("no Registry on the public port");
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");

    // 2. The internal port: without the token, or with a wrong one, UNAUTHENTICATED.
    let internal = channel(cluster.internal_addr()).await;
    let err = RegistryClient::new(internal.clone())
        .register(hijack())
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let wrong: ClusterToken = "a-guessed-cluster-token".parse().expect("token");
    let err = RegistryClient::with_interceptor(internal.clone(), AttachToken::new(Some(wrong)))
        .register(hijack())
        .await
        .expect_err("wrong token");
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    served("after the unauthenticated attempts").await;

    // 3. Even with the token, a live id from another address is refused, not applied.
    let mut insider = RegistryClient::with_interceptor(
        internal,
        AttachToken::new(Some(cluster::cluster_token())),
    );
    let err = insider
        .register(hijack())
        .await
        .expect_err("a live id from another address");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    for _ in 0..3 {
        let hb = insider
            .heartbeat(internal::HeartbeatRequest {
                worker_id: "decode-0".into(),
                load: Some(internal::WorkerLoad::default()),
                instance_id: 666,
            })
            .await
            .expect("answered");
        assert!(
            !hb.into_inner().known,
            "the forged instance is not registered"
        );
        served("during the insider's attempt").await;
    }
    let (prefill, decode) = cluster.health_counts().await.expect("health");
    assert_eq!((prefill, decode), (1, 1));

    // 4. The workers' own services refuse calls without the token.
    for id in ["prefill-0", "decode-0"] {
        let ch = channel(cluster.worker_addr(id)).await;
        let err = if id.starts_with("prefill") {
            PrefillWorkerClient::new(ch)
                .get_stats(GetStatsRequest {})
                .await
        } else {
            DecodeWorkerClient::new(ch)
                .get_stats(GetStatsRequest {})
                .await
        }
        .expect_err("no token");
        assert_eq!(err.code(), Code::Unauthenticated, "{id}: {err:?}");
    }
    let err = DecodeWorkerClient::new(channel(cluster.worker_addr("decode-0")).await)
        .cancel_sample(internal::CancelSampleRequest {
            request_id: "r".into(),
            call_id: 1,
            index: 1,
        })
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated, "CancelSample: {err:?}");
    // …and accept the cluster's (the router's calls do, or nothing above would be served).
    let stats = cluster.stats("prefill-0").await;
    assert!(
        stats.prefill_computed_tokens > 0,
        "the prompts were prefilled remotely and shipped over the authenticated transfer: {stats:?}"
    );
    served("at the end").await;
    cluster.assert_kv_blocks_released().await;
}
