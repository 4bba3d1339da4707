//! The [`FeedForward`] trait: the channel-mixing module of a decoder layer, and its per-call
//! context.

use crate::error::Result;
use crate::ffn::router::Routing;
use crate::linear::Linear;
use crate::weights::WeightSource;

/// Per-call context of a feed-forward module.
pub struct FfnContext<'a> {
    pub source: &'a dyn WeightSource,
    /// Decoder layer index (names the experts to fetch).
    pub layer: usize,
    /// When set, MoE layers push each position's routing here.
    pub routing: Option<&'a mut Vec<Routing>>,
    /// Work for the time spent waiting for experts' bytes (see
    /// [`WeightSource::with_expert_groups_idle`]); `&mut || false`: none.
    pub idle: &'a mut dyn FnMut() -> bool,
    /// A later layer's experts predicted from this layer's output so far (see
    /// [`SpeculateFn`]); `None`: no such prediction.
    pub speculate: Option<&'a mut SpeculateFn<'a>>,
}

/// Given a feed-forward layer's partial output `[n, hidden]` (the routed experts computed so
/// far plus the shared experts), the decoder layer whose experts to read ahead and those
/// experts, likeliest first (`None`: no prediction). Called while the layer waits for its
/// last experts' bytes; an error means the forward cannot go on (a state it touched could
/// not be restored).
pub type SpeculateFn<'a> = dyn FnMut(&[f32]) -> Result<Option<(usize, Vec<usize>)>> + 'a;

impl std::fmt::Debug for FfnContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FfnContext")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

/// The channel-mixing module of a decoder layer.
pub trait FeedForward: Send + Sync + std::fmt::Debug {
    /// `x [n, hidden] -> [n, hidden]`.
    fn forward(&self, x: &[f32], n: usize, ctx: &mut FfnContext<'_>) -> Result<Vec<f32>>;

    /// The routed experts this module would request for input `x [n, hidden]` (already
    /// normed), deduplicated, likeliest first; `None` when it routes nothing. Used to prefetch a
    /// layer's experts from an earlier hidden state.
    fn predict_experts(&self, _x: &[f32], _n: usize) -> Option<Vec<usize>> {
        None
    }

    /// The router's scoring matrix, if it routes (for warming the caches: [`crate::warm`]).
    fn router_gate(&self) -> Option<&Linear> {
        None
    }
}
