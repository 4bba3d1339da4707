//! Packed rows decoded inside the loops that apply them: MLA's decode walks a head's
//! `kv_b_proj` rows on every token (the absorbed query `sum_d q[d] * W_uk[d]`, then
//! `W_uv[v] . ctx`), and decoding each row into a buffer, then reading it back in `axpy` /
//! `dot`, cost most of a Q8 token's attention core (1.2 of 17 ms, `bench compute --profile`).
//! Here a chunk of a row is decoded into registers and used at once, one call per head and
//! instruction set instead of three per row. Every value is bit for bit what
//! [`super::vector::decode_row`] then [`super::vector::axpy`] / [`super::vector::dot`] give
//! (the same conversions, one rounding for the scale, the same sums in the same order), so a
//! decode step still equals the prefill chunk's tiles.

use deltafin_formats::WeightFormat;

use super::shape::KernelShape;
use super::vector::{level, reduce64, Level};

/// Rows of a packed matrix with their scales already f32: `rows` rows of `cols` values, row
/// `r`'s bytes at `data[r * row_len..]` and its scales at `scales[r * per_row..]`.
#[derive(Clone, Copy, Debug)]
pub struct PackedRows<'a> {
    kind: Kind,
    data: &'a [u8],
    row_len: usize,
    scales: &'a [f32],
    per_row: usize,
    rows: usize,
    cols: usize,
}

/// The formats decoded here; others go through a row buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Signed codes, a scale per `group` columns.
    Q8 { group: usize },
    /// Two codes per byte (low nibble first, offset 8), a scale per `group` (even) columns.
    Int4 { group: usize },
    /// Unscaled.
    Bf16,
}

impl<'a> PackedRows<'a> {
    /// `None` for a format or shape this module does not decode (the caller decodes rows one
    /// by one instead), or lengths that do not hold `rows` rows.
    pub fn new(
        format: WeightFormat,
        data: &'a [u8],
        scales: &'a [f32],
        per_row: usize,
        rows: usize,
        cols: usize,
    ) -> Option<Self> {
        let kind = match format {
            WeightFormat::Q8 { group } if group > 0 => Kind::Q8 { group },
            WeightFormat::Int4 { group }
                if group > 0 && group.is_multiple_of(2) && cols.is_multiple_of(2) =>
            {
                Kind::Int4 { group }
            }
            WeightFormat::Bf16 => Kind::Bf16,
            _ => return None,
        };
        let row_len = format.row_len(cols);
        let groups = match kind {
            Kind::Q8 { group } | Kind::Int4 { group } => cols.div_ceil(group),
            Kind::Bf16 => 0,
        };
        let fits = data.len() >= rows.checked_mul(row_len)?
            && per_row >= groups
            && scales.len() >= rows.checked_mul(per_row)?;
        fits.then_some(PackedRows {
            kind,
            data,
            row_len,
            scales,
            per_row,
            rows,
            cols,
        })
    }
}

/// Columns decoded at a time: four AVX2 registers of values beside four of accumulators.
const CHUNK: usize = 32;
/// [`super::vector`]'s lane accumulators per dot product and the width of one chain.
const LANES: usize = 64;
const CHAIN: usize = 16;

