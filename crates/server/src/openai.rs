//! OpenAI's wire format: `/v1/chat/completions` and `/v1/completions`, whole or streamed.

use std::collections::VecDeque;

use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use deltafin_text::chat::parse::OutputEvent;
use deltafin_text::chat::{Conversation, Message, Role, ToolCall, ToolChoice};
use deltafin_text::sample::SamplingParams;
use deltafin_text::textgen::{Finish, Summary, TextRequest, TokenLogprob};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::generation::{ChatSettings, Translator, Turn, chat_request, deltafin_info, sse};
use crate::params::{Obj, field, object, opt_bool, opt_f64, opt_int, opt_seed, opt_str, stop_list, unsupported};
use crate::state::{Grant, Shared, new_id, unix_now};
use crate::worker::{Admitted, RequestNote, Update};

/// Most alternatives per token for `top_logprobs` (OpenAI's limit).
const MAX_TOP_LOGPROBS: i64 = 20;

/// Sampling fields shared by every endpoint.
pub fn sampling(o: &Obj, max_temperature: f64) -> Result<SamplingParams, ApiError> {
    let temperature = opt_f64(o, "temperature", 0.0, max_temperature)?.unwrap_or(1.0);
    let top_p = match field(o, "top_p") {
        None => 1.0,
        Some(v) => match v.as_f64() {
            Some(x) if x > 0.0 && x <= 1.0 => x,
            _ => return Err(ApiError::invalid("top_p", "'top_p' must be a number in (0, 1]")),
        },
    };
    // vLLM's convention: -1 (or 0) means no limit.
    let top_k = opt_int(o, "top_k", -1, 1 << 30)?.unwrap_or(0).max(0) as usize;
    Ok(SamplingParams { temperature: temperature as f32, top_p: top_p as f32, top_k, seed: opt_seed(o, "seed")? })
}

/// `max_completion_tokens` (preferred) or `max_tokens`.
fn max_tokens(o: &Obj) -> Result<Option<usize>, ApiError> {
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(n) = opt_int(o, key, 1, i64::from(u32::MAX))? {
            return Ok(Some(n as usize));
        }
    }
    Ok(None)
}

fn check_n(o: &Obj) -> Result<(), ApiError> {
    match opt_int(o, "n", 1, 1) {
        Ok(_) => Ok(()),
        Err(_) => Err(ApiError::invalid("n", "only n = 1 is supported: this server runs one generation at a time")),
    }
}

/// Fields this server does not implement, refused unless neutral.
fn refuse_unsupported(o: &Obj) -> Result<(), ApiError> {
    let zero = |v: &Value| v.as_f64() == Some(0.0);
    unsupported(o, "frequency_penalty", zero)?;
    unsupported(o, "presence_penalty", zero)?;
    unsupported(o, "logit_bias", |v| v.as_object().is_some_and(|m| m.is_empty()))?;
    unsupported(o, "best_of", |v| v.as_i64() == Some(1))?;
    unsupported(o, "echo", |v| v.as_bool() == Some(false))?;
    unsupported(o, "suffix", |v| v.as_str() == Some(""))?;
    Ok(())
}

fn include_usage(o: &Obj) -> Result<bool, ApiError> {
    match field(o, "stream_options") {
        None => Ok(false),
        Some(Value::Object(so)) => Ok(opt_bool(so, "include_usage")
            .map_err(|_| ApiError::invalid("stream_options", "'stream_options.include_usage' must be a boolean"))?
            .unwrap_or(false)),
        Some(_) => Err(ApiError::invalid("stream_options", "'stream_options' must be an object")),
    }
}

