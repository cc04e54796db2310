//! Latent mixture-of-experts (Kimi K3): the router picks experts on the full hidden state; the
//! chosen experts work in a narrower latent space,
//! `y = up(norm(sum_k w_k E_k(down(x)))) + shared(x)`.
//!
//! Routed-expert weights arrive only through [`ExpertSource`] as MXFP4 records.

use anyhow::Result;
use deltafin_gpu::expert::ExpertRunner;
use deltafin_kernels::approx::{QuantizedRows, QuantizedX, expert_mxfp4_approx, expert_mxfp4_batch_q8};
use deltafin_kernels::expert::{Mxfp4, expert_mxfp4, expert_mxfp4_batch};
use deltafin_kernels::ops::rms_norm_inplace;
use deltafin_store::{K3Config, SpineSource};
use rayon::prelude::*;

use super::mlp::GatedMlp;
use super::router::{select_experts, weights_for};
use crate::experts::{ExpertSource, RecordLayout};
use crate::scratch::Scratch;
use crate::weights::{Linear, load_vec};

/// Which tokens chose each of a chunk's experts ([`LatentMoe::index_users`]).
#[derive(Default)]
struct UserIndex {
    /// `[E]` an expert's place in the union.
    pos: Vec<usize>,
    /// `[union]` where each expert's next user goes.
    cursor: Vec<usize>,
    /// `[union + 1]` where each expert's users start in `list`.
    start: Vec<usize>,
    /// token * k + slot of every (token, slot), grouped by expert.
    list: Vec<usize>,
    /// `[T * k]` where token * k + slot sits in `list` (its output's row).
    row: Vec<usize>,
}

impl UserIndex {
    fn users(&self, u: usize) -> &[usize] {
        &self.list[self.start[u]..self.start[u + 1]]
    }
}

/// An expert's outputs of at least this many values are put in place by the thread pool,
/// [`COPY_SHARE`] values per work item (a long prompt's popular expert returns tens of MB).
const PARALLEL_COPY_VALUES: usize = 1 << 20;
const COPY_SHARE: usize = 1 << 16;

/// A chunk of at least this many tokens routes them on the thread pool, [`ROUTING_SHARE`] per
/// work item (each token's sigmoids and top-k over all the layer's experts, at every MoE layer,
/// ran on one thread before); decode steps stay serial and allocate nothing.
const PARALLEL_ROUTING_TOKENS: usize = 64;
const ROUTING_SHARE: usize = 64;

pub struct LatentMoe {
    pub layer: usize,
    pub top_k: usize,
    pub renormalize: bool,
    pub scaling: f32,
    /// `[E, H]`.
    pub gate: Linear,
    /// `[E]`.
    pub bias: Vec<f32>,
    /// `[LAT, H]`, absent when experts work at full width.
    pub down: Option<Linear>,
    /// `[LAT]`.
    pub norm: Option<Vec<f32>>,
    /// `[H, LAT]`.
    pub up: Option<Linear>,
    pub shared: Option<GatedMlp>,
    pub inter: usize,
    pub latent: usize,
    pub beta: f32,
    pub linear_beta: Option<f32>,
    pub eps: f32,
    /// Where the six tensors sit in this store's expert records.
    pub layout: RecordLayout,
}

/// How one MoE step runs beyond its input.
#[derive(Clone, Copy, Default)]
pub struct MoeRun<'a> {
    /// The next MoE layer, whose router predicts its picks from this layer's input.
    pub next: Option<&'a LatentMoe>,
    /// Hint the prediction to the expert source (prefetch).
    pub hint: bool,
    /// Approximate mode: int8 activations for the routed experts.
    pub approx: bool,
    /// Compute the routed experts on the GPU.
    pub gpu: Option<&'a ExpertRunner>,
}

