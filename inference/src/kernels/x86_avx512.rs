//! AVX-512 (F/BW/VL/VNNI) kernels, selected at run time by [`super::Isa::detect`].
//!
//! - f32 activations for F32, F16, BF16 and FP8: 32 weights per step decoded into two zmm
//!   registers (BF16 from one load by a shift and a mask, against inputs reordered evens then
//!   odds per 32-block by [`bf16_input_order`]; F16 and FP8 through `vcvtph2ps`; e4m3 is rebuilt as an
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

use crate::kernels::scalar::MXFP4_X2;
use deltafin_formats::{ScaleType, WeightFormat};

use crate::kernels::inputs::{I16Inputs, I16Order};
use crate::kernels::shape::{KernelShape, BLOCK};

/// Whether [`row_f32`] / [`rows4_f32`] take `kind` (the others run the AVX2 kernels).
pub fn supports_f32(kind: WeightFormat) -> bool {
    matches!(
        kind,
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 | WeightFormat::Fp8Block { .. }
    )
}

/// How far ahead (bytes) the tiles prefetch at least: one short row (BF16
/// experts' 1-2 KiB) ahead was too close for DRAM latency at 2 threads (decode 72 -> 76 tokens/s
/// at 4 KiB on the 3.1B BF16 synth, benches/vs_llamacpp.sh model, Zen 5). The hint is T1 (into
/// L2), not T0: on Zen 4 a T0 prefetch holds one of the few L1 miss buffers for the whole DRAM
/// round trip, which capped one core's stream at half the read rate (matrix-vector expert
/// passes 20 -> 26 GB/s BF16, 12 -> 23 GB/s Q8, 13 -> 20 GB/s INT4, examples/stream_rate;
/// benches/results/prefetch_hint_session12.txt); 16 KiB ahead into L2 is as fast as 4 KiB.
pub(super) const MIN_PREFETCH_AHEAD: usize = 16384;

/// f32-activation kernels: `out[t] = sum_c w[c] * x[t*cols + c]`.
///
/// Every (row, input) sum is accumulated the same way in every tile: two 16-lane
/// accumulators (the first and second half of each 32-column block) over a scale group, then
/// (scaled formats) `acc += sum * scale` or (unscaled: one group) the sum itself, then one
/// reduction. So each output is bit-identical whichever tile computes it (matrix-vector,
/// several rows, or a matrix product), and a tile of `R` rows and `N` inputs needs `2RN`
/// accumulators (unscaled) or `4RN` (scaled): the matrix-product tile takes four inputs of
/// the unscaled formats at a time, each weight load and decode serving four inputs.
macro_rules! f32_tile {
    ($name:ident, $rows_name:ident, $pair_name:ident, $scaled:expr, |$p:ident, $c:ident| $decode:expr) => {
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
            // Bytes per column; the same position at least `MIN_PREFETCH_AHEAD` on (the next
            // rows this task reads) is prefetched: a hint.
            let (bpc, ahead) = (row.len() / cols, row.len().max(MIN_PREFETCH_AHEAD));
            let mut acc = [[_mm512_setzero_ps(); 2]; N];
            let mut c = 0usize;
            for gi in 0..cols.div_ceil(group) {
                let end = (c + group).min(cols);
                let mut g = [[_mm512_setzero_ps(); 2]; N];
                while c < end {
                    let $c = c;
                    // SAFETY: `c + 32 <= cols` (group and cols are multiples of 32 and the
                    // group end is at most `cols`), so the decode reads inside the row and the
                    // input loads read `x[t*cols + c ..][..32]` with `t < N`, inside `x`.
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T1>($p.wrapping_add(c * bpc + ahead) as *const i8);
                        let w: [__m512; 2] = $decode;
                        for (t, g) in g.iter_mut().enumerate() {
                            let xr = xp.add(t * cols + c);
                            g[0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), g[0]);
                            g[1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr.add(16)), g[1]);
                        }
                    }
                    c += BLOCK;
                }
                for (a, g) in acc.iter_mut().zip(&g) {
                    if $scaled {
                        let sv = _mm512_set1_ps(scales[gi] * smul);
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

        /// Two rows against `N` inputs (matrix products): each input slice is loaded once for
        /// both rows and each decoded weight is used `N` times; every output equals the
        /// single-row tile's bit for bit.
        ///
        /// # Safety
        /// As for the single-row tile, for both rows (`rows[r]` a whole row, `scales[r]` its
        /// scales), `x` holding `N * cols` values and each `outs[r]` `N`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        unsafe fn $pair_name<const N: usize>(
            rows: [&[u8]; 2],
            scales: [&[f32]; 2],
            smul: f32,
            group: usize,
            x: &[f32],
            cols: usize,
            outs: [&mut [f32]; 2],
        ) {
            let xp = x.as_ptr();
            let bpc = rows[0].len() / cols;
            let ahead = (2 * rows[0].len()).max(MIN_PREFETCH_AHEAD);
            let mut acc = [[[_mm512_setzero_ps(); 2]; N]; 2];
            let mut c = 0usize;
            for gi in 0..cols.div_ceil(group) {
                let end = (c + group).min(cols);
                let mut g = [[[_mm512_setzero_ps(); 2]; N]; 2];
                while c < end {
                    let $c = c;
                    // SAFETY: `c + 32 <= cols` (as in the single-row tile), so each row's
                    // decode reads inside that row and the input loads read
                    // `x[t*cols + c ..][..32]` with `t < N`, inside `x`.
                    unsafe {
                        let w: [[__m512; 2]; 2] = std::array::from_fn(|r| {
                            let $p = rows[r].as_ptr();
                            _mm_prefetch::<_MM_HINT_T1>(
                                $p.wrapping_add(c * bpc + ahead) as *const i8
                            );
                            $decode
                        });
                        for t in 0..N {
                            let xr = xp.add(t * cols + c);
                            let (x0, x1) = (_mm512_loadu_ps(xr), _mm512_loadu_ps(xr.add(16)));
                            for r in 0..2 {
                                g[r][t][0] = _mm512_fmadd_ps(w[r][0], x0, g[r][t][0]);
                                g[r][t][1] = _mm512_fmadd_ps(w[r][1], x1, g[r][t][1]);
                            }
                        }
                    }
                    c += BLOCK;
                }
                for (r, (ar, gr)) in acc.iter_mut().zip(&g).enumerate() {
                    for (a, g) in ar.iter_mut().zip(gr) {
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
            }
            for (out, ar) in outs.into_iter().zip(&acc) {
                for (o, a) in out.iter_mut().zip(ar) {
                    *o = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
                }
            }
        }

        /// `R` rows against one input: each 32-value slice of `x` is loaded once for all `R`
        /// rows; each row summed as the single-row tile sums it (bit-identical).
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
                            _mm_prefetch::<_MM_HINT_T1>(
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

f32_tile!(f32_f32, rows_f32, pair_f32, false, |p, c| {
    let q = p.add(4 * c) as *const f32;
    [_mm512_loadu_ps(q), _mm512_loadu_ps(q.add(16))]
});

f32_tile!(f32_bf16, rows_bf16, pair_bf16, false, |p, c| {
    // 32 weights in one load, no shuffle: each 32-bit lane holds an even weight in its low
    // half (shifted up, it is that weight as f32) and an odd one in its high half (masked, the
    // same). The inputs come in the matching order ([`bf16_input_order`]).
    let v = _mm512_loadu_si512(p.add(2 * c) as *const __m512i);
    [
        _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
        _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-0x1_0000))),
    ]
});

/// The input order the BF16 kernels take: within each 32-block of each input, the 16 even
/// elements then the 16 odd ones (`x.len()` a multiple of 32). Two permutes per block where
/// AVX-512 F runs (it does wherever these kernels do): the element-by-element copy was 0.29%
/// of a BF16 decode profile's samples (0.17% now), on the forward thread between passes.
pub fn bf16_input_order(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len() / BLOCK * BLOCK];
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was detected; `out` holds as many whole blocks as `x`.
        unsafe { bf16_input_order_avx512(x, &mut out) };
    } else {
        bf16_input_order_scalar(x, &mut out);
    }
    out
}

