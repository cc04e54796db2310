//! Kimi K3's text protocol, above the model: the tokenizer, the chat encoding (XTML) and the
//! incremental output parser, sampling, and the generation loop an API serves (stop strings,
//! log-probabilities, cancellation, prefix reuse). The engine below knows only token ids.

pub mod chat;
pub mod sample;
pub mod textgen;
pub mod tokenizer;
