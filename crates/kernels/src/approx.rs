//! Layer 4, operation: approximate mode for MXFP4 products. Activations are quantised per
//! 32-element block to int8 ([`QuantizedX`]: scale = max|x| / 127), weights taken as the exact
//! integers 2·E2M1 in [-12, 12], block dot products in integer arithmetic, then one multiply by
//! both scales. Faster and not exact: every output that uses it is labelled approximate.
//!
//! Imports `format`, `cpu`, `par`, `scalar` and `isa`. Kernels: AVX-512 with VNNI (a capability
//! of [`Path::Avx512`]), else AVX2 (also on AVX-512 CPUs without VNNI); NEON with `sdot`
//! (FEAT_DotProd); else scalar.

use crate::cpu::Path;
#[cfg(target_arch = "x86_64")]
use crate::cpu::has_avx512_vnni;
use crate::format::{BLOCK, Mxfp4};
pub use crate::format::{QuantizedRows, QuantizedX};
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx512, avx512_qtile, avx512_tile, staging};
use crate::par::par_rows;
use crate::scalar;

/// The approximate product on the best path (AVX-512 VNNI, else AVX2, else scalar; the integer
/// sums are exact, so a SIMD path equals the scalar one up to the order of the final f32
/// accumulation). Shapes as `mxfp4_matvec`, with `xq` quantised from x `[cols]`.
pub fn mxfp4_matvec_q8(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    mxfp4_matvec_q8_on(Path::best(), packed, scales, rows, cols, xq, out);
}

