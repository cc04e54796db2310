//! `deltafin convert`: a Hugging Face K3 checkpoint into a Deltafin store.
//!
//! Streaming by construction: matrices are converted in row chunks of at most [`CHUNK_BYTES`] and
//! experts one record at a time, so peak memory is a few tens of MB whatever the checkpoint's size
//! (a 1.5 TB K3 converts in the same footprint as a fixture; the largest single K3 tensor, the
//! 2.3 GB embedding, is never held whole).

use crate::os::FileAt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::checksum::{Xxh3, xxh3_64};
use half::bf16;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, bytes_to_f32, text_prefix};
use crate::config::K3Config;
use crate::error::{StoreError, io_err};
use crate::manifest::*;
use crate::progress::Progress;
use crate::quant::{effective_group, quantize_int8};
use crate::schema::{Role, SpineSpec, checkpoint_name, expert_parts, expert_tensor_name, spine_specs};
use crate::shard::{Shard, TensorEntry};

/// Upper bound on source bytes converted at once.
pub const CHUNK_BYTES: usize = 32 << 20;
/// Alignment of every spine tensor (cache lines, and SIMD loads).
const TENSOR_ALIGN: u64 = 64;
/// The spine name of a MoE layer's router gate, as the schema spells it.
const ROUTER_GATE: &str = "block_sparse_moe.gate.weight";

/// Alignment of each spine layer and each packed expert record, for O_DIRECT reads.
pub const IO_ALIGN: u64 = 4096;
/// Name of the spine file inside the store.
const SPINE_FILE: &str = "spine.bin";
/// Tokenizer files copied into the store when the checkpoint has them.
pub const TOKENIZER_FILES: [&str; 3] = ["tiktoken.model", "tokenizer_config.json", "generation_config.json"];

#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// The spine matrices' precision, or how to choose it.
    pub spine: SpinePrecision,
    /// int8 group size; 0 = per row.
    pub int8_group: usize,
    /// Keep each MoE layer's router gate in f32 whatever `spine` is (as llama.cpp keeps it):
    /// a small matrix whose rounding can flip which experts a token picks.
    pub router_f32: bool,
    /// Matrices stored at another precision, by part of their name; the first rule that
    /// matches wins, and it overrides `router_f32`.
    pub keep: Vec<KeepRule>,
    pub experts: ExpertLayout,
    pub progress: bool,
    /// Provenance recorded in the manifest (`deltafin install`).
    pub origin: Option<OriginInfo>,
    /// Recorded in the manifest: the store streams its experts (their checksums are in the
    /// presence map).
    pub streaming: Option<StreamingInfo>,
    /// Where the experts' checksums come from.
    pub expert_sums: ExpertSums,
}

/// How `convert` learns each routed expert's checksum.
#[derive(Debug, Clone, Default)]
pub enum ExpertSums {
    /// Read every record (checking its scales) and hash it: the plain conversion.
    #[default]
    Read,
    /// Not known: the shards do not hold the experts yet (a streaming install). Experts are
    /// located from the shard headers alone, in place, with checksum 0.
    Absent,
    /// Computed already (by an install that hashed each shard as it verified it), by
    /// (layer, expert); located from the headers, in place.
    Given(std::collections::HashMap<(usize, usize), u64>),
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            spine: SpinePrecision::Fixed(SpineDtype::Int8),
            int8_group: 0,
            router_f32: false,
            keep: Vec::new(),
            experts: ExpertLayout::InPlace,
            progress: false,
            origin: None,
            streaming: None,
            expert_sums: ExpertSums::Read,
        }
    }
}

pub struct ConvertReport {
    pub spine_bytes: u64,
    /// The spine matrices' dtype (as asked, or as `auto` chose).
    pub spine_dtype: SpineDtype,
    /// What `auto` weighed, when it chose.
    pub spine_auto: Option<SpineAuto>,
    pub expert_records: usize,
    pub record_bytes: u64,
    pub expert_ranges: usize,
}

