//! Memory-mapped safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`.
//!
//! [`Weights::open`] maps every file once and reads only the headers; tensor bytes stay in the
//! page cache until a getter converts them. Getters check the shape the caller expects (derived
//! from [`crate::config::ModelConfig`]) and convert:
//!
//! | stored dtype | [`Weights::get_f32`] | [`Weights::get_bf16`] | [`Weights::get_matrix`] |
//! |---|---|---|---|
//! | `BF16` | widened | as is | bf16 matrix |
//! | `F16` | widened | rounded | f32 matrix (lossless) |
//! | `F32` | as is | rounded | f32 matrix |
//! | `F8_E4M3` + `<name>_scale_inv` | dequantised | dequantised, rounded | bf16 matrix |
//!
//! fp8 is DeepSeek's block format (`quantization_config.quant_method = "fp8"`): e4m3fn bytes plus
//! one scale per 128×128 block in `<name>_scale_inv` (f32, shape `[ceil(rows/128),
//! ceil(cols/128)]`); `value = e4m3(byte) · scale_inv[r/128][c/128]`. Rounding the f32 product
//! to bf16 (round to nearest even) is exactly what DeepSeek's own `fp8_cast_bf16.py` does, so a
//! checkpoint loaded here equals their bf16 conversion bit for bit.
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use ferry_kernels::cpu::gemm::Matrix;
use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};

use crate::config::FP8_BLOCK;
use crate::error::ModelError;

/// Where a model's tensors come from: a checkpoint ([`Weights`]) or seeded random values of
/// the same shapes ([`crate::dummy::DummyWeights`]). The loader asks for each tensor by its
/// checkpoint name and the shape the config implies.
pub trait TensorSource: Sync {
    /// `name` as f32 (see [`Weights::get_f32`]).
    fn get_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>, ModelError>;
    /// `name` as a `rows × cols` GEMM operand (see [`Weights::get_matrix`]).
    fn get_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError>;
}

impl TensorSource for Weights {
    fn get_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Weights::get_f32(self, name, expected_shape)
    }
    fn get_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        Weights::get_matrix(self, name, rows, cols)
    }
}

/// Name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Suffix of the per-block scale tensor that accompanies an fp8 weight.
pub const SCALE_INV_SUFFIX: &str = "_scale_inv";

/// Decodes one `float8_e4m3fn` byte: 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no
/// infinities, `0x7F`/`0xFF` are NaN, exponent 0 is subnormal (`mantissa/8 · 2^-6`).
/// Largest finite value ±448.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((byte >> 3) & 0x0F);
    let mantissa = f32::from(byte & 0x07);
    if exp == 0x0F && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * mantissa / 8.0 * 2f32.powi(-6);
    }
    sign * (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7)
}

/// One mapped file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// Where one tensor lives: absolute byte range inside its shard's map.
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A checkpoint directory's tensors, memory-mapped.
///
/// The maps live as long as the `Weights`; getters copy and convert, so returned data never
/// borrows the files.
pub struct Weights {
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field(
                "files",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Weights {
    /// Maps the checkpoint in `dir`: `model.safetensors.index.json` and the shards it names
    /// when the index exists, else `model.safetensors`.
    ///
    /// Errors: [`CardError::MissingFile`](crate::CardError::MissingFile) when neither exists (or a listed shard is absent),
    /// [`ModelError::Weights`] for a malformed header or index, or a tensor the index places in
    /// a shard that lacks it, or the same tensor in two shards.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::missing_file(dir.to_path_buf()));
        }
        let index_path = dir.join(INDEX_FILE);
        let mut weights = Weights {
            shards: Vec::new(),
            tensors: HashMap::new(),
        };
        if index_path.exists() {
            let weight_map = read_index(&index_path)?;
            let files: BTreeSet<&str> = weight_map.values().map(String::as_str).collect();
            for file in files {
                weights.add_shard(&dir.join(file))?;
            }
            for (name, file) in &weight_map {
                let found = weights
                    .tensors
                    .get(name)
                    .and_then(|e| weights.shards.get(e.shard))
                    .is_some_and(|s| s.path == dir.join(file));
                if !found {
                    return Err(ModelError::weights(
                        name,
                        format!("{INDEX_FILE} places it in `{file}`, which does not contain it"),
                    ));
                }
            }
        } else {
            let single = dir.join(SINGLE_FILE);
            if !single.exists() {
                return Err(ModelError::missing_file(single));
            }
            weights.add_shard(&single)?;
        }
        Ok(weights)
    }

