//! Rows from one element type to another: what a writer does when its cache's dtype is not the
//! destination's (the wire always carries the destination's, see the crate docs).
//!
//! Elements are little-endian. bf16 → f32 is exact (a bf16 is the top half of an f32);
//! f32 → bf16 rounds to nearest, ties to even (NaN stays NaN), as a bf16 device cache rounds the
//! rows written into it. The same dtype copies the bytes unchanged.

use crate::{Dtype, TransferError};

/// Appends `data` (whole elements of `from`) to `out` as elements of `to`.
///
/// A length that is not a whole number of `from` elements is [`TransferError::Protocol`].
pub fn convert_into(
    data: &[u8],
    from: Dtype,
    to: Dtype,
    out: &mut Vec<u8>,
) -> Result<(), TransferError> {
    if data.len() % from.elem_size() != 0 {
        return Err(TransferError::Protocol(format!(
            "{} bytes are not whole {from} elements",
            data.len()
        )));
    }
    let n = data.len() / from.elem_size();
    out.reserve(n * to.elem_size());
    match (from, to) {
        (Dtype::F32, Dtype::F32) | (Dtype::Bf16, Dtype::Bf16) => out.extend_from_slice(data),
        (Dtype::Bf16, Dtype::F32) => {
            for c in data.chunks_exact(2) {
                let v = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        (Dtype::F32, Dtype::Bf16) => {
            for c in data.chunks_exact(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
            }
        }
    }
    Ok(())
}

/// `data` (whole elements of `from`) as elements of `to`; see [`convert_into`].
pub fn convert(data: &[u8], from: Dtype, to: Dtype) -> Result<Vec<u8>, TransferError> {
    let mut out = Vec::new();
    convert_into(data, from, to, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn same_dtype_is_a_copy_and_ragged_input_is_refused() {
        let d = f32s(&[1.5, -2.0]);
        assert_eq!(convert(&d, Dtype::F32, Dtype::F32).unwrap(), d);
        assert_eq!(convert(&d, Dtype::Bf16, Dtype::Bf16).unwrap(), d);
        for (from, len) in [(Dtype::F32, 6), (Dtype::Bf16, 3)] {
            let e = convert(&vec![0; len], from, Dtype::F32).unwrap_err();
            assert!(matches!(&e, TransferError::Protocol(m) if m.contains(from.as_str())));
        }
    }
}
