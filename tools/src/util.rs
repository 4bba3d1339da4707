//! Small helpers shared by the subcommands.

/// Parse sizes like `512K`, `1M`, `4GiB`, `1000`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a size"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    Ok((n * mult as f64) as u64)
}

/// Parse a duration in seconds: a finite number above 0 and at most a week.
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v.is_finite() && v > 0.0 && v <= 7.0 * 86400.0) {
        return Err(format!(
            "`{s}`: give a number of seconds above 0 and at most 604800 (a week)"
        ));
    }
    Ok(v)
}

/// An output file may be created or replaced only if it is (or will be) a regular file: never
/// a device node, FIFO, socket or directory.
pub fn check_output_file(path: &std::path::Path, what: &str) -> anyhow::Result<()> {
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            anyhow::bail!(
                "{what} {}: exists and is not a regular file; refusing to replace it",
                path.display()
            );
        }
    }
    Ok(())
}

/// Write `bytes` to `path` atomically (a temporary file beside it, then a rename), only if
/// `path` is or will be a regular file.
pub fn write_regular_file(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context;
    check_output_file(path, "output")?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Read a regular file of at most `cap` bytes.
pub fn read_capped(path: &std::path::Path, cap: u64) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        anyhow::bail!("{} is not a regular file", path.display());
    }
    if meta.len() > cap {
        anyhow::bail!(
            "{} is {} bytes; at most {cap} are read",
            path.display(),
            meta.len()
        );
    }
    let mut out = Vec::new();
    std::fs::File::open(path)?.take(cap).read_to_end(&mut out)?;
    Ok(out)
}

pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// Per-drive counters as report JSON.
pub fn drive_stats_json(drives: &[deltafin_storage::engine::DriveStats]) -> serde_json::Value {
    drives
        .iter()
        .enumerate()
        .map(|(i, d)| {
            serde_json::json!({
                "drive": i,
                "bytes_read": d.bytes_read,
                "reads": d.reads,
                "busy_s": d.busy.as_secs_f64(),
                "direct_io": d.direct_io,
                "read_errors": d.read_errors,
            })
        })
        .collect::<Vec<_>>()
        .into()
}

/// Facts about this machine for reports.
pub fn machine() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.to_string()))
        .unwrap_or_default();
    serde_json::json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "mem": mem,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("3 parsecs").is_err());
    }
}
