//! [`LayoutSource`]: a [`WeightSource`] over a deltafin layout (the expert-record layout that
//! `deltafin layout` writes over 1-4 drives), through the storage crate's
//! [`ExpertStore`].
//!
//! At open the whole resident set is read into memory and kept for the life of the source;
//! `tensor(name)` serves slices of it. Routed experts come from the store: each requested expert
//! is handed to the forward pass as it lands (cached ones first), so compute starts on the first
//! expert while the others are still being read; [`WeightSource::prefetch`] passes predictions
//! on to the store.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_storage::backend::IoBackend;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::manifest::{Manifest, RecordTensor};
use deltafin_storage::store::{
    CachePolicy, ExpertBatch, ExpertStore, LoadProgress, ResidentSet, StoreOptions, StoreStats,
    StreamGroup, StreamStats,
};
use deltafin_storage::stripe::Mode;
use deltafin_storage::StorageError;

use crate::error::{InferenceError, Result};
use crate::linear::bytes::WeightBytes;
use crate::streamed_layer::{streamable_layers, StreamableLayers, StreamedLayerSource};
use crate::weights::{
    ExpertCallback, ExpertGroupCallback, ExpertHints, ExpertPartRef, ExpertView, IdleCallback,
    TensorRef, WeightSource,
};

/// How to open a layout.
#[derive(Clone, Debug)]
pub struct LayoutSourceOptions {
    /// Reads in flight per drive (engine worker threads per drive).
    pub threads_per_drive: usize,
    /// Hard cap on bytes of expert buffers: reads in flight, prefetched and cached experts
    /// (the expert cache lives inside it). Must hold the largest expert record. Resident
    /// tensors live in their own buffers and do not count.
    pub buffer_cap_bytes: u64,
    /// Which cached expert to drop when the cap is reached.
    pub cache_policy: CachePolicy,
    /// Which records get their hash (`record_hash`) checked as they land (resident and
    /// experts alike).
    pub hash_check: HashCheck,
    /// Resident records read concurrently while loading the resident set.
    pub resident_in_flight: usize,
    /// The I/O backend (O_DIRECT files by default; fault injection in tests).
    pub backend: Arc<dyn IoBackend>,
    /// Streamed layers: groups read ahead of the one in use.
    pub stream_ahead: usize,
    /// Streamed layers: smaller resident records stay resident.
    pub min_streamed_record: u64,
}

impl Default for LayoutSourceOptions {
    fn default() -> Self {
        let s = StoreOptions::default();
        LayoutSourceOptions {
            threads_per_drive: s.threads_per_drive,
            buffer_cap_bytes: s.buffer_cap_bytes,
            cache_policy: s.cache_policy,
            hash_check: s.hash_check,
            resident_in_flight: 64,
            backend: s.backend,
            stream_ahead: 1,
            min_streamed_record: crate::streamed_layer::MIN_STREAMED_RECORD,
        }
    }
}

/// A [`WeightSource`] reading a deltafin layout through an [`ExpertStore`].
#[derive(Debug)]
pub struct LayoutSource {
    store: ExpertStore,
    resident: ResidentSet,
    /// Streamed decoder layers, in the store's group order.
    streamed: Vec<usize>,
    /// What each layer could stream (from the manifest).
    streamable: StreamableLayers,
    /// Tensors under these name prefixes stay resident when the rest is released (a streamed
    /// layer's small tensors, read again at every rebuild).
    keep_prefixes: Vec<String>,
}

/// A store error as the forward pass reports it (naming the layer and expert).
fn expert_error(layer: usize, expert: usize, e: StorageError) -> InferenceError {
    match e {
        StorageError::MissingExpert {
            layer,
            expert,
            reason,
        } => InferenceError::MissingExpert {
            layer: layer as usize,
            expert: expert as usize,
            reason,
        },
        StorageError::ExpertBudget {
            layer,
            expert,
            need,
            cap,
        } => InferenceError::ExpertBudget {
            layer: layer as usize,
            expert: expert as usize,
            need,
            cap,
        },
        StorageError::ExpertRead {
            layer,
            expert,
            source,
        } => InferenceError::ExpertRead {
            layer: layer as usize,
            expert: expert as usize,
            source,
        },
        other => InferenceError::ExpertRead {
            layer,
            expert,
            source: Box::new(other),
        },
    }
}

