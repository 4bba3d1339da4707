//! The decoder: embeddings, a stack of [`DecoderLayer`]s (token mixer + feed-forward, each
//! pre-normed, joined by a [`ResidualMixer`]), the final norm and the LM head.
//!
//! Files: [`forward`] ([`Model`] and its forward pass), [`decoder`] (a layer and the parts a
//! model is built from), [`residual`] (how sub-block outputs are joined), [`session`]
//! (per-sequence state), [`logits`] (what a forward returns), [`routing_counts`] (expert choices
//! counted for `plan`), [`lookahead`] (the next layer's experts predicted from a layer's partial
//! output while it waits for its reads), [`boundary`] (the next token's first routed experts
//! guessed during the last layer's wait) and [`guess_cost`] (whether that guess is worth its
//! compute).

pub mod attn_res;
pub mod boundary;
pub mod decoder;
pub mod forward;
pub mod guess_cost;
pub mod layer_figures;
pub mod logits;
pub mod lookahead;
pub mod residual;
pub mod routing_counts;
pub mod session;

pub use attn_res::{AttnRes, AttnResQuery};
pub use decoder::{DecoderLayer, LayerShape, LayerSlot, ModelParts};
pub use forward::Model;
pub use logits::{ForwardTrace, Logits, LogitsMode};
pub use residual::{AddResidual, ResidualMixer};
pub use routing_counts::RoutingCounts;
pub use session::Session;
