//! Qwen3-MoE: GQA attention with q/k norms and half-split RoPE, softmax top-k routed MoE.

use std::sync::Arc;

use crate::arch::layer_builder::LayerBuilder;
use crate::arch::parts::{check_dense, decoder_layer, dense_mlp, model_parts};
use crate::config::{ModelConfig, Qwen3MoeConfig};
use crate::error::Result;
use crate::ffn::feed_forward::FeedForward;
use crate::ffn::moe::{ExpertMatrixNames, MoeFfn, RoutedExperts};
use crate::ffn::router::SoftmaxTopKRouter;
use crate::loader::Loader;
use crate::mixer::GqaAttention;
use crate::model::{DecoderLayer, LayerSlot, ModelParts};
use crate::ops::Activation;
use crate::rope::{Rope, RopeLayout};

/// The rope of Qwen3-MoE attention and the q.k scale.
pub fn qwen_rope_and_scale(c: &Qwen3MoeConfig) -> Result<(Rope, f32)> {
    let rope = Rope::new(
        &c.rope_parameters,
        c.head_dim,
        c.max_position_embeddings,
        RopeLayout::Half,
    )?;
    Ok((rope, (c.head_dim as f64).powf(-0.5) as f32))
}

/// Qwen3-MoE's decoder layers: what every layer shares, computed once.
#[derive(Debug)]
pub(crate) struct QwenLayers {
    c: Qwen3MoeConfig,
    act: Arc<dyn Activation>,
    rope: Rope,
    scale: f32,
}

impl QwenLayers {
    pub(crate) fn new(c: &Qwen3MoeConfig) -> Result<QwenLayers> {
        let (rope, scale) = qwen_rope_and_scale(c)?;
        Ok(QwenLayers {
            c: c.clone(),
            act: Arc::new(c.hidden_act),
            rope,
            scale,
        })
    }
}

impl LayerBuilder for QwenLayers {
    fn layer(&self, ld: &Loader<'_>, l: usize) -> Result<DecoderLayer> {
        let c = &self.c;
        let hd = c.hidden_size;
        let act = &self.act;
        let (heads, kvh, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let bias = c.attention_bias;
        let mixer = GqaAttention {
            num_heads: heads,
            num_kv_heads: kvh,
            head_dim: d,
            q_proj: ld.linear(&format!("{a}.q_proj"), heads * d, hd, bias)?,
            k_proj: ld.linear(&format!("{a}.k_proj"), kvh * d, hd, bias)?,
            v_proj: ld.linear(&format!("{a}.v_proj"), kvh * d, hd, bias)?,
            o_proj: ld.linear(&format!("{a}.o_proj"), hd, heads * d, bias)?,
            q_norm: Some(ld.norm(&format!("{a}.q_norm.weight"), d, c.rms_norm_eps)?),
            k_norm: Some(ld.norm(&format!("{a}.k_norm.weight"), d, c.rms_norm_eps)?),
            rope: self.rope.clone(),
            softmax_scale: self.scale,
        };
        let ffn: Box<dyn FeedForward> = if c.is_moe_layer(l) {
            let m = format!("{p}.mlp");
            Box::new(MoeFfn {
                router: Box::new(SoftmaxTopKRouter {
                    gate: ld.linear(&format!("{m}.gate"), c.num_experts, hd, false)?,
                    top_k: c.num_experts_per_tok,
                    norm_topk_prob: c.norm_topk_prob,
                }),
                experts: RoutedExperts::new(
                    hd,
                    c.moe_intermediate_size,
                    ExpertMatrixNames::HF,
                    ld.hints,
                    ld.kernels,
                    ld.naming.clone(),
                ),
                shared_experts: None,
                act: act.clone(),
                latent: None,
            })
        } else {
            check_dense(
                ld,
                l,
                &format!("{p}.mlp"),
                "num_experts / mlp_only_layers / decoder_sparse_step",
            )?;
            Box::new(dense_mlp(
                ld,
                &format!("{p}.mlp"),
                hd,
                c.intermediate_size,
                act,
            )?)
        };
        decoder_layer(ld, &p, l, hd, c.rms_norm_eps, Box::new(mixer), ffn)
    }
}

/// The parts around Qwen3-MoE's decoder layers.
pub(crate) fn qwen3_moe_parts(
    c: &Qwen3MoeConfig,
    ld: &Loader<'_>,
    config: ModelConfig,
    layers: Vec<LayerSlot>,
) -> Result<ModelParts> {
    model_parts(
        ld,
        config,
        layers,
        c.vocab_size,
        c.hidden_size,
        c.tie_word_embeddings,
        c.rms_norm_eps,
    )
}
