//! Model configurations, with the field names Hugging Face `config.json` files use.
//!
//! Parse with [`ModelConfig::from_json`] (or the per-architecture `from_json`): it applies the
//! defaults transformers applies, names the field at fault in every error and validates the
//! shapes the forward pass relies on. The structs also derive serde so they can be written back.
//!
//! Fields that decide the shape of the weights (sizes, head dims, expert counts) are required;
//! behavioural fields (norm eps, scaling factors, routing groups, rope) take transformers'
//! defaults when absent.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::ConfigError;

type CResult<T> = std::result::Result<T, ConfigError>;

/// Reads typed fields from a config object, naming the field in every error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    model_type: &'a str,
}

impl<'a> Fields<'a> {
    /// The value of `name`, treating JSON null as absent.
    fn raw(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn parse<T: DeserializeOwned>(&self, name: &str, v: &Value) -> CResult<T> {
        serde_json::from_value(v.clone())
            .map_err(|e| ConfigError::invalid(name, format!("{e} (got {})", truncate_json(v))))
    }

    fn req<T: DeserializeOwned>(&self, name: &str) -> CResult<T> {
        match self.raw(name) {
            Some(v) => self.parse(name, v),
            None => Err(ConfigError::MissingField {
                model_type: self.model_type.to_string(),
                field: name.to_string(),
            }),
        }
    }

    fn opt<T: DeserializeOwned>(&self, name: &str) -> CResult<Option<T>> {
        self.raw(name).map(|v| self.parse(name, v)).transpose()
    }

    fn or<T: DeserializeOwned>(&self, name: &str, default: T) -> CResult<T> {
        Ok(self.opt(name)?.unwrap_or(default))
    }
}

fn truncate_json(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        let mut end = 60;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    } else {
        s
    }
}

/// Token ids that end generation (`eos_token_id` may be one id or a list).
fn parse_token_ids(f: &Fields<'_>, name: &str) -> CResult<Vec<u32>> {
    match f.raw(name) {
        None => Ok(Vec::new()),
        Some(Value::Array(_)) => f.req::<Vec<u32>>(name),
        Some(_) => Ok(vec![f.req::<u32>(name)?]),
    }
}

/// The RoPE variant and its parameters, after merging `rope_theta`, `rope_scaling` (with
/// `type` or `rope_type`) and transformers-5 `rope_parameters`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// `default`, `linear` or `yarn` (`llama3` also accepted).
    pub rope_type: String,
    pub rope_theta: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_fast: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_slow: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale_all_dim: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
}

impl RopeParameters {
    pub fn default_with_theta(theta: f64) -> Self {
        RopeParameters {
            rope_type: "default".into(),
            rope_theta: theta,
            factor: None,
            original_max_position_embeddings: None,
            beta_fast: None,
            beta_slow: None,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: None,
            partial_rotary_factor: None,
            low_freq_factor: None,
            high_freq_factor: None,
        }
    }

