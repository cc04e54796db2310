//! Anthropic's Messages API (`POST /v1/messages`), whole or streamed, over the same generation
//! path as the OpenAI endpoints: the request becomes a [`Conversation`] and a [`TextRequest`],
//! and the engine's updates are printed as Anthropic content blocks and stream events.

use std::collections::VecDeque;

use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use deltafin_text::chat::parse::OutputEvent;
use deltafin_text::chat::{Conversation, Message, Role, ToolCall, ToolChoice};
use deltafin_text::textgen::{Finish, Summary, TextRequest};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::generation::{ChatSettings, Piece, Translator, Turn, chat_request, deltafin_info, sse};
use crate::openai::{content_parts, sampling};
use crate::params::{Obj, field, object, opt_bool, opt_int, opt_str, stop_list};
use crate::state::{Grant, Shared, new_id};
use crate::worker::{Admitted, RequestNote, Update};

pub struct Prepared {
    req: TextRequest,
    grant: Grant,
    stream: bool,
}

/// Anthropic messages into the engine's: tool results become tool messages, thinking blocks
/// become reasoning, tool_use blocks become tool calls.
fn parse_messages(o: &Obj) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = field(o, "system") {
        let parts = content_parts(Some(system), "system")?;
        if !parts.is_empty() {
            let mut m = Message::new(Role::System, "");
            m.content = parts;
            out.push(m);
        }
    }
    let list = match field(o, "messages") {
        None => return Err(ApiError::missing("messages")),
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("messages", "'messages' is empty")),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("messages", "'messages' must be an array")),
    };
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Some(mo) = m.as_object() else {
            return Err(ApiError::invalid(&param, "each message must be an object"));
        };
        let role = match mo.get("role").and_then(|r| r.as_str()) {
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            _ => return Err(ApiError::invalid(&format!("{param}.role"), "role must be user or assistant")),
        };
        let content = mo.get("content");
        let blocks: Vec<Value> = match content {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(a)) => a.clone(),
            _ => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    "content must be a string or an array of blocks",
                ));
            }
        };
        let mut msg = Message::new(role, "");
        for (j, b) in blocks.iter().enumerate() {
            let bp = format!("{param}.content[{j}]");
            let kind = b.get("type").and_then(|t| t.as_str()).unwrap_or("");
            match (role, kind) {
                (_, "text") => msg.content.push(
                    b.get("text")
                        .and_then(|t| t.as_str())
                        .ok_or_else(|| ApiError::invalid(&bp, "a text block needs a string 'text'"))?
                        .to_string(),
                ),
                (Role::Assistant, "thinking") => {
                    let t = b.get("thinking").and_then(|t| t.as_str()).unwrap_or_default();
                    msg.reasoning.get_or_insert_with(String::new).push_str(t);
                }
                (Role::Assistant, "redacted_thinking") => {}
                (Role::Assistant, "tool_use") => {
                    let name = b.get("name").and_then(|n| n.as_str());
                    let Some(name) = name else {
                        return Err(ApiError::invalid(&bp, "a tool_use block needs a 'name'"));
                    };
                    msg.tool_calls.push(ToolCall {
                        id: b.get("id").and_then(|x| x.as_str()).unwrap_or_default().to_string(),
                        name: name.to_string(),
                        arguments: b.get("input").cloned().unwrap_or_else(|| json!({})).to_string(),
                    });
                }
                (Role::User, "tool_result") => {
                    // Results go before the user's own text, as their own messages.
                    let mut r = Message::new(Role::Tool, "");
                    r.content = content_parts(b.get("content"), &bp)?;
                    r.tool_call_id = b.get("tool_use_id").and_then(|x| x.as_str()).map(String::from);
                    if b.get("is_error").and_then(|e| e.as_bool()) == Some(true) {
                        r.content.insert(0, "Error: ".into());
                    }
                    out.push(r);
                }
                (_, other) => {
                    return Err(ApiError::invalid(&bp, format!("content blocks of type '{other}' are not supported")));
                }
            }
        }
        let only_results = role == Role::User
            && msg.content.is_empty()
            && blocks.iter().all(|b| b.get("type").and_then(|t| t.as_str()) == Some("tool_result"));
        if !only_results {
            out.push(msg);
        }
    }
    Ok(out)
}

fn parse_tools(o: &Obj) -> Result<Vec<Value>, ApiError> {
    let list = match field(o, "tools") {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t.get("name").and_then(|n| n.as_str());
            let Some(name) = name else {
                return Err(ApiError::invalid(&format!("tools[{i}]"), "each tool needs a 'name'"));
            };
            // The chat encoding declares tools in OpenAI's shape.
            let mut f = json!({"name": name});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            f["parameters"] = t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}));
            Ok(json!({"type": "function", "function": f}))
        })
        .collect()
}

