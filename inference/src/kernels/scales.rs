//! Scales as f32: a matrix's scale bytes converted per task (in loops the compiler vectorizes,
//! F16 through F16C, E8M0 / BF16 with AVX-512), in chunks prefetched ahead.

use deltafin_formats::codec::e8m0_bits;
use deltafin_formats::{ScaleType, WeightFormat};

use crate::kernels::isa::Isa;
use crate::kernels::shape::prefetch_l2;
#[cfg(target_arch = "x86_64")]
use crate::kernels::{x86, x86_avx512};
use crate::linear::matrix::WeightMatrix;

/// Scale bytes `bytes` (of type `st`) appended to `out` as f32, in loops the compiler
/// vectorizes (F16 through F16C when available): this runs once per task, not per weight, but
/// a per-element `match` here costed as much as the INT4 kernel itself.
pub(crate) fn scales_to_f32(isa: Isa, st: ScaleType, bytes: &[u8], out: &mut Vec<f32>) {
    // A task's scales are one short pass, too short for the hardware prefetcher to ramp up
    // (the loads stalled on DRAM: 8 GB/s for E8M0): convert them in chunks, each after asking
    // for the chunk two ahead. `matmul_many_with`'s tasks also ask for the next task's.
    for (k, chunk) in bytes.chunks(SCALE_CHUNK).enumerate() {
        if let Some(ahead) = bytes.get((k + 2) * SCALE_CHUNK..) {
            prefetch_l2(&ahead[..ahead.len().min(SCALE_CHUNK)]);
        }
        scales_chunk_to_f32(isa, st, chunk, out);
    }
}

/// Bytes per prefetch step of [`scales_to_f32`]: a multiple of every scale size, so that no
/// scale straddles two chunks.
const SCALE_CHUNK: usize = 1024;
const _: () = assert!(SCALE_CHUNK.is_multiple_of(4));

fn scales_chunk_to_f32(isa: Isa, st: ScaleType, bytes: &[u8], out: &mut Vec<f32>) {
    let start = out.len();
    let count = match st {
        ScaleType::None => 0,
        ScaleType::E8m0 => bytes.len(),
        ScaleType::F16 | ScaleType::Bf16 => bytes.len() / 2,
        ScaleType::F32 => bytes.len() / 4,
    };
    out.resize(start + count, 0.0);
    scales_into(isa, st, bytes, &mut out[start..]);
}

/// `out[i]` = scale `i` of `bytes` in type `st` (exact), on the SIMD path `isa` has (the AVX2
/// kernels' rows, `x86::RowScales`, call the same F16/BF16 converters directly).
///
/// # Panics
/// If `bytes` holds fewer than `out.len()` scales.
fn scales_into(isa: Isa, st: ScaleType, bytes: &[u8], out: &mut [f32]) {
    assert!(
        bytes.len() >= out.len() * st.size(),
        "{} scales of {st:?} in {} bytes",
        out.len(),
        bytes.len()
    );
    match st {
        ScaleType::None => out.fill(1.0),
        ScaleType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        ScaleType::Bf16 => crate::kernels::bf16::bf16_to_f32(isa, bytes, out),
        ScaleType::E8m0 => {
            #[cfg(target_arch = "x86_64")]
            if isa.has_avx512() {
                // SAFETY: `Isa::Avx512` / `Avx512Bw` mean AVX-512 F/BW were detected; `out`
                // holds no more values than `bytes` has scales (asserted above).
                unsafe { x86_avx512::e8m0_to_f32(&bytes[..out.len()], out) };
                return;
            }
            for (o, &e) in out.iter_mut().zip(bytes) {
                *o = f32::from_bits(e8m0_bits(e));
            }
        }
        ScaleType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if isa.has_avx2() {
                // SAFETY: Avx2 implies F16C was detected; `bytes` holds two bytes per value of
                // `out` (asserted above).
                unsafe { x86::f16_to_f32(bytes, out) };
                return;
            }
            let _ = isa;
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
}

pub(crate) fn row_scales(isa: Isa, m: &WeightMatrix<'_>, r0: usize, r1: usize, out: &mut Vec<f32>) {
    let (scale, st) = (m.scale_bytes(), m.scale_type());
    out.clear();
    let cols = m.cols();
    let sz = match st {
        ScaleType::None => 0,
        ScaleType::E8m0 => 1,
        ScaleType::F16 | ScaleType::Bf16 => 2,
        ScaleType::F32 => 4,
    };
    match m.format() {
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
            out.resize(r1 - r0, 1.0);
        }
        WeightFormat::Fp8Block {
            block_rows,
            block_cols,
        } => {
            let sc = cols.div_ceil(block_cols);
            for r in r0..r1 {
                let base = (r / block_rows) * sc;
                scales_to_f32(isa, st, &scale[base * sz..(base + sc) * sz], out);
            }
        }
        WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. } | WeightFormat::Q8 { .. } => {
            scales_to_f32(isa, st, group_scale_bytes(m, r0, r1), out);
        }
    }
}

