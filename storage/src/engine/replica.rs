//! Replicate mode's recovery: a piece that failed to read is read from another copy, and a
//! record that failed its hash is re-read whole from each copy until one matches.

use std::sync::atomic::Ordering;

use crate::engine::locate::bad_units;
use crate::engine::repair::repair_range;
use crate::engine::request::{InFlight, Loaded, ReadBuf, Target};
use crate::engine::shared::Shared;
use crate::error::{Result, StorageError};
use crate::stripe::Piece;

/// Replicate mode: read `dst` at `offset` from the replicas other than `failed`, in drive
/// order, after `failed` returned `first`. Returns the drive that served it, or every error.
pub(crate) fn read_other_replica(
    shared: &Shared,
    failed: usize,
    dst: &mut [u8],
    offset: u64,
    first: StorageError,
) -> Result<usize> {
    let mut failures = vec![first];
    // Healthy replicas first, then those resting after an error of their own.
    let mut order: Vec<usize> = (0..shared.drives.len())
        .filter(|&o| o != failed && !shared.drives[o].unavailable)
        .collect();
    order.sort_by_key(|&o| !shared.drives[o].healthy());
    for o in order {
        let drive = &shared.drives[o];
        match drive.read(o, dst, offset) {
            Ok(()) => {
                shared.replica_recoveries.fetch_add(1, Ordering::Relaxed);
                return Ok(o);
            }
            Err(e) => {
                drive.mark_failed();
                failures.push(e);
            }
        }
    }
    Err(StorageError::ReplicasFailed {
        offset,
        len: dst.len() as u64,
        failures,
    })
}

/// A record whose bytes did not match its hash: in replicate mode read it again whole from
/// each drive in turn (silent corruption is per copy), return the first copy that matches and
/// rewrite the bad copies' pieces from it (`repair`); otherwise, or if no copy matches, the
/// mismatch error, naming the stripe units that fail their hashes.
pub(crate) fn recover_record(shared: &Shared, req: &InFlight, mut buf: ReadBuf) -> Result<Loaded> {
    let replicated = shared.replicated();
    if let (true, Target::Record(ri), Some(want)) = (replicated, &req.target, &req.expected_hash) {
        let base = buf.as_mut_ptr();
        let piece_bytes = |p: Piece| {
            // SAFETY: as in `worker`: the piece lies within the buffer's capacity (pieces
            // cover the aligned payload it was sized for), and every piece is finished, so
            // this thread holds the buffer alone; no mutable slice of it is alive here.
            unsafe { std::slice::from_raw_parts(base.add(p.buf_offset as usize), p.len as usize) }
        };
        // Each piece's hash as first read, to find which drive served a bad piece once a good
        // copy is in.
        let first: Vec<blake3::Hash> = req
            .pieces
            .iter()
            .map(|slot| blake3::hash(piece_bytes(slot.piece)))
            .collect();
        // The drives that served the bad read first, then the others.
        let mut order: Vec<usize> = req
            .pieces
            .iter()
            .map(|slot| slot.served_by.load(Ordering::Relaxed))
            .collect();
        order.extend(0..shared.drives.len());
        let mut seen = vec![false; shared.drives.len()];
        order.retain(|&k| k < seen.len() && !std::mem::replace(&mut seen[k], true));
        // Drives whose whole copy was read and failed the hash.
        let mut corrupt_copies = Vec::new();
        for k in order {
            let drive = &shared.drives[k];
            if drive.unavailable {
                continue;
            }
            let mut ok = true;
            for slot in &req.pieces {
                let p = slot.piece;
                // SAFETY: as above; this is the only slice of the buffer alive while it is
                // written.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(base.add(p.buf_offset as usize), p.len as usize)
                };
                if drive.read(k, dst, p.file_offset).is_err() {
                    drive.mark_failed();
                    ok = false;
                    break;
                }
            }
            if !ok {
                continue;
            }
            if !want.matches(&buf[..req.payload_len]) {
                // This whole copy of the record is corrupt: rest the drive, repair it below.
                drive.mark_failed();
                corrupt_copies.push(k);
                continue;
            }
            // Drive k's copy is good. Bad pieces: those first read differently from it, and
            // every piece of a copy that failed whole.
            let mut bad: Vec<(usize, usize)> = Vec::new();
            for (i, (slot, h)) in req.pieces.iter().zip(&first).enumerate() {
                if blake3::hash(piece_bytes(slot.piece)) != *h {
                    let d = slot.served_by.load(Ordering::Relaxed);
                    shared.drives[d].mark_failed();
                    bad.push((d, i));
                }
            }
            for &c in &corrupt_copies {
                bad.extend((0..req.pieces.len()).map(|i| (c, i)));
            }
            bad.sort_unstable();
            bad.dedup();
            bad.retain(|&(d, _)| d != k && d < shared.drives.len());
            shared.replica_recoveries.fetch_add(1, Ordering::Relaxed);
            if shared.repair {
                let what = shared.manifest.records[*ri].id.to_string();
                for (d, i) in bad {
                    let p = req.pieces[i].piece;
                    repair_range(shared, d, p.file_offset, piece_bytes(p), &what, k);
                }
            }
            return Ok(Loaded {
                target: req.target.clone(),
                tag: req.tag,
                buf,
                verified: true,
            });
        }
    }
    Err(hash_mismatch(shared, req))
}

fn hash_mismatch(shared: &Shared, req: &InFlight) -> StorageError {
    let (target, pieces) = (&req.target, &req.pieces[..]);
    let first = pieces
        .first()
        .map(|s| (s.served_by.load(Ordering::Relaxed), s.piece.file_offset));
    let (mut drive, mut offset) = first.unwrap_or((0, 0));
    let (what, len) = match target {
        Target::Record(i) => {
            let r = &shared.manifest.records[*i];
            // Which stripe units are bad, by their own hashes (an error path: reads them).
            let bad = bad_units(shared, r.offset, pieces);
            if let Some(u) = bad.first() {
                (drive, offset) = (u.drive, u.file_offset);
            }
            let located = if bad.is_empty() {
                String::new()
            } else {
                format!(
                    "; {}",
                    bad.iter()
                        .map(|u| u.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            };
            let drives: Vec<usize> = {
                let mut v: Vec<usize> = pieces
                    .iter()
                    .map(|s| s.served_by.load(Ordering::Relaxed))
                    .collect();
                v.sort_unstable();
                v.dedup();
                v
            };
            (
                format!(
                    "{} (logical offset {}, read from drives {drives:?}){located}",
                    r.id, r.offset
                ),
                r.len,
            )
        }
        Target::Raw { len, .. } => ("raw range".to_string(), *len),
    };
    StorageError::HashMismatch {
        what,
        algorithm: req.expected_hash.map_or("hash", |h| h.algorithm()),
        drive,
        path: shared.drives[drive].path.clone(),
        offset,
        len,
    }
}
