//! Test instruments of `deltafin serve`, compiled only with the `test-instruments` feature (the
//! test suite's builds; release builds have neither the flags nor these code paths).
//!
//! - Scripted replies (`--script FILE`): the tiny fixtures' random weights cannot produce
//!   reasoning or tool calls, so when the last user text contains a trigger the sampled tokens are
//!   replaced by a reply's tokens, while the model still runs every step and everything after the
//!   sampler (parsing, streaming, both wire formats) is the production path.
//! - A step delay (`--token-delay-ms N`): the engine sleeps after every model step, holding it
//!   busy long enough for the concurrency tests to observe queueing deterministically.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use deltafin_text::tokenizer::Tokenizer;

/// What the test flags asked for.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Sleep after every model step.
    pub step_delay: Duration,
    /// Scripted replies file (see [`load_script`]).
    pub script: Option<PathBuf>,
}

/// A scripted reply: when the last user text contains `when`, the model's sampled tokens are
/// replaced by `tokens`.
pub struct ScriptedReply {
    pub when: String,
    pub tokens: Vec<u32>,
}

/// Load the scripted replies file: `{"replies": [{"when": "...", "text": "..."}]}`.
pub fn load_script(path: &Path, tok: &Tokenizer) -> Result<Vec<ScriptedReply>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    let replies = v.get("replies").and_then(|r| r.as_array()).context("the script needs a 'replies' array")?;
    replies
        .iter()
        .map(|r| {
            let when = r.get("when").and_then(|w| w.as_str()).context("each reply needs a string 'when'")?;
            let text = r.get("text").and_then(|w| w.as_str()).context("each reply needs a string 'text'")?;
            Ok(ScriptedReply { when: when.to_string(), tokens: tok.encode(text) })
        })
        .collect()
}

/// The tokens of the first reply whose trigger `text` contains.
pub fn scripted(script: &[ScriptedReply], text: &str) -> Option<Vec<u32>> {
    script.iter().find(|s| text.contains(&s.when)).map(|s| s.tokens.clone())
}
