//! The spine runner (a prompt chunk's int8, bf16 and f32 products, matrices kept on the GPU
//! within a budget) against the CPU's scalar twins, token by token, on whatever adapter opens
//! (`common`).

use deltafin_gpu::GpuError;
use deltafin_gpu::spine::SpineRunner;
use deltafin_kernels::format::Dense;
use deltafin_kernels::scalar::{bf16_matvec, f32_matvec, int8_matvec};
use deltafin_kernels::testdata::bytes;

mod common;
use common::gpu;

fn close(got: &[f32], want: &[f32], mags: &[f32], what: &str) {
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mags).enumerate() {
        assert!((g - w).abs() <= 2e-6 * m + 1e-30, "{what}: output {i}: gpu {g} cpu {w} (|w x| sum {m})");
    }
}

#[test]
fn chunk_products_match_the_scalar_twins_within_the_budget() {
    let Some(g) = gpu("chunk_products_match_the_scalar_twins_within_the_budget") else { return };
    let (rows, cols, n, group) = (72, 96, 20, 32);
    let q: Vec<i8> = bytes(rows * cols, 3).iter().map(|&b| b as i8).collect();
    let sc: Vec<f32> = bytes(rows * cols / group, 4).iter().map(|&b| (f32::from(b) + 1.0) / 4096.0).collect();
    let f: Vec<f32> = bytes(rows * cols, 5).iter().map(|&b| (f32::from(b) - 127.5) / 256.0).collect();
    let h: Vec<u16> = f.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    let xs: Vec<f32> = bytes(n * cols, 6).iter().map(|&b| (f32::from(b) - 127.5) / 64.0).collect();
    let int8_bytes = q.len() + sc.len() * 4;
    // Room for the int8 and f32 matrices, not for the bf16 one after them.
    let runner = SpineRunner::new(g, int8_bytes + f.len() * 4 + h.len());
    let mi = runner.upload(Dense::Int8 { q: &q, scales: &sc, group }, rows, cols).unwrap().unwrap();
    let mf = runner.upload(Dense::F32(&f), rows, cols).unwrap().unwrap();
    assert_eq!(runner.used(), int8_bytes + f.len() * 4);
    assert!(runner.upload(Dense::Bf16(&h), rows, cols).unwrap().is_none(), "past the budget");
    assert_eq!(runner.used(), int8_bytes + f.len() * 4, "a refused upload keeps no room");
    let mut got = vec![0f32; n * rows];
    let (mut want, mut mags) = (vec![0f32; rows], vec![0f32; rows]);
    // Twice each, the second with fewer tokens (the work buffers are reused, not regrown).
    for tokens in [n, n / 2] {
        let out = &mut got[..tokens * rows];
        runner.product(&mi, &xs[..tokens * cols], tokens, out).unwrap();
        for t in 0..tokens {
            let x = &xs[t * cols..(t + 1) * cols];
            int8_matvec(&q, &sc, group, rows, cols, x, &mut want);
            for (r, m) in mags.iter_mut().enumerate() {
                *m = (0..cols).map(|c| (f32::from(q[r * cols + c]) * sc[(r * cols + c) / group] * x[c]).abs()).sum();
            }
            close(&out[t * rows..(t + 1) * rows], &want, &mags, &format!("int8, {tokens} tokens, token {t}"));
        }
        runner.product(&mf, &xs[..tokens * cols], tokens, out).unwrap();
        for t in 0..tokens {
            let x = &xs[t * cols..(t + 1) * cols];
            f32_matvec(&f, rows, cols, x, &mut want);
            for (r, m) in mags.iter_mut().enumerate() {
                *m = (0..cols).map(|c| (f[r * cols + c] * x[c]).abs()).sum();
            }
            close(&out[t * rows..(t + 1) * rows], &want, &mags, &format!("f32, {tokens} tokens, token {t}"));
        }
    }
    // Dropping a matrix gives its bytes back: now the bf16 one fits.
    drop(mf);
    let mh = runner.upload(Dense::Bf16(&h), rows, cols).unwrap().expect("room after a drop");
    runner.product(&mh, &xs, n, &mut got).unwrap();
    for t in 0..n {
        let x = &xs[t * cols..(t + 1) * cols];
        bf16_matvec(&h, rows, cols, x, &mut want);
        for (r, m) in mags.iter_mut().enumerate() {
            *m = (0..cols).map(|c| (f32::from_bits(u32::from(h[r * cols + c]) << 16) * x[c]).abs()).sum();
        }
        close(&got[t * rows..(t + 1) * rows], &want, &mags, &format!("bf16, token {t}"));
    }
    // Bad shapes are errors, not panics, and an upload that fails keeps no room.
    let before = runner.used();
    assert!(matches!(runner.product(&mi, &xs[..cols + 1], 1, &mut got[..rows]), Err(GpuError::Shape { .. })));
    assert!(matches!(runner.upload(Dense::F32(&f[..rows * 40]), rows, 40), Err(GpuError::Shape { .. })));
    assert_eq!(runner.used(), before);
    drop((mi, mh));
    assert_eq!(runner.used(), 0);
}

