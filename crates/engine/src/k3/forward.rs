//! The one token path: a chunk of one or more tokens goes through the model layer by layer, so
//! each layer's spine is fetched once and each distinct expert is read once for the whole chunk.
//! Decode is a chunk of one. Within a chunk every spine matrix is applied to all of the chunk's
//! tokens at once (`Linear::forward_batch`: read from memory once per share of tokens, not once
//! per token); only the attention recurrence and the residual bookkeeping go token by token.
//! Per token the arithmetic does not depend on the chunk it rides in: logits and state are
//! bit-identical however a prompt is cut.

use anyhow::Result;
use deltafin_kernels::ops::rms_norm;

use super::state::{K3State, LayerState};
use super::{Attention, Ffn, K3Model, Layer};
use crate::blocks::attn_res::ResidualBlocks;
use crate::blocks::moe::MoeRun;
use crate::experts::ExpertSource;

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
        let c = &self.config;
        let h = c.hidden_size;
        let t_n = tokens.len();
        anyhow::ensure!(t_n > 0, "empty chunk");
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            anyhow::bail!("token id {t} is outside the vocabulary (size {})", c.vocab_size);
        }
        anyhow::ensure!(
            !st.part_way,
            "this sequence's state was left part-way through a chunk (a failed or stopped step): it cannot be continued"
        );
        st.part_way = true;
        let K3State { layers: states, routing, scratch: sc, blocks, chunk_routing, .. } = st;
        while blocks.len() < t_n {
            blocks.push(ResidualBlocks::new(c.rms_norm_eps));
        }
        let blocks = &mut blocks[..t_n];
        blocks.iter_mut().for_each(ResidualBlocks::clear);
        chunk_routing.resize_with(t_n.max(chunk_routing.len()), Default::default);
        let chunk_routing = &mut chunk_routing[..t_n];
        let mut xs = sc.take(t_n * h); // [T, H] the running partial sums entering each layer
        for (t, &tok) in tokens.iter().enumerate() {
            self.embed.row(tok as usize, &mut xs[t * h..(t + 1) * h]);
        }
        let mut normed = sc.take(t_n * h); // [T, H] each sub-layer's normed input
        let mut ys = sc.take(t_n * h); // [T, H] FFN outputs
        let mut hmix = sc.take(h); // [H] input of a sub-layer after residual mixing
        let mut y = sc.take(h); // [H] attention output
        for l in 0..self.layers.len() {
            let layer = self.layer(l)?;
            // Attention: each token's input mixed and normed, the chunk's attention (its
            // projections batched, its recurrence token by token), then each token's running
            // sum and the FFN's normed input.
            if let Ffn::Moe(m) = &layer.ffn
                && t_n * c.num_experts_per_token >= READ_AHEAD_COVERAGE * c.num_experts
            {
                // A chunk this large picks nearly every expert of the layer: the drive reads
                // into the cache's free room while attention computes, instead of idling until
                // the router has chosen.
                experts.read_ahead(m.layer);
            }
            let restart = self.block_restart(&layer, l);
            for t in 0..t_n {
                let (x, nm) = (&xs[t * h..(t + 1) * h], &mut normed[t * h..(t + 1) * h]);
                self.pre_attention(&layer, &mut blocks[t], restart, x, &mut hmix, nm);
            }
            match (&layer.attn, &mut states[l]) {
                (Attention::Kda(k), LayerState::Kda(s)) => k.forward_chunk(s, &normed, t_n, &mut ys, sc),
                (Attention::Mla(m), LayerState::Mla(s)) => m.forward_chunk(s, &normed, t_n, &mut ys, sc),
                _ => anyhow::bail!("layer {l}: state does not match the attention kind"),
            }
            for t in 0..t_n {
                let (x, nm) = (&mut xs[t * h..(t + 1) * h], &mut normed[t * h..(t + 1) * h]);
                self.post_attention(&layer, &mut blocks[t], restart, x, &ys[t * h..(t + 1) * h], &mut hmix, nm);
            }
            match &layer.ffn {
                Ffn::Dense(m) => m.forward_batch(&normed, t_n, &mut ys, sc),
                Ffn::Moe(m) => {
                    // A pinned routing (a study's override, set before a token) applies to the
                    // chunk's first token; the state keeps the last token's routing.
                    chunk_routing[0].copy_from(&routing[l]);
                    chunk_routing[1..].iter_mut().for_each(|r| {
                        r.pinned = false;
                        r.pinned_next.clear();
                    });
                    // Look-ahead predicts one token's next picks; a chunk's union is requested
                    // whole at its layer.
                    let next = if t_n == 1 { self.next_moe(l) } else { None };
                    let run = MoeRun { next, hint: self.run.prefetch, approx: self.run.approx };
                    m.forward(&normed, experts, run, chunk_routing, &mut ys, sc)?;
                    routing[l].copy_from(&chunk_routing[t_n - 1]);
                }
            }
            xs.iter_mut().zip(ys.iter()).for_each(|(a, b)| *a += b);
            if !on_layer(l) && l + 1 < self.layers.len() {
                // Stopped between layers: no read is open, the buffers go back.
                for buf in [xs, normed, ys, hmix, y] {
                    sc.give(buf);
                }
                return Ok(false);
            }
        }
        let last = &xs[(t_n - 1) * h..];
        if let Some(w) = &self.output_res_w {
            blocks[t_n - 1].mix(last, w, &mut hmix);
        } else {
            hmix.copy_from_slice(last);
        }
        rms_norm(&hmix, &self.norm, c.rms_norm_eps, &mut y);
        match &self.lm_head {
            Some(head) => head.forward(&y, logits),
            None => self.embed.forward(&y, logits),
        }
        for buf in [xs, normed, ys, hmix, y] {
            sc.give(buf);
        }
        st.position += t_n;
        st.part_way = false;
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