/// [`mxfp4_matvec_q8`] on `path`: its VNNI kernel where [`Path::Avx512`] has VNNI, the AVX2
/// kernel on AVX-512 without it, scalar where this CPU lacks `path`.
pub fn mxfp4_matvec_q8_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    assert!(cols.is_multiple_of(BLOCK));
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(xq.q.len(), cols);
    assert_eq!(xq.scales.len(), cols / BLOCK);
    assert_eq!(out.len(), rows);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW (an available path) and VL/VNNI (the guard) present; shapes
        // asserted above.
        Path::Avx512 if has_avx512_vnni() => unsafe {
            avx512::mxfp4_matvec_q8_vnni(packed, scales, rows, cols, xq, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 present (an available path; AVX-512 implies it); shapes asserted above.
        Path::Avx512 | Path::Avx2 => unsafe { avx2::mxfp4_matvec_q8(packed, scales, rows, cols, xq, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON (an available path) and DotProd (the guard) present; shapes asserted above.
        Path::Neon if crate::cpu::has_neon_dotprod() => unsafe {
            neon::mxfp4_matvec_q8_dot(packed, scales, rows, cols, xq, out)
        },
        _ => scalar::mxfp4_matvec_q8(packed, scales, rows, cols, xq, out),
    }
}

/// Row-parallel [`mxfp4_matvec_q8`].
pub fn mxfp4_matvec_q8_par(packed: &[u8], scales: &[u8], rows: usize, cols: usize, xq: &QuantizedX, out: &mut [f32]) {
    mxfp4_matvec_q8_par_on(Path::best(), packed, scales, rows, cols, xq, out);
}

/// Row-parallel [`mxfp4_matvec_q8_on`].
pub fn mxfp4_matvec_q8_par_on(
    path: Path,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xq: &QuantizedX,
    out: &mut [f32],
) {
    let (half, nb) = (cols / 2, cols / BLOCK);
    par_rows(rows, cols, out, |r0, o| {
        let n = o.len();
        mxfp4_matvec_q8_on(path, &packed[r0 * half..(r0 + n) * half], &scales[r0 * nb..(r0 + n) * nb], n, cols, xq, o)
    });
}

/// The routed expert in approximate mode: `w2 · situ(w1 · x, w3 · x)` with int8 activations
/// (`xq` is the expert input quantised once per layer; `aq` is scratch for the SiTU output).
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_approx(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    xq: &QuantizedX,
    beta: f32,
    linear_beta: Option<f32>,
    gate_up: &mut [f32],
    act: &mut [f32],
    aq: &mut QuantizedX,
    out: &mut [f32],
) {
    expert_mxfp4_approx_on(Path::best(), w1, w3, w2, inter, latent, xq, beta, linear_beta, gate_up, act, aq, out);
}

/// [`expert_mxfp4_approx`] with its products on `path`.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_approx_on(
    path: Path,
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    xq: &QuantizedX,
    beta: f32,
    linear_beta: Option<f32>,
    gate_up: &mut [f32],
    act: &mut [f32],
    aq: &mut QuantizedX,
    out: &mut [f32],
) {
    assert_eq!(gate_up.len(), inter);
    mxfp4_matvec_q8_par_on(path, w1.packed, w1.scales, inter, latent, xq, gate_up);
    mxfp4_matvec_q8_par_on(path, w3.packed, w3.scales, inter, latent, xq, act);
    // act <- situ(gate, up), in place over the up values.
    for (a, &g) in act.iter_mut().zip(gate_up.iter()) {
        let mut o = [0f32];
        scalar::situ(&[g], &[*a], beta, linear_beta, &mut o);
        *a = o[0];
    }
    aq.quantize(act);
    mxfp4_matvec_q8_par_on(path, w2.packed, w2.scales, latent, inter, aq, out);
}

/// Whether prompt chunks' int8 spine products have an integer kernel on this CPU (AVX-512
/// VNNI; elsewhere approximate mode leaves them exact: the scalar integer product is slower
/// than the exact SIMD one).
pub fn has_integer_spine() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Path::best() == Path::Avx512 && has_avx512_vnni()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Rows of `W x` for inputs `t0..t0+n` of `xq` on `path`: the VNNI tiles where [`Path::Avx512`]
/// has VNNI, else the scalar oracle ([`scalar::int8_matvec_q8`]), bit for bit the same.
/// `out[j * ts + r * rs]`. Shapes: q `[rows, cols]`, scales `[rows, cols/group]`.
#[allow(clippy::too_many_arguments)]
pub fn int8_rows_q8_on(
    path: Path,
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    xq: &QuantizedRows,
    t0: usize,
    n: usize,
    out: &mut [f32],
    (ts, rs): (usize, usize),
) {
    let cols = xq.cols;
    assert!(xq.seg > 0 && group.is_multiple_of(xq.seg) && cols.is_multiple_of(group));
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group) && t0 + n <= xq.n);
    assert!(n == 0 || rows == 0 || out.len() > (n - 1) * ts + (rows - 1) * rs);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW (an available path) and VNNI (the guard) present; shapes asserted
        // above and again by the kernel.
        Path::Avx512 if has_avx512_vnni() => unsafe {
            avx512_qtile::int8_rows_q8(q, scales, group, rows, cols, xq, t0, n, out, (ts, rs))
        },
        _ => {
            let mut o = vec![0f32; rows];
            for j in 0..n {
                let (x, s, _) = xq.input(t0 + j);
                scalar::int8_matvec_q8(q, scales, group, rows, cols, x, s, xq.seg, &mut o);
                for (r, &v) in o.iter().enumerate() {
                    out[j * ts + r * rs] = v;
                }
            }
        }
    }
}

/// MXFP4 rows as int8 ([`scalar::mxfp4_row_to_int8`]) on `path`: `q` `[rows, cols]`,
/// `row_scales` `[rows]`, NaN for a row int8 cannot hold exactly (its `q` row unspecified).
pub fn mxfp4_rows_to_int8_on(path: Path, m: Mxfp4, rows: usize, cols: usize, q: &mut [i8], row_scales: &mut [f32]) {
    assert!(cols.is_multiple_of(BLOCK) && m.packed.len() >= rows * cols / 2 && m.scales.len() >= rows * cols / BLOCK);
    assert!(q.len() >= rows * cols && row_scales.len() >= rows);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW present (an available path); shapes asserted above.
        Path::Avx512 => unsafe { avx512_qtile::mxfp4_rows_to_int8(m.packed, m.scales, rows, cols, q, row_scales) },
        _ => {
            let (half, nb) = (cols / 2, cols / BLOCK);
            for r in 0..rows {
                let (p, s) = (&m.packed[r * half..(r + 1) * half], &m.scales[r * nb..(r + 1) * nb]);
                row_scales[r] = scalar::mxfp4_row_to_int8(p, s, &mut q[r * cols..(r + 1) * cols]).unwrap_or(f32::NAN);
            }
        }
    }
}

