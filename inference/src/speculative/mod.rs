//! Speculative decoding: a [`Drafter`] proposes `k` tokens, one batched forward pass of the
//! target over the pending token and the `k` drafts verifies them (each MoE layer reads the
//! union of the positions' experts once), rejected positions are rolled back with
//! [`Session::truncate`] (no copy).
//!
//! Lossless: with greedy sampling the output is exactly the target's greedy output; with
//! temperature > 0 drafts are accepted with the speculative-sampling rule (accept `d` with
//! probability `min(1, p(d) / q(d))`, otherwise sample from `norm(max(0, p - q))`), so every
//! emitted token is distributed as the target's sampler would draw it. `p` is the target
//! sampler's distribution (after temperature / top-k / top-p); deterministic drafters have a
//! one-hot `q`.
//!
//! `k` adapts ([`KController`]): it keeps an estimate of the per-token acceptance probability
//! `a` and the measured wall time of a step with `k` drafts (drafting + verification, which on
//! streamed models grows with `k` as more experts are read), and picks the `k` maximising
//! expected tokens per second, `(1 - a^(k+1)) / (1 - a) / cost(k)`; `k = 0` is a plain decode
//! step. When drafting does not pay it is switched off and re-probed with exponential backoff.
//!
//! Files: [`drafters`], [`controller`] (choosing `k`), [`accept`] (the acceptance rule),
//! [`generate`] (the loop).

pub mod accept;
pub mod controller;
pub mod drafters;
pub mod generate;

pub use accept::accept_or_resample;
pub use controller::KController;
pub use drafters::{Draft, Drafter, ModelDrafter, NgramDrafter, ReplayDrafter};
pub use generate::{speculative_generate, SpecConfig, SpecStats};