/// Parts of a message's `content`: a string, or an array of text parts.
pub fn content_parts(v: Option<&Value>, param: &str) -> Result<Vec<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                match p {
                    Value::String(s) => out.push(s.clone()),
                    Value::Object(po) => match po.get("type").and_then(|t| t.as_str()) {
                        Some("text") | Some("input_text") => match po.get("text") {
                            Some(Value::String(s)) => out.push(s.clone()),
                            _ => return Err(ApiError::invalid(param, "a text part needs a string 'text'")),
                        },
                        Some(other) => {
                            return Err(ApiError::invalid(
                                param,
                                format!("content parts of type '{other}' are not supported (text only)"),
                            ));
                        }
                        None => return Err(ApiError::invalid(param, "a content part needs a 'type'")),
                    },
                    _ => return Err(ApiError::invalid(param, "content parts must be objects")),
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::invalid(param, "'content' must be a string or an array of text parts")),
    }
}

/// OpenAI `messages` into the engine's messages.
pub fn parse_messages(v: Option<&Value>) -> Result<Vec<Message>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Err(ApiError::missing("messages")),
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("messages", "'messages' is empty")),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("messages", "'messages' must be an array")),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = |k: &str| format!("messages[{i}].{k}");
        let Some(mo) = m.as_object() else {
            return Err(ApiError::invalid(&format!("messages[{i}]"), "each message must be an object"));
        };
        let role = match mo.get("role").and_then(|r| r.as_str()) {
            Some("system") | Some("developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some("tool") => Role::Tool,
            Some(other) => {
                return Err(ApiError::invalid(
                    &p("role"),
                    format!("unknown role '{other}' (system, developer, user, assistant or tool)"),
                ));
            }
            None => return Err(ApiError::invalid(&p("role"), "each message needs a string 'role'")),
        };
        let mut msg = Message::new(role, "");
        msg.content = content_parts(mo.get("content"), &p("content"))?;
        msg.name = opt_str(mo, "name")
            .map_err(|_| ApiError::invalid(&p("name"), "'name' must be a string"))?
            .map(String::from);
        if role == Role::Assistant {
            for key in ["reasoning_content", "reasoning"] {
                if let Some(r) =
                    opt_str(mo, key).map_err(|_| ApiError::invalid(&p(key), format!("'{key}' must be a string")))?
                {
                    msg.reasoning = Some(r.to_string());
                }
            }
            msg.tool_calls = parse_tool_calls(mo.get("tool_calls"), &p("tool_calls"))?;
        }
        if role == Role::System {
            msg.tools = parse_tools(mo.get("tools")).map_err(|e| ApiError::invalid(&p("tools"), e.message))?;
        }
        if role == Role::Tool {
            msg.tool_call_id = opt_str(mo, "tool_call_id")
                .map_err(|_| ApiError::invalid(&p("tool_call_id"), "'tool_call_id' must be a string"))?
                .map(String::from);
        }
        out.push(msg);
    }
    Ok(out)
}

fn parse_tool_calls(v: Option<&Value>, param: &str) -> Result<Vec<ToolCall>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid(param, "'tool_calls' must be an array")),
    };
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        let f = c.get("function").and_then(|f| f.as_object());
        let name = f.and_then(|f| f.get("name")).and_then(|n| n.as_str());
        let Some(name) = name else {
            return Err(ApiError::invalid(param, "each tool call needs function.name"));
        };
        let arguments = match f.and_then(|f| f.get("arguments")) {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            // Some clients send the object itself.
            Some(other) => other.to_string(),
        };
        let id = c.get("id").and_then(|i| i.as_str()).unwrap_or_default().to_string();
        out.push(ToolCall { id, name: name.to_string(), arguments });
    }
    Ok(out)
}

pub fn parse_tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    for (i, t) in list.iter().enumerate() {
        let ok = t.get("type").and_then(|x| x.as_str()) == Some("function")
            && t.get("function").and_then(|f| f.get("name")).and_then(|n| n.as_str()).is_some();
        if !ok {
            return Err(ApiError::invalid(
                &format!("tools[{i}]"),
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}",
            ));
        }
    }
    Ok(list.clone())
}

