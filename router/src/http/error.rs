//! HTTP errors: OpenAI-shaped JSON bodies for every failure, including malformed JSON.
//!
//! ```json
//! {"error": {"message": "`max_tokens` must be >= 1, got 0", "type": "invalid_request_error",
//!            "param": "max_tokens", "code": "invalid_value"}}
//! ```
//! Status codes follow the gRPC code of the error (one mapping, [`http_status`]):
//! INVALID_ARGUMENT → 400 (not axum's 422), UNAUTHENTICATED → 401 (with `WWW-Authenticate:
//! Bearer`), RESOURCE_EXHAUSTED → 429 (with `Retry-After` in seconds), UNAVAILABLE → 503.
//! [`ApiJson`] replaces `axum::Json` so bad bodies never reach axum's plain-text rejections.
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::{RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::Code;

use crate::error::RequestError;
use crate::validate::ValidationError;

/// The HTTP status for a gRPC code.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Cancelled => StatusCode::REQUEST_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The OpenAI `type` for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 404 | 413 => "invalid_request_error",
        401 => "authentication_error",
        429 => "rate_limit_error",
        503 => "service_unavailable_error",
        _ => "internal_error",
    }
}

/// An error response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message naming the field, limit and value.
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A stable snake_case code.
    pub code: &'static str,
    /// Seconds for the `Retry-After` header (429s a retry can cure).
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
}

