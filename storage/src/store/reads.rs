//! Reading routed experts: [`ExpertStore::fetch`] (a layer's experts as an [`ExpertBatch`],
//! yielded as they become available), [`ExpertStore::prefetch`], and the submission and
//! landing of the reads behind both.
//!
//! At the start the batch scores the layer's prediction, cancels mispredicted prefetches that
//! have not started, promotes wanted ones, and sorts the experts into cached, in flight and to
//! read. Each `next()` submits what the budget allows (never evicting an expert of this batch
//! not yet handed over: they are pinned), hands over a cached expert if there is one, else waits
//! for the next read to land.

use std::collections::VecDeque;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use crate::buffer::AlignedBuf;
use crate::engine::{Completion, Lane, Target};
use crate::error::{Result, StorageError};
use crate::manifest::RecordTensor;
use crate::store::cache::{ExpertKey, Lookup};
use crate::store::expert_store::{key_tag, tag_key};
use crate::store::expert_store::{ExpertStore, StoreState};
use crate::store::gate::Predictor;
use crate::stripe::align_up;

/// One routed expert's record, handed over.
#[derive(Debug)]
pub struct LandedExpert<'s> {
    pub expert: u32,
    /// The record's tensors (its layer's template), offsets into [`LandedExpert::bytes`].
    pub tensors: &'s [RecordTensor],
    buf: Arc<AlignedBuf>,
}

impl LandedExpert<'_> {
    /// The record's payload.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// Tensor `i`'s bytes (in bounds: the manifest was validated against the record length).
    pub fn tensor_bytes(&self, t: &RecordTensor) -> Option<&[u8]> {
        let end = t.offset.checked_add(t.len)?;
        self.buf.get(t.offset as usize..end as usize)
    }
}

impl ExpertStore {
    /// Start reading `experts` of `layer` on the prefetch lane (those not cached or in flight),
    /// likeliest first, as far as the budget allows without evicting experts of `layer` or the
    /// layer before it; only the prediction's ranks whose measured precision is high enough.
    ///
    /// The forward predicts layer L+1 before it fetches layer L. Started at once, L+1's reads
    /// would take the drive ahead of L's demand reads (a read a worker has started is not
    /// overtaken) and the drive would then sit idle while L's last experts, L+1's attention
    /// and its router compute. So when the layer before has routed experts here, the reads
    /// are held back until that layer's demand reads are all submitted ([`ExpertBatch`]) and
    /// fill that gap instead.
    pub fn prefetch(&self, layer: u32, experts: &[u32]) {
        let mut st = self.lock();
        let wanted = st.gate.predict(layer, Predictor::Early, experts);
        st.stats.prefetch_gated += (experts.len() - wanted.len()) as u64;
        // Prefetches of `layer` still queued are an earlier prediction's (a next-token
        // guess, wrong, or right but for a forward of several positions): the ones this
        // prediction drops are cancelled.
        cancel_unstarted_drops(&mut st, layer, &wanted);
        let fetched_before = layer
            .checked_sub(1)
            .is_some_and(|before| self.record_of(before, 0).is_ok());
        if fetched_before {
            // A held-back prefetch no fetch claimed is stale by now: replaced.
            st.deferred_prefetch = Some((layer, wanted));
        } else {
            self.issue_prefetch(&mut st, layer, &wanted);
        }
    }

    /// Submit prefetch reads of `wanted` (see [`ExpertStore::prefetch`]).
    pub(crate) fn issue_prefetch(&self, st: &mut StoreState, layer: u32, wanted: &[u32]) {
        for &e in wanted {
            let key = (layer, e);
            if st.cache.contains(key) {
                continue;
            }
            let Ok(record) = self.record_of(layer, e) else {
                continue;
            };
            let evictable = |k: ExpertKey| k.0 != layer && k.0 + 1 != layer;
            match self.submit(st, key, record, Lane::Prefetch, &evictable) {
                Ok(true) => {}
                Ok(false) | Err(_) => break,
            }
        }
    }

