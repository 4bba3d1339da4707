//! [`RecordStream`]: groups of resident records that are not held in memory but read again for
//! every use (a decoder layer's non-expert weights when the RAM budget cannot hold them all).
//!
//! The groups are used in a fixed cyclic order (layer after layer, token after token), so the
//! stream reads ahead: taking group `g` queues `g` on the demand lane if it is not already
//! coming, then the groups after it (cyclically) on the prefetch lane, then waits for `g`.
//! Buffers come back with [`RecordStream::give_back`] and are reused by the next reads of the
//! same sizes, so a steady state allocates nothing. At most `ahead + 1` groups are held at once,
//! taken or being read: a group given back makes room for the next read.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver};

use crate::buffer::AlignedBuf;
use crate::engine::{Completion, Engine, Lane, Target, Ticket};
use crate::error::{Result, StorageError};
use crate::stripe::align_up;

/// One streamed group: a name for errors and statistics, and its records (manifest indices).
#[derive(Clone, Debug)]
pub struct StreamGroup {
    pub name: String,
    pub records: Vec<usize>,
}

/// A group's records as read, shared with whoever builds on them; hand the group back with
/// [`RecordStream::give_back`] once every clone of the buffers is dropped.
#[derive(Debug)]
pub struct LandedGroup {
    pub group: usize,
    /// `(record index, bytes)`, in the group's record order.
    pub records: Vec<(usize, Arc<AlignedBuf>)>,
}

/// Counters of a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct StreamStats {
    /// Groups taken.
    pub takes: u64,
    /// Takes whose every record had already landed (the read was hidden behind compute).
    pub ready_takes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Time takes spent waiting for reads.
    pub wait: Duration,
    /// Bytes of the buffers the stream owns (in flight, taken or free for reuse), now and at
    /// the peak.
    pub buffer_bytes: u64,
    pub peak_buffer_bytes: u64,
}

impl StreamStats {
    /// The counters since `earlier` (the peak as of now).
    pub fn since(&self, earlier: &StreamStats) -> StreamStats {
        StreamStats {
            takes: self.takes.saturating_sub(earlier.takes),
            ready_takes: self.ready_takes.saturating_sub(earlier.ready_takes),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            wait: self.wait.saturating_sub(earlier.wait),
            buffer_bytes: self.buffer_bytes,
            peak_buffer_bytes: self.peak_buffer_bytes,
        }
    }
}

/// Where a group is.
#[derive(Debug)]
enum Slot {
    Idle,
    Reading(Reading),
    Taken,
}

#[derive(Debug)]
struct Reading {
    rx: Receiver<Completion>,
    tickets: Vec<Ticket>,
    landed: HashMap<usize, AlignedBuf>,
    wanted: usize,
}

#[derive(Debug, Default)]
struct StreamState {
    slots: Vec<Slot>,
    /// The group taken last (reads ahead follow it).
    last_taken: Option<usize>,
    free: Vec<AlignedBuf>,
    buffer_bytes: u64,
    stats: StreamStats,
}

/// Streamed groups of records (see the module docs).
#[derive(Debug, Default)]
pub struct RecordStream {
    groups: Vec<StreamGroup>,
    ahead: usize,
    /// Bytes of buffers the stream keeps at most: `ahead + 1` of its largest group (records
    /// rounded up to 4 KiB). Free buffers are dropped before this would be passed.
    cap: u64,
    state: Mutex<StreamState>,
    returned: Condvar,
}

