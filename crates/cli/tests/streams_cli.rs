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
        assert_eq!(v["timing"]["decode_step_s"].as_array().unwrap().len() as u64, s["steps"].as_u64().unwrap());
    }
}

#[test]
fn streams_arguments_are_checked() {
    for (args, want) in [
        (&["generate", "--model", "x", "--prompt-tokens", "1", "--join-prompt", "4"][..], "--streams"),
        (&["generate", "--model", "x", "--prompt-tokens", "1", "--streams", "0"][..], "--streams"),
    ] {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-demo/hf");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    assert!(run(&["convert", "--from", demo.to_str().unwrap(), "--to", store]).status.success());
    for (extra, want) in [
        (&["--trace", "t.jsonl"][..], "--streams cannot go with"),
        (&["--context-fill", "8"][..], "--streams cannot go with"),
        (&["--max-tokens", "1"][..], "--max-tokens"),
        (&["--context", "8"][..], "need a context of"),
    ] {
        let mut args = vec!["generate", "--model", store, "--prompt-tokens", "1,2,3", "--streams", "2"];
        args.extend(extra);
        let o = run(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
}
