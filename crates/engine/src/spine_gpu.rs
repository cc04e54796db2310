//! Where a prompt chunk's spine products run: while a chunk of one sequence is in the model
//! (`K3Model::forward_batch_with`), the engine thread carries the run's [`SpineRunner`] here, and
//! [`crate::weights::Linear::forward_batch`] sends its product to the GPU. Scoped to the thread
//! and the chunk, not stored in every matrix: the matrices are built by loaders that know nothing
//! of devices, and decode steps and batches of sequences stay on the CPU (their per-sequence
//! arithmetic is the same whatever else is in the batch).

use std::cell::RefCell;
use std::sync::Arc;

use deltafin_gpu::spine::SpineRunner;

thread_local! {
    static CURRENT: RefCell<Option<Arc<SpineRunner>>> = const { RefCell::new(None) };
}

/// Sets this thread's runner until dropped (also when the chunk unwinds), then puts back what
/// was there.
pub struct Scope {
    previous: Option<Arc<SpineRunner>>,
}

impl Scope {
    pub fn enter(runner: Option<Arc<SpineRunner>>) -> Self {
        Scope { previous: CURRENT.with(|c| c.replace(runner)) }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// The runner of the chunk this thread is computing, if its products go to the GPU.
pub fn current() -> Option<Arc<SpineRunner>> {
    CURRENT.with(|c| c.borrow().clone())
}
