//! [`KimiConfig`]: Kimi Linear (`kimi_linear`) and Kimi K3 (`kimi_k3`: the text model's config
//! in `text_config`, its tensors under `language_model.`).
//!
//! Every key of the text config must be known: a key this engine does not implement could
//! change the model's math, so an unknown one is refused by name rather than ignored.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::fields::{
    check_finite, check_grouped_routing, check_limits, check_norm_eps, parse_token_ids, positive,
    CResult, Fields, RoutingKeys,
};
use crate::error::ConfigError;

/// Keys of a Kimi text config this engine implements or knows to be without effect on the
/// forward pass (bookkeeping, training-only, or ignored by the reference implementation).
const KNOWN_KEYS: &[&str] = &[
    // implemented
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "num_expert_group",
    "topk_group",
    "moe_renormalize",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "moe_layer_freq",
    "moe_router_activation_func",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "linear_attn_config",
    "mla_use_nope",
    "mla_use_output_gate",
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "attention_bias",
    "max_position_embeddings",
    "model_max_length",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "quantization_config",
    "topk_method",
    "use_grouped_topk",
    // no effect on the forward pass
    "model_type",
    "architectures",
    "auto_map",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "initializer_range",
    "use_cache",
    "num_nextn_predict_layers",
    "attention_dropout",
    "router_aux_loss_coef",
    "output_router_logits",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "use_bfloat16",
];

/// Keys of `linear_attn_config`.
const KNOWN_LINEAR_KEYS: &[&str] = &[
    "kda_layers",
    "full_attn_layers",
    "head_dim",
    "num_heads",
    "short_conv_kernel_size",
    "use_full_rank_gate",
    "gate_lower_bound",
];

/// The activation of the gated MLPs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum KimiAct {
    Silu,
    /// SiTU: `[beta * tanh(g / beta) * sigmoid(g)] * [linear_beta * tanh(u / linear_beta)]`
    /// (the up branch unclipped without `linear_beta`).
    Situ {
        beta: f64,
        linear_beta: Option<f64>,
    },
}

/// How the router turns logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RouterScore {
    Sigmoid,
    Softmax,
}

/// Kimi Linear / Kimi K3 text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KimiConfig {
    /// `kimi_linear` or `kimi_k3` (the wrapper's).
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub kv_lora_rank: usize,
    pub q_lora_rank: Option<usize>,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub num_expert_group: usize,
    pub topk_group: usize,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f64,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub router_score: RouterScore,
    pub act: KimiAct,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// 0-based decoder layers that are KDA (the rest are MLA).
    pub kda_layers: Vec<usize>,
    pub kda_head_dim: usize,
    pub kda_num_heads: usize,
    pub short_conv_kernel_size: usize,
    pub kda_full_rank_gate: bool,
    /// K3's safe gate: `g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`.
    pub gate_lower_bound: Option<f64>,
    pub mla_output_gate: bool,
    pub attn_res_block_size: Option<usize>,
    pub routed_expert_hidden_size: Option<usize>,
    pub latent_moe_use_norm: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    pub quantization_config: Option<Value>,
}

/// The text model's config object: `text_config` of a `kimi_k3` wrapper, else the config.
pub fn text_config(config: &Value) -> CResult<&Map<String, Value>> {
    let obj = config.as_object().ok_or(ConfigError::NotAnObject)?;
    match obj.get("model_type").and_then(Value::as_str) {
        Some("kimi_k3") => obj
            .get("text_config")
            .and_then(Value::as_object)
            .ok_or_else(|| ConfigError::MissingField {
                model_type: "kimi_k3".into(),
                field: "text_config".into(),
            }),
        _ => Ok(obj),
    }
}

fn refuse_unknown(obj: &Map<String, Value>, known: &[&str], prefix: &str) -> CResult<()> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ConfigError::unsupported(
            format!("{prefix}{k}"),
            "an unknown key; it may change the model's math, so it is refused rather than \
             ignored",
        )),
        None => Ok(()),
    }
}

