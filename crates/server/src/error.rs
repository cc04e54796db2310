//! API errors, written in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) or,
//! on the Anthropic endpoint, in Anthropic's (`{"type": "error", "error": {"type", "message"}}`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use deltafin_engine::fault::{ReadFault, SpineFault};
use serde_json::json;

/// What a client is told of an engine error that is not a read fault. Engine errors name files
/// (the store's spine, a shard), and a server's file system is none of its clients' business.
pub const ENGINE_FAILED: &str = "generation failed: the engine failed on this request; details are in the server log";

/// The read fault that ended a generation, wherever in the error's chain it sits.
pub fn read_fault(e: &anyhow::Error) -> Option<&ReadFault> {
    e.chain().find_map(|c| c.downcast_ref::<ReadFault>())
}

/// A streamed spine layer that could not be read (after a retry, or its back-end failed).
pub fn spine_fault(e: &anyhow::Error) -> Option<&SpineFault> {
    e.chain().find_map(|c| c.downcast_ref::<SpineFault>())
}

/// The client-facing message of a fault reading the model from storage (routed experts or a
/// streamed spine layer): what the health rule counts.
pub fn storage_fault(e: &anyhow::Error) -> Option<String> {
    read_fault(e).map(ToString::to_string).or_else(|| spine_fault(e).map(ToString::to_string))
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
    /// The engine has logged this failure's request line already (the HTTP layer does not
    /// log it again).
    pub logged: bool,
}

/// Marks a response whose request line the engine wrote.
#[derive(Clone, Copy)]
pub struct EngineLogged;

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None, logged: false }
    }

    /// A request field with a bad value.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = Some(param.to_string());
        e.code = Some("invalid_value");
        e
    }

    pub fn missing(param: &str) -> Self {
        let mut e = Self::invalid(param, format!("'{param}' is required"));
        e.code = Some("missing_required_parameter");
        e
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn malformed_json(detail: impl std::fmt::Display) -> Self {
        let mut e = Self::bad_request(format!("the body is not valid JSON: {detail}"));
        e.code = Some("invalid_json");
        e
    }

    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model '{model}' does not exist; GET /v1/models lists the one this server runs"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn context_exceeded(message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(message);
        e.param = Some("messages".into());
        e.code = Some("context_length_exceeded");
        e
    }

    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than {limit} bytes"),
        );
        e.code = Some("request_too_large");
        e
    }

    pub fn busy(queue: usize) -> Self {
        let msg = if queue == 0 {
            "the server runs one generation at a time and is busy; retry later (start it with --queue N to wait in line)"
                .to_string()
        } else {
            format!("the server is busy and its queue of {queue} is full; retry later")
        };
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded", msg);
        e.code = Some("rate_limit_exceeded");
        e.retry_after = Some(1);
        e
    }

    pub fn tokenizer_busy(running: usize, waiting: usize) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            format!("the tokenizer endpoints are busy ({running} running, {waiting} waiting); retry later"),
        );
        e.code = Some("rate_limit_exceeded");
        e.retry_after = Some(1);
        e
    }

    pub fn not_found(path: &str) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route for {path}"));
        e.code = Some("not_found");
        e
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed on this path")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The one mapping of a failed generation's error to what its client sees. A read fault is
    /// reported as its own message (layer and expert, never a path: see
    /// `deltafin_engine::fault`); anything else as [`ENGINE_FAILED`]. The whole error, paths and
    /// all, goes to the server's log.
    pub fn from_engine(e: &anyhow::Error) -> Self {
        if let Some(f) = e.chain().find_map(|c| c.downcast_ref::<deltafin_engine::fault::FetchFault>()) {
            tracing::error!(layer = f.layer, expert = f.expert, detail = %f.detail, "generation failed: {f}");
            let mut err = Self::unavailable(format!("generation failed: {f}"));
            err.code = Some(if f.offline { "expert_not_fetched" } else { "expert_fetch_failed" });
            return err;
        }
        if let Some(f) = spine_fault(e) {
            tracing::error!(layer = f.layer, kind = ?f.kind, detail = %f.detail, "generation failed: {e:#}");
            let mut err = Self::internal(format!("generation failed: {f}"));
            err.code = Some("spine_read_failed");
            return err;
        }
        match read_fault(e) {
            Some(f) => {
                tracing::error!(layer = f.layer, expert = f.expert, kind = ?f.kind, detail = %f.detail, "generation failed: {e:#}");
                let mut err = Self::internal(format!("generation failed: {f}"));
                err.code = Some("expert_read_failed");
                err
            }
            None => {
                tracing::error!("generation failed: {e:#}");
                Self::internal(ENGINE_FAILED)
            }
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    pub fn openai_body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    /// Anthropic's error type for this status.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let kind = match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            500 => "api_error",
            503 | 529 => "overloaded_error",
            _ => "invalid_request_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": self.message}})
    }

    /// This error's status and `Retry-After` around `body` (the wire format's shape).
    pub(crate) fn respond(&self, body: serde_json::Value) -> Response {
        let mut r = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.logged {
            r.extensions_mut().insert(EngineLogged);
        }
        r
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(self.openai_body())
    }
}

