//! Opening a layout for reading from any drive's copy: find the other drives and check that
//! each holds this layout's copy, whole.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};
use crate::layout::agree::{check_agrees, explain_tampered};
use crate::manifest::{Manifest, DATA_FILE, MANIFEST_FILE};
use crate::stripe::Mode;

/// Open a layout from any drive's manifest (file or folder): load it, find every other drive,
/// and check that each holds this layout's copy. Returns the manifest and the drive folders.
pub fn open_layout(path: &Path) -> Result<(Manifest, Vec<PathBuf>)> {
    let (manifest, dirs, mut unavailable) = open_layout_degraded(path)?;
    match unavailable.is_empty() {
        true => Ok((manifest, dirs)),
        false => Err(unavailable.swap_remove(0).1),
    }
}

/// [`open_layout`], except that a replicated layout with some drives missing, foreign or
/// truncated still opens from the drives that are fine: their problems come back as the third
/// value (drive index and the error naming its path); pass the indices as
/// [`crate::engine::EngineConfig::unavailable_drives`] so that the engine reads every record
/// from the remaining copies and nothing from a foreign or truncated one. A striped layout
/// needs every drive, so any problem is an error, as is a replicated one with no usable drive.
#[allow(clippy::type_complexity)]
pub fn open_layout_degraded(
    path: &Path,
) -> Result<(Manifest, Vec<PathBuf>, Vec<(usize, StorageError)>)> {
    let here = crate::manifest::manifest_path(path);
    let manifest = match Manifest::load(path) {
        Ok(m) => m,
        Err(e @ StorageError::ManifestTampered { .. }) => {
            return Err(explain_with_siblings(e, &here))
        }
        Err(e) => return Err(e),
    };
    let here_dir = here.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut dirs = Vec::new();
    let mut unavailable = Vec::new();
    for d in &manifest.drives {
        // The drive we were pointed at is where we found it, even if mounted elsewhere now.
        let dir = if d.index == manifest.this_drive {
            here_dir.clone()
        } else {
            d.path.clone()
        };
        match check_drive(&manifest, d, &dir) {
            Ok(()) => {}
            // Copies that disagree cannot be told apart: never guess.
            Err(e @ StorageError::ManifestDisagrees { .. }) => return Err(e),
            Err(e) => {
                if manifest.mode != Mode::Replicate || manifest.drives.len() < 2 {
                    return Err(e);
                }
                unavailable.push((d.index, e));
            }
        }
        dirs.push(dir);
    }
    if unavailable.len() == manifest.drives.len() {
        return Err(unavailable.swap_remove(0).1);
    }
    Ok((manifest, dirs, unavailable))
}

/// Whether `dir` holds drive `d`'s copy of `manifest`'s layout, whole.
fn check_drive(manifest: &Manifest, d: &crate::manifest::DriveEntry, dir: &Path) -> Result<()> {
    if d.index == manifest.this_drive {
        // The copy we opened from; its data file is checked below.
        return check_data_file(d, dir);
    }
    let m = dir.join(MANIFEST_FILE);
    let other = Manifest::load(&m).map_err(|e| {
        let e = match e {
            StorageError::ManifestTampered { .. } => match fs::read(&m) {
                Ok(bytes) => explain_tampered(e, &bytes, manifest),
                Err(_) => e,
            },
            e => e,
        };
        StorageError::MissingDrive {
            drive: d.index,
            path: dir.to_path_buf(),
            reason: e.to_string(),
        }
    })?;
    if other.layout_id != manifest.layout_id || other.this_drive != d.index {
        return Err(StorageError::DriveMismatch {
            drive: d.index,
            path: dir.to_path_buf(),
            expected: format!("layout {} drive {}", manifest.layout_id, d.index),
            found: format!("layout {} drive {}", other.layout_id, other.this_drive),
        });
    }
    check_agrees(manifest, &other, d.index, &m)?;
    check_data_file(d, dir)
}

/// The drive's data file is there and long enough.
fn check_data_file(d: &crate::manifest::DriveEntry, dir: &Path) -> Result<()> {
    let data = dir.join(DATA_FILE);
    let len = fs::metadata(&data)
        .map_err(|e| StorageError::MissingDrive {
            drive: d.index,
            path: data.clone(),
            reason: e.to_string(),
        })?
        .len();
    if len < d.data_len {
        return Err(StorageError::ShortRead {
            drive: d.index,
            path: data,
            offset: len,
            len: d.data_len,
            got: len,
        });
    }
    Ok(())
}

/// The copy at `here` failed its content hash: compare it with the first sibling copy that is
/// good (found through the bad copy's own drive list) to name what was changed.
fn explain_with_siblings(err: StorageError, here: &Path) -> StorageError {
    let Ok(bytes) = fs::read(here) else {
        return err;
    };
    let Ok(bad) = Manifest::from_bytes_unauthenticated(here, &bytes) else {
        return err;
    };
    for d in &bad.drives {
        if d.index == bad.this_drive {
            continue;
        }
        if let Ok(good) = Manifest::load(&d.path.join(MANIFEST_FILE)) {
            return explain_tampered(err, &bytes, &good);
        }
    }
    err
}
