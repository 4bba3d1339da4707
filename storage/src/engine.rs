//! The read engine: per-drive pools of `pread` worker threads fed over bounded crossbeam
//! channels, two priority lanes, aligned pooled buffers filled in place, optional blake3 checks.
//!
//! A request names a record of the manifest (or, for `verify`, a raw range of one drive). It is
//! cut into pieces at stripe-unit boundaries; each piece goes to a drive's demand or prefetch
//! lane (replicate mode: the drive with the fewest outstanding bytes). Workers always drain the
//! demand lane first. Every worker writes straight into its piece's slice of the record's buffer
//! (no copy after the kernel fills it); the worker that lands the last piece checks the hash if
//! asked and sends the finished [`Loaded`] on the requester's channel, so a consumer can start on
//! the first record to land.
//!
//! Replicate mode tolerates a failing copy: a piece whose read fails is read from the other
//! drives in turn (the failing drive then gets no new pieces while a healthy one remains), and a
//! record whose bytes fail their hash is read again whole from each drive until a copy matches.
//! Only when every copy fails does the request fail, naming each drive's error. A replica whose
//! data file cannot be opened at all starts out failed (see `layout::open_layout_degraded`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select_biased, Receiver, Sender};

use crate::backend::{IoBackend, IoFile, PosixBackend};
use crate::buffer::{AlignedBuf, BufferPool, PooledBuf};
use crate::error::{Result, StorageError};
use crate::manifest::{Manifest, RecordEntry, RecordId, RecordTensor, DATA_FILE};
use crate::stripe::{align_up, Mode, Piece};

/// Which queue a request waits in. Demand always overtakes prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Demand = 0,
    Prefetch = 1,
}

/// How many completed records get their blake3 checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashCheck {
    Off,
    /// One record in every N.
    Sampled(u32),
    All,
}

impl std::str::FromStr for HashCheck {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(HashCheck::Off),
            "all" => Ok(HashCheck::All),
            s => s
                .strip_prefix("sampled")
                .map(|n| n.trim_start_matches([':', '=']))
                .map(|n| {
                    if n.is_empty() {
                        Ok(16)
                    } else {
                        n.parse::<u32>()
                    }
                })
                .and_then(|r| r.ok())
                .filter(|&n| n > 0)
                .map(HashCheck::Sampled)
                .ok_or_else(|| format!("hash check `{s}`: use off, all or sampled[:N]")),
        }
    }
}

/// Engine tuning. Defaults were chosen by measurement (see README, `benches/`).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Worker threads per drive = reads in flight per drive (the queue depth).
    pub threads_per_drive: usize,
    /// Hard cap on bytes of pooled buffers (in flight plus cached).
    pub buffer_cap_bytes: u64,
    /// Pending pieces each lane of each drive can hold before `submit` blocks.
    pub queue_capacity: usize,
    pub hash_check: HashCheck,
    pub backend: Arc<dyn IoBackend>,
    /// Replicate mode: after a read error a drive gets no new pieces (while another replica is
    /// healthy) for this long, then it is tried again; a drive that keeps failing is retried
    /// once per period.
    pub replica_retry_after: Duration,
    /// Replicate mode: drives not to read at all (copies that `open_layout_degraded` found
    /// missing, foreign or truncated); the others serve every record.
    pub unavailable_drives: Vec<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads_per_drive: 4,
            buffer_cap_bytes: 1 << 30,
            queue_capacity: 8192,
            hash_check: HashCheck::Sampled(16),
            backend: Arc::new(PosixBackend::default()),
            replica_retry_after: Duration::from_secs(10),
            unavailable_drives: Vec::new(),
        }
    }
}

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
    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            ReadBuf::Pooled(b) => b.inner_mut().as_mut_ptr(),
            ReadBuf::Owned(b) => b.as_mut_ptr(),
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
    /// True when the blake3 of the payload was checked (and matched).
    pub verified: bool,
}

/// A completion: the tag and either the data or what went wrong.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub target: Target,
    pub result: Result<Loaded>,
}

/// Per-drive counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DriveStats {
    pub bytes_read: u64,
    pub reads: u64,
    /// Wall time with at least one read in flight on this drive.
    pub busy: Duration,
    pub direct_io: bool,
    /// Failed reads on this drive: I/O errors, short reads, and (replicate mode) copies of a
    /// record that failed their hash when re-read.
    pub read_errors: u64,
}

#[derive(Debug, Default)]
struct BusyClock {
    active: u32,
    since: Option<Instant>,
    total: Duration,
}

