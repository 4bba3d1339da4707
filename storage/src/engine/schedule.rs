//! Which drive reads a piece (replicate mode) and which job a worker takes next.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{select_biased, Receiver};

use crate::engine::drive::Drive;
use crate::engine::request::Job;
use crate::engine::shared::Shared;

/// The drive with the fewest outstanding bytes (plus `extra[i]`, bytes already assigned to
/// drive i by the caller but not yet counted), among the drives without a recent read error if
/// any (replicate mode).
pub(crate) fn least_loaded(drives: &[Drive], extra: &[u64]) -> usize {
    let any_healthy = drives.iter().any(Drive::healthy);
    let mut best = 0;
    let mut best_bytes = u64::MAX;
    for (i, d) in drives.iter().enumerate() {
        if d.unavailable || (any_healthy && !d.healthy()) {
            continue;
        }
        let o = d
            .outstanding
            .load(Ordering::Relaxed)
            .saturating_add(extra.get(i).copied().unwrap_or(0));
        if o < best_bytes {
            best = i;
            best_bytes = o;
        }
    }
    best
}

/// A job a worker took; `prefetch_slot` when it holds one of its drive's prefetch slots, to
/// give back (`release_prefetch_slot`) once the piece is read.
pub(crate) struct Taken {
    pub job: Job,
    pub prefetch_slot: bool,
}

/// Take one of drive `d`'s prefetch slots, if one is free.
fn take_prefetch_slot(shared: &Shared, d: usize) -> bool {
    shared.drives[d]
        .prefetch_in_flight
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < shared.prefetch_depth).then_some(n + 1)
        })
        .is_ok()
}

pub(crate) fn release_prefetch_slot(shared: &Shared, d: usize) {
    shared.drives[d]
        .prefetch_in_flight
        .fetch_sub(1, Ordering::AcqRel);
}

/// Take the next job for drive `d`'s worker: own demand, (replicate: other drives' demand),
/// own prefetch, (replicate: other drives' prefetch), else wait. Returns `None` to exit.
///
/// Prefetch pieces are taken only while the drive has a prefetch slot free
/// (`Shared::prefetch_depth`), so a demand read never queues behind more prefetched pieces
/// than that. A worker waiting without a slot wakes each millisecond to look again; the worker
/// that frees a slot looks at once.
///
/// In replicate mode every drive holds every byte, so an idle worker steals pieces queued for a
/// busier drive: the submit-time choice (fewest outstanding bytes) balances equal drives, and
/// stealing corrects it when one drive turns out slower.
pub(crate) fn next_job(
    shared: &Shared,
    d: usize,
    lanes: &[(Receiver<Job>, Receiver<Job>)],
    steal: bool,
) -> Option<Taken> {
    let demand_job = |job| {
        Some(Taken {
            job,
            prefetch_slot: false,
        })
    };
    let (demand, prefetch) = &lanes[d];
    loop {
        if let Ok(j) = demand.try_recv() {
            return demand_job(j);
        }
        if steal {
            for (o, pair) in lanes.iter().enumerate() {
                if o == d {
                    continue;
                }
                match pair.0.try_recv() {
                    Ok(Job::Stop) => {
                        // Another worker's stop: give it back; shutdown is under way.
                        let _ = shared.drives[o].lanes[0].send(Job::Stop);
                        return None;
                    }
                    Ok(j) => return demand_job(j),
                    Err(_) => {}
                }
            }
        }
        let slot = take_prefetch_slot(shared, d);
        if slot {
            let own = prefetch.try_recv().ok();
            let stolen = || {
                lanes
                    .iter()
                    .enumerate()
                    .filter(|&(o, _)| steal && o != d)
                    .find_map(|(_, pair)| pair.1.try_recv().ok())
            };
            if let Some(job) = own.or_else(stolen) {
                return Some(Taken {
                    job,
                    prefetch_slot: true,
                });
            }
        }
        // Nothing to take: wait on our own lanes (prefetch only while holding a slot), waking
        // now and then to steal or to look for a freed slot.
        let got = match (slot, steal) {
            (true, false) => select_biased! {
                recv(demand) -> j => Some((j, false)),
                recv(prefetch) -> j => Some((j, true)),
            },
            (true, true) => select_biased! {
                recv(demand) -> j => Some((j, false)),
                recv(prefetch) -> j => Some((j, true)),
                default(Duration::from_millis(1)) => None,
            },
            (false, _) => select_biased! {
                recv(demand) -> j => Some((j, false)),
                default(Duration::from_millis(1)) => None,
            },
        };
        match got {
            Some((j, from_prefetch)) => {
                if slot && !from_prefetch {
                    release_prefetch_slot(shared, d);
                }
                return j.ok().map(|job| Taken {
                    job,
                    prefetch_slot: from_prefetch,
                });
            }
            None => {
                if slot {
                    release_prefetch_slot(shared, d);
                }
            }
        }
    }
}