    fn add_shard(&mut self, path: &Path) -> Result<(), ModelError> {
        if !path.exists() {
            return Err(ModelError::missing_file(path.to_path_buf()));
        }
        let io_err = |source| ModelError::io(path, source);
        let file = File::open(path).map_err(io_err)?;
        // SAFETY: the map is read-only and private to this process. Like every mmap-based
        // loader (candle, safetensors' own examples) we rely on checkpoint files not being
        // truncated or rewritten while a server has them open; that is a deployment rule.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
            .map_err(|e| ModelError::weights(path.display().to_string(), e.to_string()))?;
        let data_start = 8 + header_len;
        let shard = self.shards.len();
        for (name, info) in metadata.tensors() {
            let (s, e) = info.data_offsets;
            let entry = Entry {
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + s,
                end: data_start + e,
            };
            if let Some(previous) = self.tensors.insert(name.clone(), entry) {
                let other = self
                    .shards
                    .get(previous.shard)
                    .map_or_else(String::new, |s| s.path.display().to_string());
                return Err(ModelError::weights(
                    name,
                    format!("present in both `{other}` and `{}`", path.display()),
                ));
            }
        }
        self.shards.push(Shard {
            path: path.to_path_buf(),
            mmap,
        });
        Ok(())
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// The stored dtype of `name` as safetensors spells it (`BF16`, `F8_E4M3`, …), if present.
    pub fn dtype_name(&self, name: &str) -> Option<String> {
        self.tensors.get(name).map(|e| format!("{:?}", e.dtype))
    }

    /// Every tensor name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors in the checkpoint.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// `name` as f32, row-major, after checking its shape is `expected_shape`.
    ///
    /// Accepts `BF16`, `F16`, `F32`, and `F8_E4M3` with a `<name>_scale_inv` block-scale tensor;
    /// anything else is [`ModelError::UnsupportedDtype`].
    pub fn get_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let entry = self.entry(name, expected_shape)?;
        let bytes = self.bytes(name, entry)?;
        match entry.dtype {
            Dtype::F32 => Ok(f32_from_bytes(bytes)),
            Dtype::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            Dtype::F16 => Ok(bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            Dtype::F8_E4M3 => self.dequantize(name, entry, |x| x),
            other => Err(unsupported(name, other)),
        }
    }

    /// `name` as bf16, row-major, after checking its shape is `expected_shape`.
    ///
    /// bf16 is copied as is; f32, f16 and dequantised fp8 are rounded to nearest even.
    pub fn get_bf16(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<bf16>, ModelError> {
        let entry = self.entry(name, expected_shape)?;
        let bytes = self.bytes(name, entry)?;
        match entry.dtype {
            Dtype::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect()),
            Dtype::F8_E4M3 => self.dequantize(name, entry, bf16::from_f32),
            Dtype::F32 | Dtype::F16 => Ok(self
                .get_f32(name, expected_shape)?
                .into_iter()
                .map(bf16::from_f32)
                .collect()),
            other => Err(unsupported(name, other)),
        }
    }

    /// `name` as a `rows × cols` GEMM operand.
    ///
    /// bf16 stays bf16 and f32 stays f32; f16 widens to f32 (exact); fp8 is dequantised to bf16,
    /// the same conversion as DeepSeek's `fp8_cast_bf16.py`. A stored shape other than
    /// `[rows, cols]` is [`ModelError::ShapeMismatch`].
    pub fn get_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let shape = [rows, cols];
        let entry = self.entry(name, &shape)?;
        let matrix = match entry.dtype {
            Dtype::BF16 | Dtype::F8_E4M3 => {
                Matrix::from_bf16(rows, cols, self.get_bf16(name, &shape)?)
            }
            Dtype::F32 | Dtype::F16 => Matrix::from_f32(rows, cols, self.get_f32(name, &shape)?),
            other => return Err(unsupported(name, other)),
        };
        Ok(matrix?)
    }

