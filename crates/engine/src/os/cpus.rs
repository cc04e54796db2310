//! How many threads compute by default: every performance core. On Apple Silicon the
//! efficiency cores run the same kernels at a fraction of the speed, and a computation split
//! evenly waits for its slowest share, so they are left out (`hw.perflevel0.physicalcpu`);
//! elsewhere every core the process may use (`available_parallelism`).

static CHOSEN: std::sync::OnceLock<(usize, &'static str)> = std::sync::OnceLock::new();

/// Start the compute pool: `given` threads (`--threads`), or [`default_threads`]. Call once,
/// before any computation.
pub fn start(given: Option<usize>) -> Result<(usize, &'static str), String> {
    let (n, why) = match given {
        Some(0) => return Err("must be at least 1".into()),
        Some(n) => (n, "--threads"),
        None => default_threads(),
    };
    deltafin_kernels::par::init_threads(n)?;
    let _ = CHOSEN.set((n, why));
    Ok((n, why))
}

/// The compute threads in use and how they were chosen, for the plan's report.
pub fn report() -> String {
    let (n, why) = CHOSEN.get().copied().unwrap_or((deltafin_kernels::par::threads(), "the pool's default"));
    format!("compute          {n} threads ({why}); pages of {} KiB", super::memory::page_size() / 1024)
}

/// The default thread count, and how it was chosen (for the plan's report).
pub fn default_threads() -> (usize, &'static str) {
    #[cfg(target_os = "macos")]
    if let Some(n) = perf_cores() {
        return (n, "performance cores (hw.perflevel0.physicalcpu)");
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (n, "cores available to this process")
}

#[cfg(target_os = "macos")]
fn perf_cores() -> Option<usize> {
    let mut n: i32 = 0;
    let mut len = std::mem::size_of::<i32>();
    // SAFETY: the name is NUL-terminated; `n` is an i32 of `len` bytes, as the value is.
    let ok = unsafe {
        libc::sysctlbyname(
            c"hw.perflevel0.physicalcpu".as_ptr(),
            (&raw mut n).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (ok == 0 && n > 0).then_some(n as usize)
}
