//! Reading typed fields from a `config.json` object, naming the field in every error.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ConfigError;

pub(crate) type CResult<T> = std::result::Result<T, ConfigError>;

/// Reads typed fields from a config object, naming the field in every error.
pub(crate) struct Fields<'a> {
    pub obj: &'a Map<String, Value>,
    pub model_type: &'a str,
}

impl<'a> Fields<'a> {
    /// The value of `name`, treating JSON null as absent.
    pub fn raw(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    pub fn parse<T: DeserializeOwned>(&self, name: &str, v: &Value) -> CResult<T> {
        serde_json::from_value(v.clone())
            .map_err(|e| ConfigError::invalid(name, format!("{e} (got {})", truncate_json(v))))
    }

    pub fn req<T: DeserializeOwned>(&self, name: &str) -> CResult<T> {
        match self.raw(name) {
            Some(v) => self.parse(name, v),
            None => Err(ConfigError::MissingField {
                model_type: self.model_type.to_string(),
                field: name.to_string(),
            }),
        }
    }

    pub fn opt<T: DeserializeOwned>(&self, name: &str) -> CResult<Option<T>> {
        self.raw(name).map(|v| self.parse(name, v)).transpose()
    }

    pub fn or<T: DeserializeOwned>(&self, name: &str, default: T) -> CResult<T> {
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
pub(crate) fn parse_token_ids(f: &Fields<'_>, name: &str) -> CResult<Vec<u32>> {
    match f.raw(name) {
        None => Ok(Vec::new()),
        Some(Value::Array(_)) => f.req::<Vec<u32>>(name),
        Some(_) => Ok(vec![f.req::<u32>(name)?]),
    }
}

pub(crate) fn positive(fields: &[(&str, usize)]) -> CResult<()> {
    for &(name, v) in fields {
        if v == 0 {
            return Err(ConfigError::invalid(name, "must be > 0"));
        }
    }
    Ok(())
}

/// A norm epsilon must be a finite number >= 0.
pub(crate) fn check_norm_eps(name: &str, eps: f64) -> CResult<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(name, "must be a finite number >= 0"))
    }
}

/// A scale factor must be finite.
pub(crate) fn check_finite(name: &str, v: f64) -> CResult<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(ConfigError::invalid(name, "must be finite"))
    }
}

/// Config keys of a grouped top-k router (they differ between families).
pub(crate) struct RoutingKeys {
    pub experts: &'static str,
    pub top_k: &'static str,
    pub groups: &'static str,
}

/// A grouped top-k router can pick `top_k` of `experts` split into `groups`, keeping
/// `topk_group` groups; `group_scored` when groups are scored (by their top-2 experts' sum)
/// and dropped, which needs 2 experts per group.
pub(crate) fn check_grouped_routing(
    keys: &RoutingKeys,
    experts: usize,
    top_k: usize,
    groups: usize,
    topk_group: usize,
    group_scored: bool,
) -> CResult<()> {
    if top_k > experts {
        return Err(ConfigError::invalid(
            keys.top_k,
            format!("{top_k} > {} {experts}", keys.experts),
        ));
    }
    if groups == 0 || !experts.is_multiple_of(groups) {
        return Err(ConfigError::invalid(
            keys.groups,
            format!(
                "{} {experts} is not a multiple of {} {groups}",
                keys.experts, keys.groups
            ),
        ));
    }
    if topk_group > groups {
        return Err(ConfigError::invalid(
            "topk_group",
            format!("topk_group {topk_group} > {} {groups}", keys.groups),
        ));
    }
    let per_group = experts / groups;
    if group_scored && per_group < 2 {
        return Err(ConfigError::invalid(
            keys.groups,
            "each group needs at least 2 experts",
        ));
    }
    if group_scored && top_k > topk_group * per_group {
        return Err(ConfigError::invalid(
            keys.top_k,
            format!("{top_k} experts cannot be chosen from {topk_group} groups of {per_group}"),
        ));
    }
    Ok(())
}

/// Upper limits on sizes read from a config, far above every released model: a config over
/// one is refused before anything is allocated for it (a corrupt or hostile `config.json` must
/// not abort the process with a failed allocation).
pub(crate) const LIMITS: &[(&str, usize)] = &[
    ("num_hidden_layers", 4096),
    ("hidden_size", 1 << 17),
    ("vocab_size", 1 << 24),
    ("n_routed_experts", 1 << 16),
    ("num_experts", 1 << 16),
    ("intermediate_size", 1 << 20),
    ("moe_intermediate_size", 1 << 20),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("max_position_embeddings", 1 << 24),
];

/// Every `(field, value)` within [`LIMITS`].
pub(crate) fn check_limits(fields: &[(&str, usize)]) -> CResult<()> {
    for &(name, v) in fields {
        if let Some(&(_, max)) = LIMITS.iter().find(|(n, _)| *n == name) {
            if v > max {
                return Err(ConfigError::invalid(
                    name,
                    format!("{v} is over the {max} this build accepts"),
                ));
            }
        }
    }
    Ok(())
}
