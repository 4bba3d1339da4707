//! A read request as it travels through the engine: what it reads ([`Target`]), the pieces it
//! was cut into, the buffer the pieces land in, and what the requester gets back.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize};
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;

use crate::buffer::{AlignedBuf, PooledBuf};
use crate::engine::piece_hash::PieceHashing;
use crate::error::{Result, StorageError};
use crate::record_hash::RecordHash;
use crate::stripe::Piece;

/// A filled buffer: a record's payload (`len` bytes) or a raw range.
#[derive(Debug)]
pub enum ReadBuf {
    Pooled(PooledBuf),
    Owned(AlignedBuf),
}

impl std::ops::Deref for ReadBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ReadBuf::Pooled(b) => b,
            ReadBuf::Owned(b) => b,
        }
    }
}

impl ReadBuf {
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            ReadBuf::Pooled(b) => b.inner_mut().as_mut_ptr(),
            ReadBuf::Owned(b) => b.as_mut_ptr(),
        }
    }

    /// The bytes as an owned aligned buffer (a pooled one is copied out of the pool).
    pub fn into_owned(self) -> AlignedBuf {
        match self {
            ReadBuf::Owned(b) => b,
            ReadBuf::Pooled(p) => {
                let mut b = AlignedBuf::zeroed(p.len());
                b.copy_from_slice(&p);
                b
            }
        }
    }
}

/// What a request reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Record `index` of the manifest.
    Record(usize),
    /// `len` bytes of drive `drive`'s data file at `offset` (both 4 KiB-aligned).
    Raw { drive: usize, offset: u64, len: u64 },
}

/// A completed read.
#[derive(Debug)]
pub struct Loaded {
    pub target: Target,
    /// The caller's tag from `submit`.
    pub tag: u64,
    pub buf: ReadBuf,
    /// True when the payload's hash was checked (and matched).
    pub verified: bool,
}

/// A completion: the tag and either the data or what went wrong.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub target: Target,
    pub result: Result<Loaded>,
    /// On an error (a cancel included), the buffer the caller gave `submit`, no longer
    /// written to: for the caller to reuse instead of allocating another.
    pub unused: Option<AlignedBuf>,
}

/// A unit of work on a drive's lane.
#[derive(Debug)]
pub(crate) enum Job {
    Read { req: Arc<InFlight>, piece: usize },
    Stop,
}

#[derive(Debug)]
pub(crate) struct PieceSlot {
    pub piece: Piece,
    pub claimed: AtomicBool,
    /// The drive that served the piece (replicate mode may read it anywhere).
    pub served_by: AtomicUsize,
}

/// Raw pointer to a request's buffer. Workers write disjoint ranges through it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BufPtr(pub *mut u8);
// SAFETY: the pointer targets a heap buffer owned by the InFlight that outlives every job
// holding it; each piece writes a disjoint range, and a range is read only after its writer
// reported it landed (`piece_hash`: Release/Acquire) or after the last piece's `remaining`
// decrement (AcqRel) has ordered all writes before the read.
unsafe impl Send for BufPtr {}
// SAFETY: as above.
unsafe impl Sync for BufPtr {}

/// One request in flight.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub target: Target,
    pub tag: u64,
    pub payload_len: usize,
    pub expected_hash: Option<RecordHash>,
    /// The expected hash's check, fed piece by piece as they land (`None`: hashed whole at
    /// completion, or not checked).
    pub hashing: Option<PieceHashing>,
    pub ptr: BufPtr,
    pub buf: Mutex<Option<ReadBuf>>,
    pub pieces: Vec<PieceSlot>,
    pub remaining: AtomicUsize,
    pub cancelled: AtomicBool,
    pub lane: AtomicU8,
    pub error: Mutex<Option<StorageError>>,
    pub done: Sender<Completion>,
}

impl InFlight {
    /// Keep the first error of the request.
    pub fn set_error(&self, e: StorageError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}
