//! [`PrefetchGate`]: scores next-layer predictions against what the layer then asks for, and
//! lets through only the ranks of a prediction that are right often enough.
//!
//! A wrong prefetch that has started costs drive bandwidth, the bottleneck when decoding is
//! I/O-bound: on the synthetic medium model (precision ~0.6 over all eight predicted experts, 4
//! throttled drives) prefetching every prediction read 31% more bytes per token and decoded 34%
//! slower than not prefetching (`benches/results/gen_extras_ungated_prefetch.json`). But a
//! prediction is ordered likeliest first and its first ranks are right far more often than its
//! last, while reads of them fill the time the drive would otherwise sit idle between one
//! layer's last read and the next layer's first demand. So precision is measured per rank and
//! each rank is gated on its own. Predictions keep being scored while a rank is closed, so it
//! reopens if it becomes accurate.
//!
//! A layer may be predicted twice: early, from the layer before's input ([`Predictor::Early`]),
//! and again from that layer's partial output ([`Predictor::Lookahead`]), which is right far
//! more often. Each predictor is scored and gated on its own: the early one's reads start
//! before the lookahead can drop them, so its ranks must earn their reads by its own record.
//! The next token's first routed layer may be predicted before that token is known
//! ([`Predictor::NextToken`]), from a guess of the token; where the guess holds, the forward
//! makes no early prediction of that layer.

use std::collections::HashMap;

/// A rank's prefetch reads are only issued while its measured precision stays at or above this.
pub const PREFETCH_MIN_PRECISION: f64 = 0.75;
/// Predictions scored at a rank before its gate may close.
pub const PREFETCH_WARMUP: u64 = 8;
/// Ranks measured apart; later ones (a prefill chunk's union of many positions' experts) share
/// the last.
const RANKS: usize = 64;

/// Which prediction of a layer's experts: they are scored and gated apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Predictor {
    /// Made before the layer before's experts are computed.
    Early = 0,
    /// Made from the layer before's partial output, replacing the early one.
    Lookahead = 1,
    /// Made for the next token's first routed layer while the last layer waits for its
    /// experts, from a guess of that token.
    NextToken = 2,
}

const PREDICTORS: usize = 3;

/// How one layer's prediction compared with its request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Score {
    pub predicted: u64,
    pub requested: u64,
    pub correct: u64,
}

/// Moving average of how often one rank's prediction was then requested.
#[derive(Clone, Copy, Debug)]
struct RankPrecision {
    ema: f64,
    scored: u64,
}

impl RankPrecision {
    fn open(&self) -> bool {
        self.scored < PREFETCH_WARMUP || self.ema >= PREFETCH_MIN_PRECISION
    }
}

/// The prediction scorer and gate (no I/O).
#[derive(Debug, Clone)]
pub struct PrefetchGate {
    /// Experts predicted per layer and predictor, until that layer is requested.
    predicted: HashMap<u32, [Option<Vec<u32>>; PREDICTORS]>,
    /// Moving average of the fraction of a layer's last prediction's experts that were then
    /// requested (all ranks: the figure reported).
    precision_ema: f64,
    /// Per predictor, per rank of a prediction (likeliest first).
    ranks: [Vec<RankPrecision>; PREDICTORS],
}

impl Default for PrefetchGate {
    fn default() -> Self {
        let fresh = vec![
            RankPrecision {
                ema: 1.0,
                scored: 0
            };
            RANKS
        ];
        PrefetchGate {
            predicted: HashMap::new(),
            precision_ema: 1.0,
            ranks: [fresh.clone(), fresh.clone(), fresh],
        }
    }
}

impl PrefetchGate {
    /// Record `by`'s prediction for `layer` (likeliest first); returns the experts worth
    /// reading: those at ranks where `by` is still accurate enough, in the prediction's order.
    /// An early or next-token prediction starts a layer's round afresh: a lookahead left from
    /// a forward that never requested the layer (it failed) is dropped rather than scored
    /// later, and so is a next-token prediction whose guessed token was wrong (the early one
    /// made then replaces it).
    pub fn predict(&mut self, layer: u32, by: Predictor, experts: &[u32]) -> Vec<u32> {
        let preds = self.predicted.entry(layer).or_default();
        if by != Predictor::Lookahead {
            *preds = Default::default();
        }
        preds[by as usize] = Some(experts.to_vec());
        experts
            .iter()
            .enumerate()
            .filter(|&(rank, _)| self.rank(by, rank).open())
            .map(|(_, &e)| e)
            .collect()
    }

    fn rank(&self, by: Predictor, rank: usize) -> &RankPrecision {
        &self.ranks[by as usize][rank.min(RANKS - 1)]
    }

    /// Whether `by`'s likeliest prediction is accurate enough to act on.
    pub fn open(&self, by: Predictor) -> bool {
        self.rank(by, 0).open()
    }

    pub fn precision(&self) -> f64 {
        self.precision_ema
    }

    /// The measured precision of each of `by`'s ranks, likeliest first, up to the last one
    /// scored.
    pub fn rank_precisions(&self, by: Predictor) -> Vec<f64> {
        let ranks = &self.ranks[by as usize];
        let n = ranks
            .iter()
            .rposition(|r| r.scored > 0)
            .map_or(0, |i| i + 1);
        ranks[..n].iter().map(|r| r.ema).collect()
    }

