//! Q8 rows against 16-bit inputs on AVX2 without VNNI, from the inputs' true 16-bit values
//! ([`I16Inputs::wide`]): each block's 32 signed codes sign-extended to 16 bits (two
//! `vpmovsxbw` loads) meet the inputs in two `vpmaddwd`s per input.
//!
//! The two-plane path (`x86.rs`, `256 * hi + lo` with `vpmaddubsw`) needs the sign trick for
//! signed codes (`vpsignb` of each plane, `|w|` once) and two `vpmaddubsw` + two `vpmaddwd` per
//! 32 products and plane: about 1.5 times the operations of this one, which gave Q8 with
//! 16-bit activations about 0.82-0.90 of llama.cpp's speed. The integer block sums are the
//! same (`256 * hi + lo` is the 16-bit value), so only the float rounding of the partial sums
//! differs, within the Q8 error budget of the kernel tests; the result does not depend on how
//! many inputs a call takes (a matrix-vector product equals the matrix product's row).
//!
//! 8-bit inputs ([`crate::kernels::Act::I8`], the hi plane alone) come with their copy too,
//! `256 * hi`: the same kernel, the two-plane kernel's integer sums.
//!
//! [`I16Inputs::wide`]: crate::kernels::inputs::I16Inputs::wide

use std::arch::x86_64::*;

use deltafin_formats::WeightFormat;

use crate::kernels::inputs::I16Inputs;
use crate::kernels::shape::{strided_rows, KernelShape};
use crate::kernels::x86::{self, hsum, RowScales, RowsOf, RAW_SCALE_BLOCKS};

const BLOCK: usize = 32;

/// [`x86::rows_i16`], except that Q8 inputs carrying their 16-bit copy (quantized for
/// [`crate::kernels::isa::Isa::Avx2`]: no VNNI) take [`q8_wide_rows`]: the same outputs up to
/// the rounding of partial sums.
///
/// # Safety
/// As for [`x86::rows_i16`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_i16(
    vnni: bool,
    kind: WeightFormat,
    data: &[u8],
    rb: usize,
    scales: RowScales<'_>,
    per_row: usize,
    x: &I16Inputs,
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    // 8-bit inputs (`hi_only`) too: their copy holds `256 * hi`.
    let wide = matches!(kind, WeightFormat::Q8 { .. }) && !vnni;
    if !wide || x.wide.is_empty() {
        // SAFETY: the caller's contract.
        unsafe {
            x86::rows_i16(
                vnni, kind, data, rb, scales, per_row, x, t0, n, cols, out, stride,
            )
        };
        return;
    }
    debug_assert!(kind.simd_shape(cols) && rb == kind.row_len(cols) && n <= out.len());
    let count = strided_rows(out.len(), n, stride);
    // Checked: a panic, not an out-of-bounds read, if a caller breaks the contract.
    assert!(
        data.len() >= count * rb
            && scales.holds(count, per_row)
            && per_row >= cols / BLOCK
            && rb >= cols
            && x.wide.len() >= (t0 + n) * cols
            && x.d.len() >= (t0 + n) * (cols / BLOCK),
        "Q8 16-bit kernel: {count} rows of {rb} bytes, {} inputs",
        t0 + n
    );
    let rows = RowsOf {
        data,
        rb,
        count,
        scales,
        per_row,
    };
    // SAFETY: the caller's contract; `wide` holds the same inputs as the planes.
    unsafe { q8_wide_rows(&rows, &x.wide, &x.d, t0, n, cols, out, stride) }
}

/// Each of `rows` (Q8 codes, `cols` per row, block scales in `rows.scales`) against inputs
/// `t0..t0 + n` of `wide` (`[.., cols]` 16-bit values) with block scales `d` (`[.., cols/32]`),
/// input `t0 + t` of row `r` written to `out[r * stride + t]`.
///
/// # Safety
/// AVX2 and FMA available; `cols` a multiple of 32; every row `cols` bytes of codes with at
/// least `cols / 32` scales; `wide` and `d` hold `t0 + n` inputs; `out.len() ==
/// (rows.count - 1) * stride + n` with `n <= stride` when there is more than one row.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_wide_rows(
    rows: &RowsOf<'_>,
    wide: &[i16],
    d: &[f32],
    t0: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
) {
    let blocks = cols / BLOCK;
    let mut t = t0;
    while t < t0 + n {
        let k = (t0 + n - t).min(4);
        let w = &wide[t * cols..(t + k) * cols];
        let ds = &d[t * blocks..(t + k) * blocks];
        let o = &mut out[t - t0..];
        // SAFETY: the caller's contract; the slices hold `k` inputs.
        unsafe {
            match k {
                4 => q8_wide::<4>(rows, w, ds, cols, o, stride),
                3 => q8_wide::<3>(rows, w, ds, cols, o, stride),
                2 => q8_wide::<2>(rows, w, ds, cols, o, stride),
                _ => q8_wide::<1>(rows, w, ds, cols, o, stride),
            }
        }
        t += k;
    }
}

