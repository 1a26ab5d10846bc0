//! Structured output at the router: the wire shapes of `response_format` (HTTP chat and
//! completions), `text.format` (`/v1/responses`) and `ferry.v1.ResponseFormat` (gRPC) →
//! [`FormatInput`], and its check by compiling it with the router's own
//! [`GrammarCompiler`] — the compiler the workers use, on the same tokenizer — so an invalid or
//! unsupported schema is a 400 naming the field before any worker sees it.
//!
//! Compilation is CPU work that grows with the schema: it runs on the blocking pool, after the
//! schema's size ([`MAX_SCHEMA_BYTES`]) is checked.

use ferry_modelcard::grammar::{GrammarCompiler, OutputGrammar, MAX_SCHEMA_BYTES};
use ferry_proto::v1;
use serde_json::Value;

use crate::validate::ValidationError;

/// A requested output grammar and the field to name when it is refused.
#[derive(Debug, Clone, PartialEq)]
pub struct FormatInput {
    /// What the output must be.
    pub grammar: OutputGrammar,
    /// The field holding the schema, as the client's API spells it
    /// (`response_format.json_schema.schema`, `text.format.schema`, `tool_choice`, …).
    pub field: &'static str,
}

/// Where a `response_format`-like object sits in its API, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatApi {
    /// Chat and completions: `response_format`, the schema under `json_schema.schema`.
    Chat,
    /// `/v1/responses`: `text.format`, the schema directly under it (`schema`).
    Responses,
}

impl FormatApi {
    fn field(self) -> &'static str {
        match self {
            Self::Chat => "response_format",
            Self::Responses => "text.format",
        }
    }

    fn type_field(self) -> &'static str {
        match self {
            Self::Chat => "response_format.type",
            Self::Responses => "text.format.type",
        }
    }

    fn schema_field(self) -> &'static str {
        match self {
            Self::Chat => "response_format.json_schema.schema",
            Self::Responses => "text.format.schema",
        }
    }
}

/// Parses an OpenAI `response_format` (or, for `api` = [`FormatApi::Responses`], a
/// `text.format`): `{"type": "text"}` → `None`; `{"type": "json_object"}`; `{"type":
/// "json_schema", …}` with the schema an object. Anything else is a 400 naming the field.
/// `strict: false` is accepted and the schema enforced anyway (constrained decoding has no
/// weaker mode).
pub fn parse_format(v: &Value, api: FormatApi) -> Result<Option<FormatInput>, ValidationError> {
    if v.is_null() {
        return Ok(None);
    }
    let obj = v
        .as_object()
        .ok_or_else(|| ValidationError::new(api.field(), format!("must be an object, got {v}")))?;
    let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| {
        ValidationError::new(
            api.type_field(),
            "is required: \"text\", \"json_object\" or \"json_schema\"",
        )
    })?;
    let allowed_keys: &[&str] = match (kind, api) {
        ("json_schema", FormatApi::Chat) => &["type", "json_schema"],
        ("json_schema", FormatApi::Responses) => {
            &["type", "name", "schema", "strict", "description"]
        }
        _ => &["type"],
    };
    if let Some(k) = obj.keys().find(|k| !allowed_keys.contains(&k.as_str())) {
        return Err(ValidationError::new(
            api.field(),
            format!("has an unknown field {k:?} for type {kind:?}"),
        ));
    }
    let grammar = match kind {
        "text" => return Ok(None),
        "json_object" => OutputGrammar::JsonObject,
        "json_schema" => {
            let spec = match api {
                FormatApi::Chat => obj.get("json_schema").and_then(Value::as_object).ok_or_else(
                    || {
                        ValidationError::new(
                            "response_format.json_schema",
                            "is required with type \"json_schema\": an object with `name` and `schema`",
                        )
                    },
                )?,
                FormatApi::Responses => obj,
            };
            check_schema_envelope(spec, api)?;
            let schema = spec.get("schema").cloned().ok_or_else(|| {
                ValidationError::new(api.schema_field(), "is required: a JSON Schema object")
            })?;
            if !schema.is_object() {
                return Err(ValidationError::new(
                    api.schema_field(),
                    format!("must be a JSON Schema object, got {schema}"),
                ));
            }
            OutputGrammar::JsonSchema(schema)
        }
        other => {
            return Err(ValidationError::new(
                api.type_field(),
                format!("must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"),
            ))
        }
    };
    Ok(Some(FormatInput {
        grammar,
        field: match kind {
            "json_object" => api.field(),
            _ => api.schema_field(),
        },
    }))
}

/// The `json_schema` object's own fields: `name` a string (OpenAI: `[a-zA-Z0-9_-]`, at most
/// 64), `strict` a boolean, `description` a string; nothing else (besides `schema`, and `type`
/// on `/v1/responses`).
fn check_schema_envelope(
    spec: &serde_json::Map<String, Value>,
    api: FormatApi,
) -> Result<(), ValidationError> {
    let field = match api {
        FormatApi::Chat => "response_format.json_schema",
        FormatApi::Responses => "text.format",
    };
    for (k, v) in spec {
        let ok = match k.as_str() {
            "name" => v.as_str().is_some_and(|n| {
                !n.is_empty()
                    && n.len() <= 64
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            }),
            "strict" => v.is_boolean() || v.is_null(),
            "description" => v.is_string() || v.is_null(),
            "schema" | "type" => true,
            _ => {
                return Err(ValidationError::new(
                    field,
                    format!("has an unknown field {k:?}"),
                ))
            }
        };
        if !ok {
            return Err(ValidationError::new(
                field,
                format!(
                    "`{k}` must be {}, got {v}",
                    match k.as_str() {
                        "name" => "1-64 characters of a-z, A-Z, 0-9, _ and -",
                        "strict" => "a boolean",
                        _ => "a string",
                    }
                ),
            ));
        }
    }
    Ok(())
}

