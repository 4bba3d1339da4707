//! AVX-512 BF16 kernels for [`super::Act::Bf16`]: BF16 weights against inputs rounded to BF16
//! (round to nearest even, as `vcvtne2ps2bf16` does), multiplied by `vdpbf16ps`, 32
//! multiply-adds per instruction where the f32 path does 16 (226-234 vs 113-117 GMAC/s on one
//! Zen 5 core, `benches/results/bf16_tile_session11.txt`). This is llama.cpp's BF16 path's
//! precision, opt-in: the model default keeps f32 activations.
//!
//! Weights are taken in their stored order: `vdpbf16ps` multiplies the pair `(2i, 2i+1)` of
//! each 32-bit lane, and the rounded inputs are built in the same natural order, so neither side
//! is reordered. Every output is one 16-lane accumulator over the 32-column blocks in order,
//! then one reduction, whatever tile computes it: a matrix-vector product equals the matching
//! row of a matrix product bit for bit.

use std::arch::x86_64::*;

use crate::kernels::shape::BLOCK;

/// Rows per matrix-product tile: 4 rows x 4 inputs = 16 accumulators, each weight load serving
/// four inputs and each rounded input four rows.
pub const TILE_ROWS: usize = 4;
/// Inputs per tile call.
pub const TILE_INPUTS: usize = 4;

/// Prefetch distance floor (bytes) of the multi-row tiles.
const MIN_PREFETCH_AHEAD: usize = 4096;
/// The single-row tile's (matrix-vector products): the f32 single-row tile's distance.
const MIN_PREFETCH_AHEAD_ONE_ROW: usize = super::x86_avx512::MIN_PREFETCH_AHEAD;

/// Whether this machine runs these kernels.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

/// `R` rows against `N` inputs.
///
/// # Safety
/// AVX-512 F/BW/BF16 available; `cols` a multiple of 32; each `rows[r]` holds `2 * cols`
/// bytes, `x` `N * cols` values, each `outs[r]` `N`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::needless_range_loop)] // acc[r][t] by index: the accumulators stay in registers
unsafe fn tile<const R: usize, const N: usize>(
    rows: [&[u8]; R],
    x: &[f32],
    cols: usize,
    outs: [&mut [f32]; R],
) {
    let xp = x.as_ptr();
    let floor = if R == 1 {
        MIN_PREFETCH_AHEAD_ONE_ROW
    } else {
        MIN_PREFETCH_AHEAD
    };
    let ahead = (R * rows[0].len()).max(floor);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    let mut c = 0usize;
    while c < cols {
        // SAFETY: `c + 32 <= cols` (a multiple of 32), so each row load reads bytes
        // `2c .. 2c + 64` of a `2 * cols`-byte row and the input loads `x[t*cols + c ..][..32]`
        // with `t < N`, inside `x`; the prefetch is a hint.
        unsafe {
            // Filled in a loop, not `from_fn`: a closure there stayed out of line.
            let mut w = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); R];
            for (w, row) in w.iter_mut().zip(&rows) {
                let p = row.as_ptr().add(2 * c);
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead) as *const i8);
                // The same 512 bits: 32 BF16 weights in stored order.
                *w = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    p as *const __m512i,
                ));
            }
            for t in 0..N {
                let xr = xp.add(t * cols + c);
                // Lower 16 BF16 lanes from the second operand: inputs c..c+16, then c+16..c+32.
                let xb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr.add(16)), _mm512_loadu_ps(xr));
                for r in 0..R {
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[r], xb);
                }
            }
        }
        c += BLOCK;
    }
    for (out, ar) in outs.into_iter().zip(&acc) {
        for (o, a) in out.iter_mut().zip(ar) {
            *o = _mm512_reduce_add_ps(*a);
        }
    }
}

