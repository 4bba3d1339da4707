//! deltafin-storage: lay Mixture-of-Experts checkpoints out over 1-4 drives and read routed
//! experts back at the drives' combined bandwidth.
//!
//! - [`safetensors`]: parse untrusted safetensors headers, write new files.
//! - [`checkpoint`]: a Hugging Face model directory and its resident/expert split.
//! - [`formats`]: packed weight formats (FP8, INT4, MXFP4, Q8): decoders and RTN quantizers.
//! - [`synth`]: synthetic checkpoints in the real on-disk format.
//! - [`stripe`]: where logical bytes live on the drives (replicate / stripe).
//! - [`manifest`]: the versioned layout manifest.
//! - [`layout`]: writing a layout; opening one from any drive.
//! - [`buffer`]: aligned buffers and a capped pool.
//! - [`backend`]: the swappable I/O backend (real O_DIRECT files, fault injection).
//! - [`engine`]: per-drive `pread` workers, priority lanes, completion handles.
//! - [`verify`]: check every byte of a layout.

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
pub mod manifest;
pub mod naming;
pub mod safetensors;
pub mod store;
pub mod stripe;
pub mod verify;

pub use error::{Result, SafetensorsError, StorageError};
