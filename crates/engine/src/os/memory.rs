//! Memory as the operating system sees it: giving pages back while keeping the address range
//! (a prompt that borrows the expert cache's memory must really shrink the process, since the
//! budget is a resident size), the page size, and the process' peak resident size.

/// The system's page size: 4 KiB on x86 Linux and Windows, 16 KiB on Apple Silicon.
pub fn page_size() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p).ok().filter(|&p| p.is_power_of_two()).unwrap_or(4096)
    }
    #[cfg(not(unix))]
    {
        4096
    }
}

/// Alignment of a mapped I/O buffer: one huge page on x86-64 and arm64 Linux.
#[cfg(unix)]
const HUGE_PAGE: usize = 2 << 20;

/// `len` bytes (a multiple of the page size) for an I/O buffer straight from the system:
/// zero until touched, aligned to 2 MiB, and on Linux asked to be backed by transparent huge
/// pages. An O_DIRECT read pins the pages of its buffer for every read; a 17.5 MB record on
/// 4 KiB pages is 4,284 pins, and on the benchmark machine's drive that held fio replaying the
/// engine's reads at 1.8-2.0 GB/s where the same reads on pre-registered buffers
/// (`--fixedbufs`) ran at 3.0-3.8, and on huge pages at 4.2 (BENCHMARKS.md section 14). `None` where the
/// system has no such call or refuses: the caller allocates from the heap instead.
pub fn map_buffer(len: usize) -> Option<std::ptr::NonNull<u8>> {
    #[cfg(unix)]
    {
        let total = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no address is imposed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANON,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base, base + total - (start + len));
        // SAFETY: both ranges lie inside the mapping just made and outside [start, start +
        // len), which is all that is kept; `len` and `head` are page multiples, so is the tail.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        #[cfg(target_os = "linux")]
        // SAFETY: advice on the range we own; failure (THP disabled) only loses the huge pages.
        unsafe {
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        std::ptr::NonNull::new(start as *mut u8)
    }
    #[cfg(not(unix))]
    {
        let _ = len;
        None
    }
}

/// Return a buffer from [`map_buffer`] to the system.
///
/// # Safety
/// `ptr` and `len` must be exactly what `map_buffer` gave and returned, and nothing may use the
/// range afterwards.
pub unsafe fn unmap_buffer(ptr: *mut u8, len: usize) {
    #[cfg(unix)]
    // SAFETY: the caller's contract: the range is a mapping of ours that nothing uses any more.
    unsafe {
        libc::munmap(ptr.cast(), len);
    }
    #[cfg(not(unix))]
    let _ = (ptr, len);
}

/// The whole pages inside `[ptr, ptr + len)`: (start, length), length 0 when there are none.
fn whole_pages(ptr: *mut u8, len: usize, page: usize) -> (*mut u8, usize) {
    let start = (ptr as usize).next_multiple_of(page);
    let end = (ptr as usize).saturating_add(len) / page * page;
    if end <= start { (ptr, 0) } else { (ptr.wrapping_add(start - ptr as usize), end - start) }
}

