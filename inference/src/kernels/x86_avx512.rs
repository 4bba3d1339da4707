//! AVX-512 (F/BW/VL/VNNI) kernels, selected at run time by [`super::Isa::detect`].
//!
//! - f32 activations for F32, F16, BF16 and FP8: 32 weights per step decoded into two zmm
//!   registers (BF16 by a 16-bit shift, F16 and FP8 through `vcvtph2ps`; e4m3 is rebuilt as an
//!   f16 bit pattern worth 2^-8 of its value, exact including subnormals, as in the AVX2
//!   kernels), multiplied in f32. Scaled formats accumulate each scale group separately and
//!   scale the group's sum once.
//! - 16-bit activations ([`super::Act::I16`]) for INT4, MXFP4 and Q8: each code is made
//!   unsigned by an offset (INT4 nibbles are already offset binary, +8; MXFP4 doubled codes
//!   +12 through the `vpshufb` table; Q8 +128 by flipping the sign bit), `vpdpbusd` multiplies
//!   64 codes by the high input plane and then by the low plane (`(hi_sum << 8) + lo_sum`, exact
//!   in i32), each 32-block's integer sum is scaled once, and the offset times the block's
//!   input sum is taken off per row at the end (`-off * sum_b scale_b * sum(x_b)`).
//!
//! Results differ from [`super::scalar`] only in f32 summation order (tested within a budget).
//! Each input is summed in the same order whatever the number of inputs per call, so a
//! matrix-vector product equals the matching row of a matrix product bit for bit.

use std::arch::x86_64::*;

use super::scalar::MXFP4_X2;
use super::{I16Inputs, Kind, BLOCK};

/// Whether [`row_f32`] / [`rows4_f32`] take `kind` (the others run the AVX2 kernels).
pub fn supports_f32(kind: Kind) -> bool {
    matches!(kind, Kind::F32 | Kind::F16 | Kind::Bf16 | Kind::Fp8 { .. })
}

