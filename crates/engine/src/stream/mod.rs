//! Streaming routed experts from disk: aligned buffers, read back-ends, cache policies, and the
//! streaming expert source the model reads through.

pub mod activity;
pub mod aligned;
pub mod backend;
pub mod cache;
pub mod geometry;
pub mod io_thread;
pub mod probe;
pub mod reader;
pub mod replay;
pub mod spine;
pub mod streaming;
#[cfg(target_os = "linux")]
pub mod uring;
pub mod verify;
