//! `deltafin bench --kernels --device gpu`: the GPU's MXFP4 products at Kimi K3's expert shapes
//! and its int8 and bf16 spine products at K3's largest spine shape, one token and chunks of tokens, beside the GPU's read bandwidth and FMA rate measured in the
//! same run, each product's outputs checked against the CPU's scalar twin on the same inputs.

use anyhow::{Context, Result};
use deltafin_gpu::attention::MlaAttention;
use deltafin_gpu::dense::DenseProduct;
use deltafin_gpu::expert::{ExpertProgram, GpuExpert, Situ};
use deltafin_gpu::int8::Int8Product;
use deltafin_gpu::mxfp4::Mxfp4Product;
use deltafin_gpu::roofline::{bus_gbps, fma_peak_gflops, read_bandwidth_gbps, time_rounds};
use deltafin_gpu::{BoundProduct, DenseValues, Gpu, GpuOptions, GpuVec};
use deltafin_kernels::format::{BLOCK, mxfp4_decode_row};
use deltafin_kernels::testdata::{bytes, scales};
use serde_json::{Value, json};

/// K3's routed expert: gate and up `[3072, 3584]`, down `[3584, 3072]`; 16 of them per token.
const INTER: usize = 3072;
const LATENT: usize = 3584;
const TOP_K: usize = 16;
/// K3's KDA q_proj, its largest spine matrix, int8 with one scale per row.
const SPINE: (usize, usize) = (12288, 7168);

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Mxfp4,
    Int8,
    Bf16,
}

struct Case {
    name: String,
    format: Format,
    rows: usize,
    cols: usize,
    tokens: usize,
}

/// The cases: on a real GPU at full size (a layer's 16 experts in one product, so the matrix is
/// far larger than the GPU's caches); on a CPU-type adapter (llvmpipe) a slice of that, which
/// checks the harness and says nothing about GPUs.
fn cases(software: bool) -> Vec<Case> {
    let e = if software { 1 } else { TOP_K };
    let mut v = vec![
        Case {
            name: format!("mxfp4 one token: gate+up of {e} experts"),
            format: Format::Mxfp4,
            rows: 2 * e * INTER,
            cols: LATENT,
            tokens: 1,
        },
        Case {
            name: format!("mxfp4 one token: down of {e} experts"),
            format: Format::Mxfp4,
            rows: e * LATENT,
            cols: INTER,
            tokens: 1,
        },
    ];
    let chunks: &[usize] = if software { &[32] } else { &[32, 256, 1024, 4096] };
    for &n in chunks {
        v.push(Case {
            name: "mxfp4 chunk: one expert's gate".into(),
            format: Format::Mxfp4,
            rows: INTER,
            cols: LATENT,
            tokens: n,
        });
    }
    let spine_rows = if software { SPINE.0 / 16 } else { SPINE.0 };
    for &n in [1].iter().chain(chunks) {
        let name = if n == 1 { "int8 one token: KDA q_proj, row scales" } else { "int8 chunk: KDA q_proj, row scales" };
        v.push(Case { name: name.into(), format: Format::Int8, rows: spine_rows, cols: SPINE.1, tokens: n });
    }
    for &n in [1].iter().chain(&chunks[..1]) {
        let name = if n == 1 { "bf16 one token: KDA q_proj" } else { "bf16 chunk: KDA q_proj" };
        v.push(Case { name: name.into(), format: Format::Bf16, rows: spine_rows, cols: SPINE.1, tokens: n });
    }
    v
}

/// One matrix's bytes on the host: MXFP4 (packed, E8M0 scales) or int8 (values, row scales).
enum Host {
    Mxfp4(Vec<u8>, Vec<u8>),
    Int8(Vec<i8>, Vec<f32>),
    Bf16(Vec<u16>),
}

