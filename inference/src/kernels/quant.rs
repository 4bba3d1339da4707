//! Round-to-nearest weight quantizers producing the packed bytes each format ships as, with
//! the error they introduce. They live in `deltafin_storage::formats` (so `synth` and
//! `layout --quantize-experts` encode with the same code the kernels here decode against);
//! this module re-exports them.

pub use deltafin_storage::formats::{
    f32_to_fp8_e4m3, quantize_fp8_block, quantize_int4, quantize_mxfp4, quantize_q8, QuantError,
    Quantized,
};
