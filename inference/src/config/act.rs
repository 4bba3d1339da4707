//! [`HiddenAct`]: the `hidden_act` of gated MLPs.

use serde::{Deserialize, Serialize};

use crate::config::fields::CResult;
use crate::error::ConfigError;

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
    pub(crate) fn parse(s: &str) -> CResult<Self> {
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
