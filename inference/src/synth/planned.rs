//! Building blocks of a synthetic checkpoint's tensor list: a BF16 projection, a norm weight,
//! a vector, and reading a size from the config.

use deltafin_formats::Dtype;
use deltafin_storage::checkpoint_writer::{Fill, PlannedTensor};
use deltafin_storage::safetensors::TensorSpec;
use serde_json::Value;

use crate::error::{InferenceError, Result};

/// A non-negative integer field of a config.
pub(crate) fn field(cfg: &Value, key: &str) -> Result<u64> {
    cfg.get(key).and_then(Value::as_u64).ok_or_else(|| {
        InferenceError::InvalidArgument(format!(
            "config field `{key}` must be a non-negative integer"
        ))
    })
}

/// A BF16 `[out, inp]` projection, filled like a trained linear layer of fan-in `inp`.
pub(crate) fn lin(name: String, out: u64, inp: u64) -> PlannedTensor {
    PlannedTensor {
        spec: TensorSpec::new(name, Dtype::Bf16, &[out, inp]),
        fill: Fill::Linear { fan_in: inp },
    }
}

/// A BF16 norm weight of ones.
pub(crate) fn norm(name: String, n: u64) -> PlannedTensor {
    PlannedTensor {
        spec: TensorSpec::new(name, Dtype::Bf16, &[n]),
        fill: Fill::Constant(1.0),
    }
}

/// A `[n]` vector of `dtype` filled by `fill`.
pub(crate) fn vector(name: String, n: u64, dtype: Dtype, fill: Fill) -> PlannedTensor {
    PlannedTensor {
        spec: TensorSpec::new(name, dtype, &[n]),
        fill,
    }
}
