//! Rows from one [`Dtype`] to another: what a writer does when its cache's dtype is not the
//! destination's (the wire always carries the destination's, see the crate docs).
//!
//! Elements are little-endian. bf16 → f32 is exact (a bf16 is the top half of an f32);
//! f32 → bf16 rounds to nearest, ties to even (NaN stays NaN), as a bf16 device cache rounds the
//! rows written into it. A split row's pair widens to `hi + lo` (exact in f32) and an f32 value
//! splits into `hi = bf16(x)`, `lo = bf16(x − hi)` (~16 mantissa bits kept), as the fast-mode
//! cache writes it. The same dtype copies the bytes unchanged.

use crate::{Dtype, TransferError};

/// Appends `data` (whole rows of `width` logical elements, stored as `from`) to `out` as rows
/// of `to`.
///
/// A length that is not a whole number of `from` rows, or a split wider than the row, is
/// [`TransferError::Protocol`].
pub fn convert_into(
    data: &[u8],
    from: Dtype,
    to: Dtype,
    width: usize,
    out: &mut Vec<u8>,
) -> Result<(), TransferError> {
    for d in [from, to] {
        if let Dtype::Bf16Split { rope } = d {
            if rope as usize > width {
                return Err(TransferError::Protocol(format!(
                    "{d} splits more than a row of {width} elements"
                )));
            }
        }
    }
    let row_in = from.row_bytes(width);
    if row_in == 0 || data.len() % row_in != 0 {
        return Err(TransferError::Protocol(format!(
            "{} bytes are not whole rows of {width} {from} elements",
            data.len()
        )));
    }
    if from == to {
        out.extend_from_slice(data);
        return Ok(());
    }
    out.reserve(data.len() / row_in * to.row_bytes(width));
    let mut row = vec![0.0f32; width];
    for src in data.chunks_exact(row_in) {
        decode_row(src, from, &mut row);
        encode_row(&row, to, out);
    }
    Ok(())
}

/// `data` (whole rows of `from`) as rows of `to`; see [`convert_into`].
pub fn convert(
    data: &[u8],
    from: Dtype,
    to: Dtype,
    width: usize,
) -> Result<Vec<u8>, TransferError> {
    let mut out = Vec::new();
    convert_into(data, from, to, width, &mut out)?;
    Ok(out)
}

fn bf16_at(b: &[u8], i: usize) -> f32 {
    half::bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32()
}

fn push_bf16(out: &mut Vec<u8>, x: f32) {
    out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
}

/// One stored row (exactly `from.row_bytes(row.len())` bytes) as f32 values.
fn decode_row(src: &[u8], from: Dtype, row: &mut [f32]) {
    match from {
        Dtype::F32 => {
            for (d, c) in row.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::Bf16 => {
            for (i, d) in row.iter_mut().enumerate() {
                *d = bf16_at(src, i);
            }
        }
        Dtype::Bf16Split { rope } => {
            let (w, r) = (row.len(), rope as usize);
            for (i, d) in row.iter_mut().enumerate() {
                *d = if i + r < w {
                    bf16_at(src, i)
                } else {
                    // hi at i, lo `rope` elements further on.
                    bf16_at(src, i) + bf16_at(src, i + r)
                };
            }
        }
    }
}

/// Appends `row` stored as `to`.
fn encode_row(row: &[f32], to: Dtype, out: &mut Vec<u8>) {
    match to {
        Dtype::F32 => row
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Dtype::Bf16 => row.iter().for_each(|&x| push_bf16(out, x)),
        Dtype::Bf16Split { rope } => {
            let pe = row.len() - rope as usize;
            row.iter().for_each(|&x| push_bf16(out, x));
            for &x in &row[pe..] {
                push_bf16(out, x - half::bf16::from_f32(x).to_f32());
            }
        }
    }
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
        assert_eq!(convert(&d, Dtype::F32, Dtype::F32, 2).unwrap(), d);
        assert_eq!(convert(&d, Dtype::Bf16, Dtype::Bf16, 4).unwrap(), d);
        let split = Dtype::Bf16Split { rope: 1 };
        for (from, len) in [(Dtype::F32, 6), (Dtype::Bf16, 3), (split, 6)] {
            let e = convert(&vec![0; len], from, Dtype::F32, 1).unwrap_err();
            assert!(matches!(&e, TransferError::Protocol(m) if m.contains(&from.to_string())));
        }
        let e = convert(&d, Dtype::F32, Dtype::Bf16Split { rope: 3 }, 2).unwrap_err();
        assert!(matches!(&e, TransferError::Protocol(m) if m.contains("splits more")));
    }

    #[test]
    fn a_split_row_keeps_the_rope_part_to_sixteen_bits() {
        // A row of 4: two latent elements, then a rope pair of 2.
        let split = Dtype::Bf16Split { rope: 2 };
        let x = [
            1.0f32 + 2f32.powi(-10),
            -3.0,
            1.0 + 2f32.powi(-10),
            -1234.567,
        ];
        let bytes = convert(&f32s(&x), Dtype::F32, split, 4).unwrap();
        assert_eq!(bytes.len(), (4 + 2) * 2);
        let back = convert(&bytes, split, Dtype::F32, 4).unwrap();
        let back: Vec<f32> = back
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // The latent part is plain bf16: 1 + 2⁻¹⁰ rounds to 1.
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], -3.0);
        // The rope part keeps 16 bits: 1 + 2⁻¹⁰ exactly, -1234.567 within 2⁻¹⁶ relative.
        assert_eq!(back[2], x[2]);
        assert!(
            (back[3] - x[3]).abs() <= x[3].abs() * 2f32.powi(-16),
            "{}",
            back[3]
        );
        // Split → bf16 keeps the rounded value; bf16 → split has a zero lo part.
        let plain = convert(&bytes, split, Dtype::Bf16, 4).unwrap();
        assert_eq!(
            plain,
            convert(&f32s(&x), Dtype::F32, Dtype::Bf16, 4).unwrap()
        );
        let again = convert(&plain, Dtype::Bf16, split, 4).unwrap();
        assert_eq!(&again[..8], &plain[..]);
        assert_eq!(&again[8..], &[0, 0, 0, 0]);
    }
}
