//! Greedy generation through a real cluster (router + 1 prefill + 1 decode process) is exactly
//! the single-process `ferry generate`, through every public front door: gRPC `Generate`
//! (generated stubs), HTTP `/v1/completions` whole and streamed (SSE). The short prompt is
//! prefilled locally on the decode worker, the long one remotely on the prefill worker.
//! Workers on `--load-format dummy` (a `config.json` only) serve what `ferry generate
//! --load-format dummy` prints with the same seed: every process draws the same weights.
//! On the same cluster, penalties, `logit_bias`, `stop_token_ids` and `min_tokens` change
//! what both workers generate, and out-of-range values are a 400 naming the field; log-probabilities
//! come back in OpenAI's shapes (whole and streamed, both endpoints) and on gRPC, the same values
//! everywhere, for remotely prefilled requests too.
mod cluster;

use cluster::{Cluster, Role, Spec, CONTEXT, MODEL};
use ferry_proto::v1::{FinishReason, ListModelsRequest, TokenizeRequest};
use std::collections::HashMap;

use serde_json::json;

/// The golden continuations are 32 tokens long.
const MAX_TOKENS: u32 = 32;

/// Every front door returns `expected` for `prompt`.
async fn assert_all_front_doors(cluster: &Cluster, prompt: &str, expected: &str) {
    let mut client = cluster.grpc().await;
    let out = cluster::generate(&mut client, cluster::greedy_request(prompt, MAX_TOKENS))
        .await
        .expect("Generate succeeds");
    assert_eq!(out.text, expected, "gRPC Generate vs ferry generate");
    assert_eq!(out.token_ids.len(), MAX_TOKENS as usize);
    assert_eq!(out.finish_reason, Some(FinishReason::Length));
    let usage = out.usage.expect("usage on the last message");
    assert_eq!(usage.completion_tokens, MAX_TOKENS);
    assert!(usage.prompt_tokens > 0);

    let body = json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
    });
    let (status, whole) = cluster.post_json("/v1/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["model"], MODEL);
    assert_eq!(
        whole["choices"][0]["text"].as_str(),
        Some(expected),
        "HTTP /v1/completions vs ferry generate"
    );
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], MAX_TOKENS);
    assert_eq!(whole["usage"]["prompt_tokens"], usage.prompt_tokens);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = cluster.post_sse("/v1/completions", &streamed).await;
    assert!(
        chunks.len() > 1,
        "a streamed answer comes in several chunks"
    );
    let (text, finish) = cluster::sse_completion_text(&chunks);
    assert_eq!(text, expected, "HTTP SSE /v1/completions vs ferry generate");
    assert_eq!(finish.as_deref(), Some("length"));
}

#[tokio::test]
async fn greedy_output_through_the_cluster_equals_ferry_generate() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = cluster::reference_generate(&short, MAX_TOKENS).await;
    let long_ref = cluster::reference_generate(&long, MAX_TOKENS).await;
    assert!(!short_ref.is_empty() && !long_ref.is_empty());

    let cluster = Cluster::start(Spec::new(1, 1)).await;
    let decode = cluster.live(Role::Decode)[0].clone();
    let prefill = cluster.live(Role::Prefill)[0].clone();

    // 9 prompt tokens <= the decode worker's local-prefill threshold (32): prefilled there.
    assert_all_front_doors(&cluster, &short, &short_ref).await;
    let d = cluster.stats(&decode).await;
    assert_eq!(
        (d.remote_prefills, d.recomputed_prefills),
        (0, 0),
        "short prompts stay local: {d:?}"
    );
    assert!(d.local_prefills >= 3, "{d:?}");

    // 211 uncached tokens: the first request is prefilled on the prefill worker and its KV
    // shipped; the repeats find 3 blocks cached on the decode worker and compute the 19-token
    // tail there. Both paths must give the same text.
    assert_all_front_doors(&cluster, &long, &long_ref).await;
    let d = cluster.stats(&decode).await;
    assert_eq!(
        d.remote_prefills, 1,
        "the first long prompt is prefilled remotely: {d:?}"
    );
    assert_eq!(d.recomputed_prefills, 0, "{d:?}");
    assert!(d.kv_transfer_bytes > 0, "{d:?}");
    let p = cluster.stats(&prefill).await;
    assert_eq!(p.prefill_computed_tokens, 211, "{p:?}");
    assert!(p.kv_transfer_bytes > 0, "{p:?}");

    // The same cluster: sampling controls through the gateway reach both workers' engines.
    assert_sampling_controls(&cluster, &short, &long, &decode).await;
    assert_logprobs(&cluster, &short, &long, &decode).await;

    cluster.assert_kv_blocks_released().await;
}

