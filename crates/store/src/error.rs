//! Errors of the store: every variant names the file (and tensor, layer or expert) it concerns.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{file}: {msg}")]
    Config { file: String, msg: String },

    #[error("{}: {msg}", path.display())]
    Safetensors { path: PathBuf, msg: String },

    #[error("{}: tensor '{tensor}': {msg}", path.display())]
    Tensor { path: PathBuf, tensor: String, msg: String },

    #[error("tensor '{tensor}' is missing from the checkpoint ({})", dir.display())]
    MissingTensor { dir: PathBuf, tensor: String },

    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "expert record layer {layer} expert {expert}: checksum mismatch (stored {expected:016x}, read {actual:016x}); the bytes on disk are corrupt or the source shard changed"
    )]
    Checksum { layer: usize, expert: usize, expected: u64, actual: u64 },

    #[error(
        "layer {layer} expert {expert} has not been fetched into this streaming store yet; fetching needs the network (run without --offline, or fill the store first with `deltafin warmup --fetch` or `deltafin install --upgrade-to-full`)"
    )]
    Absent { layer: usize, expert: usize },

    #[error("store {}: {msg}", path.display())]
    Store { path: PathBuf, msg: String },

    #[error("source shard {} {msg}; re-run `deltafin convert` or restore the original checkpoint", path.display())]
    SourceChanged { path: PathBuf, msg: String },
}

pub fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { path, source }
}
