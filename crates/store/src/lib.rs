//! Deltafin's on-disk world: Hugging Face checkpoints in, Deltafin stores out.
//!
//! - [`shard`]: one safetensors file read by its header, tensor by tensor.
//! - [`checkpoint`]: a sharded K3 checkpoint directory with its config and index.
//! - [`schema`]: the tensors a K3 model must have, with the shapes its config implies.
//! - [`convert`]: checkpoint -> store (spine file, expert locations, manifest).
//! - [`presence`]: which experts a streaming store holds yet, and their checksums.
//! - [`store`]: opening a store; spine tensors and routed-expert records by (layer, expert).

pub mod checkpoint;
pub mod checksum;
pub mod config;
mod config_check;
pub mod convert;
pub mod error;
pub mod image;
pub mod manifest;
pub mod os;
pub mod presence;
pub mod progress;
pub mod quant;
pub mod schema;
pub mod shard;
pub mod spine;
pub mod store;
pub mod synth;

pub use config::{AttnKind, K3Config};
pub use error::StoreError;
pub use image::{ImageVerifier, SpineImage};
pub use manifest::{ExpertLayout, KeepRule, Manifest, SpineDtype, SpinePrecision};
pub use spine::{Elems, ImageBytes, LoadedTensor, SpineData, SpineSource, SpineTable, empty_image};
pub use store::{ExpertFiles, Store};
