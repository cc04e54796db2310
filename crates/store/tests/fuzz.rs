//! Fuzzing the store's parsers of external files: safetensors shards, the checkpoint index,
//! `config.json` and the store's `manifest.json`. None may panic or allocate beyond what the
//! files on disk justify, whatever the bytes; a config that parses must describe a model whose
//! sizes the rest of the runtime can form without overflow.
//!
//! Harness, corpus and case counts: see `fuzzkit` (`DELTAFIN_FUZZ_CASES=N` to run long).

mod fuzzkit;

use std::path::{Path, PathBuf};

use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::config::limits;
use deltafin_store::convert::{ConvertOptions, convert};
use deltafin_store::schema::{ShapeRule, expert_parts, spine_specs};
use deltafin_store::shard::Shard;
use deltafin_store::{ExpertLayout, K3Config, SpineDtype, Store};
use fuzzkit::*;
use proptest::prelude::*;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CapAlloc = CapAlloc;

fn fixture_hf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/k3-tiny/hf")
}

/// The smallest real shard of the fixture: a valid header and its data.
const SEED_SHARD: &str = "model-00011-of-000011.safetensors";

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Safetensors shards

/// Open `bytes` as a shard and read every tensor it claims.
fn check_shard(path: &Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    std::fs::write(path, bytes).unwrap();
    bounded(|| {
        if let Ok(shard) = Shard::open(path) {
            for t in &shard.tensors {
                // The header was validated against the file, so each read is in bounds.
                let data = shard.read_tensor(t).expect("a validated tensor must be readable");
                assert_eq!(data.len() as u64, t.len);
            }
        }
    })
}

/// A shard assembled from a length field, a header and data, each possibly wrong.
fn assembled_shard() -> impl Strategy<Value = Vec<u8>> {
    const KEYS: &[&str] = &["dtype", "shape", "data_offsets", "__metadata__", "a", "b", "format"];
    const STRINGS: &[&str] = &["F32", "BF16", "U8", "F16", "I64", "F8_E4M3", "Q9", "pt", ""];
    let header = prop_oneof![
        json_value(KEYS, STRINGS).prop_map(|v| v.to_string()),
        ".{0,64}",
        (
            prop::sample::select(STRINGS),
            prop::collection::vec(interesting_u64(), 0..4),
            interesting_u64(),
            interesting_u64()
        )
            .prop_map(|(d, shape, b, e)| {
                json!({"t": {"dtype": d, "shape": shape, "data_offsets": [b, e]}}).to_string()
            }),
    ];
    (header, prop::option::of(interesting_u64()), prop::collection::vec(any::<u8>(), 0..256)).prop_map(
        |(h, len, data)| {
            let mut b = len.unwrap_or(h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(h.as_bytes());
            b.extend_from_slice(&data);
            b
        },
    )
}

#[test]
fn fuzz_shard() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let seed = std::fs::read(fixture_hf().join(SEED_SHARD)).unwrap();
    let strategy = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        assembled_shard(),
        byte_ops(6).prop_map(move |ops| {
            let mut b = seed.clone();
            apply_bytes(&mut b, &ops);
            b
        }),
    ];
    fuzz("shard", 1500, strategy, |b| check_shard(&path, b), |b| check_shard(&path, b));
}

// ---------------------------------------------------------------------------------------------
// The checkpoint index

const INDEX: &str = "model.safetensors.index.json";

/// Open a checkpoint whose index is `text`; when it opens, convert it (a mutated index can map
/// names to the wrong shards).
fn check_index(dir: &Path, out: &Path, text: &[u8]) -> Result<(), TestCaseError> {
    std::fs::write(dir.join(INDEX), text).unwrap();
    bounded(|| {
        if Checkpoint::open(dir).is_ok() {
            let opts = ConvertOptions {
                spine: SpineDtype::Int8.into(),
                int8_group: 0,
                experts: ExpertLayout::InPlace,
                progress: false,
                ..Default::default()
            };
            let _ = convert(dir, out, &opts);
        }
    })
}

