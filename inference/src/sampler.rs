//! Token sampling: greedy, temperature, top-k, top-p, with a small seeded PCG32 generator.

use crate::error::{InferenceError, Result};

/// PCG32 (XSH-RR, 64-bit state), seeded through SplitMix64. Deterministic across platforms.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
    inc: u64,
}

impl Rng {
    const MUL: u64 = 6364136223846793005;

    pub fn new(seed: u64) -> Rng {
        let mut sm = seed;
        let mut splitmix = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let init_state = splitmix();
        let inc = splitmix() | 1;
        let mut rng = Rng { state: 0, inc };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(init_state);
        rng.next_u32();
        rng
    }

    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(Self::MUL).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    pub fn next_u64(&mut self) -> u64 {
        ((self.next_u32() as u64) << 32) | self.next_u32() as u64
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Sampling settings. `temperature == 0` means greedy (argmax); `top_k == 0` and
/// `top_p >= 1` disable those filters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig::greedy()
    }
}

impl SamplerConfig {
    pub fn greedy() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(InferenceError::InvalidArgument(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(InferenceError::InvalidArgument(format!(
                "top_p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Index of the largest finite-or-infinite value (first on ties; NaNs ignored).
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some(b) if logits[b] >= v => {}
            _ => best = Some(i),
        }
    }
    best
}

/// A sampler with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Sampler> {
        config.validate()?;
        let rng = Rng::new(config.seed);
        Ok(Sampler { config, rng })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// The distribution sampling draws from: `(token, probability)` after temperature, top-k
    /// and top-p, renormalised, most probable first. Greedy gives the argmax with probability 1.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f32)>> {
        if logits.is_empty() {
            return Err(InferenceError::InvalidArgument("empty logits".into()));
        }
        if self.config.is_greedy() {
            let i = argmax(logits)
                .ok_or_else(|| InferenceError::InvalidArgument("all logits are NaN".into()))?;
            return Ok(vec![(i as u32, 1.0)]);
        }
        let t = self.config.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v / t))
            .collect();
        if cand.is_empty() {
            return Err(InferenceError::InvalidArgument("all logits are NaN".into()));
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.config.top_k > 0 {
            cand.truncate(self.config.top_k);
        }
        // softmax over the survivors
        let max = cand[0].1;
        let mut sum = 0f64;
        for c in cand.iter_mut() {
            let e = ((c.1 - max) as f64).exp();
            c.1 = e as f32;
            sum += e;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        if self.config.top_p < 1.0 {
            // Smallest prefix whose mass reaches top_p (at least one token).
            let mut cum = 0f64;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                cum += c.1 as f64;
                if cum >= self.config.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
            let s: f64 = cand.iter().map(|c| c.1 as f64).sum();
            for c in cand.iter_mut() {
                c.1 = (c.1 as f64 / s) as f32;
            }
        }
        Ok(cand)
    }

    /// Draw one token.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let dist = self.distribution(logits)?;
        if dist.len() == 1 {
            return Ok(dist[0].0);
        }
        let u = self.rng.next_f64();
        let mut cum = 0f64;
        for &(id, p) in &dist {
            cum += p as f64;
            if u < cum {
                return Ok(id);
            }
        }
        Ok(dist[dist.len() - 1].0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_uniformish() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        let xs: Vec<u32> = (0..100).map(|_| a.next_u32()).collect();
        let ys: Vec<u32> = (0..100).map(|_| b.next_u32()).collect();
        assert_eq!(xs, ys);
        assert_ne!(Rng::new(43).next_u32(), Rng::new(42).next_u32());
        let mut r = Rng::new(7);
        let mean: f64 = (0..10000).map(|_| r.next_f64()).sum::<f64>() / 10000.0;
        assert!((mean - 0.5).abs() < 0.02);
    }
}
