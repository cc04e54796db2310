//! A conversation into prompt tokens, with K3's chat encoding.

use deltafin_text::chat::encode::{RenderOptions, render, to_tokens};
use deltafin_text::chat::{Conversation, ToolChoice};

use crate::error::ApiError;
use crate::state::Shared;

/// Whether the model reasons for this conversation (`reasoning_effort: "none"` turns it off).
pub fn thinking(conv: &Conversation) -> bool {
    conv.reasoning_effort.as_deref() != Some("none")
}

/// Prompt tokens for a conversation, ending with the assistant's generation prompt.
pub fn encode_chat(state: &Shared, conv: &Conversation) -> Result<Vec<u32>, ApiError> {
    let mut conv = narrow_tools(conv)?;
    let thinking = thinking(&conv);
    if !thinking {
        conv.reasoning_effort = None;
    }
    let segs = render(&conv, RenderOptions { thinking, add_generation_prompt: true })
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    to_tokens(&segs, &state.tokenizer).map_err(|e| ApiError::internal(e.to_string()))
}

/// K3's chat format has no "call this function" instruction; naming a function is served as
/// "a call is required" with only that function declared.
fn narrow_tools(conv: &Conversation) -> Result<Conversation, ApiError> {
    let ToolChoice::Function(name) = &conv.tool_choice else { return Ok(conv.clone()) };
    let named = |t: &&serde_json::Value| {
        t.get("function").and_then(|f| f.get("name")).and_then(|n| n.as_str()) == Some(name.as_str())
    };
    let Some(tool) = conv.tools.iter().find(named) else {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice names '{name}', which is not among the tools"),
        ));
    };
    let mut c = conv.clone();
    c.tools = vec![tool.clone()];
    c.tool_choice = ToolChoice::Required;
    Ok(c)
}
