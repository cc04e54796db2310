//! Kimi K3's chat encoding (XTML), following Moonshot's `encoding_k3.py`.
//!
//! A prompt is a list of segments. Marker segments (`<|open|>`, `<|close|>`, `<|sep|>`,
//! `<|end_of_msg|>`) become their special-token ids; every other segment, tag names and attribute
//! text included, is encoded on its own as ordinary text with special tokens disabled, so a user
//! who types `<|open|>` gets ordinary tokens, never markup. Attribute values escape `&` and `"`;
//! content is inserted raw.
//!
//! Order of a prompt: tool declaration, thinking-effort message, the conversation, a tool-choice
//! message (`required` / `none`), a response-format message, the generation prompt.
//!
//! Golden renderings (`fixtures/chat-golden/k3_chat.json`, from llama.cpp's `Kimi-K3.jinja` and
//! the encoder) test this module; where the two disagree this module follows the encoder.

use serde_json::Value;

use super::{Conversation, Message, Role, ToolChoice};
use crate::tokenizer::Tokenizer;

pub const OPEN: &str = "<|open|>";
pub const CLOSE: &str = "<|close|>";
pub const SEP: &str = "<|sep|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";

/// Efforts the model knows. `medium` is named in the model's own effort prompt and accepted by
/// llama.cpp's template, though Moonshot's encoder refuses it; we pass it through.
pub const EFFORTS: [&str; 4] = ["low", "medium", "high", "max"];

#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub text: String,
    /// A marker (special token) rather than ordinary text.
    pub special: bool,
}

#[derive(Default)]
struct Writer {
    segs: Vec<Segment>,
}

impl Writer {
    fn special(&mut self, s: &str) {
        self.segs.push(Segment { text: s.to_string(), special: true });
    }

    fn text(&mut self, s: &str) {
        if !s.is_empty() {
            self.segs.push(Segment { text: s.to_string(), special: false });
        }
    }

    /// `<|open|>TAG key="value"...<|sep|>`, each attribute as four text segments like the
    /// encoder (` key`, `="`, value, `"`), which fixes where the tokenizer may merge.
    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.special(OPEN);
        self.text(tag);
        for (k, v) in attrs {
            self.text(&format!(" {k}"));
            self.text("=\"");
            self.text(&escape_attr(v));
            self.text("\"");
        }
        self.special(SEP);
    }

    fn close(&mut self, tag: &str) {
        self.special(CLOSE);
        self.text(tag);
        self.special(SEP);
    }

    fn end_message(&mut self) {
        self.close("message");
        self.special(END_OF_MSG);
    }

    /// An internal system message (`type="..."`); its body is stripped like the encoder's.
    fn system_typed(&mut self, ty: &str, body: &str) {
        self.open("message", &[("role", "system"), ("type", ty)]);
        self.text(body.trim());
        self.end_message();
    }
}

fn escape_attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

/// Errors in a conversation that the encoder cannot render.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodeError(pub String);

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EncodeError {}

/// Render options beside the conversation.
#[derive(Debug, Clone, Copy)]
pub struct RenderOptions {
    /// The model reasons before answering (K3's default); `reasoning_effort: "none"` turns it off.
    pub thinking: bool,
    pub add_generation_prompt: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions { thinking: true, add_generation_prompt: true }
    }
}