pub fn parse_tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            _ => Err(ApiError::invalid("tool_choice", "'tool_choice' must be auto, none, required or a function")),
        },
        // Chat's `{"type": "function", "function": {"name"}}`, or the Responses API's flat
        // `{"type": "function", "name"}`.
        Some(Value::Object(o)) => match o
            .get("function")
            .and_then(|f| f.get("name"))
            .or_else(|| o.get("name").filter(|_| o.get("type").and_then(|t| t.as_str()) == Some("function")))
            .and_then(|n| n.as_str())
        {
            Some(name) => Ok(ToolChoice::Function(name.to_string())),
            None => Err(ApiError::invalid("tool_choice", "a named tool choice needs function.name")),
        },
        Some(_) => Err(ApiError::invalid("tool_choice", "'tool_choice' must be a string or an object")),
    }
}

fn parse_response_format(v: Option<&Value>) -> Result<Option<Option<Value>>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    match v.get("type").and_then(|t| t.as_str()) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(None)),
        Some("json_schema") => {
            let schema = v.get("json_schema").and_then(|j| j.get("schema")).cloned();
            Ok(Some(Some(schema.unwrap_or_else(|| json!({})))))
        }
        _ => {
            Err(ApiError::invalid("response_format", "'response_format.type' must be text, json_object or json_schema"))
        }
    }
}

pub fn reasoning_effort(o: &Obj) -> Result<Option<String>, ApiError> {
    match opt_str(o, "reasoning_effort")? {
        None => Ok(None),
        // OpenAI's lowest level; K3's lowest is `low`.
        Some("minimal") => Ok(Some("low".into())),
        Some(e @ ("none" | "low" | "medium" | "high" | "max")) => Ok(Some(e.to_string())),
        Some(_) => Err(ApiError::invalid(
            "reasoning_effort",
            "'reasoning_effort' must be none (no reasoning), minimal, low, medium, high or max",
        )),
    }
}

/// How a response reports log-probabilities.
#[derive(Clone, Copy, PartialEq)]
enum LogprobStyle {
    None,
    /// Chat: `logprobs.content[]` with `top_logprobs`.
    Chat(usize),
    /// Completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`.
    Legacy(usize),
}

impl LogprobStyle {
    fn top(self) -> Option<usize> {
        match self {
            LogprobStyle::None => None,
            LogprobStyle::Chat(n) | LogprobStyle::Legacy(n) => Some(n),
        }
    }
}

/// A validated request, ready to run and to answer.
pub struct Prepared {
    pub req: TextRequest,
    pub grant: Grant,
    pub stream: bool,
    pub include_usage: bool,
    logprobs: LogprobStyle,
    chat: bool,
}

pub fn prepare_chat(state: &Shared, body: &Value) -> Result<Prepared, ApiError> {
    let o = object(body)?;
    state.check_model(opt_str(o, "model")?)?;
    let messages = parse_messages(o.get("messages"))?;
    check_n(o)?;
    refuse_unsupported(o)?;
    let conv = Conversation {
        messages,
        tools: parse_tools(o.get("tools"))?,
        tool_choice: parse_tool_choice(o.get("tool_choice"))?,
        reasoning_effort: reasoning_effort(o)?,
        response_format: parse_response_format(o.get("response_format"))?,
    };
    let logprobs = opt_bool(o, "logprobs")?.unwrap_or(false);
    let top = opt_int(o, "top_logprobs", 0, MAX_TOP_LOGPROBS)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true"));
    }
    let style = if logprobs { LogprobStyle::Chat(top.unwrap_or(0) as usize) } else { LogprobStyle::None };
    let settings = ChatSettings {
        max_tokens: max_tokens(o)?,
        sampling: sampling(o, 2.0)?,
        stop: stop_list(o, "stop")?,
        logprobs: style.top(),
        ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
    };
    let (req, grant) = chat_request(state, &conv, settings)?;
    Ok(Prepared {
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage: include_usage(o)?,
        req,
        grant,
        logprobs: style,
        chat: true,
    })
}

