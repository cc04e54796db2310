//! Opening a Deltafin store: the manifest, the spine tensors, and routed experts by
//! (layer, expert).

use crate::os::FileAt;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checksum::{Xxh3, xxh3_64};

use crate::error::{StoreError, io_err};
use crate::manifest::*;
use crate::presence::Presence;
use crate::shard::Shard;
use crate::spine::{LoadedTensor, SpineData, SpineSource, SpineTable, check_tensor, checksum_error, layer_range};

pub struct Store {
    pub dir: PathBuf,
    pub manifest: Manifest,
    spine_file: File,
    spine_index: HashMap<String, usize>,
    pub experts: ExpertFiles,
}

/// The files routed experts are read from, and where each (layer, expert) lives.
pub struct ExpertFiles {
    files: Vec<File>,
    paths: Vec<PathBuf>,
    /// layer -> locations, indexed by expert id.
    layers: HashMap<usize, Vec<ExpertLocation>>,
    pub record_bytes: u64,
    /// A streaming store's presence map: which records are on disk, and their checksums.
    presence: Option<Arc<Presence>>,
}

impl ExpertFiles {
    /// Read the canonical record of (layer, expert) into `buf` (resized to the record length) and
    /// verify its checksum. Corrupt bytes are reported, never returned.
    pub fn read(&self, layer: usize, expert: usize, buf: &mut Vec<u8>) -> Result<(), StoreError> {
        let expected = self.checksum(layer, expert)?;
        self.read_raw(layer, expert, buf)?;
        let actual = xxh3_64(buf);
        if actual != expected {
            return Err(StoreError::Checksum { layer, expert, expected, actual });
        }
        Ok(())
    }

    /// Read the canonical record of (layer, expert) into `buf` without checking it (to compute
    /// a checksum the store does not have yet).
    pub fn read_raw(&self, layer: usize, expert: usize, buf: &mut Vec<u8>) -> Result<(), StoreError> {
        let loc = self.layers.get(&layer).and_then(|v| v.get(expert)).ok_or_else(|| StoreError::Store {
            path: PathBuf::new(),
            msg: format!("no routed expert {expert} in layer {layer}"),
        })?;
        buf.resize(self.record_bytes as usize, 0);
        let mut pos = 0usize;
        for r in &loc.ranges {
            let (fi, off, len) = (r[0] as usize, r[1], r[2] as usize);
            let end = pos + len;
            if end > buf.len() || fi >= self.files.len() {
                return Err(StoreError::Store {
                    path: PathBuf::new(),
                    msg: format!("manifest ranges of layer {layer} expert {expert} are inconsistent"),
                });
            }
            self.files[fi].read_exact_at(&mut buf[pos..end], off).map_err(io_err(&self.paths[fi]))?;
            pos = end;
        }
        if pos != buf.len() {
            return Err(StoreError::Store {
                path: PathBuf::new(),
                msg: format!("manifest ranges of layer {layer} expert {expert} cover {pos} of {} bytes", buf.len()),
            });
        }
        Ok(())
    }

    /// The checksum a record's bytes must have. In a streaming store a record not fetched yet
    /// has none: it is [`StoreError::Absent`] (asked of the file, not only of this process's
    /// view, so a record another process fetched counts).
    pub fn checksum(&self, layer: usize, expert: usize) -> Result<u64, StoreError> {
        match &self.presence {
            None => self.location(layer, expert).map(|l| l.xxh3).ok_or_else(|| StoreError::Store {
                path: PathBuf::new(),
                msg: format!("no routed expert {expert} in layer {layer}"),
            }),
            Some(p) => match p.get(layer, expert) {
                Some(v) => Ok(v),
                None => p.refresh(layer, expert)?.ok_or(StoreError::Absent { layer, expert }),
            },
        }
    }

    /// The presence map, when this is a streaming store.
    pub fn presence(&self) -> Option<&Arc<Presence>> {
        self.presence.as_ref()
    }

    /// The files expert ranges point into, by the index the ranges use.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    pub fn location(&self, layer: usize, expert: usize) -> Option<&ExpertLocation> {
        self.layers.get(&layer)?.get(expert)
    }
}

