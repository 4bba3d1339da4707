//! [`KController`]: how many tokens to draft, from the measured acceptance and the measured cost
//! of a verification pass.

/// Adaptive choice of `k` (see the module docs).
#[derive(Debug, Clone)]
pub struct KController {
    max_k: usize,
    adaptive: bool,
    /// Decayed counts of accepted drafts and of rejections (geometric model).
    acc: f64,
    rej: f64,
    /// Decayed mean seconds of a step with `k` drafts.
    cost: Vec<Option<f64>>,
    plain_since_probe: usize,
    probe_every: usize,
    /// Plain steps recorded so far.
    plain_steps: usize,
}

impl KController {
    const DECAY: f64 = 0.85;
    const COST_DECAY: f64 = 0.7;
    const PROBE_MIN: usize = 32;
    /// Drafting must beat plain decoding by this factor in the model before it is chosen:
    /// step-time estimates are noisy (cache hits, drive jitter) and a wrong switch to drafting
    /// costs a whole extra verify pass.
    const MARGIN: f64 = 1.05;
    const PROBE_MAX: usize = 256;
    /// Plain steps measured before the first draft: the first steps after a prefill run with
    /// an unusual cache (the prompt's experts), so one of them is a poor baseline.
    const WARMUP: usize = 4;

    pub fn new(max_k: usize, adaptive: bool) -> KController {
        KController {
            max_k,
            adaptive,
            // Prior: acceptance 0.5 with the weight of two observations.
            acc: 1.0,
            rej: 1.0,
            cost: vec![None; max_k + 1],
            plain_since_probe: 0,
            probe_every: Self::PROBE_MIN,
            plain_steps: 0,
        }
    }

    /// Estimated per-token acceptance probability.
    pub fn acceptance(&self) -> f64 {
        self.acc / (self.acc + self.rej)
    }

    fn cost_of(&self, k: usize) -> Option<f64> {
        if let Some(c) = self.cost[k] {
            return Some(c);
        }
        let c0 = self.cost[0]?;
        // Interpolate / extrapolate linearly from the nearest measured k's.
        let below = (1..k).rev().find_map(|j| self.cost[j].map(|c| (j, c)));
        let above = (k + 1..=self.max_k).find_map(|j| self.cost[j].map(|c| (j, c)));
        Some(match (below, above) {
            (_, Some((j, c))) if below.is_none() => c0 + (c - c0) * k as f64 / j as f64,
            (Some((i, ci)), Some((j, cj))) => ci + (cj - ci) * (k - i) as f64 / (j - i) as f64,
            (Some((i, ci)), None) => c0 + (ci - c0).max(0.0) * k as f64 / i as f64,
            // Nothing measured but plain steps: assume a draft token costs 25% of a step.
            _ => c0 * (1.0 + 0.25 * k as f64),
        })
    }

    /// Drafts to ask for, at most `limit`.
    pub fn choose(&mut self, limit: usize) -> usize {
        let cap = self.max_k.min(limit);
        if !self.adaptive || cap == 0 {
            return cap;
        }
        if self.plain_steps < Self::WARMUP {
            return 0; // measure plain steps first
        }
        let a = self.acceptance();
        let rate = |k: usize| {
            self.cost_of(k).map(|c| {
                let expected: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
                expected / c.max(1e-12)
            })
        };
        let plain = rate(0).unwrap_or(0.0);
        let mut best = (0usize, plain * Self::MARGIN);
        for k in 1..=cap {
            let Some(r) = rate(k) else { continue };
            if r > best.1 * 1.000_001 {
                best = (k, r);
            }
        }
        if best.0 == 0 {
            self.plain_since_probe += 1;
            if self.plain_since_probe >= self.probe_every {
                self.plain_since_probe = 0;
                self.probe_every = (self.probe_every * 2).min(Self::PROBE_MAX);
                return cap.min(1);
            }
        }
        best.0
    }

    /// Record a step that verified `drafted` tokens (0: a plain decode step), accepted
    /// `accepted` of them and took `secs` (drafting included).
    pub fn record(&mut self, drafted: usize, accepted: usize, secs: f64) {
        let slot = drafted.min(self.max_k);
        if drafted == 0 {
            self.plain_steps += 1;
        }
        self.cost[slot] = Some(match self.cost[slot] {
            Some(c) => c * Self::COST_DECAY + secs * (1.0 - Self::COST_DECAY),
            None => secs,
        });
        if drafted > 0 {
            self.acc = self.acc * Self::DECAY + accepted as f64;
            self.rej = self.rej * Self::DECAY + if accepted < drafted { 1.0 } else { 0.0 };
            if accepted * 2 >= drafted {
                self.probe_every = Self::PROBE_MIN;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KController;

    /// Runs the controller against a simulated target: per-token acceptance `a` (deterministic
    /// pseudo-random draws) and step cost `cost(k)`; returns (tokens per unit time relative to
    /// plain decoding, fraction of steps that drafted).
    fn simulate(a: f64, cost: impl Fn(usize) -> f64, steps: usize) -> (f64, f64) {
        let mut ctl = KController::new(8, true);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let (mut tokens, mut time, mut drafting) = (0usize, 0f64, 0usize);
        for _ in 0..steps {
            let k = ctl.choose(8);
            let accepted = (0..k).take_while(|_| uniform() < a).count();
            let secs = cost(k);
            ctl.record(k, accepted, secs);
            tokens += accepted + 1;
            time += secs;
            drafting += usize::from(k > 0);
        }
        (
            tokens as f64 / time / (1.0 / cost(0)),
            drafting as f64 / steps as f64,
        )
    }

    #[test]
    fn drafting_switches_off_when_nothing_is_accepted() {
        // Streamed model, no shared experts: verifying k drafts costs k + 1 steps.
        let (speed, drafted) = simulate(0.0, |k| 1.0 + k as f64, 200);
        assert!(speed >= 0.95, "speed {speed} at 0% acceptance");
        assert!(drafted < 0.05, "drafted on {drafted} of steps");
    }

    #[test]
    fn drafting_stays_off_when_verification_costs_as_much_as_it_saves() {
        // 80% acceptance but every verified position reads its own experts.
        let (speed, _) = simulate(0.8, |k| 1.0 + k as f64, 200);
        assert!(speed >= 0.95, "speed {speed}");
    }

    #[test]
    fn drafting_pays_when_verification_is_cheap() {
        // Positions share most experts: a draft adds 15% to a step.
        let (speed, drafted) = simulate(0.8, |k| 1.0 + 0.15 * k as f64, 200);
        assert!(speed >= 1.5, "speed {speed} at 80% acceptance");
        assert!(drafted > 0.9, "drafted on only {drafted} of steps");
        let (speed, _) = simulate(1.0, |k| 1.0 + 0.15 * k as f64, 200);
        assert!(speed >= 2.5, "speed {speed} at 100% acceptance");
    }
}
