//! A conversation into prompt tokens, with K3's chat encoding.

use deltafin_text::chat::encode::{RenderOptions, render, to_tokens};
use deltafin_text::chat::{Conversation, Role, ToolChoice};

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

/// How many leading tokens of `prompt` (the conversation's, from [`encode_chat`]) are its tools
/// and leading system messages: what other requests of the same agent or application share.
/// `None` when there are none, or they are the whole prompt.
pub fn shared_prefix(state: &Shared, conv: &Conversation, prompt: &[u32]) -> Option<usize> {
    let leading = conv.messages.iter().take_while(|m| m.role == Role::System).count();
    if leading == 0 && conv.tools.is_empty() {
        return None;
    }
    let mut head = narrow_tools(conv).ok()?;
    let thinking = thinking(&head);
    if !thinking {
        head.reasoning_effort = None;
    }
    head.messages.truncate(leading);
    let segs = render(&head, RenderOptions { thinking, add_generation_prompt: false }).ok()?;
    let tokens = to_tokens(&segs, &state.tokenizer).ok()?;
    // Rendered alone it must be the start of the whole prompt, token for token.
    (!tokens.is_empty() && tokens.len() < prompt.len() && prompt.starts_with(&tokens)).then_some(tokens.len())
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
