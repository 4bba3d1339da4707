//! [`LayoutSource`]: a [`WeightSource`] over a deltafin layout (the expert-record layout that
//! `deltafin layout` writes over 1-4 drives).
//!
//! At open the whole resident set (every [`RecordId::Resident`] record) is read through the
//! engine into owned, 4 KiB-aligned buffers and kept for the life of the source; `tensor(name)`
//! serves slices of them. Routed experts are read on demand: [`WeightSource::with_experts`]
//! submits one demand-lane read per requested expert and hands each expert to the forward pass
//! as its record lands (landing order), so compute starts on the first expert while the others
//! are still being read.
//!
//! Expert reads go through an internal `ExpertFetcher`: every expert buffer (in flight,
//! prefetched, cached) lives under one byte cap ([`LayoutSourceOptions::buffer_cap_bytes`]);
//! landed experts stay cached until the [`CachePolicy`] evicts them; [`WeightSource::prefetch`]
//! starts reads of predicted experts on the engine's prefetch lane (promoted to demand when the
//! forward pass asks for them, cancelled when it asks for others).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use deltafin_storage::backend::{IoBackend, PosixBackend};
use deltafin_storage::buffer::AlignedBuf;
use deltafin_storage::engine::{
    Completion, DriveStats, Engine, EngineConfig, HashCheck, Lane, ReadBuf, Target, Ticket,
};
use deltafin_storage::layout::open_layout_degraded;
use deltafin_storage::manifest::{Manifest, RecordId, RecordTensor};
use deltafin_storage::stripe::{align_up, Mode};
use deltafin_storage::StorageError;

use crate::error::{InferenceError, Result};
use crate::weights::{ExpertCallback, ExpertPartRef, ExpertView, TensorRef, WeightSource};

/// How to open a layout.
#[derive(Clone, Debug)]
pub struct LayoutSourceOptions {
    /// Reads in flight per drive (engine worker threads per drive).
    pub threads_per_drive: usize,
    /// Hard cap on bytes of expert buffers: reads in flight, prefetched and cached experts
    /// (the expert cache lives inside it). Must hold the largest expert record; more lets more
    /// experts be read at once and cached. Resident tensors live in their own buffers and do
    /// not count.
    pub buffer_cap_bytes: u64,
    /// Which cached expert to drop when the cap is reached.
    pub cache_policy: CachePolicy,
    /// Which records get their blake3 checked as they land (resident and experts alike).
    pub hash_check: HashCheck,
    /// Resident records read concurrently while loading the resident set.
    pub resident_in_flight: usize,
    /// The I/O backend (O_DIRECT files by default; fault injection in tests).
    pub backend: Arc<dyn IoBackend>,
}

impl Default for LayoutSourceOptions {
    fn default() -> Self {
        let e = EngineConfig::default();
        LayoutSourceOptions {
            threads_per_drive: e.threads_per_drive,
            buffer_cap_bytes: e.buffer_cap_bytes,
            hash_check: e.hash_check,
            cache_policy: CachePolicy::default(),
            resident_in_flight: 64,
            backend: Arc::new(PosixBackend::default()),
        }
    }
}

/// Progress of the resident-set load, reported after every record that lands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadProgress {
    pub done_records: usize,
    pub total_records: usize,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// Counters of a [`LayoutSource`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayoutStats {
    pub resident_records: usize,
    /// Payload bytes of the resident set.
    pub resident_bytes: u64,
    pub resident_load_time: Duration,
    /// Expert records read (an expert read twice counts twice).
    pub experts_fetched: u64,
    /// Payload bytes of those expert records.
    pub expert_bytes: u64,
    /// `with_experts` calls.
    pub expert_batches: u64,
    /// Payload bytes read so far: resident + experts.
    pub bytes_read: u64,
    /// Per-drive counters from the engine (aligned bytes actually read, busy time).
    pub drives: Vec<DriveStats>,
    /// Expert cache, prefetch and stall counters.
    pub fetch: FetchStats,
    /// Bytes of expert buffers allocated now (cached, in flight, spare).
    pub expert_memory_bytes: u64,
    /// The cap on them.
    pub expert_memory_cap: u64,
}

