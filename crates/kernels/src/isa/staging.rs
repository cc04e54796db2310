//! Layer 3, what the x86 tile kernels ([`super::avx512_tile`], [`super::avx2_tile`]) share, in
//! plain Rust: the MXFP4 products' input staging (each 32-element block split into its 16 even
//! then 16 odd elements, so a block's low nibbles meet the even inputs and its high nibbles the
//! odd ones), the overflow guard on scales, and the tile-size choice. Imports only `format`,
//! `par` and `scalar`.

use std::cell::RefCell;

use crate::format::BLOCK;

/// A scale above this could overflow an f32 lane where the oracle's order does not.
pub const SAFE_SCALE: u8 = 200;

/// Split `x` per 32-element block into its 16 even then 16 odd elements. Shapes: x, out `[cols]`.
pub fn deinterleave(x: &[f32], out: &mut [f32]) {
    for (xb, ob) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        for j in 0..BLOCK / 2 {
            ob[j] = xb[2 * j];
            ob[BLOCK / 2 + j] = xb[2 * j + 1];
        }
    }
}

/// Run `f` on `x` deinterleaved per block into a per-thread scratch buffer (reused: no
/// allocation once warm).
pub fn with_deinterleaved<R>(x: &[f32], f: impl FnOnce(&[f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        s.resize(x.len(), 0.0);
        deinterleave(x, &mut s);
        f(&s)
    })
}

/// Run `f(xd, staged)` with the inputs `xs [n, cols]` each deinterleaved per block into `xd`
/// and a staging buffer `staged [rows, n]`, then write `staged` transposed into `out [n, rows]`.
/// Both buffers are per-thread and reused: no allocation once warm.
pub fn with_batch_staging(
    xs: &[f32],
    cols: usize,
    rows: usize,
    n: usize,
    out: &mut [f32],
    f: impl FnOnce(&[f32], &mut [f32]),
) {
    thread_local! {
        static XD: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    XD.with(|b| {
        let xd = &mut *b.borrow_mut();
        xd.resize(xs.len(), 0.0);
        for (x, d) in xs.chunks_exact(cols).zip(xd.chunks_exact_mut(cols)) {
            deinterleave(x, d);
        }
        crate::par::with_staged_rows(rows, n, out, |staged| f(&xd[..], staged));
    });
}

/// The largest of `step`, 4, 3, 2, 1 (as tiles exist) not above `left` or `step`.
pub fn tile_rows(left: usize, step: usize) -> usize {
    [step, 4, 3, 2, 1].into_iter().find(|&k| k <= left && k <= step).unwrap_or(1)
}

/// Half of each E8M0 scale as f32, `HALF_SCALE[e] = 0.5 * 2^(e-127)` (exact: a power of two,
/// 2^-128 for e = 0), for codes up to [`SAFE_SCALE`] (0 above: never read there). The AVX2
/// decoders multiply weights by it, the AVX-512 tiles twice the E2M1 table: one broadcast load
/// per block instead of the ~9 scalar instructions that build the scale from its code.
pub static HALF_SCALE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut e = 0;
    while e <= SAFE_SCALE as usize {
        // 2^(e - 128): a normal's exponent field e - 1 from e = 2; 2^-127 and 2^-128 are the
        // subnormals with one bit set, 2^22 and 2^21 units of 2^-149.
        t[e] = f32::from_bits(if e >= 2 { ((e - 1) as u32) << 23 } else { 1 << (21 + e) });
        e += 1;
    }
    t
};

/// Undo the per-block deinterleave (only for the rare overflow-safe fallback row).
pub fn interleave_back(xd: &[f32]) -> Vec<f32> {
    let mut x = vec![0f32; xd.len()];
    for (xb, db) in x.chunks_exact_mut(BLOCK).zip(xd.chunks_exact(BLOCK)) {
        for j in 0..BLOCK / 2 {
            xb[2 * j] = db[j];
            xb[2 * j + 1] = db[BLOCK / 2 + j];
        }
    }
    x
}

/// `match (rows, inputs)` onto the `tile_rn::<R, N>` instantiations a tile kind has.
macro_rules! tile_dispatch {
    ($kind:literal, $self:ident, $r:expr, $m:expr, $r0:expr, $t0:expr; $( ($R:literal, $N:literal) ),* ) => {
        match ($r, $m) {
            $( ($R, $N) => $self.tile_rn::<$R, $N>($r0, $t0), )*
            _ => unreachable!("no {} tile of {} rows x {} inputs", $kind, $r, $m),
        }
    };
}

pub(crate) use tile_dispatch;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::e8m0_to_f32;

    #[test]
    fn half_scales_are_half_the_scales() {
        for e in 0..=SAFE_SCALE {
            assert_eq!(HALF_SCALE[e as usize].to_bits(), (0.5 * e8m0_to_f32(e)).to_bits(), "code {e}");
        }
    }
}
