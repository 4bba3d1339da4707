//! deltafin-storage: lay Mixture-of-Experts checkpoints out over 1-4 drives and read routed
//! experts back at the drives' combined bandwidth.
//!
//! - [`safetensors`]: parse untrusted safetensors headers, write new files.
//! - [`checkpoint`]: a Hugging Face model directory and its resident/expert split.

pub mod checkpoint;
pub mod error;
pub mod safetensors;

pub use error::{Result, SafetensorsError, StorageError};