/// The `prompt` of a completion request as token ids, and as text when it was sent as text.
fn completion_prompt<'b>(state: &Shared, v: Option<&'b Value>) -> Result<(Vec<u32>, Option<&'b str>), ApiError> {
    let bad = || ApiError::invalid("prompt", "'prompt' must be a string or an array of token ids");
    let ids_of = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|t| match t.as_u64() {
                Some(id) if id < state.model.vocab as u64 => Ok(id as u32),
                _ => Err(ApiError::invalid(
                    "prompt",
                    format!("token ids must be integers in [0, {}) (the vocabulary)", state.model.vocab),
                )),
            })
            .collect()
    };
    match v {
        None | Some(Value::Null) => Err(ApiError::missing("prompt")),
        Some(Value::String(s)) => Ok((state.tokenizer.encode(s), Some(s.as_str()))),
        Some(Value::Array(a)) if a.iter().all(|x| x.is_number()) => Ok((ids_of(a)?, None)),
        // A batch of one.
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok((state.tokenizer.encode(s), Some(s.as_str()))),
            Value::Array(inner) => Ok((ids_of(inner)?, None)),
            _ => Err(bad()),
        },
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            Err(ApiError::invalid("prompt", "batched prompts are not supported: send one prompt per request"))
        }
        Some(_) => Err(bad()),
    }
}

/// OpenAI's default length for completions.
const DEFAULT_COMPLETION_TOKENS: usize = 16;

pub fn prepare_completion(state: &Shared, body: &Value) -> Result<Prepared, ApiError> {
    let o = object(body)?;
    state.check_model(opt_str(o, "model")?)?;
    let (prompt, text) = completion_prompt(state, o.get("prompt"))?;
    check_n(o)?;
    refuse_unsupported(o)?;
    let top = opt_int(o, "logprobs", 0, MAX_TOP_LOGPROBS)?;
    let grant = match opt_int(o, "max_tokens", 1, i64::from(u32::MAX))? {
        Some(n) => state.budget(prompt.len(), Some(n as usize))?,
        // The default never makes a fitting prompt fail.
        None => {
            let g = state.budget(prompt.len(), None)?;
            Grant { tokens: g.tokens.min(DEFAULT_COMPLETION_TOKENS), ..g }
        }
    };
    let style = match top {
        Some(n) => LogprobStyle::Legacy(n as usize),
        None => LogprobStyle::None,
    };
    // A prompt sent as token ids is matched against scripts as its decoded text.
    let forced = state.forced(|| vec![text.map_or_else(|| state.tokenizer.decode(&prompt), str::to_owned)]);
    Ok(Prepared {
        req: TextRequest {
            shared_prefix: None,
            forced,
            prompt,
            max_tokens: grant.tokens,
            sampling: sampling(o, 2.0)?,
            stop: stop_list(o, "stop")?,
            logprobs: style.top(),
            parse_chat: false,
            reasoning_open: false,
            ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
        },
        grant,
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage: include_usage(o)?,
        logprobs: style,
        chat: false,
    })
}

fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::Cancelled => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

/// OpenAI's usage: tokens, and the prompt tokens taken from stored state
/// (`prompt_tokens_details.cached_tokens`).
fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
    })
}

/// Time to first token apart from the decode rate, under llama.cpp's `timings` names (which
/// local-model clients already read): the prompt phase ends with the first token.
pub fn timings(s: &Summary) -> Value {
    let after_first = s.completion_tokens.saturating_sub(1);
    let per_s = |n: usize, secs: f64| if secs > 0.0 && n > 0 { json!(n as f64 / secs) } else { Value::Null };
    json!({
        "ttft_s": s.ttft_s,
        "prompt_n": s.prompt_tokens - s.cached_prompt_tokens.min(s.prompt_tokens),
        "prompt_cached_n": s.cached_prompt_tokens,
        "prompt_ms": s.ttft_s * 1e3,
        "prompt_per_second": per_s(s.prompt_tokens - s.cached_prompt_tokens.min(s.prompt_tokens), s.ttft_s),
        "predicted_n": after_first,
        "predicted_ms": s.decode_s * 1e3,
        "predicted_per_second": per_s(after_first, s.decode_s),
    })
}

