//! A conversation into prompt tokens, with K3's chat encoding.

use deltafin_engine::chat::Conversation;
use deltafin_engine::chat::encode::{RenderOptions, render, to_tokens};

use crate::error::ApiError;
use crate::state::Shared;

/// Whether the model reasons for this conversation (`reasoning_effort: "none"` turns it off).
pub fn thinking(conv: &Conversation) -> bool {
    conv.reasoning_effort.as_deref() != Some("none")
}

/// Prompt tokens for a conversation, ending with the assistant's generation prompt.
pub fn encode_chat(state: &Shared, conv: &Conversation) -> Result<Vec<u32>, ApiError> {
    let mut conv = conv.clone();
    let thinking = thinking(&conv);
    if !thinking {
        conv.reasoning_effort = None;
    }
    let segs = render(&conv, RenderOptions { thinking, add_generation_prompt: true })
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    to_tokens(&segs, &state.tokenizer).map_err(|e| ApiError::internal(e.to_string()))
}
