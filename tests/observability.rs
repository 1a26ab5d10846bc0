//! Observability of a real cluster: `ferry up` (router + 1 prefill + 1 decode process) exports
//! the spans of one request to a real OTLP/gRPC receiver process (`rotel-agent`, PyPI `rotel`,
//! installed from `tests/python/requirements.txt`), and every process's `/metrics` parses
//! as the Prometheus text format with counters that moved by exactly what was served.
//!
//! ```text
//!  test ──HTTP + traceparent──► ferry up ─┬─ router ──┐
//!                                         ├─ decode ──┼──OTLP/gRPC──► rotel-agent (debug log → file)
//!                                         └─ prefill ─┘
//!  test ◄── parses the receiver's log; scrapes each process's /metrics
//! ```
//!
//! Without `rotel-agent` the test is skipped with a message, except under CI (`CI` set), where
//! it fails: CI must install it.
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

const MODEL: &str = "tiny-k3";
const MAX_TOKENS: u64 = 6;
/// How long the cluster and the receiver may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long spans may take to arrive after the response (export batches every 100 ms here).
const SPAN_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);

/// Requests sent after the traced one, for the counter checks.
const MORE_REQUESTS: usize = 3;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The device the cluster runs on: `$FERRY_TEST_DEVICE`, else the CPU.
fn test_device() -> String {
    std::env::var("FERRY_TEST_DEVICE").unwrap_or_else(|_| "cpu".into())
}

/// The `rotel-agent` binary: `$ROTEL_AGENT`, or the one inside the installed `rotel` wheel.
fn rotel_agent() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ROTEL_AGENT") {
        return Some(PathBuf::from(p));
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), 'rotel-agent'))",
        ])
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && path.is_file()).then_some(path)
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The OTLP receiver: `rotel-agent` printing every span it receives (detailed debug log).
struct Receiver {
    _proc: Proc,
    log: PathBuf,
    endpoint: String,
}

