//! `deltafin convert`: a Hugging Face K3 checkpoint into a Deltafin store.
//!
//! Streaming by construction: matrices are converted in row chunks of at most [`CHUNK_BYTES`] and
//! experts one record at a time, so peak memory is a few tens of MB whatever the checkpoint's size
//! (a 1.5 TB K3 converts in the same footprint as a fixture; the largest single K3 tensor, the
//! 2.3 GB embedding, is never held whole).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::Dtype;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::checkpoint::{Checkpoint, K3_TEXT_PREFIX, bytes_to_f32};
use crate::error::{StoreError, io_err};
use crate::manifest::*;
use crate::quant::{effective_group, quantize_int8};
use crate::schema::{Role, checkpoint_name, expert_parts, expert_tensor_name, spine_specs};

/// Upper bound on source bytes converted at once.
pub const CHUNK_BYTES: usize = 32 << 20;
/// Alignment of every spine tensor (cache lines, and SIMD loads).
const TENSOR_ALIGN: u64 = 64;
/// Alignment of each spine layer and each packed expert record, for O_DIRECT reads.
pub const IO_ALIGN: u64 = 4096;
/// Tokenizer files copied into the store when the checkpoint has them.
pub const TOKENIZER_FILES: [&str; 3] = ["tiktoken.model", "tokenizer_config.json", "generation_config.json"];

#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub spine: SpineDtype,
    /// int8 group size; 0 = per row.
    pub int8_group: usize,
    pub experts: ExpertLayout,
    pub progress: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions { spine: SpineDtype::Int8, int8_group: 0, experts: ExpertLayout::InPlace, progress: false }
    }
}

pub struct ConvertReport {
    pub spine_bytes: u64,
    pub expert_records: usize,
    pub record_bytes: u64,
    pub expert_ranges: usize,
}

pub fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Detect the text model's tensor prefix: K3 releases use `language_model.model.`; a plain
/// `kimi_linear` checkpoint uses `model.`.
fn detect_prefix(ck: &Checkpoint) -> &'static str {
    if ck.weight_map.keys().any(|k| k.starts_with(K3_TEXT_PREFIX)) { K3_TEXT_PREFIX } else { "model." }
}

/// Sequential writer of the spine file, tracking the offset and hashing what it is told to.
pub(crate) struct SpineWriter {
    w: BufWriter<File>,
    pub(crate) pos: u64,
    path: PathBuf,
}

impl SpineWriter {
    pub(crate) fn create(path: &Path) -> Result<Self, StoreError> {
        let f = File::create(path).map_err(io_err(path))?;
        Ok(SpineWriter { w: BufWriter::with_capacity(8 << 20, f), pos: 0, path: path.to_path_buf() })
    }

    /// Flush and sync to disk.
    pub(crate) fn finish(self) -> Result<(), StoreError> {
        let path = self.path.clone();
        let f = self.w.into_inner().map_err(|e| StoreError::Io { path: path.clone(), source: e.into_error() })?;
        f.sync_all().map_err(io_err(&path))
    }

