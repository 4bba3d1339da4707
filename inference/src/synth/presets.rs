//! The config.json of a synthetic model: an architecture's keys at a size preset, then the
//! user's `--set key=value` overrides.

use serde_json::{json, Value};

use crate::error::{InferenceError, Result};

/// Architectures `synth` can write.
pub const SYNTH_ARCHS: &[&str] = &["deepseek_v3", "qwen3_moe", "kimi_linear", "kimi_k3"];
/// Size presets, smallest first.
pub const PRESETS: &[&str] = &["tiny", "small", "medium", "large", "xl"];

/// The config.json for an architecture and preset, before overrides.
pub fn preset_config(arch: &str, preset: &str) -> Result<Value> {
    let bad = |what: String| InferenceError::InvalidArgument(what);
    // (hidden, layers, experts, top_k, moe_inter, inter, heads, vocab)
    let (h, layers, experts, topk, im, inter, heads, vocab) = match preset {
        "tiny" => (64u64, 4u64, 16u64, 4u64, 32u64, 128u64, 4u64, 512u64),
        "small" => (512, 6, 32, 4, 256, 1024, 8, 4096),
        "medium" => (1024, 8, 64, 6, 768, 2048, 8, 8192),
        "large" => (2048, 12, 64, 6, 1408, 4096, 16, 16384),
        "xl" => (4096, 16, 64, 8, 1536, 8192, 32, 32768),
        other => {
            return Err(bad(format!(
                "unknown preset `{other}`; presets: {}",
                PRESETS.join(", ")
            )))
        }
    };
    if arch == "kimi_linear" || arch == "kimi_k3" {
        return Ok(crate::synth::kimi::kimi_config(
            arch == "kimi_k3",
            [h, layers.max(4), experts, topk, im, inter, heads, vocab],
        ));
    }
    let common = json!({
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": im,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "hidden_act": "silu",
        "use_cache": true,
    });
    let mut cfg = common.as_object().cloned().unwrap_or_default();
    let extra = match arch {
        "deepseek_v3" => {
            let (ql, kvl, rope, nope, v) = if preset == "tiny" {
                (48u64, 32u64, 8u64, 16u64, 16u64)
            } else {
                (h / 2, h / 4, 32, 64, 64)
            };
            json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "first_k_dense_replace": 1,
                "moe_layer_freq": 1,
                "n_group": 1,
                "topk_group": 1,
                "n_routed_experts": experts,
                "n_shared_experts": 1,
                "norm_topk_prob": true,
                "routed_scaling_factor": 2.5,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "num_key_value_heads": heads,
                "num_nextn_predict_layers": 0,
                "q_lora_rank": ql,
                "kv_lora_rank": kvl,
                "qk_rope_head_dim": rope,
                "qk_nope_head_dim": nope,
                "v_head_dim": v,
            })
        }
        "qwen3_moe" => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": experts,
            "num_key_value_heads": (heads / 2).max(1),
            "head_dim": if preset == "tiny" { 16 } else { 64 },
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": true,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": false,
            "sliding_window": null,
            "use_sliding_window": false,
            "max_window_layers": layers,
        }),
        other => {
            return Err(bad(format!(
                "synth cannot write `{other}`; it writes: {}",
                SYNTH_ARCHS.join(", ")
            )))
        }
    };
    if let Some(o) = extra.as_object() {
        cfg.extend(o.clone());
    }
    Ok(Value::Object(cfg))
}

/// Apply `key=value` overrides; values parse as JSON when they can, else as strings.
pub fn apply_overrides(cfg: &mut Value, sets: &[String]) -> Result<()> {
    for s in sets {
        let (k, v) = s.split_once('=').ok_or_else(|| {
            InferenceError::InvalidArgument(format!("--set {s}: expected key=value"))
        })?;
        let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()));
        let path: Vec<&str> = k.trim().split('.').collect();
        // A wrapper config (Kimi K3) keeps the text model's keys in `text_config`: a key that
        // is not one of the wrapper's own goes there.
        let wrapper_key = |c: &Value| c.get(path[0]).is_some() || path[0] == "text_config";
        let mut target = &mut *cfg;
        if !wrapper_key(target) && target.get("text_config").is_some_and(Value::is_object) {
            target = &mut target["text_config"];
        }
        let (last, parents) = path.split_last().unwrap_or((&"", &[]));
        for (i, seg) in parents.iter().enumerate() {
            let Some(o) = target.as_object_mut() else {
                return Err(not_object(s, &path[..i]));
            };
            target = o
                .entry(seg.to_string())
                .or_insert_with(|| Value::Object(Default::default()));
        }
        let Some(o) = target.as_object_mut() else {
            return Err(not_object(s, parents));
        };
        o.insert(last.to_string(), value);
    }
    Ok(())
}

fn not_object(set: &str, path: &[&str]) -> InferenceError {
    InferenceError::InvalidArgument(format!(
        "--set {set}: `{}` is not an object",
        path.join(".")
    ))
}
