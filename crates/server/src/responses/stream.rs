//! A streamed response: the Responses API's event sequence. `response.created` and
//! `response.in_progress`, then per output item `response.output_item.added`, its content
//! (`response.content_part.added`, `response.output_text.delta` or
//! `response.reasoning_text.delta` ..., `.done`, `response.content_part.done`; for a call
//! `response.function_call_arguments.delta` ... `.done`), `response.output_item.done`, and at
//! the end `response.completed` (or `response.incomplete`, or `response.failed`), each event
//! with its `sequence_number`.

use std::collections::VecDeque;

use axum::response::sse::Event;
use deltafin_text::chat::parse::OutputEvent;
use serde_json::{Value, json};

use super::{Prepared, item, item_prefix, keep, response_object, status_of, usage};
use crate::error::ApiError;
use crate::generation::{Piece, Translator};
use crate::state::{Shared, new_id};
use crate::worker::Update;

/// The item being streamed.
struct Open {
    piece: Piece,
    id: String,
    index: usize,
    /// The model's call index (calls only).
    call: Option<usize>,
}

pub struct Events {
    state: Shared,
    p: Prepared,
    id: String,
    created: u64,
    seq: u64,
    started: bool,
    open: Option<Open>,
    /// Finished items, as pieces and as output items.
    pieces: Vec<Piece>,
    output: Vec<Value>,
    reasoning_tokens: usize,
}

impl Events {
    pub fn new(state: Shared, p: Prepared, id: String, created: u64) -> Self {
        Events {
            state,
            p,
            id,
            created,
            seq: 0,
            started: false,
            open: None,
            pieces: Vec::new(),
            output: Vec::new(),
            reasoning_tokens: 0,
        }
    }

    fn emit(&mut self, out: &mut VecDeque<Event>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push_back(Event::default().event(kind).data(data.to_string()));
    }

    fn response(&self, status: &str, usage: Option<Value>, error: Option<&ApiError>) -> Value {
        response_object(
            &self.state,
            &self.id,
            self.created,
            &self.p.echo,
            &self.p.grant,
            status,
            self.output.clone(),
            usage,
            error,
        )
    }

    fn start(&mut self, out: &mut VecDeque<Event>) {
        if self.started {
            return;
        }
        self.started = true;
        let r = self.response("in_progress", None, None);
        self.emit(out, "response.created", json!({"response": r}));
        self.emit(out, "response.in_progress", json!({"response": r}));
    }

    /// Open an item for `piece` (empty text or arguments).
    fn open(&mut self, out: &mut VecDeque<Event>, piece: Piece, call: Option<usize>) {
        let id = new_id(item_prefix(&piece));
        let index = self.output.len();
        let mut added = item(&piece, &id, "in_progress", &self.p.echo);
        // Items open empty: their text arrives as deltas.
        match &piece {
            Piece::Reasoning(_) | Piece::Content(_) => added["content"] = json!([]),
            Piece::Call { .. } => {}
        }
        self.emit(out, "response.output_item.added", json!({"output_index": index, "item": added}));
        let part = match &piece {
            Piece::Reasoning(_) => Some(json!({"type": "reasoning_text", "text": ""})),
            Piece::Content(_) => Some(json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})),
            Piece::Call { .. } => None,
        };
        if let Some(part) = part {
            self.emit(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
        }
        self.open = Some(Open { piece, id, index, call });
    }

    /// Close the open item, if any, as `status` (`completed`, or `incomplete` when the response
    /// ends inside it).
    fn close(&mut self, out: &mut VecDeque<Event>, status: &str) {
        let Some(o) = self.open.take() else { return };
        let (id, index) = (o.id.clone(), o.index);
        match &o.piece {
            Piece::Reasoning(text) => {
                let part = json!({"type": "reasoning_text", "text": text});
                self.emit(
                    out,
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
            }
            Piece::Content(text) => {
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                self.emit(
                    out,
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
            }
            Piece::Call { name, arguments, .. } => {
                self.emit(
                    out,
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}),
                );
            }
        }
        let done = item(&o.piece, &id, status, &self.p.echo);
        self.emit(out, "response.output_item.done", json!({"output_index": index, "item": done}));
        self.output.push(done);
        self.pieces.push(o.piece);
    }

    fn token(&mut self, out: &mut VecDeque<Event>, ev: OutputEvent) {
        match ev {
            OutputEvent::Reasoning(s) => {
                if !matches!(self.open, Some(Open { piece: Piece::Reasoning(_), .. })) {
                    self.close(out, "completed");
                    self.open(out, Piece::Reasoning(String::new()), None);
                }
                self.delta(out, "response.reasoning_text.delta", s);
            }
            OutputEvent::Content(s) => {
                if !matches!(self.open, Some(Open { piece: Piece::Content(_), .. })) {
                    self.close(out, "completed");
                    self.open(out, Piece::Content(String::new()), None);
                }
                self.delta(out, "response.output_text.delta", s);
            }
            OutputEvent::ToolCallBegin { index, name } => {
                self.close(out, "completed");
                let call = Piece::Call { id: new_id("call_"), name, arguments: String::new() };
                self.open(out, call, Some(index));
            }
            OutputEvent::ToolCallArguments { index, json } => {
                let Some(o) = self.open.as_mut().filter(|o| o.call == Some(index)) else { return };
                if let Piece::Call { arguments, .. } = &mut o.piece {
                    arguments.push_str(&json);
                }
                let (id, i) = (o.id.clone(), o.index);
                self.emit(
                    out,
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": i, "delta": json}),
                );
            }
        }
    }

    /// Append text to the open reasoning or message item and send it.
    fn delta(&mut self, out: &mut VecDeque<Event>, kind: &str, s: String) {
        let Some(o) = self.open.as_mut() else { return };
        if let Piece::Reasoning(t) | Piece::Content(t) = &mut o.piece {
            t.push_str(&s);
        }
        let (id, i) = (o.id.clone(), o.index);
        let mut data = json!({"item_id": id, "output_index": i, "content_index": 0, "delta": s});
        if kind == "response.output_text.delta" {
            data["logprobs"] = json!([]);
        }
        self.emit(out, kind, data);
    }

    fn fail(&mut self, out: &mut VecDeque<Event>, e: &ApiError) {
        self.start(out);
        self.close(out, "incomplete");
        let r = self.response("failed", None, Some(e));
        self.emit(out, "response.failed", json!({"response": r}));
    }
}

impl Translator for Events {
    fn translate(&mut self, u: Option<Update>, out: &mut VecDeque<Event>) -> bool {
        match u {
            Some(Update::Started) => {
                self.start(out);
                false
            }
            Some(Update::Token { events, .. }) => {
                self.start(out);
                if events.iter().any(|e| matches!(e, OutputEvent::Reasoning(_))) {
                    self.reasoning_tokens += 1;
                }
                for ev in events {
                    self.token(out, ev);
                }
                false
            }
            Some(Update::Done(summary)) => {
                self.start(out);
                let status = status_of(&summary);
                self.close(out, if status == "completed" { "completed" } else { "incomplete" });
                let r = self.response(status, Some(usage(&summary, self.reasoning_tokens)), None);
                keep(&self.state, self.p.store, &self.id, &r, std::mem::take(&mut self.p.history), &self.pieces);
                let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                self.emit(out, kind, json!({"response": r}));
                true
            }
            Some(Update::Failed(e)) => {
                self.fail(out, &e);
                true
            }
            None => {
                self.fail(out, &ApiError::internal("the engine dropped the request"));
                true
            }
        }
    }
}