pub fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// The text model's tensor prefix of this checkpoint.
fn detect_prefix(ck: &Checkpoint) -> &'static str {
    text_prefix(ck.weight_map.keys().map(String::as_str))
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

    /// Zero-pad up to the planned offset `target`, which must not be behind the writer.
    fn pad_until(&mut self, target: u64) -> Result<(), StoreError> {
        let Some(n) = target.checked_sub(self.pos) else {
            return Err(StoreError::Store {
                path: self.path.clone(),
                msg: format!("the layout placed data at byte {target}, behind the writer at {}", self.pos),
            });
        };
        self.write(&vec![0u8; n as usize], None)
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

/// Byte-counted progress: a bar on a terminal, periodic lines otherwise, nothing unless `show`.
pub(crate) fn byte_progress(total: u64, show: bool) -> Progress {
    Progress::new("spine", total, !show)
}

/// Convert the checkpoint in `from` into a store in `to`, step by step: open the checkpoint,
/// resolve, check and lay out the spine, write it, locate (or pack) the experts, copy the
/// tokenizer, and write the manifest last, atomically, from what the steps produced.
pub fn convert(from: &Path, to: &Path, opts: &ConvertOptions) -> Result<ConvertReport, StoreError> {
    let src = Source::open(from)?;
    std::fs::create_dir_all(to).map_err(io_err(to))?;
    refuse_same_dir(from, to)?;
    let read_experts = matches!(opts.expert_sums, ExpertSums::Read);
    if !read_experts && opts.experts != ExpertLayout::InPlace {
        return Err(StoreError::Store {
            path: to.to_path_buf(),
            msg: "experts located without reading them stay in place".into(),
        });
    }
    let (dtype, auto) = match opts.spine {
        SpinePrecision::Fixed(d) => (d, None),
        SpinePrecision::Auto { budget } => {
            let auto = SpineAuto { budget, bf16_bytes: plan_spine(&src, opts, SpineDtype::Bf16)?.bytes };
            (auto.choose(), Some(auto))
        }
    };
    let spine_plan = plan_spine(&src, opts, dtype)?;
    let expert_plan = ExpertPlan::new(&src.ck.config);
    let expert_src_bytes = if read_experts { expert_plan.src_bytes() } else { 0 };
    let bar = byte_progress(spine_plan.src_bytes + expert_src_bytes, opts.progress);
    let mut spine = write_spine(&spine_plan, opts, &to.join(SPINE_FILE), &bar)?;
    spine.auto = auto;
    let (experts, expert_ranges) = if read_experts {
        locate_experts(&src, &expert_plan, opts.experts, to, &bar)?
    } else {
        locate_experts_by_header(&src, &expert_plan, &opts.expert_sums)?
    };
    bar.finish_and_clear();
    let tokenizer = copy_tokenizer(from, to)?;
    let report = ConvertReport {
        spine_bytes: spine.bytes,
        spine_dtype: dtype,
        spine_auto: auto,
        expert_records: expert_plan.records(),
        record_bytes: expert_plan.record_bytes,
        expert_ranges,
    };
    write_manifest(from, to, &src, spine, experts, tokenizer, opts)?;
    Ok(report)
}

/// Whether two paths name the same file or directory (same device and inode), whatever their
/// spelling: `d`, `d/.`, `d/../d` and a symbolic link to `d` are all `d`.
fn same_file(a: &Path, b: &Path) -> Result<bool, StoreError> {
    std::fs::metadata(b).map_err(io_err(b))?;
    crate::os::same_file(a, b).map_err(io_err(a))
}

/// A store written into its own checkpoint directory would copy the tokenizer files onto
/// themselves (truncating them) and mix `spine.bin` and `manifest.json` into the checkpoint, so
/// converting onto the source is refused before anything is written.
fn refuse_same_dir(from: &Path, to: &Path) -> Result<(), StoreError> {
    if same_file(from, to)? {
        return Err(StoreError::Store {
            path: to.to_path_buf(),
            msg: format!(
                "is the same directory as the checkpoint {}; give --to a directory of its own",
                from.display()
            ),
        });
    }
    Ok(())
}

/// The opened checkpoint, its text model's tensor prefix and its shard file names.
struct Source {
    ck: Checkpoint,
    prefix: &'static str,
    /// File names of `ck.shards`, in the same order.
    shard_files: Vec<String>,
}

impl Source {
    /// Open and validate the checkpoint (config, index, shard headers) and detect its prefix.
    fn open(from: &Path) -> Result<Self, StoreError> {
        let ck = Checkpoint::open(from)?;
        let prefix = detect_prefix(&ck);
        let shard_files = ck
            .shards
            .iter()
            .map(|s| s.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
            .collect();
        Ok(Source { ck, prefix, shard_files })
    }
}

/// One spine tensor: its checkpoint source and its place in `spine.bin`.
struct PlannedTensor<'a> {
    /// Name inside the store.
    name: String,
    layer: Option<usize>,
    /// Full checkpoint name, for errors.
    full: String,
    shard: &'a Shard,
    t: &'a TensorEntry,
    dtype: SpineDtype,
    /// Matrices as `[rows, cols]`; vectors as one row.
    rows: usize,
    cols: usize,
    /// Stored shape (the checkpoint's for vectors).
    shape: Vec<usize>,
    /// int8 scale group; 0 for other dtypes.
    group: usize,
    offset: u64,
    len: u64,
    scales_offset: u64,
    scales_len: u64,
}

impl PlannedTensor<'_> {
    /// An error naming this tensor and its shard.
    fn error(&self, msg: String) -> StoreError {
        StoreError::Tensor { path: self.shard.path.clone(), tensor: self.full.clone(), msg }
    }
}

