//! Tools (function calling), whatever the front door: checked definitions and choice
//! ([`Tools`]), the tool-call grammar of `required` / a named function, the conversation the
//! chat template renders, and tool calls parsed out of the generated text. The wire shapes
//! live at each door and end here: OpenAI chat's and the Responses API's JSON
//! (`http/tools.rs`), `ferry.v1.Tool` / `ToolChoice` on gRPC (`validate.rs`).
//!
//! **The tool-call format.** A tool call is the JSON object
//! `{"name": <function name>, "arguments": <its arguments object>}`, optionally wrapped in
//! `<tool_call>…</tool_call>` (Hermes / Qwen templates), or a JSON array of such objects for
//! several calls. The chat template sees the definitions in its `tools` variable, in OpenAI
//! chat's shape whatever the door (`{"type": "function", "function": {"name", …}}`, as
//! transformers passes them), and is expected to ask for this format (the embedded model's
//! does).
//!
//! | choice | output | reply |
//! |---|---|---|
//! | none | free text | text, no call parsed |
//! | auto (default with tools) | free text | calls when the whole output is a call of listed functions, else text |
//! | required | constrained to one call of any listed function | calls |
//! | a named function | constrained to one call of that function | calls |
//!
//! The constraint is a JSON Schema (an `anyOf` over the functions, each `name` a `const` and
//! `arguments` the function's `parameters`) compiled like `response_format`
//! ([`crate::structured`]), so the arguments of a constrained call always validate. Without a
//! constraint (auto), arguments are checked to be an object, not validated against the schema.

use ferry_modelcard::grammar::OutputGrammar;
use ferry_modelcard::tokenizer::ChatMessage;
use ferry_proto::v1;
use serde_json::{json, Value};

use crate::structured::FormatInput;
use crate::tokenize::PromptInput;
use crate::validate::ValidationError;

/// Tools per request, at most (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// One function the model may call, as the client defined it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    /// 1-64 of `a-z A-Z 0-9 _ -`, distinct within a request.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON Schema object for its arguments; `None` = an object with no properties.
    pub parameters: Option<Value>,
    /// OpenAI's `strict`; no effect (a constrained call always follows the schema, an
    /// unconstrained one never is).
    pub strict: Option<bool>,
}

impl ToolDef {
    /// The arguments' schema (`parameters`, or an object with no properties).
    pub fn schema(&self) -> Value {
        self.parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
    }

    /// The definition in OpenAI chat's shape, for the chat template: only the fields given.
    fn template(&self) -> Value {
        let mut function = serde_json::Map::new();
        function.insert("name".into(), json!(self.name));
        if let Some(d) = &self.description {
            function.insert("description".into(), json!(d));
        }
        if let Some(p) = &self.parameters {
            function.insert("parameters".into(), p.clone());
        }
        if let Some(s) = self.strict {
            function.insert("strict".into(), json!(s));
        }
        json!({"type": "function", "function": function})
    }
}

