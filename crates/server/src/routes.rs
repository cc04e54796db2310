//! The HTTP surface: routes, authentication, body limits, request counting, and the small
//! endpoints (health, models, metrics, tokenize, detokenize).

use axum::Router;
use axum::body::Body;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use deltafin_text::chat::Conversation;
use serde_json::{Value, json};

use crate::blocking::off_runtime;
use crate::error::{AnthropicError, ApiError};
use crate::ollama::OllamaError;
use crate::params::{field, object, opt_str};
use crate::state::Shared;
use crate::{anthropic, ollama, openai, responses};

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses_create))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(|State(s): State<Shared>| async move { ollama::tags(&s) }))
        .route("/api/ps", get(|State(s): State<Shared>| async move { ollama::ps(&s) }))
        .route("/api/show", post(ollama_show))
        .route("/api/version", get(|| async { ollama::version() }))
        .route("/v1/responses/{id}", get(responses_get).delete(responses_delete))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(fallback)
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn_with_state(state.clone(), while_loading))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Endpoints that run a generation: the engine logs their line when it ends
/// ([`crate::worker::RequestNote`]).
const GENERATIONS: [&str; 6] =
    ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/api/chat", "/api/generate"];

/// Counts every request by route and status (unknown paths as one label, so hostile clients
/// cannot grow the table), and logs a line for every request the engine does not log itself:
/// refusals and errors, and the small endpoints (`/health` and `/metrics` only when they fail,
/// as monitors poll them).
async fn count(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let endpoint =
        req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "other".into());
    let method = req.method().clone();
    let t0 = std::time::Instant::now();
    let resp = next.run(req).await;
    let status = resp.status();
    state.metrics.count_request(&endpoint, status.as_u16());
    let polled = matches!(endpoint.as_str(), "/health" | "/metrics");
    // The engine wrote the line of every generation it ran, failed ones included.
    let engine_logged = (GENERATIONS.contains(&endpoint.as_str()) && status.is_success())
        || resp.extensions().get::<crate::error::EngineLogged>().is_some();
    // A monitor polling a healthy, loading or degraded server stays out of the log: /health says why.
    let monitor = polled && (status.is_success() || status == StatusCode::SERVICE_UNAVAILABLE);
    if !(engine_logged || monitor) {
        if status.is_success() {
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            tracing::info!(target: "deltafin::request", "{method} {endpoint} {} in {ms:.1} ms", status.as_u16());
        } else {
            tracing::warn!(target: "deltafin::request", "{method} {endpoint} {}", status.as_u16());
        }
    }
    resp
}

/// Paths that answer while the model loads: health, metrics and the model lists.
fn answers_while_loading(path: &str) -> bool {
    matches!(path, "/health" | "/metrics" | "/v1/models" | "/api/tags" | "/api/version" | "/api/ps" | "/api/show")
        || path.starts_with("/v1/models/")
}

/// Until the model is open, endpoints that need it answer 503 `loading` with `Retry-After`.
async fn while_loading(State(state): State<Shared>, req: Request, next: Next) -> Response {
    if state.readiness.is_ready() || answers_while_loading(req.uri().path()) {
        return next.run(req).await;
    }
    let mut e = ApiError::unavailable(format!(
        "the model is still loading ({}); retry when /health answers 200",
        state.readiness.describe()
    ));
    e.code = Some("model_loading");
    let path = req.uri().path();
    let mut r = if path.starts_with("/v1/messages") {
        AnthropicError(e).into_response()
    } else if path.starts_with("/api/") {
        OllamaError(e).into_response()
    } else {
        e.into_response()
    };
    r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("2"));
    r
}

/// With `--api-key`, every endpoint but `/health` needs `Authorization: Bearer KEY` or
/// `x-api-key: KEY`.
async fn authenticate(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else { return next.run(req).await };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let headers = req.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    let ok = [bearer, x_api_key].into_iter().flatten().any(|given| same(given.as_bytes(), key.as_bytes()));
    if ok {
        return next.run(req).await;
    }
    if req.uri().path().starts_with("/v1/messages") {
        AnthropicError(ApiError::unauthorized()).into_response()
    } else if req.uri().path().starts_with("/api/") {
        OllamaError(ApiError::unauthorized()).into_response()
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// Comparison whose time does not depend on where the strings differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The body's bytes, within the size limit.
async fn body_bytes(state: &Shared, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, ApiError> {
    let limit = state.max_body_bytes;
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        // The only errors are the limit and a broken connection; a broken connection has no
        // one left to read the answer.
        if format!("{e}").contains("length limit") {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request(format!("reading the body: {e}"))
        }
    })?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request("the request has no body; send a JSON object"));
    }
    Ok(bytes)
}

