//! Scalar codecs of the packed formats' elements and scales (bit layouts in
//! testdata/fixtures/README.md), shared by the kernels' reference path and the quantizers.

use crate::dtype::Dtype;

/// E2M1 nibble -> value (bit 3 is the sign).
pub const MXFP4_LUT: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// FP8 e4m3fn (bias 7, subnormals, no infinities, 0x7f/0xff NaN).
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0xf) as i32;
    let man = (b & 0x7) as f32;
    let mag = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else if exp == 15 && b & 0x7 == 7 {
        f32::NAN
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

/// Nearest FP8 e4m3fn code of `v` (ties to even mantissa), saturating at ±448.
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a.is_nan() {
        return 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a == 0.0 {
        return sign;
    }
    let mut e = (a.log2().floor() as i32).max(-6);
    let mut m = (a / 2f32.powi(e - 3)).round_ties_even() as u32;
    if e == -6 && m < 8 {
        return sign | m as u8;
    }
    if m >= 16 {
        e += 1;
        m = 8;
    }
    let code = (((e + 7) as u32) << 3) | (m - 8);
    sign | code.min(0x7e) as u8
}

/// `2^(e-127)`; 255 is NaN.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000), // 2^-127, subnormal
        e => f32::from_bits((e as u32) << 23),
    }
}

/// The f32 bits of an OCP e8m0 scale `2^(e - 127)`: 0 is the subnormal 2^-127, 255 is NaN.
/// Written with selects so that loops over it vectorize.
#[inline]
pub fn e8m0_bits(e: u8) -> u32 {
    let e = e as u32;
    let bits = if e == 0 { 0x0040_0000 } else { e << 23 };
    if e == 255 {
        0x7fc0_0000
    } else {
        bits
    }
}

/// BF16 bits to f32.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// BF16 / F16 / F32 little-endian bytes to f32 (`None` for other dtypes).
pub fn float_bytes_to_f32(dtype: &Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_encode_round_trips_every_code() {
        for b in 0u8..=255 {
            let v = fp8_e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let c = f32_to_fp8_e4m3(v);
            assert_eq!(fp8_e4m3_to_f32(c), v, "code {b:#x} -> {c:#x}");
        }
        assert_eq!(f32_to_fp8_e4m3(1000.0), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(-1000.0), 0xfe);
        // RTN: halfway between 1.0 (0x38) and 1.125 (0x39) goes to even 1.0.
        assert_eq!(f32_to_fp8_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_fp8_e4m3(1.07), 0x39);
        // Nearest for random values.
        for i in 0..2000 {
            let v = (i as f32 - 1000.0) * 0.173;
            let c = f32_to_fp8_e4m3(v);
            let best = (0u8..=255)
                .filter(|&b| !fp8_e4m3_to_f32(b).is_nan())
                .map(|b| (fp8_e4m3_to_f32(b) - v).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((fp8_e4m3_to_f32(c) - v).abs(), best, "{v}");
        }
    }

    #[test]
    fn e8m0_and_bf16() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert!(e8m0_to_f32(255).is_nan());
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }
}
