//! What a step's rotary tables cost on the host: `dim / 2` cos/sin pairs for each of N
//! positions, as `RopeTables::host` builds them for every GPU forward and drafter pass (verify
//! rows, prompt tokens), evaluated (f64 `cos`/`sin`, the rule before session 38) against read
//! from the cache (`Rope::cos_sin`).
//!
//!   cargo run --release -p ferry-kernels --example bench_rope [-- POSITIONS [REPEATS]]
//!
//! Prints a Markdown table and one JSON line (`benchmarks/results/`).

use std::time::Instant;

use ferry_kernels::cpu::rope::{Rope, RopeParams, RopeScaling};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(1024);
    let repeats = args.get(1).copied().unwrap_or(50).max(1);
    println!("| rotated dim | positions | evaluated ms | cached ms (first use) | cached ms | × |");
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    // 32: the DSpark lease target's `qk_rope_head_dim`; 64: DeepSeek-V3's, and the drafter's.
    for dim in [32usize, 64] {
        let rope = Rope::new(&RopeParams {
            dim,
            theta: 10000.0,
            scaling: RopeScaling::None,
            interleaved: true,
        })
        .expect("valid parameters");
        let half = dim / 2;
        let positions: Vec<usize> = (1000..1000 + n).collect();
        let (mut cos, mut sin) = (vec![0.0f32; n * half], vec![0.0f32; n * half]);
        let mut fill = |cached: bool| {
            let start = Instant::now();
            for (i, &p) in positions.iter().enumerate() {
                let (c, s) = (&mut cos[i * half..][..half], &mut sin[i * half..][..half]);
                let r = if cached {
                    rope.cos_sin(p, c, s)
                } else {
                    rope.cos_sin_uncached(p, c, s)
                };
                r.expect("lengths");
            }
            start.elapsed().as_secs_f64() * 1e3
        };
        let mut evaluated: Vec<f64> = (0..repeats).map(|_| fill(false)).collect();
        let first = fill(true);
        let mut cached: Vec<f64> = (0..repeats).map(|_| fill(true)).collect();
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (e, c) = (median(&mut evaluated), median(&mut cached));
        println!(
            "| {dim} | {n} | {e:.4} | {first:.4} | {c:.4} | {:.1} |",
            e / c
        );
        rows.push(format!(
            r#"{{"dim": {dim}, "positions": {n}, "evaluated_ms": {e:.5}, "cached_first_ms": {first:.5}, "cached_ms": {c:.5}}}"#
        ));
    }
    println!("{{\"benchmark\": \"kernels/examples/bench_rope.rs\", \"repeats\": {repeats}, \"rows\": [{}]}}", rows.join(", "));
}
