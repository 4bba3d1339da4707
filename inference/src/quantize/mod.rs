//! Storing routed experts in packed formats while laying out: [`ExpertFormat`] (what each
//! format's tensors are called and how a config announces them) and [`QuantizeExperts`] (the
//! layout transform).

pub mod expert_format;
pub mod transform;

pub use expert_format::{
    expert_only_ignore, fp8_quantization_config, is_dense_projection, DenseFormats, ExpertFormat,
};
pub use transform::{QuantizeExperts, TensorQuantError};
