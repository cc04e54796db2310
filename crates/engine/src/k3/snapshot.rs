//! A sequence's state as bytes, for prefix states kept on disk (issue 15): what a conversation
//! carries between tokens (each KDA layer's convolution history and recurrent state, each MLA
//! layer's latent cache, the position, the last routing), the logits after its last token, the
//! token prefix it stands for and the identity of the model that computed it.
//!
//! Layout, little-endian, every section length-prefixed so a reader never trusts a size it has
//! not checked against the model:
//!
//! ```text
//! magic "DFSTATE" version u8 | identity u64 | n_tokens u32 | tokens [u32]
//! position u64 | n_layers u32 | per layer: kind u8 (0 none, 1 KDA, 2 MLA) and its arrays
//!   (MLA: len u64, dtype u8 (0 f32, 1 bf16), then the cached rows [len, kv_lora + rope] as f32
//!   or as bf16 bits)
//! routing: per layer n u32, experts [u32], weights [f32]
//! logits [f32] | xxh3-64 of everything before it
//! ```
//!
//! An array is `len u32` then its values (4 bytes each, 2 for bf16). Version 2 keeps the MLA
//! cache as the model holds it (latent and rope channels of a position together, f32 or bf16);
//! version 1 (f32 latents and rope channels apart) is refused with [`SnapshotError::Version`],
//! never read as version 2. Restoring checks the checksum first (a torn or corrupt
//! file is refused whole), then the identity, then every array's length against the state it
//! is restored into: nothing is read past what was checked, and a refused snapshot leaves the
//! target state's buffers as they were sized (their contents are then unspecified).

use deltafin_store::checksum::xxh3_64;

use super::state::{K3State, LayerState};
use crate::blocks::mla::LatentCache;

/// `DFSTATE` then the format version.
const MAGIC: &[u8; 7] = b"DFSTATE";
const VERSION: u8 = b'2';

/// Why a snapshot was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("not a state snapshot (bad magic)")]
    Magic,
    #[error(
        "the snapshot is in state format version {found}, this build reads version {wants} (states are recomputed)",
        found = *.0 as char,
        wants = VERSION as char
    )]
    Version(u8),
    #[error("the snapshot is torn or corrupt (checksum mismatch)")]
    Checksum,
    #[error("the snapshot was made by another model or configuration")]
    Identity,
    #[error("the snapshot does not fit this model: {0}")]
    Shape(&'static str),
    #[error("the snapshot ends early")]
    Truncated,
}

/// Append `st`'s sequence state, `logits` and the `tokens` it stands for to `out`.
pub fn encode(st: &K3State, logits: &[f32], tokens: &[u32], identity: u64, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&identity.to_le_bytes());
    put_u32s(out, tokens);
    out.extend_from_slice(&(st.position as u64).to_le_bytes());
    out.extend_from_slice(&(st.layers.len() as u32).to_le_bytes());
    for layer in &st.layers {
        match layer {
            LayerState::None => out.push(0),
            LayerState::Kda(k) => {
                out.push(1);
                for c in &k.conv {
                    put_f32s(out, c);
                }
                put_f32s(out, &k.s);
            }
            LayerState::Mla(m) => {
                out.push(2);
                out.extend_from_slice(&(m.len as u64).to_le_bytes());
                match &m.cache {
                    LatentCache::F32(v) => {
                        out.push(0);
                        put_f32s(out, v);
                    }
                    LatentCache::Bf16(v) => {
                        out.push(1);
                        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                        v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                    }
                }
            }
        }
    }
    out.extend_from_slice(&(st.routing.len() as u32).to_le_bytes());
    for r in &st.routing {
        let experts: Vec<u32> = r.experts.iter().map(|&e| e as u32).collect();
        put_u32s(out, &experts);
        put_f32s(out, &r.weights);
    }
    put_f32s(out, logits);
    let sum = xxh3_64(&out[start..]);
    out.extend_from_slice(&sum.to_le_bytes());
}

/// The token prefix a snapshot stands for, after checking its magic, checksum and identity
/// (without touching any state): what a store reads to confirm a candidate.
pub fn tokens(bytes: &[u8], identity: u64) -> Result<Vec<u32>, SnapshotError> {
    let mut r = checked(bytes, identity)?;
    r.u32s()
}

