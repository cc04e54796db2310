//! The tiktoken-format tokenizer against ids from the Python `tiktoken` package (recorded in
//! each fixture's `tokenizer_check.json` with K3's pre-tokenisation regex), on English, digits,
//! whitespace runs, contractions, mixed scripts (Han, accents, emoji) and special tokens.

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use common::*;
use deltafin_text::tokenizer::{K3_PATTERN, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    #[serde(default)]
    allowed_special: Option<String>,
}

#[derive(Deserialize)]
struct Check {
    pat_str: String,
    cases: Vec<Case>,
}

#[test]
fn matches_python_tiktoken() {
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let check: Check =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_check.json")).unwrap()).unwrap();
        assert_eq!(check.pat_str, K3_PATTERN, "the fixture was made with K3's regex");
        let tok = Tokenizer::load(&dir.join("hf")).unwrap();
        assert!(check.cases.len() >= 6);
        for c in &check.cases {
            let got = match c.allowed_special.as_deref() {
                Some("all") => tok.encode(&c.text),
                _ => tok.encode_ordinary(&c.text),
            };
            assert_eq!(got, c.ids, "{name}: {:?}", c.text);
            assert_eq!(tok.decode(&got), c.text, "{name}: round trip of {:?}", c.text);
        }
        assert_eq!(tok.eos_id, Some(tok.specials["<|end_of_msg|>"]), "generation stops on <|end_of_msg|>");
    }
}

#[test]
fn bad_tokenizer_files_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("tiktoken.model"), "IQ== 0\nIQ== 1\n").unwrap();
    let msg = Tokenizer::load(tmp.path()).err().unwrap().to_string();
    assert!(msg.contains("appear twice"), "{msg}");
    std::fs::write(tmp.path().join("tiktoken.model"), "!!notbase64 0\n").unwrap();
    let msg = Tokenizer::load(tmp.path()).err().unwrap().to_string();
    assert!(msg.contains("base64"), "{msg}");
    std::fs::write(tmp.path().join("tiktoken.model"), "IQ== x\n").unwrap();
    let msg = Tokenizer::load(tmp.path()).err().unwrap().to_string();
    assert!(msg.contains("rank"), "{msg}");
}

/// Files that loaded before but made `encode` panic (a byte without a token), loop forever (an
/// empty special token) or misread ids; found by the fuzzer (fixtures/fuzz/tokenizer_load).
#[test]
fn tokenizer_files_that_would_break_encoding_are_errors() {
    let hf = fixture_dir("k3-tiny").join("hf");
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&hf, tmp.path());
    let model = std::fs::read_to_string(hf.join("tiktoken.model")).unwrap();
    let config = std::fs::read_to_string(hf.join("tokenizer_config.json")).unwrap();
    let load_err = |file: &str, text: &str| {
        std::fs::write(tmp.path().join(file), text).unwrap();
        let msg = Tokenizer::load(tmp.path()).err().map(|e| format!("{e:#}"));
        copy_dir(&hf, tmp.path());
        msg.unwrap_or_else(|| panic!("{file} {text:?} must be refused"))
    };
    let without_a: String = model.lines().filter(|l| !l.starts_with("YQ== ")).map(|l| format!("{l}\n")).collect();
    let msg = load_err("tiktoken.model", &without_a);
    assert!(msg.contains("byte 0x61 has no token"), "{msg}");
    let msg = load_err("tokenizer_config.json", r#"{"added_tokens_decoder": {"300": {"content": ""}}}"#);
    assert!(msg.contains("empty content"), "{msg}");
    let msg = load_err(
        "tokenizer_config.json",
        r#"{"added_tokens_decoder": {"300": {"content": "[A]"}, "0300": {"content": "[B]"}}}"#,
    );
    assert!(msg.contains("special token 300 collides"), "{msg}");
    let msg = load_err(
        "tokenizer_config.json",
        r#"{"added_tokens_decoder": {"300": {"content": "[A]"}, "301": {"content": "[A]"}}}"#,
    );
    assert!(msg.contains("appears twice"), "{msg}");
    let msg = load_err("generation_config.json", r#"{"eos_token_id": 4294967598}"#);
    assert!(msg.contains("eos_token_id 4294967598"), "{msg}");
    // The fixture itself still loads, and a tokenizer without special tokens encodes.
    assert!(config.contains("<|open|>"));
    std::fs::remove_file(tmp.path().join("tokenizer_config.json")).unwrap();
    let tok = Tokenizer::load(tmp.path()).unwrap();
    assert_eq!(tok.decode(&tok.encode("<|open|> text")), "<|open|> text");
}
