//! Layout compatibility: the check both ends of a connection run before any byte of KV moves.
//!
//! Two pools are compatible when a block of one can be copied byte for byte into a block of the
//! other: same number of layers, same page size, same latent width and same dtype. Pool sizes
//! (`num_blocks`) may differ. The writer's side of the check is what it puts on the wire: a
//! writer whose cache holds another dtype than the destination's converts its rows
//! ([`crate::convert`]) and connects with the destination's dtype (see the crate docs), so the
//! dtype compared here is always the bytes' real one. Anything else is a [`TransferError::LayoutMismatch`] naming the
//! field and both values, never a silent reinterpretation of the bytes.

use crate::{KvLayoutDesc, TransferError};

/// Checks that blocks of `theirs` can be written into blocks of `ours` (and back).
///
/// The first differing field, in the order `num_layers`, `page_size`, `latent_width`, `dtype`,
/// is reported with `ours` and `theirs` values as given.
pub fn check_compatible(ours: &KvLayoutDesc, theirs: &KvLayoutDesc) -> Result<(), TransferError> {
    fn field<T: PartialEq + ToString>(
        name: &'static str,
        ours: T,
        theirs: T,
    ) -> Result<(), TransferError> {
        if ours == theirs {
            Ok(())
        } else {
            Err(TransferError::LayoutMismatch {
                field: name,
                ours: ours.to_string(),
                theirs: theirs.to_string(),
            })
        }
    }
    field("num_layers", ours.num_layers, theirs.num_layers)?;
    field("page_size", ours.page_size, theirs.page_size)?;
    field("latent_width", ours.latent_width, theirs.latent_width)?;
    field("dtype", ours.dtype, theirs.dtype)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    fn layout() -> KvLayoutDesc {
        KvLayoutDesc {
            num_layers: 4,
            page_size: 64,
            latent_width: 576,
            dtype: Dtype::Bf16,
            num_blocks: 100,
        }
    }

    #[test]
    fn pool_size_may_differ() {
        let theirs = KvLayoutDesc {
            num_blocks: 7,
            ..layout()
        };
        assert!(check_compatible(&layout(), &theirs).is_ok());
    }

    #[test]
    fn each_geometry_field_is_named() {
        let with = |change: fn(&mut KvLayoutDesc)| {
            let mut l = layout();
            change(&mut l);
            l
        };
        let cases = [
            ("num_layers", with(|l| l.num_layers = 5), "4", "5"),
            ("page_size", with(|l| l.page_size = 32), "64", "32"),
            ("latent_width", with(|l| l.latent_width = 512), "576", "512"),
            ("dtype", with(|l| l.dtype = Dtype::F32), "bf16", "f32"),
        ];
        for (name, theirs, o, t) in cases {
            match check_compatible(&layout(), &theirs) {
                Err(TransferError::LayoutMismatch {
                    field,
                    ours,
                    theirs,
                }) => {
                    assert_eq!((field, ours.as_str(), theirs.as_str()), (name, o, t));
                }
                other => panic!("{name}: expected a mismatch, got {other:?}"),
            }
        }
    }
}
