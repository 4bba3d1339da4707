//! [`DenseMlp`]: a gated MLP (dense layers and shared experts).

use std::sync::Arc;

use crate::error::Result;
use crate::ffn::feed_forward::{FeedForward, FfnContext};
use crate::linear::owned::Linear;
use crate::ops::Activation;

/// `down(act(gate(x), up(x)))`: a gated MLP (SwiGLU with SiLU; SiTU for Kimi K3).
#[derive(Debug, Clone)]
pub struct DenseMlp {
    /// `[inter, hidden]`
    pub gate_proj: Linear,
    /// `[inter, hidden]`
    pub up_proj: Linear,
    /// `[hidden, inter]`
    pub down_proj: Linear,
    pub act: Arc<dyn Activation>,
}

impl DenseMlp {
    pub fn apply(&self, x: &[f32], n: usize) -> Vec<f32> {
        // Gate and up in one pass over the same (once-quantized) inputs.
        let mut gu = Linear::forward_many(&[&self.gate_proj, &self.up_proj], x, n).into_iter();
        let (g, u) = (gu.next().unwrap_or_default(), gu.next().unwrap_or_default());
        let mut h = vec![0f32; g.len()];
        self.act.gated_into(&g, &u, &mut h);
        self.down_proj.forward(&h, n)
    }
}

impl FeedForward for DenseMlp {
    fn forward(&self, x: &[f32], n: usize, _ctx: &mut FfnContext<'_>) -> Result<Vec<f32>> {
        Ok(crate::spans::timed(crate::spans::Phase::Dense, || {
            self.apply(x, n)
        }))
    }
}
