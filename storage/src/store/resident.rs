//! The resident set: every resident record of a layout read once into its own 4 KiB-aligned
//! buffer (not the engine's pool), with an index from tensor name to bytes.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use crate::buffer::AlignedBuf;
use crate::engine::{Engine, Lane, Target, Ticket};
use crate::error::{Result, StorageError};
use crate::manifest::{RecordId, RecordTensor};
use crate::store::stats::LoadProgress;

/// A resident record held in memory.
#[derive(Debug)]
struct ResidentRecord {
    /// Index of the record in the manifest.
    record: usize,
    /// Shared, so a model can keep tensors of it without a copy ([`ResidentSet::share`]).
    buf: Arc<AlignedBuf>,
}

/// Every resident record's bytes plus a name index.
#[derive(Debug, Default)]
pub struct ResidentSet {
    records: Vec<ResidentRecord>,
    /// Full tensor name -> (position in `records`, tensor index within the record).
    by_name: HashMap<String, (usize, usize)>,
    /// Records loaded (kept after the buffers are released).
    count: usize,
    bytes: u64,
    load_time: Duration,
}

impl ResidentSet {
    /// Read every resident record of the engine's layout but those `skip` names (streamed
    /// instead, see [`crate::store::RecordStream`]), `window` records in flight, reporting
    /// progress after each.
    pub fn load(
        engine: &Engine,
        window: usize,
        skip: &dyn Fn(usize) -> bool,
        on_progress: &mut dyn FnMut(&LoadProgress),
    ) -> Result<ResidentSet> {
        let start = Instant::now();
        let manifest = engine.manifest().clone();
        let indices: Vec<usize> = manifest
            .records
            .iter()
            .enumerate()
            .filter(|(i, r)| matches!(r.id, RecordId::Resident { .. }) && !skip(*i))
            .map(|(i, _)| i)
            .collect();
        let mut progress = LoadProgress {
            done_records: 0,
            total_records: indices.len(),
            done_bytes: 0,
            total_bytes: indices.iter().map(|&i| manifest.records[i].len).sum(),
        };
        on_progress(&progress);
        let read_err = |i: usize, source: StorageError| StorageError::ResidentRead {
            record: match &manifest.records[i].id {
                RecordId::Resident { group } => group.clone(),
                other => other.to_string(),
            },
            source: Box::new(source),
        };
        let window = window.max(1);
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
                let buf = c.result.map_err(|e| read_err(i, e))?.buf.into_owned();
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
            set.records.push(ResidentRecord {
                record: i,
                buf: Arc::new(buf),
            });
        }
        set.load_time = start.elapsed();
        set.count = set.records.len();
        Ok(set)
    }

    /// The tensor named `name`: its description and bytes (`tensors` are the manifest's
    /// records, which this set was loaded from).
    pub fn tensor<'a>(
        &'a self,
        records: &'a [crate::manifest::RecordEntry],
        name: &str,
    ) -> Option<(&'a RecordTensor, &'a [u8])> {
        let &(pos, k) = self.by_name.get(name)?;
        let rec = self.records.get(pos)?;
        let t = records.get(rec.record)?.tensors.get(k)?;
        let end = t.offset.checked_add(t.len)?;
        let bytes = rec.buf.get(t.offset as usize..end as usize)?;
        Some((t, bytes))
    }

    /// The record buffer that `bytes` (a slice this set handed out) lies in, and where: a
    /// caller keeps the tensor without copying it, and the buffer lives as long as any holder
    /// (after [`ResidentSet::release`] too). `None` for bytes from anywhere else.
    pub fn share(&self, bytes: &[u8]) -> Option<(Arc<AlignedBuf>, Range<usize>)> {
        let start = bytes.as_ptr() as usize;
        let end = start.checked_add(bytes.len())?;
        self.records.iter().find_map(|r| {
            let base = r.buf.as_ptr() as usize;
            let top = base.checked_add(r.buf.len())?;
            (base <= start && end <= top).then(|| (r.buf.clone(), start - base..end - base))
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Names of the tensors held.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Free the buffers; the counts stay for the statistics.
    pub fn release(&mut self) {
        self.release_except(&|_| false);
    }

    /// Free the buffers of every record none of whose tensors `keep` names (what the model
    /// must read again later, such as a streamed layer's small tensors, stays).
    pub fn release_except(&mut self, keep: &dyn Fn(&str) -> bool) {
        let kept: Vec<usize> = self
            .records
            .iter()
            .enumerate()
            .filter(|(pos, _)| {
                self.by_name
                    .iter()
                    .any(|(name, &(p, _))| p == *pos && keep(name))
            })
            .map(|(pos, _)| pos)
            .collect();
        let records = std::mem::take(&mut self.records);
        let by_name = std::mem::take(&mut self.by_name);
        let mut new_pos = HashMap::new();
        for (pos, rec) in records.into_iter().enumerate() {
            if kept.contains(&pos) {
                new_pos.insert(pos, self.records.len());
                self.records.push(rec);
            }
        }
        for (name, (pos, k)) in by_name {
            if let Some(&p) = new_pos.get(&pos) {
                self.by_name.insert(name, (p, k));
            }
        }
    }

    /// Bytes of the buffers held now.
    pub fn held_bytes(&self) -> u64 {
        self.records.iter().map(|r| r.buf.len() as u64).sum()
    }

    /// Records loaded.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Payload bytes loaded.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn load_time(&self) -> Duration {
        self.load_time
    }
}
