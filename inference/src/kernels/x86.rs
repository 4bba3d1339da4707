//! AVX2 + FMA + F16C kernels (x86_64), selected at run time by [`super::Isa::detect`].
//!
//! Each format decodes 32 weights per step into registers: BF16 by a 16-bit shift, F16 and FP8
//! through `vcvtph2ps` (e4m3 is rebuilt as an f16 bit pattern, exact including subnormals, worth
//! 2^-8 of the value: the 2^8 goes into the block scale), INT4 and MXFP4 by splitting nibbles
//! and mapping them with `vpshufb`, Q8 by sign extension. The f32 path multiplies in f32 (tiles
//! of 2 inputs with 4 accumulators each; F32 / BF16 / F16 without AVX-512 take the register
//! tiles of [`super::avx2_dense`] instead). The integer formats' 16-bit path multiplies codes by
//! the two int8 planes of the inputs with `vpmaddubsw` + `vpmaddwd` (or AVX-VNNI `vpdpbusd`),
//! 4 inputs per decode: INT4 and MXFP4 in groups of 8 blocks transposed so that one 32-bit
//! lane sums one block, scaled once ([`crate::kernels::inputs::I16Order::Groups8`]); 8-bit
//! inputs (`DELTAFIN_ACTIVATIONS=i8`) come as the high plane alone and the low one is skipped.
//!
//! Differences from [`super::scalar`]: summation order (tested within a budget), and FP8's NaN
//! codes 0x7f/0xff decode as ±480 (real checkpoints never hold them).

use std::arch::x86_64::*;

use crate::kernels::scalar::MXFP4_X2;
use deltafin_formats::{ScaleType, WeightFormat};

use crate::kernels::shape::{strided_rows, KernelShape, BLOCK};

/// The sum of `v`'s lanes, in a fixed order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// 16 nibble codes of a 32-value block (`b` = 16 bytes, element 2i low nibble of byte i) in
/// element order, mapped through `lut`, as two vectors of 16 i8 (elements 0..16, 16..32).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles_in_order(b: __m128i, lut: __m128i) -> (__m128i, __m128i) {
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m));
    let hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn i8x16_to_f32(e: __m128i) -> (__m256, __m256) {
    (
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e, 8))),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn int4_lut() -> __m128i {
    _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mxfp4_lut() -> __m128i {
    let l = MXFP4_X2;
    _mm_setr_epi8(
        l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], l[8], l[9], l[10], l[11], l[12], l[13],
        l[14], l[15],
    )
}

/// f32-activation tile: `out[t] = sum_c w[c] * x[t*cols + c]` for `t < N`.
macro_rules! f32_tile {
    ($name:ident, $rows_name:ident, $scaled:expr, |$p:ident, $c:ident| $decode:expr) => {
        /// One input against `R` rows: each 32-value slice of `x` is loaded once for all `R`
        /// rows (a long `x` no longer has to be re-read from L2 for every row).
        ///
        /// # Safety
        /// As for the single-row tile, for each of the `R` rows (`rows[r]` a whole row,
        /// `scales[r]` its scales), `x` holding `cols` values and `out` `R`.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $rows_name<const R: usize>(
            rows: [&[u8]; R],
            scales: [&[f32]; R],
            smul: f32,
            group: usize,
            x: &[f32],
            cols: usize,
            out: &mut [f32],
        ) {
            let xp = x.as_ptr();
            let ahead = R * rows[0].len();
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let mut c = 0usize;
            for gi in 0..cols.div_ceil(group) {
                let sv: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(scales[r][gi] * smul));
                let end = (c + group).min(cols);
                while c < end {
                    // SAFETY: `c + 32 <= cols`, so the input loads read inside `x` and each
                    // row's decode reads inside that row (see the single-row tile).
                    unsafe {
                        let xv = [
                            _mm256_loadu_ps(xp.add(c)),
                            _mm256_loadu_ps(xp.add(c + 8)),
                            _mm256_loadu_ps(xp.add(c + 16)),
                            _mm256_loadu_ps(xp.add(c + 24)),
                        ];
                        for r in 0..R {
                            let $p = rows[r].as_ptr();
                            // The same position `R` rows on (the next tile's rows): a hint.
                            _mm_prefetch::<_MM_HINT_T0>(
                                $p.wrapping_add(c * rows[r].len() / cols + ahead) as *const i8,
                            );
                            let $c = c;
                            let w: [__m256; 4] = $decode;
                            let w = if $scaled {
                                [
                                    _mm256_mul_ps(w[0], sv[r]),
                                    _mm256_mul_ps(w[1], sv[r]),
                                    _mm256_mul_ps(w[2], sv[r]),
                                    _mm256_mul_ps(w[3], sv[r]),
                                ]
                            } else {
                                w
                            };
                            acc[r][0] = _mm256_fmadd_ps(w[0], xv[0], acc[r][0]);
                            acc[r][1] = _mm256_fmadd_ps(w[1], xv[1], acc[r][1]);
                            acc[r][0] = _mm256_fmadd_ps(w[2], xv[2], acc[r][0]);
                            acc[r][1] = _mm256_fmadd_ps(w[3], xv[3], acc[r][1]);
                        }
                    }
                    c += BLOCK;
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = hsum(_mm256_add_ps(a[0], a[1]));
            }
        }

        /// # Safety
        /// AVX2, FMA and F16C available; `cols` and `group` multiples of 32; `row` holds a whole
        /// row of `cols` values, `scales` `cols.div_ceil(group)` values, `x` `N * cols`, `out` `N`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn $name<const N: usize>(
            row: &[u8],
            scales: &[f32],
            smul: f32,
            group: usize,
            x: &[f32],
            cols: usize,
            out: &mut [f32],
        ) {
            let $p = row.as_ptr();
            let xp = x.as_ptr();
            // The next row is prefetched at the same position: a hint.
            let (rl, ahead) = (row.len(), row.len());
            let mut acc = [[_mm256_setzero_ps(); 4]; N];
            let mut c = 0usize;
            for &s in &scales[..cols.div_ceil(group)] {
                let sv = _mm256_set1_ps(s * smul);
                let end = (c + group).min(cols);
                while c < end {
                    let $c = c;
                    // SAFETY: `c + 32 <= cols` (group and cols are multiples of 32 and `end` is
                    // at most `cols`), so the decode reads inside the row (its byte length
                    // is the format's for `cols` values) and the input loads below read
                    // `x[t*cols + c .. t*cols + c + 32]` with `t < N`, inside `x`.
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>(
                            $p.wrapping_add(c * rl / cols + ahead) as *const i8
                        );
                        let w: [__m256; 4] = $decode;
                        let w = if $scaled {
                            [
                                _mm256_mul_ps(w[0], sv),
                                _mm256_mul_ps(w[1], sv),
                                _mm256_mul_ps(w[2], sv),
                                _mm256_mul_ps(w[3], sv),
                            ]
                        } else {
                            w
                        };
                        for (t, a) in acc.iter_mut().enumerate() {
                            let xr = xp.add(t * cols + c);
                            for (j, a) in a.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr.add(8 * j)), *a);
                            }
                        }
                    }
                    c += BLOCK;
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = hsum(_mm256_add_ps(
                    _mm256_add_ps(a[0], a[1]),
                    _mm256_add_ps(a[2], a[3]),
                ));
            }
        }
    };
}

f32_tile!(f32_f32, rows_f32, false, |p, c| {
    let q = p.add(4 * c) as *const f32;
    [
        _mm256_loadu_ps(q),
        _mm256_loadu_ps(q.add(8)),
        _mm256_loadu_ps(q.add(16)),
        _mm256_loadu_ps(q.add(24)),
    ]
});

