//! Token mixers: the per-layer sequence-mixing module. Each mixer owns the type of its
//! per-sequence state and creates it with [`TokenMixer::new_state`]; the model keeps one boxed
//! state per layer in a [`crate::Session`].
//!
//! - [`mla`]: Multi-head Latent Attention (DeepSeek-V3 / Kimi K2 with RoPE; Kimi Linear / K3
//!   without, K3 with an output gate); caches the latent per position.
//! - [`gqa`]: grouped-query attention (Qwen3-MoE); caches K and V per position.
//! - [`kda`]: Kimi Delta Attention, linear attention with a fixed-size recurrent state
//!   ([`kda_state`]) updated by the gated delta rule ([`delta_rule`]).
//! - [`state`]: the [`TokenMixer`] and [`MixerState`] traits.

pub mod delta_rule;
pub mod gqa;
pub mod kda;
pub mod kda_state;
pub mod mla;
pub mod state;

pub use gqa::{GqaAttention, KvCache};
pub use kda::KdaAttention;
pub use kda_state::KdaState;
pub use mla::{MlaAttention, MlaCache, QProj};
pub use state::{MixerState, TokenMixer};
