//! A scripted decode worker shared by the router's integration tests: a real gRPC
//! `DecodeWorker` server on a local port whose answers the test decides.
#![allow(dead_code)] // each test binary uses part of it

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_proto::auth::{ClusterToken, RequireToken};
use ferry_proto::internal::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use ferry_proto::internal::{self, DecodeRequest, DecodeResponse};
use ferry_proto::v1;
use futures::Stream;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Code, Request, Response, Status};

/// A greedy `Generate` of the text "hello" for at most `max_tokens` tokens: the request the
/// front-door tests send when only the router's handling matters.
pub fn greedy_hello(max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Text("hello".into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stop: Some(v1::StopConditions {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Cached prompt tokens the scripted worker reports on its first message.
pub const CACHED: u32 = 5;

/// The log-probability the scripted worker reports for prompt token `i` (≥ 1) when the request
/// asks for the prompt's (`DecodeRequest.prompt_logprobs`); its alternatives are tokens
/// `0..top` at `scripted_prompt_logprob(i) - k`.
pub fn scripted_prompt_logprob(i: usize) -> f32 {
    -0.25 * i as f32
}

/// The prompt log-probabilities a scripted worker sends for `prompt` with `top` alternatives.
pub fn scripted_prompt_logprobs(prompt: &[u32], top: u32) -> Vec<v1::TokenLogprob> {
    prompt
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, &t)| v1::TokenLogprob {
            token_id: t,
            logprob: scripted_prompt_logprob(i),
            top_logprobs: (0..top)
                .map(|k| v1::TopLogprob {
                    token_id: k,
                    logprob: scripted_prompt_logprob(i) - k as f32,
                })
                .collect(),
        })
        .collect()
}

/// A decode worker that streams `script` (up to the request's `max_tokens`: LENGTH when cut
/// there, else STOP), one token per `pace` — or refuses every call, or fails mid-stream.
/// With `n` > 1 each position of the script goes out once per sample, tagged with its index
/// (and the call's id on each sample's first message); a call with `sample_index` streams
/// that sample alone, from its `generated_tokens`-th token on. `CancelSample` stops the named
/// sample. Clones share the counters, so a test keeps one to inspect what the router sent.
#[derive(Clone)]
pub struct Scripted {
    /// Tokens to stream.
    pub script: Vec<u32>,
    /// When not empty: sample `i`'s tokens instead of `script`.
    pub per_sample: Vec<Vec<u32>>,
    /// Pause before each token (a real worker's pace, so cancellations land mid-stream).
    pub pace: Duration,
    /// Refuse every call with this code and message.
    pub refuse: Option<(Code, &'static str)>,
    /// Fail with INTERNAL after this many tokens.
    pub fail_after: Option<usize>,
    /// Fail with UNAVAILABLE (the worker is going away: the router migrates) after this many
    /// messages of a fresh call (`generated_tokens` 0); a resumed call runs to its end.
    pub die_after: Option<usize>,
    /// On a fresh call of several samples: sample `.0` reports itself failed in-band with
    /// gRPC code `.2` after `.1` of its tokens (`DecodeResponse.error`), the others going on.
    pub sample_fails: Option<(u32, usize, Code)>,
    /// `decode` calls received.
    pub calls: Arc<AtomicUsize>,
    /// The requests accepted.
    pub seen: Arc<Mutex<Vec<DecodeRequest>>>,
    /// Notified when the router dropped a stream before its end.
    pub cancelled: Arc<Notify>,
    /// The `CancelSample` calls received.
    pub cancels: Arc<Mutex<Vec<internal::CancelSampleRequest>>>,
    /// Samples stopped by `CancelSample`: (call id, index).
    stopped: Arc<Mutex<HashSet<(u64, u32)>>>,
    /// The last call id handed out.
    call_ids: Arc<AtomicU64>,
}

impl Scripted {
    /// Streams `script` every 2 ms.
    pub fn streaming(script: Vec<u32>) -> Self {
        Self {
            script,
            pace: Duration::from_millis(2),
            per_sample: Vec::new(),
            refuse: None,
            fail_after: None,
            die_after: None,
            sample_fails: None,
            calls: Arc::default(),
            seen: Arc::default(),
            cancelled: Arc::default(),
            cancels: Arc::default(),
            stopped: Arc::default(),
            call_ids: Arc::default(),
        }
    }

    /// Streams `scripts[i]` as sample `i` every 2 ms.
    pub fn per_sample(scripts: Vec<Vec<u32>>) -> Self {
        Self {
            per_sample: scripts,
            ..Self::streaming(Vec::new())
        }
    }

    /// The same scripts, failing with UNAVAILABLE after `n` messages of a fresh call.
    pub fn dying_after(self, n: usize) -> Self {
        Self {
            die_after: Some(n),
            ..self
        }
    }

    /// The same scripts; on a fresh call of several samples, sample `index` reports itself
    /// failed with `code` after `after` of its tokens.
    pub fn sample_failing(self, index: u32, after: usize, code: Code) -> Self {
        Self {
            sample_fails: Some((index, after, code)),
            ..self
        }
    }

    /// Refuses every call with `code` and `message`.
    pub fn refusing(code: Code, message: &'static str) -> Self {
        Self {
            refuse: Some((code, message)),
            ..Self::streaming(Vec::new())
        }
    }

    /// The same script at another pace.
    pub fn paced(self, pace: Duration) -> Self {
        Self { pace, ..self }
    }

    /// The same script, failing with INTERNAL after `n` tokens.
    pub fn failing_after(self, n: usize) -> Self {
        Self {
            fail_after: Some(n),
            ..self
        }
    }

    /// `decode` calls so far.
    pub fn call_count(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// The requests accepted so far.
    pub fn requests(&self) -> Vec<DecodeRequest> {
        self.seen.lock().expect("test mutex").clone()
    }

    /// The `CancelSample` calls received so far.
    pub fn cancel_calls(&self) -> Vec<internal::CancelSampleRequest> {
        self.cancels.lock().expect("test mutex").clone()
    }

    /// Sample `index`'s script.
    fn script_of(&self, index: u32) -> &[u32] {
        match self.per_sample.get(index as usize) {
            Some(s) => s,
            None if self.per_sample.is_empty() => &self.script,
            None => &[],
        }
    }
}

type Tokens = Pin<Box<dyn Stream<Item = Result<DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for Scripted {
    type DecodeStream = Tokens;

    async fn decode(
        &self,
        request: Request<DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some((code, message)) = self.refuse {
            return Err(Status::new(code, message));
        }
        let req = request.into_inner();
        self.seen.lock().expect("test mutex").push(req.clone());
        let max = req.stop.as_ref().map_or(u32::MAX, |s| s.max_tokens) as usize;
        let start = req.generated_tokens as usize;
        // `n` samples, or the one a `sample_index` call resumes: (index, tokens, finish).
        let indices: Vec<u32> = if req.n > 1 {
            (0..req.n).collect()
        } else {
            vec![req.sample_index]
        };
        let samples: Vec<(u32, Vec<u32>, v1::FinishReason)> = indices
            .into_iter()
            .map(|index| {
                let all: Vec<u32> = self.script_of(index).iter().copied().take(max).collect();
                let finish = if all.len() == max {
                    v1::FinishReason::Length
                } else {
                    v1::FinishReason::Stop
                };
                (index, all.get(start..).unwrap_or_default().to_vec(), finish)
            })
            .collect();
        let call_id = if req.n > 1 {
            self.call_ids.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            0
        };
        let (tx, rx) = mpsc::channel(1);
        let (cancelled, pace, fail_after) = (self.cancelled.clone(), self.pace, self.fail_after);
        let die_after = self.die_after.filter(|_| start == 0);
        let sample_fails = self.sample_fails.filter(|_| start == 0 && req.n > 1);
        let stopped = self.stopped.clone();
        // Asked for: the prompt's log-probabilities on sample 0's first message.
        let mut prompt_logprobs = req
            .prompt_logprobs
            .map(|top| scripted_prompt_logprobs(&req.prompt_tokens, top))
            .unwrap_or_default();
        let req_logprobs = req.logprobs;
        tokio::spawn(async move {
            let longest = samples.iter().map(|(_, t, _)| t.len()).max().unwrap_or(0);
            let mut sent = 0;
            for i in 0..longest {
                for (index, tokens, finish) in &samples {
                    let index = *index;
                    if fail_after == Some(i) {
                        let _ = tx
                            .send(Err(Status::internal("scripted mid-stream failure")))
                            .await;
                        return;
                    }
                    if let Some((failing, after, code)) = sample_fails {
                        if failing == index && i == after {
                            let failed = DecodeResponse {
                                index,
                                error: "scripted sample failure".into(),
                                error_code: code as u32,
                                ..Default::default()
                            };
                            if tx.send(Ok(failed)).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        if failing == index && i > after {
                            continue;
                        }
                    }
                    let Some(&t) = tokens.get(i) else { continue };
                    if stopped
                        .lock()
                        .expect("test mutex")
                        .contains(&(call_id, index))
                    {
                        continue;
                    }
                    if die_after == Some(sent) {
                        let _ = tx
                            .send(Err(Status::unavailable("scripted worker going away")))
                            .await;
                        return;
                    }
                    let message = DecodeResponse {
                        token_ids: vec![t],
                        finish_reason: if i + 1 == tokens.len() {
                            *finish as i32
                        } else {
                            v1::FinishReason::Unspecified as i32
                        },
                        cached_prompt_tokens: if i == 0 { CACHED } else { 0 },
                        prefill_mode: if i == 0 {
                            "local".into()
                        } else {
                            String::new()
                        },
                        // Asked for: each token at -0.5 with alternatives 0..top.
                        logprobs: req_logprobs
                            .map(|top| {
                                vec![v1::TokenLogprob {
                                    token_id: t,
                                    logprob: -0.5,
                                    top_logprobs: (0..top)
                                        .map(|k| v1::TopLogprob {
                                            token_id: k,
                                            logprob: -0.5 - k as f32,
                                        })
                                        .collect(),
                                }]
                            })
                            .unwrap_or_default(),
                        index,
                        error: String::new(),
                        prompt_logprobs: if index == 0 {
                            std::mem::take(&mut prompt_logprobs)
                        } else {
                            Vec::new()
                        },
                        call_id: if i == 0 { call_id } else { 0 },
                        error_code: 0,
                    };
                    tokio::time::sleep(pace).await;
                    if tx.send(Ok(message)).await.is_err() {
                        cancelled.notify_one();
                        return;
                    }
                    sent += 1;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn cancel_sample(
        &self,
        request: Request<internal::CancelSampleRequest>,
    ) -> Result<Response<internal::CancelSampleResponse>, Status> {
        let req = request.into_inner();
        let stopped = self
            .stopped
            .lock()
            .expect("test mutex")
            .insert((req.call_id, req.index));
        self.cancels.lock().expect("test mutex").push(req);
        Ok(Response::new(internal::CancelSampleResponse { stopped }))
    }

    async fn get_stats(
        &self,
        _request: Request<internal::GetStatsRequest>,
    ) -> Result<Response<internal::WorkerStats>, Status> {
        Ok(Response::new(internal::WorkerStats::default()))
    }
}

/// Serves `worker` on a free local port; returns its address.
pub async fn start_worker(worker: Scripted) -> String {
    start_worker_requiring(worker, None).await
}

/// Serves `worker` on a free local port, refusing calls without `token` (the cluster token)
/// as a real worker does; returns its address.
pub async fn start_worker_requiring(worker: Scripted, token: Option<ClusterToken>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DecodeWorkerServer::with_interceptor(
                worker,
                RequireToken::new(token),
            ))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    addr.to_string()
}

/// Waits until no request holds an admission permit (a stream ended by its client or its
/// worker is released when the router drops it, a moment later).
pub async fn wait_released(state: &ferry_router::state::AppState) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while state.dispatcher.in_flight() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "a request was never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for the open requests to be released, then shuts the router down and checks that it
/// stopped cleanly and in time.
pub async fn stop_router(
    state: &ferry_router::state::AppState,
    shutdown: tokio_util::sync::CancellationToken,
    running: tokio::task::JoinHandle<Result<(), ferry_router::RouterError>>,
) {
    wait_released(state).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .expect("shuts down in time")
        .expect("task")
        .expect("clean shutdown");
}
