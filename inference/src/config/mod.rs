//! Model configurations, with the field names Hugging Face `config.json` files use.
//!
//! Parse with [`ModelConfig::from_json`] (or the per-architecture `from_json`): it applies the
//! defaults transformers applies, names the field at fault in every error and validates the
//! shapes the forward pass relies on. The structs also derive serde so they can be written back.
//!
//! Fields that decide the shape of the weights (sizes, head dims, expert counts) are required;
//! behavioural fields (norm eps, scaling factors, routing groups, rope) take transformers'
//! defaults when absent.
//!
//! Files: [`fields`] (typed reads naming the field), [`rope`], [`act`], one file per family
//! ([`deepseek`], [`qwen`], [`kimi`]) and [`model_config`] (the dispatch on `model_type`).

pub mod act;
pub mod deepseek;
pub mod fields;
pub mod kimi;
pub mod model_config;
pub mod qwen;
pub mod rope;

pub use act::HiddenAct;
pub use deepseek::DeepseekV3Config;
pub use kimi::{KimiAct, KimiConfig, RouterScore};
pub use model_config::ModelConfig;
pub use qwen::Qwen3MoeConfig;
pub use rope::RopeParameters;