fn parse_tool_choice(o: &Obj) -> Result<ToolChoice, ApiError> {
    match field(o, "tool_choice") {
        None => Ok(ToolChoice::Auto),
        Some(v) => match v.get("type").and_then(|t| t.as_str()) {
            Some("auto") => Ok(ToolChoice::Auto),
            Some("any") => Ok(ToolChoice::Required),
            Some("none") => Ok(ToolChoice::None),
            Some("tool") => match v.get("name").and_then(|n| n.as_str()) {
                Some(n) => Ok(ToolChoice::Function(n.to_string())),
                None => Err(ApiError::invalid("tool_choice", "tool_choice of type tool needs a 'name'")),
            },
            _ => Err(ApiError::invalid("tool_choice", "tool_choice.type must be auto, any, tool or none")),
        },
    }
}

/// `thinking: {"type": "disabled"}` turns K3's reasoning off; `output_config.effort` sets the
/// effort; otherwise K3's default (reasoning at max effort).
fn effort(o: &Obj) -> Result<Option<String>, ApiError> {
    if let Some(t) = field(o, "thinking") {
        match t.get("type").and_then(|x| x.as_str()) {
            Some("disabled") => return Ok(Some("none".into())),
            Some("enabled") | Some("adaptive") => {}
            _ => return Err(ApiError::invalid("thinking", "thinking.type must be enabled, adaptive or disabled")),
        }
    }
    match field(o, "output_config").and_then(|c| c.get("effort")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(e)) if ["low", "medium", "high", "max"].contains(&e.as_str()) => Ok(Some(e.clone())),
        Some(_) => Err(ApiError::invalid("output_config.effort", "effort must be low, medium, high or max")),
    }
}

fn conversation(o: &Obj) -> Result<Conversation, ApiError> {
    Ok(Conversation {
        messages: parse_messages(o)?,
        tools: parse_tools(o)?,
        tool_choice: parse_tool_choice(o)?,
        reasoning_effort: effort(o)?,
        response_format: None,
    })
}

/// Prompt length of a Messages request (`/v1/messages/count_tokens`).
pub fn prompt_tokens(state: &Shared, body: &Value) -> Result<usize, ApiError> {
    let o = object(body)?;
    state.check_model(opt_str(o, "model")?)?;
    Ok(crate::prompt::encode_chat(state, &conversation(o)?)?.len())
}

pub fn prepare(state: &Shared, body: &Value) -> Result<Prepared, ApiError> {
    let o = object(body)?;
    state.check_model(opt_str(o, "model")?)?;
    let max_tokens =
        opt_int(o, "max_tokens", 1, i64::from(u32::MAX))?.ok_or_else(|| ApiError::missing("max_tokens"))?;
    let conv = conversation(o)?;
    let settings = ChatSettings {
        // Agents send large fixed max_tokens (32000 and more): served up to the context.
        max_tokens: Some(max_tokens as usize),
        // Anthropic's temperature range is [0, 1].
        sampling: sampling(o, 1.0)?,
        stop: stop_list(o, "stop_sequences")?,
        logprobs: None,
        ignore_eos: false,
    };
    let (req, grant) = chat_request(state, &conv, settings)?;
    Ok(Prepared { req, grant, stream: opt_bool(o, "stream")?.unwrap_or(false) })
}

fn stop_reason(s: &Summary) -> (&'static str, Value) {
    match s.finish {
        Finish::Stop | Finish::Cancelled => match &s.stop_string {
            Some(seq) => ("stop_sequence", json!(seq)),
            None => ("end_turn", Value::Null),
        },
        Finish::Length => ("max_tokens", Value::Null),
        Finish::ToolCalls => ("tool_use", Value::Null),
    }
}

