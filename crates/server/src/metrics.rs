//! Counters for `GET /metrics`, in Prometheus' text exposition format.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use deltafin_engine::experts::ExpertSource;
use deltafin_engine::session::Session;
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

    /// Totals of the expert source since the server started.
    pub fn set_expert_stats(&self, session: &Session) {
        let t = session.experts.total_stats();
        self.expert_bytes.store(session.experts.bytes_read(), Ordering::Relaxed);
        self.cache_accesses.store(t.accesses, Ordering::Relaxed);
        self.cache_hits.store(t.hits, Ordering::Relaxed);
    }

    pub fn render(&self, queue_length: usize, running: bool) -> String {
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
        counter(&mut out, "deltafin_expert_cache_hits_total", "Routed-expert lookups served from RAM.", hits);
        gauge(
            &mut out,
            "deltafin_expert_cache_hit_rate",
            "Hits over lookups since start (0 before any).",
            if acc == 0 { 0.0 } else { hits as f64 / acc as f64 },
        );
        gauge(&mut out, "deltafin_queue_length", "Requests waiting for the engine.", queue_length as f64);
        gauge(&mut out, "deltafin_running", "Generations running (0 or 1).", running as u8 as f64);
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
        let text = m.render(2, true);
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
}
