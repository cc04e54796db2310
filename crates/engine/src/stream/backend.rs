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

/// The environment variable that says io_uring must work here: `scripts/test.sh` sets it to `1`
/// after one probe finds that the kernel grants a ring, so that a test which would skip its
/// io_uring part for want of a ring fails instead of passing untested.
pub const REQUIRE_IO_URING_ENV: &str = "DELTAFIN_REQUIRE_IO_URING";

/// Whether [`REQUIRE_IO_URING_ENV`] is set to `1`.
pub fn io_uring_required() -> bool {
    std::env::var(REQUIRE_IO_URING_ENV).is_ok_and(|v| v == "1")
}

/// For tests: whether to run their io_uring part. True where the kernel grants a ring; where it
/// refuses one, an error if [`io_uring_required`] (the caller fails), else `Ok(false)` after
/// printing `SKIPPED {what}`.
pub fn io_uring_for_tests(what: &str) -> Result<bool, String> {
    if io_uring_available() {
        return Ok(true);
    }
    if io_uring_required() {
        return Err(format!("{REQUIRE_IO_URING_ENV}=1, but this kernel refuses io_uring rings ({what})"));
    }
    println!("SKIPPED {what}: this kernel refuses io_uring rings");
    Ok(false)
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

    /// io_uring where the kernel grants a ring: forced, it is what is built, and `auto` takes it.
    /// Where no ring is granted (always off Linux), forcing it is an error and `auto` takes the
    /// pool; with `DELTAFIN_REQUIRE_IO_URING=1` that case fails the test instead.
    #[test]
    fn io_uring_only_where_the_kernel_has_it() {
        let (_f, files) = blocks_file(1);
        let forced = make_backend(files.clone(), Some(BackendKind::IoUring), 4);
        let auto = make_backend(files.clone(), None, 4).unwrap().kind();
        assert_eq!(make_backend(files, Some(BackendKind::Pread), 4).unwrap().kind(), BackendKind::Pread);
        if io_uring_available() {
            assert_eq!(forced.unwrap().kind(), BackendKind::IoUring);
            assert_eq!(auto, BackendKind::IoUring);
        } else {
            assert!(!io_uring_required(), "{REQUIRE_IO_URING_ENV}=1, but this kernel refuses io_uring rings");
            assert!(forced.is_err(), "io_uring built where the kernel refuses rings");
            if !cfg!(target_os = "linux") {
                assert_eq!(forced.err().map(|e| e.kind()), Some(io::ErrorKind::Unsupported));
            }
            assert_eq!(auto, BackendKind::Pread);
        }
    }

    /// The switch reads `1` only; the helper's answer follows the kernel and the switch.
    #[test]
    fn the_requirement_follows_the_kernel_and_the_switch() {
        match io_uring_for_tests("this check") {
            Ok(true) => assert!(io_uring_available()),
            Ok(false) => assert!(!io_uring_available() && !io_uring_required()),
            Err(e) => assert!(!io_uring_available() && io_uring_required() && e.contains(REQUIRE_IO_URING_ENV)),
        }
    }
}
