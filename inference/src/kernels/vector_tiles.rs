//! Tiled forms of [`super::vector`]'s `axpy` and `dot` for a prefill chunk's MLA heads: per
//! output the same operations in the same order as the one-at-a-time calls (so bit-identical
//! to them, on every instruction set, and a chunk gives what position-by-position decoding
//! gives), with a tile's accumulators held in registers instead of stored and reloaded by
//! every call. One call per head and chunk instead of thousands of 256-value calls: the
//! row-at-a-time MLA core ran at ~24 GMAC/s on a 32-token prefill.

use super::vector::{level, reduce16_of, reduce64, Level};

/// Outputs per register tile.
pub const TILE_POSITIONS: usize = 4;
/// Columns per register tile on AVX-512 (four 16-lane vectors per position: 16 of its 32
/// registers) and, for the tiled dot products, lanes per pass.
#[cfg(target_arch = "x86_64")]
const TILE_COLS_WIDE: usize = 64;
/// The same on AVX2 and the portable build (16 registers: four positions of 64 columns were
/// 32 accumulators, spilled and reloaded around every multiply-add; the MLA core of a 32-token
/// prefill ran at ~11 GMAC/s).
const TILE_COLS_NARROW: usize = 16;

/// `out[t, :] = sum over d in order of coef[t * stride + d] * w[d, :]` for `t < out.len() /
/// cols` and `d < rows` (`w` is `[rows, cols]`): bit for bit what zeroing `out[t]` and calling
/// `axpy(out[t], coef[t * stride + d], w[d])` for `d = 0, 1, ..` gives.
///
/// # Panics
/// If `w` holds fewer than `rows * cols` values or `coef` too few for the last output.
pub fn axpy_rows(
    coef: &[f32],
    stride: usize,
    w: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    let n = out.len() / cols.max(1);
    assert!(
        w.len() >= rows * cols,
        "axpy_rows: a row of w for every coefficient"
    );
    assert!(
        n == 0 || rows == 0 || coef.len() > (n - 1) * stride + rows - 1,
        "axpy_rows: coefficients for every output"
    );
    match level() {
        Level::Portable => axpy_rows_body::<TILE_COLS_NARROW>(coef, stride, w, rows, cols, out),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::axpy_rows_avx2(coef, stride, w, rows, cols, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::axpy_rows_avx512(coef, stride, w, rows, cols, out) },
    }
}

/// `out[t * out_stride] = dot(row, xs[t * len..(t + 1) * len])` for `t < n`, each bit for bit
/// what [`super::vector::dot`] gives.
///
/// # Panics
/// If `xs` holds fewer than `n * row.len()` values or `out` too few.
pub fn dot_many(row: &[f32], xs: &[f32], n: usize, out: &mut [f32], out_stride: usize) {
    let len = row.len();
    assert!(xs.len() >= n * len, "dot_many: an input for every output");
    assert!(
        n == 0 || out.len() > (n - 1) * out_stride,
        "dot_many: room for every output"
    );
    match level() {
        Level::Portable => dot_many_body::<TILE_COLS_NARROW>(row, xs, n, out, out_stride),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dot_many_avx2(row, xs, n, out, out_stride) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::dot_many_avx512(row, xs, n, out, out_stride) },
    }
}

/// `out[k][r] = q_k . rows[r]` for the `n_rows` rows of `q_k.len()` values laid end to end in
/// `rows`, for four queries at once (each row loaded once for all four): bit for bit what
/// [`super::vector::dots`] gives each query alone.
///
/// # Panics
/// If the queries differ in length, `rows` holds fewer than `n_rows` rows or an output fewer
/// than `n_rows` values.
pub fn dots4(
    qs: [&[f32]; TILE_POSITIONS],
    rows: &[f32],
    n_rows: usize,
    out: [&mut [f32]; TILE_POSITIONS],
) {
    let w = qs[0].len();
    assert!(
        qs.iter().all(|q| q.len() == w),
        "dots4: queries of one length"
    );
    assert!(rows.len() >= n_rows * w, "dots4: a row for every output");
    assert!(
        out.iter().all(|o| o.len() >= n_rows),
        "dots4: room for every output"
    );
    match level() {
        Level::Portable => dots4_body(qs, rows, n_rows, out),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dots4_avx2(qs, rows, n_rows, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::dots4_avx512(qs, rows, n_rows, out) },
    }
}

