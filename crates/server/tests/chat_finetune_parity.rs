//! The demo model's chat fine-tuning set is rendered by Python (`tools/demo/chat_data.py`); the
//! model must see there exactly the token ids a chat request puts before it here. The samples
//! (`models/k3-demo/training/chat-samples.json`: whole conversations, some with a tool call and
//! its result, in the shape a chat completions request carries them) go through the server's own
//! request parsing, K3's encoder and the bundle's tokenizer, and must give the recorded ids.

use std::path::PathBuf;

use deltafin_server::openai::{parse_messages, parse_tools};
use deltafin_text::chat::encode::{RenderOptions, render, to_tokens};
use deltafin_text::chat::{Conversation, ToolChoice};
use deltafin_text::tokenizer::Tokenizer;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn fine_tuning_conversations_tokenize_as_the_server_does() {
    let samples: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("models/k3-demo/training/chat-samples.json")).unwrap(),
    )
    .unwrap();
    let tok = Tokenizer::load(&repo().join("models/k3-demo/hf")).unwrap();
    let convs = samples["conversations"].as_array().unwrap();
    assert!(convs.len() >= 6, "{} samples", convs.len());
    let mut with_tools = 0;
    for (i, c) in convs.iter().enumerate() {
        let conv = Conversation {
            messages: parse_messages(c.get("messages")).unwrap_or_else(|e| panic!("sample {i}: {}", e.message)),
            tools: parse_tools(c.get("tools")).unwrap_or_else(|e| panic!("sample {i}: {}", e.message)),
            tool_choice: ToolChoice::Auto,
            reasoning_effort: c["reasoning_effort"].as_str().map(String::from),
            response_format: None,
        };
        with_tools += usize::from(!conv.tools.is_empty() && conv.messages.iter().any(|m| !m.tool_calls.is_empty()));
        let segs = render(&conv, RenderOptions { thinking: true, add_generation_prompt: false }).unwrap();
        let ids = to_tokens(&segs, &tok).unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        if ids != want {
            let at = ids.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(ids.len().min(want.len()));
            panic!(
                "sample {i}: ids differ at {at} (ours {} tokens, Python's {}): ours {:?} .. Python's {:?}",
                ids.len(),
                want.len(),
                &ids[at.saturating_sub(3)..(at + 5).min(ids.len())],
                &want[at.saturating_sub(3)..(at + 5).min(want.len())]
            );
        }
    }
    assert!(with_tools >= 2, "samples with a tool call and its result: {with_tools}");
}
