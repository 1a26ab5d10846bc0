//! The two planes, in process over real gRPC on 127.0.0.1:0: the Registry is not on the public
//! port; on the internal one it needs the cluster token; a live worker id cannot be claimed
//! from another address, and the router's calls to decode workers carry the token. Users'
//! requests keep being served by the real worker throughout the attempted hijack.
mod common;

use ferry_modelcard::tokenizer::Tokenizer;
use ferry_proto::auth::{AttachToken, ClusterToken};
use ferry_proto::internal::{self, registry_client::RegistryClient};
use ferry_proto::v1::{self, generate_request::Input, inference_client::InferenceClient};
use ferry_router::{Router, RouterConfig};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::Code;

use common::{start_worker_requiring, Scripted};

fn token(s: &str) -> ClusterToken {
    s.parse().expect("a valid token")
}

fn register(id: &str, address: &str, instance: u64) -> internal::RegisterRequest {
    internal::RegisterRequest {
        worker_id: id.into(),
        role: internal::WorkerRole::Decode as i32,
        grpc_address: address.into(),
        page_size: 4,
        total_blocks: 256,
        cached_block_hashes: vec![],
        last_event_id: 0,
        instance_id: instance,
        transports: vec![],
    }
}

fn heartbeat(id: &str, instance: u64) -> internal::HeartbeatRequest {
    internal::HeartbeatRequest {
        worker_id: id.into(),
        load: Some(internal::WorkerLoad::default()),
        instance_id: instance,
    }
}

async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

/// A greedy `Generate` of 4 tokens; its text, or the error.
async fn generate(client: &mut InferenceClient<Channel>) -> Result<String, tonic::Status> {
    let req = v1::GenerateRequest {
        input: Some(Input::Text("hello".into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stop: Some(v1::StopConditions {
            max_tokens: 4,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut text = String::new();
    while let Some(m) = stream.message().await? {
        text.push_str(&m.text);
    }
    Ok(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_is_internal_token_checked_and_cannot_be_hijacked() {
    let secret = token("cluster-secret-for-this-test");
    let tok =
        Tokenizer::from_dir(&ferry_modelcard::embedded::default_model_dir()).expect("tokenizer");
    let script = tok
        .encode(" and the earth was without form, and void", false)
        .expect("encode");
    // The real worker refuses calls without the cluster token, so a served request proves the
    // router signs its calls.
    let worker = Scripted::streaming(script.clone());
    let worker_addr = start_worker_requiring(worker.clone(), Some(secret.clone())).await;

    let bound = Router::load(RouterConfig {
        page_size: 4,
        cluster_token: Some(secret.clone()),
        ..RouterConfig::ephemeral()
    })
    .await
    .expect("load")
    .bind()
    .await
    .expect("bind");
    let (public, internal) = (bound.grpc_addr(), bound.internal_addr());
    assert_ne!(public, internal);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(bound.run(shutdown.clone()));

    // 1. The public port does not serve the Registry at all.
    let err = RegistryClient::new(channel(public).await)
        .register(register("decode-0", "127.0.0.1:9", 1))
        .await
        .expect_err("no Registry on the public port");
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");

    // 2. The internal port without the token, or with a wrong one: UNAUTHENTICATED.
    let internal_channel = channel(internal).await;
    let err = RegistryClient::new(internal_channel.clone())
        .register(register("decode-0", "127.0.0.1:9", 1))
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let err = RegistryClient::with_interceptor(
        internal_channel.clone(),
        AttachToken::new(Some(token("not-the-cluster-secret"))),
    )
    .heartbeat(heartbeat("decode-0", 1))
    .await
    .expect_err("wrong token");
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    // 3. The real worker registers with the token and serves.
    let mut registry =
        RegistryClient::with_interceptor(internal_channel, AttachToken::new(Some(secret.clone())));
    registry
        .register(register("decode-0", &worker_addr, 11))
        .await
        .expect("the real worker registers");
    let mut users = InferenceClient::new(channel(public).await);
    let expected = tok.decode(&script[..4], true).expect("decode");
    assert_eq!(generate(&mut users).await.expect("served"), expected);

    // 4. A token holder claiming the live id from another address is refused, not applied:
    //    its heartbeats are for an instance the router does not know, and users keep being
    //    served by the real worker.
    let err = registry
        .register(register("decode-0", "127.0.0.1:9", 666))
        .await
        .expect_err("a live id from another address");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert!(err.message().contains(&worker_addr), "{err:?}");
    for _ in 0..3 {
        let hb = registry
            .heartbeat(heartbeat("decode-0", 666))
            .await
            .expect("heartbeat answered");
        assert!(
            !hb.into_inner().known,
            "the hijacker's instance is not registered"
        );
        assert_eq!(generate(&mut users).await.expect("still served"), expected);
    }
    let hb = registry
        .heartbeat(heartbeat("decode-0", 11))
        .await
        .expect("heartbeat");
    assert!(
        hb.into_inner().known,
        "the real worker is still the registered one"
    );
    assert_eq!(
        worker.call_count(),
        4,
        "every request reached the real worker"
    );

    shutdown.cancel();
    running.await.expect("task").expect("clean shutdown");
}