    /// Merge the config's rope fields the way transformers' `standardize_rope_params` does.
    fn from_config(f: &Fields<'_>, default_theta: f64) -> CResult<Self> {
        let top_theta: Option<f64> = f.opt("rope_theta")?;
        let (field, dict) = if let Some(v) = f.raw("rope_parameters") {
            ("rope_parameters", Some(v))
        } else {
            ("rope_scaling", f.raw("rope_scaling"))
        };
        let mut p = RopeParameters::default_with_theta(top_theta.unwrap_or(default_theta));
        let Some(dict) = dict else { return Ok(p) };
        let obj = dict
            .as_object()
            .ok_or_else(|| ConfigError::invalid(field, "expected an object or null"))?;
        let sub = Fields {
            obj,
            model_type: f.model_type,
        };
        let name = |k: &str| format!("{field}.{k}");
        let get_f64 = |k: &str| -> CResult<Option<f64>> {
            sub.raw(k)
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| ConfigError::invalid(name(k), "expected a number"))
                })
                .transpose()
        };
        // Per-layer-type dictionaries ({"full_attention": {...}}) are not used by these models.
        if obj.values().any(Value::is_object) {
            return Err(ConfigError::unsupported(
                field,
                "per-layer-type rope parameters",
            ));
        }
        let ty = sub.raw("rope_type").or_else(|| sub.raw("type"));
        p.rope_type = match ty {
            None => "default".into(),
            Some(v) => v
                .as_str()
                .ok_or_else(|| ConfigError::invalid(name("rope_type"), "expected a string"))?
                .to_string(),
        };
        if let Some(theta) = get_f64("rope_theta")? {
            p.rope_theta = theta;
        }
        p.factor = get_f64("factor")?;
        p.original_max_position_embeddings = get_f64("original_max_position_embeddings")?;
        p.beta_fast = get_f64("beta_fast")?;
        p.beta_slow = get_f64("beta_slow")?;
        p.mscale = get_f64("mscale")?;
        p.mscale_all_dim = get_f64("mscale_all_dim")?;
        p.attention_factor = get_f64("attention_factor")?;
        p.partial_rotary_factor = get_f64("partial_rotary_factor")?;
        p.low_freq_factor = get_f64("low_freq_factor")?;
        p.high_freq_factor = get_f64("high_freq_factor")?;
        p.truncate = sub
            .raw("truncate")
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| ConfigError::invalid(name("truncate"), "expected a bool"))
            })
            .transpose()?;
        match p.rope_type.as_str() {
            "default" => {}
            "linear" | "yarn" | "llama3" => {
                // YaRN may omit `factor` when it can be derived from
                // max_position_embeddings / original_max_position_embeddings.
                let derivable =
                    p.rope_type == "yarn" && p.original_max_position_embeddings.is_some();
                let factor = match p.factor {
                    Some(f) => f,
                    None if derivable => 1.0,
                    None => {
                        return Err(ConfigError::MissingField {
                            model_type: f.model_type.to_string(),
                            field: name("factor"),
                        })
                    }
                };
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(ConfigError::invalid(
                        name("factor"),
                        format!("{factor} is not > 0"),
                    ));
                }
                if p.rope_type == "llama3"
                    && (p.low_freq_factor.is_none() || p.high_freq_factor.is_none())
                {
                    return Err(ConfigError::MissingField {
                        model_type: f.model_type.to_string(),
                        field: name("low_freq_factor/high_freq_factor"),
                    });
                }
            }
            other => {
                return Err(ConfigError::unsupported(
                    name("rope_type"),
                    format!("rope type `{other}` (supported: default, linear, yarn, llama3)"),
                ))
            }
        }
        if let Some(o) = p.original_max_position_embeddings {
            if !(o.is_finite() && o > 0.0) {
                return Err(ConfigError::invalid(
                    name("original_max_position_embeddings"),
                    "must be > 0",
                ));
            }
        }
        for (k, v) in [("beta_fast", p.beta_fast), ("beta_slow", p.beta_slow)] {
            if v.is_some_and(|b| !(b.is_finite() && b >= 0.0)) {
                return Err(ConfigError::invalid(
                    name(k),
                    "must be a finite number >= 0",
                ));
            }
        }
        if !(p.rope_theta.is_finite() && p.rope_theta > 1.0) {
            return Err(ConfigError::invalid(
                "rope_theta",
                format!("{} is not > 1", p.rope_theta),
            ));
        }
        if let Some(r) = p.partial_rotary_factor {
            if r != 1.0 {
                return Err(ConfigError::unsupported(
                    name("partial_rotary_factor"),
                    format!("{r}"),
                ));
            }
        }
        Ok(p)
    }
}

/// `hidden_act`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HiddenAct {
    Silu,
    /// Exact (erf) GELU.
    Gelu,
    /// tanh-approximated GELU (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    Relu,
}

