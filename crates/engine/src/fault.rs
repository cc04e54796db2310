//! What a failed expert read looks like to the layers above: which record, what kind of fault,
//! and whether it was retried. The message names the layer and expert, never a file path, so a
//! server may pass it to its client as it is (the path goes to the log through `detail`).

use serde::Serialize;

/// The kind of a read fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// The read itself failed (EIO, a short read, a vanished file).
    Io,
    /// The bytes arrived but do not match the record's checksum.
    Checksum,
}

/// A routed expert that could not be read intact, even after one retry.
#[derive(Debug, Clone, thiserror::Error)]
#[error("reading layer {layer} expert {expert} failed ({}) after a retry", match kind { FaultKind::Io => "I/O error", FaultKind::Checksum => "checksum mismatch" })]
pub struct ReadFault {
    pub layer: usize,
    pub expert: usize,
    pub kind: FaultKind,
    /// The underlying error with its file, for the server's log only.
    pub detail: String,
}

/// Read faults counted by an expert source since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FaultStats {
    /// Reads that failed (each attempt counts).
    pub read_errors: u64,
    /// Records whose bytes failed their checksum (each attempt counts).
    pub checksum_failures: u64,
    /// Records read again after a fault.
    pub retries: u64,
    /// Faults that ended a request (the retry failed too).
    pub failed_records: u64,
    /// Times the source was returned to a clean state after a failed request.
    pub resets: u64,
    /// Expert I/O threads (which read and verify records) started again after one was lost
    /// with reads outstanding.
    pub io_restarts: u64,
}

/// A streamed spine layer that could not be read intact, even after one retry, or whose
/// loader's read back-end failed (a new one serves the next step). Like [`ReadFault`], its own
/// message names the layer and never a path, so a server may pass it on; the underlying error
/// (file, tensor) is its source, which the command line prints and a server only logs.
#[derive(Debug, Clone, thiserror::Error)]
#[error("reading spine layer {layer} failed ({})", match kind { FaultKind::Io => "I/O error", FaultKind::Checksum => "checksum mismatch" })]
pub struct SpineFault {
    pub layer: usize,
    pub kind: FaultKind,
    #[source]
    pub detail: FaultDetail,
}

/// The underlying error of a fault, with its file: for logs and the command line.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct FaultDetail(pub String);

/// Routed experts of a streaming store that could not be made present: fetching them from the
/// origin failed, or the run is offline. The message names the layer, never a path or URL
/// (those are in `detail`, for the log).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", match offline {
    true => format!("layer {layer} expert {expert} is not in this streaming store yet, and this run is offline (run without --offline, or fill the store with `deltafin warmup --fetch` or `deltafin install --upgrade-to-full`)"),
    false => format!("fetching {count} expert(s) of layer {layer} from the origin failed"),
})]
pub struct FetchFault {
    pub layer: usize,
    /// The first expert concerned.
    pub expert: usize,
    pub count: usize,
    /// Every expert concerned (`count` of them): the sequences of a batched step that chose
    /// none of them are not to blame.
    pub experts: Vec<usize>,
    pub offline: bool,
    pub detail: String,
}
