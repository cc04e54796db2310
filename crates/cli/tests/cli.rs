//! The `deltafin` binary end to end: convert, generate (text and JSON), logits, and its answers
//! to bad input (clear errors, non-zero exit, never a panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("spawn deltafin")
}

fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(o.status.success(), "deltafin {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// Runs, expects failure with a clear message on stderr and no panic; returns stderr.
fn fails(args: &[&str]) -> String {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "deltafin {args:?} should fail");
    assert!(!err.contains("panicked"), "deltafin {args:?} panicked: {err}");
    assert!(!err.trim().is_empty(), "deltafin {args:?} failed silently");
    err
}

fn convert(name: &str, extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = fixture(name).join("hf");
    let mut args = vec!["convert", "--from", from.to_str().unwrap(), "--to", dir.path().to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(&args);
    dir
}

#[test]
fn generate_text_and_json() {
    let store = convert("k3-tiny", &[]);
    let s = store.path().to_str().unwrap();
    let text = ok(&["generate", "--model", s, "--prompt", "The lighthouse keeper", "--max-tokens", "8"]);
    assert!(!text.trim().is_empty());
    let out = ok(&["generate", "--model", s, "--prompt", "The lighthouse keeper", "--max-tokens", "8", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object on stdout");
    assert!(v["prompt_tokens"].as_array().unwrap().len() > 1);
    let toks = v["tokens"].as_array().unwrap();
    assert!(!toks.is_empty() && toks.len() <= 8);
    assert!(v["text"].is_string());
    assert!(v["timing"]["prompt_s"].as_f64().unwrap() > 0.0);
    assert!(v["timing"]["expert_bytes_read"].as_u64().unwrap() > 0);
    // The text printed is the decoded JSON tokens.
    assert_eq!(text.trim_end_matches('\n'), v["text"].as_str().unwrap());
}

#[test]
fn logits_and_greedy_match_the_reference() {
    let store = convert("k3-small", &["--spine", "f32", "--experts", "pack"]);
    let s = store.path().to_str().unwrap();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("k3-small").join("reference.json")).unwrap()).unwrap();
    let p = &reference["prompts"][1];
    let ids: Vec<String> = p["tokens"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
    let ids = ids.join(",");
    let v: serde_json::Value = serde_json::from_str(&ok(&["logits", "--model", s, "--prompt-tokens", &ids])).unwrap();
    let got: Vec<f64> = v["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let want: Vec<f64> = p["last_logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(got.len(), want.len());
    let d = got.iter().zip(&want).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    let scale = want.iter().fold(0f64, |m, b| m.max(b.abs()));
    assert!(d / scale < 1e-3, "rel err {}", d / scale);
    let v: serde_json::Value = serde_json::from_str(&ok(&[
        "generate",
        "--model",
        s,
        "--prompt-tokens",
        &ids,
        "--max-tokens",
        "12",
        "--json",
        "--ignore-eos",
    ]))
    .unwrap();
    assert_eq!(v["tokens"], p["greedy"]);
}

#[test]
fn bad_input_is_a_clear_error() {
    let store = convert("k3-tiny", &[]);
    let s = store.path().to_str().unwrap();
    let e = fails(&["generate", "--model", "/nonexistent/store", "--prompt", "hi"]);
    assert!(e.contains("/nonexistent/store"), "{e}");
    let e = fails(&["generate", "--model", s, "--prompt-tokens", "1,99999"]);
    assert!(e.contains("99999") && e.contains("vocabulary"), "{e}");
    let e = fails(&["generate", "--model", s, "--prompt", ""]);
    assert!(e.contains("no tokens"), "{e}");
    fails(&["generate", "--model", s, "--prompt-tokens", "a,b"]);
    fails(&["generate", "--model", s, "--prompt", "x", "--prompt-tokens", "1"]);
    fails(&["generate", "--model", s]);
    fails(&["convert", "--from", s, "--to", "/tmp/x", "--spine", "int3"]);
    let e = fails(&["convert", "--from", "/nonexistent/hf", "--to", "/tmp/deltafin-never"]);
    assert!(e.contains("config.json"), "{e}");
    fails(&["logits", "--model", s, "--prompt-tokens", ""]);
    fails(&["frobnicate"]);
}

#[test]
fn corrupt_expert_stops_generation_with_its_name() {
    let store = convert("k3-tiny", &["--experts", "pack"]);
    let s = store.path().to_str().unwrap();
    // Corrupt every record of layer 1 so whichever the router picks is caught.
    let f = store.path().join("experts/layer-001.bin");
    let mut bytes = std::fs::read(&f).unwrap();
    for b in bytes.iter_mut().step_by(97) {
        *b ^= 0xA5;
    }
    std::fs::write(&f, bytes).unwrap();
    let e = fails(&["generate", "--model", s, "--prompt-tokens", "1,2,3", "--max-tokens", "2"]);
    assert!(e.contains("layer 1 expert") && e.contains("checksum"), "{e}");
}

/// A 4,000-token prompt runs within the memory budget, in one budget-sized chunk or in chunks
/// of 32, with the same tokens; the JSON says how the prompt went (chunks, distinct experts,
/// FLOPs) and the peak RSS; a chunk the budget cannot hold is refused with what to do.
#[test]
fn long_prompts_run_in_budget_sized_chunks() {
    let store = convert("k3-small", &[]);
    let s = store.path().to_str().unwrap();
    let ids: Vec<String> = (0..4000u32).map(|i| ((i * 7919 + 11) % 500).to_string()).collect();
    let prompt = ids.join(",");
    let budget: u64 = 256 << 20;
    let generate = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["generate", "--model", s, "--prompt-tokens", &prompt, "--max-tokens", "3", "--json"];
        args.extend_from_slice(&["--memory-budget", "256M", "--context", "4100"]);
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&args)).expect("one JSON object")
    };
    let auto = generate(&[]);
    let by32 = generate(&["--prefill-chunk", "32"]);
    let p = &auto["timing"]["prompt"];
    assert_eq!(p["tokens"], 4000);
    // 256 MiB holds the whole prompt's activations on this model: one chunk.
    assert_eq!(p["chunks"], 1, "{}", auto["plan"]);
    assert_eq!(by32["timing"]["prompt"]["chunks"], 125);
    assert_eq!(auto["tokens"], by32["tokens"]);
    assert!(p["distinct_experts"].as_u64().unwrap() > 0);
    assert!(auto["timing"]["prompt_flops"].as_f64().unwrap() > 0.0);
    for v in [&auto, &by32] {
        let rss = v["peak_rss_bytes"].as_u64().expect("peak RSS reported");
        assert!(rss <= budget, "peak RSS {rss} over the budget {budget}");
    }
    let err = fails(&[
        "generate",
        "--model",
        s,
        "--prompt-tokens",
        "1,2,3",
        "--memory-budget",
        "256M",
        "--prefill-chunk",
        "1000000",
    ]);
    assert!(err.contains("--prefill-chunk 1000000 needs"), "{err}");
}

