//! Pieces every architecture builder uses: gated MLPs, embeddings and head, the pre-norm decoder
//! block, and the model around the blocks.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{ConfigError, InferenceError, Result};
use crate::ffn::dense::DenseMlp;
use crate::ffn::feed_forward::FeedForward;
use crate::linear::owned::Linear;
use crate::loader::Loader;
use crate::mixer::{MlaAttention, QProj, TokenMixer};
use crate::model::{AddResidual, DecoderLayer, LayerSlot, ModelParts};
use crate::ops::Activation;
use crate::rope::Rope;

/// A layer the config makes dense must not have a router in the checkpoint
/// (`{moe_prefix}.gate.weight`): if it has, the config's MoE keys (`keys`) are wrong (e.g.
/// `n_routed_experts: 0`), and saying so beats reporting a missing dense tensor.
pub(crate) fn check_dense(
    ld: &Loader<'_>,
    layer: usize,
    moe_prefix: &str,
    keys: &str,
) -> Result<()> {
    let router = format!("{}{moe_prefix}.gate.weight", ld.prefix);
    if ld.src.has_tensor(&router) {
        return Err(InferenceError::Config(ConfigError::invalid(
            keys,
            format!(
                "decoder layer {layer} is dense by the config, but the checkpoint holds its \
                 router `{router}`"
            ),
        )));
    }
    Ok(())
}

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
    layers: Vec<LayerSlot>,
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

/// The sizes of an MLA block, as the DeepSeek-V3 and Kimi configs name them.
pub(crate) struct MlaDims {
    pub hidden: usize,
    pub heads: usize,
    pub q_lora_rank: Option<usize>,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub kv_lora_rank: usize,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub bias: bool,
}

/// An MLA block's projections under `a` (`...self_attn`): DeepSeek's with `rope`, Kimi's NoPE
/// form without, K3's with an `output_gate`.
pub(crate) fn mla_attention(
    ld: &Loader<'_>,
    a: &str,
    d: &MlaDims,
    rope: Option<Rope>,
    softmax_scale: f32,
    output_gate: Option<Linear>,
) -> Result<MlaAttention> {
    let (hd, heads, bias) = (d.hidden, d.heads, d.bias);
    let (nope, rd, vd, kl) = (
        d.qk_nope_head_dim,
        d.qk_rope_head_dim,
        d.v_head_dim,
        d.kv_lora_rank,
    );
    let q = match d.q_lora_rank {
        Some(r) => QProj::Lora {
            a: ld.linear(&format!("{a}.q_a_proj"), r, hd, bias)?,
            norm: ld.norm(&format!("{a}.q_a_layernorm.weight"), r, 1e-6)?,
            b: ld.linear(&format!("{a}.q_b_proj"), heads * (nope + rd), r, false)?,
        },
        None => QProj::Direct(ld.linear(&format!("{a}.q_proj"), heads * (nope + rd), hd, false)?),
    };
    Ok(MlaAttention {
        num_heads: heads,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rd,
        v_head_dim: vd,
        kv_lora_rank: kl,
        q,
        kv_a_proj_with_mqa: ld.linear(&format!("{a}.kv_a_proj_with_mqa"), kl + rd, hd, bias)?,
        kv_a_layernorm: ld.norm(&format!("{a}.kv_a_layernorm.weight"), kl, 1e-6)?,
        kv_b_proj: ld.linear(&format!("{a}.kv_b_proj"), heads * (nope + vd), kl, false)?,
        o_proj: ld.linear(&format!("{a}.o_proj"), hd, heads * vd, bias)?,
        rope,
        softmax_scale,
        output_gate,
    })
}
