//! Fuzzing the server's request parsing: OpenAI chat and completion bodies, Anthropic Messages
//! bodies, and raw bodies sent to the endpoints that answer without generating (`/tokenize`,
//! `/detokenize`, `/v1/messages/count_tokens`). Bodies are arbitrary JSON trees over the keys
//! and values the parsers look at, and mutations of the golden chat requests; whatever parses is
//! rendered with K3's chat encoding and tokenised with the fixture tokenizer. Nothing may panic
//! (over HTTP: no 500), allocate without bound, or accept a prompt that does not fit the
//! context.
//!
//! The state is a real one: a store converted from the tiny fixture, its tokenizer, and an
//! engine thread with the model loaded (no request here reaches it).
//!
//! Harness, corpus and case counts: see `fuzzkit` (`DELTAFIN_FUZZ_CASES=N` to run long).

#[path = "../../store/tests/fuzzkit/mod.rs"]
mod fuzzkit;

use std::path::Path;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use deltafin_engine::session::{RunOptions, Session};
use deltafin_server::metrics::Metrics;
use deltafin_server::state::{AppState, ModelInfo, Shared};
use deltafin_server::worker::{self, Admission, EngineOptions};
use deltafin_server::{anthropic, openai, routes};
use deltafin_store::Store;
use deltafin_store::convert::{ConvertOptions, convert};
use deltafin_text::tokenizer::Tokenizer;
use fuzzkit::*;
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt as _;

#[global_allocator]
static ALLOC: CapAlloc = CapAlloc;

const MODEL: &str = "k3-tiny";
const CONTEXT: usize = 4096;

struct Served {
    state: Shared,
    _store: tempfile::TempDir,
}

static SERVED: LazyLock<Served> = LazyLock::new(|| {
    let dir = tempfile::tempdir().unwrap();
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/k3-tiny/hf");
    convert(&hf, dir.path(), &ConvertOptions { experts: deltafin_store::ExpertLayout::Pack, ..Default::default() })
        .unwrap();
    let store = Store::open(dir.path(), None).unwrap();
    let tokenizer = Arc::new(Tokenizer::load(dir.path()).unwrap());
    let vocab = store.manifest.config.vocab_size;
    let run = RunOptions {
        memory_budget: Some(2 << 30),
        context_tokens: CONTEXT,
        direct: false,
        prefetch: false,
        ..Default::default()
    };
    let metrics = Arc::new(Metrics::default());
    let admission = Admission::new(4);
    let (engine, loaded) = worker::spawn(
        move || Session::open(&store, &run),
        tokenizer.clone(),
        admission.clone(),
        metrics.clone(),
        EngineOptions {
            max_batch: 1,
            prefix_cache: false,
            state: None,
            #[cfg(feature = "test-instruments")]
            step_delay: Duration::ZERO,
            #[cfg(feature = "test-instruments")]
            inject_faults: false,
            #[cfg(feature = "test-instruments")]
            load_delay: Duration::ZERO,
        },
    )
    .unwrap();
    loaded.blocking_recv().expect("the engine thread answered").expect("the model opened");
    let state = Arc::new(AppState {
        model: ModelInfo {
            id: MODEL.into(),
            aliases: Vec::new(),
            created: 0,
            context: CONTEXT,
            vocab,
            numerics: "exact".into(),
            approx: false,
            device: "cpu".into(),
        },
        tokenizer,
        metrics,
        admission,
        engine,
        api_key: None,
        queue: 4,
        max_body_bytes: 1 << 20,
        #[cfg(feature = "test-instruments")]
        script: Vec::new(),
        keep_alive: Duration::from_secs(15),
        tokenizer_gate: Default::default(),
        readiness: deltafin_server::state::Readiness::new(None),
        responses: Default::default(),
    });
    state.readiness.set_ready();
    Served { state, _store: dir }
});

/// A prepared request must fit the context and use only the vocabulary.
fn check_prompt(prompt: &[u32], max_tokens: usize) {
    let vocab = SERVED.state.model.vocab as u32;
    assert!(!prompt.is_empty() && prompt.len() < CONTEXT, "prompt of {} tokens", prompt.len());
    assert!(max_tokens >= 1 && prompt.len() + max_tokens <= CONTEXT, "max_tokens {max_tokens}");
    assert!(prompt.iter().all(|&t| t < vocab), "a prompt id outside the vocabulary");
}

// ---------------------------------------------------------------------------------------------
// Request bodies

