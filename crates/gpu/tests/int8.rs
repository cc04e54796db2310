//! The GPU's int8 spine products against their CPU scalar twin (`deltafin_kernels::scalar::
//! int8_matvec`), token by token, on whatever adapter opens (`common`).

use deltafin_gpu::int8::Int8Product;
use deltafin_gpu::{Gpu, GpuError};
use deltafin_kernels::scalar::int8_matvec;
use deltafin_kernels::testdata::bytes;

mod common;
use common::gpu;

/// Run the GPU product on random int8 weights and compare: each output within 2e-6 of the sum
/// of |w x| (f32 sums in another order, and the scale applied per 16 values rather than per group).
fn check(g: &Gpu, k: &Int8Product, rows: usize, cols: usize, group: usize, n: usize, seed: u64) {
    let q: Vec<i8> = bytes(rows * cols, seed).iter().map(|&b| b as i8).collect();
    let groups = cols / group;
    let sc: Vec<f32> = bytes(rows * groups, seed + 1).iter().map(|&b| (f32::from(b) + 1.0) / 4096.0).collect();
    let xs: Vec<f32> = bytes(n * cols, seed + 2).iter().map(|&b| (f32::from(b) - 127.5) / 64.0).collect();
    let w = g.upload_int8(&q, &sc, group, rows, cols).unwrap();
    let xg = g.upload_f32(&xs).unwrap();
    let og = g.zeros_f32(n * rows).unwrap();
    let p = k.bind(g, &w, &xg, n, &og).unwrap();
    p.run(g).unwrap();
    let got = g.read_f32(&og).unwrap();
    let mut want = vec![0f32; rows];
    for t in 0..n {
        let x = &xs[t * cols..(t + 1) * cols];
        int8_matvec(&q, &sc, group, rows, cols, x, &mut want);
        for r in 0..rows {
            let mag: f32 =
                (0..cols).map(|c| (f32::from(q[r * cols + c]) * sc[r * groups + c / group] * x[c]).abs()).sum();
            let v = got[t * rows + r];
            assert!(
                (v - want[r]).abs() <= 2e-6 * mag + 1e-30,
                "{rows} x {cols} (groups of {group}), {n} tokens: token {t} row {r}: gpu {v} cpu {} (|w x| sum {mag})",
                want[r]
            );
        }
    }
}

#[test]
fn one_token_products_match_the_scalar_twin() {
    let Some(g) = gpu("int8 one_token_products_match_the_scalar_twin") else { return };
    let k = Int8Product::new(&g);
    // Per-row scales and groups; rows off the 8-row workgroup; rows of fewer chunks than a team
    // has lanes and of more.
    for (i, &(rows, cols, group)) in
        [(1, 32, 16), (7, 64, 64), (37, 96, 32), (9, 1024, 1024), (20, 2048, 128)].iter().enumerate()
    {
        check(&g, &k, rows, cols, group, 1, 10 + i as u64);
    }
}

#[test]
fn chunk_products_match_the_scalar_twin() {
    let Some(g) = gpu("int8 chunk_products_match_the_scalar_twin") else { return };
    let k = Int8Product::new(&g);
    for (i, &(rows, cols, group, n)) in
        [(1, 32, 16, 2), (5, 64, 32, 3), (128, 96, 96, 64), (70, 128, 64, 33), (130, 64, 16, 70), (129, 32, 32, 65)]
            .iter()
            .enumerate()
    {
        check(&g, &k, rows, cols, group, n, 40 + i as u64);
    }
}

/// Every int8 value, negative ones included, widens exactly: row r holds value r - 128 everywhere
/// (256 rows), a one-hot input picks one column, the scale is one.
#[test]
fn every_value_widens_exactly() {
    let Some(g) = gpu("int8 every_value_widens_exactly") else { return };
    let k = Int8Product::new(&g);
    let (rows, cols) = (256, 32);
    let q: Vec<i8> = (0..rows).flat_map(|r| std::iter::repeat_n((r as i32 - 128) as i8, cols)).collect();
    let w = g.upload_int8(&q, &vec![1.0; rows], cols, rows, cols).unwrap();
    for hot in [0usize, 5, 17, 31] {
        for n in [1usize, 2] {
            let mut xs = vec![0f32; n * cols];
            xs[(n - 1) * cols + hot] = 1.0;
            let xg = g.upload_f32(&xs).unwrap();
            let og = g.zeros_f32(n * rows).unwrap();
            let p = k.bind(&g, &w, &xg, n, &og).unwrap();
            p.run(&g).unwrap();
            let got = g.read_f32(&og).unwrap();
            for r in 0..rows {
                assert_eq!(got[(n - 1) * rows + r], r as f32 - 128.0, "row {r}, column {hot}, {n} tokens");
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let Some(g) = gpu("int8 bad_shapes_are_errors_not_panics") else { return };
    let k = Int8Product::new(&g);
    assert!(matches!(g.upload_int8(&[0; 8], &[1.0], 8, 1, 8), Err(GpuError::Shape { .. })));
    assert!(matches!(g.upload_int8(&[0; 16], &[1.0], 16, 1, 16), Err(GpuError::Shape { .. })));
    assert!(matches!(g.upload_int8(&[0; 32], &[1.0; 2], 24, 1, 32), Err(GpuError::Shape { .. })));
    assert!(matches!(g.upload_int8(&[0; 31], &[1.0], 32, 1, 32), Err(GpuError::Shape { .. })));
    let w = g.upload_int8(&[0; 64], &[1.0; 2], 32, 2, 32).unwrap();
    let x = g.upload_f32(&[0.0; 32]).unwrap();
    let o = g.zeros_f32(2).unwrap();
    assert!(matches!(k.bind(&g, &w, &x, 2, &o), Err(GpuError::Shape { .. })));
    assert!(k.bind(&g, &w, &x, 1, &o).is_ok());
}
