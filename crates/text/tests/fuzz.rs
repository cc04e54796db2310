//! Fuzzing the text protocol: loading a tokenizer from hostile files, encoding arbitrary text,
//! decoding arbitrary token ids, parsing arbitrary model output, and rendering arbitrary
//! conversations with K3's chat encoding. None may panic or allocate without bound; encoding
//! must round-trip (decoding the ids gives the text back) and a rendered prompt must decode to
//! its own text.
//!
//! Harness, corpus and case counts: see `fuzzkit` (`DELTAFIN_FUZZ_CASES=N` to run long).

#[path = "../../store/tests/fuzzkit/mod.rs"]
mod fuzzkit;

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use base64::Engine as _;
use deltafin_text::chat::encode::{RenderOptions, render, to_text, to_tokens};
use deltafin_text::chat::parse::{Markers, OutputEvent, OutputParser};
use deltafin_text::chat::{Conversation, Message, Role, ToolCall, ToolChoice};
use deltafin_text::tokenizer::{Tokenizer, Utf8Decoder};
use fuzzkit::*;
use proptest::prelude::*;
use serde_json::Value;

#[global_allocator]
static ALLOC: CapAlloc = CapAlloc;

fn fixture_hf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/k3-tiny/hf")
}

static TOKENIZER: LazyLock<Tokenizer> = LazyLock::new(|| Tokenizer::load(&fixture_hf()).expect("fixture tokenizer"));

/// Text that exercises every path of the pre-tokeniser and the special-token split.
const PROBES: &[&str] = &[
    "",
    "Hello, world! It's 2025.",
    "  \t\n\r\n  spaces   ",
    "中文字符 and ÉÀ accents, emoji 🦀🦀",
    "\u{0}\u{1}\u{1f}\u{7f}\u{80}\u{ffff}\u{10ffff}",
    "<|open|>message<|sep|>x<|close|>message<|sep|><|end_of_msg|>[EOS]",
    "<|open|<|open|>|>",
    "123456789 0.5e-3",
    "don't WE'LL",
];

/// Encode and decode `text` both ways; encoding must be lossless.
fn round_trip(tok: &Tokenizer, text: &str) {
    let ids = tok.encode_ordinary(text);
    assert_eq!(tok.decode(&ids), text, "encode_ordinary does not round-trip");
    let ids = tok.encode(text);
    assert_eq!(tok.decode(&ids), text, "encode does not round-trip");
}

// ---------------------------------------------------------------------------------------------
// Tokenizer::load

/// A tokenizer directory: each file's bytes, or absent.
#[derive(Debug, Clone)]
struct TokFiles {
    model: Option<Vec<u8>>,
    config: Option<Vec<u8>>,
    generation: Option<Vec<u8>>,
}

