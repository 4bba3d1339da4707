//! Naming what is bad when a record fails its hash with no good copy to read instead (a
//! stripe, or every replica bad): each stripe unit the record's pieces touch is read whole and
//! checked against its hash in `units.blake3`, so the error names the drive, file and offset of
//! the corrupt unit rather than only the record.

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use crate::buffer::AlignedBuf;
use crate::engine::request::PieceSlot;
use crate::engine::shared::Shared;
use crate::manifest::UNIT_HASHES_FILE;
use crate::stripe::{align_up, Mode};

/// A stripe unit that fails its hash (or cannot be read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadUnit {
    pub unit: u64,
    pub drive: usize,
    pub file_offset: u64,
    pub len: u64,
    pub path: std::path::PathBuf,
    pub reason: &'static str,
}

impl std::fmt::Display for BadUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "drive {} {} offset {} ({} bytes, stripe unit {}) {}",
            self.drive,
            self.path.display(),
            self.file_offset,
            self.len,
            self.unit,
            self.reason
        )
    }
}

/// The bad stripe units under a record at logical offset `record_offset` read as `pieces`.
pub(crate) fn bad_units(shared: &Shared, record_offset: u64, pieces: &[PieceSlot]) -> Vec<BadUnit> {
    let m = &shared.manifest;
    let placement = m.placement();
    let mut units: Vec<(u64, usize)> = pieces
        .iter()
        .map(|s| {
            let logical = record_offset + s.piece.buf_offset;
            (
                logical / placement.unit,
                s.served_by.load(Ordering::Relaxed),
            )
        })
        .collect();
    units.sort_unstable();
    units.dedup_by_key(|u| u.0);
    let mut bad = Vec::new();
    for (unit, served_by) in units {
        let (drive, file_offset) = match m.mode {
            Mode::Stripe => placement.unit_location(unit),
            Mode::Replicate => (served_by, unit * placement.unit),
        };
        let Some(d) = shared.drives.get(drive) else {
            continue;
        };
        let Some(want) = unit_hash(shared, unit) else {
            continue; // no readable unit-hash file: the record error stands alone
        };
        let len = placement
            .unit
            .min(m.logical_len.saturating_sub(unit * placement.unit));
        let mut buf = AlignedBuf::zeroed(align_up(len) as usize);
        let reason = match d.read(drive, &mut buf, file_offset) {
            Err(_) => "cannot be read",
            Ok(()) if blake3::hash(&buf[..len as usize]).as_bytes() != &want => {
                "fails its unit hash"
            }
            Ok(()) => continue,
        };
        bad.push(BadUnit {
            unit,
            drive,
            file_offset,
            len,
            path: d.path.clone(),
            reason,
        });
    }
    bad
}

/// The expected hash of `unit`, from the first drive whose `units.blake3` has it.
fn unit_hash(shared: &Shared, unit: u64) -> Option<[u8; 32]> {
    shared.drives.iter().find_map(|d| {
        let file = std::fs::File::open(d.path.parent()?.join(UNIT_HASHES_FILE)).ok()?;
        let mut h = [0u8; 32];
        file.read_exact_at(&mut h, unit.checked_mul(32)?).ok()?;
        Some(h)
    })
}