/// The conversation as segments.
pub fn render(conv: &Conversation, opts: RenderOptions) -> Result<Vec<Segment>, EncodeError> {
    let mut w = Writer::default();
    if !conv.tools.is_empty() {
        let body = format!(
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```",
            py_json(&Value::Array(conv.tools.clone()), true, true)
        );
        w.system_typed("tool-declare", &body);
    }
    let effort = conv.reasoning_effort.as_deref().unwrap_or("max");
    if opts.thinking {
        if !EFFORTS.contains(&effort) {
            return Err(EncodeError(format!(
                "unsupported reasoning effort '{effort}' (low, medium, high, max, or none to turn thinking off)"
            )));
        }
        w.system_typed(
            "thinking-effort",
            &format!(
                "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."
            ),
        );
    }
    let messages = order_tool_results(&conv.messages);
    let mut last_calls: &[super::ToolCall] = &[];
    let mut tool_index = 0usize;
    for m in &messages {
        match m.role {
            Role::System if !m.tools.is_empty() => {
                let body = format!(
                    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n{}\n```",
                    py_json(&Value::Array(m.tools.clone()), true, true)
                );
                w.system_typed("tool-declare", &body);
            }
            Role::System | Role::User => {
                let role = if m.role == Role::System { "system" } else { "user" };
                match m.name.as_deref().filter(|n| !n.is_empty()) {
                    Some(n) => w.open("message", &[("role", role), ("name", n)]),
                    None => w.open("message", &[("role", role)]),
                }
                m.content.iter().for_each(|part| w.text(part));
                w.end_message();
            }
            Role::Assistant => {
                match m.name.as_deref().filter(|n| !n.is_empty()) {
                    Some(n) => w.open("message", &[("role", "assistant"), ("name", n)]),
                    None => w.open("message", &[("role", "assistant")]),
                }
                if opts.thinking {
                    w.open("think", &[]);
                    if let Some(r) = m.reasoning.as_deref().filter(|r| !r.trim().is_empty()) {
                        w.text(r);
                    }
                    w.close("think");
                }
                w.open("response", &[]);
                m.content.iter().for_each(|part| w.text(part));
                w.close("response");
                if !m.tool_calls.is_empty() {
                    w.open("tools", &[]);
                    for (i, c) in m.tool_calls.iter().enumerate() {
                        write_call(&mut w, c, i + 1)?;
                    }
                    w.close("tools");
                }
                w.end_message();
                last_calls = &m.tool_calls;
                tool_index = 0;
            }
            Role::Tool => {
                tool_index += 1;
                let name = match (&m.tool_call_id, &m.name) {
                    (Some(id), _) if last_calls.iter().any(|c| &c.id == id) => {
                        last_calls.iter().find(|c| &c.id == id).map(|c| c.name.clone())
                    }
                    (_, Some(n)) => Some(n.clone()),
                    _ => last_calls.get(tool_index - 1).map(|c| c.name.clone()),
                };
                let Some(name) = name else {
                    return Err(EncodeError(format!(
                        "tool result {tool_index} names no tool and matches no call of the assistant message before it"
                    )));
                };
                w.open("message", &[("role", "tool"), ("tool", &name), ("index", &tool_index.to_string())]);
                m.content.iter().for_each(|part| w.text(part));
                w.end_message();
            }
        }
    }
    match &conv.tool_choice {
        ToolChoice::Required => w.system_typed(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        ToolChoice::None => w.system_typed(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
        ToolChoice::Auto | ToolChoice::Function(_) => {}
    }
    if let Some(schema) = &conv.response_format {
        let kind = if schema.is_some() { "json_schema" } else { "json_object" };
        let mut body = format!(
            "The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
        );
        if let Some(s) = schema {
            body.push_str(&format!(
                "\nThe JSON data must match the following schema:\n```json\n{}\n```",
                py_json(s, true, true)
            ));
        }
        w.system_typed("response-format", &body);
    }
    if opts.add_generation_prompt {
        w.open("message", &[("role", "assistant")]);
        w.open(if opts.thinking { "think" } else { "response" }, &[]);
    }
    Ok(w.segs)
}

fn write_call(w: &mut Writer, c: &super::ToolCall, index: usize) -> Result<(), EncodeError> {
    w.open("call", &[("tool", &c.name), ("index", &index.to_string())]);
    let raw = c.arguments.trim();
    if !raw.is_empty() {
        match serde_json::from_str::<Value>(raw) {
            Ok(Value::Object(args)) => {
                for (k, v) in &args {
                    let (ty, val) = match v {
                        Value::Bool(_) => ("boolean", py_json(v, false, false)),
                        Value::Null => ("null", "null".to_string()),
                        Value::Number(_) => ("number", py_json(v, false, false)),
                        Value::String(s) => ("string", s.clone()),
                        Value::Object(_) => ("object", py_json(v, false, false)),
                        Value::Array(_) => ("array", py_json(v, false, false)),
                    };
                    w.open("argument", &[("key", k), ("type", ty)]);
                    w.text(&val);
                    w.close("argument");
                }
            }
            Ok(Value::Null) => {}
            Ok(_) => {
                return Err(EncodeError(format!("the arguments of tool call '{}' must be a JSON object", c.name)));
            }
            Err(_) => {
                // Not JSON at all: passed through raw, as the encoder does.
                w.open("json", &[("type", "object")]);
                w.text(&c.arguments);
                w.close("json");
            }
        }
    }
    w.close("call");
    Ok(())
}

/// A run of tool results whose every `tool_call_id` names a call of the preceding assistant
/// message is put in the calls' order (stable), as the encoder does.
fn order_tool_results(messages: &[Message]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len());
    let mut i = 0;
    while i < messages.len() {
        if messages[i].role != Role::Tool {
            out.push(messages[i].clone());
            i += 1;
            continue;
        }
        let end = messages[i..].iter().position(|m| m.role != Role::Tool).map(|p| i + p).unwrap_or(messages.len());
        let mut run: Vec<Message> = messages[i..end].to_vec();
        let calls =
            out.iter().rev().find(|m| m.role == Role::Assistant).map(|m| m.tool_calls.as_slice()).unwrap_or(&[]);
        let position = |m: &Message| m.tool_call_id.as_ref().and_then(|id| calls.iter().position(|c| &c.id == id));
        if !calls.is_empty() && run.iter().all(|m| position(m).is_some()) {
            run.sort_by_key(|m| position(m).unwrap_or(usize::MAX));
        }
        out.extend(run);
        i = end;
    }
    out
}