const KEYS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "name",
    "tool_calls",
    "tool_call_id",
    "function",
    "arguments",
    "id",
    "tools",
    "parameters",
    "tool_choice",
    "reasoning_content",
    "reasoning",
    "reasoning_effort",
    "response_format",
    "json_schema",
    "schema",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "include_usage",
    "prompt",
    "echo",
    "suffix",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "system",
    "input",
    "input_schema",
    "tool_use_id",
    "is_error",
    "thinking",
    "output_config",
    "effort",
    "stop_sequences",
    "description",
    "tokens",
];

const STRINGS: &[&str] = &[
    MODEL,
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "text",
    "input_text",
    "image_url",
    "function",
    "auto",
    "none",
    "required",
    "any",
    "json_object",
    "json_schema",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "enabled",
    "disabled",
    "adaptive",
    "low",
    "medium",
    "high",
    "max",
    "minimal",
    "get_weather",
    "call_1",
    "{\"city\": \"Paris\"}",
    "[1, 2]",
    "not json {",
    "<|open|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "[EOS]",
    "",
    " ",
    "é中🦀",
];

/// A message as a client could send it, in either wire format.
fn message() -> impl Strategy<Value = Value> {
    let text = prop_oneof![4 => prop::sample::select(STRINGS).prop_map(Value::from), 1 => any::<String>().prop_map(Value::from)];
    let part = prop_oneof![
        3 => text.clone().prop_map(|t| json!({"type": "text", "text": t})),
        1 => text.clone(),
        1 => json_value(KEYS, STRINGS),
    ];
    let content = prop_oneof![
        3 => text.clone(),
        3 => prop::collection::vec(part, 0..4).prop_map(Value::Array),
        1 => json_value(KEYS, STRINGS),
    ];
    let args = prop_oneof![text.clone(), json_value(KEYS, STRINGS)];
    let call = (text.clone(), text.clone(), args)
        .prop_map(|(id, name, a)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": a}}));
    (
        prop::sample::select(vec!["system", "developer", "user", "assistant", "tool", "other"]),
        content,
        prop::collection::vec(call, 0..3),
        prop::option::of(text.clone()),
        prop::option::of(text),
        prop::collection::vec((prop::sample::select(KEYS), json_value(KEYS, STRINGS)), 0..2),
    )
        .prop_map(|(role, content, calls, name, call_id, extra)| {
            let mut m = json!({"role": role, "content": content});
            if !calls.is_empty() {
                m["tool_calls"] = Value::Array(calls);
            }
            if let Some(n) = name {
                m["name"] = n;
            }
            if let Some(id) = call_id {
                m["tool_call_id"] = id;
            }
            for (k, v) in extra {
                m[k] = v;
            }
            m
        })
}

/// A body: a plausible request with some fields replaced or added at random.
fn body() -> impl Strategy<Value = Value> {
    let fields = prop::collection::vec((prop::sample::select(KEYS), json_value(KEYS, STRINGS)), 0..5);
    (prop::collection::vec(message(), 0..5), fields, prop::sample::select(vec![MODEL, MODEL, MODEL, "other"])).prop_map(
        |(messages, fields, model)| {
            let mut b = json!({"model": model, "messages": messages, "max_tokens": 16});
            for (k, v) in fields {
                b[k] = v;
            }
            b
        },
    )
}

/// The golden chat requests, as bodies to mutate.
static GOLDEN: LazyLock<Vec<Value>> = LazyLock::new(|| {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/chat-golden/k3_chat.json");
    let g: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let mut b = json!({"model": MODEL});
            for k in ["messages", "tools", "tool_choice", "reasoning_effort", "response_format"] {
                if !c[k].is_null() {
                    b[k] = c[k].clone();
                }
            }
            b
        })
        .collect()
});

fn bodies() -> impl Strategy<Value = Value> {
    let values = prop_oneof![1 => interesting_number(), 3 => json_value(KEYS, STRINGS)].boxed();
    let golden = (0..GOLDEN.len(), prop::collection::vec(json_op(values), 0..4)).prop_map(|(i, ops)| {
        let mut b = GOLDEN[i].clone();
        apply_json(&mut b, &ops);
        b
    });
    prop_oneof![4 => body(), 4 => golden, 1 => json_value(KEYS, STRINGS)]
}

/// Bodies as a corpus file holds them: JSON, or anything else as a string value.
fn body_from_corpus(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
}

fn check_openai_chat(body: &Value) -> Result<(), TestCaseError> {
    bounded(|| {
        let s = &SERVED.state;
        let tools = body.get("tools");
        let _ = (openai::parse_tools(tools), openai::parse_tool_choice(body.get("tool_choice")));
        let _ = openai::parse_messages(body.get("messages"));
        if let Ok(p) = openai::prepare_chat(s, body) {
            check_prompt(&p.req.prompt, p.req.max_tokens);
        }
    })
}