/// [`bf16_input_order`]'s reference: element by element.
fn bf16_input_order_scalar(x: &[f32], out: &mut [f32]) {
    for (b, o) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let (evens, odds) = o.split_at_mut(BLOCK / 2);
        for (k, (e, d)) in evens.iter_mut().zip(odds).enumerate() {
            (*e, *d) = (b[2 * k], b[2 * k + 1]);
        }
    }
}

/// # Safety
/// AVX-512 F available.
#[target_feature(enable = "avx512f")]
unsafe fn bf16_input_order_avx512(x: &[f32], out: &mut [f32]) {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (b, o) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        // SAFETY: `b` and `o` are 32 values each: two 16-lane loads and stores apiece.
        unsafe {
            let (lo, hi) = (
                _mm512_loadu_ps(b.as_ptr()),
                _mm512_loadu_ps(b.as_ptr().add(16)),
            );
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_permutex2var_ps(lo, even, hi));
            _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_permutex2var_ps(lo, odd, hi));
        }
    }
}

f32_tile!(f32_f16, rows_f16, pair_f16, false, |p, c| {
    let q = p.add(2 * c);
    [
        _mm512_cvtph_ps(_mm256_loadu_si256(q as *const __m256i)),
        _mm512_cvtph_ps(_mm256_loadu_si256(q.add(32) as *const __m256i)),
    ]
});

