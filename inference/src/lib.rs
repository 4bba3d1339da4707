//! deltafin-inference: CPU forward pass for DeepSeek-V3 / Kimi K2 and Qwen3-MoE.

pub mod arch;
pub mod config;
pub mod error;
pub mod ffn;
pub mod linear;
mod loader;
pub mod mixer;
pub mod model;
pub mod ops;
pub mod rope;
pub mod weights;

pub use config::{DeepseekV3Config, ModelConfig, Qwen3MoeConfig, RopeParameters};
pub use error::{ConfigError, InferenceError, Result};
pub use model::{ForwardTrace, Logits, LogitsMode, Model, Session};
pub use weights::{DirSource, ExpertPartRef, ExpertView, TensorRef, WeightSource};
