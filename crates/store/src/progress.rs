//! Progress of long work (a conversion, a download counted in bytes; a prompt counted in
//! tokens): a bar with rate and ETA on a terminal, plain periodic lines otherwise (logs, CI, a
//! pipe), nothing when quiet.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct Progress {
    label: Mutex<String>,
    total: u64,
    done: AtomicU64,
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    last_line: Mutex<Instant>,
    every: Duration,
    /// What is counted, when not bytes.
    unit: Option<&'static str>,
}

impl Progress {
    /// `quiet` shows nothing (tests of the library).
    pub fn new(label: &str, total: u64, quiet: bool) -> Self {
        Self::with_unit(label, total, None, quiet)
    }

    /// Progress counted in `unit`s (e.g. tokens) rather than bytes.
    pub fn counted(label: &str, total: u64, unit: &'static str, quiet: bool) -> Self {
        Self::with_unit(label, total, Some(unit), quiet)
    }

    fn with_unit(label: &str, total: u64, unit: Option<&'static str>, quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(total);
            let template = match unit {
                None => "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}".to_string(),
                Some(u) => format!("{{msg:>12}} [{{bar:40}}] {{pos}}/{{len}} {u} {{per_sec}} eta {{eta}}"),
            };
            b.set_style(
                indicatif::ProgressStyle::with_template(&template)
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b.set_message(label.to_string());
            b
        });
        let every = if quiet { Duration::MAX } else { Duration::from_secs(5) };
        Progress {
            label: Mutex::new(label.into()),
            total,
            done: AtomicU64::new(0),
            bar,
            started: Instant::now(),
            last_line: Mutex::new(Instant::now()),
            every,
            unit,
        }
    }

    /// What is being done now (the bar's label, the lines' prefix).
    pub fn set_message(&self, label: &str) {
        *self.label.lock().unwrap_or_else(|p| p.into_inner()) = label.to_string();
        if let Some(b) = &self.bar {
            b.set_message(label.to_string());
        }
    }

    pub fn inc(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        self.show(done);
    }

    /// Set how much is done (a count that is known rather than added up).
    pub fn set_position(&self, done: u64) {
        self.done.store(done, Ordering::Relaxed);
        self.show(done);
    }

    fn show(&self, done: u64) {
        if let Some(b) = &self.bar {
            b.set_position(done);
            return;
        }
        let mut last = self.last_line.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= self.every {
            *last = Instant::now();
            eprintln!("{}", self.line(done));
        }
    }

    fn line(&self, done: u64) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = done as f64 / secs;
        let eta = if rate > 0.0 { (self.total.saturating_sub(done)) as f64 / rate } else { f64::INFINITY };
        let amount = |n: u64| match self.unit {
            None => human(n),
            Some(u) => format!("{n} {u}"),
        };
        format!(
            "{}: {} of {} ({:.0}%), {}/s, eta {}",
            self.label.lock().unwrap_or_else(|p| p.into_inner()),
            amount(done),
            amount(self.total),
            100.0 * done as f64 / self.total.max(1) as f64,
            amount(rate as u64),
            if eta.is_finite() { format!("{eta:.0} s") } else { "?".into() }
        )
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    /// [`Self::finish`], under the name indicatif gives it.
    pub fn finish_and_clear(&self) {
        self.finish();
    }
}

/// Bytes for people: `1.23 GB`.
pub fn human(b: u64) -> String {
    let b = b as f64;
    for (unit, scale) in [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)] {
        if b >= scale {
            return format!("{:.2} {unit}", b / scale);
        }
    }
    format!("{b:.0} B")
}
