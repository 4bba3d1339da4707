//! The read engine: per-drive pools of `pread` worker threads fed over bounded crossbeam
//! channels, two priority lanes, aligned pooled buffers filled in place, optional hash checks
//! (`record_hash`).
//!
//! A request names a record of the manifest (or, for `verify`, a raw range of one drive). It is
//! cut into pieces at stripe-unit boundaries; each piece goes to a drive's demand or prefetch
//! lane (replicate mode: the drive with the fewest outstanding bytes). Workers always drain the
//! demand lane first. Every worker writes straight into its piece's slice of the record's buffer
//! (no copy after the kernel fills it); the worker that lands the last piece checks the hash if
//! asked and sends the finished [`Loaded`] on the requester's channel, so a consumer can start on
//! the first record to land.
//!
//! Replicate mode tolerates a failing copy ([`replica`]): a piece whose read fails is read from
//! the other drives in turn (the failing drive then gets no new pieces while a healthy one
//! remains), and a record whose bytes fail their hash is read again whole from each drive until
//! a copy matches. Only when every copy fails does the request fail, naming each drive's error.
//! A replica whose data file cannot be opened at all starts out failed (see
//! `layout::open_layout_degraded`).
//!
//! Files: [`config`] (lanes, hash checks, tuning), [`drive`] (one drive: file, lanes, counters,
//! health), [`request`] (what travels: targets, pieces, buffers, completions), [`schedule`]
//! (which drive, which job next), [`worker`] (the `pread` loop), [`completion`] (the last
//! piece completes), [`replica`] (failover), [`ticket`] (cancel / promote), and this file's
//! [`Engine`], the handle that opens the drives and submits requests.

mod completion;
pub mod config;
pub mod drive;
mod locate;
mod piece_hash;
mod repair;
pub mod repair_report;
mod replica;
pub mod request;
mod schedule;
mod shared;
pub mod ticket;
mod worker;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};

pub use config::{EngineConfig, HashCheck, Lane};
pub use drive::DriveStats;
pub use repair_report::{Repair, REPAIR_LOG_FILE};
pub use request::{Completion, Loaded, ReadBuf, Target};
pub use ticket::Ticket;

use crate::backend::IoFile;
use crate::buffer::{AlignedBuf, BufferPool};
use crate::engine::completion::{complete, finish_piece};
use crate::engine::drive::{Drive, Unavailable};
use crate::engine::piece_hash::PieceHashing;
use crate::engine::request::{BufPtr, InFlight, Job, PieceSlot};
use crate::engine::schedule::least_loaded;
use crate::engine::shared::Shared;
use crate::error::{Result, StorageError};
use crate::manifest::{Manifest, RecordEntry, RecordId, RecordTensor, DATA_FILE};
use crate::record_hash::RecordHash;
use crate::stripe::{align_up, Mode, Piece, ALIGN};

/// The engine over one layout's drives.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads_per_drive: usize,
    /// Kept to fail leftover jobs at shutdown.
    receivers: Arc<Vec<(Receiver<Job>, Receiver<Job>)>>,
}