f32_tile!(f32_fp8, rows_fp8, pair_fp8, true, |p, c| {
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
/// `kind.simd_shape(cols)`; `row.len() == kind.row_len(cols)`,
/// `scales.len() >= cols.div_ceil(kind.group(cols))`, `x.len() >= n * cols`, `out.len() >= n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
    // Inputs per tile call: four for the unscaled formats (8 accumulators each), two for FP8.
    let per_call = if matches!(kind, WeightFormat::Fp8Block { .. }) {
        2
    } else {
        4
    };
    let mut t = 0;
    while t < n {
        let take = (n - t).min(per_call);
        let xs = &x[t * cols..(t + take) * cols];
        let o = &mut out[t..t + take];
        macro_rules! go {
            ($f:ident, $smul:expr) => {
                // SAFETY: the caller's contract is the tile's contract; `xs` holds `take`
                // inputs and `o` `take` outputs.
                unsafe {
                    match take {
                        4 => $f::<4>(row, scales, $smul, group, xs, cols, o),
                        3 => $f::<3>(row, scales, $smul, group, xs, cols, o),
                        2 => $f::<2>(row, scales, $smul, group, xs, cols, o),
                        _ => $f::<1>(row, scales, $smul, group, xs, cols, o),
                    }
                }
            };
        }
        match kind {
            WeightFormat::F32 => go!(f32_f32, 1.0),
            WeightFormat::Bf16 => go!(f32_bf16, 1.0),
            WeightFormat::F16 => go!(f32_f16, 1.0),
            WeightFormat::Fp8Block { .. } => go!(f32_fp8, 256.0),
            _ => unreachable!("AVX-512 f32 kernels take F32, F16, BF16 and FP8 only"),
        }
        t += take;
    }
}

/// Two rows against `n` inputs (matrix products): `outs[r][t] = dot(rows[r], x[t])`, each
/// output bit-identical to [`row_f32`]'s.
///
/// # Safety
/// As for [`row_f32`], for each of the two rows and their scales; each `outs[r]` holds `n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows2_f32(
    kind: WeightFormat,
    rows: [&[u8]; 2],
    scales: [&[f32]; 2],
    x: &[f32],
    cols: usize,
    n: usize,
    outs: [&mut [f32]; 2],
) {
    debug_assert!(kind.simd_shape(cols) && rows.iter().all(|r| r.len() == kind.row_len(cols)));
    debug_assert!(x.len() >= n * cols && outs.iter().all(|o| o.len() >= n));
    let group = kind.group(cols);
    let [o0, o1] = outs;
    let per_call = if matches!(kind, WeightFormat::Fp8Block { .. }) {
        2
    } else {
        4
    };
    let mut t = 0;
    // As many inputs at a time as `row_f32` takes.
    while t < n {
        let take = (n - t).min(per_call);
        let xs = &x[t * cols..(t + take) * cols];
        let os = [&mut o0[t..t + take], &mut o1[t..t + take]];
        macro_rules! go {
            ($f:ident, $smul:expr) => {
                // SAFETY: the caller's contract is the tile's contract; `xs` holds `take`
                // inputs and each of `os` `take` outputs.
                unsafe {
                    match take {
                        4 => $f::<4>(rows, scales, $smul, group, xs, cols, os),
                        3 => $f::<3>(rows, scales, $smul, group, xs, cols, os),
                        2 => $f::<2>(rows, scales, $smul, group, xs, cols, os),
                        _ => $f::<1>(rows, scales, $smul, group, xs, cols, os),
                    }
                }
            };
        }
        match kind {
            WeightFormat::F32 => go!(pair_f32, 1.0),
            WeightFormat::Bf16 => go!(pair_bf16, 1.0),
            WeightFormat::F16 => go!(pair_f16, 1.0),
            WeightFormat::Fp8Block { .. } => go!(pair_fp8, 256.0),
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
    /// Whether [`Codes::group`] applies: the inputs are in [`I16Order::Groups`].
    const GROUPS: bool = false;
    /// Blocks `g..g + 16` as eight zmm in the [`I16Order::Groups`] order: vector `2u + p`
    /// holds, in 32-bit lane `group_lane(j)`, the codes of elements `8u + p + 2k` (`k` in
    /// 0..4) of block `g + j`.
    ///
    /// # Safety
    /// AVX-512 F/BW available; blocks `g..g + 16` lie inside the row at `p`.
    unsafe fn group(p: *const u8, g: usize) -> [__m512i; 8] {
        let _ = (p, g);
        unreachable!("group decode is for the 4-bit formats")
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

/// A group's 256 packed bytes (16 blocks of 16) transposed in 32-bit lanes: vector `u` holds
/// bytes `4u..4u + 4` of every block, block `j` in lane `group_lane(j)` (the four loads
/// are blocks `4m..4m + 4`, one per 128-bit lane; a 4x4 transpose inside each 128-bit lane).
///
/// # Safety
/// AVX-512 F available; the 256 bytes at `p` are readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn transposed_group(p: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller guarantees the 256 bytes.
    let w: [__m512i; 4] =
        std::array::from_fn(|m| unsafe { _mm512_loadu_si512(p.add(64 * m) as *const __m512i) });
    let a0 = _mm512_unpacklo_epi32(w[0], w[1]);
    let a1 = _mm512_unpackhi_epi32(w[0], w[1]);
    let a2 = _mm512_unpacklo_epi32(w[2], w[3]);
    let a3 = _mm512_unpackhi_epi32(w[2], w[3]);
    [
        _mm512_unpacklo_epi64(a0, a2),
        _mm512_unpackhi_epi64(a0, a2),
        _mm512_unpacklo_epi64(a1, a3),
        _mm512_unpackhi_epi64(a1, a3),
    ]
}

/// [`transposed_group`]'s four vectors split into `[low nibbles, high nibbles]` each: the
/// eight vectors of [`Codes::group`] for the nibble formats.
///
/// # Safety
/// As for [`transposed_group`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn nibbles_group(p: *const u8) -> [__m512i; 8] {
    // SAFETY: the caller's contract.
    let t = unsafe { transposed_group(p) };
    let m = _mm512_set1_epi8(0x0f);
    std::array::from_fn(|v| {
        let x = t[v / 2];
        if v % 2 == 0 {
            _mm512_and_si512(x, m)
        } else {
            _mm512_and_si512(_mm512_srli_epi16(x, 4), m)
        }
    })
}

struct Int4Codes;
impl Codes for Int4Codes {
    const OFFSET: i32 = 8;
    const BLOCK_BYTES: usize = 16;
    const QUAD: bool = true;
    const GROUPS: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn group(p: *const u8, g: usize) -> [__m512i; 8] {
        // SAFETY: the caller guarantees the 256 bytes of blocks g..g+16 are inside the row.
        unsafe { nibbles_group(p.add(g * 16)) }
    }
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

/// MXFP4 doubled codes plus 12 (0..=24), the `vpshufb` table: a constant, so that the
/// decode loads it rather than building it per call (a call from inside the tile, not inlined).
const MXFP4_LUT: [i8; 16] = {
    let mut t = [0i8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = MXFP4_X2[i] + 12;
        i += 1;
    }
    t
};

struct Mxfp4Codes;
impl Codes for Mxfp4Codes {
    const OFFSET: i32 = 12;
    const BLOCK_BYTES: usize = 16;
    const QUAD: bool = true;
    const GROUPS: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn group(p: *const u8, g: usize) -> [__m512i; 8] {
        // SAFETY: the table is 16 bytes; the caller guarantees blocks g..g+16 are in the row.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(MXFP4_LUT.as_ptr() as *const __m128i));
            let mut v = nibbles_group(p.add(g * 16));
            for c in &mut v {
                *c = _mm512_shuffle_epi8(lut, *c);
            }
            v
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quad(p: *const u8, b: usize) -> (__m512i, __m512i) {
        // SAFETY: the table is 16 bytes; the caller guarantees blocks b..b+4 are in the row.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(MXFP4_LUT.as_ptr() as *const __m128i));
            let (lo, hi) = Int4Codes::quad(p, b);
            (_mm512_shuffle_epi8(lut, lo), _mm512_shuffle_epi8(lut, hi))
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn two(p: *const u8, b: usize) -> __m512i {
        // SAFETY: the table is 16 bytes; the caller guarantees blocks b, b+1 are in the row.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(MXFP4_LUT.as_ptr() as *const __m128i));
            _mm512_shuffle_epi8(lut, Int4Codes::two(p, b))
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn one(p: *const u8, b: usize) -> __m256i {
        // SAFETY: as above for block b.
        unsafe {
            let lut =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(MXFP4_LUT.as_ptr() as *const __m128i));
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

/// Where a tile's per-block weight scales come from: f32 values, or the matrix's own scale
/// bytes, converted in the kernel 16 blocks at a time (no separate conversion pass, which
/// stalled on DRAM once per task).
trait ScaleSrc<const R: usize>: Copy {
    /// Scales of blocks `b..b + 16` of row `r`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL available; blocks `b..b + 16` exist in row `r`'s scales.
    unsafe fn load16(self, r: usize, b: usize) -> __m512;
    /// Scales of blocks `b..b + n` (`n < 16`) of row `r`, zeros after.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL available; blocks `b..b + n` exist in row `r`'s scales.
    unsafe fn load_part(self, r: usize, b: usize, n: usize) -> __m512;
    /// Address of row `r`'s scale of block `b` (a prefetch hint only: not read).
    fn addr(self, r: usize, b: usize) -> *const i8;
}

/// f32 scales (converted by the caller: groups of 64 or 128 spread over 32-blocks).
#[derive(Clone, Copy)]
struct F32Scales<const R: usize>([*const f32; R]);
impl<const R: usize> ScaleSrc<R> for F32Scales<R> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(self, r: usize, b: usize) -> __m512 {
        // SAFETY: the caller guarantees the 16 scales exist.
        unsafe { _mm512_loadu_ps(self.0[r].add(b)) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_part(self, r: usize, b: usize, n: usize) -> __m512 {
        // SAFETY: the mask enables the `n` existing scales only.
        unsafe { _mm512_maskz_loadu_ps(lanes(n), self.0[r].add(b)) }
    }
    fn addr(self, r: usize, b: usize) -> *const i8 {
        self.0[r].wrapping_add(b) as *const i8
    }
}

/// Raw scale bytes of type `T` per row.
#[derive(Clone, Copy)]
struct RawScales<T: RawScale, const R: usize>([*const u8; R], std::marker::PhantomData<T>);

/// A scale encoding the kernels convert in registers.
trait RawScale: Copy {
    const SIZE: usize;
    /// # Safety
    /// AVX-512 F/BW/VL available; `16 * SIZE` bytes at `p` readable.
    unsafe fn load16(p: *const u8) -> __m512;
    /// # Safety
    /// AVX-512 F/BW/VL available; `n * SIZE` bytes at `p` readable, `n < 16`.
    unsafe fn load_part(p: *const u8, n: usize) -> __m512;
}

#[derive(Clone, Copy)]
struct E8m0Scale;
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn e8m0_lanes(e: __m128i) -> __m512 {
    let e = _mm512_cvtepu8_epi32(e);
    let bits = _mm512_slli_epi32(e, 23);
    let zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    let nan = _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255));
    let bits = _mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x0040_0000));
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(
        bits,
        nan,
        _mm512_set1_epi32(0x7fc0_0000),
    ))
}
impl RawScale for E8m0Scale {
    const SIZE: usize = 1;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 bytes at `p`.
        e8m0_lanes(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_part(p: *const u8, n: usize) -> __m512 {
        // SAFETY: the mask enables the `n` existing bytes only; the zeros after convert to
        // 2^-127 scales of blocks that are never used.
        e8m0_lanes(unsafe { _mm_maskz_loadu_epi8(lanes(n), p as *const i8) })
    }
}

#[derive(Clone, Copy)]
struct Bf16Scale;
impl RawScale for Bf16Scale {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 bytes at `p`.
        let h = unsafe { _mm256_loadu_si256(p as *const __m256i) };
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_part(p: *const u8, n: usize) -> __m512 {
        // SAFETY: the mask enables the `n` existing scales only.
        let h = unsafe { _mm256_maskz_loadu_epi16(lanes(n), p as *const i16) };
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
}

#[derive(Clone, Copy)]
struct F16Scale;
impl RawScale for F16Scale {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 bytes at `p`.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p as *const __m256i) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_part(p: *const u8, n: usize) -> __m512 {
        // SAFETY: the mask enables the `n` existing scales only.
        _mm512_cvtph_ps(unsafe { _mm256_maskz_loadu_epi16(lanes(n), p as *const i16) })
    }
}

impl<T: RawScale, const R: usize> ScaleSrc<R> for RawScales<T, R> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(self, r: usize, b: usize) -> __m512 {
        // SAFETY: the caller guarantees the 16 scales exist.
        unsafe { T::load16(self.0[r].add(b * T::SIZE)) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_part(self, r: usize, b: usize, n: usize) -> __m512 {
        // SAFETY: the caller guarantees the `n` scales exist.
        unsafe { T::load_part(self.0[r].add(b * T::SIZE), n) }
    }
    fn addr(self, r: usize, b: usize) -> *const i8 {
        self.0[r].wrapping_add(b * T::SIZE) as *const i8
    }
}

/// Mask of the first `n` (< 64) lanes.
#[inline]
fn lanes<M: TryFrom<u64>>(n: usize) -> M
where
    M::Error: std::fmt::Debug,
{
    M::try_from((1u64 << n) - 1).expect("mask wide enough")
}

/// `vpdpbusd` (each 32-bit lane plus the four products of its unsigned bytes of `a` and signed
/// bytes of `b`) as the 16-bit tiles take it: the instruction itself (AVX-512 VNNI), or the same
/// exact integers from AVX-512 BW (Skylake-SP and other AVX-512 CPUs without VNNI).
trait Dpbusd {
    /// # Safety
    /// The instruction set of the implementation available; `a`'s bytes at most `C`'s largest
    /// code (`2 * C::OFFSET`).
    unsafe fn dp<C: Codes>(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
    /// # Safety
    /// As for [`Dpbusd::dp`], plus AVX-512 VL.
    unsafe fn dp256<C: Codes>(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    /// Whether `dp` is emulated (AVX-512 BW): the tiles' 4-bit groups then sum four
    /// `vpmaddubsw` in i16 before one `vpmaddwd` ([`Bw::dp4_small`]), the same integers.
    const EMULATED: bool;
}

struct Vnni;
impl Dpbusd for Vnni {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn dp<C: Codes>(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(acc, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn dp256<C: Codes>(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, a, b)
    }
    const EMULATED: bool = false;
}

/// Without VNNI: codes below 128 (the 4-bit formats) meet the inputs in `vpmaddubsw`, whose
/// 16-bit pair sums cannot saturate then (at most 2 * 127 * 128), and `vpmaddwd` by ones;
/// Q8's unsigned codes (to 255) are widened to 16 bits first, even and odd bytes apart (the
/// matrix products do not come here for Q8: `Isa::for_format` gives them the AVX2
/// kernels).
struct Bw;
impl Dpbusd for Bw {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn dp<C: Codes>(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        let p = if 2 * C::OFFSET < 128 {
            _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1))
        } else {
            let lo = _mm512_set1_epi16(0xff);
            let ae = _mm512_and_si512(a, lo);
            let ao = _mm512_srli_epi16(a, 8);
            let be = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
            let bo = _mm512_srai_epi16(b, 8);
            _mm512_add_epi32(_mm512_madd_epi16(ae, be), _mm512_madd_epi16(ao, bo))
        };
        _mm512_add_epi32(acc, p)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn dp256<C: Codes>(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        let p = if 2 * C::OFFSET < 128 {
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
        } else {
            let lo = _mm256_set1_epi16(0xff);
            let ae = _mm256_and_si256(a, lo);
            let ao = _mm256_srli_epi16(a, 8);
            let be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
            let bo = _mm256_srai_epi16(b, 8);
            _mm256_add_epi32(_mm256_madd_epi16(ae, be), _mm256_madd_epi16(ao, bo))
        };
        _mm256_add_epi32(acc, p)
    }
    const EMULATED: bool = true;
}

impl Bw {
    /// The 32-bit lane sums of four vectors of 4-bit codes (at most 24: MXFP4's doubled
    /// codes plus 12) with inputs in -127..=127: the four `vpmaddubsw` pair sums add within
    /// i16 (at most 4 * 2 * 24 * 128 = 24576) before one `vpmaddwd`, where four [`Bw::dp`]
    /// take four.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn dp4_small(c: [__m512i; 4], b: [__m512i; 4]) -> __m512i {
        let p01 = _mm512_add_epi16(
            _mm512_maddubs_epi16(c[0], b[0]),
            _mm512_maddubs_epi16(c[1], b[1]),
        );
        let p23 = _mm512_add_epi16(
            _mm512_maddubs_epi16(c[2], b[2]),
            _mm512_maddubs_epi16(c[3], b[3]),
        );
        _mm512_madd_epi16(_mm512_add_epi16(p01, p23), _mm512_set1_epi16(1))
    }
}

/// The 16-bit tile, once per [`Dpbusd`]: its own copy compiled without VNNI for [`Bw`], so
/// that no VNNI instruction can reach a CPU without it (LLVM forms `vpdpwssd` from
/// `vpmaddwd` + add where VNNI is enabled).
macro_rules! i16_tile_fn {
    ($name:ident, $features:literal, $dot:ty) => {
/// `R` rows against `N` 16-bit inputs (`R == 1` or `N == 1`), in groups of 16 blocks: each
/// group's 16 weight scales are loaded (converted from the matrix's own encoding) and
/// multiplied by the input's 16 block scales once, then per run of four 32-blocks (a "quad")
/// each input's planes are loaded once for all rows, two `vpdpbusd` per plane pair give the
/// quad's block sums (lanes `4j..4j + 4`: block `j`), and one permute spreads the four
/// blocks' scale products over those lanes. Sub-quad tails take pairs and single blocks.
/// The offset correction `-off * sum_b w_b * dsum_b` is accumulated alongside (one FMA per
/// group). Each output is summed in the same order whatever `R` and `N` are; `out[r*N + t]`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI available; `cols` a multiple of 32; each `rows[r]` a whole row of
/// `cols` codes and `scales` `cols / 32` block scales per row; `x` holds `N * cols` codes per
/// plane and `N * cols / 32` scales and sums; `out` `R * N` values.
#[target_feature(enable = $features)]
unsafe fn $name<C: Codes, S: ScaleSrc<R>, const R: usize, const N: usize, const LO: bool>(
    rows: [&[u8]; R],
    scales: S,
    x: I16Slices<'_>,
    cols: usize,
    out: &mut [f32],
) {
    let p: [*const u8; R] = std::array::from_fn(|r| rows[r].as_ptr());
    let blocks = cols / BLOCK;
    // Inside the loops, arrays of registers are filled by plain loops, not `from_fn` or
    // `map`: those closures were left out of line for some code and scale types (MXFP4's with
    // E8M0 scales: a call per group, the codes passed through memory), halving the MXFP4
    // matrix products (benches/results/isa_sweep_session28_zen4.txt).
    // Prefetch the same position `R` rows on (the next tile's rows, when rows are consecutive;
    // a hint only, so past the matrix it is harmless): the hardware prefetcher does not run
    // far enough ahead of `R` interleaved streams (at least `MIN_PREFETCH_AHEAD`). Scales
    // likewise, `R` rows of scales on.
    let ahead = (R * rows[0].len()).max(MIN_PREFETCH_AHEAD);
    let (hp, lp) = (x.hi[..N * cols].as_ptr(), x.lo[..N * cols].as_ptr());
    let (d, dsums) = (&x.d[..N * blocks], &x.dsums[..N * blocks]);
    // Lanes 4j..4j+4 take lane j (plus 4q for the quad's place in its group).
    let quad_idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let pair_idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    let mut cacc = [[_mm512_setzero_ps(); N]; R];
    // Block scale products of the current group, `wd[r][t]` lane j: block `g + j`.
    let mut wd = [[_mm512_setzero_ps(); N]; R];
    macro_rules! group {
        ($g:expr, $n:expr) => {{
            let (g, n) = ($g, $n);
            // SAFETY: blocks `g..g + n` exist (`n == 16` or the masked tail): 16 (or `n`)
            // scales of each row, `d` / `dsums` `[t * blocks + g ..][..n]`, `t < N`.
            unsafe {
                let mut dv = [(_mm512_setzero_ps(), _mm512_setzero_ps()); N];
                for (t, dv) in dv.iter_mut().enumerate() {
                    let o = t * blocks + g;
                    *dv = if n == 16 {
                        (
                            _mm512_loadu_ps(d.as_ptr().add(o)),
                            _mm512_loadu_ps(dsums.as_ptr().add(o)),
                        )
                    } else {
                        (
                            _mm512_maskz_loadu_ps(lanes(n), d.as_ptr().add(o)),
                            _mm512_maskz_loadu_ps(lanes(n), dsums.as_ptr().add(o)),
                        )
                    };
                }
                for r in 0..R {
                    _mm_prefetch::<_MM_HINT_T1>(scales.addr(r, g + R * blocks));
                    let w = if n == 16 {
                        scales.load16(r, g)
                    } else {
                        scales.load_part(r, g, n)
                    };
                    for t in 0..N {
                        wd[r][t] = _mm512_mul_ps(w, dv[t].0);
                        cacc[r][t] = _mm512_fmadd_ps(w, dv[t].1, cacc[r][t]);
                    }
                }
            }
        }};
    }
    macro_rules! quad_step {
        ($b:expr, $q:expr) => {{
            let (b, q) = ($b, $q);
            let idx = _mm512_add_epi32(quad_idx, _mm512_set1_epi32(4 * q as i32));
            // SAFETY: `b + 4 <= blocks`: the decodes read blocks b..b+4 of each row, the input
            // loads `[t*cols + 32b ..][..128]` of each plane, `t < N`.
            unsafe {
                let mut xs = [[_mm512_setzero_si512(); 4]; N];
                for (t, x) in xs.iter_mut().enumerate() {
                    let o = t * cols + b * BLOCK;
                    x[0] = _mm512_loadu_si512(hp.add(o) as *const __m512i);
                    x[1] = _mm512_loadu_si512(hp.add(o + 64) as *const __m512i);
                    if LO {
                        x[2] = _mm512_loadu_si512(lp.add(o) as *const __m512i);
                        x[3] = _mm512_loadu_si512(lp.add(o + 64) as *const __m512i);
                    }
                }
                for r in 0..R {
                    for line in (0..4 * C::BLOCK_BYTES).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(
                            p[r].wrapping_add(b * C::BLOCK_BYTES + line + ahead) as *const i8,
                        );
                    }
                    let (ev, od) = C::quad(p[r], b);
                    for t in 0..N {
                        let [h0, h1, l0, l1] = xs[t];
                        // The planes' sums in two independent chains (one chain of four
                        // dependent `vpdpbusd` bound the tile by their latency), then
                        // `256 * hi + lo`: the same integers in either order. Without a low
                        // plane (`!LO`: it is all zeros) `256 * hi` alone, the same value.
                        let sh = <$dot>::dp::<C>(_mm512_setzero_si512(), ev, h0);
                        let sh = <$dot>::dp::<C>(sh, od, h1);
                        let s = if LO {
                            let sl = <$dot>::dp::<C>(_mm512_setzero_si512(), ev, l0);
                            let sl = <$dot>::dp::<C>(sl, od, l1);
                            _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl)
                        } else {
                            _mm512_slli_epi32(sh, 8)
                        };
                        let sv = _mm512_permutexvar_ps(idx, wd[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, acc[r][t]);
                    }
                }
            }
        }};
    }
    macro_rules! pair_step {
        ($b:expr, $j:expr) => {{
            let (b, j) = ($b, $j);
            let idx = _mm512_add_epi32(pair_idx, _mm512_set1_epi32(j as i32));
            // SAFETY: `b + 2 <= blocks`: blocks b, b+1 of each row, `[t*cols + 32b ..][..64]`
            // of each plane, `t < N`.
            unsafe {
                let mut xs = [[_mm512_setzero_si512(); 2]; N];
                for (t, x) in xs.iter_mut().enumerate() {
                    let o = t * cols + b * BLOCK;
                    x[0] = _mm512_loadu_si512(hp.add(o) as *const __m512i);
                    if LO {
                        x[1] = _mm512_loadu_si512(lp.add(o) as *const __m512i);
                    }
                }
                for r in 0..R {
                    let u = C::two(p[r], b);
                    for t in 0..N {
                        let [xh, xl] = xs[t];
                        let sh = <$dot>::dp::<C>(_mm512_setzero_si512(), u, xh);
                        let s = if LO {
                            let sl = <$dot>::dp::<C>(_mm512_setzero_si512(), u, xl);
                            _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl)
                        } else {
                            _mm512_slli_epi32(sh, 8)
                        };
                        let sv = _mm512_permutexvar_ps(idx, wd[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sv, acc[r][t]);
                    }
                }
            }
        }};
    }
    // [`I16Order::Groups`]: one 32-bit lane per block, so each block's integer sum is whole
    // after the group's eight vectors and is scaled once (lanes in `group_lane` order: the
    // scales are permuted to match).
    let sigma = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    macro_rules! group16_step {
        ($g:expr) => {{
            let g = $g;
            // SAFETY: `g + 16 <= blocks`: 16 scales of each row and `d` / `dsums`
            // `[t * blocks + g ..][..16]`, the decode reads blocks g..g+16 of each row, the
            // input loads `[t*cols + 32g ..][..512]` of each plane, `t < N`.
            unsafe {
                let mut dp = [_mm512_setzero_ps(); N];
                for (t, dp) in dp.iter_mut().enumerate() {
                    *dp = _mm512_permutexvar_ps(sigma, _mm512_loadu_ps(d.as_ptr().add(t * blocks + g)));
                }
                for r in 0..R {
                    _mm_prefetch::<_MM_HINT_T1>(scales.addr(r, g + R * blocks));
                    for line in (0..16 * C::BLOCK_BYTES).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(
                            p[r].wrapping_add(g * C::BLOCK_BYTES + line + ahead) as *const i8,
                        );
                    }
                }
                let mut wp = [_mm512_setzero_ps(); R];
                for (r, wp) in wp.iter_mut().enumerate() {
                    let w = scales.load16(r, g);
                    for t in 0..N {
                        let ds = _mm512_loadu_ps(dsums.as_ptr().add(t * blocks + g));
                        cacc[r][t] = _mm512_fmadd_ps(w, ds, cacc[r][t]);
                    }
                    *wp = _mm512_permutexvar_ps(sigma, w);
                }
                // `256 * hi + lo` of each lane: the block's exact integer sum (without a low
                // plane `256 * hi`, the same value), so the order of the products is free.
                macro_rules! whole {
                    ($sh:expr, $sl:expr) => {{
                        let sh = _mm512_slli_epi32($sh, 8);
                        if LO {
                            _mm512_add_epi32(sh, $sl)
                        } else {
                            sh
                        }
                    }};
                }
                let zero = _mm512_setzero_si512();
                if R == 1 || N == 1 {
                    // Row by row (one input, or one row): one row's eight code vectors live.
                    for r in 0..R {
                        let codes = C::group(p[r], g);
                        for t in 0..N {
                            let o = t * cols + g * BLOCK;
                            if <$dot>::EMULATED {
                                assert!(2 * C::OFFSET <= 24, "4-bit codes only");
                                // Four products a chain summed in i16 ([`Bw::dp4_small`]).
                                // A macro, not a closure: closures here stay out of line.
                                macro_rules! x {
                                    ($pl:expr, $v0:expr) => {{
                                        let mut v = [zero; 4];
                                        for (k, v) in v.iter_mut().enumerate() {
                                            let at = $pl.add(o + 64 * ($v0 + k));
                                            *v = _mm512_loadu_si512(at as *const __m512i);
                                        }
                                        v
                                    }};
                                }
                                let c0 = [codes[0], codes[1], codes[2], codes[3]];
                                let c1 = [codes[4], codes[5], codes[6], codes[7]];
                                let h = _mm512_add_epi32(
                                    Bw::dp4_small(c0, x!(hp, 0)),
                                    Bw::dp4_small(c1, x!(hp, 4)),
                                );
                                let l = if LO {
                                    _mm512_add_epi32(
                                        Bw::dp4_small(c0, x!(lp, 0)),
                                        Bw::dp4_small(c1, x!(lp, 4)),
                                    )
                                } else {
                                    zero
                                };
                                let s = whole!(h, l);
                                let wd = _mm512_mul_ps(wp[r], dp[t]);
                                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), wd, acc[r][t]);
                                continue;
                            }
                            // Two chains per plane: eight dependent `vpdpbusd` would bound
                            // the tile by their latency.
                            let (mut sh, mut sl) = ([zero; 2], [zero; 2]);
                            for (v, &c) in codes.iter().enumerate() {
                                let xh = _mm512_loadu_si512(hp.add(o + 64 * v) as *const __m512i);
                                sh[v % 2] = <$dot>::dp::<C>(sh[v % 2], c, xh);
                                if LO {
                                    let xl =
                                        _mm512_loadu_si512(lp.add(o + 64 * v) as *const __m512i);
                                    sl[v % 2] = <$dot>::dp::<C>(sl[v % 2], c, xl);
                                }
                            }
                            let (h, l) =
                                (_mm512_add_epi32(sh[0], sh[1]), _mm512_add_epi32(sl[0], sl[1]));
                            let s = whole!(h, l);
                            let wd = _mm512_mul_ps(wp[r], dp[t]);
                            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), wd, acc[r][t]);
                        }
                    }
                } else {
                    // Input by input, each input vector loaded once for all rows.
                    let mut codes = [[_mm512_setzero_si512(); 8]; R];
                    for (c, &pr) in codes.iter_mut().zip(&p) {
                        *c = C::group(pr, g);
                    }
                    for t in 0..N {
                        let o = t * cols + g * BLOCK;
                        let (mut sh, mut sl) = ([zero; R], [zero; R]);
                        if <$dot>::EMULATED {
                            assert!(2 * C::OFFSET <= 24, "4-bit codes only");
                            // `vpmaddubsw` pair sums add within i16 four vectors at a time
                            // (as in [`Bw::dp4_small`]), then one `vpmaddwd` by ones.
                            let ones = _mm512_set1_epi16(1);
                            for half in 0..2 {
                                let (mut ph, mut pl) = ([zero; R], [zero; R]);
                                for v in 4 * half..4 * half + 4 {
                                    let xh = _mm512_loadu_si512(hp.add(o + 64 * v) as *const __m512i);
                                    for r in 0..R {
                                        let p = _mm512_maddubs_epi16(codes[r][v], xh);
                                        ph[r] = _mm512_add_epi16(ph[r], p);
                                    }
                                    if LO {
                                        let xl = _mm512_loadu_si512(lp.add(o + 64 * v) as *const __m512i);
                                        for r in 0..R {
                                            let p = _mm512_maddubs_epi16(codes[r][v], xl);
                                            pl[r] = _mm512_add_epi16(pl[r], p);
                                        }
                                    }
                                }
                                for r in 0..R {
                                    sh[r] = _mm512_add_epi32(sh[r], _mm512_madd_epi16(ph[r], ones));
                                    if LO {
                                        sl[r] = _mm512_add_epi32(sl[r], _mm512_madd_epi16(pl[r], ones));
                                    }
                                }
                            }
                        } else {
                            for v in 0..8 {
                                let xh = _mm512_loadu_si512(hp.add(o + 64 * v) as *const __m512i);
                                for r in 0..R {
                                    sh[r] = <$dot>::dp::<C>(sh[r], codes[r][v], xh);
                                }
                                if LO {
                                    let xl = _mm512_loadu_si512(lp.add(o + 64 * v) as *const __m512i);
                                    for r in 0..R {
                                        sl[r] = <$dot>::dp::<C>(sl[r], codes[r][v], xl);
                                    }
                                }
                            }
                        }
                        for r in 0..R {
                            let s = whole!(sh[r], sl[r]);
                            let wd = _mm512_mul_ps(wp[r], dp[t]);
                            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), wd, acc[r][t]);
                        }
                    }
                }
            }
        }};
    }
    let full = blocks / 16 * 16;
    let mut g = 0;
    while g < full {
        if C::GROUPS {
            group16_step!(g);
        } else {
            group!(g, 16);
            for q in 0..4 {
                quad_step!(g + 4 * q, q);
            }
        }
        g += 16;
    }
    if g < blocks {
        let n = blocks - g;
        group!(g, n);
        let mut j = 0;
        if C::QUAD {
            while j + 4 <= n {
                quad_step!(g + j, j / 4);
                j += 4;
            }
        }
        while j + 2 <= n {
            pair_step!(g + j, j);
            j += 2;
        }
        if j < n {
            let b = g + j;
            // SAFETY: `b < blocks`: block b of each row, `[t*cols + 32b ..][..32]` of each
            // plane, `t < N`.
            unsafe {
                for r in 0..R {
                    let u = C::one(p[r], b);
                    for t in 0..N {
                        let o = t * cols + b * BLOCK;
                        let xh = _mm256_loadu_si256(hp.add(o) as *const __m256i);
                        let s = <$dot>::dp256::<C>(_mm256_setzero_si256(), u, xh);
                        let s = if LO {
                            let xl = _mm256_loadu_si256(lp.add(o) as *const __m256i);
                            <$dot>::dp256::<C>(_mm256_slli_epi32(s, 8), u, xl)
                        } else {
                            _mm256_slli_epi32(s, 8)
                        };
                        let sv = _mm512_permutexvar_ps(_mm512_set1_epi32(j as i32), wd[r][t]);
                        let prod = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm512_castps512_ps256(sv));
                        acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_zextps256_ps512(prod));
                    }
                }
            }
        }
    }
    // The offset correction lane by lane, then every output's 16 lanes summed at once.
    let off = _mm512_set1_ps(C::OFFSET as f32);
    let mut sums = [_mm512_setzero_ps(); 8];
    for r in 0..R {
        for t in 0..N {
            sums[r * N + t] = _mm512_fnmadd_ps(off, cacc[r][t], acc[r][t]);
        }
    }
    reduce_many(&sums[..R * N], out);
}
    };
}

