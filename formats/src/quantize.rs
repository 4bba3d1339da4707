//! Round-to-nearest quantizers producing exactly the bytes each format stores, with the error
//! they introduce. All take a row-major f32 `[rows, cols]` matrix.

use crate::codec::{e8m0_to_f32, f32_to_fp8_e4m3, fp8_e4m3_to_f32, MXFP4_LUT};

/// Scale group (columns) used for INT4, MXFP4 and Q8.
pub const GROUP: usize = 32;
/// DeepSeek-V3 FP8 block.
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// Packed weight bytes and scale bytes of one quantized matrix, plus the error made.
#[derive(Debug, Clone)]
pub struct Quantized {
    /// `weight_packed` (INT4: I32 LE words; MXFP4: U8; Q8: I8).
    pub data: Vec<u8>,
    /// `weight_scale` (INT4: BF16; MXFP4: U8 E8M0; Q8: F16).
    pub scale: Vec<u8>,
    pub error: QuantError,
}

/// Error of a quantized matrix against its f32 source.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QuantError {
    /// max |w - dequant(q)|.
    pub max_abs: f32,
    /// ||w - dequant(q)||_2 / ||w||_2.
    pub rel_rms: f32,
}

impl QuantError {
    fn measure(w: &[f32], back: impl Iterator<Item = f32>) -> QuantError {
        let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f32);
        for (&a, b) in w.iter().zip(back) {
            let e = a - b;
            max_abs = max_abs.max(e.abs());
            num += (e as f64).powi(2);
            den += (a as f64).powi(2);
        }
        QuantError {
            max_abs,
            rel_rms: if den > 0.0 {
                (num / den).sqrt() as f32
            } else {
                0.0
            },
        }
    }
}

fn check(w: &[f32], rows: usize, cols: usize, group: usize) {
    assert_eq!(w.len(), rows * cols, "quantize: matrix length");
    assert!(
        group > 0 && cols.is_multiple_of(group) && group.is_multiple_of(2),
        "quantize: group {group} must divide cols {cols}"
    );
}

/// Q8: `q = round(w / s)`, `s = absmax / 127` per group, stored as F16 (then used rounded).
pub fn quantize_q8(w: &[f32], rows: usize, cols: usize, group: usize) -> Quantized {
    check(w, rows, cols, group);
    let mut data = Vec::with_capacity(w.len());
    let mut scale = Vec::with_capacity(w.len() / group * 2);
    let mut back = Vec::with_capacity(w.len());
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = half::f16::from_f32(amax / 127.0);
        let sf = s.to_f32();
        let inv = if sf > 0.0 { 1.0 / sf } else { 0.0 };
        scale.extend_from_slice(&s.to_bits().to_le_bytes());
        for &v in g {
            let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            data.push(q as u8);
            back.push(q as f32 * sf);
        }
    }
    let error = QuantError::measure(w, back.into_iter());
    Quantized { data, scale, error }
}

/// INT4 compressed-tensors `pack-quantized` (symmetric): `q = clamp(round(w / s), -8, 7)`,
/// `s = absmax / 7` per group as BF16 (the rounded value is the one used), stored q+8, 8 per
/// LE i32 word, element c at bits 4(c%8). `cols` must be a multiple of 8.
pub fn quantize_int4(w: &[f32], rows: usize, cols: usize, group: usize) -> Quantized {
    check(w, rows, cols, group);
    assert_eq!(cols % 8, 0, "INT4 packs 8 values per word");
    let mut codes = Vec::with_capacity(w.len());
    let mut scale = Vec::with_capacity(w.len() / group * 2);
    let mut back = Vec::with_capacity(w.len());
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = half::bf16::from_f32(amax / 7.0);
        let sf = s.to_f32();
        let inv = if sf > 0.0 { 1.0 / sf } else { 0.0 };
        scale.extend_from_slice(&s.to_bits().to_le_bytes());
        for &v in g {
            let q = (v * inv).round().clamp(-8.0, 7.0) as i32;
            codes.push((q + 8) as u32);
            back.push(q as f32 * sf);
        }
    }
    let data = codes
        .chunks_exact(8)
        .flat_map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (k, &q)| w | (q << (4 * k)))
                .to_le_bytes()
        })
        .collect();
    let error = QuantError::measure(w, back.into_iter());
    Quantized { data, scale, error }
}

