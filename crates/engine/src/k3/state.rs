//! What one sequence carries from token to token: per-layer attention state (KDA recurrent
//! state or the MLA latent cache), the position, the last routing, and reusable buffers.

use crate::blocks::attn_res::ResidualBlocks;
use crate::blocks::kda::KdaState;
use crate::blocks::mla::MlaState;
use crate::blocks::moe::Routing;
use crate::scratch::Scratch;

pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
    None,
}

/// Everything one sequence carries between tokens.
pub struct K3State {
    pub layers: Vec<LayerState>,
    pub position: usize,
    /// Router choices of the last token, per layer (empty for dense layers).
    pub routing: Vec<Routing>,
    /// Per-token buffers, reused from token to token.
    pub scratch: Scratch,
    /// The block attention residuals of each token of the current chunk `[T]` (memory reused;
    /// only the first T are live).
    pub blocks: Vec<ResidualBlocks>,
    /// Routing of each token of the current chunk `[T]`, reused from layer to layer.
    pub chunk_routing: Vec<Routing>,
    /// Set while a chunk runs, cleared when it completes: a chunk that failed or was stopped
    /// between layers leaves some layers advanced and others not, and such a state is refused
    /// by the forward pass and by prompt-state saving (`is_part_way`).
    pub(crate) part_way: bool,
}

impl K3State {
    /// Whether a chunk was left part-way (an error, or a stop between layers): the state is
    /// unusable, and only a new state or a restored snapshot continues.
    pub fn is_part_way(&self) -> bool {
        self.part_way
    }

    /// Free what grew with the prompt's chunks (per-token scratch, each chunk token's residual
    /// blocks and routing), keeping the sequence: a prompt that borrowed memory gives it back.
    pub fn release_chunk_buffers(&mut self) {
        self.scratch.release();
        self.blocks = Vec::new();
        self.chunk_routing = Vec::new();
    }

    /// Make this state continue `other`'s sequence: recurrent and latent caches, position and
    /// last routing are copied into this state's own buffers (no reallocation within the
    /// reserved context). Per-token scratch is not sequence state and is left alone.
    pub fn copy_sequence_from(&mut self, other: &K3State) {
        assert_eq!(self.layers.len(), other.layers.len(), "states of different models");
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            match (a, b) {
                (LayerState::Kda(a), LayerState::Kda(b)) => {
                    for (x, y) in a.conv.iter_mut().zip(&b.conv) {
                        x.copy_from_slice(y);
                    }
                    a.s.copy_from_slice(&b.s);
                }
                (LayerState::Mla(a), LayerState::Mla(b)) => a.copy_from(b),
                (a, b) => assert!(matches!((a, b), (LayerState::None, LayerState::None)), "layer kinds differ"),
            }
        }
        self.position = other.position;
        self.routing.clone_from(&other.routing);
        self.part_way = other.part_way;
    }
}
