//! DeepSeek-V3 / Kimi K2: MLA attention (RoPE, optional YaRN) and noaux_tc routed MoE with
//! shared experts; the first `first_k_dense_replace` layers dense.

use std::sync::Arc;

use crate::arch::parts::{decoder_layer, dense_mlp, model_parts};
use crate::config::{DeepseekV3Config, ModelConfig};
use crate::error::Result;
use crate::ffn::experts::{ExpertMatrixNames, RoutedExperts};
use crate::ffn::feed_forward::FeedForward;
use crate::ffn::moe::MoeFfn;
use crate::ffn::router::NoauxTcRouter;
use crate::loader::Loader;
use crate::mixer::{MlaAttention, QProj};
use crate::model::ModelParts;
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

pub(crate) fn build_deepseek_v3(
    c: &DeepseekV3Config,
    ld: Loader<'_>,
    config: ModelConfig,
) -> Result<ModelParts> {
    let hd = c.hidden_size;
    let act: Arc<dyn Activation> = Arc::new(c.hidden_act);
    let (rope, scale) = deepseek_rope_and_scale(c)?;
    let (heads, nope, rd, vd, kl) = (
        c.num_attention_heads,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.kv_lora_rank,
    );
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let bias = c.attention_bias;
        let q = match c.q_lora_rank {
            Some(r) => QProj::Lora {
                a: ld.linear(&format!("{a}.q_a_proj"), r, hd, bias)?,
                norm: ld.norm(&format!("{a}.q_a_layernorm.weight"), r, 1e-6)?,
                b: ld.linear(&format!("{a}.q_b_proj"), heads * (nope + rd), r, false)?,
            },
            None => {
                QProj::Direct(ld.linear(&format!("{a}.q_proj"), heads * (nope + rd), hd, false)?)
            }
        };
        let mixer = MlaAttention {
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
            rope: rope.clone(),
            softmax_scale: scale,
        };
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
            };
            let shared = if c.n_shared_experts > 0 {
                Some(dense_mlp(
                    &ld,
                    &format!("{m}.shared_experts"),
                    hd,
                    c.moe_intermediate_size * c.n_shared_experts,
                    &act,
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
            })
        } else {
            Box::new(dense_mlp(
                &ld,
                &format!("{p}.mlp"),
                hd,
                c.intermediate_size,
                &act,
            )?)
        };
        layers.push(decoder_layer(
            &ld,
            &p,
            l,
            hd,
            c.rms_norm_eps,
            Box::new(mixer),
            ffn,
        )?);
    }
    model_parts(
        &ld,
        config,
        layers,
        c.vocab_size,
        hd,
        c.tie_word_embeddings,
        c.rms_norm_eps,
    )
}
