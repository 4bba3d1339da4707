//! [`super`]'s fused decoders in AVX-512 registers: a 32-column chunk as two 16-lane vectors.
//! The same conversions and the same operations in the same order as the portable body (a
//! multiply then an add, no FMA; `dot`'s 64 lanes as four vectors), so the results are bit
//! for bit the portable body's. The portable body compiled for AVX-512 was 12% of an INT4
//! decode's samples on Zen 4 (MLA's attention core, `bench compute --profile`).

use std::arch::x86_64::*;

use super::{whole_chunks, Kind, PackedRows, CHUNK, LANES};

/// Columns `c0..c0 + 32` of row `r` as two vectors in column order: `code as f32 * scale`,
/// one rounding (`mul`), as the reference decoder. `c0 + 32 <= cols`, one scale.
///
/// # Safety
/// AVX-512 F/BW available. (Not a `target_feature` function, so that it is inlined into its
/// callers' loops, as the AVX2 one.)
#[inline(always)]
unsafe fn chunk32(p: &PackedRows<'_>, r: usize, c0: usize) -> [__m512; 2] {
    let row = &p.data[r * p.row_len..(r + 1) * p.row_len];
    // SAFETY: AVX-512 F/BW (the caller's guarantee); each load reads inside the slice
    // checked just before it.
    unsafe {
        match p.kind {
            Kind::Q8 { group } => {
                let s = _mm512_set1_ps(p.scales[r * p.per_row + c0 / group]);
                let b = row[c0..c0 + 32].as_ptr();
                let q = |j: usize| {
                    let v = _mm_loadu_si128(b.add(16 * j) as *const __m128i);
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), s)
                };
                [q(0), q(1)]
            }
            Kind::Int4 { group } => {
                let s = _mm512_set1_ps(p.scales[r * p.per_row + c0 / group]);
                let v = _mm_loadu_si128(row[c0 / 2..c0 / 2 + 16].as_ptr() as *const __m128i);
                let m = _mm_set1_epi8(0x0f);
                let (lo, hi) = (_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
                // Byte i's low nibble is column 2i, its high one 2i + 1.
                let (a, c) = (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
                let eight = _mm512_set1_epi32(8);
                let f = |x: __m128i| {
                    let codes = _mm512_sub_epi32(_mm512_cvtepu8_epi32(x), eight);
                    _mm512_mul_ps(_mm512_cvtepi32_ps(codes), s)
                };
                [f(a), f(c)]
            }
            Kind::Bf16 => {
                let b = row[2 * c0..2 * c0 + 64].as_ptr();
                let h = |j: usize| {
                    let v = _mm256_loadu_si256(b.add(32 * j) as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16))
                };
                [h(0), h(1)]
            }
        }
    }
}

/// Sixteen floats of `v` from `at` (`v.len() >= at + 16`).
#[inline(always)]
fn load16(v: &[f32], at: usize) -> __m512 {
    assert!(v.len() >= at + 16);
    // SAFETY: 16 floats from `at` (asserted); AVX-512 F is the callers' feature.
    unsafe { _mm512_loadu_ps(v.as_ptr().add(at)) }
}

#[inline(always)]
fn store16(v: &mut [f32], at: usize, x: __m512) {
    assert!(v.len() >= at + 16);
    // SAFETY: 16 floats from `at` (asserted); AVX-512 F is the callers' feature.
    unsafe { _mm512_storeu_ps(v.as_mut_ptr().add(at), x) }
}

/// `super::axpy_body` in AVX-512 registers: `acc + a * w`, a multiply then an add.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn axpy_avx512(p: &PackedRows<'_>, coef: &[f32], stride: usize, out: &mut [f32]) {
    if !whole_chunks(p) {
        return super::axpy_body(p, coef, stride, out);
    }
    let cols = p.cols;
    let n = out.len() / cols.max(1);
    for c0 in (0..cols).step_by(CHUNK) {
        if n == 1 {
            // One output (a decode step): its chunk stays in registers across the rows.
            let mut acc = [load16(out, c0), load16(out, c0 + 16)];
            for (r, &a) in coef[..p.rows].iter().enumerate() {
                // SAFETY: AVX-512 F/BW (this function's features).
                let (a, w) = (_mm512_set1_ps(a), unsafe { chunk32(p, r, c0) });
                for j in 0..2 {
                    acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(a, w[j]));
                }
            }
            store16(out, c0, acc[0]);
            store16(out, c0 + 16, acc[1]);
            continue;
        }
        for r in 0..p.rows {
            // SAFETY: AVX-512 F/BW (this function's features).
            let w = unsafe { chunk32(p, r, c0) };
            for t in 0..n {
                let a = _mm512_set1_ps(coef[t * stride + r]);
                for (j, &wj) in w.iter().enumerate() {
                    let at = t * cols + c0 + 16 * j;
                    store16(
                        out,
                        at,
                        _mm512_add_ps(load16(out, at), _mm512_mul_ps(a, wj)),
                    );
                }
            }
        }
    }
}

/// `super::dots_body` in AVX-512 registers for rows of whole 64-column blocks: `dot`'s 64
/// lanes as four vectors, the product `w * x`, then its fixed reduction.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn dots_avx512(
    p: &PackedRows<'_>,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // One input (a decode step) only: a few (speculative decoding's check) run the portable
    // body.
    if !whole_chunks(p) || !p.cols.is_multiple_of(LANES) || n != 1 {
        return super::dots_body(p, xs, n, out, out_stride);
    }
    let zero = _mm512_setzero_ps();
    for (r, o) in out[..p.rows].iter_mut().enumerate() {
        let mut acc = [zero; 4];
        for c0 in (0..p.cols).step_by(LANES) {
            // SAFETY: AVX-512 F/BW (this function's features).
            let (w0, w1) = unsafe { (chunk32(p, r, c0), chunk32(p, r, c0 + CHUNK)) };
            for (j, &wj) in w0.iter().chain(&w1).enumerate() {
                let x = load16(xs, c0 + 16 * j);
                acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(wj, x));
            }
        }
        let mut lanes = [0f32; LANES];
        for (j, &v) in acc.iter().enumerate() {
            store16(&mut lanes, 16 * j, v);
        }
        *o = super::reduce64(&mut lanes);
    }
}
