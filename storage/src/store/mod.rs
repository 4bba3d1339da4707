//! The expert store: what the inference crate reads a layout through.
//!
//! - [`expert_store`]: [`ExpertStore`] — open a layout, load its resident set, the budget,
//!   the bound on reads outstanding, counters.
//! - [`reads`]: fetching (an [`ExpertBatch`] in landing order) and prefetching experts.
//! - [`cache`]: [`ExpertCache`], the byte budget and eviction policy (no I/O; tested on routing
//!   traces).
//! - [`gate`]: [`PrefetchGate`], scoring predictions and gating prefetch on their precision.
//! - [`resident`]: [`ResidentSet`], the resident tensors in memory.
//! - [`streamed`]: [`RecordStream`], resident records read again for every use, one group
//!   ahead (a layer's non-expert weights over a small RAM budget).
//! - [`stats`]: [`FetchStats`], [`StoreStats`], [`LoadProgress`].

pub mod cache;
pub mod expert_store;
pub mod gate;
pub mod reads;
pub mod resident;
pub mod stats;
pub mod streamed;

pub use cache::{CachePolicy, ExpertCache};
pub use expert_store::{ExpertStore, StoreOptions, MAX_OUTSTANDING_READS};
pub use gate::PrefetchGate;
pub use reads::{ExpertBatch, LandedExpert};
pub use resident::ResidentSet;
pub use stats::{FetchStats, LoadProgress, StoreStats};
pub use streamed::{LandedGroup, RecordStream, StreamGroup, StreamStats};
