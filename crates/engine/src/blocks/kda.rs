//! Kimi Delta Attention: a gated delta-rule linear attention with a short causal convolution.
//!
//! Per token and head, with the recurrent state `S [Dv, Dk]`:
//! `S <- S * g` (per key channel), `S <- S + k (beta (v - S k))^T`, `y = S q`,
//! then a per-head RMSNorm gated by `sigmoid(g_proj x)`.

use anyhow::Result;
use deltafin_kernels::attention::kda_head_step;
use deltafin_kernels::ops::{rms_norm_inplace, sigmoid, silu, softplus};
use deltafin_kernels::par::PAR_MIN_WEIGHTS;
use deltafin_store::SpineSource;
use deltafin_store::config::LinearAttnConfig;
use rayon::prelude::*;

use deltafin_gpu::kda::KdaRecurrence;
use deltafin_gpu::spine::SpineRunner;

use crate::scratch::Scratch;
use crate::weights::{Linear, load_vec, load_vec_prefix};

pub enum Gate {
    /// `g_proj [P, H]`.
    FullRank(Linear),
    /// `g_b_proj (g_a_proj x)`: `[D, H]` then `[P, D]`.
    LowRank(Linear, Linear),
}

pub struct Kda {
    pub heads: usize,
    pub head_dim: usize,
    pub kernel: usize,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// Conv taps `[3][P * K]`: for q, k, v; tap `j` of channel `c` at `c*K + j`, tap `K-1`
    /// multiplying the newest input.
    pub conv: [Vec<f32>; 3],
    pub f_a: Linear,
    pub f_b: Linear,
    pub b_proj: Linear,
    pub gate: Gate,
    /// `[heads]`.
    pub a_log: Vec<f32>,
    /// `[P]`.
    pub dt_bias: Vec<f32>,
    /// `[D]`.
    pub o_norm: Vec<f32>,
    pub o_proj: Linear,
    pub lower_bound: Option<f32>,
    pub eps: f32,
}

/// Per-sequence state of one KDA layer.
pub struct KdaState {
    /// The last `K-1` inputs of the q, k, v convolutions, oldest first: `[3][(K-1) * P]`.
    pub conv: [Vec<f32>; 3],
    /// Recurrent state `[heads, Dv, Dk]`.
    pub s: Vec<f32>,
}

impl KdaState {
    /// Zero state for a layer of this configuration.
    pub fn new(c: &LinearAttnConfig) -> Self {
        let p = c.num_heads * c.head_dim;
        let hist = (c.short_conv_kernel_size - 1) * p;
        KdaState {
            conv: [vec![0.0; hist], vec![0.0; hist], vec![0.0; hist]],
            s: vec![0.0; c.num_heads * c.head_dim * c.head_dim],
        }
    }
}

impl Kda {
    /// `prefix` ends with `self_attn.`.
    pub fn load(store: &dyn SpineSource, prefix: &str, c: &LinearAttnConfig, hidden: usize, eps: f32) -> Result<Self> {
        let (nh, d, k) = (c.num_heads, c.head_dim, c.short_conv_kernel_size);
        let p = nh * d;
        let lin = |n: &str, r, cols| Linear::load_shaped(store, &format!("{prefix}{n}.weight"), r, cols);
        let conv = |n: &str| load_vec(store, &format!("{prefix}{n}_conv1d.weight"), p * k);
        let gate = if c.use_full_rank_gate {
            Gate::FullRank(lin("g_proj", p, hidden)?)
        } else {
            Gate::LowRank(lin("g_a_proj", d, hidden)?, lin("g_b_proj", p, d)?)
        };
        Ok(Kda {
            heads: nh,
            head_dim: d,
            kernel: k,
            q_proj: lin("q_proj", p, hidden)?,
            k_proj: lin("k_proj", p, hidden)?,
            v_proj: lin("v_proj", p, hidden)?,
            conv: [conv("q")?, conv("k")?, conv("v")?],
            f_a: lin("f_a_proj", d, hidden)?,
            f_b: lin("f_b_proj", p, d)?,
            b_proj: lin("b_proj", nh, hidden)?,
            gate,
            a_log: load_vec_prefix(store, &format!("{prefix}A_log"), nh)?,
            dt_bias: load_vec(store, &format!("{prefix}dt_bias"), p)?,
            o_norm: load_vec(store, &format!("{prefix}o_norm.weight"), d)?,
            o_proj: lin("o_proj", hidden, p)?,
            lower_bound: c.gate_lower_bound,
            eps,
        })
    }

