//! `deltafin generate --streams N` (continuous batching, what `bench --streams` runs): on the
//! trained demo model every stream's tokens are those of its prompt generated alone, stream 0's
//! are the continuation PyTorch recorded, a prompt that joins mid-way goes through in chunks
//! while the streams keep decoding, and the batch reads fewer experts than its streams would
//! apart.

use std::path::Path;
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin")).args(args).output().expect("spawn deltafin")
}

fn ok(args: &[&str]) -> serde_json::Value {
    let o = run(args);
    assert!(o.status.success(), "deltafin {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

/// The command fails with an error that names `want`, without a panic.
fn refused(args: &[&str], want: &str) {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn csv(v: &[u64]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

#[test]
fn streams_decode_together_as_each_would_alone() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo");
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(demo.join("continuation.json")).unwrap()).unwrap();
    let prompt = csv(&ids(&rec["prompt_ids"]));
    let recorded = ids(&rec["tokens"]);
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    let o = run(&["convert", "--from", demo.join("hf").to_str().unwrap(), "--to", store, "--spine", "bf16"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The spine resident, and streamed layer by layer (each step reads each layer once for all).
    for resident in ["8", "0"] {
        let common = ["--model", store, "--resident-spine-layers", resident, "--prefill-chunk", "16", "--json"];
        let mut args = vec!["generate", "--prompt-tokens", &prompt, "--max-tokens", "6", "--streams", "3"];
        args.extend(["--join-prompt", "40"]);
        args.extend(common);
        let v = ok(&args);
        assert_eq!(v["streams"], 3);
        let tokens: Vec<Vec<u64>> = v["stream_tokens"].as_array().unwrap().iter().map(ids).collect();
        let prompts: Vec<String> = v["stream_prompts"].as_array().unwrap().iter().map(|p| csv(&ids(p))).collect();
        assert_eq!(prompts[0], prompt, "stream 0's prompt is the prompt given");
        assert_ne!(prompts[1], prompt, "the other streams have prompts of their own");
        assert!(tokens.iter().all(|t| t.len() >= 6), "every stream decoded its tokens: {tokens:?}");
        let n = tokens[0].len().min(recorded.len());
        assert_eq!(tokens[0][..n], recorded[..n], "stream 0 continues as PyTorch did (resident {resident})");
        for (i, (p, t)) in prompts.iter().zip(&tokens).enumerate() {
            let m = t.len().to_string();
            let mut solo = vec!["generate", "--prompt-tokens", p, "--max-tokens", &m, "--ignore-eos"];
            solo.extend(common);
            let alone = ok(&solo);
            assert_eq!(&ids(&alone["tokens"]), t, "stream {i} in the batch against alone (resident {resident})");
        }
        // The joining prompt: 40 tokens in chunks of 16 is 3 steps, each also decoding the 3
        // streams; the longest of them is the pause, shorter than the whole prompt.
        let j = &v["join"];
        assert_eq!(j["prompt_tokens"], 40);
        assert_eq!(j["steps"], 3);
        assert_eq!(j["streams_decoded_meanwhile"], 9);
        let (pause, whole) = (j["longest_pause_s"].as_f64().unwrap(), j["joining_prompt_s"].as_f64().unwrap());
        assert!(pause > 0.0 && pause < whole, "pause {pause} s, whole prompt {whole} s");
        // Steady decode: every step carried 3 tokens; the union of their experts is at most 3 x 8
        // per layer, and the trained router shares some.
        let s = &v["steady"];
        assert!(s["steps"].as_u64().unwrap() >= 4, "{s}");
        let distinct = s["distinct_experts_per_layer_per_step"].as_f64().unwrap();
        assert!(distinct > 8.0 && distinct <= 24.0, "{distinct}");
        assert!(s["aggregate_tokens_per_s"].as_f64().unwrap() > 0.0);
        let spine = s["spine_bytes_per_generated_token"].as_f64().unwrap();
        if resident == "0" {
            // One pass over the streamed spine per step, shared by the step's 3 tokens (the
            // loader reads one layer ahead, so a step's count may hold the next step's first).
            let per_pass = v["plan"]["spine_bytes_per_token"].as_f64().unwrap();
            let steps = s["steps"].as_f64().unwrap();
            assert!(
                (spine - per_pass / 3.0).abs() <= per_pass / 3.0 / steps + 1.0,
                "spine {spine} per token, {per_pass} per pass"
            );
        } else {
            assert_eq!(spine, 0.0);
        }
        // bench's per-step lists: every decode step, the first too (bench leaves it out).
        assert_eq!(v["timing"]["decode_step_s"].as_array().unwrap().len() as u64, s["steps"].as_u64().unwrap() + 1);
    }
}

/// `--streams N --context-fill F`: every stream starts at a context of F synthetic positions (as
/// `generate --context-fill F` does alone), so the streams are timed at a long context; each
/// stream's tokens are those of its prompt alone at the same fill.
#[test]
fn streams_at_a_filled_context_decode_as_each_would_alone() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo/hf");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    let o = run(&["convert", "--from", demo.to_str().unwrap(), "--to", store, "--spine", "bf16"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let common = ["--model", store, "--context-fill", "300", "--context", "400", "--json"];
    let mut args = vec!["generate", "--prompt-tokens", "5,6,7,8", "--max-tokens", "4", "--streams", "2"];
    args.extend(common);
    let v = ok(&args);
    assert_eq!(v["context_fill"], 300);
    let tokens: Vec<Vec<u64>> = v["stream_tokens"].as_array().unwrap().iter().map(ids).collect();
    let prompts: Vec<String> = v["stream_prompts"].as_array().unwrap().iter().map(|p| csv(&ids(p))).collect();
    for (i, (p, t)) in prompts.iter().zip(&tokens).enumerate() {
        let m = t.len().to_string();
        let mut solo = vec!["generate", "--prompt-tokens", p, "--max-tokens", &m, "--ignore-eos"];
        solo.extend(common);
        assert_eq!(&ids(&ok(&solo)["tokens"]), t, "stream {i} at a filled context against alone");
    }
    // Unfilled, the same streams decode otherwise: the fill is in the attention.
    let mut plain = vec!["generate", "--prompt-tokens", "5,6,7,8", "--max-tokens", "4", "--streams", "2"];
    plain.extend(["--model", store, "--json"]);
    let unfilled: Vec<Vec<u64>> = ok(&plain)["stream_tokens"].as_array().unwrap().iter().map(ids).collect();
    assert_ne!(unfilled, tokens, "the filled context changed nothing");
}

#[test]
fn streams_arguments_are_checked() {
    for (args, want) in [
        (&["generate", "--model", "x", "--prompt-tokens", "1", "--join-prompt", "4"][..], "--streams"),
        (&["generate", "--model", "x", "--prompt-tokens", "1", "--streams", "0"][..], "--streams"),
    ] {
        refused(args, want);
    }
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo/hf");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    assert!(run(&["convert", "--from", demo.to_str().unwrap(), "--to", store]).status.success());
    for (extra, want) in [
        (&["--trace", "t.jsonl"][..], "--streams cannot go with"),
        (&["--repeat", "2"][..], "--streams cannot go with"),
        (&["--context-fill", "8", "--context", "12"][..], "after --context-fill 8"),
        (&["--max-tokens", "1"][..], "--max-tokens"),
        (&["--context", "8"][..], "need a context of"),
    ] {
        let mut args = vec!["generate", "--model", store, "--prompt-tokens", "1,2,3", "--streams", "2"];
        args.extend(extra);
        refused(&args, want);
    }
}

/// `bench --streams 1,3 --join-prompt L`: each configuration's per-step figures become per
/// generated token, beside the one-stream configuration of the same run.
#[test]
fn bench_streams_reports_per_generated_token_beside_solo() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo/hf");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    let o = run(&["convert", "--from", demo.to_str().unwrap(), "--to", store, "--spine", "bf16"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = ok(&[
        "bench",
        "--model",
        store,
        "--runs",
        "1",
        "--max-tokens",
        "5",
        "--probe-reads",
        "16",
        "--streams",
        "1,3",
        "--join-prompt",
        "40",
        "--prefill-chunk",
        "16",
        "--resident-spine-layers",
        "0",
        "--json",
    ]);
    assert_eq!(v["streams"], serde_json::json!([1, 3]));
    let configs = v["configs"].as_array().unwrap();
    assert_eq!(configs.len(), 2);
    let f = |c: &serde_json::Value, k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {c}"));
    for (c, n) in configs.iter().zip([1.0, 3.0]) {
        assert_eq!(c["streams"].as_f64().unwrap(), n);
        // One token of every stream per step.
        let step = f(c, "s_per_step");
        assert_eq!(f(c, "s_per_token_per_sequence"), step);
        assert!((f(c, "aggregate_tokens_per_s") - n / step).abs() < 1e-9 * n / step);
        let (e, sp) = (f(c, "expert_bytes_per_step"), f(c, "spine_bytes_per_step"));
        assert!(sp > 0.0, "the spine is streamed: one pass per step");
        assert!((f(c, "bytes_read_per_generated_token") - (e + sp) / n).abs() < 1.0);
        assert!((f(c, "spine_bytes_per_generated_token") - sp / n).abs() < 1.0);
        let distinct = f(c, "distinct_experts_per_layer_per_step");
        assert!(distinct >= 8.0 && distinct <= 8.0 * n, "{distinct}");
        assert!(f(c, "floor_s_per_step") > 0.0 && f(c, "step_vs_floor") > 0.0);
        // The joining prompt: 40 tokens in chunks of 16.
        assert_eq!(c["join"]["steps"], 3);
        assert!(f(&c["join"], "longest_pause_s") <= f(&c["join"], "joining_prompt_s"));
        // No per-step figure is left under a per-token name.
        assert!(c.get("expert_bytes_per_token").is_none() && c.get("spine_bytes_per_token").is_none());
    }
    let (solo, three) = (&configs[0], &configs[1]);
    assert_eq!(f(solo, "distinct_experts_per_layer_per_step"), 8.0, "one token reads its own 8 experts");
    assert_eq!(f(&solo["vs_solo"], "aggregate_vs_solo"), 1.0);
    let ratio = f(&three["vs_solo"], "bytes_per_generated_token_vs_solo");
    let want = f(three, "bytes_read_per_generated_token") / f(solo, "bytes_read_per_generated_token");
    assert!((ratio - want).abs() < 1e-12);
    // Three streams share each pass over the spine: about a third of its bytes per token.
    let spine_ratio = f(three, "spine_bytes_per_generated_token") / f(solo, "spine_bytes_per_generated_token");
    assert!((spine_ratio - 1.0 / 3.0).abs() < 0.05, "{spine_ratio}");
}

