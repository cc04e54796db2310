//! The Ollama API as Ollama serves it, so that what is built for Ollama (Open WebUI, editor
//! plugins, the `ollama` client libraries) sees the loaded model: `/api/chat` and
//! `/api/generate` (NDJSON streaming by default, or one object with `"stream": false`;
//! `options` as sampling, `think` as K3's reasoning), `/api/tags`, `/api/show`, `/api/ps`,
//! `/api/version`. Both generation endpoints go through the same request path as the OpenAI
//! and Anthropic ones. Errors are Ollama's `{"error": "..."}`.

mod stream;

use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::{IntoResponse, Response};
use deltafin_text::chat::{Conversation, Message, Role, ToolCall, ToolChoice};
use deltafin_text::textgen::{Finish, Summary, TextRequest};
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::generation::{ChatSettings, Piece, Turn, chat_request};
use crate::openai::{parse_tools, sampling};
use crate::params::{Obj, field, object, opt_bool, opt_str, stop_list};
use crate::state::{Grant, Shared};
use crate::worker::{Admitted, RequestNote};

/// The Ollama API version these endpoints follow (what `/api/version` reports).
pub const API_VERSION: &str = "0.12.0";

/// An [`ApiError`] answered in Ollama's shape: `{"error": message}`.
pub struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        OllamaError(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        self.0.respond(json!({"error": self.0.message}))
    }
}

/// RFC 3339 time now, as Ollama's `created_at` (UTC, nanoseconds).
pub fn now_rfc3339() -> String {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// A model name as Ollama clients send it: `name` or `name:latest`.
fn check_model(state: &Shared, o: &Obj) -> Result<String, ApiError> {
    let name = opt_str(o, "model")?.or(opt_str(o, "name")?).ok_or_else(|| ApiError::missing("model"))?;
    let bare = name.strip_suffix(":latest").unwrap_or(name);
    if state.model.answers_to(bare) {
        Ok(name.to_string())
    } else {
        let mut e = ApiError::model_not_found(name);
        e.message = format!("model '{name}' not found; GET /api/tags lists the names this server answers to");
        Err(e)
    }
}

/// Ollama's `options`: sampling, `num_predict` (-1 or -2: the rest of the context), `stop`.
fn options(o: &Obj) -> Result<(ChatSettings, Option<usize>), ApiError> {
    let empty = Map::new();
    let opts = match field(o, "options") {
        None => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err(ApiError::invalid("options", "'options' must be an object")),
    };
    let num_predict = match field(opts, "num_predict") {
        None => None,
        Some(v) => match v.as_i64() {
            Some(-1 | -2) => None,
            Some(n) if n >= 1 => Some(n as usize),
            _ => {
                return Err(ApiError::invalid(
                    "options.num_predict",
                    "'num_predict' must be a positive integer, -1 or -2",
                ));
            }
        },
    };
    let s = ChatSettings {
        max_tokens: num_predict,
        sampling: sampling(opts, 2.0)?,
        stop: stop_list(opts, "stop")?,
        logprobs: None,
        ignore_eos: false,
    };
    Ok((s, num_predict))
}

/// `think`: false = no reasoning, true = the model's default, or a level.
fn think(o: &Obj) -> Result<Option<String>, ApiError> {
    match field(o, "think") {
        None | Some(Value::Bool(true)) => Ok(None),
        Some(Value::Bool(false)) => Ok(Some("none".into())),
        Some(Value::String(s)) if matches!(s.as_str(), "low" | "medium" | "high") => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid("think", "'think' must be true, false, \"low\", \"medium\" or \"high\"")),
    }
}

/// `format`: "json" or a JSON schema.
fn format(o: &Obj) -> Result<Option<Option<Value>>, ApiError> {
    match field(o, "format") {
        None => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(None)),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(Some(v.clone()))),
        Some(_) => Err(ApiError::invalid("format", "'format' must be \"json\" or a JSON schema object")),
    }
}