f32_tile!(f32_bf16, rows_bf16, false, |p, c| {
    let q = p.add(2 * c);
    let cvt = |o: usize| {
        _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(q.add(o) as *const __m128i)),
            16,
        ))
    };
    [cvt(0), cvt(16), cvt(32), cvt(48)]
});

f32_tile!(f32_f16, rows_f16, false, |p, c| {
    let q = p.add(2 * c);
    let cvt = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(q.add(o) as *const __m128i));
    [cvt(0), cvt(16), cvt(32), cvt(48)]
});

f32_tile!(f32_fp8, rows_fp8, true, |p, c| {
    // e4m3 -> f16 bits: put each byte in the high half of a 16-bit lane (sign at bit 15),
    // shift right arithmetically by one (exponent and mantissa land on f16's low exponent bits
    // and high mantissa bits; the sign is copied into bit 14) and clear bit 14. The f16 value
    // is 2^-8 of the e4m3 value (bias 15 vs 7), subnormals included.
    let v = _mm256_loadu_si256(p.add(c) as *const __m256i);
    let z = _mm256_setzero_si256();
    let keep = _mm256_set1_epi16(-0x4001); // 0xbfff
                                           // unpacklo: bytes 0..8 (lane 0) and 16..24 (lane 1); unpackhi: 8..16 and 24..32.
    let lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(z, v), 1), keep);
    let hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(z, v), 1), keep);
    [
        _mm256_cvtph_ps(_mm256_castsi256_si128(lo)),
        _mm256_cvtph_ps(_mm256_castsi256_si128(hi)),
        _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1)),
        _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1)),
    ]
});

f32_tile!(f32_int4, rows_int4, true, |p, c| {
    let (e0, e1) = nibbles_in_order(_mm_loadu_si128(p.add(c / 2) as *const __m128i), int4_lut());
    let (a, b) = i8x16_to_f32(e0);
    let (c2, d) = i8x16_to_f32(e1);
    [a, b, c2, d]
});

f32_tile!(f32_mxfp4, rows_mxfp4, true, |p, c| {
    let (e0, e1) = nibbles_in_order(_mm_loadu_si128(p.add(c / 2) as *const __m128i), mxfp4_lut());
    let (a, b) = i8x16_to_f32(e0);
    let (c2, d) = i8x16_to_f32(e1);
    [a, b, c2, d]
});

f32_tile!(f32_q8, rows_q8, true, |p, c| {
    let q = p.add(c);
    let cvt = |o: usize| {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
            q.add(o) as *const __m128i
        )))
    };
    [cvt(0), cvt(8), cvt(16), cvt(24)]
});

/// `$go!(tile, scale multiplier)` with `$kind`'s single-row f32 tile (FP8's 2^8 and MXFP4's
/// halving go into the multiplier: see the decoders above).
macro_rules! f32_tile_of {
    ($kind:expr, $go:ident) => {
        match $kind {
            WeightFormat::F32 => $go!(f32_f32, 1.0),
            WeightFormat::Bf16 => $go!(f32_bf16, 1.0),
            WeightFormat::F16 => $go!(f32_f16, 1.0),
            WeightFormat::Fp8Block { .. } => $go!(f32_fp8, 256.0),
            WeightFormat::Int4 { .. } => $go!(f32_int4, 1.0),
            WeightFormat::Mxfp4 { .. } => $go!(f32_mxfp4, 0.5),
            WeightFormat::Q8 { .. } => $go!(f32_q8, 1.0),
        }
    };
}

/// f32-activation row kernel.
///
/// # Safety
/// AVX2, FMA and F16C available; `kind.simd_shape(cols)`; `row.len() == kind.row_len(cols)`,
/// `scales.len() >= cols.div_ceil(kind.group(cols))`, `x.len() >= n * cols`, `out.len() >= n`.
#[target_feature(enable = "avx2,fma,f16c")]
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
    debug_assert!(kind.simd_shape(cols) && row.len() == kind.row_len(cols));
    debug_assert!(x.len() >= n * cols && out.len() >= n);
    let group = kind.group(cols);
    debug_assert!(scales.len() >= cols.div_ceil(group));
    let mut t = 0;
    while t < n {
        let take = (n - t).min(2);
        let xs = &x[t * cols..(t + take) * cols];
        let o = &mut out[t..t + take];
        macro_rules! go {
            ($f:ident, $smul:expr) => {
                // SAFETY: the caller's contract is the tile's contract; `xs` holds `take`
                // inputs and `o` `take` outputs.
                unsafe {
                    if take == 2 {
                        $f::<2>(row, scales, $smul, group, xs, cols, o)
                    } else {
                        $f::<1>(row, scales, $smul, group, xs, cols, o)
                    }
                }
            };
        }
        f32_tile_of!(kind, go);
        t += take;
    }
}

/// f32-activation product of consecutive rows of `data` (`rb` bytes each, `scales` holding
/// `per_row` scales per row) with inputs `t0..t0 + n` of `x` (`cols` each), input `t0 + t` of
/// row `r` written to `out[r * stride + t]` (`out.len() == (rows - 1) * stride + n`): the
/// single-row tile inlined into one loop, each output equal to [`row_f32`] on that row and
/// input.
///
/// # Safety
/// As for [`row_f32`] for every row: `data` holds the rows, `rb == kind.row_len(cols)` bytes
/// each, `scales` `per_row` values per row with `per_row >= cols.div_ceil(kind.group(cols))`;
/// `x` holds `t0 + n` inputs; `n <= stride` when there is more than one row.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_f32_inputs(
    kind: WeightFormat,
    data: &[u8],
    rb: usize,
    scales: &[f32],
    per_row: usize,
    x: &[f32],
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(kind.simd_shape(cols) && rb == kind.row_len(cols) && n <= out.len());
    let rows = strided_rows(out.len(), n, stride);
    debug_assert!(rows <= 1 || n <= stride);
    debug_assert!(data.len() >= rows * rb && scales.len() >= rows * per_row);
    debug_assert!(x.len() >= (t0 + n) * cols);
    let group = kind.group(cols);
    debug_assert!(per_row >= cols.div_ceil(group));
    macro_rules! go {
        ($f:ident, $smul:expr) => {
            for r in 0..rows {
                let (row, sc) = (
                    &data[r * rb..(r + 1) * rb],
                    &scales[r * per_row..(r + 1) * per_row],
                );
                let mut t = t0;
                while t < t0 + n {
                    let take = (t0 + n - t).min(2);
                    let xs = &x[t * cols..(t + take) * cols];
                    let o = &mut out[r * stride + t - t0..r * stride + t - t0 + take];
                    // SAFETY: the caller's contract, row by row; `xs` holds `take` inputs
                    // and `o` `take` outputs.
                    unsafe {
                        if take == 2 {
                            $f::<2>(row, sc, $smul, group, xs, cols, o)
                        } else {
                            $f::<1>(row, sc, $smul, group, xs, cols, o)
                        }
                    }
                    t += take;
                }
            }
        };
    }
    f32_tile_of!(kind, go);
}

