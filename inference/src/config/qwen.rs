//! [`Qwen3MoeConfig`]: Qwen3-MoE (`qwen3_moe`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::act::HiddenAct;
use crate::config::fields::{
    check_limits, check_norm_eps, parse_token_ids, positive, CResult, Fields,
};
use crate::config::rope::RopeParameters;
use crate::error::ConfigError;

/// Qwen3-MoE (`model_type` `qwen3_moe`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense MLP layers (`mlp_only_layers`).
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub hidden_act: HiddenAct,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub rope_parameters: RopeParameters,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    pub quantization_config: Option<Value>,
}

impl Qwen3MoeConfig {
    pub fn from_json(config: &Value) -> CResult<Self> {
        let obj = config.as_object().ok_or(ConfigError::NotAnObject)?;
        let f = Fields {
            obj,
            model_type: "qwen3_moe",
        };
        let hidden_size: usize = f.req("hidden_size")?;
        let num_attention_heads: usize = f.req("num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(ConfigError::invalid("num_attention_heads", "must be > 0"));
        }
        // transformers: absent => 4, null => num_attention_heads.
        let num_key_value_heads = match obj.get("num_key_value_heads") {
            None => 4,
            Some(Value::Null) => num_attention_heads,
            Some(_) => f.req("num_key_value_heads")?,
        };
        if f.or("use_sliding_window", false)? {
            return Err(ConfigError::unsupported(
                "use_sliding_window",
                "sliding-window attention",
            ));
        }
        let cfg = Qwen3MoeConfig {
            model_type: "qwen3_moe".into(),
            vocab_size: f.req("vocab_size")?,
            hidden_size,
            intermediate_size: f.req("intermediate_size")?,
            moe_intermediate_size: f.req("moe_intermediate_size")?,
            num_hidden_layers: f.req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim: f.or("head_dim", hidden_size / num_attention_heads)?,
            num_experts: f.req("num_experts")?,
            num_experts_per_tok: f.req("num_experts_per_tok")?,
            norm_topk_prob: f.or("norm_topk_prob", false)?,
            decoder_sparse_step: f.or("decoder_sparse_step", 1)?,
            mlp_only_layers: f.or("mlp_only_layers", Vec::new())?,
            hidden_act: HiddenAct::parse(&f.or("hidden_act", "silu".to_string())?)?,
            max_position_embeddings: f.or("max_position_embeddings", 32768)?,
            rms_norm_eps: f.or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: f.or("tie_word_embeddings", false)?,
            attention_bias: f.or("attention_bias", false)?,
            rope_parameters: RopeParameters::from_config(&f, 10000.0)?,
            bos_token_id: f.opt("bos_token_id")?,
            eos_token_id: parse_token_ids(&f, "eos_token_id")?,
            quantization_config: f.raw("quantization_config").cloned(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether decoder layer `layer` has a routed MoE (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.num_experts > 0
            && !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    fn validate(&self) -> CResult<()> {
        check_limits(&[
            ("num_hidden_layers", self.num_hidden_layers),
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("num_experts", self.num_experts),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ])?;
        if let Some(&l) = self
            .mlp_only_layers
            .iter()
            .find(|&&l| l >= self.num_hidden_layers)
        {
            return Err(ConfigError::invalid(
                "mlp_only_layers",
                format!(
                    "layer {l} does not exist (num_hidden_layers is {})",
                    self.num_hidden_layers
                ),
            ));
        }
        positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ])?;
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ConfigError::invalid(
                "num_key_value_heads",
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ConfigError::invalid("head_dim", "must be even for RoPE"));
        }
        if self.num_experts > 0 {
            positive(&[
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("num_experts_per_tok", self.num_experts_per_tok),
            ])?;
            if self.num_experts_per_tok > self.num_experts {
                return Err(ConfigError::invalid(
                    "num_experts_per_tok",
                    format!(
                        "{} > num_experts {}",
                        self.num_experts_per_tok, self.num_experts
                    ),
                ));
            }
        }
        let has_dense = (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l));
        if has_dense && self.intermediate_size == 0 {
            return Err(ConfigError::invalid(
                "intermediate_size",
                "must be > 0 (dense layers exist)",
            ));
        }
        check_norm_eps("rms_norm_eps", self.rms_norm_eps)?;
        Ok(())
    }
}