/// f32-activation kernels: `out[t] = sum_c w[c] * x[t*cols + c]`.
macro_rules! f32_tile {
    ($name:ident, $rows_name:ident, $scaled:expr, |$p:ident, $c:ident| $decode:expr) => {
        /// One row against `N` inputs.
        ///
        /// # Safety
        /// AVX-512 F/BW/VL, FMA and F16C available; `cols` and `group` multiples of 32; `row`
        /// holds a whole row of `cols` values, `scales` `cols.div_ceil(group)` values, `x`
        /// `N * cols`, `out` `N`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
            // Bytes per column; the next row (usually the next one this task reads) is
            // prefetched at the same position: a hint.
            let (bpc, ahead) = (row.len() / cols, row.len());
            let mut acc = [[_mm512_setzero_ps(); 2]; N];
            let mut c = 0usize;
            // Two steps per iteration into separate accumulators (four chains per input), so
            // the FMA latency does not bound a single input.
            macro_rules! step {
                ($g:ident, $j:expr) => {{
                    let $c = c;
                    // SAFETY: `c + 32 <= cols` (group and cols are multiples of 32 and the
                    // group end is at most `cols`), so the decode reads inside the row and the
                    // input loads read `x[t*cols + c ..][..32]` with `t < N`, inside `x`.
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>($p.wrapping_add(c * bpc + ahead) as *const i8);
                        let w: [__m512; 2] = $decode;
                        for (t, g) in $g.iter_mut().enumerate() {
                            let xr = xp.add(t * cols + c);
                            g[$j] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), g[$j]);
                            g[$j + 1] =
                                _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr.add(16)), g[$j + 1]);
                        }
                    }
                    c += BLOCK;
                }};
            }
            for gi in 0..cols.div_ceil(group) {
                let end = (c + group).min(cols);
                let mut g = [[_mm512_setzero_ps(); 4]; N];
                while c + 2 * BLOCK <= end {
                    step!(g, 0);
                    step!(g, 2);
                }
                if c < end {
                    step!(g, 0);
                }
                for (a, g) in acc.iter_mut().zip(&g) {
                    let g0 = _mm512_add_ps(g[0], g[2]);
                    let g1 = _mm512_add_ps(g[1], g[3]);
                    if $scaled {
                        let sv = _mm512_set1_ps(scales[gi] * smul);
                        a[0] = _mm512_fmadd_ps(g0, sv, a[0]);
                        a[1] = _mm512_fmadd_ps(g1, sv, a[1]);
                    } else {
                        a[0] = _mm512_add_ps(g0, a[0]);
                        a[1] = _mm512_add_ps(g1, a[1]);
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
            }
        }

        /// `R` rows against one input: each 32-value slice of `x` is loaded once for all `R`
        /// rows.
        ///
        /// # Safety
        /// As for the single-row tile, for each of the `R` rows (`rows[r]` a whole row,
        /// `scales[r]` its scales), `x` holding `cols` values and `out` `R`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
            // Bytes per column, and how far ahead to prefetch (the next tile of `R` rows).
            let bpc = rows[0].len() / cols;
            let ahead = R * rows[0].len();
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            let mut c = 0usize;
            for gi in 0..cols.div_ceil(group) {
                let end = (c + group).min(cols);
                let mut g = [[_mm512_setzero_ps(); 2]; R];
                while c < end {
                    // SAFETY: `c + 32 <= cols`, so the input loads read inside `x` and each
                    // row's decode reads inside that row (see the single-row tile).
                    unsafe {
                        let x0 = _mm512_loadu_ps(xp.add(c));
                        let x1 = _mm512_loadu_ps(xp.add(c + 16));
                        for (r, g) in g.iter_mut().enumerate() {
                            let $p = rows[r].as_ptr();
                            // The same position `R` rows on (the next tile's rows): a hint.
                            _mm_prefetch::<_MM_HINT_T0>(
                                $p.wrapping_add(c * bpc + ahead) as *const i8
                            );
                            let $c = c;
                            let w: [__m512; 2] = $decode;
                            g[0] = _mm512_fmadd_ps(w[0], x0, g[0]);
                            g[1] = _mm512_fmadd_ps(w[1], x1, g[1]);
                        }
                    }
                    c += BLOCK;
                }
                for (r, (a, g)) in acc.iter_mut().zip(&g).enumerate() {
                    if $scaled {
                        let sv = _mm512_set1_ps(scales[r][gi] * smul);
                        a[0] = _mm512_fmadd_ps(g[0], sv, a[0]);
                        a[1] = _mm512_fmadd_ps(g[1], sv, a[1]);
                    } else {
                        a[0] = _mm512_add_ps(g[0], a[0]);
                        a[1] = _mm512_add_ps(g[1], a[1]);
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
            }
        }
    };
}

f32_tile!(f32_f32, rows_f32, false, |p, c| {
    let q = p.add(4 * c) as *const f32;
    [_mm512_loadu_ps(q), _mm512_loadu_ps(q.add(16))]
});

f32_tile!(f32_bf16, rows_bf16, false, |p, c| {
    let q = p.add(2 * c);
    let cvt = |o: usize| {
        _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(q.add(o) as *const __m256i)),
            16,
        ))
    };
    [cvt(0), cvt(32)]
});

f32_tile!(f32_f16, rows_f16, false, |p, c| {
    let q = p.add(2 * c);
    [
        _mm512_cvtph_ps(_mm256_loadu_si256(q as *const __m256i)),
        _mm512_cvtph_ps(_mm256_loadu_si256(q.add(32) as *const __m256i)),
    ]
});

f32_tile!(f32_fp8, rows_fp8, true, |p, c| {
    // e4m3 -> f16 bits: each byte into the high half of a 16-bit lane (sign at bit 15), an
    // arithmetic shift right by one (exponent and mantissa land on f16's low exponent and high
    // mantissa bits, the sign is copied into bit 14) and bit 14 cleared.
    let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(c) as *const __m256i));
    let h = _mm512_and_si512(
        _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 1),
        _mm512_set1_epi16(-0x4001), // 0xbfff
    );
    [
        _mm512_cvtph_ps(_mm512_castsi512_si256(h)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)),
    ]
});

