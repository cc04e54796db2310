//! `Range` and `If-Range` as the Hub and its CDN honour them: one byte range per request.
//!
//! Anything this parser does not understand (several ranges, another unit, a malformed spec)
//! is ignored and the whole file is sent, which RFC 9110 allows; a downloader must cope with a
//! 200 to a ranged request anyway.

/// What a GET (or HEAD) of a `total`-byte file answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RangeAnswer {
    /// 200 with the whole file.
    Whole,
    /// 206 with bytes `start..=end`.
    Partial { start: u64, end: u64 },
    /// 416 with `Content-Range: bytes */total`.
    Unsatisfiable,
}

/// The answer to a `Range` header (if any) for a file of `total` bytes.
pub(crate) fn answer(range: Option<&str>, total: u64) -> RangeAnswer {
    let Some(spec) = range.and_then(|r| r.trim().strip_prefix("bytes=")) else { return RangeAnswer::Whole };
    if spec.contains(',') {
        return RangeAnswer::Whole;
    }
    let Some((first, last)) = spec.split_once('-') else { return RangeAnswer::Whole };
    let (first, last) = (first.trim(), last.trim());
    if first.is_empty() {
        // Suffix range `bytes=-n`: the last n bytes.
        let Some(n) = number(last) else { return RangeAnswer::Whole };
        if n == 0 || total == 0 {
            return RangeAnswer::Unsatisfiable;
        }
        return RangeAnswer::Partial { start: total.saturating_sub(n), end: total - 1 };
    }
    let Some(start) = number(first) else { return RangeAnswer::Whole };
    let end = if last.is_empty() {
        u64::MAX
    } else {
        match number(last) {
            Some(end) if end >= start => end,
            _ => return RangeAnswer::Whole,
        }
    };
    if start >= total {
        return RangeAnswer::Unsatisfiable;
    }
    RangeAnswer::Partial { start, end: end.min(total - 1) }
}

/// Whether `If-Range` lets a Range apply: absent, or equal to the current strong ETag. A date
/// or a weak tag never matches, so the client gets the whole (possibly changed) file.
pub(crate) fn if_range_allows(if_range: Option<&str>, etag: &str) -> bool {
    if_range.is_none_or(|v| v.trim() == etag)
}

/// Plain decimal digits only: `u64::from_str` would also take a leading `+`.
fn number(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::RangeAnswer::*;
    use super::*;

    #[test]
    fn single_ranges() {
        assert_eq!(answer(None, 100), Whole);
        assert_eq!(answer(Some("bytes=0-9"), 100), Partial { start: 0, end: 9 });
        assert_eq!(answer(Some("bytes=90-"), 100), Partial { start: 90, end: 99 });
        assert_eq!(answer(Some("bytes=90-500"), 100), Partial { start: 90, end: 99 });
        assert_eq!(answer(Some("bytes=-10"), 100), Partial { start: 90, end: 99 });
        assert_eq!(answer(Some("bytes=-500"), 100), Partial { start: 0, end: 99 });
    }

    #[test]
    fn unsatisfiable_and_ignored() {
        assert_eq!(answer(Some("bytes=100-"), 100), Unsatisfiable);
        assert_eq!(answer(Some("bytes=-0"), 100), Unsatisfiable);
        assert_eq!(answer(Some("bytes=0-"), 0), Unsatisfiable);
        assert_eq!(answer(Some("bytes=5-2"), 100), Whole);
        assert_eq!(answer(Some("bytes=0-1,5-6"), 100), Whole);
        assert_eq!(answer(Some("items=0-1"), 100), Whole);
        assert_eq!(answer(Some("bytes=+1-2"), 100), Whole);
        assert_eq!(answer(Some("bytes=x"), 100), Whole);
    }

    #[test]
    fn if_range() {
        assert!(if_range_allows(None, "\"a\""));
        assert!(if_range_allows(Some("\"a\""), "\"a\""));
        assert!(!if_range_allows(Some("\"b\""), "\"a\""));
        assert!(!if_range_allows(Some("W/\"a\""), "\"a\""));
    }
}