#[test]
fn fuzz_index() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &dir);
    let out = tmp.path().join("store");
    let real: Value = serde_json::from_slice(&std::fs::read(dir.join(INDEX)).unwrap()).unwrap();
    const KEYS: &[&str] = &[
        "weight_map",
        "metadata",
        "total_size",
        "language_model.model.norm.weight",
        "language_model.model.embed_tokens.weight",
        "vision_tower.encoder.blocks.0.norm0.weight",
    ];
    const STRINGS: &[&str] = &[
        "model-00001-of-000011.safetensors",
        "model-00011-of-000011.safetensors",
        "model.safetensors",
        "config.json",
        "tiktoken.model",
        "../model-00001-of-000011.safetensors",
        "/etc/passwd",
        ".",
        "..",
        "",
        "a/b",
        "missing.safetensors",
    ];
    let values = json_value(KEYS, STRINGS);
    let strategy = prop_oneof![
        2 => json_value(KEYS, STRINGS).prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..128),
        4 => prop::collection::vec(json_op(values), 1..4).prop_map(move |ops| {
            let mut v = real.clone();
            apply_json(&mut v, &ops);
            v.to_string().into_bytes()
        }),
    ];
    fuzz("index", 150, strategy, |t| check_index(&dir, &out, t), |t| check_index(&dir, &out, t));
}

// ---------------------------------------------------------------------------------------------
// config.json

/// Parse a config; when it is accepted, form every size the store and engine derive from it.
fn check_config(text: &[u8]) -> Result<(), TestCaseError> {
    bounded(|| {
        let Ok(text) = std::str::from_utf8(text) else { return };
        let Ok(c) = K3Config::from_hf_json(text, "config.json") else { return };
        for s in spine_specs(&c) {
            let numel: u128 = match &s.shape {
                ShapeRule::Exact(d) => d.iter().map(|&x| x as u128).product(),
                ShapeRule::Numel(n) | ShapeRule::AtLeast(n) => *n as u128,
            };
            assert!(numel <= limits::TENSOR_ELEMS, "{} has {numel} elements", s.name);
        }
        let record: u128 = expert_parts(&c).iter().map(|(_, s)| s[0] as u128 * s[1] as u128).sum();
        assert!(record > 0 && record <= limits::RECORD_BYTES, "record of {record} bytes");
        assert!(c.num_experts_per_token >= 1 && c.num_experts_per_token <= c.num_experts);
        // What the engine's state, plan and blocks multiply (engine/src/plan.rs, blocks/).
        let lac = &c.linear_attn_config;
        let p = lac.num_heads.checked_mul(lac.head_dim).expect("heads x head_dim");
        p.checked_mul(lac.head_dim).and_then(|s| s.checked_add(3 * (lac.short_conv_kernel_size - 1) * p)).expect("KDA");
        let moe = c.moe_layers();
        for l in 0..c.num_hidden_layers {
            let _ = c.attn_kind(l);
        }
        assert!(moe.iter().all(|&l| l < c.num_hidden_layers));
    })
}

#[test]
fn fuzz_config() {
    let real: Value = serde_json::from_slice(&std::fs::read(fixture_hf().join("config.json")).unwrap()).unwrap();
    const KEYS: &[&str] = &[
        "text_config",
        "hidden_size",
        "vocab_size",
        "num_hidden_layers",
        "num_experts",
        "num_experts_per_token",
        "moe_intermediate_size",
        "linear_attn_config",
        "kda_layers",
        "num_heads",
        "head_dim",
    ];
    const STRINGS: &[&str] = &["situ", "sigmoid", "silu", "", "kimi_linear"];
    let values = prop_oneof![3 => interesting_number(), 1 => json_value(KEYS, STRINGS)].boxed();
    let strategy = prop_oneof![
        6 => prop::collection::vec(json_op(values), 1..5).prop_map(move |ops| {
            let mut v = real.clone();
            apply_json(&mut v, &ops);
            v.to_string().into_bytes()
        }),
        1 => json_value(KEYS, STRINGS).prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ];
    fuzz("config", 3000, strategy, |t| check_config(t), check_config);
}

// ---------------------------------------------------------------------------------------------
// manifest.json