/// What the router chose for one token of one layer (kept for traces and tests).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
    /// When set, the next token uses `experts` as given instead of the router's choice (weights
    /// still come from this run's router scores). For studies that separate routing flips from
    /// numerical error.
    pub pinned: bool,
    /// The next MoE layer's experts as predicted from this layer's input (empty unless the
    /// model predicts: for prefetch or for a trace).
    pub predicted_next: Vec<usize>,
    /// With `pinned`, a recorded prediction of the next MoE layer's experts that replaces the
    /// model's own (replaying a trained model's trace on a store whose routers are random, so
    /// that prefetch is studied with the trained predictor's guesses).
    pub pinned_next: Vec<usize>,
}

impl Routing {
    /// Become a copy of `other` in this routing's own buffers (no allocation once they have
    /// reached top-k: the per-token loop copies routings between the state and a chunk).
    pub fn copy_from(&mut self, other: &Routing) {
        self.experts.clone_from(&other.experts);
        self.weights.clone_from(&other.weights);
        self.pinned = other.pinned;
        self.predicted_next.clone_from(&other.predicted_next);
        self.pinned_next.clone_from(&other.pinned_next);
    }
}

impl LatentMoe {
    pub fn load(store: &dyn SpineSource, layer: usize, c: &K3Config, layout: &RecordLayout) -> Result<Self> {
        let p = format!("layers.{layer}.block_sparse_moe.");
        let h = c.hidden_size;
        let lat = c.expert_input_dim();
        let (down, norm, up) = match c.routed_expert_hidden_size {
            Some(l) => (
                Some(Linear::load_shaped(store, &format!("{p}routed_expert_down_proj.weight"), l, h)?),
                if c.latent_moe_use_norm {
                    Some(load_vec(store, &format!("{p}routed_expert_norm.weight"), l)?)
                } else {
                    None
                },
                Some(Linear::load_shaped(store, &format!("{p}routed_expert_up_proj.weight"), h, l)?),
            ),
            None => (None, None, None),
        };
        let shared = if c.num_shared_experts > 0 {
            let si = c.moe_intermediate_size * c.num_shared_experts;
            Some(GatedMlp::load(
                store,
                &format!("{p}shared_experts."),
                h,
                si,
                c.situ_beta(),
                c.activation_situ_linear_beta,
            )?)
        } else {
            None
        };
        Ok(LatentMoe {
            layer,
            top_k: c.num_experts_per_token,
            renormalize: c.moe_renormalize,
            scaling: c.routed_scaling_factor,
            gate: Linear::load_shaped(store, &format!("{p}gate.weight"), c.num_experts, h)?,
            bias: load_vec(store, &format!("{p}gate.e_score_correction_bias"), c.num_experts)?,
            down,
            norm,
            up,
            shared,
            inter: c.moe_intermediate_size,
            latent: lat,
            beta: c.situ_beta(),
            linear_beta: c.activation_situ_linear_beta,
            eps: c.rms_norm_eps,
            layout: layout.clone(),
        })
    }

    /// Route one token from its router logits: the top-k, or a pinned choice re-weighted by
    /// this router. Shapes: logits `[E]`.
    fn route(&self, logits: &[f32], r: &mut Routing, sc: &mut Scratch) -> Result<()> {
        if r.pinned {
            anyhow::ensure!(r.experts.iter().all(|&e| e < self.gate.rows), "pinned expert id out of range");
            weights_for(logits, &r.experts, self.renormalize, self.scaling, &mut r.weights);
        } else {
            select_experts(
                logits,
                &self.bias,
                self.top_k,
                self.renormalize,
                self.scaling,
                &mut r.experts,
                &mut r.weights,
                sc,
            );
        }
        Ok(())
    }

    /// One routed expert applied to one token's latent input. Shapes: xl `[LAT]`, out `[LAT]`,
    /// a and gu `[I]` scratch (gu only in approximate mode, where `xq` is `xl` quantised).
    #[allow(clippy::too_many_arguments)]
    fn expert_into(
        &self,
        record: &[u8],
        xl: &[f32],
        xq: &QuantizedX,
        approx: bool,
        a: &mut [f32],
        gu: &mut [f32],
        aq: &mut QuantizedX,
        out: &mut [f32],
    ) -> Result<()> {
        let layout = &self.layout;
        anyhow::ensure!(record.len() >= layout.record_bytes, "expert record is too short");
        let (i, lat) = (self.inter, self.latent);
        // w1 = gate, w3 = up: [I, LAT]; w2 = down: [LAT, I]. One fused pass per expert.
        let m = |p: usize| Mxfp4 { packed: layout.part(record, p), scales: layout.part(record, p + 1) };
        if approx {
            expert_mxfp4_approx(m(0), m(4), m(2), i, lat, xq, self.beta, self.linear_beta, gu, a, aq, out);
        } else {
            expert_mxfp4(m(0), m(4), m(2), i, lat, xl, self.beta, self.linear_beta, a, out);
        }
        Ok(())
    }

