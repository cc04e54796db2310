//! Layer 4, operation: the per-head attention steps of the two attention kinds, apart from model
//! code. Imports `cpu`, `scalar` and `isa`.
//!
//! - KDA: one gated delta-rule update of a head's state `S [Dv, Dk]` and its read-out.
//! - MLA (absorbed, NoPE): scores of a query against every cached position, softmax, and the
//!   weighted sum of cached latents. [`mla_head_attend`] is one head's reference form (two
//!   passes); [`mla_attend_chunk`] is what the model runs: every head of every token of a chunk,
//!   one pass over the cache per token (all its heads share the cache: absorbed MLA is
//!   multi-query attention), in blocks of [`MLA_BLOCK`] positions with an online softmax.
//!
//! Both keep the reference summation order; the AVX2 instantiations of the scalar bodies
//! vectorise the element-wise work and are bit-identical to them (tested). MLA's softmax is the
//! path's own: AVX-512's on AVX-512, NEON's on NEON, scalar otherwise.

use rayon::prelude::*;

use crate::cpu::Path;
pub use crate::format::LatentRows;
#[cfg(target_arch = "aarch64")]
use crate::isa::neon;
#[cfg(target_arch = "x86_64")]
use crate::isa::{avx2, avx512, avx512_attn};
use crate::scalar;

/// `S <- S * g` (per key channel), `delta = beta (v - S k)`, `S <- S + delta k^T`, `y = S q`.
/// Shapes: s `[Dv, Dk]`, q, k, g `[Dk]`, v, delta, y `[Dv]`.
#[allow(clippy::too_many_arguments)]
pub fn kda_head_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    delta: &mut [f32],
    y: &mut [f32],
) {
    kda_head_step_on(Path::best(), s, q, k, v, g, beta, delta, y);
}

/// [`kda_head_step`] on `path`: AVX-512's kernel (lane-parallel sums), the AVX2 instantiation of
/// the scalar step on AVX2, else scalar.
#[allow(clippy::too_many_arguments)]
pub fn kda_head_step_on(
    path: Path,
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    delta: &mut [f32],
    y: &mut [f32],
) {
    let (dk, dv) = (k.len(), v.len());
    assert!(s.len() == dv * dk && q.len() == dk && g.len() == dk && delta.len() == dv && y.len() == dv);
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F present (an available path); shapes asserted above.
        Path::Avx512 => unsafe { avx512::kda_head_step(s, q, k, v, g, beta, delta, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path).
        Path::Avx2 => unsafe { avx2::kda_head_step(s, q, k, v, g, beta, delta, y) },
        _ => scalar::kda_head_step(s, q, k, v, g, beta, delta, y),
    }
}

/// Absorbed NoPE MLA for one head: `score_t = scale (q_lat . c_t + q_pe . pe_t)`, softmax over
/// the cached positions, `o_lat = sum_t p_t c_t`.
/// Shapes: q_lat `[L]`, q_pe `[R]`, latents `[T, L]`, k_pe `[T, R]`, scores `[T]`, o_lat `[L]`.
pub fn mla_head_attend(
    q_lat: &[f32],
    q_pe: &[f32],
    latents: &[f32],
    k_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    o_lat: &mut [f32],
) {
    mla_head_attend_on(Path::best(), q_lat, q_pe, latents, k_pe, scale, scores, o_lat);
}

/// [`mla_head_attend`] on `path`: the AVX2 instantiations of scores and read-out on AVX2 and
/// AVX-512, with AVX-512's softmax on AVX-512; NEON's softmax between the portable scores and
/// read-out on NEON; all scalar otherwise.
#[allow(clippy::too_many_arguments)]
pub fn mla_head_attend_on(
    path: Path,
    q_lat: &[f32],
    q_pe: &[f32],
    latents: &[f32],
    k_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    o_lat: &mut [f32],
) {
    match path.or_scalar() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F, AVX2 and FMA present (an available AVX-512 path implies AVX2 + FMA).
        Path::Avx512 => unsafe {
            avx2::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
            avx512::softmax_inplace(scores);
            avx2::mla_mix(scores, latents, q_lat.len(), o_lat);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA present (an available path).
        Path::Avx2 => unsafe {
            avx2::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
            scalar::softmax_inplace(scores);
            avx2::mla_mix(scores, latents, q_lat.len(), o_lat);
        },
        #[cfg(target_arch = "aarch64")]
        Path::Neon => {
            scalar::mla_scores(q_lat, q_pe, latents, k_pe, scale, scores);
            // SAFETY: NEON present (an available path).
            unsafe { neon::softmax_inplace(scores) };
            scalar::mla_mix(scores, latents, q_lat.len(), o_lat);
        }
        _ => scalar::mla_head_attend(q_lat, q_pe, latents, k_pe, scale, scores, o_lat),
    }
}

