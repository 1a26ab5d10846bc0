//! The ROCm backend: hipRTC compiles every kernel source (no GPU needed), and device probing
//! fails cleanly where there is no AMD GPU. Nothing here executes a kernel: no AMD GPU was
//! available to this project (README, "GPU backends").
#![cfg(feature = "rocm")]

use ferry_kernels::gpu::{Defines, Source};
use ferry_kernels::rocm::{hiprtc, probe};
use ferry_kernels::Device;

#[test]
fn hiprtc_compiles_every_source_for_gfx90a() {
    let mla = Defines::new()
        .with("MLA_DQK", 576)
        .with("MLA_DV", 512)
        .with("MHA_DQK", 192)
        .with("MHA_DV", 128);
    for source in Source::ALL {
        let defines = match source {
            Source::Mla => mla.clone(),
            _ => Defines::new(),
        };
        match hiprtc::compile(source, &defines, "gfx90a") {
            Ok(code) => assert!(!code.is_empty(), "{} produced no code", source.name()),
            Err(e) => panic!("{} does not compile with hipRTC: {e}", source.name()),
        }
    }
}

#[test]
fn probing_without_an_amd_gpu_is_an_error_not_a_panic() {
    match probe(0) {
        Ok(()) => eprintln!("an AMD GPU is present"),
        Err(e) => eprintln!("rocm:0 unavailable as expected here: {e}"),
    }
    assert!(Device::Rocm(usize::MAX).probe().is_err());
}
