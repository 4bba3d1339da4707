//! Kimi Linear and Kimi K3: KDA (linear attention) and NoPE MLA layers, sigmoid-routed MoE
//! with shared experts (`block_sparse_moe`, experts `w1`/`w3`/`w2`); K3 adds the MLA output
//! gate, KDA's full-rank output gate and safe forget gate, latent routed experts, SiTU and
//! Attention Residuals. Tensor names as the released checkpoints store them (K3's under
//! `language_model.`, which the loader prepends).

use std::sync::Arc;

use crate::arch::layer_builder::LayerBuilder;
use crate::arch::parts::{
    check_dense, decoder_layer, dense_mlp, embeddings_and_head, mla_attention, MlaDims,
};
use crate::config::{KimiAct, KimiConfig, ModelConfig, RouterScore};
use crate::error::{InferenceError, Result};
use crate::ffn::feed_forward::FeedForward;
use crate::ffn::moe::{ExpertMatrixNames, LatentMoe, MoeFfn, RoutedExperts};
use crate::ffn::router::NoauxTcRouter;
use crate::loader::Loader;
use crate::mixer::kda::{ForgetGate, KdaAttention, KdaOutputGate};
use crate::mixer::{MlaAttention, TokenMixer};
use crate::model::attn_res::{AttnRes, AttnResQuery};
use crate::model::decoder::{DecoderLayer, LayerSlot, ModelParts};
use crate::model::residual::{AddResidual, ResidualMixer};
use crate::ops::{Activation, Situ};

/// `A_log` as the checkpoint stores it — `[1, 1, H, 1]` (Kimi Linear), `[H]`, or K3's `[N]`:
/// the `H` head values then zero padding — as `[H]`. Anything else is refused: a padded
/// vector whose tail is not zero could be a per-channel rate, which this engine does not run.
fn a_log(ld: &Loader<'_>, name: &str, heads: usize) -> Result<Vec<f32>> {
    let (full, shape, v) = ld.any_f32(name)?;
    let bad = |reason: String| InferenceError::BadTensor {
        name: full.clone(),
        reason,
    };
    let per_head = shape.iter().filter(|&&d| d != 1).count() <= 1;
    if !per_head || v.len() < heads {
        return Err(bad(format!(
            "shape {shape:?}; expected [1, 1, {heads}, 1], [{heads}] or [N >= {heads}] zero-padded"
        )));
    }
    if let Some((i, x)) = v.iter().enumerate().skip(heads).find(|(_, x)| **x != 0.0) {
        return Err(bad(format!(
            "holds {} values for {heads} heads, but value {i} past the heads is {x}, not zero \
             padding",
            v.len()
        )));
    }
    if let Some(x) = v[..heads].iter().find(|x| !x.is_finite()) {
        return Err(bad(format!("a head's value is {x}")));
    }
    Ok(v[..heads].to_vec())
}