/// The lane sums of up to eight vectors, `out[k] = sum(v[k])`, each summed in one fixed order
/// whatever the others are (halves, quarters, eighths, pairs: lane `i` plus lane `i + 8`,
/// then `i + 4`, `i + 2`, `i + 1`), so that a tile's outputs do not depend on its shape; the
/// vectors share the shuffles: 12 shuffles and 12 adds for eight sums, where eight
/// separate reductions take 56 instructions (the cost that showed at short rows: one 16-block
/// group per call for the experts' down projection).
#[target_feature(enable = "avx512f")]
#[inline]
fn reduce_many(v: &[__m512], out: &mut [f32]) {
    debug_assert!(v.len() <= 8 && out.len() >= v.len());
    let z = _mm512_setzero_ps();
    let at = |s: &[__m512], i: usize| s.get(i).copied().unwrap_or(z);
    // Eight lanes of each vector: 128-bit chunks `[a0 + a2, a1 + a3, b0 + b2, b1 + b3]`.
    let l1: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (at(v, 2 * i), at(v, 2 * i + 1));
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // Four lanes: chunk `k` of `l2[m]` is vector `4m + k`.
    let l2: [__m512; 2] = std::array::from_fn(|m| {
        let (a, b) = (l1[2 * m], l1[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // Two lanes (chunk `k`: vector `k`'s pair, then vector `4 + k`'s), then one.
    let (p, q) = (l2[0], l2[1]);
    let l3 = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(p, q),
        _mm512_shuffle_ps::<0xEE>(p, q),
    );
    let l4 = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(l3, z),
        _mm512_shuffle_ps::<0xDD>(l3, z),
    );
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), l4) };
    // Chunk `k` now holds `[sum v[k], sum v[4 + k], 0, 0]`.
    for (k, o) in out[..v.len()].iter_mut().enumerate() {
        *o = lanes[4 * (k % 4) + k / 4];
    }
}
i16_tile_fn!(
    i16_tile_vnni,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
    Vnni
);
i16_tile_fn!(i16_tile_bw, "avx512f,avx512bw,avx512vl,avx2,fma", Bw);