#[test]
fn bench_streams_arguments_are_checked() {
    for (args, want) in [
        (&["bench", "--model", "x", "--join-prompt", "4"][..], "--streams"),
        (&["bench", "--model", "x", "--streams", "1,2", "--vary", "prefetch=on,off"][..], "--vary"),
    ] {
        refused(args, want);
    }
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo/hf");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    assert!(run(&["convert", "--from", demo.to_str().unwrap(), "--to", store]).status.success());
    for (list, want) in [("0", "not in 1..=256"), ("2,2", "listed twice"), ("1,300", "not in 1..=256")] {
        refused(&["bench", "--model", store, "--runs", "1", "--streams", list], want);
    }
}

/// `trace streams` on the demo model's recorded traces: one stream reads its own top-k, more
/// streams share, never more than N x top-k and never fewer than top-k.
#[test]
fn trace_streams_counts_the_union_on_recorded_routing() {
    let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo/traces");
    let files: Vec<String> =
        ["chat", "code", "prose"].iter().map(|f| traces.join(format!("{f}.jsonl")).display().to_string()).collect();
    let mut args = vec!["trace", "streams", "--window", "32", "--streams", "1,2,4", "--json"];
    args.extend(files.iter().map(String::as_str));
    let v = ok(&args);
    let rows = v["rows"].as_array().unwrap();
    let k = v["experts_per_token"].as_f64().unwrap();
    assert_eq!(k, 8.0);
    let distinct: Vec<f64> = rows.iter().map(|r| r["distinct_experts_per_layer_per_step"].as_f64().unwrap()).collect();
    assert_eq!(distinct[0], k, "one stream reads its own top-k");
    for (r, n) in rows.iter().zip([1.0, 2.0, 4.0]) {
        let d = r["distinct_experts_per_layer_per_step"].as_f64().unwrap();
        assert!(d >= k && d <= n * k, "{r}");
        assert!((r["expert_reads_per_generated_token_vs_solo"].as_f64().unwrap() - d / (n * k)).abs() < 1e-12);
    }
    assert!(distinct[1] > distinct[0] && distinct[2] > distinct[1]);
    for (extra, want) in [(&["--window", "0"][..], "--window"), (&["--streams", "1000"][..], "windows of")] {
        let mut args = vec!["trace", "streams"];
        args.extend(extra);
        args.push(&files[0]);
        refused(&args, want);
    }
}

