//! `deltafin bench --streams 1,2,4,8`: the continuous batcher's figures beside the solo ones of
//! the same run. Each value is a configuration interleaved like `--vary` (a fresh
//! `deltafin generate --streams N` per run, paired with the same probes, roofs and replay of its
//! own reads); this module turns a configuration's per-step figures (one token of every stream
//! per step) into per-generated-token ones and prints the table.

use anyhow::{Result, bail};
use deltafin_engine::plan::human;
use serde_json::{Value, json};

/// The median of the finite values.
fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    crate::bench::median(&mut v)
}

/// The configurations for `--streams`: a label and the arguments each run of it adds.
pub fn configs(streams: &[u64], join_prompt: Option<usize>) -> Result<Vec<(String, Vec<String>)>> {
    if streams.is_empty() {
        bail!("--streams wants a list such as 1,2,4,8");
    }
    let mut seen = std::collections::BTreeSet::new();
    for &n in streams {
        if !(1..=256).contains(&n) {
            bail!("--streams: {n} is not in 1..=256");
        }
        if !seen.insert(n) {
            bail!("--streams: {n} is listed twice");
        }
    }
    Ok(streams
        .iter()
        .map(|n| {
            let mut extra = vec!["--streams".to_string(), n.to_string()];
            if let Some(l) = join_prompt {
                extra.extend(["--join-prompt".to_string(), l.to_string()]);
            }
            (format!("streams={n}"), extra)
        })
        .collect())
}

/// A configuration's summary made per generated token: `bench`'s accumulator reads a run's
/// decode steps as tokens, and a step of N streams generates N of them. Adds the streams' own
/// figures (distinct experts per layer per step, the join's pause) from the runs.
pub fn per_generated_token(summary: &mut Value, n: u64) {
    let nf = n as f64;
    let f = |k: &str| summary[k].as_f64().unwrap_or(f64::NAN);
    let step_s = f("s_per_token");
    let expert = f("expert_bytes_per_token") / nf;
    let spine = f("spine_bytes_per_token") / nf;
    let floor_step = f("floor_s_per_token");
    let runs: Vec<&Value> =
        summary["per_run"].as_array().map(|r| r.iter().map(|r| &r["run"]).collect()).unwrap_or_default();
    let of_runs = |get: &dyn Fn(&Value) -> Option<f64>| median(runs.iter().filter_map(|r| get(r)).collect());
    let distinct = of_runs(&|r| r["steady"]["distinct_experts_per_layer_per_step"].as_f64());
    let unshared = runs.first().and_then(|r| r["steady"]["experts_per_layer_per_step_if_unshared"].as_f64());
    let pause = of_runs(&|r| r["join"]["longest_pause_s"].as_f64());
    let joining = of_runs(&|r| r["join"]["joining_prompt_s"].as_f64());
    let join = runs.first().map(|r| r["join"].clone()).unwrap_or(Value::Null);
    let streams = json!({
        "streams": n,
        // Every stream gets one token per step: a sequence's s/token is the step's time.
        "s_per_token_per_sequence": step_s,
        "s_per_step": step_s,
        "aggregate_tokens_per_s": nf / step_s,
        "expert_bytes_per_generated_token": expert,
        "spine_bytes_per_generated_token": spine,
        "bytes_read_per_generated_token": expert + spine,
        "distinct_experts_per_layer_per_step": distinct,
        "experts_per_layer_per_step_if_unshared": unshared,
        "floor_s_per_step": floor_step,
        "floor_aggregate_tokens_per_s": nf / floor_step,
        "step_vs_floor": step_s / floor_step,
        "join": if join.is_null() { Value::Null } else {
            json!({
                "prompt_tokens": join["prompt_tokens"],
                "chunk": join["chunk"],
                "steps": join["steps"],
                "longest_pause_s": pause,
                "joining_prompt_s": joining,
                "pause_vs_step": pause / step_s,
            })
        },
    });
    if let (Some(o), Value::Object(s)) = (summary.as_object_mut(), streams) {
        o.extend(s);
        // The accumulator's per-step byte figures, named per step so nobody reads them as
        // per generated token; a prompt-floor breakdown is not computed for batched prompts.
        for (from, to) in
            [("expert_bytes_per_token", "expert_bytes_per_step"), ("spine_bytes_per_token", "spine_bytes_per_step")]
        {
            if let Some(v) = o.remove(from) {
                o.insert(to.to_string(), v);
            }
        }
        for k in [
            "ttft_floor_s",
            "ttft_vs_floor",
            "prefill_distinct_expert_bytes",
            "prefill_expert_bytes_read",
            "prefill_spine_bytes",
            "prefill_flops",
            "prefill_attention_flops",
        ] {
            o.remove(k);
        }
    }
}