/// A prompt longer than the plan's chunk borrows the expert cache's memory for fewer, equal
/// chunks (each chunk reads its experts once), gives it back before decoding, and stays within
/// the budget with the same tokens as chunks of 16.
#[test]
fn long_prompts_borrow_the_expert_cache() {
    // The budgets below are sized against the int8 spine's bytes.
    let store = convert("k3-small", &["--spine", "int8"]);
    let s = store.path().to_str().unwrap();
    let ids: Vec<String> = (0..600u32).map(|i| ((i * 7919 + 11) % 500).to_string()).collect();
    let prompt = ids.join(",");
    // Just above the minimum: some cache slots (not all 32 experts), a small chunk of its own
    // (the minimum counts MLA's attention working set at the GPU's 64 tokens a call too).
    let budget: u64 = 106 << 20;
    let generate = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["generate", "--model", s, "--prompt-tokens", &prompt, "--max-tokens", "4", "--json"];
        args.extend_from_slice(&["--memory-budget", "106M", "--context", "4100", "--no-prefetch"]);
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&args)).expect("one JSON object")
    };
    let auto = generate(&[]);
    let by16 = generate(&["--prefill-chunk", "16"]);
    let plan = &auto["plan"];
    let (base, lent) = (plan["prefill_chunk"].as_u64().unwrap(), plan["prefill_chunk_lent"].as_u64().unwrap());
    let slots = plan["cache_slots_per_layer"].as_u64().unwrap();
    assert!(slots > 0 && slots < plan["experts_per_layer"].as_u64().unwrap(), "{plan}");
    assert!(lent > base && base < 600, "{plan}");
    let p = &auto["timing"]["prompt"];
    let chunks = 600u64.div_ceil(lent);
    assert_eq!(p["chunks"], chunks, "{p}");
    assert_eq!(p["chunk"], 600u64.div_ceil(chunks), "equal chunks: {p}");
    assert!(p["borrowed_bytes"].as_u64().unwrap() > 0, "{p}");
    assert_eq!(by16["timing"]["prompt"]["borrowed_bytes"], 0);
    assert_eq!(by16["timing"]["prompt"]["chunks"], 38);
    assert_eq!(auto["tokens"], by16["tokens"]);
    assert!(
        p["expert_bytes_read"].as_u64().unwrap() < by16["timing"]["prompt"]["expert_bytes_read"].as_u64().unwrap(),
        "fewer chunks read fewer experts: {p}"
    );
    // Chunks this large pick nearly every expert: the cache room left after lending is read
    // into ahead of the router, and those reads are used.
    let st = &auto["stream"];
    assert!(st["read_ahead"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(st["read_ahead"], st["prefetch_reads"], "prefetch is off: every speculative read is a read-ahead");
    assert_eq!(by16["stream"]["read_ahead"], 0, "chunks of 16 (96 picks of 32 experts) do not cover the layer");
    let rss = auto["peak_rss_bytes"].as_u64().expect("peak RSS reported");
    assert!(rss <= budget, "peak RSS {rss} over the budget {budget}");
}

/// `plan` needs no weights: Kimi K3 on paper at 24 and 64 GB. At 24 GB most of the spine is
/// streamed and prompt chunks still get thousands of tokens; at 64 GB everything is resident.
#[test]
fn plan_for_kimi_k3_on_paper() {
    let out = ok(&["plan", "--preset", "kimi-k3", "--memory-budget", "24G,64G", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["model"]["record_bytes"], 17_547_264);
    let plans = v["plans"].as_array().unwrap();
    let (small, big) = (&plans[0]["plan"], &plans[1]["plan"]);
    assert!(small["spine_streamed_layers"].as_u64().unwrap() > 40, "{small}");
    assert!(small["prefill_chunk"].as_u64().unwrap() >= 1000, "{small}");
    assert!(small["budget_bytes"].as_u64().unwrap() == 24 << 30);
    assert_eq!(big["spine_streamed_layers"], 0);
    let read = |p: &serde_json::Value| p["read_bytes_per_token"].as_u64().unwrap();
    assert!(read(&plans[0]) > read(&plans[1]));
    let err = fails(&["plan", "--preset", "kimi-k3", "--memory-budget", "2G"]);
    assert!(err.contains("below the minimum"), "{err}");
}

/// `plan --gpu-memory` says what a GPU holds and what crosses the bus: with room for the spine
/// and some experts, the spine is kept whole, the rest of the share caches experts (whole
/// records), and the bus carries the chosen experts the cache does not hold; with less room
/// than the spine, the rest of the spine goes per chunk and no expert is cached; with
/// `--unified-memory` the share comes out of the budget.
#[test]
fn plan_with_a_gpu_says_what_sits_where() {
    let gpu = |budget: &str, share: &str, unified: bool| {
        let mut args = vec!["plan", "--preset", "kimi-k3", "--memory-budget", budget, "--gpu-memory", share, "--json"];
        if unified {
            args.push("--unified-memory");
        }
        let v: serde_json::Value = serde_json::from_str(&ok(&args)).expect("one JSON object");
        v["plans"][0].clone()
    };
    let p = gpu("128G", "80G", false);
    let (plan, g) = (&p["plan"], &p["gpu"]);
    let spine = plan["spine_bytes"].as_u64().unwrap() + plan["spine_bytes_per_token"].as_u64().unwrap();
    let record = plan["record_bytes"].as_u64().unwrap();
    let (layers, k) = (plan["moe_layers"].as_u64().unwrap(), plan["experts_per_token"].as_u64().unwrap());
    let all = layers * plan["experts_per_layer"].as_u64().unwrap();
    assert_eq!(g["spine_kept"].as_u64().unwrap(), spine, "{g}");
    assert_eq!(g["spine_sent_per_chunk"], 0);
    let cached = g["experts_cached"].as_u64().unwrap();
    assert_eq!(cached, ((80u64 << 30) - spine) / record, "{g}");
    let bus = g["bus_bytes_per_token"].as_u64().unwrap() as f64;
    let want = (k * layers * record) as f64 * (1.0 - cached as f64 / all as f64);
    assert!((bus - want).abs() <= 1.0, "bus {bus} vs {want}");
    let p = gpu("128G", "24G", false);
    assert_eq!(p["gpu"]["spine_kept"].as_u64().unwrap(), 24 << 30);
    assert_eq!(p["gpu"]["spine_sent_per_chunk"].as_u64().unwrap(), spine - (24 << 30));
    assert_eq!(p["gpu"]["experts_cached"], 0);
    let p = gpu("64G", "16G", true);
    assert_eq!(p["plan"]["budget_bytes"].as_u64().unwrap(), 48 << 30, "the GPU's share comes out of the budget");
    let err =
        fails(&["plan", "--preset", "kimi-k3", "--memory-budget", "16G", "--gpu-memory", "16G", "--unified-memory"]);
    assert!(err.contains("is all of the memory budget"), "{err}");
    let text = ok(&["plan", "--preset", "kimi-k3", "--memory-budget", "128G", "--gpu-memory", "24G"]);
    assert!(
        text.contains("GPU memory 24.00 GiB: spine matrices 24.00 GiB kept (prompt chunks send the other"),
        "{text}"
    );
}

/// `plan` answers "how fast, and how much disk": at a given drive rate the decode estimate is
/// the bytes read per token over that rate, a faster drive gives a shorter time to first token,
/// and a full install is the spine plus every expert record.
#[test]
fn plan_estimates_speed_and_disk() {
    let out = ok(&["plan", "--preset", "kimi-k3", "--memory-budget", "64G", "--disk-gbps", "3,12", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    let p = &v["plans"][0];
    let read = p["read_bytes_per_token"].as_f64().unwrap();
    let est = p["estimates"].as_array().unwrap();
    assert_eq!(est.len(), 2);
    let s3 = est[0]["s_per_token"].as_f64().unwrap();
    assert!((s3 - read / 3e9).abs() < 1e-9 * s3.max(1.0), "{s3} vs {}", read / 3e9);
    assert_eq!(est[0]["decode_bound"], "drive");
    assert!(est[1]["ttft_s"].as_f64().unwrap() < est[0]["ttft_s"].as_f64().unwrap());
    let d = &v["disk"];
    let record = v["model"]["record_bytes"].as_u64().unwrap();
    assert_eq!(d["expert_bytes"].as_u64().unwrap(), record * 92 * 896);
    assert_eq!(
        d["full_bytes"].as_u64().unwrap(),
        d["spine_bytes"].as_u64().unwrap() + d["expert_bytes"].as_u64().unwrap()
    );
    assert_eq!(v["spine_dtype"], "int8");
    // With a compute rate the prompt of a slow processor is compute-bound.
    let out =
        ok(&["plan", "--preset", "kimi-k3", "--memory-budget", "64G", "--disk-gbps", "12", "--gflops", "1", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["plans"][0]["estimates"][0]["ttft_bound"], "compute");
    // --measure reads a scratch file with O_DIRECT under the directory, and removes it.
    let dir = tempfile::tempdir().unwrap();
    let cfg = fixture("k3-tiny/hf/config.json");
    let out = ok(&[
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--memory-budget",
        "1G",
        "--measure",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["measured"]["disk"]["gbps"].as_f64().unwrap() > 0.0, "{}", v["measured"]);
    assert!(v["measured"]["gflops"].as_f64().unwrap() > 0.0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the probe file was left behind");
    let err = fails(&["plan", "--preset", "kimi-k3", "--memory-budget", "64G", "--disk-gbps", "0"]);
    assert!(err.contains("--disk-gbps"), "{err}");
}

/// The bundled demo model (`models/k3-demo`, trained) continues its fixed prompt exactly as its
/// training framework did (PyTorch, float32, `models/k3-demo/continuation.json`): the prompt is
/// tokenized as tiktoken does, and with a bf16 spine, which is what the default (`--spine auto`,
/// as README's first command converts) keeps for it, every greedy token is the recorded one.
/// With an int8 spine it runs and gives readable text (its fidelity is measured apart).
#[test]
fn demo_model_continues_as_its_training_framework_did() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo");
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(demo.join("continuation.json")).unwrap()).unwrap();
    let prompt = rec["prompt"].as_str().unwrap();
    let n = rec["tokens"].as_array().unwrap().len().to_string();
    let hf = demo.join("hf");
    for spine in ["bf16", "auto", "int8"] {
        let dir = tempfile::tempdir().unwrap();
        let s = dir.path().to_str().unwrap();
        let mut args = vec!["convert", "--from", hf.to_str().unwrap(), "--to", s];
        if spine != "auto" {
            args.extend(["--spine", spine]);
        }
        ok(&args);
        let out = ok(&["generate", "--model", s, "--prompt", prompt, "--max-tokens", &n, "--ignore-eos", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
        assert_eq!(v["prompt_tokens"], rec["prompt_ids"], "the prompt tokenized as tiktoken does");
        if spine != "int8" {
            assert_eq!(v["tokens"], rec["tokens"], "the recorded greedy continuation ({spine})");
            assert_eq!(v["text"], rec["text"]);
        } else {
            let text = v["text"].as_str().unwrap();
            assert!(text.chars().filter(|c| c.is_ascii_alphabetic()).count() > 20, "{text:?}");
        }
    }
}

/// The demo model answers in chat as its training framework did (`models/k3-demo/chat.json`:
/// PyTorch, float32, the question rendered with K3's chat template): `generate --chat` renders the
/// same prompt ids, stops at the end of the assistant's message with the same tokens, and splits
/// them into the recorded reasoning (the thinking span closes) and answer, with a bf16 spine (the
/// default for this model) and an f32 one.
#[test]
fn demo_model_answers_in_chat_as_its_training_framework_did() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo");
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(demo.join("chat.json")).unwrap()).unwrap();
    let question = rec["messages"][0]["content"].as_str().unwrap();
    let hf = demo.join("hf");
    for spine in ["bf16", "f32"] {
        let dir = tempfile::tempdir().unwrap();
        let s = dir.path().to_str().unwrap();
        ok(&["convert", "--from", hf.to_str().unwrap(), "--to", s, "--spine", spine]);
        let out = ok(&["generate", "--model", s, "--chat", question, "--max-tokens", "200", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
        assert_eq!(v["prompt_tokens"], rec["prompt_ids"], "the chat prompt rendered as the fine-tune saw it");
        assert_eq!(v["tokens"], rec["tokens"], "the recorded greedy answer ({spine})");
        assert_eq!(v["stopped_at_eos"], true, "the turn ends with <|end_of_msg|>");
        assert_eq!(v["reasoning"], rec["reasoning"]);
        assert_eq!(v["content"], rec["content"]);
        assert_eq!(v["tool_calls"], serde_json::json!([]));
        // The text form shows the thinking apart from the answer.
        let text = ok(&["generate", "--model", s, "--chat", question, "--max-tokens", "200"]);
        let content = rec["content"].as_str().unwrap();
        assert!(text.starts_with("[thinking] "), "{text:?}");
        assert!(text.trim_end().ends_with(content.trim()), "{text:?}");
    }
}

/// `generate --chat` refuses what it cannot render before loading anything.
#[test]
fn generate_chat_arguments_are_checked() {
    let store = convert("k3-tiny", &[]);
    let s = store.path().to_str().unwrap();
    let err = fails(&["generate", "--model", s, "--chat", "hi", "--reasoning-effort", "lots"]);
    assert!(err.contains("unsupported reasoning effort 'lots'"), "{err}");
    let err = fails(&["generate", "--model", s, "--chat", "hi", "--prompt", "x"]);
    assert!(err.contains("cannot be used with"), "{err}");
    let err = fails(&["generate", "--model", s, "--system", "be brief", "--prompt", "x"]);
    assert!(err.contains("--chat"), "{err}");
}

/// `logits --all-positions` writes every position's logits, teacher-forced, as f32 `[T, V]`:
/// the last row is what `logits` prints. `convert --router-f32` keeps only the routers' gates in
/// f32 (the manifest says so) and the store runs.
#[test]
fn logits_at_every_position_and_routers_kept_in_f32() {
    let store = convert("k3-tiny", &["--spine", "int8", "--router-f32"]);
    let s = store.path().to_str().unwrap();
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(store.path().join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["spine"]["router_f32"], true);
    let tensors = m["spine"]["tensors"].as_array().unwrap();
    let dtype_of = |suffix: &str| -> Vec<String> {
        tensors
            .iter()
            .filter(|t| t["name"].as_str().unwrap().ends_with(suffix))
            .map(|t| t["dtype"].to_string())
            .collect()
    };
    let routers = dtype_of("block_sparse_moe.gate.weight");
    assert!(!routers.is_empty() && routers.iter().all(|d| d.to_lowercase().contains("f32")), "{routers:?}");
    let others = dtype_of("o_proj.weight");
    assert!(!others.is_empty() && others.iter().all(|d| d.to_lowercase().contains("int8")), "{others:?}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("logits.bin");
    let out = ok(&["logits", "--model", s, "--prompt-tokens", "5,17,3,250", "--all-positions", file.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let vocab = v["vocab"].as_u64().unwrap() as usize;
    assert_eq!(v["positions"], 4);
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(bytes.len(), 4 * vocab * 4);
    let rows: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let last: serde_json::Value =
        serde_json::from_str(&ok(&["logits", "--model", s, "--prompt-tokens", "5,17,3,250"])).unwrap();
    let want: Vec<f32> = last["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert_eq!(&rows[3 * vocab..], &want[..], "the last row is the last position's logits");
    let first: serde_json::Value =
        serde_json::from_str(&ok(&["logits", "--model", s, "--prompt-tokens", "5"])).unwrap();
    let want: Vec<f32> = first["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert_eq!(&rows[..vocab], &want[..], "the first row is the first position's logits");
}

/// `convert --keep NAME=DTYPE` stores the matrices whose name contains NAME at that precision
/// (recorded per tensor and in the manifest's rules); a rule that matches every matrix gives the
/// bf16 spine's logits bit for bit; a malformed rule is a clear error.
#[test]
fn convert_keeps_named_matrices_at_another_precision() {
    let store = convert(
        "k3-small",
        &["--spine", "int8", "--keep", "lm_head=bf16", "--keep", "block_sparse_moe.gate.weight=f32"],
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(store.path().join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["spine"]["keep"][0]["pattern"], "lm_head");
    assert_eq!(m["spine"]["keep"][1]["dtype"], "f32");
    for t in m["spine"]["tensors"].as_array().unwrap() {
        let (name, dtype) = (t["name"].as_str().unwrap(), t["dtype"].as_str().unwrap());
        let want = match name {
            "lm_head.weight" => "bf16",
            n if n.ends_with("block_sparse_moe.gate.weight") => "f32",
            n if n.ends_with("o_proj.weight") || n == "embed_tokens.weight" => "int8",
            _ => continue,
        };
        assert_eq!(dtype, want, "{name}");
    }
    let logits = |store: &Path| -> String {
        let v: serde_json::Value =
            serde_json::from_str(&ok(&["logits", "--model", store.to_str().unwrap(), "--prompt-tokens", "5,17,3,250"]))
                .unwrap();
        v["logits"].to_string()
    };
    let all_bf16 = convert("k3-small", &["--spine", "int8", "--keep", "weight=bf16"]);
    let bf16 = convert("k3-small", &["--spine", "bf16"]);
    assert_eq!(logits(all_bf16.path()), logits(bf16.path()), "every matrix kept in bf16 is the bf16 spine");
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("s");
    let from = fixture("k3-small");
    for bad in ["lm_head", "=bf16", "lm_head=int4"] {
        let err = fails(&["convert", "--from", from.to_str().unwrap(), "--to", to.to_str().unwrap(), "--keep", bad]);
        assert!(err.contains("--keep") && err.contains(bad), "{bad}: {err}");
    }
}

/// `convert --spine auto` (the default) keeps the checkpoint's bf16 when the bf16 spine takes at
/// most half the memory budget and takes int8 otherwise; it says which and why, and the manifest
/// records what it weighed. An explicit dtype is not weighed.
#[test]
fn convert_spine_auto_weighs_the_bf16_spine_against_the_budget() {
    let from = fixture("k3-small").join("hf");
    let spine_of = |store: &Path| -> serde_json::Value {
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(store.join("manifest.json")).unwrap()).unwrap();
        m["spine"].clone()
    };
    let run = |extra: &[&str]| -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["convert", "--from", from.to_str().unwrap(), "--to", dir.path().to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = Command::new(env!("CARGO_BIN_EXE_deltafin")).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        (dir, err)
    };
    let (wide, err) = run(&[]);
    let s = spine_of(wide.path());
    assert_eq!(s["matrix_dtype"], "bf16", "{err}");
    let bf16_bytes = s["auto"]["bf16_bytes"].as_u64().unwrap();
    assert_eq!(bf16_bytes, s["bytes"].as_u64().unwrap(), "it weighed the spine it wrote");
    assert!(err.contains("spine: bf16 (Kimi K3's checkpoint precision)") && err.contains("85% of"), "{err}");

    let half = bf16_bytes * 2;
    let (at, err) = run(&["--memory-budget", &half.to_string()]);
    assert_eq!(spine_of(at.path())["matrix_dtype"], "bf16", "exactly half the budget is enough: {err}");
    let (narrow, err) = run(&["--memory-budget", &(half - 1).to_string()]);
    let s = spine_of(narrow.path());
    assert_eq!(s["matrix_dtype"], "int8", "{err}");
    assert_eq!(s["auto"]["budget"], half - 1);
    assert!(err.contains("spine: int8: a bf16 spine") && err.contains("--memory-budget"), "{err}");
    assert!(s["bytes"].as_u64().unwrap() < bf16_bytes);

    let (fixed, err) = run(&["--spine", "int8"]);
    let s = spine_of(fixed.path());
    assert_eq!(s["matrix_dtype"], "int8");
    assert!(s.get("auto").is_none() && !err.contains("spine: "), "{err}");
    let err = fails(&["convert", "--from", from.to_str().unwrap(), "--to", "/nonexistent/x", "--spine", "int4"]);
    assert!(err.contains("expected auto, int8, bf16 or f32"), "{err}");
    let err = fails(&[
        "convert",
        "--from",
        from.to_str().unwrap(),
        "--to",
        "/nonexistent/x",
        "--spine",
        "int8",
        "--memory-budget",
        "1G",
    ]);
    assert!(err.contains("--memory-budget is what --spine auto weighs"), "{err}");
}

/// The memory plan reserves the state store's buffer: with `--state-dir` it counts two sequence
/// states (the live one and one snapshot's bytes), and says so.
#[test]
fn the_plan_reserves_the_state_stores_buffer() {
    let store = convert("k3-small", &[]);
    let states = tempfile::tempdir().unwrap();
    let s = store.path().to_str().unwrap();
    let args = ["generate", "--model", s, "--prompt-tokens", "5,17,3", "--max-tokens", "2", "--json"];
    let plan = |extra: &[&str]| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_str(&ok(&[&args[..], extra].concat())).unwrap();
        v["plan"].clone()
    };
    let (one, two) = (plan(&[]), plan(&["--state-dir", states.path().to_str().unwrap()]));
    assert_eq!((&one["state_copies"], &two["state_copies"]), (&1.into(), &2.into()));
    assert_eq!(two["state_bytes"].as_u64().unwrap(), 2 * one["state_bytes"].as_u64().unwrap());
    let o = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([&args[..7], &["--state-dir", states.path().to_str().unwrap()]].concat())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("(x2: the live state and its snapshots in memory)"), "{err}");
}

/// `generate --state-dir` keeps the prompt's and the turn's state on disk: a later process
/// whose prompt extends either resumes from it (`cached_prompt_tokens`) and generates exactly
/// what a run from scratch does; another numerics mode (another identity) is not served.
#[test]
fn generate_resumes_from_prompt_states_on_disk() {
    let store = convert("k3-small", &[]);
    let s = store.path().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let states = dir.path().join("states");
    let run = |prompt: &[u32], extra: &[&str]| -> serde_json::Value {
        let p = prompt.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
        let mut args =
            vec!["generate", "--model", s, "--prompt-tokens", &p, "--max-tokens", "5", "--ignore-eos", "--json"];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let with = ["--state-dir", states.to_str().unwrap()];
    let first: Vec<u32> = (0..24).map(|i| (i * 37 % 250) + 3).collect();
    let a = run(&first, &with);
    assert_eq!(a["cached_prompt_tokens"], 0);
    assert_eq!(a["prompt_states"]["counters"]["snapshots_written"], 2, "the prompt's and the turn's");
    // A follow-up extending the prompt, and one extending the turn (prompt + 4 fed tokens).
    let mut longer = first.clone();
    longer.extend([7, 8, 9]);
    let mut turn = first.clone();
    turn.extend(a["tokens"].as_array().unwrap()[..4].iter().map(|t| t.as_u64().unwrap() as u32));
    turn.extend([11, 12]);
    for (prompt, cached) in [(&longer, first.len()), (&turn, first.len() + 4)] {
        let b = run(prompt, &with);
        assert_eq!(b["cached_prompt_tokens"], cached);
        assert_eq!(b["tokens"], run(prompt, &[])["tokens"], "resuming changed the tokens");
    }
    let p = first.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let trace = dir.path().join("t.jsonl");
    let err = fails(&[
        "generate",
        "--model",
        s,
        "--prompt-tokens",
        &p,
        "--state-dir",
        states.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(err.contains("--state-dir cannot go with --trace"), "{err}");
    let approx = run(&longer, &["--state-dir", states.to_str().unwrap(), "--approx"]);
    assert_eq!(approx["cached_prompt_tokens"], 0, "approximate numerics are another identity");
    // A prompt in chunks of 8 keeps the state after each whole chunk: a prompt that leaves it
    // after 19 tokens resumes from 16.
    let chunked = dir.path().join("chunked");
    let with = ["--state-dir", chunked.to_str().unwrap(), "--prefill-chunk", "8"];
    let c = run(&first, &with);
    assert_eq!(c["prompt_states"]["counters"]["snapshots_written"], 4, "after 8, 16, 24 tokens and the turn");
    let mut diverging = first[..19].to_vec();
    diverging.extend([1, 2]);
    let d = run(&diverging, &with);
    assert_eq!(d["cached_prompt_tokens"], 16);
    assert_eq!(d["tokens"], run(&diverging, &[])["tokens"]);
}

/// kill -9 at any moment while `generate --state-dir` runs loses at most the snapshot being
/// written: the directory then holds only whole snapshots (the next open deletes the temporary
/// file of an interrupted write), none is refused as corrupt, and every later run generates
/// exactly what a run from scratch does.
#[test]
fn kill_9_while_keeping_states_loses_at_most_that_snapshot() {
    let store = convert("k3-small", &[]);
    let s = store.path().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let states = dir.path().join("states");
    let prompt = |i: u32| -> Vec<u32> { (0..48).map(|j| (j * 31 + i * 7) % 250 + 3).collect() };
    let csv = |p: &[u32]| p.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    for (i, delay_ms) in [0u64, 3, 10, 25, 50, 90, 150, 250, 400].into_iter().enumerate() {
        let p = csv(&prompt(i as u32));
        let mut child = bin()
            .args(["generate", "--model", s, "--prompt-tokens", &p, "--max-tokens", "6", "--ignore-eos", "--json"])
            .args(["--state-dir", states.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
    }
    for i in 0..9u32 {
        let mut p = prompt(i);
        p.extend([5, 6]);
        let p = csv(&p);
        let args = ["generate", "--model", s, "--prompt-tokens", &p, "--max-tokens", "4", "--ignore-eos", "--json"];
        let resumed: serde_json::Value =
            serde_json::from_str(&ok(&[&args[..], &["--state-dir", states.to_str().unwrap()]].concat())).unwrap();
        let scratch: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
        assert_eq!(resumed["tokens"], scratch["tokens"], "prompt {i}");
        assert_eq!(resumed["prompt_states"]["counters"]["dropped"], 0, "a snapshot was torn: {resumed}");
        let cached = resumed["cached_prompt_tokens"].as_u64().unwrap();
        assert!(cached == 0 || cached == 48, "prompt {i}: resumed from {cached} tokens");
    }
    let leftovers: Vec<_> = std::fs::read_dir(&states)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".dfstate"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// `--routing-trace` replays a recorded trace: each token's picks in every MoE layer, and its
/// recorded look-ahead predictions (what prefetch then reads), so that a trained model's routing
/// can drive a store of another shape. Replayed on the store it came from, the replay's own trace
/// equals the recording.
#[test]
fn a_replayed_trace_pins_the_picks_and_the_predictions() {
    let store = convert("k3-small", &[]);
    let s = store.path().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (rec, rep) = (dir.path().join("rec.jsonl"), dir.path().join("rep.jsonl"));
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", s, "--prompt-tokens", "5,17,3,250,9", "--max-tokens", "6"];
        args.extend_from_slice(&["--ignore-eos", "--json"]);
        args.extend_from_slice(extra);
        ok(&args)
    };
    generate(&["--trace", rec.to_str().unwrap()]);
    generate(&["--trace", rep.to_str().unwrap(), "--routing-trace", rec.to_str().unwrap()]);
    let read = |p: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(p).unwrap().lines().skip(1).map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let (a, b) = (read(&rec), read(&rep));
    assert_eq!(a.len(), b.len());
    let mut predictions = 0;
    for (x, y) in a.iter().zip(&b) {
        for (lx, ly) in x["layers"].as_array().unwrap().iter().zip(y["layers"].as_array().unwrap()) {
            assert_eq!(lx["experts"], ly["experts"], "the picks are pinned");
            assert_eq!(lx["predicted_next"], ly["predicted_next"], "the recorded prediction is replayed");
            predictions += lx["predicted_next"].as_array().map_or(0, |p| p.len());
        }
    }
    assert!(predictions > 0, "the recording has look-ahead predictions to replay");
}

/// `--context-fill N` decodes at a context of N tokens without computing their prompt: every MLA
/// layer's latent cache starts with N synthetic positions, so the work a step reports grows by
/// exactly N positions of attention and cache; a context that cannot hold the fill, the prompt
/// and the tokens is refused before anything runs (the latent cache is reserved for it).
#[test]
fn decode_at_a_filled_context_and_contexts_too_short_for_the_run() {
    let store = convert("k3-tiny", &[]);
    let s = store.path().to_str().unwrap();
    let base = ["generate", "--model", s, "--prompt-tokens", "1,2,3", "--max-tokens", "4"];
    let with = |extra: &[&'static str]| -> Vec<&str> { base.iter().chain(extra).copied().collect() };
    let err = fails(&with(&["--context", "6"]));
    assert!(err.contains("need a context of 7 tokens") && err.contains("--context 6"), "{err}");
    let err = fails(&with(&["--context-fill", "100", "--context", "106"]));
    assert!(err.contains("after --context-fill 100") && err.contains("context of 107"), "{err}");
    let run = |fill: &'static str| -> serde_json::Value {
        let out = ok(&with(&["--context-fill", fill, "--context", "2000", "--json"]));
        serde_json::from_str(&out).expect("one JSON object on stdout")
    };
    let (a, b) = (run("0"), run("1000"));
    assert_eq!(b["timing"]["context_fill"], 1000);
    assert_eq!(b["tokens"].as_array().unwrap().len(), 4);
    let w = |v: &serde_json::Value, k: &str| v["timing"]["decode_work"][k].as_f64().unwrap();
    // The last token is decoded after 6 positions without the fill and 1,006 with it; each step
    // touches its own row too: 7 and 1,007 rows of cache.
    assert!(w(&a, "kv_bytes") > 0.0);
    assert_eq!(w(&a, "kv_bytes") * 1007.0, w(&b, "kv_bytes") * 7.0);
    assert!(w(&b, "attention_flops") > w(&a, "attention_flops"));
    assert_eq!(w(&b, "flops") - w(&a, "flops"), w(&b, "attention_flops") - w(&a, "attention_flops"));
    assert_eq!(w(&b, "bytes_touched") - w(&a, "bytes_touched"), w(&b, "kv_bytes") - w(&a, "kv_bytes"));
    // The prompt's own attention runs after the fill, too.
    let pa = |v: &serde_json::Value| v["timing"]["prompt_attention_flops"].as_f64().unwrap();
    assert!(pa(&b) > pa(&a));
}

/// `DELTAFIN_KERNEL_PATH` runs a narrower kernel path than the CPU's best (reports say which),
/// and a value that names no path is refused at start.
#[test]
fn kernel_path_from_the_environment() {
    let store = convert("k3-tiny", &[]);
    let s = store.path().to_str().unwrap();
    let args = ["generate", "--model", s, "--prompt-tokens", "1,2,3", "--max-tokens", "2", "--json"];
    let o = bin().args(args).env("DELTAFIN_KERNEL_PATH", "scalar").output().expect("spawn deltafin");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object on stdout");
    assert_eq!(v["kernel_path"], "scalar");
    let o = bin().args(args).env("DELTAFIN_KERNEL_PATH", "sse9").output().expect("spawn deltafin");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("names no kernel path") && !err.contains("panicked"), "{err}");
}