/// f32-activation row kernel for the formats [`supports_f32`] names.
///
/// # Safety
/// AVX-512 F/BW/VL, AVX2, FMA and F16C available; `supports_f32(kind)`;
/// `kind.simd_shape(cols)`; `row.len() == kind.row_bytes(cols)`,
/// `scales.len() >= cols.div_ceil(kind.group(cols))`, `x.len() >= n * cols`, `out.len() >= n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn row_f32(
    kind: Kind,
    row: &[u8],
    scales: &[f32],
    x: &[f32],
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && row.len() == kind.row_bytes(cols));
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
        match kind {
            Kind::F32 => go!(f32_f32, 1.0),
            Kind::Bf16 => go!(f32_bf16, 1.0),
            Kind::F16 => go!(f32_f16, 1.0),
            Kind::Fp8 { .. } => go!(f32_fp8, 256.0),
            _ => unreachable!("AVX-512 f32 kernels take F32, F16, BF16 and FP8 only"),
        }
        t += take;
    }
}

/// Four rows against one input (matrix-vector products): `out[r] = dot(rows[r], x)`.
///
/// # Safety
/// As for [`row_f32`] with `n == 1`, for each of the four rows and their scales; `out` holds 4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn rows4_f32(
    kind: Kind,
    rows: [&[u8]; 4],
    scales: [&[f32]; 4],
    x: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && rows.iter().all(|r| r.len() == kind.row_bytes(cols)));
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
        Kind::F32 => go!(rows_f32, 1.0),
        Kind::Bf16 => go!(rows_bf16, 1.0),
        Kind::F16 => go!(rows_f16, 1.0),
        Kind::Fp8 { .. } => go!(rows_fp8, 256.0),
        _ => unreachable!("AVX-512 f32 kernels take F32, F16, BF16 and FP8 only"),
    }
}

/// The unsigned-code decoders of the 16-bit-activation kernels: two 32-blocks into one zmm
/// (block `b` in bytes 0..32, `b + 1` in 32..64) and one block into a ymm, each block in the
/// input order of [`super::quantize_inputs_i16`] (4-bit formats: evens, then odds).
trait Codes {
    /// What was added to every code to make it unsigned.
    const OFFSET: i32;
    /// Packed bytes of one 32-block.
    const BLOCK_BYTES: usize;
    /// Whether [`Codes::quad`] applies.
    const QUAD: bool;
    /// Blocks `b..b + 4` as two zmm (4-bit: the evens and the odds of the four blocks; Q8:
    /// their first and last 16 codes); in both, lanes `4j..4j + 4` hold codes of block `b + j`.
    ///
    /// # Safety
    /// AVX-512 F/BW available; blocks `b..b + 4` lie inside the row at `p`.
    unsafe fn quad(p: *const u8, b: usize) -> (__m512i, __m512i) {
        let _ = (p, b);
        unreachable!("quad decode is for the 4-bit formats")
    }
    /// # Safety
    /// AVX-512 F/BW available; blocks `b` and `b + 1` lie inside the row at `p`.
    unsafe fn two(p: *const u8, b: usize) -> __m512i;
    /// # Safety
    /// AVX-512 F/BW/VL available; block `b` lies inside the row at `p`.
    unsafe fn one(p: *const u8, b: usize) -> __m256i;
}

/// Splits 32 packed bytes (two blocks of nibbles) into `[b evens, b odds, b+1 evens, b+1 odds]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn nibbles_two(v: __m256i) -> __m512i {
    // Qwords [0,1,0,1,2,3,2,3]: each block's 16 bytes twice; the second copy shifted by 4.
    let z = _mm512_permutexvar_epi64(
        _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
        _mm512_castsi256_si512(v),
    );
    let z = _mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn nibbles_one(v: __m128i) -> __m256i {
    let y = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    _mm256_and_si256(y, _mm256_set1_epi8(0x0f))
}

/// Low and high nibbles of 64 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn nibbles_quad(v: __m512i) -> (__m512i, __m512i) {
    let m = _mm512_set1_epi8(0x0f);
    (
        _mm512_and_si512(v, m),
        _mm512_and_si512(_mm512_srli_epi16(v, 4), m),
    )
}