/// An [`ApiError`] answered in Anthropic's shape.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        self.0.respond(self.0.anthropic_body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;
    use deltafin_engine::fault::FaultKind;

    const PATH: &str = "/srv/models/secret-store";

    /// Every text a client could receive for `e`: both wire formats' bodies.
    fn client_texts(e: &ApiError) -> String {
        format!("{} {}", e.openai_body(), e.anthropic_body())
    }

    #[test]
    fn read_faults_name_layer_and_expert_and_no_path() {
        let fault = ReadFault {
            layer: 3,
            expert: 17,
            kind: FaultKind::Checksum,
            detail: format!("{PATH}/experts/layer-003.bin at 0x1000: checksum mismatch"),
        };
        // As the engine returns it: wrapped in context that itself names a file.
        let e = Err::<(), _>(anyhow::Error::new(fault))
            .with_context(|| format!("MoE layer 3 (store {PATH})"))
            .context("generating token 5")
            .unwrap_err();
        assert!(format!("{e:#}").contains(PATH), "the test needs a path in the chain");
        let api = ApiError::from_engine(&e);
        assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code, Some("expert_read_failed"));
        assert!(api.message.contains("layer 3 expert 17") && api.message.contains("checksum"), "{}", api.message);
        let texts = client_texts(&api);
        assert!(!texts.contains(PATH) && !texts.contains("/srv") && !texts.contains(".bin"), "{texts}");
        // Both shapes are kept.
        assert_eq!(api.openai_body()["error"]["type"], "server_error");
        assert_eq!(api.anthropic_body()["error"]["type"], "api_error");
        assert!(read_fault(&e).is_some());
    }

    #[test]
    fn spine_faults_name_the_layer_and_no_path() {
        use deltafin_engine::fault::{FaultDetail, SpineFault};
        let detail = FaultDetail(format!("{PATH}/spine.bin: Input/output error (os error 5)"));
        let fault = SpineFault { layer: 7, kind: FaultKind::Io, detail };
        let e = Err::<(), _>(anyhow::Error::new(fault)).context(format!("layer 7 (store {PATH})")).unwrap_err();
        let api = ApiError::from_engine(&e);
        assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code, Some("spine_read_failed"));
        assert!(api.message.contains("spine layer 7") && api.message.contains("I/O error"), "{}", api.message);
        let texts = client_texts(&api);
        assert!(!texts.contains(PATH) && !texts.contains("spine.bin") && !texts.contains("os error"), "{texts}");
        assert_eq!(storage_fault(&e).as_deref(), Some("reading spine layer 7 failed (I/O error)"));
    }

    #[test]
    fn other_engine_errors_become_a_generic_message() {
        let e = Err::<(), _>(std::io::Error::other("Input/output error (os error 5)"))
            .with_context(|| format!("reading spine layer 3 from {PATH}/spine.bin"))
            .unwrap_err();
        let api = ApiError::from_engine(&e);
        assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.message, ENGINE_FAILED);
        let texts = client_texts(&api);
        assert!(!texts.contains(PATH) && !texts.contains("spine.bin") && !texts.contains("os error"), "{texts}");
        assert!(read_fault(&e).is_none());
    }
}
