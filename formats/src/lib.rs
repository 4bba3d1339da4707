//! deltafin-formats: what the bytes of a weight tensor mean, shared by the storage crate (which
//! parses and lays out tensors) and the inference crate (which computes with them).
//!
//! - [`dtype`]: [`Dtype`], the safetensors element types.
//! - [`format`]: [`WeightFormat`] (how a matrix's bytes encode its values) and [`ScaleType`],
//!   with every byte size computed in checked arithmetic.
//! - [`codec`]: scalar decoders (FP8 e4m3, E8M0, E2M1, BF16/F16) shared by the kernels'
//!   reference path and the quantizers.
//! - [`quantize`]: round-to-nearest quantizers producing exactly the bytes each format ships as,
//!   with the error they make.

pub mod codec;
pub mod dtype;
pub mod format;
pub mod quantize;

pub use dtype::Dtype;
pub use format::{ScaleType, WeightFormat};