    /// One exact-mode expert for `n` tokens at once (each weight block decoded once for all of
    /// them; per token bit-identical to [`Self::expert_into`]). Shapes: xs `[n, LAT]`, act
    /// `[n, I]`, out `[n, LAT]`.
    fn expert_batch_into(&self, record: &[u8], xs: &[f32], n: usize, act: &mut [f32], out: &mut [f32]) -> Result<()> {
        let layout = &self.layout;
        anyhow::ensure!(record.len() >= layout.record_bytes, "expert record is too short");
        let m = |p: usize| Mxfp4 { packed: layout.part(record, p), scales: layout.part(record, p + 1) };
        expert_mxfp4_batch(m(0), m(4), m(2), self.inter, self.latent, xs, n, self.beta, self.linear_beta, act, out);
        Ok(())
    }

    /// [`Self::expert_batch_into`] in integers (approximate mode, a prompt chunk's): false where
    /// this CPU has no integer kernel.
    fn expert_batch_q8_into(
        &self,
        record: &[u8],
        xs: &[f32],
        n: usize,
        act: &mut [f32],
        out: &mut [f32],
    ) -> Result<bool> {
        let layout = &self.layout;
        anyhow::ensure!(record.len() >= layout.record_bytes, "expert record is too short");
        let m = |p: usize| Mxfp4 { packed: layout.part(record, p), scales: layout.part(record, p + 1) };
        let (beta, lb) = (self.beta, self.linear_beta);
        Ok(expert_mxfp4_batch_q8(m(0), m(4), m(2), self.inter, self.latent, xs, n, beta, lb, act, out))
    }

    /// Submit expert `e` to the GPU for the tokens that chose it (`users`: token * k + slot), as
    /// one batch; its outputs reach `deliver` (tagged `u`) when the runner finishes the layer's
    /// experts. The runner's cache knows the record as (layer, e). Shapes: xl `[T, LAT]`; xb
    /// `[n, LAT]` scratch, grown where a pinned routing repeats an expert past `T` users.
    #[allow(clippy::too_many_arguments)]
    fn expert_to_gpu(
        &self,
        g: &ExpertRunner,
        record: &[u8],
        e: usize,
        u: usize,
        users: &[usize],
        k: usize,
        xl: &[f32],
        xb: &mut Vec<f32>,
        deliver: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        let layout = &self.layout;
        anyhow::ensure!(record.len() >= layout.record_bytes, "expert record is too short");
        let lat = self.latent;
        let m = |p: usize| (layout.part(record, p), layout.part(record, p + 1));
        let n = users.len();
        let x = if let [ts] = users {
            let t = ts / k;
            &xl[t * lat..(t + 1) * lat]
        } else {
            if xb.len() < n * lat {
                xb.resize(n * lat, 0.0);
            }
            Self::gather_rows(users, k, lat, xl, &mut xb[..n * lat]);
            &xb[..n * lat]
        };
        g.enqueue(Some((self.layer, e)), m(0), m(4), m(2), x, n, u, deliver)?;
        Ok(())
    }

