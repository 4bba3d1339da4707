//! One decoder layer and the parts a model is assembled from.

use crate::config::ModelConfig;
use crate::ffn::feed_forward::FeedForward;
use crate::linear::owned::Linear;
use crate::mixer::TokenMixer;
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

/// The parts a model is assembled from (see `arch` builders).
#[derive(Debug)]
pub struct ModelParts {
    pub config: ModelConfig,
    pub embed_tokens: Linear,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    pub lm_head: Option<Linear>,
    pub residual: Box<dyn ResidualMixer>,
}