/// A KDA layer.
fn kda(ld: &Loader<'_>, a: &str, c: &KimiConfig) -> Result<KdaAttention> {
    let (hd, h, d, kk) = (
        c.hidden_size,
        c.kda_num_heads,
        c.kda_head_dim,
        c.short_conv_kernel_size,
    );
    let ch = h * d;
    let conv = |n: &str| ld.tensor_f32(&format!("{a}.{n}_conv1d.weight"), &[ch, 1, kk]);
    let output_gate = if c.kda_full_rank_gate {
        KdaOutputGate::FullRank(ld.linear(&format!("{a}.g_proj"), ch, hd, false)?)
    } else {
        KdaOutputGate::LowRank {
            a: ld.linear(&format!("{a}.g_a_proj"), d, hd, false)?,
            b: ld.linear(&format!("{a}.g_b_proj"), ch, d, false)?,
        }
    };
    Ok(KdaAttention {
        num_heads: h,
        head_dim: d,
        conv_kernel: kk,
        q_proj: ld.linear(&format!("{a}.q_proj"), ch, hd, false)?,
        k_proj: ld.linear(&format!("{a}.k_proj"), ch, hd, false)?,
        v_proj: ld.linear(&format!("{a}.v_proj"), ch, hd, false)?,
        conv: [conv("q")?, conv("k")?, conv("v")?],
        f_a_proj: ld.linear(&format!("{a}.f_a_proj"), d, hd, false)?,
        f_b_proj: ld.linear(&format!("{a}.f_b_proj"), ch, d, false)?,
        a_log: a_log(ld, &format!("{a}.A_log"), h)?,
        dt_bias: ld.vector(&format!("{a}.dt_bias"), ch)?,
        b_proj: ld.linear(&format!("{a}.b_proj"), h, hd, false)?,
        output_gate,
        forget_gate: match c.gate_lower_bound {
            Some(lb) => ForgetGate::Safe {
                lower_bound: lb as f32,
            },
            None => ForgetGate::Softplus,
        },
        o_norm: ld.norm(&format!("{a}.o_norm.weight"), d, c.rms_norm_eps)?,
        o_proj: ld.linear(&format!("{a}.o_proj"), hd, ch, false)?,
    })
}

/// An MLA layer: no rotation; K3's output gate.
fn mla(ld: &Loader<'_>, a: &str, c: &KimiConfig) -> Result<MlaAttention> {
    let dims = MlaDims {
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        q_lora_rank: c.q_lora_rank,
        qk_nope_head_dim: c.qk_nope_head_dim,
        qk_rope_head_dim: c.qk_rope_head_dim,
        v_head_dim: c.v_head_dim,
        kv_lora_rank: c.kv_lora_rank,
        bias: c.attention_bias,
    };
    let gate = if c.mla_output_gate {
        let rows = c.num_attention_heads * c.v_head_dim;
        Some(ld.linear(&format!("{a}.g_proj"), rows, c.hidden_size, false)?)
    } else {
        None
    };
    let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f64).powf(-0.5) as f32;
    mla_attention(ld, a, &dims, None, scale, gate)
}

/// A routed MoE block (`block_sparse_moe`).
fn moe(ld: &Loader<'_>, m: &str, c: &KimiConfig, act: &Arc<dyn Activation>) -> Result<MoeFfn> {
    let (hd, e) = (c.hidden_size, c.num_experts);
    let router = NoauxTcRouter {
        gate: ld.linear(&format!("{m}.gate"), e, hd, false)?,
        bias: ld.vector(&format!("{m}.gate.e_score_correction_bias"), e)?,
        n_group: c.num_expert_group,
        topk_group: c.topk_group,
        top_k: c.num_experts_per_token,
        norm_topk_prob: c.moe_renormalize,
        routed_scaling_factor: c.routed_scaling_factor as f32,
        softmax_scores: c.router_score == RouterScore::Softmax,
        dropped_group_score: f32::NEG_INFINITY,
        renormalize_single: false,
    };
    let shared = if c.num_shared_experts > 0 {
        Some(dense_mlp(
            ld,
            &format!("{m}.shared_experts"),
            hd,
            c.moe_intermediate_size * c.num_shared_experts,
            act,
        )?)
    } else {
        None
    };
    let (expert_hidden, latent) = match c.routed_expert_hidden_size {
        Some(r) => (
            r,
            Some(LatentMoe {
                down: ld.linear(&format!("{m}.routed_expert_down_proj"), r, hd, false)?,
                up: ld.linear(&format!("{m}.routed_expert_up_proj"), hd, r, false)?,
                norm: if c.latent_moe_use_norm {
                    Some(ld.norm(&format!("{m}.routed_expert_norm.weight"), r, c.rms_norm_eps)?)
                } else {
                    None
                },
            }),
        ),
        None => (hd, None),
    };
    Ok(MoeFfn {
        router: Box::new(router),
        experts: RoutedExperts::new(
            expert_hidden,
            c.moe_intermediate_size,
            ExpertMatrixNames::W1W3W2,
            ld.hints,
            ld.kernels,
            ld.naming.clone(),
        ),
        shared_experts: shared,
        act: act.clone(),
        latent,
    })
}

