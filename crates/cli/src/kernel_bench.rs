//! `deltafin bench --kernels`: weight bytes processed per second by each hot kernel, per thread
//! count, beside the two roofs measured in the same run (memory read bandwidth and the FMA rate
//! converted to the format's weight bytes at 2 FLOP per weight).

use std::time::Instant;

use anyhow::Result;
use deltafin_engine::kernel_path;
use deltafin_kernels::expert::{Mxfp4, expert_mxfp4, expert_mxfp4_batch, expert_mxfp4_unfused};
use deltafin_kernels::roofline::{fma_peak_gflops, read_bandwidth_gbps};
use deltafin_kernels::{bf16_matvec, int8_matvec, mxfp4_matvec_par, par::par_rows};
use serde_json::{Value, json};

/// Bytes of weights kept in rotation so products stream from RAM, not from the caches.
const WORKING_SET: usize = 512 << 20;

struct Kernel {
    name: &'static str,
    rows: usize,
    cols: usize,
    /// Stored bytes per weight (MXFP4 4.25 bits; int8 one byte plus a row scale).
    bytes_per_weight: f64,
}

fn run_timed(secs: f64, mut f: impl FnMut()) -> (u64, f64) {
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed().as_secs_f64() < secs || n < 3 {
        f();
        n += 1;
    }
    (n, t0.elapsed().as_secs_f64())
}

use deltafin_kernels::testdata::bytes as fill;