/// `out[t] = W xs[t]` for `n` inputs and an MXFP4 matrix in approximate mode: the rows decoded
/// to int8 exactly (a block of rows at a time, on the thread that computes it, so each row is
/// decoded once for all the inputs) and multiplied in integers with `xq` (the inputs
/// quantised); a row int8 cannot hold exactly takes the exact f32 product with `xs`. Rows are
/// split over the thread pool. Shapes: xs `[n, cols]`, xq the same quantised, out `[n, rows]`.
#[allow(clippy::too_many_arguments)]
pub fn mxfp4_matmat_q8_on(
    path: Path,
    m: Mxfp4,
    rows: usize,
    cols: usize,
    xs: &[f32],
    xq: &QuantizedRows,
    n: usize,
    out: &mut [f32],
) {
    use rayon::prelude::*;
    thread_local! {
        // A block of decoded rows and their scales, per thread, reused.
        static DECODED: std::cell::RefCell<(Vec<i8>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    assert!(xq.cols == cols && xq.n >= n && xs.len() >= n * cols && out.len() >= n * rows);
    assert!(m.packed.len() >= rows * cols / 2 && m.scales.len() >= rows * cols / BLOCK);
    if rows == 0 || n == 0 {
        return;
    }
    let (half, nb) = (cols / 2, cols / BLOCK);
    // The rows int8 cannot hold take the exact product: on AVX-512 the exact tiles, all the
    // inputs at once, on the inputs deinterleaved once, by the first block that needs them
    // (where every row is int8, nothing is deinterleaved or allocated).
    #[cfg(target_arch = "x86_64")]
    let xd = std::sync::OnceLock::<Vec<f32>>::new();
    #[cfg(target_arch = "x86_64")]
    let deinterleaved = || {
        xd.get_or_init(|| {
            let mut d = vec![0f32; n * cols];
            for (x, o) in xs[..n * cols].chunks_exact(cols).zip(d.chunks_exact_mut(cols)) {
                staging::deinterleave(x, o);
            }
            d
        })
    };
    // 64 rows: 224 KiB of int8 at K3's latent width, in L2 while the inputs pass.
    const BLOCK_ROWS: usize = 64;
    crate::par::with_staged_rows(rows, n, &mut out[..n * rows], |staged| {
        let one = |(i, st): (usize, &mut [f32])| {
            let r0 = i * BLOCK_ROWS;
            let k = st.len() / n;
            DECODED.with(|d| {
                let (q, s) = &mut *d.borrow_mut();
                q.resize(k * cols, 0);
                s.resize(k, 0.0);
                let mb =
                    Mxfp4 { packed: &m.packed[r0 * half..(r0 + k) * half], scales: &m.scales[r0 * nb..(r0 + k) * nb] };
                mxfp4_rows_to_int8_on(path, mb, k, cols, q, s);
                // Runs of consecutive rows int8 holds (in integers) and of rows it cannot.
                let mut r = 0;
                while r < k {
                    if !s[r].is_nan() {
                        let e = (r..k).find(|&j| s[j].is_nan()).unwrap_or(k);
                        let (qr, sr) = (&q[r * cols..e * cols], &s[r..e]);
                        int8_rows_q8_on(path, qr, sr, cols, e - r, xq, 0, n, &mut st[r * n..e * n], (1, n));
                        r = e;
                        continue;
                    }
                    let e = (r..k).find(|&j| !s[j].is_nan()).unwrap_or(k);
                    let (p, sc) = (&mb.packed[r * half..e * half], &mb.scales[r * nb..e * nb]);
                    let o = &mut st[r * n..e * n];
                    #[cfg(target_arch = "x86_64")]
                    if path.or_scalar() == Path::Avx512 {
                        // SAFETY: AVX-512F/BW present (the path); rows r..e of this block, the
                        // n deinterleaved inputs, out [e - r, n]: the kernel asserts the shapes.
                        unsafe { avx512_tile::mxfp4_rows(p, sc, e - r, cols, deinterleaved(), n, o) };
                        r = e;
                        continue;
                    }
                    for j in 0..e - r {
                        let (pj, sj) = (&p[j * half..(j + 1) * half], &sc[j * nb..(j + 1) * nb]);
                        for t in 0..n {
                            let mut v = [0f32];
                            crate::mxfp4::mxfp4_matvec_on(path, pj, sj, 1, cols, &xs[t * cols..(t + 1) * cols], &mut v);
                            o[j * n + t] = v[0];
                        }
                    }
                    r = e;
                }
            });
        };
        if rows * cols * n < crate::par::PAR_MIN_WEIGHTS {
            staged.chunks_mut(BLOCK_ROWS * n).enumerate().for_each(one);
        } else {
            staged.par_chunks_mut(BLOCK_ROWS * n).enumerate().for_each(one);
        }
    });
}

/// The routed expert for `n` inputs in approximate mode, a prompt chunk's: `w2 · situ(w1 · x,
/// w3 · x)` with the inputs and the SiTU outputs quantised to int8 in segments and the products
/// in integers ([`mxfp4_matmat_q8_on`]). False (nothing written) where this CPU has no integer
/// kernel ([`has_integer_spine`]) or a width has no segment: the caller runs another product.
/// Shapes: xs `[n, latent]`, act `[n, inter]` (scratch), out `[n, latent]`.
#[allow(clippy::too_many_arguments)]
pub fn expert_mxfp4_batch_q8(
    w1: Mxfp4,
    w3: Mxfp4,
    w2: Mxfp4,
    inter: usize,
    latent: usize,
    xs: &[f32],
    n: usize,
    beta: f32,
    linear_beta: Option<f32>,
    act: &mut [f32],
    out: &mut [f32],
) -> bool {
    thread_local! {
        static BUFS: std::cell::RefCell<(QuantizedRows, Vec<f32>, Vec<f32>)> = std::cell::RefCell::new(Default::default());
    }
    let (Some(seg_in), Some(seg_mid)) = (QuantizedRows::seg_for(latent), QuantizedRows::seg_for(inter)) else {
        return false;
    };
    if !has_integer_spine() {
        return false;
    }
    assert!(xs.len() >= n * latent && act.len() >= n * inter && out.len() >= n * latent);
    BUFS.with(|b| {
        let (xq, gate, up) = &mut *b.borrow_mut();
        gate.resize(n * inter, 0.0); // [n, inter]
        up.resize(n * inter, 0.0); // [n, inter]
        xq.quantize(xs, n, latent, seg_in);
        mxfp4_matmat_q8_on(Path::best(), w1, inter, latent, xs, xq, n, gate);
        mxfp4_matmat_q8_on(Path::best(), w3, inter, latent, xs, xq, n, up);
        crate::ops::situ(gate, up, beta, linear_beta, &mut act[..n * inter]);
        xq.quantize(act, n, inter, seg_mid);
        mxfp4_matmat_q8_on(Path::best(), w2, latent, inter, act, xq, n, out);
    });
    true
}

/// `outs[t] = W xs[t]` for a prompt chunk of `n` inputs in approximate mode: the inputs
/// quantised to int8 in segments ([`QuantizedRows`]), the products in integers on the VNNI
/// tiles, the inputs split over the thread pool and the rows in blocks that stay in the core's
/// L2 cache while a share's inputs pass. False (nothing written) where this CPU has no integer
/// kernel ([`has_integer_spine`]) or the weights' scale groups are not a multiple of 64: the
/// caller runs the exact product. Shapes: q `[rows, cols]`, scales `[rows, cols/group]`, xs
/// `[n, cols]`, outs `[n, rows]`.
#[allow(clippy::too_many_arguments)]
pub fn int8_matmat_q8(
    q: &[i8],
    scales: &[f32],
    group: usize,
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    outs: &mut [f32],
) -> bool {
    thread_local! {
        // The calling thread's quantised chunk, reused (no allocation once warm).
        static XQ: std::cell::RefCell<QuantizedRows> = std::cell::RefCell::new(QuantizedRows::default());
    }
    let Some(seg) = QuantizedRows::seg_for(group) else { return false };
    if !has_integer_spine() || group == 0 || !cols.is_multiple_of(group) {
        return false;
    }
    assert!(q.len() >= rows * cols && scales.len() >= rows * (cols / group));
    assert!(xs.len() >= n * cols && outs.len() == n * rows);
    if rows == 0 || n == 0 {
        return true;
    }
    XQ.with(|b| {
        let xq = &mut *b.borrow_mut();
        xq.quantize(xs, n, cols, seg);
        let xq = &*xq;
        // About 256 KiB of int8 weights per block: with the share's inputs a quarter the size of
        // f32 ones, the block can be twice the exact product's and still leave L2 room.
        let block = ((256 << 10) / cols.max(1)).next_multiple_of(4);
        let g = cols / group;
        crate::par::by_input_shares(rows, cols, n, block, outs, |t0, n_tok, r0, m, o| {
            let (qb, sb) = (&q[r0 * cols..(r0 + m) * cols], &scales[r0 * g..(r0 + m) * g]);
            int8_rows_q8_on(Path::best(), qb, sb, group, m, xq, t0, n_tok, o, (rows, 1));
        });
    });
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paths to check: every available one (AVX-512 without VNNI runs the AVX2 kernel).
    fn paths() -> impl Iterator<Item = Path> {
        Path::ALL.into_iter().filter(|p| {
            if !p.available() {
                println!("SKIPPED approximate path {p:?}: this CPU lacks it");
            } else if *p == Path::Avx512 && !crate::cpu::has_avx512_vnni() {
                println!("NOTE approximate path Avx512 without VNNI: its AVX2 kernel is checked");
            } else if *p == Path::Neon {
                match crate::cpu::has_neon_dotprod() {
                    true => println!("approximate path Neon: the sdot kernel, checked bit for bit"),
                    false => println!("SKIPPED NEON sdot kernel: this CPU lacks DotProd (scalar checked)"),
                }
            }
            p.available()
        })
    }

    #[test]
    fn approximate_product_tracks_exact_and_simd_matches_oracle() {
        let (rows, cols) = (37, 512);
        let mut s = 0x9e37_79b9_u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|_| 118 + (next() % 8) as u8).collect();
        let x: Vec<f32> = (0..cols).map(|_| ((next() % 20001) as f32 - 10000.0) / 5000.0).collect();
        let mut xq = QuantizedX::default();
        xq.quantize(&x);
        let (mut b, mut e) = (vec![0f32; rows], vec![0f32; rows]);
        scalar::mxfp4_matvec_q8(&packed, &scales, rows, cols, &xq, &mut b);
        scalar::mxfp4_matvec(&packed, &scales, rows, cols, &x, &mut e);
        let scale = e.iter().fold(0f32, |m, v| m.max(v.abs()));
        for path in paths() {
            let mut a = vec![0f32; rows];
            mxfp4_matvec_q8_on(path, &packed, &scales, rows, cols, &xq, &mut a);
            for r in 0..rows {
                // Integer block sums are exact: SIMD and scalar differ only in f32 accumulation order.
                assert!((a[r] - b[r]).abs() <= 1e-5 * scale, "{path:?} row {r}: {} vs {}", a[r], b[r]);
                // int8 activations: within a few percent of the largest output.
                assert!((a[r] - e[r]).abs() <= 0.03 * scale, "{path:?} row {r}: approx {} exact {}", a[r], e[r]);
            }
        }
    }

    #[test]
    fn approximate_paths_agree_on_odd_block_counts_and_extremes() {
        // Odd block counts exercise the single-block tail; every nibble and the largest
        // activations (+-127 after quantisation) appear.
        // 17 and 33 blocks per row: more than one 16-block scale group, with a lone last block.
        for (rows, cols) in [(3, 32), (5, 96), (9, 224), (4, 32 * 17), (3, 32 * 33)] {
            let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
            let mut scales: Vec<u8> = (0..rows * cols / 32).map(|i| 100 + (i % 40) as u8).collect();
            // E8M0 0 (2^-127) takes the safe path in the SIMD kernels.
            scales[cols / 32] = 0;
            let x: Vec<f32> = (0..cols).map(|i| if i % 5 == 0 { -3.0 } else { (i as f32 * 0.7).sin() }).collect();
            let mut xq = QuantizedX::default();
            xq.quantize(&x);
            let mut want = vec![0f32; rows];
            scalar::mxfp4_matvec_q8(&packed, &scales, rows, cols, &xq, &mut want);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for path in paths() {
                let mut got = vec![0f32; rows];
                mxfp4_matvec_q8_on(path, &packed, &scales, rows, cols, &xq, &mut got);
                for r in 0..rows {
                    assert!((got[r] - want[r]).abs() <= 1e-5 * scale, "{path:?} {rows}x{cols} row {r}");
                }
                // The sdot kernel accumulates in the oracle's order: the same bits.
                if path == Path::Neon && crate::cpu::has_neon_dotprod() {
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "sdot {rows}x{cols}");
                }
            }
        }
    }

    /// int8 rows with per-row or grouped scales, and inputs with an outlier channel.
    fn spine_case(rows: usize, cols: usize, group: usize, n: usize, seed: u64) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let q: Vec<i8> = (0..rows * cols).map(|_| (next() % 255) as i8).map(|v| v.max(-127)).collect();
        let scales: Vec<f32> = (0..rows * (cols / group)).map(|_| 1e-3 * (1 + next() % 64) as f32).collect();
        let xs: Vec<f32> = (0..n * cols)
            .map(|i| if i % cols == 5 { 40.0 } else { ((next() % 20001) as f32 - 10000.0) / 4000.0 })
            .collect();
        (q, scales, xs)
    }

    #[test]
    fn integer_spine_tiles_give_the_oracles_bits() {
        // Row counts crossing the 4-row tile, input counts crossing the 3-input tile, per-row and
        // grouped scales, every segment size, outputs strided past the rows.
        for (rows, cols, group, n) in
            [(9, 256, 256, 7), (5, 512, 128, 4), (4, 192, 64, 3), (13, 768, 768, 2), (1, 64, 64, 1)]
        {
            let (q, scales, xs) = spine_case(rows, cols, group, n, 0x5eed + rows as u64);
            let seg = QuantizedRows::seg_for(group).unwrap();
            let mut xq = QuantizedRows::default();
            xq.quantize(&xs, n, cols, seg);
            let stride = rows + 3;
            let mut want = vec![f32::NAN; n * stride];
            int8_rows_q8_on(Path::Scalar, &q, &scales, group, rows, &xq, 0, n, &mut want, (stride, 1));
            for path in paths() {
                let mut got = vec![f32::NAN; n * stride];
                int8_rows_q8_on(path, &q, &scales, group, rows, &xq, 0, n, &mut got, (stride, 1));
                for j in 0..n {
                    for r in 0..rows {
                        let (a, b) = (got[j * stride + r], want[j * stride + r]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{path:?} {rows}x{cols}/{group} input {j} row {r}: {a} vs {b}"
                        );
                    }
                    // Past the rows: untouched.
                    assert!(got[j * stride + rows..j * stride + stride].iter().all(|v| v.is_nan()));
                }
            }
        }
    }

    #[test]
    fn integer_spine_product_tracks_the_exact_one() {
        let (rows, cols, group, n) = (24, 1024, 1024, 5);
        let (q, scales, xs) = spine_case(rows, cols, group, n, 0xfeed);
        let mut xq = QuantizedRows::default();
        xq.quantize(&xs, n, cols, QuantizedRows::seg_for(group).unwrap());
        let mut got = vec![0f32; n * rows];
        int8_rows_q8_on(Path::Scalar, &q, &scales, group, rows, &xq, 0, n, &mut got, (rows, 1));
        let (mut err2, mut ref2) = (0f64, 0f64);
        for j in 0..n {
            let mut exact = vec![0f32; rows];
            scalar::int8_matvec(&q, &scales, group, rows, cols, &xs[j * cols..(j + 1) * cols], &mut exact);
            let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
            for r in 0..rows {
                // int8 inputs in segments of 256 (one with a channel 16 times the others): each
                // output within 10% of the largest, and 3% overall (RMS).
                let (a, e) = (got[j * rows + r], exact[r]);
                assert!((a - e).abs() <= 0.1 * scale, "input {j} row {r}: approx {a} exact {e}");
                (err2, ref2) = (err2 + ((a - e) as f64).powi(2), ref2 + (e as f64).powi(2));
            }
        }
        assert!(err2.sqrt() <= 0.03 * ref2.sqrt(), "RMS error {} of {}", err2.sqrt(), ref2.sqrt());
        // The offsets cancel the weights' +128 exactly: an all-zero input gives exact zeros.
        let zeros = vec![0f32; cols];
        xq.quantize(&zeros, 1, cols, 256);
        let mut z = vec![1f32; rows];
        int8_rows_q8_on(Path::best(), &q, &scales, group, rows, &xq, 0, 1, &mut z, (rows, 1));
        assert!(z.iter().all(|&v| v == 0.0), "{z:?}");
    }

    #[test]
    fn a_token_of_the_integer_chunk_product_does_not_depend_on_the_chunk() {
        // Large enough to run on the pool with several row blocks; each token quantised alone.
        let (rows, cols, group, n) = (300, 1024, 1024, 37);
        let (q, scales, xs) = spine_case(rows, cols, group, n, 0xabc);
        let mut whole = vec![0f32; n * rows];
        if !int8_matmat_q8(&q, &scales, group, rows, cols, &xs, n, &mut whole) {
            println!("NOTE no integer spine kernel on this CPU: int8_matmat_q8 declined, as it must");
            assert!(!has_integer_spine());
            return;
        }
        let mut xq = QuantizedRows::default();
        xq.quantize(&xs, n, cols, 256);
        let mut oracle = vec![0f32; n * rows];
        int8_rows_q8_on(Path::Scalar, &q, &scales, group, rows, &xq, 0, n, &mut oracle, (rows, 1));
        assert!(whole.iter().zip(&oracle).all(|(a, b)| a.to_bits() == b.to_bits()));
        for (t0, m) in [(0, 5), (5, 1), (6, 31)] {
            let mut part = vec![0f32; m * rows];
            assert!(int8_matmat_q8(&q, &scales, group, rows, cols, &xs[t0 * cols..(t0 + m) * cols], m, &mut part));
            assert!(part.iter().zip(&whole[t0 * rows..(t0 + m) * rows]).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        // Scale groups that are not a multiple of 64 have no integer kernel.
        assert!(
            !int8_matmat_q8(&q, &scales, 32, rows, cols, &xs, n, &mut whole) || QuantizedRows::seg_for(32).is_some()
        );
    }

    /// MXFP4 rows whose block exponents span 0..=5 (rows with a span above 3 are not exact in
    /// int8), every nibble.
    fn mxfp4_case(rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
        let nb = cols / 32;
        let scales: Vec<u8> = (0..rows * nb).map(|i| 118 + (next() % (1 + (i / nb) as u64 % 6)) as u8).collect();
        (packed, scales)
    }

    #[test]
    fn mxfp4_rows_decode_to_int8_exactly() {
        let (rows, cols) = (24, 256);
        let (mut packed, mut scales) = mxfp4_case(rows, cols, 0x1234);
        packed[..16].iter_mut().enumerate().for_each(|(i, b)| *b = (i as u8) | ((15 - i as u8) << 4));
        scales[cols / 32 * 3] = 0; // row 3: a zero exponent
        let m = Mxfp4 { packed: &packed, scales: &scales };
        let (mut q, mut rs) = (vec![0i8; rows * cols], vec![0f32; rows]);
        mxfp4_rows_to_int8_on(Path::Scalar, m, rows, cols, &mut q, &mut rs);
        let mut exact_rows = 0;
        for r in 0..rows {
            let srow = &scales[r * cols / 32..(r + 1) * cols / 32];
            let span = srow.iter().max().unwrap() - srow.iter().min().unwrap();
            assert_eq!(rs[r].is_nan(), span > 3 || srow.contains(&0), "row {r}");
            if rs[r].is_nan() {
                continue;
            }
            exact_rows += 1;
            let mut f = vec![0f32; cols];
            crate::format::mxfp4_decode_row(&packed[r * cols / 2..(r + 1) * cols / 2], srow, &mut f);
            for c in 0..cols {
                assert_eq!(q[r * cols + c] as f32 * rs[r], f[c], "row {r} col {c}");
            }
        }
        assert!(exact_rows >= rows / 2 && exact_rows < rows, "{exact_rows} exact rows of {rows}");
        for path in paths() {
            let (mut q2, mut rs2) = (vec![0i8; rows * cols], vec![0f32; rows]);
            mxfp4_rows_to_int8_on(path, m, rows, cols, &mut q2, &mut rs2);
            for r in 0..rows {
                assert_eq!(rs2[r].to_bits(), rs[r].to_bits(), "{path:?} row {r}");
                if !rs[r].is_nan() {
                    assert_eq!(q2[r * cols..(r + 1) * cols], q[r * cols..(r + 1) * cols], "{path:?} row {r}");
                }
            }
        }
    }

    #[test]
    fn integer_expert_batch_tracks_the_exact_one_and_each_input_stands_alone() {
        let (inter, lat, n) = (192, 256, 7);
        let (p1, s1) = mxfp4_case(inter, lat, 1);
        let (p3, s3) = mxfp4_case(inter, lat, 3);
        let (p2, s2) = mxfp4_case(lat, inter, 2);
        let (w1, w3, w2) = (
            Mxfp4 { packed: &p1, scales: &s1 },
            Mxfp4 { packed: &p3, scales: &s3 },
            Mxfp4 { packed: &p2, scales: &s2 },
        );
        let xs: Vec<f32> = (0..n * lat).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 700.0).collect();
        let (mut act, mut got) = (vec![0f32; n * inter], vec![0f32; n * lat]);
        if !expert_mxfp4_batch_q8(w1, w3, w2, inter, lat, &xs, n, 1.0, None, &mut act, &mut got) {
            println!("NOTE no integer kernel on this CPU: expert_mxfp4_batch_q8 declined, as it must");
            assert!(!has_integer_spine());
            return;
        }
        let (mut act_e, mut exact) = (vec![0f32; n * inter], vec![0f32; n * lat]);
        crate::expert::expert_mxfp4_batch(w1, w3, w2, inter, lat, &xs, n, 1.0, None, &mut act_e, &mut exact);
        let (mut err2, mut ref2) = (0f64, 0f64);
        for (a, e) in got.iter().zip(&exact) {
            (err2, ref2) = (err2 + ((a - e) as f64).powi(2), ref2 + (*e as f64).powi(2));
        }
        assert!(err2.sqrt() <= 0.03 * ref2.sqrt(), "RMS error {} of {}", err2.sqrt(), ref2.sqrt());
        // Input 4 alone gives the bits it gets among the seven.
        let (mut act1, mut one) = (vec![0f32; inter], vec![0f32; lat]);
        assert!(expert_mxfp4_batch_q8(
            w1,
            w3,
            w2,
            inter,
            lat,
            &xs[4 * lat..5 * lat],
            1,
            1.0,
            None,
            &mut act1,
            &mut one
        ));
        assert!(one.iter().zip(&got[4 * lat..5 * lat]).all(|(a, b)| a.to_bits() == b.to_bits()));
        // The integer rows equal the scalar oracle's bits; the rows int8 cannot hold take the
        // exact product (the same to f32 rounding on every path).
        let mut xq = QuantizedRows::default();
        xq.quantize(&xs, n, lat, 256);
        let (mut a, mut b) = (vec![0f32; n * inter], vec![0f32; n * inter]);
        mxfp4_matmat_q8_on(Path::Scalar, w1, inter, lat, &xs, &xq, n, &mut a);
        mxfp4_matmat_q8_on(Path::best(), w1, inter, lat, &xs, &xq, n, &mut b);
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (u, v)) in a.iter().zip(&b).enumerate() {
            let srow = &s1[(i % inter) * lat / 32..(i % inter + 1) * lat / 32];
            if crate::scalar::int8_row_base(srow).is_some() {
                assert_eq!(u.to_bits(), v.to_bits(), "output {i}");
            } else {
                assert!((u - v).abs() <= 1e-5 * scale, "output {i}: {u} vs {v}");
            }
        }
    }
}
