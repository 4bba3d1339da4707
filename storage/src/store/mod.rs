//! The expert store: what the inference crate reads a layout through.
//!
//! - [`expert_store`]: [`ExpertStore`] — open a layout, load its resident set, `fetch` a
//!   layer's routed experts (an [`ExpertBatch`] in landing order) and `prefetch` predicted ones.
//! - [`batch`]: one fetch in progress.
//! - [`cache`]: [`ExpertCache`], the byte budget and eviction policy (no I/O; tested on routing
//!   traces).
//! - [`gate`]: [`PrefetchGate`], scoring predictions and gating prefetch on their precision.
//! - [`resident`]: [`ResidentSet`], the resident tensors in memory.
//! - [`stats`]: [`FetchStats`], [`StoreStats`], [`LoadProgress`].

pub mod batch;
pub mod cache;
pub mod expert_store;
pub mod gate;
pub mod resident;
pub mod stats;

pub use batch::{ExpertBatch, LandedExpert};
pub use cache::{CachePolicy, ExpertCache};
pub use expert_store::{ExpertStore, StoreOptions};
pub use gate::PrefetchGate;
pub use resident::ResidentSet;
pub use stats::{FetchStats, LoadProgress, StoreStats};