impl Store {
    /// Open a store. `source_override` replaces the recorded checkpoint directory (for a
    /// checkpoint that has moved); the shards found there must still match what was converted.
    pub fn open(dir: &Path, source_override: Option<&Path>) -> Result<Self, StoreError> {
        let manifest = Manifest::load(dir)?;
        let spine_path = dir.join(&manifest.spine.file);
        let spine_file = File::open(&spine_path).map_err(io_err(&spine_path))?;
        let spine_len = spine_file.metadata().map_err(io_err(&spine_path))?.len();
        for t in &manifest.spine.tensors {
            let data_end = t.offset.checked_add(t.len);
            let scales_end = t.scales_offset.checked_add(t.scales_len);
            if !matches!((data_end, scales_end), (Some(d), Some(s)) if d <= spine_len && s <= spine_len) {
                return Err(StoreError::Store {
                    path: spine_path.clone(),
                    msg: format!("tensor '{}' lies beyond the end of the spine file ({spine_len} bytes)", t.name),
                });
            }
        }
        let spine_index = manifest.spine.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();

        let ex = &manifest.experts;
        let base: PathBuf = match ex.layout {
            ExpertLayout::Pack => dir.to_path_buf(),
            ExpertLayout::InPlace => {
                source_override.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from(&manifest.source.dir))
            }
        };
        if ex.layout == ExpertLayout::InPlace && !base.is_dir() {
            return Err(StoreError::SourceChanged {
                path: base.clone(),
                msg: "(the checkpoint directory whose shards hold the routed experts) is gone; \
                      if it moved, pass its new location with --source"
                    .into(),
            });
        }
        let mut files = Vec::with_capacity(ex.files.len());
        let mut paths = Vec::with_capacity(ex.files.len());
        for name in &ex.files {
            let p = base.join(name);
            if ex.layout == ExpertLayout::InPlace {
                verify_source_shard(&p, manifest.source.shards.iter().find(|s| &s.file == name))?;
            }
            files.push(File::open(&p).map_err(io_err(&p))?);
            paths.push(p);
        }
        check_ranges_in_files(ex, &files, &paths, &dir.join(MANIFEST_FILE))?;
        let layers = ex.layers.iter().map(|l| (l.layer, l.experts.clone())).collect();
        let presence = match &manifest.streaming {
            None => None,
            Some(st) => {
                let moe: Vec<usize> = ex.layers.iter().map(|l| l.layer).collect();
                let n = manifest.config.num_experts;
                Some(Arc::new(Presence::open(&dir.join(&st.presence_file), &moe, n)?))
            }
        };
        let experts = ExpertFiles { files, paths, layers, record_bytes: ex.record_bytes, presence };
        Ok(Store { dir: dir.to_path_buf(), manifest, spine_file, spine_index, experts })
    }

    pub fn spine_tensor_info(&self, name: &str) -> Option<&SpineTensor> {
        self.spine_index.get(name).map(|&i| &self.manifest.spine.tensors[i])
    }

    /// Read one spine tensor and verify its checksum.
    pub fn load_spine(&self, name: &str) -> Result<LoadedTensor, StoreError> {
        let spine_path = self.dir.join(&self.manifest.spine.file);
        let t = self.spine_info_or_err(name)?;
        let mut scales = vec![0u8; t.scales_len as usize];
        if t.scales_len > 0 {
            self.spine_file.read_exact_at(&mut scales, t.scales_offset).map_err(io_err(&spine_path))?;
        }
        let data = TensorBytes { file: &self.spine_file, path: &spine_path };
        decode_spine_tensor(t, data, &scales, &spine_path)
    }

    fn spine_info_or_err(&self, name: &str) -> Result<&SpineTensor, StoreError> {
        self.spine_tensor_info(name).ok_or_else(|| StoreError::Store {
            path: self.dir.clone(),
            msg: format!("spine tensor '{name}' is not in the manifest"),
        })
    }

    /// The byte range of the spine file holding layer `layer`'s tensors (4096-aligned).
    pub fn spine_layer_range(&self, layer: usize) -> Option<(u64, u64)> {
        layer_range(self.manifest.spine.tensors.iter(), layer)
    }

    /// The spine's tensor table for `layers`, detached from this open store: what a loader
    /// thread needs to decode the layer images its own reader reads.
    pub fn spine_table(&self, layers: &[usize]) -> SpineTable {
        let tensors = self.manifest.spine.tensors.iter().filter(|t| t.layer.is_some_and(|l| layers.contains(&l)));
        SpineTable { path: self.spine_path(), tensors: tensors.map(|t| (t.name.clone(), t.clone())).collect() }
    }

    pub fn spine_path(&self) -> PathBuf {
        self.dir.join(&self.manifest.spine.file)
    }

    /// Tokenizer file inside the store, if it was copied at conversion.
    pub fn tokenizer_file(&self, name: &str) -> Option<PathBuf> {
        let tok = self.manifest.tokenizer.as_ref()?;
        tok.files.iter().any(|f| f == name).then(|| self.dir.join(name))
    }
}

