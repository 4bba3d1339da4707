//! Inputs as the kernels take them: f32 as given, rounded to BF16, reordered for the AVX-512
//! BF16 tiles, or quantized for the integer formats' 8- and 16-bit activation paths; prepared
//! once per pass, whatever number of matrices read them.

use deltafin_formats::WeightFormat;

use crate::kernels::inputs::Inputs;
use crate::kernels::isa::{Act, Isa};
use crate::kernels::quantize_inputs::{
    quantize_inputs, quantize_inputs_i16, quantize_inputs_i8_planes,
};
use crate::kernels::shape::KernelShape;
#[cfg(target_arch = "x86_64")]
use crate::kernels::x86_avx512;

/// `x` (`[n, cols]`) as the kernels for `kind` on `isa` take it: f32 as given, quantized for
/// the integer formats' 8- or 16-bit activation paths, or (AVX-512 BF16) reordered into
/// `slot`, each 32-block's even inputs then its odd ones.
pub(crate) fn prepare_inputs<'x>(
    isa: Isa,
    kind: WeightFormat,
    cols: usize,
    act: Act,
    x: &'x [f32],
    slot: &'x mut Vec<f32>,
) -> Inputs<'x> {
    match prepare_owned(isa, kind, cols, act, x) {
        Prepared::AsGiven => Inputs::F32(x),
        Prepared::RoundedToBf16 => Inputs::Bf16(x),
        Prepared::Reordered(v) => {
            *slot = v;
            Inputs::F32(slot)
        }
        Prepared::Quantized(q) => q,
        #[cfg(target_arch = "x86_64")]
        Prepared::Pairs(pairs) => Inputs::Bf16Pairs { x, pairs },
    }
}

/// [`prepare_inputs`]'s work with nothing borrowed, so that many inputs can be prepared on
/// the pool's threads.
pub(crate) enum Prepared {
    /// The kernels read `x` itself.
    AsGiven,
    /// The kernels read `x` itself and round it to BF16 ([`Act::Bf16`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by the x86 kernels only
    RoundedToBf16,
    /// `x` reordered (AVX-512 BF16).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by the x86 kernels only
    Reordered(Vec<f32>),
    /// `x` quantized (the integer formats' 8- and 16-bit paths).
    Quantized(Inputs<'static>),
    /// `x` split into BF16 pairs for the AMX tiles ([`Act::Bf16x2`]).
    #[cfg(target_arch = "x86_64")]
    Pairs(crate::kernels::x86_amx::Bf16Pairs),
}

/// See [`prepare_inputs`].
pub(crate) fn prepare_owned(
    isa: Isa,
    kind: WeightFormat,
    cols: usize,
    act: Act,
    x: &[f32],
) -> Prepared {
    let integer_ok = kind.integer() && kind.simd_shape(cols);
    match act {
        // AVX-512 and AVX2: the same 8-bit values in the 16-bit layout, whose kernels then skip
        // the low plane (on AVX2 half the `vpmaddubsw` of the 16-bit path, and a third of the
        // int8 kernel's per-block work: no sign/abs per product, one convert per two blocks);
        // elsewhere the int8 kernels' own layout.
        Act::I8 if integer_ok && i8_in_i16_layout(isa) => {
            return Prepared::Quantized(Inputs::I16(quantize_inputs_i8_planes(isa, kind, x, cols)))
        }
        Act::I8 if integer_ok => return Prepared::Quantized(quantize_inputs(kind, x, cols)),
        Act::I16 if integer_ok => {
            return Prepared::Quantized(Inputs::I16(quantize_inputs_i16(isa, kind, x, cols)))
        }
        _ => {}
    }
    #[cfg(target_arch = "x86_64")]
    if act == Act::Bf16x2 && kind == WeightFormat::Bf16 && kind.simd_shape(cols) {
        return Prepared::Pairs(crate::kernels::x86_amx::Bf16Pairs::new(x, cols));
    }
    #[cfg(target_arch = "x86_64")]
    if act == Act::Bf16 && kind == WeightFormat::Bf16 && kind.simd_shape(cols) {
        return Prepared::RoundedToBf16;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() && kind == WeightFormat::Bf16 && kind.simd_shape(cols) {
        return Prepared::Reordered(x86_avx512::bf16_input_order(x));
    }
    Prepared::AsGiven
}

/// Whether [`Act::I8`] inputs go in the 16-bit layout with a zero low plane (the x86 kernels
/// skip it) rather than the int8 kernels' own layout.
#[cfg(target_arch = "x86_64")]
fn i8_in_i16_layout(isa: Isa) -> bool {
    isa.has_avx2()
}

#[cfg(not(target_arch = "x86_64"))]
fn i8_in_i16_layout(_: Isa) -> bool {
    false
}
