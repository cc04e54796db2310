//! Test instruments of `deltafin serve`, compiled only with the `test-instruments` feature (the
//! test suite's builds; release builds have neither the flags nor these code paths).
//!
//! - Scripted replies (`--script FILE`): the tiny fixtures' random weights cannot produce
//!   reasoning or tool calls, so when the tool results that end the conversation, or else the
//!   last user text, contain a trigger the sampled tokens are replaced by a reply's tokens, while the model still runs every step and everything after the
//!   sampler (parsing, streaming, both wire formats) is the production path.
//! - A step delay (`--token-delay-ms N`): the engine sleeps after every model step, holding it
//!   busy long enough for the concurrency tests to observe queueing deterministically.
//! - A load delay (`--load-delay-ms N`): the engine thread sleeps before opening the model, so
//!   that the tests see the server listening and answering `loading` first.
//! - Injected faults (`--inject-faults`): a prompt containing [`READ_FAULT_TRIGGER`] fails at its
//!   first MoE layer with a `ReadFault`, one containing [`ENGINE_ERROR_TRIGGER`] with a plain
//!   engine error; both carry a made-up server path ([`INJECTED_PATH`]) that must never reach
//!   the client. The real expert source is left untouched, so what follows (error mapping,
//!   reset, health, metrics) is the production path.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use deltafin_engine::experts::ExpertSource;
use deltafin_engine::fault::{FaultKind, FaultStats, ReadFault};
use deltafin_text::tokenizer::Tokenizer;

/// What the test flags asked for.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Sleep after every model step.
    pub step_delay: Duration,
    /// Scripted replies file (see [`load_script`]).
    pub script: Option<PathBuf>,
    /// Fail requests whose prompt holds a fault trigger.
    pub inject_faults: bool,
    /// Sleep this long before loading the model (the loading phase, observable).
    pub load_delay: Duration,
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

/// A prompt containing this fails with a checksum `ReadFault`.
pub const READ_FAULT_TRIGGER: &str = "inject-read-fault";
/// A prompt containing this fails with an engine error that is not a read fault.
pub const ENGINE_ERROR_TRIGGER: &str = "inject-engine-error";
/// The path injected errors name: the client must never see it.
pub const INJECTED_PATH: &str = "/srv/deltafin-injected/store";

/// Which fault a prompt asks for.
#[derive(Debug, Clone, Copy)]
pub enum Injected {
    ReadFault,
    EngineError,
}

/// The fault a prompt's text triggers, if any.
pub fn injected_fault(tok: &Tokenizer, prompt: &[u32]) -> Option<Injected> {
    let text = tok.decode(prompt);
    if text.contains(READ_FAULT_TRIGGER) {
        Some(Injected::ReadFault)
    } else if text.contains(ENGINE_ERROR_TRIGGER) {
        Some(Injected::EngineError)
    } else {
        None
    }
}

/// The real expert source with one injected fault at the first layer the model asks for, before
/// the real source sees that request.
pub struct FaultyExperts<'a> {
    pub inner: &'a mut dyn ExpertSource,
    pub fault: Option<Injected>,
}

impl ExpertSource for FaultyExperts<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        match self.fault.take() {
            Some(Injected::ReadFault) => Err(anyhow::Error::new(ReadFault {
                layer,
                expert: experts.first().copied().unwrap_or(0),
                kind: FaultKind::Checksum,
                detail: format!("{INJECTED_PATH}/experts/layer-{layer:03}.bin: injected checksum mismatch"),
            })
            .context(format!("MoE layer {layer} of {INJECTED_PATH}"))),
            Some(Injected::EngineError) => {
                Err(anyhow::anyhow!("reading spine layer {layer} from {INJECTED_PATH}/spine.bin: injected I/O error"))
            }
            None => self.inner.begin(layer, experts),
        }
    }

    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
        self.inner.drain(f)
    }

    fn prefetch(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        self.inner.prefetch(layer, experts)
    }

    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }

    fn reset(&mut self) {
        self.inner.reset()
    }

    fn faults(&self) -> FaultStats {
        self.inner.faults()
    }

    fn read_ahead(&mut self, layer: usize) {
        self.inner.read_ahead(layer)
    }

    fn lend(&mut self, bytes: u64) -> u64 {
        self.inner.lend(bytes)
    }

    fn take_back(&mut self) {
        self.inner.take_back()
    }
}
