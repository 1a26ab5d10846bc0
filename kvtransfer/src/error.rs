//! The one error type of the crate, with a snake-case [`TransferError::kind`] for metrics labels
//! and for carrying a failure's kind across the wire.

use crate::RemoteKey;

/// Everything that can go wrong moving KV blocks.
#[derive(thiserror::Error, Debug)]
pub enum TransferError {
    /// The writer's and the receiver's pool layouts differ in a field that must match.
    /// `ours` is the value on the side reporting the error (the writer, for `connect`).
    #[error("KV layout mismatch on `{field}`: ours is {ours}, theirs is {theirs}")]
    LayoutMismatch {
        /// The layout field that differs (`num_layers`, `page_size`, `latent_width`, `dtype`).
        field: &'static str,
        /// Our value.
        ours: String,
        /// The peer's value.
        theirs: String,
    },
    /// No region is registered under this key (never registered, or deregistered).
    #[error("no KV region is registered under remote key {0}")]
    UnknownRegion(RemoteKey),
    /// A block write outside the destination layout: `layer` must be < `num_layers`, `block`
    /// < `num_blocks` and `len` == `block_bytes()` of the destination.
    #[error("KV write out of range: layer {layer}, block {block}, {len} bytes (must be layer < num_layers, block < num_blocks, len == block_bytes)")]
    OutOfRange {
        /// The write's layer.
        layer: u32,
        /// The write's block.
        block: u32,
        /// The write's length in bytes.
        len: usize,
    },
    /// A socket error.
    #[error("KV transfer I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the wire protocol, or a wire value is invalid.
    #[error("KV transfer protocol error: {0}")]
    Protocol(String),
    /// The transfer was closed (by the peer, or after an earlier error).
    #[error("KV transfer closed")]
    Closed,
    /// The hello did not carry the receiver's cluster token: the writer is not one of the
    /// cluster's prefill workers. Nothing was revealed about the receiver's regions.
    #[error("KV transfer refused: wrong or missing cluster token")]
    Unauthenticated,
    /// The destination region refused a write.
    #[error("KV region write failed: {0}")]
    Region(String),
}

impl TransferError {
    /// Snake-case name of the variant, for metrics labels and wire failure frames.
    pub fn kind(&self) -> &'static str {
        match self {
            TransferError::LayoutMismatch { .. } => "layout_mismatch",
            TransferError::UnknownRegion(_) => "unknown_region",
            TransferError::OutOfRange { .. } => "out_of_range",
            TransferError::Io(_) => "io",
            TransferError::Protocol(_) => "protocol",
            TransferError::Closed => "closed",
            TransferError::Unauthenticated => "unauthenticated",
            TransferError::Region(_) => "region",
        }
    }
}

/// A dtype name that is not `"f32"`, `"bf16"` or `"bf16-split<rope>"`.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[error("`dtype` must be \"f32\", \"bf16\" or \"bf16-split<rope>\" (rope > 0), got {got:?}")]
pub struct ParseDtypeError {
    /// The rejected name.
    pub got: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_field_and_both_values() {
        let e = TransferError::LayoutMismatch {
            field: "page_size",
            ours: "64".into(),
            theirs: "32".into(),
        };
        assert_eq!(e.kind(), "layout_mismatch");
        let msg = e.to_string();
        assert!(msg.contains("`page_size`") && msg.contains("64") && msg.contains("32"));
        assert_eq!(
            TransferError::UnknownRegion(RemoteKey(7)).kind(),
            "unknown_region"
        );
        assert_eq!(TransferError::Closed.kind(), "closed");
    }
}
