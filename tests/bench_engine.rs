//! `ferry bench-engine --verify-cost` as a user runs it: a real process on the CPU, its table
//! and its JSON.

use std::path::Path;
use std::process::{Command, Output};

/// `ferry bench-engine --verify-cost` on the CPU: the embedded target's shapes with dummy
/// weights, 64 cached tokens per sequence, then `args`.
fn verify_cost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["bench-engine", "--verify-cost", "--device", "cpu"])
        .args(["--load-format", "dummy", "--prompt-len", "64"])
        .args(args)
        .env_remove("FERRY_DEVICE")
        .output()
        .expect("ferry runs")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// The embedded target with a drafter of the embedded drafter's shapes and random weights
/// (`--drafter-config`): every (batch, k) row is measured, the computed speed-up appears
/// exactly where an acceptance length was given and follows its formula from the row's own
/// costs, and a drafter config that does not fit the target is an error naming why.
#[test]
fn verify_cost_measures_every_row_and_computes_the_speedup_from_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("a temporary directory");
    let json = dir.path().join("verify.json");
    let drafter = root.join("models/tiny-k3-dspark/config.json");
    let out = verify_cost(&[
        "--batch",
        "1,2",
        "--verify-k",
        "3,1",
        "--repeat",
        "1",
        "--tau",
        "3:2.5",
        "--drafter-config",
        path(&drafter),
        "--json",
        path(&json),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("(τ 2.5)"), "{stdout}");

    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON file")).expect("JSON");
    assert_eq!(doc["benchmark"], "bench-engine --verify-cost");
    assert_eq!(doc["drafter_block_size"], 4);
    let rows = doc["rows"].as_array().expect("rows");
    let keys: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| (r["batch"].as_u64().unwrap(), r["k"].as_u64().unwrap()))
        .collect();
    // Verify lengths in increasing order whatever order they were given in.
    assert_eq!(keys, [(1, 1), (1, 3), (2, 1), (2, 3)]);
    for r in rows {
        let ms = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
        let (step, verify, draft) = (ms("decode_step_ms"), ms("verify_ms"), ms("draft_pass_ms"));
        assert!(step > 0.0 && verify > 0.0 && draft > 0.0, "{r}");
        // No drafter graphs on the CPU: the eager pass is what serving pays.
        assert!(r["draft_pass_graph_ms"].is_null(), "{r}");
        assert_eq!(draft, ms("draft_pass_eager_ms"), "{r}");
        if r["k"] == 3 {
            assert_eq!(r["tau"], 2.5);
            let expected = 2.5 * step / (draft + verify);
            assert!((ms("computed_speedup") - expected).abs() < 1e-9, "{r}");
        } else {
            assert!(r["tau"].is_null() && r["computed_speedup"].is_null(), "{r}");
        }
    }

    // A drafter sized for another target (V2-Lite's width) is refused before anything runs.
    let v2_lite = root.join("models/dummy/v2-lite-drafter/config.json");
    let out = verify_cost(&["--batch", "1", "--drafter-config", path(&v2_lite)]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hidden_size"), "{err}");
}