#[test]
fn fuzz_openai_chat() {
    fuzz("openai_chat", 300, bodies(), check_openai_chat, |b| check_openai_chat(&body_from_corpus(b)));
}

/// Completion bodies: a chat body's fields, with `prompt` as text, ids or batches.
fn completion_bodies() -> impl Strategy<Value = Value> {
    let ids = prop::collection::vec(prop_oneof![0u64..400, interesting_u64()], 0..8);
    let prompt = prop_oneof![
        prop::sample::select(STRINGS).prop_map(Value::from),
        any::<String>().prop_map(Value::from),
        ids.clone().prop_map(|v| json!(v)),
        ids.prop_map(|v| json!([v])),
        prop::collection::vec(prop::sample::select(STRINGS), 0..3).prop_map(|v| json!(v)),
        json_value(KEYS, STRINGS),
    ];
    (bodies(), prompt).prop_map(|(mut b, p)| {
        if let Some(o) = b.as_object_mut() {
            o.insert("prompt".into(), p);
        }
        b
    })
}

fn check_openai_completion(body: &Value) -> Result<(), TestCaseError> {
    bounded(|| {
        if let Ok(p) = openai::prepare_completion(&SERVED.state, body) {
            check_prompt(&p.req.prompt, p.req.max_tokens);
        }
    })
}

#[test]
fn fuzz_openai_completion() {
    fuzz("openai_completion", 300, completion_bodies(), check_openai_completion, |b| {
        check_openai_completion(&body_from_corpus(b))
    });
}

/// Anthropic bodies: messages of content blocks, a system prompt, tools with input schemas.
fn anthropic_bodies() -> impl Strategy<Value = Value> {
    let text = prop_oneof![4 => prop::sample::select(STRINGS).prop_map(Value::from), 1 => any::<String>().prop_map(Value::from)];
    let block = prop_oneof![
        3 => text.clone().prop_map(|t| json!({"type": "text", "text": t})),
        1 => text.clone().prop_map(|t| json!({"type": "thinking", "thinking": t})),
        1 => Just(json!({"type": "redacted_thinking", "data": "x"})),
        2 => (text.clone(), text.clone(), json_value(KEYS, STRINGS))
            .prop_map(|(id, name, input)| json!({"type": "tool_use", "id": id, "name": name, "input": input})),
        2 => (text.clone(), json_value(KEYS, STRINGS), any::<bool>())
            .prop_map(|(id, c, e)| json!({"type": "tool_result", "tool_use_id": id, "content": c, "is_error": e})),
        1 => json_value(KEYS, STRINGS),
    ];
    let content = prop_oneof![2 => text.clone(), 3 => prop::collection::vec(block, 0..4).prop_map(Value::Array)];
    let message = (prop::sample::select(vec!["user", "assistant", "system"]), content)
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    let tool = (text.clone(), json_value(KEYS, STRINGS))
        .prop_map(|(name, schema)| json!({"name": name, "description": "d", "input_schema": schema}));
    let fields = prop::collection::vec((prop::sample::select(KEYS), json_value(KEYS, STRINGS)), 0..4);
    (prop::collection::vec(message, 0..5), prop::collection::vec(tool, 0..2), prop::option::of(text), fields).prop_map(
        |(messages, tools, system, fields)| {
            let mut b = json!({"model": MODEL, "max_tokens": 32000, "messages": messages});
            if !tools.is_empty() {
                b["tools"] = Value::Array(tools);
            }
            if let Some(s) = system {
                b["system"] = s;
            }
            for (k, v) in fields {
                b[k] = v;
            }
            b
        },
    )
}

fn check_anthropic(body: &Value) -> Result<(), TestCaseError> {
    bounded(|| {
        let s = &SERVED.state;
        let _ = anthropic::prompt_tokens(s, body);
        // `prepare` keeps its request private: what it accepted is checked over HTTP below.
        let _ = anthropic::prepare(s, body);
    })
}

#[test]
fn fuzz_anthropic() {
    let strategy = prop_oneof![4 => anthropic_bodies(), 1 => bodies()];
    fuzz("anthropic", 300, strategy, check_anthropic, |b| check_anthropic(&body_from_corpus(b)));
}