/// `plan --streams` on Kimi K3 on paper: one stream is the plan's own estimate; more streams
/// share the streamed spine (fewer bytes per generated token where it is streamed), keep their
/// states (fewer resident layers), and a budget that cannot hold them says so.
#[test]
fn plan_streams_projects_the_batch_per_budget() {
    let v = ok(&[
        "plan",
        "--preset",
        "kimi-k3",
        "--memory-budget",
        "24G,64G",
        "--disk-gbps",
        "3",
        "--streams",
        "1,2,8",
        "--json",
    ]);
    let plans = v["plans"].as_array().unwrap();
    for p in plans {
        let rows = p["streams"].as_array().unwrap();
        assert_eq!(rows.len(), 3);
        let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
        let solo = &rows[0];
        assert!(
            (f(solo, "s_per_step") - f(&p["estimates"][0], "s_per_token")).abs() < 1e-9,
            "one stream is the plan's estimate"
        );
        assert!((f(solo, "distinct_experts_per_layer_per_step") - 16.0).abs() < 1e-9);
        for w in rows.windows(2) {
            assert!(f(&w[1], "bytes_read_per_generated_token") <= f(&w[0], "bytes_read_per_generated_token"));
            assert!(f(&w[1], "spine_resident_layers") <= f(&w[0], "spine_resident_layers"), "their states take memory");
            assert!(f(&w[1], "aggregate_tokens_per_s") >= f(&w[0], "aggregate_tokens_per_s") * 0.99);
        }
        let eight = &rows[2];
        assert!((f(eight, "aggregate_tokens_per_s") - 8.0 / f(eight, "s_per_step")).abs() < 1e-12);
    }
    // At 24 GB the spine is streamed: 8 streams read well under half the bytes per token.
    let r24 = plans[0]["streams"].as_array().unwrap();
    assert!(
        r24[2]["bytes_read_per_generated_token"].as_f64().unwrap()
            < 0.5 * r24[0]["bytes_read_per_generated_token"].as_f64().unwrap()
    );
    // A budget just above one state's plan cannot hold 256 states.
    let v = ok(&[
        "plan",
        "--preset",
        "kimi-k3",
        "--memory-budget",
        "24G",
        "--disk-gbps",
        "3",
        "--streams",
        "256",
        "--context",
        "131072",
        "--json",
    ]);
    let row = &v["plans"][0]["streams"][0];
    assert_eq!(row["fits"], false, "{row}");
    assert!(row["why"].as_str().unwrap().contains("budget"));
    refused(&["plan", "--preset", "kimi-k3", "--memory-budget", "24G", "--streams", "2"], "--disk-gbps");
}