impl SpineSource for Store {
    fn load_spine(&self, name: &str) -> Result<LoadedTensor, StoreError> {
        Store::load_spine(self, name)
    }
}

/// A spine tensor's bytes in the spine file (resident layers; streamed ones are views into a
/// layer image, `image.rs`).
#[derive(Clone, Copy)]
struct TensorBytes<'a> {
    file: &'a File,
    path: &'a Path,
}

/// Bytes read and converted per step when decoding from the file: the only memory a load holds
/// besides the decoded tensor. A multiple of every element size.
const DECODE_CHUNK: usize = 1 << 20;

impl TensorBytes<'_> {
    /// Hand the tensor's `len` bytes at `offset` to `f` in order, in pieces of at most
    /// [`DECODE_CHUNK`] bytes (each a whole number of elements).
    fn for_each_chunk(&self, offset: u64, len: usize, mut f: impl FnMut(&[u8])) -> Result<(), StoreError> {
        let mut buf = vec![0u8; DECODE_CHUNK.min(len)];
        let mut done = 0usize;
        while done < len {
            let n = DECODE_CHUNK.min(len - done);
            self.file.read_exact_at(&mut buf[..n], offset + done as u64).map_err(io_err(self.path))?;
            f(&buf[..n]);
            done += n;
        }
        Ok(())
    }
}