    /// Each union expert's users (token * k + slot, tokens in order, then slots), as one list
    /// cut by `start`: expert `union[u]`'s are `list[start[u]..start[u + 1]]`, and their outputs
    /// rows `start[u]..start[u + 1]` of the chunk's expert outputs (`row` maps a (token, slot)
    /// to its row). Built once per chunk (two passes over the routings) instead of a pass per
    /// expert. `pos` and `cursor` are scratch.
    fn index_users(routings: &[Routing], union: &[usize], k: usize, ix: &mut UserIndex) {
        let UserIndex { pos, cursor, start, list, row } = ix;
        pos.clear();
        pos.resize(union.iter().max().map_or(0, |&m| m + 1), usize::MAX);
        for (u, &e) in union.iter().enumerate() {
            pos[e] = u;
        }
        start.clear();
        start.resize(union.len() + 1, 0);
        for r in routings {
            for &e in &r.experts {
                start[pos[e] + 1] += 1;
            }
        }
        for u in 0..union.len() {
            start[u + 1] += start[u];
        }
        cursor.clear();
        cursor.extend_from_slice(&start[..union.len()]);
        list.clear();
        list.resize(start[union.len()], 0);
        row.clear();
        row.resize(routings.len() * k, usize::MAX);
        for (t, r) in routings.iter().enumerate() {
            for (s, &e) in r.experts.iter().enumerate() {
                let u = pos[e];
                list[cursor[u]] = t * k + s;
                row[t * k + s] = cursor[u];
                cursor[u] += 1;
            }
        }
    }

    /// The inputs of an expert's users, one row each (`users`: token * k + slot), on the thread
    /// pool when they are large. Shapes: xl `[T, LAT]`, xb `[n, LAT]`.
    fn gather_rows(users: &[usize], k: usize, lat: usize, xl: &[f32], xb: &mut [f32]) {
        let put = |(d, &ts): (&mut [f32], &usize)| d.copy_from_slice(&xl[(ts / k) * lat..(ts / k + 1) * lat]);
        if xb.len() >= PARALLEL_COPY_VALUES {
            xb.par_chunks_mut(lat).zip(users.par_iter()).for_each(put);
        } else {
            xb.chunks_mut(lat).zip(users.iter()).for_each(put);
        }
    }

    /// Put an expert's outputs (`[n, LAT]`, one row per user) into their rows of the chunk's
    /// outputs (`first` onwards: contiguous), on the thread pool when they are large.
    fn put_rows(first: usize, lat: usize, out: &[f32], eo: &mut [f32]) {
        let dst = &mut eo[first * lat..first * lat + out.len()];
        if out.len() >= PARALLEL_COPY_VALUES {
            dst.par_chunks_mut(COPY_SHARE).zip(out.par_chunks(COPY_SHARE)).for_each(|(d, s)| d.copy_from_slice(s));
        } else {
            dst.copy_from_slice(out);
        }
    }

    /// The routed sum of one token, normed (the input of the projection back). Shapes: eo
    /// `[rows, LAT]`, the token's slots at rows `rows` (routing order), acc `[LAT]`.
    fn routed_sum(&self, weights: &[f32], eo: &[f32], rows: &[usize], acc: &mut [f32]) {
        let lat = self.latent;
        acc.fill(0.0);
        for (&w, &r) in weights.iter().zip(rows) {
            for (s, &v) in acc.iter_mut().zip(&eo[r * lat..(r + 1) * lat]) {
                *s += w * v;
            }
        }
        if let Some(n) = &self.norm {
            rms_norm_inplace(acc, n, self.eps);
        }
    }