/// `ferry bench-engine --speculative --prompts FILE` on the CPU: the requests decode the file's
/// token ids (cut to `--prompt-len`), and each row says where both engines' steps went — the
/// plain engine only decodes plainly, the speculating one (`fixed:4`) verifies rounds whose
/// drafter share is part of their time. A prompt shorter than `--prompt-len` or with an id
/// outside the vocabulary is an error naming the file's line.
#[test]
fn speculative_bench_on_given_prompts_breaks_the_steps_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("a temporary directory");
    // The replay golden's prompts, each continued by its greedy tokens: real text, 24 ids.
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join("models/tiny-k3-dspark/golden/replay.json")).expect("golden"),
    )
    .expect("JSON");
    let lines: Vec<String> = golden
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let ids: Vec<u64> = c["prompt_ids"]
                .as_array()
                .into_iter()
                .chain(c["tokens"].as_array())
                .flatten()
                .map(|t| t.as_u64().expect("an id"))
                .collect();
            serde_json::json!({ "ids": ids }).to_string()
        })
        .collect();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts, lines.join("\n")).expect("write prompts");
    let json = dir.path().join("spec.json");
    // Two clients by default; `level` replaces `--batch 2` (e.g. with `--requests`).
    let bench_level = |prompts: &Path, json: Option<&Path>, level: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
        c.args(["bench-engine", "--speculative", "--device", "cpu"])
            .args(level)
            .args(["--prompt-len", "24", "--decode-steps", "16"])
            .args([
                "--repeat",
                "1",
                "--verify-len",
                "fixed:4",
                "--prompts",
                path(prompts),
            ])
            .env_remove("FERRY_DEVICE");
        if let Some(j) = json {
            c.args(["--json", path(j)]);
        }
        c.output().expect("ferry runs")
    };
    let bench = |prompts: &Path, json: Option<&Path>| bench_level(prompts, json, &["--batch", "2"]);
    // A run on `prompts` that succeeds, and its JSON file.
    let run_doc = |level: &[&str]| -> serde_json::Value {
        let out = bench_level(&prompts, Some(&json), level);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON file")).expect("JSON")
    };
    let doc = run_doc(&["--batch", "2"]);
    assert_eq!(doc["prompts"], path(&prompts));
    // Each level is warmed by `c` requests of 32 tokens that the counters below leave out.
    assert_eq!(doc["warmup_tokens"], 32, "{doc}");
    let row = &doc["rows"][0];
    let (plain, spec) = (&row["engine_steps"]["plain"], &row["engine_steps"]["spec"]);
    // Two requests of 16 tokens: one prompt step gives both first tokens, then 15 plain steps.
    assert_eq!(plain["prompt"]["steps"], 1, "{plain}");
    assert_eq!(plain["decode"]["steps"], 15, "{plain}");
    assert_eq!(plain["spec_round"]["steps"], 0, "{plain}");
    assert!(plain["spec_round"]["ms"].is_null(), "{plain}");
    let n = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    let round = &spec["spec_round"];
    assert!(n(round, "steps") > 0.0, "{spec}");
    // The phases add up to the step; a round plans (drafts), a plain step does not.
    let phases: f64 = ["plan_ms", "launch_ms", "sample_ms", "commit_ms"]
        .iter()
        .map(|k| n(round, k))
        .sum();
    assert!((phases - n(round, "ms")).abs() < 1e-6, "{round}");
    assert!(n(round, "plan_ms") > 0.0, "{round}");
    assert_eq!(n(&plain["decode"], "plan_ms"), 0.0, "{plain}");
    // How full the steps were: both requests decode in every plain step, one row each; a
    // round's rows are its sequences' plus the drafts they verified (fixed:4: up to 4 each).
    assert_eq!(n(&plain["decode"], "sequences_per_step"), 2.0, "{plain}");
    assert_eq!(n(&plain["decode"], "decode_rows_per_step"), 2.0, "{plain}");
    let (seqs, rows) = (
        n(round, "sequences_per_step"),
        n(round, "decode_rows_per_step"),
    );
    assert!(
        (1.0..=2.0).contains(&seqs) && rows > seqs && rows <= 5.0 * seqs,
        "{round}"
    );
    // The speculating engine's rounds by the head's prediction: eight bins from 0 up, with
    // this level's rounds counted in them.
    let bins = row["spec_by_prediction"].as_array().expect("bins");
    assert_eq!(bins.len(), 8, "{row}");
    assert_eq!(bins[0]["from"], 0.0, "{row}");
    let binned: f64 = bins.iter().map(|b| n(b, "rounds")).sum();
    assert!(binned > 0.0, "{row}");
    // ...and by the drafts they verified: fixed:4, so 4 or fewer, as many rounds as binned.
    let widths = row["spec_rounds_by_width"].as_array().expect("widths");
    assert!((2..=5).contains(&widths.len()), "{row}");
    let by_width: f64 = widths.iter().map(|w| w.as_f64().unwrap_or(0.0)).sum();
    assert_eq!(by_width, binned, "{row}");
    // Steps replayed from CUDA graphs are counted per kind: none on the CPU.
    assert_eq!(round["graphed_steps"], 0, "{round}");
    assert_eq!(plain["decode"]["graphed_steps"], 0, "{plain}");

    // Sampled (`--temperature 0.7`): the requests go unseeded, so the speculating engine
    // verifies rounds for them too (seeded sampled requests decode plainly by default).
    let doc = run_doc(&["--batch", "2", "--temperature", "0.7"]);
    let spec = &doc["rows"][0]["engine_steps"]["spec"];
    assert!(n(&spec["spec_round"], "steps") > 0.0, "{spec}");

    // `--requests`: a level of one client runs three requests one after the other (closed
    // loop), each its own prompt step and 15 plain steps.
    let doc = run_doc(&["--batch", "1", "--requests", "3"]);
    let row = &doc["rows"][0];
    assert_eq!(row["requests"], 3, "{row}");
    let plain = &row["engine_steps"]["plain"];
    assert_eq!(plain["prompt"]["steps"], 3, "{plain}");
    assert_eq!(plain["decode"]["steps"], 45, "{plain}");
    assert_eq!(n(&plain["decode"], "sequences_per_step"), 1.0, "{plain}");

    // `--waves`: two clients, two waves: four requests, each client's second request starting
    // as its first finishes (two prompt steps per engine at most: the second pair may arrive
    // together or one at a time).
    let doc = run_doc(&["--batch", "2", "--waves", "2"]);
    let row = &doc["rows"][0];
    assert_eq!(row["requests"], 4, "{row}");
    let plain = &row["engine_steps"]["plain"];
    let prompts_run = n(&plain["prompt"], "steps");
    assert!((2.0..=4.0).contains(&prompts_run), "{plain}");
    // The steady rate: tokens until the first client found no request left, both engines.
    for k in ["plain_steady_tok_s", "spec_steady_tok_s"] {
        assert!(n(row, k) > 0.0, "{k}: {row}");
    }

    for (bad, says) in [
        (
            r#"{"ids": [1, 2, 3]}"#,
            "line 1: 3 ids, `--prompt-len` is 24",
        ),
        (r#"{"prompt": "x"}"#, "line 1: no `ids` array"),
        (
            &format!(r#"{{"ids": [{}]}}"#, ["5"; 23].join(",") + ",99999"),
            "token id 99999",
        ),
    ] {
        std::fs::write(&prompts, bad).expect("write prompts");
        let out = bench(&prompts, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(says),
            "{bad}: {stderr}"
        );
    }
}