/// The completion text of an HTTP answer.
fn completion_text(v: &serde_json::Value) -> &str {
    v["choices"][0]["text"].as_str().unwrap_or_default()
}

/// `body` with the fields of `extra` set.
fn with(body: &serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let mut b = body.clone();
    for (k, v) in extra.as_object().into_iter().flatten() {
        b[k] = v.clone();
    }
    b
}

/// Penalties, `logit_bias`, `stop_token_ids` and `min_tokens` sent to the HTTP gateway (and
/// gRPC) change what the engines generate — on the decode worker, and on the prefill worker
/// that samples a remotely prefilled request's first token — and out-of-range values are a
/// 400 naming the field.
async fn assert_sampling_controls(cluster: &Cluster, short: &str, long: &str, decode: &str) {
    const N: u32 = 12;
    let mut client = cluster.grpc().await;
    let base = cluster::generate(&mut client, cluster::greedy_request(short, N))
        .await
        .expect("Generate succeeds");
    let body = json!({
        "model": MODEL,
        "prompt": short,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": true,
    });
    let post = |b: serde_json::Value| async move {
        let (status, out) = cluster.post_json("/v1/completions", &b).await;
        assert_eq!(status, 200, "{b}: {out}");
        out
    };

    // logit_bias -100 on the greedy first token: another token comes first, through both
    // front doors alike.
    let first = base.token_ids[0];
    let biased = post(with(
        &body,
        json!({"logit_bias": {first.to_string(): -100}}),
    ))
    .await;
    assert_ne!(
        completion_text(&biased),
        base.text,
        "logit_bias -100 changes the output"
    );
    let mut req = cluster::greedy_request(short, N);
    if let Some(s) = req.sampling.as_mut() {
        s.logit_bias = HashMap::from([(first, -100.0)]);
    }
    let g = cluster::generate(&mut client, req).await.expect("Generate");
    assert_ne!(g.token_ids[0], first, "the biased token is not chosen");
    assert_eq!(
        g.text,
        completion_text(&biased),
        "gRPC and HTTP apply the same bias"
    );

    // Each penalty changes a greedy output that repeats itself.
    for extra in [
        json!({"frequency_penalty": 2}),
        json!({"presence_penalty": 2}),
        json!({"repetition_penalty": 2}),
    ] {
        let out = post(with(&body, extra.clone())).await;
        assert_ne!(
            completion_text(&out),
            base.text,
            "{extra} changes the output"
        );
    }
    let chat = json!({"messages": [{"role": "user", "content": short}], "max_tokens": N,
                      "temperature": 0, "ignore_eos": true});
    let (_, plain) = cluster.post_json("/v1/chat/completions", &chat).await;
    let (status, penalised) = cluster
        .post_json(
            "/v1/chat/completions",
            &with(&chat, json!({"frequency_penalty": 2})),
        )
        .await;
    assert_eq!(status, 200, "{penalised}");
    assert_ne!(
        penalised["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"],
        "chat: frequency_penalty changes the output"
    );

    // stop_token_ids end generation before the token; min_tokens holds it back.
    let stop_at = base.token_ids[3];
    let cut = base
        .token_ids
        .iter()
        .position(|&t| t == stop_at)
        .unwrap_or(3);
    let mut req = cluster::greedy_request(short, N);
    if let Some(s) = req.stop.as_mut() {
        s.stop_token_ids = vec![stop_at];
    }
    let g = cluster::generate(&mut client, req.clone())
        .await
        .expect("Generate");
    assert_eq!(
        g.token_ids,
        base.token_ids[..cut],
        "stops before the stop token"
    );
    assert_eq!(g.finish_reason, Some(FinishReason::Stop));
    let stopped = post(with(&body, json!({"stop_token_ids": [stop_at]}))).await;
    assert_eq!(completion_text(&stopped), g.text);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    if let Some(s) = req.stop.as_mut() {
        s.min_tokens = u32::try_from(cut).unwrap_or(0) + 2;
    }
    let g = cluster::generate(&mut client, req).await.expect("Generate");
    assert!(
        g.token_ids.len() >= cut + 2,
        "min_tokens: {:?}",
        g.token_ids
    );
    assert!(
        !g.token_ids[..cut + 2].contains(&stop_at),
        "{:?}",
        g.token_ids
    );

    // A fresh long prompt is prefilled remotely: the prefill worker samples its first token
    // with the request's controls, exactly as the decode worker does once the prompt is cached
    // there, and differently from plain greedy decoding.
    let fresh = format!("Once more. {long}");
    // Its plain greedy first token, from a single-process run (the cluster has not seen it).
    let expected = cluster::reference_generate(&fresh, 1).await;
    let ids = cluster::tokens(cluster, &expected).await;
    assert_eq!(ids.len(), 2, "BOS and one token for {expected:?}: {ids:?}");
    let plain_first = ids[1];
    let one = json!({"model": MODEL, "prompt": fresh, "max_tokens": 1, "temperature": 0,
                     "repetition_penalty": 2, "logit_bias": {plain_first.to_string(): -100}});
    let before = cluster.stats(decode).await.remote_prefills;
    let remote = post(one.clone()).await;
    assert_eq!(
        cluster.stats(decode).await.remote_prefills,
        before + 1,
        "prefilled remotely"
    );
    assert_ne!(
        completion_text(&remote),
        expected,
        "the prefill worker applied the bias"
    );
    let local = post(one).await;
    assert_eq!(
        cluster.stats(decode).await.remote_prefills,
        before + 1,
        "then cached here"
    );
    assert_eq!(
        completion_text(&remote),
        completion_text(&local),
        "prefill worker == decode worker"
    );

    // Out of range: a 400 naming the field, from the real router.
    for (extra, field) in [
        (json!({"logit_bias": {"999999": 1}}), "logit_bias"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"min_tokens": N + 1}), "min_tokens"),
    ] {
        let (status, out) = cluster
            .post_json("/v1/completions", &with(&body, extra))
            .await;
        assert_eq!(
            (status, &out["error"]["param"]),
            (400, &json!(field)),
            "{out}"
        );
    }
}

