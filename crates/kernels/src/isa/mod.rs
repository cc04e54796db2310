//! Layer 3, one module per instruction set, each holding all of that instruction set's kernels
//! (approximate-mode ones included). They may import only `format`, `cpu`, `scalar`, `par` and
//! their own instruction set's lane math (`avx512_math`, `avx2_math`);
//! the operation modules above choose among them in their `op_on(path, ..)`.

/// The roofline's FMA loop over one instruction set's vector type: twelve independent chains
/// (enough to cover the FMA latency on two units) for at least `secs` seconds; the FLOPs done.
#[cfg(target_arch = "x86_64")]
macro_rules! fma_loop_body {
    ($secs:expr, $set1:ident, $fmadd:ident, $lanes:expr) => {{
        let t0 = std::time::Instant::now();
        let a = $set1(std::hint::black_box(0.999_999));
        let b = $set1(std::hint::black_box(1e-7));
        let mut acc = [$set1(1.0); 12];
        let mut iters = 0u64;
        while t0.elapsed().as_secs_f64() < $secs {
            for _ in 0..100_000 {
                for v in acc.iter_mut() {
                    *v = $fmadd(*v, a, b);
                }
            }
            iters += 100_000;
        }
        std::hint::black_box(acc);
        iters as f64 * 12.0 * $lanes as f64 * 2.0
    }};
}
#[cfg(target_arch = "x86_64")]
use fma_loop_body;

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx2_gemm;
#[cfg(target_arch = "x86_64")]
pub mod avx2_math;
#[cfg(target_arch = "x86_64")]
pub mod avx2_tile;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod avx512_attn;
#[cfg(target_arch = "x86_64")]
pub mod avx512_math;
#[cfg(target_arch = "x86_64")]
pub mod avx512_qtile;
#[cfg(target_arch = "x86_64")]
pub mod avx512_tile;
#[cfg(target_arch = "aarch64")]
pub mod neon;
#[cfg(target_arch = "x86_64")]
pub mod staging;
