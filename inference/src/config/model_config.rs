//! [`ModelConfig`]: a parsed configuration of any supported architecture, dispatched on
//! `model_type`.

use serde_json::Value;

use crate::config::deepseek::DeepseekV3Config;
use crate::config::fields::CResult;
use crate::config::kimi::KimiConfig;
use crate::config::qwen::Qwen3MoeConfig;
use crate::error::ConfigError;

/// A parsed configuration of any supported architecture.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// `deepseek_v3` and `kimi_k2`.
    DeepseekV3(DeepseekV3Config),
    Qwen3Moe(Qwen3MoeConfig),
    /// `kimi_linear` and `kimi_k3`.
    Kimi(KimiConfig),
}

impl ModelConfig {
    /// Parse a `config.json` value, dispatching on `model_type`.
    pub fn from_json(config: &Value) -> CResult<Self> {
        let obj = config.as_object().ok_or(ConfigError::NotAnObject)?;
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or(ConfigError::MissingModelType)?;
        match model_type {
            "deepseek_v3" | "kimi_k2" => Ok(ModelConfig::DeepseekV3(DeepseekV3Config::from_json(
                config,
            )?)),
            "qwen3_moe" => Ok(ModelConfig::Qwen3Moe(Qwen3MoeConfig::from_json(config)?)),
            "kimi_linear" | "kimi_k3" => Ok(ModelConfig::Kimi(KimiConfig::from_json(config)?)),
            other => Err(ConfigError::UnsupportedModelType(other.to_string())),
        }
    }

    pub fn model_type(&self) -> &str {
        match self {
            ModelConfig::DeepseekV3(c) => &c.model_type,
            ModelConfig::Qwen3Moe(c) => &c.model_type,
            ModelConfig::Kimi(c) => &c.model_type,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.vocab_size,
            ModelConfig::Qwen3Moe(c) => c.vocab_size,
            ModelConfig::Kimi(c) => c.vocab_size,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.hidden_size,
            ModelConfig::Qwen3Moe(c) => c.hidden_size,
            ModelConfig::Kimi(c) => c.hidden_size,
        }
    }

