//! Read benchmarks of a layout through the engine, for `deltafin bench io`: routed experts read
//! the way decoding reads them (k experts of a random MoE layer per batch, the next batch
//! already queued, as with prefetch), or every record in layout order.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use crate::engine::{DriveStats, Engine, EngineConfig, HashCheck, Lane, Target};
use crate::error::{Result, StorageError};
use crate::layout::open_layout;
use crate::manifest::{Manifest, RecordId, DATA_FILE};
use crate::stripe::align_up;

/// Bytes and records read in some time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadMeasure {
    pub bytes: u64,
    pub records: u64,
    pub secs: f64,
}

impl std::ops::AddAssign<&ReadMeasure> for ReadMeasure {
    fn add_assign(&mut self, rhs: &ReadMeasure) {
        self.bytes += rhs.bytes;
        self.records += rhs.records;
        self.secs += rhs.secs;
    }
}

/// A layout opened for read benchmarks.
#[derive(Debug)]
pub struct ReadBench {
    engine: Engine,
    dirs: Vec<PathBuf>,
    /// Record indices of each MoE layer's experts.
    layers: Vec<Vec<usize>>,
}

/// xorshift64: reproducible expert picks.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

impl ReadBench {
    /// Open the layout at `path` (any drive's copy) with `threads_per_drive` readers per drive,
    /// `buffer_cap` bytes of buffers and hash checks `hash`.
    pub fn open(
        path: &Path,
        threads_per_drive: usize,
        buffer_cap: u64,
        hash: HashCheck,
    ) -> Result<ReadBench> {
        let (manifest, dirs) = open_layout(path)?;
        let mut layers: Vec<Vec<usize>> = Vec::new();
        let mut last_layer = None;
        for (i, r) in manifest.records.iter().enumerate() {
            if let RecordId::Expert { layer, .. } = r.id {
                if last_layer != Some(layer) {
                    layers.push(Vec::new());
                    last_layer = Some(layer);
                }
                if let Some(l) = layers.last_mut() {
                    l.push(i);
                }
            }
        }
        let config = EngineConfig {
            threads_per_drive,
            buffer_cap_bytes: buffer_cap,
            hash_check: hash,
            ..EngineConfig::default()
        };
        let engine = Engine::open(Arc::new(manifest), &dirs, config)?;
        Ok(ReadBench {
            engine,
            dirs,
            layers,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        self.engine.manifest()
    }

    /// The layout folder on each drive.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Each drive's data file (for fio).
    pub fn data_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join(DATA_FILE)).collect()
    }

    /// Whether every drive is read with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.engine.direct_io()
    }

    /// Payload bytes of the first expert record (0 without experts).
    pub fn expert_record_len(&self) -> u64 {
        self.layers
            .first()
            .and_then(|l| l.first())
            .map_or(0, |&i| self.engine.record(i).len)
    }

    /// The size of one read as the engine issues it: a stripe unit, or the whole record when
    /// smaller (what fio is given for comparison).
    pub fn read_size(&self) -> u64 {
        self.manifest()
            .stripe_unit
            .min(align_up(self.expert_record_len()))
    }

    pub fn drive_stats(&self) -> Vec<DriveStats> {
        self.engine.stats()
    }

    /// For `dur`: batches of `k` random experts of a random MoE layer, `inflight` batches
    /// queued at once.
    pub fn experts(
        &self,
        k: usize,
        inflight: usize,
        dur: Duration,
        seed: u64,
    ) -> Result<ReadMeasure> {
        if self.layers.is_empty() {
            return Err(StorageError::InvalidArgument(format!(
                "layout {} has no routed experts",
                self.manifest().name
            )));
        }
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut queue = VecDeque::new();
        let mut m = ReadMeasure::default();
        let start = Instant::now();
        loop {
            while queue.len() < inflight.max(1) && start.elapsed() < dur {
                let layer = &self.layers[rng.below(self.layers.len())];
                let mut pick: Vec<usize> = Vec::with_capacity(k);
                while pick.len() < k.min(layer.len()) {
                    let e = layer[rng.below(layer.len())];
                    if !pick.contains(&e) {
                        pick.push(e);
                    }
                }
                let (rx, _tickets) = self.engine.fetch(&pick, Lane::Demand)?;
                queue.push_back((rx, pick.len()));
            }
            let Some((rx, n)) = queue.pop_front() else {
                break;
            };
            for c in rx.iter().take(n) {
                m.bytes += c.result?.buf.len() as u64;
                m.records += 1;
            }
        }
        m.secs = start.elapsed().as_secs_f64();
        Ok(m)
    }

    /// For `dur`: every record in layout order (wrapping around), two reads per reader in
    /// flight.
    pub fn sequential(&self, dur: Duration) -> Result<ReadMeasure> {
        let n = self.manifest().records.len();
        let window = self.engine.drive_count() * self.engine.threads_per_drive() * 2;
        let (tx, rx) = bounded(window + 1);
        let (mut next, mut inflight) = (0usize, 0usize);
        let mut m = ReadMeasure::default();
        let start = Instant::now();
        loop {
            while n > 0 && inflight < window && start.elapsed() < dur {
                self.engine
                    .submit(Target::Record(next % n), Lane::Demand, 0, tx.clone(), None)?;
                next += 1;
                inflight += 1;
            }
            if inflight == 0 {
                break;
            }
            let c = rx.recv().map_err(|_| StorageError::EngineClosed)?;
            inflight -= 1;
            m.bytes += c.result?.buf.len() as u64;
            m.records += 1;
        }
        m.secs = start.elapsed().as_secs_f64();
        Ok(m)
    }
}
