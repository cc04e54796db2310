//! Building blocks shared by the model families: each owns its weights, exposes `load` and a
//! one-token `forward`, and keeps its per-sequence state in a separate struct.

pub mod attn_res;
pub mod kda;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod router;
