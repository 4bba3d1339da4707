//! Advisory locks on a layout name, one `DRIVE/.NAME.lock` file per drive (`flock`): writing or
//! repairing a layout holds them exclusively, reading it holds them shared. A second `layout`
//! of the same name, or a `layout --force` over a layout that a `generate` is reading, fails at
//! once instead of interleaving with it. The lock files stay behind (they are empty); the locks
//! go with the process.

use std::fs::{File, OpenOptions};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};

/// Held locks (released on drop, or when the process ends however it ends).
#[derive(Debug)]
pub struct LayoutLock {
    _files: Vec<File>,
}

/// Whether a lock is for writing (exclusive) or reading (shared).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    Exclusive,
    Shared,
}

/// The lock file of layout folder `dir` (`DRIVE/NAME` -> `DRIVE/.NAME.lock`).
pub fn lock_path(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    dir.parent().unwrap_or(dir).join(format!(".{name}.lock"))
}

impl LayoutLock {
    /// Lock the layout folders `dirs` (one per drive), without waiting. Exclusive locks must be
    /// had on every drive (a drive whose lock file cannot be created fails); shared locks are
    /// taken where possible (a read-only drive cannot hold a lock file, and reading it is
    /// still safe: nothing can write there either).
    pub fn acquire(dirs: &[PathBuf], kind: LockKind) -> Result<LayoutLock> {
        let mut files = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let path = lock_path(dir);
            let file = match OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
            {
                Ok(f) => f,
                Err(_) if kind == LockKind::Shared => continue,
                Err(e) => return Err(StorageError::io(&path, "create lock file", e)),
            };
            let op = match kind {
                LockKind::Exclusive => libc::LOCK_EX,
                LockKind::Shared => libc::LOCK_SH,
            };
            // SAFETY: plain syscall on a descriptor this function owns.
            let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(StorageError::LayoutBusy {
                        path: dir.clone(),
                        writing: kind == LockKind::Exclusive,
                    });
                }
                if kind == LockKind::Shared {
                    continue; // a filesystem without flock: reading stays safe
                }
                return Err(StorageError::io(&path, "flock", err));
            }
            files.push(file);
        }
        Ok(LayoutLock { _files: files })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_or_a_writer_over_readers_fails_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = vec![tmp.path().join("m")];
        let w = LayoutLock::acquire(&dirs, LockKind::Exclusive).unwrap();
        // flock locks belong to the open file description, so a second open in this process
        // conflicts like another process would.
        let e = LayoutLock::acquire(&dirs, LockKind::Exclusive).unwrap_err();
        assert!(matches!(e, StorageError::LayoutBusy { .. }), "{e}");
        assert!(LayoutLock::acquire(&dirs, LockKind::Shared).is_err());
        drop(w);
        let r1 = LayoutLock::acquire(&dirs, LockKind::Shared).unwrap();
        let _r2 = LayoutLock::acquire(&dirs, LockKind::Shared).unwrap();
        let e = LayoutLock::acquire(&dirs, LockKind::Exclusive).unwrap_err();
        assert!(e.to_string().contains("m"), "{e}");
        drop(r1);
        assert_eq!(lock_path(&dirs[0]), tmp.path().join(".m.lock"));
    }
}
