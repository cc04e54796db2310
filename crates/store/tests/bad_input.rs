//! Bad and changed input: every failure is a clear error naming what is wrong, never a panic and
//! never silently wrong numbers.

use deltafin_store::os::FileAt;
use std::path::{Path, PathBuf};

use deltafin_store::convert::{ConvertOptions, convert};
use deltafin_store::{ExpertLayout, SpineDtype, Store, StoreError};

fn fixture_hf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/k3-tiny/hf")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn opts(experts: ExpertLayout) -> ConvertOptions {
    ConvertOptions { spine: SpineDtype::Int8.into(), int8_group: 0, experts, progress: false, ..Default::default() }
}

/// A private copy of the tiny checkpoint, and a store converted from it.
fn setup(experts: ExpertLayout) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &hf);
    let store = tmp.path().join("store");
    convert(&hf, &store, &opts(experts)).unwrap();
    (tmp, hf, store)
}

fn flip_byte(path: &Path, offset: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x5A;
    f.write_all_at(&b, offset).unwrap();
}

#[test]
fn corrupt_packed_expert_is_reported_with_layer_and_expert() {
    let (_t, _hf, store_dir) = setup(ExpertLayout::Pack);
    let store = Store::open(&store_dir, None).unwrap();
    let loc = store.experts.location(2, 5).unwrap().clone();
    let file = store_dir.join(&store.manifest.experts.files[loc.ranges[0][0] as usize]);
    flip_byte(&file, loc.ranges[0][1] + 17);
    let store = Store::open(&store_dir, None).unwrap();
    let mut buf = Vec::new();
    let err = store.experts.read(2, 5, &mut buf).unwrap_err();
    assert!(matches!(err, StoreError::Checksum { layer: 2, expert: 5, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("layer 2 expert 5") && msg.contains("checksum"), "{msg}");
    // Its neighbours are untouched.
    store.experts.read(2, 4, &mut buf).unwrap();
    store.experts.read(2, 6, &mut buf).unwrap();
}

#[test]
fn corrupt_in_place_expert_is_reported() {
    let (_t, hf, store_dir) = setup(ExpertLayout::InPlace);
    let store = Store::open(&store_dir, None).unwrap();
    let loc = store.experts.location(3, 11).unwrap().clone();
    let shard = hf.join(&store.manifest.experts.files[loc.ranges[0][0] as usize]);
    flip_byte(&shard, loc.ranges[0][1] + loc.ranges[0][2] - 1);
    let store = Store::open(&store_dir, None).unwrap();
    let err = store.experts.read(3, 11, &mut Vec::new()).unwrap_err();
    assert!(matches!(err, StoreError::Checksum { layer: 3, expert: 11, .. }), "{err}");
}

#[test]
fn changed_or_moved_checkpoint_is_detected() {
    let (t, hf, store_dir) = setup(ExpertLayout::InPlace);
    // A shard that grew.
    let store = Store::open(&store_dir, None).unwrap();
    let shard = hf.join(&store.manifest.experts.files[0]);
    let f = std::fs::OpenOptions::new().append(true).open(&shard).unwrap();
    f.set_len(f.metadata().unwrap().len() + 1).unwrap();
    let msg = Store::open(&store_dir, None).err().expect("grown shard must be refused").to_string();
    assert!(
        msg.contains("has changed") && msg.contains(&shard.file_name().unwrap().to_string_lossy().to_string()),
        "{msg}"
    );
    f.set_len(f.metadata().unwrap().len() - 1).unwrap();
    Store::open(&store_dir, None).unwrap();
    // A moved checkpoint: a clear message, and --source finds it at its new place.
    let moved = t.path().join("moved");
    std::fs::rename(&hf, &moved).unwrap();
    let msg = Store::open(&store_dir, None).err().expect("moved checkpoint must be refused").to_string();
    assert!(msg.contains("is gone") && msg.contains("--source"), "{msg}");
    let store = Store::open(&store_dir, Some(&moved)).unwrap();
    store.experts.read(1, 0, &mut Vec::new()).unwrap();
}

#[test]
fn corrupt_spine_is_reported() {
    let (_t, _hf, store_dir) = setup(ExpertLayout::InPlace);
    let store = Store::open(&store_dir, None).unwrap();
    let t = store.spine_tensor_info("layers.3.self_attn.kv_b_proj.weight").unwrap().clone();
    flip_byte(&store_dir.join("spine.bin"), t.offset + 3);
    let msg = store.load_spine(&t.name).unwrap_err().to_string();
    assert!(msg.contains("kv_b_proj") && msg.contains("checksum"), "{msg}");
}

#[test]
fn missing_tensor_names_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &hf);
    let idx = hf.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    let name = "language_model.model.layers.2.self_attn.f_b_proj.weight";
    assert!(v["weight_map"].as_object_mut().unwrap().remove(name).is_some());
    std::fs::write(&idx, v.to_string()).unwrap();
    let msg = convert(&hf, &tmp.path().join("s"), &opts(ExpertLayout::InPlace)).err().unwrap().to_string();
    assert!(msg.contains(name) && msg.contains("missing"), "{msg}");
}

