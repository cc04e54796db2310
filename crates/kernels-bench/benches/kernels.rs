//! `cargo bench -p deltafin-kernels`: the hot kernels at Kimi K3 shapes, as weight bytes per
//! second. `deltafin bench --kernels` reports the same kernels beside the machine's roofs.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use deltafin_kernels::approx::{QuantizedX, mxfp4_matvec_q8_par};
use deltafin_kernels::expert::{Mxfp4, expert_mxfp4, expert_mxfp4_batch};
use deltafin_kernels::ops::{rms_norm, softmax_inplace};
use deltafin_kernels::{int8_matvec, mxfp4_matvec_par};

use deltafin_kernels::testdata::bytes;

fn scales(n: usize, seed: u64) -> Vec<u8> {
    deltafin_kernels::testdata::scales(n, seed, 118, 8)
}

fn kernels(c: &mut Criterion) {
    let (rows, cols) = (3072usize, 3584usize);
    let (p, s) = (bytes(rows * cols / 2, 1), scales(rows * cols / 32, 2));
    let x: Vec<f32> = (0..cols).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect();
    let mut out = vec![0f32; rows];
    let mut g = c.benchmark_group("k3");
    g.throughput(Throughput::Bytes((p.len() + s.len()) as u64));
    g.bench_function("mxfp4 3072x3584 exact", |b| b.iter(|| mxfp4_matvec_par(&p, &s, rows, cols, &x, &mut out)));
    let mut xq = QuantizedX::default();
    xq.quantize(&x);
    g.bench_function("mxfp4 3072x3584 approx", |b| b.iter(|| mxfp4_matvec_q8_par(&p, &s, rows, cols, &xq, &mut out)));

    let (ir, ic) = (12288usize, 7168usize);
    let q: Vec<i8> = bytes(ir * ic, 3).into_iter().map(|b| b as i8).collect();
    let qs = vec![0.01f32; ir];
    let xi: Vec<f32> = (0..ic).map(|i| ((i % 89) as f32 - 44.0) / 64.0).collect();
    let mut oi = vec![0f32; ir];
    g.throughput(Throughput::Bytes((ir * ic) as u64));
    g.bench_function("int8 12288x7168", |b| b.iter(|| int8_matvec(&q, &qs, ic, ir, ic, &xi, &mut oi)));

    let (inter, lat) = (3072usize, 3584usize);
    let (p1, s1) = (bytes(inter * lat / 2, 4), scales(inter * lat / 32, 5));
    let (p3, s3) = (bytes(inter * lat / 2, 6), scales(inter * lat / 32, 7));
    let (p2, s2) = (bytes(inter * lat / 2, 8), scales(inter * lat / 32, 9));
    let (mut act, mut eo) = (vec![0f32; inter], vec![0f32; lat]);
    g.throughput(Throughput::Bytes((3 * (p1.len() + s1.len())) as u64));
    let (w1, w3, w2) =
        (Mxfp4 { packed: &p1, scales: &s1 }, Mxfp4 { packed: &p3, scales: &s3 }, Mxfp4 { packed: &p2, scales: &s2 });
    g.bench_function("expert fused", |b| {
        b.iter(|| expert_mxfp4(w1, w3, w2, inter, lat, &x, 4.0, Some(25.0), &mut act, &mut eo))
    });
    // Eight prompt tokens through one expert: throughput counts the record once per token.
    let n = 8;
    let xs: Vec<f32> = (0..n * lat).map(|i| ((i % 89) as f32 - 44.0) / 64.0).collect();
    let (mut act_b, mut eo_b) = (vec![0f32; n * inter], vec![0f32; n * lat]);
    g.throughput(Throughput::Bytes((n * 3 * (p1.len() + s1.len())) as u64));
    g.bench_function("expert fused batch 8", |b| {
        b.iter(|| expert_mxfp4_batch(w1, w3, w2, inter, lat, &xs, n, 4.0, Some(25.0), &mut act_b, &mut eo_b))
    });
    g.finish();

    // The small per-token reductions, for scale against the products above: K3's hidden size
    // (an RMSNorm per sub-layer) and its router's 896 logits / a 4096-token attention row.
    let mut s = c.benchmark_group("k3-reductions");
    let h: Vec<f32> = (0..7168).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect();
    let (w, mut o) = (vec![1.0f32; 7168], vec![0f32; 7168]);
    s.throughput(Throughput::Elements(7168));
    s.bench_function("rms_norm 7168", |b| b.iter(|| rms_norm(&h, &w, 1e-6, &mut o)));
    let mut z: Vec<f32> = (0..4096).map(|i| (i % 13) as f32 * 0.1).collect();
    s.throughput(Throughput::Elements(4096));
    s.bench_function("softmax 4096", |b| b.iter(|| softmax_inplace(&mut z)));
    s.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
