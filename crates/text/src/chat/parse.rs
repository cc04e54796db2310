//! Incremental parser of Kimi K3's assistant output: reasoning, answer and tool calls.
//!
//! K3 writes its turn in XTML: `<|open|>NAME attrs<|sep|>` opens an element and
//! `<|close|>NAME<|sep|>` closes it, where `<|open|>`, `<|close|>` and `<|sep|>` are single
//! special tokens and the header between them is ordinary text that may span many tokens. The
//! generation prompt already opens `think`, so the output starts inside the reasoning:
//!
//! ```text
//! REASONING<|close|>think<|sep|><|open|>response<|sep|>ANSWER<|close|>response<|sep|>
//! <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//!   <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>
//! <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
//! ```
//!
//! The parser works on token ids, so a marker is recognised by its id, never by text that merely
//! looks like one, and a header split over several tokens is held until its `<|sep|>` arrives.
//! Text is released as soon as it is valid UTF-8; events are emitted in output order.

use crate::tokenizer::{Tokenizer, Utf8Decoder};

/// The special-token ids of K3's markup.
#[derive(Debug, Clone, Copy)]
pub struct Markers {
    pub open: u32,
    pub close: u32,
    pub sep: u32,
}

impl Markers {
    pub fn from_tokenizer(tok: &Tokenizer) -> Option<Self> {
        Some(Markers {
            open: *tok.specials.get("<|open|>")?,
            close: *tok.specials.get("<|close|>")?,
            sep: *tok.specials.get("<|sep|>")?,
        })
    }
}

