//! [`DeepseekV3Config`]: DeepSeek-V3 and Kimi K2 (`deepseek_v3`, `kimi_k2`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::act::HiddenAct;
use crate::config::fields::{
    check_finite, check_grouped_routing, check_limits, check_norm_eps, parse_token_ids, positive,
    CResult, Fields, RoutingKeys,
};
use crate::config::rope::RopeParameters;
use crate::error::ConfigError;

/// DeepSeek-V3 / Kimi K2 (`model_type` `deepseek_v3` or `kimi_k2`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense MLP layers.
    pub intermediate_size: usize,
    /// Width of one routed expert.
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Unused by MLA (every head has its own keys); kept for completeness.
    pub num_key_value_heads: usize,
    pub n_shared_experts: usize,
    pub n_routed_experts: usize,
    pub routed_scaling_factor: f64,
    pub kv_lora_rank: usize,
    /// `None` (JSON null): queries come from `q_proj` directly.
    pub q_lora_rank: Option<usize>,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub qk_nope_head_dim: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub norm_topk_prob: bool,
    pub hidden_act: HiddenAct,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// RoPE on interleaved pairs (2i, 2i+1); transformers' default for DeepSeek-V3.
    pub rope_interleave: bool,
    pub rope_parameters: RopeParameters,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    pub scoring_func: Option<String>,
    pub topk_method: Option<String>,
    pub quantization_config: Option<Value>,
}

impl DeepseekV3Config {
    pub fn from_json(config: &Value) -> CResult<Self> {
        let obj = config.as_object().ok_or(ConfigError::NotAnObject)?;
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("deepseek_v3")
            .to_string();
        let f = Fields {
            obj,
            model_type: &model_type,
        };
        let num_attention_heads: usize = f.req("num_attention_heads")?;
        let q_lora_rank = if obj.contains_key("q_lora_rank") {
            f.opt("q_lora_rank")?
        } else {
            Some(1536)
        };
        let cfg = DeepseekV3Config {
            model_type: model_type.clone(),
            vocab_size: f.req("vocab_size")?,
            hidden_size: f.req("hidden_size")?,
            intermediate_size: f.req("intermediate_size")?,
            moe_intermediate_size: f.req("moe_intermediate_size")?,
            num_hidden_layers: f.req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: f.or("num_key_value_heads", num_attention_heads)?,
            n_shared_experts: f.or(
                "n_shared_experts",
                if obj.contains_key("n_shared_experts") {
                    0
                } else {
                    1
                },
            )?,
            n_routed_experts: f.req("n_routed_experts")?,
            routed_scaling_factor: f.or("routed_scaling_factor", 2.5)?,
            kv_lora_rank: f.req("kv_lora_rank")?,
            q_lora_rank,
            qk_rope_head_dim: f.req("qk_rope_head_dim")?,
            v_head_dim: f.req("v_head_dim")?,
            qk_nope_head_dim: f.req("qk_nope_head_dim")?,
            n_group: f.or("n_group", 8)?,
            topk_group: f.or("topk_group", 4)?,
            num_experts_per_tok: f.req("num_experts_per_tok")?,
            first_k_dense_replace: f.or("first_k_dense_replace", 3)?,
            moe_layer_freq: f.or("moe_layer_freq", 1)?,
            norm_topk_prob: f.or("norm_topk_prob", true)?,
            hidden_act: HiddenAct::parse(&f.or("hidden_act", "silu".to_string())?)?,
            max_position_embeddings: f.or("max_position_embeddings", 4096)?,
            rms_norm_eps: f.or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: f.or("tie_word_embeddings", false)?,
            attention_bias: f.or("attention_bias", false)?,
            rope_interleave: f.or("rope_interleave", true)?,
            rope_parameters: RopeParameters::from_config(&f, 10000.0)?,
            bos_token_id: f.opt("bos_token_id")?,
            eos_token_id: parse_token_ids(&f, "eos_token_id")?,
            scoring_func: f.opt("scoring_func")?,
            topk_method: f.opt("topk_method")?,
            quantization_config: f.raw("quantization_config").cloned(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// q·k width per head (`qk_nope_head_dim + qk_rope_head_dim`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether decoder layer `layer` has a routed MoE (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts > 0
            && layer >= self.first_k_dense_replace
            && layer.is_multiple_of(self.moe_layer_freq.max(1))
    }

    fn validate(&self) -> CResult<()> {
        check_limits(&[
            ("num_hidden_layers", self.num_hidden_layers),
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("n_routed_experts", self.n_routed_experts),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ])?;
        // The router this crate implements: sigmoid scores with noaux_tc group selection.
        if let Some(f) = &self.scoring_func {
            if f != "sigmoid" {
                return Err(ConfigError::unsupported(
                    "scoring_func",
                    format!("`{f}` (this build implements `sigmoid`)"),
                ));
            }
        }
        if let Some(m) = &self.topk_method {
            if m != "noaux_tc" {
                return Err(ConfigError::unsupported(
                    "topk_method",
                    format!("`{m}` (this build implements `noaux_tc`)"),
                ));
            }
        }
        positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("moe_layer_freq", self.moe_layer_freq),
        ])?;
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(ConfigError::invalid("qk_rope_head_dim", "must be even"));
        }
        if self.qk_head_dim() == 0 {
            return Err(ConfigError::invalid(
                "qk_nope_head_dim",
                "qk_nope_head_dim + qk_rope_head_dim is 0",
            ));
        }
        if self.q_lora_rank == Some(0) {
            return Err(ConfigError::invalid("q_lora_rank", "must be > 0 or null"));
        }
        if self.n_routed_experts > 0 {
            positive(&[
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("num_experts_per_tok", self.num_experts_per_tok),
                ("n_group", self.n_group),
                ("topk_group", self.topk_group),
            ])?;
            check_grouped_routing(
                &RoutingKeys {
                    experts: "n_routed_experts",
                    top_k: "num_experts_per_tok",
                    groups: "n_group",
                },
                self.n_routed_experts,
                self.num_experts_per_tok,
                self.n_group,
                self.topk_group,
                self.n_group > 1,
            )?;
        }
        check_norm_eps("rms_norm_eps", self.rms_norm_eps)?;
        check_finite("routed_scaling_factor", self.routed_scaling_factor)?;
        Ok(())
    }
}