/// The whole spine file's layout, decided before a byte of it is written.
struct SpinePlan<'a> {
    /// The dtype of matrices no rule keeps at another precision.
    dtype: SpineDtype,
    tensors: Vec<PlannedTensor<'a>>,
    /// Size of `spine.bin`, padded to [`IO_ALIGN`].
    bytes: u64,
    /// Source bytes read to write it (for progress).
    src_bytes: u64,
}

/// Resolve and check every spine tensor, then lay the spine out. A bad checkpoint fails here, by
/// tensor name, before anything is written.
fn plan_spine<'a>(src: &'a Source, opts: &ConvertOptions, dtype: SpineDtype) -> Result<SpinePlan<'a>, StoreError> {
    let mut tensors = spine_specs(&src.ck.config)
        .iter()
        .map(|s| resolve_spine_tensor(src, s, opts, dtype))
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = lay_out_spine(&mut tensors);
    let src_bytes = tensors.iter().map(|p| p.t.len).sum();
    Ok(SpinePlan { dtype, tensors, bytes, src_bytes })
}

/// Find one spine tensor in the checkpoint and check its shape and float dtype; produces it with
/// its stored dtype (`dtype` for matrices no rule keeps otherwise), geometry and int8 group, not
/// yet placed.
fn resolve_spine_tensor<'a>(
    src: &'a Source,
    s: &SpineSpec,
    opts: &ConvertOptions,
    dtype: SpineDtype,
) -> Result<PlannedTensor<'a>, StoreError> {
    let full = checkpoint_name(src.prefix, &s.name);
    let (shard, t) = src.ck.find(&full)?;
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
    let is_matrix = s.role == Role::Matrix;
    let router = s.name.ends_with(ROUTER_GATE);
    let kept = opts.keep.iter().find(|k| s.name.contains(&k.pattern)).map(|k| k.dtype);
    let dtype = match (is_matrix, kept) {
        (false, _) => SpineDtype::F32,
        (true, Some(d)) => d,
        (true, None) if router && opts.router_f32 => SpineDtype::F32,
        (true, None) => dtype,
    };
    let (rows, cols) = if is_matrix { (t.shape[0], t.shape[1]) } else { (1, t.numel()) };
    Ok(PlannedTensor {
        name: s.name.clone(),
        layer: s.layer,
        full,
        shard,
        t,
        dtype,
        rows,
        cols,
        shape: if is_matrix { vec![rows, cols] } else { t.shape.clone() },
        group: if dtype == SpineDtype::Int8 { effective_group(cols, opts.int8_group) } else { 0 },
        offset: 0,
        len: 0,
        scales_offset: 0,
        scales_len: 0,
    })
}