/// Ollama chat messages. Ollama's tool calls carry no ids: each call gets one, and a tool
/// result answers the earliest call not answered yet (of its `tool_name` when given).
fn messages(v: Option<&Value>) -> Result<Vec<Message>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("messages", "'messages' must be an array")),
    };
    let mut out: Vec<Message> = Vec::with_capacity(list.len());
    let mut unanswered: Vec<(String, String)> = Vec::new();
    let mut next_id = 0usize;
    for (i, m) in list.iter().enumerate() {
        let p = |k: &str| format!("messages[{i}].{k}");
        let Some(mo) = m.as_object() else {
            return Err(ApiError::invalid(&format!("messages[{i}]"), "each message must be an object"));
        };
        let role = match mo.get("role").and_then(Value::as_str) {
            Some("system") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some("tool") => Role::Tool,
            _ => return Err(ApiError::invalid(&p("role"), "'role' must be system, user, assistant or tool")),
        };
        if field(mo, "images").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(ApiError::invalid(&p("images"), "images are not supported: this model reads text only"));
        }
        let content =
            opt_str(mo, "content").map_err(|_| ApiError::invalid(&p("content"), "'content' must be a string"))?;
        let mut msg = Message::new(role, content.unwrap_or_default());
        match role {
            // A new user turn or a new set of calls: calls left unanswered before are over.
            Role::User => unanswered.clear(),
            Role::Assistant if field(mo, "tool_calls").is_some() => unanswered.clear(),
            _ => {}
        }
        match role {
            Role::Assistant => {
                msg.reasoning = opt_str(mo, "thinking")
                    .map_err(|_| ApiError::invalid(&p("thinking"), "'thinking' must be a string"))?
                    .map(String::from);
                if let Some(calls) = field(mo, "tool_calls") {
                    let Some(calls) = calls.as_array() else {
                        return Err(ApiError::invalid(&p("tool_calls"), "'tool_calls' must be an array"));
                    };
                    for c in calls {
                        let f = c.get("function");
                        let Some(name) = f.and_then(|f| f.get("name")).and_then(Value::as_str) else {
                            return Err(ApiError::invalid(&p("tool_calls"), "each tool call needs function.name"));
                        };
                        let arguments = match f.and_then(|f| f.get("arguments")) {
                            None | Some(Value::Null) => "{}".to_string(),
                            Some(Value::String(s)) => s.clone(),
                            Some(v) => v.to_string(),
                        };
                        next_id += 1;
                        let id = format!("call_{next_id}");
                        unanswered.push((id.clone(), name.to_string()));
                        msg.tool_calls.push(ToolCall { id, name: name.to_string(), arguments });
                    }
                }
            }
            Role::Tool => {
                let name = opt_str(mo, "tool_name")
                    .map_err(|_| ApiError::invalid(&p("tool_name"), "'tool_name' must be a string"))?;
                let at = match name {
                    Some(n) => unanswered.iter().position(|(_, cn)| cn == n),
                    None => (!unanswered.is_empty()).then_some(0),
                };
                if let Some(at) = at {
                    let (id, cn) = unanswered.remove(at);
                    msg.tool_call_id = Some(id);
                    msg.name = Some(cn);
                } else {
                    msg.name = name.map(String::from);
                }
            }
            _ => {}
        }
        out.push(msg);
    }
    Ok(out)
}

/// How a prepared request answers: a chat message or generate's `response` text.
#[derive(Clone, Copy, PartialEq)]
pub enum Kind {
    Chat,
    Generate,
}

pub struct Prepared {
    req: TextRequest,
    grant: Grant,
    stream: bool,
    kind: Kind,
    model: String,
}

fn finish(conv: Conversation, o: &Obj, kind: Kind, model: String, state: &Shared) -> Result<Prepared, ApiError> {
    let (settings, _) = options(o)?;
    let (req, grant) = chat_request(state, &conv, settings)?;
    // Ollama streams unless told otherwise.
    let stream = opt_bool(o, "stream")?.unwrap_or(true);
    Ok(Prepared { req, grant, stream, kind, model })
}

