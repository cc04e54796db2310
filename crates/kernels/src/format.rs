//! Layer 1, data formats: what the bytes mean, no kernels. Imports nothing from the crate.
//!
//! MXFP4 (OCP Microscaling), as compressed-tensors `mxfp4-pack-quantized` stores it (Kimi K3): a
//! `[rows, cols]` matrix is `packed: [rows, cols/2]` bytes, element `2j` in the LOW nibble of byte
//! `j`, and `scales: [rows, cols/32]` E8M0 bytes, one per block of 32 elements along a row. Also
//! the int8 activation blocks of approximate mode ([`QuantizedX`]).

/// Elements per shared scale.
pub const BLOCK: usize = 32;

/// E2M1 value of each nibble: sign bit 3, two exponent bits, one mantissa bit.
pub const E2M1_LUT: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// 2·E2M1 for each nibble: exact small integers.
pub const E2M1_X2_I8: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// E8M0 scale byte to its value, 2^(e-127). 0xFF encodes NaN in the format; callers validate
/// scales when data enters the store, so here it simply decodes to NaN.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    if e == 0xFF {
        return f32::NAN;
    }
    // 2^(e-127) for e in 0..=254. e = 0 is 2^-127, a subnormal f32: build it from bits.
    if e == 0 { f32::from_bits(0x0040_0000) } else { f32::from_bits((e as u32) << 23) }
}

/// One MXFP4 matrix: packed nibbles and E8M0 scales.
#[derive(Clone, Copy)]
pub struct Mxfp4<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
}

/// Shapes of an MXFP4 mat-vec: packed `[rows, cols/2]`, scales `[rows, cols/32]`, x `[cols]`,
/// out `[rows]`, `cols` a multiple of 32.
pub(crate) fn check_matvec_shapes(packed: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], out: &[f32]) {
    assert!(cols.is_multiple_of(BLOCK), "MXFP4 rows must be whole blocks of 32");
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(x.len(), cols);
    assert_eq!(out.len(), rows);
}

/// Shapes of an MXFP4 product against `n` inputs: as [`check_matvec_shapes`] with xs `[n, cols]`
/// and out `[n, rows]`.
pub(crate) fn check_matmat_shapes(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    out: &[f32],
) {
    assert!(cols.is_multiple_of(BLOCK), "MXFP4 rows must be whole blocks of 32");
    assert_eq!(packed.len(), rows * cols / 2);
    assert_eq!(scales.len(), rows * cols / BLOCK);
    assert_eq!(xs.len(), n * cols);
    assert_eq!(out.len(), n * rows);
}

/// Decode one MXFP4 row to f32. Shapes: packed `[cols/2]`, scales `[cols/32]`, out `[cols]`.
pub fn mxfp4_decode_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), packed.len() * 2);
    assert_eq!(out.len(), scales.len() * BLOCK);
    for (j, &byte) in packed.iter().enumerate() {
        let s = e8m0_to_f32(scales[2 * j / BLOCK]);
        out[2 * j] = E2M1_LUT[(byte & 0x0F) as usize] * s;
        out[2 * j + 1] = E2M1_LUT[(byte >> 4) as usize] * s;
    }
}

/// Input quantised per block, in the layout the kernels read: per block, the 16 even elements
/// then the 16 odd ones (matching low and high nibbles).
#[derive(Default)]
pub struct QuantizedX {
    pub q: Vec<i8>,
    /// One per block: `max|x| / 127` (0 for an all-zero block).
    pub scales: Vec<f32>,
}

impl QuantizedX {
    pub fn quantize(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(BLOCK));
        self.q.clear();
        self.scales.clear();
        for xb in x.chunks_exact(BLOCK) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = amax / 127.0;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            self.scales.push(s);
            let qv = |v: f32| (v * inv).round().clamp(-127.0, 127.0) as i8;
            self.q.extend((0..BLOCK / 2).map(|j| qv(xb[2 * j])));
            self.q.extend((0..BLOCK / 2).map(|j| qv(xb[2 * j + 1])));
        }
    }
}