/// Place each tensor (and its int8 scales) at a [`TENSOR_ALIGN`] boundary, each layer's first at
/// an [`IO_ALIGN`] one; produces the spine file's size, padded to [`IO_ALIGN`].
fn lay_out_spine(tensors: &mut [PlannedTensor]) -> u64 {
    let mut pos = 0u64;
    let mut last_layer: Option<Option<usize>> = None;
    for p in tensors {
        if last_layer != Some(p.layer) {
            pos = align_up(pos, IO_ALIGN);
            last_layer = Some(p.layer);
        }
        let numel = (p.rows * p.cols) as u64;
        p.offset = align_up(pos, TENSOR_ALIGN);
        p.len = match p.dtype {
            // bf16 from a bf16 source is a plain copy of the source bytes.
            SpineDtype::Bf16 if p.t.dtype == Dtype::BF16 => p.t.len,
            d => numel * d.element_bytes() as u64,
        };
        pos = p.offset + p.len;
        if p.dtype == SpineDtype::Int8 {
            // One f32 scale per group of a row (the group divides the row, see effective_group).
            p.scales_offset = align_up(pos, TENSOR_ALIGN);
            p.scales_len = numel.checked_div(p.group as u64).unwrap_or(0) * 4;
            pos = p.scales_offset + p.scales_len;
        }
    }
    align_up(pos, IO_ALIGN)
}

/// Write `spine.bin` as planned, converting each tensor in row chunks of at most [`CHUNK_BYTES`]
/// of source; produces the manifest's spine section (with each tensor's checksum).
fn write_spine(plan: &SpinePlan, opts: &ConvertOptions, path: &Path, bar: &Progress) -> Result<SpineInfo, StoreError> {
    bar.set_message("spine");
    let mut sw = SpineWriter::create(path)?;
    let mut tensors = Vec::with_capacity(plan.tensors.len());
    let mut fbuf: Vec<f32> = Vec::new();
    for p in &plan.tensors {
        sw.pad_until(p.offset)?;
        let mut h = Xxh3::new();
        let scales = write_tensor_data(&mut sw, p, &mut h, &mut fbuf, bar)?;
        check_at(&sw, p.offset + p.len, p)?;
        if p.dtype == SpineDtype::Int8 {
            sw.pad_until(p.scales_offset)?;
            let b: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
            sw.write(&b, Some(&mut h))?;
            check_at(&sw, p.scales_offset + p.scales_len, p)?;
        }
        tensors.push(SpineTensor {
            name: p.name.clone(),
            layer: p.layer,
            dtype: p.dtype,
            shape: p.shape.clone(),
            offset: p.offset,
            len: p.len,
            scales_offset: p.scales_offset,
            scales_len: p.scales_len,
            group: p.group,
            xxh3: h.digest(),
        });
    }
    sw.pad_until(plan.bytes)?;
    sw.finish()?;
    Ok(SpineInfo {
        file: SPINE_FILE.into(),
        matrix_dtype: plan.dtype,
        int8_group: opts.int8_group,
        router_f32: opts.router_f32,
        keep: opts.keep.clone(),
        auto: None,
        bytes: plan.bytes,
        tensors,
    })
}

