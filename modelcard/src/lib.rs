//! What a ferry model *is*, without computing it: everything the router needs about the model
//! it fronts, so the router builds no compute stack (no `ferry-kernels`, no CUDA bindings).
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | Hugging Face `config.json` → validated [`config::ModelConfig`] |
//! | [`rope`] | RoPE / YaRN parameters as the config states them |
//! | [`tokenizer`] | `tokenizer.json` through `tokenizers`, chat templates through `minijinja`, streaming detokenization |
//! | [`sampling`] | a request's [`sampling::SamplingParams`] and their range check |
//! | [`grammar`] | constrained decoding: JSON Schema / JSON object → per-request token masks (llguidance) |
//! | [`embedded`] | the embedded default model and its DSpark drafter, compiled into the binary |
//! | [`error`] | [`CardError`] |
//!
//! Prefix block hashes are part of the router ↔ worker contract and live with it, in
//! `ferry_proto::block_hash`.
pub mod config;
pub mod embedded;
pub mod error;
pub mod grammar;
pub mod rope;
pub mod sampling;
pub mod tokenizer;

pub use error::CardError;
