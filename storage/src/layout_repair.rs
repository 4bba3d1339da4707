//! `deltafin verify --repair`: make every drive of a layout whole again from good copies, as
//! `zpool scrub` or an md resync would.
//!
//! Under the layout's exclusive lock (no reader or writer at the same time):
//! 1. manifests: the copy the repair was pointed at must be good (its content hash matches);
//!    every other drive's copy that is missing, fails its content hash, or disagrees with it
//!    while the good copy has the majority is rewritten from it;
//! 2. `units.blake3`: rewritten on every drive where it is missing or does not match the
//!    manifest;
//! 3. `data.bin`: recreated (zero-filled, so every unit then fails its hash) where missing,
//!    extended where short;
//! 4. every stripe unit of every copy is read and hashed (one thread per drive); in a
//!    replicated layout each bad unit is rewritten from a drive whose copy of it is good, then
//!    read back and hashed. A striped layout has no second copy of its data: its bad units are
//!    reported as unrepairable (manifests and unit hashes, which every drive holds, are still
//!    repaired).

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Result, StorageError};
use crate::layout::Progress;
use crate::lock::{LayoutLock, LockKind};
use crate::manifest::{write_atomic, Manifest, DATA_FILE, MANIFEST_FILE, UNIT_HASHES_FILE};
use crate::stripe::Mode;
use crate::verify::load_unit_hashes;

/// What a repair did.
#[derive(Clone, Debug, Default)]
pub struct RepairReport {
    /// Drives whose manifest copy was rewritten.
    pub manifests_rewritten: Vec<usize>,
    /// Drives whose `units.blake3` was rewritten.
    pub unit_files_rewritten: Vec<usize>,
    /// Drives whose `data.bin` was recreated or extended.
    pub data_files_fixed: Vec<usize>,
    /// (drive, unit, from drive) of every unit rewritten and checked.
    pub units_repaired: Vec<(usize, u64, usize)>,
    /// What could not be repaired, each naming drive, file, offset.
    pub unrepairable: Vec<String>,
    pub units_checked: u64,
    pub elapsed: Duration,
}