/// Four rows against one input (matrix-vector products): `out[r] = dot(rows[r], x)`.
///
/// # Safety
/// As for [`row_f32`] with `n == 1`, for each of the four rows and their scales; `out` holds 4.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows4_f32(
    kind: WeightFormat,
    rows: [&[u8]; 4],
    scales: [&[f32]; 4],
    x: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && rows.iter().all(|r| r.len() == kind.row_len(cols)));
    debug_assert!(x.len() >= cols && out.len() >= 4);
    let group = kind.group(cols);
    debug_assert!(scales.iter().all(|s| s.len() >= cols.div_ceil(group)));
    macro_rules! go {
        ($f:ident, $smul:expr) => {
            // SAFETY: the caller's contract is the tile's contract.
            unsafe { $f::<4>(rows, scales, $smul, group, x, cols, out) }
        };
    }
    match kind {
        WeightFormat::F32 => go!(rows_f32, 1.0),
        WeightFormat::Bf16 => go!(rows_bf16, 1.0),
        WeightFormat::F16 => go!(rows_f16, 1.0),
        WeightFormat::Fp8Block { .. } => go!(rows_fp8, 256.0),
        WeightFormat::Int4 { .. } => go!(rows_int4, 1.0),
        WeightFormat::Mxfp4 { .. } => go!(rows_mxfp4, 0.5),
        WeightFormat::Q8 { .. } => go!(rows_q8, 1.0),
    }
}

/// Codes of the 16-bit-activation path on AVX2, in the [`crate::kernels::inputs::I16Inputs`] order.
trait PairCodes {
    /// What was added to every code to make it unsigned (0: codes stay signed, Q8).
    const OFFSET: i32;
    /// Whether whole groups of 8 blocks come in [`I16Order::Groups8`] ([`PairCodes::group8`]).
    ///
    /// [`I16Order::Groups8`]: crate::kernels::inputs::I16Order::Groups8
    const GROUPED: bool = false;
    /// Largest code: whether a group's eight `vpmaddubsw` products of one plane still add
    /// within i16 (INT4's 15: 16 * 15 * 128 = 30720; MXFP4's 24 does not).
    const MAX_CODE: i32;
    /// Blocks `g..g + 8` as eight code vectors in the [`I16Order::Groups8`] order: vector
    /// `2u + p` holds, in 32-bit lane `group8_lane(j)`, the codes of block `j`'s elements
    /// `8u + p + 2k` (`k` in 0..4). Only called when [`PairCodes::GROUPED`].
    ///
    /// # Safety
    /// AVX2 available; blocks `g..g + 8` inside the row at `p`.
    ///
    /// [`I16Order::Groups8`]: crate::kernels::inputs::I16Order::Groups8
    unsafe fn group8(_p: *const u8, _g: usize) -> [__m256i; 8] {
        unreachable!("group8 is only called for 4-bit codes")
    }
    /// Blocks `b`, `b + 1` inside a run of four: the parts matching the input's two halves
    /// (4-bit: evens, odds; Q8: first 16, last 16 of each block), 16 bytes per block each.
    ///
    /// # Safety
    /// AVX2 available; blocks `b`, `b + 1` inside the row at `p`.
    unsafe fn pair(p: *const u8, b: usize) -> (__m256i, __m256i);
    /// Block `b` alone, in the single-block input order (4-bit: evens then odds).
    ///
    /// # Safety
    /// AVX2 available; block `b` inside the row at `p`.
    unsafe fn single(p: *const u8, b: usize) -> __m256i;
}

/// Nibbles of 32 bytes: (low nibbles, high nibbles), mapped through `lut` when given.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles32(v: __m256i, lut: Option<__m256i>) -> (__m256i, __m256i) {
    let m = _mm256_set1_epi8(0x0f);
    let (lo, hi) = (
        _mm256_and_si256(v, m),
        _mm256_and_si256(_mm256_srli_epi16(v, 4), m),
    );
    match lut {
        Some(l) => (_mm256_shuffle_epi8(l, lo), _mm256_shuffle_epi8(l, hi)),
        None => (lo, hi),
    }
}

/// The 128 packed bytes of blocks `g..g + 8` (16 each) as four vectors of one 4-byte word of
/// every block: vector `u` holds bytes `4u..4u + 4` of block `j` in 32-bit lane
/// `4 (j % 2) + j / 2` (a 4x4 transpose of 32-bit words inside each 128-bit half of the four
/// loads, whose halves hold the even and the odd blocks).
///
/// # Safety
/// AVX2 available; the 128 bytes from `p + 16 g` readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn transposed_words8(p: *const u8, g: usize) -> [__m256i; 4] {
    let l: [__m256i; 4] = std::array::from_fn(|i| {
        // SAFETY: `i < 4`: inside the 128 bytes the caller guarantees from `p + 16 g`.
        unsafe { _mm256_loadu_si256(p.add(16 * g + 32 * i) as *const __m256i) }
    });
    let t0 = _mm256_unpacklo_epi32(l[0], l[1]);
    let t1 = _mm256_unpackhi_epi32(l[0], l[1]);
    let t2 = _mm256_unpacklo_epi32(l[2], l[3]);
    let t3 = _mm256_unpackhi_epi32(l[2], l[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// [`transposed_words8`] split into nibbles: vector `2u` the low nibbles of word `u`, `2u + 1`
/// the high ones, mapped through `lut` when given.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles_group8(w: [__m256i; 4], lut: Option<__m256i>) -> [__m256i; 8] {
    let [(a, b), (c, d), (e, f), (g, h)] = w.map(|v| nibbles32(v, lut));
    [a, b, c, d, e, f, g, h]
}

/// MXFP4 doubled codes plus 12 (0..=24), the unsigned table of the 16-bit path.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mxfp4_u_lut() -> __m256i {
    _mm256_add_epi8(
        _mm256_broadcastsi128_si256(mxfp4_lut()),
        _mm256_set1_epi8(12),
    )
}

