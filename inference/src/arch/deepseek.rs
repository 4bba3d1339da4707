//! DeepSeek-V3 / Kimi K2: MLA attention (RoPE, optional YaRN) and noaux_tc routed MoE with
//! shared experts; the first `first_k_dense_replace` layers dense.

use std::sync::Arc;

use crate::arch::layer_builder::LayerBuilder;
use crate::arch::parts::{
    check_dense, decoder_layer, dense_mlp, mla_attention, model_parts, MlaDims,
};
use crate::config::{DeepseekV3Config, ModelConfig};
use crate::error::Result;
use crate::ffn::feed_forward::FeedForward;
use crate::ffn::moe::{ExpertMatrixNames, MoeFfn, RoutedExperts};
use crate::ffn::router::NoauxTcRouter;
use crate::loader::Loader;
use crate::model::{DecoderLayer, LayerSlot, ModelParts};
use crate::ops::Activation;
use crate::rope::{yarn_get_mscale, Rope, RopeLayout};

/// The rope of DeepSeek-V3 MLA and the q.k softmax scale (with YaRN's mscale^2).
pub fn deepseek_rope_and_scale(c: &DeepseekV3Config) -> Result<(Rope, f32)> {
    let layout = if c.rope_interleave {
        RopeLayout::Interleaved
    } else {
        RopeLayout::Half
    };
    let rope = Rope::new(
        &c.rope_parameters,
        c.qk_rope_head_dim,
        c.max_position_embeddings,
        layout,
    )?;
    let mut scale = (c.qk_head_dim() as f64).powf(-0.5);
    let p = &c.rope_parameters;
    if p.rope_type != "default" {
        if let (Some(m), Some(factor)) = (p.mscale_all_dim.filter(|&m| m != 0.0), p.factor) {
            let ms = yarn_get_mscale(factor, m);
            scale *= ms * ms;
        }
    }
    Ok((rope, scale as f32))
}

/// DeepSeek-V3's decoder layers: what every layer shares, computed once.
#[derive(Debug)]
pub(crate) struct DeepseekLayers {
    c: DeepseekV3Config,
    act: Arc<dyn Activation>,
    rope: Rope,
    scale: f32,
}

impl DeepseekLayers {
    pub(crate) fn new(c: &DeepseekV3Config) -> Result<DeepseekLayers> {
        let (rope, scale) = deepseek_rope_and_scale(c)?;
        Ok(DeepseekLayers {
            c: c.clone(),
            act: Arc::new(c.hidden_act),
            rope,
            scale,
        })
    }
}

impl LayerBuilder for DeepseekLayers {
    fn layer(&self, ld: &Loader<'_>, l: usize) -> Result<DecoderLayer> {
        let c = &self.c;
        let hd = c.hidden_size;
        let act = &self.act;
        let dims = MlaDims {
            hidden: hd,
            heads: c.num_attention_heads,
            q_lora_rank: c.q_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            kv_lora_rank: c.kv_lora_rank,
            bias: c.attention_bias,
        };
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let mixer = mla_attention(ld, &a, &dims, Some(self.rope.clone()), self.scale, None)?;
        let ffn: Box<dyn FeedForward> = if c.is_moe_layer(l) {
            let m = format!("{p}.mlp");
            let e = c.n_routed_experts;
            let router = NoauxTcRouter {
                gate: ld.linear(&format!("{m}.gate"), e, hd, false)?,
                bias: ld.vector(&format!("{m}.gate.e_score_correction_bias"), e)?,
                n_group: c.n_group,
                topk_group: c.topk_group,
                top_k: c.num_experts_per_tok,
                norm_topk_prob: c.norm_topk_prob,
                routed_scaling_factor: c.routed_scaling_factor as f32,
                softmax_scores: false,
                dropped_group_score: 0.0,
                renormalize_single: true,
            };
            let shared = if c.n_shared_experts > 0 {
                Some(dense_mlp(
                    ld,
                    &format!("{m}.shared_experts"),
                    hd,
                    c.moe_intermediate_size * c.n_shared_experts,
                    act,
                )?)
            } else {
                None
            };
            Box::new(MoeFfn {
                router: Box::new(router),
                experts: RoutedExperts::new(
                    hd,
                    c.moe_intermediate_size,
                    ExpertMatrixNames::HF,
                    ld.hints,
                    ld.kernels,
                    ld.naming.clone(),
                ),
                shared_experts: shared,
                act: act.clone(),
                latent: None,
            })
        } else {
            check_dense(
                ld,
                l,
                &format!("{p}.mlp"),
                "n_routed_experts / first_k_dense_replace / moe_layer_freq",
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

/// The parts around DeepSeek-V3's decoder layers.
pub(crate) fn deepseek_v3_parts(
    c: &DeepseekV3Config,
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
