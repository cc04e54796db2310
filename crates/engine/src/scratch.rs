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
    /// A buffer of `n` floats for a caller that writes every element before it reads it: what
    /// it holds is unspecified (whatever the buffer last held), so taking it costs no memset
    /// except where the pool grows. A prompt chunk's buffers are hundreds of MB per layer, and
    /// clearing them was pure memory traffic. Debug builds (the tests) fill it with NaN instead,
    /// so a read before a write poisons the logits that the reference tests compare.
    pub fn take(&mut self, n: usize) -> Vec<f32> {
        let mut v = self.pick(n);
        if cfg!(debug_assertions) {
            v.fill(f32::NAN);
            v.resize(n, f32::NAN);
        } else {
            v.resize(n, 0.0);
        }
        v
    }

    /// The smallest pooled buffer that already holds `n` floats (so a call site keeps getting
    /// a buffer of its size whatever the order of returns), else the largest, with room for
    /// exactly `n`: growing by `resize` alone may double the capacity, and a prompt chunk's
    /// buffers are hundreds of MB that the memory plan counts at their size.
    fn pick(&mut self, n: usize) -> Vec<f32> {
        let fit = self.f32s.iter().enumerate().filter(|(_, v)| v.capacity() >= n).min_by_key(|(_, v)| v.capacity());
        let pick = fit.or_else(|| self.f32s.iter().enumerate().max_by_key(|(_, v)| v.capacity())).map(|(i, _)| i);
        let mut v = pick.map(|i| self.f32s.swap_remove(i)).unwrap_or_default();
        v.truncate(n);
        v.reserve_exact(n - v.len());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A taken buffer is not cleared (the tests see NaN where it would hold stale values), and
    /// it reuses the pooled buffer without growing it.
    #[test]
    fn take_reuses_buffers_and_leaves_their_contents() {
        let mut sc = Scratch::default();
        let mut v = sc.take(8);
        assert_eq!(v.len(), 8);
        // Poisoning is a debug-build check (release builds leave the bytes as they are).
        assert!(!cfg!(debug_assertions) || v.iter().all(|x| x.is_nan()), "debug builds poison a taken buffer");
        v.fill(3.0);
        let p = v.as_ptr();
        sc.give(v);
        let v = sc.take(5);
        assert_eq!((v.len(), v.as_ptr()), (5, p), "the pooled buffer is reused");
        // Not cleared: debug builds poison it, release builds leave the last user's values.
        let stale = if cfg!(debug_assertions) { v.iter().all(|x| x.is_nan()) } else { v.iter().all(|&x| x == 3.0) };
        assert!(stale, "{v:?}");
        sc.give(v);
        let v = sc.take(8);
        assert_eq!((v.len(), v.as_ptr()), (8, p));
        sc.give(v);
        assert_eq!(sc.pooled_bytes(), 8 * 4, "exactly the size asked for");
        let big = sc.take(20);
        assert_eq!(big.len(), 20);
        sc.give(big);
        assert_eq!(sc.pooled_bytes(), 20 * 4, "grown to exactly the size asked for");
    }
}
