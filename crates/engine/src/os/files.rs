//! Opening a file for reads that bypass the system's file cache (the expert cache is ours, and a
//! second copy in the page cache would only take memory from it):
//!
//! - Linux: `O_DIRECT`. Buffers, offsets and lengths must be multiples of the logical block
//!   size; the readers use 4096 ([`crate::stream::aligned::DIRECT_ALIGN`]). tmpfs and some
//!   other file systems refuse it with EINVAL: the file is then read through the cache.
//! - macOS: `F_NOCACHE` on the descriptor (reads go to the drive and leave nothing cached;
//!   alignment is not required, though the readers keep it) and `F_RDAHEAD` off, since the
//!   readers ask for exactly what they need.
//! - Windows: `FILE_FLAG_NO_BUFFERING`, whose alignment rule is the volume's sector size: used
//!   only when 4096 is a multiple of it (sectors of 512 or 4096 bytes); otherwise buffered.

use std::fs::File;
use std::io;
use std::path::Path;

/// Open `path` for reading without the system's cache where this platform and file system
/// allow it; returns the file and whether the cache is bypassed.
pub fn open_uncached(path: &Path) -> io::Result<(File, bool)> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((File::open(path)?, false)),
            Err(e) => Err(e),
        }
    }
    #[cfg(target_os = "macos")]
    {
        use std::os::fd::AsRawFd;
        let f = File::open(path)?;
        // SAFETY: fcntl on a descriptor this function owns, with integer arguments.
        let nocache = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) } == 0;
        // SAFETY: as above.
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_RDAHEAD, 0) };
        Ok((f, nocache))
    }
    #[cfg(windows)]
    {
        use std::os::windows::fs::OpenOptionsExt;
        use windows_sys::Win32::Storage::FileSystem::FILE_FLAG_NO_BUFFERING;
        if sector_size(path).is_some_and(|s| s > 0 && crate::stream::aligned::DIRECT_ALIGN.is_multiple_of(s))
            && let Ok(f) = std::fs::OpenOptions::new().read(true).custom_flags(FILE_FLAG_NO_BUFFERING).open(path)
        {
            return Ok((f, true));
        }
        Ok((File::open(path)?, false))
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
    {
        Ok((File::open(path)?, false))
    }
}

/// The sector size of the volume holding `path` (`GetDiskFreeSpaceW` of its root).
#[cfg(windows)]
fn sector_size(path: &Path) -> Option<usize> {
    use std::os::windows::ffi::OsStrExt;
    use windows_sys::Win32::Storage::FileSystem::GetDiskFreeSpaceW;
    let abs = std::fs::canonicalize(path).ok()?;
    let root = abs.ancestors().last()?;
    let wide: Vec<u16> = root.as_os_str().encode_wide().chain(std::iter::once(0)).collect();
    let (mut spc, mut bps, mut free, mut total) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: `wide` is NUL-terminated; the four out-parameters are valid u32s.
    let ok = unsafe { GetDiskFreeSpaceW(wide.as_ptr(), &mut spc, &mut bps, &mut free, &mut total) } != 0;
    ok.then_some(bps as usize)
}
