//! Reusable per-sequence buffers for the per-token loop. Blocks take what they need and give it
//! back; after the first tokens every buffer has reached its size, and a token allocates nothing.

#[derive(Default)]
pub struct Scratch {
    f32s: Vec<Vec<f32>>,
    ids: Vec<Vec<usize>>,
}

impl Scratch {
    /// A zeroed buffer of `n` floats.
    pub fn take(&mut self, n: usize) -> Vec<f32> {
        let mut v = self.f32s.pop().unwrap_or_default();
        v.clear();
        v.resize(n, 0.0);
        v
    }

    /// A copy of `src` in a reused buffer.
    pub fn copy_of(&mut self, src: &[f32]) -> Vec<f32> {
        let mut v = self.f32s.pop().unwrap_or_default();
        v.clear();
        v.extend_from_slice(src);
        v
    }

    pub fn give(&mut self, v: Vec<f32>) {
        self.f32s.push(v);
    }

    /// An empty index buffer.
    pub fn take_ids(&mut self) -> Vec<usize> {
        let mut v = self.ids.pop().unwrap_or_default();
        v.clear();
        v
    }

    pub fn give_ids(&mut self, v: Vec<usize>) {
        self.ids.push(v);
    }
}
