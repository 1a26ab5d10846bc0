//! Tools on the OpenAI HTTP API: the JSON shapes of `tools` and `tool_choice` on
//! `/v1/chat/completions` and on `/v1/responses` → the router's [`Tools`]
//! ([`crate::tools`], shared with gRPC: the checks, the tool-call grammar, parsing calls), and
//! chat's shape of the calls in a reply ([`ToolCallOut`]) and in incoming assistant turns.
//!
//! | API | `tools[i]` | named `tool_choice` |
//! |---|---|---|
//! | chat | `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}` | `{"type": "function", "function": {"name"}}` |
//! | responses | `{"type": "function", "name", "description"?, "parameters"?, "strict"?}` | `{"type": "function", "name"}` |
//!
//! `tool_choice` is otherwise `"none"`, `"auto"` or `"required"` on both. A reply with calls
//! has `content: null` and `finish_reason: "tool_calls"` on chat (function-call output items on
//! responses); streamed, the text is held back while it may still be a call
//! ([`Tools::may_be_call`]), and the calls come whole at the end.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::tools::{template_call, ToolCall, ToolChoice, ToolDef, Tools};
use crate::validate::ValidationError;

/// Which API's JSON shapes to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolsApi {
    /// `/v1/chat/completions`: the function nested under `function`.
    Chat,
    /// `/v1/responses`: the function's fields at the top of the tool.
    Responses,
}

impl ToolsApi {
    fn named_choice(self) -> &'static str {
        match self {
            Self::Chat => "{\"type\": \"function\", \"function\": {\"name\": …}}",
            Self::Responses => "{\"type\": \"function\", \"name\": …}",
        }
    }
}

fn bad(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError::new(field, message)
}

/// Reads `tools` and `tool_choice` in `api`'s shapes and checks them ([`Tools::new`]); `None`
/// when there are no tools (then only `tool_choice` `"none"` or `"auto"` is accepted).
/// Malformed tools are a 400 naming `tools` (on responses, a tool of another type than
/// `function`, e.g. `web_search`, names `tools[i].type`), a malformed choice `tool_choice`.
pub fn parse_tools(
    api: ToolsApi,
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<Option<Tools>, ValidationError> {
    let list = match tools.filter(|v| !v.is_null()) {
        None => &[][..],
        Some(Value::Array(a)) => a.as_slice(),
        Some(v) => return Err(bad("tools", format!("must be an array, got {v}"))),
    };
    let defs = list
        .iter()
        .enumerate()
        .map(|(i, t)| tool_def(api, i, t))
        .collect::<Result<Vec<_>, _>>()?;
    let choice = match choice.filter(|v| !v.is_null()) {
        None => None,
        Some(v) => Some(tool_choice(api, v)?),
    };
    Tools::new(defs, choice)
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `api`'s named-function object.
fn tool_choice(api: ToolsApi, v: &Value) -> Result<ToolChoice, ValidationError> {
    let named = api.named_choice();
    if let Some(s) = v.as_str() {
        return match s {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => Err(bad(
                "tool_choice",
                format!("must be \"none\", \"auto\", \"required\" or {named}, got {other:?}"),
            )),
        };
    }
    let name = match api {
        ToolsApi::Chat => v.get("function").and_then(|f| f.get("name")),
        ToolsApi::Responses => v.get("name"),
    };
    name.and_then(Value::as_str)
        .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
        .map(|n| ToolChoice::Named(n.to_owned()))
        .ok_or_else(|| {
            bad(
                "tool_choice",
                format!("an object must be {named} (only function tools are supported), got {v}"),
            )
        })
}

/// One entry of `tools` in `api`'s shape; unknown fields are refused.
fn tool_def(api: ToolsApi, i: usize, t: &Value) -> Result<ToolDef, ValidationError> {
    let at = |what: String| bad("tools", format!("tool {i}: {what}"));
    let obj = t
        .as_object()
        .ok_or_else(|| at(format!("must be an object, got {t}")))?;
    let kind = obj.get("type");
    if kind.and_then(Value::as_str) != Some("function") {
        let got = kind.map_or_else(|| "nothing".to_owned(), Value::to_string);
        return Err(match api {
            ToolsApi::Chat => at(format!("`type` must be \"function\", got {got}")),
            ToolsApi::Responses => ValidationError::new(
                format!("tools[{i}].type"),
                format!(
                    "must be \"function\": ferry runs no built-in tools (web_search, \
                     file_search, …), got {got}"
                ),
            ),
        });
    }
    let function_fields = ["name", "description", "parameters", "strict"];
    let f: &Map<String, Value> = match api {
        ToolsApi::Chat => {
            if let Some(k) = obj
                .keys()
                .find(|k| !matches!(k.as_str(), "type" | "function"))
            {
                return Err(at(format!("unknown field {k:?}")));
            }
            let f = obj
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| at("`function` must be an object with a `name`".into()))?;
            if let Some(k) = f.keys().find(|k| !function_fields.contains(&k.as_str())) {
                return Err(at(format!("unknown field `function.{k}`")));
            }
            f
        }
        ToolsApi::Responses => {
            if let Some(k) = obj
                .keys()
                .find(|k| *k != "type" && !function_fields.contains(&k.as_str()))
            {
                return Err(at(format!("unknown field {k:?}")));
            }
            obj
        }
    };
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
        at(format!(
            "the function's `name` must be a string, got {:?}",
            f.get("name")
        ))
    })?;
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(at(format!("`description` must be a string, got {v}"))),
    };
    let strict = match f.get("strict") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => return Err(at(format!("`strict` must be a boolean, got {v}"))),
    };
    Ok(ToolDef {
        name: name.to_owned(),
        description,
        parameters: f.get("parameters").filter(|p| !p.is_null()).cloned(),
        strict,
    })
}