/// `R` rows of a BF16 matrix against `n` f32 inputs rounded to BF16:
/// `outs[r][t] = sum_c w_r[c] * bf16(x[t*cols + c])`.
///
/// # Safety
/// [`available`]; `cols` a multiple of 32; each `rows[r].len() == 2 * cols`,
/// `x.len() >= n * cols`, each `outs[r].len() >= n`; `R` is 1 or [`TILE_ROWS`].
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn rows_bf16<const R: usize>(
    rows: [&[u8]; R],
    x: &[f32],
    cols: usize,
    n: usize,
    outs: [&mut [f32]; R],
) {
    debug_assert!(cols.is_multiple_of(BLOCK) && rows.iter().all(|r| r.len() == 2 * cols));
    debug_assert!(x.len() >= n * cols && outs.iter().all(|o| o.len() >= n));
    let mut outs = outs;
    let mut t = 0;
    while t < n {
        let take = (n - t).min(TILE_INPUTS);
        let xs = &x[t * cols..(t + take) * cols];
        let mut it = outs.iter_mut();
        let os: [&mut [f32]; R] = std::array::from_fn(|_| match it.next() {
            Some(o) => &mut o[t..t + take],
            None => unreachable!("R outputs"),
        });
        // SAFETY: the caller's contract is the tile's; `xs` holds `take` inputs and each of
        // `os` `take` outputs.
        unsafe {
            match take {
                4 => tile::<R, 4>(rows, xs, cols, os),
                3 => tile::<R, 3>(rows, xs, cols, os),
                2 => tile::<R, 2>(rows, xs, cols, os),
                _ => tile::<R, 1>(rows, xs, cols, os),
            }
        }
        t += take;
    }
}

/// `dispatch::rows_task` for BF16 weights and [`super::Act::Bf16`] inputs: `o[i * n + t] =
/// dot(row i, x[t])` for the `o.len() / n` rows in `data`: one row at a time for one input
/// (the rows read in order, as the f32 matrix-vector tile reads them: on Zen 4 the eight-row
/// tile, eight streams at once, decoded 12% slower than the f32 path, and the single row
/// streamed as fast as it; benches/results/bf16_decode_tile_session13.txt), four at a time
/// over the inputs in chunks that stay in L1 for several (as the f32 tiles), then any last
/// rows one by one. Every output is summed the same way in each (see `x86_avx512_bf16`).
///
/// # Safety
/// [`available`]; `cols` a multiple of 32, `rb == 2 * cols`, `data` holding `o.len() / n` rows,
/// `x.len() >= n * cols`; `chunk` a multiple of 4.
pub unsafe fn rows_task(
    data: &[u8],
    rb: usize,
    x: &[f32],
    cols: usize,
    n: usize,
    chunk: usize,
    o: &mut [f32],
) {
    /// # Safety
    /// As for `rows_task`, with `xs` the chunk's `nn` inputs.
    unsafe fn tiles<const R: usize>(
        data: &[u8],
        rb: usize,
        xs: &[f32],
        cols: usize,
        n: usize,
        (t0, nn): (usize, usize),
        o: &mut [f32],
    ) -> usize {
        let nr = o.len() / n;
        let full = nr / R * R;
        for (q, oq) in o[..full * n].chunks_mut(R * n).enumerate() {
            let rows: [&[u8]; R] =
                std::array::from_fn(|k| &data[(q * R + k) * rb..(q * R + k + 1) * rb]);
            let mut it = oq.chunks_mut(n);
            let outs: [&mut [f32]; R] = std::array::from_fn(|_| match it.next() {
                Some(row) => &mut row[t0..t0 + nn],
                None => unreachable!("R rows of n outputs"),
            });
            // SAFETY: the caller's contract (`available()`, cols a multiple of 32); each row is
            // `rb = 2 * cols` bytes, `xs` holds `nn * cols` values and each of `outs` `nn`.
            unsafe { rows_bf16::<R>(rows, xs, cols, nn, outs) };
        }
        full
    }
    for t0 in (0..n).step_by(chunk) {
        let nn = chunk.min(n - t0);
        let xs = &x[t0 * cols..(t0 + nn) * cols];
        // One input: every row by the single-row tile below.
        let done = if n == 1 {
            0
        } else {
            // SAFETY: the caller's contract; `xs` holds the chunk's `nn` inputs.
            unsafe { tiles::<{ TILE_ROWS }>(data, rb, xs, cols, n, (t0, nn), o) }
        };
        for (i, orow) in o.chunks_mut(n).enumerate().skip(done) {
            let row = &data[i * rb..(i + 1) * rb];
            // SAFETY: as in `tiles`, for one row.
            unsafe { rows_bf16::<1>([row], xs, cols, nn, [&mut orow[t0..t0 + nn]]) };
        }
    }
}
