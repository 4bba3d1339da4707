//! How sub-block outputs join the residual stream(s): [`ResidualMixer`], and the plain
//! residual add [`AddResidual`].

use std::borrow::Cow;

/// How sub-block outputs join the residual stream(s). The default, [`AddResidual`], is the
/// usual `h = h + f(norm(h))`; models that mix several residual streams across blocks plug in
/// their own.
pub trait ResidualMixer: Send + Sync + std::fmt::Debug {
    /// Streams carried from the embeddings (`[n, hidden]` each).
    fn init(&self, embeddings: Vec<f32>) -> Vec<Vec<f32>>;
    /// Input of sub-block `sub` (0 = token mixer, 1 = feed-forward) of `layer`, before its norm.
    fn block_input<'s>(&self, layer: usize, sub: usize, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]>;
    /// Fold the sub-block's output into the streams.
    fn block_output(&self, layer: usize, sub: usize, streams: &mut Vec<Vec<f32>>, out: &[f32]);
    /// The hidden state after the last layer (before the final norm).
    fn output<'s>(&self, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]>;
    /// What a layer hands to the next, for traces: the residual stream, or the running block
    /// sum of Attention Residuals (the last stream either way).
    fn layer_state<'s>(&self, streams: &'s [Vec<f32>]) -> &'s [f32] {
        streams.last().map_or(&[], |s| s.as_slice())
    }
}

/// One residual stream, `h = h + f(norm(h))`.
#[derive(Debug, Clone, Copy, Default)]
pub struct AddResidual;

impl ResidualMixer for AddResidual {
    fn init(&self, embeddings: Vec<f32>) -> Vec<Vec<f32>> {
        vec![embeddings]
    }
    fn block_input<'s>(&self, _: usize, _: usize, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]> {
        Cow::Borrowed(&streams[0])
    }
    fn block_output(&self, _: usize, _: usize, streams: &mut Vec<Vec<f32>>, out: &[f32]) {
        for (h, o) in streams[0].iter_mut().zip(out) {
            *h += o;
        }
    }
    fn output<'s>(&self, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]> {
        Cow::Borrowed(&streams[0])
    }
}