impl Engine {
    /// Open every drive's data file named in `manifest.drives[i].path` (or `drive_paths`
    /// when given, e.g. drives mounted elsewhere) and start the workers.
    pub fn open(
        manifest: Arc<Manifest>,
        drive_paths: &[PathBuf],
        config: EngineConfig,
    ) -> Result<Engine> {
        if config.threads_per_drive == 0 {
            return Err(StorageError::InvalidArgument(
                "threads_per_drive must be at least 1".into(),
            ));
        }
        let mut drives = Vec::new();
        let mut receivers = Vec::new();
        let replicated = manifest.mode == Mode::Replicate && manifest.drives.len() > 1;
        let mut first_missing = None;
        for (i, entry) in manifest.drives.iter().enumerate() {
            let dir = drive_paths
                .get(i)
                .cloned()
                .unwrap_or_else(|| entry.path.clone());
            let path = dir.join(DATA_FILE);
            let skip = replicated && config.unavailable_drives.contains(&i);
            let opened = if skip {
                Err(std::io::Error::other("rejected when the layout was opened"))
            } else {
                config.backend.open(&path)
            };
            let (file, unavailable) = match opened {
                Ok(f) => (f, false),
                // A replica that cannot be opened is a drive whose every read fails: it starts
                // marked as failed, so the others serve its share.
                Err(e) if replicated => {
                    let reason = e.to_string();
                    first_missing.get_or_insert(StorageError::MissingDrive {
                        drive: i,
                        path: path.clone(),
                        reason: reason.clone(),
                    });
                    (Arc::new(Unavailable(reason)) as Arc<dyn IoFile>, true)
                }
                Err(e) => {
                    return Err(StorageError::MissingDrive {
                        drive: i,
                        path: path.clone(),
                        reason: e.to_string(),
                    })
                }
            };
            let (dtx, drx) = bounded(config.queue_capacity);
            let (ptx, prx) = bounded(config.queue_capacity);
            drives.push(Drive::new(
                path,
                file,
                [dtx, ptx],
                unavailable,
                config.replica_retry_after,
                config.clock.clone(),
            ));
            receivers.push((drx, prx));
        }
        if let Some(e) = first_missing {
            if drives.iter().all(|d| d.unavailable) {
                return Err(e); // no copy could be opened
            }
        }
        let index = manifest
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.id.clone(), i))
            .collect();
        let shared = Arc::new(Shared {
            manifest,
            drives,
            pool: BufferPool::new(config.buffer_cap_bytes),
            hash_check: config.hash_check,
            completed: AtomicU64::new(0),
            replica_recoveries: AtomicU64::new(0),
            index,
            repair: config.repair,
            backend: config.backend.clone(),
            repairs: Mutex::new(Vec::new()),
            repair_files: Mutex::new(HashMap::new()),
            prefetch_depth: match config.prefetch_depth {
                0 => config.threads_per_drive,
                n => n,
            },
        });
        let mut workers = Vec::new();
        let receivers = Arc::new(receivers);
        for d in 0..receivers.len() {
            for t in 0..config.threads_per_drive {
                let shared = shared.clone();
                let lanes = receivers.clone();
                let h = std::thread::Builder::new()
                    .name(format!("deltafin-io-d{d}-{t}"))
                    .spawn(move || worker::worker(shared, d, lanes))
                    .map_err(|e| StorageError::io(&PathBuf::from("<thread>"), "spawn", e))?;
                workers.push(h);
            }
        }
        Ok(Engine {
            shared,
            workers,
            threads_per_drive: config.threads_per_drive,
            receivers,
        })
    }

    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.shared.manifest
    }

    pub fn pool(&self) -> &BufferPool {
        &self.shared.pool
    }

    /// Index of a record in the manifest.
    pub fn record_index(&self, id: &RecordId) -> Option<usize> {
        self.shared.index.get(id).copied()
    }

    pub fn record(&self, index: usize) -> &RecordEntry {
        &self.shared.manifest.records[index]
    }

    pub fn record_tensors(&self, index: usize) -> &[RecordTensor] {
        let m = &self.shared.manifest;
        m.record_tensors(&m.records[index])
    }

    /// True when every drive's file is read with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.shared.drives.iter().all(|d| d.file.is_direct())
    }

    pub fn drive_count(&self) -> usize {
        self.shared.drives.len()
    }

    pub fn threads_per_drive(&self) -> usize {
        self.threads_per_drive
    }

    /// Which records get their hash (`record_hash`) checked as they land.
    pub fn hash_check(&self) -> HashCheck {
        self.shared.hash_check
    }

    /// Repairs of bad copies so far (see [`Repair`]).
    pub fn repairs(&self) -> Vec<Repair> {
        self.shared
            .repairs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn replica_recoveries(&self) -> u64 {
        self.shared.replica_recoveries.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> Vec<DriveStats> {
        self.shared.drives.iter().map(Drive::stats).collect()
    }

    /// The pieces a target is read as (drives chosen, nothing counted yet), its payload
    /// length and the hash to check it against.
    fn plan(&self, target: &Target) -> Result<(Vec<Piece>, usize, Option<RecordHash>)> {
        let sh = &self.shared;
        let placement = sh.manifest.placement();
        match target {
            Target::Record(i) => {
                let r = sh
                    .manifest
                    .records
                    .get(*i)
                    .ok_or_else(|| StorageError::UnknownRecord(format!("record index {i}")))?;
                let mut pieces = placement.pieces(r.offset, align_up(r.len));
                if placement.mode == Mode::Replicate {
                    // Spread the pieces over the least loaded drives, counting the ones
                    // already assigned here.
                    let mut extra = vec![0u64; sh.drives.len()];
                    for p in &mut pieces {
                        p.drive = least_loaded(&sh.drives, &extra);
                        extra[p.drive] += p.len;
                    }
                }
                // Manifest validation refused unparseable hashes; `None` would only skip a
                // check, so refuse the read instead.
                let hash =
                    RecordHash::from_manifest_hex(&r.hash, r.xxh3.as_deref()).ok_or_else(|| {
                        StorageError::InvalidArgument(format!("{}: unparseable record hash", r.id))
                    })?;
                Ok((pieces, r.len as usize, Some(hash)))
            }
            Target::Raw { drive, offset, len } => {
                if *drive >= sh.drives.len() || offset % ALIGN != 0 || len % ALIGN != 0 {
                    return Err(StorageError::InvalidArgument(format!(
                        "raw read {target:?}"
                    )));
                }
                let mut pieces = Vec::new();
                let mut pos = 0;
                while pos < *len {
                    let take = (len - pos).min(placement.unit);
                    pieces.push(Piece {
                        drive: *drive,
                        file_offset: offset + pos,
                        buf_offset: pos,
                        len: take,
                    });
                    pos += take;
                }
                Ok((pieces, *len as usize, None))
            }
        }
    }

    /// Queue a read. The completion goes to `done` (which must have room for it: workers block
    /// on a full channel). With `dest` the data lands in that buffer instead of a pooled one
    /// (for large resident tensors that should not count against the pool).
    ///
    /// Nothing is counted against a drive until every step that can fail has passed, so a
    /// refused request leaves the drives' load (which replicate mode balances on) untouched.
    pub fn submit(
        &self,
        target: Target,
        lane: Lane,
        tag: u64,
        done: Sender<Completion>,
        dest: Option<AlignedBuf>,
    ) -> Result<Ticket> {
        let sh = &self.shared;
        let (pieces, payload_len, hash) = self.plan(&target)?;
        let mut buf = match dest {
            Some(mut b) => {
                if b.capacity() < align_up(payload_len as u64) as usize {
                    return Err(StorageError::InvalidArgument(format!(
                        "destination buffer of {} bytes is smaller than {payload_len}",
                        b.capacity()
                    )));
                }
                b.set_len(payload_len);
                ReadBuf::Owned(b)
            }
            None => ReadBuf::Pooled(sh.pool.acquire(payload_len)?),
        };
        let check = match sh.hash_check {
            HashCheck::Off => false,
            HashCheck::All => true,
            HashCheck::Sampled(n) => sh
                .completed
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(u64::from(n)),
        };
        let expected_hash = hash.filter(|_| check);
        let hashing = expected_hash.as_ref().and_then(|want| {
            let spans = pieces.iter().map(|p| (p.buf_offset, p.len)).collect();
            PieceHashing::new(spans, payload_len, want)
        });
        let ptr = BufPtr(buf.as_mut_ptr());
        let n = pieces.len();
        for p in &pieces {
            sh.drives[p.drive]
                .outstanding
                .fetch_add(p.len, Ordering::Relaxed);
        }
        let req = Arc::new(InFlight {
            target,
            tag,
            payload_len,
            expected_hash,
            hashing,
            ptr,
            buf: Mutex::new(Some(buf)),
            pieces: pieces
                .into_iter()
                .map(|piece| PieceSlot {
                    piece,
                    claimed: AtomicBool::new(false),
                    served_by: AtomicUsize::new(piece.drive),
                })
                .collect(),
            remaining: AtomicUsize::new(n),
            cancelled: AtomicBool::new(false),
            lane: AtomicU8::new(lane as u8),
            error: Mutex::new(None),
            done,
        });
        if n == 0 {
            complete(sh, &req);
        }
        for i in 0..n {
            let d = &sh.drives[req.pieces[i].piece.drive];
            let job = Job::Read {
                req: req.clone(),
                piece: i,
            };
            if d.lanes[lane as usize].send(job).is_err() {
                // Shut down: fail the pieces not queued, so their load is uncounted and the
                // request completes.
                req.set_error(StorageError::EngineClosed);
                for k in i..n {
                    if !req.pieces[k].claimed.swap(true, Ordering::AcqRel) {
                        finish_piece(sh, &req, k);
                    }
                }
                return Err(StorageError::EngineClosed);
            }
        }
        Ok(Ticket {
            req,
            shared: sh.clone(),
        })
    }

    /// Fetch records on one lane; completions arrive on the returned receiver in landing order.
    pub fn fetch(
        &self,
        indices: &[usize],
        lane: Lane,
    ) -> Result<(Receiver<Completion>, Vec<Ticket>)> {
        let (tx, rx) = bounded(indices.len().max(1));
        let tickets = indices
            .iter()
            .map(|&i| self.submit(Target::Record(i), lane, i as u64, tx.clone(), None))
            .collect::<Result<Vec<_>>>()?;
        Ok((rx, tickets))
    }

    /// Fetch routed experts `experts` of decoder layer `layer` (each record's completion tag is
    /// its record index; see [`Engine::record`]). Unknown experts are refused before anything
    /// is queued.
    pub fn fetch_experts(
        &self,
        layer: u32,
        experts: &[u32],
        lane: Lane,
    ) -> Result<(Receiver<Completion>, Vec<Ticket>)> {
        let indices = experts
            .iter()
            .map(|&expert| {
                let id = RecordId::Expert { layer, expert };
                self.record_index(&id)
                    .ok_or_else(|| StorageError::UnknownRecord(id.to_string()))
            })
            .collect::<Result<Vec<usize>>>()?;
        self.fetch(&indices, lane)
    }

    /// Read one record and wait for it.
    pub fn read_record(&self, index: usize, dest: Option<AlignedBuf>) -> Result<Loaded> {
        let (tx, rx) = bounded(1);
        self.submit(Target::Record(index), Lane::Demand, index as u64, tx, dest)?;
        rx.recv().map_err(|_| StorageError::EngineClosed)?.result
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for d in &self.shared.drives {
            for _ in 0..self.threads_per_drive {
                let _ = d.lanes[Lane::Demand as usize].send(Job::Stop);
            }
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        // Fail what is still queued so no requester waits forever.
        for (demand, prefetch) in self.receivers.iter() {
            for j in demand.try_iter().chain(prefetch.try_iter()) {
                if let Job::Read { req, piece } = j {
                    if !req.pieces[piece].claimed.swap(true, Ordering::AcqRel) {
                        req.set_error(StorageError::EngineClosed);
                        finish_piece(&self.shared, &req, piece);
                    }
                }
            }
        }
    }
}