/// The segments as one string (what the golden renderings hold).
pub fn to_text(segs: &[Segment]) -> String {
    segs.iter().map(|s| s.text.as_str()).collect()
}

/// The segments as token ids: markers to their ids, text encoded with specials disabled.
pub fn to_tokens(segs: &[Segment], tok: &Tokenizer) -> Result<Vec<u32>, EncodeError> {
    let mut ids = Vec::new();
    for s in segs {
        if s.special {
            let id = tok
                .specials
                .get(&s.text)
                .ok_or_else(|| EncodeError(format!("the tokenizer has no special token {}", s.text)))?;
            ids.push(*id);
        } else {
            ids.extend(tok.encode_ordinary(&s.text));
        }
    }
    Ok(ids)
}

/// JSON as Python's `json.dumps(v, ensure_ascii=False)` writes it: `compact` uses `,`/`:`
/// separators (else `, `/`: `), `sort` sorts object keys by code point at every level. Numbers
/// follow Python's formatting (`1e-05`, `2.5`, `1.0`).
pub fn py_json(v: &Value, compact: bool, sort: bool) -> String {
    let mut out = String::new();
    write_py_json(&mut out, v, compact, sort);
    out
}

fn write_py_json(out: &mut String, v: &Value, compact: bool, sort: bool) {
    let (item_sep, key_sep) = if compact { (",", ":") } else { (", ", ": ") };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&py_float(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_py_str(out, s),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_py_json(out, x, compact, sort);
            }
            out.push(']');
        }
        Value::Object(o) => {
            let mut entries: Vec<(&String, &Value)> = o.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_py_str(out, k);
                out.push_str(key_sep);
                write_py_json(out, x, compact, sort);
            }
            out.push('}');
        }
    }
}

fn write_py_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents -4..16,
/// else `d.ddde±XX`.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits in scientific form, e.g. "2.5e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map(|m| ("-", m)).unwrap_or(("", mantissa));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{sign}{m}e{}{:02}", if exp < 0 { "-" } else { "+" }, exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (2.5, "2.5"),
            (1.0, "1.0"),
            (1e-5, "1e-05"),
            (1e100, "1e+100"),
            (0.0001, "0.0001"),
            (123456789012345.0, "123456789012345.0"),
            (1e16, "1e+16"),
            (-0.5, "-0.5"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.5e-7, "1.5e-07"),
        ] {
            assert_eq!(py_float(f), s, "{f}");
        }
    }

    #[test]
    fn python_json_separators_and_sorting() {
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, "x\n\u0001"], "a": {"Z": null, "_": true, "a": false}}"#).unwrap();
        assert_eq!(
            py_json(&v, false, false),
            r#"{"b": [1, 2.5, "x\n\u0001"], "a": {"Z": null, "_": true, "a": false}}"#
        );
        assert_eq!(py_json(&v, true, true), r#"{"a":{"Z":null,"_":true,"a":false},"b":[1,2.5,"x\n\u0001"]}"#);
    }
}
