//! [`RopeParameters`]: `rope_theta`, `rope_scaling` (with `type` or `rope_type`) and
//! transformers-5 `rope_parameters`, merged the way transformers does.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::fields::{CResult, Fields};
use crate::error::ConfigError;

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

    /// Merge the config's rope fields the way transformers' `standardize_rope_params` does;
    /// `rope_theta` must be a finite number > 0.
    pub(crate) fn from_config(f: &Fields<'_>, default_theta: f64) -> CResult<Self> {
        let p = Self::merge(f, default_theta)?;
        if !(p.rope_theta.is_finite() && p.rope_theta > 0.0) {
            return Err(ConfigError::invalid(
                "rope_theta",
                format!("{} is not a finite number > 0", p.rope_theta),
            ));
        }
        Ok(p)
    }

    fn merge(f: &Fields<'_>, default_theta: f64) -> CResult<Self> {
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