    /// Causal depthwise conv over (history, x) then SiLU; shifts `x` into the history.
    /// Shapes: x, out `[P]`, hist `[(K-1) * P]`, taps `[P * K]`.
    fn conv_step(taps: &[f32], kernel: usize, hist: &mut [f32], x: &[f32], out: &mut [f32]) {
        let p = x.len();
        for c in 0..p {
            let w = &taps[c * kernel..(c + 1) * kernel];
            let mut acc = w[kernel - 1] * x[c];
            for j in 0..kernel - 1 {
                acc += w[j] * hist[j * p + c];
            }
            out[c] = silu(acc);
        }
        if kernel > 1 {
            hist.copy_within(p.., 0);
            hist[(kernel - 2) * p..].copy_from_slice(x);
        }
    }

    /// [`Self::conv_step`] over `t_n` tokens at once, each token's output from its own input and
    /// the `K-1` before it (from `xs`, or from the history for the chunk's first tokens), in the
    /// step's order of operations (the same bits), tokens spread over the thread pool; the
    /// history then holds the chunk's last `K-1` inputs. Shapes: taps `[P * K]`, hist `[(K-1) *
    /// P]`, xs, out `[T, P]` (out: at least that long); `K - 1` at most [`MAX_CONV_LAG`].
    #[allow(clippy::too_many_arguments)]
    fn conv_chunk(taps: &[f32], kernel: usize, p: usize, hist: &mut [f32], xs: &[f32], t_n: usize, out: &mut [f32]) {
        let lag = kernel - 1;
        assert!(lag <= MAX_CONV_LAG && hist.len() == lag * p && xs.len() >= t_n * p, "a short conv of {kernel} taps");
        let out = &mut out[..t_n * p];
        // Tokens per work item: about 256 Ki values, whole tokens.
        let per = ((256 << 10) / p.max(1)).max(1);
        let hist_ro: &[f32] = hist;
        out.par_chunks_mut(per * p).enumerate().for_each(|(blk, o)| {
            let mut window: [&[f32]; MAX_CONV_LAG] = [&[]; MAX_CONV_LAG]; // the lag inputs, oldest first
            for (dt, row) in o.chunks_exact_mut(p).enumerate() {
                let t = blk * per + dt;
                let x = &xs[t * p..(t + 1) * p];
                for (j, w) in window[..lag].iter_mut().enumerate() {
                    // Token t - lag + j, from the history before the chunk's first.
                    *w = if t + j >= lag {
                        &xs[(t + j - lag) * p..(t + j - lag + 1) * p]
                    } else {
                        &hist_ro[(t + j) * p..(t + j + 1) * p]
                    };
                }
                for c in 0..p {
                    let w = &taps[c * kernel..(c + 1) * kernel];
                    let mut acc = w[kernel - 1] * x[c];
                    for j in 0..lag {
                        acc += w[j] * window[j][c];
                    }
                    row[c] = silu(acc);
                }
            }
        });
        // The history after the chunk: inputs T - lag .. T - 1 (the older ones shifted down
        // where the chunk is shorter than the lag).
        let keep = lag.saturating_sub(t_n);
        hist.copy_within((lag - keep) * p..lag * p, 0);
        let from = t_n.saturating_sub(lag);
        hist[keep * p..lag * p].copy_from_slice(&xs[from * p..t_n * p]);
    }

