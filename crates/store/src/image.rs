//! Streamed spine layers: a layer's bytes are read in one aligned image, verified against each
//! tensor's checksum as the pieces land, and the model's tensors are views into that image: no
//! copy, no allocation per token. The image's buffer lives as long as any view of it.

use std::sync::Arc;

use crate::checksum::Xxh3;

use crate::error::StoreError;
use crate::manifest::SpineDtype;
use crate::spine::{Elems, ImageBytes, LoadedTensor, SpineData, SpineSource, SpineTable, check_tensor, checksum_error};

/// `len` bytes at `start` of `image` as elements of `T`: a view when the host is little-endian
/// (the file's order) and the bytes are aligned for `T`, else a copy.
fn view_or_copy<T: bytemuck::Pod>(
    image: &Arc<dyn ImageBytes>,
    start: usize,
    len: usize,
    from_le: fn(&[u8]) -> T,
) -> Elems<T> {
    let size = std::mem::size_of::<T>();
    let bytes = &image.bytes()[start..start + len];
    if cfg!(target_endian = "little") && bytemuck::try_cast_slice::<u8, T>(bytes).is_ok() {
        Elems::View { image: image.clone(), start, len: len / size }
    } else {
        Elems::Owned(bytes.chunks_exact(size).map(from_le).collect())
    }
}

/// An in-memory image of a layer's range of the spine file, read by a loader.
pub struct SpineImage<'a> {
    pub table: &'a SpineTable,
    /// Offset in the spine file of the image's first byte.
    pub base: u64,
    /// The image; its first `len` bytes hold the layer's range.
    pub image: &'a Arc<dyn ImageBytes>,
    pub len: usize,
    /// Every tensor of the layer was verified as the image landed ([`ImageVerifier`]); when
    /// false, each tensor is hashed as it is loaded.
    pub verified: bool,
}

impl SpineSource for SpineImage<'_> {
    fn load_spine(&self, name: &str) -> Result<LoadedTensor, StoreError> {
        let path = self.table.path();
        let t = self.table.tensor(name).ok_or_else(|| StoreError::Store {
            path: path.to_path_buf(),
            msg: format!("spine tensor '{name}' is not in the loaded layer image's table"),
        })?;
        let range = |off: u64, len: u64| -> Result<(usize, usize), StoreError> {
            let start = off.checked_sub(self.base).and_then(|s| usize::try_from(s).ok());
            let len = usize::try_from(len).ok();
            match (start, len) {
                (Some(s), Some(l)) if s.checked_add(l).is_some_and(|end| end <= self.len) => Ok((s, l)),
                _ => Err(StoreError::Store {
                    path: path.to_path_buf(),
                    msg: format!("spine tensor '{name}' is outside the loaded layer image"),
                }),
            }
        };
        if self.len > self.image.bytes().len() {
            return Err(StoreError::Store {
                path: path.to_path_buf(),
                msg: format!("the layer image holds {} bytes, not {}", self.image.bytes().len(), self.len),
            });
        }
        let (d0, dn) = range(t.offset, t.len)?;
        let (s0, sn) = if t.scales_len > 0 { range(t.scales_offset, t.scales_len)? } else { (0, 0) };
        let bytes = self.image.bytes();
        check_tensor(t, sn, path)?;
        if !self.verified {
            let mut h = Xxh3::new();
            h.update(&bytes[d0..d0 + dn]);
            h.update(&bytes[s0..s0 + sn]);
            if h.digest() != t.xxh3 {
                return Err(checksum_error(t, path));
            }
        }
        let f32_le = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let data = match t.dtype {
            SpineDtype::F32 => SpineData::F32(view_or_copy(self.image, d0, dn, f32_le)),
            SpineDtype::Bf16 => SpineData::Bf16(view_or_copy(self.image, d0, dn, |b| u16::from_le_bytes([b[0], b[1]]))),
            SpineDtype::Int8 => SpineData::Int8 {
                q: view_or_copy(self.image, d0, dn, |b| b[0] as i8),
                scales: view_or_copy(self.image, s0, sn, f32_le),
                group: t.group,
            },
        };
        Ok(LoadedTensor { name: t.name.clone(), shape: t.shape.clone(), data })
    }
}

/// One stretch of the file that a tensor's checksum covers: its data, then its scales.
struct Segment {
    start: u64,
    end: u64,
    tensor: usize,
}

/// Verifies a layer image's tensors while it is being read: each time a longer prefix of the
/// image has landed, the new bytes are fed to their tensors' hashers in file order, so when the
/// last piece lands only that piece is left to hash, and the next read need not wait for a
/// whole layer's hashing. A tensor whose scales lie before its data (no writer of ours does
/// that) is hashed whole at the end.
#[derive(Default)]
pub struct ImageVerifier {
    base: u64,
    layer: usize,
    segments: Vec<Segment>,
    /// The segment being hashed, and how far into the image the hashing has come.
    next: usize,
    hashed_to: u64,
    /// Each tensor's stretches and digest, in the table's order of the layer's tensors.
    checks: Vec<Check>,
    hashers: Vec<Xxh3>,
    /// Tensors to hash whole when everything has landed.
    at_end: Vec<usize>,
    /// Bytes hashed, and the time spent hashing (the verification cost reported per token).
    pub bytes_hashed: u64,
    pub hash_time: std::time::Duration,
}