struct Int4Pairs;
impl PairCodes for Int4Pairs {
    const OFFSET: i32 = 8;
    const GROUPED: bool = true;
    const MAX_CODE: i32 = 15;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group8(p: *const u8, g: usize) -> [__m256i; 8] {
        // SAFETY: the caller guarantees blocks g..g+8 (128 bytes) are inside the row.
        nibbles_group8(unsafe { transposed_words8(p, g) }, None)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair(p: *const u8, b: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller guarantees the 32 bytes of blocks b, b+1 are inside the row.
        nibbles32(
            unsafe { _mm256_loadu_si256(p.add(b * 16) as *const __m256i) },
            None,
        )
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn single(p: *const u8, b: usize) -> __m256i {
        // SAFETY: the caller guarantees the 16 bytes of block b are inside the row.
        let v = unsafe { _mm_loadu_si128(p.add(b * 16) as *const __m128i) };
        let y = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
        _mm256_and_si256(y, _mm256_set1_epi8(0x0f))
    }
}

struct Mxfp4Pairs;
impl PairCodes for Mxfp4Pairs {
    const OFFSET: i32 = 12;
    const GROUPED: bool = true;
    const MAX_CODE: i32 = 24;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group8(p: *const u8, g: usize) -> [__m256i; 8] {
        // SAFETY: as for INT4.
        nibbles_group8(unsafe { transposed_words8(p, g) }, Some(mxfp4_u_lut()))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair(p: *const u8, b: usize) -> (__m256i, __m256i) {
        // SAFETY: as for INT4.
        let v = unsafe { _mm256_loadu_si256(p.add(b * 16) as *const __m256i) };
        nibbles32(v, Some(mxfp4_u_lut()))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn single(p: *const u8, b: usize) -> __m256i {
        // SAFETY: as for INT4.
        _mm256_shuffle_epi8(mxfp4_u_lut(), unsafe { Int4Pairs::single(p, b) })
    }
}

struct Q8Pairs;
impl PairCodes for Q8Pairs {
    const OFFSET: i32 = 0;
    const MAX_CODE: i32 = 128;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair(p: *const u8, b: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller guarantees the 64 bytes of blocks b, b+1 are inside the row.
        let (v1, v2) = unsafe {
            (
                _mm256_loadu_si256(p.add(b * 32) as *const __m256i),
                _mm256_loadu_si256(p.add(b * 32 + 32) as *const __m256i),
            )
        };
        (
            _mm256_permute2x128_si256::<0x20>(v1, v2),
            _mm256_permute2x128_si256::<0x31>(v1, v2),
        )
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn single(p: *const u8, b: usize) -> __m256i {
        // SAFETY: the caller guarantees the 32 bytes of block b are inside the row.
        unsafe { _mm256_loadu_si256(p.add(b * 32) as *const __m256i) }
    }
}

/// Pairwise i16 products of codes `w` with inputs `x`: unsigned codes (no overflow: at most
/// 2 * 24 * 127) or, for signed Q8 codes, `|w| * sign(x, w)` (at most 2 * 128 * 127).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn code_products<C: PairCodes>(w: __m256i, x: __m256i) -> __m256i {
    if C::OFFSET == 0 {
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
    } else {
        _mm256_maddubs_epi16(w, x)
    }
}

/// i32 lane sums of `256 * hi + lo` products for two code vectors against the matching input
/// halves (lanes 0..4: the first block, 4..8: the second); without `LO` the low plane is
/// zero ([`crate::kernels::inputs::I16Inputs::hi_only`]) and not read: the same sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pair_sums<C: PairCodes, const LO: bool>(
    a: __m256i,
    b: __m256i,
    [ha, hb, la, lb]: [__m256i; 4],
) -> __m256i {
    let (k256, k1) = (_mm256_set1_epi16(256), _mm256_set1_epi16(1));
    if !LO {
        let h = if C::OFFSET == 0 {
            _mm256_add_epi32(
                _mm256_madd_epi16(code_products::<C>(a, ha), k1),
                _mm256_madd_epi16(code_products::<C>(b, hb), k1),
            )
        } else {
            _mm256_madd_epi16(
                _mm256_add_epi16(code_products::<C>(a, ha), code_products::<C>(b, hb)),
                k1,
            )
        };
        // 256 * h: exact (|h| < 2^23), as the product with 256 in the `LO` form.
        return _mm256_slli_epi32(h, 8);
    }
    if C::OFFSET == 0 {
        // Signed products reach 32512 each: widen before adding.
        let h = _mm256_add_epi32(
            _mm256_madd_epi16(code_products::<C>(a, ha), k256),
            _mm256_madd_epi16(code_products::<C>(b, hb), k256),
        );
        let l = _mm256_add_epi32(
            _mm256_madd_epi16(code_products::<C>(a, la), k1),
            _mm256_madd_epi16(code_products::<C>(b, lb), k1),
        );
        _mm256_add_epi32(h, l)
    } else {
        // Unsigned 4-bit codes: two products add within i16 (at most 4 * 24 * 127).
        let h = _mm256_add_epi16(code_products::<C>(a, ha), code_products::<C>(b, hb));
        let l = _mm256_add_epi16(code_products::<C>(a, la), code_products::<C>(b, lb));
        _mm256_add_epi32(_mm256_madd_epi16(h, k256), _mm256_madd_epi16(l, k1))
    }
}

/// i32 lane sums of one plane of a [`PairCodes::group8`] group: lane `l` the sum of its
/// block's 32 products of the 4-bit codes `c` with the plane's 256 inputs at `x`. Four
/// products of unsigned 4-bit codes add within i16 (at most 4 * 2 * 24 * 127).
///
/// # Safety
/// AVX2 available; 256 bytes readable at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group8_plane<C: PairCodes>(c: &[__m256i; 8], x: *const i8) -> __m256i {
    let p = |v: usize| {
        // SAFETY: `v < 8`: inside the 256 bytes the caller guarantees at `x`.
        let xv = unsafe { _mm256_loadu_si256(x.add(32 * v) as *const __m256i) };
        code_products::<C>(c[v], xv)
    };
    let a = _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
    let b = _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7)));
    let k1 = _mm256_set1_epi16(1);
    _mm256_add_epi32(_mm256_madd_epi16(a, k1), _mm256_madd_epi16(b, k1))
}

/// [`Dot::group8`] of `MaddDot` for `N` inputs at once (input `t`'s planes at `h + t * cols`,
/// `l + t * cols`), when a plane's eight products add within i16 ([`PairCodes::MAX_CODE`]):
/// codes outer and inputs inner, so the live vectors are one code vector and two i16
/// accumulators per input (the code-vectors-first order spilled at two inputs and more),
/// and one `vpmaddwd` per plane and input instead of two. The same integers.
///
/// # Safety
/// AVX2 available; `16 * C::MAX_CODE * 128 <= i16::MAX` (checked: a panic); for each
/// `t < N` 256 bytes readable at `h + t * cols` and, with `LO`, at `l + t * cols`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group8_i16_sums<C: PairCodes, const N: usize, const LO: bool>(
    c: &[__m256i; 8],
    h: *const i8,
    l: *const i8,
    cols: usize,
) -> [__m256i; N] {
    assert!(
        16 * C::MAX_CODE * 128 <= i16::MAX as i32,
        "i16 sums overflow"
    );
    let mut ah = [_mm256_setzero_si256(); N];
    let mut al = [_mm256_setzero_si256(); N];
    for (v, &c) in c.iter().enumerate() {
        for t in 0..N {
            // SAFETY: `v < 8`, `t < N`: inside the 256 bytes per input the caller guarantees.
            unsafe {
                let x = t * cols + 32 * v;
                let hv = _mm256_loadu_si256(h.add(x) as *const __m256i);
                ah[t] = _mm256_add_epi16(ah[t], code_products::<C>(c, hv));
                if LO {
                    let lv = _mm256_loadu_si256(l.add(x) as *const __m256i);
                    al[t] = _mm256_add_epi16(al[t], code_products::<C>(c, lv));
                }
            }
        }
    }
    let mut sums = [_mm256_setzero_si256(); N];
    for t in 0..N {
        let hs = _mm256_madd_epi16(ah[t], _mm256_set1_epi16(256));
        sums[t] = if LO {
            _mm256_add_epi32(hs, _mm256_madd_epi16(al[t], _mm256_set1_epi16(1)))
        } else {
            hs
        };
    }
    sums
}

/// How a pair of 32-byte code vectors meets the 16-bit inputs: `vpmaddubsw` + `vpmaddwd`
/// (AVX2) or `vpdpbusd` (AVX-VNNI: Alder Lake and later, Zen 5).
trait Dot {
    /// `sum 256 * hi + lo` products of codes `a`, `b` with the input halves `[ha, hb, la, lb]`,
    /// per i32 lane (lanes 0..4: the first block, 4..8: the second).
    /// Without `LO` the low halves are zero and not read.
    ///
    /// # Safety
    /// The instruction set of the implementation available.
    unsafe fn pair<C: PairCodes, const LO: bool>(
        a: __m256i,
        b: __m256i,
        x: [__m256i; 4],
    ) -> __m256i;
    /// The same for one block's 32 codes `c` against its inputs `h`, `l`.
    ///
    /// # Safety
    /// As for [`Dot::pair`].
    unsafe fn single<C: PairCodes, const LO: bool>(c: __m256i, h: __m256i, l: __m256i) -> __m256i;
    /// A [`PairCodes::group8`] group's codes against its 256 inputs of each plane at `h`, `l`:
    /// per 32-bit lane the `256 * hi + lo` sum of that lane's block (exact in i32: at most
    /// 257 * 32 * 24 * 127). Without `LO` the low plane is zero and not read.
    ///
    /// # Safety
    /// The instruction set of the implementation available; 256 bytes readable at `h` and,
    /// with `LO`, at `l`.
    unsafe fn group8<C: PairCodes, const LO: bool>(
        c: &[__m256i; 8],
        h: *const i8,
        l: *const i8,
    ) -> __m256i;
    /// The offset the products carry per code.
    fn offset<C: PairCodes>() -> i32;
    /// Whether whole groups may take [`group8_i16_sums`] (`vpmaddubsw` sums in i16).
    const I16_SUMS: bool = false;
}

