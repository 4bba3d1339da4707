//! This process's memory: resident set and peak (Linux `/proc/self/status`), memory available
//! on the machine, and allocator tuning so that peak RSS tracks what is live.

/// Keep large allocations out of the heap arenas so freed memory goes back to the system and
/// peak RSS tracks what is live (glibc otherwise raises the mmap threshold dynamically, up to
/// 32 MiB), with at most a few MiB of slack per arena: buffers from 4 MiB up are mapped and
/// unmapped with each allocation, and an arena's free top is returned past 8 MiB. Lower
/// values cost prefill dearly: at 256 KiB a 32-token chunk's activations (each a few hundred
/// KiB) were mapped, faulted in, zeroed and unmapped in every layer, 29% of its time
/// (benches/results/vs_llamacpp*.json, INT4 prefill 200 -> 279 tokens/s).
///
/// With `bounded` (a process held to a RAM budget: one reading a layout), also one arena for
/// every thread: a block freed on one thread (an expert buffer under 4 MiB landed by an I/O
/// thread, dropped by the forward pass) went back to that thread's arena, where the others
/// could not reuse it. An INT4 decode at a 745 MB `--ram-budget` grew to 746-751 MB resident
/// over its first 40 tokens (622 MB with one arena, 691 MB with two), and a cgroup limit at
/// the budget killed it. Not for every process: in RAM the one arena's lock cost ~3% of Q8
/// decode tokens/s (62.2 / 61.8 / 59.7 vs 64.9 / 63.2 / 62.0, alternated). Call before the
/// process starts its threads.
pub fn tame_allocator(bounded: bool) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; it is thread-safe in glibc.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 8 << 20);
        if bounded {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = bounded;
}

/// A field of /proc/self/status in bytes (`VmRSS`, `VmHWM`).
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())?;
    kb.checked_mul(1024)
}

/// Resident set size now.
pub fn rss_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS")
}

/// Peak resident set size so far.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM")
}

/// Memory available now (`MemAvailable`: free plus reclaimable page cache).
pub fn available_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb.saturating_mul(1024))
}

/// Half of the memory available at start (`MemAvailable`), or 4 GiB if unknown.
pub fn default_ram_budget() -> u64 {
    available_bytes().map(|b| b / 2).unwrap_or(4 << 30)
}