    pub(crate) fn pad_to(&mut self, align: u64) -> Result<(), StoreError> {
        let target = align_up(self.pos, align);
        let pad = vec![0u8; (target - self.pos) as usize];
        self.write(&pad, None)
    }
    pub(crate) fn write(&mut self, bytes: &[u8], h: Option<&mut Xxh3>) -> Result<(), StoreError> {
        self.w.write_all(bytes).map_err(io_err(&self.path))?;
        if let Some(h) = h {
            h.update(bytes);
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }
}

/// A byte-counting progress bar, drawn only when `show` (a terminal).
pub(crate) fn byte_progress(total: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template("{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}

/// Where each of the six tensors sits in a canonical record, and the record's size.
pub(crate) fn record_parts(parts: &[(&'static str, [usize; 2])]) -> (Vec<ExpertPart>, u64) {
    let mut meta = Vec::with_capacity(parts.len());
    let mut off = 0u64;
    for (name, shape) in parts {
        let len = (shape[0] * shape[1]) as u64;
        meta.push(ExpertPart { name: name.to_string(), shape: *shape, offset: off, len });
        off += len;
    }
    (meta, off)
}

pub fn convert(from: &Path, to: &Path, opts: &ConvertOptions) -> Result<ConvertReport, StoreError> {
    let ck = Checkpoint::open(from)?;
    let cfg = ck.config.clone();
    let prefix = detect_prefix(&ck);
    std::fs::create_dir_all(to).map_err(io_err(to))?;
    let specs = spine_specs(&cfg);
    let parts = expert_parts(&cfg);
    let moe_layers = cfg.moe_layers();

    // Resolve and check every tensor before writing anything: a bad checkpoint fails fast, by name.
    let mut resolved = Vec::with_capacity(specs.len());
    for s in &specs {
        let full = checkpoint_name(prefix, &s.name);
        let (shard, t) = ck.find(&full)?;
        if !s.shape.accepts(&t.shape) {
            return Err(StoreError::Tensor {
                path: shard.path.clone(),
                tensor: full,
                msg: format!("shape {:?} does not match the config, which implies {:?}", t.shape, s.shape),
            });
        }
        if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(StoreError::Tensor {
                path: shard.path.clone(),
                tensor: full,
                msg: format!("dtype {:?} is not a float type", t.dtype),
            });
        }
        resolved.push((s, full));
    }
    let (part_meta, record_bytes) = record_parts(&parts);
    let expert_total = moe_layers.len() as u64 * cfg.num_experts as u64 * record_bytes;
    let spine_src: u64 = resolved.iter().map(|(_, n)| ck.find(n).map(|(_, t)| t.len).unwrap_or(0)).sum();

    let bar = byte_progress(spine_src + expert_total, opts.progress);

    // --- spine ---
    bar.set_message("spine");
    let spine_path = to.join("spine.bin");
    let mut sw = SpineWriter::create(&spine_path)?;
    let mut tensors = Vec::with_capacity(resolved.len());
    let mut last_layer: Option<Option<usize>> = None;
    let mut fbuf: Vec<f32> = Vec::new();
    for (spec, full) in &resolved {
        if last_layer != Some(spec.layer) {
            sw.pad_to(IO_ALIGN)?;
            last_layer = Some(spec.layer);
        }
        sw.pad_to(TENSOR_ALIGN)?;
        let (shard, t) = ck.find(full)?;
        let tensor_err = |msg: String| StoreError::Tensor { path: shard.path.clone(), tensor: full.clone(), msg };
        let mut h = Xxh3::new();
        let offset = sw.pos;
        let is_matrix = spec.role == Role::Matrix;
        let dtype = if is_matrix { opts.spine } else { SpineDtype::F32 };
        let (rows, cols) = if is_matrix { (t.shape[0], t.shape[1]) } else { (1, t.numel()) };
        let esize = t.len as usize / t.numel().max(1);
        let rows_per_chunk = (CHUNK_BYTES / (cols * esize).max(1)).max(1);
        let group = effective_group(cols, opts.int8_group);
        let mut all_scales: Vec<f32> = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let nr = rows_per_chunk.min(rows - r0);
            let mut raw = vec![0u8; nr * cols * esize];
            shard.read_at(t.offset + (r0 * cols * esize) as u64, &mut raw)?;
            match dtype {
                SpineDtype::Bf16 if t.dtype == Dtype::BF16 => sw.write(&raw, Some(&mut h))?,
                _ => {
                    bytes_to_f32(t.dtype, &raw, &mut fbuf).map_err(tensor_err)?;
                    if let Some(i) = fbuf.iter().position(|v| !v.is_finite()) {
                        return Err(tensor_err(format!("element {} is not finite", r0 * cols + i)));
                    }
                    match dtype {
                        SpineDtype::F32 => {
                            let b: Vec<u8> = fbuf.iter().flat_map(|v| v.to_le_bytes()).collect();
                            sw.write(&b, Some(&mut h))?;
                        }
                        SpineDtype::Bf16 => {
                            let b: Vec<u8> = fbuf.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
                            sw.write(&b, Some(&mut h))?;
                        }
                        SpineDtype::Int8 => {
                            let (q, s) = quantize_int8(&fbuf, cols, group);
                            let b: Vec<u8> = q.iter().map(|&v| v as u8).collect();
                            sw.write(&b, Some(&mut h))?;
                            all_scales.extend_from_slice(&s);
                        }
                    }
                }
            }
            bar.inc(raw.len() as u64);
            r0 += nr;
        }
        let len = sw.pos - offset;
        let (mut scales_offset, mut scales_len) = (0, 0);
        if dtype == SpineDtype::Int8 {
            sw.pad_to(TENSOR_ALIGN)?;
            scales_offset = sw.pos;
            let b: Vec<u8> = all_scales.iter().flat_map(|v| v.to_le_bytes()).collect();
            sw.write(&b, Some(&mut h))?;
            scales_len = b.len() as u64;
        }
        tensors.push(SpineTensor {
            name: spec.name.clone(),
            layer: spec.layer,
            dtype,
            shape: if is_matrix { vec![rows, cols] } else { t.shape.clone() },
            offset,
            len,
            scales_offset,
            scales_len,
            group: if dtype == SpineDtype::Int8 { group } else { 0 },
            xxh3: h.digest(),
        });
    }
    sw.pad_to(IO_ALIGN)?;
    let spine_bytes = sw.pos;
    sw.finish()?;

    // --- experts ---
    bar.set_message("experts");
    let shard_files: Vec<String> = ck
        .shards
        .iter()
        .map(|s| s.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
        .collect();
    let mut files: Vec<String> = match opts.experts {
        ExpertLayout::InPlace => shard_files.clone(),
        ExpertLayout::Pack => Vec::new(),
    };
    if opts.experts == ExpertLayout::Pack {
        std::fs::create_dir_all(to.join("experts")).map_err(io_err(to.join("experts")))?;
    }
    let stride = align_up(record_bytes, IO_ALIGN);
    let mut layers = Vec::with_capacity(moe_layers.len());
    let mut record = vec![0u8; record_bytes as usize];
    let mut total_ranges = 0usize;
    for &l in &moe_layers {
        let mut pack_file = None;
        if opts.experts == ExpertLayout::Pack {
            let rel = format!("experts/layer-{l:03}.bin");
            let p = to.join(&rel);
            let f = File::create(&p).map_err(io_err(&p))?;
            f.set_len(stride * cfg.num_experts as u64).map_err(io_err(&p))?;
            files.push(rel);
            pack_file = Some((files.len() - 1, f, p));
        }
        let mut experts = Vec::with_capacity(cfg.num_experts);
        for e in 0..cfg.num_experts {
            // Source ranges in canonical order, adjacent ones merged.
            let mut ranges: Vec<[u64; 3]> = Vec::new();
            let mut pos = 0usize;
            for (name, shape) in &parts {
                let full = expert_tensor_name(prefix, l, e, name);
                let si = *ck
                    .weight_map
                    .get(&full)
                    .ok_or_else(|| StoreError::MissingTensor { dir: ck.dir.clone(), tensor: full.clone() })?;
                let (shard, t) = ck.expect(&full, shape, &[Dtype::U8])?;
                shard.read_at(t.offset, &mut record[pos..pos + t.len as usize])?;
                if name.ends_with("weight_scale")
                    && let Some(i) = record[pos..pos + t.len as usize].iter().position(|&b| b == 0xFF)
                {
                    return Err(StoreError::Tensor {
                        path: shard.path.clone(),
                        tensor: full,
                        msg: format!(
                            "layer {l} expert {e}: E8M0 scale byte {i} is 0xFF (NaN); the checkpoint is corrupt"
                        ),
                    });
                }
                pos += t.len as usize;
                match ranges.last_mut() {
                    Some(r) if r[0] == si as u64 && r[1] + r[2] == t.offset => r[2] += t.len,
                    _ => ranges.push([si as u64, t.offset, t.len]),
                }
            }
            let xxh3 = xxh3_64(&record);
            if let Some((fi, f, p)) = &pack_file {
                let at = e as u64 * stride;
                f.write_all_at(&record, at).map_err(io_err(p))?;
                ranges = vec![[*fi as u64, at, record_bytes]];
            }
            total_ranges += ranges.len();
            experts.push(ExpertLocation { ranges, xxh3 });
            bar.inc(record_bytes);
        }
        if let Some((_, f, p)) = pack_file {
            f.sync_all().map_err(io_err(&p))?;
        }
        layers.push(ExpertLayer { layer: l, experts });
    }
    bar.finish_and_clear();

    // --- tokenizer ---
    let mut tok_files = Vec::new();
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.exists() {
            std::fs::copy(&src, to.join(name)).map_err(io_err(&src))?;
            tok_files.push(name.to_string());
        }
    }

    let abs_dir = std::fs::canonicalize(from).map_err(io_err(from))?;
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        arch: "kimi_k3".into(),
        config: cfg.clone(),
        source: SourceInfo {
            dir: abs_dir.to_string_lossy().into_owned(),
            prefix: prefix.into(),
            shards: ck
                .shards
                .iter()
                .zip(&shard_files)
                .map(|(s, f)| SourceShard { file: f.clone(), size: s.file_len, header_xxh3: s.header_hash })
                .collect(),
        },
        spine: SpineInfo {
            file: "spine.bin".into(),
            matrix_dtype: opts.spine,
            int8_group: opts.int8_group,
            bytes: spine_bytes,
            tensors,
        },
        experts: ExpertsInfo {
            layout: opts.experts,
            format: "mxfp4".into(),
            record_bytes,
            parts: part_meta,
            files,
            layers,
        },
        tokenizer: if tok_files.is_empty() { None } else { Some(TokenizerInfo { files: tok_files }) },
    };
    manifest.save(to)?;
    Ok(ConvertReport {
        spine_bytes,
        expert_records: moe_layers.len() * cfg.num_experts,
        record_bytes,
        expert_ranges: total_ranges,
    })
}
