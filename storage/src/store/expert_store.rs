//! [`ExpertStore`]: routed experts of a layout, read through the engine under a byte budget,
//! cached, prefetched on request, and handed to the consumer in landing order.
//!
//! The store opens the layout (from any drive's copy; a replicated one with drives missing),
//! starts the engine, loads the resident set on request, and serves two calls (in
//! [`crate::store::reads`]):
//! - [`ExpertStore::fetch`]`(layer, experts)`: an [`ExpertBatch`], an iterator yielding each
//!   requested expert once, cached ones first, then reads in the order they land;
//! - [`ExpertStore::prefetch`]`(layer, experts)`: low-priority reads of predicted experts,
//!   promoted if the layer then asks for them, cancelled (if not started) if it asks for
//!   others, and gated by the measured precision of the predictions ([`PrefetchGate`]).
//!
//! Fetches are serialized (one forward pass at a time): a batch holds the store's state until
//! it is dropped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::backend::{IoBackend, PosixBackend};
use crate::buffer::AlignedBuf;
use crate::engine::{Completion, Engine, EngineConfig, HashCheck, Ticket};
use crate::error::{Result, StorageError};
use crate::layout::open_layout_degraded;
use crate::lock::{LayoutLock, LockKind};
use crate::manifest::{Manifest, RecordId};
use crate::store::cache::{CacheBuffer, CachePolicy, ExpertCache, ExpertKey};
use crate::store::gate::{Predictor, PrefetchGate};
use crate::store::resident::ResidentSet;
use crate::store::stats::{FetchStats, LoadProgress, StoreStats};
use crate::store::streamed::{LandedGroup, RecordStream, StreamGroup, StreamStats};
use crate::stripe::Mode;

impl CacheBuffer for AlignedBuf {
    fn bytes(&self) -> u64 {
        self.capacity() as u64
    }
}

/// How to open a store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Reads in flight per drive (engine worker threads per drive).
    pub threads_per_drive: usize,
    /// Hard cap on bytes of expert buffers: reads in flight, prefetched and cached experts
    /// (the expert cache lives inside it). Must hold the largest expert record; more lets more
    /// experts be read at once and cached. Resident tensors live in their own buffers and do
    /// not count.
    pub buffer_cap_bytes: u64,
    /// Which cached expert to drop when the cap is reached.
    pub cache_policy: CachePolicy,
    /// Which records get their hash (`record_hash`) checked as they land (resident and
    /// experts alike).
    pub hash_check: HashCheck,
    /// The I/O backend (O_DIRECT files by default; fault injection in tests).
    pub backend: Arc<dyn IoBackend>,
    /// Expert reads outstanding at most ([`MAX_OUTSTANDING_READS`] by default).
    pub max_outstanding_reads: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        let e = EngineConfig::default();
        StoreOptions {
            threads_per_drive: e.threads_per_drive,
            buffer_cap_bytes: e.buffer_cap_bytes,
            cache_policy: CachePolicy::default(),
            hash_check: e.hash_check,
            backend: Arc::new(PosixBackend::default()),
            max_outstanding_reads: MAX_OUTSTANDING_READS,
        }
    }
}

/// The mutable part of a store: the cache, the tickets of reads in flight, the gate, counters.
#[derive(Debug)]
pub(crate) struct StoreState {
    pub cache: ExpertCache<AlignedBuf>,
    pub tickets: HashMap<ExpertKey, Ticket>,
    pub gate: PrefetchGate,
    /// A next-layer prefetch held back until the current layer's demand reads are submitted
    /// (see [`ExpertStore::prefetch`]): the layer and its experts worth reading.
    pub deferred_prefetch: Option<(u32, Vec<u32>)>,
    /// Use counter: the cache's notion of time.
    pub clock: u64,
    pub stats: FetchStats,
}

impl StoreState {
    /// Cancel the read of `key` if it is a live one (pieces not yet started are skipped, the
    /// rest finish; its completion then settles the slot and hands its buffer back).
    pub(crate) fn cancel_read(&mut self, key: ExpertKey) {
        if self.cache.cancel(key) {
            if let Some(t) = self.tickets.get(&key) {
                t.cancel();
            }
        }
    }
}

/// Figures of the resident-set load, for the statistics.
#[derive(Clone, Copy, Debug, Default)]
struct ResidentFigures {
    records: usize,
    bytes: u64,
    time: std::time::Duration,
}

/// Routed experts of a layout (see the module docs).
#[derive(Debug)]
pub struct ExpertStore {
    engine: Engine,
    drive_dirs: Vec<PathBuf>,
    unavailable: Vec<String>,
    state: Mutex<StoreState>,
    resident: Mutex<ResidentFigures>,
    /// Resident records read for every use instead of held (none unless asked).
    stream: Mutex<Arc<RecordStream>>,
    /// Reads outstanding at most (the completion channel's capacity).
    pub(crate) max_outstanding: usize,
    pub(crate) tx: Sender<Completion>,
    pub(crate) rx: Receiver<Completion>,
    _lock: LayoutLock,
}

