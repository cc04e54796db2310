//! Byte-range arithmetic for the range scheduler: sets of half-open ranges `[start, end)`,
//! their union, what a file still lacks, and the pieces a download is cut into.

/// A half-open byte range `[start, end)`.
pub type Range = (u64, u64);

/// Sort and merge overlapping or touching ranges; empty ones are dropped.
pub fn normalize(mut v: Vec<Range>) -> Vec<Range> {
    v.retain(|r| r.1 > r.0);
    v.sort_unstable();
    let mut out: Vec<Range> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.0 <= last.1 => last.1 = last.1.max(r.1),
            _ => out.push(r),
        }
    }
    out
}

/// The parts of `[0, size)` not covered by `have` (normalized).
pub fn missing(size: u64, have: &[Range]) -> Vec<Range> {
    let mut out = Vec::new();
    let mut pos = 0u64;
    for &(s, e) in have {
        if s > pos {
            out.push((pos, s.min(size)));
        }
        pos = pos.max(e);
        if pos >= size {
            break;
        }
    }
    if pos < size {
        out.push((pos, size));
    }
    out.retain(|r| r.1 > r.0);
    out
}

/// The parts of `r` not covered by `have` (normalized).
pub fn missing_in(r: Range, have: &[Range]) -> Vec<Range> {
    missing(r.1, have).into_iter().filter(|g| g.1 > r.0).map(|g| (g.0.max(r.0), g.1)).collect()
}

/// Whether `have` (normalized) covers all of `r`.
pub fn covers(have: &[Range], r: Range) -> bool {
    // The covering range is the last one starting at or before r.0.
    let i = have.partition_point(|h| h.0 <= r.0);
    i > 0 && have[i - 1].1 >= r.1
}

/// Cut ranges into pieces of at most `piece` bytes.
pub fn pieces(ranges: &[Range], piece: u64) -> Vec<Range> {
    let piece = piece.max(1);
    let mut out = Vec::new();
    for &(s, e) in ranges {
        let mut p = s;
        while p < e {
            let q = (p + piece).min(e);
            out.push((p, q));
            p = q;
        }
    }
    out
}

/// Merge ranges whose gap is at most `gap` bytes (fewer requests for a few extra bytes).
pub fn coalesce(v: Vec<Range>, gap: u64) -> Vec<Range> {
    let mut out: Vec<Range> = Vec::new();
    for r in normalize(v) {
        match out.last_mut() {
            Some(last) if r.0 <= last.1 + gap => last.1 = last.1.max(r.1),
            _ => out.push(r),
        }
    }
    out
}

/// Total bytes of a range list.
pub fn total(v: &[Range]) -> u64 {
    v.iter().map(|r| r.1 - r.0).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        assert_eq!(normalize(vec![(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]), vec![(0, 3), (5, 9)]);
        assert_eq!(missing(10, &[(0, 3), (5, 9)]), vec![(3, 5), (9, 10)]);
        assert_eq!(missing(10, &[]), vec![(0, 10)]);
        assert_eq!(missing(10, &[(0, 12)]), vec![]);
        assert_eq!(missing_in((2, 8), &[(0, 3), (5, 6)]), vec![(3, 5), (6, 8)]);
        assert!(covers(&[(0, 3), (5, 9)], (5, 9)));
        assert!(!covers(&[(0, 3), (5, 9)], (2, 6)));
        assert_eq!(pieces(&[(0, 10)], 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(coalesce(vec![(0, 2), (4, 6), (100, 101)], 2), vec![(0, 6), (100, 101)]);
    }

    proptest! {
        /// Byte by byte: a byte is missing exactly when no range covers it, and pieces tile the
        /// ranges they were cut from.
        #[test]
        fn missing_is_the_complement(raw in proptest::collection::vec((0u64..200, 0u64..40), 0..12), size in 0u64..220) {
            let have = normalize(raw.iter().map(|&(s, l)| (s, s + l)).collect());
            let gaps = missing(size, &have);
            for b in 0..size {
                let in_have = have.iter().any(|r| r.0 <= b && b < r.1);
                let in_gap = gaps.iter().any(|r| r.0 <= b && b < r.1);
                prop_assert!(in_have != in_gap, "byte {b}");
            }
            prop_assert_eq!(total(&pieces(&gaps, 7)), total(&gaps));
            for r in &gaps { prop_assert!(!covers(&have, (r.0, r.0 + 1))); }
        }
    }
}
