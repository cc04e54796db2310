//! The two roofs a kernel is judged against, measured on this machine in the same run: memory
//! read bandwidth (a stream-style read over a buffer far larger than the caches) and the peak
//! f32 FMA rate (independent FMAs on registers), each for a given number of threads.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

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
        let flops: f64 = (0..threads).into_par_iter().map(|_| fma_loop(min_secs)).sum();
        flops / t0.elapsed().as_secs_f64() / 1e9
    })
}

/// FLOPs done by one thread in `secs` of back-to-back FMAs.
fn fma_loop(secs: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA.
        return unsafe { fma_loop_avx2(secs) };
    }
    fma_loop_scalar(secs)
}

fn fma_loop_scalar(secs: f64) -> f64 {
    let t0 = Instant::now();
    let mut acc = [1.0f32; 16];
    let (a, b) = (black_box(0.999_999f32), black_box(1e-7f32));
    let mut iters = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        for _ in 0..1_000_000 {
            for v in acc.iter_mut() {
                *v = v.mul_add(a, b);
            }
        }
        iters += 1_000_000;
    }
    black_box(acc);
    iters as f64 * 16.0 * 2.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(secs: f64) -> f64 {
    use std::arch::x86_64::*;
    let t0 = Instant::now();
    let a = _mm256_set1_ps(black_box(0.999_999));
    let b = _mm256_set1_ps(black_box(1e-7));
    // Twelve independent chains cover the FMA latency on two ports.
    let mut acc = [_mm256_set1_ps(1.0); 12];
    let mut iters = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        for _ in 0..100_000 {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        iters += 100_000;
    }
    black_box(acc);
    iters as f64 * 12.0 * 8.0 * 2.0
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
