//! Pieces every architecture builder uses: gated MLPs, embeddings and head, the pre-norm decoder
//! block, and the model around the blocks.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::ffn::dense::DenseMlp;
use crate::ffn::feed_forward::FeedForward;
use crate::linear::owned::Linear;
use crate::loader::Loader;
use crate::mixer::TokenMixer;
use crate::model::{AddResidual, DecoderLayer, ModelParts};
use crate::ops::Activation;

pub(crate) fn dense_mlp(
    ld: &Loader<'_>,
    prefix: &str,
    hidden: usize,
    inter: usize,
    act: &Arc<dyn Activation>,
) -> Result<DenseMlp> {
    Ok(DenseMlp {
        gate_proj: ld.linear(&format!("{prefix}.gate_proj"), inter, hidden, false)?,
        up_proj: ld.linear(&format!("{prefix}.up_proj"), inter, hidden, false)?,
        down_proj: ld.linear(&format!("{prefix}.down_proj"), hidden, inter, false)?,
        act: act.clone(),
    })
}

pub(crate) fn embeddings_and_head(
    ld: &Loader<'_>,
    vocab: usize,
    hidden: usize,
    tie: bool,
) -> Result<(Linear, Option<Linear>)> {
    let embed = ld.linear("model.embed_tokens", vocab, hidden, false)?;
    let head = if tie {
        None
    } else {
        Some(ld.linear("lm_head", vocab, hidden, false)?)
    };
    Ok((embed, head))
}

/// One pre-norm decoder block: `input_layernorm`, the mixer, `post_attention_layernorm`, the FFN.
pub(crate) fn decoder_layer(
    ld: &Loader<'_>,
    prefix: &str,
    index: usize,
    hidden: usize,
    eps: f64,
    mixer: Box<dyn TokenMixer>,
    ffn: Box<dyn FeedForward>,
) -> Result<DecoderLayer> {
    Ok(DecoderLayer {
        index,
        input_layernorm: ld.norm(&format!("{prefix}.input_layernorm.weight"), hidden, eps)?,
        mixer,
        post_attention_layernorm: ld.norm(
            &format!("{prefix}.post_attention_layernorm.weight"),
            hidden,
            eps,
        )?,
        ffn,
    })
}

/// The parts around the decoder blocks: embeddings, final norm, lm_head, plain residual adds.
pub(crate) fn model_parts(
    ld: &Loader<'_>,
    config: ModelConfig,
    layers: Vec<DecoderLayer>,
    vocab: usize,
    hidden: usize,
    tie: bool,
    eps: f64,
) -> Result<ModelParts> {
    let (embed_tokens, lm_head) = embeddings_and_head(ld, vocab, hidden, tie)?;
    Ok(ModelParts {
        config,
        embed_tokens,
        layers,
        norm: ld.norm("model.norm.weight", hidden, eps)?,
        lm_head,
        residual: Box::new(AddResidual),
    })
}
