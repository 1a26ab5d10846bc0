//! `ferry generate` as a user runs it: a real process, its stdout and its errors.

use std::path::Path;
use std::process::{Command, Output};

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("ferry runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn greedy_generation_prints_the_reference_continuation() {
    // The golden continuation was produced by transformers from the same checkpoint.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3/golden/cases.json");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir).unwrap()).unwrap();
    let case = &meta["cases"][0];
    let prompt = case["prompt"].as_str().unwrap();
    let expected = case["greedy_text"].as_str().unwrap();
    let n = case["greedy_ids"].as_array().unwrap().len().to_string();
    let out = ferry(&[
        "generate",
        "--prompt",
        prompt,
        "--max-tokens",
        &n,
        "--ignore-eos",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{expected}\n")
    );
}

#[test]
fn seeded_sampling_is_reproducible() {
    let args = [
        "generate",
        "--prompt",
        "And Moses said",
        "--max-tokens",
        "24",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--seed",
        "11",
    ];
    let a = ferry(&args);
    let b = ferry(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(!a.stdout.is_empty());
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn chat_template_is_applied() {
    let out = ferry(&[
        "generate",
        "--prompt",
        "Hello",
        "--chat",
        "--max-tokens",
        "4",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn missing_model_directory_is_a_clear_error() {
    let out = ferry(&[
        "generate",
        "--model",
        "/definitely/not/here",
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("/definitely/not/here"),
        "{}",
        stderr(&out)
    );
}

fn model_copy_with_config(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    dir
}

#[test]
fn malformed_config_is_a_clear_error() {
    let dir = model_copy_with_config("{ \"architectures\": [");
    let out = ferry(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("invalid JSON"), "{}", stderr(&out));
}

#[test]
fn unsupported_architecture_is_named() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3/config.json");
    let config = std::fs::read_to_string(src)
        .unwrap()
        .replace("DeepseekV3ForCausalLM", "LlamaForCausalLM");
    let dir = model_copy_with_config(&config);
    let out = ferry(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("LlamaForCausalLM"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn prompt_longer_than_the_context_is_rejected() {
    let long = "and the ".repeat(700);
    let out = ferry(&["generate", "--prompt", &long]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("context is 1024"), "{}", stderr(&out));
}

#[test]
fn invalid_sampling_flags_name_the_field() {
    let out = ferry(&["generate", "--prompt", "x", "--temperature", "-1"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("temperature"), "{}", stderr(&out));
    let out = ferry(&["generate", "--prompt", "x", "--max-tokens", "0"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("max-tokens"), "{}", stderr(&out));
}

#[test]
fn a_named_gpu_that_cannot_be_opened_is_an_error() {
    // GPU 99 exists nowhere: the command names it and the reason instead of running elsewhere.
    let out = ferry(&["generate", "--prompt", "x", "--device", "cuda:99"]);
    assert!(!out.status.success(), "ran: {}", stderr(&out));
    assert!(
        stderr(&out).contains("cuda:99") && stderr(&out).contains("unavailable"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn speculative_on_without_a_drafter_is_an_error_and_auto_decodes_plainly() {
    // The same weights under a config that is not byte-identical to the embedded one: no
    // default drafter applies.
    let embedded = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3/config.json");
    let config = std::fs::read_to_string(embedded).unwrap() + "\n";
    let dir = model_copy_with_config(&config);
    let model = dir.path().to_str().unwrap();
    let base = ["generate", "--model", model, "--prompt", "And Moses said"];
    let on = ferry(&[&base[..], &["--speculative", "on", "--device", "cpu"]].concat());
    assert!(!on.status.success(), "ran without a drafter");
    assert!(stderr(&on).contains("--drafter"), "{}", stderr(&on));
    // `auto` decodes plainly, with the text of the embedded model (same weights).
    let auto = ferry(&[&base[..], &["--max-tokens", "8", "--device", "cpu"]].concat());
    assert!(auto.status.success(), "{}", stderr(&auto));
    let embedded_out = ferry(&[
        "generate",
        "--prompt",
        "And Moses said",
        "--max-tokens",
        "8",
        "--device",
        "cpu",
    ]);
    assert_eq!(auto.stdout, embedded_out.stdout);
}

/// A directory holding only the embedded model's `config.json`, named like it (so a router
/// serves it under the same name): what `--load-format dummy` needs.
fn config_only_model() -> (tempfile::TempDir, std::path::PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tiny-k3");
    std::fs::create_dir(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3/config.json");
    std::fs::copy(src, dir.join("config.json")).unwrap();
    (root, dir)
}

#[test]
fn dummy_weights_need_only_a_config_and_are_seeded() {
    let (_root, dir) = config_only_model();
    let dir = dir.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            dir,
            "--device",
            "cpu",
            "--prompt",
            "In the beginning",
            "--max-tokens",
            "12",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        ferry(&args)
    };
    // Without weights and without `--load-format dummy`: a clear error naming the file.
    let out = run(&[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("model.safetensors"),
        "{}",
        stderr(&out)
    );
    // With it: config.json alone serves, with the embedded tokenizer (said on stderr).
    let a = run(&["--load-format", "dummy"]);
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(stderr(&a).contains("no tokenizer.json"), "{}", stderr(&a));
    let text = String::from_utf8(a.stdout.clone()).unwrap();
    assert!(text.trim().len() > 1, "{text:?}");
    // Seeded: the same seed gives the same weights and text, another seed other text; and
    // the weights are not the checkpoint's (the embedded model's continuation differs).
    let again = run(&["--load-format", "dummy", "--dummy-seed", "0"]);
    assert_eq!(a.stdout, again.stdout);
    let other = run(&["--load-format", "dummy", "--dummy-seed", "7"]);
    assert!(other.status.success(), "{}", stderr(&other));
    assert_ne!(a.stdout, other.stdout, "another seed, other weights");
    let real = ferry(&[
        "generate",
        "--device",
        "cpu",
        "--prompt",
        "In the beginning",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]);
    assert_ne!(
        a.stdout, real.stdout,
        "dummy weights are not the checkpoint's"
    );
}
