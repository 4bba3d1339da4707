//! Rotary position embeddings: inverse frequencies (default, linear, YaRN, llama3), the cos/sin
//! attention factor, and the two layouts (DeepSeek's interleaved pairs, Qwen's `rotate_half`).
//!
//! Frequencies are computed in f32 the way transformers computes them, so angles match.

use crate::config::RopeParameters;
use crate::error::{ConfigError, Result};

/// Which elements of a head rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i+1)` share frequency `i` (DeepSeek-V3 `rope_interleave`).
    Interleaved,
    /// Pairs `(i, i + d/2)` share frequency `i` (`rotate_half`).
    Half,
}

/// `0.1 * mscale * ln(scale) + 1` for `scale > 1`, else 1 (transformers' `get_mscale`).
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

#[derive(Debug, Clone)]
pub struct Rope {
    dim: usize,
    inv_freq: Vec<f32>,
    attention_factor: f32,
    layout: RopeLayout,
}

impl Rope {
    /// Frequencies for a rotary dimension `dim` (even).
    pub fn new(
        p: &RopeParameters,
        dim: usize,
        max_position_embeddings: usize,
        layout: RopeLayout,
    ) -> Result<Rope> {
        if dim == 0 || !dim.is_multiple_of(2) {
            return Err(ConfigError::invalid(
                "rope dim",
                format!("rotary dimension {dim} must be even and > 0"),
            )
            .into());
        }
        let base = p.rope_theta as f32;
        let half = dim / 2;
        // base ** (arange(0, dim, 2) / dim), in f32.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let default: Vec<f32> = pos_freqs.iter().map(|&f| 1.0 / f).collect();
        let (inv_freq, attention_factor) = match p.rope_type.as_str() {
            "default" => (default, 1.0f64),
            "linear" => {
                let factor = p.factor.unwrap_or(1.0) as f32;
                (default.iter().map(|f| f / factor).collect(), 1.0)
            }
            "yarn" => {
                let orig = p
                    .original_max_position_embeddings
                    .unwrap_or(max_position_embeddings as f64);
                let factor = match p.factor {
                    Some(f) => f,
                    None => max_position_embeddings as f64 / orig,
                };
                let attention_factor = match p.attention_factor {
                    Some(a) => a,
                    None => match (p.mscale, p.mscale_all_dim) {
                        (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                            yarn_get_mscale(factor, m) / yarn_get_mscale(factor, ma)
                        }
                        _ => yarn_get_mscale(factor, 1.0),
                    },
                };
                let beta_fast = p.beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0);
                let beta_slow = p.beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0);
                let correction_dim = |rot: f64| {
                    dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * (p.rope_theta).ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if p.truncate.unwrap_or(true) {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0) as f32;
                let mut high = high.min((dim - 1) as f64) as f32;
                if low == high {
                    high += 0.001;
                }
                let factor32 = factor as f32;
                let inv: Vec<f32> = (0..half)
                    .map(|i| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrap_factor = 1.0 - ramp;
                        let interp = 1.0 / (factor32 * pos_freqs[i]);
                        let extrap = 1.0 / pos_freqs[i];
                        interp * (1.0 - extrap_factor) + extrap * extrap_factor
                    })
                    .collect();
                (inv, attention_factor)
            }
            "llama3" => {
                let factor = p.factor.unwrap_or(1.0);
                let low_ff = p.low_freq_factor.unwrap_or(1.0);
                let high_ff = p.high_freq_factor.unwrap_or(4.0);
                let old = p.original_max_position_embeddings.unwrap_or(8192.0);
                let low_wl = old / low_ff;
                let high_wl = old / high_ff;
                let inv = default
                    .iter()
                    .map(|&f| {
                        let f = f as f64;
                        let wl = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wl > low_wl { f / factor } else { f };
                        if wl < high_wl || wl > low_wl {
                            scaled as f32
                        } else {
                            let s = (old / wl - low_ff) / (high_ff - low_ff);
                            ((1.0 - s) * scaled / factor + s * scaled) as f32
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            other => {
                return Err(
                    ConfigError::unsupported("rope_type", format!("rope type `{other}`")).into(),
                )
            }
        };
        Ok(Rope {
            dim,
            inv_freq,
            attention_factor: attention_factor as f32,
            layout,
        })
    }

    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }
    /// Multiplier applied to cos and sin.
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// cos and sin (times the attention factor) of each frequency at `pos`; each `[dim/2]`.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = f * p;
            *c = a.cos() * self.attention_factor;
            *s = a.sin() * self.attention_factor;
        }
    }

    /// Rotate one head `x` (`[dim]`) with precomputed cos/sin.
    #[inline]
    pub fn rotate(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.dim / 2;
        match self.layout {
            RopeLayout::Interleaved => {
                for i in 0..half {
                    let (a, b) = (x[2 * i], x[2 * i + 1]);
                    x[2 * i] = a * cos[i] - b * sin[i];
                    x[2 * i + 1] = b * cos[i] + a * sin[i];
                }
            }
            RopeLayout::Half => {
                for i in 0..half {
                    let (a, b) = (x[i], x[i + half]);
                    x[i] = a * cos[i] - b * sin[i];
                    x[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
    }

    /// Rotate one head at position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.dim / 2;
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        self.cos_sin(pos, &mut cos, &mut sin);
        self.rotate(x, &cos, &sin);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn params(ty: &str) -> RopeParameters {
        let mut p = RopeParameters::default_with_theta(10000.0);
        p.rope_type = ty.into();
        p
    }

    #[test]
    fn default_frequencies() {
        let r = Rope::new(&params("default"), 8, 256, RopeLayout::Half).unwrap();
        let want = [1.0f64, 0.1, 0.01, 0.001];
        for (g, w) in r.inv_freq().iter().zip(want) {
            assert!(((*g as f64) - w).abs() < 1e-6 * w.max(1e-3), "{g} vs {w}");
        }
        assert_eq!(r.attention_factor(), 1.0);
    }

    /// YaRN against the formula written out independently in f64.
    #[test]
    fn yarn_frequencies_and_factor() {
        let mut p = params("yarn");
        p.factor = Some(40.0);
        p.original_max_position_embeddings = Some(4096.0);
        p.mscale = Some(1.0);
        p.mscale_all_dim = Some(0.707);
        p.beta_fast = Some(32.0);
        p.beta_slow = Some(1.0);
        let d = 64usize;
        let r = Rope::new(&p, d, 163840, RopeLayout::Interleaved).unwrap();
        let base = 10000f64;
        let cd = |rot: f64| {
            d as f64 * (4096.0 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let low = cd(32.0).floor().max(0.0);
        let high = cd(1.0).ceil().min(d as f64 - 1.0);
        for i in 0..d / 2 {
            let inv = base.powf(-(2.0 * i as f64) / d as f64);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want = inv / 40.0 * ramp + inv * (1.0 - ramp);
            let got = r.inv_freq()[i] as f64;
            assert!((got - want).abs() <= 1e-5 * want, "i={i}: {got} vs {want}");
        }
        let m = |s: f64, m: f64| 0.1 * m * s.ln() + 1.0;
        let af = m(40.0, 1.0) / m(40.0, 0.707);
        assert!((r.attention_factor() as f64 - af).abs() < 1e-6);
        // Below the ramp the frequencies are untouched; above it they are divided by the factor.
        assert!((r.inv_freq()[0] - 1.0).abs() < 1e-6);
        let last = base.powf(-(d as f64 - 2.0) / d as f64) / 40.0;
        assert!((r.inv_freq()[d / 2 - 1] as f64 - last).abs() < 1e-5 * last);
    }

    #[test]
    fn layouts_rotate_pairs() {
        let r = Rope::new(&params("default"), 4, 16, RopeLayout::Interleaved).unwrap();
        let mut x = [1.0f32, 0.0, 1.0, 0.0];
        r.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        let r = Rope::new(&params("default"), 4, 16, RopeLayout::Half).unwrap();
        let mut x = [1.0f32, 1.0, 0.0, 0.0];
        r.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        // Norm is preserved.
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 2.0).abs() < 1e-5);
    }
}
