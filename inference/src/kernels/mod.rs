//! Weight-format kernels: `y = W x` for one input (matvec, decode) or a few (matmul, up to 16
//! rows per weight pass), organised like `memchr`: one portable reference in [`scalar`], one
//! AVX2+FMA(+F16C) implementation in `x86` chosen at run time with `is_x86_feature_detected!`,
//! one NEON implementation in `aarch64` (compiled only there), and a scalar fallback.
//!
//! Every implementation works on one weight row at a time: `row_dot(row bytes, row scales,
//! inputs) -> [n]`. The driver ([`matmul`]) splits the rows into rayon tasks, converts each
//! task's scales to f32 once (so every kernel reads plain f32 scales), prepares the inputs once
//! per call, and picks the implementation.
//!
//! Two activation precisions ([`Act`]):
//! - [`Act::F32`]: inputs stay f32, weights are dequantized in registers and multiplied in f32.
//!   This is what the model uses (fixture logits stay within 1e-4 of the f32 reference).
//! - [`Act::I8`]: for the integer formats (INT4, MXFP4, Q8), inputs are quantized on the fly to
//!   int8 per 32-value block (absmax / 127, like llama.cpp's Q8_0) and the dot products run in
//!   integer arithmetic (`vpmaddubsw`/`vpmaddwd`), scaled per block. Relative error stays within
//!   about 1% of the output's norm; other formats ignore it and run in f32. Too coarse for the
//!   fixtures' 1e-3 tolerance (measured 5.9e-3 on `deepseek_v3_int4`), so only opt-in
//!   (`DELTAFIN_ACTIVATIONS=i8`, llama.cpp's precision for its quantized formats). On x86 the
//!   same 8-bit values go through the [`Act::I16`] kernels as their high plane, the low one
//!   zero and skipped ([`I16Inputs::hi_only`]): half the `vpdpbusd` / `vpmaddubsw`, prefill of
//!   a 512-token INT4 prompt 1.06-1.20x faster than [`Act::I16`] on Zen 4.
//! - [`Act::I16`]: the integer formats again, inputs quantized to 16 bits per 32-value block and
//!   held as two int8 planes (`x ~ d * (256 * hi + lo)`), so one AVX-512 VNNI `vpdpbusd` per
//!   plane does 64 multiply-adds. About 256x finer than `I8` (half a step is amax / 65024) and,
//!   with VNNI, as fast as the memory system; [`model_act`] picks it for the integer formats
//!   when the AVX-512 kernels run. There the 4-bit formats' inputs are stored in
//!   [`I16Order::Groups`]: a group of 16 blocks transposed so that one 32-bit lane sums a
//!   whole block, scaled once per block (prefill of a 512-token INT4 prompt about 1.2x); on
//!   AVX2 in [`I16Order::Groups8`], groups of 8 blocks for the 8 lanes of a ymm.
//! - [`Act::Bf16`]: opt-in (`DELTAFIN_ACTIVATIONS=bf16`), BF16 weights only, x86_64 with AVX-512
//!   BF16: inputs rounded to BF16 and multiplied by `vdpbf16ps` (`x86_avx512_bf16`), llama.cpp's
//!   BF16 precision at twice the f32 multiply rate; beyond the fixtures' tolerance (about 2x), so
//!   never the default. Without AVX-512 BF16 it is f32.
//! - [`Act::Bf16x2`]: opt-in (`DELTAFIN_AMX=on`), BF16 weights on CPUs with AMX-BF16 (`x86_amx`):
//!   each f32 input split into two BF16 values (`hi + lo`, about 2^-17 relative, within the
//!   fixtures' tolerance; denormals read as zero, as the tiles do), multiplied by `tdpbf16ps`
//!   tiles for one input and many alike (one path, so decode equals prefill bit for bit). A
//!   512-token BF16 prefill runs 1.64x faster, a 32-token one 1.19x, a decode step 7% slower:
//!   tiles of 16 rows stream a matrix from DRAM slower than the f32 path's row-by-row reads
//!   (`benches/results/amx_session35.txt`), hence not the default.
//!
//! Files: [`isa`] (instruction sets, [`KernelConfig`]), [`shape`] (the 32-column block),
//! [`inputs`] / [`quantize_inputs`] / `prepare` (inputs prepared once per call), [`scales`] (scales as f32),
//! [`dispatch`] (per-row dispatch; `tasks`: rows per task and the transposed scratch; `avx2_rows`: a task's rows on AVX2, `avx2_dense`:
//! its register tiles for the unscaled formats), [`jobs`] (many products in one pass), and the per-ISA kernels [`scalar`], `x86`,
//! `x86_avx512`, `aarch64`.
//!
//! [`Isa::Avx512`] (AVX-512 F/BW/VL/VNNI) has its own kernels for the f32 path of the 16-bit and
//! FP8 formats and for [`Act::I16`]; for the rest it runs the AVX2 kernels (an AVX-512 machine
//! has AVX2). [`Isa::Avx512Bw`] (AVX-512 without VNNI: Skylake-SP and the like) runs the same
//! kernels, the 16-bit tiles compiled a second time without VNNI with `vpdpbusd`'s integers
//! made of `vpmaddubsw` / `vpmaddwd` (bit-identical outputs), except Q8's matrix products,
//! which take the AVX2 kernels there (`Isa::for_format`: a third of the operations).

#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod avx2_decode;
#[cfg(target_arch = "x86_64")]
mod avx2_dense;
#[cfg(target_arch = "x86_64")]
mod avx2_q8;
#[cfg(target_arch = "x86_64")]
mod avx2_rows;
pub(crate) mod bf16;
pub mod dispatch;
pub mod inputs;
pub mod isa;
pub mod jobs;
pub mod pool;
pub(crate) mod prepare;
pub mod quantize_inputs;
pub mod scalar;
pub mod scales;
pub mod shape;
pub(crate) mod tasks;
pub mod vector;
pub mod vector_decode;
pub mod vector_tiles;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_amx;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_avx512_bf16;

pub use dispatch::{matmul, matmul_many_with, matmul_with};
pub use inputs::{i16_slot, I16Inputs, I16Order, Inputs};
pub use isa::{Act, Isa, KernelConfig};
pub use jobs::{matmul_jobs, MatmulJob};
pub use quantize_inputs::{quantize_inputs, quantize_inputs_i16, quantize_inputs_i8_planes};
pub use shape::{KernelShape, BLOCK};
