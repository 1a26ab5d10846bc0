//! Prefix identity: chained XXH3-64 hashes of full KV blocks.
//!
//! `h_0 = XXH3(le(tokens of block 0), seed)` and `h_i = XXH3(le(h_{i-1}) ++ le(tokens of block i),
//! seed)`, full blocks only (ARCHITECTURE.md, "Prefix identity"). Because each hash folds in its
//! parent, one hash names a whole prefix: two prompts share `h_i` exactly when (up to a 64-bit
//! collision) their first `i + 1` blocks are equal. The router computes the same hashes from the
//! same tokens to look up its index, so the byte layout (little-endian `u32` tokens, the parent as
//! little-endian `u64`) and [`BLOCK_HASH_SEED`] are a cross-process contract: they must not depend
//! on the machine, and changing either is a wire-format change for every worker and router.
//!
//! Cost: one XXH3 pass over `4 * page_size + 8` bytes per block, O(tokens) in all.

use crate::ids::BlockHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every block hash: the ASCII bytes `ferry-kv` read big-endian.
///
/// A fixed, named seed (rather than XXH3's default) keeps ferry's hashes distinct from any other
/// system hashing the same tokens; it is part of the router ↔ worker contract.
pub const BLOCK_HASH_SEED: u64 = u64::from_be_bytes(*b"ferry-kv");

/// The chained hashes of every FULL block of `tokens`, in order; a partial trailing block has no
/// hash (its KV is still being written, so it cannot be shared).
///
/// Returns an empty list when `page_size` is 0 (no block can be full).
pub fn block_hashes(tokens: &[u32], page_size: usize) -> Vec<BlockHash> {
    if page_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    let mut buf = Vec::with_capacity(8 + 4 * page_size);
    let mut parent = None;
    for block in tokens.chunks_exact(page_size) {
        let h = hash_into(&mut buf, parent, block);
        out.push(h);
        parent = Some(h);
    }
    out
}

/// The hash of one full block given its parent's hash (`None` for the first block): one link of
/// the chain [`block_hashes`] builds, for callers that extend a prefix a block at a time.
pub fn chain_hash(parent: Option<BlockHash>, block: &[u32]) -> BlockHash {
    let mut buf = Vec::with_capacity(8 + 4 * block.len());
    hash_into(&mut buf, parent, block)
}

/// Hashes `le(parent) ++ le(block)` using `buf` as scratch space.
fn hash_into(buf: &mut Vec<u8>, parent: Option<BlockHash>, block: &[u32]) -> BlockHash {
    buf.clear();
    if let Some(p) = parent {
        buf.extend_from_slice(&p.0.to_le_bytes());
    }
    for t in block {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(buf, BLOCK_HASH_SEED))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_leading_hashes() {
        let a: Vec<u32> = (0..20).collect();
        let mut b = a.clone();
        b[13] = 999; // block 3 (page 4) differs
        let ha = block_hashes(&a, 4);
        let hb = block_hashes(&b, 4);
        assert_eq!(ha.len(), 5);
        assert_eq!(ha[..3], hb[..3]);
        assert_ne!(ha[3], hb[3]);
        assert_ne!(ha[4], hb[4], "a change propagates down the chain");
    }

    #[test]
    fn change_in_block_zero_changes_every_hash() {
        let a: Vec<u32> = (0..16).collect();
        let mut b = a.clone();
        b[0] = 7;
        let (ha, hb) = (block_hashes(&a, 4), block_hashes(&b, 4));
        for (x, y) in ha.iter().zip(&hb) {
            assert_ne!(x, y);
        }
        // Same block contents at the same depth but a different parent: different hash.
        let c: Vec<u32> = vec![1, 2, 3, 4, 1, 2, 3, 4];
        let hc = block_hashes(&c, 4);
        assert_ne!(hc[0], hc[1]);
    }

    #[test]
    fn partial_trailing_block_is_ignored() {
        let a: Vec<u32> = (0..11).collect();
        let h = block_hashes(&a, 4);
        assert_eq!(h.len(), 2);
        assert_eq!(h, block_hashes(&a[..8], 4));
        assert!(block_hashes(&a[..3], 4).is_empty());
        assert!(block_hashes(&a, 0).is_empty());
    }

    #[test]
    fn chain_hash_matches_block_hashes() {
        let a: Vec<u32> = (100..112).collect();
        let h = block_hashes(&a, 4);
        let h0 = chain_hash(None, &a[..4]);
        let h1 = chain_hash(Some(h0), &a[4..8]);
        let h2 = chain_hash(Some(h1), &a[8..12]);
        assert_eq!(h, vec![h0, h1, h2]);
    }

    /// Pinned values: the router and every worker must agree on these bit for bit, on every
    /// machine. If this test fails, the hash contract changed.
    #[test]
    fn hashes_are_pinned() {
        let expected_h0 = xxh3_64_with_seed(&[1, 0, 0, 0, 2, 0, 0, 0], BLOCK_HASH_SEED);
        let h = block_hashes(&[1, 2, 3, 4], 2);
        assert_eq!(h[0].0, expected_h0);
        let mut bytes = expected_h0.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[3, 0, 0, 0, 4, 0, 0, 0]);
        assert_eq!(h[1].0, xxh3_64_with_seed(&bytes, BLOCK_HASH_SEED));
        assert_eq!(BLOCK_HASH_SEED, 0x6665_7272_792d_6b76);
        assert_eq!(h, PINNED.map(BlockHash).to_vec());
    }

    const PINNED: [u64; 2] = [1_271_777_170_181_128_010, 11_458_073_488_450_264_409];
}
