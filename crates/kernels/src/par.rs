//! Row-parallel mat-vecs on a persistent thread pool (rayon's, sized to the cores once; no thread
//! is spawned per call). Each row is computed by the same single-threaded kernel as in the serial
//! path, so results are bit-identical whatever the thread count.
//!
//! Layer 1: imports nothing from the crate.

use rayon::prelude::*;

/// Below this many weights a product stays on the calling thread: fork/join costs more.
pub const PAR_MIN_WEIGHTS: usize = 1 << 18;

/// Run `kernel(first_row, out_chunk)` over row chunks of `out` in parallel when `rows * cols` is
/// large enough, else once over all rows.
pub fn par_rows(rows: usize, cols: usize, out: &mut [f32], kernel: impl Fn(usize, &mut [f32]) + Sync) {
    let threads = rayon::current_num_threads();
    if threads <= 1 || rows * cols < PAR_MIN_WEIGHTS || rows < 2 * threads {
        kernel(0, out);
        return;
    }
    // A few chunks per thread balance uneven progress without much scheduling.
    let chunk = rows.div_ceil(threads * 4).max(1);
    out.par_chunks_mut(chunk).enumerate().for_each(|(i, o)| kernel(i * chunk, o));
}

/// [`par_rows`] for an output laid out `[rows, width]`: chunks hold whole rows of `width`
/// values, and `kernel(first_row, chunk)` sees `chunk.len() / width` rows.
pub fn par_rows_wide(
    rows: usize,
    cols: usize,
    width: usize,
    out: &mut [f32],
    kernel: impl Fn(usize, &mut [f32]) + Sync,
) {
    assert_eq!(out.len(), rows * width);
    let threads = rayon::current_num_threads();
    if threads <= 1 || rows * cols < PAR_MIN_WEIGHTS || rows < 2 * threads {
        kernel(0, out);
        return;
    }
    let chunk = rows.div_ceil(threads * 4).max(1);
    out.par_chunks_mut(chunk * width).enumerate().for_each(|(i, o)| kernel(i * chunk, o));
}

/// Size the global pool (call once at start-up, before any parallel work).
pub fn init_threads(n: usize) -> Result<(), String> {
    rayon::ThreadPoolBuilder::new().num_threads(n).build_global().map_err(|e| e.to_string())
}

pub fn threads() -> usize {
    rayon::current_num_threads()
}
