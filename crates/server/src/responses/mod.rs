//! OpenAI's Responses API (`/v1/responses`), the API Codex and the OpenAI Agents SDK speak,
//! through the same request path as chat completions: the request becomes a conversation and a
//! `TextRequest`, the turn's output becomes output items (`reasoning`, `message`,
//! `function_call`). Responses are stored (unless `store: false`) for `previous_response_id`,
//! `GET` and `DELETE`; a continued response renders the stored conversation in front of its
//! input, and the engine's prefix state makes the part it has seen cost nothing
//! (`usage.input_tokens_details.cached_tokens`).

mod parse;
pub mod store;
mod stream;

use axum::response::{IntoResponse, Response};
use deltafin_text::chat::{Conversation, Message, Role, ToolCall};
use deltafin_text::textgen::{Finish, Summary, TextRequest};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::generation::{ChatSettings, Piece, Turn, chat_request, deltafin_info, sse};
use crate::openai::sampling;
use crate::params::{field, object, opt_bool, opt_int, opt_str, stop_list};
use crate::state::{Grant, Shared, new_id, unix_now};
use crate::worker::{Admitted, RequestNote};
use store::Stored;

/// A prepared Responses request.
pub struct Prepared {
    req: TextRequest,
    grant: Grant,
    stream: bool,
    store: bool,
    /// The conversation as rendered (stored history plus this input), kept with the output.
    history: Vec<Message>,
    /// What the response object echoes of the request.
    echo: Echo,
}

/// Request fields a response object repeats.
#[derive(Clone)]
struct Echo {
    model: String,
    instructions: Value,
    max_output_tokens: Value,
    previous_response_id: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    reasoning: Value,
    text: Value,
    metadata: Value,
    user: Value,
    store: bool,
    /// Each namespaced function's namespace (its calls name it).
    namespaces: Vec<(String, String)>,
    /// Tool types left out of the prompt (hosted tools this server cannot run).
    unavailable: Vec<String>,
}

pub fn prepare(state: &Shared, body: &Value) -> Result<Prepared, ApiError> {
    let o = object(body)?;
    let model = opt_str(o, "model")?;
    state.check_model(model)?;
    if opt_bool(o, "background")? == Some(true) {
        return Err(ApiError::invalid(
            "background",
            "background responses are not supported: send the request and wait",
        ));
    }
    let store = opt_bool(o, "store")?.unwrap_or(true);
    let previous = opt_str(o, "previous_response_id")?;
    // The conversation carried from response to response; `instructions` are not carried
    // (OpenAI's rule) and go in front of it for this request only.
    let mut carried = Vec::new();
    if let Some(id) = previous {
        let Some(prev) = state.responses.get(id) else {
            let mut e = ApiError::invalid(
                "previous_response_id",
                format!(
                    "no stored response with id '{id}' (responses are kept in memory, up to 64 MiB, until the server restarts)"
                ),
            );
            e.code = Some("previous_response_not_found");
            return Err(e);
        };
        carried = prev.history.as_ref().clone();
    }
    parse::input(o.get("input"), &mut carried)?;
    let tools = parse::tools(o.get("tools"))?;
    let mut messages = Vec::with_capacity(carried.len() + 1);
    if let Some(instructions) = opt_str(o, "instructions")? {
        messages.push(Message::new(Role::System, instructions));
    }
    messages.extend(carried.iter().cloned());
    let conv = Conversation {
        messages,
        tools: tools.functions,
        tool_choice: crate::openai::parse_tool_choice(o.get("tool_choice"))?,
        reasoning_effort: parse::effort(o.get("reasoning"))?,
        response_format: parse::format(o.get("text"))?,
    };
    let max_output = opt_int(o, "max_output_tokens", 1, i64::from(u32::MAX))?;
    let settings = ChatSettings {
        max_tokens: max_output.map(|n| n as usize),
        sampling: sampling(o, 2.0)?,
        stop: stop_list(o, "stop")?,
        logprobs: None,
        ignore_eos: false,
    };
    let (req, grant) = chat_request(state, &conv, settings)?;
    let get = |k: &str| field(o, k).cloned().unwrap_or(Value::Null);
    let echo = Echo {
        model: model.unwrap_or_default().to_string(),
        instructions: get("instructions"),
        max_output_tokens: get("max_output_tokens"),
        previous_response_id: get("previous_response_id"),
        temperature: field(o, "temperature").cloned().unwrap_or(json!(1.0)),
        top_p: field(o, "top_p").cloned().unwrap_or(json!(1.0)),
        tools: field(o, "tools").cloned().unwrap_or(json!([])),
        tool_choice: field(o, "tool_choice").cloned().unwrap_or(json!("auto")),
        parallel_tool_calls: opt_bool(o, "parallel_tool_calls")?.unwrap_or(true),
        reasoning: json!({"effort": field(o, "reasoning").and_then(|r| r.get("effort")).cloned(), "summary": null}),
        text: field(o, "text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
        metadata: field(o, "metadata").cloned().unwrap_or(json!({})),
        user: get("user"),
        store,
        namespaces: tools.namespaces,
        unavailable: tools.unavailable,
    };
    Ok(Prepared { req, grant, stream: opt_bool(o, "stream")?.unwrap_or(false), store, history: carried, echo })
}

/// One output item for a piece of the turn. `id` is the item's id; a call keeps its own
/// `call_id` (the id the client answers with `function_call_output`).
fn item(piece: &Piece, id: &str, status: &str, echo: &Echo) -> Value {
    let mut v = match piece {
        Piece::Reasoning(s) => json!({
            "type": "reasoning", "id": id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": s}],
        }),
        Piece::Content(s) => json!({
            "type": "message", "id": id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": s, "annotations": [], "logprobs": []}],
        }),
        Piece::Call { id: call_id, name, arguments } => json!({
            "type": "function_call", "id": id, "status": status, "call_id": call_id, "name": name, "arguments": arguments,
        }),
    };
    if let Piece::Call { name, .. } = piece
        && let Some((_, ns)) = echo.namespaces.iter().find(|(n, _)| n == name)
    {
        v["namespace"] = json!(ns);
    }
    v
}

/// The item id prefix for a piece.
fn item_prefix(piece: &Piece) -> &'static str {
    match piece {
        Piece::Reasoning(_) => "rs_",
        Piece::Content(_) => "msg_",
        Piece::Call { .. } => "fc_",
    }
}

