//! NEON kernels (aarch64), f32 activations; formats not listed in [`supports`] run the scalar
//! reference. CI here is x86_64: these are built and tested against the reference under
//! qemu-user with `.ci/cross-aarch64`.

use std::arch::aarch64::*;

use deltafin_formats::WeightFormat;

use crate::kernels::shape::BLOCK;

/// Formats with a NEON kernel.
pub fn supports(kind: WeightFormat) -> bool {
    matches!(
        kind,
        WeightFormat::F32
            | WeightFormat::Bf16
            | WeightFormat::Q8 { .. }
            | WeightFormat::Int4 { .. }
            | WeightFormat::Mxfp4 { .. }
    )
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn i8x8_to_f32(v: int8x8_t) -> (float32x4_t, float32x4_t) {
    let w = vmovl_s8(v);
    (
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))),
        vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))),
    )
}

/// f32-activation row kernel, one input at a time.
///
/// # Safety
/// NEON available; `kind.simd_shape(cols)` and `supports(kind)`; `row.len() ==
/// kind.row_len(cols)`, `scales.len() >= cols.div_ceil(kind.group(cols))`, `x.len() >= n * cols`,
/// `out.len() >= n`.
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn row_f32(
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    x: &[f32],
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    let group = kind.group(cols);
    let p = row.as_ptr();
    let (int4_lut, mx_lut): ([i8; 16], [i8; 16]) = (
        [-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7],
        crate::kernels::scalar::MXFP4_X2,
    );
    for (t, o) in out[..n].iter_mut().enumerate() {
        let xp = x[t * cols..].as_ptr();
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut c = 0usize;
        for &s in &scales[..cols.div_ceil(group)] {
            let smul = match kind {
                WeightFormat::Mxfp4 { .. } => s * 0.5,
                _ => s,
            };
            let end = (c + group).min(cols);
            while c < end {
                // SAFETY: `c + 32 <= cols`, so every load below stays inside the row (its byte
                // length is the format's for `cols` values) and inside `x[t*cols..][..cols]`.
                unsafe {
                    let mut w = [vdupq_n_f32(0.0); 8];
                    match kind {
                        WeightFormat::F32 => {
                            let q = p.add(4 * c) as *const f32;
                            for (j, w) in w.iter_mut().enumerate() {
                                *w = vld1q_f32(q.add(4 * j));
                            }
                        }
                        WeightFormat::Bf16 => {
                            let q = p.add(2 * c) as *const u16;
                            for (j, w) in w.iter_mut().enumerate() {
                                *w = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(q.add(4 * j)), 16));
                            }
                        }
                        WeightFormat::Q8 { .. }
                        | WeightFormat::Int4 { .. }
                        | WeightFormat::Mxfp4 { .. } => {
                            let codes: int8x16x2_t = match kind {
                                WeightFormat::Q8 { .. } => {
                                    let q = p.add(c) as *const i8;
                                    int8x16x2_t(vld1q_s8(q), vld1q_s8(q.add(16)))
                                }
                                _ => {
                                    let lut = if matches!(kind, WeightFormat::Int4 { .. }) {
                                        vld1q_s8(int4_lut.as_ptr())
                                    } else {
                                        vld1q_s8(mx_lut.as_ptr())
                                    };
                                    let b = vld1q_u8(p.add(c / 2));
                                    let lo = vqtbl1q_s8(lut, vandq_u8(b, vdupq_n_u8(0x0f)));
                                    let hi = vqtbl1q_s8(lut, vshrq_n_u8(b, 4));
                                    vzipq_s8(lo, hi)
                                }
                            };
                            let (a, b) = i8x8_to_f32(vget_low_s8(codes.0));
                            let (c2, d) = i8x8_to_f32(vget_high_s8(codes.0));
                            let (e, f) = i8x8_to_f32(vget_low_s8(codes.1));
                            let (g, h) = i8x8_to_f32(vget_high_s8(codes.1));
                            w = [a, b, c2, d, e, f, g, h];
                            for w in w.iter_mut() {
                                *w = vmulq_n_f32(*w, smul);
                            }
                        }
                        _ => unreachable!("supports() lists the NEON formats"),
                    }
                    for (j, w) in w.iter().enumerate() {
                        acc[j % 4] = vfmaq_f32(acc[j % 4], *w, vld1q_f32(xp.add(c + 4 * j)));
                    }
                }
                c += BLOCK;
            }
        }
        *o = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
    }
}
