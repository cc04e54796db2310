//! The K3 chat encoding against golden renderings (`fixtures/chat-golden/k3_chat.json`).
//!
//! Source of the goldens: llama.cpp's `models/templates/Kimi-K3.jinja` rendered with jinja2
//! 3.1.6 the way Hugging Face renders chat templates (`rendered`), and the reference Python
//! encoder `encoding_k3.py` (`rendered_encoder`, `encoder_segments`), both by
//! `tools/make_chat_golden.py`. Where the two agree the test checks that string; where they
//! differ we follow the encoder, except for effort `medium`, which the encoder refuses and we
//! accept as the template does. Requests go through the server's own request parsing, so this
//! also tests how OpenAI-shaped messages reach the encoder.

use std::path::PathBuf;

use deltafin_server::openai::{parse_messages, parse_tool_choice, parse_tools};
use deltafin_text::chat::Conversation;
use deltafin_text::chat::encode::{RenderOptions, render, to_text};
use serde_json::Value;

fn golden() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/chat-golden/k3_chat.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Cases for features the server refuses on purpose (with the reason).
const REFUSED: &[(&str, &str)] = &[("content_array_with_image", "image content: this server takes text only")];

fn conversation(case: &Value) -> Result<(Conversation, RenderOptions), String> {
    let messages = parse_messages(case.get("messages")).map_err(|e| e.message)?;
    let tools = parse_tools(case.get("tools")).map_err(|e| e.message)?;
    let tool_choice = parse_tool_choice(case.get("tool_choice")).map_err(|e| e.message)?;
    let response_format = match case.get("response_format").filter(|v| !v.is_null()) {
        None => None,
        Some(rf) if rf["type"] == "json_object" => Some(None),
        Some(rf) => Some(Some(rf["json_schema"]["schema"].clone())),
    };
    let conv = Conversation {
        messages,
        tools,
        tool_choice,
        reasoning_effort: case["reasoning_effort"].as_str().map(String::from),
        response_format,
    };
    let opts = RenderOptions {
        thinking: case["thinking"].as_bool().unwrap_or(true),
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(true),
    };
    Ok((conv, opts))
}

#[test]
fn renders_every_golden_case() {
    let g = golden();
    let source = g["source"].as_str().unwrap();
    assert!(source.contains("Kimi-K3.jinja"), "{source}");
    let cases = g["cases"].as_array().unwrap();
    assert!(cases.len() >= 25);
    let mut checked = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let conv = conversation(case);
        if let Some((_, why)) = REFUSED.iter().find(|(n, _)| *n == name) {
            assert!(conv.is_err(), "{name} should be refused ({why})");
            continue;
        }
        let (conv, opts) = conv.unwrap_or_else(|e| panic!("{name}: {e}"));
        let segs = render(&conv, opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let text = to_text(&segs);
        let agree = case["matches_encoder"].as_bool().unwrap_or(true);
        let expected = if agree || case["rendered_encoder"].is_null() {
            case["rendered"].as_str().unwrap()
        } else {
            case["rendered_encoder"].as_str().unwrap()
        };
        assert_eq!(text, expected, "case {name}");
        // The same segment boundaries as the encoder: they decide the token ids.
        if let Some(ref_segs) = case["encoder_segments"].as_array() {
            let ours: Vec<(String, bool)> = segs.iter().map(|s| (s.text.clone(), s.special)).collect();
            let theirs: Vec<(String, bool)> =
                ref_segs.iter().map(|s| (s[0].as_str().unwrap().to_string(), s[1].as_bool().unwrap())).collect();
            assert_eq!(ours, theirs, "segments of case {name}");
        }
        checked += 1;
    }
    assert_eq!(checked + REFUSED.len(), cases.len());
}

#[test]
fn unknown_effort_is_an_error_not_a_silent_default() {
    let case = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"});
    let (conv, opts) = conversation(&case).unwrap();
    assert!(render(&conv, opts).is_err());
}