/// Drop the physical pages inside `[ptr, ptr + len)` (whole pages only: a buffer aligned to 4
/// KiB keeps its partial 16 KiB pages on a Mac): the next touch reads zeros, and until then
/// they count nothing towards the resident size. Returns false where the system cannot (the
/// range then keeps its pages and its contents; callers only lose the saving).
///
/// # Safety
/// `[ptr, ptr + len)` must be a range of private anonymous memory (a heap allocation) that
/// this process owns and does not access concurrently; the contents of its whole pages are lost.
pub unsafe fn release_pages(ptr: *mut u8, len: usize) -> bool {
    let (p, n) = whole_pages(ptr, len, page_size());
    if n == 0 {
        // Nothing whole to give back (a buffer smaller than a page, or straddling one): the
        // pages stay, and the caller must not count them as released.
        return len == 0;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the caller owns the range and gives up its contents; MADV_DONTNEED on private
        // anonymous memory maps it back to zero-fill pages on the next touch.
        unsafe { libc::madvise(p.cast(), n, libc::MADV_DONTNEED) == 0 }
    }
    #[cfg(all(unix, not(target_os = "linux")))]
    {
        // macOS's MADV_FREE keeps the contents until the system needs the pages, so a fresh
        // anonymous mapping is put over the range instead: its old pages are freed at once and
        // the new ones read as zeros, at the same addresses.
        // SAFETY: MAP_FIXED replaces exactly the caller's whole pages with fresh private
        // anonymous memory of the same protection; nothing else maps there.
        let q = unsafe {
            libc::mmap(
                p.cast(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANON,
                -1,
                0,
            )
        };
        q == p.cast()
    }
    #[cfg(not(unix))]
    {
        // Windows can reset pages (MEM_RESET) but not promise zeros, and the cache's buffers come
        // from the heap: the pages are kept.
        let _ = (p, n);
        false
    }
}

/// Hand the allocator's free memory back to the system: after a large prompt chunk the
/// allocator keeps freed buffers below its mmap threshold (glibc raises that threshold up to 32
/// MiB as large buffers are freed), which would stay resident while the cache refills. Other
/// allocators return large frees to the system themselves (or cannot be asked).
pub fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only touches the allocator's own free lists; 0 keeps no pad.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Peak resident set size of this process so far, in bytes (Linux VmHWM, macOS's maximum
/// resident size, Windows' peak working set).
pub fn peak_rss_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let t = std::fs::read_to_string("/proc/self/status").ok()?;
        let l = t.lines().find(|l| l.starts_with("VmHWM:"))?;
        l.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
    }
    #[cfg(all(unix, not(target_os = "linux")))]
    {
        // SAFETY: a zeroed rusage is a valid out-parameter.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is valid for writing.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
            return None;
        }
        // Bytes on macOS (kilobytes on the BSDs).
        let max = u64::try_from(u.ru_maxrss).ok()?;
        Some(if cfg!(target_os = "macos") { max } else { max * 1024 })
    }
    #[cfg(windows)]
    {
        use windows_sys::Win32::System::ProcessStatus::{GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS};
        use windows_sys::Win32::System::Threading::GetCurrentProcess;
        // SAFETY: a zeroed counters struct with its size given is what the call expects; the
        // pseudo-handle of the current process needs no closing.
        let mut c: PROCESS_MEMORY_COUNTERS = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<PROCESS_MEMORY_COUNTERS>() as u32;
        // SAFETY: as above.
        let ok = unsafe { GetProcessMemoryInfo(GetCurrentProcess(), &mut c, size) } != 0;
        ok.then_some(c.PeakWorkingSetSize as u64)
    }
    #[cfg(not(any(unix, windows)))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident set size of this process now, in bytes.
    #[cfg(target_os = "linux")]
    fn resident_bytes() -> Option<u64> {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Some(pages * u64::try_from(page).ok()?)
    }

    #[test]
    fn only_whole_pages_are_released() {
        let p = std::ptr::without_provenance_mut::<u8>(4096);
        assert_eq!(whole_pages(p, 64 << 10, 16 << 10), (std::ptr::without_provenance_mut::<u8>(16384), 48 << 10));
        assert_eq!(whole_pages(p, 8192, 16 << 10).1, 0);
        assert_eq!(whole_pages(p, 8192, 4096), (p, 8192));
    }

    #[test]
    #[cfg(not(target_os = "linux"))]
    fn released_pages_leave_the_resident_set_and_read_as_zeros() {
        println!("SKIPPED released pages: the resident size is read from /proc (Linux only)");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn released_pages_leave_the_resident_set_and_read_as_zeros() {
        let len = 64 << 20;
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size; checked for null below.
        let p = unsafe { std::alloc::alloc(layout) };
        assert!(!p.is_null());
        // SAFETY: p is valid for len bytes, owned here.
        let buf = unsafe { std::slice::from_raw_parts_mut(p, len) };
        buf.fill(7);
        let touched = resident_bytes().unwrap();
        // SAFETY: page-aligned range owned here, not accessed during the call.
        assert!(unsafe { release_pages(p, len) });
        let released = resident_bytes().unwrap();
        assert!(touched - released >= (len as u64) * 9 / 10, "{touched} -> {released}");
        assert!(buf.iter().all(|&b| b == 0));
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(p, layout) };
    }
}
