//! What both wire formats share: preparing a chat generation, running request preparation off
//! the async workers, accumulating a whole turn, and streaming updates as server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use deltafin_text::chat::parse::OutputEvent;
use deltafin_text::chat::{Conversation, Role};
use deltafin_text::sample::SamplingParams;
use deltafin_text::textgen::{Summary, TextRequest, TokenLogprob};

use crate::error::ApiError;
use crate::sse::keep_alive;
use crate::state::{Grant, Shared, new_id};
use crate::worker::{JobHandle, Update};

/// Generation settings of a chat request, in either wire format.
pub struct ChatSettings {
    /// Requested output length; more than fits is clamped to the rest of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
}

/// A chat conversation as a generation: rendered, tokenised, bounded by the context.
pub fn chat_request(state: &Shared, conv: &Conversation, s: ChatSettings) -> Result<(TextRequest, Grant), ApiError> {
    let prompt = crate::prompt::encode_chat(state, conv)?;
    let grant = state.budget(prompt.len(), s.max_tokens)?;
    let shared_prefix = crate::prompt::shared_prefix(state, conv, &prompt);
    let req = TextRequest {
        shared_prefix,
        forced: state.forced(|| {
            // A conversation that ends with tool results is matched on them first (an agent's
            // next step), then on the last user text.
            let tools = conv.messages.iter().rev().take_while(|m| m.role == Role::Tool).map(|m| m.text());
            let user = conv.messages.iter().rev().find(|m| m.role == Role::User).map(|m| m.text());
            tools.chain(user).collect()
        }),
        prompt,
        max_tokens: grant.tokens,
        sampling: s.sampling,
        stop: s.stop,
        logprobs: s.logprobs,
        parse_chat: true,
        reasoning_open: crate::prompt::thinking(conv),
        ignore_eos: s.ignore_eos,
    };
    Ok((req, grant))
}

/// The `deltafin` object of a response: the numerics, where the routed experts computed, and a
/// clamped `max_tokens` when there was one.
pub fn deltafin_info(state: &Shared, grant: &Grant) -> serde_json::Value {
    let mut v = serde_json::json!({"numerics": state.model.numerics, "device": state.model.device});
    if let Some(asked) = grant.clamped_from {
        v["max_tokens_clamped"] = serde_json::json!({"requested": asked, "granted": grant.tokens});
    }
    v
}

/// One piece of a turn's output; consecutive text of one kind is one piece.
#[derive(Debug, Clone)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    Call { id: String, name: String, arguments: String },
}

/// A whole turn, accumulated from the engine's updates (non-streaming responses).
pub struct Turn {
    pub pieces: Vec<Piece>,
    /// Piece index of each call, in call order.
    calls: Vec<usize>,
    call_prefix: &'static str,
    pub logprobs: Vec<TokenLogprob>,
    /// Tokens that produced reasoning text.
    pub reasoning_tokens: usize,
}

impl Turn {
    /// `call_prefix`: how tool-call ids start (`call_` for OpenAI, `toolu_` for Anthropic).
    pub fn new(call_prefix: &'static str) -> Self {
        Turn { pieces: Vec::new(), calls: Vec::new(), call_prefix, logprobs: Vec::new(), reasoning_tokens: 0 }
    }

    fn apply(&mut self, ev: OutputEvent) {
        match ev {
            OutputEvent::Reasoning(s) => match self.pieces.last_mut() {
                Some(Piece::Reasoning(r)) => r.push_str(&s),
                _ => self.pieces.push(Piece::Reasoning(s)),
            },
            OutputEvent::Content(s) => match self.pieces.last_mut() {
                Some(Piece::Content(c)) => c.push_str(&s),
                _ => self.pieces.push(Piece::Content(s)),
            },
            OutputEvent::ToolCallBegin { name, .. } => {
                self.calls.push(self.pieces.len());
                self.pieces.push(Piece::Call { id: new_id(self.call_prefix), name, arguments: String::new() });
            }
            OutputEvent::ToolCallArguments { index, json } => {
                if let Some(Piece::Call { arguments, .. }) = self.calls.get(index).and_then(|&p| self.pieces.get_mut(p))
                {
                    arguments.push_str(&json);
                }
            }
        }
    }

    pub fn reasoning(&self) -> String {
        self.pieces.iter().filter_map(|p| if let Piece::Reasoning(s) = p { Some(s.as_str()) } else { None }).collect()
    }

    pub fn content(&self) -> String {
        self.pieces.iter().filter_map(|p| if let Piece::Content(s) = p { Some(s.as_str()) } else { None }).collect()
    }

    /// (id, name, arguments) per call.
    pub fn calls(&self) -> impl Iterator<Item = (&str, &str, &str)> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Call { id, name, arguments } => Some((id.as_str(), name.as_str(), arguments.as_str())),
            _ => None,
        })
    }

    /// Wait for the job to end, accumulating its output.
    pub async fn collect(&mut self, mut job: JobHandle) -> Result<Summary, ApiError> {
        while let Some(u) = job.recv().await {
            match u {
                Update::Started => {}
                Update::Token { events, logprob } => {
                    if events.iter().any(|e| matches!(e, OutputEvent::Reasoning(_))) {
                        self.reasoning_tokens += 1;
                    }
                    events.into_iter().for_each(|e| self.apply(e));
                    self.logprobs.extend(logprob);
                }
                Update::Done(s) => return Ok(s),
                Update::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::internal("the engine dropped the request"))
    }
}

/// Turns a job's updates into one wire format's events.
pub trait Translator: Send + 'static {
    /// Append the events for `update` (`None`: the engine went away) to `out`; return true
    /// when the stream is complete.
    fn translate(&mut self, update: Option<Update>, out: &mut VecDeque<Event>) -> bool;
}

/// A streamed response: the translated updates as server-sent events, with keep-alive comments
/// while nothing else is sent. Dropping the response (client gone) drops the job handle, which
/// cancels the generation or frees its place in the queue.
pub fn sse(job: JobHandle, translator: impl Translator, interval: Duration) -> Response {
    struct St<T> {
        job: JobHandle,
        t: T,
        out: VecDeque<Event>,
        done: bool,
    }
    let st = St { job, t: translator, out: VecDeque::new(), done: false };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.out.pop_front() {
                return Some((Ok::<Event, Infallible>(ev), st));
            }
            if st.done {
                return None;
            }
            let u = st.job.recv().await;
            st.done = st.t.translate(u, &mut st.out);
        }
    });
    Sse::new(stream).keep_alive(keep_alive(interval)).into_response()
}
