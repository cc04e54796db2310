//! A Responses API request (`POST /v1/responses`) as a conversation: `input` (a string or
//! items: messages, `function_call`, `function_call_output`, `reasoning`), `instructions`,
//! flat function `tools`, `tool_choice`, `reasoning.effort`, `text.format`, and the history of
//! `previous_response_id` in front.

use deltafin_text::chat::{Message, Role, ToolCall};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::params::{Obj, field, opt_str};

/// Text of a content list: a string, or parts of type `input_text`, `output_text` or `text`.
fn parts(v: Option<&Value>, param: &str) -> Result<Vec<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(list)) => list
            .iter()
            .map(|p| match p.get("type").and_then(Value::as_str) {
                Some("input_text" | "output_text" | "text" | "reasoning_text" | "summary_text") => {
                    match p.get("text") {
                        Some(Value::String(s)) => Ok(s.clone()),
                        _ => Err(ApiError::invalid(param, "a text part needs a string 'text'")),
                    }
                }
                Some(other) => Err(ApiError::invalid(
                    param,
                    format!("content parts of type '{other}' are not supported (text only)"),
                )),
                None => Err(ApiError::invalid(param, "each content part needs a 'type'")),
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(param, "'content' must be a string or an array of text parts")),
    }
}

fn role_of(s: &str, param: &str) -> Result<Role, ApiError> {
    match s {
        "system" | "developer" => Ok(Role::System),
        "user" => Ok(Role::User),
        "assistant" => Ok(Role::Assistant),
        other => {
            Err(ApiError::invalid(param, format!("unknown role '{other}' (system, developer, user or assistant)")))
        }
    }
}

/// The assistant message that calls and reasoning attach to: the last message when it is an
/// assistant's with no text after its calls, else a new one.
fn assistant(out: &mut Vec<Message>) -> &mut Message {
    let reuse = matches!(out.last(), Some(m) if m.role == Role::Assistant);
    if !reuse {
        out.push(Message::new(Role::Assistant, ""));
    }
    let n = out.len();
    &mut out[n - 1]
}

/// `input` appended to `out` as messages.
pub fn input(v: Option<&Value>, out: &mut Vec<Message>) -> Result<(), ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Err(ApiError::missing("input")),
        Some(Value::String(s)) => {
            out.push(Message::new(Role::User, s.clone()));
            return Ok(());
        }
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("input", "'input' is empty")),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("input", "'input' must be a string or an array of items")),
    };
    // Reasoning items come before the message or calls they led to.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let p = |k: &str| format!("input[{i}].{k}");
        let Some(o) = item.as_object() else {
            return Err(ApiError::invalid(&format!("input[{i}]"), "each input item must be an object"));
        };
        let kind = opt_str(o, "type").map_err(|_| ApiError::invalid(&p("type"), "'type' must be a string"))?;
        match (kind, o.get("role").and_then(Value::as_str)) {
            (None | Some("message"), Some(role)) => {
                let role = role_of(role, &p("role"))?;
                let mut m = Message::new(role, "");
                m.content = parts(o.get("content"), &p("content"))?;
                if role == Role::Assistant {
                    m.reasoning = reasoning.take();
                }
                out.push(m);
            }
            (Some("message"), None) => return Err(ApiError::invalid(&p("role"), "a message item needs a 'role'")),
            (Some("function_call"), _) => {
                let name = str_field(o, "name", &p("name"))?;
                let call_id = str_field(o, "call_id", &p("call_id"))?;
                let arguments = match field(o, "arguments") {
                    None => "{}".to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                };
                let m = assistant(out);
                if let Some(r) = reasoning.take() {
                    m.reasoning.get_or_insert_with(String::new).push_str(&r);
                }
                m.tool_calls.push(ToolCall { id: call_id, name, arguments });
            }
            (Some("function_call_output"), _) => {
                let call_id = str_field(o, "call_id", &p("call_id"))?;
                let text = match field(o, "output") {
                    Some(Value::String(s)) => vec![s.clone()],
                    Some(v @ Value::Array(_)) => parts(Some(v), &p("output"))?,
                    _ => return Err(ApiError::invalid(&p("output"), "'output' must be a string or text parts")),
                };
                // The tool's name, from the call it answers (K3's template names tool results).
                let name =
                    out.iter().rev().flat_map(|m| &m.tool_calls).find(|c| c.id == call_id).map(|c| c.name.clone());
                let mut m = Message::new(Role::Tool, "");
                m.content = text;
                m.tool_call_id = Some(call_id);
                m.name = name;
                out.push(m);
            }
            (Some("reasoning"), _) => {
                // Its text (`content`), else its summary; an encrypted-only item has none.
                let mut text = parts(o.get("content"), &p("content"))?.concat();
                if text.is_empty() {
                    text = parts(o.get("summary"), &p("summary"))?.concat();
                }
                if !text.is_empty() {
                    reasoning.get_or_insert_with(String::new).push_str(&text);
                }
            }
            (Some(other), _) => {
                return Err(ApiError::invalid(
                    &p("type"),
                    format!(
                        "input items of type '{other}' are not supported (message, function_call, function_call_output, reasoning)"
                    ),
                ));
            }
            (None, None) => {
                return Err(ApiError::invalid(&format!("input[{i}]"), "an input item needs a 'type' or a 'role'"));
            }
        }
    }
    Ok(())
}

fn str_field(o: &Obj, key: &str, param: &str) -> Result<String, ApiError> {
    match field(o, key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(ApiError::invalid(param, format!("'{key}' must be a string"))),
    }
}