impl RecordStream {
    /// A stream of `groups` of `engine`'s layout, reading `ahead` groups ahead of the one
    /// taken.
    pub fn new(engine: &Engine, groups: Vec<StreamGroup>, ahead: usize) -> RecordStream {
        let slots = groups.iter().map(|_| Slot::Idle).collect();
        let largest = groups
            .iter()
            .map(|g| {
                g.records
                    .iter()
                    .map(|&r| {
                        align_up(engine.manifest().records.get(r).map_or(0, |e| e.len).max(1))
                    })
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        RecordStream {
            groups,
            ahead,
            cap: largest.saturating_mul(ahead as u64 + 1),
            state: Mutex::new(StreamState {
                slots,
                ..StreamState::default()
            }),
            returned: Condvar::new(),
        }
    }

    pub fn groups(&self) -> &[StreamGroup] {
        &self.groups
    }

    pub fn stats(&self) -> StreamStats {
        let st = self.lock();
        StreamStats {
            buffer_bytes: st.buffer_bytes,
            ..st.stats
        }
    }

    fn lock(&self) -> MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error of a group's read, naming the group and the record.
    fn read_error(
        &self,
        engine: &Engine,
        g: usize,
        record: usize,
        e: StorageError,
    ) -> StorageError {
        StorageError::ResidentRead {
            record: format!(
                "{} (streamed group {}, record {record})",
                engine
                    .manifest()
                    .records
                    .get(record)
                    .map_or_else(|| "?".to_string(), |r| r.id.to_string()),
                self.groups[g].name
            ),
            source: Box::new(e),
        }
    }

    /// Queue every record of group `g` on `lane` into reused buffers.
    fn start(&self, engine: &Engine, st: &mut StreamState, g: usize, lane: Lane) -> Result<()> {
        let records = &self.groups[g].records;
        let (tx, rx) = bounded(records.len().max(1));
        let mut tickets = Vec::with_capacity(records.len());
        for &r in records {
            let len = engine.manifest().records.get(r).map_or(0, |e| e.len);
            let need = align_up(len.max(1)) as usize;
            // A free buffer of exactly this size (the previous read of the same record, in a
            // steady state): reusing a larger one could leave a later record none to fit and
            // grow the buffers past their cap.
            let pick = st.free.iter().position(|b| b.capacity() == need);
            let buf = match pick {
                Some(i) => st.free.swap_remove(i),
                None => {
                    // Drop free buffers of other sizes rather than grow past the cap.
                    while st.buffer_bytes + need as u64 > self.cap {
                        let Some(b) = st.free.pop() else { break };
                        st.buffer_bytes = st.buffer_bytes.saturating_sub(b.capacity() as u64);
                    }
                    st.buffer_bytes += need as u64;
                    st.stats.peak_buffer_bytes = st.stats.peak_buffer_bytes.max(st.buffer_bytes);
                    AlignedBuf::zeroed(need)
                }
            };
            match engine.submit(Target::Record(r), lane, r as u64, tx.clone(), Some(buf)) {
                Ok(t) => tickets.push(t),
                Err(e) => {
                    for t in &tickets {
                        t.cancel();
                    }
                    return Err(self.read_error(engine, g, r, e));
                }
            }
        }
        st.slots[g] = Slot::Reading(Reading {
            rx,
            tickets,
            landed: HashMap::new(),
            wanted: records.len(),
        });
        Ok(())
    }

    /// Take group `g`: wait for its records (`wait`), or return `None` unless they have all
    /// landed already (`!wait`; nothing is queued then). Taking queues the next groups.
    pub fn take(&self, engine: &Engine, g: usize, wait: bool) -> Result<Option<LandedGroup>> {
        if g >= self.groups.len() {
            return Err(StorageError::InvalidArgument(format!(
                "streamed group {g} of {}",
                self.groups.len()
            )));
        }
        let started = Instant::now();
        let mut st = self.lock();
        // Another forward pass holds it: wait for it to come back.
        while wait && matches!(st.slots[g], Slot::Taken) {
            st = self.returned.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match &mut st.slots[g] {
            Slot::Taken => return Ok(None),
            Slot::Idle if !wait => return Ok(None),
            Slot::Idle => self.start(engine, &mut st, g, Lane::Demand)?,
            Slot::Reading(r) => {
                while let Ok(c) = r.rx.try_recv() {
                    let idx = c.tag as usize;
                    match c.result {
                        Ok(l) => {
                            r.landed.insert(idx, l.buf.into_owned());
                        }
                        Err(e) => {
                            let slot = std::mem::replace(&mut st.slots[g], Slot::Idle);
                            cancel(slot);
                            return Err(self.read_error(engine, g, idx, e));
                        }
                    }
                }
                if !wait && r.landed.len() < r.wanted {
                    return Ok(None);
                }
                if r.landed.len() < r.wanted {
                    for t in &r.tickets {
                        t.promote();
                    }
                }
            }
        }
        let Slot::Reading(mut reading) = std::mem::replace(&mut st.slots[g], Slot::Taken) else {
            return Ok(None);
        };
        let ready = reading.landed.len() == reading.wanted;
        st.last_taken = Some(g);
        // Read ahead while this one is used.
        if let Err(e) = self.read_ahead(engine, &mut st) {
            st.slots[g] = Slot::Idle;
            drop(st);
            cancel(Slot::Reading(reading));
            return Err(e);
        }
        drop(st);
        while reading.landed.len() < reading.wanted {
            let got = reading.rx.recv().map_err(|_| StorageError::EngineClosed);
            let failed = match got {
                Ok(c) => match c.result {
                    Ok(l) => {
                        reading.landed.insert(c.tag as usize, l.buf.into_owned());
                        None
                    }
                    Err(e) => Some((c.tag as usize, e)),
                },
                Err(e) => Some((self.groups[g].records.first().copied().unwrap_or(0), e)),
            };
            if let Some((record, e)) = failed {
                self.lock().slots[g] = Slot::Idle;
                self.returned.notify_all();
                cancel(Slot::Reading(reading));
                return Err(self.read_error(engine, g, record, e));
            }
        }
        let mut records = Vec::with_capacity(reading.wanted);
        for &r in &self.groups[g].records {
            match reading.landed.remove(&r) {
                Some(b) => records.push((r, Arc::new(b))),
                None => {
                    self.lock().slots[g] = Slot::Idle;
                    self.returned.notify_all();
                    return Err(self.read_error(
                        engine,
                        g,
                        r,
                        StorageError::InvalidArgument("record listed twice in its group".into()),
                    ));
                }
            }
        }
        let mut st = self.lock();
        st.stats.takes += 1;
        st.stats.ready_takes += u64::from(ready);
        st.stats.bytes_read += records.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
        if !ready {
            st.stats.wait += started.elapsed();
        }
        Ok(Some(LandedGroup { group: g, records }))
    }

    /// Queue the groups after the last one taken, as long as fewer than `ahead + 1` are held.
    fn read_ahead(&self, engine: &Engine, st: &mut StreamState) -> Result<()> {
        let Some(last) = st.last_taken else {
            return Ok(());
        };
        let n = self.groups.len();
        for i in 1..=self.ahead.min(n.saturating_sub(1)) {
            let held = st.slots.iter().filter(|s| !matches!(s, Slot::Idle)).count();
            if held > self.ahead {
                break;
            }
            let next = (last + i) % n;
            if matches!(st.slots[next], Slot::Idle) {
                self.start(engine, st, next, Lane::Prefetch)?;
            }
        }
        Ok(())
    }

    /// Return a taken group: its buffers are reused by later reads (a buffer some holder still
    /// shares is dropped by that holder instead), and the next group can be read ahead.
    pub fn give_back(&self, engine: &Engine, landed: LandedGroup) {
        let mut st = self.lock();
        for (_, buf) in landed.records {
            match Arc::try_unwrap(buf) {
                Ok(b) => st.free.push(b),
                Err(shared) => {
                    st.buffer_bytes = st.buffer_bytes.saturating_sub(shared.capacity() as u64);
                }
            }
        }
        if let Some(slot) = st.slots.get_mut(landed.group) {
            *slot = Slot::Idle;
        }
        // A failed read-ahead is retried (and reported) when its group is taken.
        let _ = self.read_ahead(engine, &mut st);
        drop(st);
        self.returned.notify_all();
    }
}

/// Cancel a slot's reads that have not started; the rest finish into buffers that are dropped.
fn cancel(slot: Slot) {
    if let Slot::Reading(r) = slot {
        for t in &r.tickets {
            t.cancel();
        }
    }
}
