//! The public `ferry.v1.Inference` service over the [`Dispatcher`](crate::dispatch::Dispatcher).
//!
//! Wire → [`GrpcGenerate`] (parameters, no checks but the shapes of `response_format` and
//! tools) → [`Validator`](crate::validate::Validator) → dispatcher → events →
//! `GenerateResponse`s, each tagged with its sample's `index` (`n` > 1; with
//! `prompt_logprobs`, the prompt's on each sample's first message). With tools (a choice
//! other than none), each sample's text is kept and parsed for calls at its finish
//! ([`crate::tools::Tools::parse_calls`], the code the HTTP API uses): its last message then
//! carries the calls and FINISH_REASON_TOOL_CALLS; the text itself streams as generated.
//! Errors become `tonic::Status` through `From<RequestError>` (error.rs) and are logged here,
//! once, in the request span.
//!
//! With API keys on, every call needs `authorization: Bearer <key>` metadata (UNAUTHENTICATED
//! otherwise); `Generate` is also held to the key's limits (`limits.rs`). gRPC health and
//! reflection are other services and stay open.
use std::pin::Pin;
use std::sync::Arc;

use ferry_proto::trace_ctx;
use ferry_proto::v1::{self, inference_server::Inference};
use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Caller;
use crate::error::{log_failure, RequestError};
use crate::output::{FinishReason, GenerationEvent};
use crate::spans::{self, FrontDoor, InSpan, Operation};
use crate::state::AppState;
use crate::tools::{ToolCall, Tools};
use crate::validate::GrpcGenerate;

/// The `Inference` service.
#[derive(Debug, Clone)]
pub struct InferenceService {
    state: Arc<AppState>,
}

impl InferenceService {
    /// Serves `state`.
    pub fn new(state: Arc<AppState>) -> Self {
        Self { state }
    }

    /// Who sent `request` (its `authorization` metadata), or UNAUTHENTICATED.
    fn authenticate<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        self.state.keys.authenticate(header).map_err(|e| {
            let e = RequestError::from(e);
            log_failure(&e);
            self.state
                .metrics
                .failure
                .with_label_values(&[e.kind()])
                .inc();
            Status::from(e)
        })
    }
}

/// One event on the wire. `calls`: the sample's parsed tool calls, on its last event (its
/// finish reason then says so).
fn to_wire(
    event: GenerationEvent,
    request_id: &str,
    calls: Option<Vec<ToolCall>>,
) -> v1::GenerateResponse {
    let finish_reason = match (event.finish, &calls) {
        (None, _) => v1::FinishReason::Unspecified,
        (Some(_), Some(_)) => v1::FinishReason::ToolCalls,
        (Some(FinishReason::Stop), None) => v1::FinishReason::Stop,
        (Some(FinishReason::Length), None) => v1::FinishReason::Length,
    };
    v1::GenerateResponse {
        token_ids: event.token_ids,
        text: event.text,
        finish_reason: finish_reason as i32,
        usage: event.usage.map(|u| v1::Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_prompt_tokens: u.cached_prompt_tokens,
        }),
        request_id: request_id.to_string(),
        logprobs: event.logprobs.iter().map(v1::TokenLogprob::from).collect(),
        prompt_logprobs: event
            .prompt_logprobs
            .as_deref()
            .map(|p| p.rest.iter().map(v1::TokenLogprob::from).collect())
            .unwrap_or_default(),
        index: event.index,
        tool_calls: calls
            .into_iter()
            .flatten()
            .map(v1::ToolCall::from)
            .collect(),
    }
}

/// Each sample's output so far, for requests whose output is parsed for tool calls: at a
/// sample's finish, the calls its whole text makes.
struct CallParser {
    tools: Tools,
    texts: Vec<String>,
}

impl CallParser {
    /// Adds `event`'s text to its sample's; on the sample's finish, its calls (`None`: the
    /// output is text).
    fn on_event(&mut self, event: &GenerationEvent) -> Option<Vec<ToolCall>> {
        let i = event.index as usize;
        if self.texts.len() <= i {
            self.texts.resize(i + 1, String::new());
        }
        let text = self.texts.get_mut(i)?;
        text.push_str(&event.text);
        event.finish?;
        self.tools.parse_calls(&std::mem::take(text))
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for InferenceService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let caller = self.authenticate(&request)?;
        let operation = match request.get_ref().input {
            Some(v1::generate_request::Input::Chat(_)) => Operation::Chat,
            _ => Operation::TextCompletion,
        };
        let span = spans::request_span(FrontDoor::Grpc, operation, &self.state.model.name);
        trace_ctx::set_parent_from_request(&span, &request);
        let converted = GrpcGenerate::try_from(request.into_inner());
        let requested = match &converted {
            Ok(g) if !g.params.model.is_empty() => g.params.model.clone(),
            _ => self.state.model.name.clone(),
        };
        trace_ctx::set_attribute(&span, "gen_ai.request.model", requested);
        caller.record(&span);
        let state = self.state.clone();
        let (params, tools) = match converted {
            Ok(g) => (Ok(g.params), g.tools.filter(Tools::parses)),
            Err(e) => (Err(e), None),
        };
        let mut parser = tools.map(|tools| CallParser {
            tools,
            texts: Vec::new(),
        });
        let started = async move {
            let params = params?;
            let admission = caller.admit()?;
            let valid = state.validator.validate(params).await?;
            let id = valid.id().0.clone();
            tracing::Span::current().record("request_id", id.as_str());
            caller.charge(&valid)?;
            let events = admission.hold(state.dispatcher.generate(valid).await?);
            Ok::<_, RequestError>((id, events))
        }
        .instrument(span.clone())
        .await;
        let (id, events) = started.map_err(|e| {
            spans::request_failed(&self.state.metrics, &span, &e);
            Status::from(e)
        })?;
        let in_span = span.clone();
        let stream = events.map(move |item| match item {
            Ok(event) => {
                let calls = parser.as_mut().and_then(|p| p.on_event(&event));
                Ok(to_wire(event, &id, calls))
            }
            Err(e) => {
                in_span.in_scope(|| log_failure(&e));
                Err(Status::from(e))
            }
        });
        Ok(Response::new(Box::pin(InSpan::new(stream, span))))
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        self.authenticate(&request)?;
        let r = request.into_inner();
        let ids = self
            .state
            .validator
            .tokenize(&r.model, r.text, r.add_special_tokens)
            .await
            .inspect_err(log_failure)?;
        Ok(Response::new(v1::TokenizeResponse { ids }))
    }

    async fn list_models(
        &self,
        request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        self.authenticate(&request)?;
        let m = &self.state.model;
        Ok(Response::new(v1::ListModelsResponse {
            models: vec![v1::ModelCard {
                name: m.name.clone(),
                context_length: u32::try_from(m.context_length).unwrap_or(u32::MAX),
                architecture: m.architecture.to_string(),
            }],
        }))
    }
}