/// Cached positions per block of the one-pass MLA attention. Blocks start at multiples of this
/// from position 0, whatever the chunk, so a query's arithmetic depends only on its own position.
pub const MLA_BLOCK: usize = 32;

/// Absorbed-MLA attention of a chunk: every head of `t_n` tokens, token `i` over the cached
/// positions `0 ..= first + i` (the chunk's own latents already appended). Per query
/// `s_t = q . c_t` over all `width` channels (the query pre-scaled, its latent part already
/// absorbed), softmax, `o = sum_t p_t c_t[..kvl]`, computed by [`mla_attend_on`]. Work items
/// (one token's heads, or a share of them when there are fewer tokens than threads) run on the
/// thread pool; a query's arithmetic is the same whatever the items, so results do not depend
/// on the chunk or the thread count. Shapes: q `[heads, t_n, width]`, cache `[>= first + t_n,
/// width]`, out `[t_n, heads, kvl]`, scratch at least [`mla_attend_scratch`] floats.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_chunk(
    q: &[f32],
    heads: usize,
    t_n: usize,
    first: usize,
    cache: LatentRows,
    width: usize,
    kvl: usize,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    mla_attend_chunk_on(Path::best(), q, heads, t_n, first, cache, width, kvl, out, scratch);
}

/// How a chunk's attention splits into work items: shares of each token's heads (several when
/// there are fewer tokens than threads: each share reads the cache once, so more shares would
/// only read it more often), and heads per share.
fn attend_items(heads: usize, t_n: usize) -> (usize, usize) {
    let shares = crate::par::threads().div_ceil(t_n.max(1)).clamp(1, heads.max(1));
    (shares, heads.div_ceil(shares))
}

/// Floats of scratch [`mla_attend_chunk`] needs for `t_n` tokens of `heads` heads on this
/// thread pool (per work item: a block of cached rows as f32 `[MLA_BLOCK, width]`, the block's
/// scores `[nq, MLA_BLOCK]`, and per query the running maximum, sum and rescale `[nq]` x 3).
pub fn mla_attend_scratch(heads: usize, t_n: usize, width: usize) -> usize {
    let (shares, per) = attend_items(heads, t_n);
    t_n * shares * item_scratch(per, width)
}

fn item_scratch(nq: usize, width: usize) -> usize {
    MLA_BLOCK * width + nq * (MLA_BLOCK + 3)
}

/// [`mla_attend_chunk`] on `path`.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_chunk_on(
    path: Path,
    q: &[f32],
    heads: usize,
    t_n: usize,
    first: usize,
    cache: LatentRows,
    width: usize,
    kvl: usize,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    assert!(q.len() >= heads * t_n * width && out.len() == t_n * heads * kvl && kvl <= width);
    assert!(cache.positions(width) >= first + t_n, "MLA cache shorter than the chunk");
    if heads == 0 || t_n == 0 {
        return;
    }
    let (shares, per) = attend_items(heads, t_n);
    let item = item_scratch(per, width);
    assert!(scratch.len() >= t_n * shares * item, "MLA attention scratch too small");
    let item_of = |i: usize, g: usize, og: &mut [f32], sg: &mut [f32]| {
        let (h0, nq) = (g * per, og.len() / kvl);
        let qg = &q[(h0 * t_n + i) * width..];
        mla_attend_on(path, qg, t_n * width, nq, cache, width, kvl, first + i + 1, og, kvl, sg);
    };
    // Small work stays on the calling thread (fork and join would cost more), as in `par`.
    if heads * t_n * (first + t_n) * width < crate::par::PAR_MIN_WEIGHTS {
        for (i, (o, sc)) in out.chunks_mut(heads * kvl).zip(scratch.chunks_mut(shares * item)).enumerate() {
            for (g, (og, sg)) in o.chunks_mut(per * kvl).zip(sc.chunks_mut(item)).enumerate() {
                item_of(i, g, og, sg);
            }
        }
        return;
    }
    let items = out.par_chunks_mut(heads * kvl).zip(scratch.par_chunks_mut(shares * item));
    items.enumerate().for_each(|(i, (o, sc))| {
        o.par_chunks_mut(per * kvl)
            .zip(sc.par_chunks_mut(item))
            .enumerate()
            .for_each(|(g, (og, sg))| item_of(i, g, og, sg))
    });
}

