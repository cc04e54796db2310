//! Kimi K3's chat text: the XTML prompt encoding and the parser of the model's output.

pub mod encode;
pub mod parse;

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// A tool call in an assistant message of the history.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the client sent them: JSON text (normally an object).
    pub arguments: String,
}

/// One message of a conversation, as both wire formats reduce to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    /// Text content, as the parts the client sent (each part is encoded on its own).
    pub content: Vec<String>,
    /// An assistant message's reasoning.
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    /// For a tool result: the call it answers.
    pub tool_call_id: Option<String>,
    /// A participant name (user/system), or the tool's name for a tool result.
    pub name: Option<String>,
    /// A system message that declares more tools mid-conversation (K3's lazy tool loading;
    /// rendered in place of the message).
    pub tools: Vec<serde_json::Value>,
}

impl Message {
    /// The content's parts joined.
    pub fn text(&self) -> String {
        self.content.concat()
    }

    pub fn new(role: Role, content: impl Into<String>) -> Self {
        let content: String = content.into();
        Message {
            role,
            content: if content.is_empty() { Vec::new() } else { vec![content] },
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            tools: Vec::new(),
        }
    }
}

/// What the model is told besides the messages.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    /// A named function.
    Function(String),
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Conversation {
    pub messages: Vec<Message>,
    /// OpenAI-style tool definitions (`{"type": "function", "function": {...}}`).
    pub tools: Vec<serde_json::Value>,
    pub tool_choice: ToolChoice,
    /// `low`, `medium`, `high` or `max`; `None` = the model's default (max).
    pub reasoning_effort: Option<String>,
    /// `Some(schema)` asks for JSON output (`None` inside = any JSON object).
    pub response_format: Option<Option<serde_json::Value>>,
}
