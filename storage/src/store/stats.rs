//! Counters of an expert store: reads, cache and prefetch outcomes, stalls, memory, per-drive
//! figures. Counters are monotonic; subtract two snapshots for one phase, add phases up.

use std::ops::{Add, Sub};
use std::time::Duration;

use crate::engine::drive::DriveStats;
use crate::engine::repair_report::Repair;

/// Expert reads, cache and prefetch (monotonic; `later - earlier` for one phase).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchStats {
    /// `fetch` calls.
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
    /// Peak bytes of expert buffers (cached, in flight and spare); a difference keeps the later
    /// peak, a sum the larger.
    pub peak_bytes: u64,
    /// Experts evicted from the cache.
    pub evictions: u64,
    /// Predictions not turned into reads because measured precision was too low.
    pub prefetch_gated: u64,
    /// Predictions replaced by a better one made while the layer before waited for its reads.
    pub repredictions: u64,
}

impl FetchStats {
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

/// Applies `op` to every counter of two [`FetchStats`] (the peak is handled by the caller).
macro_rules! fetch_counters {
    ($a:expr, $b:expr, $op:ident, $peak:expr) => {
        FetchStats {
            batches: $a.batches.$op($b.batches),
            requests: $a.requests.$op($b.requests),
            cache_hits: $a.cache_hits.$op($b.cache_hits),
            prefetch_hits: $a.prefetch_hits.$op($b.prefetch_hits),
            reads: $a.reads.$op($b.reads),
            read_bytes: $a.read_bytes.$op($b.read_bytes),
            prefetch_reads: $a.prefetch_reads.$op($b.prefetch_reads),
            prefetch_cancelled: $a.prefetch_cancelled.$op($b.prefetch_cancelled),
            predicted: $a.predicted.$op($b.predicted),
            predicted_actual: $a.predicted_actual.$op($b.predicted_actual),
            predicted_correct: $a.predicted_correct.$op($b.predicted_correct),
            stall: $a.stall.$op($b.stall),
            peak_bytes: $peak,
            evictions: $a.evictions.$op($b.evictions),
            prefetch_gated: $a.prefetch_gated.$op($b.prefetch_gated),
            repredictions: $a.repredictions.$op($b.repredictions),
        }
    };
}

impl Sub for &FetchStats {
    type Output = FetchStats;
    /// What happened between `rhs` and `self` (counters saturate at zero; the peak is
    /// `self`'s).
    fn sub(self, rhs: &FetchStats) -> FetchStats {
        fetch_counters!(self, rhs, saturating_sub, self.peak_bytes)
    }
}

impl Add for &FetchStats {
    type Output = FetchStats;
    /// Two phases together (the peak is the larger).
    fn add(self, rhs: &FetchStats) -> FetchStats {
        fetch_counters!(
            self,
            rhs,
            saturating_add,
            self.peak_bytes.max(rhs.peak_bytes)
        )
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

/// Everything an expert store counts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreStats {
    pub resident_records: usize,
    /// Payload bytes of the resident set.
    pub resident_bytes: u64,
    pub resident_load_time: Duration,
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
    /// Reads served by another copy after a read error or a hash mismatch (replicate mode).
    pub replica_recoveries: u64,
    /// Bad copies rewritten from good ones (or that could not be), in order.
    pub repairs: Vec<Repair>,
    /// Streamed resident records (a layer's non-expert weights read for every use).
    pub stream: crate::store::streamed::StreamStats,
    /// The prefetch gate's measured precision of each rank of a prediction, likeliest first
    /// (as of now; a moving average): of the lookahead's predictions, or of the early ones
    /// where the lookahead did not run.
    pub prefetch_rank_precision: Vec<f64>,
    /// The same of the early predictions alone (made before the layer before's experts).
    pub prefetch_rank_precision_early: Vec<f64>,
}

impl Sub for &StoreStats {
    type Output = StoreStats;
    /// One phase: fetch and drive counters subtracted, the rest (resident set, memory) as of
    /// `self`.
    fn sub(self, rhs: &StoreStats) -> StoreStats {
        StoreStats {
            bytes_read: self.bytes_read.saturating_sub(rhs.bytes_read),
            drives: self
                .drives
                .iter()
                .enumerate()
                .map(|(i, d)| match rhs.drives.get(i) {
                    Some(r) => d - r,
                    None => d.clone(),
                })
                .collect(),
            fetch: &self.fetch - &rhs.fetch,
            stream: self.stream.since(&rhs.stream),
            replica_recoveries: self
                .replica_recoveries
                .saturating_sub(rhs.replica_recoveries),
            repairs: self
                .repairs
                .get(rhs.repairs.len().min(self.repairs.len())..)
                .unwrap_or_default()
                .to_vec(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_subtract_and_add() {
        let a = FetchStats {
            requests: 10,
            cache_hits: 4,
            stall: Duration::from_millis(5),
            peak_bytes: 100,
            ..FetchStats::default()
        };
        let b = FetchStats {
            requests: 25,
            cache_hits: 14,
            stall: Duration::from_millis(7),
            peak_bytes: 90,
            ..FetchStats::default()
        };
        let d = &b - &a;
        assert_eq!((d.requests, d.cache_hits, d.peak_bytes), (15, 10, 90));
        assert_eq!(d.stall, Duration::from_millis(2));
        let s = &a + &d;
        assert_eq!((s.requests, s.cache_hits, s.peak_bytes), (25, 14, 100));
        assert_eq!(d.hit_rate(), Some(10.0 / 15.0));
        assert_eq!((&a - &b).requests, 0, "saturates");
    }
}
