//! The one token path: a chunk of one or more tokens goes through the model layer by layer, so
//! each layer's spine is fetched once and each distinct expert is read once for the whole chunk.
//! Decode is a chunk of one. Within a chunk every spine matrix is applied to all of the chunk's
//! tokens at once (`Linear::forward_batch`: read from memory once per share of tokens, not once
//! per token); only the attention recurrence and the residual bookkeeping go token by token.
//! Per token the arithmetic does not depend on the chunk it rides in: logits and state are
//! bit-identical however a prompt is cut.

use anyhow::Result;
use deltafin_kernels::ops::rms_norm;
use rayon::prelude::*;

use super::state::{K3State, LayerState};
use super::{Attention, Ffn, K3Model, Layer};
use crate::blocks::attn_res::ResidualBlocks;
use crate::blocks::moe::{MoeRun, Routing};
use crate::experts::ExpertSource;
use crate::scratch::Scratch;

/// One sequence's share of a batched step ([`K3Model::forward_batch`]): its state, the tokens
/// it feeds (one to decode, several for a prompt chunk), and where its next-token logits go.
/// Shapes: logits `[vocab]`.
pub struct SeqStep<'a> {
    pub state: &'a mut K3State,
    pub tokens: &'a [u32],
    pub logits: &'a mut [f32],
}

/// What a batched step reuses from step to step, shared by the step's sequences: scratch, and
/// each step token's residual blocks and routing `[T]` (only the first T are live).
#[derive(Default)]
pub struct BatchBuffers {
    pub scratch: Scratch,
    pub blocks: Vec<ResidualBlocks>,
    pub routing: Vec<Routing>,
    /// The MoE layer (the store's numbering, as in [`crate::fault::ReadFault::layer`]) whose
    /// routing `routing` holds: set before that layer's experts are read, so that after a read
    /// fault the tokens that chose the failed expert are known.
    pub routed_layer: Option<usize>,
}

impl crate::generate::ChunkBuffers for BatchBuffers {
    /// Free a large step's activations (its scratch and residual blocks), so that memory
    /// borrowed from the expert cache for a long prompt's chunk can go back to it. The routing
    /// stays: it is small, and a failed step's read fault is blamed from it.
    fn release(&mut self) {
        self.scratch.release();
        self.blocks = Vec::new();
    }
}

/// A chunk reads ahead when its tokens' picks number at least this many times the layer's
/// experts: under uniform routing each expert is then missed with probability below e^-4 (2%).
const READ_AHEAD_COVERAGE: usize = 4;

impl K3Model {
    /// Run one token through the model, advancing `st`; writes the next-token logits.
    /// Shapes: logits `[vocab]`.
    pub fn forward(
        &self,
        st: &mut K3State,
        experts: &mut dyn ExpertSource,
        token: u32,
        logits: &mut [f32],
    ) -> Result<()> {
        self.forward_chunk(st, experts, &[token], logits)
    }

