//! Giving memory back to the operating system while keeping the address range: a prompt that
//! borrows the expert cache's memory must really shrink the process (the budget is a resident
//! size), not just stop using the pages.

/// Drop the physical pages behind `[ptr, ptr + len)`: the next touch reads zeros, and until then
/// the range counts nothing towards the resident size. Returns false where the system cannot
/// (the range then keeps its pages; callers only lose the saving).
///
/// # Safety
/// `ptr` must be page-aligned and `[ptr, ptr + len)` a range this process owns and does not
/// access concurrently; its contents are lost.
#[cfg(target_os = "linux")]
pub unsafe fn release_pages(ptr: *mut u8, len: usize) -> bool {
    // SAFETY: the caller owns the page-aligned range and gives up its contents; MADV_DONTNEED
    // on private anonymous memory maps it back to zero-fill pages on the next touch.
    unsafe { libc::madvise(ptr.cast(), len, libc::MADV_DONTNEED) == 0 }
}

/// See the Linux version: elsewhere the pages are kept (a saving lost, nothing else).
///
/// # Safety
/// As on Linux.
#[cfg(not(target_os = "linux"))]
pub unsafe fn release_pages(_ptr: *mut u8, _len: usize) -> bool {
    false
}

/// Hand the allocator's free memory back to the system: after a large prompt chunk the
/// allocator keeps freed buffers below its mmap threshold (glibc raises that threshold up to 32
/// MiB as large buffers are freed), which would stay resident while the cache refills.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn return_free_heap() {
    // SAFETY: malloc_trim only touches the allocator's own free lists; 0 keeps no pad.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other allocators return large frees to the system themselves (or cannot be asked).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn return_free_heap() {}

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
