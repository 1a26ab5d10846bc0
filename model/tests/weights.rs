//! `Weights`: small safetensors checkpoints written to a temp dir, read back in every dtype,
//! sharded and single-file, and the errors for wrong shapes, names and dtypes.
use std::collections::HashMap;
use std::path::Path;

use ferry_kernels::cpu::gemm::MatrixData;
use ferry_model::weights::{e4m3_to_f32, Weights};
use ferry_model::{CardError, ModelError};
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// One tensor to write: name, dtype, shape, little-endian bytes.
type Spec = (&'static str, Dtype, Vec<usize>, Vec<u8>);

fn write_safetensors(path: &Path, tensors: &[Spec]) -> anyhow::Result<()> {
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            Ok((*name, TensorView::new(*dtype, shape.clone(), bytes)?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::fs::write(path, safetensors::serialize(views, None)?)?;
    Ok(())
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
        .collect()
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A 130 × 260 fp8 weight (2 × 3 blocks of 128 × 128, the last row and column of blocks
/// partial) with one scale per block.
const FP8_ROWS: usize = 130;
const FP8_COLS: usize = 260;
const SCALES: [f32; 6] = [0.5, 1.0, 2.0, 0.25, 4.0, 1.5];

/// Every finite e4m3 code appears; 0x7F/0xFF (NaN) are skipped.
fn fp8_byte(r: usize, c: usize) -> u8 {
    let b = ((r * 31 + c * 7) % 254) as u8;
    if b >= 0x7F {
        b + 1
    } else {
        b
    }
}

fn fp8_expected(r: usize, c: usize) -> f32 {
    e4m3_to_f32(fp8_byte(r, c)) * SCALES[(r / 128) * 3 + c / 128]
}

fn checkpoint(dir: &Path) -> anyhow::Result<()> {
    let fp8: Vec<u8> = (0..FP8_ROWS)
        .flat_map(|r| (0..FP8_COLS).map(move |c| fp8_byte(r, c)))
        .collect();
    write_safetensors(
        &dir.join("model.safetensors"),
        &[
            (
                "embed",
                Dtype::BF16,
                vec![2, 3],
                bf16_bytes(&[1.0, -2.0, 0.5, 3.0, 0.0, -0.25]),
            ),
            ("norm", Dtype::F32, vec![3], f32_bytes(&[1.0, 1.1, 1.2])),
            (
                "half",
                Dtype::F16,
                vec![2, 2],
                f16_bytes(&[1.0, 0.5, -4.0, 65504.0]),
            ),
            ("ids", Dtype::I64, vec![2], vec![0; 16]),
            ("proj.weight", Dtype::F8_E4M3, vec![FP8_ROWS, FP8_COLS], fp8),
            (
                "proj.weight_scale_inv",
                Dtype::F32,
                vec![2, 3],
                f32_bytes(&SCALES),
            ),
            ("lonely.weight", Dtype::F8_E4M3, vec![2, 2], vec![0x38; 4]),
        ],
    )
}

#[test]
fn reads_bf16_f16_f32_and_builds_matrices() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    checkpoint(dir.path())?;
    let w = Weights::open(dir.path())?;
    assert_eq!(w.len(), 7);
    assert!(w.has("embed") && !w.has("nope"));
    assert_eq!(w.shape("embed"), Some(&[2usize, 3][..]));
    assert_eq!(w.dtype_name("proj.weight").as_deref(), Some("F8_E4M3"));

    // All stored values are exact in every dtype involved: comparisons are exact.
    assert_eq!(
        w.get_f32("embed", &[2, 3])?,
        vec![1.0, -2.0, 0.5, 3.0, 0.0, -0.25]
    );
    assert_eq!(w.get_f32("norm", &[3])?, vec![1.0, 1.1, 1.2]);
    assert_eq!(w.get_f32("half", &[2, 2])?, vec![1.0, 0.5, -4.0, 65504.0]);

    let m = w.get_matrix("embed", 2, 3)?;
    assert_eq!((m.rows(), m.cols()), (2, 3));
    assert!(matches!(m.data(), MatrixData::Bf16(v) if v[1] == bf16::from_f32(-2.0)));
    let m = w.get_matrix("half", 2, 2)?;
    assert!(matches!(m.data(), MatrixData::F32(v) if v[3] == 65504.0));
    let n = w.get_matrix("norm", 1, 3);
    assert!(matches!(n, Err(ModelError::ShapeMismatch { .. })), "{n:?}");
    Ok(())
}

#[test]
fn fp8_block_dequantisation() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    checkpoint(dir.path())?;
    let w = Weights::open(dir.path())?;
    let got = w.get_f32("proj.weight", &[FP8_ROWS, FP8_COLS])?;
    let expected: Vec<f32> = (0..FP8_ROWS)
        .flat_map(|r| (0..FP8_COLS).map(move |c| fp8_expected(r, c)))
        .collect();
    // Exact: one f32 multiply per element on both sides.
    assert_eq!(got, expected);

    let m = w.get_matrix("proj.weight", FP8_ROWS, FP8_COLS)?;
    let MatrixData::Bf16(bf) = m.data() else {
        anyhow::bail!("fp8 must load as a bf16 matrix, got {:?}", m.data());
    };
    let rounded: Vec<bf16> = expected.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(bf, &rounded);
    Ok(())
}

#[test]
fn fp8_scales_may_be_bf16() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[
            ("w", Dtype::F8_E4M3, vec![1, 2], vec![0x38, 0xC0]),
            ("w_scale_inv", Dtype::BF16, vec![1, 1], bf16_bytes(&[0.5])),
        ],
    )?;
    let w = Weights::open(dir.path())?;
    assert_eq!(w.get_f32("w", &[1, 2])?, vec![0.5, -1.0]);
    Ok(())
}

#[test]
fn errors_name_the_tensor() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    checkpoint(dir.path())?;
    let w = Weights::open(dir.path())?;

    let err = w.get_f32("embed", &[3, 2]).err();
    match &err {
        Some(ModelError::ShapeMismatch {
            tensor,
            expected,
            got,
        }) => {
            assert_eq!(
                (tensor.as_str(), expected.as_slice(), got.as_slice()),
                ("embed", &[3, 2][..], &[2, 3][..])
            );
        }
        other => anyhow::bail!("expected ShapeMismatch, got {other:?}"),
    }
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("`embed`") && text.contains("[2, 3]") && text.contains("[3, 2]"),
        "{text}"
    );

    let err = w.get_f32("model.layers.0.missing", &[1]).err();
    assert!(
        matches!(&err, Some(ModelError::MissingTensor(n)) if n == "model.layers.0.missing"),
        "{err:?}"
    );
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("model.layers.0.missing"), "{text}");

    let err = w.get_f32("ids", &[2]).err();
    assert!(
        matches!(&err, Some(ModelError::UnsupportedDtype { tensor, dtype }) if tensor == "ids" && dtype == "I64"),
        "{err:?}"
    );

    // fp8 without `<name>_scale_inv`.
    let err = w.get_f32("lonely.weight", &[2, 2]).err();
    let text = err.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(matches!(err, Some(ModelError::Weights { .. })), "{text}");
    assert!(text.contains("lonely.weight_scale_inv"), "{text}");
    Ok(())
}