/// Nearest E2M1 code of `v` (ties to the even code, as the OCP spec rounds).
fn e2m1_code(v: f32) -> u8 {
    let mag = v.abs();
    let mut best = 0usize;
    for (i, &m) in MXFP4_LUT[..8].iter().enumerate() {
        let d = (mag - m).abs();
        let bd = (mag - MXFP4_LUT[best]).abs();
        if d < bd || (d == bd && i % 2 == 0 && best % 2 == 1) {
            best = i;
        }
    }
    let sign = if v.is_sign_negative() && best != 0 {
        8
    } else {
        0
    };
    best as u8 | sign
}

/// MXFP4 (OCP microscaling): shared scale `2^(floor(log2(absmax)) - 2)` per group (E8M0,
/// the OCP rule: the largest magnitude maps to [4, 8) and saturates at 6), elements RTN to E2M1,
/// element 2b in the low nibble of byte b.
pub fn quantize_mxfp4(w: &[f32], rows: usize, cols: usize, group: usize) -> Quantized {
    check(w, rows, cols, group);
    let mut data = Vec::with_capacity(w.len() / 2);
    let mut scale = Vec::with_capacity(w.len() / group);
    let mut back = Vec::with_capacity(w.len());
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e: i32 = if amax > 0.0 && amax.is_finite() {
            (amax.log2().floor() as i32 - 2).clamp(-127, 127)
        } else {
            -127
        };
        scale.push((e + 127) as u8);
        let s = e8m0_to_f32((e + 127) as u8);
        for pair in g.chunks_exact(2) {
            let lo = e2m1_code(pair[0] / s);
            let hi = e2m1_code(pair[1] / s);
            data.push(lo | (hi << 4));
            back.push(MXFP4_LUT[lo as usize] * s);
            back.push(MXFP4_LUT[hi as usize] * s);
        }
    }
    let error = QuantError::measure(w, back.into_iter());
    Quantized { data, scale, error }
}

/// DeepSeek-V3 block FP8: per `[block[0], block[1]]` block (edge blocks partial) the scale is
/// `absmax / 448` (f32, stored as `weight_scale_inv` `[ceil(rows/b0), ceil(cols/b1)]`), values
/// are RTN to e4m3fn of `w / scale`; `w ≈ fp8(q) * scale`.
pub fn quantize_fp8_block(w: &[f32], rows: usize, cols: usize, block: [usize; 2]) -> Quantized {
    assert_eq!(w.len(), rows * cols, "quantize: matrix length");
    assert!(
        block[0] > 0 && block[1] > 0,
        "quantize: FP8 block must be > 0"
    );
    let nbc = cols.div_ceil(block[1]);
    let mut amax = vec![0f32; rows.div_ceil(block[0]) * nbc];
    for (r, row) in w.chunks_exact(cols.max(1)).enumerate() {
        for (c, v) in row.iter().enumerate() {
            let b = (r / block[0]) * nbc + c / block[1];
            amax[b] = amax[b].max(v.abs());
        }
    }
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| {
            if a > 0.0 && a.is_finite() {
                a / 448.0
            } else {
                1.0
            }
        })
        .collect();
    let mut data = Vec::with_capacity(w.len());
    let mut back = Vec::with_capacity(w.len());
    for (r, row) in w.chunks_exact(cols.max(1)).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            let s = scales[(r / block[0]) * nbc + c / block[1]];
            let q = f32_to_fp8_e4m3(v / s);
            data.push(q);
            back.push(fp8_e4m3_to_f32(q) * s);
        }
    }
    let error = QuantError::measure(w, back.into_iter());
    let scale = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    Quantized { data, scale, error }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_block_error_small() {
        let (rows, cols) = (200, 300);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
            .collect();
        let q = quantize_fp8_block(&w, rows, cols, FP8_BLOCK);
        assert_eq!(q.data.len(), rows * cols);
        assert_eq!(q.scale.len(), 2 * 3 * 4);
        assert!(q.error.rel_rms < 0.05, "{:?}", q.error);
    }

    #[test]
    fn packed_quantizers_round_trip_within_a_step() {
        let (rows, cols) = (3, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        for (q, bound) in [
            (quantize_q8(&w, rows, cols, GROUP), 0.01),
            (quantize_int4(&w, rows, cols, GROUP), 0.2),
            (quantize_mxfp4(&w, rows, cols, GROUP), 0.25),
        ] {
            assert!(q.error.rel_rms < bound, "{:?}", q.error);
            assert!(!q.data.is_empty() && !q.scale.is_empty());
        }
    }
}
