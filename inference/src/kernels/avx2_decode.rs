//! Packed rows decoded to f32 on AVX2 (`vector::decode_row`): MLA decodes its kv_b_proj
//! rows on every decode step, where the compiler's vectorization of the scalar body (a pass
//! to decode, a pass to scale) left the decode a visible share of a token's attention. Every
//! value is `code as f32 * scale`, one rounding, bit for bit the scalar reference
//! (`vector::tests::row_decoder_equals_the_reference`).

use std::arch::x86_64::*;

/// Eight codes (as i32) times their scale, stored at `o`: `code as f32 * scale`, one
/// rounding, as the reference.
#[target_feature(enable = "avx2")]
#[inline]
fn scaled8(codes: __m256i, s: __m256, o: &mut [f32]) {
    let v = _mm256_mul_ps(_mm256_cvtepi32_ps(codes), s);
    assert!(o.len() >= 8);
    // SAFETY: `o` holds 8 values (asserted).
    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
}

/// INT4 row (two codes per byte, low nibble first, offset 8) as f32: 32 values per step,
/// the nibbles interleaved back into column order. `out.len()` a multiple of 32, `group`
/// too, `row` `out.len() / 2` bytes, a scale per group.
#[target_feature(enable = "avx2")]
pub(crate) fn int4_row(row: &[u8], group: usize, scales: &[f32], out: &mut [f32]) {
    let (m, eight) = (_mm_set1_epi8(0x0f), _mm256_set1_epi32(8));
    for (k, (o, b)) in out
        .chunks_exact_mut(32)
        .zip(row.chunks_exact(16))
        .enumerate()
    {
        let s = _mm256_set1_ps(scales[k * 32 / group]);
        // SAFETY: `b` is 16 bytes.
        let v = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
        let (lo, hi) = (_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
        // Values 0..16 and 16..32 in column order: byte i's low nibble, then its high one.
        let (a, c) = (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
        for (j, part) in [a, c].into_iter().enumerate() {
            let first = _mm256_sub_epi32(_mm256_cvtepu8_epi32(part), eight);
            let second = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(part, 8)), eight);
            scaled8(first, s, &mut o[16 * j..]);
            scaled8(second, s, &mut o[16 * j + 8..]);
        }
    }
}

/// Q8 row (signed codes) as f32, 32 values per step; as [`int4_row`].
#[target_feature(enable = "avx2")]
pub(crate) fn q8_row(row: &[u8], group: usize, scales: &[f32], out: &mut [f32]) {
    for (k, (o, b)) in out
        .chunks_exact_mut(32)
        .zip(row.chunks_exact(32))
        .enumerate()
    {
        let s = _mm256_set1_ps(scales[k * 32 / group]);
        for j in 0..4 {
            // SAFETY: `b` is 32 bytes: bytes 8j..8j+8 are inside it.
            let v = unsafe { _mm_loadl_epi64(b.as_ptr().add(8 * j) as *const __m128i) };
            scaled8(_mm256_cvtepi8_epi32(v), s, &mut o[8 * j..]);
        }
    }
}