/// The scale bytes of rows `r0..r1` of a per-group format (INT4, MXFP4, Q8); empty otherwise.
pub(crate) fn group_scale_bytes<'m>(m: &WeightMatrix<'m>, r0: usize, r1: usize) -> &'m [u8] {
    let sz = match m.scale_type() {
        ScaleType::None => 0,
        ScaleType::E8m0 => 1,
        ScaleType::F16 | ScaleType::Bf16 => 2,
        ScaleType::F32 => 4,
    };
    match m.format() {
        WeightFormat::Int4 { group }
        | WeightFormat::Mxfp4 { group }
        | WeightFormat::Q8 { group } => {
            let g = m.cols().div_ceil(group);
            let rows = m.rows();
            &m.scale_bytes()[r0.min(rows) * g * sz..r1.min(rows) * g * sz]
        }
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each ISA's scale conversion equals the per-value definition bit for bit, for every
    /// e8m0 code (0 and 255 included) and bf16 patterns with NaNs, at lengths covering the
    /// vector bodies and their tails.
    #[test]
    fn scale_conversions_match_the_definitions() {
        let e8m0: Vec<u8> = (0..3).flat_map(|_| 0..=255u8).collect();
        let bf16: Vec<u8> = (0..700u32)
            .flat_map(|i| {
                let bits = match i % 7 {
                    0 => 0x7fc1,
                    1 => 0xff80,
                    2 => 0x0001,
                    _ => (i.wrapping_mul(0x9e37) >> 3) as u16,
                };
                bits.to_le_bytes()
            })
            .collect();
        for isa in [
            Isa::Scalar,
            Isa::Avx2,
            Isa::AvxVnni,
            Isa::Avx512Bw,
            Isa::Avx512,
            Isa::Neon,
        ] {
            if !isa.available() {
                continue;
            }
            for len in (0..40).chain([255, 256, 300, 512]) {
                for start in [0usize, 1, 5] {
                    let bytes = &e8m0[start..start + len];
                    let mut got = vec![1.0f32];
                    scales_to_f32(isa, ScaleType::E8m0, bytes, &mut got);
                    assert_eq!(got.len(), 1 + len);
                    for (i, (&g, &e)) in got[1..].iter().zip(bytes).enumerate() {
                        let want = if e == 0 {
                            2f32.powi(-127)
                        } else if e == 255 {
                            f32::NAN
                        } else {
                            2f32.powi(e as i32 - 127)
                        };
                        assert_eq!(g.to_bits(), want.to_bits(), "{isa:?} e8m0 {e} at {i}");
                    }
                    let bytes = &bf16[2 * start..2 * (start + len)];
                    let mut got = Vec::new();
                    scales_to_f32(isa, ScaleType::Bf16, bytes, &mut got);
                    assert_eq!(got.len(), len);
                    for (g, b) in got.iter().zip(bytes.chunks_exact(2)) {
                        let want = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                        assert_eq!(g.to_bits(), want.to_f32().to_bits(), "{isa:?} bf16 {b:?}");
                    }
                }
            }
        }
    }
}
