//! The embedded default model and its DSpark drafter, compiled into the binary.
//!
//! `models/tiny-k3/` (a ~3.8M-parameter `DeepseekV3ForCausalLM` with Kimi K3's proportions and
//! a 2,048-token byte-level BPE, made by `scripts/make_tiny_k3.py`) and `models/tiny-k3-dspark/`
//! (its DSpark drafter, self-distilled by `make_tiny_k3.py train-drafter`) are included with
//! `include_bytes!`, so a `ferry` binary copied anywhere — another machine, a container — serves
//! and speculates with no model files around. When the source checkout's copy is intact it is
//! used directly; otherwise the files are written once to a cache directory keyed by their
//! content hash (`$XDG_CACHE_HOME/ferry`, else `~/.cache/ferry`, else the temp dir), atomically,
//! so concurrent processes never see half a model.

use std::path::{Path, PathBuf};

use crate::CardError;

/// Name under which the embedded model is served.
pub const EMBEDDED_MODEL_NAME: &str = "tiny-k3";

/// One embedded model directory: its name and its files' bytes.
#[derive(Debug, Clone, Copy)]
pub struct Embedded {
    /// Directory name under `models/` (and under the cache directory, with a hash suffix).
    pub name: &'static str,
    /// `(file name, contents)`.
    pub files: &'static [(&'static str, &'static [u8])],
}

/// The embedded target model.
pub const TARGET: Embedded = Embedded {
    name: "tiny-k3",
    files: &[
        (
            "config.json",
            include_bytes!("../../models/tiny-k3/config.json"),
        ),
        (
            "model.safetensors",
            include_bytes!("../../models/tiny-k3/model.safetensors"),
        ),
        (
            "tokenizer.json",
            include_bytes!("../../models/tiny-k3/tokenizer.json"),
        ),
        (
            "tokenizer_config.json",
            include_bytes!("../../models/tiny-k3/tokenizer_config.json"),
        ),
    ],
};

/// The embedded target's DSpark drafter.
pub const DRAFTER: Embedded = Embedded {
    name: "tiny-k3-dspark",
    files: &[
        (
            "config.json",
            include_bytes!("../../models/tiny-k3-dspark/config.json"),
        ),
        (
            "model.safetensors",
            include_bytes!("../../models/tiny-k3-dspark/model.safetensors"),
        ),
    ],
};

impl Embedded {
    /// The source checkout's copy (`models/<name>` next to this crate), which exists only
    /// where the binary was built.
    pub fn source_dir(&self) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("models")
            .join(self.name)
    }

    /// The bytes of `file`, if it is one of this model's files.
    pub fn file(&self, file: &str) -> Option<&'static [u8]> {
        self.files.iter().find(|(n, _)| *n == file).map(|(_, b)| *b)
    }

    /// A directory holding exactly these files: the source checkout's copy when every file
    /// there has the embedded size, else the cache copy, written on first use.
    pub fn dir(&self) -> Result<PathBuf, CardError> {
        let source = self.source_dir();
        let intact = self.files.iter().all(|(name, bytes)| {
            std::fs::metadata(source.join(name)).is_ok_and(|m| m.len() == bytes.len() as u64)
        });
        if intact {
            return Ok(source);
        }
        self.extract()
    }

    /// FNV-1a over every file's bytes: names the cache directory, so a binary with other
    /// weights never reads a stale copy.
    fn content_hash(&self) -> u64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for (_, bytes) in self.files {
            for b in bytes.iter() {
                hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        hash
    }

    fn extract(&self) -> Result<PathBuf, CardError> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        let dir = base
            .join("ferry")
            .join(format!("{}-{:016x}", self.name, self.content_hash()));
        if self.files.iter().all(|(name, _)| dir.join(name).exists()) {
            return Ok(dir);
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CardError::Io { path, source }
        };
        // A private temp dir renamed into place: a reader sees all the files or none.
        let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        for (name, bytes) in self.files {
            std::fs::write(tmp.join(name), bytes).map_err(io(&tmp.join(name)))?;
        }
        match std::fs::rename(&tmp, &dir) {
            Ok(()) => Ok(dir),
            // Another process won the race; its copy is complete.
            Err(_) if self.files.iter().all(|(name, _)| dir.join(name).exists()) => {
                let _ = std::fs::remove_dir_all(&tmp);
                Ok(dir)
            }
            Err(e) => Err(io(&dir)(e)),
        }
    }
}

/// The embedded model's directory ([`TARGET`]`.dir()`), for flag defaults. If the cache copy
/// cannot be written, the source checkout's path is returned and loading it reports the
/// missing file.
pub fn default_model_dir() -> PathBuf {
    TARGET.dir().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the embedded model cannot be unpacked; using its source path");
        TARGET.source_dir()
    })
}

/// Whether `target_dir` holds the embedded target: its `config.json` is byte-identical.
pub fn is_embedded_target(target_dir: &Path) -> bool {
    match (
        std::fs::read(target_dir.join("config.json")),
        TARGET.file("config.json"),
    ) {
        (Ok(found), Some(embedded)) => found == embedded,
        _ => false,
    }
}

/// The drafter to use by default for the target in `target_dir`: the embedded drafter when the
/// target is the embedded model; else none (a drafter for any other model is named with
/// `--drafter`).
pub fn default_drafter_for(target_dir: &Path) -> Option<Result<PathBuf, CardError>> {
    is_embedded_target(target_dir).then(|| DRAFTER.dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracted_copy_matches_the_embedded_bytes() {
        let tmp = tempfile::tempdir().expect("tempdir");
        // Point the cache at a fresh directory and force extraction (not the source copy).
        std::env::set_var("XDG_CACHE_HOME", tmp.path());
        for model in [TARGET, DRAFTER] {
            let dir = model.extract().expect("extract");
            assert!(dir.starts_with(tmp.path()), "{}", dir.display());
            for (name, bytes) in model.files {
                assert_eq!(
                    &std::fs::read(dir.join(name)).expect("read"),
                    bytes,
                    "{name}"
                );
            }
            // A second call reuses the copy.
            assert_eq!(model.extract().expect("again"), dir);
        }
        assert!(is_embedded_target(&TARGET.extract().expect("target")));
        assert!(!is_embedded_target(&DRAFTER.extract().expect("drafter")));
    }
}
