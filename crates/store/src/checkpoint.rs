//! A Hugging Face checkpoint directory in Kimi K3's layout: `config.json` (with `text_config`),
//! `model.safetensors.index.json` and its shards, tensors under the `language_model.` prefix.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::Dtype;

use crate::config::K3Config;
use crate::error::{StoreError, io_err};
use crate::shard::{Shard, TensorEntry};

/// Where the text model's tensors live in a K3 release.
pub const K3_TEXT_PREFIX: &str = "language_model.model.";

/// The text model's tensor prefix, from a checkpoint's tensor names: K3 releases use
/// `language_model.model.`; a plain `kimi_linear` checkpoint uses `model.`.
pub fn text_prefix<'a>(mut names: impl Iterator<Item = &'a str>) -> &'static str {
    if names.any(|k| k.starts_with(K3_TEXT_PREFIX)) { K3_TEXT_PREFIX } else { "model." }
}
pub const K3_HEAD_NAME: &str = "language_model.lm_head.weight";

pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: K3Config,
    /// Shard files in index order (sorted by file name), opened.
    pub shards: Vec<Shard>,
    /// Full tensor name -> shard index.
    pub weight_map: BTreeMap<String, usize>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let cfg_path = dir.join("config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
        let config = K3Config::from_hf_json(&cfg_text, &cfg_path.display().to_string())?;

        let index_path = dir.join("model.safetensors.index.json");
        let mut files: Vec<String> = Vec::new();
        let mut map_by_file: BTreeMap<String, String> = BTreeMap::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(io_err(&index_path))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| StoreError::Config {
                file: index_path.display().to_string(),
                msg: format!("not valid JSON: {e}"),
            })?;
            let wm = v.get("weight_map").and_then(|w| w.as_object()).ok_or_else(|| StoreError::Config {
                file: index_path.display().to_string(),
                msg: "missing object 'weight_map'".into(),
            })?;
            // An empty map names no shard: there would be nothing to open (and no shard 0 to
            // fall back on).
            if wm.is_empty() {
                return Err(StoreError::Config {
                    file: index_path.display().to_string(),
                    msg: "'weight_map' is empty: the index lists no tensors".into(),
                });
            }
            for (name, file) in wm {
                let file = file.as_str().ok_or_else(|| StoreError::Config {
                    file: index_path.display().to_string(),
                    msg: format!("weight_map['{name}'] is not a file name"),
                })?;
                if file.is_empty() || file == "." || file.contains('/') || file.contains("..") {
                    return Err(StoreError::Config {
                        file: index_path.display().to_string(),
                        msg: format!("weight_map['{name}'] names '{file}', outside the checkpoint directory"),
                    });
                }
                map_by_file.insert(name.clone(), file.to_string());
                if !files.contains(&file.to_string()) {
                    files.push(file.to_string());
                }
            }
        } else if dir.join("model.safetensors").exists() {
            files.push("model.safetensors".into());
        } else {
            return Err(StoreError::Config {
                file: dir.display().to_string(),
                msg: "no model.safetensors.index.json and no model.safetensors".into(),
            });
        }
        files.sort();
        let mut shards = Vec::with_capacity(files.len());
        for f in &files {
            shards.push(Shard::open(&dir.join(f))?);
        }
        let mut weight_map = BTreeMap::new();
        if map_by_file.is_empty() {
            // Only a lone `model.safetensors` gets here (an index lists at least one tensor).
            for t in shards.iter().take(1).flat_map(|s| &s.tensors) {
                weight_map.insert(t.name.clone(), 0);
            }
        } else {
            for (name, file) in &map_by_file {
                // Every file of the map was pushed onto `files` above.
                let si = files.iter().position(|f| f == file).unwrap_or(0);
                if shards[si].get(name).is_none() {
                    return Err(StoreError::Tensor {
                        path: shards[si].path.clone(),
                        tensor: name.clone(),
                        msg: "listed in model.safetensors.index.json but absent from this shard".into(),
                    });
                }
                weight_map.insert(name.clone(), si);
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), config, shards, weight_map })
    }

    /// Look a tensor up by its full name.
    pub fn find(&self, name: &str) -> Result<(&Shard, &TensorEntry), StoreError> {
        let si = *self
            .weight_map
            .get(name)
            .ok_or_else(|| StoreError::MissingTensor { dir: self.dir.clone(), tensor: name.into() })?;
        let shard = &self.shards[si];
        let t =
            shard.get(name).ok_or_else(|| StoreError::MissingTensor { dir: self.dir.clone(), tensor: name.into() })?;
        Ok((shard, t))
    }

    /// Look up a tensor and check its shape and dtype class.
    pub fn expect(&self, name: &str, shape: &[usize], dtypes: &[Dtype]) -> Result<(&Shard, &TensorEntry), StoreError> {
        let (s, t) = self.find(name)?;
        if t.shape != shape {
            return Err(StoreError::Tensor {
                path: s.path.clone(),
                tensor: name.into(),
                msg: format!("shape {:?} does not match the config, which implies {:?}", t.shape, shape),
            });
        }
        if !dtypes.contains(&t.dtype) {
            return Err(StoreError::Tensor {
                path: s.path.clone(),
                tensor: name.into(),
                msg: format!("dtype {:?} is not one of {:?}", t.dtype, dtypes),
            });
        }
        Ok((s, t))
    }
}

/// Decode a float tensor's bytes (F32, BF16 or F16, little-endian) to f32.
pub fn bytes_to_f32(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> Result<(), String> {
    out.clear();
    match dtype {
        Dtype::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        Dtype::BF16 => out.extend(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())),
        Dtype::F16 => out.extend(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
        other => return Err(format!("dtype {other:?} is not a float type")),
    }
    Ok(())
}
