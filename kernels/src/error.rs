//! The one error type of the kernels crate.
//!
//! Every variant names the operation that failed and carries the offending value next to the
//! limit it broke, so a message is actionable without a debugger (STYLE.md, "Errors").

/// Why a kernel refused its inputs.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum KernelError {
    /// A buffer had the wrong length for the shape the operation was given.
    #[error("{op}: `{what}` must have length {expected}, got {got}")]
    ShapeMismatch {
        /// Operation, e.g. `"linear"`.
        op: &'static str,
        /// Which argument, e.g. `"out"`.
        what: &'static str,
        /// Length the other arguments imply.
        expected: usize,
        /// Length actually passed.
        got: usize,
    },
    /// A flat buffer's length is not a whole number of rows.
    #[error("{op}: `{what}` length {len} is not a multiple of the row width {width}")]
    NotDivisible {
        /// Operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// Length passed.
        len: usize,
        /// Row width it must divide by.
        width: usize,
    },
    /// A dimension or parameter that must satisfy a constraint does not.
    #[error("{op}: `{field}` must be {limit}, got {value}")]
    InvalidParam {
        /// Operation.
        op: &'static str,
        /// Which dimension or parameter.
        field: &'static str,
        /// The constraint, in words (e.g. `"even and > 0"`).
        limit: &'static str,
        /// The value passed, formatted.
        value: String,
    },
    /// An index (row, block id, expert id) is past the end of what it indexes.
    #[error("{op}: `{what}` index {index} out of range (must be < {len})")]
    IndexOutOfRange {
        /// Operation.
        op: &'static str,
        /// What was indexed.
        what: &'static str,
        /// Index passed.
        index: usize,
        /// Number of valid entries.
        len: usize,
    },
    /// The tiled MLA kernel puts query heads on the rows of 16-row tiles and only takes the
    /// head counts the production kernels take; pad through `mla_absorbed_attention` instead.
    #[error("{op}: tiled kernel takes 4, 8 or a multiple of 16 heads, got {heads}")]
    UnsupportedHeadCount {
        /// Operation.
        op: &'static str,
        /// Head count passed.
        heads: usize,
    },
    /// A sequence's block table does not cover all the positions it attends to.
    #[error(
        "{op}: block table has {blocks} blocks of {page_size} tokens, needs {needed_tokens} tokens"
    )]
    BlockTableTooShort {
        /// Operation.
        op: &'static str,
        /// Blocks in the table.
        blocks: usize,
        /// Tokens per block.
        page_size: usize,
        /// Tokens the sequence needs (`start_pos + num_queries`).
        needed_tokens: usize,
    },
    /// A sampling parameter is outside its valid range.
    #[error("sampling: `{field}` must be {limit}, got {value}")]
    InvalidSamplingParam {
        /// Field of `SamplingParams`.
        field: &'static str,
        /// The value passed.
        value: f64,
        /// The valid range, in words.
        limit: &'static str,
    },
    /// A `--device` string that is not `cpu`, `cuda[:N]` or `rocm[:N]`.
    #[error("device: `{value}` is not a device; expected auto, cpu, cuda[:N] or rocm[:N]")]
    InvalidDevice {
        /// The text given.
        value: String,
    },
    /// The device asked for cannot be used on this machine (no driver, no such ordinal, the
    /// backend not compiled in). A device the user named is never replaced by the CPU.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The device, as written (`cuda:0`).
        device: String,
        /// Why, in words (e.g. "no CUDA driver (libcuda.so) on this machine").
        reason: String,
    },
    /// A GPU runtime call (driver, NVRTC, cuBLAS, HIP, hipRTC) failed.
    #[error("{op}: GPU call failed: {message}")]
    Gpu {
        /// Operation or runtime call.
        op: &'static str,
        /// The runtime's message.
        message: String,
    },
    /// An op was handed buffers or weights that live on different devices (a caller bug: the
    /// one forward keeps everything of a model on its backend).
    #[error("{op}: `{what}` is on the {got}, the op runs on the {expected}")]
    DeviceMismatch {
        /// Operation.
        op: &'static str,
        /// The operand.
        what: &'static str,
        /// The backend the op runs on.
        expected: &'static str,
        /// Where the operand lives.
        got: &'static str,
    },
    /// A probability vector has nothing left to sample or renormalise (all zero, or non-finite).
    #[error("{op}: distribution has no positive finite mass (sum {sum})")]
    DegenerateDistribution {
        /// Operation.
        op: &'static str,
        /// The normaliser that was found.
        sum: f64,
    },
}

impl From<ferry_modelcard::sampling::SamplingError> for KernelError {
    fn from(e: ferry_modelcard::sampling::SamplingError) -> Self {
        KernelError::InvalidSamplingParam {
            field: e.field,
            value: e.value,
            limit: e.limit,
        }
    }
}

/// `v` as a C `int` (a kernel argument, or a cuBLAS dimension) for operation `op`; too large a
/// value is an error naming `field`.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn c_int(op: &'static str, field: &'static str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::InvalidParam {
        op,
        field,
        limit: "< 2^31",
        value: v.to_string(),
    })
}
