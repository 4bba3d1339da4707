//! Register tiles for the unscaled formats (F32, BF16, F16) against f32 inputs on AVX2 without
//! AVX-512: `R` rows times `N` inputs per pass, one accumulator per (row, input).
//!
//! Why: the single-row tile of [`super::x86`] (one row, two inputs, four accumulators each)
//! decodes every weight vector for two FMAs and loads an input vector per FMA; a prefill's
//! attention and shared-expert projections ran at about 7 MAC per cycle per core there. Four
//! rows by three inputs decode a weight vector for three FMAs and load an input vector for
//! four, twelve independent accumulators keeping both FMA pipes busy (the tile llama.cpp's
//! tinyBLAS uses on AVX2).
//!
//! Every output sums its row and input in one order whatever the tile: one 8-lane accumulator
//! over the columns in order, then `x86::hsum`. So a matrix-vector product (4 rows by 1 input)
//! equals the matching row of a matrix product bit for bit, at any width. (Eight rows by one
//! input measured slower in a decode than four: 40-45 against 45-49 BF16 tokens/s, more
//! streams than the prefetchers follow; four are within noise of the single-row tile.)

use std::arch::x86_64::*;

use deltafin_formats::WeightFormat;

use crate::kernels::shape::strided_rows;
use crate::kernels::x86::hsum;

/// A format whose values are the weights themselves (no block scales), 8 at a time as f32.
trait Unscaled {
    /// Bytes per value.
    const BYTES: usize;
    /// Values `c..c + 8` of the row at `p`.
    ///
    /// # Safety
    /// AVX2 and F16C available; the 8 values inside the row.
    unsafe fn load8(p: *const u8, c: usize) -> __m256;
}

struct F32s;
impl Unscaled for F32s {
    const BYTES: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8, c: usize) -> __m256 {
        // SAFETY: the caller guarantees the 32 bytes from `4c`.
        unsafe { _mm256_loadu_ps(p.add(4 * c) as *const f32) }
    }
}

struct Bf16s;
impl Unscaled for Bf16s {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8, c: usize) -> __m256 {
        // SAFETY: the caller guarantees the 16 bytes from `2c`.
        let h = unsafe { _mm_loadu_si128(p.add(2 * c) as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

struct F16s;
impl Unscaled for F16s {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8, c: usize) -> __m256 {
        // SAFETY: the caller guarantees the 16 bytes from `2c`.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.add(2 * c) as *const __m128i) })
    }
}

/// Whether [`rows`] takes `kind`.
pub(crate) fn supports(kind: WeightFormat) -> bool {
    matches!(
        kind,
        WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::F16
    )
}

/// The `R` rows from `p` (`rb` bytes apart) against the `N` inputs at `x` (`cols` apart):
/// `out[r * stride + t]`. The next `R` rows are prefetched as this tile reads its own: a
/// decode's matrix-vector products stream from DRAM, and without the hints the tiles ran a
/// third slower than the hardware prefetcher alone could feed (BF16 decode 30 against 45
/// tokens/s); hints in address order beat hints per row.
///
/// # Safety
/// AVX2, FMA and F16C available; `cols` a multiple of 32; `R` whole rows of `cols` values at
/// `p + r * rb`; `N * cols` values readable at `x`; `out[r * stride + t]` in bounds for
/// `r < R`, `t < N`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<W: Unscaled, const R: usize, const N: usize>(
    p: *const u8,
    rb: usize,
    x: *const f32,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut c = 0;
    while c < cols {
        // The next tile's bytes in address order, as many lines per step as this step reads
        // (a hint: never a read, even past the matrix).
        let lines = R * 32 * W::BYTES / 64;
        let next = p.wrapping_add(R * rb + c / 32 * lines * 64);
        for k in 0..lines {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(k * 64) as *const i8);
        }
        for k in (0..32).step_by(8) {
            // SAFETY: `c + k + 8 <= cols` (`cols` a multiple of 32): inside each input and
            // each row.
            unsafe {
                let xv: [__m256; N] =
                    std::array::from_fn(|t| _mm256_loadu_ps(x.add(t * cols + c + k)));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = W::load8(p.add(r * rb), c + k);
                    for (a, &xt) in acc.iter_mut().zip(&xv) {
                        *a = _mm256_fmadd_ps(w, xt, *a);
                    }
                }
            }
        }
        c += 32;
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, &a) in acc.iter().enumerate() {
            out[r * stride + t] = hsum(a);
        }
    }
}

