//! `ferry bench-transfer` as a user runs it: the `memcpy` peer and each transport between two
//! real processes, the receiver checking that its pool holds every byte written, the table and
//! the JSON.

use std::process::{Command, Output};

fn bench_transfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("bench-transfer")
        .args(args)
        .output()
        .expect("ferry runs")
}

/// 128 tokens of DeepSeek-V3's layout (61 layers × 576 bf16 a token) over the TCP transport and
/// UCX shared memory from a writer of one lane and of two: a row per case in the table and in
/// the JSON, the bytes of the layout, and a success exit, which the bench gives only when the
/// receiver found every block it was sent.
#[test]
fn every_transport_is_measured_and_what_arrived_is_checked() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let json = dir.path().join("transfer.json");
    let out = bench_transfer(&[
        "--tokens",
        "128",
        "--runs",
        "2",
        "--transports",
        "tcp,ucx-shm",
        "--ucx-lanes",
        "1,2",
        "--json",
        json.to_str().expect("a UTF-8 path"),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all = [
        "memcpy",
        "tcp transport",
        "ucx shared memory",
        "ucx shared memory, 2 lanes",
    ];
    for case in all {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(case)
                    && l[case.len()..].split_whitespace().next() == Some("128")),
            "no 128-token row for {case}: {stdout}"
        );
    }

    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON file")).expect("JSON");
    let results = doc["results"].as_array().expect("results");
    let cases: Vec<&str> = results
        .iter()
        .map(|r| r["transport"].as_str().expect("a transport"))
        .collect();
    assert_eq!(cases, all);
    let lanes: Vec<_> = results.iter().map(|r| r["lanes"].as_u64()).collect();
    assert_eq!(lanes, [None, Some(1), Some(1), Some(2)]);
    for r in results {
        assert_eq!(r["tokens"], 128);
        assert_eq!(r["bytes"], 128 * 61 * 576 * 2, "{r}");
        assert!(r["gb_per_s"].as_f64().is_some_and(|g| g > 0.0), "{r}");
    }
}

/// A prompt length that is not whole blocks is refused before anything is spawned, naming the
/// flag and the value.
#[test]
fn a_length_that_is_not_whole_blocks_is_refused() {
    let out = bench_transfer(&["--tokens", "100", "--transports", "tcp"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "100 tokens were accepted");
    assert!(
        stderr.contains("--tokens") && stderr.contains("100"),
        "{stderr}"
    );
    let out = bench_transfer(&["--tokens", "128", "--ucx-lanes", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "0 lanes were accepted");
    assert!(
        stderr.contains("--ucx-lanes") && stderr.contains("got 0"),
        "{stderr}"
    );
}