/// [`q8_wide_rows`] for exactly `N` inputs: every row once. Per block and input the two
/// `vpmaddwd` sums (4 products per i32 lane: at most 4 * 128 * 32640 < 2^24, so converting
/// them to f32 is exact) are scaled by the weight's block scale times the input's and added
/// into one of two accumulators (even and odd blocks: two FMA chains); each input's
/// accumulation order is the same whatever `N` is.
///
/// # Safety
/// As for [`q8_wide_rows`], with `wide` holding `N * cols` values and `d` `N * cols / 32`
/// (checked: a panic), `out_all` `(rows.count - 1) * stride + N`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_wide<const N: usize>(
    rows: &RowsOf<'_>,
    wide: &[i16],
    d: &[f32],
    cols: usize,
    out_all: &mut [f32],
    stride: usize,
) {
    let blocks = cols / BLOCK;
    let xp = wide[..N * cols].as_ptr();
    let d = &d[..N * blocks];
    let mut sbuf = [0f32; RAW_SCALE_BLOCKS];
    for r in 0..rows.count {
        let row = &rows.data[r * rows.rb..][..cols];
        // The row PREFETCH_ROWS ahead, in software: each task's rows are one short stream
        // and a decode's experts many of them.
        x86::prefetch_ahead(rows, r);
        // SAFETY: AVX2 and F16C are enabled here.
        let ws = unsafe { rows.scales.row(r, rows.per_row, blocks, &mut sbuf) };
        let out = &mut out_all[r * stride..r * stride + N];
        let p = row.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        // The scale products of up to 8 blocks at a time, each then broadcast from here.
        let mut wd = [[0f32; 8]; N];
        for g in (0..blocks).step_by(8) {
            let m = (blocks - g).min(8);
            for (t, wd) in wd.iter_mut().enumerate() {
                let (w, dt) = (&ws[g..g + m], &d[t * blocks + g..][..m]);
                if m == 8 {
                    // SAFETY: 8 values each of `w`, `dt` and `wd`.
                    unsafe {
                        let v = _mm256_mul_ps(
                            _mm256_loadu_ps(w.as_ptr()),
                            _mm256_loadu_ps(dt.as_ptr()),
                        );
                        _mm256_storeu_ps(wd.as_mut_ptr(), v);
                    }
                } else {
                    for ((o, &a), &b) in wd.iter_mut().zip(w).zip(dt) {
                        *o = a * b;
                    }
                }
            }
            // Blocks in pairs, even into `acc[t][0]` and odd into `acc[t][1]`: with the index
            // known at compile time the accumulators stay in registers. (`acc[k & 1]` kept
            // them on the stack, a store-to-load chain per FMA: 24 GMAC/s in cache at 128
            // inputs, against 31 now.)
            let mut k = 0;
            while k < m {
                // SAFETY: `g + k < blocks`, and `g + k + 1 < blocks` when `k + 1 < m`: each
                // block's 32 codes are inside `row`, and its 32 values `[t * cols + 32b ..]
                // [..32]` inside `wide` for `t < N`.
                unsafe {
                    let c = block_codes(p, g + k);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        acc[0] = block_fma(c, xp.add(t * cols + BLOCK * (g + k)), wd[t][k], acc[0]);
                    }
                    if k + 1 < m {
                        let c = block_codes(p, g + k + 1);
                        for (t, acc) in acc.iter_mut().enumerate() {
                            let x = xp.add(t * cols + BLOCK * (g + k + 1));
                            acc[1] = block_fma(c, x, wd[t][k + 1], acc[1]);
                        }
                    }
                }
                k += 2;
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = hsum(_mm256_add_ps(a[0], a[1]));
        }
    }
}

/// Block `b`'s 32 codes of the row at `p`, sign-extended to 16 bits (two halves).
///
/// # Safety
/// AVX2 available; `p + 32 * b .. + 32` inside the row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_codes(p: *const u8, b: usize) -> [__m256i; 2] {
    // SAFETY: the caller's contract.
    unsafe {
        [
            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(BLOCK * b) as *const __m128i)),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(BLOCK * b + 16) as *const __m128i)),
        ]
    }
}

/// `acc + scale * (codes . x)`: one block's 32 products with the 32 16-bit inputs at `x`, the
/// exact integer sum per lane converted to f32.
///
/// # Safety
/// AVX2 and FMA available; 32 values readable at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_fma(c: [__m256i; 2], x: *const i16, scale: f32, acc: __m256) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let s = _mm256_add_epi32(
            _mm256_madd_epi16(c[0], _mm256_loadu_si256(x as *const __m256i)),
            _mm256_madd_epi16(c[1], _mm256_loadu_si256(x.add(16) as *const __m256i)),
        );
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(scale), acc)
    }
}
