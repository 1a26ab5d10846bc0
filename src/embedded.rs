//! The embedded default model, compiled into the binary (`ferry_modelcard::embedded`, which also
//! holds its DSpark drafter): a `ferry` binary copied anywhere runs with no model files around.

use std::path::{Path, PathBuf};

pub use ferry_modelcard::embedded::EMBEDDED_MODEL_NAME;

/// The model directory to load: `explicit` when given, else the embedded model (the source
/// checkout's copy, or one unpacked into the cache).
pub fn model_dir(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    match explicit {
        Some(dir) => Ok(dir.to_path_buf()),
        None => Ok(ferry_modelcard::embedded::TARGET.dir()?),
    }
}