#[test]
fn inconsistent_config_names_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &hf);
    let cfg = hf.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["text_config"]["kv_lora_rank"] = serde_json::json!(24);
    std::fs::write(&cfg, v.to_string()).unwrap();
    let msg = convert(&hf, &tmp.path().join("s"), &opts(ExpertLayout::InPlace)).err().unwrap().to_string();
    assert!(msg.contains("kv_a_proj_with_mqa") && msg.contains(".safetensors") && msg.contains("shape"), "{msg}");
    // A missing field names config.json and the field.
    v["text_config"].as_object_mut().unwrap().remove("kv_lora_rank");
    std::fs::write(&cfg, v.to_string()).unwrap();
    let msg = convert(&hf, &tmp.path().join("s"), &opts(ExpertLayout::InPlace)).err().unwrap().to_string();
    assert!(msg.contains("config.json") && msg.contains("kv_lora_rank"), "{msg}");
    // Not JSON at all.
    std::fs::write(&cfg, "{ nope").unwrap();
    let msg = convert(&hf, &tmp.path().join("s"), &opts(ExpertLayout::InPlace)).err().unwrap().to_string();
    assert!(msg.contains("config.json") && msg.contains("JSON"), "{msg}");
}

#[test]
fn nan_mxfp4_scale_is_a_conversion_error() {
    let (_t, hf, store_dir) = setup(ExpertLayout::InPlace);
    let store = Store::open(&store_dir, None).unwrap();
    // w1.weight_scale is the second part of the record: its first byte follows w1's packed bytes.
    let w1_packed = store.manifest.experts.parts[0].len;
    let loc = store.experts.location(4, 7).unwrap().clone();
    let shard = hf.join(&store.manifest.experts.files[loc.ranges[0][0] as usize]);
    let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.write_all_at(&[0xFF], loc.ranges[0][1] + w1_packed).unwrap();
    let msg = convert(&hf, &store_dir.with_file_name("s2"), &opts(ExpertLayout::InPlace)).err().unwrap().to_string();
    assert!(msg.contains("layer 4 expert 7") && msg.contains("0xFF") && msg.contains("w1.weight_scale"), "{msg}");
}

#[test]
fn bad_manifest_is_a_clear_error() {
    let (_t, _hf, store_dir) = setup(ExpertLayout::Pack);
    let path = store_dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"version\": 1", "\"version\": 99")).unwrap();
    let msg = Store::open(&store_dir, None).err().unwrap().to_string();
    assert!(msg.contains("version 99"), "{msg}");
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    let msg = Store::open(&store_dir, None).err().unwrap().to_string();
    assert!(msg.contains("manifest is not valid"), "{msg}");
    std::fs::remove_file(&path).unwrap();
    let msg = Store::open(&store_dir, None).err().unwrap().to_string();
    assert!(msg.contains("manifest.json"), "{msg}");
}

/// Each file of `dir` and its bytes, to show a refused command wrote nothing.
fn snapshot(dir: &Path) -> Vec<(std::ffi::OsString, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn converting_a_checkpoint_onto_itself_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &hf);
    let link = tmp.path().join("link");
    // Symbolic links to directories need privileges on Windows: that spelling is tested on Unix.
    #[cfg(unix)]
    std::os::unix::fs::symlink(&hf, &link).unwrap();
    let before = snapshot(&hf);
    // The same directory: as given, spelt differently, and through a symbolic link.
    for to in [hf.clone(), hf.join("..").join("hf"), hf.join("."), link].into_iter().filter(|p| p.exists()) {
        let err = convert(&hf, &to, &opts(ExpertLayout::InPlace)).err().expect("converting onto itself must fail");
        let msg = err.to_string();
        assert!(msg.contains("same directory") && msg.contains("--to"), "{}: {msg}", to.display());
        assert!(snapshot(&hf) == before, "{}: the checkpoint directory was modified", to.display());
    }
}