/// Whether the model must, may or must not call a tool.
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
    choice: ToolChoice,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl Tools {
    /// Checks `defs` (at most [`MAX_TOOLS`], names valid and distinct, `parameters` an
    /// object; errors name `tools`) and `choice` (`None` = auto with tools, none without; a
    /// named function must be in `defs`, and `required` or a named function needs tools;
    /// errors name `tool_choice`). `Ok(None)` when there are no tools.
    pub fn new(
        defs: Vec<ToolDef>,
        choice: Option<ToolChoice>,
    ) -> Result<Option<Self>, ValidationError> {
        let bad = |message: String| ValidationError::new("tools", message);
        if defs.len() > MAX_TOOLS {
            return Err(bad(format!(
                "must hold at most {MAX_TOOLS} tools, got {}",
                defs.len()
            )));
        }
        for (i, d) in defs.iter().enumerate() {
            if !valid_name(&d.name) {
                return Err(bad(format!(
                    "tool {i}: the function name must be 1-64 characters of a-z, A-Z, 0-9, _ \
                     and -, got {:?}",
                    d.name
                )));
            }
            if let Some(p) = d.parameters.as_ref().filter(|p| !p.is_object()) {
                return Err(bad(format!(
                    "tool {i}: `parameters` must be a JSON Schema object, got {p}"
                )));
            }
            if defs[..i].iter().any(|e| e.name == d.name) {
                return Err(bad(format!(
                    "function names must be distinct, {:?} is listed twice",
                    d.name
                )));
            }
        }
        let choice = match choice {
            Some(c) => c,
            None if defs.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
        };
        if let ToolChoice::Named(name) = &choice {
            if !defs.is_empty() && !defs.iter().any(|d| &d.name == name) {
                return Err(ValidationError::new(
                    "tool_choice",
                    format!("names the function {name:?}, which is not in `tools`"),
                ));
            }
        }
        if defs.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ValidationError::new(
                    "tool_choice",
                    "\"required\" or a named function needs `tools`",
                )),
            };
        }
        Ok(Some(Self { defs, choice }))
    }

    /// The definitions.
    pub fn defs(&self) -> &[ToolDef] {
        &self.defs
    }

    /// The definitions for the chat template's `tools` variable, in OpenAI chat's shape.
    pub fn template_tools(&self) -> Vec<Value> {
        self.defs.iter().map(ToolDef::template).collect()
    }

    /// The choice.
    pub fn choice(&self) -> &ToolChoice {
        &self.choice
    }

    /// The grammar the choice imposes: one call of the named function, or of any listed
    /// one for `required`; `None` for auto and none.
    pub fn grammar(&self) -> Option<FormatInput> {
        let call = |d: &ToolDef| {
            json!({
                "type": "object",
                "properties": {"name": {"const": d.name}, "arguments": d.schema()},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        };
        let schema = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Named(n) => self.defs.iter().find(|d| &d.name == n).map(call)?,
            ToolChoice::Required => match self.defs.as_slice() {
                [one] => call(one),
                all => json!({"anyOf": all.iter().map(call).collect::<Vec<_>>()}),
            },
        };
        Some(FormatInput {
            grammar: OutputGrammar::JsonSchema(schema),
            field: "tools",
        })
    }

    /// Whether output is parsed for calls (every choice but none).
    pub fn parses(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// Whether streamed text must be held back: with `text` generated so far, the output may
    /// still turn out to be a call (always under a constraint; under auto while the text is
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

    /// The calls `text` (a sample's whole output) makes, in the format of the module doc;
    /// `None` when it is not a call of listed functions with object arguments (then it is
    /// plain text), or when the choice is none.
    pub fn parse_calls(&self, text: &str) -> Option<Vec<ToolCall>> {
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
                args.is_object().then(|| ToolCall::new(name, args))
            })
            .collect()
    }
}

/// A tool call parsed from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` and 24 hex digits, unique per call.
    pub id: String,
    /// The function's name (one of the request's tools).
    pub name: String,
    /// Its arguments object as JSON text (OpenAI's shape: a string).
    pub arguments: String,
}

impl ToolCall {
    fn new(name: &str, args: &Value) -> Self {
        Self {
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            name: name.to_owned(),
            arguments: args.to_string(),
        }
    }
}

/// An earlier call in the conversation, as chat templates take it (transformers' shape):
/// `{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` a JSON
/// value: given as text (OpenAI's shape) it is parsed, and kept as text when it is not JSON.
pub fn template_call(id: Option<String>, name: &str, arguments: Value) -> Value {
    let arguments = match arguments {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        v => v,
    };
    json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments}
    })
}

