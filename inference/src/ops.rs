//! Small f32 building blocks: RMSNorm, softmax, activations.

use crate::config::HiddenAct;
use crate::error::{InferenceError, Result};
use crate::linear::tensor_to_f32;
use crate::weights::WeightSource;

/// `w * x / sqrt(mean(x^2) + eps)` over the last dimension (length `w.len()`).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Vec<f32>,
    pub eps: f32,
}

impl RmsNorm {
    /// Load `{name}` (shape `[dim]`).
    pub fn load(src: &dyn WeightSource, name: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        let t = src.tensor(name)?;
        if t.shape != [dim as u64] {
            return Err(InferenceError::TensorShape {
                name: name.to_string(),
                expected: vec![dim as u64],
                got: t.shape.to_vec(),
            });
        }
        Ok(RmsNorm {
            weight: tensor_to_f32(&t, name)?,
            eps: eps as f32,
        })
    }

    pub fn dim(&self) -> usize {
        self.weight.len()
    }

    /// Normalise every `dim`-long row of `x` in place.
    pub fn apply_inplace(&self, x: &mut [f32]) {
        let d = self.weight.len();
        for row in x.chunks_mut(d) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + self.eps).sqrt();
            for (v, w) in row.iter_mut().zip(&self.weight) {
                *v = w * (*v * inv);
            }
        }
    }

    /// Normalised copy of `x` (`[n, dim]`).
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut out = x.to_vec();
        self.apply_inplace(&mut out);
        out
    }
}

/// In-place softmax of `x`.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // All -inf (or NaN): leave a uniform distribution rather than NaNs.
        if max == f32::NEG_INFINITY {
            let u = 1.0 / x.len().max(1) as f32;
            x.iter_mut().for_each(|v| *v = u);
        }
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// erf with |error| < 1.2e-7 (Numerical Recipes' erfc Chebyshev fit), evaluated in f64.
pub fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - r
    } else {
        r - 1.0
    }
}

/// The activation of a gated MLP: `gated(g, u)` combines one gate and one up value (SwiGLU:
/// `act(g) * u`; SiTU clips both branches).
pub trait Activation: Send + Sync + std::fmt::Debug {
    /// The element-wise activation of the gate.
    fn apply(&self, x: f32) -> f32;

    /// One hidden value of the gated MLP from its gate `g` and up `u` projections.
    #[inline]
    fn gated(&self, g: f32, u: f32) -> f32 {
        self.apply(g) * u
    }

    /// [`Activation::gated`] of whole rows: `out[i] = gated(g[i], u[i])` (the shortest
    /// length). Implementations may compute it faster than element by element (SiLU: a
    /// vectorized exponential, within 1e-6 relative of the exact value); every caller uses
    /// this one, so a gated MLP gives the same bits however it is run.
    fn gated_into(&self, g: &[f32], u: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
            *o = self.gated(g, u);
        }
    }
}

impl Activation for HiddenAct {
    fn gated_into(&self, g: &[f32], u: &[f32], out: &mut [f32]) {
        match self {
            HiddenAct::Silu => crate::kernels::vector::silu_mul(g, u, out),
            _ => {
                for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                    *o = self.gated(g, u);
                }
            }
        }
    }

    #[inline]
    fn apply(&self, x: f32) -> f32 {
        match self {
            HiddenAct::Silu => x * sigmoid(x),
            HiddenAct::Gelu => {
                (0.5 * x as f64 * (1.0 + erf(x as f64 / std::f64::consts::SQRT_2))) as f32
            }
            HiddenAct::GeluTanh => {
                let c = (2.0f32 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }
            HiddenAct::Relu => x.max(0.0),
        }
    }
}

/// SiTU (Kimi K3): `[beta * tanh(g / beta) * sigmoid(g)] * [linear_beta * tanh(u / linear_beta)]`,
/// the sigmoid taken of the raw gate; without `linear_beta` the up branch is not clipped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

impl Activation for Situ {
    #[inline]
    fn apply(&self, g: f32) -> f32 {
        self.beta * (g / self.beta).tanh() * sigmoid(g)
    }

    #[inline]
    fn gated(&self, g: f32, u: f32) -> f32 {
        let up = match self.linear_beta {
            Some(b) => b * (u / b).tanh(),
            None => u,
        };
        self.apply(g) * up
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn softmax_and_erf() {
        let mut v = [1.0f32, 2.0, 3.0];
        softmax_inplace(&mut v);
        assert!((v.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(v[2] > v[1] && v[1] > v[0]);
        assert!((erf(0.5) - 0.520_499_877_8).abs() < 2e-7);
        assert!((erf(-1.5) + 0.966_105_146_5).abs() < 2e-7);
    }

    #[test]
    fn situ_clips_both_branches() {
        let a = Situ {
            beta: 4.0,
            linear_beta: Some(25.0),
        };
        // Small inputs: close to silu(g) * u.
        let (g, u) = (0.3f32, -0.7f32);
        assert!((a.gated(g, u) - g * sigmoid(g) * u).abs() < 1e-3);
        // Large ones saturate at beta * 1 and linear_beta.
        assert!((a.gated(100.0, 1000.0) - 4.0 * 25.0).abs() < 1e-3);
        let b = Situ {
            beta: 4.0,
            linear_beta: None,
        };
        assert!((b.gated(100.0, 1000.0) - 4000.0).abs() < 1e-1);
    }
}