/// A matrix past the budget goes over for each product: int8, f32 and bf16 in turn through the
/// same kept buffers (a smaller one after a larger), each against its scalar twin, its bytes
/// counted and no budget taken.
#[test]
fn streamed_products_match_the_scalar_twins() {
    let Some(g) = gpu("streamed_products_match_the_scalar_twins") else { return };
    let (cols, n, group) = (96, 18, 32);
    let runner = SpineRunner::new(g, 0);
    let mut sent = 0u64;
    for rows in [72, 40] {
        let q: Vec<i8> = bytes(rows * cols, 13).iter().map(|&b| b as i8).collect();
        let sc: Vec<f32> = bytes(rows * cols / group, 14).iter().map(|&b| (f32::from(b) + 1.0) / 4096.0).collect();
        let f: Vec<f32> = bytes(rows * cols, 15).iter().map(|&b| (f32::from(b) - 127.5) / 256.0).collect();
        let h: Vec<u16> = f.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let xs: Vec<f32> = bytes(n * cols, 16).iter().map(|&b| (f32::from(b) - 127.5) / 64.0).collect();
        let mut got = vec![0f32; n * rows];
        let (mut want, mut mags) = (vec![0f32; rows], vec![0f32; rows]);
        runner.product_streamed(Dense::Int8 { q: &q, scales: &sc, group }, rows, cols, &xs, n, &mut got).unwrap();
        sent += (q.len() + sc.len() * 4) as u64;
        for t in 0..n {
            let x = &xs[t * cols..(t + 1) * cols];
            int8_matvec(&q, &sc, group, rows, cols, x, &mut want);
            for (r, m) in mags.iter_mut().enumerate() {
                *m = (0..cols).map(|c| (f32::from(q[r * cols + c]) * sc[(r * cols + c) / group] * x[c]).abs()).sum();
            }
            close(&got[t * rows..(t + 1) * rows], &want, &mags, &format!("streamed int8 {rows} rows, token {t}"));
        }
        runner.product_streamed(Dense::F32(&f), rows, cols, &xs, n, &mut got).unwrap();
        sent += (f.len() * 4) as u64;
        for t in 0..n {
            let x = &xs[t * cols..(t + 1) * cols];
            f32_matvec(&f, rows, cols, x, &mut want);
            for (r, m) in mags.iter_mut().enumerate() {
                *m = (0..cols).map(|c| (f[r * cols + c] * x[c]).abs()).sum();
            }
            close(&got[t * rows..(t + 1) * rows], &want, &mags, &format!("streamed f32 {rows} rows, token {t}"));
        }
        runner.product_streamed(Dense::Bf16(&h), rows, cols, &xs, n, &mut got).unwrap();
        sent += (h.len() * 2) as u64;
        for t in 0..n {
            let x = &xs[t * cols..(t + 1) * cols];
            bf16_matvec(&h, rows, cols, x, &mut want);
            for (r, m) in mags.iter_mut().enumerate() {
                *m = (0..cols).map(|c| (f32::from_bits(u32::from(h[r * cols + c]) << 16) * x[c]).abs()).sum();
            }
            close(&got[t * rows..(t + 1) * rows], &want, &mags, &format!("streamed bf16 {rows} rows, token {t}"));
        }
    }
    assert_eq!(runner.streamed_bytes(), sent);
    assert_eq!(runner.used(), 0, "streamed matrices take no budget");
    let q = vec![0i8; 10 * cols];
    let r = runner.product_streamed(
        Dense::Int8 { q: &q, scales: &[1.0; 2], group },
        10,
        cols,
        &[0.0; 96],
        1,
        &mut [0.0; 10],
    );
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
}

/// Several kept matrices on one input (a layer's projections of its normed input): each output
/// equals its own product, and the input crossed the bus once.
#[test]
fn products_on_one_input_send_it_once() {
    let Some(g) = gpu("products_on_one_input_send_it_once") else { return };
    let (cols, n, group) = (64, 17, 32);
    let runner = SpineRunner::new(g, 1 << 20);
    let f1: Vec<f32> = bytes(40 * cols, 21).iter().map(|&b| (f32::from(b) - 127.5) / 256.0).collect();
    let f2: Vec<f32> = bytes(24 * cols, 22).iter().map(|&b| (f32::from(b) - 127.5) / 256.0).collect();
    let q: Vec<i8> = bytes(32 * cols, 23).iter().map(|&b| b as i8).collect();
    let sc: Vec<f32> = bytes(32 * cols / group, 24).iter().map(|&b| (f32::from(b) + 1.0) / 4096.0).collect();
    let m1 = runner.upload(Dense::F32(&f1), 40, cols).unwrap().unwrap();
    let m2 = runner.upload(Dense::F32(&f2), 24, cols).unwrap().unwrap();
    let m3 = runner.upload(Dense::Int8 { q: &q, scales: &sc, group }, 32, cols).unwrap().unwrap();
    let xs: Vec<f32> = bytes(n * cols, 25).iter().map(|&b| (f32::from(b) - 127.5) / 64.0).collect();
    let (mut o1, mut o2, mut o3) = (vec![0f32; n * 40], vec![0f32; n * 24], vec![0f32; n * 32]);
    let before = runner.input_bytes();
    runner.products(&[&m1, &m2, &m3], &xs, n, &mut [&mut o1, &mut o2, &mut o3]).unwrap();
    assert_eq!(runner.input_bytes() - before, (xs.len() * 4) as u64, "the input went up once");
    for (m, got, rows) in [(&m1, &o1, 40), (&m2, &o2, 24), (&m3, &o3, 32)] {
        let mut want = vec![0f32; n * rows];
        runner.product(m, &xs, n, &mut want).unwrap();
        assert_eq!(got, &want, "{rows} rows: the same as its own product");
    }
    // Outputs that do not match their matrices are an error.
    let r = runner.products(&[&m1, &m2], &xs, n, &mut [&mut o1, &mut o3]);
    assert!(matches!(r, Err(GpuError::Shape { .. })), "{r:?}");
}
