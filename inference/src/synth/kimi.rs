//! Synthetic Kimi Linear and Kimi K3 checkpoints: the config keys the released models use and
//! every tensor they store, named, typed and shaped as released (K3's under `language_model.`,
//! its `A_log` padded, its conv weights and KDA `o_norm` F32).

use deltafin_formats::Dtype;
use deltafin_storage::checkpoint_writer::{Fill, PlannedTensor};
use deltafin_storage::safetensors::TensorSpec;
use serde_json::{json, Value};

use crate::error::{InferenceError, Result};
use crate::synth::planned::{field, lin, norm, vector};

/// The text config of a Kimi preset: every 4th layer (1-indexed) MLA, the rest KDA; K3 adds
/// SiTU, Attention Residuals, latent experts and the gates.
pub fn kimi_config(k3: bool, sizes: [u64; 8]) -> Value {
    let [h, layers, experts, topk, im, inter, heads, vocab] = sizes;
    let (kda, full): (Vec<u64>, Vec<u64>) = (1..=layers).partition(|l| l % 4 != 0);
    let kda_heads = heads.max(1);
    let head_dim = (h / kda_heads).clamp(16, 128);
    let mut text = json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": inter,
        "moe_intermediate_size": im,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": (h / 4).max(16),
        "q_lora_rank": (h / 2).max(16),
        "qk_nope_head_dim": 2 * head_dim.min(64),
        "qk_rope_head_dim": head_dim.min(64),
        "v_head_dim": 2 * head_dim.min(64),
        "num_experts": experts,
        "num_experts_per_token": topk,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "mla_use_nope": true,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": vocab - 1,
        "use_cache": true,
        "topk_method": "noaux_tc",
        "use_grouped_topk": true,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "head_dim": head_dim,
            "num_heads": kda_heads,
            "short_conv_kernel_size": 4
        }
    });
    if !k3 {
        return text;
    }
    if let Some(o) = text.as_object_mut() {
        o.insert("hidden_act".into(), "situ".into());
        o.insert("activation_situ_beta".into(), 4.0.into());
        o.insert("activation_situ_linear_beta".into(), 25.0.into());
        o.insert("attn_res_block_size".into(), json!((layers / 3).max(1)));
        o.insert("routed_expert_hidden_size".into(), json!(h / 2));
        o.insert("latent_moe_use_norm".into(), true.into());
        o.insert("mla_use_output_gate".into(), true.into());
        o.insert("num_shared_experts".into(), 2.into());
        o.insert("routed_scaling_factor".into(), 1.0.into());
        o.insert("dtype".into(), "bfloat16".into());
        if let Some(la) = o
            .get_mut("linear_attn_config")
            .and_then(Value::as_object_mut)
        {
            la.insert("use_full_rank_gate".into(), true.into());
            la.insert("gate_lower_bound".into(), (-5.0).into());
        }
    }
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": vocab - 1,
        "dtype": "bfloat16",
        "tie_word_embeddings": false,
        "text_config": text,
    })
}

fn f32_vec(name: String, n: u64, fill: Fill) -> PlannedTensor {
    vector(name, n, Dtype::F32, fill)
}

/// The layers `linear_attn_config.{key}` lists (1-indexed), 0-based.
fn listed(la: &Value, key: &str) -> Vec<u64> {
    la.get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|l| l.saturating_sub(1))
                .collect()
        })
        .unwrap_or_default()
}