/// `w[..m] = row's columns c0..c0 + m` decoded (`m <= CHUNK`): `code as f32 * scale`, one
/// rounding, as the reference decoder.
#[inline(always)]
fn decode_chunk(p: &PackedRows<'_>, r: usize, c0: usize, m: usize, w: &mut [f32; CHUNK]) {
    let row = &p.data[r * p.row_len..(r + 1) * p.row_len];
    let scales = &p.scales[r * p.per_row..(r + 1) * p.per_row];
    match p.kind {
        // A whole chunk under one scale (groups of 32, 64, 128, ..): fixed-length loops the
        // compiler turns into straight vector code.
        Kind::Q8 { group } if m == CHUNK && group.is_multiple_of(CHUNK) => {
            let s = scales[c0 / group];
            let b: &[u8; CHUNK] = row[c0..c0 + CHUNK].try_into().expect("a chunk");
            for k in 0..CHUNK {
                w[k] = b[k] as i8 as f32 * s;
            }
        }
        Kind::Int4 { group } if m == CHUNK && group.is_multiple_of(CHUNK) => {
            let s = scales[c0 / group];
            let b: &[u8; CHUNK / 2] = row[c0 / 2..(c0 + CHUNK) / 2].try_into().expect("a chunk");
            for k in 0..CHUNK / 2 {
                w[2 * k] = ((b[k] & 0xf) as i32 - 8) as f32 * s;
                w[2 * k + 1] = ((b[k] >> 4) as i32 - 8) as f32 * s;
            }
        }
        Kind::Bf16 => {
            for (o, b) in w[..m].iter_mut().zip(row[2 * c0..].chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        Kind::Q8 { group } => {
            let mut j = 0;
            while j < m {
                let g = (c0 + j) / group;
                let end = ((g + 1) * group - c0).min(m);
                let s = scales[g];
                for (o, &b) in w[j..end].iter_mut().zip(&row[c0 + j..c0 + end]) {
                    *o = b as i8 as f32 * s;
                }
                j = end;
            }
        }
        Kind::Int4 { group } => {
            // `c0` and every group boundary are even: whole bytes per segment.
            let mut j = 0;
            while j < m {
                let g = (c0 + j) / group;
                let end = ((g + 1) * group - c0).min(m);
                let s = scales[g];
                let bytes = &row[(c0 + j) / 2..(c0 + end) / 2];
                for (o, &b) in w[j..end].chunks_exact_mut(2).zip(bytes) {
                    o[0] = ((b & 0xf) as i32 - 8) as f32 * s;
                    o[1] = ((b >> 4) as i32 - 8) as f32 * s;
                }
                j = end;
            }
        }
    }
}

/// `out[t * cols + c] += coef[t * stride + r] * row_r[c]` for every row `r` in order, every
/// column `c` and every output `t < out.len() / cols`: bit for bit `axpy` with each decoded
/// row.
///
/// # Panics
/// If `coef` lacks a coefficient of an output.
pub fn axpy_rows_decoded(p: &PackedRows<'_>, coef: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len() / p.cols.max(1);
    assert!(
        n == 0 || p.rows == 0 || coef.len() > (n - 1) * stride + p.rows - 1,
        "axpy_rows_decoded: coefficients for every output"
    );
    match level() {
        Level::Portable => axpy_body(p, coef, stride, out),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::axpy_avx2(p, coef, stride, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { avx512::axpy_avx512(p, coef, stride, out) },
    }
}

/// `out[t * out_stride + r] = dot(row_r, xs[t * cols..(t + 1) * cols])` for every row `r` and
/// `t < n`: bit for bit `dot` with each decoded row.
///
/// # Panics
/// If `xs` holds fewer than `n` inputs or `out` lacks room for an output.
pub fn dots_rows_decoded(
    p: &PackedRows<'_>,
    xs: &[f32],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    assert!(
        xs.len() >= n * p.cols,
        "dots_rows_decoded: an input per output"
    );
    assert!(
        n == 0 || p.rows == 0 || out.len() > (n - 1) * out_stride + p.rows - 1,
        "dots_rows_decoded: room for every output"
    );
    match level() {
        Level::Portable => dots_body(p, xs, n, out, out_stride),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dots_avx2(p, xs, n, out, out_stride) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { avx512::dots_avx512(p, xs, n, out, out_stride) },
    }
}

#[inline(always)]
fn axpy_body(p: &PackedRows<'_>, coef: &[f32], stride: usize, out: &mut [f32]) {
    let cols = p.cols;
    let n = out.len() / cols.max(1);
    let mut w = [0f32; CHUNK];
    for c0 in (0..cols).step_by(CHUNK) {
        let m = CHUNK.min(cols - c0);
        if n == 1 && m == CHUNK {
            // One output (a decode step): its chunk stays in registers across the rows.
            let mut acc = [0f32; CHUNK];
            acc.copy_from_slice(&out[c0..c0 + CHUNK]);
            for (r, &a) in coef[..p.rows].iter().enumerate() {
                decode_chunk(p, r, c0, CHUNK, &mut w);
                for k in 0..CHUNK {
                    acc[k] += a * w[k];
                }
            }
            out[c0..c0 + CHUNK].copy_from_slice(&acc);
            continue;
        }
        for r in 0..p.rows {
            decode_chunk(p, r, c0, m, &mut w);
            for t in 0..n {
                let a = coef[t * stride + r];
                for (o, &x) in out[t * cols + c0..t * cols + c0 + m].iter_mut().zip(&w) {
                    *o += a * x;
                }
            }
        }
    }
}

#[inline(always)]
fn dots_body(p: &PackedRows<'_>, xs: &[f32], n: usize, out: &mut [f32], out_stride: usize) {
    let cols = p.cols;
    // `dot`'s lanes: whole 64-blocks into all 64, then whole 16-blocks of the rest into the
    // first 16, then the tail into the first lanes, then the fixed pairwise reduction.
    let full = cols / LANES * LANES;
    let mut w = [0f32; CHUNK];
    let mut accs = vec![[0f32; LANES]; n];
    for r in 0..p.rows {
        accs.iter_mut().for_each(|a| *a = [0f32; LANES]);
        for c0 in (0..cols).step_by(CHUNK) {
            let m = CHUNK.min(cols - c0);
            decode_chunk(p, r, c0, m, &mut w);
            for (t, acc) in accs.iter_mut().enumerate() {
                let x = &xs[t * cols + c0..t * cols + c0 + m];
                if c0 < full {
                    // Inside a 64-block: lanes `c0 % 64..`.
                    let lanes = &mut acc[c0 % LANES..c0 % LANES + CHUNK];
                    for k in 0..CHUNK {
                        lanes[k] += w[k] * x[k];
                    }
                } else {
                    // Past the 64-blocks: lane `(c - full) % 16` for whole 16-blocks, the
                    // tail's lane its offset in the tail.
                    let blocks16 = (cols - full) / CHAIN * CHAIN;
                    for k in 0..m {
                        let c = c0 + k - full;
                        let lane = if c < blocks16 {
                            c % CHAIN
                        } else {
                            c - blocks16
                        };
                        acc[lane] += w[k] * x[k];
                    }
                }
            }
        }
        for (t, acc) in accs.iter_mut().enumerate() {
            out[t * out_stride + r] = reduce64(acc);
        }
    }
}

const _: () = assert!(LANES.is_multiple_of(CHUNK));

/// Whether the SIMD bodies decode every chunk of these rows in registers: whole 32-column
/// chunks, each under one scale.
#[cfg(target_arch = "x86_64")]
fn whole_chunks(p: &PackedRows<'_>) -> bool {
    let group_ok = match p.kind {
        Kind::Q8 { group } | Kind::Int4 { group } => group.is_multiple_of(CHUNK),
        Kind::Bf16 => true,
    };
    group_ok && p.cols.is_multiple_of(CHUNK)
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{whole_chunks, Kind, PackedRows, CHUNK, LANES};

    /// Columns `c0..c0 + 32` of row `r` as four vectors in column order: `code as f32 *
    /// scale`, one rounding (`mul`), as the reference decoder. `c0 + 32 <= cols`, one scale.
    ///
    /// # Safety
    /// AVX2 available. (Not a `target_feature` function: those are not inlined into their
    /// callers' loops, and returning the four vectors through memory made the fused loops
    /// slower than decoding rows into a buffer.)
    #[inline(always)]
    unsafe fn chunk32(p: &PackedRows<'_>, r: usize, c0: usize) -> [__m256; 4] {
        let row = &p.data[r * p.row_len..(r + 1) * p.row_len];
        // SAFETY: AVX2 (the caller's guarantee); each load reads inside the slice checked
        // just before it.
        unsafe {
            match p.kind {
                Kind::Q8 { group } => {
                    let s = _mm256_set1_ps(p.scales[r * p.per_row + c0 / group]);
                    let b = row[c0..c0 + 32].as_ptr();
                    let q = |j: usize| {
                        let v = _mm_loadl_epi64(b.add(8 * j) as *const __m128i);
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s)
                    };
                    [q(0), q(1), q(2), q(3)]
                }
                Kind::Int4 { group } => {
                    let s = _mm256_set1_ps(p.scales[r * p.per_row + c0 / group]);
                    let v = _mm_loadu_si128(row[c0 / 2..c0 / 2 + 16].as_ptr() as *const __m128i);
                    let m = _mm_set1_epi8(0x0f);
                    let (lo, hi) = (_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
                    // Byte i's low nibble is column 2i, its high one 2i + 1.
                    let (a, c) = (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
                    let eight = _mm256_set1_epi32(8);
                    let f = |x: __m128i| {
                        let codes = _mm256_sub_epi32(_mm256_cvtepu8_epi32(x), eight);
                        _mm256_mul_ps(_mm256_cvtepi32_ps(codes), s)
                    };
                    [f(a), f(_mm_srli_si128(a, 8)), f(c), f(_mm_srli_si128(c, 8))]
                }
                Kind::Bf16 => {
                    let b = row[2 * c0..2 * c0 + 64].as_ptr();
                    let h = |j: usize| {
                        let v = _mm_loadu_si128(b.add(16 * j) as *const __m128i);
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
                    };
                    [h(0), h(1), h(2), h(3)]
                }
            }
        }
    }

    /// Eight floats of `v` from `at` (`v.len() >= at + 8`).
    #[inline(always)]
    fn load8(v: &[f32], at: usize) -> __m256 {
        assert!(v.len() >= at + 8);
        // SAFETY: 8 floats from `at` (asserted).
        unsafe { _mm256_loadu_ps(v.as_ptr().add(at)) }
    }

    #[inline(always)]
    fn store8(v: &mut [f32], at: usize, x: __m256) {
        assert!(v.len() >= at + 8);
        // SAFETY: 8 floats from `at` (asserted).
        unsafe { _mm256_storeu_ps(v.as_mut_ptr().add(at), x) }
    }

    /// `super::axpy_body` in AVX2 registers: `acc + a * w`, a multiply then an add (no FMA:
    /// the reference rounds twice).
    #[target_feature(enable = "avx2")]
    pub(super) fn axpy_avx2(p: &PackedRows<'_>, coef: &[f32], stride: usize, out: &mut [f32]) {
        if !whole_chunks(p) {
            return super::axpy_body(p, coef, stride, out);
        }
        let cols = p.cols;
        let n = out.len() / cols.max(1);
        for c0 in (0..cols).step_by(CHUNK) {
            if n == 1 {
                // One output (a decode step): its chunk stays in registers across the rows.
                let mut acc: [__m256; 4] = std::array::from_fn(|j| load8(out, c0 + 8 * j));
                for (r, &a) in coef[..p.rows].iter().enumerate() {
                    // SAFETY: AVX2 (this function's feature).
                    let (a, w) = (_mm256_set1_ps(a), unsafe { chunk32(p, r, c0) });
                    for j in 0..4 {
                        acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(a, w[j]));
                    }
                }
                for (j, &v) in acc.iter().enumerate() {
                    store8(out, c0 + 8 * j, v);
                }
                continue;
            }
            for r in 0..p.rows {
                // SAFETY: AVX2 (this function's feature).
                let w = unsafe { chunk32(p, r, c0) };
                for t in 0..n {
                    let a = _mm256_set1_ps(coef[t * stride + r]);
                    for (j, &wj) in w.iter().enumerate() {
                        let at = t * cols + c0 + 8 * j;
                        store8(out, at, _mm256_add_ps(load8(out, at), _mm256_mul_ps(a, wj)));
                    }
                }
            }
        }
    }

    /// `super::dots_body` in AVX2 registers for rows of whole 64-column blocks: `dot`'s 64
    /// lanes as eight vectors, the product `w * x`, then its fixed reduction.
    #[target_feature(enable = "avx2")]
    pub(super) fn dots_avx2(
        p: &PackedRows<'_>,
        xs: &[f32],
        n: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        // One input (a decode step) only: a few (speculative decoding's check) run the
        // portable body.
        if !whole_chunks(p) || !p.cols.is_multiple_of(LANES) || n != 1 {
            return super::dots_body(p, xs, n, out, out_stride);
        }
        let zero = _mm256_setzero_ps();
        for (r, o) in out[..p.rows].iter_mut().enumerate() {
            // `dot`'s 64 lanes in registers.
            let mut acc = [zero; 8];
            for c0 in (0..p.cols).step_by(LANES) {
                // SAFETY: AVX2 (this function's feature).
                let (w0, w1) = unsafe { (chunk32(p, r, c0), chunk32(p, r, c0 + CHUNK)) };
                for (j, &wj) in w0.iter().chain(&w1).enumerate() {
                    let x = load8(xs, c0 + 8 * j);
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(wj, x));
                }
            }
            let mut lanes = [0f32; LANES];
            for (j, &v) in acc.iter().enumerate() {
                store8(&mut lanes, 8 * j, v);
            }
            *o = super::reduce64(&mut lanes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::scalar;
    use crate::kernels::vector::{axpy, dot};

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// Random rows of `format` with random scales, as bytes and f32 scales.
    fn rows_of(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        seed: &mut u64,
    ) -> (Vec<u8>, Vec<f32>, usize) {
        let row_len = format.row_len(cols);
        let data: Vec<u8> = if format == WeightFormat::Bf16 {
            // Finite values (random bytes would hold NaNs, whose payloads need not agree).
            (0..rows * cols)
                .flat_map(|_| ((rng(seed).to_bits() >> 16) as u16).to_le_bytes())
                .collect()
        } else {
            (0..rows * row_len)
                .map(|_| ((rng(seed) + 0.5) * 255.0) as u8)
                .collect()
        };
        let per_row = format.scales_per_row(cols).max(1);
        let scales = (0..rows * per_row).map(|_| rng(seed) * 0.01).collect();
        (data, scales, per_row)
    }

    fn decoded(
        format: WeightFormat,
        data: &[u8],
        scales: &[f32],
        per_row: usize,
        r: usize,
        cols: usize,
    ) -> Vec<f32> {
        let row_len = format.row_len(cols);
        let mut out = vec![0f32; cols];
        scalar::decode_row(
            format,
            &data[r * row_len..(r + 1) * row_len],
            &scales[r * per_row..(r + 1) * per_row],
            cols,
            &mut out,
        );
        out
    }

    #[test]
    fn fused_equals_decode_then_axpy_and_dot_bit_for_bit() {
        let mut seed = 11u64;
        let formats = [
            WeightFormat::Q8 { group: 32 },
            WeightFormat::Q8 { group: 128 },
            WeightFormat::Q8 { group: 48 },
            WeightFormat::Int4 { group: 32 },
            WeightFormat::Int4 { group: 64 },
            WeightFormat::Bf16,
        ];
        for format in formats {
            for cols in [256, 96, 144, 200, 512] {
                let rows = 9;
                let (data, scales, per_row) = rows_of(format, rows, cols, &mut seed);
                let p = PackedRows::new(format, &data, &scales, per_row, rows, cols)
                    .expect("a decoded format");
                let dec: Vec<Vec<f32>> = (0..rows)
                    .map(|r| decoded(format, &data, &scales, per_row, r, cols))
                    .collect();
                for n in [1, 2, 5] {
                    let stride = rows + 3;
                    let coef: Vec<f32> = (0..n * stride).map(|_| rng(&mut seed)).collect();
                    let start: Vec<f32> = (0..n * cols).map(|_| rng(&mut seed)).collect();
                    let mut want = start.clone();
                    for t in 0..n {
                        for (r, row) in dec.iter().enumerate() {
                            axpy(
                                &mut want[t * cols..(t + 1) * cols],
                                coef[t * stride + r],
                                row,
                            );
                        }
                    }
                    let mut got = start.clone();
                    axpy_rows_decoded(&p, &coef, stride, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "axpy {format:?} cols {cols} n {n}");
                    // The portable build too (the dispatch above runs the widest level).
                    let mut got = start.clone();
                    axpy_body(&p, &coef, stride, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "portable axpy {format:?} {cols} {n}"
                    );

                    // The AVX2 body on a machine whose widest level is AVX-512.
                    #[cfg(target_arch = "x86_64")]
                    if std::arch::is_x86_feature_detected!("avx2") {
                        let mut got = start.clone();
                        // SAFETY: AVX2 detected.
                        unsafe { x86::axpy_avx2(&p, &coef, stride, &mut got) };
                        assert_eq!(bits(&got), bits(&want), "avx2 axpy {format:?} {cols} {n}");
                    }

                    let xs: Vec<f32> = (0..n * cols).map(|_| rng(&mut seed)).collect();
                    let out_stride = rows + 1;
                    let mut want = vec![0f32; n * out_stride];
                    for t in 0..n {
                        for (r, row) in dec.iter().enumerate() {
                            want[t * out_stride + r] = dot(row, &xs[t * cols..(t + 1) * cols]);
                        }
                    }
                    let mut got = vec![0f32; n * out_stride];
                    dots_rows_decoded(&p, &xs, n, &mut got, out_stride);
                    assert_eq!(bits(&got), bits(&want), "dots {format:?} cols {cols} n {n}");
                    let mut got = vec![0f32; n * out_stride];
                    dots_body(&p, &xs, n, &mut got, out_stride);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "portable dots {format:?} {cols} {n}"
                    );
                    #[cfg(target_arch = "x86_64")]
                    if std::arch::is_x86_feature_detected!("avx2") {
                        let mut got = vec![0f32; n * out_stride];
                        // SAFETY: AVX2 detected.
                        unsafe { x86::dots_avx2(&p, &xs, n, &mut got, out_stride) };
                        assert_eq!(bits(&got), bits(&want), "avx2 dots {format:?} {cols} {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn other_formats_and_short_buffers_are_refused() {
        let f = WeightFormat::Q8 { group: 32 };
        assert!(PackedRows::new(f, &[0u8; 64], &[1.0; 2], 1, 2, 32).is_some());
        assert!(PackedRows::new(f, &[0u8; 63], &[1.0; 2], 1, 2, 32).is_none());
        assert!(PackedRows::new(f, &[0u8; 64], &[1.0; 1], 1, 2, 32).is_none());
        assert!(PackedRows::new(WeightFormat::F32, &[0u8; 512], &[1.0; 2], 1, 2, 64).is_none());
        let odd = WeightFormat::Int4 { group: 33 };
        assert!(PackedRows::new(odd, &[0u8; 66], &[1.0; 4], 2, 2, 66).is_none());
    }
}