/// A refusal decided before the body is read (429). The body is read and dropped first, one
/// chunk at a time, so that a client still sending it gets the answer instead of a broken pipe;
/// memory stays one chunk. A body declared or found over the limit is not read further.
async fn refuse(state: &Shared, headers: &HeaderMap, body: Body, e: ApiError) -> ApiError {
    use futures_util::StreamExt as _;
    let limit = state.max_body_bytes;
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return e;
    }
    let mut chunks = body.into_data_stream();
    let mut seen = 0usize;
    while let Some(Ok(chunk)) = chunks.next().await {
        seen += chunk.len();
        if seen > limit {
            break;
        }
    }
    e
}

/// A place for a generation, then its body as JSON: a refusal (429) is decided before the body
/// is read.
async fn admitted_body(
    state: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<(crate::worker::Admitted, Value), ApiError> {
    let admitted = match state.admit() {
        Ok(a) => a,
        Err(e) => return Err(refuse(state, headers, body, e).await),
    };
    Ok((admitted, json_body(state, headers, body).await?))
}

fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes).map_err(ApiError::malformed_json)
}

/// The body as JSON, within the size limit.
async fn json_body(state: &Shared, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    parse_json(&body_bytes(state, headers, body).await?)
}

async fn chat(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (admitted, v) = admitted_body(&state, &headers, body).await?;
    let s = state.clone();
    let p = off_runtime(move || openai::prepare_chat(&s, &v)).await?;
    openai::respond(state, admitted, p).await
}

async fn completions(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (admitted, v) = admitted_body(&state, &headers, body).await?;
    let s = state.clone();
    let p = off_runtime(move || openai::prepare_completion(&s, &v)).await?;
    openai::respond(state, admitted, p).await
}

