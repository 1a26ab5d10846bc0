//! `GrammarCompiler` / `Grammar` on the embedded model's tokenizer: masks allow exactly the
//! tokens that keep the output a prefix of valid JSON, random walks through the masks always
//! end in JSON valid under the schema, rollback restores the state, invalid schemas fail to
//! compile with llguidance's reason.
use std::sync::Arc;

use ferry_modelcard::embedded::default_model_dir;
use ferry_modelcard::grammar::{Grammar, GrammarCompiler, GrammarError, OutputGrammar};
use ferry_modelcard::tokenizer::Tokenizer;
use serde_json::{json, Value};

fn compiler() -> (Arc<Tokenizer>, GrammarCompiler, u32) {
    let tok = Arc::new(Tokenizer::from_dir(&default_model_dir()).expect("embedded tokenizer"));
    let eos = tok.token_id("<|eos|>").expect("eos");
    // The model's vocabulary is padded past the tokenizer's: padding ids are never allowed.
    let vocab = tok.vocab_size() + 40;
    let c = GrammarCompiler::new(tok.clone(), vocab, &[eos]).expect("compiler");
    assert_eq!(c.vocab(), vocab);
    (tok, c, eos)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tribe": {"enum": ["Judah", "Levi", "Dan"]}
        },
        "required": ["name", "age", "tribe"],
        "additionalProperties": false
    })
}

/// A walk through the grammar choosing, at each step, the allowed token picked by `pick`
/// from the allowed list; returns the tokens (EOS excluded) once EOS is chosen or the
/// grammar stops.
fn walk(g: &mut Grammar, eos: u32, mut pick: impl FnMut(&[u32]) -> u32) -> Vec<u32> {
    let mut out = Vec::new();
    for _ in 0..400 {
        let allowed = Grammar::tokens_of(&g.allowed().expect("mask"));
        assert!(!allowed.is_empty(), "an empty mask after {out:?}");
        let t = pick(&allowed);
        if t == eos {
            return out;
        }
        g.consume(t).expect("an allowed token is consumed");
        out.push(t);
        if g.is_stopped() {
            return out;
        }
    }
    panic!("no end after 400 tokens: {out:?}");
}

#[test]
fn random_walks_give_valid_json() {
    let (tok, c, eos) = compiler();
    let mut state = 0x9e37_79b9_u64;
    for _ in 0..20 {
        let mut g = c
            .compile(&OutputGrammar::JsonSchema(schema()))
            .expect("compiles");
        let tokens = walk(&mut g, eos, |allowed| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            allowed[(state % allowed.len() as u64) as usize]
        });
        let text = tok.decode(&tokens, false).expect("decodes");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let name = v["name"].as_str().expect("name");
        assert!(name.chars().count() <= 12, "{text}");
        let age = v["age"].as_i64().expect("age");
        assert!((0..=150).contains(&age), "{text}");
        assert!(["Judah", "Levi", "Dan"].contains(&v["tribe"].as_str().expect("tribe")));
        assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
        // Compact: no whitespace between JSON tokens.
        assert!(!text.starts_with(' ') && !text.contains("\": "), "{text}");
    }
}

#[test]
fn eos_only_where_the_output_may_end_and_padding_never() {
    let (tok, c, eos) = compiler();
    let mut g = c.compile(&OutputGrammar::JsonObject).expect("compiles");
    let first = Grammar::tokens_of(&g.allowed().expect("mask"));
    assert!(!first.contains(&eos), "EOS before any output");
    assert!(first.iter().all(|&t| (t as usize) < tok.vocab_size()));
    for t in &first {
        let text = tok.decode(&[*t], false).expect("decodes");
        assert!(
            text.trim_start().starts_with('{'),
            "{text:?} cannot start an object"
        );
    }
    for t in tok.encode_text("{}", false).expect("encodes") {
        g.consume(t).expect("consumes");
    }
    assert!(
        g.is_stopped(),
        "a complete top-level object ends the output"
    );
    assert_eq!(Grammar::tokens_of(&g.allowed().expect("mask")), vec![eos]);
}

#[test]
fn rollback_and_valid_prefix() {
    let (tok, c, _) = compiler();
    let mut g = c
        .compile(&OutputGrammar::JsonSchema(schema()))
        .expect("compiles");
    let start = g.allowed().expect("mask");
    let good = tok.encode_text("{\"name\":\"Ab\"", false).expect("encodes");
    // `}` now: the other properties are required.
    let mut bad = good.clone();
    bad.extend(tok.encode_text("}", false).expect("encodes"));
    assert_eq!(g.valid_prefix(&bad).expect("validates"), good.len());
    for &t in &good {
        g.consume(t).expect("consumes");
    }
    assert_ne!(g.allowed().expect("mask"), start);
    g.rollback(good.len()).expect("rolls back");
    assert_eq!(g.allowed().expect("mask"), start);
    let wrong = tok.encode_text("[", false).expect("encodes");
    assert!(matches!(g.consume(wrong[0]), Err(GrammarError::Matcher(_))));
}

#[test]
fn invalid_schemas_are_refused() {
    let (_, c, _) = compiler();
    for bad in [
        json!({"type": "no-such-type"}),
        json!({"type": "integer", "minimum": 5, "maximum": 1}),
        json!("object"),
    ] {
        let e = c
            .compile(&OutputGrammar::JsonSchema(bad.clone()))
            .expect_err(&format!("{bad} compiled"));
        assert!(
            matches!(e, GrammarError::Compile(_) | GrammarError::Schema(_)),
            "{e:?}"
        );
    }
}

#[test]
fn local_refs_and_patterns_compile_and_constrain() {
    let (tok, c, eos) = compiler();
    let schema = json!({
        "$defs": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/code"}, "b": {"$ref": "#/$defs/code"}},
        "required": ["a", "b"],
        "additionalProperties": false
    });
    let mut g = c
        .compile(&OutputGrammar::JsonSchema(schema))
        .expect("compiles");
    let mut state = 7u64;
    let tokens = walk(&mut g, eos, |allowed| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        allowed[((state >> 33) % allowed.len() as u64) as usize]
    });
    let text = tok.decode(&tokens, false).expect("decodes");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    for k in ["a", "b"] {
        let s = v[k].as_str().expect("a string");
        assert!(
            s.len() == 3
                && s[..2].chars().all(|c| c.is_ascii_uppercase())
                && s.as_bytes()[2].is_ascii_digit(),
            "{text}"
        );
    }
}