impl Host {
    fn make(c: &Case, seed: u64) -> Host {
        match c.format {
            Format::Mxfp4 => {
                Host::Mxfp4(bytes(c.rows * c.cols / 2, seed), scales(c.rows * c.cols / BLOCK, seed + 5, 118, 8))
            }
            Format::Int8 => Host::Int8(
                bytes(c.rows * c.cols, seed).into_iter().map(|b| b as i8).collect(),
                bytes(c.rows, seed + 5).into_iter().map(|b| (f32::from(b) + 1.0) / 8192.0).collect(),
            ),
            // Finite values of either sign, exponents near 1 (random bits would be NaNs at times).
            Format::Bf16 => Host::Bf16(
                bytes(c.rows * c.cols, seed)
                    .iter()
                    .map(|&b| 0x3c00 | (u16::from(b) & 0x80) << 8 | u16::from(b) & 0x7f)
                    .collect(),
            ),
        }
    }

    /// Row r of the matrix, decoded to f32 (scales applied). Shapes: w `[cols]`.
    fn row(&self, r: usize, w: &mut [f32]) {
        let cols = w.len();
        match self {
            Host::Mxfp4(p, s) => {
                mxfp4_decode_row(&p[r * cols / 2..(r + 1) * cols / 2], &s[r * cols / BLOCK..(r + 1) * cols / BLOCK], w)
            }
            Host::Int8(q, s) => {
                w.iter_mut().zip(&q[r * cols..(r + 1) * cols]).for_each(|(o, &v)| *o = f32::from(v) * s[r])
            }
            Host::Bf16(b) => w
                .iter_mut()
                .zip(&b[r * cols..(r + 1) * cols])
                .for_each(|(o, &v)| *o = f32::from_bits(u32::from(v) << 16)),
        }
    }

    /// Row r's product with x by the scalar twin.
    fn row_product(&self, r: usize, x: &[f32]) -> f32 {
        let cols = x.len();
        let mut out = [0f32];
        match self {
            Host::Mxfp4(p, s) => deltafin_kernels::scalar::mxfp4_matvec(
                &p[r * cols / 2..(r + 1) * cols / 2],
                &s[r * cols / BLOCK..(r + 1) * cols / BLOCK],
                1,
                cols,
                x,
                &mut out,
            ),
            Host::Int8(q, s) => deltafin_kernels::scalar::int8_matvec(
                &q[r * cols..(r + 1) * cols],
                &s[r..r + 1],
                cols,
                1,
                cols,
                x,
                &mut out,
            ),
            Host::Bf16(b) => deltafin_kernels::scalar::bf16_matvec(&b[r * cols..(r + 1) * cols], 1, cols, x, &mut out),
        }
        out[0]
    }
}

/// Largest |gpu - cpu| over the outputs checked, relative to that output's sum of |w x|: rows
/// 0..16 and the last row of the first and last token, against the scalar twin.
fn check(host: &Host, c: &Case, xs: &[f32], got: &[f32]) -> f64 {
    let mut w = vec![0f32; c.cols];
    let mut worst = 0f64;
    let rows: Vec<usize> = (0..16.min(c.rows)).chain([c.rows - 1]).collect();
    for r in rows {
        host.row(r, &mut w);
        for t in [0, c.tokens - 1] {
            let x = &xs[t * c.cols..(t + 1) * c.cols];
            let want = host.row_product(r, x);
            let mag: f32 = w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
            let err = f64::from((got[t * c.rows + r] - want).abs()) / f64::from(mag.max(f32::MIN_POSITIVE));
            worst = worst.max(err);
        }
    }
    worst
}