    pub fn num_hidden_layers(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.num_hidden_layers,
            ModelConfig::Qwen3Moe(c) => c.num_hidden_layers,
            ModelConfig::Kimi(c) => c.num_hidden_layers,
        }
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        match self {
            ModelConfig::DeepseekV3(c) => &c.eos_token_id,
            ModelConfig::Qwen3Moe(c) => &c.eos_token_id,
            ModelConfig::Kimi(c) => &c.eos_token_id,
        }
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match self {
            ModelConfig::DeepseekV3(c) => c.is_moe_layer(layer),
            ModelConfig::Qwen3Moe(c) => c.is_moe_layer(layer),
            ModelConfig::Kimi(c) => c.is_moe_layer(layer),
        }
    }

    pub fn max_position_embeddings(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.max_position_embeddings,
            ModelConfig::Qwen3Moe(c) => c.max_position_embeddings,
            ModelConfig::Kimi(c) => c.max_position_embeddings,
        }
    }

    pub fn num_attention_heads(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.num_attention_heads,
            ModelConfig::Qwen3Moe(c) => c.num_attention_heads,
            ModelConfig::Kimi(c) => c.num_attention_heads,
        }
    }

    /// Routed experts each position uses (0 without MoE layers).
    pub fn experts_per_token(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.num_experts_per_tok,
            ModelConfig::Qwen3Moe(c) => c.num_experts_per_tok,
            ModelConfig::Kimi(c) => c.num_experts_per_token,
        }
    }

    /// The widest MLP intermediate (dense or expert).
    pub fn widest_intermediate(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.intermediate_size.max(c.moe_intermediate_size),
            ModelConfig::Qwen3Moe(c) => c.intermediate_size.max(c.moe_intermediate_size),
            ModelConfig::Kimi(c) => c.intermediate_size.max(c.moe_intermediate_size),
        }
    }

    pub fn quantization_config(&self) -> Option<&Value> {
        match self {
            ModelConfig::DeepseekV3(c) => c.quantization_config.as_ref(),
            ModelConfig::Qwen3Moe(c) => c.quantization_config.as_ref(),
            ModelConfig::Kimi(c) => c.quantization_config.as_ref(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::deepseek::DeepseekV3Config;
    use crate::config::qwen::Qwen3MoeConfig;
    use serde_json::json;

    fn ds() -> Value {
        json!({
            "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
            "kv_lora_rank": 32, "q_lora_rank": null, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 4, "topk_group": 2,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
            "eos_token_id": [1, 2]
        })
    }

    #[test]
    fn deepseek_defaults_and_rope() {
        let c = DeepseekV3Config::from_json(&ds()).unwrap();
        assert_eq!(c.q_lora_rank, None);
        assert_eq!(c.n_shared_experts, 1);
        assert_eq!(c.first_k_dense_replace, 3);
        assert!(c.norm_topk_prob);
        assert!(c.rope_interleave);
        assert_eq!(c.rope_parameters.rope_type, "yarn");
        assert_eq!(c.rope_parameters.factor, Some(4.0));
        assert_eq!(c.eos_token_id, vec![1, 2]);
        assert!(!c.is_moe_layer(2));
        assert!(c.is_moe_layer(3));
    }

    #[test]
    fn rope_parameters_spelling() {
        let mut v = ds();
        let o = v.as_object_mut().unwrap();
        o.remove("rope_scaling");
        o.insert(
            "rope_parameters".into(),
            json!({"rope_type": "yarn", "rope_theta": 5e4, "factor": 2.0}),
        );
        let c = DeepseekV3Config::from_json(&v).unwrap();
        assert_eq!(c.rope_parameters.rope_theta, 5e4);
        assert_eq!(c.rope_parameters.factor, Some(2.0));
    }

    #[test]
    fn missing_and_invalid_fields_are_named() {
        let mut v = ds();
        v.as_object_mut().unwrap().remove("hidden_size");
        match DeepseekV3Config::from_json(&v) {
            Err(ConfigError::MissingField { field, .. }) => assert_eq!(field, "hidden_size"),
            other => panic!("{other:?}"),
        }
        let mut v = ds();
        v["kv_lora_rank"] = json!("big");
        match DeepseekV3Config::from_json(&v) {
            Err(ConfigError::InvalidField { field, .. }) => assert_eq!(field, "kv_lora_rank"),
            other => panic!("{other:?}"),
        }
        let mut v = ds();
        v["n_group"] = json!(3);
        assert!(matches!(
            DeepseekV3Config::from_json(&v),
            Err(ConfigError::InvalidField { field, .. }) if field == "n_group"
        ));
        let mut v = ds();
        v["rope_scaling"] = json!({"type": "yarn"});
        assert!(matches!(
            DeepseekV3Config::from_json(&v),
            Err(ConfigError::MissingField { field, .. }) if field == "rope_scaling.factor"
        ));
    }

    #[test]
    fn qwen_head_dim_default_and_layers() {
        let v = json!({
            "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 1, "num_experts": 8,
            "num_experts_per_tok": 2, "mlp_only_layers": [0], "decoder_sparse_step": 2
        });
        let c = Qwen3MoeConfig::from_json(&v).unwrap();
        assert_eq!(c.head_dim, 16);
        assert!(!c.norm_topk_prob);
        let moe: Vec<bool> = (0..4).map(|l| c.is_moe_layer(l)).collect();
        assert_eq!(moe, vec![false, true, false, true]);
        let mut bad = v.clone();
        bad["num_key_value_heads"] = json!(3);
        assert!(Qwen3MoeConfig::from_json(&bad).is_err());
    }

    #[test]
    fn model_type_dispatch() {
        assert!(matches!(
            ModelConfig::from_json(&json!({})),
            Err(ConfigError::MissingModelType)
        ));
        assert!(matches!(
            ModelConfig::from_json(&json!({"model_type": "llama"})),
            Err(ConfigError::UnsupportedModelType(_))
        ));
        let mut v = ds();
        v["model_type"] = json!("kimi_k2");
        assert!(matches!(
            ModelConfig::from_json(&v),
            Ok(ModelConfig::DeepseekV3(_))
        ));
    }
}