/// The turn's output as one assistant message of the conversation (what a continued response
/// renders for it).
fn as_message(pieces: &[Piece]) -> Message {
    let mut m = Message::new(Role::Assistant, "");
    for p in pieces {
        match p {
            Piece::Reasoning(s) => m.reasoning.get_or_insert_with(String::new).push_str(s),
            Piece::Content(s) => m.content.push(s.clone()),
            Piece::Call { id, name, arguments } => {
                m.tool_calls.push(ToolCall { id: id.clone(), name: name.clone(), arguments: arguments.clone() })
            }
        }
    }
    m
}

/// The response object. `status`: `in_progress`, `completed`, `incomplete` or `failed`.
#[allow(clippy::too_many_arguments)]
fn response_object(
    state: &Shared,
    id: &str,
    created: u64,
    echo: &Echo,
    grant: &Grant,
    status: &str,
    output: Vec<Value>,
    usage: Option<Value>,
    error: Option<&ApiError>,
) -> Value {
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    let mut info = deltafin_info(state, grant);
    if !echo.unavailable.is_empty() {
        info["tools_not_available"] = json!(echo.unavailable);
    }
    json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "model": if echo.model.is_empty() { state.model.id.clone() } else { echo.model.clone() },
        "output": output,
        "usage": usage,
        "error": error.map(|e| json!({"code": e.code.unwrap_or("server_error"), "message": e.message})),
        "incomplete_details": incomplete,
        "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens,
        "previous_response_id": echo.previous_response_id, "temperature": echo.temperature,
        "top_p": echo.top_p, "tools": echo.tools, "tool_choice": echo.tool_choice,
        "parallel_tool_calls": echo.parallel_tool_calls, "reasoning": echo.reasoning, "text": echo.text,
        "metadata": echo.metadata, "user": echo.user, "store": echo.store, "truncation": "disabled",
        "background": false,
        "deltafin": info,
    })
}

fn usage(s: &Summary, reasoning_tokens: usize) -> Value {
    json!({
        "input_tokens": s.prompt_tokens,
        "input_tokens_details": {"cached_tokens": s.cached_prompt_tokens, "cache_write_tokens": 0},
        "output_tokens": s.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": s.prompt_tokens + s.completion_tokens,
    })
}

fn status_of(s: &Summary) -> &'static str {
    if s.finish == Finish::Length { "incomplete" } else { "completed" }
}

/// Keep a finished response for `previous_response_id` and `GET`.
fn keep(state: &Shared, store: bool, id: &str, response: &Value, mut history: Vec<Message>, pieces: &[Piece]) {
    if !store {
        return;
    }
    history.push(as_message(pieces));
    state.responses.put(id.to_string(), Stored::new(response.clone(), history));
}

pub async fn respond(state: Shared, admitted: Admitted, p: Prepared) -> Result<Response, ApiError> {
    let job = state.submit(admitted, p.req.clone(), RequestNote::new("POST /v1/responses", p.grant))?;
    let id = new_id("resp_");
    let created = unix_now();
    if p.stream {
        let interval = state.keep_alive;
        return Ok(sse(job, stream::Events::new(state, p, id, created), interval));
    }
    let mut turn = Turn::new("call_");
    let summary = turn.collect(job).await?;
    let status = status_of(&summary);
    // A response cut off by max_output_tokens ends inside its last item.
    let last = turn.pieces.len().saturating_sub(1);
    let output = turn
        .pieces
        .iter()
        .enumerate()
        .map(|(i, pc)| {
            let item_status = if i == last && status == "incomplete" { "incomplete" } else { "completed" };
            item(pc, &new_id(item_prefix(pc)), item_status, &p.echo)
        })
        .collect();
    let body = response_object(
        &state,
        &id,
        created,
        &p.echo,
        &p.grant,
        status,
        output,
        Some(usage(&summary, turn.reasoning_tokens)),
        None,
    );
    keep(&state, p.store, &id, &body, p.history, &turn.pieces);
    Ok(axum::Json(body).into_response())
}

/// `GET /v1/responses/{id}`.
pub fn get(state: &Shared, id: &str) -> Result<Response, ApiError> {
    match state.responses.get(id) {
        Some(s) => Ok(axum::Json(s.response.as_ref().clone()).into_response()),
        None => Err(not_found(id)),
    }
}

/// `DELETE /v1/responses/{id}`.
pub fn delete(state: &Shared, id: &str) -> Result<Response, ApiError> {
    if state.responses.delete(id) {
        Ok(axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
    } else {
        Err(not_found(id))
    }
}

fn not_found(id: &str) -> ApiError {
    let mut e =
        ApiError::bad_request(format!("no stored response with id '{}'", id.chars().take(100).collect::<String>()));
    e.status = axum::http::StatusCode::NOT_FOUND;
    e.code = Some("not_found");
    e
}