/// A layer and its experts as the store numbers them (`None` if one does not fit in `u32`).
fn store_ids(layer: usize, experts: &[usize]) -> Option<(u32, Vec<u32>)> {
    let ids = experts
        .iter()
        .map(|&e| u32::try_from(e).ok())
        .collect::<Option<Vec<u32>>>()?;
    Some((u32::try_from(layer).ok()?, ids))
}

/// The view of one landed expert: its template's tensors over its bytes.
fn expert_view<'a>(tensors: &'a [RecordTensor], bytes: &'a [u8]) -> ExpertView<'a> {
    ExpertView::new(
        tensors
            .iter()
            .filter_map(|t| {
                let end = t.offset.checked_add(t.len)?;
                Some(ExpertPartRef {
                    name: &t.name,
                    tensor: TensorRef::new(
                        t.dtype.clone(),
                        &t.shape,
                        bytes.get(t.offset as usize..end as usize)?,
                    ),
                })
            })
            .collect(),
    )
}

impl LayoutSource {
    /// Start reading `experts` of decoder `layer` (an index out of range is an error naming
    /// the first expert).
    fn fetch(&self, layer: usize, experts: &[usize]) -> Result<ExpertBatch<'_>> {
        let first = experts.first().copied().unwrap_or(0);
        let Some((l, ids)) = store_ids(layer, experts) else {
            return Err(InferenceError::MissingExpert {
                layer,
                expert: first,
                reason: "layer or expert index out of range".into(),
            });
        };
        self.store
            .fetch(l, &ids)
            .map_err(|e| expert_error(layer, first, e))
    }

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
        Self::open_streaming(path, options, &mut |_, _| Ok(Vec::new()), on_progress)
    }

    /// [`LayoutSource::open_with_progress`], streaming the decoder layers `choose` picks from
    /// what each could stream: their matrices are not loaded but read for every forward
    /// ([`WeightSource::layer_weights`]), `stream_ahead` layers ahead.
    pub fn open_streaming(
        path: &Path,
        options: &LayoutSourceOptions,
        choose: &mut dyn FnMut(&Manifest, &StreamableLayers) -> Result<Vec<usize>>,
        on_progress: &mut dyn FnMut(&LoadProgress),
    ) -> Result<LayoutSource> {
        let store = ExpertStore::open(
            path,
            &StoreOptions {
                threads_per_drive: options.threads_per_drive,
                buffer_cap_bytes: options.buffer_cap_bytes,
                cache_policy: options.cache_policy,
                hash_check: options.hash_check,
                backend: options.backend.clone(),
                ..StoreOptions::default()
            },
        )?;
        let naming = crate::family::expert_naming(&store.manifest().config)?;
        let streamable = streamable_layers(
            store.manifest(),
            &naming.layers_prefix,
            options.min_streamed_record,
        );
        let mut streamed = choose(store.manifest(), &streamable)?;
        streamed.sort_unstable();
        streamed.dedup();
        let mut groups = Vec::with_capacity(streamed.len());
        for &l in &streamed {
            let w = streamable.layer(l).ok_or_else(|| {
                InferenceError::InvalidArgument(format!(
                    "decoder layer {l} has no weights that can be streamed"
                ))
            })?;
            groups.push(StreamGroup {
                name: format!("layer {l}"),
                records: w.records.clone(),
            });
        }
        let skip: std::collections::HashSet<usize> = groups
            .iter()
            .flat_map(|g| g.records.iter().copied())
            .collect();
        store.stream_groups(groups, options.stream_ahead.max(1));
        let keep_prefixes = streamed
            .iter()
            .map(|l| format!("{}{l}.", naming.layers_prefix))
            .collect();
        let resident = store
            .read_resident_except(
                options.resident_in_flight,
                &|i| skip.contains(&i),
                on_progress,
            )
            .map_err(|e| match e {
                StorageError::ResidentRead { record, source } => {
                    InferenceError::ResidentRead { record, source }
                }
                e => InferenceError::Storage(e),
            })?;
        Ok(LayoutSource {
            store,
            resident,
            streamed,
            streamable,
            keep_prefixes,
        })
    }

    /// What each decoder layer could stream.
    pub fn streamable(&self) -> &StreamableLayers {
        &self.streamable
    }

    /// Buffer bytes of one streamed layer's weights, the largest (0 when nothing is streamed).
    pub fn largest_streamed_layer(&self) -> u64 {
        self.streamed
            .iter()
            .filter_map(|&l| self.streamable.layer(l))
            .map(|w| w.buffer_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The streamed layers and the stream's counters.
    pub fn stream_stats(&self) -> StreamStats {
        self.store.stream_stats().1
    }

    pub fn manifest(&self) -> &Manifest {
        self.store.manifest()
    }

    /// Drives of a replicated layout that could not be used at open (missing, foreign or
    /// truncated copies), one message each naming the drive and path; the other copies serve
    /// every read.
    pub fn unavailable_drives(&self) -> &[String] {
        self.store.unavailable_drives()
    }

    /// The layout folder on each drive, in drive order.
    pub fn drive_dirs(&self) -> &[PathBuf] {
        self.store.drive_dirs()
    }

    pub fn drive_count(&self) -> usize {
        self.store.drive_count()
    }

    /// Which records get their hash (`record_hash`) checked as they land.
    pub fn hash_check(&self) -> deltafin_storage::engine::HashCheck {
        self.store.hash_check()
    }

    pub fn mode(&self) -> Mode {
        self.store.mode()
    }

    /// Whether every drive is read with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.store.direct_io()
    }

    /// Names of the resident tensors held in memory.
    pub fn resident_names(&self) -> impl Iterator<Item = &str> {
        self.resident.names()
    }

    /// Change the cap on expert buffer bytes ([`LayoutSourceOptions::buffer_cap_bytes`]),
    /// e.g. once a RAM budget can be split after loading. Lowering it evicts cached experts as
    /// new reads need room.
    pub fn set_expert_memory_cap(&self, bytes: u64) {
        self.store.set_cap(bytes);
    }

    /// Allocate the expert budget's free part as buffers and fault them in now, on `threads`
    /// threads; returns the bytes (`ExpertStore::preallocate_buffers`).
    pub fn preallocate_expert_buffers(&self, threads: usize) -> u64 {
        self.store.preallocate_buffers(threads)
    }

    /// The largest routed-expert record as read (the expert memory budget must hold it).
    pub fn largest_expert_record(&self) -> u64 {
        self.manifest().largest_expert_record()
    }

    pub fn stats(&self) -> StoreStats {
        self.store.stats()
    }
}