/// The kernels one path runs in [`mla_attend_on`].
#[derive(Clone, Copy)]
enum AttendPath {
    Scalar,
    /// The scalar kernels compiled with AVX2 + FMA (the same bits: their fused multiply-adds in
    /// hardware instead of libm's software `fmaf`), for widths no vector divides on a CPU with
    /// AVX2 (the tiny test models: 20 channels; K3's 576 take the vector paths).
    #[cfg(target_arch = "x86_64")]
    ScalarFma,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl AttendPath {
    /// `path`'s kernels where the widths suit its vectors, else the scalar ones.
    fn pick(path: Path, width: usize, kvl: usize) -> Self {
        let fits = |lanes: usize| width.is_multiple_of(lanes) && kvl.is_multiple_of(lanes);
        match path.or_scalar() {
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 if fits(16) => AttendPath::Avx512,
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 | Path::Avx2 if fits(8) => AttendPath::Avx2,
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 | Path::Avx2 => AttendPath::ScalarFma,
            #[cfg(target_arch = "aarch64")]
            Path::Neon if fits(4) => AttendPath::Neon,
            _ => AttendPath::Scalar,
        }
    }

    fn widen(self, src: &[u16], dst: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 present (chosen only on an available AVX2 or AVX-512 path); dst is as
            // long as src.
            AttendPath::Avx2 | AttendPath::Avx512 | AttendPath::ScalarFma => unsafe { avx2::widen_bf16(src, dst) },
            _ => scalar::widen_bf16(src, dst),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn scores(self, q: &[f32], q_stride: usize, nq: usize, rows: &[f32], nb: usize, width: usize, s: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 + FMA present; width a multiple of 8 (`pick`); shapes checked by
            // `mla_attend_on`.
            AttendPath::Avx2 => unsafe { avx2::mla_block_scores(q, q_stride, nq, rows, nb, width, s, MLA_BLOCK) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F present; width a multiple of 16 (`pick`); shapes checked.
            AttendPath::Avx512 => unsafe {
                avx512_attn::mla_block_scores(q, q_stride, nq, rows, nb, width, s, MLA_BLOCK)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON present; width a multiple of 4 (`pick`); shapes checked.
            AttendPath::Neon => unsafe { neon::mla_block_scores(q, q_stride, nq, rows, nb, width, s, MLA_BLOCK) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 + FMA present (chosen only on an available AVX2 or AVX-512 path).
            AttendPath::ScalarFma => unsafe {
                avx2::mla_block_scores_scalar(q, q_stride, nq, rows, nb, width, s, MLA_BLOCK)
            },
            AttendPath::Scalar => scalar::mla_block_scores(q, q_stride, nq, rows, nb, width, s, MLA_BLOCK),
        }
    }

    fn exp_shifted(self, x: &mut [f32], shift: f32) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 + FMA present.
            AttendPath::Avx2 => unsafe { avx2::exp_shifted(x, shift) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F present.
            AttendPath::Avx512 => unsafe { avx512_attn::exp_shifted(x, shift) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON present.
            AttendPath::Neon => unsafe { neon::exp_shifted(x, shift) },
            _ => scalar::exp_shifted(x, shift),
        }
    }

    /// `e^x` as this path's vector exp computes it.
    fn exp(self, x: f32) -> f32 {
        let mut v = [x];
        self.exp_shifted(&mut v, 0.0);
        v[0]
    }

    #[allow(clippy::too_many_arguments)]
    fn mix(
        self,
        p: &[f32],
        alpha: &[f32],
        rows: &[f32],
        nb: usize,
        width: usize,
        kvl: usize,
        out: &mut [f32],
        os: usize,
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 + FMA present; kvl a multiple of 8 (`pick`); shapes checked.
            AttendPath::Avx2 => unsafe { avx2::mla_block_mix(p, MLA_BLOCK, alpha, rows, nb, width, kvl, out, os) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F present; kvl a multiple of 16 (`pick`); shapes checked.
            AttendPath::Avx512 => unsafe {
                avx512_attn::mla_block_mix(p, MLA_BLOCK, alpha, rows, nb, width, kvl, out, os)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON present; kvl a multiple of 4 (`pick`); shapes checked.
            AttendPath::Neon => unsafe { neon::mla_block_mix(p, MLA_BLOCK, alpha, rows, nb, width, kvl, out, os) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 + FMA present (chosen only on an available AVX2 or AVX-512 path).
            AttendPath::ScalarFma => unsafe {
                avx2::mla_block_mix_scalar(p, MLA_BLOCK, alpha, rows, nb, width, kvl, out, os)
            },
            AttendPath::Scalar => scalar::mla_block_mix(p, MLA_BLOCK, alpha, rows, nb, width, kvl, out, os),
        }
    }
}

/// One-pass absorbed-MLA attention of `nq` queries that see the same `len` cached positions
/// (one token's heads, or a share of them), on `path`. The cache goes by in blocks of
/// [`MLA_BLOCK`] positions (bf16 rows widened once per block, shared by every query); per
/// query and block: scores (`path`'s dot product), `m' = max(m, max_j s_j)`, `alpha =
/// exp(m - m')`, `p_j = exp(s_j - m')`, `l = l alpha + sum_j p_j` (in order), `o = o alpha + sum_j
/// p_j row_j` (a fused multiply-add per row, in order); at the end `o *= 1 / l`. Shapes: q
/// `[nq, q_stride]` (first `width` read), cache `[>= len, width]`, out `[nq, o_stride]` (first
/// `kvl` written), scratch at least `MLA_BLOCK * width + nq * (MLA_BLOCK + 3)` floats.
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_on(
    path: Path,
    q: &[f32],
    q_stride: usize,
    nq: usize,
    cache: LatentRows,
    width: usize,
    kvl: usize,
    len: usize,
    out: &mut [f32],
    o_stride: usize,
    scratch: &mut [f32],
) {
    if nq == 0 {
        return;
    }
    assert!(kvl <= width && q_stride >= width && o_stride >= kvl && len > 0);
    assert!(q.len() >= (nq - 1) * q_stride + width && out.len() >= (nq - 1) * o_stride + kvl);
    assert!(cache.positions(width) >= len, "MLA cache shorter than the attended positions");
    assert!(scratch.len() >= item_scratch(nq, width), "MLA attention scratch too small");
    let k = AttendPath::pick(path, width, kvl);
    let (rows_buf, rest) = scratch.split_at_mut(MLA_BLOCK * width); // [MLA_BLOCK, width]
    let (s_buf, rest) = rest.split_at_mut(nq * MLA_BLOCK); // [nq, MLA_BLOCK]
    let (m, rest) = rest.split_at_mut(nq); // [nq] running maxima
    let (l, rest) = rest.split_at_mut(nq); // [nq] running sums
    let alpha = &mut rest[..nq]; // [nq] this block's rescale
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    for i in 0..nq {
        out[i * o_stride..i * o_stride + kvl].fill(0.0);
    }
    for j0 in (0..len).step_by(MLA_BLOCK) {
        let nb = (len - j0).min(MLA_BLOCK);
        let rows: &[f32] = match cache {
            LatentRows::F32(c) => &c[j0 * width..(j0 + nb) * width],
            LatentRows::Bf16(c) => {
                k.widen(&c[j0 * width..(j0 + nb) * width], &mut rows_buf[..nb * width]);
                &rows_buf[..nb * width]
            }
        };
        k.scores(q, q_stride, nq, rows, nb, width, s_buf);
        for i in 0..nq {
            let s = &mut s_buf[i * MLA_BLOCK..i * MLA_BLOCK + nb];
            let m_new = s.iter().fold(m[i], |a, &b| a.max(b));
            alpha[i] = k.exp(m[i] - m_new);
            k.exp_shifted(s, m_new);
            l[i] = s.iter().fold(l[i] * alpha[i], |a, &b| a + b);
            m[i] = m_new;
        }
        k.mix(s_buf, alpha, rows, nb, width, kvl, out, o_stride);
    }
    for i in 0..nq {
        let inv = 1.0 / l[i];
        out[i * o_stride..i * o_stride + kvl].iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn dispatched_steps_equal_the_portable_ones() {
        if !crate::cpu::has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2+FMA path to test");
        }
        let d = 37; // not a multiple of the vector width
        let (q, k, v) = (vals(d, 1), vals(d, 2), vals(d, 3));
        let g: Vec<f32> = vals(d, 4).iter().map(|x| 0.5 + 0.4 * x).collect();
        let mut s1 = vals(d * d, 5);
        let mut s2 = s1.clone();
        let (mut dl1, mut dl2, mut y1, mut y2) = (vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d]);
        // The AVX2 instantiation is the scalar step compiled for AVX2: the same bits.
        kda_head_step_on(Path::Avx2, &mut s1, &q, &k, &v, &g, 0.7, &mut dl1, &mut y1);
        scalar::kda_head_step(&mut s2, &q, &k, &v, &g, 0.7, &mut dl2, &mut y2);
        assert!(s1.iter().zip(&s2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
        // AVX-512 sums in lanes: close to the scalar step over several steps (the state carries
        // the differences on), on widths below, at and off the vector width.
        for d in [5, 16, 37, 128] {
            let (q, k, v) = (vals(d, 11), vals(d, 12), vals(d, 13));
            let g: Vec<f32> = vals(d, 14).iter().map(|x| 0.5 + 0.4 * x).collect();
            let (mut sa, mut sb) = (vals(d * d, 15), vals(d * d, 15));
            let (mut da, mut db, mut ya, mut yb) = (vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d]);
            for _ in 0..4 {
                kda_head_step_on(Path::Avx512, &mut sa, &q, &k, &v, &g, 0.7, &mut da, &mut ya);
                scalar::kda_head_step(&mut sb, &q, &k, &v, &g, 0.7, &mut db, &mut yb);
            }
            let scale = yb.iter().chain(&sb).fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in ya.iter().chain(&sa).zip(yb.iter().chain(&sb)) {
                assert!((a - b).abs() <= 1e-5 * scale, "d {d}: {a} vs {b}");
            }
        }
        if !Path::Avx512.available() {
            println!("SKIPPED AVX-512 KDA step: this CPU lacks it (the scalar step was compared with itself)");
        }

        let (l, r, t) = (33, 5, 9);
        let (ql, qp, lat, pe) = (vals(l, 6), vals(r, 7), vals(t * l, 8), vals(t * r, 9));
        let (mut sc1, mut sc2, mut o1, mut o2) = (vec![0f32; t], vec![0f32; t], vec![0f32; l], vec![0f32; l]);
        // The default path against the portable scores and read-out around the same softmax.
        mla_head_attend(&ql, &qp, &lat, &pe, 0.3, &mut sc1, &mut o1);
        scalar::mla_scores(&ql, &qp, &lat, &pe, 0.3, &mut sc2);
        crate::ops::softmax_inplace(&mut sc2);
        scalar::mla_mix(&sc2, &lat, l, &mut o2);
        assert!(o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!((sc1.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        // The AVX2 path (AVX2 instantiations, scalar softmax) against the scalar twin.
        mla_head_attend_on(Path::Avx2, &ql, &qp, &lat, &pe, 0.3, &mut sc1, &mut o1);
        scalar::mla_head_attend(&ql, &qp, &lat, &pe, 0.3, &mut sc2, &mut o2);
        assert!(o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(sc1.iter().zip(&sc2).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// A cache of `t` positions of `width` values and, for the oracle, the same values as f32.
    fn cache(t: usize, width: usize, seed: u32) -> (Vec<u16>, Vec<f32>) {
        let f = vals(t * width, seed);
        let b: Vec<u16> = f.iter().map(|&v| crate::format::f32_to_bf16(2.0 * v)).collect();
        let wide = b.iter().map(|&v| crate::format::bf16_to_f32(v)).collect();
        (b, wide)
    }

    /// One query by the two-pass reference ([`scalar::mla_head_attend`]), in f64 for the sums.
    fn reference(q: &[f32], lat: &[f32], width: usize, kvl: usize, len: usize) -> Vec<f64> {
        let s: Vec<f64> =
            (0..len).map(|t| (0..width).map(|c| q[c] as f64 * lat[t * width + c] as f64).sum::<f64>()).collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        let l: f64 = p.iter().sum();
        (0..kvl).map(|d| (0..len).map(|t| p[t] * lat[t * width + d] as f64).sum::<f64>() / l).collect()
    }

    /// Every path's one-pass attention agrees with the two-pass reference (and the per-head
    /// reference kernel) on bf16 and f32 caches, at lengths around the block size, on K3's
    /// widths and on widths no vector divides.
    #[test]
    fn one_pass_attention_matches_the_reference_on_every_path() {
        for path in Path::ALL {
            if !path.available() {
                println!("SKIPPED: path {path:?} not available on this CPU");
                continue;
            }
            for &(width, kvl, nq) in &[(576, 512, 7), (40, 32, 3), (20, 12, 2), (9, 5, 1)] {
                for len in [1, 5, 31, 32, 33, 100, 257] {
                    let (bf, wide) = cache(len, width, 3);
                    let q: Vec<f32> = vals(nq * (width + 1), 4).iter().map(|v| v * 0.3).collect();
                    for cache in [LatentRows::Bf16(&bf), LatentRows::F32(&wide)] {
                        let mut out = vec![f32::NAN; nq * (kvl + 2)];
                        let mut sc = vec![f32::NAN; item_scratch(nq, width)];
                        mla_attend_on(path, &q, width + 1, nq, cache, width, kvl, len, &mut out, kvl + 2, &mut sc);
                        for i in 0..nq {
                            let qi = &q[i * (width + 1)..i * (width + 1) + width];
                            let want = reference(qi, &wide, width, kvl, len);
                            let got = &out[i * (kvl + 2)..i * (kvl + 2) + kvl];
                            for (g, w) in got.iter().zip(&want) {
                                assert!(
                                    (*g as f64 - w).abs() <= 3e-5 * (1.0 + w.abs()),
                                    "{path:?} width {width} len {len} query {i}: {g} vs {w}"
                                );
                            }
                            // The per-head form (latent and rope parts apart) says the same.
                            let (mut sc, mut o) = (vec![0f32; len], vec![0f32; width]);
                            let (lat, pe): (Vec<f32>, Vec<f32>) = (
                                (0..len).flat_map(|t| wide[t * width..t * width + kvl].to_vec()).collect(),
                                (0..len).flat_map(|t| wide[t * width + kvl..(t + 1) * width].to_vec()).collect(),
                            );
                            mla_head_attend(&qi[..kvl], &qi[kvl..], &lat, &pe, 1.0, &mut sc, &mut o[..kvl]);
                            for (g, h) in got.iter().zip(&o[..kvl]) {
                                assert!((g - h).abs() <= 3e-5 * (1.0 + h.abs()), "{path:?}: {g} vs per-head {h}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The read-out of a block is the scalar twin's, bit for bit, on every path (only the scores
    /// and exp sum and round in the path's own lanes).
    #[test]
    fn block_read_out_is_bit_identical_to_its_twin() {
        for path in Path::ALL {
            if !path.available() {
                println!("SKIPPED: path {path:?} not available on this CPU");
                continue;
            }
            for &(width, kvl, nq, nb) in &[(576, 512, 13, 32), (80, 64, 6, 7), (20, 16, 5, 1)] {
                let k = AttendPath::pick(path, width, kvl);
                let rows = vals(nb * width, 1);
                let p = vals(nq * MLA_BLOCK, 2);
                let alpha = vals(nq, 3);
                let mut a = vals(nq * kvl, 4);
                let mut b = a.clone();
                k.mix(&p, &alpha, &rows, nb, width, kvl, &mut a, kvl);
                scalar::mla_block_mix(&p, MLA_BLOCK, &alpha, &rows, nb, width, kvl, &mut b, kvl);
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{path:?} {width}");
            }
        }
    }

    /// Each path's exp is within a few ulp of libm's over the range softmax uses, gives exactly
    /// 0 at -inf and 1 at 0, and keeps NaN.
    #[test]
    fn vector_exp_is_accurate_and_exact_at_the_edges() {
        for path in Path::ALL {
            if !path.available() {
                println!("SKIPPED: path {path:?} not available on this CPU");
                continue;
            }
            let k = AttendPath::pick(path, 16, 16);
            let mut xs: Vec<f32> = (0..4000).map(|i| -86.0 + i as f32 * 0.0215).collect();
            let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
            k.exp_shifted(&mut xs, 0.0);
            for (g, w) in xs.iter().zip(&want) {
                assert!((g - w).abs() <= 4e-7 * w, "{path:?}: {g} vs {w}");
            }
            assert_eq!(k.exp(f32::NEG_INFINITY), 0.0, "{path:?}");
            assert_eq!(k.exp(0.0), 1.0, "{path:?}");
            assert!(k.exp(f32::NAN).is_nan(), "{path:?}");
        }
    }

    /// At widths no vector divides, an AVX path's attention is the scalar path's, bit for bit
    /// (the scalar kernels compiled with FMA: hardware fused multiply-adds, the same bits as
    /// libm's software ones).
    #[test]
    fn odd_widths_on_an_avx_path_are_the_scalar_paths_bits() {
        let mut tested = false;
        // The AVX paths only: NEON's vector kernels take widths of 4 (20 here) and sum in
        // their own lanes.
        for path in [Path::Avx2, Path::Avx512] {
            if !path.available() {
                println!("SKIPPED: path {path:?} not available on this CPU");
                continue;
            }
            for &(width, kvl, nq, len) in &[(20, 16, 4, 77), (9, 5, 2, 33)] {
                let (bf, _) = cache(len, width, 8);
                let q: Vec<f32> = vals(nq * width, 9).iter().map(|v| v * 0.3).collect();
                let run = |p: Path| {
                    let mut out = vec![f32::NAN; nq * kvl];
                    let mut sc = vec![f32::NAN; item_scratch(nq, width)];
                    mla_attend_on(p, &q, width, nq, LatentRows::Bf16(&bf), width, kvl, len, &mut out, kvl, &mut sc);
                    out
                };
                let (a, b) = (run(path), run(Path::Scalar));
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{path:?} width {width}");
                tested = true;
            }
        }
        if !tested {
            println!("SKIPPED: no AVX path on this CPU");
        }
    }

    /// A chunk's attention equals, token by token, the tokens attended one at a time (each as a
    /// decode step would), bit for bit, and does not depend on the thread count.
    #[test]
    fn chunked_attention_is_bit_identical_to_one_token_at_a_time() {
        let (heads, width, kvl, first, t_n) = (6, 80, 64, 37, 9);
        let (bf, _) = cache(first + t_n, width, 5);
        let q = vals(heads * t_n * width, 6);
        let mut chunk = vec![f32::NAN; t_n * heads * kvl];
        let mut sc = vec![f32::NAN; 3 * mla_attend_scratch(heads, t_n, width)];
        mla_attend_chunk(&q, heads, t_n, first, LatentRows::Bf16(&bf), width, kvl, &mut chunk, &mut sc);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut again = vec![f32::NAN; t_n * heads * kvl];
            let mut sc = vec![f32::NAN; 3 * mla_attend_scratch(heads, t_n, width)];
            pool.install(|| {
                let need = mla_attend_scratch(heads, t_n, width);
                mla_attend_chunk(&q, heads, t_n, first, LatentRows::Bf16(&bf), width, kvl, &mut again, &mut sc[..need])
            });
            assert!(chunk.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads");
        }
        for i in 0..t_n {
            // Token i alone: its heads' queries as a chunk of one.
            let qi: Vec<f32> =
                (0..heads).flat_map(|h| q[(h * t_n + i) * width..(h * t_n + i + 1) * width].to_vec()).collect();
            let cached = &bf[..(first + i + 1) * width];
            let mut one = vec![f32::NAN; heads * kvl];
            let mut sc = vec![f32::NAN; 3 * mla_attend_scratch(heads, 1, width)];
            mla_attend_chunk(&qi, heads, 1, first + i, LatentRows::Bf16(cached), width, kvl, &mut one, &mut sc);
            let got = &chunk[i * heads * kvl..(i + 1) * heads * kvl];
            assert!(one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "token {i}");
        }
    }
}