/// A token as text: its bytes decoded, a split character replaced.
fn token_text(state: &Shared, id: u32) -> String {
    String::from_utf8_lossy(state.tokenizer.token_bytes(id)).into_owned()
}

fn token_entry(state: &Shared, id: u32, logprob: f32) -> Value {
    let bytes = state.tokenizer.token_bytes(id);
    json!({"token": String::from_utf8_lossy(bytes), "logprob": logprob, "bytes": bytes})
}

fn chat_logprobs(state: &Shared, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = token_entry(state, l.id, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, lp)| token_entry(state, id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// Completions' log-probabilities; `offset` is the text offset of the first token, advanced
/// past these tokens.
fn legacy_logprobs(state: &Shared, lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let (mut tokens, mut token_lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for l in lps {
        let text = token_text(state, l.id);
        offsets.push(*offset);
        *offset += text.len();
        tokens.push(text);
        token_lps.push(l.logprob);
        let top: serde_json::Map<String, Value> =
            l.top.iter().map(|&(id, lp)| (token_text(state, id), json!(lp))).collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets})
}

fn fingerprint(state: &Shared) -> String {
    format!("deltafin-{}-{}", env!("CARGO_PKG_VERSION"), if state.model.approx { "approx" } else { "exact" })
}

/// Answer a prepared request: a JSON body, or an event stream.
pub async fn respond(state: Shared, admitted: Admitted, p: Prepared) -> Result<Response, ApiError> {
    let endpoint = if p.chat { "POST /v1/chat/completions" } else { "POST /v1/completions" };
    let job = state.submit(admitted, p.req.clone(), RequestNote::new(endpoint, p.grant))?;
    let id = new_id(if p.chat { "chatcmpl-" } else { "cmpl-" });
    if p.stream {
        let interval = state.keep_alive;
        let t = StreamState { created: unix_now(), state, p, id, sent_role: false, text_offset: 0 };
        return Ok(sse(job, t, interval));
    }
    let mut turn = Turn::new("call_");
    let summary = turn.collect(job).await?;
    let created = unix_now();
    let body = if p.chat {
        let content = turn.content();
        let mut message = json!({"role": "assistant", "content": content});
        let reasoning = turn.reasoning();
        if !reasoning.is_empty() {
            message["reasoning_content"] = json!(reasoning);
        }
        let calls: Vec<Value> = turn
            .calls()
            .map(
                |(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}),
            )
            .collect();
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
            if content.is_empty() {
                message["content"] = Value::Null;
            }
        }
        let logprobs = match p.logprobs {
            LogprobStyle::Chat(_) => chat_logprobs(&state, &turn.logprobs),
            _ => Value::Null,
        };
        json!({
            "id": id, "object": "chat.completion", "created": created, "model": state.model.id,
            "system_fingerprint": fingerprint(&state),
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(summary.finish)}],
            "usage": usage(&summary),
            "timings": timings(&summary),
            "deltafin": deltafin_info(&state, &p.grant),
        })
    } else {
        let logprobs = match p.logprobs {
            LogprobStyle::Legacy(_) => legacy_logprobs(&state, &turn.logprobs, &mut 0),
            _ => Value::Null,
        };
        json!({
            "id": id, "object": "text_completion", "created": created, "model": state.model.id,
            "system_fingerprint": fingerprint(&state),
            "choices": [{"index": 0, "text": turn.content(), "logprobs": logprobs, "finish_reason": finish_reason(summary.finish)}],
            "usage": usage(&summary),
            "timings": timings(&summary),
            "deltafin": deltafin_info(&state, &p.grant),
        })
    };
    Ok(axum::Json(body).into_response())
}

