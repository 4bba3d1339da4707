//! The config.json of a synthetic model: an architecture's keys at a size preset, then the
//! user's `--set key=value` overrides.

use serde_json::{json, Value};

use crate::error::{InferenceError, Result};

/// Architectures `synth` can write.
pub const SYNTH_ARCHS: &[&str] = &["deepseek_v3", "qwen3_moe", "kimi_linear", "kimi_k3"];
/// Size presets, smallest first, then `k3-width` (Kimi K3 only).
pub const PRESETS: &[&str] = &["tiny", "small", "medium", "large", "xl", "k3-width"];

/// The config.json for an architecture and preset, before overrides.
pub fn preset_config(arch: &str, preset: &str) -> Result<Value> {
    let bad = |what: String| InferenceError::InvalidArgument(what);
    if preset == "k3-width" {
        if arch != "kimi_k3" {
            return Err(bad(format!(
                "preset k3-width is Kimi K3's widths; use --arch kimi_k3, not {arch}"
            )));
        }
        return Ok(k3_width_config());
    }
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

/// Kimi K3 at its real widths with few layers: hidden 7168, KDA 96 heads x 128, MLA with
/// 64 heads, q_lora 1536, kv_lora 512, nope/rope/v 128/64/128 (Kimi K2's MLA dims: K3's own
/// config was not available to this project; its issue names only the KDA, latent and expert
/// widths), routed experts in the latent width 3584 with intermediate 3072, two shared
/// experts (6144), a dense first layer of 18432; but 4 layers (3 KDA, 1 MLA), 64 experts
/// top-8 and a 32768-token vocabulary, so that it fits one machine's disk (about 9 GB with
/// MXFP4 experts, 3.4 GB of them experts). Kernel shapes, bytes per expert and per layer
/// are K3's.
fn k3_width_config() -> Value {
    let mut cfg = crate::synth::kimi::kimi_config(true, [7168, 4, 64, 8, 3072, 18432, 64, 32768]);
    let text = &mut cfg["text_config"];
    for (k, v) in [
        ("q_lora_rank", json!(1536)),
        ("kv_lora_rank", json!(512)),
        ("qk_nope_head_dim", json!(128)),
        ("qk_rope_head_dim", json!(64)),
        ("v_head_dim", json!(128)),
        ("num_attention_heads", json!(64)),
        ("num_key_value_heads", json!(64)),
        ("routed_expert_hidden_size", json!(3584)),
        ("num_shared_experts", json!(2)),
    ] {
        text[k] = v;
    }
    text["linear_attn_config"]["num_heads"] = json!(96);
    text["linear_attn_config"]["head_dim"] = json!(128);
    cfg
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn k3_width_has_k3_widths_and_loads_as_a_config() {
        let cfg = preset_config("kimi_k3", "k3-width").unwrap();
        crate::config::ModelConfig::from_json(&cfg).unwrap();
        let tensors = crate::synth::tensors::tensors_for(&cfg).unwrap();
        let shape = |suffix: &str| {
            tensors
                .iter()
                .find(|t| t.spec.name.ends_with(suffix))
                .map(|t| t.spec.shape.clone())
                .unwrap_or_else(|| panic!("no tensor *{suffix}"))
        };
        // KDA 96 heads x 128 on hidden 7168.
        assert_eq!(shape("layers.0.self_attn.q_proj.weight"), [12288, 7168]);
        // Routed experts in the latent width 3584, intermediate 3072.
        assert_eq!(
            shape("layers.1.block_sparse_moe.experts.0.w1.weight"),
            [3072, 3584]
        );
        assert_eq!(
            shape("layers.1.block_sparse_moe.experts.0.w2.weight"),
            [3584, 3072]
        );
        // Two shared experts: 6144.
        assert_eq!(
            shape("layers.1.block_sparse_moe.shared_experts.gate_proj.weight"),
            [6144, 7168]
        );
        // The latent projections, and MLA (layer 4 of 4): kv_lora 512 + rope 64.
        assert_eq!(
            shape("layers.1.block_sparse_moe.routed_expert_down_proj.weight"),
            [3584, 7168]
        );
        assert_eq!(
            shape("layers.3.self_attn.kv_a_proj_with_mqa.weight"),
            [576, 7168]
        );
        assert!(preset_config("deepseek_v3", "k3-width").is_err());
    }
}