/// The request's tools as the model sees them.
#[derive(Debug, Default)]
pub struct Tools {
    /// Function tools in the chat form the template renders (`{"type": "function", "function": {...}}`).
    pub functions: Vec<Value>,
    /// The namespace of each function that came in one (`{"type": "namespace", "tools": [...]}`):
    /// its calls name it, as OpenAI's do.
    pub namespaces: Vec<(String, String)>,
    /// Tool types this server cannot run (hosted tools such as `web_search`, freeform `custom`
    /// tools): left out of the prompt, and listed in the response (`deltafin.tools_not_available`).
    pub unavailable: Vec<String>,
}

/// Hosted or freeform tool types: the model is not told of them (it could not use them here).
const UNAVAILABLE: &[&str] = &[
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer_use_preview",
    "computer",
    "mcp",
    "local_shell",
    "custom",
];

/// A flat function tool (`{"type": "function", "name", "parameters", ...}`) in chat form.
fn function(t: &Value, param: &str) -> Result<Value, ApiError> {
    let Some(name) = t.get("name").and_then(Value::as_str) else {
        return Err(ApiError::invalid(param, "a function tool needs a string 'name'"));
    };
    let mut f = json!({"name": name, "parameters": t.get("parameters").cloned().unwrap_or(json!({}))});
    if let Some(d) = t.get("description").filter(|d| d.is_string()) {
        f["description"] = d.clone();
    }
    Ok(json!({"type": "function", "function": f}))
}

pub fn tools(v: Option<&Value>) -> Result<Tools, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Tools::default()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    let mut out = Tools::default();
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            Some("function") => out.functions.push(function(t, &param)?),
            Some("namespace") => {
                let Some(ns) = t.get("name").and_then(Value::as_str) else {
                    return Err(ApiError::invalid(&param, "a namespace needs a string 'name'"));
                };
                let Some(inner) = t.get("tools").and_then(Value::as_array) else {
                    return Err(ApiError::invalid(&param, "a namespace needs a 'tools' array"));
                };
                for (k, f) in inner.iter().enumerate() {
                    let p = format!("{param}.tools[{k}]");
                    if f.get("type").and_then(Value::as_str) != Some("function") {
                        return Err(ApiError::invalid(&p, "a namespace holds function tools only"));
                    }
                    let chat = function(f, &p)?;
                    out.namespaces
                        .push((chat["function"]["name"].as_str().unwrap_or_default().to_string(), ns.to_string()));
                    out.functions.push(chat);
                }
            }
            Some(kind) if UNAVAILABLE.contains(&kind) => out.unavailable.push(kind.to_string()),
            Some(other) => {
                return Err(ApiError::invalid(&param, format!("tools of type '{other}' are not known to this server")));
            }
            None => return Err(ApiError::invalid(&param, "each tool needs a 'type'")),
        }
    }
    Ok(out)
}

/// `reasoning.effort` as K3's thinking level.
pub fn effort(v: Option<&Value>) -> Result<Option<String>, ApiError> {
    let Some(r) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let Some(r) = r.as_object() else { return Err(ApiError::invalid("reasoning", "'reasoning' must be an object")) };
    match opt_str(r, "effort").map_err(|_| ApiError::invalid("reasoning.effort", "'effort' must be a string"))? {
        None => Ok(None),
        // OpenAI's lowest levels; K3's lowest is `low`.
        Some("minimal") => Ok(Some("low".into())),
        Some(e @ ("none" | "low" | "medium" | "high" | "max")) => Ok(Some(e.to_string())),
        Some(_) => {
            Err(ApiError::invalid("reasoning.effort", "'effort' must be none, minimal, low, medium, high or max"))
        }
    }
}

/// `text.format` as the chat's response format.
pub fn format(v: Option<&Value>) -> Result<Option<Option<Value>>, ApiError> {
    let Some(f) = v.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(None)),
        Some("json_schema") => Ok(Some(Some(f.get("schema").cloned().unwrap_or_else(|| json!({}))))),
        _ => Err(ApiError::invalid("text.format", "'text.format.type' must be text, json_object or json_schema")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_messages_with_calls_results_and_reasoning() {
        let v = json!([
            {"role": "user", "content": "list files"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "use ls"}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"cmd\":\"ls\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a.txt"}]},
        ]);
        let mut out = Vec::new();
        input(Some(&v), &mut out).unwrap();
        assert_eq!(out.len(), 4);
        assert_eq!(out[1].role, Role::Assistant);
        assert_eq!(out[1].reasoning.as_deref(), Some("use ls"));
        assert_eq!(out[1].tool_calls.len(), 2);
        assert_eq!(out[2].role, Role::Tool);
        assert_eq!(out[2].name.as_deref(), Some("shell"));
        assert_eq!(out[3].text(), "a.txt");
    }

    #[test]
    fn unsupported_items_and_tools_are_refused_by_name() {
        let mut out = Vec::new();
        let e = input(Some(&json!([{"type": "item_reference", "id": "x"}])), &mut out).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].type"));
        let e = tools(Some(&json!([{"type": "holodeck"}]))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"));
        let t = tools(Some(&json!([
            {"type": "function", "name": "f", "description": "d"},
            {"type": "web_search", "external_web_access": true},
            {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
        ])))
        .unwrap();
        assert_eq!(t.functions[0]["function"]["name"], "f");
        assert_eq!(t.functions[1]["function"]["name"], "g");
        assert_eq!(t.namespaces, vec![("g".to_string(), "ns".to_string())]);
        assert_eq!(t.unavailable, vec!["web_search".to_string()]);
    }
}
