//! Writing the logical byte space to the drives: one writer thread per drive fed over a bounded
//! channel, the space cut at stripe units (every unit to every drive when replicated), a blake3
//! hash per unit.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Sender};

use crate::error::{Result, StorageError};
use crate::layout::progress::Progress;
use crate::stripe::{Mode, Placement, ALIGN};

enum WriteMsg {
    Chunk { offset: u64, data: Arc<Vec<u8>> },
}

pub(crate) struct DriveWriter {
    tx: Option<Sender<WriteMsg>>,
    handle: Option<JoinHandle<Result<()>>>,
}

pub(crate) fn spawn_writer(index: usize, path: PathBuf, file: File) -> DriveWriter {
    let (tx, rx) = bounded::<WriteMsg>(32);
    let handle = std::thread::spawn(move || -> Result<()> {
        for msg in rx {
            let WriteMsg::Chunk { offset, data } = msg;
            file.write_all_at(&data, offset)
                .map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOSPC) => StorageError::InsufficientSpace {
                        drive: index,
                        path: path.clone(),
                        needed: offset + data.len() as u64,
                        available: offset,
                    },
                    _ => StorageError::Io {
                        path: path.clone(),
                        op: "write",
                        source: e,
                    },
                })?;
        }
        file.sync_all()
            .map_err(|e| StorageError::io(&path, "fsync", e))
    });
    DriveWriter {
        tx: Some(tx),
        handle: Some(handle),
    }
}

/// Streams the logical space to the drives, cutting it at stripe units, hashing units.
pub(crate) struct LogicalWriter<'a> {
    placement: Placement,
    writers: Vec<DriveWriter>,
    pos: u64,
    unit_hasher: blake3::Hasher,
    unit_hashes: Vec<u8>,
    progress: &'a dyn Progress,
}

impl<'a> LogicalWriter<'a> {
    /// A writer of `logical_len` bytes over `writers` (one per drive, in drive order).
    pub fn new(
        placement: Placement,
        writers: Vec<DriveWriter>,
        logical_len: u64,
        progress: &'a dyn Progress,
    ) -> Self {
        let units = placement.unit_count(logical_len);
        LogicalWriter {
            placement,
            writers,
            pos: 0,
            unit_hasher: blake3::Hasher::new(),
            unit_hashes: Vec::with_capacity(units as usize * 32),
            progress,
        }
    }

    pub fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let within = self.pos % self.placement.unit;
            let take = ((self.placement.unit - within) as usize).min(data.len());
            let (chunk, rest) = data.split_at(take);
            self.unit_hasher.update(chunk);
            let (drive, base) = self.placement.unit_location(self.pos / self.placement.unit);
            let shared = Arc::new(chunk.to_vec());
            let targets: Vec<usize> = match self.placement.mode {
                Mode::Replicate => (0..self.writers.len()).collect(),
                Mode::Stripe => vec![drive],
            };
            for d in targets {
                self.send(d, base + within, shared.clone())?;
            }
            self.pos += take as u64;
            if self.pos.is_multiple_of(self.placement.unit) {
                self.close_unit();
            }
            self.progress.advance(take as u64);
            data = rest;
        }
        Ok(())
    }

    fn close_unit(&mut self) {
        let h = std::mem::take(&mut self.unit_hasher).finalize();
        self.unit_hashes.extend_from_slice(h.as_bytes());
    }

    fn send(&mut self, d: usize, offset: u64, data: Arc<Vec<u8>>) -> Result<()> {
        let w = &mut self.writers[d];
        let ok =
            w.tx.as_ref()
                .is_some_and(|tx| tx.send(WriteMsg::Chunk { offset, data }).is_ok());
        if ok {
            return Ok(());
        }
        // The writer stopped: surface its error.
        w.tx = None;
        match w.handle.take().map(|h| h.join()) {
            Some(Ok(Err(e))) => Err(e),
            _ => Err(StorageError::InvalidArgument(format!(
                "writer for drive {d} stopped"
            ))),
        }
    }

    pub fn pad_to(&mut self, target: u64) -> Result<()> {
        const ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(ZEROS.len());
            self.write(&ZEROS[..n])?;
        }
        Ok(())
    }

    /// Close the last unit, wait for every drive writer (fsync) and return the unit hashes.
    pub fn finish(mut self) -> Result<Vec<u8>> {
        if !self.pos.is_multiple_of(self.placement.unit) {
            self.close_unit();
        }
        let mut first_err = None;
        for w in &mut self.writers {
            w.tx = None;
            if let Some(h) = w.handle.take() {
                let r = h.join().unwrap_or_else(|_| {
                    Err(StorageError::InvalidArgument("writer panicked".into()))
                });
                if let (Err(e), None) = (r, &first_err) {
                    first_err = Some(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(self.unit_hashes),
        }
    }
}
