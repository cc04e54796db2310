//! `deltafin plan --streams 1,2,4,8`: the continuous batch on paper. For N sequences decoding
//! together under a budget, the plan keeps N sequence states (fewer resident spine layers or
//! cache slots than one), each step reads the streamed spine once and the union of the N tokens'
//! experts once: at uniform routing E(1 - (1 - k/E)^N) distinct per MoE layer (within 1% of
//! what `bench --streams` measured on the 2-layer x 896-expert store with a random router), each
//! missing the cache as one token's picks do. Labelled an estimate wherever printed: a step is
//! the drive's time for its bytes or, with a compute rate, N tokens' FLOPs, whichever is longer.

use deltafin_engine::plan::{Budget, PlanRequest, decode_work, human, make_plan};
use deltafin_store::manifest::Manifest;
use serde_json::{Value, json};

use crate::plan_speed::distinct_experts;

/// One row per stream count and drive rate; a count whose states the budget cannot hold says so.
pub fn rows(
    m: &Manifest,
    budget: u64,
    req: &PlanRequest,
    streams: &[usize],
    rates: &[f64],
    gflops: Option<f64>,
) -> Vec<Value> {
    let mut out = Vec::new();
    let k = req.experts_per_token;
    let experts = m.config.num_experts;
    for &n in streams {
        let r = PlanRequest { state_copies: n, ..req.clone() };
        let plan = match make_plan(m, &Budget::given(budget), &r) {
            Ok(p) => p,
            Err(e) => {
                out.push(json!({ "streams": n, "fits": false, "why": format!("{e:#}") }));
                continue;
            }
        };
        let union = distinct_experts(experts, k, n);
        let expert_bytes = plan.expected_expert_bytes_per_token as f64 * union / k as f64;
        let step_bytes = plan.spine_bytes_per_token as f64 + expert_bytes;
        let flops = decode_work(m, k, req.context, req.latent_cache.bytes()).flops * n as f64;
        for &g in rates {
            let disk_s = step_bytes / (g * 1e9);
            let compute_s = gflops.map(|c| flops / (c * 1e9));
            let step_s = disk_s.max(compute_s.unwrap_or(0.0));
            out.push(json!({
                "streams": n, "fits": true, "disk_gbps": g,
                "spine_resident_layers": plan.spine_resident_layers,
                "cache_slots_per_layer": plan.cache_slots_per_layer,
                "distinct_experts_per_layer_per_step": union,
                "spine_bytes_per_step": plan.spine_bytes_per_token,
                "expert_bytes_per_step": expert_bytes,
                "bytes_read_per_generated_token": step_bytes / n as f64,
                "s_per_step": step_s,
                "s_per_token_per_sequence": step_s,
                "aggregate_tokens_per_s": n as f64 / step_s,
                "s_per_generated_token": step_s / n as f64,
                "bound": if compute_s.is_some_and(|c| c > disk_s) { "compute" } else { "drive" },
            }));
        }
    }
    out
}

/// The rows as a table under one budget's plan.
pub fn print(rows: &[Value]) {
    println!("  continuous batch (estimate: uniform routing, cold cache):");
    println!(
        "    {:>7} | {:>6} | {:>8} | {:>13} | {:>9} | {:>11} | {:>10}",
        "streams", "GB/s", "resident", "read/token", "s/step", "s/token/seq", "agg tok/s"
    );
    for r in rows {
        if r["fits"] == false {
            println!(
                "    {:>7} | the budget cannot hold their states: {}",
                r["streams"].as_u64().unwrap_or(0),
                r["why"].as_str().unwrap_or("")
            );
            continue;
        }
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "    {:>7} | {:>6.1} | {:>8} | {:>13} | {:>9.2} | {:>11.2} | {:>10.4}",
            r["streams"].as_u64().unwrap_or(0),
            f("disk_gbps"),
            r["spine_resident_layers"].as_u64().unwrap_or(0),
            human(f("bytes_read_per_generated_token") as u64),
            f("s_per_step"),
            f("s_per_token_per_sequence"),
            f("aggregate_tokens_per_s"),
        );
    }
}
