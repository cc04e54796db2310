//! What differs between operating systems, one module per concern; the rest of the engine calls
//! these and stays portable. Each module holds every platform's version of its concern (Linux,
//! macOS, Windows) behind `cfg(target_os)`; positioned file I/O lives in `deltafin_store::os`,
//! and the io_uring reader, which exists only on Linux, in `stream::uring`.
//!
//! - [`budget`]: how much memory this process may use (the default budget).
//! - [`cpus`]: how many threads compute by default.
//! - [`files`]: opening a file for reads that bypass the system's cache.
//! - [`machine`]: what machine this is, and a drive's size and free space (benchmark reports).
//! - [`memory`]: giving pages back, the page size, the peak resident size.

pub mod budget;
pub mod cpus;
pub mod files;
pub mod machine;
pub mod memory;