#[tokio::test]
async fn dummy_weights_serve_through_the_cluster_like_ferry_generate() {
    // A directory holding only the embedded model's config.json, named like it.
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tiny-k3");
    std::fs::create_dir(&dir).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3/config.json");
    std::fs::copy(src, dir.join("config.json")).unwrap();
    let dir = dir.to_str().unwrap().to_string();
    let long = cluster::long_prompt();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "generate",
            "--model",
            &dir,
            "--load-format",
            "dummy",
            "--dummy-seed",
            "3",
        ])
        .args(["--device", "cpu", "--ignore-eos", "--max-tokens"])
        .arg(MAX_TOKENS.to_string())
        .args(["--prompt", &long])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = String::from_utf8(out.stdout)
        .unwrap()
        .trim_end_matches('\n')
        .to_string();

    let worker = [
        "--model",
        &dir,
        "--load-format",
        "dummy",
        "--dummy-seed",
        "3",
        "--device",
        "cpu",
    ];
    let spec = Spec::new(1, 1)
        .router(&["--model", &dir])
        .prefill(&worker)
        .decode(&worker);
    let cluster = Cluster::start(spec).await;
    let mut client = cluster.grpc().await;
    let got = cluster::generate(&mut client, cluster::greedy_request(&long, MAX_TOKENS))
        .await
        .expect("Generate succeeds");
    assert_eq!(got.text, want, "dummy cluster vs ferry generate, same seed");
    let decode = cluster.live(Role::Decode)[0].clone();
    let d = cluster.stats(&decode).await;
    assert_eq!(
        d.remote_prefills, 1,
        "the long prompt came from the prefill worker: {d:?}"
    );
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn list_models_tokenize_and_models_endpoint() {
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let mut client = cluster.grpc().await;

    let models = client
        .list_models(ListModelsRequest {})
        .await
        .expect("ListModels")
        .into_inner()
        .models;
    assert_eq!(models.len(), 1, "{models:?}");
    assert_eq!(models[0].name, MODEL);
    assert_eq!(models[0].context_length as usize, CONTEXT);
    assert_eq!(models[0].architecture, "DeepseekV3ForCausalLM");

    let (status, list) = cluster.get_json("/v1/models").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], MODEL);

    // The golden prompt ids were written by the Hugging Face tokenizer (BOS included).
    let case = &cluster::golden_cases()[0];
    let want: Vec<u32> = case["prompt_ids"]
        .as_array()
        .expect("prompt_ids")
        .iter()
        .map(|v| v.as_u64().expect("an id") as u32)
        .collect();
    let tokenize = |add_special_tokens: bool| TokenizeRequest {
        model: MODEL.into(),
        text: case["prompt"].as_str().expect("prompt").into(),
        add_special_tokens,
    };
    let ids = client
        .tokenize(tokenize(true))
        .await
        .expect("Tokenize")
        .into_inner()
        .ids;
    assert_eq!(ids, want);
    let bare = client
        .tokenize(tokenize(false))
        .await
        .expect("Tokenize")
        .into_inner()
        .ids;
    assert_eq!(bare.as_slice(), &want[1..], "without the BOS token");

    cluster.assert_kv_blocks_released().await;
}