pub fn kernel_bench(json_out: bool, secs: f64) -> Result<()> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads: Vec<usize> = (1..=cores).collect();
    let mem_buf = vec![0x5a5a_5a5a_5a5a_5a5au64; WORKING_SET / 8];
    let mut mem = Vec::new();
    let mut fma = Vec::new();
    for &t in &threads {
        mem.push(read_bandwidth_gbps(&mem_buf, t, secs));
        fma.push(fma_peak_gflops(t, secs.min(0.5)));
    }
    drop(mem_buf);
    let kernels = [
        Kernel { name: "mxfp4 w1/w3 (K3 expert up/gate)", rows: 3072, cols: 3584, bytes_per_weight: 4.25 / 8.0 },
        Kernel { name: "mxfp4 w2 (K3 expert down)", rows: 3584, cols: 3072, bytes_per_weight: 4.25 / 8.0 },
        Kernel { name: "int8 row-scaled (K3 KDA q_proj)", rows: 12288, cols: 7168, bytes_per_weight: 1.0 },
        Kernel { name: "bf16 (K3 KDA q_proj, --spine bf16)", rows: 12288, cols: 7168, bytes_per_weight: 2.0 },
    ];
    let mut rows_out = Vec::new();
    let mut xq = deltafin_kernels::approx::QuantizedX::default();
    for k in &kernels {
        let weights = k.rows * k.cols;
        let bytes = (weights as f64 * k.bytes_per_weight) as usize;
        let copies = (WORKING_SET / bytes).max(2);
        let x: Vec<f32> = (0..k.cols).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect();
        let mut out = vec![0f32; k.rows];
        let mxfp4 = k.name.starts_with("mxfp4");
        let bf16 = k.name.starts_with("bf16");
        // bf16 weights: finite values of either sign, exponents near 1 (random bits would be
        // NaNs and infinities at times).
        let mats16: Vec<Vec<u16>> = (0..if bf16 { copies } else { 0 })
            .map(|c| {
                fill(weights, c as u64 + 1).iter().map(|&b| 0x3f00 | (b as u16 & 0x80) << 8 | b as u16 & 0x7f).collect()
            })
            .collect();
        let mats: Vec<(Vec<u8>, Vec<u8>)> = (0..if bf16 { 0 } else { copies })
            .map(|c| {
                if mxfp4 {
                    let mut sc = fill(weights / 32, c as u64 + 99);
                    sc.iter_mut().for_each(|b| *b = 118 + *b % 8);
                    (fill(weights / 2, c as u64 + 1), sc)
                } else {
                    (fill(weights, c as u64 + 1), Vec::new())
                }
            })
            .collect();
        let scales = vec![0.01f32; k.rows];
        xq.quantize(&x);
        for approx in [false, true] {
            if approx && !mxfp4 {
                continue;
            }
            for (ti, &t) in threads.iter().enumerate() {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
                let mut i = 0usize;
                let (n, s) = pool.install(|| {
                    run_timed(secs, || {
                        if bf16 {
                            let w = &mats16[i % copies];
                            i += 1;
                            return par_rows(k.rows, k.cols, &mut out, |r0, o| {
                                let nr = o.len();
                                bf16_matvec(&w[r0 * k.cols..(r0 + nr) * k.cols], nr, k.cols, &x, o)
                            });
                        }
                        let (p, sc) = &mats[i % copies];
                        i += 1;
                        if approx {
                            deltafin_kernels::approx::mxfp4_matvec_q8_par(p, sc, k.rows, k.cols, &xq, &mut out);
                        } else if mxfp4 {
                            mxfp4_matvec_par(p, sc, k.rows, k.cols, &x, &mut out);
                        } else {
                            // SAFETY-free reinterpretation: int8 values from the random bytes.
                            let q: &[i8] = bytemuck_i8(p);
                            par_rows(k.rows, k.cols, &mut out, |r0, o| {
                                let nr = o.len();
                                int8_matvec(
                                    &q[r0 * k.cols..(r0 + nr) * k.cols],
                                    &scales[r0..r0 + nr],
                                    k.cols,
                                    nr,
                                    k.cols,
                                    &x,
                                    o,
                                )
                            });
                        }
                    })
                });
                let gbps = n as f64 * bytes as f64 / s / 1e9;
                let fma_roof = fma[ti] * 1e9 / 2.0 * k.bytes_per_weight / 1e9;
                let roof = mem[ti].min(fma_roof);
                rows_out.push(json!({
                    "name": if approx { format!("{} APPROX int8 activations", k.name) } else { k.name.to_string() },
                    "shape": [k.rows, k.cols],
                    "threads": t,
                    "gbps": gbps,
                    "memory_gbps": mem[ti],
                    "fma_roof_gbps": fma_roof,
                    "fraction": gbps / roof,
                    "bound": if fma_roof < mem[ti] { "compute (FMA)" } else { "memory" },
                }));
            }
        }
    }
    // The whole routed expert, fused against its separate parts.
    let (inter, lat) = (3072usize, 3584usize);
    let rec = inter * lat * 3 / 2 + inter * lat * 3 / 32;
    let copies = (WORKING_SET / rec).max(2);
    let recs: Vec<Vec<u8>> = (0..copies)
        .map(|c| {
            let mut r = fill(rec, c as u64 + 7);
            // Scales after each packed matrix: keep them in a realistic range, each row's within
            // 3 exponents (as synth's records and the demo model's experts are: approximate mode
            // then runs every row in integers; a wider span takes the exact product).
            let mut off = 0;
            for (p, sc) in [
                (inter * lat / 2, inter * lat / 32),
                (lat * inter / 2, lat * inter / 32),
                (inter * lat / 2, inter * lat / 32),
            ] {
                off += p;
                r[off..off + sc].iter_mut().for_each(|b| *b = 118 + *b % 4);
                off += sc;
            }
            r
        })
        .collect();
    let x: Vec<f32> = (0..lat).map(|i| ((i % 89) as f32 - 44.0) / 64.0).collect();
    let (mut act, mut out) = (vec![0f32; inter], vec![0f32; lat]);
    // A prompt chunk's tokens sharing an expert: one pass over the record serves BATCH inputs.
    const BATCH: usize = 8;
    let xs: Vec<f32> = (0..BATCH * lat).map(|i| ((i % 89) as f32 - 44.0) / 64.0).collect();
    let (mut act_b, mut out_b) = (vec![0f32; BATCH * inter], vec![0f32; BATCH * lat]);
    for mode in ["unfused", "fused", "batch"] {
        for (ti, &t) in threads.iter().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
            let mut i = 0usize;
            let (n, s) = pool.install(|| {
                run_timed(secs, || {
                    let r = &recs[i % copies];
                    i += 1;
                    let (w1, w2, w3) = record_matrices(r, inter, lat);
                    match mode {
                        "fused" => expert_mxfp4(w1, w3, w2, inter, lat, &x, 4.0, Some(25.0), &mut act, &mut out),
                        "batch" => expert_mxfp4_batch(
                            w1,
                            w3,
                            w2,
                            inter,
                            lat,
                            &xs,
                            BATCH,
                            4.0,
                            Some(25.0),
                            &mut act_b,
                            &mut out_b,
                        ),
                        _ => expert_mxfp4_unfused(w1, w3, w2, inter, lat, &x, 4.0, Some(25.0), &mut act, &mut out),
                    }
                })
            });
            // Weight bytes times the inputs they were applied to: what as many single-token
            // products would have had to stream.
            let inputs = if mode == "batch" { BATCH } else { 1 };
            let gbps = n as f64 * (rec * inputs) as f64 / s / 1e9;
            let fma_roof = fma[ti] * 1e9 / 2.0 * (4.25 / 8.0) / 1e9;
            rows_out.push(json!({
                "name": match mode {
                    "fused" => "expert, one call (gate, up, SiTU, down)".to_string(),
                    "batch" => format!("expert, batch of {BATCH} tokens (bytes x tokens)"),
                    _ => "expert unfused (three products)".to_string(),
                },
                "shape": [inter, lat],
                "threads": t,
                "gbps": gbps,
                "memory_gbps": mem[ti],
                "fma_roof_gbps": fma_roof,
                "fraction": gbps / mem[ti].min(fma_roof),
                "bound": if fma_roof < mem[ti] { "compute (FMA)" } else { "memory" },
            }));
        }
    }
    // Prompt chunks, which are compute-bound: FLOPs per second against the FMA roof. The spine's
    // int8 product over a chunk of tokens, and one expert applied to the tokens that chose it
    // (about 18 per expert per layer in a 1,000-token K3 prompt: 1,000 x 16 of 896).
    let mut chunk_rows = Vec::new();
    // 64 tokens: a short chunk; 512: a long prompt's chunk, split into several input shares per
    // thread (`par::input_share`).
    for n in [64usize, 512] {
        let (rows, cols) = (12288usize, 7168usize);
        let q: Vec<i8> = bytemuck_i8(&fill(rows * cols, 31)).to_vec();
        let scales = vec![0.01f32; rows];
        let xs: Vec<f32> = (0..n * cols).map(|i| ((i % 89) as f32 - 44.0) / 64.0).collect();
        let mut outs = vec![0f32; n * rows];
        let flops = 2.0 * (rows * cols * n) as f64;
        for (ti, &t) in threads.iter().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
            let (runs, s) = pool.install(|| {
                run_timed(secs, || deltafin_kernels::int8_matmat(&q, &scales, cols, rows, cols, &xs, n, &mut outs))
            });
            chunk_rows.push(chunk_row(
                format!("int8 spine product, chunk of {n} tokens"),
                [rows, cols],
                t,
                runs as f64 * flops / s,
                fma[ti],
            ));
            // --approx: the same product in integers on int8 activations (quantising included),
            // against its own roof, the integer multiply-adds' (`vpdpbusd`) peak.
            if deltafin_kernels::approx::has_integer_spine() {
                let (runs, s) = pool.install(|| {
                    run_timed(secs, || {
                        deltafin_kernels::approx::int8_matmat_q8(&q, &scales, cols, rows, cols, &xs, n, &mut outs);
                    })
                });
                let int_peak = pool.install(|| deltafin_kernels::roofline::int8_peak_gops(t, 0.3));
                chunk_rows.push(integer_chunk_row(
                    format!("int8 spine product, chunk of {n} tokens, APPROX int8 activations"),
                    [rows, cols],
                    t,
                    runs as f64 * flops / s,
                    fma[ti],
                    int_peak,
                ));
            }
        }
    }
    // 18 tokens: a short chunk's share of an expert; 256: a 1,000-token prompt's (x 16 of 64).
    for tokens in [18usize, 256] {
        let xs: Vec<f32> = (0..tokens * lat).map(|i| ((i % 89) as f32 - 44.0) / 64.0).collect();
        let (mut act_b, mut out_b) = (vec![0f32; tokens * inter], vec![0f32; tokens * lat]);
        let flops = 2.0 * 3.0 * (inter * lat * tokens) as f64;
        for (ti, &t) in threads.iter().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
            let mut i = 0usize;
            let (runs, s) = pool.install(|| {
                run_timed(secs, || {
                    let r = &recs[i % copies];
                    i += 1;
                    let (w1, w2, w3) = record_matrices(r, inter, lat);
                    expert_mxfp4_batch(w1, w3, w2, inter, lat, &xs, tokens, 4.0, Some(25.0), &mut act_b, &mut out_b)
                })
            });
            chunk_rows.push(chunk_row(
                format!("MXFP4 expert, {tokens} tokens"),
                [inter, lat],
                t,
                runs as f64 * flops / s,
                fma[ti],
            ));
            // --approx: the same expert in integers (rows decoded to int8 once per call).
            if deltafin_kernels::approx::has_integer_spine() {
                let mut i = 0usize;
                let (runs, s) = pool.install(|| {
                    run_timed(secs, || {
                        let r = &recs[i % copies];
                        i += 1;
                        let (w1, w2, w3) = record_matrices(r, inter, lat);
                        let (a, o) = (&mut act_b, &mut out_b);
                        deltafin_kernels::approx::expert_mxfp4_batch_q8(
                            w1,
                            w3,
                            w2,
                            inter,
                            lat,
                            &xs,
                            tokens,
                            4.0,
                            Some(25.0),
                            a,
                            o,
                        );
                    })
                });
                let int_peak = pool.install(|| deltafin_kernels::roofline::int8_peak_gops(t, 0.3));
                chunk_rows.push(integer_chunk_row(
                    format!("MXFP4 expert, {tokens} tokens, APPROX int8 activations"),
                    [inter, lat],
                    t,
                    runs as f64 * flops / s,
                    fma[ti],
                    int_peak,
                ));
            }
        }
    }
    let out = json!({
        "prompt_chunk_kernels": chunk_rows,
        "memory_gbps": mem.last().copied().unwrap_or(f64::NAN),
        "fma_gflops": fma.last().copied().unwrap_or(f64::NAN),
        "kernel_path": kernel_path(),
        "numerics": "exact (f32 decode, f32 accumulation)",
        "kernels": rows_out,
    });
    if json_out {
        println!("{out}");
    } else {
        print_table(&out, &threads, &mem, &fma);
    }
    Ok(())
}