#[test]
fn wrong_scale_shape_is_a_shape_mismatch_on_the_scale() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[
            ("w", Dtype::F8_E4M3, vec![129, 2], vec![0x38; 258]),
            ("w_scale_inv", Dtype::F32, vec![1, 1], f32_bytes(&[1.0])),
        ],
    )?;
    let w = Weights::open(dir.path())?;
    match w.get_f32("w", &[129, 2]) {
        Err(ModelError::ShapeMismatch {
            tensor, expected, ..
        }) => {
            assert_eq!(tensor, "w_scale_inv");
            assert_eq!(expected, vec![2, 1]);
        }
        other => anyhow::bail!("expected ShapeMismatch on the scales, got {other:?}"),
    }
    Ok(())
}

#[test]
fn sharded_checkpoints_follow_the_index() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    write_safetensors(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &[("a", Dtype::F32, vec![2], f32_bytes(&[1.0, 2.0]))],
    )?;
    write_safetensors(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[("b", Dtype::BF16, vec![1], bf16_bytes(&[3.0]))],
    )?;
    let index = |map: &[(&str, &str)]| {
        let weight_map: HashMap<&str, &str> = map.iter().copied().collect();
        serde_json::json!({"metadata": {"total_size": 10}, "weight_map": weight_map}).to_string()
    };
    let index_path = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index_path,
        index(&[
            ("a", "model-00001-of-00002.safetensors"),
            ("b", "model-00002-of-00002.safetensors"),
        ]),
    )?;
    let w = Weights::open(dir.path())?;
    assert_eq!(w.get_f32("a", &[2])?, vec![1.0, 2.0]);
    assert_eq!(w.get_f32("b", &[1])?, vec![3.0]);
    let mut names: Vec<&str> = w.names().collect();
    names.sort_unstable();
    assert_eq!(names, ["a", "b"]);

    // The index places `b` in the wrong shard.
    std::fs::write(
        &index_path,
        index(&[
            ("a", "model-00001-of-00002.safetensors"),
            ("b", "model-00001-of-00002.safetensors"),
        ]),
    )?;
    match Weights::open(dir.path()) {
        Err(e @ ModelError::Weights { .. }) => assert!(e.to_string().contains("`b`"), "{e}"),
        other => anyhow::bail!("expected a Weights error, got {other:?}"),
    }

    // The index names a shard that does not exist.
    std::fs::write(
        &index_path,
        index(&[("c", "model-00009-of-00009.safetensors")]),
    )?;
    match Weights::open(dir.path()) {
        Err(ModelError::Card(CardError::MissingFile(p))) => {
            assert!(p.ends_with("model-00009-of-00009.safetensors"))
        }
        other => anyhow::bail!("expected MissingFile, got {other:?}"),
    }

    // Shard names may not leave the directory.
    std::fs::write(&index_path, index(&[("c", "../elsewhere.safetensors")]))?;
    assert!(matches!(
        Weights::open(dir.path()),
        Err(ModelError::Weights { .. })
    ));
    Ok(())
}

#[test]
fn missing_and_corrupt_files() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    match Weights::open(dir.path()) {
        Err(ModelError::Card(CardError::MissingFile(p))) => {
            assert_eq!(p, dir.path().join("model.safetensors"))
        }
        other => anyhow::bail!("expected MissingFile, got {other:?}"),
    }
    let gone = dir.path().join("gone");
    assert!(
        matches!(Weights::open(&gone), Err(ModelError::Card(CardError::MissingFile(p))) if p == gone)
    );

    std::fs::write(
        dir.path().join("model.safetensors"),
        b"not a safetensors file",
    )?;
    match Weights::open(dir.path()) {
        Err(e @ ModelError::Weights { .. }) => {
            assert!(e.to_string().contains("model.safetensors"), "{e}");
        }
        other => anyhow::bail!("expected a Weights error, got {other:?}"),
    }
    Ok(())
}

#[test]
fn weights_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Weights>();
    assert_send_sync::<ferry_model::config::ModelConfig>();
}
