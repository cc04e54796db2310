//! Reusable per-sequence buffers for the per-token loop. Blocks take what they need and give it
//! back; after the first tokens every buffer has reached its size, and a token allocates nothing.

use deltafin_kernels::approx::QuantizedX;

#[derive(Default)]
pub struct Scratch {
    f32s: Vec<Vec<f32>>,
    ids: Vec<Vec<usize>>,
    /// Quantised activations for approximate mode: each chunk token's expert input `[T]`, and
    /// the SiTU output of the expert being computed.
    pub xqs: Vec<QuantizedX>,
    pub aq: QuantizedX,
}

impl Scratch {
    /// A zeroed buffer of `n` floats: the smallest pooled buffer that already holds `n` (so a
    /// call site keeps getting a buffer of its size whatever the order of returns), else the
    /// largest, grown.
    pub fn take(&mut self, n: usize) -> Vec<f32> {
        let fit = self.f32s.iter().enumerate().filter(|(_, v)| v.capacity() >= n).min_by_key(|(_, v)| v.capacity());
        let pick = fit.or_else(|| self.f32s.iter().enumerate().max_by_key(|(_, v)| v.capacity())).map(|(i, _)| i);
        let mut v = pick.map(|i| self.f32s.swap_remove(i)).unwrap_or_default();
        v.clear();
        // Exactly `n`: `resize` alone may double the capacity, and a prompt chunk's buffers are
        // hundreds of MB that the memory plan counts at their size.
        v.reserve_exact(n);
        v.resize(n, 0.0);
        v
    }

    pub fn give(&mut self, v: Vec<f32>) {
        self.f32s.push(v);
    }

    /// Bytes the pool holds (float and index buffers), for holding the memory plan's estimate
    /// of a prompt chunk to what a chunk really takes.
    pub fn pooled_bytes(&self) -> usize {
        let f: usize = self.f32s.iter().map(|v| v.capacity() * 4).sum();
        let i: usize = self.ids.iter().map(|v| v.capacity() * std::mem::size_of::<usize>()).sum();
        f + i
    }

    /// Drop every pooled buffer (after a prompt chunk on borrowed memory: the next token
    /// allocates its own small ones again).
    pub fn release(&mut self) {
        *self = Scratch::default();
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
