//! A global bandwidth limit: one token bucket over the body bytes of both listeners, so that a
//! loopback run can stand in for a real link (`--rate`, [`crate::Origin::set_rate`]).
//!
//! Each chunk reserves its bytes before it is handed to hyper; a reservation larger than the
//! tokens in the bucket leaves it in debt, and the chunk waits until the debt is repaid at the
//! rate. Concurrent bodies therefore share the rate whatever their number, and a timer that
//! wakes late loses nothing: the tokens keep accruing up to the burst.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds of the rate that may accrue while nothing is sent (a link's idle time is not saved
/// up beyond this).
const BURST_SECONDS: f64 = 0.05;
/// The burst is never smaller than this, so a wake-up a timer tick late can still spend it.
const MIN_BURST: f64 = 256.0 * 1024.0;

pub(crate) struct Limiter {
    state: Mutex<Bucket>,
}

struct Bucket {
    /// Bytes per second; None: unlimited.
    rate: Option<u64>,
    /// May be negative (debt).
    tokens: f64,
    at: Instant,
}

impl Limiter {
    pub(crate) fn new() -> Limiter {
        Limiter { state: Mutex::new(Bucket { rate: None, tokens: 0.0, at: Instant::now() }) }
    }

    /// A new rate (None: unlimited) applies from the next chunk; the bucket starts empty.
    pub(crate) fn set_rate(&self, rate: Option<u64>) {
        let mut b = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *b = Bucket { rate: rate.filter(|&r| r > 0), tokens: 0.0, at: Instant::now() };
    }

    /// Reserves `bytes`; returns how long the caller must wait before sending them.
    pub(crate) fn reserve(&self, bytes: u64) -> Duration {
        let mut b = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rate) = b.rate else { return Duration::ZERO };
        let rate = rate as f64;
        let now = Instant::now();
        let burst = (rate * BURST_SECONDS).max(MIN_BURST);
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate).min(burst);
        b.at = now;
        b.tokens -= bytes as f64;
        if b.tokens >= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(-b.tokens / rate) }
    }
}