/// A resident record held in memory.
#[derive(Debug)]
struct ResidentRecord {
    /// Index of the record in the manifest.
    record: usize,
    buf: AlignedBuf,
}

/// The resident set: every resident record's bytes plus a name index.
#[derive(Debug, Default)]
struct ResidentSet {
    records: Vec<ResidentRecord>,
    /// Full tensor name -> (position in `records`, tensor index within the record).
    by_name: HashMap<String, (usize, usize)>,
    /// Records loaded (kept after the buffers are released).
    count: usize,
    bytes: u64,
    load_time: Duration,
}

/// Which cached expert to drop when the expert memory budget is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Frequency-aware: the expert used least often (ties: least recently used). Decoding walks
    /// the layers cyclically, which makes plain LRU thrash when the cache is smaller than the
    /// working set; counting uses keeps the popular experts.
    #[default]
    Lfu,
}

impl std::str::FromStr for CachePolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "lru" => Ok(CachePolicy::Lru),
            "lfu" | "freq" => Ok(CachePolicy::Lfu),
            other => Err(format!("cache policy `{other}`: use lru or lfu")),
        }
    }
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Lfu => "lfu",
        })
    }
}

/// Counters of the expert fetcher (monotonic; take differences for one phase).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchStats {
    /// `with_experts` calls.
    pub batches: u64,
    /// Experts requested by the forward pass.
    pub requests: u64,
    /// Requests served from the cache (excluding first uses of prefetched experts).
    pub cache_hits: u64,
    /// Requests served by a prefetch (landed or still in flight).
    pub prefetch_hits: u64,
    /// Expert records read (demand and prefetch; an expert read twice counts twice).
    pub reads: u64,
    /// Payload bytes of those records.
    pub read_bytes: u64,
    /// Prefetch reads issued.
    pub prefetch_reads: u64,
    /// Prefetch reads cancelled before all of their bytes were read (wrong guesses).
    pub prefetch_cancelled: u64,
    /// Experts predicted for a layer (sum over predictions).
    pub predicted: u64,
    /// Experts then requested for those layers.
    pub predicted_actual: u64,
    /// Predicted experts that were requested.
    pub predicted_correct: u64,
    /// Time the forward pass waited for expert reads.
    pub stall: Duration,
    /// Peak bytes of expert buffers (cached, in flight and spare).
    pub peak_bytes: u64,
    /// Experts evicted from the cache.
    pub evictions: u64,
    /// Predictions not turned into reads because measured precision was too low.
    pub prefetch_gated: u64,
}

impl FetchStats {
    /// `self - earlier` for the counters (peak stays as is).
    pub fn since(&self, earlier: &FetchStats) -> FetchStats {
        FetchStats {
            batches: self.batches - earlier.batches,
            requests: self.requests - earlier.requests,
            cache_hits: self.cache_hits - earlier.cache_hits,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            reads: self.reads - earlier.reads,
            read_bytes: self.read_bytes - earlier.read_bytes,
            prefetch_reads: self.prefetch_reads - earlier.prefetch_reads,
            prefetch_cancelled: self.prefetch_cancelled - earlier.prefetch_cancelled,
            predicted: self.predicted - earlier.predicted,
            predicted_actual: self.predicted_actual - earlier.predicted_actual,
            predicted_correct: self.predicted_correct - earlier.predicted_correct,
            stall: self.stall.saturating_sub(earlier.stall),
            peak_bytes: self.peak_bytes,
            evictions: self.evictions - earlier.evictions,
            prefetch_gated: self.prefetch_gated - earlier.prefetch_gated,
        }
    }

