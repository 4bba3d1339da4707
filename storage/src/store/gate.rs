//! [`PrefetchGate`]: scores next-layer predictions against what the layer then asks for, and
//! closes while they are too often wrong.
//!
//! A wrong prefetch that has started costs drive bandwidth, the bottleneck when decoding is
//! I/O-bound: on the synthetic medium model (precision ~0.6, 4 throttled drives) prefetching read
//! 31% more bytes per token and decoded 34% slower than not prefetching
//! (`benches/results/gen_extras_ungated_prefetch.json`). Predictions keep being scored while the
//! gate is closed, so prefetching resumes if they become accurate.

use std::collections::HashMap;

/// Prefetch reads are only issued while the measured precision stays at or above this.
pub const PREFETCH_MIN_PRECISION: f64 = 0.75;
/// Predictions scored before the gate may close.
pub const PREFETCH_WARMUP: u64 = 8;

/// How one layer's prediction compared with its request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Score {
    pub predicted: u64,
    pub requested: u64,
    pub correct: u64,
}

/// The prediction scorer and gate (no I/O).
#[derive(Debug, Clone)]
pub struct PrefetchGate {
    /// Experts predicted per layer, until that layer is requested.
    predicted: HashMap<u32, Vec<u32>>,
    /// Moving average of the fraction of predicted experts that were then requested.
    precision_ema: f64,
    /// Predictions scored so far.
    scored: u64,
}

impl Default for PrefetchGate {
    fn default() -> Self {
        PrefetchGate {
            predicted: HashMap::new(),
            precision_ema: 1.0,
            scored: 0,
        }
    }
}

impl PrefetchGate {
    /// Record a prediction for `layer`; returns whether to read it.
    pub fn predict(&mut self, layer: u32, experts: &[u32]) -> bool {
        self.predicted.insert(layer, experts.to_vec());
        self.open()
    }

    /// Whether predictions are accurate enough to act on.
    pub fn open(&self) -> bool {
        self.scored < PREFETCH_WARMUP || self.precision_ema >= PREFETCH_MIN_PRECISION
    }

    pub fn precision(&self) -> f64 {
        self.precision_ema
    }

    /// `layer` asks for `experts`: score its prediction, if there was one.
    pub fn score(&mut self, layer: u32, experts: &[u32]) -> Option<Score> {
        let pred = self.predicted.remove(&layer)?;
        let correct = pred.iter().filter(|e| experts.contains(e)).count() as u64;
        if !pred.is_empty() {
            let p = correct as f64 / pred.len() as f64;
            self.precision_ema = 0.9 * self.precision_ema + 0.1 * p;
            self.scored += 1;
        }
        Some(Score {
            predicted: pred.len() as u64,
            requested: experts.len() as u64,
            correct,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closes_on_bad_predictions_and_reopens_on_good_ones() {
        let mut g = PrefetchGate::default();
        for i in 0..PREFETCH_WARMUP + 10 {
            assert_eq!(g.predict(1, &[1, 2]), i < PREFETCH_WARMUP, "step {i}");
            let s = g.score(1, &[5, 6]).unwrap_or_default();
            assert_eq!((s.predicted, s.correct), (2, 0));
        }
        assert!(!g.open());
        let mut steps = 0;
        while !g.open() {
            g.predict(2, &[3]);
            g.score(2, &[3]);
            steps += 1;
        }
        assert!(steps < 30, "reopened after {steps} good predictions");
        assert_eq!(g.score(9, &[1]), None, "no prediction for layer 9");
    }
}
