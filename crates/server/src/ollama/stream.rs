//! Ollama's streaming: one JSON object per line (NDJSON), each with the text of its token
//! (`message.content` / `message.thinking` for chat, `response` / `thinking` for generate), tool
//! calls in one object as each completes (arguments as an object), and a final object with
//! `done: true`, `done_reason` and the statistics. A failure mid-stream is a line
//! `{"error": ...}`, as Ollama writes it.

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use deltafin_text::chat::parse::OutputEvent;
use serde_json::{Value, json};

use super::{Kind, call_value, done_reason, now_rfc3339, stats};
use crate::worker::{JobHandle, Update};

/// Turns updates into lines.
pub struct Lines {
    kind: Kind,
    model: String,
    /// The call being streamed: (name, arguments so far); sent whole when it ends.
    call: Option<(String, String)>,
    calls_sent: usize,
}

impl Lines {
    pub fn new(kind: Kind, model: String) -> Self {
        Lines { kind, model, call: None, calls_sent: 0 }
    }

    fn line(&self, mut v: Value, out: &mut Vec<u8>) {
        v["model"] = json!(self.model);
        v["created_at"] = json!(now_rfc3339());
        if v.get("done").is_none() {
            v["done"] = json!(false);
        }
        out.extend_from_slice(v.to_string().as_bytes());
        out.push(b'\n');
    }

    /// A piece of text: `thinking` or the answer.
    fn text(&self, thinking: bool, s: &str, out: &mut Vec<u8>) {
        let v = match (self.kind, thinking) {
            (Kind::Chat, false) => json!({"message": {"role": "assistant", "content": s}}),
            (Kind::Chat, true) => json!({"message": {"role": "assistant", "content": "", "thinking": s}}),
            (Kind::Generate, false) => json!({"response": s}),
            (Kind::Generate, true) => json!({"response": "", "thinking": s}),
        };
        self.line(v, out);
    }

    /// Send the call in progress, if any.
    fn flush_call(&mut self, out: &mut Vec<u8>) {
        if let Some((name, args)) = self.call.take() {
            let c = call_value(&name, &args, self.calls_sent);
            self.calls_sent += 1;
            self.line(json!({"message": {"role": "assistant", "content": "", "tool_calls": [c]}}), out);
        }
    }

    /// Lines for one update; `true` when the stream is complete.
    fn translate(&mut self, u: Option<Update>, out: &mut Vec<u8>) -> bool {
        match u {
            Some(Update::Started) => false,
            Some(Update::Token { events, .. }) => {
                for ev in events {
                    match ev {
                        OutputEvent::Reasoning(s) => {
                            self.flush_call(out);
                            self.text(true, &s, out);
                        }
                        OutputEvent::Content(s) => {
                            self.flush_call(out);
                            self.text(false, &s, out);
                        }
                        OutputEvent::ToolCallBegin { name, .. } => {
                            self.flush_call(out);
                            self.call = Some((name, String::new()));
                        }
                        OutputEvent::ToolCallArguments { json, .. } => {
                            if let Some((_, args)) = &mut self.call {
                                args.push_str(&json);
                            }
                        }
                    }
                }
                false
            }
            Some(Update::Done(s)) => {
                self.flush_call(out);
                let mut v = match self.kind {
                    Kind::Chat => json!({"message": {"role": "assistant", "content": ""}}),
                    Kind::Generate => json!({"response": ""}),
                };
                v["done"] = json!(true);
                v["done_reason"] = json!(done_reason(&s));
                if let (Value::Object(b), Value::Object(st)) = (&mut v, stats(&s)) {
                    b.extend(st);
                }
                self.line(v, out);
                true
            }
            Some(Update::Failed(e)) => {
                out.extend_from_slice(json!({"error": e.message}).to_string().as_bytes());
                out.push(b'\n');
                true
            }
            None => {
                out.extend_from_slice(json!({"error": "the engine dropped the request"}).to_string().as_bytes());
                out.push(b'\n');
                true
            }
        }
    }
}

/// The job's updates as an NDJSON body. Dropping the response (client gone) drops the job
/// handle, which cancels the generation or frees its place in the queue.
pub fn ndjson(job: JobHandle, lines: Lines) -> Response {
    let st = (job, lines, false);
    let stream = futures_util::stream::unfold(st, |(mut job, mut lines, done)| async move {
        if done {
            return None;
        }
        loop {
            let u = job.recv().await;
            let mut out = Vec::new();
            let finished = lines.translate(u, &mut out);
            if !out.is_empty() || finished {
                return Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(out)), (job, lines, finished)));
            }
        }
    });
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response()
}
