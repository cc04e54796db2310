//! What machine this is, for benchmark reports: the processor's name, its cores (and
//! performance cores), its memory, the operating system's release, and a drive's size and free
//! space. Whatever a platform cannot tell is `None`.

use std::path::Path;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Machine {
    pub os: &'static str,
    pub arch: &'static str,
    pub cpu: Option<String>,
    pub cores: Option<usize>,
    /// Performance cores where the processor has two kinds (Apple Silicon).
    pub performance_cores: Option<usize>,
    pub ram_bytes: Option<u64>,
    pub kernel: Option<String>,
    pub page_bytes: usize,
}

pub fn describe() -> Machine {
    let mut m = Machine {
        os: std::env::consts::OS,
        arch: std::env::consts::ARCH,
        cores: std::thread::available_parallelism().map(|n| n.get()).ok(),
        page_bytes: super::memory::page_size(),
        ..Default::default()
    };
    #[cfg(target_os = "linux")]
    {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        m.cpu = read("/proc/cpuinfo").and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        });
        m.ram_bytes = read("/proc/meminfo").and_then(|t| {
            let kb = t.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse::<u64>().ok()?;
            Some(kb * 1024)
        });
        m.kernel = read("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string());
    }
    #[cfg(target_os = "macos")]
    {
        m.cpu = sysctl_string(c"machdep.cpu.brand_string");
        m.ram_bytes = sysctl_u64(c"hw.memsize");
        m.kernel = sysctl_string(c"kern.osrelease");
        m.performance_cores = sysctl_u64(c"hw.perflevel0.physicalcpu").map(|n| n as usize);
    }
    #[cfg(windows)]
    {
        use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};
        m.cpu = std::env::var("PROCESSOR_IDENTIFIER").ok();
        // SAFETY: a zeroed MEMORYSTATUSEX with its length set is what the call expects.
        let mut s: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
        s.dwLength = std::mem::size_of::<MEMORYSTATUSEX>() as u32;
        // SAFETY: `s` is a valid, initialised out-parameter.
        if unsafe { GlobalMemoryStatusEx(&mut s) } != 0 {
            m.ram_bytes = Some(s.ullTotalPhys);
        }
    }
    m
}

#[cfg(target_os = "macos")]
fn sysctl_u64(name: &std::ffi::CStr) -> Option<u64> {
    let mut buf = [0u8; 8];
    let mut len = buf.len();
    // SAFETY: `name` is NUL-terminated; the buffer holds `len` bytes.
    let ok = unsafe { libc::sysctlbyname(name.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) };
    match (ok, len) {
        (0, 4) => Some(u64::from(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]))),
        (0, 8) => Some(u64::from_ne_bytes(buf)),
        _ => None,
    }
}

#[cfg(target_os = "macos")]
fn sysctl_string(name: &std::ffi::CStr) -> Option<String> {
    let mut buf = [0u8; 256];
    let mut len = buf.len();
    // SAFETY: `name` is NUL-terminated; the buffer holds `len` bytes.
    let ok = unsafe { libc::sysctlbyname(name.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) };
    if ok != 0 {
        return None;
    }
    let s = buf.get(..len)?;
    Some(String::from_utf8_lossy(s).trim_end_matches('\0').trim().to_string())
}

/// The drive holding `path`: (device, size, free bytes) from POSIX `df -Pk` (Linux, macOS, the
/// BSDs; Git Bash on Windows).
pub fn storage(path: &Path) -> (Option<String>, Option<u64>, Option<u64>) {
    let out = std::process::Command::new("df").arg("-Pk").arg(path).output().ok();
    let text = out.and_then(|o| String::from_utf8(o.stdout).ok()).unwrap_or_default();
    parse_df(&text)
}

/// `df -Pk` output: a header, then `device 1024-blocks used available capacity mount`.
pub fn parse_df(text: &str) -> (Option<String>, Option<u64>, Option<u64>) {
    let Some(line) = text.lines().nth(1) else { return (None, None, None) };
    let f: Vec<&str> = line.split_whitespace().collect();
    let kib = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).map(|k| k * 1024);
    (f.first().map(|s| s.to_string()), kib(1), kib(3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn df_output_parses_and_this_machine_describes_itself() {
        let t = "Filesystem     1024-blocks      Used Available Capacity Mounted on\n/dev/disk3s5   971350180 500000000 471350180      52% /System/Volumes/Data\n";
        assert_eq!(parse_df(t), (Some("/dev/disk3s5".into()), Some(971_350_180 * 1024), Some(471_350_180 * 1024)));
        assert_eq!(parse_df(""), (None, None, None));
        let m = describe();
        assert!(m.cores.is_some_and(|c| c > 0) && m.page_bytes >= 4096);
        #[cfg(target_os = "linux")]
        assert!(m.ram_bytes.is_some_and(|r| r > 0) && m.kernel.is_some());
        let (_, size, free) = storage(Path::new("."));
        assert!(size >= free, "{size:?} {free:?}");
        #[cfg(unix)]
        assert!(size.is_some_and(|s| s > 0) && free.is_some(), "df -Pk told nothing: {size:?} {free:?}");
    }
}