    /// One token. Shapes: x `[hidden]` (already normed), out `[hidden]`.
    pub fn forward(&self, st: &mut KdaState, x: &[f32], out: &mut [f32], sc: &mut Scratch) {
        self.forward_chunk(st, x, 1, out, sc)
    }

    /// `t_n` tokens in order: the projections of the whole chunk first (each matrix read once
    /// per share of tokens, [`Linear::forward_batch`]), then the short conv and the delta-rule
    /// recurrence token by token, then the output projection of the chunk. Per token the
    /// arithmetic is exactly the single-token step's. Shapes: xs, outs `[T, hidden]` (xs
    /// already normed).
    pub fn forward_chunk(&self, st: &mut KdaState, xs: &[f32], t_n: usize, outs: &mut [f32], sc: &mut Scratch) {
        let (nh, d) = (self.heads, self.head_dim);
        let p = nh * d;
        // [T, P] q, k, v before the conv (after it, on the parallel path)
        let mut pre = [sc.take(t_n * p), sc.take(t_n * p), sc.take(t_n * p)];
        let mut fa = sc.take(t_n * d); // [T, D]
        let mut b = sc.take(t_n * nh); // [T, heads]
        let mut gate = sc.take(t_n * p); // [T, P]
        // Every projection of the normed input at once (on the GPU, the input goes up once).
        let [q_pre, k_pre, v_pre] = &mut pre;
        match &self.gate {
            Gate::FullRank(gp) => Linear::forward_batch_shared(
                &[&self.q_proj, &self.k_proj, &self.v_proj, &self.f_a, &self.b_proj, gp],
                xs,
                t_n,
                &mut [q_pre, k_pre, v_pre, &mut fa, &mut b, &mut gate],
            ),
            Gate::LowRank(ga, gb) => {
                let mut t = sc.take(t_n * d); // [T, D]
                Linear::forward_batch_shared(
                    &[&self.q_proj, &self.k_proj, &self.v_proj, &self.f_a, &self.b_proj, ga],
                    xs,
                    t_n,
                    &mut [q_pre, k_pre, v_pre, &mut fa, &mut b, &mut t],
                );
                gb.forward_batch(&t, t_n, &mut gate);
                sc.give(t);
            }
        }
        let mut a = sc.take(t_n * p); // [T, P] decay logits
        self.f_b.forward_batch(&fa, t_n, &mut a);
        let mut ys = sc.take(t_n * p); // [T, P]
        let mut q = sc.take(p); // [P]
        let mut k = sc.take(p); // [P]
        let mut v = sc.take(p); // [P]
        if t_n >= PARALLEL_HEADS_MIN_TOKENS && deltafin_kernels::par::threads() > 1 {
            // The short conv of the whole chunk (tokens in parallel, into `ys`, which is free
            // until the recurrence), its output taking the projections' place; then the heads
            // in parallel.
            for (i, proj) in pre.iter_mut().enumerate() {
                if self.kernel - 1 <= MAX_CONV_LAG {
                    Self::conv_chunk(&self.conv[i], self.kernel, p, &mut st.conv[i], proj, t_n, &mut ys);
                    std::mem::swap(proj, &mut ys);
                } else {
                    // A conv this long (no known model) goes token by token.
                    for t in 0..t_n {
                        let span = t * p..(t + 1) * p;
                        Self::conv_step(&self.conv[i], self.kernel, &mut st.conv[i], &proj[span.clone()], &mut q);
                        proj[span].copy_from_slice(&q[..p]);
                    }
                }
            }
            // A chunk whose spine products go to the GPU walks its states there too.
            match crate::chunk_spine::current().filter(|_| t_n >= SpineRunner::MIN_TOKENS && KdaRecurrence::supports(d))
            {
                Some(g) => self.heads_on_gpu(&g, st, &mut pre, &mut a, &mut b, &gate, t_n, &mut ys),
                None => self.heads_parallel(st, &pre, &a, &b, &gate, t_n, &mut ys),
            }
        } else {
            // A decode step (or a short chunk): token by token, each token's heads on the thread
            // pool when the states are large enough to gain (K3: 96 heads of 64 KiB), each with
            // its own decay and delta scratch.
            let parallel = nh * d * d >= PAR_MIN_WEIGHTS && deltafin_kernels::par::threads() > 1;
            let mut gd = sc.take(nh * 2 * d); // [heads, 2, D] each head's decay and delta
            for t in 0..t_n {
                let span = t * p..(t + 1) * p;
                for (i, dst) in [&mut q, &mut k, &mut v].into_iter().enumerate() {
                    Self::conv_step(&self.conv[i], self.kernel, &mut st.conv[i], &pre[i][span.clone()], dst);
                }
                let (a_t, b_t, gate_t, y) =
                    (&a[span.clone()], &b[t * nh..(t + 1) * nh], &gate[span.clone()], &mut ys[span]);
                let head = |h: usize, (q, k, s, y, gd): HeadBufs<'_>| {
                    let hs = h * d..(h + 1) * d;
                    let x = HeadIn { q, k, v: &v[hs.clone()], a: &a_t[hs.clone()], b: b_t[h], gate: &gate_t[hs] };
                    let (g, delta) = gd.split_at_mut(d);
                    self.head_step(h, x, s, g, delta, y);
                };
                if parallel {
                    let heads = (
                        q[..p].par_chunks_mut(d),
                        k[..p].par_chunks_mut(d),
                        st.s.par_chunks_mut(d * d),
                        y.par_chunks_mut(d),
                        gd.par_chunks_mut(2 * d),
                    );
                    heads.into_par_iter().enumerate().for_each(|(h, x)| head(h, x));
                } else {
                    let serial = q[..p].chunks_mut(d).zip(k[..p].chunks_mut(d)).zip(st.s.chunks_mut(d * d));
                    let serial = serial.zip(y.chunks_mut(d)).zip(gd.chunks_mut(2 * d));
                    for (h, ((((q, k), s), y), gd)) in serial.enumerate() {
                        head(h, (q, k, s, y, gd));
                    }
                }
            }
            sc.give(gd);
        }
        self.o_proj.forward_batch_exact_inputs(&ys, t_n, outs);
        let [p0, p1, p2] = pre;
        for buf in [p0, p1, p2, fa, a, b, gate, q, k, v, ys] {
            sc.give(buf);
        }
    }

    /// One head of one token after the projections and the conv: q and k L2-normalised (eps
    /// added to the sum of squares; q also takes the 1/sqrt(D) readout scale), the decay and
    /// the gated delta-rule step on the head's state, then the output norm and gate. Both the
    /// token-by-token loop and the parallel one run this, so they agree bit for bit. Shapes:
    /// s `[Dv, Dk]`; g, delta scratch and y `[D]`.
    fn head_step(&self, h: usize, x: HeadIn<'_>, s: &mut [f32], g: &mut [f32], delta: &mut [f32], y: &mut [f32]) {
        self.normalise_qk(x.q, x.k);
        let ea = self.a_log[h].exp();
        for ((gj, &aj), &bias) in g.iter_mut().zip(x.a).zip(&self.dt_bias[h * self.head_dim..(h + 1) * self.head_dim]) {
            *gj = self.decay(ea, aj + bias);
        }
        kda_head_step(s, x.q, x.k, x.v, g, sigmoid(x.b), delta, y);
        self.finish_head(y, x.gate);
    }

    /// One head's q and k L2-normalised in place (eps added to the sum of squares; q also takes
    /// the 1/sqrt(D) readout scale). Shapes: q, k `[D]`.
    fn normalise_qk(&self, q: &mut [f32], k: &mut [f32]) {
        let scale = (self.head_dim as f32).powf(-0.5);
        for (seg, sc) in [(q, scale), (k, 1.0)] {
            let ss: f32 = seg.iter().map(|v| v * v).sum();
            let inv = sc / (ss + 1e-6).sqrt();
            seg.iter_mut().for_each(|v| *v *= inv);
        }
    }

    /// A key channel's decay from its logit plus bias `z` (`ea`: the head's `exp(A_log)`).
    #[inline]
    fn decay(&self, ea: f32, z: f32) -> f32 {
        match self.lower_bound {
            Some(lb) => (lb * sigmoid(ea * z)).exp(),
            None => (-ea * softplus(z)).exp(),
        }
    }

    /// One head's output: RMSNorm, then the sigmoid gate. Shapes: y, gate `[D]`.
    fn finish_head(&self, y: &mut [f32], gate: &[f32]) {
        rms_norm_inplace(y, &self.o_norm, self.eps);
        for (v, &gt) in y.iter_mut().zip(gate) {
            *v *= sigmoid(gt);
        }
    }

    /// The recurrence of a prompt chunk with the states walked on the GPU
    /// ([`SpineRunner::kda_recur`]): each token's heads prepared in place on the CPU's threads
    /// (q and k normalised, decays over the decay logits, beta over its logit), the recurrence
    /// there (on the CPU, heads in parallel, if the GPU fails: logged), then each head's norm and
    /// gate. Shapes: qkv (after the conv), a, gate, ys `[T, P]`; b `[T, heads]`.
    #[allow(clippy::too_many_arguments)]
    fn heads_on_gpu(
        &self,
        gpu: &SpineRunner,
        st: &mut KdaState,
        qkv: &mut [Vec<f32>; 3],
        a: &mut [f32],
        b: &mut [f32],
        gate: &[f32],
        t_n: usize,
        ys: &mut [f32],
    ) {
        let (nh, d) = (self.heads, self.head_dim);
        let p = nh * d;
        let [q, k, v] = qkv;
        let (q, k, v, a, b, ys) = (
            &mut q[..t_n * p],
            &mut k[..t_n * p],
            &v[..t_n * p],
            &mut a[..t_n * p],
            &mut b[..t_n * nh],
            &mut ys[..t_n * p],
        );
        let tokens = q.par_chunks_mut(p).zip(k.par_chunks_mut(p)).zip(a.par_chunks_mut(p)).zip(b.par_chunks_mut(nh));
        tokens.for_each(|(((qt, kt), at), bt)| {
            for (h, beta) in bt.iter_mut().enumerate() {
                let hs = h * d..(h + 1) * d;
                self.normalise_qk(&mut qt[hs.clone()], &mut kt[hs.clone()]);
                let ea = self.a_log[h].exp();
                for (z, &bias) in at[hs.clone()].iter_mut().zip(&self.dt_bias[hs]) {
                    *z = self.decay(ea, *z + bias);
                }
                *beta = sigmoid(*beta);
            }
        });
        // In blocks of tokens (the GPU's buffers bounded whatever the chunk), the state carried
        // from one to the next; from the first block the GPU fails, the CPU takes the rest.
        let mut done = 0;
        while done < t_n {
            let n = (t_n - done).min(GPU_RECURRENCE_TOKENS);
            let (span, heads) = (done * p..(done + n) * p, done * nh..(done + n) * nh);
            let r = gpu.kda_recur(
                &mut st.s,
                &q[span.clone()],
                &k[span.clone()],
                &a[span.clone()],
                &v[span.clone()],
                &b[heads],
                nh,
                n,
                &mut ys[span],
            );
            if let Err(e) = r {
                tracing::warn!("KDA's recurrence on the GPU failed, computed on the CPU instead: {e}");
                break;
            }
            done += n;
        }
        if done < t_n {
            let rest = t_n - done;
            let mut per_head: Vec<Vec<&mut [f32]>> = (0..nh).map(|_| Vec::with_capacity(rest)).collect();
            for (i, seg) in ys[done * p..].chunks_mut(d).enumerate() {
                per_head[i % nh].push(seg);
            }
            let (q, k, a, b) = (&*q, &*k, &*a, &*b);
            per_head.into_par_iter().zip(st.s.par_chunks_mut(d * d)).enumerate().for_each(|(h, (outs, s))| {
                let mut delta = vec![0f32; d]; // [D]
                for (j, y) in outs.into_iter().enumerate() {
                    let t = done + j;
                    let o = t * p + h * d..t * p + (h + 1) * d;
                    kda_head_step(s, &q[o.clone()], &k[o.clone()], &v[o.clone()], &a[o], b[t * nh + h], &mut delta, y);
                }
            });
        }
        ys.par_chunks_mut(p).zip(gate[..t_n * p].par_chunks(p)).for_each(|(yt, gt)| {
            for (y, g) in yt.chunks_mut(d).zip(gt.chunks(d)) {
                self.finish_head(y, g);
            }
        });
    }

    /// The recurrence of a chunk with the heads split over the thread pool: each head walks the
    /// chunk's tokens with its own state (64 KiB on K3, resident in the core's cache for the
    /// whole chunk instead of every head's state passing through it per token). Shapes: qkv
    /// (after the conv), a, gate, ys `[T, P]`; b `[T, heads]`; the state's `s` `[heads, Dv, Dk]`.
    #[allow(clippy::too_many_arguments)]
    fn heads_parallel(
        &self,
        st: &mut KdaState,
        qkv: &[Vec<f32>; 3],
        a: &[f32],
        b: &[f32],
        gate: &[f32],
        t_n: usize,
        ys: &mut [f32],
    ) {
        let (nh, d) = (self.heads, self.head_dim);
        let p = nh * d;
        // Each head's output segments, token by token (ys is [T, heads, D]).
        let mut per_head: Vec<Vec<&mut [f32]>> = (0..nh).map(|_| Vec::with_capacity(t_n)).collect();
        for (i, seg) in ys[..t_n * p].chunks_mut(d).enumerate() {
            per_head[i % nh].push(seg);
        }
        per_head.into_par_iter().zip(st.s.par_chunks_mut(d * d)).enumerate().for_each(|(h, (outs, s))| {
            let mut buf = vec![0f32; 4 * d]; // q, k, decay, delta of this head: [4, D]
            let (q, rest) = buf.split_at_mut(d);
            let (k, rest) = rest.split_at_mut(d);
            let (g, delta) = rest.split_at_mut(d);
            for (t, y) in outs.into_iter().enumerate() {
                let o = t * p + h * d..t * p + (h + 1) * d;
                q.copy_from_slice(&qkv[0][o.clone()]);
                k.copy_from_slice(&qkv[1][o.clone()]);
                let x = HeadIn { q, k, v: &qkv[2][o.clone()], a: &a[o.clone()], b: b[t * nh + h], gate: &gate[o] };
                self.head_step(h, x, s, g, delta, y);
            }
        });
    }
}

/// Tokens per call of KDA's recurrence on the GPU: its inputs `[4, T, P]` are 200 MB a call on
/// K3, within what any adapter binds at once.
const GPU_RECURRENCE_TOKENS: usize = 1024;

/// The most inputs before the newest that the short conv of a chunk takes (K3: 3).
const MAX_CONV_LAG: usize = 8;

/// A prompt chunk at least this long walks the chunk head by head, the heads in parallel;
/// shorter ones (decode steps included) go token by token, each token's heads in parallel.
const PARALLEL_HEADS_MIN_TOKENS: usize = 8;

/// One head's buffers in a decode step: q and k `[D]` (normalised in place), its state
/// `[Dv, Dk]`, its output `[D]`, and its decay and delta scratch `[2, D]`.
type HeadBufs<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32], &'a mut [f32], &'a mut [f32]);

/// One head's inputs for one token: q and k before their normalisation, v, the decay logits,
/// the beta logit and the output-gate logits. All `[D]`.
struct HeadIn<'a> {
    q: &'a mut [f32],
    k: &'a mut [f32],
    v: &'a [f32],
    a: &'a [f32],
    b: f32,
    gate: &'a [f32],
}