    /// Cache hits / requests.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.cache_hits as f64 / self.requests as f64)
    }

    /// Correctly predicted / requested (for predicted layers).
    pub fn prefetch_recall(&self) -> Option<f64> {
        (self.predicted_actual > 0)
            .then(|| self.predicted_correct as f64 / self.predicted_actual as f64)
    }

    /// Correctly predicted / predicted.
    pub fn prefetch_precision(&self) -> Option<f64> {
        (self.predicted > 0).then(|| self.predicted_correct as f64 / self.predicted as f64)
    }
}

type Key = (usize, usize);

fn key_tag((layer, expert): Key) -> u64 {
    ((layer as u64) << 32) | (expert as u64 & 0xffff_ffff)
}

fn tag_key(tag: u64) -> Key {
    ((tag >> 32) as usize, (tag & 0xffff_ffff) as usize)
}

#[derive(Debug)]
enum Slot {
    /// Landed and cached.
    Ready {
        buf: Arc<AlignedBuf>,
        record: usize,
        last_use: u64,
        uses: u64,
        /// Prefetched and not yet requested.
        unused_prefetch: bool,
    },
    /// A read in flight; `bytes` of the budget are reserved for it.
    Pending {
        ticket: Ticket,
        record: usize,
        bytes: u64,
        prefetch: bool,
        cancelled: bool,
    },
}

#[derive(Debug)]
struct FetchState {
    slots: HashMap<Key, Slot>,
    /// Bytes of expert buffers allocated: ready + pending + spare.
    used: u64,
    /// Spare buffers of evicted experts, reused for new reads.
    spare: Vec<AlignedBuf>,
    clock: u64,
    /// Experts predicted per layer, until that layer is requested.
    predicted: HashMap<usize, Vec<usize>>,
    /// Moving average of the fraction of predicted experts that were then requested.
    precision_ema: f64,
    /// Predictions scored so far.
    scored: u64,
    stats: FetchStats,
}

/// Prefetch reads are only issued while the measured precision of the next-layer prediction
/// stays at or above this. A wrong prefetch that has started costs drive bandwidth, which is
/// the bottleneck when decoding is I/O-bound: on the synthetic medium model (precision ~0.6,
/// 4 throttled drives) prefetching read 31% more bytes per token and decoded 34% slower than
/// not prefetching (`benches/results/gen_extras.json`). Predictions keep being scored while
/// gated, so prefetching resumes if they become accurate.
const PREFETCH_MIN_PRECISION: f64 = 0.75;
/// Predictions scored before the gate may close.
const PREFETCH_WARMUP: u64 = 8;

/// Reads routed experts through the engine into buffers under a byte budget (`cap`), keeps them
/// as a cache (LRU or frequency-aware), prefetches predicted experts on the prefetch lane and
/// hands experts out in landing order. Fetches are serialized (one forward at a time).
#[derive(Debug)]
struct ExpertFetcher {
    engine: Engine,
    cap: AtomicU64,
    policy: CachePolicy,
    state: Mutex<FetchState>,
    tx: Sender<Completion>,
    rx: Receiver<Completion>,
}

impl ExpertFetcher {
    fn new(engine: Engine, cap: u64, policy: CachePolicy) -> ExpertFetcher {
        let (tx, rx) = unbounded();
        ExpertFetcher {
            engine,
            cap: AtomicU64::new(cap),
            policy,
            state: Mutex::new(FetchState {
                slots: HashMap::new(),
                used: 0,
                spare: Vec::new(),
                clock: 0,
                predicted: HashMap::new(),
                precision_ema: 1.0,
                scored: 0,
                stats: FetchStats::default(),
            }),
            tx,
            rx,
        }
    }

    fn manifest(&self) -> &Manifest {
        self.engine.manifest()
    }

