//! Finishing a request: the last piece to land checks the hash (if asked) and sends the
//! [`Completion`] on the requester's channel.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::engine::replica::recover_record;
use crate::engine::request::{Completion, InFlight, Loaded, ReadBuf};
use crate::engine::shared::Shared;
use crate::error::StorageError;

/// Account for one finished (or skipped) piece; the last one completes the request.
pub(crate) fn finish_piece(shared: &Shared, req: &Arc<InFlight>, piece: usize) {
    let p = req.pieces[piece].piece;
    shared.drives[p.drive]
        .outstanding
        .fetch_sub(p.len, Ordering::Relaxed);
    if req.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        complete(shared, req);
    }
}

/// Send the request's completion: its buffer, or the first error, `Cancelled` or
/// `EngineClosed`; a record whose hash does not match is recovered from another replica if
/// there is one.
pub(crate) fn complete(shared: &Shared, req: &Arc<InFlight>) {
    let buf = req.buf.lock().unwrap_or_else(|p| p.into_inner()).take();
    let error = req.error.lock().unwrap_or_else(|p| p.into_inner()).take();
    let mut unused = None;
    let result = match (buf, error) {
        (b, Some(e)) => {
            unused = b;
            Err(e)
        }
        (None, None) => Err(StorageError::EngineClosed),
        (Some(b), None) if req.cancelled.load(Ordering::Acquire) => {
            unused = Some(b);
            Err(StorageError::Cancelled)
        }
        (Some(buf), None) => match &req.expected_hash {
            Some(want) => {
                let matched = match &req.hashing {
                    // SAFETY: `req.ptr` points into `buf` (moved out of the request, its heap
                    // bytes unmoved), which this thread holds until the completion is sent;
                    // every piece is finished (the last `remaining` decrement got us here).
                    Some(h) => unsafe { h.matches(req.ptr.0, want) },
                    None => want.matches(&buf[..req.payload_len]),
                };
                if matched {
                    Ok(Loaded {
                        target: req.target.clone(),
                        tag: req.tag,
                        buf,
                        verified: true,
                    })
                } else {
                    recover_record(shared, req, buf)
                }
            }
            None => Ok(Loaded {
                target: req.target.clone(),
                tag: req.tag,
                buf,
                verified: false,
            }),
        },
    };
    // Every piece has finished (the last `remaining` decrement got us here): nothing writes
    // to the buffer any more. A pooled one goes back to its pool when dropped.
    let unused = match unused {
        Some(ReadBuf::Owned(b)) => Some(b),
        _ => None,
    };
    let _ = req.done.send(Completion {
        tag: req.tag,
        target: req.target.clone(),
        result,
        unused,
    });
}