pub fn gpu_kernel_bench(json_out: bool, secs: f64, adapter: Option<String>) -> Result<()> {
    let gpu = Gpu::open(&GpuOptions { allow_software: false, name: adapter })?;
    let software = gpu.is_software();
    eprintln!(
        "GPU: {}{}",
        gpu.adapter(),
        if software { " (CPU-type: small shapes, figures say nothing about GPUs)" } else { "" }
    );
    // Roofs: a buffer far past the caches (an H200's L2 is 50 MB); FMA chains long enough that
    // one dispatch takes milliseconds.
    let read_bytes: u64 = if software { 64 << 20 } else { 2 << 30 };
    let mem = read_bandwidth_gbps(&gpu, read_bytes, secs)?;
    let fma = fma_peak_gflops(&gpu, if software { 32 } else { 4096 }, secs)?;
    eprintln!("roofs: read {mem:.1} GB/s, FMA {fma:.0} GFLOP/s");
    // The bus at a prompt chunk's size (4,096 tokens of K3's 12,288-wide projections: 201 MB).
    let bus_bytes = if software { 16 << 20 } else { 4096 * 12288 * 4 };
    let (up, down) = bus_gbps(&gpu, bus_bytes)?;
    eprintln!(
        "bus ({} each way, the engine's paths): up {up:.1} GB/s, back {down:.1} GB/s",
        deltafin_engine::units::human(bus_bytes as u64)
    );
    let mxfp4 = Mxfp4Product::new(&gpu);
    let int8 = Int8Product::new(&gpu);
    let dense = DenseProduct::new(&gpu);
    let mut rows_out: Vec<Value> = Vec::new();
    for (i, c) in cases(software).iter().enumerate() {
        let seed = 1000 + 10 * i as u64;
        // Two matrices in turn when one is small enough that the caches could hold a good part
        // of it: every call reads its weights from memory.
        let one = match c.format {
            Format::Mxfp4 => c.rows * c.cols / 2 + c.rows * c.cols / BLOCK,
            Format::Int8 => c.rows * c.cols,
            Format::Bf16 => c.rows * c.cols * 2,
        };
        let copies: usize = if one < (256 << 20) { 2 } else { 1 };
        let hosts: Vec<Host> = (0..copies).map(|k| Host::make(c, seed + 100 * k as u64)).collect();
        let xs: Vec<f32> = bytes(c.tokens * c.cols, seed + 9).iter().map(|&b| (f32::from(b) - 127.5) / 128.0).collect();
        let xg = gpu.upload_f32(&xs)?;
        let outs: Vec<GpuVec> = (0..copies).map(|_| gpu.zeros_f32(c.tokens * c.rows)).collect::<Result<_, _>>()?;
        // Upload each copy and bind it; the uploaded matrices live as long as their bindings.
        let mut keep_mx = Vec::new();
        let mut keep_i8 = Vec::new();
        let mut keep_dense = Vec::new();
        let mut bound: Vec<BoundProduct> = Vec::new();
        for (h, o) in hosts.iter().zip(&outs) {
            match h {
                Host::Mxfp4(p, s) => {
                    let w = gpu.upload_mxfp4(p, s, c.rows, c.cols).with_context(|| format!("uploading {}", c.name))?;
                    bound.push(mxfp4.bind(&gpu, &w, &xg, c.tokens, o)?);
                    keep_mx.push(w);
                }
                Host::Int8(q, s) => {
                    let w = gpu
                        .upload_int8(q, s, c.cols, c.rows, c.cols)
                        .with_context(|| format!("uploading {}", c.name))?;
                    bound.push(int8.bind(&gpu, &w, &xg, c.tokens, o)?);
                    keep_i8.push(w);
                }
                Host::Bf16(b) => {
                    let w = gpu
                        .upload_dense(DenseValues::Bf16(b), c.rows, c.cols)
                        .with_context(|| format!("uploading {}", c.name))?;
                    bound.push(dense.bind(&gpu, &w, &xg, c.tokens, o)?);
                    keep_dense.push(w);
                }
            }
        }
        let mut k = 0usize;
        let per = time_rounds(&gpu, secs, |pass| {
            bound[k % copies].encode(pass);
            k += 1;
        })?;
        let err = check(&hosts[0], c, &xs, &gpu.read_f32(&outs[0])?);
        let m = Measured {
            name: &c.name,
            shape: [c.rows, c.cols],
            tokens: c.tokens,
            seconds: per,
            flops: bound[0].flops,
            weight_bytes: bound[0].weight_bytes,
            err,
        };
        rows_out.push(m.report(mem, fma));
    }
    rows_out.extend(expert_rows(&gpu, software, secs, mem, fma)?);
    rows_out.extend(attention_rows(&gpu, software, secs, mem, fma)?);
    rows_out.push(kda_row(&gpu, software, secs, mem, fma)?);
    let a = gpu.adapter();
    let out = json!({
        "device": "gpu",
        "adapter": {"name": a.name, "backend": a.backend, "device_type": a.device_type, "driver": a.driver},
        "roofs": {"read_gbps": mem, "fma_gflops": fma},
        "bus": {"bytes": bus_bytes, "up_gbps": up, "back_gbps": down},
        "kernels": rows_out,
        "git_commit": option_env!("DELTAFIN_BUILD_COMMIT"),
    });
    if json_out {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

/// Whole routed experts (gate and up, SiTU, down): a layer's 16 for one token, as decode runs
/// them (16 experts' four dispatches in one pass), and one expert for chunks of tokens. Checked
/// against `scalar::expert_mxfp4` on the first token's first 16 outputs.
fn expert_rows(gpu: &Gpu, software: bool, secs: f64, mem: f64, fma: f64) -> Result<Vec<Value>> {
    let program = ExpertProgram::new(gpu);
    let situ = Situ { beta: 4.0, linear_beta: Some(25.0) };
    let (inter, latent) = if software { (INTER / 8, LATENT / 8) } else { (INTER, LATENT) };
    let experts = if software { 2 } else { TOP_K };
    let n_mat = inter * latent;
    let mat = |s: u64| (bytes(n_mat / 2, s), scales(n_mat / BLOCK, s + 1, 118, 8));
    let hosts: Vec<[(Vec<u8>, Vec<u8>); 3]> =
        (0..experts as u64).map(|e| [mat(50 + 3 * e), mat(51 + 3 * e), mat(52 + 3 * e)]).collect();
    let on_gpu: Vec<GpuExpert> = hosts
        .iter()
        .map(|h| GpuExpert::upload(gpu, (&h[0].0, &h[0].1), (&h[1].0, &h[1].1), (&h[2].0, &h[2].1), inter, latent))
        .collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let chunks: &[usize] = if software { &[1, 32] } else { &[1, 256, 1024] };
    for &n in chunks {
        let xs: Vec<f32> = bytes(n * latent, 77).iter().map(|&b| (f32::from(b) - 127.5) / 128.0).collect();
        let xg = gpu.upload_f32(&xs)?;
        // One token: every expert of the layer; a chunk: one expert (a prompt's experts each
        // see their share of the chunk's tokens).
        let used = if n == 1 { experts } else { 1 };
        let bound: Vec<_> =
            on_gpu[..used].iter().map(|e| program.bind(gpu, e, &xg, n, situ)).collect::<Result<_, _>>()?;
        let per = time_rounds(gpu, secs, |pass| bound.iter().for_each(|b| program.encode(pass, b)))?;
        let got = gpu.read_f32(&bound[0].out)?;
        let h = &hosts[0];
        let mx = |i: usize| deltafin_kernels::expert::Mxfp4 { packed: &h[i].0, scales: &h[i].1 };
        let (mut act, mut want) = (vec![0f32; inter], vec![0f32; latent]);
        deltafin_kernels::scalar::expert_mxfp4(
            mx(0),
            mx(1),
            mx(2),
            inter,
            latent,
            &xs[..latent],
            situ.beta,
            situ.linear_beta,
            &mut act,
            &mut want,
        );
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        let err = (0..16).map(|r| f64::from((got[r] - want[r]).abs() / scale)).fold(0.0, f64::max);
        let name = if n == 1 {
            format!("expert (gate+up, SiTU, down): {used} experts, one token")
        } else {
            "expert (gate+up, SiTU, down): one expert, a chunk".into()
        };
        let flops = bound.iter().map(|b| b.flops).sum();
        let weight_bytes = bound.iter().map(|b| b.weight_bytes).sum();
        let m = Measured { name: &name, shape: [inter, latent], tokens: n, seconds: per, flops, weight_bytes, err };
        rows.push(m.report(mem, fma));
    }
    Ok(rows)
}

/// Absorbed-MLA attention of a prompt chunk's tokens (the model's calls: 64 tokens, K3's 96
/// heads over a bf16 latent cache of 576 values per position) at contexts of 1,000 to 16,000
/// positions, each call whole as the model pays it (queries and cache rows up, latent outputs
/// back), checked against the CPU's kernel on the same inputs.
fn attention_rows(gpu: &Gpu, software: bool, secs: f64, mem: f64, fma: f64) -> Result<Vec<Value>> {
    use deltafin_kernels::attention::{mla_attend_chunk, mla_attend_scratch};
    use deltafin_kernels::format::LatentRows;
    let (heads, width, kvl) = if software { (16, 576, 512) } else { (96, 576, 512) };
    let tokens = if software { 16 } else { 64 };
    let contexts: &[usize] = if software { &[256] } else { &[1000, 4000, 16000] };
    let mla = MlaAttention::new(gpu);
    let mut rows = Vec::new();
    for &ctx in contexts {
        let first = ctx - tokens;
        let q: Vec<f32> = bytes(heads * tokens * width, 91).iter().map(|&b| (f32::from(b) - 127.5) / 3000.0).collect();
        let cache: Vec<u16> = bytes(ctx * width, 92)
            .iter()
            .map(|&b| deltafin_kernels::format::f32_to_bf16((f32::from(b) - 127.5) / 128.0))
            .collect();
        let mut got = vec![0f32; heads * tokens * kvl]; // [heads, tokens, kvl]
        let rows_of = LatentRows::Bf16(&cache);
        let start = std::time::Instant::now();
        let mut calls = 0u32;
        while calls < 3 || start.elapsed().as_secs_f64() < secs {
            mla.attend(gpu, &q, heads, tokens, first, rows_of, width, kvl, &mut got)?;
            calls += 1;
        }
        let per = start.elapsed().as_secs_f64() / f64::from(calls);
        let mut want = vec![0f32; tokens * heads * kvl]; // [tokens, heads, kvl]
        let mut sc = vec![0f32; mla_attend_scratch(heads, tokens, width)];
        mla_attend_chunk(&q, heads, tokens, first, rows_of, width, kvl, &mut want, &mut sc);
        let mut err = 0f64;
        for h in 0..heads {
            for i in 0..tokens {
                for c in 0..kvl {
                    let d = got[(h * tokens + i) * kvl + c] - want[(i * heads + h) * kvl + c];
                    err = err.max(f64::from(d.abs()));
                }
            }
        }
        let seen: usize = (0..tokens).map(|i| first + i + 1).sum();
        let flops = 2.0 * (heads * seen * (width + kvl)) as f64;
        let name = format!("mla attention call: {heads} heads over {ctx} positions (bf16 cache)");
        let m = Measured {
            name: &name,
            shape: [ctx, width],
            tokens,
            seconds: per,
            flops,
            weight_bytes: (ctx * width * 2) as f64,
            err,
        };
        rows.push(m.report(mem, fma));
    }
    Ok(rows)
}

/// KDA's recurrence over a prompt chunk (K3's 96 heads of 128, 1,024 tokens), the call whole as
/// the model pays it (q, k, decays, v, beta and the state up; outputs and the state back), its
/// first two heads checked against the scalar step.
fn kda_row(gpu: &Gpu, software: bool, secs: f64, mem: f64, fma: f64) -> Result<Value> {
    use deltafin_gpu::kda::KdaRecurrence;
    let (heads, d, t_n) = if software { (2, 128, 16) } else { (96, 128, 1024) };
    let p = heads * d;
    let unit = |seed: u64| -> Vec<f32> {
        let mut v: Vec<f32> = bytes(t_n * p, seed).iter().map(|&b| (f32::from(b) - 127.5) / 128.0).collect();
        for row in v.chunks_mut(d) {
            let n = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
            row.iter_mut().for_each(|x| *x /= n);
        }
        v
    };
    let (q, k) = (unit(31), unit(32));
    let g: Vec<f32> = bytes(t_n * p, 33).iter().map(|&b| 0.6 + 0.4 * f32::from(b) / 256.0).collect();
    let v: Vec<f32> = bytes(t_n * p, 34).iter().map(|&b| (f32::from(b) - 127.5) / 64.0).collect();
    let beta: Vec<f32> = bytes(t_n * heads, 35).iter().map(|&b| 0.05 + 0.9 * f32::from(b) / 256.0).collect();
    let rec = KdaRecurrence::new(gpu, d)?;
    let mut y = vec![0f32; t_n * p]; // [T, heads, D]
    let start = std::time::Instant::now();
    let mut calls = 0u32;
    let mut s = vec![0f32; heads * d * d]; // [heads, D, D]
    while calls < 3 || start.elapsed().as_secs_f64() < secs {
        s.fill(0.0);
        rec.run(gpu, &mut s, &q, &k, &g, &v, &beta, heads, t_n, &mut y)?;
        calls += 1;
    }
    let per = start.elapsed().as_secs_f64() / f64::from(calls);
    let mut err = 0f64;
    let mut scale = 0f64;
    for h in 0..heads.min(2) {
        let (mut sh, mut delta, mut yh) = (vec![0f32; d * d], vec![0f32; d], vec![0f32; d]);
        for t in 0..t_n {
            let o = t * p + h * d..t * p + (h + 1) * d;
            let (qo, ko, go, vo) = (&q[o.clone()], &k[o.clone()], &g[o.clone()], &v[o.clone()]);
            deltafin_kernels::scalar::kda_head_step(&mut sh, qo, ko, vo, go, beta[t * heads + h], &mut delta, &mut yh);
            for (a, b) in y[o].iter().zip(&yh) {
                err = err.max(f64::from((a - b).abs()));
                scale = scale.max(f64::from(b.abs()));
            }
        }
    }
    // Per token and head: the decay (D^2 multiplies), S k and S q (2 D^2 each), the update
    // (2 D^2).
    let flops = 7.0 * (t_n * heads * d * d) as f64;
    let m = Measured {
        name: &format!("kda recurrence call: {heads} heads of {d}"),
        shape: [heads, d],
        tokens: t_n,
        seconds: per,
        flops,
        weight_bytes: (4 * 5 * t_n * p) as f64,
        err: err / scale.max(f64::MIN_POSITIVE),
    };
    Ok(m.report(mem, fma))
}

/// One measured kernel: what it did in how long, and its worst error against the scalar twin.
struct Measured<'a> {
    name: &'a str,
    shape: [usize; 2],
    tokens: usize,
    seconds: f64,
    flops: f64,
    weight_bytes: f64,
    err: f64,
}

impl Measured<'_> {
    /// Print the kernel's line and return its JSON row: rates, their fractions of the roofs
    /// measured in this run (`mem` GB/s, `fma` GFLOP/s), and its floor (its weights read once
    /// at the read roof, or its FLOPs at the FMA roof, whichever is longer).
    fn report(&self, mem: f64, fma: f64) -> Value {
        let (per, wb, fl) = (self.seconds, self.weight_bytes, self.flops);
        let floor = (wb / (mem * 1e9)).max(fl / (fma * 1e9));
        eprintln!(
            "{} [{} x {}] x {} tokens: {:.3} ms, {:.1} GB/s of weights ({:.2} of read roof), {:.0} GFLOP/s ({:.2} of FMA roof), {:.2} of its floor; max error vs scalar {:.1e}",
            self.name,
            self.shape[0],
            self.shape[1],
            self.tokens,
            per * 1e3,
            wb / per / 1e9,
            wb / per / 1e9 / mem,
            fl / per / 1e9,
            fl / per / 1e9 / fma,
            floor / per,
            self.err
        );
        json!({
            "name": self.name, "shape": self.shape, "tokens": self.tokens,
            "seconds": per, "weight_gbps": wb / per / 1e9, "gflops": fl / per / 1e9,
            "of_read_roof": wb / per / 1e9 / mem, "of_fma_roof": fl / per / 1e9 / fma,
            "floor_seconds": floor, "fraction_of_floor": floor / per,
            "bound": if wb / (mem * 1e9) > fl / (fma * 1e9) { "memory" } else { "compute (FMA)" },
            "max_rel_err_vs_scalar": self.err,
        })
    }
}