/// Each configuration's ratios to the one-stream configuration of the same run, when listed.
pub fn against_solo(summaries: &mut [Value]) {
    let solo = summaries.iter().find(|s| s["streams"].as_u64() == Some(1)).cloned();
    let Some(solo) = solo else { return };
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    for s in summaries.iter_mut() {
        let ratios = json!({
            "aggregate_vs_solo": f(s, "aggregate_tokens_per_s") / f(&solo, "aggregate_tokens_per_s"),
            "bytes_per_generated_token_vs_solo": f(s, "bytes_read_per_generated_token") / f(&solo, "bytes_read_per_generated_token"),
            "s_per_token_per_sequence_vs_solo": f(s, "s_per_token_per_sequence") / f(&solo, "s_per_token_per_sequence"),
        });
        if let Some(o) = s.as_object_mut() {
            o.insert("vs_solo".into(), ratios);
        }
    }
}

/// The streams table, one row per configuration.
pub fn print_table(summaries: &[Value]) {
    let first = summaries.first().cloned().unwrap_or(Value::Null);
    println!(
        "== {} streams: {} runs each, {}; spine {} ==",
        first["model"].as_str().unwrap_or("?"),
        first["runs"],
        first["cache"].as_str().unwrap_or(""),
        if first["spine_bytes_per_step"].as_f64().unwrap_or(0.0) > 0.0 { "streamed" } else { "resident" },
    );
    println!(
        "{:>7} | {:>9} | {:>8} | {:>12} | {:>11} | {:>11} | {:>20} | {:>9} | {:>6} | {:>9}",
        "streams",
        "agg tok/s",
        "vs solo",
        "s/token/seq",
        "read/token",
        "vs solo",
        "experts/spine",
        "distinct",
        "floor",
        "join"
    );
    for s in summaries {
        let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
        let v = |k: &str| s["vs_solo"][k].as_f64().unwrap_or(f64::NAN);
        let join = s["join"]["longest_pause_s"].as_f64().map(|p| format!("{p:.2} s")).unwrap_or_else(|| "-".into());
        println!(
            "{:>7} | {:>9.4} | {:>7.2}x | {:>12.3} | {:>11} | {:>10.2}x | {:>20} | {:>4.1}/{:<4} | {:>5.2}x | {:>9}",
            s["streams"].as_u64().unwrap_or(0),
            f("aggregate_tokens_per_s"),
            v("aggregate_vs_solo"),
            f("s_per_token_per_sequence"),
            human(f("bytes_read_per_generated_token") as u64),
            v("bytes_per_generated_token_vs_solo"),
            format!(
                "{}/{}",
                human(f("expert_bytes_per_generated_token") as u64),
                human(f("spine_bytes_per_generated_token") as u64)
            ),
            f("distinct_experts_per_layer_per_step"),
            s["experts_per_layer_per_step_if_unshared"].as_f64().unwrap_or(f64::NAN),
            f("step_vs_floor"),
            join,
        );
    }
    println!(
        "agg tok/s: tokens of all streams per second; read/token: expert and spine bytes read per generated token; distinct: experts read per MoE layer per step / if no stream shared one; floor: the step's time against its floor (max of disk at the replay of its own reads, memory, compute); join: the longest step of the running streams while a new prompt went through"
    );
    for s in summaries {
        if let Some(j) = s["join"].as_object() {
            println!(
                "  {} streams: a {}-token prompt joined in {} steps of chunk {}: longest pause {:.3} s ({:.2}x a steady step), the whole prompt {:.3} s",
                s["streams"],
                j["prompt_tokens"],
                j["steps"],
                j["chunk"],
                j["longest_pause_s"].as_f64().unwrap_or(f64::NAN),
                j["pause_vs_step"].as_f64().unwrap_or(f64::NAN),
                j["joining_prompt_s"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
}
