//! Model families: what the rest of the system needs to know about an architecture besides its
//! forward pass — which `model_type`s exist and how a checkpoint names its routed experts (the
//! storage crate lays out and reads records through that naming; it knows no family itself).

use deltafin_storage::naming::ExpertNaming;
use serde_json::Value;

use crate::error::ConfigError;

/// `model_type`s this engine runs.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "deepseek_v3",
    "kimi_k2",
    "qwen3_moe",
    "kimi_linear",
    "kimi_k3",
];

/// The config's `model_type`, if this engine runs it.
pub fn model_type(config: &Value) -> Result<&str, ConfigError> {
    let t = config
        .as_object()
        .ok_or(ConfigError::NotAnObject)?
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or(ConfigError::MissingModelType)?;
    if SUPPORTED_MODEL_TYPES.contains(&t) {
        Ok(t)
    } else {
        Err(ConfigError::UnsupportedModelType(t.to_string()))
    }
}

/// The prefix of the language model's tensor names (`language_model.` for Kimi K3's
/// multimodal wrapper, else nothing).
pub fn text_prefix(config: &Value) -> &'static str {
    match config.get("model_type").and_then(Value::as_str) {
        Some("kimi_k3") => "language_model.",
        _ => "",
    }
}

/// How checkpoints of this config's family name their per-layer and routed-expert tensors.
pub fn expert_naming(config: &Value) -> Result<ExpertNaming, ConfigError> {
    let fused = |key: &str| config.get(key).and_then(Value::as_u64);
    match model_type(config)? {
        "deepseek_v3" | "kimi_k2" => Ok(ExpertNaming {
            fused_experts: fused("n_routed_experts"),
            ..ExpertNaming::hf("mlp.experts.")
        }),
        "qwen3_moe" => Ok(ExpertNaming {
            fused_experts: fused("num_experts"),
            ..ExpertNaming::hf("mlp.experts.")
        }),
        "kimi_linear" => Ok(ExpertNaming {
            fused_experts: fused("num_experts"),
            ..ExpertNaming::hf("block_sparse_moe.experts.")
        }),
        "kimi_k3" => {
            let text = crate::config::kimi::text_config(config)?;
            Ok(ExpertNaming {
                layers_prefix: "language_model.model.layers.".into(),
                experts_prefix: "block_sparse_moe.experts.".into(),
                fused_experts: text.get("num_experts").and_then(Value::as_u64),
                skipped_prefixes: vec!["vision_tower.".into(), "mm_projector.".into()],
            })
        }
        other => Err(ConfigError::UnsupportedModelType(other.to_string())),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn families_and_refusals() {
        let n = expert_naming(&json!({"model_type": "kimi_k2", "n_routed_experts": 8})).unwrap();
        assert_eq!(n.fused_experts, Some(8));
        assert!(matches!(
            expert_naming(&json!({"model_type": "llama"})),
            Err(ConfigError::UnsupportedModelType(t)) if t == "llama"
        ));
        assert!(matches!(
            model_type(&json!({})),
            Err(ConfigError::MissingModelType)
        ));
    }
}