struct Int4Codes;
impl Codes for Int4Codes {
    const OFFSET: i32 = 8;
    const BLOCK_BYTES: usize = 16;
    const QUAD: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quad(p: *const u8, b: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller guarantees the 64 bytes of blocks b..b+4 are inside the row.
        nibbles_quad(unsafe { _mm512_loadu_si512(p.add(b * 16) as *const __m512i) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn two(p: *const u8, b: usize) -> __m512i {
        // SAFETY: the caller guarantees the 32 bytes of blocks b, b+1 are inside the row.
        nibbles_two(unsafe { _mm256_loadu_si256(p.add(b * 16) as *const __m256i) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn one(p: *const u8, b: usize) -> __m256i {
        // SAFETY: the caller guarantees the 16 bytes of block b are inside the row.
        nibbles_one(unsafe { _mm_loadu_si128(p.add(b * 16) as *const __m128i) })
    }
}

/// MXFP4 doubled codes plus 12 (0..=24), the `vpshufb` table.
fn mxfp4_table() -> [i8; 16] {
    MXFP4_X2.map(|v| v + 12)
}

struct Mxfp4Codes;
impl Codes for Mxfp4Codes {
    const OFFSET: i32 = 12;
    const BLOCK_BYTES: usize = 16;
    const QUAD: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quad(p: *const u8, b: usize) -> (__m512i, __m512i) {
        // SAFETY: the table is 16 bytes; the caller guarantees blocks b..b+4 are in the row.
        unsafe {
            let lut =
                _mm512_broadcast_i32x4(_mm_loadu_si128(mxfp4_table().as_ptr() as *const __m128i));
            let (lo, hi) = Int4Codes::quad(p, b);
            (_mm512_shuffle_epi8(lut, lo), _mm512_shuffle_epi8(lut, hi))
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn two(p: *const u8, b: usize) -> __m512i {
        // SAFETY: the table is 16 bytes; the caller guarantees blocks b, b+1 are in the row.
        unsafe {
            let lut =
                _mm512_broadcast_i32x4(_mm_loadu_si128(mxfp4_table().as_ptr() as *const __m128i));
            _mm512_shuffle_epi8(lut, Int4Codes::two(p, b))
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn one(p: *const u8, b: usize) -> __m256i {
        // SAFETY: as above for block b.
        unsafe {
            let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                mxfp4_table().as_ptr() as *const __m128i
            ));
            _mm256_shuffle_epi8(lut, Int4Codes::one(p, b))
        }
    }
}

struct Q8Codes;
impl Codes for Q8Codes {
    const OFFSET: i32 = 128;
    const BLOCK_BYTES: usize = 32;
    const QUAD: bool = true;
    /// The first 16 codes of blocks `b..b + 4`, then their last 16 (two 128-bit lane shuffles
    /// of the 128 bytes), sign bits flipped.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quad(p: *const u8, b: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller guarantees the 128 bytes of blocks b..b+4 are inside the row.
        let (v1, v2) = unsafe {
            (
                _mm512_loadu_si512(p.add(b * 32) as *const __m512i),
                _mm512_loadu_si512(p.add(b * 32 + 64) as *const __m512i),
            )
        };
        let flip = _mm512_set1_epi8(-128);
        (
            _mm512_xor_si512(_mm512_shuffle_i64x2::<0x88>(v1, v2), flip),
            _mm512_xor_si512(_mm512_shuffle_i64x2::<0xDD>(v1, v2), flip),
        )
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn two(p: *const u8, b: usize) -> __m512i {
        // SAFETY: the caller guarantees the 64 bytes of blocks b, b+1 are inside the row.
        let v = unsafe { _mm512_loadu_si512(p.add(b * 32) as *const __m512i) };
        _mm512_xor_si512(v, _mm512_set1_epi8(-128))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn one(p: *const u8, b: usize) -> __m256i {
        // SAFETY: the caller guarantees the 32 bytes of block b are inside the row.
        let v = unsafe { _mm256_loadu_si256(p.add(b * 32) as *const __m256i) };
        _mm256_xor_si256(v, _mm256_set1_epi8(-128))
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// `R` rows against `N` 16-bit inputs (`R == 1` or `N == 1`): per run of four 32-blocks (4-bit
/// formats) or pair of blocks, each input's planes are loaded once for all rows (zmm loads, not
/// arithmetic, bound these loops), two `vpdpbusd` per plane pair, the block scales (weight x
/// input) multiplied in a 128-bit register and spread over each block's lanes, and two
/// accumulators per output (alternate steps) so the FMA latency does not bound the loop. Each
/// output is summed in the same order whatever `R` and `N` are. The offset correction is added
/// at the end; `out[r * N + t]`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI available; `cols` a multiple of 32; each `rows[r]` a whole row of
/// `cols` codes with `ws[r]` its `cols / 32` weight scales; `hi`/`lo` `N * cols` codes, `d`
/// `N * cols / 32` input scales, `corr` and `out` `R * N` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn i16_tile<C: Codes, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    ws: [&[f32]; R],
    d: &[f32],
    corr: &[f32],
    hi: &[i8],
    lo: &[i8],
    cols: usize,
    out: &mut [f32],
) {
    let p: [*const u8; R] = std::array::from_fn(|r| rows[r].as_ptr());
    // Prefetch the same position `R` rows on (the next tile's rows, when rows are consecutive;
    // a hint only, so past the matrix it is harmless): the hardware prefetcher does not run
    // far enough ahead of `R` interleaved streams.
    let ahead = R * rows[0].len();
    let (hp, lp) = (hi.as_ptr(), lo.as_ptr());
    let blocks = cols / BLOCK;
    let ws: [&[f32]; R] = std::array::from_fn(|r| &ws[r][..blocks]);
    let d = &d[..N * blocks];
    // Lanes 0..8 hold block b's partial sums, lanes 8..16 block b + 1's.
    let pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    // Lanes 4j..4j+4 hold block b + j's partial sums.
    let quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let mut acc = [[[_mm512_setzero_ps(); 2]; N]; R];
    let mut tail = [[_mm256_setzero_ps(); N]; R];
    macro_rules! quad_step {
        ($b:expr, $j:expr) => {{
            let b = $b;
            // SAFETY: `b + 4 <= blocks`: the decodes read blocks b..b+4 of each row, the input
            // loads read `[t*cols + 32b ..][..128]` of each plane, `ws[r][b..b+4]` and
            // `d[t*blocks + b ..][..4]`, `t < N`.
            unsafe {
                let x: [[__m512i; 4]; N] = std::array::from_fn(|t| {
                    let o = t * cols + b * BLOCK;
                    [
                        _mm512_loadu_si512(hp.add(o) as *const __m512i),
                        _mm512_loadu_si512(hp.add(o + 64) as *const __m512i),
                        _mm512_loadu_si512(lp.add(o) as *const __m512i),
                        _mm512_loadu_si512(lp.add(o + 64) as *const __m512i),
                    ]
                });
                for r in 0..R {
                    for line in (0..4 * C::BLOCK_BYTES).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(
                            p[r].wrapping_add(b * C::BLOCK_BYTES + line + ahead) as *const i8,
                        );
                    }
                    let (ev, od) = C::quad(p[r], b);
                    let w4 = _mm_loadu_ps(ws[r].as_ptr().add(b));
                    for t in 0..N {
                        let [h0, h1, l0, l1] = x[t];
                        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ev, h0);
                        let s = _mm512_dpbusd_epi32(s, od, h1);
                        let s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), ev, l0);
                        let s = _mm512_dpbusd_epi32(s, od, l1);
                        let d4 = _mm_loadu_ps(d.as_ptr().add(t * blocks + b));
                        let sv =
                            _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_mul_ps(w4, d4)));
                        acc[r][t][$j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, acc[r][t][$j]);
                    }
                }
            }
        }};
    }
    macro_rules! pair_step {
        ($b:expr, $j:expr) => {{
            let b = $b;
            // SAFETY: `b + 2 <= blocks`: the decodes read blocks b, b+1 of each row, the input
            // loads read `[t*cols + 32b ..][..64]` of each plane, `ws[r][b..b+2]` and
            // `d[t*blocks + b ..][..2]`, `t < N`.
            unsafe {
                let x: [[__m512i; 2]; N] = std::array::from_fn(|t| {
                    let o = t * cols + b * BLOCK;
                    [
                        _mm512_loadu_si512(hp.add(o) as *const __m512i),
                        _mm512_loadu_si512(lp.add(o) as *const __m512i),
                    ]
                });
                for r in 0..R {
                    _mm_prefetch::<_MM_HINT_T0>(
                        p[r].wrapping_add(b * C::BLOCK_BYTES + ahead) as *const i8
                    );
                    let u = C::two(p[r], b);
                    let w2 = _mm_castpd_ps(_mm_load_sd(ws[r].as_ptr().add(b) as *const f64));
                    for t in 0..N {
                        let [xh, xl] = x[t];
                        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xh);
                        let s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), u, xl);
                        let d2 = _mm_castpd_ps(_mm_load_sd(
                            d.as_ptr().add(t * blocks + b) as *const f64
                        ));
                        let sv =
                            _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_mul_ps(w2, d2)));
                        acc[r][t][$j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, acc[r][t][$j]);
                    }
                }
            }
        }};
    }
    let mut b = 0usize;
    if C::QUAD {
        while b + 8 <= blocks {
            quad_step!(b, 0);
            quad_step!(b + 4, 1);
            b += 8;
        }
        if b + 4 <= blocks {
            quad_step!(b, 0);
            b += 4;
        }
    }
    while b + 4 <= blocks {
        pair_step!(b, 0);
        pair_step!(b + 2, 1);
        b += 4;
    }
    if b + 2 <= blocks {
        pair_step!(b, 0);
        b += 2;
    }
    if b < blocks {
        // SAFETY: `b < blocks`: block b of each row, `[t*cols + 32b ..][..32]` of each plane,
        // `ws[r][b]` and `d[t*blocks + b]`.
        unsafe {
            for r in 0..R {
                let u = C::one(p[r], b);
                for t in 0..N {
                    let o = t * cols + b * BLOCK;
                    let xh = _mm256_loadu_si256(hp.add(o) as *const __m256i);
                    let xl = _mm256_loadu_si256(lp.add(o) as *const __m256i);
                    let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xh);
                    let s = _mm256_dpbusd_epi32(_mm256_slli_epi32(s, 8), u, xl);
                    let sv = _mm256_set1_ps(ws[r][b] * d[t * blocks + b]);
                    tail[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sv, tail[r][t]);
                }
            }
        }
    }
    for r in 0..R {
        for t in 0..N {
            let a = _mm512_add_ps(acc[r][t][0], acc[r][t][1]);
            out[r * N + t] = _mm512_reduce_add_ps(a) + hsum256(tail[r][t]) + corr[r * N + t];
        }
    }
}

