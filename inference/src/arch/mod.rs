//! Architecture builders: map a config and Hugging Face tensor names onto the generic
//! [`DecoderLayer`] pieces. One file per family ([`deepseek`], [`qwen`], [`kimi`]); [`parts`] holds the
//! pieces they share.
//!
//! A family gives a [`LayerBuilder`] (one decoder layer from a loader: the model's resident
//! weights at load, or a streamed layer's weights at every forward) and the parts around the
//! layers.

pub mod deepseek;
pub mod kimi;
pub mod layer_builder;
pub mod parts;
pub mod qwen;

pub use deepseek::deepseek_rope_and_scale;
pub use qwen::qwen_rope_and_scale;

use crate::arch::deepseek::{deepseek_v3_parts, DeepseekLayers};
use crate::arch::kimi::{kimi_parts, KimiLayers};
use crate::arch::layer_builder::LayerBuilder;
pub use crate::arch::layer_builder::LayerFactory;
use crate::arch::qwen::{qwen3_moe_parts, QwenLayers};
use crate::config::ModelConfig;
use crate::error::{InferenceError, Result};
use crate::kernels::isa::KernelConfig;
use crate::linear::resolve::QuantHints;
use crate::loader::Loader;
use crate::model::{LayerShape, LayerSlot, ModelParts};
use crate::weights::WeightSource;

/// Build the parts of any supported architecture, every matrix on `kernels`. Layers the source
/// streams ([`WeightSource::streamed_layers`]) are built once from their weights, to check them
/// and learn their state's shape, and kept as [`LayerSlot::Streamed`].
pub fn build(
    config: ModelConfig,
    src: &dyn WeightSource,
    kernels: KernelConfig,
) -> Result<(ModelParts, LayerFactory)> {
    let hints = QuantHints::from_config(config.quantization_config());
    let naming = crate::family::expert_naming(src.config())?;
    let prefix = crate::family::text_prefix(src.config());
    let ld = Loader {
        src,
        hints,
        kernels,
        naming: naming.clone(),
        prefix,
    };
    let builder: Box<dyn LayerBuilder> = match &config {
        ModelConfig::DeepseekV3(c) => Box::new(DeepseekLayers::new(c)?),
        ModelConfig::Qwen3Moe(c) => Box::new(QwenLayers::new(c)?),
        ModelConfig::Kimi(c) => Box::new(KimiLayers::new(c)),
    };
    let factory = LayerFactory::new(builder, hints, kernels, naming, prefix);
    let streamed = src.streamed_layers();
    let mut layers = Vec::with_capacity(config.num_hidden_layers());
    for l in 0..config.num_hidden_layers() {
        if streamed.contains(&l) {
            let weights = src.layer_weights(l, true)?.ok_or_else(|| {
                InferenceError::InvalidArgument(format!(
                    "decoder layer {l} is streamed but its weights could not be read"
                ))
            })?;
            let layer = factory.build(&*weights, l)?;
            layers.push(LayerSlot::Streamed(LayerShape::of(&layer)));
        } else {
            layers.push(LayerSlot::Resident(factory.build_with(&ld, l)?));
        }
    }
    let parts = match &config {
        ModelConfig::DeepseekV3(c) => deepseek_v3_parts(c, &ld, config.clone(), layers)?,
        ModelConfig::Qwen3Moe(c) => qwen3_moe_parts(c, &ld, config.clone(), layers)?,
        ModelConfig::Kimi(c) => kimi_parts(c, &ld, config.clone(), layers)?,
    };
    Ok((parts, factory))
}
