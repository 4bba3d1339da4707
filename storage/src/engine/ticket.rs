//! [`Ticket`]: the requester's handle on a request in flight.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::engine::completion::finish_piece;
use crate::engine::config::Lane;
use crate::engine::request::{InFlight, Job};
use crate::engine::shared::Shared;

/// A handle to an in-flight request: cancel it (if not started) or promote it to demand.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub(crate) req: Arc<InFlight>,
    pub(crate) shared: Arc<Shared>,
}

impl Ticket {
    /// Cancel every piece not yet started; started pieces finish. The requester then receives
    /// `Err(Cancelled)` unless the whole request had already been read.
    pub fn cancel(&self) {
        self.req.cancelled.store(true, Ordering::Release);
        for (i, slot) in self.req.pieces.iter().enumerate() {
            if !slot.claimed.swap(true, Ordering::AcqRel) {
                finish_piece(&self.shared, &self.req, i);
            }
        }
    }

    /// Move the request's pieces that have not started to the demand lane.
    pub fn promote(&self) {
        if self.req.lane.swap(Lane::Demand as u8, Ordering::AcqRel) == Lane::Demand as u8 {
            return;
        }
        for (i, slot) in self.req.pieces.iter().enumerate() {
            if !slot.claimed.load(Ordering::Acquire) {
                let d = &self.shared.drives[slot.piece.drive];
                // A send fails only after shutdown; the request then completes with EngineClosed.
                let _ = d.lanes[Lane::Demand as usize].send(Job::Read {
                    req: self.req.clone(),
                    piece: i,
                });
            }
        }
    }

    /// Whether a worker has taken up any piece of the request (its bytes are then read in
    /// part or whole even if it is cancelled now).
    pub fn started(&self) -> bool {
        self.req
            .pieces
            .iter()
            .any(|s| s.claimed.load(Ordering::Acquire))
    }

    pub fn tag(&self) -> u64 {
        self.req.tag
    }
}