struct MaddDot;
impl Dot for MaddDot {
    const I16_SUMS: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair<C: PairCodes, const LO: bool>(
        a: __m256i,
        b: __m256i,
        x: [__m256i; 4],
    ) -> __m256i {
        pair_sums::<C, LO>(a, b, x)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn single<C: PairCodes, const LO: bool>(c: __m256i, h: __m256i, l: __m256i) -> __m256i {
        if !LO {
            return _mm256_madd_epi16(code_products::<C>(c, h), _mm256_set1_epi16(256));
        }
        _mm256_add_epi32(
            _mm256_madd_epi16(code_products::<C>(c, h), _mm256_set1_epi16(256)),
            _mm256_madd_epi16(code_products::<C>(c, l), _mm256_set1_epi16(1)),
        )
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group8<C: PairCodes, const LO: bool>(
        c: &[__m256i; 8],
        h: *const i8,
        l: *const i8,
    ) -> __m256i {
        // SAFETY: the caller guarantees the planes' 256 bytes.
        let hs = _mm256_slli_epi32(unsafe { group8_plane::<C>(c, h) }, 8);
        if !LO {
            return hs;
        }
        // SAFETY: as above.
        _mm256_add_epi32(hs, unsafe { group8_plane::<C>(c, l) })
    }
    fn offset<C: PairCodes>() -> i32 {
        C::OFFSET
    }
}

/// `vpdpbusd` takes unsigned codes: Q8's signed codes get the sign bit flipped (+128).
struct VnniDot;
impl VnniDot {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn unsigned<C: PairCodes>(c: __m256i) -> __m256i {
        if C::OFFSET == 0 {
            _mm256_xor_si256(c, _mm256_set1_epi8(-128))
        } else {
            c
        }
    }
}
impl Dot for VnniDot {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn pair<C: PairCodes, const LO: bool>(
        a: __m256i,
        b: __m256i,
        [ha, hb, la, lb]: [__m256i; 4],
    ) -> __m256i {
        let (a, b) = (Self::unsigned::<C>(a), Self::unsigned::<C>(b));
        let s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, ha);
        let s = _mm256_dpbusd_avx_epi32(s, b, hb);
        if !LO {
            return _mm256_slli_epi32(s, 8);
        }
        let s = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(s, 8), a, la);
        _mm256_dpbusd_avx_epi32(s, b, lb)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn single<C: PairCodes, const LO: bool>(c: __m256i, h: __m256i, l: __m256i) -> __m256i {
        let c = Self::unsigned::<C>(c);
        let s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), c, h);
        if !LO {
            return _mm256_slli_epi32(s, 8);
        }
        _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(s, 8), c, l)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn group8<C: PairCodes, const LO: bool>(
        c: &[__m256i; 8],
        h: *const i8,
        l: *const i8,
    ) -> __m256i {
        // Two chains of four `vpdpbusd` per plane (its latency).
        let plane = |x: *const i8| {
            // SAFETY: the caller guarantees the planes' 256 bytes.
            let v = |k: usize| unsafe { _mm256_loadu_si256(x.add(32 * k) as *const __m256i) };
            let mut a = _mm256_setzero_si256();
            let mut b = _mm256_setzero_si256();
            for k in (0..8).step_by(2) {
                a = _mm256_dpbusd_avx_epi32(a, Self::unsigned::<C>(c[k]), v(k));
                b = _mm256_dpbusd_avx_epi32(b, Self::unsigned::<C>(c[k + 1]), v(k + 1));
            }
            _mm256_add_epi32(a, b)
        };
        let hs = _mm256_slli_epi32(plane(h), 8);
        if !LO {
            return hs;
        }
        _mm256_add_epi32(hs, plane(l))
    }
    fn offset<C: PairCodes>() -> i32 {
        if C::OFFSET == 0 {
            128
        } else {
            C::OFFSET
        }
    }
}

/// Consecutive rows of a matrix for the 16-bit kernels: `count` rows of `rb` bytes in `data`,
/// each with `per_row` block scales in `scales` (at least `cols / 32` used).
pub(crate) struct RowsOf<'a> {
    pub(crate) data: &'a [u8],
    pub(crate) rb: usize,
    pub(crate) count: usize,
    pub(crate) scales: RowScales<'a>,
    pub(crate) per_row: usize,
}

/// How many rows ahead of the row being computed the 16-bit row loops prefetch. Alternated
/// A/Bs on a Zen 2 VM (the 3.1B synth, 1024 columns): Q8 decode gained 7% at 4 rows, 3% more
/// at 8 (8.7 KiB) and 1% more at 16; INT4 (512-byte rows) was 2-3% slower at 16 or 32 rows
/// than at 8 (4 KiB).
pub(crate) const PREFETCH_ROWS: usize = 8;

/// Row `r + PREFETCH_ROWS` of `rows` (if there is one) into L1, in software.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn prefetch_ahead(rows: &RowsOf<'_>, r: usize) {
    let r = r + PREFETCH_ROWS;
    if let Some(ahead) = rows.data.get(r * rows.rb..(r + 1) * rows.rb) {
        for line in (0..ahead.len()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(ahead[line..].as_ptr() as *const i8);
        }
    }
}

/// Block scales of the 16-bit kernels' rows: f32, or the matrix's own scale bytes (one scale
/// per 32-block), converted row by row inside the kernel. A separate conversion pass per task
/// (`scales::row_scales`) was 4% of an INT4 decode on AVX2 (perf, the 3.1B synth): a pass of
/// its own over bytes that stall on DRAM, and a vector written and read back.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowScales<'a> {
    F32(&'a [f32]),
    Raw(&'a [u8], ScaleType),
}

/// Rows of at most this many 32-blocks take [`RowScales::Raw`] (16384 columns); the row's
/// scales are converted into a buffer of this size on the stack.
pub(crate) const RAW_SCALE_BLOCKS: usize = 512;

impl<'a> RowScales<'a> {
    /// Whether the scales hold `count` rows of `per_row` scales.
    pub(crate) fn holds(&self, count: usize, per_row: usize) -> bool {
        match *self {
            RowScales::F32(s) => s.len() >= count * per_row,
            RowScales::Raw(b, st) => b.len() >= count * per_row * st.size(),
        }
    }

    /// Row `r`'s first `blocks` scales as f32: a slice of the f32 scales, or the raw ones
    /// converted into `buf`.
    ///
    /// # Safety
    /// AVX2 and F16C available.
    ///
    /// # Panics
    /// If the scales do not hold row `r` (`per_row` scales each, `blocks <= per_row`) or
    /// `buf` is too short.
    // Not a `target_feature` function: those are not inlined into their callers' loops, and
    // the call per row was 2.7% of a Q8 decode (perf).
    #[inline(always)]
    pub(crate) unsafe fn row<'b>(
        &self,
        r: usize,
        per_row: usize,
        blocks: usize,
        buf: &'b mut [f32; RAW_SCALE_BLOCKS],
    ) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            RowScales::F32(s) => &s[r * per_row..][..blocks],
            RowScales::Raw(b, st) => {
                let sz = st.size();
                // The scales of a row a few ahead: one line per row, a stream too sparse
                // beside the rows' for the hardware prefetcher alone (the conversion waited
                // on DRAM: prefills 4% slower than converting per task).
                let ahead = b.as_ptr().wrapping_add((r + 4) * per_row * sz);
                // SAFETY: SSE is baseline on x86_64; a prefetch never faults, whatever the
                // address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8) };
                let bytes = &b[r * per_row * sz..][..blocks * sz];
                let out = &mut buf[..blocks];
                // The common types straight to their converters: through `scales_into` (its
                // checks and dispatch per row) an in-cache INT4 matvec was 10% slower.
                match st {
                    // SAFETY: the caller guarantees AVX2 and F16C; `bytes` holds `blocks`
                    // scales of two bytes.
                    ScaleType::F16 => unsafe { f16_to_f32_inline(bytes, out) },
                    // SAFETY: as above.
                    ScaleType::Bf16 => unsafe { bf16_to_f32(bytes, out) },
                    // The rare types, as `scales::scales_into` converts them (not called
                    // from here: `scales` reads matrices, whose kernels are these).
                    ScaleType::E8m0 => {
                        for (o, &e) in out.iter_mut().zip(bytes) {
                            *o = f32::from_bits(deltafin_formats::codec::e8m0_bits(e));
                        }
                    }
                    ScaleType::F32 => {
                        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                    }
                    ScaleType::None => out.fill(1.0),
                }
                out
            }
        }
    }
}

