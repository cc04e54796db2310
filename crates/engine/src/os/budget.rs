//! How much memory this process may still use, as each operating system tells it. The plan
//! takes its default budget from here (a share of it; see `plan::budget_from`).
//!
//! - Linux: MemAvailable of /proc/meminfo, and the tightest limit of the process' control group
//!   and its ancestors (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`): MemAvailable alone
//!   ignores a container's limit, and a plan sized to the host gets the container OOM-killed.
//! - macOS: the free, inactive and purgeable pages of the VM statistics (`host_statistics64`)
//!   at the system's page size (16 KiB on Apple Silicon), less a reserve for the rest of the
//!   system: memory there is unified, so the window server and the GPU draw on the same pool,
//!   and macOS compresses and swaps rather than refusing, which turns an over-full plan into a
//!   slow one instead of a failed one. The reserve is [`UNIFIED_RESERVE_PERCENT`] of `hw.memsize`,
//!   at least [`UNIFIED_RESERVE_MIN`].
//! - Windows: the available physical memory of `GlobalMemoryStatusEx`.
//!
//! The parsers of the Linux files are plain functions of text, tested on every platform.

/// What the system says this process may use: the host's free memory with a label naming
/// where it came from, and a control group's limit (Linux only).
#[derive(Debug, Clone, Default)]
pub struct FreeMemory {
    pub host: Option<(u64, String)>,
    pub cgroup: Option<CgroupMemory>,
}

/// The part of a Mac's memory the default budget leaves to the rest of the system.
pub const UNIFIED_RESERVE_PERCENT: u64 = 10;
/// ... and at least this much.
pub const UNIFIED_RESERVE_MIN: u64 = 4 << 30;

/// Free memory now, as this platform reports it.
pub fn free_memory() -> FreeMemory {
    #[cfg(target_os = "linux")]
    {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let host = read("/proc/meminfo").as_deref().and_then(mem_available).map(|b| (b, "MemAvailable".to_string()));
        let cgroup = read("/proc/self/cgroup").and_then(|t| cgroup_memory(&t, &read));
        FreeMemory { host, cgroup }
    }
    #[cfg(target_os = "macos")]
    {
        FreeMemory { host: macos::free().map(|(free, total)| unified_share(free, total)), cgroup: None }
    }
    #[cfg(windows)]
    {
        FreeMemory { host: windows::available().map(|b| (b, "available physical memory".to_string())), cgroup: None }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
    {
        FreeMemory::default()
    }
}

/// A Mac's free memory less the reserve for the system and the GPU, labelled.
pub fn unified_share(free: u64, total: u64) -> (u64, String) {
    let reserve = (total / 100 * UNIFIED_RESERVE_PERCENT).max(UNIFIED_RESERVE_MIN);
    (
        free.saturating_sub(reserve),
        format!(
            "free, inactive and purgeable memory ({}) less {} left to the system and GPU of unified memory",
            crate::units::human(free),
            crate::units::human(reserve)
        ),
    )
}

#[cfg(target_os = "macos")]
mod macos {
    /// (free + inactive + purgeable bytes, hw.memsize).
    pub fn free() -> Option<(u64, u64)> {
        let mut total: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: the name is NUL-terminated; `total` is a u64 of `len` bytes, as hw.memsize is.
        let ok = unsafe {
            libc::sysctlbyname(c"hw.memsize".as_ptr(), (&raw mut total).cast(), &mut len, std::ptr::null_mut(), 0)
        };
        if ok != 0 {
            return None;
        }
        // SAFETY: a zeroed vm_statistics64 is a valid out-parameter; `count` is its size in
        // integers, as host_statistics64 expects.
        let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
        let mut count = (std::mem::size_of::<libc::vm_statistics64>() / std::mem::size_of::<libc::integer_t>())
            as libc::mach_msg_type_number_t;
        // SAFETY: mach_host_self has no preconditions; the buffer and count are as above.
        #[allow(deprecated)]
        let kr = unsafe {
            libc::host_statistics64(libc::mach_host_self(), libc::HOST_VM_INFO64, (&raw mut stats).cast(), &mut count)
        };
        if kr != libc::KERN_SUCCESS {
            return None;
        }
        // SAFETY: sysconf has no preconditions.
        let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        let pages = u64::from(stats.free_count) + u64::from(stats.inactive_count) + u64::from(stats.purgeable_count);
        Some((pages * page, total))
    }
}

#[cfg(windows)]
mod windows {
    use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};

    pub fn available() -> Option<u64> {
        // SAFETY: a zeroed MEMORYSTATUSEX with its length set is what the call expects.
        let mut m: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
        m.dwLength = std::mem::size_of::<MEMORYSTATUSEX>() as u32;
        // SAFETY: `m` is a valid, initialised out-parameter.
        (unsafe { GlobalMemoryStatusEx(&mut m) } != 0).then_some(m.ullAvailPhys)
    }
}

