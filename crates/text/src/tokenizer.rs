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
    /// The special tokens' ids, sorted.
    special_ids: Vec<u32>,
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
        // The byte-pair encoder falls back to single bytes and indexes its table with them: a
        // byte without a token would panic there on the first text containing it.
        if let Some(b) = (0..=255u8).find(|&b| !encoder.contains_key(&[b][..])) {
            bail!("{}: byte 0x{b:02x} has no token (byte-level BPE needs all 256 single bytes)", model_path.display());
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
                        bail!(
                            "{}: special token {id} collides with an ordinary rank or another special",
                            cfg_path.display()
                        );
                    }
                    // An empty special matches everywhere: the encoder's special-token search
                    // would never advance.
                    if content.is_empty() {
                        bail!("{}: special token {id} has empty content", cfg_path.display());
                    }
                    if specials.insert(content.to_string(), id).is_some() {
                        bail!("{}: special token content {content:?} appears twice", cfg_path.display());
                    }
                    decoder.insert(id, content.as_bytes().to_vec());
                }
            }
        }
        let gen_path = dir.join("generation_config.json");
        let eos_id = if gen_path.exists() {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&gen_path)?)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?;
            let id = match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => n.as_u64(),
                Some(serde_json::Value::Array(a)) => a.first().and_then(|n| n.as_u64()),
                _ => None,
            };
            // Token ids are u32: a larger id names no token (truncating it would name another).
            match id.map(u32::try_from) {
                Some(Ok(id)) => Some(id),
                Some(Err(_)) => bail!("{}: eos_token_id {} is not a token id", gen_path.display(), id.unwrap_or(0)),
                None => None,
            }
        } else {
            None
        };
        let special_enc: FxHashMap<String, u32> = specials.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let bpe = CoreBPE::new(encoder, special_enc, K3_PATTERN)
            .map_err(|e| anyhow::anyhow!("building the tokenizer: {e}"))?;
        let mut special_ids: Vec<u32> = specials.values().copied().collect();
        special_ids.sort_unstable();
        Ok(Tokenizer { bpe, decoder, specials, special_ids, eos_id })
    }

    /// Encode text; special-token strings in it become their ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        split_long_runs(text).flat_map(|piece| self.bpe.encode_with_special_tokens(piece)).collect()
    }

    /// Encode text treating special-token strings as plain text.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        split_long_runs(text).flat_map(|piece| self.bpe.encode_ordinary(piece)).collect()
    }

    /// One token's bytes (empty for an id the tokenizer does not know); no allocation.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.decoder.get(&id).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether `id` is one of the special tokens of `tokenizer_config.json`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }

    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|id| self.decoder.get(id).cloned().unwrap_or_default()).collect()
    }

    /// Decode to text, replacing invalid UTF-8 (a split character) with U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }
}

/// Longest run of whitespace or of non-whitespace encoded as one piece, and longest piece, as
/// Kimi's `tokenization_kimi.py` cuts them. Besides matching the reference, the cut bounds the
/// regex engine's backtracking depth and the byte-pair merge's quadratic cost on hostile input
/// (a megabyte of spaces otherwise overflows the regex engine's stack).
const MAX_RUN_CHARS: usize = 25_000;
const MAX_PIECE_CHARS: usize = 400_000;

/// Python's `str.isspace` (which, unlike `char::is_whitespace`, includes U+001C..U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Pieces of at most [`MAX_PIECE_CHARS`] characters, each further cut wherever a run of
/// whitespace or of non-whitespace exceeds [`MAX_RUN_CHARS`].
pub fn split_long_runs(text: &str) -> impl Iterator<Item = &str> {
    let mut pieces = Vec::new();
    if text.len() <= MAX_RUN_CHARS {
        pieces.push(text);
        return pieces.into_iter();
    }
    let mut chars_in_chunk = 0;
    let mut slice_start = 0;
    let mut run = 0;
    let mut run_is_space = text.chars().next().is_some_and(py_isspace);
    for (i, c) in text.char_indices() {
        if chars_in_chunk == MAX_PIECE_CHARS {
            // A new 400k-character chunk: runs restart.
            pieces.push(&text[slice_start..i]);
            slice_start = i;
            chars_in_chunk = 0;
            run = 0;
            run_is_space = py_isspace(c);
        }
        chars_in_chunk += 1;
        let space = py_isspace(c);
        if space != run_is_space {
            run = 1;
            run_is_space = space;
        } else {
            run += 1;
            if run > MAX_RUN_CHARS {
                pieces.push(&text[slice_start..i]);
                slice_start = i;
                run = 1;
            }
        }
    }
    pieces.push(&text[slice_start..]);
    pieces.into_iter()
}

/// Turns a stream of token bytes into text, holding back a character split across tokens until
/// its last byte arrives; invalid bytes become U+FFFD.
#[derive(Default)]
pub struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..good]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(n) => {
                            out.push('\u{fffd}');
                            self.pending.drain(..good + n);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is held, replaced where incomplete.
    pub fn flush(&mut self) -> String {
        String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_runs_are_cut_like_the_reference() {
        assert_eq!(split_long_runs("short text").collect::<Vec<_>>(), vec!["short text"]);
        let spaces = " ".repeat(60_000) + "x";
        let pieces: Vec<&str> = split_long_runs(&spaces).collect();
        assert_eq!(pieces.iter().map(|p| p.len()).collect::<Vec<_>>(), vec![25_000, 25_000, 10_001]);
        assert_eq!(pieces.concat(), spaces);
        // Alternating classes never reach the limit.
        let mixed = "ab ".repeat(20_000);
        assert_eq!(split_long_runs(&mixed).count(), 1);
        let wide = "é".repeat(30_000);
        let pieces: Vec<&str> = split_long_runs(&wide).collect();
        assert_eq!(pieces.iter().map(|p| p.chars().count()).collect::<Vec<_>>(), vec![25_000, 5_000]);
    }

    #[test]
    fn utf8_decoder_holds_split_characters() {
        let mut d = Utf8Decoder::default();
        let bytes = "a€b".as_bytes();
        assert_eq!(d.push(&bytes[..2]), "a");
        assert_eq!(d.push(&bytes[2..3]), "");
        assert_eq!(d.push(&bytes[3..]), "€b");
        assert_eq!(d.push(&[0xff, b'x', 0xe2]), "\u{fffd}x");
        assert_eq!(d.flush(), "\u{fffd}");
        assert!(d.is_empty());
    }
}