pub fn prepare_chat(state: &Shared, body: &Value) -> Result<Prepared, ApiError> {
    let o = object(body)?;
    let model = check_model(state, o)?;
    let messages = messages(o.get("messages"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' is empty (Ollama loads the model on an empty chat; this server has it loaded)",
        ));
    }
    let conv = Conversation {
        messages,
        tools: parse_tools(o.get("tools"))?,
        tool_choice: ToolChoice::Auto,
        reasoning_effort: think(o)?,
        response_format: format(o)?,
    };
    finish(conv, o, Kind::Chat, model, state)
}

pub fn prepare_generate(state: &Shared, body: &Value) -> Result<Prepared, ApiError> {
    let o = object(body)?;
    let model = check_model(state, o)?;
    if opt_bool(o, "raw")? == Some(true) {
        return Err(ApiError::invalid("raw", "raw prompts are not supported here: use /v1/completions for raw text"));
    }
    for key in ["suffix", "template", "context", "images"] {
        if field(o, key).is_some_and(|v| !(v.as_str() == Some("") || v.as_array().is_some_and(Vec::is_empty))) {
            return Err(ApiError::invalid(key, format!("'{key}' is not supported by this server")));
        }
    }
    let prompt = opt_str(o, "prompt")?.unwrap_or_default();
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "'prompt' is empty (Ollama loads the model on an empty prompt; this server has it loaded)",
        ));
    }
    let mut messages = Vec::new();
    if let Some(system) = opt_str(o, "system")? {
        messages.push(Message::new(Role::System, system));
    }
    messages.push(Message::new(Role::User, prompt));
    let conv = Conversation {
        messages,
        tools: Vec::new(),
        tool_choice: ToolChoice::Auto,
        reasoning_effort: think(o)?,
        response_format: format(o)?,
    };
    finish(conv, o, Kind::Generate, model, state)
}

/// Ollama's `done_reason`.
fn done_reason(s: &Summary) -> &'static str {
    match s.finish {
        Finish::Length => "length",
        _ => "stop",
    }
}

/// The statistics of the final object, in nanoseconds as Ollama gives them.
fn stats(s: &Summary) -> Value {
    let ns = |secs: f64| (secs.max(0.0) * 1e9) as u64;
    json!({
        "total_duration": ns(s.ttft_s + s.decode_s),
        "load_duration": 0,
        "prompt_eval_count": s.prompt_tokens - s.cached_prompt_tokens.min(s.prompt_tokens),
        "prompt_eval_duration": ns(s.ttft_s),
        "eval_count": s.completion_tokens,
        "eval_duration": ns(s.decode_s),
    })
}

/// A tool call as Ollama writes it: `arguments` an object.
fn call_value(name: &str, arguments: &str, index: usize) -> Value {
    let args = match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    };
    json!({"function": {"name": name, "arguments": args, "index": index}})
}

pub async fn respond(state: Shared, admitted: Admitted, p: Prepared) -> Result<Response, ApiError> {
    let endpoint = if p.kind == Kind::Chat { "POST /api/chat" } else { "POST /api/generate" };
    let job = state.submit(admitted, p.req, RequestNote::new(endpoint, p.grant))?;
    if p.stream {
        return Ok(stream::ndjson(job, stream::Lines::new(p.kind, p.model)));
    }
    let mut turn = Turn::new("call_");
    let summary = turn.collect(job).await?;
    let mut body = json!({"model": p.model, "created_at": now_rfc3339()});
    let thinking = turn.reasoning();
    match p.kind {
        Kind::Chat => {
            let mut message = json!({"role": "assistant", "content": turn.content()});
            if !thinking.is_empty() {
                message["thinking"] = json!(thinking);
            }
            let calls: Vec<Value> = turn
                .pieces
                .iter()
                .filter_map(|pc| match pc {
                    Piece::Call { name, arguments, .. } => Some((name, arguments)),
                    _ => None,
                })
                .enumerate()
                .map(|(i, (n, a))| call_value(n, a, i))
                .collect();
            if !calls.is_empty() {
                message["tool_calls"] = Value::Array(calls);
            }
            body["message"] = message;
        }
        Kind::Generate => {
            body["response"] = json!(turn.content());
            if !thinking.is_empty() {
                body["thinking"] = json!(thinking);
            }
        }
    }
    body["done"] = json!(true);
    body["done_reason"] = json!(done_reason(&summary));
    if let (Value::Object(b), Value::Object(s)) = (&mut body, stats(&summary)) {
        b.extend(s);
    }
    Ok(axum::Json(body).into_response())
}