/// Rows `0..rows` of `data` (`rb` bytes each) times inputs `t0..t0 + n` of `x` (`cols` each),
/// input `t0 + t` of row `r` written to `out[r * stride + t]`.
///
/// # Safety
/// AVX2, FMA and F16C available; `cols` a multiple of 32; `rb == W::BYTES * cols`; `data`
/// holds `rows` rows; `x` holds `t0 + n` inputs; `out` holds `(rows - 1) * stride + n`
/// values, `n <= stride` when `rows > 1`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_of<W: Unscaled>(
    data: &[u8],
    rb: usize,
    rows: usize,
    x: &[f32],
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    assert!(rb >= W::BYTES * cols && data.len() >= rows * rb);
    // `R` rows from `r` against inputs `t0 + t..` (`N` of them).
    macro_rules! run {
        ($r:expr, $t:expr, $R:literal, $N:literal) => {{
            let (r, t) = ($r, $t);
            let o = &mut out[r * stride + t..];
            // SAFETY: rows `r..r + R` of `data` and inputs `t0 + t..t0 + t + N` of `x` exist
            // (the callers' loops); `o[k * stride + j]` for `k < R`, `j < N` is output
            // `(r + k, t + j)`, inside `out`.
            unsafe {
                tile::<W, $R, $N>(
                    data.as_ptr().add(r * rb),
                    rb,
                    x.as_ptr().add((t0 + t) * cols),
                    cols,
                    o,
                    stride,
                )
            }
        }};
    }
    let mut r = 0;
    while r < rows {
        let four = r + 4 <= rows;
        let mut t = 0;
        while t < n {
            match (four, (n - t).min(3)) {
                (true, 3) => run!(r, t, 4, 3),
                (true, 2) => run!(r, t, 4, 2),
                (true, _) => run!(r, t, 4, 1),
                (false, 3) => run!(r, t, 1, 3),
                (false, 2) => run!(r, t, 1, 2),
                (false, _) => run!(r, t, 1, 1),
            }
            t += (n - t).min(3);
        }
        r += if four { 4 } else { 1 };
    }
}

/// [`rows_of`] for `kind`'s values: rows `0..rows` of `data` (`rb` bytes each) times inputs
/// `t0..t0 + n` of `x`, input `t0 + t` of row `r` in `out[r * stride + t]`, where `rows` is
/// what `out` holds (`(rows - 1) * stride + n` values).
///
/// # Safety
/// AVX2, FMA and F16C available; [`supports`]`(kind)`; `cols` a multiple of 32;
/// `rb == kind.row_len(cols)`; `data` holds the rows; `x` holds `t0 + n` inputs of `cols`;
/// `n <= stride` when there is more than one row.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows(
    kind: WeightFormat,
    data: &[u8],
    rb: usize,
    x: &[f32],
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    if n == 0 || out.len() < n {
        return;
    }
    let rows = strided_rows(out.len(), n, stride);
    assert!(x.len() >= (t0 + n) * cols && cols.is_multiple_of(32));
    assert!(rows == 1 || n <= stride);
    // SAFETY: the caller's contract, the sizes checked above.
    unsafe {
        match kind {
            WeightFormat::F32 => rows_of::<F32s>(data, rb, rows, x, t0, n, cols, out, stride),
            WeightFormat::Bf16 => rows_of::<Bf16s>(data, rb, rows, x, t0, n, cols, out, stride),
            WeightFormat::F16 => rows_of::<F16s>(data, rb, rows, x, t0, n, cols, out, stride),
            _ => unreachable!("avx2_dense takes the unscaled formats only"),
        }
    }
}