/// A piece of parsed output, in the order the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    /// A tool call begins (`index` counts calls in this turn from 0).
    ToolCallBegin {
        index: usize,
        name: String,
    },
    /// A fragment of the call's arguments as JSON; the fragments of one call concatenate to a
    /// JSON object.
    ToolCallArguments {
        index: usize,
        json: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
enum Element {
    Think,
    Response,
    Tools,
    Call,
    Argument {
        key: String,
        ty: String,
    },
    /// A call's whole arguments as one JSON text (`<|open|>json type="object"<|sep|>`).
    Json,
    /// Any other element (`message`, unknown names): its text counts as answer.
    Other(String),
}

impl Element {
    fn name(&self) -> &str {
        match self {
            Element::Think => "think",
            Element::Response => "response",
            Element::Tools => "tools",
            Element::Call => "call",
            Element::Argument { .. } => "argument",
            Element::Json => "json",
            Element::Other(n) => n,
        }
    }
}

enum Mode {
    Text,
    /// Reading the header after `<|open|>` until `<|sep|>`.
    OpenHeader,
    /// Reading the name after `<|close|>` until `<|sep|>`.
    CloseHeader,
}

pub struct OutputParser {
    markers: Markers,
    mode: Mode,
    /// Open elements, innermost last.
    stack: Vec<Element>,
    /// Header bytes being read.
    header: Vec<u8>,
    /// Text bytes not yet valid UTF-8 (a character split across tokens).
    utf8: Utf8Decoder,
    /// The argument value being read.
    value: Vec<u8>,
    /// A string argument's bytes not yet valid UTF-8.
    arg_utf8: Utf8Decoder,
    /// Calls begun so far; arguments written in the current call.
    calls: usize,
    args_in_call: usize,
    /// The current call's arguments came as one JSON text.
    raw_args: bool,
}

impl OutputParser {
    /// `in_reasoning`: the prompt opened `think` (K3's generation prompt always does).
    pub fn new(markers: Markers, in_reasoning: bool) -> Self {
        OutputParser {
            markers,
            mode: Mode::Text,
            stack: if in_reasoning { vec![Element::Think] } else { Vec::new() },
            header: Vec::new(),
            utf8: Utf8Decoder::default(),
            value: Vec::new(),
            arg_utf8: Utf8Decoder::default(),
            calls: 0,
            args_in_call: 0,
            raw_args: false,
        }
    }

    /// Feed one generated token (its id and its bytes); parsed events are appended to `out`.
    pub fn push(&mut self, id: u32, bytes: &[u8], out: &mut Vec<OutputEvent>) {
        let m = self.markers;
        if id == m.open || id == m.close {
            self.flush_text(out);
            if !matches!(self.mode, Mode::Text) {
                // A marker inside a header: the header was not a header after all.
                let stray = std::mem::take(&mut self.header);
                self.text(&stray, out);
                self.flush_text(out);
            }
            self.mode = if id == m.open { Mode::OpenHeader } else { Mode::CloseHeader };
            self.header.clear();
            return;
        }
        if id == m.sep {
            match std::mem::replace(&mut self.mode, Mode::Text) {
                Mode::OpenHeader => {
                    let h = String::from_utf8_lossy(&std::mem::take(&mut self.header)).into_owned();
                    self.open(&h, out);
                }
                Mode::CloseHeader => {
                    let h = String::from_utf8_lossy(&std::mem::take(&mut self.header)).into_owned();
                    self.close(h.trim(), out);
                }
                Mode::Text => self.text(bytes, out),
            }
            return;
        }
        match self.mode {
            Mode::Text => self.text(bytes, out),
            Mode::OpenHeader | Mode::CloseHeader => self.header.extend_from_slice(bytes),
        }
    }

    /// End of output: release held text; an unfinished argument or call is closed so that the
    /// arguments already streamed still form a JSON object.
    pub fn finish(&mut self, out: &mut Vec<OutputEvent>) {
        if !self.header.is_empty() {
            let stray = std::mem::take(&mut self.header);
            self.mode = Mode::Text;
            self.text(&stray, out);
        }
        self.flush_text(out);
        while let Some(top) = self.stack.last() {
            match top {
                Element::Argument { .. } => self.close("argument", out),
                Element::Json => self.close("json", out),
                Element::Call => self.close("call", out),
                _ => {
                    self.stack.pop();
                }
            }
        }
    }

    fn open(&mut self, header: &str, out: &mut Vec<OutputEvent>) {
        let (name, attrs) = parse_header(header);
        let el = match name.as_str() {
            "think" => Element::Think,
            "response" => Element::Response,
            "tools" => Element::Tools,
            "call" => {
                // Calls do not nest: a call opened inside another ends that one first, so
                // argument fragments always belong to the last call begun.
                if self.stack.contains(&Element::Call) {
                    self.close("call", out);
                }
                let tool = attr(&attrs, "tool").unwrap_or_default();
                out.push(OutputEvent::ToolCallBegin { index: self.calls, name: tool });
                self.calls += 1;
                self.args_in_call = 0;
                self.raw_args = false;
                Element::Call
            }
            // Once a call's arguments came as one JSON text they are complete: a later
            // `argument` or `json` in the same call is ignored (as an unknown element), or the
            // call's fragments would no longer concatenate to one JSON object.
            "argument" if self.stack.last() == Some(&Element::Call) && !self.raw_args => {
                self.value.clear();
                let key = attr(&attrs, "key").unwrap_or_default();
                let ty = attr(&attrs, "type").unwrap_or_else(|| "string".into());
                if ty == "string" {
                    // String values stream as they arrive (a coding agent's file contents can be
                    // thousands of tokens): the key and the opening quote now, the escaped text
                    // token by token, the closing quote at the end.
                    let sep = if self.args_in_call == 0 { "{" } else { ", " };
                    self.args_in_call += 1;
                    let key_json = serde_json::Value::String(key.clone()).to_string();
                    out.push(OutputEvent::ToolCallArguments {
                        index: self.calls.saturating_sub(1),
                        json: format!("{sep}{key_json}: \""),
                    });
                }
                Element::Argument { key, ty }
            }
            "json" if self.stack.last() == Some(&Element::Call) && self.args_in_call == 0 && !self.raw_args => {
                self.value.clear();
                Element::Json
            }
            _ => Element::Other(name),
        };
        self.stack.push(el);
    }

    fn close(&mut self, name: &str, out: &mut Vec<OutputEvent>) {
        // Close the innermost element of that name (and anything left open inside it).
        let Some(pos) = self.stack.iter().rposition(|e| e.name() == name) else { return };
        while self.stack.len() > pos {
            let Some(el) = self.stack.pop() else { break };
            match el {
                Element::Argument { ty, .. } if ty == "string" => {
                    let rest = self.arg_utf8.flush();
                    let json = format!("{}\"", escape_json_fragment(&rest));
                    out.push(OutputEvent::ToolCallArguments { index: self.calls.saturating_sub(1), json });
                }
                Element::Argument { key, ty } => {
                    let raw = String::from_utf8_lossy(&std::mem::take(&mut self.value)).into_owned();
                    let value = typed_value(&raw, &ty);
                    let key = serde_json::Value::String(key).to_string();
                    let sep = if self.args_in_call == 0 { "{" } else { ", " };
                    self.args_in_call += 1;
                    out.push(OutputEvent::ToolCallArguments {
                        index: self.calls.saturating_sub(1),
                        json: format!("{sep}{key}: {value}"),
                    });
                }
                Element::Json => {
                    // The model's own JSON text, as written when it is an object; anything else
                    // (cut short, not JSON) becomes `{}` so that every client gets an object.
                    let raw = String::from_utf8_lossy(&std::mem::take(&mut self.value)).trim().to_string();
                    let raw = match serde_json::from_str::<serde_json::Value>(&raw) {
                        Ok(serde_json::Value::Object(_)) => raw,
                        _ => "{}".to_string(),
                    };
                    self.raw_args = true;
                    out.push(OutputEvent::ToolCallArguments { index: self.calls.saturating_sub(1), json: raw });
                }
                Element::Call => {
                    if !self.raw_args {
                        let json = if self.args_in_call == 0 { "{}" } else { "}" };
                        out.push(OutputEvent::ToolCallArguments {
                            index: self.calls.saturating_sub(1),
                            json: json.into(),
                        });
                    }
                    self.args_in_call = 0;
                    self.raw_args = false;
                }
                _ => {}
            }
        }
    }

    fn text(&mut self, bytes: &[u8], out: &mut Vec<OutputEvent>) {
        match self.stack.last() {
            Some(Element::Argument { ty, .. }) if ty == "string" => {
                let text = self.arg_utf8.push(bytes);
                if !text.is_empty() {
                    out.push(OutputEvent::ToolCallArguments {
                        index: self.calls.saturating_sub(1),
                        json: escape_json_fragment(&text),
                    });
                }
            }
            Some(Element::Argument { .. } | Element::Json) => self.value.extend_from_slice(bytes),
            // Inside the tool section only layout whitespace is expected; anything else (even in
            // an unknown element there) is dropped, so no text lands between a call's pieces.
            _ if self.stack.iter().any(|e| matches!(e, Element::Tools | Element::Call)) => {}
            _ => {
                let text = self.utf8.push(bytes);
                self.emit(text, out);
            }
        }
    }

    fn flush_text(&mut self, out: &mut Vec<OutputEvent>) {
        if !self.utf8.is_empty() {
            let text = self.utf8.flush();
            self.emit(text, out);
        }
    }

    fn emit(&self, text: String, out: &mut Vec<OutputEvent>) {
        if text.is_empty() {
            return;
        }
        let reasoning = self.stack.last() == Some(&Element::Think);
        match out.last_mut() {
            Some(OutputEvent::Reasoning(s)) if reasoning => s.push_str(&text),
            Some(OutputEvent::Content(s)) if !reasoning => s.push_str(&text),
            _ => out.push(if reasoning { OutputEvent::Reasoning(text) } else { OutputEvent::Content(text) }),
        }
    }
}

/// `call tool="f" index="1"` -> ("call", [("tool", "f"), ("index", "1")]). Attribute values are
/// XML-unescaped.
fn parse_header(h: &str) -> (String, Vec<(String, String)>) {
    let h = h.trim();
    let (name, mut rest) = match h.find(char::is_whitespace) {
        Some(i) => (&h[..i], &h[i..]),
        None => (h, ""),
    };
    let mut attrs = Vec::new();
    loop {
        rest = rest.trim_start();
        let Some(eq) = rest.find("=\"") else { break };
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let Some(end) = after.find('"') else { break };
        attrs.push((key, unescape(&after[..end])));
        rest = &after[end + 1..];
    }
    (name.to_string(), attrs)
}

/// `text` JSON-escaped without the surrounding quotes: escaped pieces of a string concatenate to
/// the escaped string, because JSON escapes character by character.
fn escape_json_fragment(text: &str) -> String {
    let quoted = serde_json::Value::String(text.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

fn attr(attrs: &[(String, String)], key: &str) -> Option<String> {
    attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

pub(crate) fn unescape(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    s.replace("&quot;", "\"").replace("&lt;", "<").replace("&gt;", ">").replace("&apos;", "'").replace("&amp;", "&")
}

/// An argument's value as JSON: strings are quoted; other types are JSON text, kept as a string
/// when the model wrote something that does not parse.
fn typed_value(raw: &str, ty: &str) -> String {
    if ty != "string"
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(raw.trim())
    {
        return v.to_string();
    }
    serde_json::Value::String(raw.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole turn's events collected into its parts (the server's own accumulator is
    /// `deltafin_server::generation::Turn`; this one serves the parser's tests).
    #[derive(Debug, Default, Clone, PartialEq)]
    pub struct ParsedTurn {
        pub reasoning: String,
        pub content: String,
        /// (name, arguments JSON) per call.
        pub tool_calls: Vec<(String, String)>,
    }

    impl ParsedTurn {
        pub fn apply(&mut self, ev: &OutputEvent) {
            match ev {
                OutputEvent::Reasoning(s) => self.reasoning.push_str(s),
                OutputEvent::Content(s) => self.content.push_str(s),
                OutputEvent::ToolCallBegin { name, .. } => self.tool_calls.push((name.clone(), String::new())),
                OutputEvent::ToolCallArguments { index, json } => {
                    if let Some(c) = self.tool_calls.get_mut(*index) {
                        c.1.push_str(json)
                    }
                }
            }
        }
    }

    const M: Markers = Markers { open: 1001, close: 1002, sep: 1003 };

    /// Tokenise marked-up text: `<|open|>`, `<|close|>`, `<|sep|>` become their ids, the rest is
    /// cut into pieces of `piece` bytes (splitting UTF-8 characters on purpose).
    fn tokens(text: &str, piece: usize) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = ["<|open|>", "<|close|>", "<|sep|>"]
                .iter()
                .zip([M.open, M.close, M.sep])
                .filter_map(|(m, id)| rest.find(m).map(|p| (p, m.len(), id)))
                .min();
            let plain_end = next.map(|n| n.0).unwrap_or(rest.len());
            for chunk in rest.as_bytes()[..plain_end].chunks(piece) {
                out.push((0, chunk.to_vec()));
            }
            match next {
                Some((p, len, id)) => {
                    out.push((id, Vec::new()));
                    rest = &rest[p + len..];
                }
                None => rest = "",
            }
        }
        out
    }

    fn parse(text: &str, piece: usize) -> (ParsedTurn, Vec<OutputEvent>) {
        let mut p = OutputParser::new(M, true);
        let mut events = Vec::new();
        for (id, bytes) in tokens(text, piece) {
            p.push(id, &bytes, &mut events);
        }
        p.finish(&mut events);
        let mut turn = ParsedTurn::default();
        events.iter().for_each(|e| turn.apply(e));
        (turn, events)
    }

    const TURN: &str = concat!(
        "Weather in Zürich — 天气?<|close|>think<|sep|>",
        "<|open|>response<|sep|>Let me check.<|close|>response<|sep|>",
        "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>",
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>Zürich<|close|>argument<|sep|>",
        "<|open|>argument key=\"days\" type=\"integer\"<|sep|>3<|close|>argument<|sep|>",
        "<|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"unit\": \"C\"}<|close|>argument<|sep|>",
        "<|close|>call<|sep|><|open|>call tool=\"now\" index=\"2\"<|sep|><|close|>call<|sep|>",
        "<|close|>tools<|sep|><|close|>message<|sep|>"
    );

    #[test]
    fn splits_reasoning_answer_and_calls_whatever_the_token_boundaries() {
        let expect = ParsedTurn {
            reasoning: "Weather in Zürich — 天气?".into(),
            content: "Let me check.".into(),
            tool_calls: vec![
                ("get_weather".into(), r#"{"city": "Zürich", "days": 3, "opts": {"unit":"C"}}"#.into()),
                ("now".into(), "{}".into()),
            ],
        };
        for piece in 1..8 {
            let (turn, _) = parse(TURN, piece);
            assert_eq!(turn, expect, "piece {piece}");
            for (_, args) in &turn.tool_calls {
                serde_json::from_str::<serde_json::Value>(args).unwrap();
            }
        }
    }

    #[test]
    fn streamed_text_never_contains_markup_or_broken_characters() {
        let (_, events) = parse(TURN, 1);
        for e in &events {
            if let OutputEvent::Reasoning(s) | OutputEvent::Content(s) = e {
                assert!(!s.contains('\u{fffd}') && !s.contains("think") && !s.contains("<|"), "{s:?}");
            }
        }
        // Reasoning comes first, then content, then the calls.
        assert!(matches!(events[0], OutputEvent::Reasoning(_)));
        assert!(events.iter().any(|e| matches!(e, OutputEvent::Content(_))));
    }

    #[test]
    fn string_arguments_stream_token_by_token() {
        let text = concat!(
            "r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"write\" index=\"1\"<|sep|>",
            "<|open|>argument key=\"body\" type=\"string\"<|sep|>line \"one\"\nline 二\\<|close|>argument<|sep|>",
            "<|close|>call<|sep|><|close|>tools<|sep|>"
        );
        let (turn, events) = parse(text, 2);
        let fragments = events.iter().filter(|e| matches!(e, OutputEvent::ToolCallArguments { .. })).count();
        assert!(fragments > 5, "{fragments} fragments: the value should stream");
        let v: serde_json::Value = serde_json::from_str(&turn.tool_calls[0].1).unwrap();
        assert_eq!(v["body"], "line \"one\"\nline 二\\");
    }

    #[test]
    fn unfinished_output_still_gives_valid_arguments() {
        let cut = TURN.find("3<|close|>argument").unwrap();
        let (turn, _) = parse(&TURN[..cut], 3);
        assert_eq!(turn.tool_calls.len(), 1);
        let v: serde_json::Value = serde_json::from_str(&turn.tool_calls[0].1).unwrap();
        assert_eq!(v["city"], "Zürich");
        // Stopped inside reasoning: everything is reasoning.
        let (turn, _) = parse("still thinking <b>", 2);
        assert_eq!(turn.reasoning, "still thinking <b>");
        assert!(turn.content.is_empty());
    }

    #[test]
    fn text_outside_elements_is_answer_and_markup_lookalikes_are_text() {
        let (turn, _) = parse("r<|close|>think<|sep|>plain answer with <|open|> as text? no", 4);
        // A real marker id opened a header that never closed: its text comes back as answer.
        assert_eq!(turn.reasoning, "r");
        assert_eq!(turn.content, "plain answer with  as text? no");
        let mut p = OutputParser::new(M, false);
        let mut ev = Vec::new();
        p.push(0, b"<|open|>response<|sep|>", &mut ev);
        p.finish(&mut ev);
        assert_eq!(ev, vec![OutputEvent::Content("<|open|>response<|sep|>".into())]);
    }

    #[test]
    fn a_call_may_carry_its_arguments_as_one_json_text() {
        let text = concat!(
            "r<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>",
            "<|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>{\"a\": [1, 2]}",
            "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
        );
        for piece in 1..5 {
            let (turn, _) = parse(text, piece);
            assert_eq!(turn.tool_calls, vec![("f".to_string(), r#"{"a": [1, 2]}"#.to_string())]);
        }
    }

    #[test]
    fn header_attributes_unescape() {
        let (name, attrs) = parse_header(r#"call tool="a&quot;b&amp;c" index="1""#);
        assert_eq!(name, "call");
        assert_eq!(attr(&attrs, "tool").unwrap(), "a\"b&c");
        assert_eq!(typed_value("not json", "integer"), "\"not json\"");
        assert_eq!(typed_value(" 7 ", "integer"), "7");
    }

    /// Found by the fuzzer (fixtures/fuzz/token_ids/bug-*): each call's fragments must still
    /// make one JSON object when the model repeats arguments after a `json` element or opens a
    /// call inside a call.
    #[test]
    fn malformed_calls_still_give_one_object_per_call() {
        let cases = [
            (
                "<|open|>call tool=\"f\"<|sep|><|open|>json type=\"object\"<|sep|>{\"a\": 1}<|close|>json<|sep|>\
                 <|open|>argument key=\"late\" type=\"string\"<|sep|>x<|close|>argument<|sep|>\
                 <|open|>json type=\"object\"<|sep|>{\"b\": 2}<|close|>json<|sep|><|close|>call<|sep|>",
                vec![("f", "{\"a\": 1}")],
            ),
            (
                "<|open|>call tool=\"a\"<|sep|><|open|>call tool=\"b\"<|sep|>\
                 <|open|>argument key=\"k\" type=\"string\"<|sep|>v<|close|>call<|sep|>\
                 <|open|>argument key=\"k2\" type=\"array\"<|sep|>[1<|close|>argument<|sep|>",
                vec![("a", "{}"), ("b", "{\"k\": \"v\"}")],
            ),
        ];
        for (text, want) in cases {
            for piece in [1, 3, 64] {
                let (turn, _) = parse(text, piece);
                let got: Vec<(&str, &str)> = turn.tool_calls.iter().map(|(n, a)| (n.as_str(), a.as_str())).collect();
                assert_eq!(got, want, "{text}");
            }
        }
    }
}