/// Inputs `t..t + k` of an [`I16Inputs`].
#[derive(Clone, Copy)]
struct I16Slices<'a> {
    /// The inputs' element order.
    order: I16Order,
    /// The low plane is all zeros ([`I16Inputs::hi_only`]): the tiles skip it.
    hi_only: bool,
    hi: &'a [i8],
    lo: &'a [i8],
    d: &'a [f32],
    dsums: &'a [f32],
}

impl<'a> I16Slices<'a> {
    #[inline]
    fn of(x: &'a I16Inputs, t: usize, k: usize, cols: usize) -> Self {
        let blocks = cols / BLOCK;
        I16Slices {
            order: x.order,
            hi_only: x.hi_only,
            hi: &x.hi[t * cols..(t + k) * cols],
            lo: &x.lo[t * cols..(t + k) * cols],
            d: &x.d[t * blocks..(t + k) * blocks],
            dsums: &x.dsums[t * blocks..(t + k) * blocks],
        }
    }
}

/// One row's block scales as the 16-bit kernels take them.
#[derive(Clone, Copy, Debug)]
pub enum BlockScales<'a> {
    /// One f32 per 32-block.
    F32(&'a [f32]),
    /// The matrix's own scale bytes, one scale per 32-block (E8M0, BF16, F16 or F32).
    Raw(&'a [u8], ScaleType),
}

impl BlockScales<'_> {
    fn holds(&self, blocks: usize) -> bool {
        match *self {
            BlockScales::F32(s) => s.len() >= blocks,
            BlockScales::Raw(b, st) => b.len() >= blocks * st.size(),
        }
    }
}

