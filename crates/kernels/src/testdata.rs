//! Deterministic inputs shared by the kernels' tests and benchmarks.
//!
//! Layer 1: imports nothing from the crate.

/// `n` pseudo-random bytes (an LCG: reproducible, every value reachable).
pub fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u8
        })
        .collect()
}

/// `n` E8M0 scales in `base..base + spread` (realistic magnitudes around 2^-8..2^-2).
pub fn scales(n: usize, seed: u64, base: u8, spread: u8) -> Vec<u8> {
    bytes(n, seed).iter().map(|b| base + b % spread).collect()
}
