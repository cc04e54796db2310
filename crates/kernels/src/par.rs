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

/// The fewest inputs in a share of [`by_input_shares`] (when there are enough for several).
pub const SHARE_MIN_INPUTS: usize = 32;
/// The most: every row block re-reads its share's inputs, and a long prompt's share uncapped
/// (512 inputs at 4,000 tokens on two threads: 14.7 MB of f32 at K3's width) would outgrow the
/// last-level cache, where 128 (3.7 MB) do not. Not measured at that length: on a 1,000-token
/// prompt shares of 64 and of 125 inputs gave the same time (BENCHMARKS.md section 12).
pub const SHARE_MAX_INPUTS: usize = 128;

/// Inputs per share in [`by_input_shares`]: all of them for a small product; else about four
/// shares per thread (more for a long prompt: [`SHARE_MAX_INPUTS`]), so that a thread that falls
/// behind (a vCPU the host holds back for a while: this project's 2-vCPU machine ran the same
/// 2-thread chunk product at 0.53-0.86 of the FMA roof from one run to the next with one share
/// per thread) leaves its last shares to the others; no fewer than [`SHARE_MIN_INPUTS`] inputs
/// each, since each share reads the whole matrix from memory once.
pub fn input_share(rows: usize, cols: usize, n: usize) -> usize {
    if rows * cols < PAR_MIN_WEIGHTS {
        return n;
    }
    let t = threads().max(1);
    n.div_ceil(4 * t).clamp(SHARE_MIN_INPUTS, SHARE_MAX_INPUTS).min(n.div_ceil(t))
}

/// A prompt chunk's product split by inputs into shares of [`input_share`] inputs (each share
/// reads the whole matrix from memory once; a small product stays on the calling thread, as in
/// [`par_rows`]), and within a share the rows in blocks of `block` (sized by the caller to stay
/// in the core's L2 cache while the share's inputs pass). Calls `kernel(first_input, inputs, first_row, block_rows, out)` where
/// `out` is the share's `[inputs, rows]` outputs from `first_row` on. Shapes: outs `[n, rows]`.
pub fn by_input_shares(
    rows: usize,
    cols: usize,
    n: usize,
    block: usize,
    outs: &mut [f32],
    kernel: impl Fn(usize, usize, usize, usize, &mut [f32]) + Sync,
) {
    if rows == 0 || n == 0 {
        return;
    }
    let share = input_share(rows, cols, n);
    let block = block.clamp(1, rows);
    outs[..n * rows].par_chunks_mut(share * rows).enumerate().for_each(|(i, o)| {
        let (t0, n_tok) = (i * share, o.len() / rows);
        for r0 in (0..rows).step_by(block) {
            kernel(t0, n_tok, r0, block.min(rows - r0), &mut o[r0..]);
        }
    });
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

/// Run `f` on a per-thread staging buffer laid out `[rows, n]` (reused: no allocation per
/// call once grown), then transpose it into `out` `[n, rows]`: batched kernels write a row's `n`
/// outputs together, and rows are what the threads split.
pub fn with_staged_rows(rows: usize, n: usize, out: &mut [f32], f: impl FnOnce(&mut [f32])) {
    thread_local! {
        static STAGED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    STAGED.with(|b| {
        let staged = &mut *b.borrow_mut();
        staged.resize(rows * n, 0.0); // [rows, n]
        f(staged);
        // Transposed in blocks of 64 rows: each output row's writes are contiguous and the
        // block's staged rows stay in L1 (row by row, every write touched a new cache line).
        for r0 in (0..rows).step_by(64) {
            let r1 = (r0 + 64).min(rows);
            for t in 0..n {
                for (r, o) in (r0..r1).zip(&mut out[t * rows + r0..t * rows + r1]) {
                    *o = staged[r * n + t];
                }
            }
        }
    });
}

/// Size the global pool (call once at start-up, before any parallel work).
pub fn init_threads(n: usize) -> Result<(), String> {
    rayon::ThreadPoolBuilder::new().num_threads(n).build_global().map_err(|e| e.to_string())
}

pub fn threads() -> usize {
    rayon::current_num_threads()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool")
    }

    /// A large product's shares: about four per thread, within [SHARE_MIN_INPUTS,
    /// SHARE_MAX_INPUTS] where the inputs allow, never more than one thread's even part; a small
    /// product keeps all its inputs in one share.
    #[test]
    fn input_shares_are_bounded() {
        let (rows, cols) = (4096, 1024); // 4 Mi weights: a large product
        for threads in [1, 2, 3, 16] {
            pool(threads).install(|| {
                for n in [1, 5, 31, 32, 33, 64, 100, 255, 256, 1000, 4096, 16000] {
                    let s = input_share(rows, cols, n);
                    let even = n.div_ceil(threads);
                    assert!(s >= 1 && s <= even, "{threads} threads, {n} inputs: share {s}");
                    assert!(s >= SHARE_MIN_INPUTS.min(even), "{threads} threads, {n} inputs: share {s}");
                    assert!(s <= SHARE_MAX_INPUTS, "{threads} threads, {n} inputs: share {s}");
                    if threads > 1 && n >= 8 * threads * SHARE_MIN_INPUTS {
                        assert!(
                            n.div_ceil(s) >= 4 * threads,
                            "{threads} threads, {n} inputs: only {} shares",
                            n.div_ceil(s)
                        );
                    }
                }
                assert_eq!(input_share(8, 8, 1000), 1000, "a small product: one share");
            });
        }
    }

    /// Every (input, row) of the output is handed to the kernel exactly once, with its own
    /// indices, however the inputs fall into shares and the rows into blocks.
    #[test]
    fn input_shares_cover_every_output_once() {
        let (rows, cols) = (100, PAR_MIN_WEIGHTS / 64);
        for threads in [1, 2, 3] {
            for (n, block) in [(1, 7), (40, 100), (150, 7), (301, 33)] {
                let mut outs = vec![0f32; n * rows];
                pool(threads).install(|| {
                    by_input_shares(rows, cols, n, block, &mut outs, |t0, n_tok, r0, m, o| {
                        for t in 0..n_tok {
                            for i in 0..m {
                                o[t * rows + i] += ((t0 + t) * rows + r0 + i + 1) as f32;
                            }
                        }
                    })
                });
                for (k, v) in outs.iter().enumerate() {
                    assert_eq!(*v, (k + 1) as f32, "{threads} threads, {n} inputs, blocks of {block}: output {k}");
                }
            }
        }
    }
}
