//! The tensors of a synthetic DeepSeek-V3 / Kimi K2 or Qwen3-MoE checkpoint, named, shaped and
//! ordered as the released checkpoints store them.

use deltafin_formats::Dtype;
use deltafin_storage::checkpoint_writer::{Fill, PlannedTensor};
use deltafin_storage::safetensors::TensorSpec;
use serde_json::Value;

use crate::error::{InferenceError, Result};
use crate::synth::planned::{field, lin, norm, vector};

/// The checkpoint's tensors for a config, in the order real checkpoints store them.
pub fn tensors_for(cfg: &Value) -> Result<Vec<PlannedTensor>> {
    let arch = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    if arch == "kimi_linear" || arch == "kimi_k3" {
        return crate::synth::kimi::kimi_tensors(cfg);
    }
    let h = field(cfg, "hidden_size")?;
    let layers = field(cfg, "num_hidden_layers")?;
    let vocab = field(cfg, "vocab_size")?;
    let heads = field(cfg, "num_attention_heads")?;
    let inter = field(cfg, "intermediate_size")?;
    let im = field(cfg, "moe_intermediate_size")?;
    let mut v = vec![PlannedTensor {
        spec: TensorSpec::new("model.embed_tokens.weight", Dtype::Bf16, &[vocab, h]),
        fill: Fill::Uniform(1.0),
    }];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        v.push(norm(format!("{p}.input_layernorm.weight"), h));
        let moe: bool;
        let experts: u64;
        match arch {
            "deepseek_v3" | "kimi_k2" => {
                let nope = field(cfg, "qk_nope_head_dim")?;
                let rope = field(cfg, "qk_rope_head_dim")?;
                let vd = field(cfg, "v_head_dim")?;
                let kvl = field(cfg, "kv_lora_rank")?;
                let qk = nope + rope;
                match cfg.get("q_lora_rank").and_then(Value::as_u64) {
                    Some(ql) => {
                        v.push(lin(format!("{p}.self_attn.q_a_proj.weight"), ql, h));
                        v.push(norm(format!("{p}.self_attn.q_a_layernorm.weight"), ql));
                        v.push(lin(
                            format!("{p}.self_attn.q_b_proj.weight"),
                            heads * qk,
                            ql,
                        ));
                    }
                    None => v.push(lin(format!("{p}.self_attn.q_proj.weight"), heads * qk, h)),
                }
                v.push(lin(
                    format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
                    kvl + rope,
                    h,
                ));
                v.push(norm(format!("{p}.self_attn.kv_a_layernorm.weight"), kvl));
                v.push(lin(
                    format!("{p}.self_attn.kv_b_proj.weight"),
                    heads * (nope + vd),
                    kvl,
                ));
                v.push(lin(format!("{p}.self_attn.o_proj.weight"), h, heads * vd));
                let dense = cfg
                    .get("first_k_dense_replace")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                let freq = cfg
                    .get("moe_layer_freq")
                    .and_then(Value::as_u64)
                    .unwrap_or(1)
                    .max(1);
                experts = field(cfg, "n_routed_experts")?;
                moe = experts > 0 && l >= dense && l % freq == 0;
            }
            "qwen3_moe" => {
                let kv = field(cfg, "num_key_value_heads")?;
                let hd = cfg
                    .get("head_dim")
                    .and_then(Value::as_u64)
                    .unwrap_or(h / heads.max(1));
                v.push(lin(format!("{p}.self_attn.q_proj.weight"), heads * hd, h));
                v.push(lin(format!("{p}.self_attn.k_proj.weight"), kv * hd, h));
                v.push(lin(format!("{p}.self_attn.v_proj.weight"), kv * hd, h));
                v.push(lin(format!("{p}.self_attn.o_proj.weight"), h, heads * hd));
                v.push(norm(format!("{p}.self_attn.q_norm.weight"), hd));
                v.push(norm(format!("{p}.self_attn.k_norm.weight"), hd));
                let step = cfg
                    .get("decoder_sparse_step")
                    .and_then(Value::as_u64)
                    .unwrap_or(1)
                    .max(1);
                let only: Vec<u64> = cfg
                    .get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                experts = field(cfg, "num_experts")?;
                moe = experts > 0 && !only.contains(&l) && (l + 1) % step == 0;
            }
            other => {
                return Err(InferenceError::InvalidArgument(format!(
                    "synth cannot write `{other}`; it writes: {}",
                    crate::synth::presets::SYNTH_ARCHS.join(", ")
                )))
            }
        }
        v.push(norm(format!("{p}.post_attention_layernorm.weight"), h));
        if moe {
            v.push(lin(format!("{p}.mlp.gate.weight"), experts, h));
            if arch != "qwen3_moe" {
                v.push(vector(
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    experts,
                    Dtype::F32,
                    Fill::Uniform(0.01),
                ));
            }
            for e in 0..experts {
                v.push(lin(format!("{p}.mlp.experts.{e}.gate_proj.weight"), im, h));
                v.push(lin(format!("{p}.mlp.experts.{e}.up_proj.weight"), im, h));
                v.push(lin(format!("{p}.mlp.experts.{e}.down_proj.weight"), h, im));
            }
            let shared = cfg
                .get("n_shared_experts")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            if arch != "qwen3_moe" && shared > 0 {
                let w = im * shared;
                v.push(lin(
                    format!("{p}.mlp.shared_experts.gate_proj.weight"),
                    w,
                    h,
                ));
                v.push(lin(format!("{p}.mlp.shared_experts.up_proj.weight"), w, h));
                v.push(lin(
                    format!("{p}.mlp.shared_experts.down_proj.weight"),
                    h,
                    w,
                ));
            }
        } else {
            v.push(lin(format!("{p}.mlp.gate_proj.weight"), inter, h));
            v.push(lin(format!("{p}.mlp.up_proj.weight"), inter, h));
            v.push(lin(format!("{p}.mlp.down_proj.weight"), h, inter));
        }
    }
    v.push(norm("model.norm.weight".into(), h));
    if !cfg
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        v.push(lin("lm_head.weight".into(), vocab, h));
    }
    Ok(v)
}