fn offset_of(kind: Kind) -> f32 {
    (match kind {
        Kind::Int4 { .. } => Int4Codes::OFFSET,
        Kind::Mxfp4 { .. } => Mxfp4Codes::OFFSET,
        Kind::Q8 { .. } => Q8Codes::OFFSET,
        _ => unreachable!("16-bit kernels take INT4, MXFP4 and Q8 only"),
    }) as f32
}

/// What the code offset added to input `t`'s dot product with a row of weight scales `ws`:
/// `offset * sum_b ws_b * d_b * sum(x_b)`.
#[target_feature(enable = "avx512f")]
fn offset_excess(kind: Kind, ws: &[f32], x: &I16Inputs, t: usize, blocks: usize) -> f32 {
    offset_of(kind) * dot_f32(&ws[..blocks], &x.dsums[t * blocks..(t + 1) * blocks])
}

/// `sum(a[i] * b[i])` over the shorter length, 16 lanes at a time (the scalar dot of each
/// row's block scales with the input sums costed a third of the INT4 kernel).
#[target_feature(enable = "avx512f")]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`, within both slices.
        let (va, vb) = unsafe {
            (
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
            )
        };
        let j = (i / 16) % 2;
        acc[j] = _mm512_fmadd_ps(va, vb, acc[j]);
        i += 16;
    }
    if i < n {
        let m: __mmask16 = (1u16 << (n - i)) - 1;
        // SAFETY: the mask enables lanes `i..n` only; masked-off lanes are not read.
        let (va, vb) = unsafe {
            (
                _mm512_maskz_loadu_ps(m, a.as_ptr().add(i)),
                _mm512_maskz_loadu_ps(m, b.as_ptr().add(i)),
            )
        };
        acc[0] = _mm512_fmadd_ps(va, vb, acc[0]);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
}