/// What the verifier needs of a tensor's table entry (copied, so a reset allocates nothing).
#[derive(Clone, Copy)]
struct Check {
    offset: u64,
    len: u64,
    scales_offset: u64,
    scales_len: u64,
    xxh3: u64,
}

impl ImageVerifier {
    /// For `layer`'s tensors in an image starting at file offset `base`.
    pub fn new(table: &SpineTable, layer: usize, base: u64) -> Self {
        let mut v = Self::default();
        v.reset(table, layer, base);
        v
    }

    /// Start over for `layer`'s image at `base`, keeping every buffer: the spine loader reuses
    /// one verifier for every layer it streams, and allocates nothing per token.
    pub fn reset(&mut self, table: &SpineTable, layer: usize, base: u64) {
        self.checks.clear();
        self.checks.extend(table.layer_tensors(layer).map(|t| Check {
            offset: t.offset,
            len: t.len,
            scales_offset: t.scales_offset,
            scales_len: t.scales_len,
            xxh3: t.xxh3,
        }));
        self.segments.clear();
        self.at_end.clear();
        for (i, t) in self.checks.iter().enumerate() {
            if t.scales_len > 0 && t.scales_offset < t.offset + t.len {
                self.at_end.push(i);
                continue;
            }
            self.segments.push(Segment { start: t.offset, end: t.offset + t.len, tensor: i });
            if t.scales_len > 0 {
                self.segments.push(Segment { start: t.scales_offset, end: t.scales_offset + t.scales_len, tensor: i });
            }
        }
        self.segments.sort_unstable_by_key(|s| s.start);
        // Hashers are only ever added (each holds an allocated secret): a layer with fewer
        // tensors than an earlier one uses the first of them.
        let n = self.checks.len();
        self.hashers.iter_mut().take(n).for_each(Xxh3::reset);
        if self.hashers.len() < n {
            self.hashers.resize_with(n, Xxh3::new);
        }
        (self.base, self.layer, self.next, self.hashed_to) = (base, layer, 0, base);
        self.bytes_hashed = 0;
        self.hash_time = std::time::Duration::ZERO;
    }

    /// The image's bytes up to file offset `landed` are in `image` (which starts at `base`):
    /// hash what has not been hashed yet.
    pub fn advance(&mut self, image: &[u8], landed: u64) {
        let t0 = std::time::Instant::now();
        while let Some(s) = self.segments.get(self.next) {
            let from = self.hashed_to.max(s.start);
            let to = s.end.min(landed);
            if from < to {
                let (a, b) = ((from - self.base) as usize, (to - self.base) as usize);
                if let Some(bytes) = image.get(a..b) {
                    self.hashers[s.tensor].update(bytes);
                    self.bytes_hashed += (b - a) as u64;
                }
                self.hashed_to = to;
            }
            if landed >= s.end {
                self.next += 1;
            } else {
                break;
            }
        }
        self.hash_time += t0.elapsed();
    }

    /// Everything has landed: check every tensor's digest (`table` is the one the verifier was
    /// reset for; it names a tensor that fails).
    pub fn finish(&mut self, table: &SpineTable, image: &[u8]) -> Result<(), StoreError> {
        let end = self.segments.iter().map(|s| s.end).max().unwrap_or(self.base);
        self.advance(image, end);
        let t0 = std::time::Instant::now();
        for &i in &self.at_end {
            let t = self.checks[i];
            let slice = |off: u64, len: u64| {
                off.checked_sub(self.base).and_then(|a| image.get(a as usize..(a + len) as usize)).unwrap_or(&[])
            };
            self.hashers[i].update(slice(t.offset, t.len));
            self.hashers[i].update(slice(t.scales_offset, t.scales_len));
            self.bytes_hashed += t.len + t.scales_len;
        }
        self.hash_time += t0.elapsed();
        if self.next < self.segments.len() {
            return Err(StoreError::Store {
                path: table.path().to_path_buf(),
                msg: "spine layer image is incomplete".into(),
            });
        }
        for (i, (t, h)) in self.checks.iter().zip(&self.hashers).enumerate() {
            if h.digest() != t.xxh3 {
                return Err(match table.layer_tensors(self.layer).nth(i) {
                    Some(t) => checksum_error(t, table.path()),
                    None => StoreError::Store {
                        path: table.path().to_path_buf(),
                        msg: format!("a spine tensor of layer {} fails its checksum", self.layer),
                    },
                });
            }
        }
        Ok(())
    }
}