/// Convert one tensor's data into the spine, row chunk by row chunk, checking every value is
/// finite; produces its int8 scales (empty for other dtypes).
fn write_tensor_data(
    sw: &mut SpineWriter,
    p: &PlannedTensor,
    h: &mut Xxh3,
    fbuf: &mut Vec<f32>,
    bar: &Progress,
) -> Result<Vec<f32>, StoreError> {
    let (rows, cols, t) = (p.rows, p.cols, p.t);
    let esize = t.len as usize / t.numel().max(1);
    let rows_per_chunk = (CHUNK_BYTES / (cols * esize).max(1)).max(1);
    let mut scales: Vec<f32> = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let nr = rows_per_chunk.min(rows - r0);
        let mut raw = vec![0u8; nr * cols * esize];
        p.shard.read_at(t.offset + (r0 * cols * esize) as u64, &mut raw)?;
        match p.dtype {
            SpineDtype::Bf16 if t.dtype == Dtype::BF16 => sw.write(&raw, Some(h))?,
            _ => {
                bytes_to_f32(t.dtype, &raw, fbuf).map_err(|m| p.error(m))?;
                if let Some(i) = fbuf.iter().position(|v| !v.is_finite()) {
                    return Err(p.error(format!("element {} is not finite", r0 * cols + i)));
                }
                match p.dtype {
                    SpineDtype::F32 => {
                        let b: Vec<u8> = fbuf.iter().flat_map(|v| v.to_le_bytes()).collect();
                        sw.write(&b, Some(h))?;
                    }
                    SpineDtype::Bf16 => {
                        let b: Vec<u8> = fbuf.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
                        sw.write(&b, Some(h))?;
                    }
                    SpineDtype::Int8 => {
                        let (q, s) = quantize_int8(fbuf, cols, p.group);
                        let b: Vec<u8> = q.iter().map(|&v| v as u8).collect();
                        sw.write(&b, Some(h))?;
                        scales.extend_from_slice(&s);
                    }
                }
            }
        }
        bar.inc(raw.len() as u64);
        r0 += nr;
    }
    Ok(scales)
}

/// The writer must stand where the plan said: a mismatch would shift every later offset.
fn check_at(sw: &SpineWriter, planned: u64, p: &PlannedTensor) -> Result<(), StoreError> {
    if sw.pos == planned {
        Ok(())
    } else {
        Err(p.error(format!("wrote up to spine byte {} where the layout planned {planned}", sw.pos)))
    }
}

/// The canonical expert record (six tensors back to back) and the MoE layers that have one per
/// expert.
struct ExpertPlan {
    /// Checkpoint tensor suffix and shape of each part, in record order.
    parts: Vec<(&'static str, [usize; 2])>,
    /// Where each part sits in the record.
    part_meta: Vec<ExpertPart>,
    record_bytes: u64,
    moe_layers: Vec<usize>,
    num_experts: usize,
}

impl ExpertPlan {
    /// Lay out the canonical record for this config.
    fn new(cfg: &K3Config) -> Self {
        let parts = expert_parts(cfg);
        let (part_meta, record_bytes) = record_parts(&parts);
        ExpertPlan { parts, part_meta, record_bytes, moe_layers: cfg.moe_layers(), num_experts: cfg.num_experts }
    }

    /// Expert records in the model.
    fn records(&self) -> usize {
        self.moe_layers.len() * self.num_experts
    }