    /// `layer` asks for `experts`: score each of its predictions, and return how the last one
    /// made did, if there was one.
    pub fn score(&mut self, layer: u32, experts: &[u32]) -> Option<Score> {
        let preds = self.predicted.remove(&layer)?;
        let mut last = None;
        for (by, pred) in preds.iter().enumerate() {
            let Some(pred) = pred else { continue };
            let mut correct = 0u64;
            for (rank, e) in pred.iter().enumerate() {
                let hit = experts.contains(e);
                correct += u64::from(hit);
                let r = &mut self.ranks[by][rank.min(RANKS - 1)];
                r.ema = 0.9 * r.ema + if hit { 0.1 } else { 0.0 };
                r.scored += 1;
            }
            last = Some((pred.len() as u64, correct));
        }
        let (predicted, correct) = last?;
        if predicted > 0 {
            let p = correct as f64 / predicted as f64;
            self.precision_ema = 0.9 * self.precision_ema + 0.1 * p;
        }
        Some(Score {
            predicted,
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
            let open = !g.predict(1, Predictor::Early, &[1, 2]).is_empty();
            assert_eq!(open, i < PREFETCH_WARMUP, "step {i}");
            let s = g.score(1, &[5, 6]).unwrap_or_default();
            assert_eq!((s.predicted, s.correct), (2, 0));
        }
        assert!(!g.open(Predictor::Early));
        assert!(
            g.open(Predictor::Lookahead),
            "the other predictor is scored apart"
        );
        let mut steps = 0;
        while !g.open(Predictor::Early) {
            g.predict(2, Predictor::Early, &[3]);
            g.score(2, &[3]);
            steps += 1;
        }
        assert!(steps < 30, "reopened after {steps} good predictions");
        assert_eq!(g.score(9, &[1]), None, "no prediction for layer 9");
    }

    #[test]
    fn an_early_prediction_replaces_a_next_token_one_unscored() {
        let mut g = PrefetchGate::default();
        // The guessed token was wrong: the early prediction made then replaces the guess's,
        // which is not scored (the forward scores guesses by their token).
        for _ in 0..PREFETCH_WARMUP + 10 {
            g.predict(1, Predictor::NextToken, &[7, 8]);
            g.predict(1, Predictor::Early, &[1, 2]);
            let s = g.score(1, &[1, 2]).unwrap_or_default();
            assert_eq!((s.predicted, s.correct), (2, 2));
        }
        assert!(g.rank_precisions(Predictor::NextToken).is_empty());
        // The guess held: no early prediction; the next-token one is scored on its own.
        for _ in 0..PREFETCH_WARMUP + 10 {
            g.predict(1, Predictor::NextToken, &[7, 8]);
            g.score(1, &[5, 6]);
        }
        assert!(!g.open(Predictor::NextToken));
        assert!(g.open(Predictor::Early) && g.open(Predictor::Lookahead));
    }

    #[test]
    fn a_precise_first_rank_stays_open_while_a_wrong_last_rank_closes() {
        let mut g = PrefetchGate::default();
        for _ in 0..PREFETCH_WARMUP + 20 {
            g.predict(4, Predictor::Early, &[10, 11, 12]);
            // The first two ranks are always right, the third never.
            g.score(4, &[10, 11, 20]);
        }
        assert_eq!(g.predict(4, Predictor::Early, &[30, 31, 32]), vec![30, 31]);
        let p = g.rank_precisions(Predictor::Early);
        assert_eq!(p.len(), 3);
        assert!(
            p[0] > 0.99 && p[1] > 0.99 && p[2] < PREFETCH_MIN_PRECISION,
            "{p:?}"
        );
        assert!(
            (g.precision() - 2.0 / 3.0).abs() < 0.05,
            "{}",
            g.precision()
        );
    }

    #[test]
    fn the_early_and_the_lookahead_prediction_are_gated_apart() {
        let mut g = PrefetchGate::default();
        for _ in 0..PREFETCH_WARMUP + 20 {
            // The early guess is wrong at its second rank, the lookahead right at both.
            g.predict(3, Predictor::Early, &[1, 9]);
            g.predict(3, Predictor::Lookahead, &[1, 2]);
            let s = g.score(3, &[1, 2]).unwrap_or_default();
            assert_eq!(
                (s.predicted, s.correct),
                (2, 2),
                "the score is the last prediction's"
            );
        }
        assert_eq!(g.predict(5, Predictor::Early, &[7, 8]), vec![7]);
        assert_eq!(g.predict(5, Predictor::Lookahead, &[7, 8]), vec![7, 8]);
        let early = g.rank_precisions(Predictor::Early);
        assert!(early[0] > 0.99 && early[1] < 0.1, "{early:?}");
        assert!(g.precision() > 0.99, "{}", g.precision());
        // A layer only predicted early is scored by that prediction, even with a lookahead
        // left from an earlier round that was never scored.
        g.predict(6, Predictor::Lookahead, &[9, 10]);
        g.predict(6, Predictor::Early, &[4, 5]);
        let s = g.score(6, &[4]).unwrap_or_default();
        assert_eq!((s.predicted, s.correct), (2, 1));
    }
}
