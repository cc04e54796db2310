#![allow(unsafe_op_in_unsafe_fn)]
use std::arch::x86_64::*;
use std::time::Instant;
static mut HS: [f32; 256] = [0.0; 256];

// current style: R rows x N inputs, decode inside
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_dec<const R: usize, const N: usize>(p: *const u8, s: *const u8, cols: usize, x: *const f32, out: &mut [f32]) {
    let half = cols / 2; let nb = cols / 32;
    let lut = _mm512_setr_ps(0.0,1.0,2.0,3.0,4.0,6.0,8.0,12.0,-0.0,-1.0,-2.0,-3.0,-4.0,-6.0,-8.0,-12.0);
    let hs = std::ptr::addr_of!(HS) as *const f32;
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for b in 0..nb {
        let mut we = [_mm512_setzero_ps(); R]; let mut wo = [_mm512_setzero_ps(); R];
        for k in 0..R {
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(k * half + b * 16) as *const __m128i));
            let lut_s = _mm512_mul_ps(lut, _mm512_set1_ps(*hs.add(*s.add(k * nb + b) as usize)));
            we[k] = _mm512_permutexvar_ps(v, lut_s);
            wo[k] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut_s);
        }
        for j in 0..N {
            let xe = _mm512_loadu_ps(x.add(j * cols + b * 32)); let xo = _mm512_loadu_ps(x.add(j * cols + b * 32 + 16));
            for k in 0..R { acc[k][j] = _mm512_fmadd_ps(we[k], xe, acc[k][j]); acc[k][j] = _mm512_fmadd_ps(wo[k], xo, acc[k][j]); }
        }
    }
    for k in 0..R { for j in 0..N { out[k * N + j] = _mm512_reduce_add_ps(acc[k][j]); } }
}

// pre-decoded weights f32 [R, kc], inputs [N, kc] (packed), state in memory
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_f32<const R: usize, const N: usize>(w: *const f32, x: *const f32, kc: usize, st: *mut f32) {
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for i in 0..R { for j in 0..N { acc[i][j] = _mm512_loadu_ps(st.add((i * 32 + j) * 16)); } }
    let mut c = 0;
    while c < kc {
        let wv: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(w.add(i * kc + c)));
        for j in 0..N {
            let xv = _mm512_loadu_ps(x.add(j * kc + c));
            for i in 0..R { acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]); }
        }
        c += 16;
    }
    for i in 0..R { for j in 0..N { _mm512_storeu_ps(st.add((i * 32 + j) * 16), acc[i][j]); } }
}

fn main() {
    unsafe { for e in 0..256 { HS[e] = f32::from_bits(((e.max(2) - 1) as u32) << 23); } }
    let cols = 3584;
    let p: Vec<u8> = (0..48 * cols / 2).map(|i| (i * 7919 % 251) as u8).collect();
    let s: Vec<u8> = (0..48 * cols / 32).map(|i| 120 + (i % 7) as u8).collect();
    let x: Vec<f32> = (0..32 * cols).map(|i| ((i * 13 % 17) as f32) * 0.1 - 0.8).collect();
    let mut out = vec![0f32; 64];
    let ghz = 3.59;
    // A: 48-row block x 5-input groups: per call R=3,N=5 over all cols
    for _ in 0..2 {
        let iters = 2000;
        let t = Instant::now();
        for _ in 0..iters { for r in (0..48).step_by(3) { for g in 0..6 { unsafe { tile_dec::<3, 5>(p.as_ptr().add(r * cols / 2), s.as_ptr().add(r * cols / 32), cols, x.as_ptr().add(g * 5 * cols), &mut out) }; } } }
        let dt = t.elapsed().as_secs_f64();
        let flops = iters as f64 * 48.0 * 30.0 * cols as f64 * 2.0;
        println!("decode-in-tile 3x5: {:.1} GFLOP/s = {:.2} FMA/cycle-frac", flops / dt / 1e9, flops / dt / 1e9 / (32.0 * ghz));
    }
    // B: pre-decoded 4x6 over kc=256 column block, 32 inputs packed [32, kc]
    let kc = 256;
    let w: Vec<f32> = (0..4 * kc).map(|i| (i % 13) as f32 * 0.5).collect();
    let xp: Vec<f32> = (0..32 * kc).map(|i| (i % 11) as f32 * 0.25).collect();
    let mut st = vec![0f32; 48 * 32 * 16];
    for (rn, name) in [(0, "4x6"), (1, "4x5"), (2, "3x8"), (3, "6x4")] {
        let iters = 200_000;
        let t = Instant::now();
        for _ in 0..iters { unsafe {
            match rn { 0 => { for j in (0..30).step_by(6) { tile_f32::<4, 6>(w.as_ptr(), xp.as_ptr().add(j * kc), kc, st.as_mut_ptr().add(j * 16)); } }
                1 => { for j in (0..30).step_by(5) { tile_f32::<4, 5>(w.as_ptr(), xp.as_ptr().add(j * kc), kc, st.as_mut_ptr().add(j * 16)); } }
                2 => { for j in (0..32).step_by(8) { tile_f32::<3, 8>(w.as_ptr(), xp.as_ptr().add(j * kc), kc, st.as_mut_ptr().add(j * 16)); } }
                _ => { for j in (0..32).step_by(4) { tile_f32::<6, 4>(w.as_ptr(), xp.as_ptr().add(j * kc), kc, st.as_mut_ptr().add(j * 16)); } } }
        } }
        let dt = t.elapsed().as_secs_f64();
        let (r, n) = [(4.0, 30.0), (4.0, 30.0), (3.0, 32.0), (6.0, 32.0)][rn];
        let flops = iters as f64 * r * n * kc as f64 * 2.0;
        println!("predecoded {name}: {:.1} GFLOP/s = {:.2} of peak", flops / dt / 1e9, flops / dt / 1e9 / (32.0 * ghz));
    }
    std::hint::black_box(&out); std::hint::black_box(&st);
}
