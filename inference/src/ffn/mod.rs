//! Feed-forward modules: dense gated MLPs and routed Mixture-of-Experts, with pluggable routers.
//!
//! ```text
//! DenseMlp:  down(act(gate(x), up(x)))                               [n, hidden]
//! MoE:       sum_k w_k * expert_{e_k}(x) (+ shared_experts(x))       [n, hidden]
//! ```
//! Routed experts are not held by the model: [`MoeFfn`] asks the [`WeightSource`] for the experts
//! the router chose and computes each one as soon as the source hands it over.
//!
//! Files: [`feed_forward`] (the trait), [`dense`] ([`DenseMlp`]), [`router`] (routers and
//! [`Routing`]), [`moe`] ([`MoeFfn`]: routing, delivery, the weighted sum), [`routed_experts`]
//! ([`RoutedExperts`], a layer's routed experts computed from their records, matrices resolved
//! once per layer).

pub mod dense;
pub mod feed_forward;
pub mod moe;
pub mod routed_experts;
pub mod router;

pub use dense::DenseMlp;

pub use feed_forward::{FeedForward, FfnContext};
pub use moe::{ExpertMatrixNames, MoeFfn, RoutedExperts};
pub use router::{top_k_indices, NoauxTcRouter, Router, Routing, SoftmaxTopKRouter};
