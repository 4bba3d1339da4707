//! deltafin-storage: lay Mixture-of-Experts checkpoints out over 1-4 drives and read routed
//! experts back at the drives' combined bandwidth.
//!
//! - [`safetensors`]: parse untrusted safetensors headers, write new files.
//! - [`checkpoint`]: a Hugging Face model directory; [`naming`] and [`expert_parts`]: which of
//!   its tensors form routed experts (the naming comes from the caller: no model family here).
//! - [`checkpoint_writer`]: write a checkpoint from a tensor plan (synthetic models).
//! - [`stripe`]: where logical bytes live on the drives (replicate / stripe).
//! - [`manifest`]: the versioned layout manifest; [`record_hash`]: what a landed record is
//!   checked against.
//! - [`layout`]: writing a layout; opening one from any drive. [`lock`]: per-drive advisory
//!   locks on a layout name.
//! - [`buffer`]: aligned buffers and a capped pool.
//! - [`backend`]: the swappable I/O backend (real O_DIRECT files, fault injection).
//! - [`engine`]: per-drive `pread` workers, priority lanes, completion handles.
//! - [`store`]: the expert store (cache, budget, prefetch) the inference crate reads through.
//! - [`verify`]: check every byte of a layout; [`layout_repair`]: make a mirror's drives whole
//!   again from good copies. [`bench`]: read benchmarks. [`timeline`]: an opt-in trace of
//!   reads, waits and compute phases on one clock.

pub mod backend;
pub mod bench;
pub mod buffer;
pub mod checkpoint;
pub mod checkpoint_writer;
pub mod clock;
pub mod engine;
pub mod error;
pub mod expert_parts;
pub mod layout;
pub mod layout_repair;
pub mod lock;
pub mod manifest;
pub mod naming;
pub mod paced_backend;
pub mod record_hash;
pub mod safetensors;
pub mod store;
pub mod stripe;
pub mod timeline;
pub mod verify;

pub use error::{Result, SafetensorsError, StorageError};