/// The f32s of a JSON array.
fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_f64())
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default()
}

/// Log-probabilities through every front door: gRPC gives one per token with the asked number
/// of alternatives (greedy: the chosen token is the most likely); HTTP completions and chat, whole
/// and streamed, give the same values in OpenAI's shapes; a request prefilled on the prefill
/// worker gets its first token's too.
async fn assert_logprobs(cluster: &Cluster, short: &str, long: &str, decode: &str) {
    const N: u32 = 8;
    let mut client = cluster.grpc().await;
    let mut req = cluster::greedy_request(short, N);
    req.logprobs = Some(3);
    let g = cluster::generate(&mut client, req).await.expect("Generate");
    assert_eq!(g.token_ids.len(), N as usize);
    let lps = &g.logprobs;
    assert_eq!(lps.len(), g.token_ids.len(), "one per token");
    for (lp, &t) in lps.iter().zip(&g.token_ids) {
        assert_eq!(lp.token_id, t);
        assert!(lp.logprob <= 0.0, "{lp:?}");
        assert_eq!(lp.top_logprobs.len(), 3, "{lp:?}");
        assert_eq!(
            lp.top_logprobs[0].token_id, t,
            "greedy: the most likely token"
        );
        assert_eq!(lp.top_logprobs[0].logprob, lp.logprob);
        assert!(lp
            .top_logprobs
            .windows(2)
            .all(|w| w[0].logprob >= w[1].logprob));
    }
    let want: Vec<f32> = lps.iter().map(|l| l.logprob).collect();
    let close = |got: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (a, b) in got.iter().zip(&want) {
            // JSON carries the f32 as a decimal that parses back to the same f32.
            assert!((a - b).abs() <= 1e-6, "{what}: {a} vs {b}");
        }
    };

    let body = json!({"model": MODEL, "prompt": short, "max_tokens": N, "temperature": 0,
                      "ignore_eos": true, "logprobs": 2});
    let (status, whole) = cluster.post_json("/v1/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let lp = &whole["choices"][0]["logprobs"];
    close(&floats(&lp["token_logprobs"]), "completions token_logprobs");
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|t| t.as_str())
        .collect();
    assert_eq!(
        tokens.concat(),
        completion_text(&whole),
        "the tokens spell the text"
    );
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .filter_map(|o| o.as_u64())
        .collect();
    assert_eq!(offsets.first(), Some(&0));
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    for top in lp["top_logprobs"].as_array().expect("top_logprobs") {
        let n = top.as_object().map_or(0, |m| m.len());
        assert!((1..=2).contains(&n), "{top}");
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = cluster.post_sse("/v1/completions", &streamed).await;
    let mut got = Vec::new();
    for c in &chunks {
        got.extend(floats(&c["choices"][0]["logprobs"]["token_logprobs"]));
    }
    close(&got, "streamed completions");
    let (_, plain) = cluster
        .post_json("/v1/completions", &with(&body, json!({"logprobs": null})))
        .await;
    assert!(plain["choices"][0]["logprobs"].is_null(), "not asked: null");

    let chat = json!({"messages": [{"role": "user", "content": short}], "max_tokens": N,
                      "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let (status, whole) = cluster.post_json("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content")
        .clone();
    assert_eq!(content.len(), N as usize);
    let mut text = String::new();
    for e in &content {
        let token = e["token"].as_str().expect("token");
        text.push_str(token);
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .filter_map(|b| b.as_u64())
            .map(|b| b as u8)
            .collect();
        assert_eq!(bytes, token.as_bytes());
        assert!(e["logprob"].as_f64().is_some_and(|l| l <= 0.0), "{e}");
        assert_eq!(e["top_logprobs"].as_array().map(Vec::len), Some(2), "{e}");
        assert_eq!(
            e["top_logprobs"][0]["token"], e["token"],
            "greedy: the most likely"
        );
    }
    assert_eq!(
        Some(text.as_str()),
        whole["choices"][0]["message"]["content"].as_str()
    );
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let chunks = cluster.post_sse("/v1/chat/completions", &streamed).await;
    let count: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(count, N as usize, "streamed chat: one entry per token");

    // Prefilled remotely: the prefill worker returns the first token's.
    let before = cluster.stats(decode).await.remote_prefills;
    let mut req = cluster::greedy_request(&format!("And again: {long}"), 4);
    req.logprobs = Some(1);
    let g = cluster::generate(&mut client, req).await.expect("Generate");
    assert_eq!(
        cluster.stats(decode).await.remote_prefills,
        before + 1,
        "prefilled remotely"
    );
    assert_eq!(
        g.logprobs.len(),
        4,
        "the first token's came from the prefill worker"
    );
    assert_eq!(g.logprobs[0].token_id, g.token_ids[0]);
}

/// Structured output on gRPC (`GenerateRequest.response_format`): a JSON Schema constrains the
/// completion, prefilled locally (short prompt) and on the prefill worker (long prompt, whose
/// first token the prefill worker samples under the grammar), greedy and sampled: the text is
/// JSON valid under the schema and the finish reason is STOP; a schema that is not JSON, and
/// one the grammar engine refuses, are INVALID_ARGUMENT naming `response_format.json_schema`.
#[tokio::test]
async fn grpc_response_format_constrains_the_output() {
    use ferry_proto::v1::{response_format::Format, ResponseFormat, SamplingParams};
    let cluster = Cluster::start(Spec::new(1, 1)).await;
    let mut client = cluster.grpc().await;
    let schema = json!({
        "type": "object",
        "properties": {
            "book": {"enum": ["Genesis", "Exodus", "Ruth"]},
            "chapter": {"type": "integer", "minimum": 1, "maximum": 50},
            "words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                      "maxItems": 3}
        },
        "required": ["book", "chapter", "words"],
        "additionalProperties": false
    });
    let format = |text: String| ResponseFormat {
        format: Some(Format::JsonSchema(text)),
    };
    let long = "And it came to pass after these things, that God did tempt Abraham, and said \
                unto him, Abraham: and he said, Behold, here I am. And he said, Take now thy son";
    for (prompt, seed) in [("In the beginning", None), (long, None), (long, Some(11))] {
        let sampling = match seed {
            None => cluster::greedy(),
            Some(s) => SamplingParams {
                temperature: Some(1.0),
                seed: Some(s),
                ..SamplingParams::default()
            },
        };
        let mut req = cluster::request(prompt, 120, sampling, false);
        req.response_format = Some(format(schema.to_string()));
        let out = cluster::generate(&mut client, req).await.expect("Generate");
        let case = format!("{prompt:?} seed {seed:?}: {:?}", out.text);
        assert_eq!(out.finish_reason, Some(FinishReason::Stop), "{case}");
        let v: serde_json::Value = serde_json::from_str(&out.text).expect(&case);
        assert!(
            ["Genesis", "Exodus", "Ruth"].contains(&v["book"].as_str().unwrap_or("")),
            "{case}"
        );
        assert!(
            v["chapter"].as_u64().is_some_and(|c| (1..=50).contains(&c)),
            "{case}"
        );
        assert!(
            v["words"].as_array().is_some_and(|w| w.len() <= 3),
            "{case}"
        );
    }
    for bad in [
        "{not json".to_string(),
        json!({"type": "integer", "minimum": 3, "maximum": 2}).to_string(),
    ] {
        let mut req = cluster::greedy_request("In the beginning", 8);
        req.response_format = Some(format(bad.clone()));
        let e = cluster::generate(&mut client, req).await.expect_err(&bad);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}: {e:?}");
        assert!(
            e.message().contains("response_format.json_schema"),
            "{bad}: {e:?}"
        );
    }
    cluster.assert_kv_blocks_released().await;
}