/// Responses bodies: `input` as text or items of every kind, flat tools, the other fields.
fn responses_bodies() -> impl Strategy<Value = Value> {
    let text = prop_oneof![4 => prop::sample::select(STRINGS).prop_map(Value::from), 1 => any::<String>().prop_map(Value::from)];
    let item = prop_oneof![
        3 => (prop::sample::select(vec!["user", "assistant", "system", "developer", "tool"]), text.clone())
            .prop_map(|(role, t)| json!({"role": role, "content": t})),
        2 => (prop::sample::select(vec!["input_text", "output_text", "input_image"]), text.clone())
            .prop_map(|(k, t)| json!({"type": "message", "role": "user", "content": [{"type": k, "text": t}]})),
        2 => (text.clone(), text.clone(), json_value(KEYS, STRINGS))
            .prop_map(|(id, name, args)| json!({"type": "function_call", "call_id": id, "name": name, "arguments": args})),
        2 => (text.clone(), json_value(KEYS, STRINGS))
            .prop_map(|(id, out)| json!({"type": "function_call_output", "call_id": id, "output": out})),
        1 => text.clone().prop_map(|t| json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]})),
        1 => json_value(KEYS, STRINGS),
    ];
    let input = prop_oneof![1 => text.clone(), 3 => prop::collection::vec(item, 0..5).prop_map(Value::Array)];
    let tool = (text.clone(), json_value(KEYS, STRINGS))
        .prop_map(|(name, schema)| json!({"type": "function", "name": name, "parameters": schema}));
    let fields = prop::collection::vec((prop::sample::select(KEYS), json_value(KEYS, STRINGS)), 0..4);
    (input, prop::collection::vec(tool, 0..2), prop::option::of(text), fields).prop_map(
        |(input, tools, instr, fields)| {
            let mut b = json!({"model": MODEL, "input": input, "max_output_tokens": 32000});
            if !tools.is_empty() {
                b["tools"] = Value::Array(tools);
            }
            if let Some(i) = instr {
                b["instructions"] = i;
            }
            for (k, v) in fields {
                b[k] = v;
            }
            b
        },
    )
}

fn check_responses(body: &Value) -> Result<(), TestCaseError> {
    bounded(|| {
        // What it accepted (prompt within the context, ids in the vocabulary) is checked over
        // HTTP by the client tests; here: no panic, no unbounded work.
        let _ = deltafin_server::responses::prepare(&SERVED.state, body);
    })
}

#[test]
fn fuzz_responses() {
    let strategy = prop_oneof![4 => responses_bodies(), 1 => bodies()];
    fuzz("responses", 300, strategy, check_responses, |b| check_responses(&body_from_corpus(b)));
}

// ---------------------------------------------------------------------------------------------
// Raw bodies over HTTP

static RUNTIME: LazyLock<tokio::runtime::Runtime> =
    LazyLock::new(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap());

const PATHS: &[&str] = &["/tokenize", "/detokenize", "/v1/messages/count_tokens"];

/// POST `body` to `path` through the router: any answer but a 500 (a panic while preparing the
/// request) is fine.
fn check_http(path: &str, body: Vec<u8>) -> Result<(), TestCaseError> {
    bounded(|| {
        let app = routes::router(SERVED.state.clone());
        let req = Request::post(path).header("content-type", "application/json").body(Body::from(body)).unwrap();
        let resp = RUNTIME.block_on(app.oneshot(req)).unwrap();
        assert_ne!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR, "{path}: 500");
    })
}

fn http_bodies() -> impl Strategy<Value = (usize, Vec<u8>)> {
    let json_body = prop_oneof![
        3 => bodies(),
        1 => prop::collection::vec(prop_oneof![0u64..400, interesting_u64()], 0..8).prop_map(|t| json!({"tokens": t})),
        1 => any::<String>().prop_map(|p| json!({"prompt": p})),
    ]
    .prop_map(|v| serde_json::to_vec(&v).unwrap());
    let bytes = prop_oneof![
        4 => json_body.clone(),
        1 => prop::collection::vec(any::<u8>(), 0..64),
        2 => (json_body, byte_ops(3)).prop_map(|(mut b, ops)| {
            apply_bytes(&mut b, &ops);
            b
        }),
    ];
    (0..PATHS.len(), bytes)
}

#[test]
fn fuzz_http_bodies() {
    // A corpus file is `{"path": ..., "body": <string sent as is>}` or `{"path": ..., "json": ...}`.
    fuzz(
        "http",
        300,
        http_bodies(),
        |(p, b)| check_http(PATHS[*p], b.clone()),
        |bytes| {
            let v: Value = serde_json::from_slice(bytes).expect("http corpus files are JSON");
            let path = v["path"].as_str().expect("path");
            let body = match (&v["body"], &v["json"]) {
                (Value::String(s), _) => s.clone().into_bytes(),
                (_, j) => serde_json::to_vec(j).unwrap(),
            };
            check_http(path, body)
        },
    );
}