    fn cap(&self) -> u64 {
        self.cap.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FetchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stats(&self) -> FetchStats {
        self.lock().stats.clone()
    }

    /// Bytes of expert buffers currently allocated (cached, in flight, spare).
    fn used(&self) -> u64 {
        self.lock().used
    }

    fn record_of(&self, layer: usize, e: usize) -> Result<usize> {
        let id = match (u32::try_from(layer), u32::try_from(e)) {
            (Ok(layer), Ok(expert)) => Some(RecordId::Expert { layer, expert }),
            _ => None,
        };
        id.and_then(|id| self.engine.record_index(&id))
            .ok_or_else(|| InferenceError::MissingExpert {
                layer,
                expert: e,
                reason: format!("layout `{}` has no record for it", self.manifest().name),
            })
    }

    /// Make room for `need` more bytes, evicting ready experts the policy picks among those
    /// `evictable` allows. Returns a spare buffer to reuse when one fits, or `None` with the
    /// room reserved for a fresh allocation; `Err(())` when there is not enough room.
    fn make_room(
        &self,
        st: &mut FetchState,
        need: u64,
        evictable: &dyn Fn(Key) -> bool,
    ) -> std::result::Result<Option<AlignedBuf>, ()> {
        loop {
            if let Some(i) = st
                .spare
                .iter()
                .position(|b| b.capacity() as u64 >= need && (b.capacity() as u64) < need * 2)
            {
                return Ok(Some(st.spare.swap_remove(i)));
            }
            if st.used + need <= self.cap() {
                st.used += need;
                st.stats.peak_bytes = st.stats.peak_bytes.max(st.used);
                return Ok(None);
            }
            if let Some(b) = st.spare.pop() {
                st.used -= b.capacity() as u64;
                continue;
            }
            let victim = st
                .slots
                .iter()
                .filter_map(|(k, s)| match s {
                    Slot::Ready { last_use, uses, .. } if evictable(*k) => {
                        Some((*k, *last_use, *uses))
                    }
                    _ => None,
                })
                .min_by_key(|&(_, last, uses)| match self.policy {
                    CachePolicy::Lru => (0, last),
                    CachePolicy::Lfu => (uses, last),
                })
                .map(|(k, _, _)| k);
            let Some(k) = victim else { return Err(()) };
            if let Some(Slot::Ready { buf, .. }) = st.slots.remove(&k) {
                st.stats.evictions += 1;
                match Arc::try_unwrap(buf) {
                    Ok(b) => st.spare.push(b),
                    Err(shared) => st.used -= shared.capacity() as u64,
                }
            }
        }
    }

    /// Submit a read of `key` (record `record`) on `lane`, within the budget.
    fn submit(
        &self,
        st: &mut FetchState,
        key: Key,
        record: usize,
        lane: Lane,
        evictable: &dyn Fn(Key) -> bool,
    ) -> std::result::Result<bool, InferenceError> {
        let len = self.engine.record(record).len;
        let need = align_up(len.max(1));
        let dest = match self.make_room(st, need, evictable) {
            Ok(Some(b)) => b,
            Ok(None) => AlignedBuf::zeroed(len as usize),
            Err(()) => return Ok(false),
        };
        let bytes = dest.capacity() as u64;
        let ticket = match self.engine.submit(
            Target::Record(record),
            lane,
            key_tag(key),
            self.tx.clone(),
            Some(dest),
        ) {
            Ok(t) => t,
            Err(source) => {
                st.used -= bytes;
                return Err(InferenceError::ExpertRead {
                    layer: key.0,
                    expert: key.1,
                    source: Box::new(source),
                });
            }
        };
        st.slots.insert(
            key,
            Slot::Pending {
                ticket,
                record,
                bytes,
                prefetch: lane == Lane::Prefetch,
                cancelled: false,
            },
        );
        if lane == Lane::Prefetch {
            st.stats.prefetch_reads += 1;
        }
        Ok(true)
    }

    /// Apply one completion to the state. Returns the key and, on failure, the error.
    fn land(&self, st: &mut FetchState, c: Completion) -> (Key, Option<StorageError>) {
        let key = tag_key(c.tag);
        let Some(Slot::Pending {
            record,
            bytes,
            prefetch,
            ..
        }) = st.slots.remove(&key)
        else {
            // Not ours (cannot happen: every read has a pending slot until it lands).
            return (key, None);
        };
        match c.result {
            Ok(loaded) => {
                let buf = match loaded.buf {
                    ReadBuf::Owned(b) => b,
                    ReadBuf::Pooled(p) => {
                        let mut b = AlignedBuf::zeroed(p.len());
                        b.copy_from_slice(&p);
                        b
                    }
                };
                st.stats.reads += 1;
                st.stats.read_bytes += buf.len() as u64;
                // The engine may have sized the buffer differently only if it was replaced.
                let cap = buf.capacity() as u64;
                st.used = (st.used + cap).saturating_sub(bytes);
                st.clock += 1;
                st.slots.insert(
                    key,
                    Slot::Ready {
                        buf: Arc::new(buf),
                        record,
                        last_use: st.clock,
                        uses: 0,
                        unused_prefetch: prefetch,
                    },
                );
                (key, None)
            }
            Err(e) => {
                // The engine dropped the buffer.
                st.used -= bytes;
                if matches!(e, StorageError::Cancelled) && prefetch {
                    st.stats.prefetch_cancelled += 1;
                }
                (key, Some(e))
            }
        }
    }

    /// Start reading `experts` of `layer` on the prefetch lane (those not cached or in flight),
    /// as far as the budget allows without evicting experts of `layer` or the layer before it.
    fn prefetch(&self, layer: usize, experts: &[usize]) {
        let mut st = self.lock();
        st.predicted.insert(layer, experts.to_vec());
        if st.scored >= PREFETCH_WARMUP && st.precision_ema < PREFETCH_MIN_PRECISION {
            st.stats.prefetch_gated += experts.len() as u64;
            return;
        }
        for &e in experts {
            let key = (layer, e);
            if st.slots.contains_key(&key) {
                continue;
            }
            let Ok(record) = self.record_of(layer, e) else {
                continue;
            };
            let evictable = |k: Key| k.0 != layer && k.0 + 1 != layer;
            match self.submit(&mut st, key, record, Lane::Prefetch, &evictable) {
                Ok(true) => {}
                Ok(false) | Err(_) => break,
            }
        }
    }

    fn fetch(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()> {
        let mut guard = self.lock();
        let st = &mut *guard;
        st.stats.batches += 1;
        if experts.is_empty() {
            return Ok(());
        }
        let records = experts
            .iter()
            .map(|&e| self.record_of(layer, e))
            .collect::<Result<Vec<usize>>>()?;
        let n = experts.len();
        st.stats.requests += n as u64;

        // Score the prediction for this layer and cancel wrong guesses not yet started.
        if let Some(pred) = st.predicted.remove(&layer) {
            st.stats.predicted += pred.len() as u64;
            st.stats.predicted_actual += n as u64;
            let correct = pred.iter().filter(|e| experts.contains(e)).count();
            st.stats.predicted_correct += correct as u64;
            if !pred.is_empty() {
                let p = correct as f64 / pred.len() as f64;
                st.precision_ema = 0.9 * st.precision_ema + 0.1 * p;
                st.scored += 1;
            }
        }
        for slot in st
            .slots
            .iter_mut()
            .filter_map(|(k, s)| (k.0 == layer && !experts.contains(&k.1)).then_some(s))
        {
            if let Slot::Pending {
                ticket,
                prefetch: true,
                cancelled,
                ..
            } = slot
            {
                if !*cancelled {
                    ticket.cancel();
                    *cancelled = true;
                }
            }
        }

        // Classify: cached, in flight (promote prefetches), or to read.
        let mut delivered = vec![false; n];
        let mut ready: Vec<usize> = Vec::new();
        let mut to_read: std::collections::VecDeque<usize> = Default::default();
        let mut waiting = 0usize;
        st.clock += 1;
        let now = st.clock;
        for (i, &e) in experts.iter().enumerate() {
            match st.slots.get_mut(&(layer, e)) {
                Some(Slot::Ready {
                    unused_prefetch,
                    last_use,
                    uses,
                    ..
                }) => {
                    if *unused_prefetch {
                        *unused_prefetch = false;
                        st.stats.prefetch_hits += 1;
                    } else {
                        st.stats.cache_hits += 1;
                    }
                    *last_use = now;
                    *uses += 1;
                    ready.push(i);
                }
                Some(Slot::Pending {
                    ticket,
                    prefetch,
                    cancelled,
                    ..
                }) => {
                    if *prefetch && !*cancelled {
                        ticket.promote();
                        st.stats.prefetch_hits += 1;
                    } else if *cancelled {
                        // Re-read once the cancelled read has settled.
                    }
                    waiting += 1;
                }
                None => to_read.push_back(i),
            }
        }
        let index_of = |e: usize| experts.iter().position(|&x| x == e);

        // Submit what fits (never evicting experts of this batch not yet handed over), hand
        // over cached experts while those reads run, then take reads in landing order.
        let mut in_flight = waiting;
        loop {
            while let Some(&i) = to_read.front() {
                let evictable =
                    |k: Key| !(k.0 == layer && index_of(k.1).is_some_and(|j| !delivered[j]));
                if self.submit(
                    st,
                    (layer, experts[i]),
                    records[i],
                    Lane::Demand,
                    &evictable,
                )? {
                    to_read.pop_front();
                    in_flight += 1;
                } else if in_flight == 0 && ready.is_empty() {
                    // Nothing of ours will free room: cancel the reads that are not part of
                    // this batch (other layers' prefetches, and this layer's mispredicted
                    // ones) and wait for them, or give up if nothing is in flight at all.
                    let mut any = false;
                    for (k, s) in st.slots.iter_mut() {
                        if let Slot::Pending {
                            ticket, cancelled, ..
                        } = s
                        {
                            if k.0 != layer || index_of(k.1).is_none() {
                                if !*cancelled {
                                    ticket.cancel();
                                    *cancelled = true;
                                }
                                any = true;
                            }
                        }
                    }
                    if !any {
                        return Err(InferenceError::ExpertBudget {
                            layer,
                            expert: experts[i],
                            need: align_up(self.engine.record(records[i]).len.max(1)),
                            cap: self.cap(),
                        });
                    }
                    break;
                } else {
                    break;
                }
            }
            if let Some(i) = ready.pop() {
                let Some(Slot::Ready { buf, record, .. }) = st.slots.get(&(layer, experts[i]))
                else {
                    continue;
                };
                let (buf, record) = (buf.clone(), *record);
                delivered[i] = true;
                let view = expert_view(self.engine.record_tensors(record), &buf);
                on_ready(experts[i], &view)?;
                continue;
            }
            if delivered.iter().all(|&d| d) {
                return Ok(());
            }
            let t = Instant::now();
            let c = self.rx.recv().map_err(|_| InferenceError::ExpertRead {
                layer,
                expert: experts[0],
                source: Box::new(StorageError::EngineClosed),
            })?;
            st.stats.stall += t.elapsed();
            let (key, err) = self.land(st, c);
            let mine = (key.0 == layer).then(|| index_of(key.1)).flatten();
            let Some(i) = mine.filter(|&i| !delivered[i]) else {
                continue; // another layer's prefetch
            };
            in_flight = in_flight.saturating_sub(1);
            match err {
                None => {
                    if let Some(Slot::Ready {
                        last_use,
                        uses,
                        unused_prefetch,
                        ..
                    }) = st.slots.get_mut(&key)
                    {
                        *last_use = now;
                        *uses += 1;
                        *unused_prefetch = false;
                    }
                    ready.push(i);
                }
                Some(StorageError::Cancelled) => to_read.push_back(i),
                Some(source) => {
                    return Err(InferenceError::ExpertRead {
                        layer,
                        expert: experts[i],
                        source: Box::new(source),
                    })
                }
            }
        }
    }
}

fn expert_view<'a>(tensors: &'a [RecordTensor], bytes: &'a [u8]) -> ExpertView<'a> {
    ExpertView::new(
        tensors
            .iter()
            .map(|t| ExpertPartRef {
                name: &t.name,
                tensor: TensorRef::new(
                    t.dtype.clone(),
                    &t.shape,
                    // In bounds: the manifest was validated (tensor within record) and the
                    // buffer holds the record's payload.
                    &bytes[t.offset as usize..(t.offset + t.len) as usize],
                ),
            })
            .collect(),
    )
}

/// A [`WeightSource`] reading a deltafin layout through the storage engine.
#[derive(Debug)]
pub struct LayoutSource {
    unavailable: Vec<String>,
    drive_dirs: Vec<PathBuf>,
    resident: ResidentSet,
    fetcher: ExpertFetcher,
}

impl LayoutSource {
    /// Open the layout whose manifest is `path` (a `manifest.json` or the layout folder on any
    /// of its drives) and load the whole resident set.
    pub fn open(path: &Path, options: &LayoutSourceOptions) -> Result<LayoutSource> {
        Self::open_with_progress(path, options, &mut |_| {})
    }

    /// [`LayoutSource::open`], reporting resident-load progress after every record.
    pub fn open_with_progress(
        path: &Path,
        options: &LayoutSourceOptions,
        on_progress: &mut dyn FnMut(&LoadProgress),
    ) -> Result<LayoutSource> {
        // A replicated layout opens with drives missing; the others serve every record.
        let (manifest, drive_dirs, problems) = open_layout_degraded(path)?;
        let unavailable_drives = problems.iter().map(|(d, _)| *d).collect();
        let unavailable = problems.iter().map(|(_, e)| e.to_string()).collect();
        let config = EngineConfig {
            threads_per_drive: options.threads_per_drive,
            buffer_cap_bytes: options.buffer_cap_bytes,
            hash_check: options.hash_check,
            backend: options.backend.clone(),
            unavailable_drives,
            ..EngineConfig::default()
        };
        let engine = Engine::open(Arc::new(manifest), &drive_dirs, config)?;
        let resident = load_resident(&engine, options.resident_in_flight.max(1), on_progress)?;
        Ok(LayoutSource {
            unavailable,
            drive_dirs,
            resident,
            fetcher: ExpertFetcher::new(engine, options.buffer_cap_bytes, options.cache_policy),
        })
    }

    pub fn manifest(&self) -> &Manifest {
        self.fetcher.manifest()
    }

    /// Drives of a replicated layout that could not be used at open (missing, foreign or
    /// truncated copies), one message each naming the drive and path; the other copies serve
    /// every read.
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

    pub fn engine(&self) -> &Engine {
        &self.fetcher.engine
    }

    /// Names of the resident tensors held in memory.
    pub fn resident_names(&self) -> impl Iterator<Item = &str> {
        self.resident.by_name.keys().map(String::as_str)
    }

    /// Change the cap on expert buffer bytes ([`LayoutSourceOptions::buffer_cap_bytes`]),
    /// e.g. once a RAM budget can be split after loading. Lowering it evicts cached experts as
    /// new reads need room.
    pub fn set_expert_memory_cap(&self, bytes: u64) {
        self.fetcher.cap.store(bytes, Ordering::Relaxed);
    }

    pub fn stats(&self) -> LayoutStats {
        let f = self.fetcher.stats();
        LayoutStats {
            resident_records: self.resident.count,
            resident_bytes: self.resident.bytes,
            resident_load_time: self.resident.load_time,
            experts_fetched: f.reads,
            expert_bytes: f.read_bytes,
            expert_batches: f.batches,
            bytes_read: self.resident.bytes + f.read_bytes,
            drives: self.fetcher.engine.stats(),
            fetch: f,
            expert_memory_bytes: self.fetcher.used(),
            expert_memory_cap: self.fetcher.cap(),
        }
    }
}

/// Read every resident record into its own aligned buffer, `window` records in flight.
fn load_resident(
    engine: &Engine,
    window: usize,
    on_progress: &mut dyn FnMut(&LoadProgress),
) -> Result<ResidentSet> {
    let start = Instant::now();
    let manifest = engine.manifest().clone();
    let indices: Vec<usize> = manifest
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r.id, RecordId::Resident { .. }))
        .map(|(i, _)| i)
        .collect();
    let mut progress = LoadProgress {
        done_records: 0,
        total_records: indices.len(),
        done_bytes: 0,
        total_bytes: indices.iter().map(|&i| manifest.records[i].len).sum(),
    };
    on_progress(&progress);
    let read_err = |i: usize, source: StorageError| InferenceError::ResidentRead {
        record: match &manifest.records[i].id {
            RecordId::Resident { group } => group.clone(),
            other => other.to_string(),
        },
        source: Box::new(source),
    };

