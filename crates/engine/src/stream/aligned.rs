//! Page-aligned, heap-allocated byte buffers for O_DIRECT reads.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Alignment of O_DIRECT buffers, offsets and lengths. 4096 also satisfies 512-byte devices.
pub const DIRECT_ALIGN: usize = 4096;

/// Buffers from this size up are mapped from the system on their own (huge pages where there
/// are any: `os::memory::map_buffer`); smaller ones come from the heap.
const MAPPED_FROM: usize = 2 << 20;

pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// From `map_buffer` (returned with `unmap_buffer`), not from the heap.
    mapped: bool,
}

// SAFETY: the buffer is plain owned memory; ownership rules are enforced by the pool that hands
// out `&`/`&mut` to it (a buffer lent to an in-flight read is not touched until it completes).
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads of initialised bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to the alignment.
    pub fn new(len: usize) -> Self {
        let len = len.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
        if len >= MAPPED_FROM
            && let Some(ptr) = crate::os::memory::map_buffer(len)
        {
            // Fault every page in now, as the heap path's zeroing does: a first touch inside a
            // step (a huge page zeroed, memory compacted for it) would cost that step.
            for off in (0..len).step_by(DIRECT_ALIGN) {
                // SAFETY: `off < len`, inside the mapping just made, which nothing else uses.
                unsafe { ptr.as_ptr().add(off).write_volatile(0) };
            }
            return AlignedBuf { ptr, len, mapped: true };
        }
        let layout = Layout::from_size_align(len, DIRECT_ALIGN).expect("aligned layout");
        // SAFETY: the layout has non-zero size; a null result is handled below.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len, mapped: false }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed at allocation) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Give the buffer's physical pages back to the system (contents become zeros on the next
    /// touch): a buffer lent out of the expert cache stops counting towards the resident size.
    pub fn release_pages(&mut self) -> bool {
        // SAFETY: the buffer is page-aligned (DIRECT_ALIGN is a multiple of the page size on
        // the systems whose release does anything), owned by `self`, and `&mut self` means no
        // read or reference into it is live.
        unsafe { crate::os::memory::release_pages(self.ptr.as_ptr(), self.len) }
    }

    /// Raw pointer for handing to the kernel or an I/O thread.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `new` with exactly this length; the buffer is gone after this.
            unsafe { crate::os::memory::unmap_buffer(self.ptr.as_ptr(), self.len) };
            return;
        }
        let layout = Layout::from_size_align(self.len, DIRECT_ALIGN).expect("aligned layout");
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

pub fn align_down(v: u64) -> u64 {
    v / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64
}

pub fn align_up(v: u64) -> u64 {
    v.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large buffer is mapped on its own where the system allows (2 MiB-aligned, so that huge
    /// pages can back it), a small one comes from the heap; both start as zeros, hold what is
    /// written, and give their pages back as zeros.
    #[test]
    fn large_buffers_are_mapped_apart_and_behave_like_small_ones() {
        for (len, mapped) in [(4096usize, false), (MAPPED_FROM + 3 * DIRECT_ALIGN, cfg!(unix))] {
            let mut b = AlignedBuf::new(len);
            assert_eq!((b.len(), b.mapped), (len, mapped), "{len}");
            let align = if mapped { 2 << 20 } else { DIRECT_ALIGN };
            assert_eq!(b.as_mut_ptr() as usize % align, 0, "{len}");
            assert!(b.as_slice().iter().all(|&x| x == 0), "{len}");
            b.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = (i % 251) as u8);
            assert!(b.as_slice().iter().enumerate().all(|(i, &x)| x == (i % 251) as u8), "{len}");
            if b.release_pages() {
                assert!(b.as_slice().iter().all(|&x| x == 0), "{len}: released pages read as zeros");
            }
        }
    }
}
