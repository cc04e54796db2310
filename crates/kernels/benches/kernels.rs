//! `cargo bench -p deltafin-kernels`: the hot kernels at Kimi K3 shapes, as weight bytes per
//! second. `deltafin bench --kernels` reports the same kernels beside the machine's roofs.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use deltafin_kernels::approx::{QuantizedX, mxfp4_matvec_q8_par};
use deltafin_kernels::expert::{Mxfp4, expert_mxfp4};
use deltafin_kernels::{int8_matvec, mxfp4_matvec_par};

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

fn scales(n: usize, seed: u64) -> Vec<u8> {
    bytes(n, seed).into_iter().map(|b| 118 + b % 8).collect()
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
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