#[derive(Debug)]
struct Drive {
    path: PathBuf,
    file: Arc<dyn IoFile>,
    lanes: [Sender<Job>; 2],
    outstanding: AtomicU64,
    bytes_read: AtomicU64,
    reads: AtomicU64,
    /// Reads of this drive that failed (I/O error or short read).
    read_errors: AtomicU64,
    /// When the last read failed: milliseconds after `epoch`, plus one (0: never).
    failed_at_ms: AtomicU64,
    /// Never read: a replica that could not be opened or that the layout check rejected.
    unavailable: bool,
    epoch: Instant,
    retry_after: Duration,
    busy: Mutex<BusyClock>,
}

impl Drive {
    /// No read error within the last `retry_after` (replicate mode sends pieces to healthy
    /// drives while there are any).
    fn healthy(&self) -> bool {
        if self.unavailable {
            return false;
        }
        match self.failed_at_ms.load(Ordering::Relaxed) {
            0 => true,
            at => {
                let retry = u64::try_from(self.retry_after.as_millis()).unwrap_or(u64::MAX);
                self.now_ms().saturating_sub(at) >= retry.max(1)
            }
        }
    }

    /// Count a failed read and keep new pieces off this drive for `retry_after`.
    fn mark_failed(&self) {
        self.read_errors.fetch_add(1, Ordering::Relaxed);
        self.failed_at_ms
            .fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// Milliseconds since `epoch`, plus one (so that 0 can mean "never").
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn busy_enter(&self) {
        let mut b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if b.active == 0 {
            b.since = Some(Instant::now());
        }
        b.active += 1;
    }

    fn busy_leave(&self) {
        let mut b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        b.active -= 1;
        if b.active == 0 {
            if let Some(s) = b.since.take() {
                b.total += s.elapsed();
            }
        }
    }
}

#[derive(Debug)]
enum Job {
    Read { req: Arc<InFlight>, piece: usize },
    Stop,
}

#[derive(Debug)]
struct PieceSlot {
    piece: Piece,
    claimed: AtomicBool,
    /// The drive that served the piece (replicate mode may read it anywhere).
    served_by: AtomicUsize,
}

/// Raw pointer to a request's buffer. Workers write disjoint ranges through it.
#[derive(Debug, Clone, Copy)]
struct BufPtr(*mut u8);
// SAFETY: the pointer targets a heap buffer owned by the InFlight that outlives every job
// holding it; each piece writes a disjoint range, and the buffer is only read after the last
// piece's `remaining` decrement (AcqRel) has ordered all writes before the read.
unsafe impl Send for BufPtr {}
// SAFETY: as above.
unsafe impl Sync for BufPtr {}

#[derive(Debug)]
struct InFlight {
    target: Target,
    tag: u64,
    payload_len: usize,
    expected_hash: Option<String>,
    ptr: BufPtr,
    buf: Mutex<Option<ReadBuf>>,
    pieces: Vec<PieceSlot>,
    remaining: AtomicUsize,
    cancelled: AtomicBool,
    lane: AtomicU8,
    error: Mutex<Option<StorageError>>,
    done: Sender<Completion>,
}

#[derive(Debug)]
struct Shared {
    manifest: Arc<Manifest>,
    drives: Vec<Drive>,
    pool: BufferPool,
    hash_check: HashCheck,
    completed: AtomicU64,
    index: HashMap<RecordId, usize>,
    /// Pieces or records served by another replica after a read error or a hash mismatch.
    replica_recoveries: AtomicU64,
}

/// A handle to an in-flight request: cancel it (if not started) or promote it to demand.
#[derive(Debug, Clone)]
pub struct Ticket {
    req: Arc<InFlight>,
    shared: Arc<Shared>,
}

impl Ticket {
    /// Cancel every piece not yet started; started pieces finish. The requester then receives
    /// `Err(Cancelled)` unless the whole request had already been read.
    pub fn cancel(&self) {
        self.req.cancelled.store(true, Ordering::Release);
        for (i, slot) in self.req.pieces.iter().enumerate() {
            if !slot.claimed.swap(true, Ordering::AcqRel) {
                finish_piece(&self.shared, &self.req, i, false);
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

    pub fn tag(&self) -> u64 {
        self.req.tag
    }
}

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
            drives.push(Drive {
                path,
                file,
                lanes: [dtx, ptx],
                outstanding: AtomicU64::new(0),
                bytes_read: AtomicU64::new(0),
                reads: AtomicU64::new(0),
                read_errors: AtomicU64::new(0),
                failed_at_ms: AtomicU64::new(0),
                unavailable,
                epoch: Instant::now(),
                retry_after: config.replica_retry_after,
                busy: Mutex::new(BusyClock::default()),
            });

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
        });
        let mut workers = Vec::new();
        let receivers = Arc::new(receivers);
        for d in 0..receivers.len() {
            for t in 0..config.threads_per_drive {
                let shared = shared.clone();
                let lanes = receivers.clone();
                let h = std::thread::Builder::new()
                    .name(format!("deltafin-io-d{d}-{t}"))
                    .spawn(move || worker(shared, d, lanes))
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

    /// Reads (pieces after an I/O error, whole records after a hash mismatch) that another
    /// replica served (replicate mode).
    pub fn replica_recoveries(&self) -> u64 {
        self.shared.replica_recoveries.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> Vec<DriveStats> {
        self.shared
            .drives
            .iter()
            .map(|d| {
                let b = d.busy.lock().unwrap_or_else(|p| p.into_inner());
                let busy = b.total + b.since.map(|s| s.elapsed()).unwrap_or_default();
                DriveStats {
                    bytes_read: d.bytes_read.load(Ordering::Relaxed),
                    reads: d.reads.load(Ordering::Relaxed),
                    busy,
                    direct_io: d.file.is_direct(),
                    read_errors: d.read_errors.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Queue a read. The completion goes to `done` (which must have room for it: workers block
    /// on a full channel). With `dest` the data lands in that buffer instead of a pooled one
    /// (for large resident tensors that should not count against the pool).
    pub fn submit(
        &self,
        target: Target,
        lane: Lane,
        tag: u64,
        done: Sender<Completion>,
        dest: Option<AlignedBuf>,
    ) -> Result<Ticket> {
        let sh = &self.shared;
        let placement = sh.manifest.placement();
        let (pieces, payload_len, expected_hash) = match &target {
            Target::Record(i) => {
                let r = sh
                    .manifest
                    .records
                    .get(*i)
                    .ok_or_else(|| StorageError::UnknownRecord(format!("record index {i}")))?;
                let check = match sh.hash_check {
                    HashCheck::Off => false,
                    HashCheck::All => true,
                    HashCheck::Sampled(n) => sh
                        .completed
                        .fetch_add(1, Ordering::Relaxed)
                        .is_multiple_of(u64::from(n)),
                };
                let mut pieces = placement.pieces(r.offset, align_up(r.len));
                if placement.mode == Mode::Replicate {
                    for p in &mut pieces {
                        p.drive = least_loaded(&sh.drives);
                        sh.drives[p.drive]
                            .outstanding
                            .fetch_add(p.len, Ordering::Relaxed);
                    }
                } else {
                    for p in &pieces {
                        sh.drives[p.drive]
                            .outstanding
                            .fetch_add(p.len, Ordering::Relaxed);
                    }
                }
                (pieces, r.len as usize, check.then(|| r.hash.clone()))
            }
            Target::Raw { drive, offset, len } => {
                if *drive >= sh.drives.len()
                    || offset % crate::stripe::ALIGN != 0
                    || len % crate::stripe::ALIGN != 0
                {
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
                    sh.drives[*drive]
                        .outstanding
                        .fetch_add(take, Ordering::Relaxed);
                    pos += take;
                }
                (pieces, *len as usize, None)
            }
        };
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
        let ptr = BufPtr(buf.as_mut_ptr());
        let n = pieces.len();
        let req = Arc::new(InFlight {
            target,
            tag,
            payload_len,
            expected_hash,
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
            if d.lanes[lane as usize]
                .send(Job::Read {
                    req: req.clone(),
                    piece: i,
                })
                .is_err()
            {
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
                        set_error(&req, StorageError::EngineClosed);
                        finish_piece(&self.shared, &req, piece, false);
                    }
                }
            }
        }
    }
}

/// Stands in for a replica whose data file could not be opened: every read fails.
#[derive(Debug)]
struct Unavailable(String);

impl IoFile for Unavailable {
    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> std::io::Result<usize> {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("drive unavailable: {}", self.0),
        ))
    }

    fn is_direct(&self) -> bool {
        true // it reads nothing, so nothing through the page cache
    }
}

/// The drive with the fewest outstanding bytes, among the drives without a recent read error
/// if any (replicate mode).
fn least_loaded(drives: &[Drive]) -> usize {
    let any_healthy = drives.iter().any(Drive::healthy);
    let mut best = 0;
    let mut best_bytes = u64::MAX;
    for (i, d) in drives.iter().enumerate() {
        if d.unavailable || (any_healthy && !d.healthy()) {
            continue;
        }
        let o = d.outstanding.load(Ordering::Relaxed);
        if o < best_bytes {
            best = i;
            best_bytes = o;
        }
    }
    best
}

/// Replicate mode: read `dst` at `offset` from the replicas other than `failed`, in drive
/// order, after `failed` returned `first`. Returns the drive that served it, or every error.
fn read_other_replica(
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
        drive.busy_enter();
        let r = read_full(drive, o, dst, offset);
        drive.busy_leave();
        match r {
            Ok(()) => {
                drive
                    .bytes_read
                    .fetch_add(dst.len() as u64, Ordering::Relaxed);
                drive.reads.fetch_add(1, Ordering::Relaxed);
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

/// Take the next job for drive `d`'s worker: own demand, (replicate: other drives' demand),
/// own prefetch, (replicate: other drives' prefetch), else wait. Returns `None` to exit.
///
/// In replicate mode every drive holds every byte, so an idle worker steals pieces queued for a
/// busier drive: the submit-time choice (fewest outstanding bytes) balances equal drives, and
/// stealing corrects it when one drive turns out slower.
fn next_job(
    shared: &Shared,
    d: usize,
    lanes: &[(Receiver<Job>, Receiver<Job>)],
    steal: bool,
) -> Option<Job> {
    let (demand, prefetch) = &lanes[d];
    loop {
        if let Ok(j) = demand.try_recv() {
            return Some(j);
        }
        if steal {
            for lane in [0usize, 1] {
                if lane == 1 {
                    if let Ok(j) = prefetch.try_recv() {
                        return Some(j);
                    }
                }
                for (o, pair) in lanes.iter().enumerate() {
                    if o == d {
                        continue;
                    }
                    let rx = if lane == 0 { &pair.0 } else { &pair.1 };
                    match rx.try_recv() {
                        Ok(Job::Stop) => {
                            // Another worker's stop: give it back; shutdown is under way.
                            let _ = shared.drives[o].lanes[0].send(Job::Stop);
                            return None;
                        }
                        Ok(j) => return Some(j),
                        Err(_) => {}
                    }
                }
            }
            // Nothing anywhere: wait on our own lanes, waking now and then to look for work to steal.
            select_biased! {
                recv(demand) -> j => return j.ok(),
                recv(prefetch) -> j => return j.ok(),
                default(Duration::from_millis(1)) => continue,
            }
        }
        return select_biased! {
            recv(demand) -> j => j.ok(),
            recv(prefetch) -> j => j.ok(),
        };
    }
}

fn worker(shared: Arc<Shared>, d: usize, lanes: Arc<Vec<(Receiver<Job>, Receiver<Job>)>>) {
    let steal = shared.manifest.mode == Mode::Replicate && lanes.len() > 1;
    while let Some(job) = next_job(&shared, d, &lanes, steal) {
        let (req, piece) = match job {
            Job::Stop => return,
            Job::Read { req, piece } => (req, piece),
        };
        let slot = &req.pieces[piece];
        if slot.claimed.swap(true, Ordering::AcqRel) {
            continue; // already read through the other lane, or cancelled
        }
        if req.cancelled.load(Ordering::Acquire) {
            finish_piece(&shared, &req, piece, false);
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
            least_loaded(&shared.drives)
        };
        let drive = &shared.drives[rd];
        // SAFETY: [buf_offset, buf_offset+len) lies within the buffer's capacity (pieces cover
        // the aligned payload length, which the buffer was sized for), no other piece overlaps
        // it, and the buffer is not read until every piece is finished.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(req.ptr.0.add(p.buf_offset as usize), p.len as usize)
        };
        drive.busy_enter();
        let result = read_full(drive, rd, dst, p.file_offset);
        drive.busy_leave();
        match result {
            Ok(()) => {
                drive.bytes_read.fetch_add(p.len, Ordering::Relaxed);
                drive.reads.fetch_add(1, Ordering::Relaxed);
                slot.served_by.store(rd, Ordering::Relaxed);
            }
            Err(e) => {
                drive.mark_failed();
                // Every drive of a replicated layout holds the same bytes at the same offset.
                let recovered = if shared.manifest.mode == Mode::Replicate
                    && matches!(req.target, Target::Record(_))
                    && shared.drives.len() > 1
                {
                    read_other_replica(&shared, rd, dst, p.file_offset, e)
                } else {
                    Err(e)
                };
                match recovered {
                    Ok(o) => slot.served_by.store(o, Ordering::Relaxed),
                    Err(e) => set_error(&req, e),
                }
            }
        }
        finish_piece(&shared, &req, piece, true);
    }
}

fn read_full(drive: &Drive, d: usize, dst: &mut [u8], offset: u64) -> Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        match drive.file.read_at(&mut dst[done..], offset + done as u64) {
            Ok(0) => {
                return Err(StorageError::ShortRead {
                    drive: d,
                    path: drive.path.clone(),
                    offset,
                    len: dst.len() as u64,
                    got: done as u64,
                })
            }
            Ok(n) => done += n,
            Err(e) => {
                return Err(StorageError::Read {
                    drive: d,
                    path: drive.path.clone(),
                    offset: offset + done as u64,
                    len: (dst.len() - done) as u64,
                    source: e,
                })
            }
        }
    }
    Ok(())
}

fn set_error(req: &InFlight, e: StorageError) {
    let mut slot = req.error.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() {
        *slot = Some(e);
    }
}

/// Account for one finished (or skipped) piece; the last one completes the request.
fn finish_piece(shared: &Shared, req: &Arc<InFlight>, piece: usize, _read: bool) {
    let p = req.pieces[piece].piece;
    shared.drives[p.drive]
        .outstanding
        .fetch_sub(p.len, Ordering::Relaxed);
    if req.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        complete(shared, req);
    }
}

fn complete(shared: &Shared, req: &Arc<InFlight>) {
    let buf = req.buf.lock().unwrap_or_else(|p| p.into_inner()).take();
    let error = req.error.lock().unwrap_or_else(|p| p.into_inner()).take();
    let result = match (buf, error) {
        (_, Some(e)) => Err(e),
        (None, None) => Err(StorageError::EngineClosed),
        (Some(_), None) if req.cancelled.load(Ordering::Acquire) => Err(StorageError::Cancelled),
        (Some(buf), None) => match &req.expected_hash {
            Some(want) => {
                let got = blake3::hash(&buf[..req.payload_len]);
                if got.to_hex().as_str() == want {
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
    let _ = req.done.send(Completion {
        tag: req.tag,
        target: req.target.clone(),
        result,
    });
}

/// A record whose bytes did not match its hash: in replicate mode read it again whole from
/// each drive in turn (silent corruption is per copy) and return the first copy that matches;
/// otherwise, or if none does, the mismatch error.
fn recover_record(shared: &Shared, req: &InFlight, mut buf: ReadBuf) -> Result<Loaded> {
    let replicated = shared.manifest.mode == Mode::Replicate && shared.drives.len() > 1;
    if let (true, Target::Record(_), Some(want)) = (replicated, &req.target, &req.expected_hash) {
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
                drive.busy_enter();
                let r = read_full(drive, k, dst, p.file_offset);
                drive.busy_leave();
                if r.is_err() {
                    drive.mark_failed();
                    ok = false;
                    break;
                }
                drive.bytes_read.fetch_add(p.len, Ordering::Relaxed);
                drive.reads.fetch_add(1, Ordering::Relaxed);
            }
            if !ok {
                continue;
            }
            if blake3::hash(&buf[..req.payload_len]).to_hex().as_str() != want {
                // This whole copy of the record is corrupt: count it and rest the drive.
                drive.mark_failed();
                continue;
            }
            // Rest every drive that served a piece that differs from the good copy.
            for (slot, h) in req.pieces.iter().zip(&first) {
                if blake3::hash(piece_bytes(slot.piece)) != *h {
                    shared.drives[slot.served_by.load(Ordering::Relaxed)].mark_failed();
                }
            }
            shared.replica_recoveries.fetch_add(1, Ordering::Relaxed);
            return Ok(Loaded {
                target: req.target.clone(),
                tag: req.tag,
                buf,
                verified: true,
            });
        }
    }
    Err(hash_mismatch(shared, &req.target, &req.pieces))
}

fn hash_mismatch(shared: &Shared, target: &Target, pieces: &[PieceSlot]) -> StorageError {
    let first = pieces
        .first()
        .map(|s| (s.served_by.load(Ordering::Relaxed), s.piece.file_offset));
    let (drive, offset) = first.unwrap_or((0, 0));
    let (what, len) = match target {
        Target::Record(i) => {
            let r = &shared.manifest.records[*i];
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
                    "{} (logical offset {}, read from drives {drives:?})",
                    r.id, r.offset
                ),
                r.len,
            )
        }
        Target::Raw { len, .. } => ("raw range".to_string(), *len),
    };
    StorageError::HashMismatch {
        what,
        drive,
        path: shared.drives[drive].path.clone(),
        offset,
        len,
    }
}
