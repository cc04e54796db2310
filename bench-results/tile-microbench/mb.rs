#![allow(unsafe_op_in_unsafe_fn)]
use std::arch::x86_64::*;
use std::time::Instant;
const R: usize = 8;
static mut HS: [f32; 256] = [0.0; 256];

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn var_a(p: &[u8], s: &[u8], cols: usize, x: &[f32], out: &mut [f32], mul: bool, shuf: bool, pf: usize) {
    let half = cols / 2; let nb = cols / 32;
    let lut = _mm512_setr_ps(0.0,1.0,2.0,3.0,4.0,6.0,8.0,12.0,-0.0,-1.0,-2.0,-3.0,-4.0,-6.0,-8.0,-12.0);
    let hs = std::ptr::addr_of!(HS) as *const f32;
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let xe = _mm512_loadu_ps(x.as_ptr().add(b * 32));
        let xo = _mm512_loadu_ps(x.as_ptr().add(b * 32 + 16));
        if pf > 0 && b % 4 == 0 {
            if pf < 1000 { for k in 0..R { _mm_prefetch::<_MM_HINT_T0>(p.as_ptr().wrapping_add((k + pf) * half + b * 16) as *const i8); } }
            else { let d = pf - 1000; for k in 0..R { _mm_prefetch::<_MM_HINT_T0>(p.as_ptr().wrapping_add(k * half + b * 16 + d * 64) as *const i8); } }
        }
        for k in 0..R {
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.as_ptr().add(k * half + b * 16) as *const __m128i));
            let sc = *s.get_unchecked(k * nb + b) as usize;
            let lut_s = if mul { _mm512_mul_ps(lut, _mm512_set1_ps(*hs.add(sc))) } else { lut };
            let (we, wo) = if shuf {
                (_mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_castps_si512(lut_s), v)),
                 _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_castps_si512(lut_s), _mm512_srli_epi32(v, 4))))
            } else {
                (_mm512_permutexvar_ps(v, lut_s), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut_s))
            };
            acc[k] = _mm512_fmadd_ps(we, xe, acc[k]);
            acc[k] = _mm512_fmadd_ps(wo, xo, acc[k]);
        }
    }
    for k in 0..R { out[k] = _mm512_reduce_add_ps(acc[k]); }
}

// shift-only expansion: 64 bytes (4 blocks) per row per step; unscaled decode; per-lane scale vector.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn var_d(p: &[u8], s: &[u8], cols: usize, x: &[f32], out: &mut [f32]) {
    let half = cols / 2; let nb = cols / 32;
    let lut = _mm512_setr_ps(0.0,1.0,2.0,3.0,4.0,6.0,8.0,12.0,-0.0,-1.0,-2.0,-3.0,-4.0,-6.0,-8.0,-12.0);
    let sidx = _mm512_set_epi32(-1,-1,-1,3, -1,-1,-1,2, -1,-1,-1,1, -1,-1,-1,0).and_not_helper();
    let mut acc = [_mm512_setzero_ps(); R];
    for c in 0..nb / 4 {
        let xs: [__m512; 8] = std::array::from_fn(|j| _mm512_loadu_ps(x.as_ptr().add(c * 128 + j * 16)));
        for k in 0..R {
            let raw = _mm512_loadu_si512(p.as_ptr().add(k * half + c * 64) as *const _);
            let mut t = _mm512_mul_ps(_mm512_permutexvar_ps(raw, lut), xs[0]);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), lut), xs[1], t);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8), lut), xs[2], t);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 12), lut), xs[3], t);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 16), lut), xs[4], t);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 20), lut), xs[5], t);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 24), lut), xs[6], t);
            t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 28), lut), xs[7], t);
            let sb = _mm512_set1_epi32((s.as_ptr().add(k * nb + c * 4) as *const i32).read_unaligned());
            let sv = _mm512_slli_epi32(_mm512_shuffle_epi8(sb, sidx), 23);
            acc[k] = _mm512_fmadd_ps(t, _mm512_castsi512_ps(sv), acc[k]);
        }
    }
    for k in 0..R { out[k] = _mm512_reduce_add_ps(acc[k]); }
}
trait H { unsafe fn and_not_helper(self) -> Self; }
impl H for __m512i { unsafe fn and_not_helper(self) -> Self { self } }

// vpermb variant: decode 64 nibbles per vpermb into bytes? (int8 2*E2M1), then cvt: timing only
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn var_e(p: &[u8], s: &[u8], cols: usize, x: &[f32], out: &mut [f32]) {
    // shift-only expansion with 8 rows but 2 blocks (32 bytes) loaded as ymm->zmm cvtepu8_epi16? skip
    var_d(p, s, cols, x, out)
}


fn main() {
    unsafe { for e in 0..256 { HS[e] = f32::from_bits(((e.max(2) - 1) as u32) << 23); } }
    let cols = 3584; let rows_total = 3072 * 8;
    let p: Vec<u8> = (0..rows_total * cols / 2 + (1 << 20)).map(|i| (i * 7919 % 251) as u8).collect();
    let s: Vec<u8> = (0..rows_total * cols / 32).map(|i| 120 + (i % 7) as u8).collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i * 13 % 17) as f32) * 0.1 - 0.8).collect();
    let mut out = vec![0f32; rows_total];
    let half = cols / 2; let nb = cols / 32;
    for (name, pf) in [("A no prefetch", 0usize), ("A pf 8 rows", 8), ("A ahead 4 lines", 1004), ("A ahead 8", 1008), ("A ahead 16", 1016), ("A ahead 32", 1032)] {
        for _rep in 0..3 {
            let t = Instant::now();
            for r0 in (0..rows_total).step_by(8) {
                unsafe { var_a(&p[r0 * half..], &s[r0 * nb..], cols, &x, &mut out[r0..], true, false, pf) };
            }
            std::hint::black_box(&out);
            let dt = t.elapsed().as_secs_f64();
            let bytes = (rows_total * cols / 2) as f64;
            println!("{name:20} {:.2} GB/s", bytes / dt / 1e9);
        }
    }
}