/// MemAvailable of /proc/meminfo, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb.saturating_mul(1024))
}

/// The memory limit that binds this process' control group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMemory {
    /// 1 or 2.
    pub version: u8,
    /// The group (as /proc/self/cgroup names it, or an ancestor) whose limit binds.
    pub group: String,
    pub limit: u64,
    /// Memory charged to that group that the kernel cannot simply drop: `memory.current` (v2)
    /// or `memory.usage_in_bytes` (v1) less the inactive page cache of its `memory.stat`.
    /// Unknown when the usage file is unreadable.
    pub in_use: Option<u64>,
}

impl CgroupMemory {
    /// What may still be charged before the kernel reclaims hard or OOM-kills.
    pub fn headroom(&self) -> u64 {
        self.limit.saturating_sub(self.in_use.unwrap_or(0))
    }

    pub fn limit_file(&self) -> &'static str {
        if self.version == 2 { "memory.max" } else { "memory.limit_in_bytes" }
    }
}

/// The cgroup paths in /proc/self/cgroup: the v2 (unified) one, and v1's memory controller's.
/// Lines are `ID:CONTROLLERS:PATH`; v2's has ID 0 and no controllers.
pub fn cgroup_paths(proc_self_cgroup: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    (v2, v1)
}

/// A limit file's value: v2's `max` and v1's "unlimited" (a page-rounded i64::MAX, anything at
/// or above 2^62 here) mean no limit.
pub fn parse_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    t.parse::<u64>().ok().filter(|&v| v < 1 << 62)
}

/// A `key value` line of a `memory.stat` file.
pub fn stat_field(memory_stat: &str, key: &str) -> Option<u64> {
    memory_stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The group, then each ancestor up to the root: a limit set on any of them binds this process.
fn ancestors(path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut p = path.trim_end_matches('/').to_string();
    while !p.is_empty() {
        out.push(p.clone());
        match p.rfind('/') {
            Some(i) => p.truncate(i),
            None => break,
        }
    }
    out.push("/".into());
    out
}

/// The binding memory limit of this process' control group, read through `read` (a path to
/// its contents; `None` when the file is missing). Each group from ours up to the root of the
/// mount is looked at, because a container's limit is often set on a parent; where the mount
/// shows only the container's own group (Docker without a cgroup namespace), the path of
/// /proc/self/cgroup does not exist under it and the mount's root holds the limit. The group
/// with the least headroom wins. v2 is preferred when the process has both.
pub fn cgroup_memory(proc_self_cgroup: &str, read: &dyn Fn(&str) -> Option<String>) -> Option<CgroupMemory> {
    let (v2, v1) = cgroup_paths(proc_self_cgroup);
    let v2_found = v2.and_then(|path| {
        ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"].iter().find_map(|mount| {
            tightest(&path, |g| {
                let dir = join(mount, g);
                let limit = parse_limit(&read(&format!("{dir}/memory.max"))?)?;
                let usage = read(&format!("{dir}/memory.current")).and_then(|t| t.trim().parse::<u64>().ok());
                let inactive = read(&format!("{dir}/memory.stat")).and_then(|t| stat_field(&t, "inactive_file"));
                Some(CgroupMemory { version: 2, group: g.to_string(), limit, in_use: working_set(usage, inactive) })
            })
        })
    });
    v2_found.or_else(|| {
        let path = v1?;
        tightest(&path, |g| {
            let dir = join("/sys/fs/cgroup/memory", g);
            let limit = parse_limit(&read(&format!("{dir}/memory.limit_in_bytes"))?)?;
            let usage = read(&format!("{dir}/memory.usage_in_bytes")).and_then(|t| t.trim().parse::<u64>().ok());
            // v1's usage counts the whole subtree, so its cache figure must too.
            let inactive = read(&format!("{dir}/memory.stat")).and_then(|t| stat_field(&t, "total_inactive_file"));
            Some(CgroupMemory { version: 1, group: g.to_string(), limit, in_use: working_set(usage, inactive) })
        })
    })
}