impl Receiver {
    fn start(agent: &Path, dir: &Path) -> Self {
        let (grpc, http) = (free_port(), free_port());
        let log = dir.join("rotel-spans.log");
        let out = File::create(&log).expect("create the receiver log");
        let child = Command::new(agent)
            .args(["start", "--otlp-grpc-endpoint"])
            .arg(format!("127.0.0.1:{grpc}"))
            .arg("--otlp-http-endpoint")
            .arg(format!("127.0.0.1:{http}"))
            .args([
                "--exporter",
                "blackhole",
                "--debug-log",
                "traces",
                "--debug-log-verbosity",
                "detailed",
                "--batch-timeout",
                "50ms",
            ])
            .arg("--pid-file")
            .arg(dir.join("rotel.pid"))
            .arg("--log-file")
            .arg(dir.join("rotel.log"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone the log handle"))
            .stderr(out)
            .spawn()
            .expect("start rotel-agent");
        let proc = Proc(child);
        wait_until("the OTLP receiver listens", START_TIMEOUT, || {
            std::net::TcpStream::connect(("127.0.0.1", grpc)).is_ok()
        });
        Self {
            _proc: proc,
            log,
            endpoint: format!("http://127.0.0.1:{grpc}"),
        }
    }

    fn spans(&self) -> Vec<Span> {
        parse_rotel_spans(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(POLL);
    }
    panic!("timed out waiting until {what}");
}

/// `ferry up` with its stdout collected (it prints every `/metrics` address).
struct Up {
    proc: Proc,
    stdout: Arc<Mutex<String>>,
    http: SocketAddr,
    log: PathBuf,
}

impl Up {
    fn start(dir: &Path, otlp_endpoint: &str) -> Self {
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let log = dir.join("ferry-up.log");
        let err = File::create(&log).expect("create the cluster log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.args(["up", "--http-addr"])
            .arg(http.to_string())
            .arg("--grpc-addr")
            .arg(grpc.to_string())
            .args([
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--kv-blocks",
                "256",
                // Every prompt token uncached on the decode worker goes to the prefill worker.
                "--local-prefill-threshold",
                "0",
                // Every step of the request verifies 4 of the embedded drafter's drafts;
                // under the default `goodput` the measured costs would decide how many,
                // possibly none.
                "--verify-len",
                "fixed:4",
                // The embedded drafter, on every device (`auto` leaves it off on a GPU).
                "--speculative",
                "on",
                // The CPU unless `FERRY_TEST_DEVICE` names another device (the GPU machine
                // runs this test with `FERRY_TEST_DEVICE=cuda`; docs/gpu.md).
                "--device",
            ])
            .arg(test_device())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err);
        for (key, _) in std::env::vars_os() {
            let k = key.to_string_lossy();
            if (k.starts_with("FERRY_") && k != "FERRY_LOG") || k.starts_with("OTEL_") {
                cmd.env_remove(&key);
            }
        }
        // The engine's per-step `batch` spans are debug level: export them too, to check
        // their links.
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env("FERRY_OTEL_FILTER", "ferry=info,ferry_model::engine=debug");
        let mut child = cmd.spawn().expect("start ferry up");
        let out = child.stdout.take().expect("piped stdout");
        let stdout = Arc::new(Mutex::new(String::new()));
        let sink = stdout.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
        let up = Self {
            proc: Proc(child),
            stdout,
            http,
            log,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if up.printed().contains("Ctrl-C stops the cluster") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "ferry up did not come up:\n{}\n{}",
                up.printed(),
                up.log_tail()
            );
            std::thread::sleep(POLL);
        }
        up
    }

    fn printed(&self) -> String {
        self.stdout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// The `/metrics` URLs `ferry up` printed, by process name.
    fn metrics_urls(&self) -> BTreeMap<String, String> {
        self.printed()
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                let (name, url) = (words.next()?, words.next()?);
                url.ends_with("/metrics")
                    .then(|| (name.to_string(), url.to_string()))
            })
            .collect()
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // SIGTERM first so the children flush their spans; SIGKILL (Proc's drop) after.
        let _ = Command::new("kill")
            .args(["-TERM", &self.proc.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.proc.0.try_wait() {
                return;
            }
            std::thread::sleep(POLL);
        }
    }
}

/// One span as `rotel-agent --debug-log-verbosity detailed` prints it.
#[derive(Debug, Clone, Default)]
struct Span {
    service: String,
    trace_id: String,
    span_id: String,
    parent_id: String,
    name: String,
    kind: String,
    attributes: HashMap<String, String>,
    /// `(trace id, span id)` of each linked span.
    links: Vec<(String, String)>,
}

impl Span {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    fn int(&self, key: &str) -> i64 {
        self.attr(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("span `{}` has no integer `{key}`: {self:?}", self.name))
    }
}

/// `Str(x)` / `Int(5)` / `Double(0.5)` / `Bool(true)` → the inner text.
fn unwrap_value(v: &str) -> String {
    match (v.find('('), v.ends_with(')')) {
        (Some(open), true) => v[open + 1..v.len() - 1].to_string(),
        _ => v.to_string(),
    }
}

fn parse_rotel_spans(text: &str) -> Vec<Span> {
    #[derive(PartialEq)]
    enum Section {
        Resource,
        SpanAttributes,
        Links,
        Other,
    }
    let mut spans: Vec<Span> = Vec::new();
    let mut service = String::new();
    let mut section = Section::Other;
    for raw in text.lines() {
        let line = raw.trim();
        let field = |prefix: &str| -> Option<String> {
            line.strip_prefix(prefix)
                .map(|rest| rest.trim_start().trim_start_matches(':').trim().to_string())
        };
        if line.starts_with("ResourceSpans #") {
            service.clear();
            section = Section::Other;
        } else if line == "Resource attributes:" {
            section = Section::Resource;
        } else if line == "Links:" {
            section = Section::Links;
        } else if line.starts_with("SpanLink #") && section == Section::Links {
            if let Some(s) = spans.last_mut() {
                s.links.push(Default::default());
            }
        } else if ["ScopeSpans #", "Events:", "Status"]
            .iter()
            .any(|p| line.starts_with(p))
        {
            section = Section::Other;
        } else if line.starts_with("Span #") {
            spans.push(Span {
                service: service.clone(),
                ..Span::default()
            });
            section = Section::Other;
        } else if line == "Attributes:" && !spans.is_empty() {
            section = Section::SpanAttributes;
        } else if let Some(kv) = line.strip_prefix("-> ") {
            let Some((k, v)) = kv.split_once(": ") else {
                continue;
            };
            match section {
                Section::Resource if k == "service.name" => service = unwrap_value(v),
                Section::SpanAttributes => {
                    if let Some(s) = spans.last_mut() {
                        s.attributes.insert(k.to_string(), unwrap_value(v));
                    }
                }
                Section::Links => {
                    if let Some(link) = spans.last_mut().and_then(|s| s.links.last_mut()) {
                        match k {
                            "Trace ID" => link.0 = v.trim().to_string(),
                            "ID" => link.1 = v.trim().to_string(),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        } else if let Some(s) = spans.last_mut() {
            if let Some(v) = field("Trace ID") {
                s.trace_id = v;
            } else if let Some(v) = field("Parent ID") {
                s.parent_id = v;
            } else if let Some(v) = field("ID") {
                s.span_id = v;
            } else if let Some(v) = field("Name") {
                s.name = v;
            } else if let Some(v) = field("Kind") {
                s.kind = v;
            }
        }
    }
    spans
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Parses `{a="x",b="y"}` (escapes `\\`, `\"`, `\n`); returns the labels and the rest.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s.strip_prefix('{').ok_or("expected `{`")?;
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (name, after) = rest.split_once('=').ok_or("expected `=` in a label")?;
        if !is_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        let mut chars = after
            .strip_prefix('"')
            .ok_or("expected `\"`")?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("duplicate label {name}"));
        }
        rest = &after[end + 2..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Parses the Prometheus text exposition format (version 0.0.4) strictly: every sample
/// belongs to a family declared by `# TYPE` before it, names and labels are well-formed,
/// values are numbers, and histogram buckets are cumulative with `+Inf == _count`.
fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), _) if is_metric_name(name) => {}
                (Some("TYPE"), Some(name), Some(t)) if is_metric_name(name) => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&t) {
                        return Err(at(format!("unknown type {t}")));
                    }
                    if types.insert(name.to_string(), t.to_string()).is_some() {
                        return Err(at("family declared twice".into()));
                    }
                }
                _ => return Err(at("bad comment line".into())),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        if !is_metric_name(name) {
            return Err(at(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(at)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let mut fields = rest.split_whitespace();
        let value = match fields.next().ok_or_else(|| at("no value".into()))? {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse::<f64>()
                .map_err(|e| at(format!("bad value: {e}")))?,
        };
        if let Some(ts) = fields.next() {
            ts.parse::<i64>()
                .map_err(|e| at(format!("bad timestamp: {e}")))?;
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        if !types.contains_key(family) {
            return Err(at(format!("sample of undeclared family {family}")));
        }
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    // Histograms: cumulative buckets, +Inf == count.
    for (family, t) in &types {
        if t != "histogram" {
            continue;
        }
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for s in samples
            .iter()
            .filter(|s| s.name == format!("{family}_bucket"))
        {
            let mut key = s.labels.clone();
            let le = key
                .remove("le")
                .ok_or(format!("{family}: bucket without le"))?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse()
                    .map_err(|e| format!("{family}: bad le {le}: {e}"))?
            };
            series
                .entry(format!("{key:?}"))
                .or_default()
                .push((le, s.value));
        }
        for (key, buckets) in series {
            if buckets
                .windows(2)
                .any(|w| w[0].0 >= w[1].0 || w[0].1 > w[1].1)
            {
                return Err(format!(
                    "{family}{key}: buckets not cumulative: {buckets:?}"
                ));
            }
            let inf = buckets.last().filter(|b| b.0.is_infinite()).map(|b| b.1);
            let count = samples
                .iter()
                .find(|s| s.name == format!("{family}_count") && format!("{:?}", s.labels) == key)
                .map(|s| s.value);
            if inf.is_none() || inf != count {
                return Err(format!(
                    "{family}{key}: +Inf bucket {inf:?} != count {count:?}"
                ));
            }
        }
    }
    Ok(samples)
}

/// Sum of the samples named `name` whose labels include `with`.
fn total(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            with.iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

async fn scrape(http: &reqwest::Client, url: &str) -> Vec<Sample> {
    let resp = http.get(url).send().await.expect("scrape /metrics");
    assert_eq!(resp.status(), 200, "{url}");
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        ctype.starts_with("text/plain"),
        "{url}: content-type {ctype}"
    );
    let text = resp.text().await.expect("metrics body");
    parse_prometheus(&text)
        .unwrap_or_else(|e| panic!("{url}: not the Prometheus text format: {e}\n{text}"))
}

/// Distinct prompts (so no prefix is shared and every prompt is prefilled remotely).
fn prompt(i: usize) -> String {
    let books = [
        "Genesis",
        "Exodus",
        "Leviticus",
        "Numbers",
        "Deuteronomy",
        "Joshua",
    ];
    format!(
        "{} chapter {i}: And the LORD spake unto Moses in the wilderness, saying, number ye the \
         children of Israel after their families, by the house of their fathers, every male by \
         their polls; from twenty years old and upward, all that are able to go forth to war.",
        books[i % books.len()]
    )
}

/// The body of completion `i`: greedy, `MAX_TOKENS` tokens.
fn completion(i: usize) -> serde_json::Value {
    json!({
        "model": MODEL,
        "prompt": prompt(i),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
    })
}

/// Sends one completion; returns (prompt tokens, completion tokens).
async fn complete(
    http: &reqwest::Client,
    base: SocketAddr,
    body: serde_json::Value,
    traceparent: Option<&str>,
) -> (u64, u64) {
    let mut req = http
        .post(format!("http://{base}/v1/completions"))
        .json(&body);
    if let Some(tp) = traceparent {
        req = req.header("traceparent", tp);
    }
    let resp = req.send().await.expect("POST /v1/completions");
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.expect("a JSON body");
    assert_eq!(status, 200, "{body}");
    let usage = &body["usage"];
    (
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens"),
    )
}

/// `x_bucket` / `x_sum` / `x_count` → `x`.
fn family_name(sample: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| sample.strip_suffix(s))
        .unwrap_or(sample)
}

/// Every `ferry_*` identifier in `text`.
fn metric_names_in(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("ferry_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let boundary = rest[..i]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        if boundary {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// One line per span: service, name, id, parent.
fn summary(spans: &[Span]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "{:<14} {:<24} {} <- {}",
                s.service, s.name, s.span_id, s.parent_id
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn one<'a>(spans: &'a [Span], what: &str, pred: impl Fn(&Span) -> bool) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|s| pred(s)).collect();
    assert_eq!(
        found.len(),
        1,
        "exactly one {what} span expected:\n{}",
        summary(spans)
    );
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_across_three_processes_and_metrics_that_count() {
    let Some(agent) = rotel_agent() else {
        let msg = "rotel-agent not found: pip install -r tests/python/requirements.txt";
        if std::env::var_os("CI").is_some() {
            panic!("{msg}");
        }
        eprintln!("SKIPPED: {msg}");
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let receiver = Receiver::start(&agent, dir.path());
    let up = Up::start(dir.path(), &receiver.endpoint);
    // The cluster runs where the test asked (`ferry up` resolves the device once and says so).
    let banner = up.printed();
    let device = banner
        .lines()
        .find_map(|l| l.trim().strip_prefix("Device: "))
        .unwrap_or("none printed")
        .to_string();
    eprintln!("cluster device: {device}");
    assert!(
        device.starts_with(&test_device()),
        "asked for {}, ferry up runs on {device}",
        test_device()
    );
    let http = reqwest::Client::new();

    // `ferry up` reports healthy once a decode worker registered; the prefill worker too.
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let health = http.get(format!("http://{}/health", up.http)).send().await;
        if let Ok(r) = health {
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            if v["prefill_workers"] == 1 && v["decode_workers"] == 1 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "workers did not register:\n{}",
            up.log_tail()
        );
        tokio::time::sleep(POLL).await;
    }
    let urls = up.metrics_urls();
    for name in ["router", "prefill-0", "decode-0"] {
        assert!(
            urls.contains_key(name),
            "ferry up printed no /metrics for {name}:\n{}",
            up.printed()
        );
    }

    // One request under the caller's trace.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{caller_span}-01");
    // It asks for speculative decoding explicitly (the cluster speculates by default).
    let mut traced = completion(0);
    traced["speculative"] = json!(true);
    let mut sent = vec![complete(&http, up.http, traced, Some(&traceparent)).await];

    // Spans of the whole path: router, decode, prefill, the transfer on both ends.
    let wanted = [
        "dispatch",
        "decode",
        "remote_prefill",
        "prefill",
        "kv_transfer",
        "kv_receive",
    ];
    let deadline = Instant::now() + SPAN_TIMEOUT;
    let spans = loop {
        let spans: Vec<Span> = receiver
            .spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect();
        let has_root = spans.iter().any(|s| s.parent_id == caller_span);
        if has_root && wanted.iter().all(|w| spans.iter().any(|s| s.name == *w)) {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans did not arrive; got:\n{}\n{}",
            summary(&spans),
            up.log_tail()
        );
        tokio::time::sleep(POLL).await;
    };

    let services: std::collections::BTreeSet<&str> =
        spans.iter().map(|s| s.service.as_str()).collect();
    for svc in ["ferry-router", "ferry-decode", "ferry-prefill"] {
        assert!(services.contains(svc), "no span from {svc}: {services:?}");
    }
    let in_svc =
        |svc: &'static str, name: &'static str| move |s: &Span| s.service == svc && s.name == name;
    let request = one(&spans, "router request", |s| {
        s.service == "ferry-router" && s.parent_id == caller_span
    });
    assert_eq!(request.name, format!("text_completion {MODEL}"));
    assert_eq!(request.kind, "SPAN_KIND_SERVER");
    let route = one(&spans, "route", in_svc("ferry-router", "route"));
    let dispatch = one(&spans, "dispatch", in_svc("ferry-router", "dispatch"));
    let decode = one(&spans, "decode", in_svc("ferry-decode", "decode"));
    let remote = one(
        &spans,
        "remote_prefill",
        in_svc("ferry-decode", "remote_prefill"),
    );
    let prefill = one(&spans, "prefill", in_svc("ferry-prefill", "prefill"));
    let queue = one(&spans, "prefill queue", in_svc("ferry-prefill", "queue"));
    let transfer = one(
        &spans,
        "kv_transfer",
        in_svc("ferry-prefill", "kv_transfer"),
    );
    let receive = one(&spans, "kv_receive", in_svc("ferry-decode", "kv_receive"));
    for (child, parent) in [
        (route, request),
        (dispatch, request),
        (decode, dispatch),
        (remote, decode),
        (prefill, remote),
        (queue, prefill),
        (transfer, prefill),
        (receive, transfer),
    ] {
        assert_eq!(
            child.parent_id, parent.span_id,
            "`{}` ({}) must be a child of `{}` ({})",
            child.name, child.service, parent.name, parent.service
        );
    }
    assert_eq!(dispatch.kind, "SPAN_KIND_CLIENT");
    assert_eq!(decode.kind, "SPAN_KIND_SERVER");
    assert_eq!(remote.kind, "SPAN_KIND_CLIENT");
    assert_eq!(prefill.kind, "SPAN_KIND_SERVER");
    // Every span of the trace hangs off the caller's span: one connected tree.
    let ids: std::collections::HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    for s in &spans {
        assert!(
            s.parent_id == caller_span || ids.contains(s.parent_id.as_str()),
            "`{}` ({}) has a parent outside the trace: {s:?}",
            s.name,
            s.service
        );
    }

    // Attributes: GenAI conventions on the request, the decision, the transfer.
    let (prompt_tokens, completion_tokens) = sent[0];
    assert_eq!(
        request.attr("gen_ai.operation.name"),
        Some("text_completion")
    );
    assert_eq!(request.attr("gen_ai.request.model"), Some(MODEL));
    assert_eq!(
        request.int("gen_ai.usage.input_tokens"),
        prompt_tokens as i64
    );
    assert_eq!(
        request.int("gen_ai.usage.output_tokens"),
        completion_tokens as i64
    );
    assert_eq!(request.int("gen_ai.request.max_tokens"), MAX_TOKENS as i64);
    assert_eq!(
        request.attr("gen_ai.response.finish_reasons"),
        Some("length")
    );
    assert_eq!(route.attr("policy"), Some("cache_aware"));
    assert_eq!(route.attr("prefill_worker"), Some("prefill-0"));
    assert_eq!(route.attr("decode_worker"), Some("decode-0"));
    assert_eq!(route.int("predicted_cached_blocks"), 0);
    assert_eq!(decode.attr("ferry.prefill.mode"), Some("remote"));
    // The client's speculation choice, on the router's and the decode worker's spans.
    assert_eq!(request.attr("ferry.spec.requested"), Some("true"));
    assert_eq!(decode.attr("ferry.spec.requested"), Some("true"));
    assert_eq!(
        decode.int("gen_ai.usage.output_tokens"),
        completion_tokens as i64
    );
    // Its speculative rounds: γ = min(4, MAX_TOKENS − generated − 1) per round (so 4 at most,
    // fewer near the end), and after the prefill peer's first token every token came from a
    // round (accepted drafts + a correction or bonus each) except, when the last round left
    // exactly one to go, one plain step.
    let rounds = decode.int("ferry.spec.rounds");
    let drafted = decode.int("ferry.spec.drafted_tokens");
    let accepted = decode.int("ferry.spec.accepted_tokens");
    assert!(rounds >= 1, "the request speculated: {decode:?}");
    assert!(
        rounds <= drafted && drafted <= 4 * rounds,
        "{rounds} rounds verifying {drafted} drafts"
    );
    assert!(
        accepted <= drafted,
        "{accepted} of {drafted} drafts accepted"
    );
    if accepted == 0 {
        // With nothing accepted (MAX_TOKENS = 6): one token per round, at generated = 1..=4
        // with γ = 4, 3, 2, 1, then the last token in a plain step.
        assert_eq!((rounds, drafted), (4, 4 + 3 + 2 + 1));
    }
    let plain = completion_tokens as i64 - 1 - (accepted + rounds);
    assert!(
        plain == 0 || plain == 1,
        "{completion_tokens} tokens from 1 prefill token, {rounds} rounds, {accepted} accepted"
    );
    let acceptance_length: f64 = decode
        .attr("ferry.spec.acceptance_length")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no ferry.spec.acceptance_length: {decode:?}"));
    // The same f64 division on both sides; 1e-12 covers the value's trip through the
    // receiver's decimal text.
    let expected = (accepted + rounds) as f64 / rounds as f64;
    assert!(
        (acceptance_length - expected).abs() < 1e-12,
        "acceptance length {acceptance_length}, expected {expected}"
    );
    assert_eq!(
        prefill.int("ferry.prefill.computed_tokens") + prefill.int("ferry.prefill.reused_tokens"),
        prompt_tokens as i64
    );
    let bytes = transfer.int("ferry.kv_transfer.bytes");
    assert!(bytes > 0, "{transfer:?}");
    assert!(transfer.int("ferry.kv_transfer.layers") > 0, "{transfer:?}");
    assert!(transfer.int("ferry.kv_transfer.blocks") > 0, "{transfer:?}");
    assert_eq!(transfer.attr("ferry.kv_transfer.transport"), Some("tcp"));
    assert!(
        transfer.attr("ferry.kv_transfer.duration_s").is_some(),
        "{transfer:?}"
    );
    assert_eq!(receive.int("ferry.kv_transfer.bytes"), bytes);
    assert_eq!(
        receive.int("ferry.kv_transfer.layers"),
        transfer.int("ferry.kv_transfer.layers")
    );

    // The engine's batch spans (their own traces, one per step) link to the requests they
    // serve, on both workers.
    for (svc, request_span) in [("ferry-prefill", prefill), ("ferry-decode", decode)] {
        let wanted = (trace_id.to_string(), request_span.span_id.clone());
        let deadline = Instant::now() + SPAN_TIMEOUT;
        while !receiver
            .spans()
            .iter()
            .any(|s| s.service == svc && s.name == "batch" && s.links.contains(&wanted))
        {
            assert!(
                Instant::now() < deadline,
                "no {svc} batch span links to `{}`",
                request_span.name
            );
            tokio::time::sleep(POLL).await;
        }
    }

    // Nothing but ferry's own spans is exported: no h2 / hyper / tonic internals, in any trace.
    let ours = [
        "batch",
        request.name.as_str(),
        "route",
        "dispatch",
        "decode",
        "remote_prefill",
        "prefill",
        "queue",
        "kv_transfer",
        "kv_receive",
    ];
    for s in receiver.spans() {
        assert!(
            ours.contains(&s.name.as_str()),
            "unexpected exported span {s:?}"
        );
    }

    // Metrics: N more requests, then every counter moved by exactly what was served.
    for i in 1..=MORE_REQUESTS {
        sent.push(complete(&http, up.http, completion(i), None).await);
    }
    let n = sent.len() as f64;
    let prompt_sum: f64 = sent.iter().map(|s| s.0 as f64).sum();
    let gen_sum: f64 = sent.iter().map(|s| s.1 as f64).sum();
    let itl_samples: f64 = sent.iter().map(|s| (s.1 - 1) as f64).sum();

    let router = scrape(&http, &urls["router"]).await;
    assert_eq!(
        total(
            &router,
            "ferry_request_success_total",
            &[("finished_reason", "length")]
        ),
        n
    );
    assert_eq!(total(&router, "ferry_request_failure_total", &[]), 0.0);
    assert_eq!(total(&router, "ferry_prompt_tokens_total", &[]), prompt_sum);
    assert_eq!(
        total(&router, "ferry_generation_tokens_total", &[]),
        gen_sum
    );
    assert_eq!(
        total(&router, "ferry_time_to_first_token_seconds_count", &[]),
        n
    );
    assert_eq!(
        total(&router, "ferry_e2e_request_latency_seconds_count", &[]),
        n
    );
    assert_eq!(
        total(&router, "ferry_inter_token_latency_seconds_count", &[]),
        itl_samples
    );
    let decisions = [
        ("policy", "cache_aware"),
        ("prefill_worker", "prefill-0"),
        ("decode_worker", "decode-0"),
    ];
    assert_eq!(
        total(&router, "ferry_routing_decisions_total", &decisions),
        n
    );
    assert_eq!(total(&router, "ferry_routing_retries_total", &[]), 0.0);
    assert_eq!(
        total(
            &router,
            "ferry_router_workers",
            &[("worker_role", "prefill")]
        ),
        1.0
    );
    assert_eq!(total(&router, "ferry_router_requests_in_flight", &[]), 0.0);

    let decode = scrape(&http, &urls["decode-0"]).await;
    let role = |r: &'static str| ("role", r);
    assert_eq!(
        total(&decode, "ferry_request_success_total", &[role("decode")]),
        n
    );
    assert_eq!(total(&decode, "ferry_prompt_tokens_total", &[]), prompt_sum);
    assert_eq!(
        total(&decode, "ferry_generation_tokens_total", &[]),
        gen_sum
    );
    assert_eq!(
        total(&decode, "ferry_time_to_first_token_seconds_count", &[]),
        n
    );
    assert_eq!(
        total(&decode, "ferry_e2e_request_latency_seconds_count", &[]),
        n
    );
    assert_eq!(
        total(&decode, "ferry_prefills_total", &[("mode", "remote")]),
        n
    );
    assert_eq!(
        total(&decode, "ferry_remote_prefill_duration_seconds_count", &[]),
        n
    );
    assert_eq!(total(&decode, "ferry_kv_cache_total_blocks", &[]), 256.0);

    let prefill = scrape(&http, &urls["prefill-0"]).await;
    assert_eq!(
        total(
            &prefill,
            "ferry_prefill_requests_total",
            &[("outcome", "ok")]
        ),
        n
    );
    assert_eq!(
        total(&prefill, "ferry_prompt_tokens_total", &[]),
        prompt_sum
    );
    assert_eq!(
        total(&prefill, "ferry_kv_transfer_duration_seconds_count", &[]),
        n
    );
    assert_eq!(
        total(&prefill, "ferry_request_queue_time_seconds_count", &[]),
        n
    );
    assert_eq!(
        total(&prefill, "ferry_prefix_cache_queries_tokens_total", &[]),
        prompt_sum
    );
    let sent_bytes = total(
        &prefill,
        "ferry_kv_transfer_bytes_total",
        &[("direction", "send")],
    );
    let received = total(
        &decode,
        "ferry_kv_transfer_bytes_total",
        &[("direction", "receive")],
    );
    assert!(sent_bytes > 0.0);
    assert_eq!(sent_bytes, received, "every byte sent landed");

    // The Grafana dashboard only queries metrics that exist.
    let exposed: std::collections::HashSet<String> = [&router, &decode, &prefill]
        .into_iter()
        .flatten()
        .map(|s| family_name(&s.name).to_string())
        .collect();
    let dashboard = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/ferry.json");
    let dashboard = std::fs::read_to_string(&dashboard).expect("deploy/grafana/ferry.json");
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("the dashboard is JSON");
    let queried = metric_names_in(&dashboard);
    assert!(queried.len() > 20, "{queried:?}");
    for name in &queried {
        assert!(
            exposed.contains(family_name(name)),
            "the dashboard queries `{name}`, which no process exposes"
        );
    }

    // Gauges settle: nothing running, no KV blocks held by requests.
    for (name, url) in [
        ("prefill-0", &urls["prefill-0"]),
        ("decode-0", &urls["decode-0"]),
    ] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = scrape(&http, url).await;
            let busy = total(&m, "ferry_kv_cache_used_blocks", &[])
                + total(&m, "ferry_num_requests_running", &[])
                + total(&m, "ferry_num_requests_waiting", &[]);
            if busy == 0.0 {
                break;
            }
            assert!(Instant::now() < deadline, "{name} still busy: {busy}");
            tokio::time::sleep(POLL).await;
        }
    }
}

#[test]
fn the_prometheus_parser_rejects_what_scrapers_reject() {
    let good = "# HELP a_total x\n# TYPE a_total counter\na_total{k=\"v\\\"q\"} 3\n\
                # TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3\nh_count 2\n";
    let samples = parse_prometheus(good).expect("valid");
    assert_eq!(samples[0].labels["k"], "v\"q");
    for bad in [
        "a_total 1\n",                                              // no TYPE
        "# TYPE a counter\na{k=v} 1\n",                             // unquoted label
        "# TYPE a counter\na 1x\n",                                 // bad value
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 3\n", // +Inf != count
    ] {
        assert!(parse_prometheus(bad).is_err(), "{bad:?}");
    }
}