/// Runs `i16_tile` for codes `C` with the scale source the scales' type asks for.
///
/// # Safety
/// As for `i16_tile`; every `scales[r]` has the same variant and type and holds `cols / 32`
/// block scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn tile_with_scales<C: Codes, const VNNI: bool, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    scales: [BlockScales<'_>; R],
    x: I16Slices<'_>,
    cols: usize,
    out: &mut [f32],
) {
    // Inputs in the other order would give wrong sums, not an error.
    assert_eq!(
        x.order == I16Order::Groups,
        C::GROUPS,
        "16-bit tile given inputs in the wrong order"
    );
    macro_rules! raw {
        ($t:ty) => {{
            let p: [*const u8; R] = std::array::from_fn(|r| match scales[r] {
                BlockScales::Raw(b, _) => b.as_ptr(),
                BlockScales::F32(_) => unreachable!("scales of one tile share a variant"),
            });
            // SAFETY: the caller's contract.
            unsafe {
                let sc: RawScales<$t, R> = RawScales(p, std::marker::PhantomData);
                match (VNNI, x.hi_only) {
                    (true, false) => i16_tile_vnni::<C, _, R, N, true>(rows, sc, x, cols, out),
                    (true, true) => i16_tile_vnni::<C, _, R, N, false>(rows, sc, x, cols, out),
                    (false, false) => i16_tile_bw::<C, _, R, N, true>(rows, sc, x, cols, out),
                    (false, true) => i16_tile_bw::<C, _, R, N, false>(rows, sc, x, cols, out),
                }
            }
        }};
    }
    match scales[0] {
        BlockScales::F32(_) | BlockScales::Raw(_, ScaleType::F32) => {
            let p: [*const f32; R] = std::array::from_fn(|r| match scales[r] {
                BlockScales::F32(s) => s.as_ptr(),
                // Little-endian f32 bytes are f32 values (x86_64); `_mm512_loadu_ps` takes
                // any alignment.
                BlockScales::Raw(b, _) => b.as_ptr() as *const f32,
            });
            // SAFETY: the caller's contract.
            unsafe {
                let sc = F32Scales(p);
                match (VNNI, x.hi_only) {
                    (true, false) => i16_tile_vnni::<C, _, R, N, true>(rows, sc, x, cols, out),
                    (true, true) => i16_tile_vnni::<C, _, R, N, false>(rows, sc, x, cols, out),
                    (false, false) => i16_tile_bw::<C, _, R, N, true>(rows, sc, x, cols, out),
                    (false, true) => i16_tile_bw::<C, _, R, N, false>(rows, sc, x, cols, out),
                }
            }
        }
        BlockScales::Raw(_, ScaleType::E8m0) => raw!(E8m0Scale),
        BlockScales::Raw(_, ScaleType::Bf16) => raw!(Bf16Scale),
        BlockScales::Raw(_, ScaleType::F16) => raw!(F16Scale),
        BlockScales::Raw(_, ScaleType::None) => unreachable!("integer formats have scales"),
    }
}

