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
//! Expert reads go through an internal `ExpertFetcher`, the place where an expert cache,
//! next-layer prefetch and a RAM budget will slot in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;
use deltafin_storage::backend::{IoBackend, PosixBackend};
use deltafin_storage::buffer::AlignedBuf;
use deltafin_storage::engine::{
    DriveStats, Engine, EngineConfig, HashCheck, Lane, ReadBuf, Target, Ticket,
};
use deltafin_storage::layout::open_layout;
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
    /// Hard cap on pooled buffer bytes used for expert reads. Must hold the largest expert
    /// record; more lets more experts of a layer be read at once. Resident tensors live in their
    /// own buffers and do not count.
    pub buffer_cap_bytes: u64,
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
    bytes: u64,
    load_time: Duration,
}

#[derive(Debug, Default)]
struct FetchCounters {
    experts: AtomicU64,
    bytes: AtomicU64,
    batches: AtomicU64,
}

/// Reads routed experts through the engine and hands them out in landing order.
#[derive(Debug)]
struct ExpertFetcher {
    engine: Engine,
    counters: FetchCounters,
    /// Held while checking pool room and submitting, so that concurrent fetches cannot both
    /// pass the room check and then block each other in the pool.
    submit_lock: Mutex<()>,
}

/// Cancels the reads of a batch that were not consumed (on error or early return).
struct Outstanding(Vec<Option<Ticket>>);

impl Drop for Outstanding {
    fn drop(&mut self) {
        for t in self.0.iter().flatten() {
            t.cancel();
        }
    }
}

impl ExpertFetcher {
    fn manifest(&self) -> &Manifest {
        self.engine.manifest()
    }

    fn fetch(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()> {
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        if experts.is_empty() {
            return Ok(());
        }
        // Resolve every record before reading anything.
        let records = experts
            .iter()
            .map(|&e| {
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
            })
            .collect::<Result<Vec<usize>>>()?;

        let n = experts.len();
        let pool = self.engine.pool();
        // Room for every completion, so workers never block on this channel.
        let (tx, rx) = bounded(n);
        let mut outstanding = Outstanding(vec![None; n]);
        let (mut next, mut in_flight, mut done) = (0usize, 0usize, 0usize);
        while done < n {
            // Submit while the pool has room (always at least one read in flight).
            if next < n {
                let guard = if in_flight == 0 {
                    Some(self.submit_lock.lock().unwrap_or_else(|p| p.into_inner()))
                } else {
                    match self.submit_lock.try_lock() {
                        Ok(g) => Some(g),
                        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                        Err(TryLockError::WouldBlock) => None,
                    }
                };
                if let Some(_guard) = guard {
                    while next < n {
                        let need = align_up(self.engine.record(records[next]).len.max(1));
                        if in_flight > 0 && pool.in_use() + need > pool.cap() {
                            break;
                        }
                        let ticket = self
                            .engine
                            .submit(
                                Target::Record(records[next]),
                                Lane::Demand,
                                next as u64,
                                tx.clone(),
                                None,
                            )
                            .map_err(|source| InferenceError::ExpertRead {
                                layer,
                                expert: experts[next],
                                source: Box::new(source),
                            })?;
                        outstanding.0[next] = Some(ticket);
                        next += 1;
                        in_flight += 1;
                    }
                }
            }
            let c = rx.recv().map_err(|_| InferenceError::ExpertRead {
                layer,
                expert: experts[done.min(n - 1)],
                source: Box::new(StorageError::EngineClosed),
            })?;
            let i = c.tag as usize;
            in_flight -= 1;
            done += 1;
            if let Some(slot) = outstanding.0.get_mut(i) {
                *slot = None;
            }
            let expert = experts.get(i).copied().unwrap_or(usize::MAX);
            let loaded = c.result.map_err(|source| InferenceError::ExpertRead {
                layer,
                expert,
                source: Box::new(source),
            })?;
            let tensors = self.engine.record_tensors(records[i]);
            self.counters.experts.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes
                .fetch_add(loaded.buf.len() as u64, Ordering::Relaxed);
            let view = expert_view(tensors, &loaded.buf);
            on_ready(expert, &view)?;
            // `loaded` drops here: its buffer goes back to the pool before the next submit.
        }
        Ok(())
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
        let (manifest, drive_dirs) = open_layout(path)?;
        let config = EngineConfig {
            threads_per_drive: options.threads_per_drive,
            buffer_cap_bytes: options.buffer_cap_bytes,
            hash_check: options.hash_check,
            backend: options.backend.clone(),
            ..EngineConfig::default()
        };
        let engine = Engine::open(Arc::new(manifest), &drive_dirs, config)?;
        let resident = load_resident(&engine, options.resident_in_flight.max(1), on_progress)?;
        Ok(LayoutSource {
            drive_dirs,
            resident,
            fetcher: ExpertFetcher {
                engine,
                counters: FetchCounters::default(),
                submit_lock: Mutex::new(()),
            },
        })
    }

    pub fn manifest(&self) -> &Manifest {
        self.fetcher.manifest()
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

    pub fn stats(&self) -> LayoutStats {
        let c = &self.fetcher.counters;
        let expert_bytes = c.bytes.load(Ordering::Relaxed);
        LayoutStats {
            resident_records: self.resident.records.len(),
            resident_bytes: self.resident.bytes,
            resident_load_time: self.resident.load_time,
            experts_fetched: c.experts.load(Ordering::Relaxed),
            expert_bytes,
            expert_batches: c.batches.load(Ordering::Relaxed),
            bytes_read: self.resident.bytes + expert_bytes,
            drives: self.fetcher.engine.stats(),
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

    fn has_tensor(&self, name: &str) -> bool {
        self.resident.by_name.contains_key(name)
    }
}
