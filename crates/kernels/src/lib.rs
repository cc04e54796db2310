//! Deltafin's compute kernels, kept apart from model code, in layers (a module imports only
//! modules on lower layers; no import cycles):
//!
//! 1. [`format`](mod@format) (what the bytes mean: MXFP4 blocks, E2M1 tables, E8M0, int8
//!    activation blocks), [`cpu`] (feature detection and the one kernel-path enum, [`cpu::Path`]),
//!    [`par`] (the thread pool), [`testdata`].
//! 2. [`scalar`]: the portable code, every kernel's reference twin and the oracle of its SIMD paths.
//! 3. `isa::{avx2, avx512, neon}`: one module per instruction set, each holding all of its kernels.
//! 4. Operations: [`mxfp4`], [`expert`], [`approx`], [`matvec`], [`ops`], [`attention`] (and the
//!    [`roofline`] measurement); only [`expert`] imports another of them, [`mxfp4`], below it.
//!    Each dispatched operation comes as `op_on(path, ..)`, which matches on the path once and runs
//!    that path's kernel (falling back where this CPU lacks the path or the path has no kernel for
//!    the arguments), and `op(..)` = `op_on(Path::best(), ..)`.
//!
//! Kernels take plain slices and write into caller-owned buffers: nothing allocates per call once
//! the per-thread scratch is warm, so the per-token loop can reuse its buffers.

pub mod cpu;
pub mod format;
pub mod par;
pub mod testdata;

pub mod scalar;

mod isa;

pub mod approx;
pub mod attention;
pub mod expert;
pub mod matvec;
pub mod mxfp4;
pub mod ops;
pub mod roofline;

pub use format::{E2M1_LUT, e8m0_to_f32};
pub use matvec::{bf16_matvec, f32_matvec, int8_matmat, int8_matvec, int8_matvec_multi};
pub use mxfp4::{mxfp4_matvec, mxfp4_matvec_par};
