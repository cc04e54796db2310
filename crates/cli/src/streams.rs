//! `deltafin generate --streams N`: N sequences decoding together through the continuous
//! batcher (`deltafin_engine::batch`), each with its own prompt, greedy; what `bench --streams`
//! runs in a fresh process per run. Stream 0's prompt is the prompt given; stream i's moves
//! every id by i x 7,919 (mod the vocabulary), so the streams route apart as separate requests
//! would. With `--join-prompt L`, once the streams have decoded their tokens a new sequence with
//! an L-token prompt joins while they keep decoding: its prompt goes through in the plan's
//! chunks beside their tokens, and the longest step meanwhile is the pause a running stream
//! saw.

use std::time::Instant;

use anyhow::{Result, bail};
use deltafin_engine::batch::{Batcher, Next, SeqId, StepReport};
use deltafin_engine::experts::{ExpertSource, Observed};
use deltafin_engine::generate::argmax;
use deltafin_engine::plan::{human, peak_rss_bytes};
use deltafin_engine::session::RunOptions;
use serde_json::json;

use crate::bench::median;
use crate::run::GenerateArgs;

/// Which part of the run a step belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The streams' prompts.
    Prompts,
    /// Every stream decoding, nothing else.
    Decode,
    /// A new prompt joins while the streams decode.
    Join,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Prompts => "prompts",
            Phase::Decode => "decode",
            Phase::Join => "join",
        }
    }
}

/// Stream `i`'s prompt: the given one moved by i x 7,919 ids.
fn stream_prompt(prompt: &[u32], i: usize, vocab: usize) -> Vec<u32> {
    prompt.iter().map(|&t| ((t as u64 + i as u64 * 7919) % vocab.max(1) as u64) as u32).collect()
}