/// Values per lane step of the integer spine products: one 512-bit `vpdpbusd` takes 64 int8
/// pairs, summed in fours into 16 int32 lanes (lane `l` takes values `4l..4l+3`).
pub const Q8_STEP: usize = 64;
/// Lanes of [`Q8_STEP`].
pub const Q8_LANES: usize = 16;

/// A prompt chunk's inputs quantised for the integer spine products of approximate mode:
/// each input's segments of `seg` values get one scale (`max|x| / 127`, 0 for an all-zero
/// segment) and int8 values in their natural order. The kernels make the weights unsigned
/// (`w + 128`, as `vpdpbusd` wants one unsigned operand); `offsets` cancels that exactly:
/// per segment and lane, `-128 x` the sum of the lane's values, the lane accumulator's start.
#[derive(Default)]
pub struct QuantizedRows {
    pub n: usize,
    pub cols: usize,
    pub seg: usize,
    /// `[n, cols]`
    pub q: Vec<i8>,
    /// `[n, cols / seg]`
    pub scales: Vec<f32>,
    /// `[n, cols / seg, Q8_LANES]`
    pub offsets: Vec<i32>,
}

impl QuantizedRows {
    /// The segment for weights with one scale per `group` values: the largest of 256, 128 and
    /// 64 dividing it (a segment never spans two weight scales); `None` when none does.
    pub fn seg_for(group: usize) -> Option<usize> {
        [256, 128, 64].into_iter().find(|&s| group != 0 && group.is_multiple_of(s))
    }

    /// Quantise `xs` `[n, cols]` in segments of `seg` (a multiple of [`Q8_STEP`] dividing
    /// `cols`); the buffers are reused.
    pub fn quantize(&mut self, xs: &[f32], n: usize, cols: usize, seg: usize) {
        assert!(seg.is_multiple_of(Q8_STEP) && seg > 0 && cols.is_multiple_of(seg) && xs.len() >= n * cols);
        let segs = cols / seg;
        (self.n, self.cols, self.seg) = (n, cols, seg);
        self.q.resize(n * cols, 0);
        self.scales.resize(n * segs, 0.0);
        self.offsets.resize(n * segs * Q8_LANES, 0);
        // A chunk's inputs on the thread pool when there are many (a 7,168-wide input takes
        // about 10 us).
        use rayon::prelude::*;
        let xs = &xs[..n * cols];
        let q = self.q.par_chunks_exact_mut(cols);
        let s = self.scales.par_chunks_exact_mut(segs);
        let o = self.offsets.par_chunks_exact_mut(segs * Q8_LANES);
        xs.par_chunks_exact(cols)
            .zip(q.zip(s.zip(o)))
            .with_min_len(32)
            .for_each(|(x, (q, (s, o)))| Self::quantize_one(x, seg, q, s, o));
    }

    fn quantize_one(x: &[f32], seg: usize, q: &mut [i8], scales: &mut [f32], offsets: &mut [i32]) {
        for ((xs, qs), (s, off)) in x
            .chunks_exact(seg)
            .zip(q.chunks_exact_mut(seg))
            .zip(scales.iter_mut().zip(offsets.chunks_exact_mut(Q8_LANES)))
        {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            *s = amax / 127.0;
            let inv = if *s > 0.0 { 1.0 / *s } else { 0.0 };
            for (qv, &v) in qs.iter_mut().zip(xs) {
                *qv = (v * inv).round().clamp(-127.0, 127.0) as i8;
            }
            off.fill(0);
            for step in qs.chunks_exact(Q8_STEP) {
                for (l, o) in off.iter_mut().enumerate() {
                    *o -= 128 * step[4 * l..4 * l + 4].iter().map(|&v| v as i32).sum::<i32>();
                }
            }
        }
    }