/// 16-bit-activation row kernel (INT4, MXFP4, Q8); `scales` has one value per 32-block.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2 and FMA available; `kind.simd_shape(cols)`;
/// `row.len() == kind.row_bytes(cols)`, `scales.len() >= cols / 32`; `x.hi`/`x.lo` hold at
/// least `n * cols` codes and `x.d`/`x.dsums` `n * cols / 32` values; `out.len() >= n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn row_i16(
    kind: Kind,
    row: &[u8],
    scales: &[f32],
    x: &I16Inputs,
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && row.len() == kind.row_bytes(cols));
    let blocks = cols / BLOCK;
    debug_assert!(x.hi.len() >= n * cols && x.lo.len() >= n * cols);
    debug_assert!(x.d.len() >= n * blocks && x.dsums.len() >= n * blocks && out.len() >= n);
    debug_assert!(scales.len() >= blocks);
    let ws = &scales[..blocks];
    let mut t = 0;
    while t < n {
        let k = (n - t).min(4);
        let mut corr = [0f32; 4];
        for (j, c) in corr[..k].iter_mut().enumerate() {
            *c = -offset_excess(kind, ws, x, t + j, blocks);
        }
        let hi = &x.hi[t * cols..(t + k) * cols];
        let lo = &x.lo[t * cols..(t + k) * cols];
        let d = &x.d[t * blocks..(t + k) * blocks];
        let cs = &corr[..k];
        let o = &mut out[t..t + k];
        macro_rules! go {
            ($c:ty) => {
                // SAFETY: the caller's contract is the tile's; `hi`, `lo`, `d`, `cs` and `o`
                // hold exactly `k` inputs / outputs.
                unsafe {
                    match k {
                        4 => i16_tile::<$c, 1, 4>([row], [ws], d, cs, hi, lo, cols, o),
                        3 => i16_tile::<$c, 1, 3>([row], [ws], d, cs, hi, lo, cols, o),
                        2 => i16_tile::<$c, 1, 2>([row], [ws], d, cs, hi, lo, cols, o),
                        _ => i16_tile::<$c, 1, 1>([row], [ws], d, cs, hi, lo, cols, o),
                    }
                }
            };
        }
        match kind {
            Kind::Int4 { .. } => go!(Int4Codes),
            Kind::Mxfp4 { .. } => go!(Mxfp4Codes),
            Kind::Q8 { .. } => go!(Q8Codes),
            _ => unreachable!("16-bit kernels take INT4, MXFP4 and Q8 only"),
        }
        t += k;
    }
}

