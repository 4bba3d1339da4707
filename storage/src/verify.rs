//! `deltafin verify`: read every byte on every drive through the engine, check every stripe-unit
//! hash and every record hash, and name each mismatch by drive, file, offset and record.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use crate::engine::{Engine, Lane, Target};
use crate::error::{Result, StorageError};
use crate::layout::Progress;
use crate::manifest::{Manifest, DATA_FILE, UNIT_HASHES_FILE};
use crate::record_hash::RecordHasher;
use crate::stripe::Mode;

/// One bad range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub drive: usize,
    pub file: PathBuf,
    /// Offset in the drive's data file.
    pub offset: u64,
    pub len: u64,
    /// Which records (tensors or experts) the range holds.
    pub what: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "drive {} {} offset {} ({} bytes): {}",
            self.drive,
            self.file.display(),
            self.offset,
            self.len,
            self.what
        )
    }
}

#[derive(Clone, Debug)]
pub struct DriveReport {
    pub index: usize,
    pub file: PathBuf,
    pub bytes: u64,
    pub busy: Duration,
}

#[derive(Clone, Debug)]
pub struct VerifyReport {
    pub drives: Vec<DriveReport>,
    pub mismatches: Vec<Mismatch>,
    pub units_checked: u64,
    pub records_checked: u64,
    pub elapsed: Duration,
}

/// Load and check `units.blake3` from a layout folder.
pub fn load_unit_hashes(dir: &Path, manifest: &Manifest) -> Result<Vec<[u8; 32]>> {
    let path = dir.join(UNIT_HASHES_FILE);
    let bytes = std::fs::read(&path).map_err(|e| StorageError::io(&path, "read", e))?;
    let units = manifest.placement().unit_count(manifest.logical_len);
    if bytes.len() as u64 != units * 32 {
        return Err(StorageError::Manifest {
            path,
            reason: format!(
                "{} bytes, expected {} (32 per unit)",
                bytes.len(),
                units * 32
            ),
        });
    }
    if blake3::hash(&bytes).to_hex().as_str() != manifest.unit_hashes_blake3 {
        return Err(StorageError::Manifest {
            path,
            reason: "blake3 differs from the manifest's unit_hashes_blake3".into(),
        });
    }
    Ok(bytes
        .chunks_exact(32)
        .map(|c| c.try_into().unwrap_or([0; 32]))
        .collect())
}

/// Names of the records overlapping logical range `[start, end)`.
fn records_in(manifest: &Manifest, start: u64, end: u64) -> String {
    let i = manifest
        .records
        .partition_point(|r| r.offset + r.len.max(1) <= start);
    let names: Vec<String> = manifest.records[i..]
        .iter()
        .take_while(|r| r.offset < end)
        .map(|r| r.id.to_string())
        .collect();
    if names.is_empty() {
        "padding".into()
    } else if names.len() > 4 {
        format!("{}, ... ({} records)", names[..4].join(", "), names.len())
    } else {
        names.join(", ")
    }
}

struct Stream {
    /// (drive, file offset, logical offset, len) of each unit, in logical order.
    units: Vec<(usize, u64, u64, u64)>,
    next_submit: usize,
    next_process: usize,
    ready: BTreeMap<usize, crate::engine::Loaded>,
    rec: usize,
    /// Both hashes of the record being read (verify checks each one the manifest has).
    hasher: RecordHasher,
}

/// Open the layout at `path` (any drive's copy) and verify it with `threads_per_drive`
/// readers per drive and `buffer_cap` bytes of buffers. Returns the manifest and the report.
pub fn verify_layout(
    path: &Path,
    threads_per_drive: usize,
    buffer_cap: u64,
    progress: &dyn Progress,
) -> Result<(std::sync::Arc<Manifest>, Vec<PathBuf>, VerifyReport)> {
    let (manifest, dirs) = crate::layout::open_layout(path)?;
    let manifest = std::sync::Arc::new(manifest);
    let config = crate::engine::EngineConfig {
        threads_per_drive,
        buffer_cap_bytes: buffer_cap,
        hash_check: crate::engine::HashCheck::Off,
        ..crate::engine::EngineConfig::default()
    };
    let engine = Engine::open(manifest.clone(), &dirs, config)?;
    let report = verify(&engine, &dirs, progress)?;
    Ok((manifest, dirs, report))
}

