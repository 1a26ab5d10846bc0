//! Tools on `/v1/chat/completions`: OpenAI's `tools` and `tool_choice` checked into [`Tools`],
//! the tool-call grammar of `required` / a named function, and tool calls parsed out of the
//! generated text.
//!
//! **The tool-call format.** A tool call is the JSON object
//! `{"name": <function name>, "arguments": <its arguments object>}`, optionally wrapped in
//! `<tool_call>…</tool_call>` (Hermes / Qwen templates), or a JSON array of such objects for
//! several calls. The chat template sees the definitions in its `tools` variable and is
//! expected to ask for this format (the embedded model's does).
//!
//! | `tool_choice` | output | reply |
//! |---|---|---|
//! | `none` | free text | `content`, no call parsed |
//! | `auto` (default with tools) | free text | `tool_calls` when the whole output is a call to a listed function, else `content` |
//! | `required` | constrained to one call of any listed function | `tool_calls` |
//! | `{"type": "function", "function": {"name": …}}` | constrained to one call of that function | `tool_calls` |
//!
//! The constraint is a JSON Schema (an `anyOf` over the functions, each `name` a `const` and
//! `arguments` the function's `parameters`) compiled like `response_format`
//! ([`crate::structured`]), so the arguments of a constrained call always validate. A reply
//! with calls has `content: null` and `finish_reason: "tool_calls"`; streamed, the text is
//! held back while it may still be a call, and the calls come in one `delta.tool_calls` chunk
//! (each with its whole `arguments`) at the end. Without a constraint (`auto`), arguments are
//! checked to be an object, not validated against the schema.

use ferry_modelcard::grammar::OutputGrammar;
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::structured::FormatInput;
use crate::validate::ValidationError;

/// Tools per request, at most (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    /// `function.name`: 1-64 of `a-z A-Z 0-9 _ -`.
    pub name: String,
    /// `function.parameters`: a JSON Schema object (default: an object with no properties).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call a tool.
    None,
    /// The model decides; calls are parsed from free text.
    Auto,
    /// Exactly one call of some listed function.
    Required,
    /// Exactly one call of this function.
    Named(String),
}

/// A request's checked tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    defs: Vec<ToolDef>,
    /// The definitions as the client sent them (OpenAI's shape), for the chat template.
    raw: Vec<Value>,
    choice: ToolChoice,
}

