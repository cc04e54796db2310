//! The GPU's bf16 and f32 spine products, RMSNorm and softmax against their CPU scalar twins
//! (`deltafin_kernels::scalar`), on whatever adapter opens (`common`).

use deltafin_gpu::dense::DenseProduct;
use deltafin_gpu::ops::RowOps;
use deltafin_gpu::{DenseValues, Gpu, GpuError};
use deltafin_kernels::scalar::{bf16_matvec, f32_matvec, rms_norm, softmax_inplace};
use deltafin_kernels::testdata::bytes;

mod common;
use common::gpu;

fn values(n: usize, seed: u64, spread: f32) -> Vec<f32> {
    bytes(n, seed).iter().map(|&b| (f32::from(b) - 127.5) / 127.5 * spread).collect()
}

/// bf16 bits of either sign with exponents near 1 (random bits would be NaNs and infinities).
fn bf16_bits(n: usize, seed: u64) -> Vec<u16> {
    bytes(n, seed).iter().map(|&b| 0x3f00 | (u16::from(b) & 0x80) << 8 | u16::from(b) & 0x7f).collect()
}

fn check(g: &Gpu, k: &DenseProduct, bf16: bool, rows: usize, cols: usize, n: usize, seed: u64) {
    let (b16, f) = (bf16_bits(rows * cols, seed), values(rows * cols, seed, 1.0));
    let w = g.upload_dense(if bf16 { DenseValues::Bf16(&b16) } else { DenseValues::F32(&f) }, rows, cols).unwrap();
    let xs = values(n * cols, seed + 1, 2.0);
    let xg = g.upload_f32(&xs).unwrap();
    let og = g.zeros_f32(n * rows).unwrap();
    let p = k.bind(g, &w, &xg, n, &og).unwrap();
    p.run(g).unwrap();
    let got = g.read_f32(&og).unwrap();
    let wf: Vec<f32> = if bf16 { b16.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect() } else { f.clone() };
    let mut want = vec![0f32; rows];
    for t in 0..n {
        let x = &xs[t * cols..(t + 1) * cols];
        if bf16 {
            bf16_matvec(&b16, rows, cols, x, &mut want);
        } else {
            f32_matvec(&f, rows, cols, x, &mut want);
        }
        for r in 0..rows {
            let mag: f32 = wf[r * cols..(r + 1) * cols].iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
            let v = got[t * rows + r];
            assert!(
                (v - want[r]).abs() <= 2e-6 * mag + 1e-30,
                "{} {rows} x {cols}, {n} tokens: token {t} row {r}: gpu {v} cpu {} (|w x| sum {mag})",
                if bf16 { "bf16" } else { "f32" },
                want[r]
            );
        }
    }
}

#[test]
fn dense_products_match_the_scalar_twins() {
    let Some(g) = gpu("dense_products_match_the_scalar_twins") else { return };
    let k = DenseProduct::new(&g);
    for bf16 in [true, false] {
        for (i, &(rows, cols, n)) in
            [(1, 32, 1), (37, 96, 1), (9, 1024, 1), (5, 64, 3), (130, 64, 70), (128, 96, 64)].iter().enumerate()
        {
            check(&g, &k, bf16, rows, cols, n, 60 + 7 * i as u64);
        }
    }
    assert!(matches!(g.upload_dense(DenseValues::F32(&[0.0; 16]), 1, 16), Err(GpuError::Shape { .. })));
    assert!(matches!(g.upload_dense(DenseValues::Bf16(&[0; 32]), 2, 32), Err(GpuError::Shape { .. })));
}

#[test]
fn rms_norm_and_softmax_match_the_scalar_twins() {
    let Some(g) = gpu("rms_norm_and_softmax_match_the_scalar_twins") else { return };
    let ops = RowOps::new(&g);
    for (i, &(n, dim)) in [(1, 7), (3, 256), (2, 1000), (5, 7168)].iter().enumerate() {
        let x = values(n * dim, 90 + i as u64, 30.0);
        let w = values(dim, 95 + i as u64, 2.0);
        let (xg, wg, og) = (g.upload_f32(&x).unwrap(), g.upload_f32(&w).unwrap(), g.zeros_f32(n * dim).unwrap());
        let op = ops.bind_rms_norm(&g, &xg, &wg, 1e-6, &og).unwrap();
        ops.run(&g, &op).unwrap();
        let got = g.read_f32(&og).unwrap();
        let mut want = vec![0f32; dim];
        for t in 0..n {
            rms_norm(&x[t * dim..(t + 1) * dim], &w, 1e-6, &mut want);
            for j in 0..dim {
                let v = got[t * dim + j];
                assert!(
                    (v - want[j]).abs() <= 1e-5 * want[j].abs().max(1e-3),
                    "rms_norm {n} x {dim}: [{t}, {j}] gpu {v} cpu {}",
                    want[j]
                );
            }
        }
        let op = ops.bind_softmax(&g, &xg, dim, &og).unwrap();
        ops.run(&g, &op).unwrap();
        let got = g.read_f32(&og).unwrap();
        for t in 0..n {
            let mut want = x[t * dim..(t + 1) * dim].to_vec();
            softmax_inplace(&mut want);
            let sum: f32 = got[t * dim..(t + 1) * dim].iter().sum();
            assert!((sum - 1.0).abs() < 1e-4, "softmax {n} x {dim}: row {t} sums to {sum}");
            for j in 0..dim {
                let v = got[t * dim + j];
                assert!(
                    (v - want[j]).abs() <= 1e-5 * want[j] + 1e-9,
                    "softmax {n} x {dim}: [{t}, {j}] gpu {v} cpu {}",
                    want[j]
                );
            }
        }
    }
    let (x, w) = (g.upload_f32(&[1.0; 10]).unwrap(), g.upload_f32(&[1.0; 3]).unwrap());
    let o = g.zeros_f32(10).unwrap();
    assert!(matches!(ops.bind_rms_norm(&g, &x, &w, 1e-6, &o), Err(GpuError::Shape { .. })));
    assert!(matches!(ops.bind_softmax(&g, &x, 0, &o), Err(GpuError::Shape { .. })));
}
