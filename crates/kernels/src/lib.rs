//! Deltafin's compute kernels, kept apart from model code.
//!
//! Every kernel here is the portable scalar path; it doubles as the test oracle for the SIMD paths
//! that replace it on hot loops. Kernels take plain slices and write into caller-owned buffers: no
//! allocation happens inside them, so the per-token loop can reuse its buffers.

pub mod approx;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod batch;
pub mod cpu;
mod dispatch;
pub mod expert;
pub mod matvec;
pub mod mxfp4;
#[cfg(target_arch = "x86_64")]
mod mxfp4_avx2;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod ops;
pub mod par;
pub mod roofline;
pub mod testdata;

pub use matvec::{bf16_matvec, f32_matvec, int8_matvec};
pub use mxfp4::{E2M1_LUT, e8m0_to_f32, mxfp4_matvec, mxfp4_matvec_par};