/// One 16-bit row kernel per [`Dot`], each compiled for its instruction set.
macro_rules! i16_row_fn {
    ($name:ident, $rows_name:ident, $feat:literal, $dot:ty) => {
        /// Each of `rows` against `N` 16-bit inputs, row by row in one call (a call and its
        /// set-up per row cost 10-15% of an INT4 matrix-vector product: `#[inline]` alone
        /// left the row kernel out of line), input `t` of row `r` in `out_all[r * stride + t]`
        /// (the AVX2 / AVX-VNNI form of the AVX-512 16-bit tile): groups of 8 blocks take their 8 weight scales times each input's 8 block
        /// scales once; per pair of blocks inside a run of four, the [`Dot`] gives the pair's
        /// sums (`256 * hi + lo`, exact in i32) and one permute spreads the two blocks' scale
        /// products; single blocks after the runs likewise. The offset correction is one FMA
        /// per group. Each input is summed in the same order whatever `N` is; `out[t]`.
        /// Without `LO` the low plane is all zeros ([`crate::kernels::inputs::I16Inputs::hi_only`],
        /// 8-bit inputs) and is not read: half the products, the same sums.
        ///
        /// # Safety
        /// The instruction set of `$feat` available; `cols` a multiple of 32; each row a whole
        /// row of `cols` codes with at least `cols / 32` block scales; `hi`/`lo` hold
        /// `N * cols` codes and `d`/`dsums` `N * cols / 32` values (checked: a panic).
        #[target_feature(enable = $feat)]
        #[inline]
        // `j` picks both the pair's blocks and its accumulator, inside the loop over inputs.
        #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
        unsafe fn $name<C: PairCodes, const N: usize, const LO: bool, const M: bool>(
            rows: &RowsOf<'_>,
            hi: &[i8],
            lo: &[i8],
            d: &[f32],
            dsums: &[f32],
            cols: usize,
            grouped: bool,
            out_all: &mut [f32],
            stride: usize,
        ) {
            let blocks = cols / BLOCK;
            let (hp, lp) = (hi[..N * cols].as_ptr(), lo[..N * cols].as_ptr());
            let (d, dsums) = (&d[..N * blocks], &dsums[..N * blocks]);
            let quads = blocks / 4;
            let mut sbuf = [0f32; RAW_SCALE_BLOCKS];
            for r in 0..rows.count {
            let row = &rows.data[r * rows.rb..(r + 1) * rows.rb];
            // Rows ahead, in software: each task's rows are one short stream, and a
            // decode's experts many such streams (Q8 decode 7-10% faster).
            prefetch_ahead(rows, r);
            // SAFETY: `$feat` includes AVX2 and F16C.
            let ws = unsafe { rows.scales.row(r, rows.per_row, blocks, &mut sbuf) };
            let out = &mut out_all[r * stride..r * stride + N];
            let p = row.as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            let mut cacc = [_mm256_setzero_ps(); N];
            let mut wd = [_mm256_setzero_ps(); N];
            let half_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
            // Lane `l` of a Groups8 group's sums holds block `sigma[l]`.
            let sigma = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            let whole = if grouped && C::GROUPED {
                blocks / 8 * 8
            } else {
                0
            };
            let mut g = 0;
            // Whole groups in the Groups8 order: each block's integer sum whole in its lane,
            // scaled once (the scale products permuted to the lanes).
            while g < whole {
                // SAFETY: `g + 8 <= blocks`: 8 scales of `ws` and of `d` / `dsums`
                // `[t * blocks + g ..]`, the decode reads blocks g..g+8 of the row and the input
                // loads `[t*cols + 32g ..][..256]` of each plane, `t < N`.
                unsafe {
                    let w = _mm256_loadu_ps(ws.as_ptr().add(g));
                    let wp = _mm256_permutevar8x32_ps(w, sigma);
                    let codes = C::group8(p, g);
                    let x0 = g * BLOCK;
                    let many = M;
                    let sums: [__m256i; N] = if many {
                        group8_i16_sums::<C, N, LO>(&codes, hp.add(x0), lp.add(x0), cols)
                    } else {
                        [_mm256_setzero_si256(); N]
                    };
                    for t in 0..N {
                        let o = t * blocks + g;
                        let dp =
                            _mm256_permutevar8x32_ps(_mm256_loadu_ps(d.as_ptr().add(o)), sigma);
                        let x = t * cols + x0;
                        let s = if many {
                            sums[t]
                        } else {
                            <$dot>::group8::<C, LO>(&codes, hp.add(x), lp.add(x))
                        };
                        acc[t][0] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s),
                            _mm256_mul_ps(wp, dp),
                            acc[t][0],
                        );
                    }
                }
                g += 8;
            }
            // The groups' offset corrections in a pass of their own: in the loop above, `N`
            // more live vectors beside the eight code vectors spilled.
            for t in 0..N {
                for g in (0..whole).step_by(8) {
                    // SAFETY: `g + 8 <= blocks`, `t < N`: inside `ws` and `dsums`.
                    unsafe {
                        cacc[t] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(ws.as_ptr().add(g)),
                            _mm256_loadu_ps(dsums.as_ptr().add(t * blocks + g)),
                            cacc[t],
                        );
                    }
                }
            }
            while g < blocks {
                let n = (blocks - g).min(8);
                let mask = _mm256_cmpgt_epi32(
                    _mm256_set1_epi32(n as i32),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                );
                // SAFETY: the mask enables blocks `g..g + n` only, all inside `ws`, `d` and `dsums`
                // (`t < N`).
                unsafe {
                    let w = _mm256_maskload_ps(ws.as_ptr().add(g), mask);
                    for t in 0..N {
                        let o = t * blocks + g;
                        wd[t] = _mm256_mul_ps(w, _mm256_maskload_ps(d.as_ptr().add(o), mask));
                        cacc[t] = _mm256_fmadd_ps(
                            w,
                            _mm256_maskload_ps(dsums.as_ptr().add(o), mask),
                            cacc[t],
                        );
                    }
                }
                let mut k = 0;
                while k < n {
                    let b = g + k;
                    if b + 4 <= quads * 4 {
                        // Two pairs of the run of four starting at `b`.
                        for j in 0..2 {
                            let idx =
                                _mm256_add_epi32(half_idx, _mm256_set1_epi32((k + 2 * j) as i32));
                            // SAFETY: blocks b..b+4 form a run: the decode reads blocks b+2j, b+2j+1,
                            // the input loads `[t*cols + 32b + 32j ..][..32]` and the same `+ 64` of
                            // each plane, `t < N`.
                            unsafe {
                                let (ca, cb) = C::pair(p, b + 2 * j);
                                for t in 0..N {
                                    let o = t * cols + b * BLOCK + 32 * j;
                                    let h = [
                                        _mm256_loadu_si256(hp.add(o) as *const __m256i),
                                        _mm256_loadu_si256(hp.add(o + 64) as *const __m256i),
                                    ];
                                    let l = if LO {
                                        [
                                            _mm256_loadu_si256(lp.add(o) as *const __m256i),
                                            _mm256_loadu_si256(lp.add(o + 64) as *const __m256i),
                                        ]
                                    } else {
                                        [_mm256_setzero_si256(); 2]
                                    };
                                    let s = <$dot>::pair::<C, LO>(ca, cb, [h[0], h[1], l[0], l[1]]);
                                    let sv = _mm256_permutevar8x32_ps(wd[t], idx);
                                    acc[t][j] =
                                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sv, acc[t][j]);
                                }
                            }
                        }
                        k += 4;
                    } else {
                        let idx = _mm256_set1_epi32(k as i32);
                        // SAFETY: `b < blocks`: block b of the row, `[t*cols + 32b ..][..32]` of each
                        // plane, `t < N`.
                        unsafe {
                            let c = C::single(p, b);
                            for t in 0..N {
                                let o = t * cols + b * BLOCK;
                                let l = if LO {
                                    _mm256_loadu_si256(lp.add(o) as *const __m256i)
                                } else {
                                    _mm256_setzero_si256()
                                };
                                let s = <$dot>::single::<C, LO>(
                                    c,
                                    _mm256_loadu_si256(hp.add(o) as *const __m256i),
                                    l,
                                );
                                let sv = _mm256_permutevar8x32_ps(wd[t], idx);
                                acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sv, acc[t][0]);
                            }
                        }
                        k += 1;
                    }
                }
                g += n;
            }
            let off = <$dot>::offset::<C>() as f32;
            for t in 0..N {
                out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) - off * hsum(cacc[t]);
            }
            }
        }

        /// `rows` against inputs `t0..t0 + n` of `x`, input `t0 + t` of row `r` written to
        /// `out[r * stride + t]`: every row once per run of up to 4 inputs (a row of 512 INT4
        /// columns is only two groups, and a prefill's expert meets about two inputs).
        ///
        /// # Safety
        /// As for the row kernel, for every run of at most 4 inputs; `out` holds
        /// `(rows - 1) * stride + n` values.
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $rows_name<C: PairCodes, const LO: bool>(
            rows: &RowsOf<'_>,
            x: &crate::kernels::inputs::I16Inputs,
            t0: usize,
            n: usize,
            cols: usize,
            grouped: bool,
            out: &mut [f32],
            stride: usize,
        ) {
            let blocks = cols / BLOCK;
            // Whole groups of codes whose eight products per plane add within i16 take
            // [`group8_i16_sums`] (two inputs or more; MaddDot only).
            let many = <$dot>::I16_SUMS && 16 * C::MAX_CODE * 128 <= i16::MAX as i32;
            let mut t = t0;
            while t < t0 + n {
                let k = (t0 + n - t).min(4);
                let (hi, lo) = (
                    &x.hi[t * cols..(t + k) * cols],
                    &x.lo[t * cols..(t + k) * cols],
                );
                let d = &x.d[t * blocks..(t + k) * blocks];
                let ds = &x.dsums[t * blocks..(t + k) * blocks];
                let o = &mut out[t - t0..];
                // SAFETY: the caller's contract, for every row; the slices hold `k` inputs.
                unsafe {
                    match (k, many) {
                        (4, true) => $name::<C, 4, LO, true>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                        (3, true) => $name::<C, 3, LO, true>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                        (2, true) => $name::<C, 2, LO, true>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                        (4, false) => $name::<C, 4, LO, false>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                        (3, false) => $name::<C, 3, LO, false>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                        (2, false) => $name::<C, 2, LO, false>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                        _ => $name::<C, 1, LO, false>(rows, hi, lo, d, ds, cols, grouped, o, stride),
                    }
                }
                t += k;
            }
        }
    };
}