pub fn generate_streams(a: &GenerateArgs, n: usize) -> Result<()> {
    if n == 0 {
        bail!("--streams must be at least 1");
    }
    if a.trace.is_some() || a.routing_locality.is_some() || a.routing_trace.is_some() || a.state_dir.is_some() {
        bail!("--streams cannot go with --trace, --routing-locality, --routing-trace or --state-dir");
    }
    if a.repeat > 1 || a.chat.is_some() {
        bail!("--streams cannot go with --repeat or --chat");
    }
    if a.max_tokens < 2 {
        bail!("--streams needs --max-tokens of at least 2");
    }
    let join = a.join_prompt.unwrap_or(0);
    let opts = RunOptions {
        state_copies: n + usize::from(join > 0),
        log_reads: a.read_log.is_some(),
        ..a.model.run_options()?
    };
    let (store, mut s) = a.model.open_with(&opts)?;
    let prompt = &match (&a.prompt, &a.prompt_tokens) {
        (None, Some(ids)) => ids.clone(),
        (Some(text), None) => match crate::run::load_tokenizer(&store)? {
            Some(t) => t.encode(text),
            None => bail!("this store has no tokenizer; pass --prompt-tokens instead of --prompt"),
        },
        _ => bail!("--streams takes --prompt or --prompt-tokens"),
    };
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    // Each stream's context: the synthetic fill, its prompt, its tokens, and the steps it
    // decodes while a joining prompt goes through (at most one per prompt token, and one more;
    // `bench` sizes --context the same way).
    let fill = a.context_fill;
    let needed = fill + prompt.len() + a.max_tokens + if join > 0 { join + 1 } else { 0 };
    if needed > a.model.context {
        bail!(
            "{} streams of a {}-token prompt{} and --max-tokens {}{} need a context of {needed} tokens, more than --context {}",
            n,
            prompt.len(),
            if fill > 0 { format!(" after --context-fill {fill}") } else { String::new() },
            a.max_tokens,
            if join > 0 { format!(" beside a joining prompt of {join} tokens") } else { String::new() },
            a.model.context
        );
    }
    let vocab = s.model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| stream_prompt(prompt, i, vocab)).collect();
    let mut batcher = Batcher::new(&s.model, n + usize::from(join > 0));
    // With --context-fill, each stream (and the joining prompt) starts at a context of that many
    // synthetic positions, as `generate --context-fill` does for one sequence.
    let model = &s.model;
    let enter = |batcher: &mut Batcher<'_>, p: &[u32]| -> Result<SeqId> {
        if fill == 0 {
            return batcher.join(p.to_vec());
        }
        let mut state = model.new_state();
        model.fill_context_synthetic(&mut state, fill)?;
        batcher.join_from(state, vec![0f32; vocab], p.to_vec())
    };
    let ids: Vec<SeqId> = prompts.iter().map(|p| enter(&mut batcher, p)).collect::<Result<_>>()?;
    let joiner_prompt = stream_prompt(&(0..join as u32).map(|i| i * 7 + 3).collect::<Vec<_>>(), n, vocab);
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut steps: Vec<(Phase, StepReport)> = Vec::new();
    let mut phase = Phase::Prompts;
    let mut joiner: Option<SeqId> = None;
    let mut joiner_done = false;
    let start = Instant::now();
    let mut ttft = None;
    // The streams' prompts' distinct (layer, expert) records: the disk side of their floor.
    let mut seen = std::collections::HashSet::new();
    while !batcher.is_empty() {
        let mut observed;
        let src: &mut dyn ExpertSource = if phase == Phase::Prompts {
            observed = Observed {
                inner: &mut s.experts,
                on_begin: |l: usize, e: &[usize]| seen.extend(e.iter().map(|&e| (l, e))),
            };
            &mut observed
        } else {
            &mut s.experts
        };
        let report = batcher
            .step(src, &mut |id, _state, logits| {
                let t = argmax(logits);
                if Some(id) == joiner {
                    joiner_done = true;
                    return Next::Leave;
                }
                let i = ids.iter().position(|&x| x == id).unwrap_or(0);
                tokens[i].push(t);
                // A stream decodes its tokens, and on while a joining prompt goes through.
                let decoding_on = join > 0 && !joiner_done;
                if tokens[i].len() >= a.max_tokens && !decoding_on { Next::Leave } else { Next::Token(t) }
            })
            .map_err(|e| anyhow::anyhow!("a step of {} streams failed: {e}", e.failed.len()))?;
        steps.push((phase, report));
        if phase == Phase::Prompts && tokens.iter().all(|t| !t.is_empty()) {
            ttft = Some(start.elapsed().as_secs_f64());
            phase = Phase::Decode;
        }
        if phase == Phase::Decode && tokens.iter().all(|t| t.len() >= a.max_tokens) && join > 0 && joiner.is_none() {
            joiner = Some(enter(&mut batcher, &joiner_prompt)?);
            phase = Phase::Join;
        }
    }
    let total_s = start.elapsed().as_secs_f64();
    if let Some(path) = &a.read_log {
        deltafin_engine::stream::replay::write_iolog(&s.take_read_log(), path)?;
    }

    // Steady state: steps where every stream decoded and nothing else ran, the first left out
    // (as bench does for one sequence).
    let decode: Vec<&StepReport> = steps
        .iter()
        .filter(|(p, r)| *p == Phase::Decode && r.decode_tokens == n && r.prompt_tokens == 0)
        .map(|(_, r)| r)
        .collect();
    let steady = &decode[1.min(decode.len())..];
    let sum = |f: &dyn Fn(&StepReport) -> f64| steady.iter().map(|r| f(r)).sum::<f64>();
    let generated = sum(&|r| r.decode_tokens as f64);
    let secs = sum(&|r| r.seconds);
    let expert = sum(&|r| r.expert_bytes as f64);
    let spine = sum(&|r| r.spine_bytes as f64);
    let mut step_s: Vec<f64> = steady.iter().map(|r| r.seconds).collect();
    let k = s.model.config.num_experts_per_token;
    let moe_layers = store.manifest.experts.layers.len().max(1);
    let distinct = sum(&|r| r.distinct_experts as f64) / (steady.len().max(1) * moe_layers) as f64;
    let steady_json = json!({
        "steps": steady.len(),
        "aggregate_tokens_per_s": generated / secs,
        "s_per_token_per_sequence": median(&mut step_s),
        "step_s": { "min": step_s.first(), "max": step_s.last() },
        "expert_bytes_per_generated_token": expert / generated,
        "spine_bytes_per_generated_token": spine / generated,
        "bytes_read_per_generated_token": (expert + spine) / generated,
        "distinct_experts_per_layer_per_step": distinct,
        "experts_per_layer_per_step_if_unshared": (n * k) as f64,
        "disk_idle_fraction": sum(&|r| r.disk_idle_s) / secs,
    });
    // The pause a running stream saw while a prompt joined: the longest step that carried a
    // prompt chunk, against the steady step; without batching the streams would wait for the
    // whole prompt (`joining_prompt_s`).
    let join_steps: Vec<&StepReport> =
        steps.iter().filter(|(p, r)| *p == Phase::Join && r.prompt_tokens > 0).map(|(_, r)| r).collect();
    let join_json = (join > 0).then(|| {
        json!({
            "prompt_tokens": join,
            "chunk": s.model.run().prefill_chunk,
            "steps": join_steps.len(),
            "longest_pause_s": join_steps.iter().map(|r| r.seconds).fold(0.0, f64::max),
            "joining_prompt_s": join_steps.iter().map(|r| r.seconds).sum::<f64>(),
            "streams_decoded_meanwhile": join_steps.iter().map(|r| r.decode_tokens).sum::<usize>(),
        })
    });
    // The decode floor's work for one steady step: each stream's token is computed apart (FLOPs
    // times n), the spine and head are touched once, and the experts of the step's union.
    let last_context = fill + prompt.len() + a.max_tokens;
    let one = deltafin_engine::plan::decode_work(&store.manifest, k, last_context, s.model.latent_cache().bytes());
    let record = store.manifest.experts.record_bytes as f64;
    let extra_experts = ((distinct - k as f64) * moe_layers as f64 * record).max(0.0);
    let decode_work = json!({
        "flops": one.flops * n as f64,
        "attention_flops": one.attention_flops * n as f64,
        "bytes_touched": one.bytes_touched as f64 + extra_experts + one.kv_bytes as f64 * (n as f64 - 1.0),
        "kv_bytes": one.kv_bytes as f64 * n as f64,
    });
    // The streams' prompts as `generate --json` reports one prompt: what bench's time-to-first-
    // token floor is made of.
    let prompt_steps: Vec<&StepReport> =
        steps.iter().filter(|(p, r)| *p == Phase::Prompts && r.prompt_tokens > 0).map(|(_, r)| r).collect();
    let prompt_json = json!({
        "tokens": n * prompt.len(),
        "chunk": prompt_steps.iter().map(|r| r.prompt_tokens).max().unwrap_or(0),
        "chunks": prompt_steps.len(),
        "expert_bytes_read": prompt_steps.iter().map(|r| r.expert_bytes).sum::<u64>(),
        "distinct_experts": seen.len(),
        "spine_bytes_read": prompt_steps.iter().map(|r| r.spine_bytes).sum::<u64>(),
        "borrowed_bytes": prompt_steps.iter().map(|r| r.borrowed_bytes).max().unwrap_or(0),
    });
    let (flops, attention_flops) = deltafin_engine::plan::prompt_flops(&store.manifest, k, fill, prompt.len(), 1);
    // Each stream's prompt apart (with its head once), and the head again for every further
    // prompt step a sequence was in.
    let heads = prompt_steps.iter().map(|r| r.sequences).sum::<usize>().saturating_sub(n);
    let cfg = &store.manifest.config;
    let head = (heads * 2 * cfg.vocab_size * cfg.hidden_size) as f64;
    let (prompt_flops, prompt_attention_flops) = (flops * n as f64 + head, attention_flops * n as f64);
    let report = s.report();
    if a.json {
        let out = json!({
            "streams": n,
            "context_fill": fill,
            "stream_prompts": prompts,
            "stream_tokens": tokens,
            "steady": steady_json,
            "join": join_json,
            "steps": steps.iter().map(|(p, r)| json!({ "phase": p.name(), "step": r })).collect::<Vec<_>>(),
            "model": s.variant(),
            "experts_per_token": k,
            "modified_top_k": s.modified_top_k(),
            "spine_dtype": store.manifest.spine.matrix_dtype,
            "numerics": s.numerics(),
            "approximate": s.model.run().approx,
            "device": s.device(),
            "adapter": s.adapter(),
            "kernel_path": deltafin_engine::kernel_path(),
            "threads": deltafin_engine::threads(),
            // What `bench` reads of one run, here per decode step (one token of every stream),
            // the first included: bench leaves it out, as it does for one sequence.
            "timing": {
                "ttft_s": ttft,
                "prompt_s": ttft,
                "prompt": prompt_json,
                "prompt_flops": prompt_flops,
                "prompt_attention_flops": prompt_attention_flops,
                "decode_step_s": decode.iter().map(|r| r.seconds).collect::<Vec<_>>(),
                "decode_step_bytes": decode.iter().map(|r| r.expert_bytes).collect::<Vec<_>>(),
                "decode_step_disk_idle_s": decode.iter().map(|r| r.disk_idle_s).collect::<Vec<_>>(),
                "decode_work": decode_work,
                "total_s": total_s,
                "expert_bytes_read": report.expert_bytes_read,
            },
            "plan": s.plan,
            "stream": report,
            "spine": s.model.spine_report(),
            "memory_budget_bytes": s.plan.budget_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
        });
        println!("{out}");
    } else {
        for (i, t) in tokens.iter().enumerate() {
            println!("stream {i}: {}", t.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","));
        }
        eprintln!(
            "{n} streams: {:.3} tokens/s together, {:.3} s/token each; {} read per generated token ({} experts, {} spine); {:.1} distinct experts per layer per step (unshared: {})",
            steady_json["aggregate_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            steady_json["s_per_token_per_sequence"].as_f64().unwrap_or(f64::NAN),
            human(((expert + spine) / generated) as u64),
            human((expert / generated) as u64),
            human((spine / generated) as u64),
            distinct,
            n * k,
        );
        if let Some(j) = &join_json {
            eprintln!(
                "a {join}-token prompt joined in {} steps: the longest pause of a running stream {:.3} s (the whole prompt {:.3} s)",
                j["steps"],
                j["longest_pause_s"].as_f64().unwrap_or(f64::NAN),
                j["joining_prompt_s"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
    Ok(())
}