/// The group of `path` or its ancestors with a limit and the least headroom.
fn tightest(path: &str, limit_of: impl Fn(&str) -> Option<CgroupMemory>) -> Option<CgroupMemory> {
    ancestors(path).iter().filter_map(|g| limit_of(g)).min_by_key(CgroupMemory::headroom)
}

fn join(mount: &str, group: &str) -> String {
    format!("{mount}{}", if group == "/" { "" } else { group })
}

/// Usage less the inactive page cache, which the kernel reclaims before it OOM-kills (the
/// figure `docker stats` and the kubelet use). Without the stat, all of the usage counts: too
/// cautious is better than killed.
fn working_set(usage: Option<u64>, inactive_file: Option<u64>) -> Option<u64> {
    usage.map(|u| u.saturating_sub(inactive_file.unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file system of the given files, for [`cgroup_memory`].
    fn fs(files: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let files: std::collections::HashMap<String, String> =
            files.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect();
        move |p: &str| files.get(p).cloned()
    }

    const GIB: u64 = 1 << 30;
    const V1_UNLIMITED: &str = "9223372036854771712\n";

    #[test]
    fn cgroup_limit_files_parse() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("4294967296\n"), Some(4 * GIB));
        assert_eq!(parse_limit(V1_UNLIMITED), None);
        assert_eq!(parse_limit("536870912"), Some(512 << 20));
        assert_eq!(parse_limit(""), None);
        assert_eq!(parse_limit("lots"), None);
        assert_eq!(stat_field("anon 5\ninactive_file 4096\nactive_file 7\n", "inactive_file"), Some(4096));
        assert_eq!(stat_field("total_inactive_file 9\ninactive_file 3\n", "inactive_file"), Some(3));
        assert_eq!(stat_field("anon 5\n", "inactive_file"), None);
        assert_eq!(mem_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n"), Some(2 << 20));
        assert_eq!(mem_available("MemTotal: 100 kB\n"), None);
    }

    #[test]
    fn proc_self_cgroup_paths() {
        // Pure v2.
        assert_eq!(
            cgroup_paths("0::/system.slice/deltafin.service\n"),
            (Some("/system.slice/deltafin.service".into()), None)
        );
        // v1 (hybrid: the v2 line is there too, without a memory controller).
        let hybrid = "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n";
        assert_eq!(cgroup_paths(hybrid), (Some("/docker/abc".into()), Some("/docker/abc".into())));
        // Junk lines are skipped.
        assert_eq!(cgroup_paths("garbage\n4:memory:/a\n"), (None, Some("/a".into())));
        assert_eq!(cgroup_paths(""), (None, None));
    }

    #[test]
    fn cgroup_v2_limits() {
        let cg = "0::/kubepods/pod1/c1\n";
        // A number on the group: the headroom is the limit less usage net of inactive page cache.
        let read = fs(&[
            ("/sys/fs/cgroup/kubepods/pod1/c1/memory.max", "8589934592\n"),
            ("/sys/fs/cgroup/kubepods/pod1/c1/memory.current", "3221225472\n"),
            ("/sys/fs/cgroup/kubepods/pod1/c1/memory.stat", "anon 1073741824\ninactive_file 2147483648\n"),
        ]);
        let m = cgroup_memory(cg, &read).unwrap();
        assert_eq!((m.version, m.group.as_str(), m.limit, m.in_use), (2, "/kubepods/pod1/c1", 8 * GIB, Some(GIB)));
        assert_eq!(m.headroom(), 7 * GIB);
        // `max` on the group, a number on an ancestor: the ancestor binds.
        let read = fs(&[
            ("/sys/fs/cgroup/kubepods/pod1/c1/memory.max", "max\n"),
            ("/sys/fs/cgroup/kubepods/pod1/memory.max", "4294967296\n"),
            ("/sys/fs/cgroup/kubepods/memory.max", "max\n"),
        ]);
        let m = cgroup_memory(cg, &read).unwrap();
        assert_eq!((m.group.as_str(), m.limit, m.in_use), ("/kubepods/pod1", 4 * GIB, None));
        // `max` all the way up: no limit.
        let read = fs(&[
            ("/sys/fs/cgroup/kubepods/pod1/c1/memory.max", "max\n"),
            ("/sys/fs/cgroup/kubepods/pod1/memory.max", "max\n"),
        ]);
        assert_eq!(cgroup_memory(cg, &read), None);
        // A cgroup namespace: the process' group is the mount's root.
        let read = fs(&[("/sys/fs/cgroup/memory.max", "2147483648\n"), ("/sys/fs/cgroup/memory.current", "0\n")]);
        assert_eq!(cgroup_memory("0::/\n", &read).unwrap().headroom(), 2 * GIB);
    }

    #[test]
    fn cgroup_v1_limits() {
        let cg = "11:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n0::/\n";
        // The "unlimited" huge number is no limit.
        let read = fs(&[
            ("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", V1_UNLIMITED),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", V1_UNLIMITED),
        ]);
        assert_eq!(cgroup_memory(cg, &read), None);
        // A number: usage less the subtree's inactive page cache.
        let read = fs(&[
            ("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "2147483648\n"),
            ("/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "1610612736\n"),
            ("/sys/fs/cgroup/memory/docker/abc/memory.stat", "inactive_file 1\ntotal_inactive_file 536870912\n"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", V1_UNLIMITED),
        ]);
        let m = cgroup_memory(cg, &read).unwrap();
        assert_eq!((m.version, m.limit, m.in_use), (1, 2 * GIB, Some(GIB)));
        assert_eq!(m.headroom(), GIB);
        // Docker without a cgroup namespace: /docker/abc is not under the mount, whose root is
        // the container's own group.
        let read = fs(&[
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n"),
            ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "0\n"),
        ]);
        let m = cgroup_memory(cg, &read).unwrap();
        assert_eq!((m.group.as_str(), m.headroom()), ("/", GIB));
        // v2 is preferred when both have a limit.
        let read = fs(&[
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n"),
            ("/sys/fs/cgroup/unified/memory.max", "3221225472\n"),
        ]);
        assert_eq!(cgroup_memory(cg, &read).unwrap().version, 2);
    }

    #[test]
    fn missing_cgroup_files_mean_no_limit() {
        let read = fs(&[]);
        assert_eq!(cgroup_memory("0::/user.slice\n", &read), None);
        assert_eq!(cgroup_memory("9:memory:/user.slice\n", &read), None);
        assert_eq!(cgroup_memory("", &read), None);
    }

    /// A Mac leaves a tenth of its memory, at least 4 GiB, to the system and the GPU.
    #[test]
    fn unified_memory_leaves_a_reserve() {
        assert_eq!(unified_share(40 * GIB, 64 * GIB).0, 40 * GIB - 64 * GIB / 100 * 10);
        assert_eq!(unified_share(10 * GIB, 16 * GIB).0, 6 * GIB);
        assert_eq!(unified_share(3 * GIB, 16 * GIB).0, 0);
        assert!(unified_share(10 * GIB, 16 * GIB).1.contains("4.00 GiB left to the system and GPU"));
    }
}