#[test]
fn an_index_with_an_empty_weight_map_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    copy_dir(&fixture_hf(), &hf);
    std::fs::write(hf.join("model.safetensors.index.json"), r#"{"metadata": {}, "weight_map": {}}"#).unwrap();
    let msg = deltafin_store::checkpoint::Checkpoint::open(&hf).err().expect("empty weight_map must fail").to_string();
    assert!(
        msg.contains("model.safetensors.index.json") && msg.contains("weight_map") && msg.contains("empty"),
        "{msg}"
    );
}

/// Edit `manifest.json` of `store_dir` through its JSON, returning the original text.
fn edit_manifest(store_dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let path = store_dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    text
}

#[test]
fn manifest_file_names_outside_the_store_are_refused() {
    let (t, _hf, store_dir) = setup(ExpertLayout::Pack);
    // Real files wherever the names point, so only the names themselves can be objected to.
    std::fs::copy(store_dir.join("spine.bin"), t.path().join("spine.bin")).unwrap();
    std::fs::copy(store_dir.join("tiktoken.model"), t.path().join("tiktoken.model")).unwrap();
    let abs_pack = store_dir.join("experts/layer-001.bin").to_string_lossy().into_owned();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("spine.file", Box::new(|v| v["spine"]["file"] = "../spine.bin".into())),
        ("spine.file", Box::new(|v| v["spine"]["file"] = "experts/../../spine.bin".into())),
        ("experts.files[0]", Box::new(move |v| v["experts"]["files"][0] = abs_pack.clone().into())),
        ("experts.files[1]", Box::new(|v| v["experts"]["files"][1] = "experts/../experts/layer-002.bin".into())),
        ("tokenizer.files[0]", Box::new(|v| v["tokenizer"]["files"][0] = "../tiktoken.model".into())),
        ("source.shards[0].file", Box::new(|v| v["source"]["shards"][0]["file"] = "../x.safetensors".into())),
        ("spine.file", Box::new(|v| v["spine"]["file"] = "".into())),
    ];
    for (field, edit) in cases {
        let original = edit_manifest(&store_dir, edit);
        let msg = Store::open(&store_dir, None).err().map(|e| e.to_string());
        std::fs::write(store_dir.join("manifest.json"), original).unwrap();
        let msg = msg.unwrap_or_else(|| panic!("{field}: a name leaving the store must be refused"));
        assert!(msg.contains(field) && msg.contains("manifest.json"), "{field}: {msg}");
    }
    Store::open(&store_dir, None).unwrap();
}

#[test]
fn expert_table_is_checked_against_the_files() {
    for layout in [ExpertLayout::Pack, ExpertLayout::InPlace] {
        let (_t, _hf, store_dir) = setup(layout);
        let store = Store::open(&store_dir, None).unwrap();
        let (l, e) = (3usize, 9usize);
        let li = store.manifest.experts.layers.iter().position(|x| x.layer == l).unwrap();
        let r0 = store.experts.location(l, e).unwrap().ranges[0];
        let file_len = std::fs::metadata(&store.experts.paths()[r0[0] as usize]).unwrap().len();
        let record = store.manifest.experts.record_bytes;
        drop(store);
        type Edit = Box<dyn Fn(&mut serde_json::Value)>;
        let at = move |v: &mut serde_json::Value| -> serde_json::Value {
            v["experts"]["layers"][li]["experts"][e]["ranges"][0].clone()
        };
        let set = move |v: &mut serde_json::Value, r: serde_json::Value| {
            v["experts"]["layers"][li]["experts"][e]["ranges"][0] = r
        };
        let cases: Vec<(&str, Edit)> = vec![
            // Past the end of its file.
            ("past the end", Box::new(move |v| set(v, serde_json::json!([r0[0], file_len - r0[2] + 1, r0[2]])))),
            // offset + len overflows u64.
            ("past the end", Box::new(move |v| set(v, serde_json::json!([r0[0], u64::MAX - 1, r0[2]])))),
            // A file index the table does not have.
            ("file 99", Box::new(move |v| set(v, serde_json::json!([99, r0[1], r0[2]])))),
            // Ranges that do not add up to the record.
            ("cover", Box::new(move |v| set(v, serde_json::json!([r0[0], r0[1], r0[2] - 1])))),
            (
                "cover",
                Box::new(move |v| {
                    let r = at(v);
                    v["experts"]["layers"][li]["experts"][e]["ranges"].as_array_mut().unwrap().push(r);
                }),
            ),
            (
                "no byte ranges",
                Box::new(move |v| v["experts"]["layers"][li]["experts"][e]["ranges"] = serde_json::json!([])),
            ),
            // A record size that disagrees with the config.
            ("record_bytes", Box::new(move |v| v["experts"]["record_bytes"] = serde_json::json!(record * 1000))),
        ];
        for (what, edit) in cases {
            let original = edit_manifest(&store_dir, edit);
            let msg = Store::open(&store_dir, None).err().map(|e| e.to_string());
            std::fs::write(store_dir.join("manifest.json"), original).unwrap();
            let msg = msg.unwrap_or_else(|| panic!("{layout:?} {what}: a bad expert table must be refused at open"));
            assert!(msg.contains(what) && msg.contains("manifest.json"), "{layout:?} {what}: {msg}");
            if what != "record_bytes" {
                assert!(msg.contains(&format!("layer {l} expert {e}")), "{layout:?} {what}: {msg}");
            }
        }
        Store::open(&store_dir, None).unwrap();
    }
}