    /// A chunk of one or more tokens through this layer. Shapes: xs and outs `[T, hidden]`
    /// (xs already normed); routings `[T]`.
    ///
    /// Each token is routed as if alone, and the union of the chunk's experts is requested at
    /// once as soon as the router has picked them, so each distinct expert is read once per
    /// chunk and applied to every token that chose it (as one small batch when several did).
    /// With `run.next`, the next MoE layer's router then runs on the last token (its prediction
    /// is recorded, and hinted to the source for prefetch at once when `run.hint` is set), and the
    /// shared experts run while the reads are in flight. Each expert is computed when its record arrives, into
    /// its own slot, and the slots are summed in routing order, so per token the result depends
    /// neither on arrival order nor on the chunk.
    pub fn forward(
        &self,
        xs: &[f32],
        experts: &mut dyn ExpertSource,
        run: MoeRun<'_>,
        routings: &mut [Routing],
        outs: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let h = self.gate.cols;
        let t_n = routings.len();
        let (i, lat) = (self.inter, self.latent);
        let e_n = self.gate.rows;
        let mut logits = sc.take(t_n * e_n); // [T, E] router logits
        {
            // The router's scores stay exact in approximate mode: which experts a token takes
            // is not approximated.
            let _exact = crate::chunk_spine::exact_here();
            self.gate.forward_batch(xs, t_n, &mut logits);
        }
        let mut union = sc.take_ids(); // distinct experts of the chunk, first-use order
        if t_n >= PARALLEL_ROUTING_TOKENS {
            // A long chunk's tokens routed on the thread pool (each token's choice is the one
            // serial routing makes), then the union in token order.
            routings
                .par_chunks_mut(ROUTING_SHARE)
                .zip(logits[..t_n * e_n].par_chunks(ROUTING_SHARE * e_n))
                .try_for_each(|(rs, lg)| -> Result<()> {
                    let mut local = Scratch::default();
                    for (r, l) in rs.iter_mut().zip(lg.chunks_exact(e_n)) {
                        self.route(l, r, &mut local)?;
                        r.predicted_next.clear();
                    }
                    Ok(())
                })?;
            let mut seen = sc.take(e_n); // [E] 1 where the union has the expert
            seen.fill(0.0);
            for r in routings.iter() {
                for &e in &r.experts {
                    anyhow::ensure!(e < e_n, "expert id out of range");
                    if seen[e] == 0.0 {
                        seen[e] = 1.0;
                        union.push(e);
                    }
                }
            }
            sc.give(seen);
        } else {
            for (t, r) in routings.iter_mut().enumerate() {
                self.route(&logits[t * e_n..(t + 1) * e_n], r, sc)?;
                r.predicted_next.clear();
                for &e in &r.experts {
                    anyhow::ensure!(e < self.gate.rows, "expert id out of range");
                    if !union.contains(&e) {
                        union.push(e);
                    }
                }
            }
        }
        experts.begin(self.layer, &union)?;

        // The look-ahead hint goes out as soon as this layer's own reads have: its reads then
        // overlap the shared experts and every expert compute of this layer.
        if let (Some(n), Some(r)) = (run.next, routings.last_mut()) {
            if r.pinned && !r.pinned_next.is_empty() {
                r.predicted_next.clone_from(&r.pinned_next);
            } else {
                n.predict(&xs[(t_n - 1) * h..], &mut r.predicted_next, sc);
            }
            if run.hint {
                experts.prefetch(n.layer, &r.predicted_next)?;
            }
        }
        let mut shared = sc.take(t_n * h); // [T, hidden]
        if let Some(sh) = &self.shared {
            sh.forward_batch(xs, t_n, &mut shared, sc);
        }

        let mut xl = sc.take(t_n * lat); // [T, LAT] each token's latent expert input
        let mut xqs = std::mem::take(&mut sc.xqs); // [T] xl quantised (approximate mode)
        xqs.resize_with(t_n.max(xqs.len()), QuantizedX::default);
        match &self.down {
            Some(d) => d.forward_batch(xs, t_n, &mut xl),
            None => xl.copy_from_slice(&xs[..t_n * h]),
        }
        // Approximate mode's integer experts: the chunk runs its spine in integers and the
        // CPU has the kernels for the expert's widths.
        let integer = run.approx
            && crate::chunk_spine::integer()
            && deltafin_kernels::approx::has_integer_spine()
            && QuantizedRows::seg_for(lat).is_some()
            && QuantizedRows::seg_for(i).is_some();
        if run.approx && !integer {
            for t in 0..t_n {
                xqs[t].quantize(&xl[t * lat..(t + 1) * lat]);
            }
        }
        let k = self.top_k.max(routings.iter().map(|r| r.experts.len()).max().unwrap_or(0));
        // [T * k, LAT] each (token, slot)'s expert output, grouped by expert (rows of
        // `ix.row`): an expert's users' outputs are contiguous, written in one piece.
        let mut eo = sc.take(t_n * k * lat);
        let mut a = sc.take(i); // [I] SiTU activations of the expert being computed
        let mut gu = sc.take(if run.approx { i } else { 0 }); // [I] gate products (approximate mode)
        let mut aq = std::mem::take(&mut sc.aq);
        let mut done = sc.take_ids(); // [union] 1 once an expert's record has been computed
        done.resize(union.len(), 0);
        // token * k + slot of each token that chose each expert, and their outputs' rows
        let mut ix = UserIndex {
            pos: sc.take_ids(),
            cursor: sc.take_ids(),
            start: sc.take_ids(),
            list: sc.take_ids(),
            row: sc.take_ids(),
        };
        Self::index_users(routings, &union, k, &mut ix);
        // An expert used by several tokens of the chunk runs them as one small batch.
        let batch = if t_n > 1 { t_n } else { 0 }; // rows of a batch (a pinned routing may repeat an expert)
        let mut xb = sc.take(batch * lat); // [n, LAT] inputs of one expert's tokens
        let mut ab = sc.take(batch * i); // [n, I]
        if let Some(g) = run.gpu {
            // Whatever an interrupted layer left in flight (a panic mid-layer) is not this one's.
            g.finish(&mut |_, _| {})?;
        }
        let drained = experts.drain(&mut |u, record| {
            let e = union[u];
            let users = ix.users(u);
            if let Some(g) = run.gpu {
                // Submitted now, delivered (and marked done) when the GPU finishes the layer.
                let mut deliver = |u: usize, out: &[f32]| {
                    Self::put_rows(ix.start[u], lat, out, &mut eo);
                    done[u] = 1;
                };
                self.expert_to_gpu(g, record, e, u, users, k, &xl, &mut xb, &mut deliver)?;
                return Ok(());
            } else if integer && users.len() <= batch {
                // A chunk in approximate mode: every expert in integers, one user or many, so a
                // token's result does not depend on who else chose the expert.
                let n = users.len();
                Self::gather_rows(users, k, lat, &xl, &mut xb[..n * lat]);
                let rows = &mut eo[ix.start[u] * lat..(ix.start[u] + n) * lat];
                anyhow::ensure!(
                    self.expert_batch_q8_into(record, &xb[..n * lat], n, &mut ab[..n * i], rows)?,
                    "the integer expert kernel declined a product it was chosen for"
                );
            } else if run.approx || users.len() == 1 || users.len() > batch {
                for (j, &ts) in users.iter().enumerate() {
                    let t = ts / k;
                    let row = ix.start[u] + j;
                    let out = &mut eo[row * lat..(row + 1) * lat];
                    let x = &xl[t * lat..(t + 1) * lat];
                    self.expert_into(record, x, &xqs[t], run.approx, &mut a, &mut gu, &mut aq, out)?;
                }
            } else {
                let n = users.len();
                Self::gather_rows(users, k, lat, &xl, &mut xb[..n * lat]);
                let rows = &mut eo[ix.start[u] * lat..(ix.start[u] + n) * lat];
                self.expert_batch_into(record, &xb[..n * lat], n, &mut ab[..n * i], rows)?;
            }
            done[u] = 1;
            Ok(())
        });
        if let Some(g) = run.gpu {
            // Also after a failed drain: the runner is left with nothing in flight.
            let mut deliver = |u: usize, out: &[f32]| {
                Self::put_rows(ix.start[u], lat, out, &mut eo);
                done[u] = 1;
            };
            let finished = g.finish(&mut deliver);
            drained?;
            finished?;
        } else {
            drained?;
        }
        anyhow::ensure!(
            done.iter().all(|&d| d == 1),
            "expert source did not deliver every expert of layer {}",
            self.layer
        );
        let mut acc = sc.take(t_n * lat); // [T, LAT] each token's weighted, normed expert sum
        let sum_token = |(t, (r, a)): (usize, (&Routing, &mut [f32]))| {
            self.routed_sum(&r.weights, &eo, &ix.row[t * k..t * k + r.experts.len()], a);
        };
        if t_n >= PARALLEL_ROUTING_TOKENS {
            routings.par_iter().zip(acc.par_chunks_mut(lat)).enumerate().for_each(sum_token);
        } else {
            routings.iter().zip(acc.chunks_mut(lat)).enumerate().for_each(sum_token);
        }
        match &self.up {
            Some(up) => up.forward_batch(&acc, t_n, &mut outs[..t_n * h]),
            None => outs[..t_n * h].copy_from_slice(&acc),
        }
        if self.shared.is_some() {
            let add = |(o, v): (&mut [f32], &[f32])| o.iter_mut().zip(v).for_each(|(o, v)| *o += v);
            if t_n >= PARALLEL_ROUTING_TOKENS {
                outs[..t_n * h].par_chunks_mut(h).zip(shared.par_chunks(h)).for_each(add);
            } else {
                outs[..t_n * h].chunks_mut(h).zip(shared.chunks(h)).for_each(add);
            }
        }
        for buf in [logits, shared, xl, eo, a, gu, acc, xb, ab] {
            sc.give(buf);
        }
        (sc.xqs, sc.aq) = (xqs, aq);
        for ids in [union, done, ix.pos, ix.cursor, ix.start, ix.list, ix.row] {
            sc.give_ids(ids);
        }
        Ok(())
    }