/// Restore a snapshot into `st` and `logits` (which must come from the same model: their
/// buffers give the shapes every array is checked against); returns the tokens it stands for.
pub fn decode(bytes: &[u8], identity: u64, st: &mut K3State, logits: &mut [f32]) -> Result<Vec<u32>, SnapshotError> {
    let mut r = checked(bytes, identity)?;
    // Written part by part: a snapshot that fails half-way leaves `st` unusable.
    st.part_way = true;
    let tokens = r.u32s()?;
    let position = usize::try_from(r.u64()?).map_err(|_| SnapshotError::Shape("position"))?;
    if position != tokens.len() {
        return Err(SnapshotError::Shape("position"));
    }
    if r.u32()? as usize != st.layers.len() {
        return Err(SnapshotError::Shape("layer count"));
    }
    for layer in st.layers.iter_mut() {
        let kind = r.u8()?;
        match (kind, layer) {
            (0, LayerState::None) => {}
            (1, LayerState::Kda(k)) => {
                for c in k.conv.iter_mut() {
                    r.f32s_into(c)?;
                }
                r.f32s_into(&mut k.s)?;
            }
            (2, LayerState::Mla(m)) => {
                let len = usize::try_from(r.u64()?).map_err(|_| SnapshotError::Shape("MLA length"))?;
                if len != position {
                    return Err(SnapshotError::Shape("MLA cache length"));
                }
                // Exactly this model's widths for `len` tokens, in this run's dtype, before
                // anything is copied.
                let Some(n) = len.checked_mul(m.width()) else { return Err(SnapshotError::Shape("MLA cache length")) };
                match (r.u8()?, &mut m.cache) {
                    (0, LatentCache::F32(v)) => r.f32s_exact(v, n)?,
                    (1, LatentCache::Bf16(v)) => r.u16s_exact(v, n)?,
                    _ => return Err(SnapshotError::Shape("MLA cache dtype")),
                }
                m.len = len;
            }
            _ => return Err(SnapshotError::Shape("layer kinds")),
        }
    }
    if r.u32()? as usize != st.routing.len() {
        return Err(SnapshotError::Shape("routing layers"));
    }
    for routing in st.routing.iter_mut() {
        let experts = r.u32s()?;
        routing.experts.clear();
        routing.experts.extend(experts.iter().map(|&e| e as usize));
        r.f32s_vec(&mut routing.weights)?;
        if routing.weights.len() != routing.experts.len() {
            return Err(SnapshotError::Shape("routing weights"));
        }
        routing.pinned = false;
        routing.predicted_next.clear();
        routing.pinned_next.clear();
    }
    r.f32s_into(logits)?;
    if !r.rest.is_empty() {
        return Err(SnapshotError::Shape("trailing bytes"));
    }
    st.position = position;
    st.part_way = false;
    Ok(tokens)
}

/// The body after checking magic, checksum and identity, positioned after the identity.
fn checked(bytes: &[u8], identity: u64) -> Result<Reader<'_>, SnapshotError> {
    if bytes.len() < MAGIC.len() + 17 {
        return Err(SnapshotError::Truncated);
    }
    if &bytes[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::Magic);
    }
    // The version before the checksum: an older format's bytes are never interpreted.
    if bytes[MAGIC.len()] != VERSION {
        return Err(SnapshotError::Version(bytes[MAGIC.len()]));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let stored = u64::from_le_bytes(sum.try_into().map_err(|_| SnapshotError::Truncated)?);
    if xxh3_64(body) != stored {
        return Err(SnapshotError::Checksum);
    }
    let mut r = Reader { rest: &body[MAGIC.len() + 1..] };
    if r.u64()? != identity {
        return Err(SnapshotError::Identity);
    }
    Ok(r)
}

fn put_u32s(out: &mut Vec<u8>, v: &[u32]) {
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
}

fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], SnapshotError> {
        if self.rest.len() < n {
            return Err(SnapshotError::Truncated);
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, SnapshotError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, SnapshotError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// An array's length, checked against what is left (4 bytes per value).
    fn len(&mut self) -> Result<usize, SnapshotError> {
        let n = self.u32()? as usize;
        if self.rest.len() / 4 < n {
            return Err(SnapshotError::Truncated);
        }
        Ok(n)
    }
    fn u32s(&mut self) -> Result<Vec<u32>, SnapshotError> {
        let n = self.len()?;
        Ok(self.take(4 * n)?.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
    /// Into a buffer of exactly the stored length (a fixed-size state array).
    fn f32s_into(&mut self, dst: &mut [f32]) -> Result<(), SnapshotError> {
        let n = self.len()?;
        if n != dst.len() {
            return Err(SnapshotError::Shape("array length"));
        }
        for (d, b) in dst.iter_mut().zip(self.take(4 * n)?.chunks_exact(4)) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
    /// Replacing a growable buffer's contents with exactly `n` values (the MLA cache), keeping
    /// its reserved capacity.
    fn f32s_exact(&mut self, dst: &mut Vec<f32>, n: usize) -> Result<(), SnapshotError> {
        let before = self.rest;
        if self.len()? != n {
            self.rest = before;
            return Err(SnapshotError::Shape("MLA cache width"));
        }
        dst.clear();
        dst.extend(self.take(4 * n)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        Ok(())
    }

    /// [`Self::f32s_exact`] for a bf16 cache (2 bytes per value).
    fn u16s_exact(&mut self, dst: &mut Vec<u16>, n: usize) -> Result<(), SnapshotError> {
        let stored = self.u32()? as usize;
        if stored != n {
            return Err(SnapshotError::Shape("MLA cache width"));
        }
        if self.rest.len() / 2 < n {
            return Err(SnapshotError::Truncated);
        }
        dst.clear();
        dst.extend(self.take(2 * n)?.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
        Ok(())
    }

    /// Replacing a growable buffer's contents (a routing's weights), keeping its reserved
    /// capacity.
    fn f32s_vec(&mut self, dst: &mut Vec<f32>) -> Result<(), SnapshotError> {
        let n = self.len()?;
        dst.clear();
        dst.extend(self.take(4 * n)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        Ok(())
    }
}
