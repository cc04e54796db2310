//! The store's one checksum: XXH3-64 (seed 0), through `twox-hash`, which picks AVX2 or NEON
//! at run time. Verifying a record is a full pass over it on every read from the drive, so the
//! hash's speed is part of every step. A portable build of a compile-time-dispatched XXH3 gets
//! SSE2 (BENCHMARKS.md section 9 compares both: `cargo bench -p deltafin-store --bench
//! checksum`).

use std::hash::Hasher as _;

/// XXH3-64 of `bytes` in one call.
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// XXH3-64 over bytes that arrive in pieces; equal to [`xxh3_64`] of their concatenation.
/// Held in an `Option` only so that [`Xxh3::reset`] can take the hasher apart and keep its
/// secret (the hasher allocates one when built).
pub struct Xxh3(Option<twox_hash::XxHash3_64>);

impl Default for Xxh3 {
    fn default() -> Self {
        Self::new()
    }
}

impl Xxh3 {
    pub fn new() -> Self {
        Xxh3(Some(twox_hash::XxHash3_64::with_seed(0)))
    }

    /// Start over without allocating: the new hasher keeps the old one's secret (the seed-0
    /// secret), so a verifier reused for every streamed layer allocates nothing per layer.
    pub fn reset(&mut self) {
        self.0 = Some(match self.0.take().map(|h| twox_hash::XxHash3_64::with_seed_and_secret(0, h.into_secret())) {
            Some(Ok(h)) => h,
            _ => twox_hash::XxHash3_64::with_seed(0),
        });
    }

    pub fn update(&mut self, bytes: &[u8]) {
        if let Some(h) = &mut self.0 {
            h.write(bytes);
        }
    }

    pub fn digest(&self) -> u64 {
        self.0.as_ref().map_or_else(|| xxh3_64(&[]), |h| h.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stores written so far carry checksums from another XXH3 implementation
    /// (`xxhash-rust`); both must agree on every length class XXH3 treats apart (0, 1-3, 4-8,
    /// 9-16, 17-128, 129-240, long, with partial stripes and blocks), whole and in pieces.
    #[test]
    fn agrees_with_an_independent_xxh3_whole_and_in_pieces() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let lens = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65_536, 65_537, 3_000_000];
        for &n in &lens {
            let b = &data[..n];
            let want = xxhash_rust::xxh3::xxh3_64(b);
            assert_eq!(xxh3_64(b), want, "length {n}");
            for piece in [1usize, 7, 64, 4096, 1 << 20] {
                let mut h = Xxh3::new();
                b.chunks(piece).for_each(|c| h.update(c));
                assert_eq!(h.digest(), want, "length {n} in pieces of {piece}");
                // A reset hasher (one reused after other bytes) agrees too.
                h.update(&data[..piece.min(4096)]);
                h.reset();
                b.chunks(piece).for_each(|c| h.update(c));
                assert_eq!(h.digest(), want, "length {n} in pieces of {piece}, after a reset");
            }
        }
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2, "XXH3-64 of nothing, from the specification's test vectors");
    }
}
