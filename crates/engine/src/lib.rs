//! The Deltafin engine: model families over shared blocks, the expert interface, tokenizer and
//! generation.

pub mod blocks;
pub mod chat;
pub mod experts;
pub mod generate;
pub mod k3;
pub mod plan;
pub mod sample;
pub mod scratch;
pub mod session;
pub mod spine_stream;
pub mod stream;
pub mod textgen;
pub mod tokenizer;
pub mod trace;
pub mod weights;
pub use deltafin_kernels::cpu::kernel_path;
pub use deltafin_kernels::par::{init_threads, threads};