/// `dots_body`'s arithmetic per (query, row): 16 lane accumulators over whole 16-blocks, the
/// tail into the first lanes, the fixed pairwise reduction.
#[inline(always)]
fn dots4_body(
    qs: [&[f32]; TILE_POSITIONS],
    rows: &[f32],
    n_rows: usize,
    out: [&mut [f32]; TILE_POSITIONS],
) {
    const CHAIN: usize = 16;
    let w = qs[0].len();
    let full = w / CHAIN * CHAIN;
    let [q0, q1, q2, q3] = qs;
    let [o0, o1, o2, o3] = out;
    for (r, row) in rows.chunks_exact(w.max(1)).take(n_rows).enumerate() {
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0f32; CHAIN], [0f32; CHAIN], [0f32; CHAIN], [0f32; CHAIN]);
        fn c(v: &[f32], full: usize) -> &[[f32; CHAIN]] {
            v[..full].as_chunks::<CHAIN>().0
        }
        for ((((y, x0), x1), x2), x3) in c(row, full)
            .iter()
            .zip(c(q0, full))
            .zip(c(q1, full))
            .zip(c(q2, full))
            .zip(c(q3, full))
        {
            for j in 0..CHAIN {
                a0[j] += x0[j] * y[j];
                a1[j] += x1[j] * y[j];
                a2[j] += x2[j] * y[j];
                a3[j] += x3[j] * y[j];
            }
        }
        // By value (an accumulator whose address escaped kept the lane loop scalar), and a
        // function, not a closure, so that it inlines into the caller's target features.
        #[inline(always)]
        fn finish(mut a: [f32; CHAIN], q: &[f32], row: &[f32], full: usize) -> f32 {
            for (j, (x, y)) in q[full..].iter().zip(&row[full..]).enumerate() {
                a[j] += x * y;
            }
            reduce16_of(&mut a)
        }
        o0[r] = finish(a0, q0, row, full);
        o1[r] = finish(a1, q1, row, full);
        o2[r] = finish(a2, q2, row, full);
        o3[r] = finish(a3, q3, row, full);
    }
}

/// `COLS` columns per tile: every output's sum is over `d` in order whatever the tile.
#[inline(always)]
fn axpy_rows_body<const COLS: usize>(
    coef: &[f32],
    stride: usize,
    w: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    let n = out.len() / cols.max(1);
    let mut t0 = 0;
    while t0 < n {
        let tn = (n - t0).min(TILE_POSITIONS);
        let mut c0 = 0;
        while c0 < cols {
            let cw = (cols - c0).min(COLS);
            let mut acc = [[0f32; COLS]; TILE_POSITIONS];
            if tn == TILE_POSITIONS && cw == COLS {
                for d in 0..rows {
                    let wr = &w[d * cols + c0..d * cols + c0 + COLS];
                    for (t, a) in acc.iter_mut().enumerate() {
                        let k = coef[(t0 + t) * stride + d];
                        for j in 0..COLS {
                            a[j] += k * wr[j];
                        }
                    }
                }
            } else {
                for d in 0..rows {
                    let wr = &w[d * cols + c0..d * cols + c0 + cw];
                    for (t, a) in acc.iter_mut().enumerate().take(tn) {
                        let k = coef[(t0 + t) * stride + d];
                        for (a, &x) in a.iter_mut().zip(wr) {
                            *a += k * x;
                        }
                    }
                }
            }
            for (t, a) in acc.iter().enumerate().take(tn) {
                out[(t0 + t) * cols + c0..(t0 + t) * cols + c0 + cw].copy_from_slice(&a[..cw]);
            }
            c0 += cw;
        }
        t0 += tn;
    }
}

/// [`super::vector`]'s `dot_body` for `T` inputs at once: 64 lane accumulators each, whole
/// 64-blocks, then 16-blocks into the first 16 lanes, then single values into the first lanes,
/// then the same pairwise reduction. The whole blocks `Q` lanes at a time (every lane's
/// additions in the same order), so that `T * Q` accumulators fit the registers.
#[inline(always)]
fn dot_tile<const T: usize, const Q: usize>(row: &[f32], xs: [&[f32]; T]) -> [f32; T] {
    const LANES: usize = 64;
    const CHAIN: usize = 16;
    let len = row.len();
    let mut acc = [[0f32; LANES]; T];
    let whole = len / LANES * LANES;
    for q0 in (0..LANES).step_by(Q) {
        let mut part = [[0f32; Q]; T];
        let mut i = 0;
        while i < whole {
            let r = &row[i + q0..i + q0 + Q];
            for (a, x) in part.iter_mut().zip(&xs) {
                let x = &x[i + q0..i + q0 + Q];
                for j in 0..Q {
                    a[j] += r[j] * x[j];
                }
            }
            i += LANES;
        }
        for (a, p) in acc.iter_mut().zip(&part) {
            a[q0..q0 + Q].copy_from_slice(p);
        }
    }
    let mut i = whole;
    while i + CHAIN <= len {
        let r = &row[i..i + CHAIN];
        for (a, x) in acc.iter_mut().zip(&xs) {
            let x = &x[i..i + CHAIN];
            for j in 0..CHAIN {
                a[j] += r[j] * x[j];
            }
        }
        i += CHAIN;
    }
    for (a, x) in acc.iter_mut().zip(&xs) {
        for (j, k) in (i..len).enumerate() {
            a[j] += row[k] * x[k];
        }
    }
    let mut out = [0f32; T];
    for (o, a) in out.iter_mut().zip(acc.iter_mut()) {
        *o = reduce64(a);
    }
    out
}