/// gRPC's `ResponseFormat` → a [`FormatInput`] naming `response_format…`; a `json_schema`
/// that is not JSON is a 400 naming it.
pub fn from_wire(f: Option<v1::ResponseFormat>) -> Result<Option<FormatInput>, ValidationError> {
    use v1::response_format::Format;
    match f.and_then(|f| f.format) {
        None => Ok(None),
        Some(Format::JsonObject(_)) => Ok(Some(FormatInput {
            grammar: OutputGrammar::JsonObject,
            field: "response_format.json_object",
        })),
        Some(Format::JsonSchema(text)) => {
            if text.len() > MAX_SCHEMA_BYTES {
                return Err(too_large("response_format.json_schema", text.len()));
            }
            let v: Value = serde_json::from_str(&text).map_err(|e| {
                ValidationError::new("response_format.json_schema", format!("is not JSON: {e}"))
            })?;
            Ok(Some(FormatInput {
                grammar: OutputGrammar::JsonSchema(v),
                field: "response_format.json_schema",
            }))
        }
    }
}

/// The workers' wire shape of a checked grammar.
pub fn to_wire(g: &OutputGrammar) -> v1::ResponseFormat {
    use v1::response_format::Format;
    v1::ResponseFormat {
        format: Some(match g {
            OutputGrammar::JsonObject => Format::JsonObject(v1::JsonObject {}),
            OutputGrammar::JsonSchema(v) => Format::JsonSchema(v.to_string()),
        }),
    }
}

fn too_large(field: &'static str, bytes: usize) -> ValidationError {
    ValidationError::new(
        field,
        format!("must be at most {MAX_SCHEMA_BYTES} bytes of JSON, got {bytes}"),
    )
}

/// Checks `input` by compiling it on the blocking pool with `compiler` (the workers' compiler
/// on the same tokenizer): a schema llguidance refuses (unknown type, unsatisfiable bounds,
/// an unsupported keyword, over its limits) is a 400 naming `input.field` with its reason.
/// Without a compiler (a tokenizer that cannot become a token trie) every grammar is refused.
pub async fn check(
    compiler: Option<&GrammarCompiler>,
    input: FormatInput,
) -> Result<OutputGrammar, ValidationError> {
    let size = serde_json::to_string(&input.grammar.schema()).map_or(0, |s| s.len());
    if size > MAX_SCHEMA_BYTES {
        return Err(too_large(input.field, size));
    }
    let compiler = compiler.cloned().ok_or_else(|| {
        ValidationError::new(
            input.field,
            "cannot be served: constrained decoding is unavailable for this model's tokenizer",
        )
    })?;
    let grammar = input.grammar.clone();
    let compiled = tokio::task::spawn_blocking(move || compiler.compile(&grammar).map(|_| ()))
        .await
        .map_err(|e| ValidationError::new(input.field, format!("could not be compiled: {e}")))?;
    compiled.map_err(|e| {
        ValidationError::new(input.field, format!("is not a usable JSON Schema: {e}"))
    })?;
    Ok(input.grammar)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn response_format_shapes() {
        let chat = |v: Value| parse_format(&v, FormatApi::Chat);
        assert_eq!(chat(json!({"type": "text"})), Ok(None));
        assert_eq!(
            chat(json!({"type": "json_object"})).map(|f| f.map(|f| f.grammar)),
            Ok(Some(OutputGrammar::JsonObject))
        );
        let s = json!({"type": "object"});
        let got = chat(json!({"type": "json_schema",
            "json_schema": {"name": "x", "schema": s, "strict": true}}))
        .expect("valid");
        assert_eq!(
            got,
            Some(FormatInput {
                grammar: OutputGrammar::JsonSchema(s.clone()),
                field: "response_format.json_schema.schema"
            })
        );
        for (bad, field) in [
            (json!({"type": "yaml"}), "response_format.type"),
            (json!({}), "response_format.type"),
            (json!("json"), "response_format"),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_object", "schema": {}}),
                "response_format",
            ),
        ] {
            assert_eq!(
                chat(bad.clone()).expect_err(&bad.to_string()).field,
                field,
                "{bad}"
            );
        }
        let r = parse_format(
            &json!({"type": "json_schema", "name": "x", "schema": s, "strict": true}),
            FormatApi::Responses,
        )
        .expect("valid");
        assert_eq!(r.map(|f| f.field), Some("text.format.schema"));
    }

    #[test]
    fn wire_round_trip() {
        let g = OutputGrammar::JsonSchema(json!({"type": "integer"}));
        let back = from_wire(Some(to_wire(&g))).expect("valid").expect("set");
        assert_eq!(back.grammar, g);
        let bad = v1::ResponseFormat {
            format: Some(v1::response_format::Format::JsonSchema("{".into())),
        };
        assert_eq!(
            from_wire(Some(bad)).expect_err("not JSON").field,
            "response_format.json_schema"
        );
    }
}