    /// Looks `name` up and checks its shape.
    fn entry(&self, name: &str, expected_shape: &[usize]) -> Result<&Entry, ModelError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        if entry.shape != expected_shape {
            return Err(ModelError::ShapeMismatch {
                tensor: name.to_string(),
                expected: expected_shape.to_vec(),
                got: entry.shape.clone(),
            });
        }
        Ok(entry)
    }

    fn bytes(&self, name: &str, entry: &Entry) -> Result<&[u8], ModelError> {
        self.shards
            .get(entry.shard)
            .and_then(|s| s.mmap.get(entry.start..entry.end))
            .ok_or_else(|| ModelError::weights(name, "data offsets lie outside the file"))
    }

    /// Block-dequantises the fp8 tensor `name` with `<name>_scale_inv`, mapping each f32
    /// product through `convert`.
    fn dequantize<T: Copy + Default + Send + Sync>(
        &self,
        name: &str,
        entry: &Entry,
        convert: impl Fn(f32) -> T + Sync,
    ) -> Result<Vec<T>, ModelError> {
        let &[rows, cols] = entry.shape.as_slice() else {
            return Err(ModelError::weights(
                name,
                format!(
                    "F8_E4M3 tensors must be 2-D for block scaling, got shape {:?}",
                    entry.shape
                ),
            ));
        };
        let scale_name = format!("{name}{SCALE_INV_SUFFIX}");
        let scale_shape = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
        if !self.has(&scale_name) {
            return Err(ModelError::weights(
                name,
                format!("F8_E4M3 weight without its block scales `{scale_name}`"),
            ));
        }
        let scale_entry = self.entry(&scale_name, &scale_shape)?;
        let scale_bytes = self.bytes(&scale_name, scale_entry)?;
        let scales: Vec<f32> = match scale_entry.dtype {
            Dtype::F32 => f32_from_bytes(scale_bytes),
            Dtype::BF16 => scale_bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => return Err(unsupported(&scale_name, other)),
        };
        let data = self.bytes(name, entry)?;
        if rows == 0 || cols == 0 {
            return Ok(Vec::new());
        }
        let lut: [f32; 256] = std::array::from_fn(|i| e4m3_to_f32(i as u8));
        let blocks_per_row = scale_shape[1];
        let mut out = vec![T::default(); rows * cols];
        out.par_chunks_mut(cols)
            .zip(data.par_chunks_exact(cols))
            .enumerate()
            .for_each(|(r, (out_row, row))| {
                // In bounds: the scale tensor's shape was checked against `rows`/`cols` above.
                let scale_row = &scales[(r / FP8_BLOCK) * blocks_per_row..][..blocks_per_row];
                for (c, (o, &byte)) in out_row.iter_mut().zip(row).enumerate() {
                    *o = convert(lut[usize::from(byte)] * scale_row[c / FP8_BLOCK]);
                }
            });
        Ok(out)
    }
}

fn f32_from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn unsupported(name: &str, dtype: Dtype) -> ModelError {
    ModelError::UnsupportedDtype {
        tensor: name.to_string(),
        dtype: format!("{dtype:?}"),
    }
}

/// Reads `weight_map` (tensor name → shard file) from a sharded checkpoint's index.
fn read_index(path: &Path) -> Result<HashMap<String, String>, ModelError> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::io(path, source))?;
    let index: Index = serde_json::from_str(&text)
        .map_err(|e| ModelError::weights(INDEX_FILE, format!("invalid index: {e}")))?;
    for file in index.weight_map.values() {
        let mut components = Path::new(file).components();
        let plain =
            matches!(components.next(), Some(Component::Normal(_))) && components.next().is_none();
        if !plain {
            return Err(ModelError::weights(
                INDEX_FILE,
                format!("shard `{file}` must be a file name inside the checkpoint directory"),
            ));
        }
    }
    Ok(index.weight_map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x40), 2.0);
        assert_eq!(e4m3_to_f32(0x3C), 1.5);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        let neg_zero = e4m3_to_f32(0x80);
        assert_eq!(neg_zero, 0.0);
        assert!(neg_zero.is_sign_negative());
        assert!(e4m3_to_f32(0x7F).is_nan());
        assert!(e4m3_to_f32(0xFF).is_nan());
        // 0x78 has exponent 15 but is finite: e4m3fn has no infinities.
        assert_eq!(e4m3_to_f32(0x78), 256.0);
    }

    #[test]
    fn e4m3_is_monotonic_over_positive_finite_codes() {
        let values: Vec<f32> = (0u8..0x7F).map(e4m3_to_f32).collect();
        assert!(values.windows(2).all(|w| w[0] < w[1]));
    }
}
