//! Architecture builders: map a config and Hugging Face tensor names onto the generic
//! [`DecoderLayer`] pieces. One file per family ([`deepseek`], [`qwen`], [`kimi`]); [`parts`] holds the
//! pieces they share.

pub mod deepseek;
pub mod kimi;
pub mod parts;
pub mod qwen;

pub use deepseek::deepseek_rope_and_scale;
pub use qwen::qwen_rope_and_scale;

use crate::arch::deepseek::build_deepseek_v3;
use crate::arch::kimi::build_kimi;
use crate::arch::qwen::build_qwen3_moe;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kernels::isa::KernelConfig;
use crate::linear::resolve::QuantHints;
use crate::loader::Loader;
use crate::model::ModelParts;
use crate::weights::WeightSource;

/// Build the parts of any supported architecture, every matrix on `kernels`.
pub fn build(
    config: ModelConfig,
    src: &dyn WeightSource,
    kernels: KernelConfig,
) -> Result<ModelParts> {
    let hints = QuantHints::from_config(config.quantization_config());
    let naming = crate::family::expert_naming(src.config())?;
    let ld = Loader {
        src,
        hints,
        kernels,
        naming,
        prefix: crate::family::text_prefix(src.config()),
    };
    match &config {
        ModelConfig::DeepseekV3(c) => build_deepseek_v3(c, ld, config.clone()),
        ModelConfig::Qwen3Moe(c) => build_qwen3_moe(c, ld, config.clone()),
        ModelConfig::Kimi(c) => build_kimi(c, ld, config.clone()),
    }
}