    /// Submit a read of `key` (record `record`) on `lane` within the budget; `Ok(false)` when
    /// there is no room in the budget or no room for one more read outstanding.
    pub(crate) fn submit(
        &self,
        st: &mut StoreState,
        key: ExpertKey,
        record: usize,
        lane: Lane,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Result<bool> {
        // A read's completion must have room on the channel (see `ExpertStore::open`).
        if st.tickets.len() >= self.max_outstanding {
            return Ok(false);
        }
        let len = self.engine().record(record).len;
        let need = align_up(len.max(1));
        let dest = match st
            .cache
            .reserve(key, need, lane == Lane::Prefetch, evictable)
        {
            Ok(Some(b)) => b,
            Ok(None) => AlignedBuf::zeroed(len as usize),
            Err(_) => return Ok(false),
        };
        match self.engine().submit(
            Target::Record(record),
            lane,
            key_tag(key),
            self.tx.clone(),
            Some(dest),
        ) {
            Ok(t) => {
                st.tickets.insert(key, t);
                if lane == Lane::Prefetch {
                    st.stats.prefetch_reads += 1;
                }
                Ok(true)
            }
            Err(source) => {
                st.cache.abort(key);
                Err(StorageError::ExpertRead {
                    layer: key.0,
                    expert: key.1,
                    source: Box::new(source),
                })
            }
        }
    }

    /// Apply one completion: the key it was for and, on failure, the error.
    pub(crate) fn land(
        &self,
        st: &mut StoreState,
        c: Completion,
    ) -> (ExpertKey, Option<StorageError>) {
        let key = tag_key(c.tag);
        st.tickets.remove(&key);
        st.clock += 1;
        let now = st.clock;
        match c.result {
            Ok(loaded) => {
                let buf = loaded.buf.into_owned();
                let len = buf.len() as u64;
                if st.cache.land(key, Some(buf), now) {
                    st.stats.reads += 1;
                    st.stats.read_bytes += len;
                }
                (key, None)
            }
            Err(e) => {
                st.cache.land(key, None, now);
                // A cancelled guess's buffer is kept for the next read rather than freed:
                // allocating and freeing expert buffers fragments the heap and grows the
                // resident set past the budget (the lookahead cancels more guesses).
                if let Some(b) = c.unused {
                    let _ = st.cache.add_spare(b);
                }
                (key, Some(e))
            }
        }
    }

    /// Routed experts `experts` of `layer`, each yielded once as it becomes available.
    /// Unknown experts are refused before anything is read.
    pub fn fetch(&self, layer: u32, experts: &[u32]) -> Result<ExpertBatch<'_>> {
        ExpertBatch::start(self, layer, experts)
    }
}

/// One layer's experts in landing order (see the module docs).
#[derive(Debug)]
pub struct ExpertBatch<'s> {
    store: &'s ExpertStore,
    st: MutexGuard<'s, StoreState>,
    layer: u32,
    experts: Vec<u32>,
    records: Vec<usize>,
    delivered: Vec<bool>,
    /// Indices into `experts` that are landed and not yet handed over.
    ready: Vec<usize>,
    /// Indices into `experts` still to submit.
    to_read: VecDeque<usize>,
    /// Reads of this batch in flight.
    in_flight: usize,
    now: u64,
    failed: bool,
}

impl<'s> ExpertBatch<'s> {
    pub(crate) fn start(store: &'s ExpertStore, layer: u32, experts: &[u32]) -> Result<Self> {
        let mut st = store.lock();
        st.stats.batches += 1;
        let records = experts
            .iter()
            .map(|&e| store.record_of(layer, e))
            .collect::<Result<Vec<usize>>>()?;
        let n = experts.len();
        st.stats.requests += n as u64;
        // A prefetch of this very layer still held back: its demand reads follow at once.
        if st.deferred_prefetch.as_ref().is_some_and(|d| d.0 == layer) {
            st.deferred_prefetch = None;
        }
        // Score the prediction for this layer; cancel wrong guesses not yet started.
        if let Some(s) = st.gate.score(layer, experts) {
            st.stats.predicted += s.predicted;
            st.stats.predicted_actual += s.requested;
            st.stats.predicted_correct += s.correct;
        }
        let wrong: Vec<ExpertKey> = st
            .cache
            .pending_keys()
            .filter(|&((l, e), live_prefetch)| l == layer && live_prefetch && !experts.contains(&e))
            .map(|(k, _)| k)
            .collect();
        for k in wrong {
            st.cancel_read(k);
        }
        st.clock += 1;
        let now = st.clock;
        let mut batch = ExpertBatch {
            store,
            st,
            layer,
            experts: experts.to_vec(),
            records,
            delivered: vec![false; n],
            ready: Vec::new(),
            to_read: VecDeque::new(),
            in_flight: 0,
            now,
            failed: false,
        };
        // Classify: cached, in flight (promote prefetches), or to read.
        for (i, &e) in experts.iter().enumerate() {
            let key = (layer, e);
            batch.st.cache.pin(key);
            match batch.st.cache.lookup(key, now) {
                Lookup::Ready(_) => batch.ready.push(i),
                Lookup::PrefetchInFlight => {
                    if let Some(t) = batch.st.tickets.get(&key) {
                        t.promote();
                    }
                    batch.in_flight += 1;
                }
                // A cancelled read is read again once it has settled.
                Lookup::InFlight => batch.in_flight += 1,
                Lookup::Miss => batch.to_read.push_back(i),
            }
        }
        // The layer's experts: cached, already in flight (prefetched), to read now.
        crate::timeline::mark(
            "batch",
            u64::from(layer),
            batch.ready.len() as u64
                | (batch.in_flight as u64) << 16
                | (batch.to_read.len() as u64) << 32,
        );
        Ok(batch)
    }