impl ApiError {
    /// A 400 on `param`.
    pub fn bad_request(
        message: impl Into<String>,
        param: Option<String>,
        code: &'static str,
    ) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
            code,
            retry_after: None,
        }
    }

    /// The body as a JSON value (also used for errors inside an SSE stream).
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(Body {
            error: Inner {
                message: &self.message,
                kind: error_type(self.status),
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .unwrap_or_default()
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        Self {
            status: http_status(e.code()),
            param: e.param().map(str::to_string),
            code: e.kind(),
            retry_after: e.retry_after_secs(),
            message: e.to_string(),
        }
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        RequestError::Invalid(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(secs) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// A JSON body extractor whose every rejection is an OpenAI-shaped 400 naming the field.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError {
                status: e.status(),
                message: e.body_text(),
                param: None,
                code: "invalid_body",
                retry_after: None,
            })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parses `bytes` as `T`; errors name the JSON path of the bad field.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(path_error)?;
    de.end().map_err(|e| {
        ApiError::bad_request(format!("malformed JSON body: {e}"), None, "invalid_json")
    })?;
    Ok(value)
}

fn path_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    match inner.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            ApiError::bad_request(
                format!("malformed JSON body: {inner}"),
                None,
                "invalid_json",
            )
        }
        serde_json::error::Category::Io | serde_json::error::Category::Data => {
            let message = inner.to_string();
            // A field the request type does not define: name it, without serde's long list
            // (the path already ends with the field).
            if let Some(field) = message
                .strip_prefix("unknown field `")
                .and_then(|rest| rest.split('`').next())
            {
                let param = match path.as_str() {
                    "." => field.to_string(),
                    full => full.to_string(),
                };
                return ApiError::bad_request(
                    format!("`{param}` is not a field ferry accepts (nothing is ignored silently; README lists the fields)"),
                    Some(param),
                    "unknown_parameter",
                );
            }
            // A missing field is reported at the parent's path; name the field itself.
            let param = message
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .map(|field| match path.as_str() {
                    "." => field.to_string(),
                    parent => format!("{parent}.{field}"),
                })
                .or_else(|| (path != ".").then(|| path.clone()));
            let message = match &param {
                Some(p) => format!("invalid value for `{p}`: {message}"),
                None => format!("invalid request body: {message}"),
            };
            ApiError::bad_request(message, param, "invalid_type")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::openai::CompletionRequest;

    fn err(body: &str) -> ApiError {
        parse_json::<CompletionRequest>(body.as_bytes()).expect_err(body)
    }

    #[test]
    fn json_errors_name_the_field() {
        let e = err(r#"{"prompt": "x", "max_tokens": "ten"}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e:?}");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = err(r#"{"prompt": "x", "temperature": "hot"}"#);
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = err(r#"{"max_tokens": 3}"#);
        assert_eq!(e.param.as_deref(), Some("prompt"), "{e:?}");
        let e = err(r#"{"prompt": "x""#);
        assert_eq!((e.param, e.code), (None, "invalid_json"));
        let e = err(r#"{"prompt": "x"} trailing"#);
        assert_eq!(e.code, "invalid_json");
        // A field the API does not define is refused by name, not ignored.
        let e = err(r#"{"prompt": "x", "temprature": 0.5}"#);
        assert_eq!(
            (e.status, e.param.as_deref(), e.code),
            (
                StatusCode::BAD_REQUEST,
                Some("temprature"),
                "unknown_parameter"
            ),
            "{e:?}"
        );
    }

    #[test]
    fn body_is_openai_shaped() {
        let e = ApiError::from(ValidationError::new("top_p", "must be in (0, 1], got 2"));
        let body = e.body();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["message"], "`top_p` must be in (0, 1], got 2");
        assert_eq!(
            http_status(Code::ResourceExhausted),
            StatusCode::TOO_MANY_REQUESTS
        );
    }

    #[test]
    fn each_cause_has_its_status_type_and_code() {
        use ferry_proto::ids::WorkerId;
        let worker =
            |code| RequestError::worker(&WorkerId::from("d0"), &tonic::Status::new(code, "x"));
        let cases = [
            (
                RequestError::Invalid(ValidationError::new("max_tokens", "must be >= 1, got 0")),
                400,
                "invalid_request_error",
                "invalid_value",
            ),
            (
                RequestError::Overloaded { limit: 1 },
                429,
                "rate_limit_error",
                "overloaded",
            ),
            (
                RequestError::Unauthenticated(crate::auth::AuthError::Unknown),
                401,
                "authentication_error",
                "invalid_api_key",
            ),
            (
                RequestError::KeyConcurrency {
                    key: "a".into(),
                    limit: 1,
                },
                429,
                "rate_limit_error",
                "concurrency_limited",
            ),
            (
                RequestError::KeyRate {
                    key: "a".into(),
                    per_minute: 10,
                    cost: 5,
                    retry_after: std::time::Duration::from_millis(1500),
                },
                429,
                "rate_limit_error",
                "rate_limited",
            ),
            (
                RequestError::OverKeyBudget {
                    key: "a".into(),
                    per_minute: 10,
                    cost: 50,
                },
                400,
                "invalid_request_error",
                "exceeds_key_budget",
            ),
            (
                RequestError::NoDecodeWorker,
                503,
                "service_unavailable_error",
                "no_decode_worker",
            ),
            (
                RequestError::ShuttingDown,
                503,
                "service_unavailable_error",
                "shutting_down",
            ),
            (
                worker(Code::Unavailable),
                503,
                "service_unavailable_error",
                "worker_failed",
            ),
            (
                worker(Code::Internal),
                500,
                "internal_error",
                "worker_failed",
            ),
            (
                RequestError::Internal("bug".into()),
                500,
                "internal_error",
                "internal",
            ),
        ];
        for (e, status, kind, code) in cases {
            let message = e.to_string();
            let retry_after = e.retry_after_secs();
            let api = ApiError::from(e);
            let response = api.clone().into_response();
            let header = response.headers().get(RETRY_AFTER);
            assert_eq!(
                header.and_then(|h| h.to_str().ok()?.parse::<u64>().ok()),
                retry_after,
                "{message}"
            );
            assert_eq!(
                response.headers().contains_key(WWW_AUTHENTICATE),
                status == 401,
                "{message}"
            );
            let body = api.body();
            let what = format!("{message}: {body}");
            assert_eq!(api.status.as_u16(), status, "{what}");
            assert_eq!(body["error"]["type"], kind, "{what}");
            assert_eq!(body["error"]["code"], code, "{what}");
            assert_eq!(body["error"]["message"], message.as_str(), "{what}");
        }
    }
}
