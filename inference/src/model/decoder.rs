//! One decoder layer, how a model holds it (built, or streamed and rebuilt per use), and the
//! parts a model is assembled from.

use std::sync::Mutex;

use crate::config::ModelConfig;
use crate::ffn::feed_forward::FeedForward;
use crate::linear::owned::Linear;
use crate::mixer::{MixerState, TokenMixer};
use crate::model::residual::ResidualMixer;
use crate::ops::RmsNorm;

/// One decoder layer: `mixer(input_layernorm(h))`, then `ffn(post_attention_layernorm(h))`.
#[derive(Debug)]
pub struct DecoderLayer {
    pub index: usize,
    pub input_layernorm: RmsNorm,
    pub mixer: Box<dyn TokenMixer>,
    pub post_attention_layernorm: RmsNorm,
    pub ffn: Box<dyn FeedForward>,
}

/// A decoder layer as a model holds it.
#[derive(Debug)]
pub enum LayerSlot {
    /// Built once from resident weights.
    Resident(DecoderLayer),
    /// Streamed: its weights are read from the drives for every forward and the layer rebuilt
    /// over them; the model keeps only what its per-sequence state looks like.
    Streamed(LayerShape),
}

/// What a model keeps of a streamed layer: its index and the shape of its mixer's state,
/// taken from the layer when it was first built (at load).
#[derive(Debug)]
pub struct LayerShape {
    pub index: usize,
    /// An empty state of the layer's mixer (new states are made like it).
    empty_state: Mutex<Box<dyn MixerState>>,
    rollback_window: Option<usize>,
    state_widths: Option<Vec<usize>>,
    fixed_state_sizes: Vec<usize>,
    state_bytes_per_position: usize,
    fixed_state_bytes: usize,
}

impl LayerShape {
    pub fn of(layer: &DecoderLayer) -> LayerShape {
        let m = &layer.mixer;
        LayerShape {
            index: layer.index,
            empty_state: Mutex::new(m.new_state()),
            rollback_window: m.rollback_window(),
            state_widths: m.state_widths(),
            fixed_state_sizes: m.fixed_state_sizes(),
            state_bytes_per_position: m.state_bytes_per_position(),
            fixed_state_bytes: m.fixed_state_bytes(),
        }
    }
}

impl LayerSlot {
    pub fn index(&self) -> usize {
        match self {
            LayerSlot::Resident(l) => l.index,
            LayerSlot::Streamed(s) => s.index,
        }
    }

    /// The built layer (`None` when streamed).
    pub fn resident(&self) -> Option<&DecoderLayer> {
        match self {
            LayerSlot::Resident(l) => Some(l),
            LayerSlot::Streamed(_) => None,
        }
    }

    pub fn is_streamed(&self) -> bool {
        matches!(self, LayerSlot::Streamed(_))
    }

    /// A fresh, empty per-sequence state for the layer's mixer.
    pub fn new_state(&self) -> Box<dyn MixerState> {
        match self {
            LayerSlot::Resident(l) => l.mixer.new_state(),
            LayerSlot::Streamed(s) => s
                .empty_state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .empty(),
        }
    }

    pub fn rollback_window(&self) -> Option<usize> {
        match self {
            LayerSlot::Resident(l) => l.mixer.rollback_window(),
            LayerSlot::Streamed(s) => s.rollback_window,
        }
    }

    /// Snapshot hook: see [`TokenMixer::state_widths`].
    pub fn state_widths(&self) -> Option<Vec<usize>> {
        match self {
            LayerSlot::Resident(l) => l.mixer.state_widths(),
            LayerSlot::Streamed(s) => s.state_widths.clone(),
        }
    }

    /// Snapshot hook: see [`TokenMixer::fixed_state_sizes`].
    pub fn fixed_state_sizes(&self) -> Vec<usize> {
        match self {
            LayerSlot::Resident(l) => l.mixer.fixed_state_sizes(),
            LayerSlot::Streamed(s) => s.fixed_state_sizes.clone(),
        }
    }

    pub fn state_bytes_per_position(&self) -> usize {
        match self {
            LayerSlot::Resident(l) => l.mixer.state_bytes_per_position(),
            LayerSlot::Streamed(s) => s.state_bytes_per_position,
        }
    }

    pub fn fixed_state_bytes(&self) -> usize {
        match self {
            LayerSlot::Resident(l) => l.mixer.fixed_state_bytes(),
            LayerSlot::Streamed(s) => s.fixed_state_bytes,
        }
    }
}

/// The parts a model is assembled from (see `arch` builders).
#[derive(Debug)]
pub struct ModelParts {
    pub config: ModelConfig,
    pub embed_tokens: Linear,
    pub layers: Vec<LayerSlot>,
    pub norm: RmsNorm,
    pub lm_head: Option<Linear>,
    pub residual: Box<dyn ResidualMixer>,
}
