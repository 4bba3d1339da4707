//! deltafin-inference: a CPU forward pass for DeepSeek-V3 / Kimi K2 (`deepseek_v3`, `kimi_k2`),
//! Qwen3-MoE (`qwen3_moe`), Kimi Linear (`kimi_linear`) and Kimi K3 (`kimi_k3`) that matches
//! the reference implementations (f32 compute from BF16/F16/F32, block-FP8, INT4
//! pack-quantized, MXFP4 or Q8 weights).
//!
//! # Using it
//!
//! ```no_run
//! use std::sync::Arc;
//! use deltafin_inference::{generate, DirSource, GenerateConfig, Model, SamplerConfig};
//!
//! # fn main() -> deltafin_inference::Result<()> {
//! // Any WeightSource works; DirSource reads a Hugging Face model directory.
//! let source = Arc::new(DirSource::open(std::path::Path::new("/models/kimi-k2"))?);
//! let model = Model::load(source)?;
//!
//! // Logits for every position of a prompt: Logits { rows, vocab, data }.
//! let mut session = model.new_session();
//! let logits = model.forward(&mut session, &[1, 2, 3])?;
//! let _last_row: Option<&[f32]> = logits.last();
//!
//! // Cached decoding: one position per call; roll back with truncate (no copy).
//! let next = model.forward_last(&mut session, &[4])?; // [vocab]
//! session.truncate(3)?;
//! # let _ = next;
//!
//! // Streaming generation with a sampler and stop tokens (EOS ids from config.json).
//! let mut config = GenerateConfig::for_model(&model, 64);
//! config.sampler = SamplerConfig { temperature: 0.7, top_k: 40, top_p: 0.95, seed: 1 };
//! let mut session = model.new_session();
//! let out = generate(&model, &mut session, &[1, 2, 3], &config, &mut |tok| {
//!     print!("{tok} ");
//!     true // keep going
//! })?;
//! println!("{:?} ({:?})", out.tokens, out.stop);
//! # Ok(()) }
//! ```
//!
//! # Pieces
//!
//! - [`config`]: [`ModelConfig`] / [`DeepseekV3Config`] / [`Qwen3MoeConfig`] /
//!   [`config::KimiConfig`] (Kimi Linear and Kimi K3, whose `text_config` is unwrapped) with
//!   Hugging Face field names and transformers' defaults; both `rope_scaling`
//!   (`type`/`rope_type`) and transformers-5 `rope_parameters`. Errors name the field
//!   ([`ConfigError`]); a Kimi key this crate does not implement is refused by name.
//! - [`weights`]: the [`WeightSource`] trait the forward pass reads through: resident tensors by
//!   name, routed experts per layer through a callback ([`ExpertView`] = parts relative to
//!   `model.layers.L.mlp.experts.E.`, or fused `gate_up_proj`/`down_proj` slices).
//!   [`DirSource`] implements it over `deltafin_storage::checkpoint::Checkpoint`.
//! - [`layout_source`]: [`LayoutSource`], a [`WeightSource`] over a deltafin layout on 1-4
//!   drives: the resident set is read once into memory at open, routed experts are read through
//!   the storage engine's demand lane per layer and handed over in landing order.
//! - [`linear`]: [`linear::WeightMatrix`] (borrowed, dtype-tagged bytes) and [`linear::Linear`]
//!   (owned) with rayon-parallel f32-accumulating `matvec`/`matmul`; formats are
//!   [`linear::WeightFormat`] variants decoded row by row.
//! - [`mixer`]: token mixers ([`mixer::TokenMixer`]) each owning its per-sequence state type
//!   ([`mixer::MixerState`]): [`mixer::MlaAttention`] (DeepSeek MLA; caches the normalised
//!   latent and the rope key, `kv_b_proj` absorbed; Kimi's NoPE variant with an output gate),
//!   [`mixer::GqaAttention`] (Qwen3: q/k norm, GQA, caches K/V) and [`mixer::KdaAttention`]
//!   (Kimi Delta Attention: short convolutions, per-channel forget gate, gated delta rule; a
//!   fixed-size recurrent state per head that rolls back by replaying recorded positions).
//! - [`ffn`]: [`ffn::FeedForward`] modules: [`ffn::DenseMlp`] and [`ffn::MoeFfn`] with a pluggable
//!   [`ffn::Router`] ([`ffn::NoauxTcRouter`] for DeepSeek-V3, [`ffn::SoftmaxTopKRouter`] for
//!   Qwen3) and optional shared experts and latent projection (Kimi K3's latent MoE).
//!   Activations are [`ops::Activation`] trait objects (SiLU, GELU, Kimi K3's SiTU).
//! - [`model`]: [`Model`], [`Session`], [`model::DecoderLayer`] and the [`model::ResidualMixer`]
//!   trait (plain residual add by default; Kimi K3's block attention residuals in
//!   `model/attn_res.rs`). New architectures assemble
//!   [`model::ModelParts`] and call [`Model::from_parts`]; [`arch`] holds the builders.
//! - [`rope`]: default / linear / YaRN / llama3 frequencies, interleaved or half-split layout.
//! - [`sampler`] and [`generate()`]: greedy, temperature, top-k, top-p with a seeded PCG32.
//!
//! Every failure caused by input (config, tensor names/shapes/dtypes, token ids, a source that
//! cannot deliver an expert) is an [`InferenceError`]; a failed forward leaves the session as it
//! was before the call.

pub mod arch;
pub mod config;
pub mod digest;
pub mod error;
pub mod family;
pub mod ffn;
pub mod generate;
pub mod kernels;
pub mod layout_source;
pub mod linear;
mod loader;
pub mod mixer;
pub mod model;
pub mod ops;
pub mod quantize;
pub mod rope;
pub mod run;
pub mod sampler;
pub mod scratch;
pub mod snapshot;
pub mod spans;
pub mod speculative;
pub mod streamed_layer;
pub mod synth;
pub mod warm;
pub mod weights;

pub use config::{DeepseekV3Config, HiddenAct, ModelConfig, Qwen3MoeConfig, RopeParameters};
pub use deltafin_storage::store::{CachePolicy, FetchStats, LoadProgress, StoreStats, StreamStats};
pub use error::{ConfigError, InferenceError, Result};
pub use generate::{generate, GenerateConfig, GenerateOutput, StopReason};
pub use kernels::KernelConfig;
pub use layout_source::{LayoutSource, LayoutSourceOptions};
pub use model::{ForwardTrace, Logits, LogitsMode, Model, Session};
pub use sampler::{Rng, Sampler, SamplerConfig};
pub use weights::{DirSource, ExpertPartRef, ExpertView, TensorRef, WeightSource};