/// The w1, w2, w3 matrices of a synthetic expert record laid out as the bench writes it (each
/// `[inter, lat]` matrix's packed nibbles followed by its scales).
fn record_matrices(r: &[u8], inter: usize, lat: usize) -> (Mxfp4<'_>, Mxfp4<'_>, Mxfp4<'_>) {
    let (a, b) = (inter * lat / 2, inter * lat / 32);
    let m =
        |i: usize| Mxfp4 { packed: &r[i * (a + b)..i * (a + b) + a], scales: &r[i * (a + b) + a..(i + 1) * (a + b)] };
    (m(0), m(1), m(2))
}

/// A compute-bound kernel's row: achieved GFLOP/s and its fraction of the FMA roof.
fn chunk_row(name: String, shape: [usize; 2], threads: usize, flops_per_s: f64, fma_gflops: f64) -> Value {
    let gflops = flops_per_s / 1e9;
    json!({ "name": name, "shape": shape, "threads": threads, "gflops": gflops,
            "fma_gflops": fma_gflops, "fraction_of_fma_roof": gflops / fma_gflops })
}

/// [`chunk_row`] of an approximate-mode integer kernel, also against its own roof (`int_peak`,
/// the `vpdpbusd` rate in GOP/s).
fn integer_chunk_row(
    name: String,
    shape: [usize; 2],
    threads: usize,
    ops_per_s: f64,
    fma: f64,
    int_peak: f64,
) -> Value {
    let mut row = chunk_row(name, shape, threads, ops_per_s, fma);
    row["int8_peak_gops"] = json!(int_peak);
    row["fraction_of_int8_roof"] = json!(ops_per_s / 1e9 / int_peak);
    row
}