    /// Input `t`'s values, scales and offsets.
    pub fn input(&self, t: usize) -> (&[i8], &[f32], &[i32]) {
        let segs = self.cols / self.seg;
        (
            &self.q[t * self.cols..(t + 1) * self.cols],
            &self.scales[t * segs..(t + 1) * segs],
            &self.offsets[t * segs * Q8_LANES..(t + 1) * segs * Q8_LANES],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nibble_decodes_to_e2m1() {
        // Nibble n in the low half of byte 0 is element 0; in the high half it is element 1.
        let expect = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for n in 0u8..16 {
            let mag = expect[(n & 7) as usize];
            let want = if n & 8 != 0 { -mag } else { mag };
            let mut packed = vec![0u8; 16];
            packed[0] = n | (n << 4);
            let mut out = vec![0f32; 32];
            mxfp4_decode_row(&packed, &[127], &mut out);
            assert_eq!(out[0], want, "nibble {n} low");
            assert_eq!(out[1], want, "nibble {n} high");
            assert!(out[2..].iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn scale_edges() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(0) > 0.0);
        assert!(e8m0_to_f32(255).is_nan());
        for e in 1u8..=254 {
            assert_eq!(e8m0_to_f32(e), 2f32.powi(e as i32 - 127), "e = {e}");
        }
    }
}

/// A dense `[rows, cols]` weight matrix in one of the spine's storage formats, row-major. The
/// transposed products ([`crate::matvec::vecmat`]) read it element by element as f32: f32 as is,
/// bf16 widened (exact), int8 times its scale (`q * scales[r, c / group]`, one rounding).
#[derive(Clone, Copy)]
pub enum Dense<'a> {
    F32(&'a [f32]),
    /// Raw bf16 bits.
    Bf16(&'a [u16]),
    /// `q [rows, cols]`, `scales [rows, cols / group]`.
    Int8 {
        q: &'a [i8],
        scales: &'a [f32],
        group: usize,
    },
}

impl Dense<'_> {
    /// Whether the storage holds `rows x cols` values (and, for int8, whole scale groups).
    pub fn holds(&self, rows: usize, cols: usize) -> bool {
        match *self {
            Dense::F32(w) => w.len() == rows * cols,
            Dense::Bf16(w) => w.len() == rows * cols,
            Dense::Int8 { q, scales, group } => {
                group != 0
                    && cols.is_multiple_of(group)
                    && q.len() == rows * cols
                    && scales.len() == rows * (cols / group)
            }
        }
    }

    /// Element `(r, c)` of a matrix `cols` wide, as f32 (the scalar definition every path keeps).
    #[inline(always)]
    pub fn at(&self, cols: usize, r: usize, c: usize) -> f32 {
        match *self {
            Dense::F32(w) => w[r * cols + c],
            Dense::Bf16(w) => bf16_to_f32(w[r * cols + c]),
            Dense::Int8 { q, scales, group } => q[r * cols + c] as f32 * scales[r * (cols / group) + c / group],
        }
    }
}

/// bf16 bits to f32 (exact: the bits move up by 16).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bf16 bits, rounding to nearest even (NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// The rows of MLA's latent cache, `[positions, width]`: per position the normed latent
/// (`kv_lora` values) then the `rope` channels, in f32 or as bf16 bits.
#[derive(Clone, Copy)]
pub enum LatentRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl LatentRows<'_> {
    /// Positions held, at `width` values each.
    pub fn positions(&self, width: usize) -> usize {
        match self {
            LatentRows::F32(v) => v.len() / width.max(1),
            LatentRows::Bf16(v) => v.len() / width.max(1),
        }
    }

    /// Value `c` of position `t`, as f32.
    #[inline(always)]
    pub fn at(&self, width: usize, t: usize, c: usize) -> f32 {
        match self {
            LatentRows::F32(v) => v[t * width + c],
            LatentRows::Bf16(v) => bf16_to_f32(v[t * width + c]),
        }
    }
}
