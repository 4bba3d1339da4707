//! What a loaded model's decoder layers add up to: per-sequence state sizes, the rollback
//! window, which layers stream.

use crate::model::decoder::LayerSlot;
use crate::model::forward::Model;

impl Model {
    /// Decoder layers whose weights are read from the drives for every forward.
    pub fn streamed_layers(&self) -> Vec<usize> {
        self.layers()
            .iter()
            .filter(|l| l.is_streamed())
            .map(LayerSlot::index)
            .collect()
    }

    /// Bytes of per-sequence state each position adds (KV caches), summed over the layers.
    pub fn state_bytes_per_position(&self) -> u64 {
        self.layers()
            .iter()
            .map(|l| l.state_bytes_per_position() as u64)
            .sum()
    }

    /// Bytes of per-sequence state that do not grow with the context (recurrent states),
    /// summed over the layers.
    pub fn fixed_state_bytes(&self) -> u64 {
        self.layers()
            .iter()
            .map(|l| l.fixed_state_bytes() as u64)
            .sum()
    }

    /// The longest forward a truncate can return into at any position (`None`: no limit; see
    /// [`TokenMixer::rollback_window`](crate::mixer::TokenMixer::rollback_window)).
    pub fn rollback_window(&self) -> Option<usize> {
        self.layers()
            .iter()
            .filter_map(LayerSlot::rollback_window)
            .min()
    }
}
