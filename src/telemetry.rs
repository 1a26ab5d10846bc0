//! Logging and trace export for every `ferry` process: the one place that reads the
//! `FERRY_LOG` and OpenTelemetry `OTEL_*` environment variables.
//!
//! ```text
//!  tracing spans/events ─► registry ─┬─ fmt layer (stderr, FERRY_LOG)                 always
//!                                    ├─ queue-time layer (ferry_request_queue_time_seconds)  workers
//!                                    └─ OpenTelemetry layer (FERRY_OTEL_FILTER) ─► batch
//!                                       span processor (its own thread) ─► OTLP/gRPC   when enabled
//! ```
//!
//! Export is **off by default and free when off**: no exporter, no OpenTelemetry layer and no
//! thread exist unless `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is
//! set or `OTEL_TRACES_EXPORTER=otlp`; `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`
//! turn it off again. The SDK reads the rest of the standard variables itself:
//! `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the default service name is
//! `ferry-<role>`), `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default
//! `parentbased_always_on`), `OTEL_EXPORTER_OTLP_{TRACES_,}{ENDPOINT,TIMEOUT,HEADERS}` and
//! `OTEL_BSP_*` (batching). Children of `ferry up` inherit the environment, so every process of
//! a local cluster exports when it is set.
//!
//! Only `ferry*` targets reach the exporter (`FERRY_OTEL_FILTER`, default `ferry=info`, in
//! `EnvFilter` syntax); the transport crates (`h2`, `hyper`, `tonic`, `tower`) and the
//! OpenTelemetry crates themselves are always filtered out, so the exporter's own gRPC calls
//! never become spans.
//!
//! The OTLP gRPC client runs on a one-thread tokio runtime owned here, separate from the
//! process's serving runtime, so export keeps working while that runtime shuts down and
//! [`Telemetry::shutdown`] can flush after it is gone.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::SpanExporter;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Targets that never reach the exporter, whatever `FERRY_OTEL_FILTER` says.
const NEVER_EXPORTED: &str =
    "h2=off,hyper=off,hyper_util=off,tonic=off,tower=off,opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off";

/// Which process this is, for the default service name and the role-specific layers.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// `service.name` unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` sets one.
    pub service_name: &'static str,
    /// `service.instance.id` (the worker id), when known.
    pub instance_id: Option<String>,
    /// Whether this process may export traces at all (`ferry up` itself does not: its
    /// children do).
    pub export: bool,
    /// Whether to time the engine's `queue` spans into `ferry_request_queue_time_seconds`
    /// (worker processes).
    pub queue_metrics: bool,
}

/// Installed telemetry; call [`Telemetry::shutdown`] (or drop it) before exiting so buffered
/// spans are flushed.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// Whether the `OTEL_*` environment asks for trace export; what was odd about it goes to
/// `notes` (logged once the subscriber is up).
fn export_requested(notes: &mut Vec<String>) -> bool {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    match var("OTEL_TRACES_EXPORTER").as_deref() {
        Some("otlp") => true,
        Some("none") => false,
        Some(other) => {
            notes.push(format!(
                "OTEL_TRACES_EXPORTER={other:?}: only `otlp` (gRPC) and `none` are supported; not exporting"
            ));
            false
        }
        None => {
            var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
                || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        }
    }
}

fn service_name_from_env() -> bool {
    std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="))
}

fn build_provider(
    config: &TelemetryConfig,
    notes: &mut Vec<String>,
) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), String> {
    for key in [
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    ] {
        if let Ok(p) = std::env::var(key) {
            if p != "grpc" {
                notes.push(format!("{key}={p:?}: ferry exports OTLP over gRPC only"));
            }
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("ferry-otel")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the trace export runtime: {e}"))?;
    // The tonic channel spawns its connection task on the runtime entered here.
    let exporter = {
        let _entered = runtime.enter();
        SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| format!("building the OTLP exporter: {e}"))?
    };
    let mut resource = Resource::builder().with_attributes([
        KeyValue::new("service.namespace", "ferry"),
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
    ]);
    if let Some(id) = &config.instance_id {
        resource = resource.with_attribute(KeyValue::new("service.instance.id", id.clone()));
    }
    if !service_name_from_env() {
        resource = resource.with_service_name(config.service_name);
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    Ok((provider, runtime))
}

/// Installs the global subscriber: logs to stderr always, trace export when the environment
/// asks for it (see the module docs). Call once, first thing in `main`.
pub fn init(config: TelemetryConfig) -> Telemetry {
    let fmt_filter =
        EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| EnvFilter::new("warn,ferry=info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(fmt_filter);
    let mut notes = Vec::new();
    let (provider, runtime) = if config.export && export_requested(&mut notes) {
        match build_provider(&config, &mut notes) {
            Ok((p, r)) => (Some(p), Some(r)),
            Err(e) => {
                notes.push(format!("trace export is disabled: {e}"));
                (None, None)
            }
        }
    } else {
        (None, None)
    };
    let otel = provider.as_ref().map(|p| {
        let base = std::env::var("FERRY_OTEL_FILTER").unwrap_or_else(|_| "ferry=info".into());
        let filter = EnvFilter::try_new(format!("{base},{NEVER_EXPORTED}")).unwrap_or_else(|e| {
            notes.push(format!(
                "FERRY_OTEL_FILTER={base:?} is not a valid filter ({e}); using ferry=info"
            ));
            EnvFilter::new(format!("ferry=info,{NEVER_EXPORTED}"))
        });
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("ferry"))
            .with_tracked_inactivity(false)
            .with_filter(filter)
    });
    let queue = config
        .queue_metrics
        .then(ferry_worker::metrics::queue_time_layer);
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .with(queue)
        .init();
    for note in notes {
        tracing::warn!("{note}");
    }
    if provider.is_some() {
        tracing::info!(
            service = config.service_name,
            "exporting traces over OTLP/gRPC"
        );
    }
    Telemetry { provider, runtime }
}

impl Telemetry {
    /// Flushes buffered spans and stops the exporter (a no-op when not exporting).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "flushing traces at exit failed");
            }
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}
