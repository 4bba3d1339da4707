//! BF16 values to f32 (exact: a BF16 is the high half of an f32), on the SIMD path where the
//! kernels have one. Here, not in `scales`, so that matrices can use it without an import
//! circle (`scales` reads matrices).

use crate::kernels::isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::kernels::{x86, x86_avx512};

/// `out[i] = bf16(bytes[2i..2i+2])`, on AVX-512 or AVX2 where `isa` is it.
pub(crate) fn bf16_to_f32(isa: Isa, bytes: &[u8], out: &mut [f32]) {
    assert!(bytes.len() >= 2 * out.len(), "bf16 bytes for every output");
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() && isa.available() {
        // SAFETY: AVX-512 F/BW were detected (`available`); `bytes` holds two bytes per
        // output (asserted above).
        unsafe { x86_avx512::bf16_to_f32(bytes, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && isa.available() {
        // SAFETY: AVX2 was detected (`available`); the lengths are asserted above.
        unsafe { x86::bf16_to_f32(bytes, out) };
        return;
    }
    let _ = isa; // only x86_64 has a SIMD path
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_and_portable_agree_exactly() {
        let vals: Vec<u16> = (0..77u16)
            .map(|i| i.wrapping_mul(2654).wrapping_add(i << 9))
            .collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let want: Vec<f32> = vals
            .iter()
            .map(|&v| f32::from_bits((v as u32) << 16))
            .collect();
        for isa in [Isa::Scalar, Isa::best()] {
            let mut out = vec![0f32; vals.len()];
            bf16_to_f32(isa, &bytes, &mut out);
            let (a, b): (Vec<u32>, Vec<u32>) = (
                out.iter().map(|f| f.to_bits()).collect(),
                want.iter().map(|f| f.to_bits()).collect(),
            );
            assert_eq!(a, b, "{isa:?}");
        }
    }
}
