//! Predicting the next layer's routed experts from the current layer's partial output.
//!
//! When experts stream from drives, a layer's last experts arrive after the compute threads
//! have finished the cached ones, and the next layer's experts are only known once its router
//! has run: after those last experts, the residual add and the next layer's token mixer. The
//! prediction made before the layer (the next router applied to the layer's input) is right
//! for about two in three of the next layer's experts on a DeepSeek-V3-shaped model. While the
//! layer waits for its last reads, the compute threads are idle: they run the next layer's
//! mixer on the stream as it would be with the experts computed so far (and the shared
//! experts), roll the mixer's state back, and route the result. Missing three of eight
//! experts, that prediction agreed with the router on 0.89 of the next layer's experts, the
//! earlier one on 0.68 (`benches/results/lookahead_session30.txt`). The exact forward then
//! runs as before; only the reads ahead change.

use crate::error::Result;
use crate::mixer::MixerState;
use crate::model::decoder::DecoderLayer;
use crate::model::residual::ResidualMixer;
use crate::spans::{quiet, span, Phase};

/// Positions a forward may have for the lookahead (decode, a speculative verification batch):
/// a prefill chunk's mixer costs more than it saves.
pub const LOOKAHEAD_MAX_POSITIONS: usize = 16;

/// Whether layers predict the next one's experts from their partial output (on unless
/// `DELTAFIN_LOOKAHEAD=0`, for measuring it).
pub fn lookahead_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DELTAFIN_LOOKAHEAD").map_or(true, |v| v != "0"))
}

/// Layer `layer + 1` (`next`)'s experts predicted from layer `layer`'s partial feed-forward
/// output `partial` `[n, hidden]`: the streams before that output (`streams`) take it, `next`'s
/// mixer runs on them with its per-sequence `state`, which is then rolled back to where it
/// was, and `next`'s router routes the result. `None`: `next` routes nothing, or its state
/// could not roll back from `n` positions (so it is not touched).
pub fn predict_from_partial(
    residual: &dyn ResidualMixer,
    layer: usize,
    next: &DecoderLayer,
    streams: &[Vec<f32>],
    partial: &[f32],
    n: usize,
    state: &mut dyn MixerState,
) -> Result<Option<(usize, Vec<usize>)>> {
    if next.mixer.rollback_window().is_some_and(|w| n > w) {
        return Ok(None);
    }
    let _span = span(Phase::Lookahead);
    let mut streams = streams.to_vec();
    residual.block_output(layer, 1, &mut streams, partial);
    let x = next
        .input_layernorm
        .apply(&residual.block_input(layer + 1, 0, &streams));
    let len = state.len();
    let mixed = quiet(|| next.mixer.forward(&x, n, state));
    // Back to `len` whatever the forward did (an error may leave positions behind).
    if state.len() != len {
        state.truncate(len)?;
    }
    residual.block_output(layer + 1, 0, &mut streams, &mixed?);
    let xn = next
        .post_attention_layernorm
        .apply(&residual.block_input(layer + 1, 1, &streams));
    Ok(next.ffn.predict_experts(&xn, n).map(|e| (next.index, e)))
}