/// The Attention Residuals' queries (`attn_res_block_size` set).
fn attn_res(ld: &Loader<'_>, c: &KimiConfig, block_size: usize) -> Result<AttnRes> {
    let hd = c.hidden_size;
    let query = |prefix: &str| -> Result<AttnResQuery> {
        let norm = ld.vector(&format!("{prefix}_norm.weight"), hd)?;
        let proj = ld.tensor_f32(&format!("{prefix}_proj.weight"), &[1, hd])?;
        Ok(AttnResQuery::new(&norm, &proj))
    };
    let layers = (0..c.num_hidden_layers)
        .map(|l| {
            let p = format!("model.layers.{l}");
            Ok((
                query(&format!("{p}.self_attention_res"))?,
                query(&format!("{p}.mlp_res"))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(AttnRes {
        block_size,
        hidden: hd,
        eps: c.rms_norm_eps as f32,
        layers,
        output: query("model.output_attn_res")?,
    })
}

/// Kimi's decoder layers: what every layer shares, computed once.
#[derive(Debug)]
pub(crate) struct KimiLayers {
    c: KimiConfig,
    act: Arc<dyn Activation>,
}

impl KimiLayers {
    pub(crate) fn new(c: &KimiConfig) -> KimiLayers {
        let act: Arc<dyn Activation> = match c.act {
            KimiAct::Silu => Arc::new(crate::config::HiddenAct::Silu),
            KimiAct::Situ { beta, linear_beta } => Arc::new(Situ {
                beta: beta as f32,
                linear_beta: linear_beta.map(|b| b as f32),
            }),
        };
        KimiLayers { c: c.clone(), act }
    }
}

impl LayerBuilder for KimiLayers {
    fn layer(&self, ld: &Loader<'_>, l: usize) -> Result<DecoderLayer> {
        let (c, act) = (&self.c, &self.act);
        let hd = c.hidden_size;
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let mixer: Box<dyn TokenMixer> = if c.is_kda_layer(l) {
            Box::new(kda(ld, &a, c)?)
        } else {
            Box::new(mla(ld, &a, c)?)
        };
        let ffn: Box<dyn FeedForward> = if c.is_moe_layer(l) {
            Box::new(moe(ld, &format!("{p}.block_sparse_moe"), c, act)?)
        } else {
            check_dense(
                ld,
                l,
                &format!("{p}.block_sparse_moe"),
                "num_experts / first_k_dense_replace / moe_layer_freq",
            )?;
            Box::new(dense_mlp(
                ld,
                &format!("{p}.mlp"),
                hd,
                c.intermediate_size,
                act,
            )?)
        };
        decoder_layer(ld, &p, l, hd, c.rms_norm_eps, mixer, ffn)
    }
}

/// The parts around Kimi's decoder layers (K3: the Attention Residuals).
pub(crate) fn kimi_parts(
    c: &KimiConfig,
    ld: &Loader<'_>,
    config: ModelConfig,
    layers: Vec<LayerSlot>,
) -> Result<ModelParts> {
    let hd = c.hidden_size;
    let (embed_tokens, lm_head) = embeddings_and_head(ld, c.vocab_size, hd, c.tie_word_embeddings)?;
    let residual: Box<dyn ResidualMixer> = match c.attn_res_block_size {
        Some(s) => Box::new(attn_res(ld, c, s)?),
        None => Box::new(AddResidual),
    };
    Ok(ModelParts {
        config,
        embed_tokens,
        layers,
        norm: ld.norm("model.norm.weight", hd, c.rms_norm_eps)?,
        lm_head,
        residual,
    })
}
