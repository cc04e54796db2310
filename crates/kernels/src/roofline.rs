//! The two roofs a kernel is judged against, measured on this machine in the same run: memory
//! read bandwidth (a stream-style read over a buffer far larger than the caches) and the peak
//! f32 FMA rate (independent FMAs on registers), each for a given number of threads.
//!
//! Layer 4 (a measurement beside the operations): imports `cpu`, `scalar` and `isa`, whose FMA
//! probes it runs.

use std::hint::black_box;
use std::time::Instant;

use crate::cpu::Path;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx512};
use crate::scalar;

/// Trials each probe runs; the best is the roof. A roof is what the machine can do, and a
/// single trial is at the mercy of the moment: bench runs on record show the two-thread FMA
/// probe at 117-182 GFLOP/s in some runs and 209-233 in the rest, and the memory probe at
/// 22.5-45 GB/s (a floor from such a trial was beaten by the engine).
const TRIALS: usize = 4;

/// Run `work(thread, secs)` on `threads` threads started together at a barrier, `TRIALS` times
/// for `min_secs / TRIALS` each; returns the best trial's summed work per second of wall time
/// (the slowest thread's: all of them must have overlapped for the figure to be a rate of the
/// whole machine).
fn best_rate(threads: usize, min_secs: f64, work: impl Fn(usize, f64) -> f64 + Sync) -> f64 {
    let threads = threads.max(1);
    let secs = (min_secs / TRIALS as f64).max(1e-3);
    let mut best = f64::NAN;
    for _ in 0..TRIALS {
        let barrier = std::sync::Barrier::new(threads);
        let results: Vec<(f64, f64)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (barrier, work) = (&barrier, &work);
                    s.spawn(move || {
                        barrier.wait();
                        let t0 = Instant::now();
                        let done = work(t, secs);
                        (done, t0.elapsed().as_secs_f64())
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        if results.len() != threads {
            continue;
        }
        let wall = results.iter().map(|r| r.1).fold(0.0, f64::max);
        let rate = results.iter().map(|r| r.0).sum::<f64>() / wall;
        if rate.is_finite() && (best.is_nan() || rate > best) {
            best = rate;
        }
    }
    best
}

/// Read `buf` with `threads` threads (each its own share, whole passes over it) for about
/// `min_secs` in all; returns GB/s of the best trial.
pub fn read_bandwidth_gbps(buf: &[u64], threads: usize, min_secs: f64) -> f64 {
    let threads = threads.max(1);
    let chunk = buf.len().div_ceil(threads).max(1);
    let shares: Vec<&[u64]> = buf.chunks(chunk).collect();
    best_rate(shares.len(), min_secs, |t, secs| {
        let share = shares[t];
        let t0 = Instant::now();
        let mut passes = 0u64;
        while passes < 1 || t0.elapsed().as_secs_f64() < secs {
            black_box(sum_words(share));
            passes += 1;
        }
        passes as f64 * std::mem::size_of_val(share) as f64
    }) / 1e9
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

/// Peak f32 FMA rate with `threads` threads, in GFLOP/s (2 FLOP per FMA lane), of the best trial.
pub fn fma_peak_gflops(threads: usize, min_secs: f64) -> f64 {
    best_rate(threads, min_secs, |_, secs| fma_loop_on(Path::best(), secs)) / 1e9
}

/// Integer operations per second (GOP/s; a multiply-add is two) of `threads` threads' int8 dot
/// products (`vpdpbusd`), the roof of approximate mode's integer spine products; 0 where this
/// CPU has no such kernel ([`crate::approx::has_integer_spine`]).
pub fn int8_peak_gops(threads: usize, min_secs: f64) -> f64 {
    if !crate::approx::has_integer_spine() {
        return 0.0;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512F and VNNI present (has_integer_spine).
        best_rate(threads, min_secs, |_, secs| unsafe { avx512::vnni_loop(secs) }) / 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, min_secs);
        0.0
    }
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

    #[test]
    fn every_thread_counts_in_the_rate() {
        // Each thread does one unit of work per call: the rate is the threads' sum over the
        // slowest one's time, so two threads doing a fixed sleep report twice one thread's rate.
        let one = best_rate(1, 0.04, |_, _| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            1.0
        });
        let two = best_rate(2, 0.04, |_, _| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            1.0
        });
        assert!(one > 0.0 && two > 1.5 * one && two < 2.5 * one, "one {one}, two {two}");
    }
}
