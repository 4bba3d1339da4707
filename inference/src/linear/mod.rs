//! Weight matrices over dtype-tagged byte buffers, and the f32-accumulating kernels behind them.
//!
//! A [`WeightMatrix`] borrows raw checkpoint bytes (a routed expert straight from its source);
//! a [`Linear`] owns them (resident weights, prepared once at load). Both compute `y = W x` with
//! `W` `[rows (out), cols (in)]` in the Hugging Face `nn.Linear` layout, on the kernels of the
//! [`KernelConfig`](crate::kernels::KernelConfig) they were loaded with.
//!
//! Formats are [`WeightFormat`]s (the `deltafin-formats` crate): F32, F16, BF16; DeepSeek block
//! FP8 (`weight` F8_E4M3 + `weight_scale_inv`); compressed-tensors `pack-quantized` INT4
//! (`weight_packed` I32 + `weight_scale`); compressed-tensors `mxfp4-pack-quantized`
//! (`weight_packed` U8 + E8M0 `weight_scale` U8); Q8 (`weight_packed` I8 + `weight_scale`).
//!
//! Files: [`matrix`] (borrowed, checked), [`owned`] ([`Linear`]), [`bytes`] (a `Linear`'s
//! bytes: its own or shared with the source), [`resolve`] (finding a matrix's tensors by name),
//! [`convert`] (whole tensors as f32).

pub mod bytes;
pub mod convert;
pub mod matrix;
pub mod owned;
pub mod resolve;

pub use crate::kernels::dispatch::matmul_many;
pub use bytes::{SharedBuffer, WeightBytes};
pub use convert::{dequantize, tensor_to_f32};
pub use deltafin_formats::{ScaleType, WeightFormat};
pub use matrix::WeightMatrix;
pub use owned::Linear;
pub use resolve::QuantHints;
