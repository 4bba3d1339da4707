//! Architecture builders: map a config and Hugging Face tensor names onto the generic
//! [`DecoderLayer`] pieces.

use std::sync::Arc;

use crate::config::{DeepseekV3Config, ModelConfig, Qwen3MoeConfig};
use crate::error::Result;
use crate::ffn::{DenseMlp, ExpertShape, FeedForward, MoeFfn, NoauxTcRouter, SoftmaxTopKRouter};
use crate::linear::QuantHints;
use crate::loader::Loader;
use crate::mixer::{GqaAttention, MlaAttention, QProj, TokenMixer};
use crate::model::{AddResidual, DecoderLayer, ModelParts};
use crate::ops::Activation;
use crate::rope::{yarn_get_mscale, Rope, RopeLayout};
use crate::weights::WeightSource;

/// Build the parts of any supported architecture.
pub fn build(config: ModelConfig, src: &dyn WeightSource) -> Result<ModelParts> {
    let hints = QuantHints::from_config(config.quantization_config());
    let ld = Loader { src, hints };
    match &config {
        ModelConfig::DeepseekV3(c) => build_deepseek_v3(c, ld, config.clone()),
        ModelConfig::Qwen3Moe(c) => build_qwen3_moe(c, ld, config.clone()),
    }
}

fn dense_mlp(
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

fn embeddings_and_head(
    ld: &Loader<'_>,
    vocab: usize,
    hidden: usize,
    tie: bool,
) -> Result<(crate::linear::Linear, Option<crate::linear::Linear>)> {
    let embed = ld.linear("model.embed_tokens", vocab, hidden, false)?;
    let head = if tie {
        None
    } else {
        Some(ld.linear("lm_head", vocab, hidden, false)?)
    };
    Ok((embed, head))
}

/// One pre-norm decoder block: `input_layernorm`, the mixer, `post_attention_layernorm`, the FFN.
fn decoder_layer(
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
fn model_parts(
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

fn build_deepseek_v3(
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
                experts: ExpertShape {
                    hidden: hd,
                    intermediate: c.moe_intermediate_size,
                    hints: ld.hints,
                },
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

fn build_qwen3_moe(c: &Qwen3MoeConfig, ld: Loader<'_>, config: ModelConfig) -> Result<ModelParts> {
    let hd = c.hidden_size;
    let act: Arc<dyn Activation> = Arc::new(c.hidden_act);
    let (rope, scale) = qwen_rope_and_scale(c)?;
    let (heads, kvh, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
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
            rope: rope.clone(),
            softmax_scale: scale,
        };
        let ffn: Box<dyn FeedForward> = if c.is_moe_layer(l) {
            let m = format!("{p}.mlp");
            Box::new(MoeFfn {
                router: Box::new(SoftmaxTopKRouter {
                    gate: ld.linear(&format!("{m}.gate"), c.num_experts, hd, false)?,
                    top_k: c.num_experts_per_tok,
                    norm_topk_prob: c.norm_topk_prob,
                }),
                experts: ExpertShape {
                    hidden: hd,
                    intermediate: c.moe_intermediate_size,
                    hints: ld.hints,
                },
                shared_experts: None,
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
