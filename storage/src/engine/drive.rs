//! One drive of an engine: its data file, its two lanes, its counters and its health (replicate
//! mode keeps new pieces off a drive for a while after it fails a read).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::backend::IoFile;
use crate::clock::Clock;
use crate::engine::request::Job;
use crate::error::{Result, StorageError};

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
    /// Bytes of pieces queued to or being read by this drive right now.
    pub outstanding: u64,
}

impl std::ops::Sub for &DriveStats {
    type Output = DriveStats;
    /// The counters accumulated between `rhs` and `self` (`direct_io` and `outstanding` are
    /// taken from `self`).
    fn sub(self, rhs: &DriveStats) -> DriveStats {
        DriveStats {
            bytes_read: self.bytes_read.saturating_sub(rhs.bytes_read),
            reads: self.reads.saturating_sub(rhs.reads),
            busy: self.busy.saturating_sub(rhs.busy),
            direct_io: self.direct_io,
            read_errors: self.read_errors.saturating_sub(rhs.read_errors),
            outstanding: self.outstanding,
        }
    }
}

/// Wall time with at least one read in flight.
#[derive(Debug, Default)]
struct BusyClock {
    active: u32,
    since: Option<Instant>,
    total: Duration,
}

#[derive(Debug)]
pub(crate) struct Drive {
    pub path: PathBuf,
    pub file: Arc<dyn IoFile>,
    pub lanes: [Sender<Job>; 2],
    pub outstanding: AtomicU64,
    pub bytes_read: AtomicU64,
    pub reads: AtomicU64,
    /// Prefetch-lane pieces being read now or about to be (`Shared::prefetch_depth` at most).
    pub prefetch_in_flight: AtomicUsize,
    /// Reads of this drive that failed (I/O error or short read).
    read_errors: AtomicU64,
    /// When the last read failed: milliseconds on `clock`, plus one (0: never).
    failed_at_ms: AtomicU64,
    /// Never read: a replica that could not be opened or that the layout check rejected.
    pub unavailable: bool,
    clock: Arc<dyn Clock>,
    retry_after: Duration,
    busy: Mutex<BusyClock>,
}

impl Drive {
    pub fn new(
        path: PathBuf,
        file: Arc<dyn IoFile>,
        lanes: [Sender<Job>; 2],
        unavailable: bool,
        retry_after: Duration,
        clock: Arc<dyn Clock>,
    ) -> Drive {
        Drive {
            path,
            file,
            lanes,
            outstanding: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            prefetch_in_flight: AtomicUsize::new(0),
            read_errors: AtomicU64::new(0),
            failed_at_ms: AtomicU64::new(0),
            unavailable,
            clock,
            retry_after,
            busy: Mutex::new(BusyClock::default()),
        }
    }

    /// No read error within the last `retry_after` (replicate mode sends pieces to healthy
    /// drives while there are any).
    pub fn healthy(&self) -> bool {
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
    pub fn mark_failed(&self) {
        self.read_errors.fetch_add(1, Ordering::Relaxed);
        self.failed_at_ms
            .fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// Milliseconds on the clock, plus one (so that 0 can mean "never").
    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    /// Read `dst.len()` bytes at `offset`, timing the drive as busy; `d` is its index (errors
    /// name it). Counts the bytes on success.
    pub fn read(&self, d: usize, dst: &mut [u8], offset: u64) -> Result<()> {
        self.busy_enter();
        let r = self.read_full(d, dst, offset);
        self.busy_leave();
        if r.is_ok() {
            self.bytes_read
                .fetch_add(dst.len() as u64, Ordering::Relaxed);
            self.reads.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn read_full(&self, d: usize, dst: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0usize;
        while done < dst.len() {
            match self.file.read_at(&mut dst[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(StorageError::ShortRead {
                        drive: d,
                        path: self.path.clone(),
                        offset,
                        len: dst.len() as u64,
                        got: done as u64,
                    })
                }
                Ok(n) => done += n,
                Err(e) => {
                    return Err(StorageError::Read {
                        drive: d,
                        path: self.path.clone(),
                        offset: offset + done as u64,
                        len: (dst.len() - done) as u64,
                        source: e,
                    })
                }
            }
        }
        Ok(())
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

    pub fn stats(&self) -> DriveStats {
        let b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let busy = b.total + b.since.map(|s| s.elapsed()).unwrap_or_default();
        DriveStats {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            busy,
            direct_io: self.file.is_direct(),
            read_errors: self.read_errors.load(Ordering::Relaxed),
            outstanding: self.outstanding.load(Ordering::Relaxed),
        }
    }
}

/// Stands in for a replica whose data file could not be opened: every read fails.
#[derive(Debug)]
pub(crate) struct Unavailable(pub String);

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
