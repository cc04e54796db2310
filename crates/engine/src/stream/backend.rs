//! Choosing a read back-end: io_uring where the kernel grants a ring (Linux only,
//! [`super::uring`]), the positioned-read thread pool of [`super::reader`] otherwise and on
//! every other platform.

use std::fs::File;
use std::io;
use std::sync::Arc;

use super::reader::{BackendKind, PreadPool, ReadBackend};
#[cfg(target_os = "linux")]
use super::uring::Uring;

/// Whether this kernel grants an io_uring ring (never off Linux).
pub fn io_uring_available() -> bool {
    #[cfg(target_os = "linux")]
    return super::uring::available();
    #[cfg(not(target_os = "linux"))]
    false
}

/// Pick a back-end: the forced one, or io_uring when the kernel grants a ring, else pread.
pub fn make_backend(
    files: Arc<Vec<File>>,
    force: Option<BackendKind>,
    depth: usize,
) -> io::Result<Box<dyn ReadBackend>> {
    match force {
        Some(BackendKind::Pread) => Ok(Box::new(PreadPool::new(files, depth))),
        #[cfg(target_os = "linux")]
        Some(BackendKind::IoUring) => Ok(Box::new(Uring::new(files, depth as u32)?)),
        #[cfg(not(target_os = "linux"))]
        Some(BackendKind::IoUring) => Err(io::Error::new(io::ErrorKind::Unsupported, "io_uring exists only on Linux")),
        #[cfg(target_os = "linux")]
        None => match Uring::new(files.clone(), depth as u32) {
            Ok(u) => Ok(Box::new(u)),
            Err(e) => {
                tracing::info!("io_uring unavailable ({e}); using the pread thread pool");
                Ok(Box::new(PreadPool::new(files, depth)))
            }
        },
        #[cfg(not(target_os = "linux"))]
        None => Ok(Box::new(PreadPool::new(files, depth))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::reader::tests::blocks_file;

    /// Off Linux there is no io_uring: asking for it is a clear error, `auto` takes the pool.
    #[test]
    fn io_uring_only_where_the_kernel_has_it() {
        let (_f, files) = blocks_file(1);
        let forced = make_backend(files.clone(), Some(BackendKind::IoUring), 4);
        if cfg!(target_os = "linux") {
            println!("io_uring: tested in stream::uring on Linux");
        } else {
            println!("SKIPPED io_uring reader: Linux only");
            assert_eq!(forced.err().map(|e| e.kind()), Some(io::ErrorKind::Unsupported));
            assert_eq!(make_backend(files, None, 4).unwrap().kind(), BackendKind::Pread);
        }
    }
}