i16_row_fn!(i16_row, i16_rows, "avx2,fma,f16c", MaddDot);
i16_row_fn!(
    i16_row_vnni,
    i16_rows_vnni,
    "avx2,fma,f16c,avxvnni",
    VnniDot
);

/// 16-bit-activation product (INT4, MXFP4, Q8) of consecutive rows of `data` (`rb` bytes
/// each, `scales` holding `per_row` block scales per row, one per 32-block) with inputs
/// `t0..t0 + n` of `x`, input `t0 + t` of row `r` written to `out[r * stride + t]`
/// (`out.len() == (rows - 1) * stride + n`); each output independent of the other rows and
/// of how many inputs the call takes.
///
/// # Safety
/// AVX2, FMA and F16C available, and AVX-VNNI when `vnni`; `kind.simd_shape(cols)`; `data`
/// holds the rows, `rb == kind.row_len(cols)` bytes each, and `scales` `per_row` values per
/// row, `per_row >= cols / 32` (raw scales: `cols / 32 <= RAW_SCALE_BLOCKS`, checked: a
/// panic); `x.hi`/`x.lo` hold at least `(t0 + n) * cols` codes and
/// `x.d`/`x.dsums` `(t0 + n) * cols / 32` values; `n <= stride` when there is more than one
/// row.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_i16(
    vnni: bool,
    kind: WeightFormat,
    data: &[u8],
    rb: usize,
    scales: RowScales<'_>,
    per_row: usize,
    x: &crate::kernels::inputs::I16Inputs,
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(kind.simd_shape(cols) && rb == kind.row_len(cols) && n <= out.len());
    let rows = strided_rows(out.len(), n, stride);
    debug_assert!(rows <= 1 || n <= stride);
    debug_assert!(data.len() >= rows * rb && scales.holds(rows, per_row));
    debug_assert!(per_row >= cols / BLOCK && x.hi.len() >= (t0 + n) * cols);
    debug_assert!(x.lo.len() >= (t0 + n) * cols && x.d.len() >= (t0 + n) * (cols / BLOCK));
    let rows = RowsOf {
        data,
        rb,
        count: rows,
        scales,
        per_row,
    };
    // SAFETY: the caller's contract.
    unsafe { i16_dispatch(vnni, kind, &rows, x, t0, n, cols, out, stride) }
}

/// [`rows_i16`] on `rows`: the kernel instance of `kind`, `vnni` and the inputs' planes.
///
/// # Safety
/// As for [`rows_i16`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn i16_dispatch(
    vnni: bool,
    kind: WeightFormat,
    rows: &RowsOf<'_>,
    x: &crate::kernels::inputs::I16Inputs,
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    let grouped = i16_order_checked(kind, x);
    macro_rules! go {
        ($c:ty) => {
            // SAFETY: the caller's contract (AVX-VNNI available when `vnni`).
            unsafe {
                match (vnni, x.hi_only) {
                    (false, false) => {
                        i16_rows::<$c, true>(rows, x, t0, n, cols, grouped, out, stride)
                    }
                    (false, true) => {
                        i16_rows::<$c, false>(rows, x, t0, n, cols, grouped, out, stride)
                    }
                    (true, false) => {
                        i16_rows_vnni::<$c, true>(rows, x, t0, n, cols, grouped, out, stride)
                    }
                    (true, true) => {
                        i16_rows_vnni::<$c, false>(rows, x, t0, n, cols, grouped, out, stride)
                    }
                }
            }
        };
    }
    match kind {
        WeightFormat::Int4 { .. } => go!(Int4Pairs),
        WeightFormat::Mxfp4 { .. } => go!(Mxfp4Pairs),
        WeightFormat::Q8 { .. } => go!(Q8Pairs),
        _ => unreachable!("16-bit kernels take INT4, MXFP4 and Q8 only"),
    }
}

