//! Free space on the drives, checked before anything is written.

use std::path::Path;

use crate::error::{Result, StorageError};

/// Free bytes available to us on the filesystem holding `path`.
pub fn free_space(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        StorageError::InvalidArgument(format!("{}: path has a NUL byte", path.display()))
    })?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value; c is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers for the call's duration.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(StorageError::io(
            path,
            "statvfs",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// One drive's space for a new layout: what it needs, what is free, and what replacing the old
/// layout in place would give back (its `data.bin`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DriveSpace {
    pub drive: usize,
    pub need: u64,
    pub free: u64,
    pub reclaim: u64,
}

/// What every drive needs for its share of `plan` (plus hashes, manifest and `keep_free`).
pub(crate) fn drive_space(
    dirs: &[std::path::PathBuf],
    placement: crate::stripe::Placement,
    plan: &crate::layout::plan::Plan,
    keep_free: u64,
) -> Result<Vec<DriveSpace>> {
    let units = placement.unit_count(plan.logical_len);
    let mut out = Vec::with_capacity(dirs.len());
    for (i, dir) in dirs.iter().enumerate() {
        let drive = dir.parent().unwrap_or(dir);
        let need = placement
            .drive_file_len(i, plan.logical_len)
            .saturating_add(units.saturating_mul(32))
            .saturating_add((plan.records.len() as u64).saturating_mul(400))
            .saturating_add(1 << 20)
            .saturating_add(keep_free);
        let reclaim = std::fs::metadata(dir.join(crate::manifest::DATA_FILE))
            .map(|m| m.len())
            .unwrap_or(0);
        out.push(DriveSpace {
            drive: i,
            need,
            free: free_space(drive)?,
            reclaim,
        });
    }
    Ok(out)
}

/// The first drive without room (counting the old layout's bytes as free when `reclaim`).
pub(crate) fn short_of_space(
    dirs: &[std::path::PathBuf],
    space: &[DriveSpace],
    reclaim: bool,
) -> Option<StorageError> {
    space.iter().find_map(|d| {
        let have = d.free.saturating_add(if reclaim { d.reclaim } else { 0 });
        (have < d.need).then(|| StorageError::InsufficientSpace {
            drive: d.drive,
            path: dirs[d.drive]
                .parent()
                .unwrap_or(&dirs[d.drive])
                .to_path_buf(),
            needed: d.need,
            available: have,
        })
    })
}

/// Reserve `len` bytes for `file` (drive `drive`) with `posix_fallocate`, so a full disk fails
/// before anything is written; filesystems without it are let through.
pub(crate) fn reserve(file: &std::fs::File, path: &Path, drive: usize, len: u64) -> Result<()> {
    let off = libc::off_t::try_from(len).map_err(|_| {
        StorageError::InvalidArgument(format!("{}: {len} bytes is too large", path.display()))
    })?;
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::posix_fallocate(std::os::unix::io::AsRawFd::as_raw_fd(file), 0, off) };
    if rc == libc::ENOSPC {
        return Err(StorageError::InsufficientSpace {
            drive,
            path: path.to_path_buf(),
            needed: len,
            available: path.parent().and_then(|p| free_space(p).ok()).unwrap_or(0),
        });
    }
    if rc != 0 && rc != libc::EOPNOTSUPP {
        return Err(StorageError::io(
            path,
            "fallocate",
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}