#[test]
fn absurd_configs_are_refused_at_load() {
    let text = std::fs::read_to_string(fixture_hf().join("config.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    deltafin_store::K3Config::from_hf_json(&text, "config.json").unwrap();
    let cases: &[(&str, serde_json::Value, &str)] = &[
        ("hidden_size", serde_json::json!(1u64 << 40), "hidden_size"),
        ("vocab_size", serde_json::json!(u64::MAX), "vocab_size"),
        ("num_hidden_layers", serde_json::json!(1u64 << 30), "num_hidden_layers"),
        ("num_experts", serde_json::json!(0), "num_experts_per_token"),
        ("num_experts_per_token", serde_json::json!(17), "num_experts_per_token"),
        ("num_experts", serde_json::json!(1u64 << 40), "num_experts"),
        ("moe_intermediate_size", serde_json::json!(0), "moe_intermediate_size"),
        ("moe_intermediate_size", serde_json::json!(1u64 << 20), "moe_intermediate_size"),
        ("routed_expert_hidden_size", serde_json::json!(0), "routed_expert_hidden_size"),
        ("kv_lora_rank", serde_json::json!(0), "kv_lora_rank"),
        ("num_attention_heads", serde_json::json!(0), "num_attention_heads"),
        ("q_lora_rank", serde_json::json!(0), "q_lora_rank"),
        ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
        ("rms_norm_eps", serde_json::json!(1e300), "rms_norm_eps"),
        ("routed_scaling_factor", serde_json::json!(1e300), "routed_scaling_factor"),
        ("vocab_size", serde_json::json!(-5), "vocab_size"),
        ("num_shared_experts", serde_json::json!(1u64 << 20), "num_shared_experts"),
    ];
    let lac: &[(&str, serde_json::Value, &str)] = &[
        ("head_dim", serde_json::json!(1u64 << 18), "elements"),
        ("head_dim", serde_json::json!(1u64 << 30), "head_dim"),
        ("short_conv_kernel_size", serde_json::json!(1u64 << 40), "short_conv_kernel_size"),
        ("kda_layers", serde_json::json!(vec![1; 100]), "kda_layers"),
        ("full_attn_layers", serde_json::json!([9]), "full_attn_layers"),
    ];
    let mut all = Vec::new();
    for (k, v, want) in cases {
        let mut c = base.clone();
        c["text_config"][*k] = v.clone();
        all.push((format!("{k} = {v}"), c, *want));
    }
    // Widths each within bounds whose expert record is not (54 GB).
    let mut c = base.clone();
    c["text_config"]["moe_intermediate_size"] = serde_json::json!(1u64 << 18);
    c["text_config"]["routed_expert_hidden_size"] = serde_json::json!(1u64 << 17);
    all.push(("a huge expert record".into(), c, "expert record"));
    for (k, v, want) in lac {
        let mut c = base.clone();
        c["text_config"]["linear_attn_config"][*k] = v.clone();
        all.push((format!("linear_attn_config.{k} = {v}"), c, *want));
    }
    for (what, c, want) in all {
        let msg = deltafin_store::K3Config::from_hf_json(&c.to_string(), "x/config.json")
            .err()
            .unwrap_or_else(|| panic!("{what}: must be refused"))
            .to_string();
        assert!(msg.contains("x/config.json") && msg.contains(want), "{what}: {msg}");
    }
}