async fn messages(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, AnthropicError> {
    let (admitted, v) = admitted_body(&state, &headers, body).await?;
    let s = state.clone();
    let p = off_runtime(move || anthropic::prepare(&s, &v)).await?;
    Ok(anthropic::respond(state, admitted, p).await?)
}

async fn responses_create(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (admitted, v) = admitted_body(&state, &headers, body).await?;
    let s = state.clone();
    let p = off_runtime(move || responses::prepare(&s, &v)).await?;
    responses::respond(state, admitted, p).await
}

async fn ollama_chat(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, OllamaError> {
    let (admitted, v) = admitted_body(&state, &headers, body).await?;
    let s = state.clone();
    let p = off_runtime(move || ollama::prepare_chat(&s, &v)).await?;
    Ok(ollama::respond(state, admitted, p).await?)
}

async fn ollama_generate(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, OllamaError> {
    let (admitted, v) = admitted_body(&state, &headers, body).await?;
    let s = state.clone();
    let p = off_runtime(move || ollama::prepare_generate(&s, &v)).await?;
    Ok(ollama::respond(state, admitted, p).await?)
}

async fn ollama_show(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, OllamaError> {
    let v = json_body(&state, &headers, body).await?;
    Ok(ollama::show(&state, &v)?)
}

async fn responses_get(State(state): State<Shared>, Path(id): Path<String>) -> Result<Response, ApiError> {
    responses::get(&state, &id)
}

async fn responses_delete(State(state): State<Shared>, Path(id): Path<String>) -> Result<Response, ApiError> {
    responses::delete(&state, &id)
}

/// Tokenizer endpoints skip the engine's admission, so they pass a gate of their own
/// ([`crate::state::TokenizerGate`]): a place before the body is read (429 beyond it), then
/// parsing and tokenising on the blocking pool, at most two at a time.
async fn count_tokens(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, AnthropicError> {
    let place = match state.tokenizer_place() {
        Ok(p) => p,
        Err(e) => return Err(refuse(&state, &headers, body, e).await.into()),
    };
    let bytes = body_bytes(&state, &headers, body).await?;
    let s = state.clone();
    let n = state
        .tokenizer_job(place, move || {
            let mut v = parse_json(&bytes)?;
            // Counting needs no max_tokens.
            if let Some(o) = v.as_object_mut() {
                o.entry("max_tokens").or_insert(json!(1));
            }
            anthropic::prompt_tokens(&s, &v)
        })
        .await?;
    Ok(axum::Json(json!({"input_tokens": n})).into_response())
}

/// The model as `/v1/models` lists it, under one of its names.
fn model_object(state: &Shared, name: &str) -> Value {
    let m = &state.model;
    json!({
        "id": name, "object": "model", "created": m.created, "owned_by": "deltafin",
        "max_model_len": m.context,
        "deltafin": {"numerics": m.numerics, "approximate": m.approx, "context": m.context},
    })
}

async fn models(State(state): State<Shared>) -> Response {
    let data: Vec<Value> = state.model.names().map(|n| model_object(&state, n)).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn model(
    State(state): State<Shared>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, ApiError> {
    let Ok(Path(id)) = id else { return Err(ApiError::bad_request("the model id in the path is not valid UTF-8")) };
    if state.model.answers_to(&id) {
        Ok(axum::Json(model_object(&state, &id)).into_response())
    } else {
        Err(ApiError::model_not_found(&id))
    }
}

/// 200 `{"status": "ok", ...}`; 503 `{"status": "loading", "loading_s"}` while the model
/// loads; 503 `{"status": "degraded", "reason", ...}` while the last three generations failed
/// reading experts (the rule: [`crate::metrics::Metrics::degraded`]).
async fn health(State(state): State<Shared>) -> Response {
    if !state.readiness.is_ready() {
        let mut body = state.readiness.json();
        body["model"] = json!(state.model.id);
        return (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "2")], axum::Json(body)).into_response();
    }
    let running = state.admission.running.load(std::sync::atomic::Ordering::Relaxed);
    let queue_length = state.admission.waiting();
    match state.metrics.degraded() {
        None => axum::Json(json!({
            "status": "ok", "running": running, "running_sequences": state.admission.running_count(),
            "queue_length": queue_length,
        }))
        .into_response(),
        Some(d) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({
                "status": "degraded", "reason": d.reason, "consecutive_read_faults": d.consecutive_read_faults,
                "running": running, "queue_length": queue_length,
            })),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    let text = state.metrics.render(state.admission.waiting(), state.admission.running_count());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// `{"prompt": text}` (special-token strings in it are recognised, as in completions) or
/// `{"messages": [...], "tools"?, "reasoning_effort"?}` (the chat encoding with the generation
/// prompt).
async fn tokenize(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let place = match state.tokenizer_place() {
        Ok(p) => p,
        Err(e) => return Err(refuse(&state, &headers, body, e).await),
    };
    let bytes = body_bytes(&state, &headers, body).await?;
    let s = state.clone();
    let body = state
        .tokenizer_job(place, move || {
            let tokens = tokens_of(&s, &parse_json(&bytes)?)?;
            // Written here, under the job's place, and straight from the ids: a JSON `Value`
            // per token would cost some 20 times the ids' memory.
            #[derive(serde::Serialize)]
            struct Tokenized<'a> {
                tokens: &'a [u32],
                count: usize,
                max_model_len: usize,
            }
            let out = Tokenized { tokens: &tokens, count: tokens.len(), max_model_len: s.model.context };
            serde_json::to_vec(&out).map_err(|_| ApiError::internal("writing the tokens failed"))
        })
        .await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

fn tokens_of(state: &Shared, v: &Value) -> Result<Vec<u32>, ApiError> {
    let o = object(v)?;
    if let Some(m) = opt_str(o, "model")? {
        state.check_model(Some(m))?;
    }
    match (field(o, "prompt"), field(o, "messages")) {
        (Some(Value::String(s)), None) => Ok(state.tokenizer.encode(s)),
        (Some(_), None) => Err(ApiError::invalid("prompt", "'prompt' must be a string")),
        (None, Some(m)) => {
            let conv = Conversation {
                messages: openai::parse_messages(Some(m))?,
                tools: openai::parse_tools(o.get("tools"))?,
                tool_choice: openai::parse_tool_choice(o.get("tool_choice"))?,
                reasoning_effort: openai::reasoning_effort(o)?,
                response_format: None,
            };
            crate::prompt::encode_chat(state, &conv)
        }
        _ => Err(ApiError::bad_request("send either 'prompt' (a string) or 'messages'")),
    }
}

async fn detokenize(State(state): State<Shared>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let place = match state.tokenizer_place() {
        Ok(p) => p,
        Err(e) => return Err(refuse(&state, &headers, body, e).await),
    };
    let bytes = body_bytes(&state, &headers, body).await?;
    let s = state.clone();
    let text = state.tokenizer_job(place, move || text_of(&s, &parse_json(&bytes)?)).await?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}

fn text_of(state: &Shared, v: &Value) -> Result<String, ApiError> {
    let o = object(v)?;
    let Some(Value::Array(list)) = field(o, "tokens") else {
        return Err(ApiError::invalid("tokens", "'tokens' must be an array of token ids"));
    };
    let mut ids = Vec::with_capacity(list.len());
    for t in list {
        match t.as_u64() {
            Some(id) if (id as usize) < state.model.vocab => ids.push(id as u32),
            _ => {
                return Err(ApiError::invalid(
                    "tokens",
                    format!("token ids must be integers in [0, {}) (the vocabulary)", state.model.vocab),
                ));
            }
        }
    }
    Ok(state.tokenizer.decode(&ids))
}

async fn fallback(req: Request) -> Response {
    let mut e = ApiError::not_found(req.uri().path());
    if req.uri().path().len() > 200 {
        e.message = "no route for this path".into();
    }
    let mut r = e.into_response();
    *r.status_mut() = StatusCode::NOT_FOUND;
    r
}