/// 16-bit-activation row kernel (INT4, MXFP4, Q8) against `n` inputs.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2 and FMA available; `kind.simd_shape(cols)`;
/// `row.len() == kind.row_len(cols)`, `scales` holds `cols / 32` block scales; `x.hi`/`x.lo`
/// hold at least `n * cols` codes and `x.d`/`x.dsums` `n * cols / 32` values; `out.len() >= n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn row_i16(
    vnni: bool,
    kind: WeightFormat,
    row: &[u8],
    scales: BlockScales<'_>,
    x: &I16Inputs,
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && row.len() == kind.row_len(cols));
    let blocks = cols / BLOCK;
    debug_assert!(x.hi.len() >= n * cols && x.lo.len() >= n * cols);
    debug_assert!(x.d.len() >= n * blocks && x.dsums.len() >= n * blocks && out.len() >= n);
    debug_assert!(scales.holds(blocks));
    let mut t = 0;
    while t < n {
        let k = (n - t).min(4);
        let xt = I16Slices::of(x, t, k, cols);
        let o = &mut out[t..t + k];
        macro_rules! go {
            ($c:ty, $v:literal) => {
                // SAFETY: the caller's contract is the tile's; `xt` and `o` hold exactly `k`
                // inputs / outputs.
                unsafe {
                    match k {
                        4 => tile_with_scales::<$c, $v, 1, 4>([row], [scales], xt, cols, o),
                        3 => tile_with_scales::<$c, $v, 1, 3>([row], [scales], xt, cols, o),
                        2 => tile_with_scales::<$c, $v, 1, 2>([row], [scales], xt, cols, o),
                        _ => tile_with_scales::<$c, $v, 1, 1>([row], [scales], xt, cols, o),
                    }
                }
            };
        }
        match (kind, vnni) {
            (WeightFormat::Int4 { .. }, true) => go!(Int4Codes, true),
            (WeightFormat::Int4 { .. }, false) => go!(Int4Codes, false),
            (WeightFormat::Mxfp4 { .. }, true) => go!(Mxfp4Codes, true),
            (WeightFormat::Mxfp4 { .. }, false) => go!(Mxfp4Codes, false),
            (WeightFormat::Q8 { .. }, true) => go!(Q8Codes, true),
            (WeightFormat::Q8 { .. }, false) => go!(Q8Codes, false),
            _ => unreachable!("16-bit kernels take INT4, MXFP4 and Q8 only"),
        }
        t += k;
    }
}