/// Verify a layout. `dirs` are the drive folders (from `open_layout`).
pub fn verify(engine: &Engine, dirs: &[PathBuf], progress: &dyn Progress) -> Result<VerifyReport> {
    let manifest = engine.manifest().clone();
    // Every drive's copy of the unit hashes, whichever drive we were pointed at; checking
    // uses the first good one.
    let mut mismatches = Vec::new();
    let mut unit_hashes = None;
    let mut first_error = None;
    for (d, dir) in dirs.iter().enumerate() {
        match load_unit_hashes(dir, &manifest) {
            Ok(h) => {
                unit_hashes.get_or_insert(h);
            }
            Err(e) => {
                mismatches.push(Mismatch {
                    drive: d,
                    file: dir.join(UNIT_HASHES_FILE),
                    offset: 0,
                    len: 0,
                    what: format!("unit hash file unusable: {e}"),
                });
                first_error.get_or_insert(e);
            }
        }
    }
    let unit_hashes = match (unit_hashes, first_error) {
        (Some(h), _) => h,
        (None, Some(e)) => return Err(e),
        (None, None) => {
            return Err(StorageError::InvalidArgument(
                "a layout with no drives".into(),
            ))
        }
    };
    let placement = manifest.placement();
    let nunits = placement.unit_count(manifest.logical_len);
    let unit_len = |i: u64| {
        placement
            .unit
            .min(manifest.logical_len - i * placement.unit)
    };
    // One stream per full copy of the logical space.
    let copies: Vec<Option<usize>> = match manifest.mode {
        Mode::Replicate => (0..manifest.drives.len()).map(Some).collect(),
        Mode::Stripe => vec![None],
    };
    let mut streams: Vec<Stream> = copies
        .iter()
        .map(|copy| Stream {
            units: (0..nunits)
                .map(|i| {
                    let (d, off) = placement.unit_location(i);
                    (copy.unwrap_or(d), off, i * placement.unit, unit_len(i))
                })
                .collect(),
            next_submit: 0,
            next_process: 0,
            ready: BTreeMap::new(),
            rec: 0,
            hasher: RecordHasher::new(),
        })
        .collect();
    let total: u64 = streams
        .iter()
        .map(|s| s.units.iter().map(|u| u.3).sum::<u64>())
        .sum();
    progress.start(total, "verifying");
    let before = engine.stats();
    let started = Instant::now();
    let window = (engine.drive_count() * engine.threads_per_drive() * 2).max(4);
    let max_window_bytes = engine.pool().cap() / 2;
    let window = window.min((max_window_bytes / placement.unit).max(1) as usize);
    let (tx, rx) = bounded(window * streams.len() + 1);
    let mut in_flight = 0usize;
    let mut units_checked = 0;
    let mut records_checked = 0;
    let file_of = |d: usize| dirs[d].join(DATA_FILE);
    loop {
        // Keep each stream's window full, round-robin so every drive stays busy.
        let mut submitted = true;
        while submitted && in_flight < window * streams.len() {
            submitted = false;
            for (si, s) in streams.iter_mut().enumerate() {
                if s.next_submit < s.units.len() && s.next_submit - s.next_process < window {
                    let (d, off, _, len) = s.units[s.next_submit];
                    let tag = ((si as u64) << 40) | s.next_submit as u64;
                    engine.submit(
                        Target::Raw {
                            drive: d,
                            offset: off,
                            len: crate::stripe::align_up(len),
                        },
                        Lane::Demand,
                        tag,
                        tx.clone(),
                        None,
                    )?;
                    s.next_submit += 1;
                    in_flight += 1;
                    submitted = true;
                }
            }
        }
        if in_flight == 0 {
            break;
        }
        let c = rx.recv().map_err(|_| StorageError::EngineClosed)?;
        in_flight -= 1;
        let si = (c.tag >> 40) as usize;
        let ui = (c.tag & ((1 << 40) - 1)) as usize;
        let s = &mut streams[si];
        let (d, off, lo, len) = s.units[ui];
        match c.result {
            Ok(loaded) => {
                s.ready.insert(ui, loaded);
            }
            Err(e) => {
                mismatches.push(Mismatch {
                    drive: d,
                    file: file_of(d),
                    offset: off,
                    len,
                    what: format!(
                        "read failed: {e}; holds {}",
                        records_in(&manifest, lo, lo + len)
                    ),
                });
                // Feed zeros so record hashes downstream still get checked (and fail).
                s.ready.insert(
                    ui,
                    crate::engine::Loaded {
                        target: c.target,
                        tag: c.tag,
                        buf: crate::engine::ReadBuf::Owned(crate::buffer::AlignedBuf::zeroed(
                            len as usize,
                        )),
                        verified: false,
                    },
                );
            }
        }
        // Process units in logical order.
        while let Some(loaded) = s.ready.remove(&s.next_process) {
            let ui = s.next_process;
            let (d, off, lo, len) = s.units[ui];
            let bytes = &loaded.buf[..len as usize];
            units_checked += 1;
            if blake3::hash(bytes).as_bytes() != &unit_hashes[ui]
                && !mismatches
                    .iter()
                    .any(|m: &Mismatch| m.drive == d && m.offset == off)
            {
                mismatches.push(Mismatch {
                    drive: d,
                    file: file_of(d),
                    offset: off,
                    len,
                    what: format!(
                        "stripe unit {ui} hash differs; holds {}",
                        records_in(&manifest, lo, lo + len)
                    ),
                });
            }
            let hi = lo + len;
            while let Some(r) = manifest.records.get(s.rec) {
                if r.offset >= hi {
                    break;
                }
                let a = r.offset.max(lo);
                let b = (r.offset + r.len).min(hi);
                if b > a {
                    s.hasher
                        .update(&bytes[(a - lo) as usize..(b - lo) as usize]);
                }
                if r.offset + r.len <= hi {
                    records_checked += 1;
                    let (blake3_hex, xxh3_hex) = s.hasher.finish();
                    let differs = match (blake3_hex != r.hash, r.xxh3.as_ref()) {
                        (true, _) => Some("hash"),
                        (false, Some(x)) if *x != xxh3_hex => Some("xxh3"),
                        _ => None,
                    };
                    if let Some(which) = differs {
                        let (rd, roff) = match manifest.mode {
                            Mode::Replicate => (d, r.offset),
                            Mode::Stripe => placement.unit_location(r.offset / placement.unit),
                        };
                        let roff = if manifest.mode == Mode::Stripe {
                            roff + r.offset % placement.unit
                        } else {
                            roff
                        };
                        mismatches.push(Mismatch {
                            drive: rd,
                            file: file_of(rd),
                            offset: roff,
                            len: r.len,
                            what: format!("record {} {which} differs", r.id),
                        });
                    }
                    s.rec += 1;
                } else {
                    break;
                }
            }
            progress.advance(len);
            s.next_process += 1;
        }
    }
    progress.finish();
    let elapsed = started.elapsed();
    let after = engine.stats();
    let drives = after
        .iter()
        .zip(&before)
        .enumerate()
        .map(|(i, (a, b))| DriveReport {
            index: i,
            file: file_of(i),
            bytes: a.bytes_read - b.bytes_read,
            busy: a.busy.saturating_sub(b.busy),
        })
        .collect();
    mismatches.sort_by_key(|m| (m.drive, m.offset));
    Ok(VerifyReport {
        drives,
        mismatches,
        units_checked,
        records_checked,
        elapsed,
    })
}
