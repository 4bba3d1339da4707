//! [`GuessCost`]: whether the next-token guess ([`crate::model::boundary`]) is worth its
//! compute on this model and machine, from its measured time against a routed layer's.

use std::sync::Mutex;

/// Guesses measured before the cost gate may close, and after closing, decode steps without a
/// guess before one more is made to measure again (a guess's cost and a layer's time both
/// change with the cache and the drives).
const COST_WARMUP: u64 = 4;
const COST_PROBE_EVERY: u64 = 64;

/// What a guess costs against what it can buy. A guess computes the head, the first layers
/// and a router: time the threads would otherwise idle in, as long as it ends before the last
/// layer would have. What it buys is about one routed layer's reads started before the next
/// token's router. So guesses are made while they take no longer than a routed layer does
/// in decode (both moving averages measured here). With DeepSeek-V3's 129K vocabulary on
/// the medium synthetic model, a guess took several layers' time (the head alone ~265 MB) and
/// made decode 3.5% slower at a 40% memory cap
/// (`benches/results/next_token_guess_cost_session37.txt`); a full-size head is ~1.8 GB.
#[derive(Debug, Default)]
pub struct GuessCost {
    inner: Mutex<CostFigures>,
}

/// [`GuessCost`]'s moving averages (seconds) and counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostFigures {
    pub guess_s: f64,
    pub guesses: u64,
    pub layer_s: f64,
    pub tokens: u64,
    /// Decode steps that made no guess because it cost too much.
    pub skipped: u64,
    since_probe: u64,
}

impl GuessCost {
    fn ema(avg: &mut f64, count: u64, x: f64) {
        *avg = if count == 0 { x } else { 0.8 * *avg + 0.2 * x };
    }

    /// A guess took `d` (head, first layers, router).
    pub(crate) fn record_guess(&self, d: std::time::Duration) {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let x = d.as_secs_f64();
        if c.guesses > 0 && c.guesses < COST_WARMUP {
            // While measuring, the fastest: a first guess's page faults and allocations would
            // otherwise keep the average high for many probes.
            c.guess_s = c.guess_s.min(x);
        } else {
            let n = c.guesses;
            Self::ema(&mut c.guess_s, n, x);
        }
        c.guesses += 1;
    }

    /// A decode step over drives took `d` for `routed` routed layers.
    pub(crate) fn record_token(&self, d: std::time::Duration, routed: usize) {
        if routed == 0 {
            return;
        }
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let n = c.tokens;
        Self::ema(&mut c.layer_s, n, d.as_secs_f64() / routed as f64);
        c.tokens += 1;
    }

    /// Whether to make this step's guess: while measuring, while guesses take no longer than
    /// a routed layer, and once every [`COST_PROBE_EVERY`] skipped steps.
    pub(crate) fn worth_it(&self) -> bool {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if c.guesses < COST_WARMUP || c.tokens < COST_WARMUP || c.guess_s <= c.layer_s {
            return true;
        }
        c.since_probe += 1;
        if c.since_probe >= COST_PROBE_EVERY {
            c.since_probe = 0;
            return true;
        }
        c.skipped += 1;
        false
    }

    pub fn figures(&self) -> CostFigures {
        *self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guesses are made while measuring and while they take no longer than a routed layer;
    /// once they cost more, only every `COST_PROBE_EVERY`-th step makes one (to measure
    /// again), and a cheaper guess reopens the gate.
    #[test]
    fn the_cost_gate_closes_on_guesses_slower_than_a_layer_and_probes_again() {
        use std::time::Duration;
        let c = GuessCost::default();
        for _ in 0..COST_WARMUP {
            assert!(c.worth_it(), "while measuring");
            c.record_guess(Duration::from_millis(12));
            c.record_token(Duration::from_millis(60), 10);
        }
        // 12 ms a guess against 6 ms a layer: closed, but for one probe in COST_PROBE_EVERY.
        let made = (0..3 * COST_PROBE_EVERY).filter(|_| c.worth_it()).count();
        assert_eq!(made as u64, 3);
        assert_eq!(c.figures().skipped, 3 * COST_PROBE_EVERY - 3);
        // Guesses got cheaper (the probes measure them): open again.
        for _ in 0..20 {
            c.record_guess(Duration::from_millis(2));
        }
        assert!(c.figures().guess_s < c.figures().layer_s);
        assert!((0..10).all(|_| c.worth_it()));
        // No routed layers: nothing recorded.
        let before = c.figures();
        c.record_token(Duration::from_millis(1), 0);
        assert_eq!(c.figures(), before);
    }
}