/// A tool call in a chat reply (`message.tool_calls[i]`, and in one `delta.tool_calls` chunk).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    /// The chunk index of the call (streamed chunks only; absent in whole replies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// `call_…`, unique per call.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// `tool_calls[i].function`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text (OpenAI's shape: a string).
    pub arguments: String,
}

impl From<ToolCall> for ToolCallOut {
    fn from(c: ToolCall) -> Self {
        Self {
            index: None,
            id: c.id,
            kind: "function",
            function: FunctionCall {
                name: c.name,
                arguments: c.arguments,
            },
        }
    }
}

/// An incoming chat assistant turn's `tool_calls` for the chat template
/// ([`template_call`]: `arguments` parsed from its JSON text). A malformed entry is a 400
/// naming `messages`.
pub fn template_tool_calls(i: usize, calls: &Value) -> Result<Vec<Value>, ValidationError> {
    let at = |what: String| bad("messages", format!("message {i}: {what}"));
    let list = calls
        .as_array()
        .ok_or_else(|| at(format!("`tool_calls` must be an array, got {calls}")))?;
    list.iter()
        .map(|c| {
            let f = c
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| at(format!("a tool call needs a `function` object, got {c}")))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| at("a tool call's `function.name` must be a string".into()))?;
            let id = c.get("id").and_then(Value::as_str).map(str::to_owned);
            let arguments = f
                .get("arguments")
                .cloned()
                .unwrap_or_else(|| Value::Object(Map::new()));
            Ok(template_call(id, name, arguments))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}},
            {"type": "function", "function": {"name": "noop"}}])
    }

    #[test]
    fn chat_shapes_and_their_errors() {
        let chat = |t: &Value, c: Option<Value>| parse_tools(ToolsApi::Chat, Some(t), c.as_ref());
        let t = chat(&weather(), None).expect("valid").expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Auto);
        assert_eq!(t.template_tools(), weather().as_array().cloned().unwrap());
        let named = json!({"type": "function", "function": {"name": "noop"}});
        let t = chat(&weather(), Some(named))
            .expect("valid")
            .expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Named("noop".into()));
        assert_eq!(
            parse_tools(ToolsApi::Chat, None, Some(&json!("auto"))),
            Ok(None)
        );
        for (tools, choice, field) in [
            (
                weather(),
                json!({"type": "function", "function": {"name": "nope"}}),
                "tool_choice",
            ),
            (
                weather(),
                json!({"type": "function", "name": "noop"}),
                "tool_choice",
            ),
            (weather(), json!("sometimes"), "tool_choice"),
            (json!([]), json!("required"), "tool_choice"),
            (json!([{"type": "retrieval"}]), json!("auto"), "tools"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                json!("auto"),
                "tools",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "extra": 1}}]),
                json!("auto"),
                "tools",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "description": 3}}]),
                json!("auto"),
                "tools",
            ),
            (
                json!([{"type": "function", "function": {"name": "a"}},
                       {"type": "function", "function": {"name": "a"}}]),
                json!("auto"),
                "tools",
            ),
            (json!({"name": "a"}), json!("auto"), "tools"),
        ] {
            let e = chat(&tools, Some(choice.clone())).expect_err(&format!("{tools} {choice}"));
            assert_eq!(e.field, field, "{tools} {choice}: {e}");
        }
    }

    #[test]
    fn responses_shapes_and_their_errors() {
        let tools = json!([{"type": "function", "name": "get_weather", "description": "Sky.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": true}]);
        let resp =
            |t: &Value, c: Option<Value>| parse_tools(ToolsApi::Responses, Some(t), c.as_ref());
        let t = resp(
            &tools,
            Some(json!({"type": "function", "name": "get_weather"})),
        )
        .expect("valid")
        .expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Named("get_weather".into()));
        assert_eq!(
            t.template_tools()[0]["function"]["description"],
            json!("Sky."),
            "rendered in chat's shape"
        );
        let web = json!([{"type": "function", "name": "f"}, {"type": "web_search"}]);
        let e = resp(&web, None).expect_err("a built-in tool");
        assert_eq!(e.field, "tools[1].type", "{e}");
        assert!(e.message.contains("web_search"), "{e}");
        for (tools, choice, field) in [
            (tools.clone(), json!({"type": "file_search"}), "tool_choice"),
            (
                tools.clone(),
                json!({"type": "function", "name": "nope"}),
                "tool_choice",
            ),
            (
                json!([{"type": "function", "name": "f", "function": {}}]),
                json!("auto"),
                "tools",
            ),
            (json!([{"name": "f"}]), json!("auto"), "tools[0].type"),
        ] {
            let e = resp(&tools, Some(choice.clone())).expect_err(&format!("{tools} {choice}"));
            assert_eq!(e.field, field, "{tools} {choice}: {e}");
        }
    }

    #[test]
    fn incoming_calls_are_parsed_for_the_template() {
        let calls = json!([{"id": "call_1", "type": "function",
            "function": {"name": "noop", "arguments": "{\"x\":1}"}}]);
        assert_eq!(
            template_tool_calls(0, &calls).expect("valid")[0]["function"]["arguments"],
            json!({"x": 1})
        );
        let e = template_tool_calls(2, &json!([{"id": "x"}])).expect_err("no function");
        assert_eq!(e.field, "messages");
        assert!(e.message.contains("message 2"), "{e}");
    }
}
