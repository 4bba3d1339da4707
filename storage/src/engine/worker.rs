//! The per-drive `pread` worker loop.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;

use crate::engine::completion::finish_piece;
use crate::engine::config::Lane;
use crate::engine::replica::read_other_replica;
use crate::engine::request::{Job, Target};
use crate::engine::schedule::{least_loaded, next_job, release_prefetch_slot, Taken};
use crate::engine::shared::Shared;
use crate::stripe::Mode;
use crate::timeline;

/// Serve drive `d`'s lanes until a stop job: read each claimed piece straight into its slice of
/// the request's buffer, fail over to another replica on an error (replicate mode), and finish
/// the piece.
pub(crate) fn worker(
    shared: Arc<Shared>,
    d: usize,
    lanes: Arc<Vec<(Receiver<Job>, Receiver<Job>)>>,
) {
    let steal = shared.manifest.mode == Mode::Replicate && lanes.len() > 1;
    while let Some(Taken { job, prefetch_slot }) = next_job(&shared, d, &lanes, steal) {
        // The slot is given back once the piece's read is over, however that ends (a drop
        // below, or any early exit).
        let slot_guard = prefetch_slot.then(|| SlotGuard(&shared, d));
        let (req, piece) = match job {
            Job::Stop => return,
            Job::Read { req, piece } => (req, piece),
        };
        let slot = &req.pieces[piece];
        if slot.claimed.swap(true, Ordering::AcqRel) {
            continue; // already read through the other lane, or cancelled
        }
        if req.cancelled.load(Ordering::Acquire) {
            finish_piece(&shared, &req, piece);
            continue;
        }
        let p = slot.piece;
        // Raw reads name their drive; record pieces in replicate mode may be served by any
        // (by this worker's drive unless it has had read errors).
        let replicated = steal && matches!(req.target, Target::Record(_));
        let rd = if !replicated {
            p.drive
        } else if shared.drives[d].healthy() {
            d
        } else if shared.drives[p.drive].healthy() {
            p.drive
        } else {
            // Queued to a drive that has failed since: another replica, if one is healthy.
            least_loaded(&shared.drives, &[])
        };
        let drive = &shared.drives[rd];
        // SAFETY: [buf_offset, buf_offset+len) lies within the buffer's capacity (pieces cover
        // the aligned payload length, which the buffer was sized for), no other piece overlaps
        // it, and no one reads this range until it is reported landed (`piece_hash`) or every
        // piece is finished.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(req.ptr.0.add(p.buf_offset as usize), p.len as usize)
        };
        let started = timeline::enabled().then(Instant::now);
        let read = drive.read(rd, dst, p.file_offset);
        drop(slot_guard);
        if let Some(started) = started {
            let kind = if req.lane.load(Ordering::Relaxed) == Lane::Demand as u8 {
                "read_demand"
            } else {
                "read_prefetch"
            };
            timeline::record(kind, started, Instant::now(), rd as u64, p.len);
        }
        // The drive that served the piece: this one, or (replicate) another after an error.
        let served = match read {
            Ok(()) => Ok(rd),
            Err(e) => {
                drive.mark_failed();
                // Every drive of a replicated layout holds the same bytes at the same offset.
                if shared.replicated() && matches!(req.target, Target::Record(_)) {
                    read_other_replica(&shared, rd, dst, p.file_offset, e)
                } else {
                    Err(e)
                }
            }
        };
        match served {
            Ok(o) => {
                slot.served_by.store(o, Ordering::Relaxed);
                if let Some(h) = req
                    .hashing
                    .as_ref()
                    .filter(|_| !req.cancelled.load(Ordering::Relaxed))
                {
                    // SAFETY: `req.ptr` is the request's buffer, sized for every piece and
                    // owned by `req` until its completion; this piece was written just above
                    // (from this drive or another copy) and no one writes it again.
                    unsafe { h.piece_landed(req.ptr.0, piece) };
                }
            }
            Err(e) => req.set_error(e),
        }
        finish_piece(&shared, &req, piece);
    }
}

/// Gives a drive's prefetch slot back when dropped.
struct SlotGuard<'a>(&'a Shared, usize);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        release_prefetch_slot(self.0, self.1);
    }
}
