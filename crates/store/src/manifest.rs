//! The store's self-describing manifest (`manifest.json`), replaced atomically by rename.

use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

use crate::config::K3Config;
use crate::error::{StoreError, io_err};

pub const FORMAT_NAME: &str = "deltafin-store";
pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Architecture family: `kimi_k3`.
    pub arch: String,
    pub config: K3Config,
    pub source: SourceInfo,
    pub spine: SpineInfo,
    pub experts: ExpertsInfo,
    #[serde(default)]
    pub tokenizer: Option<TokenizerInfo>,
    /// Where the checkpoint came from, for stores made by `deltafin install`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<OriginInfo>,
    /// Present while the store streams its experts from the origin (`install --mode stream`):
    /// routed experts may be absent, and a present one's checksum is in the presence map, not
    /// in `experts.layers` (whose `xxh3` fields are 0 until the store is full).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streaming: Option<StreamingInfo>,
}

/// The origin a store was installed from, pinned to one commit.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OriginInfo {
    /// `hub` (the Hugging Face Hub API and URL layout) or `mirror` (a plain HTTP directory of a
    /// snapshot's files).
    pub kind: String,
    /// The endpoint it was installed from (the default for later fetches).
    pub endpoint: String,
    pub repo: String,
    /// The revision asked for (a branch, tag or commit).
    pub revision: String,
    /// The commit every file was fetched at.
    pub commit: String,
    pub files: Vec<OriginFile>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OriginFile {
    pub name: String,
    pub size: u64,
    /// The origin's sha256 (LFS files on the Hub; a mirror's SHA256SUMS).
    #[serde(default)]
    pub sha256: Option<String>,
    /// The Hub's blob id (the name of the file's blob in a Hub cache).
    #[serde(default)]
    pub blob: Option<String>,
    /// A mirror's validator of the file when the install pinned it (its ETag, else its
    /// Last-Modified): every later response must carry the same, or the file has changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validator: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StreamingInfo {
    /// The presence map, relative to the store.
    pub presence_file: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourceInfo {
    /// Absolute path of the checkpoint directory at conversion time.
    pub dir: String,
    /// Tensor-name prefix of the text model (`language_model.model.`).
    pub prefix: String,
    pub shards: Vec<SourceShard>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SourceShard {
    pub file: String,
    pub size: u64,
    /// xxh3-64 of the shard's JSON header: cheap to re-check at every open.
    pub header_xxh3: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpineDtype {
    Int8,
    Bf16,
    F32,
}

impl SpineDtype {
    /// Bytes per stored element (int8's scales aside).
    pub fn element_bytes(self) -> usize {
        match self {
            SpineDtype::Int8 => 1,
            SpineDtype::Bf16 => 2,
            SpineDtype::F32 => 4,
        }
    }
}

impl std::str::FromStr for SpineDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "int8" => Ok(SpineDtype::Int8),
            "bf16" => Ok(SpineDtype::Bf16),
            "f32" => Ok(SpineDtype::F32),
            _ => Err(format!("unknown spine dtype '{s}' (expected int8, bf16 or f32)")),
        }
    }
}

/// How `convert` picks the spine matrices' precision (`convert --spine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpinePrecision {
    /// This dtype, whatever the machine.
    Fixed(SpineDtype),
    /// The checkpoint's own precision, bf16, when the bf16 spine takes at most half of `budget`
    /// (the memory the runtime will plan with), else int8. On the trained demo model int8 flips
    /// the top token at 2-2.5% of positions, almost all through changed expert choices
    /// (docs/numerics.md, "Spine quantisation"), so int8 is what a machine takes when it must, not the
    /// default where bf16 fits with as much memory again left for the expert cache.
    Auto { budget: u64 },
}

impl From<SpineDtype> for SpinePrecision {
    fn from(d: SpineDtype) -> Self {
        SpinePrecision::Fixed(d)
    }
}

impl SpinePrecision {
    /// Whether a store whose spine section is `spine` holds what this asks for: the fixed
    /// dtype; for `auto`, what the rule picks with a bf16 spine of `bf16_bytes` (an estimate
    /// is enough: a store converted by auto before keeps its choice, so that a resumed install
    /// does not decide again).
    pub fn matches(&self, spine: &SpineInfo, bf16_bytes: u64) -> bool {
        match self {
            SpinePrecision::Fixed(d) => spine.matrix_dtype == *d,
            SpinePrecision::Auto { budget } => {
                spine.auto.is_some() || spine.matrix_dtype == SpineAuto { budget: *budget, bf16_bytes }.choose()
            }
        }
    }
}