    let (tx, rx) = bounded(window.min(indices.len()).max(1));
    let mut outstanding: HashMap<usize, Ticket> = HashMap::new();
    let mut slots: Vec<Option<AlignedBuf>> = Vec::new();
    slots.resize_with(manifest.records.len(), || None);
    let mut next = 0;
    let result = (|| -> Result<()> {
        while progress.done_records < indices.len() {
            while next < indices.len() && outstanding.len() < window {
                let i = indices[next];
                let dest = AlignedBuf::zeroed(manifest.records[i].len as usize);
                let t = engine
                    .submit(
                        Target::Record(i),
                        Lane::Demand,
                        i as u64,
                        tx.clone(),
                        Some(dest),
                    )
                    .map_err(|e| read_err(i, e))?;
                outstanding.insert(i, t);
                next += 1;
            }
            let c = rx.recv().map_err(|_| {
                read_err(indices[progress.done_records], StorageError::EngineClosed)
            })?;
            let i = c.tag as usize;
            outstanding.remove(&i);
            let loaded = c.result.map_err(|e| read_err(i, e))?;
            let buf = match loaded.buf {
                ReadBuf::Owned(b) => b,
                ReadBuf::Pooled(p) => {
                    let mut b = AlignedBuf::zeroed(p.len());
                    b.copy_from_slice(&p);
                    b
                }
            };
            progress.done_records += 1;
            progress.done_bytes += buf.len() as u64;
            slots[i] = Some(buf);
            on_progress(&progress);
        }
        Ok(())
    })();
    if result.is_err() {
        for t in outstanding.values() {
            t.cancel();
        }
    }
    result?;

