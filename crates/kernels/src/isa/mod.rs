//! Layer 3, one module per instruction set, each holding all of that instruction set's kernels
//! (approximate-mode ones included). They may import only `format`, `cpu`, `scalar`, `par` and
//! their own instruction set's lane math (`avx512_math`);
//! the operation modules above choose among them in their `op_on(path, ..)`.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod avx512_math;
#[cfg(target_arch = "x86_64")]
pub mod avx512_tile;
#[cfg(target_arch = "aarch64")]
pub mod neon;
