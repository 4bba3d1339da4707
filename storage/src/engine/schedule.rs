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

/// Take the next job for drive `d`'s worker: own demand, (replicate: other drives' demand),
/// own prefetch, (replicate: other drives' prefetch), else wait. Returns `None` to exit.
///
/// In replicate mode every drive holds every byte, so an idle worker steals pieces queued for a
/// busier drive: the submit-time choice (fewest outstanding bytes) balances equal drives, and
/// stealing corrects it when one drive turns out slower.
pub(crate) fn next_job(
    shared: &Shared,
    d: usize,
    lanes: &[(Receiver<Job>, Receiver<Job>)],
    steal: bool,
) -> Option<Job> {
    let (demand, prefetch) = &lanes[d];
    loop {
        if let Ok(j) = demand.try_recv() {
            return Some(j);
        }
        if steal {
            for lane in [0usize, 1] {
                if lane == 1 {
                    if let Ok(j) = prefetch.try_recv() {
                        return Some(j);
                    }
                }
                for (o, pair) in lanes.iter().enumerate() {
                    if o == d {
                        continue;
                    }
                    let rx = if lane == 0 { &pair.0 } else { &pair.1 };
                    match rx.try_recv() {
                        Ok(Job::Stop) => {
                            // Another worker's stop: give it back; shutdown is under way.
                            let _ = shared.drives[o].lanes[0].send(Job::Stop);
                            return None;
                        }
                        Ok(j) => return Some(j),
                        Err(_) => {}
                    }
                }
            }
            // Nothing anywhere: wait on our own lanes, waking now and then to look for work to steal.
            select_biased! {
                recv(demand) -> j => return j.ok(),
                recv(prefetch) -> j => return j.ok(),
                default(Duration::from_millis(1)) => continue,
            }
        }
        return select_biased! {
            recv(demand) -> j => j.ok(),
            recv(prefetch) -> j => j.ok(),
        };
    }
}