/// Repair the layout whose good manifest copy is at `path` (see the module docs).
pub fn repair_layout(path: &Path, progress: &dyn Progress) -> Result<RepairReport> {
    let started = Instant::now();
    let here_file = crate::manifest::manifest_path(path);
    let here = Manifest::load(&here_file)?;
    let here_dir = here_file
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let dirs: Vec<PathBuf> = here
        .drives
        .iter()
        .map(|d| {
            if d.index == here.this_drive {
                here_dir.clone()
            } else {
                d.path.clone()
            }
        })
        .collect();
    let _lock = LayoutLock::acquire(&dirs, LockKind::Exclusive)?;
    let mut report = RepairReport::default();

    repair_manifests(&here, &dirs, &mut report)?;
    let unit_bytes = repair_unit_files(&here, &dirs, &mut report)?;
    let unit_hashes: Vec<[u8; 32]> = unit_bytes
        .chunks_exact(32)
        .map(|c| c.try_into().unwrap_or([0; 32]))
        .collect();
    let files = repair_data_files(&here, &dirs, &mut report)?;

    // Scan every copy, one thread per drive.
    let placement = here.placement();
    let nunits = placement.unit_count(here.logical_len);
    let total: u64 = match here.mode {
        Mode::Replicate => here.logical_len * dirs.len() as u64,
        Mode::Stripe => here.logical_len,
    };
    progress.start(total, "scrubbing");
    let unit_len = |u: u64| placement.unit.min(here.logical_len - u * placement.unit);
    let location = |d: usize, u: u64| match here.mode {
        Mode::Replicate => Some(u * placement.unit),
        Mode::Stripe => {
            let (owner, off) = placement.unit_location(u);
            (owner == d).then_some(off)
        }
    };
    let bad: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(d, f)| {
                let (unit_hashes, location, unit_len) = (&unit_hashes, &location, &unit_len);
                s.spawn(move || {
                    let mut bad = Vec::new();
                    let mut buf = vec![0u8; placement.unit as usize];
                    for u in 0..nunits {
                        let Some(off) = location(d, u) else { continue };
                        let len = unit_len(u) as usize;
                        let ok = f.read_exact_at(&mut buf[..len], off).is_ok()
                            && blake3::hash(&buf[..len]).as_bytes() == &unit_hashes[u as usize];
                        if !ok {
                            bad.push(u);
                        }
                        progress.advance(len as u64);
                    }
                    bad
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    progress.finish();
    report.units_checked = match here.mode {
        Mode::Replicate => nunits * dirs.len() as u64,
        Mode::Stripe => nunits,
    };

    let mut buf = vec![0u8; placement.unit as usize];
    for (d, units) in bad.iter().enumerate() {
        for &u in units {
            let len = unit_len(u) as usize;
            let off = location(d, u).unwrap_or(0);
            let where_ = format!(
                "drive {d} {} offset {off} ({len} bytes, stripe unit {u})",
                dirs[d].join(DATA_FILE).display()
            );
            if here.mode == Mode::Stripe {
                report
                    .unrepairable
                    .push(format!("{where_}: a stripe holds no other copy"));
                continue;
            }
            let source = (0..files.len()).find(|&e| e != d && !bad[e].contains(&u));
            let Some(e) = source else {
                report
                    .unrepairable
                    .push(format!("{where_}: no drive has a good copy"));
                continue;
            };
            let fixed = files[e]
                .read_exact_at(&mut buf[..len], off)
                .and_then(|()| files[d].write_all_at(&buf[..len], off))
                .and_then(|()| files[d].sync_data())
                .and_then(|()| files[d].read_exact_at(&mut buf[..len], off));
            match fixed {
                Ok(()) if blake3::hash(&buf[..len]).as_bytes() == &unit_hashes[u as usize] => {
                    report.units_repaired.push((d, u, e));
                }
                Ok(()) => report.unrepairable.push(format!(
                    "{where_}: rewritten from drive {e} but reads back wrong"
                )),
                Err(err) => report
                    .unrepairable
                    .push(format!("{where_}: rewriting from drive {e} failed: {err}")),
            }
        }
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Every other drive's manifest copy agrees with `here`, or is rewritten from it.
fn repair_manifests(here: &Manifest, dirs: &[PathBuf], report: &mut RepairReport) -> Result<()> {
    let mut bad = Vec::new();
    let mut dissent = Vec::new();
    for (d, dir) in dirs.iter().enumerate() {
        if d == here.this_drive {
            continue;
        }
        match Manifest::load(&dir.join(MANIFEST_FILE)) {
            Ok(m)
                if m.layout_id == here.layout_id
                    && m.this_drive == d
                    && m.shared_content() == here.shared_content() => {}
            // A valid copy that says something else: only the majority may overrule it.
            Ok(m) if m.content_hash == m.compute_content_hash() && !m.content_hash.is_empty() => {
                dissent.push(d);
                bad.push(d);
            }
            _ => bad.push(d),
        }
    }
    let agreeing = dirs.len() - bad.len();
    if !dissent.is_empty() && agreeing <= dissent.len() {
        return Err(StorageError::InvalidArgument(format!(
            "the manifest copies on drives {dissent:?} disagree with drive {}'s and it has no \
             majority ({agreeing} of {} copies agree with it); point --repair at the copy you \
             know is right on a layout where it has the majority, or lay the model out again",
            here.this_drive,
            dirs.len()
        )));
    }
    for d in bad {
        fs::create_dir_all(&dirs[d]).map_err(|e| StorageError::io(&dirs[d], "create", e))?;
        let mut m = here.clone();
        m.this_drive = d;
        m.store(&dirs[d])?;
        report.manifests_rewritten.push(d);
    }
    Ok(())
}

/// `units.blake3` on every drive, rewritten where missing or wrong; returns its bytes.
fn repair_unit_files(
    here: &Manifest,
    dirs: &[PathBuf],
    report: &mut RepairReport,
) -> Result<Vec<u8>> {
    let good = dirs
        .iter()
        .find(|d| load_unit_hashes(d, here).is_ok())
        .map(|d| fs::read(d.join(UNIT_HASHES_FILE)))
        .transpose()
        .map_err(|e| StorageError::io(&dirs[0].join(UNIT_HASHES_FILE), "read", e))?
        .ok_or_else(|| StorageError::Manifest {
            path: dirs[here.this_drive].join(UNIT_HASHES_FILE),
            reason: "no drive holds a unit hash file matching the manifest; lay the model out \
                     again"
                .into(),
        })?;
    for (d, dir) in dirs.iter().enumerate() {
        if load_unit_hashes(dir, here).is_err() {
            write_atomic(&dir.join(UNIT_HASHES_FILE), &good)?;
            report.unit_files_rewritten.push(d);
        }
    }
    Ok(good)
}

/// Every drive's `data.bin` opened read-write at its full length (created or extended).
fn repair_data_files(
    here: &Manifest,
    dirs: &[PathBuf],
    report: &mut RepairReport,
) -> Result<Vec<File>> {
    let mut files = Vec::with_capacity(dirs.len());
    for (d, dir) in dirs.iter().enumerate() {
        let path = dir.join(DATA_FILE);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StorageError::io(&path, "open for repair", e))?;
        let want = here.drives[d].data_len;
        let len = f
            .metadata()
            .map_err(|e| StorageError::io(&path, "stat", e))?
            .len();
        if len < want {
            f.set_len(want)
                .map_err(|e| StorageError::io(&path, "extend", e))?;
            report.data_files_fixed.push(d);
        }
        files.push(f);
    }
    Ok(files)
}