impl HiddenAct {
    fn parse(s: &str) -> CResult<Self> {
        Ok(match s {
            "silu" | "swish" => HiddenAct::Silu,
            "gelu" => HiddenAct::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => HiddenAct::GeluTanh,
            "relu" => HiddenAct::Relu,
            other => {
                return Err(ConfigError::unsupported(
                    "hidden_act",
                    format!("activation `{other}`"),
                ))
            }
        })
    }
}

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
            if !self.n_routed_experts.is_multiple_of(self.n_group) {
                return Err(ConfigError::invalid(
                    "n_group",
                    format!(
                        "n_routed_experts {} is not a multiple of n_group {}",
                        self.n_routed_experts, self.n_group
                    ),
                ));
            }
            if self.topk_group > self.n_group {
                return Err(ConfigError::invalid(
                    "topk_group",
                    format!("topk_group {} > n_group {}", self.topk_group, self.n_group),
                ));
            }
            let per_group = self.n_routed_experts / self.n_group;
            if per_group < 2 && self.n_group > 1 {
                return Err(ConfigError::invalid(
                    "n_group",
                    "each group needs at least 2 experts",
                ));
            }
            if self.num_experts_per_tok > self.topk_group * per_group {
                return Err(ConfigError::invalid(
                    "num_experts_per_tok",
                    format!(
                        "{} experts cannot be chosen from {} groups of {per_group}",
                        self.num_experts_per_tok, self.topk_group
                    ),
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(ConfigError::invalid(
                "rms_norm_eps",
                "must be a finite number >= 0",
            ));
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(ConfigError::invalid(
                "routed_scaling_factor",
                "must be finite",
            ));
        }
        Ok(())
    }
}

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
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(ConfigError::invalid(
                "rms_norm_eps",
                "must be a finite number >= 0",
            ));
        }
        Ok(())
    }
}

fn positive(fields: &[(&str, usize)]) -> CResult<()> {
    for &(name, v) in fields {
        if v == 0 {
            return Err(ConfigError::invalid(name, "must be > 0"));
        }
    }
    Ok(())
}

/// A parsed configuration of any supported architecture.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// `deepseek_v3` and `kimi_k2`.
    DeepseekV3(DeepseekV3Config),
    Qwen3Moe(Qwen3MoeConfig),
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
            other => Err(ConfigError::UnsupportedModelType(other.to_string())),
        }
    }

    pub fn model_type(&self) -> &str {
        match self {
            ModelConfig::DeepseekV3(c) => &c.model_type,
            ModelConfig::Qwen3Moe(c) => &c.model_type,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.vocab_size,
            ModelConfig::Qwen3Moe(c) => c.vocab_size,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.hidden_size,
            ModelConfig::Qwen3Moe(c) => c.hidden_size,
        }
    }

    pub fn num_hidden_layers(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.num_hidden_layers,
            ModelConfig::Qwen3Moe(c) => c.num_hidden_layers,
        }
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        match self {
            ModelConfig::DeepseekV3(c) => &c.eos_token_id,
            ModelConfig::Qwen3Moe(c) => &c.eos_token_id,
        }
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match self {
            ModelConfig::DeepseekV3(c) => c.is_moe_layer(layer),
            ModelConfig::Qwen3Moe(c) => c.is_moe_layer(layer),
        }
    }

    pub fn max_position_embeddings(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.max_position_embeddings,
            ModelConfig::Qwen3Moe(c) => c.max_position_embeddings,
        }
    }

    pub fn num_attention_heads(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.num_attention_heads,
            ModelConfig::Qwen3Moe(c) => c.num_attention_heads,
        }
    }

    /// Routed experts each position uses (0 without MoE layers).
    pub fn experts_per_token(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.num_experts_per_tok,
            ModelConfig::Qwen3Moe(c) => c.num_experts_per_tok,
        }
    }

    /// The widest MLP intermediate (dense or expert).
    pub fn widest_intermediate(&self) -> usize {
        match self {
            ModelConfig::DeepseekV3(c) => c.intermediate_size.max(c.moe_intermediate_size),
            ModelConfig::Qwen3Moe(c) => c.intermediate_size.max(c.moe_intermediate_size),
        }
    }

    pub fn quantization_config(&self) -> Option<&Value> {
        match self {
            ModelConfig::DeepseekV3(c) => c.quantization_config.as_ref(),
            ModelConfig::Qwen3Moe(c) => c.quantization_config.as_ref(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
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
