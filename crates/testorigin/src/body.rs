//! Response bodies streamed in chunks, with the body faults built in.
//!
//! Files are read piece by piece at request time (bench checkpoints are gigabytes), and each
//! chunk is counted in the stats as it is handed to hyper. A fault that must cut the connection
//! (`Drop`, `WrongLength`) ends the stream with an error, which makes hyper abort it.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::Stats;
use crate::rate::Limiter;
use crate::state::lock;

/// The largest chunk handed to hyper.
const CHUNK: u64 = 64 * 1024;

/// How much is read from a file at a time: each tokio file read is a trip to the blocking pool,
/// so reading a chunk at a time caps a transfer well below what loopback carries.
const READ_AHEAD: u64 = 1024 * 1024;

/// How long a stream waits before its abort. hyper buffers written chunks and only flushes when
/// the body is pending, so an error right after the last chunk would throw away the bytes the
/// fault promised to send; the pause lets them reach the client first.
const FLUSH_PAUSE: Duration = Duration::from_millis(150);

/// What `WrongLength` adds to the `Content-Length` it announces.
const WRONG_LENGTH_EXTRA: u64 = 1024;

/// Where a body's bytes come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    File(PathBuf),
    Memory(Bytes),
}

/// A fault that changes the body, not the status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFault {
    Drop { after_bytes: u64 },
    Slow { bytes_per_sec: u64 },
    WrongLength,
    Corrupt,
}

/// One body to send: `len` bytes of `source` from `start`.
pub(crate) struct BodyPlan {
    pub source: Source,
    pub start: u64,
    pub len: u64,
    pub fault: Option<BodyFault>,
    /// The file name its bytes are counted under in `Stats::body_bytes` (None: not counted).
    pub count_as: Option<String>,
    pub stats: Arc<Mutex<Stats>>,
    /// The origin's bandwidth limit, shared by every body of both listeners.
    pub limiter: Arc<Limiter>,
}

impl BodyPlan {
    /// The `Content-Length` to announce: the body's length, except under `WrongLength`.
    pub(crate) fn content_length(&self) -> u64 {
        match self.fault {
            Some(BodyFault::WrongLength) => self.len + WRONG_LENGTH_EXTRA,
            _ => self.len,
        }
    }

    pub(crate) fn into_body(self) -> Body {
        let cursor = Cursor { plan: self, file: None, buffered: Bytes::new(), sent: 0, done: false };
        Body::from_stream(futures_util::stream::unfold(cursor, next_chunk))
    }
}

struct Cursor {
    plan: BodyPlan,
    file: Option<tokio::fs::File>,
    /// Read from the source but not yet sent: it starts at `sent`.
    buffered: Bytes,
    sent: u64,
    done: bool,
}

impl Cursor {
    /// Bytes to send before the stream ends (or aborts).
    fn limit(&self) -> u64 {
        match self.plan.fault {
            Some(BodyFault::Drop { after_bytes }) => after_bytes.min(self.plan.len),
            _ => self.plan.len,
        }
    }

    fn chunk_size(&self) -> u64 {
        match self.plan.fault {
            // About ten chunks a second, so the pace is smooth even for small files.
            Some(BodyFault::Slow { bytes_per_sec }) => (bytes_per_sec / 10).clamp(1, CHUNK),
            _ => CHUNK,
        }
    }

    /// The next `len` bytes (at most what is left before the limit).
    async fn take(&mut self, len: u64) -> io::Result<Bytes> {
        if self.buffered.is_empty() {
            let ahead = (self.limit() - self.sent).min(READ_AHEAD.max(len));
            self.buffered = self.read(ahead).await?;
        }
        let len = (len as usize).min(self.buffered.len());
        Ok(self.buffered.split_to(len))
    }

    async fn read(&mut self, len: u64) -> io::Result<Bytes> {
        let offset = self.plan.start + self.sent;
        match &self.plan.source {
            Source::Memory(bytes) => Ok(bytes.slice(offset as usize..(offset + len) as usize)),
            Source::File(path) => {
                if self.file.is_none() {
                    let mut file = tokio::fs::File::open(path).await?;
                    file.seek(io::SeekFrom::Start(offset)).await?;
                    self.file = Some(file);
                }
                let file = self.file.as_mut().expect("opened above");
                let mut buf = BytesMut::zeroed(len as usize);
                file.read_exact(&mut buf).await?;
                Ok(buf.freeze())
            }
        }
    }
}

async fn next_chunk(mut c: Cursor) -> Option<(io::Result<Bytes>, Cursor)> {
    if c.done {
        return None;
    }
    let limit = c.limit();
    if c.sent >= limit {
        c.done = true;
        return match c.plan.fault {
            Some(BodyFault::Drop { .. } | BodyFault::WrongLength) => {
                tokio::time::sleep(FLUSH_PAUSE).await;
                Some((Err(io::Error::other("injected fault: connection aborted")), c))
            }
            _ => None,
        };
    }
    let mut chunk = match c.take((limit - c.sent).min(c.chunk_size())).await {
        Ok(chunk) => chunk,
        Err(e) => {
            // The file changed under us: abort rather than send a short body that looks whole.
            c.done = true;
            return Some((Err(e), c));
        }
    };
    // The last piece of a read-ahead may be shorter than a chunk.
    let len = chunk.len() as u64;
    let wait = c.plan.limiter.reserve(len);
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    if let Some(BodyFault::Slow { bytes_per_sec }) = c.plan.fault {
        tokio::time::sleep(Duration::from_secs_f64(len as f64 / bytes_per_sec.max(1) as f64)).await;
    }
    if c.plan.fault == Some(BodyFault::Corrupt) {
        let target = c.plan.len / 2;
        if (c.sent..c.sent + len).contains(&target) {
            let mut bytes = BytesMut::from(&chunk[..]);
            bytes[(target - c.sent) as usize] ^= 0xff;
            chunk = bytes.freeze();
        }
    }
    if let Some(name) = &c.plan.count_as {
        *lock(&c.plan.stats).body_bytes.entry(name.clone()).or_default() += len;
    }
    c.sent += len;
    Some((Ok(chunk), c))
}
