//! The two roofs a kernel is judged against, measured on this machine in the same run: memory
//! read bandwidth (a stream-style read over a buffer far larger than the caches) and the peak
//! f32 FMA rate (independent FMAs on registers), each for a given number of threads.
//!
//! Layer 4 (a measurement beside the operations): imports `cpu`, `scalar` and `isa`, whose FMA
//! probes it runs.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

use crate::cpu::Path;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx512};
use crate::scalar;

/// Read `buf` once per pass with `threads` threads for at least `min_secs`; returns GB/s.
pub fn read_bandwidth_gbps(buf: &[u64], threads: usize, min_secs: f64) -> f64 {
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
        Ok(p) => p,
        Err(_) => return f64::NAN,
    };
    pool.install(|| {
        let chunk = buf.len().div_ceil(threads);
        let t0 = Instant::now();
        let mut passes = 0u64;
        while t0.elapsed().as_secs_f64() < min_secs || passes < 2 {
            let s: u64 = buf.par_chunks(chunk).map(sum_words).reduce(|| 0, |a, b| a ^ b);
            black_box(s);
            passes += 1;
        }
        (passes as f64 * std::mem::size_of_val(buf) as f64) / t0.elapsed().as_secs_f64() / 1e9
    })
}

/// XOR-fold of the words: the cheapest work that still reads every byte.
fn sum_words(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(8);
    for w in &mut it {
        for l in 0..8 {
            acc[l] ^= w[l];
        }
    }
    it.remainder().iter().fold(acc.iter().fold(0, |a, b| a ^ b), |a, b| a ^ b)
}

/// Peak f32 FMA rate with `threads` threads, in GFLOP/s (2 FLOP per FMA lane).
pub fn fma_peak_gflops(threads: usize, min_secs: f64) -> f64 {
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
        Ok(p) => p,
        Err(_) => return f64::NAN,
    };
    pool.install(|| {
        let t0 = Instant::now();
        let flops: f64 = (0..threads).into_par_iter().map(|_| fma_loop_on(Path::best(), min_secs)).sum();
        flops / t0.elapsed().as_secs_f64() / 1e9
    })
}

/// FLOPs done by one thread in `secs` of back-to-back FMAs on `path`, as wide as its kernels'
/// registers (512-bit on AVX-512: on Zen 5 that is twice the AVX2 rate, and a roof measured with
/// AVX2 would credit the AVX-512 kernels with twice their real efficiency), else scalar.
fn fma_loop_on(path: Path, secs: f64) -> f64 {
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F present (an available path).
        Path::Avx512 => unsafe { avx512::fma_loop(secs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path).
        Path::Avx2 => unsafe { avx2::fma_loop(secs) },
        _ => scalar::fma_loop(secs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofs_are_positive_and_finite() {
        let buf = vec![1u64; 1 << 16];
        let bw = read_bandwidth_gbps(&buf, 1, 0.01);
        assert!(bw.is_finite() && bw > 0.0);
        let f = fma_peak_gflops(1, 0.01);
        assert!(f.is_finite() && f > 0.0);
    }
}