/// Whether `x` is in [`I16Order::Groups8`] (else [`I16Order::Quads`]); inputs quantized for
/// the AVX-512 tiles, or grouped for a format without groups, would give wrong sums here: a
/// panic, not an error.
///
/// [`I16Order::Groups8`]: crate::kernels::inputs::I16Order::Groups8
/// [`I16Order::Quads`]: crate::kernels::inputs::I16Order::Quads
fn i16_order_checked(kind: WeightFormat, x: &crate::kernels::inputs::I16Inputs) -> bool {
    let grouped = x.order == crate::kernels::inputs::I16Order::Groups8;
    assert!(
        x.order == crate::kernels::inputs::I16Order::Quads
            || (grouped && matches!(kind, WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. })),
        "AVX2 16-bit kernel given {kind:?} inputs in the order {:?}",
        x.order
    );
    grouped
}

/// `out[i] = f16(bytes[2i..2i+2])` for every `out`.
///
/// # Safety
/// F16C available; `bytes.len() >= 2 * out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16_to_f32(bytes: &[u8], out: &mut [f32]) {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { f16_to_f32_inline(bytes, out) }
}

/// [`f16_to_f32`] inlined into its caller: the AVX2 rows convert a row's scales per row, and
/// the call (a `target_feature` function is not inlined) was ~5% of a Q8 decode (perf).
///
/// # Safety
/// AVX2 and F16C available (the caller's features: it is only inlined into such functions);
/// `bytes.len() >= 2 * out.len()`.
#[inline(always)]
pub(crate) unsafe fn f16_to_f32_inline(bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    let body = n / 8 * 8;
    let mut i = 0;
    while i < body {
        // SAFETY: `i + 8 <= n`, so 16 bytes from `2i` are inside `bytes` and 8 floats from `i`
        // inside `out`.
        unsafe {
            let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (o, b) in out[body..]
        .iter_mut()
        .zip(bytes[2 * body..].chunks_exact(2))
    {
        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

/// `out[i] = bf16(bytes[2i..2i+2])` for every `out` (exact: a 16-bit shift).
///
/// # Safety
/// AVX2 available; `bytes.len() >= 2 * out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn bf16_to_f32(bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    let body = n / 8 * 8;
    let mut i = 0;
    while i < body {
        // SAFETY: `i + 8 <= n`, so 16 bytes from `2i` are inside `bytes` and 8 floats from `i`
        // inside `out`.
        unsafe {
            let w =
                _mm256_cvtepu16_epi32(_mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
            );
        }
        i += 8;
    }
    for (o, b) in out[body..]
        .iter_mut()
        .zip(bytes[2 * body..].chunks_exact(2))
    {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// One 32-block of [`super::quantize_inputs_i16`] on AVX2, when the block's slot order is one
/// of the two the formats use (4-bit: evens then odds; Q8: natural): the same bytes as the
/// portable loop (the same operations in the same order, rounding to nearest even,
/// NaN-preserving clamps, NaN -> 0). Returns `None`, having written nothing, for any other
/// order.
///
/// # Safety
/// AVX2 available; `xb.len() == 32`; run A (`base..base + 16`) and run B
/// (`base + runs.run_b ..][..16]`) inside `hi` and `lo`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_block_i16(
    xb: &[f32],
    extra: f32,
    runs: &crate::kernels::inputs::BlockRuns,
    base: usize,
    hi: &mut [i8],
    lo: &mut [i8],
) -> Option<(f32, f32)> {
    let evens_odds: [u8; BLOCK] =
        std::array::from_fn(|k| if k < 16 { 2 * k } else { 2 * (k - 16) + 1 } as u8);
    let natural: [u8; BLOCK] = std::array::from_fn(|k| k as u8);
    let split = if runs.src == evens_odds {
        true
    } else if runs.src == natural {
        false
    } else {
        return None;
    };
    debug_assert!(xb.len() == BLOCK && base + runs.run_b + 16 <= hi.len().min(lo.len()));
    // SAFETY: `xb` holds 32 floats.
    let v: [__m256; 4] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * i)) });
    let unord = _mm256_or_ps(
        _mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[1]),
        _mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[3]),
    );
    // With a NaN in the block the portable `fold(0, max)` decides (it skips NaNs).
    let amax = if _mm256_movemask_ps(unord) != 0 {
        crate::kernels::inputs::block_amax(xb)
    } else {
        let abs = |x: __m256| _mm256_andnot_ps(_mm256_set1_ps(-0.0), x);
        let m = _mm256_max_ps(
            _mm256_max_ps(abs(v[0]), abs(v[1])),
            _mm256_max_ps(abs(v[2]), abs(v[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        _mm_cvtss_f32(m)
    };
    let s = amax / 127.0;
    let (inv, inv_lo) = crate::kernels::inputs::i16_inverses(s);
    let (vs, vinv, vinv_lo) = (
        _mm256_set1_ps(s),
        _mm256_set1_ps(inv),
        _mm256_set1_ps(inv_lo),
    );
    let (lim_lo, lim_hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    // `max(lim, q)` returns `q` when `q` is NaN: NaN stays NaN, as in `f32::clamp`; NaN lanes
    // then become 0, as the portable `as i8` makes them.
    let clamp = |q: __m256| _mm256_min_ps(lim_hi, _mm256_max_ps(lim_lo, q));
    let to_int = |q: __m256| {
        let ok = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(q, q));
        _mm256_and_si256(_mm256_cvtps_epi32(q), ok)
    };
    let mut h = [_mm256_setzero_si256(); 4];
    let mut l = [_mm256_setzero_si256(); 4];
    for i in 0..4 {
        let hq = clamp(_mm256_round_ps::<RNE>(_mm256_mul_ps(v[i], vinv)));
        let r = _mm256_sub_ps(v[i], _mm256_mul_ps(hq, vs));
        let lq = clamp(_mm256_round_ps::<RNE>(_mm256_mul_ps(r, vinv_lo)));
        h[i] = to_int(hq);
        l[i] = to_int(lq);
    }
    let mut sum = _mm256_setzero_si256();
    for i in 0..4 {
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_slli_epi32(h[i], 8), l[i]));
    }
    let sum = _mm_add_epi32(
        _mm256_castsi256_si128(sum),
        _mm256_extracti128_si256::<1>(sum),
    );
    let sum = _mm_add_epi32(sum, _mm_shuffle_epi32::<0x4e>(sum));
    let sum = _mm_add_epi32(sum, _mm_shuffle_epi32::<0xb1>(sum));
    let sum = _mm_cvtsi128_si32(sum);
    // 32 i32 in [-127, 127] -> 32 i8 in element order (packs interleave 128-bit lanes; one
    // dword permute restores the order), then evens / odds per lane and qwords [0, 2, 1, 3]
    // for the 4-bit run order.
    let bytes = |q: [__m256i; 4]| {
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if split {
            let eo = _mm256_setr_epi8(
                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1,
                3, 5, 7, 9, 11, 13, 15,
            );
            _mm256_permute4x64_epi64::<0xd8>(_mm256_shuffle_epi8(p, eo))
        } else {
            p
        }
    };
    for (q, out) in [(h, hi), (l, lo)] {
        let b = bytes(q);
        // SAFETY: both runs of 16 bytes are inside `out` (the caller's contract).
        unsafe {
            _mm_storeu_si128(
                out.as_mut_ptr().add(base) as *mut __m128i,
                _mm256_castsi256_si128(b),
            );
            _mm_storeu_si128(
                out.as_mut_ptr().add(base + runs.run_b) as *mut __m128i,
                _mm256_extracti128_si256::<1>(b),
            );
        }
    }
    Some(crate::kernels::inputs::i16_block_scales(s, extra, sum))
}