/// Expert reads outstanding at most: far more than the drives' queues need to stay busy, and
/// more than a layer's experts (a prefill chunk reads them all at once) in every shipped model.
pub const MAX_OUTSTANDING_READS: usize = 1024;

/// Tag of an expert read: layer in the high half, expert in the low half.
pub(crate) fn key_tag((layer, expert): ExpertKey) -> u64 {
    (u64::from(layer) << 32) | u64::from(expert)
}

pub(crate) fn tag_key(tag: u64) -> ExpertKey {
    ((tag >> 32) as u32, (tag & 0xffff_ffff) as u32)
}

impl ExpertStore {
    /// Open the layout whose manifest is `path` (a `manifest.json` or the layout folder on any
    /// of its drives). A replicated layout opens with drives missing, foreign or truncated
    /// (see [`ExpertStore::unavailable_drives`]); the others serve every record.
    pub fn open(path: &Path, opts: &StoreOptions) -> Result<ExpertStore> {
        let (manifest, drive_dirs, problems) = open_layout_degraded(path)?;
        // Readers hold the name shared: a `layout --force` or a repair waits for none of them
        // silently, it fails at once while the layout is in use.
        let lock = LayoutLock::acquire(&drive_dirs, LockKind::Shared)?;
        let config = EngineConfig {
            threads_per_drive: opts.threads_per_drive,
            buffer_cap_bytes: opts.buffer_cap_bytes,
            hash_check: opts.hash_check,
            backend: opts.backend.clone(),
            unavailable_drives: problems.iter().map(|(d, _)| *d).collect(),
            ..EngineConfig::default()
        };
        // Completions wait on a bounded channel. The store never has more reads outstanding
        // (submitted, completion not yet received) than the channel holds, so no sender ever
        // blocks on it: not a worker, and not the store itself when a cancel completes a read
        // on the caller's thread. The budget, not this, is what normally limits reads.
        let records = manifest
            .records
            .iter()
            .filter(|r| matches!(r.id, RecordId::Expert { .. }))
            .count();
        let max_outstanding = records.clamp(1, opts.max_outstanding_reads.max(1));
        let (tx, rx) = bounded(max_outstanding);
        let engine = Engine::open(Arc::new(manifest), &drive_dirs, config)?;
        Ok(ExpertStore {
            engine,
            drive_dirs,
            unavailable: problems.iter().map(|(_, e)| e.to_string()).collect(),
            state: Mutex::new(StoreState {
                cache: ExpertCache::new(opts.buffer_cap_bytes, opts.cache_policy),
                tickets: HashMap::new(),
                gate: PrefetchGate::default(),
                deferred_prefetch: None,
                clock: 0,
                stats: FetchStats::default(),
            }),
            resident: Mutex::new(ResidentFigures::default()),
            stream: Mutex::new(Arc::new(RecordStream::default())),
            max_outstanding,
            tx,
            rx,
            _lock: lock,
        })
    }

    /// Read the whole resident set, `window` records in flight.
    pub fn read_resident(
        &self,
        window: usize,
        on_progress: &mut dyn FnMut(&LoadProgress),
    ) -> Result<ResidentSet> {
        self.read_resident_except(window, &|_| false, on_progress)
    }

    /// Read the resident set but the records `skip` names (streamed instead).
    pub fn read_resident_except(
        &self,
        window: usize,
        skip: &dyn Fn(usize) -> bool,
        on_progress: &mut dyn FnMut(&LoadProgress),
    ) -> Result<ResidentSet> {
        let set = ResidentSet::load(&self.engine, window, skip, on_progress)?;
        *self.resident.lock().unwrap_or_else(|p| p.into_inner()) = ResidentFigures {
            records: set.count(),
            bytes: set.bytes(),
            time: set.load_time(),
        };
        Ok(set)
    }

    pub fn manifest(&self) -> &Manifest {
        self.engine.manifest()
    }

    /// Drives of a replicated layout that could not be used at open (missing, foreign or
    /// truncated copies), one message each naming the drive and path.
    pub fn unavailable_drives(&self) -> &[String] {
        &self.unavailable
    }

    /// The layout folder on each drive, in drive order.
    pub fn drive_dirs(&self) -> &[PathBuf] {
        &self.drive_dirs
    }

    pub fn drive_count(&self) -> usize {
        self.drive_dirs.len()
    }

    pub fn mode(&self) -> Mode {
        self.manifest().mode
    }

