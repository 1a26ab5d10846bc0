//! The public `ferry.v1.Inference` service over the [`Dispatcher`](crate::dispatch::Dispatcher).
//!
//! Wire → [`GenerateParams`] (no checks) → [`Validator`](crate::validate::Validator) →
//! dispatcher → events → `GenerateResponse`s, each tagged with its sample's `index` (`n` > 1). Errors become `tonic::Status` through
//! `From<RequestError>` (error.rs) and are logged here, once, in the request span.
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
use crate::validate::GenerateParams;

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

fn to_wire(event: GenerationEvent, request_id: &str) -> v1::GenerateResponse {
    v1::GenerateResponse {
        token_ids: event.token_ids,
        text: event.text,
        finish_reason: match event.finish {
            None => v1::FinishReason::Unspecified,
            Some(FinishReason::Stop) => v1::FinishReason::Stop,
            Some(FinishReason::Length) => v1::FinishReason::Length,
        } as i32,
        usage: event.usage.map(|u| v1::Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_prompt_tokens: u.cached_prompt_tokens,
        }),
        request_id: request_id.to_string(),
        logprobs: event.logprobs.iter().map(v1::TokenLogprob::from).collect(),
        index: event.index,
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
        let params = GenerateParams::try_from(request.into_inner());
        let requested = match &params {
            Ok(p) if !p.model.is_empty() => p.model.clone(),
            _ => self.state.model.name.clone(),
        };
        trace_ctx::set_attribute(&span, "gen_ai.request.model", requested);
        caller.record(&span);
        let state = self.state.clone();
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
            Ok(event) => Ok(to_wire(event, &id)),
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