/// Prints a job's updates as OpenAI chunks.
struct StreamState {
    state: Shared,
    p: Prepared,
    id: String,
    created: u64,
    sent_role: bool,
    /// Byte offset of the next token's text (completions' `text_offset`).
    text_offset: usize,
}

impl StreamState {
    /// One chunk around `choices`.
    fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> Event {
        Event::default().data(self.chunk_value(choices, usage).to_string())
    }

    fn chunk_value(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": if self.p.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.state.model.id,
            "system_fingerprint": fingerprint(&self.state),
            "choices": choices,
        });
        if self.p.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    }
}

impl Translator for StreamState {
    fn translate(&mut self, u: Option<Update>, out: &mut VecDeque<Event>) -> bool {
        match u {
            Some(Update::Started) => false,
            Some(Update::Token { events, logprob }) => {
                let mut choices = token_choices(self.p.chat, &events);
                if let Some(l) = logprob {
                    let lp = match self.p.logprobs {
                        LogprobStyle::Chat(_) => chat_logprobs(&self.state, std::slice::from_ref(&l)),
                        LogprobStyle::Legacy(_) => {
                            legacy_logprobs(&self.state, std::slice::from_ref(&l), &mut self.text_offset)
                        }
                        LogprobStyle::None => Value::Null,
                    };
                    match choices.first_mut() {
                        Some(c) => c["logprobs"] = lp,
                        None if self.p.chat => {
                            choices.push(json!({"index": 0, "delta": {}, "logprobs": lp, "finish_reason": null}))
                        }
                        None => choices.push(json!({"index": 0, "text": "", "logprobs": lp, "finish_reason": null})),
                    }
                }
                for mut c in choices {
                    if self.p.chat && !self.sent_role {
                        self.sent_role = true;
                        c["delta"]["role"] = json!("assistant");
                    }
                    out.push_back(self.chunk(vec![c], None));
                }
                false
            }
            Some(Update::Done(summary)) => {
                let fr = finish_reason(summary.finish);
                let last = if self.p.chat {
                    let delta = if self.sent_role { json!({}) } else { json!({"role": "assistant"}) };
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": fr})
                } else {
                    json!({"index": 0, "text": "", "logprobs": null, "finish_reason": fr})
                };
                out.push_back(self.chunk(vec![last], None));
                if self.p.include_usage {
                    let mut last = self.chunk_value(vec![], Some(usage(&summary)));
                    last["timings"] = timings(&summary);
                    out.push_back(Event::default().data(last.to_string()));
                }
                out.push_back(Event::default().data("[DONE]"));
                true
            }
            Some(Update::Failed(e)) => {
                out.push_back(error_event(&e));
                out.push_back(Event::default().data("[DONE]"));
                true
            }
            None => {
                out.push_back(error_event(&ApiError::internal("the engine dropped the request")));
                out.push_back(Event::default().data("[DONE]"));
                true
            }
        }
    }
}

fn error_event(e: &ApiError) -> Event {
    Event::default().data(e.openai_body().to_string())
}

/// Choices for one token's events: chat deltas, or completion text.
fn token_choices(chat: bool, events: &[OutputEvent]) -> Vec<Value> {
    let mut out = Vec::new();
    for ev in events {
        if !chat {
            // Completions are raw text: only content exists there.
            if let OutputEvent::Content(s) = ev {
                out.push(json!({"index": 0, "text": s, "logprobs": null, "finish_reason": null}));
            }
            continue;
        }
        let delta = match ev {
            OutputEvent::Reasoning(s) => json!({"reasoning_content": s}),
            OutputEvent::Content(s) => json!({"content": s}),
            OutputEvent::ToolCallBegin { index, name } => json!({"tool_calls": [{
                "index": index, "id": new_id("call_"), "type": "function",
                "function": {"name": name, "arguments": ""}
            }]}),
            OutputEvent::ToolCallArguments { index, json } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": json}}]})
            }
        };
        out.push(json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}));
    }
    out
}
