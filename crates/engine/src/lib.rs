//! The Deltafin engine: the model and the runtime that feeds it, knowing only token ids.
//!
//! - Model math: [`k3`] (the Kimi K3 model and its one token path) over shared [`blocks`]
//!   (attention, router, MoE block, MLP), [`weights`] and per-token [`scratch`].
//! - The expert interface: [`experts`], the one narrow path by which routed-expert weights reach
//!   the model, and [`fault`], what a failed read looks like above it.
//! - The I/O runtime: [`stream`] (read back-ends, record geometry, the expert cache and the
//!   streaming expert source, spine streaming), [`plan`] (the memory budget) and [`session`]
//!   (options to a loaded model with its expert source).
//! - [`os`]: what differs between operating systems, one module per concern.
//! - [`generate`]: the one generation loop; [`study`]: router traces and routing overrides.
//!
//! Text (tokenizer, chat format, sampling) lives in the `deltafin-text` crate above this one.

pub mod batch;
pub mod blocks;
pub mod chunk_spine;
pub mod experts;
pub mod fault;
pub mod generate;
pub mod gpu_plan;
pub mod k3;
pub mod os;
pub mod plan;
pub mod prefix_store;
pub mod scratch;
pub mod session;
pub mod stream;
pub mod study;
pub mod units;
pub mod weights;
pub use deltafin_kernels::cpu::kernel_path;
pub use deltafin_kernels::par::{init_threads, threads};
