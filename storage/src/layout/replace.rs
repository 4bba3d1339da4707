//! Where a layout is written, and how it replaces an old one without losing it.
//!
//! A new layout is written into `DRIVE/.NAME.new-ID` on every drive and swapped in only when
//! complete: on each drive the old `NAME` is renamed to `.NAME.old-ID`, the new folder to `NAME`,
//! and only when every drive is swapped are the old folders removed. A failure before the swap
//! (no space, a read-only drive, a bad tensor, an interrupt) leaves the old layout untouched and
//! at most a `.NAME.new-*` folder, which the next run removes. A crash during the swap leaves
//! the old layout's folders as `.NAME.old-ID` (the mixed drives then fail to open with a
//! drive-id mismatch, naming the drive).
//!
//! When the drives cannot hold the old and the new layout at once, a forced replacement writes
//! in place, but only after every check has passed (space counting the old `data.bin` as free,
//! each drive writable): then the old manifests are removed first, so an interrupted
//! replacement never looks complete.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};
use crate::layout::space::{short_of_space, DriveSpace};
use crate::manifest::{sync_dir, MANIFEST_FILE};

/// Where this run writes, and what it must do when done.
#[derive(Debug)]
pub(crate) struct Target {
    /// `DRIVE/NAME`: where the layout will live (and what its manifest says).
    pub final_dirs: Vec<PathBuf>,
    /// Where the files are written now (the staging folders, or `final_dirs` in place).
    pub write_dirs: Vec<PathBuf>,
    /// Whether `write_dirs` are staging folders to swap in.
    pub staged: bool,
    id: String,
}

fn staging_dir(dir: &Path, id: &str, kind: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    dir.parent()
        .unwrap_or(dir)
        .join(format!(".{name}.{kind}-{id}"))
}

/// Remove `.NAME.new-*` folders left by interrupted runs (the caller holds the layout lock,
/// so no other run is writing them).
pub(crate) fn remove_stale_staging(final_dirs: &[PathBuf]) -> Result<()> {
    for dir in final_dirs {
        let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
            continue;
        };
        let prefix = format!(".{}.new-", name.to_string_lossy());
        let Ok(rd) = fs::read_dir(parent) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let p = e.path();
                fs::remove_dir_all(&p).map_err(|err| {
                    StorageError::io(&p, "remove an interrupted layout's folder", err)
                })?;
            }
        }
    }
    Ok(())
}

/// Whether a layout (complete or not) exists at `dir`.
fn occupied(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).exists() || dir.join(crate::manifest::DATA_FILE).exists()
}

/// Decide where to write. Refuses an existing layout unless `force`; checks space and that
/// every drive is writable before anything existing is touched.
pub(crate) fn prepare(
    final_dirs: Vec<PathBuf>,
    force: bool,
    space: &[DriveSpace],
    id: &str,
) -> Result<Target> {
    // A complete layout (a manifest) needs --force; the files of an interrupted run do not.
    if let Some(dir) = final_dirs.iter().find(|d| d.join(MANIFEST_FILE).exists()) {
        if !force {
            return Err(StorageError::LayoutExists { path: dir.clone() });
        }
    }
    let existing = final_dirs.iter().any(|d| occupied(d));
    // Beside the old layout when every drive can hold both (always, without an old layout).
    let staged = short_of_space(&final_dirs, space, false).is_none();
    if !staged {
        if let Some(e) = short_of_space(&final_dirs, space, existing) {
            return Err(e);
        }
    }
    let write_dirs: Vec<PathBuf> = if staged {
        final_dirs
            .iter()
            .map(|d| staging_dir(d, id, "new"))
            .collect()
    } else {
        final_dirs.clone()
    };
    // Every drive writable, before anything is removed.
    for (i, dir) in write_dirs.iter().enumerate() {
        fs::create_dir_all(dir).map_err(|e| StorageError::MissingDrive {
            drive: i,
            path: dir.clone(),
            reason: format!("cannot create the layout folder: {e}"),
        })?;
        let probe = dir.join(format!(".probe-{id}"));
        fs::write(&probe, b"")
            .and_then(|()| fs::remove_file(&probe))
            .map_err(|e| StorageError::MissingDrive {
                drive: i,
                path: dir.clone(),
                reason: format!("not writable: {e}"),
            })?;
    }
    if !staged {
        // In place: every check has passed; now make the old layout look incomplete first.
        for dir in &final_dirs {
            let m = dir.join(MANIFEST_FILE);
            if m.exists() {
                fs::remove_file(&m).map_err(|e| StorageError::io(&m, "remove old manifest", e))?;
                sync_dir(dir)?;
            }
        }
    }
    Ok(Target {
        final_dirs,
        write_dirs,
        staged,
        id: id.to_string(),
    })
}

impl Target {
    /// Swap the finished staging folders in (no-op when written in place), then remove the
    /// old layout's folders.
    pub(crate) fn commit(&self) -> Result<()> {
        if !self.staged {
            return Ok(());
        }
        let mut olds = Vec::new();
        for (new, fin) in self.write_dirs.iter().zip(&self.final_dirs) {
            if fin.exists() {
                let old = staging_dir(fin, &self.id, "old");
                fs::rename(fin, &old)
                    .map_err(|e| StorageError::io(fin, "move the old layout aside", e))?;
                olds.push(old);
            }
            fs::rename(new, fin).map_err(|e| StorageError::io(new, "swap the new layout in", e))?;
            sync_dir(fin.parent().unwrap_or(fin))?;
        }
        for old in olds {
            fs::remove_dir_all(&old)
                .map_err(|e| StorageError::io(&old, "remove the old layout", e))?;
        }
        Ok(())
    }

    /// After a failure: remove the staging folders (the old layout was never touched).
    pub(crate) fn abandon(&self) {
        if self.staged {
            for d in &self.write_dirs {
                let _ = fs::remove_dir_all(d);
            }
        }
    }
}
