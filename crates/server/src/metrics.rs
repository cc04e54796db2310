//! Counters for `GET /metrics`, in Prometheus' text exposition format, and the health rule of
//! `GET /health`.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use deltafin_engine::experts::ExpertSource;
use deltafin_engine::fault::FaultStats;
use deltafin_engine::prefix_store::StoreCounters;
use deltafin_engine::session::Session;
use deltafin_store::presence::FetchStats;
use deltafin_text::textgen::{Finish, Summary};

/// A Prometheus summary without quantiles: a sum and a count.
#[derive(Default)]
struct SumCount {
    sum: f64,
    count: u64,
}

#[derive(Default)]
pub struct Metrics {
    /// Requests by endpoint and status code.
    requests: Mutex<Vec<((String, u16), u64)>>,
    pub rejected_busy: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    ttft: Mutex<SumCount>,
    per_token: Mutex<SumCount>,
    expert_bytes: AtomicU64,
    cache_accesses: AtomicU64,
    cache_hits: AtomicU64,
    /// Lookups served by a prefetch or a prompt chunk's read-ahead (landed or in flight).
    prefetch_served: AtomicU64,
    faults: Mutex<FaultStats>,
    /// A streaming store's fetches, and its experts on disk (present, all).
    streaming: Mutex<Option<StreamingTotals>>,
    /// The prompt-state store on disk: its counters, and the snapshots and bytes it holds.
    states: Mutex<Option<(StoreCounters, (usize, u64))>>,
    health: Mutex<Health>,
    /// Sequences per model step (continuous batching), and the most a step may carry.
    batch: Mutex<SumCount>,
    batch_largest: AtomicU64,
    max_batch: AtomicU64,
}

/// How a generation that the engine ran ended, for the health rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Ended normally (stop, length, tool calls).
    Completed,
    /// Stopped by its client: says nothing about the storage either way.
    Cancelled,
    /// Failed reading the model from storage: routed experts or a streamed spine layer (its
    /// client-facing message).
    ReadFault(String),
    /// Failed otherwise (another engine error, a panic).
    OtherFailure,
}

/// A streaming store's fetch totals, and its experts on disk (present, all).
type StreamingTotals = (FetchStats, Option<(usize, usize)>);

/// Generations in a row that must fail with a read fault for the server to report itself
/// degraded. One fault can be a bad sector under one record; three in a row with nothing
/// succeeding between them means the storage under the model is failing, and a load balancer
/// should send work elsewhere.
pub const DEGRADED_AFTER: u64 = 3;

/// The read-fault streak behind `/health`.
#[derive(Debug, Default)]
struct Health {
    /// Generations that failed with a read fault since the last completed one.
    read_fault_streak: u64,
    /// The latest read fault's message (layer and expert).
    last_fault: String,
}