    /// Experts of the batch not handed over yet.
    pub fn remaining(&self) -> usize {
        self.delivered.iter().filter(|&&d| !d).count()
    }

    fn index_of(&self, e: u32) -> Option<usize> {
        self.experts.iter().position(|&x| x == e)
    }

    fn hand_over(&mut self, i: usize) -> Option<LandedExpert<'s>> {
        let key = (self.layer, self.experts[i]);
        let buf = self.st.cache.peek(key)?;
        self.delivered[i] = true;
        self.st.cache.unpin(key);
        let manifest: &'s crate::manifest::Manifest = self.store.manifest();
        Some(LandedExpert {
            expert: self.experts[i],
            tensors: manifest.record_tensors(&manifest.records[self.records[i]]),
            buf,
        })
    }

    /// Submit reads while the budget has room. When nothing of this batch can free room,
    /// cancel the reads that are not part of it (other layers' prefetches and this layer's
    /// mispredicted ones) and wait for them; with nothing in flight at all, the budget is too
    /// small for this expert.
    fn submit_what_fits(&mut self) -> Result<()> {
        while let Some(&i) = self.to_read.front() {
            let key = (self.layer, self.experts[i]);
            let submitted =
                self.store
                    .submit(&mut self.st, key, self.records[i], Lane::Demand, &|_| true)?;
            if submitted {
                self.to_read.pop_front();
                self.in_flight += 1;
                continue;
            }
            if self.in_flight == 0 && self.ready.is_empty() {
                let others: Vec<ExpertKey> = self
                    .st
                    .cache
                    .pending_keys()
                    .map(|(k, _)| k)
                    .filter(|&(l, e)| l != self.layer || self.index_of(e).is_none())
                    .collect();
                if others.is_empty() {
                    return Err(StorageError::ExpertBudget {
                        layer: self.layer,
                        expert: self.experts[i],
                        need: align_up(self.store.engine().record(self.records[i]).len.max(1)),
                        cap: self.st.cache.cap(),
                    });
                }
                for k in others {
                    self.st.cancel_read(k);
                }
            }
            break;
        }
        // Every demand read is submitted: now the next layer's held-back prefetch.
        if self.to_read.is_empty() {
            if let Some((layer, wanted)) = self.st.deferred_prefetch.take() {
                if layer != self.layer {
                    crate::timeline::mark("prefetch", u64::from(layer), wanted.len() as u64);
                    self.store.issue_prefetch(&mut self.st, layer, &wanted);
                }
            }
        }
        Ok(())
    }

    /// A better prediction of the experts `layer` will ask for (likeliest first), made while
    /// this batch waits for its reads (the forward can then run the next layer's attention on
    /// the output so far). It replaces the earlier prediction: that one's prefetches the new
    /// one drops are cancelled where no drive has started them, and the new one's gated ranks
    /// are read (behind this batch's demand reads, as [`ExpertStore::prefetch`]'s are).
    ///
    /// A layer before this one can only be the next token's (a forward goes up the layers):
    /// that prediction, made from a guess of the next token, is scored as
    /// [`Predictor::NextToken`].
    pub fn repredict(&mut self, layer: u32, experts: &[u32]) {
        if layer == self.layer {
            return;
        }
        let by = if layer < self.layer {
            Predictor::NextToken
        } else {
            Predictor::Lookahead
        };
        let wanted = self.st.gate.predict(layer, by, experts);
        self.st.stats.prefetch_gated += (experts.len() - wanted.len()) as u64;
        self.st.stats.repredictions += 1;
        cancel_unstarted_drops(&mut self.st, layer, &wanted);
        crate::timeline::mark("repredict", u64::from(layer), wanted.len() as u64);
        if !self.to_read.is_empty() {
            // This batch's demand reads are not all submitted yet: held back as before.
            self.st.deferred_prefetch = Some((layer, wanted));
        } else {
            self.st.deferred_prefetch = None;
            self.store.issue_prefetch(&mut self.st, layer, &wanted);
        }
    }

    /// Time since `since` spent waiting for this batch's reads while doing other work (the
    /// caller's idle work between [`ExpertBatch::next_ready`] looks): counted as a stall, and
    /// on the timeline as one, as a blocking wait is.
    pub fn count_wait(&mut self, since: Instant) {
        let now = Instant::now();
        self.st.stats.stall += now.duration_since(since);
        crate::timeline::record("stall", since, now, u64::from(self.layer), 0);
    }

    /// The next expert of the batch whose bytes are available now (cached, or a read that
    /// has completed), without waiting for a drive; `None` when none is.
    pub fn next_ready(&mut self) -> Option<Result<LandedExpert<'s>>> {
        if self.failed {
            return None;
        }
        match self.step(false) {
            Ok(l) => l.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }

    /// The next expert; with `wait`, blocks for a read to complete when none is ready
    /// (`None`: all delivered); without, `None` also when nothing is ready now.
    fn step(&mut self, wait: bool) -> Result<Option<LandedExpert<'s>>> {
        loop {
            self.submit_what_fits()?;
            if let Some(i) = self.ready.pop() {
                match self.hand_over(i) {
                    Some(l) => return Ok(Some(l)),
                    None => {
                        // Evicted before it was handed over (cannot happen while pinned):
                        // read it again.
                        self.to_read.push_back(i);
                        continue;
                    }
                }
            }
            if self.delivered.iter().all(|&d| d) {
                return Ok(None);
            }
            if self.in_flight == 0 && self.to_read.is_empty() {
                // Nothing of ours is coming (a pending read of ours settled as another
                // layer's): look again.
                for i in 0..self.experts.len() {
                    let key = (self.layer, self.experts[i]);
                    if !self.delivered[i] && !self.st.cache.contains(key) {
                        self.to_read.push_back(i);
                    } else if !self.delivered[i] && self.st.cache.peek(key).is_some() {
                        self.ready.push(i);
                    }
                }
                if !self.to_read.is_empty() || !self.ready.is_empty() {
                    continue;
                }
            }
            let closed = || StorageError::ExpertRead {
                layer: self.layer,
                expert: self.experts[0],
                source: Box::new(StorageError::EngineClosed),
            };
            let c = if wait {
                let t = Instant::now();
                let c = self.store.rx.recv().map_err(|_| closed())?;
                self.st.stats.stall += t.elapsed();
                crate::timeline::record("stall", t, Instant::now(), u64::from(self.layer), 0);
                c
            } else {
                match self.store.rx.try_recv() {
                    Ok(c) => c,
                    Err(crossbeam_channel::TryRecvError::Empty) => return Ok(None),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(closed()),
                }
            };
            let (key, err) = self.store.land(&mut self.st, c);
            let mine = (key.0 == self.layer)
                .then(|| self.index_of(key.1))
                .flatten()
                .filter(|&i| !self.delivered[i]);
            let Some(i) = mine else {
                continue; // another layer's prefetch
            };
            self.in_flight = self.in_flight.saturating_sub(1);
            match err {
                None => {
                    self.st.cache.touch(key, self.now);
                    self.ready.push(i);
                }
                Some(StorageError::Cancelled) => self.to_read.push_back(i),
                Some(source) => {
                    return Err(StorageError::ExpertRead {
                        layer: self.layer,
                        expert: key.1,
                        source: Box::new(source),
                    })
                }
            }
        }
    }
}

impl<'s> Iterator for ExpertBatch<'s> {
    type Item = Result<LandedExpert<'s>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.step(true) {
            Ok(Some(l)) => Some(Ok(l)),
            Ok(None) => None,
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

impl Drop for ExpertBatch<'_> {
    fn drop(&mut self) {
        for i in 0..self.experts.len() {
            if !self.delivered[i] {
                let key = (self.layer, self.experts[i]);
                self.st.cache.unpin(key);
            }
        }
    }
}

/// Cancel the live prefetches of `layer` outside `wanted` that no drive has started.
fn cancel_unstarted_drops(st: &mut StoreState, layer: u32, wanted: &[u32]) {
    let dropped: Vec<ExpertKey> = st
        .cache
        .pending_keys()
        .filter(|&((l, e), live_prefetch)| l == layer && live_prefetch && !wanted.contains(&e))
        .map(|(k, _)| k)
        .filter(|k| st.tickets.get(k).is_some_and(|t| !t.started()))
        .collect();
    for k in dropped {
        st.cancel_read(k);
    }
}