    /// Run `tokens` (one or more) through the model layer by layer, advancing `st`; writes the
    /// last token's next-token logits. Shapes: logits `[vocab]`.
    pub fn forward_chunk(
        &self,
        st: &mut K3State,
        experts: &mut dyn ExpertSource,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<()> {
        self.forward_chunk_with(st, experts, tokens, logits, &mut |_| true)?;
        Ok(())
    }

    /// [`Self::forward_chunk`], calling `on_layer(l)` after each layer (prompt progress and
    /// cancellation): when it returns false before the last layer, the chunk stops there and
    /// this returns `Ok(false)`; `st` is then part-way through the chunk, as after an error, and
    /// is refused from then on (`K3State::is_part_way`).
    pub fn forward_chunk_with(
        &self,
        st: &mut K3State,
        experts: &mut dyn ExpertSource,
        tokens: &[u32],
        logits: &mut [f32],
        on_layer: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool> {
        // One sequence is a batch of one, run on the sequence's own buffers (moved, not copied:
        // a decode step still allocates nothing).
        let mut bufs = BatchBuffers {
            scratch: std::mem::take(&mut st.scratch),
            blocks: std::mem::take(&mut st.blocks),
            routing: std::mem::take(&mut st.chunk_routing),
            routed_layer: None,
        };
        let mut one = [SeqStep { state: &mut *st, tokens, logits }];
        let r = self.forward_batch_with(&mut one, experts, &mut bufs, on_layer);
        (st.scratch, st.blocks, st.chunk_routing) = (bufs.scratch, bufs.blocks, bufs.routing);
        r
    }

    /// One step for several sequences at once (continuous batching): each `seqs[i]` feeds its
    /// own tokens (one for a decode step, several for a prompt chunk) into its own state, and
    /// gets the logits after its last token. The step goes through the model once: each spine
    /// layer is fetched once, every spine matrix, router and shared expert is applied to all of
    /// the step's tokens together, the union of every token's experts is read once and each
    /// expert applied to every token that chose it, and the head runs once over the sequences'
    /// last tokens. Only attention goes sequence by sequence, each over its own state. Per
    /// sequence the arithmetic is that of the same tokens alone (`forward_chunk`), bit for bit.
    /// A failure fails the step for every sequence in it (their states are left part-way).
    pub fn forward_batch(
        &self,
        seqs: &mut [SeqStep<'_>],
        experts: &mut dyn ExpertSource,
        bufs: &mut BatchBuffers,
    ) -> Result<()> {
        self.forward_batch_with(seqs, experts, bufs, &mut |_| true)?;
        Ok(())
    }

    /// [`Self::forward_batch`] with `on_layer` as in [`Self::forward_chunk_with`].
    pub fn forward_batch_with(
        &self,
        seqs: &mut [SeqStep<'_>],
        experts: &mut dyn ExpertSource,
        bufs: &mut BatchBuffers,
        on_layer: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool> {
        let c = &self.config;
        let h = c.hidden_size;
        anyhow::ensure!(!seqs.is_empty(), "empty batch");
        for s in seqs.iter() {
            anyhow::ensure!(!s.tokens.is_empty(), "empty chunk");
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                anyhow::bail!("token id {t} is outside the vocabulary (size {})", c.vocab_size);
            }
            anyhow::ensure!(
                s.logits.len() == c.vocab_size,
                "logits buffer of {} for a vocabulary of {}",
                s.logits.len(),
                c.vocab_size
            );
            anyhow::ensure!(
                !s.state.part_way,
                "this sequence's state was left part-way through a chunk (a failed or stopped step): it cannot be continued"
            );
        }
        for s in seqs.iter_mut() {
            s.state.part_way = true;
        }
        // Sequence i's tokens are rows starts[i]..starts[i + 1] of every [T, ..] buffer.
        let t_n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        // A prompt chunk of one sequence sends its spine products to the GPU, or with --approx
        // runs its int8 ones in integers; a batch of sequences keeps the exact CPU products, so
        // that each sequence's arithmetic does not depend on what it is batched with.
        let one = seqs.len() == 1;
        let integer = one && self.run.approx && t_n >= crate::chunk_spine::INTEGER_MIN_TOKENS;
        let _chunk = crate::chunk_spine::Scope::enter(self.run.gpu_spine.clone().filter(|_| one), integer);
        let BatchBuffers { scratch: sc, blocks, routing: chunk_routing, routed_layer } = bufs;
        *routed_layer = None;
        while blocks.len() < t_n {
            blocks.push(ResidualBlocks::new(c.rms_norm_eps));
        }
        let blocks = &mut blocks[..t_n];
        blocks.iter_mut().for_each(ResidualBlocks::clear);
        chunk_routing.resize_with(t_n.max(chunk_routing.len()), Default::default);
        let chunk_routing = &mut chunk_routing[..t_n];
        let mut xs = sc.take(t_n * h); // [T, H] the running partial sums entering each layer
        for (t, &tok) in seqs.iter().flat_map(|s| s.tokens).enumerate() {
            self.embed.row(tok as usize, &mut xs[t * h..(t + 1) * h]);
        }
        let mut normed = sc.take(t_n * h); // [T, H] each sub-layer's normed input
        let mut ys = sc.take(t_n * h); // [T, H] FFN outputs
        let mut hmix = sc.take(h); // [H] input of a sub-layer after residual mixing
        let gpu_busy = || self.run.gpu_spine.as_ref().map_or(0.0, |g| g.busy_seconds());
        for l in 0..self.layers.len() {
            let layer = self.layer(l)?;
            // Attention: each token's input mixed and normed, each sequence's attention over its
            // own state (its projections batched, its recurrence token by token), then each
            // token's running sum and the FFN's normed input.
            if let Ffn::Moe(m) = &layer.ffn
                && t_n * c.num_experts_per_token >= READ_AHEAD_COVERAGE * c.num_experts
            {
                // A chunk this large picks nearly every expert of the layer: the drive reads
                // into the cache's free room while attention computes, instead of idling until
                // the router has chosen.
                experts.read_ahead(m.layer);
            }
            let restart = self.block_restart(&layer, l);
            if t_n >= PARALLEL_TOKENS {
                // A long chunk's tokens on the thread pool, each share with its own mixing buffer.
                let items = blocks.par_chunks_mut(TOKEN_SHARE).zip(xs.par_chunks(TOKEN_SHARE * h));
                items.zip(normed.par_chunks_mut(TOKEN_SHARE * h)).for_each(|((bs, xc), nc)| {
                    let mut mix = vec![0f32; h]; // [H]
                    for ((b, x), nm) in bs.iter_mut().zip(xc.chunks_exact(h)).zip(nc.chunks_exact_mut(h)) {
                        self.pre_attention(&layer, b, restart, x, &mut mix, nm);
                    }
                });
            } else {
                for t in 0..t_n {
                    let (x, nm) = (&xs[t * h..(t + 1) * h], &mut normed[t * h..(t + 1) * h]);
                    self.pre_attention(&layer, &mut blocks[t], restart, x, &mut hmix, nm);
                }
            }
            let attention_start = std::time::Instant::now();
            let gpu_start = gpu_busy();
            let mut t0 = 0;
            for s in seqs.iter_mut() {
                let n = s.tokens.len();
                let (x, y) = (&normed[t0 * h..(t0 + n) * h], &mut ys[t0 * h..(t0 + n) * h]);
                match (&layer.attn, &mut s.state.layers[l]) {
                    (Attention::Kda(k), LayerState::Kda(st)) => k.forward_chunk(st, x, n, y, sc),
                    (Attention::Mla(m), LayerState::Mla(st)) => m.forward_chunk(st, x, n, y, sc),
                    _ => anyhow::bail!("layer {l}: state does not match the attention kind"),
                }
                t0 += n;
            }
            let attention = attention_start.elapsed();
            let attention_gpu = gpu_busy() - gpu_start;
            if t_n >= PARALLEL_TOKENS {
                let items = blocks.par_chunks_mut(TOKEN_SHARE).zip(xs.par_chunks_mut(TOKEN_SHARE * h));
                let items = items.zip(ys.par_chunks(TOKEN_SHARE * h)).zip(normed.par_chunks_mut(TOKEN_SHARE * h));
                items.for_each(|(((bs, xc), yc), nc)| {
                    let mut mix = vec![0f32; h]; // [H]
                    let tokens = bs.iter_mut().zip(xc.chunks_exact_mut(h)).zip(yc.chunks_exact(h));
                    for (((b, x), y), nm) in tokens.zip(nc.chunks_exact_mut(h)) {
                        self.post_attention(&layer, b, restart, x, y, &mut mix, nm);
                    }
                });
            } else {
                for t in 0..t_n {
                    let (x, nm) = (&mut xs[t * h..(t + 1) * h], &mut normed[t * h..(t + 1) * h]);
                    self.post_attention(&layer, &mut blocks[t], restart, x, &ys[t * h..(t + 1) * h], &mut hmix, nm);
                }
            }
            let ffn_start = std::time::Instant::now();
            match &layer.ffn {
                Ffn::Dense(m) => m.forward_batch(&normed, t_n, &mut ys, sc),
                Ffn::Moe(m) => {
                    // A pinned routing (a study's override, set before a token) applies to each
                    // sequence's first token of the step; a state keeps its last token's routing.
                    let mut t0 = 0;
                    for s in seqs.iter() {
                        chunk_routing[t0].copy_from(&s.state.routing[l]);
                        chunk_routing[t0 + 1..t0 + s.tokens.len()].iter_mut().for_each(|r| {
                            r.pinned = false;
                            r.pinned_next.clear();
                        });
                        t0 += s.tokens.len();
                    }
                    // Look-ahead predicts one token's next picks; a step's union is requested
                    // whole at its layer.
                    let next = if t_n == 1 { self.next_moe(l) } else { None };
                    let run = MoeRun {
                        next,
                        hint: self.run.prefetch,
                        approx: self.run.approx,
                        gpu: self.run.gpu_experts.as_deref(),
                    };
                    *routed_layer = Some(m.layer);
                    m.forward(&normed, experts, run, chunk_routing, &mut ys, sc)?;
                    let mut t0 = 0;
                    for s in seqs.iter_mut() {
                        t0 += s.tokens.len();
                        s.state.routing[l].copy_from(&chunk_routing[t0 - 1]);
                    }
                }
            }
            self.phases.add(attention, matches!(layer.attn, Attention::Mla(_)), attention_gpu, ffn_start.elapsed());
            if t_n >= PARALLEL_TOKENS {
                xs.par_chunks_mut(h)
                    .zip(ys.par_chunks(h))
                    .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
            } else {
                xs.iter_mut().zip(ys.iter()).for_each(|(a, b)| *a += b);
            }
            if !on_layer(l) && l + 1 < self.layers.len() {
                // Stopped between layers: no read is open, the buffers go back.
                for buf in [xs, normed, ys, hmix] {
                    sc.give(buf);
                }
                return Ok(false);
            }
        }
        // The head, once for the step: each sequence's last token, mixed and normed, as a row.
        let n_seq = seqs.len();
        let mut last = sc.take(n_seq * h); // [N, H] each sequence's normed last hidden state
        let mut t0 = 0;
        for (i, s) in seqs.iter().enumerate() {
            t0 += s.tokens.len();
            let x = &xs[(t0 - 1) * h..t0 * h];
            if let Some(w) = &self.output_res_w {
                blocks[t0 - 1].mix(x, w, &mut hmix);
            } else {
                hmix.copy_from_slice(x);
            }
            rms_norm(&hmix, &self.norm, c.rms_norm_eps, &mut last[i * h..(i + 1) * h]);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if let [s] = seqs {
            head.forward(&last, s.logits);
        } else {
            let v = c.vocab_size;
            let mut out = sc.take(n_seq * v); // [N, vocab]
            head.forward_batch(&last, n_seq, &mut out);
            for (s, row) in seqs.iter_mut().zip(out.chunks_exact(v)) {
                s.logits.copy_from_slice(row);
            }
            sc.give(out);
        }
        for buf in [xs, normed, ys, hmix, last] {
            sc.give(buf);
        }
        for s in seqs.iter_mut() {
            s.state.position += s.tokens.len();
            s.state.part_way = false;
        }
        Ok(true)
    }

    /// Whether layer `l` starts an attention-residual block: the running sum is stored as a
    /// block and restarts from the attention output.
    fn block_restart(&self, layer: &Layer, l: usize) -> bool {
        layer.res_w.is_some() && self.config.attn_res_block_size.is_some_and(|b| l.is_multiple_of(b))
    }

    /// One token's attention input: the plain residual or the block mix, normed (into
    /// `normed`); at a block start the running sum is stored as a block.
    /// Shapes: x, hmix, normed `[hidden]`.
    fn pre_attention(
        &self,
        layer: &Layer,
        blocks: &mut ResidualBlocks,
        restart: bool,
        x: &[f32],
        hmix: &mut [f32],
        normed: &mut [f32],
    ) {
        match &layer.res_w {
            Some((w_attn, _)) => {
                blocks.mix(x, w_attn, hmix);
                if restart {
                    blocks.push(x);
                }
            }
            None => hmix.copy_from_slice(x),
        }
        rms_norm(hmix, &layer.input_norm, self.config.rms_norm_eps, normed);
    }

    /// One token after attention: the running sum (restarted from the attention output at a
    /// block start), then the FFN's normed input (into `normed`).
    /// Shapes: x, y, hmix, normed `[hidden]`.
    #[allow(clippy::too_many_arguments)]
    fn post_attention(
        &self,
        layer: &Layer,
        blocks: &mut ResidualBlocks,
        restart: bool,
        x: &mut [f32],
        y: &[f32],
        hmix: &mut [f32],
        normed: &mut [f32],
    ) {
        if restart {
            x.copy_from_slice(y);
        } else {
            x.iter_mut().zip(y.iter()).for_each(|(a, b)| *a += b);
        }
        match &layer.res_w {
            Some((_, w_mlp)) => blocks.mix(x, w_mlp, hmix),
            None => hmix.copy_from_slice(x),
        }
        rms_norm(hmix, &layer.post_norm, self.config.rms_norm_eps, normed);
    }
}

/// A chunk of at least this many tokens mixes and norms its tokens' residual streams on the
/// thread pool, [`TOKEN_SHARE`] tokens per work item (K3's attention residuals take a dot
/// product and an update of the hidden size per block of earlier layers, per token and
/// sub-layer); decode steps and short chunks stay on the calling thread and allocate nothing.
const PARALLEL_TOKENS: usize = 64;
const TOKEN_SHARE: usize = 16;