    let mut set = ResidentSet::default();
    for (i, slot) in slots.into_iter().enumerate() {
        let Some(buf) = slot else { continue };
        let pos = set.records.len();
        for (k, t) in manifest.records[i].tensors.iter().enumerate() {
            set.by_name.insert(t.name.clone(), (pos, k));
        }
        set.bytes += buf.len() as u64;
        set.records.push(ResidentRecord { record: i, buf });
    }
    set.load_time = start.elapsed();
    set.count = set.records.len();
    Ok(set)
}

impl WeightSource for LayoutSource {
    fn config(&self) -> &serde_json::Value {
        &self.manifest().config
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let &(pos, k) =
            self.resident
                .by_name
                .get(name)
                .ok_or_else(|| InferenceError::MissingTensor {
                    name: name.to_string(),
                })?;
        let rec = &self.resident.records[pos];
        let t = &self.manifest().records[rec.record].tensors[k];
        Ok(TensorRef::new(
            t.dtype.clone(),
            &t.shape,
            &rec.buf[t.offset as usize..(t.offset + t.len) as usize],
        ))
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()> {
        self.fetcher.fetch(layer, experts, on_ready)
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.fetcher.prefetch(layer, experts);
    }

    fn wants_prefetch(&self) -> bool {
        true
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.resident.by_name.contains_key(name)
    }

    fn release_resident(&mut self) {
        // Keep the counters (bytes, load time) for the statistics; free the buffers.
        self.resident.records = Vec::new();
        self.resident.by_name = HashMap::new();
    }
}