/// What `/api/tags`, `/api/show` and `/api/ps` say of the model.
fn details(state: &Shared) -> Value {
    json!({
        "parent_model": "", "format": "deltafin", "family": "kimi_k3", "families": ["kimi_k3"],
        "parameter_size": "", "quantization_level": if state.model.approx { "MXFP4 (approximate)" } else { "MXFP4" },
    })
}

fn entry(state: &Shared, name: &str) -> Value {
    json!({
        "name": format!("{name}:latest"), "model": format!("{name}:latest"),
        "modified_at": now_rfc3339(), "size": 0, "digest": "", "details": details(state),
    })
}

pub fn tags(state: &Shared) -> Response {
    let models: Vec<Value> = state.model.names().map(|n| entry(state, n)).collect();
    axum::Json(json!({"models": models})).into_response()
}

pub fn ps(state: &Shared) -> Response {
    let models: Vec<Value> = if state.readiness.is_ready() {
        state
            .model
            .names()
            .map(|n| {
                let mut e = entry(state, n);
                e["expires_at"] = json!("2999-01-01T00:00:00Z");
                e["size_vram"] = json!(0);
                e["context_length"] = json!(state.model.context);
                e
            })
            .collect()
    } else {
        Vec::new()
    };
    axum::Json(json!({"models": models})).into_response()
}

pub fn show(state: &Shared, body: &Value) -> Result<Response, ApiError> {
    let o = object(body)?;
    check_model(state, o)?;
    Ok(axum::Json(json!({
        "modelfile": "", "parameters": "", "template": "",
        "details": details(state),
        "model_info": {"general.architecture": "kimi_k3", "kimi_k3.context_length": state.model.context},
        "capabilities": ["completion", "tools", "thinking"],
        "modified_at": now_rfc3339(),
    }))
    .into_response())
}

pub fn version() -> Response {
    axum::Json(json!({"version": API_VERSION})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_results_answer_the_earliest_open_call_of_their_tool() {
        let v = json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "a", "arguments": {"x": 1}}},
                {"function": {"name": "b", "arguments": {}}}]},
            {"role": "tool", "content": "rb", "tool_name": "b"},
            {"role": "tool", "content": "ra"},
        ]);
        let m = messages(Some(&v)).unwrap();
        assert_eq!(m[1].tool_calls[0].arguments, "{\"x\":1}");
        assert_eq!(m[2].tool_call_id, m[1].tool_calls.get(1).map(|c| c.id.clone()));
        assert_eq!(m[3].tool_call_id, Some(m[1].tool_calls[0].id.clone()));
        assert_eq!(m[3].name.as_deref(), Some("a"));
    }

    #[test]
    fn a_new_turn_leaves_unanswered_calls_behind() {
        let v = json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
            {"role": "user", "content": "never mind"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
            {"role": "tool", "content": "r"},
        ]);
        let m = messages(Some(&v)).unwrap();
        assert_eq!(m[4].tool_call_id, Some(m[3].tool_calls[0].id.clone()));
        assert_ne!(m[1].tool_calls[0].id, m[3].tool_calls[0].id);
    }

    #[test]
    fn created_at_is_rfc3339() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 30, "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[10] == b'T', "{t}");
        assert!(t.starts_with("20"), "{t}");
    }
}
