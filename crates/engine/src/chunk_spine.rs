//! Where a prompt chunk's spine products run: while a chunk of one sequence is in the model
//! (`K3Model::forward_batch_with`), the engine thread carries here the run's [`SpineRunner`]
//! (`--device gpu`) or the approximate mode's integer products (`--approx`), and
//! [`crate::weights::Linear::forward_batch`] sends its product there. Scoped to the thread and
//! the chunk, not stored in every matrix: the matrices are built by loaders that know nothing of
//! devices or modes, and decode steps and batches of sequences keep the exact CPU products
//! (their per-sequence arithmetic is the same whatever else is in the batch).

use std::cell::RefCell;
use std::sync::Arc;

use deltafin_gpu::spine::SpineRunner;

/// Tokens a chunk needs before its int8 spine products run in integers (below, the exact
/// products: a prompt's few-token tail or a short follow-up turn computes as decode does).
pub const INTEGER_MIN_TOKENS: usize = 16;

#[derive(Default)]
struct ChunkSpine {
    gpu: Option<Arc<SpineRunner>>,
    integer: bool,
}

thread_local! {
    static CURRENT: RefCell<ChunkSpine> = RefCell::new(ChunkSpine::default());
}

/// Sets this thread's chunk products until dropped (also when the chunk unwinds), then puts
/// back what was there.
pub struct Scope {
    previous: ChunkSpine,
}

impl Scope {
    /// `gpu`: the runner for the chunk's products; `integer`: int8 matrices in integers.
    pub fn enter(gpu: Option<Arc<SpineRunner>>, integer: bool) -> Self {
        Scope { previous: CURRENT.with(|c| c.replace(ChunkSpine { gpu, integer })) }
    }
}

/// The rest of this scope with exact CPU products (the router: a flipped expert choice costs
/// far more than its small product saves); the GPU's runner, if any, stays.
pub fn exact_here() -> Scope {
    Scope::enter(current(), false)
}

impl Drop for Scope {
    fn drop(&mut self) {
        let previous = std::mem::take(&mut self.previous);
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// The runner of the chunk this thread is computing, if its products go to the GPU.
pub fn current() -> Option<Arc<SpineRunner>> {
    CURRENT.with(|c| c.borrow().gpu.clone())
}

/// Whether the chunk this thread is computing runs its int8 products in integers.
pub fn integer() -> bool {
    CURRENT.with(|c| c.borrow().integer)
}