    /// Whether every drive is read with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.engine.direct_io()
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Stream `groups` of resident records (not held: read again for every use), `ahead`
    /// groups read ahead of the one taken. Replaces any previous stream.
    pub fn stream_groups(&self, groups: Vec<StreamGroup>, ahead: usize) {
        *self.stream.lock().unwrap_or_else(|p| p.into_inner()) =
            Arc::new(RecordStream::new(&self.engine, groups, ahead));
    }

    fn record_stream(&self) -> Arc<RecordStream> {
        self.stream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Take streamed group `g` ([`RecordStream::take`]): wait for it, or (`!wait`) only if it
    /// has landed already.
    pub fn take_group(&self, g: usize, wait: bool) -> Result<Option<LandedGroup>> {
        self.record_stream().take(&self.engine, g, wait)
    }

    /// Give a taken group back ([`RecordStream::give_back`]).
    pub fn give_back_group(&self, landed: LandedGroup) {
        self.record_stream().give_back(&self.engine, landed);
    }

    /// The streamed groups and their counters.
    pub fn stream_stats(&self) -> (Vec<StreamGroup>, StreamStats) {
        let s = self.record_stream();
        (s.groups().to_vec(), s.stats())
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, StoreState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which records get their hash (`record_hash`) checked as they land.
    pub fn hash_check(&self) -> HashCheck {
        self.engine.hash_check()
    }

    /// Change the cap on expert buffer bytes (e.g. once a RAM budget can be split after
    /// loading). Lowering it evicts cached experts as new reads need room.
    pub fn set_cap(&self, bytes: u64) {
        self.lock().cache.set_cap(bytes);
    }

    /// Fill the free part of the expert budget, up to one buffer per routed expert, with spare
    /// buffers the size of the largest expert record, every page faulted in now on `threads`
    /// threads, so that reads while generating reuse memory instead of faulting fresh pages in
    /// on the I/O threads (see [`AlignedBuf::prefault`]: with a 40% cap on a VM that was most
    /// of a decoded token's time). Also makes a budget the machine cannot back fail here,
    /// not mid-generation. Returns the bytes added.
    pub fn preallocate_buffers(&self, threads: usize) -> u64 {
        let size = self.manifest().largest_expert_record();
        let experts = self.manifest().expert_records().count() as u64;
        if size == 0 {
            return 0;
        }
        let (used, cap) = {
            let st = self.lock();
            (st.cache.used(), st.cache.cap())
        };
        let count = (cap.saturating_sub(used) / size).min(experts);
        let Ok(len) = usize::try_from(size) else {
            return 0;
        };
        let threads = threads.clamp(1, 16) as u64;
        let bufs: Vec<AlignedBuf> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let share = count / threads + u64::from(t < count % threads);
                    scope.spawn(move || {
                        (0..share)
                            .map(|_| {
                                let mut b = AlignedBuf::zeroed(len);
                                b.prefault();
                                b
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        });
        let mut st = self.lock();
        let mut added = 0;
        for b in bufs {
            let bytes = b.capacity() as u64;
            if st.cache.add_spare(b).is_err() {
                break;
            }
            added += bytes;
        }
        added
    }

    pub fn stats(&self) -> StoreStats {
        let st = self.lock();
        let c = st.cache.counters();
        let fetch = FetchStats {
            cache_hits: c.hits,
            prefetch_hits: c.prefetch_hits,
            evictions: c.evictions,
            prefetch_cancelled: c.prefetch_cancelled,
            peak_bytes: c.peak_bytes,
            ..st.stats.clone()
        };
        let r = *self.resident.lock().unwrap_or_else(|p| p.into_inner());
        let stream = self.record_stream().stats();
        let early_ranks = st.gate.rank_precisions(Predictor::Early);
        let lookahead_ranks = st.gate.rank_precisions(Predictor::Lookahead);
        StoreStats {
            resident_records: r.records,
            resident_bytes: r.bytes,
            resident_load_time: r.time,
            bytes_read: r.bytes + fetch.read_bytes + stream.bytes_read,
            stream,
            drives: self.engine.stats(),
            expert_memory_bytes: st.cache.used(),
            expert_memory_cap: st.cache.cap(),
            fetch,
            replica_recoveries: self.engine.replica_recoveries(),
            repairs: self.engine.repairs(),
            prefetch_rank_precision: if lookahead_ranks.is_empty() {
                early_ranks.clone()
            } else {
                lookahead_ranks
            },
            prefetch_rank_precision_early: early_ranks,
        }
    }

    /// The record of expert `expert` of `layer`.
    pub(crate) fn record_of(&self, layer: u32, expert: u32) -> Result<usize> {
        self.engine
            .record_index(&RecordId::Expert { layer, expert })
            .ok_or_else(|| StorageError::MissingExpert {
                layer,
                expert,
                reason: format!("layout `{}` has no record for it", self.manifest().name),
            })
    }
}