/// `R` rows against one 16-bit input (matrix-vector products): `out[r] = dot(rows[r], x)`.
///
/// # Safety
/// As for [`row_i16`] with `n == 1`, for each of the `R` rows and their scales; `out` holds `R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn rows_i16<const R: usize>(
    kind: Kind,
    rows: [&[u8]; R],
    scales: [&[f32]; R],
    x: &I16Inputs,
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && rows.iter().all(|r| r.len() == kind.row_bytes(cols)));
    let blocks = cols / BLOCK;
    debug_assert!(x.hi.len() >= cols && x.lo.len() >= cols && out.len() >= R);
    debug_assert!(scales.iter().all(|s| s.len() >= blocks));
    let ws: [&[f32]; R] = std::array::from_fn(|r| &scales[r][..blocks]);
    let corr: [f32; R] = std::array::from_fn(|r| -offset_excess(kind, ws[r], x, 0, blocks));
    let (hi, lo, d) = (&x.hi[..cols], &x.lo[..cols], &x.d[..blocks]);
    macro_rules! go {
        ($c:ty) => {
            // SAFETY: the caller's contract is the tile's; one input, `R` rows and outputs.
            unsafe { i16_tile::<$c, R, 1>(rows, ws, d, &corr, hi, lo, cols, out) }
        };
    }
    match kind {
        Kind::Int4 { .. } => go!(Int4Codes),
        Kind::Mxfp4 { .. } => go!(Mxfp4Codes),
        Kind::Q8 { .. } => go!(Q8Codes),
        _ => unreachable!("16-bit kernels take INT4, MXFP4 and Q8 only"),
    }
}

/// `out[i] = 2^(bytes[i] - 127)` (OCP e8m0: 0 is 2^-127, 255 NaN) for every `out`.
///
/// # Safety
/// AVX-512 F/BW available; `bytes.len() >= out.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn e8m0_to_f32(bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n <= bytes.len()`: 16 bytes and 16 floats from `i`.
        unsafe {
            let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.as_ptr().add(i) as *const __m128i));
            let bits = _mm512_slli_epi32(e, 23);
            let zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
            let nan = _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255));
            let bits = _mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x0040_0000));
            let bits = _mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7fc0_0000));
            _mm512_storeu_si512(out.as_mut_ptr().add(i) as *mut __m512i, bits);
        }
        i += 16;
    }
    for (o, &e) in out[i..].iter_mut().zip(&bytes[i..]) {
        *o = f32::from_bits(super::e8m0_bits(e));
    }
}

