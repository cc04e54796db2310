//! `generate --chat`: one user message in the model's chat format (as `serve` renders a chat
//! request) and the generated turn split into reasoning, answer and tool calls, as the server
//! splits it.

use anyhow::{Result, anyhow};
use deltafin_text::chat::encode::RenderOptions;
use deltafin_text::chat::parse::{Markers, OutputEvent, OutputParser};
use deltafin_text::chat::{self, Conversation, Message, Role};
use deltafin_text::tokenizer::Tokenizer;

/// `--chat`: the conversation and how it renders.
pub fn chat_conversation(message: &str, system: Option<&str>, effort: &str) -> Result<(Conversation, RenderOptions)> {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(Message::new(Role::System, s));
    }
    messages.push(Message::new(Role::User, message));
    let thinking = effort != "none";
    let conv =
        Conversation { messages, reasoning_effort: thinking.then(|| effort.to_string()), ..Conversation::default() };
    let opts = RenderOptions { thinking, add_generation_prompt: true };
    // Refuse an unknown effort now, before minutes of loading.
    chat::encode::render(&conv, opts).map_err(|e| anyhow!("{e}"))?;
    Ok((conv, opts))
}

pub fn chat_prompt(conv: &Conversation, opts: RenderOptions, tok: &Tokenizer) -> Result<Vec<u32>> {
    let segs = chat::encode::render(conv, opts).map_err(|e| anyhow!("{e}"))?;
    chat::encode::to_tokens(&segs, tok).map_err(|e| anyhow!("{e}"))
}

/// The generated assistant turn, split as the server splits it.
pub struct ChatTurn {
    pub reasoning: String,
    pub content: String,
    /// (name, arguments JSON) per call.
    pub tool_calls: Vec<(String, String)>,
}

impl ChatTurn {
    pub fn shown(&self) -> String {
        let mut out = String::new();
        if !self.reasoning.trim().is_empty() {
            out.push_str(&format!("[thinking] {}\n\n", self.reasoning.trim()));
        }
        out.push_str(self.content.trim());
        for (name, args) in &self.tool_calls {
            out.push_str(&format!("\n[tool call] {name}({args})"));
        }
        out
    }
}

pub fn chat_turn(tok: &Tokenizer, thinking: bool, tokens: &[u32]) -> ChatTurn {
    let mut turn = ChatTurn { reasoning: String::new(), content: String::new(), tool_calls: Vec::new() };
    let Some(markers) = Markers::from_tokenizer(tok) else {
        turn.content = tok.decode(tokens);
        return turn;
    };
    let mut parser = OutputParser::new(markers, thinking);
    let mut events = Vec::new();
    for &id in tokens {
        let markup = [markers.open, markers.close, markers.sep].contains(&id);
        let bytes = if !markup && tok.is_special(id) { &[][..] } else { tok.token_bytes(id) };
        parser.push(id, bytes, &mut events);
    }
    parser.finish(&mut events);
    for ev in events {
        match ev {
            OutputEvent::Reasoning(s) => turn.reasoning.push_str(&s),
            OutputEvent::Content(s) => turn.content.push_str(&s),
            OutputEvent::ToolCallBegin { name, .. } => turn.tool_calls.push((name, String::new())),
            OutputEvent::ToolCallArguments { index, json } => {
                if let Some(c) = turn.tool_calls.get_mut(index) {
                    c.1.push_str(&json);
                }
            }
        }
    }
    turn
}