/// Why the server is degraded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Degraded {
    pub consecutive_read_faults: u64,
    pub reason: String,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain numbers behind: still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut r = lock(&self.requests);
        match r.iter_mut().find(|((e, s), _)| e == endpoint && *s == status) {
            Some((_, n)) => *n += 1,
            None => r.push(((endpoint.to_string(), status), 1)),
        }
    }

    pub fn record_generation(&self, s: &Summary) {
        self.prompt_tokens.fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_prompt_tokens.fetch_add(s.cached_prompt_tokens as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(s.completion_tokens as u64, Ordering::Relaxed);
        if s.finish == Finish::Cancelled {
            self.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        if s.completion_tokens > 0 {
            let mut t = lock(&self.ttft);
            t.sum += s.ttft_s;
            t.count += 1;
        }
        if s.completion_tokens > 1 {
            let mut t = lock(&self.per_token);
            t.sum += s.decode_s;
            t.count += s.completion_tokens as u64 - 1;
        }
    }

    /// One model step of the batch, with this many sequences in it.
    pub fn record_step(&self, sequences: usize) {
        let mut b = lock(&self.batch);
        b.sum += sequences as f64;
        b.count += 1;
        self.batch_largest.fetch_max(sequences as u64, Ordering::Relaxed);
    }

    /// The most sequences a step may carry (`serve --max-batch`).
    pub fn set_max_batch(&self, n: usize) {
        self.max_batch.store(n as u64, Ordering::Relaxed);
    }

    /// Totals of the expert source since the server started.
    pub fn set_expert_stats(&self, session: &Session) {
        let t = session.experts.total_stats();
        self.expert_bytes.store(session.experts.bytes_read(), Ordering::Relaxed);
        self.cache_accesses.store(t.accesses, Ordering::Relaxed);
        self.cache_hits.store(t.cache_hits, Ordering::Relaxed);
        self.prefetch_served.store(t.prefetch_used, Ordering::Relaxed);
        self.set_faults(ExpertSource::faults(&session.experts));
        *lock(&self.streaming) = session.experts.fetch_stats().map(|f| (f, session.experts.presence_count()));
    }

    /// The prompt-state store's counters after a request.
    pub fn set_state_stats(&self, c: StoreCounters, held: (usize, u64)) {
        *lock(&self.states) = Some((c, held));
    }

    fn set_faults(&self, f: FaultStats) {
        *lock(&self.faults) = f;
    }

    /// The health rule: a read fault extends the streak, a completed generation ends it, and a
    /// cancelled one or a failure of another kind leaves it as it is (neither says whether the
    /// storage reads well).
    pub fn record_outcome(&self, o: Outcome) {
        let mut h = lock(&self.health);
        match o {
            Outcome::Completed => h.read_fault_streak = 0,
            Outcome::ReadFault(msg) => {
                h.read_fault_streak += 1;
                h.last_fault = msg;
            }
            Outcome::Cancelled | Outcome::OtherFailure => {}
        }
    }

    /// `Some` while the last [`DEGRADED_AFTER`] generations (cancelled ones and other failures
    /// aside) failed with read faults.
    pub fn degraded(&self) -> Option<Degraded> {
        let h = lock(&self.health);
        (h.read_fault_streak >= DEGRADED_AFTER).then(|| Degraded {
            consecutive_read_faults: h.read_fault_streak,
            reason: format!(
                "the last {} generations failed reading the model from storage (latest: {}); the next one that completes clears this",
                h.read_fault_streak, h.last_fault
            ),
        })
    }

    pub fn render(&self, queue_length: usize, running: usize) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        metric("deltafin_requests_total", "counter", "HTTP requests by endpoint and status code.");
        let mut out = o;
        {
            let mut r: Vec<_> = lock(&self.requests).clone();
            r.sort();
            for ((endpoint, status), n) in r {
                let _ = writeln!(out, "deltafin_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
            }
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let summary = |out: &mut String, name: &str, help: &str, s: &SumCount| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} summary\n{name}_sum {}\n{name}_count {}",
                s.sum, s.count
            );
        };
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(&mut out, "deltafin_rejected_busy_total", "Requests refused with 429.", ld(&self.rejected_busy));
        counter(
            &mut out,
            "deltafin_cancelled_total",
            "Generations stopped by a client disconnect.",
            ld(&self.cancelled),
        );
        counter(&mut out, "deltafin_failed_total", "Generations that failed in the engine.", ld(&self.failed));
        counter(&mut out, "deltafin_prompt_tokens_total", "Prompt tokens processed.", ld(&self.prompt_tokens));
        counter(
            &mut out,
            "deltafin_prompt_tokens_cached_total",
            "Prompt tokens resumed from the previous prompt's state instead of recomputed.",
            ld(&self.cached_prompt_tokens),
        );
        counter(&mut out, "deltafin_generated_tokens_total", "Tokens generated.", ld(&self.generated_tokens));
        summary(
            &mut out,
            "deltafin_time_to_first_token_seconds",
            "Seconds from the engine taking a request to its first token.",
            &lock(&self.ttft),
        );
        summary(
            &mut out,
            "deltafin_seconds_per_token",
            "Seconds per generated token after the first.",
            &lock(&self.per_token),
        );
        counter(
            &mut out,
            "deltafin_expert_bytes_read_total",
            "Routed-expert bytes read from disk.",
            ld(&self.expert_bytes),
        );
        let (acc, hits) = (ld(&self.cache_accesses), ld(&self.cache_hits));
        counter(&mut out, "deltafin_expert_cache_accesses_total", "Routed-expert lookups.", acc);
        counter(
            &mut out,
            "deltafin_expert_cache_hits_total",
            "Routed-expert lookups found in the cache (not put there by a prefetch or read-ahead).",
            hits,
        );
        counter(
            &mut out,
            "deltafin_expert_prefetch_served_total",
            "Routed-expert lookups served by a prefetch or a prompt chunk's read-ahead.",
            ld(&self.prefetch_served),
        );
        gauge(
            &mut out,
            "deltafin_expert_cache_hit_rate",
            "Hits over lookups since start (0 before any).",
            if acc == 0 { 0.0 } else { hits as f64 / acc as f64 },
        );
        if let Some((c, (n, bytes))) = *lock(&self.states) {
            let lines = [
                ("deltafin_state_hits_total", "Requests resumed from a prompt state on disk.", c.hits),
                ("deltafin_state_misses_total", "Requests for which no prompt state on disk served.", c.misses),
                ("deltafin_state_bytes_read_total", "Bytes of prompt states read from disk.", c.bytes_read),
                ("deltafin_state_bytes_written_total", "Bytes of prompt states written to disk.", c.bytes_written),
                ("deltafin_state_snapshots_written_total", "Prompt states written to disk.", c.snapshots_written),
                ("deltafin_state_evictions_total", "Prompt states deleted to stay within the budget.", c.evictions),
                ("deltafin_state_dropped_total", "Prompt states found torn or corrupt, deleted unused.", c.dropped),
            ];
            for (name, help, v) in lines {
                counter(&mut out, name, help, v);
            }
            gauge(&mut out, "deltafin_state_snapshots", "Prompt states on disk now.", n as f64);
            gauge(&mut out, "deltafin_state_bytes", "Bytes of prompt states on disk now.", bytes as f64);
        }
        let f = *lock(&self.faults);
        counter(
            &mut out,
            "deltafin_expert_read_errors_total",
            "Routed-expert reads that failed (each attempt counts).",
            f.read_errors,
        );
        counter(
            &mut out,
            "deltafin_expert_checksum_failures_total",
            "Routed-expert records whose bytes failed their checksum (each attempt counts).",
            f.checksum_failures,
        );
        counter(
            &mut out,
            "deltafin_expert_read_retries_total",
            "Routed-expert records read again after a fault.",
            f.retries,
        );
        counter(
            &mut out,
            "deltafin_expert_failed_records_total",
            "Routed-expert read faults that failed a request (the retry failed too).",
            f.failed_records,
        );
        counter(
            &mut out,
            "deltafin_expert_source_resets_total",
            "Times the expert source was returned to a clean state after a failed request.",
            f.resets,
        );
        counter(
            &mut out,
            "deltafin_expert_io_thread_restarts_total",
            "Expert I/O threads (which read and verify records) started again after one was lost with reads outstanding.",
            f.io_restarts,
        );
        gauge(
            &mut out,
            "deltafin_degraded",
            &format!(
                "1 while the last {DEGRADED_AFTER} generations failed with read faults (GET /health answers 503), else 0."
            ),
            self.degraded().is_some() as u8 as f64,
        );
        if let Some((f, present)) = *lock(&self.streaming) {
            counter(
                &mut out,
                "deltafin_stream_experts_fetched_total",
                "Routed experts fetched from the origin on first use.",
                f.experts,
            );
            counter(
                &mut out,
                "deltafin_stream_experts_fetched_ahead_total",
                "Of those, fetched ahead of demand from the router's look-ahead.",
                f.experts_ahead,
            );
            counter(
                &mut out,
                "deltafin_stream_bytes_downloaded_total",
                "Body bytes received from the origin by expert fetches.",
                f.bytes_downloaded,
            );
            counter(
                &mut out,
                "deltafin_stream_bytes_written_total",
                "Bytes written into the store by expert fetches (SSD endurance).",
                f.bytes_written,
            );
            counter(
                &mut out,
                "deltafin_stream_fetch_failures_total",
                "Layer fetches that failed (the request failed with them).",
                f.failures,
            );
            gauge(&mut out, "deltafin_stream_fetch_seconds_total", "Wall time spent fetching experts.", f.seconds);
            if let Some((p, all)) = present {
                gauge(
                    &mut out,
                    "deltafin_stream_experts_present",
                    &format!("Routed experts on disk (of {all})."),
                    p as f64,
                );
            }
        }
        gauge(&mut out, "deltafin_queue_length", "Requests waiting for the engine.", queue_length as f64);
        gauge(&mut out, "deltafin_running", "Generations running (at most the batch size).", running as f64);
        summary(
            &mut out,
            "deltafin_batch_sequences_per_step",
            "Sequences in each model step of the continuous batch (serve --max-batch above 1): sum over steps and steps.",
            &lock(&self.batch),
        );
        gauge(
            &mut out,
            "deltafin_batch_sequences_largest",
            "The most sequences one model step carried.",
            self.batch_largest.load(Ordering::Relaxed) as f64,
        );
        gauge(
            &mut out,
            "deltafin_max_batch",
            "The most sequences a model step may carry (serve --max-batch).",
            self.max_batch.load(Ordering::Relaxed) as f64,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.count_request("/v1/chat/completions", 200);
        m.count_request("/v1/chat/completions", 200);
        m.count_request("/v1/completions", 429);
        m.record_generation(&Summary {
            finish: Finish::Stop,
            prompt_tokens: 7,
            cached_prompt_tokens: 3,
            completion_tokens: 5,
            ttft_s: 0.5,
            decode_s: 2.0,
            stop_string: None,
        });
        m.set_faults(FaultStats {
            read_errors: 4,
            checksum_failures: 3,
            retries: 5,
            failed_records: 2,
            resets: 2,
            io_restarts: 1,
        });
        let text = m.render(2, 1);
        assert!(text.contains("deltafin_expert_read_errors_total 4\n"));
        assert!(text.contains("deltafin_expert_checksum_failures_total 3\n"));
        assert!(text.contains("deltafin_expert_read_retries_total 5\n"));
        assert!(text.contains("deltafin_expert_failed_records_total 2\n"));
        assert!(text.contains("deltafin_expert_source_resets_total 2\n"));
        assert!(text.contains("deltafin_expert_io_thread_restarts_total 1\n"));
        assert!(text.contains("deltafin_degraded 0\n"));
        assert!(text.contains("deltafin_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"));
        assert!(text.contains("deltafin_requests_total{endpoint=\"/v1/completions\",status=\"429\"} 1"));
        assert!(text.contains("deltafin_prompt_tokens_total 7\n"));
        assert!(text.contains("deltafin_generated_tokens_total 5\n"));
        assert!(text.contains("deltafin_prompt_tokens_cached_total 3\n"));
        assert!(text.contains("deltafin_seconds_per_token_sum 2\ndeltafin_seconds_per_token_count 4\n"));
        assert!(text.contains("deltafin_queue_length 2\n"));
        // Every sample line belongs to a declared metric.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let base = name.trim_end_matches("_sum").trim_end_matches("_count");
            assert!(text.contains(&format!("# TYPE {base} ")), "{line}");
        }
    }

    #[test]
    fn three_read_faults_in_a_row_degrade_until_a_completion() {
        let m = Metrics::default();
        let fault = || Outcome::ReadFault("reading layer 3 expert 17 failed (checksum mismatch) after a retry".into());
        m.record_outcome(fault());
        m.record_outcome(fault());
        assert_eq!(m.degraded(), None);
        // Cancellations and other failures neither count nor clear.
        m.record_outcome(Outcome::Cancelled);
        m.record_outcome(Outcome::OtherFailure);
        assert_eq!(m.degraded(), None);
        m.record_outcome(fault());
        let d = m.degraded().expect("three read faults in a row");
        assert_eq!(d.consecutive_read_faults, 3);
        assert!(d.reason.contains("layer 3 expert 17"), "{}", d.reason);
        assert!(m.render(0, 0).contains("deltafin_degraded 1\n"));
        m.record_outcome(fault());
        assert_eq!(m.degraded().map(|d| d.consecutive_read_faults), Some(4));
        // One completed generation clears it, and the streak starts over.
        m.record_outcome(Outcome::Completed);
        assert_eq!(m.degraded(), None);
        assert!(m.render(0, 0).contains("deltafin_degraded 0\n"));
        m.record_outcome(fault());
        m.record_outcome(fault());
        assert_eq!(m.degraded(), None);
    }
}