/// `out[i] = bf16(bytes[2i..2i+2])` for every `out`.
///
/// # Safety
/// AVX-512 F/BW available; `bytes.len() >= 2 * out.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn bf16_to_f32(bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`: 32 bytes from `2i` and 16 floats from `i`.
        unsafe {
            let h = _mm256_loadu_si256(bytes.as_ptr().add(2 * i) as *const __m256i);
            let bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_storeu_si512(out.as_mut_ptr().add(i) as *mut __m512i, bits);
        }
        i += 16;
    }
    for (o, b) in out[i..].iter_mut().zip(bytes[2 * i..].chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// One 32-block of [`super::quantize_inputs_i16`]: the same bytes as its portable loop (the
/// same operations in the same order, rounding to nearest even), written to the block's two
/// runs of 16 slots from `base`; returns `(d, dsum)`.
///
/// # Safety
/// AVX-512 F/BW/VL available; `xb.len() == 32`; `base + runs.run_b + 16 <= hi.len()` and
/// the same for `lo`, with run A (`base..base + 16`) inside too.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub unsafe fn quantize_block_i16(
    xb: &[f32],
    extra: f32,
    runs: &super::BlockRuns,
    base: usize,
    hi: &mut [i8],
    lo: &mut [i8],
) -> (f32, f32) {
    debug_assert!(xb.len() == BLOCK && base + runs.run_b + 16 <= hi.len().min(lo.len()));
    // SAFETY: `xb` holds 32 floats.
    let (v0, v1) = unsafe {
        (
            _mm512_loadu_ps(xb.as_ptr()),
            _mm512_loadu_ps(xb.as_ptr().add(16)),
        )
    };
    // With a NaN in the block the portable `fold(0, max)` (which skips NaNs) decides: a
    // vector max would keep or drop a NaN depending on its lane.
    let amax = if _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v0, v1) != 0 {
        xb.iter().fold(0f32, |m, v| m.max(v.abs()))
    } else {
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)))
    };
    let s = amax / 127.0;
    let (inv, inv_lo) = super::i16_inverses(s);
    let (vs, vinv, vinv_lo) = (
        _mm512_set1_ps(s),
        _mm512_set1_ps(inv),
        _mm512_set1_ps(inv_lo),
    );
    let (lim_lo, lim_hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    // `max(lim, q)` returns `q` when `q` is NaN: NaN stays NaN, as in `f32::clamp`.
    let clamp = |q: __m512| _mm512_min_ps(lim_hi, _mm512_max_ps(lim_lo, q));
    let split = |v: __m512| {
        let h = clamp(_mm512_roundscale_ps::<RNE>(_mm512_mul_ps(v, vinv)));
        let r = _mm512_sub_ps(v, _mm512_mul_ps(h, vs));
        let l = clamp(_mm512_roundscale_ps::<RNE>(_mm512_mul_ps(r, vinv_lo)));
        // NaN lanes become 0, as the scalar `as i8` makes them.
        let clean = |q: __m512| _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(q, q), q);
        (clean(h), clean(l))
    };
    let (h0, l0) = split(v0);
    let (h1, l1) = split(v1);
    // SAFETY: `runs.src` holds 32 indices < 32: the two-source permute's index vectors.
    let (ia, ib) = unsafe {
        let idx = _mm256_loadu_si256(runs.src.as_ptr() as *const __m256i);
        (
            _mm512_cvtepu8_epi32(_mm256_castsi256_si128(idx)),
            _mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(idx)),
        )
    };
    let sum = _mm512_add_epi32(
        _mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0),
        _mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1),
    );
    let sum = _mm512_reduce_add_epi32(sum);
    for (codes, out) in [((h0, h1), hi), ((l0, l1), lo)] {
        let a = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(codes.0, ia, codes.1));
        let b = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(codes.0, ib, codes.1));
        // SAFETY: both runs of 16 bytes are inside `out` (the caller's contract).
        unsafe {
            _mm_storeu_si128(out.as_mut_ptr().add(base) as *mut __m128i, a);
            _mm_storeu_si128(out.as_mut_ptr().add(base + runs.run_b) as *mut __m128i, b);
        }
    }
    let d = s / 256.0 * extra;
    (d, d * sum as f32)
}