    /// Source bytes read to locate (or pack) every record (for progress).
    fn src_bytes(&self) -> u64 {
        self.records() as u64 * self.record_bytes
    }
}

/// Read every expert's record once (checking its E8M0 scales and hashing it) and say where it
/// lives: byte ranges in the checkpoint's shards (in place), or one record in a 4096-aligned
/// per-layer file under `experts/` (pack). Produces the manifest's experts section and the
/// number of byte ranges.
fn locate_experts(
    src: &Source,
    plan: &ExpertPlan,
    layout: ExpertLayout,
    to: &Path,
    bar: &Progress,
) -> Result<(ExpertsInfo, usize), StoreError> {
    bar.set_message("experts");
    let mut files: Vec<String> = match layout {
        ExpertLayout::InPlace => src.shard_files.clone(),
        ExpertLayout::Pack => Vec::new(),
    };
    if layout == ExpertLayout::Pack {
        std::fs::create_dir_all(to.join("experts")).map_err(io_err(to.join("experts")))?;
    }
    let stride = align_up(plan.record_bytes, IO_ALIGN);
    let mut layers = Vec::with_capacity(plan.moe_layers.len());
    let mut record = vec![0u8; plan.record_bytes as usize];
    let mut total_ranges = 0usize;
    for &l in &plan.moe_layers {
        let pack = match layout {
            ExpertLayout::Pack => Some(PackFile::create(to, l, stride * plan.num_experts as u64, &mut files)?),
            ExpertLayout::InPlace => None,
        };
        let mut experts = Vec::with_capacity(plan.num_experts);
        for e in 0..plan.num_experts {
            let mut ranges = read_record(src, plan, l, e, &mut record)?;
            let xxh3 = xxh3_64(&record);
            if let Some(pack) = &pack {
                ranges = vec![pack.write(e as u64 * stride, &record)?];
            }
            total_ranges += ranges.len();
            experts.push(ExpertLocation { ranges, xxh3 });
            bar.inc(plan.record_bytes);
        }
        if let Some(pack) = pack {
            pack.sync()?;
        }
        layers.push(ExpertLayer { layer: l, experts });
    }
    let info = ExpertsInfo {
        layout,
        format: "mxfp4".into(),
        record_bytes: plan.record_bytes,
        parts: plan.part_meta.clone(),
        files,
        layers,
    };
    Ok((info, total_ranges))
}

/// Where expert `e` of layer `l` lives, from the shard headers alone: per part, its shard
/// and tensor entry, in canonical order (shapes and dtype checked).
fn record_parts_of<'a>(
    src: &'a Source,
    plan: &ExpertPlan,
    l: usize,
    e: usize,
) -> Result<Vec<(usize, &'a Shard, &'a TensorEntry, String)>, StoreError> {
    let ck = &src.ck;
    let mut out = Vec::with_capacity(plan.parts.len());
    for (name, shape) in &plan.parts {
        let full = expert_tensor_name(src.prefix, l, e, name);
        let si = *ck
            .weight_map
            .get(&full)
            .ok_or_else(|| StoreError::MissingTensor { dir: ck.dir.clone(), tensor: full.clone() })?;
        let (shard, t) = ck.expect(&full, shape, &[Dtype::U8])?;
        out.push((si, shard, t, full));
    }
    Ok(out)
}

/// The source ranges `[shard, offset, len]` of a record's parts, adjacent ones merged.
fn merged_ranges(parts: &[(usize, &Shard, &TensorEntry, String)]) -> Vec<[u64; 3]> {
    let mut ranges: Vec<[u64; 3]> = Vec::new();
    for (si, _, t, _) in parts {
        match ranges.last_mut() {
            Some(r) if r[0] == *si as u64 && r[1] + r[2] == t.offset => r[2] += t.len,
            _ => ranges.push([*si as u64, t.offset, t.len]),
        }
    }
    ranges
}

/// Read expert `e` of layer `l` into `record` in canonical order, refusing a NaN (0xFF) E8M0
/// scale; produces its source ranges `[shard, offset, len]`, adjacent ones merged.
fn read_record(
    src: &Source,
    plan: &ExpertPlan,
    l: usize,
    e: usize,
    record: &mut [u8],
) -> Result<Vec<[u64; 3]>, StoreError> {
    let parts = record_parts_of(src, plan, l, e)?;
    let mut pos = 0usize;
    for (name, (_, shard, t, full)) in plan.parts.iter().map(|p| p.0).zip(&parts) {
        let part = &mut record[pos..pos + t.len as usize];
        shard.read_at(t.offset, part)?;
        if name.ends_with("weight_scale")
            && let Some(i) = crate::quant::nan_scale(part)
        {
            return Err(StoreError::Tensor {
                path: shard.path.clone(),
                tensor: full.clone(),
                msg: format!("layer {l} expert {e}: E8M0 scale byte {i} is 0xFF (NaN); the checkpoint is corrupt"),
            });
        }
        pos += t.len as usize;
    }
    Ok(merged_ranges(&parts))
}