/// Load the tokenizer from `files`; when it loads, use it on every probe and on ids around its
/// vocabulary.
fn check_load(dir: &Path, files: &TokFiles) -> Result<(), TestCaseError> {
    for (name, bytes) in [
        ("tiktoken.model", &files.model),
        ("tokenizer_config.json", &files.config),
        ("generation_config.json", &files.generation),
    ] {
        let p = dir.join(name);
        match bytes {
            Some(b) => std::fs::write(&p, b).unwrap(),
            None => {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    bounded(|| {
        let Ok(tok) = Tokenizer::load(dir) else { return };
        for p in PROBES {
            round_trip(&tok, p);
        }
        for s in tok.specials.keys() {
            round_trip(&tok, s);
            round_trip(&tok, &format!("a{s}{s}b"));
        }
        let ids: Vec<u32> = (0..400).chain([u32::MAX, u32::MAX - 1, 1 << 31]).collect();
        let _ = tok.decode(&ids);
        for &id in &ids {
            let _ = (tok.token_bytes(id), tok.is_special(id));
        }
    })
}

/// A corpus file: `{"tiktoken_model": text, "tiktoken_model_b64": base64, "tokenizer_config":
/// text, "generation_config": text}`, each optional (absent: the file is absent); the string
/// `"fixture"` stands for the fixture's own file.
fn tok_files_from_corpus(bytes: &[u8]) -> TokFiles {
    let v: Value = serde_json::from_slice(bytes).expect("tokenizer_load corpus files are JSON");
    let file = |key: &str, fixture: &str| -> Option<Vec<u8>> {
        match v.get(key)?.as_str()? {
            "fixture" => Some(std::fs::read(fixture_hf().join(fixture)).unwrap()),
            s => Some(s.as_bytes().to_vec()),
        }
    };
    let b64 = v
        .get("tiktoken_model_b64")
        .and_then(Value::as_str)
        .map(|s| base64::engine::general_purpose::STANDARD.decode(s).expect("tiktoken_model_b64 is base64"));
    TokFiles {
        model: b64.or_else(|| file("tiktoken_model", "tiktoken.model")),
        config: file("tokenizer_config", "tokenizer_config.json"),
        generation: file("generation_config", "generation_config.json"),
    }
}

/// Edits of a `tiktoken.model`, line by line.
#[derive(Debug, Clone)]
enum LineOp {
    Drop(prop::sample::Index),
    Duplicate(prop::sample::Index),
    Rank(prop::sample::Index, String),
    Token(prop::sample::Index, String),
    Raw(prop::sample::Index, String),
}

fn line_op() -> impl Strategy<Value = LineOp> {
    use prop::sample::Index;
    let rank = prop_oneof![
        Just("0".to_string()),
        Just("4294967295".to_string()),
        Just("4294967296".to_string()),
        Just("-1".to_string()),
        Just("300".to_string()),
        Just("1e3".to_string()),
        (0u32..400).prop_map(|r| r.to_string()),
    ];
    let token = prop_oneof![
        Just(String::new()),
        Just("!!!!".to_string()),
        Just("=".to_string()),
        prop::collection::vec(any::<u8>(), 0..6).prop_map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
    ];
    prop_oneof![
        3 => any::<Index>().prop_map(LineOp::Drop),
        2 => any::<Index>().prop_map(LineOp::Duplicate),
        2 => (any::<Index>(), rank).prop_map(|(i, r)| LineOp::Rank(i, r)),
        2 => (any::<Index>(), token).prop_map(|(i, t)| LineOp::Token(i, t)),
        1 => (any::<Index>(), ".{0,12}").prop_map(|(i, s)| LineOp::Raw(i, s)),
    ]
}

fn apply_lines(text: &str, ops: &[LineOp]) -> Vec<u8> {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    for op in ops {
        let n = lines.len();
        if n == 0 {
            break;
        }
        match op {
            LineOp::Drop(i) => {
                lines.remove(i.index(n));
            }
            LineOp::Duplicate(i) => {
                let l = lines[i.index(n)].clone();
                lines.push(l);
            }
            LineOp::Rank(i, r) | LineOp::Token(i, r) => {
                let l = &mut lines[i.index(n)];
                let (tok, rank) = l.split_once(' ').unwrap_or((l.as_str(), ""));
                *l = if matches!(op, LineOp::Rank(..)) { format!("{tok} {r}") } else { format!("{r} {rank}") };
            }
            LineOp::Raw(i, s) => lines[i.index(n)] = s.clone(),
        }
    }
    (lines.join("\n") + "\n").into_bytes()
}

#[test]
fn fuzz_tokenizer_load() {
    let dir = tempfile::tempdir().unwrap();
    let model = std::fs::read_to_string(fixture_hf().join("tiktoken.model")).unwrap();
    let config: Value =
        serde_json::from_slice(&std::fs::read(fixture_hf().join("tokenizer_config.json")).unwrap()).unwrap();
    let generation: Value =
        serde_json::from_slice(&std::fs::read(fixture_hf().join("generation_config.json")).unwrap()).unwrap();
    const KEYS: &[&str] = &["added_tokens_decoder", "content", "special", "eos_token_id", "300", "302", "0"];
    const STRINGS: &[&str] = &["", "<|open|>", "[EOS]", "a", " ", "<|", "|>", "\\", "(", "*", "\u{0}"];
    let values = prop_oneof![2 => interesting_number(), 3 => json_value(KEYS, STRINGS)].boxed();
    let json_file = move |real: Value| {
        let values = values.clone();
        prop_oneof![
            4 => prop::collection::vec(json_op(values), 0..4).prop_map(move |ops| {
                let mut v = real.clone();
                apply_json(&mut v, &ops);
                Some(v.to_string().into_bytes())
            }),
            1 => Just(None),
            1 => prop::collection::vec(any::<u8>(), 0..32).prop_map(Some),
        ]
    };
    let model_file = prop_oneof![
        6 => prop::collection::vec(line_op(), 0..4).prop_map(move |ops| Some(apply_lines(&model, &ops))),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Some),
        1 => Just(None),
    ];
    let strategy = (model_file, json_file(config), json_file(generation))
        .prop_map(|(model, config, generation)| TokFiles { model, config, generation });
    fuzz(
        "tokenizer_load",
        150,
        strategy,
        |f| check_load(dir.path(), f),
        |b| check_load(dir.path(), &tok_files_from_corpus(b)),
    );
}

// ---------------------------------------------------------------------------------------------
// encode

/// Text built from runs of pieces that stress the pre-tokeniser (long runs of one class,
/// special-token strings, split characters).
fn runs() -> impl Strategy<Value = String> {
    const PIECES: &[&str] = &[
        " ", "\n", "\r\n", "\t", "a", "A", "é", "中", "🦀", "1", "'s", ".", "<|open|>", "<|sep|>", "[EOS]", "<|",
        "\u{301}", "\u{1c}", "\u{a0}", "ab ", " \n",
    ];
    // Past the tokenizer's 25,000-character cut, in up to three runs.
    prop::collection::vec((prop::sample::select(PIECES), 1..30_000usize), 1..4)
        .prop_map(|rs| rs.into_iter().map(|(p, n)| p.repeat(n)).collect())
}

fn check_encode(text: &str) -> Result<(), TestCaseError> {
    bounded(|| round_trip(&TOKENIZER, text))
}

#[test]
fn fuzz_tokenizer_encode() {
    let strategy = prop_oneof![
        4 => any::<String>(),
        4 => "(\\PC|<\\|open\\|>|<\\|sep\\|>|\\[EOS\\]| |\n){0,64}",
        1 => runs(),
    ];
    fuzz("tokenizer_encode", 200, strategy, |s| check_encode(s), |b| check_encode(&String::from_utf8_lossy(b)));
}

// ---------------------------------------------------------------------------------------------
// decode, token bytes, and the parser of model output

/// Decode `ids` every way, stream their bytes through the UTF-8 decoder, and parse them as
/// model output: parsing must not panic and every call's argument fragments must concatenate
/// to a JSON object.
fn check_ids(ids: &[u32]) -> Result<(), TestCaseError> {
    bounded(|| {
        let tok = &*TOKENIZER;
        let bytes = tok.decode_bytes(ids);
        assert_eq!(tok.decode(ids), String::from_utf8_lossy(&bytes));
        let mut d = Utf8Decoder::default();
        let mut streamed = String::new();
        for &id in ids {
            let _ = tok.is_special(id);
            streamed.push_str(&d.push(tok.token_bytes(id)));
        }
        streamed.push_str(&d.flush());
        assert_eq!(streamed, String::from_utf8_lossy(&bytes), "streamed decoding differs from decoding at once");
        for in_reasoning in [true, false] {
            let markers = Markers::from_tokenizer(tok).expect("fixture markers");
            let mut p = OutputParser::new(markers, in_reasoning);
            let mut events = Vec::new();
            for &id in ids {
                p.push(id, tok.token_bytes(id), &mut events);
            }
            p.finish(&mut events);
            let mut args: Vec<String> = Vec::new();
            for e in &events {
                match e {
                    OutputEvent::ToolCallBegin { index, .. } => {
                        assert_eq!(*index, args.len(), "tool calls are numbered in order");
                        args.push(String::new());
                    }
                    OutputEvent::ToolCallArguments { index, json } => args[*index].push_str(json),
                    _ => {}
                }
            }
            for (i, a) in args.iter().enumerate() {
                let a = if a.is_empty() { "{}" } else { a };
                match serde_json::from_str::<Value>(a) {
                    Ok(Value::Object(_)) => {}
                    other => panic!("call {i}: arguments {a:?} are not a JSON object: {other:?}"),
                }
            }
        }
    })
}

/// Token ids as model output would have them: mostly markers and the pieces of XTML headers.
fn output_ids() -> impl Strategy<Value = Vec<u32>> {
    let tok = &*TOKENIZER;
    let mut words: Vec<u32> = Vec::new();
    for w in [
        "think",
        "response",
        "tools",
        "call",
        "argument",
        "json",
        "message",
        " tool=\"f\"",
        " key=\"k\"",
        " type=\"",
        "string",
        "number",
        "object",
        "boolean",
        "null",
        "array",
        "\"",
        " index=\"1\"",
        "{\"a\": 1}",
        "[1,",
        "é",
    ] {
        words.extend(tok.encode_ordinary(w));
    }
    let specials: Vec<u32> = tok.specials.values().copied().collect();
    let id = prop_oneof![
        4 => prop::sample::select(specials),
        6 => prop::sample::select(words),
        2 => 0u32..330,
        1 => any::<u32>(),
    ];
    prop::collection::vec(id, 0..160)
}

#[test]
fn fuzz_token_ids() {
    let strategy = prop_oneof![1 => prop::collection::vec(any::<u32>(), 0..64), 4 => output_ids()];
    // A corpus file is a JSON array of ids, or `{"text": ...}`: model output written as text,
    // special-token strings becoming their ids.
    fuzz(
        "token_ids",
        2000,
        strategy,
        |ids| check_ids(ids),
        |b| {
            let v: Value = serde_json::from_slice(b).expect("token_ids corpus files are JSON");
            let ids: Vec<u32> = match v.get("text").and_then(Value::as_str) {
                Some(text) => TOKENIZER.encode(text),
                None => serde_json::from_value(v).expect("an array of ids, or {\"text\": ...}"),
            };
            check_ids(&ids)
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Chat rendering

/// Render a conversation; when it renders, its tokens must decode to its text.
fn check_render(conv: &Conversation, opts: RenderOptions) -> Result<(), TestCaseError> {
    bounded(|| {
        let Ok(segs) = render(conv, opts) else { return };
        let ids = to_tokens(&segs, &TOKENIZER).expect("every marker is a special token of the fixture");
        assert_eq!(TOKENIZER.decode(&ids), to_text(&segs), "a rendered prompt must decode to its text");
    })
}

/// A corpus file: `{"messages": [{"role", "content": [..], "name", "reasoning", "tool_calls":
/// [{"id", "name", "arguments"}], "tool_call_id", "tools"}], "tools", "tool_choice": "auto" |
/// "none" | "required" | {"function": name}, "reasoning_effort", "response_format":
/// {"schema": ..} | "object", "thinking", "add_generation_prompt"}`.
fn conversation_from_corpus(bytes: &[u8]) -> (Conversation, RenderOptions) {
    let v: Value = serde_json::from_slice(bytes).expect("chat_render corpus files are JSON");
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(String::from);
    let messages = v["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| Message {
            role: match m["role"].as_str() {
                Some("system") => Role::System,
                Some("assistant") => Role::Assistant,
                Some("tool") => Role::Tool,
                _ => Role::User,
            },
            content: m["content"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect(),
            reasoning: s(m, "reasoning"),
            tool_calls: m["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| ToolCall {
                    id: s(c, "id").unwrap_or_default(),
                    name: s(c, "name").unwrap_or_default(),
                    arguments: s(c, "arguments").unwrap_or_default(),
                })
                .collect(),
            tool_call_id: s(m, "tool_call_id"),
            name: s(m, "name"),
            tools: m["tools"].as_array().cloned().unwrap_or_default(),
        })
        .collect();
    let tool_choice = match &v["tool_choice"] {
        Value::String(c) if c == "none" => ToolChoice::None,
        Value::String(c) if c == "required" => ToolChoice::Required,
        Value::Object(o) => ToolChoice::Function(o["function"].as_str().unwrap_or_default().into()),
        _ => ToolChoice::Auto,
    };
    let response_format = match &v["response_format"] {
        Value::Object(o) => Some(o.get("schema").cloned()),
        Value::String(_) => Some(None),
        _ => None,
    };
    let conv = Conversation {
        messages,
        tools: v["tools"].as_array().cloned().unwrap_or_default(),
        tool_choice,
        reasoning_effort: s(&v, "reasoning_effort"),
        response_format,
    };
    let opts = RenderOptions {
        thinking: v["thinking"].as_bool().unwrap_or(true),
        add_generation_prompt: v["add_generation_prompt"].as_bool().unwrap_or(true),
    };
    (conv, opts)
}

const CHAT_KEYS: &[&str] = &["type", "function", "name", "parameters", "description", "properties", "required"];
const CHAT_STRINGS: &[&str] = &[
    "",
    "get_weather",
    "object",
    "string",
    "call_1",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "\"&amp;\"",
    "&",
    "\"",
    "{\"a\": 1}",
    "[1, 2]",
    "null",
    "not json {",
    "  ",
    "\n",
    "é中🦀",
];

fn text() -> impl Strategy<Value = String> {
    prop_oneof![3 => prop::sample::select(CHAT_STRINGS).prop_map(String::from), 2 => any::<String>()]
}

fn message() -> impl Strategy<Value = Message> {
    let role = prop::sample::select(vec![Role::System, Role::User, Role::Assistant, Role::Tool]);
    let args = prop_oneof![
        2 => json_value(CHAT_KEYS, CHAT_STRINGS).prop_map(|v| v.to_string()),
        1 => text(),
    ];
    let call = (text(), text(), args).prop_map(|(id, name, arguments)| ToolCall { id, name, arguments });
    (
        role,
        prop::collection::vec(text(), 0..3),
        prop::option::of(text()),
        prop::collection::vec(call, 0..3),
        prop::option::of(text()),
        prop::option::of(text()),
        prop::collection::vec(json_value(CHAT_KEYS, CHAT_STRINGS), 0..2),
    )
        .prop_map(|(role, content, reasoning, tool_calls, tool_call_id, name, tools)| Message {
            role,
            content,
            reasoning,
            tool_calls,
            tool_call_id,
            name,
            tools,
        })
}

fn conversation() -> impl Strategy<Value = (Conversation, RenderOptions)> {
    let choice = prop_oneof![
        Just(ToolChoice::Auto),
        Just(ToolChoice::None),
        Just(ToolChoice::Required),
        text().prop_map(ToolChoice::Function),
    ];
    let effort = prop::option::of(prop_oneof![
        prop::sample::select(vec!["low", "medium", "high", "max", "none", "minimal", ""]).prop_map(String::from),
        text(),
    ]);
    let format = prop::option::of(prop::option::of(json_value(CHAT_KEYS, CHAT_STRINGS)));
    (
        prop::collection::vec(message(), 0..6),
        prop::collection::vec(json_value(CHAT_KEYS, CHAT_STRINGS), 0..3),
        choice,
        effort,
        format,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(messages, tools, tool_choice, reasoning_effort, response_format, thinking, prompt)| {
            let conv = Conversation { messages, tools, tool_choice, reasoning_effort, response_format };
            (conv, RenderOptions { thinking, add_generation_prompt: prompt })
        })
}

#[test]
fn fuzz_chat_render() {
    fuzz(
        "chat_render",
        300,
        conversation(),
        |(c, o)| check_render(c, *o),
        |b| {
            let (c, o) = conversation_from_corpus(b);
            check_render(&c, o)
        },
    );
}
