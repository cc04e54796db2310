//! Record geometry, in one place: where a routed expert's bytes sit on disk, the aligned window
//! each of its ranges is read through (O_DIRECT reads whole 4096-byte blocks), how large a
//! buffer must be to hold a record's windows back to back, and how the canonical record is
//! assembled from them once they have arrived.

use deltafin_store::manifest::ExpertLocation;

use super::aligned::{DIRECT_ALIGN, align_down, align_up};

/// One range of a record (`[file, offset, len]` in the manifest) as it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub file: usize,
    /// Aligned start of the read.
    pub offset: u64,
    /// Aligned length of the read.
    pub len: usize,
    /// Bytes that must arrive (the window may run past the end of the file).
    pub need: usize,
    /// Where the range starts inside the window.
    pub skip: usize,
    /// The range's own length.
    pub range_len: usize,
}

impl Window {
    pub fn of(range: &[u64; 3]) -> Window {
        let (file, off, len) = (range[0] as usize, range[1], range[2]);
        let start = align_down(off);
        let end = align_up(off + len);
        Window {
            file,
            offset: start,
            len: (end - start) as usize,
            need: (off + len - start) as usize,
            skip: (off - start) as usize,
            range_len: len as usize,
        }
    }
}

/// The windows of a record's ranges, in record order.
pub fn windows(loc: &ExpertLocation) -> impl Iterator<Item = Window> + '_ {
    loc.ranges.iter().map(Window::of)
}

/// Bytes of buffer one record needs: its windows back to back.
pub fn buffer_bytes(loc: &ExpertLocation) -> usize {
    windows(loc).map(|w| w.len).sum()
}

/// The buffer size that holds any of these records (one aligned block when there are none).
pub fn slot_bytes<'a>(locs: impl IntoIterator<Item = &'a ExpertLocation>) -> usize {
    locs.into_iter().map(buffer_bytes).max().unwrap_or(DIRECT_ALIGN)
}

/// Turn a buffer holding `loc`'s windows back to back into the canonical record; returns where
/// the record starts in the buffer. One range is used where it landed; several are compacted
/// leftwards into record order (each destination precedes its source, so copies never clobber).
pub fn assemble(loc: &ExpertLocation, buf: &mut [u8]) -> usize {
    if loc.ranges.len() == 1 {
        return Window::of(&loc.ranges[0]).skip;
    }
    let (mut src, mut dst) = (0usize, 0usize);
    for w in windows(loc) {
        buf.copy_within(src + w.skip..src + w.skip + w.range_len, dst);
        src += w.len;
        dst += w.range_len;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_their_ranges_and_records_assemble_in_order() {
        // Two ranges of one record, neither aligned, in two files.
        let loc = ExpertLocation { ranges: vec![[0, 5000, 3000], [1, 100, 9000]], xxh3: 0 };
        let w: Vec<Window> = windows(&loc).collect();
        assert_eq!(w[0], Window { file: 0, offset: 4096, len: 4096, need: 3904, skip: 904, range_len: 3000 });
        assert_eq!(w[1], Window { file: 1, offset: 0, len: 12288, need: 9100, skip: 100, range_len: 9000 });
        assert_eq!(buffer_bytes(&loc), 16384);
        assert_eq!(slot_bytes([&loc]), 16384);
        assert_eq!(slot_bytes([]), DIRECT_ALIGN);
        // Fill the windows as a read would, with each byte its file offset's low bits tagged by file.
        let mut buf = vec![0u8; buffer_bytes(&loc)];
        let mut pos = 0;
        let mut want = Vec::new();
        for w in &w {
            for i in 0..w.len {
                buf[pos + i] = ((w.offset as usize + i) as u8) ^ (w.file as u8 * 0x55);
            }
            want.extend_from_slice(&buf[pos + w.skip..pos + w.skip + w.range_len]);
            pos += w.len;
        }
        let start = assemble(&loc, &mut buf);
        assert_eq!(start, 0);
        assert_eq!(&buf[..want.len()], &want[..]);
        // One range is used in place.
        let one = ExpertLocation { ranges: vec![[0, 8200, 100]], xxh3: 0 };
        assert_eq!(assemble(&one, &mut [0u8; 4096]), 8);
    }
}