/// A 1-indexed layer list of `linear_attn_config` as 0-based layers.
fn layer_list(f: &Fields<'_>, name: &str, layers: usize) -> CResult<Vec<usize>> {
    let field = format!("linear_attn_config.{name}");
    let list: Vec<usize> = f.or(name, Vec::new())?;
    let mut out = Vec::with_capacity(list.len());
    for l in list {
        if l == 0 || l > layers {
            return Err(ConfigError::invalid(
                field,
                format!("layer {l} is not in 1..={layers} (the lists are 1-indexed)"),
            ));
        }
        if out.contains(&(l - 1)) {
            return Err(ConfigError::invalid(
                field,
                format!("layer {l} is listed twice"),
            ));
        }
        out.push(l - 1);
    }
    Ok(out)
}

impl KimiConfig {
    pub fn from_json(config: &Value) -> CResult<Self> {
        let wrapper = config.as_object().ok_or(ConfigError::NotAnObject)?;
        let model_type = wrapper
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or(ConfigError::MissingModelType)?
            .to_string();
        let obj = text_config(config)?;
        let prefix = if model_type == "kimi_k3" {
            "text_config."
        } else {
            ""
        };
        refuse_unknown(obj, KNOWN_KEYS, prefix)?;
        let f = Fields {
            obj,
            model_type: &model_type,
        };
        let layers: usize = f.req("num_hidden_layers")?;
        let lin = match f.raw("linear_attn_config") {
            Some(v) => v
                .as_object()
                .ok_or_else(|| ConfigError::invalid("linear_attn_config", "expected an object"))?,
            None => &Map::new(),
        };
        refuse_unknown(
            lin,
            KNOWN_LINEAR_KEYS,
            &format!("{prefix}linear_attn_config."),
        )?;
        let lf = Fields {
            obj: lin,
            model_type: &model_type,
        };
        let kda_layers = layer_list(&lf, "kda_layers", layers)?;
        let full = layer_list(&lf, "full_attn_layers", layers)?;
        for l in 0..layers {
            match (kda_layers.contains(&l), full.contains(&l)) {
                (true, true) => {
                    return Err(ConfigError::invalid(
                        "linear_attn_config",
                        format!("layer {} is both a KDA and a full-attention layer", l + 1),
                    ))
                }
                (false, false) if !lin.is_empty() => {
                    return Err(ConfigError::invalid(
                        "linear_attn_config",
                        format!(
                            "layer {} is in neither kda_layers nor full_attn_layers",
                            l + 1
                        ),
                    ))
                }
                _ => {}
            }
        }
        let act = match f.or("hidden_act", "silu".to_string())?.as_str() {
            "silu" | "swish" => KimiAct::Silu,
            "situ" => {
                let beta = f.or("activation_situ_beta", 1.0f64)?;
                let beta = if beta == 0.0 { 1.0 } else { beta };
                let linear_beta: Option<f64> = f.opt("activation_situ_linear_beta")?;
                for (k, v) in [
                    ("activation_situ_beta", Some(beta)),
                    ("activation_situ_linear_beta", linear_beta),
                ] {
                    if v.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
                        return Err(ConfigError::invalid(k, "must be a finite number > 0"));
                    }
                }
                KimiAct::Situ { beta, linear_beta }
            }
            other => {
                return Err(ConfigError::unsupported(
                    "hidden_act",
                    format!("activation `{other}` (Kimi models use silu or situ)"),
                ))
            }
        };
        let router_score = match f
            .or("moe_router_activation_func", "sigmoid".to_string())?
            .as_str()
        {
            "sigmoid" => RouterScore::Sigmoid,
            "softmax" => RouterScore::Softmax,
            other => {
                return Err(ConfigError::unsupported(
                    "moe_router_activation_func",
                    format!("`{other}` (sigmoid or softmax)"),
                ))
            }
        };
        if let Some(m) = f.opt::<String>("topk_method")? {
            if m != "noaux_tc" {
                return Err(ConfigError::unsupported(
                    "topk_method",
                    format!("`{m}` (Kimi models select noaux_tc-style)"),
                ));
            }
        }
        if !f.or("mla_use_nope", true)? {
            return Err(ConfigError::unsupported(
                "mla_use_nope",
                "false (rotary MLA in a Kimi model)",
            ));
        }
        let num_attention_heads: usize = f.req("num_attention_heads")?;
        let kv_heads: usize = f.or("num_key_value_heads", num_attention_heads)?;
        if kv_heads != num_attention_heads {
            return Err(ConfigError::invalid(
                "num_key_value_heads",
                format!("{kv_heads}; MLA needs num_attention_heads ({num_attention_heads})"),
            ));
        }
        let max_pos = match f.opt::<usize>("max_position_embeddings")? {
            Some(m) => m,
            None => f.or("model_max_length", 131072)?,
        };
        let cfg = KimiConfig {
            model_type: model_type.clone(),
            vocab_size: f.req("vocab_size")?,
            hidden_size: f.req("hidden_size")?,
            intermediate_size: f.or("intermediate_size", 0)?,
            moe_intermediate_size: f.or("moe_intermediate_size", 0)?,
            num_hidden_layers: layers,
            num_attention_heads,
            kv_lora_rank: f.req("kv_lora_rank")?,
            q_lora_rank: f.opt("q_lora_rank")?,
            qk_nope_head_dim: f.req("qk_nope_head_dim")?,
            qk_rope_head_dim: f.req("qk_rope_head_dim")?,
            v_head_dim: f.req("v_head_dim")?,
            num_experts: f.or("num_experts", 0)?,
            num_experts_per_token: f.or("num_experts_per_token", 0)?,
            num_shared_experts: f.or("num_shared_experts", 0)?,
            num_expert_group: f.or("num_expert_group", 1)?,
            topk_group: f.or("topk_group", 1)?,
            moe_renormalize: f.or("moe_renormalize", true)?,
            routed_scaling_factor: f.or("routed_scaling_factor", 1.0)?,
            first_k_dense_replace: f.or("first_k_dense_replace", 0)?,
            moe_layer_freq: f.or("moe_layer_freq", 1)?,
            router_score,
            act,
            rms_norm_eps: f.or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: f.or("tie_word_embeddings", false)?,
            attention_bias: f.or("attention_bias", false)?,
            kda_head_dim: if kda_layers.is_empty() {
                0
            } else {
                lf.req("head_dim")?
            },
            kda_num_heads: if kda_layers.is_empty() {
                0
            } else {
                lf.req("num_heads")?
            },
            short_conv_kernel_size: if kda_layers.is_empty() {
                0
            } else {
                lf.or("short_conv_kernel_size", 4)?
            },
            kda_full_rank_gate: lf.or("use_full_rank_gate", false)?,
            gate_lower_bound: lf.opt("gate_lower_bound")?,
            kda_layers,
            mla_output_gate: f.or("mla_use_output_gate", false)?,
            attn_res_block_size: f.opt("attn_res_block_size")?,
            routed_expert_hidden_size: f.opt("routed_expert_hidden_size")?,
            latent_moe_use_norm: f.or("latent_moe_use_norm", false)?,
            max_position_embeddings: max_pos,
            bos_token_id: f.opt("bos_token_id")?,
            eos_token_id: parse_token_ids(&f, "eos_token_id")?,
            quantization_config: f.raw("quantization_config").cloned(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether decoder layer `layer` is a KDA (linear attention) layer; the rest are MLA.
    pub fn is_kda_layer(&self, layer: usize) -> bool {
        self.kda_layers.contains(&layer)
    }

    /// Whether decoder layer `layer` has a routed MoE (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.num_experts > 0
            && layer >= self.first_k_dense_replace
            && layer.is_multiple_of(self.moe_layer_freq)
    }

    /// The tensor-name prefix of the language model (`language_model.` for K3).
    pub fn prefix(&self) -> &'static str {
        if self.model_type == "kimi_k3" {
            "language_model."
        } else {
            ""
        }
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
            ("max_position_embeddings", self.max_position_embeddings),
        ])?;
        positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("moe_layer_freq", self.moe_layer_freq),
        ])?;
        if self.qk_nope_head_dim + self.qk_rope_head_dim == 0 {
            return Err(ConfigError::invalid(
                "qk_nope_head_dim",
                "qk_nope_head_dim + qk_rope_head_dim must be > 0",
            ));
        }
        if self.q_lora_rank == Some(0) {
            return Err(ConfigError::invalid("q_lora_rank", "must be > 0 or null"));
        }
        if !self.kda_layers.is_empty() {
            positive(&[
                ("linear_attn_config.head_dim", self.kda_head_dim),
                ("linear_attn_config.num_heads", self.kda_num_heads),
                (
                    "linear_attn_config.short_conv_kernel_size",
                    self.short_conv_kernel_size,
                ),
            ])?;
        }
        if let Some(lb) = self.gate_lower_bound {
            if !(lb.is_finite() && lb < 0.0) {
                return Err(ConfigError::invalid(
                    "linear_attn_config.gate_lower_bound",
                    format!("{lb} is not a finite number < 0"),
                ));
            }
        }
        let has_moe = (0..self.num_hidden_layers).any(|l| self.is_moe_layer(l));
        let has_dense = (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l));
        if has_dense && self.intermediate_size == 0 {
            return Err(ConfigError::invalid(
                "intermediate_size",
                "must be > 0 (dense layers exist)",
            ));
        }
        if has_moe {
            positive(&[
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("num_experts_per_token", self.num_experts_per_token),
                ("num_expert_group", self.num_expert_group),
                ("topk_group", self.topk_group),
            ])?;
            // Groups are scored only when some are dropped.
            let grouped = self.num_expert_group > 1 && self.num_expert_group > self.topk_group;
            check_grouped_routing(
                &RoutingKeys {
                    experts: "num_experts",
                    top_k: "num_experts_per_token",
                    groups: "num_expert_group",
                },
                self.num_experts,
                self.num_experts_per_token,
                self.num_expert_group,
                self.topk_group,
                grouped,
            )?;
        }
        if self.routed_expert_hidden_size == Some(0) {
            return Err(ConfigError::invalid(
                "routed_expert_hidden_size",
                "must be > 0 or null",
            ));
        }
        if self.attn_res_block_size == Some(0) {
            return Err(ConfigError::invalid(
                "attn_res_block_size",
                "must be > 0 or null",
            ));
        }
        check_norm_eps("rms_norm_eps", self.rms_norm_eps)?;
        check_finite("routed_scaling_factor", self.routed_scaling_factor)?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn k3() -> Value {
        let text: Value = serde_json::from_str(include_str!(
            "../../../testdata/fixtures/kimi_k3_a/config.json"
        ))
        .unwrap();
        text
    }

    #[test]
    fn k3_fixture_parses() {
        let c = KimiConfig::from_json(&k3()).unwrap();
        assert_eq!(c.kda_layers, vec![0, 1, 2, 4, 5]);
        assert!(!c.is_kda_layer(3) && !c.is_moe_layer(0) && c.is_moe_layer(1));
        assert_eq!(c.gate_lower_bound, Some(-5.0));
        assert!(c.kda_full_rank_gate && c.mla_output_gate && c.latent_moe_use_norm);
        assert_eq!(c.attn_res_block_size, Some(3));
        assert_eq!(c.routed_expert_hidden_size, Some(32));
        assert_eq!(
            c.act,
            KimiAct::Situ {
                beta: 4.0,
                linear_beta: Some(25.0)
            }
        );
        assert_eq!(c.prefix(), "language_model.");
    }

    #[test]
    fn unknown_and_bad_keys_are_refused_by_name() {
        let mut v = k3();
        v["text_config"]["use_magic_gate"] = true.into();
        let e = KimiConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("text_config.use_magic_gate"), "{e}");
        let mut v = k3();
        v["text_config"]["linear_attn_config"]["gate_upper_bound"] = 1.0.into();
        let e = KimiConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("linear_attn_config.gate_upper_bound"), "{e}");
        let mut v = k3();
        v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 5]);
        let e = KimiConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("layer 6") && e.contains("neither"), "{e}");
        let mut v = k3();
        v["text_config"]["linear_attn_config"]["gate_lower_bound"] = 0.5.into();
        assert!(KimiConfig::from_json(&v).is_err());
        let mut v = k3();
        v["text_config"]["mla_use_nope"] = false.into();
        let e = KimiConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("mla_use_nope"), "{e}");
        let mut v = k3();
        v["text_config"]["hidden_act"] = "gelu".into();
        assert!(KimiConfig::from_json(&v).is_err());
    }
}