/// gRPC's `tools` and `tool_choice` → checked [`Tools`] ([`Tools::new`]). A `parameters`
/// that is not JSON text is a 400 naming `tools`, an unknown `mode` one naming `tool_choice`;
/// `MODE_UNSPECIFIED` is as unset.
pub fn from_wire(
    tools: Vec<v1::Tool>,
    choice: Option<v1::ToolChoice>,
) -> Result<Option<Tools>, ValidationError> {
    let defs = tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let parameters = match t.parameters.trim() {
                "" => None,
                text => Some(serde_json::from_str(text).map_err(|e| {
                    ValidationError::new(
                        "tools",
                        format!("tool {i}: `parameters` is not JSON: {e}"),
                    )
                })?),
            };
            Ok(ToolDef {
                name: t.name,
                description: Some(t.description).filter(|d| !d.is_empty()),
                parameters,
                strict: None,
            })
        })
        .collect::<Result<Vec<_>, ValidationError>>()?;
    use v1::tool_choice::{Choice, Mode};
    let choice = match choice.and_then(|c| c.choice) {
        None => None,
        Some(Choice::Function(name)) => Some(ToolChoice::Named(name)),
        Some(Choice::Mode(m)) => match Mode::try_from(m) {
            Ok(Mode::Unspecified) => None,
            Ok(Mode::None) => Some(ToolChoice::None),
            Ok(Mode::Auto) => Some(ToolChoice::Auto),
            Ok(Mode::Required) => Some(ToolChoice::Required),
            Err(_) => {
                return Err(ValidationError::new(
                    "tool_choice",
                    format!("`mode` must be MODE_NONE, MODE_AUTO or MODE_REQUIRED, got {m}"),
                ))
            }
        },
    };
    Tools::new(defs, choice)
}

impl From<ToolCall> for v1::ToolCall {
    fn from(c: ToolCall) -> Self {
        Self {
            id: c.id,
            name: c.name,
            arguments: c.arguments,
        }
    }
}

/// The request's output grammar: `format` (its `response_format`, `format_field` as the API
/// names it) or the grammar `tools`' choice imposes. Both is a 400 naming `format_field`:
/// under `required` or a named function the output is the call.
pub fn output_grammar(
    format: Option<FormatInput>,
    tools: Option<&Tools>,
    format_field: &'static str,
) -> Result<Option<FormatInput>, ValidationError> {
    match (format, tools.and_then(Tools::grammar)) {
        (Some(_), Some(_)) => Err(ValidationError::new(
            format_field,
            "cannot be combined with `tool_choice` \"required\" or a named function (the \
             output is the tool call)",
        )),
        (f, None) | (None, f) => Ok(f),
    }
}