    /// The experts this layer's router would pick for `x` (used on an earlier layer's hidden
    /// state to predict this layer's picks for prefetch). Shape: x `[hidden]`.
    pub fn predict(&self, x: &[f32], ids: &mut Vec<usize>, sc: &mut Scratch) {
        let mut logits = sc.take(self.gate.rows); // [E]
        self.gate.forward(x, &mut logits);
        let mut w = sc.take(0);
        select_experts(&logits, &self.bias, self.top_k, self.renormalize, self.scaling, ids, &mut w, sc);
        sc.give(w);
        sc.give(logits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows gathered and put on the thread pool (above the size where that starts) and below it
    /// land where a plain loop puts them.
    #[test]
    fn rows_go_where_a_loop_puts_them() {
        let (lat, k, t_n) = (1024usize, 3usize, 700usize);
        let xl: Vec<f32> = (0..t_n * lat).map(|i| i as f32).collect();
        for n in [5usize, 1100] {
            // Users: every token's slot (j % k), some tokens twice, in a scrambled order.
            let users: Vec<usize> = (0..n).map(|j| ((j * 37) % t_n) * k + j % k).collect();
            let mut xb = vec![0f32; n * lat];
            LatentMoe::gather_rows(&users, k, lat, &xl, &mut xb);
            for (j, &ts) in users.iter().enumerate() {
                assert_eq!(xb[j * lat..(j + 1) * lat], xl[(ts / k) * lat..(ts / k + 1) * lat], "n {n}: row {j}");
            }
            assert_eq!(n * lat >= PARALLEL_COPY_VALUES, n == 1100, "both sides of the threshold");
            let first = 7;
            let mut eo = vec![-1f32; (first + n + 3) * lat];
            LatentMoe::put_rows(first, lat, &xb, &mut eo);
            assert!(eo[..first * lat].iter().chain(&eo[(first + n) * lat..]).all(|&v| v == -1.0), "n {n}: outside");
            assert_eq!(eo[first * lat..(first + n) * lat], xb[..], "n {n}: the rows");
        }
    }

    /// The index gives each expert its users in token order, then slot order (a pinned routing
    /// may name an expert twice), and each (token, slot) the row its output takes.
    #[test]
    fn users_are_indexed_in_token_order() {
        let r = |experts: &[usize]| Routing { experts: experts.to_vec(), ..Default::default() };
        let routings = [r(&[4, 9]), r(&[9, 2]), r(&[4, 4])];
        let union = [4, 9, 2];
        let mut ix = UserIndex::default();
        LatentMoe::index_users(&routings, &union, 2, &mut ix);
        assert_eq!(ix.users(0), &[0, 4, 5]);
        assert_eq!(ix.users(1), &[1, 2]);
        assert_eq!(ix.users(2), &[3]);
        for u in 0..3 {
            for (j, &ts) in ix.users(u).iter().enumerate() {
                assert_eq!(ix.row[ts], ix.start[u] + j);
            }
        }
    }
}
