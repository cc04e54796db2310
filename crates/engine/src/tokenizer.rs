//! Kimi's tiktoken-format tokenizer: `tiktoken.model` (`base64(bytes) rank` per line) with K3's
//! pre-tokenisation regex, plus the special tokens of `tokenizer_config.json`.
//!
//! Encoding goes through `tiktoken-rs`'s byte-pair encoder. Decoding is a table lookup done here
//! so that a token sequence that splits a UTF-8 character decodes lossily instead of failing.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

/// K3's pre-tokenisation pattern (needs class intersection `&&` and a `(?!\S)` look-ahead).
pub const K3_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+"
);

pub struct Tokenizer {
    bpe: CoreBPE,
    /// id -> bytes for ordinary ranks and special tokens alike.
    decoder: HashMap<u32, Vec<u8>>,
    pub specials: HashMap<String, u32>,
    pub eos_id: Option<u32>,
}

impl Tokenizer {
    /// Load from a directory holding `tiktoken.model`, and optionally `tokenizer_config.json` and
    /// `generation_config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let model_path = dir.join("tiktoken.model");
        let text = std::fs::read_to_string(&model_path).with_context(|| format!("reading {}", model_path.display()))?;
        let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        let mut decoder: HashMap<u32, Vec<u8>> = HashMap::new();
        for (ln, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let mut it = line.split_whitespace();
            let (Some(b64), Some(rank), None) = (it.next(), it.next(), it.next()) else {
                bail!("{}:{}: expected 'base64 rank'", model_path.display(), ln + 1);
            };
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .with_context(|| format!("{}:{}: bad base64", model_path.display(), ln + 1))?;
            let rank: u32 =
                rank.parse().with_context(|| format!("{}:{}: bad rank '{rank}'", model_path.display(), ln + 1))?;
            if decoder.insert(rank, bytes.clone()).is_some() {
                bail!("{}:{}: rank {rank} appears twice", model_path.display(), ln + 1);
            }
            if encoder.insert(bytes, rank).is_some() {
                bail!("{}:{}: token bytes appear twice", model_path.display(), ln + 1);
            }
        }
        let mut specials: HashMap<String, u32> = HashMap::new();
        let cfg_path = dir.join("tokenizer_config.json");
        if cfg_path.exists() {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)
                .with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
            if let Some(obj) = v.get("added_tokens_decoder").and_then(|a| a.as_object()) {
                for (id, entry) in obj {
                    let id: u32 = id.parse().with_context(|| format!("{}: bad token id '{id}'", cfg_path.display()))?;
                    let content = entry
                        .get("content")
                        .and_then(|c| c.as_str())
                        .with_context(|| format!("{}: token {id} has no content", cfg_path.display()))?;
                    if decoder.contains_key(&id) {
                        bail!("{}: special token {id} collides with an ordinary rank", cfg_path.display());
                    }
                    specials.insert(content.to_string(), id);
                    decoder.insert(id, content.as_bytes().to_vec());
                }
            }
        }
        let gen_path = dir.join("generation_config.json");
        let eos_id = if gen_path.exists() {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&gen_path)?)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?;
            match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| n as u32),
                Some(serde_json::Value::Array(a)) => a.first().and_then(|n| n.as_u64()).map(|n| n as u32),
                _ => None,
            }
        } else {
            None
        };
        let special_enc: FxHashMap<String, u32> = specials.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let bpe = CoreBPE::new(encoder, special_enc, K3_PATTERN)
            .map_err(|e| anyhow::anyhow!("building the tokenizer: {e}"))?;
        Ok(Tokenizer { bpe, decoder, specials, eos_id })
    }

    /// Encode text; special-token strings in it become their ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special_tokens(text)
    }

    /// Encode text treating special-token strings as plain text.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|id| self.decoder.get(id).cloned().unwrap_or_default()).collect()
    }

    /// Decode to text, replacing invalid UTF-8 (a split character) with U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }
}