impl WeightSource for LayoutSource {
    fn config(&self) -> &serde_json::Value {
        &self.manifest().config
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let (t, bytes) = self
            .resident
            .tensor(&self.manifest().records, name)
            .ok_or_else(|| InferenceError::MissingTensor {
                name: name.to_string(),
            })?;
        Ok(TensorRef::new(t.dtype.clone(), &t.shape, bytes))
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()> {
        let first = experts.first().copied().unwrap_or(0);
        let batch = self.fetch(layer, experts)?;
        for landed in batch {
            let landed = landed.map_err(|e| expert_error(layer, first, e))?;
            let view = expert_view(landed.tensors, landed.bytes());
            on_ready(landed.expert as usize, &view)?;
        }
        Ok(())
    }

    fn with_expert_groups(
        &self,
        layer: usize,
        experts: &[usize],
        on_group: &mut ExpertGroupCallback<'_>,
    ) -> Result<()> {
        self.with_expert_groups_idle(layer, experts, on_group, &mut |_| false)
    }

    fn with_expert_groups_idle(
        &self,
        layer: usize,
        experts: &[usize],
        on_group: &mut ExpertGroupCallback<'_>,
        on_idle: &mut IdleCallback<'_>,
    ) -> Result<()> {
        let first = experts.first().copied().unwrap_or(0);
        let mut batch = self.fetch(layer, experts)?;
        // Whether this layer waited for a drive: the compute workers park between passes
        // from its first wait until a layer that finds all its experts ready.
        let mut waited = false;
        // Wait for one expert, then take every other one that is already there (cached, or
        // landed meanwhile): the group is computed in one parallel pass while the drives
        // go on reading the rest.
        loop {
            let landed = match batch.next_ready() {
                Some(l) => l,
                None if batch.remaining() == 0 => break,
                None => {
                    // Waiting for a drive: the compute workers sleep meanwhile, and this
                    // thread does the caller's idle work, looking for a landing between steps.
                    if !waited {
                        waited = true;
                        crate::kernels::pool::pool().park_between_passes(true);
                    }
                    crate::kernels::pool::pool().rest();
                    let mut landed = None;
                    let waiting = std::time::Instant::now();
                    let mut worked = false;
                    while landed.is_none() && on_idle(&mut BatchHints(&mut batch)) {
                        // The idle work may have run a parallel pass, which woke them.
                        crate::kernels::pool::pool().rest();
                        worked = true;
                        landed = batch.next_ready();
                    }
                    if worked {
                        batch.count_wait(waiting);
                    }
                    match landed.or_else(|| batch.next()) {
                        Some(l) => l,
                        None => break,
                    }
                }
            };
            let mut group = vec![landed.map_err(|e| expert_error(layer, first, e))?];
            while let Some(more) = batch.next_ready() {
                group.push(more.map_err(|e| expert_error(layer, first, e))?);
            }
            let views: Vec<(usize, ExpertView<'_>)> = group
                .iter()
                .map(|l| (l.expert as usize, expert_view(l.tensors, l.bytes())))
                .collect();
            on_group(&views)?;
        }
        crate::kernels::pool::pool().park_between_passes(waited);
        Ok(())
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        if let Some((l, ids)) = store_ids(layer, experts) {
            self.store.prefetch(l, &ids);
        }
    }

    fn wants_prefetch(&self) -> bool {
        true
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.resident.contains(name)
    }

    fn share(&self, bytes: &[u8]) -> Option<WeightBytes> {
        let (buf, range) = self.resident.share(bytes)?;
        WeightBytes::shared(buf, range)
    }

    fn release_resident(&mut self) {
        // Keep the counters (bytes, load time) for the statistics; free the buffers, but not
        // a streamed layer's small tensors: every rebuild of the layer reads them again.
        let keep = &self.keep_prefixes;
        self.resident
            .release_except(&|name| keep.iter().any(|p| name.starts_with(p.as_str())));
    }

    fn streamed_layers(&self) -> Vec<usize> {
        self.streamed.clone()
    }

    fn layer_weights(
        &self,
        layer: usize,
        wait: bool,
    ) -> Result<Option<Box<dyn WeightSource + '_>>> {
        let Some(g) = self.streamed.iter().position(|&l| l == layer) else {
            return Ok(None);
        };
        let landed = self.store.take_group(g, wait).map_err(|e| match e {
            StorageError::ResidentRead { record, source } => {
                InferenceError::ResidentRead { record, source }
            }
            e => InferenceError::Storage(e),
        })?;
        Ok(landed.map(|l| {
            Box::new(StreamedLayerSource::new(
                self,
                self.manifest(),
                l,
                &self.store,
            )) as Box<dyn WeightSource>
        }))
    }
}

/// [`ExpertHints`] given to the forward's idle work while `batch` waits: through the batch,
/// which holds the store.
struct BatchHints<'b, 's>(&'b mut ExpertBatch<'s>);

impl ExpertHints for BatchHints<'_, '_> {
    fn repredict(&mut self, layer: usize, experts: &[usize]) {
        if let Some((l, ids)) = store_ids(layer, experts) {
            self.0.repredict(l, &ids);
        }
    }
}