#[inline(always)]
fn dot_many_body<const Q: usize>(
    row: &[f32],
    xs: &[f32],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let len = row.len();
    let x = |t: usize| &xs[t * len..(t + 1) * len];
    let mut t = 0;
    while t + TILE_POSITIONS <= n {
        let v = dot_tile::<TILE_POSITIONS, Q>(row, std::array::from_fn(|k| x(t + k)));
        for (k, v) in v.into_iter().enumerate() {
            out[(t + k) * out_stride] = v;
        }
        t += TILE_POSITIONS;
    }
    while t < n {
        out[t * out_stride] = dot_tile::<1, Q>(row, [x(t)])[0];
        t += 1;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f")]
    pub(super) fn dots4_avx512(
        qs: [&[f32]; super::TILE_POSITIONS],
        rows: &[f32],
        n_rows: usize,
        out: [&mut [f32]; super::TILE_POSITIONS],
    ) {
        super::dots4_body(qs, rows, n_rows, out)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn dots4_avx2(
        qs: [&[f32]; super::TILE_POSITIONS],
        rows: &[f32],
        n_rows: usize,
        out: [&mut [f32]; super::TILE_POSITIONS],
    ) {
        super::dots4_body(qs, rows, n_rows, out)
    }
    #[target_feature(enable = "avx512f")]
    pub(super) fn axpy_rows_avx512(
        coef: &[f32],
        stride: usize,
        w: &[f32],
        rows: usize,
        cols: usize,
        out: &mut [f32],
    ) {
        super::axpy_rows_body::<{ super::TILE_COLS_WIDE }>(coef, stride, w, rows, cols, out)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn axpy_rows_avx2(
        coef: &[f32],
        stride: usize,
        w: &[f32],
        rows: usize,
        cols: usize,
        out: &mut [f32],
    ) {
        super::axpy_rows_body::<{ super::TILE_COLS_NARROW }>(coef, stride, w, rows, cols, out)
    }
    #[target_feature(enable = "avx512f")]
    pub(super) fn dot_many_avx512(
        row: &[f32],
        xs: &[f32],
        n: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        super::dot_many_body::<{ super::TILE_COLS_WIDE }>(row, xs, n, out, out_stride)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn dot_many_avx2(
        row: &[f32],
        xs: &[f32],
        n: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        super::dot_many_body::<{ super::TILE_COLS_NARROW }>(row, xs, n, out, out_stride)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::vector::{axpy, dot};

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn xs_rows(n: usize, cols: usize) -> Vec<f32> {
        values(n * cols, 9)
    }

    /// The oracle is the one-at-a-time calls themselves: equal bits, tails of every kind.
    #[test]
    fn tiles_equal_one_call_at_a_time() {
        for (n, rows, cols) in [
            (1, 1, 1),
            (4, 16, 64),
            (7, 9, 200),
            (9, 64, 256),
            (5, 3, 17),
        ] {
            let stride = rows + 3;
            let coef = values(n * stride, 1);
            let w = values(rows * cols, 2);
            let mut got = vec![0f32; n * cols];
            axpy_rows(&coef, stride, &w, rows, cols, &mut got);
            let mut want = vec![0f32; n * cols];
            for (t, o) in want.chunks_mut(cols).enumerate() {
                for d in 0..rows {
                    axpy(o, coef[t * stride + d], &w[d * cols..(d + 1) * cols]);
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "axpy_rows n {n} rows {rows} cols {cols}"
            );

            let qs: Vec<Vec<f32>> = (0..TILE_POSITIONS)
                .map(|k| values(cols, 5 + k as u64))
                .collect();
            let mut got: Vec<Vec<f32>> = vec![vec![0f32; n]; TILE_POSITIONS];
            {
                let [a, b, c, d] = &mut got[..] else {
                    unreachable!()
                };
                let q = |k: usize| qs[k].as_slice();
                dots4([q(0), q(1), q(2), q(3)], &xs_rows(n, cols), n, [a, b, c, d]);
            }
            for (k, g) in got.iter().enumerate() {
                let mut want = vec![0f32; n];
                crate::kernels::vector::dots(&qs[k], &xs_rows(n, cols), &mut want);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(g), bits(&want), "dots4 query {k}, {n} rows of {cols}");
            }

            let row = values(cols, 3);
            let xs = values(n * cols, 4);
            let mut got = vec![0f32; 2 * n];
            dot_many(&row, &xs, n, &mut got, 2);
            for t in 0..n {
                let want = dot(&row, &xs[t * cols..(t + 1) * cols]);
                assert_eq!(
                    got[2 * t].to_bits(),
                    want.to_bits(),
                    "dot_many {t} of {n}, {cols}"
                );
            }
        }
    }
}