/// Decode a spine tensor into its in-memory form, verifying its checksum. The bytes are read
/// (or taken from the image) chunk by chunk straight into the result, so a load holds the
/// decoded tensor plus one [`DECODE_CHUNK`], never the raw bytes and the result together: a
/// 2.3 GB bf16 embedding peaks at 2.3 GB + 1 MB, not 4.6 GB. Lengths are checked against the
/// shape before anything is allocated; nothing is returned unless the checksum matches.
fn decode_spine_tensor(
    t: &SpineTensor,
    data: TensorBytes,
    scales_raw: &[u8],
    spine_path: &Path,
) -> Result<LoadedTensor, StoreError> {
    let name = &t.name;
    let (numel, len) = check_tensor(t, scales_raw.len(), spine_path)?;
    let mut h = Xxh3::new();
    let decoded = match t.dtype {
        SpineDtype::F32 => {
            let mut v = Vec::with_capacity(numel);
            data.for_each_chunk(t.offset, len, |c| {
                h.update(c);
                v.extend(c.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            })?;
            SpineData::F32(v.into())
        }
        SpineDtype::Bf16 => {
            let mut v = Vec::with_capacity(numel);
            data.for_each_chunk(t.offset, len, |c| {
                h.update(c);
                v.extend(c.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
            })?;
            SpineData::Bf16(v.into())
        }
        SpineDtype::Int8 => {
            let mut q = Vec::with_capacity(numel);
            data.for_each_chunk(t.offset, len, |c| {
                h.update(c);
                q.extend(c.iter().map(|&b| b as i8));
            })?;
            let scales: Vec<f32> =
                scales_raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            SpineData::Int8 { q: q.into(), scales: scales.into(), group: t.group }
        }
    };
    h.update(scales_raw);
    if h.digest() != t.xxh3 {
        return Err(checksum_error(t, spine_path));
    }
    Ok(LoadedTensor { name: name.to_string(), shape: t.shape.clone(), data: decoded })
}

/// Every expert byte range lies inside its file, so a read never runs off the end of a file
/// (`Manifest::load` has checked the indices, the overflow and the record length).
fn check_ranges_in_files(
    ex: &ExpertsInfo,
    files: &[File],
    paths: &[PathBuf],
    manifest: &Path,
) -> Result<(), StoreError> {
    let mut sizes = Vec::with_capacity(files.len());
    for (f, p) in files.iter().zip(paths) {
        sizes.push(f.metadata().map_err(io_err(p))?.len());
    }
    for layer in &ex.layers {
        for (e, loc) in layer.experts.iter().enumerate() {
            for (i, &[f, off, len]) in loc.ranges.iter().enumerate() {
                let size = sizes.get(f as usize).copied().unwrap_or(0);
                if off.checked_add(len).is_none_or(|end| end > size) {
                    return Err(StoreError::Store {
                        path: manifest.to_path_buf(),
                        msg: format!(
                            "experts.layers: layer {} expert {e}: range {i} [{f}, {off}, {len}] runs past the end of {} ({size} bytes)",
                            layer.layer,
                            paths.get(f as usize).map(|p| p.display().to_string()).unwrap_or_default()
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Check a source shard is still the file we converted: same size, same header.
fn verify_source_shard(path: &Path, recorded: Option<&SourceShard>) -> Result<(), StoreError> {
    let Some(rec) = recorded else {
        return Err(StoreError::Store {
            path: path.to_path_buf(),
            msg: "shard is not recorded in the manifest".into(),
        });
    };
    let meta = std::fs::metadata(path)
        .map_err(|e| StoreError::SourceChanged { path: path.to_path_buf(), msg: format!("cannot be opened ({e})") })?;
    if meta.len() != rec.size {
        return Err(StoreError::SourceChanged {
            path: path.to_path_buf(),
            msg: format!("has changed: {} bytes now, {} at conversion", meta.len(), rec.size),
        });
    }
    let shard = Shard::open(path)?;
    if shard.header_hash != rec.header_xxh3 {
        return Err(StoreError::SourceChanged {
            path: path.to_path_buf(),
            msg: "has changed: its header differs".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::image::{ImageVerifier, SpineImage};
    use crate::spine::ImageBytes;

    /// A bf16 tensor of `rows x cols` spanning several decode chunks, with its table entry.
    fn bf16_tensor(rows: usize, cols: usize, offset: u64) -> (SpineTensor, Vec<u8>, Vec<f32>) {
        let values: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
        let t = SpineTensor {
            name: "t".into(),
            layer: Some(0),
            dtype: SpineDtype::Bf16,
            shape: vec![rows, cols],
            offset,
            len: bytes.len() as u64,
            scales_offset: 0,
            scales_len: 0,
            group: 0,
            xxh3: xxh3_64(&bytes),
        };
        (t, bytes, values)
    }

    /// An in-memory layer image.
    struct Bytes(Vec<u8>);
    impl ImageBytes for Bytes {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
    }

    fn table(path: &Path, t: &SpineTensor) -> SpineTable {
        SpineTable { path: path.to_path_buf(), tensors: [(t.name.clone(), t.clone())].into_iter().collect() }
    }

    /// `bytes` at `offset` of an image starting at 0, optionally verified already.
    fn from_image(t: &SpineTensor, file_bytes: &[u8], path: &Path, verified: bool) -> Result<LoadedTensor, StoreError> {
        let image: Arc<dyn ImageBytes> = Arc::new(Bytes(file_bytes.to_vec()));
        let table = table(path, t);
        SpineImage { table: &table, base: 0, image: &image, len: file_bytes.len(), verified }.load_spine(&t.name)
    }

    #[test]
    fn bf16_tensors_decode_from_file_and_image() {
        // 2.5 decode chunks, at an odd offset (chunk edges fall mid-row, and the image cannot be
        // viewed as u16: it is copied) and at an even one (viewed in place).
        let (rows, cols) = (5, DECODE_CHUNK / 4);
        for offset in [3u64, 4] {
            let (t, bytes, values) = bf16_tensor(rows, cols, offset);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("spine.bin");
            let mut file_bytes = vec![0xEEu8; offset as usize];
            file_bytes.extend_from_slice(&bytes);
            std::fs::write(&path, &file_bytes).unwrap();
            let file = File::open(&path).unwrap();
            let from_file = decode_spine_tensor(&t, TensorBytes { file: &file, path: &path }, &[], &path).unwrap();
            let image = from_image(&t, &file_bytes, &path, false).unwrap();
            let SpineData::Bf16(bits) = &image.data else { panic!("not bf16") };
            assert_eq!(bits.is_view(), offset == 4, "aligned bytes are viewed, not copied");
            for loaded in [from_file, image] {
                assert_eq!(loaded.shape, vec![rows, cols]);
                let SpineData::Bf16(bits) = &loaded.data else { panic!("not bf16") };
                assert_eq!(bits.len(), rows * cols);
                let expect: Vec<u16> = values.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
                assert!(**bits == *expect);
                assert_eq!(loaded.to_f32(), values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect::<Vec<_>>());
            }
            // A flipped byte is a checksum error, whichever chunk it is in, unless the image was
            // verified as it landed (the loader's verifier, tested below, caught it then).
            let mut bad = file_bytes.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            let e = from_image(&t, &bad, &path, false).unwrap_err().to_string();
            assert!(e.contains("checksum"), "{e}");
            let tb = table(&path, &t);
            let mut verifier = ImageVerifier::new(&tb, 0, 0);
            verifier.advance(&bad, 1000);
            let e = verifier.finish(&tb, &bad).unwrap_err().to_string();
            assert!(e.contains("checksum"), "{e}");
            // A shape that disagrees with the length, or overflows, is refused before any read.
            let mut t2 = t.clone();
            t2.shape = vec![usize::MAX, 3];
            let e = from_image(&t2, &file_bytes, &path, true).unwrap_err().to_string();
            assert!(e.contains("overflows"), "{e}");
            t2.shape = vec![rows, cols + 1];
            let e = from_image(&t2, &file_bytes, &path, true).unwrap_err().to_string();
            assert!(e.contains("does not match"), "{e}");
            // An image said to be longer than its bytes is refused.
            let image: Arc<dyn ImageBytes> = Arc::new(Bytes(file_bytes.clone()));
            let tb = table(&path, &t);
            let long = SpineImage { table: &tb, base: 0, image: &image, len: file_bytes.len() + 1, verified: true };
            assert!(long.load_spine(&t.name).unwrap_err().to_string().contains("holds"));
            // A table entry pointing outside the image is refused.
            t2 = t.clone();
            t2.offset += 8;
            let e = from_image(&t2, &file_bytes, &path, true).unwrap_err().to_string();
            assert!(e.contains("outside"), "{e}");
        }
    }

    /// The verifier hashes pieces as they land, in any piece sizes, and agrees with hashing the
    /// whole: a clean image passes, and one flipped byte anywhere fails.
    #[test]
    fn image_verifier_hashes_pieces_as_they_land() {
        let (t, bytes, _) = bf16_tensor(3, 1000, 64);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spine.bin");
        let mut image = vec![0u8; 64];
        image.extend_from_slice(&bytes);
        let table = table(&path, &t);
        // One verifier reset for each image, as the spine loader uses it.
        let mut v = ImageVerifier::new(&table, 0, 0);
        for piece in [1usize, 7, 4096, 1 << 20] {
            v.reset(&table, 0, 0);
            let mut landed = 0;
            while landed < image.len() {
                landed = (landed + piece).min(image.len());
                v.advance(&image, landed as u64);
            }
            v.finish(&table, &image).unwrap();
            assert_eq!(v.bytes_hashed, bytes.len() as u64);
        }
        for flip in [64, 64 + bytes.len() / 2, image.len() - 1] {
            let mut bad = image.clone();
            bad[flip] ^= 0x10;
            v.reset(&table, 0, 0);
            v.advance(&bad, 100);
            let e = v.finish(&table, &bad).unwrap_err().to_string();
            assert!(e.contains(&t.name) && e.contains("checksum"), "flip at {flip}: {e}");
            // The next image verifies clean after a failed one.
            v.reset(&table, 0, 0);
            v.finish(&table, &image).unwrap();
        }
    }
}