/// Every tensor of a Kimi Linear (`config` itself) or Kimi K3 (the wrapper) checkpoint.
pub fn kimi_tensors(config: &Value) -> Result<Vec<PlannedTensor>> {
    let k3 = config.get("model_type").and_then(Value::as_str) == Some("kimi_k3");
    let c = if k3 {
        config.get("text_config").ok_or_else(|| {
            InferenceError::InvalidArgument("kimi_k3 config without text_config".into())
        })?
    } else {
        config
    };
    let pre = if k3 { "language_model." } else { "" };
    let small_dtype = if k3 { Dtype::F32 } else { Dtype::Bf16 };
    let (h, layers, vocab) = (
        field(c, "hidden_size")?,
        field(c, "num_hidden_layers")?,
        field(c, "vocab_size")?,
    );
    let (heads, nope, rope, vd, kl) = (
        field(c, "num_attention_heads")?,
        field(c, "qk_nope_head_dim")?,
        field(c, "qk_rope_head_dim")?,
        field(c, "v_head_dim")?,
        field(c, "kv_lora_rank")?,
    );
    let null = Value::Null;
    let la = c.get("linear_attn_config").unwrap_or(&null);
    let kda_layers = listed(la, "kda_layers");
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let flag = |v: &Value, k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    let experts = num(c, "num_experts");
    let first_dense = num(c, "first_k_dense_replace");
    let latent = c.get("routed_expert_hidden_size").and_then(Value::as_u64);
    let attn_res = c
        .get("attn_res_block_size")
        .and_then(Value::as_u64)
        .is_some();
    let mut v = vec![PlannedTensor {
        spec: TensorSpec::new(
            format!("{pre}model.embed_tokens.weight"),
            Dtype::Bf16,
            &[vocab, h],
        ),
        fill: Fill::Uniform(1.0),
    }];
    for l in 0..layers {
        let p = format!("{pre}model.layers.{l}");
        v.push(norm(format!("{p}.input_layernorm.weight"), h));
        v.push(norm(format!("{p}.post_attention_layernorm.weight"), h));
        if attn_res {
            for w in ["self_attention_res", "mlp_res"] {
                v.push(norm(format!("{p}.{w}_norm.weight"), h));
                v.push(lin(format!("{p}.{w}_proj.weight"), 1, h));
            }
        }
        let a = format!("{p}.self_attn");
        if kda_layers.contains(&l) {
            let (hh, d, k) = (
                num(la, "num_heads"),
                num(la, "head_dim"),
                num(la, "short_conv_kernel_size"),
            );
            let ch = hh * d;
            for x in ["q", "k", "v"] {
                v.push(lin(format!("{a}.{x}_proj.weight"), ch, h));
                v.push(PlannedTensor {
                    spec: TensorSpec::new(
                        format!("{a}.{x}_conv1d.weight"),
                        small_dtype.clone(),
                        &[ch, 1, k],
                    ),
                    fill: Fill::Uniform(0.8),
                });
            }
            v.push(lin(format!("{a}.f_a_proj.weight"), d, h));
            v.push(lin(format!("{a}.f_b_proj.weight"), ch, d));
            let safe = la.get("gate_lower_bound").is_some_and(|g| !g.is_null());
            // A_log: per head; the safe gate's rate around 1, the softplus gate's log U(1, 16).
            let (lo, hi) = if safe { (-0.5, 0.5) } else { (0.0, 2.7) };
            if k3 {
                v.push(f32_vec(
                    format!("{a}.A_log"),
                    hh.max(d),
                    Fill::Padded { lo, hi, count: hh },
                ));
            } else {
                v.push(PlannedTensor {
                    spec: TensorSpec::new(format!("{a}.A_log"), Dtype::F32, &[1, 1, hh, 1]),
                    fill: Fill::Range(lo, hi),
                });
            }
            let (lo, hi) = if safe { (-3.0, 0.0) } else { (-6.9, -2.3) };
            v.push(f32_vec(format!("{a}.dt_bias"), ch, Fill::Range(lo, hi)));
            v.push(lin(format!("{a}.b_proj.weight"), hh, h));
            if flag(la, "use_full_rank_gate") {
                v.push(lin(format!("{a}.g_proj.weight"), ch, h));
            } else {
                v.push(lin(format!("{a}.g_a_proj.weight"), d, h));
                v.push(lin(format!("{a}.g_b_proj.weight"), ch, d));
            }
            v.push(vector(
                format!("{a}.o_norm.weight"),
                d,
                small_dtype.clone(),
                Fill::Constant(1.0),
            ));
            v.push(lin(format!("{a}.o_proj.weight"), h, ch));
        } else {
            match c.get("q_lora_rank").and_then(Value::as_u64) {
                Some(r) => {
                    v.push(lin(format!("{a}.q_a_proj.weight"), r, h));
                    v.push(norm(format!("{a}.q_a_layernorm.weight"), r));
                    v.push(lin(
                        format!("{a}.q_b_proj.weight"),
                        heads * (nope + rope),
                        r,
                    ));
                }
                None => v.push(lin(format!("{a}.q_proj.weight"), heads * (nope + rope), h)),
            }
            v.push(lin(format!("{a}.kv_a_proj_with_mqa.weight"), kl + rope, h));
            v.push(norm(format!("{a}.kv_a_layernorm.weight"), kl));
            v.push(lin(
                format!("{a}.kv_b_proj.weight"),
                heads * (nope + vd),
                kl,
            ));
            if flag(c, "mla_use_output_gate") {
                v.push(lin(format!("{a}.g_proj.weight"), heads * vd, h));
            }
            v.push(lin(format!("{a}.o_proj.weight"), h, heads * vd));
        }
        let moe = experts > 0 && l >= first_dense && l % num(c, "moe_layer_freq").max(1) == 0;
        if !moe {
            let inter = field(c, "intermediate_size")?;
            v.push(lin(format!("{p}.mlp.gate_proj.weight"), inter, h));
            v.push(lin(format!("{p}.mlp.up_proj.weight"), inter, h));
            v.push(lin(format!("{p}.mlp.down_proj.weight"), h, inter));
            continue;
        }
        let m = format!("{p}.block_sparse_moe");
        let im = field(c, "moe_intermediate_size")?;
        v.push(lin(format!("{m}.gate.weight"), experts, h));
        v.push(f32_vec(
            format!("{m}.gate.e_score_correction_bias"),
            experts,
            Fill::Uniform(0.01),
        ));
        let eh = latent.unwrap_or(h);
        if let Some(r) = latent {
            v.push(lin(format!("{m}.routed_expert_down_proj.weight"), r, h));
            v.push(lin(format!("{m}.routed_expert_up_proj.weight"), h, r));
            if flag(c, "latent_moe_use_norm") {
                v.push(norm(format!("{m}.routed_expert_norm.weight"), r));
            }
        }
        for e in 0..experts {
            v.push(lin(format!("{m}.experts.{e}.w1.weight"), im, eh));
            v.push(lin(format!("{m}.experts.{e}.w2.weight"), eh, im));
            v.push(lin(format!("{m}.experts.{e}.w3.weight"), im, eh));
        }
        let shared = num(c, "num_shared_experts");
        if shared > 0 {
            let w = im * shared;
            v.push(lin(format!("{m}.shared_experts.gate_proj.weight"), w, h));
            v.push(lin(format!("{m}.shared_experts.up_proj.weight"), w, h));
            v.push(lin(format!("{m}.shared_experts.down_proj.weight"), h, w));
        }
    }
    v.push(norm(format!("{pre}model.norm.weight"), h));
    if attn_res {
        v.push(norm(format!("{pre}model.output_attn_res_norm.weight"), h));
        v.push(lin(format!("{pre}model.output_attn_res_proj.weight"), 1, h));
    }
    if !flag(c, "tie_word_embeddings") {
        v.push(lin(format!("{pre}lm_head.weight"), vocab, h));
    }
    Ok(v)
}