/// A chat prompt: with the tool definitions in the template's `tools` variable when the
/// request has tools, or when a turn carries tool calls (the template renders those through
/// the same path).
pub fn chat_prompt(messages: Vec<ChatMessage>, tools: Option<&Tools>) -> PromptInput {
    let with_calls = messages.iter().any(|m| m.tool_calls.is_some());
    match tools {
        Some(t) => PromptInput::ChatTools(messages, t.template_tools()),
        None if with_calls => PromptInput::ChatTools(messages, Vec::new()),
        None => PromptInput::Chat(messages),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str, parameters: Option<Value>) -> ToolDef {
        ToolDef {
            name: name.into(),
            description: None,
            parameters,
            strict: None,
        }
    }

    fn weather() -> Vec<ToolDef> {
        vec![
            def(
                "get_weather",
                Some(
                    json!({"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}),
                ),
            ),
            def("noop", None),
        ]
    }

    #[test]
    fn choices_and_their_errors() {
        let t = Tools::new(weather(), None).expect("valid").expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Auto);
        assert!(t.grammar().is_none());
        let t = Tools::new(weather(), Some(ToolChoice::Required))
            .expect("valid")
            .expect("tools");
        assert_eq!(t.grammar().expect("constrained").field, "tools");
        let t = Tools::new(weather(), Some(ToolChoice::Named("noop".into())))
            .expect("valid")
            .expect("tools");
        assert_eq!(t.choice(), &ToolChoice::Named("noop".into()));
        assert_eq!(Tools::new(Vec::new(), Some(ToolChoice::Auto)), Ok(None));
        assert_eq!(Tools::new(Vec::new(), None), Ok(None));
        for (defs, choice, field) in [
            (
                weather(),
                Some(ToolChoice::Named("nope".into())),
                "tool_choice",
            ),
            (Vec::new(), Some(ToolChoice::Required), "tool_choice"),
            (
                Vec::new(),
                Some(ToolChoice::Named("noop".into())),
                "tool_choice",
            ),
            (vec![def("a b", None)], None, "tools"),
            (vec![def("a", None), def("a", None)], None, "tools"),
            (vec![def("a", Some(json!("object")))], None, "tools"),
            (
                (0..=MAX_TOOLS)
                    .map(|i| def(&format!("f{i}"), None))
                    .collect(),
                None,
                "tools",
            ),
        ] {
            let e = Tools::new(defs, choice.clone()).expect_err(&format!("{choice:?}"));
            assert_eq!(e.field, field, "{choice:?}: {e}");
        }
    }

    #[test]
    fn calls_are_parsed_from_the_documented_format() {
        let t = Tools::new(weather(), None).expect("valid").expect("tools");
        let c = t
            .parse_calls(r#" {"name":"get_weather","arguments":{"city":"Ur"}} "#)
            .expect("a call");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].name, "get_weather");
        assert_eq!(c[0].arguments, r#"{"city":"Ur"}"#);
        assert!(c[0].id.starts_with("call_") && c[0].id.len() == 29, "{c:?}");
        let wrapped = r#"<tool_call>{"name": "noop", "arguments": {}}</tool_call>"#;
        assert_eq!(t.parse_calls(wrapped).expect("a call")[0].name, "noop");
        let two =
            r#"[{"name":"noop","arguments":{}},{"name":"get_weather","arguments":{"city":"x"}}]"#;
        let two = t.parse_calls(two).expect("calls");
        assert_eq!(two.len(), 2);
        assert_ne!(two[0].id, two[1].id);
        for not_a_call in [
            "In the beginning",
            r#"{"name":"unknown","arguments":{}}"#,
            r#"{"name":"noop","arguments":"x"}"#,
            r#"{"name":"noop""#,
            "[]",
        ] {
            assert_eq!(t.parse_calls(not_a_call), None, "{not_a_call}");
        }
        assert!(t.may_be_call("  {\"na"));
        assert!(t.may_be_call("<tool"));
        assert!(!t.may_be_call("And God"));
        let none = Tools::new(weather(), Some(ToolChoice::None))
            .expect("valid")
            .expect("tools");
        assert_eq!(none.parse_calls(r#"{"name":"noop","arguments":{}}"#), None);
        assert!(!none.may_be_call(""));
    }

    #[test]
    fn the_template_sees_openai_chat_shapes() {
        let mut defs = weather();
        defs[1].description = Some("Does nothing.".into());
        defs[1].strict = Some(true);
        let t = Tools::new(defs, None).expect("valid").expect("tools");
        assert_eq!(
            t.template_tools()[1],
            json!({"type": "function", "function": {"name": "noop",
                "description": "Does nothing.", "strict": true}})
        );
        assert_eq!(
            template_call(Some("c1".into()), "noop", json!("{\"a\":1}")),
            json!({"id": "c1", "type": "function",
                "function": {"name": "noop", "arguments": {"a": 1}}})
        );
        assert_eq!(
            template_call(None, "noop", json!("not json"))["function"]["arguments"],
            "not json"
        );
        let msgs = vec![ChatMessage::new("user", "hi")];
        assert_eq!(
            chat_prompt(msgs.clone(), None),
            PromptInput::Chat(msgs.clone())
        );
        assert!(matches!(
            chat_prompt(msgs, Some(&t)),
            PromptInput::ChatTools(_, tools) if tools.len() == 2
        ));
    }
}