impl SpineInfo {
    /// How to convert again as this spine was converted (auto weighs the same checkpoint
    /// against the same budget, so it chooses the same).
    pub fn precision(&self) -> SpinePrecision {
        match self.auto {
            Some(a) => SpinePrecision::Auto { budget: a.budget },
            None => SpinePrecision::Fixed(self.matrix_dtype),
        }
    }
}

/// What `--spine auto` weighed, recorded in the manifest beside the dtype it chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpineAuto {
    /// The memory budget it was given.
    pub budget: u64,
    /// The spine's size with bf16 matrices.
    pub bf16_bytes: u64,
}

impl SpineAuto {
    /// The rule: bf16 when its spine takes at most half the budget.
    pub fn choose(self) -> SpineDtype {
        if self.bf16_bytes <= self.budget / 2 { SpineDtype::Bf16 } else { SpineDtype::Int8 }
    }

    /// The choice and its reason, in words.
    pub fn describe(self) -> String {
        let h = crate::progress::human;
        match self.choose() {
            SpineDtype::Bf16 => format!(
                "bf16 (Kimi K3's checkpoint precision): a bf16 spine ({}) takes at most half the memory budget ({})",
                h(self.bf16_bytes),
                h(self.budget)
            ),
            _ => format!(
                "int8: a bf16 spine ({}) would take more than half the memory budget ({}); --spine bf16 keeps it anyway",
                h(self.bf16_bytes),
                h(self.budget)
            ),
        }
    }
}

/// Spine matrices whose store name contains `pattern` are stored as `dtype` whatever the
/// spine's dtype is: the few sensitive matrices a mixed-precision spine keeps wider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepRule {
    pub pattern: String,
    pub dtype: SpineDtype,
}