/// A store converted from the fixture (the checkpoint kept beside it for in-place experts).
struct StoreDir {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    manifest: Value,
}

fn store_dir(layout: ExpertLayout) -> StoreDir {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &hf);
    let dir = tmp.path().join("store");
    let opts = ConvertOptions {
        spine: SpineDtype::Bf16.into(),
        int8_group: 0,
        experts: layout,
        progress: false,
        ..Default::default()
    };
    convert(&hf, &dir, &opts).unwrap();
    let manifest = serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    StoreDir { _tmp: tmp, dir, manifest }
}

/// Open the store with `text` as its manifest; when it opens, load every spine tensor and read
/// every expert record (the checks at open must make every read safe).
fn check_manifest(store: &StoreDir, text: &[u8]) -> Result<(), TestCaseError> {
    std::fs::write(store.dir.join("manifest.json"), text).unwrap();
    bounded(|| {
        let Ok(s) = Store::open(&store.dir, None) else { return };
        for t in &s.manifest.spine.tensors {
            let _ = s.load_spine(&t.name);
        }
        let mut buf = Vec::new();
        for l in &s.manifest.experts.layers {
            for e in 0..l.experts.len() + 1 {
                let _ = s.experts.read(l.layer, e, &mut buf);
            }
        }
    })
}

/// A corpus file is a manifest as is, or `{"fuzz_patch": {pointer: value}, "fuzz_remove":
/// [pointer]}` applied to the converted store's own manifest (so seeds stay small).
fn manifest_from_corpus(real: &Value, bytes: &[u8]) -> Vec<u8> {
    let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(bytes) else { return bytes.to_vec() };
    if !o.contains_key("fuzz_patch") && !o.contains_key("fuzz_remove") {
        return bytes.to_vec();
    }
    let mut v = real.clone();
    for (ptr, val) in o.get("fuzz_patch").and_then(Value::as_object).into_iter().flatten() {
        *v.pointer_mut(ptr).unwrap_or_else(|| panic!("corpus patch: no {ptr}")) = val.clone();
    }
    for ptr in o.get("fuzz_remove").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str) {
        let (parent, key) = ptr.rsplit_once('/').expect("a pointer");
        match v.pointer_mut(parent).expect("corpus remove: parent") {
            Value::Object(m) => drop(m.remove(key)),
            Value::Array(a) => drop(a.remove(key.parse::<usize>().expect("index"))),
            _ => panic!("corpus remove: {ptr}"),
        }
    }
    v.to_string().into_bytes()
}

#[test]
fn fuzz_manifest() {
    let stores = [store_dir(ExpertLayout::Pack), store_dir(ExpertLayout::InPlace)];
    const KEYS: &[&str] = &["file", "files", "ranges", "offset", "len", "shape", "record_bytes", "layer", "experts"];
    const STRINGS: &[&str] = &[
        "spine.bin",
        "experts/layer-001.bin",
        "../spine.bin",
        "/etc/passwd",
        "",
        ".",
        "int8",
        "bf16",
        "f32",
        "pack",
        "in-place",
        "tiktoken.model",
    ];
    let values = prop_oneof![3 => interesting_number(), 2 => json_value(KEYS, STRINGS)].boxed();
    let reals: Vec<Value> = stores.iter().map(|s| s.manifest.clone()).collect();
    let strategy = (
        0..stores.len(),
        prop_oneof![
            6 => prop::collection::vec(json_op(values), 1..4).prop_map(|ops| (ops, Vec::new())),
            1 => byte_ops(4).prop_map(|ops| (Vec::new(), ops)),
        ],
    );
    fuzz(
        "manifest",
        120,
        strategy,
        |(which, (json_ops, byte_ops))| {
            let mut v = reals[*which].clone();
            apply_json(&mut v, json_ops);
            let mut text = serde_json::to_vec(&v).unwrap();
            apply_bytes(&mut text, byte_ops);
            check_manifest(&stores[*which], &text)
        },
        |bytes| {
            for (s, real) in stores.iter().zip(&reals) {
                check_manifest(s, &manifest_from_corpus(real, bytes))?;
            }
            Ok(())
        },
    );
}