/// Two rows against the `n` 16-bit inputs `t0..t0 + n` of `x` (matrix products):
/// `outs[r][t] = dot(rows[r], x[t0 + t])`, each input's planes loaded once for both rows; each
/// output bit-identical to [`row_i16`]'s (the tile sums every output in the same order whatever
/// its shape).
///
/// # Safety
/// As for [`row_i16`] with `t0 + n` inputs, for both rows and their block scales (both of one
/// variant and type); each `outs[r]` holds `n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows2_i16(
    vnni: bool,
    kind: WeightFormat,
    rows: [&[u8]; 2],
    scales: [BlockScales<'_>; 2],
    x: &I16Inputs,
    cols: usize,
    t0: usize,
    n: usize,
    outs: [&mut [f32]; 2],
) {
    debug_assert!(kind.simd_shape(cols) && rows.iter().all(|r| r.len() == kind.row_len(cols)));
    let blocks = cols / BLOCK;
    let end = t0 + n;
    debug_assert!(x.hi.len() >= end * cols && x.lo.len() >= end * cols);
    debug_assert!(x.d.len() >= end * blocks && x.dsums.len() >= end * blocks);
    debug_assert!(scales.iter().all(|s| s.holds(blocks)) && outs.iter().all(|o| o.len() >= n));
    let sc = scales;
    let [o0, o1] = outs;
    let mut t = 0;
    while t < n {
        // Four inputs at a time, as `row_i16` takes them.
        let k = (n - t).min(4);
        let xt = I16Slices::of(x, t0 + t, k, cols);
        let mut tmp = [0f32; 8];
        macro_rules! go {
            ($c:ty, $v:literal) => {
                // SAFETY: the caller's contract is the tile's; `xt` holds `k` inputs and
                // `tmp` the `2 * k` outputs (`out[r * k + t]`).
                unsafe {
                    match k {
                        4 => tile_with_scales::<$c, $v, 2, 4>(rows, sc, xt, cols, &mut tmp[..8]),
                        3 => tile_with_scales::<$c, $v, 2, 3>(rows, sc, xt, cols, &mut tmp[..6]),
                        2 => tile_with_scales::<$c, $v, 2, 2>(rows, sc, xt, cols, &mut tmp[..4]),
                        _ => tile_with_scales::<$c, $v, 2, 1>(rows, sc, xt, cols, &mut tmp[..2]),
                    }
                }
            };
        }
        match (kind, vnni) {
            (WeightFormat::Int4 { .. }, true) => go!(Int4Codes, true),
            (WeightFormat::Int4 { .. }, false) => go!(Int4Codes, false),
            (WeightFormat::Mxfp4 { .. }, true) => go!(Mxfp4Codes, true),
            (WeightFormat::Mxfp4 { .. }, false) => go!(Mxfp4Codes, false),
            (WeightFormat::Q8 { .. }, true) => go!(Q8Codes, true),
            (WeightFormat::Q8 { .. }, false) => go!(Q8Codes, false),
            _ => unreachable!("16-bit kernels take INT4, MXFP4 and Q8 only"),
        }
        // Element by element: `copy_from_slice` of one to four values was a `memmove` call
        // each (0.8% of an INT4 prefill's samples).
        for (d, s) in o0[t..t + k].iter_mut().zip(&tmp[..k]) {
            *d = *s;
        }
        for (d, s) in o1[t..t + k].iter_mut().zip(&tmp[k..2 * k]) {
            *d = *s;
        }
        t += k;
    }
}

/// `R` rows against one 16-bit input (matrix-vector products): `out[r] = dot(rows[r], x)`.
///
/// # Safety
/// As for [`row_i16`] with `n == 1`, for each of the `R` rows and their scales (all of one
/// variant and type); `out` holds `R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub unsafe fn rows_i16<const R: usize>(
    vnni: bool,
    kind: WeightFormat,
    rows: [&[u8]; R],
    scales: [BlockScales<'_>; R],
    x: &I16Inputs,
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(kind.simd_shape(cols) && rows.iter().all(|r| r.len() == kind.row_len(cols)));
    let blocks = cols / BLOCK;
    debug_assert!(x.hi.len() >= cols && x.lo.len() >= cols && out.len() >= R);
    debug_assert!(scales.iter().all(|s| s.holds(blocks)));
    let xt = I16Slices::of(x, 0, 1, cols);
    macro_rules! go {
        ($c:ty, $v:literal) => {
            // SAFETY: the caller's contract is the tile's; one input, `R` rows and outputs.
            unsafe { tile_with_scales::<$c, $v, R, 1>(rows, scales, xt, cols, out) }
        };
    }
    match (kind, vnni) {
        (WeightFormat::Int4 { .. }, true) => go!(Int4Codes, true),
        (WeightFormat::Int4 { .. }, false) => go!(Int4Codes, false),
        (WeightFormat::Mxfp4 { .. }, true) => go!(Mxfp4Codes, true),
        (WeightFormat::Mxfp4 { .. }, false) => go!(Mxfp4Codes, false),
        (WeightFormat::Q8 { .. }, true) => go!(Q8Codes, true),
        (WeightFormat::Q8 { .. }, false) => go!(Q8Codes, false),
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
        *o = f32::from_bits(deltafin_formats::codec::e8m0_bits(e));
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
    runs: &crate::kernels::inputs::BlockRuns,
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
        crate::kernels::inputs::block_amax(xb)
    } else {
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)))
    };
    let s = amax / 127.0;
    let (inv, inv_lo) = crate::kernels::inputs::i16_inverses(s);
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
    crate::kernels::inputs::i16_block_scales(s, extra, sum)
}

/// Whether [`decode_row_packed`] takes rows of `kind` `cols` wide: the integer formats with
/// groups of whole 16-value runs.
pub fn decode_row_packed_supports(kind: WeightFormat, cols: usize) -> bool {
    match kind {
        WeightFormat::Int4 { group }
        | WeightFormat::Mxfp4 { group }
        | WeightFormat::Q8 { group } => {
            cols.is_multiple_of(BLOCK) && group.is_multiple_of(16) && group > 0
        }
        _ => false,
    }
}

/// One row of an integer format to f32, as [`crate::kernels::scalar::decode_row`] gives it
/// bit for bit (each value an exact conversion of its code times its group's scale, one
/// multiply): 16 values per step instead of the portable loop's byte at a time.
///
/// # Safety
/// AVX-512 F/BW/VL available; `decode_row_packed_supports(kind, cols)`; `row` holds the row's
/// `kind.row_len(cols)` bytes, `scales` one f32 per group, `out` at least `cols` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub unsafe fn decode_row_packed(
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(decode_row_packed_supports(kind, cols));
    debug_assert!(row.len() >= kind.row_len(cols) && out.len() >= cols);
    let group = kind.group(cols);
    debug_assert!(scales.len() >= cols.div_ceil(group));
    let o = out.as_mut_ptr();
    let p = row.as_ptr();
    // SAFETY: the table holds 16 f32.
    let mxfp4 = unsafe { _mm512_loadu_ps(crate::kernels::scalar::MXFP4_LUT.as_ptr()) };
    let nib = _mm_set1_epi8(0x0f);
    // The scale of each run of 16 values, walked without a division per run.
    let (mut gi, mut left) = (0usize, group);
    let mut next_scale = || {
        let s = _mm512_set1_ps(scales[gi]);
        left -= 16;
        if left == 0 {
            gi += 1;
            left = group;
        }
        s
    };
    let mut c = 0;
    while c < cols {
        let s0 = next_scale();
        let s1 = next_scale();
        // SAFETY: `c + 32 <= cols` (cols is a multiple of 32): the block's bytes lie inside
        // the row (16 for the 4-bit formats, 32 for Q8) and its 32 outputs inside `out`.
        unsafe {
            let (a, b) = match kind {
                WeightFormat::Q8 { .. } => {
                    let v = _mm256_loadu_si256(p.add(c) as *const __m256i);
                    (
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))),
                    )
                }
                _ => {
                    // Byte i holds value 2i (low nibble) and 2i + 1 (high).
                    let v = _mm_loadu_si128(p.add(c / 2) as *const __m128i);
                    let lo = _mm_and_si128(v, nib);
                    let hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
                    let first = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
                    let second = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
                    if matches!(kind, WeightFormat::Mxfp4 { .. }) {
                        (
                            _mm512_permutexvar_ps(first, mxfp4),
                            _mm512_permutexvar_ps(second, mxfp4),
                        )
                    } else {
                        let eight = _mm512_set1_epi32(8);
                        (
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(first, eight)),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(second, eight)),
                        )
                    }
                }
            };
            _mm512_storeu_ps(o.add(c), _mm512_mul_ps(a, s0));
            _mm512_storeu_ps(o.add(c + 16), _mm512_mul_ps(b, s1));
        }
        c += BLOCK;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_input_order_is_evens_then_odds_per_block() {
        let x: Vec<f32> = (0..96).map(|i| i as f32).collect();
        let want: Vec<f32> = x
            .chunks(BLOCK)
            .flat_map(|b| b.iter().step_by(2).chain(b.iter().skip(1).step_by(2)))
            .copied()
            .collect();
        let mut scalar = vec![0f32; x.len()];
        bf16_input_order_scalar(&x, &mut scalar);
        assert_eq!(scalar, want);
        // On this machine's best path (AVX-512 where it runs).
        assert_eq!(bf16_input_order(&x), want);
    }
}