fn bad(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError::new(field, message)
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl Tools {
    /// Checks `tools` and `tool_choice`: each tool `{"type": "function", "function": {"name",
    /// "description"?, "parameters"?, "strict"?}}`, names valid and distinct; `tool_choice`
    /// `none` / `auto` / `required` / a named function that is in `tools`. `None` when there
    /// are no tools (then only `tool_choice: "none"` or `"auto"` is accepted).
    pub fn parse(
        tools: Option<&Value>,
        choice: Option<&Value>,
    ) -> Result<Option<Self>, ValidationError> {
        let list = match tools.filter(|v| !v.is_null()) {
            None => &[][..],
            Some(Value::Array(a)) => a.as_slice(),
            Some(v) => return Err(bad("tools", format!("must be an array, got {v}"))),
        };
        if list.len() > MAX_TOOLS {
            return Err(bad(
                "tools",
                format!("must hold at most {MAX_TOOLS} tools, got {}", list.len()),
            ));
        }
        let mut defs: Vec<ToolDef> = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let def = tool_def(i, t)?;
            if defs.iter().any(|d| d.name == def.name) {
                return Err(bad(
                    "tools",
                    format!(
                        "function names must be distinct, {:?} is listed twice",
                        def.name
                    ),
                ));
            }
            defs.push(def);
        }
        let choice = match choice.filter(|v| !v.is_null()) {
            None if defs.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!(
                            "must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \
                             \"function\": {{\"name\": …}}}}, got {other:?}"
                        ),
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        bad(
                            "tool_choice",
                            format!(
                                "an object must be {{\"type\": \"function\", \"function\": \
                                 {{\"name\": …}}}}, got {v}"
                            ),
                        )
                    })?;
                if !defs.iter().any(|d| d.name == name) {
                    return Err(bad(
                        "tool_choice",
                        format!("names the function {name:?}, which is not in `tools`"),
                    ));
                }
                ToolChoice::Named(name.to_owned())
            }
        };
        if defs.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(bad(
                    "tool_choice",
                    "\"required\" or a named function needs `tools`",
                )),
            };
        }
        Ok(Some(Self {
            defs,
            raw: list.to_vec(),
            choice,
        }))
    }

    /// The definitions for the chat template's `tools` variable.
    pub fn template_tools(&self) -> &[Value] {
        &self.raw
    }

    /// The choice.
    pub fn choice(&self) -> &ToolChoice {
        &self.choice
    }

    /// The grammar `tool_choice` imposes: one call of the named function, or of any listed
    /// one for `required`; `None` for `auto` and `none`.
    pub fn grammar(&self) -> Option<FormatInput> {
        let call = |d: &ToolDef| {
            json!({
                "type": "object",
                "properties": {"name": {"const": d.name}, "arguments": d.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        };
        let schema = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Named(n) => self.defs.iter().find(|d| &d.name == n).map(call)?,
            ToolChoice::Required if self.defs.len() == 1 => call(&self.defs[0]),
            ToolChoice::Required => {
                json!({"anyOf": self.defs.iter().map(call).collect::<Vec<_>>()})
            }
        };
        Some(FormatInput {
            grammar: OutputGrammar::JsonSchema(schema),
            field: "tools",
        })
    }

    /// Whether output is parsed for calls (every choice but `none`).
    pub fn parses(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// Whether streamed text must be held back: with `text` generated so far, the output may
    /// still turn out to be a call (always under a constraint; under `auto` while the text is
    /// blank or starts like a call).
    pub fn may_be_call(&self, text: &str) -> bool {
        match self.choice {
            ToolChoice::None => false,
            ToolChoice::Required | ToolChoice::Named(_) => true,
            ToolChoice::Auto => {
                let t = text.trim_start();
                t.is_empty()
                    || t.starts_with('{')
                    || t.starts_with('[')
                    || "<tool_call>".starts_with(t)
                    || t.starts_with("<tool_call>")
            }
        }
    }

    /// The calls `text` (the whole output) makes, in the format of the module doc; `None`
    /// when it is not a call of listed functions (then it is plain content).
    pub fn parse_calls(&self, text: &str) -> Option<Vec<ToolCallOut>> {
        if !self.parses() {
            return None;
        }
        let mut t = text.trim();
        if let Some(inner) = t
            .strip_prefix("<tool_call>")
            .and_then(|r| r.strip_suffix("</tool_call>"))
        {
            t = inner.trim();
        }
        let v: Value = serde_json::from_str(t).ok()?;
        let items = match v {
            Value::Array(a) if !a.is_empty() => a,
            v @ Value::Object(_) => vec![v],
            _ => return None,
        };
        items
            .into_iter()
            .map(|item| {
                let name = item.get("name")?.as_str()?;
                self.defs.iter().find(|d| d.name == name)?;
                let args = item.get("arguments").or_else(|| item.get("parameters"))?;
                args.is_object().then(|| ToolCallOut::new(name, args))
            })
            .collect()
    }
}

/// One entry of `tools`, checked.
fn tool_def(i: usize, t: &Value) -> Result<ToolDef, ValidationError> {
    let at = |what: String| bad("tools", format!("tool {i}: {what}"));
    let obj = t
        .as_object()
        .ok_or_else(|| at(format!("must be an object, got {t}")))?;
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        other => return Err(at(format!("`type` must be \"function\", got {other:?}"))),
    }
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
    if let Some(k) = f
        .keys()
        .find(|k| !matches!(k.as_str(), "name" | "description" | "parameters" | "strict"))
    {
        return Err(at(format!("unknown field `function.{k}`")));
    }
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    if !valid_name(name) {
        return Err(at(format!(
            "`function.name` must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {:?}",
            f.get("name")
        )));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(p) => {
            return Err(at(format!(
                "`function.parameters` must be a JSON Schema object, got {p}"
            )))
        }
    };
    Ok(ToolDef {
        name: name.to_owned(),
        parameters,
    })
}

/// A tool call in a reply (`message.tool_calls[i]`, and in one `delta.tool_calls` chunk).
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

impl ToolCallOut {
    fn new(name: &str, args: &Value) -> Self {
        Self {
            index: None,
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            kind: "function",
            function: FunctionCall {
                name: name.to_owned(),
                arguments: args.to_string(),
            },
        }
    }
}

/// An incoming assistant turn's `tool_calls` for the chat template: each `{"id", "type":
/// "function", "function": {"name", "arguments"}}` with `arguments` parsed from its JSON text
/// (kept as text when it is not JSON). A malformed entry is a 400 naming `messages`.
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
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => {
                    serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
                }
                Some(v) => v.clone(),
                None => Value::Object(Map::new()),
            };
            Ok(json!({
                "id": c.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": name, "arguments": arguments}
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}},
            {"type": "function", "function": {"name": "noop"}}])
    }

    #[test]
    fn choices_and_their_errors() {
        let t = Tools::parse(Some(&weather()), None)
            .expect("valid")
            .expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Auto);
        assert!(t.grammar().is_none());
        let t = Tools::parse(Some(&weather()), Some(&json!("required")))
            .expect("valid")
            .expect("tools");
        let g = t.grammar().expect("constrained");
        assert_eq!(g.field, "tools");
        let named = json!({"type": "function", "function": {"name": "noop"}});
        let t = Tools::parse(Some(&weather()), Some(&named))
            .expect("valid")
            .expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Named("noop".into()));
        assert_eq!(Tools::parse(None, Some(&json!("auto"))), Ok(None));
        for (tools, choice, field) in [
            (
                weather(),
                json!({"type": "function", "function": {"name": "nope"}}),
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
                json!([{"type": "function", "function": {"name": "a"}},
                       {"type": "function", "function": {"name": "a"}}]),
                json!("auto"),
                "tools",
            ),
            (json!({"name": "a"}), json!("auto"), "tools"),
        ] {
            let e =
                Tools::parse(Some(&tools), Some(&choice)).expect_err(&format!("{tools} {choice}"));
            assert_eq!(e.field, field, "{tools} {choice}: {e}");
        }
    }

    #[test]
    fn calls_are_parsed_from_the_documented_format() {
        let t = Tools::parse(Some(&weather()), None)
            .expect("valid")
            .expect("tools");
        let c = t
            .parse_calls(r#" {"name":"get_weather","arguments":{"city":"Ur"}} "#)
            .expect("a call");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].function.name, "get_weather");
        assert_eq!(c[0].function.arguments, r#"{"city":"Ur"}"#);
        assert!(c[0].id.starts_with("call_"));
        let wrapped = r#"<tool_call>{"name": "noop", "arguments": {}}</tool_call>"#;
        assert_eq!(
            t.parse_calls(wrapped).expect("a call")[0].function.name,
            "noop"
        );
        let two =
            r#"[{"name":"noop","arguments":{}},{"name":"get_weather","arguments":{"city":"x"}}]"#;
        assert_eq!(t.parse_calls(two).expect("calls").len(), 2);
        for not_a_call in [
            "In the beginning",
            r#"{"name":"unknown","arguments":{}}"#,
            r#"{"name":"noop","arguments":"x"}"#,
            r#"{"name":"noop""#,
        ] {
            assert_eq!(t.parse_calls(not_a_call), None, "{not_a_call}");
        }
        assert!(t.may_be_call("  {\"na"));
        assert!(t.may_be_call("<tool"));
        assert!(!t.may_be_call("And God"));
    }
}