/// The experts section from the shard headers alone, nothing read: checksums from `sums`
/// (`Given`), or 0 (`Absent`: a streaming store, whose presence map has each fetched record's).
fn locate_experts_by_header(
    src: &Source,
    plan: &ExpertPlan,
    sums: &ExpertSums,
) -> Result<(ExpertsInfo, usize), StoreError> {
    let mut layers = Vec::with_capacity(plan.moe_layers.len());
    let mut total_ranges = 0usize;
    for &l in &plan.moe_layers {
        let mut experts = Vec::with_capacity(plan.num_experts);
        for e in 0..plan.num_experts {
            let ranges = merged_ranges(&record_parts_of(src, plan, l, e)?);
            total_ranges += ranges.len();
            let xxh3 = match sums {
                ExpertSums::Given(m) => *m.get(&(l, e)).ok_or_else(|| StoreError::Store {
                    path: src.ck.dir.clone(),
                    msg: format!("no checksum was computed for layer {l} expert {e}"),
                })?,
                _ => 0,
            };
            experts.push(ExpertLocation { ranges, xxh3 });
        }
        layers.push(ExpertLayer { layer: l, experts });
    }
    let info = ExpertsInfo {
        layout: ExpertLayout::InPlace,
        format: "mxfp4".into(),
        record_bytes: plan.record_bytes,
        parts: plan.part_meta.clone(),
        files: src.shard_files.clone(),
        layers,
    };
    Ok((info, total_ranges))
}

/// One layer's packed expert file, `experts/layer-LLL.bin`, written record by record.
struct PackFile {
    /// Its index in the manifest's `experts.files`.
    index: usize,
    f: File,
    path: PathBuf,
}

impl PackFile {
    /// Create the file at its full size and append its name to `files`.
    fn create(to: &Path, layer: usize, size: u64, files: &mut Vec<String>) -> Result<Self, StoreError> {
        let rel = format!("experts/layer-{layer:03}.bin");
        let path = to.join(&rel);
        let f = File::create(&path).map_err(io_err(&path))?;
        f.set_len(size).map_err(io_err(&path))?;
        files.push(rel);
        Ok(PackFile { index: files.len() - 1, f, path })
    }

    /// Write a record at `at`; produces its one range.
    fn write(&self, at: u64, record: &[u8]) -> Result<[u64; 3], StoreError> {
        self.f.write_all_at(record, at).map_err(io_err(&self.path))?;
        Ok([self.index as u64, at, record.len() as u64])
    }

    /// Flush the file to disk once its layer is complete.
    fn sync(self) -> Result<(), StoreError> {
        self.f.sync_all().map_err(io_err(&self.path))
    }
}

/// Copy the tokenizer files the checkpoint has into the store; produces the manifest's
/// tokenizer section (`None` when it has none).
fn copy_tokenizer(from: &Path, to: &Path) -> Result<Option<TokenizerInfo>, StoreError> {
    let mut files = Vec::new();
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.exists() {
            let dst = to.join(name);
            // Copying a file onto itself truncates it (a link in the store pointing back into
            // the checkpoint would do that even when the directories differ).
            if dst.exists() && same_file(&src, &dst)? {
                return Err(StoreError::Store {
                    path: dst,
                    msg: format!("is the checkpoint's own {name}; refusing to copy it onto itself"),
                });
            }
            std::fs::copy(&src, &dst).map_err(io_err(&src))?;
            files.push(name.to_string());
        }
    }
    Ok(if files.is_empty() { None } else { Some(TokenizerInfo { files }) })
}

/// Write `manifest.json` (atomically, by rename) describing the source and what the steps
/// before produced.
fn write_manifest(
    from: &Path,
    to: &Path,
    src: &Source,
    spine: SpineInfo,
    experts: ExpertsInfo,
    tokenizer: Option<TokenizerInfo>,
    opts: &ConvertOptions,
) -> Result<(), StoreError> {
    let abs_dir = std::fs::canonicalize(from).map_err(io_err(from))?;
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        arch: "kimi_k3".into(),
        config: src.ck.config.clone(),
        source: SourceInfo {
            dir: abs_dir.to_string_lossy().into_owned(),
            prefix: src.prefix.into(),
            shards: src
                .ck
                .shards
                .iter()
                .zip(&src.shard_files)
                .map(|(s, f)| SourceShard { file: f.clone(), size: s.file_len, header_xxh3: s.header_hash })
                .collect(),
        },
        spine,
        experts,
        tokenizer,
        origin: opts.origin.clone(),
        streaming: opts.streaming.clone(),
    };
    manifest.save(to)
}