/// View random bytes as int8 weights.
fn bytemuck_i8(b: &[u8]) -> &[i8] {
    // SAFETY: u8 and i8 have the same size and alignment, and every bit pattern is valid for both.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const i8, b.len()) }
}

fn print_table(out: &Value, threads: &[usize], mem: &[f64], fma: &[f64]) {
    println!("kernel path {}; roofs measured in this run:", out["kernel_path"]);
    for (i, t) in threads.iter().enumerate() {
        println!("  {t} thread(s): memory read {:.1} GB/s, FMA {:.1} GFLOP/s", mem[i], fma[i]);
    }
    println!(
        "{:<36} {:>12} {:>7} {:>9} {:>9} {:>9} {:>8}  bound",
        "kernel", "shape", "threads", "GB/s", "mem GB/s", "FMA GB/s", "fraction"
    );
    for k in out["kernels"].as_array().into_iter().flatten() {
        println!(
            "{:<36} {:>12} {:>7} {:>9.2} {:>9.2} {:>9.2} {:>8.2}  {}",
            k["name"].as_str().unwrap_or(""),
            format!("{}x{}", k["shape"][0], k["shape"][1]),
            k["threads"],
            k["gbps"].as_f64().unwrap_or(0.0),
            k["memory_gbps"].as_f64().unwrap_or(0.0),
            k["fma_roof_gbps"].as_f64().unwrap_or(0.0),
            k["fraction"].as_f64().unwrap_or(0.0),
            k["bound"].as_str().unwrap_or("")
        );
    }
    println!("prompt chunks (compute-bound):");
    println!("{:<44} {:>12} {:>7} {:>9} {:>9} {:>8}", "kernel", "shape", "threads", "GFLOP/s", "FMA roof", "fraction");
    for k in out["prompt_chunk_kernels"].as_array().into_iter().flatten() {
        println!(
            "{:<44} {:>12} {:>7} {:>9.1} {:>9.1} {:>8.2}",
            k["name"].as_str().unwrap_or(""),
            format!("{}x{}", k["shape"][0], k["shape"][1]),
            k["threads"],
            k["gflops"].as_f64().unwrap_or(0.0),
            k["fma_gflops"].as_f64().unwrap_or(0.0),
            k["fraction_of_fma_roof"].as_f64().unwrap_or(0.0),
        );
    }
}
