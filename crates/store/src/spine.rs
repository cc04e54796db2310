//! Spine tensors as the runtime holds them, whatever their source: the element types (owned, or
//! views into a streamed layer's image), the table of where each tensor sits in the spine file,
//! and the checks every source applies. `store.rs` (the file) and `image.rs` (a streamed layer)
//! build on this.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::bf16;

use crate::error::StoreError;
use crate::manifest::{SpineDtype, SpineTensor};

/// Bytes that decoded spine tensors may view in place: a streamed layer's image (an aligned
/// read buffer owned by the loader's pool).
pub trait ImageBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
}

/// A spine tensor's elements: owned (decoded from the spine file), or viewed in place in a
/// shared layer image.
#[derive(Clone)]
pub enum Elems<T> {
    Owned(Vec<T>),
    /// `len` elements at byte `start` of the image. Built only by [`view_or_copy`], which checks
    /// that the range is inside the image and aligned for `T`.
    View {
        image: Arc<dyn ImageBytes>,
        start: usize,
        len: usize,
    },
}

impl<T: bytemuck::Pod> std::ops::Deref for Elems<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Elems::Owned(v) => v,
            // In bounds and aligned: checked when the view was made, and the image never moves.
            Elems::View { image, start, len } => {
                bytemuck::cast_slice(&image.bytes()[*start..*start + *len * std::mem::size_of::<T>()])
            }
        }
    }
}

impl<T> From<Vec<T>> for Elems<T> {
    fn from(v: Vec<T>) -> Self {
        Elems::Owned(v)
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for Elems<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if matches!(self, Elems::Owned(_)) { "owned" } else { "view" };
        write!(f, "Elems({kind}, {} elements)", self.len())
    }
}

impl<T: bytemuck::Pod> Elems<T> {
    /// Whether the elements are a view into a shared image (no copy was made).
    pub fn is_view(&self) -> bool {
        matches!(self, Elems::View { .. })
    }

    /// A view now looks at the same bytes of `image` instead: an image of the same layer, read
    /// again, whose bytes passed the same checksums (or [`empty_image`], to let the old image
    /// go while the view is not used). Owned elements stay as they are. Allocates nothing.
    pub fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        if let Elems::View { image, .. } = self {
            *image = to.clone();
        }
    }
}

/// The image a decoded layer's views point at while the layer is kept between reads (its
/// weights unused): holds no bytes, so reading through such a view panics rather than read
/// another layer's bytes. One per process; a clone allocates nothing.
pub fn empty_image() -> Arc<dyn ImageBytes> {
    struct Empty;
    impl ImageBytes for Empty {
        fn bytes(&self) -> &[u8] {
            &[]
        }
    }
    static EMPTY: std::sync::OnceLock<Arc<dyn ImageBytes>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| Arc::new(Empty)).clone()
}

/// One spine tensor in memory, in the dtype the store keeps it: owned, or (a streamed layer)
/// views into the layer's image.
#[derive(Debug, Clone)]
pub enum SpineData {
    F32(Elems<f32>),
    /// Raw bf16 bits.
    Bf16(Elems<u16>),
    /// int8 values `[rows, cols]` and f32 scales `[rows, cols/group]`.
    Int8 {
        q: Elems<i8>,
        scales: Elems<f32>,
        group: usize,
    },
}

impl SpineData {
    /// Every view of this tensor now looks at `to` ([`Elems::rebind`]).
    pub fn rebind(&mut self, to: &Arc<dyn ImageBytes>) {
        match self {
            SpineData::F32(w) => w.rebind(to),
            SpineData::Bf16(w) => w.rebind(to),
            SpineData::Int8 { q, scales, .. } => {
                q.rebind(to);
                scales.rebind(to);
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct LoadedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: SpineData,
}

impl LoadedTensor {
    /// The tensor as f32 (dequantising if needed). Used for vectors and for the embedding row.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            SpineData::F32(v) => v.to_vec(),
            SpineData::Bf16(v) => v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
            SpineData::Int8 { q, scales, group } => crate::quant::dequantize_int8(q, scales, *group),
        }
    }
}

/// Where spine tensors come from: the store's file, or an in-memory image of part of it.
pub trait SpineSource {
    fn load_spine(&self, name: &str) -> Result<LoadedTensor, StoreError>;
}

/// The 4096-aligned byte range of the spine file holding `layer`'s tensors.
pub(crate) fn layer_range<'a>(tensors: impl Iterator<Item = &'a SpineTensor>, layer: usize) -> Option<(u64, u64)> {
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for t in tensors.filter(|t| t.layer == Some(layer)) {
        lo = lo.min(t.offset);
        hi = hi.max(t.offset + t.len);
        if t.scales_len > 0 {
            lo = lo.min(t.scales_offset);
            hi = hi.max(t.scales_offset + t.scales_len);
        }
    }
    (hi > 0).then(|| (lo / 4096 * 4096, hi.div_ceil(4096) * 4096))
}

/// Some layers' spine tensor table: where each tensor sits in the spine file.
#[derive(Debug, Clone)]
pub struct SpineTable {
    pub(crate) path: PathBuf,
    pub(crate) tensors: HashMap<String, SpineTensor>,
}

impl SpineTable {
    /// The spine file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The byte range of the spine file holding layer `layer`'s tensors (4096-aligned).
    pub fn layer_range(&self, layer: usize) -> Option<(u64, u64)> {
        layer_range(self.tensors.values(), layer)
    }

    pub fn tensor(&self, name: &str) -> Option<&SpineTensor> {
        self.tensors.get(name)
    }

    /// Layer `layer`'s tensors.
    pub fn layer_tensors(&self, layer: usize) -> impl Iterator<Item = &SpineTensor> {
        self.tensors.values().filter(move |t| t.layer == Some(layer))
    }
}

/// A tensor's table entry checked against its shape before anything is read or allocated:
/// the element count does not overflow, the length matches shape and dtype, and an int8
/// tensor's group and scales (`scales_len` bytes) match. Returns (elements, bytes).
pub(crate) fn check_tensor(
    t: &SpineTensor,
    scales_len: usize,
    spine_path: &Path,
) -> Result<(usize, usize), StoreError> {
    let name = &t.name;
    let bad =
        |msg: &str| StoreError::Store { path: spine_path.to_path_buf(), msg: format!("spine tensor '{name}': {msg}") };
    let numel = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("shape overflows"))?;
    let esize = t.dtype.element_bytes();
    let len = usize::try_from(t.len).map_err(|_| bad("length does not match shape"))?;
    if numel.checked_mul(esize) != Some(len) {
        return Err(bad("length does not match shape"));
    }
    if t.dtype == SpineDtype::Int8 {
        let cols = *t.shape.last().unwrap_or(&0);
        if t.group == 0 || !cols.is_multiple_of(t.group) || Some(scales_len) != (numel / t.group).checked_mul(4) {
            return Err(bad("int8 length, group or scales do not match shape"));
        }
    }
    Ok((numel, len))
}

pub(crate) fn checksum_error(t: &SpineTensor, path: &std::path::Path) -> StoreError {
    StoreError::Store {
        path: path.to_path_buf(),
        msg: format!("spine tensor '{}' fails its checksum: the spine file is corrupt", t.name),
    }
}