/// A tool call's accumulated arguments as the `input` object.
fn input_of(args: &str) -> Value {
    match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

pub async fn respond(state: Shared, admitted: Admitted, p: Prepared) -> Result<Response, ApiError> {
    let prompt_tokens = p.req.prompt.len();
    let job = state.submit(admitted, p.req, RequestNote::new("POST /v1/messages", p.grant))?;
    let id = new_id("msg_");
    if p.stream {
        let interval = state.keep_alive;
        let t = StreamState { state, id, prompt_tokens, started: false, open: Block::None, index: 0 };
        return Ok(sse(job, t, interval));
    }
    let mut turn = Turn::new("toolu_");
    let summary = turn.collect(job).await?;
    let blocks: Vec<Value> = turn
        .pieces
        .iter()
        .map(|p| match p {
            Piece::Reasoning(s) => json!({"type": "thinking", "thinking": s, "signature": ""}),
            Piece::Content(s) => json!({"type": "text", "text": s}),
            Piece::Call { id, name, arguments } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": input_of(arguments)})
            }
        })
        .collect();
    let (reason, seq) = stop_reason(&summary);
    Ok(axum::Json(json!({
        "id": id, "type": "message", "role": "assistant", "model": state.model.id,
        "content": blocks, "stop_reason": reason, "stop_sequence": seq,
        "usage": {"input_tokens": summary.prompt_tokens - summary.cached_prompt_tokens.min(summary.prompt_tokens),
                  "cache_read_input_tokens": summary.cached_prompt_tokens,
                  "output_tokens": summary.completion_tokens},
        "timings": crate::openai::timings(&summary),
        "deltafin": deltafin_info(&state, &p.grant),
    }))
    .into_response())
}

#[derive(PartialEq)]
enum Block {
    None,
    Thinking,
    Text,
    ToolUse,
}

/// Prints a job's updates as Anthropic stream events.
struct StreamState {
    state: Shared,
    id: String,
    prompt_tokens: usize,
    started: bool,
    open: Block,
    /// Index of the open (or next) content block.
    index: usize,
}

fn emit(out: &mut VecDeque<Event>, kind: &str, data: Value) {
    out.push_back(Event::default().event(kind).data(data.to_string()));
}

impl StreamState {
    fn close_block(&mut self, out: &mut VecDeque<Event>) {
        if self.open != Block::None {
            let i = self.index;
            if self.open == Block::Thinking {
                let d = json!({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": ""}});
                emit(out, "content_block_delta", d);
            }
            emit(out, "content_block_stop", json!({"type": "content_block_stop", "index": i}));
            self.index += 1;
            self.open = Block::None;
        }
    }

    fn open_block(&mut self, out: &mut VecDeque<Event>, kind: Block, block: Value) {
        self.close_block(out);
        let i = self.index;
        emit(out, "content_block_start", json!({"type": "content_block_start", "index": i, "content_block": block}));
        self.open = kind;
    }

    fn delta(&self, out: &mut VecDeque<Event>, delta: Value) {
        let i = self.index;
        emit(out, "content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": delta}));
    }

    fn message_start(&mut self, out: &mut VecDeque<Event>) {
        if !self.started {
            self.started = true;
            let m = json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.state.model.id,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
            }});
            emit(out, "message_start", m);
        }
    }
}

impl Translator for StreamState {
    fn translate(&mut self, u: Option<Update>, out: &mut VecDeque<Event>) -> bool {
        match u {
            Some(Update::Started) => {
                self.message_start(out);
                false
            }
            Some(Update::Token { events, .. }) => {
                self.message_start(out);
                for ev in events {
                    match ev {
                        OutputEvent::Reasoning(s) => {
                            if self.open != Block::Thinking {
                                let b = json!({"type": "thinking", "thinking": "", "signature": ""});
                                self.open_block(out, Block::Thinking, b);
                            }
                            self.delta(out, json!({"type": "thinking_delta", "thinking": s}));
                        }
                        OutputEvent::Content(s) => {
                            if self.open != Block::Text {
                                self.open_block(out, Block::Text, json!({"type": "text", "text": ""}));
                            }
                            self.delta(out, json!({"type": "text_delta", "text": s}));
                        }
                        OutputEvent::ToolCallBegin { name, .. } => {
                            let b = json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}});
                            self.open_block(out, Block::ToolUse, b);
                        }
                        // The parser emits a call's arguments only while the call is open, so
                        // they belong to the open tool_use block.
                        OutputEvent::ToolCallArguments { json, .. } if self.open == Block::ToolUse => {
                            self.delta(out, json!({"type": "input_json_delta", "partial_json": json}))
                        }
                        OutputEvent::ToolCallArguments { .. } => {}
                    }
                }
                false
            }
            Some(Update::Done(summary)) => {
                self.message_start(out);
                self.close_block(out);
                let (reason, seq) = stop_reason(&summary);
                emit(
                    out,
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": {"output_tokens": summary.completion_tokens}}),
                );
                emit(out, "message_stop", json!({"type": "message_stop"}));
                true
            }
            Some(Update::Failed(e)) => {
                emit(out, "error", e.anthropic_body());
                true
            }
            None => {
                emit(out, "error", ApiError::internal("the engine dropped the request").anthropic_body());
                true
            }
        }
    }
}
