//! Head padding for the tiled absorbed-MLA kernel.
//!
//! The production absorbed-MLA kernels (AMD AITER, and ferry's own tiled kernels) put the query
//! heads of one token on the rows of a 16-row matrix tile, so they accept 4, 8 or a multiple of
//! 16 heads. Other counts (12 heads per rank for Kimi K3 at TP8) are zero-padded up to the next
//! supported count and the real heads' rows are sliced back afterwards. Padding is exact: in
//! the absorbed form every head attends independently against the one shared latent head, so
//! padded rows never mix with real ones (`shared/reference/mla.md`, "Head-count constraints").

use crate::error::KernelError;

/// Rows of one query-head tile in the absorbed kernel.
pub const TILE_ROWS: usize = 16;

/// Whether the tiled kernel takes `heads` query heads directly: 4, 8, or a positive multiple of 16.
pub fn is_supported_tile_heads(heads: usize) -> bool {
    heads == 4 || heads == 8 || (heads > 0 && heads % TILE_ROWS == 0)
}

/// How many heads the tiled kernel runs for a given real head count.
///
/// `padded` is `real` when the kernel supports it, otherwise the smallest supported count
/// above it: 1..=3 → 4, 5..=7 → 8, 9..=15 → 16, 17..=31 → 32, and so on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPadPlan {
    /// Heads the model has on this rank.
    pub real: usize,
    /// Heads the kernel runs (`>= real`); rows `real..padded` are zero queries.
    pub padded: usize,
}

impl HeadPadPlan {
    /// Plans `heads` real heads; zero heads is rejected because there is nothing to run.
    pub fn for_heads(heads: usize) -> Result<Self, KernelError> {
        let padded = match heads {
            0 => {
                return Err(KernelError::InvalidParam {
                    op: "head_pad_plan",
                    field: "heads",
                    limit: "> 0",
                    value: heads.to_string(),
                })
            }
            1..=4 => 4,
            5..=8 => 8,
            h => h.div_ceil(TILE_ROWS) * TILE_ROWS,
        };
        Ok(Self {
            real: heads,
            padded,
        })
    }

    /// Whether the kernel needs padded copies of the inputs.
    pub fn needs_padding(&self) -> bool {
        self.padded != self.real
    }

    /// Rows per tile when running `padded` heads: `min(padded, 16)`.
    pub fn tile_rows(&self) -> usize {
        self.padded.min(TILE_ROWS)
    }

    /// Copies `[tokens][real][width]` into `[tokens][padded][width]`, zero-filling the extra heads.
    pub fn pad_heads(&self, x: &[f32], width: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let tokens = self.tokens("pad_heads", x.len(), self.real, width)?;
        check_len("pad_heads", "out", tokens * self.padded * width, out.len())?;
        let (real_row, padded_row) = (self.real * width, self.padded * width);
        for (src, dst) in x
            .chunks_exact(real_row)
            .zip(out.chunks_exact_mut(padded_row))
        {
            let (head, tail) = dst.split_at_mut(real_row);
            head.copy_from_slice(src);
            tail.fill(0.0);
        }
        Ok(())
    }

    /// Slices the real heads back: `[tokens][padded][width]` → `[tokens][real][width]`.
    pub fn unpad_heads(&self, x: &[f32], width: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let tokens = self.tokens("unpad_heads", x.len(), self.padded, width)?;
        check_len("unpad_heads", "out", tokens * self.real * width, out.len())?;
        let (real_row, padded_row) = (self.real * width, self.padded * width);
        for (src, dst) in x
            .chunks_exact(padded_row)
            .zip(out.chunks_exact_mut(real_row))
        {
            dst.copy_from_slice(&src[..real_row]);
        }
        Ok(())
    }

    /// Token count of a `[tokens][heads][width]` buffer of length `len`.
    fn tokens(
        &self,
        op: &'static str,
        len: usize,
        heads: usize,
        width: usize,
    ) -> Result<usize, KernelError> {
        let row = heads * width;
        if row == 0 || len % row != 0 {
            return Err(KernelError::NotDivisible {
                op,
                what: "x",
                len,
                width: row,
            });
        }
        Ok(len / row)
    }
}

fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::ShapeMismatch {
            op,
            what,
            expected,
            got,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_counts() {
        for h in [4, 8, 16, 32, 48, 128] {
            assert!(is_supported_tile_heads(h), "{h}");
        }
        for h in [0, 1, 2, 3, 5, 6, 7, 9, 12, 15, 17, 20, 24, 31, 33] {
            assert!(!is_supported_tile_heads(h), "{h}");
        }
    }

    #[test]
    fn padded_counts() {
        let cases = [
            (1, 4),
            (3, 4),
            (4, 4),
            (5, 8),
            (8, 8),
            (9, 16),
            (12, 16),
            (16, 16),
            (17, 32),
            (20, 32),
            (31, 32),
            (32, 32),
            (33, 48),
            (96, 96),
        ];
        for (real, padded) in cases {
            let plan = HeadPadPlan::for_heads(real).expect("non-zero heads");
            assert_eq!(plan, HeadPadPlan { real, padded }, "{real}");
            assert!(is_supported_tile_heads(plan.padded));
        }
        assert!(HeadPadPlan::for_heads(0).is_err());
    }

    #[test]
    fn pad_then_unpad_round_trips() {
        let plan = HeadPadPlan::for_heads(3).expect("non-zero heads");
        let x: Vec<f32> = (0..2 * 3 * 5).map(|v| v as f32 + 1.0).collect();
        let mut padded = vec![f32::NAN; 2 * 4 * 5];
        plan.pad_heads(&x, 5, &mut padded).expect("shapes match");
        assert_eq!(&padded[15..20], &[0.0; 5]);
        let mut back = vec![0.0; x.len()];
        plan.unpad_heads(&padded, 5, &mut back)
            .expect("shapes match");
        assert_eq!(back, x);
    }
}