impl std::str::FromStr for KeepRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (pattern, dtype) =
            s.rsplit_once('=').ok_or_else(|| format!("'{s}' is not NAME=DTYPE (for example lm_head=bf16)"))?;
        if pattern.is_empty() {
            return Err(format!("'{s}' names no tensor (NAME=DTYPE, NAME part of a spine tensor's name)"));
        }
        Ok(KeepRule { pattern: pattern.to_string(), dtype: dtype.parse()? })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpineInfo {
    pub file: String,
    /// The dtype requested for matrices; vectors are always f32.
    pub matrix_dtype: SpineDtype,
    /// int8 group size requested (0 = per row).
    #[serde(default)]
    pub int8_group: usize,
    /// The router gates were kept in f32 (`convert --router-f32`).
    #[serde(default)]
    pub router_f32: bool,
    /// Matrices kept at another precision than `matrix_dtype` (`convert --keep NAME=DTYPE`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keep: Vec<KeepRule>,
    /// Set when `convert --spine auto` chose `matrix_dtype`: what it weighed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto: Option<SpineAuto>,
    pub bytes: u64,
    pub tensors: Vec<SpineTensor>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SpineTensor {
    pub name: String,
    pub layer: Option<usize>,
    pub dtype: SpineDtype,
    pub shape: Vec<usize>,
    pub offset: u64,
    pub len: u64,
    /// int8 only: f32 scales `[rows, cols/group]` at this offset.
    #[serde(default)]
    pub scales_offset: u64,
    #[serde(default)]
    pub scales_len: u64,
    #[serde(default)]
    pub group: usize,
    /// xxh3-64 over data then scales.
    pub xxh3: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertLayout {
    InPlace,
    Pack,
}

impl std::str::FromStr for ExpertLayout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "in-place" => Ok(ExpertLayout::InPlace),
            "pack" => Ok(ExpertLayout::Pack),
            _ => Err(format!("unknown expert layout '{s}' (expected in-place or pack)")),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExpertsInfo {
    pub layout: ExpertLayout,
    /// `mxfp4` (compressed-tensors pack-quantized, group 32, E8M0 scales).
    pub format: String,
    /// Bytes of one canonical record: the six tensors back to back in `parts` order.
    pub record_bytes: u64,
    pub parts: Vec<ExpertPart>,
    /// Files the ranges point into. In place: checkpoint shard names (relative to `source.dir`);
    /// packed: files relative to the store.
    pub files: Vec<String>,
    pub layers: Vec<ExpertLayer>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExpertPart {
    pub name: String,
    pub shape: [usize; 2],
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExpertLayer {
    pub layer: usize,
    pub experts: Vec<ExpertLocation>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExpertLocation {
    /// Byte ranges `[file index, offset, length]` whose concatenation is the canonical record.
    /// One range when the checkpoint keeps the expert contiguous (K3 does).
    pub ranges: Vec<[u64; 3]>,
    /// xxh3-64 of the canonical record.
    pub xxh3: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// Files copied into the store (tiktoken.model, tokenizer_config.json, generation_config.json).
    pub files: Vec<String>,
}

impl Manifest {
    pub fn load(store: &Path) -> Result<Self, StoreError> {
        let path = store.join(MANIFEST_FILE);
        if !path.exists() {
            return Err(StoreError::Store { path: store.to_path_buf(), msg: not_a_store(store) });
        }
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| StoreError::Store { path: path.clone(), msg: format!("manifest is not valid: {e}") })?;
        if m.format != FORMAT_NAME {
            return Err(StoreError::Store { path, msg: format!("format '{}' is not a Deltafin store", m.format) });
        }
        if m.version != FORMAT_VERSION {
            return Err(StoreError::Store {
                path,
                msg: format!("store format version {} is not supported (this build reads {FORMAT_VERSION})", m.version),
            });
        }
        m.config.validate(&path.display().to_string())?;
        m.check_file_names().map_err(|msg| StoreError::Store { path: path.clone(), msg })?;
        m.check_expert_table().map_err(|msg| StoreError::Store { path: path.clone(), msg })?;
        Ok(m)
    }

    /// Every file name is joined to a directory (the store, or the checkpoint for shards), so
    /// each must stay inside it: a hand-edited or hostile manifest must not make the store read
    /// (or the tokenizer load) files elsewhere.
    fn check_file_names(&self) -> Result<(), String> {
        check_inside("spine.file", &self.spine.file)?;
        for (i, f) in self.experts.files.iter().enumerate() {
            check_inside(&format!("experts.files[{i}]"), f)?;
        }
        for (i, s) in self.source.shards.iter().enumerate() {
            check_inside(&format!("source.shards[{i}].file"), &s.file)?;
        }
        for (i, f) in self.tokenizer.iter().flat_map(|t| t.files.iter()).enumerate() {
            check_inside(&format!("tokenizer.files[{i}]"), f)?;
        }
        if let Some(s) = &self.streaming {
            check_inside("streaming.presence_file", &s.presence_file)?;
        }
        Ok(())
    }

    /// The routed-expert table against the config and itself (file sizes are checked by
    /// `Store::open`): the record layout is the one the config implies, every MoE layer has one
    /// location per expert, and every location's ranges name a listed file, do not overflow and
    /// add up to exactly one record. Readers then size buffers and slice records without
    /// re-checking.
    fn check_expert_table(&self) -> Result<(), String> {
        let ex = &self.experts;
        let (parts, record_bytes) = record_parts(&crate::schema::expert_parts(&self.config));
        if ex.record_bytes != record_bytes {
            return Err(format!(
                "experts.record_bytes is {} but the config's MXFP4 expert record is {record_bytes} bytes",
                ex.record_bytes
            ));
        }
        if ex.parts != parts {
            return Err("experts.parts is not the record layout the config implies".into());
        }
        let listed: Vec<usize> = ex.layers.iter().map(|l| l.layer).collect();
        let moe = self.config.moe_layers();
        if listed != moe {
            return Err(format!("experts.layers lists layers {listed:?}; the config's MoE layers are {moe:?}"));
        }
        let n = self.config.num_experts;
        for layer in &ex.layers {
            let l = layer.layer;
            if layer.experts.len() != n {
                return Err(format!(
                    "experts.layers: layer {l} has {} experts; the config has {n}",
                    layer.experts.len()
                ));
            }
            for (e, loc) in layer.experts.iter().enumerate() {
                let at = |msg: String| format!("experts.layers: layer {l} expert {e}: {msg}");
                if loc.ranges.is_empty() {
                    return Err(at("has no byte ranges".into()));
                }
                let mut total = 0u64;
                for (i, &[f, off, len]) in loc.ranges.iter().enumerate() {
                    if f >= ex.files.len() as u64 {
                        return Err(at(format!(
                            "range {i} names file {f}, but experts.files has {} files",
                            ex.files.len()
                        )));
                    }
                    if off.checked_add(len).is_none() {
                        return Err(at(format!("range {i} [{f}, {off}, {len}] runs past the end of any file")));
                    }
                    total = total.saturating_add(len);
                }
                if total != record_bytes {
                    return Err(at(format!("byte ranges cover {total} bytes; a record is {record_bytes}")));
                }
            }
        }
        Ok(())
    }

    /// Write to a temporary file, sync, then rename over the old manifest: readers see the old or
    /// the new manifest, never half of one.
    pub fn save(&self, store: &Path) -> Result<(), StoreError> {
        let path = store.join(MANIFEST_FILE);
        let tmp = store.join(".manifest.json.tmp");
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| StoreError::Store { path: path.clone(), msg: e.to_string() })?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
            f.write_all(&text).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
        Ok(())
    }
}

/// A manifest file name must be a plain relative path: not empty, not absolute, only normal
/// components (no `..`, no leading `.`; `Path` drops inner ones), so joining it to its directory
/// stays inside that directory.
fn check_inside(field: &str, name: &str) -> Result<(), String> {
    let plain = !name.is_empty() && Path::new(name).components().all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(())
    } else {
        Err(format!(
            "{field} '{name}' is not a relative path inside its directory (empty, absolute, or with '.' or '..')"
        ))
    }
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

/// What to do with a directory that has no manifest: a Hugging Face checkpoint is converted
/// first; anything else is not a store.
fn not_a_store(dir: &Path) -> String {
    let checkpoint = dir.join("config.json").is_file()
        && std::fs::read_dir(dir)
            .map(|es| es.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".safetensors")))
            .unwrap_or(false);
    if checkpoint {
        let d = dir.display();
        format!(
            "this is a Hugging Face checkpoint, not a Deltafin store; convert it first: \
             `deltafin convert --from {d} --to {d}-deltafin`, then pass --model {d}-deltafin"
        )
    } else if !dir.is_dir() {
        "no such directory: pass --model a Deltafin store (made by `deltafin convert` or `deltafin install`)".into()
    } else {
        format!(
            "no {MANIFEST_FILE}: not a Deltafin store (make one with `deltafin convert --from CHECKPOINT --to DIR` \
             or `deltafin install`)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spine(dtype: SpineDtype, auto: Option<SpineAuto>) -> SpineInfo {
        SpineInfo {
            file: "spine.bin".into(),
            matrix_dtype: dtype,
            int8_group: 0,
            router_f32: false,
            keep: Vec::new(),
            auto,
            bytes: 0,
            tensors: Vec::new(),
        }
    }

    #[test]
    fn auto_takes_bf16_up_to_half_the_budget() {
        assert_eq!(SpineAuto { budget: 200, bf16_bytes: 100 }.choose(), SpineDtype::Bf16);
        assert_eq!(SpineAuto { budget: 199, bf16_bytes: 100 }.choose(), SpineDtype::Int8);
        assert_eq!(SpineAuto { budget: 0, bf16_bytes: 1 }.choose(), SpineDtype::Int8);
        assert!(SpineAuto { budget: 199, bf16_bytes: 100 }.describe().starts_with("int8"));
    }

    /// A resumed install keeps what auto chose before, and a store converted without auto
    /// matches auto when it holds what auto would pick; a fixed dtype matches that dtype.
    #[test]
    fn precision_matches_what_was_converted() {
        let chose = Some(SpineAuto { budget: 1 << 30, bf16_bytes: 1 << 20 });
        // A budget under which auto would now pick int8 (bf16 of 1 MiB > half of 1 MiB).
        let auto = SpinePrecision::Auto { budget: 1 << 20 };
        let mib = 1 << 20;
        assert!(auto.matches(&spine(SpineDtype::Bf16, chose), mib), "chosen before: kept");
        assert!(auto.matches(&spine(SpineDtype::Int8, chose), mib));
        assert!(auto.matches(&spine(SpineDtype::Int8, None), mib), "int8 by hand, int8 by the rule");
        assert!(!auto.matches(&spine(SpineDtype::Bf16, None), mib), "bf16 by hand, int8 by the rule");
        assert!(SpinePrecision::Auto { budget: 1 << 30 }.matches(&spine(SpineDtype::Bf16, None), mib));
        let int8 = SpinePrecision::Fixed(SpineDtype::Int8);
        assert!(int8.matches(&spine(SpineDtype::Int8, None), mib));
        assert!(int8.matches(&spine(SpineDtype::Int8, chose), mib));
        assert!(!int8.matches(&spine(SpineDtype::Bf16, chose), mib));
        assert_eq!(spine(SpineDtype::Int8, chose).precision(), SpinePrecision::Auto { budget: 1 << 30 });
        assert_eq!(spine(SpineDtype::Int8, None).precision(), SpinePrecision::Fixed(SpineDtype::Int8));
    }

    #[test]
    fn a_checkpoint_given_as_a_store_says_to_convert_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("model-00001-of-00002.safetensors"), b"").unwrap();
        let e = Manifest::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("Hugging Face checkpoint") && e.contains("deltafin convert --from"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = Manifest::load(empty.path()).unwrap_err().to_string();
        assert!(e.contains("not a Deltafin store") && !e.contains("os error"), "{e}");
    }
}
